"""Constant folding: the part of a graph that depends on none of its inputs runs once, at compile time.

Models rebuild constants on every call: Hugging Face makes its causal mask from `arange`, `cumsum`
and indexing each step, a rotary table from `arange` and `cos`.  In eager and in the captured graph
those are a dozen tiny launches and about 5 us of host time each.  Here every node computed only
from constructors and module constants (`get_attr`) is evaluated once on the device, with real
tensors, and the graph reads the result as a buffer of the GraphModule.

Only where it pays: a constant that our kernels can compute in their index math and that only
fused ops read (an `arange` feeding a pointwise chain) is left to them.  Not folded: random ops (a mask must be redrawn each call), ops that write to their arguments, a
value the graph mutates, returns, or whose sizes are symbolic, and results larger than
FOLD_LIMIT_BYTES (a folded value stays in memory for the graph's life).  Inductor's own folder
(torch._inductor.constant_folding) is written for frozen parameters, skips constructors (what we
need folded) and imports Inductor's compile stack (seconds), hence this small pass.
"""
from __future__ import annotations

import functools
import logging
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from . import ops
from .graph import ComputeGraph, cpu_scalar, meta, numel

aten = torch.ops.aten
log = logging.getLogger("fuser")
FOLD_LIMIT_BYTES = 1 << 24  # per folded value


def fold_constants(gm: fx.GraphModule) -> list[str]:
    """Folds gm in place; returns a line per folded value for the report."""
    graph = gm.graph
    const = constant_nodes(gm)
    written = {a for n in graph.nodes for a in _written(n)}
    if written & const:
        return []  # a constant is mutated in place: its value is per call
    cg = ComputeGraph(graph)
    frontier = [n for n in const if n.op == "call_function" and _materialised(n, const) and _pays(n, const, cg)]
    if not frontier:
        return []
    values = _evaluate(gm, const, frontier)
    notes = []
    for n in frontier:
        value = values.get(n)
        if value is None:
            continue
        name = fresh_attr(gm, f"_folded_{n.name}")
        gm.register_buffer(name, value, persistent=False)
        with graph.inserting_before(n):
            new = graph.get_attr(name)
        new.meta = dict(n.meta, folded=True)  # its layout is the traced one (checked in _evaluate)
        n.replace_all_uses_with(new)
        notes.append(f"{n.name}: {list(value.shape)} {str(value.dtype).replace('torch.', '')}")
    graph.eliminate_dead_code()
    gm.recompile()
    if notes:
        log.debug("fuser: folded %d constants: %s", len(notes), ", ".join(notes))
    return notes


def merge_duplicates(gm: fx.GraphModule) -> list[str]:
    """An op that computes what an earlier op computed is dropped for it, where only eager ops read either
    result (directly or through views): made as tensors either way.  T5's SDPA calls each copy the one
    relative-position bias contiguous: four identical [B, H, T, T] copies, which the partition then made
    siblings of one kernel, all held at once (run 192).  Values are numbered through views (two views
    alike are one value) but views stay as they are, as does what fused ops read: a recogniser claims its
    attention's views and Q·Kᵀ, and a pointwise op each reader's kernel recomputes costs less than one
    written out and read back.  Hence not torch's CSE (`fx_graph_cse`, run by AOT Autograd on joint
    graphs), which merges every duplicate.  Not merged: ops with effects (random, writes, profiler
    ranges), `empty`, returned values (eager returns two tensors), what an op writes into, and across a
    write in place.  Returns a line per op dropped."""
    cg = ComputeGraph(gm.graph)

    def eager_reads(n) -> bool:  # n is read only by eager ops, directly or through views
        return all(eager_reads(c) if cg.transparent(c) else isinstance(cg.info[c], ops.Opaque) for c in n.users)

    written = set()  # what some op writes into, and the views it is written through
    for m in gm.graph.nodes:
        for w in _written(m):
            while w not in written:
                written.add(w)
                w = w.args[0] if cg.transparent(w) and w.args and isinstance(w.args[0], fx.Node) else w
    value, seen, notes = {}, {}, []  # node -> the first node of its value; key -> that node
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.is_impure():  # a write in place, a random op, a profiler range, a print: never merged
            if _written(n):
                seen.clear()  # what was read before a write is not what is read after it
            continue
        key = _value_key(n, value)
        if key is None or "unbacked_bindings" in n.meta:  # (a size it binds is named by the shapes after it)
            continue
        first = value[n] = seen.setdefault(key, n)
        if first is n or cg.transparent(n) or _returned(n) or _returned(first) or {n, first} & written:
            continue
        if eager_reads(n) and eager_reads(first):
            notes.append(f"{n.name} as {first.name}")
            n.replace_all_uses_with(first)
            gm.graph.erase_node(n)
    if notes:
        gm.graph.eliminate_dead_code()  # the views only the dropped ops read
        gm.recompile()
    return notes


def recompute_past_eager(gm: fx.GraphModule, cg: ComputeGraph, keep: set) -> list[str]:
    """A pointwise op read on both sides of an eager op it feeds is copied for the readers that do not lead to
    that op.  SiLU in a conv net's backward: its sigmoid is recomputed for convolution_backward's weight
    gradient and read again by SiLU's gradient after it; read once, it joined the kernel before the eager op,
    which then wrote it and every result of it the later readers wanted, and the kernel after read them back
    (1.6x eager's bytes).  Copied, the kernel after reads the sigmoid's input and computes it again (as
    Inductor computes a pointwise buffer where each reader is, unless it is realised).  Only an op whose
    operands are no more bytes than its result (a unary op, a broadcast operand), so no reader reads more;
    not random ops nor those in `keep` (a recognised attention).  Returns a line per op copied."""
    order = list(gm.graph.nodes)
    eager = [n for n in order if n.op == "call_function" and isinstance(cg.info.get(n), ops.Opaque)]
    bit = {n: 1 << i for i, n in enumerate(eager)}
    reach = {}  # node -> the eager ops it leads to, as bits

    def leads_to(n) -> int:
        return functools.reduce(operator.or_, (reach[u] | bit.get(u, 0) for u in n.users), 0)
    hint, notes = cg.sizes.hint, []
    for n in reversed(order):
        reach[n] = leads_to(n)
        if not reach[n] or n in keep or n.op != "call_function" or not isinstance(cg.info.get(n), ops.Pointwise) \
                or cg.transparent(n) or n.is_impure() or not isinstance(meta(n), torch.Tensor):
            continue
        later = [u for u in n.users if u not in bit and u.op != "output" and reach[n] & ~(reach[u] | bit.get(u, 0))]
        if not later or len(later) == len(n.users):
            continue
        read = sum(hint(cg.read_elems(n, a)) * meta(a).element_size() for a in cg.data_inputs(n) if not cpu_scalar(meta(a)))
        if read > hint(numel(n)) * meta(n).element_size():
            continue
        with gm.graph.inserting_after(n):
            copy = gm.graph.node_copy(n)
        for u in later:
            u.replace_input_with(n, copy)
        reach[copy], reach[n] = leads_to(copy), leads_to(n)
        notes.append(f"{n.name} for {', '.join(u.name for u in later)}")
    if notes:
        gm.recompile()
    return notes


def _value_key(n: fx.Node, value: dict):
    """What n computes, as a hashable key (its target, and its operands by value), or None where it may not
    be merged (random ops and writes are impure: merge_duplicates skips them first).  Floats by their
    repr: -0.0 == 0.0, but x * -0.0 is not x * 0.0."""
    target = n.target
    if target is not operator.getitem and not isinstance(target, torch._ops.OpOverload):
        return None
    if isinstance(target, torch._ops.OpOverload) and "empty" in target.__name__:  # its values: whatever was there
        return None
    leaves, spec = tree_flatten((n.args, n.kwargs))
    try:
        key = tuple((float, repr(x)) if isinstance(x, float) else (type(x), value.get(x, x)) for x in leaves)
    except TypeError:  # an operand with no hash
        return None
    return target, key, str(spec)


# op -> (the operand that leaves x unchanged, whether that holds for floats): x + 0 is +0.0 where x is -0.0
_IDENTITIES = {aten.add.Tensor: (0, False), aten.sub.Tensor: (0, True), aten.mul.Tensor: (1, True)}


def drop_identities(gm: fx.GraphModule) -> list[str]:
    """`x + 0`, `x - 0` and `x * 1` replaced by x, where the result is x's dtype, shape and layout, real (complex
    products differ: (1 + inf j) * 1 is nan + inf j), and not returned by the graph, directly or through views
    (it would return x itself, or a view of it).  Hugging Face computes its positions as
    `arange(T) + past_length`, 0 in training: an eager add (~60 us of host a step) of a constant our kernels
    would otherwise compute in their index math.  Returns a line per op dropped."""
    notes = []
    for n in list(gm.graph.nodes):
        identity = _IDENTITIES.get(n.target) if n.op == "call_function" else None
        if identity is None or len(n.args) != 2 or n.kwargs or not isinstance(n.args[0], fx.Node):
            continue
        x, other = n.args
        xv, v = x.meta.get("val"), n.meta.get("val")
        if type(other) not in (int, float) or other != identity[0] or not isinstance(xv, torch.Tensor) \
                or not isinstance(v, torch.Tensor) or (v.dtype.is_floating_point and not identity[1]):
            continue
        if (xv.dtype, xv.shape, xv.stride()) != (v.dtype, v.shape, v.stride()) or v.dtype.is_complex or _returned(n):
            continue
        n.replace_all_uses_with(x)
        gm.graph.erase_node(n)
        notes.append(f"{n.name}: {n.target.__name__.split('.')[0]} by {other}")
    if notes:
        gm.recompile()
    return notes


def _returned(n: fx.Node) -> bool:
    """The graph returns n's value or a view of it."""
    todo, seen = [n], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for u in m.users:
            if u.op == "output":
                return True
            op = u.target
            if (isinstance(op, torch._ops.OpOverload) and (op.is_view or op is aten._unsafe_view.default)) \
                    or op is operator.getitem:
                todo.append(u)
    return False


def constant_nodes(gm: fx.GraphModule) -> set:
    """The nodes computed from module constants and constructors alone (what folding may evaluate)."""
    const = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not all(a in const for a in n.all_input_nodes):
            continue
        if _foldable(n) or (n.target is operator.getitem and n.args[0] in const):
            const.add(n)
    return const


def recompute_constants(joint: fx.GraphModule) -> int:
    """Marks constants of the joint graph for the backward to recompute rather than the forward to save: a causal
    or packed-sequence mask that Hugging Face builds from `arange` and `cumsum` each step is saved by the min-cut
    partition as a small activation, so the forward computed it every step (3 to 5 launches, ~300 us of host:
    cumsum has no lowering) where folding would have made it free.  Recomputed, it is a constant of both graphs,
    and each folds it.  Marked: constants made with an op we cannot lower (what fold_constants then folds; a
    chain of lowerable ops is left to the regions that read it, which a backward might not fuse: Swin's shifted-
    window mask, rolled and padded), and the constants they are made of; each at most FOLD_LIMIT_BYTES and made
    only of such (one made from a larger constant would have the min-cut save the larger for the backward).
    Returns how many."""
    const, cg = constant_nodes(joint), ComputeGraph(joint.graph)
    small, opaque = set(), set()
    for n in joint.graph.nodes:
        if n not in const or n.op != "call_function":
            continue
        v = n.meta.get("val")
        values = v if isinstance(v, (list, tuple)) else [v]
        inputs = [a for a in n.all_input_nodes if a.op == "call_function"]
        if all(isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() <= FOLD_LIMIT_BYTES for t in values) \
                and all(a in small for a in inputs):
            small.add(n)
            if (n.target is not operator.getitem and not cg.fusible(n)) or any(a in opaque for a in inputs):
                opaque.add(n)
    marked, todo = set(), list(opaque)
    while todo:
        n = todo.pop()
        if n not in marked:
            marked.add(n)
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            todo += [a for a in n.all_input_nodes if a in small]
    return len(marked)


def _foldable(n: fx.Node) -> bool:
    op = n.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if op._schema.is_mutable or "empty" in op.__name__:  # in place, or memory without values
        return False
    v = n.meta.get("val")
    values = v if isinstance(v, (list, tuple)) else [v]
    return all(isinstance(t, torch.Tensor) and t.layout == torch.strided
               and all(isinstance(x, int) for x in (*t.shape, *t.stride())) for t in values)


def _written(n: fx.Node) -> list:
    """The nodes an op writes to (its mutable arguments)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            out += [x for x in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(x, fx.Node)]
    return out


def _materialised(n: fx.Node, const: set) -> bool:
    """A constant that a computed node reads: its value is kept (not one the output returns, which
    would hand every caller the same tensor, and not a many-result op: its pieces are kept instead)."""
    users = set(n.users)
    if any(u.op == "output" for u in users):
        return False
    if isinstance(n.meta.get("val"), (list, tuple)):
        return False
    return any(u not in const for u in users)


def _pays(n: fx.Node, const: set, cg: ComputeGraph) -> bool:
    """Folding pays unless the value and everything it is made from can be lowered and all its
    readers too: then the regions that read it compute it in their index math (arange, full: no
    bytes at all), where a folded buffer would be read from memory."""
    made_of, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in made_of or m.op != "call_function":
            continue
        made_of.add(m)
        todo += m.all_input_nodes
    lowered = all(m.target is operator.getitem or cg.fusible(m) for m in made_of)
    return not lowered or any(u.op == "call_function" and not cg.fusible(u) for u in n.users)


def _evaluate(gm: fx.GraphModule, const: set, frontier: list) -> dict:
    """The frontier's real values, computed by running the constant nodes (fake mode off)."""
    env, out = {}, {}
    wanted = set(frontier)
    with unset_fake_temporarily(), torch.no_grad():
        for n in gm.graph.nodes:
            if n not in const:
                continue
            if n.op == "get_attr":
                env[n] = getattr(gm, n.target)
                continue
            args = torch.fx.node.map_arg(n.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*args, **kwargs)
            v, fake = env[n], n.meta["val"]
            if n in wanted and v.untyped_storage().nbytes() <= FOLD_LIMIT_BYTES \
                    and v.shape == fake.shape and v.stride() == fake.stride() and v.dtype == fake.dtype:
                out[n] = v  # kept only with the layout the graph was traced with
    return out


def fresh_attr(gm, name: str) -> str:
    """`name`, or it with underscores added, free as an attribute of gm (for a constant registered on it)."""
    while hasattr(gm, name):
        name += "_"
    return name
