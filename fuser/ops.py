"""The op table: every ATen op fuser knows, its kind, and its Triton lowering.

Kinds:
- pointwise: one output element from the same-index elements of its inputs. `fmt` renders the Triton
  expression from the operands, already converted to the op's compute dtype (fp32 for 16-bit floats).
- layout: an index map (view, permute, expand, slice, cat, ...). Inside a kernel it is index math,
  never a copy. `index_map` returns, for an output index tuple, the branches (operand, input index,
  condition) and the value where no branch applies.
- reduction: combines elements over some dims (sum, amax, var, argmax, any).
- opaque: everything else (matmul, conv, embedding, random ops): left to eager, with the reason.
"""
from __future__ import annotations

import math
import operator
import re
import dataclasses
from dataclasses import dataclass
from typing import Callable

import sympy
import torch

from . import indexing as ix
from .dtypes import TL_DTYPE, compute_dtype, convert, literal, wrapped

aten = torch.ops.aten
prims = torch.ops.prims

# ----------------------------------------------------------------------------- dtypes

# ----------------------------------------------------------------------------- op kinds


@dataclass(frozen=True)
class Check:
    """A condition eager checks on every element (on `devices`): where `cond` (Triton source) is
    false, eager raises RuntimeError(message), and so does the kernel (codegen/kernel.py)."""
    cond: str
    message: str
    devices: tuple = ("cpu", "cuda")


@dataclass(frozen=True)
class Pointwise:
    fmt: Callable  # (args: Args) -> str
    promote_inputs: bool = False  # compute in the inputs' promoted dtype (comparisons), not the result's
    cast: bool = False            # a dtype conversion: the value is rounded to the result dtype
    bool_args: tuple = ()         # operand positions read as conditions (kept bool, not converted)
    checks: Callable | None = None  # (args: Args) -> list[Check]: what eager raises on
    raw_args: tuple = ()          # operand positions read in their own dtype, never converted (a seed)
    wraps: bool = False           # an int scalar operand is cast to the common int dtype, wrapping (see _WRAPPING)


@dataclass(frozen=True)
class Layout:
    index_map: Callable  # (node, out_index, ranges) -> (branches, other)
    copies: bool = False  # eager materialises its output (clone, cat, pad); views cost nothing there
    indirect: bool = False  # the index along one dim is data (gather): codegen loads it first


@dataclass(frozen=True)
class Reduction:
    combine: str          # sum | max | min | argmax | argmin | any | var
    mean: bool = False    # divide the sum by the number of reduced elements


@dataclass(frozen=True)
class Scatter:
    """index_put without accumulation by one integer index tensor at `dim`, into a graph input that
    nothing else reads (a KV cache written at its new positions): the kernel stores the values into
    the input in place, at the indexed positions, and writes nothing else (fuser.graph.ComputeGraph
    checks the graph allows it).  Its iteration space is the values' (store_shape), not the input's."""
    dim: int


@dataclass(frozen=True)
class Opaque:
    reason: str


class Args:
    """Operands of a pointwise op as Triton source: tensors as expressions, scalars as literals."""

    def __init__(self, node, rendered: list, index: tuple = ()):
        self.node, self.rendered, self.index = node, rendered, index

    def __getitem__(self, i):
        return self.rendered[i]

    def __len__(self):
        return len(self.rendered)

    def kw(self, name, default=None):
        return self.node.kwargs.get(name, default)

    @property
    def dtype(self) -> torch.dtype:
        return self.node.meta["val"].dtype

    def round_to(self, expr: str, dtype: torch.dtype) -> str:
        """An fp32 expression rounded to `dtype` and held in fp32 again (codegen knows how, per backend)."""
        return convert(convert(expr, torch.float32, dtype), dtype, torch.float32)


def _is_float(a: Args) -> bool:
    return a.dtype.is_floating_point


def wraps_scalars(node) -> bool:
    """Whether an op of _WRAPPING casts its int scalars to the integer dtype it computes in, as eager's: not
    for true division, whose result is a float (int16 / 32768 divides by 32768), nor over bools alone (eager
    refuses an int past int64 there)."""
    tensors = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return not node.meta["val"].dtype.is_floating_point and any(t.dtype != torch.bool for t in tensors)


def _alpha(a: Args, b: str) -> str:
    alpha, other = a.kw("alpha", 1), a.node.args[1]
    if isinstance(other, int) and isinstance(alpha, int) and wraps_scalars(a.node):
        return literal(wrapped(alpha * other, a.dtype))  # eager multiplies in the dtype, wrapping
    return b if alpha == 1 else f"({literal(alpha)} * {b})"


def _add(a: Args) -> str:
    if a.dtype == torch.bool:
        return f"({a[0]} | {a[1]})"
    return f"({a[0]} + {_alpha(a, a[1])})"


def _mul(a: Args) -> str:
    return f"({a[0]} & {a[1]})" if a.dtype == torch.bool else f"({a[0]} * {a[1]})"


def _div_mode(a: Args) -> str:
    mode = a.kw("rounding_mode")
    if mode is None:
        return f"({a[0]} / {a[1]})"
    if _is_float(a):
        if mode == "floor":
            return f"_floordiv_float({a[0]}, {a[1]})"
        q = f"({a[0]} / {a[1]})"
        if a.dtype in (torch.float16, torch.bfloat16):  # eager rounds the quotient to 16 bits, then truncates
            q = a.round_to(q, a.dtype)
        return f"_trunc({q})"
    return f"_floordiv_int({a[0]}, {a[1]})" if mode == "floor" else f"({a[0]} // {a[1]})"


def _int_divisor_nonzero(a: Args) -> list:
    """Integer division and remainder by zero raise on CPU (CUDA gives an unspecified value)."""
    if a.dtype.is_floating_point or a.dtype == torch.bool:
        return []
    if a.node.target.overloadpacket is aten.div and a.kw("rounding_mode") is None:
        return []  # true division of ints gives a float
    return [Check(f"({a[1]} != 0)", "ZeroDivisionError", devices=("cpu",))]


def _held(a: Args, i: int) -> str:
    """Operand i as a value of the op's compute dtype, a number one too (`_typed`)."""
    return a[i] if isinstance(a.node.args[i], torch.fx.Node) else _typed(a[i], a.dtype)


def _pow_scalar(a: Args) -> str:
    x, e = a[0], a.node.args[1]
    known = {2: f"({x} * {x})", 3: f"({x} * {x} * {x})", 1: x, 0.5: f"tl.sqrt({x})",
             -0.5: f"tl.rsqrt({x})", -1: f"(1.0 / {x})", -2: f"(1.0 / ({x} * {x}))"}
    if e in known and (_is_float(a) or e in (1, 2, 3)):
        return known[e]
    if e == 0:  # 1 for every x, inf and NaN too (x * 0 + 1 was NaN there, and so x ** 1.0's gradient)
        return f"tl.where({x} != {x}, 1.0, 1.0)" if _is_float(a) else f"({x} * 0 + 1)"
    if not _is_float(a):
        return f"_pow_int({x}, {x} * 0 + {literal(int(e))})"
    return f"_pow({x}, {literal(float(e))})"


def _clamp(a: Args) -> str:
    lo = _bound(a, 1) if len(a) > 1 else a.kw("min")
    hi = _bound(a, 2) if len(a) > 2 else a.kw("max")
    return _clamp_literal(a[0], lo, hi)


def _bound(a: Args, i: int):
    """Argument i of a clamp as _clamp_literal takes it: a number as it is, a tensor operand as its source."""
    return a[i] if isinstance(a.node.args[i], torch.fx.Node) else a.node.args[i]


def _round(a: Args) -> str:
    if a.node.kwargs.get("decimals", 0):
        s = literal(10.0 ** a.kw("decimals"))
        return f"(_rint({a[0]} * {s}) / {s})"
    return f"_rint({a[0]})"


def _fill(a: Args) -> str:
    """A constant tensor's value, held in its dtype's compute dtype: rounded to its dtype as eager's tensor
    holds it (full(0.1) in bf16 is 0.10009765625), and typed (a bare `1` would be an int in a float kernel:
    ones_like(x) fed to copysign gave garbage)."""
    value = a.node.args[1] if a.node.target in (aten.full.default, aten.full_like.default) else a.node.args[0]
    held = TL_DTYPE[compute_dtype(a.dtype)]
    if isinstance(value, torch.fx.Node):  # a symbolic int
        return f"({literal(value)}).to({held})"
    return _typed(literal(torch.tensor(value, dtype=a.dtype).item()), a.dtype)


def _typed(text: str, dtype) -> str:
    """A number's Triton source as a value of `dtype`'s compute dtype: a bare literal would compute in Python's
    arithmetic (pow(0.0, x): 1.0 / 0.0 raised) or as an int in a float kernel (copysign read its bits)."""
    held = TL_DTYPE[compute_dtype(dtype)]
    return f"{text}.to({held})" if text.startswith("tl.") else f"tl.full([], {text}, {held})"


def _arange(a: Args) -> str:
    args = a.node.args
    start, end, step = (0, args[0], 1) if len(args) == 1 else ((*args, 1)[:3])
    return f"({literal(start)} + {ix.texpr(a.index[0])} * {literal(step)})"


def _gelu(a: Args) -> str:
    x = a[0]
    if a.kw("approximate", "none") == "tanh":
        tanh = "libdevice.tanh" if a.dtype == torch.float64 else "_tanh"  # _tanh is single-precision accurate
        return f"(0.5 * {x} * (1.0 + {tanh}(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _compare(sym: str) -> Pointwise:
    return Pointwise(lambda a: f"({a[0]} {sym} {a[1]})", promote_inputs=True)


def _bool(x: str) -> str:
    return f"({x} != 0)"


def _libdevice(name: str) -> Pointwise:
    """A function CUDA's libdevice has (codegen/interp_math.py stands in for it when interpreted)."""
    return Pointwise(lambda a: f"libdevice.{name}({', '.join(a.rendered)})")


def _sign(a: Args) -> str:
    """-1, 0 or 1; 0 for NaN (and for -0.0), as eager's (0 < x) - (x < 0)."""
    x = a[0]
    if a.dtype == torch.bool:
        return x
    return f"(({x} > 0).to({x}.dtype) - ({x} < 0).to({x}.dtype))"


def _signbit(a: Args) -> str:
    dt = a.node.args[0].meta["val"].dtype
    if dt == torch.bool:
        return f"({a[0]} & False)"
    if not dt.is_floating_point:
        return f"({a[0]} < 0)"
    bits = "tl.int64" if dt == torch.float64 else "tl.int32"
    return f"({a[0]}.to({bits}, bitcast=True) < 0)"


def _fmax_fmin(cmp: str) -> Pointwise:
    """fmax/fmin: a NaN operand loses to a number (maximum/minimum propagate it instead)."""
    return Pointwise(lambda a: f"tl.where({a[1]} != {a[1]}, {a[0]}, tl.where({a[0]} {cmp} {a[1]}, {a[0]}, {a[1]}))")


def _elu(a: Args) -> str:
    alpha, scale, input_scale = (*a.node.args[1:], 1.0, 1.0, 1.0)[:3]
    x = a[0]
    neg = f"_expm1({x} * {literal(float(input_scale))})"
    return f"tl.where({x} > 0, {x} * {literal(float(scale))}, {literal(float(alpha * scale))} * {neg})"


def _shift(a: Args, left: bool) -> str:
    """Shifts by a negative amount or by the width or more: 0 to the left, the sign to the right (0 for
    an unsigned dtype; the amount actually shifted by stays in range: LLVM leaves larger shifts undefined)."""
    x, n, bits = a[0], a[1], a.dtype.itemsize * 8
    if left or not a.dtype.is_signed:
        return f"tl.where({n} < 0, 0, tl.where({n} >= {bits}, 0, {x} {'<<' if left else '>>'} tl.where({n} < 0, 0, {n} % {bits})))"
    return f"({x} >> tl.where({n} < 0, {bits - 1}, tl.where({n} >= {bits}, {bits - 1}, {n})))"


def _angle(a: Args) -> str:
    """The argument of a real number: pi below zero, NaN for NaN, else 0."""
    x = a[0]
    return f"tl.where({x} < 0, 3.141592653589793, tl.where({x} != {x}, {x}, {x} * 0.0))"


def _polygamma(a: Args) -> str:
    n, x = a.node.args[0], a[1]
    if n == 0:
        return f"_digamma({x})"
    if n == 1:
        return f"_trigamma({x})"
    return f"({literal(float((-1) ** (n + 1) * math.factorial(n)))} * _zeta({literal(float(n + 1))}, {x}))"


P = Pointwise
POINTWISE = {
    aten.add: P(_add), aten.sub: P(lambda a: f"({a[0]} - {_alpha(a, a[1])})"),
    aten.rsub: P(lambda a: f"({_alpha(a, a[1])} - {a[0]})"),
    aten.mul: P(_mul), aten.div: P(_div_mode, checks=_int_divisor_nonzero), aten.true_divide: P(lambda a: f"({a[0]} / {a[1]})"),
    # Triton's unary minus is 0 - x, which gives +0.0 for 0.0: floats negate by * -1 (IEEE's -0.0)
    aten.neg: P(lambda a: f"({a[0]} * -1.0)" if _is_float(a) else f"(-{a[0]})"),
    aten._neg_view: P(lambda a: f"({a[0]} * -1.0)"),  # a view by the negative bit (`conj().imag`): its value
    aten.abs: P(lambda a: f"tl.abs({a[0]})"),
    aten.reciprocal: P(lambda a: f"(1.0 / {a[0]})"),
    aten.sqrt: P(lambda a: f"tl.sqrt({a[0]})"), aten.rsqrt: P(lambda a: f"tl.rsqrt({a[0]})"),
    aten.exp: P(lambda a: f"tl.exp({a[0]})"), aten.exp2: P(lambda a: f"tl.exp2({a[0]})"),
    aten.expm1: P(lambda a: f"_expm1({a[0]})"),
    aten.log: P(lambda a: f"tl.log({a[0]})"), aten.log2: P(lambda a: f"tl.log2({a[0]})"),
    aten.log10: P(lambda a: f"(tl.log({a[0]}) * 0.4342944819032518)"),
    aten.log1p: P(lambda a: f"_log1p({a[0]})"),
    aten.sin: P(lambda a: f"tl.sin({a[0]})"), aten.cos: P(lambda a: f"tl.cos({a[0]})"),
    aten.tan: P(lambda a: f"(tl.sin({a[0]}) / tl.cos({a[0]}))"),
    aten.tanh: P(lambda a: f"libdevice.tanh({a[0]})" if a.dtype == torch.float64 else f"_tanh({a[0]})"),
    aten.sigmoid: P(lambda a: f"tl.sigmoid({a[0]})"),
    aten.silu: P(lambda a: f"({a[0]} * tl.sigmoid({a[0]}))"),
    aten.relu: P(lambda a: f"tl.where({a[0]} < 0, 0, {a[0]})"),
    aten.leaky_relu: P(lambda a: f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {literal((a.node.args + (0.01,))[1])})"),
    aten.hardtanh: P(lambda a: _clamp_literal(a[0], *(a.node.args + (-1.0, 1.0))[1:3])),
    aten.hardsigmoid: P(lambda a: _clamp_literal(f"({a[0]} / 6.0 + 0.5)", 0.0, 1.0)),
    aten.hardswish: P(lambda a: f"({a[0]} * {_clamp_literal(f'({a[0]} / 6.0 + 0.5)', 0.0, 1.0)})"),
    aten.gelu: P(_gelu), aten.erf: P(lambda a: f"tl.erf({a[0]})"),
    aten.erfc: P(lambda a: f"(1.0 - tl.erf({a[0]}))"),
    aten.pow: P(lambda a: _pow_scalar(a) if a.node.target == aten.pow.Tensor_Scalar
                else f"_pow({_held(a, 0)}, {a[1]})" if _is_float(a) else f"_pow_int({a[0]}, {a[1]})"),
    aten.maximum: P(lambda a: f"_maximum({a[0]}, {a[1]})"), aten.minimum: P(lambda a: f"_minimum({a[0]}, {a[1]})"),
    aten.clamp: P(_clamp), aten.clamp_min: P(lambda a: _clamp_literal(a[0], _bound(a, 1), None)),
    aten.clamp_max: P(lambda a: _clamp_literal(a[0], None, _bound(a, 1))),
    aten.where: P(lambda a: f"tl.where({a[0]}, {a[1]}, {a[2]})", bool_args=(0,)),
    aten.masked_fill: P(lambda a: f"tl.where({a[1]}, {a[2]}, {a[0]})", bool_args=(1,)),
    aten.sign: P(_sign), aten.sgn: P(_sign), aten.signbit: P(_signbit, promote_inputs=True),
    aten.floor: P(lambda a: f"tl.floor({a[0]})" if _is_float(a) else a[0]),
    aten.ceil: P(lambda a: f"tl.ceil({a[0]})" if _is_float(a) else a[0]),
    aten.trunc: P(lambda a: f"_trunc({a[0]})" if _is_float(a) else a[0]),
    aten.round: P(lambda a: _round(a) if _is_float(a) else a[0]),
    aten.frac: P(lambda a: f"({a[0]} - _trunc({a[0]}))"),
    aten.remainder: P(lambda a: f"_remainder({a[0]}, {a[1]})", checks=_int_divisor_nonzero),
    aten.fmod: P(lambda a: f"_fmod({a[0]}, {a[1]})", checks=_int_divisor_nonzero),
    aten.floor_divide: P(lambda a: f"_floordiv_float({a[0]}, {a[1]})" if _is_float(a) else f"_floordiv_int({a[0]}, {a[1]})",
                         checks=_int_divisor_nonzero),
    **{op: _compare(sym) for op, sym in ((aten.eq, "=="), (aten.ne, "!="), (aten.lt, "<"), (aten.le, "<="),
                                          (aten.gt, ">"), (aten.ge, ">="))},
    aten.isnan: P(lambda a: f"({a[0]} != {a[0]})", promote_inputs=True),
    aten.isinf: P(lambda a: f"(tl.abs({a[0]}) == float(\"inf\"))", promote_inputs=True),
    aten.logical_not: P(lambda a: f"({a[0]} == 0)", promote_inputs=True),
    **{getattr(aten, n): _libdevice(n) for n in ("asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
                                                  "atanh", "erfinv", "lgamma", "hypot", "copysign", "nextafter")},
    **{op: _libdevice(n) for op, n in ((aten.i0, "cyl_bessel_i0"), (aten.special_i1, "cyl_bessel_i1"),
                                       (aten.special_modified_bessel_i0, "cyl_bessel_i0"),
                                       (aten.special_modified_bessel_i1, "cyl_bessel_i1"),
                                       (aten.special_erfcx, "erfcx"), (aten.special_ndtri, "normcdfinv"),
                                       (aten.special_bessel_j0, "j0"), (aten.special_bessel_j1, "j1"),
                                       (aten.special_bessel_y0, "y0"), (aten.special_bessel_y1, "y1"))},
    aten.bitwise_left_shift: P(lambda a: _shift(a, True)), aten.bitwise_right_shift: P(lambda a: _shift(a, False)),
    aten.__lshift__: P(lambda a: _shift(a, True)), aten.__rshift__: P(lambda a: _shift(a, False)),  # x << 2
    aten.gcd: P(lambda a: f"_gcd({a[0]}, {a[1]})"),
    aten.lcm: P(lambda a: f"_lcm({a[0]}, {a[1]})"),
    aten.angle: P(_angle),
    aten.ldexp: P(lambda a: f"({a[0]} * tl.exp2({a[1]}))"),  # eager: x * 2.0 ** e
    aten.fmax: _fmax_fmin(">"), aten.fmin: _fmax_fmin("<"),
    aten.elu: P(_elu),
    aten.digamma: P(lambda a: f"_digamma({a[0]})"), aten.polygamma: P(_polygamma),
    aten.special_zeta: P(lambda a: f"_zeta({a[0]}, {a[1]})"),
    aten.special_i0e: P(lambda a: f"_i0e({a[0]})"), aten.special_i1e: P(lambda a: f"_i1e({a[0]})"),
    aten.special_modified_bessel_k0: P(lambda a: f"(_k0e({a[0]}) * tl.exp(-{a[0]}))"),
    aten.special_modified_bessel_k1: P(lambda a: f"(_k1e({a[0]}) * tl.exp(-{a[0]}))"),
    aten.special_scaled_modified_bessel_k0: P(lambda a: f"_k0e({a[0]})"),
    aten.special_scaled_modified_bessel_k1: P(lambda a: f"_k1e({a[0]})"),
    aten.special_spherical_bessel_j0: P(lambda a: f"_spherical_j0({a[0]})"),
    # as selects and comparisons of truth values: the interpreter has no & | ^ between a float
    # operand's comparison and a scalar's
    aten.logical_and: P(lambda a: f"tl.where({_bool(a[0])}, {_bool(a[1])}, False)", promote_inputs=True),
    aten.logical_or: P(lambda a: f"tl.where({_bool(a[0])}, True, {_bool(a[1])})", promote_inputs=True),
    aten.logical_xor: P(lambda a: f"({_bool(a[0])} != {_bool(a[1])})", promote_inputs=True),
    aten.bitwise_and: P(lambda a: f"({a[0]} & {a[1]})"), aten.bitwise_or: P(lambda a: f"({a[0]} | {a[1]})"),
    aten.bitwise_xor: P(lambda a: f"({a[0]} ^ {a[1]})"),
    aten.bitwise_not: P(lambda a: f"({a[0]} == 0)" if a.dtype == torch.bool else f"(~{a[0]})"),
    aten._to_copy: P(lambda a: a[0], cast=True), prims.convert_element_type: P(lambda a: a[0], cast=True),
    aten.full: P(_fill), aten.full_like: P(_fill), aten.scalar_tensor: P(_fill),
    aten.arange: P(_arange),
}


# Eager's binary ops cast an int scalar to the tensors' common dtype as C's casts do, wrapping
# (TensorIterator's wrapped number): int8 + 1000 adds -24, int8 > 1000 compares with -24.  Ops that
# take the scalar as a bound or a value to store (clamp, masked_fill, full, pow) check it and raise.
_WRAPPING = (aten.add, aten.sub, aten.rsub, aten.mul, aten.div, aten.remainder, aten.fmod, aten.floor_divide,
             aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.bitwise_and, aten.bitwise_or,
             aten.bitwise_xor, aten.bitwise_left_shift, aten.bitwise_right_shift, aten.__lshift__, aten.__rshift__)
POINTWISE.update({op: dataclasses.replace(POINTWISE[op], wraps=True) for op in _WRAPPING})


def dropout_expr(x: str, seed: str, index: str, p: float, offset: int) -> str:
    """fuser::dropout (fuser/dropout.py) of the value x at `index`, the element's index in the
    contiguous numbering of its shape, as Triton source: written once here for the fused lowering and
    the op's own kernel, so both draw the same masks bit for bit.

    Kept where Philox's uniform u in [0, 1) at counter offset + index (int64: no wrap) is >= p, so
    P(kept) = 1 - p, p = 0 keeps all and p = 1 none; kept x * (1 / (1 - p)), dropped x * 0.0: eager's
    x * mask * scale (one rounding), so a NaN or inf dropped is NaN there and here."""
    if p == 0:
        return x
    if p == 1:
        return f"({x} * 0.0)"  # eager's scale is 0 here, never 1 / 0
    # + seed * 0: the counter as an int64 tensor whatever the index is (an int32 block, or the literal
    # 0 of a 0-d tensor); compiled Triton has no tl.to_tensor
    u = f"tl.rand({seed}, {index} + {seed} * 0 + {offset})"
    return f"tl.where({u} >= {literal(float(p))}, {x} * {literal(1.0 / (1.0 - p))}, {x} * 0.0)"


def _dropout(a: Args) -> str:
    p, offset = a.node.args[2:4]
    return dropout_expr(a[0], a[1], ix.texpr(ix.linearize(a.index, _shape(a.node))), p, offset)


# Ops of our own, matched by qualified name: fuser/dropout.py defines fuser::dropout (its eager
# kernel needs the runtime, a higher layer this table must not import), and the name is what the op
# is in every graph, traced or not.
NAMED = {
    "fuser::dropout": P(_dropout, raw_args=(1,)),  # the seed stays int64
}


def _clamp_literal(x: str, lo, hi) -> str:
    """x clamped to [lo, hi] (a tensor operand's Triton source, or a Python number; None: no bound).  NaN stays
    NaN, and a NaN bound makes the result NaN, as eager's."""
    for bound, cmp in ((lo, "<"), (hi, ">")):
        if bound is None:
            continue
        b = bound if isinstance(bound, str) else literal(bound)
        x = f"tl.where({x} {cmp} {b}, {b}, {x})"
        if isinstance(bound, str) or math.isnan(bound):  # a tensor, or a NaN number
            x = f"tl.where({b} != {b}, {b}, {x})"
    return x


# Helpers the generated kernels may call; emitted into a kernel's module only where it uses them.
HELPERS = {
    "_tanh": """
@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1) cancels near 0 (x's relative precision and -0.0's sign lost): there, Cephes'
    # tanhf polynomial, x * (1 + x^2 p(x^2)), single-precision accurate (fp64 takes libdevice's)
    z = x * x
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
    small = x * (1.0 + (p - 3.33332819422e-1) * z)
    return tl.where(tl.abs(x) < 0.625, small, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
""",
    "_log1p": """
@triton.jit
def _log1p(x):
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, tl.log(u) * (x / (u - 1.0))))
""",
    "_expm1": """
@triton.jit
def _expm1(x):
    u = tl.exp(x)
    return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0,
                    tl.where(u == float("inf"), u, (u - 1.0) * (x / tl.log(u)))))
""",
    "_trunc": """
@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
""",
    "_rint": """
@triton.jit
def _rint(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(tie & odd, r - 1.0, r)
    return tl.where(r == 0, x * 0.0, r)  # -0.4 rounds to -0.0
""",
    "_pow": """
@triton.jit
def _pow(a, b):
    # C's pow: |a|^b; an odd integer power keeps a's sign (-0.0's too: (-0.0)^-3 is -inf); a negative
    # finite a to a non-integer power is NaN (-inf's is inf or 0); x^0 and 1^y are 1, NaN or not
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    is_int = b == tl.floor(b)
    odd = is_int & ((b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    # (selects, not & and |: the interpreter refuses those between a block and a scalar exponent's)
    negative = tl.where(a == 0, 1.0 / a < 0, a < 0)
    r = tl.where(negative, tl.where(odd, r * -1.0, r), r)  # -r is 0 - r on the GPU: +0.0 for 0.0
    r = tl.where(a < 0, tl.where(a != -float("inf"), tl.where(is_int, r, float("nan")), r), r)
    return tl.where(b == 0, 1.0, tl.where(a == 1.0, 1.0, r))
""",
    "_pow_int": """
@triton.jit
def _pow_int(a, b):
    # integer powers by squaring; a negative exponent gives 1 / a^-b truncated (0 unless a is 1 or -1)
    r = a * 0 + b * 0 + 1  # every loop value a block of the result's shape (a or b may be a scalar)
    base = a + b * 0
    e = tl.where(b < 0, 0, b) + a * 0
    for _ in range(0, 64):
        r = tl.where((e & 1) != 0, r * base, r)
        base = base * base
        e = e >> 1
    odd = (b & 1) != 0
    neg = tl.where(a == 1, 1, tl.where(a == -1, tl.where(odd, -1, 1), 0))
    return tl.where(b < 0, neg.to(r.dtype), r)
""",
    "_gcd": """
@triton.jit
def _gcd(a, b):
    # Euclid's algorithm, as many steps as the worst case (consecutive Fibonacci numbers) needs
    x = tl.abs(a) + b * 0
    y = tl.abs(b) + a * 0
    for _ in range(0, 94):
        nz = y != 0
        r = x % tl.where(nz, y, 1)
        x = tl.where(nz, y, x)
        y = tl.where(nz, r, y)
    return x
""",
    "_lcm": """
@triton.jit
def _lcm(a, b):
    g = _gcd(a, b)
    return tl.abs(tl.where(g == 0, 0, a // tl.where(g == 0, 1, g) * b))
""",
    "_maximum": """
@triton.jit
def _maximum(a, b):
    return tl.where(a > b, a, tl.where(a != a, a, b))  # no `|`: the interpreter refuses a 0-d operand's
""",
    "_minimum": """
@triton.jit
def _minimum(a, b):
    return tl.where(a < b, a, tl.where(a != a, a, b))  # no `|`: the interpreter refuses a 0-d operand's
""",
    "_remainder": """
@triton.jit
def _remainder(a, b):
    r = _fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
""",
    "_fmod": """
@triton.jit
def _fmod(a, b):
    r = a % b
    return tl.where(r == 0, a * 0, r)  # a zero takes a's sign (the GPU's % gave +0.0 for -0.0 % 2)
""",
    "_rne_bf16": """
@triton.jit
def _rne_bf16(x):
    # fp32 -> bf16, rounding to nearest even by hand (Triton's interpreter truncates)
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    b = tl.where(x != x, x.to(tl.uint32, bitcast=True) | 0x400000, b)  # a NaN's mantissa would carry into its sign
    # the upper half as the bf16's bits (the interpreter's own conversion flushes subnormals to 0)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
""",
    "_floordiv_float": """
@triton.jit
def _floordiv_float(a, b):
    # as torch computes it (c10's div_floor_floating): exact where a / b rounds onto an integer
    mod = a % b
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    return tl.where(b == 0, a / b, tl.where(div == 0, (a / b) * 0.0, fl))  # a zero takes a / b's sign
""",
    # Special functions libdevice lacks, after Cephes and torch's ATen/native/Math.h.
    "_digamma": """
@triton.jit
def _digamma(x):
    # reflection for x < 0, recurrence up to x >= 10, then the asymptotic series in 1/x^2.
    # (Float constants stay literals: a float assigned to a name is an fp32 value in Triton.)
    neg = x < 0
    frac = x - tl.where(x < 0, tl.ceil(x), tl.floor(x))
    refl = 3.141592653589793 * tl.cos(3.141592653589793 * frac) / tl.sin(3.141592653589793 * frac)
    y = tl.where(neg, 1.0 - x, x)
    acc = y * 0.0
    for _ in tl.static_range(10):
        small = y < 10.0
        acc = acc - tl.where(small, 1.0 / y, 0.0)
        y = tl.where(small, y + 1.0, y)
    z = 1.0 / (y * y)
    poly = ((((((8.33333333333333333333e-2 * z - 2.10927960927960927961e-2) * z + 7.57575757575757575758e-3) * z
                - 4.16666666666666666667e-3) * z + 3.96825396825396825397e-3) * z - 8.33333333333333333333e-3) * z
            + 8.33333333333333333333e-2)
    r = acc + tl.log(y) - 0.5 / y - tl.where(y < 1e17, z * poly, 0.0)
    r = tl.where(neg, r - refl, r)
    r = tl.where(neg & (x == tl.floor(x)), float("nan"), r)
    r = tl.where(x == float("inf"), x, r)
    return tl.where(x == 0, tl.where(1.0 / x > 0, -float("inf"), float("inf")), r)  # copysign(inf, -x)
""",
    "_trigamma": """
@triton.jit
def _trigamma(x):
    refl = x < 0.5
    s = tl.sin(3.141592653589793 * x)
    acc = tl.where(refl, -9.869604401089358 / (s * s), 0.0)
    y = tl.where(refl, 1.0 - x, x)
    for _ in tl.static_range(6):
        acc = acc + 1.0 / (y * y)
        y = y + 1.0
    ixx = 1.0 / (y * y)
    acc = acc + (1.0 + 1.0 / (2.0 * y) + ixx * (1.0 / 6.0 - ixx * (1.0 / 30.0 - ixx * (1.0 / 42.0)))) / y
    return tl.where(refl, -acc, acc)
""",
    "_zeta": """
@triton.jit
def _zeta(x, q):
    # Hurwitz zeta: nine terms of the sum, then Euler-Maclaurin (Cephes zeta.c; its 12 correction
    # terms unrolled below, with their coefficients as literals)
    x, q = q * 0.0 + x, x * 0.0 + q  # both blocks: the interpreter has no & between scalar conditions
    s = _pow(q, -x)
    a = q
    b = s * 0.0
    for _ in tl.static_range(9):
        a = a + 1.0
        b = _pow(a, -x)
        s = s + b
    # Cephes sums on while a <= 9 (q < 0): as many more terms as the block's most negative q needs
    more = tl.where((a <= 9.0) & (q > -1e6), 9.0 - a + 1.0, 0.0)
    if len(more.shape) > 0:
        more = tl.max(tl.ravel(more), 0)
    more = more.to(tl.int32)
    for _ in range(0, more):
        on = a <= 9.0
        a = tl.where(on, a + 1.0, a)
        b = tl.where(on, _pow(a, -x), b)
        s = tl.where(on, s + b, s)
    w = a
    s = s + b * w / (x - 1.0) - 0.5 * b
    fa = s * 0.0 + 1.0
    k = s * 0.0
    done = s != s
""" + "".join(f"""    fa = fa * (x + k)
    b = b / w
    t = fa * b / {c!r}
    s = tl.where(done, s, s + t)
    done = done | (tl.abs(t / s) < 1.11022302462515654042e-16)
    fa = fa * (x + k + 1.0)
    b = b / w
    k = k + 2.0
""" for c in (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
              -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
              1.8152105401943546773e17, -7.1661652561756670113e18)) + """    bad_q = (q <= 0) & (q == tl.floor(q))
    s = tl.where((q <= 0) & (x != tl.floor(x)), float("nan"), s)
    s = tl.where(bad_q, float("inf"), s)
    s = tl.where(x < 1.0, float("nan"), s)
    return tl.where(x == 1.0, float("inf"), s)
""",
    "_bessel_i_asym": """
@triton.jit
def _bessel_i_asym(ax, nu4):
    # exp(-x) I_nu(x) for large x: 1/sqrt(2 pi x) sum_k prod_j ((2j-1)^2 - 4 nu^2) / (k! (8x)^k)
    term = 1.0 / tl.sqrt(6.283185307179586 * ax)
    acc = term
    for k in tl.static_range(1, 9):
        term = term * ((2 * k - 1) * (2 * k - 1) - nu4) / (8.0 * k * ax)
        acc = acc + term
    return acc
""",
    "_i0e": """
@triton.jit
def _i0e(x):
    ax = tl.abs(x)
    small = libdevice.cyl_bessel_i0(tl.where(ax < 80.0, x, 0.0)) * tl.exp(-ax)
    return tl.where(ax < 80.0, small, _bessel_i_asym(ax, 0.0))
""",
    "_i1e": """
@triton.jit
def _i1e(x):
    ax = tl.abs(x)
    small = libdevice.cyl_bessel_i1(tl.where(ax < 80.0, x, 0.0)) * tl.exp(-ax)
    big = _bessel_i_asym(ax, 4.0)
    return tl.where(ax < 80.0, small, tl.where(x < 0, -big, big))
""",
    "_k_int": """
@triton.jit
def _k_int(x, ONE: tl.constexpr):
    # exp(x) K_nu(x), nu = 0 or 1, from K_nu(x) = int_0^inf exp(-x cosh t) cosh(nu t) dt by the
    # trapezoid rule (exponentially convergent here): in t for x <= 2, in v = sqrt(2x) sinh(t/2) above
    xs = tl.where(x <= 2.0, x, 2.0)
    acc = xs * 0.0
    for k in range(0, 81):
        t = xs * 0.0 + k * 0.25  # in x's precision
        ct = 0.5 * (tl.exp(t) + tl.exp(-t))
        f = tl.exp(-xs * (ct - 1.0))
        if ONE:
            f = f * ct
        acc = acc + tl.where(k == 0, 0.5, 1.0) * f
    xl = tl.where(x > 2.0, x, 2.0)
    acc2 = xl * 0.0
    for k in range(0, 28):
        v = xl * 0.0 + k * 0.25
        f = tl.exp(-v * v) * 2.0 / tl.sqrt(2.0 * xl + v * v)
        if ONE:
            f = f * (1.0 + v * v / xl)
        acc2 = acc2 + tl.where(k == 0, 0.5, 1.0) * f
    return 0.25 * tl.where(x <= 2.0, acc, acc2)
""",
    "_k0e": """
@triton.jit
def _k0e(x):
    # below 1e-6 the leading terms of the series: -(log(x/2) + gamma) (1 + x^2/4) + x^2/4
    tiny = (-(tl.log(0.5 * x) + 0.5772156649015329) * (1.0 + 0.25 * x * x) + 0.25 * x * x) * tl.exp(x)
    r = tl.where(x < 1e-6, tiny, _k_int(tl.where(x < 1e-6, 1.0, x), False))
    r = tl.where(x == 0, float("inf"), r)
    return tl.where(x < 0, float("nan"), r)
""",
    "_k1e": """
@triton.jit
def _k1e(x):
    tiny = (1.0 / x + 0.5 * x * (tl.log(0.5 * x) + 0.5772156649015329 - 0.5)) * tl.exp(x)
    r = tl.where(x < 1e-6, tiny, _k_int(tl.where(x < 1e-6, 1.0, x), True))
    r = tl.where(x == 0, float("inf"), r)
    return tl.where(x < 0, float("nan"), r)
""",
    "_spherical_j0": """
@triton.jit
def _spherical_j0(x):
    x2 = x * x
    series = 1.0 + x2 * (-1.0 / 6.0 + x2 * (1.0 / 120.0 + x2 * (-1.0 / 5040.0 + x2 * (
        1.0 / 362880.0 + x2 * (-1.0 / 39916800.0 + x2 * (1.0 / 6227020800.0))))))
    r = tl.where(tl.abs(x) < 0.5, series, tl.sin(x) / x)
    return tl.where(tl.abs(x) == float("inf"), 0.0, r)
""",
    "_floordiv_int": """
@triton.jit
def _floordiv_int(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)
""",
}



def helpers_for(source: str) -> list[str]:
    """Sources of the helpers `source` calls, and of the helpers they call, each once, callees first."""
    found: dict[str, str] = {}

    def visit(text):
        for name, src in HELPERS.items():
            if name not in found and re.search(rf"\b{name}\(|\b{name}\)", text):
                found[name] = ""  # mark before recursing: no cycles
                visit(src)
                found.pop(name)
                found[name] = src

    visit(source)
    return list(found.values())


# ----------------------------------------------------------------------------- layout


def _shape(n) -> tuple:
    return ix.shape_of(n.meta["val"])


def _size_arg(a):
    """An int argument of a layout op (a slice start, a pad width) as an expression."""
    if isinstance(a, torch.fx.Node):
        return ix.expr(a.meta["val"])
    return a if a is None else sympy.Integer(a)


def _nonneg(e, ranges) -> bool:
    return ranges.sizes.nonneg(e) if isinstance(ranges, ix.Ranges) else e >= 0


def _start(start, size, ranges, what: str, clamp: bool = True):
    """A slice's start (or a select's index) as eager reads it: from the end where negative, clamped into
    [0, size] for a slice.  Over symbolic sizes a start that is negative at every size (`x[:, -2:]` at a
    symbolic length, the backward's slice_scatter of it) is size + start (Max(0, .) where the ranges do not
    keep it in range); one whose sign the ranges do not decide raises (the region is left to eager)."""
    if start.is_Integer and size.is_Integer:
        start = start + size if start < 0 else start
        return min(max(start, 0), size) if clamp else start
    if _nonneg(start, ranges):
        return start
    if _nonneg(-start - 1, ranges):
        wrapped = size + start
        return wrapped if not clamp or _nonneg(wrapped, ranges) else sympy.Max(0, wrapped)
    raise ValueError(f"{what} {start} may be negative")


def _view(node, idx, ranges):
    src = node.args[0]
    flat = ix.linearize(idx, _shape(node))
    return [(src, ix.delinearize(flat, _shape(src), ranges), None)], None


def _identity(node, idx, ranges):
    return [(node.args[0], tuple(idx), None)], None


def _permute(node, idx, ranges):
    dims = [d % len(idx) for d in node.args[1]]
    out = [None] * len(idx)
    for i, d in enumerate(dims):
        out[d] = idx[i]
    return [(node.args[0], tuple(out), None)], None


def _expand(node, idx, ranges):
    return [(node.args[0], ix.broadcast_index(idx, _shape(node), _shape(node.args[0])), None)], None


def _slice(node, idx, ranges):
    src = node.args[0]
    dim, start, _, step = (tuple(node.args[1:]) + (0, None, None, 1))[:4]
    dim %= len(idx)
    size = _shape(src)[dim]
    start = _start(sympy.Integer(0) if start is None else _size_arg(start), size, ranges, "slice start")
    out = list(idx)
    out[dim] = start + idx[dim] * (step or 1)
    return [(src, tuple(out), None)], None


def _select(node, idx, ranges):
    src = node.args[0]
    dim, i = node.args[1], _size_arg(node.args[2])
    dim %= len(_shape(src))
    i = _start(i, _shape(src)[dim], ranges, "select index", clamp=False)
    out = list(idx)
    out.insert(dim, i)
    return [(src, tuple(out), None)], None


def _cat(node, idx, ranges):
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= len(idx)
    branches, offset = [], 0
    for t in node.args[0]:
        shape = _shape(t)
        if ix.numel(shape) == 0:
            continue  # torch.cat skips empty legacy tensors
        size = shape[dim]
        out = list(idx)
        out[dim] = idx[dim] - offset
        branches.append((t, tuple(out), (offset, offset + size, dim)))
        offset += size
    return branches, None


def _flip(node, idx, ranges):
    shape = _shape(node)
    dims = {d % len(shape) for d in node.args[1]}
    out = tuple(shape[d] - 1 - i if d in dims else i for d, i in enumerate(idx))
    return [(node.args[0], out, None)], None


def _pad(node, idx, ranges):
    src, pad = node.args[0], node.args[1]
    value = (node.args + (0.0,))[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
    shape = _shape(src)
    out, conds = list(idx), []
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        lo = _size_arg(pad[2 * k])
        out[d] = idx[d] - lo
        conds.append((lo, lo + shape[d], d))
    return [(src, tuple(out), tuple(conds))], value


def index_parts(node) -> tuple:
    """(source, [(dim, index node)], where the indices' dims sit in the output, how many) of x[indices]:
    integer index tensors at some dims, broadcast together; their dims replace the indexed ones where
    those are adjacent, else lead the output (numpy's rule: x[:, i, :, j] is [*broadcast(i, j), ...])."""
    given = [(d, t) for d, t in enumerate(node.args[1]) if t is not None]
    dims = [d for d, _ in given]
    span = max(t.meta["val"].dim() for _, t in given)
    return node.args[0], given, dims[0] if dims == list(range(dims[0], dims[-1] + 1)) else 0, span


def gather_parts(node):
    """(source, dim, index node, where the index sits in the output's dims, how many dims it spans)
    of a gather-like node but indexing (index_parts): gather's index has the output's shape;
    index_select's is 1-D at `dim`; embedding(weight, t) is weight[t]."""
    packet = node.target.overloadpacket
    src = node.args[0]
    if packet is aten.embedding:  # weight[indices]: the indices' dims, then the row's
        return src, 0, node.args[1], 0, node.args[1].meta["val"].dim()
    dim = node.args[1] % max(len(_shape(src)), 1)
    if packet is aten.gather:
        return src, dim, node.args[2], 0, None
    return src, dim, node.args[2], dim, 1


def _slice_scatter(node, idx, ranges):
    """out = input with src written over input[dim][start::step] (len(src) elements): src where the
    index is in that slice, input elsewhere."""
    names = ("input", "src", "dim", "start", "end", "step")
    a = {"dim": 0, "start": None, "end": None, "step": 1, **dict(zip(names, node.args)), **node.kwargs}
    step = a["step"]
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"slice_scatter with step {step}")
    dim = a["dim"] % len(idx)
    size = _shape(a["input"])[dim]
    start = _start(sympy.Integer(0) if a["start"] is None else _size_arg(a["start"]), size, ranges, "slice_scatter start")
    out = list(idx)
    length = _shape(a["src"])[dim]
    if step == 1:
        out[dim] = idx[dim] - start
        return [(a["src"], tuple(out), (start, start + length, dim)), (a["input"], tuple(idx), None)], None
    out[dim] = ix.FloorDiv(idx[dim] - start, step)
    hi = start + (length - 1) * step + 1
    return [(a["src"], tuple(out), ((start, hi, dim, step),)), (a["input"], tuple(idx), None)], None


L = Layout
LAYOUT = {
    aten.view: L(_view), aten._unsafe_view: L(_view), aten.reshape: L(_view), aten.alias: L(_identity),
    aten.unsqueeze: L(_view), aten.squeeze: L(_view), aten.permute: L(_permute),
    aten.t: L(lambda n, i, r: _permute_dims(n, i, (1, 0))),
    aten.expand: L(_expand), aten.slice: L(_slice), aten.select: L(_select),
    aten.clone: L(_identity, copies=True), aten.lift_fresh_copy: L(_identity, copies=True),
    aten.cat: L(_cat, copies=True), aten.flip: L(_flip, copies=True),
    aten.constant_pad_nd: L(_pad, copies=True),
    aten.slice_scatter: L(_slice_scatter, copies=True),
    # gathers: index_select (torch's roll decomposes to it, with an index computed from arange),
    # indexing by integer tensors (a relative-position-bias table; a mask by batch and position) and
    # embedding (token ids); the index is loaded or computed in the kernel (see the codegen's _gather)
    aten.gather: L(None, copies=True, indirect=True),
    aten.index_select: L(None, copies=True, indirect=True),
    aten.index: L(None, copies=True, indirect=True),
    aten.embedding: L(None, copies=True, indirect=True),
}



def _permute_dims(node, idx, dims):
    if len(idx) < 2:
        return [(node.args[0], tuple(idx), None)], None
    out = [None] * len(idx)
    for i, d in enumerate(dims):
        out[d] = idx[i]
    return [(node.args[0], tuple(out), None)], None


# ----------------------------------------------------------------------------- reductions

R = Reduction
REDUCTION = {
    aten.sum: R("sum"), aten.mean: R("sum", mean=True), aten.amax: R("max"), aten.amin: R("min"),
    aten.argmax: R("argmax"), aten.argmin: R("argmin"), aten.any: R("any"),
    aten.var: R("var"), aten.var_mean: R("var"),
}


def reduction_dims(node) -> tuple[int, ...]:
    """The dims a reduction node reduces over its input (all dims where the op says so)."""
    ndim = len(_shape(node.args[0]))
    op = node.target.overloadpacket
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if op in (aten.argmax, aten.argmin) and dims is None:
        dims = None
    if isinstance(dims, int):
        dims = [dims]
    if not dims:  # None or []: every dim
        return tuple(range(ndim))
    return tuple(sorted(d % max(ndim, 1) for d in dims))


# ----------------------------------------------------------------------------- opaque

_FEW_LONG_ROWS = ("kept whole over fewer rows than the GPU's processors, each longer than a program holds: eager's "
                  "kernel is faster there than ours, a program a row (decompositions.softmax_over_many_rows)")
OPAQUE = {
    aten._softmax: _FEW_LONG_ROWS,
    aten._log_softmax: _FEW_LONG_ROWS,
    aten.mm: "matmul: compute-bound, left to cuBLAS",
    aten.bmm: "matmul: compute-bound, left to cuBLAS",
    aten.addmm: "matmul: compute-bound, left to cuBLAS",
    aten._addmm_activation: "matmul with its activation in cuBLASLt's epilogue (fuser/epilogue.py)",
    aten.baddbmm: "matmul: compute-bound, left to cuBLAS",
    aten.convolution: "convolution: compute-bound, left to cuDNN",
    aten.convolution_backward: "convolution: compute-bound, left to cuDNN",
    aten._scaled_dot_product_flash_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_efficient_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_cudnn_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_flash_attention_for_cpu: "attention already fused by SDPA",
    aten.scaled_dot_product_attention: "attention already fused by SDPA",
    aten.contiguous: "a copy only where the tensor is not contiguous at run time (SDPA's output, transposed, "
                     "usually is: fuser.graph.contiguous_where_copied); a view then",
    aten.native_dropout: "random: dropout in training is left to eager",
    aten.copy_: "writes a mutated input's new value back into it (a buffer, a cache), as AOT Autograd did after the graph",
    aten.bernoulli: "random numbers are left to eager",
    aten.rand: "random numbers are left to eager", aten.randn: "random numbers are left to eager",
    aten.randint: "random numbers are left to eager (fuser::dropout's seed is one)",
    aten.embedding_dense_backward: "an embedding's gradient: eager's kernels (fuser/embedding.py takes a small "
                                   "table where the cost model says it pays; decomposed, it would be an index_put "
                                   "with accumulate, which serialises repeated indices)",
}

# SDPA kernels stay whole (they already never write the scores); the core decompositions would
# otherwise turn the CPU one into matmul + softmax.  An embedding's gradient stays whole: decomposed,
# it is an index_put with accumulate, whose CUDA kernel serialises repeated indices (T5's position
# bias, 65536 positions into 32 buckets: 2.5 ms a step, bench/notes.md run 33).
KEEP_WHOLE = [aten._scaled_dot_product_flash_attention_for_cpu, aten.native_dropout, aten.embedding_dense_backward]


def classify(node) -> Pointwise | Layout | Reduction | Opaque:
    """The op-table entry of an fx node, or the reason it stays eager."""
    target = node.target
    if node.op != "call_function":
        return Opaque("not an op")
    packet = getattr(target, "overloadpacket", None)
    if packet in OPAQUE:
        return Opaque(OPAQUE[packet])
    if packet is aten.index_put:
        return _scatter(node)
    if packet is aten.scatter:
        return _one_hot_scatter(node)
    if (packet in (aten.argmax, aten.argmin) or packet is aten.abs and node.meta["val"].device.type == "cpu") \
            and _bool_operand(node):  # (CUDA's abs takes bools)
        return Opaque(f"{packet.__name__} of a bool tensor: eager raises (not implemented for 'Bool')")
    if packet in (aten.clamp, aten.clamp_min, aten.clamp_max) and _out_of_range(node, (*node.args[1:], *node.kwargs.values())):
        return Opaque("a clamp bound outside the tensor's dtype: eager raises (it cannot be converted without "
                      "overflow) or, for an unsigned dtype, wraps it around")
    if packet in (aten.add, aten.sub, aten.rsub) and _out_of_range(node, (node.kwargs.get("alpha", 1),)):
        return Opaque("an alpha outside the tensor's dtype: eager raises (it cannot be converted without overflow)")
    if packet is aten.nextafter and node.meta["val"].dtype in (torch.float16, torch.bfloat16):
        return Opaque("nextafter in a 16-bit dtype: its step is the 16-bit format's, not fp32's (kernels compute "
                      "in fp32): left to eager")
    if packet is aten.index and not _integer_indices(node):
        return Opaque("indexing by a mask (a gather of a data-dependent size), or by several tensors one of them "
                      "0-d (torch's fake tensors shape it otherwise than eager): left to eager")
    for table in (POINTWISE, LAYOUT, REDUCTION):
        if packet in table:
            return table[packet]
    if isinstance(target, torch._ops.OpOverload) and target.name() in NAMED:
        return NAMED[target.name()]
    return Opaque(f"no Triton lowering for {target}")


def _one_hot_scatter(node) -> Pointwise | Opaque:
    """`x.scatter(dim, index, value)` where index has one element along dim and x's sizes elsewhere (the
    one-hot of a cross-entropy's backward, label smoothing's): pointwise, where(index == position, value, x);
    an index outside [0, size) raises, as eager (CPU: its RuntimeError; CUDA: a device assert)."""
    if node.target not in (aten.scatter.value, aten.scatter.src):
        return Opaque("scatter with a reduction: left to eager")
    xs, ids = _shape(node.args[0]), _shape(node.args[2])
    dim, size = _one_hot_dim(node)
    if len(xs) != len(ids) or ids[dim] != 1 or any(a != b for d, (a, b) in enumerate(zip(xs, ids)) if d != dim) \
            or size == 0:  # (into a dim of size 0: eager raises, and a kernel computes nothing)
        return Opaque("scatter at several positions per row, or by an index of another shape than the input's: "
                      "left to eager")
    if node.target is aten.scatter.src and _shape(node.args[3]) != ids:
        return Opaque("scatter of a source larger than its index: left to eager")
    if _out_of_range(node, node.args[3:4]):
        return Opaque("a scattered value outside the tensor's dtype: eager raises (it cannot be converted without overflow)")
    return ONE_HOT


# ops whose float operand a kernel reads as a rendered operand (the arithmetic), not as a Python number while lowering
FLOAT_OPERAND_OPS = (aten.mul, aten.div, aten.add, aten.sub, aten.rsub)


def _one_hot_dim(node) -> tuple[int, object]:
    """The scattered dim (non-negative) and its size."""
    xs = _shape(node.args[0])
    dim = node.args[1] % max(len(xs), 1)
    return dim, xs[dim] if xs else 1


def _one_hot(a: Args) -> str:
    dim, _ = _one_hot_dim(a.node)
    position = ix.texpr(a.index[dim]) if a.index else "0"
    return f"tl.where({a[2]} == {position}, {_held(a, 3)}, {a[0]})"


def _one_hot_index_in_range(a: Args) -> list:
    dim, size = _one_hot_dim(a.node)
    return [Check(f"({a[2]} >= 0) & ({a[2]} < {ix.texpr(size)})",
                  f"scatter: index out of bounds for dimension {dim} with size {size}")]


ONE_HOT = Pointwise(_one_hot, raw_args=(2,), checks=_one_hot_index_in_range)


def _bool_operand(node) -> bool:
    x = node.args[0] if node.args else None
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].dtype == torch.bool


def _out_of_range(node, values) -> bool:
    """Whether a number among `values` (a clamp's bounds, an alpha) is one eager's conversion to the result's
    dtype refuses or wraps (c10::overflows: past an int's range, or a negative one for an unsigned int; past a
    16-bit float's finite range on CPU: CUDA's kernel holds the bound in fp32)."""
    dtype, cpu = node.meta["val"].dtype, node.meta["val"].device.type == "cpu"
    bounds = [b for b in values if isinstance(b, (int, float)) and not isinstance(b, bool)]
    for b in bounds:
        if dtype.is_floating_point:
            if cpu and math.isfinite(b) and abs(b) > torch.finfo(dtype).max:
                return True
        elif dtype != torch.bool and isinstance(b, int):
            info = torch.iinfo(dtype)
            if b > info.max or b < info.min:
                return True
    return False


def accumulates(node) -> bool:
    """index_put with accumulate=True: repeated indices add up."""
    return node.target is aten.index_put.default and bool(
        node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False))


def _scatter(node) -> Scatter | Opaque:
    if node.target is not aten.index_put.default or accumulates(node):
        return Opaque("index_put with accumulate: left to eager (repeated indices add up)")
    given = [(d, t) for d, t in enumerate(node.args[1]) if t is not None]
    values = node.args[2]
    if len(given) != 1 or not _integer_indices(node) or not isinstance(values, torch.fx.Node):
        return Opaque("index_put by several index tensors or a mask: left to eager")
    return Scatter(given[0][0])


def _integer_indices(node) -> bool:
    indices = node.args[1] if len(node.args) > 1 else ()
    given = [t for t in indices if t is not None]
    # several with a 0-d one: torch's fake tensors give such an index another shape than eager's
    return bool(given) and all(isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)
                               and t.meta["val"].dtype in (torch.int64, torch.int32)
                               and (len(given) == 1 or t.meta["val"].dim() > 0) for t in given)


def op_name(node) -> str:
    t = node.target
    return "getitem" if t is operator.getitem else str(t)
