"""The decomposition table AOT Autograd lowers with: the ops we fuse become the primitives the op
table lowers (var_mean, rsqrt, exp, sum and pointwise ops); SDPA and dropout stay whole.

torch's own decompositions where they fit; the few written here say why they are not torch's.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._inductor import inductor_prims  # its fma prim, which Dynamo writes (see fma)
from torch._prims_common import get_computation_dtype, suggest_memory_format
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops
from .plan import NUM_SMS
from .region import PERSISTENT_MAX_R

aten = torch.ops.aten


def decompositions() -> dict:
    """The table, a copy per backend of one built once a process: torch's core table lists every
    CompositeImplicit op of every namespace, 0.2 s a build on CPU (half of a small graph's compile,
    measured on the op tests).  A composite op registered after the first build is missing from it and
    decomposes anyway: AOT traces below the CompositeImplicit key."""
    return dict(_table())


@functools.cache
def _table() -> dict:
    table = dict(core_aten_decompositions())
    # torch's own decompositions of the norms: var_mean, rsqrt and pointwise ops, which we fuse.  All
    # BatchNorm entry points are listed, since each decomposes through the next (the eval one calls
    # the mutating `_native_batch_norm_legit`, which must decompose too, functionally in eval); the
    # backward ones (native_batch_norm_backward, native_group_norm_backward) are core decompositions.
    # `repeat` (InstanceNorm repeats its affine per sample) becomes expand + reshape: index math.
    # linalg_vector_norm (weight_norm's ||v||, clip-by-norm) and adaptive average pooling (a global pool, or
    # windows of a divisible size: a mean; ragged ones gathers) are pointwise ops and sums too.
    table.update(get_decompositions([
        aten.linalg_vector_norm, aten._adaptive_avg_pool2d,
        aten.native_layer_norm, aten._softmax, aten._log_softmax, aten.repeat,
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional, aten._batch_norm_with_update_functional,
        aten._batch_norm_no_update]))
    table[aten.native_group_norm.default] = native_group_norm
    table[aten.native_group_norm_backward.default] = native_group_norm_backward
    table[aten.copy.default] = copy
    table[aten.split_with_sizes.default] = split_with_sizes  # split and chunk decompose to it
    table[aten.unbind.int] = unbind
    table[inductor_prims.fma] = fma
    table[aten.max.dim], table[aten.min.dim] = max_dim, min_dim
    table[aten.max.default], table[aten.min.default] = aten.amax.default, aten.amin.default
    table[aten._adaptive_avg_pool2d_backward.default] = adaptive_avg_pool2d_backward
    table[aten._adaptive_avg_pool2d.default] = functools.partial(adaptive_avg_pool2d, table[aten._adaptive_avg_pool2d.default])
    table[aten.max_pool2d_with_indices.default] = max_pool2d_with_indices
    table[aten.avg_pool2d.default] = avg_pool2d
    for op in (aten._softmax.default, aten._log_softmax.default):
        table[op] = functools.partial(softmax_over_many_rows, table[op])
    table[aten.mm.default] = table[aten.bmm.default] = outer_product
    for op in [*ops.KEEP_WHOLE, aten.baddbmm]:  # baddbmm: one cuBLAS call (BLOOM's scores: see patterns)
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


def split_with_sizes(x, split_sizes, dim: int = 0):
    """The pieces as slices, views our kernels compose into their index math.  Not torch's (as_strided,
    whose strides hide which dimension is cut) nor the op itself: one op of several results, which a region
    cannot hold, so the pointwise work that made the tensor split (a GLU's `chunk` after a scale or a bias)
    was a kernel of its own, its result written out for the pieces' readers."""
    dim = torch._prims_common.canonicalize_dim(x.dim(), dim)
    torch._check(all(size >= 0 for size in split_sizes), lambda: "split_with_sizes expects non-negative split sizes")
    torch._check_with(ValueError, sum(split_sizes) == x.shape[dim],
                      lambda: f"Split sizes add up to {sum(split_sizes)} but got the tensor's size of {x.shape[dim]}")
    pieces, start = [], 0
    for size in split_sizes:
        pieces.append(aten.slice.Tensor(x, dim, start, start + size))
        start = start + size
    return pieces


def fma(a, b, c):
    """Dynamo writes `addcmul_(t1, t2, value=v)` and `add_(x, alpha=tensor)` (a single-tensor Adam's update) as
    Inductor's fused multiply-add prim: a * b + c, which our kernels compute in fp32 (Triton contracts it
    to one fma), rounded once; the prim had no lowering and ran eagerly beside its mul."""
    return aten.add.Tensor(aten.mul.Tensor(a, b), c)


def max_dim(x, dim: int, keepdim: bool = False):
    """`values, indices = x.max(dim)` (greedy decoding's logits.max(-1)) as amax and argmax, reductions our
    kernels hold: the op, of two results, had run eagerly with its producer.  Both give the first NaN and the
    first of tied maxima, as max.dim does; its gradient stays max's own (autograd runs above this table).
    Bools stay the op (argmax refuses them), and 0-d tensors (a reduction over no dim)."""
    if x.dtype == torch.bool or x.dim() == 0:
        return NotImplemented
    return aten.amax.default(x, [dim], keepdim), aten.argmax.default(x, dim, keepdim)


def min_dim(x, dim: int, keepdim: bool = False):
    """As max_dim."""
    if x.dtype == torch.bool or x.dim() == 0:
        return NotImplemented
    return aten.amin.default(x, [dim], keepdim), aten.argmin.default(x, dim, keepdim)


def unbind(x, dim: int = 0):
    """The pieces as selects (index math), for the reason split_with_sizes gives."""
    dim = torch._prims_common.canonicalize_dim(x.dim(), dim)
    torch._check_index(x.dim() > 0, lambda: "Dimension specified as 0 but tensor has no dimensions")
    return tuple(aten.select.int(x, dim, i) for i in range(x.shape[dim]))


def native_group_norm(x, weight, bias, n: int, c: int, hw: int, groups: int, eps: float):
    """GroupNorm with all its per-element work in the [N, G, C/G, HW] space of its reduction, so the
    statistics, the normalisation and the affine are one kernel.  Not torch's decomposition: on CPU
    it folds the affine into per-(N, C) scale and shift through `as_strided`, and on GPU it applies the
    affine after viewing back to [N, C, ...]; either way the affine leaves the reduction's space."""
    dtype = get_computation_dtype(x.dtype)
    rows = x.to(dtype).reshape(n, groups, c // groups, hw)
    var, mean = torch.var_mean(rows, dim=[2, 3], correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (rows - mean) * rstd
    if weight is not None:
        out = out * weight.reshape(1, groups, c // groups, 1)
    if bias is not None:
        out = out + bias.reshape(1, groups, c // groups, 1)
    return out.to(x.dtype).reshape(x.shape), mean.to(x.dtype).reshape(n, groups), rstd.to(x.dtype).reshape(n, groups)


def native_group_norm_backward(dy, x, mean, rstd, weight, n: int, c: int, hw: int, groups: int, mask):
    """GroupNorm's gradient as two kernels: the input's (two sums per group, then the per-element
    formula) and the affine's (two sums per channel).  Not torch's decomposition: it sums per (N, C)
    first, then per group, and those reductions over different spaces are six kernels."""
    dtype = get_computation_dtype(x.dtype)
    shape = (n, groups, c // groups, hw)
    dy, rows = dy.to(dtype).reshape(shape), x.to(dtype).reshape(shape)
    xhat = (rows - mean.to(dtype).reshape(n, groups, 1, 1)) * rstd.to(dtype).reshape(n, groups, 1, 1)
    dx = dw = db = None
    if mask[0]:
        g = dy if weight is None else dy * weight.to(dtype).reshape(1, groups, c // groups, 1)
        m = shape[2] * shape[3]
        g_mean = torch.sum(g, dim=[2, 3], keepdim=True) / m
        gx_mean = torch.sum(g * xhat, dim=[2, 3], keepdim=True) / m
        dx = ((g - g_mean - xhat * gx_mean) * rstd.to(dtype).reshape(n, groups, 1, 1)).to(x.dtype).reshape(x.shape)
    out_dtype = (x if weight is None else weight).dtype
    if mask[1]:
        dw = torch.sum(dy * xhat, dim=[0, 3]).reshape(c).to(out_dtype)
    if mask[2]:
        db = torch.sum(dy, dim=[0, 3]).reshape(c).to(out_dtype)
    return dx, dw, db


def softmax_over_many_rows(torchs, x, dim: int, half_to_float: bool):
    """torch's decomposition of (log_)softmax (`torchs`: max, exp, sum, a pointwise op), except on CUDA over fewer
    rows than the GPU has processors, each longer than one program holds in registers (a decode step's softmax
    over a vocabulary).  There the partition makes the decomposition one kernel (Partitioner.absorb_whole), a
    program a row looping over it, and eager's softmax kernel is faster still (H200, bench/few_rows.py run 218,
    bf16: [1, 128256] 0.037 ms eager, 0.080 our one kernel; [8, 50257] 0.020 and 0.042; [64, 128256] 0.045 and
    0.064; 4 and 32 rows of 32000 a tie; log_softmax alike).  The partition cannot weigh eager's op, decomposed
    before it sees the graph, so the op stays whole here.  Not so layer_norm, whose eager kernel is the slow one
    there (0.24 ms at [1, 128256] against our one kernel's 0.045).  Nor over 4-D scores: attention's softmax,
    which the attention patterns find decomposed (a decode step over a long cache: our flash kernel or SDPA)."""
    length, rows = x.shape[dim] if x.dim() else 1, x.numel() // max(x.shape[dim] if x.dim() else 1, 1)
    if x.is_cuda and x.dim() < 4 and isinstance(length, int) and isinstance(rows, int) and length > PERSISTENT_MAX_R \
            and rows < NUM_SMS:
        return NotImplemented
    return torchs(x, dim, half_to_float)


def adaptive_avg_pool2d(torchs, x, output_size):
    """Windows of a divisible size: torch's decomposition (an average pool, below).  Ragged ones: a gather of
    each window padded to the longest, masked, then one sum over the window dims in fp32 over each window's
    size.  torch's ragged form adds its gathered slices one by one, a chain of longest-window-squared adds (380
    ops pooling 37x53 to 2x3, each a gather in the kernel, and half a minute of partitioning), in the input's
    dtype.  Over a symbolic H (or W) pooled to more than one cell the op stays whole: torch's branches on
    `H % out` and `out % (H % out)`, each residue a graph of its own (`interpolate(mode="area")` over 12 image
    sizes met Dynamo's recompile limit).  A global pool (out 1) branches on nothing."""
    sizes = x.shape[-2:]
    if any(not isinstance(i, int) and o != 1 for i, o in zip(sizes, output_size)):
        return NotImplemented
    if not all(isinstance(i, int) for i in sizes) or all(i % o == 0 for i, o in zip(sizes, output_size)) \
            or not x.dtype.is_floating_point:
        return torchs(x, output_size)

    def windows(n_in: int, n_out: int):  # each window's elements (clamped past its end), which are its own, its size
        o = torch.arange(n_out, device=x.device)
        start, end = (o * n_in) // n_out, -((-(o + 1) * n_in) // n_out)
        longest = max(-(-(i + 1) * n_in // n_out) - i * n_in // n_out for i in range(n_out))
        offset = torch.arange(longest, device=x.device)
        index = torch.clamp(start[:, None] + offset, max=n_in - 1)
        return index, offset < (end - start)[:, None], end - start
    (rows, in_rows, height), (cols, in_cols, width) = windows(sizes[0], output_size[0]), windows(sizes[1], output_size[1])
    vals = x[..., rows[:, :, None, None], cols]  # [..., OH, KH, OW, KW]
    keep = in_rows[:, :, None, None] & in_cols
    total = torch.where(keep, vals, 0).sum((-3, -1), dtype=get_computation_dtype(x.dtype))
    return (total / (height[:, None] * width[None, :])).to(x.dtype).contiguous(memory_format=suggest_memory_format(x))


def adaptive_avg_pool2d_backward(grad, x):
    """The gradient of adaptive average pooling as index math and a small sum, so it fuses with what reads
    it (a ResNet's global pool: its [N, C, 1, 1] gradient broadcast over H x W, divided by H*W, straight into
    ReLU's gradient).  torch has no decomposition of it.  Each input pixel takes the gradients of the output
    windows it lies in, over each window's area: windows of a divisible size are a broadcast; ragged ones (they
    may overlap) a sum over the few output windows (at most 16) of a mask of which hold the pixel."""
    h, w = x.shape[-2:]
    oh, ow = grad.shape[-2:]
    if not all(isinstance(v, int) for v in (h, w, oh, ow)):
        return NotImplemented
    if h % oh == 0 and w % ow == 0:
        kh, kw = h // oh, w // ow
        g = (grad / (kh * kw))[..., :, None, :, None].expand(*grad.shape[:-2], oh, kh, ow, kw)
        return g.reshape(x.shape).to(x.dtype).contiguous(memory_format=suggest_memory_format(x))  # as eager's
    if oh * ow > 16:
        return NotImplemented

    def windows(n_in: int, n_out: int):  # [n_out, n_in]: whether input i lies in output window o, and sizes
        o = torch.arange(n_out, device=x.device)
        start, end = (o * n_in) // n_out, -((-(o + 1) * n_in) // n_out)
        i = torch.arange(n_in, device=x.device)
        inside = (i[None, :] >= start[:, None]) & (i[None, :] < end[:, None])
        return inside, end - start
    in_h, size_h = windows(h, oh)
    in_w, size_w = windows(w, ow)
    area = (size_h[:, None] * size_w[None, :]).to(grad.dtype)  # [oh, ow]
    g = (grad / area)[..., :, :, None, None]  # [..., oh, ow, 1, 1]
    mask = (in_h[:, None, :, None] & in_w[None, :, None, :]).to(grad.dtype)  # [oh, ow, h, w]
    return (g * mask).sum((-4, -3)).to(x.dtype)


POOL_WINDOW_MAX = 25  # elements of a pooling window unrolled in a kernel; larger windows stay eager's op (as Inductor)


def _pool_windows(x, kernel_size, stride, padding, dilation, ceil_mode: bool, fill: float):
    """What max and average pooling share: `x` padded with `fill`, and for each window element (raster order)
    its strided slice of the padded input, the [..., OH, OW] values that element of every window sees (views:
    index math in the kernel that reads them); each window's first row and column in the input (before the
    padding: negative where it starts in it); per pooled dim, (output size, kernel, stride, padding, dilation).
    None where the op stays whole: a window past POOL_WINDOW_MAX, or ceil_mode at a symbolic size (its last
    window is kept or dropped by a comparison of sizes: a guard, a graph per residue)."""
    def pair(v, default):
        return tuple(v) * 2 if len(v) == 1 else tuple(v) if len(v) else default
    kh, kw = pair(kernel_size, None)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride, (kh, kw)), pair(padding, (0, 0)), pair(dilation, (1, 1))
    h, w = x.shape[-2:]
    if kh * kw > POOL_WINDOW_MAX or ceil_mode and not (isinstance(h, int) and isinstance(w, int)):
        return None

    def out_size(n, k, s, p, d):  # torch's pooling_output_shape, and the padding past the end the windows need
        span = d * (k - 1) + 1
        o = (n + 2 * p - span + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (o - 1) * s >= n + p:
            o -= 1
        return o, (max(0, (o - 1) * s + span - (n + 2 * p)) + p if ceil_mode else p)
    (oh, bottom), (ow, right) = out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw)
    padded = aten.constant_pad_nd.default(x, [pw, right, ph, bottom], fill)
    views = [aten.slice.Tensor(aten.slice.Tensor(padded, -2, a * dh, a * dh + (oh - 1) * sh + 1, sh),
                               -1, b * dw, b * dw + (ow - 1) * sw + 1, sw)
             for a in range(kh) for b in range(kw)]
    starts = torch.arange(oh, device=x.device) * sh - ph, torch.arange(ow, device=x.device) * sw - pw
    return views, starts, ((oh, kh, sh, ph, dh), (ow, kw, sw, pw, dw))


def _tiles(x, kernel_size, stride, padding, ceil_mode: bool):
    """x as [..., OH, KH, OW, KW] where the windows tile it (stride = kernel, no padding; ceil_mode only where
    it adds no window), the rows and columns past the last window cut off; else None."""
    kernel = tuple(kernel_size) * (3 - len(kernel_size))
    h, w = x.shape[-2:]
    if tuple(stride or kernel) * (3 - len(stride or kernel)) != kernel or any(padding):
        return None
    if not (isinstance(h, int) and isinstance(w, int)) and not statically_known_true(h % kernel[0] + w % kernel[1] == 0):
        return None  # the reshape would guard on the sizes' divisibility: a graph per pattern of residues
    if ceil_mode and (h % kernel[0] or w % kernel[1]):
        return None
    (kh, kw), (oh, ow) = kernel, (h // kernel[0], w // kernel[1])
    return x[..., :oh * kh, :ow * kw].reshape(*x.shape[:-2], oh, kh, ow, kw)


def _padding_only(out: int, stride: int, pad: int, offset: int, size: int) -> bool:
    """Whether a window element's view (at `offset` in its window) reads padding alone along one dim: a small input
    pooled to one cell or two.  False where a size is symbolic (not asked: a guard)."""
    if not (isinstance(out, int) and isinstance(size, int)):
        return False
    return (out - 1) * stride + offset - pad < 0 or offset - pad >= size


def max_pool2d_with_indices(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    """Max pooling as a chain over the window's elements, each a strided view of the input padded with -inf:
    values and flat indices in one kernel with the op before it (a ResNet stem's BatchNorm and ReLU); in
    inference the indices are dead and dropped.  Not torch's decomposition (a gather of every window, then
    max over it; torch 2.11 has none): eager's rule is kept exactly, an element replaces the running maximum
    where it is greater or NaN, so the index is the first of tied maxima or the last NaN, and a window all
    -inf gives its first position inside the input.  Integer inputs and large windows stay the op."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    got = _pool_windows(x, kernel_size, stride, padding, dilation, ceil_mode, float("-inf"))
    if got is None:
        return NotImplemented
    views, (rows, cols), ((oh, _, sh, ph, dh), (ow, kw, sw, pw, dw)) = got
    width = x.shape[-1]
    first_row = torch.where(rows < 0, rows + (-rows + dh - 1) // dh * dh, rows)  # the first inside the input
    first_col = torch.where(cols < 0, cols + (-cols + dw - 1) // dw * dw, cols)
    best, index = views[0], (first_row[:, None] * width + first_col[None, :]).expand(views[0].shape)
    for i, v in enumerate(views[1:], 1):
        a, b = divmod(i, kw)
        if _padding_only(oh, sh, ph, a * dh, x.shape[-2]) or _padding_only(ow, sw, pw, b * dw, width):
            continue  # -inf everywhere: never taken (and a constant, whose isnan codegen cannot or with a tensor)
        take = (v > best) | torch.isnan(v)
        best = torch.where(take, v, best)
        index = torch.where(take, (rows + a * dh)[:, None] * width + (cols + b * dw)[None, :], index)
    layout = suggest_memory_format(x)  # eager's outputs follow the input's layout
    return best.contiguous(memory_format=layout), index.contiguous(memory_format=layout)


def avg_pool2d(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Average pooling as a sum of strided views of the input padded with zeros, in fp32 for 16-bit inputs,
    over each window's divisor as eager counts it (the padding in it or not; a window past the padded input,
    ceil_mode's last, never counts what lies beyond), rounded once.  torch has no decomposition of it; the
    op had run eagerly beside the ops around it (DenseNet's transitions, PoolFormer's token mixer)."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    acc = get_computation_dtype(x.dtype)
    tiled = _tiles(x, kernel_size, stride, padding, ceil_mode)
    if tiled is not None:  # windows that tile the input: one sum over them, of any size
        return (tiled.sum((-3, -1), dtype=acc) / (divisor_override or tiled.shape[-3] * tiled.shape[-1])).to(x.dtype) \
            .contiguous(memory_format=suggest_memory_format(x))
    got = _pool_windows(x.to(acc), kernel_size, stride, padding, (1,), ceil_mode, 0.0)
    if got is None:
        return NotImplemented
    views, (rows, cols), ((_, kh, _, ph, _), (_, kw, _, pw, _)) = got
    total = functools.reduce(torch.add, views)
    if divisor_override:
        out = total / divisor_override
    else:
        h, w = x.shape[-2:]
        row_end, col_end = torch.clamp(rows + kh, max=h + ph), torch.clamp(cols + kw, max=w + pw)
        if not count_include_pad:
            rows, cols = torch.clamp(rows, min=0), torch.clamp(cols, min=0)
            row_end, col_end = torch.clamp(row_end, max=h), torch.clamp(col_end, max=w)
        out = total / ((row_end - rows)[:, None] * (col_end - cols)[None, :])
    return out.to(x.dtype).contiguous(memory_format=suggest_memory_format(x))


def outer_product(a, b):
    """A matmul over one summed element ([M, 1] @ [1, N], batched or not) as the product it is, a
    broadcast multiply we fuse with what reads it: rotary embeddings make their angles so in every
    Hugging Face decoder (`inv_freq[:, None] @ positions[None, :]`), a cuBLAS launch a forward (as
    Inductor's decomposition of small matmuls).  One product, rounded once: what the matmul gives.  Any
    other size, or one not known while tracing, stays a matmul (NotImplemented: the op as it is)."""
    if not isinstance(a.shape[-1], int) or a.shape[-1] != 1 or not a.dtype.is_floating_point:
        return NotImplemented
    return (a * b).contiguous()  # laid out as the matmul's result (a permuted batch dim would carry over)


def copy(dst, src, non_blocking=False):
    """Functional `dst.copy_(src)` (InstanceNorm's running-stat update): src cast and broadcast to
    dst's shape, index math plus a cast.  torch has no decomposition of it (Inductor lowers it)."""
    return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()
