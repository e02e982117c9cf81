"""The score chain of a recognised attention, as the lines of its kernel's score modification.

Each chain node becomes one line over fp32 tiles: the scores are `s`, the masks and biases the
chain reads are `extra0..`, loaded per tile by the kernel (or computed from the positions, where
patterns found them to be a structural mask or a slope * (k - q) bias).  The op table lowers each
node as it does in pointwise kernels, but for a division by a constant (`_reciprocal`).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from fuser import ops
from fuser.dtypes import literal
from fuser.graph import meta, packet

from .attention import _TL_DTYPE, DEAD_FILL, ScoreMod
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
    return f"({m.group(1)} * {literal(1.0 / float(c))})" if m else expr


def score_mod(scores, chain: list, extras: list, cg, structure: tuple | None = None, forms: tuple = (),
              learned: tuple[int, ...] = ()) -> ScoreMod:
    """The lines; with `structure` (offset o, window w: the chain masks every key past q + o, and
    with w every key at q + o - k >= w) the kernel also applies that mask itself and skips the tiles
    it empties.  `forms`: the extras computed from the indices instead of loaded (patterns).
    `learned`: the extras that need a gradient (a learned bias): each gets its derivative's lines,
    or None where the chain has no rule for it."""
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
                    causal_offset=offset, window=window, forms=tuple(forms), grad=_gradient(scores, chain, names),
                    data_mask=None if structure else _data_mask(scores, chain, extras, forms),
                    bias_grads=tuple((i, _gradient(extras[i], chain, names, f"g{i}")) for i in learned))


def _dead(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x <= DEAD_FILL


def _data_mask(scores, chain: list, extras: list, forms) -> tuple | None:
    """ScoreMod.data_mask: a loaded extra that only the chain's last op on the scores reads (casts may
    follow), as an additive mask (s + e) or a boolean one (where / masked_fill with a fill <= DEAD_FILL);
    else None.  (Without a structure only: a structural mask already skips its tiles.)"""
    path, found = {scores}, None
    for n in chain:
        if not any(a in path for a in n.all_input_nodes):
            continue
        path.add(n)
        if found is not None:
            if packet(n) not in _ONE:
                return None  # an op after the mask (soft-capping, say): a masked tile is not zero there
            continue
        loaded = [i for i, e in enumerate(extras) if e in n.all_input_nodes and (i >= len(forms) or forms[i] is None)]
        if len(loaded) != 1:
            # Before the mask, only ops of the scores and plain numbers (scaling, soft-capping, casts): another
            # mask there (a causal one from the indices, say) could hide a row's keys the data mask keeps, and
            # its tiles, skipped for the data mask alone, would leave that row nothing (eager: uniform).
            if packet(n) not in _BEFORE or any(a not in path for a in n.all_input_nodes):
                return None
            continue
        i = loaded[0]
        e, op, args = extras[i], packet(n), n.args
        dtype = meta(e).dtype
        if any(e in m.all_input_nodes for m in chain if m is not n) or (dtype not in _TL_DTYPE and dtype != torch.bool):
            return None
        if op is aten.add and dtype != torch.bool and n.kwargs.get("alpha", 1) == 1 and len(args) == 2:
            found = (i, "add", dtype)
        elif op is aten.where and dtype == torch.bool and args[0] is e and len(args) == 3:
            found = (i, "keep", dtype) if args[1] in path and _dead(args[2]) else \
                    (i, "drop", dtype) if args[2] in path and _dead(args[1]) else None
        elif op is aten.masked_fill and dtype == torch.bool and args[1] is e and args[0] in path and _dead(args[2]):
            found = (i, "drop", dtype)
        if found is None:
            return None
    return found


def plain_scale(scores, chain: list, extras: list, mask: int) -> float | None:
    """The constant c where the chain is `mask(scores * c)` and casts alone (the mask: extra `mask`, the chain's
    data mask), so that SDPA computes it once the mask is known causal; else None."""
    scale, path = 1.0, {scores}
    for n in chain:
        if not any(a in path for a in n.all_input_nodes):
            return None  # the chain computes something beside the scores (a bias): more than a mask
        path.add(n)
        op, args = packet(n), n.args
        c = args[1] if len(args) == 2 else None
        if op in _ONE or extras[mask] in n.all_input_nodes:
            continue
        if op not in (aten.mul, aten.div) or args[0] not in path or not isinstance(c, (int, float)) \
                or isinstance(c, bool) or c == 0 or n.kwargs.get("rounding_mode") is not None:
            return None
        scale = scale * c if op is aten.mul else scale / c
    return float(scale)


_ONE = {aten._to_copy, aten.clone, aten.alias, torch.ops.prims.convert_element_type}  # d/dx = 1 (a cast passes
# the gradient straight through, as autograd does)
# ops a data mask's tile skipping allows before the mask (`_data_mask`): finite scores stay finite
_BEFORE = _ONE | {aten.mul, aten.div, aten.add, aten.sub, aten.neg, aten.tanh}


def _gradient(scores, chain: list, names: dict, var: str = "g") -> tuple[str, ...] | None:
    """Lines setting `var` = d(last chain value)/d(scores), the product of each op's derivative along
    the path from the scores (or from an extra the chain reads: a learned bias's); the forward's lines
    have run, their variables hold the values.  None where an op has no rule here or reads the path
    twice (s * s)."""
    path, lines = {scores}, [f"{var} = 1.0"]
    if not chain:
        return tuple(lines)

    def val(a) -> str:
        if isinstance(a, fx.Node):
            return f"{names[a]}.to(tl.float32)"
        return literal(float(a))
    for n in chain:
        on = [j for j, a in enumerate(n.args) if isinstance(a, fx.Node) and a in path]
        if not on:
            continue  # computes a mask or a bias from other values: no path through it
        if len(on) > 1 and packet(n) is not aten.where:
            return None
        j, op, args, out = on[0], packet(n), n.args, f"{names[n]}.to(tl.float32)"
        alpha = n.kwargs.get("alpha", 1)
        if op in _ONE:
            d = None
        elif op is aten.add:
            d = None if j == 0 or alpha == 1 else literal(float(alpha))
        elif op is aten.sub:
            d = None if j == 0 else literal(-float(alpha))
        elif op is aten.mul:
            d = val(args[1 - j])
        elif op is aten.div and j == 0 and n.kwargs.get("rounding_mode") is None:
            d = literal(1.0 / float(args[1])) if isinstance(args[1], (int, float)) else f"(1.0 / {val(args[1])})"
        elif op is aten.neg:
            d = "-1.0"
        elif op is aten.tanh:
            d = f"(1.0 - {out} * {out})"
        elif op is aten.exp:
            d = out
        elif op is aten.sigmoid:
            d = f"({out} * (1.0 - {out}))"
        elif op is aten.where and len(args) == 3 and 0 not in on:
            d = None if on == [1, 2] else f"tl.where({names[args[0]]}, {1.0 if j == 1 else 0.0}, {0.0 if j == 1 else 1.0})"
        elif op is aten.masked_fill and j == 0:
            d = f"tl.where({names[args[1]]}, 0.0, 1.0)"
        else:
            return None
        if d is not None:
            lines.append(f"{var} = {var} * {d}")
        path.add(n)
    return tuple(lines) if chain[-1] in path else None
