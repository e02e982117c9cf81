"""Block sizes and warps for a region's kernel, by its shape and the device it runs on.

One place decides them, so the cost model's occupancy estimate and the emitted kernel agree.
On CPU the interpreter runs each program in numpy: few, large programs are fastest there.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

from fuser.region import Region


@dataclass(frozen=True)
class BlockPlan:
    xblock: int
    rblock: int        # 1 for pointwise kernels
    num_warps: int
    programs: int
    persistent: bool   # the whole row in registers (reductions), else a loop over R


def block_plan(region: Region, device_type: str) -> BlockPlan:
    space = region.space
    cpu = device_type == "cpu"
    if not space.is_reduction:
        n = max(space.rows, 1)
        xblock = min(triton.next_power_of_2(n), 8192 if cpu else 1024)
        return BlockPlan(xblock, 1, 4, triton.cdiv(n, xblock), True)
    rows, r = max(space.rows, 1), max(space.r, 1)
    if space.persistent:
        rblock = triton.next_power_of_2(r)
        budget = 16384 if cpu else 4096  # elements per program
        xblock = min(triton.next_power_of_2(rows), max(1, budget // rblock))
        warps = min(16, max(1, xblock * rblock // 512))
        return BlockPlan(xblock, rblock, warps, triton.cdiv(rows, xblock), True)
    rblock = 8192 if cpu else 4096  # H200 sweep (bench/notes.md): 4096 x 8 warps beat 2048 and 8192
    return BlockPlan(1, rblock, 8, rows, False)
