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

constexpr int64_t kAhead = 4;  // rows prefetched ahead: rows may sit on different pages

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
    std::vector<float> scores;  // [heads, len], per thread
    std::vector<float> acc;     // [heads, dim]
    std::vector<float> inv_sum;  // [heads]
    // One request per iteration: each token's row (all KV heads) is touched once for K and
    // once for V, which matters when rows are far apart (the all-layers layout's token stride
    // is L*2*H*D elements: every token sits on its own 4 KiB page).
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = seq_lens[b];
      scores.resize(static_cast<size_t>(heads * (len > 0 ? len : 1)));
      acc.assign(static_cast<size_t>(heads * dim), 0.0f);
      inv_sum.assign(static_cast<size_t>(heads), 0.0f);
      const float* qb = q + b * q_stride_b;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t row = row_of<PAGED>(b, t, starts, table, table_stride, block_size);
        if (t + kAhead < len) {
          prefetch_row(k + row_of<PAGED>(b, t + kAhead, starts, table, table_stride,
                                         block_size) * stride_row, row_bytes);
        }
        const float* kr = k + row * stride_row;
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float* kh = kr + (hq / group) * stride_head;
          const float* qh = qb + hq * q_stride_h;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
          scores[hq * len + t] = dot * scale;
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* s = scores.data() + hq * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[hq] = len > 0 ? 1.0f / sum : 0.0f;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t row = row_of<PAGED>(b, t, starts, table, table_stride, block_size);
        if (t + kAhead < len) {
          prefetch_row(v + row_of<PAGED>(b, t + kAhead, starts, table, table_stride,
                                         block_size) * stride_row, row_bytes);
        }
        const float* vr = v + row * stride_row;
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float* vh = vr + (hq / group) * stride_head;
          const float p = scores[hq * len + t];
          float* a = acc.data() + hq * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * vh[d];
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* o = out + b * out_stride_b + hq * out_stride_h;
        const float* a = acc.data() + hq * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv_sum[hq];
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
