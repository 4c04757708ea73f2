// An int8 KV cache on the CPU (--kv-cache-dtype int8): the fused quantising write, the decode
// kernel that reads int8 rows in place, and the dequantising gather the prefill kernels read.
//
// Each head's row of a token (K or V) is its int8 values and then a float16 scale:
//
//   | dim int8 values | scale (float16, 2 bytes) |     value = int8 * scale, scale = max|x| / 127
//
// at  base + row * stride_row + kv_head * stride_head  (bytes), row as in cpu_rows.h (slot rows in
// virtual mode, block-table rows in paged mode: the twins, one loop body for both, so they give
// bit-identical outputs on the same data). Quantisation is symmetric, per token and KV head,
// rounded to nearest with the float16-rounded scale (docs/memory.md, "An int8 KV cache").
//
// Rotation: where head_dim is a power of two every row is stored in a rotated basis, x H with H
// the normalised Sylvester-Hadamard matrix (a fast Walsh-Hadamard transform, in place, here):
// it keeps every dot product ((qH).(kH) = q.k) and spreads a few large channels (K's, after RoPE)
// over the whole head, so one scale per token and head loses far less of the small ones. The
// kernels take and give everything in the model's basis: the store rotates before quantising,
// decode rotates the query and rotates its output back (H H = I), the dequantising gather
// rotates each row back, so no caller multiplies by H.
//
// Decode, where the cache is most of the bytes a step reads: with AVX-512 VNNI the query is
// quantised to int16 per head (relative error 2^-16, where the int8 K's is 2^-8) and the scores are
// integer dot products of K's int8 widened to int16 (vpdpwssd: two per 64-element head, no float
// conversion of K), 16 tokens' sums reduced into one vector at once; V is widened to float in
// registers and accumulated in float32 (online softmax, float32). With AVX2 and no AVX-512 the
// same integer products run as vpmaddwd + vpaddd on 8-lane vectors (attend_avx2), where they and
// not the bytes bound the task: each 64-token block's K and V rows are widened to int16 once for
// all the GQA group's query heads (benchmarks/int8_decode_ab.py: 1.2x widening per head).
// Compiled per GQA group and head_dim (64 or 128) so that the scores and the value accumulators
// stay in registers; other shapes and other CPUs use a portable loop (float32 arithmetic on the
// dequantised values).
//
// Built by vmkv/kernels/cpu_attention_int8.py (g++ -O3 -march=native -fopenmp), called through
// ctypes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_rows.h"
#include "cpu_vec.h"

#if defined(__F16C__)
#include <immintrin.h>  // (cpu_vec.h includes it only for AVX2 + FMA or AVX-512)
#endif

namespace {

using namespace vmkv;

constexpr int64_t kScaleBytes = 2;   // the float16 scale after each head's values
constexpr int64_t kMaxTaskRows = 48;  // query heads of one decode task (its KV heads x group)

// float16 <-> float32, round to nearest even (F16C where the CPU has it).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FFu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline uint16_t float_to_half(float f) {  // f finite, >= 0, below 65520 (a scale)
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  if (f < 6.103515625e-05f) {  // subnormal range: units of 2^-24
    return static_cast<uint16_t>(std::nearbyint(f * 16777216.0f));
  }
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t exp = ((bits >> 23) & 0xFFu) - 112, man = bits & 0x7FFFFFu;
  uint32_t h = exp << 10 | man >> 13;
  const uint32_t rest = man & 0x1FFFu;  // round to nearest even (a carry moves the exponent)
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
#endif
}

inline float row_scale(const int8_t* row, int64_t dim) {
  uint16_t h;
  std::memcpy(&h, row + dim, sizeof(h));
  return half_to_float(h);
}

constexpr int64_t kMaxDim = 512;  // the largest head_dim the kernels take

// Whether rows of this head_dim are stored rotated (a power of two: the Hadamard transform).
inline bool rotated(int64_t dim) { return dim >= 2 && (dim & (dim - 1)) == 0; }

// x[0 .. dim) <- x H / sqrt(dim) in place (dim a power of two): butterflies of stride 1, 2, 4,
// ... (a + b, a - b), then the scale. The AVX-512 and AVX2 paths do the same float operations in
// the same order (strides below 16 or 8 by lane swaps), so all give the same bits.
inline void hadamard(float* x, int64_t dim) {
  int64_t h = 1;
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t i = 0; i < dim; i += 16) {
      __m512 v = _mm512_loadu_ps(x + i);
      // lanes whose stride-h bit is set hold b (the partner a is lane ^ h): a - b = p - v
      __m512 p = _mm512_permute_ps(v, 0xB1);
      v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xAAAA, p, v);
      p = _mm512_permute_ps(v, 0x4E);
      v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xCCCC, p, v);
      p = _mm512_shuffle_f32x4(v, v, 0xB1);
      v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xF0F0, p, v);
      p = _mm512_shuffle_f32x4(v, v, 0x4E);
      v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xFF00, p, v);
      _mm512_storeu_ps(x + i, v);
    }
    h = 16;
  }
#elif defined(VMKV_VECTOR)
  if (dim % 8 == 0) {
    for (int64_t i = 0; i < dim; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      // lanes whose stride-h bit is set hold b (the partner a is lane ^ h): a - b = p - v
      __m256 p = _mm256_permute_ps(v, 0xB1);
      v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
      p = _mm256_permute_ps(v, 0x4E);
      v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
      p = _mm256_permute2f128_ps(v, v, 0x01);
      v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
      _mm256_storeu_ps(x + i, v);
    }
    h = 8;
  }
#endif
  for (; h < dim; h *= 2) {
    for (int64_t i = 0; i < dim; i += 2 * h) {
#pragma omp simd
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim));
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) x[d] *= norm;
}

// x[0 .. dim) as float, rotated where rows of this dim are (what the cache's basis holds).
template <typename T>
inline void to_cache_basis(const T* x, int64_t dim, float* dst) {
#if defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {
    for (int64_t d = 0; d < dim; d += kLanes) vstore(dst + d, vload(x + d));
  } else {
    for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(x[d]);
  }
#else
  for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(x[d]);
#endif
  if (rotated(dim)) hadamard(dst, dim);
}

#if defined(VMKV_VECTOR)
// |x| on every lane.
inline vfloat vabs(vfloat x) {
#if defined(__AVX512F__)
  return _mm512_abs_ps(x);
#else
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
#endif
}

// x rounded to the nearest integer, ties to even (std::nearbyint's default).
inline vfloat vround_even(vfloat x) {
#if defined(__AVX512F__)
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

// kLanes integral values of x (in [-127, 127]) stored as int8 at p.
inline void vstore_int8(int8_t* p, vfloat x) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
#else
  const __m256i w = _mm256_cvtps_epi32(x);
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
#endif
}

// kLanes int8 values at p, as floats.
inline vfloat vload_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p))));
#endif
}
#endif

// x[0 .. dim) rotated (where rows are) and quantised into dst: dim int8 values, then the
// float16 scale max|x| / 127 (rounded to nearest even, then clamped: the vector and scalar
// loops give the same bytes).
template <typename T>
inline void quantize_row(const T* x, int64_t dim, int8_t* dst) {
  alignas(64) float xr[kMaxDim];
  to_cache_basis(x, dim, xr);
#if defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {
    vfloat m = vzero();
    for (int64_t d = 0; d < dim; d += kLanes) m = vmax(m, vabs(vload(xr + d)));
    const uint16_t h = float_to_half(std::min(vmax_lane(m) / 127.0f, 65504.0f));
    const float s = half_to_float(h);
    const vfloat inv = vset1(s > 0.0f ? 1.0f / s : 0.0f);
    const vfloat lo = vset1(-127.0f), hi = vset1(127.0f);
    for (int64_t d = 0; d < dim; d += kLanes) {
      vstore_int8(dst + d, vmin(vmax(vround_even(vmul(vload(xr + d), inv)), lo), hi));
    }
    std::memcpy(dst + dim, &h, sizeof(h));
    return;
  }
#endif
  float amax = 0.0f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(xr[d]));
  const uint16_t h = float_to_half(std::min(amax / 127.0f, 65504.0f));
  const float s = half_to_float(h);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t d = 0; d < dim; ++d) {
    const float r = std::nearbyint(xr[d] * inv);
    dst[d] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
  }
  std::memcpy(dst + dim, &h, sizeof(h));
}

// acc[0 .. dim) * inv, rotated back to the model's basis (where rows are rotated), into o.
template <typename T>
inline void store_output(float* acc, int64_t dim, float inv, T* o) {
  for (int64_t d = 0; d < dim; ++d) acc[d] *= inv;
  if (rotated(dim)) hadamard(acc, dim);
#if defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {
    for (int64_t d = 0; d < dim; d += kLanes) vstore(o + d, vload(acc + d));
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(acc[d]);
}

// A cache row's dim values (int8 * its scale) in the model's basis (rotated back), as T.
template <typename T>
inline void dequantize_row(const int8_t* row, int64_t dim, T* dst) {
  alignas(64) float x[kMaxDim];
  const float s = row_scale(row, dim);
#if defined(VMKV_VECTOR)
  if (dim % kLanes == 0) {
    const vfloat sv = vset1(s);
    for (int64_t d = 0; d < dim; d += kLanes) vstore(x + d, vmul(vload_int8(row + d), sv));
    if (rotated(dim)) hadamard(x, dim);
    for (int64_t d = 0; d < dim; d += kLanes) vstore(dst + d, vload(x + d));
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(row[d]) * s;
  if (rotated(dim)) hadamard(x, dim);
  for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(x[d]);
}

// What one decode task reads and writes (request b, KV heads [kvh0, kvh1)).
template <typename T>
struct DecodeArgs {
  const T* q;
  int64_t q_stride_b, q_stride_h;
  const int8_t* k;
  const int8_t* v;
  int64_t stride_row, stride_head;
  const int64_t* starts;
  const int32_t* table;
  int64_t table_stride, block_size;
  int64_t group, dim;
  float scale;
  T* out;
  int64_t out_stride_b, out_stride_h;
};

// A decode task: request b's KV heads [kvh0, kvh1), its tokens [lo, len).
struct TaskBounds {
  int64_t b, lo, len, kvh0, kvh1;
};

// A decode step's tasks, handed to the threads one at a time (dynamic scheduling), in order.
class TaskQueue {
 public:
  // task i: request i / splits, KV heads span * (i % splits) onwards; window > 0: its last
  // `window` tokens only
  TaskQueue(const int32_t* seq_lens, int64_t batch, int64_t splits, int64_t span,
            int64_t window)
      : seq_lens_(seq_lens), splits_(splits), span_(span), window_(window),
        total_(batch * splits) {}

  int64_t total() const { return total_; }
  int64_t claim() { return next_.fetch_add(1, std::memory_order_relaxed); }

  TaskBounds bounds(int64_t task) const {
    const int64_t b = task / splits_, kvh0 = task % splits_ * span_, len = seq_lens_[b];
    return {b, window_ > 0 ? std::max<int64_t>(0, len - window_) : 0, len, kvh0, kvh0 + span_};
  }

 private:
  const int32_t* seq_lens_;
  int64_t splits_, span_, window_, total_;
  std::atomic<int64_t> next_{0};
};

// One thread's tasks from the queue, with one task of lookahead for the kernels that use it: a
// task about to start its last block claims the thread's next task (claim_next), so that block
// fetches the next task's first rows as it fetches its own next block's. Without it every
// task's first block waited on memory (at 256 tokens, one block in four). Claimed only then,
// not a whole task ahead, so the threads still finish within a block of each other.
class ThreadTasks {
 public:
  explicit ThreadTasks(TaskQueue& queue) : queue_(queue) {}

  // The thread's next task (the one claimed ahead, if any), or -1: none left.
  int64_t take() {
    const int64_t task = claimed_ >= 0 ? claimed_ : queue_.claim();
    first_fetched_ = claimed_ >= 0;
    claimed_ = -1;
    return task < queue_.total() ? task : -1;
  }

  // Whether the task just taken had its first block fetched by the task before it.
  bool first_block_fetched() const { return first_fetched_; }

  // Claims the thread's next task now (once per task): its bounds, or nullptr if none is left.
  const TaskBounds* claim_next() {
    if (claimed_ < 0) claimed_ = queue_.claim();
    if (claimed_ >= queue_.total()) return nullptr;
    next_ = queue_.bounds(claimed_);
    return &next_;
  }

 private:
  TaskQueue& queue_;
  int64_t claimed_ = -1;
  bool first_fetched_ = false;
  TaskBounds next_{};
};

// Portable: the task's query heads one at a time, float32 arithmetic on dequantised values.
template <typename T, bool PAGED>
void attend_portable(const DecodeArgs<T>& a, int64_t b, int64_t lo, int64_t len, int64_t kvh0,
                     int64_t kvh1) {
  const int64_t dim = a.dim;
  std::vector<float> qf(static_cast<size_t>(dim)), acc(static_cast<size_t>(dim));
  for (int64_t h = kvh0; h < kvh1; ++h) {
    for (int64_t g = 0; g < a.group; ++g) {
      const int64_t head = h * a.group + g;
      to_cache_basis(a.q + b * a.q_stride_b + head * a.q_stride_h, dim, qf.data());
      std::fill(acc.begin(), acc.end(), 0.0f);
      float m = -INFINITY, l = 0.0f;
      for (int64_t t = lo; t < len; ++t) {
        const int64_t row = row_of<PAGED>(b, t, a.starts, a.table, a.table_stride, a.block_size);
        const int8_t* kr = a.k + row * a.stride_row + h * a.stride_head;
        const int8_t* vr = a.v + row * a.stride_row + h * a.stride_head;
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; ++d) dot += qf[d] * static_cast<float>(kr[d]);
        const float s = dot * row_scale(kr, dim) * a.scale;
        const float m_new = std::max(m, s);
        const float rescale = max_rescale(m, m_new), p = exp_nonpositive(s - m_new);
        const float w = p * row_scale(vr, dim);
        for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * rescale + w * static_cast<float>(vr[d]);
        l = l * rescale + p;
        m = m_new;
      }
      store_output(acc.data(), dim, len > lo ? 1.0f / l : 0.0f,
                   a.out + b * a.out_stride_b + head * a.out_stride_h);
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VMKV_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VMKV_INT8_AVX2 1
#endif

#if defined(VMKV_INT8_VNNI) || defined(VMKV_INT8_AVX2)
constexpr int64_t kBlock = 64;  // tokens per online-softmax step (four or eight score vectors)
constexpr int kMaxGroup = 8;

// The cache lines of [p, p + bytes) fetched into L2 (a line per 64 bytes; the next block's
// rows, a few per token pair of the value loop: all at once they stalled the loop, ~14 % slower).
// Addresses at most 64 bytes apart, the last byte included, so every line is touched.
template <int64_t BYTES>
inline void prefetch_lines(const int8_t* p) {
  for (int64_t o = 0; o + 64 < BYTES; o += 64) __builtin_prefetch(p + o, 0, 1);
  __builtin_prefetch(p + BYTES - 1, 0, 1);
}

// The first block's K and V rows of a task (request b, KV heads [kvh0, kvh1)), fetched while
// its query is prepared (later blocks' are fetched during the block before).
template <int64_t DIM, bool PAGED, typename T>
inline void prefetch_first_block(const DecodeArgs<T>& a, int64_t b, int64_t lo, int64_t len,
                                 int64_t kvh0, int64_t kvh1) {
  const int64_t first = std::min(kBlock, len - lo);
  for (int64_t j = 0; j < first; ++j) {
    const int64_t row = row_of<PAGED>(b, lo + j, a.starts, a.table, a.table_stride,
                                      a.block_size);
    for (int64_t h = kvh0; h < kvh1; ++h) {
      prefetch_lines<DIM + kScaleBytes>(a.k + row * a.stride_row + h * a.stride_head);
      prefetch_lines<DIM + kScaleBytes>(a.v + row * a.stride_row + h * a.stride_head);
    }
  }
}
#endif

#if defined(VMKV_INT8_VNNI)

// Sixteen int32 vectors -> one whose lane j is the sum of v[j]'s lanes (vsum16's shuffles).
inline __m512i vsum16_i32(const __m512i* v) {
  __m512i a[8], b[4], d[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x = _mm512_castsi512_ps(a[2 * i]), y = _mm512_castsi512_ps(a[2 * i + 1]);
    b[i] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(x, y, 0x44)),
                            _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0xEE)));
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d[0], d[1], 0x88),
                          _mm512_shuffle_i32x4(d[0], d[1], 0xDD));
}

// Int32 value accumulators of a dim chunk (two per query head and 32 dims) that fit in ~24
// registers.
template <int GROUP, int CH>
constexpr int chunk_of() {
  int cv = CH;
  while (cv > 1 && 2 * GROUP * cv > 24) cv /= 2;
  return cv;
}

// A task (request b, KV heads [kvh0, kvh1)) with GROUP query heads per KV head and head_dim
// 32 * CH, all products integer (vpdpwssd) and exact:
//   scores  the query as int16 (one scale per head) . K's int8 widened to int16, 16 tokens'
//           int32 sums reduced into one vector, then scaled by the query's and each K row's
//           scale;
//   values  w = P * V's row scale as int16 (one scale per head and 64-token block: relative
//           error 2^-16 of the block's largest), token pairs interleaved as in bf16 decode
//           (unpacklo/hi of two rows: int32 lane 4L + k of chunk c is dim 32c + 8L + k, or + 4
//           for the high half), summed per block in int32 (at most 64 * 127 * 32767 < 2^31),
//           then added to float32 accumulators (online softmax, float32).
template <typename T, int GROUP, int CH, bool PAGED>
void attend_vnni(const DecodeArgs<T>& a, int64_t b, int64_t lo, int64_t len, int64_t kvh0,
                 int64_t kvh1) {
  constexpr int64_t dim = 32 * CH;
  constexpr int CV = chunk_of<GROUP, CH>();
  const int64_t span = kvh1 - kvh0;
  alignas(64) float acc[kMaxTaskRows][dim];  // permuted lanes (above), undone at the store
  float m[kMaxTaskRows], l[kMaxTaskRows], qscale[kMaxTaskRows];
  alignas(64) int16_t q16[kMaxTaskRows][dim];
  alignas(64) float ks[kBlock], vs[kBlock];
  alignas(64) int16_t wq[GROUP][kBlock + 32];  // w of the head's block as int16, + zeros
                                               // (rows of 192 bytes: stores aligned)
  int64_t rows[kBlock], next_rows[kBlock];
  const auto row_at = [&](int64_t t) {
    return row_of<PAGED>(b, t, a.starts, a.table, a.table_stride, a.block_size);
  };
  prefetch_first_block<dim, PAGED>(a, b, lo, len, kvh0, kvh1);
  for (int64_t r = 0; r < span * GROUP; ++r) {  // the query rotated, as int16, a scale per head
    alignas(64) float qr[dim];
    to_cache_basis(a.q + b * a.q_stride_b + (kvh0 * GROUP + r) * a.q_stride_h, dim, qr);
    __m512 top = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_load_ps(qr + d)));
    }
    const float amax = _mm512_reduce_max_ps(top);
    const float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
    qscale[r] = s * a.scale;
    const __m512 inv = _mm512_set1_ps(1.0f / s);  // |q / s| <= 32767, a rounding saturated
    for (int64_t d = 0; d < dim; d += 16) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16[r] + d),
                         _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                             _mm512_mul_ps(_mm512_load_ps(qr + d), inv))));
    }
    std::fill(acc[r], acc[r] + dim, 0.0f);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int g = 0; g < GROUP; ++g) wq[g][kBlock] = wq[g][kBlock + 1] = 0;
  for (int64_t t0 = lo; t0 < len; t0 += kBlock) {
    const int64_t n = std::min(kBlock, len - t0), vecs_n = (n + 15) / 16;
    for (int64_t j = 0; j < n; ++j) rows[j] = row_at(t0 + j);
    for (int64_t j = n; j < vecs_n * 16; ++j) rows[j] = rows[0];  // masked off below
    const int64_t ahead = std::max<int64_t>(0, std::min(kBlock, len - t0 - kBlock));
    for (int64_t j = 0; j < ahead; ++j) next_rows[j] = row_at(t0 + kBlock + j);
    for (int64_t h = 0; h < span; ++h) {
      const int64_t off = (kvh0 + h) * a.stride_head;
      for (int64_t j = 0; j < vecs_n * 16; ++j) {
        ks[j] = row_scale(a.k + rows[j] * a.stride_row + off, dim);
        vs[j] = row_scale(a.v + rows[j] * a.stride_row + off, dim);
      }
      float rescale[GROUP], wscale[GROUP];
      for (int g = 0; g < GROUP; ++g) {
        const int64_t r = h * GROUP + g;
        __m512i qv[CH];
        for (int c = 0; c < CH; ++c) qv[c] = _mm512_load_si512(q16[r] + 32 * c);
        __m512 scores[kBlock / 16];
        __m512 block_max = _mm512_set1_ps(-INFINITY);
        for (int64_t u = 0; u < vecs_n; ++u) {
          __m512i part[16];
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            const int8_t* kr = a.k + rows[u * 16 + j] * a.stride_row + off;
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < CH; ++c) {
              const __m512i kw = _mm512_cvtepi8_epi16(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + 32 * c)));
              s = _mm512_dpwssd_epi32(s, kw, qv[c]);
            }
            part[j] = s;
          }
          scores[u] = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_cvtepi32_ps(vsum16_i32(part)), _mm512_load_ps(ks + 16 * u)),
              _mm512_set1_ps(qscale[r]));
          const int64_t nu = std::min<int64_t>(16, n - u * 16);
          const __mmask16 live = static_cast<__mmask16>((1u << nu) - 1u);
          block_max = _mm512_mask_max_ps(block_max, live, block_max, scores[u]);
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(block_max));
        rescale[g] = max_rescale(m[r], m_new);
        __m512 sums = _mm512_setzero_ps();
        __m512 w[kBlock / 16];
        __m512 w_max = _mm512_setzero_ps();
        for (int64_t u = 0; u < vecs_n; ++u) {
          const int64_t nu = std::min<int64_t>(16, n - u * 16);
          const __m512 p = _mm512_maskz_mov_ps(
              static_cast<__mmask16>((1u << nu) - 1u),
              exp_nonpositive_v(_mm512_sub_ps(scores[u], _mm512_set1_ps(m_new))));
          sums = _mm512_add_ps(sums, p);
          w[u] = _mm512_mul_ps(p, _mm512_load_ps(vs + 16 * u));
          w_max = _mm512_max_ps(w_max, w[u]);
        }
        const float wm = _mm512_reduce_max_ps(w_max);
        wscale[g] = wm / 32767.0f;
        const __m512 to_int = _mm512_set1_ps(wm > 0.0f ? 32767.0f / wm : 0.0f);
        for (int64_t u = 0; u < vecs_n; ++u) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(wq[g] + 16 * u),
                             _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(
                                 _mm512_mul_ps(w[u], to_int))));
        }
        for (int64_t j = vecs_n * 16; j < kBlock; ++j) wq[g][j] = 0;
        l[r] = l[r] * rescale[g] + _mm512_reduce_add_ps(sums);
        m[r] = m_new;
      }
      for (int cc = 0; cc < CH; cc += CV) {  // values: CV chunks of 32 dims of every head
        __m512i iacc[GROUP][2 * CV];
        for (int g = 0; g < GROUP; ++g) {
          for (int e = 0; e < 2 * CV; ++e) iacc[g][e] = _mm512_setzero_si512();
        }
        for (int64_t j = 0; j < n; j += 2) {
          if (cc == 0) {  // head h's lines of the next block's rows j, j + 1 (into L2)
            for (int64_t i = j; i < std::min(j + 2, ahead); ++i) {
              const int64_t at = next_rows[i] * a.stride_row + off;
              prefetch_lines<dim + kScaleBytes>(a.k + at);
              prefetch_lines<dim + kScaleBytes>(a.v + at);
            }
          }
          const int8_t* v0 = a.v + rows[j] * a.stride_row + off + 32 * cc;
          const int8_t* v1 = j + 1 < n ? a.v + rows[j + 1] * a.stride_row + off + 32 * cc
                                       : nullptr;
          __m512i lo_w[CV], hi_w[CV];
          for (int c = 0; c < CV; ++c) {
            const __m512i x = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32 * c)));
            const __m512i z = v1 != nullptr
                ? _mm512_cvtepi8_epi16(
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32 * c)))
                : _mm512_setzero_si512();
            lo_w[c] = _mm512_unpacklo_epi16(x, z);
            hi_w[c] = _mm512_unpackhi_epi16(x, z);
          }
          for (int g = 0; g < GROUP; ++g) {
            int32_t pair;  // w of tokens j, j + 1 (0 past n)
            std::memcpy(&pair, &wq[g][j], sizeof(pair));
            const __m512i pp = _mm512_set1_epi32(pair);
            for (int c = 0; c < CV; ++c) {
              iacc[g][2 * c] = _mm512_dpwssd_epi32(iacc[g][2 * c], lo_w[c], pp);
              iacc[g][2 * c + 1] = _mm512_dpwssd_epi32(iacc[g][2 * c + 1], hi_w[c], pp);
            }
          }
        }
        for (int g = 0; g < GROUP; ++g) {
          float* ar = acc[h * GROUP + g] + 32 * cc;
          const __m512 f = _mm512_set1_ps(rescale[g]), ws = _mm512_set1_ps(wscale[g]);
          for (int e = 0; e < 2 * CV; ++e) {
            _mm512_store_ps(ar + 16 * e,
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][e]), ws,
                                            _mm512_mul_ps(_mm512_load_ps(ar + 16 * e), f)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < span * GROUP; ++r) {
    alignas(64) float res[dim];
    // lane 4L + k of chunk 2c is dim 32c + 8L + k, of 2c + 1 dim 32c + 8L + 4 + k: the two
    // chunks' 128-bit lanes interleaved (lo 0, hi 0, lo 1, hi 1 | lo 2, hi 2, lo 3, hi 3)
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                            23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                             29, 30, 31);
    for (int64_t c = 0; c < CH; ++c) {
      const __m512 lo_acc = _mm512_load_ps(acc[r] + 32 * c);
      const __m512 hi_acc = _mm512_load_ps(acc[r] + 32 * c + 16);
      _mm512_store_ps(res + 32 * c, _mm512_permutex2var_ps(lo_acc, first, hi_acc));
      _mm512_store_ps(res + 32 * c + 16, _mm512_permutex2var_ps(lo_acc, second, hi_acc));
    }
    store_output(res, dim, len > lo ? 1.0f / l[r] : 0.0f,
                 a.out + b * a.out_stride_b + (kvh0 * GROUP + r) * a.out_stride_h);
  }
}

template <typename T, int GROUP, int DIM, bool PAGED>
void attend_fast(const DecodeArgs<T>& a, const TaskBounds& task, ThreadTasks& tasks) {
  (void)tasks;  // (no lookahead: each task fetches its own first block)
  attend_vnni<T, GROUP, DIM / 32, PAGED>(a, task.b, task.lo, task.len, task.kvh0, task.kvh1);
}
#endif

#if defined(VMKV_INT8_AVX2)
// Eight int32 vectors -> one whose lane j is the sum of v[j]'s lanes.
inline __m256i vsum8_i32(const __m256i* v) {
  // per 128-bit half: [v0 0+1, v0 2+3, v1 0+1, v1 2+3], then each vector's four-lane sums
  const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),  // the low halves' sums
                          _mm256_permute2x128_si256(b0, b1, 0x31));  // + the high halves'
}

// Lanes [0, live) all ones, the rest zero (a mask for blendv / and).
inline __m256 first_lanes(int64_t live) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// attend_vnni's task with AVX2 (no VNNI): the same exact integer products, vpmaddwd and vpaddd
// for each vpdpwssd, on 8-lane vectors; head_dim 16 * CH. Without VNNI the products, not the
// bytes, bound the task, so each block's rows are widened once for all GROUP query heads:
//   keys    a row's int8 widened to int16 once (CH registers), its products with every group
//           head's int16 query (one scale per head) summed per head, 8 tokens' sums reduced into
//           one vector, then scaled by the query's and each K row's scale;
//   values  the block's rows widened once into token pairs interleaved by unpacklo/hi (whose
//           int32 lane 4L + k of chunk c is dim 16c + 8L + k (lo) or 16c + 8L + 4 + k (hi)),
//           then per head w as int16 (one scale per head and block) . those pairs summed in
//           int32, added to float32 accumulators (online softmax, float32).
// Integer sums are exact in any order, so this gives attend_vnni's bits.
template <typename T, int GROUP, int CH, bool PAGED>
void attend_avx2(const DecodeArgs<T>& a, const TaskBounds& task, ThreadTasks& tasks) {
  constexpr int64_t dim = 16 * CH;
  const int64_t b = task.b, lo = task.lo, len = task.len, kvh0 = task.kvh0, kvh1 = task.kvh1;
  constexpr int CV = CH < 4 ? CH : 4;  // 16-dim chunks per value pass: 2 * CV accumulators
  const int64_t span = kvh1 - kvh0;
  alignas(32) float acc[kMaxTaskRows][dim];  // permuted lanes (above), undone at the store
  float m[kMaxTaskRows], l[kMaxTaskRows], qscale[kMaxTaskRows];
  alignas(32) int16_t q16[kMaxTaskRows][dim];
  alignas(32) float scores[GROUP][kBlock];
  alignas(16) uint16_t ks16[kBlock], vs16[kBlock];  // the rows' float16 scales
  alignas(32) float vs[kBlock];
  alignas(32) __m256i pairs[kBlock / 2][2 * CH];  // V rows 2p, 2p + 1 widened, interleaved
  alignas(32) int16_t wq[GROUP][kBlock];  // w of the head's block as int16 (masked: 0 past n)
  int64_t rows[kBlock], next_rows[kBlock];  // byte offsets of the block's rows (and the next's)
  if (!tasks.first_block_fetched()) prefetch_first_block<dim, PAGED>(a, b, lo, len, kvh0, kvh1);
  for (int64_t r = 0; r < span * GROUP; ++r) {  // the query rotated, as int16, a scale per head
    alignas(32) float qr[dim];
    to_cache_basis(a.q + b * a.q_stride_b + (kvh0 * GROUP + r) * a.q_stride_h, dim, qr);
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(qr[d]));
    const float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
    qscale[r] = s * a.scale;
    for (int64_t d = 0; d < dim; ++d) {  // |q / s| <= 32767, a rounding saturated
      q16[r][d] = static_cast<int16_t>(std::clamp(std::nearbyint(qr[d] * inv), -32768.0f,
                                                  32767.0f));
    }
    std::fill(acc[r], acc[r] + dim, 0.0f);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const auto offset_of = [&](int64_t rb, int64_t t) {
    return row_of<PAGED>(rb, t, a.starts, a.table, a.table_stride, a.block_size) * a.stride_row;
  };
  for (int64_t t0 = lo; t0 < len; t0 += kBlock) {
    const int64_t n = std::min(kBlock, len - t0), vecs_n = (n + 7) / 8, pairs_n = (n + 1) / 2;
    for (int64_t j = 0; j < n; ++j) rows[j] = offset_of(b, t0 + j);
    for (int64_t j = n; j < vecs_n * 8; ++j) rows[j] = rows[0];  // masked off below
    int64_t ahead = std::max<int64_t>(0, std::min(kBlock, len - t0 - kBlock));
    for (int64_t j = 0; j < ahead; ++j) next_rows[j] = offset_of(b, t0 + kBlock + j);
    const TaskBounds* following = t0 + kBlock >= len ? tasks.claim_next() : nullptr;
    if (following != nullptr) {  // the last block: the thread's next task's first rows, as
      // offsets from this task's heads (both span the same number of heads)
      ahead = std::max<int64_t>(0, std::min(kBlock, following->len - following->lo));
      const int64_t heads = (following->kvh0 - kvh0) * a.stride_head;
      for (int64_t j = 0; j < ahead; ++j) {
        next_rows[j] = offset_of(following->b, following->lo + j) + heads;
      }
    }
    for (int64_t h = 0; h < span; ++h) {
      const int8_t* k = a.k + (kvh0 + h) * a.stride_head;
      const int8_t* v = a.v + (kvh0 + h) * a.stride_head;
      const int16_t* qh = q16[h * GROUP];
      for (int64_t u = 0; u < vecs_n; ++u) {  // keys: 8 rows, each widened once
        __m256i part[GROUP][8];
        for (int j = 0; j < 8; ++j) {
          const int64_t t = u * 8 + j;
          const int8_t* kr = k + rows[t];
          if (t < ahead) prefetch_lines<dim + kScaleBytes>(k + next_rows[t]);
          std::memcpy(&ks16[t], kr + dim, sizeof(uint16_t));  // (its lines are being read)
          __m256i kw[CH];
          for (int c = 0; c < CH; ++c) {
            kw[c] = _mm256_cvtepi8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(kr + 16 * c)));
          }
          for (int g = 0; g < GROUP; ++g) {
            const auto* qg = reinterpret_cast<const __m256i*>(qh + g * dim);
            __m256i s = _mm256_madd_epi16(kw[0], _mm256_load_si256(qg));
            for (int c = 1; c < CH; ++c) {
              s = _mm256_add_epi32(s, _mm256_madd_epi16(kw[c], _mm256_load_si256(qg + c)));
            }
            part[g][j] = s;
          }
        }
        const __m256 ks = _mm256_cvtph_ps(
            _mm_load_si128(reinterpret_cast<const __m128i*>(ks16 + 8 * u)));
        for (int g = 0; g < GROUP; ++g) {
          _mm256_store_ps(scores[g] + 8 * u,
                          _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(vsum8_i32(part[g])), ks),
                                        _mm256_set1_ps(qscale[h * GROUP + g])));
        }
      }
      for (int64_t p = 0; p < pairs_n; ++p) {  // values: the block's rows widened once
        const int64_t j = 2 * p;
        for (int64_t i = j; i < std::min(j + 2, ahead); ++i) {
          prefetch_lines<dim + kScaleBytes>(v + next_rows[i]);
        }
        const int8_t* v0 = v + rows[j];
        const int8_t* v1 = j + 1 < n ? v + rows[j + 1] : nullptr;
        std::memcpy(&vs16[j], v0 + dim, sizeof(uint16_t));
        std::memcpy(&vs16[j + 1], v + rows[j + 1] + dim, sizeof(uint16_t));  // (row 0 past n)
        for (int c = 0; c < CH; ++c) {
          const __m256i x = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + 16 * c)));
          const __m256i z = v1 != nullptr
              ? _mm256_cvtepi8_epi16(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(v1 + 16 * c)))
              : _mm256_setzero_si256();
          pairs[p][2 * c] = _mm256_unpacklo_epi16(x, z);
          pairs[p][2 * c + 1] = _mm256_unpackhi_epi16(x, z);
        }
      }
      for (int64_t j = 2 * pairs_n; j < vecs_n * 8; ++j) vs16[j] = vs16[0];  // masked off below
      for (int64_t u = 0; u < vecs_n; ++u) {
        _mm256_store_ps(vs + 8 * u, _mm256_cvtph_ps(
            _mm_load_si128(reinterpret_cast<const __m128i*>(vs16 + 8 * u))));
      }
      for (int g = 0; g < GROUP; ++g) {
        const int64_t r = h * GROUP + g;
        __m256 block_max = _mm256_set1_ps(-INFINITY);
        for (int64_t u = 0; u < vecs_n; ++u) {
          block_max = _mm256_max_ps(
              block_max, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                          _mm256_load_ps(scores[g] + 8 * u),
                                          first_lanes(n - u * 8)));
        }
        const float m_new = std::max(m[r], vmax_lane(block_max));
        const float rescale = max_rescale(m[r], m_new);
        __m256 sums = _mm256_setzero_ps(), w_max = _mm256_setzero_ps();
        __m256 w[kBlock / 8];
        for (int64_t u = 0; u < vecs_n; ++u) {
          const __m256 p = _mm256_and_ps(
              first_lanes(n - u * 8),
              exp_nonpositive_v(_mm256_sub_ps(_mm256_load_ps(scores[g] + 8 * u),
                                              _mm256_set1_ps(m_new))));
          sums = _mm256_add_ps(sums, p);
          w[u] = _mm256_mul_ps(p, _mm256_load_ps(vs + 8 * u));
          w_max = _mm256_max_ps(w_max, w[u]);
        }
        const float wm = vmax_lane(w_max);
        const __m256 to_int = _mm256_set1_ps(wm > 0.0f ? 32767.0f / wm : 0.0f);
        for (int64_t u = 0; u < vecs_n; ++u) {
          const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(w[u], to_int));
          _mm_store_si128(reinterpret_cast<__m128i*>(wq[g] + 8 * u),
                          _mm_packs_epi32(_mm256_castsi256_si128(x),
                                          _mm256_extracti128_si256(x, 1)));
        }
        l[r] = l[r] * rescale + vsum(sums);
        m[r] = m_new;
        const __m256 f = _mm256_set1_ps(rescale), ws = _mm256_set1_ps(wm / 32767.0f);
        for (int cc = 0; cc < CH; cc += CV) {  // CV chunks of 16 dims at a time
          __m256i iacc[2 * CV];
          for (int e = 0; e < 2 * CV; ++e) iacc[e] = _mm256_setzero_si256();
          for (int64_t p = 0; p < pairs_n; ++p) {
            int32_t pair;  // w of tokens 2p, 2p + 1 (0 past n)
            std::memcpy(&pair, &wq[g][2 * p], sizeof(pair));
            const __m256i pp = _mm256_set1_epi32(pair);
            for (int e = 0; e < 2 * CV; ++e) {
              iacc[e] = _mm256_add_epi32(iacc[e], _mm256_madd_epi16(pairs[p][2 * cc + e], pp));
            }
          }
          float* ar = acc[r] + 16 * cc;
          for (int e = 0; e < 2 * CV; ++e) {
            _mm256_store_ps(ar + 8 * e,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[e]), ws,
                                            _mm256_mul_ps(_mm256_load_ps(ar + 8 * e), f)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < span * GROUP; ++r) {
    alignas(32) float res[dim];
    for (int64_t c = 0; c < CH; ++c) {  // (lo 0, hi 0 | lo 1, hi 1) -> dims in order
      const __m256 lo_acc = _mm256_load_ps(acc[r] + 16 * c);
      const __m256 hi_acc = _mm256_load_ps(acc[r] + 16 * c + 8);
      _mm256_store_ps(res + 16 * c, _mm256_permute2f128_ps(lo_acc, hi_acc, 0x20));
      _mm256_store_ps(res + 16 * c + 8, _mm256_permute2f128_ps(lo_acc, hi_acc, 0x31));
    }
    store_output(res, dim, len > lo ? 1.0f / l[r] : 0.0f,
                 a.out + b * a.out_stride_b + (kvh0 * GROUP + r) * a.out_stride_h);
  }
}

template <typename T, int GROUP, int DIM, bool PAGED>
void attend_fast(const DecodeArgs<T>& a, const TaskBounds& task, ThreadTasks& tasks) {
  attend_avx2<T, GROUP, DIM / 16, PAGED>(a, task, tasks);
}
#endif

#if defined(VMKV_INT8_VNNI) || defined(VMKV_INT8_AVX2)
template <typename T, bool PAGED>
using TaskFn = void (*)(const DecodeArgs<T>&, const TaskBounds&, ThreadTasks&);

template <typename T, bool PAGED, int DIM, int... G>
TaskFn<T, PAGED> fast_of_group(int64_t group, std::integer_sequence<int, G...>) {
  TaskFn<T, PAGED> fn = nullptr;
  ((group == G + 1 ? (fn = &attend_fast<T, G + 1, DIM, PAGED>) : fn), ...);
  return fn;
}

// The compiled task (VNNI or AVX2) for this GQA group and head_dim, or nullptr (the portable
// loop).
template <typename T, bool PAGED>
TaskFn<T, PAGED> fast_task(int64_t group, int64_t dim) {
  const auto groups = std::make_integer_sequence<int, kMaxGroup>{};
  switch (dim) {
    case 64: return fast_of_group<T, PAGED, 64>(group, groups);
    case 128: return fast_of_group<T, PAGED, 128>(group, groups);
    default: return nullptr;
  }
}
#endif

template <typename T, bool PAGED>
void decode(const DecodeArgs<T>& a, const int32_t* seq_lens, int64_t batch, int64_t kv_heads,
            const NewRows<T>& fresh, int64_t window) {
#if defined(_OPENMP)
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  // a task is a request's KV heads, all of them (one stream of rows per request) unless too few
  // requests keep the threads busy: then one head each
  const int64_t span = batch >= 4 * threads && kv_heads * a.group <= kMaxTaskRows ? kv_heads : 1;
  const int64_t splits = kv_heads / span;
#if defined(VMKV_INT8_VNNI) || defined(VMKV_INT8_AVX2)
  const TaskFn<T, PAGED> fast = fast_task<T, PAGED>(a.group, a.dim);
#endif
  TaskQueue queue(seq_lens, batch, splits, span, window);
#pragma omp parallel
  {
    ThreadTasks tasks(queue);
    for (int64_t task = tasks.take(); task >= 0; task = tasks.take()) {
      const TaskBounds t = queue.bounds(task);
      if (fresh.k != nullptr && t.len > 0) {  // quantise the new token's rows of these heads
        const int64_t row = row_of<PAGED>(t.b, t.len - 1, a.starts, a.table, a.table_stride,
                                          a.block_size);
        for (int64_t h = t.kvh0; h < t.kvh1; ++h) {
          quantize_row(fresh.k + t.b * fresh.k_stride_b + h * fresh.k_stride_h, a.dim,
                       const_cast<int8_t*>(a.k) + row * a.stride_row + h * a.stride_head);
          quantize_row(fresh.v + t.b * fresh.v_stride_b + h * fresh.v_stride_h, a.dim,
                       const_cast<int8_t*>(a.v) + row * a.stride_row + h * a.stride_head);
        }
      }
#if defined(VMKV_INT8_VNNI) || defined(VMKV_INT8_AVX2)
      if (fast != nullptr) {
        fast(a, t, tasks);
        continue;
      }
#endif
      attend_portable<T, PAGED>(a, t.b, t.lo, t.len, t.kvh0, t.kvh1);
    }
  }
}

template <typename T>
int decode_entry(const DecodeArgs<T>& a, const int32_t* seq_lens, int64_t batch,
                 int64_t kv_heads, const NewRows<T>& fresh, int64_t window) {
  if (a.table != nullptr) {
    if (a.block_size <= 0) return 1;
    decode<T, true>(a, seq_lens, batch, kv_heads, fresh, window);
  } else {
    if (a.starts == nullptr) return 1;
    decode<T, false>(a, seq_lens, batch, kv_heads, fresh, window);
  }
  return 0;
}

// Rows [first[b], seq_lens[b]) of each request, dequantised and rotated back to the model's basis,
// as T at dst rows dst_starts[b] + t.
template <typename T, bool PAGED>
void dequantize(const int8_t* k, const int8_t* v, int64_t stride_row, int64_t stride_head,
                const int64_t* starts, const int32_t* table, int64_t table_stride,
                int64_t block_size, const int32_t* seq_lens, const int32_t* first,
                int64_t batch, int64_t kv_heads, int64_t dim, T* dst_k, T* dst_v,
                const int64_t* dst_starts) {
  std::vector<int64_t> task_b, task_t;  // chunks of 64 tokens
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = first[b]; t < seq_lens[b]; t += 64) {
      task_b.push_back(b);
      task_t.push_back(t);
    }
  }
  const int64_t tasks = static_cast<int64_t>(task_b.size());
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task_b[task], t1 = std::min<int64_t>(task_t[task] + 64, seq_lens[b]);
    for (int64_t t = task_t[task]; t < t1; ++t) {
      const int64_t row = row_of<PAGED>(b, t, starts, table, table_stride, block_size);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t src = row * stride_row + h * stride_head;
        const int64_t dst = ((dst_starts[b] + t) * kv_heads + h) * dim;
        dequantize_row(k + src, dim, dst_k + dst);
        dequantize_row(v + src, dim, dst_v + dst);
      }
    }
  }
}

constexpr int kFloat32 = 0, kBFloat16 = 2;

}  // namespace

extern "C" {

// Quantises rows k_new[t], v_new[t] ([tokens, kv_heads, dim] of dtype at the given strides) into
// the int8 cache rows rows[t] (skipped where negative). Returns 0, or 1 on bad arguments.
int vmkv_cpu_kv_int8_store(int dtype, void* k, void* v, int64_t stride_row, int64_t stride_head,
                           const int64_t* rows, int64_t tokens, int64_t kv_heads, int64_t dim,
                           const void* k_new, int64_t k_stride_t, int64_t k_stride_h,
                           const void* v_new, int64_t v_stride_t, int64_t v_stride_h) {
  if (kv_heads <= 0 || dim <= 0 || dim > kMaxDim || tokens < 0) return 1;
  if (stride_head < dim + kScaleBytes) return 1;
  if (dtype != kFloat32 && dtype != kBFloat16) return 1;
  auto* kc = static_cast<int8_t*>(k);
  auto* vc = static_cast<int8_t*>(v);
#pragma omp parallel for schedule(static) if (tokens * kv_heads >= 256)
  for (int64_t i = 0; i < tokens * kv_heads; ++i) {
    const int64_t t = i / kv_heads, h = i % kv_heads;
    if (rows[t] < 0) continue;
    const int64_t at = rows[t] * stride_row + h * stride_head;
    if (dtype == kFloat32) {
      quantize_row(static_cast<const float*>(k_new) + t * k_stride_t + h * k_stride_h, dim,
                   kc + at);
      quantize_row(static_cast<const float*>(v_new) + t * v_stride_t + h * v_stride_h, dim,
                   vc + at);
    } else {
      quantize_row(static_cast<const bf16*>(k_new) + t * k_stride_t + h * k_stride_h, dim,
                   kc + at);
      quantize_row(static_cast<const bf16*>(v_new) + t * v_stride_t + h * v_stride_h, dim,
                   vc + at);
    }
  }
  return 0;
}

// Decode attention over an int8 cache: q [batch, heads, dim] and out of dtype (float32 or
// bfloat16), addressed by starts (virtual) or table (paged) as in cpu_attention.cpp; with k_new
// (and v_new) the new rows are first quantised into each request's token seq_lens[b] - 1.
// window > 0: only each request's last `window` tokens. Returns 0, or 1 on bad arguments.
int vmkv_cpu_decode_attention_int8(
    int dtype, const void* q, int64_t q_stride_b, int64_t q_stride_h, const void* k,
    const void* v, int64_t stride_row, int64_t stride_head, const int64_t* starts,
    const int32_t* table, int64_t table_stride, int64_t block_size, const int32_t* seq_lens,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale, void* out,
    int64_t out_stride_b, int64_t out_stride_h, const void* k_new, int64_t k_new_stride_b,
    int64_t k_new_stride_h, const void* v_new, int64_t v_new_stride_b, int64_t v_new_stride_h,
    int64_t window) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || dim > kMaxDim || batch < 0 ||
      window < 0) {
    return 1;
  }
  if ((k_new == nullptr) != (v_new == nullptr) || stride_head < dim + kScaleBytes) return 1;
  const auto *kc = static_cast<const int8_t*>(k), *vc = static_cast<const int8_t*>(v);
  const int64_t group = heads / kv_heads;
  if (dtype == kFloat32) {
    const DecodeArgs<float> a{static_cast<const float*>(q), q_stride_b, q_stride_h, kc, vc,
                              stride_row, stride_head, starts, table, table_stride, block_size,
                              group, dim, scale, static_cast<float*>(out), out_stride_b,
                              out_stride_h};
    const NewRows<float> fresh{static_cast<const float*>(k_new), k_new_stride_b, k_new_stride_h,
                               static_cast<const float*>(v_new), v_new_stride_b, v_new_stride_h};
    return decode_entry(a, seq_lens, batch, kv_heads, fresh, window);
  }
  if (dtype == kBFloat16) {
    const DecodeArgs<bf16> a{static_cast<const bf16*>(q), q_stride_b, q_stride_h, kc, vc,
                             stride_row, stride_head, starts, table, table_stride, block_size,
                             group, dim, scale, static_cast<bf16*>(out), out_stride_b,
                             out_stride_h};
    const NewRows<bf16> fresh{static_cast<const bf16*>(k_new), k_new_stride_b, k_new_stride_h,
                              static_cast<const bf16*>(v_new), v_new_stride_b, v_new_stride_h};
    return decode_entry(a, seq_lens, batch, kv_heads, fresh, window);
  }
  return 1;
}

// Rows [first[b], seq_lens[b]) of each request dequantised into dst_k, dst_v ([rows, kv_heads,
// dim] contiguous, dtype float32 or bfloat16) at rows dst_starts[b] + t: what the prefill
// kernels then read as a contiguous cache. Returns 0, or 1 on bad arguments.
int vmkv_cpu_kv_int8_dequantize(int dtype, const void* k, const void* v, int64_t stride_row,
                                int64_t stride_head, const int64_t* starts, const int32_t* table,
                                int64_t table_stride, int64_t block_size,
                                const int32_t* seq_lens, const int32_t* first, int64_t batch,
                                int64_t kv_heads, int64_t dim, void* dst_k, void* dst_v,
                                const int64_t* dst_starts) {
  if (kv_heads <= 0 || dim <= 0 || dim > kMaxDim || batch < 0) return 1;
  if (stride_head < dim + kScaleBytes) return 1;
  if ((table == nullptr) == (starts == nullptr) || (table != nullptr && block_size <= 0)) return 1;
  const auto *kc = static_cast<const int8_t*>(k), *vc = static_cast<const int8_t*>(v);
  const bool paged = table != nullptr;
  if (dtype == kFloat32) {
    auto* dk = static_cast<float*>(dst_k);
    auto* dv = static_cast<float*>(dst_v);
    (paged ? dequantize<float, true> : dequantize<float, false>)(
        kc, vc, stride_row, stride_head, starts, table, table_stride, block_size, seq_lens,
        first, batch, kv_heads, dim, dk, dv, dst_starts);
    return 0;
  }
  if (dtype == kBFloat16) {
    auto* dk = static_cast<bf16*>(dst_k);
    auto* dv = static_cast<bf16*>(dst_v);
    (paged ? dequantize<bf16, true> : dequantize<bf16, false>)(
        kc, vc, stride_row, stride_head, starts, table, table_stride, block_size, seq_lens,
        first, batch, kv_heads, dim, dk, dv, dst_starts);
    return 0;
  }
  return 1;
}

}  // extern "C"
