/* Native CPU kernels for the decoder (see kernels/cpu/__init__.py for why they exist).
 *
 * C with OpenMP, loaded through ctypes: no Python headers, no torch headers, so it builds in about a second with
 * the system compiler. Decode attention and SiLU use AVX2/FMA intrinsics when the build targets them (see
 * kernels/cpu/build.py); every op also has a portable C path. Every op exists for float32 (suffix _f32) and
 * bfloat16 (suffix _bf16, stored as uint16). Arithmetic is float32; bfloat16 results are rounded (nearest even)
 * at the points where torch's eager reference rounds, so both paths agree to the last bit in the elementwise ops
 * other than SiLU (whose exp differs by an ulp) and to float32 rounding error in the reductions. On AVX-512 builds
 * a small-batch linear and a whole decode step's layers (`decode_layers`) come on top (the end of this file).
 *
 * Threading: OpenMP regions use the libgomp that torch already loaded (same soname), so torch and these kernels
 * share one thread pool; the caller passes torch's thread count.
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

/* Parallelise only work big enough to pay for waking the pool: a region costs microseconds on an idle machine
 * but a scheduler time slice when another thread holds a core (the engine's event loop, a neighbour), so decode-
 * sized elementwise ops stay on the calling thread, as torch's own grain size (32768) keeps them. */
#define PARALLEL_MIN_ELEMS 65536
#define PARALLEL_MIN_ATTENTION_WORK (1 << 20) /* context positions x query heads x head_dim */

#ifdef KSANA_AVX2
/* Sum each of eight vectors: [sum(a0), ..., sum(a7)]. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
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
static inline __m256 round8_f32(__m256 x) { return x; }
static inline __m256 round8_bf16(__m256 x) { /* round to nearest even at 16 bits (finite inputs) */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* One decode task (a sequence's KV heads, or one of them), head_dim a multiple of 8; query head g reads KV head
 * g / head_group. Positions go in tiles of DECODE_TILE, and each tile serves every query head while its K (then V)
 * rows are in cache, so a long context is read from
 * memory once, not once per head. Scores take eight positions at a time (one accumulator per position, summed
 * across lanes together); the exp is vectorised; P @ V accumulates 64 dims at a time in registers, carried across
 * tiles in `acc`. `kv_rows[i]` is position i's K/V row offset (slot * row + kvh * dim). */
#define DECODE_TILE 128
/* The first query head of each KV group prefetches its K (then V) rows this many positions ahead into L2: blocks
 * sit at random addresses, so the hardware prefetcher restarts at every block (10-20% faster from memory). */
#define DECODE_PREFETCH 16
#define DEFINE_DECODE_AVX2(SUF, T)                                                                              \
    static void decode_task_avx2_##SUF(const float *qf, const T *k_cache, const T *v_cache, const int64_t *kv_rows, \
                                       int64_t n, int64_t group, int64_t head_group, int64_t dim, float scale,  \
                                       float *scores, float *acc, T *out) {                                      \
        float maxs[group], sums[group];                                                                          \
        for (int64_t g = 0; g < group; g++) maxs[g] = -INFINITY;                                                 \
        for (int64_t t0 = 0; t0 < n; t0 += DECODE_TILE) {                                                        \
            int64_t t1 = t0 + DECODE_TILE < n ? t0 + DECODE_TILE : n;                                            \
            for (int64_t g = 0; g < group; g++) {                                                                \
                const float *qg = qf + g * dim;                                                                  \
                const T *kc = k_cache + (g / head_group) * dim; /* this head's KV head within the row */         \
                float *sg = scores + g * n;                                                                      \
                __m256 vmax = _mm256_set1_ps(-INFINITY);                                                         \
                int64_t i = t0;                                                                                  \
                for (; i + 8 <= t1; i += 8) {                                                                    \
                    if (g % head_group == 0 && i + DECODE_PREFETCH + 8 <= n) /* the group's first head fetches */ \
                        for (int p = 0; p < 8; p++)                                                              \
                            for (int64_t d = 0; d < dim; d += 64 / (int64_t)sizeof(T))                           \
                                _mm_prefetch((const char *)(kc + kv_rows[i + DECODE_PREFETCH + p] + d),          \
                                             _MM_HINT_T1);                                                       \
                    const T *k0 = kc + kv_rows[i], *k1 = kc + kv_rows[i + 1];                          \
                    const T *k2 = kc + kv_rows[i + 2], *k3 = kc + kv_rows[i + 3];                      \
                    const T *k4 = kc + kv_rows[i + 4], *k5 = kc + kv_rows[i + 5];                      \
                    const T *k6 = kc + kv_rows[i + 6], *k7 = kc + kv_rows[i + 7];                      \
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                    for (int64_t d = 0; d < dim; d += 8) {                                                       \
                        __m256 qv = _mm256_loadu_ps(qg + d);                                                     \
                        a0 = _mm256_fmadd_ps(qv, load8_##SUF(k0 + d), a0);                                      \
                        a1 = _mm256_fmadd_ps(qv, load8_##SUF(k1 + d), a1);                                      \
                        a2 = _mm256_fmadd_ps(qv, load8_##SUF(k2 + d), a2);                                      \
                        a3 = _mm256_fmadd_ps(qv, load8_##SUF(k3 + d), a3);                                      \
                        a4 = _mm256_fmadd_ps(qv, load8_##SUF(k4 + d), a4);                                      \
                        a5 = _mm256_fmadd_ps(qv, load8_##SUF(k5 + d), a5);                                      \
                        a6 = _mm256_fmadd_ps(qv, load8_##SUF(k6 + d), a6);                                      \
                        a7 = _mm256_fmadd_ps(qv, load8_##SUF(k7 + d), a7);                                      \
                    }                                                                                            \
                    __m256 sc = _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale));    \
                    _mm256_storeu_ps(sg + i, sc);                                                                \
                    vmax = _mm256_max_ps(vmax, sc);                                                              \
                }                                                                                                \
                float m = maxs[g];                                                                               \
                for (; i < t1; i++) {                                                                            \
                    const T *k = kc + kv_rows[i];                                                                \
                    __m256 a = _mm256_setzero_ps();                                                              \
                    for (int64_t d = 0; d < dim; d += 8)                                                         \
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8_##SUF(k + d), a);                     \
                    sg[i] = sum8(a) * scale;                                                                     \
                    if (sg[i] > m) m = sg[i];                                                                    \
                }                                                                                                \
                float lanes[8];                                                                                  \
                _mm256_storeu_ps(lanes, vmax);                                                                   \
                for (int j = 0; j < 8; j++) if (lanes[j] > m) m = lanes[j];                                      \
                maxs[g] = m;                                                                                     \
            }                                                                                                    \
        }                                                                                                        \
        /* exp and the normaliser (unrounded), then the weights as the dtype rounds them */                      \
        for (int64_t g = 0; g < group; g++) {                                                                    \
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
        for (int64_t t0 = 0; t0 < n; t0 += DECODE_TILE) {                                                        \
            int64_t t1 = t0 + DECODE_TILE < n ? t0 + DECODE_TILE : n;                                            \
            for (int64_t g = 0; g < group; g++) {                                                                \
                const float *sg = scores + g * n;                                                                \
                const T *vc = v_cache + (g / head_group) * dim;                                                  \
                for (int64_t d0 = 0; d0 < dim; d0 += 64) {                                                       \
                    int64_t chunks = (dim - d0 < 64 ? dim - d0 : 64) / 8;                                        \
                    float *ag = acc + g * dim + d0;                                                              \
                    __m256 r[8];                                                                                 \
                    for (int c = 0; c < chunks; c++) r[c] = _mm256_loadu_ps(ag + 8 * c);                         \
                    if (chunks == 8) {                                                                           \
                        for (int64_t j = t0; j < t1; j++) {                                                      \
                            const T *v = vc + kv_rows[j] + d0;                                                   \
                            if (g % head_group == 0 && j + DECODE_PREFETCH < n) {                                \
                                const T *ahead = vc + kv_rows[j + DECODE_PREFETCH] + d0;                         \
                                for (int64_t d = 0; d < 64; d += 64 / (int64_t)sizeof(T))                        \
                                    _mm_prefetch((const char *)(ahead + d), _MM_HINT_T1);                        \
                            }                                                                                    \
                            __m256 w = _mm256_set1_ps(sg[j]);                                                    \
                            r[0] = _mm256_fmadd_ps(w, load8_##SUF(v), r[0]);                                    \
                            r[1] = _mm256_fmadd_ps(w, load8_##SUF(v + 8), r[1]);                                \
                            r[2] = _mm256_fmadd_ps(w, load8_##SUF(v + 16), r[2]);                               \
                            r[3] = _mm256_fmadd_ps(w, load8_##SUF(v + 24), r[3]);                               \
                            r[4] = _mm256_fmadd_ps(w, load8_##SUF(v + 32), r[4]);                               \
                            r[5] = _mm256_fmadd_ps(w, load8_##SUF(v + 40), r[5]);                               \
                            r[6] = _mm256_fmadd_ps(w, load8_##SUF(v + 48), r[6]);                               \
                            r[7] = _mm256_fmadd_ps(w, load8_##SUF(v + 56), r[7]);                               \
                        }                                                                                        \
                    } else {                                                                                     \
                        for (int64_t j = t0; j < t1; j++) {                                                      \
                            const T *v = vc + kv_rows[j] + d0;                                                   \
                            __m256 w = _mm256_set1_ps(sg[j]);                                                    \
                            for (int c = 0; c < chunks; c++) r[c] = _mm256_fmadd_ps(w, load8_##SUF(v + 8 * c), r[c]); \
                        }                                                                                        \
                    }                                                                                            \
                    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(ag + 8 * c, r[c]);                         \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            float inv = sums[g] > 0.f ? 1.0f / sums[g] : 0.f;                                                    \
            for (int64_t d = 0; d < dim; d++) store_##SUF(out + g * dim + d, acc[g * dim + d] * inv);            \
        }                                                                                                        \
    }

DEFINE_DECODE_AVX2(f32, float)
DEFINE_DECODE_AVX2(bf16, bf16_t)
#endif

#ifdef KSANA_AVX2
/* silu(g) = g / (1 + e^-g), with e^-g from e^-|g| (or its inverse) so the exp argument is never positive. */
static inline __m256 silu8(__m256 g) {
    __m256 t = exp_nonpositive(_mm256_or_ps(_mm256_set1_ps(-0.0f), g)); /* e^-|g| */
    t = _mm256_blendv_ps(t, _mm256_div_ps(_mm256_set1_ps(1.0f), t), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}
#define SILU_AND_MUL_AVX2(SUF)                                                                                  \
    for (; j + 8 <= d; j += 8) {                                                                                \
        __m256 prod = _mm256_mul_ps(round8_##SUF(silu8(load8_##SUF(g + j))), load8_##SUF(u + j));               \
        float vals[8];                                                                                          \
        _mm256_storeu_ps(vals, prod);                                                                           \
        for (int l = 0; l < 8; l++) store_##SUF(o + j + l, vals[l]);                                            \
    }
#define DECODE_AVX2 1
#define DECODE_TASK_AVX2(SUF) decode_task_avx2_##SUF
#else
#define SILU_AND_MUL_AVX2(SUF)
#define DECODE_AVX2 0
#define DECODE_TASK_AVX2(SUF) decode_task_scalar_##SUF
#endif

#define DEFINE_KERNELS(SUF, T)                                                                                  \
    /* out = w * round(r * rsqrt(mean(r^2) + eps)), r = x (+ add, rounded, also written to residual_out). */    \
    void rms_norm_##SUF(const T *x, int64_t x_stride, const T *add, T *residual_out, const T *w, T *out,        \
                        int64_t rows, int64_t dim, float eps, int nthreads) {                                   \
        _Pragma("omp parallel for num_threads(nthreads) if (rows * dim >= PARALLEL_MIN_ELEMS)")                 \
        for (int64_t i = 0; i < rows; i++) {                                                                     \
            const T *src = x + i * x_stride;                                                                     \
            T *o = out + i * dim;                                                                                \
            if (add) { /* the new residual, rounded as torch's add rounds; it is what gets normalised */         \
                const T *ar = add + i * dim;                                                                     \
                T *res = residual_out + i * dim;                                                                 \
                for (int64_t d = 0; d < dim; d++) store_##SUF(res + d, load_##SUF(src + d) + load_##SUF(ar + d)); \
                src = res;                                                                                       \
            }                                                                                                    \
            float ss = 0.f;                                                                                      \
            _Pragma("omp simd reduction(+ : ss)")                                                                \
            for (int64_t d = 0; d < dim; d++) ss += load_##SUF(src + d) * load_##SUF(src + d);                   \
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                                     \
            for (int64_t d = 0; d < dim; d++)                                                                    \
                store_##SUF(o + d, load_##SUF(w + d) * round_##SUF(load_##SUF(src + d) * inv));                  \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* neox rotary: out[t, h] = round(round(x * cos) + round(rot(x) * sin)), rot(x) = [-x2, x1]. */             \
    void rotary_neox_##SUF(const T *x, int64_t tok_stride, const T *cos, const T *sin, T *out, int64_t ntok,    \
                           int64_t nheads, int64_t dim, int nthreads) {                                          \
        int64_t half = dim / 2;                                                                                  \
        _Pragma("omp parallel for num_threads(nthreads) if (ntok * nheads * dim >= PARALLEL_MIN_ELEMS)")        \
        for (int64_t t = 0; t < ntok; t++) {                                                                     \
            const T *c = cos + t * dim, *s = sin + t * dim;                                                      \
            for (int64_t h = 0; h < nheads; h++) {                                                               \
                const T *xh = x + t * tok_stride + h * dim;                                                      \
                T *o = out + (t * nheads + h) * dim;                                                             \
                for (int64_t d = 0; d < half; d++) {                                                             \
                    float a = load_##SUF(xh + d), b = load_##SUF(xh + d + half);                                 \
                    float c1 = load_##SUF(c + d), s1 = load_##SUF(s + d);                                        \
                    float c2 = load_##SUF(c + d + half), s2 = load_##SUF(s + d + half);                          \
                    store_##SUF(o + d, round_##SUF(a * c1) + round_##SUF(-b * s1));                              \
                    store_##SUF(o + d + half, round_##SUF(b * c2) + round_##SUF(a * s2));                        \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* out[:, :d] = round(round(silu(gate)) * up) for x = [gate | up]. */                                        \
    void silu_and_mul_##SUF(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t d, int nthreads) {     \
        _Pragma("omp parallel for num_threads(nthreads) if (rows * d >= PARALLEL_MIN_ELEMS)")                   \
        for (int64_t i = 0; i < rows; i++) {                                                                     \
            const T *g = x + i * x_stride, *u = g + d;                                                           \
            T *o = out + i * d;                                                                                  \
            int64_t j = 0;                                                                                       \
            SILU_AND_MUL_AVX2(SUF)                                                                               \
            for (; j < d; j++) {                                                                                 \
                float gv = load_##SUF(g + j);                                                                    \
                float sv = round_##SUF(gv / (1.0f + expf(-gv)));                                                 \
                store_##SUF(o + j, sv * load_##SUF(u + j));                                                      \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* Copy each token's K/V row (num_kv_heads * head_dim values) into its cache slot. */                        \
    void store_kv_##SUF(const T *key, int64_t key_stride, const T *value, int64_t value_stride, T *k_cache,     \
                        T *v_cache, const int64_t *slots, int64_t ntok, int64_t row) {                          \
        for (int64_t t = 0; t < ntok; t++) {                                                                     \
            memcpy(k_cache + slots[t] * row, key + t * key_stride, sizeof(T) * row);                             \
            memcpy(v_cache + slots[t] * row, value + t * value_stride, sizeof(T) * row);                         \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* One decode task in portable C (same layout as the AVX2 one): the fallback for other CPUs and head sizes. */\
    static void decode_task_scalar_##SUF(const float *qf, const T *k_cache, const T *v_cache,                   \
                                         const int64_t *kv_rows, int64_t n, int64_t group, int64_t head_group,   \
                                         int64_t dim, float scale, float *scores, float *acc, T *out) {          \
        (void)acc; /* the scalar path accumulates one output at a time */                                        \
        for (int64_t g = 0; g < group; g++) {                                                                    \
            const float *qg = qf + g * dim;                                                                      \
            const T *kc = k_cache + (g / head_group) * dim, *vc = v_cache + (g / head_group) * dim;              \
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
            float inv = sum > 0.f ? 1.0f / sum : 0.f;                                                            \
            T *o = out + g * dim;                                                                                \
            for (int64_t d = 0; d < dim; d++) {                                                                  \
                float acc = 0.f;                                                                                 \
                for (int64_t i = 0; i < n; i++) acc = fmaf(sg[i], load_##SUF(vc + kv_rows[i] + d), acc);        \
                store_##SUF(o + d, acc * inv);                                                                   \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* One new token per sequence over its paged context. One task per (sequence, KV head): the task reads its  \
     * head's keys and values once, for all query heads of the group. Two passes (scores, then the weighted sum  \
     * of values) keep the softmax exact without rescaling. With window > 0 only the last `window` positions.   \
     * As in SDPA's bf16 kernel, the unnormalised probabilities are rounded to bf16 before they weight V (the    \
     * sum that normalises them is not), so bf16 models follow transformers' rounding.                          \
     */                                                                                                          \
    void paged_decode_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                   \
                            const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, T *out,  \
                            int64_t batch, int64_t nheads, int64_t nkv, int64_t dim, int64_t block_size,         \
                            float scale, int64_t window, int nthreads) {                                         \
        int64_t group = nheads / nkv;                                                                            \
        int64_t row = nkv * dim;                                                                                 \
        int64_t positions = 0;                                                                                   \
        for (int64_t b = 0; b < batch; b++)                                                                      \
            positions += (window > 0 && seq_lens[b] > window) ? window : seq_lens[b];                            \
        int parallel = positions * nheads * dim >= PARALLEL_MIN_ATTENTION_WORK;                                  \
        /* A task is one sequence's KV heads (all of them when the batch alone keeps the threads busy: each      \
         * position's row is then read whole and in order; else one KV head, so a long single sequence still    \
         * spreads over the threads). */                                                                         \
        int64_t kv_per_task = batch >= 2 * nthreads ? nkv : 1;                                                   \
        int64_t tasks_per_seq = nkv / kv_per_task, heads_per_task = kv_per_task * group;                         \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (parallel)")                     \
        for (int64_t task = 0; task < batch * tasks_per_seq; task++) {                                           \
            int64_t b = task / tasks_per_seq, kv0 = (task % tasks_per_seq) * kv_per_task;                         \
            int64_t len = seq_lens[b];                                                                           \
            int64_t start = (window > 0 && len > window) ? len - window : 0;                                     \
            int64_t n = len - start;                                                                             \
            const int64_t *table = block_tables + b * table_stride;                                              \
            float *qf = (float *)malloc(sizeof(float) * heads_per_task * dim);                                   \
            float *scores = (float *)malloc(sizeof(float) * heads_per_task * (n > 0 ? n : 1));                   \
            int64_t *kv_rows = (int64_t *)malloc(sizeof(int64_t) * (n > 0 ? n : 1));                             \
            float *acc = (float *)malloc(sizeof(float) * heads_per_task * dim);                                  \
            for (int64_t i = 0; i < n; i++) {                                                                    \
                int64_t p = start + i;                                                                           \
                kv_rows[i] = (table[p / block_size] * block_size + p % block_size) * row + kv0 * dim;            \
            }                                                                                                    \
            const T *qh = q + b * q_stride + kv0 * group * dim;                                                  \
            for (int64_t j = 0; j < heads_per_task * dim; j++) qf[j] = load_##SUF(qh + j);                       \
            T *o = out + (b * nheads + kv0 * group) * dim;                                                       \
            if (DECODE_AVX2 && dim % 8 == 0)                                                                     \
                DECODE_TASK_AVX2(SUF)(qf, k_cache, v_cache, kv_rows, n, heads_per_task, group, dim, scale,       \
                                      scores, acc, o);                                                           \
            else                                                                                                 \
                decode_task_scalar_##SUF(qf, k_cache, v_cache, kv_rows, n, heads_per_task, group, dim, scale,    \
                                         scores, acc, o);                                                        \
            free(qf);                                                                                            \
            free(scores);                                                                                        \
            free(kv_rows);                                                                                       \
            free(acc);                                                                                           \
        }                                                                                                        \
    }

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, bf16_t)

/* Greedy sampling's two numbers per row of float32 logits, in two passes over the row and no [rows, vocab]
 * temporary: the index of the first maximum (as torch's argmax; a NaN counts as the maximum, the first one wins)
 * and log_softmax's value there, -log(sum(exp(x - max))) (NaN where log_softmax gives NaN: a NaN or an infinite
 * maximum). The sum's exp and order differ from torch's, so the log-probability agrees to float32 rounding. */
void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs,
                     int nthreads) {
    _Pragma("omp parallel for num_threads(nthreads) if (rows * vocab >= 4 * PARALLEL_MIN_ELEMS)")
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        float m = -INFINITY;
        int64_t id = 0, i = 0;
        int has_nan = 0;
#ifdef KSANA_AVX2
        if (vocab >= 8 && vocab < INT32_MAX) {
            __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
            __m256i vidx = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i step = _mm256_set1_epi32(8);
            for (; i + 8 <= vocab; i += 8) {
                __m256 v = _mm256_loadu_ps(x + i);
                __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
                vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                vmax = _mm256_blendv_ps(vmax, v, gt);
                vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
                cur = _mm256_add_epi32(cur, step);
            }
            has_nan = _mm256_movemask_ps(vnan) != 0;
            float lane_max[8];
            int32_t lane_idx[8];
            _mm256_storeu_ps(lane_max, vmax);
            _mm256_storeu_si256((__m256i *)lane_idx, vidx);
            id = lane_idx[0], m = lane_max[0];
            for (int l = 1; l < 8; l++) /* lanes interleave indices: on a tie the smaller index is the first */
                if (lane_max[l] > m || (lane_max[l] == m && lane_idx[l] < id)) m = lane_max[l], id = lane_idx[l];
            if (m == -INFINITY) id = 0; /* no lane rose above -inf: every value so far is -inf */
        }
#endif
        for (; i < vocab; i++) {
            if (x[i] != x[i]) has_nan = 1;
            else if (x[i] > m) m = x[i], id = i;
        }
        if (has_nan) {
            for (id = 0; x[id] == x[id]; id++) {}
            ids[r] = id;
            logprobs[r] = NAN;
            continue;
        }
        ids[r] = id;
        if (!isfinite(m)) {
            logprobs[r] = NAN;
            continue;
        }
        float sum = 0.f;
        i = 0;
#ifdef KSANA_AVX2
        __m256 vsum = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
        for (; i + 8 <= vocab; i += 8)
            vsum = _mm256_add_ps(vsum, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
        sum = sum8(vsum);
#endif
        for (; i < vocab; i++) sum += expf(x[i] - m);
        logprobs[r] = -logf(sum);
    }
}

/* ---- Small-batch linear layers: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), for decode-sized M ----------------
 *
 * BLAS is tuned for big products; at decode's M (1-64 rows) MKL reaches a fraction of this CPU's matmul rate
 * and, from M = 4, of its memory bandwidth. Here weight rows are read straight from their torch layout (no packed
 * copy): a tile of 4 weight rows and up to 6 input rows keeps 24 float32 accumulators along K in registers, so
 * each weight vector loaded serves every input row of the tile; the 4 x 6 dot products are summed across lanes
 * at the end. Each thread walks its share of 4-row weight tiles once, passing every input-row tile over a tile
 * while it is in L1, and prefetches the next tile's rows into L2 during the first pass (the hardware prefetcher
 * stops at page boundaries, and short rows never let it ramp up; into L1 measured about 10% slower at 16-64 rows,
 * as the prefetches then hold the few L1 fill buffers). bfloat16 inputs are widened to float32 once per call,
 * weights per load; accumulation is float32 and each output is rounded once, as oneDNN's bfloat16 matmul does.
 * Built only for AVX-512 (the tile needs its 32 vector registers); `linear_available` tells Python, and other
 * CPUs keep BLAS.
 */
#if defined(KSANA_AVX512)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

#define LINEAR_MR 6          /* input rows per tile */
#define LINEAR_PARALLEL_MIN (1 << 18) /* M * N * K below this stays on the calling thread */

static inline __m512 w16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 w16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 w16m_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 w16m_bf16(const bf16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    __m128 b4 = _mm_add_ps(_mm256_castps256_ps128(b8), _mm256_extractf128_ps(b8, 1));
    __m128 c4 = _mm_add_ps(_mm256_castps256_ps128(c8), _mm256_extractf128_ps(c8, 1));
    __m128 d4 = _mm_add_ps(_mm256_castps256_ps128(d8), _mm256_extractf128_ps(d8, 1));
    return _mm_hadd_ps(_mm_hadd_ps(a4, b4), _mm_hadd_ps(c4, d4));
}

/* One tile: MR input rows (float32, `xs` apart) x 4 weight rows (w0..w3; fewer real ones repeat w0 and `nr`
 * says how many outputs to write). */
#define DEFINE_LINEAR_TILE(SUF, T, MR)                                                                          \
    static void linear_tile_##SUF##_##MR(const float *x, int64_t xs, const T *w0, const T *w1, const T *w2,    \
                                         const T *w3, int64_t K, const T *bias, T *out, int64_t ldo, int nr,    \
                                         const T *next) {                                                       \
        __m512 acc[MR][4];                                                                                       \
        for (int m = 0; m < MR; m++)                                                                             \
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();                                         \
        int64_t k = 0;                                                                                           \
        for (; k + 16 <= K; k += 16) {                                                                           \
            __m512 b0 = w16_##SUF(w0 + k), b1 = w16_##SUF(w1 + k), b2 = w16_##SUF(w2 + k), b3 = w16_##SUF(w3 + k); \
            if (next) { /* the next tile's four rows into L2, one cache line of each per 16 columns */        \
                _mm_prefetch((const char *)(next + k), _MM_HINT_T1);                                             \
                _mm_prefetch((const char *)(next + K + k), _MM_HINT_T1);                                         \
                _mm_prefetch((const char *)(next + 2 * K + k), _MM_HINT_T1);                                     \
                _mm_prefetch((const char *)(next + 3 * K + k), _MM_HINT_T1);                                     \
            }                                                                                                    \
            for (int m = 0; m < MR; m++) {                                                                       \
                __m512 a = _mm512_loadu_ps(x + m * xs + k);                                                      \
                acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);                                                   \
                acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);                                                   \
                acc[m][2] = _mm512_fmadd_ps(a, b2, acc[m][2]);                                                   \
                acc[m][3] = _mm512_fmadd_ps(a, b3, acc[m][3]);                                                   \
            }                                                                                                    \
        }                                                                                                        \
        if (k < K) {                                                                                             \
            __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);                                                  \
            __m512 b0 = w16m_##SUF(w0 + k, mask), b1 = w16m_##SUF(w1 + k, mask);                                 \
            __m512 b2 = w16m_##SUF(w2 + k, mask), b3 = w16m_##SUF(w3 + k, mask);                                 \
            for (int m = 0; m < MR; m++) {                                                                       \
                __m512 a = _mm512_maskz_loadu_ps(mask, x + m * xs + k);                                          \
                acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);                                                   \
                acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);                                                   \
                acc[m][2] = _mm512_fmadd_ps(a, b2, acc[m][2]);                                                   \
                acc[m][3] = _mm512_fmadd_ps(a, b3, acc[m][3]);                                                   \
            }                                                                                                    \
        }                                                                                                        \
        float bias4[4] = {0.f, 0.f, 0.f, 0.f};                                                                   \
        if (bias)                                                                                                \
            for (int j = 0; j < nr; j++) bias4[j] = load_##SUF(bias + j);                                        \
        for (int m = 0; m < MR; m++) {                                                                           \
            float sums[4];                                                                                       \
            _mm_storeu_ps(sums, _mm_add_ps(sum4x16(acc[m][0], acc[m][1], acc[m][2], acc[m][3]),                  \
                                           _mm_loadu_ps(bias4)));                                                \
            for (int j = 0; j < nr; j++) store_##SUF(out + m * ldo + j, sums[j]);                                \
        }                                                                                                        \
    }

#define DEFINE_LINEAR(SUF, T)                                                                                   \
    DEFINE_LINEAR_TILE(SUF, T, 1)                                                                                \
    DEFINE_LINEAR_TILE(SUF, T, 2)                                                                                \
    DEFINE_LINEAR_TILE(SUF, T, 3)                                                                                \
    DEFINE_LINEAR_TILE(SUF, T, 4)                                                                                \
    DEFINE_LINEAR_TILE(SUF, T, 5)                                                                                \
    DEFINE_LINEAR_TILE(SUF, T, 6)                                                                                \
    typedef void (*linear_tile_##SUF##_fn)(const float *, int64_t, const T *, const T *, const T *, const T *,  \
                                           int64_t, const T *, T *, int64_t, int, const T *);                    \
    static const linear_tile_##SUF##_fn linear_tiles_##SUF[LINEAR_MR + 1] = {                                    \
        NULL, linear_tile_##SUF##_1, linear_tile_##SUF##_2, linear_tile_##SUF##_3,                               \
        linear_tile_##SUF##_4, linear_tile_##SUF##_5, linear_tile_##SUF##_6};                                    \
                                                                                                                 \
    /* x: M rows `x_stride` apart; w: N rows of K, contiguous; bias: N or NULL; out: M x N, contiguous. */       \
    void linear_##SUF(const T *x, int64_t x_stride, const T *w, const T *bias, T *out, int64_t M, int64_t N,    \
                      int64_t K, int nthreads) {                                                                 \
        const float *xf = (const float *)(const void *)x;                                                        \
        int64_t xs = x_stride;                                                                                   \
        float *widened = NULL;                                                                                   \
        if (sizeof(T) != sizeof(float)) { /* bfloat16 input rows, widened once */                               \
            widened = (float *)malloc(sizeof(float) * M * K);                                                    \
            for (int64_t m = 0; m < M; m++)                                                                      \
                for (int64_t k = 0; k < K; k++) widened[m * K + k] = load_##SUF(x + m * x_stride + k);           \
            xf = widened;                                                                                        \
            xs = K;                                                                                              \
        }                                                                                                        \
        int64_t ntiles = (N + 3) / 4, mtiles = (M + LINEAR_MR - 1) / LINEAR_MR;                                 \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (M * N * K >= LINEAR_PARALLEL_MIN)") \
        for (int64_t t = 0; t < ntiles; t++) {                                                                   \
            int64_t n0 = 4 * t;                                                                                  \
            int nr = N - n0 < 4 ? (int)(N - n0) : 4;                                                             \
            const T *w0 = w + n0 * K, *w1 = nr > 1 ? w0 + K : w0, *w2 = nr > 2 ? w0 + 2 * K : w0;                \
            const T *w3 = nr > 3 ? w0 + 3 * K : w0;                                                              \
            for (int64_t i = 0; i < mtiles; i++) { /* rows split evenly: 8 = 4 + 4, not 6 + 2 */               \
                int64_t m0 = i * M / mtiles, mr = (i + 1) * M / mtiles - m0;                                     \
                linear_tiles_##SUF[mr](xf + m0 * xs, xs, w0, w1, w2, w3, K, bias ? bias + n0 : NULL,             \
                                       out + m0 * N + n0, N, nr, m0 == 0 && n0 + 8 <= N ? w0 + 4 * K : NULL); \
            }                                                                                                    \
        }                                                                                                        \
        free(widened);                                                                                           \
    }

DEFINE_LINEAR(f32, float)
DEFINE_LINEAR(bf16, bf16_t)

/* ---- A decode step's decoder layers in one call ---------------------------------------------------------------
 *
 * The same ops, in the same order and with the same threading, as DecoderLayer.forward over the native kernels,
 * so the results are identical to the op-by-op path; what goes is Python between the ops. On this CPU each op
 * called from Python costs tens of microseconds once the matmul before it has streamed megabytes of weights
 * through the caches (the interpreter's own working set is evicted), about ten calls a layer.
 * `table` holds DECODE_LAYER_FIELDS addresses per layer (see kernels/cpu/ops.py, DecodeLayerWeights); biases may
 * be 0. `h` [M, hidden] is the embedding on entry and the last layer's MLP output on return; `residual` receives
 * the residual stream (the final norm adds them, as the Python loop leaves it).
 */
#define DECODE_LAYER_FIELDS 12
#define DEFINE_DECODE_LAYERS(SUF, T)                                                                            \
    void decode_layers_##SUF(const int64_t *table, const int64_t *windows, int64_t nlayers, T *h, T *residual,  \
                             int64_t M, int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter, \
                             const T *cos, const T *sin, const int64_t *slots, const int64_t *block_tables,     \
                             int64_t table_stride, const int64_t *seq_lens, int64_t block_size, float eps,      \
                             float scale, int nthreads) {                                                        \
        int64_t q = nheads * dim, kv = nkv * dim, qkv_n = q + 2 * kv;                                            \
        T *x = (T *)malloc(sizeof(T) * M * hidden), *qkv = (T *)malloc(sizeof(T) * M * qkv_n);                  \
        T *qk = (T *)malloc(sizeof(T) * M * (q + kv)), *attn = (T *)malloc(sizeof(T) * M * q);                  \
        T *gate_up = (T *)malloc(sizeof(T) * M * 2 * inter), *act = (T *)malloc(sizeof(T) * M * inter);         \
        for (int64_t l = 0; l < nlayers; l++) {                                                                  \
            const int64_t *f = table + l * DECODE_LAYER_FIELDS;                                                  \
            const T *in_norm = (const T *)(intptr_t)f[0], *qkv_w = (const T *)(intptr_t)f[1];                    \
            const T *qkv_b = (const T *)(intptr_t)f[2], *o_w = (const T *)(intptr_t)f[3];                        \
            const T *o_b = (const T *)(intptr_t)f[4], *post_norm = (const T *)(intptr_t)f[5];                    \
            const T *gate_up_w = (const T *)(intptr_t)f[6], *gate_up_b = (const T *)(intptr_t)f[7];              \
            const T *down_w = (const T *)(intptr_t)f[8], *down_b = (const T *)(intptr_t)f[9];                    \
            T *k_cache = (T *)(intptr_t)f[10], *v_cache = (T *)(intptr_t)f[11];                                  \
            if (l == 0) { /* residual = h; x = norm(h) */                                                        \
                memcpy(residual, h, sizeof(T) * M * hidden);                                                     \
                rms_norm_##SUF(h, hidden, NULL, NULL, in_norm, x, M, hidden, eps, nthreads);                     \
            } else { /* residual += h; x = norm(residual) (elementwise, so in place) */                          \
                rms_norm_##SUF(h, hidden, residual, residual, in_norm, x, M, hidden, eps, nthreads);             \
            }                                                                                                    \
            linear_##SUF(x, hidden, qkv_w, qkv_b, qkv, M, qkv_n, hidden, nthreads);                              \
            rotary_neox_##SUF(qkv, qkv_n, cos, sin, qk, M, nheads + nkv, dim, nthreads);                         \
            store_kv_##SUF(qk + q, q + kv, qkv + q + kv, qkv_n, k_cache, v_cache, slots, M, kv);                 \
            paged_decode_##SUF(qk, q + kv, k_cache, v_cache, block_tables, table_stride, seq_lens, attn, M,      \
                               nheads, nkv, dim, block_size, scale, windows[l], nthreads);                       \
            linear_##SUF(attn, q, o_w, o_b, h, M, hidden, q, nthreads);                                          \
            rms_norm_##SUF(h, hidden, residual, residual, post_norm, x, M, hidden, eps, nthreads);               \
            linear_##SUF(x, hidden, gate_up_w, gate_up_b, gate_up, M, 2 * inter, hidden, nthreads);              \
            silu_and_mul_##SUF(gate_up, 2 * inter, act, M, inter, nthreads);                                     \
            linear_##SUF(act, inter, down_w, down_b, h, M, hidden, inter, nthreads);                             \
        }                                                                                                        \
        free(x);                                                                                                 \
        free(qkv);                                                                                               \
        free(qk);                                                                                                \
        free(attn);                                                                                              \
        free(gate_up);                                                                                           \
        free(act);                                                                                               \
    }

DEFINE_DECODE_LAYERS(f32, float)
DEFINE_DECODE_LAYERS(bf16, bf16_t)
#pragma GCC pop_options
int linear_available(void) { return 1; }
#else
/* Without AVX-512 `linear_*` only exist so every build exports the same names; Python never calls them. */
void linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out, int64_t M,
                int64_t N, int64_t K, int nthreads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)nthreads;
    abort();
}
void linear_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *w, const bf16_t *bias, bf16_t *out, int64_t M,
                 int64_t N, int64_t K, int nthreads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)nthreads;
    abort();
}
void decode_layers_f32(void) { abort(); }
void decode_layers_bf16(void) { abort(); }
int linear_available(void) { return 0; }
#endif
