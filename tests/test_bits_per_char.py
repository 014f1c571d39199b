"""Bits per character and per byte are over the documents' own text: an end-of-text token or a chat marker is one
token the model predicts, but no character of anybody's text, so it counts zero characters and zero bytes (never
the 13 characters of `<|endoftext|>` spelled out). The expected counts come from the documents the test wrote."""

import json
import math

import pytest

from helpers import run_ok
from gptlab.tokenizer import EOT, CharTokenizer, ChatTokenizer

DOCS = [f"Café {i}: déjà vu à 東京, naïve — {'ab' * (i % 5)}!\n" for i in range(20)]  # more bytes than characters


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A run trained two steps on BPE data whose validation corpus is DOCS[10:], named with --val (so its
    documents, and their characters, are known here)."""
    root = tmp_path_factory.mktemp("bpe")
    train, val = root / "train.jsonl", root / "val.jsonl"
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:10] * 5), encoding="utf-8")
    val.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[10:]), encoding="utf-8")
    from gptlab.cli import main

    assert main(["prepare", str(train), "--val", str(val), "--tokenizer", "bpe", "--vocab-size", "300",
                 "--out", str(root / "data"), "--quiet"]) == 0
    assert main(["train", "--data", str(root / "data"), "--run", str(root / "run"), "--max-steps", "2",
                 "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
                 "--eval-interval", "2", "--eval-batches", "1", "--precision", "fp32", "--quiet"]) == 0
    return root


def test_eval_counts_the_held_out_documents_characters_and_bytes_not_the_end_of_text_markers(bpe_run, capsys):
    text = "".join(DOCS[10:])
    meta = json.loads((bpe_run / "data" / "meta.json").read_text())
    report = json.loads(run_ok(capsys, "eval", "--run", str(bpe_run / "run"), "--json"))
    (scored,) = report["scores"] if "scores" in report else [report]
    assert (scored["chars"], scored["bytes"]) == (len(text), len(text.encode())) == (meta["val_chars"],
                                                                                    len(text.encode()))
    assert scored["special_tokens"] == 10  # one end-of-text after each document
    assert scored["bits_per_byte"] == pytest.approx(scored["loss"] * scored["tokens"] / math.log(2)
                                                    / len(text.encode()), rel=1e-9)


def test_the_eval_table_says_special_tokens_count_no_characters(bpe_run, capsys):
    out = run_ok(capsys, "eval", "--run", str(bpe_run / "run"))
    assert "special tokens (end-of-text, chat markers) count 0 characters and 0 bytes" in " ".join(out.split())


def test_a_files_end_of_text_markers_count_no_characters(bpe_run, capsys):
    path = bpe_run / "two.txt"
    path.write_text(DOCS[0] + EOT + DOCS[1], encoding="utf-8")
    report = json.loads(run_ok(capsys, "eval", "--run", str(bpe_run / "run"), str(path), "--json"))
    (scored,) = report["scores"] if "scores" in report else [report]
    text = DOCS[0] + DOCS[1]
    assert (scored["chars"], scored["bytes"], scored["special_tokens"]) == (len(text), len(text.encode()), 1)


def test_compare_puts_each_run_on_bits_per_byte_of_its_documents_own_bytes(bpe_run, tmp_path, capsys):
    """compare's bits per byte (tokenizers differ) is each evaluation's nats over the held-out text's bytes."""
    from helpers import tiny_run
    from gptlab.plots import read_metrics, validation_curve
    from gptlab.runs import val_bits_per_byte

    curve = validation_curve(read_metrics(bpe_run / "run" / "metrics.jsonl"))
    steps, bpb, _ = val_bits_per_byte(bpe_run / "run", curve)
    text_bytes = len("".join(DOCS[10:]).encode())
    meta = json.loads((bpe_run / "data" / "meta.json").read_text())
    assert bpb == pytest.approx([loss * meta["val_tokens"] / math.log(2) / text_bytes for loss in curve[1]])
    char = tiny_run(tmp_path, 2, ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
                                  "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1", "--quiet"])
    run_ok(capsys, "compare", str(bpe_run / "run"), str(char), "--out", str(tmp_path / "c.png"))


def test_a_chat_splits_markers_count_no_characters(tmp_path, capsys):
    """Conversations of known contents: every message's content is 12 characters, so the validation split's
    characters are 12 per message of its conversations, whatever the markers around them."""
    base = CharTokenizer("abcdefghijklmnopqrstuvwxyzé ")
    chats = tmp_path / "chats.jsonl"
    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = [{"messages": [{"role": "user", "content": (letters[i % 26] + " ") * 5 + "é "},
                          {"role": "assistant", "content": (letters[(i + 3) % 26] * 11) + "é"}]} for i in range(30)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    from gptlab import rundir
    from gptlab.checkpoint import save_checkpoint
    from gptlab.config import ModelConfig, TrainConfig, to_dict
    from gptlab.model import GPT

    tok = ChatTokenizer(base)
    cfg = ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    run = tmp_path / "run"
    rundir.init_run(run, cfg, TrainConfig(max_steps=1), tok, {"preset": "char-quick"})
    state = rundir.TrainingState(model=to_dict(cfg), train=to_dict(TrainConfig(max_steps=1)), best_val_loss=1.0,
                                 val_loss=1.0)
    save_checkpoint(run, "best", 1, GPT(cfg).eval(), state,
                    extra_files={"tokenizer.json": (run / "tokenizer.json").read_bytes()})
    run_ok(capsys, "prepare", "--chat", str(chats), "--tokenizer-from", str(run), "--context", "32", "--out",
           str(tmp_path / "data"), "--quiet")
    from gptlab.data.batches import load_dataset

    val = load_dataset(tmp_path / "data").val.tolist()
    messages = sum(val.count(tok.role_ids[r]) for r in ("user", "assistant"))
    report = json.loads(run_ok(capsys, "eval", "--run", str(run), "--data", str(tmp_path / "data"), "--json"))
    (scored,) = report["scores"] if "scores" in report else [report]
    assert messages > 0 and scored["chars"] == 12 * messages and scored["bytes"] == 13 * messages
    assert scored["special_tokens"] == 2 * messages  # a role marker and an end marker each
