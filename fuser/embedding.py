"""An embedding's gradient over a small table (positions, token types, relative-position buckets) as our kernel.

aten.embedding_dense_backward stays whole in the graph (ops.KEEP_WHOLE: decomposed, it is an index_put with
accumulate).  Eager runs it as a fill of the table and either a feature kernel (up to 3072 indices: 54-76 us a
call on an H200 whatever the table, run 70) or a sort of the indices and segment sums (~15 launches: T5's
relative bias, 65536 indices into 32 buckets).  For a small table, one-hot rows times the gradient rows
(codegen/embedding.py) is one launch (two where the indices are split across programs), exact in fp32 and
deterministic.  The cost model picks, per call site (cost.embedding_grad_times): a word embedding's table
(tens of thousands of rows) stays with eager, whose cost does not grow with a block of rows re-reading
the gradient.  Not taken: scale_grad_by_freq, symbolic sizes, and bf16 on CPU (the interpreter's tl.dot
is wrong in bf16).
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from fuser.codegen.embedding import DTYPES, KERNEL, SUM_KERNEL, prepare, prepare_sum, source

from . import dtypes
from .cost import embedding_grad_times
from .graph import OWN_CALL, meta, static_shape
from .plan import embedding_grad_plan
from .runtime import launch

aten = torch.ops.aten
MAX_ROWS = 4096  # tables past this stay eager whatever the model says (its fill and reads grow with them)


def embedding_dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> torch.Tensor:
    """aten.embedding_dense_backward's value, by our kernels: the [num_weights, D] sum of the gradient
    rows of each index, rows whose index is padding_idx left out."""
    d, n = grad.shape[-1], indices.numel()
    if num_weights == 0 or d == 0:  # nothing to sum: eager's CUDA kernel reads past a [V, 0] table (illegal access)
        return grad.new_zeros(num_weights, d)
    if not _ours(grad, n, num_weights, d) or scale_grad_by_freq:  # `lower` routes none of these here
        return aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    out = grad.new_empty(num_weights, d)
    if n == 0:
        return out.zero_()
    g2 = grad.reshape(n, d)
    g2 = g2 if g2.stride(-1) == 1 or d == 1 else g2.contiguous()
    idx = indices.reshape(-1).contiguous()
    plan = embedding_grad_plan(n, num_weights, d)
    device = grad.device.type
    with dtypes.target(device):
        src = source(grad.dtype)
    with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():  # launches go to the current one
        if plan.split == 1:
            grid, args, config = prepare(g2, idx, out, num_weights, padding_idx, plan, partial=False)
            launch(src, KERNEL, grid, args, config, device)
            return out
        part = grad.new_empty(plan.split, num_weights, d, dtype=torch.float32)
        grid, args, config = prepare(g2, idx, part, num_weights, padding_idx, plan, partial=True)
        launch(src, KERNEL, grid, args, config, device)
        grid, args, config = prepare_sum(part, out)
        launch(src, SUM_KERNEL, grid, args, config, device)
    return out


def _ours(grad: torch.Tensor, n: int, v: int, d: int) -> bool:
    """What the kernels take: a float gradient on CUDA (on CPU, not bf16: the interpreter's tl.dot is wrong
    there), a table with rows and columns, offsets within int32 (n * D, V * D)."""
    device_ok = grad.device.type == "cuda" or (grad.device.type == "cpu" and grad.dtype != torch.bfloat16)
    return grad.dtype in DTYPES and device_ok and v > 0 and d > 0 and n * d < 2**31 and v * d < 2**31


def lower(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Marks each embedding gradient of gm our kernel takes (the wrapper then calls `embedding_dense_backward`:
    runtime.fast_calls); returns (node, a line for the report) for each."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.embedding_dense_backward.default:
            continue
        why = _taken(n)
        if why is not None:
            n.meta[OWN_CALL] = embedding_dense_backward
            out.append((n, why))
    return out


def _taken(n: fx.Node) -> str | None:
    if n.kwargs or len(n.args) != 5:
        return None
    grad, indices, num_weights, _, scale = n.args
    g, i = meta(grad), meta(indices)
    if scale or g is None or i is None or not isinstance(num_weights, int):
        return None
    if i.dtype not in (torch.int32, torch.int64) or num_weights > MAX_ROWS or g.dim() == 0:
        return None
    if not (static_shape(g) and static_shape(i)):
        return None
    rows, d = i.numel(), g.shape[-1]
    if num_weights == 0 or d == 0:
        return f"{n.name}: an empty [{num_weights}, {d}] table's gradient, no kernel (eager's CUDA kernel reads past it)"
    if not _ours(g, rows, num_weights, d):
        return None
    ours, eager = embedding_grad_times(rows, num_weights, d, g.element_size())
    if ours >= eager:
        return None
    return (f"{n.name}: a [{num_weights}, {d}] table's gradient over {rows} indices, one-hot rows x gradient "
            f"rows (modelled {ours * 1e6:.1f} us, eager's {eager * 1e6:.1f})")
