"""Step 0: facts about the machine (versions, driver, granularity, copy bandwidth)."""

from __future__ import annotations

import platform
import shutil
import subprocess

from common import Result, copy_bandwidth, run_step


def _cmd(args: list[str], timeout: float = 15) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"


def main(res: Result) -> None:
    res.record("nvidia_smi", _cmd(["nvidia-smi"]))
    res.record("nvidia_smi_query", _cmd(["nvidia-smi", "--query-gpu=name,driver_version,"
                                         "memory.total,memory.used,clocks.sm,clocks.mem",
                                         "--format=csv"]))
    res.record("nvcc", _cmd(["nvcc", "--version"]).splitlines()[-2:])
    res.record("tools", {t: shutil.which(t) for t in ("nvcc", "compute-sanitizer", "ncu")})
    versions = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "numpy", "cupy", "flash_attn",
                "cuda.bindings", "safetensors", "tokenizers"):
        try:
            m = __import__(mod, fromlist=["_"])
            versions[mod] = getattr(m, "__version__", "present")
        except Exception as exc:  # noqa: BLE001
            versions[mod] = f"absent ({type(exc).__name__})"
    res.record("versions", versions)

    import torch

    res.check("torch sees CUDA", torch.cuda.is_available(), cuda=torch.version.cuda)
    props = torch.cuda.get_device_properties(0)
    res.record("device", {"name": props.name, "sm": f"{props.major}.{props.minor}",
                          "sms": props.multi_processor_count,
                          "memory_gib": props.total_memory / 2**30})
    free, total = torch.cuda.mem_get_info()
    res.record("mem_get_info_gib", [free / 2**30, total / 2**30])

    from vmkv.attention.cuda_common import aten_flash_kwargs, flash_attn_module

    kwargs = sorted(aten_flash_kwargs())
    res.record("aten_flash_attention_forward_kwargs", kwargs)
    res.check("aten._flash_attention_forward takes scale + seqused_k",
              {"scale", "seqused_k"} <= set(kwargs), kwargs=kwargs)
    res.record("flash_attn_installed", flash_attn_module() is not None)

    from cuda.bindings import driver as cu

    err, = cu.cuInit(0)
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
    res.headline = (f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                    f"gran {backend.granularity >> 20} MiB, copy {bw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    run_step("s0_env", main)
