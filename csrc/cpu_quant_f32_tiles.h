// AVX2 builds' products of many float32 activation rows with packed GGUF groups
// (csrc/cpu_quant_gemm.h's layout): each group of 16 output rows is dequantized once into a
// float32 tile, and the rows are multiplied with it by float32 FMAs, six rows at a time.
//
//   tile [K][16]: element (k, n) at k * 16 + n (weight row n of the group, input k)
//
// Why: without VNNI the integer products cost vpmaddubsw + vpmaddwd + the adds per byte pair,
// twice (the activations' two bytes), and the 8-bit formats a vpsignb more: per multiply-add
// about 2.5x (Q8_0, U8) and 1.5x (4-bit) the instructions of a float32 FMA, where the
// dequantization is paid once per group for all rows. Measured on a 2-core AVX2 EPYC
// (docs/models.md, "Quantized weights"): from F32_TILE_ROWS rows on these are faster; fewer
// rows, where the weight stream decides, keep the integer products. The values are the float32
// the dequantized model holds (d * (u - Z) or d * u + m as one FMA, exact for the symmetric
// formats), so these products are the dequantized float32 linear's up to summation order: no
// activation rounding at all.
//
// AVX2 with FMA and F16C only (VMKV_QUANT_F32_TILES): AVX-512 builds keep their VNNI products,
// measured faster than float32 arithmetic at every row count.
#pragma once

#include "cpu_quant_gemm.h"

namespace vmkv::quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define VMKV_QUANT_F32_TILES 1

constexpr int64_t kF32Pass = 6;  // rows per pass over a tile: 6 x 2 accumulators + 3 registers

// u: eight rows' 32-bit lanes of four unsigned codes (byte e: element k + e); each row's value
// u * d + off for the four elements, written to tile columns col .. col + 8 of rows k .. k + 4.
inline void put4_f32(__m256i u, __m256 d, __m256 off, int64_t k, float* tile, int64_t col) {
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int e = 0; e < 4; ++e) {
    const __m256 code = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u, 8 * e), byte));
    _mm256_storeu_ps(tile + (k + e) * kGroup + col, _mm256_fmadd_ps(code, d, off));
  }
}

// The group at `rec` (nb records) into tile [32 nb][16].
template <Format F>
inline void dequant_group_f32(const uint8_t* rec, int64_t nb, float* tile) {
  for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
    const int64_t k = b * kBlock;
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 8: bytes 32h .. 32h + 32 of each load
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 16 * h)));
      const __m256 off =
          kMin<F> ? _mm256_cvtph_ps(_mm_loadu_si128(
                        reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 32 + 16 * h)))
                  : _mm256_mul_ps(d, _mm256_set1_ps(static_cast<float>(-kZero<F>)));
      if constexpr (kFour<F>) {
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          codes4<F>(rec, j, h, lo, hi);
          put4_f32(lo, d, off, k + 4 * j, tile, 8 * h);
          put4_f32(hi, d, off, k + 16 + 4 * j, tile, 8 * h);
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          put4_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j * 64 + h * 32)),
                   d, off, k + 4 * j, tile, 8 * h);
        }
      }
    }
  }
}

inline bool dequant_group_f32(int32_t format, const uint8_t* rec, int64_t nb, float* tile) {
  switch (format) {
    case kQ4_0: dequant_group_f32<kQ4_0>(rec, nb, tile); return true;
    case kQ4_1: dequant_group_f32<kQ4_1>(rec, nb, tile); return true;
    case kQ5_0: dequant_group_f32<kQ5_0>(rec, nb, tile); return true;
    case kQ8_0: dequant_group_f32<kQ8_0>(rec, nb, tile); return true;
    case kU8: dequant_group_f32<kU8>(rec, nb, tile); return true;
    default: return false;
  }
}

// c[R][16] = a[R, k] (row stride lda) tile[k][16]. The row loops are unrolled by pragma: left to
// its later unrolling, GCC kept a copy of every accumulator on the stack and stored it every
// iteration (2.5x slower).
template <int R>
inline void tile_rows_f32(const float* a, int64_t lda, const float* tile, int64_t k, float* c) {
  __m256 left[R], right[R];  // columns 0 .. 8 and 8 .. 16
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) left[r] = right[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(tile + i * kGroup);
    const __m256 w1 = _mm256_loadu_ps(tile + i * kGroup + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + i);
      left[r] = _mm256_fmadd_ps(x, w0, left[r]);
      right[r] = _mm256_fmadd_ps(x, w1, right[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kGroup, left[r]);
    _mm256_storeu_ps(c + r * kGroup + 8, right[r]);
  }
}

// c[rows][16] = a[rows, k] (row stride lda) tile[k][16], kF32Pass rows per pass.
inline void tile_product_f32(const float* a, int64_t lda, int64_t rows, const float* tile,
                             int64_t k, float* c) {
  static_assert(kF32Pass == 6);
  for (int64_t r = 0; r < rows; r += kF32Pass) {
    const float* ar = a + r * lda;
    float* cr = c + r * kGroup;
    switch (std::min(kF32Pass, rows - r)) {
      case 1: tile_rows_f32<1>(ar, lda, tile, k, cr); break;
      case 2: tile_rows_f32<2>(ar, lda, tile, k, cr); break;
      case 3: tile_rows_f32<3>(ar, lda, tile, k, cr); break;
      case 4: tile_rows_f32<4>(ar, lda, tile, k, cr); break;
      case 5: tile_rows_f32<5>(ar, lda, tile, k, cr); break;
      default: tile_rows_f32<6>(ar, lda, tile, k, cr); break;
    }
  }
}
#endif

}  // namespace vmkv::quant
