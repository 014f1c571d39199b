"""Deliberately broken copies of the fused decode kernel (csrc/decode.cpp): each must fail one of
tests/test_fastdecode.py's parity checks, so that those checks are known to catch what they claim to."""

import pytest

from gptlab import fastdecode
from test_fastdecode import BF16_TOLERANCE, FP32_TOLERANCE, SHAPES, bf16_cache_errors, bf16_errors, fp32_error

pytestmark = [pytest.mark.device_path("fused decode (AVX-512)"), pytest.mark.usefixtures("fused_kernel")]

# name -> the edits (old text, new text, in order) that break the kernel, and the check (CHECKS) that must catch it
MUTANTS = {
    "ln_1 and ln_2 swapped": ([("L.ln_1_", "L.ln_X_"), ("L.ln_2_", "L.ln_1_"), ("L.ln_X_", "L.ln_2_")], "fp32"),
    "every bias dropped": ([("int t = omp_get_thread_num(), T", "b = nullptr; int t = omp_get_thread_num(), T"),
                            ("(b ? b[c] : 0.0f)", "0.0f")], "fp32"),
    "LayerNorm gains ignored": ([("* rstd * w[c] +", "* rstd +")], "fp32"),
    "bf16 cache store truncates": ([("(bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)", "(bf16)(u >> 16)")],
                                   "bf16 cache"),
    "products' masked tail one short": ([("(Mask)0xFFFF : (Mask)((1u << left) - 1)",
                                          "(Mask)0xFFFF : (Mask)((1u << (left - 1)) - 1)")], "fp32"),
    "attention's head tail one short": ([("(__mmask16)0 : (__mmask16)((1u << left) - 1)",
                                          "(__mmask16)0 : (__mmask16)((1u << (left - 1)) - 1)")], "fp32"),
}


def fp32_passes(lib) -> bool:
    return all(fp32_error(shape, rows, lib) <= FP32_TOLERANCE for shape in SHAPES for rows in (1, 2, 5, 8))


def bf16_weights_pass(lib) -> bool:
    return all(bf16_errors(shape, lib)[1] <= BF16_TOLERANCE for shape in SHAPES)


def bf16_cache_passes(lib) -> bool:
    errors = (bf16_cache_errors(shape, lib) for shape in SHAPES)
    return all(logits_error <= BF16_TOLERANCE and wrongly_rounded == 0 for logits_error, wrongly_rounded in errors)


# test_fastdecode's parity checks, each over every shape there (stopping at the first that fails)
CHECKS = {"fp32": fp32_passes, "bf16 weights": bf16_weights_pass, "bf16 cache": bf16_cache_passes}


def test_the_kernel_itself_passes_every_check(fused_kernel):
    assert all(check(fused_kernel) for check in CHECKS.values())


@pytest.mark.parametrize("name", MUTANTS)
def test_a_broken_kernel_fails_the_parity_checks(name, tmp_path):
    edits, catcher = MUTANTS[name]
    source = fastdecode.SOURCE.read_text()
    for old, new in edits:
        assert old in source, f"the mutant {name!r} no longer applies: {old!r} is not in decode.cpp"
        source = source.replace(old, new)
    (tmp_path / "decode.cpp").write_text(source)
    lib = fastdecode.build_library(tmp_path / "decode.cpp", tmp_path)
    assert not CHECKS[catcher](lib), f"the {catcher} check passes a kernel with {name}"
