"""A region's kernel as an nn.Module: checks what it is given, picks the variant, allocates, launches.

Kernels are specialised to sizes and strides (constants make the index math cheap).  A call with the
captured shapes and dtypes but other strides gets a variant generated for those strides; a call with
other shapes or dtypes is refused, never run on a kernel made for something else.
"""
from __future__ import annotations

import torch

from fuser.codegen.compile import check_mode, load
from fuser.codegen.kernel import KernelSource, TensorSig, generate
from .graph import meta
from .region import Region


class RegionKernel(torch.nn.Module):
    def __init__(self, region: Region, name: str):
        super().__init__()
        self.region, self.name = region, name
        self.in_sigs = tuple(TensorSig.of(meta(n)) for n in region.inputs)
        self.out_sigs = tuple(TensorSig.of(meta(n)) for n in region.outputs)
        self.device_type = meta(region.outputs[0]).device.type
        self.variants: dict[tuple, KernelSource] = {}
        self.source = self._variant(self.in_sigs).source  # emitting it now also proves it can be

    def _variant(self, sigs: tuple) -> KernelSource:
        if sigs not in self.variants:
            self.variants[sigs] = generate(self.region, list(sigs), list(self.out_sigs), self.device_type, self.name)
        return self.variants[sigs]

    def _check(self, inputs) -> tuple:
        if len(inputs) != len(self.in_sigs):
            raise TypeError(f"{self.name}: expected {len(self.in_sigs)} tensors, got {len(inputs)}")
        sigs = []
        for i, (t, want) in enumerate(zip(inputs, self.in_sigs)):
            if tuple(t.shape) != want.shape or t.dtype != want.dtype:
                raise RuntimeError(
                    f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, but the kernel was made for "
                    f"{want.shape} {want.dtype}; recapture (fuser.fuse) for new shapes or dtypes")
            sigs.append(TensorSig.of(t))
        return tuple(sigs)

    def forward(self, *inputs):
        device = next((t.device for t in inputs if t.dim() > 0), inputs[0].device if inputs else None)
        if device.type != self.device_type:
            raise RuntimeError(f"{self.name}: made for {self.device_type} tensors, given {device.type} ones")
        inputs = [t.to(device) if t.device != device else t for t in inputs]  # 0-d CPU scalars
        variant = self._variant(self._check(inputs))
        outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in self.out_sigs]
        if variant.grid > 0 and self.region.space.rows > 0 and (self.region.space.r > 0 or not self.region.space.is_reduction):
            check_mode(device.type)
            fn = load(variant.source, variant.name)
            meta_args = {"XBLOCK": variant.plan.xblock}
            if self.region.space.is_reduction:
                meta_args["RBLOCK"] = variant.plan.rblock
            if device.type != "cpu":
                meta_args["num_warps"] = variant.plan.num_warps
            with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
                fn[(variant.grid,)](*inputs, *outs, **meta_args)
        return tuple(outs)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.region.kind}, {len(self.region.nodes)} ops"


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
