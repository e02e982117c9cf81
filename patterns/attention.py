"""Attention written out by hand: Q·Kᵀ → score modifications → softmax → ·V, found in the ATen graph.

Eager attention (Hugging Face's "eager", most research code) writes the N×N scores to HBM several
times.  Recognised here, it becomes one flash-attention kernel (codegen/attention.py) in which the
score modifications found between the two matmuls run on each tile.  Shapes as AOT Autograd leaves
them: each matmul is `bmm(view(expand(x)), view(expand(y)))` over [B*H, ., .]; repeat_kv is
`view(clone(expand(unsqueeze(kv, 2))))`, which we undo so shared K/V heads are read, not copied.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch._prims_common import get_computation_dtype
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_int, statically_known_true

from fuser import ops
from fuser.codegen.attention import IndexMask, LinearBias, structure_of
from fuser.indexing import expr
from fuser.graph import (ComputeGraph, current, fake_mode_of, fold_fixed_sizes, fold_into, insert, packet, is_generator, meta, operands,
                         real_tensors, run_node, shape)

aten = torch.ops.aten
_VIEW = {aten.view, aten._unsafe_view, aten.reshape}
_SAME = {aten.expand, aten.clone, aten.alias}  # no change of values on the way to a bmm operand



@dataclass(eq=False)
class Attention:
    """One recognised attention: what the kernel reads, what it replaces, and the score chain."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scores: fx.Node               # the [B, H, M, N] view of Q·Kᵀ: `s` in the score mod
    chain: list                   # pointwise nodes from `scores` to the softmax input, in graph order
    extras: list                  # tensors the chain reads besides the scores (masks, biases)
    out: fx.Node                  # the [B, H, M, D] result
    nodes: list = field(default_factory=list)  # every node the kernel replaces
    id: int = 0
    dropout: float = 0.0          # probability of dropout on the softmax's output (training)
    safe: bool = False            # torch's _safe_softmax: a row whose every score is -inf gives 0 (SDPA's math
                                  # path under compile), not eager softmax's NaN

    @property
    def inputs(self) -> list:
        return [self.q, self.k, self.v, *self.extras]

    @property
    def outputs(self) -> list:
        return [self.out]

    kind = "attention"


def resolved(a: Attention) -> Attention:
    """`a` with its operands as lowerings of the attentions found with it left them (one chained to another
    with no projection between reads the node the first one's output replaced)."""
    return replace(a, q=current(a.q), k=current(a.k), v=current(a.v), extras=[current(e) for e in a.extras])


def _operand4(n, dims4, shared_heads: bool = False):
    """The 4-D tensor behind a bmm operand `view(expand/clone(x))`, and the nodes walked.
    `shared_heads` (K and V): x may have one head that the expand broadcasts to all (multi-query
    attention written with broadcasting, Falcon's), returned as it is."""
    walked = []
    if packet(n) not in _VIEW:
        return None, walked
    walked.append(n)
    n = n.args[0]
    while packet(n) in _SAME and shape(n) == dims4:
        walked.append(n)
        n = n.args[0]
    if shape(n) == dims4:
        return n, walked
    one_head = (dims4[0], 1, *dims4[2:])
    if shared_heads and walked and packet(walked[-1]) is aten.expand and tuple(shape(n)) == one_head:
        return n, walked
    return None, walked


def undo_repeat_kv(kv, walked):
    """view(clone(expand(unsqueeze(x, 2)))) -> x: the kernel maps query heads onto shared K/V heads."""
    n, seen = kv, []
    if packet(n) in _VIEW:
        seen.append(n)
        n = n.args[0]
        if packet(n) is aten.clone:
            seen.append(n)
            n = n.args[0]
        if packet(n) is aten.expand and len(shape(n)) == 5:
            seen.append(n)
            n = n.args[0]
            if packet(n) is aten.unsqueeze and n.args[1] in (2, -3):
                seen.append(n)
                walked.extend(seen)
                return n.args[0]
    return kv


def _swaps_last_two(n) -> bool:
    """permute(x, [0, 1, 3, 2]) (after AOT Autograd) or transpose(x, -1, -2) (traced before it)."""
    if packet(n) is aten.permute:
        return list(n.args[1]) == [0, 1, 3, 2]
    return packet(n) is aten.transpose and sorted(d % 4 for d in n.args[1:3]) == [2, 3]


def dropout_site(n):
    """(probability, nodes, input) where n is dropout in training: native_dropout's first result
    (CUDA), or x * (bernoulli_(empty_like(x), 1 - p) / (1 - p)) (dropout's CPU form); else None."""
    if n.target is operator.getitem and n.args[1] == 0 and packet(n.args[0]) is aten.native_dropout:
        drop = n.args[0]
        if len(drop.users) == 1 and (len(drop.args) < 3 or drop.args[2] in (True, None)):
            return float(drop.args[1]), [n, drop], drop.args[0]
    if packet(n) is aten.mul and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args):
        for x, m in (n.args, n.args[::-1]):
            if packet(m) is aten.div_ and len(m.users) == 1 and packet(m.args[0]) is aten.bernoulli_:
                draw = m.args[0]
                keep = draw.args[1] if len(draw.args) > 1 else None
                if isinstance(keep, float) and m.args[1] == keep and packet(draw.args[0]) is aten.empty_like \
                        and draw.args[0].args[0] is x and len(draw.users) == 1 and 0 < keep <= 1:
                    return 1.0 - keep, [n, m, draw, draw.args[0]], x
    return None


def safe_rows(p) -> list:
    """torch's _safe_softmax as decomposed: where(not any(not (x == -inf)), 0, softmax(x)) (or with
    all(x == -inf)): its nodes other than the softmax, or [] if p is not that."""
    if packet(p) is not aten.where or len(p.args) != 3 or not isinstance(p.args[0], fx.Node):
        return []
    cond, zero, inner = p.args
    x, _ = _softmax_input(inner)
    if x is None or not _is_zero(zero):
        return []
    nodes = [p] + ([zero] if isinstance(zero, fx.Node) else [])
    n = cond
    if packet(n) is aten.logical_not and packet(n.args[0]) is aten.any:
        nodes += [n, n.args[0]]
        n = n.args[0].args[0]
        if packet(n) is not aten.logical_not:
            return []
        nodes.append(n)
        n = n.args[0]
    elif packet(n) is aten.all:
        nodes.append(n)
        n = n.args[0]
    else:
        return []
    if packet(n) is not aten.eq or n.args[0] is not x or n.args[1] != float("-inf"):
        return []
    return nodes + [n]


def _is_zero(z) -> bool:
    if isinstance(z, (int, float)):
        return z == 0
    return packet(z) in (aten.full_like, aten.zeros_like, aten.full, aten.scalar_tensor) and \
        (packet(z) is aten.zeros_like or z.args[-1 if packet(z) is aten.scalar_tensor else 1] == 0)


def _softmax_input(p):
    """X when p is the decomposed softmax exp(X - amax(X)) / sum(exp(...)) over the last dim."""
    if packet(p) is not aten.div or not isinstance(p.args[1], fx.Node):
        return None, []
    e, total = p.args
    if packet(e) is not aten.exp or packet(total) is not aten.sum or total.args[0] is not e:
        return None, []
    d = e.args[0]
    if packet(d) is not aten.sub:
        return None, []
    x, m = d.args
    last = len(shape(x)) - 1
    if packet(m) is not aten.amax or m.args[0] is not x:
        return None, []
    if ops.reduction_dims(m) != (last,) or ops.reduction_dims(total) != (last,):
        return None, []
    return x, [m, d, e, total, p]


def _chain(x, scores, cg: ComputeGraph):
    """Pointwise nodes that carry the scores to x, and the other tensors they read; None if not a chain."""
    depends: dict = {}

    def dep(n):
        if n is scores:
            return True
        if not isinstance(n, fx.Node) or cg.order[n] < cg.order[scores]:
            return False
        if n not in depends:
            depends[n] = any(dep(a) for a in operands(n))
        return depends[n]

    chain, extras, stack = [], [], [x]
    while stack:
        n = stack.pop()
        if n is scores or n in chain:
            continue
        if not isinstance(cg.info.get(n), ops.Pointwise) or shape(n) != shape(scores):
            return None
        chain.append(n)
        for a in operands(n):
            if dep(a):
                stack.append(a)
            elif is_generator(a) and not operands(a) and meta(a).numel() == 1:
                chain.append(a)  # a constant (masked_fill's -inf): a literal in the kernel, not a load
            elif a not in extras:
                extras.append(a)
    return sorted(chain, key=cg.order.__getitem__), extras


def _broadcasts_to(small, big) -> bool:
    """Whether a tensor of shape `small` broadcasts to `big` unchanged, asked of the sizes' fake values, whose shape
    environment knows what the trace proved: MPT slices its ALiBi bias from `max(0, L - s)`, a size of
    `L - Max(0, L - s)` equal to s by a guard the add took (not by its expression)."""
    if len(small) > len(big):
        return False
    return all(statically_known_true(x == 1) or statically_known_true(x == y) for x, y in zip(reversed(small), reversed(big)))


def _ancestors(n, stop_before: int, cg: ComputeGraph) -> set:
    seen, stack = set(), [n]
    while stack:
        a = stack.pop()
        if a in seen or cg.order[a] < stop_before:
            continue
        seen.add(a)
        stack.extend(a.all_input_nodes)
    return seen


def match(pv: fx.Node, cg: ComputeGraph, notes: list | None = None) -> Attention | None:
    """The attention whose final matmul is `pv`, if the graph around it is one.  `notes`: where a line goes for an
    attention found whole but for its scores or probabilities read outside it (not a silent miss)."""
    if packet(pv) is not aten.bmm:
        return None
    users = list(pv.users)
    if len(users) != 1 or packet(users[0]) not in _VIEW or len(shape(users[0])) != 4:
        return None
    out = users[0]
    b, h, m, dv = shape(out)
    if not dv.is_Integer:
        return None  # the kernel is built for static head dims; batch, heads and lengths may vary
    p, walked_p = _operand4(pv.args[0], (b, h, m, shape(pv.args[0])[-1]))
    if p is None:
        return None
    dropout = 0.0
    while len(shape(p)) == 4:  # casts, same-shape views (Falcon), dropout(eval); dropout in training
        if packet(p) in (aten._to_copy, aten.clone, aten.alias) or (
                packet(p) in _VIEW and isinstance(p.args[0], fx.Node) and shape(p.args[0]) == shape(p)):
            walked_p.append(p)
            p = p.args[0]
        elif not dropout and (found := dropout_site(p)) is not None:
            dropout, walked, p = found
            walked_p += walked
        else:
            break
    safe = safe_rows(p)
    if safe:
        walked_p += safe
        p = p.args[2]
    x, soft = _softmax_input(p)
    if x is None:
        return None
    n = shape(x)[-1]
    v, walked_v = _operand4(pv.args[1], (b, h, n, dv), shared_heads=True)
    if v is None:
        return None
    v = undo_repeat_kv(v, walked_v)
    # walk back from the softmax input to Q·Kᵀ
    candidates = [a for a in _ancestors(x, 0, cg) if packet(a) is aten.bmm and len(a.users) == 1
                  and packet(next(iter(a.users))) in _VIEW and shape(next(iter(a.users))) == (b, h, m, n)]
    if not candidates:
        return None
    qk = max(candidates, key=cg.order.__getitem__)  # the nearest: earlier layers are ancestors too
    scores = next(iter(qk.users))
    d = shape(qk.args[0])[-1]  # Q's and K's head dim: V's may differ (MLA: DeepSeek's 192 and 128)
    if not d.is_Integer:
        return None
    found = _chain(x, scores, cg) if x is not scores else ([], [])
    if found is None:
        return None
    chain, extras = found
    q, walked_q = _operand4(qk.args[0], (b, h, m, d))
    kt, walked_k = _operand4(qk.args[1], (b, h, d, n), shared_heads=True)
    if q is None or kt is None or not _swaps_last_two(kt):
        return None
    walked_k.append(kt)
    k = undo_repeat_kv(kt.args[0], walked_k)
    if shape(k)[:2] != (b, shape(v)[1]) or shape(k)[2:] != (n, d) or shape(v)[1] == 0 or h % shape(v)[1]:
        return None
    if meta(q).dtype != meta(k).dtype or meta(k).dtype != meta(v).dtype:
        return None
    for e in extras:  # masks and biases, broadcast over [B, H, M, N], not computed from V
        if meta(e) is None or len(shape(e)) > 4 or not _broadcasts_to(meta(e).shape, meta(scores).shape):
            return None
        if v in _ancestors(e, cg.order[v], cg):
            return None
    core = [qk, scores, *chain, *soft, *walked_p, pv, out]
    owned = set(core)
    outside = sorted({u.name for n in core if n is not out for u in n.users if u not in owned})
    if outside:  # the scores or probabilities are needed elsewhere (returned weights, say)
        if notes is not None:
            notes.append(f"attention at {out.name} left to its ops: its scores or probabilities are read outside it "
                         f"({', '.join(outside[:4])}: returned attention weights, or saved for autograd), so the N x N matrix "
                         "is made")
        return None
    prep = walked_q + walked_k + walked_v
    changed = True
    while changed:  # the views and repeat_kv copies feeding the matmuls go too, where nothing else reads them
        changed = False
        for n in prep:
            if n not in owned and all(u in owned for u in n.users):
                owned.add(n)
                changed = True
    return Attention(q, k, v, scores, chain, extras, out, sorted(owned, key=cg.order.__getitem__), dropout=dropout,
                     safe=bool(safe))


def normalize_attention(graph: fx.Graph) -> int:
    """Rewrites ways of writing attention into the form match() reads; returns how many.

    - BLOOM's scores, `baddbmm(alibi, q, kᵀ, beta, alpha).view(B, H, M, N)` = alpha·(q·kᵀ) +
      beta·alibi, written out in [B, H, M, N] as bmm, view, mul and add where they reach a softmax's
      max within a few ops, so that Q·Kᵀ is a bmm and the bias is in the chain (fuser's
      decompositions keep baddbmm whole: elsewhere it stays one cuBLAS call);
    - Kᵀ made by one permute of another layout (BLOOM's `k.permute(0, 2, 3, 1)` of [B, N, H, D]):
      split into the permute to K ([B, H, N, D]) and the swap of its last two dims;
    - an in-place pointwise op on the scores nothing else reads (Falcon's `scores /= sqrt(d)`) made functional;
    - views to the shape a tensor already has, on the way to a softmax, dropped;
    - a float scale read as a number off the 0-d tensor Dynamo passed it in (dynamic=True) read as that tensor."""
    done, mode = 0, None
    for n in list(graph.nodes):
        if packet(n) is not aten.baddbmm or len(n.users) != 1 or not _reaches_softmax(n):
            continue
        view = next(iter(n.users))
        bias, q, kt = n.args[:3]
        if packet(view) not in _VIEW or len(shape(view)) != 4 or not isinstance(bias, fx.Node):
            continue
        b, h, m, k = shape(view)
        lead = shape(bias)[:-2] if len(shape(bias)) == 3 else None
        if lead not in ((b * h,), (1,)):
            continue
        beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)  # keyword-only in the schema
        # the view's own size arguments (ints, or the graph's size nodes where sizes vary: sympy sizes are no
        # arguments a graph can run) for Q·Kᵀ's [B, H, M, N] and the bias's [B or 1, H or 1, M or 1, N or 1]
        sizes = list(view.args[1])
        tail = [1 if shape(bias)[i] == 1 else sizes[i + 1] for i in (1, 2)]
        bias_sizes = [*sizes[:2], *tail] if lead[0] != 1 else [1, 1, *tail]
        if sum(isinstance(x, int) and x == -1 for x in bias_sizes) > 1:
            continue
        mode = mode or fake_mode_of(graph)

        def call(target, *args):
            return insert(graph, view, mode, target, *args)
        s4 = call(aten.view.default, call(aten.bmm.default, q, kt), sizes)
        s4 = s4 if alpha == 1 else call(aten.mul.Tensor, s4, alpha)
        out = s4
        if beta != 0:  # else baddbmm ignores the input (even its NaN)
            bias4 = call(aten.view.default, bias, bias_sizes)
            out = call(aten.add.Tensor, s4, bias4 if beta == 1 else call(aten.mul.Tensor, bias4, beta))
        view.replace_all_uses_with(out)
        graph.erase_node(view)
        graph.erase_node(n)
        done += 1
    return done + _fix_head_dims(graph) + _functional_scores(graph) + _split_kt_permutes(graph) + \
        _drop_identity_views(graph) + _tensor_scales(graph)


_SCALAR_OPS = (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor)


def _tensor_scales(graph: fx.Graph) -> int:
    """`x * s` on the way to a softmax (or /, +, -), where s is a float Dynamo passed in as a 0-d tensor t that the
    trace before autograd reads back as a number (`_local_scalar_dense(t)`, a SymFloat: dynamic=True leaves a module's
    float scale unspecialised), rewritten as `x * t` in the op's computation dtype and on its device (t is a CPU
    tensor; our kernel reads every operand on the query's device), as AOT Autograd's tensorify pass rewrites it
    later: match() takes a one-element tensor for an extra, not a number.  (On torch 2.13 that pass then finds the
    float read as a number nowhere and has Dynamo trace the frame again with it a constant; 2.11 keeps this graph.)"""
    done, mode = 0, None
    for n in list(graph.nodes):
        if n.target not in _SCALAR_OPS or not _reaches_softmax(n):
            continue
        floats = [a for a in n.args if packet(a) is aten._local_scalar_dense and isinstance(a.meta.get("val"),
                  torch.SymFloat) and meta(a.args[0]) is not None and meta(a.args[0]).numel() == 1]
        if not floats:
            continue
        mode = mode or fake_mode_of(graph)
        dtype = get_computation_dtype(meta(n).dtype)
        args = [insert(graph, n, mode, aten._to_copy.default, a.args[0], dtype=dtype, device=meta(n).device)
                if a in floats else a for a in n.args]
        new = insert(graph, n, mode, n.target, *args, **n.kwargs)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        done += 1
    return done


def _fix_head_dims(graph: fx.Graph) -> int:
    """Q·Kᵀ's and ·V's head dims fixed at their values where they are size symbols (q, k and v passed in
    under `dynamic=True`; on a recompile q's and k's may be one symbol, v's another), by guards Dynamo
    keeps: another head dim compiles another graph.  The kernels are built for one head dim (batch, heads
    and lengths may vary), and the scale, `1 / sqrt(d)`, becomes the constant it then is.  Only around a
    softmax that a matmul feeds and another reads; an unbacked size (no value while tracing) stays."""
    fixed = 0
    for n in graph.nodes:
        if packet(n) not in (aten.amax, aten._softmax):
            continue
        qk, pv = _nearest_bmm(n, "all_input_nodes"), _nearest_bmm(n, "users")
        if qk is None or pv is None or not _derives_from(pv.args[0], n):
            continue  # V·Pᵀ (a conv net's attention over [B, C, HW]): its last dim is the tokens', not a head dim
        for d in (meta(qk.args[0]).shape[-1], meta(pv).shape[-1]):
            if isinstance(d, torch.SymInt) and not expr(d).is_number:
                try:
                    guard_int(d)
                    fixed += 1
                except GuardOnDataDependentSymNode:
                    pass
    return fixed and fold_fixed_sizes(graph)


def _derives_from(x: fx.Node, n: fx.Node, depth: int = 16) -> bool:
    """Whether n is among x's inputs, walking up to `depth` nodes back (P·V's left operand from the softmax)."""
    frontier, seen = [x], set()
    for _ in range(depth):
        if n in frontier:
            return True
        seen.update(frontier)
        frontier = [a for u in frontier for a in u.all_input_nodes if a not in seen]
    return False


def _nearest_bmm(n: fx.Node, towards: str, depth: int = 16) -> fx.Node | None:
    """The first bmm met walking from n through its inputs (Q·Kᵀ from the softmax) or its readers (P·V)."""
    frontier, seen = list(getattr(n, towards)), set()
    for _ in range(depth):
        nxt = []
        for u in frontier:
            if u in seen:
                continue
            seen.add(u)
            if packet(u) is aten.bmm:
                return u
            nxt.extend(getattr(u, towards))
        frontier = nxt
    return None


def _functional_scores(graph: fx.Graph) -> int:
    """An in-place pointwise op on the way to a softmax (Falcon's `scores /= math.sqrt(d)`: aten.div_, which
    the trace before autograd keeps) as its functional op, where nothing else can see the write: the tensor
    it writes is read there alone, and so is every tensor it is a view of, back to the op that made it (not a
    graph input).  match() reads functional chains only."""
    done = 0
    for n in list(graph.nodes):
        target = n.target
        if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                torch.Tag.pointwise not in target.tags or not target._schema.is_mutable or not _reaches_softmax(n):
            continue
        name = target._schema.name.split("::")[-1]
        functional = getattr(getattr(aten, name[:-1], None), target._overloadname, None) if name.endswith("_") else None
        x = n.args[0]
        while isinstance(x, fx.Node) and len(x.users) == 1 and packet(x) in _VIEW:
            x = x.args[0]
        if functional is None or not isinstance(x, fx.Node) or len(x.users) != 1 or x.op != "call_function" \
                or len(n.args[0].users) != 1:
            continue
        with graph.inserting_before(n):
            new = graph.call_function(functional, n.args, n.kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        done += 1
    return done


def _split_kt_permutes(graph: fx.Graph) -> int:
    """Kᵀ as match() reads it (a swap of the last two dims of a 4-D K, viewed to 3-D for the bmm)
    where the model wrote `k.permute(0, 2, 3, 1)` of [B, N, H, D], transposed K after viewing it to
    [B·H, N, D], or scaled Kᵀ after the swap (SDPA's math path: permute(k) * s is permute(k * s))."""
    done, mode = 0, None
    for n in list(graph.nodes):
        if packet(n) is not aten.bmm or len(shape(n.args[1])) != 3 or not _reaches_softmax(n):
            continue
        walked = [n.args[1]]
        while packet(walked[-1]) in (*_VIEW, *_SAME):
            walked.append(walked[-1].args[0])
        kt = walked[-1]
        mode = mode or fake_mode_of(graph)
        if packet(kt) is aten.mul and isinstance(kt.args[1], (int, float)) and packet(kt.args[0]) is aten.permute \
                and len(kt.users) == 1:
            perm = kt.args[0]
            moved = insert(graph, kt, mode, perm.target, insert(graph, kt, mode, kt.target, perm.args[0], kt.args[1]),
                           *perm.args[1:])
            kt.replace_all_uses_with(moved)
            graph.erase_node(kt)
            if not perm.users:
                graph.erase_node(perm)
            kt = moved
            done += 1
        if packet(kt) is aten.transpose and len(shape(kt)) == 3 and sorted(d % 3 for d in kt.args[1:3]) == [1, 2]:
            p = [0, 2, 1]  # traced before AOT Autograd
        elif packet(kt) is aten.permute and not _swaps_last_two(kt):
            p = list(kt.args[1])
        else:
            continue
        if len(p) == 4:
            k = insert(graph, kt, mode, aten.permute.default, kt.args[0], [p[0], p[1], p[3], p[2]])
            kt.replace_all_uses_with(insert(graph, kt, mode, aten.permute.default, k, [0, 1, 3, 2]))
            graph.erase_node(kt)
        elif p == [0, 2, 1] and kt is n.args[1] and (x4 := _four_d(kt.args[0])) is not None:
            kt4 = insert(graph, n, mode, aten.permute.default, x4, [0, 1, 3, 2])
            x3 = kt.args[0]  # [B·H, N, D]: Kᵀ's sizes are its dims 0, 2, 1 (a symbolic one read off it in the graph)
            sizes = [d if isinstance(d, int) else insert(graph, n, mode, aten.sym_size.int, x3, i)
                     for i, d in ((i, meta(x3).shape[i]) for i in (0, 2, 1))]
            n.replace_input_with(kt, insert(graph, n, mode, aten.reshape.default, kt4, sizes))
        else:
            continue
        done += 1
    return done


def _drop_identity_views(graph: fx.Graph) -> int:
    """A view (or a chain of views) back to the layout a tensor already has is the tensor itself:
    Falcon views its 4-D scores to the same 4-D shape, or to 3-D and back (its in-place scaling of the
    bmm's output, functionalised).  Its readers read the tensor, so the score chain is pointwise end
    to end."""
    done = 0
    for n in list(graph.nodes):
        if packet(n) not in _VIEW or meta(n) is None or not _reaches_softmax(n):
            continue
        x, between = n.args[0], []
        while isinstance(x, fx.Node) and meta(x) is not None:
            if (tuple(shape(x)), meta(x).stride(), meta(x).storage_offset()) == \
                    (tuple(shape(n)), meta(n).stride(), meta(n).storage_offset()):
                n.replace_all_uses_with(x)
                for dead in [n, *between]:  # the views on the way, where nothing else reads them
                    if not dead.users:
                        graph.erase_node(dead)
                done += 1
                break
            between.append(x)
            x = x.args[0] if packet(x) in _VIEW else None
    return done


def _four_d(x3):
    """The [B, H, N, D] tensor a [B·H, N, D] one is a view of (through views and copies), or None."""
    n = x3
    while packet(n) in (*_VIEW, *_SAME) and len(shape(n)) != 4:
        n = n.args[0]
    if len(shape(n)) == 4 and shape(n)[0] * shape(n)[1] == shape(x3)[0] and tuple(shape(n)[2:]) == tuple(shape(x3)[1:]):
        return n
    return None


def _reaches_softmax(n, depth: int = 6) -> bool:
    for u in n.users:
        if packet(u) in (aten.amax, aten._softmax) or (depth and _reaches_softmax(u, depth - 1)):
            return True
    return False


def find(graph: fx.Graph, cg: ComputeGraph | None = None, notes: list | None = None) -> list[Attention]:
    """The attentions of the graph; `notes`: see match."""
    cg = cg or ComputeGraph(graph)
    found = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem and packet(n) is aten.bmm:
            a = match(n, cg, notes)
            if a is not None:
                a.id = len(found)
                found.append(a)
    return found


def mask_structure(att: Attention, cg: ComputeGraph) -> tuple[int, int | None] | None:
    """(o, w) when the score chain masks every key k > q + o whatever the scores (a causal mask built
    from constants: tril/triu of ones, arange comparisons) and, with a window w, every key with
    q + o - k >= w; else None.

    The masks are evaluated once, here, from the constants they are built of (a mask that reads a
    graph input, such as a padding mask, is data and is not folded).  Knowing the structure lets the
    kernel skip the tiles above the diagonal (and before the window) instead of loading and applying
    the mask there.
    """
    if not att.chain:
        return None
    m, n = shape(att.scores)[2:]
    if not (m.is_Integer and n.is_Integer):
        return None  # symbolic lengths: the mask is applied as the chain computes it, tile by tile
    m, n = int(m), int(n)
    values = {}
    with torch.no_grad(), real_tensors():
        try:
            for e in att.extras:
                if fold_into(e, values) is None:
                    return None
            values[att.scores] = torch.zeros((1, 1, m, n), device=meta(att.scores).device)
            for node in att.chain:
                values[node] = run_node(node, values)
            out = values[att.chain[-1]].float().reshape(-1, m, n)
        except (RuntimeError, TypeError, ValueError):
            return None
        # -inf, or a finfo.min-style bias (fp16's finfo.min is -65504): exp() of it is 0 next to any
        # unmasked score, unless the whole row is masked; then eager averages over every key (finite
        # bias) and skipping tiles would change that
        masked_all = out <= _MASKED
        if bool((masked_all & torch.isfinite(out)).any()) and not bool((~masked_all).any(-1).all()):
            return None
        masked = masked_all.all(0)
        d = torch.arange(n, device=masked.device)[None, :] - torch.arange(m, device=masked.device)[:, None]  # k - q
        for off in sorted({0, n - m}):
            upper = d > off
            if bool(upper.any()) and bool(masked[upper].all()):
                return off, _window(masked, d, off, n)
    return None


def _window(masked, d, off: int, n: int) -> int | None:
    """The smallest w with every key at q + o - k >= w masked, where that skips keys, else None."""
    kept = ~masked
    rows = kept.any(1)
    if not bool(rows.any()):
        return None
    reach = torch.where(kept, off - d, torch.full_like(d, -1)).amax(1)  # furthest kept key back, per row
    w = int(reach[rows].max()) + 1
    return w if w < n and bool((masked | (off - d < w)).all()) else None


_MASKED = torch.finfo(torch.float16).min / 2
_FORM_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)


def extra_forms(att: Attention) -> tuple:
    """Per extra, IndexMask or LinearBias where its value, folded from constants at compile time, is
    exactly that function of the positions (checked on every element), else None.  The kernel then
    computes it from the indices instead of loading an M x N tile per step (data masks stay loads)."""
    m, n = shape(att.scores)[2:]
    if not (m.is_Integer and n.is_Integer):
        return (None,) * len(att.extras)
    m, n = int(m), int(n)
    forms = []
    with torch.no_grad(), real_tensors():
        for e in att.extras:
            try:
                value = fold_into(e, {})
                forms.append(None if value is None or value.dtype not in _FORM_DTYPES else _form_of(value, m, n))
            except (RuntimeError, TypeError, ValueError):
                forms.append(None)
    return tuple(forms)


def what_the_kernel_reads(graph: fx.Graph, e: fx.Node, form, mode=None) -> fx.Node:
    """An extra the kernel computes from the positions (`form`: extra_forms') is not read whole: a structural
    mask not at all, a slope * (k - q) bias at q = 0, k = 1 only.  The kernel gets that element per batch and
    head, a copy made before the extra's first reader, so that the M x N tensor is neither kept for a backward
    nor made at all where its producer fuses into the copy.  `mode`: the graph's fake mode, where the new
    nodes need their fake tensors (a graph after AOT Autograd)."""
    if form is None:
        return e
    k = 1 if isinstance(form, LinearBias) else 0
    first = next(n for n in graph.nodes if n in e.users)
    n = e
    for target, args in ((aten.slice.Tensor, (-2, 0, 1)), (aten.slice.Tensor, (-1, k, k + 1)), (aten.clone.default, ())):
        n = insert(graph, first, mode, target, n, *args) if mode is not None else _call(graph, first, target, n, *args)
    return n


def _call(graph: fx.Graph, before: fx.Node, target, *args) -> fx.Node:
    with graph.inserting_before(before):
        return graph.call_function(target, args)


def _form_of(value: torch.Tensor, m: int, n: int):
    if value.dim() > 4 or tuple(value.shape[-2:]) != (m, n):
        return None
    v4 = value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))  # on its device: it may be large
    d = torch.arange(n, device=v4.device)[None, :] - torch.arange(m, device=v4.device)[:, None]  # k - q
    if v4.is_floating_point() and n > 1:
        slope = v4[..., :1, 1:2].float()
        if torch.equal((slope * d.float()).to(v4.dtype), v4):
            return LinearBias(v4.dtype)
    if not bool((v4 == v4[:1, :1]).all()):
        return None  # differs between batches or heads
    plane = v4[0, 0]
    if plane.dtype == torch.bool:
        for masks, masked in ((True, plane), (False, ~plane)):
            form = structure_of(masked, m, n)
            if form is not None:
                return IndexMask(*form, torch.bool, masks=masks)
        return None
    if not plane.is_floating_point():
        return None
    fills = plane[plane != 0].unique()
    if fills.numel() != 1 or float(fills[0]) > _MASKED:
        return None
    form = structure_of(plane != 0, m, n)
    return None if form is None else IndexMask(*form, plane.dtype, fill=float(fills[0]))
