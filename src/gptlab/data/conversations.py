"""`prepare --chat`: conversations in OpenAI's messages format -> token files, a loss mask and where each
conversation starts.

Each JSONL line is `{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}` ending with the
assistant's answer. A conversation is rendered by the chat tokenizer (tokenizer.ChatTokenizer): the ids, and for
each id whether training predicts it (the assistant's content and its end marker). A conversation longer than
`context` tokens is split at turn boundaries: each piece is the leading system messages followed by as many whole
exchanges (a user turn and the assistant's answers to it) as fit; an exchange that does not fit with the system
messages is refused, naming its file and line. Whole conversations, chosen at random by `seed`, are held out for
validation. Per split the folder holds SPLIT.bin (a token file), SPLIT.mask.npy (uint8, 1 where the id is a
trained target) and SPLIT.starts.npy (int64: where each piece starts, then the split's length); batches.py draws
rows that start at a piece's start. Everything is checked before anything is written, and the files are written
in a hidden folder beside the output and moved into place at the end, meta.json last.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.chat import check_messages
from gptlab.config import PrepareConfig
from gptlab.data.tokenfiles import VERSION, TokenWriter, token_dtype
from gptlab.errors import GptlabError
from gptlab.rundir import fsync_dir, write_atomic, write_json
from gptlab.tokenizer import ChatTokenizer, Tokenizer, train_tokenizer


@dataclass
class Conversation:
    where: str  # "FILE:LINE"
    messages: list[dict[str, str]]


def read_conversations(paths: list[str], least: int = 2) -> list[Conversation]:
    """Every conversation of the JSONL files named (folders: their *.jsonl files, sorted; a leading UTF-8
    byte-order mark dropped); GptlabError naming the file and line of the first bad one, or when there are fewer
    than `least`."""
    out = []
    for file in _files(paths):
        try:
            lines = file.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark dropped, as everywhere
        except UnicodeDecodeError:
            raise GptlabError(f"{file} is not UTF-8 text; give conversations as UTF-8 JSONL") from None
        except OSError as exc:
            raise GptlabError(f"cannot read {file}: {exc.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GptlabError(f"{where}: not a JSON object ({exc.msg}); give one conversation per line") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise GptlabError(f"{where}: a conversation is an object with \"messages\": [{{\"role\", "
                                  "\"content\"}, ...]")
            out.append(Conversation(where, check_messages(record["messages"], where, training=True)))
    if len(out) < least:
        raise GptlabError(f"{' '.join(paths)} hold{'s' * (len(paths) == 1)} {len(out)} conversation(s); "
                          f"{'training and validation need' if least > 1 else 'give'} at least {least}")
    return out


def _files(paths: list[str]) -> list[Path]:
    if not paths:
        raise GptlabError("prepare --chat needs the conversations: give JSONL files or folders of them")
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
            if not found:
                raise GptlabError(f"{path} holds no .jsonl files of conversations")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise GptlabError(f"{path} does not exist; give JSONL files or folders of them")
    return files


def chat_tokenizer(cfg: PrepareConfig, conversations: list[Conversation], fixed: Tokenizer | None) -> ChatTokenizer:
    """The tokenizer of `fixed` (--tokenizer-from) or a new one of cfg.tokenizer built from the messages' text, with
    the chat markers added."""
    if fixed is not None:
        return ChatTokenizer(fixed)
    texts = (m["content"] for c in conversations for m in c.messages)
    chunks = ["".join(texts)] if cfg.tokenizer == "char" else texts
    return ChatTokenizer(train_tokenizer(cfg.tokenizer, chunks, cfg.vocab_size))


def pieces(conversation: Conversation, tok: ChatTokenizer, context: int) -> list[tuple[list[int], list[bool]]]:
    """The conversation's (ids, trained) as one piece, or split at turn boundaries into pieces of at most `context`
    ids (see the module's rule); GptlabError naming its file and line when a turn cannot fit."""
    rendered = []
    for n, message in enumerate(conversation.messages, 1):
        try:
            rendered.append(tok.render([message]))
        except GptlabError as exc:
            raise GptlabError(f"{conversation.where}: message {n}: {exc}") from None
        if message["role"] == "assistant" and len(rendered[-1][0]) > context:
            raise GptlabError(f"{conversation.where}: message {n}, an assistant turn of {len(rendered[-1][0])} "
                              f"tokens, is longer than the context ({context}); raise --context or shorten it")
    if sum(len(ids) for ids, _ in rendered) <= context:
        return [_join(rendered)]
    messages = conversation.messages
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    groups, current = [], []  # exchanges: a new one starts at each message after an assistant turn
    for i in range(lead, len(messages)):
        if current and messages[i]["role"] != "assistant" and messages[i - 1]["role"] == "assistant":
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    head, out, body = rendered[:lead], [], []
    for group in groups:
        exchange = [rendered[i] for i in group]
        if _length(head + exchange) > context:
            raise GptlabError(f"{conversation.where}: the exchange from message {group[0] + 1} to {group[-1] + 1}"
                              f"{' with the system messages' if head else ''} is longer than the context "
                              f"({context}); raise --context or shorten it")
        if body and _length(head + body + exchange) > context:
            out.append(_join(head + body))
            body = []
        body += exchange
    out.append(_join(head + body))
    return out


def _length(parts: list[tuple[list[int], list[bool]]]) -> int:
    return sum(len(ids) for ids, _ in parts)


def _join(parts: list[tuple[list[int], list[bool]]]) -> tuple[list[int], list[bool]]:
    return [i for ids, _ in parts for i in ids], [t for _, trained in parts for t in trained]


def held_out(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which of `count` conversations are validation ones: round(count * fraction) of them (at least one, at most
    count - 1), chosen by `seed`."""
    n = min(max(1, round(count * fraction)), count - 1)
    held = np.zeros(count, dtype=bool)
    held[np.random.default_rng(seed).choice(count, n, replace=False)] = True
    return held


@dataclass
class Built:
    """Conversations rendered and split, ready to write: the tokenizer, each split's pieces, the metadata."""

    tokenizer: ChatTokenizer
    splits: dict[str, list[tuple[list[int], list[bool]]]]
    meta: dict[str, Any]


def build_chat(paths: list[str], cfg: PrepareConfig, fixed: Tokenizer | None) -> Built:
    """Read, check, tokenize and split the conversations of `paths` (validation: those of cfg.val, else whole
    conversations held out by cfg.val_fraction and cfg.seed); nothing is written. GptlabError on bad input."""
    train = read_conversations(paths)
    val = read_conversations(cfg.val, least=1) if cfg.val else []
    tok = chat_tokenizer(cfg, train + val, fixed)
    held = np.zeros(len(train), dtype=bool) if val else held_out(len(train), cfg.val_fraction, cfg.seed)
    splits: dict[str, list[tuple[list[int], list[bool]]]] = {"train": [], "val": []}
    for conversation, is_val in [(c, bool(h)) for c, h in zip(train, held)] + [(c, True) for c in val]:
        splits["val" if is_val else "train"] += pieces(conversation, tok, cfg.context)
    digest = hashlib.sha256(json.dumps([tok.to_dict(), cfg.context, cfg.chat_loss, [c.messages for c in train],
                                        [c.messages for c in val], held.tolist()]).encode()).hexdigest()
    counts = {"train": int((~held).sum()), "val": int(held.sum()) + len(val)}
    meta = {"format_version": VERSION, "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size).name, "split": "validation files" if val else "conversations",
            "val_fraction": None if val else cfg.val_fraction, "seed": cfg.seed, "documents": len(train) + len(val),
            "val_documents": counts["val"], "fingerprint": digest,
            "chat": {"context": cfg.context, "loss": cfg.chat_loss, "conversations": counts,
                     "pieces": {name: len(p) for name, p in splits.items()},
                     "longest": max(len(ids) for p in splits.values() for ids, _ in p)}}
    return Built(tok, splits, meta)


def write_chat(out: Path, built: Built) -> dict[str, Any]:
    """Write `built` into `out` (through a hidden folder beside it, meta.json moved last); returns the metadata."""
    staging = out.parent / f".{out.name}.chat-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    meta = {**built.meta, "shards": {}}
    meta["chat"]["files"] = {}
    for split, parts in built.splits.items():
        ids = np.fromiter((i for p, _ in parts for i in p), dtype=np.int64)
        trained = np.fromiter((t for _, m in parts for t in m), dtype=np.uint8, count=len(ids))
        if built.meta["chat"]["loss"] == "all":  # every id a lesson but each piece's first (nothing precedes it)
            trained[:] = 1
        starts = np.cumsum([0] + [len(p) for p, _ in parts], dtype=np.int64)  # ends with the split's length
        writer = TokenWriter(staging / f"{split}.bin", built.tokenizer.vocab_size)
        writer.write(ids)
        writer.close()
        meta["shards"][split] = [{"file": f"{split}.bin", "tokens": len(ids), "sha256": writer.sha.hexdigest()}]
        meta[f"{split}_tokens"], meta[f"{split}_sha256"] = len(ids), writer.sha.hexdigest()
        files = {}
        for kind, array in (("mask", trained), ("starts", starts)):
            blob = io.BytesIO()
            np.save(blob, array)
            write_atomic(staging / f"{split}.{kind}.npy", blob.getvalue())
            files[kind] = {"file": f"{split}.{kind}.npy", "sha256": hashlib.sha256(blob.getvalue()).hexdigest()}
        meta["chat"]["files"][split] = files
    built.tokenizer.save(staging / "tokenizer.json")
    write_json(staging / "meta.json", meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # from here until the end the folder is not prepared data
    for name in sorted(os.listdir(staging), key=lambda n: n == "meta.json"):
        os.replace(staging / name, out / name)
    fsync_dir(out)
    staging.rmdir()
    return meta


def load_chat_split(folder: Path, meta: dict[str, Any], split: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A chat split's (mask, starts) as written by `write_chat`; GptlabError when they are missing or do not fit the
    split's `length` tokens (a mask of `length` flags; starts: integers rising from 0 to `length`, no piece empty)."""
    files = meta["chat"]["files"][split]
    try:
        mask = np.load(folder / files["mask"]["file"], mmap_mode="r")
        starts = np.load(folder / files["starts"]["file"])
    except (OSError, ValueError, KeyError, TypeError):
        raise GptlabError(f"the {split} conversation files in {folder} are missing or damaged; run `gptlab prepare "
                          "--chat` again") from None
    if mask.ndim != 1 or starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer) or len(mask) != length \
            or len(starts) < 2 or starts[0] != 0 or starts[-1] != length or np.any(starts[1:] <= starts[:-1]):
        raise GptlabError(f"the {split} conversation files in {folder} do not match its token files; run `gptlab "
                          "prepare --chat` again")
    return mask, starts
