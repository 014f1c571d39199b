"""`gptlab bench prepare` (bench/prepare_speed.py): the generated corpus, and one small run whose figures are checked
against direct tokenization of the same documents."""

import json
from pathlib import Path

from gptlab.bench import prepare_speed as prepare_bench
from gptlab.cli import main
from gptlab.tokenizer import train_tokenizer


def test_the_generated_corpus_has_fineweb_fields_and_its_size(tmp_path):
    shards = prepare_bench.make_corpus(tmp_path / "c", 0.3)
    records = [json.loads(line) for s in shards for line in Path(s).read_text(encoding="utf-8").splitlines()]
    size = sum(len(r["text"].encode()) for r in records)
    assert 0.3e6 <= size < 0.3e6 + 8192 and {"text", "id", "url"} <= set(records[0])
    assert all(1024 <= len(r["text"]) < 8192 for r in records)
    again = prepare_bench.make_corpus(tmp_path / "d", 0.3)
    assert [json.loads(line) for s in again for line in Path(s).read_text().splitlines()] == records  # seeded


def test_a_small_run_prints_the_table_and_counts_every_token(tmp_path, capsys):
    rows = prepare_bench.run_prepare_bench((0.1, 0.2), ["gpt2", "char"], workers=2)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["tokenizer", "MB", "tokens", "prepare", "MB/s", "tokens/s", "limit", "MB/s", "share",
                              "peak", "MB"]
    assert out[-1].startswith("gpt2 at 0.2 MB: ") and "of the limit; peak memory" in out[-1]
    gpt2 = train_tokenizer("gpt2", [])
    for row in rows:
        shards = prepare_bench.make_corpus(tmp_path / str(row.megabytes), row.megabytes)
        texts = [json.loads(line)["text"] for s in shards for line in Path(s).read_text(encoding="utf-8").splitlines()]
        expected = sum(len(gpt2.encode(t)) + 1 for t in texts) if row.tokenizer == "gpt2" else \
            sum(map(len, texts)) + len(texts) - 1  # char: a newline between documents
        assert row.tokens == expected and row.peak_bytes > 10e6 and row.prepare_s > 0
        assert (row.limit_s is None) == (row.tokenizer == "char")


def test_bad_sizes_are_refused(capsys):
    assert main(["bench", "prepare", "--sizes-mb", "0", "1"]) == 2
    assert "--sizes-mb must be > 0" in capsys.readouterr().err
