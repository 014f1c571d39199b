"""Checkpoints function by function: the bytes written (manifest, checksums from hashlib, state.json), what
verification says of each kind of damage, pruning, the optimizer and RNG round trips, and loading a run."""

import errno
import hashlib
import json
import logging
import os
import shutil
import time

import pytest
import torch
from helpers import CORPUS, TINY, tiny_config, tiny_run
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab import checkpoint as ck
from gptlab.cli import main
from gptlab.config import ModelConfig, from_dict, to_dict
from gptlab.errors import GptlabError
from gptlab.model import GPT, build_model
from gptlab.rundir import TrainingState
from gptlab.runs import summarize


def away_from_init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` with weights set by `seed` alone, far from any init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def saved(run, step, kind="step", keep=2, seed=0, **kwargs):
    """A checkpoint of a tiny GPT (weights by `seed`) with its model config in state.json."""
    model = away_from_init(GPT(tiny_config()), seed)
    return ck.save_checkpoint(run, kind, step, model, TrainingState(to_dict(tiny_config())), keep=keep, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step char run: step checkpoints at 3 and 6, a best one."""
    return tiny_run(tmp_path_factory.mktemp("trained"), 6, [*TINY, "--eval-interval", "3"])


@pytest.fixture
def run(trained, tmp_path):
    """A copy of `trained` to damage."""
    return shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))


# ---- bytes: checksums, tensors, optimizer, RNG -------------------------------------------------------------------

def test_sha256_file_is_hashlib_of_the_whole_file(tmp_path):
    data = os.urandom((5 << 20) + 3)  # more than one 4 MiB block
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    assert ck.sha256_file(tmp_path / "big") == hashlib.sha256(data).hexdigest()
    assert ck.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_model_tensors_drop_wrapper_prefixes_and_keep_a_tied_head_once():
    model = away_from_init(GPT(tiny_config()))
    plain = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for wrapper in ("module", "_orig_mod"):  # DDP, torch.compile
        wrapped = torch.nn.Module()
        wrapped.add_module(wrapper, model)
        tensors = ck.model_tensors(wrapped)
        assert set(tensors) == set(plain) and all(torch.equal(tensors[k], v) for k, v in plain.items())
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)  # untied: both are weights
    assert torch.equal(ck.model_tensors(model)["lm_head.weight"], model.transformer.wte.weight * 2)
    linear = torch.nn.Linear(3, 2)  # nothing named like a GPT: every tensor as it is
    assert set(ck.model_tensors(linear)) == {"weight", "bias"}


def fresh_and_tensors():
    return GPT(tiny_config()), ck.model_tensors(away_from_init(GPT(tiny_config())))


def test_load_model_tensors_fills_every_weight_and_the_tied_head():
    model, tensors = fresh_and_tensors()
    ck.load_model_tensors(model, tensors, "here")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in tensors.items())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_load_model_tensors_names_the_first_three_missing_or_unexpected_and_a_wrong_shape():
    model, tensors = fresh_and_tensors()
    names = sorted(tensors)
    fits = "the weights in SRC do not fit the model described by its config"
    with pytest.raises(GptlabError) as missing:
        ck.load_model_tensors(model, {k: v for k, v in tensors.items() if k not in names[:4]}, "SRC")
    assert str(missing.value) == f"{fits} (missing {names[:3]})"
    extra = {f"extra.{i}": torch.zeros(1) for i in range(4)}
    with pytest.raises(GptlabError) as unexpected:
        ck.load_model_tensors(model, {**tensors, **extra}, "SRC")
    assert str(unexpected.value) == f"{fits} (unexpected ['extra.0', 'extra.1', 'extra.2'])"
    wpe = tensors["transformer.wpe.weight"]
    with pytest.raises(GptlabError) as wrong:
        ck.load_model_tensors(model, {**tensors, "transformer.wpe.weight": wpe[:5]}, "SRC")
    assert str(wrong.value) == f"{fits} (shape mismatch transformer.wpe.weight (5, 32) vs {tuple(wpe.shape)})"


def test_optimizer_state_goes_through_safetensors_and_json_and_comes_back_whole(tmp_path):
    """AdamW after two steps, plus a plain-number entry under a dotted name (an optimizer may keep such): the
    tensors through a safetensors file, the rest through JSON, restored into a new optimizer, are the same."""
    model = away_from_init(GPT(tiny_config()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    optimizer.state[model.transformer.wpe.weight]["lookahead.k"] = 5
    tensors, meta = ck.optimizer_tensors(optimizer)
    assert {k.split(".", 1)[1] for k in tensors} == {"step", "exp_avg", "exp_avg_sq"} and meta["scalars"] == {"1.lookahead.k": 5}
    save_file(tensors, tmp_path / "o.safetensors")
    other = torch.optim.AdamW(GPT(tiny_config()).parameters(), lr=0.5)
    ck.restore_optimizer(other, load_file(tmp_path / "o.safetensors"), json.loads(json.dumps(meta)))
    want, got = optimizer.state_dict(), other.state_dict()
    assert json.dumps(got["param_groups"]) == json.dumps(want["param_groups"])
    assert got["state"].keys() == want["state"].keys()
    for pid, entry in want["state"].items():
        assert got["state"][pid].keys() == entry.keys()
        assert all(torch.equal(torch.as_tensor(got["state"][pid][k]), torch.as_tensor(v)) for k, v in entry.items())


def test_the_rng_comes_back_to_where_it_was_saved():
    torch.manual_seed(7)
    state = ck.rng_tensors()
    first = torch.rand(5)
    torch.rand(3)
    ck.restore_rng(state)
    assert torch.equal(torch.rand(5), first)


@pytest.fixture
def gpus(monkeypatch):
    """Stand-in CUDA with n devices (no GPU needed): what set_rng_state_all was handed."""
    handed = []

    def with_devices(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.full((4,), i, dtype=torch.uint8)
                                                                       for i in range(n)])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", handed.append)
        return handed
    return with_devices


def test_each_gpus_rng_is_saved_and_restored_to_the_same_gpu(gpus):
    handed = gpus(12)  # cuda_10 and cuda_11 sort before cuda_2 as text
    state = ck.rng_tensors()
    assert sorted(state) == sorted(["torch_cpu", *(f"cuda_{i}" for i in range(12))])
    ck.restore_rng(state)
    assert [int(t[0]) for t in handed.pop()] == list(range(12))


@pytest.mark.parametrize("saved_on, now", [(2, 1), (0, 0), (0, 2)])
def test_gpu_rng_states_are_left_alone_unless_saved_for_as_many_gpus(gpus, saved_on, now):
    cpu = torch.get_rng_state()
    state = {"torch_cpu": cpu, **{f"cuda_{i}": torch.zeros(4, dtype=torch.uint8) for i in range(saved_on)}}
    handed = gpus(now)
    ck.restore_rng(state)
    assert handed == []


# ---- listing, verifying, finding -------------------------------------------------------------------------------

def test_list_checkpoints_is_newest_first_and_skips_what_is_not_a_checkpoint(tmp_path):
    """Stray folders whose names are no step number, and a file named like a checkpoint, are left out (the
    file used to make find_checkpoint raise NotADirectoryError)."""
    for name in ("step-00000002", "step-00000010", "best-00000004", "step-00000007", "step-final",
                 "step-00000008-1", "step-", "step-x-3", ".tmp-step-00000009-1"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000011").write_text("a file, not a checkpoint")
    found = ck.list_checkpoints(tmp_path, "step")
    assert found == [ck.Checkpoint(tmp_path / "checkpoints" / f"step-{s:08d}", "step", s) for s in (10, 7, 2)]
    assert ck.list_checkpoints(tmp_path, "best") == [ck.Checkpoint(tmp_path / "checkpoints" / "best-00000004",
                                                                   "best", 4)]


@pytest.fixture
def one(tmp_path):
    return saved(tmp_path, 3)


@pytest.mark.parametrize("damage, problem", [
    (lambda c: (c / "manifest.json").unlink(), "no manifest (it was never finished)"),
    (lambda c: (c / "manifest.json").write_text("{"), "damaged manifest"),
    (lambda c: (c / "manifest.json").write_bytes(b"\xff\xfe{}"), "damaged manifest"),
    (lambda c: (c / "rng.safetensors").unlink(), "rng.safetensors is missing"),
    (lambda c: (c / "state.json").write_text("{}"), "state.json is truncated (2 of {} bytes)"),
    (lambda c: (c / "model.safetensors").write_bytes(b"\0" * (c / "model.safetensors").stat().st_size),
     "model.safetensors does not match its checksum (corrupted)"),
])
def test_verify_says_what_is_wrong(one, damage, problem):
    size = (one / "state.json").stat().st_size
    damage(one)
    assert ck.verify(one) == problem.format(size)


def test_a_manifest_listing_no_files_has_nothing_to_check(tmp_path):
    (tmp_path / "manifest.json").write_text('{"step": 3}')
    assert ck.verify(tmp_path) is None


def test_find_checkpoint_falls_back_past_damaged_ones_and_says_so(tmp_path, caplog):
    paths = [saved(tmp_path, s, keep=3) for s in (1, 2, 3)]
    assert ck.find_checkpoint(tmp_path) == ck.Checkpoint(paths[2], "step", 3)  # kind "step" by default
    for p in paths[1:]:
        (p / "model.safetensors").write_bytes(b"x")
    size = (paths[0] / "model.safetensors").stat().st_size
    with caplog.at_level(logging.WARNING, logger="gptlab"):
        assert ck.find_checkpoint(tmp_path, "step") == ck.Checkpoint(paths[0], "step", 1)
    damaged = f"model.safetensors is truncated (1 of {size} bytes)"
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {paths[2]} is unusable ({damaged}); falling back to an older one",
        f"checkpoint {paths[1]} is unusable ({damaged}); falling back to an older one"]
    caplog.clear()
    (paths[0] / "model.safetensors").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="gptlab"):
        assert ck.find_checkpoint(tmp_path, "step") is None
    assert caplog.records[-1].getMessage() == (f"checkpoint {paths[0]} is unusable ({damaged}); no older step "
                                               "checkpoint is left")
    assert ck.find_checkpoint(tmp_path, "best") is None


def test_verify_cached_sees_a_damage_and_a_rename_made_after_it_answered(one):
    assert ck.verify_cached(one) is None
    (one / "rng.safetensors").rename(one / "rng.bak")  # same inode, size and time: only the name changed
    assert ck.verify_cached(one) == "rng.safetensors is missing"
    (one / "rng.bak").rename(one / "rng.safetensors")
    assert ck.verify_cached(one) is None
    with open(one / "state.json", "a") as f:
        f.write(" ")
    assert ck.verify_cached(one).startswith("state.json is truncated")


def test_verify_cached_of_a_folder_with_a_dangling_link_verifies_it(one):
    (one / "stray").symlink_to(one / "nowhere")  # stat() fails: no cache key, verified directly
    assert ck.verify_cached(one) is None
    (one / "state.json").write_text("{}")
    assert ck.verify_cached(one).startswith("state.json is truncated")


# ---- saving, pruning, cleaning -----------------------------------------------------------------------------------

def test_a_saved_checkpoint_holds_every_part_listed_with_its_size_and_sha256(tmp_path):
    model = away_from_init(GPT(tiny_config()))
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    tokenizer = "naïve → ok".encode()
    t0 = time.time()
    path = ck.save_checkpoint(tmp_path, "step", 12, model, TrainingState(to_dict(tiny_config()), imported_from="é"),
                              optimizer, extra_files={"tokenizer.json": tokenizer})
    t1 = time.time()
    assert path == tmp_path / "checkpoints" / "step-00000012" and os.listdir(tmp_path / "checkpoints") == [path.name]
    names = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "tokenizer.json"]
    assert sorted(os.listdir(path)) == sorted([*names, "manifest.json"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest == {"step": 12, "kind": "step", "files": {
        n: {"bytes": (path / n).stat().st_size, "sha256": hashlib.sha256((path / n).read_bytes()).hexdigest()}
        for n in names}}
    assert (path / "tokenizer.json").read_bytes() == tokenizer
    weights = load_file(path / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in ck.model_tensors(model).items())
    assert len(weights) == len(model.state_dict()) - 1  # the tied head once
    assert set(load_file(path / "optimizer.safetensors")) == {f"{i}.{k}" for i in range(len(list(model.parameters())))
                                                              for k in ("step", "exp_avg", "exp_avg_sq")}
    written = json.loads((path / "state.json").read_text())
    assert sorted(written) == ["imported_from", "model", "optimizer", "step", "time"]  # what was given, and stamped
    state = ck.read_state(ck.Checkpoint(path, "step", 12))
    assert state.step == 12 and state.imported_from == "é" and state.model == to_dict(tiny_config())
    assert state.optimizer["param_groups"][0]["lr"] == 1e-3 and t0 <= state.time <= t1
    assert (state.train, state.sampler, state.tokens_seen) == (None, None, None)
    umask = os.umask(0o022)
    os.umask(umask)
    mode = 0o666 & ~umask
    assert {(path / n).stat().st_mode & 0o777 for n in names} == {mode}  # safetensors alone would write 0600


def test_a_checkpoint_saved_again_at_the_same_step_replaces_the_first(tmp_path):
    first = saved(tmp_path, 5, seed=1)
    again = saved(tmp_path, 5, seed=2)
    assert again == first and os.listdir(tmp_path / "checkpoints") == [first.name] and ck.verify(first) is None
    want = ck.model_tensors(away_from_init(GPT(tiny_config()), 2))
    assert all(torch.equal(load_file(first / "model.safetensors")[k], v) for k, v in want.items())


def test_a_temp_folder_left_by_an_earlier_process_with_this_pid_is_replaced(tmp_path):
    stale = tmp_path / "checkpoints" / f".tmp-step-00000004-{os.getpid()}"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left over")
    path = saved(tmp_path, 4)
    assert not (path / "junk").exists() and not stale.exists() and ck.verify(path) is None


def test_the_newest_two_are_kept_by_default_and_older_ones_deleted_without_leftovers(tmp_path):
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, "step", step, GPT(tiny_config()), TrainingState({}))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_counts_only_valid_checkpoints(tmp_path, keep):
    """Steps 1 to 4 with 2 and 3 damaged, then step 5 (valid: 5, 4, 1): the newest `keep` valid ones stay, and
    whatever is older than the keep-th valid one goes; damaged ones never count towards `keep`."""
    for step in (1, 2, 3, 4):
        saved(tmp_path, step, keep=9)
    for step in (2, 3):
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "state.json").write_text("{}")
    saved(tmp_path, 5, keep=keep)
    left = {1: [5], 2: [5, 4], 3: [5, 4, 3, 2, 1]}[keep]
    assert [c.step for c in ck.list_checkpoints(tmp_path, "step")] == left
    assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted(f"step-{s:08d}" for s in left)


def test_an_undeletable_old_checkpoint_never_fails_the_save_and_clean_stale_tries_again(tmp_path, monkeypatch):
    saved(tmp_path, 1)
    saved(tmp_path, 2)
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if os.fspath(path) == "rng.safetensors":
            raise PermissionError(errno.EACCES, "Permission denied")
        return unlink(path, *args, **kwargs)
    monkeypatch.setattr(os, "unlink", refuse)
    assert saved(tmp_path, 3).name == "step-00000003"
    left = sorted(os.listdir(tmp_path / "checkpoints"))
    assert left[:1] == [f".trash-step-00000001-{os.getpid()}"] and left[1:] == ["step-00000002", "step-00000003"]
    ck.clean_stale(tmp_path)  # still refused: no error, tried again next time
    assert len(os.listdir(tmp_path / "checkpoints")) == 3
    monkeypatch.undo()
    ck.clean_stale(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000003"]


def test_clean_stale_removes_temp_and_trash_folders_only(tmp_path):
    kept = saved(tmp_path, 2)
    for name in (".tmp-step-00000004-99", ".trash-step-00000001-98", ".tmp-best-00000004-97"):
        (tmp_path / "checkpoints" / name / "shards").mkdir(parents=True)
    ck.clean_stale(tmp_path)
    assert os.listdir(tmp_path / "checkpoints") == [kept.name] and ck.verify(kept) is None


def shard_writer(model, calls):
    """What distributed/processes.py hands save_checkpoint for FSDP, in one process: the model's (and optimizer's)
    tensors written by sharded.write into the folder it is given; returns the optimizer's JSON part."""
    from gptlab import sharded

    def write(folder, with_optimizer):
        calls.append((folder.name, folder.parent.name.startswith(".tmp-"), with_optimizer))
        tensors = {f"model.{k}": v for k, v in ck.model_tensors(model).items()}
        if with_optimizer:
            tensors["optimizer.0.exp_avg"] = torch.arange(3.0)
        sharded.write(folder, tensors)
        return {"param_groups": [{"lr": 0.5}], "scalars": {}}
    return write


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_sharded_checkpoint_lists_its_shards_and_reads_back_whole(tmp_path, with_optimizer):
    model, calls = away_from_init(GPT(tiny_config())), []
    optimizer = torch.optim.AdamW(model.parameters()) if with_optimizer else None
    path = ck.save_checkpoint(tmp_path, "step", 6, model, TrainingState({}), optimizer,
                              shards=shard_writer(model, calls))
    assert calls == [("shards", True, with_optimizer)] and ck.verify(path) is None
    assert not (path / "model.safetensors").exists() and not (path / "optimizer.safetensors").exists()
    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(listed) == sorted(["rng.safetensors", "state.json",
                                     *(f"shards/{p.name}" for p in (path / "shards").iterdir())])
    state = json.loads((path / "state.json").read_text())
    assert state.get("optimizer") == ({"param_groups": [{"lr": 0.5}], "scalars": {}} if with_optimizer else None)
    whole = ck.read_tensors(path, "model")
    want = ck.model_tensors(model)
    assert whole.keys() == want.keys() and all(torch.equal(whole[k], v) for k, v in want.items())
    if with_optimizer:
        assert set(ck.read_tensors(path, "optimizer")) == {"0.exp_avg"}


@pytest.mark.parametrize("exc, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (OSError("quota exceeded "), "quota exceeded"),
    (SafetensorError(" bad header "), "bad header"),
])
def test_a_failed_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, exc, reason):
    before = saved(tmp_path, 1)

    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr(ck, "save_file", fail)
    with pytest.raises(GptlabError) as refused:
        saved(tmp_path, 2)
    assert str(refused.value) == (f"cannot write a checkpoint in {tmp_path / 'checkpoints'}: {reason}; free some space "
                                  "or fix the permissions (the previous checkpoint is intact)")
    assert os.listdir(tmp_path / "checkpoints") == [before.name] and ck.verify(before) is None


def test_a_checkpoints_path_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    with pytest.raises(GptlabError, match="cannot write a checkpoint in .*: Not a directory; free some space"):
        saved(tmp_path, 1)


def test_unreadable_tensors_are_one_line_naming_the_file(one):
    (one / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}")
    with pytest.raises(GptlabError, match=r"model\.safetensors cannot be read \(.+\); the checkpoint is damaged$"):
        ck.read_tensors(one, "model")


# ---- loading a run -----------------------------------------------------------------------------------------------

def test_load_run_takes_the_best_checkpoint_by_default_and_the_newest_step_one_when_asked(trained):
    best = ck.load_run(trained)
    assert best.checkpoint.kind == "best" and best.checkpoint == ck.find_checkpoint(trained, "best")
    last = ck.load_run(trained, which="last")
    assert last.checkpoint == ck.Checkpoint(trained / "checkpoints" / "step-00000006", "step", 6)
    state = json.loads((last.checkpoint.path / "state.json").read_text())
    assert (last.state.step, last.state.model, last.state.sampler) == (6, state["model"], state["sampler"])
    assert to_dict(last.model_cfg) == state["model"]
    assert last.tokenizer.vocab_size == last.model_cfg.vocab_size == len(set(CORPUS))  # a char tokenizer
    weights = load_file(last.checkpoint.path / "model.safetensors")
    assert all(torch.equal(last.model.state_dict()[k], v) for k, v in weights.items())
    assert not last.model.training and {p.device.type for p in last.model.parameters()} == {"cpu"}


def write_as_before(checkpoint, state):
    """`state` as state.json in `checkpoint` (a str as it is), the manifest's entry for it made again with hashlib."""
    (checkpoint / "state.json").write_text(state if isinstance(state, str) else json.dumps(state, indent=2))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    blob = (checkpoint / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_state_json_of_the_first_format_still_loads_lists_and_resumes(trained, tmp_path):
    """The first releases wrote no sampler, no optimizer setting (AdamW was the only one) and none of the training
    settings added since: such a checkpoint loads, is listed with its numbers, and resumes."""
    run = shutil.copytree(trained, tmp_path / "old")
    now = json.loads((run / "checkpoints" / "step-00000006" / "state.json").read_text())
    old_train = {k: v for k, v in now["train"].items() if k not in ("optimizer", "muon_lr")}
    first = {"tokens_seen": 6 * 4 * 16, "best_val_loss": 3.25, "val_loss": 3.5,
             "data_fingerprint": now["data_fingerprint"], "model": now["model"], "train": old_train,
             "gptlab_version": "0.1.0", "git_commit": "unknown", "optimizer": now["optimizer"], "step": 6,
             "time": 1.7e9}
    write_as_before(run / "checkpoints" / "step-00000006", first)
    state = ck.read_state(ck.find_checkpoint(run))
    assert (state.step, state.tokens_seen, state.best_val_loss, state.sampler) == (6, 384, 3.25, None)
    assert "optimizer" not in state.train and ck.load_run(run, which="last").checkpoint.step == 6
    summary = summarize(run)
    assert (summary.step, summary.tokens, summary.best_val_loss) == (6, 384, 3.25)
    assert main(["train", "--run", str(run), "--resume", "--max-steps", "8"]) == 0
    resumed = json.loads((run / "checkpoints" / "step-00000008" / "state.json").read_text())
    assert resumed["tokens_seen"] == 8 * 4 * 16 and resumed["sampler"] == {"seed": 1337, "next_step": 8}


def test_a_state_json_without_a_step_or_model_is_one_line(trained, tmp_path):
    run = shutil.copytree(trained, tmp_path / "bad")
    write_as_before(run / "checkpoints" / "step-00000006", {"step": 6, "model": 5})
    with pytest.raises(GptlabError, match=r"state\.json holds no checkpoint state \(a step and the model's "
                                          r"settings\); the checkpoint is damaged$"):
        ck.read_state(ck.find_checkpoint(run))


@pytest.mark.parametrize("text, words", [
    ('{"step": true, "model": {}}', "holds no checkpoint state"),  # JSON's true is no step number
    ('{"step": 6, "model": {}', "is not valid JSON; the checkpoint is damaged"),
    ("", "is not valid JSON; the checkpoint is damaged"),
])
def test_a_state_json_with_a_true_step_or_not_json_is_one_line_naming_it(trained, tmp_path, text, words):
    run = shutil.copytree(trained, tmp_path / "bad")
    write_as_before(run / "checkpoints" / "step-00000006", text)
    with pytest.raises(GptlabError, match=f"^{run / 'checkpoints' / 'step-00000006' / 'state.json'} {words}"):
        ck.read_state(ck.find_checkpoint(run))


def test_load_run_puts_the_model_on_the_device_asked_for(trained):
    assert {p.device.type for p in ck.load_run(trained, device="meta").model.parameters()} == {"meta"}


def damage(path, truncate=True):
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100] if truncate else b"\0" * weights.stat().st_size)


def test_a_run_whose_checkpoints_are_all_damaged_names_the_newest_and_its_damage(run):
    steps = ck.list_checkpoints(run, "step")
    size = (steps[0].path / "model.safetensors").stat().st_size
    damage(steps[0].path)
    damage(steps[1].path, truncate=False)  # another damage: the message is the newest's
    damage(ck.list_checkpoints(run, "best")[0].path, truncate=False)
    with pytest.raises(GptlabError) as refused:
        ck.load_run(run)
    assert str(refused.value) == (f"run {run} has no usable checkpoint: the newest, step-00000006, is damaged "
                                  f"(model.safetensors is truncated (100 of {size} bytes))")


def test_a_run_with_only_a_damaged_best_checkpoint_names_it(run):
    for c in ck.list_checkpoints(run, "step"):
        shutil.rmtree(c.path)
    best = ck.list_checkpoints(run, "best")[0].path
    damage(best, truncate=False)
    with pytest.raises(GptlabError, match=f"no usable checkpoint: the newest, {best.name}, is damaged "
                                          r"\(model.safetensors does not match its checksum \(corrupted\)\)$"):
        ck.load_run(run)


def test_a_run_without_checkpoints_says_whether_it_is_being_trained(run):
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(GptlabError) as refused:
        ck.load_run(run)
    assert str(refused.value) == f"run {run} has no checkpoint yet; train it with `gptlab train --run {run}`"
    with ck.RunLock(run), pytest.raises(GptlabError) as refused:
        ck.load_run(run)
    assert str(refused.value) == (f"run {run} is being trained and has no checkpoint yet; wait for its first "
                                  "evaluation (one every --eval-interval steps) or pass --run")


def test_a_run_tokenizer_that_is_not_the_checkpoints_is_refused(run):
    (run / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes() + b" ")
    ckpt = ck.find_checkpoint(run, "best").path
    with pytest.raises(GptlabError) as refused:
        ck.load_run(run)
    assert str(refused.value) == (f"{run / 'tokenizer.json'} is not the tokenizer the weights in {ckpt} were "
                                  f"trained with; restore it from {ckpt / 'tokenizer.json'}")


def model_cfg_of(run, **changes):
    state = json.loads((ck.find_checkpoint(run).path / "state.json").read_text())
    return from_dict(ModelConfig, {**state["model"], **changes})


def test_a_checkpoint_without_its_own_tokenizer_loads_with_the_runs(run):
    cfg = model_cfg_of(run)
    shutil.rmtree(run / "checkpoints")
    model = away_from_init(build_model(cfg))
    ck.save_checkpoint(run, "step", 1, model, TrainingState(to_dict(cfg)))
    loaded = ck.load_run(run)
    assert loaded.checkpoint.step == 1 and loaded.tokenizer.vocab_size == cfg.vocab_size
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in ck.model_tensors(model).items())


def test_weights_that_do_not_fit_their_config_or_tokenizer_are_refused(run):
    cfg = model_cfg_of(run)
    small = model_cfg_of(run, vocab_size=cfg.vocab_size - 1)
    shutil.rmtree(run / "checkpoints")
    wider = to_dict(cfg) | {"n_embd": cfg.n_embd * 2}  # state.json's config is not the weights'
    path = ck.save_checkpoint(run, "step", 1, build_model(cfg), TrainingState(wider))
    with pytest.raises(GptlabError, match=f"^the weights in {path} do not fit the model described by its config "):
        ck.load_run(run)
    ck.save_checkpoint(run, "step", 2, build_model(small), TrainingState(to_dict(small)))
    with pytest.raises(GptlabError) as refused:
        ck.load_run(run)
    assert str(refused.value) == (f"the tokenizer of {run} has {cfg.vocab_size} tokens but the weights only "
                                  f"{cfg.vocab_size - 1}: they do not belong together")


def pruned_while_read(monkeypatch, times):
    """_load_checkpoint as when training prunes the checkpoint being read: it vanishes (FileNotFoundError) the
    first `times` times, then loads."""
    real, calls = ck._load_checkpoint, []

    def load(run_dir, ckpt, device, merge):
        calls.append(ckpt.step)
        if len(calls) <= times:
            shutil.rmtree(ckpt.path)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(ckpt.path / "model.safetensors"))
        return real(run_dir, ckpt, device, merge)
    monkeypatch.setattr(ck, "_load_checkpoint", load)
    return calls


def test_a_checkpoint_pruned_while_it_is_read_is_replaced_by_the_next(run, monkeypatch):
    calls = pruned_while_read(monkeypatch, 1)
    assert ck.load_run(run, which="last").checkpoint.step == 3 and calls == [6, 3]


def test_loading_gives_up_after_three_checkpoints_vanish(run, monkeypatch):
    model = GPT(model_cfg_of(run))
    for step in (7, 8):
        ck.save_checkpoint(run, "step", step, model, TrainingState(to_dict(model_cfg_of(run))), keep=9)
    calls = pruned_while_read(monkeypatch, 9)
    with pytest.raises(FileNotFoundError):
        ck.load_run(run, which="last")
    assert calls == [8, 7, 6] and [c.step for c in ck.list_checkpoints(run, "step")] == [3]
