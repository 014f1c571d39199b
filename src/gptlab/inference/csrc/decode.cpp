// One decode step of a GPT-2 decoder on a CPU: every row (prompt) brings one new token; this runs the whole model
// for it in one call, so no interpreter sits between the weights and the memory bus. One source for every CPU: the
// vector operations come from simd.h beside it (AVX-512, AVX2 + FMA, NEON, or the compiler's generic vectors,
// by the build's target: gptlab/inference/native.py names them).
//
// Why: decoding one token reads every weight once, so memory bandwidth sets its speed. Each op launched from
// Python costs microseconds, a 12-layer model launches hundreds per token, and the library kernels for one row
// (GEMV) stop well short of the bus (docs/benchmarks.md). Here the products stream each weight row once, for all
// rows of the batch at a time, and the small work (LayerNorm, attention over the cache, GELU, residual adds) is
// fused around them. Activations are fp32; weights fp32 or bf16 (bf16 products round x to bf16 where the build
// has AVX512-BF16, as a bf16 model's activations are, and widen W to fp32 everywhere else: bf16 storage halves the
// bytes read on any CPU), or int8 with one fp32 scale per output row (gptlab/inference/int8.py): widened to fp32
// for FMAs, or, where the build has AVX512-VNNI, multiplied as bytes by vpdpbusd against x quantized per row to 16
// bits, in two bytes (see gemv_vnni), or, where it has ARM's dot product, by sdot against x in 15 bits (gemv_sdot).
// Those ISA-specific products live in products.h; everything else here is written once over simd.h.
//
// The math is the model's (gptlab/model.py), step by step; tests/test_fused.py holds it to the torch path
// (gptlab/inference/fused.py calls it).
// Layout of the KV cache: k, v (n_layer, R, n_head, max_len, head_dim) fp32 or bf16, as gptlab.model.KVCache.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "abi.h"   // gptlab/csrc: the struct layout every library exports
#include "simd.h"  // beside this file: the vector layer (vf, LANES, loads, sums, e^x) for this build's target

using simd::vf;

// A row of x alone (gemv_one) is multiplied by this many rows of W at a time: independent sums enough to hide the
// multiply-add's latency, and as many rows streaming side by side. The generic build's vectors take two registers
// each on a plain x86-64 (SSE's 16), where eight sums spill.
#ifdef GPTLAB_SIMD_GENERIC
constexpr int ONE_ROW = 4;
#else
constexpr int ONE_ROW = 8;
#endif
// Batched products fetch W this many rows ahead into L2: the hardware prefetcher alone lags, and into L1 the
// fetches evicted x (measured slower).
constexpr int AHEAD = 4;
// A product that reads W as one sequential stream (gemv_one, products.h's gemv_vnni) fetches it this many bytes
// ahead into L2.
constexpr int STREAM_AHEAD = 4096;
// Attention reads a head's cached keys and values in order, fetched this many positions ahead into L1.
constexpr int CACHE_AHEAD = 16;

struct Layer {  // weights (out, in) as nn.Linear stores them, in the model's dtype; vectors fp32, NULL if absent
    const void *c_attn_w, *attn_proj_w, *c_fc_w, *mlp_proj_w;
    const float *ln_1_w, *ln_1_b, *c_attn_b, *attn_proj_b, *ln_2_w, *ln_2_b, *c_fc_b, *mlp_proj_b;
    // int8 weights only (else NULL): each output row's scale, and its sum of int8 weights (for VNNI's offset)
    const float *c_attn_s, *attn_proj_s, *c_fc_s, *mlp_proj_s;
    const int32_t *c_attn_sum, *attn_proj_sum, *c_fc_sum, *mlp_proj_sum;
};

// How the matrices are stored and multiplied: Model.weights
enum Weights { FP32 = 0, BF16 = 1, INT8_FMA = 2, INT8_VNNI = 3 };

struct Model {
    int n_layer, n_head, head_dim, n_embd, vocab_size, block_size, weights, gelu_tanh;
    float eps;
    const void *wte, *wpe, *lm_head;  // (V, C), (block_size, C), (V, C); int8 weights: wte and wpe are fp32
    const float *ln_f_w, *ln_f_b;
    const Layer* layers;
    const float* lm_head_s;  // int8 weights only (else NULL): as Layer's
    const int32_t* lm_head_sum;
};

struct Step {  // R rows, each one new token at its own position
    int R, max_len, n_threads, cache_bf16;
    int cache_rows;        // rows of the cache (R where each row has its own)
    const int64_t* ids;    // (R,)
    int64_t* pos;          // (R,): positions filled so far; the new token goes to pos[r], then pos[r] += 1
    const int64_t* slot;   // (R,): the cache row row r reads and writes; NULL: row r's own. Rows sharing a cache row
                           // at consecutive positions verify several tokens of one sequence in one step (each
                           // sees the keys and values the rows before it store in this step: all are stored first)
    void *k, *v;           // caches (n_layer, cache_rows, n_head, max_len, head_dim), fp32 or bf16
    float *x, *h, *qkv, *att, *fc, *logits, *scores;  // scratch (R*C, R*C, R*3C, R*C, R*4C), out (R*V), T*max_len
};

// ---- the ABI (gptlab/csrc/abi.h): Python (gptlab/inference/native.py) fills these structs with ctypes and checks,
// before the first call, that this library's version, sizes and offsets are the ones it passes ----
constexpr int LAYOUT_VERSION = 3;  // raise with any change to the structs above, here and in native.py
#define F(S, f) GPTLAB_FIELD(S, f)
static const gptlab_abi::Field FIELDS[] = {
    F(Layer, c_attn_w), F(Layer, attn_proj_w), F(Layer, c_fc_w), F(Layer, mlp_proj_w), F(Layer, ln_1_w),
    F(Layer, ln_1_b), F(Layer, c_attn_b), F(Layer, attn_proj_b), F(Layer, ln_2_w), F(Layer, ln_2_b),
    F(Layer, c_fc_b), F(Layer, mlp_proj_b), F(Layer, c_attn_s), F(Layer, attn_proj_s), F(Layer, c_fc_s),
    F(Layer, mlp_proj_s), F(Layer, c_attn_sum), F(Layer, attn_proj_sum), F(Layer, c_fc_sum), F(Layer, mlp_proj_sum),
    F(Model, n_layer), F(Model, n_head), F(Model, head_dim), F(Model, n_embd), F(Model, vocab_size),
    F(Model, block_size), F(Model, weights), F(Model, gelu_tanh), F(Model, eps), F(Model, wte),
    F(Model, wpe), F(Model, lm_head), F(Model, ln_f_w), F(Model, ln_f_b), F(Model, layers), F(Model, lm_head_s),
    F(Model, lm_head_sum),
    F(Step, R), F(Step, max_len), F(Step, n_threads), F(Step, cache_bf16), F(Step, cache_rows), F(Step, ids),
    F(Step, pos), F(Step, slot), F(Step, k),
    F(Step, v), F(Step, x), F(Step, h), F(Step, qkv), F(Step, att), F(Step, fc), F(Step, logits), F(Step, scores),
};
#undef F
static const gptlab_abi::Size SIZES[] = {GPTLAB_SIZE(Layer), GPTLAB_SIZE(Model), GPTLAB_SIZE(Step)};
GPTLAB_EXPORT_LAYOUT(LAYOUT_VERSION, FIELDS, SIZES)

// What this build's vector layer is ("avx512", "avx2", "neon", "generic") and how many floats a vector holds.
extern "C" const char* gptlab_simd() { return simd::NAME; }
extern "C" int gptlab_lanes() { return simd::LANES; }

// Whether this build multiplies bf16 weights with AVX512-BF16 (else it widens them to fp32).
extern "C" int gptlab_bf16_dot() {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

// Whether this build multiplies int8 weights with ARM's dot product (sdot; the FMA layout, Model.weights INT8_FMA).
extern "C" int gptlab_int8_sdot() {
#if defined(GPTLAB_SIMD_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return 1;
#else
    return 0;
#endif
}

// Whether this build multiplies int8 weights with AVX512-VNNI (Model.weights INT8_VNNI; else it runs INT8_FMA).
extern "C" int gptlab_int8_vnni() {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16 x) { uint32_t u = (uint32_t)x << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }

enum Epilogue { STORE, GELU_ERF, GELU_TANH, ADD };  // y = dot + b; y = gelu(dot + b); y += dot + b

template <int E> static inline void finish(float* y, float d) {
    if (E == STORE) *y = d;
    else if (E == ADD) *y += d;
    else if (E == GELU_ERF) *y = 0.5f * d * (1.0f + erff(d * 0.70710678118654752f));
    else *y = 0.5f * d * (1.0f + tanhf(0.79788456080286536f * (d + 0.044715f * d * d * d)));
}

// ---- matrix-vector products ----
// One kernel shape per case below, written once over a "dot" type: how a vector of W meets a vector of x.
// Widen<WT>: W fp32, bf16 or int8 widened to fp32, x fp32, simd::LANES multiply-adds per instruction. A partial
// vector (a row's tail) is named by its count of elements.
template <typename WT> struct Widen {
    using W = WT;
    using X = float;
    using WV = vf;
    using XV = vf;
    using Mask = int;
    static constexpr int LANES = simd::LANES;  // elements of k per vector
    static Mask tail(int left) { return left >= LANES ? LANES : left; }
    static WV w(const W* p) { return simd::load(p); }
    static WV w(const W* p, Mask m) { return simd::load(p, m); }
    static XV x(const X* p) { return simd::load(p); }
    static XV x(const X* p, Mask m) { return simd::load(p, m); }
    static vf madd(vf acc, WV w, XV x) { return simd::fma(w, x, acc); }
};

// Every product below sums each output of each row of x alike, whatever the rows beside it (so a row's logits are
// the same floats alone or in any batch: the server's continuous batching and `gptlab sample` rely on it): one
// vector of sums over k in steps of the lanes, then the masked tail, then simd::sum, times the scale (int8's; 1
// for float weights) plus the bias in one rounding (fmaf, not left to the compiler's contraction), then E.
//
// The sums are named variables, not an array: GCC keeps such an array on the stack and stores it every
// iteration.

// One row of x (R = 1): NB rows of W (outputs n .. n + NB - 1) at a time, one sum each: independent chains that
// hide the multiply-add's latency without splitting any output's sum, x loaded once for all NB. The NB rows are
// one block of W, read side by side; the blocks are fetched into L2 as one stream, at the pace they are read, a
// block plus STREAM_AHEAD bytes ahead (so that each byte is fetched more than STREAM_AHEAD bytes of the stream
// before it is read). The last group's rows past n1 repeat row n (read again from L1) and are not stored.
#define LOAD(p) D::w(p)
#define LOAD_TAIL(p) D::w(p, m)
#define MADD1(j, LD) if constexpr (NB > j) a##j = D::madd(a##j, LD(r##j + k), xv);
#define MADDS1(LD) MADD1(0, LD) MADD1(1, LD) MADD1(2, LD) MADD1(3, LD) MADD1(4, LD) MADD1(5, LD) MADD1(6, LD) \
                   MADD1(7, LD)
#define ROW1(j) *r##j = count > j ? r0 + j * (int64_t)K : r0
template <int E, int NB, typename D>
static void gemv_one(const typename D::W* W, const typename D::X* x, const float* s, const float* b, float* y,
                     int K, int n0, int n1) {
    constexpr int L = D::LANES;
    const typename D::Mask all = D::tail(L);
    const int64_t block = (int64_t)NB * K * sizeof(*W), step = (int64_t)NB * L * sizeof(*W);  // bytes
    for (int n = n0; n < n1; n += NB) {
        const int count = n1 - n >= NB ? NB : n1 - n;
        const typename D::W* r0 = W + (int64_t)n * K;
        const typename D::W ROW1(1), ROW1(2), ROW1(3), ROW1(4), ROW1(5), ROW1(6), ROW1(7);
        const char* ahead = (const char*)r0 + block + STREAM_AHEAD;
        vf a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        int k = 0;
        for (; k + L <= K; k += L) {
            for (int line = 0; line < step; line += 64) simd::fetch_far(ahead + (int64_t)k * NB * sizeof(*W) + line);
            typename D::XV xv = D::x(x + k, all);
            MADDS1(LOAD)
        }
        if (k < K) {
            typename D::Mask m = D::tail(K - k);
            typename D::XV xv = D::x(x + k, m);
            MADDS1(LOAD_TAIL)
        }
        float d[8];
        simd::sum4(a0, a1, a2, a3, d);  // each as simd::sum adds it
        if constexpr (NB > 4) simd::sum4(a4, a5, a6, a7, d + 4);
        for (int i = 0; i < count; i++) {
            float bias = b ? b[n + i] : 0.0f, scale = s ? s[n + i] : 1.0f;
            finish<E>(y + n + i, fmaf(d[i], scale, bias));
        }
    }
}
#undef LOAD
#undef LOAD_TAIL
#undef MADD1
#undef MADDS1
#undef ROW1

// OUT stores row j's sum a##j for output n.
#define OUT(j) if constexpr (RB > j) finish<E>(Y + (int64_t)j * N + n, fmaf(simd::sum(a##j), scale, bias));
#define OUTS OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7)

// Two rows of x (or the last odd one): one row of W at a time, one sequential stream (two interleaved streams, or
// a weight tile, measured slower here), each W vector used RB times; the next row is fetched ahead into L1.
#define MADD(j, M) if constexpr (RB > j) a##j = D::madd(a##j, w, D::x(X + (int64_t)j * K + k, M));
#define MADDS(M) MADD(0, M) MADD(1, M) MADD(2, M) MADD(3, M) MADD(4, M) MADD(5, M) MADD(6, M) MADD(7, M)
template <int E, int RB, typename D>
static void gemv_rows(const typename D::W* W, const typename D::X* X, const float* s, const float* b, float* Y,
                      int N, int K, int n0, int n1) {
    constexpr int L = D::LANES;
    const typename D::Mask all = D::tail(L);
    for (int n = n0; n < n1; n++) {
        vf a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const typename D::W* r = W + (int64_t)n * K;
        int k = 0;
        for (; k + L <= K; k += L) {
            simd::fetch_near((const char*)(r + K + k));
            typename D::WV w = D::w(r + k);
            MADDS(all)
        }
        if (k < K) {
            typename D::Mask m = D::tail(K - k);
            typename D::WV w = D::w(r + k, m);
            MADDS(m)
        }
        float bias = b ? b[n] : 0.0f, scale = s ? s[n] : 1.0f;
        OUTS
    }
}
#undef MADD
#undef MADDS
#undef OUT
#undef OUTS

// Four or more rows of x: two rows of W at a time (n and n + 1; n only when `one`), each x vector loaded once
// for both, fewer loads per multiply-add; W fetched AHEAD rows ahead into L2.
#define MADD2(j, M) if constexpr (RB > j) { typename D::XV xv = D::x(X + (int64_t)j * K + k, M); \
                                            a##j = D::madd(a##j, w0, xv); b##j = D::madd(b##j, w1, xv); }
#define MADDS2(M) MADD2(0, M) MADD2(1, M) MADD2(2, M) MADD2(3, M) MADD2(4, M) MADD2(5, M) MADD2(6, M) MADD2(7, M)
#define OUT2(j) if constexpr (RB > j) { \
    finish<E>(Y + (int64_t)j * N + n, fmaf(simd::sum(a##j), scale0, bias0)); \
    if (!one) finish<E>(Y + (int64_t)j * N + n + 1, fmaf(simd::sum(b##j), scale1, bias1)); }
template <int E, int RB, typename D>
static void gemv_pair(const typename D::W* W, const typename D::X* X, const float* s, const float* b, float* Y, int N,
                      int K, int n, bool one) {
    constexpr int L = D::LANES;
    const typename D::Mask all = D::tail(L);
    vf a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    vf b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    const typename D::W *r0 = W + (int64_t)n * K, *r1 = one ? r0 : r0 + K;
    int k = 0;
    for (; k + L <= K; k += L) {
        for (int line = 0; line < L * (int)sizeof(*r0); line += 64) {
            simd::fetch_far((const char*)(r0 + AHEAD * K + k) + line);
            simd::fetch_far((const char*)(r1 + AHEAD * K + k) + line);
        }
        typename D::WV w0 = D::w(r0 + k), w1 = D::w(r1 + k);
        MADDS2(all)
    }
    if (k < K) {
        typename D::Mask m = D::tail(K - k);
        typename D::WV w0 = D::w(r0 + k, m), w1 = D::w(r1 + k, m);
        MADDS2(m)
    }
    float bias0 = b ? b[n] : 0.0f, bias1 = b && !one ? b[n + 1] : 0.0f;
    float scale0 = s ? s[n] : 1.0f, scale1 = s && !one ? s[n + 1] : 1.0f;
    OUT2(0) OUT2(1) OUT2(2) OUT2(3) OUT2(4) OUT2(5) OUT2(6) OUT2(7)
}
#undef MADD2
#undef MADDS2
#undef OUT2

// Y (R, N) from X (R, K) and W (N, K): this thread's share [n0, n1) of the outputs, every row.
template <int E, typename D>
static void gemv(const typename D::W* W, const typename D::X* X, const float* s, const float* b, float* Y, int R,
                 int N, int K, int n0, int n1) {
    if (R == 1) { gemv_one<E, ONE_ROW, D>(W, X, s, b, Y, K, n0, n1); return; }
    for (int r = 0; r < R;) {
        const typename D::X* x = X + (int64_t)r * K;
        float* y = Y + (int64_t)r * N;
        int left = R - r, rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (rows >= 4) {
            for (int n = n0; n < n1; n += 2) {
                if (rows == 8) gemv_pair<E, 8, D>(W, x, s, b, y, N, K, n, n + 1 == n1);
                else gemv_pair<E, 4, D>(W, x, s, b, y, N, K, n, n + 1 == n1);
            }
        } else if (rows == 2) {
            gemv_rows<E, 2, D>(W, x, s, b, y, N, K, n0, n1);
        } else {
            gemv_rows<E, 1, D>(W, x, s, b, y, N, K, n0, n1);
        }
        r += rows;
    }
}

#include "products.h"  // beside this file: DotBF16, gemv_vnni, gemv_sdot, the products with an ISA's own instructions

// Y (R, N) = X (R, K) W^T + b, W (N, K) in the model's format (s, sums: int8's per-row scales and sums), epilogue
// E; the outputs are split evenly over the threads, then all wait for all.
template <int E>
static void linear(const Model& m, const void* W, const float* s, const int32_t* sums, const float* X, const float* b,
                   float* Y, int R, int N, int K) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int per = (N + T - 1) / T;
    if (m.weights == INT8_VNNI) per = (per + 15) / 16 * 16;  // whole blocks of 16 rows
    int n0 = t * per < N ? t * per : N, n1 = n0 + per < N ? n0 + per : N;
    if (n0 < n1) {
        if (m.weights == INT8_VNNI) {
#ifdef __AVX512VNNI__
            gemv_vnni<E>((const int8_t*)W, X, s, sums, b, Y, R, N, K, n0, n1);
#else
            __builtin_trap();  // unreachable: Python never asks a library built without VNNI for the VNNI layout
#endif
#if defined(GPTLAB_SIMD_NEON) && defined(__ARM_FEATURE_DOTPROD)
        } else if (m.weights == INT8_FMA) {
            gemv_sdot<E>((const int8_t*)W, X, s, b, Y, R, N, K, n0, n1);
#endif
        } else if (m.weights == INT8_FMA) {
            gemv<E, Widen<int8_t>>((const int8_t*)W, X, s, b, Y, R, N, K, n0, n1);
        } else if (m.weights == BF16) {
#ifdef __AVX512BF16__
            gemv<E, DotBF16>((const bf16*)W, to_bf16(X, (int64_t)R * K), nullptr, b, Y, R, N, K, n0, n1);
#else
            gemv<E, Widen<bf16>>((const bf16*)W, X, nullptr, b, Y, R, N, K, n0, n1);
#endif
        } else {
            gemv<E, Widen<float>>((const float*)W, X, nullptr, b, Y, R, N, K, n0, n1);
        }
    }
#pragma omp barrier
}

static void layer_norm(const float* x, const float* w, const float* b, float* y, int C, float eps) {
    float mean = 0.0f, var = 0.0f;
    for (int c = 0; c < C; c++) mean += x[c];
    mean /= C;
    for (int c = 0; c < C; c++) var += (x[c] - mean) * (x[c] - mean);
    float rstd = 1.0f / sqrtf(var / C + eps);
    for (int c = 0; c < C; c++) y[c] = (x[c] - mean) * rstd * w[c] + (b ? b[c] : 0.0f);
}

static void layer_norm_rows(const Model& m, const float* x, const float* w, const float* b, float* y, int R) {
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) layer_norm(x + (int64_t)r * m.n_embd, w, b, y + (int64_t)r * m.n_embd, m.n_embd, m.eps);
}

// The KV cache holds fp32, or bf16 (a bf16 model's: half the bytes to read, and at batch 8 and a few hundred
// positions those bytes rival the weights').
static inline void store(float* p, float x) { *p = x; }
static inline void store(bf16* p, float x) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    *p = (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The cache row of step row r, and where head hh of layer l starts in it.
static inline int64_t head_base(const Model& m, const Step& s, int l, int r, int hh) {
    const int64_t row = s.slot ? s.slot[r] : r;
    return ((((int64_t)l * s.cache_rows + row) * m.n_head + hh) * s.max_len) * m.head_dim;  // [l, row, hh, 0, 0]
}

// Store every row's new key and value of layer l at its position (before any row attends: a row may read the ones
// stored by rows before it, in a step that verifies several positions of one sequence).
template <typename CT>
static void store_new(const Model& m, const Step& s, int l) {
    const int C = m.n_embd, D = m.head_dim;
#pragma omp for schedule(static)
    for (int task = 0; task < s.R * m.n_head; task++) {
        const int r = task / m.n_head, hh = task % m.n_head;
        const float* qkv = s.qkv + (int64_t)r * 3 * C;
        const float *k_new = qkv + C + hh * D, *v_new = qkv + 2 * C + hh * D;
        const int64_t base = head_base(m, s, l, r, hh), p = s.pos[r];
        CT *K = (CT*)s.k + base, *V = (CT*)s.v + base;
        for (int d = 0; d < D; d++) { store(K + p * D + d, k_new[d]); store(V + p * D + d, v_new[d]); }
    }
}

// softmax(q K^T / sqrt(D)) V over positions 0..pos of one row and head (its key and value stored: store_new).
// DC = ceil(D / LANES) vectors hold q and the output in registers (D = 64 in every GPT-2: DC = 4 on AVX-512, 8 on
// AVX2, 16 on NEON); n[c] is how many of vector c's lanes are in the head (the last may be partial).
template <typename CT, int DC>
static void attend(const Model& m, const Step& s, int l, int r, int hh, float* scores) {
    constexpr int L = simd::LANES;
    const int C = m.n_embd, D = m.head_dim;
    const float* q = s.qkv + (int64_t)r * 3 * C + hh * D;
    const int64_t base = head_base(m, s, l, r, hh);
    const CT *K = (const CT*)s.k + base, *V = (const CT*)s.v + base;
    const int64_t p = s.pos[r];
    int n[DC];
    vf qv[DC], y[DC];
    const vf scale = simd::set1(1.0f / sqrtf((float)D));
    for (int c = 0; c < DC; c++) {
        int left = D - L * c;
        n[c] = left >= L ? L : left <= 0 ? 0 : left;
        qv[c] = simd::load(q + L * c, n[c]) * scale;
        y[c] = simd::zero();
    }
    // The cache is read from memory (the weights streamed through since), one head's positions in order: fetched
    // CACHE_AHEAD positions ahead, or each step waited on memory one position at a time (`gptlab bench decode`'s
    // batch-8 steps, docs/benchmarks.md). Scores four positions at a time: four independent sums reduced together
    // (simd::sum4: the same additions in the same order as simd::sum, which scores the rest one at a time).
    const int row_bytes = D * (int)sizeof(CT);
    int64_t j = 0;
    for (; j + 4 <= p + 1; j += 4) {
        if (j + CACHE_AHEAD + 3 <= p) {  // only positions this step reads
            const char* ahead = (const char*)(K + (j + CACHE_AHEAD) * D);
            for (int c = 0; c < 4 * row_bytes; c += 64) simd::fetch_near(ahead + c);
        }
        vf a0 = qv[0] * simd::load(K + j * D, n[0]);
        vf a1 = qv[0] * simd::load(K + (j + 1) * D, n[0]);
        vf a2 = qv[0] * simd::load(K + (j + 2) * D, n[0]);
        vf a3 = qv[0] * simd::load(K + (j + 3) * D, n[0]);
        for (int c = 1; c < DC; c++) {
            a0 = simd::fma(qv[c], simd::load(K + j * D + L * c, n[c]), a0);
            a1 = simd::fma(qv[c], simd::load(K + (j + 1) * D + L * c, n[c]), a1);
            a2 = simd::fma(qv[c], simd::load(K + (j + 2) * D + L * c, n[c]), a2);
            a3 = simd::fma(qv[c], simd::load(K + (j + 3) * D + L * c, n[c]), a3);
        }
        simd::sum4(a0, a1, a2, a3, scores + j);
    }
    for (; j <= p; j++) {
        vf acc = qv[0] * simd::load(K + j * D, n[0]);
        for (int c = 1; c < DC; c++) acc = simd::fma(qv[c], simd::load(K + j * D + L * c, n[c]), acc);
        scores[j] = simd::sum(acc);
    }
    vf most = simd::set1(-INFINITY);
    for (int64_t i = 0; i <= p; i += L) {
        int count = p + 1 - i >= L ? L : (int)(p + 1 - i);
        most = simd::max(most, simd::load(scores + i, count, -INFINITY));
    }
    const vf top = simd::set1(simd::max_of(most));
    vf total = simd::zero();
    for (int64_t i = 0; i <= p; i += L) {
        int count = p + 1 - i >= L ? L : (int)(p + 1 - i);
        vf e = simd::keep(simd::exp(simd::load(scores + i, count) - top), count);
        simd::store(scores + i, e, count);
        total = total + e;
    }
    // the weighted sum of V, two positions at a time into two sets of sums (independent chains), added at the end
    vf z[DC];
    for (int c = 0; c < DC; c++) z[c] = simd::zero();
    int64_t i = 0;
    for (; i + 2 <= p + 1; i += 2) {
        if (i + CACHE_AHEAD + 1 <= p) {
            const char* ahead = (const char*)(V + (i + CACHE_AHEAD) * D);
            for (int c = 0; c < 2 * row_bytes; c += 64) simd::fetch_near(ahead + c);
        }
        vf w0 = simd::set1(scores[i]), w1 = simd::set1(scores[i + 1]);
        for (int c = 0; c < DC; c++) {
            y[c] = simd::fma(w0, simd::load(V + i * D + L * c, n[c]), y[c]);
            z[c] = simd::fma(w1, simd::load(V + (i + 1) * D + L * c, n[c]), z[c]);
        }
    }
    if (i <= p) {
        vf w = simd::set1(scores[i]);
        for (int c = 0; c < DC; c++) y[c] = simd::fma(w, simd::load(V + i * D + L * c, n[c]), y[c]);
    }
    for (int c = 0; c < DC; c++) y[c] = y[c] + z[c];
    const vf norm = simd::set1(1.0f / simd::sum(total));
    float* out = s.att + (int64_t)r * C + hh * D;
    for (int c = 0; c < DC; c++) simd::store(out + L * c, y[c] * norm, n[c]);
}

// D <= 256 (checked by the caller): DC = ceil(D / LANES) rounded up to a power of two (the vectors past the head
// have no lanes in it; D = 64, every GPT-2's, needs no rounding on any target)
template <typename CT>
static void attend_any(const Model& m, const Step& s, int l, int r, int hh, float* scores) {
    constexpr int L = simd::LANES;
    const int chunks = (m.head_dim + L - 1) / L;
    if (chunks <= 1) attend<CT, 1>(m, s, l, r, hh, scores);
    else if (chunks <= 2) attend<CT, 2>(m, s, l, r, hh, scores);
    else if (chunks <= 4) attend<CT, 4>(m, s, l, r, hh, scores);
    else if (chunks <= 8) attend<CT, 8>(m, s, l, r, hh, scores);
    else if (chunks <= 16 || L >= 16) attend<CT, 16>(m, s, l, r, hh, scores);
    else attend<CT, 256 / L>(m, s, l, r, hh, scores);
}

template <typename WT>
static void embed(const Model& m, const Step& s) {
    const WT *wte = (const WT*)m.wte, *wpe = (const WT*)m.wpe;
    const int C = m.n_embd;
#pragma omp for schedule(static)
    for (int r = 0; r < s.R; r++)
        for (int c = 0; c < C; c++)
            s.x[(int64_t)r * C + c] = to_f32(wte[s.ids[r] * C + c]) + to_f32(wpe[s.pos[r] * C + c]);
}

extern "C" int gptlab_decode_step(const Model* mp, const Step* sp) {
    const Model& m = *mp;
    const Step& s = *sp;
    const int C = m.n_embd, R = s.R;
    for (int r = 0; r < R; r++)
        if (s.pos[r] < 0 || s.pos[r] >= s.max_len || s.pos[r] >= m.block_size || s.ids[r] < 0 || s.ids[r] >= m.vocab_size
            || (s.slot && (s.slot[r] < 0 || s.slot[r] >= s.cache_rows)) || (!s.slot && r >= s.cache_rows))
            return r + 1;  // the caller checks before calling; this guards memory, not the user
#pragma omp parallel num_threads(s.n_threads)
    {
        if (m.weights == BF16) embed<bf16>(m, s); else embed<float>(m, s);  // int8 models embed from fp32
        for (int l = 0; l < m.n_layer; l++) {
            const Layer& L = m.layers[l];
            layer_norm_rows(m, s.x, L.ln_1_w, L.ln_1_b, s.h, R);
            linear<STORE>(m, L.c_attn_w, L.c_attn_s, L.c_attn_sum, s.h, L.c_attn_b, s.qkv, R, 3 * C, C);
            float* scores = s.scores + (int64_t)omp_get_thread_num() * s.max_len;
            if (s.cache_bf16) store_new<bf16>(m, s, l); else store_new<float>(m, s, l);  // (a barrier after)
#pragma omp for schedule(static)
            for (int task = 0; task < R * m.n_head; task++) {
                if (s.cache_bf16) attend_any<bf16>(m, s, l, task / m.n_head, task % m.n_head, scores);
                else attend_any<float>(m, s, l, task / m.n_head, task % m.n_head, scores);
            }
            linear<ADD>(m, L.attn_proj_w, L.attn_proj_s, L.attn_proj_sum, s.att, L.attn_proj_b, s.x, R, C, C);
            layer_norm_rows(m, s.x, L.ln_2_w, L.ln_2_b, s.h, R);
            if (m.gelu_tanh) linear<GELU_TANH>(m, L.c_fc_w, L.c_fc_s, L.c_fc_sum, s.h, L.c_fc_b, s.fc, R, 4 * C, C);
            else linear<GELU_ERF>(m, L.c_fc_w, L.c_fc_s, L.c_fc_sum, s.h, L.c_fc_b, s.fc, R, 4 * C, C);
            linear<ADD>(m, L.mlp_proj_w, L.mlp_proj_s, L.mlp_proj_sum, s.fc, L.mlp_proj_b, s.x, R, C, 4 * C);
        }
        layer_norm_rows(m, s.x, m.ln_f_w, m.ln_f_b, s.h, R);
        linear<STORE>(m, m.lm_head, m.lm_head_s, m.lm_head_sum, s.h, nullptr, s.logits, R, m.vocab_size, C);
    }
    for (int r = 0; r < R; r++) s.pos[r] += 1;
    return 0;
}
