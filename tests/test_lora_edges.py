"""LoRA's edges (issue 42, behaviour 5), held to PEFT itself or to numbers worked out here: the adapters' dropout
in training mode, where PEFT puts it (on the input of the A path alone) and at a scaling alpha / r off its default;
and every LoraConfig setting of the installed PEFT that gptlab's adapters do not implement, refused by `gptlab import
peft` in one line that names it, with nothing written (the adapter folder made by PEFT's own save_pretrained)."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import GPT2LMHeadModel

from helpers import hf_folder, run_bad, run_ok, tree
from gptlab import lora
from gptlab.checkpoint import load_run, model_tensors
from gptlab.hf import peft as gptlab_peft
from gptlab.hf.gpt2_folders import load_hf_model

P = 0.25  # the adapters' dropout: not the default 0, and not 0.5, where p and 1 - p would be the same number
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # transformers' own dropouts off: LoRA's alone
SMALL = dict(n_embd=32, n_head=2, n_layer=2, n_positions=32, **NO_DROPOUT)
TARGETS = ["c_attn", "c_proj", "c_fc"]


class ShapeSeededDropout(torch.nn.Module):
    """Dropout at the p of the dropout it replaces, whose mask is drawn from a generator seeded by the input's shape:
    the same mask on both sides for inputs of one shape, another mask for another shape (the A path's output is
    narrower than its input), so where the dropout sits is what decides whether two models agree."""

    def __init__(self, replaced: torch.nn.Module):
        super().__init__()
        self.p = getattr(replaced, "p", 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = 1_000_003 * x.shape[-1] + x.numel()
        keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) >= self.p
        return x * keep.to(x.dtype) / (1 - self.p)


def swap_dropouts(ours: torch.nn.Module, theirs: torch.nn.Module) -> int:
    """Every adapter dropout of both models made a ShapeSeededDropout; returns how many were swapped on each."""
    swapped = 0
    for module in ours.modules():
        if isinstance(module, lora.LoRALinear):
            module.lora_dropout = ShapeSeededDropout(module.lora_dropout)
            swapped += 1
    for module in theirs.modules():
        if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict):
            module.lora_dropout["default"] = ShapeSeededDropout(module.lora_dropout["default"])
    return swapped


def test_in_training_the_adapters_dropout_sits_on_the_a_paths_input_as_in_peft(tmp_path):
    """r 4, alpha 6 (scaling 1.5, not PEFT's default alpha 8) and dropout P on every layer kind, B far from zero; both
    models in training mode with the same masks for inputs of one shape: the same logits and the same gradients of A
    and B as PEFT's. In eval mode they agree again, and differ from training's (the dropout is felt)."""
    hf_folder(tmp_path / "hf", seed=5, **SMALL)
    theirs = get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "hf"), LoraConfig(
        r=4, lora_alpha=6, lora_dropout=P, target_modules=TARGETS, fan_in_fan_out=True, task_type="CAUSAL_LM"))
    ours = load_hf_model(tmp_path / "hf")
    lora.apply_lora(ours, lora.LoraSettings(4, 6.0, P, tuple(TARGETS)))
    adapters = {n: torch.randn_like(t) * 0.3 for n, t in model_tensors(ours).items()}
    ours.load_state_dict(adapters, strict=False)
    assert not set_peft_model_state_dict(theirs, {f"base_model.model.{n}": t for n, t in adapters.items()}
                                         ).unexpected_keys
    assert swap_dropouts(ours, theirs) == 2 * 4
    x = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for model, logits_of in ((ours, lambda m: m(x)[0]), (theirs, lambda m: m(input_ids=x).logits)):
        model.train()
        logits = logits_of(model)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
                 for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            results.append((logits.detach(), grads, logits_of(model.eval())))
    (got, our_grads, our_eval), (want, their_grads, their_eval) = results
    assert (got - want).abs().max().item() <= 1e-5
    assert our_grads.keys() == their_grads.keys() and len(our_grads) == 2 * 4 * 2
    for name, grad in their_grads.items():
        assert (our_grads[name] - grad).abs().max().item() <= 1e-5 * grad.abs().max().item() + 1e-7, name
    assert (our_eval - their_eval).abs().max().item() <= 1e-5 and (our_eval - want).abs().max().item() > 1e-2


def test_the_adapters_dropout_keeps_a_fraction_1_minus_p_scaled_by_alpha_over_r_over_1_minus_p():
    """By hand: a layer whose base is zero and whose A and B are the identity (rank 8 = its width), alpha 12: in
    training its output is 1.5 x dropout(x), so on ones each element is 0 or 1.5 / (1 - P) = 2, a fraction P of
    them 0 (within 5 standard deviations of a binomial fraction over 32,768 draws); in eval, 1.5 everywhere."""
    base = torch.nn.Linear(8, 8)
    torch.nn.init.zeros_(base.weight)
    torch.nn.init.zeros_(base.bias)
    layer = lora.LoRALinear(base, 8, 12.0, P)
    with torch.no_grad():
        layer.lora_A.weight.copy_(torch.eye(8))
        layer.lora_B.weight.copy_(torch.eye(8))
    torch.manual_seed(3)
    x = torch.ones(4096, 8)
    with torch.no_grad():
        y = layer.train()(x)
        kept = y[y != 0]
        assert torch.allclose(kept, torch.full_like(kept, 2.0), rtol=1e-6, atol=0)
        zeros, n = (y == 0).double().mean().item(), y.numel()
        assert abs(zeros - P) <= 5 * (P * (1 - P) / n) ** 0.5, zeros
        assert torch.equal(layer.eval()(x), torch.full_like(x, 1.5))


# ---- `gptlab import peft`: what gptlab's adapters do not implement is refused ------------------------------------

PEFT_SHAPE = dict(vocab_size=50257, n_embd=32, n_head=2, n_layer=2, n_positions=32)  # GPT-2's vocabulary: importable


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A folder with a tiny random GPT-2 imported as runs/base, and `peft`: LoRA adapters for it (rank 4, alpha 6 on
    c_attn and c_fc, B far from zero) written by PEFT's own save_pretrained."""
    root = tmp_path_factory.mktemp("peft-edges")
    hf_folder(root / "tiny-hf", seed=9, **PEFT_SHAPE)
    theirs = get_peft_model(GPT2LMHeadModel.from_pretrained(root / "tiny-hf"), LoraConfig(
        r=4, lora_alpha=6, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    theirs.save_pretrained(root / "peft")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        from gptlab.cli import main

        assert main(["import", "tiny-hf", "--run", "runs/base"]) == 0
    return root


def adapter_with(root, name: str, **settings):
    """A copy of the PEFT adapter folder whose adapter_config.json sets `settings` over PEFT's."""
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(root / "peft", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **settings}))
    return folder


REFUSED = [  # (setting, a value PEFT takes): each one a model gptlab's plain LoRA would compute differently
    ("use_dora", True), ("use_rslora", True), ("bias", "all"), ("bias", "lora_only"), ("lora_bias", True),
    ("modules_to_save", ["lm_head"]), ("layers_to_transform", [0]), ("rank_pattern", {"c_fc": 2}),
    ("alpha_pattern", {"c_fc": 12}), ("exclude_modules", ["transformer.h.0.attn.c_attn"]),
    ("target_parameters", ["mlp.c_fc.weight"]), ("layer_replication", [[0, 2], [1, 2]]), ("use_qalora", True),
    ("megatron_config", {"num_layers": 2}), ("loftq_config", {"loftq_bits": 4, "loftq_iter": 1}),
    ("alora_invocation_tokens", [50, 51]), ("arrow_config", {"top_k": 1}), ("use_bdlora", {"nblocks": 2}),
    ("velora_config", {"num_groups": 4}), ("monteclora_config", {"n_samples": 2}), ("kasa_config", {"beta": 0.1}),
    ("astra_config", {"rank": 4}), ("init_lora_weights", "astra"),
    ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"), ("init_lora_weights", "loftq"), ("init_lora_weights", "lora_ga"),
    ("init_lora_weights", "mica"), ("task_type", "SEQ_CLS"), ("task_type", "FEATURE_EXTRACTION"),
    ("target_modules", r".*\.c_attn"), ("target_modules", "c_attn"), ("target_modules", ["c_attn", "lm_head"]),
    ("target_modules", ["transformer.h.0.attn.c_attn"]),
]


@pytest.mark.parametrize("setting, value", REFUSED, ids=[f"{k}={v}".translate({ord(c): None for c in " '\\"})
                                                           for k, v in REFUSED])
def test_a_peft_setting_gptlab_does_not_implement_is_refused_in_one_line_naming_it(made, capsys, monkeypatch,
                                                                                   setting, value):
    monkeypatch.chdir(made)
    folder = adapter_with(made, "edited", **{setting: value})
    before, run = tree(made), f"runs/refused-{REFUSED.index((setting, value))}"
    line = run_bad(capsys, "import", "peft", str(folder), "--base", "runs/base", "--run", run)
    assert f"sets {setting} = {value!r}" in line and "gptlab's LoRA does not implement" in line
    why = {"task_type": " (a model other than GPT-2's language model)",  # the reason each refusal gives, by hand
           "target_modules": " (a regular expression over whole module names)" if isinstance(value, str) else
           " (gptlab adapts c_attn, c_proj, c_fc, attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)"}
    if setting in why or setting == "init_lora_weights":
        assert f"sets {setting} = {value!r}{why.get(setting, '')}, which gptlab's LoRA does not implement" in line
    assert tree(made) == before and not (made / run).exists()


ACCEPTED = {  # PEFT settings that leave the adapters' model as plain LoRA computes it
    "fan_in_fan_out": False,  # PEFT sets it for GPT-2's Conv1D layers itself (with a warning)
    "init_lora_weights": "gaussian",  # how A and B started, the base untouched
    "eva_config": {"rho": 2.0}, "corda_config": {"cache_file": None}, "lora_ga_config": {"direction": "ArB2r"},
    "task_type": None, "lora_dropout": P, "ensure_weight_tying": True, "megatron_core": "megatron.core",
}


def test_peft_settings_that_change_nothing_import_as_the_model_peft_loads(made, capsys, monkeypatch, recwarn):
    """The adapter with every accepted setting off its default: imported, and its logits those of PEFT loading
    the same folder onto the same base (in eval mode); plain as written by PEFT, the same again."""
    monkeypatch.chdir(made)
    folder = adapter_with(made, "accepted", **ACCEPTED)
    x = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(4))
    for source, run in ((made / "peft", "runs/plain"), (folder, "runs/accepted")):
        run_ok(capsys, "import", "peft", str(source), "--base", "runs/base", "--run", run)
        theirs = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(made / "tiny-hf"), source).eval()
        with torch.no_grad():
            want, got = theirs(input_ids=x).logits, load_run(run).model(x)[0]
            assert (got - want).abs().max().item() <= 1e-5, source
            assert (want - GPT2LMHeadModel.from_pretrained(made / "tiny-hf")(x).logits).abs().max() > 1e-2
    train = json.loads((made / "runs/accepted/config.json").read_text())["train"]
    assert (train["lora_rank"], train["lora_alpha"], train["lora_dropout"]) == (4, 6.0, P)


def test_every_setting_of_peft_s_lora_config_is_either_read_refused_or_known_to_change_nothing():
    """A PEFT release that adds a LoraConfig setting fails here until it is sorted into one of the three."""
    known = set(gptlab_peft._UNSUPPORTED) | set(gptlab_peft._HARMLESS) | set(gptlab_peft._READ)
    assert {f.name for f in dataclasses.fields(LoraConfig)} - known == set()
    assert not set(gptlab_peft._UNSUPPORTED) & (set(gptlab_peft._HARMLESS) | set(gptlab_peft._READ))


def test_an_embedding_with_trainable_tokens_prints_as_one_and_lives_on_its_base_s_device():
    """print(model) shows nn.Embedding's own line (no norm, sparse or scaled-gradient setting it does not have),
    and the ids it keeps are made where the base's weight is: here the meta device, so that a tensor made on
    the default device instead would show (on the CPU alone the two are the same)."""
    base = torch.nn.Embedding(11, 4, device="meta")
    tokens = lora.TrainableTokens(base, [3, 7])
    assert repr(tokens) == "TrainableTokens(11, 4)"
    assert {t.device.type for t in (tokens.token_ids, tokens.slot, tokens.token_values)} == {"meta"}
    assert (tokens.token_ids.dtype, tokens.slot.dtype) == (torch.long, torch.long)
    cpu = lora.TrainableTokens(torch.nn.Embedding(11, 4), [3, 7])
    assert cpu.slot.tolist() == [-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1]


def test_a_damaged_or_partial_adapter_folder_is_refused_in_one_line_naming_the_folder_and_the_fault(
        made, capsys, monkeypatch):
    """Each way an adapter folder can be wrong, as `gptlab import peft` says it (one line, nothing written): the
    folder named first, then what is wrong, worked out here; and a config without init_lora_weights (PEFT's
    default start, plain LoRA) imports."""
    from gptlab.chat import ChatTokenizer

    monkeypatch.chdir(made)
    markers = sorted(ChatTokenizer(load_run("runs/base").tokenizer).special_ids.values())

    def refused(folder, *expected):
        before = tree(made)
        line = run_bad(capsys, "import", "peft", str(folder), "--base", "runs/base", "--run", "runs/refused")
        assert tree(made) == before and not (made / "runs/refused").exists()
        for part in expected:
            assert part in line, (part, line)
        return line

    folder = adapter_with(made, "listed")
    (folder / "adapter_config.json").write_text("[1, 2]")  # JSON, but not an object
    refused(folder, f"error: {folder} holds a PEFT adapter of type None; gptlab imports LoRA adapters only")
    folder = adapter_with(made, "rank-word", r="four")
    refused(folder, f"error: {folder / 'adapter_config.json'} lacks a usable r, lora_alpha or target_modules (",
            "'four'")
    folder = adapter_with(made, "rank-zero", r=0)
    refused(folder, f"error: {folder}: lora_rank must be at least 1, not 0")
    folder = adapter_with(made, "task", task_type="SEQ_CLS")
    refused(folder, f"error: {folder}: the adapter sets task_type = 'SEQ_CLS'")
    folder = adapter_with(made, "indices", trainable_token_indices="wte")
    refused(folder, f"error: {folder}: trainable_token_indices 'wte' is not a list of token ids")
    folder = adapter_with(made, "not-markers", trainable_token_indices=[5, 6])
    refused(folder, f"error: {folder}: the adapter trains the rows of tokens [5, 6], which are not the chat markers")
    folder = adapter_with(made, "no-rows", trainable_token_indices=markers)  # the markers' rows missing
    refused(folder, f"error: the adapter in {folder} does not fit the model of runs/base: ",
            f"the weights in {folder} do not fit", "token_values (0,) vs (4, 32)")  # no rows for the four markers
    folder = adapter_with(made, "no-weights")
    (folder / "adapter_model.safetensors").unlink()
    refused(folder, f"error: {folder} has no adapter_model.safetensors (gptlab reads adapters in safetensors only)")
    folder = adapter_with(made, "damaged-weights")
    (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    refused(folder, f"error: {folder / 'adapter_model.safetensors'} cannot be read (")

    folder = adapter_with(made, "default-start")
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["init_lora_weights"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    run_ok(capsys, "import", "peft", str(folder), "--base", "runs/base", "--run", "runs/default-start")
    train = json.loads((made / "runs/default-start/config.json").read_text())["train"]
    assert (train["lora_rank"], train["lora_alpha"], sorted(train["lora_targets"].split(","))) == (4, 6.0, ["c_attn", "c_fc"])
    # where it came from, and the base it adapts (its weights' hash), in the run's config and its checkpoint's state
    config = json.loads((made / "runs/default-start/config.json").read_text())
    base = {"run": str((made / "runs/base").resolve()),
            "sha256": lora.tensors_sha256(model_tensors(load_run("runs/base").model))}
    assert config["imported_from"] == str(folder.resolve()) and config["base"] == base
    state = load_run("runs/default-start").state
    assert state.imported_from == str(folder.resolve()) and state.base == base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_merged_layer_is_w_plus_scaling_b_a_in_the_layers_dtype_with_its_bias_or_none(dtype):
    """merged(): W + (alpha / r) B A worked out here in float64 and rounded once to the layer's dtype, no bias where
    the layer has none (not a fresh random one), the layer's bias itself where it has one; made where the layer
    lives (the meta device: a layer made on the default device instead shows)."""
    for bias in (False, True):
        base = torch.nn.Linear(6, 5, bias=bias).to(dtype)
        layer = lora.LoRALinear(base, 2, 3.0, 0.0)
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(5, 2, generator=torch.Generator().manual_seed(2)).to(dtype))
        merged = layer.merged()
        delta = layer.lora_B.weight.double() @ layer.lora_A.weight.double()
        want = (base.weight.double() + 1.5 * delta).to(dtype)
        assert merged.weight.dtype == dtype and (merged.weight.double() - want.double()).abs().max() <= (
            0 if dtype == torch.bfloat16 else 1e-6)
        assert (merged.bias is None) if not bias else (merged.bias is base.bias)
        x = torch.randn(3, 6).to(dtype)
        with torch.no_grad():
            assert (merged(x).double() - layer(x).double()).abs().max() <= (0.05 if dtype == torch.bfloat16 else 1e-5)
    on_meta = lora.LoRALinear(torch.nn.Linear(6, 5, device="meta"), 2, 3.0, 0.0).merged()
    assert on_meta.weight.device.type == "meta"


def test_trainable_tokens_keep_their_ids_and_rows_and_the_tied_head_has_no_bias():
    """What a checkpoint holds of the added tokens: their ids and rows, not the id -> row lookup (rebuilt from the
    ids); the head tied to them prints and behaves as a bias-free Linear."""
    tokens = lora.TrainableTokens(torch.nn.Embedding(11, 4), [3, 7])
    assert set(tokens.state_dict()) == {"weight", "token_ids", "token_values"}
    head = lora.TrainableTokensHead(torch.nn.Linear(4, 11, bias=False), tokens)
    assert head.bias is None and repr(head) == "TrainableTokensHead(in_features=4, out_features=11, bias=False)"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_bf16_runs_start_stores_only_the_frozen_block_matrices_in_bf16(precision, tmp_path):
    """lora.adapt with the run's precision, on any CPU (the bf16 run end to end needs native bf16 and is skipped
    elsewhere): in bf16 the frozen Linear weights of the blocks (targeted or not) become bf16, the adapters,
    embeddings, LayerNorms and biases stay fp32; in fp32 nothing changes. The reference it returns names the base's folder and weights."""
    from gptlab.config import ModelConfig, TrainConfig
    from gptlab.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(init_from=str(tmp_path / "base"), lora_rank=2, lora_targets="c_attn,c_fc")
    base = lora.adapt(model, cfg, init, None, None, precision)
    assert base == {"run": str(tmp_path / "base"), "sha256": lora.tensors_sha256(init)}
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    frozen = {f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                         "mlp.c_proj")}  # targeted or not
    assert frozen <= dtypes.keys() and not any(model.get_parameter(n).requires_grad for n in frozen)
    wanted = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {dtypes[n] for n in frozen} == {wanted}
    assert {dtypes[n] for n in dtypes if n not in frozen} == {torch.float32}
