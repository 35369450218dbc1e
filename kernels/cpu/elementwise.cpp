// SwiGLU's activation (silu_and_mul) and the KV cache write (store_kv), float32 and bfloat16, on vec.h's lanes.
//
// silu_and_mul rounds where torch's eager reference rounds (silu's result, then the product); its exp is vec.h's,
// so a value may differ from torch's by an ulp. The row has C linkage: the fused decode step and the packed
// linear's fused SwiGLU (decode_layers.cpp, packed_linear.h) run the very code the operator runs. Measured by bench/kernel_ops.py.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vec.h"

namespace ksana {
namespace {

// silu(g) = g / (1 + e^-g), with e^-g from e^-|g| (or its inverse), so the exp's argument is never positive.
template <typename V>
inline V silu(V g) {
    V t = exp_nonpositive(g.neg_abs());
    t = V::where_negative(g, V::splat(1.0f) / t, t);
    return g / (V::splat(1.0f) + t);
}

template <typename V, typename T>
inline void silu_and_mul_lanes(const T *g, const T *u, T *o) {
    (round_to<T>(silu(V::load(g))) * V::load(u)).store(o);
}

// o[:d] = round(round(silu(gate)) * up) for a row [gate | up]: the widest lanes, then eight, then one at a time
// with expf (each lane's value is the same at any width).
template <typename T>
void silu_and_mul_row(const T *g, T *o, int64_t d) {
    const T *u = g + d;
    int64_t j = 0;
    for (; j + Wide::lanes <= d; j += Wide::lanes) silu_and_mul_lanes<Wide>(g + j, u + j, o + j);
    if (Wide::lanes > 8 && j + 8 <= d) silu_and_mul_lanes<F32x8>(g + j, u + j, o + j), j += 8;
    for (; j < d; j++) {
        float gv = load1(g + j);
        store1(o + j, round_to<T>(gv / (1.0f + std::exp(-gv))) * load1(u + j));
    }
}

template <typename T>
void silu_and_mul(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t d, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * d >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) silu_and_mul_row(x + i * x_stride, out + i * d, d);
}

// Each token's K/V heads (nkv x dim values) into its cache slot. A block holds block_size x nkv x dim values;
// within it slot s's KV head h starts at s * slot_stride + h * head_stride: (nkv * dim, dim) slot-major,
// (dim, block_size * dim) head-major (see ksana/worker/kv_cache.py).
template <typename T>
void store_kv(const T *key, int64_t key_stride, const T *value, int64_t value_stride, T *k_cache, T *v_cache,
              const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size, int64_t slot_stride,
              int64_t head_stride) {
    for (int64_t t = 0; t < ntok; t++) {
        int64_t at = slots[t] / block_size * block_size * nkv * dim + slots[t] % block_size * slot_stride;
        for (int64_t h = 0; h < nkv; h++) {
            std::memcpy(k_cache + at + h * head_stride, key + t * key_stride + h * dim, sizeof(T) * dim);
            std::memcpy(v_cache + at + h * head_stride, value + t * value_stride + h * dim, sizeof(T) * dim);
        }
    }
}

}  // namespace
}  // namespace ksana

// The C entry points: the operators' (registration.cpp) and the rows the fused decode step runs (decode_layers.cpp).
using ksana::bf16;

extern "C" {
// The widest lanes the C++ kernels run (16 on AVX-512 or with KSANA_WIDE_LANES, else 8): a build query.
int wide_lanes(void) { return ksana::Wide::lanes; }

void silu_and_mul_row_f32(const float *g, float *o, int64_t d) { ksana::silu_and_mul_row(g, o, d); }
void silu_and_mul_row_bf16(const bf16 *g, bf16 *o, int64_t d) { ksana::silu_and_mul_row(g, o, d); }
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t d, int nthreads) {
    ksana::silu_and_mul(x, x_stride, out, rows, d, nthreads);
}
void silu_and_mul_bf16(const bf16 *x, int64_t x_stride, bf16 *out, int64_t rows, int64_t d, int nthreads) {
    ksana::silu_and_mul(x, x_stride, out, rows, d, nthreads);
}
void store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, float *k_cache,
                  float *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size,
                  int64_t slot_stride, int64_t head_stride) {
    ksana::store_kv(key, key_stride, value, value_stride, k_cache, v_cache, slots, ntok, nkv, dim, block_size,
                    slot_stride, head_stride);
}
void store_kv_bf16(const bf16 *key, int64_t key_stride, const bf16 *value, int64_t value_stride, bf16 *k_cache,
                   bf16 *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size,
                   int64_t slot_stride, int64_t head_stride) {
    ksana::store_kv(key, key_stride, value, value_stride, k_cache, v_cache, slots, ntok, nkv, dim, block_size,
                    slot_stride, head_stride);
}
}
