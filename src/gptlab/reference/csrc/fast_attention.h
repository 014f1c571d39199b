// Causal multi-head self-attention for fast.cpp (included inside its namespace: dot, axpy, exps, sum_of, max_of,
// PARALLEL_FOR and RUNG come from there). reference.cpp's equations on qkv (N, 3C), head h at columns h D .. h D + D:
//   s[t, j] = q_t . k_j / sqrt(D) (j <= t);  p[t, :] = softmax(s[t, :]);  y_t = sum_j p[t, j] m[t, j] v_j
// Rungs 1-4 keep p (B, H, T, T) for the backward, as the naive engine does. Rung 5 keeps one number per row, the
// log-sum-exp lse_t = max_j s + log sum_j e^(s - max): the forward walks the keys in blocks of KEYS, keeping a
// running maximum, sum and output that it rescales when a block raises the maximum (the online softmax); the
// backward recomputes p[t, j] = e^(s[t, j] - lse_t), and needs sum_j p dp = dy_t . y_t, which the output gives.
// Threads take whole (batch, head) pairs: each writes its own columns of y and dqkv, in the order one thread would.
#pragma once

constexpr int KEYS = 64, QUERIES = 64;  // rung 5: keys and queries per block of the online softmax

static inline const float* head(const float* qkv, int b, int T, int t, int C, int part, int h, int D) {
    return qkv + ((size_t)b * T + t) * 3 * C + (size_t)part * C + (size_t)h * D;
}

// rung 5: one (batch, head)'s q, k, v rows (3C apart) and its columns of y and dqkv
struct Heads {
    const float* qkv;
    int b, h, T, C, D;
    // the head's operands packed once for every block that reads them as B (packed_positions, packed_channels):
    // the forward packs kt and vs, the backward kt, vt, ks, qs and dys
    const float *kt = nullptr, *vt = nullptr, *ks = nullptr, *vs = nullptr, *qs = nullptr, *dys = nullptr;
    const float* at(int part, int t) const { return qkv + ((size_t)b * T + t) * 3 * C + (size_t)part * C + (size_t)h * D; }
    Mat rows(int part, int t) const { return {at(part, t), 3L * C, 1}; }        // (t.., d)
    Mat columns(int part, int t) const { return {at(part, t), 1, 3L * C}; }     // (d, t..): k^T, v^T
    size_t out(int t) const { return ((size_t)b * T + t) * C + (size_t)h * D; }  // into (N, C)
    size_t grad(int part, int t) const { return ((size_t)b * T + t) * 3 * C + (size_t)part * C + (size_t)h * D; }
};

// rung 5: a head's operand packed once, in the slivers the kernel reads as B (slivers of NR columns, k-major, zero
// past the edge), instead of once per block that reads it. By position: the transpose (D x T), sliver s the
// positions s NR .. s NR + NR - 1, D deep (keys for Q K^T, values for dY V^T), a block of keys from j0 at sliver
// j0 / NR. By channel: the rows themselves (T x D), sliver s the channels s NR .., T deep (values for P V, keys for
// dS K, queries for dS^T Q, dy for P^T dY), a block of positions from t0 at row t0 of every sliver.
static_assert(KEYS % NR == 0 && QUERIES % NR == 0, "a block of keys starts at a whole sliver");
static const float* packed_positions(const float* rows, long stride, int T, int D, Vec& buffer) {
    float* out = scratch(buffer, (size_t)(T + NR - 1) / NR * NR * D);
    for (int s = 0; s * NR < T; s++) pack(rows + (size_t)s * NR * stride, 1, stride, D, std::min(NR, T - s * NR), NR,
                                          out + (size_t)s * D * NR);
    return out;
}
static const float* packed_channels(const float* rows, long stride, int T, int D, Vec& buffer) {
    float* out = scratch(buffer, (size_t)(D + NR - 1) / NR * NR * T);
    for (int s = 0; s * NR < D; s++) pack(rows + (size_t)s * NR, stride, 1, T, std::min(NR, D - s * NR), NR,
                                          out + (size_t)s * T * NR);
    return out;
}

// C (M x N, rows ldc apart) [+]= A (M x K) B on this thread, B given packed: sliver js at b + js bstride, K deep.
// A is packed here, whole (K at most KC: one block of K, the sums in gemm's order); a deeper K goes through gemm
// with B as it is in memory.
static void product(int M, int N, int K, Mat A, Mat B, const float* b, long bstride, float* C, long ldc, bool acc) {
    if (K > TILE.kc) return gemm(M, N, K, A, B, C, ldc, acc, nullptr, 1);
    static thread_local std::vector<float> a_buf;
    const int m_sl = (M + MR - 1) / MR, n_sl = (N + NR - 1) / NR;
    float* ap = scratch(a_buf, (size_t)K * m_sl * MR);
    for (int s = 0; s < m_sl; s++)
        pack(A.p + (size_t)s * MR * A.rs, A.cs, A.rs, K, std::min(MR, M - s * MR), MR, ap + (size_t)s * K * MR);
    for (int js = 0; js < n_sl; js++)
        for (int is = 0; is < m_sl; is++) {
            const int m0 = is * MR, n0 = js * NR;
            kernel(K, ap + (size_t)is * K * MR, b + js * bstride, C + (size_t)m0 * ldc + n0, ldc,
                   std::min(MR, M - m0), std::min(NR, N - n0), acc);
        }
}

static const float* at_sliver(const float* packed, int j0, int D) {  // by position: the block from position j0
    return packed + (size_t)(j0 / NR) * D * NR;
}
static const float* at_row(const float* packed, int t0) {  // by channel: the block from position t0
    return packed + (size_t)t0 * NR;
}

// p = e^(s scale - shift) for the nk keys from j0 of query t (s: the block's row), 0 for a hidden key (j > t)
static inline void softmax_row(float* s, int nk, int j0, int t, float scale, float shift) {
    const int seen = std::clamp(t - j0 + 1, 0, nk);
    for (int j = 0; j < seen; j++) s[j] *= scale;
    exps(s, shift, seen, s);
    std::fill(s + seen, s + nk, 0.0f);
}

// Queries t0 .. t0 + nq over the key blocks up to t0 + nq: S = Q K^T (a product), the online softmax on S's rows
// (running maximum m and sum l; what was summed shrinks by e^(m_old - m_new) when a block raises m), Y += P' V
// (a product); then y = Y / l and lse = m + log l.
static void fused_forward(const Heads& x, int t0, int nq, float scale, const float* mask, float* y, float* lse) {
    const int D = x.D;
    Vec S((size_t)QUERIES * KEYS), Y((size_t)QUERIES * D, 0.0f), m(QUERIES, -std::numeric_limits<float>::infinity()),
        l(QUERIES, 0.0f);
    for (int j0 = 0; j0 < t0 + nq; j0 += KEYS) {
        const int nk = std::min(KEYS, t0 + nq - j0);
        product(nq, nk, D, x.rows(0, t0), x.columns(1, j0), at_sliver(x.kt, j0, D), (long)D * NR, S.data(), KEYS,
                false);
        for (int i = 0; i < nq; i++) {
            float* s = S.data() + (size_t)i * KEYS;
            const int t = t0 + i, seen = std::clamp(t - j0 + 1, 0, nk);
            const float top = std::max(m[i], max_of(s, seen) * scale);
            const float shrink = std::exp(m[i] - top);  // e^(-inf) = 0 for the first block
            l[i] *= shrink;
            for (int d = 0; d < D; d++) Y[(size_t)i * D + d] *= shrink;
            m[i] = top;
            softmax_row(s, nk, j0, t, scale, top);
            l[i] += sum_of(s, seen);
            if (mask)
                for (int j = 0; j < seen; j++) s[j] *= mask[(size_t)t * x.T + j0 + j];
        }
        product(nq, D, nk, {S.data(), KEYS, 1}, x.rows(2, j0), at_row(x.vs, j0), (long)x.T * NR, Y.data(), D, true);
    }
    for (int i = 0; i < nq; i++) {
        float* out = y + x.out(t0 + i);
        for (int d = 0; d < D; d++) out[d] = Y[(size_t)i * D + d] / l[i];
        lse[t0 + i] = m[i] + std::log(l[i]);
    }
}

// The backward of one block of queries, key block by key block: P recomputed from lse; dP' = dY V^T;
// dV += (P m)^T dY; dS = P (dP' m - dy . y) scale; dQ += dS K; dK += dS^T Q (each a product).
static void fused_backward(const Heads& x, int t0, int nq, float scale, const float* mask, const float* y,
                           const float* dy, const float* lse, float* dqkv) {
    const int D = x.D, C = x.C;
    Vec P((size_t)QUERIES * KEYS), dP((size_t)QUERIES * KEYS), PM(mask ? (size_t)QUERIES * KEYS : 0), delta(nq);
    const Mat dY{dy + x.out(t0), C, 1};
    for (int i = 0; i < nq; i++) delta[i] = dot(dy + x.out(t0 + i), y + x.out(t0 + i), D);
    for (int j0 = 0; j0 < t0 + nq; j0 += KEYS) {
        const int nk = std::min(KEYS, t0 + nq - j0);
        product(nq, nk, D, x.rows(0, t0), x.columns(1, j0), at_sliver(x.kt, j0, D), (long)D * NR, P.data(), KEYS,
                false);
        product(nq, nk, D, dY, x.columns(2, j0), at_sliver(x.vt, j0, D), (long)D * NR, dP.data(), KEYS, false);
        for (int i = 0; i < nq; i++) {
            const int t = t0 + i;
            float *p = P.data() + (size_t)i * KEYS, *dp = dP.data() + (size_t)i * KEYS;
            softmax_row(p, nk, j0, t, scale, lse[t]);
            const float* mk = mask ? mask + (size_t)t * x.T + j0 : nullptr;
            for (int j = 0; j < nk; j++) {
                if (mk) PM[(size_t)i * KEYS + j] = p[j] * mk[j];
                dp[j] = p[j] * ((mk ? dp[j] * mk[j] : dp[j]) - delta[i]) * scale;
            }
        }
        const long by_channel = (long)x.T * NR;
        product(nk, D, nq, {mask ? PM.data() : P.data(), 1, KEYS}, dY, at_row(x.dys, t0), by_channel,
                dqkv + x.grad(2, j0), 3L * C, true);
        product(nq, D, nk, {dP.data(), KEYS, 1}, x.rows(1, j0), at_row(x.ks, j0), by_channel, dqkv + x.grad(0, t0),
                3L * C, true);
        product(nk, D, nq, {dP.data(), 1, KEYS}, x.rows(0, t0), at_row(x.qs, t0), by_channel, dqkv + x.grad(1, j0),
                3L * C, true);
    }
}

void attention_forward(const float* qkv, const float* mask, int B, int T, int C, int H, float* y, float* probs,
                       float* lse) {
    Timed timed(ATTENTION_F);
    const int D = C / H;
    const float scale = 1.0f / std::sqrt((float)D);
    PARALLEL_FOR
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        if (RUNG >= FUSED) {
            Heads x{qkv, b, h, T, C, D};
            static thread_local Vec kt, vs;
            x.kt = packed_positions(x.at(1, 0), 3L * C, T, D, kt);
            x.vs = packed_channels(x.at(2, 0), 3L * C, T, D, vs);
            for (int t0 = 0; t0 < T; t0 += QUERIES) fused_forward(x, t0, std::min(QUERIES, T - t0), scale,
                                                                  mask ? mask + (size_t)bh * T * T : nullptr, y,
                                                                  lse + (size_t)bh * T);
            continue;
        }
        Vec s(T);
        for (int t = 0; t < T; t++) {
            const float* q = head(qkv, b, T, t, C, 0, h, D);
            const float* m = mask ? mask + ((size_t)bh * T + t) * T : nullptr;
            float* out = y + ((size_t)b * T + t) * C + (size_t)h * D;
            std::fill(out, out + D, 0.0f);
            for (int j = 0; j <= t; j++) s[j] = dot(q, head(qkv, b, T, j, C, 1, h, D), D) * scale;
            float* p = probs + ((size_t)bh * T + t) * T;
            exps(s.data(), max_of(s.data(), t + 1), t + 1, p);
            const float inv = 1.0f / sum_of(p, t + 1);
            for (int j = 0; j <= t; j++) p[j] *= inv;
            for (int j = t + 1; j < T; j++) p[j] = 0.0f;  // the causal mask: key j is hidden from query t < j
            for (int j = 0; j <= t; j++) axpy(m ? p[j] * m[j] : p[j], head(qkv, b, T, j, C, 2, h, D), out, D);
        }
    }
}

// dp'[t, j] = dy_t . v_j;  dv_j += p m dy_t;  dp = dp' m;  ds = p (dp - sum_j p dp);  dq_t += ds k_j / sqrt(D);
// dk_j += ds q_t / sqrt(D). Writes dqkv (N, 3C).
void attention_backward(const float* qkv, const float* probs, const float* lse, const float* y, const float* mask,
                        const float* dy, int B, int T, int C, int H, float* dqkv) {
    Timed timed(ATTENTION_B);
    const int D = C / H;
    const float scale = 1.0f / std::sqrt((float)D);
    PARALLEL_FOR
    for (size_t i = 0; i < (size_t)B * T * 3 * C; i++) dqkv[i] = 0;
    PARALLEL_FOR
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        if (RUNG >= FUSED) {
            Heads x{qkv, b, h, T, C, D};
            static thread_local Vec kt, vt, ks, qs, dys;
            x.kt = packed_positions(x.at(1, 0), 3L * C, T, D, kt);
            x.vt = packed_positions(x.at(2, 0), 3L * C, T, D, vt);
            x.ks = packed_channels(x.at(1, 0), 3L * C, T, D, ks);
            x.qs = packed_channels(x.at(0, 0), 3L * C, T, D, qs);
            x.dys = packed_channels(dy + x.out(0), C, T, D, dys);
            for (int t0 = 0; t0 < T; t0 += QUERIES)
                fused_backward(x, t0, std::min(QUERIES, T - t0), scale, mask ? mask + (size_t)bh * T * T : nullptr,
                               y, dy, lse + (size_t)bh * T, dqkv);
            continue;
        }
        for (int t = 0; t < T; t++) {
            const float *q = head(qkv, b, T, t, C, 0, h, D), *g = dy + ((size_t)b * T + t) * C + (size_t)h * D;
            const float* m = mask ? mask + ((size_t)bh * T + t) * T : nullptr;
            float* dq = dqkv + ((size_t)b * T + t) * 3 * C + (size_t)h * D;
            const float* p = probs + ((size_t)bh * T + t) * T;
            float pdp = 0;
            Vec dp(t + 1);
            for (int j = 0; j <= t; j++) {
                float* dv = dqkv + ((size_t)b * T + j) * 3 * C + 2 * (size_t)C + (size_t)h * D;
                float d = dot(g, head(qkv, b, T, j, C, 2, h, D), D);
                axpy(m ? p[j] * m[j] : p[j], g, dv, D);
                dp[j] = m ? d * m[j] : d;
                pdp += p[j] * dp[j];
            }
            for (int j = 0; j <= t; j++) {
                const float ds = p[j] * (dp[j] - pdp) * scale;
                float* dk = dqkv + ((size_t)b * T + j) * 3 * C + (size_t)C + (size_t)h * D;
                axpy(ds, head(qkv, b, T, j, C, 1, h, D), dq, D);
                axpy(ds, q, dk, D);
            }
        }
    }
}
