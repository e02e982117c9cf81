"""Sizes and index math as sympy expressions, symbols allowed.

A size is an int or one of Dynamo's size symbols (s0, s1, ...: positive integers, with the ranges and
the hints, i.e. the sizes seen at capture, that its shape environment records).  `Sizes` answers
what the kernel decisions need: a value at the hints (for the cost model) and comparisons that hold
for every size Dynamo's guards let through (for index simplification).

Layout ops (view, permute, expand, slice, cat) never copy inside a kernel: they map an index tuple of
their output to one of their input.  Those maps nest into `(a // b) % c` terms (torch.utils._sympy's
FloorDiv and ModularIndexing, for non-negative operands), which we simplify with the known ranges of
the index variables, so that a contiguous access prints as `x`, not as a chain of divisions: Triton
can only vectorise what it can see is contiguous.  With symbolic sizes the same rules apply where
they provably hold; where not, the general form stays (correct, maybe slower).
"""
from __future__ import annotations

import functools

import sympy
import torch
from sympy.printing.str import StrPrinter
from torch.utils._sympy.functions import FloorDiv, IntTrueDiv, ModularIndexing
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

__all__ = ["FloorDiv", "ModularIndexing", "Sizes", "Ranges", "expr", "shape_of"]

UNBACKED_HINT = 8192  # a data-dependent size has no hint; the cost model assumes a large one (as Inductor)


def expr(s) -> sympy.Expr:
    """An int, a SymInt (or SymFloat) or a sympy expression as a sympy expression."""
    if isinstance(s, (torch.SymInt, torch.SymFloat)):
        return s.node.expr
    if isinstance(s, (int, bool)):
        return sympy.Integer(int(s))
    return sympy.sympify(s)


def shape_of(t) -> tuple:
    """A (fake) tensor's shape as sympy expressions: comparing SymInts would add guards to Dynamo's
    shape environment, comparing expressions only asks whether they are the same expression."""
    return _exprs(t.shape)


def stride_of(t) -> tuple:
    return _exprs(t.stride())


def _exprs(dims) -> tuple:
    if all(type(d) is int for d in dims):
        return _ints(tuple(dims))
    return tuple(expr(s) for s in dims)


@functools.lru_cache(maxsize=8192)
def _ints(dims: tuple) -> tuple:
    """Static sizes as sympy Integers, made once: the cost model asks for the same shapes thousands of
    times a graph (~3% of an 8-layer BERT training step's compile_graph on CPU)."""
    return tuple(sympy.Integer(d) for d in dims)


class Sizes:
    """What is known of a graph's size symbols: their ranges and hints (Dynamo's shape env)."""

    def __init__(self, hints: dict | None = None, ranges: dict | None = None):
        self.hints = dict(hints or {})
        self.ranges = dict(ranges or {})

    @staticmethod
    def of_graph(graph) -> "Sizes":
        for n in graph.nodes:
            v = n.meta.get("val")
            found = [s for s in ((v,) if isinstance(v, torch.SymInt) else tuple(v.shape) + tuple(v.stride())
                                 if isinstance(v, torch.Tensor) and v.layout == torch.strided else ())
                     if isinstance(s, torch.SymInt)]
            if found:
                env = found[0].node.shape_env
                hints = getattr(env, "backed_var_to_val", None)  # torch >= 2.13; var_to_val before
                hints = env.var_to_val if hints is None else hints
                return Sizes({s: int(h) for s, h in hints.items()}, dict(env.var_to_range))
        return Sizes()

    def hint(self, e) -> int:
        e = expr(e)
        if e.is_Integer:
            return int(e)
        subs = {s: self.hints.get(s, UNBACKED_HINT) for s in e.free_symbols}
        return int(e.xreplace(subs))

    def bounds(self, e) -> ValueRanges:
        e = self.simplify(e)
        rng = {s: self.ranges.get(s, ValueRanges(0 if s.is_nonnegative else -int_oo, int_oo))
               for s in e.free_symbols}
        try:
            return bound_sympy(e, rng)
        except Exception:  # an expression value-range analysis does not know
            return ValueRanges.unknown()

    def simplify(self, e):
        """e without the Max/Min that hold one way for every size (Dynamo's strides: Max(1, s - 1))."""
        return _drop_minmax(expr(e), self)

    def nonneg(self, e) -> bool:
        e = expr(e)
        if e.is_Number:
            return e >= 0
        return self._lower(e) >= 0

    def lt(self, a, b) -> bool:
        """a < b for every size the graph may be called with."""
        d = sympy.expand(expr(b) - expr(a))
        if d.is_Number:
            return bool(d > 0)
        return self._lower(d) > 0

    def _lower(self, e):
        """A lower bound of e over the sizes' ranges: of e, and of e factored where that bounds it higher (intervals
        lose the correlation of a size's terms: s*t - s is >= -inf term by term, s*(t - 1) >= 2; XLNet's shifted
        scores at a symbolic length had been refused a kernel)."""
        lower = self.bounds(e).lower
        if lower < 0 and e.is_Add and any(len(t.free_symbols) > 1 for t in e.args):  # (linear: the bound is exact)
            factored = sympy.factor(e)
            if factored != e:
                lower = max(lower, self.bounds(factored).lower)
        if lower < 0 and e.is_Add and e.has(FloorDiv):
            lower = max(lower, self._lower_without_floors(e))
        return lower

    def _lower_without_floors(self, e):
        """A lower bound of the sum e with each FloorDiv(a, b) of a positive integer b replaced by what bounds it
        from the side its coefficient needs: a / b above, (a - b + 1) / b below (s - s // 2 >= s / 2 >= 1:
        `narrow(x, 1, -(T // 2), 2)` at a symbolic length had been refused its kernel as "may be negative")."""
        terms = []
        for t in e.args:
            c, rest = t.as_coeff_Mul()
            if isinstance(rest, FloorDiv) and rest.args[1].is_Integer and rest.args[1] > 0 and self.nonneg(rest.args[0]):
                a, b = rest.args
                rest = a / b if c < 0 else (a - b + 1) / b
            terms.append(c * rest)
        return self.bounds(sympy.Add(*terms)).lower

    def divides(self, d, e) -> bool:
        """e is a multiple of d for every size (d, e integer expressions)."""
        d, e = expr(d), expr(e)
        if d.is_Integer and e.is_Integer:
            return int(d) != 0 and int(e) % int(d) == 0
        num, den = sympy.fraction(sympy.together(sympy.cancel(e / d)))  # together: (2s - 1) / 2 is s - 1/2
        return den == 1 or den == -1


def _is_minmax(t) -> bool:
    return type(t).__name__ in ("Max", "Min")  # sympy's, or torch.utils._sympy's own (Dynamo's)


def _drop_minmax(e, sizes: Sizes):
    """Max(a, b) -> a where a >= b always (Dynamo writes strides as Max(1, s - 1))."""
    if not any(_is_minmax(t) for t in sympy.preorder_traversal(e)):
        return e

    def pick(m):
        a, rest = m.args[0], m.args[1:]
        b = rest[0] if len(rest) == 1 else type(m)(*rest)
        is_max = type(m).__name__ == "Max"
        for first, second in ((a, b), (b, a)):
            if sizes.nonneg(first - second if is_max else second - first):
                return first
        return m

    return e.replace(_is_minmax, pick)


class Ranges(dict):
    """Index variables -> their extent (symbol in [0, extent)), plus the graph's `sizes`."""

    def __init__(self, extents: dict, sizes: Sizes | None = None):
        super().__init__(extents)
        self.sizes = sizes or Sizes()


def _sizes(ranges) -> Sizes:
    return getattr(ranges, "sizes", None) or Sizes()


def _is_index(factor, ranges) -> bool:
    return bool(factor.free_symbols & ranges.keys())


def _terms(e, ranges) -> dict:
    """e as {index atom: coefficient}, coefficients free of index variables (ints and sizes)."""
    out: dict = {}
    for t in sympy.Add.make_args(sympy.expand(e)):
        idx, coeff = [], []
        for f in sympy.Mul.make_args(t):
            (idx if _is_index(f, ranges) else coeff).append(f)
        atom, c = sympy.Mul(*idx), sympy.Mul(*coeff)
        out[atom] = out.get(atom, sympy.Integer(0)) + c
    return {a: c for a, c in out.items() if c != 0}


def value_range(e, ranges: dict) -> tuple:
    """Inclusive (lo, hi) of an index expression, given each variable's extent (var in [0, extent))."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return e, e
    if not _is_index(e, ranges):
        return e, e  # a size: constant over the kernel's index space
    if e.is_Symbol:
        return sympy.Integer(0), sympy.sympify(ranges[e]) - 1
    sizes = _sizes(ranges)
    if e.is_Add:
        lo = hi = sympy.Integer(0)
        for t in e.args:
            a, b = value_range(t, ranges)
            lo, hi = lo + a, hi + b
        return lo, hi
    if e.is_Mul:
        terms = _terms(e, ranges)
        if len(terms) == 1:
            (atom, c), = terms.items()
            if not atom.is_Mul:
                a, b = value_range(atom, ranges)
                if sizes.nonneg(c):
                    return c * a, c * b
                if sizes.nonneg(-c):
                    return c * b, c * a
        raise ValueError(f"non-linear index term {e}")
    if isinstance(e, FloorDiv):
        a, b = value_range(e.args[0], ranges)
        return _floor_of(a, e.args[1], sizes), _floor_of(b + 1, e.args[1], sizes, end=True)
    if isinstance(e, ModularIndexing):
        a, b = value_range(e.args[0], ranges)
        d, m = e.args[1], e.args[2]
        if sizes.nonneg(a) and sizes.lt(FloorDiv(b, d), m):
            return FloorDiv(a, d), FloorDiv(b, d)
        return sympy.Integer(0), m - 1
    if isinstance(e, sympy.Mod) and sizes.lt(0, e.args[1]):  # Python's remainder: the divisor's sign
        return sympy.Integer(0), e.args[1] - 1
    raise ValueError(f"unsupported index expression {e}")


def _floor_of(a, d, sizes: Sizes, end: bool = False):
    """a // d; with end, (a - 1) // d for an exclusive end a: exact where d divides a (x < s*k gives
    x // k <= s - 1, which FloorDiv(s*k - 1, k) would not show for a symbolic k)."""
    if sizes.divides(d, a):
        q = sympy.cancel(a / d)
        return q - 1 if end else q
    return FloorDiv(a - 1, d) if end else FloorDiv(a, d)


def _split(e, divisor, ranges):
    """Split e into (the part that is a multiple of divisor, divided by it; the rest)."""
    whole, rest = sympy.Integer(0), sympy.Integer(0)
    sizes = _sizes(ranges)
    for atom, c in _terms(e, ranges).items():
        if sizes.divides(divisor, c):
            whole += sympy.cancel(c / divisor) * atom
        else:
            rest += c * atom
    return whole, rest


def _single_term(e, ranges):
    """(coeff, atom) if e is coeff*atom with one index atom and nothing else, else None."""
    d = _terms(e, ranges)
    if len(d) == 1:
        (atom, coeff), = d.items()
        if atom != 1:
            return coeff, atom
    return None


def floordiv(e, d, ranges: dict):
    """e // d, simplified with the variables' ranges."""
    e, d = sympy.sympify(e), sympy.sympify(d)
    if d == 1:
        return e
    sizes = _sizes(ranges)
    whole, rest = _split(e, d, ranges)
    if rest == 0:
        return whole
    lo, hi = value_range(rest, ranges)
    if sizes.nonneg(lo) and sizes.lt(hi, d):
        return whole
    single = _single_term(rest, ranges)
    if single and sizes.lt(0, single[0]) and sizes.divides(single[0], d) and sizes.nonneg(lo):
        c, t = single
        return whole + _floordiv_atom(t, sympy.cancel(d / c), ranges)
    return whole + FloorDiv(rest, d)  # printed with Python's rounding where rest may be negative


def _floordiv_atom(t, d, ranges: dict):
    if d == 1:
        return t
    sizes = _sizes(ranges)
    lo, hi = value_range(t, ranges)
    if sizes.lt(hi, d):
        return sympy.Integer(0)
    if isinstance(t, FloorDiv):
        return floordiv(t.args[0], t.args[1] * d, ranges)
    if isinstance(t, ModularIndexing):
        a, p, m = t.args
        if sizes.divides(d, m):
            return ModularIndexing(a, p * d, sympy.cancel(m / d))
    return FloorDiv(t, d)


def modulo(e, m, ranges: dict):
    """e % m, simplified with the variables' ranges."""
    e, m = sympy.sympify(e), sympy.sympify(m)
    if m == 1:
        return sympy.Integer(0)
    sizes = _sizes(ranges)
    _, rest = _split(e, m, ranges)
    lo, hi = value_range(rest, ranges)
    if sizes.nonneg(lo) and sizes.lt(hi, m):
        return rest
    single = _single_term(rest, ranges)
    if single and sizes.lt(0, single[0]) and sizes.divides(single[0], m) and sizes.nonneg(lo):
        c, t = single
        return c * _modulo_atom(t, sympy.cancel(m / c), ranges)
    if not sizes.nonneg(lo):  # (a flip's `W - 1 - w` under a pixel shuffle's `% 2`): Python's remainder, as
        return sympy.Mod(rest, m)  # sympy's Mod is and the printers print it; ModularIndexing is C's `%`
    return ModularIndexing(rest, 1, m)


def _modulo_atom(t, m, ranges: dict):
    sizes = _sizes(ranges)
    lo, hi = value_range(t, ranges)
    if sizes.lt(hi, m):
        return t
    if isinstance(t, FloorDiv):
        return ModularIndexing(t.args[0], t.args[1], m)
    if isinstance(t, ModularIndexing) and sizes.divides(m, t.args[2]):
        return ModularIndexing(t.args[0], t.args[1], m)
    return ModularIndexing(t, 1, m)


def _same(a, b) -> bool:
    return a == b or sympy.expand(a - b) == 0


def combine(e, ranges: dict):
    """Merge c*((a//p)%s) + c*s*((a//(p*s))%s2) into c*((a//p)%(s*s2)) until nothing changes.

    This is what turns the per-dimension address of a contiguous tensor back into the flat index.
    """
    terms = _terms(e, ranges)
    changed = True
    while changed:
        changed = False
        for t1, c1 in terms.items():
            if not isinstance(t1, ModularIndexing):
                continue
            a, p, s = t1.args
            for t2, c2 in terms.items():
                if t2 is t1 or not _same(c2, c1 * s):
                    continue
                if isinstance(t2, ModularIndexing) and t2.args[0] == a and _same(t2.args[1], p * s):
                    merged = ModularIndexing(a, p, s * t2.args[2])
                elif isinstance(t2, FloorDiv) and t2.args[0] == a and _same(t2.args[1], p * s):
                    merged = FloorDiv(a, p)
                else:
                    continue
                del terms[t1], terms[t2]
                for atom, c in _terms(c1 * _tidy(merged, ranges), ranges).items():
                    terms[atom] = terms.get(atom, sympy.Integer(0)) + c
                changed = True
                break
            if changed:
                break
    return sympy.Add(*(c * a for a, c in terms.items()))


def _tidy(t, ranges: dict):
    """(a // p) % s with a < p*s is a // p; a // 1 is a."""
    if isinstance(t, ModularIndexing):
        a, p, s = t.args
        if _sizes(ranges).lt(value_range(a, ranges)[1], p * s):
            return floordiv(a, p, ranges)
    return t


def delinearize(flat, shape, ranges: dict) -> tuple:
    """The multi-index of a row-major flat index into `shape`."""
    out, stride = [], sympy.Integer(1)
    for size in reversed(shape):
        out.append(sympy.Integer(0) if size == 1 else modulo(floordiv(flat, stride, ranges), size, ranges))
        stride *= size
    return tuple(reversed(out))


def linearize(index, shape):
    """The row-major flat index of a multi-index into `shape`."""
    flat, stride = sympy.Integer(0), sympy.Integer(1)
    for i, size in zip(reversed(index), reversed(shape)):
        flat += i * stride
        stride *= size
    return flat


def broadcast_index(index, from_shape, to_shape) -> tuple:
    """Index of an operand of shape `to_shape` broadcast (right-aligned) to `from_shape`."""
    lead = len(from_shape) - len(to_shape)
    return tuple(sympy.Integer(0) if size == 1 else index[lead + d] for d, size in enumerate(to_shape))


def broadcast_shapes(a, b) -> tuple | None:
    """The broadcast of two shapes of expressions, or None where they do not broadcast."""
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == 1 or x == y:
            out.append(y)
        elif y == 1:
            out.append(x)
        else:
            return None
    return tuple(reversed(out))


def numel(shape) -> sympy.Expr:
    return sympy.Mul(*(expr(s) for s in shape))


def size_symbols(*exprs) -> set:
    """The size symbols (s0, u1, ...) in some expressions."""
    out = set()
    for e in exprs:
        out |= expr(e).free_symbols
    return out


class TritonPrinter(StrPrinter):
    """Prints index math as Triton/Python integer expressions.  Every function by this printer's own
    method (torch's FloorDiv prints itself with Python's `//` otherwise, which Triton reads as C's)."""
    printmethod = "_fuser_print"

    def _print_FloorDiv(self, e):
        """sympy's and Python's `//` floor; Triton's truncates toward zero (as C's): the same where the
        numerator is non-negative and the divisor positive (index math over sizes), else corrected by
        taking off the floor remainder first (a padded length -(-n // 8) * 8 over a symbolic n)."""
        a, b = e.args
        num, den = self._operand(a), self._operand(b)
        if a.is_nonnegative and b.is_positive:
            return f"({num} // {den})"
        return f"(({num} - {_floor_mod(num, den)}) // {den})"

    def _print_ModularIndexing(self, e):
        a, p, m = e.args
        inner = self._operand(a) if p == 1 else f"({self._operand(a)} // {self._operand(p)})"
        return f"({inner} % {self._operand(m)})"

    def _print_Mod(self, e):
        """sympy's Mod takes the divisor's sign (as Python's `%`); Triton's `%` the dividend's (as C's):
        the same where the dividend is non-negative and the divisor positive (index math over sizes)."""
        a, m = e.args
        num, den = self._operand(a), self._operand(m)
        return f"({num} % {den})" if a.is_nonnegative and m.is_positive else _floor_mod(num, den)

    _print_PythonMod = _print_Mod  # torch's name for Python's `%` on sizes

    # Sizes computed in floats (`int(1.25 * n / 4)`, interpolate's `floor(1.5 * h)`): fp64 as Python's float,
    # rounded to an int as Python's int(), floor(), ceil(); a ratio of ints exactly, by integer division.
    def _print_FloorToInt(self, e):
        (arg,) = e.args
        if isinstance(arg, IntTrueDiv):
            return self._print(FloorDiv(*arg.args))
        return self._to_int(f"tl.floor({self._print(arg)})")

    def _print_CeilToInt(self, e):  # ceil(a / b) = -floor(-a / b)
        (arg,) = e.args
        if isinstance(arg, IntTrueDiv):
            a, b = arg.args
            return self._print(-FloorDiv(-a, b))
        return self._to_int(f"tl.ceil({self._print(arg)})")

    def _print_TruncToInt(self, e):
        return self._to_int(self._print(e.args[0]))

    def _to_int(self, x: str) -> str:
        return f"tl.cast({x}, tl.int64)"  # C's conversion truncates toward zero, as Python's int()

    def _print_ToFloat(self, e):
        return self._float(e.args[0])

    def _print_FloatTrueDiv(self, e):
        return f"({self._operand(e.args[0])} / {self._operand(e.args[1])})"

    def _print_IntTrueDiv(self, e):  # n / (n - 1) of sizes, a float (BatchNorm's unbiased variance factor)
        return f"({self._float(e.args[0])} / {self._float(e.args[1])})"

    def _float(self, a) -> str:
        """An int expression of sizes as a float (fp64, as Python's)."""
        return f"tl.cast({self._print(a)}, tl.float64)"

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Function(self, e):
        """Any other function of sizes (sqrt, round...): no form here.  In a kernel's index math the region
        stays eager with the reason; in the host's size function the graph runs as given, with the reason
        (printed as written, either was a NameError at run time)."""
        raise ValueError(f"no integer form for {e}")

    def _print_PowByNatural(self, e):
        return self._print_Pow(e)

    def _print_Max(self, e):
        return self._fold("tl.maximum", e.args)

    def _print_Min(self, e):
        return self._fold("tl.minimum", e.args)

    def _print_Pow(self, e):
        base, exp = e.args
        if exp.is_Integer and int(exp) > 0:  # Triton has no `**` on ints: s0**2 is s0*s0
            return "(" + " * ".join([self._operand(base)] * int(exp)) + ")"
        raise ValueError(f"no integer form for {e}")

    def _fold(self, fn, args):
        text = self._print(args[0])
        for a in args[1:]:
            text = f"{fn}({text}, {self._print(a)})"
        return text

    def _operand(self, a) -> str:
        """A numerator in brackets unless atomic: `//` and `%` bind tighter than `+`."""
        text = self._print(a)
        return text if a.is_Atom or isinstance(a, (FloorDiv, ModularIndexing)) else f"({text})"


def _floor_mod(num: str, den: str) -> str:
    """Triton source of Python's num % den (the divisor's sign) from C's `%` (the dividend's)."""
    return f"((({num} % {den}) + {den}) % {den})"


class PythonPrinter(TritonPrinter):
    """The same arithmetic as host Python (sizes evaluated at launch)."""

    def _print_Pow(self, e):
        return StrPrinter._print_Pow(self, e)

    def _print_Mod(self, e):  # Python's `%` and `//` are sympy's Mod and floor division
        return f"({self._operand(e.args[0])} % {self._operand(e.args[1])})"

    _print_PythonMod = _print_Mod

    def _print_FloorDiv(self, e):
        return f"({self._operand(e.args[0])} // {self._operand(e.args[1])})"

    def _print_PowByNatural(self, e):
        return f"({self._operand(e.args[0])} ** {self._operand(e.args[1])})"

    def _print_FloorToInt(self, e):
        if isinstance(e.args[0], IntTrueDiv):
            return TritonPrinter._print_FloorToInt(self, e)
        return f"int({self._operand(e.args[0])} // 1)"

    def _print_CeilToInt(self, e):
        if isinstance(e.args[0], IntTrueDiv):
            return TritonPrinter._print_CeilToInt(self, e)
        return f"-int(-{self._operand(e.args[0])} // 1)"

    def _to_int(self, x: str) -> str:
        return f"int({x})"

    def _float(self, a) -> str:
        return f"float({self._print(a)})"

    def _print_Max(self, e):
        return f"max({', '.join(self._print(a) for a in e.args)})"

    def _print_Min(self, e):
        return f"min({', '.join(self._print(a) for a in e.args)})"


def texpr(e) -> str:
    """Triton source of e, bracketed where it is a sum, product or power: callers splice it next to other
    operators (`i - {lo}`, `{i} * {step}`, `-{n}`, `% {size}`), where `s0 - 5` or `2*s0` unbracketed changed
    the arithmetic (a strided slice_scatter at a symbolic start wrote other rows; an arange of step 2 under
    a cat read other values: silent wrong answers)."""
    return _bracketed(TritonPrinter(), e)


def pyexpr(e) -> str:
    """Host Python source of e, bracketed as texpr."""
    return _bracketed(PythonPrinter(), e)


def _bracketed(printer, e) -> str:
    e = sympy.sympify(e)
    text = printer.doprint(e)
    return f"({text})" if e.is_Add or e.is_Mul or e.is_Pow or (e.is_Number and e < 0) else text
