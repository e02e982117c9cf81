"""Attention claimed before AOT Autograd splits forward from backward, so training runs SDPA's own
forward and backward.

After AOT Autograd, a training forward already saves the N x N softmax probabilities for its
backward, and the backward reads them: rewriting the forward then would change nothing the
backward does.  So for a graph that needs gradients, Dynamo's graph is first traced to ATen here
(make_fx, only softmax and dropout decomposed, so the recogniser sees them), each attention SDPA expresses exactly
is rewritten as one SDPA call (codegen/sdpa.py), and that graph is what AOT Autograd traces: SDPA's
derivative gives the flash/memory-efficient backward, and the forward saves O(N) (the log-sum-exp),
not the scores.  Where nothing is claimed, Dynamo's graph goes to AOT Autograd untouched.

The trace runs on Dynamo's own fake inputs, so symbolic sizes stay symbolic.  Left alone (the
reason goes to the report): graphs that hold parameters as attributes (a trace would make them constants), and graphs whose meaning a plain
trace loses: autograd.Function and other higher-order ops, autocast on around the call (AOT would
apply it again to the traced casts), gradients switched off around a value that needs them.
Autocast switched inside the graph is kept: the trace records the casts it makes.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx

from fuser.codegen import sdpa
from fuser.graph import ComputeGraph
from fuser.patterns.attention import find, normalize_attention

aten = torch.ops.aten


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _refusal(gm: fx.GraphModule, example_inputs) -> str | None:
    """Why this graph is not traced here, or None."""
    if not any(_feeds_a_matmul(n) for n in gm.graph.nodes if "softmax" in str(n.target)):
        return ""  # no attention to claim: nothing to say (and no trace: it could add guards on sizes)
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(isinstance(v, FakeTensor) for v in values) or any(v is None for v in values):
        return "Dynamo's graph carries no fake inputs to trace with"
    if any(True for _ in gm.parameters()):
        return "the graph holds parameters as attributes"
    if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        return "autocast is on"
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            return f"the graph calls {n.target} (a plain trace would drop what it means)"
    return _grad_mode_refusal(gm, example_inputs)


_MATMULS = ("matmul", "bmm", "einsum", "baddbmm")


def _feeds_a_matmul(n: fx.Node, depth: int = 4) -> bool:
    """A softmax whose result reaches a matmul within a few ops (casts, dropout): attention's shape."""
    for u in n.users:
        name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", str(u.target))
        if any(m in name for m in _MATMULS) or (depth and _feeds_a_matmul(u, depth - 1)):
            return True
    return False


def _grad_mode_refusal(gm: fx.GraphModule, example_inputs) -> str | None:
    """The trace here does not record grad-mode switches.  That loses nothing where no value computed
    with gradients off depends on an input that needs them (LLaMA's rotary table under no_grad is
    made from a buffer and positions); else, the reason."""
    inputs = iter(example_inputs)
    needs, enabled = set(), True
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            x = next(inputs, None)
            if isinstance(x, torch.Tensor) and x.requires_grad:
                needs.add(n)
        elif n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            enabled = bool(n.args[0])
        elif any(a in needs for a in n.all_input_nodes):
            if not enabled:
                return f"{n.name} is computed with gradients off from a value that needs them"
            needs.add(n)
    return None


def claim_attention(gm: fx.GraphModule, example_inputs) -> tuple[fx.GraphModule, list[str]]:
    """(the graph AOT Autograd should trace, notes for the report)."""
    if not _needs_grad(example_inputs):
        return gm, []
    why = _refusal(gm, example_inputs)
    if why is not None:
        return gm, [f"attention in training left to its ops: {why}"] if why else []
    # Dynamo's own fake inputs (sizes symbolic where they vary): the trace keeps the size arithmetic
    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next(v.fake_mode for v in values if isinstance(v, FakeTensor))
    with mode:
        traced = make_fx(gm, decomposition_table=get_decompositions([aten._softmax, aten._safe_softmax, aten.dropout]))(*values)
    traced.graph.eliminate_dead_code()  # softmax's detached copy of its output (saved for autograd)
    normalize_attention(traced.graph)
    cg = ComputeGraph(traced.graph)
    notes, fixups = [], {}
    for a in find(traced.graph, cg):
        try:
            text, _ = sdpa.lower(traced, a, fixups)
        except sdpa.NotExpressible as e:
            notes.append(f"attention in training left to its ops (not SDPA: {e}; our kernel has no gradient yet)")
            continue
        notes.append(f"attention claimed before autograd (SDPA computes it and its gradient): {text}")
    if not any(n.startswith("attention claimed") for n in notes):
        return gm, notes
    traced.graph.eliminate_dead_code()
    for given, new in zip([n for n in gm.graph.nodes if n.op == "placeholder"],
                          [n for n in traced.graph.nodes if n.op == "placeholder"]):
        new.meta.update({k: v for k, v in given.meta.items() if k not in new.meta})  # Dynamo's input facts
    traced.meta.update(gm.meta)
    traced.recompile()
    return traced, notes
