"""Constrained generation: output a program can rely on. A `Grammar` (a JSON schema, any JSON object, a regex or a
Lark grammar) is compiled once for a tokenizer by llguidance (chosen over xgrammar and outlines-core: the fastest
masks and compiles measured on MaskBench's 10,163 schemas, and whole forced runs as tokens); each constrained row
of a batch gets its own `Constraint`, which gives the row's mask of allowed tokens for every step, takes the
tokens the grammar forces without drawing them, and ends the row where the grammar is complete.

The order a constrained token is chosen in (sampling.next_token): logit_bias is added to the logits, then the
penalties, then the grammar's mask (-inf on every token it refuses), then temperature, top-k and top-p, then the
draw; greedy takes the most likely allowed token. A token the grammar forces is never drawn (it uses no random
number): the next token of a forced run (llguidance's fast-forward tokens: the grammar's forced bytes as the
tokenizer writes them), or the only token a mask allows. So a row's output is the same whether its forced run is
fed to the model in one multi-position step (the fused step's verify) or one token at a time.

JSON is written compactly (no whitespace between tokens: an untrained model's output stays within its budget).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "lark": "Lark grammar"}
JSON_OPTIONS = {"whitespace_flexible": False}  # "," and ":" with nothing around them
DIGITS = "0123456789"


class GrammarError(GptlabError):
    """A schema or grammar that cannot constrain this model's output: what is wrong, in one line."""


class _Vocabulary:
    """A tokenizer as llguidance reads it: every id's bytes (special tokens marked with 0xFF, as llguidance marks
    them), its end ids (end-of-text, a chat turn's end: where a complete grammar may stop) and an encoder that never
    raises (llguidance asks it to write forced text, which may hold characters a char vocabulary lacks: those are
    left out, and the mask refuses them)."""

    def __init__(self, tokenizer: Tokenizer):
        size = tokenizer.vocab_size
        special = set(tokenizer.end_ids)
        self.tokens = [b"\xff" + tokenizer.decode_bytes([i]) if i in special else tokenizer.decode_bytes([i])
                       for i in range(size)]
        if not special:  # no end id: one past the vocabulary, which the model never gives
            self.tokens.append(b"\xff<|end|>")
            special = {size}
        self.special_token_ids = sorted(special)
        self.eos_token_id = self.special_token_ids[0]
        self.bos_token_id = None
        self._tokenizer = tokenizer
        self._pieces = {t.decode("utf-8"): i for i, t in enumerate(self.tokens)
                        if not t.startswith(b"\xff") and _utf8(t) is not None}

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        try:
            return self._tokenizer.encode(text)
        except GptlabError:  # a character the vocabulary lacks: greedy over what it has
            return [self._pieces[c] for c in text if c in self._pieces]


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def lltokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, made once (its tables cost a moment at GPT-2's vocabulary) and kept on it. A
    tokenizer with no end id gets one past its vocabulary, which the model never gives: its rows end when the
    grammar is complete."""
    return _made(tokenizer)[0]


def _made(tokenizer: Tokenizer) -> tuple[llguidance.LLTokenizer, set[str]]:
    """llguidance's tokenizer and the characters the vocabulary writes, made once and kept on the tokenizer."""
    made = getattr(tokenizer, "_lltokenizer", None)
    if made is None:
        vocab = _Vocabulary(tokenizer)
        have: set[str] = set()
        for token in vocab.tokens:
            if not token.startswith(b"\xff"):
                have |= set(token.decode("utf-8", "ignore"))
        made = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), eos_token=vocab.special_token_ids), have
        tokenizer._lltokenizer = made
    return made


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint for one tokenizer: its kind (GRAMMAR_KINDS), llguidance's grammar, the vocabulary's size.
    Made by `compile_grammar`, shared by every row it constrains."""

    kind: str
    text: str
    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int
    ends: tuple[int, ...] = ()  # the tokenizer's end ids (end-of-text, a chat turn's end and markers)

    def start(self, fast_forward: bool = True) -> Constraint:
        return Constraint(self, fast_forward)


def compile_grammar(kind: str, source: Any, tokenizer: Tokenizer) -> Grammar:
    """`source` (a JSON schema as a dict or JSON text, None for json_object, a regex, a Lark grammar) compiled for
    `tokenizer`; GrammarError naming what is wrong with it, or the characters every output needs that the
    vocabulary lacks."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"the constraint's kind must be one of {', '.join(GRAMMAR_KINDS)}, not {kind!r}")
    schema = _schema(source) if kind == "json_schema" else {"type": "object"} if kind == "json_object" else None
    if schema is not None:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif not isinstance(source, str) or not source:
        raise GrammarError(f"the {NAMES[kind]} must be a non-empty string")
    else:
        text = (llguidance.LLMatcher.grammar_from_regex if kind == "regex" else
                llguidance.LLMatcher.grammar_from_lark)(source)
    lltok = lltokenizer(tokenizer)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, lltok)
    if failed:
        raise GrammarError(f"the {NAMES[kind]} is not valid: {_one_line(messages[0])}")
    grammar = Grammar(kind, text, lltok, tokenizer.vocab_size, tuple(sorted(tokenizer.end_ids)))
    _check_vocabulary(grammar, schema, tokenizer)
    return grammar


def _schema(source: Any) -> dict:
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(source, dict):
        raise GrammarError(f"a JSON schema must be a JSON object, not {type(source).__name__}")
    return source


def _one_line(message: str) -> str:
    return " ".join(message.split())


# ---- characters a vocabulary must have ---------------------------------------------------------------------------

def _check_vocabulary(grammar: Grammar, schema: dict | None, tokenizer: Tokenizer) -> None:
    """GrammarError when every output needs a character the vocabulary cannot write: the JSON schema's (its
    structure, required keys, digits of numbers, the words true/false/null), and any grammar's first token."""
    have = _made(tokenizer)[1]
    matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
    forced = matcher.compute_ff_bytes().decode("utf-8", "ignore")  # (asked first: an empty mask ends the matcher)
    missing = sorted((_missing(schema, have) if schema is not None else set()) | set(forced) - have)
    bits = _bits(matcher.compute_bitmask(), grammar.vocab_size)
    if not missing and _stuck(bits, int(np.count_nonzero(bits)), matcher, grammar.ends):
        missing = ["its first character"]
    if missing:
        shown = ", ".join(json.dumps(c) if len(c) == 1 else c for c in missing)
        raise GrammarError(f"every output of this {NAMES[grammar.kind]} needs characters the model's "
                           f"vocabulary lacks: {shown}; use a model whose tokenizer writes them")


def _missing(schema: Any, have: set[str]) -> set[str]:
    """Characters outside `have` that every JSON instance of `schema` holds (what the schema alone tells: its
    structure, required keys, digits of numbers, the words true / false / null, the values of an enum or const);
    where alternatives are given (enum, anyOf / oneOf, a list of types), nothing where one of them is writable,
    else the fewest one of them lacks."""
    if not isinstance(schema, dict):
        return set()
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options:
        return _fewest([set(json.dumps(o, separators=(",", ":"), ensure_ascii=False)) - have for o in options])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _fewest([_missing(s, have) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return _fewest([_missing({**schema, "type": k}, have) for k in kind])
    return _missing_of_type(kind, schema, have)


def _fewest(alternatives: list[set[str]]) -> set[str]:
    """Of alternatives' missing characters: none where one lacks none, else the smallest set."""
    return min(alternatives, key=len) if alternatives else set()


def _missing_of_type(kind: Any, schema: dict, have: set[str]) -> set[str]:
    if kind == "object":
        out = set("{}")
        required = [k for k in schema.get("required", []) if isinstance(k, str)]
        properties = schema.get("properties", {})
        for key in required:
            out |= {'"', ":"} | set(key) | _missing(properties.get(key) if isinstance(properties, dict) else None,
                                                  have)
        return (out | ({","} if len(required) > 1 else set())) - have
    if kind == "array":
        out, least = set("[]"), schema.get("minItems", 0)
        if isinstance(least, int) and least > 0:
            out |= _missing(schema.get("items"), have) | ({","} if least > 1 else set())
        return out - have
    if kind == "string":
        return {'"'} - have
    if kind in ("integer", "number"):
        return set() if have & set(DIGITS) else {"a digit"}
    if kind == "boolean":
        return _fewest([set("true") - have, set("false") - have])
    if kind == "null":
        return set("null") - have
    return set()


def _stuck(bits: np.ndarray, count: int, matcher: llguidance.LLMatcher, ends: tuple[int, ...]) -> bool:
    """Whether a mask leaves the row nowhere to go: no token at all, or only end tokens where the grammar is not
    complete (llguidance allows the end where nothing else can follow, so that generation stops)."""
    return not count or (count == int(bits[list(ends)].sum()) and not matcher.is_accepting())


def _bits(bitmask: bytes, vocab_size: int) -> np.ndarray:
    """llguidance's mask (one bit per id, least significant first) as a bool array (vocab_size,)."""
    return np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)


# ---- one row's constraint ----------------------------------------------------------------------------------------

class DeadEnd(GptlabError):
    """A constrained row that can go no further: its grammar allows no token the model has."""


class Constraint:
    """One row's state in its grammar. `forced()`: the token the grammar forces next (None where the row draws);
    `allowed()`: the mask (vocab_size,) of the tokens it may draw; `consume(token)` moves on; `finished` once the
    grammar is complete and allows nothing more. `fast_forward` False: the grammar's forced runs are not taken (the
    row draws every token under the mask; only a mask of one token forces it)."""

    def __init__(self, grammar: Grammar, fast_forward: bool):
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.fast_forward = fast_forward
        self.queue: deque[int] = deque()  # the rest of the forced run the row is in
        self.taken: list[int] = []  # the tokens consumed (a dead end replays them to name what was needed)
        self._mask: torch.Tensor | None = None
        self._dead: DeadEnd | None = None
        self._only: int | None = None  # the one token the mask allows, where it allows one
        self._refill()

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def allowed(self) -> torch.Tensor:
        """The tokens the row may take next (vocab_size,) bool; DeadEnd where there are none."""
        if self._dead is not None:
            raise self._dead
        if self._mask is None:
            if self.matcher.is_error():
                raise DeadEnd(f"the constraint failed: {_one_line(self.matcher.get_error())}")
            bits = _bits(self.matcher.compute_bitmask(), self.grammar.vocab_size)
            self._mask = torch.from_numpy(bits)
            count = int(np.count_nonzero(bits))
            self._only = int(np.flatnonzero(bits)[0]) if count == 1 else None
            if _stuck(bits, count, self.matcher, self.grammar.ends):
                replay = llguidance.LLMatcher(self.grammar.tokenizer, self.grammar.text, log_level=0)
                replay.consume_tokens(self.taken)
                text = _one_line(replay.compute_ff_bytes().decode("utf-8", "replace"))
                raise DeadEnd("the constraint allows no token this model has next" +
                              (f" (it needs {text!r})" if text else "") + "; use a model whose vocabulary writes it")
        return self._mask

    @property
    def mask_ready(self) -> bool:
        """Whether the next mask is computed (by `prefetch` during a step, or by a row that asked for it)."""
        return self._mask is not None

    def prefetch(self) -> None:
        """Compute the next mask now (the engine calls it on a worker thread while the model runs: llguidance lets
        go of the GIL); a dead end is raised when the row asks for the mask."""
        if self.queue or self._mask is not None or self.finished:
            return
        try:
            self.allowed()
        except DeadEnd as exc:
            self._dead = exc

    def forced(self) -> int | None:
        """The next token of the row's forced run, or the only token its mask allows; None where it draws."""
        if self.queue:
            return self.queue[0]
        self.allowed()
        return self._only

    def consume(self, token: int) -> None:
        """The row took `token` (forced or drawn under the mask)."""
        if self.queue and self.queue[0] == token:
            self.queue.popleft()
        else:
            self.queue.clear()
        self.taken.append(token)
        if not self.matcher.consume_token(token):
            raise DeadEnd(f"the constraint refused token {token}: {_one_line(self.matcher.get_error())}")
        self._mask = None
        if not self.queue:
            self._refill()

    def _refill(self) -> None:
        if self.fast_forward and not self.matcher.is_stopped():
            self.queue.extend(self.matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a speculative proposal) the grammar accepts from here, in order."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0
