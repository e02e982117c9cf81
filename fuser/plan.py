"""Launch configs: block sizes and warps for a region's kernel (by its sizes and the device it runs
on) and for the attention kernel, and the signature (shapes, strides, dtype) a kernel is made for.

One place decides them, so the cost model's occupancy estimate and the launched kernel agree.
On CPU the interpreter runs each program in numpy: few, large programs are fastest there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import indexing as ix
from .region import persistent_at


NUM_SMS = 132  # programs needed to keep every SM of an H100 / H200 busy
SHARED_MEMORY = 227 * 1024  # bytes of shared memory a Hopper block may take


def next_pow2(n: int) -> int:
    """The least power of 2 >= n (1 for n <= 1).  This and cdiv are triton.next_power_of_2's and
    triton.cdiv's values without their cost on the launch path (ConstexprFunctions in Triton 3.9:
    6-15 us a call)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockPlan:
    xblock: int
    rblock: int        # 1 for pointwise kernels
    num_warps: int
    programs: int
    persistent: bool   # the whole row in registers (reductions), else a loop over R


WIDE = 2**31  # element offsets from here on need 64-bit index math (region and attention kernels alike)


def max_offset(shape, stride) -> int:
    """One past the largest element offset a tensor of this shape and these strides reaches."""
    return sum((s - 1) * abs(st) for s, st in zip(shape, stride)) + 1


COLUMN_TILE = (64, 4096, 8)  # a looped column reduction's columns a program, elements a tile, warps


def block_plan(rows: int, r: int | None, device_type: str, column: bool = False) -> BlockPlan:
    """The launch config for `rows` rows (elements, for pointwise kernels: r None) of `r` reduced
    elements each, at the sizes of one call (kernels over symbolic sizes plan per call).  `column`:
    the rows are the contiguous dim (Region.column): past a few reduced elements, tiles of 64 rows x
    64 reduced (a 128-byte line of 16-bit columns a load), looped."""
    cpu = device_type == "cpu"
    if r is None:
        n = max(rows, 1)
        xblock = min(next_pow2(n), 8192 if cpu else 1024)
        return BlockPlan(xblock, 1, 4, cdiv(n, xblock), True)
    rows, r = max(rows, 1), max(r, 1)
    if column and not persistent_at(r, column):
        xblock = min(next_pow2(rows), COLUMN_TILE[0])
        return BlockPlan(xblock, (16384 if cpu else COLUMN_TILE[1]) // xblock, COLUMN_TILE[2], cdiv(rows, xblock), False)
    if persistent_at(r):
        rblock = next_pow2(r)
        budget = 16384 if cpu else 4096  # elements per program
        xblock = min(next_pow2(rows), max(1, budget // rblock))
        warps = min(16, max(1, xblock * rblock // 512))
        return BlockPlan(xblock, rblock, warps, cdiv(rows, xblock), True)
    rblock = 8192 if cpu else 4096  # H200 sweep (bench/notes.md): 4096 x 8 warps beat 2048 and 8192
    return BlockPlan(1, rblock, 8, rows, False)


@dataclass(frozen=True)
class TensorSig:
    """Shape and strides: ints, or sympy expressions in the graph's size symbols (and, for an input
    of a generic-strides variant, in symbols naming its strides, passed at launch)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSig":
        """A real tensor's signature in ints; a fake one's in expressions."""
        if any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())):
            return TensorSig(ix.shape_of(t), ix.stride_of(t), t.dtype)
        return TensorSig(tuple(t.shape), tuple(t.stride()), t.dtype)


def attention_plan(head_dim: int, dtype, on_gpu: bool, listed: bool = False,
                   head_dim_v: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); `listed`: the kernel walks a data mask's tile lists; `head_dim_v`:
    V's head dim where it differs from Q's and K's (`head_dim`).

    GPU: the fastest of sweeps (bench/attention_tiles.py, scratch sweeps of runs 50-51); every pick fits Hopper's
    227 KiB of shared memory.  16-bit D128, tiles computed from the structure (causal, soft-cap, ALiBi, no mask,
    GQA; H100 run 20, H200 run 51): 64x64, 4 warps, 3 stages, by 6-50% over 128-row tiles; over a data mask's
    lists (H200 runs 50-51): 128x64, 8 warps, 3 stages (0.62 against 0.74 ms with padding, 0.83 against 0.96
    causal).  16-bit D64 (H200 runs 50-51, soft-cap and lists): 64x64, 4 warps, 3 stages (0.24 against 0.31 ms
    for 128x64, 8 warps, which won H100's run 20 on a chain with no score mod).  fp32 dots are IEEE, on FMA
    units rather than tensor cores, so they want tiles small enough to keep the fp32 accumulator in registers
    (larger ones spill: 128x32 at D=128 ran 14x slower).
    16-bit past D128: 128x64, 8 warps, as many stages (up to 3) as shared memory holds: MLA's q/k 192 (padded to
    256), v 128 (H200 run 222): 3 stages 0.99 ms against 2 stages' 1.17 (FlexAttention 1.21); D256: 2 stages.
    CPU (interpreter): small tiles keep the numpy emulation fast and still exercise several blocks.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if not on_gpu:
        return 16, 16, 1, 1
    widest = max(head_dim, head_dim_v)
    if dtype == torch.float32:
        if widest <= 64:
            return 128, 32, 4, 2
        return (32, 64, 4, 2) if widest <= 128 else (32, 32, 4, 2)
    if widest <= 64:
        return 64, 64, 4, 3
    if widest <= 128:
        return (128, 64, 8, 3) if listed else (64, 64, 4, 3)
    bd, bdv = next_pow2(head_dim), next_pow2(head_dim_v)
    stages = 3 if 3 * 64 * (bd + bdv) * 2 + 128 * bd * 2 <= SHARED_MEMORY else 2  # K and V tiles a stage, Q's tile
    return 128, 64, 8, stages


def attention_bwd_plan(head_dim: int, dtype, on_gpu: bool, head_dim_v: int | None = None,
                       listed: bool = False) -> tuple[tuple, tuple]:
    """((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, that of the dQ kernel): the dK/dV kernel
    owns BLOCK_N keys and walks the queries BLOCK_M at a time, the dQ kernel the other way round (over a data
    mask's tile lists, made for one tile shape, both take the dQ kernel's).  Run 120 (H200, ALiBi and window,
    each kernel swept with the other as shipped): 64x64 won both; 128 keys a dK/dV program ran 2.1-2.3x slower
    (its two fp32 accumulators spill).  GPU, 16-bit: D128 64x64,
    4 warps, 2 stages won sweeps of 6-8 shared configs (H100 run 24: soft-cap 5.02 ms a step against 5.88 with 3
    stages; H200 run 51: soft-cap and a padding mask's lists, 128x64 8 warps within 7% on dK/dV, 30% slower on
    dQ); D64 64x64, 4 warps, 3 stages (H200 runs 50-51: 0.46 ms of dK/dV + dQ over lists against 0.73 for the
    forward's old 128x64, 8 warps).  Past D128 (H200 run 223, MLA's q/k 192, v 128, causal, a step): dK/dV 64x32, 4
    warps, 2 stages, dQ 128x64, 8 warps, 2 stages, 4.99 ms (FlexAttention 7.43; 64x64 both 8.28; dK/dV at 128x64
    asks 258 KiB of shared memory), dQ 64x64 where its 128-row tiles would not fit (D256).  `listed`: the two
    kernels share one tile shape (a data mask's lists are made for one): past D128 64x64, which fits both.  fp32
    takes the forward's plan."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    widest = max(head_dim, head_dim_v)
    if not on_gpu or dtype == torch.float32:
        cfg = attention_plan(head_dim, dtype, on_gpu, head_dim_v=head_dim_v)
        return cfg, cfg
    if widest <= 128 or listed:
        cfg = (64, 64, 4, 3) if widest <= 64 else (64, 64, 4, 2)
        return cfg, cfg
    dims = next_pow2(head_dim) + next_pow2(head_dim_v)
    fits = 2 * 64 * dims * 2 + 128 * dims * 2 <= SHARED_MEMORY  # K, V tiles over 2 stages; Q's and dO's
    return (64, 32, 4, 2), (128, 64, 8, 2) if fits else (64, 64, 4, 2)


EMBEDDING_PARTIAL_BYTES = 1 << 20


@dataclass(frozen=True)
class EmbeddingGradPlan:
    """The one-hot embedding gradient's launch (codegen/embedding.py): [BV table rows, BD columns] a
    program, BN indices a step, the indices split in `split` parts of `chunk` (a multiple of BN), whose
    fp32 partial sums a second kernel adds when split > 1."""
    bv: int
    bd: int
    bn: int
    split: int
    chunk: int

    def programs(self, v: int, d: int) -> tuple[int, int, int]:
        return cdiv(v, self.bv), cdiv(d, self.bd), self.split


def embedding_grad_plan(n: int, v: int, d: int) -> EmbeddingGradPlan:
    """Tiles of 64 (tl.dot wants 16 at least: a narrower table, T5's 8 heads, is masked), and the indices
    split until about two programs an SM, each program at least 4 steps of BN indices, the fp32 partials
    within EMBEDDING_PARTIAL_BYTES (they are made at the backward's end: bert's 3 splits of its position
    table took its step's peak 1 MiB over Inductor's, run 82)."""
    bv, bd, bn = 64, max(16, min(64, next_pow2(d))), 64
    tiles = cdiv(v, bv) * cdiv(d, bd)
    split = max(1, min(cdiv(2 * NUM_SMS, tiles), cdiv(n, 4 * bn), EMBEDDING_PARTIAL_BYTES // max(1, v * d * 4)))
    chunk = cdiv(cdiv(n, split), bn) * bn
    return EmbeddingGradPlan(bv, bd, bn, cdiv(n, chunk) if n else 1, chunk)


@dataclass(frozen=True)
class ScatterPlan:
    """The scattered embedding gradient's launches (codegen/embedding.py): BLOCK table elements zeroed a
    program, [BN indices, BD columns] a program for the sums."""
    block: int
    bn: int
    bd: int
    num_warps: int


def scatter_plan(d: int) -> ScatterPlan:
    """A fill of 2048 elements a program (Inductor's pointwise blocks are 1024-2048); 32 gradient rows of up
    to 128 columns a program: wide rows split across programs, narrow ones still 16 wide.  Not swept."""
    return ScatterPlan(2048, 32, max(16, min(128, next_pow2(d))), 4)
