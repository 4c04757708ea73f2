"""Step 9 (optional): compute-sanitizer memcheck over the virtual attention scenario.

Run as ``compute-sanitizer --tool memcheck python benchmarks/gpu/s9_sanitize.py``: the
aten FlashAttention-2 and Triton backends over VMM slots whose pages end right after a
request's length. memcheck reports any access to unmapped VA (an over-read) as an error.
"""

from __future__ import annotations

from common import Result, guard, run_step, tests_on_path

tests_on_path()


def main(res: Result) -> None:
    import attention_scenarios as sc
    import torch

    from vmkv.attention.cuda import CudaAttentionBackend

    for kernel in ("aten-flash", "triton"):
        def scenario(kernel: str = kernel) -> None:
            kv = sc.cuda_virtual(torch.bfloat16)
            attn = CudaAttentionBackend(kv, kernel)
            errors, _ = sc.run_scenario(kv, attn, sc.boundary_steps(kv), tol=1e-2)
            torch.cuda.synchronize()
            res.check(f"{kernel} under memcheck", max(errors) < 1e-2, max_rel_err=max(errors))
            kv.close()

        guard(res, kernel, scenario)


if __name__ == "__main__":
    run_step("s9_sanitize", main)
