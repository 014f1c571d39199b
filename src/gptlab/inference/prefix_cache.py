"""The prompt pass and the exact prefix cache.

A prompt (a row's window) goes through the model's forward in chunks of `PROMPT_CHUNK` tokens, one chunk after
another over the row's KV cache, whether or not any of it is cached: so a chunk's keys and values are the same
numbers whichever request computed them, and a `PrefixCache` can hand one request the chunks another computed.

`PrefixCache` keeps the keys and values of whole chunks, keyed by the exact tokens from the window's first one to the
chunk's last (each block's key is its parent block and its own tokens: no hashing, no collisions), evicted least
recently used under a budget of bytes. A hit copies the blocks into the row's cache (but for those it holds from its
last prompt pass: a running batch passes its prompts through one cache) and the prompt pass goes on
from the first chunk not cached; the last token of a window is always computed (its logits are the next token's),
so at most the whole chunks before it are reused. Only the prompt pass makes blocks: keys and values written by the
decode step round differently, so a chat's next turn puts the last reply through the prompt pass again. Logits,
log-probabilities and text with the cache are therefore bit for bit those without it (tests/test_prefix_cache.py).

A cache belongs to one model and one cache dtype (`PrefixCache.check`): it never serves blocks of another run or
another precision.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.model import KVCache

PROMPT_CHUNK = 64  # tokens per forward of the prompt pass, and per cached block


@dataclass
class CacheStats:
    """What a PrefixCache did so far: prompt tokens looked up and of those served from blocks, the bytes held now
    and the budget, the blocks held now and how many were evicted."""

    lookup_tokens: int = 0
    hit_tokens: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    blocks: int = 0
    evictions: int = 0


@dataclass(eq=False)
class _Block:
    k: torch.Tensor  # (n_layer, H, chunk, D): one chunk's keys, every layer and head
    v: torch.Tensor
    key: tuple  # (parent block's id, this chunk's tokens)
    id: int

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PrefixCache:
    """Blocks of keys and values of whole prompt chunks, for one model and cache dtype, under `budget_bytes`
    (0: nothing is kept, every lookup misses)."""

    def __init__(self, budget_bytes: int, chunk: int = PROMPT_CHUNK):
        if budget_bytes < 0:
            raise GptlabError(f"the prefix cache's budget must be >= 0 MB, not {budget_bytes / 2 ** 20:g}")
        self.budget, self.chunk = budget_bytes, chunk
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()  # least recently used first
        self._next_id = 1  # 0 is the root: the parent of every window's first chunk
        self._owner: tuple | None = None
        self._held = 0  # bytes of the blocks held
        self._stats = CacheStats(budget_bytes=budget_bytes)
        # a one-row cache -> the ids of the blocks its chunks 0, 1, ... hold (the prompt pass's, copied or kept):
        # a cache used again for a prompt pass skips copying a block it holds already
        self._resident: weakref.WeakKeyDictionary[KVCache, list[int]] = weakref.WeakKeyDictionary()

    @classmethod
    def of_mb(cls, mb: float) -> PrefixCache | None:
        """The cache of a `--prefix-cache-mb` budget: None for 0 (no cache), GptlabError below 0."""
        if mb < 0:
            raise GptlabError(f"--prefix-cache-mb must be >= 0, not {mb:g}; 0 turns the cache off")
        return cls(int(mb * 2 ** 20)) if mb else None

    def check(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Bind the cache to `model` and `dtype` on first use; GptlabError for any other later."""
        owner = (model, dtype)
        if self._owner is None:
            self._owner = owner
        elif self._owner[0] is not model or self._owner[1] != dtype:
            raise GptlabError("this prefix cache holds another model's keys and values (or another precision's); "
                              "give each model its own")

    def stats(self) -> CacheStats:
        return CacheStats(**{**self._stats.__dict__, "bytes": self._held, "blocks": len(self._blocks)})

    def lookup(self, tokens: Sequence[int], usable: int) -> list[_Block]:
        """The cached blocks of the longest run of whole chunks of `tokens` from its start, at most `usable`
        chunks; counted in the stats over len(tokens) tokens looked up."""
        found: list[_Block] = []
        parent = 0
        for i in range(usable):
            block = self._blocks.get((parent, tuple(tokens[i * self.chunk:(i + 1) * self.chunk])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        self._stats.lookup_tokens += len(tokens)
        self._stats.hit_tokens += len(found) * self.chunk
        self._touch(found)
        return found

    def copy_in(self, found: Sequence[_Block], cache: KVCache) -> None:
        """Put `found`'s blocks (a lookup's) in chunks 0, 1, ... of the one-row `cache`, but for those it holds."""
        held = self._resident.get(cache, [])
        for i, block in enumerate(found):
            if i >= len(held) or held[i] != block.id:
                cache.k[:, 0, :, i * self.chunk:(i + 1) * self.chunk] = block.k
                cache.v[:, 0, :, i * self.chunk:(i + 1) * self.chunk] = block.v

    def insert(self, tokens: Sequence[int], cache: KVCache, row: int, start: int, end: int) -> None:
        """Keep chunks start..end-1 of `tokens` (whole chunks, computed by the prompt pass) from row `row` of
        `cache`; chunks before `start` must be cached already (looked up just before). The chunks of a one-row
        `cache` are then known to hold the blocks kept (`copy_in`)."""
        chain, parent = [], 0
        for i in range(end):
            key = (parent, tuple(tokens[i * self.chunk:(i + 1) * self.chunk]))
            block = self._blocks.get(key)
            if block is None and i >= start and self.budget:
                lo, hi = i * self.chunk, (i + 1) * self.chunk
                block = _Block(cache.k[:, row, :, lo:hi].clone(), cache.v[:, row, :, lo:hi].clone(), key,
                               self._next_id)
                block = self._add(block, chain)
            if block is None:
                break  # over the budget with the chain kept: the rest has no parent to hang from
            chain.append(block)
            parent = block.id
        self._touch(chain)
        if len(cache.pos) == 1:
            self._resident[cache] = [block.id for block in chain]

    def _add(self, block: _Block, chain: list[_Block]) -> _Block | None:
        """Keep `block` (whose parent is the last of `chain`, the blocks of its window before it), evicting least
        recently used blocks outside the chain to make room; None, nothing evicted, where the chain and the block
        do not fit the budget."""
        if sum(b.nbytes for b in chain) + block.nbytes > self.budget:
            return None
        self._evict(self.budget - block.nbytes, keep={b.id for b in chain})
        self._next_id += 1
        self._blocks[block.key] = block
        self._held += block.nbytes
        return block

    def _evict(self, room: int, keep: set[int]) -> None:
        """Drop least recently used blocks, never those in `keep` (the chain a block is being added to), until the
        rest take at most `room` bytes. A block is always used more recently than its descendants (`_touch`), so
        they go before it; were one left behind, no lookup could reach it (its parent's id is never given again)
        and it would go in its turn."""
        for key in list(self._blocks):
            if self._held <= room:
                return
            block = self._blocks[key]
            if block.id not in keep:
                del self._blocks[key]
                self._held -= block.nbytes
                self._stats.evictions += 1

    def _touch(self, chain: list[_Block]) -> None:
        """Mark a chain used, its last block first: a parent stays more recently used than its children, so
        eviction takes leaves first."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)


def prompt_pass(model: torch.nn.Module, cache: KVCache, tokens: Sequence[int], prefix: PrefixCache | None,
                logits: str = "last") -> tuple[torch.Tensor | None, int]:
    """Fill row 0 of the one-row `cache` with `tokens` through the model's forward, PROMPT_CHUNK tokens at a time,
    reusing `prefix`'s blocks of the whole chunks before the last token and keeping the chunks computed. The cache
    may have been through a prompt pass before: what it held is written over or never read (its position is set),
    and blocks it holds already are not copied again (`PrefixCache.copy_in`).
    `logits`: "last" (the last position's (1, V)), "all" (every position's (T, V): no block is reused, so every
    position is computed; the chunks are still kept) or "none". Returns (logits, tokens served from the cache)."""
    chunk = prefix.chunk if prefix is not None else PROMPT_CHUNK
    T, device = len(tokens), cache.pos.device
    usable = 0 if logits == "all" else (T if logits == "none" else T - 1) // chunk
    found = prefix.lookup(tokens, usable) if prefix is not None and usable else []
    if found:
        prefix.copy_in(found, cache)
    cache.pos[0] = len(found) * chunk
    outs = []
    for lo in range(len(found) * chunk, T, chunk):
        ids = torch.tensor([list(tokens[lo:lo + chunk])], dtype=torch.long, device=device)
        head = logits == "all" or (logits == "last" and lo + chunk >= T)  # the LM head only where logits are kept
        out, _ = model(ids, kv_cache=cache, last_only=logits != "all", head=head)
        if head:
            outs.append(out[0])
    if prefix is not None:
        prefix.insert(tokens, cache, 0, len(found), T // chunk)
    hit = len(found) * chunk
    if logits == "none":
        return None, hit
    return (torch.cat(outs) if logits == "all" else outs[-1]), hit
