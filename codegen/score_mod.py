"""The score chain of a recognised attention, as the lines of its kernel's score modification.

Each chain node becomes one line over fp32 tiles: the scores are `s`, the masks and biases the
chain reads are `extra0..`, loaded per tile by the kernel (or computed from the positions, where
patterns found them to be a structural mask or a slope * (k - q) bias).  The op table lowers each
node as it does in pointwise kernels, but for a division by a constant (`_reciprocal`).
"""
from __future__ import annotations

import re

import torch

from fuser import ops
from fuser.graph import meta, packet

from .attention import ScoreMod
from .kernel import lower_pointwise

aten = torch.ops.aten


def _reciprocal(n, expr: str) -> str:
    """A division of the scores by a constant (`/ math.sqrt(d)`, soft-capping's `/ cap`) as a multiply
    by its reciprocal: one instruction instead of a full-range division per score, at most one fp32
    ulp apart (exact for powers of two), far below the 16-bit rounding eager gives the scores.  A
    decision for the score chain only: pointwise regions keep eager's division."""
    c = n.args[1] if len(n.args) == 2 else None
    if packet(n) is not aten.div or n.kwargs.get("rounding_mode") is not None or not isinstance(c, (int, float)) \
            or isinstance(c, bool) or c == 0 or not meta(n).dtype.is_floating_point:
        return expr
    m = re.fullmatch(r"\((.+) / ([^()/]+)\)", expr)
    return f"({m.group(1)} * {1.0 / float(c)!r})" if m else expr


def score_mod(scores, chain: list, extras: list, cg, structure: tuple | None = None, forms: tuple = ()) -> ScoreMod:
    """The lines; with `structure` (offset o, window w: the chain masks every key past q + o, and
    with w every key at q + o - k >= w) the kernel also applies that mask itself and skips the tiles
    it empties.  `forms`: the extras computed from the indices instead of loaded (patterns)."""
    names = {scores: "s"}
    dtypes = {"s": torch.float32}
    for i, e in enumerate(extras):
        names[e] = f"extra{i}"
        dtypes[f"extra{i}"] = meta(e).dtype
    lines = []
    for i, n in enumerate(chain):
        expr, dt, checks = lower_pointwise(n, cg.info[n], names.__getitem__, dtypes)
        if checks:
            raise ValueError(f"attention score chain: {n.name} needs a check eager makes ({checks[0].message})")
        names[n] = f"c{i}"
        dtypes[f"c{i}"] = dt
        lines.append(f"c{i} = {_reciprocal(n, expr)}")
    last = names[chain[-1]] if chain else "s"
    if dtypes[last] != torch.float32:
        last = f"{last}.to(tl.float32)"
    lines.append(f"s = {last}")
    text = "\n".join(lines)
    used = tuple(ops.helpers_for(text))
    offset, window = structure or (0, None)
    return ScoreMod(tuple(lines), n_extra=len(extras), helpers=used, causal=structure is not None,
                    causal_offset=offset, window=window, forms=tuple(forms))
