// One decode step of a GPT-2 decoder on a CPU with AVX-512: every row (prompt) brings one new token; this runs
// the whole model for it in one call, so no interpreter sits between the weights and the memory bus.
//
// Why: decoding one token reads every weight once, so memory bandwidth sets its speed. Each op launched from
// Python costs microseconds, a 12-layer model launches hundreds per token, and the library kernels for one row
// (GEMV) stop well short of the bus (docs/benchmarks.md). Here the products stream each weight row once, for all
// rows of the batch at a time, and the small work (LayerNorm, attention over the cache, GELU, residual adds) is
// fused around them. Activations are fp32; weights fp32 or bf16 (widened to fp32 as they are loaded).
//
// The math is the model's (gptlab/model.py), step by step; tests/test_fastdecode.py holds it to the torch path.
// Layout of the KV cache: k, v (n_layer, R, n_head, max_len, head_dim) fp32 or bf16, as gptlab.model.KVCache.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

typedef uint16_t bf16;

// Batched products fetch W this many rows ahead into L2: the hardware prefetcher alone lags, and into L1 the
// fetches evicted x (measured: 1.4x slower).
constexpr int AHEAD = 4;
// A single row of x streams W in order, fetched this many bytes ahead into L2.
constexpr int STREAM_AHEAD = 4096;

struct Layer {  // weights (out, in) as nn.Linear stores them, in the model's dtype; vectors fp32, NULL if absent
    const void *c_attn_w, *attn_proj_w, *c_fc_w, *mlp_proj_w;
    const float *ln_1_w, *ln_1_b, *c_attn_b, *attn_proj_b, *ln_2_w, *ln_2_b, *c_fc_b, *mlp_proj_b;
};

struct Model {
    int n_layer, n_head, head_dim, n_embd, vocab_size, block_size, bf16_weights, gelu_tanh;
    float eps;
    const void *wte, *wpe, *lm_head;  // (V, C), (block_size, C), (V, C)
    const float *ln_f_w, *ln_f_b;
    const Layer* layers;
};

struct Step {  // R rows, each one new token at its own position
    int R, max_len, n_threads, cache_bf16;
    const int64_t* ids;  // (R,)
    int64_t* pos;        // (R,): positions filled so far; the new token goes to pos[r], then pos[r] += 1
    void *k, *v;         // caches, fp32 or bf16
    float *x, *h, *qkv, *att, *fc, *logits, *scores;  // scratch (R*C, R*C, R*3C, R*C, R*4C), out (R*V), T*max_len
};

// ---- loading weights as fp32 vectors of 16 ----
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const bf16* p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

// One row: four independent sums along k, one sequential stream through W's row.
template <int E, typename WT>
static void gemv_row1(const WT* W, const float* x, const float* b, float* y, int K, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const WT* w = W + (int64_t)n * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int k = 0;
        for (; k + 64 <= K; k += 64) {
            for (int line = 0; line < 64 * (int)sizeof(WT); line += 64)  // 4 KB ahead, into L2: measured 5% faster
                _mm_prefetch((const char*)(w + k) + STREAM_AHEAD + line, _MM_HINT_T1);
            a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
            a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
            a2 = _mm512_fmadd_ps(load16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
            a3 = _mm512_fmadd_ps(load16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
        }
        for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
        if (k < K) {
            __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
            a0 = _mm512_fmadd_ps(load16(w + k, m), _mm512_maskz_loadu_ps(m, x + k), a0);
        }
        float d = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        finish<E>(y + n, d + (b ? b[n] : 0.0f));
    }
}

// RB rows of x against one row of W at a time: one sequential stream through W, each vector used RB times (two
// interleaved streams, or a weight tile, measured slower here). The sums are named variables, not an array: GCC
// keeps such an array on the stack and stores it every iteration.
#define FMA(j, M) if constexpr (RB > j) a##j = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(M, X + (int64_t)j * K + k), a##j);
#define FMAS(M) FMA(0, M) FMA(1, M) FMA(2, M) FMA(3, M) FMA(4, M) FMA(5, M) FMA(6, M) FMA(7, M)
#define OUT(j) if constexpr (RB > j) finish<E>(Y + (int64_t)j * N + n, _mm512_reduce_add_ps(a##j) + bias);
template <int E, int RB, typename WT>
static void gemv_rows(const WT* W, const float* X, const float* b, float* Y, int N, int K, int n0, int n1) {
    const __mmask16 all = 0xFFFF;
    for (int n = n0; n < n1; n++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const WT* r = W + (int64_t)n * K;
        for (int k = 0; k < K; k += 16) {
            __mmask16 m = K - k >= 16 ? all : (__mmask16)((1u << (K - k)) - 1);
            _mm_prefetch((const char*)(r + K + k), _MM_HINT_T0);  // the next row: the prefetcher lags at this pace
            __m512 w = load16(r + k, m);
            FMAS(m)
        }
        float bias = b ? b[n] : 0.0f;
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7)
    }
}
#undef FMA
#undef FMAS

// Four or more rows of x: two rows of W at a time, each x vector loaded once for both, fewer loads per
// multiply-add (measured faster than one row at a time here, and slower for two rows of x).
#define ACC(j) __m512 a##j = _mm512_setzero_ps(), b##j = a##j;
#define FMA2(j, M, OFF) if constexpr (RB > j) { \
        __m512 xv = _mm512_maskz_loadu_ps(M, X + (int64_t)j * K + k + OFF); \
        a##j = _mm512_fmadd_ps(w0, xv, a##j); b##j = _mm512_fmadd_ps(w1, xv, b##j); }
#define FMAS2(M, OFF) FMA2(0, M, OFF) FMA2(1, M, OFF) FMA2(2, M, OFF) FMA2(3, M, OFF) \
                      FMA2(4, M, OFF) FMA2(5, M, OFF) FMA2(6, M, OFF) FMA2(7, M, OFF)
#define OUT2(j) if constexpr (RB > j) { finish<E>(Y + (int64_t)j * N + n, _mm512_reduce_add_ps(a##j) + bias0); \
                                        if (!one) finish<E>(Y + (int64_t)j * N + n + 1, _mm512_reduce_add_ps(b##j) + bias1); }
template <int E, int RB, typename WT>
static void gemv_pair(const WT* W, const float* X, const float* b, float* Y, int N, int K, int n, bool one) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    const WT *r0 = W + (int64_t)n * K, *r1 = one ? r0 : r0 + K;
    const __mmask16 all = 0xFFFF;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        {
            for (int line = 0; line < 32 * (int)sizeof(WT); line += 64) {
                _mm_prefetch((const char*)(r0 + AHEAD * K + k) + line, _MM_HINT_T1);
                _mm_prefetch((const char*)(r1 + AHEAD * K + k) + line, _MM_HINT_T1);
            }
        }
        __m512 w0 = load16(r0 + k), w1 = load16(r1 + k);
        FMAS2(all, 0)
        w0 = load16(r0 + k + 16), w1 = load16(r1 + k + 16);
        FMAS2(all, 16)
    }
    for (; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? all : (__mmask16)((1u << (K - k)) - 1);
        __m512 w0 = load16(r0 + k, m), w1 = load16(r1 + k, m);
        FMAS2(m, 0)
    }
    float bias0 = b ? b[n] : 0.0f, bias1 = b && !one ? b[n + 1] : 0.0f;
    OUT2(0) OUT2(1) OUT2(2) OUT2(3) OUT2(4) OUT2(5) OUT2(6) OUT2(7)
}
#undef ACC
#undef FMA2
#undef FMAS2
#undef OUT2

template <int E, int RB, typename WT>
static void gemv_pairs(const WT* W, const float* X, const float* b, float* Y, int N, int K, int n0, int n1) {
    int n = n0;
    for (; n + 2 <= n1; n += 2) gemv_pair<E, RB>(W, X, b, Y, N, K, n, false);
    if (n < n1) gemv_pair<E, RB>(W, X, b, Y, N, K, n, true);
}

#ifdef __AVX512BF16__
// bf16 weights on a CPU with AVX512-BF16: x is rounded to bf16 too (as a bf16 model's activations are) and each
// vdpbf16ps does 32 multiply-adds into fp32 sums, half the instructions of widening W: batches stay memory-bound.
static inline __m512bh bf16x32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh bf16x32(const bf16* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

template <int E>
static void gemv_dp_row1(const bf16* W, const bf16* x, const float* b, float* y, int K, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const bf16* w = W + (int64_t)n * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int k = 0;
        for (; k + 128 <= K; k += 128) {
            for (int line = 0; line < 256; line += 64)
                _mm_prefetch((const char*)(w + k) + STREAM_AHEAD + line, _MM_HINT_T1);
            a0 = _mm512_dpbf16_ps(a0, bf16x32(w + k), bf16x32(x + k));
            a1 = _mm512_dpbf16_ps(a1, bf16x32(w + k + 32), bf16x32(x + k + 32));
            a2 = _mm512_dpbf16_ps(a2, bf16x32(w + k + 64), bf16x32(x + k + 64));
            a3 = _mm512_dpbf16_ps(a3, bf16x32(w + k + 96), bf16x32(x + k + 96));
        }
        for (; k < K; k += 32) {
            __mmask32 m = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
            a0 = _mm512_dpbf16_ps(a0, bf16x32(w + k, m), bf16x32(x + k, m));
        }
        float d = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        finish<E>(y + n, d + (b ? b[n] : 0.0f));
    }
}

#define DP(j, M) if constexpr (RB > j) a##j = _mm512_dpbf16_ps(a##j, w, bf16x32(X + (int64_t)j * K + k, M));
#define DPS(M) DP(0, M) DP(1, M) DP(2, M) DP(3, M) DP(4, M) DP(5, M) DP(6, M) DP(7, M)
// RB rows of x against one row of W at a time: one sequential stream through W, each vector used RB times.
template <int E, int RB>
static void gemv_dp_rows(const bf16* W, const bf16* X, const float* b, float* Y, int N, int K, int n0, int n1) {
    const __mmask32 all = 0xFFFFFFFFu;
    for (int n = n0; n < n1; n++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const bf16* r = W + (int64_t)n * K;
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            _mm_prefetch((const char*)(r + K + k), _MM_HINT_T0);  // the next row
            __m512bh w = bf16x32(r + k);
            DPS(all)
        }
        if (k < K) {
            __mmask32 m = (__mmask32)((1u << (K - k)) - 1);
            __m512bh w = bf16x32(r + k, m);
            DPS(m)
        }
        float bias = b ? b[n] : 0.0f;
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7)
    }
}
#undef DP
#undef DPS

#define ACC(j) __m512 a##j = _mm512_setzero_ps(), b##j = a##j;
#define DP2(j, M) if constexpr (RB > j) { __m512bh xv = bf16x32(X + (int64_t)j * K + k, M); \
                      a##j = _mm512_dpbf16_ps(a##j, w0, xv); b##j = _mm512_dpbf16_ps(b##j, w1, xv); }
#define DPS2(M) DP2(0, M) DP2(1, M) DP2(2, M) DP2(3, M) DP2(4, M) DP2(5, M) DP2(6, M) DP2(7, M)
#define OUT2(j) if constexpr (RB > j) { finish<E>(Y + (int64_t)j * N + n, _mm512_reduce_add_ps(a##j) + bias0); \
                                        if (!one) finish<E>(Y + (int64_t)j * N + n + 1, _mm512_reduce_add_ps(b##j) + bias1); }
template <int E, int RB>
static void gemv_dp_pair(const bf16* W, const bf16* X, const float* b, float* Y, int N, int K, int n, bool one) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    const bf16 *r0 = W + (int64_t)n * K, *r1 = one ? r0 : r0 + K;
    const __mmask32 all = 0xFFFFFFFFu;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char*)(r0 + AHEAD * K + k), _MM_HINT_T1);
        _mm_prefetch((const char*)(r1 + AHEAD * K + k), _MM_HINT_T1);
        __m512bh w0 = bf16x32(r0 + k), w1 = bf16x32(r1 + k);
        DPS2(all)
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1u << (K - k)) - 1);
        __m512bh w0 = bf16x32(r0 + k, m), w1 = bf16x32(r1 + k, m);
        DPS2(m)
    }
    float bias0 = b ? b[n] : 0.0f, bias1 = b && !one ? b[n + 1] : 0.0f;
    OUT2(0) OUT2(1) OUT2(2) OUT2(3) OUT2(4) OUT2(5) OUT2(6) OUT2(7)
}
#undef ACC
#undef DP2
#undef DPS2
#undef OUT2

template <int E, int RB>
static void gemv_dp_pairs(const bf16* W, const bf16* X, const float* b, float* Y, int N, int K, int n0, int n1) {
    int n = n0;
    for (; n + 2 <= n1; n += 2) gemv_dp_pair<E, RB>(W, X, b, Y, N, K, n, false);
    if (n < n1) gemv_dp_pair<E, RB>(W, X, b, Y, N, K, n, true);
}

template <int E>
static void gemv_dp(const bf16* W, const float* X, const float* b, float* Y, int R, int N, int K, int n0, int n1) {
    static thread_local bf16* xb = nullptr;  // this thread's bf16 copy of X, grown as needed
    static thread_local int64_t capacity = 0;
    if (capacity < (int64_t)R * K) {
        delete[] xb;
        capacity = (int64_t)R * K;
        xb = new bf16[capacity];
    }
    for (int64_t i = 0; i < (int64_t)R * K; i += 32) {
        int64_t left = (int64_t)R * K - i;
        __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        __mmask16 hi = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, X + i + 16), _mm512_maskz_loadu_ps(lo, X + i));
        _mm512_mask_storeu_epi16(xb + i, ((__mmask32)hi << 16) | lo, (__m512i)v);
    }
    if (R == 1) { gemv_dp_row1<E>(W, xb, b, Y, K, n0, n1); return; }
    for (int r = 0; r < R;) {
        const bf16* x = xb + (int64_t)r * K;
        float* y = Y + (int64_t)r * N;
        int left = R - r;
        if (left >= 8) { gemv_dp_pairs<E, 8>(W, x, b, y, N, K, n0, n1); r += 8; }
        else if (left >= 4) { gemv_dp_pairs<E, 4>(W, x, b, y, N, K, n0, n1); r += 4; }
        else if (left >= 2) { gemv_dp_rows<E, 2>(W, x, b, y, N, K, n0, n1); r += 2; }
        else { gemv_dp_rows<E, 1>(W, x, b, y, N, K, n0, n1); r += 1; }
    }
}
#endif
#undef OUT

// Y (R, N) from X (R, K) and W (N, K): this thread's share [n0, n1) of the outputs, every row.
template <int E, typename WT>
static void gemv(const WT* W, const float* X, const float* b, float* Y, int R, int N, int K, int n0, int n1) {
    if (R == 1) { gemv_row1<E>(W, X, b, Y, K, n0, n1); return; }
    for (int r = 0; r < R;) {
        const float* x = X + (int64_t)r * K;
        float* y = Y + (int64_t)r * N;
        int left = R - r;
        if (left >= 8) { gemv_pairs<E, 8>(W, x, b, y, N, K, n0, n1); r += 8; }
        else if (left >= 4) { gemv_pairs<E, 4>(W, x, b, y, N, K, n0, n1); r += 4; }
        else if (left >= 2) { gemv_rows<E, 2>(W, x, b, y, N, K, n0, n1); r += 2; }
        else { gemv_rows<E, 1>(W, x, b, y, N, K, n0, n1); r += 1; }
    }
}

template <int E>
static void linear(const Model& m, const void* W, const float* X, const float* b, float* Y, int R, int N, int K) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int per = (N + T - 1) / T;
    int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
    if (n0 < n1) {
#ifdef __AVX512BF16__
        if (m.bf16_weights) gemv_dp<E>((const bf16*)W, X, b, Y, R, N, K, n0, n1);
#else
        if (m.bf16_weights) gemv<E>((const bf16*)W, X, b, Y, R, N, K, n0, n1);
#endif
        else gemv<E>((const float*)W, X, b, Y, R, N, K, n0, n1);
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

// e^x for 16 numbers: 2^(x log2 e) = 2^n * 2^f, |f| <= 1/2, 2^f by its Taylor polynomial to degree 6 (relative
// error ~1e-7), 2^n by vscalefps. Inputs here are <= 0 (scores minus their maximum).
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.540353039e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355815e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129108e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265070e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471806e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// softmax(q K^T / sqrt(D)) V over positions 0..pos of one row and head, after storing this step's k and v.
// DC = ceil(D / 16) vectors hold q and the output in registers (D = 64 in every GPT-2: DC = 4).
template <typename CT, int DC>
static void attend(const Model& m, const Step& s, int l, int r, int hh, float* scores) {
    const int C = m.n_embd, D = m.head_dim, H = m.n_head;
    const float* qkv = s.qkv + (int64_t)r * 3 * C;
    const float *q = qkv + hh * D, *k_new = qkv + C + hh * D, *v_new = qkv + 2 * C + hh * D;
    int64_t base = ((((int64_t)l * s.R + r) * H + hh) * s.max_len) * D;  // [l, r, hh, 0, 0]
    CT *K = (CT*)s.k + base, *V = (CT*)s.v + base;
    int64_t p = s.pos[r];
    for (int d = 0; d < D; d++) { store(K + p * D + d, k_new[d]); store(V + p * D + d, v_new[d]); }
    __mmask16 mask[DC];
    __m512 qv[DC], y[DC];
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)D));
    for (int c = 0; c < DC; c++) {
        int left = D - 16 * c;
        mask[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask[c], q + 16 * c), scale);
        y[c] = _mm512_setzero_ps();
    }
    float top = -INFINITY;
    for (int64_t j = 0; j <= p; j++) {
        __m512 acc = _mm512_mul_ps(qv[0], load16(K + j * D, mask[0]));
        for (int c = 1; c < DC; c++) acc = _mm512_fmadd_ps(qv[c], load16(K + j * D + 16 * c, mask[c]), acc);
        scores[j] = _mm512_reduce_add_ps(acc);
        top = scores[j] > top ? scores[j] : top;
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j <= p; j += 16) {
        __mmask16 m16 = p + 1 - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (p + 1 - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m16, scores + j), _mm512_set1_ps(top)));
        e = _mm512_maskz_mov_ps(m16, e);
        _mm512_mask_storeu_ps(scores + j, m16, e);
        total = _mm512_add_ps(total, e);
    }
    for (int64_t j = 0; j <= p; j++) {
        __m512 w = _mm512_set1_ps(scores[j]);
        for (int c = 0; c < DC; c++) y[c] = _mm512_fmadd_ps(w, load16(V + j * D + 16 * c, mask[c]), y[c]);
    }
    const __m512 norm = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    float* out = s.att + (int64_t)r * C + hh * D;
    for (int c = 0; c < DC; c++) _mm512_mask_storeu_ps(out + 16 * c, mask[c], _mm512_mul_ps(y[c], norm));
}

template <typename CT>
static void attend_any(const Model& m, const Step& s, int l, int r, int hh, float* scores) {
    switch ((m.head_dim + 15) / 16) {  // head_dim <= 256, checked by the caller
        case 1: attend<CT, 1>(m, s, l, r, hh, scores); break;
        case 2: attend<CT, 2>(m, s, l, r, hh, scores); break;
        case 3: attend<CT, 3>(m, s, l, r, hh, scores); break;
        case 4: attend<CT, 4>(m, s, l, r, hh, scores); break;
        case 5: attend<CT, 5>(m, s, l, r, hh, scores); break;
        case 6: attend<CT, 6>(m, s, l, r, hh, scores); break;
        case 7: attend<CT, 7>(m, s, l, r, hh, scores); break;
        case 8: attend<CT, 8>(m, s, l, r, hh, scores); break;
        case 9: case 10: case 11: case 12: attend<CT, 12>(m, s, l, r, hh, scores); break;
        default: attend<CT, 16>(m, s, l, r, hh, scores); break;
    }
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
        if (s.pos[r] < 0 || s.pos[r] >= s.max_len || s.pos[r] >= m.block_size || s.ids[r] < 0 || s.ids[r] >= m.vocab_size)
            return r + 1;  // the caller checks before calling; this guards memory, not the user
#pragma omp parallel num_threads(s.n_threads)
    {
        if (m.bf16_weights) embed<bf16>(m, s); else embed<float>(m, s);
        for (int l = 0; l < m.n_layer; l++) {
            const Layer& L = m.layers[l];
            layer_norm_rows(m, s.x, L.ln_1_w, L.ln_1_b, s.h, R);
            linear<STORE>(m, L.c_attn_w, s.h, L.c_attn_b, s.qkv, R, 3 * C, C);
            float* scores = s.scores + (int64_t)omp_get_thread_num() * s.max_len;
#pragma omp for schedule(static)
            for (int task = 0; task < R * m.n_head; task++) {
                if (s.cache_bf16) attend_any<bf16>(m, s, l, task / m.n_head, task % m.n_head, scores);
                else attend_any<float>(m, s, l, task / m.n_head, task % m.n_head, scores);
            }
            linear<ADD>(m, L.attn_proj_w, s.att, L.attn_proj_b, s.x, R, C, C);
            layer_norm_rows(m, s.x, L.ln_2_w, L.ln_2_b, s.h, R);
            if (m.gelu_tanh) linear<GELU_TANH>(m, L.c_fc_w, s.h, L.c_fc_b, s.fc, R, 4 * C, C);
            else linear<GELU_ERF>(m, L.c_fc_w, s.h, L.c_fc_b, s.fc, R, 4 * C, C);
            linear<ADD>(m, L.mlp_proj_w, s.fc, L.mlp_proj_b, s.x, R, C, 4 * C);
        }
        layer_norm_rows(m, s.x, m.ln_f_w, m.ln_f_b, s.h, R);
        linear<STORE>(m, m.lm_head, s.h, nullptr, s.logits, R, m.vocab_size, C);
    }
    for (int r = 0; r < R; r++) s.pos[r] += 1;
    return 0;
}
