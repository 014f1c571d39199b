"""Every CLI verb against a catalogue of bad inputs: exit code 2, one line naming the problem, no run harmed."""

import pytest

from gptlab.cli import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-interval", "5", "--eval-batches", "2", "--log-interval", "5", "--precision", "fp32", "--quiet"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder with a prepared corpus, a trained run and an assortment of bad files."""
    from conftest import CORPUS

    root = tmp_path_factory.mktemp("sweep")
    (root / "corpus.txt").write_text(CORPUS)
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("too short\n" * 3)
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "nul.txt").write_bytes(b"text\x00with a NUL byte\n" * 10)
    (root / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (root / "afile").write_text("I am a file, not a folder\n")
    (root / "unseen.txt").write_text("Zebra ☃ quartz\n")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    assert main(["prepare", str(root / "short.txt"), "--out", str(root / "shortdata"), "--quiet"]) == 0
    assert main(["train", "--data", str(root / "data"), "--run", str(root / "run"), "--max-steps", "5", *TINY]) == 0
    (root / "notarun").mkdir()
    (root / "run-empty").mkdir()
    (root / "run-empty" / "config.json").write_text((root / "run" / "config.json").read_text())
    (root / "run-empty" / "tokenizer.json").write_text((root / "run" / "tokenizer.json").read_text())
    (root / "badconfig").mkdir()
    (root / "badconfig" / "config.json").write_text("[]")
    (root / "badconfig" / "tokenizer.json").write_text((root / "run" / "tokenizer.json").read_text())
    (root / "badmeta").mkdir()
    (root / "badmeta" / "meta.json").write_text("{not json")
    return root


def files_of(run):
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "config.json"}


CASES = [
    # prepare
    (["prepare", "{r}/empty.txt", "--out", "{r}/o"], "is empty"),
    (["prepare", "{r}/binary.bin", "--out", "{r}/o"], "binary.bin is not valid utf-8: bad byte at offset 128"),
    (["prepare", "{r}/nul.txt", "--out", "{r}/o"], "looks like a binary file"),
    (["prepare", "{r}/latin1.txt", "--out", "{r}/o"], "offset 3; pass --encoding"),
    (["prepare", "{r}/missing.txt", "--out", "{r}/o"], "missing.txt does not exist"),
    (["prepare", "{r}/notarun", "--out", "{r}/o"], "no files found"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/afile/sub"], "cannot create output folder"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--val-fraction", "1.5"], "val_fraction must be in [0, 1)"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--tokenizer", "bpe", "--vocab-size", "10"], "vocab_size >= 257"),
    (["prepare", "{r}/corpus.txt", "--tokenizer", "word"], "invalid choice: 'word'"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--encoding", "klingon"], "unknown text encoding"),
    # train
    (["train", "--data", "{r}/nodata", "--run", "{r}/t"], "is not a prepared data folder"),
    (["train", "--data", "{r}/badmeta", "--run", "{r}/t"], "meta.json is damaged"),
    (["train", "--data", "{r}/shortdata", "--run", "{r}/t", *TINY], "fewer than block_size + 1 = 17"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--batch-size", "0"], "batch_size must be a positive"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--batch-size", "-4"], "batch_size must be a positive"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--lr", "0"], "lr (learning rate) must be > 0"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--max-steps", "0"], "max_steps must be a positive"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--max-steps", "-3"], "max_steps must be a positive"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--n-layer", "0"], "n_layer must be a positive"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--dropout", "1.5"], "dropout must be in [0, 1)"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--grad-clip", "-1"], "grad_clip must be >= 0"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--keep-last", "1"], "keep_last must be at least 2"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--layers", "3"], "unrecognized arguments: --layers"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--device", "cuda"], "device 'cuda' is not available"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--device", "tpu"], "device must be one of"),
    (["train", "--data", "{r}/data", "--run", "{r}/afile/sub", *TINY], "cannot create run folder"),
    (["train", "--data", "{r}/data", "--run", "{r}/run", *TINY], "already has checkpoints; pass --resume"),
    (["train", "--data", "{r}/data", "--run", "{r}/run", "--resume", "--n-embd", "32"], "n_embd=16 (now 32)"),
    (["train", "--data", "{r}/data", "--run", "{r}/run", "--resume", "maybe"], "--resume takes no value or 'auto'"),
    (["train", "--data", "{r}/data", "--run", "{r}/nowhere", "--resume"], "does not exist"),
    (["train", "--data", "{r}/data", "--run", "{r}/run-empty", "--resume", *TINY], "no checkpoint to resume"),
    # sample
    (["sample", "--run", "{r}/nowhere"], "does not exist"),
    (["sample", "--run", "{r}/notarun"], "is not a gptlab run"),
    (["sample", "--run", "{r}/badconfig"], "is not a gptlab run config"),
    (["sample", "--run", "{r}/run-empty"], "has no checkpoint yet"),
    (["sample", "--run", "{r}/run", "--prompt", "Zebra ☃"], "never seen: 'Z', 'b', '☃'"),
    (["sample", "--run", "{r}/run", "--prompt", ""], "the prompt is empty"),
    (["sample", "--run", "{r}/run", "--prompt-file", "{r}/missing.txt"], "does not exist"),
    (["sample", "--run", "{r}/run", "--prompt-file", "{r}/latin1.txt"], "not valid UTF-8"),
    (["sample", "--run", "{r}/run", "--max-new-tokens", "0"], "max_new_tokens must be a positive"),
    (["sample", "--run", "{r}/run", "--max-new-tokens", "-5"], "max_new_tokens must be a positive"),
    (["sample", "--run", "{r}/run", "--temperature", "-1"], "temperature must be >= 0"),
    (["sample", "--run", "{r}/run", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["sample", "--run", "{r}/run", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["sample", "--run", "{r}/run", "--top-k", "-1"], "top_k must be >= 1"),
    (["sample", "--run", "{r}/run", "--num-samples", "0"], "--num-samples must be >= 1"),
    (["sample", "--run", "{r}/run", "--seed", "x"], "seed must be an integer"),
    # eval
    (["eval", "--run", "{r}/notarun"], "is not a gptlab run"),
    (["eval", "--run", "{r}/run", "{r}/missing.txt"], "missing.txt does not exist"),
    (["eval", "--run", "{r}/run", "{r}/latin1.txt"], "latin1.txt is not valid utf-8"),
    (["eval", "--run", "{r}/run", "{r}/unseen.txt"], "never seen"),
    (["eval", "--run", "{r}/run", "{r}/empty.txt"], "too short to score"),
    (["eval", "--run", "{r}/run", "--batch-size", "0"], "--batch-size must be >= 1"),
    # import / export
    (["import", "{r}/nowhere", "--run", "{r}/i"], "does not exist"),
    (["import", "{r}/notarun", "--run", "{r}/i"], "no config.json"),
    (["import", "{r}/corpus.txt", "--run", "{r}/i"], "not a folder"),
    (["export", "{r}/notarun", "--out", "{r}/x"], "is not a gptlab run"),
    (["export", "{r}/run", "--format", "onnx", "--out", "{r}/x"], "invalid choice: 'onnx'"),
    (["export", "{r}/run"], "the following arguments are required: --out"),
    (["export", "{r}/run", "--out", "{r}/afile/sub"], "cannot"),
    # bench and the command itself
    (["bench", "generate", "--new-tokens", "0"], "new"),
    (["bench", "train", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    (["launch"], "invalid choice: 'launch'"),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_clear_line_and_harms_no_run(world, capsys, argv, words):
    before = files_of(world / "run")
    code = main([a.replace("{r}", str(world)) for a in argv])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("gptlab: warning")]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("gptlab: error: "), err
    assert words in err[0]
    assert files_of(world / "run") == before


def test_an_oversize_prompt_keeps_its_last_block_size_tokens(world, capsys):
    (world / "long.txt").write_text("All:\nSpeak, speak.\n" * 2000)
    assert main(["sample", "--run", str(world / "run"), "--prompt-file", str(world / "long.txt"),
                 "--max-new-tokens", "5", "--no-echo"]) == 0
    assert len(capsys.readouterr().out) >= 5
