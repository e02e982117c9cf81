"""A recognised attention lowered to torch's `scaled_dot_product_attention`, where that is exact.

SDPA (flash, cuDNN, memory-efficient) is faster than our own kernel wherever it can express the
score chain, and it has a backward.  It computes softmax(a * s + c) @ v for a scale `a` and an
additive mask `c` (or torch's top-left causal mask).  The checker walks the chain from the scores
and keeps it in that form:

- `mul`/`div` by a constant number scales both `a` and `c`; `neg` and `x - s` negate them; by a
  one-element tensor (a float Dynamo made an input) it scales `c` and q instead;
- `add`/`sub` of a tensor or number that does not depend on the scores adds it to `c`;
- `masked_fill` / `where` with a constant fill replaces the score; that equals adding the fill only
  when the fill absorbs any score (|fill| >= 1e30 or infinite: finfo.min of bf16/fp32, -inf), so a
  smaller fill (-1e4, fp16's finfo.min through masked_fill, 0) goes to our own kernel;
- float casts pass (a widening cast of `c` changes no value and is skipped).
Anything else (soft-capping, a multiplicative mask) is not expressible: the caller uses our kernel.

`c` is built from the chain's own ops with the scores taken as zero, so it rounds as eager's mask
did.  SDPA adds it to fp32 scores: where eager rounds `a * s + c` to 16 bits first the two differ by
that rounding, as all our fused kernels do (numerics policy).  Finite mask values are clamped to
+-1e36, which still absorbs any score (SDPA's CUDA kernels scale the mask by log2(e): bf16's and
fp32's finfo.min would overflow to -inf).  Fully masked rows: eager's softmax of
an all -inf row is NaN, SDPA's is 0; where `c` may hold -inf (we cannot prove it finite), the rows
whose every key is -inf are set back to NaN after the call (one small reduction over `c`, shared by
the attentions that read the same mask).  A mask of constants is evaluated at compile time: torch's
causal mask becomes `is_causal=True` (no mask read), an all-zero mask none at all; a mask that a
masked_fill/where makes from parameters and buffers alone is checked for it at run time
(causal_or_masked).  Dropout on the
probabilities (training, traced before autograd) is SDPA's `dropout_p`.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fuser.graph import (constant_value, contiguous_where_copied, fake_mode_of, insert, meta, operands, packet, real_tensors,
                         replace_output, shape)
from fuser.indexing import Sizes
from .attention import mask_structure

aten = torch.ops.aten
ABSORBING = 1e30  # |fill| at which fp32 a*s + fill == fill for any score below 1e22
SAFE_MASK = 1e36  # past ~2.3e38, SDPA's exp2 scaling (x log2(e)) overflows fp32
_CASTS = {aten._to_copy, aten.clone, aten.alias, torch.ops.prims.convert_element_type}
_CAST_KWARGS = {"dtype", "memory_format", "layout", "device", "pin_memory", "non_blocking"}
_SAFE = {aten.view, aten._unsafe_view, aten.expand, aten.unsqueeze, aten.permute, aten.slice, aten.select,
         aten.clone, aten.alias, aten.index, aten.squeeze, aten.repeat, aten.cat, aten.embedding,
         aten.t, aten.transpose}  # layout and gather ops: a value they output was a value of an input


class NotExpressible(Exception):
    """The score chain is not softmax(a * s + c): the reason, for the report."""


def _number(x) -> float | None:
    """A Python number, or the value of a one-element constant node."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node) and meta(x) is not None and meta(x).numel() == 1:
        v = constant_value(x)
        with real_tensors():
            return None if v is None else float(v.reshape(()))
    return None


class _Builder:
    """Inserts nodes before the attention's output, each with its fake tensor; remembers them to undo."""

    def __init__(self, graph: fx.Graph, before: fx.Node):
        self.graph, self.before, self.made = graph, before, []
        self.mode = fake_mode_of(graph)

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        n = insert(self.graph, self.before, self.mode, target, *args, **kwargs)
        self.made.append(n)
        return n

    def undo(self):
        for n in reversed(self.made):
            if not n.users:
                self.graph.erase_node(n)


def _mask(att, build: _Builder) -> tuple[float, fx.Node | None, list]:
    """(a, c, factors): the scale and the additive mask (None: zero) of the chain, c built as graph
    nodes, and the one-element tensors the scores are multiplied or divided by (applied to q)."""
    a, c, factors = 1.0, None, []
    dep = {att.scores}
    for n in att.chain:
        if not any(x in dep for x in operands(n)):
            continue  # a constant of the chain (a fill value): read through _number
        dep.add(n)
        p, args = packet(n), list(n.args)
        here = [i for i, x in enumerate(args) if x in dep]
        if len(here) != 1 or any(x in dep for x in n.kwargs.values()):
            raise NotExpressible(f"{p} reads the scores twice")
        i, dt = here[0], meta(n).dtype
        if p in (aten.mul, aten.div):
            other = args[1 - i]
            if p is aten.div and i != 0:
                raise NotExpressible("a tensor divided by the scores")
            k = _number(other)
            if k is None and isinstance(other, fx.Node) and meta(other) is not None and meta(other).numel() == 1:
                factors.append((n.target, other))  # a scale known at run time only (Dynamo's unspecialised float)
                c = None if c is None else build(n.target, c, other)
                continue
            if k is None or not math.isfinite(k) or k == 0:
                raise NotExpressible(f"{p} of the scores by a tensor (a multiplicative mask)")
            a = a * k if p is aten.mul else a / k
            c = None if c is None else build(n.target, c, k)
        elif p in (aten.add, aten.sub, aten.rsub):
            if n.kwargs.get("alpha", args[2] if len(args) > 2 else 1) != 1:
                raise NotExpressible(f"{p} with alpha")
            x = args[1 - i]
            negated = (p is aten.sub and i == 1) or (p is aten.rsub and i == 0)  # x - scores
            if not isinstance(x, fx.Node):
                if not math.isfinite(float(x)):
                    raise NotExpressible(f"{p} of {x} to every score")
                if negated:
                    a, c = -a, (None if c is None else build(aten.neg.default, c))
                continue  # a constant shift of every score: softmax does not see it
            if negated:
                a = -a
                c = x if c is None else build(aten.sub.Tensor, x, c)
            elif p is aten.add:
                c = x if c is None else build(aten.add.Tensor, c, x)
            else:  # scores - x
                c = build(aten.neg.default, x) if c is None else build(aten.sub.Tensor, c, x)
        elif p is aten.neg:
            a = -a
            c = None if c is None else build(aten.neg.default, c)
        elif p in (aten.masked_fill, aten.where):
            if p is aten.masked_fill:
                if i != 0:
                    raise NotExpressible("masked_fill of a mask made from the scores")
                cond, fill, keep_fill = args[1], _number(args[2]), True
            else:
                if i == 0:
                    raise NotExpressible("where with a condition made from the scores")
                cond, fill, keep_fill = args[0], _number(args[3 - i]), i == 2
            if fill is None:
                raise NotExpressible(f"{p} with a fill that is a tensor")
            if not (abs(fill) >= ABSORBING or math.isinf(fill)):
                raise NotExpressible(f"{p} fills {fill:g}, which replaces the score instead of masking it "
                                     f"(SDPA adds its mask)")
            # the fill a scalar, not a tensor: a CPU scalar tensor in `where` is copied to the GPU per call (the
            # copy waits for the GPU), a GPU one is a launch per call
            if c is not None:
                c = build(aten.where.ScalarSelf, cond, fill, c) if keep_fill else build(aten.where.ScalarOther, cond, c, fill)
            else:  # the mask starts from the fill: 0-d tensors of the scores' dtype on their device, literals of
                # the region that makes the mask (where.Scalar, float32, failed an fp32-upcast bf16 chain on CUDA)
                zero, filled = (build(aten.scalar_tensor.default, x, dtype=dt, device=meta(n).device) for x in (0.0, fill))
                c = build(aten.where.self, cond, filled, zero) if keep_fill else build(aten.where.self, cond, zero, filled)
        elif p in _CASTS:
            if set(n.kwargs) - _CAST_KWARGS or not dt.is_floating_point or meta(n).device != meta(args[0]).device:
                raise NotExpressible(f"{p} to {dt}")
            if c is not None and meta(c).dtype != dt and torch.finfo(dt).bits < torch.finfo(meta(c).dtype).bits:
                c = build(aten._to_copy.default, c, dtype=dt)  # a narrowing cast rounds the mask as eager did
        else:
            raise NotExpressible(f"{p} on the scores")
    return a, c, factors


def finite(n, depth: int = 0) -> bool:
    """True where n's values are provably never infinite: bools, ints, finite constants and what
    layout ops and `where` make of them (HF's `where(keep, 0, finfo.min)`).  Arithmetic may overflow
    and a parameter may hold anything: not provable."""
    if isinstance(n, (int, float, bool)):
        return math.isfinite(n)
    if not isinstance(n, fx.Node) or depth > 64:
        return False
    v = meta(n)
    if v is not None and not (v.dtype.is_floating_point or v.dtype.is_complex):
        return True
    if n.op == "get_attr" or packet(n) in (aten.full, aten.scalar_tensor):
        value = constant_value(n)
        with real_tensors():
            return value is not None and bool(torch.isfinite(value).all())
    p = packet(n)
    if p is aten.where:
        return all(finite(x, depth + 1) for x in n.args[1:3])
    if p is aten._to_copy:
        src = meta(n.args[0])
        if src is not None and src.dtype == torch.bool:
            return True
        if src is not None and not src.dtype.is_floating_point:  # ints: finite unless the float type is narrow
            return v is not None and torch.finfo(v.dtype).max > 2.0 ** 64
        return finite(n.args[0], depth + 1) and v is not None and src is not None and \
            torch.finfo(v.dtype).max >= torch.finfo(src.dtype).max
    if p in _SAFE:
        return all(finite(x, depth + 1) for x in operands(n) if meta(x) is not None and meta(x).dtype.is_floating_point)
    return False


def lower(gm: fx.GraphModule, att, fixups: dict, buffers: set | None = None,
          structured=None, listed=None) -> tuple[str, list]:  # att: patterns.attention.Attention
    """Rewrites `att` in gm's graph as one SDPA call; returns the call as text for the report, and
    the nodes made.
    Raises NotExpressible (the graph unchanged) where SDPA cannot compute what eager does.
    `fixups` holds, per mask node, the copy SDPA takes (clamped, its keys adjacent) and its "row fully
    -inf" node, shared by the attentions of one graph.  `buffers`: inputs that are the same tensors every
    call (parameters and buffers); None where nothing may be checked at run time (CUDA graphs replay the calls;
    the trace before autograd, where the check would be traced, not run): a mask computed from them alone, or
    from sizes alone (aranges at a symbolic length: checked once per length), is checked at run time for torch's
    causal mask (causal_or_masked), and for a sliding window, which then runs
    `structured(q, k, v, window, scale)` (our kernel); a mask of neither runs `listed` (causal_or_masked)."""
    graph = gm.graph
    q, k, v = att.q, att.k, att.v
    h, m = shape(q)[1:3]
    hkv = shape(k)[1]
    build = _Builder(graph, att.out)
    added = []  # the fixups this call made: dropped with its nodes where it gives up (`give_up`)

    def give_up():
        build.undo()
        for key in added:
            del fixups[key]
    try:
        scale, c, factors = _mask(att, build)
        low = False
        if att.safe:
            q, k, v, c, scale, low = _undo_math_path(build, q, k, v, c, scale)
        causal, value, checked, sources, clamped, dense = False, None, None, [], False, False
        if c is not None:
            value = constant_value(c) if m.is_Integer and shape(k)[2].is_Integer else None
            if value is not None:
                with real_tensors():
                    causal, c = _constant_mask(value, int(m), int(shape(k)[2]), c)
            qdt = meta(q).dtype
            if c is not None and meta(c).dtype != qdt:
                if not meta(c).dtype.is_floating_point or torch.finfo(meta(c).dtype).bits > torch.finfo(qdt).bits:
                    raise NotExpressible(f"the additive mask is {meta(c).dtype}, wider than the {qdt} attention: "
                                         "SDPA would round it")
                c = build(aten._to_copy.default, c, dtype=qdt)
            checked = c
            sources = mask_sources(checked) if c is not None and value is None else []
            sizes = size_sources(checked) if c is not None and value is None and not sources and buffers is not None else []
            sources = sources or sizes  # a mask made from sizes alone (aranges at a symbolic length)
            filled = any(packet(n) in (aten.masked_fill, aten.where) for n in att.chain)
            if not set(sources) <= set(buffers or ()) | set(sizes) or m != shape(k)[2] or att.dropout \
                    or not filled:  # a padding mask (new every call), or
                sources = []  # a decode step (torch's causal mask is square), a bias (T5's: no fill)
            if c is not None and not sources:  # shared by the attentions reading the same mask (T5's position bias)
                if ("given", checked) not in fixups:
                    fixups[("given", checked)] = _given(build, c, value)
                    added.append(("given", checked))
                c, clamped, dense = fixups[("given", checked)]
    except NotExpressible:
        give_up()
        raise
    gqa = hkv != h
    kk, vv = k, v
    if gqa and c is not None and not sources:  # SDPA's memory-efficient kernel (the one taking a mask) has no GQA: repeat
        kk, vv = (build(aten.flatten.using_ints, build(aten.clone.default, build(
            aten.expand.default, build(aten.unsqueeze.default, x, 2), [-1, -1, h // hkv, -1, -1]),
            memory_format=torch.contiguous_format), 1, 2) for x in (k, v))
    kwargs = dict(attn_mask=c, dropout_p=att.dropout, is_causal=causal, scale=scale)
    if gqa and c is None:
        kwargs["enable_gqa"] = True
    if att.safe and not _runs_fused(q, kk, vv, kwargs, Sizes.of_graph(graph).hint):
        give_up()
        raise NotExpressible("SDPA's math path, and SDPA would take it again for these tensors (as eager does): "
                             "left as decomposed, to our regions")
    for op, factor in factors:  # (q * f) @ k^T == (q @ k^T) * f; q rounds where eager rounded the scores
        q = build(op, q, factor)
    fix_rows = c is not None and value is None and not finite(checked) and not att.safe  # a constant mask was checked above
    boolean = _boolean(checked) if sources else None
    if sources:  # the mask as the program made it: clamped, and its rows of -inf found, only where SDPA takes it
        dims = (shape(q)[-1], shape(v)[-1])
        ours = meta(q).dtype in (torch.float16, torch.bfloat16, torch.float32) and all(d.is_Integer and int(d) <= 256
                                                                                      for d in dims)
        # ours: what our kernels take (as fuser.pregrad checks for training); else SDPA with the mask
        given = boolean[0] if boolean else c  # a boolean mask read as it is: no additive copy made per call
        out = build(causal_or_masked(structured if ours else None, listed if ours else None, fix_rows,
                                     *(boolean[1:] if boolean else ())), q, k, v, given, *sources, scale=scale)
    else:
        if fix_rows and checked not in fixups:  # eager: NaN where every key of a row is -inf; SDPA: 0
            fixups[checked] = build(aten.eq.Scalar, build(aten.amax.default, checked, [-1], True), float("-inf"))
            added.append(checked)
        try:
            out = build(aten.scaled_dot_product_attention.default, q, kk, vv, **kwargs)
        except RuntimeError as e:  # torch 2.11's fake SDPA pads a mask of symbolic length with a kernel taking ints
            give_up()
            raise NotExpressible(f"SDPA's fake kernel fails on these sizes ({str(e).splitlines()[0][-80:]})") from e
        if fix_rows:
            out = build(aten.where.ScalarSelf, fixups[checked], float("nan"), out)  # a scalar: see _mask
    if att.safe and low:
        out = build(aten._to_copy.default, out, dtype=meta(att.out).dtype)
    text = [f"attn_mask={list(shape(c)) if c is not None else None}", f"is_causal={causal}", f"scale={scale:g}"]
    if att.dropout:
        text.append(f"dropout_p={att.dropout:g} (SDPA's own random stream: eager's masks differ, not their law)")
    if c is not None and (clamped or sources and _clamps(meta(checked).dtype)):
        text.append(f"mask clamped to +-{SAFE_MASK:g} (SDPA's exp2 would overflow finfo.min)"
                    + (" where SDPA takes it" if sources else ""))
    if dense:
        text.append("the mask written with its keys adjacent (SDPA's fused kernels read it so)")
    if factors:
        text.append(f"q scaled by {', '.join(f.name for _, f in factors)} (a scale given at run time)")
    if boolean:
        text.append(f"the boolean {boolean[0].name} read as the mask ({boolean[1]}, fill {boolean[2]:g}; "
                    "no additive mask made)")
    if sources:
        text.append(f"the mask (from {', '.join(x.name for x in sources)}) checked at run time for torch's "
                    "causal mask (then is_causal, no mask read)"
                    + (" or a sliding window (then our kernel over the window's tiles)" if structured else "")
                    + ", once per new value of its inputs")
    if gqa:
        text.append("enable_gqa=True" if c is None or sources else
                    f"K/V heads repeated x{h // hkv} (the masked kernel has no GQA)")
    if fix_rows:
        text.append("rows whose every key is -inf set to NaN, as eager" + (" (our kernel gives NaN there itself)"
                                                                           if sources and listed else ""))
    if att.safe:
        text.append("SDPA's math path as the tracer decomposed it (_safe_softmax: a fully masked row gives 0), "
                    + ("run on the program's 16-bit q, k, v" if low else "q and k scales folded"))
    replace_output(att.out, out)  # SDPA's output may be in its own memory order ([B, M, H, D])
    if packet(out) is aten.scaled_dot_product_attention:
        contiguous_where_copied(out)
    for n in reversed(att.nodes):
        if not n.users:
            graph.erase_node(n)
    return "scaled_dot_product_attention: " + ", ".join(text), build.made


def _undo_math_path(build, q, k, v, c, scale: float):
    """SDPA's math path, decomposed by the tracer (it picked no fused kernel for fake tensors): q and k
    each scaled by sqrt(scale), and 16-bit q, k, v cast to fp32 first (the mask promoted by the add,
    or cast).  The scales fold into SDPA's; the casts are dropped, so that SDPA runs on the program's
    16-bit tensors, as the program's own SDPA call would in eager (its output is cast back to fp32 for
    the graph).  Returns (q, k, v, c, scale, whether the casts were dropped).  Where q, k, v are such
    casts but the mask holds fp32 values (T5's position bias, Falcon's ALiBi), raises NotExpressible:
    SDPA would round the mask to 16 bits, and an fp32 SDPA beside the casts was slower than the
    decomposition left to our regions (T5 on the H100, 2026-11-23)."""
    def factor(x):
        if packet(x) is aten.mul and isinstance(x.args[1], (int, float)) and len(x.users) == 1:
            return x.args[0], float(x.args[1])
        return x, 1.0

    def source(x):
        return x.args[0] if packet(x) in (aten._to_copy, torch.ops.prims.convert_element_type) else None
    (q, a), (k, b) = factor(q), factor(k)
    scale *= a * b
    casts = [source(x) for x in (q, k, v)]
    if not all(isinstance(x, fx.Node) for x in casts):
        if any(x is not None for x in casts):
            raise NotExpressible("SDPA's math path over fp32 copies of only some of q, k, v: left as decomposed")
        return q, k, v, c, scale, False
    low = meta(casts[0]).dtype
    if {meta(x).dtype for x in casts} != {low} or low not in (torch.float16, torch.bfloat16) \
            or meta(q).dtype != torch.float32:
        raise NotExpressible("SDPA's math path over fp32 copies of q, k, v that are not all of one 16-bit dtype: "
                             "left as decomposed")
    if c is not None:
        c = _in_dtype(build, c, low)
        if c is None:
            raise NotExpressible(f"SDPA's math path over fp32 copies of {low} q, k, v with an fp32 mask "
                                 f"(SDPA would round it to {low}): left as decomposed")
    return (*casts, c, scale, True)


def _runs_fused(q, k, v, kwargs: dict, hint) -> bool:
    """Whether SDPA picks a fused kernel, not its math path, for tensors laid out as these, asked of
    torch itself (`_fused_sdp_choice`, what SDPA asks when called) with uninitialised tensors of their
    shapes (batch 1, sizes at their hints), strides and dtypes on their device.  The tracer asked it
    of fake tensors and got the math path where real ones get a fused kernel (ViT on the H100), but a
    math path it picks for real tensors too (T5's position bias) gains nothing over the
    decomposition, which our regions fuse."""
    def real(n):
        if not isinstance(n, fx.Node):
            return n
        t = meta(n)
        size = [hint(x) for x in t.shape]
        if t.dim() == 4:
            size[0] = 1
        return torch.empty_strided(size, [hint(x) for x in t.stride()], dtype=t.dtype, device=t.device)
    try:
        with real_tensors():
            args = {key: real(x) for key, x in kwargs.items()}
            choice = torch._fused_sdp_choice(real(q), real(k), real(v), args.pop("attn_mask"), args.pop("dropout_p"),
                                             args.pop("is_causal"), **args)
    except RuntimeError:  # torch could not say: the recognition stands
        return True
    return choice != torch.nn.attention.SDPBackend.MATH.value


def _in_dtype(build, c: fx.Node, dtype):
    """The mask `c` of an upcast math path in `dtype` without changing a value: c itself (promoted by
    the add), the tensor it was cast from, or a where between numbers `dtype` holds exactly (a
    boolean mask made additive: 0 and -inf); else None."""
    if meta(c).dtype == dtype:
        return c
    if packet(c) in (aten._to_copy, torch.ops.prims.convert_element_type) and meta(c.args[0]).dtype == dtype:
        return c.args[0]
    if packet(c) is aten.where and all(_number(x) is not None and torch.tensor(_number(x), dtype=dtype).item() == _number(x)
                                       for x in c.args[1:]):
        return build(aten._to_copy.default, c, dtype=dtype)
    return None


def _in_safe_range(build: _Builder, c: fx.Node, value) -> fx.Node:
    """c with its finite values clamped to +-SAFE_MASK.  SDPA's CUDA kernels run the softmax in base 2
    and multiply the mask by log2(e): a finfo.min of bf16 or fp32 (HF's masks) overflows to -inf
    there, and a row masked entirely by it gives 0 instead of eager's uniform average.  Any value past
    1e30 absorbs the scores the same, so the clamp changes nothing else; -inf stays -inf."""
    if not _clamps(meta(c).dtype):
        return c
    if value is not None:
        with real_tensors():
            v = value.float()
            if not bool((v[v.isfinite()].abs() > SAFE_MASK).any()):
                return c
    clamped = build(aten.clamp.default, c, -SAFE_MASK, SAFE_MASK)
    return build(aten.where.self, build(aten.isinf.default, c), c, clamped)


def _given(build: _Builder, c: fx.Node, value) -> tuple[fx.Node, bool, bool]:
    """(the mask as SDPA takes it, whether clamped, whether copied to make its keys adjacent).  Its finite values
    clamped (`_in_safe_range`); its keys at stride 1: SDPA's kernels that take a mask (memory-efficient, cuDNN)
    read it so, whatever the keys' number, and a mask in another layout (T5's position bias, its heads innermost)
    sent SDPA to its math path (run 132, H200: fp32 matmuls, the scores written, 2x Inductor's GPU time on T5).
    The dimensions it broadcasts over (stride 0) stay broadcast: the clamp and the copy are made on one slice,
    expanded back after (a view), so no [B, H, M, N] tensor is written for a smaller mask.  Made once per mask
    (`fixups`), fused into the region making the mask where the graph makes it."""
    v = meta(c)
    one = c
    for i in range(v.dim() - 1):  # not the keys: SDPA needs them at stride 1
        if statically_known_true(v.stride()[i] == 0) and not statically_known_true(v.shape[i] == 1):
            one = build(aten.slice.Tensor, one, i, 0, 1)
    safe = _in_safe_range(build, one, value)
    dense = safe if statically_known_true(meta(safe).stride()[-1] == 1) else \
        build(aten.clone.default, safe, memory_format=torch.contiguous_format)
    if dense is one:  # as it is (the slices, unread, go with the graph's dead code)
        return c, False, False
    return dense if one is c else build(aten.expand.default, dense, list(v.shape)), safe is not one, dense is not safe


def _boolean(c: fx.Node) -> tuple[fx.Node, str, float] | None:
    """(b, kind, fill) where the additive mask `c` is `where(b, fill, 0)` ("drop": True masks) or `where(b, 0,
    fill)` ("keep") of a boolean b and a fill that absorbs any score (<= -ABSORBING), perhaps cast after (the fill
    then as the cast rounds it): masked_fill's and torch.where's masks, which a kernel reads as booleans."""
    dtype = meta(c).dtype
    if packet(c) in (aten._to_copy, torch.ops.prims.convert_element_type) and meta(c.args[0]).dtype.is_floating_point:
        c = c.args[0]
    if packet(c) is not aten.where or len(c.args) != 3 or meta(c.args[0]).dtype != torch.bool:
        return None
    a, b = (_number(x) for x in c.args[1:])
    if a is None or b is None:
        return None
    a, b = (torch.tensor(x, dtype=meta(c).dtype).to(dtype).item() for x in (a, b))
    if b == 0 and a <= -ABSORBING:
        return c.args[0], "drop", a
    if a == 0 and b <= -ABSORBING:
        return c.args[0], "keep", b
    return None


def _clamps(dtype: torch.dtype) -> bool:
    """Whether a mask of `dtype` may hold finite values past SDPA's safe range."""
    return torch.finfo(dtype).max > SAFE_MASK


def mask_sources(mask: fx.Node) -> list:
    """The graph inputs a mask is computed from, all tensors, or [] where it also reads a size (the mask's
    shape varies) or draws random numbers."""
    tensors, sizes = _inputs_of(mask)
    return [] if sizes else tensors


def size_sources(mask: fx.Node) -> list:
    """The size inputs (symbolic ints) a mask is computed from, where it reads no tensor input and draws no
    random numbers (a causal mask from aranges at a symbolic length), else []."""
    tensors, sizes = _inputs_of(mask)
    return [] if tensors else sizes


def _inputs_of(mask: fx.Node) -> tuple[list, list]:
    """(tensor inputs, size inputs) the mask is computed from, each sorted by name; ([], []) where it draws
    random numbers or reads another kind of input."""
    seen, todo, tensors, sizes = set(), [mask], [], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if meta(n) is None and not isinstance(n.meta.get("val"), torch.SymInt):
                return [], []  # a symbolic float, say: neither kind of source
            (tensors if meta(n) is not None else sizes).append(n)
        elif n.op == "call_function":
            if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags:
                return [], []
            todo += n.all_input_nodes
    return sorted(tensors, key=lambda n: n.name), sorted(sizes, key=lambda n: n.name)


RECHECKS = 3  # inputs that are new tensors every call: checked again this many times, then the mask is used as given
SIZE_ANSWERS = 64  # sizes a mask made from sizes alone is checked at, per call site; at others it is used as given


class RunTimeCheck:
    """A call site's answer about values the compiled graph cannot see (a mask made from parameters and
    buffers: causal? a window?), kept with its inputs' weak refs, versions and addresses and worked out again
    only when an input is another tensor, was written in place or pointed at other memory (`.data =`), at most
    RECHECKS times after the first; then None (the mask is applied as given).  Inputs made under
    `torch.inference_mode()` keep no version: None for them (never a stale answer).  Sources that are sizes (a
    mask made from aranges at symbolic lengths): the answer is kept per set of sizes, SIZE_ANSWERS of them."""

    def __init__(self):
        self.stamp, self.answer, self.checks, self.value, self.current = None, None, 0, None, False
        self.by_size: dict = {}  # a mask made from sizes alone: the answer per set of sizes

    def _same(self, sources) -> bool:
        return self.stamp is not None and len(self.stamp) == len(sources) and all(
            r() is x and version == x._version and ptr == x.data_ptr() for (r, version, ptr), x in zip(self.stamp, sources))

    def __call__(self, sources, compute):
        self.current = False
        if sources and all(isinstance(x, int) for x in sources):  # sizes: the answer is theirs, checked once each
            key = tuple(sources)
            if key not in self.by_size:
                if len(self.by_size) >= SIZE_ANSWERS:
                    return None
                self.by_size[key] = compute()
            return self.by_size[key]
        if any(x.is_inference() for x in sources):
            return None
        self.current = self._same(sources)
        if self.current:
            return self.answer
        if self.checks > RECHECKS:
            return None
        self.current = True
        self.stamp = [(weakref.ref(x), x._version, x.data_ptr()) for x in sources]
        self.value = SameValue.of(self.stamp)  # held here: the token lives while a site checked these sources
        self.answer = compute()
        self.checks += 1
        return self.answer

    def same_value(self) -> "SameValue | None":
        """After a call: an object that stands for the value of what its sources make, where they were the
        tensors, versions and addresses of the last check, else None: what a mask made of them alone keeps
        across calls (its tile lists: codegen.attention._extra_args).  The call sites whose sources are the
        same get the same object (a model's layers reading one mask)."""
        return self.value if self.current else None


class SameValue:
    """See RunTimeCheck.same_value: one per set of sources (the same tensors, alive, at the same versions and
    addresses), while a call site holds it."""
    _made = weakref.WeakValueDictionary()

    def __init__(self, stamp):
        self.refs = [r for r, _, _ in stamp]

    @classmethod
    def of(cls, stamp) -> "SameValue":
        key = tuple((id(r()), version, ptr) for r, version, ptr in stamp)
        made = cls._made.get(key)
        if made is None or any(a() is not b() for a, b in zip(made.refs, (r for r, _, _ in stamp))):
            made = cls._made[key] = cls(stamp)  # (an id again, of another tensor: a new one)
        return made


def causal_or_masked(structured=None, listed=None, fix_rows: bool = False, kind: str = "add", fill: float = 0.0):
    """A new call site of SDPA over a mask computed from parameters and buffers (nanoGPT's causal
    `bias` buffer, Mistral's window), with its own decision (kept by the compiled graph that calls
    it, gone with it).  Where the mask is torch's causal mask (0 on and below the diagonal, <= -1e30
    above), SDPA runs with is_causal=True: the flash kernel, no mask read, half the tiles.  Where it
    is a sliding window over that and `structured(q, k, v, window, scale)` is given (our kernel,
    which skips the tiles outside the window), that runs.  The check (a few comparisons and a host
    sync) runs again only when an input the mask is made from is another tensor or was written in
    place (its version), at most RECHECKS times; else the mask is applied as the program made it: by
    `listed(q, k, v, mask, scale, same, kind, fill)` where given (our kernel over the tiles the mask keeps, the
    ones it masks whole skipped: 0.65 against SDPA's 1.8 ms forward with a padded causal mask at S4096,
    whose memory-efficient kernel reads the whole mask; rows of -inf give NaN there as in eager; `same`:
    RunTimeCheck.same_value, so that the lists are made once while the sources stay), else by SDPA, the
    mask clamped to +-SAFE_MASK first and, with `fix_rows`, its rows of -inf set to NaN after, as eager's.
    `kind`: the mask additive ("add"), or a boolean whose True keeps ("keep") or masks ("drop") a key, masked
    keys then at `fill` (in q's dtype)."""
    check = RunTimeCheck()

    def causal_or_masked(q, k, v, mask, *sources, scale: float):
        gqa = q.shape[1] != k.shape[1]
        if not isinstance(q, FakeTensor):
            found = check(sources, lambda: _structure(mask, q.shape[2], k.shape[2], kind))
            if found is not None:
                window = found[1]
                if window is None:
                    return aten.scaled_dot_product_attention.default(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
                if structured is not None:
                    return structured(q, k, v, window, scale)
            if listed is not None:
                return listed(q, k, v, mask, scale, check.same_value(), kind, fill)
        if gqa:  # the memory-efficient kernel (the one taking a mask) has no GQA
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
        if kind != "add":  # the additive mask the program made
            mask = torch.where(mask if kind == "drop" else ~mask, torch.tensor(fill, dtype=q.dtype, device=q.device),
                               torch.zeros((), dtype=q.dtype, device=q.device))
        safe = mask
        if _clamps(mask.dtype):  # as _in_safe_range in a graph
            safe = torch.where(mask.isinf(), mask, mask.clamp(-SAFE_MASK, SAFE_MASK))
        out = aten.scaled_dot_product_attention.default(q, k, v, attn_mask=safe, scale=scale)
        return torch.where(mask.amax(-1, keepdim=True) == float("-inf"), float("nan"), out) if fix_rows else out
    causal_or_masked.causal_check = True
    return causal_or_masked


def _structure(mask: torch.Tensor, m: int, n: int, kind: str) -> tuple[int, int | None] | None:
    """(0, window or None) where the mask (additive, masked at <= -ABSORBING; or boolean: `kind`) is the same for
    every batch and head and masks exactly the keys past the diagonal (and, with a window, those `window` or
    more behind)."""
    found = mask_structure(mask, kind, m, n)
    return found if found is not None and found[0] == 0 else None


def _constant_mask(value: torch.Tensor, m: int, n: int, c: fx.Node):
    """(is_causal, mask node or None) for a mask known at compile time."""
    value = value.float()
    if not bool(value.any()):
        return False, None
    full = value.expand(*value.shape[:-2], m, n).reshape(-1, m, n)
    if bool((full == float("-inf")).all(-1).any()):
        raise NotExpressible("the constant mask masks every key of some row (eager gives NaN there)")
    upper = torch.ones(m, n, dtype=torch.bool, device=value.device).triu(1)
    if bool((full[:, ~upper] == 0).all()) and bool((full[:, upper] <= -ABSORBING).all()):
        return True, None
    return False, c


