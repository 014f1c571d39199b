// A stand-alone driver of the fused decode step (gptlab/inference/csrc/decode.cpp, compiled into it): reads a model
// and the ids of some decode steps from a file, runs the steps, writes the logits. It lets a build for another CPU
// be checked where no such CPU is at hand: tests/test_arm.py cross-compiles it for ARM64 (static) and runs it
// under qemu-user, then compares the logits with the torch forward's.
//
//   drive_decode IN OUT [verify]
// IN (little-endian, written by tests/test_arm.py): "GPTLABDRIVE1", then int32 n_layer, n_head, head_dim, n_embd,
// vocab_size, block_size, weights, gelu_tanh, R, steps, cache_bf16; float32 eps; then the arrays, each an int64 byte
// count (0: NULL) and its bytes: wte, wpe, lm_head, ln_f_w, ln_f_b, lm_head_s, lm_head_sum, then per layer the 20
// of struct Layer in its order; then the ids, int64 (steps, R). Every row starts at position 0.
// OUT: float32 logits (steps, R, vocab_size); with `verify` (R must be 1), then the logits (steps, vocab_size) of
// one verify step of all the row's tokens at once (steps step rows on cache row 0, at positions 0, 1, ...).
// Exit status 0, or 1 with a line on stderr.
#include "decode.cpp"

#include <stdio.h>
#include <stdlib.h>
#include <vector>

static FILE* in;

static void fail(const char* what) {
    fprintf(stderr, "drive_decode: %s\n", what);
    exit(1);
}

template <typename T> static T read_one() {
    T value;
    if (fread(&value, sizeof(T), 1, in) != 1) fail("the input ends early");
    return value;
}

static const void* read_array() {  // kept for the whole run: the model points into it
    int64_t bytes = read_one<int64_t>();
    if (bytes == 0) return nullptr;
    if (bytes < 0) fail("a negative array size");
    void* data = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (fread(data, 1, bytes, in) != (size_t)bytes) fail("an array ends early");
    return data;
}

int main(int argc, char** argv) {
    const bool verify = argc == 4 && strcmp(argv[3], "verify") == 0;
    if (argc != 3 && !verify) fail("usage: drive_decode IN OUT [verify]");
    in = fopen(argv[1], "rb");
    if (!in) fail("cannot open IN");
    char magic[12];
    if (fread(magic, 1, 12, in) != 12 || memcmp(magic, "GPTLABDRIVE1", 12) != 0) fail("IN is not a drive file");
    Model m;
    m.n_layer = read_one<int32_t>();
    m.n_head = read_one<int32_t>();
    m.head_dim = read_one<int32_t>();
    m.n_embd = read_one<int32_t>();
    m.vocab_size = read_one<int32_t>();
    m.block_size = read_one<int32_t>();
    m.weights = read_one<int32_t>();
    m.gelu_tanh = read_one<int32_t>();
    const int R = read_one<int32_t>(), steps = read_one<int32_t>(), cache_bf16 = read_one<int32_t>();
    m.eps = read_one<float>();
    m.wte = read_array();
    m.wpe = read_array();
    m.lm_head = read_array();
    m.ln_f_w = (const float*)read_array();
    m.ln_f_b = (const float*)read_array();
    m.lm_head_s = (const float*)read_array();
    m.lm_head_sum = (const int32_t*)read_array();
    std::vector<Layer> layers(m.n_layer);
    for (Layer& L : layers) {
        const void** fields = (const void**)&L;  // 20 pointers, in order (the ABI check holds the layout)
        for (int f = 0; f < (int)(sizeof(Layer) / sizeof(void*)); f++) fields[f] = read_array();
    }
    m.layers = layers.data();
    std::vector<int64_t> ids((size_t)steps * R);
    for (int64_t& id : ids) id = read_one<int64_t>();
    fclose(in);

    const int C = m.n_embd, T = 2;  // threads: the scores buffer is per thread
    const int64_t cache = (int64_t)m.n_layer * R * m.n_head * steps * m.head_dim;
    std::vector<float> k(cache), v(cache);  // bf16 caches use the first half of each
    std::vector<float> x((size_t)R * C), h((size_t)R * C), qkv((size_t)R * 3 * C), att((size_t)R * C);
    std::vector<float> fc((size_t)R * 4 * C), logits((size_t)R * m.vocab_size), scores((size_t)T * steps);
    std::vector<int64_t> pos(R, 0);
    FILE* out = fopen(argv[2], "wb");
    if (!out) fail("cannot open OUT");
    for (int t = 0; t < steps; t++) {
        Step s{R, steps, T, cache_bf16, R, ids.data() + (int64_t)t * R, pos.data(), nullptr, k.data(), v.data(), x.data(), h.data(),
               qkv.data(), att.data(), fc.data(), logits.data(), scores.data()};
        if (gptlab_decode_step(&m, &s) != 0) fail("the step refused a row");
        fwrite(logits.data(), sizeof(float), logits.size(), out);
    }
    if (verify) {  // the same tokens again, all in one step, over a fresh cache
        if (R != 1) fail("verify drives one row");
        std::fill(k.begin(), k.end(), 0.0f);
        std::fill(v.begin(), v.end(), 0.0f);
        const size_t S = steps;
        std::vector<float> vx(S * C), vh(S * C), vqkv(S * 3 * C), vatt(S * C), vfc(S * 4 * C), vlogits(S * m.vocab_size);
        std::vector<int64_t> vpos(S), slot(S, 0);
        for (size_t t = 0; t < S; t++) vpos[t] = (int64_t)t;
        Step s{steps, steps, T, cache_bf16, 1, ids.data(), vpos.data(), slot.data(), k.data(), v.data(), vx.data(),
               vh.data(), vqkv.data(), vatt.data(), vfc.data(), vlogits.data(), scores.data()};
        if (gptlab_decode_step(&m, &s) != 0) fail("the verify refused a row");
        fwrite(vlogits.data(), sizeof(float), vlogits.size(), out);
    }
    return fclose(out) == 0 ? 0 : 1;
}
