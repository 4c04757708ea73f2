// The int8 LM head (--lm-head-dtype int8): a step's logits from int8 products, with each row's
// leading candidates rescored exactly.
//
//   1. x [m, K] (float32 or bf16) quantised per row: s_r = max|x_r| / 127, q = round(x / s_r)
//      in [-127, 127], stored as u8 = q + 128.
//   2. logits[r, n] = (C[r, n] - comp[n]) * s_r * scale[n], C = u8(x) W8^T by oneDNN's u8 x s8
//      brgemm ukernel (torch's export: vpdpbusd on AVX512-VNNI, AMX-INT8 where the CPU has it);
//      W8 [N, K] is the head quantised per row (scale[n] = max|W_n| / 127) and
//      comp[n] = 128 sum_k W8[n, k] takes the u8 offset back out.
//   3. Each row's `candidates` largest logits are recomputed from the dense weight (the model's
//      own head in its dtype, float32 accumulation) and written over their int8 values, so the
//      greedy token is the dense head's wherever its true winner is among those candidates (the
//      int8 error is ~0.1 % of a logit; the candidates span its top handful).
//
// Why: the 262k-row head of Gemma 3 is ~half of a batch-64 bf16 decode step (~52 of ~110 ms on a
// 2-core Zen 4, at ~87 % of its bf16 FLOP rate); u8 x s8 products run at twice the bf16 rate.
//
// W8 is packed in blocks of block_n columns, each [K / 4][block_n][4] (the ukernel's VNNI quads),
// zero columns past N. Built by vmkv/kernels/cpu_int8_head.py (g++ -O3 -march=native -fopenmp,
// cached, called through ctypes); the ukernel reports errors as C++ exceptions, caught here.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_vec.h"

extern "C" {
typedef void (*VmkvBrgemmU8S8)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                               int64_t ldc, bool add_c, const uint8_t* a, const int8_t* b,
                               int32_t* c, bool is_vnni);
typedef void (*VmkvBrgemmRelease)(bool is_vnni);

// The head: packed W8, its corrections and scales, the dense weight rows for rescoring.
struct VmkvInt8Head {
  const int8_t* packed;   // [ceil(N / block_n)][K / 4][block_n][4]
  const int32_t* comp;    // [ceil(N / block_n) * block_n]
  const float* scale;     // [ceil(N / block_n) * block_n]
  const void* dense;      // [N, K] rows, row stride dense_stride (elements)
  int64_t dense_stride;
  int dense_bf16;         // 1: dense rows are bf16, 0: float32
  int64_t in_features, out_features, block_n;
  VmkvBrgemmU8S8 brgemm;
  VmkvBrgemmRelease release;
};
}

namespace {

using namespace vmkv;

constexpr int64_t kTileRows = 64;   // rows of x per product (decode: the whole batch)
constexpr int64_t kMaxCandidates = 64;

template <typename T>
void quantize_row(const T* x, int64_t k, uint8_t* q, float* scale) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < k; ++i) m = std::max(m, std::fabs(to_float(x[i])));
  const float inv = m > 0.f ? 127.f / m : 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(to_float(x[i]) * inv);
    q[i] = static_cast<uint8_t>(static_cast<int>(std::clamp(v, -127.f, 127.f)) + 128);
  }
  *scale = m / 127.f;
}

// The `k` largest values' indices of row[0, n) (first occurrences win ties), k <= have on
// return where the row holds fewer comparable values.
int64_t top_candidates(const float* row, int64_t n, int64_t k, int64_t* idx) {
  float val[kMaxCandidates];
  int64_t have = 0;
  float threshold = -INFINITY;  // the k-th value once k are held
  auto insert = [&](float v, int64_t i) {
    if (!(v > threshold)) return;
    int64_t j = have < k ? have++ : k - 1;
    while (j > 0 && val[j - 1] < v) {
      val[j] = val[j - 1];
      idx[j] = idx[j - 1];
      --j;
    }
    val[j] = v;
    idx[j] = i;
    if (have == k) threshold = val[k - 1];
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), _mm512_set1_ps(threshold),
                                       _CMP_GT_OQ);
    while (hit) {
      const int j = __builtin_ctz(hit);
      insert(row[i + j], i + j);
      hit &= hit - 1;
    }
  }
#endif
  for (; i < n; ++i) insert(row[i], i);
  return have;
}

template <typename X, typename W>
float dot(const X* x, const W* w, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += to_float(x[i]) * to_float(w[i]);
  return acc;
}

template <typename X>
float dense_logit(const VmkvInt8Head& h, const X* x, int64_t n) {
  if (h.dense_bf16) {
    return dot(x, static_cast<const bf16*>(h.dense) + n * h.dense_stride, h.in_features);
  }
  return dot(x, static_cast<const float*>(h.dense) + n * h.dense_stride, h.in_features);
}

template <typename X>
int head(const VmkvInt8Head& h, const X* x, int64_t lda, int64_t m, float* out, int64_t ldo,
         int64_t candidates) {
  const int64_t k = h.in_features, n = h.out_features, bn = h.block_n;
  const int64_t blocks = (n + bn - 1) / bn, tiles = (m + kTileRows - 1) / kTileRows;
  std::vector<uint8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> xs(static_cast<size_t>(m));
#pragma omp parallel for schedule(static) if (m > 16)
  for (int64_t r = 0; r < m; ++r) quantize_row(x + r * lda, k, xq.data() + r * k, &xs[r]);

  std::atomic<bool> failed{false};
#pragma omp parallel
  {
    std::vector<int32_t> c(static_cast<size_t>(kTileRows * bn));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles * blocks; ++t) {
      const int64_t m0 = t / blocks * kTileRows, rows = std::min(kTileRows, m - m0);
      const int64_t j = t % blocks, n0 = j * bn, cols = std::min(bn, n - n0);
      try {
        h.brgemm(rows, bn, k, k, bn, bn, false, xq.data() + m0 * k, h.packed + j * k * bn,
                 c.data(), true);
      } catch (...) {
        failed = true;
        continue;
      }
      const int32_t* comp = h.comp + n0;
      const float* scale = h.scale + n0;
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* cr = c.data() + r * bn;
        float* o = out + (m0 + r) * ldo + n0;
        const float s = xs[m0 + r];
#pragma omp simd
        for (int64_t i = 0; i < cols; ++i) o[i] = static_cast<float>(cr[i] - comp[i]) * s * scale[i];
      }
    }
    try {
      h.release(true);
    } catch (...) {
      failed = true;
    }
  }
  if (failed) return 2;
  if (candidates > 0) {
#pragma omp parallel for schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; ++r) {
      int64_t idx[kMaxCandidates];
      float* o = out + r * ldo;
      const int64_t have = top_candidates(o, n, candidates, idx);
      for (int64_t i = 0; i < have; ++i) o[idx[i]] = dense_logit(h, x + r * lda, idx[i]);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// out [m, N] float32 (row stride ldo) = the head's logits of x [m, K] (row stride lda; bf16 when
// x_bf16, else float32), with each row's `candidates` (0..64) largest rescored from the dense
// weight. 0 on success, 1 for bad arguments, 2 when the ukernel raised.
int vmkv_int8_head(const VmkvInt8Head* h, const void* x, int64_t lda, int x_bf16, int64_t m,
                   float* out, int64_t ldo, int64_t candidates) {
  if (h == nullptr || x == nullptr || out == nullptr || m < 0 || h->in_features % 4 != 0 ||
      h->block_n <= 0 || h->block_n % 16 != 0 || lda < h->in_features ||
      ldo < h->out_features || candidates < 0 || candidates > kMaxCandidates ||
      h->brgemm == nullptr || h->release == nullptr) {
    return 1;
  }
  if (m == 0) return 0;
  if (x_bf16) return head(*h, static_cast<const vmkv::bf16*>(x), lda, m, out, ldo, candidates);
  return head(*h, static_cast<const float*>(x), lda, m, out, ldo, candidates);
}

}  // extern "C"
