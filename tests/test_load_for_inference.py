"""load_for_inference: the one way sample, eval, serve and `bench serve` load a run's model: which checkpoint, in
which precision (checked before anything is loaded), prepared to decode or kept for scoring."""

import pytest
import torch
from helpers import CORPUS, TINY, run_bad, tiny_run
from safetensors.torch import load_file

from gptlab.errors import GptlabError
from gptlab.inference.int8 import Int8Linear
from gptlab.inference.loading import load_for_inference
from gptlab.inference.prepared import InferenceModel, TorchStep

V = len(set(CORPUS))  # the char tokenizer's vocabulary


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 6-step run of TINY's model (1 layer, 2 heads, 16 wide, context 16): a best checkpoint and step ones."""
    return tiny_run(tmp_path_factory.mktemp("inference"), 6, [*TINY, "--eval-interval", "3"])


def test_a_run_loads_from_its_best_checkpoint_with_its_parameter_count(run):
    ready = load_for_inference(run, "cpu", "fp32")
    assert ready.checkpoint.kind == "best" and ready.precision == "fp32" and ready.model.precision == "fp32"
    # wte V x 16, wpe 16 x 16, one block (2 LayerNorms, c_attn 16 -> 48, c_proj 16 -> 16, c_fc 16 -> 64, mlp's
    # c_proj 64 -> 16, with biases), ln_f; the head is tied to wte
    block = 2 * 32 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16)
    assert ready.parameters == V * 16 + 16 * 16 + block + 32
    assert isinstance(ready.model, InferenceModel) and not ready.model.model.training
    assert ready.tokenizer.vocab_size == V


def test_for_scoring_fp32_keeps_the_checkpoints_own_weights(run):
    ready = load_for_inference(run, "cpu", "fp32", decode=False)
    weights = load_file(ready.checkpoint.path / "model.safetensors")
    own = ready.model.model.state_dict()
    assert all(torch.equal(own[name], tensor) for name, tensor in weights.items())
    assert isinstance(ready.model.decoder, TorchStep)


def test_for_scoring_int8_runs_the_int8_weights_through_the_torch_reference(run):
    ready = load_for_inference(run, "cpu", "int8", decode=False)
    block = ready.model.model.transformer.h[0]
    linears = [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]
    assert all(isinstance(m, Int8Linear) for m in linears) and isinstance(ready.model.decoder, TorchStep)
    assert ready.precision == "int8"


def test_a_precision_this_machine_lacks_is_refused_before_anything_is_loaded(tmp_path, monkeypatch, run):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # no AVX-512 BF16, no AMX
    with monkeypatch.context() as m:  # and no compiler for the native step, which stores bf16 on any CPU
        m.setattr("gptlab.inference.native.missing", lambda: "no g++ on PATH")
        with pytest.raises(GptlabError, match="no native bf16 support and no g\\+\\+ .*; use --precision fp32"):
            load_for_inference(tmp_path / "not-a-run", "cpu", "bf16")
        assert load_for_inference(run, "cpu", "auto").precision == "fp32"  # no native bf16, no native step
    # the native step stores bf16 on any CPU: auto decodes in bf16; scoring alone (torch's forward) stays in fp32
    assert load_for_inference(run, "cpu", "auto").precision == "bf16"
    assert load_for_inference(run, "cpu", "auto", decode=False).precision == "fp32"
    with pytest.raises(GptlabError, match="does not exist"):
        load_for_inference(tmp_path / "not-a-run", "cpu", "fp32")


def test_sample_refuses_a_prompt_its_tokenizer_cannot_read_before_the_model_is_prepared(run, monkeypatch, capsys):
    """Preparing (packing the weights, building the fused step on first use) is work a bad prompt must not wait for:
    sample reads its prompt with the run's tokenizer first, as it did before load_for_inference."""
    import gptlab.inference.loading

    prepared = []
    monkeypatch.setattr(gptlab.inference.loading, "prepare_for_inference", lambda *args, **kw: prepared.append(args))
    line = run_bad(capsys, "sample", "--run", str(run), "--prompt", "\u2603", "--precision", "fp32")
    assert "never seen" in line and prepared == []


def test_by_default_a_run_loads_in_fp32_on_the_cpu_and_elsewhere_where_asked(run):
    """load_for_inference(run) alone: fp32 on the CPU; a device given as a torch.device is where the model lands
    (the meta device stands in for a GPU here: a model left on the CPU shows)."""
    ready = load_for_inference(run)
    weight = next(ready.model.model.parameters())
    assert (ready.precision, ready.model.precision, weight.device.type, weight.dtype) == \
        ("fp32", "fp32", "cpu", torch.float32)
    elsewhere = load_for_inference(run, torch.device("meta"), "fp32", decode=False)
    assert {p.device.type for p in elsewhere.model.model.parameters()} == {"meta"}


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_to_decode_the_model_is_prepared_in_the_precision_asked(run, precision):
    from gptlab.inference.loading import bf16_storage_possible
    from gptlab.runtime import bf16_supported

    cpu = torch.device("cpu")
    if precision == "bf16" and not (bf16_supported(cpu) or bf16_storage_possible(cpu)):
        pytest.skip("no native bf16 and no g++ for the fused step that stores it")
    ready = load_for_inference(run, "cpu", precision)
    assert ready.precision == ready.model.precision == precision
    block = ready.model.model.transformer.h[0]
    if precision == "int8":
        assert isinstance(block.mlp.c_fc, Int8Linear)
    else:
        assert block.ln_1.weight.dtype == ready.model.model.transformer.wte.weight.dtype == torch.bfloat16
