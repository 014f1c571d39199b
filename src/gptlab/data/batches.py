"""Batches of (x, y) windows from a prepared data folder.

Batches are windows of block_size + 1 tokens cut at random offsets: x is the first block_size, y the same shifted by
one, so each window holds block_size next-token lessons. The offsets are a pure function of (seed, step, micro-step,
rank), which makes training reproducible and resumable without storing the sampler. Conversations (`prepare --chat`)
are cut differently: each window starts where a conversation (or a piece of one) starts, and y is -1 (no lesson)
wherever the target is not the assistant's or belongs to a conversation the window cuts off. An evaluation of a small
split reads it once instead (pass_batches): each target in one row, in order.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.data.conversations import load_chat_split
from gptlab.data.tokenfiles import ShardedTokens, read_split
from gptlab.errors import GptlabError
from gptlab.tokenizer import Tokenizer
from gptlab.tokenizer import load as load_tokenizer


@dataclass
class Dataset:
    """A prepared data folder: the two splits, the tokenizer and the metadata."""

    path: Path
    train: np.ndarray | ShardedTokens
    val: np.ndarray | ShardedTokens
    tokenizer: Tokenizer
    meta: dict[str, Any]
    chat: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # conversations: each split's (mask, starts)

    def split(self, name: str) -> np.ndarray | ShardedTokens:
        return self.train if name == "train" else self.val

    def fingerprint(self) -> str:
        """sha256 of the metadata, which holds the sha256 of both token files: changes whenever the data does."""
        return hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode()).hexdigest()


def not_prepared(path: Path) -> GptlabError:
    """The refusal of `path` as --data when it is not a prepared folder (no meta.json), with the prepare command
    that makes one from its text (nanoGPT's input.txt where the folder has one) into a folder of its own under
    data/, never into `path` itself."""
    if not path.exists():
        return GptlabError(f"{path} does not exist; give --data a folder made by `gptlab prepare TEXT --out "
                           "data/NAME`")
    source = path / "input.txt" if (path / "input.txt").is_file() else path
    name = (path.stem if path.is_file() else path.resolve().name) or "corpus"
    out = Path("data") / name
    if out.resolve() == path.resolve() or out.exists():
        out = Path("data") / f"{name}-gptlab"
    return GptlabError(f"{path} is not a prepared data folder (no meta.json); make one from its text with "
                       f"`gptlab prepare {shlex.quote(str(source))} --out {shlex.quote(str(out))}` and train with "
                       f"--data {shlex.quote(str(out))}")


def load_dataset(data_dir: str | Path) -> Dataset:
    """The prepared data in `data_dir`; raises GptlabError when it is missing or damaged."""
    path = Path(data_dir)
    if not (path / "meta.json").is_file():
        raise not_prepared(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"{path / 'meta.json'} is damaged; run `gptlab prepare` again") from None
    if not isinstance(meta, dict):
        raise GptlabError(f"{path / 'meta.json'} is damaged; run `gptlab prepare` again")
    train, val = read_split(path, meta, "train"), read_split(path, meta, "val")
    if (meta.get("train_tokens"), meta.get("val_tokens")) != (len(train), len(val)):
        raise GptlabError(f"the token files in {path} do not match its meta.json ({len(train)} / {len(val)} tokens, "
                          f"meta.json says {meta.get('train_tokens')} / {meta.get('val_tokens')}); run `gptlab "
                          "prepare` again")
    chat = {split: load_chat_split(path, meta, split, len(tokens)) for split, tokens in
            (("train", train), ("val", val))} if isinstance(meta.get("chat"), dict) else None
    return Dataset(path, train, val, load_tokenizer(path / "tokenizer.json"), meta, chat)


def draw_batch(dataset: Dataset, split: str, batch_size: int, block_size: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the split: random windows (get_batch), or for conversations rows from their starts
    (get_chat_batch)."""
    if dataset.chat is None:
        return get_batch(dataset.split(split), batch_size, block_size, generator)
    return get_chat_batch(dataset.split(split), *dataset.chat[split], batch_size, block_size, generator)


def get_chat_batch(tokens: np.ndarray | ShardedTokens, mask: np.ndarray, starts: np.ndarray, batch_size: int,
                   block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` rows of block_size + 1 ids, each from the start of a random piece of conversation on (padded
    past the split's end): x (B, T), and y (B, T) the next ids where they are trained targets (the mask's 1s) of
    pieces wholly inside the row, else -1."""
    tokens = np.asarray(tokens)
    length = len(tokens)
    picked = starts[torch.randint(len(starts) - 1, (batch_size,), generator=generator).numpy()]
    at = picked[:, None] + np.arange(block_size + 1)  # (B, T+1) positions in the split
    inside = np.minimum(at, length - 1)
    window = np.where(at < length, tokens[inside], 0).astype(np.int64)  # past the end: padding, never a target
    last = np.searchsorted(starts, picked + block_size + 1, side="right") - 1
    whole = at < starts[last][:, None]  # inside the pieces that end within the row
    trained = whole & (mask[inside] == 1)
    y = np.where(trained[:, 1:], window[:, 1:], -1)
    return torch.from_numpy(window[:, :-1]), torch.from_numpy(y)


def pass_rows(dataset: Dataset, split: str, block_size: int) -> int:
    """How many rows one pass over the split takes (see pass_batches), told without reading it."""
    if dataset.chat is not None:
        return len(dataset.chat[split][1]) - 1
    return -(-(len(dataset.split(split)) - 1) // block_size)


def pass_batches(dataset: Dataset, split: str, batch_size: int,
                 block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pass over the split in batches of `batch_size` rows (x, y), each target in exactly one row: rows of
    block_size + 1 ids overlapping by one (for conversations: a row from each piece's start, with that piece's
    targets alone), y -1 past the split's end and in the rows that pad the last batch. The whole split is read: for
    small splits (an evaluation that would otherwise draw more rows than this)."""
    if dataset.chat is None:
        ids = np.asarray(dataset.split(split)).astype(np.int64)
        at = np.arange(0, len(ids) - 1, block_size)[:, None] + np.arange(block_size + 1)  # (R, T+1) positions
        window = np.where(at < len(ids), ids[np.minimum(at, len(ids) - 1)], -1)
        x, y = np.maximum(window[:, :-1], 0), window[:, 1:]
    else:
        x, y = _chat_pass(np.asarray(dataset.split(split)), *dataset.chat[split], block_size)
    pad = -len(x) % batch_size
    x = np.concatenate([x, np.zeros((pad, block_size), dtype=np.int64)])
    y = np.concatenate([y, np.full((pad, block_size), -1, dtype=np.int64)])
    return [(torch.from_numpy(x[i:i + batch_size]), torch.from_numpy(y[i:i + batch_size]))
            for i in range(0, len(x), batch_size)]


def _chat_pass(tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray,
               block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A row from each piece's start (padded past the split's end), trained targets of that piece alone."""
    at = starts[:-1, None] + np.arange(block_size + 1)  # (R, T+1) positions in the split
    inside = np.minimum(at, len(tokens) - 1)
    window = np.where(at < len(tokens), tokens[inside], 0).astype(np.int64)
    own = (at < starts[1:, None]) & (mask[inside] == 1)
    return window[:, :-1], np.where(own[:, 1:], window[:, 1:], -1)


def batch_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A generator seeded from (seed, step, micro-step, rank) alone: any batch can be redrawn at any time."""
    mixed = int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{micro}/{rank}".encode(), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)


def get_batch(tokens: np.ndarray | ShardedTokens, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows: x (B, T) and y (B, T) = x shifted left by one, as int64."""
    if len(tokens) < block_size + 1:
        raise GptlabError(f"the split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                          "use a longer corpus or a smaller --block-size")
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator).numpy()
    if isinstance(tokens, ShardedTokens):  # the same windows as one file would give: shards are one stream
        windows = torch.from_numpy(tokens.windows(starts, block_size + 1).astype(np.int64))  # (B, T+1)
    else:
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
