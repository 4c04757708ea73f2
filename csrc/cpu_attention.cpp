// Batched attention on the CPU, one kernel body for both KV modes (the CPU twins): decode (one
// query token per request) and prefill chunks (many, causal after the cached context).
//
// Every request attends over its own cached rows, read in place:
//   contiguous (virtual mode):  row(b, t) = starts[b] + t                  (a slot is contiguous)
//   block table (paged mode):   row(b, t) = table[b][t / bs] * bs + t % bs
// and the element address is  base + row * stride_row + kv_head * stride_head + d.
// Same loops, same arithmetic order in both modes, so both produce bit-identical outputs for the
// same data. Nothing at or past seq_lens[b] is read, and with a sliding window (window > 0:
// query p sees keys p - window + 1 .. p) nothing before the step's first window either, so the
// pages or blocks behind it may be gone. q, k, v and out are float32 or bfloat16
// (widened on load, float32 arithmetic, rounded on store: cpu_vec.h).
//
// Built by vmkv/kernels/cpu_attention.py with g++ -O3 -march=native -fopenmp into a cached shared
// library and called through ctypes: no torch headers (about 8 s to build on a 2-core EPYC, most
// of it the bf16 decode kernels compiled per GQA group and head_dim, below). Where
// the CPU has AVX-512 (16 lanes) or AVX2 with FMA (8 lanes) the inner loops are intrinsics,
// written once over the small vector layer of cpu_vec.h (scores as one FMA chain per row, the tile's
// exponentials a vector at a time, accumulators held in registers across a tile: the compiler
// kept them in memory and the exponentials scalar); elsewhere portable loops. Without these
// intrinsics the decode kernel ran 9x slower on an AVX2 machine (15.8 vs 1.8 ms per layer).

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_rows.h"
#include "cpu_vec.h"

namespace {

using namespace vmkv;

constexpr int64_t kTile = 32;  // tokens per tile: K rows, then the same V rows
constexpr int64_t kMaxTaskRows = 48;  // query heads of one decode task (its KV heads x group)

// Every cache line of [row, row + bytes) fetched into L1.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Every cache line of [row, row + bytes) read, in address order: a demand stream, which the
// hardware prefetchers follow (software prefetches of the same lines did not make them). The
// empty asm uses what was read, so that the reads stay.
inline void read_lines(const void* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  if (bytes <= 0) return;
#if defined(__AVX512F__)
  __m512i x = _mm512_setzero_si512();
  for (int64_t off = 0; off + 64 <= bytes; off += 64) {
    x = _mm512_or_si512(x, _mm512_loadu_si512(p + off));
  }
  asm volatile("" : : "v"(x));
#else
  uint32_t x = 0;
  for (int64_t off = 0; off + 4 <= bytes; off += 64) {
    uint32_t word;
    std::memcpy(&word, p + off, sizeof(word));
    x |= word;
  }
  asm volatile("" : : "r"(x));
#endif
  const char last = p[bytes - 1];  // the last (partial) line: nothing past the row is read
  asm volatile("" : : "r"(last));
}

// The next tile's rows fetched into L2 a few cache lines at a time, one step() per iteration of
// the tile's score and value loops, so that memory streams while the arithmetic runs. Fetched
// in one burst before the tile, the lines came in while the core waited for line-fill buffers,
// as demand reads do (kernel alone, 64 x 300 tokens x 30 float32 layers out of cache, 2-core
// Zen 4: virtual 49-53 -> 37-39 ms, paged 52-57 -> 44-47; the tile's rows read whole alone
// take 35). kLinesPerStep spreads a float32 tile of 3 KV heads of dim 64 (768 lines) over its
// 192 steps; other shapes finish early or leave a rest to finish(). A rate counted or computed
// per tile cost 3-8 % in the loops.
class TilePrefetch {
 public:
  static constexpr int kLinesPerStep = 4;

  // A new tile: rows of `row_bytes` each are add()ed next.
  void start(int64_t row_bytes) {
    row_bytes_ = row_bytes;
    nrows_ = row_ = off_ = 0;
  }
  void add(const void* row) { rows_[nrows_++] = static_cast<const char*>(row); }
  inline void step() {
    for (int i = 0; i < kLinesPerStep && row_ < nrows_; ++i) next();
  }
  void finish() {
    while (row_ < nrows_) next();
  }

 private:
  inline void next() {
    __builtin_prefetch(rows_[row_] + off_, 0, 1);
    off_ += 64;
    if (off_ >= row_bytes_) {
      off_ = 0;
      ++row_;
    }
  }
  const char* rows_[2 * kTile * kMaxTaskRows];  // K and V rows of up to every head, head by head
  int64_t nrows_ = 0, row_ = 0, off_ = 0, row_bytes_ = 0;
};

// Rows [r, nrows) of the row-blocked loops below (scores, values): blocks of R, then the rest
// (fewer than R) as one block: a GQA group of 3 is one block, not three single rows.
template <int R, typename F>
inline void in_row_blocks(int64_t nrows, F&& block, int64_t r = 0) {
  for (; r + R <= nrows; r += R) block(std::integral_constant<int, R>{}, r);
  if constexpr (R > 1) {
    if (r < nrows) in_row_blocks<R - 1>(nrows, block, r);
  }
}

// One row's online-softmax step over a tile of scores pr[0 .. kTile) of which the first
// `visible` count: pr becomes the probabilities (0 past visible), the running max m and sum l
// move on, and the row's accumulator acc[0 .. dim) is rescaled to the new max.
inline void softmax_tile_row(float* pr, int64_t visible, float& m, float& l, float* acc,
                             int64_t dim) {
  float tile_max = -INFINITY;
  int64_t j = 0;
#if defined(VMKV_VECTOR)  // whole vectors at once (exact: max does not round)
  if (visible >= kLanes) {
    vfloat vm = vload(pr);
    for (j = kLanes; j + kLanes <= visible; j += kLanes) vm = vmax(vm, vload(pr + j));
    tile_max = vmax_lane(vm);
  }
#endif
  for (; j < visible; ++j) tile_max = std::max(tile_max, pr[j]);
  const float m_new = std::max(m, tile_max);
  const float rescale = max_rescale(m, m_new);
  float tile_sum = 0.0f;
#if defined(VMKV_VECTOR)
  static_assert(kTile % kLanes == 0, "tiles are whole vectors");
  vfloat sums = vzero();
  for (int64_t j0 = 0; j0 < kTile; j0 += kLanes) {
    const int64_t live = std::clamp<int64_t>(visible - j0, 0, kLanes);
    const vfloat e = vfirst(exp_nonpositive_v(vsub(vload(pr + j0), vset1(m_new))), live);
    vstore(pr + j0, e);
    sums = vadd(sums, e);
  }
  tile_sum = vsum(sums);
#else
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t j = 0; j < kTile; ++j) {
    const float e = j < visible ? exp_nonpositive(pr[j] - m_new) : 0.0f;
    pr[j] = e;
    tile_sum += e;
  }
#endif
  l = l * rescale + tile_sum;
  m = m_new;
  if (rescale != 1.0f) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
  }
}
#if defined(__AVX512F__)
// tile_scores of rows r0 .. r0 + R for dim = DV vectors: the rows' q held in registers and each
// key vector loaded once for all R rows (R loads per R FMAs became one: the GQA group's rows
// had each reloaded q and k, two loads per FMA). Every (row, token) sum keeps tile_scores' FMA
// chain and reduction, so the scores are bit-identical.
template <int R, int DV, typename T>
inline void score_rows_held(const float* qs, int64_t r0, const T* const* krow, int64_t n,
                            float* p, TilePrefetch* next) {
  constexpr int64_t dim = DV * kLanes;
  vfloat qv[R][DV];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < DV; ++c) qv[i][c] = vload(qs + (r0 + i) * dim + c * kLanes);
  }
  vfloat part[R][kTile];
  for (int64_t j = 0; j < n; ++j) {
    if (next != nullptr) next->step();
    const T* kr = krow[j];
    vfloat s[R];
    const vfloat k0 = vload(kr);
    for (int i = 0; i < R; ++i) s[i] = vmul(qv[i][0], k0);
    for (int c = 1; c < DV; ++c) {
      const vfloat kc = vload(kr + c * kLanes);
      for (int i = 0; i < R; ++i) s[i] = vfmadd(qv[i][c], kc, s[i]);
    }
    for (int i = 0; i < R; ++i) part[i][j] = s[i];
  }
  for (int i = 0; i < R; ++i) {
    for (int64_t j = n; j < kTile; ++j) part[i][j] = vzero();
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      vstore(p + (r0 + i) * kTile + j0, vsum16(part[i] + j0));
    }
  }
}
#endif

// Scores of a tile: p[r * kTile + j] = q_r . k_j for the group's rows r and tokens j < n;
// `next` (decode's next tile, or none) steps once per token of each vector loop.
template <typename T>
inline void tile_scores(const float* qs, int64_t group, int64_t dim, const T* const* krow,
                        int64_t n, float* p, TilePrefetch* next = nullptr) {
#if defined(__AVX512F__)
  if (dim == 4 * kLanes) {  // head_dim 64: up to 4 rows' q (16 registers) held
    in_row_blocks<4>(group, [&](auto rows_, int64_t r0) {
      score_rows_held<decltype(rows_)::value, 4>(qs, r0, krow, n, p, next);
    });
    return;
  }
  if (dim == 8 * kLanes) {  // head_dim 128: up to 3 rows' q (24 registers) held
    in_row_blocks<3>(group, [&](auto rows_, int64_t r0) {
      score_rows_held<decltype(rows_)::value, 8>(qs, r0, krow, n, p, next);
    });
    return;
  }
  if (dim % kLanes == 0) {  // one FMA chain per (row, token), 16 tokens' sums at once
    vfloat part[kTile];
    for (int64_t r = 0; r < group; ++r) {
      const float* qr = qs + r * dim;
      for (int64_t j = 0; j < n; ++j) {
        if (next != nullptr) next->step();
        const T* kr = krow[j];
        vfloat s = vmul(vload(qr), vload(kr));
        for (int64_t d = kLanes; d < dim; d += kLanes) s = vfmadd(vload(qr + d), vload(kr + d), s);
        part[j] = s;
      }
      for (int64_t j = n; j < kTile; ++j) part[j] = vzero();
      for (int64_t j0 = 0; j0 < n; j0 += kLanes) vstore(p + r * kTile + j0, vsum16(part + j0));
    }
    return;
  }
#elif defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {  // one FMA chain per (row, token), one reduction at the end
    for (int64_t j = 0; j < n; ++j) {
      if (next != nullptr) next->step();
      const T* kr = krow[j];
      for (int64_t r = 0; r < group; ++r) {
        const float* qr = qs + r * dim;
        vfloat s = vmul(vload(qr), vload(kr));
        for (int64_t d = kLanes; d < dim; d += kLanes) s = vfmadd(vload(qr + d), vload(kr + d), s);
        p[r * kTile + j] = vsum(s);
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < group; ++r) {
      const float* qr = qs + r * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * to_float(krow[j][d]);
      p[r * kTile + j] = dot;
    }
  }
}

#if defined(VMKV_VECTOR)
// Rows handled together (a prefill task's, a decode task's GQA group), so that each key or
// value vector loaded feeds R rows' FMAs: one load per R FMAs instead of about one per FMA, which
// made prefill load-bound (a third of the GEMM rate on a Zen 4 EPYC). R x (accumulator vectors)
// stays within the registers: 16 of AVX-512's 32, 8 of AVX2's 16. Each output element's FMA
// chain keeps its order, so the results are bit-identical to one row at a time.
constexpr int64_t kAccVecs = kLanes == 16 ? 16 : 8;
constexpr int64_t kValueChains = 4;                      // value vectors per row and d chunk
constexpr int64_t kValueRows = kAccVecs / kValueChains;  // rows per value block

// acc_r[d .. d + kValueChains * kLanes) += sum_j p[r * kTile + j] * v_j for rows r0 .. r0 + R.
template <int R, typename T>
inline void value_rows(const float* p, int64_t r0, int64_t d, int64_t dim, const T* const* vrow,
                       int64_t n, float* acc, TilePrefetch* next) {
  vfloat av[R][kValueChains];
  for (int i = 0; i < R; ++i) {
    float* a = acc + (r0 + i) * dim + d;
    for (int64_t c = 0; c < kValueChains; ++c) av[i][c] = vload(a + c * kLanes);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (next != nullptr) next->step();
    vfloat vj[kValueChains];
    for (int64_t c = 0; c < kValueChains; ++c) vj[c] = vload(vrow[j] + d + c * kLanes);
    for (int i = 0; i < R; ++i) {
      const vfloat pj = vset1(p[(r0 + i) * kTile + j]);
      for (int64_t c = 0; c < kValueChains; ++c) av[i][c] = vfmadd(pj, vj[c], av[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float* a = acc + (r0 + i) * dim + d;
    for (int64_t c = 0; c < kValueChains; ++c) vstore(a + c * kLanes, av[i][c]);
  }
}

#endif

// acc_r += sum_j p[r * kTile + j] * v_j for the group's rows r and tokens j < n; `next` as in
// tile_scores.
template <typename T>
inline void tile_values(const float* p, int64_t group, int64_t dim, const T* const* vrow,
                        int64_t n, float* acc, TilePrefetch* next = nullptr) {
#if defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {  // pieces of acc in registers across the tile, rows in blocks
    int64_t d = 0;
    for (; d + kValueChains * kLanes <= dim; d += kValueChains * kLanes) {
      in_row_blocks<kValueRows>(group, [&](auto rows_, int64_t r0) {
        value_rows<decltype(rows_)::value>(p, r0, d, dim, vrow, n, acc, next);
      });
    }
    for (; d < dim; d += kLanes) {
      for (int64_t r = 0; r < group; ++r) {
        float* a = acc + r * dim + d;
        vfloat av = vload(a);
        for (int64_t j = 0; j < n; ++j) {
          av = vfmadd(vset1(p[r * kTile + j]), vload(vrow[j] + d), av);
        }
        vstore(a, av);
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < group; ++r) {
      const float pj = p[r * kTile + j];
      float* a = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += pj * to_float(vrow[j][d]);
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 decode on AVX512-BF16 dot products (vdpbf16ps): no widening of K/V, a score tile of
// 16 tokens summed into one vector at once, P rounded to bf16 for the value products (as torch's
// CPU flash attention does). Compiled per GQA group (up to kDpMaxGroup query heads per KV head)
// and head_dim (64 or 128) so that a tile's partial scores and a dim chunk's value accumulators
// stay in registers (with runtime shapes they lived on the stack and the kernel, at 37 ns per
// token of 3 KV heads on a 2-core EPYC from cache, was slower than memory; compiled: 17 ns);
// other shapes use the widening loops above.
constexpr int64_t kDpTile = 16;      // tokens per score vector
constexpr int64_t kDpBlock = 64;     // tokens per online-softmax step (whole score vectors)
constexpr int kDpMaxGroup = 8;       // query heads per KV head

// Vectors of a dim chunk whose value accumulators (two per query head and vector) fit in
// about 24 registers.
template <int GROUP, int VECS>
constexpr int dp_chunk_vecs() {
  int cv = VECS;
  while (cv > 1 && 2 * GROUP * cv > 24) cv /= 2;
  return cv;
}

inline __m512i load_row_part(const bf16* p) { return _mm512_loadu_si512(p); }

// The task's KV heads [kvh0, kvh1) of request b over its len tokens: q (bf16, exact) against K
// in place, online softmax in float32, values accumulated as bf16 pairs into float32 lanes whose
// dims are interleaved (unpacklo/hi of two V rows: lane 4L + k of chunk c is dim 32c + 8L + k,
// or + 4 for the high half), undone at the store. (kvh1 - kvh0) * GROUP <= kMaxTaskRows.
// The KV mode is an argument, not a template parameter: it only picks how a block's 64 row
// numbers are computed, and half the instantiations cut the library's build by ~4 s.
template <int GROUP, int VECS>
void dp_attend(bool paged, const bf16* q, int64_t q_stride_b, int64_t q_stride_h, const bf16* k,
               const bf16* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
               const int32_t* table, int64_t table_stride, int64_t block_size, int64_t b,
               int64_t lo, int64_t len, int64_t kvh0, int64_t kvh1, float scale, bf16* out,
               int64_t out_stride_b, int64_t out_stride_h) {
  constexpr int64_t dim = 32 * VECS, lanes = 2 * VECS * 16;
  constexpr int CV = dp_chunk_vecs<GROUP, VECS>();
  const int64_t span = kvh1 - kvh0, nrows = span * GROUP;
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(bf16));
  alignas(64) float acc[kMaxTaskRows][lanes];  // [row][vector 2c (lo) or 2c + 1 (hi)][16]
  float m[kMaxTaskRows], l[kMaxTaskRows];
  alignas(64) uint16_t pb[GROUP][kDpBlock + 1];  // P of the head's block, bf16, + a zero
  int64_t rows[kDpBlock], next_rows[kDpBlock];
  for (int64_t r = 0; r < nrows; ++r) {
    std::fill(acc[r], acc[r] + lanes, 0.0f);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int g = 0; g < GROUP; ++g) pb[g][kDpBlock] = 0;
  const auto row_at = [&](int64_t t) {
    return paged ? row_of<true>(b, t, starts, table, table_stride, block_size)
                 : row_of<false>(b, t, starts, table, table_stride, block_size);
  };
  for (int64_t j = 0; j < std::min(kDpBlock, len - lo); ++j) {  // the first block: not fetched
    const int64_t row = row_at(lo + j);
    for (int64_t h = kvh0; h < kvh1; ++h) {
      prefetch_row(k + row * stride_row + h * stride_head, head_bytes);
      prefetch_row(v + row * stride_row + h * stride_head, head_bytes);
    }
  }
  for (int64_t t0 = lo; t0 < len; t0 += kDpBlock) {
    const int64_t n = std::min(kDpBlock, len - t0), vecs_n = (n + kDpTile - 1) / kDpTile;
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = row_at(t0 + j);
    }
    // a partial tile reads the block's first row again (its scores are masked off)
    for (int64_t j = n; j < vecs_n * kDpTile; ++j) rows[j] = rows[0];
    // the next block's rows, fetched a few lines per token pair of the value loop below (one
    // burst would wait for line-fill buffers instead of computing)
    const int64_t ahead = std::max<int64_t>(0, std::min(kDpBlock, len - t0 - kDpBlock));
    for (int64_t j = 0; j < ahead; ++j) {
      next_rows[j] = row_at(t0 + kDpBlock + j);
    }
    for (int64_t h = 0; h < span; ++h) {
      const int64_t off = (kvh0 + h) * stride_head;
      float rescale[GROUP];
      for (int g = 0; g < GROUP; ++g) {  // scores, online softmax, P in bf16
        const int64_t r = h * GROUP + g;
        const bf16* qr = q + b * q_stride_b + (kvh0 * GROUP + r) * q_stride_h;
        __m512i qv[VECS];
        for (int c = 0; c < VECS; ++c) qv[c] = load_row_part(qr + 32 * c);
        __m512 scores[kDpBlock / kDpTile];
        __m512 block_max = _mm512_set1_ps(-INFINITY);
        for (int64_t u = 0; u < vecs_n; ++u) {  // 16 tokens' scores as one vector
          const int64_t j0 = u * kDpTile, nu = std::min(kDpTile, n - j0);
          __m512 part[kDpTile];
#pragma GCC unroll 16
          for (int j = 0; j < kDpTile; ++j) {
            const bf16* kr = k + rows[j0 + j] * stride_row + off;
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < VECS; ++c) {
              s = _mm512_dpbf16_ps(s, (__m512bh)qv[c], (__m512bh)load_row_part(kr + 32 * c));
            }
            part[j] = s;
          }
          scores[u] = _mm512_mul_ps(vsum16(part), _mm512_set1_ps(scale));
          const __mmask16 live = static_cast<__mmask16>((1u << nu) - 1u);
          block_max = _mm512_mask_max_ps(block_max, live, block_max, scores[u]);
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(block_max));
        rescale[g] = max_rescale(m[r], m_new);
        __m512 sums = _mm512_setzero_ps();
        for (int64_t u = 0; u < vecs_n; ++u) {
          const int64_t nu = std::min(kDpTile, n - u * kDpTile);
          const __m512 p = _mm512_maskz_mov_ps(
              static_cast<__mmask16>((1u << nu) - 1u),
              exp_nonpositive_v(_mm512_sub_ps(scores[u], _mm512_set1_ps(m_new))));
          sums = _mm512_add_ps(sums, p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb[g] + u * kDpTile),
                              (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[r] = l[r] * rescale[g] + _mm512_reduce_add_ps(sums);
        m[r] = m_new;
      }
      // values: token pairs as bf16 pairs, a chunk of CV vectors of every query head at a time
      for (int cc = 0; cc < VECS; cc += CV) {
        __m512 a[GROUP][2 * CV];
        for (int g = 0; g < GROUP; ++g) {
          const __m512 f = _mm512_set1_ps(rescale[g]);
          for (int e = 0; e < 2 * CV; ++e) {
            a[g][e] = _mm512_mul_ps(_mm512_load_ps(acc[h * GROUP + g] + (2 * cc + e) * 16), f);
          }
        }
        for (int64_t j = 0; j < n; j += 2) {
          if (cc == 0) {
            for (int64_t i = j; i < std::min(j + 2, ahead); ++i) {
              const int64_t at = next_rows[i] * stride_row + off;
              for (int64_t o = 0; o < head_bytes; o += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(k + at) + o, 0, 1);
                __builtin_prefetch(reinterpret_cast<const char*>(v + at) + o, 0, 1);
              }
            }
          }
          const bf16* v0 = v + rows[j] * stride_row + off + 32 * cc;
          const bf16* v1 = j + 1 < n ? v + rows[j + 1] * stride_row + off + 32 * cc : nullptr;
          __m512i lo[CV], hi[CV];
          for (int c = 0; c < CV; ++c) {
            const __m512i x = load_row_part(v0 + 32 * c);
            const __m512i z = v1 != nullptr ? load_row_part(v1 + 32 * c) : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(x, z);
            hi[c] = _mm512_unpackhi_epi16(x, z);
          }
          for (int g = 0; g < GROUP; ++g) {
            uint32_t pair;  // P of tokens j, j + 1 (0 past n: stored zero)
            std::memcpy(&pair, &pb[g][j], sizeof(pair));
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int c = 0; c < CV; ++c) {
              a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo[c], pp);
              a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi[c], pp);
            }
          }
        }
        for (int g = 0; g < GROUP; ++g) {
          for (int e = 0; e < 2 * CV; ++e) {
            _mm512_store_ps(acc[h * GROUP + g] + (2 * cc + e) * 16, a[g][e]);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    bf16* o = out + b * out_stride_b + (kvh0 * GROUP + r) * out_stride_h;
    const float inv = len > 0 ? 1.0f / l[r] : 0.0f;
    for (int64_t c = 0; c < VECS; ++c) {
      const float* lo = acc[r] + 2 * c * 16;
      const float* hi = lo + 16;
      for (int64_t lane = 0; lane < 4; ++lane) {
        for (int64_t i = 0; i < 4; ++i) {
          o[32 * c + 8 * lane + i] = float_to_bf16(lo[4 * lane + i] * inv);
          o[32 * c + 8 * lane + 4 + i] = float_to_bf16(hi[4 * lane + i] * inv);
        }
      }
    }
  }
}

using DpKernel = decltype(&dp_attend<1, 1>);

template <int VECS, int... G>
DpKernel dp_kernel_of_group(int64_t group, std::integer_sequence<int, G...>) {
  DpKernel fn = nullptr;
  ((group == G + 1 ? (fn = &dp_attend<G + 1, VECS>) : fn), ...);
  return fn;
}

// The compiled kernel for this GQA group and head_dim, or nullptr (use the widening loops).
DpKernel dp_kernel(int64_t group, int64_t dim) {
  const auto groups = std::make_integer_sequence<int, kDpMaxGroup>{};
  switch (dim) {
    case 64: return dp_kernel_of_group<2>(group, groups);
    case 128: return dp_kernel_of_group<4>(group, groups);
    default: return nullptr;
  }
}
#endif

template <typename T, bool PAGED>
void decode(const T* q, int64_t q_stride_b, int64_t q_stride_h, const T* k,
            const T* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
            const int32_t* table, int64_t table_stride, int64_t block_size,
            const int32_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            float scale, T* out, int64_t out_stride_b, int64_t out_stride_h,
            const NewRows<T>& fresh, int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(T));
  // A task is a request's KV heads [kvh0, kvh0 + span): all of them (each token's K and V rows
  // of every head are read together, one stream per request) unless there are too few requests
  // to keep the threads busy; then one head each. Each head's arithmetic is the same either way.
#if defined(_OPENMP)
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  const int64_t span = batch >= 4 * threads && kv_heads * group <= kMaxTaskRows ? kv_heads : 1;
  const int64_t splits = kv_heads / span;
#if defined(__AVX512BF16__)
  const DpKernel dp = std::is_same_v<T, bf16> ? dp_kernel(group, dim) : nullptr;
#endif
#pragma omp parallel
  {
    std::vector<float> qs(static_cast<size_t>(heads * dim));     // [heads, dim], scaled
    std::vector<float> acc(static_cast<size_t>(heads * dim));    // [heads, dim]
    std::vector<float> p(static_cast<size_t>(group * kTile));    // [group, tile]
    std::vector<float> m(static_cast<size_t>(heads)), sum(static_cast<size_t>(heads));
    std::vector<int64_t> rows(static_cast<size_t>(kTile)), next_rows(static_cast<size_t>(kTile));
    std::vector<const T*> krow(static_cast<size_t>(kTile)), vrow(static_cast<size_t>(kTile));
    TilePrefetch next;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * splits; ++task) {
      const int64_t b = task / splits, kvh0 = task % splits * span, kvh1 = kvh0 + span;
      const int64_t len = seq_lens[b];
      // a sliding window: the query (token len - 1) sees tokens lo .. len - 1 only; nothing
      // before lo is read (its pages or blocks may be given back)
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (fresh.k != nullptr && len > 0) {  // store the new token's K/V rows of these heads
        const int64_t row = row_of<PAGED>(b, len - 1, starts, table, table_stride, block_size);
        for (int64_t h = kvh0; h < kvh1; ++h) {
          std::memcpy(const_cast<T*>(k) + row * stride_row + h * stride_head,
                      fresh.k + b * fresh.k_stride_b + h * fresh.k_stride_h, head_bytes);
          std::memcpy(const_cast<T*>(v) + row * stride_row + h * stride_head,
                      fresh.v + b * fresh.v_stride_b + h * fresh.v_stride_h, head_bytes);
        }
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) {
        if (dp != nullptr) {
          dp(PAGED, q, q_stride_b, q_stride_h, k, v, stride_row, stride_head, starts, table,
             table_stride, block_size, b, lo, len, kvh0, kvh1, scale, out, out_stride_b,
             out_stride_h);
          continue;
        }
      }
#endif
      for (int64_t r = kvh0 * group; r < kvh1 * group; ++r) {
        const T* src = q + b * q_stride_b + r * q_stride_h;
        float* dst = qs.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]) * scale;
      }
      // the task's heads of a row as one run (heads inside the row, as the engine lays them
      // out: from head kvh0's first element to head kvh1 - 1's last), else head by head
      const int64_t run = (kvh1 - kvh0 - 1) * stride_head + dim;
      const bool one_run = stride_head >= dim && run <= stride_row;
      const int64_t run_bytes = (one_run ? run : dim) * static_cast<int64_t>(sizeof(T));
      const int64_t runs = one_run ? 1 : kvh1 - kvh0;
      std::fill(acc.begin() + kvh0 * group * dim, acc.begin() + kvh1 * group * dim, 0.0f);
      std::fill(m.begin() + kvh0 * group, m.begin() + kvh1 * group, -INFINITY);
      std::fill(sum.begin() + kvh0 * group, sum.begin() + kvh1 * group, 0.0f);
      // Tokens go in tiles (online softmax): per head, a tile's K rows, then the same tokens'
      // V rows; the tile's exponentials are vector loops. Memory: computed head by head, the
      // tile reads each row in pieces (a head's 256 bytes of every 768 in float32 with 3 KV
      // heads), a pattern the hardware prefetchers did not stream: K/V came in at 12-15 GB/s
      // where reading the same rows whole ran at 25 (a 2-core Zen 4 EPYC). So the first tile's
      // rows are read whole in address order, and each next tile's are fetched into L2 during
      // the tile before (TilePrefetch).
      const auto rows_of_tile = [&](int64_t t0, int64_t* out_rows) {
        for (int64_t j = 0; j < std::min(kTile, len - t0); ++j) {
          out_rows[j] = row_of<PAGED>(b, t0 + j, starts, table, table_stride, block_size);
        }
      };
      rows_of_tile(lo, rows.data());
      for (int64_t t0 = lo; t0 < len; t0 += kTile) {
        const int64_t n = len - t0 < kTile ? len - t0 : kTile;
        // the next tile's rows fetched during this tile's arithmetic (a paged tile's blocks are
        // scattered: no hardware prefetcher follows them); the first tile's read in address
        // order first (a demand stream, which the hardware prefetchers do follow)
        const int64_t ahead = std::max<int64_t>(0, std::min(kTile, len - t0 - kTile));
        rows_of_tile(t0 + kTile, next_rows.data());
        next.start(run_bytes);
        for (const T* base : {k, v}) {
          for (int64_t j = 0; j < ahead; ++j) {
            const T* at = base + next_rows[j] * stride_row + kvh0 * stride_head;
            for (int64_t i = 0; i < runs; ++i) next.add(at + i * stride_head);
          }
        }
        if (t0 == lo) {
          for (const T* base : {k, v}) {
            for (int64_t j = 0; j < n; ++j) {
              for (int64_t i = 0; i < runs; ++i) {
                read_lines(base + rows[j] * stride_row + (kvh0 + i) * stride_head, run_bytes);
              }
            }
          }
        }
        for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
          for (int64_t j = 0; j < n; ++j) {
            krow[j] = k + rows[j] * stride_row + kvh * stride_head;
            vrow[j] = v + rows[j] * stride_row + kvh * stride_head;
          }
          const int64_t h0 = kvh * group;
          tile_scores(qs.data() + h0 * dim, group, dim, krow.data(), n, p.data(), &next);
          for (int64_t r = 0; r < group; ++r) {
            softmax_tile_row(p.data() + r * kTile, n, m[h0 + r], sum[h0 + r],
                             acc.data() + (h0 + r) * dim, dim);
          }
          tile_values(p.data(), group, dim, vrow.data(), n, acc.data() + h0 * dim, &next);
        }
        next.finish();
        std::swap(rows, next_rows);
      }
      for (int64_t r = kvh0 * group; r < kvh1 * group; ++r) {
        T* o = out + b * out_stride_b + r * out_stride_h;
        const float* a = acc.data() + r * dim;
        const float inv = len > 0 ? 1.0f / sum[r] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(a[d] * inv);
      }
    }
  }
}

// Prefill chunks: entry b brings q_lens[b] query tokens (rows q_start[b] .. of q and out)
// after ctx = seq_lens[b] - q_lens[b] cached ones; query i (position ctx + i) sees keys 0 .. ctx + i,
// or with a sliding window W > 0 only keys ctx + i - W + 1 .. ctx + i: nothing before the
// entry's first query's window (ctx - W + 1) is read, so its pages or blocks may be gone.
// One task per (request, tile of kQTile queries, kv head): its group's query heads x queries
// are the rows of a flash-attention loop over key tiles of kKTile tokens. Scores are outer
// products (q broadcast, the key tile transposed so its kKTile tokens are contiguous), the
// value update a broadcast of p over a value row: both vectorise without horizontal sums.
constexpr int64_t kQTile = 16;  // query tokens per task

constexpr int64_t kKTile = kTile;  // key tokens per tile (tile_values' p layout)
#ifndef VMKV_TRANSPOSED_MAX
#define VMKV_TRANSPOSED_MAX (64 << 20)
#endif
constexpr int64_t kTransposedMax = VMKV_TRANSPOSED_MAX;  // bytes of key tiles transposed once per call

#if defined(VMKV_VECTOR)
constexpr int64_t kScoreVecs = kTile / kLanes;        // score vectors per row of a tile
constexpr int64_t kScoreRows = kAccVecs / kScoreVecs;  // rows per score block

// s[r * kTile + j] = q_r . k_j for rows r0 .. r0 + R, the key tile transposed in kt [dim, kTile].
// AVX2: the key vectors are pinned in registers (the empty asm): GCC folded each load into every
// row's FMA as a memory operand, R loads per vector, and on a Zen 3 EPYC the loop ran at 52
// GFLOP/s a core where it runs at 90 with them in registers (the same FMAs: the same bits).
template <int R>
inline void score_rows(const float* qs, int64_t r0, int64_t dim, const float* kt, float* s) {
  vfloat sv[R][kScoreVecs];
  for (int i = 0; i < R; ++i) {
    for (int64_t c = 0; c < kScoreVecs; ++c) sv[i][c] = vzero();
  }
  for (int64_t d = 0; d < dim; ++d) {
    vfloat kd[kScoreVecs];
    for (int64_t c = 0; c < kScoreVecs; ++c) kd[c] = vload(kt + d * kTile + c * kLanes);
    if constexpr (kLanes == 8 && kScoreVecs == 4) {
      asm("" : "+x"(kd[0]), "+x"(kd[1]), "+x"(kd[2]), "+x"(kd[3]));
    }
    for (int i = 0; i < R; ++i) {
      const vfloat qd = vset1(qs[(r0 + i) * dim + d]);
      for (int64_t c = 0; c < kScoreVecs; ++c) sv[i][c] = vfmadd(qd, kd[c], sv[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int64_t c = 0; c < kScoreVecs; ++c) vstore(s + (r0 + i) * kTile + c * kLanes, sv[i][c]);
  }
}

#endif

template <typename T, bool PAGED>
void prefill(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k,
             const T* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
             const int32_t* table, int64_t table_stride, int64_t block_size,
             const int32_t* q_start, const int32_t* q_lens, const int32_t* seq_lens,
             int64_t batch, int64_t heads,
             int64_t kv_heads, int64_t dim, float scale, T* out, int64_t out_stride_t,
             int64_t out_stride_h, int64_t window) {
  const int64_t group = heads / kv_heads;
  // entry b's first key any of its queries sees (0 without a window)
  const auto first_key = [&](int64_t b) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, seq_lens[b] - q_lens[b] - window + 1) : 0;
  };
  std::vector<int64_t> task_b, task_q0;  // one per (request, query tile)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t q0 = 0; q0 < q_lens[b]; q0 += kQTile) {
      task_b.push_back(b);
      task_q0.push_back(q0);
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(task_b.size()) * kv_heads;
  // Every key tile transposed once, [request's tile, kv head][dim, kKTile] (zero past the
  // request's tokens): each (query tile, head) task of a request reads them all again (it had
  // transposed each itself: ~15 % of the kernel at 640-token prompts). Past kTransposedMax bytes
  // (long cached contexts) each task transposes its tiles itself, as before.
  // request b's tiles: key tiles first_key(b) / kKTile .. of its own, from tile0[b] on
  std::vector<int64_t> tile0(static_cast<size_t>(batch) + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    tile0[b + 1] = tile0[b] + (seq_lens[b] + kKTile - 1) / kKTile - first_key(b) / kKTile;
  }
  const int64_t tile_floats = dim * kKTile, tiles = tile0[batch] * kv_heads;
  const bool once = tiles * tile_floats * static_cast<int64_t>(sizeof(float)) <= kTransposedMax;
  const std::unique_ptr<float[]> kt_all(once ? new float[tiles * tile_floats] : nullptr);
  const auto transpose = [&](int64_t b, int64_t kvh, int64_t k0, float* kt) {  // kt [dim, kKTile]
    const int64_t nk = std::min(kKTile, seq_lens[b] - k0);
    const int64_t skip = std::clamp<int64_t>(first_key(b) - k0, 0, nk);  // before the window
    for (int64_t j = 0; j < skip; ++j) {
      for (int64_t d = 0; d < dim; ++d) kt[d * kKTile + j] = 0.0f;
    }
    for (int64_t j = skip; j < nk; ++j) {
      const int64_t row = row_of<PAGED>(b, k0 + j, starts, table, table_stride, block_size);
      const T* kr = k + row * stride_row + kvh * stride_head;
      for (int64_t d = 0; d < dim; ++d) kt[d * kKTile + j] = to_float(kr[d]);
    }
    for (int64_t j = nk; j < kKTile; ++j) {
      for (int64_t d = 0; d < dim; ++d) kt[d * kKTile + j] = 0.0f;
    }
  };
#pragma omp parallel
  {
    if (once) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t job = 0; job < tiles; ++job) {
        const int64_t tile = job / kv_heads;
        const int64_t b = std::upper_bound(tile0.begin(), tile0.end(), tile) - tile0.begin() - 1;
        transpose(b, job % kv_heads, (tile - tile0[b] + first_key(b) / kKTile) * kKTile,
                  kt_all.get() + job * tile_floats);
      }
    }
    std::vector<float> own(once ? 0 : static_cast<size_t>(tile_floats));  // [dim, tile]
    const int64_t max_rows = group * kQTile;
    std::vector<float> qs(static_cast<size_t>(max_rows * dim));   // [rows, dim], scaled
    std::vector<float> acc(static_cast<size_t>(max_rows * dim));  // [rows, dim]
    std::vector<float> s(static_cast<size_t>(max_rows * kKTile)); // [rows, tile]
    std::vector<float> m(static_cast<size_t>(max_rows)), l(static_cast<size_t>(max_rows));
    std::vector<const T*> vrow(static_cast<size_t>(kKTile));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t b = task_b[task / kv_heads], q0 = task_q0[task / kv_heads];
      const int64_t kvh = task % kv_heads;
      const int64_t q_len = q_lens[b], ctx = seq_lens[b] - q_len;
      const int64_t nq = std::min(kQTile, q_len - q0), nrows = nq * group;
      for (int64_t r = 0; r < nrows; ++r) {  // row r: query q0 + r / group, head r % group
        const T* src = q + (q_start[b] + q0 + r / group) * q_stride_t +
                       (kvh * group + r % group) * q_stride_h;
        float* dst = qs.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]) * scale;
      }
      std::fill(acc.begin(), acc.begin() + nrows * dim, 0.0f);
      std::fill(m.begin(), m.begin() + nrows, -INFINITY);
      std::fill(l.begin(), l.begin() + nrows, 0.0f);
      const int64_t kv_end = ctx + q0 + nq;  // the tile's last query sees keys < kv_end
      const int64_t lo_b = first_key(b);   // rows before it are never read (values: aliased)
      // the tile's first query sees keys from k_lo on (the window's start, or 0)
      const int64_t k_lo = window > 0 ? std::max<int64_t>(0, ctx + q0 - window + 1) : 0;
      for (int64_t k0 = k_lo / kKTile * kKTile; k0 < kv_end; k0 += kKTile) {
        const int64_t nk = std::min(kKTile, kv_end - k0);
        const float* kt = own.data();
        if (once) {
          const int64_t tile = tile0[b] + k0 / kKTile - lo_b / kKTile;
          kt = kt_all.get() + (tile * kv_heads + kvh) * tile_floats;
        } else {
          transpose(b, kvh, k0, own.data());
        }
#if defined(VMKV_VECTOR)
        in_row_blocks<kScoreRows>(nrows, [&](auto rows_, int64_t r0) {
          score_rows<decltype(rows_)::value>(qs.data(), r0, dim, kt, s.data());
        });
#endif
        for (int64_t r = 0; r < nrows; ++r) {  // scores (unless above), masked, online softmax
          float* sr = s.data() + r * kKTile;
#if !defined(VMKV_VECTOR)
          const float* qr = qs.data() + r * dim;
#pragma omp simd
          for (int64_t j = 0; j < kKTile; ++j) sr[j] = 0.0f;
          for (int64_t d = 0; d < dim; ++d) {
            const float qd = qr[d];
            const float* kd = kt + d * kKTile;
#pragma omp simd
            for (int64_t j = 0; j < kKTile; ++j) sr[j] += qd * kd[j];
          }
#endif
          const int64_t pos = ctx + q0 + r / group;  // the query's position
          const int64_t visible = std::min(nk, pos + 1 - k0);  // causal
          // a window's first visible key in this tile: the scores before it are masked out
          const int64_t hidden = window > 0 ? std::max<int64_t>(0, pos - window + 1 - k0) : 0;
          if (hidden == 0) {
            softmax_tile_row(sr, visible, m[r], l[r], acc.data() + r * dim, dim);
          } else if (hidden >= visible) {  // none of this tile: p zero, m and l unchanged
            softmax_tile_row(sr, 0, m[r], l[r], acc.data() + r * dim, dim);
          } else {
            std::fill(sr, sr + hidden, -INFINITY);
            softmax_tile_row(sr, visible, m[r], l[r], acc.data() + r * dim, dim);
            std::fill(sr, sr + hidden, 0.0f);
          }
        }
        for (int64_t j = 0; j < nk; ++j) {  // rows before lo_b: lo_b's (p is 0 there)
          vrow[j] = v + row_of<PAGED>(b, std::max(k0 + j, lo_b), starts, table, table_stride,
                                      block_size) * stride_row + kvh * stride_head;
        }
        tile_values(s.data(), nrows, dim, vrow.data(), nk, acc.data());  // acc += P V
      }
      for (int64_t r = 0; r < nrows; ++r) {
        T* o = out + (q_start[b] + q0 + r / group) * out_stride_t +
                 (kvh * group + r % group) * out_stride_h;
        const float* a = acc.data() + r * dim;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(a[d] * inv);
      }
    }
  }
}

// The element types of q, k, v, out and the new rows (one for all): the CUDA library's codes.
constexpr int kFloat32 = 0, kBFloat16 = 2;

template <typename T>
int decode_entry(const void* q, int64_t q_stride_b, int64_t q_stride_h, const void* k,
                 const void* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
                 const int32_t* table, int64_t table_stride, int64_t block_size,
                 const int32_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                 int64_t dim, float scale, void* out, int64_t out_stride_b, int64_t out_stride_h,
                 const void* k_new, int64_t k_new_stride_b, int64_t k_new_stride_h,
                 const void* v_new, int64_t v_new_stride_b, int64_t v_new_stride_h,
                 int64_t window) {
  const NewRows<T> fresh{static_cast<const T*>(k_new), k_new_stride_b, k_new_stride_h,
                         static_cast<const T*>(v_new), v_new_stride_b, v_new_stride_h};
  const auto* qt = static_cast<const T*>(q);
  const auto *kt = static_cast<const T*>(k), *vt = static_cast<const T*>(v);
  auto* ot = static_cast<T*>(out);
  if (table != nullptr) {
    if (block_size <= 0) return 1;
    decode<T, true>(qt, q_stride_b, q_stride_h, kt, vt, stride_row, stride_head, nullptr, table,
                    table_stride, block_size, seq_lens, batch, heads, kv_heads, dim, scale, ot,
                    out_stride_b, out_stride_h, fresh, window);
  } else {
    if (starts == nullptr) return 1;
    decode<T, false>(qt, q_stride_b, q_stride_h, kt, vt, stride_row, stride_head, starts,
                     nullptr, 0, 1, seq_lens, batch, heads, kv_heads, dim, scale, ot,
                     out_stride_b, out_stride_h, fresh, window);
  }
  return 0;
}

template <typename T>
int prefill_entry(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                  const void* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
                  const int32_t* table, int64_t table_stride, int64_t block_size,
                  const int32_t* q_start, const int32_t* q_lens, const int32_t* seq_lens,
                  int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                  void* out, int64_t out_stride_t, int64_t out_stride_h, int64_t window) {
  const auto* qt = static_cast<const T*>(q);
  const auto *kt = static_cast<const T*>(k), *vt = static_cast<const T*>(v);
  auto* ot = static_cast<T*>(out);
  if (table != nullptr) {
    if (block_size <= 0) return 1;
    prefill<T, true>(qt, q_stride_t, q_stride_h, kt, vt, stride_row, stride_head, nullptr,
                     table, table_stride, block_size, q_start, q_lens, seq_lens, batch, heads,
                     kv_heads, dim, scale, ot, out_stride_t, out_stride_h, window);
  } else {
    if (starts == nullptr) return 1;
    prefill<T, false>(qt, q_stride_t, q_stride_h, kt, vt, stride_row, stride_head, starts,
                      nullptr, 0, 1, q_start, q_lens, seq_lens, batch, heads, kv_heads, dim,
                      scale, ot, out_stride_t, out_stride_h, window);
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 on bad arguments. dtype: 0 float32, 2 bfloat16 (q, k, v, out and the
// new rows alike; float32 arithmetic either way). With k_new (and v_new) given, entry b's new
// K/V rows k_new[b], v_new[b] ([batch, kv_heads, dim] at the given strides) are first stored at
// its token seq_lens[b] - 1; the cache k, v is then written, not only read. window > 0: a
// sliding window, entry b attends to its last `window` tokens only (0: all of them).
int vmkv_cpu_decode_attention(int dtype, const void* q, int64_t q_stride_b, int64_t q_stride_h,
                              const void* k, const void* v, int64_t stride_row,
                              int64_t stride_head, const int64_t* starts, const int32_t* table,
                              int64_t table_stride, int64_t block_size, const int32_t* seq_lens,
                              int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                              float scale, void* out, int64_t out_stride_b,
                              int64_t out_stride_h, const void* k_new, int64_t k_new_stride_b,
                              int64_t k_new_stride_h, const void* v_new,
                              int64_t v_new_stride_b, int64_t v_new_stride_h, int64_t window) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || batch < 0 || window < 0) return 1;
  if ((k_new == nullptr) != (v_new == nullptr)) return 1;
  if (dtype == kFloat32) {
    return decode_entry<float>(q, q_stride_b, q_stride_h, k, v, stride_row, stride_head, starts,
                               table, table_stride, block_size, seq_lens, batch, heads,
                               kv_heads, dim, scale, out, out_stride_b, out_stride_h, k_new,
                               k_new_stride_b, k_new_stride_h, v_new, v_new_stride_b,
                               v_new_stride_h, window);
  }
  if (dtype == kBFloat16) {
    return decode_entry<bf16>(q, q_stride_b, q_stride_h, k, v, stride_row, stride_head, starts,
                              table, table_stride, block_size, seq_lens, batch, heads, kv_heads,
                              dim, scale, out, out_stride_b, out_stride_h, k_new,
                              k_new_stride_b, k_new_stride_h, v_new, v_new_stride_b,
                              v_new_stride_h, window);
  }
  return 1;
}

// Prefill chunks (see prefill above), dtype and window as for decode; returns 0 on success, 1
// on bad arguments.
int vmkv_cpu_prefill_attention(int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h,
                               const void* k, const void* v, int64_t stride_row,
                               int64_t stride_head, const int64_t* starts, const int32_t* table,
                               int64_t table_stride, int64_t block_size,
                               const int32_t* q_start, const int32_t* q_lens,
                               const int32_t* seq_lens, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t dim, float scale, void* out,
                               int64_t out_stride_t, int64_t out_stride_h, int64_t window) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || batch < 0 || window < 0) return 1;
  for (int64_t b = 0; b < batch; ++b) {
    if (q_start[b] < 0 || q_lens[b] < 0 || seq_lens[b] < q_lens[b]) return 1;
  }
  if (dtype == kFloat32) {
    return prefill_entry<float>(q, q_stride_t, q_stride_h, k, v, stride_row, stride_head, starts,
                                table, table_stride, block_size, q_start, q_lens, seq_lens,
                                batch, heads, kv_heads, dim, scale, out, out_stride_t,
                                out_stride_h, window);
  }
  if (dtype == kBFloat16) {
    return prefill_entry<bf16>(q, q_stride_t, q_stride_h, k, v, stride_row, stride_head, starts,
                               table, table_stride, block_size, q_start, q_lens, seq_lens,
                               batch, heads, kv_heads, dim, scale, out, out_stride_t,
                               out_stride_h, window);
  }
  return 1;
}

}  // extern "C"
