// Paged decode attention: one new token per sequence over its paged K/V, float32 and bfloat16, on vec.h's lanes.
//
// Two passes (scores, then the weighted sum of values) keep the softmax exact without rescaling. As in SDPA's
// bfloat16 kernel, the unnormalised probabilities are rounded to bfloat16 before they weight V (the sum that
// normalises them is not), so bfloat16 models follow transformers' rounding. decode_plan.h says how a step splits
// into tasks (decode_plan.cpp plans them and combines split ones); the fused decode step (decode_layers.cpp) runs these
// tasks from its own thread team; decode_prefetch.h fetches a task's rows ahead. One task template
// serves every instruction set: its lanes and the few choices that differ between 8 and 16 lanes (tile sizes,
// query heads per block, prefetch distances) come from a policy. Measured by bench/kernel_ops.py (paged decode)
// and bench/roofline.py (decode at batch 1); the tuning tools are tools/attention_ab.py and tools/decode_ab.py.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "decode_plan.h"
#include "decode_prefetch.h"
#include "vec.h"

namespace ksana {
namespace {

// The 8-lane task (AVX2, NEON, portable). Tiles of 32 positions (16, 64 and 128 read cold KV slower;
// tools/attention_ab.py); at head size 64 (rows in address order) a task of 512 positions or more takes tiles of
// 64 (fewer prefetch restarts), shorter ones keep 32, where a task's first tile, which nothing prefetches, is a
// larger share (tools/decode_ab.py). At head size 64 each query head goes through a tile alone, each K or V row
// read whole before the next, so a tile's rows come from memory in address order (faster over cold KV than four
// rows 32 bytes at a time; tools/attention_ab.py); at other sizes up to three query heads of a KV head go
// together (3 x 4 accumulators, the query vectors and a loaded vector fill the 16 registers).
struct Lanes8 {
    using V = F32x8;
    static int64_t tile(int64_t n, int64_t, int64_t dim) { return dim == 64 && n >= 512 ? 64 : 32; }
    static int heads_per_block(int64_t dim) { return dim == 64 ? 1 : 3; }
    static bool rows_whole(int64_t dim, bool) { return dim == 64; }
    static int row_vectors(int64_t dim) { return dim == 64 ? 8 : 4; }  // a row's vectors held at once
    static constexpr int64_t leave_after = 0;
    static int64_t ahead(int64_t) { return 1; }
};

// The 16-lane task (AVX-512): up to four query heads per load of each K and V row (the loads per FMA drop from
// above one to about a half, which shows most with the KV in cache; tools/attention_ab.py --hot). A task of
// several KV heads goes in tiles of one block of the engine's 16 slots (head-major, a block's heads lie together);
// a task of one KV head reads rows a block apart, in tiles of 32 (longer tiles slow cold KV, shorter ones make the
// unprefetched first tile a larger share; tools/attention_ab.py, tools/decode_ab.py). A unit that starts where the
// one before it ended, after two such, is left to the hardware prefetcher, which streams memory read in address
// order faster than software prefetches fetch it, and its keys are read row by row; tiles of 16 fetch two units
// ahead (one is too short a lead for blocks placed at random; tools/attention_ab.py --placement).
struct Lanes16 {
    using V = F32x16;
    static int64_t tile(int64_t, int64_t nkv, int64_t) { return nkv > 1 ? 16 : 32; }
    static int heads_per_block(int64_t) { return 4; }
    static bool rows_whole(int64_t, bool streamed) { return streamed; }
    static int row_vectors(int64_t) { return 4; }
    static constexpr int64_t leave_after = 2;
    static int64_t ahead(int64_t nkv) { return nkv > 1 ? 2 : 1; }
};

// The four scores of QB query heads' accumulators a[b][p] (position p): each folded to eight lanes and summed in
// sums4's tree, scaled, stored at s[b * n + p] and folded into the heads' running maxima.
template <typename V, int QB>
inline void store_scores(const V (&a)[QB][4], float scale, float *s, int64_t n, float (*vmax)[4]) {
    #pragma GCC unroll 4
    for (int b = 0; b < QB; b++) {
        F32x4 sc = sums4(fold(a[b][0]), fold(a[b][1]), fold(a[b][2]), fold(a[b][3])) * F32x4::splat(scale);
        sc.store(s + b * n);
        F32x4::max(F32x4::load(vmax[b]), sc).store(vmax[b]);
    }
}

// The scores of `count` positions (a multiple of 4), four at a time, for QB query heads that share a KV head,
// stepping through the four rows together; the prefetch advances every 16 dims (the pace that spreads its
// requests most evenly; tools/attention_ab.py).
template <typename V, typename T, int QB>
inline void qk_block(const float *q, const T *kc, const int64_t *rows, int64_t count, int64_t dim, float scale,
                     float *s, int64_t n, float (*vmax)[4], DecodePrefetch<T> &pf) {
    for (int64_t i = 0; i < count; i += 4) {
        const T *kp[4] = {kc + rows[i], kc + rows[i + 1], kc + rows[i + 2], kc + rows[i + 3]};
        V a[QB][4];
        #pragma GCC unroll 4
        for (int b = 0; b < QB; b++) a[b][0] = a[b][1] = a[b][2] = a[b][3] = V::zero();
        for (int64_t d = 0; d < dim; d += V::lanes) {
            if (d % 16 == 0) pf.next();
            V qv[QB];
            #pragma GCC unroll 4
            for (int b = 0; b < QB; b++) qv[b] = V::load(q + b * dim + d);
            #pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                V x = V::load(kp[p] + d);
                #pragma GCC unroll 4
                for (int b = 0; b < QB; b++) a[b][p] = V::fma(qv[b], x, a[b][p]);
            }
        }
        store_scores<V, QB>(a, scale, s + i, n, vmax);
    }
}

// a[b][p] += query chunk b . the first `chunks` vectors of row k (all CH of them unrolled, as most rows go).
template <typename V, typename T, int QB, int CH>
inline void dot_row(const V (&qv)[QB][CH], const T *k, int chunks, V (&a)[QB][4], int p) {
    if (chunks == CH) {
        #pragma GCC unroll 8
        for (int c = 0; c < CH; c++) {
            V x = V::load(k + c * V::lanes);
            #pragma GCC unroll 4
            for (int b = 0; b < QB; b++) a[b][p] = V::fma(qv[b][c], x, a[b][p]);
        }
        return;
    }
    for (int c = 0; c < chunks; c++) {
        V x = V::load(k + c * V::lanes);
        #pragma GCC unroll 4
        for (int b = 0; b < QB; b++) a[b][p] = V::fma(qv[b][c], x, a[b][p]);
    }
}

// qk_block's sums in the same order, with each row read whole (`CH` vectors at a time) before the next: what the
// hardware prefetcher streams. The same prefetch count as qk_block, spread over the rows. A query of CH vectors is
// loaded once, outside the block loop: loaded inside it under a condition, it leaves the registers (3x slower).
template <typename V, typename T, int QB, int CH>
inline void qk_rows(const float *q, const T *kc, const int64_t *rows, int64_t count, int64_t dim, float scale,
                    float *s, int64_t n, float (*vmax)[4], DecodePrefetch<T> &pf) {
    constexpr int64_t W = V::lanes;
    const int64_t fetches = (dim + 15) / 16, per_row = fetches / 4;
    const auto zeroed = [](V (&a)[QB][4]) {
        #pragma GCC unroll 4
        for (int b = 0; b < QB; b++) a[b][0] = a[b][1] = a[b][2] = a[b][3] = V::zero();
    };
    if (dim == CH * W) {
        V qv[QB][CH];
        for (int b = 0; b < QB; b++)
            for (int c = 0; c < CH; c++) qv[b][c] = V::load(q + b * dim + c * W);
        for (int64_t i = 0; i < count; i += 4) {
            V a[QB][4];
            zeroed(a);
            constexpr int64_t row_fetches = (CH * W + 15) / 16;  // this branch's `fetches`, known here
            #pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                #pragma GCC unroll 4
                for (int64_t f = 0; f < row_fetches / 4; f++) pf.next();
                dot_row<V, T, QB, CH>(qv, kc + rows[i + p], CH, a, p);
            }
            for (int64_t f = row_fetches / 4 * 4; f < row_fetches; f++) pf.next();
            store_scores<V, QB>(a, scale, s + i, n, vmax);
        }
        return;
    }
    for (int64_t i = 0; i < count; i += 4) {
        V a[QB][4];
        zeroed(a);
        for (int64_t d0 = 0; d0 < dim; d0 += CH * W) {
            const int chunks = static_cast<int>((dim - d0 < CH * W ? dim - d0 : CH * W) / W);
            V qv[QB][CH];
            for (int b = 0; b < QB; b++)
                for (int c = 0; c < CH; c++) qv[b][c] = c < chunks ? V::load(q + b * dim + d0 + c * W) : V::zero();
            #pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                if (d0 == 0)
                    for (int64_t f = 0; f < per_row; f++) pf.next();
                dot_row<V, T, QB, CH>(qv, kc + rows[i + p] + d0, chunks, a, p);
            }
        }
        for (int64_t f = 4 * per_row; f < fetches; f++) pf.next();
        store_scores<V, QB>(a, scale, s + i, n, vmax);
    }
}

// acc[b][0 .. NV x lanes) += sum_j s[b][j] v_j over positions [j0, j1), for QB query heads; one prefetch step a
// position.
template <typename V, typename T, int QB, int NV>
inline void pv_block(const float *s, int64_t n, const T *vc, const int64_t *kv_rows, int64_t j0, int64_t j1,
                     float *acc, int64_t dim, DecodePrefetch<T> &pf) {
    constexpr int64_t W = V::lanes;
    V r[QB][NV];
    #pragma GCC unroll 4
    for (int b = 0; b < QB; b++)
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) r[b][c] = V::load(acc + b * dim + c * W);
    for (int64_t j = j0; j < j1; j++) {
        pf.next();
        const T *v = vc + kv_rows[j];
        V w[QB];
        #pragma GCC unroll 4
        for (int b = 0; b < QB; b++) w[b] = V::splat(s[b * n + j]);
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) {
            V x = V::load(v + c * W);
            #pragma GCC unroll 4
            for (int b = 0; b < QB; b++) r[b][c] = V::fma(w[b], x, r[b][c]);
        }
    }
    #pragma GCC unroll 4
    for (int b = 0; b < QB; b++)
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) r[b][c].store(acc + b * dim + c * W);
}

// The blocks for a run-time count of query heads (1-4) and of vectors (1-4, or 8: Lanes8's dim-64 rows).
template <typename V, typename T, int QB>
void pv_heads(int nv, const float *s, int64_t n, const T *vc, const int64_t *kv_rows, int64_t j0, int64_t j1,
              float *acc, int64_t dim, DecodePrefetch<T> &pf) {
    switch (nv) {
    case 1: return pv_block<V, T, QB, 1>(s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    case 2: return pv_block<V, T, QB, 2>(s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    case 3: return pv_block<V, T, QB, 3>(s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    case 4: return pv_block<V, T, QB, 4>(s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    default: return pv_block<V, T, QB, 8>(s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    }
}

template <typename V, typename T>
void pv(int qb, int nv, const float *s, int64_t n, const T *vc, const int64_t *kv_rows, int64_t j0, int64_t j1,
        float *acc, int64_t dim, DecodePrefetch<T> &pf) {
    switch (qb) {
    case 1: return pv_heads<V, T, 1>(nv, s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    case 2: return pv_heads<V, T, 2>(nv, s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    case 3: return pv_heads<V, T, 3>(nv, s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    default: return pv_heads<V, T, 4>(nv, s, n, vc, kv_rows, j0, j1, acc, dim, pf);
    }
}

template <typename V, typename T, int QB>
void qk_heads(bool whole, int ch, const float *q, const T *kc, const int64_t *rows, int64_t count, int64_t dim,
              float scale, float *s, int64_t n, float (*vmax)[4], DecodePrefetch<T> &pf) {
    if (!whole) return qk_block<V, T, QB>(q, kc, rows, count, dim, scale, s, n, vmax, pf);
    if (ch == 8) return qk_rows<V, T, QB, 8>(q, kc, rows, count, dim, scale, s, n, vmax, pf);
    qk_rows<V, T, QB, 4>(q, kc, rows, count, dim, scale, s, n, vmax, pf);
}

// The scores of `count` positions (a multiple of 4) for a run-time count of query heads (1-4), in either order.
template <typename V, typename T>
void qk(int qb, bool whole, int ch, const float *q, const T *kc, const int64_t *rows, int64_t count, int64_t dim,
        float scale, float *s, int64_t n, float (*vmax)[4], DecodePrefetch<T> &pf) {
    switch (qb) {
    case 1: return qk_heads<V, T, 1>(whole, ch, q, kc, rows, count, dim, scale, s, n, vmax, pf);
    case 2: return qk_heads<V, T, 2>(whole, ch, q, kc, rows, count, dim, scale, s, n, vmax, pf);
    case 3: return qk_heads<V, T, 3>(whole, ch, q, kc, rows, count, dim, scale, s, n, vmax, pf);
    default: return qk_heads<V, T, 4>(whole, ch, q, kc, rows, count, dim, scale, s, n, vmax, pf);
    }
}

// A task's scratch: the query in float32, the scores, each position's row offset, the accumulators, and per query
// head the running maximum (and its four-lane part from the blocks) and the softmax's sum.
struct TaskScratch {
    float *qf, *scores, *acc, *maxs, *sums;
    float (*vmax)[4];
    int64_t *kv_rows;
    void *block;

    // Each array on a cache line of its own.
    static int64_t line_up(int64_t bytes) { return (bytes + 63) / 64 * 64; }

    TaskScratch(int64_t heads, int64_t n, int64_t dim) {
        const int64_t m = n > 0 ? n : 1;
        const int64_t sizes[] = {line_up(8 * m), line_up(4 * heads * dim), line_up(4 * heads * dim),
                                 line_up(4 * heads * m), line_up(4 * heads), line_up(4 * heads), line_up(16 * heads)};
        int64_t total = 0;
        for (int64_t size : sizes) total += size;
        block = std::aligned_alloc(64, total);
        char *at = static_cast<char *>(block);
        kv_rows = reinterpret_cast<int64_t *>(at), at += sizes[0];
        qf = reinterpret_cast<float *>(at), at += sizes[1];
        acc = reinterpret_cast<float *>(at), at += sizes[2];
        scores = reinterpret_cast<float *>(at), at += sizes[3];
        maxs = reinterpret_cast<float *>(at), at += sizes[4];
        sums = reinterpret_cast<float *>(at), at += sizes[5];
        vmax = reinterpret_cast<float (*)[4]>(at);
    }
    TaskScratch(const TaskScratch &) = delete;
    ~TaskScratch() { std::free(block); }
};

// The end of a task: each query head's output, acc / sum, or with `part` (a split task's share of the positions)
// the unnormalised parts for the combine: part = [max[group] | sum[group] | acc[group][dim]].
template <typename T>
void decode_finish(const float *acc, const float *maxs, const float *sums, int64_t group, int64_t dim, T *out,
                   float *part) {
    if (part) {
        std::memcpy(part, maxs, sizeof(float) * group);
        std::memcpy(part + group, sums, sizeof(float) * group);
        std::memcpy(part + 2 * group, acc, sizeof(float) * group * dim);
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = sums[g] > 0.f ? 1.0f / sums[g] : 0.f;
        for (int64_t d = 0; d < dim; d++) store1(out + g * dim + d, acc[g * dim + d] * inv);
    }
}

// One task over n positions, head_dim a multiple of the policy's lanes; query head g reads KV head g / head_group.
// Positions go in tiles, and each tile serves every query head while its K (then V) rows are in cache, so a long
// context is read from memory once, not once per head. `kv_rows[i]` is where position i's first KV head of the
// task starts; KV head h lies h * head_stride further.
template <typename P, typename T>
void decode_task_lanes(const float *qf, const T *k_cache, const T *v_cache, const TaskScratch &w, int64_t n,
                       int64_t group, int64_t head_group, int64_t dim, int64_t head_stride, float scale, T *out,
                       float *part) {
    using V = typename P::V;
    constexpr int64_t W = V::lanes;
    const int64_t *kv_rows = w.kv_rows;
    float *scores = w.scores, *acc = w.acc, *maxs = w.maxs, *sums = w.sums;
    float (*vmax)[4] = w.vmax;
    const int64_t nkv = group / head_group, qb_max = P::heads_per_block(dim);
    const int64_t blocks = (head_group + qb_max - 1) / qb_max, fetches = (dim + 15) / 16;
    const int ch = P::row_vectors(dim);
    const int64_t slice = ch * W, slices = (dim + slice - 1) / slice;
    const int64_t tile = P::tile(n, nkv, dim);
    DecodePrefetch<T> pf;
    pf.dim = dim, pf.tile = tile, pf.leave_after = P::leave_after, pf.ahead = P::ahead(nkv);
    for (int64_t g = 0; g < group; g++) {
        maxs[g] = -INFINITY;
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++) vmax[g][p] = -INFINITY;
    }
    for (int64_t t = 0, t0 = 0; t0 < n; t++, t0 += tile) {
        const int64_t t1 = t0 + tile < n ? t0 + tile : n, rows = t1 - t0;
        for (int64_t h = 0; h < nkv; h++) {
            const bool whole = P::rows_whole(dim, pf.streamed & 1);
            pf.plan(k_cache, v_cache, kv_rows, n, nkv, head_stride, t, h, 0, blocks * (rows / 4 * fetches + rows % 4));
            const T *kc = k_cache + h * head_stride;
            for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end;) {
                const int qb = static_cast<int>(g_end - g0 < qb_max ? g_end - g0 : qb_max);
                const float *qg = qf + g0 * dim;
                float *sg = scores + g0 * n;
                const int64_t blocked = (t1 - t0) / 4 * 4;
                qk<V, T>(qb, whole, ch, qg, kc, kv_rows + t0, blocked, dim, scale, sg + t0, n, vmax + g0, pf);
                for (int64_t i = t0 + blocked; i < t1; i++) {
                    pf.next();
                    const T *k = kc + kv_rows[i];
                    for (int b = 0; b < qb; b++) {
                        V a = V::zero();
                        for (int64_t d = 0; d < dim; d += W) a = V::fma(V::load(qg + b * dim + d), V::load(k + d), a);
                        sg[b * n + i] = fold(a).sum() * scale;
                        if (sg[b * n + i] > maxs[g0 + b]) maxs[g0 + b] = sg[b * n + i];
                    }
                }
                g0 += qb;
            }
        }
    }
    // exp and the normaliser (unrounded), then the weights as the dtype rounds them
    for (int64_t g = 0; g < group; g++) {
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++)
            if (vmax[g][p] > maxs[g]) maxs[g] = vmax[g][p];
        float *sg = scores + g * n;
        const V vm = V::splat(maxs[g]);
        V vsum = V::zero();
        float sum = 0.f;
        int64_t i = 0;
        for (; i + W <= n; i += W) {
            V e = exp_nonpositive(V::load(sg + i) - vm);
            vsum = vsum + e;
            round_to<T>(e).store(sg + i);
        }
        for (; i < n; i++) {
            float e = std::exp(sg[i] - maxs[g]);
            sum += e;
            sg[i] = round_to<T>(e);
        }
        sums[g] = sum + vsum.sum();
    }
    std::memset(acc, 0, sizeof(float) * group * dim);
    for (int64_t t = 0, t0 = 0; t0 < n; t++, t0 += tile) {
        const int64_t t1 = t0 + tile < n ? t0 + tile : n;
        for (int64_t h = 0; h < nkv; h++) {
            pf.plan(k_cache, v_cache, kv_rows, n, nkv, head_stride, t, h, 1, blocks * slices * (t1 - t0));
            const T *vc = v_cache + h * head_stride;
            for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end;) {
                const int qb = static_cast<int>(g_end - g0 < qb_max ? g_end - g0 : qb_max);
                for (int64_t d0 = 0; d0 < dim; d0 += slice) {
                    const int nv = static_cast<int>((dim - d0 < slice ? dim - d0 : slice) / W);
                    pv<V, T>(qb, nv, scores + g0 * n, n, vc + d0, kv_rows, t0, t1, acc + g0 * dim + d0, dim, pf);
                }
                g0 += qb;
            }
        }
    }
    decode_finish(acc, maxs, sums, group, dim, out, part);
}

// One task in plain C++, for head sizes the lanes do not divide.
template <typename T>
void decode_task_scalar(const float *qf, const T *k_cache, const T *v_cache, const TaskScratch &w, int64_t n,
                        int64_t group, int64_t head_group, int64_t dim, int64_t head_stride, float scale, T *out,
                        float *part) {
    const int64_t *kv_rows = w.kv_rows;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = qf + g * dim;
        const T *kc = k_cache + (g / head_group) * head_stride;
        const T *vc = v_cache + (g / head_group) * head_stride;
        float *sg = w.scores + g * n, m = -INFINITY, sum = 0.f;
        for (int64_t i = 0; i < n; i++) {
            const T *k = kc + kv_rows[i];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; d++) dot = std::fma(qg[d], load1(k + d), dot);
            sg[i] = dot * scale;
            if (sg[i] > m) m = sg[i];
        }
        for (int64_t i = 0; i < n; i++) {
            float e = std::exp(sg[i] - m);
            sum += e;
            sg[i] = round_to<T>(e);
        }
        w.maxs[g] = m, w.sums[g] = sum;
        for (int64_t d = 0; d < dim; d++) {
            float a = 0.f;
            for (int64_t i = 0; i < n; i++) a = std::fma(sg[i], load1(vc + kv_rows[i] + d), a);
            w.acc[g * dim + d] = a;
        }
    }
    decode_finish(w.acc, w.maxs, w.sums, group, dim, out, part);
}

template <typename T>
void run_task(const decode_plan *plan, int64_t task, const T *q, int64_t q_stride, const T *k_cache,
              const T *v_cache, const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, T *out,
              int64_t nheads, int64_t dim, int64_t block_size, float scale, int64_t window, float *parts) {
    const int64_t splits = plan->splits, heads = plan->heads_per_task, group = plan->group;
    const int64_t whole = task / splits, chunk = task % splits;
    const int64_t b = whole / plan->tasks_per_seq, kv0 = (whole % plan->tasks_per_seq) * plan->kv_per_task;
    const int64_t len = seq_lens[b];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t first = start + (len - start) * chunk / splits;
    const int64_t n = start + (len - start) * (chunk + 1) / splits - first;
    const int64_t *table = block_tables + b * table_stride;
    TaskScratch w(heads, n, dim);
    const int64_t head0 = kv0 * plan->head_stride;  // the task's first KV head within a slot
    for (int64_t i = 0, blk = first / block_size, off = first % block_size; i < n; i++) {
        w.kv_rows[i] = table[blk] * block_size * plan->row + off * plan->slot_stride + head0;
        if (++off == block_size) off = 0, blk++;
    }
    const T *qh = q + b * q_stride + kv0 * group * dim;
    for (int64_t j = 0; j < heads * dim; j++) w.qf[j] = load1(qh + j);
    T *o = out + (b * nheads + kv0 * group) * dim;
    float *part = parts ? parts + task * plan->part_len : nullptr;
    if constexpr (Wide::lanes == 16) {
        if (dim % 16 == 0)
            return decode_task_lanes<Lanes16>(w.qf, k_cache, v_cache, w, n, heads, group, dim, plan->head_stride,
                                              scale, o, part);
    }
    if (dim % 8 == 0)
        decode_task_lanes<Lanes8>(w.qf, k_cache, v_cache, w, n, heads, group, dim, plan->head_stride, scale, o, part);
    else
        decode_task_scalar(w.qf, k_cache, v_cache, w, n, heads, group, dim, plan->head_stride, scale, o, part);
}

// The C entry that combines a whole task's split parts (decode_plan.cpp), for either dtype.
inline void combine(const decode_plan *plan, int64_t whole, const float *parts, float *out, int64_t nheads,
                    int64_t dim) {
    decode_combine_f32(plan, whole, parts, out, nheads, dim);
}
inline void combine(const decode_plan *plan, int64_t whole, const float *parts, bf16 *out, int64_t nheads,
                    int64_t dim) {
    decode_combine_bf16(plan, whole, parts, out, nheads, dim);
}

template <typename T>
void paged_decode(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *block_tables,
                  int64_t table_stride, const int64_t *seq_lens, T *out, int64_t batch, int64_t nheads, int64_t nkv,
                  int64_t dim, int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale,
                  int64_t window, int nthreads) {
    decode_plan plan = plan_decode(seq_lens, batch, nheads, nkv, dim, window, slot_stride, head_stride, nthreads);
    const int64_t tasks = plan.whole_tasks * plan.splits;
    float *parts = plan.splits > 1 ? static_cast<float *>(std::malloc(sizeof(float) * tasks * plan.part_len)) : nullptr;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (plan.parallel)
    for (int64_t task = 0; task < tasks; task++)
        run_task(&plan, task, q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, nheads, dim,
                 block_size, scale, window, parts);
    if (parts) {
        for (int64_t whole = 0; whole < plan.whole_tasks; whole++) combine(&plan, whole, parts, out, nheads, dim);
        std::free(parts);
    }
}

}  // namespace
}  // namespace ksana

using ksana::bf16;

extern "C" {
void decode_run_task_f32(const decode_plan *plan, int64_t task, const float *q, int64_t q_stride,
                         const float *k_cache, const float *v_cache, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *seq_lens, float *out, int64_t nheads, int64_t dim,
                         int64_t block_size, float scale, int64_t window, float *parts) {
    ksana::run_task(plan, task, q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, nheads, dim,
                    block_size, scale, window, parts);
}
void decode_run_task_bf16(const decode_plan *plan, int64_t task, const bf16 *q, int64_t q_stride,
                          const bf16 *k_cache, const bf16 *v_cache, const int64_t *block_tables,
                          int64_t table_stride, const int64_t *seq_lens, bf16 *out, int64_t nheads, int64_t dim,
                          int64_t block_size, float scale, int64_t window, float *parts) {
    ksana::run_task(plan, task, q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, nheads, dim,
                    block_size, scale, window, parts);
}
void paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                      int64_t batch, int64_t nheads, int64_t nkv, int64_t dim, int64_t block_size, int64_t slot_stride,
                      int64_t head_stride, float scale, int64_t window, int nthreads) {
    ksana::paged_decode(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, batch, nheads, nkv,
                        dim, block_size, slot_stride, head_stride, scale, window, nthreads);
}
void paged_decode_bf16(const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache,
                       const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, bf16 *out,
                       int64_t batch, int64_t nheads, int64_t nkv, int64_t dim, int64_t block_size, int64_t slot_stride,
                       int64_t head_stride, float scale, int64_t window, int nthreads) {
    ksana::paged_decode(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, batch, nheads, nkv,
                        dim, block_size, slot_stride, head_stride, scale, window, nthreads);
}
}
