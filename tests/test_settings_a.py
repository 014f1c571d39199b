"""Settings run at a non-default value through the command line (issue 42's boundary rule, tests/boundaries.toml):
one tiny `train` with a dozen flags off their defaults, replayed step by step by a plain torch loop written here
(torch's AdamW, clip_grad_norm_, the cosine schedule worked out by hand); a LoRA run on it, merged as W + alpha/r B A;
`sample` against the plain forward's greedy ids with the penalty by hand; `inspect attention`'s one map against the
attention equation written out; `serve`'s limits, key, address and grace as the app and the socket then hold them;
`bench chat`'s task and run sizes in what it keeps; `bench generate --char-tokens`; `train --max-restarts` in the
torchrun command."""

import json
import math
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from helpers import CORPUS, reference_continuation, run_ok
from gptlab.checkpoint import load_run
from gptlab.cli import main
from gptlab.config import SampleConfig
from gptlab.data.batches import load_dataset
from gptlab.model import GPT

LR, MIN_LR, BETAS, CLIP, DECAY, STEPS, B, T, ACCUM, EVALS = 0.02, 0.002, (0.7, 0.9), 0.05, 6, 4, 3, 16, 2, 3
FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", str(T), "--batch-size", str(B),
         "--grad-accum", str(ACCUM), "--max-steps", str(STEPS), "--lr", str(LR), "--min-lr", str(MIN_LR),
         "--warmup-steps", "0", "--lr-decay-steps", str(DECAY), "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
         "--grad-clip", str(CLIP), "--weight-decay", "0", "--dropout", "0", "--optimizer", "adamw",
         "--eval-interval", "1", "--eval-batches", str(EVALS), "--log-interval", "1", "--keep-last", "3",
         "--precision", "fp32", "--device", "cpu", "--quiet"]


@pytest.fixture(autouse=True)
def torch_decoding(monkeypatch):
    """Decode with torch ops: building the fused step (tens of seconds, once a session) is no setting's doing, and
    its equality with the torch forward is tests/test_fused.py's."""
    from gptlab.inference import fused

    monkeypatch.setattr(fused, "load_library", lambda: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained by the CLI with FLAGS, every forward with targets recorded (training or not, x, y) and the
    weights before the first step: (root, run, calls, initial)."""
    root = tmp_path_factory.mktemp("settings-a")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    calls, initial, forward = [], {}, GPT.forward

    def spy(self, idx, targets=None, **kwargs):
        if targets is not None:
            if not initial:
                initial.update({k: v.detach().clone() for k, v in self.state_dict().items()})
            calls.append((self.training, idx.clone(), targets.clone()))
        return forward(self, idx, targets, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "forward", spy)
        assert main(["train", "--data", str(root / "data"), "--run", str(root / "run"), *FLAGS]) == 0
    return root, root / "run", calls, initial


def hand_lr(step):
    """The cosine from LR to MIN_LR over DECAY steps, no warm-up."""
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * step / DECAY)) * (LR - MIN_LR)


def mean_loss(model, pairs):
    return sum(F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()) for x, y in pairs) / len(pairs)


def replay(run, calls, initial):
    """The run's steps by hand on the batches it drew: per step (loss, norm before clipping, val loss), and the
    model after the last step (None where the run made other forwards than FLAGS ask for)."""
    model = GPT(load_run(run).model_cfg)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0)
    train = [(x, y) for training, x, y in calls if training]
    evals = [(x, y) for training, x, y in calls if not training]
    if (len(train), len(evals)) != (STEPS * ACCUM, STEPS * 2 * EVALS):
        return None  # not the forwards asked for: the tests say which
    out = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = hand_lr(step)
        model.train()
        loss = mean_loss(model, train[ACCUM * step:ACCUM * (step + 1)])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():  # each evaluation: EVALS batches of train, then EVALS of val
            val = mean_loss(model, evals[2 * EVALS * step + EVALS:2 * EVALS * (step + 1)])
        out.append((loss.item(), norm.item(), val.item()))
    return out, model


@pytest.fixture(scope="module")
def replayed(trained):
    _, run, calls, initial = trained
    return replay(run, calls, initial)


def rows(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_train_steps_as_a_hand_written_adamw_loop_on_the_batches_asked_for(trained, replayed):
    """--batch-size 3 and --block-size 16 rows of the --data folder's train split, --grad-accum 2 micro-batches a
    step for --max-steps 4, clipped to --grad-clip 0.05 (it bites), torch's AdamW at --lr 0.02 with --beta1 0.7
    --beta2 0.9 on a cosine over --lr-decay-steps 6: each step's loss and norm, and the weights after step 4."""
    root, run, calls, _ = trained
    train = [(x, y) for training, x, y in calls if training]
    assert len(train) == STEPS * ACCUM and all(x.shape == y.shape == (B, T) for x, y in train)
    tokens = np.asarray(load_dataset(root / "data").train).astype(np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, T + 1)
    for x, y in train:
        for row in torch.cat([x, y[:, -1:]], 1).numpy():
            assert (windows == row).all(1).any()  # a window of the train split, y its next tokens
    assert torch.equal(train[0][1][:, :-1], train[0][0][:, 1:])
    assert replayed is not None, "the run's evaluations are not those FLAGS ask for"
    steps, model = replayed
    logged = rows(run, "train")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for (loss, norm, _), row, step in zip(steps, logged, range(STEPS)):
        assert row["loss"] == pytest.approx(loss, rel=1e-5) and row["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert norm > 2 * CLIP and row["lr"] == pytest.approx(hand_lr(step), rel=1e-9)
    saved = load_file(run / "checkpoints" / "step-00000004" / "model.safetensors")
    mine = model.state_dict()
    for name, tensor in saved.items():
        assert (tensor - mine[name]).abs().max().item() <= 2e-5, name


def test_train_evaluates_logs_and_keeps_checkpoints_as_asked(trained, replayed):
    """--eval-interval 1: an evaluation every step, each of --eval-batches 3 batches a split (its val loss the hand
    loop's); --log-interval 1: a train row every step; --keep-last 3: the newest three step checkpoints."""
    _, run, calls, _ = trained
    assert sum(not training for training, _, _ in calls) == STEPS * 2 * EVALS
    assert replayed is not None, "the run's training steps are not those FLAGS ask for"
    steps, _ = replayed
    evaluated = rows(run, "eval")
    assert [r["step"] for r in evaluated] == [1, 2, 3, 4] and [r["step"] for r in rows(run, "train")] == [1, 2, 3, 4]
    for (_, _, val), row in zip(steps, evaluated):
        assert row["val_loss"] == pytest.approx(val, rel=1e-5)
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000002", "step-00000003", "step-00000004"]


def test_lora_flags_adapt_the_layers_named_at_the_rank_and_scale_asked_for(trained, tmp_path):
    """--init-from the run, --lora-rank 3 --lora-alpha 6 --lora-targets c_fc,attn.c_proj --lora-dropout 0.25: the
    frozen weights are the run's, A is 3 wide on exactly those layers, and the merged weight is W + (6/3) B A."""
    root, base, _, _ = trained
    assert main(["train", "--init-from", str(base), "--data", str(root / "data"), "--run", str(tmp_path / "lo"),
                 "--lora-rank", "3", "--lora-alpha", "6", "--lora-targets", "c_fc,attn.c_proj", "--lora-dropout",
                 "0.25", "--max-steps", "1", "--lr", "0.05", "--warmup-steps", "0", "--batch-size", "3",
                 "--eval-interval", "1", "--eval-batches", "1", "--precision", "fp32", "--device", "cpu",
                 "--quiet"]) == 0
    frozen = load_run(base).model.state_dict()
    adapted = load_run(tmp_path / "lo", merge=False).model
    merged = load_run(tmp_path / "lo").model.state_dict()
    layers = {n: m for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert sorted(layers) == [f"transformer.h.{i}.{kind}" for i in (0, 1) for kind in ("attn.c_proj", "mlp.c_fc")]
    for name, layer in layers.items():
        a, b = layer.lora_A.weight, layer.lora_B.weight
        assert a.shape == (3, layer.in_features) and b.shape == (layer.out_features, 3) and b.abs().max() > 0
        assert layer.lora_dropout.p == 0.25
        assert torch.equal(layer.weight, frozen[f"{name}.weight"])
        want = frozen[f"{name}.weight"] + 2.0 * (b @ a)
        assert (merged[f"{name}.weight"] - want).abs().max().item() <= 1e-6, name
    for name, tensor in frozen.items():
        if not any(name.startswith(layer) for layer in layers):
            assert torch.equal(merged[name], tensor), name


def test_sample_reads_the_prompt_file_in_its_encoding_and_penalises_as_the_plain_forward(trained, tmp_path, capsys):
    """--prompt-file in UTF-16 with --encoding utf-16, --max-new-tokens 9, --frequency-penalty 1.5, greedy: the
    plain forward's greedy ids with the penalty worked by hand (reference_continuation), which the penalty
    changed."""
    _, run, _, _ = trained
    (tmp_path / "prompt.txt").write_bytes("All:\nSpeak".encode("utf-16"))
    out = run_ok(capsys, "sample", "--run", str(run), "--prompt-file", str(tmp_path / "prompt.txt"), "--encoding",
                 "utf-16", "--max-new-tokens", "9", "--frequency-penalty", "1.5", "--temperature", "0",
                 "--precision", "fp32", "--device", "cpu", "--no-echo")
    loaded = load_run(run)
    prompt = loaded.tokenizer.encode("All:\nSpeak")
    penalised = reference_continuation(loaded.model, prompt, SampleConfig(max_new_tokens=9, temperature=0,
                                                                          frequency_penalty=1.5))
    plain = reference_continuation(loaded.model, prompt, SampleConfig(max_new_tokens=9, temperature=0))
    assert penalised != plain and len(penalised) == 9
    assert out.removesuffix("\n") == loaded.tokenizer.decode(penalised)


def test_inspect_attention_draws_the_one_map_of_the_layer_and_head_asked_for(trained, tmp_path, capsys,
                                                                              monkeypatch):
    """--layer 1 --head 0: one map, softmax(q k^T / sqrt(d)) under the causal mask of layer 1's head 0, q and k
    worked out here from that block's input."""
    from matplotlib.axes import Axes

    _, run, _, _ = trained
    drawn, imshow = [], Axes.imshow
    monkeypatch.setattr(Axes, "imshow", lambda self, x, *a, **k: drawn.append(np.asarray(x)) or imshow(self, x, *a,
                                                                                                         **k))
    out = run_ok(capsys, "inspect", "attention", "--run", str(run), "--prompt", "All: Sp", "--layer", "1", "--head",
                 "0", "--out", str(tmp_path))
    assert out.strip() == str(tmp_path / "attention-layer1-head0.png")
    loaded = load_run(run)
    ids = torch.tensor([loaded.tokenizer.encode("All: Sp")])
    block, seen = loaded.model.transformer.h[1], []
    handle = block.attn.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    with torch.no_grad():
        loaded.model(ids)
        handle.remove()
        C, D = 16, 8
        q, k, _ = block.attn.c_attn(seen[0]).split(C, dim=2)
        q, k = (t.view(1, 7, 2, D).transpose(1, 2)[0, 0] for t in (q, k))
        scores = (q @ k.T / math.sqrt(D)).masked_fill(torch.ones(7, 7).triu(1).bool(), float("-inf"))
    (picture,) = drawn
    assert picture.shape == (7, 7) and np.abs(picture - torch.softmax(scores, -1).numpy()).max() <= 1e-5


def test_serve_flags_reach_the_app_and_the_socket_and_each_limit_holds_at_its_value(trained, monkeypatch,
                                                                                      capsys):
    """--host 127.0.0.2 --api-key k3y --max-tokens 6 --max-n 2 --max-prompt-tokens 5 --max-body-bytes 400
    --max-batch 3: the socket is bound there; without the key 401; a request without max_tokens gets 6 tokens
    (OpenAI's 16 is over the limit), 7 is refused; n 3 is refused; a prompt of 6 characters (6 tokens) is over the
    context asked for, 5 are taken; a body of 400 bytes is read, 401 are 413; 4 sequences are more than the batch."""
    from gptlab.serve import server
    from gptlab.serve.app import make_app

    _, run, _, _ = trained
    seen = {}
    monkeypatch.setattr(server, "serve_run", lambda served, sock, limits, key: seen.update(
        served=served, address=sock.getsockname(), limits=limits, key=key))
    run_ok(capsys, "serve", "--run", str(run), "--host", "127.0.0.2", "--port", "0", "--api-key", "k3y",
           "--max-tokens", "6", "--max-n", "2", "--max-prompt-tokens", "5", "--max-body-bytes", "400",
           "--max-batch", "3", "--precision", "fp32", "--device", "cpu")
    assert seen["address"][0] == "127.0.0.2"
    key = {"Authorization": "Bearer k3y"}
    with TestClient(make_app(seen["served"], seen["limits"], seen["key"])) as http:
        def post(body, headers=key):
            reply = http.post("/v1/completions", json=body, headers=headers)
            return reply.status_code, reply.json()

        assert post({"prompt": "All:"}, {})[0] == 401
        status, body = post({"prompt": "All:", "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 6
        assert post({"prompt": "All:", "max_tokens": 7})[1]["error"]["param"] == "max_tokens"
        assert post({"prompt": "All:", "n": 2, "max_tokens": 1})[0] == 200
        assert post({"prompt": "All:", "n": 3, "max_tokens": 1})[1]["error"]["param"] == "n"
        assert post({"prompt": "All: ", "max_tokens": 1})[0] == 200
        assert post({"prompt": "All: S", "max_tokens": 1})[1]["error"]["code"] == "context_length_exceeded"
        raw = b'{"prompt": "All:", "max_tokens": 1}'
        sizes = [http.post("/v1/completions", content=raw.ljust(n), headers={**key, "Content-Type":
                                                                               "application/json"}).status_code
                 for n in (400, 401)]  # JSON padded with spaces to exactly n bytes
        assert sizes == [200, 413]
        status, body = post({"prompt": ["A", "l", "l", ":"], "max_tokens": 1})
        assert status == 400 and "--max-batch" in body["error"]["message"]
        assert post({"prompt": ["A", "l", "l"], "max_tokens": 1})[0] == 200


def stream_then_stop(url: str, box: dict) -> None:
    """When the server answers: a long streamed request; at its first event SIGTERM to this process (the server's
    handler); then read the rest, noting when the signal went and when the stream ended. A server that never
    answered gets no signal (without its handler, SIGTERM would end the test run)."""
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=5)
                box["up"] = True
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        body = {"prompt": "All:", "max_tokens": 100000, "stream": True, "n": 2, "temperature": 1.0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            box["signalled"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            box["rest"] = list(lines)
            box["ended"] = time.monotonic()
    finally:
        if "signalled" not in box and box.get("up"):  # the request failed: stop the server all the same
            os.kill(os.getpid(), signal.SIGTERM)


def test_serve_gives_in_flight_requests_the_grace_asked_for_then_cancels_them(trained, capsys):
    """--grace 1: a request that would run for minutes is cancelled, and told so, about 1 s after SIGTERM (the
    default 10 s would run past the bound)."""
    _, run, _, _ = trained
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    box = {}
    client = threading.Thread(target=stream_then_stop, args=(f"http://127.0.0.1:{port}", box), daemon=True)
    client.start()
    assert main(["serve", "--run", str(run), "--port", str(port), "--grace", "1", "--max-tokens", "100000",
                 "--precision", "fp32", "--device", "cpu"]) == 0
    client.join(30)
    events = [json.loads(line[6:]) for line in box["rest"] if line.startswith("data: {")]
    assert events[-1]["error"]["message"] == "the server is shutting down"
    assert 0.9 <= box["ended"] - box["signalled"] < 5


def test_bench_chat_makes_the_task_and_the_runs_it_is_asked_for_and_keeps_them(tmp_path, monkeypatch, capsys):
    """--alphabet xyz --max-len 3 (--min-len 1): every word of x, y, z, 1 to 3 letters, the longest among them;
    --held 4 distinct held-out words never trained; --base-steps 2, --batch-size 4, --lr 0.01: the runs' own
    settings and steps; --keep: all of it left in the folder."""
    from gptlab.bench import chat_finetune

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Reverse the word.\nThe quick brown fox jumps over a lazy dog; what a cat said: no.\n" * 40)
    real = chat_finetune.pretrain_base
    monkeypatch.setattr(chat_finetune, "pretrain_base", lambda folder, s, _=None: real(folder, s, [str(corpus)]))
    kept = tmp_path / "kept"
    run_ok(capsys, "bench", "chat", "--alphabet", "xyz", "--min-len", "1", "--max-len", "3", "--train", "20",
           "--held", "4", "--base-steps", "2", "--steps", "1", "--batch-size", "4", "--lr", "0.01", "--n-layer", "1",
           "--n-head", "1", "--n-embd", "8", "--keep", str(kept))
    read = [[json.loads(line) for line in (kept / f).read_text().splitlines()]
            for f in ("conversations.jsonl", "held-out.jsonl")]
    words = [[m["content"].removeprefix("reverse: ") for c in part for m in c["messages"] if m["role"] == "user"]
             for part in read]
    assert len(words[0]) == 20 and len(words[1]) == len(set(words[1])) == 4 and not set(words[0]) & set(words[1])
    assert all(set(w) <= set("xyz") and 1 <= len(w) <= 3 for w in words[0] + words[1])
    assert max(map(len, words[0] + words[1])) == 3
    config = {run: json.loads((kept / run / "config.json").read_text())["train"] for run in
              ("base", "sft-all", "sft-assistant")}
    assert (config["base"]["max_steps"], config["base"]["batch_size"]) == (2, 4)
    assert all((config[r]["max_steps"], config[r]["lr"], config[r]["batch_size"]) == (1, 0.01, 4)
               for r in ("sft-all", "sft-assistant"))
    base_rows = [json.loads(line) for line in (kept / "base" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in base_rows) == 2


def test_bench_generate_times_the_char_model_over_the_tokens_asked_for(monkeypatch, capsys):
    """--char-tokens 7 reaches the bench, and the char model's timed runs (cached, then not) each generate 7
    tokens after a 2-token warm-up; --char-tokens 0 is handed on as 0 (skip it)."""
    from gptlab.bench import engines, generate
    from gptlab.bench.sliding import char_model_speedup

    asked = []
    monkeypatch.setattr(generate, "run_generate", lambda **kw: asked.append(kw["char_tokens"]))
    for n in ("7", "0"):
        run_ok(capsys, "bench", "generate", "--char-tokens", n, "--device", "cpu")
    assert asked == [7, 0]
    made = []  # the char-small model's code path at a tenth of its width: seconds less on a busy machine
    monkeypatch.setitem(engines.GEN_MODELS, "char-small", {**engines.GEN_MODELS["char-small"], "n_layer": 1,
                                                          "n_head": 2, "n_embd": 16})
    for name in ("generate_batch", "generate_uncached"):
        real = getattr(engines, name)
        monkeypatch.setattr(engines, name, lambda *a, _real=real, **k: made.append(list(_real(*a, **k))) or made[-1])
    char_model_speedup(torch.device("cpu"), asked[0], 4)
    assert [len(steps) for steps in made] == [2, 7, 7]


def test_max_restarts_is_handed_to_torchrun(trained, tmp_path, monkeypatch, capsys):
    """--nproc 2 --max-restarts 3: torchrun is started with --max_restarts=3 (it restarts the processes, which then
    resume: test_distributed)."""
    from gptlab.distributed import processes

    commands, real = [], subprocess.run
    monkeypatch.setattr(processes.subprocess, "run", lambda command, *a, **k: commands.append(command) or
                        subprocess.CompletedProcess(command, 0) if "torch.distributed.run" in command else
                        real(command, *a, **k))
    root, _, _, _ = trained
    run_ok(capsys, "train", "--data", str(root / "data"), "--run", str(tmp_path / "two"), "--nproc", "2",
           "--max-restarts", "3", "--max-steps", "2", "--batch-size", "4", "--quiet")
    (command,) = commands
    assert "--max_restarts=3" in command and "--nproc_per_node=2" in command
