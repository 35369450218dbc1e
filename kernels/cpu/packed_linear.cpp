// The packed linear's operators (see packed_linear.h): the weight's packing at load, rows of a packed table (a tied
// embedding), the weight unpacked for BLAS, the linear itself, and greedy decoding straight from a packed lm_head.
// The tiles and which runs where are the build's schedule's (packed_wide.h or packed_narrow.cpp); this file
// packs the input and runs the threads. bench/kernel_ops.py measures it against BLAS over torch's layout.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "packed_linear.h"
#include "parallel.h"

extern "C" void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs,
                                int nthreads);

namespace ksana::packed {

__thread KvWarm *kv_warming __attribute__((tls_model("initial-exec"))) = nullptr;
int prefetch_min_rows = 1;

namespace {

// packed[p][k][j] = w[16p + j][k], zero for 16p + j >= N.
template <typename T>
void pack_weight(const T *w, int64_t N, int64_t K, T *packed, int nthreads) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        T *dst = packed + p * K * kPanel;
        for (int j = 0; j < kPanel; j++) {
            const int64_t n = p * kPanel + j;
            for (int64_t k = 0; k < K; k++) dst[k * kPanel + j] = n < N ? w[n * K + k] : T(0);
        }
    }
}

// An embedding lookup from a packed table (a tied head): out[i][k] = packed[id / 16][k][id % 16], a row's values
// one cache line apart in one contiguous run. False (and nothing written) if an id is outside [0, N).
template <typename T>
bool packed_rows(const T *packed, int64_t N, int64_t K, const int64_t *ids, int64_t n, T *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return false;
    for (int64_t i = 0; i < n; i++) {
        const T *src = packed + ids[i] / kPanel * K * kPanel + ids[i] % kPanel;
        for (int64_t k = 0; k < K; k++) out[i * K + k] = src[k * kPanel];
    }
    return true;
}

// The panels back as one row-major [K, panels * 16] matrix (out[k][16p + j] = packed[p][k][j]): the weight
// transposed, as a BLAS matmul takes it (see ``NativeCPUOps.linear``). Rows split across the threads.
template <typename T>
void unpack_weight(const T *packed, int64_t panels, int64_t K, T *out, int nthreads) {
    const int64_t ld = panels * kPanel;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        const int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
        for (int64_t p = 0; p < panels; p++) {
            const T *src = packed + (p * K + k0) * kPanel;
            for (int64_t k = k0; k < k1; k++, src += kPanel) std::memcpy(out + k * ld + p * kPanel, src, sizeof(T) * kPanel);
        }
    }
}

// The packing and the matmul of packed_linear; with `greedy`, no `out`: each panel group's logits go to the
// greedy part instead.
template <typename T>
void matmul(const T *x, int64_t x_stride, const T *w, const T *bias, T *out, int64_t M, int64_t N, int64_t K,
            int nthreads, GreedyGroups *greedy) {
    const int64_t stride = M <= kRowTile ? M : kRowTile, row_tiles = (M + stride - 1) / stride;
    float *a = static_cast<float *>(std::aligned_alloc(64, sizeof(float) * ((row_tiles * stride * K + 15) / 16 * 16)));
    if (M % stride)  // the padding rows of a partial last tile are computed (not stored): zeros
        std::memset(a + (row_tiles - 1) * stride * K, 0, sizeof(float) * stride * K);
    const bool parallel = M * N * K >= kParallelMin;
    int64_t next_group = 0;  // the first panel group no thread has taken
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        const int64_t k_blocks = (K + 63) / 64;  // split along K too: a decode step has one row tile
#pragma omp for schedule(static)
        for (int64_t tk = 0; tk < row_tiles * k_blocks; tk++) {
            const int64_t t = tk / k_blocks, k0 = tk % k_blocks * 64, k1 = k0 + 64 < K ? k0 + 64 : K;
            if (M >= kRowTile && (t + 1) * kRowTile <= M)
                pack_tile(x, x_stride, K, k0, k1, a, t);
            else
                for (int64_t row = t * stride; row < M && row < (t + 1) * stride; row++)
                    pack_row(x + row * x_stride, K, k0, k1, a, M, row);
        }
        panel_groups(a, w, bias, out, M, N, K, &next_group, omp_get_num_threads(), greedy);
    }
    std::free(a);
}

// Greedy decoding straight from the lm_head: each row's first maximum over its first `vocab` logits (the first NaN
// if there is one) and log_softmax there, as greedy_logprobs gives them from the logits packed_linear writes
// (bfloat16 logits rounded as it stores them). The wide schedule does it without the [M, N] logits: each panel
// group keeps its own maximum and sum of exponentials, 16 rows at a time, while its logits are in L1, combined in
// group order, so the result does not depend on which thread ran which group. The narrow schedule runs the
// logits, widened to float32 as the model's logits path widens them, through greedy_logprobs (float32 logits of
// the whole vocabulary as they are; their copy is a small part of the call).
template <typename T>
void linear_greedy(const T *x, int64_t x_stride, const T *w, int64_t M, int64_t N, int64_t K, int64_t vocab,
                   int64_t *ids, float *logprobs, int nthreads) {
    const int64_t cols = vocab < N ? vocab : N;
    if constexpr (kWideSchedule) {
        const int64_t groups = group_count(M, N);
        const int64_t slices = (M + 15) / 16, n = 16 * groups * slices;
        float *values = static_cast<float *>(std::malloc(sizeof(float) * 4 * n));
        GreedyGroups greedy{groups, cols, values, values + n, values + 2 * n, values + 3 * n};
        matmul<T>(x, x_stride, w, nullptr, nullptr, M, N, K, nthreads, &greedy);
        for (int64_t s = 0; s < slices; s++)
            greedy_combine(greedy, s, M - 16 * s < 16 ? M - 16 * s : 16, ids + 16 * s, logprobs + 16 * s);
        std::free(values);
    } else {
        T *logits = static_cast<T *>(std::malloc(sizeof(T) * M * N));
        const bool as_is = sizeof(T) == sizeof(float) && cols == N;  // float32 rows of exactly the vocabulary
        float *wide = as_is ? reinterpret_cast<float *>(logits) : static_cast<float *>(std::malloc(sizeof(float) * M * cols));
        matmul<T>(x, x_stride, w, nullptr, logits, M, N, K, nthreads, nullptr);
        if (!as_is)
            for (int64_t r = 0; r < M; r++)
                for (int64_t j = 0; j < cols; j++) wide[r * cols + j] = load1(logits + r * N + j);
        greedy_logprobs(wide, M, cols, ids, logprobs, nthreads);
        if (!as_is) std::free(wide);
        std::free(logits);
    }
}

}  // namespace
}  // namespace ksana::packed

namespace packed = ksana::packed;
using ksana::bf16;

extern "C" {
// From how many input rows the wide tiles prefetch their weight panels in software; below it they leave the panels'
// streams to the hardware prefetchers. Python sets it per CPU (packed_prefetch_min_rows in kernels/cpu/ops.py, with
// the measurements). Process-wide, like the library. Returns the previous setting.
int set_packed_prefetch_min_rows(int rows) {
    const int previous = packed::prefetch_min_rows;
    packed::prefetch_min_rows = rows;
    return previous;
}
// Whether this build has the packed linear and the fused decode step: on AVX2 and AVX-512; other CPUs keep torch's
// layout and BLAS (the schedule compiles on NEON and the portable lanes, but is measured only on x86).
int linear_available(void) {
#if KSANA_VEC_AVX2
    return 1;
#else
    return 0;
#endif
}

void pack_weight_f32(const float *w, int64_t N, int64_t K, float *packed, int nthreads) {
    packed::pack_weight(w, N, K, packed, nthreads);
}
void pack_weight_bf16(const bf16 *w, int64_t N, int64_t K, bf16 *packed, int nthreads) {
    packed::pack_weight(w, N, K, packed, nthreads);
}
void unpack_weight_f32(const float *packed, int64_t panels, int64_t K, float *out, int nthreads) {
    packed::unpack_weight(packed, panels, K, out, nthreads);
}
void unpack_weight_bf16(const bf16 *packed, int64_t panels, int64_t K, bf16 *out, int nthreads) {
    packed::unpack_weight(packed, panels, K, out, nthreads);
}
// 1 (and nothing written) if an id is outside [0, N).
int packed_rows_f32(const float *packed, int64_t N, int64_t K, const int64_t *ids, int64_t n, float *out) {
    return packed::packed_rows(packed, N, K, ids, n, out) ? 0 : 1;
}
int packed_rows_bf16(const bf16 *packed, int64_t N, int64_t K, const int64_t *ids, int64_t n, bf16 *out) {
    return packed::packed_rows(packed, N, K, ids, n, out) ? 0 : 1;
}
// x: M rows `x_stride` apart; w: pack_weight's panels for N x K; bias: N or null; out: M x N, contiguous.
void packed_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out, int64_t M,
                       int64_t N, int64_t K, int nthreads) {
    packed::matmul(x, x_stride, w, bias, out, M, N, K, nthreads, nullptr);
}
void packed_linear_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, bf16 *out, int64_t M,
                        int64_t N, int64_t K, int nthreads) {
    packed::matmul(x, x_stride, w, bias, out, M, N, K, nthreads, nullptr);
}
void packed_linear_greedy_f32(const float *x, int64_t x_stride, const float *w, int64_t M, int64_t N, int64_t K,
                              int64_t vocab, int64_t *ids, float *logprobs, int nthreads) {
    packed::linear_greedy(x, x_stride, w, M, N, K, vocab, ids, logprobs, nthreads);
}
void packed_linear_greedy_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, int64_t M, int64_t N, int64_t K,
                               int64_t vocab, int64_t *ids, float *logprobs, int nthreads) {
    packed::linear_greedy(x, x_stride, w, M, N, K, vocab, ids, logprobs, nthreads);
}
}
