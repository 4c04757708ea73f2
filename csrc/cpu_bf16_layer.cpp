// Linears and decoder layers on oneDNN's brgemm ukernel, in bfloat16 (the CPU's matrix units:
// AMX or AVX512-BF16) and in float32 (AVX-512 FMA), one body templated on the element type T:
//
//   vmkv_bf16_linear:    out = a W^T (+ b), float32 or bfloat16 out (the LM head, any packed linear)
//   vmkv_bf16_attn_in:   h = rms_norm(x) * w1;  qkv = h Wqkv^T (+ b);  RoPE on q and k in place
//   (attention: the engine's backend reads q/k/v out of qkv)
//   vmkv_bf16_attn_out:  x += attn Wo^T (+ b);  h = rms_norm(x) * w2;
//                        act = silu(h Wg^T) * (h Wu^T);  x += act Wdown^T (+ b)
//
// A layer with Gemma 3's norms (VmkvBf16Layer.gemma set) runs Gemma's order instead, every norm
// normalize(x) * (1 + w) in float32 rounded once (cpu_gemma_ops.h):
//   attn_in:   h = norm_in(x);  qkv = h Wqkv^T;  q_norm / k_norm per head;  RoPE on q and k
//   attn_out:  x += norm_post_attn(attn Wo^T);  h = norm_pre_ffw(x);
//              act = gelu_tanh(h Wg^T) * (h Wu^T);  x += norm_post_ffw(act Wdown^T)
//
// The matrix products are oneDNN's brgemm ukernel (the AMX tile kernel torch's own CPU flash
// attention runs), which torch exports as at::native::cpublas::brgemm; the caller passes its
// address and that of brgemm_release, so this library links nothing but libgomp. A weight is
// packed once at load into blocks of block_n output columns, each block W^T[K, bn] in VNNI pairs
// ([K/2][bn][2], the layout the ukernel reads; vmkv/models/linear.py packs it). A product runs as
// tiles of rows x block_n columns spread over the OpenMP team, each tile's float32
// result finished by an epilogue while it is in cache: bias, rounding to bf16, the residual add,
// or SiLU(gate) * up (the gate and up tiles of one column block computed together).
//
// Rounding follows transformers in bfloat16 operation for operation, so a bf16 engine tracks a
// bf16 transformers model as closely as float reassociation allows: each linear's result
// (bias included) rounded once to bf16; RMSNorm statistics in float32, x * rsqrt(var + eps)
// rounded, then times the bf16 weight, rounded; RoPE products and their sum each rounded;
// SiLU rounded, then its product with up rounded; each residual add rounded. In float32 every
// rounding is the identity (the order of operations stays the unfused layer's), B blocks are
// plain rows ([K][block_n], no VNNI pairs), and the entry points are vmkv_f32_*.
//
// Built by vmkv/kernels/cpu_bf16.py like csrc/cpu_attention.cpp (g++ -O3 -march=native
// -fopenmp, cached, called through ctypes). Each entry point returns 0, 1 on bad arguments
// (nothing written) or 2 when the ukernel raised (the output is then undefined).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_brgemm.h"
#include "cpu_gemma_ops.h"
#include "cpu_lap.h"
#include "cpu_layer_ops.h"
#include "cpu_vec.h"

using vmkv::bf16;

extern "C" {

// A packed linear layer: W^T in ceil(N / block_n) blocks of [K / 2][block_n][2] (bf16; float32:
// [K][block_n]), zero-padded columns in the last block, an optional bias [N] of the same type.
struct VmkvBf16Linear {
  const void* packed;
  const void* bias;  // nullptr: none
  int64_t in_features, out_features, block_n;
};

// The ukernel's entry points and (optional) profiling counters {gemm ns, elementwise ns}. For
// the float32 entry points `brgemm` is the ukernel's float overload (same arguments, float*).
struct VmkvBf16Gemm {
  VmkvBrgemm brgemm;
  VmkvBrgemmRelease release;
  int64_t* ns;  // nullptr: not profiling
};

// A decoder layer's weights (the caller keeps the tensors alive). gate_up holds the gate's
// columns, then the up projection's: intermediate must be a multiple of its block_n. With
// `gemma` set the layer is Gemma 3's and input_norm / post_norm are not read.
struct VmkvBf16Layer {
  VmkvBf16Linear qkv, o, gate_up, down;
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  const VmkvGemmaNorms* gemma;  // nullptr: a Llama layer
};

struct VmkvBf16Shape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
  VmkvBf16Gemm gemm;
};

}  // extern "C"

namespace {

using namespace vmkv;

constexpr int64_t kSmallRows = 64;     // up to this many rows: one row tile (decode)
constexpr int64_t kMaxTileRows = 256;  // rows per ukernel call beyond it (prefill)
constexpr int64_t kMaxBlockN = 64;     // widest column block a weight may be packed in
// fewest rows per tile when decode's rows are split: a streaming pass's 6 (below 12 rows the
// weight stream decides and splitting the rows made the GEMMs slower; from 12 to 31 rows the
// even split took float32's GEMMs at 12-28 rows 5-7 % faster, bf16's at 20-28 rows 5-7 %)
constexpr int64_t kBalancedRows = 6;

// the ukernel's float32 overload (VmkvBrgemm's arguments with float A and B)
using BrgemmF32 = void (*)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                           int64_t ldc, bool add_c, const float* a, const float* b, float* c,
                           bool is_vnni);

template <typename T>
constexpr bool kVnni = std::is_same_v<T, bf16>;  // B in VNNI pairs (bf16) or plain rows

template <typename T>
bool bad_linear(const VmkvBf16Linear& w, int64_t in, int64_t out) {
  return w.packed == nullptr || w.in_features != in || w.out_features != out ||
         (kVnni<T> && w.in_features % 2 != 0) || w.block_n <= 0 || w.block_n > kMaxBlockN ||
         w.block_n % 16 != 0;
}

// Decode's row counts (up to kSmallRows) stream each weight block once from memory, then reuse
// it from cache for the rest of the rows. The ukernel left that stream exposed: at 1-4 rows it
// read the weights at 22-29 GB/s where a plain read of the same blocks ran at 32 (float32) and
// 40 GB/s (bf16), and up to 64 rows it stayed behind the loops below. These take up to 6 rows
// of A per pass over a block (the first pass streams it, the rest find it in cache), each
// k-row of the block loaded once per pass and fed to every row's FMAs (bf16: dot products of
// VNNI pairs, the ukernel's AVX512-BF16 arithmetic in its order). Measured on a 2-core Zen 4
// EPYC, every linear of SmolLM2-135M's 30 layers in rotation, against the ukernel: float32
// 1.33x as fast at 1 row, 1.15x at 8-12, 1.09x at 24, 1.04x at 32, 1.01x at 64; bf16 1.65x at
// 1 row, 1.2x at 8, 1.18x at 16, 1.06x at 32, 1.02x at 64; bit-identical results in both. A
// spread-out software prefetch of the next block (L1 or L2) made no steady difference. With
// AMX the tile kernel takes bf16 from 5 rows on (its peak is far above these dot products).
#if defined(__AVX512F__)
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
constexpr int64_t kStreamRowsBf16 = kSmallRows;
#elif defined(__AVX512BF16__)
constexpr int64_t kStreamRowsBf16 = 4;  // AMX: the tile kernel from 5 rows on
#else
constexpr int64_t kStreamRowsBf16 = 0;  // no bf16 dot products: the ukernel
#endif
template <typename T>
constexpr int64_t kStreamRows = std::is_same_v<T, bf16> ? kStreamRowsBf16 : kSmallRows;
constexpr int64_t kStreamPass = 6;  // rows of A per pass over a block (6 x 4 accumulators)

// c[R, V * 16] = a[R, K] (row stride lda) b, b one float32 block [K][V * 16].
template <int R, int V>
inline void stream_rows(const float* a, int64_t lda, const float* b, int64_t k, float* c) {
  vfloat acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  }
  for (int64_t i = 0; i < k; ++i) {
    vfloat wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload(b + (i * V + v) * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat x = vset1(a[r * lda + i]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(x, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) vstore(c + (r * V + v) * kLanes, acc[r][v]);
  }
}

#if defined(__AVX512BF16__)
// c[R, V * 16] = a[R, K] (row stride lda) b, b one bf16 block in VNNI pairs [K / 2][V * 16][2].
template <int R, int V>
inline void stream_rows(const bf16* a, int64_t lda, const bf16* b, int64_t k, float* c) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k / 2; ++i) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(b + (i * V + v) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // a[r, 2i] and a[r, 2i + 1]
      std::memcpy(&pair, a + r * lda + 2 * i, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + (r * V + v) * 16, acc[r][v]);
  }
}
#endif

// c[rows, V * 16] = a[rows, K] b, kStreamPass rows per pass (the later passes find b in cache).
template <int V, typename T>
void stream_block(const T* a, int64_t lda, int64_t rows, const T* b, int64_t k, float* c) {
  static_assert(kStreamPass == 6);
  for (int64_t r = 0; r < rows; r += kStreamPass) {
    const T* ar = a + r * lda;
    float* cr = c + r * V * 16;
    switch (std::min(kStreamPass, rows - r)) {
      case 1: stream_rows<1, V>(ar, lda, b, k, cr); break;
      case 2: stream_rows<2, V>(ar, lda, b, k, cr); break;
      case 3: stream_rows<3, V>(ar, lda, b, k, cr); break;
      case 4: stream_rows<4, V>(ar, lda, b, k, cr); break;
      case 5: stream_rows<5, V>(ar, lda, b, k, cr); break;
      default: stream_rows<6, V>(ar, lda, b, k, cr); break;
    }
  }
}

// stream_block for block width bn; false (nothing done) where it does not apply.
template <typename T>
bool stream_product(int64_t bn, const T* a, int64_t lda, int64_t rows, const T* b, int64_t k,
                    float* c) {
  if (rows > kStreamRows<T>) return false;
  if constexpr (kStreamRows<T> > 0) {
    switch (bn) {
      case 64: stream_block<4>(a, lda, rows, b, k, c); return true;
      case 32: stream_block<2>(a, lda, rows, b, k, c); return true;
      case 16: stream_block<1>(a, lda, rows, b, k, c); return true;
      default: return false;
    }
  }
  return false;
}
#endif

// c[rows, bn] = a[rows, K] (row stride lda) times column block `block` of w.
template <typename T>
inline void block_product(const VmkvBf16Gemm& g, const VmkvBf16Linear& w, int64_t block,
                          const T* a, int64_t lda, int64_t rows, float* c) {
  // No software prefetch of the next block: a burst of prefetches for its 64+ KiB waits on
  // line-fill buffers before the product starts, and decode's GEMMs were ~8 % slower with one
  // (`vmkv bench profile --dtype bfloat16 --batch-size 64`, 19.3 vs 17.7 ms); the hardware
  // streams the contiguous block by itself.
  const T* b = static_cast<const T*>(w.packed) + block * w.in_features * w.block_n;
#if defined(__AVX512F__)
  if (stream_product(w.block_n, a, lda, rows, b, w.in_features, c)) return;
#endif
  if constexpr (kVnni<T>) {
    g.brgemm(rows, w.block_n, w.in_features, lda, w.block_n, w.block_n, false, a, b, c, true);
  } else {
    reinterpret_cast<BrgemmF32>(g.brgemm)(rows, w.block_n, w.in_features, lda, w.block_n,
                                          w.block_n, false, a, b, c, false);
  }
}

// Runs task(m0, rows, block, scratch) for every (row tile, column block) of an m-row product
// over the OpenMP team; `scratch` holds two float32 tiles. Few rows (decode): the column blocks
// split over the threads, so each streams its share of the weight once; where the blocks do not
// divide evenly (9 blocks on 2 threads: 5 and 4), the rows are cut into one tile per thread and
// the tasks run block by block, so a thread shares at most its first and last block with a
// neighbour (9 blocks: 4.5 each). Many rows (prefill): row tiles of at most kMaxTileRows, a
// whole number per thread, each thread sweeping every column block with its rows of A in
// cache. Returns false when a task raised (the ukernel reports errors as C++ exceptions, which
// must not cross the OpenMP region or the C ABI).
template <typename T, typename Task>
bool for_each_tile(const VmkvBf16Gemm& g, int64_t m, int64_t blocks, Task&& task) {
#if defined(_OPENMP)
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  int64_t tiles = 1;
  bool block_major = false;  // task t: block t / tiles, row tile t % tiles
  if (m > kSmallRows) {
    tiles = std::max(threads, (m + kMaxTileRows - 1) / kMaxTileRows);
    tiles = (tiles + threads - 1) / threads * threads;
  } else if (blocks % threads != 0 && m >= kBalancedRows * threads) {
    tiles = threads;
    block_major = true;
  }
  const int64_t tile_rows = (m + tiles - 1) / tiles, tasks = tiles * blocks;
  std::atomic<bool> failed{false};
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> scratch(static_cast<size_t>(2 * tile_rows * kMaxBlockN));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t m0 = (block_major ? t % tiles : t / blocks) * tile_rows;
      const int64_t block = block_major ? t / tiles : t % blocks;
      if (m0 >= m) continue;
      try {
        task(m0, std::min(tile_rows, m - m0), block, scratch.data());
      } catch (...) {
        failed = true;
      }
    }
    try {
      g.release(kVnni<T>);
    } catch (...) {
      failed = true;
    }
  }
  return !failed;
}

int64_t num_blocks(const VmkvBf16Linear& w) {
  return (w.out_features + w.block_n - 1) / w.block_n;
}

// What a linear's epilogue does with its float32 products c (+ bias) in out (row stride ldo):
enum class Store {
  kRounded,   // out = round(c + b)          (T)
  kResidual,  // out = round(out + round(c + b))
  kFloat,     // out = c + b                 (float32: the LM head)
};

// out[m, N] from a[m, K] (row stride lda) w^T: every (row tile, column block) product, each row
// of it stored by S while in cache.
template <Store S, typename T, typename Out>
bool linear(const VmkvBf16Gemm& g, const VmkvBf16Linear& w, const T* a, int64_t lda, int64_t m,
            Out* out, int64_t ldo) {
  const T* bias = static_cast<const T*>(w.bias);
  return for_each_tile<T>(g, m, num_blocks(w), [&](int64_t m0, int64_t rows, int64_t j,
                                                   float* c) {
    block_product(g, w, j, a + m0 * lda, lda, rows, c);
    const int64_t n0 = j * w.block_n, cols = std::min(w.block_n, w.out_features - n0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* cr = c + r * w.block_n;
      Out* o = out + (m0 + r) * ldo + n0;
      if constexpr (S == Store::kRounded) {
        store_rounded(cr, bias, n0, cols, o);
      } else if constexpr (S == Store::kResidual) {
        add_rounded(cr, bias, n0, cols, o);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < cols; ++i) o[i] = cr[i] + bias_at(bias, n0 + i);
      }
    }
  });
}

// act[m, I] = silu(h Wg^T) * (h Wu^T) (Gelu: gelu_tanh), rounded as transformers does; gate
// block j and up block j + I / bn in one task.
template <typename T, bool Gelu = false>
bool gate_up_act(const VmkvBf16Gemm& g, const VmkvBf16Linear& w, const T* h, int64_t ldh,
                 int64_t m, int64_t inter, T* act) {
  const int64_t bn = w.block_n, pairs = inter / bn;
  const T* bias = static_cast<const T*>(w.bias);
  const T* bias_up = bias != nullptr ? bias + inter : nullptr;
  return for_each_tile<T>(g, m, pairs, [&](int64_t m0, int64_t rows, int64_t j, float* c) {
    float* up = c + rows * bn;
    block_product(g, w, j, h + m0 * ldh, ldh, rows, c);
    block_product(g, w, pairs + j, h + m0 * ldh, ldh, rows, up);
    for (int64_t r = 0; r < rows; ++r) {
      T* out = act + (m0 + r) * inter + j * bn;
      if constexpr (Gelu) {
        gelu_tanh_mul_rounded(c + r * bn, up + r * bn, bias, bias_up, j * bn, bn, out);
      } else {
        silu_mul_rounded(c + r * bn, up + r * bn, bias, bias_up, j * bn, bn, out);
      }
    }
  });
}

template <typename T>
bool bad_layer(const VmkvBf16Shape* s, const VmkvBf16Layer* w, int64_t t) {
  if (s == nullptr || w == nullptr || s->gemm.brgemm == nullptr ||
      s->gemm.release == nullptr || t < 0 || s->head_dim % 2 != 0) {
    return true;
  }
  const int64_t q = s->num_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
  return bad_linear<T>(w->qkv, s->hidden, q + 2 * kv) || bad_linear<T>(w->o, q, s->hidden) ||
         bad_linear<T>(w->gate_up, s->hidden, 2 * s->intermediate) ||
         bad_linear<T>(w->down, s->intermediate, s->hidden) ||
         s->intermediate % w->gate_up.block_n != 0;
}

template <typename T>
int linear_entry(const VmkvBf16Gemm* g, const VmkvBf16Linear* w, const T* a, int64_t lda,
                 int64_t m, void* out, int64_t ldo, bool rounded) {
  if (g == nullptr || w == nullptr || g->brgemm == nullptr || g->release == nullptr ||
      bad_linear<T>(*w, w->in_features, w->out_features) || m < 0 || lda < w->in_features ||
      ldo < w->out_features) {
    return 1;
  }
  if (m == 0) return 0;
  Lap lap(g->ns);
  const bool ok = rounded ? linear<Store::kRounded>(*g, *w, a, lda, m, static_cast<T*>(out), ldo)
                          : linear<Store::kFloat>(*g, *w, a, lda, m, static_cast<float*>(out), ldo);
  lap(0);
  return ok ? 0 : 2;
}

template <typename T>
int attn_in(const VmkvBf16Shape* s, const VmkvBf16Layer* w, const T* x, int64_t t,
            const T* cos, const T* ssin, T* h, T* qkv) {
  if (bad_layer<T>(s, w, t)) return 1;
  if (t == 0) return 0;
  const int64_t width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
  Lap lap(s->gemm.ns);
  if (w->gemma != nullptr) {
    gemma_norm(x, w->gemma->input, t, s->hidden, s->eps, h);
  } else {
    rms_norm(x, static_cast<const T*>(w->input_norm), t, s->hidden, s->eps, h);
  }
  lap(1);
  const bool ok = linear<Store::kRounded>(s->gemm, w->qkv, h, s->hidden, t, qkv, width);
  lap(0);
  if (w->gemma != nullptr) {
    gemma_head_norms(qkv, t, width, s->num_heads, s->num_kv_heads, s->head_dim, s->eps,
                     w->gemma->q, w->gemma->k);
  }
  rope(qkv, t, width, cos, ssin, s->num_heads + s->num_kv_heads, s->head_dim);
  lap(1);
  return ok ? 0 : 2;
}

// attn_out for a Gemma 3 layer: each sub-block's output normed before its residual add (h holds
// the o and down products, then the normed input of the MLP).
template <typename T>
int gemma_attn_out(const VmkvBf16Shape* s, const VmkvBf16Layer* w, T* x, int64_t t,
                   const T* attn, int64_t attn_stride, T* h, T* act) {
  const int64_t hidden = s->hidden, inter = s->intermediate;
  const VmkvGemmaNorms& n = *w->gemma;
  Lap lap(s->gemm.ns);
  bool ok = linear<Store::kRounded>(s->gemm, w->o, attn, attn_stride, t, h, hidden);
  lap(0);
  gemma_norm_add(h, n.post_attn, t, hidden, s->eps, x);
  gemma_norm(x, n.pre_ffw, t, hidden, s->eps, h);
  lap(1);
  ok = ok && gate_up_act<T, true>(s->gemm, w->gate_up, h, hidden, t, inter, act);
  ok = ok && linear<Store::kRounded>(s->gemm, w->down, act, inter, t, h, hidden);
  lap(0);
  gemma_norm_add(h, n.post_ffw, t, hidden, s->eps, x);
  lap(1);
  return ok ? 0 : 2;
}

template <typename T>
int attn_out(const VmkvBf16Shape* s, const VmkvBf16Layer* w, T* x, int64_t t, const T* attn,
             int64_t attn_stride, T* h, T* act) {
  if (bad_layer<T>(s, w, t) || attn_stride < s->num_heads * s->head_dim) return 1;
  if (t == 0) return 0;
  if (w->gemma != nullptr) return gemma_attn_out(s, w, x, t, attn, attn_stride, h, act);
  const int64_t hidden = s->hidden, inter = s->intermediate;
  Lap lap(s->gemm.ns);
  bool ok = linear<Store::kResidual>(s->gemm, w->o, attn, attn_stride, t, x, hidden);
  lap(0);
  rms_norm(x, static_cast<const T*>(w->post_norm), t, hidden, s->eps, h);
  lap(1);
  ok = ok && gate_up_act(s->gemm, w->gate_up, h, hidden, t, inter, act);
  ok = ok && linear<Store::kResidual>(s->gemm, w->down, act, inter, t, x, hidden);
  lap(0);
  return ok ? 0 : 2;
}

}  // namespace

extern "C" {

// out [m, N] (row stride ldo) = a [m, K] (row stride lda) W^T (+ b): float32 when out_bf16 is 0,
// else bf16 rounded once.
int vmkv_bf16_linear(const VmkvBf16Gemm* g, const VmkvBf16Linear* w, const bf16* a,
                     int64_t lda, int64_t m, void* out, int64_t ldo, int out_bf16) {
  return linear_entry(g, w, a, lda, m, out, ldo, out_bf16 != 0);
}

// x [t, hidden] (read), cos/signed_sin [t, head_dim] bf16; writes h [t, hidden] (scratch) and
// qkv [t, (Hq + 2 Hkv) * D] with RoPE applied to its q and k heads.
int vmkv_bf16_attn_in(const VmkvBf16Shape* s, const VmkvBf16Layer* w, const bf16* x, int64_t t,
                      const bf16* cos, const bf16* ssin, bf16* h, bf16* qkv) {
  return attn_in(s, w, x, t, cos, ssin, h, qkv);
}

// x [t, hidden] updated in place by the attention output attn [t, Hq * D] (row stride
// attn_stride) and the MLP; h [t, hidden] and act [t, intermediate] are scratch.
int vmkv_bf16_attn_out(const VmkvBf16Shape* s, const VmkvBf16Layer* w, bf16* x, int64_t t,
                       const bf16* attn, int64_t attn_stride, bf16* h, bf16* act) {
  return attn_out(s, w, x, t, attn, attn_stride, h, act);
}

// The same three in float32 (gemm.brgemm: the ukernel's float overload; weights packed as
// plain [K][block_n] blocks); the last argument of vmkv_f32_linear is ignored (always float32).
int vmkv_f32_linear(const VmkvBf16Gemm* g, const VmkvBf16Linear* w, const float* a,
                    int64_t lda, int64_t m, void* out, int64_t ldo, int /*out_bf16*/) {
  return linear_entry(g, w, a, lda, m, out, ldo, true);
}

int vmkv_f32_attn_in(const VmkvBf16Shape* s, const VmkvBf16Layer* w, const float* x,
                     int64_t t, const float* cos, const float* ssin, float* h, float* qkv) {
  return attn_in(s, w, x, t, cos, ssin, h, qkv);
}

int vmkv_f32_attn_out(const VmkvBf16Shape* s, const VmkvBf16Layer* w, float* x, int64_t t,
                      const float* attn, int64_t attn_stride, float* h, float* act) {
  return attn_out(s, w, x, t, attn, attn_stride, h, act);
}

}  // extern "C"
