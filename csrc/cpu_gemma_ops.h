// Gemma 3's elementwise work for the fused CPU decoder layer (csrc/cpu_bf16_layer.cpp), templated
// on the element type T like cpu_layer_ops.h: its (1 + w) RMSNorm, computed in float32 and
// rounded once (transformers' Gemma3RMSNorm: normalize(x.float()) * (1 + w.float()), cast back),
// applied to rows, to each q/k head, and before a residual add; and GeGLU's tanh GELU.
// Header-only, no torch: the kernel build hashes it with each source that includes it.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_layer_ops.h"
#include "cpu_vec.h"

extern "C" {

// A Gemma 3 layer's norm scales, each 1 + w in float32 (folded at load; the caller keeps them
// alive): the sandwich norms around attention and the MLP [hidden], the per-head q/k norms
// [head_dim].
struct VmkvGemmaNorms {
  const float* input;
  const float* post_attn;
  const float* pre_ffw;
  const float* post_ffw;
  const float* q;
  const float* k;
};

}  // extern "C"

namespace vmkv {

// out = round(x * rsqrt(mean(x^2) + eps) * scale) over n values of one row (out may be x).
template <typename T>
inline void gemma_norm_row(const T* x, const float* scale, int64_t n, float eps, T* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= n; i += kLanes) {
    vstore(out + i, vmul(vmul(vload(x + i), vset1(inv)), vload(scale + i)));
  }
#endif
  for (; i < n; ++i) out[i] = from_float<T>(to_float(x[i]) * inv * scale[i]);
}

// out[r] = gemma_norm_row(x[r]) for t rows of n values.
template <typename T>
void gemma_norm(const T* x, const float* scale, int64_t t, int64_t n, float eps, T* out) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) gemma_norm_row(x + r * n, scale, n, eps, out + r * n);
}

// x[r] = round(x[r] + gemma_norm_row(h[r])) for t rows of n values; h is overwritten by the
// normed rows.
template <typename T>
void gemma_norm_add(T* h, const float* scale, int64_t t, int64_t n, float eps, T* x) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) {
    T* hr = h + r * n;
    T* xr = x + r * n;
    gemma_norm_row(hr, scale, n, eps, hr);
    int64_t i = 0;
#if defined(VMKV_VECTOR)
    for (; i + kLanes <= n; i += kLanes) vstore(xr + i, vadd(vload(xr + i), vload(hr + i)));
#endif
    for (; i < n; ++i) xr[i] = from_float<T>(to_float(xr[i]) + to_float(hr[i]));
  }
}

// Each q head (q_scale) and k head (k_scale) of t rows of qkv (row stride `width`: Hq q heads,
// Hkv k heads, Hkv v heads of d values) normed in place.
template <typename T>
void gemma_head_norms(T* qkv, int64_t t, int64_t width, int64_t hq, int64_t hkv, int64_t d,
                      float eps, const float* q_scale, const float* k_scale) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t h = 0; h < hq + hkv; ++h) {
      T* head = qkv + r * width + h * d;
      gemma_norm_row(head, h < hq ? q_scale : k_scale, d, eps, head);
    }
  }
}

// tanh GELU: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), computed as g / (1 + exp(-2 y))
// (y the tanh's argument: the same function, torch's up to float's last bits)
struct GeluTanh {
  static constexpr float kTwoBeta = 2.0f * 0.7978845608028654f, kKappa = 0.044715f;
  static float scalar(float g) {
    return g / (1.0f + exp_approx(-kTwoBeta * (g + kKappa * g * g * g)));
  }
#if defined(VMKV_VECTOR)
  static vfloat vec(vfloat g) {
    const vfloat inner = vmul(vset1(-kTwoBeta), vfmadd(vmul(vset1(kKappa), vmul(g, g)), g, g));
    return vdiv(g, vadd(vset1(1.0f), vexp(inner)));
  }
#endif
};

// act = round(round(gelu_tanh(round(gate + bg))) * round(up + bu))
template <typename T>
inline void gelu_tanh_mul_rounded(const float* gate, const float* up, const T* bias_gate,
                                  const T* bias_up, int64_t n0, int64_t cols, T* act) {
  act_mul_rounded<GeluTanh>(gate, up, bias_gate, bias_up, n0, cols, act);
}

}  // namespace vmkv
