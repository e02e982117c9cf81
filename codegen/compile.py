"""Source to runnable kernel: cached by source hash in memory and on disk.

The source is written to `$FUSER_CACHE_DIR/<sha>.py` and imported from there, so `triton.jit` sees a
real file (it reads the source for its own cache key) and Triton's compiled binaries are reused
across processes.

Kernels for CPU tensors run through Triton's interpreter, kernels for GPU tensors are compiled.
Triton reads its interpret knob when `@triton.jit` wraps a function (and when an interpreted kernel
calls a constexpr function), so we set it per kernel, for the device the kernel is made for, instead
of for the whole process at import: no environment variable and no import order is needed, and one
process can run both kinds.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import threading
import warnings

import numpy as np
import torch
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from fuser.dtypes import interpreted, interpreting  # noqa: F401 - the backend kernels are made for

_loaded: dict[tuple, object] = {}
_lock = threading.Lock()


def cache_dir() -> str:
    path = os.environ.get("FUSER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    os.makedirs(path, exist_ok=True)
    return path


def math_import(source: str) -> str:
    """The import a kernel module needs for the `libdevice.<fn>` calls in `source`: CUDA's libdevice
    when compiled; in the interpreter (which cannot call libdevice) the same names computed by torch
    on the CPU tensors' values (fuser/codegen/interp_math.py)."""
    if "libdevice." not in source:
        return ""
    if interpreting():
        return "from fuser.codegen import interp_math as libdevice\n"
    return "from triton.language.extra import libdevice\n"


_as_interpreted: dict = {}


def _call_interpreted(jit_fn, *args, **kwargs):
    """JITFunction.__call__ while a kernel is interpreted.  Triton's own @jit helpers (tl.max,
    tl.sum, tl.sigmoid...) were wrapped when triton was imported: compiled, unless TRITON_INTERPRET
    was set then.  Inside an interpreted kernel they run as the interpreter runs its own."""
    fn = _as_interpreted.get(id(jit_fn))  # by id: hashing a JITFunction walks its source
    if fn is None:
        fn = _as_interpreted[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
    return fn(*args, **kwargs)


@contextlib.contextmanager
def _interpret_knob(on: bool):
    """Triton's interpret knob set as the kernel's device needs, restored after.  Masked-off lanes of
    an interpreted kernel compute on whatever values they hold (log of 0, 0/0): numpy's warnings
    about those say nothing about the results and never reach the user."""
    old, old_call = knobs.runtime.interpret, JITFunction.__call__
    knobs.runtime.interpret = on
    try:
        if on:
            JITFunction.__call__ = _call_interpreted
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                yield
        else:
            yield
    finally:
        knobs.runtime.interpret, JITFunction.__call__ = old, old_call


def load(source: str, name: str, device_type: str):
    """The jitted function `name` defined in `source`, made for `device_type` (interpreted on CPU)."""
    interp = interpreted(device_type)
    hit = _loaded.get((source, interp))
    if hit is not None:
        return hit
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    with _lock:
        if (source, interp) in _loaded:
            return _loaded[(source, interp)]
        path = os.path.join(cache_dir(), f"k_{sha}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        mode = "interp" if interp else "jit"
        spec = importlib.util.spec_from_file_location(f"fuser_kernels.{mode}.k_{sha}", path)
        module = importlib.util.module_from_spec(spec)
        with _interpret_knob(interp):
            spec.loader.exec_module(module)
        fn = getattr(module, name)
        _loaded[(source, interp)] = fn
        return fn


def run_interpreted(fn, grid, *args, **kwargs):
    """Run an interpreted kernel on CPU tensors (the knob on while it runs, numpy quiet)."""
    with _interpret_knob(True):
        return fn[grid](*args, **kwargs)


_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


class Launcher:
    """Launches one kernel with one launch config.  On CUDA, after Triton's JIT has compiled it, later
    launches call the compiled kernel directly, skipping the JIT's per-call argument binding (about
    15 us of host time, which small kernels wait on).  The JIT specialises a kernel on its arguments'
    pointer alignment and on its int arguments (== 1, divisible by 16, 32 or 64 bits): a call that
    differs in those goes back through the JIT once, and its compiled kernel is kept beside the
    others.  On CPU the kernel runs through the interpreter."""

    def __init__(self, fn, meta: dict, device_type: str):
        self.fn, self.meta = fn, meta
        self.interpreted = interpreted(device_type)
        self.constexprs = tuple(v for k, v in meta.items() if k != "num_warps")  # in parameter order
        self.compiled: dict = {}

    def __call__(self, grid: int, *args):
        if self.interpreted:
            run_interpreted(self.fn, (grid,), *args, **self.meta)
            return
        key = tuple([_spec(a) for a in args])
        compiled = self.compiled.get(key)
        if compiled is not None and knobs.runtime.launch_enter_hook is None:
            stream = _raw_stream(torch.cuda.current_device())
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *self.constexprs)
            return
        compiled = self.fn[(grid,)](*args, **self.meta)
        if hasattr(compiled, "packed_metadata"):
            self.compiled[key] = compiled


def _spec(a):
    """What Triton's JIT specialises an argument on."""
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -2**31 <= a < 2**31)
    return a.data_ptr() % 16 == 0
