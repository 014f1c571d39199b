"""The int8 products of every build this machine runs, and of the torch path, against integer arithmetic worked out
by hand: exact numbers in, exact numbers out.

Each case is made so that nothing rounds. Weights are w = q * 2^-e with each row's largest |q| 127, so quantize_rows
gives back exactly q and the scale 2^-e; activations are integers whose largest magnitude is the constant the
build quantizes x by (VNNI: 32767, sdot: 16383; the FMA products take x as it is), so x / sx = x: quantizing x
changes nothing; every sum stays below 2^24, exact in fp32 in any order. Each output is then exactly
sum(x * q) (numpy, int64) times its row's 2^-e. A build that scales x back by another constant than it quantized
by (1/16384 for 1/16383, 1/32768 for 1/32767) is off by 1/16384 or 1/32768 of every output: the tolerance, 1e-6 of
the largest output, is 30 times smaller (measured: 0, the outputs are equal).

The activations reach the products through LayerNorms of gain 0, whose output is their bias exactly: ln_1's bias is
c_attn's input (its k and v land in an fp32 KV cache), ln_f's the LM head's (its output is the logits). Input widths
n_embd 63, 64 and 65 are L - 1, 0 and 1 modulo every lane count L of the builds' int8 products (NEON 4; AVX2 and
generic vectors 8; AVX-512 16; their four-vector loops 16, 32, 64; VNNI's groups of 4 and its 16-wide maximum;
sdot's 16 and its 32-wide loop), outputs (vocabularies 65, 63, 64; c_attn's 189, 192, 195) modulo VNNI's blocks of
16 rows and the FMA products' pairs and fours; rows 1 (the one-row products) and 15 (groups of 8, 4, 2 and 1 rows;
VNNI's and sdot's of 4 and 3). The builds besides this CPU's own (built as users get it, -O3) are built at -O0: no
optimizer changes an exact product, and -O0 compiles in seconds.
"""

import numpy as np
import pytest
import torch
from arm_driver import CROSS, MISSING, QEMU, cross_build, run_driver

from gptlab.config import ModelConfig
from gptlab.inference import native
from gptlab.inference.fused import FusedDecoder
from gptlab.inference.int8 import quantize_model
from gptlab.model import GPT

WIDTHS = [(63, 65, 3), (64, 63, 4), (65, 64, 5)]  # (n_embd, vocab_size, n_head)
ROWS = (1, 15)
TOLERANCE = 1e-6  # of the largest output; a constant slipped by one moves every output by 1/32768 of itself or more
X_MAX = {"fma": 32767, "vnni": 32767, "sdot": 16383}  # x's largest magnitude: the constant each product quantizes by
O0 = ("-O0", *native.FLAGS[1:])
OTHER_X86 = ["x86-64-v4", "x86-64-v3", "plain"]  # +vnni and +bf16 add no int8 code but VNNI's: the CPU's own build's
ARM = [("armv8-a", "cortex-a53", "fma"), ("armv8.2-a+dotprod", "max", "sdot")]  # build, qemu's CPU, product


def exact_rows(N: int, K: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(q (N, K) int64 in [-127, 127], each row's largest |q| 127, and scale (N,) powers of two 2^-8 .. 2^-14), one
    row all zeros (its scale 0)."""
    q = rng.integers(-127, 128, (N, K))
    q[np.arange(N), rng.integers(0, K, N)] = rng.choice([-127, 127], N)
    scale = 2.0 ** -rng.integers(8, 15, N)
    q[N // 2], scale[N // 2] = 0, 0.0
    return q, scale


def exact_x(K: int, x_max: int, rng: np.random.Generator) -> np.ndarray:
    """K integers in [-64, 64] but one, +-x_max: sum |x| * 127 < 2^24 for K <= 65."""
    x = rng.integers(-64, 65, K)
    x[rng.integers(0, K)] = rng.choice([-x_max, x_max])
    return x


def exact_case(C: int, V: int, n_head: int, x_max: int) -> tuple[GPT, dict[str, np.ndarray]]:
    """A 1-layer int8 GPT built from exact_rows weights and exact_x inputs (ln_1's and ln_f's gains 0, biases x), and
    the outputs worked out by hand: "attn" c_attn's (3C,), "head" the logits (V,), float64."""
    rng = np.random.default_rng(C)
    model = GPT(ModelConfig(n_layer=1, n_head=n_head, n_embd=C, vocab_size=V, block_size=8, dropout=0.0)).eval()
    block, t = model.transformer.h[0], model.transformer
    want = {}
    with torch.no_grad():
        for name, linear, ln in (("attn", block.attn.c_attn, block.ln_1), ("head", model.lm_head, t.ln_f)):
            q, scale = exact_rows(linear.out_features, C, rng)
            x = exact_x(C, x_max, rng)
            linear.weight.copy_(torch.from_numpy(q * scale[:, None]))
            ln.weight.zero_()
            ln.bias.copy_(torch.from_numpy(x))
            want[name] = (q @ x) * scale  # q @ x in int64: exact
            want[name + " q"], want[name + " scale"] = q, scale
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.zero_()
    quantize_model(model)
    for name, linear in (("attn", block.attn.c_attn), ("head", model.lm_head)):  # quantization gave them back
        assert np.array_equal(linear.q.numpy(), want[name + " q"]), name
        assert np.array_equal(linear.scale.numpy(), want[name + " scale"]), name
    return model, want


def error(got: torch.Tensor, want: np.ndarray) -> float:
    """The largest difference of `got` (rows of want's shape) from `want`, over want's largest magnitude."""
    expected = torch.from_numpy(want).expand_as(got)
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


def errors(model: GPT, want: dict, step) -> dict[str, float]:
    """The errors of one decode step `step(ids, cache) -> logits (R, V)` over fp32 caches of each of ROWS rows:
    logits, and the keys and values c_attn wrote at position 0."""
    c, out = model.config, {}
    for rows in ROWS:
        cache = model.new_kv_cache(rows, dtype=torch.float32)
        logits = step(torch.randint(0, c.vocab_size, (rows,)), cache)
        heads = torch.from_numpy(want["attn"]).view(3, c.n_head, c.head_dim).numpy()
        out[f"{rows} rows: logits"] = error(logits, want["head"])
        out[f"{rows} rows: keys"] = error(cache.k[0, :, :, 0], heads[1])
        out[f"{rows} rows: values"] = error(cache.v[0, :, :, 0], heads[2])
    return out


@pytest.mark.parametrize("C, V, n_head", WIDTHS)
def test_the_torch_int8_path_is_exact(C, V, n_head):
    model, want = exact_case(C, V, n_head, X_MAX["fma"])
    with torch.no_grad():
        got = errors(model, want, lambda ids, cache: model(ids[:, None], kv_cache=cache)[0][:, -1])
    assert max(got.values()) <= TOLERANCE, got


@pytest.fixture(scope="module")
def native_build(request):
    """name -> that build's library, None where this CPU does not run it: its own build is the session's
    (fused_kernel, -O3), any other is built at -O0; each when first asked for."""
    libs = {}

    def build(name: str):
        if name == native.build_for_cpu().name:
            return request.getfixturevalue("fused_kernel")
        if name not in libs:
            libs[name] = native.build_library(build=name, flags=O0) if native.BUILDS[name].runs_here() else None
        return libs[name]

    return build


NATIVE_RUNS = [pytest.param("own", "vnni", marks=pytest.mark.device_path("int8 native (VNNI)")),
               *(pytest.param(build, "fma", marks=pytest.mark.device_path("fused decode (native)"))
                 for build in ("own", *OTHER_X86))]


@pytest.mark.parametrize("C, V, n_head", WIDTHS)
@pytest.mark.parametrize("build, product", NATIVE_RUNS)
def test_each_native_builds_int8_product_is_exact(native_build, build, product, C, V, n_head):
    """Build "own" is this CPU's, by its VNNI product and by its other one (FMAs; sdot on an ARM CPU with it)."""
    name = native.build_for_cpu().name if build == "own" else build
    lib = native_build(name)
    if lib is None:
        pytest.skip(f"this CPU does not run the {name} build")
    if product == "vnni" and not native.has_int8_vnni(lib):
        pytest.skip(f"the {name} build has no VNNI product (no AVX512-VNNI on this CPU)")
    model, want = exact_case(C, V, n_head, X_MAX["sdot" if lib.gptlab_int8_sdot() else product])
    decoder = FusedDecoder(model, lib, vnni=product == "vnni", huge_pages=False)
    got = errors(model, want, lambda ids, cache: decoder.step(ids, cache).clone())
    assert max(got.values()) <= TOLERANCE, f"{native.describe(lib)}, {product}: {got}"


# ---- the ARM builds, under qemu (as tests/test_arm.py runs them) ------------------------------------------------

@pytest.fixture(scope="module")
def arm_driver(tmp_path_factory):
    """build -> its driver, cross-compiled when first asked for; skips without the cross compiler or qemu-user."""
    if CROSS is None or QEMU is None:
        pytest.skip(MISSING)
    folder, drivers = tmp_path_factory.mktemp("arm-exact"), {}
    return lambda build: drivers.get(build) or drivers.setdefault(build, cross_build(build, folder / build, "-O0"))


@pytest.mark.device_path("arm64 under qemu")
@pytest.mark.parametrize("build, cpu, product", ARM)
def test_each_arm_builds_int8_product_is_exact(arm_driver, build, cpu, product, tmp_path):
    got = {}
    for (C, V, n_head), rows in [(width, rows) for width in WIDTHS for rows in ROWS]:
        model, want = exact_case(C, V, n_head, X_MAX[product])
        logits = run_driver(arm_driver(build), cpu, model, torch.randint(0, V, (1, rows)), tmp_path)[0]  # one step
        got[f"width {C}, {rows} rows"] = error(logits, want["head"])
    assert max(got.values()) <= TOLERANCE, f"{build} ({product}) under -cpu {cpu}: {got}"
