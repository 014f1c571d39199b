// The products that take an ISA's own dot-product instructions, kept out of the kernel's one source
// (gptlab/inference/csrc/decode.cpp, which includes this file after its epilogues, `finish<E>`, and its constants):
// bf16 by AVX512-BF16 (DotBF16, a "dot" type for decode.cpp's gemv templates, and to_bf16 for its x), int8 by
// AVX512-VNNI (gemv_vnni, over W packed in blocks of 16 rows) and int8 by ARM's dot product (gemv_sdot, over
// row-major W). Each is compiled only into the builds whose target has its instructions; every other build runs
// the widening products of simd.h. AVX2 has no such product worth taking: its byte multiply-add (vpmaddubsw)
// saturates at int16 and needs a vpmaddwd and an add after it, as many instructions per weight and row as the
// FMAs over widened weights, so x86-64-v3 widens.
#pragma once

// This thread's buffer TAG of at least `count` T's, for x rounded or quantized by each thread (all of X: R x K
// numbers, far fewer than the weights it then reads, and no barrier). It grows and never shrinks (no reallocation
// between the model's widths) and lives as long as the thread.
template <typename T, int TAG> static T* scratch(int64_t count) {
    static thread_local T* buffer = nullptr;
    static thread_local int64_t capacity = 0;
    if (capacity < count) {
        delete[] buffer;
        capacity = count;
        buffer = new T[capacity];
    }
    return buffer;
}

#ifdef __AVX512BF16__
// DotBF16: bf16 weights on a CPU with AVX512-BF16; x is rounded to bf16 too (as a bf16 model's activations are)
// and each vdpbf16ps does 32 multiply-adds into fp32 sums, half the instructions of widening W.
struct DotBF16 {
    using W = bf16;
    using X = bf16;
    using WV = __m512bh;
    using XV = __m512bh;
    using Mask = __mmask32;
    static constexpr int LANES = 32;
    static Mask tail(int left) { return left >= LANES ? (Mask)0xFFFFFFFFu : (Mask)((1u << left) - 1); }
    static WV w(const W* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static WV w(const W* p, Mask m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
    static XV x(const X* p) { return w(p); }
    static XV x(const X* p, Mask m) { return w(p, m); }
    static vf madd(vf acc, WV w, XV x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

#ifdef __AVX512BF16__
// X rounded to bf16 for DotBF16, into this thread's `scratch`.
static const bf16* to_bf16(const float* X, int64_t count) {
    bf16* xb = scratch<bf16, 0>(count);
    for (int64_t i = 0; i < count; i += 32) {
        int64_t left = count - i;
        __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        __mmask16 hi = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, X + i + 16), _mm512_maskz_loadu_ps(lo, X + i));
        _mm512_mask_storeu_epi16(xb + i, ((__mmask32)hi << 16) | lo, (__m512i)v);
    }
    return xb;
}
#endif

#ifdef __AVX512VNNI__
// int8 weights by VNNI. vpdpbusd multiplies unsigned bytes by signed bytes, 4 at a time into each of 16 int32
// sums. x keeps 16 bits (the weights are what int8 is about; x rounded to 8 bits per row, tried first, changed
// the greedy text of trained models about twice as often as the weights' own rounding): it is quantized per
// row to xq = round(x / sx), sx = max|x_row| / 32767, and split into two bytes, xq = 256 * hi + lo with lo in
// [0, 255] and hi in [-128, 127], stored as lo and hi + 128 (both unsigned). Two vpdpbusd per group of 4 inputs
// give sum(lo * q) and sum((hi + 128) * q) = sum(hi * q) + 128 * sum(q), so that
//     sum(xq * q) = 256 * (sum((hi + 128) * q) - 128 * sums[n]) + sum(lo * q)
// and each output is that times sx * s[n], plus b[n]. The two int32 sums are exact (|sum| < 2^31 up to
// K = 65,000); they are combined in fp32.
//
// W comes packed in blocks of 16 rows (gptlab/inference/fused.py, vnni_pack): for each group of 4 inputs k, the
// 16 rows' 4 weights each, 64 bytes, one vector: [n / 16][k / 4][n % 16][k % 4], rows and inputs padded with
// zeros to multiples of 16 and 4 (scales and sums padded likewise). One vpdpbusd then adds 4 inputs' products
// into the 16 outputs of a block, x's 4 bytes broadcast: no reduction across lanes at all, and W is read as one
// sequential stream. Row-major int8 rows (768 bytes in GPT-2) cost a reduction and a loop per row, which
// measured slower than the weights' bytes (the FMA product below is what a CPU without VNNI runs).
// The sums are exact integers and each row of x is quantized alone, so a row's logits are the same bit for bit
// whatever the rows beside it (the server's continuous batching relies on this).
struct QuantizedX {
    const uint8_t* q;  // (R, 2, KP): each row's hi + 128 bytes, then its lo bytes; KP = K rounded up to 64, the
                       // tail x = 0 (hi + 128 = 128, lo = 0; its weights are 0)
    const float* scale;  // (R,): sx
};

// X (R, K) quantized into this thread's `scratch` buffers. One constant both quantizes x and scales the sums back.
static QuantizedX quantize_x(const float* X, int R, int K, int KP) {
    constexpr float X16 = 32767.0f;  // x's largest magnitude in 16 bits
    uint8_t* xq = scratch<uint8_t, 1>((int64_t)R * 2 * KP);
    float* xs = scratch<float, 2>(R);
    for (int r = 0; r < R; r++) {
        const float* x = X + (int64_t)r * K;
        __m512 top = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)));
        }
        float amax = _mm512_reduce_max_ps(top);
        xs[r] = amax / X16;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? X16 / amax : 0.0f);
        const __m512i offset = _mm512_set1_epi32(128);
        uint8_t* hi = xq + (int64_t)r * 2 * KP;
        uint8_t* lo = hi + KP;
        for (int k = 0; k < KP; k += 16) {  // |x * inv| <= 32767: rounded to nearest even, split into two bytes
            const int left = K - k;
            __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv));
            __m512i high = _mm512_add_epi32(_mm512_srai_epi32(v, 8), offset);
            _mm_storeu_si128((__m128i*)(hi + k), _mm512_cvtepi32_epi8(high));
            _mm_storeu_si128((__m128i*)(lo + k), _mm512_cvtepi32_epi8(v));  // the low byte: xq - 256 * hi
        }
    }
    return {xq, xs};
}

// The 16 outputs n .. n + 15 of one row of x (those below n1), from its sums of (hi + 128) * q and lo * q:
// (256 * (hi - 128 * sums) + lo) * sx * s + b, then E.
template <int E>
static inline void finish16(float* y, __m512i hi, __m512i lo, float sx, const float* s, const int32_t* sums,
                            const float* b, int n, int n1) {
    const int count = n1 - n >= 16 ? 16 : n1 - n;
    const __mmask16 m = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
    __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(sums + n), 7);  // 128 * sums (padded to 16)
    __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, offset)), _mm512_set1_ps(256.0f),
                                 _mm512_cvtepi32_ps(lo));
    __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx), _mm512_loadu_ps(s + n));
    __m512 bias = b ? _mm512_maskz_loadu_ps(m, b + n) : _mm512_setzero_ps();
    __m512 d = _mm512_fmadd_ps(dot, scale, bias);
    if (E == STORE) { _mm512_mask_storeu_ps(y, m, d); return; }
    if (E == ADD) { _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), d)); return; }
    float v[16];
    _mm512_storeu_ps(v, d);
    for (int i = 0; i < count; i++) finish<E>(y + i, v[i]);
}

// RB rows of x against one block of 16 W rows: per row, a sum of the hi bytes' products and one of the lo bytes'
// (independent chains), the block's next bytes fetched STREAM_AHEAD ahead into L2.
#define DPX(j) if constexpr (RB > j) { int32_t h4, l4; const uint8_t* xj = xq + (int64_t)j * 2 * KP + 4 * g; \
                                       memcpy(&h4, xj, 4); memcpy(&l4, xj + KP, 4);                          \
                                       h##j = _mm512_dpbusd_epi32(h##j, _mm512_set1_epi32(h4), w);           \
                                       l##j = _mm512_dpbusd_epi32(l##j, _mm512_set1_epi32(l4), w); }
template <int E, int RB>
static void vnni_block(const int8_t* Wb, const uint8_t* xq, const float* xs, const float* s, const int32_t* sums,
                       const float* b, float* Y, int N, int KG, int KP, int n, int n1) {
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
    for (int g = 0; g < KG; g++) {
        _mm_prefetch((const char*)(Wb + (int64_t)g * 64) + STREAM_AHEAD, _MM_HINT_T1);
        __m512i w = _mm512_loadu_si512(Wb + (int64_t)g * 64);
        DPX(0) DPX(1) DPX(2) DPX(3)
    }
    finish16<E>(Y + n, h0, l0, xs[0], s, sums, b, n, n1);
    if constexpr (RB > 1) finish16<E>(Y + N + n, h1, l1, xs[1], s, sums, b, n, n1);
    if constexpr (RB > 2) finish16<E>(Y + 2 * (int64_t)N + n, h2, l2, xs[2], s, sums, b, n, n1);
    if constexpr (RB > 3) finish16<E>(Y + 3 * (int64_t)N + n, h3, l3, xs[3], s, sums, b, n, n1);
}
#undef DPX

// Y (R, N) from X (R, K) and the packed W: this thread's share [n0, n1) of the outputs (n0 a multiple of 16).
template <int E>
static void gemv_vnni(const int8_t* W, const float* X, const float* s, const int32_t* sums, const float* b, float* Y,
                      int R, int N, int K, int n0, int n1) {
    const int KP = (K + 63) / 64 * 64, KG = (K + 3) / 4;
    QuantizedX x = quantize_x(X, R, K, KP);
    for (int n = n0; n < n1; n += 16) {
        const int8_t* Wb = W + (int64_t)(n / 16) * KG * 64;
        for (int r = 0; r < R; r += 4) {  // a block (16 x K bytes) is read from memory once, then from L1
            const uint8_t* xq = x.q + (int64_t)r * 2 * KP;
            float* y = Y + (int64_t)r * N;
            switch (R - r >= 4 ? 4 : R - r) {
                case 4: vnni_block<E, 4>(Wb, xq, x.scale + r, s, sums, b, y, N, KG, KP, n, n1); break;
                case 3: vnni_block<E, 3>(Wb, xq, x.scale + r, s, sums, b, y, N, KG, KP, n, n1); break;
                case 2: vnni_block<E, 2>(Wb, xq, x.scale + r, s, sums, b, y, N, KG, KP, n, n1); break;
                default: vnni_block<E, 1>(Wb, xq, x.scale + r, s, sums, b, y, N, KG, KP, n, n1); break;
            }
        }
    }
}
#endif

#if defined(GPTLAB_SIMD_NEON) && defined(__ARM_FEATURE_DOTPROD)
// int8 weights by ARM's dot product (armv8.2-a+dotprod builds): sdot multiplies 16 signed bytes by 16 signed
// bytes, 4 at a time into each of 4 int32 sums, four times the multiply-adds of an fp32 FMA. x keeps 15 bits (as
// VNNI keeps 16, and for the same reason): quantized per row to xq = round(x / sx), sx = max|x_row| / 16383, and
// split into two signed bytes, xq = 128 * hi + lo with hi in [-128, 127] and lo in [0, 127]; two sdot per 16
// inputs give sum(hi * q) and sum(lo * q), and each output is (128 * sum(hi * q) + sum(lo * q)) * sx * s[n] + b[n].
// The int32 sums are exact (|sum(hi * q)| <= 128 * 127 * K: no overflow below K = 130,000) and combined in double.
// W stays row-major (the FMA product's layout): one row of W is read once for every row of x, in groups of four,
// while it sits in L1. Each row of x is quantized alone, so a row's logits do not depend on the rows beside it.
// X (R, K) quantized into this thread's `scratch` buffers: (R, 2, KP) bytes, each row's hi then its lo, and R
// scales sx. One constant both quantizes x and scales the sums back.
static const int8_t* quantize_x_sdot(const float* X, int R, int K, int KP, float* xs) {
    constexpr float X15 = 16383.0f;  // x's largest magnitude in 15 bits
    int8_t* xq = scratch<int8_t, 3>((int64_t)R * 2 * KP);
    for (int r = 0; r < R; r++) {
        const float* x = X + (int64_t)r * K;
        float amax = 0.0f;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
        xs[r] = amax / X15;
        const float inv = amax > 0.0f ? X15 / amax : 0.0f;
        int8_t* hi = xq + (int64_t)r * 2 * KP;
        int8_t* lo = hi + KP;
        for (int k = 0; k < KP; k++) {  // |x * inv| <= 16383, rounded to nearest even; the tail past K is 0
            const int32_t q = k < K ? (int32_t)lrintf(x[k] * inv) : 0;
            hi[k] = (int8_t)(q >> 7);  // arithmetic shift: floor(q / 128)
            lo[k] = (int8_t)(q & 127);
        }
    }
    return xq;
}

// RB (1-4) rows of x against row n of W: for each row of x a sum of the hi bytes' products and one of the lo
// bytes', each over two independent chains (even and odd groups of 16 inputs).
#define SDOT(j, A, w, k) if constexpr (RB > j) {                                                     \
        h##j##A = vdotq_s32(h##j##A, w, vld1q_s8(xq + (int64_t)j * 2 * KP + (k)));                   \
        l##j##A = vdotq_s32(l##j##A, w, vld1q_s8(xq + (int64_t)j * 2 * KP + KP + (k))); }
#define SDOTS(A, w, k) SDOT(0, A, w, k) SDOT(1, A, w, k) SDOT(2, A, w, k) SDOT(3, A, w, k)
#define SOUT(j) if constexpr (RB > j) {                                                              \
        const double d = 128.0 * vaddvq_s32(vaddq_s32(h##j##a, h##j##b)) + vaddvq_s32(vaddq_s32(l##j##a, l##j##b)); \
        finish<E>(Y + (int64_t)j * N + n, (float)d * xs[j] * s[n] + (b ? b[n] : 0.0f)); }
template <int E, int RB>
static void sdot_rows(const int8_t* w, const int8_t* xq, const float* xs, const float* s, const float* b, float* Y,
                      int N, int K, int KP, int n) {
    const int32x4_t z = vdupq_n_s32(0);
    int32x4_t h0a = z, h0b = z, h1a = z, h1b = z, h2a = z, h2b = z, h3a = z, h3b = z;
    int32x4_t l0a = z, l0b = z, l1a = z, l1b = z, l2a = z, l2b = z, l3a = z, l3b = z;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (k % 64 == 0) simd::fetch_near(w + K + k);  // the next row, into L1
        const int8x16_t w0 = vld1q_s8(w + k), w1 = vld1q_s8(w + k + 16);
        SDOTS(a, w0, k) SDOTS(b, w1, k + 16)
    }
    for (; k < K; k += 16) {  // the last 1-31 inputs; past K, x's bytes are 0 and W's are not read
        int8_t tail[16] = {0};
        memcpy(tail, w + k, K - k >= 16 ? 16 : K - k);
        const int8x16_t wt = vld1q_s8(tail);
        SDOTS(a, wt, k)
    }
    SOUT(0) SOUT(1) SOUT(2) SOUT(3)
}
#undef SDOT
#undef SDOTS
#undef SOUT

// Y (R, N) from X (R, K) and row-major int8 W: this thread's share [n0, n1) of the outputs.
template <int E>
static void gemv_sdot(const int8_t* W, const float* X, const float* s, const float* b, float* Y, int R, int N, int K,
                      int n0, int n1) {
    const int KP = (K + 15) / 16 * 16;
    float* xs = scratch<float, 4>(R);
    const int8_t* xq = quantize_x_sdot(X, R, K, KP, xs);
    for (int n = n0; n < n1; n++) {
        const int8_t* w = W + (int64_t)n * K;
        for (int r = 0; r < R; r += 4) {
            const int8_t* q = xq + (int64_t)r * 2 * KP;
            float* y = Y + (int64_t)r * N;
            switch (R - r >= 4 ? 4 : R - r) {
                case 4: sdot_rows<E, 4>(w, q, xs + r, s, b, y, N, K, KP, n); break;
                case 3: sdot_rows<E, 3>(w, q, xs + r, s, b, y, N, K, KP, n); break;
                case 2: sdot_rows<E, 2>(w, q, xs + r, s, b, y, N, K, KP, n); break;
                default: sdot_rows<E, 1>(w, q, xs + r, s, b, y, N, K, KP, n); break;
            }
        }
    }
}
#endif
