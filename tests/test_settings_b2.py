"""Settings of the writing verbs (train, prepare) at non-default values through `gptlab VERB`, each held to an
outside reference (docs/design.md, "Boundaries"; tests/boundaries.toml names these tests): the learning rate and
weight decay every optimizer group steps with, against the schedule worked out by hand; the model's shape, against
transformers' GPT-2 of that shape holding the exported weights; the token files, against the documents they hold."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import CORPUS, run_ok, torch_ops_on_one_thread

import gptlab.training.step
import gptlab.training.train
from gptlab.checkpoint import load_run
from gptlab.data.batches import load_dataset

SHAPE = ["--n-layer", "3", "--n-head", "3", "--n-embd", "24", "--vocab-size", "72", "--block-size", "16"]
SCHEDULE = ["--optimizer", "muon", "--lr", "0.01", "--muon-lr", "0.05", "--min-lr", "0.002", "--warmup-steps", "2",
            "--lr-decay-steps", "4", "--weight-decay", "0.3", "--seed", "7"]
# lr_at by hand: warm-up 0.01 x 1/2, 2/2; cosine from step 2 to 4: 0.002 + 0.5 (1 + cos(pi p)) 0.008 at p = 0, 1/2;
# min_lr from step 4 on
LRS = [0.005, 0.01, 0.01, 0.006, 0.002]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_ops_on_one_thread():
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A char run of SHAPE trained with SCHEDULE: 3 steps with --quiet, then resumed to 5 without it; the groups
    (Muon's or not, lr, weight decay, parameters) each step stepped with, and what each session wrote to stderr."""
    root = tmp_path_factory.mktemp("settings-b2")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    steps, errs, real = [], [], gptlab.training.step.step_if_finite
    seeds, generator = [], gptlab.training.step.batch_generator

    def spy(optimizer, loss, norm):
        steps.append([(g.get("muon", False), g["lr"], g["weight_decay"], len(g["params"]))
                      for g in optimizer.param_groups])
        return real(optimizer, loss, norm)

    from gptlab.cli import main

    common = ["--data", str(root / "data"), "--run", str(root / "run"), "--batch-size", "4", "--eval-interval", "5",
              "--eval-batches", "1", "--log-interval", "1", "--precision", "fp32", "--device", "cpu"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gptlab.training.step, "step_if_finite", spy)
        m.setattr(gptlab.training.step, "batch_generator", lambda *a: seeds.append(a) or generator(*a))
        m.setattr(gptlab.training.train, "PLAIN_LINE_SECONDS", 0.0)  # a progress line at every log row
        assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
        for argv in (["--max-steps", "3", "--quiet", *SHAPE, *SCHEDULE], ["--max-steps", "5", "--resume"]):
            err = root / f"err{len(errs)}.txt"
            with open(err, "w") as stream:
                m.setattr(sys, "stderr", stream)
                assert main(["train", *common, *argv]) == 0
            errs.append(err.read_text())
    return SimpleNamespace(root=root, run=root / "run", steps=steps, seeds=seeds, errs=errs)


def test_each_step_steps_with_the_hand_worked_schedule_and_decay(trained):
    """--lr 0.01 --warmup-steps 2 --min-lr 0.002 (--lr-decay-steps 4): the learning rate of each of the 5 steps,
    across the resume; --optimizer muon --muon-lr 0.05: the blocks' matrices in Muon's group at 5x it, the rest in
    AdamW's; --weight-decay 0.3: on the matrices and the embeddings, never on gains and biases; --seed 7: every
    batch drawn from seed 7 (the recipe of its generator: tests/test_data.py)."""
    assert len(trained.steps) == len(LRS)
    assert {a[0] for a in trained.seeds} == {7} and [a[1] for a in trained.seeds if a[2:] == (0,)] == [0, 1, 2, 3, 4]
    for groups, lr in zip(trained.steps, LRS):
        muon, decayed, plain = (next(g for g in groups if pick(g)) for pick in (
            lambda g: g[0], lambda g: not g[0] and g[2] > 0, lambda g: not g[0] and g[2] == 0))
        assert muon[1] == pytest.approx(5 * lr) and decayed[1] == plain[1] == pytest.approx(lr)
        assert (muon[2], decayed[2], plain[2]) == (0.3, 0.3, 0.0)
        # 3 blocks x 4 matrices; the token and position embeddings (the head is the token embedding); 3 blocks x
        # (2 LayerNorms' gain and bias + 4 biases) and ln_f's gain and bias
        assert (muon[3], decayed[3], plain[3], len(groups)) == (3 * 4, 2, 3 * 8 + 2, 3)


def test_the_shape_flags_give_the_gpt2_of_that_shape_in_transformers(trained, capsys):
    """--n-layer 3 --n-head 3 --n-embd 24 --vocab-size 72 --block-size 16: the exported weights in transformers'
    GPT-2 with exactly that shape give the run's logits; the embedding holds 72 rows, the tokenizer's 34 and
    padding (the export cuts the padding)."""
    from transformers import GPT2LMHeadModel

    run_ok(capsys, "export", str(trained.run), "--out", str(trained.root / "hf"))
    hf = GPT2LMHeadModel.from_pretrained(trained.root / "hf").eval()
    assert (hf.config.n_layer, hf.config.n_head, hf.config.n_embd, hf.config.n_positions) == (3, 3, 24, 16)
    ours = load_run(trained.run).model.eval()
    vocab = load_dataset(trained.root / "data").tokenizer.vocab_size
    assert ours.transformer.wte.weight.shape == (72, 24) and hf.config.vocab_size == vocab == 34
    x = torch.as_tensor(load_dataset(trained.root / "data").val[:32].astype("int64")).view(2, 16)
    with torch.no_grad():
        assert (ours(x)[0][..., :vocab] - hf(x).logits).abs().max().item() <= 1e-5


def test_quiet_leaves_out_the_progress_lines_a_session_without_it_prints(trained):
    """--quiet: the first session wrote no progress line; the resumed one, without it, one per step (log interval 1,
    the plain lines of a session without a terminal)."""
    assert not [line for line in trained.errs[0].splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in trained.errs[1].splitlines() if line.startswith("step ")] == [
        "step 4/5", "step 5/5"]


def test_prepare_reads_the_field_holds_out_the_fraction_and_cuts_the_shards_asked_for(tmp_path, capsys):
    """--text-field content, --val-fraction 0.5, --seed 3, --shard-tokens 100: every document (read from its
    "content") lies whole in one split, the held-out ones at least half the characters and short of half by less
    than any document left in training (prepare's rule); the token files of at most 100 tokens each; another seed
    holds out other documents."""
    docs = [f"Doc {i}: " + "ab cd " * (1 + i % 5) + "end." for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
    held = {}
    for seed in ("3", "0"):
        run_ok(capsys, "prepare", str(tmp_path / "d.jsonl"), "--text-field", "content", "--val-fraction", "0.5",
               "--seed", seed, "--shard-tokens", "100", "--out", str(tmp_path / seed), "--quiet")
        ds = load_dataset(tmp_path / seed)
        train, val = (ds.tokenizer.decode(ids.tolist()) for ids in (ds.train, ds.val))
        held[seed] = {i for i, d in enumerate(docs) if d in val}
        assert all((d in train) != (d in val) for d in docs)
        kept, left = sum(len(docs[i]) for i in held[seed]), [len(d) for i, d in enumerate(docs) if i not in held[seed]]
        assert 0 <= sum(map(len, docs)) // 2 - kept < min(left)
        shards = json.loads((tmp_path / seed / "meta.json").read_text())["shards"]
        for split, ids in (("train", ds.train), ("val", ds.val)):
            sizes = [s["tokens"] for s in shards[split]]
            assert sizes == [100] * (len(ids) // 100) + [len(ids) % 100] * (len(ids) % 100 > 0)
    assert held["3"] != held["0"]


class Terminal:
    """A stderr that says it is a terminal, so that progress bars draw on it."""

    def __init__(self):
        self.text = []

    def write(self, text):
        self.text.append(text)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_prepare_draws_its_bars_on_a_terminal_unless_quiet(tmp_path, monkeypatch):
    """--quiet: nothing on the terminal; the same prepare without it draws its scan and encode bars there."""
    from gptlab.cli import main

    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    drawn = {}
    for flags in (["--quiet"], []):
        monkeypatch.setattr(sys, "stderr", Terminal())
        assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "d"), *flags]) == 0
        drawn[bool(flags)] = "".join(sys.stderr.text)
    assert drawn[True] == "" and "scan" in drawn[False] and "encode" in drawn[False]


def test_bench_chat_settings_make_the_conversations_and_runs_asked_for(monkeypatch):
    """--train 40 --min-len 4 (--max-len 5, --seed 9): 40 training conversations whose words are 4 or 5 letters,
    both lengths drawn; the model and fine-tuning settings (--n-layer 2 --n-head 3 --n-embd 24 --steps 7
    --precision bf16) reach the bench as given (its runs: tests/test_bench_chat.py)."""
    from gptlab.bench import chat_finetune
    from gptlab.cli import main

    seen = []
    monkeypatch.setattr(chat_finetune, "run_chat_bench", lambda settings, **kw: seen.append(settings))
    assert main(["bench", "chat", "--train", "40", "--held", "5", "--min-len", "4", "--max-len", "5", "--seed", "9",
                 "--n-layer", "2", "--n-head", "3", "--n-embd", "24", "--steps", "7", "--precision", "bf16"]) == 0
    (settings,) = seen
    assert (settings.n_layer, settings.n_head, settings.n_embd, settings.steps, settings.precision) == (
        2, 3, 24, 7, "bf16")
    train, held = chat_finetune.make_conversations(settings)
    words = [m["content"].removeprefix("reverse: ") for c in train + held for m in c["messages"] if m["role"] == "user"]
    assert len(train) == 40 and len(held) == 5 and {len(w) for w in words} == {4, 5}
    assert train != chat_finetune.make_conversations(chat_finetune.ChatBenchSettings(
        train=40, held=5, min_len=4, max_len=5))[0]  # --seed 9 draws other conversations than seed 0


def test_bench_serve_sends_the_requests_prompt_and_time_limit_asked_for(tmp_path, monkeypatch, capsys):
    """--sequential 1 --clients 2 --requests 4 --max-tokens 3 --prompt-tokens 5 --time-limit 1, each request taking
    0.4 s: one request alone, then each client sends at 0, 0.4 and 0.8 s and not at 1.2 (past the limit), so 6 of
    8 sent; every prompt 5 characters of the char run (one token each). The requests are timed stand-ins: the
    server's answers are tests/test_bench_serve.py's and tests/test_serve.py's."""
    import asyncio

    from gptlab.bench import serve
    from gptlab.cli import main
    from helpers import chat_run

    bodies = []

    async def request(http, body):
        bodies.append(body)
        await asyncio.sleep(0.4)
        return serve.Outcome(200, tokens=body["max_tokens"], ttft=0.1, latency=0.4)

    monkeypatch.setattr(serve, "_one_request", request)
    run = chat_run(tmp_path)
    assert main(["bench", "serve", "--run", str(run), "--precision", "fp32", "--sequential", "1", "--clients", "2",
                 "--requests", "4", "--max-tokens", "3", "--prompt-tokens", "5", "--time-limit", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line[:14].strip(): line[14:].split()[:6] for line in out.splitlines()
            if line.startswith(("one at a time", "concurrent"))}  # clients, requests, ok, 429, errors, tokens
    assert rows == {"one at a time": ["1", "1", "1", "0", "0", "3"], "concurrent": ["2", "6", "6", "0", "0", "18"]}
    assert "not sent (time limit): 2" in out and len(bodies) == 7
    assert {len(b["prompt"]) for b in bodies} == {5} and {b["max_tokens"] for b in bodies} == {3}
