"""Settings of the reading verbs (sample, inspect, the run they read) at non-default values, each held to an outside
reference (docs/design.md, "Boundaries"; tests/boundaries.toml names these tests): what `gptlab sample` prints is
the plain model's forward, step by step over the documented window, with the distribution worked out in numpy
(helpers.reference_probs) and the documented draw (one uniform number of a generator seeded with the seed, placed
in the cumulative distribution); the logit lens's last depth is the plain forward's softmax. The runs here are
written, not trained (a random model moved off its init, so that its next-token distributions are far from
uniform), and decoded by torch ops: the fused kernel's build would cost half a minute, and the settings here act on
the logits whichever step computed them (tests/test_fused.py holds the fused step to the torch forward)."""

import functools
import os

import numpy as np
import pytest
import torch
from helpers import reference_probs, reference_window, run_ok, torch_ops_on_one_thread

from gptlab import rundir
from gptlab.checkpoint import load_run, save_checkpoint
from gptlab.config import ModelConfig, SampleConfig, TrainConfig, to_dict
from gptlab.model import GPT
from gptlab.tokenizer import CharTokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;!?\n"
SEP = "-" * 40 + "\n"  # what sample prints between samples
LABELS = {" ": "\u2423", "\n": "\u21b5"}  # the lens table shows a space as ␣ and a line break as ↵
NEW = 24  # tokens drawn per sample: prompt and continuation stay inside the context of 64, so no window slides
DRAWS = {  # one setting away from its default (temperature 0.8, no top-k, top-p 1, no penalties) each
    "temperature": (["--temperature", "0.5"], dict(temperature=0.5)),
    "top-k": (["--temperature", "1", "--top-k", "3"], dict(temperature=1.0, top_k=3)),
    "top-p": (["--temperature", "1", "--top-p", "0.4"], dict(temperature=1.0, top_p=0.4)),
    "presence": (["--temperature", "1", "--presence-penalty", "1.5"], dict(temperature=1.0, presence_penalty=1.5)),
    "repetition": (["--temperature", "1", "--repetition-penalty", "3"], dict(temperature=1.0, repetition_penalty=3.0)),
}


@pytest.fixture(autouse=True)
def torch_step():
    with torch_ops_on_one_thread():
        yield


def written_run(run, seed=0):
    """A run folder at `run` holding a 1-layer char model (context 64) with every weight moved off its init by
    seeded noise of 0.3, as training would leave it, and its best checkpoint."""
    tokenizer = CharTokenizer(ALPHABET)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=noise))
    train_cfg = TrainConfig(max_steps=1)
    rundir.init_run(run, cfg, train_cfg, tokenizer, {"preset": "char-quick"})
    state = rundir.TrainingState(model=to_dict(cfg), train=to_dict(train_cfg), best_val_loss=1.0, val_loss=1.0)
    save_checkpoint(run, "best", 1, model, state, extra_files={"tokenizer.json": (run / "tokenizer.json").read_bytes()})
    return run


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return written_run(tmp_path_factory.mktemp("settings-b") / "run")


@functools.cache
def loaded_run(run):
    return load_run(run)


@torch.no_grad()
def reference_text(run, prompt, cfg, seed, n=NEW):
    """The text drawn after `prompt`: each step the plain forward over the documented window, the distribution
    from reference_probs with the penalties counted over the prompt and the tokens drawn, then one uniform number
    of a generator seeded with `seed` placed in its cumulative sum; cut before the first of cfg.stop."""
    loaded = loaded_run(run)
    model, tokenizer, block = loaded.model.eval(), loaded.tokenizer, loaded.model.config.block_size
    ids, drawn, generator = tokenizer.encode(prompt), [], torch.Generator().manual_seed(seed)
    for _ in range(n):
        logits = model(torch.tensor([reference_window(ids, drawn, block)]))[0][0, -1].double().numpy()
        counts = np.bincount(ids[-block:] + drawn, minlength=len(logits))
        probs, margin = reference_probs(logits, counts, cfg)
        assert margin > 1e-6  # no top-p boundary close enough to round either way in float32
        drawn.append(int(np.searchsorted(np.cumsum(probs), torch.rand(1, generator=generator).item(), side="right")))
        text = tokenizer.decode(drawn)
        hits = [text.index(s) for s in cfg.stop if s in text]
        if hits:
            return text[:min(hits)]
    return tokenizer.decode(drawn)


@pytest.mark.parametrize("case", DRAWS)
def test_each_sampling_setting_draws_what_the_plain_forward_and_the_documented_draw_give(written, capsys, case):
    """--temperature, --top-k, --top-p, --presence-penalty, --repetition-penalty (and --prompt, --seed) through
    `gptlab sample`, against the text drawn by hand from the plain forward; and the setting shows (the default
    draws another text)."""
    flags, settings = DRAWS[case]
    argv = ["sample", "--run", str(written), "--prompt", "All:", "--max-new-tokens", str(NEW), "--seed", "5",
            "--precision", "fp32", "--device", "cpu"]
    expected = reference_text(written, "All:", SampleConfig(max_new_tokens=NEW, seed=5, **settings), seed=5)
    assert run_ok(capsys, *argv, *flags) == "All:" + expected + "\n"
    assert expected != reference_text(written, "All:", SampleConfig(max_new_tokens=NEW, seed=5), seed=5)


def test_samples_seeds_stop_strings_no_echo_and_a_prompt_file(written, capsys, tmp_path):
    """--prompt-file's text is the prompt; --num-samples 3 draws sample i with --seed + i; --stop cuts each sample
    before its first stop string; --no-echo leaves the prompt out: all against the hand-drawn texts."""
    (tmp_path / "prompt.txt").write_text("Speak, speak.\n", encoding="utf-8")
    cfg = SampleConfig(max_new_tokens=NEW, temperature=1.0, stop=["k", "z"])
    expected = [reference_text(written, "Speak, speak.\n", cfg, seed=11 + i) for i in range(3)]
    assert len(set(expected)) == 3 and all(len(text) < NEW for text in expected)  # premise: each one was cut
    out = run_ok(capsys, "sample", "--run", str(written), "--prompt-file", str(tmp_path / "prompt.txt"),
                 "--num-samples", "3", "--seed", "11", "--temperature", "1", "--stop", "k", "--stop", "z",
                 "--max-new-tokens", str(NEW), "--no-echo", "--precision", "fp32", "--device", "cpu")
    assert out == SEP.join(text + "\n" for text in expected)
    echoed = run_ok(capsys, "sample", "--run", str(written), "--prompt-file", str(tmp_path / "prompt.txt"),
                    "--seed", "12", "--temperature", "1", "--stop", "k", "--stop", "z", "--max-new-tokens", str(NEW),
                    "--precision", "fp32", "--device", "cpu")
    assert echoed == "Speak, speak.\n" + expected[1] + "\n"  # without --no-echo: the prompt first


def test_the_lens_shows_the_top_tokens_of_the_plain_forward_at_its_last_depth(written, capsys, tmp_path):
    """`inspect lens --top 3 --out DIR`: at the last depth each position's cell is the 3 most likely next tokens of
    the plain forward with their probabilities; the picture is written in DIR."""
    out = run_ok(capsys, "inspect", "lens", "--run", str(written), "--prompt", "All:", "--top", "3", "--out",
                 str(tmp_path / "pics"))
    lines = out.splitlines()
    assert lines[-1] == str(tmp_path / "pics" / "lens.png") and (tmp_path / "pics" / "lens.png").is_file()
    loaded = load_run(written)
    ids = loaded.tokenizer.encode("All:")
    with torch.no_grad():
        probs = torch.softmax(loaded.model(torch.tensor([ids]))[0][0].double(), dim=-1)  # (T, V): every position
    rows = lines[2:-1]
    assert len(rows) == len(ids)
    for t, row in enumerate(rows):
        top = probs[t].topk(3)
        cells = row.split()[-6:]  # the last depth: token, probability, three times
        shown = [LABELS.get(c, c) for c in map(loaded.tokenizer.decode, [[int(i)] for i in top.indices])]
        assert cells == [x for label, v in zip(shown, top.values) for x in (label, f"{v:.2f}")]


def test_reading_verbs_take_the_run_named_and_else_the_most_recent(tmp_path, monkeypatch, capsys):
    """--run names the run a reading verb uses; without it, the most recent under runs/: each text is the one drawn
    by hand from that run's plain forward (two runs of other weights)."""
    monkeypatch.chdir(tmp_path)
    older, newer = written_run(tmp_path / "runs" / "older", seed=1), written_run(tmp_path / "runs" / "newer", seed=2)
    os.utime(older / "config.json", (1e9, 1e9))  # trained long before the other (the most recent: by config.json)
    drawn = SampleConfig(max_new_tokens=12, temperature=1.0, seed=3)
    want = {run.name: "All:" + reference_text(run, "All:", drawn, seed=3, n=12) + "\n" for run in (older, newer)}
    assert want["older"] != want["newer"]  # premise: the runs answer apart
    flags = ["--prompt", "All:", "--max-new-tokens", "12", "--temperature", "1", "--seed", "3", "--precision", "fp32"]
    assert run_ok(capsys, "sample", "--run", "runs/older", *flags) == want["older"]
    assert run_ok(capsys, "sample", *flags) == want["newer"]
