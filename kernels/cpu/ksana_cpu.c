/* The packed-weight linear and the fused decode step (decode_layers), the CPU kernels not yet over vec.h's lanes
 * (see kernels/cpu/__init__.py for why the native kernels exist).
 *
 * C with OpenMP, no Python or torch headers; registration.cpp declares every exported function as a torch operator
 * (torch.ops.ksana.*) and it links into one library with the C++ kernels (norms, elementwise, attention,
 * sampling), whose row and task bodies decode_layers calls. AVX2 and AVX-512 builds have the packed linear and
 * decode_layers (AVX-512 inside its own target sections); a portable build exports stubs that Python never calls.
 * Every op exists for float32 (suffix _f32) and bfloat16 (suffix _bf16, stored as uint16); arithmetic is float32.
 *
 * Threading: OpenMP regions use the libgomp that torch already loaded (same soname), so torch and these kernels
 * share one thread pool; the operators pass the calling thread's torch thread count. `decode_layers` runs a whole
 * step as one region whose threads meet at a barrier of their own (team_wait) between ops. */
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

#include "parallel.h"

#ifdef KSANA_AVX2
/* The AVX2 helpers of the packed linear below. */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const bf16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#if defined(KSANA_AVX512)
/* The AVX-512 helpers of the packed linear below, compiled for AVX-512 in this section only. */
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
#pragma GCC pop_options
#endif

/* RMSNorm and rotary rows, defined in norms.cpp (the same code as the rms_norm and rotary_neox operators). */
void rms_norm_row_f32(const float *src, const float *add, float *residual_out, const float *w, float *o, int64_t dim,
                      float eps);
void rms_norm_row_bf16(const bf16_t *src, const bf16_t *add, bf16_t *residual_out, const bf16_t *w, bf16_t *o,
                       int64_t dim, float eps);
void rotary_token_f32(const float *x, const float *c, const float *s, float *out, int64_t nheads, int64_t dim);
void rotary_token_bf16(const bf16_t *x, const bf16_t *c, const bf16_t *s, bf16_t *out, int64_t nheads, int64_t dim);
/* SwiGLU's activation row and the KV cache write (elementwise.cpp, the silu_and_mul and store_kv operators). */
void silu_and_mul_row_f32(const float *g, float *o, int64_t d);
void silu_and_mul_row_bf16(const bf16_t *g, bf16_t *o, int64_t d);
void store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, float *k_cache,
                  float *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size,
                  int64_t slot_stride, int64_t head_stride);
void store_kv_bf16(const bf16_t *key, int64_t key_stride, const bf16_t *value, int64_t value_stride, bf16_t *k_cache,
                   bf16_t *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size,
                   int64_t slot_stride, int64_t head_stride);
/* Greedy sampling over float32 logits (sampling.cpp). */
void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs, int nthreads);

/* Paged decode attention's plan and tasks (attention_decode.cpp), which decode_layers runs from its team. */
#include "decode_plan.h"



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
            silu_and_mul_row_##SUF(block + m * 2 * PANEL, act, PANEL);                                            \
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
                        silu_and_mul_row_##SUF(gate_up + r * 2 * inter, x + r * inter, inter);                    \
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
