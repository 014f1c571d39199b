"""The fast engine's NEON builds, checked without an ARM machine: reference/csrc/fast.cpp cross-compiled with Debian's
g++-aarch64-linux-gnu into a static stand-alone driver (tests/native/drive_fast.cpp) at the vector rung and the top
rung, run under qemu-user (`-cpu max`, two threads), its loss, logits and every gradient held to the naive engine's
on the same weights (x86, fp32) within test_fast.TOLERANCE per tensor, on odd shapes (no lane of NEON's 4 whole)
and past the attention's blocks of 64. Skips only where the cross compiler or qemu-user is missing (`make test`
installs both when it runs as root with apt-get)."""

import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from arm_driver import CROSS, MISSING, QEMU
from helpers import FAST_TOLERANCE as TOLERANCE
from helpers import ODD, PAST_BLOCKS, fast_batch, relative, sharpened, trained_like

from gptlab import compiled
from gptlab.reference import fast
from gptlab.reference import naive_gpt as ng
from gptlab.reference.library import LAYER_TENSORS

pytestmark = [pytest.mark.device_path("arm64 under qemu"),
              pytest.mark.skipif(CROSS is None or QEMU is None, reason=MISSING)]
DRIVER = Path(__file__).parent / "native" / "drive_fast.cpp"
RUNGS = ("simd", "fused")  # the first rung with NEON vectors, and the top one (threads and fusion over them)
CASES = [(ODD, dict(activation="gelu_tanh"), 2, 7), ({**PAST_BLOCKS, "n_embd": 36, "n_head": 4}, {}, 1, 70)]


def cross_build(rung: str, folder: Path) -> Path:
    """The driver with fast.cpp at `rung` compiled in for ARMv8-A (NEON), static, -O3 as users get it."""
    out = folder / f"drive-fast-{rung}"
    flags = [*fast.FAST_FLAGS, *compiled.BUILDS["armv8-a"].target, f"-DGPTLAB_RUNG={fast.rung_level(rung)}"]
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    done = subprocess.run([CROSS, *flags, "-static", "-I", str(fast.FAST_SOURCE.parent), "-I", str(compiled.INCLUDE),
                           str(DRIVER), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the {rung} rung's ARM build failed to compile:\n{done.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast-arm")
    with ThreadPoolExecutor(len(RUNGS)) as pool:
        return dict(zip(RUNGS, pool.map(lambda r: cross_build(r, folder), RUNGS)))


def tensors(model) -> list[str | None]:
    """The parameter names in the driver's order (None where the model has no such tensor)."""
    params = dict(model.named_parameters())
    top = [ng.TOP_NAMES[k] for k in ("wte", "wpe", "ln_f_w", "ln_f_b")]
    per_layer = [ng.layer_names(i)[k] for i in range(model.config.n_layer) for k in LAYER_TENSORS]
    return [name if name in params else None for name in top + per_layer]


def run_driver(driver: Path, model, idx, tgt, folder: Path):
    c, params = model.config, dict(model.named_parameters())
    names = tensors(model)
    parts = [b"GPTLABFAST01", struct.pack("<9id", c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size,
                                          int(c.activation == "gelu_tanh"), *idx.shape, 2, c.layer_norm_eps)]
    for name in names:
        data = b"" if name is None else params[name].detach().contiguous().numpy().tobytes()
        parts += [struct.pack("<q", len(data) // 4), data]
    parts += [idx.numpy().astype(np.int64).tobytes(), tgt.numpy().astype(np.int64).tobytes()]
    (folder / "in").write_bytes(b"".join(parts))
    done = subprocess.run([QEMU, "-cpu", "max", str(driver), str(folder / "in"), str(folder / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = (folder / "out").read_bytes()
    loss = struct.unpack("<d", out[:8])[0]
    floats = torch.from_numpy(np.frombuffer(out[8:], dtype=np.float32).copy())
    n = idx.numel() * c.vocab_size
    logits, at, grads = floats[:n].view(*idx.shape, -1), n, {}
    for name in filter(None, names):
        size = params[name].numel()
        grads[name] = floats[at:at + size].view(params[name].shape)
        at += size
    assert at == floats.numel()
    return logits, loss, grads


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_neon_build_under_qemu_matches_the_naive_engine(drivers, rung, case, tmp_path):
    """Heads 7 and 9 wide (past NEON's 4 lanes), and 70 tokens: past the fused attention's blocks of 64."""
    shape, settings, B, T = CASES[case]
    model = sharpened(trained_like({**shape, **settings}))
    idx, tgt = fast_batch(shape["vocab_size"], B, T, True)
    ref_logits, ref_loss, ref_grads = ng.step(model, idx, tgt, grads=True)
    logits, loss, grads = run_driver(drivers[rung], model, idx, tgt, tmp_path)
    gaps = {"logits": relative(logits, ref_logits), "loss": abs(loss - ref_loss) / abs(ref_loss)}
    gaps.update({name: relative(grads[name], ref_grads[name]) for name in ref_grads})
    name = max(gaps, key=gaps.get)
    assert gaps[name] <= TOLERANCE, f"{rung} under qemu: {name} differs by {gaps[name]:.2e}"
