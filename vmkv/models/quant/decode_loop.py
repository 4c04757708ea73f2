"""The one-user step: a pure-decode step's whole decoder stack in one C call.

    x = embed(ids)                                      (one C call)
    decode_layers(x):  for each layer                   (one C call for all of them)
                           attn_in -> the decode kernel (vmkv_cpu_decode_attention, called from C
                           through its address) -> attn_out
    norm(x) -> hidden                                   (the model's own module)

A decode step of one request on quantized weights streams ~100 MB of weights in ~4 ms; the fused
layers' two calls per layer plus the attention backend's call cost ~60 us of Python each in
between (90 transitions a step), which was a third of such a step. Here the only Python of the
forward is the embedding, the rotary table and building this call's arguments. The attention is
the backend's own kernel with the backend's own addressing (slot rows or block tables) and
windows (over an int8 cache its int8 kernel, which has the same C signature), and the calls are
the per-layer path's: the same bits in both KV modes (tested).
"""

from __future__ import annotations

import ctypes

import torch

from vmkv.attention.cpu import CpuAttentionBackend, CpuStepMetadata
from vmkv.attention.op import current_step
from vmkv.kernels import cpu_attention, cpu_attention_int8, cpu_quant


class DecodeLoop:
    """Runs pure-decode steps of a quantized fused model (``layers``: the C layer arguments in
    layer order) through :func:`cpu_quant` ``decode_layers``."""

    def __init__(self, shape: cpu_quant.ShapeArgs, layers: list[cpu_quant.LayerArgs],
                 dtype: torch.dtype, scale: float) -> None:
        self.shape = shape
        self.layers = (cpu_quant.LayerArgs * len(layers))(*layers)
        self.call = cpu_quant.entry(dtype, "decode_layers")
        self.dtype = dtype
        self.scale = scale
        #: (backend, K pointers, V pointers, windows, row stride, head stride, the decode
        #: kernel's address), per backend
        self._rows: tuple[object, ...] | None = None

    def takes(self, keep: torch.Tensor | None
              ) -> tuple[CpuAttentionBackend, CpuStepMetadata] | None:
        """The step's backend and metadata when this step can run here: every request decodes
        through a CPU decode kernel (which stores the new K/V itself) over a cache of the
        model's dtype or int8, all rows kept."""
        step = current_step()
        if keep is not None or step is None or not cpu_attention.available():
            return None
        backend, meta = step
        if not (isinstance(backend, CpuAttentionBackend) and isinstance(meta, CpuStepMetadata)
                and meta.decode is not None and meta.decode.query_rows is None
                and meta.prefill is None and self.dtype in cpu_attention.DTYPE_CODES):
            return None
        kv_dtype = backend.kv.spec.dtype
        if kv_dtype == self.dtype or (kv_dtype == torch.int8 and cpu_attention_int8.available()):
            return backend, meta
        return None

    def _layer_rows(self, backend: CpuAttentionBackend) -> tuple[object, ...]:
        if self._rows is None or self._rows[0] is not backend:
            # [outer * inner, kv_heads, D] row views, as the backend's own (no copies)
            rows = [(k.flatten(0, 1), v.flatten(0, 1))
                    for k, v in (backend.kv.layer_kv(i) for i in range(len(self.layers)))]
            k0 = rows[0][0]
            if any(k.stride() != k0.stride() or v.stride() != k0.stride() for k, v in rows):
                raise ValueError("the layers' K/V rows do not share one stride")
            ptrs = ctypes.c_void_p * len(rows)
            kernel = cpu_attention_int8 if k0.dtype == torch.int8 else cpu_attention
            self._rows = (backend, ptrs(*(k.data_ptr() for k, _ in rows)),
                          ptrs(*(v.data_ptr() for _, v in rows)),
                          (ctypes.c_int64 * len(rows))(*backend.windows), k0.stride(0),
                          k0.stride(1), kernel.decode_address())
        return self._rows

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backend: CpuAttentionBackend, meta: CpuStepMetadata, scratch: list[torch.Tensor]
            ) -> None:
        """Run every layer of the step whose embedded tokens are ``x [T, hidden]`` (updated in
        place to the last layer's output); ``scratch`` = h, qkv, act as the fused body's."""
        decode = meta.decode
        assert decode is not None
        _, k_ptrs, v_ptrs, windows, stride_row, stride_head, attention = \
            self._layer_rows(backend)
        rows = decode.rows
        starts = rows.starts.to(torch.int64).contiguous() if rows.starts is not None else None
        table = (rows.block_table.to(torch.int32).contiguous()
                 if rows.block_table is not None else None)
        lens = decode.seq_lens.to(torch.int32).contiguous()
        args = cpu_quant.DecodeArgs(
            attention=attention,
            dtype=cpu_attention.DTYPE_CODES[self.dtype], k=ctypes.cast(k_ptrs, ctypes.c_void_p),
            v=ctypes.cast(v_ptrs, ctypes.c_void_p), windows=ctypes.cast(windows, ctypes.c_void_p),
            stride_row=stride_row, stride_head=stride_head,
            starts=starts.data_ptr() if starts is not None else None,
            table=table.data_ptr() if table is not None else None,
            table_stride=table.stride(0) if table is not None else 0,
            block_size=rows.block_size, seq_lens=lens.data_ptr(), scale=self.scale)
        h, qkv, act = scratch
        t = x.shape[0]
        attn = x.new_empty(t, self.shape.num_heads * self.shape.head_dim)
        err = self.call(ctypes.byref(self.shape), self.layers, len(self.layers), x.data_ptr(), t,
                        cos.data_ptr(), sin.data_ptr(), h.data_ptr(), qkv.data_ptr(),
                        attn.data_ptr(), act.data_ptr(), ctypes.byref(args))
        if err:
            raise ValueError(f"the decode loop refused its arguments (code {err}, T={t})")
