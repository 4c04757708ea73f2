// AVX2 builds' products of many activation rows with packed GGUF groups (csrc/cpu_quant_gemm.h's
// layout) on int16 tiles: each group of 16 output rows is widened once into int16 codes, and the
// activations' 15-bit integer codes (the same quantisation as the integer products: a =
// 128 hi + lo, one int16 each) are multiplied with it by vpmaddwd, 16 multiply-adds an
// instruction, six rows at a time:
//
//   codes [K / 2][16][2]: element (k, n) at ((k / 2) * 16 + n) * 2 + k % 2 (weight row n of the
//                         group, input k): its code u, less Z for the symmetric formats
//   d, m  [K / 32][16]:   each block's weight scales (and Q4_1 / U8 minimums) as float32
//
// Why: without VNNI the integer products pay vpmaddubsw twice (the activations' two bytes) and a
// vpmaddwd to widen, about 1.5x (4-bit) to 2.5x (8-bit) the multiply instructions of one
// vpmaddwd per 16 multiply-adds; float32 FMAs do 8. Zen 3 issues two vpmaddwd a cycle, as it does
// FMAs. Each block's int32 sums are exactly the integer products' (sum (u - Z) a = sum u a - Z z),
// and the block epilogue is theirs (the same fused multiply-adds in the same order), so the
// results are bit-identical to csrc/cpu_quant_gemm.h's group_product in every build.
//
// AVX2 with FMA and F16C only (VMKV_QUANT_I16_TILES): AVX-512 builds keep their VNNI products.
#pragma once

#include "cpu_quant_gemm.h"

namespace vmkv::quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define VMKV_QUANT_I16_TILES 1

constexpr int64_t kI16Pass = 6;  // rows per pass: 6 x 2 int32 accumulators + 3 registers

// One group widened: codes [K / 2][16][2] int16, d and m [K / 32][16] float32.
struct I16Tile {
  int16_t* codes;
  float* d;
  float* m;
};

// v: eight rows' 32-bit lanes of four unsigned codes (byte 4r + e: row r's element 2 p + e),
// less `zero`, into tile pairs p and p + 1 of rows 8h .. 8h + 8.
inline void put_pairs(__m256i v, __m256i zero, int64_t p, int h, int16_t* codes) {
  const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  // rows 0-3 then 4-7, each row's four codes as int16: [row][e]
  const __m256i rows03 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), zero);
  const __m256i rows47 =
      _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), zero);
  // [pair p: rows 0-3 | pair p + 1: rows 0-3] and the same for rows 4-7
  const __m256i a = _mm256_permutevar8x32_epi32(rows03, even_odd);
  const __m256i b = _mm256_permutevar8x32_epi32(rows47, even_odd);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + (p * kGroup + 8 * h) * 2),
                      _mm256_permute2x128_si256(a, b, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + ((p + 1) * kGroup + 8 * h) * 2),
                      _mm256_permute2x128_si256(a, b, 0x31));
}

// The group at `rec` (nb records) into `tile`.
template <Format F>
inline void widen_group(const uint8_t* rec, int64_t nb, const I16Tile& tile) {
  const __m256i zero = _mm256_set1_epi16(static_cast<int16_t>(kZero<F>));
  for (int64_t b = 0; b < nb; ++b, rec += kRecord<F>) {
    int16_t* codes = tile.codes + b * kBlock * kGroup;  // the block's 16 pairs
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 8: bytes 32h .. 32h + 32 of each load
      if constexpr (kFour<F>) {
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          codes4<F>(rec, j, h, lo, hi);
          put_pairs(lo, zero, 2 * j, h, codes);
          put_pairs(hi, zero, 8 + 2 * j, h, codes);
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          put_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j * 64 + h * 32)),
                    zero, 2 * j, h, codes);
        }
      }
      _mm256_storeu_ps(tile.d + b * kGroup + 8 * h,
                       _mm256_cvtph_ps(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 16 * h))));
      if constexpr (kMin<F>) {
        _mm256_storeu_ps(tile.m + b * kGroup + 8 * h,
                         _mm256_cvtph_ps(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(rec + kDOffset<F> + 32 + 16 * h))));
      }
    }
  }
}

inline bool widen_group(int32_t format, const uint8_t* rec, int64_t nb, const I16Tile& tile) {
  switch (format) {
    case kQ4_0: widen_group<kQ4_0>(rec, nb, tile); return true;
    case kQ4_1: widen_group<kQ4_1>(rec, nb, tile); return true;
    case kQ5_0: widen_group<kQ5_0>(rec, nb, tile); return true;
    case kQ8_0: widen_group<kQ8_0>(rec, nb, tile); return true;
    case kU8: widen_group<kU8>(rec, nb, tile); return true;
    default: return false;
  }
}

// sums[R][16] = one block: activation codes a[R, 32] (row stride lda) times its 16 code pairs.
// The row loops are unrolled by pragma so that the 2R accumulators stay in registers.
template <int R>
inline void block_sums(const int16_t* a, int64_t lda, const int16_t* codes, int32_t* sums) {
  __m256i left[R], right[R];  // outputs 0 .. 8 and 8 .. 16
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) left[r] = right[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int p = 0; p < kBlock / 2; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32 + 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m256i x = _mm256_set1_epi32(pair);
      left[r] = _mm256_add_epi32(left[r], _mm256_madd_epi16(w0, x));
      right[r] = _mm256_add_epi32(right[r], _mm256_madd_epi16(w1, x));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kGroup), left[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kGroup + 8), right[r]);
  }
}

// block_sums<6> in assembly: GCC 12 hoists the six broadcasts ahead of the products and spills
// accumulators to the stack every pair (2x slower). ymm0-11 hold the sums (row r: 2r, 2r + 1),
// ymm12-13 the pair's codes, ymm14-15 a broadcast and a product.
#define VMKV_I16_ROW(r0, r1, at)                       \
  "vpbroadcastd " at ", %%ymm14\n\t"                   \
  "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"             \
  "vpaddd %%ymm15, %%ymm" #r0 ", %%ymm" #r0 "\n\t"     \
  "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"             \
  "vpaddd %%ymm14, %%ymm" #r1 ", %%ymm" #r1 "\n\t"
#define VMKV_I16_STORE(r, off) "vmovdqu %%ymm" #r ", " #off "(%[sums])\n\t"

template <>
inline void block_sums<6>(const int16_t* a, int64_t lda, const int16_t* codes, int32_t* sums) {
  const int16_t* a3 = a + 3 * lda;  // rows 3 .. 6
  const int64_t stride = 2 * lda;   // bytes per row
  int64_t pairs = kBlock / 2;
  asm volatile(
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
      "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
      "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
      "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
      "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
      "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
      "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
      "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
      "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
      "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
      "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
      "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
      "1:\n\t"
      "vmovdqu (%[codes]), %%ymm12\n\t"
      "vmovdqu 32(%[codes]), %%ymm13\n\t"
      VMKV_I16_ROW(0, 1, "(%[a])")
      VMKV_I16_ROW(2, 3, "(%[a],%[stride])")
      VMKV_I16_ROW(4, 5, "(%[a],%[stride],2)")
      VMKV_I16_ROW(6, 7, "(%[a3])")
      VMKV_I16_ROW(8, 9, "(%[a3],%[stride])")
      VMKV_I16_ROW(10, 11, "(%[a3],%[stride],2)")
      "add $4, %[a]\n\t"
      "add $4, %[a3]\n\t"
      "add $64, %[codes]\n\t"
      "dec %[pairs]\n\t"
      "jnz 1b\n\t"
      VMKV_I16_STORE(0, 0) VMKV_I16_STORE(1, 32) VMKV_I16_STORE(2, 64) VMKV_I16_STORE(3, 96)
      VMKV_I16_STORE(4, 128) VMKV_I16_STORE(5, 160) VMKV_I16_STORE(6, 192)
      VMKV_I16_STORE(7, 224) VMKV_I16_STORE(8, 256) VMKV_I16_STORE(9, 288)
      VMKV_I16_STORE(10, 320) VMKV_I16_STORE(11, 352)
      : [a] "+r"(a), [a3] "+r"(a3), [codes] "+r"(codes), [pairs] "+r"(pairs)
      : [stride] "r"(stride), [sums] "r"(sums)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
        "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef VMKV_I16_ROW
#undef VMKV_I16_STORE

// c[N][16] = the block epilogue of rows r .. r + N of a pass of R rows (sums [nb][R][16]; the
// activations' scales in qa from row r0): the integer products' fused multiply-adds in their
// order. N rows at once: each row's two accumulators are a chain of dependent FMAs (two a block
// for Q4_1), which one row alone would wait on.
template <Format F, int N>
inline void block_epilogue(const int32_t* sums, int R, int r, const QActs& qa, int64_t r0,
                           const I16Tile& tile, float* c) {
  const int64_t nb = qa.blocks();
  __m256 left[N], right[N];
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) left[i] = right[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 d0 = _mm256_loadu_ps(tile.d + b * kGroup);
    const __m256 d1 = _mm256_loadu_ps(tile.d + b * kGroup + 8);
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {
      const int64_t at = (r0 + r + i) * nb + b;
      const int32_t* s = sums + (b * R + r + i) * kGroup;
      const __m256 da = _mm256_set1_ps(qa.d[at]);
      const __m256i dot0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
      const __m256i dot1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8));
      left[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(d0, da), left[i]);
      right[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(d1, da), right[i]);
      if constexpr (kMin<F>) {
        const __m256 sa = _mm256_set1_ps(qa.s[at]);
        left[i] = _mm256_fmadd_ps(_mm256_loadu_ps(tile.m + b * kGroup), sa, left[i]);
        right[i] = _mm256_fmadd_ps(_mm256_loadu_ps(tile.m + b * kGroup + 8), sa, right[i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) {
    _mm256_storeu_ps(c + (r + i) * kGroup, left[i]);
    _mm256_storeu_ps(c + (r + i) * kGroup + 8, right[i]);
  }
}

// c[R][16] = activation rows r0 .. r0 + R (qa, with its int16 codes) times the tile: every
// block's int32 sums first (sums: [nb][R][16] scratch), then the rows' block epilogues, three
// rows at a time.
template <Format F, int R>
inline void tile_rows_i16(const QActs& qa, int64_t r0, const I16Tile& tile, int32_t* sums,
                          float* c) {
  for (int64_t b = 0; b < qa.blocks(); ++b) {
    block_sums<R>(qa.codes + r0 * qa.k + b * kBlock, qa.k, tile.codes + b * kBlock * kGroup,
                  sums + b * R * kGroup);
  }
  for (int r = 0; r < R; r += 3) {
    switch (std::min(3, R - r)) {
      case 1: block_epilogue<F, 1>(sums, R, r, qa, r0, tile, c); break;
      case 2: block_epilogue<F, 2>(sums, R, r, qa, r0, tile, c); break;
      default: block_epilogue<F, 3>(sums, R, r, qa, r0, tile, c); break;
    }
  }
}

// c[rows][16] = activation rows r0 .. r0 + rows (qa, quantised with its int16 codes) times the
// tile (the group's K is qa.k), kI16Pass rows per pass; sums holds qa.blocks() * kI16Pass * 16
// int32.
template <Format F>
inline void tile_product_i16(const QActs& qa, int64_t r0, int64_t rows, const I16Tile& tile,
                             int32_t* sums, float* c) {
  static_assert(kI16Pass == 6);
  for (int64_t r = 0; r < rows; r += kI16Pass) {
    float* cr = c + r * kGroup;
    const int64_t at = r0 + r;
    switch (std::min(kI16Pass, rows - r)) {
      case 1: tile_rows_i16<F, 1>(qa, at, tile, sums, cr); break;
      case 2: tile_rows_i16<F, 2>(qa, at, tile, sums, cr); break;
      case 3: tile_rows_i16<F, 3>(qa, at, tile, sums, cr); break;
      case 4: tile_rows_i16<F, 4>(qa, at, tile, sums, cr); break;
      case 5: tile_rows_i16<F, 5>(qa, at, tile, sums, cr); break;
      default: tile_rows_i16<F, 6>(qa, at, tile, sums, cr); break;
    }
  }
}

inline bool tile_product_i16(int32_t format, const QActs& qa, int64_t r0, int64_t rows,
                             const I16Tile& tile, int32_t* sums, float* c) {
  switch (format) {
    case kQ4_0: tile_product_i16<kQ4_0>(qa, r0, rows, tile, sums, c); return true;
    case kQ4_1: tile_product_i16<kQ4_1>(qa, r0, rows, tile, sums, c); return true;
    case kQ5_0: tile_product_i16<kQ5_0>(qa, r0, rows, tile, sums, c); return true;
    case kQ8_0: tile_product_i16<kQ8_0>(qa, r0, rows, tile, sums, c); return true;
    case kU8: tile_product_i16<kU8>(qa, r0, rows, tile, sums, c); return true;
    default: return false;
  }
}
#endif

}  // namespace vmkv::quant
