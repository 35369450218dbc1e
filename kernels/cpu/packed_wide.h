// The packed linear's schedule for 32 vector registers of 16 lanes (AVX-512; with KSANA_WIDE_LANES, the same code
// on pairs of eight lanes, to test it on other CPUs): which tile runs over which panel group, and greedy decoding
// fused into the lm_head. See packed_linear.h for the layout; bench/kernel_ops.py and tools/decode_ab.py measure it.
// These are templates: packed_wide.cpp and packed_wide_bf16.cpp instantiate them for each weight type, two
// compilations that run side by side (one alone took half a minute at -O3).
//
// Decode-sized inputs (up to 16 rows) run one tile of all rows per panel group, so the weights are read exactly
// once; larger inputs (prefill) run tiles of 8 rows x 3 panels, the panels' K x 48 block staying in L2 while every
// row tile passes over it. The tiles prefetch their own panels' streams, 2 KiB into L1 and 8 KiB into L2: against
// one T0 prefetch 4 KiB ahead, that streamed a 512 MiB weight 0-3% faster at 1 row, 5-9% at 2-8 rows and 2-5% at
// 16 (a T1 alone, 8 KiB ahead: 2-4% faster from 8 rows, slower at 2-4), and the same at 32-64 rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "packed_linear.h"

namespace ksana::packed {

#if KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES)
namespace {

using V = F32x16;
constexpr int64_t kGemmRows = 8;    // input rows per tile above kDecodeRows
constexpr int64_t kGemmPanels = 3;  // panels per tile above kDecodeRows
constexpr int64_t kSplitK = 16;     // values of k per block of the split tile and the sweep
constexpr int64_t kSweepTiles = 8;  // row tiles the sweep takes at most

// 1-3 rows: four panels, for 4-12 accumulators in flight; 4-8 rows: two (at 8 rows, 2 weight loads and 8
// broadcasts for 16 FMAs); 9-16: the split tile's two.
constexpr int panels_of_decode_tile(int64_t rows) { return rows >= 4 ? 2 : 4; }
// Panels per group: the decode tile's up to kDecodeRows rows, the gemm tiles' above.
constexpr int panels_per_group(int64_t rows) { return rows <= kDecodeRows ? panels_of_decode_tile(rows) : kGemmPanels; }

// A whole-K tile of MR rows x NP panels over pack_row's layout; `prefetch`: its panels' streams too, from
// prefetch_min_rows rows.
template <typename T, int MR, int NP>
void tile(const float *a, const T *w, int64_t panel_len, int64_t K, const T *bias, T *out, int64_t ldo, int rows,
          int last_cols, bool prefetch) {
    panel_tile<V, T, MR, NP, true>(TileRows<MR>{a, K}, w, panel_len, 0, K, K, nullptr, bias, out, ldo, rows,
                                   last_cols, StreamFetch{prefetch && MR >= prefetch_min_rows});
}

// 9-16 input rows (MR) x 2 panels in two halves of rows, 8 and MR - 8, one kSplitK-long block of k at a time: each
// half's 16 accumulators come from (and go back to) the stack between blocks, while the block's 2 KiB of weights stay
// in L1 for the second half. Per k that is 2 weight loads and 8 broadcasts for 16 FMAs, where the one-panel tile needs
// 17 loads for 16, so the weights stream faster (tools/decode_ab.py). A bfloat16 block is widened once, by the first
// half, for both: the fused decode step at batch 16 took 0.94x the time of widening it in each half (tools/decode_ab.py
// --dtype bfloat16, AVX-512). Each half prefetches one panel's stream, so the requests go out evenly over the block;
// past its panel's end the prefetch goes on in the next group's same panel (two panels on when the panels are adjacent,
// one when a pair's are far apart). The first half also warms a line of the thread's KV list (kv_warming) per k: at 16
// rows the projection is bound by the FMAs and reads its weights at about half the read ceiling, so the attention after
// it finds most of its first task's keys and values in L2 (a task of 512 positions is 786 KiB of smollm2's float32 KV,
// within a 1 MiB L2); warming more costs more than it saves (tools/decode_ab.py). Every output is the same sum in the
// same order as the one-panel tile's.
template <typename T, int MR>
void split_tile(const float *a, const T *w, int64_t panel_len, int64_t K, const T *bias, T *out, int64_t ldo,
                int rows, int last_cols) {
    KvWarm *warming = kv_warming;
    V saved[2][kRowTile][2];
    // the first half's widened bfloat16 block, for the second (the widening's shuffles compete with the FMAs)
    constexpr bool widens = !std::is_same_v<T, float>;
    alignas(64) float wide[widens ? kSplitK : 1][2][kPanel];
    const int64_t run = K * kPanel, jump = panel_len == run ? panel_len : 0;
    for (int64_t k0 = 0; k0 < K; k0 += kSplitK) {
        const int64_t k1 = k0 + kSplitK < K ? k0 + kSplitK : K;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int hr = h ? MR - kRowTile : kRowTile;  // this half's rows
            const float *ah = a + h * kRowTile * K;
            const T *ws = w + h * panel_len;  // the panel this half prefetches
            V acc0[kRowTile], acc1[kRowTile];
#pragma GCC unroll 8
            for (int m = 0; m < kRowTile; m++) {
                acc0[m] = k0 && m < hr ? saved[h][m][0] : V::zero();
                acc1[m] = k0 && m < hr ? saved[h][m][1] : V::zero();
            }
            for (int64_t k = k0; k < k1; k++) {
                V b0, b1;
                if constexpr (widens) {
                    if (h) {  // the first half's widened weights
                        b0 = V::load(wide[k - k0][0]), b1 = V::load(wide[k - k0][1]);
                    } else {
                        b0 = V::load(w + k * kPanel), b1 = V::load(w + panel_len + k * kPanel);
                        b0.store(wide[k - k0][0]), b1.store(wide[k - k0][1]);
                    }
                } else {
                    b0 = V::load(w + k * kPanel), b1 = V::load(w + panel_len + k * kPanel);
                }
                const int64_t f1 = k * kPanel + kPrefetchL1, f2 = k * kPanel + kPrefetchL2;
                prefetch_l1(ws + (f1 < run ? f1 : f1 + jump));
                prefetch_l2(ws + (f2 < run ? f2 : f2 + jump));
                if (h == 0 && warming) warming->line();
#pragma GCC unroll 8
                for (int m = 0; m < kRowTile; m++) {
                    if (m >= hr) break;
                    V x = V::splat(ah[k * kRowTile + m]);
                    acc0[m] = V::fma(x, b0, acc0[m]);
                    acc1[m] = V::fma(x, b1, acc1[m]);
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < kRowTile; m++)
                if (m < hr) saved[h][m][0] = acc0[m], saved[h][m][1] = acc1[m];
        }
    }
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < 2; p++)
            store_panel_row(out + m * ldo + p * kPanel, &saved[m / kRowTile][m % kRowTile][p],
                            bias ? bias + p * kPanel : nullptr, p ? last_cols : static_cast<int>(kPanel));
}

// 17-64 input rows (kSweepTiles row tiles of 8 at most) x kGemmPanels panels: every row tile over one block of
// kSplitK k while the block's 3 KiB of weights are in L1, then the next block, each tile's 24 accumulators kept on
// the stack between blocks. The gemm tiles run each row tile over the whole K instead, so only the first streams
// weights from memory and the others compute from L2 while the memory idles; here the first three tiles each
// prefetch one panel's stream, spread over every block. Same sums in the same order as the gemm tile's. float32
// only: a bfloat16 weight is half the bytes and its widening more arithmetic, so there the step is FLOP-bound and
// the accumulators' trips to the stack cost more than the stream gains (tools/decode_ab.py at batches 32-64).
template <typename T>
void sweep(const float *a, const T *w, int64_t panel_len, int64_t K, const T *bias, T *out, int64_t ldo, int64_t M,
           int last_cols) {
    const int64_t tiles = (M + kGemmRows - 1) / kGemmRows;
    V saved[kSweepTiles][kGemmRows][kGemmPanels];
    for (int64_t k0 = 0; k0 < K; k0 += kSplitK) {
        const int64_t k1 = k0 + kSplitK < K ? k0 + kSplitK : K;
        for (int64_t t = 0; t < tiles; t++) {
            const float *at = a + t * kGemmRows * K;
            const T *ws = w + (t < kGemmPanels ? t : 0) * panel_len;  // the panel this tile prefetches
            V acc[kGemmRows][kGemmPanels];
#pragma GCC unroll 8
            for (int m = 0; m < kGemmRows; m++)
#pragma GCC unroll 3
                for (int p = 0; p < kGemmPanels; p++) acc[m][p] = k0 ? saved[t][m][p] : V::zero();
            for (int64_t k = k0; k < k1; k++) {
                V b[kGemmPanels];
#pragma GCC unroll 3
                for (int p = 0; p < kGemmPanels; p++) b[p] = V::load(w + p * panel_len + k * kPanel);
                if (t < kGemmPanels) prefetch_l1(ws + k * kPanel + kPrefetchL1), prefetch_l2(ws + k * kPanel + kPrefetchL2);
#pragma GCC unroll 8
                for (int m = 0; m < kGemmRows; m++) {
                    V x = V::splat(at[k * kGemmRows + m]);
#pragma GCC unroll 3
                    for (int p = 0; p < kGemmPanels; p++) acc[m][p] = V::fma(x, b[p], acc[m][p]);
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < kGemmRows; m++)
#pragma GCC unroll 3
                for (int p = 0; p < kGemmPanels; p++) saved[t][m][p] = acc[m][p];
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int p = 0; p < kGemmPanels; p++)
            store_panel_row(out + m * ldo + p * kPanel, &saved[m / kGemmRows][m % kGemmRows][p],
                            bias ? bias + p * kPanel : nullptr, p == kGemmPanels - 1 ? last_cols : static_cast<int>(kPanel));
}

// A decode input's panel group of `gp` panels (`np` a whole group): the wide tile over a whole group, else one
// panel at a time.
template <typename T>
void decode_group(const float *a, const T *w, int64_t panel_len, int64_t K, const T *bias, T *out, int64_t ld,
                  int64_t M, int gp, int np, int last_cols) {
    if (gp == np) {
        with_count<kDecodeRows>(M, [&]<int MR>() {
            if constexpr (MR > kRowTile)
                split_tile<T, MR>(a, w, panel_len, K, bias, out, ld, MR, last_cols);
            else
                tile<T, MR, panels_of_decode_tile(MR)>(a, w, panel_len, K, bias, out, ld, MR, last_cols, true);
        });
        return;
    }
    for (int i = 0; i < gp; i++)
        with_count<kDecodeRows>(M, [&]<int MR>() {
            tile<T, MR, 1>(a, w + i * panel_len, panel_len, K, bias ? bias + i * kPanel : nullptr, out + i * kPanel,
                           ld, MR, i == gp - 1 ? last_cols : static_cast<int>(kPanel), true);
        });
}

// Greedy decoding's part of one panel group of the lm_head: for each of up to 16 rows, the group's maximum over
// columns [col0, col0 + width) of `block` (rows `ld` apart), the first column holding it, the first NaN's column,
// and sum(exp(x - the group's maximum)), into `greedy` at `index`. The rows go in the lanes: 16 columns at a time
// are transposed, so every step is one vector op for all rows. Columns are taken in order, so the first maximum
// and the first NaN are the first ones.
template <typename T>
void greedy_block(const T *block, int64_t ld, int rows, int64_t col0, int64_t width, GreedyGroups *greedy,
                  int64_t index) {
    const V minus_inf = V::splat(-INFINITY);
    V m = minus_inf, sum = V::zero(), id = V::splat(-1.0f), nan_id = id;
    int nan = 0;
    for (int64_t c0 = 0; c0 < width; c0 += kPanel) {
        const int cols = width - c0 < kPanel ? static_cast<int>(width - c0) : static_cast<int>(kPanel);
        V col[16];
        for (int r = 0; r < 16; r++) col[r] = r < rows ? V::load(block + r * ld + c0) : V::zero();
        transpose(col);
        const V before = m;
        for (int c = 0; c < cols; c++) {
            const V column = V::splat(static_cast<float>(col0 + c0 + c));
            const int first_nan = col[c].nan_mask() & ~nan;
            nan_id = V::select(first_nan, column, nan_id), nan |= first_nan;
            const int above = col[c].gt_mask(m);
            m = V::select(above, col[c], m), id = V::select(above, column, id);
        }
        // rescale what the earlier columns summed to the new maximum (rows with one above -inf only)
        const int some = m.gt_mask(minus_inf), had = before.gt_mask(minus_inf);
        sum = V::select(had, sum * exp_nonpositive(before - m), sum);
        for (int c = 0; c < cols; c++) sum = V::select(some, sum + exp_nonpositive(col[c] - m), sum);
    }
    m.store(greedy->max + 16 * index), sum.store(greedy->sum + 16 * index);
    id.store(greedy->id + 16 * index), nan_id.store(greedy->nan_id + 16 * index);
}

}  // namespace

template <typename T>
void panel_groups(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N, int64_t K,
                  int64_t *next_group, int64_t nthreads, GreedyGroups *greedy) {
    const int64_t panels = (N + kPanel - 1) / kPanel, panel_len = K * kPanel;
    const int last_cols = N % kPanel ? static_cast<int>(N % kPanel) : static_cast<int>(kPanel);
    const bool decode = M <= kDecodeRows;
    const int64_t row_tiles = decode ? 1 : (M + kGemmRows - 1) / kGemmRows;
    const int np = panels_per_group(M);
    const int64_t groups = (panels + np - 1) / np;
    // greedy: a panel group's logits, rows ld apart (on the stack for a decode tile)
    T small[kDecodeRows * 4 * kPanel];
    T *block = greedy && !decode ? static_cast<T *>(std::malloc(sizeof(T) * M * np * kPanel)) : small;
    const int64_t ld = greedy ? np * kPanel : N;
    for (int64_t g0, g1; claim_groups(next_group, groups, nthreads, &g0, &g1);) {
        for (int64_t g = g0; g < g1; g++) {
            const int64_t p0 = g * np;
            const int gp = panels - p0 < np ? static_cast<int>(panels - p0) : np;  // panels in this group
            const int cols = p0 + gp == panels ? last_cols : static_cast<int>(kPanel);
            const T *wg = w + p0 * panel_len;
            const T *bg = bias ? bias + p0 * kPanel : nullptr;
            T *o = greedy ? block : out + p0 * kPanel;
            if (decode) {
                decode_group(a, wg, panel_len, K, bg, o, ld, M, gp, np, cols);
            } else if (sizeof(T) == sizeof(float) && row_tiles <= kSweepTiles && gp == kGemmPanels) {
                sweep(a, wg, panel_len, K, bg, o, ld, M, cols);
            } else {
                for (int64_t t = 0; t < row_tiles; t++) {
                    const int rows = M - t * kGemmRows < kGemmRows ? static_cast<int>(M - t * kGemmRows)
                                                                   : static_cast<int>(kGemmRows);
                    with_count<kGemmPanels>(gp, [&]<int NP>() {
                        tile<T, kGemmRows, NP>(a + t * kGemmRows * K, wg, panel_len, K, bg, o + t * kGemmRows * ld,
                                               ld, rows, cols, t == 0);
                    });
                }
            }
            if (greedy) {
                const int64_t width = greedy->vocab - p0 * kPanel < gp * kPanel ? greedy->vocab - p0 * kPanel
                                                                                : gp * kPanel;
                for (int64_t r0 = 0; r0 < M; r0 += 16)
                    greedy_block(block + r0 * ld, ld, M - r0 < 16 ? static_cast<int>(M - r0) : 16, p0 * kPanel, width,
                                 greedy, r0 / 16 * groups + g);
            }
        }
    }
    if (block != small) std::free(block);
}

template <typename T>
void swiglu_groups(const float *a, const T *w, int64_t M, int64_t inter, int64_t K, int64_t *next_group,
                   int64_t nthreads, float *a_out) {
    const int64_t half = inter / kPanel, panel_len = K * kPanel;
    T block[kDecodeRows * 2 * kPanel];
    for (int64_t g0, g1; claim_groups(next_group, half, nthreads, &g0, &g1);) {
        for (int64_t g = g0; g < g1; g++) {
            with_count<kDecodeRows>(M, [&]<int MR>() {
                if constexpr (MR > kRowTile)
                    split_tile<T, MR>(a, w + g * panel_len, half * panel_len, K, nullptr, block, 2 * kPanel, MR,
                                      kPanel);
                else
                    tile<T, MR, 2>(a, w + g * panel_len, half * panel_len, K, nullptr, block, 2 * kPanel, MR, kPanel,
                                   true);
            });
            swiglu_into_packed(block, M, g, inter, a_out);
        }
    }
}
#endif

}  // namespace ksana::packed
