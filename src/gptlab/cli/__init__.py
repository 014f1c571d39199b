"""The `gptlab` command: it only parses and prints. Every verb is one entry of COMMANDS, made by `@command(name,
help)` over a function that turns its flags into typed values, calls one library function and prints the result;
its flags come from the function `add_NAME` beside it, in the same module: verbs.py (prepare, train, sample, eval,
runs, compare, info), chat_verbs.py (chat), hf_verbs.py (import, export), inspect_verbs.py (inspect), serve_verbs.py
(serve) and bench_verbs.py (bench); common.py holds the registry and the flags generated from config.py, and this
module `main`. Policy lives in the library (runs.py: presets, overrides,
resumes, run folders; evaluate.py: scoring), so a Python caller gets what a command does.

Flags for model, training and sampling settings are generated from the dataclasses in config.py, with their help
texts and choices, so the CLI, config files and Python callers share one definition. Errors a user can cause print
one line and exit 2.
"""

from __future__ import annotations

import logging
import sys

from gptlab.cli import (
    bench_verbs,  # noqa: F401
    inspect_verbs,  # noqa: F401
    reference_verbs,  # noqa: F401
    serve_verbs,  # noqa: F401
    verbs,  # noqa: F401  (each import registers its verbs; --help lists them in this order)
)
from gptlab.cli import chat_verbs  # noqa: F401, I001  (chat after verbs' info in --help)
from gptlab.cli import hf_verbs  # noqa: F401, I001  (import and export after verbs' info in --help)
from gptlab.cli.bench_verbs import BENCHES  # noqa: F401  (tests list the bench verbs)
from gptlab.cli.common import COMMANDS, Parser
from gptlab.errors import GptlabError

# ---- main --------------------------------------------------------------------------------------------------------

def make_parser() -> Parser:
    from gptlab import __version__

    parser = Parser(prog="gptlab", description="Build, train, run and look inside GPT-2-style language models.")
    parser.add_argument("--version", action="version", version=f"gptlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (fn, help) in COMMANDS.items():
        add_flags = getattr(sys.modules[fn.__module__], f"add_{name}")
        add_flags(sub.add_parser(name, help=help, description=help))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="gptlab: warning: %(message)s", level=logging.WARNING)
    parser = make_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["--"]:  # `torchrun -m gptlab -- train ...` on Pythons whose argparse keeps the "--"
            argv = argv[1:]
        args = parser.parse_args(argv)
        args.argv = argv
        if not args.command:
            parser.print_help()
            return 2
        return COMMANDS[args.command][0](args)
    except GptlabError as exc:
        label = getattr(exc, "label", "error")
        print(f"gptlab: {label + ': ' if label else ''}{exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file-system refusal no check above anticipated: still one line, never a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"gptlab: error: {exc.strerror or exc}{where}; check the path, free space and permissions",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gptlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
