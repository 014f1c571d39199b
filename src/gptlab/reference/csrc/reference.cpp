// The naive GPT-2: every piece of the theory as a plain loop, its forward beside its backward, written for a reader
// checking it against the equations (docs/from-the-equations.md), not for speed. Standard C++17 only: no
// intrinsics, no BLAS, no threads. Templated on the scalar R (float and double are exported). Built with -O2
// -ffp-contract=off and never -ffast-math: IEEE -inf in the mask, and the same results on every CPU.
//
// Letters: B batch, T time, C channels (n_embd), h heads (H in the code, where h counts them), d_k = C / h (D in
// the code), V vocabulary, F = 4C, N = B * T rows.
// Matrices are stored as torch stores them: a Linear's weight W is (out, in) and y = x W^T + b.
// Every backward ADDS into its parameter gradients (dW += ...) and WRITES its input gradient (dx = ...), except
// where a comment says otherwise; the caller zeroes the gradients once per call of the model.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "abi.h"  // gptlab/csrc: the struct layout every library exports

// ---- the structs Python fills (reference/library.py mirrors them field for field) ----

struct Layer {  // one block's tensors (or their gradients); a bias is NULL when the model has none
    void *ln_1_w, *ln_1_b, *c_attn_w, *c_attn_b, *attn_proj_w, *attn_proj_b;
    void *ln_2_w, *ln_2_b, *c_fc_w, *c_fc_b, *mlp_proj_w, *mlp_proj_b;
};

struct Model {  // the shape and the tensors (or their gradients: the same struct, the same shapes)
    int n_layer, n_head, n_embd, vocab_size, block_size, gelu_tanh;
    double eps;  // LayerNorm's epsilon
    void *wte, *wpe, *ln_f_w, *ln_f_b;  // the LM head is wte (tied)
    Layer* layers;
};

struct Masks {  // one block's dropout multipliers (0 or 1 / (1 - p)), drawn by the caller; NULL: no dropout there
    void *attn;        // (B, H, T, T) on the attention probabilities
    void *attn_resid;  // (B, T, C) on the attention's output before the residual add
    void *mlp_resid;   // (B, T, C) on the MLP's output before the residual add
};

struct Batch {
    int B, T;
    const int64_t* idx;      // (B, T) token ids
    const int64_t* targets;  // (B, T) next tokens, -1 ignored; NULL: no loss (and no backward)
    void* emb_mask;          // (B, T, C) dropout multipliers after the embeddings, or NULL
    Masks* masks;            // n_layer of them, or NULL: no dropout anywhere in the blocks
    void* logits;            // out: (B, T, V)
    double loss;             // out: the mean cross-entropy over the targets that are not -1
};

// ---- the ABI (gptlab/csrc/abi.h): Python checks these before the first call ----
constexpr int LAYOUT_VERSION = 1;  // raise with any change to the structs above, here and in reference/library.py
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

// ---- where a step's time goes: seconds spent in each function, summed over calls (gptlab bench reference) ----
enum Piece { EMBEDDING_F, EMBEDDING_B, DROPOUT, LAYERNORM_F, LAYERNORM_B, LINEAR_F, LINEAR_B, ATTENTION_F,
             ATTENTION_B, GELU_F, GELU_B, CROSS_ENTROPY_F, CROSS_ENTROPY_B, CLIP, ADAMW, N_PIECES };
static const char* PIECE_NAMES[N_PIECES] = {
    "embedding_forward", "embedding_backward", "dropout", "layernorm_forward", "layernorm_backward",
    "linear_forward", "linear_backward", "attention_forward", "attention_backward", "gelu_forward", "gelu_backward",
    "cross_entropy_forward", "cross_entropy_backward", "clip_grad_norm", "adamw"};
static double piece_seconds[N_PIECES];
static bool ticking = false;  // the tests' clock: each reading is one tick (counted as a second) past the last
static double ticks = 0;

static double clock_seconds() {
    if (ticking) return ticks += 1;
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds the time from its construction to its destruction to one piece's total. No timed function calls another, so
// each function's time is its own: on the ticking clock a piece's total is its number of calls, exactly.
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
extern "C" void gptlab_profile_ticking(int on) {  // the tests' clock on (1) or the steady clock back (0)
    ticking = on != 0;
    ticks = 0;
}

namespace {

using std::size_t;
constexpr double PI = 3.14159265358979323846;
template <typename R> using Vec = std::vector<R>;

// ---- token + position embedding ----
// x[b,t,:] = wte[idx[b,t], :] + wpe[t, :]
template <typename R>
void embedding_forward(const int64_t* idx, const R* wte, const R* wpe, int B, int T, int C, R* x) {
    Timed timed(EMBEDDING_F);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const R* tok = wte + (size_t)idx[b * T + t] * C;
            const R* pos = wpe + (size_t)t * C;
            R* out = x + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) out[c] = tok[c] + pos[c];
        }
}

// dwte[idx[b,t], :] += dx[b,t,:];  dwpe[t, :] += dx[b,t,:]   (a token seen twice collects both gradients)
template <typename R>
void embedding_backward(const int64_t* idx, const R* dx, int B, int T, int C, R* dwte, R* dwpe) {
    Timed timed(EMBEDDING_B);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const R* g = dx + ((size_t)b * T + t) * C;
            R* tok = dwte + (size_t)idx[b * T + t] * C;
            R* pos = dwpe + (size_t)t * C;
            for (int c = 0; c < C; c++) {
                tok[c] += g[c];
                pos[c] += g[c];
            }
        }
}

// ---- dropout with the caller's mask: y = x * m (m is 0 or 1 / (1 - p)); dx = dy * m ----
template <typename R>
void dropout(const R* x, const R* m, size_t n, R* y) {
    Timed timed(DROPOUT);
    for (size_t i = 0; i < n; i++) y[i] = m ? x[i] * m[i] : x[i];
}

// ---- LayerNorm over the C channels of each of the N rows ----
// mu = (1/C) sum_c x_c;  var = (1/C) sum_c (x_c - mu)^2;  rstd = 1 / sqrt(var + eps)
// xhat_c = (x_c - mu) * rstd;  y_c = w_c * xhat_c + b_c   (b absent when the model has no biases)
template <typename R>
void layernorm_forward(const R* x, const R* w, const R* b, int N, int C, double eps, R* y, R* mean, R* rstd) {
    Timed timed(LAYERNORM_F);
    for (int n = 0; n < N; n++) {
        const R* xn = x + (size_t)n * C;
        R mu = 0;
        for (int c = 0; c < C; c++) mu += xn[c];
        mu /= C;
        R var = 0;
        for (int c = 0; c < C; c++) var += (xn[c] - mu) * (xn[c] - mu);
        var /= C;
        R s = R(1) / std::sqrt(var + R(eps));
        for (int c = 0; c < C; c++) y[(size_t)n * C + c] = (xn[c] - mu) * s * w[c] + (b ? b[c] : R(0));
        mean[n] = mu;
        rstd[n] = s;
    }
}

// dw_c += sum_n dy_c xhat_c;  db_c += sum_n dy_c;  with g_c = dy_c w_c:
// dx_c = rstd * (g_c - mean_c'(g_c') - xhat_c * mean_c'(g_c' xhat_c'))
template <typename R>
void layernorm_backward(const R* x, const R* w, const R* mean, const R* rstd, const R* dy, int N, int C,
                        R* dx, R* dw, R* db) {
    Timed timed(LAYERNORM_B);
    for (int n = 0; n < N; n++) {
        const R* xn = x + (size_t)n * C;
        const R* dyn = dy + (size_t)n * C;
        R g_mean = 0, gx_mean = 0;
        for (int c = 0; c < C; c++) {
            R xhat = (xn[c] - mean[n]) * rstd[n];
            R g = dyn[c] * w[c];
            g_mean += g;
            gx_mean += g * xhat;
            dw[c] += dyn[c] * xhat;
            if (db) db[c] += dyn[c];
        }
        g_mean /= C;
        gx_mean /= C;
        for (int c = 0; c < C; c++) {
            R xhat = (xn[c] - mean[n]) * rstd[n];
            dx[(size_t)n * C + c] = rstd[n] * (dyn[c] * w[c] - g_mean - xhat * gx_mean);
        }
    }
}

// ---- a Linear layer: y[n, o] = sum_i x[n, i] W[o, i] + b[o], W is (O, I) ----
template <typename R>
void linear_forward(const R* x, const R* W, const R* b, int N, int I, int O, R* y) {
    Timed timed(LINEAR_F);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            R s = b ? b[o] : R(0);
            for (int i = 0; i < I; i++) s += x[(size_t)n * I + i] * W[(size_t)o * I + i];
            y[(size_t)n * O + o] = s;
        }
}

// dx[n, i] = sum_o dy[n, o] W[o, i];  dW[o, i] += sum_n dy[n, o] x[n, i];  db[o] += sum_n dy[n, o]
template <typename R>
void linear_backward(const R* x, const R* W, const R* dy, int N, int I, int O, R* dx, R* dW, R* db) {
    Timed timed(LINEAR_B);
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < I; i++) dx[(size_t)n * I + i] = 0;
        for (int o = 0; o < O; o++) {
            R g = dy[(size_t)n * O + o];
            for (int i = 0; i < I; i++) {
                dx[(size_t)n * I + i] += g * W[(size_t)o * I + i];
                dW[(size_t)o * I + i] += g * x[(size_t)n * I + i];
            }
            if (db) db[o] += g;
        }
    }
}

// ---- GELU, elementwise ----
// exact:  gelu(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2));    gelu'(x) = Phi(x) + x phi(x),  phi(x) = e^(-x^2/2) / sqrt(2 pi)
// tanh:   u = sqrt(2/pi) (x + 0.044715 x^3);  gelu(x) = 0.5 x (1 + tanh u)
//         gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
template <typename R>
R gelu(R x, bool tanh_form) {
    if (tanh_form) {
        R u = std::sqrt(R(2) / R(PI)) * (x + R(0.044715) * x * x * x);
        return R(0.5) * x * (R(1) + std::tanh(u));
    }
    return R(0.5) * x * (R(1) + std::erf(x / std::sqrt(R(2))));
}

template <typename R>
R gelu_derivative(R x, bool tanh_form) {
    if (tanh_form) {
        R k = std::sqrt(R(2) / R(PI));
        R th = std::tanh(k * (x + R(0.044715) * x * x * x));
        return R(0.5) * (R(1) + th) + R(0.5) * x * (R(1) - th * th) * k * (R(1) + R(3) * R(0.044715) * x * x);
    }
    R Phi = R(0.5) * (R(1) + std::erf(x / std::sqrt(R(2))));
    R phi = std::exp(R(-0.5) * x * x) / std::sqrt(R(2) * R(PI));
    return Phi + x * phi;
}

template <typename R>
void gelu_forward(const R* x, size_t n, bool tanh_form, R* y) {
    Timed timed(GELU_F);
    for (size_t i = 0; i < n; i++) y[i] = gelu(x[i], tanh_form);
}

// dx_i = dy_i gelu'(x_i)
template <typename R>
void gelu_backward(const R* x, const R* dy, size_t n, bool tanh_form, R* dx) {
    Timed timed(GELU_B);
    for (size_t i = 0; i < n; i++) dx[i] = dy[i] * gelu_derivative(x[i], tanh_form);
}

// ---- causal multi-head self-attention on qkv (N, 3C): q, k, v side by side, head h at columns h*D .. h*D+D ----
// s[t, j] = q_t . k_j / sqrt(D) for j <= t, -inf for j > t;  p[t, :] = softmax(s[t, :]);  p' = p * mask (dropout)
// y_t = sum_j p'[t, j] v_j, the heads' y side by side: (N, C). probs keeps p (before dropout) for the backward.
template <typename R>
void attention_forward(const R* qkv, const R* mask, int B, int T, int C, int H, R* y, R* probs) {
    Timed timed(ATTENTION_F);
    const int D = C / H;
    const R scale = R(1) / std::sqrt(R(D));
    const R minus_inf = -std::numeric_limits<R>::infinity();
    Vec<R> s(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const R* q = qkv + ((size_t)b * T + t) * 3 * C + h * D;
                R top = minus_inf;
                for (int j = 0; j < T; j++) {
                    const R* k = qkv + ((size_t)b * T + j) * 3 * C + C + h * D;
                    R dot = 0;
                    for (int d = 0; d < D; d++) dot += q[d] * k[d];
                    s[j] = j <= t ? dot * scale : minus_inf;  // the causal mask: key j is hidden from query t > j
                    if (s[j] > top) top = s[j];
                }
                R* p = probs + (((size_t)b * H + h) * T + t) * T;
                R sum = 0;
                for (int j = 0; j < T; j++) {
                    p[j] = std::exp(s[j] - top);  // exp(-inf) = 0: a hidden key gets no weight
                    sum += p[j];
                }
                for (int j = 0; j < T; j++) p[j] /= sum;
                const R* m = mask ? mask + (((size_t)b * H + h) * T + t) * T : nullptr;
                R* out = y + ((size_t)b * T + t) * C + h * D;
                for (int d = 0; d < D; d++) out[d] = 0;
                for (int j = 0; j < T; j++) {
                    R w = m ? p[j] * m[j] : p[j];
                    const R* v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * D;
                    for (int d = 0; d < D; d++) out[d] += w * v[d];
                }
            }
}

// With dy (N, C):  dp'[t, j] = dy_t . v_j;  dv_j += p'[t, j] dy_t;  dp = dp' * mask
// softmax's Jacobian-vector product: ds[t, j] = p[t, j] (dp[t, j] - sum_j' p[t, j'] dp[t, j'])  (0 where hidden)
// dq_t = sum_j ds[t, j] k_j / sqrt(D);  dk_j += ds[t, j] q_t / sqrt(D).  Writes dqkv (N, 3C).
template <typename R>
void attention_backward(const R* qkv, const R* probs, const R* mask, const R* dy, int B, int T, int C, int H,
                        R* dqkv) {
    Timed timed(ATTENTION_B);
    const int D = C / H;
    const R scale = R(1) / std::sqrt(R(D));
    for (size_t i = 0; i < (size_t)B * T * 3 * C; i++) dqkv[i] = 0;
    Vec<R> dp(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const R* p = probs + (((size_t)b * H + h) * T + t) * T;
                const R* m = mask ? mask + (((size_t)b * H + h) * T + t) * T : nullptr;
                const R* g = dy + ((size_t)b * T + t) * C + h * D;
                for (int j = 0; j < T; j++) {
                    const R* v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * D;
                    R* dv = dqkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * D;
                    R w = m ? p[j] * m[j] : p[j];
                    R dot = 0;
                    for (int d = 0; d < D; d++) {
                        dot += g[d] * v[d];
                        dv[d] += w * g[d];
                    }
                    dp[j] = m ? dot * m[j] : dot;
                }
                R pdp = 0;
                for (int j = 0; j < T; j++) pdp += p[j] * dp[j];
                const R* q = qkv + ((size_t)b * T + t) * 3 * C + h * D;
                R* dq = dqkv + ((size_t)b * T + t) * 3 * C + h * D;
                for (int j = 0; j <= t; j++) {  // hidden keys (j > t) have p = 0: no gradient reaches them
                    R ds = p[j] * (dp[j] - pdp) * scale;
                    const R* k = qkv + ((size_t)b * T + j) * 3 * C + C + h * D;
                    R* dk = dqkv + ((size_t)b * T + j) * 3 * C + C + h * D;
                    for (int d = 0; d < D; d++) {
                        dq[d] += ds * k[d];
                        dk[d] += ds * q[d];
                    }
                }
            }
}

// ---- cross-entropy over the vocabulary, mean over the rows whose target is not -1 ----
// loss = (1/n) sum_rows (log sum_v e^(z_v) - z_target);  dz = (softmax(z) - onehot(target)) / n, 0 on ignored rows
template <typename R>
double cross_entropy_forward(const R* logits, const int64_t* targets, int N, int V) {
    Timed timed(CROSS_ENTROPY_F);
    double total = 0;
    int n = 0;
    for (int r = 0; r < N; r++) {
        if (targets[r] < 0) continue;
        const R* z = logits + (size_t)r * V;
        R top = z[0];
        for (int v = 1; v < V; v++) top = z[v] > top ? z[v] : top;
        R sum = 0;
        for (int v = 0; v < V; v++) sum += std::exp(z[v] - top);
        total += (double)(std::log(sum) + top - z[targets[r]]);
        n++;
    }
    return total / n;  // no targets: 0 / 0 = NaN, as torch gives
}

template <typename R>
void cross_entropy_backward(const R* logits, const int64_t* targets, int N, int V, R* dlogits) {
    Timed timed(CROSS_ENTROPY_B);
    int n = 0;
    for (int r = 0; r < N; r++) n += targets[r] >= 0;
    for (int r = 0; r < N; r++) {
        const R* z = logits + (size_t)r * V;
        R* dz = dlogits + (size_t)r * V;
        if (targets[r] < 0) {
            for (int v = 0; v < V; v++) dz[v] = 0;
            continue;
        }
        R top = z[0];
        for (int v = 1; v < V; v++) top = z[v] > top ? z[v] : top;
        R sum = 0;
        for (int v = 0; v < V; v++) sum += std::exp(z[v] - top);
        for (int v = 0; v < V; v++) dz[v] = (std::exp(z[v] - top) / sum - (v == targets[r] ? R(1) : R(0))) / R(n);
    }
}

// ---- one block: x_mid = x + drop(W_O attention(ln_1(x)));  y = x_mid + drop(MLP(ln_2(x_mid))) ----
// MLP(u) = W_proj gelu(W_fc u + b_fc) + b_proj:  C -> 4C -> C

template <typename R>
struct BlockActs {  // what a block's backward needs from its forward
    Vec<R> x, ln1, mean1, rstd1, qkv, probs, att, attn_out, x_mid, ln2, mean2, rstd2, fc, act, mlp_out;
    BlockActs(int B, int T, int C, int H)
        : x((size_t)B * T * C), ln1(x.size()), mean1((size_t)B * T), rstd1(mean1.size()), qkv(x.size() * 3),
          probs((size_t)B * H * T * T), att(x.size()), attn_out(x.size()), x_mid(x.size()), ln2(x.size()),
          mean2(mean1.size()), rstd2(mean1.size()), fc(x.size() * 4), act(fc.size()), mlp_out(x.size()) {}
};

template <typename R> const R* at(const void* p) { return static_cast<const R*>(p); }
template <typename R> R* at(void* p) { return static_cast<R*>(p); }

template <typename R>
void block_forward(const Model& m, const Layer& w, const Masks* mk, int B, int T, const R* x, BlockActs<R>& a,
                   R* y) {
    const int N = B * T, C = m.n_embd;
    const size_t NC = (size_t)N * C;
    std::copy(x, x + NC, a.x.begin());  // kept for the backward; y may be x itself
    layernorm_forward(a.x.data(), at<R>(w.ln_1_w), at<R>(w.ln_1_b), N, C, m.eps, a.ln1.data(), a.mean1.data(), a.rstd1.data());
    linear_forward(a.ln1.data(), at<R>(w.c_attn_w), at<R>(w.c_attn_b), N, C, 3 * C, a.qkv.data());
    attention_forward(a.qkv.data(), mk ? at<R>(mk->attn) : nullptr, B, T, C, m.n_head, a.att.data(), a.probs.data());
    linear_forward(a.att.data(), at<R>(w.attn_proj_w), at<R>(w.attn_proj_b), N, C, C, a.attn_out.data());
    dropout(a.attn_out.data(), mk ? at<R>(mk->attn_resid) : nullptr, NC, a.x_mid.data());
    for (size_t i = 0; i < NC; i++) a.x_mid[i] += a.x[i];  // the residual add (y may be x: read the copy)
    layernorm_forward(a.x_mid.data(), at<R>(w.ln_2_w), at<R>(w.ln_2_b), N, C, m.eps, a.ln2.data(), a.mean2.data(),
                      a.rstd2.data());
    linear_forward(a.ln2.data(), at<R>(w.c_fc_w), at<R>(w.c_fc_b), N, C, 4 * C, a.fc.data());
    gelu_forward(a.fc.data(), a.fc.size(), m.gelu_tanh != 0, a.act.data());
    linear_forward(a.act.data(), at<R>(w.mlp_proj_w), at<R>(w.mlp_proj_b), N, 4 * C, C, a.mlp_out.data());
    dropout(a.mlp_out.data(), mk ? at<R>(mk->mlp_resid) : nullptr, NC, y);
    for (size_t i = 0; i < NC; i++) y[i] += a.x_mid[i];  // the residual add
}

// The backward of block_forward, the same steps in reverse. A residual add y = x + f(x) passes dy on unchanged
// to x AND through f: dx = dy + df/dx^T dy.  Writes dx (N, C); adds into the gradients g.
template <typename R>
void block_backward(const Model& m, const Layer& w, const Layer& g, const Masks* mk, int B, int T,
                    const BlockActs<R>& a, const R* dy, R* dx) {
    const int N = B * T, C = m.n_embd;
    const size_t NC = (size_t)N * C;
    Vec<R> d_out(NC), d_act(a.fc.size()), d_fc(a.fc.size()), d_ln(NC), d_mid(NC), d_att(NC), d_qkv(a.qkv.size());
    // y = x_mid + drop(MLP(ln_2(x_mid)))
    dropout(dy, mk ? at<R>(mk->mlp_resid) : nullptr, NC, d_out.data());
    linear_backward(a.act.data(), at<R>(w.mlp_proj_w), d_out.data(), N, 4 * C, C, d_act.data(), at<R>(g.mlp_proj_w),
                    at<R>(g.mlp_proj_b));
    gelu_backward(a.fc.data(), d_act.data(), a.fc.size(), m.gelu_tanh != 0, d_fc.data());
    linear_backward(a.ln2.data(), at<R>(w.c_fc_w), d_fc.data(), N, C, 4 * C, d_ln.data(), at<R>(g.c_fc_w),
                    at<R>(g.c_fc_b));
    layernorm_backward(a.x_mid.data(), at<R>(w.ln_2_w), a.mean2.data(), a.rstd2.data(), d_ln.data(), N, C,
                       d_mid.data(), at<R>(g.ln_2_w), at<R>(g.ln_2_b));
    for (size_t i = 0; i < NC; i++) d_mid[i] += dy[i];  // the residual's own path
    // x_mid = x + drop(W_O attention(ln_1(x)))
    dropout(d_mid.data(), mk ? at<R>(mk->attn_resid) : nullptr, NC, d_out.data());
    linear_backward(a.att.data(), at<R>(w.attn_proj_w), d_out.data(), N, C, C, d_att.data(), at<R>(g.attn_proj_w),
                    at<R>(g.attn_proj_b));
    attention_backward(a.qkv.data(), a.probs.data(), mk ? at<R>(mk->attn) : nullptr, d_att.data(), B, T, C, m.n_head,
                       d_qkv.data());
    linear_backward(a.ln1.data(), at<R>(w.c_attn_w), d_qkv.data(), N, C, 3 * C, d_ln.data(), at<R>(g.c_attn_w),
                    at<R>(g.c_attn_b));
    layernorm_backward(a.x.data(), at<R>(w.ln_1_w), a.mean1.data(), a.rstd1.data(), d_ln.data(), N, C, dx,
                       at<R>(g.ln_1_w), at<R>(g.ln_1_b));
    for (size_t i = 0; i < NC; i++) dx[i] += d_mid[i];  // the residual's own path
}

// ---- the whole model ----
// x = drop(wte[idx] + wpe[t]);  x = block_l(x) for l = 0 .. L-1;  logits = ln_f(x) wte^T (the head tied to wte)
// With targets: loss = cross_entropy(logits, targets), and with grads the gradient of the loss in every tensor.
// The tied wte gets two paths: the head's dwte[v, c] += sum_n dlogits[n, v] ln_f(x)[n, c] and the embedding's.
template <typename R>
int model_step(const Model& m, const Model* grads, Batch& batch) {
    const int B = batch.B, T = batch.T, C = m.n_embd, V = m.vocab_size, N = B * T;
    if (T > m.block_size || T < 1 || B < 1 || C % m.n_head) return 1;
    for (int i = 0; i < N; i++)
        if (batch.idx[i] < 0 || batch.idx[i] >= V) return 2;
    for (int i = 0; batch.targets && i < N; i++)  // a target is a token id, or -1: ignored
        if (batch.targets[i] < -1 || batch.targets[i] >= V) return 3;
    const size_t NC = (size_t)N * C;
    Vec<R> x0(NC), x(NC);
    embedding_forward(batch.idx, at<R>(m.wte), at<R>(m.wpe), B, T, C, x0.data());
    dropout(x0.data(), at<R>(batch.emb_mask), NC, x.data());
    std::vector<BlockActs<R>> acts;
    acts.reserve(m.n_layer);
    for (int l = 0; l < m.n_layer; l++) {
        acts.emplace_back(B, T, C, m.n_head);
        const Masks* mk = batch.masks ? batch.masks + l : nullptr;
        block_forward(m, m.layers[l], mk, B, T, x.data(), acts[l], x.data());
    }
    Vec<R> xf(NC), mean(N), rstd(N);
    layernorm_forward(x.data(), at<R>(m.ln_f_w), at<R>(m.ln_f_b), N, C, m.eps, xf.data(), mean.data(), rstd.data());
    R* logits = at<R>(batch.logits);
    linear_forward(xf.data(), at<R>(m.wte), static_cast<const R*>(nullptr), N, C, V, logits);
    if (!batch.targets) return 0;
    batch.loss = cross_entropy_forward(logits, batch.targets, N, V);
    if (!grads) return 0;
    // backward: the same steps in reverse
    Vec<R> dlogits((size_t)N * V), dxf(NC), dx(NC), dnext(NC);
    cross_entropy_backward(logits, batch.targets, N, V, dlogits.data());
    linear_backward(xf.data(), at<R>(m.wte), dlogits.data(), N, C, V, dxf.data(), at<R>(grads->wte),
                    static_cast<R*>(nullptr));
    layernorm_backward(x.data(), at<R>(m.ln_f_w), mean.data(), rstd.data(), dxf.data(), N, C, dx.data(),
                       at<R>(grads->ln_f_w), at<R>(grads->ln_f_b));
    for (int l = m.n_layer - 1; l >= 0; l--) {
        const Masks* mk = batch.masks ? batch.masks + l : nullptr;
        block_backward(m, m.layers[l], grads->layers[l], mk, B, T, acts[l], dx.data(), dnext.data());
        std::swap(dx, dnext);
    }
    dropout(dx.data(), at<R>(batch.emb_mask), NC, dnext.data());
    embedding_backward(batch.idx, dnext.data(), B, T, C, at<R>(grads->wte), at<R>(grads->wpe));
    return 0;
}

// ---- the optimizer ----
// global-norm clipping: norm = sqrt(sum of every gradient element squared); with max_norm > 0 and
// coef = max_norm / (norm + 1e-6) < 1, every gradient is multiplied by coef (torch's clip_grad_norm_)
template <typename R>
double clip_grad_norm(R* const* grads, const int64_t* sizes, int n, double max_norm) {
    Timed timed(CLIP);
    double sq = 0;
    for (int i = 0; i < n; i++)
        for (int64_t j = 0; j < sizes[i]; j++) sq += (double)grads[i][j] * (double)grads[i][j];
    double norm = std::sqrt(sq);
    double coef = max_norm / (norm + 1e-6);
    if (max_norm > 0 && coef < 1)
        for (int i = 0; i < n; i++)
            for (int64_t j = 0; j < sizes[i]; j++) grads[i][j] *= R(coef);
    return norm;
}

// AdamW at step t (1, 2, ...), one tensor: decoupled decay first, then Adam with bias correction
//   theta <- theta (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   theta <- theta - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
template <typename R>
void adamw(R* theta, const R* g, R* mom, R* vel, int64_t n, double lr, double b1, double b2, double eps, double wd,
           int64_t t) {
    Timed timed(ADAMW);
    const double c1 = 1 - std::pow(b1, (double)t), c2 = 1 - std::pow(b2, (double)t);
    for (int64_t i = 0; i < n; i++) {
        theta[i] *= R(1 - lr * wd);
        mom[i] = R(b1) * mom[i] + R(1 - b1) * g[i];
        vel[i] = R(b2) * vel[i] + R(1 - b2) * g[i] * g[i];
        theta[i] -= R(lr / c1) * mom[i] / (std::sqrt(vel[i] / R(c2)) + R(eps));
    }
}

}  // namespace

// ---- the exported entry points: _f32 on float tensors, _f64 on double ----
// gptlab_step: logits (and loss with targets; gradients added into `grads` unless it is NULL). Returns 0, or 1 for
// a shape the model cannot take, 2 for a token id outside the vocabulary, 3 for a target neither an id nor -1.
#define EXPORT(S, R)                                                                                             \
    extern "C" int gptlab_step_##S(const Model* m, const Model* grads, Batch* batch) {                          \
        return model_step<R>(*m, grads, *batch);                                                                 \
    }                                                                                                            \
    extern "C" double gptlab_clip_grad_norm_##S(R* const* grads, const int64_t* sizes, int n, double max_norm) { \
        return clip_grad_norm<R>(grads, sizes, n, max_norm);                                                    \
    }                                                                                                            \
    extern "C" void gptlab_adamw_##S(R* theta, const R* g, R* m, R* v, int64_t n, double lr, double b1,        \
                                     double b2, double eps, double wd, int64_t t) {                             \
        adamw<R>(theta, g, m, v, n, lr, b1, b2, eps, wd, t);                                                     \
    }                                                                                                            \
    /* the pieces alone, each forward then (with an upstream gradient) its backward, for the tests */           \
    extern "C" void gptlab_layernorm_##S(const R* x, const R* w, const R* b, int N, int C, double eps, R* y,     \
                                         const R* dy, R* dx, R* dw, R* db) {                                     \
        Vec<R> mean(N), rstd(N);                                                                                 \
        layernorm_forward(x, w, b, N, C, eps, y, mean.data(), rstd.data());                                      \
        if (dy) layernorm_backward(x, w, mean.data(), rstd.data(), dy, N, C, dx, dw, db);                         \
    }                                                                                                            \
    extern "C" void gptlab_attention_##S(const R* qkv, const R* mask, int B, int T, int C, int H, R* y,          \
                                         const R* dy, R* dqkv) {                                                 \
        Vec<R> probs((size_t)B * H * T * T);                                                                     \
        attention_forward(qkv, mask, B, T, C, H, y, probs.data());                                               \
        if (dy) attention_backward(qkv, probs.data(), mask, dy, B, T, C, H, dqkv);                               \
    }                                                                                                            \
    extern "C" void gptlab_gelu_##S(const R* x, int64_t n, int tanh_form, R* y, const R* dy, R* dx) {           \
        gelu_forward(x, n, tanh_form != 0, y);                                                                   \
        if (dy) gelu_backward(x, dy, n, tanh_form != 0, dx);                                                     \
    }                                                                                                            \
    extern "C" void gptlab_mlp_##S(const R* x, const R* w_fc, const R* b_fc, const R* w_proj, const R* b_proj,  \
                                   int N, int C, int tanh_form, R* y, const R* dy, R* dx, R* dw_fc, R* db_fc,    \
                                   R* dw_proj, R* db_proj) {                                                     \
        Vec<R> fc((size_t)N * 4 * C), act(fc.size()), d_act(fc.size());                                          \
        linear_forward(x, w_fc, b_fc, N, C, 4 * C, fc.data());                                                   \
        gelu_forward(fc.data(), fc.size(), tanh_form != 0, act.data());                                          \
        linear_forward(act.data(), w_proj, b_proj, N, 4 * C, C, y);                                              \
        if (!dy) return;                                                                                         \
        linear_backward(act.data(), w_proj, dy, N, 4 * C, C, d_act.data(), dw_proj, db_proj);                    \
        gelu_backward(fc.data(), d_act.data(), fc.size(), tanh_form != 0, d_act.data());                         \
        linear_backward(x, w_fc, d_act.data(), N, C, 4 * C, dx, dw_fc, db_fc);                                   \
    }                                                                                                            \
    extern "C" double gptlab_cross_entropy_##S(const R* logits, const int64_t* targets, int N, int V,           \
                                               R* dlogits) {                                                     \
        if (dlogits) cross_entropy_backward(logits, targets, N, V, dlogits);                                     \
        return cross_entropy_forward(logits, targets, N, V);                                                     \
    }                                                                                                            \
    extern "C" void gptlab_block_##S(const Model* m, const Layer* w, const Layer* g, const Masks* mk, int B,     \
                                     int T, const R* x, R* y, const R* dy, R* dx) {                              \
        BlockActs<R> a(B, T, m->n_embd, m->n_head);                                                              \
        block_forward(*m, *w, mk, B, T, x, a, y);                                                                \
        if (dy) block_backward(*m, *w, *g, mk, B, T, a, dy, dx);                                                 \
    }

EXPORT(f32, float)
EXPORT(f64, double)
