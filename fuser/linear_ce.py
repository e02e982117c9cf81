"""fuser::linear_cross_entropy: `F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)` and
its gradients, chunk by chunk of rows, without ever holding the [N, V] logits.

Each chunk: the logits by torch's matmul in the input dtype (eager's F.linear rounds them so), one
Triton kernel (codegen/cross_entropy.py) for the rows' losses and log-sum-exps and the gradient
w.r.t. the logits, written over them, then grad_x = grad_logits @ weight.  With one chunk,
grad_weight = grad_logits^T @ x and grad_bias their sum.  With several, the weight's gradient is
computed by slices of the vocabulary instead: each slice's logits for every row again (x @ W[slice]^T),
their gradient from the saved log-sum-exps (a second kernel), grad_weight[slice] = that^T @ x and
grad_bias[slice] its sum.  The gradients are computed in the forward, so the op's backward only
scales them by the upstream gradient: that needs a scalar loss ("mean" or "sum", not "none").

Memory: one [chunk, V] logits buffer (reused as its gradient, and by every slice's [N, V / chunks]),
grad_x as x, grad_weight in the weight's dtype, the rows' losses and log-sum-exps.  Decision (issue 12,
the 128K-vocabulary model): slices cost one more matmul of the logits' size (4 instead of 3), but no
grad_weight summed over chunks, which must be fp32 (a 16-bit sum rounds once a chunk, an error growing
with the chunks, where eager's one matmul over all N rows rounds once): V*D*4 bytes held, V*D*6 more at
the end for its rounded copy, and V*D*8 moved a chunk.  Each slice's grad_weight is one matmul over all
N rows, rounded once, as eager's.
"""
from __future__ import annotations

import functools
import math

import torch

from fuser.codegen.cross_entropy import GRAD_KERNEL, KERNEL, TARGETS_KERNEL, prepare, prepare_grad, prepare_targets, row_source

from . import dtypes
from .plan import next_pow2
from .runtime import call_directly, launch, launch_sequence

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


_MIN_ROWS = 2048  # below this, grad_weight's fp32 read-modify-write once a chunk outweighs the matmuls
_MAX_CHUNK_BYTES = 1 << 30  # one chunk's fp32 logits, at most (unless Liger's rule asks for more)


def rows_per_chunk(n: int, n_classes: int, dim: int) -> int:
    """Rows a chunk, a power of 2 clamped to [1, N]: Liger-Kernel's rule (a chunk's logits about the
    size of x: next_power_of_2(ceil(N / ceil(V / D)))) raised to 2048 rows, or to as many as keep the
    chunk's fp32 logits within 1 GiB.

    Why the floor: small chunks make small matmuls, and (when grad_weight was summed over chunks in
    fp32) each chunk moved 8*V*D bytes against 6*rows*V*D flops, about 300/rows of the chunk's time on
    an H100.  Measured there then (bf16, N 8192, D 4096, V 128256; forward + backward): Liger's 256 rows
    (32 chunks) took 101 ms, 1024 rows 49 ms, 2048 rows 43 ms (peak 3.5 GiB above the inputs); eager 56
    ms, 11.7 GiB.  (grad_weight is now computed by vocabulary slices: the module's docstring.)"""
    liger = next_pow2(math.ceil(n / math.ceil(n_classes / dim)))
    floor = _MIN_ROWS
    while floor > 1 and floor * n_classes * 4 > _MAX_CHUNK_BYTES:
        floor //= 2
    return max(1, min(max(liger, floor), n))


def linear_cross_entropy(x, weight, target, bias=None, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """The loss (0-d fp32) of `F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)`,
    differentiable in x, weight and bias.  x: [..., D]; weight: [V, D]; bias: [V] or None;
    target: x.shape[:-1] int64 class indices.  `chunk_rows`: rows a chunk (None: `rows_per_chunk`'s rule)."""
    return linear_cross_entropy_op(x, weight, bias, target, int(ignore_index), float(label_smoothing), reduction,
                                   chunk_rows)[0]


def _check(x, weight, bias, target, label_smoothing: float, reduction: str, chunk_rows: int | None) -> None:
    """What the op refuses, as ValueError naming the cause (real and fake tensors alike)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} not supported: the gradients are "
                         "computed in the forward, which needs a scalar loss ('mean' or 'sum')")
    if x.dtype not in _FLOATS:
        raise ValueError(f"linear_cross_entropy: x of {x.dtype} (float16, bfloat16 or float32 only)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        found = f"weight {weight.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
        raise ValueError(f"linear_cross_entropy: x is {x.dtype} but {found}; all must share x's dtype")
    if target.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: target of {target.dtype}; class indices are int64 "
                         "(class probabilities are not supported)")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"linear_cross_entropy: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: want [..., D], [V, D], [V]")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {tuple(target.shape)} for x {tuple(x.shape)}: want x.shape[:-1]")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing={label_smoothing} not in [0, 1]")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows}, want at least 1 (or None: the rule)")


def _scale_of(t: torch.Tensor, n_classes: int, ignore_index: int, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction's factor on the rows' losses and the gradient, 0-d fp32 on the device (1 / the rows whose
    target is not ignore_index for "mean": inf with none kept; else 1): no host sync; one kernel
    (cross_entropy_targets).  A kept target outside [0, V) raises, as eager does: on CPU an IndexError before
    any other kernel runs; on CUDA, like eager's nll_loss, a device-side assert (asynchronous: waiting for the
    check would stall the step).  `dtype`: the logits' (the kernel shares their source module)."""
    scale, ok = t.new_empty((), dtype=torch.float32), t.new_empty((), dtype=torch.bool)
    mean = reduction == "mean"
    device = t.device.type
    source = _source(dtype, device)
    launch_sequence(source, [(TARGETS_KERNEL, *prepare_targets(t, n_classes, ignore_index, scale, ok, mean=mean))],
                    device, (TARGETS_KERNEL, source, t.stride(0), t.shape[0], n_classes, ignore_index, mean, t.device))
    if t.is_cuda:
        torch._assert_async(ok, f"linear_cross_entropy: a target is out of bounds for {n_classes} classes")
    elif not ok:
        kept = t != ignore_index
        bad = kept & ((t < 0) | (t >= n_classes))
        raise IndexError(f"linear_cross_entropy: target {int(t[bad][0])} is out of bounds for {n_classes} "
                         f"classes ({int(bad.sum())} such row(s); ignore_index is {ignore_index})")
    return scale


def _rows(logits, t, row_loss, lse, ce: dict, write_grad: bool = True) -> None:
    """cross_entropy_rows over `logits` (codegen/cross_entropy.prepare), its launch bound once per layout (the
    key fixes the launch's meta and int arguments: the meta follows from the class count)."""
    device = logits.device.type
    source = _source(logits.dtype, device)
    grid, args, meta = prepare(logits, t, row_loss, lse, **ce, write_grad=write_grad)
    key = (KERNEL, source, logits.stride(0), logits.shape[1], ce["ignore_index"], write_grad, logits.device)
    launch_sequence(source, [(KERNEL, grid, args, meta)], device, key)


def _total(row_loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """The loss: the sum of the rows' losses, each already times the reduction's factor (cross_entropy_rows);
    with no rows, "mean" is NaN (0 / 0), as eager gives."""
    if row_loss.numel() == 0 and reduction == "mean":
        return row_loss.new_full((), float("nan"))
    return row_loss.sum()


@functools.lru_cache(maxsize=None)
def _source(dtype: torch.dtype, device_type: str) -> str:
    with dtypes.target(device_type):
        return row_source(dtype)


def _per(t: torch.Tensor) -> int:
    """Elements in 16 bytes: what cuBLAS's fast kernels want a matmul's dimensions to be multiples of."""
    return max(1, 16 // t.element_size())


def _padded(weight: torch.Tensor, bias: torch.Tensor | None):
    """(weight, bias) with zero rows added up to a class count of a multiple of 16 bytes: cuBLAS runs a
    matmul with an odd class count (GPT-2's 50257) on its slowest kernels.  Run 63 (H200, bf16, 2048
    rows, D 768): 1.67 / 1.15 / 1.14 ms for the logits, grad_x and grad_weight over 50257 classes,
    0.25 / 0.24 / 0.24 over 50264; padding the rows' stride alone did not help.  Inductor pads such
    matmuls too (pad_mm).  The added classes' logits are exact zeros, their gradient is written 0, and
    their rows of grad_weight are dropped."""
    v = weight.shape[0]
    vp = -(-v // _per(weight)) * _per(weight)
    if vp == v:
        return weight, bias
    # a copy and the added rows' zeros, not a zero fill of the whole table first (77 MB for GPT-2's)
    padded = torch.cat([weight, weight.new_zeros(vp - v, weight.shape[1])])
    return padded, (None if bias is None else torch.cat([bias, bias.new_zeros(vp - v)]))


def _buffer(x: torch.Tensor, n: int, step: int, classes: int) -> tuple[torch.Tensor, int]:
    """(one flat buffer for every chunk's [step, classes] logits and every slice's [N, width], the slices'
    width: a multiple of 16 bytes, as `classes` is)."""
    per = _per(x)
    width = max(per, step * classes // n // per * per) if step < n else classes
    return x.new_empty(max(min(step, n) * classes, n * width if step < n else 0)), width


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buf[:rows * cols].view(rows, cols)


def _weight_grads(x2, n_classes, t, lse, grad_w, grad_b, buf, width: int, ce: dict, logits_of, upstream=None):
    """grad_weight (and grad_bias, unless None), [Vp, D] with the padded classes, by slices of the classes,
    each [N, width] within `buf`: `logits_of(v0, v1, out)` gives the slice's logits (computed into `out`,
    or a view of logits held elsewhere starting at class v0), their gradient goes to `out` (plus the
    logits' own upstream gradient, where given), and grad_weight[v0:v1] is one matmul over all N rows,
    rounded once."""
    n, vp = x2.shape[0], grad_w.shape[0]
    source = _source(x2.dtype, x2.device.type)
    for v0 in range(0, vp, width):
        v1 = min(v0 + width, vp)
        out = _view(buf, n, v1 - v0)
        grid, args, meta = prepare_grad(logits_of(v0, v1, out), out, t, lse, n_classes, v0, **ce,
                                        upstream=None if upstream is None else upstream[:, v0:])
        launch(source, GRAD_KERNEL, grid, args, meta, x2.device.type)
        torch.mm(out.t(), x2, out=grad_w[v0:v1])
        if grad_b is not None:
            grad_b[v0:v1].copy_(out.sum(0, dtype=torch.float32))


def _linear(x, weight, bias, out: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) written into `out` (contiguous [rows, classes])."""
    return torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)


@torch.library.custom_op("fuser::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                            ignore_index: int, label_smoothing: float, reduction: str,
                            chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_x, grad_weight, grad_bias) of the loss, the gradients for an upstream gradient of 1;
    grad_bias is empty without a bias.  Loss 0-d fp32, the gradients in their inputs' dtypes."""
    _check(x, weight, bias, target, label_smoothing, reduction, chunk_rows)
    n_classes, dim = weight.shape
    x2, t = x.reshape(-1, dim), target.reshape(-1).contiguous()  # the matmuls take any strides
    n = x2.shape[0]
    scale = _scale_of(t, n_classes, ignore_index, reduction, x.dtype)
    row_loss = x.new_empty(n, dtype=torch.float32)
    lse = x.new_empty(n, dtype=torch.float32)
    wp, bp = _padded(weight, bias)
    vp = wp.shape[0]
    grad_x = x.new_empty(x.shape)
    grad_x2 = grad_x.view(n, dim)
    grad_w = weight.new_empty(vp, dim)
    grad_b = weight.new_empty(vp if bias is not None else 0)
    step = chunk_rows or rows_per_chunk(n, n_classes, dim)
    ce = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, scale=scale)
    if n == 0:  # no rows: no gradient, as eager's (and a NaN "mean" below)
        grad_w.zero_(), grad_b.zero_()
    elif step >= n:  # one chunk (a step's usual case): the whole gradient, written once in the weight's dtype;
        # no slice or view of anything (each is a dispatcher call: host time in a host-bound step)
        logits = _linear(x2, wp, bp, x.new_empty(n, vp))  # the padded classes' logits: zeros
        _rows(logits if vp == n_classes else logits[:, :n_classes], t, row_loss, lse, ce)
        torch.mm(logits, wp, out=grad_x2)  # logits now hold their gradient
        torch.mm(logits.t(), x2, out=grad_w)
        if bias is not None:
            grad_b.copy_(logits.sum(0, dtype=torch.float32))
    else:
        # one buffer for every chunk's logits and every slice's: never two at once (run 58 found three
        # [chunk, V] tensors live at the forward's peak when each matmul allocated its own)
        buf, width = _buffer(x, n, step, vp)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            logits = _linear(x2[lo:hi], wp, bp, _view(buf, hi - lo, vp))
            _rows(logits[:, :n_classes], t[lo:hi], row_loss[lo:hi], lse[lo:hi], ce)
            torch.mm(logits, wp, out=grad_x2[lo:hi])
        # the weight's gradient by slices of the vocabulary, each [N, width] no larger than a chunk's logits
        _weight_grads(x2, n_classes, t, lse, grad_w, grad_b if bias is not None else None, buf, width, ce,
                      lambda v0, v1, out: _linear(x2, wp[v0:v1], bp[v0:v1] if bias is not None else None, out))
    if vp != n_classes:
        grad_w, grad_b = grad_w[:n_classes], grad_b[:n_classes] if bias is not None else grad_b
    return _total(row_loss, reduction), grad_x, grad_w, grad_b


@linear_cross_entropy_op.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, chunk_rows=None):
    _check(x, weight, bias, target, label_smoothing, reduction, chunk_rows)
    grad_b = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape), grad_b


def _setup(ctx, inputs, output):
    _, grad_x, grad_w, grad_b = output
    ctx.has_bias = inputs[2] is not None
    ctx.mark_non_differentiable(grad_x, grad_w, grad_b)  # values, not functions of the inputs autograd knows
    ctx.save_for_backward(grad_x, grad_w, grad_b)


def _backward(ctx, grad_loss, *_):
    """The forward's gradients times the upstream scalar gradient, each in its input's dtype."""
    grad_x, grad_w, grad_b = ctx.saved_tensors
    # a 0-d fp32 factor keeps each gradient's dtype (the product in fp32, rounded once)
    return grad_x * grad_loss, grad_w * grad_loss, grad_b * grad_loss if ctx.has_bias else None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)
call_directly(linear_cross_entropy_op)


# ---------------------------------------------------------------- the model returns the logits too
# Hugging Face's causal LMs return their logits beside the loss, so a model compiled whole makes them
# anyway.  Then the forward is eager's matmul (the logits, returned) and one read of them for the rows'
# losses and log-sum-exps; the backward makes the logits' gradient a buffer at a time from the saved
# log-sum-exps (plus the logits' own upstream gradient: AOT Autograd hands a zero one where the caller
# leaves them unused), by row chunks for grad_x and by vocabulary slices for grad_weight, each matmul
# over whole rows or whole columns, rounded once.  Three matmuls as eager; what is never held is the
# [N, V] fp32 upcast and the [N, V] gradient.


@torch.library.custom_op("fuser::linear_cross_entropy_logits", mutates_args=())
def linear_cross_entropy_logits_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
                                   chunk_rows: int | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logits, lse, scale): the loss of `F.cross_entropy(F.linear(x, weight, bias).float(), target,
    ...)`, the logits ([..., V], x's dtype, as F.linear rounds them), the rows' log-sum-exps and the
    reduction's factor (0-d fp32), both kept for the backward."""
    _check(x, weight, bias, target, label_smoothing, reduction, chunk_rows)
    n_classes, dim = weight.shape
    x2, t = x.reshape(-1, dim), target.reshape(-1).contiguous()
    n = x2.shape[0]
    scale = _scale_of(t, n_classes, ignore_index, reduction, x.dtype)
    wp, bp = _padded(weight, bias)
    if wp is weight:
        logits = _linear(x2, weight, bias, x.new_empty(n, n_classes))
    else:  # the padded matmul and a copy: faster than the matmul over an odd class count (_padded)
        logits = _linear(x2, wp, bp, x.new_empty(n, wp.shape[0]))[:, :n_classes].contiguous()
    row_loss, lse = x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)
    _rows(logits, t, row_loss, lse, dict(ignore_index=ignore_index, label_smoothing=label_smoothing, scale=scale),
          write_grad=False)
    return _total(row_loss, reduction), logits.view(*x.shape[:-1], n_classes), lse, scale


@linear_cross_entropy_logits_op.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, chunk_rows=None):
    _check(x, weight, bias, target, label_smoothing, reduction, chunk_rows)
    return (x.new_empty((), dtype=torch.float32), x.new_empty(*x.shape[:-1], weight.shape[0]),
            x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32), x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("fuser::linear_cross_entropy_logits_backward", mutates_args=())
def linear_cross_entropy_logits_backward_op(x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                                            target: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                                            scale: torch.Tensor, grad_loss: torch.Tensor,
                                            grad_logits: torch.Tensor | None, ignore_index: int,
                                            label_smoothing: float, chunk_rows: int | None = None
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of linear_cross_entropy_logits for the loss's upstream gradient
    `grad_loss` (0-d) and the logits' own `grad_logits` (None: none); grad_bias empty without a bias."""
    n_classes, dim = weight.shape
    x2, t = x.reshape(-1, dim), target.reshape(-1).contiguous()
    n = x2.shape[0]
    z = logits.reshape(n, n_classes)
    up = None if grad_logits is None else grad_logits.reshape(n, n_classes)
    if up is not None and up.stride(-1) != 1:
        up = up.contiguous()
    ce = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, scale=scale * grad_loss.float())
    wp, _ = _padded(weight, None)
    vp = wp.shape[0]
    grad_x, grad_w = x.new_empty(n, dim), weight.new_empty(vp, dim)
    grad_b = weight.new_empty(vp if has_bias else 0)
    if n == 0:  # no rows: no gradient, as eager's
        return grad_x.view(x.shape), grad_w[:n_classes].zero_(), grad_b[:n_classes].zero_()
    step = min(chunk_rows or rows_per_chunk(n, n_classes, dim), n)
    buf, width = _buffer(x, n, step, vp)
    source = _source(x.dtype, x.device.type)
    sums = x.new_empty(n, dtype=torch.float32)
    for lo in range(0, n, step):  # grad_x by chunks of rows, each over every class (the padded ones: 0)
        hi = min(lo + step, n)
        out = _view(buf, hi - lo, vp)
        grid, args, meta = prepare_grad(z[lo:hi], out, t[lo:hi], lse[lo:hi], n_classes, 0, **ce,
                                        upstream=None if up is None else up[lo:hi], row_sums=sums[lo:hi])
        launch(source, GRAD_KERNEL, grid, args, meta, x.device.type)
        torch.mm(out, wp, out=grad_x[lo:hi])
    # the caller holds the logits (returned), which AOT Autograd hands out as a view that does not share
    # the saved tensor's version counter: a change in place before the backward (`logits.div_(T)`) would
    # go unseen and the gradient would be silently wrong.  Their rows no longer sum to 1 under the saved
    # log-sum-exps: raise (asynchronously on CUDA, as the targets' check; a NaN or infinite row passes)
    torch._assert_async(~((sums - 1).abs() > 1e-3).any(), "linear_cross_entropy: the logits it returned were "
                        "modified in place before the backward, which reads them: modify a copy (logits.clone()) "
                        "or run the backward first")
    if step >= n:  # one chunk: its gradient is whole, the weight's gradient from it
        torch.mm(out.t(), x2, out=grad_w)
        if has_bias:
            grad_b.copy_(out.sum(0, dtype=torch.float32))
    else:
        _weight_grads(x2, n_classes, t, lse, grad_w, grad_b if has_bias else None, buf, width, ce,
                      lambda v0, v1, _: z[:, v0:], up)
    return grad_x.view(x.shape), grad_w[:n_classes], grad_b[:n_classes]


@linear_cross_entropy_logits_backward_op.register_fake
def _(x, weight, has_bias, target, logits, lse, scale, grad_loss, grad_logits, ignore_index, label_smoothing,
      chunk_rows=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0] if has_bias else 0)


def _setup_logits(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, _, chunk_rows = inputs
    _, logits, lse, scale = output
    ctx.mark_non_differentiable(lse, scale)
    ctx.set_materialize_grads(False)  # an unused loss or logits: no zero tensor made for it
    ctx.save_for_backward(x, weight, target, logits, lse, scale)
    ctx.has_bias, ctx.args = bias is not None, (ignore_index, label_smoothing, chunk_rows)


def _backward_logits(ctx, grad_loss, grad_logits, *_):
    x, weight, target, logits, lse, scale = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = scale.new_zeros(())
    gx, gw, gb = linear_cross_entropy_logits_backward_op(x, weight, ctx.has_bias, target, logits, lse, scale,
                                                         grad_loss, grad_logits, *ctx.args)
    return gx, gw, gb if ctx.has_bias else None, None, None, None, None, None


linear_cross_entropy_logits_op.register_autograd(_backward_logits, setup_context=_setup_logits)
call_directly(linear_cross_entropy_logits_op)
call_directly(linear_cross_entropy_logits_backward_op)
