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

Memory: one [chunk, V] logits buffer (reused as its gradient; a slice's [N, V / chunks] is no larger),
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

from fuser.codegen.cross_entropy import KERNEL, SLICE_KERNEL, prepare, prepare_slice, row_source

from . import dtypes
from .plan import next_pow2
from .runtime import call_directly, launch

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


def _kept_rows(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """Rows whose target is not ignore_index, counted once over all N rows (the "mean" divisor), a
    0-d tensor on the device: no host sync.  A kept target outside [0, V) raises, as eager does: on
    CPU an IndexError before any kernel runs; on CUDA, like eager's nll_loss, a device-side assert
    (asynchronous: waiting for the check would stall the step)."""
    kept = target != ignore_index
    bad = kept & ((target < 0) | (target >= n_classes))
    if target.is_cuda:
        torch._assert_async(~bad.any(), f"linear_cross_entropy: a target is out of bounds for {n_classes} classes")
    elif bad.any():
        raise IndexError(f"linear_cross_entropy: target {int(target[bad][0])} is out of bounds for {n_classes} "
                         f"classes ({int(bad.sum())} such row(s); ignore_index is {ignore_index})")
    return kept.sum()


@functools.lru_cache(maxsize=None)
def _source(dtype: torch.dtype, device_type: str) -> str:
    with dtypes.target(device_type):
        return row_source(dtype)


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
    n_kept = _kept_rows(t, n_classes, ignore_index)
    # "mean" divides by the kept rows of the whole batch; with none kept, no row reads the scale
    scale = n_kept.clamp_min(1).float().reciprocal() if reduction == "mean" else x.new_ones((), dtype=torch.float32)
    source = _source(x.dtype, x.device.type)
    row_loss = x.new_empty(n, dtype=torch.float32)
    lse = x.new_empty(n, dtype=torch.float32)
    grad_x = x.new_empty(n, dim)
    grad_w = weight.new_empty(weight.shape)
    grad_b = weight.new_empty(n_classes) if bias is not None else weight.new_empty(0)
    step = chunk_rows or rows_per_chunk(n, n_classes, dim)
    ce = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, scale=scale)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        xc = x2[lo:hi]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else torch.mm(xc, weight.t())
        grid, args, meta = prepare(logits, t[lo:hi], row_loss[lo:hi], lse[lo:hi], **ce)
        launch(source, KERNEL, grid, args, meta, x.device.type)
        torch.mm(logits, weight, out=grad_x[lo:hi])  # logits now hold their gradient
        if step >= n:  # one chunk: the whole gradient, written once in the weight's dtype
            torch.mm(logits.t(), xc, out=grad_w)
            if bias is not None:
                grad_b.copy_(logits.sum(0, dtype=torch.float32))
    if step < n:  # several: by slices of the vocabulary, each [N, width] no larger than a chunk's logits
        width = max(1, step * n_classes // n)
        for v0 in range(0, n_classes, width):
            v1 = min(v0 + width, n_classes)
            w = weight[v0:v1]
            logits = torch.addmm(bias[v0:v1], x2, w.t()) if bias is not None else torch.mm(x2, w.t())
            grid, args, meta = prepare_slice(logits, t, lse, n_classes, v0, **ce)
            launch(source, SLICE_KERNEL, grid, args, meta, x.device.type)
            torch.mm(logits.t(), x2, out=grad_w[v0:v1])
            if bias is not None:
                grad_b[v0:v1].copy_(logits.sum(0, dtype=torch.float32))
    loss = row_loss.sum()
    if reduction == "mean":
        loss = loss / n_kept  # 0 / 0 = NaN with every row ignored, as eager gives
    return loss, grad_x.view(x.shape), grad_w, grad_b


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
