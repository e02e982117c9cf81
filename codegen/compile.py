"""Source to runnable kernel: cached by source hash in memory and on disk.

The source is written to `$FUSER_CACHE_DIR/<sha>.py` and imported from there, so `triton.jit` sees a
real file (it reads the source for its own cache key) and Triton's compiled binaries are reused
across processes.  On CPU tensors the same function runs through Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import threading

_loaded: dict[tuple[str, bool], object] = {}
_lock = threading.Lock()


def cache_dir() -> str:
    path = os.environ.get("FUSER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    os.makedirs(path, exist_ok=True)
    return path


def load(source: str, name: str, interpret: bool):
    """The jitted function `name` defined in `source` (interpreted where the tensors are on CPU)."""
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    key = (sha, interpret)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        path = os.path.join(cache_dir(), f"k_{sha}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"fuser_kernels.k_{sha}_{int(interpret)}", path)
        module = importlib.util.module_from_spec(spec)
        with _interpreting(interpret):  # helpers the kernel calls must be interpreted too
            spec.loader.exec_module(module)
        fn = getattr(module, name)
        _loaded[key] = fn
        return fn


@contextlib.contextmanager
def _interpreting(on: bool):
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
