"""The `gptlab serve` verb: a run behind an OpenAI-compatible HTTP API (gptlab.serve)."""

from __future__ import annotations

import argparse
import sys

from gptlab.cli.common import add_device, command
from gptlab.config import INFERENCE_PRECISIONS

LIMIT_FLAGS = {  # flag -> (Limits field, type, help); the defaults come from Limits itself
    "--max-tokens": ("max_tokens", int, "most tokens one request may generate (max_tokens) (default %(default)s)"),
    "--max-n": ("max_n", int, "most completions per prompt in one request (n) (default %(default)s)"),
    "--max-prompt-tokens": ("max_prompt_tokens", int, "longest prompt in tokens (default %(default)s: the model's context)"),
    "--max-body-bytes": ("max_body_bytes", int, "largest request body; larger ones get 413 (default %(default)s)"),
    "--max-batch": ("max_batch", int, "most sequences decoded together (continuous batching) (default %(default)s)"),
    "--queue": ("queue", int, "most requests waiting for a place in the batch; more get 429 (default %(default)s)"),
    "--prefix-cache-mb": ("prefix_cache_mb", float, "keep prompts' keys and values (whole chunks) up to this many MB "
                          "and reuse them for prompts that start alike; answers are bit for bit the same; 0 turns "
                          "it off (default %(default)s)"),
    "--speculate": ("speculate", str, "auto: propose tokens from n-grams already in the prompt and the output and "
                    "check them in one step (the same answers, sooner where text repeats; on the fused CPU step); "
                    "off (default %(default)s)"),
    "--grace": ("grace", float, "seconds in-flight requests get to finish after SIGTERM / Ctrl-C (default %(default)s)"),
}


@command("serve", "serve a run over HTTP: OpenAI-compatible /v1/completions (and /v1/chat/completions for a run "
                  "with a chat template) with continuous batching, a playground at /")
def cmd_serve(args: argparse.Namespace) -> int:
    from gptlab.checkpoint import read_run_config
    from gptlab.inference.loading import bf16_storage_possible
    from gptlab.runs import latest_run
    from gptlab.runtime import resolve_device, resolve_precision, set_threads
    from gptlab.serve.api import Limits
    from gptlab.serve.server import check_bind, listen, load_served, serve_run
    from gptlab.tokenizer import ChatTokenizer

    limits = Limits(**{name: getattr(args, name) for name, _, _ in LIMIT_FLAGS.values()},
                    accept_any_model=args.accept_any_model)
    check_bind(args.host, args.port, args.api_key)
    set_threads()
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device, bf16_storage_possible(device))
    run = args.run or latest_run()
    read_run_config(run)  # a folder that is not a run is refused before the port is taken
    sock = listen(args.host, args.port)
    try:
        served = load_served(run, precision, device)
        port = sock.getsockname()[1]
        shown = "localhost" if args.host in ("127.0.0.1", "::1") else args.host
        chat = " and /v1/chat/completions" if isinstance(served.tokenizer, ChatTokenizer) else ""
        name = f'the model "{served.name}"' + (" (or any name)" if limits.accept_any_model else "")
        print(f"gptlab: serving {run} as {name} at http://{shown}:{port} (playground at /, API at "
              f"/v1/completions{chat}); Ctrl-C stops", file=sys.stderr)
        serve_run(served, sock, limits, args.api_key)
    finally:
        sock.close()
    return 0


def add_serve(p: argparse.ArgumentParser) -> None:
    from gptlab.serve.api import Limits

    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine "
                   "only; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API (needed off loopback)")
    p.add_argument("--accept-any-model", action="store_true", help="answer a request's \"model\" whatever name it "
                   "gives, for clients that hard-code one (default: only the run folder's name, as /v1/models lists "
                   "it, or none; any other is 404 model_not_found)")
    add_device(p)
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto",
                   help="inference weights, as in `gptlab sample` (default auto)")
    defaults = Limits()
    group = p.add_argument_group("limits")
    for flag, (name, kind, help) in LIMIT_FLAGS.items():
        group.add_argument(flag, dest=name, type=kind, default=getattr(defaults, name), help=help)
