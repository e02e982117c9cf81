"""The `torch.compile(model, backend="fuser")` backend: Dynamo graph -> AOT Autograd -> our pipeline."""
from __future__ import annotations

import threading

from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

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
    """A Dynamo backend that fuses each graph it is given: forward (or inference) and backward."""
    unknown = set(options or {}) - set(OPTIONS)
    if unknown:
        raise ValueError(f"fuser: unknown option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    opts = {**OPTIONS, **(options or {})}

    def compiler(backward: bool):
        def compile_(gm, example_inputs):
            new, report = compile_graph(gm, graph_index=len(_reports), attention=opts["attention"] and not backward)
            if backward:
                report.notes.append("backward graph (from AOT Autograd)")
            record(report)
            if sink is not None:
                sink(report, new)
            return make_boxed_func(new.forward)
        return compile_

    # min-cut: the forward saves what is cheapest by bytes and recomputes cheap pointwise work instead
    return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True), decompositions=decompositions(),
                        partition_fn=min_cut_rematerialization_partition)


def fuser_backend(gm, example_inputs, options: dict | None = None):
    """Entry point registered as `torch_dynamo_backends: fuser`."""
    return make_backend(options=options)(gm, example_inputs)
