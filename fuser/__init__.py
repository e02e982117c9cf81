"""fuser: graph-level kernel fusion for PyTorch, with a report of the HBM bytes each region saves."""
import importlib.util as _util
import os as _os
import sys as _sys


def _mount_source_subpackages():
    """In a source checkout, codegen/ and patterns/ sit beside fuser/; installed, they sit inside it."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for sub in ("codegen", "patterns"):
        inside = _os.path.join(__path__[0], sub)
        beside = _os.path.join(root, sub, "__init__.py")
        name = f"{__name__}.{sub}"
        if _os.path.isdir(inside) or name in _sys.modules or not _os.path.exists(beside):
            continue
        spec = _util.spec_from_file_location(name, beside, submodule_search_locations=[_os.path.dirname(beside)])
        module = _util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)
        globals()[sub] = module


_mount_source_subpackages()

from .api import FusedModule, fuse, last_report, reports  # noqa: E402
from .report import FusionReport  # noqa: E402

__all__ = ["fuse", "FusedModule", "FusionReport", "last_report", "reports"]
