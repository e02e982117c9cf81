"""CUDA libdevice's functions for kernels run by Triton's interpreter, which cannot call libdevice.

A kernel that calls `libdevice.<name>(...)` imports this module under that name when it is
interpreted (fuser/dtypes.py `math_import`). Each function takes the interpreter's tensors (numpy
arrays inside) or Python scalars, computes in float64 with torch, and returns a tensor of the first
tensor operand's Triton type, as libdevice would (nextafter, which steps one ulp, in that type's own
precision).
"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _wrap(fn, native=False):
    def call(*args):
        tensors = [a for a in args if isinstance(a, tl.tensor)]
        np_dtype = tensors[0].handle.data.dtype
        arrays = np.broadcast_arrays(*(a.handle.data if isinstance(a, tl.tensor) else np.asarray(a) for a in args))
        out = fn(*(torch.from_numpy(np.array(a, dtype=np_dtype if native else np.float64)) for a in arrays))
        data = out.numpy().astype(np_dtype)
        ty = max(tensors, key=lambda a: len(a.shape)).type
        return tl.tensor(TensorHandle(data, tensors[0].dtype), ty)
    return call


_TORCH = {
    "asin": torch.asin, "acos": torch.acos, "atan": torch.atan, "atan2": torch.atan2,
    "tanh": torch.tanh, "sinh": torch.sinh, "cosh": torch.cosh, "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh,
    "erfinv": torch.erfinv, "lgamma": torch.lgamma, "erfcx": torch.special.erfcx,
    "normcdfinv": torch.special.ndtri, "cyl_bessel_i0": torch.special.i0, "cyl_bessel_i1": torch.special.i1,
    "j0": torch.special.bessel_j0, "j1": torch.special.bessel_j1,
    "y0": torch.special.bessel_y0, "y1": torch.special.bessel_y1,
    "nextafter": torch.nextafter, "hypot": torch.hypot, "copysign": torch.copysign,
}
globals().update({name: _wrap(fn, native=name == "nextafter") for name, fn in _TORCH.items()})
