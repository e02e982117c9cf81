"""The runtime: kernel source to a loaded kernel, launches, and the modules the rewritten graph calls.

Loading: the source is written to `$FUSER_CACHE_DIR/<sha>.py` and imported from there, so `triton.jit`
sees a real file (it reads the source for its own cache key) and Triton's compiled binaries are
reused across processes.  Kernels for CPU tensors run through Triton's interpreter, kernels for GPU
tensors are compiled.  Triton reads its interpret knob when `@triton.jit` wraps a function (and when
an interpreted kernel calls a constexpr function), so we set it per kernel, for the device the kernel
is made for, instead of for the whole process at import: no environment variable and no import order
is needed, and one process can run both kinds.

Kernel modules: a region's kernel (`RegionKernel`) checks what it is given, picks the variant,
allocates and launches.  Kernels over static sizes are specialised to them and to the captured
strides (constants make the index math cheap); a call with the captured shapes and dtypes but other
strides gets a variant generated for those strides; other shapes or dtypes are refused, never run on
a kernel made for something else.  Kernels over symbolic sizes (Dynamo marked a size dynamic) take
the size symbols as int arguments, passed by the rewritten graph after the tensors.  Each call
evaluates the expected shapes and strides from them and checks the inputs; the variant is chosen per
call: rows in registers or looped (by the row length), 32- or 64-bit offsets (by the largest offset),
and, for an input whose strides are not the captured expressions, a variant that takes that input's
strides as arguments.  Sources come from the `generate` function the pipeline hands over: the
runtime never imports codegen or patterns.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import logging
import operator
import os
import sys
import threading
import types
import warnings
import weakref

import numpy as np
import sympy
import torch
from torch._dynamo.backends.cudagraphs import find_input_mutations, get_device_node_mapping
from torch._inductor import cudagraph_trees
from torch.multiprocessing.reductions import StorageWeakRef
from torch._inductor.cudagraph_utils import check_multiple_devices_or_any_cpu_nodes, get_placeholder_info
from torch._inductor.utils import count_tangents, get_first_incompatible_cudagraph_node, num_fw_fixed_arguments
from triton import knobs
import triton.runtime.interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from . import indexing as ix
from . import ops
from .dtypes import interpreted
from .graph import OWN_CALL, computed_from, is_size, meta
from .plan import WIDE, TensorSig, block_plan, max_offset
from .region import Region, persistent_at

aten = torch.ops.aten

log = logging.getLogger("fuser")
_loaded: dict[tuple, object] = {}
_lock = threading.Lock()


def cache_dir() -> str:
    path = os.environ.get("FUSER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    os.makedirs(path, exist_ok=True)
    return path


_as_interpreted: dict = {}


def _call_interpreted(jit_fn, *args, **kwargs):
    """JITFunction.__call__ while a kernel is interpreted.  Triton's own @jit helpers (tl.max,
    tl.sum, tl.sigmoid...) were wrapped when triton was imported: compiled, unless TRITON_INTERPRET
    was set then.  Inside an interpreted kernel they run as the interpreter runs its own."""
    fn = _as_interpreted.get(id(jit_fn))  # by id: hashing a JITFunction walks its source
    if fn is None:
        fn = _as_interpreted[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
    return fn(*args, **kwargs)


def _squeeze_int_arguments() -> None:
    """Triton 3.6's interpreter (the GPU image's) holds an int argument as a 1-element array and reads it
    as an index with int(array), which numpy 2.4 refuses for an array of one dimension (a loop
    `range(0, V, BLOCK)` over an argument V raised); Triton 3.9 squeezes the array first, and so do we."""
    patch = _interp._patch_lang_tensor
    if getattr(patch, "fuser_squeezes", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patched.fuser_squeezes = True
    _interp._patch_lang_tensor = patched


_squeeze_int_arguments()


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
            with _language_kept(), np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                yield
        else:
            yield
    finally:
        knobs.runtime.interpret, JITFunction.__call__ = old, old_call


@functools.cache
def _language_objects() -> tuple:
    """What the interpreter patches: triton.language, its core and math modules, and core's classes
    (the tensor's operators, dtype.to_ir, ...)."""
    mods = [sys.modules[n] for n in ("triton.language", "triton.language.core", "triton.language.math")]
    classes = [v for v in vars(mods[1]).values() if isinstance(v, type) and v.__module__ == mods[1].__name__]
    return tuple(mods + classes)


@contextlib.contextmanager
def _language_kept():
    """triton.language as it was before an interpreted kernel ran.  The interpreter swaps the
    language's builtins for interpreted ones while a kernel runs, and restores them after; but a
    @jit helper called from inside (tl.max, tl.sum) patches them again and never restores (Triton
    3.6 to 3.9, `InterpretedFunction.__call__`).  Left so, the next kernel compiled for the GPU in
    this process builds its IR with the interpreter's semantics and fails (`'ir.value' object has no
    attribute 'dtype'`): a fallback that depends on which test ran before."""
    saved = [(o, dict(vars(o))) for o in _language_objects()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            if now == before:  # the common case, compared in C
                continue
            # names new to a module stay: the interpreter adds its own to the globals of the functions
            # it rewrites, which its cached rewrites go on using
            for name in [n for n in now if n not in before] if isinstance(obj, type) else ():
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _absent) is not value:
                    setattr(obj, name, value)


_absent = object()


def load(source: str, name: str, device_type: str):
    """The jitted function `name` defined in `source`, made for `device_type` (interpreted on CPU)."""
    interp = interpreted(device_type)
    hit = _loaded.get((source, name, interp))
    if hit is not None:
        return hit
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    with _lock:
        if (source, name, interp) in _loaded:
            return _loaded[(source, name, interp)]
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
        _loaded[(source, name, interp)] = fn
        return fn


def run_interpreted(fn, grid, *args, **kwargs):
    """Run an interpreted kernel on CPU tensors (the knob on while it runs, numpy quiet)."""
    with _interpret_knob(True):
        return fn[grid](*args, **kwargs)


# torch.cuda.current_device() and current_stream() wrap these with checks that cost microseconds
# per launch; the launch path calls the bindings themselves
_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else None
# with one visible GPU every kernel's device is the current one: the bound paths skip asking (~1 us a
# launch, 148 calls a llama-gqa step, run 87)
_ONE_GPU = torch.cuda.is_available() and torch.cuda.device_count() == 1


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
        self.constexprs = tuple(meta[a] for a in fn.arg_names if a in meta)  # in parameter order
        self.compiled: dict = {}
        self.aligned = None  # the compiled kernel for tensor arguments all 16-byte aligned, no ints
        self.pending = None  # a compile started ahead (precompile), waited for at the first launch

    def precompile(self, grid, dtypes: list, device: torch.device) -> None:
        """Compile for tensor arguments of `dtypes` (16-byte aligned, as the caching allocator's are) in a
        thread of the compile pool, while the graph is still being compiled and run: Triton compiles a kernel
        in ~0.2-0.4 s, mostly outside the GIL (its passes, ptxas), so a graph's kernels compile side by side
        instead of one at each first launch (Inductor compiles its kernels in parallel too)."""
        pool = _compile_pool()
        if pool is None or self.interpreted or self.pending is not None or self.compiled:
            return

        def compile_():
            with torch.cuda.device(device):
                self.fn.warmup(*dtypes, grid=grid if isinstance(grid, tuple) else (grid,), **self.meta)
        self.pending = pool.submit(compile_)

    def __call__(self, grid, *args):
        """grid: the number of programs, or a tuple of up to 3."""
        if self.interpreted:
            run_interpreted(self.fn, grid if isinstance(grid, tuple) else (grid,), *args, **self.meta)
            return
        if self.pending is not None:  # the JIT below finds what it compiled (a failure is the launch's to raise)
            pending, self.pending = self.pending, None
            with contextlib.suppress(Exception):
                pending.result()
        key = _spec(args)
        compiled = self.compiled.get(key)
        if compiled is not None and _no_launch_hooks():
            run_compiled(compiled, grid, 0 if _ONE_GPU else _current_device(), args, self.constexprs)
            return
        compiled = self.fn[grid if isinstance(grid, tuple) else (grid,)](*args, **self.meta)
        if hasattr(compiled, "packed_metadata"):
            self.compiled[key] = compiled
            if all(k is True for k in key):
                self.aligned = compiled


@functools.cache
def _compile_pool():
    """Threads compiling kernels ahead (Launcher.precompile): FUSER_COMPILE_THREADS of them (default: the
    machine's cores; 0: none, each kernel compiles at its first launch)."""
    n = int(os.environ.get("FUSER_COMPILE_THREADS", os.cpu_count() or 1))
    return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="fuser-compile") if n > 0 else None


def run_compiled(compiled, grid, device_index: int, args, constexprs):
    """Launches a kernel Triton's JIT compiled, on the current stream of `device_index`, without the
    JIT's argument binding: the one place that speaks the compiled launcher's calling convention.
    grid: the number of programs, or a tuple of up to 3."""
    x, y, z = (grid, 1, 1) if grid.__class__ is int else (*grid, 1, 1)[:3]
    compiled.run(x, y, z, _raw_stream(device_index), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *constexprs)


_launchers: dict = {}


def launch(source: str, name: str, grid, args, meta: dict, device_type: str):
    """Launch kernel `name` of `source` on `args` with the meta-parameters `meta` (constexprs, num_warps,
    num_stages) through a Launcher kept per kernel, meta, tensor dtypes and device: the attention kernels
    and their tile lists, whose host side (`prepare`) works out grid, arguments and meta per call, launch
    as the regions do once compiled (Launcher), not through the JIT's argument binding."""
    key = (source, name, tuple(meta.items()), tuple([a.dtype for a in args if isinstance(a, torch.Tensor)]),
           (0 if _ONE_GPU else _current_device()) if device_type == "cuda" else None)
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = _launchers[key] = Launcher(load(source, name, device_type), meta, device_type)
    launcher(grid, *args)
    return launcher


def launch_sequence(source: str, launches: list, device_type: str, key) -> None:
    """Launch `launches` ((kernel name, grid, args, meta) each, in order) of `source`.  On CUDA, once a first
    call has compiled them, a call under the same `key` (the caller's: it must fix every launch's meta and int
    arguments) whose tensors are all 16-byte aligned calls the compiled kernels directly: one lookup for the
    sequence instead of a launcher's key and an alignment key per launch (the embedding gradient's three
    launches: fuser/embedding.py)."""
    bound = _sequences.get(key) if device_type == "cuda" else None
    if bound is not None and _no_launch_hooks() and (_ONE_GPU or _current_device() == bound[0]) and _aligned(launches):
        for (_, grid, args, _), (compiled, constexprs) in zip(launches, bound[1]):
            run_compiled(compiled, grid, bound[0], args, constexprs)
        return
    launchers = [launch(source, name, grid, args, meta, device_type) for name, grid, args, meta in launches]
    if device_type == "cuda" and key not in _sequences and _aligned(launches):
        kernels = [(launcher.compiled.get(_spec(args)), launcher.constexprs)
                   for launcher, (_, _, args, _) in zip(launchers, launches)]
        if all(c is not None for c, _ in kernels):
            _sequences[key] = (0 if _ONE_GPU else _current_device(), kernels)


def _aligned(launches) -> bool:
    return all(a.data_ptr() % 16 == 0 for _, _, args, _ in launches for a in args if isinstance(a, torch.Tensor))


def _spec(args) -> tuple:
    """What Triton's JIT specialises a launch on (Launcher's key for its compiled kernels)."""
    return tuple([a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else _int_spec(a) for a in args])


def current(device: torch.device):
    """A context making `device` the current CUDA device, for launches that go to the current one; nothing
    where it already is, or on CPU (entering torch.cuda.device costs host time on every call)."""
    if device.type != "cuda" or _ONE_GPU or device.index == _current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _no_launch_hooks() -> bool:
    """No launch hook is set (a profiler's, say): triton >= 3.6 holds them in a HookChain, empty when
    none is, where older versions had None."""
    hook = knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


def _int_spec(a: int) -> tuple:
    """What Triton's JIT specialises an int argument on (a tensor: its pointer's 16-byte alignment)."""
    return (a == 1, a % 16 == 0, -2**31 <= a < 2**31)


BOUND_SIZES = 64  # size values per symbolic kernel whose call is kept bound (RegionKernel._bind_sizes; launch_sequence)
CONSTANT_ROWS = 4  # row lengths of a looped reduction that get a variant with the length built in


class EagerCheckError(RuntimeError):
    """What eager raises on this input (an index out of range, an integer division by zero)."""


class NotForTheseSizes(Exception):
    """No kernel of this region serves the sizes of this call (a reduction over an empty row, which
    eager answers with an identity or an error): the graph runs as given for this call."""


class _Variant:
    """One generated kernel and its launchers, one per launch config."""

    def __init__(self, src, params: list):
        self.src, self.params = src, params  # params: where each size argument comes from (see _dynamic)
        self.fn = None
        self.launchers: dict = {}

    def launcher(self, plan, device_type: str, reduction: bool) -> "Launcher":
        key = (plan.xblock, plan.rblock, plan.num_warps)
        hit = self.launchers.get(key)
        if hit is None:
            if self.fn is None:
                self.fn = load(self.src.source, self.src.name, device_type)
            meta_args = {"XBLOCK": plan.xblock}
            if reduction:
                meta_args["RBLOCK"] = plan.rblock
            if device_type != "cpu":
                meta_args["num_warps"] = plan.num_warps
                # debug=True (the kernel's device-side asserts) also turns on Triton's integer overflow
                # sanitizer, which miscompiled a ragged pool's index math on triton 3.6 (H200, run 230:
                # every output wrong, NaN in some; right without it): the asserts stay, the sanitizer off
                meta_args["sanitize_overflow"] = False
            hit = self.launchers[key] = Launcher(self.fn, meta_args, device_type)
        return hit


class RegionKernel(torch.nn.Module):
    """`generate(in_sigs, out_sigs, persistent=, wide=)` gives the KernelSource of a variant."""

    def __init__(self, region: Region, name: str, generate):
        super().__init__()
        self.region, self.name, self.generate = region, name, generate
        self.sizes = region.cg.sizes
        self.in_sigs = tuple(TensorSig.of(meta(n)) for n in region.inputs)
        self.out_sigs = tuple(TensorSig.of(meta(n)) for n in region.outputs)
        self.device = meta(region.outputs[0]).device  # where a region with no tensor inputs runs
        self.device_type = self.device.type
        self.reduction = region.space.is_reduction
        self.symbols = region.size_symbols
        r_symbols = ix.size_symbols(region.space.r)  # a row length that is one symbol can be made constant
        self._row_symbol = region.space.r if len(r_symbols) == 1 and next(iter(r_symbols)) == region.space.r else None
        # outputs stored into an input in place (ops.Scatter): the wrapper hands that input over as the buffer
        self.scatters = tuple(j for j, o in enumerate(region.outputs) if isinstance(region.cg.info[o], ops.Scatter))
        self.seen: tuple = ()  # the size arguments of the latest call (the report's values)
        self.checked = tuple(range(len(self.in_sigs)))  # inputs `into` compares (the rewrite narrows it)
        self.moved = {i for i, n in enumerate(region.inputs) if meta(n).device != self.device}  # 0-d CPU scalars
        self._plans: dict = {}  # (rows, r) -> launch config, for kernels over symbolic sizes
        self._at: dict = {}  # size values -> the call at those sizes, bound (_bind_sizes)
        self._rows_constant: set = set()  # row lengths with a variant of their own (_constant_row)
        self.variants: dict = {}
        if self.symbols:
            self._shapes_at = _shape_function(self.symbols, self.in_sigs, self.out_sigs, region.space)
            hints = [self.sizes.hint(s) for s in self.symbols]
            *_, rows, r = self._shapes_at(*hints)
            # the variant for the captured layout at the hints: emitting it now also proves it can be
            self.source = self._dynamic((persistent_at(r, region.column) if self.reduction else True, False, (), None)).src.source
        else:
            self._captured = self._static(self.in_sigs)
            self.source = self._captured[0].src.source
            space = region.space
            self._rows, self._r = int(space.rows), int(space.r)
            self.empty = self._rows == 0 or (self.reduction and self._r == 0)
            self._plan = block_plan(self._rows, self._r if self.reduction else None, self.device_type, region.column)
            if not self.empty and self.device_type == "cuda":
                variant, outs = self._captured
                variant.launcher(self._plan, "cuda", self.reduction).precompile(
                    self._plan.programs, [s.dtype for s in (*self.in_sigs, *outs)], self.device)

    def _generate(self, in_sigs, out_sigs, persistent: bool, wide: bool, constant: tuple = ()):
        return self.generate(list(in_sigs), list(out_sigs), persistent=persistent, wide=wide, constant=constant)

    # ------------------------------------------------------------------ static sizes
    def _static(self, sigs: tuple):
        """(variant, outputs' signatures) for these input signatures (ints)."""
        if sigs not in self.variants:
            outs = tuple(TensorSig(tuple(map(int, s.shape)), tuple(map(int, s.stride)), s.dtype) for s in self.out_sigs)
            wide = any(max_offset(s.shape, s.stride) >= WIDE for s in (*sigs, *outs))
            src = self._generate(sigs, outs, self.region.persistent, wide)
            self.variants[sigs] = (_Variant(src, []), outs)
        return self.variants[sigs]

    def _check(self, inputs) -> tuple:
        for t, s in zip(inputs, self.in_sigs):
            if t.shape != s.shape or t.stride() != s.stride or t.dtype != s.dtype:
                break
        else:
            return self.in_sigs  # the captured layout: the common case, checked without allocating
        sigs = tuple(TensorSig.of(t) for t in inputs)
        for i, (got, want) in enumerate(zip(sigs, self.in_sigs)):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise RuntimeError(
                    f"{self.name}: input {i} is {got.shape} {got.dtype}, but the kernel was made for "
                    f"{want.shape} {want.dtype}; recapture (fuser.fuse) for new shapes or dtypes")
        return sigs

    # ------------------------------------------------------------------ symbolic sizes
    def _dynamic(self, key: tuple) -> _Variant:
        """The variant (persistent, wide, inputs with generic strides, row length made constant) of
        the symbolic kernel."""
        hit = self.variants.get(key)
        if hit is None:
            persistent, wide, generic, row_length = key
            where = {s: ("size", k) for k, s in enumerate(self.symbols)}
            sigs = list(self.in_sigs)
            for i in generic:  # strides as arguments: in<i>_st<d>
                strides = tuple(sympy.Symbol(f"in{i}_st{d}", integer=True, nonnegative=True) for d in range(len(sigs[i].shape)))
                where.update({s: ("stride", i, d) for d, s in enumerate(strides)})
                sigs[i] = TensorSig(sigs[i].shape, strides, sigs[i].dtype)
            constant = (self._row_symbol,) if row_length is not None else ()
            src = self._generate(sigs, self.out_sigs, persistent, wide, constant)
            params = [where[p] for p in src.params]
            hit = self.variants[key] = _Variant(src, params)
        return hit

    def _constant_row(self, r: int):
        """A looped reduction over a symbolic row length runs its loop a third slower than over a
        constant one (H100, cross-entropy over 128256 logits: 1.29 vs 0.97 ms; bench/notes.md), so
        the first CONSTANT_ROWS row lengths it meets each get a variant with the length built in
        (a vocabulary or hidden size rarely varies); lengths past those share the generic variant.
        The variant is keyed by the exact length: never run for another."""
        if self._row_symbol is None:
            return None  # only a row length that is one symbol can be passed as that constant
        seen = self._rows_constant
        if r in seen or len(seen) < CONSTANT_ROWS:
            seen.add(r)
            return r
        return None

    def seen_sizes(self) -> dict:
        return dict(zip(self.symbols, self.seen))

    def _run_dynamic(self, inputs, values, device):
        object.__setattr__(self, "seen", values)  # not nn.Module's __setattr__: microseconds a call
        in_shapes, in_strides, out_shapes, out_strides, rows, r = self._shapes_at(*values)
        generic = []
        for i, (t, shp, st, sig) in enumerate(zip(inputs, in_shapes, in_strides, self.in_sigs)):
            if t.shape != shp or t.dtype != sig.dtype:
                raise RuntimeError(
                    f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, but the kernel was made for "
                    f"{sig.shape} {sig.dtype} = {shp} at these sizes; recapture (fuser.fuse) for new shapes or dtypes")
            if t.stride() != st and any(a != b for a, b, n in zip(t.stride(), st, shp) if n != 1):
                generic.append(i)
        outs = [torch.empty_strided(shp, st, dtype=s.dtype, device=device)
                for shp, st, s in zip(out_shapes, out_strides, self.out_sigs)]
        if rows == 0:
            return outs, None
        if self.reduction and r == 0:
            raise NotForTheseSizes(f"{self.name}: a reduction over 0 elements")
        # offsets from a tensor's data pointer stay inside its storage: bounded by the storage's size
        wide = rows * max(r, 1) >= WIDE or any(
            t.untyped_storage().nbytes() >= WIDE * t.element_size() for t in (*inputs, *outs))
        persistent = persistent_at(r, self.region.column) if self.reduction else True
        variant = self._dynamic((persistent, wide, tuple(generic), self._constant_row(r) if not persistent else None))
        plan = self._plans.get((rows, r))
        if plan is None:
            plan = self._plans[(rows, r)] = block_plan(rows, r if self.reduction else None, self.device_type,
                                                       self.region.column)
        sizes = [values[p[1]] if p[0] == "size" else inputs[p[1]].stride(p[2]) for p in variant.params]
        return outs, (variant, plan, sizes)

    # ------------------------------------------------------------------ launch
    def forward(self, *args):
        """The general entry (kernels over symbolic sizes, and any direct call): checks every input,
        allocates the outputs, launches; returns the outputs.  Over symbolic sizes, a call at sizes
        seen before takes the call bound for them (_bind_sizes) when its inputs match."""
        if self.scatters:
            raise RuntimeError(f"{self.name} stores into an input in place: it is called through the graph's "
                               "wrapper, with that input as its output buffer")
        if self.symbols:
            bound = self._at.get(args[len(self.in_sigs):])
            if bound is not None:
                outs = bound(args)
                if outs is not None:
                    return outs
        inputs = args[:len(self.in_sigs)]
        device = next((t.device for t in inputs if t.dim() > 0), self.device)
        if device.type != self.device_type:
            raise RuntimeError(f"{self.name}: made for {self.device_type} tensors, given {device.type} ones")
        moved = any(t.device != device for t in inputs)
        if moved:
            inputs = [t.to(device) for t in inputs]  # 0-d CPU scalars
        if self.symbols:
            values = args[len(self.in_sigs):]
            outs, launch = self._run_dynamic(inputs, values, device)
            if launch is None:
                return tuple(outs)
            variant, plan, sizes = launch
            if not moved and not any(p[0] == "stride" for p in variant.params):
                self._bind_sizes(values, inputs, outs, variant, plan, sizes, device)
        else:
            if len(args) != len(self.in_sigs):
                raise TypeError(f"{self.name}: expected {len(self.in_sigs)} tensors, got {len(args)}")
            sigs = self._check(inputs)
            variant, out_sigs = self._captured if sigs is self.in_sigs else self._static(sigs)
            outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in out_sigs]
            if self.empty:
                return tuple(outs)
            plan, sizes = self._plan, []
        self._launch(variant, plan, inputs, outs, sizes, device)
        return tuple(outs)

    def _bind_sizes(self, values: tuple, inputs, outs, variant, plan, sizes, device):
        """The call at these size values, bound: what _run_dynamic worked out (the inputs' and
        outputs' layouts, the variant, the launch config, the size arguments) kept, so that a later
        call at the same sizes is a comparison of each input's layout with this call's, the outputs'
        allocation and the launch; on CUDA, once compiled, the compiled kernel is launched directly
        (as _bound_into).  An input in another layout (or a launch hook, another current device, an
        unaligned pointer) returns None: the general path.  At most BOUND_SIZES sizes are kept
        (then the oldest goes): a length that changes every call keeps the general path's cost."""
        n, n_in = len(self.out_sigs), len(self.in_sigs)
        checks = tuple((t.shape, t.stride(), t.dtype) for t in inputs)
        made = tuple((tuple(o.shape), o.stride(), o.dtype) for o in outs)
        alloc = allocator(device)
        launcher = variant.launcher(plan, device.type, self.reduction)
        key = (True,) * (len(inputs) + n) + tuple(_int_spec(a) for a in sizes)
        grid, constexprs, index, name = plan.programs, launcher.constexprs, device.index, self.name
        compiled_path = device.type == "cuda" and not variant.src.checks
        launch = self._launch

        def call(args):
            for t, (shape, stride, dtype) in zip(args, checks):
                if t.shape != shape or t.stride() != stride or t.dtype != dtype:
                    return None
            object.__setattr__(self, "seen", values)
            ins = args[:n_in]
            new = [alloc(*m) for m in made]
            compiled = launcher.compiled.get(key) if compiled_path else None
            if compiled is None or (not _ONE_GPU and _current_device() != index) or not _no_launch_hooks() \
                    or any(t.data_ptr() % 16 for t in ins):
                launch(variant, plan, ins, new, sizes, device)
            else:
                run_compiled(compiled, grid, index, (*ins, *new, *sizes), constexprs)
            return tuple(new)
        call.__name__ = f"{name}_at_{'_'.join(map(str, values))}"
        if len(self._at) >= BOUND_SIZES:
            del self._at[next(iter(self._at))]
        self._at[values] = call

    def into(self, *args):
        """The per-graph wrapper's entry for a kernel over static sizes: the inputs, then output
        buffers the wrapper allocated with the captured layout.  Only the inputs in `checked` (those
        the wrapper did not allocate itself) are compared with the captured layout; one that differs
        gets its own variant (other strides) or an error (other shapes or dtypes), as in forward."""
        n = len(self.in_sigs)
        inputs, outs = args[:n], args[n:]
        variant = self._captured[0]
        for i in self.checked:
            t, s = inputs[i], self.in_sigs[i]
            if t.shape != s.shape or t.stride() != s.stride or t.dtype != s.dtype:
                variant = self._static(self._check(inputs))[0]
                break
        if self.moved:
            inputs = [t.to(self.device) if i in self.moved else t for i, t in enumerate(inputs)]
        if not self.empty:
            self._launch(variant, self._plan, inputs, outs, (), self.device)
        return outs[0] if len(outs) == 1 else outs

    def _launch(self, variant: _Variant, plan, inputs, outs, sizes, device):
        launcher = variant.launcher(plan, device.type, self.reduction)
        src = variant.src
        if src.checks:  # interpreted kernels flag what eager raises on (see KernelWriter._check)
            flags = torch.zeros(len(src.checks), dtype=torch.int32, device=device)
            # eager checks every index before it writes: a tensor a scatter stores into in place (a cache) is put
            # back as it was where the call raises (CPU only: this path is interpreted)
            saved = [(outs[j], outs[j].clone()) for j in self.scatters]
            launcher(plan.programs, *inputs, *outs, flags, *sizes)
            for message, bad in zip(src.checks, flags.tolist()):
                if bad:
                    for o, before in saved:
                        o.copy_(before)
                    raise EagerCheckError(f"{message} (in fuser kernel {self.name})")
        elif device.type == "cuda" and device.index != _current_device():
            with torch.cuda.device(device):
                launcher(plan.programs, *inputs, *outs, *sizes)
        else:
            launcher(plan.programs, *inputs, *outs, *sizes)

    def __call__(self, *inputs):  # straight to forward: no hook machinery on the launch path
        return self.forward(*inputs)

    def buffers(self):
        """(shape, stride, dtype, device) of each output, for the wrapper to allocate; None when the
        sizes are symbolic (the kernel allocates them per call)."""
        if self.symbols:
            return None
        return [(s.shape, s.stride, s.dtype, self.device) for s in self._captured[1]]

    def entry(self):
        """What the rewritten graph calls, named for the kernel in its printed code: `into` for
        static sizes (the wrapper allocates the outputs), `forward` for symbolic ones."""
        if self.symbols:
            return named(self.name, self.forward)
        into = self._bound_into() if self.device_type == "cuda" and not (self.moved or self.empty) else self.into
        call = named(self.name, into, returns_args=slice(len(self.in_sigs), None))
        call.in_place = () if self.moved else self._captured[0].src.in_place  # see write_outputs_in_place
        return call

    def _bound_into(self):
        """`into` for the common case, bound once at load time: the captured variant and launch
        config; every checked input in the captured layout and 16-byte aligned (the outputs and the
        other inputs are buffers of the wrapper or of the graph's kernels, so aligned); the kernel
        compiled (from the second call on); no launch hook; the kernel's device current.  Then a
        call is the checks and the compiled kernel's launch (about 1 us of Python); anything else
        goes through `into`."""
        n, index, single, slow = len(self.in_sigs), self.device.index, len(self.out_sigs) == 1, self.into
        checks = [(i, self.in_sigs[i].shape, self.in_sigs[i].stride, self.in_sigs[i].dtype) for i in self.checked]
        launcher = self._captured[0].launcher(self._plan, "cuda", self.reduction)
        grid, constexprs = self._plan.programs, launcher.constexprs

        def into(*args):
            compiled = launcher.aligned
            if compiled is None or (not _ONE_GPU and _current_device() != index) or not _no_launch_hooks():
                return slow(*args)
            for i, shape, stride, dtype in checks:
                t = args[i]
                if t.stride() != stride or t.shape != shape or t.dtype != dtype or t.data_ptr() % 16:
                    return slow(*args)
            run_compiled(compiled, grid, index, args, constexprs)
            return args[n] if single else args[n:]
        return into

    def extra_repr(self) -> str:
        sizes = f", sizes {', '.join(map(str, self.symbols))}" if self.symbols else ""
        return f"{self.name}: {self.region.kind}, {len(self.region.nodes)} ops{sizes}"


def named(name: str, fn, returns_args: slice = slice(0, 0)):
    """`fn` as the rewritten graph calls it: a plain function (no module machinery on the launch
    path) named for the kernel, so that the printed program reads `kernels_fused_3(...)`.
    `returns_args`: the arguments it returns (output buffers it was given); the rest is new memory.
    A Python function is renamed (a copy of it: no extra frame per call); a builtin is wrapped."""
    if isinstance(fn, types.FunctionType):
        call = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    else:
        def call(*args):
            return fn(*args)
    call.__name__ = call.__qualname__ = name
    call.__module__ = "kernels"
    call.returns_args = returns_args
    return call


def _shape_function(symbols, in_sigs, out_sigs, space):
    """A host function of the size symbols' values: the inputs' shapes and strides, the outputs',
    and the rows and row length of the iteration space (Python source, compiled once)."""
    def tup(es):
        return "(" + "".join(f"{ix.pyexpr(e)}, " for e in es) + ")"

    def sigs(items, attr):
        return "(" + "".join(f"{tup(getattr(s, attr))}, " for s in items) + ")"

    body = (f"({sigs(in_sigs, 'shape')}, {sigs(in_sigs, 'stride')}, {sigs(out_sigs, 'shape')}, "
            f"{sigs(out_sigs, 'stride')}, {ix.pyexpr(space.rows)}, {ix.pyexpr(space.r)})")
    src = f"def shapes_at({', '.join(map(str, symbols))}):\n    return {body}\n"
    scope: dict = {}
    exec(compile(src, "<fuser sizes>", "exec"), scope)  # noqa: S102 - our own printed arithmetic
    return scope["shapes_at"]


class AttentionKernel(torch.nn.Module):
    """A recognised attention as one flash-attention launch: the N x N scores never reach HBM.  The
    kernel takes batch, heads and both sequence lengths at run time; only the head dim is built in.
    `prepare(q, k, v, extras)` (from codegen) allocates the output and gives the launch's grid,
    arguments and meta-parameters."""

    symbols = ()

    def __init__(self, name: str, source: str, prepare, in_shapes, in_dtypes, out_dtype, describe: str):
        super().__init__()
        self.name, self.source, self.prepare = name, source, prepare
        self.in_shapes, self.in_dtypes, self.out_dtype, self.describe = in_shapes, in_dtypes, out_dtype, describe

    def forward(self, q, k, v, *extras):
        for i, (t, want, dt) in enumerate(zip((q, k, v, *extras), self.in_shapes, self.in_dtypes)):
            if t.dim() != len(want) or t.dtype != dt or any(
                    w.is_Integer and g != int(w) for g, w in zip(t.shape, want)):
                raise RuntimeError(f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, made for "
                                   f"{want} {dt}; recapture for new shapes")
        out, _ = run_attention(self.source, self.prepare, q, k, v, extras)
        return (out if out.dtype == self.out_dtype else out.to(self.out_dtype),)

    def __call__(self, *inputs):  # straight to forward: no hook machinery on the launch path
        return self.forward(*inputs)

    def buffers(self):
        return None  # allocated by `prepare`, per call

    def entry(self):
        return named(self.name, self.forward)

    def extra_repr(self) -> str:
        return f"{self.name}: attention, {self.describe}"


class Recent(collections.OrderedDict):
    """The last few entries put (the oldest dropped first)."""

    def __init__(self, kept: int):
        super().__init__()
        self.kept = kept

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.kept:
            self.popitem(last=False)


_LISTS = Recent(4)  # tile lists (small int32 tensors; no mask, no memory of one held): a step's few
# launch_sequence's: a caller's key -> (device index, [(compiled kernel, constexprs)] in launch order); sizes
# that vary (a batch's length) each take one, the oldest dropped
_sequences = Recent(BOUND_SIZES)


def lists_cache(q: torch.Tensor):
    """Where a data mask's tile lists are kept (codegen.attention._extra_args) for the attentions that read the
    same mask after (a model's layers, a step's backward); none under CUDA-graph capture (lists made outside a
    graph would be replayed over masks written into the same addresses).  Keyed by the mask's memory and version,
    or by the versions of the buffers it is made from (codegen.sdpa.RunTimeCheck.same_value), so a write that does
    not bump them (through `.data`, DLPack, a kernel of the user's) is not seen: as torch's own checks of saved
    tensors."""
    return None if q.is_cuda and torch.cuda.is_current_stream_capturing() else _LISTS


def run_attention(source: str, prepare, q, k, v, extras=(), **kwargs):
    """Launch the attention kernel `attention_fwd` in `source` as `prepare` says (after the launches it
    asks for first: a data mask's tile lists); returns (out, lse)."""
    out, lse, grid, args, meta, first = prepare(q, k, v, extras, **kwargs)
    run_kernels(first, q.device.type)
    launch(source, "attention_fwd", grid, args, meta, q.device.type)
    return out, lse


def run_kernels(launches, device_type: str):
    """Launch, in order, `launches`: (source, kernel name, grid, args, meta) each (a `prepare`'s)."""
    for source, name, grid, args, meta_args in launches:
        launch(source, name, grid, args, meta_args, device_type)


# ---------------------------------------------------------------------------------------- the wrapper
def allocator(device: torch.device):
    """empty_strided for one device, named for the printed program; on the current CUDA device and
    on CPU through the bindings Inductor's generated code calls (a microsecond less per buffer)."""
    if device.type == "cuda":
        raw, index = torch._C._dynamo.guards._empty_strided_cuda, device.index

        def alloc(size, stride, dtype):
            if _ONE_GPU or _current_device() == index:
                return raw(size, stride, dtype)
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
    elif device.type == "cpu":
        alloc = torch._C._dynamo.guards._empty_strided_cpu
    else:
        def alloc(size, stride, dtype):
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
    alloc = named(f"empty_strided_{device.type}", alloc)
    alloc.allocates = True  # a buffer of the wrapper's own (write_over_donated finds them so)
    return alloc


_MULTI_VIEWS = {torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.unbind.int,
                torch.ops.aten.chunk.default, torch.ops.aten.tensor_split.sections}
# as Inductor's generated code calls it: a view of the base's storage at an offset from the base's
reinterpret = named("reinterpret", torch._C._dynamo.guards._reinterpret_tensor, returns_args=slice(0, 1))


# ATen overloads the wrapper calls through torch's public bindings: the same kernel, its arguments
# parsed in C++ (OpOverload.__call__ adds a Python frame and pybind's schema matching: aten.mm.default
# takes 2.7 us of host time against torch.mm's 1.6 on this project's CPU).  Each binding takes the
# overload's arguments as AOT's graphs pass them (tensors positionally, options by keyword under the same
# names: a binding names the first tensor `input`, not `self`) and resolves to this overload for them; the
# table holds the ops that stay eager in most graphs (matmuls, gathers, SDPA, copies, and the GELU alone
# between two matmuls, which fuses with neither: bert's and ViT's, 4 a step).
# Not index_put: its binding refuses the None of an index list (`cache[:, :, pos] = k`).
_BINDINGS = {
    aten.mm.default: torch.mm, aten.addmm.default: torch.addmm, aten.bmm.default: torch.bmm,
    aten._addmm_activation.default: torch._addmm_activation,
    aten.baddbmm.default: torch.baddbmm, aten.convolution.default: torch.convolution,
    aten.embedding.default: torch.embedding, aten.index_select.default: torch.index_select,
    aten.gather.default: torch.gather, aten.cat.default: torch.cat, aten.gelu.default: torch._C._nn.gelu,
    aten.clone.default: torch.clone, aten.copy_.default: torch.Tensor.copy_,
    # views fast_views left (over symbolic sizes: graphs of fuse(dynamic=True), or after a recompile)
    aten.view.default: torch.Tensor.view, aten.reshape.default: torch.reshape, aten.permute.default: torch.permute,
    aten.expand.default: torch.Tensor.expand, aten.unsqueeze.default: torch.unsqueeze,
    aten.squeeze.dim: torch.squeeze, aten.transpose.int: torch.transpose, aten.t.default: torch.t,
    aten.select.int: torch.select, aten.split_with_sizes.default: torch.split_with_sizes,
    aten.sum.dim_IntList: torch.sum,
    aten.scaled_dot_product_attention.default: torch._C._nn.scaled_dot_product_attention,
    aten._scaled_dot_product_efficient_attention.default: torch._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention.default: torch._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention.default: torch._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_for_cpu.default: torch._scaled_dot_product_flash_attention_for_cpu,
}


def call_directly(op) -> None:
    """fuser's own custom op `op` (a torch.library CustomOpDef), called by the wrapper as its Python function,
    past the dispatcher and its aliasing check (our ops return new tensors): the graphs that hold these ops
    are AOT Autograd's, run with gradients off, so the op's autograd glue has nothing to do there."""
    _BINDINGS[op._opoverload] = op._init_fn


OVERLOAD = "fuser_overload"  # node meta: the ATen overload a binding calls (its schema, for the passes after)


def fast_calls(graph) -> int:
    """Eager ops of the wrapper called through their public bindings (above), or through the function an
    op-family module gave the node (graph.OWN_CALL); returns how many.  The last pass on a graph but for
    write_over_donated, which reads a binding's overload from the node's meta (OVERLOAD)."""
    done = 0
    for n in graph.nodes:
        if n.op == "call_function" and (call := n.meta.get(OWN_CALL) or _BINDINGS.get(n.target)) is not None:
            if call is _BINDINGS.get(n.target):
                n.meta[OVERLOAD] = n.target
            n.target = call
            done += 1
    return done


def _overload(n):
    return n.meta.get(OVERLOAD, n.target)


def fast_views(graph, exact: set) -> int:
    """Views over static layouts (view, permute, expand, slice, a split's pieces...) become one
    reinterpretation of the tensor they start from, as in Inductor's generated code: a call through
    the dispatcher costs about 5 us of host time, a reinterpretation about 1, and a chain of views
    (split -> view -> permute) collapses into one.  A chain starting from a tensor whose layout is
    known (`exact`: our kernels' buffers, folded constants) is reinterpreted outright; one starting
    from an input or an eager op's result first checks that it has the shape and strides it was
    traced with, and otherwise runs the chain's ops as written (`view_chain`).  as_strided is left
    alone (its offset is absolute).  Returns the number of views rewritten."""
    chains: dict = {}  # a rewritten node -> (the tensor its chain starts from, the chain's steps)
    done = 0
    for n in list(graph.nodes):
        site = _view_site(n)
        if site is None:
            continue
        base, step = site
        root, steps = chains.get(base, (base, ()))
        steps = (*steps, step)
        v, r = n.meta["val"], root.meta["val"]
        layout = (tuple(v.shape), v.stride(), v.storage_offset() - r.storage_offset())
        back = root in exact and layout == (tuple(r.shape), r.stride(), 0) or _identity(steps, tuple(r.shape))
        if back and not any(u.op == "output" for u in n.users):
            n.replace_all_uses_with(root)  # views that come back to the root's layout (a permute and its
            graph.erase_node(n)  # inverse, in backward graphs: a weight's W.t().t()): the root itself, no call
            done += 1
            continue
        with graph.inserting_before(n):
            if root in exact:
                new = graph.call_function(reinterpret, (root, *layout))
            else:
                new = graph.call_function(view_chain, (root, *layout, tuple(r.shape), r.stride(), *steps))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        chains[new] = (root, steps)
        done += 1
    graph.eliminate_dead_code()
    return done


_PERMUTES = {"aten.permute.default", "aten.transpose.int", "aten.t.default"}
_SAME_SIZE = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}


def _identity(steps, shape: tuple) -> bool:
    """Whether a chain of views gives its root back whatever the root's strides: permutes (transposes) that
    compose to none, aliases, views to the size the tensor has.  Such a chain needs no layout check."""
    order = list(range(len(shape)))  # the root's dim each dim of the current view is
    for name, args, _, index in steps:
        if index is not None:
            return False
        if name == "aten.alias.default":
            continue
        if name in _SAME_SIZE:
            if tuple(args[0]) != tuple(shape[d] for d in order):
                return False
            continue
        if name not in _PERMUTES:
            return False
        rank = len(order)
        if rank < 2 and name != "aten.permute.default":
            continue  # t() and transpose of a 0-d or 1-d tensor give it back
        if name == "aten.permute.default":
            dims = [d % rank for d in args[0]]
        else:
            a, b = (0, 1) if name == "aten.t.default" else (args[0] % rank, args[1] % rank)
            dims = list(range(rank))
            dims[a], dims[b] = dims[b], dims[a]
        order = [order[d] for d in dims]
    return order == list(range(len(shape)))


def _view_site(n):
    """(base, step) when `n` is a view of a tensor over static sizes with its base's dtype, else None;
    the step is view_step's."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0].target in _MULTI_VIEWS:
        whole = n.args[0]
        base, step = whole.args[0], view_step(whole.target, whole.args[1:], whole.kwargs, n.args[1])
    elif isinstance(n.target, torch._ops.OpOverload) and (n.target.is_view or n.target is torch.ops.aten._unsafe_view.default) \
            and n.target not in _MULTI_VIEWS and "as_strided" not in n.target.__name__:
        base, step = n.args[0], view_step(n.target, n.args[1:], n.kwargs, None)
    else:
        return None
    if not isinstance(base, torch.fx.Node):
        return None
    v, b = n.meta.get("val"), base.meta.get("val")
    if not (isinstance(v, torch.Tensor) and isinstance(b, torch.Tensor)) or v.dtype != b.dtype or v.layout != torch.strided \
            or b.layout != torch.strided or not all(_static(t) for t in (v, b)):
        return None
    if StorageWeakRef(v.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return None  # a reshape (or flatten) that copied where it was traced: not a view of base
    if any(t.is_conj() or t.is_neg() for t in (v, b)):
        return None  # conj() and _neg_view are views by a bit the reinterpretation would drop
    return base, step


def _static(t) -> bool:
    return all(isinstance(x, int) for x in (*t.shape, *t.stride(), t.storage_offset()))


def view_step(op, args, kwargs, index) -> tuple:
    """One view of a chain as the program prints it: ("aten.permute.default", args, kwargs as
    pairs, the piece taken or None), constants only (names, numbers, tuples), so that Python builds
    the chain once, when it compiles the program, and not on every call."""
    return (f"{op.namespace}.{op.__name__}", _frozen(tuple(args)), _frozen(tuple(sorted(kwargs.items()))), index)


def _frozen(x):
    return tuple(map(_frozen, x)) if isinstance(x, (list, tuple)) else x


@functools.cache
def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _view_chain(root, size, stride, offset, root_size, root_stride, *steps):
    """A chain of views of `root`: if root has the traced layout, one reinterpretation; else the ops."""
    if root.stride() == root_stride and root.shape == root_size:
        return torch._C._dynamo.guards._reinterpret_tensor(root, size, stride, offset)
    t = root
    for name, args, kwargs, index in steps:
        t = _op(name)(t, *args, **dict(kwargs))
        t = t if index is None else t[index]
    return t


view_chain = named("view_chain", _view_chain, returns_args=slice(0, 1))


def _lifetimes(nodes: list, owners: set, resolve=lambda m: m):
    """Memory lifetimes over the program's order: the owners (buffer allocations, new tensors) each
    node may share memory with (`members`, through views and our kernels' returned buffers, each
    owner passed through `resolve`), the position of each owner's last reader and the owners a
    graph output holds.  Returns (positions, members, last, forever)."""
    pos = {n: i for i, n in enumerate(nodes)}
    group: dict = {}

    def members(n):
        return frozenset(resolve(m) for m in group.get(n, ())) if isinstance(n, torch.fx.Node) else frozenset()

    for n in nodes:
        if n in owners:
            group[n] = frozenset([n])
        elif n.op == "call_function":
            group[n] = aliased(n, members)
    last, forever = {}, set()
    for n in nodes:
        for a in n.all_input_nodes:
            for b in group.get(a, ()):
                if n.op == "output":
                    forever.add(b)
                last[b] = max(last.get(b, -1), pos[n])
    return pos, members, last, forever


def write_outputs_in_place(graph, allocations: set, donated: set = frozenset()) -> list[str]:
    """A kernel's output written over one of its inputs where the kernel allows it (`in_place` of its
    entry: the same layout, each element read before it is written, by the program that writes it)
    and nothing reads that input's memory afterwards: the output's buffer allocation is dropped, so
    the peak holds one of the two (the scores and the probabilities of a softmax after an eager bmm;
    a GELU after a matmul).  The input's memory must be the graph's own: one of the wrapper's
    buffers, the new tensor of an eager op (its schema returns no alias), or a `donated` input
    (write_over_donated), not another input or a graph output, and no other argument of the kernel
    may share it.  An eager op's result or a donated input is taken through `take_in_place`, which
    checks at run time that it has the layout the kernel writes (else a new buffer).  Returns the
    kernel calls that write in place."""
    nodes = list(graph.nodes)
    redirect: dict = {}  # an output allocation dropped -> the owner whose memory the output took
    owners = set(allocations) | set(donated) | {n for n in nodes if new_tensor(n)}
    pos, members, last, forever = _lifetimes(nodes, owners, lambda m: redirect.get(m, m))

    def dies_here(a, k, at: int):
        """The one owner of a's memory, when nothing reads it after k and no other argument of k shares it."""
        own = members(a)
        if len(own) != 1:
            return None
        (o,) = own
        if o in forever or last.get(o) != pos[k] or any(
                o in members(x) for x in (*k.args[:at], *k.args[at + 1:]) if isinstance(x, torch.fx.Node)):
            return None
        return o

    done = []
    for k in nodes:
        op = _in_place_op(k)
        if op is not None:  # an eager pointwise op (a GELU left alone after a matmul): its in-place form
            a, v = k.args[0], k.meta.get("val")
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and (o := dies_here(a, k, 0)) \
                    and (a.meta["val"].shape, a.meta["val"].stride(), a.meta["val"].dtype) == (v.shape, v.stride(), v.dtype):
                k.target = op
                k.meta.pop(OVERLOAD, None)
                redirect[k], last[o] = o, last.get(k, pos[k])
                if k in forever:
                    forever.add(o)
                done.append(k.name)
            continue
        pairs = getattr(k.target, "in_place", ()) if k.op == "call_function" else ()
        used = set()
        for i, j in pairs:
            start = k.target.returns_args.start
            n, a = k.args[start + j], k.args[i]
            if n not in allocations or len(n.users) != 1 or i in used or not isinstance(a, torch.fx.Node):
                continue
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or not _static(v) or v.storage_offset() != 0:
                continue
            o = dies_here(a, k, i)
            if o is None:
                continue
            layout = (tuple(v.shape), v.stride())
            if o not in allocations:  # an eager op's result: its layout checked when the call runs
                with graph.inserting_before(k):
                    a = graph.call_function(take_in_place, (a, *n.args, *layout))
                a.meta = dict(n.meta)
            elif layout != tuple(n.args[:2]):  # the output's layout over the input's memory
                with graph.inserting_before(k):
                    a = graph.call_function(reinterpret, (a, *n.args[:2], 0))
                a.meta = dict(n.meta)
            n.replace_all_uses_with(a)
            graph.erase_node(n)
            redirect[n] = o
            last[o] = last.get(n, pos[k])
            if n in forever:
                forever.add(o)
            used.add(i)
            done.append(k.name)
    return done


def write_over_donated(graph, donated: set) -> list[str]:
    """write_outputs_in_place again, over a backward graph whose `donated` inputs are AOT Autograd's
    donated buffers: saved activations that no forward input or output aliases, which AOT hands the
    backward to use up (it then refuses `retain_graph=True`, as for Inductor's backward, which
    writes over them too).  A kernel or an eager pointwise op whose input is one of them, read
    there for the last time, writes its output over it (the loss op's grad_weight times the loss's
    gradient: one [V, D] tensor, not two).  Only for a backward run in the boxed convention, which
    owns its inputs (backend.ReleasingRunner).  AOT checks a donated activation against the forward's
    inputs and outputs, not against the other saved activations: one that shares its storage with
    another input (two views of one tensor) is left alone, and so is one that is part of a larger
    storage (a gradient written there would keep all of it alive).  Returns the calls that write over an
    input now."""
    def storage(n):
        v = n.meta.get("val")
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) and v.layout == torch.strided else None

    def whole(n):  # the tensor is all of its storage: an output written there frees no less than it
        v = n.meta["val"]
        return v.untyped_storage().nbytes() == v.numel() * v.element_size()

    shared = collections.Counter(storage(n) for n in graph.nodes if n.op == "placeholder")
    donated = {n for n in donated if storage(n) is not None and shared[storage(n)] == 1 and whole(n)}
    allocations = {n for n in graph.nodes if getattr(n.target, "allocates", False)}
    return write_outputs_in_place(graph, allocations, donated)


def new_tensor(n) -> bool:
    """An eager op whose result is a new tensor (its schema returns no alias)."""
    schema = getattr(_overload(n), "_schema", None) if n.op == "call_function" else None
    return schema is not None and _overload(n) is not torch.ops.aten._unsafe_view.default and len(schema.returns) == 1 \
        and schema.returns[0].alias_info is None and isinstance(n.meta.get("val"), torch.Tensor)


def _in_place_op(n):
    """The in-place overload of an eager pointwise op (aten.gelu_.default for aten.gelu.default)."""
    target = _overload(n) if n.op == "call_function" else None
    if not isinstance(target, torch._ops.OpOverload) or \
            torch.Tag.pointwise not in target.tags or target._schema.is_mutable or not new_tensor(n):
        return None
    packet = getattr(torch.ops.aten, target.__name__.split(".")[0] + "_", None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _take_in_place(t, size, stride, dtype, t_size, t_stride):
    """t's memory, to be written over in the layout (size, stride), where t has the layout the kernel
    was made for (t_size, t_stride); else a new buffer."""
    if t.dtype == dtype and t.stride() == t_stride and t.shape == t_size and t.storage_offset() == 0:
        return t if (t_size, t_stride) == (size, stride) else torch._C._dynamo.guards._reinterpret_tensor(t, size, stride, 0)
    return torch.empty_strided(size, stride, dtype=dtype, device=t.device)


take_in_place = named("take_in_place", _take_in_place, returns_args=slice(0, 1))


def reuse_buffers(graph, allocations: set) -> int:
    """Lets a buffer allocation (a node in `allocations`, args (size, stride, dtype)) take over an
    earlier buffer of the same size, stride and dtype that nothing reads any more: no later node
    uses it or a view of it, and it is not (a view of) a graph output.  Views are read from the ops'
    schemas (a return with alias info); a call whose aliasing is unknown is taken to alias all its
    arguments.  Returns the number of allocations saved."""
    nodes = list(graph.nodes)
    pos, _, last, forever = _lifetimes(nodes, allocations)
    free: dict = {}  # (size, stride, dtype) -> [(buffer, free after position)]
    saved = 0
    for n in nodes:
        if n not in allocations:
            continue
        key = tuple(n.args)
        pool = free.setdefault(key, [])
        taken = next((i for i, (b, end) in enumerate(pool) if end < pos[n]), None)
        if taken is not None:
            buffer, _ = pool.pop(taken)
            n.replace_all_uses_with(buffer)
            last[buffer] = last.get(n, pos[n])
            if n in forever:
                forever.add(buffer)
            graph.erase_node(n)
            saved += 1
            n = buffer
        if n not in forever:
            pool.append((n, last.get(n, pos[n])))
    return saved


# functional overwrites of some elements of a tensor -> their in-place forms
_IN_PLACE = {aten.index_put.default: aten.index_put_.default, aten.index_copy.default: aten.index_copy_.default,
             aten.scatter.src: aten.scatter_.src, aten.scatter.value: aten.scatter_.value}


def write_inputs_in_place(graph) -> list[str]:
    """An input the graph mutates (AOT Autograd ends the graph with `copy_(input, new)`, e.g. a KV
    cache written with index_put) is written in place where `new` overwrites some of its elements
    (index_put without accumulation, index_copy, scatter): the functional op would copy the whole
    input first and the copy_ write it all back, two passes over a cache per layer in a decode step
    for one new row.  Taken only where nothing reads the input (or a view of it) after the op, in
    the graph's final order, and the indices and values do not depend on the input (so a call
    replayed after a failure writes the same).  An eager pointwise op on the input and numbers (or
    sizes) that only the copy_ reads (HF's StaticCache advancing its length, `length.add_(1)`: an add,
    then a copy, a layer of a decode step, run 159) runs in place where the copy_ was: last, so the
    input keeps its value for every read before it and a call that fails earlier leaves it unchanged.
    torch.fx.passes.reinplace leaves graph inputs alone (its own TODO) and Inductor's pass belongs to
    its lowering, hence this.  Returns the names of the copy_ nodes removed."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    done = []

    def drop(c, dst):  # the copy back: dst holds the new value already
        c.replace_all_uses_with(dst)
        done.append(c.name)
        graph.erase_node(c)

    for c in nodes:
        if c.target is not aten.copy_.default or not isinstance(c.args[1], torch.fx.Node):
            continue
        dst, new = c.args[:2]
        if dst.op == "placeholder" and _returned_input(new) is dst:  # our kernel stored into dst in place
            drop(c, dst)
            continue
        if dst.op != "placeholder" or not new.args or new.args[0] is not dst or not _same_layout(meta(new), meta(dst)) \
                or _reads(new, dst) or any(u.op == "output" for u in new.users):  # returned: a tensor of its own
            continue
        pointwise = updated_in_place(new)
        if pointwise is not None:
            c.prepend(new)  # where the copy_ was: after every read of the input
            new.target = pointwise
            drop(c, dst)
            continue
        if new.target not in _IN_PLACE or ops.accumulates(new):
            continue
        views = {dst}
        for n in nodes[pos[dst] + 1:]:
            if n.op == "call_function" and n is not new and aliased(n, lambda a: {a} & views):
                views.add(n)
        if any(pos[u] > pos[new] for v in views for u in v.users if u not in (new, c)):
            continue  # read after the write: the functional op's copy is needed
        new.target = _IN_PLACE[new.target]
        drop(c, dst)
    return done


def written_into(unit, o):
    """The graph input a unit's output `o` is stored into in place (an index_put, ops.Scatter: the wrapper
    hands the input over as the output's buffer), or None."""
    cg = getattr(unit, "cg", None)
    return o.args[0] if cg is not None and isinstance(cg.info.get(o), ops.Scatter) else None


def _returned_input(new):
    """The argument a call of our kernels returns as `new` (its output buffer), or None."""
    call, j = (new.args[0], new.args[1]) if new.target is operator.getitem else (new, 0)
    given = getattr(call.target, "returns_args", None) if call.op == "call_function" else None
    if given is None:
        return None
    returned = range(len(call.args))[given]  # an empty slice (a kernel over symbolic sizes): it returns new memory
    return call.args[returned[j]] if j < len(returned) else None


def updated_in_place(new):
    """The in-place op that writes `new`, a mutated input's new value, into the input itself (see
    write_inputs_in_place), or None: an eager pointwise op on the input whose other operands are
    numbers or sizes (moved last, it reads no tensor that a write in place before it changed) and
    that only the copy_ back reads.  The partitioner leaves such an op to eager: in a kernel that
    reads the input at other elements too, it could not be written in place (programs run in no
    order), and a copy back would cost a launch more."""
    users = list(new.users)
    if len(users) != 1 or users[0].target is not aten.copy_.default or users[0].args[1] is not new \
            or new.target in _IN_PLACE:
        return None
    dst = users[0].args[0]
    if dst.op != "placeholder" or not new.args or new.args[0] is not dst or not _same_layout(meta(new), meta(dst)):
        return None
    numbers = all(not isinstance(a, torch.fx.Node) or is_size(a) for a in (*new.args[1:], *new.kwargs.values()))
    return _in_place_op(new) if numbers else None


# in-place pointwise ops on a number -> the foreach op that runs a list of them as one launch
_FOREACH = {aten.add_.Tensor: torch._foreach_add_, aten.add_.Scalar: torch._foreach_add_,
            aten.mul_.Tensor: torch._foreach_mul_, aten.mul_.Scalar: torch._foreach_mul_,
            aten.sub_.Tensor: torch._foreach_sub_, aten.sub_.Scalar: torch._foreach_sub_}
# not div_: eager's CUDA kernel multiplies by the number's reciprocal, the foreach one divides (an ulp apart)


def batch_in_place(graph) -> list[str]:
    """Runs of the in-place updates write_inputs_in_place made, back to back where the copies were (a
    decode step's `length.add_(1)` of every layer's cache: one launch each), as one foreach call
    (`torch._foreach_add_(tensors, numbers)`: one multi-tensor kernel per device and dtype).  Only ops
    whose other operand is a number (no alpha), on distinct tensors, whose results nothing reads.
    Returns the names of the ops batched."""
    done, run = [], []

    def flush():
        if len(run) > 1:
            with graph.inserting_before(run[0]):
                graph.call_function(_FOREACH[run[0].target], ([n.args[0] for n in run], [n.args[1] for n in run]))
            done.extend(n.name for n in run)
            for n in run:
                graph.erase_node(n)
        run.clear()

    for n in list(graph.nodes):
        ok = n.op == "call_function" and n.target in _FOREACH and len(n.args) == 2 and not n.kwargs \
            and isinstance(n.args[1], (int, float)) and not isinstance(n.args[1], bool) and not n.users \
            and isinstance(n.args[0], torch.fx.Node)
        if run and not (ok and _FOREACH[n.target] is _FOREACH[run[0].target]
                        and all(m.args[0] is not n.args[0] for m in run)):
            flush()
        if ok:
            run.append(n)
    flush()
    return done


def _same_layout(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
        and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()


def _reads(n, dst) -> bool:
    """Do n's arguments other than the first depend on dst?"""
    return computed_from([a for a in n.all_input_nodes if a is not n.args[0]], dst)


def aliased(n, members) -> frozenset:
    """The buffers a call's result may share memory with."""
    target = n.target
    schema = getattr(_overload(n), "_schema", None)
    if target is operator.getitem:
        args = n.args[:1]
    elif hasattr(target, "returns_args"):  # our kernels (named)
        args = n.args[target.returns_args]
    elif target is torch.ops.aten._unsafe_view.default:  # a view, though its schema says a new tensor
        args = n.args[:1]
    elif schema is not None:
        if not any(r.alias_info is not None for r in schema.returns):
            return frozenset()  # a new tensor
        args = [a for r, a in zip(schema.arguments, n.args) if r.alias_info is not None]
    else:
        args = n.all_input_nodes
    out = frozenset()
    for a in args:
        out |= members(a) if isinstance(a, torch.fx.Node) else frozenset()
    return out


# ---------------------------------------------------------------------------------------- CUDA graphs
CUDA_GRAPH_SIZES = 8  # distinct size keys a graph records CUDA graphs for; calls at sizes past these run plainly


def static_inputs(gm, n_dynamo_inputs: int, n_inputs: int, backward: bool) -> list:
    """Inputs whose address is fixed from call to call (parameters, buffers; in a backward, what the
    forward saved): CUDA-graph replay reads them in place instead of copying them in.  As Inductor's
    get_static_input_idxs (inlined: importing compile_fx for five lines costs seconds): AOT Autograd's
    own indices, which follow its tokens, subclasses and synthetic bases (pregrad.claim keeps the marks
    they are read from)."""
    if backward:
        return list(range(count_tangents(gm)))
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        return list(context.fw_metadata.static_input_indices)
    return list(range(num_fw_fixed_arguments(n_dynamo_inputs, n_inputs)))


def cuda_graph_refusal(gm, static: list) -> str | None:
    """Why the graph `gm` (as given, before our rewrite) cannot be replayed as a CUDA graph, or None:
    CPU tensors or several devices, an input other than a parameter mutated in place, an op whose
    result decides sizes (data-dependent) or that CUDA graphs cannot hold (torch's own checks)."""
    devices = get_device_node_mapping(gm)
    if not devices or all(d.type == "cpu" for d in devices):
        return "the graph runs on CPU, where CUDA graphs do not apply (the option has no effect)"
    if reason := check_multiple_devices_or_any_cpu_nodes(devices):
        return reason
    if find_input_mutations(gm.graph) - set(static):
        return "an input other than a parameter or buffer is mutated in place"
    if node := get_first_incompatible_cudagraph_node(gm):
        return f"{node.name} ({node.target}) cannot be held in a CUDA graph"
    return None


class CudaGraphs:
    """Replays a compiled graph (boxed: called with a list of inputs) as CUDA graphs through torch's
    cudagraph trees (torch._inductor.cudagraph_trees, as `mode="reduce-overhead"` does for Inductor):
    the first call at a size runs it plainly (warm-up: Triton compiles our kernels), the next records
    it, later ones replay it.  Trees copy inputs whose address changes into the graph's own buffers,
    keep parameters and buffers in place (re-recording if one moves), and share one memory pool
    between forward and backward.  One CUDA graph per distinct set of int inputs (sizes), up to
    CUDA_GRAPH_SIZES of them; calls at other sizes run plainly, and the report says so.

    Outputs live in the pool and the next replay writes over them (trees then refuse access to an
    output still held).  An inference graph returns aliases of its outputs, and before each call
    gives any alias the caller still holds (a list of results, a KV cache) a copy of its values:
    nothing is copied unless an output is kept.  In training, trees' rules hold: an output of a
    forward (the loss) is valid until the next step's forward, and reading it later raises trees'
    error, as with Inductor's reduce-overhead."""

    def __init__(self, fn, gm, static: list, *, backward: bool, inference: bool, note):
        self.fn, self.note, self.inference = fn, note, inference
        self.static = static
        self.device = next(iter(get_device_node_mapping(gm))).index
        self.trees_kwargs = dict(
            device_index=self.device, is_backward=backward, is_inference=inference,
            stack_traces=[None] * len(gm.graph.output_node().args[0]),
            placeholders=get_placeholder_info(gm.graph), mutated_input_idxs=find_input_mutations(gm.graph))
        self.graphs: dict = {}  # size key -> trees' replaying function
        self.varying: list | None = None  # positions of the inputs that are not static
        self.returned: list = []  # weak references to the aliases the previous call returned
        self._boxed_call = True

    def _model(self, inputs: list):  # trees' convention: the callee empties the list it is given
        args = list(inputs)
        inputs.clear()
        return self.fn(args)

    def _key(self, args) -> tuple:
        """The sizes of this call: its int inputs and the shapes of its tensors other than parameters
        (trees key on ints alone, and a size may reach the graph only through a tensor's shape)."""
        if self.varying is None:
            static = set(self.static)
            self.varying = [i for i in range(len(args)) if i not in static]
        return tuple(a if isinstance(a, int) else a.shape if isinstance(a, torch.Tensor) else None
                     for a in map(args.__getitem__, self.varying))

    def __call__(self, args: list):
        for ref in self.returned:
            held = ref()
            if held is not None:  # the caller kept it: its values move out of the pool before the replay
                held.data = held.clone(memory_format=torch.preserve_format)
        self.returned = []
        key = self._key(args)
        graphed = self.graphs.get(key)
        if graphed is None:
            if len(self.graphs) >= CUDA_GRAPH_SIZES:
                self.note(f"cuda_graphs: more than {CUDA_GRAPH_SIZES} sizes seen; calls at other sizes run "
                          "without CUDA graphs")
                return self.fn(args)
            # made at the first real call: trees read the ints of real inputs, not of fake ones
            graphed = self.graphs[key] = cudagraph_trees.cudagraphify_impl(
                self._model, list(args), self.static, **self.trees_kwargs)
        out = graphed(args)
        if not self.inference:
            return out
        out = [t.detach() if isinstance(t, torch.Tensor) else t for t in out]
        self.returned = [weakref.ref(t) for t in out if isinstance(t, torch.Tensor)]
        return out
