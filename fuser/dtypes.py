"""Dtypes in kernels: the Triton name of each torch dtype, the dtype values are held in, conversions
and literals as Triton source.

The source of a conversion depends on the backend it is for (Triton's interpreter truncates fp32 to
bf16, compiled Triton rounds), so the backend is part of the context the source is generated in:
`target(device_type)`, read by `interpreting()`; so is where math functions come from (`math_import`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch

from . import indexing as ix

_target_interpreted = contextvars.ContextVar("fuser_interpreted", default=False)


def interpreted(device_type: str) -> bool:
    return device_type == "cpu"


def interpreting() -> bool:
    """Whether the source being generated now is for the interpreter (see `target`)."""
    return _target_interpreted.get()


@contextlib.contextmanager
def target(device_type: str):
    """Generate (and load, and run) kernels for this device: the interpreter on CPU, else compiled."""
    token = _target_interpreted.set(interpreted(device_type))
    try:
        yield
    finally:
        _target_interpreted.reset(token)


TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels hold 16-bit floats in fp32 (accumulate in fp32, round once at the output)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def literal(v) -> str:
    """A Python scalar as Triton source; a symbolic int (a size node) as the size expression, whose
    symbols the kernel takes as arguments."""
    if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), (torch.SymInt, torch.SymFloat)):
        return f"({ix.texpr(ix.expr(v.meta['val']))})"  # a float in fp64 (indexing's printer), as Python computes it
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else '-float("inf")'
        if v == 0.0 and math.copysign(1.0, v) < 0:  # Triton's compiler makes a -0.0 constant +0.0 (3.6, run 196):
            return "tl.full([], -2147483648, tl.int32).to(tl.float32, bitcast=True)"  # so its bits, as a float
        return repr(v)
    if isinstance(v, int):
        return str(v)
    raise TypeError(f"no Triton literal for {v!r}")


def wrapped(v, dtype: torch.dtype):
    """An int scalar cast to integer `dtype` as C's casts do (modulo 2**bits: 1000 -> -24 in int8); any
    other value, or a float or bool dtype, as it is."""
    if not isinstance(v, int) or isinstance(v, bool) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return v
    info = torch.iinfo(dtype)
    return (v - info.min) % (info.max - info.min + 1) + info.min


def held_in(v: float, dtype: torch.dtype) -> float:
    """A Python float as a 16-bit float `dtype` holds it (rounded: eager converts it so for a comparison's common
    dtype and a pad's fill); any other dtype, as it is."""
    return float(torch.tensor(v, dtype=dtype)) if dtype in (torch.float16, torch.bfloat16) else v


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    if src == dst:
        return expr
    if dst == torch.bool:
        return f"({expr} != 0)"
    if dst in (torch.float16, torch.bfloat16):
        if src == torch.float64:  # eager rounds a double to float first (c10's Half/BFloat16 take a float)
            expr, src = f"{expr}.to(tl.float32)", torch.float32
        if not src.is_floating_point:  # ints reach 16-bit floats through fp32 (the interpreter would bit-cast)
            expr, src = f"{expr}.to(tl.float32)", torch.float32
        if dst == torch.bfloat16 and src == torch.float32 and interpreting():
            return f"_rne_bf16({expr})"  # the interpreter truncates fp32 -> bf16 whatever it is asked
        if src.itemsize > dst.itemsize:
            return f'{expr}.to({TL_DTYPE[dst]}, fp_downcast_rounding="rtne")'
    if src == torch.bfloat16 and interpreting():  # the interpreter's bf16 -> fp32 flushes subnormals: by bits
        expr = f"((({expr}).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)"
        return expr if dst == torch.float32 else convert(expr, torch.float32, dst)
    return f"{expr}.to({TL_DTYPE[dst]})"


def math_import(source: str) -> str:
    """The import a kernel module needs for the `libdevice.<fn>` calls in `source`: CUDA's libdevice
    when compiled; in the interpreter (which cannot call libdevice) the same names computed by torch
    on the CPU tensors' values (fuser/codegen/interp_math.py)."""
    if "libdevice." not in source:
        return ""
    if interpreting():
        return "from fuser.codegen import interp_math as libdevice\n"
    return "from triton.language.extra import libdevice\n"
