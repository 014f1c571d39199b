"""`gptlab bench prepare`: how fast `gptlab prepare` turns a FineWeb-shaped corpus into token files, beside the
limit — the tokenizer library's own batch encoding of the same documents, already in memory, with as many threads
as prepare has worker processes (tiktoken's encode_ordinary_batch for gpt2, tokenizers' encode_batch for bpe) —
and prepare's peak memory (its process and its workers together) at two corpus sizes.

The corpus is generated: JSON-lines shards of documents of 1-8 KB cut from Tiny Shakespeare at seeded offsets,
with FineWeb's fields. prepare runs as the user runs it, in its own process (`python -m gptlab prepare`), and
its time includes the scan pass and the process's start; its memory is sampled from /proc while it runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gptlab.bench.timing import LoadWatch
from gptlab.data.corpus import bundled_source, read_chunks
from gptlab.machine import usable_cores
from gptlab.tokenizer import load as load_tokenizer

SHARD_BYTES = 64 << 20
BATCH_BYTES = 4 << 20  # the limit encodes batches of documents this large, as prepare's units are


@dataclass
class PrepareRow:
    """One tokenizer at one corpus size: prepare's time, tokens and peak memory, and the limit's time."""

    tokenizer: str
    megabytes: float
    tokens: int
    prepare_s: float
    peak_bytes: int
    limit_s: float | None  # None: the library has no batch encoder (char)

    @property
    def share(self) -> float | None:
        """prepare's throughput over the limit's."""
        return None if self.limit_s is None else self.limit_s / self.prepare_s


def make_corpus(folder: Path, megabytes: float, seed: int = 0) -> list[str]:
    """JSON-lines shards holding about `megabytes` MB of UTF-8 text in `folder`, written as they are made (the
    corpus is never in memory); returns their paths."""
    text = "".join(read_chunks(bundled_source()))
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    target, written, shard, n = int(megabytes * 1e6), 0, None, 0
    names = []
    while written < target:
        if shard is None or shard.tell() >= SHARD_BYTES:
            if shard is not None:
                shard.close()
            names.append(str(folder / f"{len(names):03d}_00000.jsonl"))
            shard = open(names[-1], "w", encoding="utf-8")
        start, size = rng.randrange(len(text) - 8192), rng.randrange(1024, 8192)
        doc = text[start:start + size]
        shard.write(json.dumps({"text": doc, "id": f"<urn:uuid:{n:012d}>", "dump": "CC-MAIN-2024-10",
                                "url": f"https://example.com/{n}", "language": "en"}) + "\n")
        written += len(doc.encode("utf-8"))
        n += 1
    shard.close()
    return names


def run_measured(argv: list[str]) -> tuple[float, int]:
    """Run a command; (seconds, the peak of the summed resident memory of it and its child processes)."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0]

    def watch() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], tree_rss(process.pid))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = process.communicate()
    seconds = time.perf_counter() - start
    watcher.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {err.decode(errors='replace').strip()}")
    return seconds, peak[0]


def tree_rss(pid: int) -> int:
    """The resident memory of a process and all its descendants, in bytes (0 where /proc cannot tell)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(tree_rss(int(child)) for child in f.read().split())
    except (OSError, ValueError):
        pass
    return total


def limit_seconds(kind: str, data: Path, shards: list[str], workers: int) -> float | None:
    """The tokenizer library's own batch encoding of every document, in batches of BATCH_BYTES, `workers`
    threads; the documents are read into memory first, outside the timing."""
    tok = load_tokenizer(data / "tokenizer.json")
    if kind == "gpt2":
        def encode(batch: list[str]) -> None:
            tok.enc.encode_ordinary_batch(batch, num_threads=workers)
    elif kind == "bpe":
        def encode(batch: list[str]) -> None:
            tok.hf.encode_batch(batch, add_special_tokens=False)
    else:
        return None
    batches, batch, size = [], [], 0
    for shard in shards:
        with open(shard, encoding="utf-8") as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                size += len(batch[-1])
                if size >= BATCH_BYTES:
                    batches.append(batch)
                    batch, size = [], 0
    batches.append(batch)
    start = time.perf_counter()
    for batch in batches:
        encode(batch)
    return time.perf_counter() - start


def measure_tokenizer(kind: str, corpus: Path, shards: list[str], megabytes: float, workers: int, work: Path,
                      bpe_from: Path | None) -> PrepareRow:
    out = work / f"{kind}-{megabytes:g}"
    argv = [sys.executable, "-m", "gptlab", "prepare", str(corpus), "--out", str(out), "--workers", str(workers),
            "--quiet"]
    argv += ["--tokenizer-from", str(bpe_from)] if kind == "bpe" else ["--tokenizer", kind]
    seconds, peak = run_measured(argv)
    meta = json.loads((out / "meta.json").read_text())
    row = PrepareRow(kind, megabytes, meta["train_tokens"] + meta["val_tokens"], seconds, peak,
                     limit_seconds(kind, out, shards, workers))
    shutil.rmtree(out)  # its shards: the disk holds one size's token files at a time
    return row


def run_prepare_bench(sizes_mb: tuple[float, float], tokenizers: list[str], workers: int | None = None,
                      vocab_size: int = 4096) -> list[PrepareRow]:
    """Print one line per tokenizer and size, the machine's load, and last the GPT-2 tokenizer's share of the
    limit at the larger size and the peak memory at both sizes."""
    workers = workers or usable_cores()
    os.environ["RAYON_NUM_THREADS"] = str(workers)  # tokenizers' batch encoding: as many threads as workers
    watch, rows = LoadWatch(), []
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-prepare-") as tmp:
        work = Path(tmp)
        bpe_from = None
        if "bpe" in tokenizers:  # a BPE vocabulary trained once on a small sample; prepare then only encodes
            sample = make_corpus(work / "sample", 2)
            bpe_from = work / "bpe-vocab"
            run_measured([sys.executable, "-m", "gptlab", "prepare", *sample, "--tokenizer", "bpe", "--vocab-size",
                          str(vocab_size), "--out", str(bpe_from), "--quiet"])
        print(f"prepare vs the tokenizer library's batch encoding, {workers} worker processes / threads, corpus of "
              "JSON-lines shards (FineWeb's shape)")
        print(f"{'tokenizer':>9} {'MB':>7} {'tokens':>12} {'prepare MB/s':>12} {'tokens/s':>10} {'limit MB/s':>10} "
              f"{'share':>6} {'peak MB':>8}")
        for megabytes in sizes_mb:
            corpus = work / f"corpus-{megabytes:g}"
            shards = make_corpus(corpus, megabytes)
            for kind in tokenizers:
                row = measure_tokenizer(kind, corpus, shards, megabytes, workers, work, bpe_from)
                rows.append(row)
                limit = "-" if row.limit_s is None else f"{megabytes / row.limit_s:.2f}"
                share = "-" if row.share is None else f"{row.share:.0%}"
                print(f"{kind:>9} {megabytes:>7g} {row.tokens:>12,} {megabytes / row.prepare_s:>12.2f} "
                      f"{row.tokens / row.prepare_s:>10,.0f} {limit:>10} {share:>6} {row.peak_bytes / 1e6:>8.0f}")
            shutil.rmtree(corpus, ignore_errors=True)
    print(watch.stop().report())
    _summary(rows)
    return rows


def _summary(rows: list[PrepareRow]) -> None:
    main = "gpt2" if any(r.tokenizer == "gpt2" for r in rows) else rows[0].tokenizer
    ordered = sorted((r for r in rows if r.tokenizer == main), key=lambda r: r.megabytes)
    small, large = ordered[0], ordered[-1]
    share = "no limit to compare" if large.share is None else f"{large.share:.0%} of the limit"
    print(f"{main} at {large.megabytes:g} MB: {share}; peak memory {small.peak_bytes / 1e6:.0f} MB at "
          f"{small.megabytes:g} MB, {large.peak_bytes / 1e6:.0f} MB at {large.megabytes:g} MB")
