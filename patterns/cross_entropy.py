"""A linear layer whose logits feed only a cross-entropy (the LM head and its loss), found in the ATen
graph traced before autograd.

Shape as make_fx leaves `F.cross_entropy(lm_head(h).float().view(-1, V), labels)`:
`nll_loss_forward(_log_softmax(view(_to_copy(_unsafe_view(mm(view(h), t(W)))))), target)`, with
`addmm(b, ...)` for a biased head.  Where nothing else reads the logits, the pair becomes one chunked
op (fuser/linear_ce.py) that never holds the [tokens x vocabulary] logits.  Where something else
does (a model compiled whole returns its logits, as Hugging Face's do), the logits exist anyway: the
match says so (`returns_logits`) and the op taking its place returns them, holding neither their fp32
upcast nor their [tokens x vocabulary] gradient.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fuser.graph import computed_from, meta

aten = torch.ops.aten
# between the matmul and the log-softmax: reshapes of the [N, V] rows and a float cast
_PASS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
         aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.alias.default}
_REDUCTIONS = {1: "mean", 2: "sum"}  # nll_loss's reduction enum (0: none)


@dataclass(eq=False)
class LinearCrossEntropy:
    """One linear + cross-entropy: loss = cross_entropy(x @ weight^T + bias, target)."""

    x: fx.Node                     # [N, D]
    weight_t: fx.Node              # the matmul's second operand, [D, V] (weight^T)
    bias: fx.Node | None           # [V]
    target: fx.Node                # [N] class indices
    ignore_index: int
    reduction: str                 # "mean" | "sum"
    loss: fx.Node                  # the node whose value is the loss (nll_loss_forward's output 0)
    nodes: list                    # every node the op replaces, matmul first
    returns_logits: bool           # something else reads the logits too: the op must return them

    kind = "linear_cross_entropy"


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def match(nll: fx.Node) -> LinearCrossEntropy | str | None:
    """The match at `nll` (an nll_loss_forward), or why not (a str), or None where `nll` is not a
    cross-entropy over a matmul at all."""
    logp, target, weight, reduction, ignore_index = nll.args[:5]
    if not (isinstance(logp, fx.Node) and logp.target is aten._log_softmax.default):
        return None
    walked, cur = [logp], logp.args[0]
    while isinstance(cur, fx.Node) and cur.target in _PASS:
        walked.append(cur)
        cur = cur.args[0]
    if not (isinstance(cur, fx.Node) and cur.target in (aten.mm.default, aten.addmm.default)):
        return None
    mm = cur
    returns_logits = len(mm.users) != 1 or any(len(n.users) != 1 for n in walked[1:])
    if weight is not None:
        return "cross-entropy with class weights"
    if reduction not in _REDUCTIONS:
        return "reduction='none' (a loss per token: its gradient cannot be computed ahead of the backward)"
    if mm.target is aten.addmm.default and (mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1):
        return "addmm with alpha or beta"
    bias, x, w_t = (None, *mm.args[:2]) if mm.target is aten.mm.default else mm.args[:3]
    logits, scores = meta(mm), meta(logp.args[0])
    v = logits.shape[1]
    if logp.args[1] not in (1, -1) or scores.dim() != 2 or not _same(scores.shape[1], v):
        return "the log-softmax is not over the vocabulary of each row"
    if any(not _same(meta(n).shape[-1], v) for n in walked[1:]):
        return "a reshape between the matmul and the loss mixes rows"
    if any(meta(n).dtype.itemsize < logits.dtype.itemsize for n in walked):
        return "the logits are rounded to a narrower dtype before the loss"
    if bias is not None and (meta(bias).dim() != 1 or not _same(meta(bias).shape[0], v)):
        return "a bias that is not one value per class"
    if not (logits.dtype.is_floating_point and meta(x).dtype == meta(w_t).dtype):
        return f"logits of {logits.dtype} from {meta(x).dtype} x {meta(w_t).dtype}"
    if returns_logits and computed_from([target], mm):
        return "the targets are computed from the logits (the op would read what it makes)"
    loss = next((u for u in nll.users if u.target is operator.getitem and u.args[1] == 0), None)
    if loss is None or any(u is not loss for u in nll.users):
        return "the loss's total weight is read too"
    return LinearCrossEntropy(x, w_t, bias, target, int(ignore_index), _REDUCTIONS[reduction], loss,
                              [mm, *reversed(walked), nll, loss], returns_logits)


def find(graph: fx.Graph) -> list[LinearCrossEntropy | str]:
    """Every linear + cross-entropy of `graph`, or the reason one was not taken."""
    found = (match(n) for n in graph.nodes if n.op == "call_function" and n.target is aten.nll_loss_forward.default)
    return [m for m in found if m is not None]
