"""Source to runnable kernel: cached by source hash in memory and on disk.

The source is written to `$FUSER_CACHE_DIR/<sha>.py` and imported from there, so `triton.jit` sees a
real file (it reads the source for its own cache key) and Triton's compiled binaries are reused
across processes.

Triton's interpreter is a process-wide mode chosen when triton is imported (TRITON_INTERPRET=1):
in it, kernels run on CPU tensors; out of it, on GPU tensors.  `fuser` turns it on at import on a
machine without a GPU; `check_mode` names the fix when tensors and mode disagree.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import threading

import torch
from triton import knobs

_loaded: dict[str, object] = {}
_by_source: dict[str, object] = {}  # the hot path: no hashing per launch
_lock = threading.Lock()


def cache_dir() -> str:
    path = os.environ.get("FUSER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    os.makedirs(path, exist_ok=True)
    return path


def interpreting() -> bool:
    return bool(knobs.runtime.interpret)


def check_mode(device_type: str):
    if device_type == "cpu" and not interpreting():
        raise RuntimeError("fuser: kernels on CPU tensors run through Triton's interpreter; set "
                           "TRITON_INTERPRET=1 before triton is imported (or import fuser first)")
    if device_type != "cpu" and interpreting():
        raise RuntimeError("fuser: TRITON_INTERPRET=1 is set, so Triton cannot run kernels on "
                           f"{device_type} tensors in this process")


def load(source: str, name: str):
    """The jitted function `name` defined in `source`."""
    hit = _by_source.get(source)
    if hit is not None:
        return hit
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    with _lock:
        if sha in _loaded:
            return _loaded[sha]
        path = os.path.join(cache_dir(), f"k_{sha}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"fuser_kernels.k_{sha}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[sha] = _by_source[source] = getattr(module, name)
        return _loaded[sha]


_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


class Launcher:
    """Launches one kernel on its grid.  On CUDA, after Triton's JIT has compiled it, later launches
    call the compiled kernel directly, skipping the JIT's per-call argument binding (about 15 us of
    host time, which small kernels wait on).  The JIT specialises our kernels only on pointer
    alignment, so a call whose alignment differs goes back through the JIT."""

    def __init__(self, fn, grid: int, meta: dict):
        self.fn, self.grid, self.meta = fn, grid, meta
        self.constexprs = tuple(v for k, v in meta.items() if k != "num_warps")  # in parameter order
        self.compiled = None
        self.aligned = None

    def __call__(self, *args):
        compiled = self.compiled
        if compiled is not None and knobs.runtime.launch_enter_hook is None:
            if tuple([a.data_ptr() % 16 == 0 for a in args]) == self.aligned:
                stream = _raw_stream(args[-1].get_device())
                compiled.run(self.grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                             None, None, None, *args, *self.constexprs)
                return
        compiled = self.fn[(self.grid,)](*args, **self.meta)
        if self.compiled is None and args[-1].is_cuda and hasattr(compiled, "packed_metadata"):
            self.compiled, self.aligned = compiled, tuple(a.data_ptr() % 16 == 0 for a in args)
