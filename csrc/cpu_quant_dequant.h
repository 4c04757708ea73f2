// Packed GGUF groups (csrc/cpu_quant_gemm.h's layout: 16 output rows, one record per block of 32
// inputs) dequantized into the bfloat16 tiles oneDNN's brgemm ukernel multiplies: many bf16
// activation rows (prefill, wide batches) take the weight at the bf16 dot products' rate instead
// of the two-byte integer products, paying the dequantization once per tile for all rows.
//
//   tile [K / 2][ldt][2]: element (k, n) at ((k / 2) * ldt + n) * 2 + k % 2 (VNNI pairs)
//
// Values are d * (u - Z) or d * u + m as one fused multiply-add, the float32 the dequantized
// model holds (exact: an fp16 scale times a code of at most 8 bits), rounded to nearest even: a
// tile equals the dequantized weight cast to bfloat16. AVX512-BF16 only (where the bf16 ukernel
// runs); elsewhere, and for float32 activations (whose integer products measured faster than
// float32 brgemm at every row count), the integer products serve every row count.
#pragma once

#include "cpu_quant_gemm.h"

namespace vmkv::quant {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define VMKV_QUANT_TILES 1

// Codes: byte 4r + e of `u` = row r's unsigned code of element k + e (e < 4); every row's value
// u * d + off (lane r: row r) rounded to bf16, written as elements k .. k + 3 of columns
// col .. col + 16: element k + 2 p in the low half of a 32-bit lane, k + 2 p + 1 in the high
// half (VNNI pair p of row r).
inline void put4(__m512i u, __m512 d, __m512 off, int64_t k, bf16* tile, int64_t ldt,
                 int64_t col) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int pair = 0; pair < 2; ++pair) {
    __m512i half[2];
    for (int i = 0; i < 2; ++i) {
      const int e = 2 * pair + i;
      const __m512 v = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u, 8 * e), byte)), d, off);
      half[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    }
    _mm512_storeu_si512(tile + ((k / 2 + pair) * ldt + col) * 2,
                        _mm512_or_si512(half[0], _mm512_slli_epi32(half[1], 16)));
  }
}

// The group at `rec` (nb records) into columns col .. col + 16 of `tile` (K = 32 nb rows).
template <Format F>
inline void dequant_group(const uint8_t* rec, int64_t nb, bf16* tile, int64_t ldt, int64_t col) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(rec + kDOffset<F>)));
    const __m512 off = kMin<F> ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(rec + kDOffset<F> + 32)))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-kZero<F>));
    const int64_t k = b * kBlock;
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
        put4(lo, d, off, k + 4 * j, tile, ldt, col);
        put4(hi, d, off, k + 16 + 4 * j, tile, ldt, col);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        put4(_mm512_loadu_si512(rec + j * 64), d, off, k + 4 * j, tile, ldt, col);
      }
    }
  }
}

inline bool dequant_group(int32_t format, const uint8_t* rec, int64_t nb, bf16* tile, int64_t ldt,
                          int64_t col) {
  switch (format) {
    case kQ4_0: dequant_group<kQ4_0>(rec, nb, tile, ldt, col); return true;
    case kQ4_1: dequant_group<kQ4_1>(rec, nb, tile, ldt, col); return true;
    case kQ5_0: dequant_group<kQ5_0>(rec, nb, tile, ldt, col); return true;
    case kQ8_0: dequant_group<kQ8_0>(rec, nb, tile, ldt, col); return true;
    case kU8: dequant_group<kU8>(rec, nb, tile, ldt, col); return true;
    default: return false;
  }
}
#endif

}  // namespace vmkv::quant
