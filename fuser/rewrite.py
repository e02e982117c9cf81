"""Replaces each region's nodes by one call of its kernel module, keeping the graph in topological order."""
from __future__ import annotations

import operator

import networkx as nx
import torch.fx as fx


def rewrite(gm: fx.GraphModule, regions: list, kernels: list) -> fx.GraphModule:
    """A new GraphModule in which each region (or recognised attention: anything with nodes, inputs
    and outputs) is one `self.<kernel name>(*inputs)` call; prints as Python."""
    owner = {n: r for r in regions for n in r.nodes}
    by_region = dict(zip(regions, kernels))
    units = nx.DiGraph()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def unit(n):
        return owner.get(n, n)

    for n in gm.graph.nodes:
        units.add_node(unit(n))
    for r in regions:
        for a in r.inputs:
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
    for r, k in zip(regions, kernels):
        gm.add_submodule(k.name, k)
    for u in nx.lexicographical_topological_sort(units, key=key):
        if u in by_region:
            k = by_region[u]
            call = graph.call_module(k.name, tuple(env[a] for a in u.inputs))
            for i, o in enumerate(u.outputs):
                env[o] = graph.call_function(operator.getitem, (call, i))
                env[o].meta = dict(o.meta)
            continue
        if any(a not in env for a in u.all_input_nodes):
            continue  # a view used only inside regions: it became index math
        env[u] = graph.node_copy(u, lambda a: env[a])
    new = fx.GraphModule(gm, graph)
    new.graph.eliminate_dead_code()
    new.recompile()
    return new
