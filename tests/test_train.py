import copy
import dataclasses
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

from helpers import CORPUS, tiny_config, tree
from gptlab import checkpoint as ck
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.batches import load_dataset
from gptlab.errors import GptlabError
from gptlab.model import GPT, Bigram
from gptlab.optim import lr_at, param_groups
from gptlab.runtime import bf16_supported
from gptlab.training import train as training
from gptlab.training.step import StepContext, estimate_loss, train_step
from gptlab.training.train import train


def quick(**overrides) -> TrainConfig:
    base = dict(batch_size=4, max_steps=12, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_interval=6,
                eval_batches=2, log_interval=2, precision="fp32", device="cpu")
    return TrainConfig(**{**base, **overrides})


def model_cfg(**overrides):
    return tiny_config(vocab_size=0, **overrides)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_weight_decay_only_on_matrices():
    """Every parameter in exactly one group, told apart by its name: LayerNorm gains and biases do not decay; the
    embeddings (the tied head with them) and the linear weights do."""
    model = GPT(tiny_config(bias=True))
    names = {id(p): name for name, p in model.named_parameters()}
    decay, no_decay = param_groups(model.parameters(), 0.1)
    plain = sorted(n for n in names.values() if n.endswith(".bias") or ".ln_" in n)
    assert sorted(names[id(p)] for p in no_decay["params"]) == plain and len(plain) == 2 * 2 * 4 + 2
    assert sorted(names[id(p)] for p in decay["params"]) == sorted(set(names.values()) - set(plain))
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_training_lowers_the_loss_and_writes_a_complete_run(tmp_path, char_data):
    result = train(char_data, tmp_path / "run", model_cfg(), quick(max_steps=40, eval_interval=20), quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["val_loss"] < 3.0 < rows[0]["loss"]  # down from near ln(34) = 3.53, uniform
    assert all({"loss", "grad_norm", "lr", "tokens_per_s"} <= set(r) for r in rows if r["kind"] == "train")
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert ck.find_checkpoint(tmp_path / "run", "step").step == 40
    assert ck.find_checkpoint(tmp_path / "run", "best") is not None
    assert result.step == 40 and result.val_loss == evals[-1]["val_loss"]


def test_every_file_of_a_run_honours_the_umask(tmp_path, char_data):
    """Checkpoints' safetensors files too (the library writing them makes them 0600): a run folder can be shared
    as the umask says, like every other file in it."""
    before = os.umask(0o027)
    try:
        train(char_data, tmp_path / "run", model_cfg(), quick(max_steps=6), quiet=True)
    finally:
        os.umask(before)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert "run/checkpoints/step-00000006/model.safetensors" in modes
    assert modes == dict.fromkeys(modes, oct(0o640))


def test_checkpoint_round_trip_gives_the_trained_models_logits(tmp_path, char_data, monkeypatch):
    """The model loaded from the last checkpoint against the one training held in memory when it wrote it (a
    copy taken then): the same weights, and in eval mode (dropout off) the same logits."""
    save, held = ck.save_checkpoint, {}

    def keep_a_copy(run, kind, step, model, *args, **kwargs):
        held[kind, step] = copy.deepcopy(model)
        return save(run, kind, step, model, *args, **kwargs)

    monkeypatch.setattr(ck, "save_checkpoint", keep_a_copy)
    train(char_data, tmp_path / "run", model_cfg(dropout=0.2), quick(), quiet=True)
    reference = held["step", 12].eval()
    loaded = ck.load_run(tmp_path / "run", which="last")
    torch.manual_seed(quick().seed)  # the weights training started from
    fresh = GPT(loaded.model_cfg).state_dict()
    trained = reference.state_dict()
    assert all(not torch.equal(fresh[k], trained[k]) for k in trained if k.endswith("weight"))  # every one moved
    assert loaded.model_cfg == reference.config and loaded.checkpoint.step == 12
    assert all(torch.equal(v, trained[k]) for k, v in loaded.model.state_dict().items())
    idx = torch.randint(0, loaded.model_cfg.vocab_size, (8, 16))
    with torch.no_grad():
        assert torch.equal(loaded.model(idx)[0], reference(idx)[0])
    state = json.loads((loaded.checkpoint.path / "state.json").read_text())
    assert state["step"] == 12 and state["tokens_seen"] == 12 * 4 * 16


def losses(history):
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in history]


def test_resume_continues_exactly(tmp_path, char_data):
    straight = train(char_data, tmp_path / "a", model_cfg(dropout=0.1), quick(lr_decay_steps=12), quiet=True)
    first = train(char_data, tmp_path / "b", model_cfg(dropout=0.1), quick(max_steps=6, lr_decay_steps=12),
                  quiet=True)
    resumed = train(char_data, tmp_path / "b", model_cfg(dropout=0.1), quick(lr_decay_steps=12), resume=True,
                    quiet=True)
    a = ck.load_run(tmp_path / "a", which="last").model.state_dict()
    b = ck.load_run(tmp_path / "b", which="last").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(straight.history) == losses(first.history + resumed.history)


def test_resume_refuses_a_different_model_shape_or_data(tmp_path, char_data, corpus_file):
    train(char_data, tmp_path / "run", model_cfg(), quick(max_steps=6), quiet=True)
    with pytest.raises(GptlabError, match="n_layer=2 \\(now 3\\)"):
        train(char_data, tmp_path / "run", model_cfg(n_layer=3), quick(), resume=True, quiet=True)
    from gptlab.data.prepare import prepare

    other = tmp_path / "other"
    corpus_file.write_text(corpus_file.read_text()[::-1])  # same characters, different data
    prepare([str(corpus_file)], other, "char", quiet=True)
    with pytest.raises(GptlabError, match="different data"):
        train(other, tmp_path / "run", model_cfg(), quick(), resume=True, quiet=True)


def test_resume_refuses_data_whose_tokenizer_is_not_the_runs(tmp_path, char_data):
    run = tmp_path / "run"
    train(char_data, run, model_cfg(), quick(max_steps=6), quiet=True)
    other = tmp_path / "relabelled"
    shutil.copytree(char_data, other)  # the same token files and meta.json: the same data fingerprint
    tok = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    assert tok["chars"][-1] == "z"
    tok["chars"][-1] = "é"  # the last id decodes to another character; the vocabulary's size is the same
    (other / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    before = tree(run)
    with pytest.raises(GptlabError, match=re.escape(f"the tokenizer of {other} is not the run's")):
        train(other, run, model_cfg(), quick(), resume=True, quiet=True)
    assert tree(run) == before


def test_corpus_shorter_than_a_block_is_refused(tmp_path):
    from gptlab.data.prepare import prepare

    (tmp_path / "short.txt").write_text("tiny text, far too short\n" * 2)
    prepare([str(tmp_path / "short.txt")], tmp_path / "d", "char", quiet=True)
    with pytest.raises(GptlabError, match="fewer than block_size \\+ 1 = 17"):
        train(tmp_path / "d", tmp_path / "run", model_cfg(), quick(), quiet=True)


@pytest.mark.device_path("bf16 native")
@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="this CPU has no native bf16")
def test_bf16_autocast_trains_close_to_fp32(tmp_path, char_data):
    fp32 = train(char_data, tmp_path / "a", model_cfg(), quick(max_steps=20), quiet=True)
    bf16 = train(char_data, tmp_path / "b", model_cfg(), quick(max_steps=20, precision="bf16"), quiet=True)
    assert abs(fp32.val_loss - bf16.val_loss) < 0.05


def test_a_step_and_an_evaluation_read_everything_but_the_model_from_one_context(char_data):
    """A bigram table of zeros predicts every character alike, so its loss is ln V on both splits (V: the corpus's
    distinct characters); a step at 4 of 10 warm-up steps runs at 5/10 of the peak rate; applied, it lowers the
    loss."""
    V = len(set(CORPUS))
    ctx = StepContext(load_dataset(char_data), quick(lr=1e-2, warmup_steps=10), 16, torch.device("cpu"), "fp32")
    model = Bigram(ModelConfig(arch="bigram", vocab_size=V, block_size=16, n_layer=1, n_head=1, n_embd=1))
    assert estimate_loss(model, ctx) == pytest.approx({"train": math.log(V), "val": math.log(V)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loss, _ = train_step(model, optimizer, ctx, 4)
    assert loss.item() == pytest.approx(math.log(V)) and optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert estimate_loss(model, ctx)["train"] < math.log(V) and ctx.parallel.world_size == 1


class Recorded(torch.nn.Module):
    """A model that keeps every (x, y) it is asked to score."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, x, y=None):
        self.seen.append((x.clone(), y.clone()))
        return self.model(x, y)


def test_an_evaluation_stops_at_one_pass_over_a_small_split_and_samples_a_large_one(char_data):
    """Issue 41: a split of a few hundred tokens was read eval_batches x batch_size windows at a time. Where that is
    more rows than one pass over it takes, the evaluation scores each target once, in order (rows of up to
    block_size, the last padded with -1), and its loss is the mean over the split's targets, as `gptlab eval`
    counts them; a larger split is still sampled, eval_batches batches of it."""
    from gptlab.evaluate import total_nats

    ds = load_dataset(char_data)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))
    ctx = StepContext(ds, quick(eval_batches=200), 16, torch.device("cpu"), "fp32")
    recorded = Recorded(model)
    losses = estimate_loss(recorded, ctx)
    for split, first in (("train", 0), ("val", math.ceil((len(ds.train) - 1) / 16 / 4))):
        tokens = torch.as_tensor(ds.split(split).astype("int64"))
        rows = math.ceil((len(tokens) - 1) / 16)  # one pass: far fewer than the 200 x 4 rows asked for
        seen = recorded.seen[first:first + math.ceil(rows / 4)]
        assert all(x.shape == y.shape == (4, 16) for x, y in seen)
        targets = torch.cat([y.flatten() for _, y in seen])
        assert torch.equal(targets[targets != -1], tokens[1:])  # every target once, in order
        nats, count = total_nats(model, tokens.numpy(), precision="fp32")
        assert count == len(tokens) - 1 and losses[split] == pytest.approx(nats / count, rel=1e-5)
    assert len(recorded.seen) == math.ceil((len(ds.train) - 1) / 16 / 4) + math.ceil((len(ds.val) - 1) / 16 / 4)
    recorded.seen.clear()
    estimate_loss(recorded, StepContext(ds, quick(eval_batches=3), 16, torch.device("cpu"), "fp32"))
    assert len(recorded.seen) == 2 * 3 and all(bool((y != -1).all()) for _, y in recorded.seen)  # sampled


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_a_split_whose_pass_is_exactly_the_rows_asked_for_is_passed_once(char_data, extra):
    """The edge of the rule above: eval_batches x batch_size rows one below, at and one past one pass over val.
    At and past it, val is passed once (every target in order); below it, sampled (no padding, no order)."""
    ds = load_dataset(char_data)
    rows = math.ceil((len(ds.val) - 1) / 16)
    recorded = Recorded(GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16)))
    estimate_loss(recorded, StepContext(ds, quick(batch_size=rows + extra, eval_batches=1), 16, torch.device("cpu"),
                                        "fp32"))
    (_, train_y), (_, val_y) = recorded.seen  # train's split is far larger: one sampled batch of it
    tokens = torch.as_tensor(ds.val.astype("int64"))
    assert val_y.shape == (rows + extra, 16) and bool((train_y != -1).all())
    targets = val_y.flatten()
    assert torch.equal(targets[targets != -1], tokens[1:]) == (extra >= 0)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_a_conversation_split_of_exactly_the_rows_asked_for_is_passed_once(extra):
    """The same edge for conversations, whose pass takes a row per piece: 6 pieces of val against eval_batches x
    batch_size = 6 + extra rows. At and past it, one row from each piece's start, in order; below it, sampled."""
    from pathlib import Path

    from gptlab.data.batches import Dataset

    train, val = np.arange(0, 400) % 50, np.arange(0, 60) % 50
    starts = {"train": np.arange(0, 401, 8), "val": np.arange(0, 61, 10)}
    chat = {split: (np.ones(len(t), dtype=np.uint8), starts[split]) for split, t in (("train", train), ("val", val))}
    ds = Dataset(Path("."), train, val, None, {}, chat)
    recorded = Recorded(GPT(tiny_config(vocab_size=50, block_size=16)))
    estimate_loss(recorded, StepContext(ds, quick(batch_size=6 + extra, eval_batches=1), 16, torch.device("cpu"),
                                        "fp32"))
    (_, _), (x, _) = recorded.seen
    in_order = x.shape == (6 + extra, 16) and x[:6, 0].tolist() == [0, 10, 20, 30, 40, 0]
    assert in_order == (extra >= 0), x[:, 0].tolist()


def test_a_pass_whose_last_batch_holds_one_target_counts_its_loss(char_data):
    """One pass of 3 rows in batches of 2 over a split of 2 x 16 + 2 tokens: the last batch holds one target (and
    a row of padding), and the loss is still the mean over all 33 targets."""
    from gptlab.evaluate import total_nats

    ds = load_dataset(char_data)
    val = np.asarray(ds.val)[:34]
    ds = dataclasses.replace(ds, val=val)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # away from the initial values: every target's loss differs
    loss = estimate_loss(model, StepContext(ds, quick(batch_size=2, eval_batches=5), 16, torch.device("cpu"),
                                            "fp32"))["val"]
    nats, count = total_nats(model, val.astype("int64"), precision="fp32")
    assert count == 33 and loss == pytest.approx(nats / count, rel=1e-5)


def test_a_sampled_evaluation_draws_fixed_batches_of_its_own_seeded_by_the_run(char_data):
    """Where a split is sampled, its eval_batches batches are the same at every evaluation whatever torch's global
    random state, differ from each other, change with the run's --seed, and are none of the batches a training step
    draws (two micro-batches a step here)."""
    ds = load_dataset(char_data)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))

    def drawn(seed, steps=0):
        recorded = Recorded(model)
        ctx = StepContext(ds, quick(eval_batches=3, seed=seed, grad_accum=2), 16, torch.device("cpu"), "fp32")
        estimate_loss(recorded, ctx)
        optimizer = torch.optim.SGD(recorded.parameters(), lr=0.0)
        for step in range(steps):
            train_step(recorded, optimizer, ctx, step)
        return [x for x, _ in recorded.seen[:3]], [x for x, _ in recorded.seen[6:]]  # train's 3; the steps'

    torch.manual_seed(1)
    first, trained = drawn(7, steps=3)
    torch.manual_seed(2)
    again, _ = drawn(7)
    other, _ = drawn(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for i, a in enumerate(first) for b in first[i + 1:])
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    assert len(trained) == 3 * 2 and not any(torch.equal(a, b) for a in first for b in trained)


@pytest.mark.parametrize("clip", [0.05, 0.0, 1e6])
def test_a_step_applies_the_mean_gradient_of_its_micro_batches_clipped_to_grad_clip(char_data, clip):
    """train_step with grad_accum 2 and plain SGD at a constant rate 1 in a group of lr_scale 0.5: the update is
    -0.5 x the gradient of the mean loss over the two micro-batches it drew (worked out here from those batches),
    scaled down to norm grad_clip when larger (0: never), and it returns that gradient's norm before clipping."""
    ds = load_dataset(char_data)
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))
    plain = copy.deepcopy(model)
    recorded = Recorded(model)
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "lr_scale": 0.5}], lr=0.0)
    ctx = StepContext(ds, quick(grad_accum=2, grad_clip=clip, lr=1.0, min_lr=1.0, warmup_steps=0), 16,
                      torch.device("cpu"), "fp32")
    loss, norm = train_step(recorded, optimizer, ctx, 0)
    assert len(recorded.seen) == 2 and optimizer.param_groups[0]["lr"] == 0.5
    mean = sum(plain(x, y)[1] for x, y in recorded.seen) / 2
    mean.backward()
    grads = [p.grad for p in plain.parameters()]
    whole = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert loss.item() == pytest.approx(mean.item(), rel=1e-6) and norm.item() == pytest.approx(whole, rel=1e-5)
    scale = min(1.0, clip / whole) if clip > 0 else 1.0
    assert whole > 0.05 and (scale < 1) == (clip == 0.05)  # the clip bites at 0.05 alone
    for p, q, g in zip(model.parameters(), plain.parameters(), grads):
        torch.testing.assert_close(p.detach() - q.detach(), -0.5 * scale * g, rtol=1e-4, atol=1e-7)


def test_a_step_whose_loss_is_not_finite_is_not_applied_and_says_which_step(char_data):
    """On the CPU (where the host learns it at once) a step whose loss is nan raises NonFiniteLoss naming the step
    counted from 1, and the weights stay as they were."""
    from gptlab.training.faults import NonFiniteLoss

    ds = load_dataset(char_data)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = StepContext(ds, quick(lr=1.0, min_lr=1.0, warmup_steps=0), 16, torch.device("cpu"), "fp32")
    with pytest.raises(NonFiniteLoss) as raised:
        train_step(model, optimizer, ctx, 4)
    assert str(raised.value) == ("step 5: the loss (nan) or gradient norm (nan) is not finite, so the step was not "
                                 "applied")
    after = model.state_dict()
    assert optimizer.param_groups[0]["lr"] == 1.0  # the step would have moved them
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before)


class LastOfFour:
    """The view of the last of four processes (rank 3): the last quarter of each batch's rows, sums left alone."""
    world_size = 4

    def local_rows(self, *tensors):
        return tuple(t.chunk(4)[3] for t in tensors)

    def mean(self, value):
        return value


def test_a_process_whose_rows_of_a_pass_are_only_padding_adds_no_loss(char_data):
    """One pass over val: 44 rows in batches of 8, the last padded by four rows, which are the two the last process
    gets of it: it scores no target there (its loss would be nan), and its result is the mean over the targets of
    the rows it did get, the last two of each full batch."""
    from gptlab.evaluate import total_nats

    ds = load_dataset(char_data)
    model = GPT(tiny_config(vocab_size=ds.tokenizer.vocab_size, block_size=16))
    ctx = StepContext(ds, quick(batch_size=8, eval_batches=200), 16, torch.device("cpu"), "fp32",
                      parallel=LastOfFour())
    val = torch.as_tensor(ds.val.astype("int64"))
    assert math.ceil((len(val) - 1) / 16) == 44
    rows = [val[16 * r:16 * r + 17] for b in range(5) for r in (8 * b + 6, 8 * b + 7)]
    nats = sum(total_nats(model, r.numpy(), precision="fp32")[0] for r in rows)
    assert estimate_loss(model, ctx)["val"] == pytest.approx(nats / (16 * len(rows)), rel=1e-5)


def test_everything_the_loop_carries_is_declared(tmp_path, char_data, monkeypatch):
    """The loop keeps no state but the Trainer's declared fields: after a run, the trainer holds exactly them."""
    held = {}
    loop = training.Trainer.loop

    def watched(self, quiet):
        result = loop(self, quiet)
        held.update(vars(self))
        return result

    monkeypatch.setattr(training.Trainer, "loop", watched)
    train(char_data, tmp_path / "run", model_cfg(), quick(max_steps=4, eval_interval=2), quiet=True)
    assert set(held) == {f.name for f in dataclasses.fields(training.Trainer)}
    assert held["clock"].start_step == 0 and held["progress"].step == 4 and len(held["history"]) == 4


def test_the_summary_of_a_resumed_run_counts_this_sessions_steps_with_its_seconds(tmp_path, char_data, capsys):
    from helpers import TINY, run_ok

    run = str(tmp_path / "run")
    first = run_ok(capsys, "train", "--data", str(char_data), "--run", run, *TINY, "--max-steps", "5")
    assert f"run {run}: 5 steps in " in first
    again = run_ok(capsys, "train", "--run", run, "--resume", "--max-steps", "8", "--quiet")
    assert f"run {run}: 3 steps (5 to 8) in " in again
    result = train(char_data, run, model_cfg(n_layer=1, n_head=2, n_embd=16), quick(max_steps=10), resume=True,
                   quiet=True)
    assert (result.start_step, result.step) == (8, 10)


def test_a_run_from_init_from_weights_not_read_is_refused_but_a_full_fine_tune_resumes_without_them():
    """runs.start reads cfg.init_from's weights; train() given none refuses a new run, and a LoRA run even when it
    resumes (its base is in no checkpoint of its own), but resumes a full fine-tune from its own checkpoint."""
    from gptlab.training.preflight import check_init_weights

    full, adapters = TrainConfig(init_from="runs/base"), TrainConfig(init_from="runs/base", lora_rank=4)
    for cfg, resume in ((full, False), (adapters, False), (adapters, True)):
        with pytest.raises(GptlabError, match="init_from 'runs/base' needs its weights"):
            check_init_weights(cfg, resume, None)
    check_init_weights(full, True, None)
    check_init_weights(adapters, True, {})  # the base's weights, read
    check_init_weights(TrainConfig(), False, None)  # a run from scratch
