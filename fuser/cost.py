"""The cost model: HBM bytes and kernel launches, unfused vs fused, as sympy expressions.

On memory-bound work time is bytes over bandwidth.  Unfused, every compute node is an eager kernel
that reads its inputs and writes its output; a chain of k same-shape ops moves 2kN elements.  Fused,
the region reads each input once per pass over it and writes each output once: 2N, so k = 2kN / 2N.
A region is kept only where its modelled time beats the eager time of its nodes (where the GPU work is shorter
than the host's time to issue the launches, the host's: host_bound).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from . import indexing as ix
from . import ops
from .graph import ComputeGraph, cpu_scalar, is_generator, meta, numel, operands
from .plan import NUM_SMS, block_plan, embedding_grad_plan  # one place picks block sizes
from .region import Region

HBM_BYTES_PER_S = 3.0e12   # about what an H100/H200 copy moves; only ratios matter for decisions
LAUNCH_S = 4e-6            # one eager kernel launch (and its gap) on a GPU
# eager's elementwise kernel leaves TensorIterator's vectorised path when an operand is broadcast or
# of another dtype than the result: measured at 0.39-0.57x of a copy's bandwidth (H100, bf16
# [32000, 2048]: times a 0-d fp32 CUDA tensor 1131 GB/s, a row-broadcast bias 1532, .float() 1923,
# a same-dtype product 2919; bench/notes.md, run 38); or laid out otherwise than the result: GQA's
# repeated K and V and the attention gradients made contiguous moved 216 MB in 245 us (H200, run 84:
# 0.88 TB/s against a 4.27 TB/s copy)
EAGER_SLOW_PATH = 0.5
EAGER_STRIDED = 0.25
# ops eager runs as two kernels: `where` with a number wraps it in a 0-d tensor on the result's device first
# (scalar_tensor: a fill launched per call, seen as 4 extra launches a llama decode step, run 154, from the
# NaN fix-up after SDPA that codegen/sdpa.py builds); masked_fill out of place clones, then fills in place
_TWO_LAUNCHES = (torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.ScalarOther, torch.ops.aten.where.Scalar,
                 torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill.Tensor)
# The host's time to issue one of our kernels and one eager op in a compiled graph.  Where the GPU work is shorter
# (a decode step's norm over the vocabulary), the graph takes the host's time, a launch at a time.  Run 92 (the
# H200's host) measured 14-20 us a kernel of ours inside a training step, more an eager op (an eager reduction's
# ~60 us: split.py); runs 218-219 (bench/few_rows.py) timed splits of 2-5 launches, 1-4 of them eager ops, at
# 11-145 us, which ~10 us a kernel of ours and ~30 an eager op fit (noisy: one split moved 2.5x between the runs)
HOST_KERNEL_S = 15e-6
HOST_EAGER_S = 30e-6


def tensor_bytes(n, elems=None) -> sympy.Expr:
    """Bytes of a node's tensor (or of `elems` of its elements), symbolic where its sizes are."""
    return (numel(n) if elems is None else sympy.sympify(elems)) * meta(n).element_size()


@dataclass
class Cost:
    """Bytes as expressions in the graph's sizes; decisions use their values at the hints (the sizes
    seen at capture)."""
    bytes_unfused: sympy.Expr
    bytes_fused: sympy.Expr
    launches_unfused: int
    programs: int
    sizes: ix.Sizes

    @property
    def k(self) -> float:
        fused = self.sizes.hint(self.bytes_fused)
        return float(self.sizes.hint(self.bytes_unfused)) / fused if fused else 1.0

    def time_fused(self) -> float:
        occupancy = min(1.0, self.programs / NUM_SMS)
        return self.sizes.hint(self.bytes_fused) / (HBM_BYTES_PER_S * occupancy) + LAUNCH_S


def host_bound(gpu_s: float, kernels: int, eager_ops: int) -> float:
    """Seconds of work whose GPU time is `gpu_s`, issued as `kernels` of ours and `eager_ops` eager ops: the
    longer of the GPU's time and the host's.  Weighs a reduction's neighbourhood as one kernel against it split
    (Partitioner.absorb_whole): over few long rows the one kernel's few programs take more GPU time than the
    split's pieces, and less than the host takes to issue those pieces."""
    return max(gpu_s, kernels * HOST_KERNEL_S + eager_ops * HOST_EAGER_S)


def eager_cost(cg: ComputeGraph, n, generators: bool = False) -> tuple[sympy.Expr, int]:
    """Bytes and launches of one compute node run as its own eager kernel; with `generators`, also those
    of the generators it reads (an arange, a full: transparent in our kernels, which compute them from
    the index, but run by eager for an op left to it; HF's KV-cache position `arange(1) + length` was an
    eager arange and an eager add a layer of a decode step, run 154)."""
    if n.target is operator.getitem:
        return sympy.Integer(0), 0
    if is_generator(n):
        return tensor_bytes(n), 1
    if generators:
        b, launches = eager_cost(cg, n)
        for g in _generators_read(cg, n):
            b, launches = b + 2 * tensor_bytes(g), launches + 1  # written by its kernel, read by n's
        return b, launches
    reads = sum((tensor_bytes(a, cg.read_elems(n, a)) for a in cg.data_inputs(n)), sympy.Integer(0))
    outs = meta(n)
    if isinstance(cg.info.get(n), ops.Scatter):  # in place: the indexed positions alone
        writes = tensor_bytes(n, ix.numel(cg.store_shape(n)))
    elif outs is not None:
        writes = tensor_bytes(n)
    else:  # multi-output ops (var_mean): every tensor they return
        writes = sum((ix.numel(t.shape) * t.element_size() for t in n.meta["val"] if isinstance(t, torch.Tensor)),
                     sympy.Integer(0))
    return reads + writes, 2 if n.target in _TWO_LAUNCHES else 1


def _generators_read(cg: ComputeGraph, n) -> list:
    """The generators n reads, directly or through views, that eager runs as kernels (not 0-d CPU ones)."""
    found, todo = [], [a for a in operands(n) if isinstance(a, fx.Node)]
    while todo:
        a = todo.pop()
        if a.op != "call_function" or not cg.transparent(a) or a in found:
            continue
        if is_generator(a):
            if not cpu_scalar(meta(a)):
                found.append(a)
        else:
            todo.extend(o for o in operands(a) if isinstance(o, fx.Node))
    return found


def region_cost(region: Region) -> Cost:
    """The region's bytes and launches; occupancy from the programs its GPU kernel launches."""
    cg = region.cg
    unfused, launches = sympy.Integer(0), 0
    for n in region.nodes:
        b, l = eager_cost(cg, n)
        unfused, launches = unfused + b, launches + l
    passes = region.passes()
    fused = sympy.Integer(0)
    for a in region.inputs:
        elems = max((cg.read_elems(c, a) for c in region.nodes if a in cg.data_inputs(c)), key=cg.sizes.hint)
        fused += tensor_bytes(a, elems) * passes[a]
    for o in region.outputs:
        fused += tensor_bytes(o, ix.numel(cg.store_shape(o)))
    space, hint = region.space, cg.sizes.hint
    plan = block_plan(hint(space.rows), hint(space.r) if space.is_reduction else None, "cuda", region.column)
    return Cost(unfused, fused, launches, plan.programs, cg.sizes)


def eager_slow_path(cg: ComputeGraph, n) -> bool:
    return eager_bandwidth(cg, n) < 1.0


def eager_bandwidth(cg: ComputeGraph, n) -> float:
    """The share of a copy's bandwidth eager's kernel for a pointwise op or a copy reaches: less where
    it is not vectorised, for a tensor operand broadcast to the result's shape, cast from another
    float dtype, or laid out otherwise than the result (permuted, sliced, expanded).  Not slow: a
    0-d CPU tensor (passed as a scalar), a generator (no read), an operand whose dtype the op's
    signature fixes (where's and masked_fill's bool condition, a comparison's operands, indices)."""
    out = meta(n)
    if not (isinstance(cg.info.get(n), ops.Pointwise) or is_copy(cg, n)) or not isinstance(out, torch.Tensor):
        return 1.0
    read = [o for o in operands(n) if isinstance(meta(o), torch.Tensor) and not cpu_scalar(meta(o)) and not is_generator(o)]
    if any(_other_layout(cg, meta(o), out) for o in read):
        return EAGER_STRIDED
    total = cg.sizes.hint(numel(n))
    for a in cg.data_inputs(n):
        v = meta(a)
        if not isinstance(v, torch.Tensor) or cpu_scalar(v) or is_generator(a):
            continue
        if cg.sizes.hint(cg.read_elems(n, a)) < total:
            return EAGER_SLOW_PATH
        if v.dtype != out.dtype and v.dtype.is_floating_point and out.dtype.is_floating_point:
            return EAGER_SLOW_PATH
    return 1.0


def is_copy(cg: ComputeGraph, n) -> bool:
    """A layout op eager runs as an elementwise copy of one same-shape operand (clone, contiguous())."""
    kind, args = cg.info.get(n), [o for o in operands(n) if isinstance(meta(o), torch.Tensor)]
    return isinstance(kind, ops.Layout) and kind.copies and not kind.indirect and len(args) == 1 \
        and ix.shape_of(meta(args[0])) == ix.shape_of(meta(n))


def _other_layout(cg: ComputeGraph, v: torch.Tensor, out: torch.Tensor) -> bool:
    """An operand of the result's shape whose strides differ from the result's on a dimension of more
    than one element (sizes at their hints): TensorIterator cannot iterate both as one flat run."""
    if v.layout != torch.strided or v.dim() != out.dim():
        return False
    hint = cg.sizes.hint
    shape = [hint(s) for s in ix.shape_of(out)]
    if [hint(s) for s in ix.shape_of(v)] != shape:
        return False
    return any(size > 1 and hint(a) != hint(b) for size, a, b in zip(shape, ix.stride_of(v), ix.stride_of(out)))


def eager_time(cg: ComputeGraph, n) -> float:
    b, launches = eager_cost(cg, n, generators=True)
    bandwidth = HBM_BYTES_PER_S * eager_bandwidth(cg, n)
    return cg.sizes.hint(b) / bandwidth + launches * LAUNCH_S


# eager's embedding gradient (aten.embedding_dense_backward on CUDA): up to 3072 indices, a feature kernel that
# took 54-76 us a call whatever the table (H200, run 70: bert's 3 tables 227 us, gpt2's 2 107, t5's 80) and a
# fill of the table; past that, a sort of the indices and segment sums: ~15 launches (t5's relative bias)
EAGER_EMBEDDING_FEATURE_S = 50e-6
EAGER_EMBEDDING_FEATURE_MAX = 3072
EAGER_EMBEDDING_SORT_LAUNCHES = 15


def embedding_grad_times(n: int, v: int, d: int, e: int) -> tuple[float, float, float]:
    """(our one-hot kernel's modelled seconds, our scatter's, eager's) for the gradient of a [v, d] table of
    e-byte elements over n indices.  The one-hot kernel reads the gradient once per block of table rows (and
    its fp32 partials once more where the indices are split); the scatter writes the table once (and the
    indexed rows again), with fp32 sums of the gradient rows zeroed, added into and read; eager reads the
    gradient once and writes the table twice (fill, then rows)."""
    plan = embedding_grad_plan(n, v, d)
    pv, _, split = plan.programs(v, d)
    partials = 2 * split * v * d * 4 if split > 1 else 0
    one_hot = (pv * n * (d * e + 8) + partials + v * d * e) / HBM_BYTES_PER_S + (1 + (split > 1)) * LAUNCH_S
    scatter = (v * d * e + 2 * n * d * e + 16 * n * d + 36 * n) / HBM_BYTES_PER_S + 3 * LAUNCH_S
    fixed = EAGER_EMBEDDING_FEATURE_S + 2 * LAUNCH_S if n <= EAGER_EMBEDDING_FEATURE_MAX \
        else EAGER_EMBEDDING_SORT_LAUNCHES * LAUNCH_S
    return one_hot, scatter, (n * (d * e + 8) + 2 * v * d * e) / HBM_BYTES_PER_S + fixed
