"""Step 9 (optional): compute-sanitizer memcheck over the virtual attention scenario.

Run as ``compute-sanitizer --tool memcheck python benchmarks/gpu/s9_sanitize.py``: the
aten FlashAttention-2 and Triton backends over VMM slots whose pages end right after a
request's length. memcheck reports any access to unmapped VA (an over-read) as an error.
"""

from __future__ import annotations

import sys

from common import ROOT, Result, guard, run_step

sys.path.insert(0, str(ROOT / "tests"))


def main(res: Result) -> None:
    import test_attention_cuda as ta
    import torch

    from vmkv.attention.virtual_cuda import VirtualCudaBackend

    for kernel in ("aten-flash", "triton"):
        def scenario(kernel: str = kernel) -> None:
            kv = ta.cuda_virtual(torch.bfloat16)
            attn = VirtualCudaBackend(kv, kernel)
            errors, _ = ta.run_scenario(kv, attn, ta.gpu_steps(kv), tol=1e-2)
            torch.cuda.synchronize()
            res.check(f"{kernel} under memcheck", max(errors) < 1e-2, max_rel_err=max(errors))
            kv.close()

        guard(res, kernel, scenario)


if __name__ == "__main__":
    run_step("s9_sanitize", main)
