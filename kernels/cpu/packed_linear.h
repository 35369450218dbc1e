// Linear layers over packed weights, out[M, N] = x[M, K] @ w[N, K]^T (+ bias): what packed_linear.cpp (the
// operators), the two tile schedules (packed_wide.h, packed_narrow.cpp) and the fused decode step
// (decode_layers.cpp) share.
//
// The weights are repacked once, at load, into panels of 16 output columns: panel p is a [K][16] block holding
// w[16p .. 16p+15, k] at row k (zeros past N). Every k then gives one 16-wide row of weights, and a tile of MR input
// rows x NP panels keeps its accumulators in registers, fed by a broadcast of x[m, k] per row: no cross-lane sums,
// and each weight is loaded once for all the tile's rows. The input is transposed first into [K][rows] blocks
// (pack_row), widened to float32. Accumulation is float32, one FMA per k in k order, then the bias, each output
// rounded once (as oneDNN's bfloat16 matmul does): every schedule and lane width gives the same bits.
// bench/kernel_ops.py measures it against BLAS over torch's layout.
#pragma once

#include <cstdint>

#include "vec.h"

extern "C" {
void silu_and_mul_row_f32(const float *g, float *o, int64_t d);
void silu_and_mul_row_bf16(const uint16_t *g, uint16_t *o, int64_t d);
}

namespace ksana::packed {

constexpr int64_t kPanel = 16;          // output columns per packed panel
constexpr int64_t kDecodeRows = 16;     // up to this many input rows run as one tile per panel group
constexpr int64_t kRowTile = 8;         // input rows per block of the packed input (see pack_row)
constexpr int64_t kParallelMin = 1 << 18;  // M * N * K below this stays on the calling thread

// Which schedule the build runs: the 32-register one (packed_wide.h) on AVX-512, or where KSANA_WIDE_LANES asks
// for it on pairs of eight lanes (to test it on another CPU); else the 16-register one (packed_narrow.cpp).
#if KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES)
constexpr bool kWideSchedule = true;
#else
constexpr bool kWideSchedule = false;
#endif

// A prefetch into L1 (T0) or L2 (T1): the instruction _mm_prefetch gives, on any CPU.
inline void prefetch_l1(const void *p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

// A thread's warming of the KV rows its first attention task of the layer reads, while the qkv projection before
// it runs (decode_layers.cpp; see packed_wide.h's split tile, the only tile that warms).
struct KvWarm {
    const char *at = nullptr, *end = nullptr;  // the current block's next line and its end
    const char *const *blocks = nullptr;       // the blocks still to warm, in the order the task reads them
    int64_t left = 0, block_bytes = 0;

    void line() {
        if (at == end) {
            if (!left) return;
            at = *blocks++, left--;
            end = at + block_bytes;
        }
        prefetch_l2(at);
        at += 64;
    }
};
// The calling thread's list while its qkv projection runs, else null: a thread-local, so the tiles' signatures
// (and every other caller of the packed matmul) stay as they are. Initial-exec: one load, no __tls_get_addr.
extern __thread KvWarm *kv_warming __attribute__((tls_model("initial-exec")));

// From how many input rows the wide tiles prefetch their own panels' streams in software (see
// set_packed_prefetch_min_rows); the prefetches move no value, so either setting gives the same bits.
extern int prefetch_min_rows;

// Columns [k0, k1) of row `row` of M (K values a row) into the tiles' input layout as float32: a[k][m] for up to 8
// rows, else a[t][k][m] with kRowTile rows a tile (row = t * kRowTile + m; a 16-row decode tile reads two), so
// threads that pack whole row tiles never write the same cache line.
template <typename T>
inline void pack_row(const T *x, int64_t K, int64_t k0, int64_t k1, float *a, int64_t M, int64_t row) {
    const int64_t step = M <= kRowTile ? M : kRowTile;
    float *dst = a + row / step * step * K + row % step;
    for (int64_t k = k0; k < k1; k++) dst[k * step] = load1(x + k);
}

// Columns [k0, k1) of row tile t (rows 8t..8t+7, `x_stride` apart, all below M, M >= 8) into the packed input as
// pack_row lays it out, eight columns at a time through a transpose instead of one strided store per value.
template <typename T>
inline void pack_tile(const T *x, int64_t x_stride, int64_t K, int64_t k0, int64_t k1, float *a, int64_t t) {
    const T *src = x + t * kRowTile * x_stride;
    float *dst = a + t * kRowTile * K;
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) {
        F32x8 r[kRowTile];
        for (int m = 0; m < kRowTile; m++) r[m] = F32x8::load(src + m * x_stride + k);
        transpose(r);
        for (int i = 0; i < 8; i++) r[i].store(dst + (k + i) * kRowTile);
    }
    for (; k < k1; k++)
        for (int m = 0; m < kRowTile; m++) dst[k * kRowTile + m] = load1(src + m * x_stride + k);
}

// Rows of M (`x_stride` apart, K values) in the row tiles tid, tid + nth, ... into the packed input: whole tiles by
// pack_tile, a partial one (or M < 8, whose layout is M rows wide) row by row.
template <typename T>
void pack_tiles(const T *x, int64_t x_stride, int64_t K, float *a, int64_t M, int tid, int nth) {
    for (int64_t t = tid; t * kRowTile < M; t += nth) {
        if (M >= kRowTile && (t + 1) * kRowTile <= M)
            pack_tile(x, x_stride, K, 0, K, a, t);
        else
            for (int64_t r = t * kRowTile; r < M && r < (t + 1) * kRowTile; r++)
                pack_row(x + r * x_stride, K, 0, K, a, M, r);
    }
}

// The calling thread's next run of panel groups [*g0, *g1) from the shared counter `next_group`: a thread's share
// of what is left, down to one. A thread the OS preempts (a server's event loop shares these cores) leaves the
// rest to the others, the last chunks are small so the threads reach the barrier together, and the early ones are
// long contiguous streams (fixed or smaller shares are slower, tools/decode_ab.py). False once no group is left.
inline bool claim_groups(int64_t *next_group, int64_t groups, int64_t nthreads, int64_t *g0, int64_t *g1) {
    int64_t first = __atomic_load_n(next_group, __ATOMIC_RELAXED);
    if (first >= groups) return false;
    int64_t chunk = (groups - first) / nthreads;
    chunk = chunk < 1 ? 1 : chunk;
    *g0 = __atomic_fetch_add(next_group, chunk, __ATOMIC_RELAXED);
    *g1 = *g0 + chunk < groups ? *g0 + chunk : groups;
    return true;
}

// Row m's k-th value in a tile's input. TileRows: a tile of MR rows of pack_row's layout over the whole input
// (a[k * MR + m] up to 8 rows, else a[m / 8][k][m % 8]); StridedRows: consecutive rows of one row tile, `step` wide;
// RowPointers: a pointer per row (chunks across row tiles).
template <int MR>
struct TileRows {
    const float *a;
    int64_t K;
    float at(int m, int64_t k) const {
        return MR > kRowTile ? a[m / kRowTile * kRowTile * K + k * kRowTile + m % kRowTile] : a[k * MR + m];
    }
};
struct StridedRows {
    const float *a;
    int64_t step;
    float at(int m, int64_t k) const { return a[k * step + m]; }
};
struct RowPointers {
    const float *const *a;
    int64_t step;
    float at(int m, int64_t k) const { return a[m][k * step]; }
};

// What a tile prefetches: nothing; each of its own panels' streams, kPrefetchL1 elements ahead into L1 and
// kPrefetchL2 into L2 (the wide tiles); or a share of the block the thread streams next, line
// (k - k0) * step / 2^16 of `at` at each k (the narrow tiles).
constexpr int64_t kPrefetchL1 = 512, kPrefetchL2 = 2048;  // 2 KiB and 8 KiB of float32: see packed_wide.h
struct NoFetch {
    void at_k(int64_t) const {}
    template <typename T>
    void panel(const T *) const {}
};
struct StreamFetch {
    bool on;
    void at_k(int64_t) const {}
    template <typename T>
    void panel(const T *wk) const {
        if (on) prefetch_l1(wk + kPrefetchL1), prefetch_l2(wk + kPrefetchL2);
    }
};
template <typename T>
struct ShareFetch {
    const T *at;
    int64_t step;
    void at_k(int64_t dk) const { prefetch_l1(at + (dk * step >> 16) * kPanel); }
    template <typename W>
    void panel(const W *) const {}
};

// Columns [0, cols) of one output row of a panel from its accumulators (16 / V::lanes vectors) plus the bias.
template <typename V, typename T>
inline void store_panel_row(T *o, const V *acc, const T *bias, int cols) {
    constexpr int H = kPanel / V::lanes;
    if (cols == kPanel) {
        for (int h = 0; h < H; h++) (bias ? acc[h] + V::load(bias + h * V::lanes) : acc[h]).store(o + h * V::lanes);
        return;
    }
    float v[kPanel];
    for (int h = 0; h < H; h++) acc[h].store(v + h * V::lanes);
    for (int j = 0; j < cols; j++) store1(o + j, bias ? v[j] + load1(bias + j) : v[j]);
}

// MR input rows x NP panels (`panel_stride` apart; weights of type W, float32 or T) over k in [k0, k1), on lanes V (a
// panel row is 16 / V::lanes vectors): the accumulators start at zero (k0 = 0) or from `part`, and end in `part` or, at
// k1 = K, in the output (`rows` <= MR rows `ldo` apart, the last panel's first `last_cols` columns, plus the bias).
// kWeightsFirst loads the k's weights for all panels, then broadcasts one row at a time (32 registers: up to 16 rows);
// else it broadcasts every row first, then loads one weight vector at a time (16 registers: 3 rows x 2 panels, 12
// accumulators). The loops are unrolled whole: with a variable index GCC keeps the accumulators in memory. The input
// and prefetch policies come by value, so their strides stay in registers. Never inlined: each shape is a function of
// its own, which GCC compiles as tightly as it does alone (inlined into its dispatch, the packed linear ran 3-7%
// slower: tools/decode_ab.py).
template <typename V, typename T, int MR, int NP, bool kWeightsFirst, typename Rows, typename Fetch, typename W>
[[gnu::noinline]] void panel_tile(const Rows in, const W *w, int64_t panel_stride, int64_t k0, int64_t k1, int64_t K,
                                   float *part, const T *bias, T *out, int64_t ldo, int rows, int last_cols,
                                   const Fetch fetch) {
    constexpr int H = kPanel / V::lanes, J = NP * H;
    V acc[MR][J];
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
        for (int j = 0; j < J; j++) acc[m][j] = k0 ? V::load(part + (m * J + j) * V::lanes) : V::zero();
#pragma GCC unroll 2
    for (int64_t k = k0; k < k1; k++) {
        fetch.at_k(k - k0);
        if constexpr (kWeightsFirst) {
            V b[J];
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) {
                const W *wk = w + p * panel_stride + k * kPanel;
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) b[p * H + h] = V::load(wk + h * V::lanes);
                fetch.panel(wk);
            }
#pragma GCC unroll 16
            for (int m = 0; m < MR; m++) {
                V x = V::splat(in.at(m, k));
#pragma GCC unroll 8
                for (int j = 0; j < J; j++) acc[m][j] = V::fma(x, b[j], acc[m][j]);
            }
        } else {
            V x[MR];
#pragma GCC unroll 16
            for (int m = 0; m < MR; m++) x[m] = V::splat(in.at(m, k));
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) {
                const W *wk = w + p * panel_stride + k * kPanel;
                fetch.panel(wk);
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    V b = V::load(wk + h * V::lanes);
#pragma GCC unroll 16
                    for (int m = 0; m < MR; m++) acc[m][p * H + h] = V::fma(x[m], b, acc[m][p * H + h]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++) {
        if (k1 < K) {
#pragma GCC unroll 8
            for (int j = 0; j < J; j++) acc[m][j].store(part + (m * J + j) * V::lanes);
        } else if (m < rows) {
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++)
                store_panel_row(out + m * ldo + p * kPanel, &acc[m][p * H], bias ? bias + p * kPanel : nullptr,
                                p == NP - 1 ? last_cols : static_cast<int>(kPanel));
        }
    }
}

// f(std::integral_constant<int, n>) for the runtime n in [1, N]: a tile's compile-time shape from a count.
template <int N, typename F>
inline void with_count(int64_t n, F &&f) {
    if constexpr (N > 0) {
        if (n == N) return f.template operator()<N>();
        with_count<N - 1>(n, f);
    }
}

// What packed_linear_greedy's panel groups found, per slice of 16 rows and group, the rows in the 16 lanes (see
// packed_wide.h's greedy_block): slice s's group g at s * groups + g. Column indices travel as float32 (exact
// below 2^24 columns).
struct GreedyGroups {
    int64_t groups, vocab;
    float *max, *sum;     // the group's maximum logit; sum(exp(logit - that maximum)) over the group
    float *id, *nan_id;   // the first column holding the maximum (-1: every logit -inf); the first NaN's (-1)
};
// The wide schedule's greedy parts: how many panel groups an [M, N] output has, and each row of slice `slice` (16
// rows at most): its token and log-probability from its groups.
int64_t group_count(int64_t M, int64_t N);
void greedy_combine(const GreedyGroups &greedy, int64_t slice, int64_t rows, int64_t *ids, float *logprobs);

// The matmul over packed input `a` (pack_row's layout, whole tiles) for the calling thread, which takes panel
// groups from the shared counter `next_group` (0 at the start) until none is left; with `greedy` (the wide schedule
// only), no `out`: each group's logits go to greedy instead. Defined by the build's schedule.
template <typename T>
void panel_groups(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N, int64_t K,
                  int64_t *next_group, int64_t nthreads, GreedyGroups *greedy);

// gate_up and SwiGLU in one pass, for decode_layers (see swiglu_fusable): group g is gate panel g and up panel
// g + inter / 16, whose SwiGLU goes straight into down's packed input `a_out` (swiglu_into_packed). The same values
// as the matmul, the SiLU pass and the packing, without the [M, 2 * inter] output, the SiLU phase or its barrier
// (tools/decode_ab.py, same bits).
template <typename T>
void swiglu_groups(const float *a, const T *w, int64_t M, int64_t inter, int64_t K, int64_t *next_group,
                   int64_t nthreads, float *a_out);

// Whether decode_layers can run an MLP's gate_up projection and SwiGLU as one pass: up to kDecodeRows rows (larger
// inputs take the wider groups of the gemm tiles) and gate and up in whole panels; the pass adds no bias, so a
// layer with a gate_up bias keeps the two passes.
inline bool swiglu_fusable(int64_t M, int64_t inter) { return M <= kDecodeRows && inter % kPanel == 0; }

inline void silu_and_mul_row(const float *g, float *o, int64_t d) { silu_and_mul_row_f32(g, o, d); }
inline void silu_and_mul_row(const bf16 *g, bf16 *o, int64_t d) { silu_and_mul_row_bf16(g, o, d); }

// The one pass's epilogue: each of a pair group's M rows in `block` (gate's 16 columns, then up's) through the
// SwiGLU row, into columns [16 g, 16 g + 16) of down's packed input.
template <typename T>
inline void swiglu_into_packed(const T *block, int64_t M, int64_t g, int64_t inter, float *a) {
    const int64_t step = M <= kRowTile ? M : kRowTile;
    T act[kPanel];
    for (int64_t m = 0; m < M; m++) {
        silu_and_mul_row(block + m * 2 * kPanel, act, kPanel);
        pack_row(act, inter, 0, kPanel, a + g * kPanel * step, M, m);
    }
}

}  // namespace ksana::packed
