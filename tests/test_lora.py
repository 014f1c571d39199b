"""LoRA: adapters on a frozen base, held to PEFT on transformers' GPT-2 (the same adapters give the same logits,
both ways through PEFT's files), merged equal to unmerged, only adapters trained, exact resume, the base named by
path and sha256, and one clear line for each bad input. The models are tiny random GPT-2s built here."""

import hashlib
import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

from helpers import CORPUS, hf_folder, run_bad, run_ok, tree
from gptlab import lora
from gptlab.checkpoint import load_run, model_tensors
from gptlab.config import SampleConfig, TrainConfig
from gptlab.engine import generate
from gptlab.errors import GptlabError
from gptlab.hf.gpt2_folders import load_hf_model
from gptlab.inference.loading import load_for_inference
from gptlab.optim import make_optimizer
from gptlab.runtime import bf16_supported

TINY = dict(vocab_size=50257, n_embd=32, n_head=2, n_layer=2, n_positions=64)
LORA = ["--block-size", "32", "--batch-size", "4", "--grad-accum", "1", "--lr", "1e-2", "--min-lr", "1e-2",
        "--warmup-steps", "0", "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "2",
        "--precision", "fp32", "--device", "cpu", "--dropout", "0", "--quiet", "--lora-rank", "4",
        "--lora-alpha", "16", "--lora-targets", "c_attn,c_proj,c_fc"]


def base_folder(path, seed, **shape):
    """A random transformers GPT-2 saved in `path`, its biases and LayerNorms moved off their zero / one init (a
    fresh init hides a dropped bias)."""
    hf_folder(path, seed=seed, **shape)
    model = GPT2LMHeadModel.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with GPT-2-tokenized data, a tiny random GPT-2 imported as runs/base, and runs/lo: LoRA adapters
    (rank 4, alpha 16: scaling 4) on every layer kind, trained 8 steps, so that B is far from its zero start."""
    root = tmp_path_factory.mktemp("lora")
    base_folder(root / "tiny-hf", seed=7, **TINY)
    (root / "corpus.txt").write_text(CORPUS * 20, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main_ok("prepare", "corpus.txt", "--tokenizer", "gpt2", "--out", "data", "--quiet")
        assert main_ok("import", "tiny-hf", "--run", "runs/base")
        assert main_ok("train", "--init-from", "runs/base", "--data", "data", "--run", "runs/lo", "--max-steps", "8",
                       *LORA)
    return root


def main_ok(*argv):
    from gptlab.cli import main

    return main(list(argv)) == 0


@pytest.fixture
def at(work, monkeypatch):
    monkeypatch.chdir(work)
    return work


def peft_model(base_hf, adapters_dir=None, **config):
    """transformers' GPT-2 from `base_hf` with PEFT's LoRA: loaded from `adapters_dir`, or made from `config`."""
    base = GPT2LMHeadModel.from_pretrained(base_hf)
    if adapters_dir is not None:
        return PeftModel.from_pretrained(base, adapters_dir).eval()
    return get_peft_model(base, LoraConfig(fan_in_fan_out=True, task_type="CAUSAL_LM", **config)).eval()


def ids(n=40, seed=0):
    return torch.randint(0, TINY["vocab_size"], (3, n), generator=torch.Generator().manual_seed(seed))


# ---- parity with PEFT ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", [["c_attn"], ["c_attn", "c_proj", "c_fc"], ["mlp.c_proj"]])
def test_adapters_on_our_gpt_give_peft_s_logits(tmp_path, targets):
    base_folder(tmp_path / "hf", seed=3, **TINY)
    theirs = peft_model(tmp_path / "hf", r=3, lora_alpha=12, target_modules=targets)
    ours = load_hf_model(tmp_path / "hf")
    names = lora.apply_lora(ours, lora.LoraSettings(3, 12.0, 0.0, tuple(targets)))
    adapters = {n: torch.randn_like(t) * 0.3 for n, t in model_tensors(ours).items()}  # B far from zero
    ours.load_state_dict(adapters, strict=False)
    result = set_peft_model_state_dict(theirs, {f"base_model.model.{n}": t for n, t in adapters.items()})
    assert not result.unexpected_keys
    x = ids()
    with torch.no_grad():
        want, got = theirs(x).logits, ours(x)[0]
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - GPT2LMHeadModel.from_pretrained(tmp_path / "hf")(x).logits).abs().max().item() > 1e-2  # adapted
    assert sum(p.numel() for _, p in ours.named_parameters() if p.requires_grad) == \
        theirs.get_nb_trainable_parameters()[0]
    assert len(names) == {1: 2, 3: 8}[len(targets)]  # 2 blocks; c_proj is attention's and the MLP's


def test_a_trained_run_exported_for_peft_loads_there_with_equal_logits_and_greedy_ids(at, capsys):
    run_ok(capsys, "export", "runs/base", "--out", "base-hf")
    out = run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft")
    assert "adapter_config.json, adapter_model.safetensors" in out  # no tokenizer: the run added no tokens
    assert sorted(p.name for p in (at / "lo-peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                   "gptlab-export.json"]
    theirs = peft_model(at / "base-hf", at / "lo-peft")
    assert theirs.peft_config["default"].r == 4 and theirs.peft_config["default"].lora_alpha == 16
    with safe_open(at / "lo-peft/adapter_model.safetensors", "pt") as f:  # transformers 4.x refuses other files
        assert f.metadata() == {"format": "pt"}
    with safe_open(at / "base-hf/model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    stored = load_file(at / "lo-peft/adapter_model.safetensors")
    assert all(t.abs().max() > 1e-3 for n, t in stored.items() if "lora_B" in n)  # trained away from zero
    x = ids(32)  # the run's context (the base's is 64)
    ours = load_run("runs/lo", merge=False).model
    with torch.no_grad():
        assert (ours(x)[0] - theirs(x).logits).abs().max().item() <= 1e-5
    prompt = x[0, :8].tolist()
    want = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 8, dtype=torch.long),
                           max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    served = load_for_inference("runs/lo", "cpu", "fp32").model  # what sample, eval and serve load: merged
    got = [step[0] for step in generate(served, prompt, SampleConfig(max_new_tokens=12, temperature=0))]
    assert got == want


def test_merged_equals_unmerged_and_export_merge_is_that_model_in_transformers(at, capsys):
    merged, adapted = load_run("runs/lo").model, load_run("runs/lo", merge=False).model
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())
    assert sum(isinstance(m, lora.LoRALinear) for m in adapted.modules()) == 2 * 4  # c_attn, both c_proj, c_fc
    x = ids(32, seed=1)
    with torch.no_grad():
        assert (merged(x)[0] - adapted(x)[0]).abs().max().item() <= 1e-5
        run_ok(capsys, "export", "runs/lo", "--merge", "--out", "lo-merged")
        hf = GPT2LMHeadModel.from_pretrained(at / "lo-merged").eval()
        assert (hf(x).logits - adapted(x)[0]).abs().max().item() <= 1e-5


def test_a_peft_adapter_imported_is_the_same_model(at, capsys):
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft2")
    out = run_ok(capsys, "import", "peft", "lo-peft2", "--base", "runs/base", "--run", "runs/from-peft")
    assert "4,096 adapter parameters" in out  # 2 layers x 4 x ((32+96) + (32+32) + (32+128) + (128+32))
    x = ids(24, seed=2)
    with torch.no_grad():
        assert torch.equal(load_run("runs/from-peft").model(x)[0], load_run("runs/lo").model(x)[0])


# ---- training --------------------------------------------------------------------------------------------------

def test_a_step_changes_only_the_adapters():
    from gptlab.model import GPT
    from gptlab.config import ModelConfig

    model = GPT(ModelConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=24, dropout=0.0))
    lora.apply_lora(model, lora.LoraSettings(2, 4.0, 0.0, ("c_attn", "c_fc")))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.1))
    for _ in range(2):  # the second step moves A too (B is zero at the first)
        x = torch.randint(0, 61, (4, 16))
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n, _ in model.named_parameters() if lora.is_adapter(n)}
    assert changed == adapters and len(adapters) == 2 * 2 * 2


def test_a_resumed_lora_run_ends_exactly_where_one_straight_run_does(at, capsys):
    common = ["--init-from", "runs/base", "--data", "data", *LORA, "--lora-dropout", "0.1"]
    run_ok(capsys, "train", "--run", "runs/straight", "--max-steps", "8", *common)
    run_ok(capsys, "train", "--run", "runs/halves", "--max-steps", "4", *common)
    run_ok(capsys, "train", "--run", "runs/halves", "--resume", "--max-steps", "8", "--quiet")
    a = load_file(at / "runs/straight/checkpoints/step-00000008/model.safetensors")
    b = load_file(at / "runs/halves/checkpoints/step-00000008/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(lora.is_adapter(k) for k in a)  # the base is not copied into the run's checkpoints
    optimizer = load_file(at / "runs/halves/checkpoints/step-00000008/optimizer.safetensors")
    assert sum(t.numel() for t in optimizer.values() if t.dim() > 0) == 2 * 4096  # AdamW's two moments, adapters


def test_a_resume_that_changes_the_adapters_or_adds_them_is_refused_in_one_line_naming_them(at, capsys):
    common = ["--init-from", "runs/base", "--data", "data", "--max-steps", "2"]
    run_ok(capsys, "train", "--run", "runs/lo2", *common, *LORA)
    assert run_bad(capsys, "train", "--run", "runs/lo2", "--resume", "--max-steps", "4", "--lora-rank", "8") == (
        "gptlab: error: this run's LoRA adapters are rank 4, alpha 16, dropout 0 on c_attn,c_proj,c_fc; a resume keeps "
        "them (drop the --lora-* settings, or fine-tune into a new --run)")
    plain = LORA[:LORA.index("--lora-rank")]  # no adapters: a full fine-tune
    run_ok(capsys, "train", "--run", "runs/full2", *common, *plain)
    assert run_bad(capsys, "train", "--run", "runs/full2", "--resume", "--max-steps", "4", "--lora-rank", "4") == (
        "gptlab: error: this run's LoRA adapters are none; a resume keeps them (drop the --lora-* settings, or "
        "fine-tune into a new --run)")


@pytest.mark.device_path("bf16 native")
@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="this CPU has no native bf16: training refuses bf16")
def test_a_bf16_lora_run_stores_its_frozen_matrices_in_bf16_and_trains_the_same_bits(at, capsys, monkeypatch):
    """The same adapters, bit for bit, with the base's block matrices stored in bf16 (as the run does) and with them
    kept in fp32 (the storage switched off): autocast rounds them to bf16 before every product either way. With
    --loss-chunk on top, the adapters land within bf16's noise of the plain run's; a logger's sample at the end is
    drawn in the run's precision (in fp32 the bf16 matrices would be refused)."""
    from gptlab import model as model_module
    from gptlab.training import train as training

    real, stored = lora.store_frozen_matrices, []
    monkeypatch.setattr(training.lora, "store_frozen_matrices", lambda model, dtype: stored.append(
        sorted(n for n, p in model.named_parameters() if p.dim() == 2 and not p.requires_grad)) or real(model, dtype))
    bf16 = [*LORA, "--init-from", "runs/base", "--data", "data", "--max-steps", "4", "--precision", "bf16"]
    checked, check_memory = [], training.check_memory
    monkeypatch.setattr(training, "check_memory", lambda *a: checked.append(a[4:]) or check_memory(*a))
    run_ok(capsys, "train", "--run", "runs/bf16", *bf16)
    assert checked == [("bf16",)]  # the memory check counts the frozen matrices at bf16's 2 bytes
    chunked, real_loss = [], model_module.chunked_loss
    monkeypatch.setattr(model_module, "chunked_loss", lambda *a: chunked.append(a[-1]) or real_loss(*a))
    run_ok(capsys, "train", "--run", "runs/bf16-chunked", "--loss-chunk", "24", "--log", "tensorboard", *bf16)
    assert chunked == [24] * 4  # one micro-batch per step
    assert len(stored) == 2 and len(stored[0]) == 2 * 4 + 2  # every block's 4 matrices, and wte and wpe
    monkeypatch.setattr(training.lora, "store_frozen_matrices", lambda model, dtype: 0)
    run_ok(capsys, "train", "--run", "runs/bf16-fp32-base", *bf16)
    a, b, c = (load_file(at / f"runs/{name}/checkpoints/step-00000004/model.safetensors")
               for name in ("bf16", "bf16-fp32-base", "bf16-chunked"))
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all((c[k] - a[k]).abs().max() <= 0.02 * a[k].abs().max() for k in a)


def test_info_and_runs_show_the_base_and_the_adapters(at, capsys):
    out = run_ok(capsys, "info", "runs/lo")
    sha = json.loads((at / "runs/lo/config.json").read_text())["base"]["sha256"]
    stored = load_file(next((at / "runs/base/checkpoints").glob("best-*")) / "model.safetensors")
    base = lora.tensors_sha256({**stored, "transformer.wpe.weight": stored["transformer.wpe.weight"][:32]})
    assert sha == base
    assert (f"LoRA adapters: rank 4, alpha 16, dropout 0 on c_attn,c_proj,c_fc (4,096 parameters) on base "
            f"{at / 'runs/base'} (weights sha256 {base[:12]})") in out
    assert "finetune+lora" in run_ok(capsys, "runs", "runs")


def test_a_base_that_moved_or_changed_is_refused_in_one_line(at, capsys, tmp_path):
    hf_folder(tmp_path / "other", seed=8, **TINY)
    run_ok(capsys, "import", "tiny-hf", "--run", "runs/base2")
    run_ok(capsys, "train", "--init-from", "runs/base2", "--data", "data", "--run", "runs/on2", "--max-steps", "4",
           *LORA)
    shutil.move(at / "runs/base2", at / "runs/base2-moved")
    assert "is gone (moved or deleted)" in run_bad(capsys, "sample", "--run", "runs/on2", "--max-new-tokens", "2")
    run_ok(capsys, "import", str(tmp_path / "other"), "--run", "runs/base2")  # another model in its place
    line = run_bad(capsys, "sample", "--run", "runs/on2", "--max-new-tokens", "2")
    assert "has changed since the adapters were trained on it" in line
    line = run_bad(capsys, "train", "--run", "runs/on2", "--resume", "--max-steps", "6", "--quiet")
    base = at / "runs/base2"
    assert line == (f"gptlab: error: the base of this LoRA run, {base}, is not the one its adapters were trained on "
                    f"({base}: moved, or its weights changed); restore it or fine-tune again into a new --run")


@pytest.mark.parametrize("kept", ["run", "sha256"])
def test_a_checkpoint_that_names_half_of_its_base_is_refused_as_damaged(at, capsys, kept):
    """A LoRA checkpoint's state.json whose base lacks its folder or its weights' sha256 cannot be checked against
    its base: refused in one line that says so, not a KeyError (or adapters on unchecked weights)."""
    damaged = at / f"runs/half-{kept}"
    shutil.copytree(at / "runs/lo", damaged)
    for state in damaged.glob("checkpoints/*/state.json"):  # rewritten with its manifest: only the base is wrong
        data = json.loads(state.read_text())
        data["base"] = {kept: data["base"][kept]}
        state.write_text(json.dumps(data))
        manifest = json.loads((state.parent / "manifest.json").read_text())
        manifest["files"]["state.json"] = {"bytes": state.stat().st_size,
                                           "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
        (state.parent / "manifest.json").write_text(json.dumps(manifest))
    line = run_bad(capsys, "sample", "--run", str(damaged), "--max-new-tokens", "2")
    assert f"{damaged} holds LoRA adapters but does not name its base run; the checkpoint is damaged" in line


def test_the_memory_check_counts_the_frozen_base_at_its_own_bytes(monkeypatch):
    from gptlab.config import ModelConfig
    from gptlab.training.preflight import check_memory

    model_cfg = ModelConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=12, n_embd=768)
    params = 50257 * 768 + 64 * 768 + 2 * (12 * 768 * 768 + 13 * 768) + 2 * 768  # GPT-2's count, worked out
    adapters = 2 * 8 * (768 + 3 * 768)  # c_attn, rank 8
    total = params * 4 + adapters * 16
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": total}[name])
    lora_cfg = TrainConfig(batch_size=1, init_from="runs/base", lora_rank=8)
    check_memory(model_cfg, lora_cfg, torch.device("cpu"), 1)  # exactly enough
    with pytest.raises(GptlabError, match="or train LoRA adapters"):
        check_memory(model_cfg, TrainConfig(batch_size=1, init_from="runs/base"), torch.device("cpu"), 1)
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": total - 1}[name])
    with pytest.raises(GptlabError, match="this model has"):
        check_memory(model_cfg, lora_cfg, torch.device("cpu"), 1)
    bf16 = total - 2 * (12 * 768 * 768) * 2  # a bf16 run: the blocks' frozen matrices at 2 bytes (c_attn's 3C^2,
    # attention's c_proj C^2, c_fc's 4C^2 and the MLP's c_proj 4C^2 per block), embeddings and vectors at 4
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": bf16}[name])
    check_memory(model_cfg, lora_cfg, torch.device("cpu"), 1, "bf16")
    with pytest.raises(GptlabError, match="this model has"):
        check_memory(model_cfg, lora_cfg, torch.device("cpu"), 1, "fp32")
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": bf16 - 1}[name])
    with pytest.raises(GptlabError, match="this model has"):
        check_memory(model_cfg, lora_cfg, torch.device("cpu"), 1, "bf16")


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, words", [
    (["--lora-rank", "4"], "LoRA adapts a trained model: name it with --init-from"),
    (["--init-from", "runs/base", "--lora-rank", "33"], "--lora-rank 33 is more than the narrowest adapted layer's"),
    (["--init-from", "runs/base", "--lora-rank", "0"], "lora_rank must be at least 1, not 0 (leave it unset"),
    (["--init-from", "runs/base", "--lora-rank", "-1"], "lora_rank must be at least 1, not -1"),
    (["--init-from", "runs/base", "--lora-rank", "4", "--lora-targets", "c_attn,wte"],
     "error: lora_targets: unknown layer 'wte'; choose among"),  # refused with the settings, before any model
    (["--init-from", "tiny-hf", "--lora-rank", "4"], "LoRA needs a gptlab run as its base"),
    (["--init-from", "runs/base", "--lora-rank", "4", "--lora-dropout", "1"], "lora_dropout must be in [0, 1)"),
    (["--init-from", "runs/base", "--lora-rank", "4", "--fsdp"], "--fsdp does not shard LoRA's frozen base yet"),
    (["--init-from", "runs/base", "--lora-rank", "4", "--engine", "reference"], "the reference engine trains every "
                                                                                 "weight; drop --lora-rank"),
])
def test_bad_lora_settings_are_one_line_and_write_nothing(at, capsys, flags, words):
    before = tree(at)
    line = run_bad(capsys, "train", "--data", "data", "--run", "runs/bad", "--max-steps", "2", "--quiet", *flags)
    assert words in line
    assert tree(at) == before


def test_bad_exports_and_imports_are_one_line_and_write_nothing(at, capsys, tmp_path):
    hf_folder(tmp_path / "wide", seed=1, **{**TINY, "n_embd": 48})
    run_ok(capsys, "import", str(tmp_path / "wide"), "--run", "runs/wide")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft3")
    before = tree(at)
    cases = [
        (["export", "runs/lo", "--out", "x"], "holds LoRA adapters (rank 4, alpha 16, dropout 0 on c_attn,c_proj,c_fc)"
                                              ": export --merge"),
        (["export", "runs/base", "--merge", "--out", "x"], "has no LoRA adapters to merge"),
        (["export", "runs/base", "--format", "peft", "--out", "x"], "has no LoRA adapters (it was trained in full)"),
        (["export", "runs/lo", "--format", "peft", "--merge", "--out", "x"], "drop --merge"),
        (["import", "peft", "lo-peft3", "--base", "runs/wide", "--run", "runs/x"], "does not fit the model of "
                                                                                    "runs/wide"),
        (["import", "peft", "lo-peft3", "--run", "runs/x"], "needs the run of the model the adapter was trained on"),
        (["import", "peft", "tiny-hf", "--base", "runs/base", "--run", "runs/x"], "is not a PEFT adapter folder"),
        (["import", "peft", "lo-peft3", "--base", "tiny-hf", "--run", "runs/x"], "--base tiny-hf is not a gptlab run"),
        (["import", "tiny-hf", "--base", "runs/base", "--run", "runs/x"], "--base is for `gptlab import peft DIR "
                                                                          "--base RUN`"),
        (["import", "lora", "tiny-hf", "--run", "runs/x"], "import takes [hf|peft|gguf] PATH, not lora tiny-hf"),
    ]
    for argv, words in cases:
        assert words in run_bad(capsys, *argv), argv
    assert tree(at) == before
    config = json.loads((at / "lo-peft3/adapter_config.json").read_text())
    (at / "lo-peft3/adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    line = run_bad(capsys, "import", "peft", "lo-peft3", "--base", "runs/base", "--run", "runs/x")
    assert "sets use_dora = True, which gptlab's LoRA does not implement" in line
    assert not (at / "runs/x").exists()


def test_eval_and_inspect_take_a_lora_run_and_eval_scores_what_peft_computes(at, capsys):
    import numpy as np
    from gptlab.data.batches import load_dataset

    run_ok(capsys, "export", "runs/base", "--out", "base-hf4")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft4")
    theirs = peft_model(at / "base-hf4", at / "lo-peft4")
    val = torch.as_tensor(np.asarray(load_dataset("data").val, dtype=np.int64))
    nats = count = 0
    with torch.no_grad():
        for start in range(0, len(val) - 1, 32):  # windows of 32 predictions, each token predicted once
            window = val[start:start + 33]
            logits = theirs(window[None, :-1]).logits[0]
            nats += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
            count += len(window) - 1
    scored = json.loads(run_ok(capsys, "eval", "--run", "runs/lo", "--precision", "fp32", "--json"))["scores"][0]
    assert scored["tokens"] == count and scored["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert "total" in run_ok(capsys, "inspect", "model", "--run", "runs/lo")
    run_ok(capsys, "inspect", "lens", "--run", "runs/lo", "--prompt", "Speak, speak.", "--out", "lens")
    assert (at / "lens").is_dir() and any((at / "lens").glob("*.png"))


# ---- what the planted bugs showed unguarded ----------------------------------------------------------------------

def test_unset_lora_settings_take_peft_s_defaults():
    defaults = LoraConfig()
    assert lora.settings({"lora_rank": 4}) == lora.LoraSettings(4, float(defaults.lora_alpha),
                                                                float(defaults.lora_dropout), ("c_attn",))
    assert lora.settings({"lora_rank": None}) is None and lora.settings(None) is None


def test_a_new_adapter_draws_a_as_peft_does_and_b_is_zero(tmp_path):
    hf_folder(tmp_path / "hf", seed=3, **{**TINY, "n_embd": 256, "n_head": 4, "n_layer": 1})
    theirs = peft_model(tmp_path / "hf", r=16, target_modules=["c_attn"])
    ours = load_hf_model(tmp_path / "hf")
    lora.apply_lora(ours, lora.LoraSettings(16, 8.0, 0.0, ("c_attn",)))
    a, b = ours.transformer.h[0].attn.c_attn.lora_A.weight, ours.transformer.h[0].attn.c_attn.lora_B.weight
    peft_a = theirs.base_model.model.transformer.h[0].attn.c_attn.lora_A["default"].weight
    assert a.shape == peft_a.shape and not b.any()
    # uniform on (-bound, bound), bound = 1 / sqrt(in) for kaiming_uniform(a=sqrt(5)): 4,096 draws reach it closely
    assert a.abs().max().item() == pytest.approx(peft_a.abs().max().item(), rel=2e-3)
    assert a.abs().max().item() <= 1 / 256 ** 0.5


def test_adapter_dropout_drops_in_training_only():
    layer = lora.LoRALinear(torch.nn.Linear(64, 48), 4, 8.0, 0.5)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(8, 64)
    assert not torch.equal(layer(x), layer(x))  # a new mask each call
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    plain = lora.LoRALinear(torch.nn.Linear(64, 48), 4, 8.0, 0.0)
    assert torch.equal(plain(x), plain(x))


def test_a_target_outside_the_list_is_named_with_the_choices():
    from gptlab.config import ModelConfig
    from gptlab.model import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(GptlabError, match=r"^--lora-targets: unknown layer 'wte'; choose among c_attn, c_proj, c_fc, "
                                          r"attn\.c_attn, attn\.c_proj, mlp\.c_fc, mlp\.c_proj \(comma-separated\)$"):
        lora.apply_lora(model, lora.LoraSettings(2, 4.0, 0.0, ("wte",)))


def test_a_rank_up_to_the_narrowest_adapted_width_is_taken_as_peft_takes_it():
    from gptlab.config import ModelConfig
    from gptlab.model import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8))
    lora.apply_lora(model, lora.LoraSettings(8, 8.0, 0.0, ("c_attn",)))  # c_attn is 8 -> 24: rank 8 is its width
    assert model.transformer.h[0].attn.c_attn.lora_A.weight.shape == (8, 8)
    with pytest.raises(GptlabError, match=r"^--lora-rank 9 is more than the narrowest adapted layer's width \(8\); "
                                          r"choose a rank of at most 8$"):
        lora.apply_lora(GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8)),
                        lora.LoraSettings(9, 8.0, 0.0, ("c_attn",)))


def test_rank_1_is_the_lowest_rank_apply_lora_takes_through_the_api_too():
    """The settings refuse a rank below 1 before any model (above); apply_lora, called from code, holds the same
    edge: rank 1 adapts (A one row, B one column), 0 is refused in one line."""
    from gptlab.config import ModelConfig
    from gptlab.model import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8))
    assert lora.apply_lora(model, lora.LoraSettings(1, 2.0, 0.0, ("c_fc",))) == ["transformer.h.0.mlp.c_fc"]
    layer = model.transformer.h[0].mlp.c_fc
    assert (layer.lora_A.weight.shape, layer.lora_B.weight.shape, layer.scaling) == ((1, 8), (32, 1), 2.0)
    with pytest.raises(GptlabError, match=r"^--lora-rank must be at least 1, not 0$"):
        lora.apply_lora(GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8)),
                        lora.LoraSettings(0, 2.0, 0.0, ("c_fc",)))


def test_the_peft_config_names_the_base_and_loads_without_peft_s_complaints(at, capsys, recwarn):
    run_ok(capsys, "export", "runs/base", "--out", "base-hf5")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft5")
    config = json.loads((at / "lo-peft5/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-hf"  # the folder runs/base was imported from: no local path
    recwarn.clear()
    peft_model(at / "base-hf5", at / "lo-peft5")
    assert not [w for w in recwarn if "fan_in_fan_out" in str(w.message)]  # PEFT fixes a wrong flag, with a warning


def test_a_peft_export_into_a_gptlab_folder_or_a_full_disk_is_refused_and_writes_nothing(at, capsys, monkeypatch):
    before = tree(at)
    assert "--out data is a prepared data folder; exporting there would overwrite" in run_bad(
        capsys, "export", "runs/lo", "--format", "peft", "--out", "data")
    assert "--out runs/base is a gptlab run; exporting there would overwrite" in run_bad(
        capsys, "export", "runs/lo", "--format", "peft", "--out", "runs/base")
    assert "--out runs/lo is the run itself" in run_bad(capsys, "export", "runs/lo", "--format", "peft", "--out",
                                                        "runs/lo")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("gptlab.hf.gpt2_folders.save_file", no_space)
    line = run_bad(capsys, "export", "runs/lo", "--format", "peft", "--out", "full/lo")
    assert line == ("gptlab: error: cannot write full/lo/adapter_model.safetensors: No space left on device; check "
                    "free space")
    assert tree(at) == before


def test_export_peft_over_another_projects_files_needs_overwrite(at, capsys):
    """A folder holding files gptlab did not export is refused, by the CLI and by export_peft itself, unless asked
    to overwrite (--overwrite); an adapter run imported from a folder names no Hugging Face base of its own."""
    from gptlab.hf.peft import base_name, export_peft

    (at / "theirs").mkdir()
    (at / "theirs/notes.txt").write_text("not gptlab's")
    line = run_bad(capsys, "export", "runs/lo", "--format", "peft", "--out", "theirs")
    assert "theirs" in line and "--overwrite" in line
    with pytest.raises(GptlabError, match="--overwrite"):
        export_peft("runs/lo", at / "theirs")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "theirs", "--overwrite")
    assert (at / "theirs/adapter_model.safetensors").is_file()
    run_ok(capsys, "import", "peft", "theirs", "--base", "runs/base", "--run", "runs/from-theirs")
    assert base_name("runs/base") == "tiny-hf" and base_name("runs/from-theirs") is None


def test_a_peft_adapter_of_another_type_or_with_dropout_imports_as_it_says(at, capsys):
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft6")
    config = json.loads((at / "lo-peft6/adapter_config.json").read_text())
    (at / "lo-peft6/adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    line = run_bad(capsys, "import", "peft", "lo-peft6", "--base", "runs/base", "--run", "runs/y")
    assert "holds a PEFT adapter of type 'PREFIX_TUNING'; gptlab imports LoRA adapters only" in line
    (at / "lo-peft6/adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.125}))
    run_ok(capsys, "import", "peft", "lo-peft6", "--base", "runs/base", "--run", "runs/y")
    train = json.loads((at / "runs/y/config.json").read_text())["train"]
    assert (train["lora_rank"], train["lora_alpha"], train["lora_dropout"], train["lora_targets"]) == \
        (4, 16.0, 0.125, "c_attn,c_proj,c_fc")
    written = json.loads((at / "runs/y/config.json").read_text())  # the base's preset, or none as the base has
    assert written.get("preset", "none") == json.loads((at / "runs/base/config.json").read_text()).get("preset", "none")
    run_ok(capsys, "export", "runs/y", "--format", "peft", "--out", "y-peft")  # and back out: PEFT reads what it set
    back = PeftConfig.from_pretrained(at / "y-peft")
    assert (back.lora_dropout, back.task_type, back.r, back.lora_alpha) == (0.125, "CAUSAL_LM", 4, 16.0)
    # every field gptlab writes, as PEFT's own save_pretrained writes it for the same adapters
    peft_own = peft_model(at / "tiny-hf", r=4, lora_alpha=16, lora_dropout=0.125, target_modules=["c_attn", "c_proj",
                                                                                                  "c_fc"])
    peft_own.save_pretrained(at / "y-peft-own")
    theirs = json.loads((at / "y-peft-own/adapter_config.json").read_text())
    ours = json.loads((at / "y-peft/adapter_config.json").read_text())
    fields = ["peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "fan_in_fan_out", "bias", "inference_mode",
              "init_lora_weights", "use_rslora", "use_dora", "modules_to_save", "trainable_token_indices"]
    assert {f: ours[f] for f in fields} == {f: theirs[f] for f in fields}
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def test_bench_train_sets_lora_beside_full_fine_tuning_with_memory_split(char_data, monkeypatch, capsys):
    """The tiny bench: full fine-tuning, LoRA and LoRA with activation checkpointing, each one's memory measured in a
    fresh process; the split's weights and trained bytes worked out here (no timing is asserted)."""
    from gptlab import model as model_module
    from gptlab.bench import device_peak
    from gptlab.bench.train_speed import lora_variants, run_train_bench
    from gptlab.config import ModelConfig
    from gptlab.peak import Peak

    monkeypatch.setattr(device_peak, "measure_peak", lambda device, quick: Peak(1e10, "test", bf16=2e10))
    model = ModelConfig(block_size=32, n_layer=3, n_head=2, n_embd=48, dropout=0.1, vocab_size=0)
    variants = lora_variants(torch.device("cpu"), 4)
    chunks, real = [], model_module.chunked_loss
    monkeypatch.setattr(model_module, "chunked_loss", lambda *a: chunks.append(a[-1]) or real(*a))
    rows = run_train_bench(char_data, model, TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, device="cpu",
                                                         loss_chunk=40), steps=1, warmup=0, variants=variants,
                           memory=True)
    assert chunks == [40] * 3  # each variant's step here (the memory is measured in processes of its own)
    lines = capsys.readouterr().out.strip().splitlines()
    V = len(set(CORPUS))
    params = V * 48 + 32 * 48 + 3 * (12 * 48 * 48 + 13 * 48) + 2 * 48  # tied head; biases, LayerNorms
    adapters = 3 * 4 * (48 + 3 * 48)  # rank 4 on c_attn (48 -> 144) in 3 blocks
    halved = 3 * 12 * 48 * 48 * 2 if variants[1].precision == "bf16" else 0  # LoRA's frozen matrices in bf16
    assert [r["weights_bytes"] for r in rows] == [params * 4, *[(params + adapters) * 4 - halved] * 2]
    assert [r["trained_bytes"] for r in rows] == [params * 12, adapters * 12, adapters * 12]
    assert 0 < rows[2]["saved_bytes"] < rows[1]["saved_bytes"] / 2  # the checkpointed blocks keep their inputs only
    assert rows[0]["step_bytes"] >= params * 4  # a step of full fine-tuning makes every weight's gradient
    assert all(r["step_bytes"] > 0 and r["base_bytes"] > (params + adapters) * 4 for r in rows)
    assert rows[1]["val_loss"] == rows[2]["val_loss"] != rows[0]["val_loss"]
    assert lines[-1].startswith(f"{variants[1].name}: peak ") and f"; {variants[2].name}: peak " in lines[-1]
    assert main_ok("bench", "train", "--lora-rank", "4", "--traced") is False


def test_bench_train_lora_rank_runs_the_three_variants_with_memory(monkeypatch, capsys, tmp_path):
    """The command line reaches the bench: --lora-rank R gives full fine-tuning, LoRA of rank R and LoRA with
    activation checkpointing, memory measured; a rank under 1 or another comparison beside it is refused."""
    import gptlab.bench.train_speed

    seen = {}
    monkeypatch.chdir(tmp_path)  # the bench prepares the bundled corpus here
    monkeypatch.setattr(gptlab.bench.train_speed, "run_train_bench", lambda data, model, cfg, **kw: seen.update(kw, cfg=cfg))
    assert main_ok("bench", "train", "--lora-rank", "6", "--device", "cpu")
    assert [(v.lora_rank, v.checkpointing) for v in seen["variants"]] == [(0, False), (6, False), (6, True)]
    assert seen["memory"] is True and seen["cfg"].loss_chunk == 0
    assert main_ok("bench", "train", "--lora-rank", "6", "--device", "cpu", "--loss-chunk", "128")
    assert seen["cfg"].loss_chunk == 128  # every variant's, the reference's too
    assert main_ok("bench", "train", "--loss-chunk", "-2") is False
    assert "loss_chunk must be >= 0" in capsys.readouterr().err
    for bad in (["--lora-rank", "0"], ["--lora-rank", "4", "--activation-checkpointing"]):
        assert main_ok("bench", "train", *bad) is False
        assert "is its own comparison" in capsys.readouterr().err


def test_the_bench_makes_adamw_state_for_the_adapters_only_and_no_gradient_for_the_frozen_base():
    """bench.memory's base level is the model and the optimizer's state: a frozen weight must get neither."""
    from gptlab.bench.memory import _allocate_optimizer_state
    from gptlab.config import ModelConfig
    from gptlab.model import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))
    lora.apply_lora(model, lora.LoraSettings(2, 8.0, 0.0, ("c_attn",)))
    optimizer = make_optimizer(model, TrainConfig(lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _allocate_optimizer_state(model, optimizer)
    assert all(p.grad is None for p in model.parameters())
    assert {id(p) for p in optimizer.state} == {id(p) for n, p in model.named_parameters() if lora.is_adapter(n)}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # at lr 0 nothing moves


def test_an_imported_adapter_is_described_as_an_import_on_its_bases_preset(tmp_path, char_data, monkeypatch, capsys):
    import re

    from helpers import TINY

    monkeypatch.chdir(tmp_path)
    run_ok(capsys, "train", "--data", "data", "--run", "runs/base", "--max-steps", "2", *TINY)
    run_ok(capsys, "train", "--init-from", "runs/base", "--data", "data", "--run", "runs/lo", "--lora-rank", "2",
           "--max-steps", "2", "--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--precision",
           "fp32", "--quiet")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft")
    out = run_ok(capsys, "import", "peft", "lo-peft", "--base", "runs/base", "--run", "runs/back")
    count = int(re.search(r"([\d,]+) adapter parameters", out).group(1).replace(",", ""))
    info = run_ok(capsys, "info", "runs/back")
    assert info.splitlines()[0] == (f"run runs/back: imported from {tmp_path / 'lo-peft'} (no training steps), "
                                    "preset char-quick+lora")
    assert "data:" not in info and "step 0" not in info and f"({count:,} parameters)" in info
    assert "char-quick+lora" in run_ok(capsys, "runs", "runs").splitlines()[-1]


def test_a_peft_export_names_its_base_by_hugging_face_name_or_not_at_all(at, tmp_path, char_data, monkeypatch,
                                                                          capsys):
    from gptlab.hf.peft import hub_name
    from helpers import TINY as TINY_FLAGS

    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft-name")
    config = json.loads((at / "lo-peft-name/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-hf" and str(at) not in json.dumps(config)
    assert hub_name("/home/me/.cache/huggingface/hub/models--openai-community--gpt2/snapshots/607a30d7") == \
        "openai-community/gpt2"
    monkeypatch.chdir(tmp_path)  # a base trained here, imported from nowhere: no name to give
    run_ok(capsys, "train", "--data", "data", "--run", "runs/base", "--max-steps", "2", *TINY_FLAGS)
    run_ok(capsys, "train", "--init-from", "runs/base", "--data", "data", "--run", "runs/lo", "--lora-rank", "2",
           "--max-steps", "2", "--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--precision",
           "fp32", "--quiet")
    run_ok(capsys, "export", "runs/lo", "--format", "peft", "--out", "lo-peft")
    text = (tmp_path / "lo-peft/adapter_config.json").read_text()
    assert json.loads(text)["base_model_name_or_path"] is None and str(tmp_path) not in text
