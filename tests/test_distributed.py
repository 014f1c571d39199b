"""Data parallelism: N processes (torchrun, gloo on CPU) train exactly like one process with the same global batch,
and their checkpoints resume anywhere."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from helpers import CORPUS
from gptlab import checkpoint as ck
from gptlab.cli import main
from gptlab.config import ModelConfig, PrepareConfig, TrainConfig
from gptlab.distributed.processes import Parallel
from gptlab.errors import GptlabError
from gptlab.model import build_model
from gptlab.training.train import train

# fp32 and no dropout: the runs must differ by nothing but the order of floating-point sums. No biases: the key
# bias's true gradient is exactly 0, and Adam would blow its rounding noise up into lr-sized random updates.
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0, bias=False)
SETTINGS = dict(batch_size=8, grad_accum=2, lr=3e-3, min_lr=3e-4, warmup_steps=2, lr_decay_steps=8, eval_interval=5,
                eval_batches=2, log_interval=1, precision="fp32", device="cpu")  # all that the CLI's preset sets


def flags(**settings) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**SHAPE, **SETTINGS, **settings}.items()]


def run_python(*argv: str, launcher: tuple[str, ...] = ()) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def gptlab(*argv: str, launcher: tuple[str, ...] = ()) -> None:
    run_python("-m", "gptlab", *argv, launcher=launcher)


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def one_process(char_data, run, max_steps, resume=False):
    return train(char_data, run, ModelConfig(**SHAPE), TrainConfig(**{**SETTINGS, "max_steps": max_steps}),
                 resume=resume, quiet=True)


def steps(rows):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def assert_same_steps(got, want):
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, loss, norm), (_, loss_1, norm_1) in zip(got, want):
        assert loss == pytest.approx(loss_1, rel=1e-5) and norm == pytest.approx(norm_1, rel=1e-5)


def assert_same_weights(run, run_1, step):
    """Every weight within 1e-5, and every weight tensor within 1e-5 relative: |a - b| / |b| <= 1e-5 (norms over
    the tensor; summing in another order moves single near-zero elements further, relatively, and Adam passes
    that on). Whole or sharded checkpoints alike."""
    a = ck.read_tensors(ck.find_checkpoint(run, "step").path, "model")
    b = ck.read_tensors(ck.find_checkpoint(run_1, "step").path, "model")
    assert ck.find_checkpoint(run, "step").step == step and a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).norm() <= 1e-5 * b[name].norm(), name
        assert (a[name] - b[name]).abs().max() <= 1e-5, name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process, 8 steps, checkpoints at 5 and 8: what every other run is compared with."""
    from gptlab.data.prepare import prepare

    root = tmp_path_factory.mktemp("dist")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([str(root / "corpus.txt")], root / "data", "char", quiet=True)
    at5 = one_process(root / "data", root / "one-5", 5)
    at8 = one_process(root / "data", root / "one-8", 8)
    return root, at5, at8


def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(straight):
    root, at5, at8 = straight
    gptlab("train", "--nproc", "2", "--data", str(root / "data"), "--run", str(root / "ddp"), "--max-steps=5",
           "--quiet", *flags())
    assert_same_steps(steps(metrics(root / "ddp")), steps(at5.history))
    assert_same_weights(root / "ddp", root / "one-5", 5)
    assert json.loads((root / "ddp" / "config.json").read_text())["processes"] == 2

    resumed = one_process(root / "data", root / "ddp", 8, resume=True)
    assert_same_steps(steps(resumed.history), steps(at8.history)[5:])
    assert_same_weights(root / "ddp", root / "one-8", 8)


def test_lora_adapters_train_in_two_processes_like_in_one(straight):
    """DDP over a frozen base: only the adapters' gradients are averaged; the base is a trained run (one-8)."""
    root = straight[0]
    adapters = ["--init-from", str(root / "one-8"), "--lora-rank", "2", "--lora-targets", "c_attn,c_fc",
                "--max-steps=4", "--quiet"]
    assert main(["train", "--data", str(root / "data"), "--run", str(root / "lora-1"), *adapters, *flags()]) == 0
    gptlab("train", "--nproc", "2", "--data", str(root / "data"), "--run", str(root / "lora-2"), *adapters, *flags())
    assert_same_weights(root / "lora-2", root / "lora-1", 4)
    trained = ck.read_tensors(ck.find_checkpoint(root / "lora-2", "step").path, "model")
    assert sorted(trained) == sorted(f"transformer.h.{i}.{layer}.lora_{ab}.weight" for i in range(2)
                                     for layer in ("attn.c_attn", "mlp.c_fc") for ab in "AB")
    assert all(trained[n].abs().max() > 0 for n in trained)  # B moved off zero


def test_conversations_train_in_two_processes_like_in_one(straight):
    """Each process's rows hold different numbers of lessons (assistant tokens): the step's loss and gradient are
    still the mean over all the step's lessons, as in one process."""
    from gptlab.data.prepare import prepare

    root = straight[0]
    lines = [json.dumps({"messages": [{"role": "user", "content": "ab"[: 1 + i % 2]},
                                      {"role": "assistant", "content": "xyz"[: 1 + i % 3] * (1 + i % 2)}]})
             for i in range(60)]
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "chats.jsonl")], root / "chat", PrepareConfig(chat=True, context=16), quiet=True)
    one = train(root / "chat", root / "chat-1", ModelConfig(**SHAPE), TrainConfig(**{**SETTINGS, "max_steps": 4}),
                quiet=True)
    gptlab("train", "--nproc", "2", "--data", str(root / "chat"), "--run", str(root / "chat-2"), "--max-steps=4",
           "--quiet", *flags())
    assert_same_steps(steps(metrics(root / "chat-2")), steps(one.history))
    assert_same_weights(root / "chat-2", root / "chat-1", 4)


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
INIT_SCRIPT = """
import json, sys, torch
from safetensors.torch import save_file
from gptlab.config import ModelConfig
from gptlab.distributed.processes import setup
par = setup("cpu")
torch.manual_seed(7)
model = par.build(ModelConfig(**json.loads(sys.argv[1])), fsdp=True)
after = torch.rand(4)  # the generator must stand where a whole build leaves it
whole = {name: p.full_tensor() for name, p in model.named_parameters()}
held = torch.tensor([sum(p.to_local().numel() for p in model.parameters())])
save_file({**whole, "rng_after": after, "held": held}, f"{sys.argv[2]}-{par.rank}.safetensors")
"""


def test_fsdp_builds_only_its_shards_with_the_initial_weights_of_one_process_bit_for_bit(tmp_path):
    """Built on the meta device and sharded, each of 2 processes initialises only its slices (about half the
    parameters), and the slices put together are the weights one process builds from the same seed, bit for bit;
    odd sizes (vocab 67, n_embd 36) shard unevenly, and biases are drawn before they are zeroed."""
    shape = dict(n_layer=2, n_head=3, n_embd=36, block_size=16, vocab_size=67, bias=True)
    (tmp_path / "init.py").write_text(INIT_SCRIPT)
    run_python(str(tmp_path / "init.py"), json.dumps(shape), str(tmp_path / "out"), launcher=TORCHRUN)
    torch.manual_seed(7)
    model = build_model(ModelConfig(**shape))
    after = torch.rand(4)
    total = sum(p.numel() for p in model.parameters())
    for rank in range(2):
        got = ck.load_tensors(tmp_path / f"out-{rank}.safetensors")
        assert torch.equal(got.pop("rng_after"), after)
        assert abs(got.pop("held").item() / total - 0.5) < 0.02
        assert got.keys() == dict(model.named_parameters()).keys()
        for name, p in model.named_parameters():
            assert torch.equal(got[name], p), name


@pytest.fixture(scope="module")
def fsdp(straight):
    """2 FSDP processes, 5 steps: a sharded checkpoint at step 5."""
    root, _, _ = straight
    gptlab("--", "train", "--data", str(root / "data"), "--run", str(root / "fsdp"), "--max-steps=5", "--quiet",
           "--fsdp", *flags(), launcher=TORCHRUN)
    return root / "fsdp"


def test_fsdp_trains_like_one_process_holding_about_half_per_process(straight, fsdp):
    root, at5, _ = straight
    rows = metrics(fsdp)
    assert_same_steps(steps(rows), steps(at5.history))
    assert_same_weights(fsdp, root / "one-5", 5)
    alone, shared = at5.history[0], rows[0]  # the first train row: what each process holds after one step
    assert len(alone["param_bytes"]) == 1 and len(shared["param_bytes"]) == 2
    for key in ("param_bytes", "optimizer_bytes"):
        assert all(held / alone[key][0] <= 0.55 for held in shared[key]), (key, shared[key], alone[key])


def test_an_fsdp_checkpoint_is_sharded_and_one_process_reads_it_whole(straight, fsdp, monkeypatch, capsys):
    root, _, at8 = straight
    ckpt = ck.find_checkpoint(fsdp, "step").path
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "optimizer.safetensors").exists()
    shards = sorted(p.name for p in (ckpt / ck.SHARDS).iterdir())
    listed = json.loads((ckpt / ck.MANIFEST).read_text())["files"]
    assert len(shards) == 2 and all(f"{ck.SHARDS}/{name}" in listed for name in shards)
    whole = ck.read_tensors(ckpt, "model")
    loaded = ck.load_run(fsdp, which="last")
    assert all(torch.equal(loaded.model.state_dict()[name], t) for name, t in whole.items())
    assert ck.read_tensors(ckpt, "optimizer")["0.exp_avg"].shape == loaded.model.transformer.wte.weight.shape
    monkeypatch.chdir(root)
    assert main(["sample", "--run", str(fsdp), "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip()
    shutil.copytree(fsdp, root / "fsdp-in-one")
    resumed = one_process(root / "data", root / "fsdp-in-one", 8, resume=True)  # Adam's state, gathered
    assert_same_steps(steps(resumed.history), steps(at8.history)[5:])
    assert_same_weights(root / "fsdp-in-one", root / "one-8", 8)


def test_a_shard_damaged_after_its_checkpoint_was_verified_is_noticed(fsdp, tmp_path):
    shutil.copytree(fsdp, tmp_path / "run")
    ckpt = ck.find_checkpoint(tmp_path / "run", "step")  # verified, and the verdict remembered
    shard = sorted((ckpt.path / ck.SHARDS).iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, same inode: only the file's own modification time tells
    shard.write_bytes(bytes(data))
    assert ck.find_checkpoint(tmp_path / "run", "step") is None


def test_an_fsdp_run_stopped_and_resumed_continues_exactly(straight, fsdp):
    """Resumed from its shards on 2 processes, the run is the run that never stopped, bit for bit (and within
    1e-5 of one process)."""
    root, _, at8 = straight
    shutil.copytree(fsdp, root / "fsdp-resumed")
    train_flags = ("--data", str(root / "data"), "--max-steps=8", "--quiet", "--fsdp", *flags())
    gptlab("--", "train", "--run", str(root / "fsdp-resumed"), "--resume", *train_flags, launcher=TORCHRUN)
    gptlab("--", "train", "--run", str(root / "fsdp-8"), *train_flags, launcher=TORCHRUN)
    resumed, straight_8 = (metrics(root / name) for name in ("fsdp-resumed", "fsdp-8"))
    assert steps(resumed) == steps(straight_8)
    a, b = (ck.read_tensors(ck.find_checkpoint(root / name).path, "model") for name in ("fsdp-resumed", "fsdp-8"))
    assert all(torch.equal(a[name], b[name]) for name in b)
    assert_same_steps(steps(resumed), steps(at8.history))
    assert_same_weights(root / "fsdp-resumed", root / "one-8", 8)


def test_fsdp_resumes_a_whole_checkpoint_of_one_process(straight):
    root, _, at8 = straight
    shutil.copytree(root / "one-5", root / "one-5-fsdp")
    gptlab("--", "train", "--data", str(root / "data"), "--run", str(root / "one-5-fsdp"), "--max-steps=8",
           "--resume", "--quiet", "--fsdp", *flags(), launcher=TORCHRUN)  # Adam's state cut into shards
    assert_same_steps(steps(metrics(root / "one-5-fsdp"))[5:], steps(at8.history)[5:])
    assert_same_weights(root / "one-5-fsdp", root / "one-8", 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_machines(argv: list[str], folders: list) -> list[tuple[int, str]]:
    """`gptlab ARGV` started as two machines would start it: two torchrun agents (--nnodes 2, one process each,
    c10d rendezvous on the loopback address), each in its own working folder. Returns (exit code, stderr) each."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=test-{port}",
               "--max_restarts=0", "-m", "gptlab", "--", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for folder in folders]
    try:
        errors = [agent.communicate(timeout=300)[1] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()  # a hung agent (it ignores SIGTERM) must not outlive the test
    return [(agent.returncode, err) for agent, err in zip(agents, errors)]


def test_two_machines_train_resume_and_match_one_process(straight):
    root, _, at8 = straight
    argv = ["train", "--data", str(root / "data"), "--run", str(root / "nodes"), "--quiet", "--fsdp", *flags()]
    for more in (["--max-steps=5"], ["--max-steps=8", "--resume=auto"]):
        outcomes = two_machines(argv + more, [root, root])
        assert all(code == 0 for code, _ in outcomes), outcomes[0][1][-3000:] + outcomes[1][1][-3000:]
    assert [r["step"] for r in metrics(root / "nodes") if r["kind"] == "train"] == list(range(1, 9))
    assert_same_steps(steps(metrics(root / "nodes")), steps(at8.history))
    assert_same_weights(root / "nodes", root / "one-8", 8)


def test_machines_that_see_different_run_folders_are_refused(straight, tmp_path):
    """A relative --run from two different working folders stands for two machines' node-local storage: every
    process refuses with one message, and neither folder is left behind."""
    root = straight[0]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    outcomes = two_machines(["train", "--data", str(root / "data"), "--run", "run", "--max-steps=2", "--quiet",
                             *flags()], [a, b])
    assert all(code != 0 for code, _ in outcomes)
    assert all("not every process sees the run folder" in err for _, err in outcomes), outcomes
    assert not (a / "run").exists() and not (b / "run").exists()


START_SCRIPT = """
import sys
from gptlab.distributed.processes import setup
from gptlab.errors import GptlabError
par = setup("cpu")
try:
    par.check_same_start(True, 5 + 3 * par.rank if sys.argv[2] == "differ" else 5)
    outcome = "agreed"
except GptlabError as exc:
    outcome = str(exc)
open(f"{sys.argv[1]}-{par.rank}", "w").write(outcome)
"""


@pytest.mark.parametrize("steps_seen", ["same", "differ"])
def test_processes_that_would_resume_from_different_checkpoints_are_refused(tmp_path, steps_seen):
    (tmp_path / "start.py").write_text(START_SCRIPT)
    run_python(str(tmp_path / "start.py"), str(tmp_path / "out"), steps_seen, launcher=TORCHRUN)
    outcomes = {(tmp_path / f"out-{rank}").read_text() for rank in range(2)}
    assert outcomes == ({"agreed"} if steps_seen == "same" else
                        {"the processes disagree on where to start (resume or not, and from which checkpoint step); "
                         "every machine must see the same --run folder and get the same --resume"})


def test_rows_of_a_global_batch_are_shared_out_in_order():
    x = torch.arange(24).view(8, 3)
    shares = [Parallel(torch.device("cpu"), rank, 4).local_rows(x)[0] for rank in range(4)]
    assert all(s.shape == (2, 3) for s in shares) and torch.equal(torch.cat(shares), x)
    assert Parallel(torch.device("cpu")).local_rows(x)[0] is x
    with pytest.raises(GptlabError, match="batch_size 8 does not split across 3 processes"):
        Parallel(torch.device("cpu"), 0, 3).check_batch(8)


def test_restartable_torchrun_needs_a_fixed_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert main(["train", "--max-steps", "1"]) == 2
    assert "pass --run" in capsys.readouterr().err


def test_an_elastic_restart_resumes_from_the_last_checkpoint(tmp_path, monkeypatch, capsys, char_data):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--data", str(char_data), "--run", "run", "--quiet", *flags()]
    assert main([*argv, "--max-steps=5"]) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # what torchrun sets when it restarts the workers
    assert main([*argv, "--max-steps=8"]) == 0
    out = capsys.readouterr().out
    assert "run run: 3 steps (5 to 8) in " in out  # this process's steps: the restart continued from step 5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))  # continued, not restarted
