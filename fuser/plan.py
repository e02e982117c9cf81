"""Launch configs: block sizes and warps for a region's kernel, by its sizes and the device it runs on.

One place decides them, so the cost model's occupancy estimate and the emitted kernel agree.
On CPU the interpreter runs each program in numpy: few, large programs are fastest there.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

from .region import persistent_at


@dataclass(frozen=True)
class BlockPlan:
    xblock: int
    rblock: int        # 1 for pointwise kernels
    num_warps: int
    programs: int
    persistent: bool   # the whole row in registers (reductions), else a loop over R


def block_plan(rows: int, r: int | None, device_type: str) -> BlockPlan:
    """The launch config for `rows` rows (elements, for pointwise kernels: r None) of `r` reduced
    elements each, at the sizes of one call (kernels over symbolic sizes plan per call)."""
    cpu = device_type == "cpu"
    if r is None:
        n = max(rows, 1)
        xblock = min(triton.next_power_of_2(n), 8192 if cpu else 1024)
        return BlockPlan(xblock, 1, 4, triton.cdiv(n, xblock), True)
    rows, r = max(rows, 1), max(r, 1)
    if persistent_at(r):
        rblock = triton.next_power_of_2(r)
        budget = 16384 if cpu else 4096  # elements per program
        xblock = min(triton.next_power_of_2(rows), max(1, budget // rblock))
        warps = min(16, max(1, xblock * rblock // 512))
        return BlockPlan(xblock, rblock, warps, triton.cdiv(rows, xblock), True)
    rblock = 8192 if cpu else 4096  # H200 sweep (bench/notes.md): 4096 x 8 warps beat 2048 and 8192
    return BlockPlan(1, rblock, 8, rows, False)
