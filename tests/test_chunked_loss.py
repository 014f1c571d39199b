"""The training loss over chunks of positions (--loss-chunk) and a LoRA run's frozen matrices stored in bf16: each
held to the plain path it replaces. The chunked loss gives the plain loss and gradients to fp32's rounding, and
under bf16 autocast errs from an fp32 reference no more than the plain bf16 path does; it keeps none of the (N, V)
logits for backward; an evaluation (no gradients) still returns logits. The bf16 storage gives the same loss and
gradients bit for bit under bf16 autocast, and no rounded copy of a matrix is kept for backward."""

import copy
import json

import pytest
import torch

from helpers import perturbed
from gptlab import lora
from gptlab import model as model_module
from gptlab.bench.memory import saved_bytes
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.model import GPT

V = 301  # a vocabulary wide enough that the logits dominate what a forward keeps
SHAPE = dict(vocab_size=V, block_size=16, n_layer=2, n_head=3, n_embd=36, dropout=0.1)


def moved_model(**overrides) -> GPT:
    """A GPT with every parameter away from its initial value (LayerNorm gains 1 and biases 0 hide bugs)."""
    torch.manual_seed(0)
    return perturbed(GPT(ModelConfig(**{**SHAPE, **overrides})))


def batch(rows: int = 3, T: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and targets of 3 x 13 positions (39: no chunk size below divides it), some targets ignored (-1)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)
    y[0, :5] = -1
    y[2, -1] = -1
    return x, y


def gradients(model: torch.nn.Module, chunk: int, bf16: bool = False, scale: float = 0.37) -> tuple[torch.Tensor, dict]:
    """One training forward, and backward from `scale` x the loss (as a step of several micro-batches does), with
    dropout drawn from the same seed: (loss, {name: gradient})."""
    model = copy.deepcopy(model).train()
    model.loss_chunk = chunk
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, loss = model(*batch())
    assert (logits is None) == (chunk > 0)
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst(grads: dict, reference: dict) -> float:
    """The largest gradient error, relative to each tensor's largest reference value."""
    assert grads.keys() == reference.keys()
    return max(((grads[n] - reference[n]).abs().max() / reference[n].abs().max()).item() for n in reference)


@pytest.mark.parametrize("chunk", [1, 5, 16, 39, 1000])
def test_the_chunked_loss_and_gradients_are_the_plain_ones_in_fp32(chunk):
    model = moved_model()
    loss, grads = gradients(model, 0)
    chunked_loss, chunked = gradients(model, chunk)
    assert chunked_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert worst(chunked, grads) < 1e-5  # fp32's rounding of sums taken in another order
    assert grads["transformer.wte.weight"].abs().max() > 0  # the tied head's gradient is among them


def test_under_bf16_autocast_it_errs_no_more_than_the_plain_bf16_path():
    model = moved_model()
    exact_loss, exact = gradients(model, 0)  # fp32: the reference both are held to
    plain_loss, plain = gradients(model, 0, bf16=True)
    chunked_loss, chunked = gradients(model, 7, bf16=True)
    assert abs(plain_loss - exact_loss) > 1e-4  # bf16's logits: a loss of their own, which the chunks compute too
    assert abs(chunked_loss - plain_loss) < 1e-5
    assert worst(chunked, exact) <= 2 * worst(plain, exact) + 1e-3
    assert worst(chunked, plain) <= 2 / 256  # and it is the plain bf16 path: two roundings of bf16 (8 bits) apart


def test_a_float64_model_keeps_float64_and_a_batch_without_lessons_is_nan_as_plain():
    model = moved_model(dropout=0.0).double()
    loss, grads = gradients(model, 0)
    chunked_loss, chunked = gradients(model, 4)
    assert chunked_loss.dtype == torch.float64 and chunked_loss.item() == pytest.approx(loss.item(), rel=1e-12)
    assert worst(chunked, grads) < 1e-12
    under_autocast, _ = gradients(model, 4, bf16=True)  # autocast leaves float64 alone, in chunks too
    assert under_autocast.dtype == torch.float64 and under_autocast.item() == pytest.approx(loss.item(), rel=1e-12)
    x, y = batch()
    for chunk in (0, 4):
        model.loss_chunk = chunk
        assert torch.isnan(model(x, torch.full_like(y, -1))[1])


def test_nothing_of_the_vocabulary_s_width_is_kept_for_backward():
    """The plain forward keeps the logits' log-softmax (N x V in fp32) for backward; the chunked one keeps nothing
    of that width: what it saves shrinks by at least N x V x 4 bytes (worked out from the shapes)."""
    model, (x, y) = moved_model(dropout=0.0), batch()
    kept = {}
    for chunk in (0, 5):
        model.loss_chunk = chunk
        kept[chunk] = saved_bytes(model, lambda: model(x, y)[1])
    assert kept[0] - kept[5] >= x.numel() * V * 4


def test_evaluation_and_generation_still_get_logits():
    model = moved_model()
    model.loss_chunk = 5
    x, y = batch()
    with torch.no_grad():
        logits, loss = model.eval()(x, y)
    assert logits.shape == (3, 13, V) and loss is not None
    model.train()
    logits, loss = model(x)  # no targets: logits as always
    assert logits.shape == (3, 13, V) and loss is None


def lora_model(tokens: list[int] | None = None) -> GPT:
    """A moved GPT with LoRA adapters on c_attn and c_fc (and trained rows for `tokens`), the adapters moved too."""
    model = moved_model()
    lora.apply_lora(model, lora.LoraSettings(4, 8.0, 0.0, ("c_attn", "c_fc")), tokens)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_a_lora_head_with_rows_of_its_own_gives_the_plain_gradients_in_chunks():
    """The chat markers' rows (TrainableTokensHead): their logits and gradients come from token_values."""
    model = lora_model(tokens=[3, 299])
    loss, grads = gradients(model, 0)
    chunked_loss, chunked = gradients(model, 5)
    assert "transformer.wte.token_values" in grads and chunked_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert worst(chunked, grads) < 1e-5


def test_frozen_matrices_in_bf16_give_the_same_bits_under_bf16_autocast():
    model = lora_model(tokens=[7])
    stored = copy.deepcopy(model)
    matrices = [n for n, p in model.named_parameters() if n.startswith("transformer.h.") and n.endswith(".weight")
                and p.dim() == 2 and not p.requires_grad]  # c_attn's, attn.c_proj's, c_fc's, mlp.c_proj's
    assert len(matrices) == 2 * 4
    halved = sum(model.get_parameter(n).numel() * 2 for n in matrices)
    assert lora.store_frozen_matrices(stored, torch.bfloat16) == halved
    for name, p in stored.named_parameters():
        assert p.dtype == (torch.bfloat16 if name in matrices else torch.float32), name  # embeddings, LN, adapters
    loss, grads = gradients(model, 0, bf16=True)
    stored_loss, stored_grads = gradients(stored, 0, bf16=True)
    assert torch.equal(stored_loss, loss) and stored_grads.keys() == grads.keys()
    assert all(torch.equal(stored_grads[n], grads[n]) for n in grads)
    assert lora.store_frozen_matrices(stored, torch.bfloat16) == 0  # twice: nothing more


def test_frozen_matrices_in_bf16_keep_no_rounded_copy_for_backward():
    """Autocast rounds an fp32 matrix into a new bf16 tensor that backward keeps; a bf16 one is used as it is."""
    model, (x, y) = lora_model(), batch()
    stored = copy.deepcopy(model)
    lora.store_frozen_matrices(stored, torch.bfloat16)
    kept = []
    for m in (model, stored):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept.append(saved_bytes(m, lambda: m(x, y)[1]))
    copies = sum(p.numel() * 2 for n, p in stored.named_parameters() if p.dtype == torch.bfloat16
                 and n != "transformer.h.0.attn.c_attn.weight")  # the first's input needs no gradient: no copy kept
    assert kept[0] - kept[1] >= copies


def test_train_with_loss_chunk_ends_where_the_plain_run_does(tmp_path, char_data, monkeypatch):
    flags = ["--data", str(char_data), "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--dropout", "0.1", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "4", "--eval-interval", "4",
             "--eval-batches", "2", "--log-interval", "1", "--precision", "fp32", "--device", "cpu", "--quiet"]
    assert main(["train", "--run", str(tmp_path / "plain"), *flags]) == 0
    chunks, real = [], model_module.chunked_loss
    monkeypatch.setattr(model_module, "chunked_loss", lambda *a: chunks.append(a[-1]) or real(*a))
    assert main(["train", "--run", str(tmp_path / "chunked"), "--loss-chunk", "7", *flags]) == 0
    assert chunks == [7] * 8  # every micro-step's loss (evaluations have no gradients: plain)
    rows = {}
    for name in ("plain", "chunked"):
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rows[name] = [r["loss"] for r in metrics if r.get("kind") == "train"]
    assert len(rows["plain"]) == 4 and rows["chunked"] == pytest.approx(rows["plain"], rel=1e-5)
    assert json.loads((tmp_path / "chunked" / "config.json").read_text())["train"]["loss_chunk"] == 7


@pytest.mark.parametrize("flags, words", [
    (["--loss-chunk", "-1"], "loss_chunk must be >= 0"),
    (["--loss-chunk", "8", "--arch", "bigram"], "drop --loss-chunk"),
    (["--loss-chunk", "8", "--engine", "reference"], "reference engine does not implement loss_chunk"),
])
def test_a_loss_chunk_that_cannot_apply_is_one_line(tmp_path, char_data, capsys, flags, words):
    code = main(["train", "--run", str(tmp_path / "r"), "--data", str(char_data), "--max-steps", "1",
                 "--device", "cpu", "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()
