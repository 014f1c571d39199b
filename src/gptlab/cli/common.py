"""What every verb module of the CLI shares: the registry of verbs, the one-line-error parser, the flags generated
from config.py's dataclasses, and small helpers."""


from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.config import DEVICES, PREFIX_CACHE_MB, field_help, field_types, parse_value
from gptlab.errors import GptlabError

RunVerb = Callable[[argparse.Namespace], int]  # a verb: its parsed arguments -> the exit code
AddFlags = Callable[[argparse.ArgumentParser], None]  # a verb's flags, added to its parser
COMMANDS: dict[str, tuple[RunVerb, str]] = {}  # name -> (function, help); its flags: the module's add_NAME
class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise GptlabError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """Refuse what is left over here, in the verb's own parser (argparse leaves a verb's unknown flags to the
        top-level parser, whose message would point to `gptlab --help`)."""
        parsed, rest = super().parse_known_args(args, namespace)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        return parsed, rest


class Verbs(argparse._SubParsersAction):
    """add_subparsers' action whose commands get their flags when one is used, from the function given to
    add_parser as `flags`: `gptlab --help` and `gptlab train ...` build no other command's flags (some read their
    defaults from modules that import torch)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending: dict[str, AddFlags] = {}  # name -> the function that adds its flags, until it is used

    def add_parser(self, name: str, flags: AddFlags | None = None, **kwargs: Any) -> argparse.ArgumentParser:
        parser = super().add_parser(name, **kwargs)
        if flags is not None:
            self.pending[name] = flags
        return parser

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        add = self.pending.pop(values[0], None)
        if add is not None:
            add(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def command(name: str, help: str):
    """Register the verb `name`; its flags are added by the function add_NAME of the module that defines it."""
    def register(fn):
        COMMANDS[name] = (fn, help)
        return fn
    return register


class Subcommands(dict):
    """A verb's subcommands (`gptlab bench peak`, `gptlab inspect lens`): name -> (add its flags, run, help).
    Used as a decorator, `@SUBCOMMANDS(name, help, add_flags)`, over the function that runs one."""

    def __init__(self, dest: str, metavar: str):
        super().__init__()
        self.dest, self.metavar = dest, metavar

    def __call__(self, name: str, help: str, add: AddFlags | None) -> Callable[[RunVerb], RunVerb]:
        def register(fn):
            self[name] = (add, fn, help)
            return fn
        return register

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest=self.dest, metavar=self.metavar, required=True, parser_class=Parser,
                                    action=Verbs)
        for name, (add, _, help) in self.items():
            sub.add_parser(name, help=help, description=help, flags=add)

    def run(self, args: argparse.Namespace) -> int:
        return self[getattr(args, self.dest)][1](args)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str, defaults: bool = False) -> None:
    """One --flag per dataclass field, with the field's help, choices and metavar. Without `defaults` (train,
    sample) values stay None unless given, so the preset (or the run being resumed, or a config file) fills the
    rest, and `overrides` parses them; a true-or-false field takes an optional value. With `defaults` (prepare,
    whose settings have no preset) each flag starts at its field's default, said in its help, argparse parses
    integers and numbers, and a true-or-false field is a switch."""
    group = parser.add_argument_group(title)
    instance = cls() if defaults else None
    for name, kind in field_types(cls).items():
        flag, (text, choices, metavar) = "--" + name.replace("_", "-"), field_help(cls)[name]
        default = getattr(instance, name) if instance is not None else None
        if default is not None and not isinstance(default, bool) and default not in ("", []) and "(default" not in text:
            text = f"{text} (default {default})"
        if kind is bool and defaults:
            group.add_argument(flag, dest=name, action="store_true", help=text)
        elif kind is bool:
            group.add_argument(flag, dest=name, nargs="?", const="true", default=None, metavar="BOOL",
                               help=f"{text} (true / false; the flag alone: true)")
        elif not isinstance(kind, type):  # list[str]: the flag repeated
            group.add_argument(flag, dest=name, action="append", default=None, metavar=metavar, help=text)
        else:
            typed = {"type": kind} if defaults and kind in (int, float) else {}
            group.add_argument(flag, dest=name, default=default, choices=choices, help=text,
                               metavar=metavar or (None if choices else kind.__name__.upper()), **typed)


def overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line (or have a default there), as values of their
    types: text parsed (parse_value), what argparse has typed already as it is."""
    out = {}
    for name in field_types(cls):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = parse_value(cls, name, value) if isinstance(value, str) else value
    return out


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: auto picks cuda, then mps, then cpu (default auto)")


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """\\n, \\t, \\r and \\\\ as a shell passes them in `--stop "\\n\\n"` -> the characters they name."""
    import re

    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), text)


def announce(loaded) -> None:
    """Say on stderr which run and checkpoint a command picked (stdout stays the command's output)."""
    ckpt = loaded.checkpoint
    print(f"gptlab: using {ckpt.path} ({ckpt.kind} checkpoint, step {ckpt.step})", file=sys.stderr)


def at_least(args: argparse.Namespace, **minimums: int) -> None:
    """Refuse a numeric flag below its minimum, naming the flag."""
    for name, low in minimums.items():
        if getattr(args, name) < low:
            raise GptlabError(f"--{name.replace('_', '-')} must be >= {low}, not {getattr(args, name)}")


def add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    """--prefix-cache-mb: the exact prefix cache's budget (chat, serve)."""
    p.add_argument("--prefix-cache-mb", type=float, default=PREFIX_CACHE_MB, metavar="MB",
                   help="keep the keys and values of prompts' whole chunks up to this many MB and reuse them for "
                        "prompts that start alike (a conversation's earlier turns, a shared system prompt); the "
                        f"output is bit for bit the same as without; 0 turns it off (default {PREFIX_CACHE_MB})")


def prefix_cache(mb: float):
    """The PrefixCache of a --prefix-cache-mb (None for 0)."""
    from gptlab.inference.prefix_cache import PrefixCache

    return PrefixCache.of_mb(mb)


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """--json-schema, --regex, --grammar: the output obeys a grammar (sample, chat)."""
    group = p.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid for this JSON schema (compact: "
                       "no whitespace between tokens); it ends where the JSON is complete")
    group.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    group.add_argument("--grammar", metavar="FILE", help="the output is a sentence of this Lark grammar (llguidance's "
                       "dialect: `start: ...`, /regex/ terminals, %%json {...} for JSON)")


def constraint(args: argparse.Namespace, tokenizer):
    """The Steer of --json-schema / --regex / --grammar compiled for `tokenizer` (None where none is given);
    GptlabError (one line) for a file that cannot be read or a schema or grammar that cannot be used."""
    from gptlab.inference.grammar import compile_grammar
    from gptlab.inference.rows import Steer

    for flag, kind, is_file in (("json_schema", "json_schema", True), ("regex", "regex", False),
                                ("grammar", "lark", True)):
        value = getattr(args, flag, None)
        if value is None:
            continue
        if is_file:
            try:
                value = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise GptlabError(f"--{flag.replace('_', '-')}: cannot read {value}: "
                                  f"{getattr(exc, 'strerror', None) or exc}") from None
        return Steer(grammar=compile_grammar(kind, value, tokenizer))
    return None
