// Linears and decoder layers on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0; and vmkv's
// U8 blocks for --quantization int8), served as the file holds them: the products are
// csrc/cpu_quant_gemm.h's integer dot products on the packed blocks with the activations
// quantised per block of 32 to int8; everything else is the fused layers' elementwise work
// (csrc/cpu_layer_ops.h), in float32 or bfloat16 activations:
//
//   vmkv_q{f32,bf16}_linear:    out = a W^T (+ b), float32 or the activations' type (LM head,
//                               any quantized linear)
//   vmkv_q{f32,bf16}_embed:     out[i] = W[ids[i]] (the tied embedding, looked up in its blocks)
//   vmkv_q{f32,bf16}_attn_in:   h = rms_norm(x) * w1;  qkv = h Wqkv^T (+ b);  RoPE on q and k
//   vmkv_q{f32,bf16}_attn_out:  x += attn Wo^T (+ b);  h = rms_norm(x) * w2;
//                               act = silu(h Wg^T) * (h Wu^T);  x += act Wdown^T (+ b)
//
// A linear is up to three segments of rows, each packed in its own format (q, k and v of one
// fused qkv projection may differ: Gemma 3's file has Q5_0 q and k with a Q8_0 v). A product runs
// over the OpenMP team by groups of 16 output rows: few activation rows (decode) split the
// groups over the threads, so each streams its share of the weight once; many (prefill) take
// row tiles of 64, each thread sweeping every group with its tile in cache. Each group's float32
// tile is finished by the layer's epilogue while in cache (bias, rounding, residual, SiLU*up).
// From vmkv_q_set_ukernel's row count on (prefill, wide batches), a product on bf16 activations
// instead dequantizes each block of 32 output rows once into a bf16 tile in VNNI pairs
// (csrc/cpu_quant_dequant.h) and multiplies it with oneDNN's brgemm ukernel, row tile by row
// tile: the bf16 dot products' rate for the arithmetic, the file's bytes for the weight stream.
//
// Built by vmkv/kernels/cpu_quant.py like the other CPU kernels (g++ -O3 -march=native -fopenmp,
// cached, called through ctypes). Each entry point returns 0, 1 on bad arguments (nothing
// written), or 4 when the brgemm ukernel raised.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_brgemm.h"
#include "cpu_lap.h"
#include "cpu_layer_ops.h"
#include "cpu_quant_dequant.h"
#include "cpu_quant_i16_tiles.h"
#include "cpu_quant_gemm.h"
#include "cpu_vec.h"

using vmkv::bf16;

extern "C" {

// Rows of one linear packed in one format: ceil(rows / 16) groups of K / 32 records each.
struct VmkvQSegment {
  const void* packed;
  int64_t rows;
  int32_t format;  // a GGML type id: 2 Q4_0, 3 Q4_1, 6 Q5_0, 8 Q8_0; or 100 U8 (vmkv's int8)
  int32_t reserved;
};

// A quantized linear: its segments' rows in order make the N outputs; every segment but the last
// holds a multiple of 16 rows. An optional bias [N] of the activations' type.
struct VmkvQLinear {
  VmkvQSegment segments[3];
  int64_t num_segments;
  const void* bias;
  int64_t in_features, out_features;
};

struct VmkvQLayer {
  VmkvQLinear qkv, o, gate_up, down;  // gate_up: the gate's rows, then the up projection's
  const void* input_norm;             // [hidden]
  const void* post_norm;              // [hidden]
};

struct VmkvQShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
  int64_t* ns;  // nullptr, or the profiling counters {products, elementwise, attention} in ns
};

// csrc/cpu_attention.cpp's decode entry point, vmkv_cpu_decode_attention (its C ABI).
typedef int (*VmkvDecodeAttention)(int dtype, const void* q, int64_t q_stride_b,
                                   int64_t q_stride_h, const void* k, const void* v,
                                   int64_t stride_row, int64_t stride_head,
                                   const int64_t* starts, const int32_t* table,
                                   int64_t table_stride, int64_t block_size,
                                   const int32_t* seq_lens, int64_t batch, int64_t heads,
                                   int64_t kv_heads, int64_t dim, float scale, void* out,
                                   int64_t out_stride_b, int64_t out_stride_h, const void* k_new,
                                   int64_t k_new_stride_b, int64_t k_new_stride_h,
                                   const void* v_new, int64_t v_new_stride_b,
                                   int64_t v_new_stride_h, int64_t window);

// A pure-decode step's attention, the same for every layer but the cache rows: the decode kernel
// stores each request's new K/V row at its token seq_lens[b] - 1 and attends (one call a layer).
struct VmkvQDecode {
  VmkvDecodeAttention attention;
  int64_t dtype;                  // the kernel's element type code (0 float32, 2 bfloat16)
  const void* const* k;           // [layers] each layer's flat K rows [rows, kv_heads, D]
  const void* const* v;           // [layers] its V rows
  const int64_t* windows;         // [layers] sliding window in tokens (0: none)
  int64_t stride_row, stride_head;
  const int64_t* starts;          // virtual mode: [batch] first row of each request, or nullptr
  const int32_t* table;           // paged mode: [batch, table_stride] block table, or nullptr
  int64_t table_stride, block_size;
  const int32_t* seq_lens;        // [batch] cached tokens + the new one
  float scale;
};

}  // extern "C"

namespace {

using namespace vmkv;
using quant::kBlock;
using quant::kGroup;
using quant::QActs;

constexpr int kAttentionPart = 2;   // the profiling counter of decode_layers' attention calls
constexpr int64_t kSmallRows = 64;  // up to this many rows: the groups split over the threads
constexpr int64_t kTileRows = 64;   // rows per tile beyond it (prefill), integer products

// Group g of w: its first record, format, first output column and live columns.
struct GroupRef {
  const uint8_t* rec;
  int32_t format;
  int64_t n0, cols;
};

int64_t segment_groups(const VmkvQSegment& s) { return (s.rows + kGroup - 1) / kGroup; }

int64_t num_groups(const VmkvQLinear& w) {
  int64_t g = 0;
  for (int64_t i = 0; i < w.num_segments; ++i) g += segment_groups(w.segments[i]);
  return g;
}

GroupRef group_ref(const VmkvQLinear& w, int64_t g) {
  int64_t n0 = 0;
  for (int64_t i = 0;; ++i) {
    const VmkvQSegment& s = w.segments[i];
    const int64_t groups = segment_groups(s);
    if (g < groups || i + 1 == w.num_segments) {
      const int64_t record = quant::record_bytes(s.format);
      return {static_cast<const uint8_t*>(s.packed) + g * (w.in_features / kBlock) * record,
              s.format, n0 + g * kGroup, std::min(kGroup, s.rows - g * kGroup)};
    }
    g -= groups;
    n0 += s.rows;
  }
}

bool bad_linear(const VmkvQLinear& w, int64_t in, int64_t out) {
  if (w.in_features != in || w.out_features != out || in <= 0 || in % kBlock != 0 ||
      w.num_segments < 1 || w.num_segments > 3) {
    return true;
  }
  int64_t rows = 0;
  for (int64_t i = 0; i < w.num_segments; ++i) {
    const VmkvQSegment& s = w.segments[i];
    if (s.packed == nullptr || s.rows <= 0 || quant::record_bytes(s.format) == 0 ||
        (i + 1 < w.num_segments && s.rows % kGroup != 0)) {
      return true;
    }
    rows += s.rows;
  }
  return rows != out;
}

// The calling thread's buffer for quantised activations (grown, never shrunk), with int16
// codes or not.
QActs quantized(int64_t m, int64_t k, bool with_codes) {
  thread_local std::vector<char> buffer;
  const size_t need = static_cast<size_t>(quant::qacts_bytes(m, k, with_codes)) + 64;
  if (buffer.size() < need) buffer.resize(need);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  return quant::qacts_in(aligned, m, k, with_codes);
}

// x [m, k] (row stride ldx) quantised into the calling thread's buffer.
template <typename T>
QActs quantize(const T* x, int64_t ldx, int64_t m, int64_t k, bool with_codes = false) {
  const QActs a = quantized(m, k, with_codes);
#pragma omp parallel for schedule(static) if (m >= kParallelRows)
  for (int64_t r = 0; r < m; ++r) quant::quantize_rows(x, ldx, r, r + 1, a);
  return a;
}

// Runs task(m0, rows, group, c) for every (row tile, group) of an m-row product over the OpenMP
// team, c a float32 scratch tile [tile rows][16]. Few rows: one tile, groups split over the
// threads (each streams a contiguous share of the weight); many: tiles of at most Rows::kTileMax
// rows, a multiple of Rows::kRowStep each (the last one apart), each thread's tasks tile by tile.
template <typename Rows, typename Task>
void for_each_group(int64_t m, int64_t groups, Task&& task) {
  const int64_t tiles = m > kSmallRows ? (m + Rows::kTileMax - 1) / Rows::kTileMax : 1;
  const int64_t even = (m + tiles - 1) / tiles, step = Rows::kRowStep;
  const int64_t tile_rows = (even + step - 1) / step * step;
  const int64_t tasks = tiles * groups;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> scratch(static_cast<size_t>(2 * tile_rows * kGroup));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t m0 = (t / groups) * tile_rows;
      if (m0 < m) task(m0, std::min(tile_rows, m - m0), t % groups, scratch.data());
    }
  }
}

enum class Store { kRounded, kResidual, kFloat };

// out [rows, N] (row stride ldo), columns n0 .. n0 + cols, from their float32 products
// c [rows, ldc] (+ bias), stored by S.
template <Store S, typename T, typename Out>
void store_rows(const float* c, int64_t ldc, int64_t rows, const T* bias, int64_t n0, int64_t cols,
                Out* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * ldc;
    Out* o = out + r * ldo + n0;
    if constexpr (S == Store::kRounded) {
      store_rounded(cr, bias, n0, cols, o);
    } else if constexpr (S == Store::kResidual) {
      add_rounded(cr, bias, n0, cols, o);
    } else {
      for (int64_t i = 0; i < cols; ++i) o[i] = cr[i] + bias_at(bias, n0 + i);
    }
  }
}

// The ukernel for many bf16 rows (vmkv_q_set_ukernel; none: the integer products serve every
// row count).
struct Ukernel {
  VmkvBrgemm brgemm = nullptr;  // its BFloat16 overload (B in VNNI pairs)
  VmkvBrgemmRelease release = nullptr;
  int64_t min_rows = 0;         // products of at least this many rows take the tiles
};
Ukernel g_ukernel;

constexpr int64_t kTileCols = 2 * kGroup;  // outputs per dequantized tile
constexpr int64_t kUkRows = 256;           // rows per ukernel call

// Whether an m-row product on T activations takes the dequantized tiles.
template <typename T>
bool tiled(int64_t m) {
#if defined(VMKV_QUANT_TILES)
  return std::is_same_v<T, bf16> && g_ukernel.brgemm != nullptr && g_ukernel.min_rows > 0 &&
         m >= g_ukernel.min_rows;
#else
  return false;
#endif
}

#if defined(VMKV_QUANT_TILES)
// Block j of w (outputs 32 j .. 32 j + 32, its first output returned) dequantized into tile
// [K / 2, 32, 2]; columns past the weight's last row are zero.
int64_t dequant_block(const VmkvQLinear& w, int64_t j, bf16* tile) {
  const int64_t nb = w.in_features / kBlock, groups = num_groups(w), per = kTileCols / kGroup;
  const int64_t n0 = group_ref(w, per * j).n0;
  if (n0 + kTileCols > w.out_features) {
    std::memset(tile, 0, sizeof(bf16) * w.in_features * kTileCols);
  }
  for (int64_t i = 0; i < per && per * j + i < groups; ++i) {
    const GroupRef ref = group_ref(w, per * j + i);
    quant::dequant_group(ref.format, ref.rec, nb, tile, kTileCols, i * kGroup);
  }
  return n0;
}

// c [rows, 32] = a [rows, K] (row stride lda) times a dequantized tile.
void tile_product(const bf16* a, int64_t lda, int64_t rows, int64_t k, const bf16* tile,
                  float* c) {
  g_ukernel.brgemm(rows, kTileCols, k, lda, kTileCols, kTileCols, false, a, tile, c, true);
}

// Runs task(j, tiles, c) for every block j < blocks over the OpenMP team: `tiles` holds `per`
// tiles of [K / 2, 32, 2] bf16, c a float32 scratch [kUkRows, 32] per tile. False when the
// ukernel raised (its errors are C++ exceptions, which must not cross the OpenMP region or the
// C ABI).
template <typename Task>
bool for_each_block(int64_t blocks, int64_t k, int per, Task&& task) {
  std::atomic<bool> failed{false};
#pragma omp parallel if (blocks > 1)
  {
    std::vector<bf16> tiles(static_cast<size_t>(per * k * kTileCols));
    std::vector<float> c(static_cast<size_t>(per * kUkRows * kTileCols));
#pragma omp for schedule(static)
    for (int64_t j = 0; j < blocks; ++j) {
      try {
        task(j, tiles.data(), c.data());
      } catch (...) {
        failed = true;
      }
    }
    try {
      g_ukernel.release(true);
    } catch (...) {
      failed = true;
    }
  }
  return !failed;
}

// out [m, N] = x [m, K] (row stride ldx) w^T on dequantized tiles, each tile row stored by S.
template <Store S, typename Out>
bool tiled_linear(const VmkvQLinear& w, const bf16* x, int64_t ldx, int64_t m, Out* out,
                  int64_t ldo) {
  const bf16* bias = static_cast<const bf16*>(w.bias);
  const int64_t k = w.in_features, blocks = (w.out_features + kTileCols - 1) / kTileCols;
  return for_each_block(blocks, k, 1, [&](int64_t j, bf16* tile, float* c) {
    const int64_t n0 = dequant_block(w, j, tile), cols = std::min(kTileCols, w.out_features - n0);
    for (int64_t m0 = 0; m0 < m; m0 += kUkRows) {
      const int64_t rows = std::min(kUkRows, m - m0);
      tile_product(x + m0 * ldx, ldx, rows, k, tile, c);
      store_rows<S>(c, kTileCols, rows, bias, n0, cols, out + m0 * ldo, ldo);
    }
  });
}

// act [m, I] = silu(h Wg^T) * (h Wu^T) on dequantized tiles (gate block j with up block
// j + I / 32; I a multiple of 32).
bool tiled_gate_up(const VmkvQLinear& w, const bf16* h, int64_t m, int64_t inter, bf16* act) {
  const bf16* bias = static_cast<const bf16*>(w.bias);
  const bf16* bias_up = bias != nullptr ? bias + inter : nullptr;
  const int64_t k = w.in_features, pairs = inter / kTileCols;
  return for_each_block(pairs, k, 2, [&](int64_t j, bf16* tiles, float* c) {
    bf16* up_tile = tiles + k * kTileCols;
    float* up = c + kUkRows * kTileCols;
    dequant_block(w, j, tiles);
    dequant_block(w, pairs + j, up_tile);
    for (int64_t m0 = 0; m0 < m; m0 += kUkRows) {
      const int64_t rows = std::min(kUkRows, m - m0);
      tile_product(h + m0 * k, k, rows, k, tiles, c);
      tile_product(h + m0 * k, k, rows, k, up_tile, up);
      for (int64_t r = 0; r < rows; ++r) {
        silu_mul_rounded(c + r * kTileCols, up + r * kTileCols, bias, bias_up, j * kTileCols,
                         kTileCols, act + (m0 + r) * inter + j * kTileCols);
      }
    }
  });
}
#endif

// c [rows, 16] = activation rows m0 .. m0 + rows times one group: integer products on the
// activations quantised per block.
struct IntegerRows {
  static constexpr int64_t kTileMax = kTileRows, kRowStep = 1;
  QActs a;
  int64_t nb;  // records per group
  void operator()(const GroupRef& ref, int64_t m0, int64_t rows, float* c) const {
    quant::group_product(ref.format, ref.rec, nb, a, m0, rows, c, kGroup);
  }
};

#if defined(VMKV_QUANT_I16_TILES)
// Products of at least this many rows take the int16 tiles (0: none; vmkv_q_set_i16_tiles).
int64_t g_i16_tile_rows = 0;

// The same products, bit for bit, on int16 tiles (csrc/cpu_quant_i16_tiles.h): the group widened
// once into the calling thread's tile, times the activations' int16 codes (a.codes).
// Prefill's row tiles are 20 passes of kI16Pass rows: the group is widened once per 120 rows.
struct I16Rows {
  static constexpr int64_t kTileMax = 20 * quant::kI16Pass, kRowStep = quant::kI16Pass;
  QActs a;
  void operator()(const GroupRef& ref, int64_t m0, int64_t rows, float* c) const {
    const int64_t k = a.k, nb = k / kBlock;
    thread_local std::vector<int16_t> tile_codes;
    thread_local std::vector<float> scales;  // d [nb][16], then m [nb][16]
    thread_local std::vector<int32_t> sums;  // [nb][kI16Pass][16]
    tile_codes.resize(std::max(tile_codes.size(), static_cast<size_t>(k * kGroup)));
    scales.resize(std::max(scales.size(), static_cast<size_t>(2 * nb * kGroup)));
    sums.resize(std::max(sums.size(), static_cast<size_t>(nb * quant::kI16Pass * kGroup)));
    const quant::I16Tile tile{tile_codes.data(), scales.data(), scales.data() + nb * kGroup};
    quant::widen_group(ref.format, ref.rec, nb, tile);
    quant::tile_product_i16(ref.format, a, m0, rows, tile, sums.data(), c);
  }
};
#endif

// out[m, N] (row stride ldo) = the activations times w^T, group by group through group_rows
// (IntegerRows or I16Rows), each tile row stored by S.
template <Store S, typename T, typename Out, typename Rows>
void linear(const VmkvQLinear& w, const Rows& group_rows, int64_t m, Out* out, int64_t ldo) {
  const T* bias = static_cast<const T*>(w.bias);
  for_each_group<Rows>(m, num_groups(w), [&](int64_t m0, int64_t rows, int64_t g, float* c) {
    const GroupRef ref = group_ref(w, g);
    group_rows(ref, m0, rows, c);
    store_rows<S>(c, kGroup, rows, bias, ref.n0, ref.cols, out + m0 * ldo, ldo);
  });
}

// act[m, I] = silu(h Wg^T) * (h Wu^T), rounded as transformers does: gate group j and up group
// j + I / 16 in one task.
template <typename T, typename Rows>
void gate_up_act(const VmkvQLinear& w, const Rows& group_rows, int64_t m, int64_t inter, T* act) {
  const int64_t pairs = inter / kGroup;
  const T* bias = static_cast<const T*>(w.bias);
  const T* bias_up = bias != nullptr ? bias + inter : nullptr;
  for_each_group<Rows>(m, pairs, [&](int64_t m0, int64_t rows, int64_t j, float* c) {
    float* up = c + rows * kGroup;
    group_rows(group_ref(w, j), m0, rows, c);
    group_rows(group_ref(w, pairs + j), m0, rows, up);
    for (int64_t r = 0; r < rows; ++r) {
      silu_mul_rounded(c + r * kGroup, up + r * kGroup, bias, bias_up, j * kGroup, kGroup,
                       act + (m0 + r) * inter + j * kGroup);
    }
  });
}

// fn(group_rows) with the group products for x [m, k] (row stride ldx) quantised per block:
// the int16 tiles from vmkv_q_set_i16_tiles' row count on (AVX2 builds), else the integer
// products (the same results).
template <typename T, typename Fn>
void with_group_rows(const T* x, int64_t ldx, int64_t m, int64_t k, Fn&& fn) {
#if defined(VMKV_QUANT_I16_TILES)
  if (g_i16_tile_rows > 0 && m >= g_i16_tile_rows) {
    fn(I16Rows{quantize(x, ldx, m, k, true)});
    return;
  }
#endif
  fn(IntegerRows{quantize(x, ldx, m, k), k / kBlock});
}

// out [m, N] = x [m, K] (row stride ldx) w^T: dequantized bf16 tiles from the ukernel's row
// count on, else with_group_rows' products. False when the ukernel raised.
template <Store S, typename T, typename Out>
bool product(const VmkvQLinear& w, const T* x, int64_t ldx, int64_t m, Out* out, int64_t ldo) {
#if defined(VMKV_QUANT_TILES)
  if constexpr (std::is_same_v<T, bf16>) {
    if (tiled<T>(m)) return tiled_linear<S>(w, x, ldx, m, out, ldo);
  }
#endif
  with_group_rows(x, ldx, m, w.in_features,
                  [&](const auto& rows) { linear<S, T>(w, rows, m, out, ldo); });
  return true;
}

// act [m, I] = silu(h Wg^T) * (h Wu^T), h [m, K] dense; the same choice as product.
template <typename T>
bool gate_up_product(const VmkvQLinear& w, const T* h, int64_t m, int64_t inter, T* act) {
#if defined(VMKV_QUANT_TILES)
  if constexpr (std::is_same_v<T, bf16>) {
    if (tiled<T>(m) && inter % kTileCols == 0) return tiled_gate_up(w, h, m, inter, act);
  }
#endif
  with_group_rows(h, w.in_features, m, w.in_features,
                  [&](const auto& rows) { gate_up_act(w, rows, m, inter, act); });
  return true;
}

constexpr int kUkernelFailed = 4;  // the entry points' code when the ukernel raised

bool bad_layer(const VmkvQShape* s, const VmkvQLayer* w, int64_t t) {
  if (s == nullptr || w == nullptr || t < 0 || s->head_dim % 2 != 0 ||
      s->intermediate % kGroup != 0) {
    return true;
  }
  const int64_t q = s->num_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
  return bad_linear(w->qkv, s->hidden, q + 2 * kv) || bad_linear(w->o, q, s->hidden) ||
         bad_linear(w->gate_up, s->hidden, 2 * s->intermediate) ||
         bad_linear(w->down, s->intermediate, s->hidden);
}

template <typename T>
int linear_entry(const VmkvQLinear* w, const T* a, int64_t lda, int64_t m, void* out,
                 int64_t ldo, bool rounded, int64_t* ns) {
  if (w == nullptr || bad_linear(*w, w->in_features, w->out_features) || m < 0 ||
      lda < w->in_features || ldo < w->out_features) {
    return 1;
  }
  if (m == 0) return 0;
  Lap lap(ns);
  const bool ok = rounded ? product<Store::kRounded>(*w, a, lda, m, static_cast<T*>(out), ldo)
                          : product<Store::kFloat>(*w, a, lda, m, static_cast<float*>(out), ldo);
  lap(kGemmPart);
  return ok ? 0 : kUkernelFailed;
}

template <typename T>
int embed_entry(const VmkvQLinear* w, const int64_t* ids, int64_t t, T* out) {
  if (w == nullptr || w->num_segments != 1 || bad_linear(*w, w->in_features, w->out_features) ||
      t < 0 || (t > 0 && (ids == nullptr || out == nullptr))) {
    return 1;
  }
  for (int64_t i = 0; i < t; ++i) {
    if (ids[i] < 0 || ids[i] >= w->out_features) return 1;
  }
  const VmkvQSegment& s = w->segments[0];
  const int64_t nb = w->in_features / kBlock, record = quant::record_bytes(s.format);
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t i = 0; i < t; ++i) {
    const int64_t g = ids[i] / kGroup, n = ids[i] % kGroup;
    const uint8_t* rec = static_cast<const uint8_t*>(s.packed) + g * nb * record;
    for (int64_t b = 0; b < nb; ++b, rec += record) {
      for (int64_t e = 0; e < kBlock; ++e) {
        out[i * w->in_features + b * kBlock + e] =
            from_float<T>(quant::weight_at(s.format, rec, n, e));
      }
    }
  }
  return 0;
}

template <typename T>
int attn_in(const VmkvQShape* s, const VmkvQLayer* w, const T* x, int64_t t, const T* cos,
            const T* ssin, T* h, T* qkv) {
  if (bad_layer(s, w, t)) return 1;
  if (t == 0) return 0;
  const int64_t width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
  Lap lap(s->ns);
  rms_norm(x, static_cast<const T*>(w->input_norm), t, s->hidden, s->eps, h);
  lap(kElementwisePart);
  if (!product<Store::kRounded>(w->qkv, h, s->hidden, t, qkv, width)) return kUkernelFailed;
  lap(kGemmPart);
  rope(qkv, t, width, cos, ssin, s->num_heads + s->num_kv_heads, s->head_dim);
  lap(kElementwisePart);
  return 0;
}

template <typename T>
int attn_out(const VmkvQShape* s, const VmkvQLayer* w, T* x, int64_t t, const T* attn,
             int64_t attn_stride, T* h, T* act) {
  const int64_t q = s != nullptr ? s->num_heads * s->head_dim : 0;
  if (bad_layer(s, w, t) || attn_stride < q) return 1;
  if (t == 0) return 0;
  const int64_t hidden = s->hidden, inter = s->intermediate;
  Lap lap(s->ns);
  if (!product<Store::kResidual>(w->o, attn, attn_stride, t, x, hidden)) return kUkernelFailed;
  lap(kGemmPart);
  rms_norm(x, static_cast<const T*>(w->post_norm), t, hidden, s->eps, h);
  lap(kElementwisePart);
  if (!gate_up_product(w->gate_up, h, t, inter, act) ||
      !product<Store::kResidual>(w->down, act, inter, t, x, hidden)) {
    return kUkernelFailed;
  }
  lap(kGemmPart);
  return 0;
}

// Every layer of a pure-decode step (t requests, one token each): attn_in, the decode kernel
// through d, attn_out, layer after layer, with no return to Python.
template <typename T>
int decode_layers(const VmkvQShape* s, const VmkvQLayer* layers, int64_t num_layers, T* x,
                  int64_t t, const T* cos, const T* ssin, T* h, T* qkv, T* attn, T* act,
                  const VmkvQDecode* d) {
  if (s == nullptr || layers == nullptr || d == nullptr || d->attention == nullptr ||
      num_layers < 1) {
    return 1;
  }
  const int64_t hq = s->num_heads, hkv = s->num_kv_heads, dim = s->head_dim;
  const int64_t width = (hq + 2 * hkv) * dim;
  for (int64_t l = 0; l < num_layers; ++l) {
    if (int err = attn_in(s, layers + l, x, t, cos, ssin, h, qkv)) return err;
    if (t > 0) {
      Lap lap(s->ns);
      const int err = d->attention(
          static_cast<int>(d->dtype), qkv, width, dim, d->k[l], d->v[l], d->stride_row,
          d->stride_head, d->starts, d->table, d->table_stride, d->block_size, d->seq_lens, t,
          hq, hkv, dim, d->scale, attn, hq * dim, dim, qkv + hq * dim, width, dim,
          qkv + (hq + hkv) * dim, width, dim, d->windows != nullptr ? d->windows[l] : 0);
      lap(kAttentionPart);
      if (err) return 3;
    }
    if (int err = attn_out(s, layers + l, x, t, attn, hq * dim, h, act)) return err;
  }
  return 0;
}

}  // namespace

extern "C" {

// Which code path this build runs: "avx512-vnni", "avx2" or "portable".
const char* vmkv_q_path() { return VMKV_QUANT_PATH; }

// Products on bfloat16 activations of at least min_rows rows (0: none) take dequantized tiles
// and oneDNN's brgemm ukernel (brgemm: its BFloat16 overload). Returns 1 where this build has no
// tiles (not AVX512-BF16; nothing set), else 0. Set before products run, not during them.
int vmkv_q_set_ukernel(VmkvBrgemm brgemm, VmkvBrgemmRelease release, int64_t min_rows) {
#if defined(VMKV_QUANT_TILES)
  g_ukernel = {brgemm, release, brgemm != nullptr && release != nullptr ? min_rows : 0};
  return 0;
#else
  (void)brgemm, (void)release, (void)min_rows;
  return 1;
#endif
}

// Products of at least min_rows rows (0: none) take the int16 tiles (the same results). Returns
// 1 where this build has none (not an AVX2 build without AVX-512; nothing set), else 0. Set
// before products run, not during them.
int vmkv_q_set_i16_tiles(int64_t min_rows) {
#if defined(VMKV_QUANT_I16_TILES)
  g_i16_tile_rows = std::max<int64_t>(min_rows, 0);
  return 0;
#else
  (void)min_rows;
  return 1;
#endif
}

// out [m, N] (row stride ldo) = a [m, K] (row stride lda) W^T (+ b): float32 when out_rounded is
// 0, else the activations' type (rounded once). ns: nullptr or the profiling counters.
int vmkv_qf32_linear(const VmkvQLinear* w, const float* a, int64_t lda, int64_t m, void* out,
                     int64_t ldo, int out_rounded, int64_t* ns) {
  return linear_entry(w, a, lda, m, out, ldo, out_rounded != 0, ns);
}

int vmkv_qbf16_linear(const VmkvQLinear* w, const bf16* a, int64_t lda, int64_t m, void* out,
                      int64_t ldo, int out_rounded, int64_t* ns) {
  return linear_entry(w, a, lda, m, out, ldo, out_rounded != 0, ns);
}

// out [t, K] = the rows ids [t] of a one-segment linear's weight (an embedding table [V, K]).
int vmkv_qf32_embed(const VmkvQLinear* w, const int64_t* ids, int64_t t, float* out) {
  return embed_entry(w, ids, t, out);
}

int vmkv_qbf16_embed(const VmkvQLinear* w, const int64_t* ids, int64_t t, bf16* out) {
  return embed_entry(w, ids, t, out);
}

// x [t, hidden] (read), cos/signed_sin [t, head_dim]; writes h [t, hidden] (scratch) and
// qkv [t, (Hq + 2 Hkv) * D] with RoPE applied to its q and k heads.
int vmkv_qf32_attn_in(const VmkvQShape* s, const VmkvQLayer* w, const float* x, int64_t t,
                      const float* cos, const float* ssin, float* h, float* qkv) {
  return attn_in(s, w, x, t, cos, ssin, h, qkv);
}

int vmkv_qbf16_attn_in(const VmkvQShape* s, const VmkvQLayer* w, const bf16* x, int64_t t,
                       const bf16* cos, const bf16* ssin, bf16* h, bf16* qkv) {
  return attn_in(s, w, x, t, cos, ssin, h, qkv);
}

// x [t, hidden] updated in place by the attention output attn [t, Hq * D] (row stride
// attn_stride) and the MLP; h [t, hidden] and act [t, intermediate] are scratch.
int vmkv_qf32_attn_out(const VmkvQShape* s, const VmkvQLayer* w, float* x, int64_t t,
                       const float* attn, int64_t attn_stride, float* h, float* act) {
  return attn_out(s, w, x, t, attn, attn_stride, h, act);
}

int vmkv_qbf16_attn_out(const VmkvQShape* s, const VmkvQLayer* w, bf16* x, int64_t t,
                        const bf16* attn, int64_t attn_stride, bf16* h, bf16* act) {
  return attn_out(s, w, x, t, attn, attn_stride, h, act);
}

// A pure-decode step's decoder stack in one call (decode_layers above): x [t, hidden] (the
// embedded tokens, updated in place to the last layer's output), cos/signed_sin [t, head_dim],
// scratch h, qkv, attn [t, Hq * D] and act. Returns 0, 1 on bad arguments, 3 when the attention
// kernel refused its arguments, 4 when the ukernel raised.
int vmkv_qf32_decode_layers(const VmkvQShape* s, const VmkvQLayer* layers, int64_t num_layers,
                            float* x, int64_t t, const float* cos, const float* ssin, float* h,
                            float* qkv, float* attn, float* act, const VmkvQDecode* d) {
  return decode_layers(s, layers, num_layers, x, t, cos, ssin, h, qkv, attn, act, d);
}

int vmkv_qbf16_decode_layers(const VmkvQShape* s, const VmkvQLayer* layers, int64_t num_layers,
                             bf16* x, int64_t t, const bf16* cos, const bf16* ssin, bf16* h,
                             bf16* qkv, bf16* attn, bf16* act, const VmkvQDecode* d) {
  return decode_layers(s, layers, num_layers, x, t, cos, ssin, h, qkv, attn, act, d);
}

}  // extern "C"
