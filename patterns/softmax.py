"""The online-softmax pattern: sum(exp(A - amax(A))) over the same dims as the amax.

Op by op, the sum needs the max first: two passes over a row too long for registers.  Rescaling a
running sum whenever the running max grows gives both in one pass (as FlashAttention does), so a
region holding this pattern reads its rows once fewer.
"""
from __future__ import annotations

import operator

import torch

from fuser import ops

aten = torch.ops.aten
_VIEWS = {aten.view, aten._unsafe_view, aten.unsqueeze, aten.expand, aten.alias, aten.reshape}


def _packet(n):
    return getattr(n.target, "overloadpacket", None) if isinstance(n, torch.fx.Node) else None


def _through_views(n):
    while _packet(n) in _VIEWS:
        n = n.args[0]
    return n


def online_max(total) -> torch.fx.Node | None:
    """The amax node M when `total` is sum(exp(A - M)) and M = amax(A) over the same dims, else None."""
    if _packet(total) is not aten.sum or total.target is operator.getitem:
        return None
    e = total.args[0]
    if _packet(e) is not aten.exp:
        return None
    d = e.args[0]
    if _packet(d) is not aten.sub or d.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, torch.fx.Node) for a in d.args):
        return None
    a, m = d.args
    m = _through_views(m)
    if _packet(m) is not aten.amax or _through_views(m.args[0]) is not _through_views(a):
        return None
    if ops.reduction_dims(m) != ops.reduction_dims(total):
        return None
    return m
