"""The `torch.compile(model, backend="fuser")` backend: Dynamo graph -> AOT Autograd -> our pipeline."""
from __future__ import annotations

import threading

from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .capture import compile_graph, decompositions
from .report import FusionReport

_reports: list[FusionReport] = []
_lock = threading.Lock()

OPTIONS = {"attention": True}  # option -> default: recognise hand-written attention


def record(report: FusionReport) -> int:
    with _lock:
        _reports.append(report)
        return len(_reports) - 1


def all_reports() -> list[FusionReport]:
    return list(_reports)


def make_backend(sink=None, options: dict | None = None):
    """A Dynamo backend that fuses each forward (and inference) graph it is given."""
    unknown = set(options or {}) - set(OPTIONS)
    if unknown:
        raise ValueError(f"fuser: unknown option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    opts = {**OPTIONS, **(options or {})}

    def fw_compiler(gm, example_inputs):
        new, report = compile_graph(gm, graph_index=len(_reports), attention=opts["attention"])
        record(report)
        if sink is not None:
            sink(report, new)
        return make_boxed_func(new.forward)

    def bw_compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)  # backward fusion: issue 5

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, decompositions=decompositions())


def fuser_backend(gm, example_inputs, options: dict | None = None):
    """Entry point registered as `torch_dynamo_backends: fuser`."""
    return make_backend(options=options)(gm, example_inputs)
