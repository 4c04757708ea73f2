// The CPU kernels' small vector layer (csrc/cpu_*.cpp), written once for AVX-512 (16 float lanes),
// AVX2 with FMA (8 lanes) or neither (VMKV_VECTOR undefined: portable loops), plus bfloat16
// storage: bf16 values are the upper 16 bits of a float32, widened on load (a shift, exact) and
// rounded to nearest-even on store (what torch's float -> bfloat16 conversion does), so kernels
// keep float32 arithmetic for any element type. Header-only, no torch: the kernel build hashes
// it with each source that includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define VMKV_VECTOR 1
#endif


namespace vmkv {

// bfloat16 as stored (the upper half of a float32's bits)
using bf16 = uint16_t;

inline float bf16_to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, NaN kept quiet (torch's c10::BFloat16 conversion).
inline bf16 float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return static_cast<bf16>((bits >> 16) | 0x40);
  return static_cast<bf16>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// A value of element type T (float or bf16) as float, and back (bf16: rounded).
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x); }
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) { return float_to_bf16(x); }
// exp(x) for float32, Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r,
// times 2^n built in the exponent bits (~1 ulp; written so the compiler vectorises it).
inline float exp_approx(float x) {
  x = x < 88.3762626647949f ? x : 88.3762626647949f;
  x = x > -87.3365447505531f ? x : -87.3365447505531f;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// x rounded to bfloat16 precision, kept as a float (a bf16 tensor's value between two ops)
inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }
// x at element type T's precision, kept as a float (float: x itself)
template <typename T> inline float round_to(float x);
template <> inline float round_to<float>(float x) { return x; }
template <> inline float round_to<bf16>(float x) { return round_bf16(x); }


#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vfloor(vfloat x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
inline vfloat vpow2(vfloat i) {  // 2^i for integral i in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23));
}
inline float vsum(vfloat x) { return _mm512_reduce_add_ps(x); }
inline float vmax_lane(vfloat x) { return _mm512_reduce_max_ps(x); }  // the largest lane
inline vfloat vfirst(vfloat x, int64_t live) {  // lanes >= live zeroed (NaN included)
  return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << live) - 1u), x);
}
#elif defined(VMKV_VECTOR)
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vfloor(vfloat x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
inline vfloat vpow2(vfloat i) {  // 2^i for integral i in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23));
}
inline float vsum(vfloat x) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline float vmax_lane(vfloat x) {  // the largest lane
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline vfloat vfirst(vfloat x, int64_t live) {  // lanes >= live zeroed (NaN included)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)), lane);
  return _mm256_and_ps(x, _mm256_castsi256_ps(keep));
}
#endif

#if defined(__AVX512F__)
inline vfloat vload(const bf16* p) {  // 16 bf16 -> 16 floats
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void vstore(bf16* p, vfloat x) {  // round to nearest even (NaN: as float_to_bf16)
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
#elif defined(VMKV_VECTOR)
inline vfloat vload(const bf16* p) {  // 8 bf16 -> 8 floats
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void vstore(bf16* p, vfloat x) {
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, x);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = float_to_bf16(f[i]);
}
#endif

#if defined(__AVX512F__)
// Sixteen vectors -> one vector whose lane j is the sum of v[j]'s lanes.
inline vfloat vsum16(const vfloat* v) {
  vfloat a[8], b[4], d[2];
  for (int i = 0; i < 8; ++i) {  // lane L of a[i]: v[2i], v[2i+1] halves of their lane L
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane L of b[i]: v[4i .. 4i+3]'s lane-L sums
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // pairs of lanes folded
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vround_bf16(vfloat x) {  // x rounded to bfloat16 precision, as float_to_bf16
#if defined(__AVX512BF16__)
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  alignas(64) bf16 h[kLanes];
  vstore(h, x);
  return vload(h);
#endif
}
#elif defined(VMKV_VECTOR)
inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vround_bf16(vfloat x) {
  alignas(32) bf16 h[kLanes];
  vstore(h, x);
  return vload(h);
}
#endif
#if defined(VMKV_VECTOR)
template <typename T> inline vfloat vround_to(vfloat x);  // round_to on every lane
template <> inline vfloat vround_to<float>(vfloat x) { return x; }
template <> inline vfloat vround_to<bf16>(vfloat x) { return vround_bf16(x); }
#endif

// exp(m_old - m_new), an online softmax's rescale when its running max moves from m_old to
// m_new >= m_old: 0 from -inf (the first tile), 1 without a call when the max did not move (most
// tiles after the first few; the call and its vzeroupper cost a prefill task ~8 %).
inline float max_rescale(float m_old, float m_new) {
  return m_new == m_old ? 1.0f : std::exp(m_old - m_new);
}

// exp(x) for x <= 0 that vectorises (glibc's expf does not, outside -ffast-math):
// 2^(x log2 e) = 2^i * 2^f with f in [0, 1) from a degree-6 polynomial fitted in relative
// error; within 1.1e-7 of exp (float32 rounding: 6e-8), 0 below x = -87.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.4426950408889634f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 2.1683431e-4f;
  p = p * f + 1.2437946e-3f;
  p = p * f + 9.6799853e-3f;
  p = p * f + 5.5482150e-2f;
  p = p * f + 2.4023031e-1f;
  p = p * f + 6.9314691e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float two_i;
  std::memcpy(&two_i, &bits, sizeof(two_i));
  return p * two_i;
}

#if defined(VMKV_VECTOR)
// exp_nonpositive on kLanes lanes (same polynomial).
inline vfloat exp_nonpositive_v(vfloat x) {
  const vfloat t = vmul(vmax(x, vset1(-87.0f)), vset1(1.4426950408889634f));
  const vfloat i = vfloor(t);
  const vfloat f = vsub(t, i);
  vfloat p = vset1(2.1683431e-4f);
  p = vfmadd(p, f, vset1(1.2437946e-3f));
  p = vfmadd(p, f, vset1(9.6799853e-3f));
  p = vfmadd(p, f, vset1(5.5482150e-2f));
  p = vfmadd(p, f, vset1(2.4023031e-1f));
  p = vfmadd(p, f, vset1(6.9314691e-1f));
  p = vfmadd(p, f, vset1(1.0f));
  return vmul(p, vpow2(i));
}
#endif

#if defined(VMKV_VECTOR)
// exp_approx on kLanes lanes (the same polynomial and range reduction).
inline vfloat vexp(vfloat x) {
  x = vmax(vmin(x, vset1(88.3762626647949f)), vset1(-87.3365447505531f));
  const vfloat n = vfloor(vfmadd(x, vset1(1.44269504088896341f), vset1(0.5f)));
  vfloat r = vsub(x, vmul(n, vset1(0.693359375f)));
  r = vfmadd(n, vset1(2.12194440e-4f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfmadd(vmul(p, r), r, r), vset1(1.0f));
  return vmul(p, vpow2(n));
}
#endif

}  // namespace vmkv
