// oneDNN's brgemm ukernel as torch exports it, the matrix unit of the bfloat16 kernels
// (csrc/cpu_bf16_layer.cpp, csrc/cpu_amx_prefill.cpp): at::native::cpublas::brgemm (BFloat16
// overload) computes C[m, n] (+)= A[m, k] B[k, n] with B in VNNI pairs (is_vnni) and row strides
// lda, ldb, ldc; brgemm_release gives up the calling thread's AMX state. The float32 layer
// (cpu_bf16_layer.cpp's vmkv_f32_*) gets the float overload's address in the same pointer and
// casts it back to its own signature. The Python side looks
// both up in libtorch_cpu and passes their addresses (vmkv/kernels/cpu_bf16.py). The ukernel
// reports errors as C++ exceptions: callers catch them before an OpenMP region or the C ABI.
#pragma once

#include <cstdint>

extern "C" {
typedef void (*VmkvBrgemm)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                           int64_t ldc, bool add_c, const uint16_t* a, const uint16_t* b,
                           float* c, bool is_vnni);
typedef void (*VmkvBrgemmRelease)(bool is_vnni);
}
