/* Native CPU kernels for the decoder (see kernels/cpu/__init__.py for why they exist).
 *
 * C with OpenMP, no Python or torch headers, so it builds in seconds with the system compiler; registration.cpp
 * declares every exported function as a torch operator (torch.ops.ksana.*) and both link into one library.
 * Decode attention and SiLU use AVX2/FMA intrinsics when the build targets them (see kernels/cpu/build.py); every
 * op also has a portable C path. Every op exists for float32 (suffix _f32) and bfloat16 (suffix _bf16, stored as
 * uint16). Arithmetic is float32; bfloat16 results are rounded (nearest even)
 * at the points where torch's eager reference rounds, so both paths agree to the last bit in the elementwise ops
 * other than SiLU (whose exp differs by an ulp) and to float32 rounding error in the reductions. AVX2 and AVX-512
 * builds add the packed-weight linear and a whole decode step's layers (`decode_layers`, both at the end of this
 * file); AVX-512 builds also a 16-lane decode attention task and greedy sampler.
 *
 * Threading: OpenMP regions use the libgomp that torch already loaded (same soname), so torch and these kernels
 * share one thread pool; the operators pass the calling thread's torch thread count. `decode_layers` runs a whole
 * step as one region whose threads meet at a barrier of their own (team_wait) between ops.
 */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KSANA_AVX2 1
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const bf16_t *p) { return bf16_to_f32(*p); }
static inline void store_f32(float *p, float x) { *p = x; }
static inline void store_bf16(bf16_t *p, float x) { *p = f32_to_bf16(x); }
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#include "parallel.h"
#define PARALLEL_MIN_ATTENTION_WORK (1 << 20) /* context positions x query heads x head_dim */
/* Lower where few sequences' tasks split (paged_decode): there both threads halve a long context's attention,
 * worth waking the pool for at batch 1; the same threshold for every batch slows serving's many small steps. */
#define PARALLEL_MIN_SPLIT_WORK (1 << 18)
#define DECODE_SPLIT_TASKS 8 /* tasks per thread that paged_decode splits few long sequences into */
#define DECODE_SPLIT_MIN 128 /* positions per split task at least */

/* The end of a decode task: each query head's output, acc / sum, or with `part` (a split task's share of the
 * positions, see paged_decode) the unnormalised parts for the combine: part = [max[group] | sum[group] |
 * acc[group][dim]]. */
#define DEFINE_DECODE_FINISH(SUF, T)                                                                             \
    static inline void decode_finish_##SUF(const float *acc, const float *maxs, const float *sums, int64_t group, \
                                           int64_t dim, T *out, float *part) {                                   \
        if (part) {                                                                                              \
            memcpy(part, maxs, sizeof(float) * group);                                                           \
            memcpy(part + group, sums, sizeof(float) * group);                                                   \
            memcpy(part + 2 * group, acc, sizeof(float) * group * dim);                                          \
            return;                                                                                              \
        }                                                                                                        \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            float inv = sums[g] > 0.f ? 1.0f / sums[g] : 0.f;                                                    \
            for (int64_t d = 0; d < dim; d++) store_##SUF(out + g * dim + d, acc[g * dim + d] * inv);            \
        }                                                                                                        \
    }
DEFINE_DECODE_FINISH(f32, float)
DEFINE_DECODE_FINISH(bf16, bf16_t)

#ifdef KSANA_AVX2
/* Sum each of eight vectors: [sum(a0), ..., sum(a7)]. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)], each summed as sum8x8 sums (the same tree, so the same bits). */
static inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

static inline float sum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* e^x for x <= 0 (softmax arguments): 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (about one
 * ulp); arguments below -87 give (nearly) zero. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT |
                               _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const bf16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void store8_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
static inline void store8_bf16(bf16_t *p, __m256 x) { /* as f32_to_bf16, 8 lanes */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
static inline __m256 round8_f32(__m256 x) { return x; }
static inline __m256 round8_bf16(__m256 x) { /* round to nearest even at 16 bits (finite inputs) */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The AVX-512 task's tiles. A task of several KV heads goes in tiles of one block of the engine's 16 slots: with the
 * cache head-major a block's heads lie together, so the task reads them in turn, and blocks that follow one another
 * in memory in address order. A task of one KV head (batches under twice the threads) reads one head's rows, which
 * lie a block apart, and goes in tiles of 32: longer tiles slow the attention over cold KV (tools/attention_ab.py),
 * shorter ones make a task's first tile, which nothing prefetches, a larger share of it (tools/decode_ab.py). */
#define DECODE_TILE 16
#define DECODE_TILE_ONE_HEAD 32
/* A unit (tile, KV head) that starts where the one before it ended, when the units before that did too, is left to
 * the hardware prefetcher (decode_prefetch's leave_after), which streams memory read in address order faster than
 * software prefetches fetch it. Such a unit's keys are read row by row (qk_rows). A fresh engine places a
 * sequence's blocks in order, so most units stream; blocks placed at random keep the software prefetch
 * (tools/attention_ab.py --placement in-order, or random). */
#define DECODE_STREAM_AFTER 2
/* Tiles of 16 fetch two units ahead (one unit: 4 KiB at smollm2's head size): a unit ahead is too short a lead for
 * blocks placed at random (tools/attention_ab.py). */
#define DECODE_PREFETCH_AHEAD 2
/* The AVX2 task's tile, with decode_prefetch: 32 positions (16, 64 and 128 read cold KV slower;
 * tools/attention_ab.py). With the dim-64 blocks (rows in address order), a task of DECODE_TILE_AVX2_LONG_MIN
 * positions or more goes in tiles of 64 (fewer prefetch restarts); shorter tasks keep 32, where a task's first
 * tile, which nothing prefetches, is a larger share (tools/decode_ab.py). */
#define DECODE_TILE_AVX2 32
#define DECODE_TILE_AVX2_LONG 64
#define DECODE_TILE_AVX2_LONG_MIN 512
static inline int64_t decode_tile_avx2(int64_t n) {
    return n >= DECODE_TILE_AVX2_LONG_MIN ? DECODE_TILE_AVX2_LONG : DECODE_TILE_AVX2;
}
/* A decode task's software prefetch. The task reads its rows in units of (tile, KV head), keys then values, and
 * while it computes on one unit it fetches the next into L2, a share of a row per loop iteration so that the
 * requests go out evenly over the unit's work (every pass over it, not only the first's). The hardware prefetcher
 * alone leaves the arithmetic waiting on its rows, and a prefetch a fixed distance ahead from the first query head
 * only sends the requests in bursts (tools/attention_ab.py). `step`: rows per iteration, 16.16 fixed point. */
#define DEFINE_DECODE_PREFETCH(SUF, T)                                                                           \
    typedef struct {                                                                                             \
        const T *base;                                                                                           \
        const int64_t *rows;                                                                                     \
        int64_t step, at, dim, tile; /* tile: the task's (decode_tile_avx2; in AVX-512 DECODE_TILE's) */         \
        int64_t leave_after; /* > 0: after this many units in a row that follow the one before in memory */      \
                             /* the next such are left to the hardware */                                        \
        int64_t run;         /* how many units in a row have followed the one before in memory */                \
        int64_t ahead;       /* the target: this many units after the one computed on (0: the next) */           \
        int streamed;        /* bit i: unit i + 1 from the one computed on is left to the hardware */            \
    } decode_prefetch_##SUF;                                                                                     \
    static inline void decode_prefetch_next_##SUF(decode_prefetch_##SUF *pf) {                                   \
        for (int64_t r = (pf->at * pf->step) >> 16, r1 = ((pf->at + 1) * pf->step) >> 16; r < r1; r++)           \
            for (int64_t d = 0; d < pf->dim; d += 64 / (int64_t)sizeof(T))                                       \
                _mm_prefetch((const char *)(pf->base + pf->rows[r] + d), _MM_HINT_T1);                           \
        pf->at++;                                                                                                \
    }                                                                                                            \
    /* The unit `ahead` after tile t's KV head h of pass v (0 keys, 1 values; none after the last), over         \
     * `iters`; none either where the hardware streams it (leave_after). */                                      \
    static inline void decode_prefetch_plan_##SUF(decode_prefetch_##SUF *pf, const T *k_cache, const T *v_cache, \
                                                  const int64_t *kv_rows, int64_t n, int64_t nkv,                \
                                                  int64_t head_stride, int64_t t, int64_t h, int v,              \
                                                  int64_t iters) {                                               \
        int64_t tile = pf->tile, tiles = (n + tile - 1) / tile, rows = 0;                                        \
        const T *end = NULL; /* where the unit before the target ends */                                         \
        for (int64_t u = 0; u < (pf->ahead > 1 ? pf->ahead : 1) && v < 2; u++) {                                 \
            int64_t last = (t + 1) * tile < n ? (t + 1) * tile - 1 : n - 1;                                      \
            end = (v ? v_cache : k_cache) + h * head_stride + kv_rows[last] + pf->dim;                           \
            if (++h == nkv) h = 0, t++;                                                                          \
            if (t == tiles) t = 0, v++;                                                                          \
        }                                                                                                        \
        int64_t t0 = t * tile;                                                                                   \
        if (v < 2) rows = n - t0 < tile ? n - t0 : tile;                                                         \
        pf->base = (v ? v_cache : k_cache) + h * head_stride;                                                    \
        pf->rows = kv_rows + t0;                                                                                 \
        int streamed = 0;                                                                                        \
        if (pf->leave_after && rows) {                                                                           \
            pf->run = pf->base + pf->rows[0] == end ? pf->run + 1 : 0;                                           \
            streamed = pf->run > pf->leave_after;                                                                \
            rows = streamed ? 0 : rows;                                                                          \
        }                                                                                                        \
        pf->streamed = (pf->streamed >> 1) | streamed << ((pf->ahead > 1 ? pf->ahead : 1) - 1);                  \
        pf->step = iters ? (rows << 16) / iters : 0;                                                             \
        pf->at = 0;                                                                                              \
    }
/* The decode task's two inner blocks for QB query heads that share one KV head (GQA), QB = 1..3, so that each K
 * and V vector is loaded once for all of them: 3 x 4 accumulators, the QB query (or weight) vectors and the one
 * loaded vector fill the 16 registers. qk: the scores of positions rows[0..3], each summed across lanes as sum8x8
 * sums (the same bits as one head at a time); pv: 32 dims of positions [j0, j1) into the QB accumulators. The
 * task's prefetch (decode_prefetch) advances every 16 dims in qk and every position in pv, the pace that spreads
 * its requests most evenly over cold KV (every 32 dims falls behind; tools/attention_ab.py). */
#define DEFINE_GQA_AVX2(SUF, T, QB)                                                                              \
    static inline void qk4_avx2_##SUF##_##QB(const float *q, const T *kc, const int64_t *rows, int64_t dim,      \
                                             float scale, float *s, int64_t n, __m128 *vmax,                     \
                                             decode_prefetch_##SUF *pf) {                                        \
        const T *kp[4] = {kc + rows[0], kc + rows[1], kc + rows[2], kc + rows[3]};                               \
        __m256 a[QB][4];                                                                                         \
        _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++)                                                     \
            a[b][0] = a[b][1] = a[b][2] = a[b][3] = _mm256_setzero_ps();                                         \
        for (int64_t d = 0; d < dim; d += 8) {                                                                   \
            if (d % 16 == 0) decode_prefetch_next_##SUF(pf);                                                     \
            __m256 qv[QB];                                                                                       \
            _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++) qv[b] = _mm256_loadu_ps(q + b * dim + d);       \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                                \
                __m256 x = load8_##SUF(kp[p] + d);                                                               \
                _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++)                                             \
                    a[b][p] = _mm256_fmadd_ps(qv[b], x, a[b][p]);                                                \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++) {                                                   \
            __m128 sc = _mm_mul_ps(sum4x8(a[b][0], a[b][1], a[b][2], a[b][3]), _mm_set1_ps(scale));              \
            _mm_storeu_ps(s + b * n, sc);                                                                        \
            vmax[b] = _mm_max_ps(vmax[b], sc);                                                                   \
        }                                                                                                        \
    }                                                                                                            \
    static inline void pv32_avx2_##SUF##_##QB(const float *s, int64_t n, const T *vc, const int64_t *rows,       \
                                              int64_t j0, int64_t j1, float *acc, int64_t dim,                   \
                                              decode_prefetch_##SUF *pf) {                                       \
        __m256 r[QB][4];                                                                                         \
        _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++)                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) r[b][c] = _mm256_loadu_ps(acc + b * dim + 8 * c); \
        for (int64_t j = j0; j < j1; j++) {                                                                      \
            decode_prefetch_next_##SUF(pf);                                                                      \
            const T *v = vc + rows[j];                                                                           \
            __m256 w[QB];                                                                                        \
            _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++) w[b] = _mm256_set1_ps(s[b * n + j]);            \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                                \
                __m256 x = load8_##SUF(v + 8 * c);                                                               \
                _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++) r[b][c] = _mm256_fmadd_ps(w[b], x, r[b][c]); \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 3") for (int b = 0; b < QB; b++)                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + b * dim + 8 * c, r[b][c]); \
    }
/* The dim-64 blocks: one query head over a tile's rows, each K (qk) or V (pv) row read whole before the next,
 * so a block's rows come from memory in address order; the GQA blocks above step through four rows at once, 32
 * bytes of each, an order the memory system serves slower. The task's later query heads of the KV head read the
 * tile again from L1. The same sums in the same order as the GQA blocks (the same bits), in less time over cold KV
 * (tools/attention_ab.py). */
#define DEFINE_ROWS64_AVX2(SUF, T)                                                                               \
    static inline void qk_rows64_##SUF(const float *q, const T *kc, const int64_t *rows, int64_t m, float scale, \
                                       float *s, __m128 *vmax, float *smax, decode_prefetch_##SUF *pf) {         \
        __m256 qv[8];                                                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);                  \
        int64_t i = 0;                                                                                           \
        for (; i + 4 <= m; i += 4) {                                                                             \
            __m256 a[4];                                                                                         \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                                \
                decode_prefetch_next_##SUF(pf);                                                                  \
                const T *k = kc + rows[i + p];                                                                   \
                a[p] = _mm256_setzero_ps();                                                                      \
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                              \
                    a[p] = _mm256_fmadd_ps(qv[c], load8_##SUF(k + 8 * c), a[p]);                                 \
            }                                                                                                    \
            __m128 sc = _mm_mul_ps(sum4x8(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale));                          \
            _mm_storeu_ps(s + i, sc);                                                                            \
            *vmax = _mm_max_ps(*vmax, sc);                                                                       \
        }                                                                                                        \
        for (; i < m; i++) {                                                                                     \
            decode_prefetch_next_##SUF(pf);                                                                      \
            const T *k = kc + rows[i];                                                                           \
            __m256 a = _mm256_setzero_ps();                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                                  \
                a = _mm256_fmadd_ps(qv[c], load8_##SUF(k + 8 * c), a);                                           \
            s[i] = sum8(a) * scale;                                                                              \
            if (s[i] > *smax) *smax = s[i];                                                                      \
        }                                                                                                        \
    }                                                                                                            \
    static inline void pv_rows64_##SUF(const float *s, const T *vc, const int64_t *rows, int64_t j0, int64_t j1, \
                                       float *acc, decode_prefetch_##SUF *pf) {                                  \
        __m256 r[8];                                                                                             \
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(acc + 8 * c);                 \
        for (int64_t j = j0; j < j1; j++) {                                                                      \
            decode_prefetch_next_##SUF(pf);                                                                      \
            const T *v = vc + rows[j];                                                                           \
            __m256 w = _mm256_set1_ps(s[j]);                                                                     \
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                                  \
                r[c] = _mm256_fmadd_ps(w, load8_##SUF(v + 8 * c), r[c]);                                         \
        }                                                                                                        \
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + 8 * c, r[c]);                 \
    }
/* One decode task (a sequence's KV heads, or one of them), head_dim a multiple of 8; query head g reads KV head
 * g / head_group. Positions go in tiles (decode_tile_avx2), and each tile serves every query head while its K
 * (then V) rows are in cache, so a long context is read from memory once, not once per head; at head size 64
 * each query head goes through the tile alone (the dim-64 blocks: rows in address order), at other sizes the
 * query heads of a KV head go through the GQA blocks together, up to three at a time (a 128-wide query does not
 * fit the registers the dim-64 blocks keep it in). The exp is vectorised; P @ V accumulates
 * in registers within a tile and in `acc` across tiles. `kv_rows[i]` is where position i's first KV head of the
 * task starts; KV head h lies h * head_stride further (dim slot-major, block_size * dim head-major: see
 * store_kv). The rows are prefetched as decode_prefetch says. */
#define DEFINE_DECODE_AVX2(SUF, T)                                                                               \
    DEFINE_DECODE_PREFETCH(SUF, T)                                                                               \
    DEFINE_GQA_AVX2(SUF, T, 1)                                                                                   \
    DEFINE_GQA_AVX2(SUF, T, 2)                                                                                   \
    DEFINE_GQA_AVX2(SUF, T, 3)                                                                                   \
    DEFINE_ROWS64_AVX2(SUF, T)                                                                                   \
    static void decode_task_avx2_##SUF(const float *qf, const T *k_cache, const T *v_cache,                      \
                                       const int64_t *kv_rows,                                                   \
                                       int64_t n, int64_t group, int64_t head_group, int64_t dim,                \
                                       int64_t head_stride, float scale, float *scores, float *acc, T *out,      \
                                       float *part) {                                                            \
        float maxs[group], sums[group];                                                                          \
        __m128 vmax[group];                                                                                      \
        int64_t nkv = group / head_group, blocks = (head_group + 2) / 3; /* GQA blocks per KV head */            \
        int64_t tile = dim == 64 ? decode_tile_avx2(n) : DECODE_TILE_AVX2;                                       \
        decode_prefetch_##SUF pf = {.dim = dim, .tile = tile};                                                   \
        for (int64_t g = 0; g < group; g++) maxs[g] = -INFINITY, vmax[g] = _mm_set1_ps(-INFINITY);               \
        for (int64_t t0 = 0; t0 < n; t0 += tile) {                                                               \
            int64_t t1 = t0 + tile < n ? t0 + tile : n;                                                          \
            for (int64_t h = 0; h < nkv; h++) { /* a unit: its loop iterations, four positions or one each */    \
                int64_t iters = dim == 64 ? head_group * (t1 - t0) /* one per position of each query head */     \
                                          : blocks * ((t1 - t0) / 4 * ((dim + 15) / 16) + (t1 - t0) % 4);        \
                decode_prefetch_plan_##SUF(&pf, k_cache, v_cache, kv_rows, n, nkv, head_stride,                  \
                                           t0 / tile, h, 0, iters);                                              \
                const T *kc = k_cache + h * head_stride;                                                         \
                if (dim == 64) {                                                                                 \
                    for (int64_t g = h * head_group; g < (h + 1) * head_group; g++)                              \
                        qk_rows64_##SUF(qf + g * dim, kc, kv_rows + t0, t1 - t0, scale, scores + g * n + t0,     \
                                        vmax + g, maxs + g, &pf);                                                \
                    continue;                                                                                    \
                }                                                                                                \
                for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end; g0 += 3) {                \
                    int qb = (int)(g_end - g0 < 3 ? g_end - g0 : 3);                                             \
                    const float *qg = qf + g0 * dim;                                                             \
                    float *sg = scores + g0 * n;                                                                 \
                    int64_t i = t0;                                                                              \
                    for (; i + 4 <= t1; i += 4) {                                                                \
                        switch (qb) {                                                                            \
                        case 1: qk4_avx2_##SUF##_1(qg, kc, kv_rows + i, dim, scale, sg + i, n, vmax + g0,        \
                                                   &pf); break;                                                  \
                        case 2: qk4_avx2_##SUF##_2(qg, kc, kv_rows + i, dim, scale, sg + i, n, vmax + g0,        \
                                                   &pf); break;                                                  \
                        default: qk4_avx2_##SUF##_3(qg, kc, kv_rows + i, dim, scale, sg + i, n, vmax + g0,       \
                                                   &pf); break;                                                  \
                        }                                                                                        \
                    }                                                                                            \
                    for (; i < t1; i++) {                                                                        \
                        decode_prefetch_next_##SUF(&pf);                                                         \
                        const T *k = kc + kv_rows[i];                                                            \
                        for (int b = 0; b < qb; b++) {                                                           \
                            __m256 a = _mm256_setzero_ps();                                                      \
                            for (int64_t d = 0; d < dim; d += 8)                                                 \
                                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + b * dim + d), load8_##SUF(k + d), a);   \
                            sg[b * n + i] = sum8(a) * scale;                                                     \
                            if (sg[b * n + i] > maxs[g0 + b]) maxs[g0 + b] = sg[b * n + i];                      \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        /* exp and the normaliser (unrounded), then the weights as the dtype rounds them */                      \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            float lanes[4];                                                                                      \
            _mm_storeu_ps(lanes, vmax[g]);                                                                       \
            for (int j = 0; j < 4; j++) if (lanes[j] > maxs[g]) maxs[g] = lanes[j];                              \
            float *sg = scores + g * n;                                                                          \
            __m256 vm = _mm256_set1_ps(maxs[g]), vsum = _mm256_setzero_ps();                                     \
            float sum = 0.f;                                                                                     \
            int64_t i = 0;                                                                                       \
            for (; i + 8 <= n; i += 8) {                                                                         \
                __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));                          \
                vsum = _mm256_add_ps(vsum, e);                                                                   \
                _mm256_storeu_ps(sg + i, round8_##SUF(e));                                                       \
            }                                                                                                    \
            for (; i < n; i++) {                                                                                 \
                float e = expf(sg[i] - maxs[g]);                                                                 \
                sum += e;                                                                                        \
                sg[i] = round_##SUF(e);                                                                          \
            }                                                                                                    \
            sums[g] = sum + sum8(vsum);                                                                          \
        }                                                                                                        \
        memset(acc, 0, sizeof(float) * group * dim);                                                             \
        int64_t slices = (dim + 31) / 32; /* 32 dims at a time; the last dims, fewer than 32, eight at a time */ \
        for (int64_t t0 = 0; t0 < n; t0 += tile) {                                                               \
            int64_t t1 = t0 + tile < n ? t0 + tile : n;                                                          \
            for (int64_t h = 0; h < nkv; h++) { /* a unit: one iteration per position and slice */               \
                int64_t iters = dim == 64 ? head_group * (t1 - t0) : blocks * (t1 - t0) * slices;                \
                decode_prefetch_plan_##SUF(&pf, k_cache, v_cache, kv_rows, n, nkv, head_stride,                  \
                                           t0 / tile, h, 1, iters);                                              \
                const T *vc = v_cache + h * head_stride;                                                         \
                if (dim == 64) {                                                                                 \
                    for (int64_t g = h * head_group; g < (h + 1) * head_group; g++)                              \
                        pv_rows64_##SUF(scores + g * n, vc, kv_rows, t0, t1, acc + g * dim, &pf);                \
                    continue;                                                                                    \
                }                                                                                                \
                for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end; g0 += 3) {                \
                    int qb = (int)(g_end - g0 < 3 ? g_end - g0 : 3);                                             \
                    const float *sg = scores + g0 * n;                                                           \
                    int64_t d0 = 0;                                                                              \
                    for (; d0 + 32 <= dim; d0 += 32) {                                                           \
                        float *ag = acc + g0 * dim + d0;                                                         \
                        switch (qb) {                                                                            \
                        case 1: pv32_avx2_##SUF##_1(sg, n, vc + d0, kv_rows, t0, t1, ag, dim, &pf); break;       \
                        case 2: pv32_avx2_##SUF##_2(sg, n, vc + d0, kv_rows, t0, t1, ag, dim, &pf); break;       \
                        default: pv32_avx2_##SUF##_3(sg, n, vc + d0, kv_rows, t0, t1, ag, dim, &pf); break;      \
                        }                                                                                        \
                    }                                                                                            \
                    if (d0 < dim) {                                                                              \
                        for (int64_t j = t0; j < t1; j++) decode_prefetch_next_##SUF(&pf);                       \
                        for (int b = 0; b < qb; b++)                                                             \
                            for (int64_t d = d0; d < dim; d += 8) {                                              \
                                __m256 r = _mm256_loadu_ps(acc + (g0 + b) * dim + d);                            \
                                for (int64_t j = t0; j < t1; j++)                                                \
                                    r = _mm256_fmadd_ps(_mm256_set1_ps(sg[b * n + j]),                           \
                                                        load8_##SUF(vc + kv_rows[j] + d), r);                    \
                                _mm256_storeu_ps(acc + (g0 + b) * dim + d, r);                                   \
                            }                                                                                    \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        decode_finish_##SUF(acc, maxs, sums, group, dim, out, part);                                             \
    }

DEFINE_DECODE_AVX2(f32, float)
DEFINE_DECODE_AVX2(bf16, bf16_t)
#endif

#if defined(KSANA_AVX512)
/* The decode task in AVX-512: the AVX2 task's tiles, passes, prefetch and rounding, 16 lanes wide, and the query
 * heads that share a KV head (GQA) served together: up to four of them per load of each K and V row (the AVX2 task
 * serves up to three). The loads per FMA drop from above one to about a half, which shows most with the KV in
 * cache (tools/attention_ab.py --hot). Same exp, so the same softmax weights; the dot products sum in another
 * order than AVX2's. */
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16m_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16m_bf16(const bf16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 round16_f32(__m512 x) { return x; }
static inline __m512 round16_bf16(__m512 x) { /* as round8_bf16 */
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
/* exp_nonpositive, 16 lanes (the same operations, so the same values) */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

/* The decode task's two inner blocks for QB query heads that share one KV head (GQA), QB = 1..4: each K and V row
 * is loaded once for all of them. qk: the scores of 4 positions; pv: positions [j0, j1) into one 64-wide slice of
 * the QB accumulators, `chunks` of its 4 sixteen-lane chunks live (masked: head sizes 16, 48, 80, ...). */
#define DEFINE_GQA_BLOCKS(SUF, T, QB)                                                                            \
    /* qk's 4 x QB dot products, each summed across lanes, scaled, stored and folded into the maxima. */         \
    static inline void qk_scores_##SUF##_##QB(__m512 a[QB][4], float scale, float *s, int64_t n, __m128 *vmax) { \
        _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++) {                                                   \
            __m128 sc = _mm_mul_ps(sum4x8(fold16(a[b][0]), fold16(a[b][1]), fold16(a[b][2]), fold16(a[b][3])),   \
                                   _mm_set1_ps(scale));                                                          \
            _mm_storeu_ps(s + b * n, sc);                                                                        \
            vmax[b] = _mm_max_ps(vmax[b], sc);                                                                   \
        }                                                                                                        \
    }                                                                                                            \
    static inline void qk_block_##SUF##_##QB(const float *q, const T *kc, const int64_t *rows, int64_t dim,      \
                                             float scale, float *s, int64_t n, __m128 *vmax,                     \
                                             decode_prefetch_##SUF *pf) {                                        \
        const T *k0 = kc + rows[0], *k1 = kc + rows[1], *k2 = kc + rows[2], *k3 = kc + rows[3];                  \
        __m512 a[QB][4];                                                                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                                     \
            a[b][0] = a[b][1] = a[b][2] = a[b][3] = _mm512_setzero_ps();                                         \
        for (int64_t d = 0; d < dim; d += 16) {                                                                  \
            decode_prefetch_next_##SUF(pf);                                                                      \
            __m512 x0 = load16_##SUF(k0 + d), x1 = load16_##SUF(k1 + d);                                         \
            __m512 x2 = load16_##SUF(k2 + d), x3 = load16_##SUF(k3 + d);                                         \
            _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++) {                                               \
                __m512 qv = _mm512_loadu_ps(q + b * dim + d);                                                    \
                a[b][0] = _mm512_fmadd_ps(qv, x0, a[b][0]);                                                      \
                a[b][1] = _mm512_fmadd_ps(qv, x1, a[b][1]);                                                      \
                a[b][2] = _mm512_fmadd_ps(qv, x2, a[b][2]);                                                      \
                a[b][3] = _mm512_fmadd_ps(qv, x3, a[b][3]);                                                      \
            }                                                                                                    \
        }                                                                                                        \
        qk_scores_##SUF##_##QB(a, scale, s, n, vmax);                                                            \
    }                                                                                                            \
    /* qk's block with each of the 4 rows read whole before the next (the same sums in the same order), for      \
     * a unit that the hardware prefetcher streams: it follows the ones before it in memory, and it streams      \
     * only what is read in address order. */                                                                    \
    static inline void qk_rows_##SUF##_##QB(const float *q, const T *kc, const int64_t *rows, int64_t dim,       \
                                            float scale, float *s, int64_t n, __m128 *vmax,                      \
                                            decode_prefetch_##SUF *pf) {                                         \
        __m512 a[QB][4];                                                                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                                     \
            a[b][0] = a[b][1] = a[b][2] = a[b][3] = _mm512_setzero_ps();                                         \
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {                                                               \
            int chunks = (int)((dim - d0 < 64 ? dim - d0 : 64) / 16);                                            \
            __m512 qv[QB][4];                                                                                    \
            _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                                 \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)                                              \
                    qv[b][c] = c < chunks ? _mm512_loadu_ps(q + b * dim + d0 + 16 * c) : _mm512_setzero_ps();    \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                                \
                const T *k = kc + rows[p] + d0;                                                                  \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                            \
                    if (c >= chunks) break;                                                                      \
                    __m512 x = load16_##SUF(k + 16 * c);                                                         \
                    _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                         \
                        a[b][p] = _mm512_fmadd_ps(qv[b][c], x, a[b][p]);                                         \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int64_t d = 0; d < dim; d += 16) decode_prefetch_next_##SUF(pf); /* keeps the unit's count */       \
        qk_scores_##SUF##_##QB(a, scale, s, n, vmax);                                                            \
    }                                                                                                            \
    static inline void pv_block_##SUF##_##QB(const float *s, int64_t n, const T *vc, const int64_t *kv_rows,     \
                                             int64_t j0, int64_t j1, int chunks, float *acc, int64_t dim,        \
                                             decode_prefetch_##SUF *pf) {                                        \
        __mmask16 m[4];                                                                                          \
        for (int c = 0; c < 4; c++) m[c] = c < chunks ? (__mmask16)0xffff : 0;                                   \
        __m512 r[QB][4];                                                                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)                                                  \
                r[b][c] = _mm512_maskz_loadu_ps(m[c], acc + b * dim + 16 * c);                                   \
        for (int64_t j = j0; j < j1; j++) {                                                                      \
            decode_prefetch_next_##SUF(pf);                                                                      \
            const T *v = vc + kv_rows[j];                                                                        \
            __m512 x0 = load16m_##SUF(v, m[0]), x1 = load16m_##SUF(v + 16, m[1]);                                \
            __m512 x2 = load16m_##SUF(v + 32, m[2]), x3 = load16m_##SUF(v + 48, m[3]);                           \
            _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++) {                                               \
                __m512 w = _mm512_set1_ps(s[b * n + j]);                                                         \
                r[b][0] = _mm512_fmadd_ps(w, x0, r[b][0]);                                                       \
                r[b][1] = _mm512_fmadd_ps(w, x1, r[b][1]);                                                       \
                r[b][2] = _mm512_fmadd_ps(w, x2, r[b][2]);                                                       \
                r[b][3] = _mm512_fmadd_ps(w, x3, r[b][3]);                                                       \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int b = 0; b < QB; b++)                                                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)                                                  \
                _mm512_mask_storeu_ps(acc + b * dim + 16 * c, m[c], r[b][c]);                                    \
    }

/* One decode task in AVX-512 (head_dim a multiple of 16): positions in tiles (DECODE_TILE), each tile's KV heads
 * in turn, keys then values, and the query heads of a KV head through the GQA blocks, up to four at a time. While
 * it computes on one (tile, KV head) unit it fetches one ahead into L2 (decode_prefetch, as the AVX2 task), unless
 * the hardware prefetcher streams it (DECODE_STREAM_AFTER). */
#define DEFINE_DECODE_AVX512(SUF, T)                                                                             \
    DEFINE_GQA_BLOCKS(SUF, T, 1)                                                                                 \
    DEFINE_GQA_BLOCKS(SUF, T, 2)                                                                                 \
    DEFINE_GQA_BLOCKS(SUF, T, 3)                                                                                 \
    DEFINE_GQA_BLOCKS(SUF, T, 4)                                                                                 \
    static void decode_task_avx512_##SUF(const float *qf, const T *k_cache, const T *v_cache,                    \
                                         const int64_t *kv_rows, int64_t n, int64_t group, int64_t head_group,   \
                                         int64_t dim, int64_t head_stride, float scale, float *scores,           \
                                         float *acc, T *out, float *part) {                                      \
        float maxs[group], sums[group];                                                                          \
        __m128 vmax[group];                                                                                      \
        for (int64_t g = 0; g < group; g++) maxs[g] = -INFINITY, vmax[g] = _mm_set1_ps(-INFINITY);               \
        int64_t nkv = group / head_group, passes = (head_group + 3) / 4, slices = (dim + 63) / 64;               \
        int64_t tile = nkv > 1 ? DECODE_TILE : DECODE_TILE_ONE_HEAD;                                             \
        decode_prefetch_##SUF pf = {.dim = dim, .tile = tile, .leave_after = DECODE_STREAM_AFTER,                \
                                   .ahead = nkv > 1 ? DECODE_PREFETCH_AHEAD : 1};                                \
        for (int64_t t = 0, t0 = 0; t0 < n; t++, t0 += tile) {                                                   \
            int64_t t1 = t0 + tile < n ? t0 + tile : n, rows = t1 - t0;                                          \
            for (int64_t h = 0; h < nkv; h++) {                                                                  \
                int streamed = pf.streamed & 1; /* this unit left to the hardware prefetcher: row by row */      \
                decode_prefetch_plan_##SUF(&pf, k_cache, v_cache, kv_rows, n, nkv, head_stride, t, h, 0,         \
                                           passes * (rows / 4 * (dim / 16) + rows % 4));                         \
                const T *kc = k_cache + h * head_stride;                                                         \
                for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end;) {                        \
                    int qb = (int)(g_end - g0 < 4 ? g_end - g0 : 4);                                             \
                    const float *qg = qf + g0 * dim;                                                             \
                    float *sg = scores + g0 * n;                                                                 \
                    __m128 *vm = vmax + g0;                                                                      \
                    int64_t i = t0;                                                                              \
                    for (; i + 4 <= t1; i += 4) {                                                                \
                        const int64_t *r4 = kv_rows + i;                                                         \
                        float *s4 = sg + i;                                                                      \
                        if (streamed) switch (qb) {                                                              \
                            case 1: qk_rows_##SUF##_1(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;            \
                            case 2: qk_rows_##SUF##_2(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;            \
                            case 3: qk_rows_##SUF##_3(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;            \
                            default: qk_rows_##SUF##_4(qg, kc, r4, dim, scale, s4, n, vm, &pf);                  \
                            }                                                                                    \
                        else switch (qb) {                                                                       \
                            case 1: qk_block_##SUF##_1(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;           \
                            case 2: qk_block_##SUF##_2(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;           \
                            case 3: qk_block_##SUF##_3(qg, kc, r4, dim, scale, s4, n, vm, &pf); break;           \
                            default: qk_block_##SUF##_4(qg, kc, r4, dim, scale, s4, n, vm, &pf);                 \
                            }                                                                                    \
                    }                                                                                            \
                    for (; i < t1; i++) {                                                                        \
                        decode_prefetch_next_##SUF(&pf);                                                         \
                        const T *k = kc + kv_rows[i];                                                            \
                        for (int b = 0; b < qb; b++) {                                                           \
                            __m512 a = _mm512_setzero_ps();                                                      \
                            for (int64_t d = 0; d < dim; d += 16)                                                \
                                a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + b * dim + d), load16_##SUF(k + d), a);  \
                            sg[b * n + i] = sum8(fold16(a)) * scale;                                             \
                            if (sg[b * n + i] > maxs[g0 + b]) maxs[g0 + b] = sg[b * n + i];                      \
                        }                                                                                        \
                    }                                                                                            \
                    g0 += qb;                                                                                    \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            float lanes[4];                                                                                      \
            _mm_storeu_ps(lanes, vmax[g]);                                                                       \
            for (int j = 0; j < 4; j++) if (lanes[j] > maxs[g]) maxs[g] = lanes[j];                              \
            float *sg = scores + g * n;                                                                          \
            __m512 vm = _mm512_set1_ps(maxs[g]), vsum = _mm512_setzero_ps();                                     \
            float sum = 0.f;                                                                                     \
            int64_t i = 0;                                                                                       \
            for (; i + 16 <= n; i += 16) {                                                                       \
                __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + i), vm));                        \
                vsum = _mm512_add_ps(vsum, e);                                                                   \
                _mm512_storeu_ps(sg + i, round16_##SUF(e));                                                      \
            }                                                                                                    \
            for (; i < n; i++) {                                                                                 \
                float e = expf(sg[i] - maxs[g]);                                                                 \
                sum += e;                                                                                        \
                sg[i] = round_##SUF(e);                                                                          \
            }                                                                                                    \
            sums[g] = sum + _mm512_reduce_add_ps(vsum);                                                          \
        }                                                                                                        \
        memset(acc, 0, sizeof(float) * group * dim);                                                             \
        for (int64_t t = 0, t0 = 0; t0 < n; t++, t0 += tile) {                                                   \
            int64_t t1 = t0 + tile < n ? t0 + tile : n;                                                          \
            for (int64_t h = 0; h < nkv; h++) {                                                                  \
                decode_prefetch_plan_##SUF(&pf, k_cache, v_cache, kv_rows, n, nkv, head_stride, t, h, 1,         \
                                           passes * slices * (t1 - t0));                                         \
                const T *vc = v_cache + h * head_stride;                                                         \
                for (int64_t g0 = h * head_group, g_end = g0 + head_group; g0 < g_end;) {                        \
                    int qb = (int)(g_end - g0 < 4 ? g_end - g0 : 4);                                             \
                    const float *sg = scores + g0 * n;                                                           \
                    for (int64_t d0 = 0; d0 < dim; d0 += 64) {                                                   \
                        int chunks = (int)((dim - d0 < 64 ? dim - d0 : 64) / 16);                                \
                        float *ag = acc + g0 * dim + d0;                                                         \
                        const T *vd = vc + d0;                                                                   \
                        switch (qb) {                                                                            \
                        case 1: pv_block_##SUF##_1(sg, n, vd, kv_rows, t0, t1, chunks, ag, dim, &pf); break;     \
                        case 2: pv_block_##SUF##_2(sg, n, vd, kv_rows, t0, t1, chunks, ag, dim, &pf); break;     \
                        case 3: pv_block_##SUF##_3(sg, n, vd, kv_rows, t0, t1, chunks, ag, dim, &pf); break;     \
                        default: pv_block_##SUF##_4(sg, n, vd, kv_rows, t0, t1, chunks, ag, dim, &pf); break;    \
                        }                                                                                        \
                    }                                                                                            \
                    g0 += qb;                                                                                    \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        decode_finish_##SUF(acc, maxs, sums, group, dim, out, part);                                             \
    }

DEFINE_DECODE_AVX512(f32, float)
DEFINE_DECODE_AVX512(bf16, bf16_t)

#pragma GCC pop_options
#define DECODE_AVX512 1
#define DECODE_TASK_AVX512(SUF) decode_task_avx512_##SUF
#else
#define DECODE_AVX512 0
#define DECODE_TASK_AVX512(SUF) DECODE_TASK_AVX2(SUF)
#endif

#ifdef KSANA_AVX2
/* silu(g) = g / (1 + e^-g), with e^-g from e^-|g| (or its inverse) so the exp argument is never positive. */
static inline __m256 silu8(__m256 g) {
    __m256 t = exp_nonpositive(_mm256_or_ps(_mm256_set1_ps(-0.0f), g)); /* e^-|g| */
    t = _mm256_blendv_ps(t, _mm256_div_ps(_mm256_set1_ps(1.0f), t), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}
#define SILU_AND_MUL_AVX2(SUF)                                                                                  \
    for (; j + 8 <= d; j += 8)                                                                                  \
        store8_##SUF(o + j, _mm256_mul_ps(round8_##SUF(silu8(load8_##SUF(g + j))), load8_##SUF(u + j)));
#define DECODE_AVX2 1
#define DECODE_TASK_AVX2(SUF) decode_task_avx2_##SUF
#else
#define SILU_AND_MUL_AVX2(SUF)
#define DECODE_AVX2 0
#define DECODE_TASK_AVX2(SUF) decode_task_scalar_##SUF
#endif

/* RMSNorm and rotary rows, defined in norms.cpp (the same code as the rms_norm and rotary_neox operators). */
void rms_norm_row_f32(const float *src, const float *add, float *residual_out, const float *w, float *o, int64_t dim,
                      float eps);
void rms_norm_row_bf16(const bf16_t *src, const bf16_t *add, bf16_t *residual_out, const bf16_t *w, bf16_t *o,
                       int64_t dim, float eps);
void rotary_token_f32(const float *x, const float *c, const float *s, float *out, int64_t nheads, int64_t dim);
void rotary_token_bf16(const bf16_t *x, const bf16_t *c, const bf16_t *s, bf16_t *out, int64_t nheads, int64_t dim);
/* Greedy sampling over float32 logits (sampling.cpp). */
void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs, int nthreads);

/* The per-row and per-task bodies that both the ops and decode_layers run: kept out of line, so decode_layers
 * (compiled for AVX-512) runs the very code the ops run, with the same vectorised reductions and the same bits. */
#define NOINLINE __attribute__((noinline))

/* How paged_decode divides a step's attention into tasks. A task is one sequence's KV heads: all of them when
 * the batch alone keeps the threads busy (each position's row is then read whole and in order), else one KV
 * head, whose query heads share its keys and values. Few sequences give few tasks (one sequence: one per KV
 * head, 3 for 2 threads on smollm2), so then a long context's tasks are split along the positions
 * (flash-decoding): each chunk keeps its own max, sum and unnormalised sum of values (a part of `part_len`
 * floats), and the chunks are combined, rescaled to the overall max, at the end. The plan depends on the
 * thread count, not on which thread runs a task, so any thread may run any task with the same result. */
typedef struct {
    int64_t group, row, kv_per_task, tasks_per_seq, heads_per_task, whole_tasks, splits, part_len;
    int64_t slot_stride, head_stride; /* the cache's layout (see store_kv) */
    int parallel; /* worth waking the other threads for */
} decode_plan;

static decode_plan plan_decode(const int64_t *seq_lens, int64_t batch, int64_t nheads, int64_t nkv, int64_t dim,
                               int64_t window, int64_t slot_stride, int64_t head_stride, int nthreads) {
    decode_plan plan = {.group = nheads / nkv, .row = nkv * dim, .slot_stride = slot_stride,
                        .head_stride = head_stride};
    int64_t positions = 0, longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t n = (window > 0 && seq_lens[b] > window) ? window : seq_lens[b];
        positions += n;
        longest = n > longest ? n : longest;
    }
    plan.kv_per_task = batch >= 2 * nthreads ? nkv : 1;
    plan.parallel = nthreads > 1 && positions * nheads * dim >= (plan.kv_per_task == 1 ? PARALLEL_MIN_SPLIT_WORK
                                                                                       : PARALLEL_MIN_ATTENTION_WORK);
    plan.tasks_per_seq = nkv / plan.kv_per_task;
    plan.heads_per_task = plan.kv_per_task * plan.group;
    plan.whole_tasks = batch * plan.tasks_per_seq;
    plan.splits = 1;
    if (plan.parallel && plan.kv_per_task == 1) {
        int64_t wanted = (DECODE_SPLIT_TASKS * nthreads + plan.whole_tasks - 1) / plan.whole_tasks;
        int64_t most = longest / DECODE_SPLIT_MIN;
        plan.splits = wanted < most ? wanted : most;
        plan.splits = plan.splits < 1 ? 1 : plan.splits;
    }
    plan.part_len = plan.heads_per_task * (2 + dim);
    return plan;
}

/* The silu_and_mul op's row: in an AVX-512 build the 16-lane one that decode_layers runs (the same values),
 * defined with the packed linear; faster than the 8-lane row in bfloat16 (float32 runs at the caches' bandwidth
 * either way). */
#if defined(KSANA_AVX512)
static void silu_and_mul_row16_f32(const float *g, float *o, int64_t d);
static void silu_and_mul_row16_bf16(const bf16_t *g, bf16_t *o, int64_t d);
#define SILU_AND_MUL_OP_ROW(SUF) silu_and_mul_row16_##SUF
#else
#define SILU_AND_MUL_OP_ROW(SUF) silu_and_mul_row_##SUF
#endif

#define DEFINE_KERNELS(SUF, T)                                                                                  \
    /* Columns [j, d) of silu_and_mul_row, one at a time with expf: the vector loops' tail. */                   \
    static NOINLINE void silu_and_mul_tail_##SUF(const T *g, T *o, int64_t j, int64_t d) {                       \
        for (; j < d; j++) {                                                                                     \
            float gv = load_##SUF(g + j);                                                                        \
            float sv = round_##SUF(gv / (1.0f + expf(-gv)));                                                     \
            store_##SUF(o + j, sv * load_##SUF(g + d + j));                                                      \
        }                                                                                                        \
    }                                                                                                            \
    /* out[:, :d] = round(round(silu(gate)) * up) for x = [gate | up]. */                                        \
    static NOINLINE void silu_and_mul_row_##SUF(const T *g, T *o, int64_t d) {                                   \
        const T *u = g + d;                                                                                      \
        int64_t j = 0;                                                                                           \
        SILU_AND_MUL_AVX2(SUF)                                                                                   \
        (void)u;                                                                                                 \
        silu_and_mul_tail_##SUF(g, o, j, d);                                                                     \
    }                                                                                                            \
    void silu_and_mul_##SUF(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t d, int nthreads) {     \
        _Pragma("omp parallel for num_threads(nthreads) if (rows * d >= PARALLEL_MIN_ELEMS)")                   \
        for (int64_t i = 0; i < rows; i++) SILU_AND_MUL_OP_ROW(SUF)(x + i * x_stride, out + i * d, d);          \
    }                                                                                                            \
                                                                                                                 \
    /* Copy each token's K/V heads (num_kv_heads x head_dim values) into its cache slot. A block holds          \
     * block_size x nkv x dim values; within it slot s's KV head h starts at s * slot_stride + h * head_stride:  \
     * (nkv * dim, dim) slot-major, (dim, block_size * dim) head-major (see ksana/worker/kv_cache.py). */        \
    void store_kv_##SUF(const T *key, int64_t key_stride, const T *value, int64_t value_stride, T *k_cache,     \
                        T *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim,               \
                        int64_t block_size, int64_t slot_stride, int64_t head_stride) {                         \
        for (int64_t t = 0; t < ntok; t++) {                                                                     \
            int64_t at = slots[t] / block_size * block_size * nkv * dim + slots[t] % block_size * slot_stride;   \
            for (int64_t h = 0; h < nkv; h++) {                                                                  \
                memcpy(k_cache + at + h * head_stride, key + t * key_stride + h * dim, sizeof(T) * dim);         \
                memcpy(v_cache + at + h * head_stride, value + t * value_stride + h * dim, sizeof(T) * dim);     \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* One decode task in portable C (same layout as the AVX2 one): the fallback for other CPUs and head sizes. */\
    static void decode_task_scalar_##SUF(const float *qf, const T *k_cache, const T *v_cache,                   \
                                         const int64_t *kv_rows, int64_t n, int64_t group, int64_t head_group,   \
                                         int64_t dim, int64_t head_stride, float scale, float *scores,           \
                                         float *acc, T *out, float *part) {                                      \
        float maxs[group], sums[group];                                                                          \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            const float *qg = qf + g * dim;                                                                      \
            const T *kc = k_cache + (g / head_group) * head_stride;                                              \
            const T *vc = v_cache + (g / head_group) * head_stride;                                              \
            float *sg = scores + g * n, m = -INFINITY, sum = 0.f;                                                \
            for (int64_t i = 0; i < n; i++) {                                                                    \
                const T *k = kc + kv_rows[i];                                                                    \
                float dot = 0.f;                                                                                 \
                _Pragma("omp simd reduction(+ : dot)")                                                           \
                for (int64_t d = 0; d < dim; d++) dot = fmaf(qg[d], load_##SUF(k + d), dot);                     \
                sg[i] = dot * scale;                                                                             \
                if (sg[i] > m) m = sg[i];                                                                        \
            }                                                                                                    \
            for (int64_t i = 0; i < n; i++) {                                                                    \
                float e = expf(sg[i] - m);                                                                       \
                sum += e;                                                                                        \
                sg[i] = round_##SUF(e);                                                                          \
            }                                                                                                    \
            maxs[g] = m, sums[g] = sum;                                                                          \
            for (int64_t d = 0; d < dim; d++) {                                                                  \
                float a = 0.f;                                                                                   \
                for (int64_t i = 0; i < n; i++) a = fmaf(sg[i], load_##SUF(vc + kv_rows[i] + d), a);             \
                acc[g * dim + d] = a;                                                                            \
            }                                                                                                    \
        }                                                                                                        \
        decode_finish_##SUF(acc, maxs, sums, group, dim, out, part);                                             \
    }                                                                                                            \
                                                                                                                 \
    /* One new token per sequence over its paged context (see plan_decode for how it splits into tasks). Two     \
     * passes (scores, then the weighted sum of values) keep the softmax exact without rescaling. With           \
     * window > 0 only the last `window` positions. As in SDPA's bf16 kernel, the unnormalised probabilities     \
     * are rounded to bf16 before they weight V (the sum that normalises them is not), so bf16 models follow     \
     * transformers' rounding. `parts`: the split tasks' partial results (plan->splits > 1), combined by         \
     * decode_combine.                                                                                           \
     */                                                                                                          \
    static NOINLINE void decode_run_task_##SUF(const decode_plan *plan, int64_t task, const T *q,                \
                                               int64_t q_stride, const T *k_cache, const T *v_cache,             \
                                               const int64_t *block_tables, int64_t table_stride,                \
                                               const int64_t *seq_lens, T *out, int64_t nheads, int64_t dim,     \
                                               int64_t block_size, float scale, int64_t window, float *parts) {  \
        int64_t splits = plan->splits, heads_per_task = plan->heads_per_task, group = plan->group;               \
        int64_t whole = task / splits, chunk = task % splits;                                                    \
        int64_t b = whole / plan->tasks_per_seq, kv0 = (whole % plan->tasks_per_seq) * plan->kv_per_task;        \
        int64_t len = seq_lens[b];                                                                               \
        int64_t start = (window > 0 && len > window) ? len - window : 0;                                         \
        int64_t first = start + (len - start) * chunk / splits;                                                  \
        int64_t n = start + (len - start) * (chunk + 1) / splits - first;                                        \
        const int64_t *table = block_tables + b * table_stride;                                                  \
        float *qf = (float *)malloc(sizeof(float) * heads_per_task * dim);                                       \
        float *scores = (float *)malloc(sizeof(float) * heads_per_task * (n > 0 ? n : 1));                       \
        int64_t *kv_rows = (int64_t *)malloc(sizeof(int64_t) * (n > 0 ? n : 1));                                 \
        float *acc = (float *)malloc(sizeof(float) * heads_per_task * dim);                                      \
        int64_t head0 = kv0 * plan->head_stride; /* the task's first KV head within a slot */                   \
        for (int64_t i = 0, blk = first / block_size, off = first % block_size; i < n; i++) {                    \
            kv_rows[i] = table[blk] * block_size * plan->row + off * plan->slot_stride + head0;                  \
            if (++off == block_size) off = 0, blk++;                                                             \
        }                                                                                                        \
        const T *qh = q + b * q_stride + kv0 * group * dim;                                                      \
        for (int64_t j = 0; j < heads_per_task * dim; j++) qf[j] = load_##SUF(qh + j);                           \
        T *o = out + (b * nheads + kv0 * group) * dim;                                                           \
        float *part = parts ? parts + task * plan->part_len : NULL;                                              \
        if (DECODE_AVX512 && dim % 16 == 0)                                                                      \
            DECODE_TASK_AVX512(SUF)(qf, k_cache, v_cache, kv_rows, n, heads_per_task, group, dim,                \
                                    plan->head_stride, scale, scores, acc, o, part);                             \
        else if (DECODE_AVX2 && dim % 8 == 0)                                                                    \
            DECODE_TASK_AVX2(SUF)(qf, k_cache, v_cache, kv_rows, n, heads_per_task, group, dim,                  \
                                  plan->head_stride, scale, scores, acc, o, part);                               \
        else                                                                                                     \
            decode_task_scalar_##SUF(qf, k_cache, v_cache, kv_rows, n, heads_per_task, group, dim,               \
                                     plan->head_stride, scale, scores, acc, o, part);                            \
        free(qf);                                                                                                \
        free(scores);                                                                                            \
        free(kv_rows);                                                                                           \
        free(acc);                                                                                               \
    }                                                                                                            \
                                                                                                                 \
    /* One whole task's output from its split parts: out = sum_c w_c acc_c / sum_c w_c sum_c,                    \
     * w_c = e^(max_c - max); an empty chunk weighs 0. */                                                        \
    static NOINLINE void decode_combine_##SUF(const decode_plan *plan, int64_t whole, const float *parts,        \
                                              T *out, int64_t nheads, int64_t dim) {                             \
        int64_t splits = plan->splits, part_len = plan->part_len, heads_per_task = plan->heads_per_task;         \
        int64_t b = whole / plan->tasks_per_seq, kv0 = (whole % plan->tasks_per_seq) * plan->kv_per_task;        \
        T *o = out + (b * nheads + kv0 * plan->group) * dim;                                                     \
        const float *whole_parts = parts + whole * splits * part_len;                                            \
        float sum_v[dim];                                                                                        \
        for (int64_t g = 0; g < heads_per_task; g++) {                                                           \
            float top = -INFINITY, total = 0.f;                                                                  \
            for (int64_t c = 0; c < splits; c++)                                                                 \
                top = whole_parts[c * part_len + g] > top ? whole_parts[c * part_len + g] : top;                 \
            for (int64_t d = 0; d < dim; d++) sum_v[d] = 0.f;                                                    \
            for (int64_t c = 0; c < splits; c++) {                                                               \
                const float *part = whole_parts + c * part_len;                                                  \
                if (part[g] == -INFINITY) continue;                                                              \
                float w = expf(part[g] - top);                                                                   \
                total += w * part[heads_per_task + g];                                                           \
                const float *acc = part + 2 * heads_per_task + g * dim;                                          \
                for (int64_t d = 0; d < dim; d++) sum_v[d] += w * acc[d];                                        \
            }                                                                                                    \
            float inv = total > 0.f ? 1.0f / total : 0.f;                                                        \
            for (int64_t d = 0; d < dim; d++) store_##SUF(o + g * dim + d, sum_v[d] * inv);                      \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    void paged_decode_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                    \
                            const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, T *out,  \
                            int64_t batch, int64_t nheads, int64_t nkv, int64_t dim, int64_t block_size,         \
                            int64_t slot_stride, int64_t head_stride, float scale, int64_t window,               \
                            int nthreads) {                                                                      \
        decode_plan plan = plan_decode(seq_lens, batch, nheads, nkv, dim, window, slot_stride, head_stride,      \
                                       nthreads);                                                                \
        int64_t tasks = plan.whole_tasks * plan.splits;                                                          \
        float *parts = plan.splits > 1 ? (float *)malloc(sizeof(float) * tasks * plan.part_len) : NULL;          \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (plan.parallel)")                \
        for (int64_t task = 0; task < tasks; task++)                                                             \
            decode_run_task_##SUF(&plan, task, q, q_stride, k_cache, v_cache, block_tables, table_stride,        \
                                  seq_lens, out, nheads, dim, block_size, scale, window, parts);                 \
        if (parts) {                                                                                             \
            for (int64_t whole = 0; whole < plan.whole_tasks; whole++)                                           \
                decode_combine_##SUF(&plan, whole, parts, out, nheads, dim);                                     \
            free(parts);                                                                                         \
        }                                                                                                        \
    }

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, bf16_t)

/* Causal attention of one sequence's new tokens over its paged cache (the new tokens' K/V already stored), float32,
 * for prefill. PyTorch's CPU SDPA runs its small per-chunk GEMMs through MKL at about a fifth of the FMA peak;
 * here a task is one KV head and PREFILL_QBLOCK consecutive query positions, whose rows (every query head of the
 * KV head at each position) meet the keys as a small matrix product: scores = rows x keys over head_dim with the
 * keys packed transposed in tiles of 16, an exact softmax per row (max, then exp and the sum, as the decode task),
 * then rows x head_dim += weights x values. Query position p sees key positions (p - window, p] (window 0: all up
 * to p). `kv_rows[i]`: where key position first_key + i's KV head 0 starts in the caches (see store_kv);
 * KV head h lies h * head_stride further. */
#ifdef KSANA_AVX2
#define PREFILL_QBLOCK 16
#define PREFILL_KTILE 16

/* s[r][0..16) = scale * (q_r . each key of a tile) for MR rows (q rows `dim` apart), the tile packed [dim][16]. */
#define DEFINE_PREFILL_QK(MR)                                                                                    \
    static inline void prefill_qk_##MR(const float *q, const float *kt, int64_t dim, float scale, float *s,      \
                                       int64_t s_stride) {                                                       \
        __m256 a[MR][2];                                                                                         \
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();            \
        for (int64_t d = 0; d < dim; d++) {                                                                      \
            const float *row = kt + d * PREFILL_KTILE;                                                           \
            __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);                                     \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                               \
                __m256 qb = _mm256_broadcast_ss(q + r * dim + d);                                                \
                a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);                                                      \
                a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);                                                      \
            }                                                                                                    \
        }                                                                                                        \
        __m256 sc = _mm256_set1_ps(scale);                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                                   \
            _mm256_storeu_ps(s + r * s_stride, _mm256_mul_ps(a[r][0], sc));                                      \
            _mm256_storeu_ps(s + r * s_stride + 8, _mm256_mul_ps(a[r][1], sc));                                  \
        }                                                                                                        \
    }
DEFINE_PREFILL_QK(6)
DEFINE_PREFILL_QK(3)

/* acc[r][0..8 * NV) = sum_j p[r][j] v_j[0..8 * NV) for three rows over keys [j0, j1). */
#define DEFINE_PREFILL_PV(NV)                                                                                    \
    static inline void prefill_pv3_##NV(const float *p, int64_t p_stride, const float *v_cache,                  \
                                        const int64_t *rows, int64_t j0, int64_t j1, float *acc, int64_t dim) {  \
        __m256 r[3][NV];                                                                                         \
        _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++)                                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) r[b][c] = _mm256_setzero_ps();                  \
        for (int64_t j = j0; j < j1; j++) {                                                                      \
            const float *v = v_cache + rows[j];                                                                  \
            __m256 w[3];                                                                                         \
            _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++) w[b] = _mm256_broadcast_ss(p + b * p_stride + j);\
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) {                                               \
                __m256 x = _mm256_loadu_ps(v + 8 * c);                                                           \
                _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++) r[b][c] = _mm256_fmadd_ps(w[b], x, r[b][c]); \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++)                                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++)                                                 \
                _mm256_storeu_ps(acc + b * dim + 8 * c, r[b][c]);                                                \
    }
DEFINE_PREFILL_PV(4)
DEFINE_PREFILL_PV(1)

/* One row's softmax weights over its columns [j0, j1) of `sr`: e^(s - max) in place, their sum returned; the last
 * (j1 - j0) % 8 columns through masked loads and stores. */
static inline float prefill_softmax8(float *sr, int64_t j0, int64_t j1) {
    int64_t full = j0 + (j1 - j0) / 8 * 8;
    __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(j1 - full)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 vm = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
    for (int64_t j = j0; j < full; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sr + j));
    __m256 last = _mm256_maskload_ps(sr + full, tail);
    vm = _mm256_max_ps(vm, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), last, _mm256_castsi256_ps(tail)));
    vm = _mm256_max_ps(vm, _mm256_permute2f128_ps(vm, vm, 1));
    vm = _mm256_max_ps(vm, _mm256_permute_ps(vm, 0x4e));
    vm = _mm256_max_ps(vm, _mm256_permute_ps(vm, 0xb1));
    for (int64_t j = j0; j < full; j += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vm));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(sr + j, e);
    }
    __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(last, vm)), _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(sr + full, tail, e);
    return sum8(_mm256_add_ps(vsum, e));
}

#if defined(KSANA_AVX512)
/* The same products 16 lanes wide: a tile's 16 keys in one vector, NT tiles (NT x 16 keys) for MR rows at a time,
 * and 16 of head_dim a vector in the weighted sums of values. Each output is the same FMAs in the same order, so
 * the same bits as the AVX2 kernels', with half the instructions. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define DEFINE_PREFILL_QK16(MR, NT)                                                                              \
    static void prefill_qk16_##MR##_##NT(const float *q, const float *kt, int64_t dim, float scale, float *s,    \
                                         int64_t s_stride) {                                                     \
        __m512 a[MR][NT];                                                                                        \
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++)                                                     \
            _Pragma("GCC unroll 2") for (int t = 0; t < NT; t++) a[r][t] = _mm512_setzero_ps();                  \
        for (int64_t d = 0; d < dim; d++) {                                                                      \
            __m512 k[NT];                                                                                        \
            _Pragma("GCC unroll 2") for (int t = 0; t < NT; t++)                                                 \
                k[t] = _mm512_loadu_ps(kt + t * PREFILL_KTILE * dim + d * PREFILL_KTILE);                        \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                               \
                __m512 qb = _mm512_set1_ps(q[r * dim + d]);                                                      \
                _Pragma("GCC unroll 2") for (int t = 0; t < NT; t++)                                             \
                    a[r][t] = _mm512_fmadd_ps(qb, k[t], a[r][t]);                                              \
            }                                                                                                    \
        }                                                                                                        \
        __m512 sc = _mm512_set1_ps(scale);                                                                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++)                                                     \
            _Pragma("GCC unroll 2") for (int t = 0; t < NT; t++)                                                 \
                _mm512_storeu_ps(s + r * s_stride + t * PREFILL_KTILE, _mm512_mul_ps(a[r][t], sc));              \
    }
DEFINE_PREFILL_QK16(6, 2)
DEFINE_PREFILL_QK16(6, 1)
DEFINE_PREFILL_QK16(3, 2)
DEFINE_PREFILL_QK16(3, 1)

#define DEFINE_PREFILL_PV16(NV)                                                                                  \
    static void prefill_pv3_16_##NV(const float *p, int64_t p_stride, const float *v_cache, const int64_t *rows, \
                                    int64_t j0, int64_t j1, float *acc, int64_t dim) {                           \
        __m512 r[3][NV];                                                                                         \
        _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++)                                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) r[b][c] = _mm512_setzero_ps();                  \
        for (int64_t j = j0; j < j1; j++) {                                                                      \
            const float *v = v_cache + rows[j];                                                                  \
            __m512 w[3];                                                                                         \
            _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++) w[b] = _mm512_set1_ps(p[b * p_stride + j]);      \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) {                                               \
                __m512 x = _mm512_loadu_ps(v + 16 * c);                                                          \
                _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++) r[b][c] = _mm512_fmadd_ps(w[b], x, r[b][c]); \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 3") for (int b = 0; b < 3; b++)                                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++)                                                 \
                _mm512_storeu_ps(acc + b * dim + 16 * c, r[b][c]);                                               \
    }
DEFINE_PREFILL_PV16(4)
DEFINE_PREFILL_PV16(1)
#define PREFILL_SOFTMAX prefill_softmax16
/* prefill_softmax8 16 lanes wide: the same exp, so the same weights; their sum in another order. */
static float prefill_softmax16(float *sr, int64_t j0, int64_t j1) {
    int64_t full = j0 + (j1 - j0) / 16 * 16;
    __mmask16 tail = (__mmask16)((1u << (j1 - full)) - 1u);
    __m512 vm = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
    for (int64_t j = j0; j < full; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sr + j));
    __m512 last = _mm512_maskz_loadu_ps(tail, sr + full);
    vm = _mm512_mask_max_ps(vm, tail, vm, last);
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    for (int64_t j = j0; j < full; j += 16) {
        __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_storeu_ps(sr + j, e);
    }
    __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(_mm512_sub_ps(last, m)));
    _mm512_mask_storeu_ps(sr + full, tail, e);
    return _mm512_reduce_add_ps(_mm512_add_ps(vsum, e));
}
#pragma GCC pop_options
#else
#define PREFILL_SOFTMAX prefill_softmax8
#endif

/* One task: KV head h, query positions [p0, p1) (absolute). Rows are position-major, the group's query heads
 * within a position: row i * group + g. Score columns start at the task's first key tile, tile `t0` of `kt`. */
static NOINLINE void prefill_task_f32(const float *q, int64_t q_stride, const float *kt, const float *v_cache,
                                      const int64_t *kv_rows, int64_t context_len, int64_t first_key, int64_t p0,
                                      int64_t p1, int64_t h, int64_t group, int64_t dim, int64_t head_stride,
                                      float scale, int64_t window, float *out, int64_t out_stride) {
    int64_t npos = p1 - p0, nrows = npos * group;
    int64_t lo = window > 0 && p0 - window + 1 > first_key ? p0 - window + 1 : first_key; /* first key seen */
    int64_t t0 = (lo - first_key) / PREFILL_KTILE, t1 = (p1 - first_key + PREFILL_KTILE - 1) / PREFILL_KTILE;
    int64_t width = (t1 - t0) * PREFILL_KTILE, col0 = first_key + t0 * PREFILL_KTILE; /* column 0's position */
    const int64_t *rows = kv_rows + t0 * PREFILL_KTILE;
    const float *vc = v_cache + h * head_stride;
    float *qp = (float *)malloc(sizeof(float) * (nrows + 6) * dim); /* +6: room for the 6-row kernel's last rows */
    float *s = (float *)malloc(sizeof(float) * (nrows + 6) * width);
    float *acc = (float *)malloc(sizeof(float) * group * dim);
    int64_t *key_lo = (int64_t *)malloc(sizeof(int64_t) * npos); /* each position's first visible column */
    for (int64_t i = 0; i < npos; i++) {
        for (int64_t g = 0; g < group; g++)
            memcpy(qp + (i * group + g) * dim, q + (p0 + i - context_len) * q_stride + (h * group + g) * dim,
                   sizeof(float) * dim);
        int64_t first = window > 0 && p0 + i - window + 1 > lo ? p0 + i - window + 1 : lo;
        key_lo[i] = first - col0;
    }
    memset(qp + nrows * dim, 0, sizeof(float) * 6 * dim);
    /* scores, six rows at a time (three when fewer are left), over the tiles the rows see */
    for (int64_t r0 = 0; r0 < nrows;) {
        int mr = nrows - r0 >= 6 ? 6 : 3;
        int64_t last_pos = (r0 + mr - 1) / group < npos ? (r0 + mr - 1) / group : npos - 1;
        int64_t first_tile = key_lo[r0 / group] / PREFILL_KTILE;
        int64_t end_tile = (p0 + last_pos - col0) / PREFILL_KTILE + 1;
        for (int64_t t = first_tile; t < end_tile;) {
            const float *tile = kt + (t0 + t) * PREFILL_KTILE * dim;
            float *st = s + r0 * width + t * PREFILL_KTILE;
#if defined(KSANA_AVX512)
            int nt = end_tile - t >= 2 ? 2 : 1; /* two tiles a call where there are: 12 accumulators for 6 rows */
            if (mr == 6)
                (nt == 2 ? prefill_qk16_6_2 : prefill_qk16_6_1)(qp + r0 * dim, tile, dim, scale, st, width);
            else
                (nt == 2 ? prefill_qk16_3_2 : prefill_qk16_3_1)(qp + r0 * dim, tile, dim, scale, st, width);
            t += nt;
#else
            if (mr == 6)
                prefill_qk_6(qp + r0 * dim, tile, dim, scale, st, width);
            else
                prefill_qk_3(qp + r0 * dim, tile, dim, scale, st, width);
            t++;
#endif
        }
        r0 += mr;
    }
    /* per position: each row's softmax weights over its columns [j0, j1), then its heads' sums of values */
    for (int64_t i = 0; i < npos; i++) {
        int64_t j0 = key_lo[i], j1 = p0 + i - col0 + 1;
        float sums[group];
        for (int64_t g = 0; g < group; g++) sums[g] = PREFILL_SOFTMAX(s + (i * group + g) * width, j0, j1);
        for (int64_t g0 = 0; g0 < group; g0 += 3) { /* three heads at a time, the rest (group % 3) one by one */
            const float *p = s + (i * group + g0) * width;
            float *a = acc + g0 * dim;
            if (group - g0 >= 3) {
                int64_t d0 = 0;
#if defined(KSANA_AVX512)
                for (; d0 + 64 <= dim; d0 += 64) prefill_pv3_16_4(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                for (; d0 + 16 <= dim; d0 += 16) prefill_pv3_16_1(p, width, vc + d0, rows, j0, j1, a + d0, dim);
#endif
                for (; d0 + 32 <= dim; d0 += 32) prefill_pv3_4(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                for (; d0 < dim; d0 += 8) prefill_pv3_1(p, width, vc + d0, rows, j0, j1, a + d0, dim);
                continue;
            }
            for (int64_t b = 0; b < group - g0; b++)
                for (int64_t d = 0; d < dim; d++) {
                    float x = 0.f;
                    for (int64_t j = j0; j < j1; j++) x = fmaf(p[b * width + j], vc[rows[j] + d], x);
                    a[b * dim + d] = x;
                }
        }
        for (int64_t g = 0; g < group; g++) {
            float inv = 1.0f / sums[g];
            float *o = out + (p0 + i - context_len) * out_stride + (h * group + g) * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = acc[g * dim + d] * inv;
        }
    }
    free(qp);
    free(s);
    free(acc);
    free(key_lo);
}

void prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                           const int64_t *table, int64_t q_len, int64_t seq_len, int64_t nheads, int64_t nkv,
                           int64_t dim, int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale,
                           int64_t window, float *out, int nthreads) {
    int64_t context_len = seq_len - q_len, group = nheads / nkv;
    int64_t first_key = window > 0 && context_len - window + 1 > 0 ? context_len - window + 1 : 0;
    int64_t nk = seq_len - first_key, tiles = (nk + PREFILL_KTILE - 1) / PREFILL_KTILE;
    int64_t *kv_rows = (int64_t *)malloc(sizeof(int64_t) * tiles * PREFILL_KTILE);
    for (int64_t p = first_key; p < seq_len; p++)
        kv_rows[p - first_key] = table[p / block_size] * block_size * nkv * dim + p % block_size * slot_stride;
    /* every KV head's keys transposed once, tile by tile ([dim][16] each; the last tile's missing keys zero) */
    float *kt = (float *)malloc(sizeof(float) * nkv * tiles * PREFILL_KTILE * dim);
    int64_t blocks = (q_len + PREFILL_QBLOCK - 1) / PREFILL_QBLOCK, tasks = blocks * nkv;
    _Pragma("omp parallel num_threads(nthreads) if (tasks > 1)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t ht = 0; ht < nkv * tiles; ht++) {
            const float *kc = k_cache + ht / tiles * head_stride;
            float *tile = kt + ht * PREFILL_KTILE * dim;
            for (int64_t j = 0; j < PREFILL_KTILE; j++) {
                int64_t key = ht % tiles * PREFILL_KTILE + j;
                for (int64_t d = 0; d < dim; d++)
                    tile[d * PREFILL_KTILE + j] = key < nk ? kc[kv_rows[key] + d] : 0.f;
            }
        }
        /* the last positions (the most keys) first, so that the short tasks even out the threads at the end */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < tasks; task++) {
            int64_t block = blocks - 1 - task / nkv, p0 = context_len + block * PREFILL_QBLOCK, h = task % nkv;
            int64_t p1 = p0 + PREFILL_QBLOCK < seq_len ? p0 + PREFILL_QBLOCK : seq_len;
            prefill_task_f32(q, q_stride, kt + h * tiles * PREFILL_KTILE * dim, v_cache, kv_rows, context_len,
                             first_key, p0, p1, h, group, dim, head_stride, scale, window, out, nheads * dim);
        }
    }
    free(kt);
    free(kv_rows);
}
int prefill_attention_available(void) { return 1; }
#else
/* Without AVX2 this only exists so every build exports the same names; Python never calls it. */
void prefill_attention_f32(void) { abort(); }
int prefill_attention_available(void) { return 0; }
#endif

/* ---- Linear layers over packed weights: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) -------------------------------
 *
 * The weights are repacked once, at load, into panels of 16 output columns: panel p is a [K][16] block holding
 * w[16p .. 16p+15, k] at row k (zeros past N). Every k then gives one 16-wide vector of weights, and a tile of MR
 * input rows x NP panels keeps MR * NP float32 accumulators in registers, fed by a broadcast of x[m, k] per row:
 * no cross-lane sums, and each weight vector is loaded once for all the tile's rows. A weight panel is one
 * contiguous stream, which the tiles prefetch ahead (2 KiB into L1 and 8 KiB into L2: see DEFINE_PACKED_TILE).
 * Decode-sized inputs (up to 16 rows) run one tile of all rows per panel group, so the weights are read exactly
 * once; larger inputs (prefill) run tiles of 8 rows x 3 panels, the panels' K x 48 block staying in L2 while
 * every row tile passes over it. The input is transposed first into [K][stride] blocks (16 rows, or 8 per row
 * tile), widened to float32. Accumulation is float32 and each output is rounded once, as oneDNN's bfloat16 matmul
 * does. At decode sizes this streams the weights faster than BLAS over torch's layout, and keeps up with it at
 * prefill sizes (bench/kernel_ops.py).
 * The tiles above are AVX-512's (they need its 32 vector registers); AVX2 builds have tiles of their own over the
 * same panels (see DEFINE_PACKED_TILE_AVX2). `linear_available` tells Python; other CPUs keep torch's layout and
 * BLAS.
 */
/* From how many input rows the AVX-512 packed tiles prefetch their weight panels in software; below it they leave
 * the panels' streams to the hardware prefetchers. Python sets it per CPU (packed_prefetch_min_rows in
 * kernels/cpu/ops.py, with the measurements). Process-wide, like the library; the prefetches move no value, so
 * either setting gives the same bits. */
static int packed_prefetch_min_rows = 1;
int set_packed_prefetch_min_rows(int rows) { /* the previous setting */
    int previous = packed_prefetch_min_rows;
    packed_prefetch_min_rows = rows;
    return previous;
}

#if defined(KSANA_AVX512) || defined(KSANA_AVX2)
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#if defined(KSANA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#endif

#define PANEL 16                       /* output columns per packed panel */
#define DECODE_ROWS 16                 /* up to this many input rows run as one tile per panel group */
#define GEMM_MR 8                      /* input rows per tile above DECODE_ROWS */
#define ROW_TILE 8                     /* input rows per block of the packed input (see pack_row) */
#define GEMM_NP 3                      /* panels per tile above DECODE_ROWS */
#define PACKED_PREFETCH_L1 512         /* elements ahead in a panel's stream into L1 (2 KiB of float32)... */
#define PACKED_PREFETCH_L2 2048        /* ...and into L2 (8 KiB) */
#define LINEAR_PARALLEL_MIN (1 << 18)  /* M * N * K below this stays on the calling thread */

/* A thread's warming of the KV rows its first attention task of the layer reads, while the qkv projection before
 * it runs (decode_layers). At 16 rows the projection is bound by the FMAs and reads its weights at about half the
 * read ceiling, so the split tile (the 9-16-row decode tile) sends one prefetch of this list into L2 for every k
 * of its first half, a line for every two of weights; the attention then finds most of that task's keys and
 * values in L2 instead of memory (a task of 512 positions is 786 KiB of smollm2's float32 KV, within a 1 MiB L2).
 * Warming more (a line per k in both halves), or the next layer's tasks during the MLP (the lines then wait in L3
 * behind the MLP's weights and slow its matmuls more than the attention gains), costs more than it saves
 * (tools/decode_ab.py). The AVX2 tiles do not warm (KV_WARMS). */
#if defined(KSANA_AVX512)
#define KV_WARMS 1
#else
#define KV_WARMS 0
#endif
typedef struct {
    const char *at, *end;       /* the current block's next line and its end */
    const char *const *blocks;  /* the blocks still to warm, in the order the task reads them */
    int64_t left, block_bytes;
} kv_warm;
/* The calling thread's list while its qkv projection runs, else NULL: a thread-local, so the tiles' signatures
 * (and every other caller of the packed matmul) stay as they are. Initial-exec: one load, no __tls_get_addr. */
static __thread kv_warm *kv_warming __attribute__((tls_model("initial-exec")));
static inline void kv_warm_line(kv_warm *w) {
    if (w->at == w->end) {
        if (!w->left) return;
        w->at = *w->blocks++, w->left--;
        w->end = w->at + w->block_bytes;
    }
    _mm_prefetch(w->at, _MM_HINT_T1);
    w->at += 64;
}

/* Whether decode_layers can run an MLP's gate_up projection and SwiGLU as one pass (packed_swiglu_groups): up to
 * DECODE_ROWS rows (larger inputs take the wider groups of the gemm tiles) and gate and up in whole panels; the
 * pass adds no bias, so a layer with a gate_up bias keeps the two passes. */
static inline int swiglu_fusable(int64_t M, int64_t inter) { return M <= DECODE_ROWS && inter % PANEL == 0; }
/* The one pass's epilogue, for both builds' packed_swiglu_groups: each of a pair group's M rows in `block`
 * (gate's 16 columns, then up's) through the build's SwiGLU row, into columns [16 g, 16 g + 16) of down's packed
 * input (pack_row). */
#define DEFINE_SWIGLU_INTO_PACKED(SUF, T)                                                                        \
    static inline void swiglu_into_packed_##SUF(const T *block, int64_t M, int64_t g, int64_t inter, float *a) { \
        int64_t step = M <= ROW_TILE ? M : ROW_TILE;                                                             \
        T act[PANEL];                                                                                            \
        for (int64_t m = 0; m < M; m++) {                                                                        \
            SILU_AND_MUL_ROW(SUF)(block + m * 2 * PANEL, act, PANEL);                                            \
            pack_row_##SUF(act, inter, 0, PANEL, a + g * PANEL * step, M, m);                                    \
        }                                                                                                        \
    }

#if defined(KSANA_AVX512)
static inline __m512 w16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 w16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 w16m_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 w16m_bf16(const bf16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void st16m_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void st16m_bf16(bf16_t *p, __m512 v, __mmask16 m) { /* as f32_to_bf16, 16 lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

/* silu8's operations 16 lanes wide (exp16_nonpositive is exp_nonpositive's), so the same values lane for lane. */
static inline __m512 silu16(__m512 g) {
    __m512 t = exp16_nonpositive(_mm512_or_ps(_mm512_set1_ps(-0.0f), g)); /* e^-|g| */
    t = _mm512_mask_div_ps(t, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_set1_ps(1.0f), t);
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), t));
}

/* r[i] = [r0[i], ..., r7[i]]: eight columns of eight rows. */
#endif
static inline void transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* What packed_linear_greedy's panel groups found, per slice of 16 rows and group, the rows in the 16 lanes (see
 * greedy_block): slice s's group g at s * groups + g. */
typedef struct {
    int64_t groups, vocab;
    float *max, *sum;      /* the group's maximum logit; sum(exp(logit - that maximum)) over the group */
    int32_t *id, *nan_id;  /* the first column holding the maximum (-1: every logit -inf); the first NaN's (-1) */
} greedy_groups;

/* The calling thread's next run of panel groups [*g0, *g1) from the shared counter `next_group`: a thread's share
 * of what is left, down to one (why: see packed_groups); the run is empty when other threads took the last groups
 * first, and there is none (0) once no group is left. */
static inline int claim_groups(int64_t *next_group, int64_t groups, int64_t nthreads, int64_t *g0, int64_t *g1) {
    int64_t first = __atomic_load_n(next_group, __ATOMIC_RELAXED);
    if (first >= groups) return 0;
    int64_t chunk = (groups - first) / nthreads;
    chunk = chunk < 1 ? 1 : chunk;
    *g0 = __atomic_fetch_add(next_group, chunk, __ATOMIC_RELAXED);
    *g1 = *g0 + chunk < groups ? *g0 + chunk : groups;
    return 1;
}

#if defined(KSANA_AVX512)
/* r[i] = [r0[i], ..., r15[i]]: sixteen columns of sixteen rows (transpose8x8's two stages, then two across the
 * 128-bit lanes). */
static inline void transpose16x16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++)
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88), r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
}

/* The tiles' one epilogue: panel `p` of `rows` rows, row m's accumulator at acc[m * stride], plus the bias, stored
 * `ldo` apart (`mask`: the panel's columns). */
#define DEFINE_PANEL_STORE(SUF, T)                                                                               \
    static inline void store_panel_##SUF(T *out, int64_t ldo, const __m512 *acc, int64_t stride, int64_t rows,   \
                                         const T *bias, __mmask16 mask) {                                        \
        __m512 bv = bias ? load16m_##SUF(bias, mask) : _mm512_setzero_ps();                                      \
        for (int64_t m = 0; m < rows; m++) st16m_##SUF(out + m * ldo, _mm512_add_ps(acc[m * stride], bv), mask); \
    }
DEFINE_PANEL_STORE(f32, float)
DEFINE_PANEL_STORE(bf16, bf16_t)

/* MR input rows (float32 as pack_row lays them out: a[k * MR + m] up to 8 rows, else a[m / 8][k][m % 8], 8 being
 * ROW_TILE) x NP panels (`panel_len` = K * 16 apart); stores `rows` rows and, in the last panel, `last_mask`'s
 * columns. `prefetch`: fetch each panel's stream ahead, PACKED_PREFETCH_L1 elements into L1 and
 * PACKED_PREFETCH_L2 into L2. Against one T0 prefetch 4 KiB ahead, the two streamed a 512 MiB weight 0-3% faster
 * at 1 row, 5-9% at 2-8 rows and 2-5% at 16 (after a T1 alone, 8 KiB ahead, had: 2-4% faster from 8 rows, slower
 * at 2-4), and the same at 32-64 rows (gemm tiles). */
#define DEFINE_PACKED_TILE(SUF, T, MR, NP)                                                                       \
    static void packed_tile_##SUF##_##MR##_##NP(const float *a, const T *w, int64_t panel_len, int64_t K,        \
                                                const T *bias, T *out, int64_t ldo, int rows,                    \
                                                __mmask16 last_mask, int prefetch) {                             \
        __m512 acc[MR][NP];                                                                                      \
        _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++)                                                    \
            _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) acc[m][p] = _mm512_setzero_ps();                \
        const int fetch = prefetch && MR >= packed_prefetch_min_rows;                                            \
        for (int64_t k = 0; k < K; k++) {                                                                        \
            __m512 b[NP];                                                                                        \
            _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) {                                               \
                const T *wk = w + p * panel_len + k * PANEL;                                                     \
                b[p] = w16_##SUF(wk);                                                                            \
                if (fetch) {                                                                                     \
                    _mm_prefetch((const char *)(wk + PACKED_PREFETCH_L1), _MM_HINT_T0);                          \
                    _mm_prefetch((const char *)(wk + PACKED_PREFETCH_L2), _MM_HINT_T1);                          \
                }                                                                                                \
            }                                                                                                    \
            _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                              \
                __m512 x = _mm512_set1_ps(a[MR > 8 ? m / 8 * 8 * K + k * 8 + m % 8 : k * MR + m]);               \
                _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++)                                             \
                    acc[m][p] = _mm512_fmadd_ps(x, b[p], acc[m][p]);                                             \
            }                                                                                                    \
        }                                                                                                        \
        for (int p = 0; p < NP; p++)                                                                             \
            store_panel_##SUF(out + p * PANEL, ldo, &acc[0][p], NP, rows, bias ? bias + p * PANEL : NULL,        \
                              p == NP - 1 ? last_mask : (__mmask16)0xffff);                                      \
    }

/* 9-16 input rows (MR) x 2 panels in two halves of rows, 8 and MR - 8, one SPLIT_KC-long block of k at a time:
 * each half's 16 accumulators come from (and go back to) the stack between blocks, while the block's 2 KiB of
 * weights stay in L1 for the second half. Per k that is 2 weight loads and 8 broadcasts for 16 FMAs, where the
 * one-panel tile needs 17 loads for 16, so the weights stream faster (tools/decode_ab.py). Each half prefetches one
 * panel's stream, so the requests go out evenly over the block. Every output is the same sum in the same order
 * (one FMA per k, then the bias) as the one-panel tile's, so both give the same bits. */
#define SPLIT_KC 16
#define DEFINE_PACKED_SPLIT_TILE(SUF, T, MR)                                                                     \
    static void packed_split_tile_##SUF##_##MR(const float *a, const T *w, int64_t panel_len, int64_t K,         \
                                               const T *bias, T *out, int64_t ldo, int rows,                     \
                                               __mmask16 last_mask, int prefetch) {                              \
        (void)prefetch;                                                                                          \
        kv_warm *warming = kv_warming; /* see kv_warm */                                                         \
        __m512 saved[2][ROW_TILE][2];                                                                            \
        /* past its panel's end, each half's prefetch goes on in the next group's same panel: two panels on     \
         * (adjacent panels) or one (a pair tile's panels are far apart) */                                      \
        const int64_t run = K * PANEL, jump = panel_len == run ? panel_len : 0;                                  \
        for (int64_t k0 = 0; k0 < K; k0 += SPLIT_KC) {                                                           \
            int64_t k1 = k0 + SPLIT_KC < K ? k0 + SPLIT_KC : K;                                                  \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                                \
                const int hr = h ? MR - ROW_TILE : ROW_TILE; /* this half's rows */                              \
                const float *ah = a + h * ROW_TILE * K;                                                          \
                const T *ws = w + h * panel_len; /* the panel this half prefetches */                            \
                __m512 acc0[ROW_TILE], acc1[ROW_TILE];                                                           \
                _Pragma("GCC unroll 8") for (int m = 0; m < ROW_TILE; m++) {                                     \
                    acc0[m] = k0 && m < hr ? saved[h][m][0] : _mm512_setzero_ps();                               \
                    acc1[m] = k0 && m < hr ? saved[h][m][1] : _mm512_setzero_ps();                               \
                }                                                                                                \
                for (int64_t k = k0; k < k1; k++) {                                                              \
                    __m512 b0 = w16_##SUF(w + k * PANEL), b1 = w16_##SUF(w + panel_len + k * PANEL);             \
                    int64_t f1 = k * PANEL + PACKED_PREFETCH_L1, f2 = k * PANEL + PACKED_PREFETCH_L2;            \
                    _mm_prefetch((const char *)(ws + (f1 < run ? f1 : f1 + jump)), _MM_HINT_T0);                 \
                    _mm_prefetch((const char *)(ws + (f2 < run ? f2 : f2 + jump)), _MM_HINT_T1);                 \
                    if (h == 0 && warming) kv_warm_line(warming);                                                \
                    _Pragma("GCC unroll 8") for (int m = 0; m < ROW_TILE; m++) {                                 \
                        if (m >= hr) break;                                                                      \
                        __m512 x = _mm512_set1_ps(ah[k * ROW_TILE + m]);                                         \
                        acc0[m] = _mm512_fmadd_ps(x, b0, acc0[m]);                                               \
                        acc1[m] = _mm512_fmadd_ps(x, b1, acc1[m]);                                               \
                    }                                                                                            \
                }                                                                                                \
                _Pragma("GCC unroll 8") for (int m = 0; m < hr; m++) {                                           \
                    saved[h][m][0] = acc0[m], saved[h][m][1] = acc1[m];                                          \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int p = 0; p < 2; p++)                                                                              \
            store_panel_##SUF(out + p * PANEL, ldo, &saved[0][0][p], 2, rows, bias ? bias + p * PANEL : NULL,    \
                              p ? last_mask : (__mmask16)0xffff);                                                \
    }

/* 17-64 input rows (SWEEP_TILES row tiles of 8 at most) x GEMM_NP panels: every row tile over one block of
 * SPLIT_KC k while the block's 3 KiB of weights are in L1, then the next block, each tile's 24 accumulators kept
 * on the stack between blocks. The gemm tiles (what larger inputs take) run each row tile over the whole K
 * instead, so only the first streams weights from memory and the others compute from L2 while the memory idles;
 * here the first three tiles each prefetch one panel's stream, spread over every block. Same sums in the same
 * order as the gemm tile's: the same bits. float32 only: a bfloat16 weight is half the bytes and its widening more
 * arithmetic, so there the step is FLOP-bound and the accumulators' trips to the stack cost more than the stream
 * gains (tools/decode_ab.py at batches 32-64). */
#define SWEEP_TILES 8
#define SWEEPS(T) (sizeof(T) == sizeof(float))
#define DEFINE_PACKED_SWEEP(SUF, T)                                                                              \
    static void packed_sweep_##SUF(const float *a, const T *w, int64_t panel_len, int64_t K, const T *bias,      \
                                   T *out, int64_t ldo, int64_t M, __mmask16 last_mask) {                        \
        int64_t tiles = (M + GEMM_MR - 1) / GEMM_MR;                                                             \
        __m512 saved[SWEEP_TILES][GEMM_MR][GEMM_NP];                                                             \
        for (int64_t k0 = 0; k0 < K; k0 += SPLIT_KC) {                                                           \
            int64_t k1 = k0 + SPLIT_KC < K ? k0 + SPLIT_KC : K;                                                  \
            for (int64_t t = 0; t < tiles; t++) {                                                                \
                const float *at = a + t * GEMM_MR * K;                                                           \
                const T *ws = w + (t < GEMM_NP ? t : 0) * panel_len; /* the panel this tile prefetches */        \
                __m512 acc[GEMM_MR][GEMM_NP];                                                                    \
                _Pragma("GCC unroll 8") for (int m = 0; m < GEMM_MR; m++)                                        \
                    _Pragma("GCC unroll 3") for (int p = 0; p < GEMM_NP; p++)                                    \
                        acc[m][p] = k0 ? saved[t][m][p] : _mm512_setzero_ps();                                   \
                for (int64_t k = k0; k < k1; k++) {                                                              \
                    __m512 b[GEMM_NP];                                                                           \
                    _Pragma("GCC unroll 3") for (int p = 0; p < GEMM_NP; p++)                                    \
                        b[p] = w16_##SUF(w + p * panel_len + k * PANEL);                                         \
                    if (t < GEMM_NP) {                                                                           \
                        _mm_prefetch((const char *)(ws + k * PANEL + PACKED_PREFETCH_L1), _MM_HINT_T0);          \
                        _mm_prefetch((const char *)(ws + k * PANEL + PACKED_PREFETCH_L2), _MM_HINT_T1);          \
                    }                                                                                            \
                    _Pragma("GCC unroll 8") for (int m = 0; m < GEMM_MR; m++) {                                  \
                        __m512 x = _mm512_set1_ps(at[k * GEMM_MR + m]);                                          \
                        _Pragma("GCC unroll 3") for (int p = 0; p < GEMM_NP; p++)                                \
                            acc[m][p] = _mm512_fmadd_ps(x, b[p], acc[m][p]);                                     \
                    }                                                                                            \
                }                                                                                                \
                _Pragma("GCC unroll 8") for (int m = 0; m < GEMM_MR; m++)                                        \
                    _Pragma("GCC unroll 3") for (int p = 0; p < GEMM_NP; p++) saved[t][m][p] = acc[m][p];        \
            }                                                                                                    \
        }                                                                                                        \
        for (int p = 0; p < GEMM_NP; p++)                                                                        \
            store_panel_##SUF(out + p * PANEL, ldo, &saved[0][0][p], GEMM_NP, M, bias ? bias + p * PANEL : NULL, \
                              p == GEMM_NP - 1 ? last_mask : (__mmask16)0xffff);                                 \
    }

/* Decode tiles: every row count up to 16 over the panels panels_of_decode_tile gives it (the split tile above 8
 * rows), and one panel (for the last panels of a layer) at every row count. */
#define DEFINE_PACKED_TILES(SUF, T)                                                                              \
    DEFINE_PACKED_TILE(SUF, T, 1, 1) DEFINE_PACKED_TILE(SUF, T, 2, 1) DEFINE_PACKED_TILE(SUF, T, 3, 1)           \
    DEFINE_PACKED_TILE(SUF, T, 4, 1) DEFINE_PACKED_TILE(SUF, T, 5, 1) DEFINE_PACKED_TILE(SUF, T, 6, 1)           \
    DEFINE_PACKED_TILE(SUF, T, 7, 1) DEFINE_PACKED_TILE(SUF, T, 8, 1) DEFINE_PACKED_TILE(SUF, T, 9, 1)           \
    DEFINE_PACKED_TILE(SUF, T, 10, 1) DEFINE_PACKED_TILE(SUF, T, 11, 1) DEFINE_PACKED_TILE(SUF, T, 12, 1)        \
    DEFINE_PACKED_TILE(SUF, T, 13, 1) DEFINE_PACKED_TILE(SUF, T, 14, 1) DEFINE_PACKED_TILE(SUF, T, 15, 1)        \
    DEFINE_PACKED_TILE(SUF, T, 16, 1)                                                                            \
    DEFINE_PACKED_TILE(SUF, T, 1, 4) DEFINE_PACKED_TILE(SUF, T, 2, 4) DEFINE_PACKED_TILE(SUF, T, 3, 4)           \
    DEFINE_PACKED_TILE(SUF, T, 1, 2) DEFINE_PACKED_TILE(SUF, T, 2, 2) DEFINE_PACKED_TILE(SUF, T, 3, 2)           \
    DEFINE_PACKED_TILE(SUF, T, 4, 2) DEFINE_PACKED_TILE(SUF, T, 5, 2) DEFINE_PACKED_TILE(SUF, T, 6, 2)           \
    DEFINE_PACKED_TILE(SUF, T, 7, 2)                                                                             \
    DEFINE_PACKED_TILE(SUF, T, 8, 2) DEFINE_PACKED_TILE(SUF, T, 8, 3)                                            \
    DEFINE_PACKED_SPLIT_TILE(SUF, T, 9) DEFINE_PACKED_SPLIT_TILE(SUF, T, 10)                                     \
    DEFINE_PACKED_SPLIT_TILE(SUF, T, 11) DEFINE_PACKED_SPLIT_TILE(SUF, T, 12)                                    \
    DEFINE_PACKED_SPLIT_TILE(SUF, T, 13) DEFINE_PACKED_SPLIT_TILE(SUF, T, 14)                                    \
    DEFINE_PACKED_SPLIT_TILE(SUF, T, 15) DEFINE_PACKED_SPLIT_TILE(SUF, T, 16)                                    \
    DEFINE_PACKED_SWEEP(SUF, T)                                                                                  \
    typedef void (*packed_tile_##SUF##_fn)(const float *, const T *, int64_t, int64_t, const T *, T *,           \
                                           int64_t, int, __mmask16, int);                                        \
    /* [rows][0]: one panel; [rows][1]: the wide tile (panels_of_decode_tile) */                                 \
    static const packed_tile_##SUF##_fn packed_decode_tiles_##SUF[DECODE_ROWS + 1][2] = {                        \
        {NULL, NULL},                                                                                            \
        {packed_tile_##SUF##_1_1, packed_tile_##SUF##_1_4}, {packed_tile_##SUF##_2_1, packed_tile_##SUF##_2_4},  \
        {packed_tile_##SUF##_3_1, packed_tile_##SUF##_3_4}, {packed_tile_##SUF##_4_1, packed_tile_##SUF##_4_2},  \
        {packed_tile_##SUF##_5_1, packed_tile_##SUF##_5_2}, {packed_tile_##SUF##_6_1, packed_tile_##SUF##_6_2},  \
        {packed_tile_##SUF##_7_1, packed_tile_##SUF##_7_2}, {packed_tile_##SUF##_8_1, packed_tile_##SUF##_8_2},  \
        {packed_tile_##SUF##_9_1, packed_split_tile_##SUF##_9},                                                  \
        {packed_tile_##SUF##_10_1, packed_split_tile_##SUF##_10},                                                \
        {packed_tile_##SUF##_11_1, packed_split_tile_##SUF##_11},                                                \
        {packed_tile_##SUF##_12_1, packed_split_tile_##SUF##_12},                                                \
        {packed_tile_##SUF##_13_1, packed_split_tile_##SUF##_13},                                                \
        {packed_tile_##SUF##_14_1, packed_split_tile_##SUF##_14},                                                \
        {packed_tile_##SUF##_15_1, packed_split_tile_##SUF##_15},                                                \
        {packed_tile_##SUF##_16_1, packed_split_tile_##SUF##_16},                                                \
    };                                                                                                           \
    static const packed_tile_##SUF##_fn packed_gemm_tiles_##SUF[GEMM_NP + 1] = {                                 \
        NULL, packed_tile_##SUF##_8_1, packed_tile_##SUF##_8_2, packed_tile_##SUF##_8_3};                        \
    /* two panels at every decode row count (packed_swiglu_groups) */                                            \
    static const packed_tile_##SUF##_fn packed_pair_tiles_##SUF[DECODE_ROWS + 1] = {                             \
        NULL, packed_tile_##SUF##_1_2, packed_tile_##SUF##_2_2, packed_tile_##SUF##_3_2,                         \
        packed_tile_##SUF##_4_2, packed_tile_##SUF##_5_2, packed_tile_##SUF##_6_2, packed_tile_##SUF##_7_2,      \
        packed_tile_##SUF##_8_2, packed_split_tile_##SUF##_9, packed_split_tile_##SUF##_10,                      \
        packed_split_tile_##SUF##_11, packed_split_tile_##SUF##_12, packed_split_tile_##SUF##_13,                \
        packed_split_tile_##SUF##_14, packed_split_tile_##SUF##_15, packed_split_tile_##SUF##_16};

/* 1-3 rows: four panels, for 4-12 accumulators in flight; 4-8 rows: two (at 8 rows, 2 weight loads and 8
 * broadcasts for 16 FMAs); 9-16: the split tile's two. */
static inline int panels_of_decode_tile(int64_t rows) { return rows >= 4 ? 2 : 4; }
/* Panels per group of packed_groups: the decode tile's up to DECODE_ROWS rows, the gemm tiles' above. */
static inline int panels_per_group(int64_t rows) {
    return rows <= DECODE_ROWS ? panels_of_decode_tile(rows) : GEMM_NP;
}


/* Each row's token and log-probability from its groups, in group order, as greedy_logprobs would give them: the
 * first NaN wins (logprob NaN); else the first group holding the maximum m gives the token, and its log_softmax
 * is -log(sum over groups of sum_g * e^(max_g - m)) (NaN where m is infinite). `slice`'s rows, 16 at most. */
static void greedy_combine(const greedy_groups *greedy, int64_t slice, int64_t rows, int64_t *ids,
                           float *logprobs) {
    const int64_t base = slice * greedy->groups;
    __m512 m = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    __m512i id = _mm512_set1_epi32(-1), nan_id = id;
    __mmask16 nan = 0;
    for (int64_t g = 0; g < greedy->groups; g++) {
        __m512i group_nan = _mm512_loadu_si512(greedy->nan_id + 16 * (base + g));
        __mmask16 first_nan = _mm512_cmpneq_epi32_mask(group_nan, _mm512_set1_epi32(-1)) & ~nan;
        nan_id = _mm512_mask_mov_epi32(nan_id, first_nan, group_nan), nan |= first_nan;
        __m512 group_max = _mm512_loadu_ps(greedy->max + 16 * (base + g));
        __mmask16 above = _mm512_cmp_ps_mask(group_max, m, _CMP_GT_OQ);
        m = _mm512_mask_mov_ps(m, above, group_max);
        id = _mm512_mask_mov_epi32(id, above, _mm512_loadu_si512(greedy->id + 16 * (base + g)));
    }
    for (int64_t g = 0; g < greedy->groups; g++) {
        __m512 group_max = _mm512_loadu_ps(greedy->max + 16 * (base + g));
        __mmask16 some = _mm512_cmp_ps_mask(group_max, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
        __m512 scale = exp16_nonpositive(_mm512_sub_ps(group_max, m));
        total = _mm512_mask3_fmadd_ps(_mm512_loadu_ps(greedy->sum + 16 * (base + g)), scale, total, some);
    }
    float lane_max[16], lane_total[16];
    int32_t lane_id[16], lane_nan[16];
    _mm512_storeu_ps(lane_max, m), _mm512_storeu_ps(lane_total, total);
    _mm512_storeu_si512(lane_id, id), _mm512_storeu_si512(lane_nan, nan_id);
    for (int64_t r = 0; r < rows; r++) {
        if (nan >> r & 1) {
            ids[r] = lane_nan[r], logprobs[r] = NAN;
            continue;
        }
        ids[r] = lane_id[r] < 0 ? 0 : lane_id[r];
        logprobs[r] = isfinite(lane_max[r]) ? -logf(lane_total[r]) : NAN;
    }
}

#define DEFINE_PACKED_GROUPS(SUF, T)                                                                             \
    DEFINE_PACKED_TILES(SUF, T)                                                                                  \
    /* silu_and_mul_row 16 lanes at a time: silu16, the same rounding and stores, so the same values; the tail   \
     * goes as silu_and_mul_row's does (8 lanes of the same math, then expf one by one). */                      \
    static void silu_and_mul_row16_##SUF(const T *g, T *o, int64_t d) {                                          \
        const T *u = g + d;                                                                                      \
        int64_t j = 0;                                                                                           \
        for (; j + 8 <= d; j += j + 16 <= d ? 16 : 8) {                                                          \
            __mmask16 m = j + 16 <= d ? (__mmask16)0xffff : (__mmask16)0x00ff;                                   \
            __m512 s = round16_##SUF(silu16(load16m_##SUF(g + j, m)));                                           \
            st16m_##SUF(o + j, _mm512_mul_ps(s, load16m_##SUF(u + j, m)), m);                                    \
        }                                                                                                        \
        silu_and_mul_tail_##SUF(g, o, j, d);                                                                     \
    }                                                                                                            \
                                                                                                                 \
    /* Greedy decoding's part of one panel group of the lm_head: for each of up to 16 rows, the group's maximum  \
     * over columns [col0, col0 + width) of `block` (rows `ld` apart), the first column holding it, the first     \
     * NaN's column, and sum(exp(x - the group's maximum)), into `greedy` at `index` (see greedy_groups). The     \
     * rows go in the lanes: 16 columns at a time are transposed, so every step is one vector op for all rows.   \
     * Columns are taken in order, so the first maximum and the first NaN are the first ones. */                 \
    static void greedy_block_##SUF(const T *block, int64_t ld, int rows, int64_t col0, int64_t width,           \
                                   greedy_groups *greedy, int64_t index) {                                       \
        __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();                                         \
        __m512i id = _mm512_set1_epi32(-1), nan_id = id;                                                         \
        __mmask16 nan = 0;                                                                                       \
        for (int64_t c0 = 0; c0 < width; c0 += PANEL) {                                                          \
            int cols = width - c0 < PANEL ? (int)(width - c0) : PANEL;                                           \
            __m512 col[16];                                                                                      \
            for (int r = 0; r < 16; r++)                                                                         \
                col[r] = r < rows ? load16_##SUF(block + r * ld + c0) : _mm512_setzero_ps();                     \
            transpose16x16(col);                                                                                 \
            __m512 before = m;                                                                                   \
            for (int c = 0; c < cols; c++) {                                                                     \
                __mmask16 first_nan = _mm512_cmp_ps_mask(col[c], col[c], _CMP_UNORD_Q) & ~nan;                   \
                nan_id = _mm512_mask_mov_epi32(nan_id, first_nan, _mm512_set1_epi32((int)(col0 + c0 + c)));      \
                nan |= first_nan;                                                                                \
                __mmask16 above = _mm512_cmp_ps_mask(col[c], m, _CMP_GT_OQ);                                     \
                m = _mm512_mask_mov_ps(m, above, col[c]);                                                        \
                id = _mm512_mask_mov_epi32(id, above, _mm512_set1_epi32((int)(col0 + c0 + c)));                  \
            }                                                                                                    \
            /* rescale what the earlier columns summed to the new maximum (rows with one above -inf only) */     \
            __mmask16 some = _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);                       \
            __mmask16 had = _mm512_cmp_ps_mask(before, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);                   \
            sum = _mm512_mask_mul_ps(sum, had, sum, exp16_nonpositive(_mm512_sub_ps(before, m)));                \
            for (int c = 0; c < cols; c++)                                                                       \
                sum = _mm512_mask_add_ps(sum, some, sum, exp16_nonpositive(_mm512_sub_ps(col[c], m)));           \
        }                                                                                                        \
        _mm512_storeu_ps(greedy->max + 16 * index, m), _mm512_storeu_ps(greedy->sum + 16 * index, sum);          \
        _mm512_storeu_si512(greedy->id + 16 * index, id);                                                        \
        _mm512_storeu_si512(greedy->nan_id + 16 * index, nan_id);                                                \
    }                                                                                                            \
                                                                                                                 \
    /* The matmul over packed input `a` (pack_row's layout, whole tiles) for the calling thread, which takes     \
     * panel groups from the shared counter `next_group` (0 at the start) until none is left.                    \
     * Panel groups are handed out in chunks of a thread's share of what is left, down to one: a thread the OS   \
     * preempts (the event loop of a server shares these cores) leaves the rest to the others, the last chunks   \
     * are small so the threads reach the barrier together, and the early ones are long contiguous streams (each \
     * new chunk restarts the stream; fixed or smaller shares are slower, tools/decode_ab.py). A preempted thread\
     * holds up to half the work of the first chunks, which saturated serving does not feel                      \
     * (bench/serving_vs_offline.py). */                                                                         \
    static void packed_groups_##SUF(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N,     \
                                    int64_t K, int64_t *next_group, int64_t nthreads, greedy_groups *greedy) {   \
        int64_t panels = (N + PANEL - 1) / PANEL, panel_len = K * PANEL;                                         \
        __mmask16 last_mask = (__mmask16)(N % PANEL ? (1u << (N % PANEL)) - 1u : 0xffffu);                       \
        int decode = M <= DECODE_ROWS;                                                                           \
        int64_t row_tiles = decode ? 1 : (M + GEMM_MR - 1) / GEMM_MR;                                            \
        int np = panels_per_group(M);                                                                            \
        int64_t groups = (panels + np - 1) / np;                                                                 \
        /* greedy: a panel group's logits, rows ld apart (on the stack for a decode tile) */                     \
        T small[DECODE_ROWS * 4 * PANEL];                                                                        \
        T *block = greedy && !decode ? (T *)malloc(sizeof(T) * M * np * PANEL) : small;                          \
        int64_t ld = greedy ? np * PANEL : N;                                                                    \
        for (int64_t g0, g1; claim_groups(next_group, groups, nthreads, &g0, &g1);) {                            \
            for (int64_t g = g0; g < g1; g++) {                                                                  \
                int64_t p0 = g * np;                                                                             \
                int gp = panels - p0 < np ? (int)(panels - p0) : np; /* panels in this group */                  \
                __mmask16 mask = p0 + gp == panels ? last_mask : (__mmask16)0xffff;                              \
                const T *wg = w + p0 * panel_len;                                                                \
                const T *bg = bias ? bias + p0 * PANEL : NULL;                                                   \
                T *o = greedy ? block : out + p0 * PANEL;                                                        \
                if (decode && gp == np) {                                                                        \
                    packed_decode_tiles_##SUF[M][1](a, wg, panel_len, K, bg, o, ld, (int)M, mask, 1);            \
                } else if (decode) {                                                                             \
                    for (int i = 0; i < gp; i++)                                                                 \
                        packed_decode_tiles_##SUF[M][0](a, wg + i * panel_len, panel_len, K,                     \
                                                         bg ? bg + i * PANEL : NULL, o + i * PANEL, ld, (int)M,  \
                                                         i == gp - 1 ? mask : 0xffff, 1);                        \
                } else if (SWEEPS(T) && row_tiles <= SWEEP_TILES && gp == GEMM_NP) {                             \
                    packed_sweep_##SUF(a, wg, panel_len, K, bg, o, ld, M, mask);                                 \
                } else {                                                                                         \
                    for (int64_t t = 0; t < row_tiles; t++) {                                                    \
                        int rows = M - t * GEMM_MR < GEMM_MR ? (int)(M - t * GEMM_MR) : GEMM_MR;                 \
                        packed_gemm_tiles_##SUF[gp](a + t * GEMM_MR * K, wg, panel_len, K, bg,                   \
                                                    o + t * GEMM_MR * ld, ld, rows, mask, t == 0);               \
                    }                                                                                            \
                }                                                                                                \
                if (greedy) {                                                                                    \
                    int64_t width = greedy->vocab - p0 * PANEL < gp * PANEL ? greedy->vocab - p0 * PANEL         \
                                                                            : gp * PANEL;                        \
                    for (int64_t r0 = 0; r0 < M; r0 += 16)                                                       \
                        greedy_block_##SUF(block + r0 * ld, ld, M - r0 < 16 ? (int)(M - r0) : 16, p0 * PANEL,    \
                                           width, greedy, r0 / 16 * groups + g);                                 \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        if (block != small) free(block);                                                                         \
    }                                                                                                            \
    /* gate_up and SwiGLU in one pass, for decode_layers (see swiglu_fusable): a group is gate panel g and up    \
     * panel g + inter / 16, which the two-panel tile takes as two panels inter / 16 panels apart, into a block  \
     * on the stack; then the SwiGLU of each of the block's rows straight into down's packed input `a_out`       \
     * (swiglu_into_packed). The same values as the matmul, the SiLU pass and the packing, without the           \
     * [M, 2 * inter] output, the SiLU phase or its barrier (tools/decode_ab.py, same bits). */                  \
    DEFINE_SWIGLU_INTO_PACKED(SUF, T)                                                                            \
    static void packed_swiglu_groups_##SUF(const float *a, const T *w, int64_t M, int64_t inter, int64_t K,      \
                                           int64_t *next_group, int64_t nthreads, float *a_out) {                \
        int64_t half = inter / PANEL, panel_len = K * PANEL;                                                     \
        T block[DECODE_ROWS * 2 * PANEL];                                                                        \
        for (int64_t g0, g1; claim_groups(next_group, half, nthreads, &g0, &g1);) {                              \
            for (int64_t g = g0; g < g1; g++) {                                                                  \
                packed_pair_tiles_##SUF[M](a, w + g * panel_len, half * panel_len, K, NULL, block, 2 * PANEL,    \
                                           (int)M, (__mmask16)0xffff, 1);                                        \
                swiglu_into_packed_##SUF(block, M, g, inter, a_out);                                             \
            }                                                                                                    \
        }                                                                                                        \
    }

#define DEFINE_PACKED_GREEDY(SUF, T)                                                                             \
    /* Greedy decoding straight from the lm_head, without the [M, N] logits: each row's first maximum over its   \
     * first `vocab` logits (the first NaN if there is one) and log_softmax there, as greedy_logprobs gives them \
     * from the logits packed_linear writes (bf16 logits rounded as it stores them). Each panel group keeps its  \
     * own maximum and sum of exponentials, 16 rows at a time, while its logits are in L1; they are combined in  \
     * group order, so the result does not depend on which thread ran which group. */                           \
    void packed_linear_greedy_##SUF(const T *x, int64_t x_stride, const T *w, int64_t M, int64_t N, int64_t K,   \
                                    int64_t vocab, int64_t *ids, float *logprobs, int nthreads) {                \
        int64_t groups = ((N + PANEL - 1) / PANEL + panels_per_group(M) - 1) / panels_per_group(M);              \
        int64_t slices = (M + 15) / 16, n = 16 * groups * slices;                                                \
        greedy_groups greedy = {.groups = groups, .vocab = vocab < N ? vocab : N};                               \
        greedy.max = (float *)malloc(sizeof(float) * 2 * n);                                                     \
        greedy.sum = greedy.max + n;                                                                             \
        greedy.id = (int32_t *)malloc(sizeof(int32_t) * 2 * n);                                                  \
        greedy.nan_id = greedy.id + n;                                                                           \
        packed_matmul_##SUF(x, x_stride, w, NULL, NULL, M, N, K, nthreads, &greedy);                             \
        for (int64_t s = 0; s < slices; s++)                                                                     \
            greedy_combine(&greedy, s, M - 16 * s < 16 ? M - 16 * s : 16, ids + 16 * s, logprobs + 16 * s);      \
        free(greedy.max);                                                                                        \
        free(greedy.id);                                                                                         \
    }

#define SILU_AND_MUL_ROW(SUF) silu_and_mul_row16_##SUF
#else
/* The packed linear in AVX2 (16 vector registers of 8 lanes): a tile is MR <= 3 input rows x NP panels, each
 * panel two 8-lane halves, so at most 12 accumulators (3 x 2 and 2 x 3 panels, 1 x 4), plus the rows' broadcasts
 * and one weight vector. Each k is one 64-byte line of every panel, as in the AVX-512 tiles, and the output's
 * summation order is the same (one FMA per k, then the bias): both builds give the same bits. A decode step's
 * rows (and prefill's, across row tiles: avx2_row_chunks) go in chunks of up to 3 rows over each panel group, a
 * block of k at a time (see packed_groups). It streams the weights faster than BLAS over torch's layout at decode
 * sizes (bench/kernel_ops.py). */
#define AVX2_MR 3       /* input rows per tile */
/* Values of k per pass of the row chunks over a panel group (see packed_groups): with one chunk (up to 3 rows) it
 * only sets how often the partial sums are saved; 4-8 rows 32 (4 KiB of a panel group's float32 in L1), 9-16 rows
 * 64, more 128, each the fastest block for its rows over smollm2's projections (tools/decode_ab.py). */
static inline int64_t avx2_kblock(int64_t M) {
    return M < 4 ? 128 : M <= ROW_TILE ? 32 : M <= DECODE_ROWS ? 64 : 128;
}
static inline __m256 w8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 w8_bf16(const bf16_t *p) { return load8_bf16(p); }
/* Columns [0, cols) of one output row of a panel from its two halves plus the bias (`cols` values), rounded once
 * per value. */
static inline void st_panel_f32(float *o, __m256 lo, __m256 hi, const float *bias, int cols) {
    if (cols == PANEL) {
        if (bias) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(o, lo), _mm256_storeu_ps(o + 8, hi);
        return;
    }
    float v[PANEL];
    _mm256_storeu_ps(v, lo), _mm256_storeu_ps(v + 8, hi);
    for (int j = 0; j < cols; j++) o[j] = bias ? v[j] + bias[j] : v[j];
}
static inline void st_panel_bf16(bf16_t *o, __m256 lo, __m256 hi, const bf16_t *bias, int cols) {
    float v[PANEL];
    _mm256_storeu_ps(v, lo), _mm256_storeu_ps(v + 8, hi);
    for (int j = 0; j < cols; j++) o[j] = f32_to_bf16(bias ? v[j] + bf16_to_f32(bias[j]) : v[j]);
}

/* MR rows of the packed input x NP panels (`panel_len` apart), over k in [k0, k1): the accumulators start at zero
 * (k0 = 0) or from `part`, and end in `part` or, at k1 = K, in the output (MR rows, the last panel's first
 * `last_cols` columns, plus the bias). A tile does not prefetch its own panels, unlike the AVX-512 tiles: on AMD
 * CPUs with AVX2 only the hardware prefetchers stream them alone, and the AVX-512 tiles' prefetches there cost
 * time, most at few rows. With PF it prefetches
 * lines of the block the thread streams next instead: line (k - k0) * pf_step / 2^16 of `pf` at each k, so a share
 * of them goes evenly over its k (see packed_groups). Row m's k-th value is at a[k * a_step + m], or with ROWS
 * (chunks across the input's row tiles, see avx2_row_chunks) at a[m][k * a_step]. */
#define TILE_INPUT_0 const float *
#define TILE_INPUT_1 const float *const *
#define TILE_ROW_0(a, m) ((a) + (m))
#define TILE_ROW_1(a, m) ((a)[m])
#define DEFINE_PACKED_TILE_AVX2(SUF, T, MR, NP, PF, ROWS)                                                        \
    static void packed_tile_##SUF##_##MR##_##NP##_##PF##ROWS(TILE_INPUT_##ROWS a, int64_t a_step, const T *w,    \
                                                       int64_t panel_len, int64_t k0, int64_t k1, int64_t K,     \
                                                       float *part, const T *bias, T *out, int64_t ldo,          \
                                                       int last_cols, const T *pf, int64_t pf_step) {            \
        __m256 acc[MR][2 * NP];                                                                                  \
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)                                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NP; j++)                                             \
                acc[m][j] = k0 ? _mm256_loadu_ps(part + (m * 2 * NP + j) * 8) : _mm256_setzero_ps();             \
        /* k unrolled by two: fewer loop branches between the FMAs, the same bits */                             \
        _Pragma("GCC unroll 2") for (int64_t k = k0; k < k1; k++) {                                              \
            __m256 x[MR];                                                                                        \
            if (PF) _mm_prefetch((const char *)(pf + ((k - k0) * pf_step >> 16) * PANEL), _MM_HINT_T0);          \
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)                                                 \
                x[m] = _mm256_broadcast_ss(TILE_ROW_##ROWS(a, m) + k * a_step);                                  \
            _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) {                                               \
                const T *wk = w + p * panel_len + k * PANEL;                                                     \
                __m256 lo = w8_##SUF(wk);                                                                        \
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)                                             \
                    acc[m][2 * p] = _mm256_fmadd_ps(x[m], lo, acc[m][2 * p]);                                    \
                __m256 hi = w8_##SUF(wk + 8);                                                                    \
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)                                             \
                    acc[m][2 * p + 1] = _mm256_fmadd_ps(x[m], hi, acc[m][2 * p + 1]);                            \
            }                                                                                                    \
        }                                                                                                        \
        /* unrolled, as above: with a variable index GCC keeps acc in memory and stores it every k */            \
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)                                                     \
            _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) {                                               \
                if (k1 < K) {                                                                                    \
                    _mm256_storeu_ps(part + (m * 2 * NP + 2 * p) * 8, acc[m][2 * p]);                            \
                    _mm256_storeu_ps(part + (m * 2 * NP + 2 * p + 1) * 8, acc[m][2 * p + 1]);                    \
                } else {                                                                                         \
                    st_panel_##SUF(out + m * ldo + p * PANEL, acc[m][2 * p], acc[m][2 * p + 1],                  \
                                   bias ? bias + p * PANEL : NULL, p == NP - 1 ? last_cols : PANEL);             \
                }                                                                                                \
            }                                                                                                    \
    }

#define DEFINE_PACKED_TILES_AVX2_PF(SUF, T, PF, ROWS)                                                            \
    DEFINE_PACKED_TILE_AVX2(SUF, T, 1, 1, PF, ROWS) DEFINE_PACKED_TILE_AVX2(SUF, T, 1, 2, PF, ROWS)              \
    DEFINE_PACKED_TILE_AVX2(SUF, T, 1, 3, PF, ROWS) DEFINE_PACKED_TILE_AVX2(SUF, T, 1, 4, PF, ROWS)              \
    DEFINE_PACKED_TILE_AVX2(SUF, T, 2, 1, PF, ROWS) DEFINE_PACKED_TILE_AVX2(SUF, T, 2, 2, PF, ROWS)              \
    DEFINE_PACKED_TILE_AVX2(SUF, T, 2, 3, PF, ROWS) DEFINE_PACKED_TILE_AVX2(SUF, T, 3, 1, PF, ROWS)              \
    DEFINE_PACKED_TILE_AVX2(SUF, T, 3, 2, PF, ROWS)
#define PACKED_TILES_AVX2_ROWS(SUF, V)                                                                           \
    {NULL},                                                                                                      \
    {NULL, packed_tile_##SUF##_1_1_##V, packed_tile_##SUF##_1_2_##V, packed_tile_##SUF##_1_3_##V,                \
     packed_tile_##SUF##_1_4_##V},                                                                               \
    {NULL, packed_tile_##SUF##_2_1_##V, packed_tile_##SUF##_2_2_##V, packed_tile_##SUF##_2_3_##V, NULL},         \
    {NULL, packed_tile_##SUF##_3_1_##V, packed_tile_##SUF##_3_2_##V, NULL, NULL},
#define DEFINE_PACKED_TILES_AVX2(SUF, T)                                                                         \
    DEFINE_PACKED_TILES_AVX2_PF(SUF, T, 0, 0) DEFINE_PACKED_TILES_AVX2_PF(SUF, T, 1, 0)                          \
    DEFINE_PACKED_TILES_AVX2_PF(SUF, T, 0, 1) DEFINE_PACKED_TILES_AVX2_PF(SUF, T, 1, 1)                          \
    typedef void (*packed_tile_##SUF##_fn)(const float *, int64_t, const T *, int64_t, int64_t, int64_t,         \
                                           int64_t, float *, const T *, T *, int64_t, int, const T *, int64_t);  \
    typedef void (*packed_rows_tile_##SUF##_fn)(const float *const *, int64_t, const T *, int64_t, int64_t,      \
                                                int64_t, int64_t, float *, const T *, T *, int64_t, int,         \
                                                const T *, int64_t);                                             \
    /* [prefetching][rows][panels], for the shapes avx2_panels_per_group hands out (at most 12 accumulators); */ \
    /* the second with a pointer per row (chunks across row tiles) */                                            \
    static const packed_tile_##SUF##_fn packed_tiles_##SUF[2][AVX2_MR + 1][5] = {                                \
        {PACKED_TILES_AVX2_ROWS(SUF, 00)}, {PACKED_TILES_AVX2_ROWS(SUF, 10)}};                                   \
    static const packed_rows_tile_##SUF##_fn packed_rows_tiles_##SUF[2][AVX2_MR + 1][5] = {                      \
        {PACKED_TILES_AVX2_ROWS(SUF, 01)}, {PACKED_TILES_AVX2_ROWS(SUF, 11)}};

/* The rows of one tile of the packed input (`rows`, up to ROW_TILE) in chunks of at most `mr` rows (AVX2_MR, or
 * 2: see avx2_decode_mr), as even as they go: chunk c is rows [rows * c / n, rows * (c + 1) / n) of n. */
static inline int64_t avx2_chunks(int64_t rows, int64_t mr) { return (rows + mr - 1) / mr; }
/* Panels per group: as many as keep the largest chunk at 12 accumulators at most. */
static inline int avx2_panels_per_group(int64_t M, int64_t mr) {
    int64_t rows = M < ROW_TILE ? M : ROW_TILE, chunks = avx2_chunks(rows, mr);
    int64_t most = (rows + chunks - 1) / chunks;
    return most >= 3 ? 2 : most == 2 ? 3 : 4;
}
/* A model of a decode pass's tile time per panel and k, chunks of at most `mr` rows: a chunk's FMAs a k at two a
 * cycle, but no faster than the 5-cycle FMA latency of one accumulator (fewer than 10 accumulators wait on it),
 * over its panels, plus 0.3 for each chunk (its passes over the block from L1, its partial sums); fitted to the
 * packed linear's times with the two chunkings below at 2 to 16 rows over smollm2's projections. */
static inline double avx2_pass_cost(int64_t M, int64_t mr) {
    int np = avx2_panels_per_group(M, mr);
    double cost = 0;
    for (int64_t t0 = 0; t0 < M; t0 += ROW_TILE) {
        int64_t rows = M - t0 < ROW_TILE ? M - t0 : ROW_TILE, n = avx2_chunks(rows, mr);
        for (int64_t c = 0; c < n; c++) {
            double fmas = 2.0 * np * (rows * (c + 1) / n - rows * c / n);
            cost += (fmas / 2 > 5 ? fmas / 2 : 5) / np + 0.3;
        }
    }
    return cost;
}
/* Rows per chunk of a float32 decode pass (up to DECODE_ROWS rows, not the gate_up pairs, whose groups are two
 * panels): 2-row chunks over 3 panels where the model says they beat the 3-row chunks over 2, which leave
 * 2-row chunks over 2 panels (8 accumulators) wherever the rows do not split into threes (at 8, 9, 10, 12 and 16
 * rows; tools/decode_ab.py). The same sums in the same order: the same bits. Not for bfloat16 weights: there each
 * of the 3 panels' loads also widens its values, and 2-row chunks are slower. */
static inline int64_t avx2_decode_mr(int64_t M) {
    return avx2_pass_cost(M, 2) < avx2_pass_cost(M, AVX2_MR) ? 2 : AVX2_MR;
}

/* The block of panels a thread streams after the current one, and how its row chunks share prefetching it:
 * the group's next k block, or else the next group's first, which is the next of the thread's run or, at the
 * run's end, the first group no thread has taken yet (likely the thread's own next claim). With fewer row
 * chunks than panels (up to 4 rows) nothing is prefetched: there the hardware prefetchers keep up (see the
 * tiles). `at` is the block's offset in elements from the first panel. */
typedef struct {
    int64_t at, panel_len, k, panels, per_panel; /* per_panel: chunks prefetching each panel's lines (0: none) */
} avx2_next_block;
static inline avx2_next_block avx2_next(int64_t g, int64_t g1, int64_t *next_group, int64_t groups, int np,
                                        int64_t panels, int64_t panel_len, int64_t k1, int64_t K,
                                        int64_t kblock, int64_t chunks, int64_t pair_half) {
    /* pairs (pair_half > 0, see packed_pass): group g is panels g and g + pair_half */
    avx2_next_block next = {.panel_len = pair_half ? pair_half * panel_len : panel_len};
    int64_t group = g, group_len = pair_half ? panel_len : np * panel_len;
    if (k1 < K) {
        next.at = g * group_len + k1 * PANEL, next.k = K - k1;
    } else {
        group = g + 1 < g1 ? g + 1 : __atomic_load_n(next_group, __ATOMIC_RELAXED);
        if (group >= groups) return next;
        next.at = group * group_len, next.k = K;
    }
    next.k = next.k < kblock ? next.k : kblock;
    next.panels = pair_half ? 2 : panels - group * np < np ? panels - group * np : np;
    next.per_panel = chunks / next.panels; /* each chunk prefetches at least 16 lines */
    next.per_panel = next.per_panel < next.k / 16 ? next.per_panel : next.k / 16;
    return next;
}
/* The row chunks' shares of the next block, for every block of one shape: chunk c < `n` prefetches from line
 * `at[c]` past the block's start, `step[c]` lines per k as 16.16 fixed point; chunks from `n` on prefetch
 * nothing. Blocks of a matmul share a shape but for a group's last k block and the last group, so the table is
 * made again only when the shape changes (`key`): its integer divisions, made for every tile call, would cost
 * a decode step about 2%. */
#define AVX2_SHARES 64 /* chunks that can prefetch: at most np * kblock / 16, 4 * 128 / 16 = 32 */
typedef struct {
    int64_t key[4], n, at[AVX2_SHARES], step[AVX2_SHARES];
} avx2_shares;
static inline void avx2_share_table(const avx2_next_block *next, int64_t k_len, avx2_shares *table) {
    int64_t *key = table->key;
    if (key[0] == next->k && key[1] == next->panels && key[2] == next->per_panel && key[3] == k_len) return;
    key[0] = next->k, key[1] = next->panels, key[2] = next->per_panel, key[3] = k_len;
    table->n = next->per_panel * next->panels;
    table->n = table->n < AVX2_SHARES ? table->n : AVX2_SHARES;
    for (int64_t c = 0; c < table->n; c++) {
        int64_t j = c % next->per_panel, l0 = next->k * j / next->per_panel;
        int64_t l1 = next->k * (j + 1) / next->per_panel;
        table->at[c] = c / next->per_panel * next->panel_len + l0 * PANEL;
        table->step[c] = ((l1 - l0) << 16) / k_len;
    }
}

/* A row chunk above DECODE_ROWS rows (see packed_groups): `rows` input rows from row `row`; row m's values at
 * a[m][k * step] in the packed input (see pack_row). */
typedef struct {
    const float *a[AVX2_MR];
    int64_t row;
    int rows;
} avx2_chunk;
/* Above DECODE_ROWS rows, three consecutive rows a chunk, across the packed input's row tiles, and 2 + 2 for a
 * last 3 + 1: within the tiles (3 + 3 + 2) a 2-row chunk costs nearly a 3-row chunk's time for two thirds of its
 * FLOPs. Up to 16 rows the chunks stay within the tiles: across them a pointer per row for every tile costs the
 * decode step more than the fuller chunks gain (tools/decode_ab.py). */
static void avx2_row_chunks(const float *a, int64_t M, int64_t K, avx2_chunk *chunk) {
    int64_t chunks = avx2_chunks(M, AVX2_MR);
    for (int64_t ci = 0; ci < chunks; ci++) {
        int64_t left = M - ci * AVX2_MR;
        chunk[ci].row = ci * AVX2_MR, chunk[ci].rows = (int)(left < AVX2_MR ? left : AVX2_MR);
    }
    if (M % AVX2_MR == 1) chunk[chunks - 2].rows = 2, chunk[chunks - 1].row--, chunk[chunks - 1].rows = 2;
    for (int64_t ci = 0; ci < chunks; ci++)
        for (int m = 0; m < chunk[ci].rows; m++) {
            int64_t r = chunk[ci].row + m;
            chunk[ci].a[m] = a + r / ROW_TILE * ROW_TILE * K + r % ROW_TILE;
        }
}

#define DEFINE_PACKED_GROUPS(SUF, T)                                                                             \
    DEFINE_PACKED_TILES_AVX2(SUF, T)                                                                             \
    DEFINE_SWIGLU_INTO_PACKED(SUF, T)                                                                            \
    /* The matmul over packed input `a` (pack_row's layout) for the calling thread, taking panel groups from     \
     * `next_group` in chunks as the AVX-512 packed_groups does. A group goes avx2_kblock values of k at a time: \
     * every row chunk passes over that block (in L1) before the next, the first one streaming it from memory,   \
     * so the stream runs beside the arithmetic, not before it; the chunks' partial sums wait in `part`.         \
     * Meanwhile the chunks prefetch the block the thread streams next (avx2_next), evenly over the block's work:\
     * else the first chunk stalls on memory and the rest run from L1 with memory idle.                          \
     * With `pair_half` > 0 (up to DECODE_ROWS rows; see packed_swiglu_groups) group g is panels g and           \
     * g + pair_half, computed into a block on the stack, whose SwiGLU goes into `act_out` (swiglu_into_packed). \
     * `greedy` is the AVX-512 build's (this one computes logits; see packed_linear_greedy). */                  \
    static void packed_pass_##SUF(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N,       \
                                  int64_t K, int64_t *next_group, int64_t nthreads, int64_t pair_half,           \
                                  float *act_out) {                                                              \
        int64_t panels = (N + PANEL - 1) / PANEL, panel_len = K * PANEL;                                         \
        int last_cols = N % PANEL ? (int)(N % PANEL) : PANEL;                                                    \
        int64_t step = M <= ROW_TILE ? M : ROW_TILE; /* rows per tile of the packed input */                     \
        int across = M > DECODE_ROWS; /* chunks across row tiles (avx2_row_chunks) */                            \
        /* rows per chunk at most */                                                                             \
        int64_t mr = across || pair_half || sizeof(T) != sizeof(float) ? AVX2_MR : avx2_decode_mr(M);            \
        int np = pair_half ? 2 : avx2_panels_per_group(M, mr);                                                   \
        int64_t groups = pair_half ? pair_half : (panels + np - 1) / np;                                         \
        int64_t ld = pair_half ? 2 * PANEL : N, panel_stride = pair_half ? pair_half * panel_len : panel_len;    \
        T block[DECODE_ROWS * 2 * PANEL]; /* pairs: a group's gate and up outputs */                             \
        /* a chunk's partial sums: at most 12 accumulators of 8 floats; 3 chunks on the stack (to 8 rows) */     \
        int64_t chunks = across ? avx2_chunks(M, mr)                                                             \
                                : M / step * avx2_chunks(step, mr) + (M % step ? avx2_chunks(M % step, mr) : 0); \
        int64_t part_len = 12 * 8, kblock = avx2_kblock(M);                                                      \
        float small[3 * 12 * 8];                                                                                 \
        float *part = chunks <= 3 ? small : (float *)malloc(sizeof(float) * chunks * part_len);                  \
        /* row chunk c of a whole row tile and of a partial last one: rows [bounds[c], bounds[c + 1]) */         \
        int64_t last_rows = M % step ? M % step : step;                                                          \
        int64_t n_whole = avx2_chunks(step, mr), n_last = avx2_chunks(last_rows, mr);                            \
        int64_t whole_bounds[AVX2_MR + 2], last_bounds[AVX2_MR + 2];                                             \
        for (int64_t c = 0; c <= n_whole; c++) whole_bounds[c] = step * c / n_whole;                             \
        for (int64_t c = 0; c <= n_last; c++) last_bounds[c] = last_rows * c / n_last;                           \
        avx2_chunk *chunk = across ? (avx2_chunk *)malloc(sizeof(avx2_chunk) * chunks) : NULL;                   \
        if (across) avx2_row_chunks(a, M, K, chunk);                                                             \
        avx2_shares shares = {.key = {-1}};                                                                      \
        for (int64_t g0, g1; claim_groups(next_group, groups, nthreads, &g0, &g1);) {                            \
            for (int64_t g = g0; g < g1; g++) {                                                                  \
                int64_t p0 = pair_half ? g : g * np;                                                             \
                int gp = pair_half ? 2 : panels - p0 < np ? (int)(panels - p0) : np; /* panels in the group */   \
                int cols = !pair_half && p0 + gp == panels ? last_cols : PANEL;                                  \
                const T *wg = w + p0 * panel_len;                                                                \
                const T *bg = bias ? bias + p0 * PANEL : NULL;                                                   \
                T *og = pair_half ? block : out + p0 * PANEL;                                                    \
                for (int64_t k0 = 0; k0 < K; k0 += kblock) {                                                     \
                    int64_t k1 = k0 + kblock < K ? k0 + kblock : K;                                              \
                    avx2_next_block next = avx2_next(g, g1, next_group, groups, np, panels, panel_len, k1, K,    \
                                                     kblock, chunks, pair_half);                                 \
                    avx2_share_table(&next, k1 - k0, &shares);                                                   \
                    float *pc = part;                                                                            \
                    for (int64_t ci = 0; across && ci < chunks; ci++, pc += part_len) {                          \
                        const avx2_chunk *c = chunk + ci;                                                        \
                        int pf = ci < shares.n;                                                                  \
                        int64_t pf_at = pf ? next.at + shares.at[ci] : 0;                                        \
                        packed_rows_tiles_##SUF[pf][c->rows][gp](c->a, step, wg, panel_len, k0, k1, K, pc, bg,   \
                                                                 out + c->row * N + p0 * PANEL, N, cols,         \
                                                                 w + pf_at, pf ? shares.step[ci] : 0);           \
                    }                                                                                            \
                    int64_t ci = 0; /* the chunk's index in this block */                                        \
                    for (int64_t t0 = 0; !across && t0 < M; t0 += step) {                                        \
                        int whole = M - t0 >= step;                                                              \
                        int64_t n = whole ? n_whole : n_last;                                                    \
                        const int64_t *bounds = whole ? whole_bounds : last_bounds;                              \
                        for (int64_t c = 0; c < n; c++, ci++, pc += part_len) {                                  \
                            int64_t r0 = bounds[c], r1 = bounds[c + 1];                                          \
                            int pf = ci < shares.n;                                                              \
                            int64_t pf_at = pf ? next.at + shares.at[ci] : 0;                                    \
                            int64_t pf_step = pf ? shares.step[ci] : 0;                                          \
                            packed_tiles_##SUF[pf][r1 - r0][gp](a + t0 * K + r0, step, wg, panel_stride, k0, k1, \
                                                                K, pc, bg, og + (t0 + r0) * ld, ld, cols,        \
                                                                w + pf_at, pf_step);                             \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
                if (pair_half) swiglu_into_packed_##SUF(block, M, g, pair_half * PANEL, act_out);                \
            }                                                                                                    \
        }                                                                                                        \
        if (part != small) free(part);                                                                           \
        free(chunk);                                                                                             \
    }                                                                                                            \
    static void packed_groups_##SUF(const float *a, const T *w, const T *bias, T *out, int64_t M, int64_t N,     \
                                    int64_t K, int64_t *next_group, int64_t nthreads, greedy_groups *greedy) {   \
        (void)greedy;                                                                                            \
        packed_pass_##SUF(a, w, bias, out, M, N, K, next_group, nthreads, 0, NULL);                              \
    }                                                                                                            \
    /* gate_up and SwiGLU in one pass (see the AVX-512 build's): the pairs of packed_pass. */                    \
    static void packed_swiglu_groups_##SUF(const float *a, const T *w, int64_t M, int64_t inter, int64_t K,      \
                                           int64_t *next_group, int64_t nthreads, float *a_out) {                \
        packed_pass_##SUF(a, w, NULL, NULL, M, 2 * inter, K, next_group, nthreads, inter / PANEL, a_out);        \
    }

/* Greedy decoding from the lm_head through the logits (the AVX-512 build fuses it: see there): the packed
 * linear's logits, widened to float32 as the model's logits path widens them, through greedy_logprobs, so the
 * results are the logits path's exactly. Float32 logits of the whole vocabulary go to greedy_logprobs as they
 * are; their copy is a small part of the call. */
#define DEFINE_PACKED_GREEDY(SUF, T)                                                                             \
    void packed_linear_greedy_##SUF(const T *x, int64_t x_stride, const T *w, int64_t M, int64_t N, int64_t K,   \
                                    int64_t vocab, int64_t *ids, float *logprobs, int nthreads) {                \
        int64_t cols = vocab < N ? vocab : N;                                                                    \
        T *logits = (T *)malloc(sizeof(T) * M * N);                                                              \
        int as_is = sizeof(T) == sizeof(float) && cols == N; /* float32 rows of exactly the vocabulary */        \
        float *wide = as_is ? (float *)(void *)logits : (float *)malloc(sizeof(float) * M * cols);               \
        packed_matmul_##SUF(x, x_stride, w, NULL, logits, M, N, K, nthreads, NULL);                              \
        if (!as_is)                                                                                              \
            for (int64_t r = 0; r < M; r++)                                                                      \
                for (int64_t j = 0; j < cols; j++) wide[r * cols + j] = load_##SUF(logits + r * N + j);          \
        greedy_logprobs(wide, M, cols, ids, logprobs, nthreads);                                                 \
        if (!as_is) free(wide);                                                                                  \
        free(logits);                                                                                            \
    }

#define SILU_AND_MUL_ROW(SUF) silu_and_mul_row_##SUF
#endif

#define DEFINE_PACKED_INPUT(SUF, T)                                                                              \
    /* packed[p][k][j] = w[16p + j][k], zero for 16p + j >= N. */                                                \
    void pack_weight_##SUF(const T *w, int64_t N, int64_t K, T *packed, int nthreads) {                          \
        int64_t panels = (N + PANEL - 1) / PANEL;                                                                \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                       \
        for (int64_t p = 0; p < panels; p++) {                                                                   \
            T *dst = packed + p * K * PANEL;                                                                     \
            for (int j = 0; j < PANEL; j++) {                                                                    \
                int64_t n = p * PANEL + j;                                                                       \
                for (int64_t k = 0; k < K; k++) {                                                                \
                    if (n < N) dst[k * PANEL + j] = w[n * K + k];                                                \
                    else memset(&dst[k * PANEL + j], 0, sizeof(T));                                              \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* An embedding lookup from a packed table (a tied head): out[i][k] = packed[id / 16][k][id % 16], a row's   \
     * values one cache line apart in one contiguous run. 1 (and nothing written) if an id is outside [0, N). */ \
    int packed_rows_##SUF(const T *packed, int64_t N, int64_t K, const int64_t *ids, int64_t n, T *out) {        \
        for (int64_t i = 0; i < n; i++)                                                                          \
            if (ids[i] < 0 || ids[i] >= N) return 1;                                                             \
        for (int64_t i = 0; i < n; i++) {                                                                        \
            const T *src = packed + ids[i] / PANEL * K * PANEL + ids[i] % PANEL;                                 \
            for (int64_t k = 0; k < K; k++) out[i * K + k] = src[k * PANEL];                                     \
        }                                                                                                        \
        return 0;                                                                                                \
    }                                                                                                            \
                                                                                                                 \
    /* The panels back as one row-major [K, panels * 16] matrix (out[k][16p + j] = packed[p][k][j]): the weight \
     * transposed, as a BLAS matmul takes it (see ``NativeCPUOps.linear``). Rows split across the threads. */    \
    void unpack_weight_##SUF(const T *packed, int64_t panels, int64_t K, T *out, int nthreads) {                 \
        int64_t ld = panels * PANEL;                                                                             \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                       \
        for (int64_t k0 = 0; k0 < K; k0 += 64) {                                                                 \
            int64_t k1 = k0 + 64 < K ? k0 + 64 : K;                                                              \
            for (int64_t p = 0; p < panels; p++) {                                                               \
                const T *src = packed + (p * K + k0) * PANEL;                                                    \
                for (int64_t k = k0; k < k1; k++, src += PANEL)                                                   \
                    memcpy(out + k * ld + p * PANEL, src, sizeof(T) * PANEL);                                    \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* Columns [k0, k1) of row `row` of M (K values a row) into the tiles' input layout as float32: a[k][m] for  \
     * up to 8 rows, else a[t][k][m] with ROW_TILE rows a tile (row = t * ROW_TILE + m; a 16-row decode tile     \
     * reads two), so threads that pack whole row tiles never write the same cache line. */                      \
    static inline void pack_row_##SUF(const T *x, int64_t K, int64_t k0, int64_t k1, float *a, int64_t M,        \
                                      int64_t row) {                                                             \
        int64_t step = M <= ROW_TILE ? M : ROW_TILE;                                                             \
        float *dst = a + row / step * step * K + row % step;                                                     \
        for (int64_t k = k0; k < k1; k++) dst[k * step] = load_##SUF(x + k);                                     \
    }                                                                                                            \
                                                                                                                 \
    /* Columns [k0, k1) of row tile t (rows 8t..8t+7, `x_stride` apart, all below M, M >= 8) into the packed     \
     * input as pack_row lays it out, eight columns at a time through a transpose instead of one strided store   \
     * per value. */                                                                                             \
    static inline void pack_tile_##SUF(const T *x, int64_t x_stride, int64_t K, int64_t k0, int64_t k1,          \
                                       float *a, int64_t t) {                                                    \
        const T *src = x + t * ROW_TILE * x_stride;                                                              \
        float *dst = a + t * ROW_TILE * K;                                                                       \
        int64_t k = k0;                                                                                          \
        for (; k + 8 <= k1; k += 8) {                                                                            \
            __m256 r[ROW_TILE];                                                                                  \
            for (int m = 0; m < ROW_TILE; m++) r[m] = load8_##SUF(src + m * x_stride + k);                       \
            transpose8x8(r);                                                                                     \
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (k + i) * ROW_TILE, r[i]);                        \
        }                                                                                                        \
        for (; k < k1; k++)                                                                                      \
            for (int m = 0; m < ROW_TILE; m++) dst[k * ROW_TILE + m] = load_##SUF(src + m * x_stride + k);       \
    }                                                                                                            \
                                                                                                                 \
    /* Rows of M (`x_stride` apart, K values) in the row tiles tid, tid + nth, ... into the packed input: whole  \
     * tiles by pack_tile, a partial one (or M < 8, whose layout is M rows wide) row by row. */                  \
    static void pack_tiles_##SUF(const T *x, int64_t x_stride, int64_t K, float *a, int64_t M, int tid,          \
                                 int nth) {                                                                      \
        for (int64_t t = tid; t * ROW_TILE < M; t += nth) {                                                      \
            if (M >= ROW_TILE && (t + 1) * ROW_TILE <= M)                                                        \
                pack_tile_##SUF(x, x_stride, K, 0, K, a, t);                                                     \
            else                                                                                                 \
                for (int64_t r = t * ROW_TILE; r < M && r < (t + 1) * ROW_TILE; r++)                             \
                    pack_row_##SUF(x + r * x_stride, K, 0, K, a, M, r);                                          \
        }                                                                                                        \
    }

#define DEFINE_PACKED_MATMUL(SUF, T)                                                                             \
    /* The packing and the matmul of packed_linear; with `greedy`, no `out`: each panel group's logits go to     \
     * greedy_block instead. */                                                                                  \
    static void packed_matmul_##SUF(const T *x, int64_t x_stride, const T *w, const T *bias, T *out, int64_t M,  \
                                    int64_t N, int64_t K, int nthreads, greedy_groups *greedy) {                 \
        int64_t stride = M <= ROW_TILE ? M : ROW_TILE, row_tiles = (M + stride - 1) / stride;                    \
        float *a = (float *)aligned_alloc(64, sizeof(float) * ((row_tiles * stride * K + 15) / 16 * 16));        \
        if (M % stride) /* the padding rows of a partial last tile are computed (not stored): zeros */           \
            memset(a + (row_tiles - 1) * stride * K, 0, sizeof(float) * stride * K);                             \
        int parallel = M * N * K >= LINEAR_PARALLEL_MIN;                                                         \
        int64_t next_group = 0; /* the first panel group no thread has taken */                                  \
        _Pragma("omp parallel num_threads(nthreads) if (parallel)")                                              \
        {                                                                                                        \
            int64_t k_blocks = (K + 63) / 64; /* split along K too: a decode step has one row tile */            \
            _Pragma("omp for schedule(static)")                                                                  \
            for (int64_t tk = 0; tk < row_tiles * k_blocks; tk++) {                                              \
                int64_t t = tk / k_blocks, k0 = tk % k_blocks * 64, k1 = k0 + 64 < K ? k0 + 64 : K;              \
                if (M >= ROW_TILE && (t + 1) * ROW_TILE <= M)                                                    \
                    pack_tile_##SUF(x, x_stride, K, k0, k1, a, t);                                               \
                else                                                                                             \
                    for (int64_t row = t * stride; row < M && row < (t + 1) * stride; row++)                     \
                        pack_row_##SUF(x + row * x_stride, K, k0, k1, a, M, row);                                \
            }                                                                                                    \
            packed_groups_##SUF(a, w, bias, out, M, N, K, &next_group, omp_get_num_threads(), greedy);           \
        }                                                                                                        \
        free(a);                                                                                                 \
    }                                                                                                            \
                                                                                                                 \
    /* x: M rows `x_stride` apart; w: pack_weight's panels for N x K; bias: N or NULL; out: M x N, contiguous. */ \
    void packed_linear_##SUF(const T *x, int64_t x_stride, const T *w, const T *bias, T *out, int64_t M,         \
                             int64_t N, int64_t K, int nthreads) {                                               \
        packed_matmul_##SUF(x, x_stride, w, bias, out, M, N, K, nthreads, NULL);                                 \
    }

#define DEFINE_PACKED_LINEAR(SUF, T)                                                                             \
    DEFINE_PACKED_INPUT(SUF, T) DEFINE_PACKED_GROUPS(SUF, T)                                                     \
    DEFINE_PACKED_MATMUL(SUF, T) DEFINE_PACKED_GREEDY(SUF, T)
DEFINE_PACKED_LINEAR(f32, float)
DEFINE_PACKED_LINEAR(bf16, bf16_t)

/* ---- A decode step's decoder layers in one call ---------------------------------------------------------------
 *
 * The same ops, in the same order, as DecoderLayer.forward over the native kernels, so the results are identical
 * to the op-by-op path; what goes is Python between the ops. Each op called from Python costs tens of
 * microseconds once the matmul before it has streamed megabytes of weights through the caches (the interpreter's
 * own working set is evicted), about ten calls a layer.
 * The whole step is one OpenMP region: the team meets at a barrier between phases instead of forking and joining
 * for each op. Every thread runs the row-wise ops on all the rows, into its own residual stream, normed rows and
 * packed matmul input (pack_tiles: an 8x8 transpose per 8 columns, not one strided store per value): they are
 * microseconds of work, and a thread that computes them itself needs no barrier before the matmul that reads them
 * (five barriers a layer, not eight). Each sequence's rotary and KV store run in its attention task when a task
 * is a whole sequence.
 * `table` holds DECODE_LAYER_FIELDS addresses per layer (see kernels/cpu/ops.py, _addresses, and DecodeLayerWeights
 * in kernels/dispatch.py); biases may be 0. `h` [M, hidden] is the embedding on entry and, on return, the last
 * layer's MLP output, or with `final_norm` the model's final norm of it; `residual` receives the residual stream
 * (with `final_norm`, the sum that norm took).
 */
/* The team's barrier between decode_layers' phases. libgomp's barrier spins only 100 times before it sleeps in
 * the kernel once its pools hold more threads than there are CPUs (see ksana/worker/fresh_thread.py, which keeps
 * the engine's own process clear of that). A caller that is not clear pays a futex wake at each of a step's 270
 * waits: 4-34 us each, about 4 ms of a batch-16 step, in a script that ran the layers from its main thread after
 * the engine's forward thread had. This one spins with pause, then yields the CPU in a loop, so a thread the OS
 * preempted (a server's event loop shares the cores) gets a core back soon. Sense-reversing: the last thread to
 * arrive flips `sense`. */
#define TEAM_SPINS (1 << 12) /* pauses before it yields: tens of microseconds */
typedef struct {
    _Alignas(64) int64_t arrived;
    _Alignas(64) int sense;
} team_barrier;

static void team_wait(team_barrier *barrier, int nthreads, int *my_sense) {
    int sense = !*my_sense;
    *my_sense = sense;
    if (__atomic_add_fetch(&barrier->arrived, 1, __ATOMIC_ACQ_REL) == nthreads) {
        __atomic_store_n(&barrier->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&barrier->sense, sense, __ATOMIC_RELEASE);
        return;
    }
    for (int64_t spins = 0; __atomic_load_n(&barrier->sense, __ATOMIC_ACQUIRE) != sense; spins++) {
        if (spins < TEAM_SPINS) _mm_pause();
        else sched_yield();
    }
}

/* The fused step's phases, timed: only in the build tools/decode_phases.py makes (-DKSANA_PHASE_CLOCK). Each
 * thread adds, per phase, the time from leaving the previous barrier to reaching this phase's (work) and the time it
 * then waits there (wait); decode_phase_clock hands the sums over and clears them. Without the flag TEAM_WAIT is the
 * plain barrier and the kernel is the one the engine runs. */
enum { PHASE_NORM, PHASE_QKV, PHASE_STORE, PHASE_ATTENTION, PHASE_COMBINE, PHASE_PACK, PHASE_O, PHASE_POST_NORM,
       PHASE_GATE_UP, PHASE_SILU, PHASE_DOWN, PHASES };
#define PHASE_THREADS 64 /* threads clocked; more run unclocked */
#ifdef KSANA_PHASE_CLOCK
#include <time.h>
typedef struct {
    _Alignas(64) double work[PHASES], wait[PHASES], mark;
} phase_clock;
static phase_clock phase_clocks[PHASE_THREADS];

static inline double phase_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void phase_start(int tid) {
    if (tid < PHASE_THREADS) phase_clocks[tid].mark = phase_now();
}

static void team_wait_clocked(team_barrier *barrier, int nthreads, int *my_sense, int tid, int phase) {
    double arrived = phase_now();
    team_wait(barrier, nthreads, my_sense);
    if (tid >= PHASE_THREADS) return;
    phase_clock *clock = &phase_clocks[tid];
    double left = phase_now();
    clock->work[phase] += arrived - clock->mark;
    clock->wait[phase] += left - arrived;
    clock->mark = left;
}

static void phase_mark(int tid, int phase) { /* a phase that ends without a barrier: its work only */
    if (tid >= PHASE_THREADS) return;
    double now = phase_now();
    phase_clocks[tid].work[phase] += now - phase_clocks[tid].mark;
    phase_clocks[tid].mark = now;
}

/* How many phases the clock has: tools/decode_phases.py's names must match the enum above. */
int decode_phase_count(void) { return PHASES; }

/* out[t][0][p], out[t][1][p]: thread t's work and wait seconds in phase p since the last call, t < threads. */
void decode_phase_clock(double *out, int threads) {
    for (int t = 0; t < threads && t < PHASE_THREADS; t++)
        for (int p = 0; p < PHASES; p++) {
            out[(t * 2) * PHASES + p] = phase_clocks[t].work[p];
            out[(t * 2 + 1) * PHASES + p] = phase_clocks[t].wait[p];
            phase_clocks[t].work[p] = phase_clocks[t].wait[p] = 0.0;
        }
}
#define TEAM_WAIT(phase) team_wait_clocked(&barrier, nth, &sense, tid, phase)
#define PHASE_START(tid) phase_start(tid)
#define PHASE_MARK(phase) phase_mark(tid, phase)
#else
#define TEAM_WAIT(phase) team_wait(&barrier, nth, &sense)
#define PHASE_START(tid) ((void)0)
#define PHASE_MARK(phase) ((void)0)
#endif

#define DECODE_LAYER_FIELDS 12
/* Row b's q and k rotated into qk, its k and v stored in the KV cache (decode_layers' locals). */
#define ROTATE_AND_STORE(SUF, b)                                                                                 \
    do {                                                                                                         \
        rotary_token_##SUF(qkv + (b) * qkv_n, cos + (b) * dim, sin + (b) * dim, qk + (b) * (q + kv),             \
                           nheads + nkv, dim);                                                                   \
        store_kv_##SUF(qk + (b) * (q + kv) + q, q + kv, qkv + (b) * qkv_n + q + kv, qkv_n, k_cache, v_cache,     \
                       slots + (b), 1, nkv, dim, block_size, slot_stride, head_stride);                          \
    } while (0)
#define DEFINE_DECODE_LAYERS(SUF, T)                                                                            \
    void decode_layers_##SUF(const int64_t *table, const int64_t *windows, int64_t nlayers, T *h, T *residual,  \
                             int64_t M, int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter, \
                             const T *cos, const T *sin, const int64_t *slots, const int64_t *block_tables,     \
                             int64_t table_stride, const int64_t *seq_lens, int64_t block_size,                 \
                             int64_t slot_stride, int64_t head_stride, float eps,                               \
                             float scale, int nthreads, const T *final_norm) {                                   \
        int64_t q = nheads * dim, kv = nkv * dim, qkv_n = q + 2 * kv;                                            \
        int64_t k_most = hidden > q ? hidden : q;                                                                \
        k_most = k_most > inter ? k_most : inter;                                                                \
        int64_t row_tiles = (M + ROW_TILE - 1) / ROW_TILE;                                                       \
        T *qkv = (T *)malloc(sizeof(T) * M * qkv_n), *qk = (T *)malloc(sizeof(T) * M * (q + kv));                \
        T *attn = (T *)malloc(sizeof(T) * M * q), *gate_up = (T *)malloc(sizeof(T) * M * 2 * inter);             \
        /* down's packed input from the fused gate_up and SwiGLU pass; calloc: the padding rows of a partial last\
         * tile stay zero */                                                                                     \
        int fuse_mlp = swiglu_fusable(M, inter);                                                                 \
        float *a_act = fuse_mlp ? (float *)calloc(row_tiles * ROW_TILE * inter, sizeof(float)) : NULL;           \
        /* work counters, 0 at the start: per layer four matmuls' panel groups and the attention's tasks */      \
        int64_t *next_work = (int64_t *)calloc(5 * nlayers, sizeof(int64_t));                                    \
        int64_t parts_len = 0; /* split attention tasks' partial results: room for the layer that needs most */  \
        for (int64_t l = 0; l < nlayers; l++) {                                                                  \
            decode_plan plan = plan_decode(seq_lens, M, nheads, nkv, dim, windows[l], slot_stride, head_stride,  \
                                           nthreads);                                                            \
            int64_t len = plan.splits > 1 ? plan.whole_tasks * plan.splits * plan.part_len : 0;                  \
            parts_len = len > parts_len ? len : parts_len;                                                       \
        }                                                                                                        \
        float *parts = parts_len ? (float *)malloc(sizeof(float) * parts_len) : NULL;                            \
        team_barrier barrier = {0, 0};                                                                           \
        _Pragma("omp parallel num_threads(nthreads)")                                                            \
        {                                                                                                        \
            int tid = omp_get_thread_num(), nth = omp_get_num_threads(), sense = 0;                              \
            PHASE_START(tid);                                                                                    \
            /* The row-wise ops run on every row in every thread, each into its own copy of the residual stream  \
             * (thread 0's is `residual`), the normed rows and the matmul's packed input: the same bits in each, \
             * and no barrier between them and the matmul that reads them. */                                    \
            T *res = tid == 0 ? residual : (T *)malloc(sizeof(T) * M * hidden);                                  \
            T *x = (T *)malloc(sizeof(T) * M * (inter > hidden ? inter : hidden)); /* or SwiGLU's, unfused */    \
            float *a = (float *)calloc(row_tiles * ROW_TILE * k_most, sizeof(float));                            \
            int64_t most_blocks = 0; /* the longest sequence's, for this thread's warm list (kv_warm) */         \
            for (int64_t b = 0; b < M; b++) {                                                                    \
                int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;                                    \
                most_blocks = blocks > most_blocks ? blocks : most_blocks;                                       \
            }                                                                                                    \
            const char **warm_blocks = (const char **)malloc(sizeof(char *) * (2 * most_blocks + 1));            \
            kv_warm warm;                                                                                        \
            for (int64_t l = 0; l < nlayers; l++) {                                                              \
                const int64_t *f = table + l * DECODE_LAYER_FIELDS;                                              \
                const T *in_norm = (const T *)(intptr_t)f[0], *qkv_w = (const T *)(intptr_t)f[1];                \
                const T *qkv_b = (const T *)(intptr_t)f[2], *o_w = (const T *)(intptr_t)f[3];                    \
                const T *o_b = (const T *)(intptr_t)f[4], *post_norm = (const T *)(intptr_t)f[5];                \
                const T *gate_up_w = (const T *)(intptr_t)f[6], *gate_up_b = (const T *)(intptr_t)f[7];          \
                const T *down_w = (const T *)(intptr_t)f[8], *down_b = (const T *)(intptr_t)f[9];                \
                T *k_cache = (T *)(intptr_t)f[10], *v_cache = (T *)(intptr_t)f[11];                              \
                int64_t *next_group = next_work + 5 * l, *next_task = next_work + 5 * l + 4;                     \
                /* res = h (first layer) or res + h; x = norm(res). h is read here before this thread reaches    \
                 * the qkv barrier, which the o projection's writes to h come after. */                          \
                for (int64_t r = 0; r < M; r++) {                                                                \
                    if (l == 0) {                                                                                \
                        memcpy(res + r * hidden, h + r * hidden, sizeof(T) * hidden);                            \
                        rms_norm_row_##SUF(h + r * hidden, NULL, NULL, in_norm, x + r * hidden, hidden, eps);    \
                    } else {                                                                                     \
                        rms_norm_row_##SUF(h + r * hidden, res + r * hidden, res + r * hidden, in_norm,          \
                                           x + r * hidden, hidden, eps);                                         \
                    }                                                                                            \
                }                                                                                                \
                pack_tiles_##SUF(x, hidden, hidden, a, M, 0, 1);                                                 \
                PHASE_MARK(PHASE_NORM);                                                                          \
                decode_plan plan = plan_decode(seq_lens, M, nheads, nkv, dim, windows[l], slot_stride,           \
                                               head_stride, nthreads);                                           \
                int whole_seqs = plan.kv_per_task == nkv && plan.splits == 1; /* a task is a whole sequence */   \
                /* Each thread's first task is sequence `tid` (the rest are taken as they come), whose KV        \
                 * the split tile warms during the qkv projection (kv_warm). A thread the OS preempts holds up   \
                 * only that task. Same bits: which thread runs a task does not change its result. */            \
                int warm_first = KV_WARMS && whole_seqs && M > ROW_TILE && M <= DECODE_ROWS                      \
                                 && plan.whole_tasks >= nth;                                                     \
                if (warm_first) {                                                                                \
                    int64_t len = seq_lens[tid], window = windows[l], count = 0;                                 \
                    int64_t start = window > 0 && len > window ? len - window : 0;                               \
                    int64_t block_bytes = block_size * nkv * dim * (int64_t)sizeof(T);                           \
                    for (int v = 0; v < 2; v++)                                                                  \
                        for (int64_t i = start / block_size; i * block_size < len; i++)                          \
                            warm_blocks[count++] = (const char *)(v ? v_cache : k_cache)                         \
                                                   + block_tables[tid * table_stride + i] * block_bytes;         \
                    warm = (kv_warm){.blocks = warm_blocks, .left = count, .block_bytes = block_bytes};          \
                    kv_warming = &warm;                                                                          \
                }                                                                                                \
                packed_groups_##SUF(a, qkv_w, qkv_b, qkv, M, qkv_n, hidden, next_group, nth, NULL);              \
                TEAM_WAIT(PHASE_QKV);                                                                            \
                kv_warming = NULL;                                                                               \
                if (!whole_seqs) { /* tasks share sequences: rotary and KV store first */                        \
                    for (int64_t t = tid; t * ROW_TILE < M; t += nth)                                            \
                        for (int64_t r = t * ROW_TILE; r < M && r < (t + 1) * ROW_TILE; r++)                     \
                            ROTATE_AND_STORE(SUF, r);                                                            \
                    TEAM_WAIT(PHASE_STORE);                                                                      \
                }                                                                                                \
                for (int64_t tasks = plan.whole_tasks * plan.splits, first = warm_first;; first = 0) {           \
                    int64_t task = first ? tid                                                                   \
                                         : nth * warm_first + __atomic_fetch_add(next_task, 1, __ATOMIC_RELAXED);\
                    if (task >= tasks) break;                                                                    \
                    if (whole_seqs) ROTATE_AND_STORE(SUF, task);                                                 \
                    decode_run_task_##SUF(&plan, task, qk, q + kv, k_cache, v_cache, block_tables, table_stride, \
                                          seq_lens, attn, nheads, dim, block_size, scale, windows[l],            \
                                          plan.splits > 1 ? parts : NULL);                                       \
                }                                                                                                \
                TEAM_WAIT(PHASE_ATTENTION);                                                                      \
                if (plan.splits > 1) { /* the split parts combined, whole tasks shared out in turn */            \
                    for (int64_t whole = tid; whole < plan.whole_tasks; whole += nth)                            \
                        decode_combine_##SUF(&plan, whole, parts, attn, nheads, dim);                            \
                    TEAM_WAIT(PHASE_COMBINE);                                                                    \
                }                                                                                                \
                pack_tiles_##SUF(attn, q, q, a, M, 0, 1);                                                        \
                PHASE_MARK(PHASE_PACK);                                                                          \
                packed_groups_##SUF(a, o_w, o_b, h, M, hidden, q, next_group + 1, nth, NULL);                    \
                TEAM_WAIT(PHASE_O);                                                                              \
                /* res += h; x = norm(res): read before the gate_up barrier, which down's writes to h follow */  \
                for (int64_t r = 0; r < M; r++)                                                                  \
                    rms_norm_row_##SUF(h + r * hidden, res + r * hidden, res + r * hidden, post_norm,            \
                                       x + r * hidden, hidden, eps);                                             \
                pack_tiles_##SUF(x, hidden, hidden, a, M, 0, 1);                                                 \
                PHASE_MARK(PHASE_POST_NORM);                                                                     \
                int fused = fuse_mlp && !gate_up_b; /* the one pass adds no bias */                              \
                if (fused) {                                                                                     \
                    packed_swiglu_groups_##SUF(a, gate_up_w, M, inter, hidden, next_group + 2, nth, a_act);      \
                    TEAM_WAIT(PHASE_GATE_UP);                                                                    \
                } else {                                                                                         \
                    packed_groups_##SUF(a, gate_up_w, gate_up_b, gate_up, M, 2 * inter, hidden,                  \
                                        next_group + 2, nth, NULL);                                              \
                    TEAM_WAIT(PHASE_GATE_UP);                                                                    \
                    for (int64_t r = 0; r < M; r++)                                                              \
                        SILU_AND_MUL_ROW(SUF)(gate_up + r * 2 * inter, x + r * inter, inter);                    \
                    pack_tiles_##SUF(x, inter, inter, a, M, 0, 1);                                               \
                    PHASE_MARK(PHASE_SILU);                                                                      \
                }                                                                                                \
                packed_groups_##SUF(fused ? a_act : a, down_w, down_b, h, M, hidden, inter, next_group + 3, nth, \
                                    NULL);                                                                       \
                TEAM_WAIT(PHASE_DOWN);                                                                           \
            }                                                                                                    \
            /* the model's final norm, this thread's row tiles: h = norm(res + h), the sum into `residual` */    \
            for (int64_t t = tid; final_norm && t * ROW_TILE < M; t += nth)                                      \
                for (int64_t r = t * ROW_TILE; r < M && r < (t + 1) * ROW_TILE; r++)                             \
                    rms_norm_row_##SUF(h + r * hidden, res + r * hidden, residual + r * hidden, final_norm,      \
                                       h + r * hidden, hidden, eps);                                             \
            free(warm_blocks);                                                                                   \
            if (tid != 0) free(res);                                                                             \
            free(x);                                                                                             \
            free(a);                                                                                             \
        }                                                                                                        \
        free(qkv);                                                                                               \
        free(qk);                                                                                                \
        free(attn);                                                                                              \
        free(gate_up);                                                                                           \
        free(a_act);                                                                                             \
        free(next_work);                                                                                         \
        free(parts);                                                                                             \
    }

DEFINE_DECODE_LAYERS(f32, float)
DEFINE_DECODE_LAYERS(bf16, bf16_t)
#if defined(KSANA_AVX512)
#pragma GCC pop_options
#endif
int linear_available(void) { return 1; }
#else
/* Without AVX2 these only exist so every build exports the same names; Python never calls them. */
#define DEFINE_PACKED_STUBS(SUF, T)                                                                             \
    void pack_weight_##SUF(const T *w, int64_t N, int64_t K, T *packed, int nthreads) {                          \
        (void)w, (void)N, (void)K, (void)packed, (void)nthreads;                                                 \
        abort();                                                                                                 \
    }                                                                                                            \
    void packed_linear_##SUF(const T *x, int64_t x_stride, const T *w, const T *bias, T *out, int64_t M,        \
                             int64_t N, int64_t K, int nthreads) {                                               \
        (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)nthreads;      \
        abort();                                                                                                 \
    }
DEFINE_PACKED_STUBS(f32, float)
DEFINE_PACKED_STUBS(bf16, bf16_t)
void unpack_weight_f32(void) { abort(); }
void unpack_weight_bf16(void) { abort(); }
int packed_rows_f32(void) { abort(); }
int packed_rows_bf16(void) { abort(); }
void decode_layers_f32(void) { abort(); }
void decode_layers_bf16(void) { abort(); }
void packed_linear_greedy_f32(void) { abort(); }
void packed_linear_greedy_bf16(void) { abort(); }
int linear_available(void) { return 0; }
#endif
