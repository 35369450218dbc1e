// Eight float32 lanes for every instruction set: one source for the CPU kernels' vector code.
//
// F32x8 wraps __m256 where the build targets AVX2/FMA, two float32x4_t on NEON, and a plain array elsewhere, which
// the compiler vectorises as it can. Every operation rounds exactly as IEEE float32 does lane by lane (the fused
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
    static F32x8 zero() { return {_mm256_setzero_ps()}; }
    static F32x8 splat(float x) { return {_mm256_set1_ps(x)}; }
    static F32x8 load(const float *p) { return {_mm256_loadu_ps(p)}; }
    static F32x8 load(const bf16 *p) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
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
    // (v0 + v4 + v2 + v6) + (v1 + v5 + v3 + v7), in that tree.
    float sum() const {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
    }
};
#else
// Portable and NEON lanes: the same operations on eight floats (NEON's are its two 4-lane registers).
struct F32x8 {
    float v[8];
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
    float sum() const { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
};
#endif

// The largest lane (NaN-free lanes; exact in any order).
inline float max_lane(F32x8 x) {
    float lanes[8];
    x.store(lanes);
    float m = lanes[0];
    for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

// e^x for x <= 0 (softmax arguments): 2^n * e^r with n = round(x / ln 2), |r| <= ln2/2 (ln 2 in two parts, so r is
// exact) and a degree-6 Taylor polynomial (about one ulp); arguments below -87 give (nearly) zero. The same
// operations in the same order on every instruction set, so the same bits.
inline F32x8 exp_nonpositive(F32x8 x) {
    x = F32x8::max(x, F32x8::splat(-87.0f));
    F32x8 n = (x * F32x8::splat(1.44269504f)).round_even();
    F32x8 r = F32x8::fma(-n, F32x8::splat(0.693359375f), x);
    r = F32x8::fma(-n, F32x8::splat(-2.12194440e-4f), r);
    F32x8 p = F32x8::splat(1.0f / 720);
    p = F32x8::fma(p, r, F32x8::splat(1.0f / 120));
    p = F32x8::fma(p, r, F32x8::splat(1.0f / 24));
    p = F32x8::fma(p, r, F32x8::splat(1.0f / 6));
    p = F32x8::fma(p, r, F32x8::splat(0.5f));
    p = F32x8::fma(p, r, F32x8::splat(1.0f));
    p = F32x8::fma(p, r, F32x8::splat(1.0f));
    return p * n.exp2_integral();
}

// Eight lanes of T as float32, and back: round<T> is round_bf16 for bfloat16, nothing for float32.
template <typename T> inline F32x8 round_to(F32x8 x) { return x; }
template <> inline F32x8 round_to<bf16>(F32x8 x) { return x.round_bf16(); }

}  // namespace ksana
