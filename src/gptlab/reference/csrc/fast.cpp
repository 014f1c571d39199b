// The naive GPT-2 made fast, rung by rung (docs/to-the-metal.md). One source, compiled once per rung with
// -DGPTLAB_RUNG=k: each rung keeps every idea of the rungs below it and adds one.
//   1 loops    every product in the loop order whose innermost loop walks both operands at unit stride, so a
//              cache line is used whole and the compiler can vectorise the loop (the naive engine's weight
//              gradient sweeps the whole dW once per row; here each dW row stays in L1 while the rows pass)
//   2 tiles    the products blocked and packed (BLIS's loops): a KC-deep sliver of A and of B sized to L1, an
//              MC x KC block of A sized to L2, a KC x NC panel of B sized to the last level, from the caches the
//              machine reports, each packed once into the order the inner kernel reads
//   3 simd     the inner kernel an MR x NR block of C held in vector registers (MR rows, NR = 2 vectors), written
//              once over the vector layer of the decode kernel (inference/csrc/simd.h: AVX-512, AVX2 + FMA, NEON,
//              generic); the softmax, cross-entropy and GELU over vectors too
//   4 threads  the products, attention, LayerNorm and the optimizer over the cores (OpenMP, the thread count
//              Python passes: torch's, never more), each output written by one thread in a fixed order, so two
//              runs give the same bits
//   5 fused    attention with an online softmax over blocks of keys (no T x T matrix kept: the backward
//              recomputes it from one log-sum-exp per row; each head's operands packed once), the residual add
//              fused into the LayerNorm after it, the bias and GELU applied to a block of the products' rows once
//              its last block of K is done (GELU's derivative likewise in the backward), the cross-entropy's
//              backward in its forward's pass
// The structs, the exported functions and their meaning are the naive engine's (reference.cpp), float only: the
// same Python fills both. Built with -O3 -fno-math-errno for a named target (never -ffast-math: IEEE -inf in the
// mask).

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "../../inference/csrc/simd.h"  // the vector layer (vf, LANES, load, store, fma, sum, exp)
#include "abi.h"                          // gptlab/csrc: the struct layout every library exports

#ifndef GPTLAB_RUNG
#define GPTLAB_RUNG 5
#endif
enum Rung { LOOPS = 1, TILES, SIMD, THREADS, FUSED };
constexpr int RUNG = GPTLAB_RUNG;
static_assert(RUNG >= LOOPS && RUNG <= FUSED, "GPTLAB_RUNG is 1 (loops) .. 5 (fused)");

// ---- the structs: reference.cpp's, field for field (reference/library.py checks both) ----
struct Layer {
    void *ln_1_w, *ln_1_b, *c_attn_w, *c_attn_b, *attn_proj_w, *attn_proj_b;
    void *ln_2_w, *ln_2_b, *c_fc_w, *c_fc_b, *mlp_proj_w, *mlp_proj_b;
};
struct Model {
    int n_layer, n_head, n_embd, vocab_size, block_size, gelu_tanh;
    double eps;
    void *wte, *wpe, *ln_f_w, *ln_f_b;
    Layer* layers;
};
struct Masks {
    void *attn, *attn_resid, *mlp_resid;
};
struct Batch {
    int B, T;
    const int64_t* idx;
    const int64_t* targets;
    void* emb_mask;
    Masks* masks;
    void* logits;
    double loss;
};

constexpr int LAYOUT_VERSION = 1;  // reference.cpp's: the same structs
#define F(S, f) GPTLAB_FIELD(S, f)
static const gptlab_abi::Field FIELDS[] = {
    F(Layer, ln_1_w), F(Layer, ln_1_b), F(Layer, c_attn_w), F(Layer, c_attn_b), F(Layer, attn_proj_w),
    F(Layer, attn_proj_b), F(Layer, ln_2_w), F(Layer, ln_2_b), F(Layer, c_fc_w), F(Layer, c_fc_b),
    F(Layer, mlp_proj_w), F(Layer, mlp_proj_b),
    F(Model, n_layer), F(Model, n_head), F(Model, n_embd), F(Model, vocab_size), F(Model, block_size),
    F(Model, gelu_tanh), F(Model, eps), F(Model, wte), F(Model, wpe), F(Model, ln_f_w), F(Model, ln_f_b),
    F(Model, layers),
    F(Masks, attn), F(Masks, attn_resid), F(Masks, mlp_resid),
    F(Batch, B), F(Batch, T), F(Batch, idx), F(Batch, targets), F(Batch, emb_mask), F(Batch, masks),
    F(Batch, logits), F(Batch, loss),
};
#undef F
static const gptlab_abi::Size SIZES[] = {GPTLAB_SIZE(Layer), GPTLAB_SIZE(Model), GPTLAB_SIZE(Masks),
                                         GPTLAB_SIZE(Batch)};
GPTLAB_EXPORT_LAYOUT(LAYOUT_VERSION, FIELDS, SIZES)

// ---- the clock: seconds in each function, summed over calls (the naive engine's pieces) ----
enum Piece { EMBEDDING_F, EMBEDDING_B, DROPOUT, LAYERNORM_F, LAYERNORM_B, LINEAR_F, LINEAR_B, ATTENTION_F,
             ATTENTION_B, GELU_F, GELU_B, CROSS_ENTROPY_F, CROSS_ENTROPY_B, CLIP, ADAMW, N_PIECES };
static const char* PIECE_NAMES[N_PIECES] = {
    "embedding_forward", "embedding_backward", "dropout", "layernorm_forward", "layernorm_backward",
    "linear_forward", "linear_backward", "attention_forward", "attention_backward", "gelu_forward", "gelu_backward",
    "cross_entropy_forward", "cross_entropy_backward", "clip_grad_norm", "adamw"};
static double piece_seconds[N_PIECES];
static bool ticking = false;
static double ticks = 0;
static double clock_seconds() {
    if (ticking) return ticks += 1;
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
struct Timed {
    Piece piece;
    double start = clock_seconds();
    explicit Timed(Piece k) : piece(k) {}
    ~Timed() { piece_seconds[piece] += clock_seconds() - start; }
};
extern "C" int gptlab_profile_pieces() { return N_PIECES; }
extern "C" const char* gptlab_profile_name(int k) { return k >= 0 && k < N_PIECES ? PIECE_NAMES[k] : nullptr; }
extern "C" double gptlab_profile_seconds(int k) { return k >= 0 && k < N_PIECES ? piece_seconds[k] : -1.0; }
extern "C" void gptlab_profile_reset() {
    for (double& t : piece_seconds) t = 0;
}
extern "C" void gptlab_profile_ticking(int on) {
    ticking = on != 0;
    ticks = 0;
}

// ---- threads (rung 4): the count Python passes; below rung 4 every loop runs on the calling thread ----
static int n_threads = 1;
static inline int team() { return RUNG >= THREADS ? n_threads : 1; }
#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) num_threads(team())")
// an elementwise pass over n floats: on the calling thread below SPREAD floats (a team's start and barrier cost more)
constexpr int SPREAD = 1 << 13;
#define PARALLEL_FOR_OVER(n) _Pragma("omp parallel for schedule(static) num_threads(team()) if ((n) > SPREAD)")
#define PARALLEL_FOR_SIMD_OVER(n) \
    _Pragma("omp parallel for simd schedule(static) num_threads(team()) if ((n) > SPREAD)")

// Inside a parallel region: this thread's share [first, end) of n columns, whole vectors but the last (each
// thread sums its own columns over every row, in row order: the same bits on any number of threads)
static inline std::pair<int, int> my_columns(int n) {
    const int t = omp_get_thread_num(), n_t = omp_get_num_threads(), lanes = simd::LANES;
    const int vectors = (n + lanes - 1) / lanes;
    return {std::min(n, vectors * t / n_t * lanes), std::min(n, vectors * (t + 1) / n_t * lanes)};
}

// ---- tiles (rung 2): from the caches the machine reports (sysconf; a common size where it reports none) ----
constexpr int MR = 6, NR = 2 * simd::LANES;  // the inner kernel's block of C: MR rows x NR columns
struct Tiles {
    int mc, kc, nc;
};
static long cache_bytes(int name, long fallback) {
    long v = sysconf(name);
    return v > 0 ? v : fallback;
}
static Tiles measure_tiles() {
    long l1 = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 32 << 10), l2 = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 512 << 10);
    long l3 = cache_bytes(_SC_LEVEL3_CACHE_SIZE, 8 << 20);
    // KC: an MR x KC sliver of A and a KC x NR sliver of B in 3/4 of L1; MC: the MC x KC block of A in half of
    // L2; NC: the KC x NC panel of B in half of the last level
    int kc = (int)std::clamp(l1 * 3 / 4 / (long)(sizeof(float) * (MR + NR)) / 16 * 16, 64L, 1024L);
    int mc = (int)std::clamp(l2 / 2 / (long)(sizeof(float) * kc) / MR * MR, (long)MR, 1020L);
    int nc = (int)std::clamp(l3 / 2 / (long)(sizeof(float) * kc) / NR * NR, (long)NR, 8192L / NR * NR);
    return {mc, kc, nc};
}
static const Tiles TILE = measure_tiles();

namespace {

using std::size_t;
using simd::vf;
constexpr float PI = 3.14159265358979323846f;
using Vec = std::vector<float>;

// ---- vectors: a dot product and y += a x over n floats (the vector layer from rung 3, plain loops below) ----
static inline float dot(const float* a, const float* b, int n) {
    if (RUNG >= SIMD) {
        vf acc = simd::zero();
        int i = 0;
        for (; i + simd::LANES <= n; i += simd::LANES) acc = simd::fma(simd::load(a + i), simd::load(b + i), acc);
        if (i < n) acc = simd::fma(simd::load(a + i, n - i), simd::load(b + i, n - i), acc);
        return simd::sum(acc);
    }
    float s = 0;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static inline void axpy(float a, const float* x, float* y, int n) {
    if (RUNG >= SIMD) {
        vf va = simd::set1(a);
        int i = 0;
        for (; i + simd::LANES <= n; i += simd::LANES) simd::store(y + i, simd::fma(va, simd::load(x + i), simd::load(y + i)));
        if (i < n) simd::store(y + i, simd::fma(va, simd::load(x + i, n - i), simd::load(y + i, n - i)), n - i);
        return;
    }
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

// ---- GELU (reference.cpp's equations); from rung 3 over vectors: e^x from the vector layer, erf by Abramowitz &
// Stegun 7.1.26 (|error| < 1.5e-7), tanh u through 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)) ----
static inline float gelu(float x, bool tanh_form) {
    if (tanh_form) {
        float u = std::sqrt(2.0f / PI) * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + std::tanh(u));
    }
    return 0.5f * x * (1.0f + std::erf(x / std::sqrt(2.0f)));
}
static inline float gelu_derivative(float x, bool tanh_form) {
    if (tanh_form) {
        float k = std::sqrt(2.0f / PI), th = std::tanh(k * (x + 0.044715f * x * x * x));
        return 0.5f * (1 + th) + 0.5f * x * (1 - th * th) * k * (1 + 3 * 0.044715f * x * x);
    }
    return 0.5f * (1 + std::erf(x / std::sqrt(2.0f))) + x * std::exp(-0.5f * x * x) / std::sqrt(2 * PI);
}
// gelu(x) = x cdf(x): for the exact form cdf = Phi (the normal CDF) and density = phi = Phi'; for the tanh form
// cdf = s = 1 / (1 + e^(-2u)) and density = ds/dx = 2s(1 - s) du/dx
static inline void gelu_parts(vf x, bool tanh_form, vf& cdf, vf& density) {
    const vf one = simd::set1(1.0f);
    if (tanh_form) {
        const vf k = simd::set1(0.7978845608028654f);
        vf u = k * (x + simd::set1(0.044715f) * x * x * x);
        vf e = simd::exp(simd::zero() - simd::max(u + u, simd::set1(-80.0f)));  // e^(-2u), 2u >= -80: finite
        vf s = one / (one + e);
        cdf = s;
        density = simd::set1(2.0f) * s * (one - s) * k * (one + simd::set1(3 * 0.044715f) * x * x);
        return;
    }
    vf z = simd::max(x, simd::zero() - x) * simd::set1(0.7071067811865476f);
    vf t = one / (one + simd::set1(0.3275911f) * z);
    vf p = simd::set1(1.061405429f);
    p = simd::fma(p, t, simd::set1(-1.453152027f));
    p = simd::fma(p, t, simd::set1(1.421413741f));
    p = simd::fma(p, t, simd::set1(-0.284496736f));
    p = simd::fma(p, t, simd::set1(0.254829592f));
    vf g = simd::exp(simd::zero() - z * z);  // e^(-x^2 / 2)
    vf tail = simd::set1(0.5f) * p * t * g;  // Phi(-|x|) = erfc(|x| / sqrt 2) / 2
    cdf = x >= simd::zero() ? one - tail : tail;
    density = g * simd::set1(0.3989422804014327f);
}
static inline vf gelu_v(vf x, bool tanh_form) {
    vf cdf, density;
    gelu_parts(x, tanh_form, cdf, density);
    return x * cdf;
}
static inline vf gelu_derivative_v(vf x, bool tanh_form) {
    vf cdf, density;
    gelu_parts(x, tanh_form, cdf, density);
    return cdf + x * density;  // both forms: d(x cdf)/dx = cdf + x d(cdf)/dx
}

// ---- what a product does to each tile of C after its last block of K (rungs 2+): + bias, then at rung 5
// act = gelu(C) (the MLP's forward) or C *= gelu'(pre) (its backward) ----
struct Epilogue {
    const float* bias = nullptr;  // (N): C[m, n] += bias[n]
    float* act = nullptr;         // (M, ldc): gelu(C)
    const float* pre = nullptr;   // (M, ldc): C *= gelu'(pre)
    bool tanh_form = false;
};
static void finish_row(const Epilogue& e, float* c, long at, int n0, int n) {
    if (e.bias)
        for (int j = 0; j < n; j++) c[j] += e.bias[n0 + j];
    if (RUNG >= FUSED && (e.act || e.pre)) {
        int j = 0;
        for (; j < n; j += simd::LANES) {
            int w = std::min(simd::LANES, n - j);
            vf v = simd::load(c + j, w);
            if (e.act) simd::store(e.act + at + j, gelu_v(v, e.tanh_form), w);
            if (e.pre) simd::store(c + j, v * gelu_derivative_v(simd::load(e.pre + at + j, w), e.tanh_form), w);
        }
    }
}

// ---- the products: C (M x N, rows ldc apart) = [C +] A (M x K) B (K x N), A(m, k) at A.p[m rs + k cs] ----
struct Mat {
    const float* p;
    long rs, cs;
    float at(long r, long c) const { return p[r * rs + c * cs]; }
};

// rung 1: the loop order that walks both operands at unit stride, chosen by the layouts
static void gemm_loops(int M, int N, int K, Mat A, Mat B, float* C, long ldc, bool acc) {
    if (B.cs == 1) {  // C[m, :] += A(m, k) B[k, :]: rows of B and C (dX = dY W; dW = dY^T X, dW's row kept in L1)
        for (int m = 0; m < M; m++) {
            float* c = C + m * ldc;
            if (!acc) std::fill(c, c + N, 0.0f);
            for (int k = 0; k < K; k++) axpy(A.at(m, k), B.p + k * B.rs, c, N);
        }
    } else if (A.cs == 1 && B.rs == 1) {  // C[m, n] = A[m, :] . B[:, n]: a row of X against a row of W
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) C[m * ldc + n] = (acc ? C[m * ldc + n] : 0.0f) + dot(A.p + m * A.rs, B.p + n * B.cs, K);
    } else {
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float s = 0;
                for (int k = 0; k < K; k++) s += A.at(m, k) * B.at(k, n);
                C[m * ldc + n] = (acc ? C[m * ldc + n] : 0.0f) + s;
            }
    }
}

// the inner kernel: C[0:mr, 0:nr] (+)= the packed MR x kb sliver a times the packed kb x NR sliver b (zero-padded)
static void kernel(int kb, const float* a, const float* b, float* c, long ldc, int mr, int nr, bool acc) {
    if (RUNG >= SIMD) {
        vf c0[MR], c1[MR];
        for (int r = 0; r < MR; r++) c0[r] = c1[r] = simd::zero();
        for (int r = 0; r < mr; r++) {  // C's rows asked for now, read (or written) only after the kb steps
            __builtin_prefetch(c + r * ldc, 1);
            __builtin_prefetch(c + r * ldc + NR - 1, 1);
        }
        // eight steps of k a loop iteration: fewer pointer bumps and branches between the FMAs, and the loads of
        // the next steps issued while this one's FMAs wait (docs/to-the-metal.md: what the profile showed)
#pragma GCC unroll 8
        for (int k = 0; k < kb; k++, a += MR, b += NR) {
            vf b0 = simd::load(b), b1 = simd::load(b + simd::LANES);
            for (int r = 0; r < MR; r++) {
                vf ar = simd::set1(a[r]);
                c0[r] = simd::fma(ar, b0, c0[r]);
                c1[r] = simd::fma(ar, b1, c1[r]);
            }
        }
        const int w0 = std::min(nr, simd::LANES), w1 = std::max(0, nr - simd::LANES);
        for (int r = 0; r < mr; r++) {
            float* cr = c + r * ldc;
            if (nr == NR) {
                simd::store(cr, acc ? c0[r] + simd::load(cr) : c0[r]);
                simd::store(cr + simd::LANES, acc ? c1[r] + simd::load(cr + simd::LANES) : c1[r]);
            } else {
                simd::store(cr, acc ? c0[r] + simd::load(cr, w0) : c0[r], w0);
                if (w1) simd::store(cr + simd::LANES, acc ? c1[r] + simd::load(cr + simd::LANES, w1) : c1[r], w1);
            }
        }
        return;
    }
    float t[MR][NR] = {};  // the compiler's code: C's block in an array it vectorises and keeps in registers
    for (int k = 0; k < kb; k++) {
        const float* bk = b + (size_t)k * NR;
        for (int r = 0; r < MR; r++) {
            const float ar = a[(size_t)k * MR + r];
#pragma omp simd
            for (int j = 0; j < NR; j++) t[r][j] += ar * bk[j];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) c[r * ldc + j] = (acc ? c[r * ldc + j] : 0.0f) + t[r][j];
}

// A sliver packed k-major: dst[k W + j] = src[k ks + j js] for j < w, 0 for w <= j < W (k < kb). The loop walks
// whichever of k and j is the unit stride innermost (a row of W read whole, not one float from each of W rows).
static void pack(const float* src, long ks, long js, int kb, int w, int W, float* dst) {
    if (js == 1 || ks != 1) {
        for (int k = 0; k < kb; k++) {
            const float* row = src + k * ks;
            float* out = dst + (size_t)k * W;
            for (int j = 0; j < w; j++) out[j] = row[j * js];
            for (int j = w; j < W; j++) out[j] = 0.0f;
        }
        return;
    }
    for (int j = 0; j < w; j++) {
        const float* col = src + j * js;
        for (int k = 0; k < kb; k++) dst[(size_t)k * W + j] = col[k];
    }
    for (int j = w; j < W; j++)
        for (int k = 0; k < kb; k++) dst[(size_t)k * W + j] = 0.0f;
}

static float* scratch(std::vector<float>& v, size_t n) {
    if (v.size() < n + 16) v.resize(n + 16);
    return (float*)(((uintptr_t)v.data() + 63) & ~(uintptr_t)63);
}

// rungs 2+: BLIS's five loops. K in even blocks of at most KC; B's KC x NC panel packed into slivers of NR columns,
// each thread's MC x KC block of A into slivers of MR rows, then every (sliver of A, sliver of B) pair through the
// kernel. From rung 4 each thread takes its own rows of C (whole slivers) and packs its own A, and the threads share
// the packing of B's panel: each tile of C is computed by one thread, its blocks of K in order, so the result has
// the same bits however many threads there are.
static void gemm_tiles(int M, int N, int K, Mat A, Mat B, float* C, long ldc, bool acc, const Epilogue* epi, int nt) {
    static thread_local std::vector<float> b_buf;  // a thread's own: attention calls products from its threads
    const int k_blocks = (K + TILE.kc - 1) / TILE.kc, kc = (K + k_blocks - 1) / k_blocks, mc = TILE.mc, nc = TILE.nc;
    float* bp = scratch(b_buf, (size_t)kc * ((std::min(nc, N) + NR - 1) / NR * NR));
    const int slivers = (M + MR - 1) / MR, teams = std::max(1, std::min(nt, slivers));
#pragma omp parallel num_threads(teams) if (teams > 1)
    {
        static thread_local std::vector<float> a_buf;
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int lo = slivers * t / n_t * MR, hi = std::min(M, slivers * (t + 1) / n_t * MR);
        float* ap = scratch(a_buf, (size_t)kc * ((std::min(mc, std::max(hi - lo, 1)) + MR - 1) / MR * MR));
        for (int jc = 0; jc < N; jc += nc) {
            const int nb = std::min(nc, N - jc), n_sl = (nb + NR - 1) / NR;
            for (int pc = 0; pc < K; pc += kc) {
                const int kb = std::min(kc, K - pc);
                const bool last = pc + kb == K, add = acc || pc > 0;
#pragma omp for schedule(static)
                for (int s = 0; s < n_sl; s++) {  // pack B's slivers: k-major, NR columns, zero past N
                    const int n0 = jc + s * NR;
                    pack(B.p + pc * B.rs + n0 * B.cs, B.rs, B.cs, kb, std::min(NR, N - n0), NR,
                         bp + (size_t)s * kb * NR);
                }
                for (int ic = lo; ic < hi; ic += mc) {
                    const int mb = std::min(mc, hi - ic), m_sl = (mb + MR - 1) / MR;
                    for (int s = 0; s < m_sl; s++) {  // pack this thread's A: k-major, MR rows, zero past M
                        const int m0 = ic + s * MR;
                        pack(A.p + m0 * A.rs + pc * A.cs, A.cs, A.rs, kb, std::min(MR, M - m0), MR,
                             ap + (size_t)s * kb * MR);
                    }
                    for (int js = 0; js < n_sl; js++)
                        for (int is = 0; is < m_sl; is++) {
                            const int m0 = ic + is * MR, n0 = jc + js * NR;
                            const int mr = std::min(MR, M - m0), nr = std::min(NR, N - n0);
                            float* c = C + m0 * ldc + n0;
                            kernel(kb, ap + (size_t)is * kb * MR, bp + (size_t)js * kb * NR, c, ldc, mr, nr, add);
                        }
                    // the epilogue on the block's rows, each whole at unit stride, while the block is in cache: tile
                    // by tile, its rows of the activation (and pre-activation) were 64-byte pieces 4 N bytes apart,
                    // a pattern the prefetchers miss (the MLP was slower than with an unfused pass)
                    if (last && epi)
                        for (int m = ic; m < ic + mb; m++) finish_row(*epi, C + m * ldc + jc, m * ldc + jc, jc, nb);
                }
#pragma omp barrier
            }
        }
    }
}

// `nt` threads share the product (default: the team; 1 inside a loop that is already spread over the threads)
static void gemm(int M, int N, int K, Mat A, Mat B, float* C, long ldc, bool acc, const Epilogue* epi = nullptr,
                 int nt = 0) {
    if (RUNG >= TILES) return gemm_tiles(M, N, K, A, B, C, ldc, acc, epi, nt > 0 ? nt : team());
    gemm_loops(M, N, K, A, B, C, ldc, acc);
    if (epi && epi->bias)
        for (int m = 0; m < M; m++) finish_row(*epi, C + m * ldc, m * ldc, 0, N);
}

// ---- a Linear layer, y = x W^T + b with W (O, I): y (N, O) ----
void linear_forward(const float* x, const float* W, const float* b, int N, int I, int O, float* y,
                    const Epilogue* fused = nullptr) {
    Timed timed(LINEAR_F);
    Epilogue e = fused ? *fused : Epilogue{};
    e.bias = b;
    gemm(N, O, I, {x, I, 1}, {W, 1, I}, y, O, false, &e);
}

// dx = dy W (written; with `grad_of`, times gelu'(grad_of) at rung 5); dW += dy^T x; db += column sums of dy
void linear_backward(const float* x, const float* W, const float* dy, int N, int I, int O, float* dx, float* dW,
                     float* db, const Epilogue* fused = nullptr) {
    Timed timed(LINEAR_B);
    gemm(N, I, O, {dy, O, 1}, {W, I, 1}, dx, I, false, fused);
    gemm(O, I, N, {dy, 1, O}, {x, I, 1}, dW, I, true);
    if (!db) return;
#pragma omp parallel num_threads(team()) if ((long)N * O > SPREAD)
    {
        const auto [o0, o1] = my_columns(O);
        for (int n = 0; n < N; n++)
            for (int o = o0; o < o1; o++) db[o] += dy[(size_t)n * O + o];
    }
}

// ---- embeddings, dropout ----
void embedding_forward(const int64_t* idx, const float* wte, const float* wpe, int B, int T, int C, float* x) {
    Timed timed(EMBEDDING_F);
    PARALLEL_FOR
    for (int r = 0; r < B * T; r++) {
        const float *tok = wte + (size_t)idx[r] * C, *pos = wpe + (size_t)(r % T) * C;
        for (int c = 0; c < C; c++) x[(size_t)r * C + c] = tok[c] + pos[c];
    }
}
void embedding_backward(const int64_t* idx, const float* dx, int B, int T, int C, float* dwte, float* dwpe) {
    Timed timed(EMBEDDING_B);  // each thread its own channels: a token seen twice adds in row order
#pragma omp parallel num_threads(team()) if ((long)B * T * C > SPREAD)
    {
        const auto [c0, c1] = my_columns(C);
        for (int r = 0; r < B * T; r++) {
            const float* g = dx + (size_t)r * C;
            float *tok = dwte + (size_t)idx[r] * C, *pos = dwpe + (size_t)(r % T) * C;
            for (int c = c0; c < c1; c++) {
                tok[c] += g[c];
                pos[c] += g[c];
            }
        }
    }
}
void dropout(const float* x, const float* m, size_t n, float* y) {
    Timed timed(DROPOUT);
    PARALLEL_FOR_OVER(n)
    for (size_t i = 0; i < n; i++) y[i] = m ? x[i] * m[i] : x[i];
}

// ---- LayerNorm over C channels of N rows; at rung 5 the residual add before it in the same pass:
// with `res`, x = x + drop(res) is formed (into x_out) and normalised ----
void layernorm_forward(const float* x, const float* w, const float* b, int N, int C, double eps, float* y,
                       float* mean, float* rstd, const float* res = nullptr, const float* res_mask = nullptr,
                       float* x_out = nullptr) {
    Timed timed(LAYERNORM_F);
    PARALLEL_FOR
    for (int n = 0; n < N; n++) {
        const float* xn = x + (size_t)n * C;
        if (res) {
            float* o = x_out + (size_t)n * C;
            const float *r = res + (size_t)n * C, *m = res_mask ? res_mask + (size_t)n * C : nullptr;
            for (int c = 0; c < C; c++) o[c] = (m ? r[c] * m[c] : r[c]) + xn[c];
            xn = o;
        }
        float mu = 0, var = 0;
        for (int c = 0; c < C; c++) mu += xn[c];
        mu /= C;
        for (int c = 0; c < C; c++) var += (xn[c] - mu) * (xn[c] - mu);
        var /= C;
        float s = 1.0f / std::sqrt(var + (float)eps);
        float* yn = y + (size_t)n * C;
        for (int c = 0; c < C; c++) yn[c] = (xn[c] - mu) * s * w[c] + (b ? b[c] : 0.0f);
        mean[n] = mu;
        rstd[n] = s;
    }
}
// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w [+ add: the residual's own path, at rung 5];
// dw += sum_n dy xhat, db += sum_n dy (over ranges of channels, rows in order)
void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd, const float* dy, int N,
                        int C, float* dx, float* dw, float* db, const float* add = nullptr) {
    Timed timed(LAYERNORM_B);
    PARALLEL_FOR
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * C, *dyn = dy + (size_t)n * C;
        float g_mean = 0, gx_mean = 0;
        for (int c = 0; c < C; c++) {
            float xhat = (xn[c] - mean[n]) * rstd[n], g = dyn[c] * w[c];
            g_mean += g;
            gx_mean += g * xhat;
        }
        g_mean /= C;
        gx_mean /= C;
        float* dxn = dx + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float xhat = (xn[c] - mean[n]) * rstd[n];
            dxn[c] = rstd[n] * (dyn[c] * w[c] - g_mean - xhat * gx_mean) + (add ? add[(size_t)n * C + c] : 0.0f);
        }
    }
#pragma omp parallel num_threads(team()) if ((long)N * C > SPREAD)
    {
        const auto [c0, c1] = my_columns(C);
        for (int n = 0; n < N; n++) {
            const float *xn = x + (size_t)n * C, *dyn = dy + (size_t)n * C;
            for (int c = c0; c < c1; c++) {
                dw[c] += dyn[c] * (xn[c] - mean[n]) * rstd[n];
                if (db) db[c] += dyn[c];
            }
        }
    }
}

// ---- GELU, elementwise (rungs 1-4; rung 5 applies it in the products' epilogue) ----
void gelu_forward(const float* x, size_t n, bool tanh_form, float* y) {
    Timed timed(GELU_F);
    if (RUNG >= SIMD) {
        PARALLEL_FOR
        for (size_t i = 0; i < n; i += simd::LANES) {
            int w = (int)std::min<size_t>(simd::LANES, n - i);
            simd::store(y + i, gelu_v(simd::load(x + i, w), tanh_form), w);
        }
        return;
    }
    for (size_t i = 0; i < n; i++) y[i] = gelu(x[i], tanh_form);
}
void gelu_backward(const float* x, const float* dy, size_t n, bool tanh_form, float* dx) {
    Timed timed(GELU_B);
    if (RUNG >= SIMD) {
        PARALLEL_FOR
        for (size_t i = 0; i < n; i += simd::LANES) {
            int w = (int)std::min<size_t>(simd::LANES, n - i);
            simd::store(dx + i, simd::load(dy + i, w) * gelu_derivative_v(simd::load(x + i, w), tanh_form), w);
        }
        return;
    }
    for (size_t i = 0; i < n; i++) dx[i] = dy[i] * gelu_derivative(x[i], tanh_form);
}

// ---- e^x over n floats (x <= 0 here): the vector layer's from rung 3 ----
static inline void exps(const float* x, float shift, int n, float* y) {
    if (RUNG >= SIMD) {
        const vf s = simd::set1(shift);
        for (int i = 0; i < n; i += simd::LANES) {
            int w = std::min(simd::LANES, n - i);
            simd::store(y + i, simd::exp(simd::load(x + i, w, shift) - s), w);
        }
        return;
    }
    for (int i = 0; i < n; i++) y[i] = std::exp(x[i] - shift);
}
static inline float sum_of(const float* x, int n) {
    if (RUNG >= SIMD) {
        vf acc = simd::zero();
        for (int i = 0; i < n; i += simd::LANES) acc = acc + simd::load(x + i, std::min(simd::LANES, n - i));
        return simd::sum(acc);
    }
    float s = 0;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i];
    return s;
}
static inline float max_of(const float* x, int n) {
    float top = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

#include "fast_attention.h"  // beside this file: causal attention, kept (rungs 1-4) and fused (rung 5)

// ---- cross-entropy: mean over the rows whose target is not -1; the backward (softmax - onehot) / n ----
double cross_entropy(const float* logits, const int64_t* targets, int N, int V, float* dlogits) {
    Timed timed(dlogits && RUNG < FUSED ? CROSS_ENTROPY_B : CROSS_ENTROPY_F);
    int count = 0;
    for (int r = 0; r < N; r++) count += targets[r] >= 0;
    std::vector<double> row_loss(N, 0.0);
    PARALLEL_FOR
    for (int r = 0; r < N; r++) {
        const float* z = logits + (size_t)r * V;
        float* dz = dlogits ? dlogits + (size_t)r * V : nullptr;
        if (targets[r] < 0) {
            if (dz) std::fill(dz, dz + V, 0.0f);
            continue;
        }
        float top = max_of(z, V);
        Vec e(dz ? 0 : V);
        float* ez = dz ? dz : e.data();
        exps(z, top, V, ez);
        float sum = sum_of(ez, V);
        row_loss[r] = (double)(std::log(sum) + top - z[targets[r]]);
        if (dz) {
            const float scale = 1.0f / (sum * (float)count);
            for (int v = 0; v < V; v++) dz[v] = ez[v] * scale;
            dz[targets[r]] -= 1.0f / (float)count;
        }
    }
    double total = 0;
    for (int r = 0; r < N; r++) total += row_loss[r];
    return total / count;
}

#include "fast_model.h"  // beside this file: the block, the model's step, clipping and AdamW

}  // namespace

extern "C" int gptlab_fast_rung() { return RUNG; }
extern "C" const char* gptlab_fast_vectors() { return simd::NAME; }
extern "C" void gptlab_fast_set_threads(int n) { n_threads = std::max(1, n); }
extern "C" int gptlab_fast_threads() { return team(); }
extern "C" void gptlab_fast_tiles(int* out) {  // MR, NR, MC, KC, NC
    out[0] = MR, out[1] = NR, out[2] = TILE.mc, out[3] = TILE.kc, out[4] = TILE.nc;
}

// ---- reference.cpp's entry points, float only (the same meaning, the same return codes) ----
extern "C" int gptlab_step_f32(const Model* m, const Model* grads, Batch* batch) { return model_step(*m, grads, *batch); }
extern "C" double gptlab_clip_grad_norm_f32(float* const* grads, const int64_t* sizes, int n, double max_norm) {
    return clip_grad_norm(grads, sizes, n, max_norm);
}
extern "C" void gptlab_adamw_f32(float* theta, const float* g, float* m, float* v, int64_t n, double lr, double b1,
                                 double b2, double eps, double wd, int64_t t) {
    adamw(theta, g, m, v, n, lr, b1, b2, eps, wd, t);
}
extern "C" void gptlab_layernorm_f32(const float* x, const float* w, const float* b, int N, int C, double eps,
                                     float* y, const float* dy, float* dx, float* dw, float* db) {
    Vec mean(N), rstd(N);
    layernorm_forward(x, w, b, N, C, eps, y, mean.data(), rstd.data());
    if (dy) layernorm_backward(x, w, mean.data(), rstd.data(), dy, N, C, dx, dw, db);
}
extern "C" void gptlab_attention_f32(const float* qkv, const float* mask, int B, int T, int C, int H, float* y,
                                     const float* dy, float* dqkv) {
    Vec probs(RUNG >= FUSED ? 0 : (size_t)B * H * T * T), lse(RUNG >= FUSED ? (size_t)B * H * T : 0);
    attention_forward(qkv, mask, B, T, C, H, y, probs.data(), lse.data());
    if (dy) attention_backward(qkv, probs.data(), lse.data(), y, mask, dy, B, T, C, H, dqkv);
}
extern "C" void gptlab_gelu_f32(const float* x, int64_t n, int tanh_form, float* y, const float* dy, float* dx) {
    gelu_forward(x, n, tanh_form != 0, y);
    if (dy) gelu_backward(x, dy, n, tanh_form != 0, dx);
}
extern "C" void gptlab_mlp_f32(const float* x, const float* w_fc, const float* b_fc, const float* w_proj,
                               const float* b_proj, int N, int C, int tanh_form, float* y, const float* dy, float* dx,
                               float* dw_fc, float* db_fc, float* dw_proj, float* db_proj) {
    Vec fc((size_t)N * 4 * C), act(fc.size()), d_fc(fc.size());
    Epilogue out, grad;
    out.act = act.data(), out.tanh_form = grad.tanh_form = tanh_form != 0, grad.pre = fc.data();
    linear_forward(x, w_fc, b_fc, N, C, 4 * C, fc.data(), &out);
    if (RUNG < FUSED) gelu_forward(fc.data(), fc.size(), tanh_form != 0, act.data());
    linear_forward(act.data(), w_proj, b_proj, N, 4 * C, C, y);
    if (!dy) return;
    linear_backward(act.data(), w_proj, dy, N, 4 * C, C, d_fc.data(), dw_proj, db_proj, &grad);
    if (RUNG < FUSED) gelu_backward(fc.data(), d_fc.data(), fc.size(), tanh_form != 0, d_fc.data());
    linear_backward(x, w_fc, d_fc.data(), N, C, 4 * C, dx, dw_fc, db_fc);
}
extern "C" double gptlab_cross_entropy_f32(const float* logits, const int64_t* targets, int N, int V, float* dlogits) {
    return cross_entropy(logits, targets, N, V, dlogits);
}
extern "C" void gptlab_block_f32(const Model* m, const Layer* w, const Layer* g, const Masks* mk, int B, int T,
                                 const float* x, float* y, const float* dy, float* dx) {
    BlockActs a(B, T, m->n_embd, m->n_head);
    std::copy(x, x + a.x.size(), a.x.begin());
    block_forward(*m, *w, mk, B, T, a, y);
    if (dy) block_backward(*m, *w, *g, mk, B, T, a, dy, dx);
}
// the products alone (tests and the bench): C (M x N, rows ldc apart) = [C +] A B, A(m, k) at A[m rsa + k csa]
extern "C" void gptlab_fast_matmul(int M, int N, int K, const float* A, long rsa, long csa, const float* B, long rsb,
                                   long csb, float* C, long ldc, int acc) {
    gemm(M, N, K, {A, rsa, csa}, {B, rsb, csb}, C, ldc, acc != 0);
}

// Dropout multipliers drawn here, not by torch's generator (whose draws are sequential): out[i] = 1 / (1 - p) where
// the uniform u_i >= p, else 0. A counter-based draw: any element, on any thread, in any order, has the same value.
// The stream's key is SplitMix64 of the seed and the stream; u_i is 24 bits of a 32-bit hash (two rounds of a
// multiply-xorshift mixer, each a permutation of 32 bits) of i keyed by the key's halves. 32-bit multiplies are what
// the vector units have (AVX2 has no 64-bit one): the loop vectorises, 8 or 16 draws an instruction, where
// SplitMix64 per element ran one draw at a time.
static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}
extern "C" void gptlab_fast_masks(uint64_t seed, uint64_t stream, double p, float* out, int64_t n) {
    const uint64_t key = splitmix64(seed ^ splitmix64(stream));
    const uint32_t low = (uint32_t)key, high = (uint32_t)(key >> 32);
    const float keep = 1.0f / (1.0f - (float)p), threshold = (float)p;
    PARALLEL_FOR_OVER(n)
    for (int64_t i = 0; i < n; i++) {  // i's top 32 bits join the second key: every index of a tensor its own draw
        const uint32_t h = mix32(mix32((uint32_t)i + low) ^ (high + (uint32_t)((uint64_t)i >> 32)));
        const float u = (float)(h >> 8) * (1.0f / 16777216.0f);
        out[i] = u >= threshold ? keep : 0.0f;
    }
}
