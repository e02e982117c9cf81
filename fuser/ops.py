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
from dataclasses import dataclass
from typing import Callable

import sympy
import torch

from . import indexing as ix

aten = torch.ops.aten
prims = torch.ops.prims

# ----------------------------------------------------------------------------- dtypes

TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels hold 16-bit floats in fp32 (accumulate in fp32, round once at the output)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def literal(v) -> str:
    """A Python scalar as Triton source."""
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else '-float("inf")'
        return repr(v)
    if isinstance(v, int):
        return str(v)
    raise TypeError(f"no Triton literal for {v!r}")


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
        from fuser.codegen.kernel import convert
        return convert(convert(expr, torch.float32, dtype), dtype, torch.float32)


def _is_float(a: Args) -> bool:
    return a.dtype.is_floating_point


def _alpha(a: Args, b: str) -> str:
    alpha = a.kw("alpha", 1)
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


def _pow_scalar(a: Args) -> str:
    x, e = a[0], a.node.args[1]
    known = {2: f"({x} * {x})", 3: f"({x} * {x} * {x})", 1: x, 0.5: f"tl.sqrt({x})",
             -0.5: f"tl.rsqrt({x})", -1: f"(1.0 / {x})", -2: f"(1.0 / ({x} * {x}))"}
    if e in known and (_is_float(a) or e in (1, 2, 3)):
        return known[e]
    if e == 0:
        return f"({x} * 0 + 1)"
    return f"_pow({x}, {literal(float(e))})"


def _clamp(a: Args) -> str:
    lo = a[1] if len(a) > 1 else a.kw("min")
    hi = a[2] if len(a) > 2 else a.kw("max")
    return _clamp_literal(a[0], lo, hi)


def _round(a: Args) -> str:
    if a.node.kwargs.get("decimals", 0):
        s = literal(10.0 ** a.kw("decimals"))
        return f"(_rint({a[0]} * {s}) / {s})"
    return f"_rint({a[0]})"


def _fill(a: Args) -> str:
    value = a.node.args[1] if a.node.target in (aten.full.default, aten.full_like.default) else a.node.args[0]
    return literal(value)


def _arange(a: Args) -> str:
    args = a.node.args
    start, end, step = (0, args[0], 1) if len(args) == 1 else ((*args, 1)[:3])
    return f"({literal(start)} + {ix.texpr(a.index[0])} * {literal(step)})"


def _gelu(a: Args) -> str:
    x = a[0]
    if a.kw("approximate", "none") == "tanh":
        return f"(0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _compare(sym: str) -> Pointwise:
    return Pointwise(lambda a: f"({a[0]} {sym} {a[1]})", promote_inputs=True)


def _bool(x: str) -> str:
    return f"({x} != 0)"


P = Pointwise
POINTWISE = {
    aten.add: P(_add), aten.sub: P(lambda a: f"({a[0]} - {_alpha(a, a[1])})"),
    aten.rsub: P(lambda a: f"({_alpha(a, a[1])} - {a[0]})"),
    aten.mul: P(_mul), aten.div: P(_div_mode, checks=_int_divisor_nonzero), aten.true_divide: P(lambda a: f"({a[0]} / {a[1]})"),
    aten.neg: P(lambda a: f"(-{a[0]})"), aten.abs: P(lambda a: f"tl.abs({a[0]})"),
    aten.reciprocal: P(lambda a: f"(1.0 / {a[0]})"),
    aten.sqrt: P(lambda a: f"tl.sqrt({a[0]})"), aten.rsqrt: P(lambda a: f"tl.rsqrt({a[0]})"),
    aten.exp: P(lambda a: f"tl.exp({a[0]})"), aten.exp2: P(lambda a: f"tl.exp2({a[0]})"),
    aten.expm1: P(lambda a: f"_expm1({a[0]})"),
    aten.log: P(lambda a: f"tl.log({a[0]})"), aten.log2: P(lambda a: f"tl.log2({a[0]})"),
    aten.log10: P(lambda a: f"(tl.log({a[0]}) * 0.4342944819032518)"),
    aten.log1p: P(lambda a: f"_log1p({a[0]})"),
    aten.sin: P(lambda a: f"tl.sin({a[0]})"), aten.cos: P(lambda a: f"tl.cos({a[0]})"),
    aten.tan: P(lambda a: f"(tl.sin({a[0]}) / tl.cos({a[0]}))"),
    aten.tanh: P(lambda a: f"_tanh({a[0]})"), aten.sigmoid: P(lambda a: f"tl.sigmoid({a[0]})"),
    aten.silu: P(lambda a: f"({a[0]} * tl.sigmoid({a[0]}))"),
    aten.relu: P(lambda a: f"tl.where({a[0]} < 0, 0, {a[0]})"),
    aten.leaky_relu: P(lambda a: f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {literal((a.node.args + (0.01,))[1])})"),
    aten.hardtanh: P(lambda a: _clamp_literal(a[0], *(a.node.args + (-1.0, 1.0))[1:3])),
    aten.hardsigmoid: P(lambda a: _clamp_literal(f"({a[0]} / 6.0 + 0.5)", 0.0, 1.0)),
    aten.hardswish: P(lambda a: f"({a[0]} * {_clamp_literal(f'({a[0]} / 6.0 + 0.5)', 0.0, 1.0)})"),
    aten.gelu: P(_gelu), aten.erf: P(lambda a: f"tl.erf({a[0]})"),
    aten.erfc: P(lambda a: f"(1.0 - tl.erf({a[0]}))"),
    aten.pow: P(lambda a: _pow_scalar(a) if a.node.target == aten.pow.Tensor_Scalar
                else f"_pow({a[0]}, {a[1]})"),
    aten.maximum: P(lambda a: f"_maximum({a[0]}, {a[1]})"), aten.minimum: P(lambda a: f"_minimum({a[0]}, {a[1]})"),
    aten.clamp: P(_clamp), aten.clamp_min: P(lambda a: _clamp_literal(a[0], a[1], None)),
    aten.clamp_max: P(lambda a: _clamp_literal(a[0], None, a[1])),
    aten.where: P(lambda a: f"tl.where({a[0]}, {a[1]}, {a[2]})", bool_args=(0,)),
    aten.masked_fill: P(lambda a: f"tl.where({a[1]}, {a[2]}, {a[0]})", bool_args=(1,)),
    aten.sign: P(lambda a: f"tl.where({a[0]} > 0, 1, tl.where({a[0]} < 0, -1, {a[0]} * 0))"),
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
    aten.logical_and: P(lambda a: f"({_bool(a[0])} & {_bool(a[1])})", promote_inputs=True),
    aten.logical_or: P(lambda a: f"({_bool(a[0])} | {_bool(a[1])})", promote_inputs=True),
    aten.logical_xor: P(lambda a: f"({_bool(a[0])} ^ {_bool(a[1])})", promote_inputs=True),
    aten.bitwise_and: P(lambda a: f"({a[0]} & {a[1]})"), aten.bitwise_or: P(lambda a: f"({a[0]} | {a[1]})"),
    aten.bitwise_xor: P(lambda a: f"({a[0]} ^ {a[1]})"),
    aten.bitwise_not: P(lambda a: f"({a[0]} == 0)" if a.dtype == torch.bool else f"(~{a[0]})"),
    aten._to_copy: P(lambda a: a[0], cast=True), prims.convert_element_type: P(lambda a: a[0], cast=True),
    aten.full: P(_fill), aten.full_like: P(_fill), aten.scalar_tensor: P(_fill),
    aten.arange: P(_arange),
}


def _clamp_literal(x: str, lo, hi) -> str:
    """x clamped to [lo, hi] (Triton source or Python numbers; None: no bound).  NaN stays NaN."""
    if lo is not None:
        lo = lo if isinstance(lo, str) else literal(lo)
        x = f"tl.where({x} < {lo}, {lo}, {x})"
    if hi is not None:
        hi = hi if isinstance(hi, str) else literal(hi)
        x = f"tl.where({x} > {hi}, {hi}, {x})"
    return x


# Helpers the generated kernels may call; emitted into a kernel's module only where it uses them.
HELPERS = {
    "_tanh": """
@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
""",
    "_log1p": """
@triton.jit
def _log1p(x):
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
""",
    "_expm1": """
@triton.jit
def _expm1(x):
    u = tl.exp(x)
    return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * (x / tl.log(u))))
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
    return tl.where(tie & odd, r - 1.0, r)
""",
    "_pow": """
@triton.jit
def _pow(a, b):
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    is_int = b == tl.floor(b)
    odd = is_int & ((b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    r = tl.where(a < 0, tl.where(is_int, tl.where(odd, -r, r), float("nan")), r)
    return tl.where(b == 0, 1.0, r)
""",
    "_maximum": """
@triton.jit
def _maximum(a, b):
    return tl.where((a > b) | (a != a), a, b)
""",
    "_minimum": """
@triton.jit
def _minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)
""",
    "_remainder": """
@triton.jit
def _remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
""",
    "_fmod": """
@triton.jit
def _fmod(a, b):
    return a % b
""",
    "_rne_bf16": """
@triton.jit
def _rne_bf16(x):
    # fp32 -> bf16, rounding to nearest even by hand (Triton's interpreter truncates)
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)
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
    return tl.where(b == 0, a / b, tl.where(div == 0, div * 0.0, fl))
""",
    "_floordiv_int": """
@triton.jit
def _floordiv_int(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)
""",
}


# ----------------------------------------------------------------------------- layout


def _shape(n) -> tuple:
    return tuple(n.meta["val"].shape)


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
    start = 0 if start is None else (start + size if start < 0 else start)
    start = min(max(start, 0), size)
    out = list(idx)
    out[dim] = start + idx[dim] * (step or 1)
    return [(src, tuple(out), None)], None


def _select(node, idx, ranges):
    src = node.args[0]
    dim, i = node.args[1], node.args[2]
    dim %= len(_shape(src))
    i = i + _shape(src)[dim] if i < 0 else i
    out = list(idx)
    out.insert(dim, sympy.Integer(i))
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
        lo = pad[2 * k]
        out[d] = idx[d] - lo
        conds.append((lo, lo + shape[d], d))
    return [(src, tuple(out), tuple(conds))], value


L = Layout
LAYOUT = {
    aten.view: L(_view), aten._unsafe_view: L(_view), aten.reshape: L(_view), aten.alias: L(_identity),
    aten.unsqueeze: L(_view), aten.squeeze: L(_view), aten.permute: L(_permute),
    aten.t: L(lambda n, i, r: _permute_dims(n, i, (1, 0))),
    aten.expand: L(_expand), aten.slice: L(_slice), aten.select: L(_select),
    aten.clone: L(_identity, copies=True), aten.lift_fresh_copy: L(_identity, copies=True),
    aten.cat: L(_cat, copies=True), aten.flip: L(_flip, copies=True),
    aten.constant_pad_nd: L(_pad, copies=True),
    aten.gather: L(None, copies=True, indirect=True),
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

OPAQUE = {
    aten.mm: "matmul: compute-bound, left to cuBLAS",
    aten.bmm: "matmul: compute-bound, left to cuBLAS",
    aten.addmm: "matmul: compute-bound, left to cuBLAS",
    aten.baddbmm: "matmul: compute-bound, left to cuBLAS",
    aten.convolution: "convolution: compute-bound, left to cuDNN",
    aten.embedding: "embedding: a gather by token id, left to eager",
    aten._scaled_dot_product_flash_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_efficient_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_cudnn_attention: "attention already fused by SDPA",
    aten._scaled_dot_product_flash_attention_for_cpu: "attention already fused by SDPA",
    aten.native_dropout: "random: dropout in training is left to eager",
    aten.bernoulli: "random numbers are left to eager",
    aten.rand: "random numbers are left to eager", aten.randn: "random numbers are left to eager",
    aten.index: "indexing by a tensor is a gather, left to eager",
}

# SDPA kernels stay whole (they already never write the scores); the core decompositions would
# otherwise turn the CPU one into matmul + softmax.
KEEP_WHOLE = [aten._scaled_dot_product_flash_attention_for_cpu, aten.native_dropout]


def classify(node) -> Pointwise | Layout | Reduction | Opaque:
    """The op-table entry of an fx node, or the reason it stays eager."""
    target = node.target
    if node.op != "call_function":
        return Opaque("not an op")
    packet = getattr(target, "overloadpacket", None)
    if packet in OPAQUE:
        return Opaque(OPAQUE[packet])
    for table in (POINTWISE, LAYOUT, REDUCTION):
        if packet in table:
            return table[packet]
    return Opaque(f"no Triton lowering for {target}")


def op_name(node) -> str:
    t = node.target
    return "getitem" if t is operator.getitem else str(t)
