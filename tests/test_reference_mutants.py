"""Deliberately broken copies of the naive engine (reference/csrc/reference.cpp), built at -O1: each must fail the
comparison with torch autograd in float64 or the optimizer steps beside torch's AdamW, so those checks are known to
catch what they claim to; a copy whose structs differ is refused; and without a compiler, `--engine reference`
says in one line what to install."""

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from helpers import perturbed
from gptlab import compiled
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.reference import library
from gptlab.reference import naive_gpt as rm

pytestmark = pytest.mark.usefixtures("reference_engine")
O1 = ("-O1", *library.FLAGS[1:])

# name -> the edits (old text, new text) that plant the bug; each old text must still be in the source
MUTANTS = {
    "LayerNorm's gain ignored in the backward": [("R g = dyn[c] * w[c];", "R g = dyn[c];"),
                                                 ("rstd[n] * (dyn[c] * w[c] - g_mean", "rstd[n] * (dyn[c] - g_mean")],
    "sqrt(d_k) dropped": [("s[j] = j <= t ? dot * scale : minus_inf;", "s[j] = j <= t ? dot : minus_inf;")],
    "the mask one position late": [("s[j] = j <= t ? dot * scale : minus_inf;",
                                    "s[j] = j <= t + 1 ? dot * scale : minus_inf;")],
    "the residual's gradient not added to the branch's": [
        ("    for (size_t i = 0; i < NC; i++) d_mid[i] += dy[i];  // the residual's own path\n", "")],
    "the MLP's first bias gets no gradient": [("d_ln.data(), at<R>(g.c_fc_w),\n                    at<R>(g.c_fc_b));",
                                               "d_ln.data(), at<R>(g.c_fc_w),\n                    (R*)nullptr);")],
    "AdamW's bias correction dropped": [("theta[i] -= R(lr / c1) * mom[i] / (std::sqrt(vel[i] / R(c2)) + R(eps));",
                                         "theta[i] -= R(lr) * mom[i] / (std::sqrt(vel[i]) + R(eps));")],
}


def mutated_library(edits, folder) -> ctypes.CDLL:
    source = library.SOURCE.read_text()
    for old, new in edits:
        assert old in source, f"{old!r} is not in reference.cpp: the mutant no longer applies"
        source = source.replace(old, new)
    (folder / "reference.cpp").write_text(source)
    return library.build_library(folder / "reference.cpp", folder, O1)


def engine_passes(monkeypatch, lib) -> bool:
    """The float64 checks with `lib` as the engine: a perturbed model's logits, loss and gradients against torch
    autograd, then three AdamW steps against torch's on the same gradients, all within 1e-10."""
    monkeypatch.setattr(library, "load_library", lambda: lib)
    torch.manual_seed(0)
    model = perturbed(GPT(ModelConfig(n_layer=2, n_embd=12, n_head=3, block_size=8, vocab_size=17, dropout=0.0)))
    model = model.double()
    idx, targets = torch.randint(0, 17, (2, 8)), torch.randint(0, 17, (2, 8))
    logits, loss, grads = rm.step(model, idx, targets, grads=True)
    expected_logits, expected_loss = model(idx, targets)
    expected_loss.backward()
    expected_logits = expected_logits.detach()
    errors = [(logits - expected_logits).abs().max() / expected_logits.abs().max(), abs(loss - expected_loss.item()) / loss]
    errors += [(grads[n] - p.grad).abs().max() / p.grad.abs().max() for n, p in model.named_parameters()]
    from gptlab.reference.naive_adamw import NaiveAdamW

    theirs = [p.detach().clone().requires_grad_() for p in model.parameters()]
    mine = [p.detach().clone() for p in model.parameters()]
    for t, m, p in zip(theirs, mine, model.parameters()):
        t.grad, m.grad = p.grad.clone(), p.grad.clone()
    torch_opt = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1)
    naive_opt = NaiveAdamW([{"params": mine, "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.999))
    for _ in range(3):
        torch_opt.step()
        naive_opt.step()
    errors += [(m - t.detach()).abs().max() / t.detach().abs().max() for m, t in zip(mine, theirs)]
    return max(float(e) for e in errors) <= 1e-10


def test_the_built_engine_passes(monkeypatch, reference_engine):
    assert engine_passes(monkeypatch, reference_engine)


def test_every_planted_bug_fails_the_checks(monkeypatch, tmp_path):
    for name, edits in MUTANTS.items():
        folder = tmp_path / name.replace(" ", "-").replace("'", "")
        folder.mkdir()
        assert not engine_passes(monkeypatch, mutated_library(edits, folder)), f"{name}: no check caught it"


def test_a_build_with_other_structs_is_refused(tmp_path):
    edits = [("constexpr int LAYOUT_VERSION = 1;", "constexpr int LAYOUT_VERSION = 2;")]
    with pytest.raises(compiled.ABIError, match="layout version 2, gptlab passes version 1"):
        mutated_library(edits, tmp_path)


def test_without_a_compiler_the_engine_says_what_to_install(tmp_path, char_data):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "GPTLAB_KERNELS": str(tmp_path / "kernels")}
    out = subprocess.run([sys.executable, "-m", "gptlab", "train", "--data", str(char_data), "--run",
                          str(tmp_path / "run"), "--engine", "reference", "--max-steps", "2", "--n-layer", "1",
                          "--n-embd", "16", "--n-head", "2", "--block-size", "16"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "needs a C++17 compiler" in out.stderr and "(Debian/Ubuntu: apt-get install g++; macOS: xcode-select " \
        "--install) or set CXX" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_source_that_does_not_compile_is_refused_with_the_compilers_message(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undeclared_name_here; }\n")
    with pytest.raises(compiled.BuildError, match="undeclared_name_here") as caught:
        library.build_library(source, tmp_path / "out", O1)
    assert "failed:" in str(caught.value) and not list((tmp_path / "out").glob("*.so"))
    assert "b'" not in str(caught.value) and "\n" in str(caught.value)  # the compiler's text as it printed it
