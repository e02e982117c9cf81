"""A region: the compute nodes one kernel runs, its iteration space, and its inputs and outputs.

Pointwise regions iterate over one shape.  Reduction regions iterate over (rows, R): `full` is the
shape the reductions read, `reduced` the dims they combine; every reduction in the region shares
them.  Each output is either full-shaped (stored per element) or row-shaped (stored per row).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import cached_property

import sympy
import torch

from . import indexing as ix
from . import ops
from .graph import ComputeGraph, is_size, meta, operands, packet, shape

# The online-softmax pattern, sum(exp(A - amax(A))) over the amax's dims: op by op the sum needs the
# max first (two passes over a row too long for registers); a running sum rescaled whenever the
# running max grows gives both in one pass, as FlashAttention does.  Part of the pass schedule.
aten = torch.ops.aten
_VIEWS = {aten.view, aten._unsafe_view, aten.unsqueeze, aten.expand, aten.alias, aten.reshape}



def _through_views(n):
    while packet(n) in _VIEWS:
        n = n.args[0]
    return n


def online_max(total) -> torch.fx.Node | None:
    """The amax node M when `total` is sum(exp(A - M)) and M = amax(A) over the same dims, else None."""
    if packet(total) is not aten.sum or total.target is operator.getitem:
        return None
    e = total.args[0]
    if packet(e) is not aten.exp:
        return None
    d = e.args[0]
    if packet(d) is not aten.sub or d.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, torch.fx.Node) for a in d.args):
        return None
    a, m = d.args
    m = _through_views(m)
    if packet(m) is not aten.amax or _through_views(m.args[0]) is not _through_views(a):
        return None
    if ops.reduction_dims(m) != ops.reduction_dims(total):
        return None
    return m


PERSISTENT_MAX_R = 16384  # rows up to this many elements are held in registers: one HBM pass
# A column reduction (over outer dims, the contiguous one kept: a weight's or a bias's gradient) is
# tiled [columns x rows] so that its loads run along memory; past this many rows it loops over them
# (block_plan) instead of holding a few columns' whole rows, whose loads would stride across lines.
COLUMN_PERSISTENT_MAX_R = 64
COLUMN_MIN_WIDTH = 32


def persistent_at(r: int, column: bool = False) -> bool:
    return r <= (COLUMN_PERSISTENT_MAX_R if column else PERSISTENT_MAX_R)


@dataclass(frozen=True)
class Space:
    """Sizes are sympy expressions: ints, or Dynamo's size symbols where sizes vary."""

    full: tuple
    reduced: tuple[int, ...] = ()

    @property
    def kept(self) -> tuple:
        return tuple(s for d, s in enumerate(self.full) if d not in self.reduced)

    @property
    def rows(self):
        return sympy.Mul(*self.kept)

    @property
    def r(self):
        return sympy.Mul(*(self.full[d] for d in self.reduced))

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduced)

    @property
    def column(self) -> bool:
        """Reduced over outer dims only, the innermost kept: in a contiguous tensor, x runs along memory."""
        return self.is_reduction and len(self.full) - 1 not in self.reduced

    def row_shaped(self, shp) -> bool:
        """A per-row value: the full shape with the reduced dims set to 1 or dropped."""
        keep1 = tuple(1 if d in self.reduced else s for d, s in enumerate(self.full))
        return tuple(shp) in (keep1, self.kept)


def _is_reduction(cg: ComputeGraph, n) -> bool:
    return isinstance(cg.info[n], ops.Reduction)


def reduction_space(n) -> Space:
    return Space(shape(n.args[0]), ops.reduction_dims(n))


@dataclass(eq=False)
class Region:
    """Compute nodes of one kernel (in graph order) and what the cost model and codegen need."""

    cg: ComputeGraph
    nodes: list
    space: Space
    id: int = 0
    members: set = field(init=False)

    def __post_init__(self):
        self.nodes = sorted(self.nodes, key=self.cg.order.__getitem__)
        self.members = set(self.nodes)

    @cached_property
    def outputs(self) -> list:
        """Members whose data is read outside the region (multi-output ops give their getitems)."""
        out = []
        for n in self.nodes:
            if meta(n) is None:
                continue
            if any(c not in self.members for c in self.cg.consumers(n)):
                out.append(n)
        return out

    @cached_property
    def inputs(self) -> list:
        """Non-member nodes whose data the region reads, in graph order."""
        seen = {}
        for n in self.nodes:
            for a in self.cg.data_inputs(n):
                if a not in self.members:
                    seen[a] = None
        return sorted(seen, key=self.cg.order.__getitem__)

    @property
    def kind(self) -> str:
        return "reduction" if self.space.is_reduction else "pointwise"

    @property
    def persistent(self) -> bool:
        """Rows held in registers (one HBM pass), else a loop over R, at the sizes seen at capture.
        With a symbolic R the kernel picks its variant per call (`persistent_at`)."""
        return persistent_at(self.cg.sizes.hint(self.space.r), self.column)

    @cached_property
    def column(self) -> bool:
        """A reduction that keeps the innermost dim, at least COLUMN_MIN_WIDTH wide (narrower, a tile's
        rows would not fill a line either, and fewer programs would run): see COLUMN_PERSISTENT_MAX_R.
        argmax and argmin keep the row layout (the looped kernel does not lower them)."""
        return self.space.column and not self.arg_reduction \
            and self.cg.sizes.hint(self.space.full[-1]) >= COLUMN_MIN_WIDTH

    @cached_property
    def arg_reduction(self) -> bool:
        """Holds an argmax or argmin, which only the persistent row kernel lowers."""
        return any(_is_reduction(self.cg, n) and self.cg.info[n].combine in ("argmax", "argmin") for n in self.nodes)

    @property
    def looped_argmax(self) -> bool:
        """An argmax or argmin over rows longer than registers hold: codegen has no looped form of them."""
        return self.arg_reduction and not self.persistent

    # -- reduction levels: which loop computes what (shared by the cost model and codegen) --

    @cached_property
    def levels(self) -> dict:
        """Level of each member: 0 for per-element work before any reduction, k after k chained ones."""
        lvl = {}
        for n in self.nodes:
            deps = [lvl.get(a, 0) for a in self._member_deps(n)]
            base = max(deps, default=0)
            partner = self.online_max(n)
            if partner is not None:  # computed in the same pass as its max
                lvl[n] = lvl[partner]
            elif _is_reduction(self.cg, n):
                # var needs its mean first: two chained passes
                extra = 2 if self.cg.info[n].combine == "var" else 1
                lvl[n] = base + extra
            else:
                lvl[n] = base
        return lvl

    def online_max(self, n):
        """The amax in this region that `n` = sum(exp(A - amax(A))) can share a pass with, if any."""
        m = online_max(n) if _is_reduction(self.cg, n) else None
        return m if m in self.members else None

    def _member_deps(self, n) -> list:
        if n.target is operator.getitem:
            return [n.args[0]]
        return [a for a in self.cg.data_inputs(n) if a in self.members]

    @cached_property
    def size_symbols(self) -> tuple:
        """The size symbols the kernel's index math can name, in a fixed order: those of every node
        it reads through (members, the views between them, its inputs) and of size arguments."""
        found, stack, seen = set(), list(self.nodes), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            v = n.meta.get("val")
            if is_size(n):
                found |= ix.size_symbols(v)
                continue
            if isinstance(v, torch.Tensor):
                found |= ix.size_symbols(*v.shape, *v.stride())
            if n in self.members or self.cg.transparent(n):
                stack.extend(operands(n))
        return tuple(sorted(found, key=str))

    def cone_inputs(self, roots) -> set:
        """Region inputs read to compute `roots` within one pass (stopping at reductions)."""
        found, stack, seen = set(), list(roots), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for a in self.cg.data_inputs(n) if n.target is not operator.getitem else [n.args[0]]:
                if a not in self.members:
                    found.add(a)
                elif not _is_reduction(self.cg, a):
                    stack.append(a)
        return found

    def passes(self) -> dict:
        """How many times each input is read from HBM: once when rows sit in registers, else per loop."""
        if not self.space.is_reduction or self.persistent:
            return {a: 1 for a in self.inputs}
        count = {a: 0 for a in self.inputs}
        by_level = {}
        for n in self.nodes:
            if _is_reduction(self.cg, n):
                by_level.setdefault(self.levels[n], []).append(n)
                if self.cg.info[n].combine == "var":  # the mean pass, one level earlier
                    by_level.setdefault(self.levels[n] - 1, []).append(n)
        loops = [self.cone_inputs(ns) for _, ns in sorted(by_level.items())]
        full_outputs = [o for o in self.outputs if shape(o) == self.space.full]
        if full_outputs:
            loops.append(self.cone_inputs(full_outputs))
        row_outputs = [o for o in self.outputs if shape(o) != self.space.full]
        once = self.cone_inputs(row_outputs)
        for a in count:
            count[a] = sum(a in loop for loop in loops) or (1 if a in once else 0)
        return count


def analyze(cg: ComputeGraph, nodes, widest: bool = True) -> Space | None:
    """The iteration space these nodes can share in one kernel, or None if they cannot; with `widest`
    off, pointwise outputs of one shape only."""
    members = set(nodes)
    spaces = {reduction_space(n) for n in nodes if _is_reduction(cg, n)}
    if len(spaces) > 1:
        return None
    scatters = {n for n in nodes if isinstance(cg.info[n], ops.Scatter)}
    if scatters and (spaces or any(a in scatters for n in nodes for a in cg.data_inputs(n))):
        return None  # a scatter's result is only ever stored (no element of it can be computed)
    outs = [n for n in nodes if meta(n) is not None and any(c not in members for c in cg.consumers(n))]
    if not outs:
        outs = [n for n in nodes if meta(n) is not None]
    if spaces:
        space = spaces.pop()
        if space.r == 0:
            return None  # a reduction over nothing: eager gives the identity (or the error)
        if any(n.target is not operator.getitem and meta(n) is None and not _is_reduction(cg, n) for n in nodes):
            return None
        for o in outs:
            if shape(o) != space.full and not space.row_shaped(shape(o)):
                return None
        for n in nodes:  # per-element work downstream of a reduction must be full- or row-shaped
            if not _is_reduction(cg, n) and meta(n) is not None and any(
                    _is_reduction(cg, a) or a.target is operator.getitem for a in cg.data_inputs(n) if a in members):
                if shape(n) != space.full and not space.row_shaped(shape(n)):
                    return None
        return space
    shapes = list(dict.fromkeys(cg.store_shape(o) for o in outs))
    if len(shapes) == 1:
        return Space(shapes[0])
    return _widest(cg, shapes) if widest else None


def _widest(cg: ComputeGraph, shapes: list) -> Space | None:
    """Outputs of several shapes (horizontal fusion of siblings: a decode step's rotated queries and
    keys, [1, 32, 1, 128] and [1, 8, 1, 128]; its cache positions [1] beside its mask [1, 1, 1, 1040]): the kernel
    walks the largest, and each other output is stored at its own index where x < its numel.  None
    where no shape has at least every other's elements at every size."""
    for full in shapes:
        if all(cg.sizes.nonneg(ix.numel(full) - ix.numel(s)) for s in shapes):
            return Space(full)
    return None
