// The elementwise work of the fused CPU decoder layers (csrc/cpu_bf16_layer.cpp and
// csrc/cpu_quant_layer.cpp), templated on the element type T (float, or bf16 rounded where
// transformers rounds): the epilogues that finish a float32 product tile, RMSNorm and RoPE.
// Header-only, no torch: the kernel build hashes it with each source that includes it.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace vmkv {

constexpr int64_t kParallelRows = 16;  // elementwise passes stay on one thread below this

template <typename T>
inline float bias_at(const T* bias, int64_t n) {
  return bias != nullptr ? to_float(bias[n]) : 0.0f;
}

// Epilogues over one tile row: the float32 products c[0 .. cols) of columns n0 ..

// out = round(c + bias)
template <typename T>
inline void store_rounded(const float* c, const T* bias, int64_t n0, int64_t cols, T* out) {
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= cols; i += kLanes) {
    vfloat y = vload(c + i);
    if (bias != nullptr) y = vadd(y, vload(bias + n0 + i));
    vstore(out + i, y);
  }
#endif
  for (; i < cols; ++i) out[i] = from_float<T>(c[i] + bias_at(bias, n0 + i));
}

// x = round(x + round(c + bias))
template <typename T>
inline void add_rounded(const float* c, const T* bias, int64_t n0, int64_t cols, T* x) {
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= cols; i += kLanes) {
    vfloat p = vload(c + i);
    if (bias != nullptr) p = vadd(p, vload(bias + n0 + i));
    vstore(x + i, vadd(vload(x + i), vround_to<T>(p)));
  }
#endif
  for (; i < cols; ++i) {
    x[i] = from_float<T>(to_float(x[i]) + round_to<T>(c[i] + bias_at(bias, n0 + i)));
  }
}

// act = round(round(Act(round(gate + bg))) * round(up + bu)), Act the MLP's activation: a type
// with `static float scalar(float)` and, where VMKV_VECTOR is defined, `static vfloat vec(vfloat)`.
template <typename Act, typename T>
inline void act_mul_rounded(const float* gate, const float* up, const T* bias_gate,
                            const T* bias_up, int64_t n0, int64_t cols, T* act) {
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= cols; i += kLanes) {
    vfloat g = vload(gate + i), u = vload(up + i);
    if (bias_gate != nullptr) g = vadd(g, vload(bias_gate + n0 + i));
    if (bias_up != nullptr) u = vadd(u, vload(bias_up + n0 + i));
    g = vround_to<T>(g);
    vstore(act + i, vmul(vround_to<T>(Act::vec(g)), vround_to<T>(u)));
  }
#endif
  for (; i < cols; ++i) {
    const float g = round_to<T>(gate[i] + bias_at(bias_gate, n0 + i));
    const float u = round_to<T>(up[i] + bias_at(bias_up, n0 + i));
    act[i] = from_float<T>(round_to<T>(Act::scalar(g)) * u);
  }
}

// SiLU: g / (1 + exp(-g))
struct Silu {
  static float scalar(float g) { return g / (1.0f + exp_approx(-g)); }
#if defined(VMKV_VECTOR)
  static vfloat vec(vfloat g) { return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))); }
#endif
};

// act = round(round(silu(round(gate + bg))) * round(up + bu))
template <typename T>
inline void silu_mul_rounded(const float* gate, const float* up, const T* bias_gate,
                             const T* bias_up, int64_t n0, int64_t cols, T* act) {
  act_mul_rounded<Silu>(gate, up, bias_gate, bias_up, n0, cols, act);
}

// out = round(weight * round(x * inv)) over n values of one row.
template <typename T>
inline void scale_row(const T* x, const T* weight, float inv, int64_t n, T* out) {
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= n; i += kLanes) {
    vstore(out + i, vmul(vload(weight + i), vround_to<T>(vmul(vload(x + i), vset1(inv)))));
  }
#endif
  for (; i < n; ++i) {
    out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(x[i]) * inv));
  }
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(VMKV_VECTOR)
  vfloat acc = vzero();
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = vload(x + i);
    acc = vfmadd(v, v, acc);
  }
  sum = vsum(acc);
#endif
  for (; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  return sum;
}

// out[r] = round(weight * round(x[r] * rsqrt(mean(x[r]^2) + eps))), statistics in float32.
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t t, int64_t n, float eps, T* out) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) {
    const float inv = 1.0f / std::sqrt(sum_squares(x + r * n, n) / static_cast<float>(n) + eps);
    scale_row(x + r * n, weight, inv, n, out + r * n);
  }
}

// One head's half-split rotation in place: p[i] = round(round(x1 c) + round(x2 s)) for the first
// half (x1 = p[i], x2 = p[i + half]) and the mirror for the second.
template <typename T>
inline void rope_head(T* p, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
#if defined(VMKV_VECTOR)
  for (; i + kLanes <= half; i += kLanes) {
    const vfloat x1 = vload(p + i), x2 = vload(p + half + i);
    vstore(p + i, vadd(vround_to<T>(vmul(x1, vload(c + i))),
                       vround_to<T>(vmul(x2, vload(s + i)))));
    vstore(p + half + i, vadd(vround_to<T>(vmul(x2, vload(c + half + i))),
                              vround_to<T>(vmul(x1, vload(s + half + i)))));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_float(p[i]), x2 = to_float(p[i + half]);
    p[i] = from_float<T>(round_to<T>(x1 * to_float(c[i])) + round_to<T>(x2 * to_float(s[i])));
    p[i + half] = from_float<T>(round_to<T>(x2 * to_float(c[i + half])) +
                                round_to<T>(x1 * to_float(s[i + half])));
  }
}

// Neox half-split RoPE of `heads` heads of t rows (row stride `width`) in place:
// x*cos + roll(x, D/2)*signed_sin, each product and the sum rounded.
template <typename T>
void rope(T* x, int64_t t, int64_t width, const T* cos, const T* ssin, int64_t heads, int64_t d) {
#pragma omp parallel for schedule(static) if (t >= kParallelRows)
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      rope_head(x + r * width + h * d, cos + r * d, ssin + r * d, d / 2);
    }
  }
}

}  // namespace vmkv
