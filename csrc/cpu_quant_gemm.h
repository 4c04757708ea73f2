// Products of activations with GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0) and vmkv's
// own asymmetric U8 (--quantization int8) on their packed blocks, with integer dot products:
// AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd), or portable loops. Header-only, no torch; used by csrc/cpu_quant_layer.cpp.
//
// Activations are quantised per block of 32 to 15-bit integers a = round(x / d), d = max|x| /
// 16256, held as two int8 bytes a = 128 hi + lo (hi in [-127, 127], lo in [-64, 63]), so each
// product is two byte-wide dot products summed exactly in int32 (128 dot(u, hi) + dot(u, lo)).
// Why not one int8 byte, as llama.cpp's Q8_0 / Q8_1 activations: on the default model that
// agreed with the dequantized float32 model's top-1 token at 94.7 % of 2,044 teacher-forced
// positions of the project's docs (the layers and the LM head losing about as much each), where
// the second byte gives the float32 answer up to ~3e-5 of a block's largest activation. A decode
// step streams the weights from memory either way; the second byte doubles the arithmetic.
//
// A weight [N, K] is stored as groups of 16 output rows; a group holds one record per block of 32
// inputs, and a record holds exactly the bytes GGUF holds for those 16 x 32 weights (nothing is
// widened: a packed weight is the file's size), rearranged so that one 64-byte load feeds one
// vpdpbusd for all 16 rows:
//
//   codes   4-bit formats: 4 loads of 64 bytes; byte 4r + e of load j holds row r's elements
//           4j + e (low nibble) and 16 + 4j + e (high nibble): GGUF's own nibble pairing
//           (element i with i + 16), so packing is a transpose of whole bytes.
//           Q8_0: 8 loads of 64 bytes, byte 4r + e of load j = row r's element 4j + e, plus 128
//           (unsigned, as vpdpbusd's unsigned operand wants it). U8: the same, its codes as they
//           are (already unsigned).
//   hbits   Q5_0 only: 8 little-endian 64-bit masks, mask g bit 4r + e = the fifth bit of row r's
//           element 4g + e (g < 4: the low nibbles of load g; g >= 4: the high nibbles of g - 4).
//   d       16 fp16 scales, one per row.
//   m       Q4_1 and U8 only: 16 fp16 minimums.
//
// The value of a weight is d * (u - Z) with u its unsigned code and Z = 8 (Q4_0), 16 (Q5_0),
// 128 (Q8_0), or d * u + m (Q4_1, U8). A block's contribution to output row n is therefore
//   symmetric:  d_w * d_a * (sum u * q  -  Z * sum q)       (the integer part exact)
//   Q4_1, U8:   d_w * d_a * (sum u * q)  +  m_w * (d_a * sum q)
// with q the activation's integer codes and d_a its scale. A group of 16 rows is one vector of int32
// dot products, then of float32 sums: no horizontal reduction anywhere. Every build (AVX-512,
// AVX2, portable) quantises activations identically and sums each row's blocks in the same order
// with the same fused multiply-adds, so their outputs are bit-identical (the AVX2 builds' int16
// tiles for many rows, csrc/cpu_quant_i16_tiles.h, included).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace vmkv::quant {

constexpr int64_t kBlock = 32;  // inputs per quant block
constexpr int64_t kGroup = 16;  // output rows per packed group

// The formats; the values are GGML's type ids (gguf.GGMLQuantizationType), but U8's: vmkv's own
// asymmetric 8-bit block (d | m | 32 unsigned codes, value d * u + m), no GGUF type.
enum Format : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kU8 = 100 };

template <Format F> constexpr bool kFour = F != kQ8_0 && F != kU8;  // 4-bit codes (+ hbits)
template <Format F> constexpr bool kMin = F == kQ4_1 || F == kU8;   // d * u + m
template <Format F> constexpr int64_t kCodeBytes = kFour<F> ? 256 : 512;
template <Format F> constexpr int64_t kHbitBytes = F == kQ5_0 ? 64 : 0;
template <Format F> constexpr int64_t kDOffset = kCodeBytes<F> + kHbitBytes<F>;
template <Format F> constexpr int64_t kRecord = kDOffset<F> + (kMin<F> ? 64 : 32);
template <Format F> constexpr int32_t kZero = F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : F == kQ8_0 ? 128 : 0;

inline int64_t record_bytes(int32_t format) {
  switch (format) {
    case kQ4_0: return kRecord<kQ4_0>;
    case kQ4_1: return kRecord<kQ4_1>;
    case kQ5_0: return kRecord<kQ5_0>;
    case kQ8_0: return kRecord<kQ8_0>;
    case kU8: return kRecord<kU8>;
    default: return 0;
  }
}

// IEEE half -> float (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Activations quantised per block of 32: row r's codes a = 128 hi + lo in hi[r * k ..] and
// lo[r * k ..], and per block its scale d, the sum of its codes z and s = d * z (Q4_1's minimum
// term).
struct QActs {
  int8_t* hi;
  int8_t* lo;
  float* d;
  float* s;
  int32_t* z;
  int16_t* codes;  // nullptr, or the codes a as one int16 each (csrc/cpu_quant_i16_tiles.h)
  int64_t k;       // inputs per row (a multiple of 32)
  int64_t blocks() const { return k / kBlock; }
};

// Bytes QActs needs for m rows of k inputs (64-byte aligned parts), with int16 codes or not.
inline int64_t qacts_bytes(int64_t m, int64_t k, bool with_codes = false) {
  const int64_t codes = (m * k + 63) / 64 * 64, per_block = (m * (k / kBlock) * 4 + 63) / 64 * 64;
  return (with_codes ? 4 : 2) * codes + 3 * per_block;
}

inline QActs qacts_in(void* buffer, int64_t m, int64_t k, bool with_codes = false) {
  char* p = static_cast<char*>(buffer);
  const int64_t codes = (m * k + 63) / 64 * 64, per_block = (m * (k / kBlock) * 4 + 63) / 64 * 64;
  QActs a;
  a.hi = reinterpret_cast<int8_t*>(p);
  a.lo = reinterpret_cast<int8_t*>(p + codes);
  a.d = reinterpret_cast<float*>(p + 2 * codes);
  a.s = reinterpret_cast<float*>(p + 2 * codes + per_block);
  a.z = reinterpret_cast<int32_t*>(p + 2 * codes + 2 * per_block);
  a.codes = with_codes ? reinterpret_cast<int16_t*>(p + 2 * codes + 3 * per_block) : nullptr;
  a.k = k;
  return a;
}

constexpr float kLevels = 127.0f * 128.0f;  // the codes' largest magnitude (16256)

// One block of 32 values: d = max|x| / 16256, a = round-to-nearest-even(x * (1 / d)) split
// into hi = floor((a + 64) / 128) and lo = a - 128 hi, z = sum a, s = d * z; and a itself into
// codes unless that is nullptr. Identical in every build.
template <typename T>
inline void quantize_block(const T* x, int8_t* hi, int8_t* lo, float* d, float* s, int32_t* z,
                           int16_t* codes) {
#if defined(__AVX512F__)
  const vfloat x0 = vload(x), x1 = vload(x + 16);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
  const float scale = amax / kLevels, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  int32_t sum = 0;
  for (int half = 0; half < 2; ++half) {
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(inv)));
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(64)), 7);
    const __m512i l = _mm512_sub_epi32(a, _mm512_slli_epi32(h, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * half), _mm512_cvtsepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * half), _mm512_cvtsepi32_epi8(l));
    if (codes != nullptr) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16 * half), _mm512_cvtsepi32_epi16(a));
    }
    sum += _mm512_reduce_add_epi32(a);
  }
#elif defined(VMKV_VECTOR)
  vfloat v[4], amax8 = vzero();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    v[i] = vload(x + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], absmask));
  }
  const float amax = vmax_lane(amax8);
  const float scale = amax / kLevels, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  __m256i a[4], h[4], l[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    h[i] = _mm256_srai_epi32(_mm256_add_epi32(a[i], _mm256_set1_epi32(64)), 7);
    l[i] = _mm256_sub_epi32(a[i], _mm256_slli_epi32(h[i], 7));
    total = _mm256_add_epi32(total, a[i]);
  }
  // packs work within 128-bit lanes: 8 dwords of 4 bytes come out as rows 0, 1, 2, 3 of each
  // half in turn; this order puts them back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const auto bytes = [&](const __m256i* w) {
    return _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3])), order);
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), bytes(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), bytes(l));
  if (codes != nullptr) {
    for (int i = 0; i < 2; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(a[2 * i], a[2 * i + 1]),
                                                   0xD8));
    }
  }
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(total),
                                     _mm256_extracti128_si256(total, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  const int32_t sum = _mm_cvtsi128_si32(two) + _mm_extract_epi32(two, 1);
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float scale = amax / kLevels, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t a = static_cast<int32_t>(std::nearbyint(to_float(x[i]) * inv));
    const int32_t h = (a + 64) >> 7;  // arithmetic shift: floor
    hi[i] = static_cast<int8_t>(h);
    lo[i] = static_cast<int8_t>(a - 128 * h);
    if (codes != nullptr) codes[i] = static_cast<int16_t>(a);
    sum += a;
  }
#endif
  *d = scale;
  *z = sum;
  *s = scale * static_cast<float>(sum);
}

// Rows [r0, r1) of x [*, k] (row stride ldx) into a.
template <typename T>
inline void quantize_rows(const T* x, int64_t ldx, int64_t r0, int64_t r1, const QActs& a) {
  const int64_t nb = a.blocks();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = r * nb + b;
      const int64_t at = r * a.k + b * kBlock;
      quantize_block(x + r * ldx + b * kBlock, a.hi + at, a.lo + at, a.d + i, a.s + i, a.z + i,
                     a.codes != nullptr ? a.codes + at : nullptr);
    }
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512F__)
// Four activation codes broadcast to every lane, straight from memory (vpbroadcastd zmm, m32).
inline __m512i bcast4(const int8_t* p) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VMKV_QUANT_PATH "avx512-vnni"
// c[r][0..16) = rows r0 .. r0 + R of the activations times one group's nb records. Per block and
// row two int32 vectors: dot(u, hi) and dot(u, lo) - Z z, combined as 128 dh + dl.
template <Format F, int R>
inline void group_rows(const uint8_t* rec, int64_t nb, const QActs& a, int64_t r0, float* c,
                       int64_t ldc) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nbk = a.blocks();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
    __m512i dh[R], dl[R];
    const int8_t *ah[R], *al[R];
    for (int r = 0; r < R; ++r) {
      dh[r] = _mm512_setzero_si512();
      dl[r] = _mm512_set1_epi32(-kZero<F> * a.z[(r0 + r) * nbk + b]);
      ah[r] = a.hi + (r0 + r) * a.k + b * kBlock;
      al[r] = a.lo + (r0 + r) * a.k + b * kBlock;
    }
    if constexpr (kFour<F>) {
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512(rec + j * 64);
        __m512i lo = _mm512_and_si512(w, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        if constexpr (F == kQ5_0) {
          const uint8_t* hb = rec + kCodeBytes<F>;
          const __m512i sixteen = _mm512_set1_epi8(16);
          __mmask64 lo_bits, hi_bits;
          std::memcpy(&lo_bits, hb + 8 * j, sizeof(lo_bits));
          std::memcpy(&hi_bits, hb + 8 * (j + 4), sizeof(hi_bits));
          lo = _mm512_mask_add_epi8(lo, lo_bits, lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, hi_bits, hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          dh[r] = _mm512_dpbusd_epi32(dh[r], lo, bcast4(ah[r] + 4 * j));
          dl[r] = _mm512_dpbusd_epi32(dl[r], lo, bcast4(al[r] + 4 * j));
          dh[r] = _mm512_dpbusd_epi32(dh[r], hi, bcast4(ah[r] + 16 + 4 * j));
          dl[r] = _mm512_dpbusd_epi32(dl[r], hi, bcast4(al[r] + 16 + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(rec + j * 64);
        for (int r = 0; r < R; ++r) {
          dh[r] = _mm512_dpbusd_epi32(dh[r], w, bcast4(ah[r] + 4 * j));
          dl[r] = _mm512_dpbusd_epi32(dl[r], w, bcast4(al[r] + 4 * j));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(rec + kDOffset<F>)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nbk + b;
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh[r], 7), dl[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i])),
                               acc[r]);
      if constexpr (kMin<F>) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(rec + kDOffset<F> + 32)));
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[i]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * ldc, acc[r]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VMKV_QUANT_PATH "avx2"
// 32 bytes whose byte i is 0x10 where bit i of `bits` is set, else 0.
inline __m256i bits_to_sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(0x10));
}

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// A 4-bit record's codes of load j for rows 8h .. 8h + 8 (bytes 32h .. 32h + 32): lo the
// elements 4j + e, hi 16 + 4j + e, byte 4r + e each (Q5_0: with their fifth bits).
template <Format F>
inline void codes4(const uint8_t* rec, int j, int h, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j * 64 + h * 32));
  lo = _mm256_and_si256(w, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
  if constexpr (F == kQ5_0) {
    uint32_t lo_bits, hi_bits;
    std::memcpy(&lo_bits, rec + kCodeBytes<F> + 8 * j + 4 * h, 4);
    std::memcpy(&hi_bits, rec + kCodeBytes<F> + 8 * (j + 4) + 4 * h, 4);
    lo = _mm256_or_si256(lo, bits_to_sixteens(lo_bits));
    hi = _mm256_or_si256(hi, bits_to_sixteens(hi_bits));
  }
}

// sum over 4-byte groups of u * q (u unsigned <= 31, q signed) as int32, in lanes
inline __m256i dot4(__m256i u_lo, __m256i q_lo, __m256i u_hi, __m256i q_hi) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u_lo, q_lo),
                                     _mm256_maddubs_epi16(u_hi, q_hi));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// The AVX-512 kernel's arithmetic on 8 rows at a time (the group's halves): the same integer dot
// products and the same float32 operations per row. 8-bit codes are centred (u - 128, signed)
// and multiplied as |w| times q with w's sign (vpmaddubsw cannot take 255 x 127 pairs; |w| <= 128
// and |q| <= 127 keep a pair's sum under 2^15), so Q8_0's products need no - Z z and U8's add
// 128 z back.
template <Format F, int R>
inline void group_rows(const uint8_t* rec0, int64_t nb, const QActs& a, int64_t r0, float* c,
                       int64_t ldc) {
  const int64_t nbk = a.blocks();
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* rec = rec0;
    for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
      __m256i dh[R], dl[R];
      const int8_t *ah[R], *al[R];
      for (int r = 0; r < R; ++r) {
        dh[r] = _mm256_setzero_si256();
        // 8-bit codes are multiplied centred (u - 128): 128 z puts back what Z does not take
        dl[r] = _mm256_set1_epi32((kFour<F> ? -kZero<F> : 128 - kZero<F>) *
                                  a.z[(r0 + r) * nbk + b]);
        ah[r] = a.hi + (r0 + r) * a.k + b * kBlock;
        al[r] = a.lo + (r0 + r) * a.k + b * kBlock;
      }
      if constexpr (kFour<F>) {
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          codes4<F>(rec, j, h, lo, hi);
          for (int r = 0; r < R; ++r) {
            dh[r] = _mm256_add_epi32(dh[r], dot4(lo, bcast4(ah[r] + 4 * j), hi,
                                                 bcast4(ah[r] + 16 + 4 * j)));
            dl[r] = _mm256_add_epi32(dl[r], dot4(lo, bcast4(al[r] + 4 * j), hi,
                                                 bcast4(al[r] + 16 + 4 * j)));
          }
        }
      } else {
        const __m256i ones = _mm256_set1_epi16(1);
        for (int j = 0; j < 8; ++j) {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j * 64 + h * 32)),
              _mm256_set1_epi8(static_cast<char>(0x80)));
          const __m256i aw = _mm256_abs_epi8(w);
          for (int r = 0; r < R; ++r) {
            dh[r] = _mm256_add_epi32(dh[r], _mm256_madd_epi16(
                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(ah[r] + 4 * j), w)), ones));
            dl[r] = _mm256_add_epi32(dl[r], _mm256_madd_epi16(
                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(al[r] + 4 * j), w)), ones));
          }
        }
      }
      const __m256 dw = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nbk + b;
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dh[r], 7), dl[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(a.d[i])), acc[r]);
        if constexpr (kMin<F>) {
          const __m256 mw = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 32 + 16 * h)));
          acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[i]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(c + r * ldc + 8 * h, acc[r]);
  }
}
#else
#define VMKV_QUANT_PATH "portable"
// Weight (row n, element e) of a record as its unsigned code.
template <Format F>
inline int32_t code_of(const uint8_t* rec, int64_t n, int64_t e) {
  if constexpr (!kFour<F>) {
    return rec[(e / 4) * 64 + 4 * n + e % 4];
  } else {
    const int64_t j = (e % 16) / 4;
    const uint8_t byte = rec[j * 64 + 4 * n + e % 4];
    int32_t u = e < 16 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (F == kQ5_0) {
      uint64_t mask;
      std::memcpy(&mask, rec + kCodeBytes<F> + 8 * (e / 4), sizeof(mask));
      u += ((mask >> (4 * n + e % 4)) & 1u) ? 16 : 0;
    }
    return u;
  }
}

template <Format F, int R>
inline void group_rows(const uint8_t* rec0, int64_t nb, const QActs& a, int64_t r0, float* c,
                       int64_t ldc) {
  const int64_t nbk = a.blocks();
  for (int r = 0; r < R; ++r) {
    for (int64_t n = 0; n < kGroup; ++n) {
      float acc = 0.0f;
      const uint8_t* rec = rec0;
      for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
        const int64_t i = (r0 + r) * nbk + b, at = (r0 + r) * a.k + b * kBlock;
        int32_t dot = -kZero<F> * a.z[i];
        for (int64_t e = 0; e < kBlock; ++e) {
          dot += code_of<F>(rec, n, e) * (128 * a.hi[at + e] + a.lo[at + e]);
        }
        uint16_t h;
        std::memcpy(&h, rec + kDOffset<F> + 2 * n, sizeof(h));
        acc = std::fma(static_cast<float>(dot), half_to_float(h) * a.d[i], acc);
        if constexpr (kMin<F>) {
          std::memcpy(&h, rec + kDOffset<F> + 32 + 2 * n, sizeof(h));
          acc = std::fma(half_to_float(h), a.s[i], acc);
        }
      }
      c[r * ldc + n] = acc;
    }
  }
}
#endif

// Rows per pass over a group's records: the first pass reads them from memory, the rest from
// cache.
constexpr int64_t kPass = 4;

// c[rows][16] (row stride ldc) = activation rows r0 .. r0 + rows times one group (nb records).
template <Format F>
inline void group_product(const uint8_t* group, int64_t nb, const QActs& a, int64_t r0,
                          int64_t rows, float* c, int64_t ldc) {
  for (int64_t r = 0; r < rows; r += kPass) {
    float* cr = c + r * ldc;
    switch (std::min(kPass, rows - r)) {
      case 1: group_rows<F, 1>(group, nb, a, r0 + r, cr, ldc); break;
      case 2: group_rows<F, 2>(group, nb, a, r0 + r, cr, ldc); break;
      case 3: group_rows<F, 3>(group, nb, a, r0 + r, cr, ldc); break;
      default: group_rows<F, 4>(group, nb, a, r0 + r, cr, ldc); break;
    }
  }
}

// group_product for a run-time format; false for an unknown one.
inline bool group_product(int32_t format, const uint8_t* group, int64_t nb, const QActs& a,
                          int64_t r0, int64_t rows, float* c, int64_t ldc) {
  switch (format) {
    case kQ4_0: group_product<kQ4_0>(group, nb, a, r0, rows, c, ldc); return true;
    case kQ4_1: group_product<kQ4_1>(group, nb, a, r0, rows, c, ldc); return true;
    case kQ5_0: group_product<kQ5_0>(group, nb, a, r0, rows, c, ldc); return true;
    case kQ8_0: group_product<kQ8_0>(group, nb, a, r0, rows, c, ldc); return true;
    case kU8: group_product<kU8>(group, nb, a, r0, rows, c, ldc); return true;
    default: return false;
  }
}

// Weight (row n of the group, element e of block b) as a float: the embedding's lookup.
template <Format F>
inline float weight_at(const uint8_t* rec, int64_t n, int64_t e) {
  int32_t u;
  if constexpr (!kFour<F>) {
    u = rec[(e / 4) * 64 + 4 * n + e % 4];
  } else {
    const uint8_t byte = rec[((e % 16) / 4) * 64 + 4 * n + e % 4];
    u = e < 16 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (F == kQ5_0) {
      uint64_t mask;
      std::memcpy(&mask, rec + kCodeBytes<F> + 8 * (e / 4), sizeof(mask));
      u += ((mask >> (4 * n + e % 4)) & 1u) ? 16 : 0;
    }
  }
  uint16_t h;
  std::memcpy(&h, rec + kDOffset<F> + 2 * n, sizeof(h));
  const float d = half_to_float(h);
  if constexpr (kMin<F>) {
    std::memcpy(&h, rec + kDOffset<F> + 32 + 2 * n, sizeof(h));
    return d * static_cast<float>(u) + half_to_float(h);
  }
  return d * static_cast<float>(u - kZero<F>);
}

inline float weight_at(int32_t format, const uint8_t* rec, int64_t n, int64_t e) {
  switch (format) {
    case kQ4_0: return weight_at<kQ4_0>(rec, n, e);
    case kQ4_1: return weight_at<kQ4_1>(rec, n, e);
    case kQ5_0: return weight_at<kQ5_0>(rec, n, e);
    case kU8: return weight_at<kU8>(rec, n, e);
    default: return weight_at<kQ8_0>(rec, n, e);
  }
}

}  // namespace vmkv::quant
