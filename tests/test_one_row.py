"""One row decoded alone is the same floats as that row decoded beside others (decode.cpp's gemv: the one-row
product, gemv_one, sums every output as the many-row products gemv_rows and gemv_pair do, so RunningBatch needs no
pad row for `gptlab sample` to give the server's bits).

For each weight format (fp32; bf16 by AVX512-BF16 dot products on this CPU's build where it has them, widened
elsewhere; int8 by FMAs over widened weights; int8 by VNNI, exact integer sums) and each build this CPU runs (its
own at -O3 as users get it, the others at -O1 as tests/test_lanes.py builds them), a watched row's logits over
several steps at R = 1 are torch.equal to its logits at R = 2, 3, 5 and 9 (the watched row in each of the
products' blocks of 8, 4, 2 and 1 rows, beside rows at other positions), on parameters moved off their initial
values. The widths sit at every build's lane edges (n_embd ≡ 1, L − 1 and 0 modulo 32, 16, 8 and 4; the MLP's
4·n_embd ≡ 4, 12 and 0 modulo 16), the output counts off the one-row product's groups of ONE_ROW outputs
(vocabularies 65, 79, 64). The ARM64 build's NEON products are held to the same under qemu (tests/arm_driver.py),
where qemu-user and the cross compiler are installed.
"""

import pytest
import torch
from arm_driver import CROSS, MISSING, QEMU, cross_build, run_driver
from helpers import int8_model, trained_like

from gptlab.engine import one_thread
from gptlab.inference import native
from gptlab.inference.fused import FusedDecoder

# n_embd 129 ≡ 1 and 159 ≡ L − 1 modulo 32, 16, 8 and 4 (heads of 43 and 53), 192 ≡ 0 (heads of 48); each at
# least 4 x 32 wide, so that a sum split along k into chains of whole vectors (4 x 32 bf16 at a time) rounds
# otherwise than one chain: at narrower widths such a split has no whole group of 4 vectors to split
SHAPES = [dict(n_layer=2, n_head=3, n_embd=129, vocab_size=65, block_size=24),
          dict(n_layer=2, n_head=3, n_embd=159, vocab_size=79, block_size=24, activation="gelu_tanh"),
          dict(n_layer=2, n_head=4, n_embd=192, vocab_size=64, block_size=24, bias=False)]
# (rows, the watched row's index): every many-row kernel holds it (gemv_pair's blocks of 8 and 4 rows, gemv_rows'
# of 2 and 1)
BESIDE = [(2, 1), (3, 0), (3, 2), (5, 0), (5, 4), (9, 0), (9, 8)]
STEPS = 4
FORMATS = ["fp32", "bf16", "int8 fma", "int8 vnni"]
# this CPU's own build, and each vector width's plainest build it runs
BUILDS_HERE = sorted({native.build_for_cpu().name} | {name for name in ("x86-64-v4", "x86-64-v3", "plain")
                                                     if native.BUILDS[name].runs_here()})
O1 = ("-O1", *native.FLAGS[1:])  # as tests/test_lanes.py and tests/test_kernel_mutants.py build the others


def test_the_shapes_sit_at_each_lane_edge():
    """The widths at every build's lane edges, the output counts off decode.cpp's ONE_ROW groups (8 outputs at a
    time, 4 on the plain build)."""
    for lanes in (4, 8, 16, 32):
        assert sorted(s["n_embd"] % lanes for s in SHAPES) == [0, 1, lanes - 1]
    assert sorted(4 * s["n_embd"] % 16 for s in SHAPES) == [0, 4, 12]
    assert sorted(s["vocab_size"] % 8 for s in SHAPES) == [0, 1, 7]
    assert sorted(s["vocab_size"] % 4 for s in SHAPES) == [0, 1, 3]
    assert all(s["n_embd"] >= 4 * 32 for s in SHAPES)


@pytest.fixture(autouse=True)
def _one_thread():  # tiny models: a second thread only waits (tests/test_fused.py splits the outputs over threads)
    with one_thread():
        yield


@pytest.fixture(scope="module", params=BUILDS_HERE)
def lib(request, fused_kernel):
    """The build: this CPU's own as users get it, the others at -O1."""
    if request.param == native.build_for_cpu().name:
        return fused_kernel
    return native.build_library(build=native.BUILDS[request.param], flags=O1)


def model_of(shape: dict, weights: str):
    """A GPT of `shape` off its initial values, its matrices in `weights` (a FORMATS name)."""
    if weights.startswith("int8"):
        return int8_model(shape)
    return trained_like(shape, torch.bfloat16 if weights == "bf16" else torch.float32)


def watched(model, fused: FusedDecoder, rows: int, at: int) -> torch.Tensor:
    """The logits (STEPS, V) of one row, its 7-token prompt prefilled alone and then STEPS tokens decoded, in a
    cache of `rows` rows at index `at`: the others prompted with other tokens and 0-2 positions behind theirs."""
    vocab = model.config.vocab_size
    draw = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, vocab, (1, 7), generator=draw), torch.randint(0, vocab, (STEPS,), generator=draw)
    with torch.inference_mode():
        mine, cache = model.new_kv_cache(1), model.new_kv_cache(rows)
        model(prompt, kv_cache=mine)
        if rows > 1:
            model(torch.randint(0, vocab, (rows, 6), generator=draw), kv_cache=cache)
            cache.pos -= torch.arange(rows) % 3
        cache.replace_rows(torch.tensor([at]), mine)
        logits = []
        for token in tokens:
            ids = torch.randint(0, vocab, (rows,), generator=draw)
            ids[at] = token
            logits.append(fused.step(ids, cache)[at].clone())
    return torch.stack(logits)


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"C{s['n_embd']}")
def test_a_row_alone_gives_the_same_logits_as_beside_other_rows(lib, shape, weights):
    """R = 1 takes decode.cpp's gemv_one (ONE_ROW outputs at a time), R >= 2 gemv_rows and gemv_pair."""
    if weights == "int8 vnni" and not native.has_int8_vnni(lib):
        pytest.skip("this build has no AVX512-VNNI product")
    model = model_of(shape, weights)
    fused = FusedDecoder(model, lib, vnni=weights == "int8 vnni")
    assert fused.weights == weights
    alone = watched(model, fused, 1, 0)
    assert alone.isfinite().all() and len({tuple(step.tolist()) for step in alone}) == STEPS  # each step its own
    differ = [(rows, at) for rows, at in BESIDE if not torch.equal(watched(model, fused, rows, at), alone)]
    assert differ == [], f"{native.describe(lib)}, {weights}: (rows, index) whose logits differ from alone's"


@pytest.mark.device_path("arm64 under qemu")
@pytest.mark.skipif(CROSS is None or QEMU is None, reason=MISSING)
def test_an_arm_row_alone_gives_the_same_logits_as_beside_other_rows(tmp_path):
    """The armv8-a build (NEON, 4 lanes; fp32, bf16 widened, int8 by FMAs) under qemu: every row starts at position
    0 in the driver, so the rows beside differ by their tokens. (armv8.2-a+dotprod compiles the same float products;
    its int8 product, sdot, sums exact integers per row of x.) And a row's tokens checked all at once in one verify
    step (speculation's) give each position the bits its one-token steps gave."""
    driver = cross_build("armv8-a", tmp_path / "build")
    draw = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        for weights in ("fp32", "bf16", "int8 fma"):
            model = model_of(shape, weights)
            ids = torch.randint(0, shape["vocab_size"], (STEPS, 9), generator=draw)
            beside = run_driver(driver, "max", model, ids, tmp_path)
            three = run_driver(driver, "max", model, ids[:, :3].contiguous(), tmp_path)
            for at, got in ((0, three[:, 0]), (2, three[:, 2]), (4, beside[:, 4]), (8, beside[:, 8])):
                alone, verified = run_driver(driver, "max", model, ids[:, at:at + 1].contiguous(), tmp_path, True)
                assert torch.equal(got, alone[:, 0]), f"C{shape['n_embd']}, {weights}: row {at} of {3 if at < 3 else 9}"
                assert torch.equal(verified, alone[:, 0]), f"C{shape['n_embd']}, {weights}: row {at}'s verify"
