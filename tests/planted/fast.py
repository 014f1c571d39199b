"""Planted bugs in the fast engine's kernels (issue 49: reference/csrc/fast.cpp and the headers beside it): a tile
edge, a tail loop, a wrong stride, a missing accumulate, a race between threads, the online softmax's rescaling,
the causal mask, GELU's derivative in the products' epilogue and the epilogue's rows, the fused residual's dropout,
the masks' streams, attention's operands packed once a head; each must fail the checks of tests/test_fast.py
(every rung against the naive engine, the products against torch in float64, the same bits run to run, the masks'
law)."""

from planted import Planted

CPP = "src/gptlab/reference/csrc/fast.cpp"
ATT = "src/gptlab/reference/csrc/fast_attention.h"
MODEL = "src/gptlab/reference/csrc/fast_model.h"
F = "tests/test_fast.py"
PARITY = f"{F}::test_every_rung_matches_the_naive_engine"
PRODUCTS = f"{F}::test_the_products_at_every_tile_and_lane_edge"
STEPS = f"{F}::test_twenty_training_steps_follow_the_naive_engine"
SAME_BITS = f"{F}::test_the_threaded_rungs_give_the_same_bits_every_run_and_on_any_thread_count"
DEEP = f"{F}::test_a_head_deeper_than_the_k_tile_matches_the_naive_engine"
MASKS = f"{F}::test_the_engines_masks_keep_1_minus_p_at_1_over_1_minus_p_and_follow_torchs_seed"

PLANTED = [
    Planted("fast: a sliver of B packed one column short at the matrix's edge", CPP, None,
            [("pack(B.p + pc * B.rs + n0 * B.cs, B.rs, B.cs, kb, std::min(NR, N - n0),",
              "pack(B.p + pc * B.rs + n0 * B.cs, B.rs, B.cs, kb, std::min(NR, N - n0 - (N - n0 < NR)),")], PRODUCTS),
    Planted("fast: the kernel's second vector stores one lane short at a tile's edge", CPP, None,
            [("w1 = std::max(0, nr - simd::LANES);", "w1 = std::max(0, nr - simd::LANES - 1);")], PRODUCTS),
    Planted("fast: the vector dot product drops its tail", CPP, None,
            [("        if (i < n) acc = simd::fma(simd::load(a + i, n - i), simd::load(b + i, n - i), acc);\n", "")],
            PARITY),
    Planted("fast: a block of K overwrites the blocks before it (a missing accumulate)", CPP, None,
            [("const bool last = pc + kb == K, add = acc || pc > 0;", "const bool last = pc + kb == K, add = acc;")],
            PRODUCTS),
    Planted("fast: the bias gradient sums the first 64 rows alone", CPP, None,
            [("        for (int n = 0; n < N; n++)\n            for (int o = o0;",
              "        for (int n = 0; n < std::min(N, 64); n++)\n            for (int o = o0;")], PARITY),
    Planted("fast: the fused backward reads dy's rows 3C apart (a wrong stride)", ATT, None,
            [("const Mat dY{dy + x.out(t0), C, 1};", "const Mat dY{dy + x.out(t0), 3L * C, 1};")], PARITY),
    Planted("fast: threads compute with B's slivers before all are packed (a race)", CPP, None,
            [("#pragma omp for schedule(static)\n                for (int s = 0; s < n_sl; s++) {",
              "#pragma omp for schedule(static) nowait\n                for (int s = 0; s < n_sl; s++) {")],
            [SAME_BITS, PARITY]),
    Planted("fast: a thread repacks B while the other still reads it (a race)", CPP, None,
            [("#pragma omp barrier\n", "")], [SAME_BITS, PARITY]),
    Planted("fast: the online softmax forgets to shrink its running sum", ATT, None,
            [("            l[i] *= shrink;\n", "")], PARITY),
    Planted("fast: the causal mask lets each query see the next key", ATT, None,
            [("const int seen = std::clamp(t - j0 + 1, 0, nk);\n    for",
              "const int seen = std::clamp(t - j0 + 2, 0, nk);\n    for")], PARITY),
    Planted("fast: GELU's derivative in the epilogue drops x times the density", CPP, None,
            [("    return cdf + x * density;", "    return cdf;")], PARITY),
    Planted("fast: the residual fused into LayerNorm ignores the dropout mask", CPP, None,
            [("o[c] = (m ? r[c] * m[c] : r[c]) + xn[c];", "o[c] = r[c] + xn[c];")], PARITY),
    Planted("fast: the loop-order rung's dot product starts from the wrong row of W", CPP, None,
            [("dot(A.p + m * A.rs, B.p + n * B.cs, K);", "dot(A.p + m * A.rs, B.p + (n > 0 ? n - 1 : 0) * B.cs, K);")],
            PRODUCTS),
    Planted("fast: AdamW's second moment without its bias correction", MODEL, None,
            [("theta[i] -= step * mom[i] / (std::sqrt(vel[i] / fc2) + feps);",
              "theta[i] -= step * mom[i] / (std::sqrt(vel[i]) + feps);")], STEPS),
    Planted("fast: clipping scales the gradients by the square root of its coefficient", MODEL, None,
            [("grads[i][j] *= (float)coef;", "grads[i][j] *= (float)std::sqrt(coef);")], STEPS),
    Planted("fast: the epilogue leaves each block's last row without its bias and GELU", CPP, None,
            [("for (int m = ic; m < ic + mb; m++) finish_row(", "for (int m = ic; m < ic + mb - 1; m++) finish_row(")],
            PARITY),
    Planted("fast: every stream of a seed draws the same mask", CPP, None,
            [("const uint64_t key = splitmix64(seed ^ splitmix64(stream));", "const uint64_t key = splitmix64(seed);")],
            MASKS),
    Planted("fast: a block of keys read from the packed keys one sliver early", ATT, None,
            [("return packed + (size_t)(j0 / NR) * D * NR;", "return packed + (size_t)(j0 / NR - (j0 > 0)) * D * NR;")],
            PARITY),
    Planted("fast: the packed queries' block starts at the block of keys' row", ATT, None,
            [("product(nk, D, nq, {dP.data(), 1, KEYS}, x.rows(0, t0), at_row(x.qs, t0),",
              "product(nk, D, nq, {dP.data(), 1, KEYS}, x.rows(0, t0), at_row(x.qs, j0),")], PARITY),
    Planted("fast: a head deeper than the K tile loses its last channel in attention's products", ATT, None,
            [("K > TILE.kc) return gemm(M, N, K, A, B, C, ldc, acc, nullptr, 1);",
              "K > TILE.kc) return gemm(M, N, K - 1, A, B, C, ldc, acc, nullptr, 1);")], DEEP),
]
