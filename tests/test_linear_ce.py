"""fuser::linear_cross_entropy held to eager `F.cross_entropy(F.linear(x, w, b).float(), target, ...)`:
the loss and the gradients of x, weight and bias, over dtypes, chunkings, ignored rows, label
smoothing, both reductions, leading dims and strided x; and what the op refuses.

The gradients are compared with eager's in the same dtype, not with an fp64 reference: both round
the gradient w.r.t. the logits to the input dtype once (eager at its `.float()`'s backward, the op at
the kernel's store) and accumulate the matmuls in fp32, so eager's 16-bit rounding does not
dominate the difference (seen on CPU: 16-bit grads within 1.5 ulps of eager's, while both sit 40
to 240 ulps from an fp64 reference at small elements, where the rounded gradient's terms cancel: an
fp64 reference would need tolerances wide enough to hide a bug; on an H100, bf16 grad_x differed by
up to 44 ulps at elements a thousand times below its largest, cuBLAS choosing other kernels for a
chunk than for all rows).  Under "mean" the
gradients are O(1/N), where the absolute part of tol(dtype), set for values of order 1, would accept
anything: atol is scaled by the gradient's largest element.  The loss is fp32 computed from the same
logits (the chunks' matmuls round as eager's does), held to fp32's tolerance whatever the inputs.

Shapes stay small: the kernel runs in Triton's interpreter on CPU (about 10 ms a row at V = 1531),
and each chunk is a launch (tens of ms), so most cases pick a few chunks by `chunk_rows`.
"""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fuser.codegen.cross_entropy import block_v
from fuser.linear_ce import linear_cross_entropy, linear_cross_entropy_op, rows_per_chunk
from tolerances import tol

N, D, V = 37, 48, 1531  # odd sizes: masked last tiles everywhere; V > the interpreter's BLOCK_V


def _eager(x, weight, target, bias=None, **kw):
    logits = F.linear(x, weight, bias).float()
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), **kw)


def _inputs(device, dtype, n=N, v=V, d=D, bias=True, lead=(), seed=0):
    """x [*lead, n, d], weight [v, d] (logits of std ~2: a softmax neither flat nor one-hot), bias,
    targets with every fifth row ignored (ignore_index -100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (2 / d ** 0.5)
    b = torch.randn(v, generator=g) if bias else None
    t = torch.randint(0, v, (*lead, n), generator=g)
    t.view(-1)[::5] = -100
    return x.to(device, dtype), w.to(device, dtype), (b.to(device, dtype) if bias else None), t.to(device)


def _run(fn, x, weight, target, bias=None, view=None, upstream=1.0, **kw):
    """(loss, [grad x, grad weight, grad bias]) of fn; `view` makes the x fn sees from the leaf."""
    leaves = [a.detach().clone().requires_grad_() for a in (x, weight, bias) if a is not None]
    xx = view(leaves[0]) if view else leaves[0]
    loss = fn(xx, leaves[1], target, leaves[2] if bias is not None else None, **kw)
    (loss * upstream).backward()
    return loss.detach(), [a.grad for a in leaves]


def _assert_matches(got, want, dtype):
    (loss, grads), (loss_e, grads_e) = got, want
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, loss_e, equal_nan=True, **tol(torch.float32))
    t = tol(dtype)
    for name, g, e in zip(("x", "weight", "bias"), grads, grads_e):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        torch.testing.assert_close(g, e, atol=t["atol"] * float(e.abs().max()), rtol=t["rtol"], msg=f"grad {name}")


def _compare(x, weight, target, bias=None, view=None, upstream=1.0, chunk_rows=None, **kw):
    got = _run(linear_cross_entropy, x, weight, target, bias, view, upstream, chunk_rows=chunk_rows, **kw)
    want = _run(_eager, x, weight, target, bias, view, upstream, **kw)
    _assert_matches(got, want, x.dtype)
    return got


# (bias, reduction, label_smoothing, dtype): fp32 takes every combination of the three options; fp16 and bf16 two
# each, between them both values of every option with each 16-bit dtype (what a 16-bit dtype changes, the
# gradients rounded once at the store and eager's rounding of them, does not depend on which options are on, and
# the options' pairings are fp32's; the 16-bit grid repeated them at ~2 s a case on CPU)
MATCHES_EAGER = [(b, r, ls, torch.float32) for ls in (0.0, 0.1) for r in ("mean", "sum") for b in (False, True)] + [
    (False, "mean", 0.0, torch.float16), (True, "sum", 0.1, torch.float16),
    (False, "sum", 0.1, torch.bfloat16), (True, "mean", 0.0, torch.bfloat16)]


@pytest.mark.parametrize("bias,reduction,label_smoothing,dtype", MATCHES_EAGER,
                         ids=[f"{'bias' if b else 'nobias'}-{r}-{ls}-{d}" for b, r, ls, d in MATCHES_EAGER])
def test_matches_eager(dtype, label_smoothing, reduction, bias, device):
    # 16 rows a chunk: three chunks, the last one short; on CPU every row runs the tile loop
    x, w, b, t = _inputs(device, dtype, bias=bias)
    _compare(x, w, t, b, chunk_rows=16, label_smoothing=label_smoothing, reduction=reduction)


def test_default_chunking_one_tile(device):
    """The chunk rule as shipped (here all N rows in one chunk) and V within one tile (masked)."""
    assert rows_per_chunk(N, 300, D) == N
    x, w, b, t = _inputs(device, torch.float32, v=300)
    _compare(x, w, t, b, label_smoothing=0.1)


def test_custom_ignore_index(device):
    """ignore_index a real class (7): its rows give no loss and no gradient, -100 is then a bad target."""
    x, w, b, t = _inputs(device, torch.bfloat16, v=300)
    t[t == -100] = 7
    t[1::6] = 7
    _compare(x, w, t, b, chunk_rows=16, ignore_index=7, label_smoothing=0.1)


def test_leading_dims(device):
    """x [B, T, D] and target [B, T]; grad_x comes back in x's shape."""
    x, w, b, t = _inputs(device, torch.float16, n=7, v=300, lead=(3,))
    _, (gx, _, _) = _compare(x, w, t, b, reduction="sum")
    assert gx.shape == (3, 7, D)


@pytest.mark.parametrize("rows", [1, 5])
def test_strided_targets(rows, device):
    """Targets taken as a column of a wider tensor (`labels[:, -1]`, the last token's): torch's contiguous()
    keeps a one-row tensor's stride, which the target checks read through."""
    x, w, b, _ = _inputs(device, torch.float32, n=rows, v=300)
    labels = torch.randint(0, 300, (rows, 3), device=device)
    _compare(x, w, labels[:, -1], b, reduction="sum")


def test_strided_x(device):
    """x a transposed view (column-major [N, D]): the matmuls take it as it is."""
    x, w, b, t = _inputs(device, torch.float32, v=300)
    _compare(x.t().contiguous(), w, t, b, view=lambda leaf: leaf.t(), chunk_rows=16)


def test_upstream_gradient_scales(device):
    """(loss * 3.5).backward(): the gradients computed in the forward are scaled in the backward."""
    x, w, b, t = _inputs(device, torch.bfloat16, v=300)
    _compare(x, w, t, b, upstream=3.5, chunk_rows=16, label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_rows", [4, None], ids=["ten_chunks", "one_chunk"])
def test_gradients_round_once(dtype, chunk_rows, device):
    """Ten chunks: grad_weight and grad_bias by vocabulary slices, each slice one matmul (and one sum)
    over all rows, rounded once: within 3 ulps of eager's one matmul and sum (when chunks' products were
    summed in 16 bits, a rounding a chunk, they were 11-20 ulps off).  One chunk (the rule's choice here):
    grad_weight is one matmul in the weight's dtype, as eager's.  (grad_x is not summed over chunks:
    test_matches_eager holds it.)"""
    x, w, b, t = _inputs(device, dtype)
    assert chunk_rows or rows_per_chunk(x.shape[0], w.shape[0], w.shape[1]) == x.shape[0]
    (_, got), (_, want) = (_run(fn, x, w, t, b, **kw) for fn, kw in ((linear_cross_entropy, dict(chunk_rows=chunk_rows)), (_eager, {})))
    eps = torch.finfo(dtype).eps
    for name, g, e in zip(("weight", "bias"), got[1:], want[1:]):
        torch.testing.assert_close(g, e, rtol=3 * eps, atol=3 * eps * 1e-3 * float(e.abs().max()), msg=f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_chunk_over_padded_classes(dtype, device):
    """All rows in one chunk (the rule's choice here) over a class count cuBLAS wants padded (1531: to 1532 in
    fp32, 1536 in fp16): the padded logits stay inside the op and the weight's and bias's gradients come out
    [V, D] and [V]."""
    assert rows_per_chunk(N, V, D) == N
    x, w, b, t = _inputs(device, dtype)
    _compare(x, w, t, b, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_rows(reduction, device):
    """Eager over zero rows: "mean" is NaN (0 / 0), "sum" 0; every gradient is 0."""
    x, w, b, t = _inputs(device, torch.float32, n=0, v=300)
    (loss, grads), (loss_e, grads_e) = (_run(f, x, w, t, b, reduction=reduction) for f in (linear_cross_entropy, _eager))
    torch.testing.assert_close(loss, loss_e, equal_nan=True, **tol(torch.float32))
    assert bool(loss.isnan()) == (reduction == "mean")
    for g, e in zip(grads, grads_e):
        assert g.shape == e.shape and g.dtype == e.dtype and not g.any()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_row_ignored(reduction, device):
    """Eager: "mean" divides 0 by 0 kept rows (NaN), "sum" gives 0; the gradients are 0 either way."""
    x, w, b, t = _inputs(device, torch.float32, n=5, v=300)
    t.fill_(-100)
    loss, grads = _compare(x, w, t, b, label_smoothing=0.1, reduction=reduction)
    assert bool(loss.isnan()) == (reduction == "mean")
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("bad", [300, -5])
def test_out_of_range_target_raises(bad, device):
    """Eager raises on a target outside [0, V): on CPU an IndexError before any kernel runs; on CUDA,
    as eager's nll_loss, an asynchronous device-side assert (no host sync in the step), which leaves
    the process's CUDA context unusable: there the call runs in a child process."""
    if device == "cuda":
        code = ("import torch; from fuser.linear_ce import linear_cross_entropy as f; "
                "x, w = torch.randn(5, 48, device='cuda'), torch.randn(300, 48, device='cuda'); "
                f"t = torch.tensor([1, 2, {bad}, 3, -100], device='cuda'); f(x, w, t); torch.cuda.synchronize()")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        # the assert fires (its printf on stderr); what raises is the next CUDA call, cuBLAS's or the sync
        assert run.returncode != 0 and "_assert_async_cuda_kernel" in run.stderr, run.stderr[-2000:]
        return
    x, w, b, t = _inputs(device, torch.float32, n=5, v=300)
    t[2] = bad
    with pytest.raises(IndexError, match=f"target {bad} is out of bounds for 300 classes"):
        linear_cross_entropy(x, w, t, b)


# case: (keyword arguments, dtypes of x / weight / target, the error's words)
REFUSALS = {
    "reduction none": (dict(reduction="none"), {}, "reduction='none' not supported"),
    "weight dtype": ({}, dict(weight=torch.float16), "x is torch.float32 but weight torch.float16"),
    "integer x": ({}, dict(x=torch.int32, weight=torch.int32), "x of torch.int32"),
    "float target": ({}, dict(target=torch.float32), "class indices are int64"),
    "label smoothing": (dict(label_smoothing=1.5), {}, r"label_smoothing=1.5 not in \[0, 1\]"),
    "chunk rows": (dict(chunk_rows=0), {}, "chunk_rows=0, want at least 1"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case, device):
    kwargs, dtypes, message = REFUSALS[case]
    x, w, _, t = _inputs(device, torch.float32, n=5, v=30, bias=False)
    x, w, t = (a.to(dtypes.get(k, a.dtype)) for k, a in (("x", x), ("weight", w), ("target", t)))
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(x, w, t, **kwargs)


def test_under_torch_compile(device):
    """Dynamo and AOT Autograd trace the op through its fake (sizes symbolic), then run it."""
    x, w, b, t = _inputs(device, torch.float32, n=9, v=50)
    compiled = torch.compile(lambda *a: linear_cross_entropy(*a, chunk_rows=4, label_smoothing=0.1),
                             backend="aot_eager", dynamic=True, fullgraph=True)
    got = _run(compiled, x, w, t, b)
    _assert_matches(got, _run(_eager, x, w, t, b, label_smoothing=0.1), torch.float32)


def test_tile_loop_runs():
    """The interpreter's tile is narrower than V: the shapes above run the online softmax's loop."""
    assert block_v(V, on_gpu=False) < V and block_v(300, on_gpu=False) >= 300


def test_chunk_rule():
    """Liger-Kernel's rule raised to 2048 rows, or to a 1 GiB fp32 chunk; a power of 2 in [1, N]."""
    assert rows_per_chunk(4096, 32000, 4096) == 2048  # Liger: 512 rows; floor 2048 (256 MiB of logits)
    assert rows_per_chunk(8192, 128256, 4096) == 2048  # Liger: 256; 2048 * 128256 * 4 B < 1 GiB
    assert rows_per_chunk(65536, 262144, 4096) == 1024  # 1024 rows of 256K classes: 1 GiB
    assert rows_per_chunk(65536, 1 << 20, 16384) == 1024  # Liger's rule above the floor: 65536 / 64
    assert rows_per_chunk(10, 100, 1000) == 10  # clamped to N
    assert rows_per_chunk(0, 100, 10) == 1


def test_one_logits_buffer_at_a_time(device):
    """The op's memory over its inputs is its outputs plus one chunk's logits (also every slice's), and
    here a padded copy of the weight: run 58 found three [chunk, V] tensors live at once at llama-128k's peak."""
    if device != "cuda":
        pytest.skip("the CUDA caching allocator's peak counter")
    n, v, d, chunk = 4096, 8001, 256, 1024
    x, w, _, t = _inputs(device, torch.bfloat16, n=n, v=v, d=d, bias=False)
    run = lambda: linear_cross_entropy_op(x, w, None, t, -100, 0.0, "mean", chunk)  # noqa: E731
    run()  # cuBLAS's workspace, the kernels
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    held = sum(o.untyped_storage().nbytes() for o in out)
    extra = torch.cuda.max_memory_allocated() - base - held
    one_chunk = chunk * v * x.element_size()
    padded_weight = w.numel() * w.element_size()  # V is odd: the weight's rows padded to 8008 (linear_ce._padded)
    assert one_chunk <= extra <= one_chunk + chunk * 16 + padded_weight + n * 64 + (1 << 20), (extra, one_chunk)
