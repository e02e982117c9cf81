"""Matmuls whose output width is not a multiple of 16 bytes get their right operand padded.

cuBLAS runs a [2048 x 768] @ [768 x 50257] bf16 product (GPT-2's LM head over the tied embedding)
at 1.68 ms on an H100 and the same product with the weight padded to 50264 columns at 0.24 ms, copy
and slice included (bench/notes.md): an unaligned width sends it to a slow kernel, and padding the
output alone does not help.  Inductor pads the same way (torch._inductor.fx_passes.pad_mm, after
benchmarking both); here the rule is fixed: pad when the width is unaligned and the product is large.
The operand is copied each call in its own memory order (coalesced, padding left unset: it only
reaches output columns that are sliced away), the product is taken, and its first N columns are a
view of it.  Only on CUDA; the sizes must be static.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph import replaced, static_shape

aten = torch.ops.aten
ALIGN_BYTES = 16
MIN_ROWS = 256  # fewer rows (a decode step): the product reads the weight once, a copy would double it
MIN_FLOPS = 2**30
DEVICES = ("cuda",)  # where padding pays (tests add "cpu" to run the rewrite through the interpreter)


def padded_columns(b: torch.Tensor, width: int) -> torch.Tensor:
    """`b` ([..., K, N] or a bias [N]) copied into a buffer `width` >= N columns wide, in b's own
    memory order; columns past N are left unset."""
    shape = (*b.shape[:-1], width)
    if b.dim() >= 2 and b.stride(-2) == 1 and b.stride(-1) != 1:  # column-major (a transposed weight)
        buf = b.new_empty((*b.shape[:-2], width, b.shape[-2])).transpose(-1, -2)
    else:
        buf = b.new_empty(shape)
    buf[..., :b.shape[-1]].copy_(b)
    return buf


def pad_matmuls(gm: fx.GraphModule) -> list[str]:
    """Rewrites the unaligned large mm/addmm of gm in place; returns a line per matmul for the report."""
    notes, changed = [], []
    for n in list(gm.graph.nodes):
        width = _padded_width(n)
        if width is None:
            continue
        if n.target is aten.mm.default:
            a, b = n.args
            extra = ()
        else:  # addmm(bias, a, b): the bias too, where it spans the columns
            bias, a, b = n.args[:3]
            if isinstance(bias, fx.Node) and bias.meta["val"].dim() >= 1 and bias.meta["val"].shape[-1] != 1:
                with gm.graph.inserting_before(n):
                    bias = gm.graph.call_function(padded_columns, (bias, width))
            extra = (bias,)
        with gm.graph.inserting_before(n):
            padded = gm.graph.call_function(padded_columns, (b, width))
            args = (*extra, a, padded, *n.args[3 if extra else 2:])
            product = gm.graph.call_function(n.target, args, dict(n.kwargs))
            cols = gm.graph.call_function(aten.slice.Tensor, (product, 1, 0, n.meta["val"].shape[-1]))
        changed += [padded, product, cols] + [bias for bias in extra if bias is not n.args[0]]
        n.replace_all_uses_with(cols)
        gm.graph.erase_node(n)
        notes.append(f"{n.name}: {list(n.meta['val'].shape)} computed {width} columns wide (aligned)")
    if notes:
        replaced(gm, changed)
    return notes


def _padded_width(n: fx.Node) -> int | None:
    if n.op != "call_function" or n.target not in (aten.mm.default, aten.addmm.default):
        return None
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.device.type not in DEVICES or v.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if not static_shape(v):
        return None
    (rows, cols), k = v.shape, n.args[-1].meta["val"].shape[0] if isinstance(n.args[-1], fx.Node) else 0
    per = ALIGN_BYTES // v.element_size()
    if cols % per == 0 or rows < MIN_ROWS or 2 * rows * cols * int(k) < MIN_FLOPS:
        return None
    return -(-cols // per) * per
