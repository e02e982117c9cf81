"""The `torch.compile(model, backend="fuser")` backend: Dynamo graph -> AOT Autograd -> our pipeline.

A failure inside the pipeline never reaches the user as a crash: the graph runs as it was given
(eager ATen), the reason goes to the `fuser` logger at WARNING and into the graph's report.
"""
from __future__ import annotations

import logging
import threading
import traceback

from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .pipeline import compile_graph
from .decompositions import decompositions
from .runtime import EagerCheckError, NotForTheseSizes
from .report import FusionReport

log = logging.getLogger("fuser")
_reports: list[FusionReport] = []
_lock = threading.Lock()

# option -> (default, allowed values, what it does)
OPTIONS = {"attention": (True, (True, False), "recognise hand-written attention and run it as one kernel")}


def record(report: FusionReport) -> int:
    with _lock:
        _reports.append(report)
        return len(_reports) - 1


def all_reports() -> list[FusionReport]:
    return list(_reports)


def validate(options: dict | None) -> dict:
    """Options with defaults filled in; an unknown name or a value outside the allowed ones is an error."""
    options = dict(options or {})
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"fuser: unknown option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    for name, value in options.items():
        allowed = OPTIONS[name][1]
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise ValueError(f"fuser: option {name}={value!r} is not allowed; allowed values: "
                             f"{', '.join(map(repr, allowed))} ({OPTIONS[name][2]})")
    return {name: options.get(name, default) for name, (default, _, _) in OPTIONS.items()}


def _fall_back(report: FusionReport, stage: str, e: BaseException):
    reason = f"{stage}: {type(e).__name__}: {e}".strip()
    report.fallback = reason
    log.warning("fuser: graph %d runs as given (eager ATen): %s\n%s", report.graph, reason,
                "".join(traceback.format_exception(e)[-6:]))


class GraphRunner:
    """Calls the rewritten graph.  If it fails for a reason of ours (a kernel that does not compile,
    a bug in generated code), the graph as given is run on the same inputs: if that raises too, the
    error is the user's and propagates; else fuser's failure is recorded and every later call runs
    the given graph."""

    def __init__(self, fused, given, report: FusionReport, ran=None):
        self.fused, self.given, self.report, self.ran = fused, given, report, ran

    def __call__(self, *args):
        if self.ran is not None:  # fuse() reports the graphs that ran in its latest call
            self.ran(self.report)
        if self.fused is self.given:
            return self.given(*args)
        try:
            return self.fused(*args)
        except EagerCheckError:
            raise  # eager raises here too (index out of range, integer division by zero)
        except NotForTheseSizes as e:  # this call's sizes only (a reduction over 0 elements)
            log.debug("fuser: graph %d runs as given for one call: %s", self.report.graph, e)
            return self.given(*args)
        except Exception as e:
            out = self.given(*args)
            _fall_back(self.report, "at run time", e)
            self.fused = self.given
            return out


def make_backend(sink=None, options: dict | None = None, ran=None):
    """A Dynamo backend that fuses each graph it is given: forward (or inference) and backward.
    `sink(report, gm)` hears of each graph compiled, `ran(report)` of each graph run."""
    opts = validate(options)

    def compiler(backward: bool):
        def compile_(gm, example_inputs):
            index = len(_reports)
            try:
                new, report = compile_graph(gm, graph_index=index, attention=opts["attention"] and not backward)
                report.graph = index
            except Exception as e:
                new, report = gm, FusionReport(graph=index)
                _fall_back(report, "while compiling", e)
            if backward:
                report.notes.append("backward graph (from AOT Autograd)")
            record(report)
            if sink is not None:
                sink(report, new)
            return make_boxed_func(GraphRunner(new.forward, gm.forward, report, ran))
        return compile_

    # min-cut: the forward saves what is cheapest by bytes and recomputes cheap pointwise work instead
    aot = aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True), decompositions=decompositions(),
                       partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        try:
            return aot(gm, example_inputs)
        except (RestartAnalysis, SkipFrame):
            raise  # Dynamo's own control flow (e.g. a 0-d float input made a SymFloat): not a failure
        except Exception as e:  # AOT Autograd or a decomposition failed on this graph: Dynamo's graph runs as is
            report = FusionReport(graph=len(_reports))
            _fall_back(report, "while capturing (AOT Autograd)", e)
            record(report)
            if sink is not None:
                sink(report, gm)
            return GraphRunner(gm.forward, gm.forward, report, ran)
    return backend


def fuser_backend(gm, example_inputs, options: dict | None = None):
    """Entry point registered as `torch_dynamo_backends: fuser`."""
    return make_backend(options=options)(gm, example_inputs)
