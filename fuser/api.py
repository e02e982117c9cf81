"""`fuser.fuse(model)`: a module with the model's outputs, whose memory-bound work runs fused."""
from __future__ import annotations

import logging
import types

import torch

from . import backend
from .report import FusionReport

log = logging.getLogger("fuser")


class _Function(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _DynamoGaveUp(logging.Filter):
    """Keeps the warning Dynamo logs when it gives up on a function (its recompile limit): from
    then on it runs that function eagerly for inputs it has no graph for, and says nothing more."""

    last: str | None = None

    def filter(self, record):
        if str(record.msg).startswith("torch._dynamo hit config."):
            _DynamoGaveUp.last = record.getMessage().splitlines()[0]
        return True


logging.getLogger("torch._dynamo.convert_frame").addFilter(_DynamoGaveUp())


class FusedModule(torch.nn.Module):
    """Runs `model` through Dynamo with the fuser backend; recaptures for new shapes or dtypes."""

    def __init__(self, model: torch.nn.Module, options: dict | None = None):
        super().__init__()
        self.model = model
        self._graph_reports: list[FusionReport] = []
        self._latest: list[FusionReport] = []  # the graphs that ran since the latest call began
        self._warned: set[str] = set()
        self._gave_up: str | None = None  # Dynamo's reason, once it gives up on the model's frame
        self.graph_modules: list[torch.fx.GraphModule] = []  # the rewritten graphs, in capture order
        self._seen_devices: frozenset | None = None
        target = model.fn if isinstance(model, _Function) else model  # a function compiles without module layers
        backend.validate(options)  # bad options fail here, not at the first call
        compiled = torch.compile(_own_entry(target), dynamic=False,
                                 backend=backend.make_backend(self._captured, options, self._latest.append))
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: no second copy of the weights

    def forward(self, *args, **kwargs):
        devices = _devices(args, kwargs)
        if devices != self._seen_devices:  # weights are checked when the inputs' devices change
            _check_devices(self.model, devices)
            self._seen_devices = devices
        self._latest.clear()  # in place: the backend's runners append to this list
        _DynamoGaveUp.last = None
        try:
            out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchRuntimeError as e:
            # Dynamo met an error running the program on fake tensors: run it for real, so that a
            # wrong program raises eager's own error (IndexError, ...); if eager runs, Dynamo failed.
            out = self.model(*args, **kwargs)
            self._ran_eagerly(f"Dynamo could not trace the model: {str(e).splitlines()[0]}")
            return out
        if not self._latest:
            if _DynamoGaveUp.last:
                self._gave_up = _DynamoGaveUp.last
            self._ran_eagerly(self._gave_up or "Dynamo ran this call without a graph (nothing fused ran)")
        return out

    def _ran_eagerly(self, reason: str):
        """No fused graph ran in this call: say so, in the report and (once per reason) in the log."""
        self._latest.append(FusionReport(fallbacks=[f"this call ran eagerly: {reason}"]))
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("fuser: a call of %s ran eagerly: %s", type(self.model).__name__, reason)

    def _captured(self, report: FusionReport, gm: torch.fx.GraphModule):
        self._graph_reports.append(report)
        self.graph_modules.append(gm)

    @property
    def report(self) -> FusionReport:
        """The report of the graphs that ran in the latest call (and in the backward after it)."""
        return FusionReport.merge(self._latest)

    @property
    def reports(self) -> list[FusionReport]:
        """Reports of every graph captured so far (one per graph, graph breaks and recaptures included)."""
        return list(self._graph_reports)

    @property
    def code(self) -> str:
        """The rewritten graphs as Python: each fused region is one `self.fused_<i>(...)` call."""
        return "\n".join(self.report.code)


def _own_entry(target):
    """`target` called through a function whose code object is this FusedModule's own.  Dynamo keeps
    its compiled graphs, and counts them against its recompile limit, per code object: compiling the
    model's forward itself, every fuse() of one class (a notebook re-run, a sweep) would add to one
    count with a backend of its own, and the ninth would silently run eagerly."""
    def entry(*args, **kwargs):
        return target(*args, **kwargs)
    code = entry.__code__.replace()  # a new code object, equal to the shared one
    return types.FunctionType(code, entry.__globals__, "fused_entry", None, entry.__closure__)


def _devices(args, kwargs) -> frozenset:
    """Devices of the tensor arguments (and of tensors one container deep), 0-d scalars aside."""
    found = set()
    for a in (*args, *kwargs.values()):
        for t in (a.values() if isinstance(a, dict) else a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                found.add(t.device)
    return frozenset(found)


def _check_devices(model, devices):
    devices = set(devices) | {p.device for p in model.parameters()} | {b.device for b in model.buffers() if b.dim() > 0}
    if len(devices) > 1:
        raise ValueError(f"fuser: inputs and weights are on mixed devices {sorted(map(str, devices))}; "
                         "move them to one device")


def fuse(model, example_inputs: tuple | None = None, **options) -> FusedModule:
    """Fuse `model` (an nn.Module or a callable).  With example_inputs it captures now."""
    if isinstance(model, FusedModule):
        return model
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise TypeError(f"fuser.fuse expects an nn.Module or a callable, got {type(model).__name__}")
        model = _Function(model)
    fused = FusedModule(model, options or None)
    if example_inputs is not None:
        with torch.no_grad():
            fused(*example_inputs)
    return fused


def last_report() -> FusionReport | None:
    """The report of the most recently compiled graph, through fuse() or torch.compile."""
    all_ = backend.all_reports()
    return all_[-1] if all_ else None


def reports() -> list[FusionReport]:
    return backend.all_reports()
