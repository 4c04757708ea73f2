"""Attention kernels for both KV modes, in twins that differ only in address translation.

* :mod:`vmkv.kernels.triton_decode`: Triton decode and prefill kernels with a ``PAGED``
  constexpr (contiguous slot addressing vs block table); runs on CPU under ``TRITON_INTERPRET=1``.
* :mod:`vmkv.kernels.cuda_twins`: a CUDA C++ PagedAttention-style decode pair
  (``csrc/paged_attention.cu``), built with nvcc and called through ctypes on a GPU machine.

Nothing is imported here: importing Triton fixes the interpreter choice, and neither Triton nor
nvcc exists everywhere. Import the submodule you need.
"""
