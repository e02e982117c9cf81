"""A matmul whose result is read only by a tanh-GELU or a ReLU becomes one cuBLASLt call with the activation in
its epilogue (`torch._addmm_activation`; a matmul without a bias, T5's, gets a zero one).

Why: GPT-2's MLP (c_fc, gelu_new, c_proj) ran its GELU as a kernel of its own, alone between two matmuls,
which are opaque to the partition: a launch a layer in a host-bound step, and the activation's bytes read and
written again.  Measured (H200, bf16, [2048, 768] @ [768, 3072] + bias): addmm 17.1 us on the GPU, with the
GELU epilogue 19.3 us (cuBLASLt's `gelubias` kernel), at the same host time a call; NaN and infinities come
out where the separate ops put them; the result is as close to fp64 as eager's (closer: one rounding).

Which function the chain computes is found by evaluating it in fp64 on sample points, not from its spelling:
Hugging Face's `gelu_new` formula, BLOOM's constants, `F.gelu(approximate="tanh")`, `relu`, `clamp_min(x, 0)`
alike; the erf GELU is not the tanh one, and `where(x > 0, x, 0)` turns NaN into 0 where ReLU keeps it: both stay
regions.  In training AOT's partition saves the pre-activation for the backward (which recomputes the
activation from it): read twice, the matmul keeps its ops there.  Decision: 16-bit results only: in fp32,
cuBLASLt runs the GELU as a second kernel (no launch saved).  On CPU the op is ATen's addmm and activation,
so the rewrite is taken there too (the tests run it through the interpreter's neighbours).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from . import ops
from .graph import fake_mode_of, is_generator, is_tensor, real_tensors, replaced, static_shape

aten = torch.ops.aten
DTYPES = (torch.float16, torch.bfloat16)
# views that keep the element order of the matmul's contiguous result (a 3-d input's linear: view, addmm, view)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# casts: identities in the fp64 evaluation where they go to a float type at least as wide as the matmul's
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _samples() -> torch.Tensor:
    x = torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64)
    return torch.cat([x, torch.tensor([0.0, 1e-6, -1e-6, 1e-3, -1e-3, 40.0, -40.0, math.inf, -math.inf, math.nan],
                                      dtype=torch.float64)])


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"gelu (tanh)": (True, _gelu_tanh), "relu": (False, torch.relu)}


def matmul_epilogues(gm: fx.GraphModule) -> list[str]:
    """Rewrites gm in place; a line per matmul for the report."""
    notes, changed, zeros = [], [], {}
    for n in list(gm.graph.nodes):
        found = _activation_after(n)
        if found is None:
            continue
        name, chain, out = found
        args = n.args if n.target is aten.addmm.default else (_zeros(gm, n, zeros), *n.args)
        with gm.graph.inserting_before(n):
            fused = gm.graph.call_function(aten._addmm_activation.default, args, {"use_gelu": ACTIVATIONS[name][0]})
        new = fused
        views = [m for m in chain if m.target in _VIEWS]
        if views:  # the result's shape, as the chain's last view gives it (pointwise ops keep shapes)
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(aten.view.default, (fused, views[-1].args[1]))
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
        name = f"_zero_bias_{len(made)}"
        while hasattr(gm, name):
            name += "_"
        with real_tensors():
            gm.register_buffer(name, torch.zeros(v.shape[-1], dtype=v.dtype, device=v.device), persistent=False)
        with gm.graph.inserting_before(next(m for m in gm.graph.nodes if m.op != "placeholder")):
            made[key] = gm.graph.get_attr(name)
        made[key].meta["val"] = fake_mode_of(gm.graph).from_tensor(getattr(gm, name))
    return made[key]


def _activation_after(n: fx.Node):
    """(activation name, the chain's nodes in graph order, its last node) where n is an mm or addmm (without
    scaling) whose result only a tanh-GELU or a ReLU reads (through order-keeping views and casts), else None."""
    if n.op != "call_function" or n.kwargs or not (n.target is aten.addmm.default and len(n.args) == 3
                                                   or n.target is aten.mm.default):
        return None
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.dtype not in DTYPES or n.target is aten.mm.default and not static_shape(v):
        return None
    chain = _made_from(n)
    for out in reversed(chain):  # the longest chain first
        part = _ancestors(out, chain)
        inside = {n, *part}
        if v.dtype != out.meta["val"].dtype or any(u not in inside for m in inside - {out} for u in m.users):
            continue
        name = _which(n, part)
        if name is not None:
            return name, part, out
    return None


def _made_from(n: fx.Node) -> list[fx.Node]:
    """The pointwise ops, casts and order-keeping views after n in the graph (an fx graph is in topological
    order) that read n or each other only (scalars aside, and 0-d constants made among them), in graph order."""
    made, inside, m = [], {n}, n.next
    while m.op != "root":
        tensors = [a for a in m.all_input_nodes if is_tensor(a)]
        sizes_only = len(tensors) < len(m.all_input_nodes)  # a view to symbolic sizes reads them as nodes
        if m.op == "call_function" and all(a in inside for a in tensors) and (
                m.target in _VIEWS and tensors
                or not sizes_only and tensors and (m.target in _CASTS or isinstance(ops.classify(m), ops.Pointwise))
                or not m.all_input_nodes and _scalar(m)):
            made.append(m)
            inside.add(m)
        m = m.next
    return made


def _scalar(m: fx.Node) -> bool:
    """A 0-d constant made in the graph (the 0 of `where(x > 0, x, 0)`)."""
    v = m.meta.get("val")
    return is_generator(m) and isinstance(v, torch.Tensor) and v.dim() == 0


def _ancestors(out: fx.Node, chain: list[fx.Node]) -> list[fx.Node]:
    members, todo, keep = set(chain), [out], set()
    while todo:
        m = todo.pop()
        if m in keep or m not in members:
            continue
        keep.add(m)
        todo += m.all_input_nodes
    return [m for m in chain if m in keep]


def _widening(cast: fx.Node, dtype: torch.dtype) -> bool:
    """A cast to a float type that holds every value of `dtype` (bf16 -> fp32, not bf16 -> fp16 or to an int)."""
    to = cast.args[1] if cast.target is torch.ops.prims.convert_element_type.default else cast.kwargs.get("dtype")
    return to in (dtype, torch.float32, torch.float64) and set(cast.kwargs) <= {"dtype"}


def _which(n: fx.Node, part: list[fx.Node]) -> str | None:
    """The activation the chain computes from n's value, by evaluating it in fp64 (views and casts as
    identities), or None."""
    with real_tensors(), torch.no_grad():  # fake mode off: real values, computed here
        x = _samples()
        values = {n: x}
        try:
            for m in part:
                if m.target in _CASTS and not _widening(m, n.meta["val"].dtype):
                    return None
                if m.target in _VIEWS or m.target in _CASTS:
                    values[m] = values[m.args[0]]
                    continue
                args, kwargs = fx.node.map_arg((m.args, m.kwargs), values.__getitem__)
                values[m] = m.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return None
        y = values[part[-1]]
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
            return None
        for name, (_, f) in ACTIVATIONS.items():
            want = f(x)
            if torch.equal(y.isnan(), want.isnan()) and torch.allclose(
                    y.double().nan_to_num(0.0, 1e300, -1e300), want.nan_to_num(0.0, 1e300, -1e300), rtol=1e-6, atol=1e-9):
                return name
    return None
