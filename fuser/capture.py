"""Capture: Dynamo + AOT Autograd hand us ATen graphs with a fake tensor on every node.

Dynamo takes models as users call them (ModelOutput, caches, Python control flow: a graph break
leaves that piece to eager).  AOT Autograd lowers each graph to ATen, decomposing the ops we fuse
(layer_norm, softmax, log_softmax, ...) into the primitives our op table lowers, and would hand the
backward graph to the same pipeline.  `compile_graph` is the pipeline on one ATen graph.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions, get_decompositions

from . import ops
from .cost import evaluate
from .graph import shape as node_shape
from .launch import RegionKernel
from .partition import Partitioner
from .report import FusionReport, RegionReport, Unfused
from .rewrite import rewrite

aten = torch.ops.aten
log = logging.getLogger("fuser")


def decompositions() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([aten.native_layer_norm, aten._softmax, aten._log_softmax,
                                     aten._native_batch_norm_legit_no_training]))
    for op in ops.KEEP_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


def _describe(n) -> str:
    v = n.meta.get("val")
    return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else "?"


def compile_graph(gm: fx.GraphModule, graph_index: int = 0) -> tuple[fx.GraphModule, FusionReport]:
    """Partition, emit a kernel per region, rewrite.  What cannot be emitted stays eager, with why."""
    from fuser.codegen.kernel import CodegenError

    part = Partitioner(gm.graph)
    regions = part.partition()
    kept, kernels, dropped = [], [], []
    for region in regions:
        name = f"fused_{len(kept)}"
        try:
            kernel = RegionKernel(region, name)
        except CodegenError as e:
            dropped += [(n, f"codegen: {e}") for n in region.nodes]
            continue
        region.id = len(kept)
        kept.append(region)
        kernels.append(kernel)
    report = FusionReport()
    for region, kernel in zip(kept, kernels):
        cost = part.cost(region)
        report.regions.append(RegionReport(
            id=region.id, graph=graph_index, kind=region.kind,
            ops=[ops.op_name(n) for n in region.nodes],
            input_shapes=[_describe(n) for n in region.inputs],
            output_shapes=[_describe(n) for n in region.outputs],
            bytes_unfused=evaluate(cost.bytes_unfused), bytes_fused=evaluate(cost.bytes_fused),
            bytes_unfused_expr=str(cost.bytes_unfused), bytes_fused_expr=str(cost.bytes_fused),
            launches_unfused=cost.launches_unfused, kernel=kernel.name, source=kernel.source))
        log.debug("region %s (%s, k=%.2f):\n%s", kernel.name, region.kind, cost.k, kernel.source)
    for n, reason in part.unfused(kept) + [(n, r) for n, r in dropped if n.target is not _getitem]:
        report.unfused.append(Unfused(ops.op_name(n), n.name, reason, graph_index))
    devices = {node_shape and n.meta["val"].device.type for n in gm.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor)}
    if "cpu" in devices and kept:
        report.notes.append("CPU tensors: the kernels run through Triton's interpreter (correct, slow; for tests)")
    new = rewrite(gm, kept, kernels) if kept else gm
    report.code.append(new.code)
    return new, report


_getitem = __import__("operator").getitem
