"""A region's kernel as an nn.Module: checks what it is given, picks the variant, allocates, launches.

Kernels over static sizes are specialised to them and to the captured strides (constants make the
index math cheap); a call with the captured shapes and dtypes but other strides gets a variant
generated for those strides; other shapes or dtypes are refused, never run on a kernel made for
something else.

Kernels over symbolic sizes (Dynamo marked a size dynamic) take the size symbols as int arguments,
passed by the rewritten graph after the tensors.  Each call evaluates the expected shapes and strides
from them and checks the inputs; the variant is chosen per call: rows in registers or looped (by the
row length), 32- or 64-bit offsets (by the largest offset), and, for an input whose strides are not
the captured expressions, a variant that takes that input's strides as arguments.
"""
from __future__ import annotations

import sympy
import torch

from fuser.codegen.attention import attention_source, flash_attention
from fuser.codegen.compile import Launcher, load
from fuser.dtypes import target
from fuser.codegen.kernel import KernelSource, TensorSig, generate
from fuser.codegen.score_mod import score_mod
from fuser.patterns.attention import causal_offset
from . import indexing as ix
from .cost import region_cost
from .graph import is_size, meta, shape
from .plan import block_plan
from .region import Region, persistent_at

WIDE = 2**31  # offsets from here on need 64-bit index math


class EagerCheckError(RuntimeError):
    """What eager raises on this input (an index out of range, an integer division by zero)."""


class NotForTheseSizes(Exception):
    """No kernel of this region serves the sizes of this call (a reduction over an empty row, which
    eager answers with an identity or an error): the graph runs as given for this call."""


class _Variant:
    """One generated kernel and its launchers, one per launch config."""

    def __init__(self, src: KernelSource, params: list):
        self.src, self.params = src, params  # params: how to get each size argument (see _size_args)
        self.fn = None
        self.launchers: dict = {}

    def launcher(self, plan, device_type: str, reduction: bool) -> Launcher:
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
            hit = self.launchers[key] = Launcher(self.fn, meta_args, device_type)
        return hit


class RegionKernel(torch.nn.Module):
    def __init__(self, region: Region, name: str, cost=None):
        super().__init__()
        self.region, self.name = region, name
        self.cost = cost if cost is not None else region_cost(region)
        self.sizes = region.cg.sizes
        self.in_sigs = tuple(TensorSig.of(meta(n)) for n in region.inputs)
        self.out_sigs = tuple(TensorSig.of(meta(n)) for n in region.outputs)
        self.device = meta(region.outputs[0]).device  # where a region with no tensor inputs runs
        self.device_type = self.device.type
        self.reduction = region.space.is_reduction
        self.symbols = self._symbols()
        self.seen: tuple = ()  # the size arguments of the latest call (the report's values)
        self.variants: dict = {}
        if self.symbols:
            self._shapes_at = _shape_function(self.symbols, self.in_sigs, self.out_sigs, region.space)
            hints = [self.sizes.hint(s) for s in self.symbols]
            *_, rows, r = self._shapes_at(*hints)
            # the variant for the captured layout at the hints: emitting it now also proves it can be
            self.source = self._dynamic((persistent_at(r) if self.reduction else True, False, ())).src.source
        else:
            self._captured = self._static(self.in_sigs)
            self.source = self._captured[0].src.source
            space = region.space
            self._rows, self._r = int(space.rows), int(space.r)
            self.empty = self._rows == 0 or (self.reduction and self._r == 0)
            self._plan = block_plan(self._rows, self._r if self.reduction else None, self.device_type)

    def _symbols(self) -> tuple:
        """The size symbols the shapes, strides and arguments of this region are written in."""
        found = set()
        for sig in (*self.in_sigs, *self.out_sigs):
            found |= ix.size_symbols(*sig.shape, *sig.stride)
        found |= ix.size_symbols(*self.region.space.full)
        for n in self.region.nodes:
            for a in n.all_input_nodes:
                if is_size(a):
                    found |= ix.size_symbols(a.meta["val"])
        return tuple(sorted(found, key=str))

    def _generate(self, in_sigs, out_sigs, persistent: bool, wide: bool) -> KernelSource:
        return generate(self.region, list(in_sigs), list(out_sigs), self.device_type, self.name,
                        persistent=persistent, wide=wide, cost=self.cost)

    # ------------------------------------------------------------------ static sizes
    def _static(self, sigs: tuple):
        """(variant, outputs' signatures) for these input signatures (ints)."""
        if sigs not in self.variants:
            outs = tuple(TensorSig(tuple(map(int, s.shape)), tuple(map(int, s.stride)), s.dtype) for s in self.out_sigs)
            wide = any(_max_offset(s.shape, s.stride) >= WIDE for s in (*sigs, *outs))
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
        """The variant (persistent, wide, inputs with generic strides) of the symbolic kernel."""
        hit = self.variants.get(key)
        if hit is None:
            persistent, wide, generic = key
            sigs = list(self.in_sigs)
            for i in generic:  # strides as arguments: in<i>_st<d>
                strides = tuple(sympy.Symbol(f"in{i}_st{d}", integer=True, nonnegative=True) for d in range(len(sigs[i].shape)))
                sigs[i] = TensorSig(sigs[i].shape, strides, sigs[i].dtype)
            src = self._generate(sigs, self.out_sigs, persistent, wide)
            where = {s: ("size", k) for k, s in enumerate(self.symbols)}
            params = [where.get(p) or ("stride", int(str(p)[2:].split("_")[0]), int(str(p).split("_st")[1]))
                      for p in src.params]
            hit = self.variants[key] = _Variant(src, params)
        return hit

    def seen_sizes(self) -> dict:
        return dict(zip(self.symbols, self.seen))

    def _run_dynamic(self, inputs, values, device):
        self.seen = values
        in_shapes, in_strides, out_shapes, out_strides, rows, r = self._shapes_at(*values)
        generic = []
        for i, (t, shp, st, sig) in enumerate(zip(inputs, in_shapes, in_strides, self.in_sigs)):
            if t.shape != shp or t.dtype != sig.dtype:
                raise RuntimeError(
                    f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, but the kernel was made for "
                    f"{sig.shape} {sig.dtype} = {shp} at these sizes; recapture (fuser.fuse) for new shapes or dtypes")
            if any(a != b for a, b, n in zip(t.stride(), st, shp) if n != 1):
                generic.append(i)
        outs = [torch.empty_strided(shp, st, dtype=s.dtype, device=device)
                for shp, st, s in zip(out_shapes, out_strides, self.out_sigs)]
        if rows == 0:
            return outs, None
        if self.reduction and r == 0:
            raise NotForTheseSizes(f"{self.name}: a reduction over 0 elements")
        wide = any(_max_offset(t.shape, t.stride()) >= WIDE for t in (*inputs, *outs))
        variant = self._dynamic((persistent_at(r) if self.reduction else True, wide, tuple(generic)))
        plan = block_plan(rows, r if self.reduction else None, self.device_type)
        sizes = [values[p[1]] if p[0] == "size" else inputs[p[1]].stride(p[2]) for p in variant.params]
        return outs, (variant, plan, sizes)

    # ------------------------------------------------------------------ launch
    def forward(self, *args):
        inputs = args[:len(self.in_sigs)]
        device = next((t.device for t in inputs if t.dim() > 0), self.device)
        if device.type != self.device_type:
            raise RuntimeError(f"{self.name}: made for {self.device_type} tensors, given {device.type} ones")
        if any(t.device != device for t in inputs):
            inputs = [t.to(device) for t in inputs]  # 0-d CPU scalars
        if self.symbols:
            outs, launch = self._run_dynamic(inputs, args[len(self.in_sigs):], device)
            if launch is None:
                return tuple(outs)
            variant, plan, sizes = launch
        else:
            if len(args) != len(self.in_sigs):
                raise TypeError(f"{self.name}: expected {len(self.in_sigs)} tensors, got {len(args)}")
            sigs = self._check(inputs)
            variant, out_sigs = self._captured if sigs is self.in_sigs else self._static(sigs)
            outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in out_sigs]
            if self.empty:
                return tuple(outs)
            plan, sizes = self._plan, []
        launcher = variant.launcher(plan, device.type, self.reduction)
        src = variant.src
        if src.checks:  # interpreted kernels flag what eager raises on (see KernelWriter._check)
            flags = torch.zeros(len(src.checks), dtype=torch.int32, device=device)
            launcher(plan.programs, *inputs, *outs, flags, *sizes)
            for message, bad in zip(src.checks, flags.tolist()):
                if bad:
                    raise EagerCheckError(f"{message} (in fuser kernel {self.name})")
        elif device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                launcher(plan.programs, *inputs, *outs, *sizes)
        else:
            launcher(plan.programs, *inputs, *outs, *sizes)
        return tuple(outs)

    def __call__(self, *inputs):  # straight to forward: no hook machinery on the launch path
        return self.forward(*inputs)

    def extra_repr(self) -> str:
        sizes = f", sizes {', '.join(map(str, self.symbols))}" if self.symbols else ""
        return f"{self.name}: {self.region.kind}, {len(self.region.nodes)} ops{sizes}"


def _max_offset(shape, stride) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(shape, stride)) + 1


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
    kernel takes batch, heads and both sequence lengths at run time; only the head dim is built in."""

    symbols = ()

    def __init__(self, att, cg, name: str):
        super().__init__()
        self.att, self.name = att, name
        with target(meta(att.q).device.type):
            self.mod = score_mod(att.scores, att.chain, att.extras, cg, causal_offset(att, cg))
            self.head_dim = int(shape(att.q)[-1])
            self.source = attention_source(self.mod, self.head_dim, meta(att.q).dtype)
        self.in_shapes = tuple(shape(n) for n in att.inputs)
        self.in_dtypes = tuple(meta(n).dtype for n in att.inputs)
        self.out_dtype = meta(att.out).dtype

    def forward(self, q, k, v, *extras):
        for i, (t, want, dt) in enumerate(zip((q, k, v, *extras), self.in_shapes, self.in_dtypes)):
            if t.dim() != len(want) or t.dtype != dt or any(
                    w.is_Integer and g != int(w) for g, w in zip(t.shape, want)):
                raise RuntimeError(f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, made for "
                                   f"{want} {dt}; recapture for new shapes")
        out = flash_attention(q, k, v, scale=1.0, mod=self.mod, extras=extras)
        return (out if out.dtype == self.out_dtype else out.to(self.out_dtype),)

    def extra_repr(self) -> str:
        return f"{self.name}: attention, score mod: " + "; ".join(self.mod.lines)
