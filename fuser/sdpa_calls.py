"""SDPA calls in Dynamo's graph, made ready for AOT Autograd: masks known at compile time dropped (those that keep
every key) or made `is_causal` (the causal one), masks laid out for the fused kernels (contiguous_masks), and,
for the trace before autograd (pregrad.py), the fused kernel eager would pick pinned where tracing with fake
tensors would take SDPA's math path.

The first and the last matter for the same calls: transformers (5.17, under compile) passes ViT's attention an all-keep mask
built from aranges (`q_index >= 0`, expanded), and causal LMs a causal one (`kv_index <= q_index`, and the
packed-sequence check of their positions); with a mask SDPA runs its memory-efficient kernel at best, over
every tile, and a mask also keeps the pin off.  A mask is dropped only where its value is known at compile
time: made from no graph input (sizes static, no random op), evaluated once on real tensors, every element
True (boolean) or 0 (additive), or exactly `ones(L, S).tril()` over every batch and head (boolean, or 0 and
-inf or a float's lowest): then the call is made is_causal.  A mask that depends on a size that varies or on
an input stays, as does one written in place (Dynamo's graph is not functional: a write does not show among
the mask's inputs), one made under autocast switched inside the graph, one that widens the output by
broadcasting (eager raises there), and an `is_causal` call's (eager raises there)."""
from __future__ import annotations

import contextlib
import logging
import operator
import threading

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.nn.attention import SDPBackend


aten = torch.ops.aten
log = logging.getLogger("fuser")

_SDPA_CALLS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_PRIVATE = {SDPBackend.FLASH_ATTENTION.value: "flash", SDPBackend.CUDNN_ATTENTION.value: "cuDNN",
            SDPBackend.EFFICIENT_ATTENTION.value: "memory-efficient"}


def is_sdpa_call(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _SDPA_CALLS


# ------------------------------------------------------------------------------------ masks known at compile time
def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.kwargs[name] if name in n.kwargs else n.args[i] if len(n.args) > i else default


def _set_mask(call: fx.Node, mask) -> None:
    if "attn_mask" in call.kwargs:
        call.update_kwarg("attn_mask", mask)
    else:
        call.update_arg(3, mask)


_IN_PLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift, operator.imatmul}


# the same as methods (`x.__iand__(y)`), and Tensor's __idiv__, which operator has no function for
_IN_PLACE_DUNDERS = {f"__{f.__name__}__" for f in _IN_PLACE} | {"__idiv__"}


def _in_place_method(name: str) -> bool:
    """A tensor method that writes its tensor: `add_`, `__iand__`; not `__eq__` (torch 2.11's Dynamo keeps `a == b`
    of tensors as that method) nor another operator's dunder."""
    if name.startswith("__") and name.endswith("__"):
        return name in _IN_PLACE_DUNDERS
    return name.endswith("_")


def _writes(n: fx.Node) -> list:
    """The tensors `n` writes in place (Dynamo's graph keeps in-place methods, setitem and out=)."""
    if n.op == "call_method" and _in_place_method(n.target):
        return n.args[:1]
    if n.op != "call_function":
        return []
    t = n.target
    if t in _IN_PLACE:
        return n.args[:1]
    if getattr(t, "__module__", None) in ("_operator", "operator"):
        return []  # and_, or_, not_: named with a trailing _ (a keyword's), not in place
    if getattr(t, "__name__", "").endswith("_") \
            or (isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable):
        return n.args[:1]
    return [n.kwargs["out"]] if "out" in n.kwargs else []


def _ancestors(nodes) -> set:
    seen, stack = set(), [a for a in nodes if isinstance(a, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _plain(n: fx.Node) -> bool:
    """A tensor method or a function of torch, operator or builtins (not a user's function Dynamo allowed in
    the graph, which could do anything when run at compile time)."""
    if n.op == "call_method":
        return not _in_place_method(n.target)
    module = getattr(n.target, "__module__", None) or ""
    return n.op == "call_function" and (module.split(".")[0] in ("torch", "_operator", "operator", "builtins")
                                        or n.target in (operator.getitem,))


# A mask is evaluated once, at compile time, and dropped (its value never held): each value it is made of may
# be larger than a folded constant's (fold.FOLD_LIMIT_BYTES, 16 MiB), so that a causal LM's [B, 1, T, T] mask at
# B8 T4096 (128 MiB, bool) is still read, where its attention costs most.  Decision: 256 MiB a value.
MASK_LIMIT_BYTES = 1 << 28


def _made_of(node: fx.Node) -> list[fx.Node] | None:
    """`node` and what it is computed from, in graph order, or None where any of it is a graph input, an
    attribute, not a plain op, a value of no static size, or past MASK_LIMIT_BYTES."""
    made = _ancestors([node])
    for n in made:
        v = n.meta.get("example_value")
        if not _plain(n) or v is None:
            return None
        if isinstance(v, torch.Tensor) and (not all(isinstance(s, int) for s in v.shape)
                                            or v.untyped_storage().nbytes() > MASK_LIMIT_BYTES):
            return None
    return [n for n in node.graph.nodes if n in made]


def _masked_calls(gm: fx.GraphModule):
    """(SDPA call, its mask's node) for each call whose mask the graph computes, in graph order."""
    for n in list(gm.graph.nodes):
        mask = _arg(n, 3, "attn_mask") if is_sdpa_call(n) else None
        if isinstance(mask, fx.Node):
            yield n, mask


def _written(graph: fx.Graph) -> set:
    """The nodes a tensor the graph writes in place is computed from, the written ones among them: a mask
    among them may not be at the call what its node's example value says."""
    return _ancestors([t for n in graph.nodes for t in _writes(n)])


def _droppable(call: fx.Node, mask: fx.Node, written: set) -> list[fx.Node] | None:
    """The nodes the mask is made of, where dropping it keeps the call's meaning (the module docstring's
    rules; `written`: _written of the graph, which has no autocast switched inside), else None."""
    if _arg(call, 5, "is_causal", False) is not False:
        return None
    q, k = (_arg(call, i, name) for i, name in ((0, "query"), (1, "key")))
    qv, kv, mv = (getattr(a, "meta", {}).get("example_value") for a in (q, k, mask))
    if not all(isinstance(v, torch.Tensor) for v in (qv, kv, mv)):
        return None
    scores = (*qv.shape[:-1], kv.shape[-2])
    if tuple(torch.broadcast_shapes(scores, mv.shape)) != tuple(scores):
        return None
    nodes = _made_of(mask)
    return None if nodes is None or written.intersection(nodes) else nodes


def _value(gm: fx.GraphModule, nodes: list[fx.Node]) -> torch.Tensor | None:
    """The last of `nodes` computed on real tensors, or None where any op draws random numbers or is not ATen's
    (checked on a trace with fake tensors first, so no generator moves) or the computation fails."""
    graph, env = fx.Graph(), {}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[nodes[-1]])
    try:
        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            traced = make_fx(fx.GraphModule(gm, graph), tracing_mode="fake")()
            ops = [n.target for n in traced.graph.nodes if n.op == "call_function"]
            if any(not isinstance(t, torch._ops.OpOverload) or t.namespace not in ("aten", "prims")
                   or torch.Tag.nondeterministic_seeded in t.tags for t in ops if t is not operator.getitem):
                return None  # random numbers, a collective, a custom op: not run at compile time
            value = traced()
    except Exception:  # noqa: BLE001 - a mask we cannot evaluate is kept
        return None
    return value if isinstance(value, torch.Tensor) else None


def _stored(value: torch.Tensor) -> torch.Tensor:
    """`value` with each broadcast (stride-0) dimension narrowed to one element: what the checks below compare,
    so that a small mask expanded over batch and heads costs its own size, not the expansion's."""
    for d, (size, stride) in enumerate(zip(value.shape, value.stride())):
        if stride == 0 and size > 1:
            value = value.narrow(d, 0, 1)
    return value


def _keeps_every_key(value: torch.Tensor) -> bool:
    value = _stored(value)
    if value.dtype == torch.bool:
        return bool(value.all())
    return value.is_floating_point() and bool((value == 0).all())


_MASKED_BELOW = -1e30  # an additive mask's masked value: -inf, or a float's lowest (bf16's, fp32's; not fp16's -65504,
# which a score near fp16's largest would outweigh, where is_causal's -inf never is)


def _causal(value: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether the mask, broadcast over the call's scores [..., queries, keys], is SDPA's `is_causal` one in every
    batch and head: key j kept for query i exactly where j <= i (top-left, `ones(L, S).tril()`); boolean, or
    additive with 0 where kept and -inf (or a float's lowest, _MASKED_BELOW) where not."""
    if queries == 0 or keys == 0 or value.dim() < 2 or value.shape[-2:] not in ((queries, keys), (1, keys),
                                                                                  (queries, 1), (1, 1)):
        return False
    tril = torch.ones(queries, keys, dtype=torch.bool, device=value.device).tril()
    value = _stored(value)  # a broadcast row or column is compared once, against every row or column of tril
    if value.dtype == torch.bool:
        keep = value
    elif value.is_floating_point():
        keep = value == 0
        if not bool((keep | (value <= _MASKED_BELOW)).all()):
            return False
    else:
        return False
    return bool((keep == tril).all())


def _set_causal(call: fx.Node) -> None:
    if len(call.args) > 5:
        call.update_arg(5, True)
    else:
        call.update_kwarg("is_causal", True)


def _erase_unused(node: fx.Node) -> None:
    """`node` and what only it read, where nothing reads them now."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.graph is None:
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def drop_constant_masks(gm: fx.GraphModule) -> list[str]:
    """Each SDPA call's mask made from constants (module docstring) dropped where it keeps every key, and made
    `is_causal=True` where it is the causal mask (transformers builds causal LMs' masks from aranges under compile,
    5.17: SDPA given the mask runs its masked kernels over every tile; is_causal skips the tiles above the
    diagonal); notes for the report."""
    calls = list(_masked_calls(gm))
    if not calls or any("autocast" in getattr(n.target, "__name__", "") for n in gm.graph.nodes):
        return []  # a mask made under autocast switched inside the graph would be evaluated without it
    dropped, causal, written = 0, 0, _written(gm.graph)
    for n, mask in calls:
        try:
            nodes = _droppable(n, mask, written)
            value = None if nodes is None else _value(gm, nodes)
            if value is None:
                continue
            q, k = (_arg(n, i, name).meta["example_value"] for i, name in ((0, "query"), (1, "key")))
            if _keeps_every_key(value):
                dropped += 1
            elif _causal(value, q.shape[-2], k.shape[-2]):
                _set_causal(n)
                causal += 1
            else:
                continue
        except Exception as e:  # noqa: BLE001 - a mask we cannot reason about is kept, the graph compiled
            log.debug("fuser: SDPA mask %s kept: %s: %s", mask.name, type(e).__name__, e)
            continue
        _set_mask(n, None)
        _erase_unused(mask)
    notes = []
    if dropped:
        notes.append(f"attention masks that keep every key dropped: {dropped} SDPA call(s) had a mask made from "
                     "constants that masks nothing (they run SDPA's unmasked kernels)")
    if causal:
        notes.append(f"causal attention masks made is_causal: {causal} SDPA call(s) had a mask made from constants "
                     "that is the causal one (they run SDPA's causal kernels, skipping the tiles above the diagonal)")
    if notes:
        gm.recompile()
    return notes


# ------------------------------------------------------------------------------------ masks laid out for the kernels
def _strided_mask(v) -> bool:
    """A CUDA mask whose last dimension is not contiguous, of static layout, with no broadcast dimension (a copy of
    one would write the broadcast out whole)."""
    if not isinstance(v, torch.Tensor) or not v.is_cuda or v.dim() == 0:
        return False
    dims = [*v.shape, *v.stride()]
    if not all(isinstance(x, int) for x in dims):
        return False
    return v.shape[-1] > 1 and v.stride(-1) != 1 and not any(st == 0 and sz > 1 for sz, st in zip(v.shape, v.stride()))


def contiguous_masks(gm: fx.GraphModule) -> list[str]:
    """Each CUDA SDPA call's mask whose last dimension is not contiguous, copied to a contiguous one first: SDPA's
    fused kernels need a contiguous last dimension, and without one eager takes its math path, in fp32 (T5's
    position bias, a permuted view of [1, S, S, H] whose gradient is wanted: math for [8, 8, 256, 64] bf16 on an
    H200, run 106; fp32 GEMMs 375 us of a t5 training step, in Inductor's too).  Decision: faster than eager's pick,
    the same values up to the fused kernel's rounding, as SDPA gives on a contiguous mask; the copy is the mask's
    size once.  Notes for the report."""
    copied, laid_out = 0, {}  # a mask read by several calls (T5's bias, every layer's) is copied once
    written = None
    for n, mask in _masked_calls(gm):
        v = mask.meta.get("example_value")
        try:
            if not _strided_mask(v):
                continue
            written = _written(gm.graph) if written is None else written
            if mask in written:
                continue
            laid = laid_out.get(mask)
            if laid is None:
                with gm.graph.inserting_before(n):
                    laid = laid_out[mask] = gm.graph.call_method("contiguous", (mask,))
                with getattr(v, "fake_mode", None) or contextlib.nullcontext():
                    laid.meta["example_value"] = v.contiguous()
        except Exception as e:  # noqa: BLE001 - a mask we cannot reason about is left as it is
            log.debug("fuser: SDPA mask %s left as it is: %s: %s", mask.name, type(e).__name__, e)
            continue
        _set_mask(n, laid)
        copied += 1
    if not copied:
        return []
    gm.recompile()
    return [f"attention masks laid out for SDPA's fused kernels: {copied} SDPA call(s) had a mask whose last dimension "
            f"is not contiguous (eager takes the math path there); {len(laid_out)} copied to a contiguous one first"]


# ------------------------------------------------------------------------------------ the kernel eager picks
def eager_sdpa_choice(q, k, v, is_causal: bool, scale) -> int | None:
    """The kernel SDPA picks on real tensors of q, k and v's sizes, strides, dtype and device, or None (sizes
    not static).  Asked of fake tensors (what Dynamo and AOT Autograd trace with), SDPA can answer its math
    path where real tensors get a fused kernel: ViT's [32, 12, 197, 64] bf16 queries, viewed from [B, S, H, D],
    get cuDNN in eager and math under fake tensors (H200, run 97), whose fp32 matmuls took 1.09 ms a layer's
    forward and backward against cuDNN's 0.19, in Inductor's step and ours.  One buffer holds all three (no
    values are read)."""
    dims = [*q.shape, *q.stride(), *k.shape, *k.stride(), *v.shape, *v.stride()]
    if not all(isinstance(x, int) for x in dims):
        return None
    with disable_proxy_modes_tracing(), unset_fake_temporarily():  # real tensors, kept out of the trace
        span = max(1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) for t in (q, k, v))
        buf = torch.empty(span, dtype=q.dtype, device=q.device)
        real = [buf.as_strided(t.shape, t.stride()).requires_grad_(t.requires_grad) for t in (q, k, v)]
        return int(torch._fused_sdp_choice(*real, None, 0.0, is_causal, scale=scale))


_pinned = threading.local()  # the kernels sdpa_as_eager_picks took during this thread's trace


@contextlib.contextmanager
def pinned_kernels():
    """A list of the kernels `sdpa_as_eager_picks` pins inside this block (filled as the trace goes)."""
    _pinned.kernels = kernels = []
    try:
        yield kernels
    finally:
        _pinned.kernels = []


def sdpa_as_eager_picks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention, traced with fake tensors as SDPA would run on real ones: where the trace
    would take the math path (fp32 matmuls and a softmax, saved for the backward) but eager takes a fused
    kernel, that kernel's op, whose derivative is its own backward.  Called on real tensors, with a mask,
    dropout or GQA, or where fake and real tensors agree, it is SDPA itself."""
    if isinstance(query, FakeTensor) and query.is_cuda and attn_mask is None and not dropout_p and not enable_gqa:
        choice = eager_sdpa_choice(query, key, value, is_causal, scale)
        if choice in _PRIVATE and choice != int(torch._fused_sdp_choice(query, key, value, None, 0.0, is_causal, scale=scale)):
            getattr(_pinned, "kernels", []).append(_PRIVATE[choice])
            if choice == SDPBackend.FLASH_ATTENTION.value:
                return aten._scaled_dot_product_flash_attention.default(query, key, value, 0.0, is_causal, False,
                                                                         scale=scale)[0]
            if choice == SDPBackend.CUDNN_ATTENTION.value:
                return aten._scaled_dot_product_cudnn_attention.default(query, key, value, None, True, 0.0, is_causal,
                                                                        False, scale=scale)[0]
            return aten._scaled_dot_product_efficient_attention.default(query, key, value, None, True, 0.0, is_causal,
                                                                        scale=scale)[0]
    return torch._C._nn.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                     enable_gqa=enable_gqa)


def pin_sdpa(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm whose SDPA calls trace as `sdpa_as_eager_picks`, or gm where it has none."""
    if not any(is_sdpa_call(n) for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if is_sdpa_call(n):
            n.target = sdpa_as_eager_picks
    return fx.GraphModule(gm, graph)
