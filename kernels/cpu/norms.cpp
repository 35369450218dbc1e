// RMSNorm (with the residual add fused) and neox rotary embedding, float32 and bfloat16, on F32x8 lanes (vec.h).
//
// Arithmetic is float32 and bfloat16 results are rounded where torch's eager reference rounds, so these agree with
// it to the last bit but for the sum of squares' order. The per-row bodies have C linkage: the fused decode step
// (decode_layers.cpp) runs the very same code as the operators. Measured by bench/kernel_ops.py.
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "vec.h"

namespace ksana {
namespace {

// out = w * round(r * rsqrt(mean(r^2) + eps)), r = x (+ add, rounded, also written to residual_out).
template <typename T>
void rms_norm_row(const T *src, const T *add, T *residual_out, const T *w, T *o, int64_t dim, float eps) {
    if (add) {  // the new residual, rounded as torch's add rounds; it is what gets normalised
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) (F32x8::load(src + d) + F32x8::load(add + d)).store(residual_out + d);
        for (; d < dim; d++) store1(residual_out + d, load1(src + d) + load1(add + d));
        src = residual_out;
    }
    // the sum of squares in four 8-lane partial sums, then the lanes' tree, then the tail in order
    F32x8 s0 = F32x8::zero(), s1 = s0, s2 = s0, s3 = s0;
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {
        F32x8 x0 = F32x8::load(src + d), x1 = F32x8::load(src + d + 8);
        F32x8 x2 = F32x8::load(src + d + 16), x3 = F32x8::load(src + d + 24);
        s0 = s0 + x0 * x0, s1 = s1 + x1 * x1, s2 = s2 + x2 * x2, s3 = s3 + x3 * x3;
    }
    for (; d + 8 <= dim; d += 8) {
        F32x8 x0 = F32x8::load(src + d);
        s0 = s0 + x0 * x0;
    }
    float ss = ((s0 + s1) + (s2 + s3)).sum();
    for (; d < dim; d++) ss += load1(src + d) * load1(src + d);
    float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    F32x8 vinv = F32x8::splat(inv);
    d = 0;
    for (; d + 8 <= dim; d += 8)
        (F32x8::load(w + d) * round_to<T>(F32x8::load(src + d) * vinv)).store(o + d);
    for (; d < dim; d++) store1(o + d, load1(w + d) * round_to<T>(load1(src + d) * inv));
}

template <typename T>
void rms_norm(const T *x, int64_t x_stride, const T *add, T *residual_out, const T *w, T *out, int64_t rows,
              int64_t dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++)
        rms_norm_row(x + i * x_stride, add ? add + i * dim : nullptr, add ? residual_out + i * dim : nullptr, w,
                     out + i * dim, dim, eps);
}

// neox rotary: out[t, h] = round(round(x * cos) + round(rot(x) * sin)), rot(x) = [-x2, x1]; -b * s as (b * s)
// negated, the same product.
template <typename T>
void rotary_token(const T *x, const T *c, const T *s, T *out, int64_t nheads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t h = 0; h < nheads; h++) {
        const T *xh = x + h * dim;
        T *o = out + h * dim;
        int64_t d = 0;
        for (; d + 8 <= half; d += 8) {
            F32x8 a = F32x8::load(xh + d), b = F32x8::load(xh + d + half);
            F32x8 c1 = F32x8::load(c + d), s1 = F32x8::load(s + d);
            F32x8 c2 = F32x8::load(c + d + half), s2 = F32x8::load(s + d + half);
            (round_to<T>(a * c1) + round_to<T>(-(b * s1))).store(o + d);
            (round_to<T>(b * c2) + round_to<T>(a * s2)).store(o + d + half);
        }
        for (; d < half; d++) {
            float a = load1(xh + d), b = load1(xh + d + half);
            float c1 = load1(c + d), s1 = load1(s + d), c2 = load1(c + d + half), s2 = load1(s + d + half);
            store1(o + d, round_to<T>(a * c1) + round_to<T>(-b * s1));
            store1(o + d + half, round_to<T>(b * c2) + round_to<T>(a * s2));
        }
    }
}

template <typename T>
void rotary_neox(const T *x, int64_t tok_stride, const T *cos, const T *sin, T *out, int64_t ntok, int64_t nheads,
                 int64_t dim, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (ntok * nheads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < ntok; t++)
        rotary_token(x + t * tok_stride, cos + t * dim, sin + t * dim, out + t * nheads * dim, nheads, dim);
}

}  // namespace
}  // namespace ksana

// The C entry points: the operators' (registration.cpp) and the rows the fused decode step runs (decode_layers.cpp).
using ksana::bf16;

extern "C" {
void rms_norm_row_f32(const float *src, const float *add, float *residual_out, const float *w, float *o, int64_t dim,
                      float eps) {
    ksana::rms_norm_row(src, add, residual_out, w, o, dim, eps);
}
void rms_norm_row_bf16(const bf16 *src, const bf16 *add, bf16 *residual_out, const bf16 *w, bf16 *o, int64_t dim,
                       float eps) {
    ksana::rms_norm_row(src, add, residual_out, w, o, dim, eps);
}
void rms_norm_f32(const float *x, int64_t x_stride, const float *add, float *residual_out, const float *w, float *out,
                  int64_t rows, int64_t dim, float eps, int nthreads) {
    ksana::rms_norm(x, x_stride, add, residual_out, w, out, rows, dim, eps, nthreads);
}
void rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *add, bf16 *residual_out, const bf16 *w, bf16 *out,
                   int64_t rows, int64_t dim, float eps, int nthreads) {
    ksana::rms_norm(x, x_stride, add, residual_out, w, out, rows, dim, eps, nthreads);
}
void rotary_token_f32(const float *x, const float *c, const float *s, float *out, int64_t nheads, int64_t dim) {
    ksana::rotary_token(x, c, s, out, nheads, dim);
}
void rotary_token_bf16(const bf16 *x, const bf16 *c, const bf16 *s, bf16 *out, int64_t nheads, int64_t dim) {
    ksana::rotary_token(x, c, s, out, nheads, dim);
}
void rotary_neox_f32(const float *x, int64_t tok_stride, const float *cos, const float *sin, float *out, int64_t ntok,
                     int64_t nheads, int64_t dim, int nthreads) {
    ksana::rotary_neox(x, tok_stride, cos, sin, out, ntok, nheads, dim, nthreads);
}
void rotary_neox_bf16(const bf16 *x, int64_t tok_stride, const bf16 *cos, const bf16 *sin, bf16 *out, int64_t ntok,
                      int64_t nheads, int64_t dim, int nthreads) {
    ksana::rotary_neox(x, tok_stride, cos, sin, out, ntok, nheads, dim, nthreads);
}
}
