"""`fuser.fuse(model)`: a module with the model's outputs, whose memory-bound work runs fused."""
from __future__ import annotations

import copy
import inspect
import itertools
import logging
import threading
import types
import weakref

import torch
from torch._dynamo.utils import counters

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
            lines = [line.strip() for line in record.getMessage().splitlines()]
            function = next((line for line in lines[1:] if line.startswith("function:")), None)
            _DynamoGaveUp.last = f"{lines[0]} ({function})" if function else lines[0]
        return True


logging.getLogger("torch._dynamo.convert_frame").addFilter(_DynamoGaveUp())


def _break_total() -> int:
    return sum(counters["graph_break"].values())


class _GraphBreaks:
    """The graph breaks Dynamo met during one call.  Dynamo counts them by reason (one Counter for
    the process) while it compiles a frame; a call that reuses compiled code counts nothing.  Per
    call this compares two totals; the counter is copied only when it changed."""

    def __init__(self):
        self.total: int | None = None
        self.seen: dict[str, int] = {}

    def start(self):
        total = _break_total()
        if total != self.total:  # changed since our latest call (another model compiled, a reset)
            self.seen, self.total = dict(counters["graph_break"]), total

    def new(self) -> list[str]:
        if _break_total() == self.total:
            return []
        now = counters["graph_break"]
        found = [_break_reason(r) for r, n in now.items() if n > self.seen.get(r, 0)]
        self.seen, self.total = dict(now), sum(now.values())
        return list(dict.fromkeys(found))


def _break_reason(text: str) -> str:
    """Dynamo's reason, shortened to its first line and its explanation (no hints, no links)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return "(no reason given)"
    explanation = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {explanation}" if explanation else lines[0]


class _Entry:
    """A compiled entry point, what runs if Dynamo fails on it, and Dynamo's reason once it gave up on it."""

    def __init__(self, compiled, eager):
        self.compiled, self.eager = compiled, eager
        self.gave_up: str | None = None


class FusedModule(torch.nn.Module):
    """Runs `model` through Dynamo with the fuser backend; recaptures for new shapes or dtypes.

    Attributes of the model that FusedModule does not have itself are the model's: `fused.config`,
    `fused.device`, `fused.dtype`, `fused.generation_config`, its methods.  `fused.generate(...)`
    runs the model's own `generate` with each forward step fused."""

    def __init__(self, model: torch.nn.Module, options: dict | None = None, dynamic: bool | None = None):
        super().__init__()
        _check_dynamic(dynamic)
        self.model = model
        self.dynamic = dynamic
        self._graph_reports: list[FusionReport] = []
        self._known: set[int] = set()  # indices of the graphs in _graph_reports
        self._latest: list[FusionReport] = []  # the graphs that ran since the latest call began
        # whether a fused graph ran in the current step: a plain object's attribute, set on every call
        # (nn.Module.__setattr__ costs microseconds)
        self._step = types.SimpleNamespace(ran_graph=False)
        self._warned: set = set()  # reasons already said at WARNING
        self._parts_given_up: list[str] = []  # Dynamo's reasons for functions inside the model it gave up on
        self._breaks = _GraphBreaks()
        self._generating = False
        self.graph_modules: list[torch.fx.GraphModule] = []  # the rewritten graphs, in capture order
        self._seen_devices: frozenset | None = None
        target = model.fn if isinstance(model, _Function) else model  # a function compiles without module layers
        self._options = dict(options or {})
        self._backend = _shared_backend(self._options)  # bad options fail here, not at the first call
        # not submodules: no second copy of the weights
        object.__setattr__(self, "_entry", _Entry(self._compile(target), model))
        object.__setattr__(self, "_generate_entry", None)  # made at the first generate()

    def __deepcopy__(self, memo):
        """A copy fuses a deep copy of the model afresh.  Copied attribute by attribute, it would keep this
        module's compiled entry and backend (closures over this model: the copy would run the original's
        weights) and its kernels' fake tensors (which cannot be copied)."""
        return FusedModule(copy.deepcopy(self.model, memo), self._options, self.dynamic)

    def __reduce__(self):
        """Pickled (torch.save) as the model and the options; loaded, it fuses again at its first call."""
        return FusedModule, (self.model, self._options, self.dynamic)

    def _compile(self, target):
        return torch.compile(_own_entry(target), dynamic=self.dynamic, backend=self._backend)

    def __getattr__(self, name: str):
        """Parameters, buffers and submodules first (nn.Module's own lookup), then the model's
        attributes.  Dunder names are not forwarded (copy, pickle look them up on the instance), nor
        is anything while `model` is not set yet (unpickling, deepcopy): no recursion."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
        model = self.__dict__.get("_modules", {}).get("model")
        if model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}, nor has the "
                                 f"model it wraps ({type(model).__name__})") from None

    def forward(self, *args, **kwargs):
        self._check_devices(args, kwargs)
        self._latest.clear()  # in place: the backend's runners append to this list
        return self._call(self._entry, args, kwargs)

    def _check_devices(self, args, kwargs):
        devices = _devices(args, kwargs)
        if devices != self._seen_devices:  # weights are checked when the inputs' devices change
            _check_devices(self.model, devices)
            self._seen_devices = devices

    def _call(self, entry: _Entry, args, kwargs):
        """One call of a compiled entry: what ran goes into `_latest`; a call that ran no fused graph,
        and each graph break Dynamo met, is said in the report and (once per reason) at WARNING."""
        _DynamoGaveUp.last = None
        self._step.ran_graph = False
        captured = len(self._graph_reports)
        self._breaks.start()
        running = _running()
        running.append(self)
        try:
            out = entry.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchRuntimeError as e:
            # Dynamo met an error running the program on fake tensors: run it for real, so that a
            # wrong program raises eager's own error (IndexError, ...); if eager runs, Dynamo failed.
            out = entry.eager(*args, **kwargs)
            self._ran_eagerly(f"Dynamo could not trace the model: {str(e).splitlines()[0]}")
            return out
        finally:
            running.pop()
        breaks = self._breaks.new()
        if breaks:
            self._graph_broke(breaks, self._graph_reports[captured:])
        if not self._step.ran_graph:
            if _DynamoGaveUp.last:
                entry.gave_up = _DynamoGaveUp.last
            self._ran_eagerly(entry.gave_up or "Dynamo ran this call without a graph (nothing fused ran)")
        elif _DynamoGaveUp.last or self._parts_given_up:
            self._part_ran_eagerly(_DynamoGaveUp.last)
        return out

    def _part_ran_eagerly(self, reason: str | None):
        """Dynamo gave up on a function inside the model, a frame of its own past a graph break (a decorator
        every layer class shares: a frame per class, past the recompile limit), while other graphs ran: from
        then on that function runs eagerly wherever it has no graph, and Dynamo says nothing more.  Said in
        the report of every later call and, once, at WARNING."""
        if reason and reason not in self._parts_given_up:
            self._parts_given_up.append(reason)
            log.warning("fuser: part of %s runs eagerly from now on: %s", self._name, reason)
        lines = [f"part of this model runs eagerly (Dynamo gave up on a function inside it): {r}"
                 for r in self._parts_given_up]
        if not any(line in r.fallbacks for r in self._latest for line in lines):
            self._latest.append(FusionReport(fallbacks=lines))

    def _ran(self, report: FusionReport):
        """The backend's runners call this (through _route_ran) as each graph runs: the report lists each
        graph once.  A graph another module compiled (their shared backend) joins this one's graphs."""
        self._step.ran_graph = True
        if not any(r is report for r in self._latest):
            self._latest.append(report)
            if report.graph not in self._known:
                gm = _graph_modules.get(report.graph)
                if gm is not None:
                    self._captured(report, gm)
                else:
                    self._known.add(report.graph)

    def _ran_eagerly(self, reason: str):
        """No fused graph ran in this call: say so, in the report and (once per reason) in the log."""
        line = f"this call ran eagerly: {reason}"
        if not any(line in r.fallbacks for r in self._latest):  # generate(): once, not once per token
            self._latest.append(FusionReport(fallbacks=[line]))
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("fuser: a call of %s ran eagerly: %s", self._name, reason)

    def _graph_broke(self, reasons: list[str], captured: list[FusionReport]):
        """Dynamo split the model at a graph break: the pieces either side are separate graphs (each
        fused), the code at the break runs eagerly.  The note goes into the reports of the graphs
        captured in this call, so that every later call that runs them says it too."""
        notes = [f"graph break: {r} (that piece runs eagerly)" for r in reasons]
        for report in captured:
            report.notes += [n for n in notes if n not in report.notes]
        if not any(any(r is c for c in captured) for r in self._latest):
            self._latest.append(FusionReport(notes=notes))
        for reason in reasons:
            if ("graph break", reason) not in self._warned:
                self._warned.add(("graph break", reason))
                log.warning("fuser: graph break in %s: %s; the code at the break runs eagerly, the pieces "
                            "either side are fused as separate graphs", self._name, reason)

    def generate(self, *args, **kwargs):
        """The wrapped model's own `generate` (Hugging Face), with every forward it makes run through
        fuser: prefill and each decode step call the model, and that call runs a compiled entry of
        the model's original forward, with this module's backend and `dynamic` setting.

        `fused.report` afterwards holds the graphs that ran during this generate call (each once),
        `fused.reports` every graph captured so far.  With `dynamic=None`, the first decode steps
        compile at fixed sizes, and the growing KV cache makes its length symbolic at the next one.
        HF's own auto-compile (static caches) is turned off here (`disable_compile=True`, unless you
        pass it): fuser is the compiler."""
        model = self.model
        if getattr(model, "generate", None) is None:
            raise AttributeError(f"fuser: {type(model).__name__} has no generate(); fused.generate runs the "
                                 "wrapped model's own (a Hugging Face model's GenerationMixin.generate)")
        if self._generating:
            raise RuntimeError("fuser: fused.generate() was called again from inside itself")
        if getattr(model.forward, "_fuser_step", False):
            raise RuntimeError(f"fuser: {type(model).__name__}.forward is routed through another FusedModule's "
                               "generate() right now; call one generate() at a time")
        entry = self._generate_entry
        if entry is None:
            original = model.forward  # the bound forward, before any patching
            entry = _Entry(self._compile(original), original)
            object.__setattr__(self, "_generate_entry", entry)

        def step(*a, **k):
            self._check_devices(a, k)
            return self._call(entry, a, k)
        step._fuser_step = True
        # generate() reads the forward's signature to decide what it passes (position_ids from the mask, the
        # mask itself, logits_to_keep): without it, GPT-2 with left padding decoded from the wrong positions
        step.__signature__ = inspect.signature(entry.eager)

        if hasattr(getattr(model, "generation_config", None), "disable_compile"):
            kwargs.setdefault("disable_compile", True)
        had, old = "forward" in model.__dict__, model.__dict__.get("forward")
        self._latest.clear()
        self._generating = True
        model.__dict__["forward"] = step  # model(...) -> nn.Module.__call__ -> self.forward: this step
        try:
            return model.generate(*args, **kwargs)
        finally:
            if had:
                model.__dict__["forward"] = old
            else:
                model.__dict__.pop("forward", None)
            self._generating = False

    @property
    def _name(self) -> str:
        """The model's class, or the function's name, for messages."""
        model = self.model
        return getattr(model.fn, "__qualname__", repr(model.fn)) if isinstance(model, _Function) else type(model).__name__

    def _captured(self, report: FusionReport, gm: torch.fx.GraphModule):
        self._known.add(report.graph)
        self._graph_reports.append(report)
        self.graph_modules.append(gm)

    @property
    def report(self) -> FusionReport:
        """The report of the graphs that ran in the latest call (and in the backward after it); after
        generate(), of the graphs that ran during it."""
        return FusionReport.merge(self._latest)

    @property
    def reports(self) -> list[FusionReport]:
        """Reports of every graph captured so far (one per graph, graph breaks and recaptures included)."""
        return list(self._graph_reports)

    @property
    def code(self) -> str:
        """The rewritten graphs as Python: each fused region is one `kernels_fused_<i>(...)` call,
        its output buffers allocated (and reused) in the program."""
        return "\n".join(self.report.code)


def _shared_backend(options: dict):
    """The backend of every FusedModule made with these options (one per set of options).  Dynamo keeps
    compiled code per code object and backend: with a backend each, a function that every module reaches
    in a frame of its own (the model class's forward past a graph break, a library helper) compiled again
    for each module, and the ninth module met Dynamo's recompile limit there and ran eagerly.  Shared,
    the code compiled for one module serves the next where Dynamo's guards hold.  And no backend holds a
    module: Dynamo keeps every backend for the life of the process (its model's weights with it, where each
    module's backend was a closure over it).  The backend's reports reach the module that runs each graph
    (_route_ran)."""
    key = tuple(backend.validate(options).items())
    with _backends_lock:
        if key not in _BACKENDS:
            _BACKENDS[key] = backend.make_backend(_route_captured, options, _route_ran)
        return _BACKENDS[key]


_BACKENDS: dict[tuple, object] = {}
_backends_lock = threading.Lock()
_calls = threading.local()
_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # forward graph -> the module that last ran it
_graph_modules: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # graph index -> its rewritten graph


def _running() -> list:
    """The FusedModules whose call is running in this thread, innermost last."""
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    return stack


def _module_of(report: FusionReport) -> FusedModule | None:
    """The module a graph runs for: the one whose call runs it, else (a backward graph, run by autograd after
    the call, perhaps in autograd's own thread) the one that last ran its forward graph."""
    stack = getattr(_calls, "stack", None)
    if stack:
        return stack[-1]
    return _owners.get(report.forward) if report.forward is not None else None


def _route_ran(report: FusionReport):
    module = _module_of(report)
    if module is not None:
        if report.forward is None and _owners.get(report.graph) is not module:  # (a read: a write costs 5x, per call)
            _owners[report.graph] = module
        module._ran(report)


def _route_captured(report: FusionReport, gm: torch.fx.GraphModule):
    _graph_modules[report.graph] = gm
    module = _module_of(report)
    if module is not None:
        module._captured(report, gm)


def _own_entry(target):
    """`target` called through a function whose code object is this FusedModule's own.  Dynamo keeps
    its compiled graphs, and counts them against its recompile limit, per code object: compiling the
    model's forward itself, every fuse() of one class (a notebook re-run, a sweep) would add to one
    count with a backend of its own, and the ninth would silently run eagerly."""
    def entry(*args, **kwargs):
        return target(*args, **kwargs)
    # a name of its own too: Dynamo keeps which sizes it saw change (automatic dynamic) per file, line and
    # name, so a second fuse() would start over symbolic sizes where the first had seen a size change
    name = f"fused_entry_{next(_ENTRIES)}"
    code = entry.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, entry.__globals__, name, None, entry.__closure__)


_ENTRIES = itertools.count()


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


def fuse(model, example_inputs: tuple | None = None, *, dynamic: bool | None = None, **options) -> FusedModule:
    """Fuse `model` (an nn.Module or a callable).  With example_inputs it captures now.

    `dynamic` is torch.compile's: None (the default) compiles the first call at its sizes and, when
    a size changes, recompiles with that size symbolic (automatic dynamic), so a model called at one
    shape gets kernels specialised to it and a model called at many lengths gets one generic graph
    more, not one per length; True makes sizes symbolic from the first call (torch._dynamo.mark_dynamic
    marks single dimensions); False specialises every shape (a graph per shape, until Dynamo's
    recompile limit, after which calls at new shapes run eagerly and the report says so)."""
    if isinstance(model, FusedModule):
        return model
    _check_dynamic(dynamic)
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise TypeError(f"fuser.fuse expects an nn.Module or a callable, got {type(model).__name__}")
        model = _Function(model)
    fused = FusedModule(model, options or None, dynamic=dynamic)
    if example_inputs is not None:
        with torch.no_grad():
            fused(*example_inputs)
    return fused


def _check_dynamic(dynamic):
    if not (dynamic is None or dynamic is True or dynamic is False):
        raise ValueError(f"fuser: dynamic={dynamic!r} is not allowed; allowed values: None (automatic: static "
                         "first, a size that changes becomes symbolic), True (symbolic sizes from the first "
                         "call), False (every shape specialised)")


def last_report() -> FusionReport | None:
    """The report of the most recently compiled graph, through fuse() or torch.compile."""
    all_ = backend.all_reports()
    return all_[-1] if all_ else None


def reports() -> list[FusionReport]:
    return backend.all_reports()
