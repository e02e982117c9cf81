"""Column sums over many rows become two sums: partial sums of row blocks, then their sum.

A weight's or a bias's gradient sums a [tokens, D] tensor over its tokens.  One program per 64
columns (block_plan's column tiles) gives D/64 programs: 32 for D = 2048 on an H100's 132 SMs,
each looping over all 8192 rows; even D = 8192's 128 programs keep too few loads in flight.  Split S
ways, the first sum runs S*D/64 programs over N/S rows each and writes [S, D] partials in fp32; the
second sums those (a few KiB) and rounds once, as eager's single sum does.  Inductor splits such reductions the same way (its split reductions); here the split
is a graph rewrite, so the partition fuses the prologue into the first sum and the cast into the second.
Only where the sizes are static and the row count has a divisor near the wanted split.

The other way round, a sum over a few elements (at most 8 a result) becomes that many adds, in fp32 and
rounded once, as eager's sum: pointwise, it fuses with consumers that read it at other positions, where a
reduction ends its kernel (GQA's key gradient, summed over the 4 query heads that shared it, is read by
RoPE's gradient at the rotated half; eager ran 8 such sums a llama step, run 84).  Inductor unrolls the
same way (unroll_reductions_threshold = 8).
"""
from __future__ import annotations

import itertools
import math

import sympy
import torch
import torch.fx as fx

from .plan import NUM_SMS
from . import indexing as ix
from . import ops
from .graph import OWN_KERNEL, ComputeGraph, fake_mode_of, insert, replaced, static_shape
from .ops import reduction_dims
from .region import COLUMN_MIN_WIDTH

aten, prims = torch.ops.aten, torch.ops.prims
COLUMNS_A_PROGRAM = 64  # block_plan's column tile
MIN_ROWS_A_PART = 128   # fewer rows a part and the partials' traffic starts to count
# programs the first sum runs: 4 a processor keep enough loads in flight (run 210, bench/column_sums.py, H200:
# [8192, 2048] bf16 37.4 -> 30.4 us, 2 a processor before; 8 and 16 no better, and each part's partials cost)
PROGRAMS_WANTED = 4 * NUM_SMS
DEVICES = ("cuda",)     # where the split pays (tests add "cpu" to run it through the interpreter)


def split_column_sums(gm: fx.GraphModule) -> list[str]:
    """Rewrites gm's column sums in place; returns a line per sum for the report."""
    notes, changed = [], []
    for n in list(gm.graph.nodes):
        parts = _parts(n)
        if parts is None:
            continue
        xv = n.args[0].meta["val"]
        k = len(reduction_dims(n))
        rows, rest = math.prod(xv.shape[:k]), list(xv.shape[k:])
        changed += _sum_in_parts(gm, n, [parts, rows // parts, *rest])
        notes.append(f"{n.name}: {list(xv.shape)} summed over {rows} rows in {parts} parts of {rows // parts}, "
                     "then the parts")
    if notes:
        replaced(gm, changed)
    return notes


def _sum_in_parts(gm: fx.GraphModule, n: fx.Node, blocks: list, divide_by: int | None = None) -> list[fx.Node]:
    """Replaces sum (or mean) `n` by the sums of its input viewed as `blocks` ([parts, a part's rows, the
    rest]) in fp32 for 16-bit values, their sum (our kernels both: eager's column sums are the slower),
    the mean's division by `divide_by`, the cast to n's dtype and a view to n's shape; returns the new nodes."""
    out, graph = n.meta["val"], gm.graph
    acc = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
    with graph.inserting_before(n):
        view = graph.call_function(aten.view.default, (n.args[0], blocks))
        partial = graph.call_function(aten.sum.dim_IntList, (view, [1]), {"dtype": acc})
        total = graph.call_function(aten.sum.dim_IntList, (partial, [0]))
        partial.meta[OWN_KERNEL] = total.meta[OWN_KERNEL] = True
        new = [view, partial, total]
        if divide_by is not None:
            new.append(graph.call_function(aten.div.Tensor, (new[-1], divide_by)))
        if acc != out.dtype:
            new.append(graph.call_function(prims.convert_element_type.default, (new[-1], out.dtype)))
        if list(out.shape) != list(blocks[2:]):  # keepdim
            new.append(graph.call_function(aten.view.default, (new[-1], list(out.shape))))
    n.replace_all_uses_with(new[-1])
    graph.erase_node(n)
    return new


def _parts(n: fx.Node) -> int | None:
    """How many parts to split sum `n` into, or None to leave it: a float sum over the leading dims
    of a contiguous tensor at least COLUMN_MIN_WIDTH wide (narrower ones keep the row layout, one
    program a column), static sizes, too few column tiles to fill the GPU, a divisor of the rows."""
    if n.op != "call_function" or n.target is not aten.sum.dim_IntList or len(n.args) < 2:
        return None
    x = n.args[0]
    xv, out = x.meta.get("val"), n.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or xv.device.type not in DEVICES:
        return None
    if not out.dtype.is_floating_point or out.dtype == torch.float64 or n.kwargs.get("dtype") not in (None, out.dtype):
        return None
    if not static_shape(xv) or not xv.is_contiguous():
        return None
    dims = reduction_dims(n)
    if dims != tuple(range(len(dims))) or len(dims) == xv.dim() or xv.shape[-1] < COLUMN_MIN_WIDTH:
        return None  # not over leading dims only (a whole-tensor sum is a row reduction already)
    rows, columns = math.prod(xv.shape[:len(dims)]), math.prod(xv.shape[len(dims):])
    programs = -(-columns // COLUMNS_A_PROGRAM)
    wanted = min(-(-PROGRAMS_WANTED // programs), rows // MIN_ROWS_A_PART)
    if wanted < 2:
        return None
    parts = next((s for s in range(wanted, 1, -1) if rows % s == 0), 1)
    return parts if parts * 4 >= wanted else None


WHOLE_MIN = 1 << 16  # elements: a smaller whole-tensor sum loops fast enough in one program
MIN_A_PART = 2048      # elements a part at least
WHOLE_PARTS = 4 * NUM_SMS  # parts at most (run 211, H200, bench/column_sums.py --whole: a bf16 [8, 1024, 4096]
# loss's mean 36.0 -> 29.7 us, 2 a processor before; Inductor 38.7)


def split_whole_sums(gm: fx.GraphModule) -> list[str]:
    """A float sum or mean over every element of a large tensor, of a pointwise op's result (a loss:
    `out.float().square().mean()`, `((y - t) ** 2).sum()`), becomes sums of parts and then their sum.
    Whole, it is a row reduction of one row: one program would loop over the tensor, so the partition
    left it to eager, which then read the prologue's result from memory (an fp32 copy of the model's
    output, written and read, and an eager reduction's ~60 us of host; bert, t5 and vit's steps).
    Split, the prologue fuses into the first sum's programs and the mean's division into the second.
    Rewrites gm in place; returns a line per sum for the report."""
    notes, changed, cg = [], [], None
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim):
            continue
        x, out = n.args[0], n.meta.get("val")
        xv = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or xv.device.type not in DEVICES \
                or not out.dtype.is_floating_point or out.dtype == torch.float64 \
                or n.kwargs.get("dtype") not in (None, xv.dtype) or not static_shape(xv) or not xv.is_contiguous():
            continue  # (a dtype= casts every element first: eager's fp16 sum of fp32 values overflows per element)
        numel = xv.numel()
        if len(reduction_dims(n)) != xv.dim() or numel < WHOLE_MIN or x.op != "call_function":
            continue
        cg = cg or ComputeGraph(gm.graph)
        if not isinstance(cg.info.get(x), ops.Pointwise):
            continue  # no prologue to fuse: eager's one reduction is as good as two of ours
        parts = next(s for s in range(min(WHOLE_PARTS, numel // MIN_A_PART), 0, -1) if numel % s == 0)
        if parts * 4 < min(WHOLE_PARTS, numel // MIN_A_PART):
            continue  # no divisor near the wanted split
        changed += _sum_in_parts(gm, n, [parts, numel // parts], divide_by=numel if n.target in (aten.mean.default,
                                                                                           aten.mean.dim) else None)
        notes.append(f"{n.name}: {list(xv.shape)} summed in {parts} parts of {numel // parts}, then the parts")
    if notes:
        replaced(gm, changed)
    return notes


UNROLL = 8  # elements a result at most, as Inductor's unroll_reductions_threshold


def unroll_small_sums(gm: fx.GraphModule, keep: set) -> list[str]:
    """Rewrites gm's float sums over at most UNROLL elements a result (static reduced sizes) as adds, but
    those in `keep` (a recognised attention's softmax) and the split sums' second stage; returns a line
    per sum for the report.  As eager's: fp32 adds from +0 (a sum of -0.0 is +0.0), rounded once, the
    result laid out as eager's (contiguous: a copy where the input's other dims are permuted)."""
    notes, mode = [], None
    for n in list(gm.graph.nodes):
        if n in keep or n.op != "call_function" or n.target is not aten.sum.dim_IntList or n.meta.get(OWN_KERNEL):
            continue
        x, out = n.args[0], n.meta.get("val")
        xv = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or xv.dim() == 0 \
                or not xv.dtype.is_floating_point or not out.dtype.is_floating_point:
            continue
        dims = reduction_dims(n)
        sizes = [xv.shape[d] for d in dims]
        if not all(isinstance(s, int) for s in sizes) or not 2 <= math.prod(sizes) <= UNROLL or not _contiguous(out):
            continue
        mode = mode or fake_mode_of(gm.graph)
        acc = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype

        def call(target, *args, **kwargs):  # inserted before the sum, with its fake value
            return insert(gm.graph, n, mode, target, *args, **kwargs)

        total = None
        for at in itertools.product(*(range(s) for s in sizes)):
            part = x
            for d, i in sorted(zip(dims, at), reverse=True):  # the last dim first: the others keep their numbers
                part = call(aten.select.int, part, d, i)
            if part.meta["val"].dtype != out.dtype:  # sum(x, dtype=D) is x.to(D).sum(): each element rounded to D
                part = call(prims.convert_element_type.default, part, out.dtype)
            if part.meta["val"].dtype != acc:
                part = call(prims.convert_element_type.default, part, acc)
            total = part if total is None else call(aten.add.Tensor, total, part)
        total = call(aten.add.Tensor, total, 0.0)  # eager's sum starts from +0
        if total.meta["val"].dtype != out.dtype:
            total = call(prims.convert_element_type.default, total, out.dtype)
        keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        for d in dims if keepdim else ():
            total = call(aten.unsqueeze.default, total, d)
        if not _contiguous(total.meta["val"]):
            total = call(aten.clone.default, total, memory_format=torch.contiguous_format)
        n.replace_all_uses_with(total)
        gm.graph.erase_node(n)
        notes.append(f"{n.name}: {math.prod(sizes)} elements a result")
    if notes:
        gm.graph.lint()
        gm.recompile()
    return notes


def _contiguous(t: torch.Tensor) -> bool:
    """Row-major on every dim of more than one element, as eager's sum lays out its result (compared as
    expressions: no guards on symbolic sizes)."""
    expected = sympy.Integer(1)
    for size, stride in reversed(list(zip(ix.shape_of(t), ix.stride_of(t)))):
        if size != 1 and sympy.expand(stride - expected) != 0:
            return False
        expected = expected * size
    return True
