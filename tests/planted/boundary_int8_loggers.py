"""Planted bugs at issue 42's boundaries: the int8 products' quantization constants and lane tails on each build
(tests/test_int8_exact.py, exact integer products at widths L - 1, 0 and 1 modulo every lane count), and how a
logger marks a run that crashed or was stopped (tests/test_loggers.py, read back with MLflow's and W&B's own
readers)."""

from planted import Planted

INT8 = "src/gptlab/inference/int8.py"
DECODE = "src/gptlab/inference/csrc/decode.cpp"
SIMD = "src/gptlab/inference/csrc/simd.h"
PRODUCTS = "src/gptlab/inference/csrc/products.h"
LOGGERS = "src/gptlab/training/loggers.py"
EXACT = "tests/test_int8_exact.py"
NATIVE = f"{EXACT}::test_each_native_builds_int8_product_is_exact"
TORCH = f"{EXACT}::test_the_torch_int8_path_is_exact"
ARM_SDOT = f"{EXACT}::test_each_arm_builds_int8_product_is_exact[armv8.2-a+dotprod-max-sdot]"
OWN_VNNI = [f"{NATIVE}[own-vnni-{w}]" for w in ("63-65-3", "64-63-4", "65-64-5")]
OWN_FMA = [f"{NATIVE}[own-fma-{w}]" for w in ("63-65-3", "64-63-4", "65-64-5")]
GENERIC = [f"{NATIVE}[{b}-fma-{w}]" for b in ("x86-64-v3", "plain") for w in ("63-65-3", "64-63-4", "65-64-5")]
ENDED = "tests/test_loggers.py::test_a_run_that_crashes_or_is_interrupted_is_marked_failed_or_killed_not_finished"

PLANTED = [
    # the constant x is quantized by, and the one its sums are scaled back by
    Planted("int8edge: VNNI scales x's sums back by 1/32768 while quantizing by 32767", PRODUCTS, "quantize_x",
            [("xs[r] = amax / X16;", "xs[r] = amax / 32768.0f;")], OWN_VNNI),
    Planted("int8edge: VNNI quantizes x by 32768 while scaling back by 1/32767", PRODUCTS, "quantize_x",
            [("amax > 0.0f ? X16 / amax : 0.0f", "amax > 0.0f ? 32768.0f / amax : 0.0f")], OWN_VNNI),
    Planted("int8edge: sdot scales x's sums back by 1/16384 while quantizing by 16383", PRODUCTS, "quantize_x_sdot",
            [("xs[r] = amax / X15;", "xs[r] = amax / 16384.0f;")], ARM_SDOT),
    Planted("int8edge: sdot's x constant 16384, not 16383 (x's largest value overflows its high byte)", PRODUCTS,
            "quantize_x_sdot", [("constexpr float X15 = 16383.0f;", "constexpr float X15 = 16384.0f;")], ARM_SDOT),
    Planted("int8edge: weights quantized into [-126, 126] (each row's largest clamped)", INT8, "quantize_rows",
            [(".clamp_(-QMAX, QMAX)", ".clamp_(-QMAX + 1, QMAX - 1)")], TORCH),
    # lane tails: a width one past a multiple of the lanes, or one short of the next
    Planted("int8edge: one row's product drops a last lone input (width 1 past the lanes)", DECODE, "gemv_one",
            [("if (k < K) {", "if (k + 1 < K) {")], OWN_FMA),
    Planted("int8edge: the product of two rows drops a last lone input", DECODE, "gemv_rows",
            [("        if (k < K) {\n            typename D::Mask m",
              "        if (k + 1 < K) {\n            typename D::Mask m")], OWN_FMA),
    Planted("int8edge: the product of four or eight rows drops a last lone input", DECODE, "gemv_pair",
            [("    if (k < K) {\n        typename D::Mask m", "    if (k + 1 < K) {\n        typename D::Mask m")],
            OWN_FMA),
    Planted("int8edge: VNNI quantizes a last lone input of x as 0", PRODUCTS, "quantize_x",
            [("left > 0 ? (__mmask16)((1u << left) - 1)", "left > 1 ? (__mmask16)((1u << left) - 1)")], OWN_VNNI),
    Planted("int8edge: sdot drops a last lone input past its groups of 16", PRODUCTS, "sdot_rows",
            [("for (; k < K; k += 16) {  // the last 1-31", "for (; k + 1 < K; k += 16) {  // the last 1-31")],
            ARM_SDOT),
    Planted("int8edge: a partial vector one lane short of whole is read whole (width L - 1)", SIMD, "load",
            [("if (n >= LANES) return load(p);", "if (n >= LANES - 1) return load(p);")], GENERIC),
    # how a run that stops short is marked
    Planted("loggeredge: a crashed run's MLflow status FINISHED", LOGGERS, "ending",
            [('return "FAILED", 1', 'return "FINISHED", 1')], ENDED),
    Planted("loggeredge: a crashed run's MLflow status KILLED (as a stop by a signal)", LOGGERS, "ending",
            [('return "FAILED", 1', 'return "KILLED", 1')], ENDED),
    Planted("loggeredge: a crashed run's W&B exit code 0", LOGGERS, "ending",
            [('return "FAILED", 1', 'return "FAILED", 0')], ENDED),
    Planted("loggeredge: a run stopped by SIGINT marked failed with exit code 1", LOGGERS, "ending",
            [('return "KILLED", exc.exit_code', 'return "FAILED", 1')], ENDED),
    Planted("loggeredge: Ctrl-C's KeyboardInterrupt taken for a crash", LOGGERS, "ending",
            [("if isinstance(exc, KeyboardInterrupt):", "if isinstance(exc, SystemExit):")], ENDED),
    Planted("loggeredge: every logger finished as if training had ended, whatever stopped it", LOGGERS,
            "Loggers.__exit__", [("        for logger in self.loggers:\n            logger.finish(exc)",
              "        for logger in self.loggers:\n            logger.finish(None)")], ENDED),
]
