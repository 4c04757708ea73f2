"""What a KV cache must hold (per-token shapes) and how the virtual layouts lay it out.

Virtual layouts (``[slot, token, ...]``: one fixed slot of ``slot_tokens`` per request):

    per-layer   2*L regions, region 2*r+kv is [slot, token, kv_head, head_dim] of the r-th
                layer in region order: full-attention layers first, then sliding-window ones
                (one growth step maps a page in every region: 2*L maps); the sliding layers'
                regions give back the whole pages behind their window (``drop_window``)
    all-layers  1 region [slot, token, layer, k|v, kv_head, head_dim]
                (one growth step maps one page that covers a few tokens of every layer; a page
                holds every layer's share, so none can be given back before the request ends:
                the kernels still apply the windows, the memory stays)

Either way a layer's K (or V) handed to attention is a strided ``[slot, token, kv_head,
head_dim]`` view of the same memory, never a copy. ``slot_tokens`` is ``max_model_len`` rounded
up so that a slot is a whole number of pages (tokens may straddle page boundaries inside it).

A :class:`KVSpec` carries its own KV ``dtype`` (the model's, or int8: ``--kv-cache-dtype``) and
the bytes per token that follow from it. An int8 cache is quantised per token and KV head,
symmetrically, and each head's row holds its scale right after its values, so every view,
copy, swap, fork and prefix share of a row carries the scale with it:

    int8 head row   | head_dim int8 values | float16 scale (2 bytes) |   = head_dim + 2 bytes
                    value = int8 * scale;  scale = max|x| / 127 of that token's head

Views of such a cache are ``[..., kv_head, head_dim + 2]`` int8 (:attr:`KVSpec.row_dim`). An fp8
cache (CUDA, ``fp8_e4m3|fp8_e5m2``) has the same rows with fp8 values (scale = max|x| / 448 or
/ 57344, the format's largest value), read by the Triton twins; its views are of that fp8
dtype, the scale's two bytes included. It also
describes *layer groups* (:class:`LayerGroup`: full-attention layers, and
sliding-window layers whose queries see only their last tokens: Gemma 3's). The attention
backends read each layer's window (:attr:`KVSpec.windows`) and apply it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from vmkv.config import LAYOUTS
from vmkv.kernels.scaled_rows import FP8_DTYPES, SCALE_BYTES

#: the KV cache's storage by ``--kv-cache-dtype`` name (auto resolved before: the model's)
KV_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: caches of scaled rows: values of one byte, then a float16 scale per token and head
QUANTIZED = (torch.int8, *FP8_DTYPES)


def kv_storage_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a KV cache named ``name`` (``--kv-cache-dtype``, resolved) stores."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in KV_STORAGE:
        raise ValueError(f"a KV cache dtype must be one of {sorted(KV_STORAGE)}, got {name!r}")
    return KV_STORAGE[key]


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose KV is kept alike: every token of a request (``sliding_window`` None: full
    attention), or only its last ``sliding_window`` tokens."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVSpec:
    """Per-token KV shape of a model: ``num_layers`` x (K, V) x ``num_kv_heads`` x ``head_dim``
    of ``dtype``, the KV cache's own dtype (the model's, or ``torch.int8``: quantised rows with a
    float16 scale each, see the module docstring), in ``layer_groups`` (empty: one
    full-attention group of every layer, what every model but Gemma 3 has)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    layer_groups: tuple[LayerGroup, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        layers = sorted(i for group in self.layer_groups for i in group.layers)
        if self.layer_groups and layers != list(range(self.num_layers)):
            raise ValueError(f"layer_groups must hold each of the {self.num_layers} layers "
                             f"once, got {self.layer_groups}")
        for group in self.layer_groups:
            if group.sliding_window is not None and group.sliding_window <= 0:
                raise ValueError(f"a sliding window must be positive, got {group}")

    @cached_property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups, never empty."""
        return self.layer_groups or (LayerGroup(tuple(range(self.num_layers))),)

    @cached_property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens, 0 for full attention (what attention
        kernels take)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for layer in group.layers:
                out[layer] = group.sliding_window or 0
        return tuple(out)

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def quantized(self) -> bool:
        """Whether rows are one-byte values with a scale each (``--kv-cache-dtype int8``, or
        ``fp8_e4m3|fp8_e5m2`` on CUDA)."""
        return self.dtype in QUANTIZED

    @cached_property
    def row_dim(self) -> int:
        """Elements of one head's row in the cache: ``head_dim``, + the scale's 2 bytes in an
        int8 cache (the last dim of :meth:`VirtualLayout.layer_views` and of paged blocks)."""
        return self.head_dim + (SCALE_BYTES if self.quantized else 0)

    @cached_property
    def head_bytes(self) -> int:
        """Bytes of one layer's K (or V) for one token, in the KV dtype (scales included)."""
        return self.num_kv_heads * self.row_dim * self.itemsize

    @cached_property
    def bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.head_bytes

    def describe(self) -> str:
        """The KV dtype and what it costs: ``int8 (11,880 bytes a token = 90,382 tokens per
        GiB)`` (the start-up report's words)."""
        return (f"{str(self.dtype).removeprefix('torch.')} ({self.bytes_per_token:,} bytes a "
                f"token = {2**30 // self.bytes_per_token:,} tokens per GiB)")


@dataclass(frozen=True)
class VirtualLayout:
    """Geometry of the virtual KV tensors: regions, bytes per token row, slot size."""

    name: str
    spec: KVSpec
    page_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.name!r}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    @cached_property
    def num_regions(self) -> int:
        return 2 * self.spec.num_layers if self.name == "per-layer" else 1

    @cached_property
    def layer_order(self) -> tuple[int, ...]:
        """Layers in region order: full-attention layers first, then sliding-window ones (the
        layer order where no layer slides)."""
        windows = self.spec.windows
        return tuple(sorted(range(self.spec.num_layers), key=lambda i: (windows[i] > 0, i)))

    @cached_property
    def drop_window(self) -> int:
        """Tokens the sliding layers' regions keep behind a step's first token (their largest
        window), 0 where no region gives pages back (no sliding layer, or the all-layers
        layout)."""
        return max(self.spec.windows) if self.name == "per-layer" else 0

    @cached_property
    def num_full_regions(self) -> int:
        """Regions that keep every token (the first ones); the rest give back pages behind
        :attr:`drop_window`."""
        if not self.drop_window:
            return self.num_regions
        return 2 * sum(1 for w in self.spec.windows if w == 0)

    def first_kept_page(self, num_tokens: int) -> int:
        """The first page a sliding region needs for a step after ``num_tokens`` cached tokens
        (the page of the window's first token); every page before it may be given back."""
        window = self.drop_window
        return self.first_page_of(max(0, num_tokens - window + 1)) if window else 0

    @cached_property
    def row_bytes(self) -> int:
        """Bytes one token occupies in one region."""
        spec = self.spec
        return spec.head_bytes if self.name == "per-layer" else spec.bytes_per_token

    @cached_property
    def token_alignment(self) -> int:
        """Smallest token count whose rows fill a whole number of pages."""
        return math.lcm(self.row_bytes, self.page_size) // self.row_bytes

    @cached_property
    def slot_tokens(self) -> int:
        """Tokens per slot: ``max_model_len`` rounded up to :attr:`token_alignment`."""
        align = self.token_alignment
        return -(-self.max_model_len // align) * align

    @cached_property
    def slot_bytes(self) -> int:
        return self.slot_tokens * self.row_bytes

    @cached_property
    def slot_pages(self) -> int:
        return self.slot_bytes // self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages (per region) a slot needs mapped to hold ``num_tokens`` tokens."""
        return -(-num_tokens * self.row_bytes // self.page_size)

    def tokens_in(self, num_pages: int) -> int:
        """Whole tokens that ``num_pages`` mapped pages (per region) hold."""
        return num_pages * self.page_size // self.row_bytes

    def first_page_of(self, token: int) -> int:
        """Index (within the slot) of the page holding the first byte of ``token``."""
        return token * self.row_bytes // self.page_size

    def layer_views(
        self, regions: list[torch.Tensor], num_slots: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) views ``[slot, token, kv_head, head_dim]`` over the region bytes."""
        spec, t = self.spec, self.slot_tokens
        h, d = spec.num_kv_heads, spec.row_dim
        typed = [r.view(spec.dtype) for r in regions]
        if self.name == "per-layer":
            shaped = [r.view(num_slots, t, h, d) for r in typed]
            position = {layer: r for r, layer in enumerate(self.layer_order)}
            return [(shaped[2 * position[i]], shaped[2 * position[i] + 1])
                    for i in range(spec.num_layers)]
        kv = typed[0].view(num_slots, t, spec.num_layers, 2, h, d)
        return [(kv[:, :, i, 0], kv[:, :, i, 1]) for i in range(spec.num_layers)]
