"""What must be claimed before AOT Autograd splits forward from backward: attention (so training runs
SDPA's own forward and backward, or ours), a linear layer feeding only a cross-entropy (one chunked
op, fuser/linear_ce.py, that never holds the logits), and dropout (a seeded op fused into regions,
fuser/dropout.py, whose backward regenerates the mask instead of saving it).

After AOT Autograd, a training forward already saves the N x N softmax probabilities for its
backward, and the backward reads them: rewriting the forward then would change nothing the
backward does.  So for a graph that needs gradients, Dynamo's graph is first traced to ATen here
(make_fx, only softmax and dropout decomposed, so the recogniser sees them), each attention SDPA expresses exactly
is rewritten as one SDPA call (codegen/sdpa.py), and that graph is what AOT Autograd traces: SDPA's
derivative gives the flash/memory-efficient backward, and the forward saves O(N) (the log-sum-exp),
not the scores.  An attention SDPA cannot express (soft-capping, ALiBi in fp32) becomes one call of
the custom op `fuser::flash_attention` instead: our forward kernel, and, registered as its
gradient, our backward kernels (codegen/attention_bwd.py), which recompute the scores from Q, K
and the saved log-sum-exp; the score chain's derivative comes from codegen/score_mod.py.  The loss and dropout
are claimed for the same reason: after AOT, the forward already saves the logits or the mask.  Where
nothing is claimed, Dynamo's graph goes to AOT Autograd untouched.

The trace runs on Dynamo's own fake inputs, so symbolic sizes stay symbolic.  Left alone (the
reason goes to the report): graphs that hold parameters as attributes (a trace would make them constants), and graphs whose meaning a plain
trace loses: autograd.Function and other higher-order ops, autocast on around the call (AOT would
apply it again to the traced casts), gradients switched off around a value that needs them.
Autocast switched inside the graph is kept: the trace records the casts it makes.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._dispatch.python import enable_python_dispatcher
from torch._decomp.decompositions import matmul as python_matmul
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from fuser.codegen import sdpa
from fuser.codegen.attention import refusal
from fuser.codegen.score_mod import plain_scale, score_mod
from fuser.graph import ComputeGraph, meta, replace_output, shape
from fuser.patterns import cross_entropy
from fuser.patterns.attention import (dropout_site, extra_forms, find, mask_structure, normalize_attention, resolved,
                                     safe_rows, what_the_kernel_reads)

from .attention_op import flash_attention_op, register_mod, register_site
from .dropout import dropout_op
from .dtypes import target
from .linear_ce import linear_cross_entropy_logits_op, linear_cross_entropy_op
from .sdpa_calls import is_sdpa_call, pin_sdpa, pinned_kernels

aten = torch.ops.aten


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _refusal(gm: fx.GraphModule, example_inputs) -> str | None:
    """Why this graph is not traced here, or None."""
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


def _is_dropout(n: fx.Node) -> bool:
    """Dropout as Dynamo records it (the functional, the module inlined); p = 0 or eval is left alone."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.op not in ("call_function", "call_method") or "dropout" not in name or n.target is dropout_op._opoverload:
        return False
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
    return training is not False and p != 0


def _is_a_loss(n: fx.Node) -> bool:
    """A cross-entropy or NLL loss as Dynamo records it (the functional, the module inlined)."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return n.op in ("call_function", "call_method") and ("cross_entropy" in name or "nll_loss" in name)


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


def _wanted(gm: fx.GraphModule, attention: bool, loss: bool, dropout: bool) -> str:
    """What this graph has to claim, in words ("" for nothing: then no trace, which could add guards)."""
    att = attention and any(_feeds_a_matmul(n) for n in gm.graph.nodes if "softmax" in str(n.target))
    calls = attention and any(is_sdpa_call(n) for n in gm.graph.nodes) and any(  # pinned on CUDA only
        isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.is_cuda for n in gm.graph.nodes if n.op == "placeholder")
    ce = loss and any(_is_a_loss(n) for n in gm.graph.nodes)
    drop = dropout and any(_is_dropout(n) for n in gm.graph.nodes)
    return " and ".join(w for w, on in (("attention", att), ("SDPA's kernel", calls), ("the linear + cross-entropy", ce),
                                        ("dropout", drop)) if on)


class _SymbolicMatmul(TorchFunctionMode):
    """A matmul over symbolic sizes traced through torch's Python matmul (the one AOT Autograd's trace runs,
    under its Python dispatcher): torch 2.11's C++ matmul asks such a tensor's sizes() while make_fx traces
    it, which specialises every size (each new length then compiled a graph; torch 2.13 no longer does).
    Only matmul, the op found doing it, rather than the whole Python dispatcher: the least change to what the
    trace runs."""

    _MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._MATMULS and not kwargs and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args) \
                and any(isinstance(s, torch.SymInt) for a in args for s in a.shape):
            return python_matmul(*args)
        return func(*args, **kwargs)


class _Quiet(logging.Filter):
    """Drops the fake tensor's log of a meta kernel's failure that `_trace` answers by tracing again."""

    def filter(self, record) -> bool:
        return False


def _trace(gm: fx.GraphModule, decomposed: list, values: list, pinned: list | None = None) -> fx.GraphModule:
    """make_fx of gm with `decomposed` decomposed; where an op's C++ kernel takes no symbolic sizes (constant_pad_nd
    by amounts computed from sizes: Swin's window padding at symbolic sizes), traced again under the Python
    dispatcher, as AOT Autograd traces, whose Python reference takes them.  Not under it from the start: it
    sends SDPA's masked fake kernel to a C++ kernel that takes no symbolic sizes (bench/notes.md, run 152).
    `pinned`: the SDPA kernels the trace pins (sdpa_calls.pinned_kernels), emptied before the second trace."""
    table = get_decompositions(decomposed)
    quiet, fake_log = _Quiet(), logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addFilter(quiet)
    try:
        with _SymbolicMatmul():
            return make_fx(gm, decomposition_table=table)(*values)
    except RuntimeError as e:
        if "expected to contain only concrete integers" not in str(e):
            raise
    finally:
        fake_log.removeFilter(quiet)
    if pinned is not None:
        pinned.clear()
    with enable_python_dispatcher():
        return make_fx(gm, decomposition_table=table)(*values)


def claim(gm: fx.GraphModule, example_inputs, attention: bool | str = True, loss: bool = True,
          dropout: bool = True) -> tuple[fx.GraphModule, list[str]]:
    """(the graph AOT Autograd should trace, notes for the report).  `attention`: claim attention (as the
    `attention` option: True, SDPA where exact, else our kernel; "triton", our kernel always);
    `loss`: claim a linear layer feeding only a cross-entropy (fuser/linear_ce.py); `dropout`: claim
    dropout as the seeded op fused into regions (fuser/dropout.py)."""
    if not _needs_grad(example_inputs):
        return gm, []
    wanted = _wanted(gm, attention, loss, dropout)
    if not wanted:
        return gm, []
    why = _refusal(gm, example_inputs)
    if why is not None:
        return gm, [f"{wanted} in training left to its ops: {why}"]
    # Dynamo's own fake inputs (sizes symbolic where they vary): the trace keeps the size arithmetic
    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next(v.fake_mode for v in values if isinstance(v, FakeTensor))
    with mode, pinned_kernels() as pinned:
        traced = _trace(pin_sdpa(gm) if attention else gm, [aten._softmax, aten._safe_softmax, aten.dropout], values,
                        pinned)
    if wanted == "SDPA's kernel" and not pinned:
        return gm, []  # SDPA calls alone, none the trace would take otherwise than eager: Dynamo's graph as is
    traced.graph.eliminate_dead_code()  # softmax's detached copy of its output (saved for autograd)
    notes = _claim_attention(traced, example_inputs, ours_only=attention == "triton") if attention else []
    if "attention" in wanted and not notes:
        notes.append("attention in training left to its ops: a softmax feeds a matmul, but no attention was recognised "
                     "there (patterns/attention.py: Q @ K^T, a score chain, softmax, @ V, over a static head dim)")
    if pinned:
        notes.append(f"SDPA calls claimed before autograd: {len(pinned)} run {', '.join(sorted(set(pinned)))}, as eager "
                     "picks for their tensors (traced with fake tensors, SDPA took its math path)")
    if any(safe_rows(n) for n in traced.graph.nodes):
        # SDPA's math path, decomposed by the trace (_safe_softmax) and not claimed back: its decomposed
        # backward gives NaN on a row whose every key is -inf, where eager's gives 0.  Traced again
        # with _safe_softmax kept whole, for the loss and dropout alone.
        notes = [n for n in notes if " claimed before autograd" not in n] + [
            "attention in training left to its ops: SDPA's math path, as the trace decomposed it, could not be "
            "claimed back (its decomposed backward gives NaN on fully masked rows, eager's 0)"]
        with mode:
            traced = _trace(gm, [aten._softmax, aten.dropout], values)
        traced.graph.eliminate_dead_code()
    notes += (_claim_losses(traced) if loss else []) + (_claim_dropouts(traced) if dropout else [])
    if not any(" claimed before autograd" in n for n in notes):
        return gm, notes
    traced.graph.eliminate_dead_code()
    for given, new in zip([n for n in gm.graph.nodes if n.op == "placeholder"],
                          [n for n in traced.graph.nodes if n.op == "placeholder"]):
        new.meta.update({k: v for k, v in given.meta.items() if k not in new.meta})  # Dynamo's input facts
    traced.meta.update(gm.meta)
    _keep_sources(gm, traced)
    traced.recompile()
    return traced, notes


def _keep_sources(gm: fx.GraphModule, traced: fx.GraphModule) -> None:
    """Dynamo's map from lifted tensors to their sources, carried to the traced graph.  AOT Autograd reads from it
    (and the placeholders' `_dynamo_source`) which inputs are parameters and buffers, its static_input_indices, which
    CUDA graphs read in place; without it, it takes the graph for an export's, none static, and cudagraph trees copied
    every weight in before each replay (40 copies a llama-gqa training step, run 101).  The tensor constants the
    trace lifted (make_fx's `_tensor_constant<i>`) get a source each: AOT asserts one for every lifted tensor."""
    for given, new in zip(gm.graph.find_nodes(op="placeholder"), traced.graph.find_nodes(op="placeholder")):
        if hasattr(given, "_dynamo_source"):
            new._dynamo_source = given._dynamo_source
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is None:
        return
    sources = dict(sources)
    for name, _ in [*traced.named_parameters(remove_duplicate=False), *traced.named_buffers(remove_duplicate=False)]:
        sources.setdefault(name, ConstantSource(f"fuser_claim_{name}"))
    traced._param_name_to_source = sources


def _claim_attention(traced: fx.GraphModule, example_inputs, ours_only: bool = False) -> list[str]:
    """Each attention of the traced graph rewritten as SDPA or as our op (`ours_only`: as our op); notes."""
    normalize_attention(traced.graph)
    cg = ComputeGraph(traced.graph)
    notes, fixups = [], {}
    learned = _needing_grad(traced.graph, example_inputs)
    data = _from_tensors(traced.graph)
    static = _static(traced.graph, example_inputs)
    for a in find(traced.graph, cg, notes):
        a = resolved(a)  # its operands as the claims before it left them
        if any(sdpa.size_sources(e) for e in a.extras):  # a mask from sizes alone: its structure found at run time
            why, how = _claim_for_our_kernel(traced, a, cg, learned, static)
            if why is None:
                notes.append(f"attention claimed before autograd (our op, a mask of sizes alone at symbolic lengths){how}")
                continue
        if any(e in data and e not in learned for e in a.extras):  # a learned bias goes to SDPA where it can, else ours
            # A data mask (padding, say) can mask a row's every key with a finite fill, where eager's probabilities
            # are uniform: SDPA's backward recomputes them from a log-sum-exp that lost them (-1e36 + log N rounds
            # to -1e36); ours keeps the row maximum and the log of the row sum apart.
            why, how = _claim_for_our_kernel(traced, a, cg, learned, static)
            notes.append(f"attention in training left to its ops (a data mask or bias: not SDPA, whose backward loses "
                         f"a row it masks whole; not our kernel: {why})" if why else
                         "attention claimed before autograd (our kernel and its backward; not SDPA: a data mask or "
                         f"bias, and SDPA's backward loses a row it masks whole){how}")
            continue
        try:
            if ours_only:
                raise sdpa.NotExpressible('the option attention="triton" asks for our kernel')
            text, _ = sdpa.lower(traced, a, fixups)
        except sdpa.NotExpressible as e:
            why, how = _claim_for_our_kernel(traced, a, cg, learned, static)
            if why:
                notes.append(f"attention in training left to its ops (not SDPA: {e}; not our kernel: {why})")
            else:
                notes.append(f"attention claimed before autograd (our kernel and its backward; not SDPA: {e}){how}")
            continue
        notes.append(f"attention claimed before autograd (SDPA computes it and its gradient): {text}")
    return notes


def _claim_losses(traced: fx.GraphModule) -> list[str]:
    """Each linear layer feeding a cross-entropy rewritten as one op: `fuser::linear_cross_entropy` (the
    logits never held whole) where nothing else reads them, else `fuser::linear_cross_entropy_logits`
    (which returns them: a model compiled whole returns its logits); notes."""
    notes, taken = [], set()
    for m in cross_entropy.find(traced.graph):
        if isinstance(m, str):
            notes.append(f"linear + cross-entropy left to its ops: {m}")
            continue
        if m.nodes[0] in taken:  # a second loss over the same logits: they come from the first op now
            notes.append("linear + cross-entropy left to its ops: another cross-entropy over the same logits "
                         "was claimed (it returns them)")
            continue
        taken.add(m.nodes[0])
        graph = traced.graph
        op = linear_cross_entropy_logits_op if m.returns_logits else linear_cross_entropy_op
        with graph.inserting_before(m.loss):
            w_t = m.weight_t
            weight = w_t.args[0] if w_t.target is aten.t.default else graph.call_function(aten.t.default, (w_t,))
            call = graph.call_function(op._opoverload, (m.x, weight, m.bias, m.target, m.ignore_index, 0.0, m.reduction))
            loss = graph.call_function(operator.getitem, (call, 0))
            if meta(m.loss).dtype != torch.float32:
                loss = graph.call_function(torch.ops.prims.convert_element_type.default, (loss, meta(m.loss).dtype))
            logits = graph.call_function(operator.getitem, (call, 1)) if m.returns_logits else None
        m.loss.replace_all_uses_with(loss)
        if logits is not None:
            logits.meta.update(m.nodes[0].meta)
            m.nodes[0].replace_all_uses_with(logits)
        for n in reversed(m.nodes):
            if not n.users:
                graph.erase_node(n)
        if logits is not None:
            _after(logits, graph)
        v, d = meta(m.weight_t).shape[1], meta(m.x).shape[1]
        how = ("the logits returned (the model's output), neither their fp32 upcast nor their gradient held"
               if m.returns_logits else "chunked, the logits never held whole")
        notes.append(f"linear + cross-entropy claimed before autograd ([{meta(m.x).shape[0]}, {d}] x [{d}, {v}], "
                     f"reduction {m.reduction}): {how}")
    return notes


def _after(node: fx.Node, graph: fx.Graph) -> None:
    """Move the readers of `node` that come before it (the matmul it replaces was earlier: its other
    readers, such as the model's output view, stayed there) to just after it, in order, with everything
    of theirs that also came before it.  Nothing left behind reads what moves: it would read `node` too.
    (fx's legalize_graph would re-sort the whole graph, moving what needs no move.)"""
    reads, early = {node}, []
    for n in graph.nodes:
        if n is node:
            break
        if any(a in reads for a in n.all_input_nodes):
            reads.add(n)
            early.append(n)
    cursor = node
    for n in early:
        cursor.append(n)
        cursor = n


# Philox offsets of the dropout sites of one graph: site k draws from counter k * 2^40 on, so sites
# sharing the graph's seed never share random numbers (up to 2^40 elements a site)
_SITE_STRIDE = 1 << 40


def _claim_dropouts(traced: fx.GraphModule) -> list[str]:
    """Each dropout left after the attention claims (those on attention's probabilities went to
    SDPA's dropout or stay with the attention) rewritten as `fuser::dropout` from one seed drawn per
    call: fused into the regions around it, and its gradient the same op on the gradient, so no mask
    is saved for the backward.  Its random stream is not eager's (a different generator): the same
    torch.manual_seed gives the same masks run to run, not eager's masks."""
    graph, seeds, sites = traced.graph, {}, 0
    for n in list(graph.nodes):
        site = dropout_site(n) if n.op == "call_function" else None
        if site is None:
            continue
        p, nodes, x = site
        device = meta(x).device
        with graph.inserting_before(nodes[-1]):
            if device not in seeds:
                seeds[device] = _draw_seed(graph, device)
            out = graph.call_function(dropout_op._opoverload, (x, seeds[device], float(p), sites * _SITE_STRIDE))
        n.replace_all_uses_with(out)
        for m in nodes:
            if not m.users:
                graph.erase_node(m)
        sites += 1
    return [f"dropout claimed before autograd: {sites} site(s) as fuser::dropout (seeded, fused into regions, "
            "no mask saved)"] if sites else []


def _draw_seed(graph: fx.Graph, device) -> fx.Node:
    """fuser/dropout.py's new_seed in the graph: a random op, so never folded or merged, and saved for
    the backward, not drawn again there."""
    return graph.call_function(aten.randint.low, (0, 1 << 62, []), {"dtype": torch.int64, "device": device})


def _computed_from(graph: fx.Graph, inputs) -> set:
    """The nodes computed from the placeholders in `inputs`, those included."""
    found = set(inputs)
    for n in graph.nodes:
        if n.op != "placeholder" and any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _from_tensors(graph: fx.Graph) -> set:
    """The nodes computed from an input tensor's values (a mask built from sizes alone is not).
    Decision: a buffer counts as data too (a mask held in one is claimed in inference, where its
    value is checked at run time, not in training, where a fully masked row would go wrong)."""
    return _computed_from(graph, [n for n in graph.nodes if n.op == "placeholder"
                                  and isinstance(n.meta.get("val"), torch.Tensor)])


def _needing_grad(graph: fx.Graph, example_inputs) -> set:
    """The nodes computed from an input that needs a gradient (the trace's own values do not say)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return _computed_from(graph, [n for n, x in zip(placeholders, example_inputs)
                                  if isinstance(x, torch.Tensor) and x.requires_grad])


def _viewed_input(n: fx.Node) -> bool:
    """`n` is an input of the graph, or views of one: memory the graph's program never writes over (it
    reuses only its own allocations, and writes over no saved tensor that aliases an input), so a data mask's
    tile lists may be kept for it (runtime.lists_cache).  A mask computed in the graph is not: a buffer the
    program hands on to a later tensor is written without a version bump."""
    while n.op == "call_function" and getattr(n.target, "is_view", False) and n.target is not aten.reshape.default:
        n = n.args[0]  # its schema says it aliases (reshape's may copy)
    return n.op == "placeholder"


def _static(graph: fx.Graph, example_inputs) -> set:
    """The placeholders that are parameters and buffers (the same tensors every call), as Dynamo marks them."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return {n for n, x in zip(placeholders, example_inputs) if getattr(x, "_dynamo_static_input_type", None)}


def _claim_for_our_kernel(gm: fx.GraphModule, a, cg: ComputeGraph, learned: set, static: set = frozenset()) -> tuple[str | None, str]:
    """Rewrites attention `a` as one `fuser::flash_attention` call; returns (why not, with the graph
    unchanged, or None; what the note adds).  `learned`: the nodes that need a gradient; `static`: the
    parameters and buffers, from which alone a data mask is checked at run time (fuser/attention_op.py)."""
    if a.safe:
        return "SDPA's math path (fully masked rows give 0)", ""
    if any(meta(n).device != meta(a.q).device for n in a.inputs):
        return "operands on several devices", ""
    why = refusal(meta(a.q).dtype, shape(a.q)[-1], shape(a.v)[-1])  # integers: normalize_attention fixes symbolic ones
    if why is not None:
        return why, ""
    try:
        with target(meta(a.q).device.type):
            mod = score_mod(a.scores, a.chain, a.extras, cg, mask_structure(a, cg), extra_forms(a),
                            learned=tuple(i for i, e in enumerate(a.extras) if e in learned))
    except ValueError as e:
        return str(e), ""
    if mod.grad is None:
        ops = ", ".join(str(n.target) for n in a.chain)
        return f"no derivative rule for an op of the score chain ({ops})", ""
    biases = [a.extras[i].name for i, lines in mod.bias_grads if lines is None]
    if biases:
        return f"the score chain reads {', '.join(biases)}, which needs a gradient, through ops with no derivative rule", ""
    with gm.graph.inserting_before(a.out):
        extras = [what_the_kernel_reads(gm.graph, e, mod.form(i)) for i, e in enumerate(a.extras)]
        seeds = [_draw_seed(gm.graph, meta(a.q).device)] if a.dropout else []  # a seed per site: counters from 0
        sources = sdpa.mask_sources(a.extras[mod.data_mask[0]]) if mod.data_mask else []
        sizes = sdpa.size_sources(a.extras[mod.data_mask[0]]) if mod.data_mask and not sources else []
        site, flash = -1, None
        if sources and set(sources) <= static or sizes:  # nanoGPT's causal buffer, Mistral's window, a causal mask
            # from aranges at symbolic lengths: checked at run time (a mask of sizes alone once per set of sizes)
            flash = plain_scale(a.scores, a.chain, a.extras, mod.data_mask[0]) if not a.dropout else None
            site = register_site(flash)
        call = gm.graph.call_function(flash_attention_op._opoverload,
                                      (a.q, a.k, a.v, extras, 1.0, register_mod(mod), float(a.dropout), seeds, site,
                                       sources if site >= 0 and not sizes else [],
                                       bool(mod.data_mask) and _viewed_input(a.extras[mod.data_mask[0]]), sizes))
        out = gm.graph.call_function(operator.getitem, (call, 0))
        if meta(a.out).dtype != meta(a.q).dtype:
            out = gm.graph.call_function(torch.ops.prims.convert_element_type.default, (out, meta(a.out).dtype))
    out.meta["val"] = meta(a.out)  # for the claims after this one (the op's output is contiguous, as P @ V was)
    replace_output(a.out, out)
    for n in reversed(a.nodes):
        if not n.users:
            gm.graph.erase_node(n)
    kind = mod.data_mask and str(mod.data_mask[2]).removeprefix("torch.")
    if site >= 0:
        made = "sizes alone, checked at run time once per set of sizes" if sizes else \
            "parameters and buffers, checked at run time"
        return None, (f"; its {kind} mask, made from {made}: where causal or a "
                      f"window, {'SDPA (causal) or ' if flash is not None else ''}our kernel made for that structure; else "
                      "the tiles it masks whole skipped, listed per call")
    return None, f"; the tiles its {kind} mask masks whole skipped, listed per call" if kind else ""

