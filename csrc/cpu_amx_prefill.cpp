// bfloat16 prefill attention on the CPU's matrix units, both KV modes (the AMX prefill twins):
// flash attention whose two products per key chunk run on oneDNN's brgemm ukernel (AMX tiles).
//
// Entry b brings q_lens[b] query tokens (rows q_start[b] .. of q and out) after
// ctx = seq_lens[b] - q_lens[b] cached ones; query i (position ctx + i) sees keys 0 .. ctx + i,
// read in place through the step's addressing (csrc/cpu_rows.h: slot rows or a block table).
//
//   1. pack: each (entry, KV head, chunk of up to kChunk keys) once, K^T and V in the ukernel's
//            VNNI pairs (K^T[D/2][width][2], V[width/2][D][2], width the chunk's keys rounded up
//            to whole kKeys tiles; zero past the entry's length)
//   2. attend: each (entry, KV head, block of kQueries queries): the block's query heads of the
//            group x queries are the rows of Q [rows, D]; per key chunk
//              S = Q K^T (one brgemm call), causal mask, online softmax in float32, P in bf16,
//              O = O * rescale + P V (one brgemm call, accumulating)
//            then out = O / l, rounded to bf16.
//
// One call per product per chunk (not per 64-key tile): at D = 64 a tile's product is a few
// hundred cycles of AMX work, so per-call overhead decided the speed. The softmax reads each
// score twice (its max, then exp(scale * s - m)) and never writes the scaled scores back.
//
// P is rounded to bf16 for the second product, as torch's CPU flash attention does. The ukernel
// is torch's export of oneDNN's brgemm (at::native::cpublas::brgemm); the caller passes its
// address and brgemm_release's (vmkv/kernels/cpu_bf16.py), so this library links only libgomp.
// Returns 0, 1 on bad arguments (scale must be positive), 2 when the ukernel raised.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_brgemm.h"
#include "cpu_rows.h"
#include "cpu_vec.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

using vmkv::bf16;


namespace {

using namespace vmkv;

constexpr int64_t kKeys = 64;     // keys per tile: N of S = Q K^T, K of P V
constexpr int64_t kQueries = 32;  // query tokens per task (x the group's heads = rows)
constexpr int64_t kChunk = 512;   // keys whose scores are computed before their softmax

struct Args {
  const bf16 *q, *k, *v;
  int64_t q_stride_t, q_stride_h, stride_row, stride_head;
  const int64_t* starts;
  const int32_t *table, *q_start, *q_lens, *seq_lens;
  int64_t table_stride, block_size, batch, heads, kv_heads, dim;
  float scale;
  bf16* out;
  int64_t out_stride_t, out_stride_h;
  VmkvBrgemm brgemm;
  VmkvBrgemmRelease release;
};

// Where each entry's packed keys start, in kKeys tiles, per KV head: entry b's chunk c (keys
// c * kChunk ..) holds kv_heads consecutive blocks of chunk_width(b, c) * D elements, one per
// head, from tile tile_base[b] + c * kChunk / kKeys on.
struct Packing {
  std::vector<int64_t> tile_base;
  int64_t tiles = 0;
};

Packing plan_packing(const Args& a) {
  Packing p;
  p.tile_base.resize(static_cast<size_t>(a.batch));
  for (int64_t b = 0; b < a.batch; ++b) {
    p.tile_base[b] = p.tiles;
    p.tiles += (a.seq_lens[b] + kKeys - 1) / kKeys;
  }
  return p;
}

// Keys packed for entry b's chunk starting at key c0: its keys rounded up to whole tiles.
inline int64_t chunk_width(const Args& a, int64_t b, int64_t c0) {
  const int64_t padded = (a.seq_lens[b] + kKeys - 1) / kKeys * kKeys;
  return std::min(kChunk, padded - c0);
}

// Element offset of (entry b, chunk at key c0, KV head h)'s packed block (K^T or V alike).
inline int64_t chunk_offset(const Args& a, const Packing& pk, int64_t b, int64_t c0, int64_t h) {
  return ((pk.tile_base[b] + c0 / kKeys) * a.kv_heads * kKeys + h * chunk_width(a, b, c0)) *
         a.dim;
}

// Tile t (keys t * kKeys ..) of entry b, KV head h, into its chunk's packed K^T and V;
// zero past the entry's length.
template <bool PAGED>
void pack_tile(const Args& a, const Packing& pk, int64_t b, int64_t h, int64_t t,
               uint32_t* kt_all, bf16* vp_all) {
  const int64_t pairs = a.dim / 2, len = a.seq_lens[b];
  const int64_t c0 = t * kKeys / kChunk * kChunk, j0 = t * kKeys - c0;
  const int64_t width = chunk_width(a, b, c0), base = chunk_offset(a, pk, b, c0, h);
  uint32_t* kt = kt_all + base / 2;  // [D/2][width] pairs
  bf16* vp = vp_all + base;          // [width/2][D][2]
  for (int64_t j = j0; j < j0 + kKeys; ++j) {
    const int64_t tok = c0 + j;
    if (tok >= len) {
      for (int64_t p = 0; p < pairs; ++p) kt[p * width + j] = 0;
      continue;
    }
    const int64_t row = row_of<PAGED>(b, tok, a.starts, a.table, a.table_stride, a.block_size);
    const auto* kr = reinterpret_cast<const uint32_t*>(a.k + row * a.stride_row +
                                                       h * a.stride_head);
    for (int64_t p = 0; p < pairs; ++p) kt[p * width + j] = kr[p];  // K^T: pair p, key j
  }
  for (int64_t i = j0 / 2; i < (j0 + kKeys) / 2; ++i) {  // V: keys 2i, 2i+1 interleaved
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t tok = c0 + 2 * i + e;
      bf16* dst = vp + i * a.dim * 2 + e;
      if (tok >= len) {
        for (int64_t d = 0; d < a.dim; ++d) dst[2 * d] = 0;
        continue;
      }
      const int64_t row = row_of<PAGED>(b, tok, a.starts, a.table, a.table_stride,
                                        a.block_size);
      const bf16* vr = a.v + row * a.stride_row + h * a.stride_head;
      for (int64_t d = 0; d < a.dim; ++d) dst[2 * d] = vr[d];
    }
  }
}

// One online-softmax step of a row over a chunk's raw scores s[0 .. width) (width whole
// tiles), of which the first `visible` (>= 1) count: p (bf16) becomes exp(scale * s - m)
// (0 past visible); m, l move on; returns the factor the row's accumulator must be scaled by.
inline float softmax_row(const float* s, int64_t width, int64_t visible, float scale, float& m,
                         float& l, bf16* p) {
  float raw_max = -INFINITY, sum = 0.0f;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
  if (j < visible) {
    vm = _mm512_mask_max_ps(vm, static_cast<__mmask16>((1u << (visible - j)) - 1u), vm,
                            _mm512_loadu_ps(s + j));
  }
  raw_max = _mm512_reduce_max_ps(vm);
#else
  for (int64_t j = 0; j < visible; ++j) raw_max = std::max(raw_max, s[j]);
#endif
  const float m_new = std::max(m, raw_max * scale);  // scale > 0
  const float rescale = max_rescale(m, m_new);
#if defined(__AVX512F__)
  const __m512 mul = _mm512_set1_ps(scale), sub = _mm512_set1_ps(m_new);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t live = std::clamp<int64_t>(visible - j, 0, 16);
    const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(
        keep, exp_nonpositive_v(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), mul), sub)));
    vstore(p + j, e);
    sums = _mm512_add_ps(sums, e);
  }
  sum = _mm512_reduce_add_ps(sums);
#else
  for (int64_t j = 0; j < width; ++j) {
    const float e = j < visible ? exp_nonpositive(s[j] * scale - m_new) : 0.0f;
    p[j] = float_to_bf16(e);
    sum += e;
  }
#endif
  l = l * rescale + sum;
  m = m_new;
  return rescale;
}

template <typename T>
void grow(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
}

// Per-thread buffers of the attend step, kept between calls.
struct Scratch {
  std::vector<bf16> q;   // [rows, D] the block's queries
  std::vector<float> s;  // [rows, kChunk] scores of a key chunk
  std::vector<bf16> p;   // [rows, kChunk] their probabilities
  std::vector<float> o;  // [rows, D] the accumulator
  std::vector<float> m, l;
  void fit(int64_t rows, int64_t dim) {
    grow(q, rows * dim);
    grow(s, rows * kChunk);
    grow(p, rows * kChunk);
    grow(o, rows * dim);
    grow(m, rows);
    grow(l, rows);
  }
};

// Rows of the task (entry b, KV head h, queries q0 .. q0 + nq): row r is query q0 + r / group
// of head h * group + r % group. Keys go in chunks of up to kChunk: S = Q K^T over the chunk in
// one ukernel call, then the rows' softmax, then O += P V in one call.
void attend_block(const Args& a, const Packing& pk, const uint32_t* kt, const bf16* vp,
                  int64_t b, int64_t h, int64_t q0, Scratch& w) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t q_len = a.q_lens[b], ctx = a.seq_lens[b] - q_len;
  const int64_t nq = std::min(kQueries, q_len - q0), rows = nq * group;
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* src = a.q + (a.q_start[b] + q0 + r / group) * a.q_stride_t +
                      (h * group + r % group) * a.q_stride_h;
    std::copy(src, src + dim, w.q.begin() + r * dim);
    w.m[r] = -INFINITY;
    w.l[r] = 0.0f;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.0f);
  const int64_t kv_end = ctx + q0 + nq;  // the block's last query sees keys < kv_end
  const bf16* k_packed = reinterpret_cast<const bf16*>(kt);
  for (int64_t c0 = 0; c0 < kv_end; c0 += kChunk) {
    const int64_t width = (std::min(kv_end - c0, kChunk) + kKeys - 1) / kKeys * kKeys;
    const int64_t packed = chunk_width(a, b, c0), base = chunk_offset(a, pk, b, c0, h);
    a.brgemm(rows, width, dim, dim, packed, kChunk, false, w.q.data(), k_packed + base,
             w.s.data(), true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(width, ctx + q0 + r / group + 1 - c0);  // >= 1
      const float rescale = softmax_row(w.s.data() + r * kChunk, width, visible, a.scale,
                                        w.m[r], w.l[r], w.p.data() + r * kChunk);
      if (rescale != 1.0f) {
        float* orow = w.o.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) orow[d] *= rescale;
      }
    }
    a.brgemm(rows, dim, width, kChunk, dim, dim, true, w.p.data(), vp + base, w.o.data(), true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = a.out + (a.q_start[b] + q0 + r / group) * a.out_stride_t +
                (h * group + r % group) * a.out_stride_h;
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = float_to_bf16(w.o[r * dim + d] * inv);
  }
}

template <bool PAGED>
int run(const Args& a) {
  const Packing pk = plan_packing(a);
  const int64_t tile_elems = kKeys * a.dim, kv = a.kv_heads;
  // packed K^T and V, kept between calls (growing only): fresh pages would be zeroed by the OS
  static thread_local std::vector<uint32_t> kt;
  static thread_local std::vector<bf16> vp;
  grow(kt, pk.tiles * kv * tile_elems / 2);
  grow(vp, pk.tiles * kv * tile_elems);
  uint32_t* const kt_data = kt.data();  // (the names are this thread's; the team uses these)
  bf16* const vp_data = vp.data();
  std::vector<int64_t> task_b, task_q0;  // attention tasks: (entry, query block)
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t q0 = 0; q0 < a.q_lens[b]; q0 += kQueries) {
      task_b.push_back(b);
      task_q0.push_back(q0);
    }
  }
  std::atomic<bool> failed{false};
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pk.tiles * kv; ++i) {  // (tile of some entry, KV head)
      const int64_t tile = i / kv, h = i % kv;
      const int64_t b = std::upper_bound(pk.tile_base.begin(), pk.tile_base.end(), tile) -
                        pk.tile_base.begin() - 1;
      pack_tile<PAGED>(a, pk, b, h, tile - pk.tile_base[b], kt_data, vp_data);
    }
    static thread_local Scratch scratch;
    scratch.fit(kQueries * (a.heads / kv), a.dim);
    const int64_t tasks = static_cast<int64_t>(task_b.size()) * kv;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) {
      try {
        attend_block(a, pk, kt_data, vp_data, task_b[i / kv], i % kv, task_q0[i / kv],
                     scratch);
      } catch (...) {
        failed = true;
      }
    }
    try {
      a.release(true);
    } catch (...) {
      failed = true;
    }
  }
  return failed ? 2 : 0;
}

}  // namespace

extern "C" {

// Causal bf16 attention of prefill chunks, as vmkv_cpu_prefill_attention (csrc/cpu_attention.cpp)
// with the brgemm ukernel's entry points; head_dim must be a multiple of 32.
int vmkv_amx_prefill_attention(const bf16* q, int64_t q_stride_t, int64_t q_stride_h,
                               const bf16* k, const bf16* v, int64_t stride_row,
                               int64_t stride_head, const int64_t* starts, const int32_t* table,
                               int64_t table_stride, int64_t block_size,
                               const int32_t* q_start, const int32_t* q_lens,
                               const int32_t* seq_lens, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t dim, float scale, bf16* out,
                               int64_t out_stride_t, int64_t out_stride_h, VmkvBrgemm brgemm,
                               VmkvBrgemmRelease release) {
  if (!(scale > 0.0f) || kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || dim % 32 != 0 || batch < 0 ||
      brgemm == nullptr || release == nullptr || (table == nullptr) == (starts == nullptr) ||
      (table != nullptr && block_size <= 0)) {
    return 1;
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (q_start[b] < 0 || q_lens[b] < 0 || seq_lens[b] < q_lens[b]) return 1;
  }
  const Args a{q, k, v, q_stride_t, q_stride_h, stride_row, stride_head, starts, table,
               q_start, q_lens, seq_lens, table_stride, block_size, batch, heads, kv_heads,
               dim, scale, out, out_stride_t, out_stride_h, brgemm, release};
  return table != nullptr ? run<true>(a) : run<false>(a);
}

}  // extern "C"
