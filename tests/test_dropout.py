"""fuser::dropout (fuser/dropout.py): its statistics and exact values, eager's NaN semantics, masks
fixed by (seed, offset) and the element's logical index, a gradient that reuses the forward's mask,
and the op fused into the regions around it, forward and backward, with the same masks as unfused.

Exact comparisons (atol = rtol = 0) where the claim is bit-exactness: the kernel computes x * scale
once, as eager's x * mask * scale does; tolerances (tests/tolerances.py) where a fused reduction
reorders sums."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fuser
from fuser.dropout import dropout, new_seed
from tolerances import tol

SHAPE = (3, 423, 213)
EXACT = dict(atol=0, rtol=0)
drop = torch.ops.fuser.dropout.default


def _nonzero(shape, dtype=torch.float32, device="cpu"):
    """Random values in +-[0.5, 1.5): never 0, so a 0 in the output is a dropped element."""
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    return ((torch.rand(shape, device=device) + 0.5) * sign).to(dtype)


def _seed(value, device):
    return torch.tensor(value, dtype=torch.int64, device=device)


def _mask(shape, seed, p, offset=0, device="cpu"):
    """The keep mask of (seed, p, offset) at `shape`, read off the op's output on nonzero values."""
    return drop(_nonzero(shape, device=device), seed, p, offset) != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_values(p, dtype, device):
    x = _nonzero(SHAPE, dtype, device)
    out = dropout(x, p, seed=_seed(11, device))
    kept = out != 0
    n = x.numel()
    assert abs(kept.sum().item() - n * (1 - p)) < 6 * math.sqrt(n * p * (1 - p))  # binomial, 6 sigma
    assert out.dtype == dtype and out.shape == x.shape
    # kept: eager's x * (1 / (1 - p)) rounded once to the dtype; dropped: exactly 0
    torch.testing.assert_close(out[kept], (x * (1.0 / (1.0 - p)))[kept], **EXACT)
    assert not out[~kept].any()


def test_p_zero_is_identity_and_p_one_is_eager_zero(device):
    x = _nonzero((37, 213), device=device)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    seed = _seed(3, device)
    torch.testing.assert_close(drop(x, seed, 0.0, 0), x, equal_nan=True, **EXACT)
    # p = 1 multiplies by eager's scale 0 (never by 1 / 0): finite -> 0, NaN and inf -> NaN, as eager
    torch.testing.assert_close(drop(x, seed, 1.0, 0), F.dropout(x, 1.0, training=True), equal_nan=True, **EXACT)
    assert not drop(x[1:], seed, 1.0, 0).isnan().any()


def test_nan_and_inf_follow_eager(device):
    """Decision: eager computes x * mask * scale, so a NaN or inf it drops is NaN (NaN * 0, inf * 0),
    not 0; the op does the same, and propagates them where it keeps them."""
    p, seed = 0.5, _seed(5, device)
    x = _nonzero((41, 97), device=device)
    special = torch.rand(x.shape, device=device) < 0.2
    x[special] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)[
        torch.randint(0, 3, (int(special.sum()),), device=device)]
    keep = _mask(x.shape, seed, p, device=device)
    torch.testing.assert_close(drop(x, seed, p, 0), x * keep * (1 / (1 - p)), equal_nan=True, **EXACT)
    assert drop(x, seed, p, 0)[special & ~keep].isnan().all()


def test_seed_and_offset_fix_the_mask(device):
    x = _nonzero((29, 301), device=device)
    seed = _seed(2 ** 40 + 7, device)
    out = drop(x, seed, 0.5, 0)
    torch.testing.assert_close(drop(x, seed, 0.5, 0), out, **EXACT)
    far = 3 << 40  # offset + index past 2^32: the counter is 64-bit
    for other in (drop(x, seed, 0.5, 1), drop(x, seed, 0.5, far), drop(x, _seed(8, device), 0.5, 0)):
        assert ((other != 0) != (out != 0)).float().mean() > 0.3  # about half of the mask differs
    torch.testing.assert_close(drop(x, seed, 0.5, far), drop(x, seed, 0.5, far), **EXACT)
    # the counter is offset + index: a shifted offset reads the same stream one element on
    assert torch.equal(_mask((1, 301), seed, 0.5, 1, device), _mask((1, 302), seed, 0.5, 0, device)[:, 1:])


def test_seed_from_torch_generator(device):
    x = _nonzero((17, 53), device=device)
    torch.manual_seed(4)
    a = dropout(x, 0.3)
    torch.manual_seed(4)
    assert torch.equal(dropout(x, 0.3), a)
    torch.manual_seed(4)
    seed = new_seed(device)
    assert seed.dim() == 0 and seed.dtype == torch.int64 and 0 <= seed.item() < 2 ** 62
    assert torch.equal(dropout(x, 0.3, seed=seed), a)


def test_mask_follows_the_logical_index_not_the_layout(device):
    seed = _seed(9, device)
    x = _nonzero((23, 45, 31), device=device)
    out = drop(x, seed, 0.4, 0)
    # the same values laid out transposed in memory, and a non-contiguous view: the same output
    other_layout = x.transpose(0, 2).contiguous().transpose(0, 2)
    assert other_layout.stride() != x.stride()
    torch.testing.assert_close(drop(other_layout, seed, 0.4, 0), out, **EXACT)
    assert drop(other_layout, seed, 0.4, 0).stride() == other_layout.stride()  # as the fake says
    sliced = x[:, ::2]
    torch.testing.assert_close(drop(sliced, seed, 0.4, 0), drop(sliced.contiguous(), seed, 0.4, 0), **EXACT)
    # a transposed-contiguous copy is another tensor (transposed shape): its own logical numbering
    xt = x.transpose(0, 1).contiguous()
    torch.testing.assert_close(drop(xt.transpose(0, 1), seed, 0.4, 0), out, **EXACT)


def test_scalar_and_empty(device):
    seed = _seed(1, device)
    assert drop(torch.tensor(2.0, device=device), seed, 0.5, 0).item() in (0.0, 4.0)
    assert drop(torch.empty(0, 5, device=device), seed, 0.5, 0).shape == (0, 5)
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        drop(torch.ones(3, device=device), seed, 1.5, 0)
    with pytest.raises(RuntimeError, match="0-d int64"):
        drop(torch.ones(3, device=device), seed.float(), 0.5, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradient_reuses_the_forward_mask_and_saves_only_the_seed(dtype, device):
    p, seed = 0.3, _seed(21, device)
    x = _nonzero((37, 213), dtype, device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = drop(x, seed, p, 5)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((), torch.int64)]  # the seed, no mask
    g = _nonzero(x.shape, dtype, device)
    (gx,) = torch.autograd.grad(out, x, g)
    keep = out != 0
    torch.testing.assert_close(gx, torch.where(keep, g * (1.0 / (1.0 - p)), 0.0).to(dtype), **EXACT)


def test_fake_with_symbolic_shapes(device):
    x = _nonzero((5, 7), device=device)
    gm = make_fx(lambda x, s: drop(x.t(), s, 0.2, 0) * 2, tracing_mode="symbolic")(x, _seed(1, device))
    (node,) = [n for n in gm.graph.nodes if n.target is drop]
    val = node.meta["val"]
    assert not isinstance(val.shape[0], int) and val.stride() == (1, val.shape[0])  # x.t()'s layout


def _region_with_dropout(report):
    (region,) = [r for r in report.regions if "fuser.dropout.default" in r.ops]
    return region


def test_fused_pointwise_is_bit_identical_to_the_op(device):
    """bias-add + dropout + residual in one kernel, x read through a permute: the same masks and
    values as the op alone, by the element's index whatever layout the region reads it in (the sum
    with the residual within tolerance: compiled Triton contracts d * scale + r into one FMA)."""
    seed = _seed(77, device)
    x = _nonzero((213, 3, 37), device=device).permute(1, 2, 0)
    r, b = _nonzero((3, 37, 213), device=device), _nonzero((213,), device=device)

    def fn(x, r, b, seed):
        d = drop(x + b, seed, 0.1, 1 << 40)
        return d + r, d

    fused = fuser.fuse(fn)
    (got, got_d), (want, want_d) = fused(x, r, b, seed), fn(x, r, b, seed)
    torch.testing.assert_close(got_d, want_d, **EXACT)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    assert {"aten.add.Tensor", "fuser.dropout.default"} <= set(_region_with_dropout(fused.report).ops)
    assert "tl.rand(" in _region_with_dropout(fused.report).source


def test_fused_inside_a_cat_branch(device):
    """Read under a branch condition, the seed is loaded as a masked block, not a scalar."""
    seed = _seed(13, device)
    x, y = _nonzero((7, 30), device=device), _nonzero((7, 11), device=device)

    def fn(x, y, seed):  # p = 0.5: a scale of 2, exact even where the + 1 is contracted into an FMA
        return torch.cat([drop(x * 2, seed, 0.5, 0), y], dim=1) + 1

    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x, y, seed), fn(x, y, seed), **EXACT)
    assert "aten.cat.default" in _region_with_dropout(fused.report).ops


def test_fused_on_a_scalar(device):
    """A 0-d x broadcast in the region: its index is the literal 0, the counter a scalar."""
    def fn(x, y, seed):
        return drop(x * 2, seed, 0.5, 3) + y

    fused = fuser.fuse(fn)
    x, y = torch.tensor(1.5, device=device), _nonzero((4,), device=device)
    outs = [fused(x, y, _seed(s, device)) for s in range(6)]
    for s, out in enumerate(outs):
        torch.testing.assert_close(out, fn(x, y, _seed(s, device)), **EXACT)
    assert len({tuple(out.tolist()) for out in outs}) == 2  # kept (x * 4 + y) for some seeds, dropped for others
    assert "fuser.dropout.default" in _region_with_dropout(fused.report).ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_with_bias_residual_and_layer_norm(dtype, device):
    seed = _seed(5, device)
    x, r = _nonzero((3, 37, 213), dtype, device), _nonzero((3, 37, 213), dtype, device)
    b, w = _nonzero((213,), dtype, device), _nonzero((213,), dtype, device)

    def fn(x, r, b, seed):
        return F.layer_norm(drop(x + b, seed, 0.1, 0) + r, (213,), w)

    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x, r, b, seed), fn(x, r, b, seed), **tol(dtype))
    ops = set(_region_with_dropout(fused.report).ops)
    assert {"aten.add.Tensor", "fuser.dropout.default", "aten.var_mean.correction"} <= ops  # one kernel


def test_fused_with_symbolic_sizes(device):
    seed = _seed(6, device)

    def fn(x, seed):
        return torch.sigmoid(drop(x * 3, seed, 0.25, 0))

    fused = fuser.fuse(fn, dynamic=True)
    for rows in (5, 9):
        x = _nonzero((rows, 77), device=device)
        got, want = fused(x, seed), fn(x, seed)
        assert torch.equal(got == 0.5, want == 0.5)  # sigmoid(0): the same elements dropped
        torch.testing.assert_close(got, want, **tol(torch.float32))
    assert "fuser.dropout.default" in _region_with_dropout(fused.report).ops


def test_training_through_fuse(device):
    """The seed is drawn in the forward graph (torch's generator), saved for the backward, never
    drawn again; the backward's fuser::dropout is fused there; gradients equal the eager op's."""
    x, r = _nonzero((3, 37, 213), device=device), _nonzero((3, 37, 213), device=device)
    b, w = _nonzero((213,), device=device), _nonzero((213,), device=device)
    for t in (x, r, b):
        t.requires_grad_()

    def fn(x, r, b):
        return F.layer_norm(dropout(x + b, 0.3, offset=7) + r, (213,), w)

    fused = fuser.fuse(fn)
    g = _nonzero(x.shape, device=device)
    results = []
    for f in (fused, fn):
        torch.manual_seed(3)
        out = f(x, r, b)
        results.append((out, *torch.autograd.grad(out, (x, r, b), g)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol(torch.float32))
    forward, backward = fused.reports[-2:]
    assert any("backward graph" in n for n in backward.notes)
    drawn = "torch.ops.aten.randint"  # the backward takes the forward's seed as an input, draws none
    assert drawn in "".join(forward.code) and drawn not in "".join(backward.code)
    assert {"fuser.dropout.default", "aten.sum.dim_IntList"} <= set(_region_with_dropout(backward).ops)
