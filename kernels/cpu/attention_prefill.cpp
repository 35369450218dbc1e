// Causal attention of one sequence's new tokens over its paged cache (their K/V already stored), float32, for
// prefill, on vec.h's lanes.
//
// PyTorch's CPU SDPA runs its small per-chunk GEMMs through MKL at about a fifth of the FMA peak; here a task is one
// KV head and PREFILL_QBLOCK consecutive query positions, whose rows (every query head of the KV head at each
// position) meet the keys as a small matrix product: scores = rows x keys over head_dim with the keys packed
// transposed in tiles of 16, an exact softmax per row (max, then exp and the sum, as the decode task), then rows x
// head_dim += weights x values. Query position p sees key positions (p - window, p] (window 0: all up to p). Every
// score and every output element is the same FMAs in the same order at any lane width; the softmax's sum is taken
// in the lanes' order. Measured by bench/kernel_ops.py (prefill attention) and bench/throughput.py.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vec.h"

// Query positions a task and keys a packed tile (bench/kernel_ops.py's prefill attention against SDPA).
#define PREFILL_QBLOCK 16
#define PREFILL_KTILE 16

namespace ksana {
namespace {

// s[r][0 .. NT x 16) = scale * (q_r . each key of NT tiles) for MR rows (q rows `dim` apart), each tile packed
// [dim][16] and `tile_stride` floats after the one before.
template <typename V, int MR, int NT>
void qk(const float *q, const float *kt, int64_t dim, int64_t tile_stride, float scale, float *s, int64_t s_stride) {
    constexpr int KV = PREFILL_KTILE / V::lanes;  // vectors a tile row
    V a[MR][NT * KV];
    #pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
        #pragma GCC unroll 4
        for (int c = 0; c < NT * KV; c++) a[r][c] = V::zero();
    for (int64_t d = 0; d < dim; d++) {
        V k[NT * KV];
        #pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            #pragma GCC unroll 2
            for (int c = 0; c < KV; c++) k[t * KV + c] = V::load(kt + t * tile_stride + d * PREFILL_KTILE + c * V::lanes);
        #pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            V qb = V::splat(q[r * dim + d]);
            #pragma GCC unroll 4
            for (int c = 0; c < NT * KV; c++) a[r][c] = V::fma(qb, k[c], a[r][c]);
        }
    }
    const V sc = V::splat(scale);
    #pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
        #pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            #pragma GCC unroll 2
            for (int c = 0; c < KV; c++)
                (a[r][t * KV + c] * sc).store(s + r * s_stride + t * PREFILL_KTILE + c * V::lanes);
}

// acc[b][0 .. NV x lanes) = sum_j p[b][j] v_j[0 .. NV x lanes) for three rows over keys [j0, j1).
template <typename V, int NV>
void pv3(const float *p, int64_t p_stride, const float *v_cache, const int64_t *rows, int64_t j0, int64_t j1,
         float *acc, int64_t dim) {
    V r[3][NV];
    #pragma GCC unroll 3
    for (int b = 0; b < 3; b++)
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) r[b][c] = V::zero();
    for (int64_t j = j0; j < j1; j++) {
        const float *v = v_cache + rows[j];
        V w[3];
        #pragma GCC unroll 3
        for (int b = 0; b < 3; b++) w[b] = V::splat(p[b * p_stride + j]);
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) {
            V x = V::load(v + c * V::lanes);
            #pragma GCC unroll 3
            for (int b = 0; b < 3; b++) r[b][c] = V::fma(w[b], x, r[b][c]);
        }
    }
    #pragma GCC unroll 3
    for (int b = 0; b < 3; b++)
        #pragma GCC unroll 8
        for (int c = 0; c < NV; c++) r[b][c].store(acc + b * dim + c * V::lanes);
}

// One row's softmax weights over its columns [j0, j1) of `sr`: e^(s - max) in place, their sum returned; the last
// (j1 - j0) % lanes columns through partial loads and stores.
template <typename V>
float softmax(float *sr, int64_t j0, int64_t j1) {
    const int64_t full = j0 + (j1 - j0) / V::lanes * V::lanes;
    const int tail = static_cast<int>(j1 - full);
    V vm = V::splat(-INFINITY), vsum = V::zero();
    for (int64_t j = j0; j < full; j += V::lanes) vm = V::max(vm, V::load(sr + j));
    const V last = V::load_first(sr + full, tail, -INFINITY);
    const V m = V::splat(max_lane(V::max(vm, last)));
    for (int64_t j = j0; j < full; j += V::lanes) {
        V e = exp_nonpositive(V::load(sr + j) - m);
        vsum = vsum + e;
        e.store(sr + j);
    }
    exp_nonpositive(last - m).store_first(sr + full, tail);
    return (vsum + V::load_first(sr + full, tail, 0.0f)).sum();
}

// One task: KV head h, query positions [p0, p1) (absolute). Rows are position-major, the group's query heads
// within a position: row i * group + g. Score columns start at the task's first key tile, tile `t0` of `kt`.
// The score products take up to `max_tiles` tiles a call (two at 16 lanes: 12 accumulators for 6 rows).
template <typename V, int max_tiles>
void prefill_task(const float *q, int64_t q_stride, const float *kt, const float *v_cache, const int64_t *kv_rows,
                  int64_t context_len, int64_t first_key, int64_t p0, int64_t p1, int64_t h, int64_t group,
                  int64_t dim, int64_t head_stride, float scale, int64_t window, float *out, int64_t out_stride) {
    const int64_t npos = p1 - p0, nrows = npos * group;
    const int64_t lo = window > 0 && p0 - window + 1 > first_key ? p0 - window + 1 : first_key;  // first key seen
    const int64_t t0 = (lo - first_key) / PREFILL_KTILE, t1 = (p1 - first_key + PREFILL_KTILE - 1) / PREFILL_KTILE;
    const int64_t width = (t1 - t0) * PREFILL_KTILE, col0 = first_key + t0 * PREFILL_KTILE;  // column 0's position
    const int64_t tile_stride = PREFILL_KTILE * dim;
    const int64_t *rows = kv_rows + t0 * PREFILL_KTILE;
    const float *vc = v_cache + h * head_stride;
    // +6 rows: room for the 6-row products' last rows
    float *qp = static_cast<float *>(std::malloc(sizeof(float) * ((nrows + 6) * dim + (nrows + 6) * width +
                                                                  group * dim + group)));
    float *s = qp + (nrows + 6) * dim, *acc = s + (nrows + 6) * width, *sums = acc + group * dim;
    int64_t *key_lo = static_cast<int64_t *>(std::malloc(sizeof(int64_t) * npos));  // first visible column
    for (int64_t i = 0; i < npos; i++) {
        for (int64_t g = 0; g < group; g++)
            std::memcpy(qp + (i * group + g) * dim, q + (p0 + i - context_len) * q_stride + (h * group + g) * dim,
                        sizeof(float) * dim);
        const int64_t first = window > 0 && p0 + i - window + 1 > lo ? p0 + i - window + 1 : lo;
        key_lo[i] = first - col0;
    }
    std::memset(qp + nrows * dim, 0, sizeof(float) * 6 * dim);
    // scores, six rows at a time (three when fewer are left), over the tiles the rows see
    for (int64_t r0 = 0; r0 < nrows;) {
        const int mr = nrows - r0 >= 6 ? 6 : 3;
        const int64_t last_pos = (r0 + mr - 1) / group < npos ? (r0 + mr - 1) / group : npos - 1;
        const int64_t first_tile = key_lo[r0 / group] / PREFILL_KTILE;
        const int64_t end_tile = (p0 + last_pos - col0) / PREFILL_KTILE + 1;
        for (int64_t t = first_tile; t < end_tile;) {
            const float *tile = kt + (t0 + t) * tile_stride;
            float *st = s + r0 * width + t * PREFILL_KTILE;
            const int nt = max_tiles > 1 && end_tile - t >= 2 ? 2 : 1;
            if (mr == 6)
                (nt == 2 ? qk<V, 6, max_tiles> : qk<V, 6, 1>)(qp + r0 * dim, tile, dim, tile_stride, scale, st, width);
            else
                (nt == 2 ? qk<V, 3, max_tiles> : qk<V, 3, 1>)(qp + r0 * dim, tile, dim, tile_stride, scale, st, width);
            t += nt;
        }
        r0 += mr;
    }
    // per position: each row's softmax weights over its columns [j0, j1), then its heads' sums of values
    for (int64_t i = 0; i < npos; i++) {
        const int64_t j0 = key_lo[i], j1 = p0 + i - col0 + 1;
        for (int64_t g = 0; g < group; g++) sums[g] = softmax<V>(s + (i * group + g) * width, j0, j1);
        for (int64_t g0 = 0; g0 < group; g0 += 3) {  // three heads at a time, the rest (group % 3) one by one
            const float *p = s + (i * group + g0) * width;
            float *a = acc + g0 * dim;
            if (group - g0 >= 3) {
                int64_t d0 = 0;
                for (; d0 + 4 * V::lanes <= dim; d0 += 4 * V::lanes)
                    pv3<V, 4>(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                for (; d0 + V::lanes <= dim; d0 += V::lanes) pv3<V, 1>(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                for (; d0 + 32 <= dim; d0 += 32) pv3<F32x8, 4>(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                for (; d0 < dim; d0 += 8) pv3<F32x8, 1>(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                continue;
            }
            for (int64_t b = 0; b < group - g0; b++)
                for (int64_t d = 0; d < dim; d++) {
                    float x = 0.f;
                    for (int64_t j = j0; j < j1; j++) x = std::fma(p[b * width + j], vc[rows[j] + d], x);
                    a[b * dim + d] = x;
                }
        }
        for (int64_t g = 0; g < group; g++) {
            const float inv = 1.0f / sums[g];
            float *o = out + (p0 + i - context_len) * out_stride + (h * group + g) * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = acc[g * dim + d] * inv;
        }
    }
    std::free(qp);
    std::free(key_lo);
}

// head_dim a multiple of 8.
void prefill_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                       const int64_t *table, int64_t q_len, int64_t seq_len, int64_t nheads, int64_t nkv, int64_t dim,
                       int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale, int64_t window,
                       float *out, int nthreads) {
    const int64_t context_len = seq_len - q_len, group = nheads / nkv;
    const int64_t first_key = window > 0 && context_len - window + 1 > 0 ? context_len - window + 1 : 0;
    const int64_t nk = seq_len - first_key, tiles = (nk + PREFILL_KTILE - 1) / PREFILL_KTILE;
    int64_t *kv_rows = static_cast<int64_t *>(std::malloc(sizeof(int64_t) * tiles * PREFILL_KTILE));
    for (int64_t p = first_key; p < seq_len; p++)
        kv_rows[p - first_key] = table[p / block_size] * block_size * nkv * dim + p % block_size * slot_stride;
    // every KV head's keys transposed once, tile by tile ([dim][16] each; the last tile's missing keys zero)
    float *kt = static_cast<float *>(std::malloc(sizeof(float) * nkv * tiles * PREFILL_KTILE * dim));
    const int64_t blocks = (q_len + PREFILL_QBLOCK - 1) / PREFILL_QBLOCK, tasks = blocks * nkv;
#pragma omp parallel num_threads(nthreads) if (tasks > 1)
    {
#pragma omp for schedule(static)
        for (int64_t ht = 0; ht < nkv * tiles; ht++) {
            const float *kc = k_cache + ht / tiles * head_stride;
            float *tile = kt + ht * PREFILL_KTILE * dim;
            for (int64_t j = 0; j < PREFILL_KTILE; j++) {
                const int64_t key = ht % tiles * PREFILL_KTILE + j;
                for (int64_t d = 0; d < dim; d++) tile[d * PREFILL_KTILE + j] = key < nk ? kc[kv_rows[key] + d] : 0.f;
            }
        }
        // the last positions (the most keys) first, so that the short tasks even out the threads at the end
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t block = blocks - 1 - task / nkv, p0 = context_len + block * PREFILL_QBLOCK, h = task % nkv;
            const int64_t p1 = p0 + PREFILL_QBLOCK < seq_len ? p0 + PREFILL_QBLOCK : seq_len;
            prefill_task<Wide, Wide::lanes == 16 ? 2 : 1>(q, q_stride, kt + h * tiles * PREFILL_KTILE * dim, v_cache,
                                                          kv_rows, context_len, first_key, p0, p1, h, group, dim,
                                                          head_stride, scale, window, out, nheads * dim);
        }
    }
    std::free(kt);
    std::free(kv_rows);
}

}  // namespace
}  // namespace ksana

// Vectorised where the lanes are (AVX2, NEON); elsewhere torch's SDPA serves prefill, and this is never called.
#if KSANA_VEC_AVX2 || KSANA_VEC_NEON
#define PREFILL_VECTORISED 1
#else
#define PREFILL_VECTORISED 0
#endif

extern "C" {
int prefill_attention_available(void) { return PREFILL_VECTORISED; }

void prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                           const int64_t *table, int64_t q_len, int64_t seq_len, int64_t nheads, int64_t nkv,
                           int64_t dim, int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale,
                           int64_t window, float *out, int nthreads) {
    ksana::prefill_attention(q, q_stride, k_cache, v_cache, table, q_len, seq_len, nheads, nkv, dim, block_size,
                             slot_stride, head_stride, scale, window, out, nthreads);
}
}
