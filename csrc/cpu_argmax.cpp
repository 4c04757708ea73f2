// Row-wise picks from a float32 matrix on the CPU: greedy sampling's argmax and random
// sampling's inverse-CDF draw.
//
// vmkv_cpu_argmax: torch.argmax's answer, the index of the first maximum, or of the first NaN
// when the row has one (NaN counts as the largest value).
//
// torch's CPU argmax carries an index through a scalar reduction (~2.4 ms for 64 rows of a
// 49,152-token vocabulary on a 2-core AVX-512 machine, where amax takes 0.3 ms). Here each row
// takes two passes the compiler vectorises: the maximum and a NaN check over the whole row,
// then blocks of kBlock values tested for the maximum (or a NaN) until the first block that
// holds one, which is scanned for its first match. Rows are split over the OpenMP threads.
//
// vmkv_cpu_sample: one token per row from softmax(row / temperature), drawn by inverse CDF with
// one uniform u in [0, 1) per row: the first index whose running sum of exp((x - max) / T)
// exceeds u times the row's total. torch's CPU exponential_ (the exponential race's noise, one
// draw per vocabulary entry) takes ~1 ms a row of 49,152 entries and ~5 ms of 262,144; here a
// row is read twice (max, then exponentials summed per block of kBlock with the block sums kept)
// and the block holding the draw a third time. Tokens at -inf (masked) have no width and are
// never drawn; a row of -inf only returns 0, and a row with a NaN its first NaN (as argmax).
//
// Built by vmkv/kernels/cpu_argmax.py like csrc/cpu_attention.cpp (g++ -O3 -march=native
// -fopenmp, cached, called through ctypes).

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kBlock = 64;

// The first NaN's index, or -1; the row's maximum into *max_out.
int64_t row_max_or_nan(const float* x, int64_t n, float* max_out) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  *max_out = m;
  if (!nan) return -1;
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] != x[j]) return j;
  }
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
  float m;
  const int64_t nan = row_max_or_nan(x, n, &m);
  if (nan >= 0) return nan;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = j0 + kBlock < n ? j0 + kBlock : n;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = j0; j < j1; ++j) hit |= x[j] == m;
    if (!hit) continue;
    for (int64_t j = j0; j < j1; ++j) {
      if (x[j] == m) return j;
    }
  }
  return 0;  // n == 0 (callers reject it); every row of -inf values returns 0 above
}

// exp((x - m) * inv_t), exactly 0 for x = -inf (exp_nonpositive bottoms out at ~1e-38).
inline float width(float x, float m, float inv_t) {
  return x == -INFINITY ? 0.0f : vmkv::exp_nonpositive((x - m) * inv_t);
}

// width summed over [j0, j1) in float32.
float block_sum(const float* x, int64_t j0, int64_t j1, float m, float inv_t) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = j0; j < j1; ++j) s += width(x[j], m, inv_t);
  return s;
}

// The inverse-CDF draw of one row; `sums` holds ceil(n / kBlock) doubles of scratch.
int64_t row_sample(const float* x, int64_t n, float inv_t, double u, double* sums) {
  float m;
  const int64_t nan = row_max_or_nan(x, n, &m);
  if (nan >= 0) return nan;
  if (m == -INFINITY) return 0;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kBlock;
    sums[b] = block_sum(x, j0, j0 + kBlock < n ? j0 + kBlock : n, m, inv_t);
    total += sums[b];
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last = -1;  // the last block with any width: where a draw rounding past the end lands
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] <= 0.0) continue;
    last = b;
    if (acc + sums[b] <= target) {
      acc += sums[b];
      continue;
    }
    break;
  }
  // in block `last`: the first entry whose running sum passes the target, else its last entry
  // with width (the block's float sum and this double walk may round apart)
  const int64_t j0 = last * kBlock, j1 = j0 + kBlock < n ? j0 + kBlock : n;
  int64_t pick = -1;
  for (int64_t j = j0; j < j1; ++j) {
    const float p = width(x[j], m, inv_t);
    if (p <= 0.0f) continue;
    pick = j;
    acc += p;
    if (acc > target) break;
  }
  return pick;
}

}  // namespace

extern "C" int vmkv_cpu_sample(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                               const float* inv_temperature, const double* uniforms,
                               int64_t* out) {
  if (rows < 0 || cols <= 0 || row_stride < cols) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    if (!(inv_temperature[r] > 0.0f && std::isfinite(inv_temperature[r])) ||
        !(uniforms[r] >= 0.0 && uniforms[r] < 1.0)) {
      return 2;
    }
  }
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel if (rows * cols >= (1 << 16))
  {
    std::vector<double> sums(blocks);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      out[r] = row_sample(x + r * row_stride, cols, inv_temperature[r], uniforms[r], sums.data());
    }
  }
  return 0;
}

extern "C" int vmkv_cpu_argmax(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                               int64_t* out) {
  if (rows < 0 || cols <= 0 || row_stride < cols) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * row_stride, cols);
  return 0;
}
