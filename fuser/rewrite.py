"""Replaces each region's nodes by one call of its kernel module, keeping the graph in topological order."""
from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

from . import indexing as ix
from .graph import meta, static_shape
from .runtime import allocator, fast_views, reinterpret, reuse_buffers, write_outputs_in_place, written_into


class Unbound(Exception):
    """A size symbol no node of the graph gives."""


def bind_sizes(graph: fx.Graph, symbols, made: dict | None = None) -> list:
    """For each size symbol, a node whose value at run time is that size: a SymInt input of the
    graph, or `sym_size`/`sym_stride` of a tensor that has it (inserted after that tensor).  Dynamo
    makes every size symbol one of a graph input's sizes, so one is found for each."""
    made = {} if made is None else made
    out = []
    for sym in symbols:
        node = made.get(sym)
        if node is None:
            node = made[sym] = _find(graph, sym)
        out.append(node)
    return out


def _find(graph: fx.Graph, sym):
    nodes = sorted(graph.nodes, key=lambda n: n.op != "placeholder")  # inputs first
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and ix.expr(v) == sym:
            return n
    for n in nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
            continue
        for op, values in ((torch.ops.aten.sym_size.int, v.shape), (torch.ops.aten.sym_stride.int, v.stride())):
            for d, s in enumerate(values):
                if ix.expr(s) == sym:
                    with graph.inserting_after(n):
                        new = graph.call_function(op, (n, d))
                    new.meta["val"] = s
                    return new
    raise Unbound(f"no input of the graph gives the size {sym}")


def rewrite(gm: fx.GraphModule, regions: list, kernels: list, sizes: dict | None = None) -> fx.GraphModule:
    """A new GraphModule in which each region (or recognised attention: anything with nodes, inputs
    and outputs) is one call of its kernel; prints as Python.  `sizes` maps a region to the nodes
    giving its kernel's size arguments (see `bind_sizes`).

    The GraphModule's forward is the graph's one wrapper: a kernel over static sizes is called with
    output buffers allocated in the program itself (`buf3 = empty_strided_cuda(...)`), a buffer that
    nothing reads any more is handed to the next kernel that needs one of its size, and only the
    inputs a kernel did not get from another kernel of the graph are checked against the layout it
    was made for.  Kernels stay attributes of the GraphModule (named as in the program)."""
    sizes = sizes or {}
    owner = {n: r for r in regions for n in r.nodes}
    by_region = dict(zip(regions, kernels))
    units = nx.DiGraph()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def unit(n):
        return owner.get(n, n)

    for n in gm.graph.nodes:
        units.add_node(unit(n))
    for r in regions:
        for a in [*r.inputs, *sizes.get(r, ())]:
            units.add_edge(unit(a), r)
    for n in gm.graph.nodes:
        if n in owner:
            continue
        for a in n.all_input_nodes:
            if unit(a) is not n:
                units.add_edge(unit(a), n)

    def key(u):
        return order[u.nodes[0]] if u in by_region else order[u]

    graph, env = fx.Graph(), {}
    allocations, ours, allocators, calls = set(), set(), {}, {}
    for u in nx.lexicographical_topological_sort(units, key=key):
        if u not in by_region:
            if any(a not in env for a in u.all_input_nodes):
                continue  # a view used only inside regions: it became index math
            env[u] = graph.node_copy(u, lambda a: env[a])
            continue
        k = by_region[u]
        args = [env[a] for a in [*u.inputs, *sizes.get(u, ())]]
        buffers = k.buffers()
        if buffers is None:  # the kernel allocates its outputs (sizes known only at run time)
            call = graph.call_function(k.entry(), tuple(args))
            outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(u.outputs))]
        else:
            bufs = []
            for o, (shape, stride, dtype, device) in zip(u.outputs, buffers):
                if (dst := written_into(u, o)) is not None:  # a scatter: stored into its input in place
                    bufs.append(env[dst])
                    continue
                alloc = allocators.get(device) or allocators.setdefault(device, allocator(device))
                bufs.append(graph.create_node("call_function", alloc, (shape, stride, dtype), name=f"buf{len(allocations)}"))
                allocations.add(bufs[-1])
            call = graph.call_function(k.entry(), (*args, *bufs))
            calls[call] = k
            outs = [call] if len(bufs) == 1 else [graph.call_function(operator.getitem, (call, i)) for i in range(len(bufs))]
            ours.update(outs)
        for o, new in zip(u.outputs, outs):
            env[o] = new
            new.meta = dict(o.meta)
    graph.eliminate_dead_code()
    exact = ours | {n for n in graph.nodes if n.meta.get("folded") or _contiguous_by_construction(n)}
    fast_views(graph, exact)
    for call, k in calls.items():  # a kernel checks the inputs whose layout (and 16-byte alignment) the graph does not fix
        k.checked = tuple(i for i, a in enumerate(call.args[:len(k.in_sigs)]) if not _fixed(a, exact))
    in_place = write_outputs_in_place(graph, allocations)
    reuse_buffers(graph, allocations & set(graph.nodes))
    new = fx.GraphModule(gm, graph)
    for k in kernels:
        new.add_submodule(k.name, k)
    new.recompile()
    new.in_place = in_place  # the kernels writing over an input (for the report)
    return new


# eager ops whose result is a new contiguous tensor whatever their inputs' layouts (their meta functions,
# which the fake tensors follow, and their kernels allocate it so): a view of one needs no layout check
_NEW_CONTIGUOUS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                   torch.ops.aten.baddbmm.default, torch.ops.aten._addmm_activation.default}


def _fixed(a, exact: set) -> bool:
    """Whether tensor `a`'s layout and 16-byte alignment are the traced ones by construction: a buffer of the
    wrapper, an eager matmul's result, or a view of one at an offset of a multiple of 16 bytes (a split's
    second piece may start anywhere: its pointer is checked, as the compiled kernel assumes alignment)."""
    if a in exact:
        return True
    if a.target is not reinterpret or a.args[0] not in exact:
        return False
    v = meta(a)
    return v is not None and a.args[3] * v.element_size() % 16 == 0


def _contiguous_by_construction(n) -> bool:
    v = meta(n)
    return n.target in _NEW_CONTIGUOUS and v is not None and v.is_contiguous() and static_shape(v)
