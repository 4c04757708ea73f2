// Batched decode attention on the CPU, one kernel body for both KV modes (the CPU twins).
//
// One query token per request attends over that request's cached rows, read in place:
//   contiguous (virtual mode):  row(b, t) = starts[b] + t                  (a slot is contiguous)
//   block table (paged mode):   row(b, t) = table[b][t / bs] * bs + t % bs
// and the element address is  base + row * stride_row + kv_head * stride_head + d.
// Same loops, same arithmetic order in both modes, so both produce bit-identical outputs for the
// same data. Nothing at or past seq_lens[b] is read. float32 only (these CPUs have no fast bf16).
//
// Built by vmkv/kernels/cpu_attention.py with g++ -O3 -fopenmp into a cached shared library and
// called through ctypes: no torch headers, so it compiles in about a second.

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

template <bool PAGED>
inline int64_t row_of(int64_t b, int64_t t, const int64_t* starts, const int32_t* table,
                      int64_t table_stride, int64_t block_size) {
  if constexpr (PAGED) {
    return static_cast<int64_t>(table[b * table_stride + t / block_size]) * block_size +
           t % block_size;
  } else {
    return starts[b] + t;
  }
}

constexpr int64_t kTile = 32;  // tokens per tile: K rows, then the same V rows

inline void prefetch_row(const float* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

template <bool PAGED>
void decode(const float* q, int64_t q_stride_b, int64_t q_stride_h, const float* k,
            const float* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
            const int32_t* table, int64_t table_stride, int64_t block_size,
            const int32_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            float scale, float* out, int64_t out_stride_b, int64_t out_stride_h) {
  const int64_t group = heads / kv_heads;
  const int64_t row_bytes = ((kv_heads - 1) * stride_head + dim) * 4;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(heads * kTile));  // [heads, tile] probabilities
    std::vector<float> acc;  // [heads, dim]
    std::vector<float> m(static_cast<size_t>(heads)), sum(static_cast<size_t>(heads));
    std::vector<int64_t> rows(static_cast<size_t>(kTile));
    // One request per iteration, tokens in tiles (online softmax): a tile's K rows are read,
    // then the same tokens' V rows while their pages are still in the TLB. Every token's row
    // (all KV heads) is touched once for K and once for V — this matters when rows are far
    // apart: the all-layers layout's token stride is L*2*H*D elements, a 4 KiB page per token.
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = seq_lens[b];
      acc.assign(static_cast<size_t>(heads * dim), 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(sum.begin(), sum.end(), 0.0f);
      const float* qb = q + b * q_stride_b;
      for (int64_t t0 = 0; t0 < len; t0 += kTile) {
        const int64_t n = len - t0 < kTile ? len - t0 : kTile;
        for (int64_t j = 0; j < n; ++j) {
          rows[j] = row_of<PAGED>(b, t0 + j, starts, table, table_stride, block_size);
          prefetch_row(k + rows[j] * stride_row, row_bytes);
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = k + rows[j] * stride_row;
          prefetch_row(v + rows[j] * stride_row, row_bytes);
          for (int64_t hq = 0; hq < heads; ++hq) {
            const float* kh = kr + (hq / group) * stride_head;
            const float* qh = qb + hq * q_stride_h;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
            p[hq * kTile + j] = dot * scale;
          }
        }
        for (int64_t hq = 0; hq < heads; ++hq) {  // online softmax update
          float* ph = p.data() + hq * kTile;
          float tile_max = -INFINITY;
          for (int64_t j = 0; j < n; ++j) tile_max = ph[j] > tile_max ? ph[j] : tile_max;
          const float m_new = tile_max > m[hq] ? tile_max : m[hq];
          const float rescale = std::exp(m[hq] - m_new);  // exp(-inf) = 0 on the first tile
          float tile_sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            ph[j] = std::exp(ph[j] - m_new);
            tile_sum += ph[j];
          }
          sum[hq] = sum[hq] * rescale + tile_sum;
          m[hq] = m_new;
          if (rescale != 1.0f) {
            float* a = acc.data() + hq * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* vr = v + rows[j] * stride_row;
          for (int64_t hq = 0; hq < heads; ++hq) {
            const float* vh = vr + (hq / group) * stride_head;
            const float pj = p[hq * kTile + j];
            float* a = acc.data() + hq * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += pj * vh[d];
          }
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* o = out + b * out_stride_b + hq * out_stride_h;
        const float* a = acc.data() + hq * dim;
        const float inv = len > 0 ? 1.0f / sum[hq] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 on bad arguments.
int vmkv_cpu_decode_attention(const float* q, int64_t q_stride_b, int64_t q_stride_h,
                              const float* k, const float* v, int64_t stride_row,
                              int64_t stride_head, const int64_t* starts, const int32_t* table,
                              int64_t table_stride, int64_t block_size, const int32_t* seq_lens,
                              int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                              float scale, float* out, int64_t out_stride_b,
                              int64_t out_stride_h) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || batch < 0) return 1;
  if (table != nullptr) {
    if (block_size <= 0) return 1;
    decode<true>(q, q_stride_b, q_stride_h, k, v, stride_row, stride_head, nullptr, table,
                 table_stride, block_size, seq_lens, batch, heads, kv_heads, dim, scale, out,
                 out_stride_b, out_stride_h);
  } else {
    if (starts == nullptr) return 1;
    decode<false>(q, q_stride_b, q_stride_h, k, v, stride_row, stride_head, starts, nullptr, 0,
                  1, seq_lens, batch, heads, kv_heads, dim, scale, out, out_stride_b,
                  out_stride_h);
  }
  return 0;
}

}  // extern "C"
