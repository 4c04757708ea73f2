// A Llama-family decoder layer on the CPU around its attention, in two calls per layer:
//
//   vmkv_layer_attn_in:   h = rms_norm(x) * w1;  qkv = h Wqkv^T (+ b);  RoPE on q and k in place
//   (attention: the engine's backend, in Python, reads q/k/v out of qkv)
//   vmkv_layer_attn_out:  x += attn Wo^T (+ b);  h = rms_norm(x) * w2;  gu = h Wgu^T (+ b);
//                         gu[:, :I] = silu(gu[:, :I]) * gu[:, I:];  x += gu[:, :I] Wdown^T (+ b)
//
// Why: at decode batch sizes a compiled layer (TorchInductor, the linears opaque) spent ~0.4 ms of
// framework time per layer (guards, wrappers, custom-op dispatch, one OpenMP region per fused
// loop) around ~0.8 ms of GEMMs; here the whole layer but its attention is two C calls. The GEMMs
// are MKL's packed ``cblas_sgemm_compute`` on weights packed at load (vmkv/models/linear.py),
// reached through a function pointer the caller passes (torch's own libtorch_cpu exports it), so
// this library links nothing but libgomp. Elementwise loops take one thread for a few rows and
// the OpenMP team for many (prefill).
//
// Arithmetic follows the unfused layer operation for operation in float32 (RMSNorm statistics in
// float32, x * rsqrt(var + eps) then * weight; RoPE as x*cos + roll(x)*signed_sin; SiLU as
// x / (1 + exp(-x)); residual adds after each GEMM), so results differ from it only by the
// summation order of the norm's mean and the last bit of exp.
//
// Built by vmkv/kernels/cpu_decoder_layer.py like csrc/cpu_attention.cpp (g++ -O3 -march=native
// -fopenmp, cached, called through ctypes).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_lap.h"
#include "cpu_vec.h"

namespace {

using vmkv::exp_approx;
using vmkv::Lap;

// MKL's CBLAS constants (mkl_cblas.h) and cblas_sgemm_compute's signature (LP64: MKL_INT = int)
constexpr int kRowMajor = 101, kNoTrans = 111, kPacked = 151;
using SgemmCompute = void (*)(int layout, int transa, int transb, int m, int n, int k,
                              const float* a, int lda, const void* b, int ldb, float beta,
                              float* c, int ldc);

// Rows per call below which the elementwise loops stay on the calling thread (waking the team
// costs more than a few rows of work).
constexpr int64_t kParallelRows = 16;

}  // namespace

extern "C" {

// One linear layer: weight packed by cblas_sgemm_pack (B = W^T, [in, out]), optional bias [out].
struct VmkvPackedLinear {
  const void* packed;
  const float* bias;  // nullptr: none
  int64_t in_features, out_features;
};

// A decoder layer's weights (the caller keeps the tensors alive).
struct VmkvDecoderLayer {
  VmkvPackedLinear qkv, o, gate_up, down;
  const float* input_norm;  // [hidden]
  const float* post_norm;   // [hidden]
};

// The model's geometry, the GEMM entry point and (optional) profiling counters.
struct VmkvLayerShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
  SgemmCompute gemm;  // cblas_sgemm_compute
  int64_t* ns;        // nullptr, or {gemm ns, elementwise ns} accumulated per call
};

}  // extern "C"

namespace {

// out [t, n] = a [t, k] (row stride lda) W^T (+ bias), W packed.
void linear(const VmkvLayerShape* s, const VmkvPackedLinear& w, const float* a, int64_t lda,
            int64_t t, float* out) {
  const int64_t n = w.out_features;
  float beta = 0.0f;
  if (w.bias != nullptr) {  // C starts as the bias (beta = 1), as the unfused linear does
    for (int64_t r = 0; r < t; ++r) std::memcpy(out + r * n, w.bias, n * sizeof(float));
    beta = 1.0f;
  }
  s->gemm(kRowMajor, kNoTrans, kPacked, static_cast<int>(t), static_cast<int>(n),
          static_cast<int>(w.in_features), a, static_cast<int>(lda), w.packed,
          static_cast<int>(w.in_features), beta, out, static_cast<int>(n));
}

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)), statistics in float32.
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

void rms_norm(const float* x, const float* weight, int64_t t, int64_t n, float eps, float* out) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) rms_norm_row(x + r * n, weight, n, eps, out + r * n);
}

// Neox half-split RoPE of `heads` heads of one row in place: x*cos + roll(x, D/2)*signed_sin.
void rope_row(float* x, const float* cos, const float* ssin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = x + h * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = p[i], x2 = p[i + half];
      p[i] = x1 * cos[i] + x2 * ssin[i];
      p[i + half] = x2 * cos[i + half] + x1 * ssin[i + half];
    }
  }
}

// gate[i] = silu(gate[i]) * up[i] over `n` values.
void silu_mul_row(float* gate, const float* up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + exp_approx(-g)) * up[i];
  }
}

void add_rows(float* x, const float* y, int64_t count) {
#pragma omp parallel for schedule(static) if (count >= kParallelRows * 1024)
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

bool bad_shape(const VmkvLayerShape* s, const VmkvDecoderLayer* w, int64_t t) {
  const int64_t q = s->num_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
  return s == nullptr || w == nullptr || s->gemm == nullptr || t < 0 || s->head_dim % 2 != 0 ||
         w->qkv.in_features != s->hidden || w->qkv.out_features != q + 2 * kv ||
         w->o.in_features != q || w->o.out_features != s->hidden ||
         w->gate_up.in_features != s->hidden ||
         w->gate_up.out_features != 2 * s->intermediate ||
         w->down.in_features != s->intermediate || w->down.out_features != s->hidden;
}

}  // namespace

extern "C" {

// x [t, hidden] (read), cos/signed_sin [t, head_dim]; writes h [t, hidden] (scratch) and
// qkv [t, (Hq + 2 Hkv) * D] with RoPE applied to its q and k heads. Returns 0, or 1 on a bad
// shape (nothing written).
int vmkv_layer_attn_in(const VmkvLayerShape* s, const VmkvDecoderLayer* w, const float* x,
                       int64_t t, const float* cos, const float* ssin, float* h, float* qkv) {
  if (bad_shape(s, w, t)) return 1;
  if (t == 0) return 0;
  const int64_t hidden = s->hidden, d = s->head_dim;
  const int64_t width = (s->num_heads + 2 * s->num_kv_heads) * d;
  Lap lap(s->ns);
  rms_norm(x, w->input_norm, t, hidden, s->eps, h);
  lap(1);
  linear(s, w->qkv, h, hidden, t, qkv);
  lap(0);
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r)
    rope_row(qkv + r * width, cos + r * d, ssin + r * d, s->num_heads + s->num_kv_heads, d);
  lap(1);
  return 0;
}

// x [t, hidden] updated in place by the attention output attn [t, Hq * D] (row stride
// attn_stride) and the MLP; h [t, hidden] and gu [t, 2 * intermediate] are scratch. Returns 0,
// or 1 on a bad shape (nothing written).
int vmkv_layer_attn_out(const VmkvLayerShape* s, const VmkvDecoderLayer* w, float* x, int64_t t,
                        const float* attn, int64_t attn_stride, float* h, float* gu) {
  if (bad_shape(s, w, t) || attn_stride < s->num_heads * s->head_dim) return 1;
  if (t == 0) return 0;
  const int64_t hidden = s->hidden, inter = s->intermediate;
  Lap lap(s->ns);
  linear(s, w->o, attn, attn_stride, t, h);
  lap(0);
  add_rows(x, h, t * hidden);
  rms_norm(x, w->post_norm, t, hidden, s->eps, h);
  lap(1);
  linear(s, w->gate_up, h, hidden, t, gu);
  lap(0);
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) silu_mul_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter);
  lap(1);
  linear(s, w->down, gu, 2 * inter, t, h);
  lap(0);
  add_rows(x, h, t * hidden);
  lap(1);
  return 0;
}

}  // extern "C"
