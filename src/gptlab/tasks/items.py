"""Benchmark task files: JSONL records read into items of three kinds, each a set of (context, continuation) options
of which one is right.

- multiple choice: one context, several continuations (HellaSwag's own records: `ctx_a`, `ctx_b`,
  `activity_label`, `endings`, `label`, with lm-evaluation-harness's HellaSwag preprocessing, and kept as llm.c
  reads them too, for acc_token_mean; or the plain form `{"context", "choices", "label"}`);
- schema: several contexts, one continuation (Winograd-style: `{"contexts", "continuation", "label"}`);
- language modelling: one context, one continuation, right only if greedy decoding reproduces it (LAMBADA-style:
  `{"context", "continuation"}`).

A continuation follows its context after one space (the harness's default target delimiter). Every record of a
file is of one kind; a bad record is refused with its file and line.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path

from gptlab.errors import GptlabError

MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELLING = "multiple choice", "schema", "language modelling"
DELIMITER = " "  # between a context and its continuation
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")


@dataclass(frozen=True)
class Item:
    kind: str
    contexts: tuple[str, ...]  # one (multiple choice, language modelling) or several (schema)
    continuations: tuple[str, ...]  # several (multiple choice) or one
    label: int  # the right option: a continuation (multiple choice), a context (schema); 0 for language modelling
    line: int  # where the record is in its file
    llmc: tuple[str, tuple[str, ...]] | None = None  # a HellaSwag record as llm.c reads it: its `ctx`, its endings

    @property
    def options(self) -> list[tuple[str, str]]:
        """(context, continuation) per option, the continuation with its delimiter in front."""
        if self.kind == SCHEMA:
            return [(c, DELIMITER + self.continuations[0]) for c in self.contexts]
        return [(self.contexts[0], DELIMITER + c) for c in self.continuations]

    @property
    def option_texts(self) -> list[str]:
        """What tells the options apart, without the delimiter: its length in characters is acc_norm's divisor."""
        return list(self.contexts) if self.kind == SCHEMA else list(self.continuations)

    def worked_example(self) -> str:
        """The item with its right answer, as a few-shot example."""
        context, continuation = self.options[self.label]
        return context + continuation


def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's HellaSwag cleaning: WikiHow's "[title]" becomes ". ", other [tags] go, double
    spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def read_task(path: str | Path) -> list[Item]:
    """Every item of a JSONL task file (a leading UTF-8 byte-order mark dropped, blank lines skipped). GptlabError
    naming the file and line for bytes that are not UTF-8, a line that is not a JSON object, a record of no known
    form or of another kind than the first, a missing or empty field, or a label out of range; and for a file with
    no items."""
    path = Path(path)
    try:
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # the one rule for text (corpus.text_decoder)
        lines = data.decode("utf-8").splitlines()
    except OSError as exc:
        raise GptlabError(f"cannot read task file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise GptlabError(f"{path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); save the file as "
                          "UTF-8") from None
    items: list[Item] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        item = _item(text, number, f"{path}:{number}")
        if items and item.kind != items[0].kind:
            raise GptlabError(f"{path}:{number}: a {item.kind} record in a file of {items[0].kind} records; "
                              "keep one kind per file")
        items.append(item)
    if not items:
        raise GptlabError(f"{path} holds no task records")
    return items


def _item(text: str, line: int, where: str) -> Item:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GptlabError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise GptlabError(f"{where}: a record must be a JSON object")
    if all(key in record for key in HELLASWAG_FIELDS):
        ctx_a, ctx_b = _text(record, "ctx_a", where), _text(record, "ctx_b", where, empty=True)
        context = hellaswag_preprocess(f"{_text(record, 'activity_label', where)}: {ctx_a} {ctx_b.capitalize()}")
        endings = _texts(record, "endings", where)
        # llm.c's context is the record's own `ctx`: HellaSwag's ctx_a, then a space and ctx_b where ctx_b is not empty
        raw = _text(record, "ctx", where) if "ctx" in record else f"{ctx_a} {ctx_b}" if ctx_b else ctx_a
        return _checked(Item(MULTIPLE_CHOICE, (context,), tuple(hellaswag_preprocess(e) for e in endings),
                             _label(record, where), line, (raw, tuple(endings))), where)
    if "choices" in record:
        return _checked(Item(MULTIPLE_CHOICE, (_text(record, "context", where),),
                             tuple(_texts(record, "choices", where)), _label(record, where), line), where)
    if "contexts" in record:
        return _checked(Item(SCHEMA, tuple(_texts(record, "contexts", where)),
                             (_text(record, "continuation", where),), _label(record, where), line), where)
    if "context" in record and "continuation" in record:
        return Item(LANGUAGE_MODELLING, (_text(record, "context", where),),
                    (_text(record, "continuation", where),), 0, line)
    raise GptlabError(f"{where}: not a task record: expected HellaSwag's fields ({', '.join(HELLASWAG_FIELDS)}), "
                      '{"context", "choices", "label"}, {"contexts", "continuation", "label"} or '
                      '{"context", "continuation"}')


def _text(record: dict, key: str, where: str, empty: bool = False) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise GptlabError(f"{where}: field {key!r} must be a string" + ("" if key in record else ", and is missing"))
    if not empty and not value.strip():
        raise GptlabError(f"{where}: field {key!r} is empty")
    return value


def _texts(record: dict, key: str, where: str) -> list[str]:
    values = record.get(key)
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, str) for v in values):
        raise GptlabError(f"{where}: field {key!r} must be a list of at least 2 strings")
    for i, value in enumerate(values):
        if not value.strip():
            raise GptlabError(f"{where}: {key}[{i}] is empty")
    return values


def _label(record: dict, where: str) -> int:
    label = record.get("label")
    if isinstance(label, str) and label.strip().isdigit():  # HellaSwag's labels are strings: "3"
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        raise GptlabError(f"{where}: field 'label' must be the index of the right option, an integer")
    return label


def _checked(item: Item, where: str) -> Item:
    n = len(item.option_texts)
    if not 0 <= item.label < n:
        raise GptlabError(f"{where}: label {item.label} is out of range for {n} options (0 to {n - 1})")
    return item
