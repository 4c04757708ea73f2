// Row-wise argmax of a float32 matrix on the CPU, with torch.argmax's answer: the index of the
// first maximum, or of the first NaN when the row has one (NaN counts as the largest value).
//
// torch's CPU argmax carries an index through a scalar reduction (~2.4 ms for 64 rows of a
// 49,152-token vocabulary on a 2-core AVX-512 machine, where amax takes 0.3 ms). Here each row
// takes two passes the compiler vectorises: the maximum and a NaN check over the whole row,
// then blocks of kBlock values tested for the maximum (or a NaN) until the first block that
// holds one, which is scanned for its first match. Rows are split over the OpenMP threads.
//
// Built by vmkv/kernels/cpu_argmax.py like csrc/cpu_attention.cpp (g++ -O3 -march=native
// -fopenmp, cached, called through ctypes).

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 64;

int64_t row_argmax(const float* x, int64_t n) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] != x[j]) return j;
    }
  }
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

}  // namespace

extern "C" int vmkv_cpu_argmax(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                               int64_t* out) {
  if (rows < 0 || cols <= 0 || row_stride < cols) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * row_stride, cols);
  return 0;
}
