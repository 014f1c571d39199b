// The block, the model's step, clipping and AdamW for fast.cpp (included inside its namespace), reference.cpp's
// equations in reference.cpp's order. Each block's input stays in its own buffer (no copy); at rung 5 the residual
// adds live inside the LayerNorms (forward and backward) and GELU inside the MLP's products.
#pragma once

struct BlockActs {  // what a block's backward needs from its forward; x is the block's input
    Vec x, ln1, mean1, rstd1, qkv, probs, lse, att, attn_out, x_mid, ln2, mean2, rstd2, fc, act, mlp_out;
    BlockActs(int B, int T, int C, int H)
        : x((size_t)B * T * C), ln1(x.size()), mean1((size_t)B * T), rstd1(mean1.size()), qkv(x.size() * 3),
          probs(RUNG >= FUSED ? 0 : (size_t)B * H * T * T), lse(RUNG >= FUSED ? (size_t)B * H * T : 0),
          att(x.size()), attn_out(x.size()), x_mid(x.size()), ln2(x.size()), mean2(mean1.size()),
          rstd2(mean1.size()), fc(x.size() * 4), act(fc.size()), mlp_out(x.size()) {}
};

// The step's buffers, kept from one call to the next (a fresh buffer is fresh pages, and the kernel's page faults
// cost more than the FLOPs of a small layer): every one is written whole before it is read. One caller at a time.
static Vec& kept(int slot, size_t n) {
    static std::vector<Vec> slots(16);
    if (slots[slot].size() != n) slots[slot].resize(n);
    return slots[slot];
}
static std::vector<BlockActs>& kept_acts(const Model& md, int B, int T) {
    static std::vector<BlockActs> acts;
    static int shape[5] = {};
    const int now[5] = {md.n_layer, B, T, md.n_embd, md.n_head};
    if (!std::equal(now, now + 5, shape)) {
        acts.clear();
        for (int l = 0; l < md.n_layer; l++) acts.emplace_back(B, T, md.n_embd, md.n_head);
        std::copy(now, now + 5, shape);
    }
    return acts;
}

template <typename P> const float* at(P p) { return static_cast<const float*>(p); }
static float* mut(void* p) { return static_cast<float*>(p); }

static void add_into(float* y, const float* a, const float* m, const float* b, size_t n) {  // y = a m + b
    PARALLEL_FOR_OVER(n)
    for (size_t i = 0; i < n; i++) y[i] = (m ? a[i] * m[i] : a[i]) + b[i];
}

void block_forward(const Model& md, const Layer& w, const Masks* mk, int B, int T, BlockActs& a, float* y) {
    const int N = B * T, C = md.n_embd;
    const size_t NC = (size_t)N * C;
    const bool tanh_form = md.gelu_tanh != 0;
    layernorm_forward(a.x.data(), at(w.ln_1_w), at(w.ln_1_b), N, C, md.eps, a.ln1.data(), a.mean1.data(),
                      a.rstd1.data());
    linear_forward(a.ln1.data(), at(w.c_attn_w), at(w.c_attn_b), N, C, 3 * C, a.qkv.data());
    attention_forward(a.qkv.data(), mk ? at(mk->attn) : nullptr, B, T, C, md.n_head, a.att.data(), a.probs.data(),
                      a.lse.data());
    linear_forward(a.att.data(), at(w.attn_proj_w), at(w.attn_proj_b), N, C, C, a.attn_out.data());
    const float* attn_mask = mk ? at(mk->attn_resid) : nullptr;
    if (RUNG >= FUSED) {  // x_mid = x + drop(attn_out) formed inside ln_2's pass
        layernorm_forward(a.x.data(), at(w.ln_2_w), at(w.ln_2_b), N, C, md.eps, a.ln2.data(), a.mean2.data(),
                          a.rstd2.data(), a.attn_out.data(), attn_mask, a.x_mid.data());
        Epilogue gelu_out;
        gelu_out.act = a.act.data();
        gelu_out.tanh_form = tanh_form;
        linear_forward(a.ln2.data(), at(w.c_fc_w), at(w.c_fc_b), N, C, 4 * C, a.fc.data(), &gelu_out);
    } else {
        add_into(a.x_mid.data(), a.attn_out.data(), attn_mask, a.x.data(), NC);
        layernorm_forward(a.x_mid.data(), at(w.ln_2_w), at(w.ln_2_b), N, C, md.eps, a.ln2.data(), a.mean2.data(),
                          a.rstd2.data());
        linear_forward(a.ln2.data(), at(w.c_fc_w), at(w.c_fc_b), N, C, 4 * C, a.fc.data());
        gelu_forward(a.fc.data(), a.fc.size(), tanh_form, a.act.data());
    }
    linear_forward(a.act.data(), at(w.mlp_proj_w), at(w.mlp_proj_b), N, 4 * C, C, a.mlp_out.data());
    add_into(y, a.mlp_out.data(), mk ? at(mk->mlp_resid) : nullptr, a.x_mid.data(), NC);
}

static const float* masked(const float* dy, const float* m, size_t n, Vec& out) {  // dy m, or dy itself
    if (!m) return dy;
    out.resize(n);
    dropout(dy, m, n, out.data());
    return out.data();
}

// Writes dx (N, C); adds into the gradients g. A residual add passes dy on unchanged to x and through f.
void block_backward(const Model& md, const Layer& w, const Layer& g, const Masks* mk, int B, int T,
                    const BlockActs& a, const float* dy, float* dx) {
    const int N = B * T, C = md.n_embd;
    const size_t NC = (size_t)N * C;
    const bool tanh_form = md.gelu_tanh != 0;
    Vec &d_drop = kept(9, NC), &d_fc = kept(10, a.fc.size()), &d_ln = kept(11, NC), &d_mid = kept(12, NC);
    Vec &d_att = kept(13, NC), &d_qkv = kept(14, a.qkv.size());
    const float* d_out = masked(dy, mk ? at(mk->mlp_resid) : nullptr, NC, d_drop);
    if (RUNG >= FUSED) {  // d_fc = (d_out W_proj) gelu'(fc) as each tile leaves the product
        Epilogue grad;
        grad.pre = a.fc.data();
        grad.tanh_form = tanh_form;
        linear_backward(a.act.data(), at(w.mlp_proj_w), d_out, N, 4 * C, C, d_fc.data(), mut(g.mlp_proj_w),
                        mut(g.mlp_proj_b), &grad);
    } else {
        Vec& d_act = kept(15, a.fc.size());
        linear_backward(a.act.data(), at(w.mlp_proj_w), d_out, N, 4 * C, C, d_act.data(), mut(g.mlp_proj_w),
                        mut(g.mlp_proj_b));
        gelu_backward(a.fc.data(), d_act.data(), a.fc.size(), tanh_form, d_fc.data());
    }
    linear_backward(a.ln2.data(), at(w.c_fc_w), d_fc.data(), N, C, 4 * C, d_ln.data(), mut(g.c_fc_w), mut(g.c_fc_b));
    layernorm_backward(a.x_mid.data(), at(w.ln_2_w), a.mean2.data(), a.rstd2.data(), d_ln.data(), N, C,
                       d_mid.data(), mut(g.ln_2_w), mut(g.ln_2_b), RUNG >= FUSED ? dy : nullptr);
    if (RUNG < FUSED) add_into(d_mid.data(), d_mid.data(), nullptr, dy, NC);
    d_out = masked(d_mid.data(), mk ? at(mk->attn_resid) : nullptr, NC, d_drop);
    linear_backward(a.att.data(), at(w.attn_proj_w), d_out, N, C, C, d_att.data(), mut(g.attn_proj_w),
                    mut(g.attn_proj_b));
    attention_backward(a.qkv.data(), a.probs.data(), a.lse.data(), a.att.data(), mk ? at(mk->attn) : nullptr,
                       d_att.data(), B, T, C, md.n_head, d_qkv.data());
    linear_backward(a.ln1.data(), at(w.c_attn_w), d_qkv.data(), N, C, 3 * C, d_ln.data(), mut(g.c_attn_w),
                    mut(g.c_attn_b));
    layernorm_backward(a.x.data(), at(w.ln_1_w), a.mean1.data(), a.rstd1.data(), d_ln.data(), N, C, dx,
                       mut(g.ln_1_w), mut(g.ln_1_b), RUNG >= FUSED ? d_mid.data() : nullptr);
    if (RUNG < FUSED) add_into(dx, dx, nullptr, d_mid.data(), NC);
}

// reference.cpp's model_step: logits, the loss with targets, and with grads every gradient added into grads
int model_step(const Model& md, const Model* grads, Batch& batch) {
    const int B = batch.B, T = batch.T, C = md.n_embd, V = md.vocab_size, N = B * T;
    if (T > md.block_size || T < 1 || B < 1 || C % md.n_head) return 1;
    for (int i = 0; i < N; i++)
        if (batch.idx[i] < 0 || batch.idx[i] >= V) return 2;
    for (int i = 0; batch.targets && i < N; i++)
        if (batch.targets[i] < -1 || batch.targets[i] >= V) return 3;
    const size_t NC = (size_t)N * C;
    std::vector<BlockActs>& acts = kept_acts(md, B, T);
    Vec &x0 = kept(0, NC), &x = kept(1, NC);
    float* first = md.n_layer ? acts[0].x.data() : x.data();
    embedding_forward(batch.idx, at(md.wte), at(md.wpe), B, T, C, batch.emb_mask ? x0.data() : first);
    if (batch.emb_mask) dropout(x0.data(), at(batch.emb_mask), NC, first);
    for (int l = 0; l < md.n_layer; l++) {
        float* out = l + 1 < md.n_layer ? acts[l + 1].x.data() : x.data();
        block_forward(md, md.layers[l], batch.masks ? batch.masks + l : nullptr, B, T, acts[l], out);
    }
    Vec &xf = kept(2, NC), &mean = kept(3, N), &rstd = kept(4, N);
    layernorm_forward(x.data(), at(md.ln_f_w), at(md.ln_f_b), N, C, md.eps, xf.data(), mean.data(), rstd.data());
    float* logits = mut(batch.logits);
    linear_forward(xf.data(), at(md.wte), nullptr, N, C, V, logits);
    if (!batch.targets) return 0;
    Vec& dlogits = kept(5, grads ? (size_t)N * V : 0);
    batch.loss = cross_entropy(logits, batch.targets, N, V, grads && RUNG >= FUSED ? dlogits.data() : nullptr);
    if (!grads) return 0;
    if (RUNG < FUSED) cross_entropy(logits, batch.targets, N, V, dlogits.data());
    Vec &dxf = kept(6, NC), &dx = kept(7, NC), &dnext = kept(8, NC);
    linear_backward(xf.data(), at(md.wte), dlogits.data(), N, C, V, dxf.data(), mut(grads->wte), nullptr);
    layernorm_backward(x.data(), at(md.ln_f_w), mean.data(), rstd.data(), dxf.data(), N, C, dx.data(),
                       mut(grads->ln_f_w), mut(grads->ln_f_b));
    for (int l = md.n_layer - 1; l >= 0; l--) {
        block_backward(md, md.layers[l], grads->layers[l], batch.masks ? batch.masks + l : nullptr, B, T, acts[l],
                       dx.data(), dnext.data());
        std::swap(dx, dnext);
    }
    const float* demb = masked(dx.data(), at(batch.emb_mask), NC, dnext);
    embedding_backward(batch.idx, demb, B, T, C, mut(grads->wte), mut(grads->wpe));
    return 0;
}

// torch's clip_grad_norm_: the global norm in double (per-thread partial sums added in thread order)
double clip_grad_norm(float* const* grads, const int64_t* sizes, int n, double max_norm) {
    Timed timed(CLIP);
    double sq = 0;
    for (int i = 0; i < n; i++) {
        const int parts = sizes[i] > SPREAD ? team() : 1;
        std::vector<double> part(parts, 0.0);
        const int64_t size = sizes[i], step = (size + parts - 1) / parts;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
        for (int p = 0; p < parts; p++) {
            double s = 0;  // in vector lanes, summed in the lanes' fixed order: the same bits every run
            const float* g = grads[i];
#pragma omp simd reduction(+ : s)
            for (int64_t j = p * step; j < std::min(size, (p + 1) * step); j++) s += (double)g[j] * g[j];
            part[p] = s;
        }
        for (double s : part) sq += s;
    }
    const double norm = std::sqrt(sq), coef = max_norm / (norm + 1e-6);
    if (max_norm > 0 && coef < 1)
        for (int i = 0; i < n; i++) {
            PARALLEL_FOR_OVER(sizes[i])
            for (int64_t j = 0; j < sizes[i]; j++) grads[i][j] *= (float)coef;
        }
    return norm;
}

// AdamW at step t, one tensor (reference.cpp's update, element by element)
void adamw(float* theta, const float* g, float* mom, float* vel, int64_t n, double lr, double b1, double b2, double eps,
           double wd, int64_t t) {
    Timed timed(ADAMW);
    const double c1 = 1 - std::pow(b1, (double)t), c2 = 1 - std::pow(b2, (double)t);
    const float decay = (float)(1 - lr * wd), fb1 = (float)b1, fb2 = (float)b2, nb1 = (float)(1 - b1),
                nb2 = (float)(1 - b2), step = (float)(lr / c1), fc2 = (float)c2, feps = (float)eps;
    PARALLEL_FOR_SIMD_OVER(n)
    for (int64_t i = 0; i < n; i++) {
        theta[i] *= decay;
        mom[i] = fb1 * mom[i] + nb1 * g[i];
        vel[i] = fb2 * vel[i] + nb2 * g[i] * g[i];
        theta[i] -= step * mom[i] / (std::sqrt(vel[i] / fc2) + feps);
    }
}
