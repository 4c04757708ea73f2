// Twin decode-attention kernels in the style of the original PagedAttention (vLLM v1/v2)
// kernel, templated on PAGED: the only difference between the twins is how a token's K/V row
// is found.
//
//   contiguous (virtual mode)  K: [num_slots, slot_tokens, kv_heads, head_size] strided view
//       row(seq, t) = slot_ids[seq] * stride_outer + t * stride_tok
//   paged (block table)        K: [num_blocks, block_size, kv_heads, head_size]
//       row(seq, t) = block_table[seq][t / block_size] * stride_outer
//                     + (t % block_size) * stride_tok
//
// Grid (num_heads, num_seqs, num_partitions), 128 threads: a block handles one query head over
// one PARTITION_SIZE-token partition of one sequence. A thread group of 2 threads computes one
// query-key dot (16-byte vector loads), so a warp covers a 16-token tile; warps walk the tiles.
// Logits live in shared memory, the softmax is block-wide, and for the values each lane of a
// warp owns head_size / 32 dimensions while warps walk the same tiles. With more than one
// partition a second kernel merges the partial results (PagedAttention v2's reduce).
//
// Invariants: all offsets are int64 (slot_id * slot stride exceeds 2^31 elements on a large
// virtual reservation); nothing at or past seq_lens[seq] is read, neither K/V rows nor block
// table entries. No ATen/c10 headers: this file compiles with nvcc alone, and the C entry
// point takes raw pointers, int64 strides and the stream as an integer.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <initializer_list>

namespace vmkv {

constexpr int WARP_SIZE = 32;
constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
constexpr int PARTITION_SIZE = 512;
constexpr int THREAD_GROUP_SIZE = 2;  // threads per query-key dot
constexpr int TILE_TOKENS = WARP_SIZE / THREAD_GROUP_SIZE;  // tokens a warp covers per step
constexpr unsigned FULL_MASK = 0xffffffffu;

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct DecodeParams {
  void* out;               // [num_seqs, num_heads, head_size] (strided)
  const void* q;           // [num_seqs, num_heads, head_size] (strided)
  const void* k;           // contiguous: [slots, slot_tokens, kv_heads, D]; paged: [blocks, bs, ..]
  const void* v;
  const int32_t* index;    // contiguous: slot_ids [num_seqs]; paged: block_table [num_seqs, ..]
  const int32_t* seq_lens; // [num_seqs]
  float* tmp_out;          // [num_seqs, num_heads, num_partitions, head_size] (partitions > 1)
  float* exp_sums;         // [num_seqs, num_heads, num_partitions]
  float* max_logits;       // [num_seqs, num_heads, num_partitions]
  int num_seqs, num_heads, num_kv_heads, num_partitions, block_size;
  float scale;
  int64_t q_stride_seq, q_stride_head, o_stride_seq, o_stride_head;
  int64_t k_stride_outer, k_stride_tok, k_stride_head;
  int64_t v_stride_outer, v_stride_tok, v_stride_head;
  int64_t index_stride;    // block_table row stride (paged)
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N scalars read with one aligned access
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T val[N]; };

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

// Element offset of token t's row: the whole difference between the twins.
template <bool PAGED>
__device__ __forceinline__ int64_t token_row(const int32_t* __restrict__ table_row, int64_t slot,
                                             int t, int block_size, int64_t stride_outer,
                                             int64_t stride_tok) {
  if constexpr (PAGED) {
    const int64_t block = table_row[t / block_size];
    return block * stride_outer + static_cast<int64_t>(t % block_size) * stride_tok;
  } else {
    return slot * stride_outer + static_cast<int64_t>(t) * stride_tok;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2)
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, mask));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) x += __shfl_xor_sync(FULL_MASK, x, mask);
  return x;
}

template <typename T, int HEAD_SIZE, bool PAGED>
__global__ void __launch_bounds__(NUM_THREADS) decode_partition_kernel(const DecodeParams p) {
  constexpr int QK_VEC = 16 / sizeof(T);  // 16-byte loads in the dot
  constexpr int QK_STRIDE = THREAD_GROUP_SIZE * QK_VEC;
  constexpr int V_VEC = HEAD_SIZE / WARP_SIZE;  // dims a lane owns in the value pass
  constexpr int V_LOAD = V_VEC < QK_VEC ? V_VEC : QK_VEC;  // at most 16 bytes per access
  static_assert(HEAD_SIZE % QK_STRIDE == 0 && HEAD_SIZE % WARP_SIZE == 0, "bad head size");

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / WARP_SIZE;
  const int lane = tid % WARP_SIZE;
  const int seq_len = p.seq_lens[seq];
  const int start = part * PARTITION_SIZE;
  const int64_t out_row = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions +
                          part;  // row of tmp_out / exp_sums / max_logits
  if (start >= seq_len) {
    if (seq_len <= 0 && part == 0 && p.num_partitions == 1) {  // empty sequence: zeros
      T* out = static_cast<T*>(p.out) + seq * p.o_stride_seq + head * p.o_stride_head;
      for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) out[d] = from_float<T>(0.f);
    }
    return;
  }
  const int n = min(PARTITION_SIZE, seq_len - start);
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  __shared__ float q_s[HEAD_SIZE];
  __shared__ float logits[PARTITION_SIZE];
  __shared__ float red_max[NUM_WARPS];
  __shared__ float red_sum[NUM_WARPS];
  __shared__ float out_s[NUM_WARPS][HEAD_SIZE];

  const T* q = static_cast<const T*>(p.q) + seq * p.q_stride_seq + head * p.q_stride_head;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) q_s[d] = to_float(q[d]) * p.scale;

  const int32_t* table_row = PAGED ? p.index + seq * p.index_stride : nullptr;
  const int64_t slot = PAGED ? 0 : static_cast<int64_t>(p.index[seq]);
  const T* k_base = static_cast<const T*>(p.k) + kv_head * p.k_stride_head;
  const T* v_base = static_cast<const T*>(p.v) + kv_head * p.v_stride_head;
  const int num_tiles = (n + TILE_TOKENS - 1) / TILE_TOKENS;
  __syncthreads();

  // 1) logits: thread group (2 lanes) per token, warps walking 16-token tiles
  const int group_lane = lane % THREAD_GROUP_SIZE;
  float qk_max = -FLT_MAX;
  for (int tile = warp; tile < num_tiles; tile += NUM_WARPS) {
    const int i = tile * TILE_TOKENS + lane / THREAD_GROUP_SIZE;  // token within the partition
    float dot = 0.f;
    if (i < n) {
      const T* k_row = k_base + token_row<PAGED>(table_row, slot, start + i, p.block_size,
                                                 p.k_stride_outer, p.k_stride_tok);
#pragma unroll
      for (int d = group_lane * QK_VEC; d < HEAD_SIZE; d += QK_STRIDE) {
        const Vec<T, QK_VEC> kv = load_vec<T, QK_VEC>(k_row + d);
#pragma unroll
        for (int j = 0; j < QK_VEC; ++j) dot += q_s[d + j] * to_float(kv.val[j]);
      }
    }
#pragma unroll
    for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2)
      dot += __shfl_xor_sync(FULL_MASK, dot, mask);
    if (i < n && group_lane == 0) {
      logits[i] = dot;
      qk_max = fmaxf(qk_max, dot);
    }
  }

  // 2) softmax over the partition (block-wide max and sum)
  qk_max = warp_max(qk_max);
  if (lane == 0) red_max[warp] = qk_max;
  __syncthreads();
  qk_max = red_max[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) qk_max = fmaxf(qk_max, red_max[w]);
  float exp_sum = 0.f;
  for (int i = tid; i < n; i += NUM_THREADS) {
    const float e = expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = warp_sum(exp_sum);
  if (lane == 0) red_sum[warp] = exp_sum;
  __syncthreads();  // also publishes logits[] to every warp
  exp_sum = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) exp_sum += red_sum[w];

  // 3) values: lane owns V_VEC dims, warps walk the same tiles
  float acc[V_VEC];
#pragma unroll
  for (int j = 0; j < V_VEC; ++j) acc[j] = 0.f;
  for (int tile = warp; tile < num_tiles; tile += NUM_WARPS) {
    const int last = min(TILE_TOKENS, n - tile * TILE_TOKENS);
    for (int j = 0; j < last; ++j) {
      const int i = tile * TILE_TOKENS + j;
      const T* v_row = v_base + token_row<PAGED>(table_row, slot, start + i, p.block_size,
                                                 p.v_stride_outer, p.v_stride_tok);
      const float w = logits[i];
#pragma unroll
      for (int c = 0; c < V_VEC; c += V_LOAD) {
        const Vec<T, V_LOAD> vv = load_vec<T, V_LOAD>(v_row + lane * V_VEC + c);
#pragma unroll
        for (int e = 0; e < V_LOAD; ++e) acc[c + e] += w * to_float(vv.val[e]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V_VEC; ++j) out_s[warp][lane * V_VEC + j] = acc[j];
  __syncthreads();

  const float inv_sum = 1.f / exp_sum;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) o += out_s[w][d];
    o *= inv_sum;
    if (p.num_partitions == 1) {
      T* out = static_cast<T*>(p.out) + seq * p.o_stride_seq + head * p.o_stride_head;
      out[d] = from_float<T>(o);
    } else {
      p.tmp_out[out_row * HEAD_SIZE + d] = o;
    }
  }
  if (p.num_partitions > 1 && tid == 0) {
    p.exp_sums[out_row] = exp_sum;
    p.max_logits[out_row] = qk_max;
  }
}

// PagedAttention v2's reduce: rescale each partition by exp(max_p - max) * sum_p.
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) merge_partitions_kernel(const DecodeParams p) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int parts = min(p.num_partitions, (seq_len + PARTITION_SIZE - 1) / PARTITION_SIZE);
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions;
  float global_max = -FLT_MAX;
  for (int i = 0; i < parts; ++i) global_max = fmaxf(global_max, p.max_logits[base + i]);
  float total = 0.f;
  for (int i = 0; i < parts; ++i)
    total += p.exp_sums[base + i] * expf(p.max_logits[base + i] - global_max);
  const float inv_total = parts > 0 ? 1.f / total : 0.f;
  T* out = static_cast<T*>(p.out) + seq * p.o_stride_seq + head * p.o_stride_head;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int i = 0; i < parts; ++i) {
      const float w = p.exp_sums[base + i] * expf(p.max_logits[base + i] - global_max);
      o += w * p.tmp_out[(base + i) * HEAD_SIZE + d];
    }
    out[d] = from_float<T>(o * inv_total);
  }
}

template <typename T, int HEAD_SIZE, bool PAGED>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_heads, p.num_seqs, p.num_partitions);
  decode_partition_kernel<T, HEAD_SIZE, PAGED><<<grid, NUM_THREADS, 0, stream>>>(p);
  if (p.num_partitions > 1) {
    merge_partitions_kernel<T, HEAD_SIZE>
        <<<dim3(p.num_heads, p.num_seqs), NUM_THREADS, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, bool PAGED>
cudaError_t dispatch_head(const DecodeParams& p, int head_size, cudaStream_t stream) {
  switch (head_size) {
    case 64: return launch<T, 64, PAGED>(p, stream);
    case 128: return launch<T, 128, PAGED>(p, stream);
    case 256: return launch<T, 256, PAGED>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_mode(const DecodeParams& p, int head_size, bool paged, cudaStream_t stream) {
  return paged ? dispatch_head<T, true>(p, head_size, stream)
               : dispatch_head<T, false>(p, head_size, stream);
}

thread_local const char* last_message = "";

bool aligned(uintptr_t ptr, int64_t bytes) { return ptr % bytes == 0; }

}  // namespace vmkv

extern "C" {

// Tokens per partition: the workspace holds ceil(max_seq_len / this) partitions.
int vmkv_decode_partition_size(void) { return vmkv::PARTITION_SIZE; }

// Message for an argument error (the last nonzero return of vmkv_decode_attention) or a CUDA
// error code.
const char* vmkv_error_string(int code) {
  return code == static_cast<int>(cudaErrorInvalidValue) && vmkv::last_message[0]
             ? vmkv::last_message
             : cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Decode attention, one query token per sequence. Returns 0 or a cudaError_t code.
//   dtype: 0 fp32, 1 fp16, 2 bf16 (q, k, v, out alike); paged: 0 slot ids, 1 block table.
//   Strides are in elements; head_size must be 64, 128 or 256 with unit stride; K/V rows and
//   head offsets must be 16-byte aligned. tmp_out/exp_sums/max_logits (fp32) are needed when
//   max_seq_len > vmkv_decode_partition_size(); every seq_lens[i] must be <= max_seq_len.
int vmkv_decode_attention(int dtype, int paged, uintptr_t out, uintptr_t q, uintptr_t k,
                          uintptr_t v, uintptr_t index, uintptr_t seq_lens, uintptr_t tmp_out,
                          uintptr_t exp_sums, uintptr_t max_logits, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                          int64_t block_size, int64_t max_seq_len, float scale,
                          int64_t q_stride_seq, int64_t q_stride_head, int64_t o_stride_seq,
                          int64_t o_stride_head, int64_t k_stride_outer, int64_t k_stride_tok,
                          int64_t k_stride_head, int64_t v_stride_outer, int64_t v_stride_tok,
                          int64_t v_stride_head, int64_t index_stride, uintptr_t stream) {
  using namespace vmkv;
  last_message = "";
  const int itemsize = dtype == kFloat32 ? 4 : 2;
  const int64_t vec = 16 / itemsize;
  auto fail = [](const char* msg) {
    last_message = msg;
    return static_cast<int>(cudaErrorInvalidValue);
  };
  if (dtype < kFloat32 || dtype > kBFloat16)
    return fail("dtype must be 0 (fp32), 1 (fp16) or 2 (bf16)");
  if (head_size != 64 && head_size != 128 && head_size != 256)
    return fail("head_size must be 64, 128 or 256");
  if (num_seqs <= 0 || num_seqs > 65535 || num_heads <= 0 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0)
    return fail("need 0 < num_seqs <= 65535 and num_heads a multiple of num_kv_heads");
  if (paged && block_size <= 0) return fail("block_size must be positive in paged mode");
  if (max_seq_len < 0 || max_seq_len > (int64_t{1} << 31) - 1)
    return fail("max_seq_len out of range");
  if (!aligned(k, 16) || !aligned(v, 16)) return fail("k and v must be 16-byte aligned");
  for (int64_t s : {k_stride_outer, k_stride_tok, k_stride_head, v_stride_outer, v_stride_tok,
                    v_stride_head}) {
    if (s % vec != 0) return fail("K/V strides must be multiples of 16 bytes");
  }
  const int64_t partitions =
      std::max<int64_t>(1, (max_seq_len + PARTITION_SIZE - 1) / PARTITION_SIZE);
  if (partitions > 65535) return fail("max_seq_len needs too many partitions");
  if (partitions > 1 && (!tmp_out || !exp_sums || !max_logits))
    return fail("tmp_out, exp_sums and max_logits are required past one partition");

  DecodeParams p{};
  p.out = reinterpret_cast<void*>(out);
  p.q = reinterpret_cast<const void*>(q);
  p.k = reinterpret_cast<const void*>(k);
  p.v = reinterpret_cast<const void*>(v);
  p.index = reinterpret_cast<const int32_t*>(index);
  p.seq_lens = reinterpret_cast<const int32_t*>(seq_lens);
  p.tmp_out = reinterpret_cast<float*>(tmp_out);
  p.exp_sums = reinterpret_cast<float*>(exp_sums);
  p.max_logits = reinterpret_cast<float*>(max_logits);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.num_partitions = static_cast<int>(partitions);
  p.block_size = static_cast<int>(paged ? block_size : 1);
  p.scale = scale;
  p.q_stride_seq = q_stride_seq;
  p.q_stride_head = q_stride_head;
  p.o_stride_seq = o_stride_seq;
  p.o_stride_head = o_stride_head;
  p.k_stride_outer = k_stride_outer;
  p.k_stride_tok = k_stride_tok;
  p.k_stride_head = k_stride_head;
  p.v_stride_outer = v_stride_outer;
  p.v_stride_tok = v_stride_tok;
  p.v_stride_head = v_stride_head;
  p.index_stride = index_stride;

  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const int hs = static_cast<int>(head_size);
  cudaError_t err;
  switch (dtype) {
    case kFloat32: err = dispatch_mode<float>(p, hs, paged != 0, s); break;
    case kFloat16: err = dispatch_mode<__half>(p, hs, paged != 0, s); break;
    default: err = dispatch_mode<__nv_bfloat16>(p, hs, paged != 0, s); break;
  }
  return static_cast<int>(err);
}

}  // extern "C"
