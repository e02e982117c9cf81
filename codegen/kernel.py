"""Emits one Triton kernel, as readable source, for a region (pointwise or row reduction).

Every value is defined by index: the value of node n at index tuple i is generated on demand, its
operands at the indices the op maps i to (broadcasting, views, slices, cat).  Only region inputs are
loaded, at addresses built from their real strides, and only region outputs are stored.  Values with
the same (node, index) are computed once (CSE).  16-bit floats are held in fp32 and rounded once at
the store, or where the graph itself casts.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import sympy
import torch
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from fuser import indexing as ix
from fuser import ops
from fuser.graph import is_generator, is_size, meta, shape
from fuser.region import PERSISTENT_MAX_R, Region

aten = torch.ops.aten

from fuser.dtypes import TL_DTYPE, compute_dtype, convert, held_in, interpreting, literal, math_import, target, wrapped


X = sympy.Symbol("x", integer=True, nonnegative=True)
R = sympy.Symbol("r", integer=True, nonnegative=True)


class CodegenError(Exception):
    """The region cannot be emitted as one kernel.  With `node` (a reduction whose result a member
    reads where one kernel cannot), the pipeline splits the region so that no member reads it;
    else the region is left to eager."""

    def __init__(self, message: str, node=None):
        super().__init__(message)
        self.node = node


def _in_dtype(v, dtype: torch.dtype):
    """A Python number as a value of `dtype`, as eager fills with it: an integer tensor's pad value -100.0 is
    -100 (a float literal made the kernel's result fp32: integers past 2**24 rounded, an index of fp32)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and not dtype.is_floating_point:
        return bool(v) if dtype == torch.bool else int(v)
    return held_in(v, dtype) if isinstance(v, float) else v  # a 16-bit pad holds the number rounded


@dataclass
class KernelSource:
    name: str
    source: str
    params: tuple  # the size symbols the kernel takes after its pointers, in order
    checks: tuple = ()  # messages of the flags an interpreted kernel raises on (see `_check`)
    in_place: tuple = ()  # (input, output) pairs that may share memory (see KernelWriter._in_place)


def _minmax(combine: str, v: str) -> str:
    """Row max/min that propagates NaN, as torch.amax/amin do (tl.max alone would drop it)."""
    fn = "tl.max" if combine == "max" else "tl.min"
    return f"tl.where(tl.max(({v} != {v}).to(tl.int32), 1)[:, None] > 0, float(\"nan\"), {fn}({v}, 1)[:, None])"


def _promote(args) -> torch.dtype:
    """The dtype comparisons and logical ops compute in (torch's promotion, scalars included)."""
    tensors = [meta(a).dtype for a in args if isinstance(a, torch.fx.Node) and meta(a) is not None]
    dt = tensors[0] if tensors else torch.float32
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t)
    scalars = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    scalars += [0.0 if isinstance(a.meta["val"], torch.SymFloat) else 0 for a in args if is_size(a)]  # a symbolic number
    if any(isinstance(s, float) for s in scalars) and not dt.is_floating_point:
        dt = torch.get_default_dtype()
    elif scalars and dt == torch.bool:
        dt = torch.int64
    return dt


def lower_pointwise(n, kind: ops.Pointwise, operand, dtypes: dict, index: tuple = ()) -> tuple[str, torch.dtype, list]:
    """The Triton expression of pointwise node n, the dtype it is held in, and what eager checks.

    `operand(a)` names the variable holding tensor operand a (dtypes maps variables to theirs); the
    operands are converted to the op's compute dtype, and a cast rounds to its target dtype."""
    out_dt = meta(n).dtype
    promoted = _promote(n.args) if kind.promote_inputs else None
    op_dt = compute_dtype(promoted if kind.promote_inputs else out_dt)
    wrap_dt = _promote(n.args) if kind.wraps and ops.wraps_scalars(n) else None
    rendered = []
    for pos, a in enumerate(n.args):
        if isinstance(a, torch.fx.Node) and is_generator(n):
            rendered.append(None)  # full_like reads its operand's shape, which the kernel already has
        elif is_size(a):  # a float of sizes (fp64 in the kernel) as the op computes: eager converts a Python float so
            rendered.append(convert(literal(a), torch.float64, op_dt) if isinstance(a.meta["val"], torch.SymFloat)
                            and op_dt.is_floating_point else literal(a))
        elif isinstance(a, torch.fx.Node) and meta(a) is not None:
            v = operand(a)
            keep = kind.cast or pos in kind.raw_args or (meta(a).dtype == torch.bool and pos in kind.bool_args)
            rendered.append(v if keep else convert(v, dtypes[v], op_dt))
        elif isinstance(a, float) and kind.promote_inputs:
            # a comparison converts the number to the common dtype first (CPU and CUDA): `x_half == 4 / 3` holds
            # where x holds half(4 / 3)
            rendered.append(literal(held_in(a, promoted)))
        elif isinstance(a, (bool, int, float)):
            rendered.append(literal(wrapped(a, wrap_dt) if wrap_dt is not None else a))
        else:
            rendered.append(a)
    args = ops.Args(n, rendered, index)
    expr, checks = kind.fmt(args), kind.checks(args) if kind.checks else []
    res_dt = compute_dtype(out_dt)
    if kind.cast:
        src_dt = meta(n.args[0]).dtype
        held = dtypes.get(rendered[0], op_dt)
        if src_dt != held and src_dt.is_floating_point and out_dt != src_dt:
            # the value eager casts is already rounded to its own 16-bit dtype: round there first
            expr = convert(convert(expr, held, src_dt), src_dt, held)
        rounded = convert(expr, held, out_dt)
        return (convert(rounded, out_dt, res_dt) if out_dt != res_dt else rounded), res_dt, checks
    if kind.promote_inputs:
        return (expr, torch.bool, checks) if out_dt == torch.bool else (convert(expr, op_dt, res_dt), res_dt, checks)
    return expr, res_dt, checks


class KernelWriter:
    def __init__(self, region: Region, inputs: list, outputs: list, device_type: str, name: str,
                 persistent: bool, wide: bool, cost, constant: tuple = ()):
        self.region, self.cg, self.space = region, region.cg, region.space
        self.in_sig = dict(zip(region.inputs, [_simplified(s, region.cg.sizes) for s in inputs]))
        self.out_sig = dict(zip(region.outputs, [_simplified(s, region.cg.sizes) for s in outputs]))
        self.persistent, self.wide, self.cost = persistent, wide, cost
        self.constant = set(constant)  # size symbols made compile-time constants (see RegionKernel)
        self.name = name
        self.reduction = self.space.is_reduction
        self.sizes = self.cg.sizes
        rows, r = self.space.rows, self.space.r
        self.ranges = ix.Ranges({X: max(rows, 1) if rows.is_Integer else rows,
                                 R: max(r, 1) if r.is_Integer else r}, self.sizes)
        # x's and r's values on live lanes, for _inside (a pad's or a gather's symbols have ranges only where
        # their condition holds: not these)
        self.lane_ranges = {s: ValueRanges(0, int(e) - 1) for s, e in self.ranges.items() if sympy.sympify(e).is_Integer}
        self.lines: list[str] = []
        self.depth = 1
        self.scopes: list[dict] = [{}]
        self.dtypes: dict[str, torch.dtype] = {}
        self.count = 0
        self.reduced: dict = {}  # (node, component) -> register holding the per-row result
        self.aliases: dict = {}  # symbol -> the in-range index it names inside a cat/pad branch
        self.device_type = device_type
        self.checks: list[str] = []  # messages of the checks emitted, in flag order
        self.in_loop = False  # inside a loop over R: rmask names the lanes of this tile
        self.ptr = {n: f"in{i}_ptr" for i, n in enumerate(region.inputs)}
        self.accesses: list = []  # ("load" | "store", node, address text), in the order emitted
        self.ptr.update({n: f"out{i}_ptr" for i, n in enumerate(region.outputs)})

    # ------------------------------------------------------------------ canonical indices
    def full_index(self, o=None) -> tuple:
        """The index x stands for in the full shape, or (pointwise) in output o's own shape."""
        if not self.reduction:  # x walks the elements in the order the output is laid out
            full = self.space.full if o is None else self.cg.store_shape(o)
            order = self._store_order(o, full)
            walked = ix.delinearize(X, tuple(full[d] for d in order), self.ranges)
            return tuple(walked[order.index(d)] for d in range(len(full)))
        kept = iter(ix.delinearize(X, self.space.kept, self.ranges))
        red = iter(ix.delinearize(R, tuple(self.space.full[d] for d in self.space.reduced), self.ranges))
        return tuple(next(red) if d in self.space.reduced else next(kept) for d in range(len(self.space.full)))

    def _store_order(self, o, full) -> list:
        """Dims from outermost to innermost in the memory order of output o (the first of the full
        shape by default; its strides, largest first): a channels_last output is walked as NHWC, so
        its stores (and the loads of inputs laid out alike) are contiguous in x; a contiguous output
        keeps the logical order."""
        if o is None:
            o = next((p for p in self.region.outputs if shape(p) == tuple(full)), self.region.outputs[0])
        sig = self.out_sig[o]
        dims = range(len(full))
        if tuple(sig.shape) != tuple(full):
            return list(dims)
        hint = self.sizes.hint  # the order only decides which accesses are contiguous, never the addresses
        return sorted(dims, key=lambda d: (-hint(sig.stride[d]) if hint(sig.shape[d]) > 1 else 0, d))

    def row_index(self, shp) -> tuple:
        """Index of a per-row value of shape `shp` (keepdim or not) at the current row."""
        kept = ix.delinearize(X, self.space.kept, self.ranges)
        if tuple(shp) == self.space.kept:
            return kept
        it = iter(kept)
        return tuple(sympy.Integer(0) if d in self.space.reduced else next(it) for d in range(len(self.space.full)))

    # ------------------------------------------------------------------ emission helpers
    def emit(self, line: str):
        self.lines.append("    " * self.depth + line)

    def new(self, expr: str, dtype: torch.dtype) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.emit(f"{name} = {expr}")
        self.dtypes[name] = dtype
        return name

    def lookup(self, key):
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        return None

    def remember(self, key, name):
        self.scopes[-1][key] = name
        return name

    def mask_for(self, expr_strs, cond) -> str:
        text = " ".join(expr_strs)
        parts = []
        if re.search(r"\bx\b", text):
            parts.append("xmask")
        if re.search(r"\br\b", text):
            parts.append("rmask")
        if cond:
            parts.append(cond)
        return " & ".join(parts) if parts else "None"

    # ------------------------------------------------------------------ values by index
    def value(self, n, idx: tuple, cond: str | None = None) -> str:
        idx = tuple(sympy.sympify(i) for i in idx)
        if cond is not None and self._inside(n, idx):
            cond = None
        key = (n, idx, cond)
        hit = self.lookup(key)
        if hit is not None:
            return hit
        if n in self.region.members:
            name = self._member(n, idx, cond)
        elif self.cg.transparent(n):
            name = self._inline(n, idx, cond)
        else:
            name = self._load(n, idx, cond)
        return self.remember(key, name)

    def _inside(self, n, idx: tuple) -> bool:
        """Whether idx lies in n's shape on every lane (x and r within their static extents, as xmask and rmask
        keep them): n's element there is one eager computes, so a condition from an op that reads
        it (a pad's in-bounds test, a max pool window's) need mask neither its loads nor its checks, and it
        is one value for every such condition.  A max pool after BatchNorm loaded the four per-channel
        parameters and computed the square root again for each of its 9 window elements, each under that
        element's padding test."""
        dims, known = shape(n), self.lane_ranges
        if len(dims) != len(idx):
            return False
        for i, size in zip(idx, dims):
            if not sympy.sympify(size).is_Integer or not i.free_symbols <= known.keys():
                return False
            try:
                b = bound_sympy(i, known)
            except Exception:  # an expression value-range analysis does not know
                return False
            if not (b.lower >= 0 and b.upper <= int(size) - 1):
                return False
        return True

    def _load(self, n, idx, cond) -> str:
        sig = self.in_sig[n]
        addr = sum((i * s for i, s, size in zip(idx, sig.stride, sig.shape) if size != 1), sympy.Integer(0))
        addr = ix.texpr(self.expand_aliases(ix.combine(addr, self.ranges)))
        mask = self.mask_for([addr], cond)
        for var in ("x", "r"):  # a fixed address under a block mask: the pointer must be a block too
            if re.search(rf"\b{var}\b", mask) and not re.search(rf"\b{var}\b", addr):
                addr = f"{addr} + 0 * {var}"
        masked = "" if mask == "None" else f", mask={mask}, other=0"
        self.accesses.append(("load", n, addr))
        raw = f"tl.load({self.ptr[n]} + ({addr}){masked})"
        cdt = compute_dtype(sig.dtype)
        return self.new(convert(raw, sig.dtype, cdt), cdt)

    def _inline(self, n, idx, cond) -> str:
        kind = self.cg.info[n]
        if isinstance(kind, ops.Pointwise):  # a generator: full, arange, ...
            return self._pointwise(n, kind, idx, cond)
        return self._layout(n, kind, idx, cond)

    def _gather(self, n, idx, cond) -> str:
        """out[i] = src[i with dim -> index[...]] (gather, index_select, embedding; indexing: _index): the
        index is loaded (or computed, as for torch's roll), then names a symbol in the source's index
        math.  An index out of range raises, as in eager; the load is masked by it, so no lane ever
        reads outside the source."""
        if n.target.overloadpacket is aten.index:
            return self._index(n, idx, cond)
        src, dim, index, at, span = ops.gather_parts(n)
        index_idx = tuple(idx) if span is None else tuple(idx[at:at + span])
        iv = self._load_index(index, index_idx, cond)
        size = shape(src)[dim]
        valid = f"({iv} >= 0) & ({iv} < {ix.texpr(size)})"
        self._check(ops.Check(valid, f"gather: index out of bounds for dimension {dim} with size {size}"), cond)
        sym = self._index_symbol(iv, size)
        if span is None:
            src_idx = tuple(sym if d == dim else i for d, i in enumerate(idx))
        else:
            src_idx = (*idx[:at], sym, *idx[at + span:])
        v = self.value(src, src_idx, f"({cond}) & {valid}" if cond else valid)
        return self._as_computed(n, v)

    def _index(self, n, idx, cond) -> str:
        """x[i, j, ...] by integer tensors at some dims (ops.index_parts): each index loaded at the
        broadcast position of the output's index, taken from the end where negative (as eager), out of
        range raising; the dims not indexed follow in order."""
        src, given, at, span = ops.index_parts(n)
        out_b, b_shape = tuple(idx[at:at + span]), shape(n)[at:at + span]
        rest = iter((*idx[:at], *idx[at + span:]))
        syms, valid = {}, []
        for dim, index in given:
            iv = self._load_index(index, ix.broadcast_index(out_b, b_shape, shape(index)), cond)
            iv, _ = self._from_end(iv, shape(src)[dim], dim, cond, "index")
            valid.append(f"({iv} >= 0) & ({iv} < {ix.texpr(shape(src)[dim])})")
            syms[dim] = self._index_symbol(iv, shape(src)[dim])
        src_idx = tuple(syms[d] if d in syms else next(rest) for d in range(len(shape(src))))
        inside = " & ".join(valid)
        v = self.value(src, src_idx, f"({cond}) & {inside}" if cond else inside)
        return self._as_computed(n, v)

    def _from_end(self, iv: str, size, dim: int, cond, what: str) -> tuple[str, str]:
        """A loaded index taken from the end where negative, as eager; out of [-size, size) it raises
        (`what` names the op in the message).  Returns (the index in [0, size), the in-range test of iv)."""
        n = ix.texpr(size)
        ok = f"({iv} >= -{n}) & ({iv} < {n})"
        self._check(ops.Check(ok, f"{what} out of bounds for dimension {dim} with size {size}"), cond)
        return self.new(f"tl.where({iv} < 0, {iv} + {n}, {iv})", self.dtypes[iv]), ok

    def _as_computed(self, n, v: str) -> str:
        """Value `v`, read for layout op `n`, in the dtype n's value is computed in."""
        cdt = compute_dtype(meta(n).dtype)
        return v if self.dtypes[v] == cdt else self.new(convert(v, self.dtypes[v], cdt), cdt)

    def _load_index(self, index, index_idx, cond) -> str:
        iv = self.value(index, index_idx, cond)
        if interpreting():  # an index loaded as a scalar (a [1, 1] tensor of token ids): the interpreter's
            iv = self.new(f"tl.where(xmask, {iv}, {iv})", self.dtypes[iv])  # 0-d bools are int32, no load mask
        if self.wide and self.dtypes[iv] != torch.int64:  # an int32 index times a stride may pass 2**31
            iv = self.new(f"{iv}.to(tl.int64)", torch.int64)
        return iv

    def _index_symbol(self, iv: str, size):
        """A symbol standing for the loaded index `iv` in the source's index math, in [0, size)."""
        sym = sympy.Symbol(f"g{len(self.aliases)}", integer=True, nonnegative=True)
        self.aliases[sym], self.ranges[sym] = sympy.Symbol(iv), size
        return sym

    def _check(self, check: ops.Check, cond):
        """Eager raises where `check.cond` fails on a live lane.  Compiled (GPU): a device-side
        assert, as eager's own kernels do.  Interpreted (CPU): the kernel sets a flag per check and
        the launch raises RuntimeError(message) (the interpreter ignores device_assert)."""
        if self.device_type not in check.devices:
            return
        ok = f"({check.cond})"
        lanes = ["xmask"] + (["rmask"] if self.reduction and (self.persistent or self.in_loop) else [])
        live = " & ".join(lanes + ([f"({cond})"] if cond else []))
        if not interpreting():
            self.emit(f'tl.device_assert((({live}) == 0) | {ok}, "fuser: {check.message}")')
            self.checks.append(check.message)
            return
        # as int32, compared for the mask: the interpreter holds a bool made with a 0-d operand as int32 data
        bad = self.new(f"(({live}) & ({ok} == 0)).to(tl.int32)", torch.int32)
        self.emit(f"tl.store(err_ptr + {len(self.checks)} + {bad} * 0, {bad}, mask={bad} != 0)")
        self.checks.append(check.message)

    def _layout(self, n, kind, idx, cond) -> str:
        if kind.indirect:
            return self._gather(n, idx, cond)
        branches, other = kind.index_map(n, idx, self.ranges)
        cdt = compute_dtype(meta(n).dtype)
        if len(branches) == 1 and branches[0][2] is None and other is None:  # a pure index map
            return self._as_computed(n, self.value(branches[0][0], branches[0][1], cond))
        result = None if other is None else literal(_in_dtype(other, meta(n).dtype))  # cat: the last branch is the fallback
        for src, src_idx, bounds in reversed(branches):
            if bounds is not None and not isinstance(bounds[0], tuple):
                bounds = (bounds,)
            conds = [] if bounds is None else [self._in_bounds(idx[b[2]], *b) for b in bounds]
            if None in conds:  # a bound that fails at every size: never taken (no load outside its tensor)
                continue
            here = " & ".join(c for c in conds if c) or None  # "": a bound that holds at every size
            sub_cond = cond if here is None else (f"({cond}) & {here}" if cond else here)
            v = self.value(src, self._alias_bounded(src_idx, bounds), sub_cond)
            v = convert(v, self.dtypes[v], cdt)
            result = v if here is None or result is None else f"tl.where({here}, {v}, {result})"
        if result is None:
            raise CodegenError(f"{n.name}: no branch of the {n.target} is taken at any size", n)
        if other is not None and not cdt.is_floating_point and cdt != torch.bool:  # an int literal is int32
            result = f"({result}).to({TL_DTYPE[cdt]})"
        return self.new(result, cdt)

    def _in_bounds(self, i, lo, hi, d, step=1) -> str | None:
        """Triton source: lo <= i < hi, and i - lo a multiple of step (a strided slice_scatter).  Where i is
        a function of sizes alone (circular padding's wrapped row, a pad's last column at a symbolic width),
        decided at compile time where the sizes' ranges decide it: "" if it holds at every size, None if at
        none (a scalar condition, which Triton's interpreter cannot mask with: the graph had run eagerly)."""
        e = self.expand_aliases(sympy.sympify(i))
        i = ix.texpr(e)
        if e.free_symbols <= self.sizes.hints.keys():
            if step == 1 and self.sizes.nonneg(e - lo) and self.sizes.lt(e, hi):
                return ""
            if self.sizes.lt(e, lo) or self.sizes.nonneg(e - hi):
                return None
            i = f"({i} + 0 * x)"  # undecided (the size's parity under a step): a block, as the interpreter masks with
        here = f"(({i}) >= {ix.texpr(lo)}) & (({i}) < {ix.texpr(hi)})"
        return here if step == 1 else f"{here} & ((({i}) - {ix.texpr(lo)}) % {step} == 0)"

    def _alias_bounded(self, idx, bounds) -> tuple:
        """Inside a cat/pad branch the shifted index is in range (other lanes are masked): give it a
        symbol with that range, so the index math simplifies; it prints as what it stands for."""
        if bounds is None:
            return idx
        idx = list(idx)
        for lo, hi, d, *step in bounds:
            sym = sympy.Symbol(f"c{len(self.aliases)}", integer=True, nonnegative=True)
            self.aliases[sym] = idx[d]
            self.ranges[sym] = ix.FloorDiv(hi - lo + (step[0] - 1), step[0]) if step else hi - lo
            idx[d] = sym
        return tuple(idx)

    def expand_aliases(self, e):
        while e.free_symbols & self.aliases.keys():
            e = e.xreplace(self.aliases)
        return e

    def print_index(self, e) -> str:
        return ix.texpr(self.expand_aliases(sympy.sympify(e)))

    def _member(self, n, idx, cond) -> str:
        kind = self.cg.info[n]
        if n.target is operator.getitem:
            return self._reduced(n.args[0], n.args[1], idx)
        if isinstance(kind, ops.Reduction):
            return self._reduced(n, 0, idx)
        if isinstance(kind, ops.Layout):
            return self._layout(n, kind, idx, cond)
        return self._pointwise(n, kind, idx, cond)

    def _pointwise(self, n, kind: ops.Pointwise, idx, cond) -> str:
        def operand(a):
            return self.value(a, ix.broadcast_index(idx, shape(n), shape(a)), cond)

        index = tuple(self.expand_aliases(i) for i in idx)
        expr, dt, checks = lower_pointwise(n, kind, operand, self.dtypes, index)
        for c in checks:
            self._check(c, cond)
        return self.new(expr, dt)

    # ------------------------------------------------------------------ reductions
    def _reduced(self, n, component: int, idx) -> str:
        want = tuple(sympy.sympify(i) for i in self.row_index(self._component_shape(n, component)))
        if tuple(idx) != want:
            raise CodegenError(f"{n.name}: a reduction result is read at another row's index", n)
        key = (n, component)
        if key not in self.reduced:
            if not self.persistent:
                raise CodegenError(f"{n.name}: reduction needed before its loop", n)
            self._emit_reduction(n)
        return self.reduced[key]

    @staticmethod
    def _component_shape(n, component):
        v = n.meta["val"]
        return tuple((v[component] if isinstance(v, (tuple, list)) else v).shape)

    def _reduction_input(self, n):
        full = self.full_index()
        return self.value(n.args[0], ix.broadcast_index(full, self.space.full, shape(n.args[0])))

    def _out_dtype(self, n):
        v = n.meta["val"]
        return (v[0] if isinstance(v, (tuple, list)) else v).dtype

    def _emit_reduction(self, n):
        """Persistent: reduce the row held in registers.  Looped: see `_loop_reduction`."""
        combine = self.cg.info[n].combine
        v = self._reduction_input(n)
        out_dt = compute_dtype(self._out_dtype(n))
        if combine in ("sum", "var"):
            acc_dt = out_dt if combine == "sum" else compute_dtype(meta(n.args[0]).dtype)
            v = convert(self._summand(n, v) if combine == "sum" else v, self.dtypes[v], acc_dt)
            s = self.new(f"tl.sum(tl.where(rmask, {v}, 0), 1)[:, None]", acc_dt)
            if combine == "sum":
                scale = f" / {self._float(self.space.r)}" if self.cg.info[n].mean else ""
                self.reduced[(n, 0)] = self.new(f"{s}{scale}", out_dt) if scale else s
                return
            mean = self.new(f"{s} / {self._float(self.space.r)}", acc_dt)
            dev = self.new(f"tl.where(rmask, {v} - {mean}, 0)", acc_dt)
            self._finish_var(n, self.new(f"tl.sum({dev} * {dev}, 1)[:, None]", acc_dt), mean, acc_dt)
            return
        if combine in ("max", "min"):
            ident = _identity(combine, self.dtypes[v])
            masked = self.new(f"tl.where(rmask, {v}, {ident})", self.dtypes[v])
            red = _minmax(combine, masked) if self.dtypes[v].is_floating_point else \
                f"{'tl.max' if combine == 'max' else 'tl.min'}({masked}, 1)[:, None]"
            self.reduced[(n, 0)] = self.new(red, self.dtypes[v])
            return
        if combine in ("argmax", "argmin"):
            ident = _identity("max" if combine == "argmax" else "min", self.dtypes[v])
            fn = "tl.argmax" if combine == "argmax" else "tl.argmin"
            arg = f"{fn}(tl.where(rmask, {v}, {ident}), 1)[:, None]"
            if self.dtypes[v].is_floating_point:  # torch: a NaN is the extreme value, the first one wins
                nan = self.new(f"rmask & ({v} != {v})", torch.bool)
                first_nan = f"tl.argmax({nan}.to(tl.int32), 1)[:, None]"
                arg = f"tl.where(tl.max({nan}.to(tl.int32), 1)[:, None] > 0, {first_nan}, {arg})"
            self.reduced[(n, 0)] = self.new(f"({arg}).to(tl.int64)", torch.int64)
            return
        if combine == "any":
            self.reduced[(n, 0)] = self.new(f"tl.max(tl.where(rmask & ({v} != 0), 1, 0), 1)[:, None] > 0", torch.bool)
            return
        raise CodegenError(f"no lowering for reduction {combine}")

    def _summand(self, n, v):
        """sum(x, dtype=D) is x.to(D).sum(): to a 16-bit D each element is rounded before it is added
        (an element past D's range is inf there), then held in fp32 as D's values are.  Not a mean's: eager's
        CPU mean of a 16-bit dtype sums the fp32 values (CUDA's rounds them: the devices differ)."""
        d = self._out_dtype(n)
        if d not in (torch.float16, torch.bfloat16) or meta(n.args[0]).dtype == d or self.cg.info[n].mean:
            return v
        return self.new(convert(convert(v, self.dtypes[v], d), d, torch.float32), torch.float32)

    def _finish_var(self, n, sq, mean, acc_dt):
        correction = n.kwargs.get("correction", 1)
        correction = 1 if correction is None else correction
        denom = self.space.r - correction
        if denom.is_Integer:
            text = repr(float(max(int(denom), 0)))
        else:
            text = f"({ix.texpr(denom)})" if self.sizes.nonneg(denom) else f"tl.maximum({ix.texpr(denom)}, 0)"
        var = self.new(f"{sq} / {text}", acc_dt)
        self.reduced[(n, 0)] = var
        self.reduced[(n, 1)] = mean

    # ------------------------------------------------------------------ looped reductions
    def _loop(self, body):
        self.emit(f"for roffset in range(0, {ix.texpr(self.space.r)}, RBLOCK):")
        self.depth += 1
        self.scopes.append({})
        self.emit("r = roffset + tl.arange(0, RBLOCK)[None, :]")
        self.emit(f"rmask = r < {ix.texpr(self.space.r)}")
        self.in_loop = True
        body()
        self.in_loop = False
        self.scopes.pop()
        self.depth -= 1

    def _looped(self):
        by_level: dict[int, list] = {}
        for n in self.region.nodes:
            if isinstance(self.cg.info[n], ops.Reduction):
                combine = self.cg.info[n].combine
                if combine in ("argmax", "argmin"):
                    raise CodegenError(f"{combine} over rows longer than {PERSISTENT_MAX_R} is left to eager")
                lvl = self.region.levels[n]
                by_level.setdefault(lvl, []).append((n, "main"))
                if combine == "var":
                    by_level.setdefault(lvl - 1, []).append((n, "mean"))
        for lvl in sorted(by_level):
            items = by_level[lvl]
            accs = []
            online = {self.region.online_max(n): n for n, part in items if part == "main"}
            online.pop(None, None)  # amax -> the sum(exp(A - amax)) sharing its pass
            for n, part in items:
                combine = "sum" if part == "mean" else self.cg.info[n].combine
                dt = torch.float64 if meta(n.args[0]).dtype == torch.float64 else (
                    compute_dtype(self._out_dtype(n)) if combine == "sum" else compute_dtype(meta(n.args[0]).dtype))
                ident = "0" if combine in ("sum", "var", "any") else _identity(combine, dt)
                acc = f"acc{self.count}"
                self.count += 1
                tl_dt = TL_DTYPE[torch.int32 if combine == "any" else dt]
                width = "1" if n in online or n in online.values() else "RBLOCK"  # online pairs: per row
                self.emit(f"{acc} = tl.full([XBLOCK, {width}], {ident}, {tl_dt})")
                accs.append((n, part, combine, acc, dt))

            acc_of = {n: acc for n, part, _, acc, _ in accs if part == "main"}

            def body():
                for n, part, combine, acc, dt in accs:
                    if n in online.values():
                        continue  # updated with its max below
                    v = self._reduction_input(n)
                    if n in online:
                        self._online_update(acc, acc_of[online[n]], convert(v, self.dtypes[v], dt))
                        continue
                    if combine == "sum":
                        v = self._summand(n, v)
                    v = convert(v, self.dtypes[v], dt if combine != "any" else self.dtypes[v])
                    if part == "main" and combine == "var":
                        mean = self.reduced[(n, 1)]
                        self.emit(f"{acc} = {acc} + tl.where(rmask, ({v} - {mean}) * ({v} - {mean}), 0)")
                    elif combine in ("sum", "var"):
                        self.emit(f"{acc} = {acc} + tl.where(rmask, {v}, 0)")
                    elif combine in ("max", "min"):
                        helper = "_maximum" if combine == "max" else "_minimum"
                        self.emit(f"{acc} = {helper}({acc}, tl.where(rmask, {v}, {_identity(combine, dt)}))")
                    elif combine == "any":
                        self.emit(f"{acc} = tl.maximum({acc}, tl.where(rmask & ({v} != 0), 1, 0))")
            self._loop(body)
            for n, part, combine, acc, dt in accs:
                out_dt = compute_dtype(self._out_dtype(n))
                if part == "mean":
                    s = self.new(f"tl.sum({acc}, 1)[:, None]", dt)
                    self.reduced[(n, 1)] = self.new(f"{s} / {self._float(self.space.r)}", dt)
                elif combine == "var":
                    self._finish_var(n, self.new(f"tl.sum({acc}, 1)[:, None]", dt), self.reduced[(n, 1)], dt)
                elif n in online.values():  # already scaled to the final max
                    self.reduced[(n, 0)] = acc
                    self.dtypes[acc] = dt
                elif combine == "sum":
                    s = self.new(f"tl.sum({acc}, 1)[:, None]", dt)
                    mean = self.cg.info[n].mean
                    self.reduced[(n, 0)] = self.new(f"{s} / {self._float(self.space.r)}", out_dt) if mean else s
                elif combine in ("max", "min"):
                    red = _minmax(combine, acc) if dt.is_floating_point else \
                        f"{'tl.max' if combine == 'max' else 'tl.min'}({acc}, 1)[:, None]"
                    self.reduced[(n, 0)] = self.new(red, dt)
                elif combine == "any":
                    self.reduced[(n, 0)] = self.new(f"tl.max({acc}, 1)[:, None] > 0", torch.bool)

    def _online_update(self, m_acc: str, s_acc: str, v: str):
        """Per-row running max and running sum of exp(v - max), rescaled when a tile raises the max:
        one pass, one exp per element."""
        tile = self.new(f"tl.where(rmask, {v}, -float(\"inf\"))", torch.float32)
        m_new = self.new(f"_maximum({m_acc}, {_minmax('max', tile)})", torch.float32)
        live = f"({m_new} > -float(\"inf\"))"
        self.emit(f"{s_acc} = tl.where({live}, {s_acc} * tl.exp({m_acc} - {m_new}), 0) + "
                  f"tl.sum(tl.where(rmask & {live}, tl.exp({v} - {m_new}), 0), 1)[:, None]")
        self.emit(f"{m_acc} = {m_new}")

    # ------------------------------------------------------------------ stores
    def _store(self, o, idx, cond: str | None = None):
        if isinstance(self.cg.info[o], ops.Scatter):
            return self._scatter(o, idx, cond)
        sig = self.out_sig[o]
        v = self.value(o, idx, cond)
        addr = sum((i * s for i, s, size in zip(idx, sig.stride, sig.shape) if size != 1), sympy.Integer(0))
        addr = ix.texpr(ix.combine(addr, self.ranges))
        per_row = self.reduction and shape(o) != self.space.full
        mask = "xmask" if per_row or not self.reduction else "xmask & rmask"
        mask += f" & ({cond})" if cond else ""
        if not re.search(r"\bx\b", addr):  # a single value: the pointer must still be a block
            addr = f"{addr} + 0 * x"
        self.accesses.append(("store", o, addr))
        self.emit(f"tl.store({self.ptr[o]} + ({addr}), {convert(v, self.dtypes[v], sig.dtype)}, {mask})")

    def _scatter(self, o, idx, cond):
        """index_put(dst, [.., index at dim, ..], values) stored into dst in place (its output buffer is
        dst: fuser.rewrite): the values at `idx` (over the indexed positions) go to dst with the index
        loaded in place of the indexed dims, taken from the end where negative; out of range raises, as
        in eager, and the store is masked by it, so no lane writes outside dst."""
        d = self.cg.info[o].dim
        index, values, sig = o.args[1][d], o.args[2], self.out_sig[o]
        span = len(shape(index))
        iv, ok = self._from_end(self._load_index(index, tuple(idx[d:d + span]), cond), shape(o)[d], d, cond,
                                "index_put: index")
        at = (*idx[:d], sympy.Integer(0), *idx[d + span:])
        addr = sum((i * st for i, st, n in zip(at, sig.stride, sig.shape) if n != 1), sympy.Integer(0))
        addr = f"{ix.texpr(ix.combine(addr, self.ranges))} + {iv} * {ix.texpr(sig.stride[d])}"
        v = self.value(values, ix.broadcast_index(idx, self.cg.store_shape(o), shape(values)), cond)
        mask = " & ".join(["xmask", f"({ok})"] + ([f"({cond})"] if cond else []))
        self.accesses.append(("scatter", o, addr))
        self.emit(f"tl.store({self.ptr[o]} + ({addr}), {convert(v, self.dtypes[v], sig.dtype)}, {mask})")

    # ------------------------------------------------------------------ the kernel
    def _float(self, e) -> str:
        """A size as a divisor of a float: a literal, or the size expression (an int argument)."""
        return f"{int(e)}.0" if e.is_Integer else f"({ix.texpr(e)})"

    def generate(self) -> KernelSource:
        if self.space.rows == 0:  # nothing to compute: the kernel is never launched
            self.emit("pass")
            return self._assemble()
        try:
            return self._generate()
        except ValueError as e:  # index math we cannot prove in range (see fuser/indexing.py)
            raise CodegenError(str(e)) from e

    def _generate(self) -> KernelSource:
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        full_outs = [o for o in self.region.outputs if shape(o) == self.space.full or not self.reduction]
        row_outs = [o for o in self.region.outputs if o not in full_outs]
        if not self.reduction:
            self.emit(f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)")
            self.emit(f"xmask = x < {ix.texpr(self.space.rows)}")
            for o in full_outs:
                stored = self.cg.store_shape(o)
                if ix.numel(stored) == 0:
                    continue  # no element (a horizontally fused output with a dim of size 0)
                if shape(o) == tuple(self.space.full):
                    self._store(o, self.full_index())
                else:  # horizontally fused (region._widest), or a scatter: its own index, on its own elements
                    fewer = sympy.expand(self.space.rows - ix.numel(stored)) != 0
                    self._store(o, self.full_index(o), f"(x < {ix.texpr(ix.numel(stored))})" if fewer else None)
        else:
            self.emit(f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
            self.emit(f"xmask = x < {ix.texpr(self.space.rows)}")
            if self.persistent:
                self.emit("r = tl.arange(0, RBLOCK)[None, :]")
                self.emit(f"rmask = r < {ix.texpr(self.space.r)}")
                for o in full_outs:
                    self._store(o, self.full_index())
            else:
                self._looped()
                if full_outs:
                    self._loop(lambda: [self._store(o, self.full_index()) for o in full_outs])
            for o in row_outs:
                self._store(o, self.row_index(shape(o)))
        return self._assemble()

    def _size_params(self, body: str) -> tuple:
        """The size symbols the body names, in a fixed order: the kernel's int arguments (the
        region's, and the strides a generic-strides variant takes)."""
        found = set(self.region.size_symbols)
        for sig in self.in_sig.values():
            found |= ix.size_symbols(*sig.stride)
        return tuple(s for s in sorted(found, key=str) if re.search(rf"\b{s}\b", body))

    def _assemble(self) -> KernelSource:
        body = "\n".join(self.lines)
        sizes = self._size_params(body)
        params = [self.ptr[n] for n in self.region.inputs] + [self.ptr[n] for n in self.region.outputs]
        params += ["err_ptr"] if self.checks and interpreting() else []
        params += [f"{s}: tl.constexpr" if s in self.constant else str(s) for s in sizes]
        params += ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.reduction else [])
        used = ops.helpers_for(body)
        header = self._header()
        helpers = "".join(used)
        jit = "@triton.jit(debug=True)  # device-side asserts on" if self.checks and not interpreting() else "@triton.jit"
        src = (header + "import triton\nimport triton.language as tl\n" + math_import(helpers + body) + helpers +
               f"\n\n{jit}\ndef {self.name}({', '.join(params)}):\n{body}\n")
        return KernelSource(self.name, src, sizes, tuple(self.checks) if interpreting() else (), self._in_place())

    def _in_place(self) -> tuple:
        """(input i, output j) pairs whose memory may be one buffer: the same dtype, output j stored
        once, element-wise (full-shaped), and every load of input i at the very address (offset from
        its pointer) of that store and emitted before it; the shapes may differ (a view of the input
        is index math in the kernel).  Each program then reads an element before it
        writes it and touches no other program's elements (a row of a reduction is one program's:
        read whole, or tile by tile ahead of the store loop)."""
        pairs = []
        for j, o in enumerate(self.region.outputs):
            stores = [(k, a) for k, (kind, n, a) in enumerate(self.accesses) if kind == "store" and n is o]
            if len(stores) != 1 or (self.reduction and shape(o) != self.space.full):
                continue
            (at, addr), out = stores[0], self.out_sig[o]
            for i, n in enumerate(self.region.inputs):
                sig = self.in_sig[n]
                loads = [(k, a) for k, (kind, m, a) in enumerate(self.accesses) if kind == "load" and m is n]
                if sig.dtype == out.dtype and loads and all(a == addr and k < at for k, a in loads):
                    pairs.append((i, j))
        return tuple(pairs)

    def _header(self) -> str:
        cost, hint = self.cost, self.sizes.hint
        passes = self.region.passes()
        lines = [f"# region {self.region.id}: {self.region.kind}, {len(self.region.nodes)} ops: "
                 + ", ".join(dict.fromkeys(ops.op_name(n).replace("aten.", "") for n in self.region.nodes))]
        sp = self.space
        if sp.is_reduction:
            lines.append(f"# iteration: {sp.rows} rows x {sp.r} reduced (full shape {list(sp.full)}, "
                         f"reduced dims {list(sp.reduced)}), {'row in registers' if self.persistent else 'looped over the row'}")
        else:
            lines.append(f"# iteration: {sp.rows} elements, shape {list(sp.full)}")
        lines.append("# HBM traffic of this kernel:")
        for n in self.region.inputs:
            p = passes[n]
            lines.append(f"#   read  {n.name}: {list(shape(n))} {meta(n).dtype}".replace("torch.", "")
                         + (f" x{p} passes" if p > 1 else ""))
        for n in self.region.outputs:
            stored = self.cg.store_shape(n)
            into = f" into {n.args[0].name} {list(shape(n))} in place, at its indexed positions" \
                if isinstance(self.cg.info[n], ops.Scatter) else ""
            lines.append(f"#   write {n.name}: {list(stored)} {meta(n).dtype}".replace("torch.", "")
                         + f"{into} = {_value(ix.numel(stored) * meta(n).element_size(), hint)} B")
        lines.append(f"# bytes fused {_value(cost.bytes_fused, hint)} vs unfused {_value(cost.bytes_unfused, hint)} "
                     f"({cost.launches_unfused} eager kernels): k = {cost.k:.2f}"
                     + (" at the sizes seen at capture" if cost.bytes_fused.free_symbols else ""))
        return "\n".join(lines) + "\n"


def _identity(combine: str, dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return '-float("inf")' if combine == "max" else 'float("inf")'
    if dtype == torch.bool:
        return "0" if combine == "max" else "1"
    info = torch.iinfo(dtype)
    return str(info.min if combine == "max" else info.max)


def _simplified(sig, sizes):
    """A signature whose strides drop the Max/Min that hold one way at every size."""
    if not any(isinstance(st, sympy.Basic) and not st.is_Integer for st in sig.stride):
        return sig
    return type(sig)(sig.shape, tuple(sizes.simplify(st) for st in sig.stride), sig.dtype)


def _value(e, hint) -> str:
    """An expression and, where it has symbols, its value at the hints."""
    return str(int(e)) if e.is_Integer else f"{e} (= {hint(e)})"


def generate(region: Region, inputs: list, outputs: list, *, device_type: str, name: str,
             persistent: bool, wide: bool, cost, constant: tuple = ()) -> KernelSource:
    """`constant`: size symbols the kernel takes as constexprs (one compile per value) rather than ints."""
    with target(device_type):
        return KernelWriter(region, inputs, outputs, device_type, name, persistent, wide, cost, constant).generate()
