"""``vmkv bench study``: the address-translation study of the machine it runs on, in one
command (docs/study.md is the committed one; docs/benchmarks.md describes the command).

Parts, each answering its questions with the existing benches' entry points:

    memory        useful KV fraction per strategy (vmkv.bench.memory)
    translation   attention alone, block table vs contiguous slot (vmkv.bench.kernels)
    tax           what virtual mode pays, as a share of the step (engines alternated,
                  page faults, TLB misses where readable; vmkv.bench.profile)
    mapping       page-operation latency (vmkv.bench.vmm) and the mapper's hidden stall
    end_to_end    virtual vs paged offline per mix and dtype, prefix cache, online
                  (vmkv.bench.throughput, vmkv.bench.serve)
    elastic       OS-visible memory through bursts and idle gaps (vmkv.bench.elastic)
    hybrid        sliding-window layers: resident KV by layer group, map/unmap calls, requests
                  at once in a fixed budget, against a uniform layout (the real managers)
    kv_dtype      --kv-cache-dtype auto vs int8: bytes and tokens per page and block, useful
                  memory on the mixes, speed and map calls on decode-heavy, decode step parts,
                  teacher-forced accuracy; the first screen says what auto picks and why
    gpu           benchmarks/gpu/check.sh's results where they exist

Each part module has ``NAME``, ``TITLE``, ``tasks(scale, raw)`` (the measurements, each filling
``raw``), ``summarise(raw, scale)`` (the derived numbers, stored in the JSON too),
``commands(scale, study_command)`` and ``section(part_doc, study_doc)`` (what the report shows,
built from the JSON only). :mod:`.runner` runs them, :mod:`.report` writes the markdown.
"""

from __future__ import annotations

from types import ModuleType

from vmkv.bench.study import (
    elastic,
    end_to_end,
    gpu,
    hybrid,
    kv_dtype,
    mapping,
    memory,
    tax,
    translation,
)

PARTS: tuple[ModuleType, ...] = (memory, translation, tax, mapping, end_to_end, elastic, hybrid,
                                 kv_dtype, gpu)
PART_NAMES = tuple(p.NAME for p in PARTS)
