// The vector layer of the native decode step (gptlab/inference/csrc/decode.cpp): one source for every CPU.
//
// The kernel is written once over `vf`, a vector of LANES floats, and the few operations below. Each build names
// its target explicitly (gptlab/inference/native.py: BUILDS), never -march=native, and this header picks the
// instructions from what that target defines:
//   AVX-512 (x86-64-v4)     vf = __m512, 16 lanes, tails by masked loads and stores
//   AVX2 + FMA (x86-64-v3)  vf = __m256, 8 lanes
//   NEON (any ARM64)        vf = float32x4_t, 4 lanes
//   anything else           vf = a compiler vector of 8 floats (GCC and Clang lower it to what the target has)
// Arithmetic (+, -, *) is the compiler's vector arithmetic on every target; what differs per instruction set is
// here: loads that widen bf16 and int8 weights to fp32, fused multiply-adds, horizontal sums, maxima, e^x and
// loads and stores of a partial vector (a row's tail). The products that only one instruction set has (AVX512-BF16
// dot products, AVX512-VNNI byte products) stay in decode.cpp behind their target's macro.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GPTLAB_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define GPTLAB_SIMD_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define GPTLAB_SIMD_NEON 1
#include <arm_neon.h>
#else
#define GPTLAB_SIMD_GENERIC 1
#endif

typedef uint16_t bf16;

namespace simd {

#if defined(GPTLAB_SIMD_AVX512)
constexpr int LANES = 16;
constexpr const char* NAME = "avx512";
typedef __m512 vf;
#elif defined(GPTLAB_SIMD_AVX2)
constexpr int LANES = 8;
constexpr const char* NAME = "avx2";
typedef __m256 vf;
#elif defined(GPTLAB_SIMD_NEON)
constexpr int LANES = 4;
constexpr const char* NAME = "neon";
typedef float32x4_t vf;
#else
constexpr int LANES = 8;
constexpr const char* NAME = "generic";
typedef float vf __attribute__((vector_size(32)));
#endif

// ---- whole vectors ----
static inline vf zero() { return vf{} ; }
static inline vf set1(float a) {  // a in every lane (a broadcast: no addition, which would turn -0 into +0)
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_set1_ps(a);
#elif defined(GPTLAB_SIMD_AVX2)
    return _mm256_set1_ps(a);
#elif defined(GPTLAB_SIMD_NEON)
    return vdupq_n_f32(a);
#else
    vf v;
    for (int i = 0; i < LANES; i++) v[i] = a;
    return v;
#endif
}

static inline vf load(const float* p) {
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_loadu_ps(p);
#elif defined(GPTLAB_SIMD_AVX2)
    return _mm256_loadu_ps(p);
#elif defined(GPTLAB_SIMD_NEON)
    return vld1q_f32(p);
#else
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
#endif
}

// bf16 widened to fp32: the 16 bits become the top half of the float (exact)
static inline vf load(const bf16* p) {
#if defined(GPTLAB_SIMD_AVX512)
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(GPTLAB_SIMD_AVX2)
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#elif defined(GPTLAB_SIMD_NEON)
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
#else
    uint32_t u[LANES];
    for (int i = 0; i < LANES; i++) u[i] = (uint32_t)p[i] << 16;
    vf v;
    memcpy(&v, u, sizeof(v));
    return v;
#endif
}

// int8 sign-extended and converted to fp32 (exact: |q| <= 127); the row's scale is applied to the finished sum
static inline vf load(const int8_t* p) {
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(GPTLAB_SIMD_AVX2)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#elif defined(GPTLAB_SIMD_NEON)
    int32_t four;
    memcpy(&four, p, 4);
    int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
#else
    float f[LANES];
    for (int i = 0; i < LANES; i++) f[i] = (float)p[i];
    vf v;
    memcpy(&v, f, sizeof(v));
    return v;
#endif
}

static inline void store(float* p, vf v) {
#if defined(GPTLAB_SIMD_AVX512)
    _mm512_storeu_ps(p, v);
#elif defined(GPTLAB_SIMD_AVX2)
    _mm256_storeu_ps(p, v);
#elif defined(GPTLAB_SIMD_NEON)
    vst1q_f32(p, v);
#else
    memcpy(p, &v, sizeof(v));
#endif
}

// ---- partial vectors: the first n lanes (0 <= n <= LANES) from memory, the others `fill` ----
#if defined(GPTLAB_SIMD_AVX512)
static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline vf load(const float* p, int n, float fill = 0.0f) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p);
}
static inline vf load(const bf16* p, int n) {
    __m256i h = _mm256_maskz_loadu_epi16(first(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf load(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), p)));
}
static inline void store(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
// v's first n lanes, the others 0
static inline vf keep(vf v, int n) { return _mm512_maskz_mov_ps(first(n), v); }
#else
template <typename T> static inline vf load(const T* p, int n, T fill = T()) {
    if (n >= LANES) return load(p);
    T part[LANES];
    for (int i = 0; i < LANES; i++) part[i] = i < n ? p[i] : fill;
    return load(part);
}
static inline void store(float* p, vf v, int n) {
    if (n >= LANES) { store(p, v); return; }
    float part[LANES];
    store(part, v);
    for (int i = 0; i < n; i++) p[i] = part[i];
}
static inline vf keep(vf v, int n) {
    if (n >= LANES) return v;
    float part[LANES];
    store(part, v);
    for (int i = n; i < LANES; i++) part[i] = 0.0f;
    return load(part);
}
#endif

// ---- arithmetic ----
static inline vf fma(vf a, vf b, vf acc) {  // a * b + acc, one rounding where the target has FMA
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_fmadd_ps(a, b, acc);
#elif defined(GPTLAB_SIMD_AVX2)
    return _mm256_fmadd_ps(a, b, acc);
#elif defined(GPTLAB_SIMD_NEON)
    return vfmaq_f32(acc, a, b);
#else
    return a * b + acc;
#endif
}

static inline vf max(vf a, vf b) {
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_max_ps(a, b);
#elif defined(GPTLAB_SIMD_AVX2)
    return _mm256_max_ps(a, b);
#elif defined(GPTLAB_SIMD_NEON)
    return vmaxq_f32(a, b);
#else
    return a > b ? a : b;
#endif
}

// The sum of v's lanes: on AVX-512 _mm512_reduce_add_ps's order (halves, then quarters, ...); elsewhere halves
// likewise, down to one lane.
static inline float sum(vf v) {
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_reduce_add_ps(v);
#elif defined(GPTLAB_SIMD_AVX2)
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#elif defined(GPTLAB_SIMD_NEON)
    float32x2_t h = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
#else
    float part[LANES];
    store(part, v);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) part[i] += part[i + w];
    return part[0];
#endif
}

static inline float max_of(vf v) {
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_reduce_max_ps(v);
#else
    float part[LANES];
    store(part, v);
    float m = part[0];
    for (int i = 1; i < LANES; i++) m = part[i] > m ? part[i] : m;
    return m;
#endif
}

// The sums of four vectors into out[0..3], each added as sum() adds it (so a position scored four at a time gets
// the number it gets alone).
static inline void sum4(vf a0, vf a1, vf a2, vf a3, float* out) {
#if defined(GPTLAB_SIMD_AVX512)
    // halves: [a0 lo + a0 hi | a1 lo + a1 hi], then quarters: [a0 | a1 | a2 | a3] (4 partial sums each)
    __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 quarter = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
    quarter = _mm512_add_ps(quarter, _mm512_permute_ps(quarter, 0x4E));
    quarter = _mm512_add_ps(quarter, _mm512_permute_ps(quarter, 0xB1));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, quarter)));
#else
    out[0] = sum(a0);
    out[1] = sum(a1);
    out[2] = sum(a2);
    out[3] = sum(a3);
#endif
}

// e^x for LANES numbers, x <= 0 here (scores minus their maximum): 2^(x log2 e) = 2^n * 2^f, |f| <= 1/2, 2^f by
// its Taylor polynomial to degree 6 (relative error ~1e-7), 2^n by vscalefps on AVX-512, else by building the
// float's exponent (x clamped at -87, where e^x is 1.6e-38 and 2^n still a normal float).
static inline vf exp(vf x) {
#if defined(GPTLAB_SIMD_AVX512)
    vf t = max(x, set1(-104.0f)) * set1(1.44269504088896341f);
    vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    vf t = max(x, set1(-87.0f)) * set1(1.44269504088896341f);
    const vf magic = set1(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer (even on ties)
    vf n = (t + magic) - magic;
#endif
    vf f = t - n;
    vf p = set1(1.540353039e-4f);
    p = fma(p, f, set1(1.333355815e-3f));
    p = fma(p, f, set1(9.618129108e-3f));
    p = fma(p, f, set1(5.550410866e-2f));
    p = fma(p, f, set1(2.402265070e-1f));
    p = fma(p, f, set1(6.931471806e-1f));
    p = fma(p, f, set1(1.0f));
#if defined(GPTLAB_SIMD_AVX512)
    return _mm512_scalef_ps(p, n);
#elif defined(GPTLAB_SIMD_AVX2)  // p * 2^n: n + 127 in the exponent's bits (n >= -126 after the clamp)
    return p * _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                       _mm256_set1_epi32(127)), 23));
#elif defined(GPTLAB_SIMD_NEON)
    return p * vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
#else
    float pn[LANES], nn[LANES];
    store(pn, p);
    store(nn, n);
    for (int i = 0; i < LANES; i++) {
        uint32_t bits = (uint32_t)((int32_t)nn[i] + 127) << 23;
        float two_n;
        memcpy(&two_n, &bits, 4);
        pn[i] *= two_n;
    }
    return load(pn);
#endif
}

// Fetch the cache line holding p: into L1 (near) or L2 (far) ahead of its use
static inline void fetch_near(const void* p) { __builtin_prefetch(p, 0, 3); }
static inline void fetch_far(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace simd
