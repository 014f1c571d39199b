"""Deliberately broken copies of the fused decode kernel (inference/csrc/decode.cpp and its vector layer,
inference/csrc/simd.h): each must fail one of the parity checks of tests/test_fused.py and tests/test_int8.py
(tests/helpers.py holds them), so that those checks are known to catch what they claim to; the other builds this
CPU runs (the AVX2 build on an AVX-512 machine, the plain build everywhere) held to the same checks, with a few
mutants of their own vector code each; and copies whose structs differ from the ctypes ones
(gptlab.inference.native), each of which loading must refuse."""

import shutil
from pathlib import Path

import pytest

from helpers import (BF16_TOLERANCE, FMA_TOLERANCE, FP32_TOLERANCE, INT8_SHAPES, KERNEL_SHAPES, VNNI_TOLERANCE,
                     bf16_cache_errors, bf16_errors, fp32_error, int8_error, trained_like)
from gptlab.inference import native

pytestmark = [pytest.mark.device_path("fused decode (native)"), pytest.mark.usefixtures("fused_kernel")]

# name -> the edits (old text, new text, in order) that break the kernel, and the check (CHECKS) that must catch it
MUTANTS = {
    "ln_1 and ln_2 swapped": ([("L.ln_1_", "L.ln_X_"), ("L.ln_2_", "L.ln_1_"), ("L.ln_X_", "L.ln_2_")], "fp32"),
    "every bias dropped": ([("int t = omp_get_thread_num(), T", "b = nullptr; int t = omp_get_thread_num(), T"),
                            ("(b ? b[c] : 0.0f)", "0.0f")], "fp32"),
    "LayerNorm gains ignored": ([("* rstd * w[c] +", "* rstd +")], "fp32"),
    "bf16 cache store truncates": ([("(bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)", "(bf16)(u >> 16)")],
                                   "bf16 cache"),
    "products' tail one short": ([("return left >= LANES ? LANES : left;", "return left >= LANES ? LANES : left - 1;")],
                                 "fp32"),
    "attention's scores, four at a time, lose the fourth's tail of q": (
        [("            a3 = simd::fma(qv[c], simd::load(K + (j + 3) * D + L * c, n[c]), a3);\n", "")], "fp32"),
    "attention's sum over V drops the odd positions": ([("y[c] = y[c] + z[c];", "y[c] = y[c];")], "fp32"),
    "a verify's rows all read and write cache row 0": ([("const int64_t row = s.slot ? s.slot[r] : r;",
                                                           "const int64_t row = s.slot ? 0 : r;")], "verify"),
    "a verify's rows attend before the rows before them store": (
        [("            if (s.cache_bf16) store_new<bf16>(m, s, l); else store_new<float>(m, s, l);  // (a barrier after)\n",
          ""),
         ("            linear<ADD>(m, L.attn_proj_w,",
          "            if (s.cache_bf16) store_new<bf16>(m, s, l); else store_new<float>(m, s, l);\n"
          "            linear<ADD>(m, L.attn_proj_w,")], "verify"),
    "attention's head tail one short": ([("n[c] = left >= L ? L : left <= 0 ? 0 : left;",
                                          "n[c] = left >= L ? L : left <= 0 ? 0 : left - 1;")], "fp32"),
    "int8 FMA product of one row ignores the row scales": ([("scale = s ? s[n + i] : 1.0f;", "scale = 1.0f;")],
                                                           "int8 fma"),
    "int8 FMA product of many rows ignores the row scales": ([("scale = s ? s[n] : 1.0f;", "scale = 1.0f;")],
                                                             "int8 fma"),
    "int8 VNNI product takes the next row's scale": ([("_mm512_set1_ps(sx), _mm512_loadu_ps(s + n))",
                                                       "_mm512_set1_ps(sx), _mm512_loadu_ps(s + n + 1))")], "int8 vnni"),
    "int8 VNNI product drops the u8 offset's correction": ([("_mm512_slli_epi32(_mm512_loadu_si512(sums + n), 7)",
                                                             "_mm512_setzero_si512()")], "int8 vnni"),
    "int8 VNNI product ignores x's scale": ([("_mm512_set1_ps(sx)", "_mm512_set1_ps(1.0f)")], "int8 vnni"),
    "int8 VNNI product drops x's low byte (8-bit x)": ([("_mm512_cvtepi32_ps(lo));", "_mm512_setzero_ps());")],
                                                       "int8 vnni"),
}


def fp32_passes(lib) -> bool:
    return all(fp32_error(shape, rows, lib) <= FP32_TOLERANCE for shape in KERNEL_SHAPES for rows in (1, 2, 5, 8))


def bf16_weights_pass(lib) -> bool:
    return all(bf16_errors(shape, lib)[1] <= BF16_TOLERANCE for shape in KERNEL_SHAPES)


def bf16_cache_passes(lib) -> bool:
    errors = (bf16_cache_errors(shape, lib) for shape in KERNEL_SHAPES)
    return all(logits_error <= BF16_TOLERANCE and wrongly_rounded == 0 for logits_error, wrongly_rounded in errors)


def int8_fma_passes(lib) -> bool:
    return all(int8_error(shape, rows, lib, vnni=False) <= FMA_TOLERANCE for shape in INT8_SHAPES for rows in (1, 3, 5))


def int8_vnni_passes(lib) -> bool:
    return all(int8_error(shape, rows, lib, vnni=True) <= VNNI_TOLERANCE for shape in INT8_SHAPES for rows in (2, 8))


def verify_passes(lib) -> bool:
    """test_speculative's: rows of 1, 4 and 2 tokens (one cache row each) in one verify give each position the
    logits, bit for bit, that one-token steps feeding the same tokens give (fp32, every shape)."""
    import torch

    from gptlab.inference.fused import FusedDecoder

    for shape in KERNEL_SHAPES:
        torch.manual_seed(0)
        model = trained_like(shape)
        fused = FusedDecoder(model, lib)
        start = model.new_kv_cache(3)
        with torch.inference_mode():
            model(torch.randint(0, shape["vocab_size"], (3, 9)), kv_cache=start)
        start.pos -= torch.tensor([0, 3, 1])
        tokens = [torch.randint(0, shape["vocab_size"], (n,)).tolist() for n in (1, 4, 2)]
        stepped, expected = start.select_rows(torch.arange(3)), {}
        for t in range(4):
            logits = fused.step(torch.tensor([row[t] if t < len(row) else 0 for row in tokens]), stepped).clone()
            expected.update({(r, t): logits[r] for r, row in enumerate(tokens) if t < len(row)})
        pos = [int(start.pos[r]) + t for r, row in enumerate(tokens) for t in range(len(row))]
        got = fused.verify(torch.tensor([x for row in tokens for x in row]), torch.tensor(pos),
                           torch.tensor([r for r, row in enumerate(tokens) for _ in row]),
                           start.select_rows(torch.arange(3)))
        keys = [(r, t) for r, row in enumerate(tokens) for t in range(len(row))]
        if not all(torch.equal(got[i], expected[key]) for i, key in enumerate(keys)):
            return False
    return True


# test_fused's, test_int8's and test_speculative's parity checks, each over every shape there (stopping at the first
# that fails)
CHECKS = {"fp32": fp32_passes, "bf16 weights": bf16_weights_pass, "bf16 cache": bf16_cache_passes,
          "int8 fma": int8_fma_passes, "int8 vnni": int8_vnni_passes, "verify": verify_passes}


def runnable(check: str, lib=None) -> bool:
    """Whether this CPU runs `check` (the VNNI product needs AVX512-VNNI), and `lib` if given (a build with it)."""
    return check != "int8 vnni" or (native.cpu_has_int8_vnni() if lib is None else native.has_int8_vnni(lib))


def test_the_kernel_itself_passes_every_check(fused_kernel):
    assert all(check(fused_kernel) for name, check in CHECKS.items() if runnable(name))


@pytest.mark.parametrize("name", MUTANTS)
def test_a_broken_kernel_fails_the_parity_checks(name, tmp_path):
    edits, catcher = MUTANTS[name]
    if not runnable(catcher):
        pytest.skip("no AVX512-VNNI on this CPU")
    lib = native.build_library(mutated_source(edits, tmp_path), tmp_path)
    assert not CHECKS[catcher](lib), f"the {catcher} check passes a kernel with {name}"


# ---- the other builds: each build's own vector code (inference/csrc/simd.h) ------------------------------------------

# The builds tested besides this CPU's own (the AVX2 build runs on every AVX-512 machine; plain runs everywhere)
OTHER_BUILDS = ["x86-64-v3", "plain"]
# build -> name -> (file, edits, check): mutants of the code only that build compiles, at -O1 (the quickest build
# that still vectorizes; the checks, not the optimizer, are under test)
O1 = ("-O1", *native.FLAGS[1:])
BUILD_MUTANTS = {
    "x86-64-v3": {
        "AVX2 sum drops the upper half": ("simd.h", [(
            "__m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));",
            "__m128 h = _mm256_castps256_ps128(v);")], "fp32"),
        "AVX2 bf16 widening one bit short": ("simd.h", [(
            "_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))",
            "_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 15))")], "bf16 weights"),
        "AVX2 int8 weights read unsigned": ("simd.h", [("_mm256_cvtepi8_epi32(", "_mm256_cvtepu8_epi32(")],
                                            "int8 fma"),
        "a partial vector reads one element too many": ("simd.h", [("i < n ? p[i] : fill", "i <= n ? p[i] : fill")],
                                                        "fp32"),
    },
    "plain": {
        "generic sum stops at two lanes": ("simd.h", [("for (int w = LANES / 2; w >= 1; w /= 2)",
                                                       "for (int w = LANES / 2; w >= 2; w /= 2)")], "fp32"),
        "generic bf16 widening one bit short": ("simd.h", [("(uint32_t)p[i] << 16", "(uint32_t)p[i] << 15")],
                                                "bf16 weights"),
        "generic int8 weights read unsigned": ("simd.h", [("f[i] = (float)p[i];", "f[i] = (float)(uint8_t)p[i];")],
                                               "int8 fma"),
        "a partial store writes one lane short": ("simd.h", [("for (int i = 0; i < n; i++) p[i] = part[i];",
                                                              "for (int i = 0; i < n - 1; i++) p[i] = part[i];")],
                                                  "fp32"),
    },
}


@pytest.fixture(scope="module", params=OTHER_BUILDS)
def other_build(request):
    build = native.BUILDS[request.param]
    if not build.runs_here():
        pytest.skip(f"this CPU does not run the {build.name} build")
    return build


def test_the_other_builds_pass_every_check(other_build):
    """Each other build, at -O1 as its mutants below are (this CPU's own build is checked at -O3, as users get it,
    by tests/test_fused.py and tests/test_int8.py): fp32 at every shape and batch width, bf16 weights, the bf16
    cache, int8 by FMAs (and by VNNI where the build has it)."""
    lib = native.build_library(build=other_build, flags=O1)
    assert native.describe(lib).startswith(other_build.name)
    failed = [name for name, check in CHECKS.items() if runnable(name, lib) and not check(lib)]
    assert not failed, f"the {other_build.name} build fails the {', '.join(failed)} checks"


@pytest.mark.parametrize("build, name", [(b, n) for b, mutants in BUILD_MUTANTS.items() for n in mutants])
def test_a_broken_build_fails_the_parity_checks(build, name, tmp_path):
    if not native.BUILDS[build].runs_here():
        pytest.skip(f"this CPU does not run the {build} build")
    file, edits, catcher = BUILD_MUTANTS[build][name]
    lib = native.build_library(mutated_source(edits, tmp_path, file), tmp_path, build, O1)
    assert not CHECKS[catcher](lib), f"the {catcher} check passes the {build} build with {name}"


# ---- the ABI: builds whose structs differ from the ctypes ones are refused before any call ------------------------

# name -> the edits that change decode.cpp's layout, and what the refusal must say (both values, the struct named)
ABI_MUTANTS = {
    "a field added to Step": ([("int R, max_len, n_threads, cache_bf16;",
                                "int R, max_len, n_threads, cache_bf16; void* spare;")],
                              r"struct Step is 128 bytes in .* but 120 bytes in gptlab's ctypes"),
    "two Layer fields swapped": ([("const void *c_attn_w, *attn_proj_w,", "const void *attn_proj_w, *c_attn_w,")],
                                 r"Layer.c_attn_w is at byte 8 in .* but at byte 0 in gptlab's ctypes"),
    "a field in Model's padding": ([("    float eps;\n", "    float eps;\n    int spare;\n"),
                                    ("F(Model, eps),", "F(Model, eps), F(Model, spare),")],
                                   r"struct Model has 18 fields in .* but 17 in gptlab's ctypes"),
    "the layout version raised": ([("constexpr int LAYOUT_VERSION = 3;", "constexpr int LAYOUT_VERSION = 4;")],
                                  r"layout version 4, gptlab passes version 3"),
    "no layout exported (an older source)": ([("GPTLAB_EXPORT_LAYOUT(LAYOUT_VERSION, FIELDS, SIZES)", "")],
                                             r"exports no struct layout"),
}


KERNEL_FILES = (native.SOURCE, native.SOURCE.parent / "simd.h", native.SOURCE.parent / "products.h")


def mutated_source(edits: list[tuple[str, str]], folder, file: str | None = None) -> Path:
    """decode.cpp with the vector layer simd.h and the ISA products products.h (which its #includes find beside it
    first) written into `folder`, `edits` applied in order, each to `file` or else to the one of the three that
    holds its old text (each must still apply); returns decode.cpp's path there."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = {f.name: f.read_text() for f in KERNEL_FILES}
    for old, new in edits:
        holders = [name for name, text in texts.items() if old in text and name == (file or name)]
        assert len(holders) == 1, f"{old!r} is in {holders or 'none'} of the kernel's files: the mutant is stale"
        texts[holders[0]] = texts[holders[0]].replace(old, new)
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder / native.SOURCE.name


def test_the_kernel_reports_the_layout_gptlab_passes(fused_kernel):
    native.check_layout(fused_kernel)  # raises on any difference
    assert fused_kernel.gptlab_layout_version() == native.LAYOUT_VERSION


@pytest.mark.parametrize("name", ABI_MUTANTS)
def test_a_build_with_other_structs_is_refused(name, tmp_path):
    edits, message = ABI_MUTANTS[name]
    with pytest.raises(native.KernelABIError, match=message):
        native.build_library(mutated_source(edits, tmp_path), tmp_path)


def test_a_refused_build_leaves_decoding_to_torch(monkeypatch, caplog):
    """gptlab expecting another layout than the built library's: loading refuses it with a warning, and the engine
    is left to decode with torch ops."""
    monkeypatch.setattr(native, "LAYOUT_VERSION", native.LAYOUT_VERSION + 1)
    with pytest.raises(native.KernelABIError, match="is not called"):
        native.build_library()
    assert native.load_library.__wrapped__() is None
    assert "the fused decode step is unavailable" in caplog.text and "layout version" in caplog.text
