"""The `gptlab` command: it only parses and prints. Every verb is one entry of COMMANDS, made by `@command(name,
help)` over a function that turns its flags into typed values, calls one library function and prints the result;
its flags come from the function `add_NAME` beside it, in the same module: verbs.py (prepare, train, sample, eval,
runs, compare, info), chat_verbs.py (chat), hf_verbs.py (import, export), inspect_verbs.py (inspect), serve_verbs.py
(serve), bench_verbs.py (bench) and generate_verbs.py (bench generate); common.py holds the registry and the flags
generated from config.py, and this module `main`. Policy lives in the library (runs.py: presets, overrides,
resumes, run folders; evaluate.py: scoring), so a Python caller gets what a command does.

Flags for model, training and sampling settings are generated from the dataclasses in config.py, with their help
texts and choices, so the CLI, config files and Python callers share one definition. Errors a user can cause print
one line and exit 2; Ctrl-C at any moment, imports included, stops a command with one line and exit 130 (train
first finishes its step and says how to resume).

Starting is cheap: the verb modules import the library (and torch) inside their functions, and a verb's flags are
added only when that verb is used (common.Verbs), so `gptlab --help` and a refused argument never import torch,
nor does a verb's --help (but serve's and bench chat's, whose defaults live beside the code that runs them).
"""

from __future__ import annotations

import signal
import sys
import threading

# Nothing else is imported with this package: the verb modules, and the library modules they import inside their
# functions, are imported by main, so that Ctrl-C during those imports is main's to report in one line.

# ---- main --------------------------------------------------------------------------------------------------------

def make_parser():
    """The `gptlab` parser: every verb of COMMANDS, in the order their modules register them; a verb's flags are
    added when it is used (see common.Verbs)."""
    from gptlab import __version__
    from gptlab.cli import (
        bench_verbs,  # noqa: F401
        generate_verbs,  # noqa: F401
        inspect_verbs,  # noqa: F401
        reference_verbs,  # noqa: F401
        serve_verbs,  # noqa: F401
        verbs,  # noqa: F401  (each import registers its verbs; --help lists them in this order)
    )
    from gptlab.cli import chat_verbs  # noqa: F401, I001  (chat after verbs' info in --help)
    from gptlab.cli import hf_verbs  # noqa: F401, I001  (import and export after verbs' info in --help)
    from gptlab.cli.common import COMMANDS, Parser, Verbs

    parser = Parser(prog="gptlab", description="Build, train, run and look inside GPT-2-style language models.")
    parser.add_argument("--version", action="version", version=f"gptlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, action=Verbs)
    for name, (fn, help) in COMMANDS.items():
        sub.add_parser(name, help=help, description=help, flags=getattr(sys.modules[fn.__module__], f"add_{name}"))
    return parser


def __getattr__(name: str):
    """BENCHES (the bench verbs, which tests list), from its module on first use."""
    if name == "BENCHES":
        from gptlab.cli.bench_verbs import BENCHES

        return BENCHES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """`gptlab ARGV` (default: the command line's): the exit status. Ctrl-C at any moment, imports included, ends it
    with one line and status 130, also where SIGINT came ignored (a shell starts background jobs so, and Python then
    leaves it ignored; the ignored state is restored after)."""
    ignored = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    try:
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return _command(argv)
    except KeyboardInterrupt as exc:  # its message, where one is given, says what was kept (a stopped prepare's)
        print(f"gptlab: interrupted{f': {exc}' if exc.args else ''}", file=sys.stderr)
        return 130
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _command(argv: list[str] | None) -> int:
    """Parse `argv` and run its verb; a refusal (GptlabError, an unanticipated OSError) is one line on stderr."""
    import logging

    from gptlab.errors import GptlabError

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
        from gptlab.cli.common import COMMANDS

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


if __name__ == "__main__":
    sys.exit(main())
