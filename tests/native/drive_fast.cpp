// A stand-alone driver of the fast engine (gptlab/reference/csrc/fast.cpp, compiled into it at the rung its build
// names with -DGPTLAB_RUNG): reads a model and a batch from a file, runs one step with gradients, writes the loss,
// the logits and every gradient. tests/test_fast_arm.py cross-compiles it for ARM64 (static) and runs it under
// qemu-user, then holds its numbers to the naive engine's on the same weights.
//
//   drive_fast IN OUT
// IN (little-endian): "GPTLABFAST01", int32 n_layer, n_head, n_embd, vocab_size, block_size, gelu_tanh, B, T,
// threads; float64 eps; then the tensors, each an int64 float count (0: NULL) and its floats: wte, wpe, ln_f_w,
// ln_f_b, then per layer the 12 of struct Layer in its order; then idx and targets, int64 (B, T) each.
// OUT: float64 loss, float32 logits (B, T, V), then the gradient of every tensor present, in the same order.
// Exit status 0, or 1 with a line on stderr.
#include "fast.cpp"

#include <stdio.h>

static FILE* in;

static void fail(const char* what) {
    fprintf(stderr, "drive_fast: %s\n", what);
    exit(1);
}

template <typename T> static T read_one() {
    T value;
    if (fread(&value, sizeof(T), 1, in) != 1) fail("the input ends early");
    return value;
}

struct Tensor {
    std::vector<float> data, grad;
};

static void* read_tensor(std::vector<Tensor>& all, void** grad) {
    int64_t n = read_one<int64_t>();
    if (n < 0) fail("a negative tensor size");
    if (n == 0) return *grad = nullptr;
    all.emplace_back();
    Tensor& t = all.back();
    t.data.resize(n);
    t.grad.assign(n, 0.0f);
    if (fread(t.data.data(), sizeof(float), n, in) != (size_t)n) fail("a tensor ends early");
    *grad = t.grad.data();
    return t.data.data();
}

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: drive_fast IN OUT");
    in = fopen(argv[1], "rb");
    if (!in) fail("cannot open IN");
    char magic[12];
    if (fread(magic, 1, 12, in) != 12 || memcmp(magic, "GPTLABFAST01", 12)) fail("IN is not a drive_fast input");
    int h[9];
    for (int& v : h) v = read_one<int32_t>();
    Model m{h[0], h[1], h[2], h[3], h[4], h[5], read_one<double>(), nullptr, nullptr, nullptr, nullptr, nullptr};
    Model g = m;
    const int B = h[6], T = h[7];
    gptlab_fast_set_threads(h[8]);
    std::vector<Tensor> all;
    all.reserve(4 + 12 * (size_t)m.n_layer);
    m.wte = read_tensor(all, &g.wte), m.wpe = read_tensor(all, &g.wpe);
    m.ln_f_w = read_tensor(all, &g.ln_f_w), m.ln_f_b = read_tensor(all, &g.ln_f_b);
    std::vector<Layer> layers(m.n_layer), grads(m.n_layer);
    for (int l = 0; l < m.n_layer; l++) {
        void** w = (void**)&layers[l];
        void** d = (void**)&grads[l];
        for (int k = 0; k < 12; k++) w[k] = read_tensor(all, d + k);
    }
    m.layers = layers.data(), g.layers = grads.data();
    std::vector<int64_t> idx((size_t)B * T), targets(idx.size());
    if (fread(idx.data(), 8, idx.size(), in) != idx.size() || fread(targets.data(), 8, idx.size(), in) != idx.size())
        fail("the batch ends early");
    std::vector<float> logits((size_t)B * T * m.vocab_size);
    Batch batch{B, T, idx.data(), targets.data(), nullptr, nullptr, logits.data(), 0.0};
    if (gptlab_step_f32(&m, &g, &batch)) fail("the engine refused the batch");
    FILE* out = fopen(argv[2], "wb");
    if (!out) fail("cannot open OUT");
    fwrite(&batch.loss, 8, 1, out);
    fwrite(logits.data(), 4, logits.size(), out);
    for (Tensor& t : all) fwrite(t.grad.data(), 4, t.grad.size(), out);
    return fclose(out) ? 1 : 0;
}
