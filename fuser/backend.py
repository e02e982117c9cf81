"""The `torch.compile(model, backend="fuser")` backend: Dynamo graph -> AOT Autograd -> our pipeline.

A failure inside the pipeline never reaches the user as a crash: the graph runs as it was given
(eager ATen), the reason goes to the `fuser` logger at WARNING and into the graph's report.  The one
exception is a backward graph over static sizes after its first call (ReleasingRunner): it drops its
inputs as it goes, so a failure of ours there is recorded and raised, and later calls run as given.
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import traceback
import weakref

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .pipeline import compile_graph
from .pregrad import claim
from .sdpa_calls import contiguous_masks, drop_constant_masks
from .decompositions import decompositions
from .fold import recompute_constants
from .runtime import CudaGraphs, EagerCheckError, NotForTheseSizes, cuda_graph_refusal, static_inputs, write_over_donated
from .report import FusionReport

log = logging.getLogger("fuser")
_reports: list[FusionReport] = []
_lock = threading.Lock()
_indices = itertools.count()  # next() of a count is atomic in CPython
# Dynamo's tracing context of a frame -> the latest forward graph compiled in it: AOT Autograd compiles a
# backward (lazily, at its first call, where sizes are symbolic) in its forward's context
_forward_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# option -> (default, allowed values, what it does)
OPTIONS = {"attention": (True, (True, False, "triton"), "recognise hand-written attention: True runs it as SDPA where "
                         "that is exact, else as our flash kernel; 'triton' always as our kernel; False leaves it"),
           "cuda_graphs": (False, (True, False), "replay each graph's kernels as CUDA graphs (GPU only)"),
           "fused_loss": (True, (True, False), "in training, a linear layer whose logits feed only a cross-entropy "
                          "runs as one chunked op that never holds the logits whole (fuser/linear_ce.py)"),
           "dropout": (True, (True, False), "in training, dropout runs inside the fused regions from a seed drawn "
                       "per call, its mask regenerated in the backward, never stored (fuser/dropout.py); False: eager")}
# torch.compile's modes, as fuser options: reduce-overhead is CUDA graphs; fuser does not autotune
# (yet), so max-autotune is read as reduce-overhead and max-autotune-no-cudagraphs as default
MODES = {"default": {}, "reduce-overhead": {"cuda_graphs": True}, "max-autotune": {"cuda_graphs": True},
         "max-autotune-no-cudagraphs": {}}


def record(report: FusionReport) -> None:
    with _lock:
        _reports.append(report)


def _new_index() -> int:
    """A graph's index, taken when its compile starts (a lazy backward may compile in one thread while a forward
    compiles in another: indices taken as the count of reports recorded could repeat; they key reports' routing)."""
    return next(_indices)


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


class ReleasingRunner:
    """A backward graph, called boxed (AOT Autograd hands over the list of saved activations and
    gradients).  Its first call goes through GraphRunner (which can rerun the graph as given on a
    failure of ours, so it keeps every input until the end).  Later calls run the fused graph in the
    boxed convention (fx's _BoxedCodeGen): it empties the list and drops each input at its last use,
    as Inductor's output code does, so the saved activations are freed as the backward consumes
    them instead of all living until it ends, and the activations AOT Autograd donates are written
    over where they are read for the last time (runtime.write_over_donated).  Only over static
    sizes: a graph over symbolic sizes may meet sizes no kernel serves (NotForTheseSizes), which
    needs its inputs to run as given."""

    def __init__(self, runner: GraphRunner, gm: fx.GraphModule, donated: tuple = ()):
        self.runner, self.warm = runner, False
        self.boxed, written = _boxed_module(gm, donated)
        if written:
            runner.report.notes.append(f"from the second call, {len(written)} ops write over saved activations AOT "
                                       f"Autograd donates (freed as they are used): {', '.join(written)}")
        self._boxed_call = True  # on the instance: AOT's wrappers copy __dict__ (functools.wraps)

    def __call__(self, args: list):
        r = self.runner
        if not self.warm or self.boxed is None or r.fused is r.given:
            self.warm = not any(isinstance(a, int) for a in args)  # ints: symbolic sizes
            return r(*args)
        if r.ran is not None:
            r.ran(r.report)
        try:
            return self.boxed(args)
        except EagerCheckError:
            raise
        except Exception as e:  # noqa: BLE001 - its inputs are gone: no rerun, said loudly
            _fall_back(r.report, "at run time, after its inputs were released", e)
            r.fused = r.given
            raise RuntimeError(f"fuser: backward graph {r.report.graph} failed after it released its inputs, so "
                               f"this call cannot run as given; later calls will: {type(e).__name__}: {e}") from e


def _boxed_module(gm: fx.GraphModule, donated: tuple = ()):
    """(gm's forward in the boxed convention (a copy of its graph), the calls that write over the
    `donated` inputs there: runtime.write_over_donated), or (None, []) where torch has no such codegen."""
    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is None:
        return None, []
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(isinstance(n.meta.get("val"), torch.SymInt) for n in inputs):
        donated = ()  # symbolic sizes: never run boxed (ReleasingRunner), so nothing is written over
    try:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        copied = [n for n in graph.nodes if n.op == "placeholder"]
        written = write_over_donated(graph, {copied[i] for i in donated if i < len(copied)}) if donated else []
        graph.set_codegen(codegen())
        return fx.GraphModule(gm, graph).forward, written
    except Exception as e:  # noqa: BLE001 - a failure here costs the boxed run, not the graph
        log.warning("fuser: a backward graph keeps its inputs to its end (no boxed copy): %s: %s", type(e).__name__, e)
        return None, []


def _donated_inputs() -> tuple:
    """Indices of the backward graph's inputs that AOT Autograd donates (runtime.write_over_donated),
    read where Inductor reads them: the tracing context's forward metadata."""
    context = torch._guards.TracingContext.try_get()
    return tuple(getattr(getattr(context, "fw_metadata", None), "bw_donated_idxs", None) or ())


def _partition(joint, inputs, **kwargs):
    """AOT Autograd's min-cut, allowed to recompute a cheap pointwise result in the backward even where a
    backward matmul reads it (SwiGLU's silu(gate) * up, a norm's output feeding the next projections):
    AOT bans that by default as saving no memory, the tensor being materialised in the backward anyway;
    but a training step peaks as its backward starts, every layer's activations held, and a tensor
    remade where its layer's backward reads it is held for that layer only (run 59: llama-128k's forward
    saved 3 [tokens, ffn] tensors a layer, as Inductor's does)."""
    recompute_constants(joint)
    with functorch_config.patch(ban_recompute_materialized_backward=False):
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def make_backend(sink=None, options: dict | None = None, ran=None):
    """A Dynamo backend that fuses each graph it is given: forward (or inference) and backward.
    `sink(report, gm)` hears of each graph compiled, `ran(report)` of each graph run."""
    opts = validate(options)

    n_dynamo_inputs = [0]  # of the graph Dynamo gave (set per graph, below)
    claimed: list[str] = []  # what pregrad.claim did to the graph being compiled, for its forward's report

    def compiler(backward: bool, inference: bool = False):
        def compile_(gm, example_inputs):
            index = _new_index()
            static = static_inputs(gm, n_dynamo_inputs[0], len(example_inputs), backward)  # params, buffers
            given = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # compile_graph rewrites gm in place
            try:
                new, report = compile_graph(gm, graph_index=index, attention=opts["attention"] if not backward else False,
                                            cuda_graphs=opts["cuda_graphs"], static=tuple(static))
                report.graph = index
            except Exception as e:
                new, report = given, FusionReport(graph=index)
                _fall_back(report, "while compiling", e)
            if backward:
                report.forward = _forward_graphs.get(torch._guards.TracingContext.try_get())
                report.notes.append("backward graph (from AOT Autograd)")
            else:
                report.notes += claimed
                if (context := torch._guards.TracingContext.try_get()) is not None:
                    _forward_graphs[context] = index
            record(report)
            if sink is not None:
                sink(report, new)
            runner = GraphRunner(new.forward, given.forward, report, ran)
            # donated activations are written over only without CUDA graphs (not yet run under replay)
            donated = _donated_inputs() if not opts["cuda_graphs"] else ()
            run = ReleasingRunner(runner, new, donated) if backward and new is not given else make_boxed_func(runner)
            if opts["cuda_graphs"]:
                run = _cuda_graphed(run, given, static, report, backward, inference, ran)
            return run
        return compile_

    # min-cut (_partition): the forward saves what is cheapest by bytes and recomputes cheap pointwise work instead.
    # Mutated inputs (a KV cache, a buffer) stay in the graph as copy_ (as Inductor asks): the wrapper
    # then writes them in place (runtime.write_inputs_in_place) and CUDA graphs capture the writes.
    aot = aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True),
                       inference_compiler=compiler(False, inference=True), decompositions=decompositions(),
                       partition_fn=_partition, keep_inference_input_mutations=True)

    def backend(gm, example_inputs):
        n_dynamo_inputs[0] = len(example_inputs)
        dropped: list[str] = []
        given = gm  # Dynamo's graph, what runs if AOT Autograd fails on the claimed one
        try:
            dropped = drop_constant_masks(gm) + contiguous_masks(gm) if opts["attention"] is not False else []  # in place: `given` too
            claimed[:] = dropped
            if opts["attention"] or opts["fused_loss"] or opts["dropout"]:
                gm, notes = _claimed(gm, example_inputs, opts["attention"], opts["fused_loss"], opts["dropout"])
                claimed[:] += notes
            return aot(gm, example_inputs)
        except (RestartAnalysis, SkipFrame):
            raise  # Dynamo's own control flow (e.g. a 0-d float input made a SymFloat): not a failure
        except Exception as e:  # AOT Autograd or a decomposition failed on this graph: Dynamo's graph runs as is
            if gm is not given:  # the claims' graph failed: Dynamo's own, fused as a graph with nothing claimed
                why = f"attention, loss and dropout in training left to their ops: AOT Autograd failed on the " \
                      f"graph that claimed them: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log.warning("fuser: %s", why)
                try:
                    claimed[:] = dropped + [why]
                    return aot(given, example_inputs)
                except (RestartAnalysis, SkipFrame):
                    raise
                except Exception as again:  # noqa: BLE001 - the graph as given, below
                    e = again
            report = FusionReport(graph=_new_index())
            _fall_back(report, "while capturing (AOT Autograd)", e)
            record(report)
            if sink is not None:
                sink(report, given)
            return GraphRunner(given.forward, given.forward, report, ran)
    return backend


def _claimed(gm, example_inputs, attention: bool | str, loss: bool, dropout: bool):
    """pregrad.claim, or Dynamo's graph as given (with the reason) where the trace it makes fails."""
    try:
        return claim(gm, example_inputs, attention, loss, dropout)
    except Exception as e:  # noqa: BLE001 - a failure here must cost the claim, not the graph
        log.warning("fuser: attention, loss and dropout in training left to their ops: %s: %s", type(e).__name__, e)
        return gm, [f"attention, loss and dropout in training left to their ops: the trace before autograd failed: "
                    f"{type(e).__name__}: {e}"[:300]]


def _cuda_graphed(run, gm, static: list, report: FusionReport, backward: bool, inference: bool, ran):
    """`run` replayed as CUDA graphs where the graph allows it; else `run`, with the reason noted."""
    def note(text: str):
        if text not in report.notes:
            report.notes.append(text)
            log.info("fuser: graph %d: %s", report.graph, text)

    reason = cuda_graph_refusal(gm, static)
    if reason is not None:
        note(f"cuda_graphs: not used for this graph: {reason}")
        return run
    graphed = CudaGraphs(run, gm, static, backward=backward, inference=inference, note=note)
    note("cuda_graphs: this graph's kernels are replayed as CUDA graphs (one per size)")

    def replay(args):
        if ran is not None:  # a replay does not run the graph's Python: the report hears of it here
            ran(report)
        return graphed(args)
    replay._boxed_call = True
    return replay


def fuser_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """Entry point registered as `torch_dynamo_backends: fuser`.  torch.compile passes `mode` and
    `options` through (`mode="reduce-overhead"` turns on CUDA graphs)."""
    return make_backend(options=options_for(mode, options))(gm, example_inputs)


def options_for(mode: str | None, options: dict | None) -> dict:
    """torch.compile's mode as fuser options; options given explicitly win."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"fuser: mode={mode!r} is not known; known: {', '.join(MODES)}")
    return {**MODES.get(mode or "default", {}), **(options or {})}
