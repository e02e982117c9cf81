"""Replaces each region's nodes by one call of its kernel module, keeping the graph in topological order."""
from __future__ import annotations

import operator

import networkx as nx
import torch.fx as fx

from .region import Region


def rewrite(gm: fx.GraphModule, regions: list[Region], kernels: list) -> fx.GraphModule:
    """A new GraphModule in which each region is `self.fused_<id>(*inputs)`; prints as Python."""
    owner = {n: r for r in regions for n in r.nodes}
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
        return order[u.nodes[0]] if isinstance(u, Region) else order[u]

    if not nx.is_directed_acyclic_graph(units):
        cyc = nx.find_cycle(units)
        raise RuntimeError("cycle: " + " -> ".join(str(getattr(a, 'name', [x.name for x in a.nodes] if isinstance(a, Region) else a)) for a, b in cyc))
    graph, env = fx.Graph(), {}
    for r, k in zip(regions, kernels):
        gm.add_submodule(k.name, k)
    by_region = dict(zip(regions, kernels))
    for u in nx.lexicographical_topological_sort(units, key=key):
        if isinstance(u, Region):
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
