"""Capture: Dynamo + AOT Autograd hand us ATen graphs with a fake tensor on every node.

Dynamo takes models as users call them (ModelOutput, caches, Python control flow: a graph break
leaves that piece to eager).  AOT Autograd lowers each graph to ATen, decomposing the ops we fuse
(layer_norm, softmax, log_softmax, ...) into the primitives our op table lowers, and would hand the
backward graph to the same pipeline.  `compile_graph` is the pipeline on one ATen graph.
"""
from __future__ import annotations

import logging
import operator

import sympy
import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._prims_common import get_computation_dtype

from . import ops
from .cost import eager_cost, evaluate, tensor_bytes
from .graph import ComputeGraph
from .launch import AttentionKernel, RegionKernel
from .partition import Partitioner
from .report import FusionReport, RegionReport, Unfused
from .rewrite import rewrite

aten = torch.ops.aten
log = logging.getLogger("fuser")


def decompositions() -> dict:
    table = dict(core_aten_decompositions())
    # torch's own decompositions of the norms: var_mean, rsqrt and pointwise ops, which we fuse.  All
    # BatchNorm entry points are listed, since each decomposes through the next (the eval one calls
    # the mutating `_native_batch_norm_legit`, which must decompose too, functionally in eval); the
    # backward ones (native_batch_norm_backward, native_group_norm_backward) are core decompositions.
    # `repeat` (InstanceNorm repeats its affine per sample) becomes expand + reshape: index math.
    table.update(get_decompositions([
        aten.native_layer_norm, aten._softmax, aten._log_softmax, aten.repeat,
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional, aten._batch_norm_with_update_functional,
        aten._batch_norm_no_update]))
    table[aten.native_group_norm.default] = native_group_norm
    table[aten.native_group_norm_backward.default] = native_group_norm_backward
    table[aten.copy.default] = copy
    for op in ops.KEEP_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


def native_group_norm(x, weight, bias, n: int, c: int, hw: int, groups: int, eps: float):
    """GroupNorm with all its per-element work in the [N, G, C/G, HW] space of its reduction, so the
    statistics, the normalisation and the affine are one kernel.  Not torch's decomposition: on CPU
    it folds the affine into per-(N, C) scale and shift through `as_strided`, and on GPU it applies the
    affine after viewing back to [N, C, ...]; either way the affine leaves the reduction's space."""
    dtype = get_computation_dtype(x.dtype)
    rows = x.to(dtype).reshape(n, groups, c // groups, hw)
    var, mean = torch.var_mean(rows, dim=[2, 3], correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (rows - mean) * rstd
    if weight is not None:
        out = out * weight.reshape(1, groups, c // groups, 1)
    if bias is not None:
        out = out + bias.reshape(1, groups, c // groups, 1)
    return out.to(x.dtype).reshape(x.shape), mean.to(x.dtype).reshape(n, groups), rstd.to(x.dtype).reshape(n, groups)


def native_group_norm_backward(dy, x, mean, rstd, weight, n: int, c: int, hw: int, groups: int, mask):
    """GroupNorm's gradient as two kernels: the input's (two sums per group, then the per-element
    formula) and the affine's (two sums per channel).  Not torch's decomposition: it sums per (N, C)
    first, then per group, and those reductions over different spaces are six kernels."""
    dtype = get_computation_dtype(x.dtype)
    shape = (n, groups, c // groups, hw)
    dy, rows = dy.to(dtype).reshape(shape), x.to(dtype).reshape(shape)
    xhat = (rows - mean.to(dtype).reshape(n, groups, 1, 1)) * rstd.to(dtype).reshape(n, groups, 1, 1)
    dx = dw = db = None
    if mask[0]:
        g = dy if weight is None else dy * weight.to(dtype).reshape(1, groups, c // groups, 1)
        m = shape[2] * shape[3]
        g_mean = torch.sum(g, dim=[2, 3], keepdim=True) / m
        gx_mean = torch.sum(g * xhat, dim=[2, 3], keepdim=True) / m
        dx = ((g - g_mean - xhat * gx_mean) * rstd.to(dtype).reshape(n, groups, 1, 1)).to(x.dtype).reshape(x.shape)
    out_dtype = (x if weight is None else weight).dtype
    if mask[1]:
        dw = torch.sum(dy * xhat, dim=[0, 3]).reshape(c).to(out_dtype)
    if mask[2]:
        db = torch.sum(dy, dim=[0, 3]).reshape(c).to(out_dtype)
    return dx, dw, db


def copy(dst, src, non_blocking=False):
    """Functional `dst.copy_(src)` (InstanceNorm's running-stat update): src cast and broadcast to
    dst's shape, index math plus a cast.  torch has no decomposition of it (Inductor lowers it)."""
    return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()


def _describe(n) -> str:
    v = n.meta.get("val")
    return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else "?"


def compile_graph(gm: fx.GraphModule, graph_index: int = 0, attention: bool = True) -> tuple[fx.GraphModule, FusionReport]:
    """Recognise attention, partition the rest, emit a kernel per region, rewrite.  What cannot be
    emitted stays eager, with the reason."""
    from fuser.codegen.kernel import CodegenError
    from fuser.patterns.attention import find

    cg = ComputeGraph(gm.graph)
    attentions = find(gm.graph, cg) if attention else []
    taken = {n for a in attentions for n in a.nodes}
    part = Partitioner(gm.graph, supported=lambda n: n not in taken, cg=cg)
    report, units, kernels, dropped = FusionReport(), [], [], []
    for a in attentions:
        kernel = AttentionKernel(a, cg, f"attention_{a.id}")
        units.append(a)
        kernels.append(kernel)
        report.regions.append(_attention_report(a, cg, kernel, graph_index, len(report.regions)))
    for region in part.partition():
        try:
            kernel = RegionKernel(region, f"fused_{region.id}")
        except CodegenError as e:
            dropped += [(n, f"codegen: {e}") for n in region.nodes]
            continue
        units.append(region)
        kernels.append(kernel)
        cost = part.cost(region)
        report.regions.append(RegionReport(
            id=len(report.regions), graph=graph_index, kind=region.kind,
            ops=[ops.op_name(n) for n in region.nodes],
            input_shapes=[_describe(n) for n in region.inputs],
            output_shapes=[_describe(n) for n in region.outputs],
            bytes_unfused=evaluate(cost.bytes_unfused), bytes_fused=evaluate(cost.bytes_fused),
            bytes_unfused_expr=str(cost.bytes_unfused), bytes_fused_expr=str(cost.bytes_fused),
            launches_unfused=cost.launches_unfused, kernel=kernel.name, source=kernel.source))
        log.debug("region %s (%s, k=%.2f):\n%s", kernel.name, region.kind, cost.k, kernel.source)
    fused = {n for u in units for n in u.nodes}
    reasons = dict(part.unfused([u for u in units if u not in attentions]))
    reasons.update(dropped)  # a region dropped at codegen: its nodes say why, once
    for n, reason in reasons.items():
        if n not in fused and n.target is not operator.getitem:
            report.unfused.append(Unfused(ops.op_name(n), n.name, reason, graph_index))
    devices = {n.meta["val"].device.type for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    if "cpu" in devices and units:
        report.notes.append("CPU tensors: the kernels run through Triton's interpreter (correct, slow; for tests)")
    new = rewrite(gm, units, kernels) if units else gm
    report.code.append(new.code)
    return new, report


def _attention_report(a, cg, kernel, graph_index, rid) -> RegionReport:
    """Unfused, every op of the attention is an eager kernel (the scores go to HBM and back each
    time); fused, q, k, v and the masks are read once and the output written once."""
    unfused = sum((eager_cost(cg, n)[0] for n in a.nodes if cg.is_compute(n)), sympy.Integer(0))
    fused = sum((tensor_bytes(n) for n in [*a.inputs, a.out]), sympy.Integer(0))
    return RegionReport(
        id=rid, graph=graph_index, kind="attention", ops=[ops.op_name(n) for n in a.nodes if cg.is_compute(n)],
        input_shapes=[_describe(n) for n in a.inputs], output_shapes=[_describe(a.out)],
        bytes_unfused=evaluate(unfused), bytes_fused=evaluate(fused), bytes_unfused_expr=str(unfused),
        bytes_fused_expr=str(fused), launches_unfused=sum(eager_cost(cg, n)[1] for n in a.nodes if cg.is_compute(n)),
        kernel=kernel.name, source=kernel.source)

