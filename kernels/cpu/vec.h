// Float32 lanes for every instruction set: one source for the CPU kernels' vector code.
//
// F32x8 wraps __m256 where the build targets AVX2/FMA, two float32x4_t on NEON, and a plain array elsewhere, which
// the compiler vectorises as it can. F32x16 wraps __m512 where the build targets AVX-512, and is two F32x8
// elsewhere: a kernel written over a lane type V runs 16 lanes wide on AVX-512, and the same 16-lane code runs (and
// is tested, bit for bit) on any other CPU as pairs of 8. `Wide` is the type a kernel takes for its widest lanes. Every operation rounds exactly as IEEE float32 does lane by lane (the fused
// multiply-adds are explicit and round once), and the reductions add in one fixed tree, so a kernel written on
// F32x8 gives the same bits on every instruction set. bfloat16 values travel as uint16_t and widen exactly; they
// narrow rounding to nearest even, as torch rounds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KSANA_VEC_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KSANA_VEC_AVX512 1
#endif
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define KSANA_VEC_NEON 1
#endif

namespace ksana {

using bf16 = uint16_t;

inline float bf16_to_f32(bf16 h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<bf16>(u >> 16);
}

// One value of T as float32, and back (rounded to T); round_to<T>(x) = the float32 value of T(x).
inline float load1(const float *p) { return *p; }
inline float load1(const bf16 *p) { return bf16_to_f32(*p); }
inline void store1(float *p, float x) { *p = x; }
inline void store1(bf16 *p, float x) { *p = f32_to_bf16(x); }
template <typename T> inline float round_to(float x) { return x; }
template <> inline float round_to<bf16>(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#if KSANA_VEC_AVX2
struct F32x8 {
    __m256 v;
    static constexpr int lanes = 8;
    static F32x8 zero() { return {_mm256_setzero_ps()}; }
    static F32x8 splat(float x) { return {_mm256_set1_ps(x)}; }
    static F32x8 load(const float *p) { return {_mm256_loadu_ps(p)}; }
    static F32x8 load(const bf16 *p) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
    }
    // The first n lanes (0 <= n <= 8) from p, `fill` in the others; the others are not read.
    static F32x8 load_first(const float *p, int n, float fill) {
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, live), _mm256_castsi256_ps(live))};
    }
    void store_first(float *p, int n) const {
        _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
    }
    void store(float *p) const { _mm256_storeu_ps(p, v); }
    void store(bf16 *p) const {  // as f32_to_bf16, lane by lane
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    // Rounded to bfloat16 and widened again (finite lanes).
    F32x8 round_bf16() const {
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
        return {_mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
    }
    friend F32x8 operator+(F32x8 a, F32x8 b) { return {_mm256_add_ps(a.v, b.v)}; }
    friend F32x8 operator-(F32x8 a, F32x8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
    friend F32x8 operator*(F32x8 a, F32x8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
    friend F32x8 operator-(F32x8 a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }
    friend F32x8 operator/(F32x8 a, F32x8 b) { return {_mm256_div_ps(a.v, b.v)}; }
    F32x8 neg_abs() const { return {_mm256_or_ps(v, _mm256_set1_ps(-0.0f))}; }  // -|v|
    // Lane by lane: neg where `sign` < 0, else other.
    static F32x8 where_negative(F32x8 sign, F32x8 neg, F32x8 other) {
        return {_mm256_blendv_ps(other.v, neg.v, _mm256_cmp_ps(sign.v, _mm256_setzero_ps(), _CMP_LT_OQ))};
    }
    // a * b + c, rounded once.
    static F32x8 fma(F32x8 a, F32x8 b, F32x8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
    // a > b ? a : b lane by lane (a NaN lane in either gives b's).
    static F32x8 max(F32x8 a, F32x8 b) { return {_mm256_max_ps(a.v, b.v)}; }
    // Rounded to the nearest integer, ties to even.
    F32x8 round_even() const { return {_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
    // 2^n for integral lanes n in [-126, 127].
    F32x8 exp2_integral() const {
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(127)), 23);
        return {_mm256_castsi256_ps(e)};
    }
    // Bit i set where lane i is NaN; where lane i equals o's.
    int nan_mask() const { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
    int eq_mask(F32x8 o) const { return _mm256_movemask_ps(_mm256_cmp_ps(v, o.v, _CMP_EQ_OQ)); }
    int gt_mask(F32x8 o) const { return _mm256_movemask_ps(_mm256_cmp_ps(v, o.v, _CMP_GT_OQ)); }
    // Lane i: a's where bit i of `mask` is set, else b's.
    static F32x8 select(int mask, F32x8 a, F32x8 b) {
        __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(mask), bit), bit);
        return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(on))};
    }
    // (v0 + v4 + v2 + v6) + (v1 + v5 + v3 + v7), in that tree.
    float sum() const {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
    }
};

// Four float32 lanes: four positions' scores at a time in decode attention.
struct F32x4 {
    __m128 v;
    static F32x4 splat(float x) { return {_mm_set1_ps(x)}; }
    static F32x4 load(const float *p) { return {_mm_loadu_ps(p)}; }
    void store(float *p) const { _mm_storeu_ps(p, v); }
    friend F32x4 operator*(F32x4 a, F32x4 b) { return {_mm_mul_ps(a.v, b.v)}; }
    static F32x4 max(F32x4 a, F32x4 b) { return {_mm_max_ps(a.v, b.v)}; }  // a > b ? a : b
};

// Four vectors' sums, each in the horizontal-add tree ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)).
inline F32x4 sums4(F32x8 a0, F32x8 a1, F32x8 a2, F32x8 a3) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0.v, a1.v), _mm256_hadd_ps(a2.v, a3.v));
    return {_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1))};
}
#else
// Portable and NEON lanes: the same operations on eight floats (NEON's are its two 4-lane registers).
struct F32x8 {
    float v[8];
    static constexpr int lanes = 8;
    static F32x8 zero() { return splat(0.0f); }
    static F32x8 splat(float x) {
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = x;
        return r;
    }
    template <typename T>
    static F32x8 load(const T *p) {
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = load1(p + i);
        return r;
    }
    template <typename T>
    void store(T *p) const {
        for (int i = 0; i < 8; i++) store1(p + i, v[i]);
    }
    static F32x8 load_first(const float *p, int n, float fill) {
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = i < n ? p[i] : fill;
        return r;
    }
    void store_first(float *p, int n) const {
        for (int i = 0; i < n; i++) p[i] = v[i];
    }
    F32x8 round_bf16() const {  // finite lanes, as the AVX2 path
        F32x8 r;
        for (int i = 0; i < 8; i++) {
            uint32_t u;
            std::memcpy(&u, &v[i], 4);
            u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
            std::memcpy(&r.v[i], &u, 4);
        }
        return r;
    }
    friend F32x8 operator+(F32x8 a, F32x8 b) {
#if KSANA_VEC_NEON
        F32x8 r;
        vst1q_f32(r.v, vaddq_f32(vld1q_f32(a.v), vld1q_f32(b.v)));
        vst1q_f32(r.v + 4, vaddq_f32(vld1q_f32(a.v + 4), vld1q_f32(b.v + 4)));
        return r;
#else
        for (int i = 0; i < 8; i++) a.v[i] += b.v[i];
        return a;
#endif
    }
    friend F32x8 operator*(F32x8 a, F32x8 b) {
#if KSANA_VEC_NEON
        F32x8 r;
        vst1q_f32(r.v, vmulq_f32(vld1q_f32(a.v), vld1q_f32(b.v)));
        vst1q_f32(r.v + 4, vmulq_f32(vld1q_f32(a.v + 4), vld1q_f32(b.v + 4)));
        return r;
#else
        for (int i = 0; i < 8; i++) a.v[i] *= b.v[i];
        return a;
#endif
    }
    friend F32x8 operator-(F32x8 a) {
        for (int i = 0; i < 8; i++) a.v[i] = -a.v[i];
        return a;
    }
    friend F32x8 operator-(F32x8 a, F32x8 b) {
        for (int i = 0; i < 8; i++) a.v[i] -= b.v[i];
        return a;
    }
    friend F32x8 operator/(F32x8 a, F32x8 b) {
        for (int i = 0; i < 8; i++) a.v[i] /= b.v[i];
        return a;
    }
    F32x8 neg_abs() const {
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = -std::fabs(v[i]);
        return r;
    }
    static F32x8 where_negative(F32x8 sign, F32x8 neg, F32x8 other) {
        for (int i = 0; i < 8; i++) other.v[i] = sign.v[i] < 0.0f ? neg.v[i] : other.v[i];
        return other;
    }
    static F32x8 fma(F32x8 a, F32x8 b, F32x8 c) {
        for (int i = 0; i < 8; i++) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
        return c;
    }
    static F32x8 max(F32x8 a, F32x8 b) {
        for (int i = 0; i < 8; i++) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
        return a;
    }
    F32x8 round_even() const {  // under the default rounding mode, as the AVX2 path's explicit one
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = std::nearbyint(v[i]);
        return r;
    }
    F32x8 exp2_integral() const {
        F32x8 r;
        for (int i = 0; i < 8; i++) {
            uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(v[i]) + 127) << 23;
            std::memcpy(&r.v[i], &bits, 4);
        }
        return r;
    }
    int nan_mask() const {
        int mask = 0;
        for (int i = 0; i < 8; i++) mask |= (v[i] != v[i]) << i;
        return mask;
    }
    int eq_mask(F32x8 o) const {
        int mask = 0;
        for (int i = 0; i < 8; i++) mask |= (v[i] == o.v[i]) << i;
        return mask;
    }
    int gt_mask(F32x8 o) const {
        int mask = 0;
        for (int i = 0; i < 8; i++) mask |= (v[i] > o.v[i]) << i;
        return mask;
    }
    static F32x8 select(int mask, F32x8 a, F32x8 b) {
        F32x8 r;
        for (int i = 0; i < 8; i++) r.v[i] = mask >> i & 1 ? a.v[i] : b.v[i];
        return r;
    }
    float sum() const { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
};

struct F32x4 {
    float v[4];
    static F32x4 splat(float x) { return {{x, x, x, x}}; }
    static F32x4 load(const float *p) { return {{p[0], p[1], p[2], p[3]}}; }
    void store(float *p) const {
        for (int i = 0; i < 4; i++) p[i] = v[i];
    }
    friend F32x4 operator*(F32x4 a, F32x4 b) {
        for (int i = 0; i < 4; i++) a.v[i] *= b.v[i];
        return a;
    }
    static F32x4 max(F32x4 a, F32x4 b) {
        for (int i = 0; i < 4; i++) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
        return a;
    }
};

inline F32x4 sums4(F32x8 a0, F32x8 a1, F32x8 a2, F32x8 a3) {
    const F32x8 *a[4] = {&a0, &a1, &a2, &a3};
    F32x4 out;
    for (int k = 0; k < 4; k++) {
        const float *v = a[k]->v;
        out.v[k] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
    return out;
}
#endif

// The largest lane (NaN-free lanes; exact in any order).
inline float max_lane(F32x8 x) {
    float lanes[8];
    x.store(lanes);
    float m = lanes[0];
    for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

// r[i] = [r0[i], ..., r7[i]]: eight columns of eight rows.
inline void transpose(F32x8 (&r)[8]) {
#if KSANA_VEC_AVX2
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_ps(r[i].v, r[i + 1].v), t[i + 1] = _mm256_unpackhi_ps(r[i].v, r[i + 1].v);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
#else
    float m[8][8];
    for (int i = 0; i < 8; i++) r[i].store(m[i]);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) r[i].v[j] = m[j][i];
#endif
}

// e^x for x <= 0 (softmax arguments): 2^n * e^r with n = round(x / ln 2), |r| <= ln2/2 (ln 2 in two parts, so r is
// exact) and a degree-6 Taylor polynomial (about one ulp); arguments below -87 give (nearly) zero. The same
// operations in the same order on every instruction set and lane width, so the same bits.
template <typename V>
inline V exp_nonpositive(V x) {
    x = V::max(x, V::splat(-87.0f));
    V n = (x * V::splat(1.44269504f)).round_even();
    V r = V::fma(-n, V::splat(0.693359375f), x);
    r = V::fma(-n, V::splat(-2.12194440e-4f), r);
    V p = V::splat(1.0f / 720);
    p = V::fma(p, r, V::splat(1.0f / 120));
    p = V::fma(p, r, V::splat(1.0f / 24));
    p = V::fma(p, r, V::splat(1.0f / 6));
    p = V::fma(p, r, V::splat(0.5f));
    p = V::fma(p, r, V::splat(1.0f));
    p = V::fma(p, r, V::splat(1.0f));
    return p * n.exp2_integral();
}

#if KSANA_VEC_AVX512
struct F32x16 {
    __m512 v;
    static constexpr int lanes = 16;
    static F32x16 zero() { return {_mm512_setzero_ps()}; }
    static F32x16 splat(float x) { return {_mm512_set1_ps(x)}; }
    static F32x16 load(const float *p) { return {_mm512_loadu_ps(p)}; }
    static F32x16 load(const bf16 *p) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    }
    static F32x16 load_first(const float *p, int n, float fill) {
        return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1u), p)};
    }
    void store_first(float *p, int n) const { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v); }
    void store(float *p) const { _mm512_storeu_ps(p, v); }
    void store(bf16 *p) const {  // as f32_to_bf16, lane by lane
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16(r));
    }
    F32x16 round_bf16() const {  // finite lanes, as F32x8's
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        return {_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
    }
    friend F32x16 operator+(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
    friend F32x16 operator-(F32x16 a, F32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
    friend F32x16 operator*(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
    friend F32x16 operator-(F32x16 a) { return {_mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(a.v), _mm512_set1_epi32(static_cast<int>(0x80000000u))))}; }
    friend F32x16 operator/(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
    F32x16 neg_abs() const { return {_mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))))}; }
    static F32x16 where_negative(F32x16 sign, F32x16 neg, F32x16 other) {
        return {_mm512_mask_mov_ps(other.v, _mm512_cmp_ps_mask(sign.v, _mm512_setzero_ps(), _CMP_LT_OQ), neg.v)};
    }
    static F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
    static F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
    F32x16 round_even() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
    F32x16 exp2_integral() const {
        __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127)), 23);
        return {_mm512_castsi512_ps(e)};
    }
    // The low and high eight lanes added: eight lanes whose sum is this vector's.
    F32x8 fold() const { return {_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))}; }
    float sum() const { return fold().sum(); }  // the tree of _mm512_reduce_add_ps
    float max_lane() const { return _mm512_reduce_max_ps(v); }
    int nan_mask() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
    int gt_mask(F32x16 o) const { return _mm512_cmp_ps_mask(v, o.v, _CMP_GT_OQ); }
    static F32x16 select(int mask, F32x16 a, F32x16 b) {
        return {_mm512_mask_mov_ps(b.v, static_cast<__mmask16>(mask), a.v)};
    }
};

// r[i] = [r0[i], ..., r15[i]]: sixteen columns of sixteen rows (the 8x8 transpose's two stages, then two across
// the 128-bit lanes).
inline void transpose(F32x16 (&r)[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v), t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++)
        r[j].v = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88), r[j + 8].v = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
}
#else
// Sixteen lanes as two F32x8: the same values lane by lane, and sum() in the same tree, as AVX-512's.
struct F32x16 {
    F32x8 lo, hi;
    static constexpr int lanes = 16;
    static F32x16 zero() { return {F32x8::zero(), F32x8::zero()}; }
    static F32x16 splat(float x) { return {F32x8::splat(x), F32x8::splat(x)}; }
    template <typename T>
    static F32x16 load(const T *p) { return {F32x8::load(p), F32x8::load(p + 8)}; }
    static F32x16 load_first(const float *p, int n, float fill) {
        return {F32x8::load_first(p, n < 8 ? n : 8, fill), F32x8::load_first(p + 8, n > 8 ? n - 8 : 0, fill)};
    }
    void store_first(float *p, int n) const {
        lo.store_first(p, n < 8 ? n : 8);
        hi.store_first(p + 8, n > 8 ? n - 8 : 0);
    }
    template <typename T>
    void store(T *p) const { lo.store(p), hi.store(p + 8); }
    F32x16 round_bf16() const { return {lo.round_bf16(), hi.round_bf16()}; }
    friend F32x16 operator+(F32x16 a, F32x16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
    friend F32x16 operator-(F32x16 a, F32x16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
    friend F32x16 operator*(F32x16 a, F32x16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
    friend F32x16 operator-(F32x16 a) { return {-a.lo, -a.hi}; }
    friend F32x16 operator/(F32x16 a, F32x16 b) { return {a.lo / b.lo, a.hi / b.hi}; }
    F32x16 neg_abs() const { return {lo.neg_abs(), hi.neg_abs()}; }
    static F32x16 where_negative(F32x16 sign, F32x16 neg, F32x16 other) {
        return {F32x8::where_negative(sign.lo, neg.lo, other.lo), F32x8::where_negative(sign.hi, neg.hi, other.hi)};
    }
    static F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return {F32x8::fma(a.lo, b.lo, c.lo), F32x8::fma(a.hi, b.hi, c.hi)}; }
    static F32x16 max(F32x16 a, F32x16 b) { return {F32x8::max(a.lo, b.lo), F32x8::max(a.hi, b.hi)}; }
    F32x16 round_even() const { return {lo.round_even(), hi.round_even()}; }
    F32x16 exp2_integral() const { return {lo.exp2_integral(), hi.exp2_integral()}; }
    F32x8 fold() const { return lo + hi; }
    float sum() const { return fold().sum(); }
    float max_lane() const { return ksana::max_lane(F32x8::max(lo, hi)); }
    int nan_mask() const { return lo.nan_mask() | hi.nan_mask() << 8; }
    int gt_mask(F32x16 o) const { return lo.gt_mask(o.lo) | hi.gt_mask(o.hi) << 8; }
    static F32x16 select(int mask, F32x16 a, F32x16 b) {
        return {F32x8::select(mask & 0xff, a.lo, b.lo), F32x8::select(mask >> 8, a.hi, b.hi)};
    }
};

// As AVX-512's: four 8x8 transposes, the off-diagonal blocks swapped.
inline void transpose(F32x16 (&r)[16]) {
    F32x8 block[4][8];  // [row half][column half]: rows 0-7 lo, rows 0-7 hi, rows 8-15 lo, rows 8-15 hi
    for (int i = 0; i < 8; i++)
        block[0][i] = r[i].lo, block[1][i] = r[i].hi, block[2][i] = r[i + 8].lo, block[3][i] = r[i + 8].hi;
    for (auto &b : block) transpose(b);
    for (int i = 0; i < 8; i++) r[i] = {block[0][i], block[2][i]}, r[i + 8] = {block[1][i], block[3][i]};
}
#endif

// A vector's lanes folded to eight (their sum kept): itself for F32x8.
inline F32x8 fold(F32x8 x) { return x; }
inline F32x8 fold(F32x16 x) { return x.fold(); }
inline float max_lane(F32x16 x) { return x.max_lane(); }

// The widest lanes this build runs: 16 on AVX-512, or where KSANA_WIDE_LANES asks for the AVX-512 kernels'
// algorithms on another CPU (to test them there), else 8.
#if KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES)
using Wide = F32x16;
#else
using Wide = F32x8;
#endif

// Lanes of T as float32, and back: round<T> is round_bf16 for bfloat16, nothing for float32.
template <typename T> inline F32x8 round_to(F32x8 x) { return x; }
template <> inline F32x8 round_to<bf16>(F32x8 x) { return x.round_bf16(); }
template <typename T> inline F32x16 round_to(F32x16 x) { return x; }
template <> inline F32x16 round_to<bf16>(F32x16 x) { return x.round_bf16(); }

}  // namespace ksana
