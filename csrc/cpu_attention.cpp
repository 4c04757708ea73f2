// Batched attention on the CPU, one kernel body for both KV modes (the CPU twins): decode (one
// query token per request) and prefill chunks (many, causal after the cached context).
//
// Every request attends over its own cached rows, read in place:
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

// Prefill chunks: entry b brings q_lens[b] query tokens (rows q_start[b] .. of q and out)
// after ctx = seq_lens[b] - q_lens[b] cached ones; query i (position ctx + i) sees keys 0 .. ctx + i.
// One task per (request, tile of kQTile queries, kv head): its group's query heads x queries
// are the rows of a flash-attention loop over key tiles of kKTile tokens. Scores are outer
// products (q broadcast, the key tile transposed so its kKTile tokens are contiguous), the
// value update a broadcast of p over a value row: both vectorise without horizontal sums.
constexpr int64_t kQTile = 16;  // query tokens per task

// exp(x) for x <= 0 that vectorises (glibc's expf does not, outside -ffast-math):
// 2^(x log2 e) = 2^i * 2^f with f in [0, 1) from a degree-6 polynomial fitted in relative
// error; within 1.1e-7 of exp (float32 rounding: 6e-8), 0 below x = -87.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.4426950408889634f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 2.1683431e-4f;
  p = p * f + 1.2437946e-3f;
  p = p * f + 9.6799853e-3f;
  p = p * f + 5.5482150e-2f;
  p = p * f + 2.4023031e-1f;
  p = p * f + 6.9314691e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float two_i;
  std::memcpy(&two_i, &bits, sizeof(two_i));
  return p * two_i;
}
constexpr int64_t kKTile = 32;  // key tokens per tile

template <bool PAGED>
void prefill(const float* q, int64_t q_stride_t, int64_t q_stride_h, const float* k,
             const float* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
             const int32_t* table, int64_t table_stride, int64_t block_size,
             const int32_t* q_start, const int32_t* q_lens, const int32_t* seq_lens,
             int64_t batch, int64_t heads,
             int64_t kv_heads, int64_t dim, float scale, float* out, int64_t out_stride_t,
             int64_t out_stride_h) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> task_b, task_q0;  // one per (request, query tile)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t q0 = 0; q0 < q_lens[b]; q0 += kQTile) {
      task_b.push_back(b);
      task_q0.push_back(q0);
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(task_b.size()) * kv_heads;
#pragma omp parallel
  {
    const int64_t max_rows = group * kQTile;
    std::vector<float> qs(static_cast<size_t>(max_rows * dim));   // [rows, dim], scaled
    std::vector<float> acc(static_cast<size_t>(max_rows * dim));  // [rows, dim]
    std::vector<float> s(static_cast<size_t>(max_rows * kKTile)); // [rows, tile]
    std::vector<float> kt(static_cast<size_t>(dim * kKTile));     // [dim, tile]
    std::vector<float> m(static_cast<size_t>(max_rows)), l(static_cast<size_t>(max_rows));
    std::vector<int64_t> rows(static_cast<size_t>(kKTile));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t b = task_b[task / kv_heads], q0 = task_q0[task / kv_heads];
      const int64_t kvh = task % kv_heads;
      const int64_t q_len = q_lens[b], ctx = seq_lens[b] - q_len;
      const int64_t nq = std::min(kQTile, q_len - q0), nrows = nq * group;
      for (int64_t r = 0; r < nrows; ++r) {  // row r: query q0 + r / group, head r % group
        const float* src = q + (q_start[b] + q0 + r / group) * q_stride_t +
                           (kvh * group + r % group) * q_stride_h;
        float* dst = qs.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
      }
      std::fill(acc.begin(), acc.begin() + nrows * dim, 0.0f);
      std::fill(m.begin(), m.begin() + nrows, -INFINITY);
      std::fill(l.begin(), l.begin() + nrows, 0.0f);
      const int64_t kv_end = ctx + q0 + nq;  // the tile's last query sees keys < kv_end
      for (int64_t k0 = 0; k0 < kv_end; k0 += kKTile) {
        const int64_t nk = std::min(kKTile, kv_end - k0);
        for (int64_t j = 0; j < nk; ++j) {
          rows[j] = row_of<PAGED>(b, k0 + j, starts, table, table_stride, block_size);
          const float* kr = k + rows[j] * stride_row + kvh * stride_head;
          for (int64_t d = 0; d < dim; ++d) kt[d * kKTile + j] = kr[d];
        }
        for (int64_t j = nk; j < kKTile; ++j) {
          for (int64_t d = 0; d < dim; ++d) kt[d * kKTile + j] = 0.0f;
        }
        for (int64_t r = 0; r < nrows; ++r) {  // scores, masked, online softmax
          float* sr = s.data() + r * kKTile;
          const float* qr = qs.data() + r * dim;
#pragma omp simd
          for (int64_t j = 0; j < kKTile; ++j) sr[j] = 0.0f;
          for (int64_t d = 0; d < dim; ++d) {
            const float qd = qr[d];
            const float* kd = kt.data() + d * kKTile;
#pragma omp simd
            for (int64_t j = 0; j < kKTile; ++j) sr[j] += qd * kd[j];
          }
          const int64_t visible = std::min(nk, ctx + q0 + r / group + 1 - k0);  // causal
          float tile_max = -INFINITY;
          for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, sr[j]);
          const float m_new = std::max(m[r], tile_max);
          const float rescale = std::exp(m[r] - m_new);  // exp(-inf) = 0 on the first tile
          float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t j = 0; j < kKTile; ++j) {
            const float p = j < visible ? exp_nonpositive(sr[j] - m_new) : 0.0f;
            sr[j] = p;
            tile_sum += p;
          }
          l[r] = l[r] * rescale + tile_sum;
          m[r] = m_new;
          if (rescale != 1.0f) {
            float* a = acc.data() + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
          }
        }
        for (int64_t j = 0; j < nk; ++j) {  // acc += P V
          const float* vr = v + rows[j] * stride_row + kvh * stride_head;
          for (int64_t r = 0; r < nrows; ++r) {
            const float p = s[r * kKTile + j];
            if (p == 0.0f) continue;  // masked (later queries of the tile only)
            float* a = acc.data() + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t r = 0; r < nrows; ++r) {
        float* o = out + (q_start[b] + q0 + r / group) * out_stride_t +
                   (kvh * group + r % group) * out_stride_h;
        const float* a = acc.data() + r * dim;
        const float inv = 1.0f / l[r];
#pragma omp simd
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

// Prefill chunks (see prefill above); returns 0 on success, 1 on bad arguments.
int vmkv_cpu_prefill_attention(const float* q, int64_t q_stride_t, int64_t q_stride_h,
                               const float* k, const float* v, int64_t stride_row,
                               int64_t stride_head, const int64_t* starts, const int32_t* table,
                               int64_t table_stride, int64_t block_size,
                               const int32_t* q_start, const int32_t* q_lens,
                               const int32_t* seq_lens, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t dim, float scale, float* out,
                               int64_t out_stride_t, int64_t out_stride_h) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || batch < 0) return 1;
  for (int64_t b = 0; b < batch; ++b) {
    if (q_start[b] < 0 || q_lens[b] < 0 || seq_lens[b] < q_lens[b]) return 1;
  }
  if (table != nullptr) {
    if (block_size <= 0) return 1;
    prefill<true>(q, q_stride_t, q_stride_h, k, v, stride_row, stride_head, nullptr, table,
                  table_stride, block_size, q_start, q_lens, seq_lens, batch, heads, kv_heads,
                  dim, scale,
                  out, out_stride_t, out_stride_h);
  } else {
    if (starts == nullptr) return 1;
    prefill<false>(q, q_stride_t, q_stride_h, k, v, stride_row, stride_head, starts, nullptr,
                   0, 1, q_start, q_lens, seq_lens, batch, heads, kv_heads, dim, scale, out,
                   out_stride_t, out_stride_h);
  }
  return 0;
}

}  // extern "C"
