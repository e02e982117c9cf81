"""A matmul whose result is read only by a tanh-GELU or a ReLU becomes one cuBLASLt call with the activation in
its epilogue (`torch._addmm_activation`; a matmul without a bias, T5's, gets a zero one).

Why: GPT-2's MLP (c_fc, gelu_new, c_proj) ran its GELU as a kernel of its own, alone between two matmuls,
which are opaque to the partition: a launch a layer in a host-bound step, and the activation's bytes read and
written again.  Measured (H200, bf16, [2048, 768] @ [768, 3072] + bias): addmm 17.1 us on the GPU, with the
GELU epilogue 19.3 us (cuBLASLt's `gelubias` kernel), at the same host time a call; NaN and infinities come
out where the separate ops put them; the result is as close to fp64 as eager's (closer: one rounding).

Which function the chain computes is found by evaluating it in fp64 on every value of the matmul's 16-bit
dtype (the only inputs eager's chain ever sees), infinities and NaN, not from its spelling:
Hugging Face's `gelu_new` formula, BLOOM's constants, `F.gelu(approximate="tanh")`, `relu`, `clamp_min(x, 0)`
alike; the erf GELU is not the tanh one, `where(x > 0, x, 0)` turns NaN into 0 where ReLU keeps it, and
`threshold(x, 5e-7, 0)` differs on (0, 5e-7]: all stay regions.  The chain must be elementwise (no operand
broadcast), its casts may not narrow before its end (fp32 -> fp16 overflows where the epilogue would not), and its
result's shape is the chain's last view's, given by `_unsafe_view` (a graph output is no view).  In training
AOT's partition saves the pre-activation for the backward (which recomputes the activation from it): read twice,
the matmul keeps its ops there.  Decision: 16-bit results only: in fp32,
cuBLASLt runs the GELU as a second kernel (no launch saved).  On CPU the op is ATen's addmm and activation,
so the rewrite is taken there too (the tests run it through the interpreter's neighbours).
"""
from __future__ import annotations

import functools
import heapq
import math

import torch
import torch.fx as fx

from . import ops
from .fold import fresh_attr
from .graph import fake_mode_of, is_generator, is_tensor, meta, real_tensors, replaced

aten = torch.ops.aten
DTYPES = (torch.float16, torch.bfloat16)
# views that keep the element order of the matmul's contiguous result (a 3-d input's linear: view, addmm, view)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


@functools.lru_cache(maxsize=None)
def _samples(dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """Every value of the 16-bit `dtype` (NaN and infinities among them) in fp64, and each activation of them
    (computed once: a graph has many matmuls)."""
    with real_tensors():
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float64)
        return x, {name: f(x) for name, (_, f) in ACTIVATIONS.items()}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


ACTIVATIONS = {"gelu (tanh)": (True, _gelu_tanh), "relu": (False, torch.relu)}


def matmul_epilogues(gm: fx.GraphModule) -> list[str]:
    """Rewrites gm in place; a line per matmul for the report."""
    notes, changed, zeros = [], [], {}
    order = {m: i for i, m in enumerate(gm.graph.nodes)}
    for n in list(order):
        found = _activation_after(n, order)
        if found is None:
            continue
        name, chain, out = found
        args = n.args if n.target is aten.addmm.default else (_zeros(gm, n, zeros), *n.args)
        with gm.graph.inserting_before(n):
            fused = gm.graph.call_function(aten._addmm_activation.default, args, {"use_gelu": ACTIVATIONS[name][0]})
        new = fused
        views = [m for m in chain if m.target in _VIEWS]
        if views:  # the result's shape, as the chain's last view gives it (no view: a graph output must be none)
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(aten._unsafe_view.default, (fused, views[-1].args[1]))
        out.replace_all_uses_with(new)
        for m in reversed([n, *chain]):
            gm.graph.erase_node(m)
        changed += [fused, new]
        notes.append(f"{n.name}: {list(n.meta['val'].shape)} {str(n.meta['val'].dtype).replace('torch.', '')} "
                     f"with its {name} in cuBLASLt's epilogue ({len(chain)} ops, no kernel of their own)")
    if notes:
        replaced(gm, changed)
    return notes


def _zeros(gm: fx.GraphModule, n: fx.Node, made: dict) -> fx.Node:
    """A zero bias for mm n (T5's MLP has none): one constant buffer per width, dtype and device, made once."""
    v = n.meta["val"]
    key = (v.shape[-1], v.dtype, v.device)
    if key not in made:
        name = fresh_attr(gm, f"_zero_bias_{len(made)}")
        with real_tensors():
            gm.register_buffer(name, torch.zeros(v.shape[-1], dtype=v.dtype, device=v.device), persistent=False)
        with gm.graph.inserting_before(next(m for m in gm.graph.nodes if m.op != "placeholder")):
            made[key] = gm.graph.get_attr(name)
        made[key].meta["val"] = fake_mode_of(gm.graph).from_tensor(getattr(gm, name))
    return made[key]


def _activation_after(n: fx.Node, order: dict):
    """(activation name, the chain's nodes in graph order, its last node) where n is an mm or addmm (without
    scaling) whose result only a tanh-GELU or a ReLU reads (through order-keeping views and casts), else None."""
    if n.op != "call_function" or n.kwargs or not (n.target is aten.addmm.default and len(n.args) == 3
                                                   or n.target is aten.mm.default):
        return None
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.dtype not in DTYPES or not isinstance(v.shape[-1], int):
        return None  # (an mm's zero bias needs a fixed width)
    chain = _made_from(n, order)
    for out in reversed(chain):  # the longest chain first
        part = _ancestors(out, chain)
        inside = {n, *part}
        if v.dtype != out.meta["val"].dtype or any(u not in inside for m in inside - {out} for u in m.users):
            continue
        name = _which(n, part)
        if name is not None:
            return name, part, out
    return None


def _made_from(n: fx.Node, order: dict) -> list[fx.Node]:
    """The pointwise ops, casts and order-keeping views that read n or each other only (0-d constants made in
    the graph and scalars aside), none broadcasting, in graph order: walked from n's readers forward."""
    inside, made, heap, seen = {n}, [], [(order[u], u) for u in n.users if u in order], set()
    heapq.heapify(heap)
    while heap:
        _, m = heapq.heappop(heap)
        if m in seen:
            continue
        seen.add(m)
        scalars = [a for a in m.all_input_nodes if a not in inside and _scalar(a)]
        if not _member(m, inside | set(scalars)):
            continue
        for m2 in [*scalars, m]:
            made.append(m2)
            inside.add(m2)
        for u in m.users:
            if u in order and u not in seen:
                heapq.heappush(heap, (order[u], u))
    return sorted(made, key=order.__getitem__)


def _member(m: fx.Node, inside: set) -> bool:
    """Whether m computes from `inside` alone, elementwise: a view to the same element count (whose sizes may
    be the graph's size nodes), a cast, or a pointwise op whose tensor operands all have its shape."""
    if m.op != "call_function":
        return False
    tensors = [a for a in m.all_input_nodes if is_tensor(a)]
    if not tensors or any(a not in inside for a in tensors) or meta(m) is None:
        return False
    if m.target in _VIEWS:
        return True
    if len(tensors) < len(m.all_input_nodes):  # a size node read by anything but a view
        return False
    if m.target not in _CASTS and not isinstance(ops.classify(m), ops.Pointwise):
        return False
    return all(meta(a).shape == meta(m).shape or meta(a).dim() == 0 and _scalar(a) for a in tensors)


def _scalar(m: fx.Node) -> bool:
    """A 0-d constant made in the graph (the 0 of `where(x > 0, x, 0)`)."""
    v = meta(m)
    return is_generator(m) and not m.all_input_nodes and v is not None and v.dim() == 0


def _ancestors(out: fx.Node, chain: list[fx.Node]) -> list[fx.Node]:
    members, todo, keep = set(chain), [out], set()
    while todo:
        m = todo.pop()
        if m in keep or m not in members:
            continue
        keep.add(m)
        todo += m.all_input_nodes
    return [m for m in chain if m in keep]


def _cast_ok(cast: fx.Node, out: fx.Node, dtype: torch.dtype) -> bool:
    """A cast the fp64 evaluation may take as the identity: to fp32 or fp64 (holding every value of the 16-bit
    `dtype`), one that changes nothing, or the chain's last op rounding to `dtype` (the epilogue rounds there
    too); not a narrowing inside the chain (fp32 -> fp16 overflows where the epilogue would not)."""
    to = cast.args[1] if cast.target is torch.ops.prims.convert_element_type.default else cast.kwargs.get("dtype")
    if set(cast.kwargs) - {"dtype"}:
        return False
    return to in (torch.float32, torch.float64) or to == meta(cast.args[0]).dtype or cast is out and to == dtype


def _which(n: fx.Node, part: list[fx.Node]) -> str | None:
    """The activation the chain computes from n's value, by evaluating it in fp64 (views and allowed casts
    as identities) on every value n can hold, or None."""
    dtype = n.meta["val"].dtype
    if any(m.target in _CASTS and not _cast_ok(m, part[-1], dtype) for m in part):
        return None
    x, activations = _samples(dtype)
    found = set(activations)
    with real_tensors(), torch.no_grad():  # fake mode off: real values, computed here
        # by pieces under ATen's parallel grain (32768): a parallel op on a busy 2-core machine costs ms
        for lo in range(0, x.numel(), _PIECE):
            y = _evaluate(n, part, x[lo:lo + _PIECE].clone())  # (a copy: the cached samples out of any op's reach)
            if y is None:
                return None
            found = {name for name in found if _same(y, activations[name][lo:lo + _PIECE])}
            if not found:
                return None
    return next(iter(found))


_PIECE = 1 << 14


def _evaluate(n: fx.Node, part: list[fx.Node], x: torch.Tensor) -> torch.Tensor | None:
    values = {n: x}
    try:
        for m in part:
            if m.target in _VIEWS or m.target in _CASTS:
                values[m] = values[m.args[0]]
                continue
            args, kwargs = fx.node.map_arg((m.args, m.kwargs), values.__getitem__)
            values[m] = m.target(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError):
        return None
    y = values[part[-1]]
    return y.double() if isinstance(y, torch.Tensor) and y.shape == x.shape and y.is_floating_point() else None


def _same(y: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN where `want` is NaN, equal infinities, else within 1e-6 relative (torch.allclose is slower)."""
    if not torch.equal(y.isnan(), want.isnan()):
        return False
    close = ((y - want).abs() <= 1e-12 + 1e-6 * want.abs()).logical_or_(y == want).logical_or_(y.isnan())
    return bool(close.all())
