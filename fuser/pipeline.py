"""The pipeline on one ATen graph: patterns -> partition -> cost -> codegen -> rewrite -> report.

Capture (Dynamo + AOT Autograd, fuser/backend.py) hands it an ATen graph with a fake tensor on every
node, sizes symbolic where Dynamo made them so; forward and backward graphs alike come here.
"""
from __future__ import annotations

import functools
import logging
import operator

import sympy
import torch
import torch.fx as fx

from fuser.codegen import attention as attention_codegen
from fuser.codegen import sdpa
from fuser.codegen.kernel import CodegenError, generate
from fuser.codegen.score_mod import score_mod
from fuser.patterns.attention import extra_forms, find, mask_structure, normalize_attention, resolved, what_the_kernel_reads

from . import ops
from .cost import eager_cost, tensor_bytes
from .dtypes import target
from .embedding import lower as lower_embedding_grads
from .epilogue import matmul_epilogues
from .fold import drop_identities, fold_constants, merge_duplicates, recompute_past_eager
from .gqa import share_kv_heads
from .padding import pad_matmuls
from .split import split_column_sums, split_whole_sums, unroll_small_sums
from .graph import ComputeGraph, fake_mode_of, meta, replaced, shape
from .runtime import AttentionKernel, RegionKernel, batch_in_place, fast_calls, lists_cache, run_attention, write_inputs_in_place
from .partition import Partitioner
from .report import FusionReport, RegionReport, Unfused
from .rewrite import Unbound, bind_sizes, rewrite

aten = torch.ops.aten
log = logging.getLogger("fuser")


def _describe(n) -> str:
    v = n.meta.get("val")
    return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else "?"


def compile_graph(gm: fx.GraphModule, graph_index: int = 0, attention: bool | str = True,
                  cuda_graphs: bool = False, static: tuple = ()) -> tuple[fx.GraphModule, FusionReport]:
    """Recognise attention, partition the rest, emit a kernel per region, rewrite.  What cannot be
    emitted stays eager, with the reason.  `attention`: True lowers each attention to SDPA where
    that is exact and to our kernel elsewhere, "triton" always to our kernel, False leaves it.
    `cuda_graphs`: the graph will be replayed, so no lowering may decide anything at run time.
    `static`: indices of the inputs that are parameters and buffers (the same tensors every call)."""
    duplicates = merge_duplicates(gm)
    dropped_identities = drop_identities(gm)
    folded = fold_constants(gm)
    padded = pad_matmuls(gm)
    epilogues = matmul_epilogues(gm)
    split, whole = split_column_sums(gm), split_whole_sums(gm)
    embedding_grads = dict(lower_embedding_grads(gm))
    report = FusionReport()
    if attention and normalize_attention(gm.graph):  # BLOOM's scores: Q·Kᵀ and a bias, for the recogniser
        gm.recompile()
    not_sdpa, lowered = _lower_to_sdpa(gm, graph_index, report, None if cuda_graphs else static) if attention is True else ({}, set())
    shared = share_kv_heads(gm)
    cg = ComputeGraph(gm.graph)
    # our kernel reads every operand on the query's device (a CPU scale tensor of Dynamo's is not)
    found = find(gm.graph, cg, report.notes) if attention else []
    refused = {a: why for a in found if (why := _not_ours(a)) is not None}
    attentions = [a for a in found if a not in refused]
    for a, why in refused.items():
        why = f"{not_sdpa[a.out]}; {why}" if a.out in not_sdpa else why
        report.notes.append(f"attention at {a.out.name} left to its ops (not SDPA, not our kernel): {why}")
    taken = {n for a in attentions for n in a.nodes}
    unrolled = unroll_small_sums(gm, taken)
    if unrolled:
        cg = ComputeGraph(gm.graph)
    recomputed = recompute_past_eager(gm, cg, taken)
    if recomputed:
        cg = ComputeGraph(gm.graph)
    units, kernels, dropped = [], [], []
    hints = dict(cg.sizes.hints)
    bound, made = {}, {}
    mods = []
    for a in attentions:
        kernel, mod = _attention_kernel(a, cg, f"attention_{a.id}")
        units.append(a)
        kernels.append(kernel)
        mods.append(mod)
        why = f"not SDPA: {not_sdpa[a.out]}" if a.out in not_sdpa else "attention='triton'"
        report.regions.append(_attention_report(a, cg, kernel.name, kernel.source, graph_index,
                                                len(report.regions), hints, f"triton flash kernel ({why})"))
    for a, mod, kernel, entry in zip(attentions, mods, kernels, report.regions[len(report.regions) - len(attentions):]):
        _narrow_extras(a, mod, kernel)  # the report: what the kernel reads now (eager's bytes as counted before)
        entry.input_shapes = [_describe(n) for n in a.inputs]
        entry.bytes_fused_expr = sum((tensor_bytes(n) for n in [*a.inputs, a.out]), sympy.Integer(0))
    if attentions:  # new nodes (the narrowed extras); each output is the unit's, not a view to read through to
        cg = ComputeGraph(gm.graph)  # its P @ V (a region after it reads it as the kernel writes it)
        for a in attentions:
            cg.info[a.out] = ops.Opaque("an attention kernel's output")
    part, emitted = _emit_regions(gm, cg, taken, launch_host=not cuda_graphs)
    for region, kernel, cost in emitted:
        try:
            bound[region] = bind_sizes(gm.graph, kernel.symbols, made)
        except Unbound as e:
            dropped += [(n, f"codegen: {e}") for n in region.nodes]
            continue
        units.append(region)
        kernels.append(kernel)
        report.regions.append(RegionReport(
            id=len(report.regions), graph=graph_index, kind=region.kind,
            ops=[ops.op_name(n) for n in region.nodes],
            input_shapes=[_describe(n) for n in region.inputs],
            output_shapes=[_describe(n) for n in region.outputs],
            bytes_unfused_expr=cost.bytes_unfused, bytes_fused_expr=cost.bytes_fused,
            launches_unfused=cost.launches_unfused, kernel=kernel.name, source=kernel.source,
            hints=hints, seen=kernel.seen_sizes if kernel.symbols else None))
        log.debug("region %s (%s, k=%.2f):\n%s", kernel.name, region.kind, cost.k, kernel.source)
    fused = {n for u in units for n in u.nodes}
    reasons = dict(part.unfused([u for u in units if u not in attentions]))
    reasons.update(dropped)  # a region dropped at codegen: its nodes say why, once
    for n, reason in reasons.items():
        if n not in fused and n not in lowered and n not in embedding_grads and n.target is not operator.getitem:
            report.unfused.append(Unfused(ops.op_name(n), n.name, reason, graph_index))
    devices = {n.meta["val"].device.type for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    if "cpu" in devices and units:
        report.notes.append("CPU tensors: the kernels run through Triton's interpreter (correct, slow; for tests)")
    if duplicates:
        report.notes.append(f"ops that compute what an earlier op computed, dropped for it: {', '.join(duplicates)}")
    if dropped_identities:
        report.notes.append(f"ops that leave their operand unchanged dropped: {', '.join(dropped_identities)}")
    if folded:
        report.notes.append(f"{len(folded)} constants computed once, at compile time: {', '.join(folded)}")
    if shared:
        report.notes.append(f"attention of one query row shares K and V between query heads: {'; '.join(shared)}")
    if padded:
        report.notes.append(f"matmuls with unaligned widths padded: {', '.join(padded)}")
    if epilogues:
        report.notes.append(f"activations run in their matmul's epilogue: {'; '.join(epilogues)}")
    if part.kept_apart:
        report.notes.append(f"siblings kept apart for memory: {'; '.join(dict.fromkeys(part.kept_apart))}")
    if split:
        report.notes.append(f"column sums split to fill the GPU: {'; '.join(split)}")
    if whole:
        report.notes.append(f"whole-tensor sums split (their prologue fused into the parts): {'; '.join(whole)}")
    if recomputed:
        report.notes.append(f"pointwise ops computed again past an eager op they feed, for: {'; '.join(recomputed)}")
    if unrolled:
        report.notes.append(f"small sums as adds (fused where read at other positions): {'; '.join(unrolled)}")
    if embedding_grads:
        report.notes.append(f"embedding gradients as our kernel: {'; '.join(embedding_grads.values())}")
    new = rewrite(gm, units, kernels, bound) if units else gm
    if units:  # on the final order of the calls; then the eager calls through torch's bindings (last:
        written = write_inputs_in_place(new.graph)  # the targets are no longer OpOverloads)
        batched = batch_in_place(new.graph)
        fast_calls(new.graph)
        new.recompile()
        if new.in_place:
            report.notes.append(f"{len(new.in_place)} kernels write their output over an input that dies there "
                                f"(one buffer, not two): {', '.join(new.in_place)}")
        if written:
            report.unfused = [u for u in report.unfused if u.node not in written]
            report.notes.append(f"{len(written)} mutated inputs written in place (no copy of the input, no copy back)")
        if batched:
            report.notes.append(f"{len(batched)} in-place updates of mutated inputs in one foreach launch: {', '.join(batched)}")
    elif fast_calls(new.graph):  # a graph with no region still calls its eager ops (and ours) the short way
        new.recompile()
    report.code.append(new.code)
    return new, report


MAX_PASSES = 8  # partitions of one graph at most (then a refused region goes to eager, with codegen's reason)


def _emit_regions(gm, cg, taken: set, launch_host: bool = True):
    """Partition the graph and emit each region's kernel: (the partitioner, [(region, kernel, cost)]).
    A region codegen refuses because a member reads a reduction's result where one kernel cannot (at
    another row, or inside the reduction's own loop: GQA's sum over the query heads sharing a K,
    read by RoPE's rotation in the backward) costs the region, not its ops: every such reduction of
    the pass is sealed (it ends its kernel) and the graph partitioned again, so their readers join
    kernels of their own (one more pass for all the layers of a model).  Kernels are kept by their
    node sets across passes (emitted once; named by region ids that never repeat across passes); a
    region refused otherwise, or in the last pass, is left out, and its nodes give the partitioner's
    reason or codegen's.  `launch_host`: launches cost host time (not so under CUDA graphs: cost.host_bound)."""
    emitted: dict = {}  # frozenset of nodes -> (region, kernel, cost) or the CodegenError
    sealed: frozenset = frozenset()
    apart: frozenset = frozenset()  # nodes of refused regions: no sibling joins them in the next pass
    first_id = 0
    for last in [False] * (MAX_PASSES - 1) + [True]:
        part = Partitioner(gm.graph, supported=lambda n: n not in taken, cg=cg, sealed=sealed, first_id=first_id,
                           apart=apart, launch_host=launch_host)
        regions = part.partition()
        first_id += len(regions)
        out, seal, refused = [], set(), set()
        for region in regions:
            key = frozenset(region.nodes)
            if key not in emitted:
                cost, name = part.cost(region), f"fused_{region.id}"
                try:
                    emitted[key] = (region, RegionKernel(region, name, functools.partial(
                        generate, region, device_type=meta(region.outputs[0]).device.type, name=name, cost=cost)), cost)
                except CodegenError as e:
                    emitted[key] = e
            hit = emitted[key]
            if not isinstance(hit, CodegenError):
                out.append(hit)
            elif hit.node in region.members and hit.node not in sealed and not last:
                seal.add(hit.node)
            else:
                part.reasons.update((n, f"codegen: {hit}") for n in region.nodes)
                if not last and not set(region.nodes) <= apart:  # a sibling's merge may have cost it: once
                    refused |= set(region.nodes)  # more without sibling merges for these nodes
        if not seal and not refused:
            return part, out
        sealed, apart = sealed | seal, apart | refused


def _attention_kernel(att, cg, name: str) -> tuple[AttentionKernel, attention_codegen.ScoreMod]:
    """The flash-attention kernel of a recognised attention, its score chain as the score mod (returned too)."""
    with target(meta(att.q).device.type):
        mod = score_mod(att.scores, att.chain, att.extras, cg, mask_structure(att, cg), extra_forms(att))
        source = attention_codegen.attention_source(mod, int(shape(att.q)[-1]), meta(att.q).dtype,
                                                    head_dim_v=int(shape(att.v)[-1]))
    return (AttentionKernel(name, source, functools.partial(attention_codegen.prepare, mod=mod),
                            tuple(shape(n) for n in att.inputs), tuple(meta(n).dtype for n in att.inputs),
                            meta(att.out).dtype, "score mod: " + "; ".join(mod.lines)), mod)


def _narrow_extras(att, mod, kernel: AttentionKernel) -> None:
    """The extras the kernel computes from the positions narrowed in the graph to the elements it reads
    (`att.extras` and the kernel's input shapes updated), so that no M x N mask or bias is made for it."""
    graph = att.q.graph
    for i, e in enumerate(att.extras):
        narrow = what_the_kernel_reads(graph, e, mod.form(i), fake_mode_of(graph))
        if narrow is not e:  # the nodes the kernel replaces read it instead (shapes that broadcast alike; their values
            for n in att.nodes:  # are never computed), so the partition sees who reads it, and nothing reads `e`
                n.replace_input_with(e, narrow)
            att.extras[i] = narrow
    kernel.in_shapes = tuple(shape(n) for n in att.inputs)


def _not_ours(a) -> str | None:
    """Why our kernel does not take the unit, or None: its operands on the query's device, no dropout (not
    written), not SDPA's math path (fully masked rows give 0 there, NaN in our kernel, as eager's softmax), and
    the dtypes and head dims it is made for."""
    if a.dropout:
        return "dropout (our inference kernel draws none)"
    if a.safe:
        return "SDPA's math path (fully masked rows give 0)"
    if any(meta(n).device != meta(a.q).device for n in a.inputs):
        return "operands on several devices"
    return attention_codegen.refusal(meta(a.q).dtype, shape(a.q)[-1], shape(a.v)[-1])


def _lower_to_sdpa(gm: fx.GraphModule, graph_index: int, report: FusionReport, static: tuple | None) -> dict:
    """Each attention SDPA can compute exactly becomes one SDPA call (codegen/sdpa.py), reported as
    a region; returns {output node: why not} for the others, which go to our own kernel, and the
    SDPA calls made (not listed as left to eager: they are the lowering).  `static`: the indices of the
    parameters and buffers; None where no mask may be checked at run time (CUDA graphs)."""
    cg = ComputeGraph(gm.graph)
    hints = dict(cg.sizes.hints)
    why, changed, fixups, calls = {}, [], {}, set()
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    buffers = None if static is None else {inputs[i] for i in static if i < len(inputs)}
    found = find(gm.graph, cg)
    # eager's cost of each, on the graph as captured: a lowering rewires the attentions after it (one reading
    # another's output would be read through the SDPA call, which `cg` has never seen)
    entries = [_attention_report(a, cg, "sdpa", "", graph_index, 0, hints, "") for a in found]
    for a, entry in zip(found, entries):
        a = resolved(a)  # its operands as the lowerings before it left them
        try:
            with target(meta(a.q).device.type):
                text, made = sdpa.lower(gm, a, fixups, buffers, _windowed, _listed)
        except sdpa.NotExpressible as e:
            why[a.out] = str(e)
            continue
        entry.id, entry.source, entry.lowering = len(report.regions), text, "sdpa (the score chain is a scale and an additive mask)"
        report.regions.append(entry)
        changed += made
        calls.update(n for n in made if n.target is aten.scaled_dot_product_attention.default
                     or getattr(n.target, "causal_check", False))
        log.debug("attention %s lowered to %s", a.out.name, text)
    if changed:
        gm.graph.eliminate_dead_code()  # a mask that became is_causal, the eager masks no attention reads now
        replaced(gm, changed)
    return why, calls


def _windowed(q, k, v, window: int, scale: float):
    """Causal attention over the last `window` keys of each query, its tiles outside the window
    skipped: what a sliding-window mask in a buffer runs once found at run time (sdpa.causal_or_masked)."""
    return _ours(q, k, v, (), attention_codegen.ScoreMod((), causal=True, window=window), scale)


def _listed(q, k, v, mask, scale: float, same_value=None, kind: str = "add", fill: float = 0.0):
    """Attention with `mask` (additive, or a boolean whose True keeps or drops a key, `kind`, dropped keys at
    `fill`) over the tiles it keeps, those it masks whole skipped and those it keeps whole not read: what a
    mask in a buffer with no structure runs (sdpa.causal_or_masked).  Its lists are kept across calls only
    while `same_value` (sdpa.RunTimeCheck.same_value) vouches for the mask's value: the mask may be the
    graph's, made again each call, its memory perhaps another tensor's at the next."""
    mod = attention_codegen.ScoreMod((attention_codegen.mask_line(kind, fill),), n_extra=1, data_mask=(0, kind, mask.dtype))
    kept = dict(lists_cache=lists_cache(q), same_value=same_value) if same_value is not None else {}
    return _ours(q, k, v, (mask,), mod, scale, **kept)


def _ours(q, k, v, extras, mod, scale: float, **kept):
    source = _attention_source(mod, q.shape[-1], v.shape[-1], q.dtype, q.device.type)
    return run_attention(source, attention_codegen.prepare, q, k, v, extras, mod=mod, scale=scale, **kept)[0]


@functools.lru_cache(maxsize=64)
def _attention_source(mod, head_dim: int, head_dim_v: int, dtype, device_type: str) -> str:
    with target(device_type):
        return attention_codegen.attention_source(mod, head_dim, dtype, head_dim_v=head_dim_v)


def _attention_report(a, cg, kernel, source, graph_index, rid, hints, lowering) -> RegionReport:
    """Unfused, every op of the attention is an eager kernel (the scores go to HBM and back each
    time); fused, q, k, v and the masks are read once and the output written once."""
    unfused = sum((eager_cost(cg, n)[0] for n in a.nodes if cg.is_compute(n)), sympy.Integer(0))
    fused = sum((tensor_bytes(n) for n in [*a.inputs, a.out]), sympy.Integer(0))
    return RegionReport(
        id=rid, graph=graph_index, kind="attention", ops=[ops.op_name(n) for n in a.nodes if cg.is_compute(n)],
        input_shapes=[_describe(n) for n in a.inputs], output_shapes=[_describe(a.out)],
        bytes_unfused_expr=unfused, bytes_fused_expr=fused, hints=hints,
        launches_unfused=sum(eager_cost(cg, n)[1] for n in a.nodes if cg.is_compute(n)),
        kernel=kernel, source=source, lowering=lowering)

