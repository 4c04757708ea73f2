"""Quantized weights on the CPU: GGUF block formats served as the file holds them
(:mod:`~vmkv.models.quant.gguf_weights`, :mod:`~vmkv.models.quant.modules`,
:mod:`~vmkv.models.quant.packing`)."""
