"""Every CLI verb against a catalogue of bad inputs: exit code 2, one line naming the problem, and not one byte
changed, added or removed anywhere in the folder it ran in (runs, data, everything)."""

import json
import shutil

import pytest
from helpers import CORPUS, TINY, tree

from gptlab.cli import main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder with a prepared corpus, a trained run and an assortment of bad files."""

    root = tmp_path_factory.mktemp("sweep")
    (root / "corpus.txt").write_text(CORPUS)
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("too short\n" * 3)
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "nul.txt").write_bytes(b"text\x00with a NUL byte\n" * 10)
    (root / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (root / "afile").write_text("I am a file, not a folder\n")
    (root / "unseen.txt").write_text("Zebra ☃ quartz\n")
    (root / "eot.txt").write_text("one document<|endoftext|>another one\n" * 20)
    (root / "upper.txt").write_text(CORPUS.upper())
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    assert main(["prepare", str(root / "upper.txt"), "--out", str(root / "otherdata"), "--quiet"]) == 0
    (root / "textbin").mkdir()  # a Hugging Face folder whose weights file is text (a Git LFS pointer, say)
    (root / "textbin" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2,
                                                              "n_embd": 16, "n_positions": 16, "vocab_size": 60}))
    (root / "textbin" / "pytorch_model.bin").write_text("these are not the weights you are looking for\n")
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
    for name, key, value in (("badtype", ("model", "n_layer"), "abc"), ("baddata", ("data",), 123)):
        shutil.copytree(root / "run", root / name)
        config = json.loads((root / name / "config.json").read_text())
        (config[key[0]] if len(key) == 2 else config)[key[-1]] = value
        (root / name / "config.json").write_text(json.dumps(config))
    return root


CASES = [
    # prepare
    (["prepare", "{r}/empty.txt", "--out", "{r}/o"], "is empty"),
    (["prepare", "{r}/binary.bin", "--out", "{r}/o"], "binary.bin is not valid utf-8: bad byte at offset 128"),
    (["prepare", "{r}/nul.txt", "--out", "{r}/o"], "looks like a binary file"),
    (["prepare", "{r}/upper.txt", "--out", "{r}/data"], "holds data prepared from other inputs or settings"),
    (["prepare", "{r}/latin1.txt", "--out", "{r}/o"], "offset 3; pass --encoding"),
    (["prepare", "{r}/missing.txt", "--out", "{r}/o"], "missing.txt does not exist"),
    (["prepare", "{r}/notarun", "--out", "{r}/o"], "no files found"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/afile/sub"], "cannot create output folder"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--val-fraction", "1.5"], "val_fraction must be in (0, 1)"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--val-fraction", "0"], "val_fraction must be in (0, 1)"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--shard-tokens", "0"], "--shard-tokens must be at least 1"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--shard-tokens", "-5"], "--shard-tokens must be at least 1"),
    (["prepare", "{r}/eot.txt", "--out", "{r}/o", "--tokenizer", "gpt2"], "eot.txt contains the text <|endoftext|>"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/run"], "holds a gptlab run"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/textbin"], "holds a model"),
    (["prepare", "{r}/unseen.txt", "--out", "{r}/o", "--tokenizer-from", "{r}/run"], "never seen: 'Z', 'b', 'q', '☃'"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--tokenizer-from", "{r}/notarun"], "is not a gptlab run or"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--tokenizer", "bpe", "--vocab-size", "10"], "vocab_size >= 257"),
    (["prepare", "{r}/corpus.txt", "--tokenizer", "word"], "invalid choice: 'word'"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--encoding", "klingon"], "unknown text encoding"),
    (["prepare", "{r}", "--include", "binary.bin", "--out", "{r}/o"], "is empty; give a file with text in it; 1 "
                                                                       "unreadable file was skipped"),
    (["prepare", "{r}", "--include", "binary.bin", "--strict", "--out", "{r}/o"], "binary.bin is not valid utf-8"),
    (["prepare", "{r}", "--include", "*.nothing", "--out", "{r}/o"], "no files that pass --include / --exclude"),
    (["prepare", "{r}/run/metrics.jsonl", "--out", "{r}/o"], "metrics.jsonl line 1 has no text field 'text'"),
    (["prepare", "{r}/data/meta.json", "--out", "{r}/o"], "meta.json line 1 is not JSON"),
    (["prepare", "{r}/corpus.txt", "--out", "{r}/o", "--text-field"], "expected one argument"),
    (["prepare", "{r}/corpus.txt", "--val", "{r}/empty.txt", "--out", "{r}/o"], "the validation corpus"),
    (["prepare", "{r}/corpus.txt", "--val", "{r}/missing.txt", "--out", "{r}/o"], "missing.txt does not exist"),
    (["prepare", "{r}/corpus.txt", "--val", "{r}/latin1.txt", "--out", "{r}/o"], "latin1.txt is not valid utf-8"),
    (["prepare", "{r}/corpus.txt", "--seed", "x", "--out", "{r}/o"], "invalid int value: 'x'"),
    (["prepare", "{r}/corpus.txt", "--workers", "0", "--out", "{r}/o"], "--workers must be at least 1, not 0"),
    # train
    (["train", "--data", "{r}/nodata", "--run", "{r}/t"], "nodata does not exist; give --data a folder made by"),
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
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--preset", "gpt5"], "invalid choice: 'gpt5'"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--layers", "3"], "unrecognized arguments: --layers"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--n-embd", "1000000", "--n-head", "1"], "GiB for its weights"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", *TINY, "--batch-size", "1000000000"], "for its logits alone"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--lr", "nan"], "lr must be a finite number"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--seed", "-1"], "seed must be in [0, 2**63)"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", *TINY, "--nproc", "2", "--batch-size", "15"],
     "must be a multiple of the 2 processes"),
    (["train", "--data", "{r}/data", "--run", "{r}/data", *TINY], "is a prepared data folder"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--optimizer", "muon", "--fsdp"], "optimizer muon"),
    (["train", "--data", "{r}/data", "--run", "{r}/textbin", *TINY], "not a gptlab run's"),
    (["train", "--data", "{r}/data", "--run", "{r}/t", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["train", "--data", "{r}/data", "--run", "{r}/afile/sub", *TINY], "cannot create run folder"),
    (["train", "--data", "{r}/data", "--run", "{r}/run", *TINY], "already has checkpoints; pass --resume"),
    (["train", "--data", "{r}/data", "--run", "{r}/run", "--resume", "--n-embd", "32"], "n_embd=16 (now 32)"),
    (["train", "--run", "{r}/run", "--resume", "--n-layer", "3"], "n_layer=1 (now 3)"),
    (["train", "--run", "{r}/run", "--resume", "--data", "{r}/otherdata"], "trained on different data"),
    (["train", "--run", "{r}/run", "--resume", "--max-steps", "3"], "nothing to do"),
    (["train", "--run", "{r}/run", "--resume", "--max-steps", "5"], "nothing to do"),
    (["train", "--run", "{r}/badtype", "--resume"], "config.json is damaged: n_layer must be an integer, not 'abc'"),
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
    (["sample", "--run", "{r}/run", "--prompt-file", "{r}/latin1.txt"], "latin1.txt is not valid utf-8"),
    (["sample", "--run", "{r}/run", "--frequency-penalty", "nan"], "frequency_penalty must be a finite number"),
    (["sample", "--run", "{r}/run", "--presence-penalty", "nan"], "presence_penalty must be a finite number"),
    (["sample", "--run", "{r}/run", "--temperature", "inf"], "temperature must be a finite number"),
    (["sample", "--run", "{r}/run", "--seed", "99999999999999999999999"], "seed must be in [0, 2**63)"),
    (["sample", "--run", "{r}/badtype"], "config.json is damaged: n_layer must be an integer, not 'abc'"),
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
    (["eval", "--run", "{r}/run", "--encoding", "bogus", "{r}/corpus.txt"], "unknown text encoding 'bogus'"),
    (["eval", "--run", "{r}/run", "--data", "{r}/otherdata"], "another tokenizer than run"),
    (["eval", "--run", "{r}/baddata"], "config.json is damaged: data must be the path"),
    # compare
    (["compare", "{r}/notarun"], "is not a gptlab run"),
    (["compare", "{r}/run-empty"], "none of these runs has been evaluated yet"),
    (["compare", "{r}/run", "--out", "{r}/curves.json"], "a picture's name must end in .png, .svg, .pdf, .jpg"),
    (["compare", "{r}/run", "--bogus"], "(see `gptlab compare --help`)"),
    # import / export
    (["import", "{r}/nowhere", "--run", "{r}/i"], "does not exist"),
    (["import", "{r}/notarun", "--run", "{r}/i"], "no config.json"),
    (["import", "{r}/corpus.txt", "--run", "{r}/i"], "not a folder"),
    (["import", "{r}/textbin", "--run", "{r}/i"], "pytorch_model.bin is not a PyTorch weights file"),
    (["import", "{r}/textbin", "--run", "{r}/data"], "already holds prepared data"),
    (["export", "{r}/notarun", "--out", "{r}/x"], "is not a gptlab run"),
    (["export", "{r}/run", "--format", "onnx", "--out", "{r}/x"], "invalid choice: 'onnx'"),
    (["export", "{r}/run"], "the following arguments are required: --out"),
    (["export", "{r}/run", "--out", "{r}/afile/sub"], "cannot"),
    (["export", "{r}/run", "--out", "{r}/run"], "is the run itself"),
    (["export", "{r}/run", "--out", "{r}/badtype"], "is a gptlab run"),
    (["export", "{r}/run", "--out", "{r}/data"], "is a prepared data folder"),
    # serve (each refused before a model is loaded; all but run-empty's before a port is taken)
    (["serve", "--run", "{r}/run", "--host", "0.0.0.0"], "give --api-key KEY"),
    (["serve", "--run", "{r}/run", "--host", "192.168.1.5"], "give --api-key KEY"),
    (["serve", "--run", "{r}/run", "--host", "0.0.0.0", "--api-key", " "], "--api-key must not be empty"),
    (["serve", "--run", "{r}/run", "--port", "70000"], "--port must be in [0, 65535]"),
    (["serve", "--run", "{r}/run", "--port", "x"], "invalid int value: 'x'"),
    (["serve", "--run", "{r}/run", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
    (["serve", "--run", "{r}/run", "--max-n", "0"], "--max-n must be a positive integer"),
    (["serve", "--run", "{r}/run", "--max-batch", "-1"], "--max-batch must be a positive integer"),
    (["serve", "--run", "{r}/run", "--queue", "0"], "--queue must be a positive integer"),
    (["serve", "--run", "{r}/run", "--max-body-bytes", "0"], "--max-body-bytes must be a positive integer"),
    (["serve", "--run", "{r}/run", "--max-prompt-tokens", "-1"], "--max-prompt-tokens must be >= 0"),
    (["serve", "--run", "{r}/run", "--grace", "nan"], "--grace must be a number of seconds >= 0"),
    (["serve", "--run", "{r}/run", "--precision", "fp64"], "invalid choice: 'fp64'"),
    (["serve", "--run", "{r}/notarun"], "is not a gptlab run"),
    (["serve", "--run", "{r}/nowhere"], "does not exist"),
    (["serve", "--run", "{r}/run-empty", "--port", "0"], "has no checkpoint yet"),
    (["bench", "serve", "--clients", "0"], "--clients must be >= 1"),
    (["bench", "serve", "--clients", "1000"], "--clients must be at most 256"),
    (["bench", "serve", "--queue", "0"], "--queue must be >= 1"),
    (["bench", "serve", "--time-limit", "0"], "--time-limit must be in (0, 600]"),
    (["bench", "serve", "--run", "{r}/notarun"], "is not a gptlab run"),
    # bench and the command itself
    (["bench", "generate", "--new-tokens", "0"], "new"),
    (["bench", "train", "--preset", "gpt5"], "invalid choice: 'gpt5'"),
    (["bench", "race", "--precisions", "int8"], "invalid choice: 'int8'"),
    (["bench", "race", "--eval-every", "0"], "--eval-every must be >= 1"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    (["bench", "prepare", "--sizes-mb", "0", "1"], "--sizes-mb must be > 0"),
    (["bench", "prepare", "--workers", "0"], "--workers >= 1"),
    (["launch"], "invalid choice: 'launch'"),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a[:1] + a[-2:]).replace("☃", "snowman")
                                                       for a, _ in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(world, capsys, monkeypatch, argv, words):
    monkeypatch.chdir(world)  # whatever a command writes by default (runs/, data/) lands in the tree too
    before = tree(world)
    code = main([a.replace("{r}", str(world)) for a in argv])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("gptlab: warning")]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("gptlab: error: "), err
    assert words in err[0]
    assert tree(world) == before


def test_an_oversize_prompt_keeps_its_last_block_size_tokens(world, capsys, tmp_path):
    (tmp_path / "long.txt").write_text("All:\nSpeak, speak.\n" * 2000)
    assert main(["sample", "--run", str(world / "run"), "--prompt-file", str(tmp_path / "long.txt"),
                 "--max-new-tokens", "5", "--no-echo"]) == 0
    assert len(capsys.readouterr().out) >= 5
