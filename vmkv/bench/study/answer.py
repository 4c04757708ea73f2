"""The study's answer in numbers, computed from the parts' summaries when they change (and
stored in the JSON, so the report only formats it): how much faster or slower virtual is than
paged end to end, and how much of that the kernel's translation cost and the virtual tax
predict."""

from __future__ import annotations

from typing import Any


def synthesis(parts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """From the end-to-end, translation and tax summaries (None unless all three exist):

    - ``kernel_gain_pct``: % of a paged decode step the virtual kernel saves: attention's share
      of the step x (1 - 1 / (paged / virtual attention time));
    - ``tax_pct``: % of a virtual run spent in map/unmap, page creation and first touch;
    - ``expected_pct`` = gain - tax: virtual's predicted speed-up over paged (negative: slower);
    - ``measured_pct``: (virtual / paged output tokens/s - 1) x 100, median over mixes x dtypes,
      with its range over them."""
    try:
        e2e = parts["end_to_end"]["summary"]
        kernel = parts["translation"]["summary"]["engine_default_decode_ratio"]
        tax = parts["tax"]["summary"]
        paged_step = tax["profile_steps"]["paged decode"]
        tax_pct = tax["variants"]["virtual"]["tax_pct"]
    except KeyError:
        return None
    if kernel is None:
        return None
    share = 100 * paged_step["attention"] / paged_step["step_ms"]
    gain = share * (1 - 1 / kernel)
    expected = gain - tax_pct
    measured = (e2e["ratio_median"] - 1) * 100
    return {"attention_share_pct": share, "kernel_ratio": kernel, "kernel_gain_pct": gain,
            "kernel_gain_abs_pct": abs(gain), "tax_pct": tax_pct, "expected_pct": expected,
            "expected_abs_pct": abs(expected), "measured_pct": measured,
            "measured_abs_pct": abs(measured),
            "measured_min_pct": (e2e["ratio_min"] - 1) * 100,
            "measured_max_pct": (e2e["ratio_max"] - 1) * 100}
