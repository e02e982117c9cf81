"""The partitioner: groups compute nodes into regions where one kernel pays.

Walks the graph in order and tries to merge each fusible node's group with the groups of its
producers.  A merge is kept when (1) the nodes can share one iteration space, (2) the merged group
leaves the graph acyclic, and (3) the cost model's time for the merged kernel beats the two apart.
Then a group that only one other group reads tries to join it whole (under the same three tests), and a
reduction's group tries to join every group around it at once (`absorb_whole`: the pairwise test misses a
kernel that only pays whole, a norm over few long rows).
The support predicate is pluggable (`supported`), as in torch.fx's CapabilityBasedPartitioner.
A `sealed` node ends its group: no member of a merged group reads it (the pipeline seals a
reduction whose readers codegen could not serve in one kernel, and partitions that region again).
"""
from __future__ import annotations

import operator
from typing import Callable

import networkx as nx
import torch.fx as fx

from . import indexing as ix
from . import ops
from .cost import Cost, eager_cost, eager_slow_path, eager_time, host_bound, region_cost, tensor_bytes
from .graph import OWN_KERNEL, ComputeGraph, cpu_scalar, is_size, meta, numel
from .plan import NUM_SMS
from .region import PERSISTENT_MAX_R, Region, analyze, reduction_space
from .runtime import updated_in_place


HELD_FLOOR = 1 << 20  # bytes a sibling merge may hold early whatever it saves (a LayerNorm's weight and bias sums)
ALONE_MARGIN = 1.25  # a lone op runs as our kernel only where the model has it this much faster than eager's


class Partitioner:
    def __init__(self, graph: fx.Graph, supported: Callable[[fx.Node], bool] | None = None,
                 cg: ComputeGraph | None = None, sealed: frozenset = frozenset(), first_id: int = 0,
                 apart: frozenset = frozenset(), launch_host: bool = True):
        self.cg = cg or ComputeGraph(graph)
        self.launch_host = launch_host  # launches cost host time (cost.host_bound); not under CUDA graphs
        self.supported = supported or (lambda n: True)
        self.sealed, self.first_id = sealed, first_id  # first_id: the id of the first region made
        self.apart = apart  # nodes of a region codegen refused: no sibling joins their groups (the pipeline)
        self.dag = nx.DiGraph()
        for n in self.cg.nodes:
            if self.cg.is_compute(n) or n.op in ("placeholder", "get_attr", "output"):
                self.dag.add_node(n)
        for n in list(self.dag.nodes):
            for c in self.cg.consumers(n):
                self.dag.add_edge(n, c)
            for p in self._size_sources(n):  # a size read off a tensor orders its producer first too
                if p in self.dag and p is not n:
                    self.dag.add_edge(p, n)
        self.group: dict = {}
        self.members: dict[int, set] = {}
        self.spans: dict[int, tuple] = {}  # group of several nodes -> (first, last) of its nodes in graph order
        self.reasons: dict = {}
        self.kept_apart: list[str] = []  # sibling merges refused for memory (held_longer), for the report
        self.costs: dict = {}  # region -> Cost, for the regions partition() returns
        self._eager: dict = {}  # node -> eager_time
        # pointwise outputs of several shapes (horizontal fusion): for siblings, not while producers and
        # consumers merge node by node (a broadcast consumer would take its producer's kernel, recomputing
        # it per element, where a reduction after the consumer could have taken the consumer)
        self.widest = False

    def _size_sources(self, n) -> set:
        """The nodes whose tensors n's sizes are read off (sym_size of them, through views and size
        arithmetic): data_inputs leaves sizes out, but a region that made such a tensor and also
        reads n's result would be a cycle (a recomputed GELU whose sym_size shapes the view a
        matmul reads, and a product of that matmul in the same region)."""
        out, stack, seen = set(), [a for a in n.all_input_nodes], set()
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if is_size(a):
                for t in a.all_input_nodes:
                    if is_size(t):
                        stack.append(t)
                    elif t.op == "call_function" and self.cg.transparent(t):
                        out.update(self.cg.data_inputs(t))
                        stack.extend(x for x in t.all_input_nodes if is_size(x))
                    else:
                        out.add(t)
            elif a.op == "call_function" and self.cg.transparent(a):
                stack.extend(a.all_input_nodes)  # a view's size arguments
        return out

    def candidate(self, n) -> bool:
        return self.cg.is_compute(n) and self.cg.fusible(n) and self.supported(n)

    # ------------------------------------------------------------------ verbs
    def time(self, nodes) -> float:
        """Modelled seconds: eager for a lone op (and its getitems), else the fused kernel's."""
        if sum(n.target is not operator.getitem for n in nodes) <= 1:
            return sum(self.eager(n) for n in nodes)
        region = self.region(nodes)
        return float("inf") if region is None else self.cost(region).time_fused()

    def eager(self, n) -> float:
        """Modelled seconds of n as its own eager kernel, worked out once a node (merges ask often)."""
        t = self._eager.get(n)
        if t is None:
            t = self._eager[n] = eager_time(self.cg, n)
        return t

    def region(self, nodes, rid=0) -> Region | None:
        space = analyze(self.cg, list(nodes), self.widest)
        if space is None:
            return None
        if self.checks_in_part(nodes, space):
            return None
        region = Region(self.cg, list(nodes), space, rid)
        if region.size_symbols and any(isinstance(self.cg.info[n], ops.Scatter) for n in region.nodes):
            return None  # the wrapper hands a scatter its input as the output buffer where sizes are static only
        return region

    def checks_in_part(self, nodes, space) -> bool:
        """Whether a gather or a one-hot scatter, whose index the kernel checks where it loads it, would be computed
        at fewer elements than it has: the group's space is smaller, or a member reads it through a view with fewer
        elements (a slice or a select: `embedding(ids, w)[0]`, then broadcast wider).
        An index out of range where nothing is computed would not raise, as eager raises: such a group is not
        formed."""
        hint = self.cg.sizes.hint
        total = hint(ix.numel(space.full))
        for n in nodes:
            if not (isinstance(k := self.cg.info.get(n), ops.Layout) and k.indirect or k is ops.ONE_HOT):
                continue
            if hint(numel(n)) > total or any(c in nodes and hint(self.cg.read_elems(c, n)) < hint(numel(n))
                                             for c in self.cg.consumers(n)):
                return True
        return False

    def cost(self, region: Region) -> Cost:
        """The region's cost; that of a region partition() returns is kept for the pipeline to hand on."""
        return self.costs.get(region) or region_cost(region)

    def creates_cycle(self, a: set, b: set) -> bool:
        """Would a path leave the merged group and come back into it?  Groups already formed run as one kernel
        each (every input before every output): a path that reaches one member goes on from all of them (a
        sibling merge beside a group that both feeds one sibling and reads the other is a cycle of kernels,
        though no node path is one: Qwen2-MoE's router gradient).  Nodes past the merged group in graph order
        cannot lead back, unless through a group with members on both sides: the bound moves past those."""
        merged = a | b
        spans = [span for g, span in self.spans.items() if not self.members[g] <= merged]
        limit, moved = max(self.cg.order[n] for n in merged), True
        while moved:
            moved = False
            for lo, hi in spans:
                if lo <= limit < hi:
                    limit, moved = hi, True
        stack = [s for n in merged for s in self.dag.successors(n) if s not in merged]
        seen = set()
        while stack:
            n = stack.pop()
            if n in seen or self.cg.order[n] > limit:
                continue
            if n in merged:
                return True
            for m in self.members.get(self.group.get(n)) or (n,):  # (n is outside merged: so is its group)
                seen.add(m)
                stack.extend(self.dag.successors(m))
        return False

    def reads_sealed(self, nodes: set) -> fx.Node | None:
        """A sealed member of `nodes` that another member reads (directly or through its getitems)."""
        for s in self.sealed & nodes:
            for c in self.cg.consumers(s):
                if any(r in nodes for r in (self.cg.consumers(c) if c.target is operator.getitem else [c])):
                    return s
        return None

    def try_merge(self, ga: int, gb: int) -> bool:
        a, b = self.members[ga], self.members[gb]
        merged = a | b
        if self.region(merged) is None or self.creates_cycle(a, b):
            return False
        if (s := self.reads_sealed(merged)) is not None:
            for n in merged:
                self.reasons.setdefault(n, f"{s.name}'s result is read at other rows than its own, which one "
                                           "kernel cannot serve: it ends its kernel")
            return False
        if self.time(merged) >= self.time(a) + self.time(b) and not _forced(a, b):
            return False
        self.join(ga, gb)
        return True

    def join(self, ga: int, gb: int):
        """Group gb's nodes become group ga's."""
        merged = self.members[ga] | self.members[gb]
        for n in self.members[gb]:
            self.group[n] = ga
        self.members[ga] = merged
        del self.members[gb]
        orders = [self.cg.order[n] for n in merged]
        self.spans.pop(gb, None)
        self.spans[ga] = (min(orders), max(orders))

    def partition(self) -> list[Region]:
        for n in self.cg.nodes:
            if not self.candidate(n):
                continue
            if updated_in_place(n) is not None:
                self.reasons[n] = "a mutated input's new value, written into it in place by eager's in-place op"
                continue
            if isinstance(self.cg.info[n], ops.Reduction) and reduction_space(n).r == 0:
                self.reasons[n] = "a reduction over an empty dim: eager gives the identity (or raises)"
                continue
            if self.long_argmax(n):
                self.reasons[n] = (f"{self.cg.info[n].combine} over a row length that may pass {PERSISTENT_MAX_R} "
                                   "(a symbolic size): codegen has no looped form of it")
                continue
            gid = len(self.group)
            self.group[n] = gid
            self.members[gid] = {n}
            for p in self.cg.data_inputs(n) if n.target is not operator.getitem else [n.args[0]]:
                if p in self.group and self.group[p] != self.group[n]:
                    merged = self.try_merge(self.group[p], self.group[n])
                    if not merged and n.target is operator.getitem:
                        self.reasons[n] = "a component of an op that stays eager"
        self.absorb_producers()
        self.absorb_whole()
        self.widest = True
        self.absorb_siblings()
        self.absorb_producers()  # siblings merged: a producer they both read through a view may now have one reader
        regions = []
        for gid, nodes in self.members.items():
            compute = [n for n in nodes if n.target is not operator.getitem]
            own = self.own_kernel(compute)
            if len(compute) < 2 and not own:
                for n in compute:
                    self.reasons.setdefault(n, "alone: no producer or consumer it pays to fuse with (k = 1)")
                continue
            region = self.region(nodes, self.first_id + len(regions))
            if region is None:
                continue
            cost = self.cost(region)
            if not own and not self.pays(cost, nodes):
                for n in compute:
                    self.reasons[n] = "fusing its group would not pay by the cost model"
                continue
            self.costs[region] = cost
            regions.append(region)
        return regions

    def own_kernel(self, compute: list) -> bool:
        """A lone compute node that runs as our kernel all the same."""
        return len(compute) == 1 and (compute[0].meta.get(OWN_KERNEL, False) or self.pays_alone(compute[0]))

    def pays(self, cost: Cost, nodes) -> bool:
        """Whether the group's one kernel (of cost `cost`) beats its ops run eagerly, each a launch the host issues."""
        eager = sum(n.target is not operator.getitem for n in nodes)
        return self.host_bound(cost.time_fused(), 1, 0) < \
            self.host_bound(sum(self.eager(n) for n in nodes), 0, eager)

    def host_bound(self, gpu_s: float, kernels: int, eager_ops: int) -> float:
        """cost.host_bound where launches cost host time, else the GPU's time (CUDA graphs replay them)."""
        return host_bound(gpu_s, kernels, eager_ops) if self.launch_host else gpu_s

    def as_run(self, nodes) -> tuple[float, int, int]:
        """(modelled GPU seconds, kernels of ours, eager ops) of a group as partition() runs it: one kernel where
        it keeps the group's region, else each op eagerly."""
        compute = [n for n in nodes if n.target is not operator.getitem]
        own = self.own_kernel(compute)
        region = self.region(nodes) if len(compute) > 1 or own else None
        cost = self.cost(region) if region is not None else None
        if cost is not None and (own or self.pays(cost, nodes)):
            return cost.time_fused(), 1, 0
        return sum(self.eager(n) for n in nodes), 0, len(compute)

    def absorb_whole(self):
        """A reduction's group joins every group around it that one kernel can run with it, all at once, where the
        model has that kernel beating them apart, the host's time to issue each launch counted (cost.host_bound).
        Merged pair by pair, a norm over fewer rows than processors, each row looped over, was split into pieces
        and eager reductions: each merge was charged the few programs' GPU time, while the launches the whole
        saves came one at a time (layer_norm over [1, 128256] bf16, H200 runs 218-219: 3 launches 0.07-0.13 ms,
        one kernel 0.045, Inductor 0.041; softmax, log_softmax and RMSNorm alike, bench/few_rows.py).  Only for
        reductions over fewer programs than processors, where the pairwise test splits them; elsewhere the
        partition stays as the pairwise merges made it."""
        for n in self.cg.nodes:
            gid = self.group.get(n)
            if gid is None or not isinstance(self.cg.info[n], ops.Reduction) or self.members[gid] & self.apart:
                continue
            region = self.region(self.members[gid])
            if region is None or self.cost(region).programs >= NUM_SMS:
                continue
            parts = self.neighbourhood(gid)
            if len(parts) > 1 and self.whole_pays(parts):
                for other in parts[1:]:
                    self.join(gid, other)

    def neighbourhood(self, gid: int) -> list[int]:
        """gid and the groups that feed it or read it, transitively, that one kernel can run with it (one space,
        no cycle, no sealed reduction read, no node of a region codegen refused), in the order found."""
        parts, nodes, todo = [gid], set(self.members[gid]), [gid]
        while todo:
            for other in self._adjacent(self.members[todo.pop()]):
                theirs = self.members[other]
                if other in parts or theirs & self.apart or self.region(nodes | theirs) is None \
                        or self.creates_cycle(nodes, theirs) or self.reads_sealed(nodes | theirs) is not None:
                    continue
                parts.append(other)
                nodes |= theirs
                todo.append(other)
        return parts

    def _adjacent(self, nodes: set) -> list[int]:
        """The groups of the nodes that `nodes` read or are read by, in graph order."""
        near = {x for n in nodes for x in (*self.cg.data_inputs(n), *self.cg.consumers(n)) if x not in nodes}
        near |= {n.args[0] for n in nodes if n.target is operator.getitem and n.args[0] not in nodes}
        near = sorted((x for x in near if x in self.group), key=self.cg.order.__getitem__)
        return list(dict.fromkeys(self.group[x] for x in near))

    def whole_pays(self, parts: list[int]) -> bool:
        """Whether the groups as one kernel beat them as partition() would run them apart."""
        region = self.region(set().union(*(self.members[g] for g in parts)))
        if region is None or region.looped_argmax:
            return False
        gpu, kernels, eager = (sum(t) for t in zip(*(self.as_run(self.members[g]) for g in parts)))
        return self.host_bound(self.cost(region).time_fused(), 1, 0) < self.host_bound(gpu, kernels, eager)

    def long_argmax(self, n) -> bool:
        """An argmax or argmin whose row length is symbolic and may pass what one block holds: its region
        would be refused at run time, at such a length, and the whole graph with it."""
        kind = self.cg.info[n]
        if not isinstance(kind, ops.Reduction) or kind.combine not in ("argmax", "argmin"):
            return False
        r = reduction_space(n).r
        return not ix.expr(r).is_Integer and not self.cg.sizes.bounds(r).upper <= PERSISTENT_MAX_R

    def pays_alone(self, n) -> bool:
        """A lone pointwise op or copy that our kernel runs faster than eager's by the model, with a
        margin for the launch: where eager's kernel is not vectorised (a broadcast, cast or permuted
        operand, at the sizes where bandwidth counts: grad_weight times the loss's 0-d fp32 gradient,
        232 us eager; GQA's repeated K and V), or where eager launches two kernels for it (`where` with
        a number, or the generator it reads, at the sizes where the launch counts: the NaN fix-up after a
        decode step's SDPA, its KV cache's positions `arange(1) + length`)."""
        if not (eager_slow_path(self.cg, n) or eager_cost(self.cg, n, generators=True)[1] > 1):
            return False
        region = self.region({n})
        return region is not None and self.cost(region).time_fused() * ALONE_MARGIN < self.eager(n)

    def absorb_producers(self):
        """A group whose data only one other group reads joins that group.  Merged pairwise, node by
        node, its nodes were outputs of each pair and had to share the pair's shape; joined whole, it
        has no outputs, and a view between it and its consumers (InstanceNorm's and GroupNorm's
        gradient viewed from [N, C, H, W] to [1, N*C, H, W]) is index math."""
        for gid in list(self.members):
            if gid not in self.members:
                continue
            nodes = self.members[gid]
            targets = {self.group.get(c) for n in nodes for c in self.cg.consumers(n) if c not in nodes}
            if len(targets) == 1 and None not in targets:
                self.try_merge(targets.pop(), gid)

    def absorb_siblings(self):
        """A group joins a sibling, where the model says it pays: a group that reads the same tensor
        (the input read once, a launch fewer: the backward's recomputed GELU beside the GELU's own
        gradient, vit's step ran 8 eager GELUs in run 66; a LayerNorm recomputed for a weight's
        gradient beside the LayerNorm's gradient), or one that reads a tensor of the same producing
        group (a launch fewer: a LayerNorm's weight and bias gradients, two column sums over the
        gradient kernel's outputs).  Horizontal fusion: the two share no path (try_merge's cycle test),
        and run on one device.  Over symbolic sizes too (a merged pair of spaces there prints `Mod` in its
        index math: CUDA run 77 met it before the printer knew it).  A merged region codegen refuses (an
        argmax over rows too long, joined to a sum) costs its groups their fusion: the pipeline
        partitions again with its nodes `apart`."""
        for gid in list(self.members):
            nodes = self.members.get(gid)
            if nodes is None or nodes & self.apart:
                continue
            # a 0-d CPU scalar is read on any device: not a tie between groups, but where the group runs on CPU
            on_cpu = _placed(nodes) == {"cpu"}
            inputs = {x for n in nodes for x in self.cg.data_inputs(n)
                      if x not in nodes and (on_cpu or not cpu_scalar(meta(x)))}
            producers = {self.group[x] for x in inputs if x in self.group}
            # a group reading this one is no sibling: joined, it would recompute this group's output per element
            consumers = {self.group.get(c) for n in nodes for c in self.cg.consumers(n)}
            near = inputs | {m for p in producers for m in self.members.get(p, ())}
            siblings = sorted({self.group.get(c) for x in near for c in self.cg.consumers(x)} - {gid, None}
                              - producers - consumers)
            for other in siblings:
                theirs = self.members.get(other)
                if theirs is None or theirs & self.apart or _placed(theirs) != _placed(nodes) \
                        or (not on_cpu and _devices(theirs) != _devices(nodes)):
                    continue
                if (held := self.held_longer(theirs, nodes)) is not None:
                    self.kept_apart.append(held)
                    continue
                if self.try_merge(other, gid):
                    break

    def held_longer(self, a: set, b: set) -> str | None:
        """Why two siblings stay apart for memory, or None.  Merged, they run as one kernel as soon as the
        inputs of both are ready: the later sibling's outputs are then made early and held across every
        kernel in between.  Refused where those outputs are more bytes than the reads the merge saves and
        at least HELD_FLOOR (Inductor refuses horizontal fusions of nodes 64 apart for the same reason,
        `are_long_distant_nodes`).  Four layers' copies of one bias, siblings by the bias they read,
        were all held from the first layer on."""
        order, hint = self.cg.order, self.cg.sizes.hint
        first, later = sorted((a, b), key=lambda g: min(order[n] for n in g))
        read = [{x for n in g for x in self.cg.data_inputs(n) if x not in g} for g in (first, later)]
        outs = {n for n in later if any(c not in later for c in self.cg.consumers(n))}
        held = sum(hint(tensor_bytes(n)) for n in outs if meta(n) is not None)
        saved = sum(hint(tensor_bytes(x)) for x in read[0] & read[1] if meta(x) is not None)
        if held <= max(saved, HELD_FLOOR):
            return None
        ready = max([min(order[n] for n in first)] + [order[x] for x in read[0] | read[1]])  # the merged kernel's place
        between = self.cg.nodes[ready + 1:min(order[n] for n in later)]
        if not any(self.cg.is_compute(n) and n.target is not operator.getitem and n not in first for n in between):
            return None
        return (f"{min(later, key=order.get).name} not joined to {min(first, key=order.get).name}: its outputs "
                f"({held / 2**20:.1f} MiB) would be made before the ops between them and held across them, "
                f"for {saved / 2**20:.1f} MiB of reads saved")

    def unfused(self, regions) -> list[tuple[fx.Node, str]]:
        """Every compute node left to eager, with the reason."""
        inside = {n for r in regions for n in r.nodes}
        out = []
        for n in self.cg.nodes:
            if not self.cg.is_compute(n) or n in inside or n.target is operator.getitem:
                continue
            kind = self.cg.info[n]
            reason = kind.reason if isinstance(kind, ops.Opaque) else self.reasons.get(
                n, "not supported by the support predicate" if not self.supported(n) else "left out")
            out.append((n, reason))
        return out


def _devices(nodes) -> set:
    return {v.device for n in nodes if (v := meta(n)) is not None and not cpu_scalar(v)}


def _placed(nodes) -> set:
    """The device types of every tensor the nodes make, 0-d CPU ones included."""
    return {v.device.type for n in nodes if (v := meta(n)) is not None}


def _forced(a: set, b: set) -> bool:
    """A multi-output op and its getitems always travel together."""
    return any(n.target is operator.getitem for n in b) and len(b) == 1

