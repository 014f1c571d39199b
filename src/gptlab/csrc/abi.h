// The ABI every native library of gptlab exports (gptlab/compiled.py reads it): Python fills the library's structs
// with ctypes, and before the first call checks that the library's layout version, the size of each struct and the
// offset of each field are the ones it passes; a library that differs is never called.
//
// A library lists its structs' fields with GPTLAB_FIELD and its structs with GPTLAB_SIZE, then exports them:
//     static const gptlab_abi::Field FIELDS[] = {GPTLAB_FIELD(Model, n_layer), ...};
//     static const gptlab_abi::Size SIZES[] = {GPTLAB_SIZE(Model), ...};
//     GPTLAB_EXPORT_LAYOUT(LAYOUT_VERSION, FIELDS, SIZES)
#pragma once
#include <cstddef>
#include <cstring>

namespace gptlab_abi {

struct Field { const char *s, *f; long off; };  // struct s has field f at byte off
struct Size { const char* s; long size; };       // struct s is size bytes

template <std::size_t N> long size_of(const Size (&sizes)[N], const char* s) {  // -1: a struct not listed
    for (const Size& e : sizes)
        if (!std::strcmp(e.s, s)) return e.size;
    return -1;
}

template <std::size_t N> int count_fields(const Field (&fields)[N], const char* s) {  // fields listed for struct s
    int n = 0;
    for (const Field& e : fields) n += !std::strcmp(e.s, s);
    return n;
}

template <std::size_t N> long offset_of(const Field (&fields)[N], const char* s, const char* f) {  // -1: not listed
    for (const Field& e : fields)
        if (!std::strcmp(e.s, s) && !std::strcmp(e.f, f)) return e.off;
    return -1;
}

}  // namespace gptlab_abi

#define GPTLAB_FIELD(S, f) gptlab_abi::Field{#S, #f, (long)offsetof(S, f)}
#define GPTLAB_SIZE(S) gptlab_abi::Size{#S, (long)sizeof(S)}

// The four functions compiled.check_abi calls: gptlab_layout_version(), gptlab_sizeof(struct),
// gptlab_fields(struct) and gptlab_offsetof(struct, field).
#define GPTLAB_EXPORT_LAYOUT(VERSION, FIELDS, SIZES)                                                               \
    extern "C" int gptlab_layout_version() { return VERSION; }                                                     \
    extern "C" long gptlab_sizeof(const char* s) { return gptlab_abi::size_of(SIZES, s); }                         \
    extern "C" int gptlab_fields(const char* s) { return gptlab_abi::count_fields(FIELDS, s); }                    \
    extern "C" long gptlab_offsetof(const char* s, const char* f) { return gptlab_abi::offset_of(FIELDS, s, f); }
