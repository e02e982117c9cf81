"""Index math as sympy expressions over the kernel's iteration variables.

Layout ops (view, permute, expand, slice, cat) never copy inside a kernel: they map an index tuple of
their output to one of their input.  Those maps nest into `(a // b) % c` terms, which we simplify with
the known ranges of the variables so that a contiguous access prints as `x`, not as a chain of
divisions: Triton can only vectorise what it can see is contiguous.
"""
from __future__ import annotations

import math

import sympy
from sympy.printing.str import StrPrinter


class FloorDiv(sympy.Function):
    """a // b for non-negative integers (what Triton's `//` gives there)."""

    is_integer = True
    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if b == 1:
            return a
        return None


class ModularIndexing(sympy.Function):
    """(a // b) % c for non-negative integers."""

    is_integer = True
    nargs = 3

    @classmethod
    def eval(cls, a, b, c):
        if a.is_Integer and b.is_Integer and c.is_Integer:
            return sympy.Integer((int(a) // int(b)) % int(c))
        return None


def value_range(e, ranges: dict) -> tuple[int, int]:
    """Inclusive (lo, hi) of an index expression, given each symbol's size (symbol in [0, size))."""
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        return 0, int(ranges[e]) - 1
    if e.is_Add:
        lo = hi = 0
        for t in e.args:
            a, b = value_range(t, ranges)
            lo, hi = lo + a, hi + b
        return lo, hi
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff.is_Integer and not rest.is_Mul:
            a, b = value_range(rest, ranges)
            c = int(coeff)
            return (c * a, c * b) if c >= 0 else (c * b, c * a)
        raise ValueError(f"non-linear index term {e}")
    if isinstance(e, FloorDiv):
        a, b = value_range(e.args[0], ranges)
        d = int(e.args[1])
        return a // d, b // d
    if isinstance(e, ModularIndexing):
        a, b = value_range(e.args[0], ranges)
        d, m = int(e.args[1]), int(e.args[2])
        if a >= 0 and b // d < m:
            return a // d, b // d
        return 0, m - 1
    raise ValueError(f"unsupported index expression {e}")


def _split(e, divisor: int):
    """Split e into (multiple_of_divisor / divisor, rest) by its integer coefficients."""
    whole, rest = sympy.Integer(0), sympy.Integer(0)
    for term, coeff in e.as_coefficients_dict().items():
        c = int(coeff)
        if c % divisor == 0:
            whole += (c // divisor) * term
        else:
            rest += c * term
    return whole, rest


def _single_term(e):
    """(coeff, term) if e is coeff*term with one non-constant term, else None."""
    d = e.as_coefficients_dict()
    if len(d) == 1:
        (term, coeff), = d.items()
        if term != 1:
            return int(coeff), term
    return None


def floordiv(e, d: int, ranges: dict):
    """e // d, simplified with the variables' ranges."""
    e, d = sympy.sympify(e), int(d)
    if d == 1:
        return e
    whole, rest = _split(e, d)
    if rest == 0:
        return whole
    lo, hi = value_range(rest, ranges)
    if 0 <= lo and hi < d:
        return whole
    single = _single_term(rest)
    if single and single[0] > 0 and d % single[0] == 0 and lo >= 0:
        c, t = single
        return whole + _floordiv_atom(t, d // c, ranges)
    if lo < 0:
        raise ValueError(f"negative index in {rest} // {d}")
    return whole + FloorDiv(rest, d)


def _floordiv_atom(t, d: int, ranges: dict):
    if d == 1:
        return t
    lo, hi = value_range(t, ranges)
    if hi < d:
        return sympy.Integer(0)
    if isinstance(t, FloorDiv):
        return floordiv(t.args[0], int(t.args[1]) * d, ranges)
    if isinstance(t, ModularIndexing):
        a, p, m = t.args[0], int(t.args[1]), int(t.args[2])
        if m % d == 0:
            return ModularIndexing(a, p * d, m // d)
    return FloorDiv(t, d)


def modulo(e, m: int, ranges: dict):
    """e % m, simplified with the variables' ranges."""
    e, m = sympy.sympify(e), int(m)
    if m == 1:
        return sympy.Integer(0)
    _, rest = _split(e, m)
    lo, hi = value_range(rest, ranges)
    if 0 <= lo and hi < m:
        return rest
    single = _single_term(rest)
    if single and single[0] > 0 and m % single[0] == 0 and lo >= 0:
        c, t = single
        return c * _modulo_atom(t, m // c, ranges)
    if lo < 0:
        raise ValueError(f"negative index in {rest} % {m}")
    return ModularIndexing(rest, 1, m)


def _modulo_atom(t, m: int, ranges: dict):
    lo, hi = value_range(t, ranges)
    if hi < m:
        return t
    if isinstance(t, FloorDiv):
        return ModularIndexing(t.args[0], t.args[1], m)
    if isinstance(t, ModularIndexing) and int(t.args[2]) % m == 0:
        return ModularIndexing(t.args[0], t.args[1], m)
    return ModularIndexing(t, 1, m)


def combine(e, ranges: dict):
    """Merge c*((a//p)%s) + c*s*((a//(p*s))%s2) into c*((a//p)%(s*s2)) until nothing changes.

    This is what turns the per-dimension address of a contiguous tensor back into the flat index.
    """
    e = sympy.expand(e)
    changed = True
    while changed:
        changed = False
        terms = e.as_coefficients_dict()
        for t1, c1 in terms.items():
            if not isinstance(t1, ModularIndexing):
                continue
            a, p, s = t1.args
            for t2, c2 in terms.items():
                if t2 is t1 or c2 != c1 * s:
                    continue
                if isinstance(t2, ModularIndexing) and t2.args[0] == a and t2.args[1] == p * s:
                    merged = ModularIndexing(a, p, s * t2.args[2])
                elif isinstance(t2, FloorDiv) and t2.args[0] == a and t2.args[1] == p * s:
                    merged = FloorDiv(a, p)
                else:
                    continue
                e = e - c1 * t1 - c2 * t2 + c1 * _tidy(merged, ranges)
                changed = True
                break
            if changed:
                break
    return e


def _tidy(t, ranges: dict):
    """(a // p) % s with a < p*s is a // p; a // 1 is a."""
    if isinstance(t, ModularIndexing):
        a, p, s = t.args
        if value_range(a, ranges)[1] < int(p) * int(s):
            return floordiv(a, p, ranges)
    return t


def delinearize(flat, shape, ranges: dict) -> tuple:
    """The multi-index of a row-major flat index into `shape`."""
    out, stride = [], 1
    for size in reversed(shape):
        out.append(sympy.Integer(0) if size == 1 else modulo(floordiv(flat, stride, ranges), size, ranges))
        stride *= size
    return tuple(reversed(out))


def linearize(index, shape):
    """The row-major flat index of a multi-index into `shape`."""
    flat, stride = sympy.Integer(0), 1
    for i, size in zip(reversed(index), reversed(shape)):
        flat += i * stride
        stride *= size
    return flat


def broadcast_index(index, from_shape, to_shape) -> tuple:
    """Index of an operand of shape `to_shape` broadcast (right-aligned) to `from_shape`."""
    lead = len(from_shape) - len(to_shape)
    return tuple(sympy.Integer(0) if size == 1 else index[lead + d] for d, size in enumerate(to_shape))


def numel(shape) -> int:
    return math.prod(int(s) for s in shape)


class TritonPrinter(StrPrinter):
    """Prints index math as Triton/Python integer expressions."""

    def _print_FloorDiv(self, e):
        return f"({self._operand(e.args[0])} // {self._print(e.args[1])})"

    def _print_ModularIndexing(self, e):
        a, p, m = e.args
        inner = self._operand(a) if p == 1 else f"({self._operand(a)} // {self._print(p)})"
        return f"({inner} % {self._print(m)})"

    def _operand(self, a) -> str:
        """A numerator in brackets unless atomic: `//` and `%` bind tighter than `+`."""
        text = self._print(a)
        return text if a.is_Atom or isinstance(a, (FloorDiv, ModularIndexing)) else f"({text})"


def texpr(e) -> str:
    return TritonPrinter().doprint(sympy.sympify(e))
