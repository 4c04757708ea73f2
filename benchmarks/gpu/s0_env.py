"""Step 0: facts about the machine: versions, toolchain (pytest, C compiler, Python.h, nvcc,
ninja, compute-sanitizer), a real one-element Triton launch, driver, granularity, copy
bandwidth. A CPU dry run records the CUDA facts as "n/a on cpu"."""

from __future__ import annotations

import platform

from common import DEVICE, NA_CPU, ON_CPU, Result, copy_bandwidth, guard, run_step
from toolchain import command_output, module_version, toolchain_facts

MODULES = ("torch", "triton", "transformers", "numpy", "cupy", "flash_attn", "cuda.bindings",
           "safetensors", "tokenizers")
CUDA_FACTS = ("nvidia_smi", "nvidia_smi_query", "device", "mem_get_info_gib", "cuInit",
              "granularity", "d2d_copy_bandwidth_tb_s")


def triton_launch(res: Result) -> None:
    """One element written by a real Triton kernel (its launcher is compiled here first)."""
    try:
        import triton_probe
    except Exception as exc:  # noqa: BLE001 - no triton, or a broken one: a fact
        res.record("triton_launch", {"result": f"import failed: {type(exc).__name__}: {exc}"})
        return
    import torch

    t = torch.zeros(4, device=DEVICE)
    result = triton_probe.outcome(lambda: triton_probe.store_one(t, 2, 7.0))
    if result == "ok":
        result = "ok" if t.tolist() == [0.0, 0.0, 7.0, 0.0] else f"wrong result {t.tolist()}"
    res.record("triton_launch", {"mode": triton_probe.mode(), "result": result})
    res.check("one-element Triton launch", result == "ok", mode=triton_probe.mode(),
              result=result[:300])


def cuda_facts(res: Result) -> str:
    """Driver, device, VMM granularity, copy bandwidth; returns the headline."""
    import torch

    res.record("nvidia_smi", command_output(["nvidia-smi"]))
    res.record("nvidia_smi_query", command_output([
        "nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,"
        "clocks.mem", "--format=csv"]))
    res.check("torch sees CUDA", torch.cuda.is_available(), cuda=torch.version.cuda)
    props = torch.cuda.get_device_properties(0)
    res.record("device", {"name": props.name, "sm": f"{props.major}.{props.minor}",
                          "sms": props.multi_processor_count,
                          "memory_gib": props.total_memory / 2**30})
    free, total = torch.cuda.mem_get_info()
    res.record("mem_get_info_gib", [free / 2**30, total / 2**30])

    from cuda.bindings import driver as cu

    err, = cu.cuInit(0)
    res.record("cuInit", getattr(err, "name", str(err)))
    res.check("cuInit", err == cu.CUresult.CUDA_SUCCESS, result=getattr(err, "name", err))
    from vmkv.memory.cuda import CudaMemoryBackend

    backend = CudaMemoryBackend(None, 1)
    prop = backend._allocation_prop()
    gran = {}
    for flag in ("CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED"):
        e, g = cu.cuMemGetAllocationGranularity(
            prop, getattr(cu.CUmemAllocationGranularity_flags, flag))
        gran[flag] = int(g) if e == cu.CUresult.CUDA_SUCCESS else getattr(e, "name", str(e))
    res.record("granularity", gran)
    res.check("granularity is 2 MiB", backend.granularity == 2 << 20, bytes=backend.granularity)
    bw = copy_bandwidth(2 << 30)
    res.record("d2d_copy_bandwidth_tb_s", bw / 1e12)
    return (f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"gran {backend.granularity >> 20} MiB, copy {bw / 1e12:.2f} TB/s")


def main(res: Result) -> None:
    res.record("versions", {"python": platform.python_version(),
                            **{m: module_version(m) for m in MODULES}})
    facts = toolchain_facts()
    res.record("toolchain", facts)
    res.headline = (f"pytest {facts['pytest']}, cc {facts['cc']['path']}, "
                    f"Python.h {facts['python_h']['exists']}")
    guard(res, "one-element Triton launch", lambda: triton_launch(res))

    from vmkv.attention.kernel_choice import aten_flash_kwargs, flash_attn_module

    kwargs = sorted(aten_flash_kwargs())  # the op's schema: readable without a GPU
    res.record("aten_flash_attention_forward_kwargs", kwargs)
    res.check("aten._flash_attention_forward takes scale + seqused_k",
              {"scale", "seqused_k"} <= set(kwargs), kwargs=kwargs)
    res.record("flash_attn_installed", flash_attn_module() is not None)
    if ON_CPU:
        for key in CUDA_FACTS:
            res.record(key, NA_CPU)
        return
    head = guard(res, "CUDA facts", lambda: cuda_facts(res))
    if head is not None:
        res.headline = head + ", " + res.headline


if __name__ == "__main__":
    run_step("s0_env", main)
