"""The fused decode step at widths on each side of every build's vector edge: the model width C, the heads' width
C / h, the MLP's 4C and the vocabulary at ≡ 0, 1 and L − 1 modulo each build's lane count L (16 on AVX-512, 8 on
AVX2 and the plain build, 4 on NEON, 32 for AVX512-BF16's pairs) and rows on each side of the products' row
blocks (decode.cpp's gemv: one row alone; 7 = 4 + 2 + 1; 9 = 8 + 1; outputs in pairs, an odd
width's last alone), against the torch forward (fp32) and the torch bf16 path (bf16 weights), on every build
this CPU runs. The tolerances are test_fused's; a tail element lost or read twice moves the logits by far more."""

import pytest

from helpers import BF16_TOLERANCE, FP32_TOLERANCE, bf16_errors, fp32_error
from gptlab.inference import native

pytestmark = [pytest.mark.device_path("fused decode (native)"), pytest.mark.usefixtures("fused_kernel")]

LANE_COUNTS = (4, 8, 16, 32)
# C = 33: 1 past a multiple of every lane count (heads of 11 = 8 + 3 = 4·2 + 3), 4C = 132 ≡ 4 (mod 32);
# C = 63: one short of a multiple of every lane count (heads of 21), vocabulary 79 ≡ 15 (mod 16);
# C = 64: a multiple of every lane count (heads of 16), vocabulary 64
LANE_SHAPES = [dict(n_layer=1, n_head=3, n_embd=33, vocab_size=65, block_size=24),
               dict(n_layer=1, n_head=3, n_embd=63, vocab_size=79, block_size=24, activation="gelu_tanh"),
               dict(n_layer=1, n_head=4, n_embd=64, vocab_size=64, block_size=24, bias=False)]
# this CPU's own build, and each vector width's plainest build it runs (the ARM builds: tests/test_arm.py, under qemu)
BUILDS_HERE = sorted({native.build_for_cpu().name} | {name for name in ("x86-64-v4", "x86-64-v3", "plain")
                                                     if native.BUILDS[name].runs_here()})


def test_the_shapes_sit_at_each_lane_edge():
    widths = {s["n_embd"] % L for s in LANE_SHAPES for L in LANE_COUNTS}
    assert {0, 1} <= widths and all(any(s["n_embd"] % L == L - 1 for s in LANE_SHAPES) for L in LANE_COUNTS)
    assert {s["vocab_size"] % 16 for s in LANE_SHAPES} == {1, 15, 0}


O1 = ("-O1", *native.FLAGS[1:])  # as tests/test_kernel_mutants.py builds the other builds: the same cached files


@pytest.fixture(scope="module", params=BUILDS_HERE)
def lib(request):
    """The build: this CPU's own as users get it, the others at -O1."""
    if request.param == native.build_for_cpu().name:
        return native.load_library()
    return native.build_library(build=native.BUILDS[request.param], flags=O1)


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=lambda s: f"C{s['n_embd']}")
@pytest.mark.parametrize("rows", [1, 7, 9])
def test_fp32_at_each_lane_edge_equals_the_torch_forward(lib, shape, rows):
    assert fp32_error(shape, rows, lib) <= FP32_TOLERANCE


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=lambda s: f"C{s['n_embd']}")
def test_bf16_weights_at_each_lane_edge_stay_as_close_as_the_torch_bf16_path(lib, shape):
    torch_error, fused_error = bf16_errors(shape, lib)
    assert torch_error <= BF16_TOLERANCE and fused_error <= BF16_TOLERANCE
