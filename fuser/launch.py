"""A region's kernel as an nn.Module: checks what it is given, picks the variant, allocates, launches.

Kernels are specialised to sizes and strides (constants make the index math cheap).  A call with the
captured shapes and dtypes but other strides gets a variant generated for those strides; a call with
other shapes or dtypes is refused, never run on a kernel made for something else.
"""
from __future__ import annotations

import torch

from fuser.codegen.attention import attention_source, flash_attention
from fuser.codegen.compile import Launcher, load, target
from fuser.codegen.kernel import KernelSource, TensorSig, generate
from fuser.codegen.score_mod import score_mod
from fuser.patterns.attention import causal_offset
from .graph import meta, shape
from .region import Region


class EagerCheckError(RuntimeError):
    """What eager raises on this input (an index out of range, an integer division by zero)."""


class RegionKernel(torch.nn.Module):
    def __init__(self, region: Region, name: str):
        super().__init__()
        self.region, self.name = region, name
        self.in_sigs = tuple(TensorSig.of(meta(n)) for n in region.inputs)
        self.out_sigs = tuple(TensorSig.of(meta(n)) for n in region.outputs)
        self.device = meta(region.outputs[0]).device  # where a region with no tensor inputs runs
        self.device_type = self.device.type
        self.variants: dict[tuple, tuple[KernelSource, object]] = {}
        self._captured = self._variant(self.in_sigs)  # emitting it now also proves it can be
        self.source = self._captured[0].source
        space = region.space
        self.empty = space.rows == 0 or (space.is_reduction and space.r == 0)

    def _variant(self, sigs: tuple):
        """(source, launcher) for these input signatures; the launcher is loaded on first launch."""
        if sigs not in self.variants:
            src = generate(self.region, list(sigs), list(self.out_sigs), self.device_type, self.name)
            meta_args = {"XBLOCK": src.plan.xblock}
            if self.region.space.is_reduction:
                meta_args["RBLOCK"] = src.plan.rblock
            if self.device_type != "cpu":
                meta_args["num_warps"] = src.plan.num_warps
            self.variants[sigs] = (src, meta_args)
        return self.variants[sigs]

    def _check(self, inputs) -> tuple:
        if len(inputs) != len(self.in_sigs):
            raise TypeError(f"{self.name}: expected {len(self.in_sigs)} tensors, got {len(inputs)}")
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

    def forward(self, *inputs):
        device = next((t.device for t in inputs if t.dim() > 0), self.device)
        if device.type != self.device_type:
            raise RuntimeError(f"{self.name}: made for {self.device_type} tensors, given {device.type} ones")
        if any(t.device != device for t in inputs):
            inputs = [t.to(device) for t in inputs]  # 0-d CPU scalars
        sigs = self._check(inputs)
        src, meta_args = self._captured if sigs is self.in_sigs else self._variant(sigs)
        outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in self.out_sigs]
        if not self.empty:
            if src.launcher is None:
                src.launcher = Launcher(load(src.source, src.name, device.type), src.grid, meta_args, device.type)
            if src.checks:  # interpreted kernels flag what eager raises on (see KernelWriter._check)
                flags = torch.zeros(len(src.checks), dtype=torch.int32, device=device)
                src.launcher(*inputs, *outs, flags)
                for message, bad in zip(src.checks, flags.tolist()):
                    if bad:
                        raise EagerCheckError(f"{message} (in fuser kernel {self.name})")
            elif device.type == "cuda" and device.index != torch.cuda.current_device():
                with torch.cuda.device(device):
                    src.launcher(*inputs, *outs)
            else:
                src.launcher(*inputs, *outs)
        return tuple(outs)

    def __call__(self, *inputs):  # straight to forward: no hook machinery on the launch path
        return self.forward(*inputs)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.region.kind}, {len(self.region.nodes)} ops"


class AttentionKernel(torch.nn.Module):
    """A recognised attention as one flash-attention launch: the N x N scores never reach HBM."""

    def __init__(self, att, cg, name: str):
        super().__init__()
        self.att, self.name = att, name
        with target(meta(att.q).device.type):
            self.mod = score_mod(att.scores, att.chain, att.extras, cg, causal_offset(att, cg))
            self.source = attention_source(self.mod, shape(att.q)[-1], meta(att.q).dtype)
        self.in_shapes = tuple(shape(n) for n in att.inputs)
        self.out_dtype = meta(att.out).dtype

    def forward(self, q, k, v, *extras):
        got = tuple(tuple(t.shape) for t in (q, k, v, *extras))
        if got != self.in_shapes:
            raise RuntimeError(f"{self.name}: given shapes {got}, made for {self.in_shapes}; recapture for new shapes")
        out = flash_attention(q, k, v, scale=1.0, mod=self.mod, extras=extras)
        return (out if out.dtype == self.out_dtype else out.to(self.out_dtype),)

    def extra_repr(self) -> str:
        return f"{self.name}: attention, score mod: " + "; ".join(self.mod.lines)
