"""The ARM64 decode kernel's stand-alone driver (tests/native/drive_decode.cpp), cross-compiled for qemu-user and
run there: shared by tests/test_arm.py (logits against the torch forward) and tests/test_int8_exact.py (the int8
products against integer arithmetic)."""

import shutil
import struct
import subprocess
from pathlib import Path

import torch

from gptlab import compiled
from gptlab.inference import native
from gptlab.inference.fused import _int8_operands

CROSS, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
MISSING = "no aarch64-linux-gnu-g++ or qemu-aarch64 (Debian's g++-aarch64-linux-gnu and qemu-user; make test installs " \
          "them as root)"
DRIVER = Path(__file__).parent / "native" / "drive_decode.cpp"


def cross_build(build: str, folder: Path, opt: str = "-O3", headers: dict[str, Path] | None = None) -> Path:
    """The driver with the kernel of ARM build `build` compiled in, static, for qemu-user. `headers`: the kernel's
    headers by name (simd.h, products.h: beside decode.cpp in gptlab) to use instead of gptlab's (found first: each is
    copied beside the sources)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in (DRIVER, native.SOURCE):
        shutil.copy(source, folder / source.name)
    for name, header in (headers or {}).items():
        shutil.copy(header, folder / name)
    out = folder / f"drive-{build}"
    flags = [opt, *native.FLAGS[1:], *native.BUILDS[build].target]
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    include = ["-I", str(native.SOURCE.parent), "-I", str(compiled.INCLUDE)]  # after the copies' folder
    done = subprocess.run([CROSS, *flags, "-static", *include, str(folder / DRIVER.name), "-o",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the {build} build failed to compile:\n{done.stderr[-3000:]}"
    return out


def _array(t: torch.Tensor | None) -> bytes:
    if t is None:
        return struct.pack("<q", 0)
    t = t.detach().contiguous()
    data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return struct.pack("<q", len(data)) + data


def drive_input(model, ids: torch.Tensor) -> bytes:
    """The driver's input (see drive_decode.cpp) for `model` (fp32, bf16 or int8 weights) and ids (steps, R)."""
    c = model.config
    operands = _int8_operands(model, vnni=False, huge_pages=False)  # Int8Linear -> (q, scale, sums)
    int8 = bool(operands)
    weights = 2 if int8 else 1 if model.transformer.wte.weight.dtype == torch.bfloat16 else 0

    def matrix(linear):
        return _array(operands[linear][0] if linear in operands else linear.weight)

    def vector(t):
        return _array(None if t is None else t.float())

    def extra(linear, i):  # an int8 matrix's scales (i = 1) or sums (i = 2)
        return _array(operands[linear][i] if linear in operands else None)

    t = model.transformer
    head = [b"GPTLABDRIVE1", struct.pack("<11if", c.n_layer, c.n_head, c.head_dim, c.n_embd, c.vocab_size,
                                         c.block_size, weights, int(c.activation == "gelu_tanh"), ids.shape[1],
                                         ids.shape[0], 0, c.layer_norm_eps)]
    embed = (lambda w: _array(w.float())) if int8 else _array  # an int8 model embeds from fp32
    parts = [*head, embed(t.wte.weight), embed(t.wpe.weight), matrix(model.lm_head), vector(t.ln_f.weight),
             vector(t.ln_f.bias), extra(model.lm_head, 1), extra(model.lm_head, 2)]
    for block in t.h:
        mats = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        parts += [matrix(m) for m in mats]
        parts += [vector(v) for v in (block.ln_1.weight, block.ln_1.bias, mats[0].bias, mats[1].bias,
                                      block.ln_2.weight, block.ln_2.bias, mats[2].bias, mats[3].bias)]
        parts += [extra(m, 1) for m in mats] + [extra(m, 2) for m in mats]
    parts.append(ids.to(torch.int64).contiguous().numpy().tobytes())
    return b"".join(parts)


def run_driver(driver: Path, cpu: str, model, ids: torch.Tensor, folder: Path, verify: bool = False):
    """The logits (steps, R, V) of the driver's steps under qemu's `cpu`; with `verify` (one row), also those
    (steps, V) of one verify step of the same tokens: (steps' logits, verify's)."""
    (folder / "in.bin").write_bytes(drive_input(model, ids))
    done = subprocess.run([QEMU, "-cpu", cpu, str(driver), str(folder / "in.bin"), str(folder / "out.bin"),
                           *(["verify"] if verify else [])], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{driver.name} under -cpu {cpu}: exit {done.returncode}: {done.stderr[-2000:]}"
    data = torch.frombuffer(bytearray((folder / "out.bin").read_bytes()), dtype=torch.float32)
    V, stepped = model.config.vocab_size, ids.numel() * model.config.vocab_size
    logits = data[:stepped].view(ids.shape[0], ids.shape[1], V)
    return (logits, data[stepped:].view(ids.shape[0], V)) if verify else logits
