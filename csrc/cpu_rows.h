// Where the CPU kernels find a request's cached rows: the one line that differs between the
// twins of each kernel (csrc/cpu_attention.cpp, csrc/cpu_attention_int8.cpp,
// csrc/cpu_amx_prefill.cpp); and the decoding tokens' own new rows the decode kernels store.
//
//   contiguous (virtual mode):  row(b, t) = starts[b] + t                  (a slot is contiguous)
//   block table (paged mode):   row(b, t) = table[b][t / bs] * bs + t % bs
#pragma once

#include <cstdint>

namespace vmkv {

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

// The decoding tokens' own K/V rows ([batch, kv_heads, dim] at these strides), which a decode
// kernel stores (the int8 one quantised) at each request's last token (seq_lens[b] - 1) before
// attending; k == nullptr: none.
template <typename T>
struct NewRows {
  const T* k = nullptr;
  int64_t k_stride_b = 0, k_stride_h = 0;
  const T* v = nullptr;
  int64_t v_stride_b = 0, v_stride_h = 0;
};

}  // namespace vmkv
