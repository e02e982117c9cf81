"""fuser::dropout: dropout whose mask is never stored, but drawn again from a seed wherever it is needed.

out = x * keep / (1 - p), keep = (u >= p) for Philox's uniform u at counter offset + i, where i is
the element's index in the contiguous numbering of x's shape (not its address: a kernel reading x
in another layout draws the same number for the same element).  The op is linear in x with that
mask, so its gradient is the same op, same seed, p and offset, on the incoming gradient: autograd
saves the 8-byte seed, never a mask, and after AOT Autograd the backward graph calls fuser::dropout.

Inside a region it is one more pointwise op (fuser/ops.py's row, matched by the op's name, renders
ops.dropout_expr); run alone it is the small Triton kernel below, built from the same expression, so
fused and unfused runs give the same masks bit for bit.  Its random stream is not eager dropout's.
"""
from __future__ import annotations

import functools

import torch

from . import ops
from .dtypes import compute_dtype, convert, target
from .plan import block_plan
from .runtime import call_directly, load, run_interpreted


def new_seed(device) -> torch.Tensor:
    """A seed for fuser::dropout: a 0-d int64 drawn from torch's generator on `device`, so
    torch.manual_seed repeats the masks.  Traced, it is aten.randint, a random op: never folded
    (fuser/fold.py), never merged by CSE, and saved for the backward by AOT's partitioner, not
    drawn again there (it recomputes only ops of its allow-list)."""
    return torch.randint(0, 1 << 62, (), dtype=torch.int64, device=device)


def dropout(x: torch.Tensor, p: float, *, seed: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
    """x with each element zeroed with probability p and the others scaled by 1 / (1 - p), the mask
    given by (seed, offset): the same pair, the same mask.  `seed`: a 0-d int64 tensor on x's device;
    None draws one (`new_seed`).  `offset`: where this site's counters start; sites sharing a seed
    need ranges that do not overlap (x.numel() counters each)."""
    if seed is None:
        seed = new_seed(x.device)
    return torch.ops.fuser.dropout.default(x, seed, float(p), int(offset))


def check(x: torch.Tensor, seed: torch.Tensor, p: float):
    """fuser::dropout's arguments (also those of the attention ops' dropout, fuser/pregrad.py)."""
    torch._check(x.dtype.is_floating_point, lambda: f"fuser::dropout: x must be floating point, not {x.dtype}")
    torch._check(seed.dim() == 0 and seed.dtype == torch.int64 and seed.device == x.device,
                 lambda: f"fuser::dropout: the seed must be a 0-d int64 tensor on {x.device}, not {seed.dtype} "
                         f"of shape {tuple(seed.shape)} on {seed.device}")
    torch._check(0.0 <= p <= 1.0, lambda: f"dropout probability has to be between 0 and 1, but got {p}")


@torch.library.custom_op("fuser::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, seed: torch.Tensor, p: float, offset: int) -> torch.Tensor:
    """The op where no region took it: our kernel, the fused lowering's expression."""
    check(x, seed, p)
    out = torch.empty_like(x)  # the layout the fake gives
    if out.numel():
        _launch(x, seed, p, offset, out)
    return out


@dropout_op.register_fake
def _(x, seed, p, offset):
    check(x, seed, p)
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _, seed, ctx.p, ctx.offset = inputs
    ctx.save_for_backward(seed)


def _backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return torch.ops.fuser.dropout.default(grad, seed, ctx.p, ctx.offset), None, None, None


dropout_op.register_autograd(_backward, setup_context=_setup_context)
call_directly(dropout_op)


# ------------------------------------------------------------------ the kernel run where no region took the op


def _launch(x, seed, p, offset, out):
    """One lane per element, walked in out's memory order (x, when dense, has out's strides: both
    accesses coalesced); a contiguous x and out are walked as one dim."""
    if x.is_contiguous() and out.is_contiguous():
        dims = [(x.numel(), 1, 1, 1)]  # (size, x's stride, out's stride, stride in the contiguous numbering)
    else:
        order = sorted(range(x.dim()), key=lambda d: (-out.stride(d) if x.shape[d] > 1 else 0, d))
        numbering = _contiguous_strides(x.shape)
        dims = [(x.shape[d], x.stride(d), out.stride(d), numbering[d]) for d in order]
    # int32 index math unless an index or an address may pass 2^31 (x may be a view of a larger storage)
    wide = max(x.numel(), x.untyped_storage().nbytes() // x.element_size()) >= 2 ** 31
    source = _source(len(dims), x.dtype, p, offset, wide, x.device.type)
    kernel = load(source, "dropout_kernel", x.device.type)
    plan = block_plan(x.numel(), None, x.device.type)
    sizes, xs, os_, cs = zip(*dims)
    args = (x, seed, out, x.numel(), *sizes[1:], *xs, *os_, *cs)
    if x.is_cuda:
        with torch.cuda.device(x.device):
            kernel[(plan.programs,)](*args, XBLOCK=plan.xblock, num_warps=plan.num_warps)
    else:
        run_interpreted(kernel, (plan.programs,), *args, XBLOCK=plan.xblock)


def _contiguous_strides(shape) -> list:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


@functools.lru_cache(maxsize=64)
def _source(ndim: int, dtype: torch.dtype, p: float, offset: int, wide: bool, device_type: str) -> str:
    """The kernel for `ndim` dims in walk order: the lane's position m along them gives its index
    per dim (the outermost is what is left), hence its addresses in x and out and its index i in
    the contiguous numbering, the random counter."""
    dims = range(ndim)
    params = ["x_ptr", "seed_ptr", "out_ptr", "n", *(f"s{d}" for d in dims[1:]),
              *(f"{a}{d}" for a in ("xs", "os", "cs") for d in dims), "XBLOCK: tl.constexpr"]
    pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    lines = [f"m = {pid} * XBLOCK + tl.arange(0, XBLOCK)", "mask = m < n", "rest = m",
             "xa = m * 0", "oa = m * 0", "i = m * 0"]
    for d in reversed(dims):
        k = f"k{d}" if d else "rest"
        if d:
            lines += [f"{k} = rest % s{d}", f"rest = rest // s{d}"]
        lines += [f"xa += {k} * xs{d}", f"oa += {k} * os{d}", f"i += {k} * cs{d}"]
    cdt = compute_dtype(dtype)
    with target(device_type):
        lines += [f"v = {convert('tl.load(x_ptr + xa, mask=mask, other=0)', dtype, cdt)}",
                  "seed = tl.load(seed_ptr)",
                  f"y = {ops.dropout_expr('v', 'seed', 'i', p, offset)}",
                  f"tl.store(out_ptr + oa, {convert('y', cdt, dtype)}, mask=mask)"]
    body = "\n".join(f"    {line}" for line in lines)
    return ("import triton\nimport triton.language as tl\n" + "".join(ops.helpers_for(body))
            + f"\n\n@triton.jit\ndef dropout_kernel({', '.join(params)}):\n{body}\n")
