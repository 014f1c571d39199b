"""`gptlab bench chat` (bench/chat_finetune.py) in seconds: a tiny char GPT, an easier task (reverse a 2-letter word),
few steps. Masked fine-tuning must reach a lower bar that the base before fine-tuning misses;
the expected answers are computed here from the task's rule, not taken from the bench."""

import json

import numpy as np
import pytest

from gptlab.bench.chat_finetune import ChatBenchSettings, make_conversations, run_chat_bench
from gptlab.cli import main

BAR = 0.75  # masked fine-tuning's accuracy at least; the base before fine-tuning below it
CORPUS = "Reverse the word.\nThe quick brown fox jumps over a lazy dog; what a cat said: no.\n"
TINY = ChatBenchSettings(train=800, held=24, min_len=2, max_len=2, alphabet="abcdefghijklmnopqrstuvwxyz",
                         system_share=0.25, seed=3, n_layer=2, n_head=2, n_embd=48, block_size=48, batch_size=32,
                         base_steps=10, base_lr=3e-3, steps=400, lr=6e-3, precision="fp32")


def word_of(conversation):
    """The word a conversation asks about: its user turn is "reverse: WORD"."""
    (user,) = [m["content"] for m in conversation["messages"] if m["role"] == "user"]
    task, word = user.split(": ")
    assert task == "reverse"
    return word


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-bench")
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS * 200, encoding="utf-8")
    return folder, run_chat_bench(TINY, corpus=[str(corpus)], quiet=True, folder=folder)


def test_masked_fine_tuning_answers_held_out_questions_the_base_cannot(bench):
    _, report = bench
    base, unmasked, masked = report["variants"]
    expected = [word_of(c)[::-1] for c in report["held"]]
    scored = {}
    for variant in (base, unmasked, masked):
        assert len(variant.answers) == len(expected)
        right = sum(a == e for a, e in zip(variant.answers, expected))
        assert variant.accuracy == pytest.approx(right / len(expected))  # the bench counts as the task's rule does
        scored[variant.name] = right / len(expected)
    assert scored[masked.name] >= BAR, report["variants"]
    assert scored[base.name] < BAR  # before fine-tuning it does not know the task (nor the chat template)
    assert masked.steps == unmasked.steps == TINY.steps and base.steps == TINY.base_steps


def test_held_out_questions_are_never_trained_and_every_answer_follows_the_rule(bench):
    folder, report = bench
    train, held = read_jsonl(folder / "conversations.jsonl"), read_jsonl(folder / "held-out.jsonl")
    assert held == report["held"] and len(train) == TINY.train and len(held) == TINY.held
    trained_words = {word_of(c) for c in train}
    held_words = [word_of(c) for c in held]
    assert len(set(held_words)) == len(held_words) and not trained_words & set(held_words)
    for c in train + held:
        word = word_of(c)
        assert len(word) == 2 and set(word) <= set(TINY.alphabet)
        assert c["messages"][-1] == {"role": "assistant", "content": word[::-1]}
    with_system = sum(c["messages"][0]["role"] == "system" for c in train)
    assert 0.15 * len(train) < with_system < 0.35 * len(train)


def test_the_unmasked_variant_trains_every_token_and_the_masked_one_the_answers_only(bench):
    folder, _ = bench
    masked = np.load(folder / "sft-data-assistant" / "train.mask.npy")
    unmasked = np.load(folder / "sft-data-all" / "train.mask.npy")
    assert unmasked.all() and len(unmasked) == len(masked)
    assert 0.1 < masked.mean() < 0.4  # "ab<|end|>" of "<|user|>reverse: ba<|end|><|assistant|>ab<|end|>"
    for run in ("sft-assistant", "sft-all"):
        config = json.loads((folder / run / "config.json").read_text())
        assert config["train"]["init_from"] == str(folder / "base") and config["train"]["max_steps"] == TINY.steps


def test_conversations_are_seeded():
    settings = ChatBenchSettings(train=50, held=5)
    assert make_conversations(settings) == make_conversations(settings)
    assert make_conversations(settings) != make_conversations(ChatBenchSettings(train=50, held=5, seed=1))


def test_bad_bench_flags_are_one_line(capsys, tmp_path):
    assert main(["bench", "chat", "--steps", "0"]) == 2
    assert "--steps must be >= 1, not 0" in capsys.readouterr().err
    assert main(["bench", "chat", "--lr", "0"]) == 2
    assert "--lr must be > 0, not 0.0" in capsys.readouterr().err
    assert main(["bench", "chat", "--held", "30", "--min-len", "1", "--max-len", "1", "--alphabet", "ab", "--keep",
                 str(tmp_path / "kept")]) == 2
    assert "too few" in capsys.readouterr().err
    assert not (tmp_path / "kept").exists() or not any((tmp_path / "kept").iterdir())  # refused before any work
