"""The ARM64 builds of the fused decode step, checked without an ARM machine.

The kernel (gptlab/inference/csrc/decode.cpp over csrc/simd.h's NEON vectors) is cross-compiled with Debian's
g++-aarch64-linux-gnu into a static stand-alone driver (tests/native/drive_decode.cpp), which runs decode steps
from a file under qemu-user: under `-cpu max` (every ARMv8/v9 extension) and under a Cortex-A53 (ARMv8.0: no dot
product, as the armv8-a build must run on). Its logits are held to the torch forward's over the same ids in fp32,
bf16 weights and int8 weights (FMA products; sdot where the build has the dot product), and broken copies of the
NEON vector code and of the sdot product must fail the same comparison. Skips only where the cross compiler or
qemu-user is missing (`make test` installs both when it runs as root with apt-get); with them present, a build that
fails to compile fails here.
"""

import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import (FMA_TOLERANCE, FP32_TOLERANCE, INT8_SHAPES, KERNEL_SHAPES, VNNI_TOLERANCE, int8_model,
                     trained_like)

from gptlab import compiled
from gptlab.inference import native
from gptlab.inference.fused import _int8_operands

CROSS, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
DRIVER = Path(__file__).parent / "native" / "drive_decode.cpp"
pytestmark = [pytest.mark.device_path("arm64 under qemu"),
              pytest.mark.skipif(CROSS is None or QEMU is None, reason="no aarch64-linux-gnu-g++ or qemu-aarch64 "
                                 "(Debian's g++-aarch64-linux-gnu and qemu-user; make test installs them as root)")]
# the ARM builds run here, each under the CPUs it must run on (qemu's names)
RUNS = [("armv8-a", "cortex-a53"), ("armv8-a", "max"), ("armv8.2-a+dotprod", "max")]
STEPS, ROWS = 9, 5  # 5 rows: the sdot product's groups of 4 rows and of 1


def cross_build(build: str, folder: Path, opt: str = "-O3", headers: dict[str, Path] | None = None) -> Path:
    """The driver with the kernel of ARM build `build` compiled in, static, for qemu-user. `headers`: gptlab/csrc
    headers by name (simd.h, products.h) to use instead of gptlab's (found first: each is copied beside the
    sources)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in (DRIVER, native.SOURCE):
        shutil.copy(source, folder / source.name)
    for name, header in (headers or {}).items():
        shutil.copy(header, folder / name)
    out = folder / f"drive-{build}"
    flags = [opt, *native.FLAGS[1:], *native.BUILDS[build].target]
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    done = subprocess.run([CROSS, *flags, "-static", "-I", str(compiled.INCLUDE), str(folder / DRIVER.name), "-o",
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


def run_driver(driver: Path, cpu: str, model, ids: torch.Tensor, folder: Path) -> torch.Tensor:
    """The logits (steps, R, V) of the driver's steps under qemu's `cpu`."""
    (folder / "in.bin").write_bytes(drive_input(model, ids))
    done = subprocess.run([QEMU, "-cpu", cpu, str(driver), str(folder / "in.bin"), str(folder / "out.bin")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{driver.name} under -cpu {cpu}: exit {done.returncode}: {done.stderr[-2000:]}"
    data = torch.frombuffer(bytearray((folder / "out.bin").read_bytes()), dtype=torch.float32)
    return data.view(ids.shape[0], ids.shape[1], model.config.vocab_size)


def expected_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The torch forward's logits over the whole sequences (causal: position t's are decode step t's), (steps, R,
    V) in fp32; a bf16 model's computed in fp32 from its bf16 weights (the ARM kernel widens them exactly)."""
    if model.transformer.wte.weight.dtype == torch.bfloat16:
        model = model.float()
    with torch.no_grad():
        return model(ids.T.contiguous())[0].float().transpose(0, 1)


def cases(build: str = "armv8-a"):
    """(name, model, tolerance): fp32 at two shapes with tails on NEON's 4 lanes (widths 75 and 100, heads of 25;
    tanh GELU; no biases; eps 1e-6), bf16 weights, int8 weights at two shapes (K tails of 11 and 8 past sdot's
    groups of 16, and of 3 and 8 past the 4 lanes): by FMAs, or by sdot against x in 15 bits where the build has
    the dot product (x rounded as VNNI rounds it: VNNI's tolerance)."""
    int8 = VNNI_TOLERANCE if "dotprod" in build else FMA_TOLERANCE
    return [("fp32, width 75", trained_like(KERNEL_SHAPES[1]), FP32_TOLERANCE),
            ("fp32, width 60, tanh", trained_like(KERNEL_SHAPES[0]), FP32_TOLERANCE),
            ("bf16 weights, width 100", trained_like(KERNEL_SHAPES[2], torch.bfloat16), FP32_TOLERANCE),
            ("int8 weights, width 75", int8_model(INT8_SHAPES[0]), int8),
            ("int8 weights, width 200, no biases", int8_model(INT8_SHAPES[1]), int8)]


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """The ARM builds' drivers, -O3 as users get them, compiled side by side (two cores)."""
    folder = tmp_path_factory.mktemp("arm")
    builds = sorted({build for build, _ in RUNS})
    with ThreadPoolExecutor(len(builds)) as pool:
        return dict(zip(builds, pool.map(lambda b: cross_build(b, folder / b), builds)))


def errors(driver: Path, cpu: str, folder: Path, only: str = "") -> dict[str, float]:
    """Each case's (or, with `only`, the cases whose names start with it) largest logit error under qemu's `cpu`."""
    torch.manual_seed(0)
    out = {}
    for name, model, _ in cases():
        if not name.startswith(only):
            continue
        ids = torch.randint(0, model.config.vocab_size, (STEPS, ROWS))
        out[name] = (run_driver(driver, cpu, model, ids, folder) - expected_logits(model, ids)).abs().max().item()
    return out


@pytest.mark.parametrize("build, cpu", RUNS)
def test_an_arm_build_under_qemu_matches_the_torch_forward(drivers, build, cpu, tmp_path):
    got = errors(drivers[build], cpu, tmp_path)
    tolerance = {name: tol for name, _, tol in cases(build)}
    assert all(got[name] <= tolerance[name] for name in got), got


# broken copies of the ARM code, each changing the logits far past the tolerance: (the header it is in, the build
# that compiles it, the cases it touches, old text, new text). NEON's vector layer (csrc/simd.h) in the armv8-a
# build; the sdot product (csrc/products.h's gemv_sdot) in the armv8.2-a+dotprod build, held to VNNI's tolerance
ARM_MUTANTS = {
    "NEON sum drops the upper half": ("simd.h", "armv8-a", "", "float32x2_t h = vadd_f32(vget_low_f32(v), "
                                      "vget_high_f32(v));", "float32x2_t h = vget_low_f32(v);"),
    "NEON int8 weights read unsigned": ("simd.h", "armv8-a", "",
                                        "int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));",
                                        "int16x8_t wide = vreinterpretq_s16_u16(vmovl_u8(vreinterpret_u8_s32("
                                        "vdup_n_s32(four))));"),
    "sdot: the hi bytes' sum weighted 64, not 128": ("products.h", "armv8.2-a+dotprod", "int8",
                                                     "const double d = 128.0 *", "const double d = 64.0 *"),
    "sdot: x's low 8 bits kept, not 7": ("products.h", "armv8.2-a+dotprod", "int8", "lo[k] = (int8_t)(q & 127);",
                                         "lo[k] = (int8_t)(q & 255);"),
    "sdot: the last inputs past a group of 16 dropped": ("products.h", "armv8.2-a+dotprod", "int8",
                                                         "for (; k < K; k += 16) {  // the last 1-31",
                                                         "for (; k + 16 <= K; k += 16) {  // the last 1-31"),
}


@pytest.mark.parametrize("name", ARM_MUTANTS)
def test_a_broken_arm_build_fails_under_qemu(name, tmp_path):
    header, build, only, old, new = ARM_MUTANTS[name]
    text = (compiled.INCLUDE / header).read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {header}: the mutant no longer applies"
    (tmp_path / header).write_text(text.replace(old, new))
    driver = cross_build(build, tmp_path / "build", "-O1", {header: tmp_path / header})
    got = errors(driver, "max", tmp_path, only)
    tolerance = {case: tol for case, _, tol in cases(build)}
    assert any(got[case] > tolerance[case] for case in got), f"the comparison passes {build} with {name}: {got}"
