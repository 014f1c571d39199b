"""Activation checkpointing (--activation-checkpointing): each block recomputed in backward gives the plain path's
gradients bit for bit in fp32 with dropout on (the recomputation redraws the same masks) and under bf16 autocast
(held to 1e-6); only a training forward with gradients and no cache recomputes; it composes with compile, DDP and
FSDP, and so does --loss-chunk beside it (the plain run's numbers to fp32's rounding); a CLI run with it resumes exactly, with it switched either way; bigram and the reference engine refuse it;
`bench train --activation-checkpointing` measures it."""

import json
import os
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
import torch.utils.checkpoint

from helpers import CORPUS, tiny_config
from gptlab import checkpoint as ck
from gptlab.bench import device_peak
from gptlab.bench.memory import saved_bytes
from gptlab.bench.train_speed import checkpointing_variants, run_train_bench
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.model import GPT
from gptlab.peak import Peak
from gptlab.runtime import autocast
from gptlab.training import train as training
from gptlab.training.train import train

SHAPE = dict(vocab_size=37, block_size=16, n_layer=3, n_head=3, n_embd=36, dropout=0.1)  # odd sizes on purpose
CPU = torch.device("cpu")


def moved_model(**overrides) -> GPT:
    """A GPT with every parameter moved away from its initial value (LayerNorms start at gain 1 and bias 0, which
    would hide a gradient computed from the wrong ones)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**SHAPE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def batch(rows: int = 3, T: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets, T not a power of two."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 37, (rows, T), generator=g), torch.randint(0, 37, (rows, T), generator=g)


def gradients(model: GPT, checkpointing: bool, precision: str = "fp32"):
    """One training forward and backward from the same random state: (loss, {name: gradient}, the random state
    after it)."""
    model.train()
    model.zero_grad(set_to_none=True)
    model.checkpoint_blocks = checkpointing
    torch.manual_seed(5)
    with autocast(CPU, precision):
        loss = model(*batch())[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, torch.get_rng_state()


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_gradients_equal_the_plain_paths_bit_for_bit_in_fp32_with_dropout(attention):
    model = moved_model(attention=attention)
    plain_loss, plain, plain_rng = gradients(model, False)
    loss, grads, rng = gradients(model, True)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in plain), \
        max((grads[n] - plain[n]).abs().max().item() for n in plain)
    assert torch.equal(rng, plain_rng)  # the recomputation leaves the generator where the plain step does
    assert all(g.abs().sum() > 0 for g in plain.values())


def test_gradients_under_bf16_autocast_are_within_1e_6_of_the_plain_paths():
    """Stated tolerance 1e-6 (absolute, every element); measured here: 0, the recomputation is deterministic."""
    model = moved_model()
    plain_loss, plain, _ = gradients(model, False, "bf16")
    loss, grads, _ = gradients(model, True, "bf16")
    assert torch.equal(loss, plain_loss)
    assert max((grads[n] - plain[n]).abs().max().item() for n in plain) <= 1e-6


@pytest.fixture
def recomputed(monkeypatch) -> list[int]:
    """Counts the blocks run through torch's checkpoint."""
    calls, real = [], torch.utils.checkpoint.checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    return calls


def test_only_a_training_forward_with_gradients_and_no_cache_recomputes(recomputed):
    model = moved_model(dropout=0.0)
    model.checkpoint_blocks = True
    x, _ = batch()
    model.train()
    want = model(x)[0]
    assert len(recomputed) == SHAPE["n_layer"]
    model.eval()
    assert torch.equal(model(x)[0], want) and len(recomputed) == 3  # dropout is 0: eval computes the same
    model.train()
    with torch.no_grad():
        model(x)
    cache = model.new_kv_cache(3)
    cached = model(x, kv_cache=cache)[0]
    assert len(recomputed) == 3
    assert (cached - want).abs().max() < 1e-5 and cache.pos.tolist() == [13] * 3


def test_checkpointing_keeps_each_blocks_input_and_a_fraction_of_what_the_plain_forward_keeps():
    x, y = batch()
    kept = {}
    for n_layer in (2, 4):
        model = moved_model(n_layer=n_layer)
        model.checkpoint_blocks = True
        kept[n_layer] = saved_bytes(model, lambda: model(x, y))
    assert kept[4] - kept[2] == 2 * 3 * 13 * 36 * 4  # two blocks more: two inputs more, (B, T, C) in fp32
    model.checkpoint_blocks = False
    plain = saved_bytes(model, lambda: model(x, y))
    assert kept[4] < plain / 3, (kept, plain)
    linear, x = torch.nn.Linear(8, 8, bias=False), torch.randn(4, 8, requires_grad=True)
    assert saved_bytes(linear, lambda: linear(x)) == x.nbytes  # the weight it saves too is a parameter


def test_measuring_what_a_forward_keeps_lets_all_of_it_go_afterwards():
    """The pack hook must not hand autograd back the tensor itself: a saved output would then hold its own graph
    node, and the whole graph would never be freed (the bench's later measurements would count it)."""
    model = moved_model(attention="naive")  # its softmax saves its output
    x, y = batch()
    kept = []
    handle = model.transformer.ln_f.register_forward_hook(lambda m, args, out: kept.append(weakref.ref(out)))
    model.train()
    assert saved_bytes(model, lambda: model(x, y)) > 0
    handle.remove()
    assert kept and kept[0]() is None  # ln_f's output, saved by the LM head, was freed with the graph


@pytest.mark.device_path("torch.compile")
def test_compiled_training_with_checkpointing_matches_eager_without(tmp_path, char_data, caplog, monkeypatch):
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile's CPU backend (inductor) needs a C++ compiler and none is on PATH")
    shape = dict(vocab_size=0, n_layer=1, bias=False)  # no key bias: its true gradient is 0, Adam amplifies noise
    settings = dict(batch_size=4, max_steps=2, lr=3e-3, warmup_steps=1, eval_interval=2, eval_batches=2,
                    log_interval=1, precision="fp32", device="cpu")
    compiling, compile_model = [], training.compile_model
    monkeypatch.setattr(training, "compile_model", lambda model, warm_up: compiling.append(
        (model.checkpoint_blocks, model.loss_chunk)) or compile_model(model, warm_up))
    compiled = train(char_data, tmp_path / "compiled", tiny_config(**shape),
                     TrainConfig(**settings, compile=True, activation_checkpointing=True, loss_chunk=7), quiet=True)
    assert "torch.compile is unavailable" not in caplog.text, caplog.text
    assert compiling == [(True, 7)]  # the model compiled recomputes its blocks and its loss in chunks (no spy here:
    # dynamo would stop at it)
    eager = train(char_data, tmp_path / "eager", tiny_config(**shape), TrainConfig(**settings), quiet=True)
    losses = [[r["loss"] for r in result.history if r["kind"] == "train"] for result in (compiled, eager)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert compiled.val_loss == pytest.approx(eager.val_loss, rel=1e-5)


PARALLEL_SCRIPT = """
import json, sys
import torch.utils.checkpoint
from gptlab.config import ModelConfig, TrainConfig
from gptlab.training.train import train

calls, real = [0], torch.utils.checkpoint.checkpoint
def counted(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)
torch.utils.checkpoint.checkpoint = counted
data, root = sys.argv[1:3]
shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
for mode in ("ddp", "fsdp"):
    out = {}
    for name, on, chunk in (("False", False, 0), ("True", True, 0), ("chunked", True, 5)):
        calls[0] = 0
        settings = TrainConfig(batch_size=4, grad_accum=2, max_steps=2, lr=3e-3, warmup_steps=1, eval_interval=2,
                               eval_batches=1, log_interval=1, precision="fp32", device="cpu", fsdp=mode == "fsdp",
                               activation_checkpointing=on, loss_chunk=chunk)
        result = train(data, f"{root}/{mode}-{name}", ModelConfig(**shape), settings, quiet=True)
        rows = [(r["step"], r["loss"], r["grad_norm"]) for r in result.history if r["kind"] == "train"]
        out[name] = {"rows": rows, "val": result.val_loss, "calls": calls[0]}
    json.dump(out, open(f"{root}/{mode}-rank{result.rank}.json", "w"))
"""


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """2 processes (torchrun, gloo) train 2 steps of 2 micro-steps with dropout 0.1, without and with activation
    checkpointing, under DDP and then FSDP (one launch for both: starting processes is most of the time)."""
    from gptlab.data.prepare import prepare

    root = tmp_path_factory.mktemp("parallel")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([str(root / "corpus.txt")], root / "data", "char", quiet=True)
    (root / "run.py").write_text(PARALLEL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(root / "run.py"), str(root / "data"), str(root)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_train_the_same_numbers_with_and_without_it(mode, parallel_runs):
    """The same losses, gradient norms and weights bit for bit, each process recomputing its blocks."""
    for rank in (0, 1):
        out = json.loads((parallel_runs / f"{mode}-rank{rank}.json").read_text())
        assert out["True"]["rows"] == out["False"]["rows"] and out["True"]["val"] == out["False"]["val"]
        assert out["False"]["calls"] == 0 and out["True"]["calls"] >= 2 * 2 * 2  # blocks x micro-steps x steps
        chunked, plain = out["chunked"], out["False"]  # --loss-chunk too: the same numbers to fp32's rounding
        assert [r[0] for r in chunked["rows"]] == [r[0] for r in plain["rows"]]
        assert [r[1:] for r in chunked["rows"]] == [pytest.approx(r[1:], rel=1e-5) for r in plain["rows"]]
        assert chunked["val"] == pytest.approx(plain["val"], rel=1e-5)
    a, b = (ck.read_tensors(ck.find_checkpoint(parallel_runs / f"{mode}-{on}", "step").path, "model")
            for on in (True, False))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_a_cli_run_with_it_resumes_exactly_and_it_may_be_switched_on_resume(tmp_path, char_data, recomputed):
    """Three runs of 6 steps with dropout 0.1: without the flag; with it, stopped at 3 and resumed (the setting kept
    from the run); with it, resumed at 3 with it off. The same losses and weights, bit for bit."""
    flags = ["--data", str(char_data), "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--dropout", "0.1", "--batch-size", "4", "--eval-interval", "3", "--eval-batches", "2",
             "--log-interval", "1", "--precision", "fp32", "--device", "cpu", "--quiet"]
    assert main(["train", "--run", str(tmp_path / "plain"), "--max-steps", "6", *flags]) == 0
    assert recomputed == []
    assert main(["train", "--run", str(tmp_path / "on"), "--max-steps", "3", "--activation-checkpointing",
                 *flags]) == 0
    assert len(recomputed) == 2 * 3  # blocks x steps (evaluation recomputes nothing)
    assert json.loads((tmp_path / "on" / "config.json").read_text())["train"]["activation_checkpointing"] is True
    shutil.copytree(tmp_path / "on", tmp_path / "switched")
    assert main(["train", "--run", str(tmp_path / "on"), "--resume", "--max-steps", "6", "--quiet"]) == 0
    assert len(recomputed) == 2 * 6
    assert main(["train", "--run", str(tmp_path / "switched"), "--resume", "--max-steps", "6",
                 "--activation-checkpointing", "false", "--quiet"]) == 0
    assert len(recomputed) == 2 * 6
    config = json.loads((tmp_path / "switched" / "config.json").read_text())
    assert config["train"]["activation_checkpointing"] is False

    def trained(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        weights = ck.read_tensors(ck.find_checkpoint(tmp_path / name, "step").path, "model")
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows], weights

    (plain_rows, plain), runs = trained("plain"), [trained("on"), trained("switched")]
    for rows, weights in runs:
        assert rows == plain_rows and len(rows) == 8
        assert all(torch.equal(weights[k], plain[k]) for k in plain)


@pytest.mark.parametrize("argv, says", [
    (["--preset", "bigram"], "arch bigram has none; drop --activation-checkpointing"),
    (["--engine", "reference"], "the reference engine does not implement activation checkpointing")])
def test_a_model_or_engine_without_blocks_to_recompute_refuses_it_in_one_line(argv, says, tmp_path, char_data,
                                                                                capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(char_data), "--run", str(run), "--activation-checkpointing", "--quiet",
                 "--max-steps", "1", "--eval-batches", "1", *argv]) == 2  # a short run where it is taken
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not run.exists()


def test_bench_train_compares_memory_and_time_without_and_with_it(char_data, monkeypatch, capsys):
    """The tiny bench: each variant's memory measured in a fresh process, then timed side by side; the table ends
    with the ratios (no timing is asserted)."""
    monkeypatch.setattr(device_peak, "measure_peak", lambda device, quick: Peak(1e10, "test", bf16=2e10))
    model = tiny_config(vocab_size=0, dropout=0.1, n_layer=3)
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, device="cpu")
    variants = checkpointing_variants(CPU)
    rows = run_train_bench(char_data, model, cfg, steps=1, warmup=0, variants=variants, memory=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [r["variant"] for r in rows] == [v.name for v in variants] and variants[1].checkpointing
    assert rows[0]["val_loss"] == rows[1]["val_loss"]  # the same numbers, recomputed
    assert 0 < rows[1]["saved_bytes"] < rows[0]["saved_bytes"] / 2
    assert all(r["base_bytes"] > 0 and r["step_bytes"] >= 0 for r in rows)
    header = next(i for i, line in enumerate(lines) if line.startswith("variant") and "saved MB" in line)
    assert [line.split("  ")[0] for line in lines[header + 1:header + 3]] == [v.name for v in variants]
    assert lines[-1].startswith(f"{variants[1].name}: saved for backward ") and "x the reference's" in lines[-1]


def test_bench_train_takes_one_comparison_at_a_time(capsys):
    assert main(["bench", "train", "--traced", "--activation-checkpointing"]) == 2
    assert "choose one" in capsys.readouterr().err


FREED = """
import sys, torch
from gptlab.bench import memory
if sys.argv[1] == "return":
    memory._return_freed_memory()
big = torch.ones(16 << 18)  # 16 MiB, mapped on its own: glibc then serves blocks up to 16 MiB from its heap
del big
before = memory._status("VmRSS")
block = torch.ones(8 << 18)  # 8 MiB
del block
print((memory._status("VmRSS") - before) >> 20)
"""


@pytest.mark.parametrize("how, kept", [("return", 0), ("keep", 8)])
def test_memory_freed_in_a_measured_process_leaves_the_resident_set(how, kept):
    """The bench's resident figures follow the memory in use only if freed blocks go back to the system: with
    glibc's defaults a freed 8 MiB block after a 16 MiB one stays resident (the case the measurement must avoid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", FREED, how], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert abs(int(out.stdout) - kept) <= 1
