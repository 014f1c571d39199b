"""The ARM64 builds of the fused decode step, checked without an ARM machine.

The kernel (gptlab/inference/csrc/decode.cpp over simd.h's NEON vectors, beside it) is cross-compiled with Debian's
g++-aarch64-linux-gnu into a static stand-alone driver (tests/native/drive_decode.cpp), which runs decode steps
from a file under qemu-user: under `-cpu max` (every ARMv8/v9 extension) and under a Cortex-A53 (ARMv8.0: no dot
product, as the armv8-a build must run on). Its logits are held to the torch forward's over the same ids in fp32,
bf16 weights and int8 weights (FMA products; sdot where the build has the dot product), and broken copies of the
NEON vector code and of the sdot product must fail the same comparison. Skips only where the cross compiler or
qemu-user is missing (`make test` installs both when it runs as root with apt-get); with them present, a build that
fails to compile fails here.
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from arm_driver import CROSS, MISSING, QEMU, cross_build, run_driver
from helpers import (FMA_TOLERANCE, FP32_TOLERANCE, INT8_SHAPES, KERNEL_SHAPES, VNNI_TOLERANCE, int8_model,
                     trained_like)

from gptlab.inference import native

pytestmark = [pytest.mark.device_path("arm64 under qemu"),
              pytest.mark.skipif(CROSS is None or QEMU is None, reason=MISSING)]
# the ARM builds run here, each under the CPUs it must run on (qemu's names)
RUNS = [("armv8-a", "cortex-a53"), ("armv8-a", "max"), ("armv8.2-a+dotprod", "max")]
STEPS, ROWS = 9, 5  # 5 rows: the sdot product's groups of 4 rows and of 1


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
# that compiles it, the cases it touches, old text, new text). NEON's vector layer (inference/csrc/simd.h) in the
# armv8-a build; the sdot product (inference/csrc/products.h's gemv_sdot) in the armv8.2-a+dotprod build, held to VNNI's tolerance
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
    text = (native.SOURCE.parent / header).read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {header}: the mutant no longer applies"
    (tmp_path / header).write_text(text.replace(old, new))
    driver = cross_build(build, tmp_path / "build", "-O1", {header: tmp_path / header})
    got = errors(driver, "max", tmp_path, only)
    tolerance = {case: tol for case, _, tol in cases(build)}
    assert any(got[case] > tolerance[case] for case in got), f"the comparison passes {build} with {name}: {got}"
