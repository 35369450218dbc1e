// The packed linear's schedule for 16 vector registers of 8 lanes (AVX2; NEON and the portable lanes compile it
// too): a tile is MR <= 3 input rows x NP panels, each panel two 8-lane halves, so at most 12 accumulators (3 x 2
// and 2 x 3 panels, 1 x 4), plus the rows' broadcasts and one weight vector. See packed_linear.h for the layout;
// bench/kernel_ops.py and tools/decode_ab.py measure it.
//
// A decode step's rows (and prefill's, across row tiles: row_chunks) go in chunks of up to 3 rows over each panel
// group, a block of k at a time: every row chunk passes over the block (in L1) before the next block, the first
// streaming it from memory, so the stream runs beside the arithmetic, not before it; the chunks' partial sums wait
// in `part`. A bfloat16 block with four chunks or more is widened to float32 once, before them (widen_block). A
// tile does not prefetch its own panels: on AMD CPUs with AVX2 only the hardware prefetchers stream them alone,
// and the wide tiles' prefetches cost time there, most at few rows. The chunks prefetch the block the thread
// streams next instead (next_block), evenly over the block's work: else the first chunk stalls on memory and the
// rest run from L1 with memory idle.
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "packed_linear.h"

namespace ksana::packed {

#if !(KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES))
namespace {

constexpr int64_t kChunkRows = 3;  // input rows per tile at most
constexpr int kMostAccumulators = 12;

// Values of k per pass of the row chunks over a panel group: with one chunk (up to 3 rows) it only sets how often
// the partial sums are saved; 4-8 rows 32 (4 KiB of a panel group's float32 in L1), 9-16 rows 64, more 128, each
// the fastest block for its rows over smollm2's projections (tools/decode_ab.py).
constexpr int64_t k_block(int64_t M) { return M < 4 ? 128 : M <= kRowTile ? 32 : M <= kDecodeRows ? 64 : 128; }

// The rows of one tile of the packed input (`rows`, up to kRowTile) in chunks of at most `mr` rows (kChunkRows, or
// 2: see decode_chunk_rows), as even as they go: chunk c is rows [rows * c / n, rows * (c + 1) / n) of n.
constexpr int64_t chunks_of(int64_t rows, int64_t mr) { return (rows + mr - 1) / mr; }
// Panels per group: as many as keep the largest chunk at 12 accumulators at most.
inline int panels_per_group(int64_t M, int64_t mr) {
    const int64_t rows = M < kRowTile ? M : kRowTile, chunks = chunks_of(rows, mr);
    const int64_t most = (rows + chunks - 1) / chunks;
    return most >= 3 ? 2 : most == 2 ? 3 : 4;
}
// A model of a decode pass's tile time per panel and k, chunks of at most `mr` rows: a chunk's FMAs a k at two a
// cycle, but no faster than the 5-cycle FMA latency of one accumulator (fewer than 10 accumulators wait on it),
// over its panels, plus 0.3 for each chunk (its passes over the block from L1, its partial sums); fitted to the
// packed linear's times with the two chunkings below at 2 to 16 rows over smollm2's projections.
inline double pass_cost(int64_t M, int64_t mr) {
    const int np = panels_per_group(M, mr);
    double cost = 0;
    for (int64_t t0 = 0; t0 < M; t0 += kRowTile) {
        const int64_t rows = M - t0 < kRowTile ? M - t0 : kRowTile, n = chunks_of(rows, mr);
        for (int64_t c = 0; c < n; c++) {
            const double fmas = 2.0 * np * (rows * (c + 1) / n - rows * c / n);
            cost += (fmas / 2 > 5 ? fmas / 2 : 5) / np + 0.3;
        }
    }
    return cost;
}
// Rows per chunk of a float32 decode pass (up to kDecodeRows rows, not the gate_up pairs, whose groups are two
// panels): 2-row chunks over 3 panels where the model says they beat the 3-row chunks over 2, which leave 2-row
// chunks over 2 panels (8 accumulators) wherever the rows do not split into threes (at 8, 9, 10, 12 and 16 rows;
// tools/decode_ab.py). The same sums in the same order: the same bits. Not for bfloat16 weights: there each of
// the 3 panels' loads also widens its values, and 2-row chunks are slower.
inline int64_t decode_chunk_rows(int64_t M) { return pass_cost(M, 2) < pass_cost(M, kChunkRows) ? 2 : kChunkRows; }

// The block of panels a thread streams after the current one, and how its row chunks share prefetching it: the
// group's next k block, or else the next group's first, which is the next of the thread's run or, at the run's
// end, the first group no thread has taken yet (likely the thread's own next claim). With fewer row chunks than
// panels (up to 4 rows) nothing is prefetched: there the hardware prefetchers keep up. `at` is the block's offset
// in elements from the first panel.
struct NextBlock {
    int64_t at = 0, panel_len = 0, k = 0, panels = 0, per_panel = 0;  // per_panel: chunks prefetching each panel
};
inline NextBlock next_block(int64_t g, int64_t g1, int64_t *next_group, int64_t groups, int np, int64_t panels,
                            int64_t panel_len, int64_t k1, int64_t K, int64_t kblock, int64_t chunks,
                            int64_t pair_half) {
    // pairs (pair_half > 0, see pass): group g is panels g and g + pair_half
    NextBlock next;
    next.panel_len = pair_half ? pair_half * panel_len : panel_len;
    int64_t group = g;
    const int64_t group_len = pair_half ? panel_len : np * panel_len;
    if (k1 < K) {
        next.at = g * group_len + k1 * kPanel, next.k = K - k1;
    } else {
        group = g + 1 < g1 ? g + 1 : __atomic_load_n(next_group, __ATOMIC_RELAXED);
        if (group >= groups) return next;
        next.at = group * group_len, next.k = K;
    }
    next.k = next.k < kblock ? next.k : kblock;
    next.panels = pair_half ? 2 : panels - group * np < np ? panels - group * np : np;
    next.per_panel = chunks / next.panels;  // each chunk prefetches at least 16 lines
    next.per_panel = next.per_panel < next.k / 16 ? next.per_panel : next.k / 16;
    return next;
}

// The row chunks' shares of the next block, for every block of one shape: chunk c < `n` prefetches from line
// `at[c]` past the block's start, `step[c]` lines per k as 16.16 fixed point; chunks from `n` on prefetch nothing.
// Blocks of a matmul share a shape but for a group's last k block and the last group, so the table is made again
// only when the shape changes (`key`): its integer divisions, made for every tile call, would cost a decode step
// about 2%.
constexpr int64_t kShares = 64;  // chunks that can prefetch: at most np * kblock / 16, 4 * 128 / 16 = 32
struct Shares {
    int64_t key[4] = {-1, 0, 0, 0}, n = 0, at[kShares], step[kShares];

    void update(const NextBlock &next, int64_t k_len) {
        if (key[0] == next.k && key[1] == next.panels && key[2] == next.per_panel && key[3] == k_len) return;
        key[0] = next.k, key[1] = next.panels, key[2] = next.per_panel, key[3] = k_len;
        n = next.per_panel * next.panels;
        n = n < kShares ? n : kShares;
        for (int64_t c = 0; c < n; c++) {
            const int64_t j = c % next.per_panel, l0 = next.k * j / next.per_panel;
            const int64_t l1 = next.k * (j + 1) / next.per_panel;
            at[c] = c / next.per_panel * next.panel_len + l0 * kPanel;
            step[c] = ((l1 - l0) << 16) / k_len;
        }
    }
};

// A row chunk above kDecodeRows rows: `rows` input rows from row `row`; row m's values at a[m][k * 8].
struct RowChunk {
    const float *a[kChunkRows];
    int64_t row;
    int rows;
};
// Above kDecodeRows rows, three consecutive rows a chunk, across the packed input's row tiles, and 2 + 2 for a last
// 3 + 1: within the tiles (3 + 3 + 2) a 2-row chunk costs nearly a 3-row chunk's time for two thirds of its FLOPs.
// Up to 16 rows the chunks stay within the tiles: across them a pointer per row for every tile costs the decode
// step more than the fuller chunks gain (tools/decode_ab.py).
void row_chunks(const float *a, int64_t M, int64_t K, RowChunk *chunk) {
    const int64_t chunks = chunks_of(M, kChunkRows);
    for (int64_t ci = 0; ci < chunks; ci++) {
        const int64_t left = M - ci * kChunkRows;
        chunk[ci].row = ci * kChunkRows, chunk[ci].rows = static_cast<int>(left < kChunkRows ? left : kChunkRows);
    }
    if (M % kChunkRows == 1) chunk[chunks - 2].rows = 2, chunk[chunks - 1].row--, chunk[chunks - 1].rows = 2;
    for (int64_t ci = 0; ci < chunks; ci++)
        for (int m = 0; m < chunk[ci].rows; m++) {
            const int64_t r = chunk[ci].row + m;
            chunk[ci].a[m] = a + r / kRowTile * kRowTile * K + r % kRowTile;
        }
}

// A chunk of `rows` x `np` panels over k in [k0, k1) (see panel_tile; weights of type W: T, or float32 widened from
// it); with `fetch`, prefetching its share of the next block from `pf`, `share` lines per k (16.16 fixed point).
template <typename W, typename T, typename Rows>
void chunk_tile(int rows, int np, const Rows &in, const W *w, int64_t panel_stride, int64_t k0, int64_t k1,
                int64_t K, float *part, const T *bias, T *out, int64_t ldo, int cols, bool fetch, const T *pf,
                int64_t share) {
    with_count<kChunkRows>(rows, [&]<int MR>() {
        with_count<4>(np, [&]<int NP>() {
            if constexpr (MR * NP * 2 <= kMostAccumulators) {
                if (fetch)
                    panel_tile<F32x8, T, MR, NP, false>(in, w, panel_stride, k0, k1, K, part, bias, out, ldo, MR, cols,
                                                        ShareFetch<T>{pf, share});
                else
                    panel_tile<F32x8, T, MR, NP, false>(in, w, panel_stride, k0, k1, K, part, bias, out, ldo, MR, cols,
                                                        NoFetch{});
            }
        });
    });
}

// A block of a bfloat16 panel group in float32 for its row chunks: `np` panels (`panel_stride` apart) over k in
// [k0, k1) into `wide`, panel p's k at wide[(p * kblock + k - k0) * kPanel]. Widened once, not once per chunk: the
// widening's shuffles take the ports the FMAs need; the block then stays in L1 (at most 16 KiB, kWideBlock). It
// pays from 4 chunks (kWidenChunks), where the widenings saved outweigh the separate pass, which streams the block
// from memory with no FMAs beside it: the fused decode step in bfloat16 at batch 4 (2 chunks) took 1.16x the time
// of widening in each chunk, 8 (3 chunks) 1.01x, 16 (6) 0.94x, 32 (11) 0.86x (tools/decode_ab.py --dtype bfloat16,
// the AVX2 build on an AVX-512 Xeon, KSANA_CPU_KERNELS=avx2).
constexpr int64_t kWideBlock = 2 * 128 * kPanel;  // the most np * kblock * kPanel of a pass with kWidenChunks chunks
constexpr int64_t kWidenChunks = 4;
inline void widen_block(const bf16 *w, int64_t panel_stride, int np, int64_t k0, int64_t k1, int64_t kblock,
                        float *wide) {
    for (int p = 0; p < np; p++)
        for (int64_t k = k0; k < k1; k++)
            for (int h = 0; h < kPanel / F32x8::lanes; h++)
                F32x8::load(w + p * panel_stride + k * kPanel + h * F32x8::lanes)
                    .store(wide + (p * kblock + k - k0) * kPanel + h * F32x8::lanes);
}

// The matmul over packed input `a` for the calling thread, taking panel groups from `next_group` (see
// claim_groups), a k_block of k at a time. With `pair_half` > 0 (up to kDecodeRows rows; see swiglu_groups) group
// g is panels g and g + pair_half, computed into a block on the stack, whose SwiGLU goes into `act_out`.
template <typename T>
void pass(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N, int64_t K, int64_t *next_group,
          int64_t nthreads, int64_t pair_half, float *act_out) {
    const int64_t panels = (N + kPanel - 1) / kPanel, panel_len = K * kPanel;
    const int last_cols = N % kPanel ? static_cast<int>(N % kPanel) : static_cast<int>(kPanel);
    const int64_t step = M <= kRowTile ? M : kRowTile;  // rows per tile of the packed input
    const bool across = M > kDecodeRows;                 // chunks across row tiles (row_chunks)
    const int64_t mr = across || pair_half || sizeof(T) != sizeof(float) ? kChunkRows : decode_chunk_rows(M);
    const int np = pair_half ? 2 : panels_per_group(M, mr);
    const int64_t groups = pair_half ? pair_half : (panels + np - 1) / np;
    const int64_t ld = pair_half ? 2 * kPanel : N, panel_stride = pair_half ? pair_half * panel_len : panel_len;
    T block[kDecodeRows * 2 * kPanel];  // pairs: a group's gate and up outputs
    // a chunk's partial sums: at most 12 accumulators of 8 floats; 3 chunks on the stack (to 8 rows)
    const int64_t chunks = across ? chunks_of(M, mr)
                                  : M / step * chunks_of(step, mr) + (M % step ? chunks_of(M % step, mr) : 0);
    const int64_t part_len = kMostAccumulators * 8, kblock = k_block(M);
    float small[3 * kMostAccumulators * 8];
    float *part = chunks <= 3 ? small : static_cast<float *>(std::malloc(sizeof(float) * chunks * part_len));
    // row chunk c of a whole row tile and of a partial last one: rows [bounds[c], bounds[c + 1])
    const int64_t last_rows = M % step ? M % step : step;
    const int64_t n_whole = chunks_of(step, mr), n_last = chunks_of(last_rows, mr);
    int64_t whole_bounds[kChunkRows + 2], last_bounds[kChunkRows + 2];
    // bfloat16 weights with kWidenChunks row chunks or more: each block widened once, the chunks read it in float32
    constexpr bool bf16_weights = !std::is_same_v<T, float>;
    const bool widens = bf16_weights && chunks >= kWidenChunks && np * kblock * kPanel <= kWideBlock;
    alignas(64) float wide[bf16_weights ? kWideBlock : 1];
    for (int64_t c = 0; c <= n_whole; c++) whole_bounds[c] = step * c / n_whole;
    for (int64_t c = 0; c <= n_last; c++) last_bounds[c] = last_rows * c / n_last;
    RowChunk *chunk = across ? static_cast<RowChunk *>(std::malloc(sizeof(RowChunk) * chunks)) : nullptr;
    if (across) row_chunks(a, M, K, chunk);
    Shares shares;
    for (int64_t g0, g1; claim_groups(next_group, groups, nthreads, &g0, &g1);) {
        for (int64_t g = g0; g < g1; g++) {
            const int64_t p0 = pair_half ? g : g * np;
            const int gp = pair_half ? 2 : panels - p0 < np ? static_cast<int>(panels - p0) : np;
            const int cols = !pair_half && p0 + gp == panels ? last_cols : static_cast<int>(kPanel);
            const T *wg = w + p0 * panel_len;
            const T *bg = bias ? bias + p0 * kPanel : nullptr;
            T *og = pair_half ? block : out + p0 * kPanel;
            for (int64_t k0 = 0; k0 < K; k0 += kblock) {
                const int64_t k1 = k0 + kblock < K ? k0 + kblock : K;
                const NextBlock next = next_block(g, g1, next_group, groups, np, panels, panel_len, k1, K, kblock,
                                                  chunks, pair_half);
                shares.update(next, k1 - k0);
                // every row chunk over the block, its weights from wb (panels `stride` apart, k at wb + k * kPanel)
                const auto block_chunks = [&](const auto *wb, int64_t stride) {
                    float *pc = part;
                    for (int64_t ci = 0; across && ci < chunks; ci++, pc += part_len) {
                        const RowChunk &c = chunk[ci];
                        const bool pf = ci < shares.n;
                        chunk_tile(c.rows, gp, RowPointers{c.a, step}, wb, stride, k0, k1, K, pc, bg,
                                   out + c.row * N + p0 * kPanel, N, cols, pf,
                                   w + (pf ? next.at + shares.at[ci] : 0), pf ? shares.step[ci] : 0);
                    }
                    int64_t ci = 0;  // the chunk's index in this block
                    for (int64_t t0 = 0; !across && t0 < M; t0 += step) {
                        const bool whole = M - t0 >= step;
                        const int64_t n = whole ? n_whole : n_last;
                        const int64_t *bounds = whole ? whole_bounds : last_bounds;
                        for (int64_t c = 0; c < n; c++, ci++, pc += part_len) {
                            const int64_t r0 = bounds[c], r1 = bounds[c + 1];
                            const bool pf = ci < shares.n;
                            chunk_tile(static_cast<int>(r1 - r0), gp, StridedRows{a + t0 * K + r0, step}, wb,
                                       stride, k0, k1, K, pc, bg, og + (t0 + r0) * ld, ld, cols, pf,
                                       w + (pf ? next.at + shares.at[ci] : 0), pf ? shares.step[ci] : 0);
                        }
                    }
                };
                if constexpr (bf16_weights) {
                    if (widens) {
                        widen_block(wg, panel_stride, gp, k0, k1, kblock, wide);
                        // the tiles index weights by absolute k: the block's k0 sits at wide[0] (they read k >= k0)
                        block_chunks(reinterpret_cast<const float *>(reinterpret_cast<uintptr_t>(wide) -
                                                                     k0 * kPanel * sizeof(float)),
                                     kblock * kPanel);
                        continue;
                    }
                }
                block_chunks(wg, panel_stride);
            }
            if (pair_half) swiglu_into_packed(block, M, g, pair_half * kPanel, act_out);
        }
    }
    if (part != small) std::free(part);
    std::free(chunk);
}

}  // namespace

template <typename T>
void panel_groups(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N, int64_t K,
                  int64_t *next_group, int64_t nthreads, GreedyGroups *) {
    pass(a, w, bias, out, M, N, K, next_group, nthreads, 0, nullptr);
}

template <typename T>
void swiglu_groups(const float *a, const T *w, int64_t M, int64_t inter, int64_t K, int64_t *next_group,
                   int64_t nthreads, float *a_out) {
    pass<T>(a, w, nullptr, nullptr, M, 2 * inter, K, next_group, nthreads, inter / kPanel, a_out);
}

template void panel_groups<float>(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t,
                                  int64_t *, int64_t, GreedyGroups *);
template void panel_groups<bf16>(const float *, const bf16 *, const bf16 *, bf16 *, int64_t, int64_t, int64_t,
                                 int64_t *, int64_t, GreedyGroups *);
template void swiglu_groups<float>(const float *, const float *, int64_t, int64_t, int64_t, int64_t *, int64_t,
                                   float *);
template void swiglu_groups<bf16>(const float *, const bf16 *, int64_t, int64_t, int64_t, int64_t *, int64_t,
                                  float *);
#endif

}  // namespace ksana::packed
