"""Conv nets: BatchNorm (eval: a per-channel affine folded into the region; training: statistics and
running-stat updates fused), GroupNorm and InstanceNorm as row reductions, NCHW and channels_last.

Whole blocks are compared with eager at a looser fp32 tolerance (as tests/test_models.py does):
convolutions and their weight gradients sum hundreds of products, so reordered fp32 sums differ by
more than one op's tolerance.  Training runs in fp32 on every device: ReLU's gradient is a step, so a
pre-activation within rounding of 0 takes the other branch, and its whole gradient (spread by the
convolution's backward) differs.  In bf16, where eager rounds between ops and the kernel does not,
that happens to a few elements of every tensor; in fp32 only within ~1e-7 of 0 (seeds are fixed;
seed 0 puts one ResNet pre-activation at 3e-8 in eager, -1e-8 in fp64, so the ResNet tests use 1).
Sizes are odd (batch 3, 13x11, 12/20 channels) and small: the kernels run through Triton's
interpreter on CPU.
"""
import copy

import pytest
import torch
import torch.nn as nn

import fuser
from tolerances import tol

BLOCK_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}
LAYOUTS = ["nchw", "channels_last"]


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _prepare(model, x, layout, device, dtype=None):
    """Random (never zero) weights, random positive BN running stats, the model and input in `layout`."""
    dtype = dtype or _dtype(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase):
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
                if m.track_running_stats:
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
            elif isinstance(m, nn.GroupNorm) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    model = model.to(device, dtype)
    x = x.to(device, dtype)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    return model, x


def _infer(model, x):
    model.eval()
    fused = fuser.fuse(model)
    with torch.no_grad():
        out, want = fused(x), model(x)
    torch.testing.assert_close(out, want, **BLOCK_TOL[x.dtype])
    return fused


def _train(model, x, steps=3, lr=0.05):
    """`steps` SGD steps through the fused model and through an eager copy: outputs, the gradients of
    the input and of every parameter, and the buffers (BN running stats) agree at every step.  cuDNN
    convolutions run in full fp32 here: in TF32 (its default) they round their inputs to 10 bits,
    so a difference of one fp32 ulp between fused and eager norms can become one of 1e-3."""
    model.train()
    ref = copy.deepcopy(model)
    fused = fuser.fuse(model)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        _steps(model, ref, fused, x, steps, lr)
    return fused


def _steps(model, ref, fused, x, steps, lr):
    t = BLOCK_TOL[x.dtype]
    for step in range(steps):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, want = fused(xa), ref(xb)
        torch.testing.assert_close(out, want, **t)
        grad = torch.randn_like(want)
        out.backward(grad)
        want.backward(grad)
        torch.testing.assert_close(xa.grad, xb.grad, **t)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **t, msg=lambda m: f"step {step}, grad of {name}: {m}")
                p -= lr * p.grad
                q -= lr * q.grad
                p.grad = q.grad = None
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, **tol(b.dtype), msg=lambda m: f"step {step}, buffer {name}: {m}")


def _assert_norms_fused(fused, kind=None):
    """No norm op and nothing for want of a lowering left eager; the norms' ops sit in fused regions."""
    for rep in fused.reports:
        assert not rep.all_fallbacks, rep.all_fallbacks
        for u in rep.unfused:
            assert "norm" not in u.op and "no Triton lowering" not in u.reason, (u.op, u.reason)
            assert "not a single tensor" not in u.reason or "convolution" in u.op, (u.op, u.reason)
    regions = [r for rep in fused.reports for r in rep.regions]
    if kind == "reduction":  # statistics from the batch: var_mean in a reduction region, rsqrt with it
        assert any(r.kind == "reduction" and {"var_mean", "rsqrt"} <= fused_ops_of(r) for r in regions)
    elif kind == "affine":  # eval BatchNorm: running stats folded into a pointwise region
        assert any(r.kind == "pointwise" and {"sqrt", "mul", "add"} <= fused_ops_of(r) for r in regions)


def fused_ops_of(region) -> set:
    return {o.replace("aten.", "").split(".")[0] for o in region.ops}


def _backward_reports(fused):
    return [rep for rep in fused.reports if any("backward graph" in n for n in rep.notes)]


# ----------------------------------------------------------------------------- BatchNorm


def _conv_bn_relu(cin=3, c=12):
    return nn.Sequential(nn.Conv2d(cin, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batchnorm_eval_is_one_pointwise_region(device, layout):
    torch.manual_seed(0)
    model, x = _prepare(_conv_bn_relu(), torch.randn(3, 3, 13, 11), layout, device)
    fused = _infer(model, x)
    _assert_norms_fused(fused, "affine")
    (region,) = fused.report.regions  # (x - mean) / sqrt(var + eps) * w + b, then relu: one kernel
    assert region.kind == "pointwise" and "relu" in fused_ops_of(region)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batchnorm_training_running_stats(device, layout):
    torch.manual_seed(0)
    model, x = _prepare(_conv_bn_relu(), torch.randn(3, 3, 13, 11), layout, device, torch.float32)
    fused = _train(model, x)
    assert model[1].num_batches_tracked.item() == 3
    _assert_norms_fused(fused, "reduction")
    forward = fused.reports[0]
    # statistics, normalisation, affine, relu and both running-stat updates: one kernel
    (region,) = [r for r in forward.regions if r.kind == "reduction"]
    assert {"var_mean", "rsqrt", "relu"} <= fused_ops_of(region)
    assert sum(o.startswith("aten.add") for o in region.ops) >= 3  # eps, running_mean, running_var
    # backward: the per-channel sums of BN's gradient and the input gradient in one reduction
    (back,) = _backward_reports(fused)
    assert [r.kind for r in back.regions] == ["reduction"] and "sum" in fused_ops_of(back.regions[0])


# ----------------------------------------------------------------------------- ResNet and ConvNeXt blocks


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-bn-relu-conv-bn, plus the identity or a 1x1 conv-bn downsample, relu."""

    def __init__(self, cin, c, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None
        if stride != 1 or cin != c:
            self.down = nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, LayerNorm over channels in NHWC, Linear 4x, GELU, Linear,
    layer scale, residual (drop_path off)."""

    def __init__(self, c):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pw1 = nn.Linear(c, 4 * c)
        self.pw2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(nn.functional.gelu(self.pw1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("down", [False, True], ids=["identity", "downsample"])
def test_resnet_block_inference(device, layout, down):
    torch.manual_seed(1)
    block = BasicBlock(12, 20, stride=2) if down else BasicBlock(12, 12)
    model, x = _prepare(block, torch.randn(3, 12, 13, 11), layout, device)
    fused = _infer(model, x)
    _assert_norms_fused(fused, "affine")
    # bn1+relu, and bn2 + (downsample bn) + residual add + relu: two pointwise kernels
    assert [r.kind for r in fused.report.regions] == ["pointwise", "pointwise"]
    assert {"add", "relu"} <= fused_ops_of(fused.report.regions[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("down", [False, True], ids=["identity", "downsample"])
def test_resnet_block_training(device, layout, down):
    torch.manual_seed(1)
    block = BasicBlock(12, 20, stride=2) if down else BasicBlock(12, 12)
    model, x = _prepare(block, torch.randn(3, 12, 13, 11), layout, device, torch.float32)
    fused = _train(model, x, steps=2)
    _assert_norms_fused(fused, "reduction")
    # bn1 (+relu) one kernel; bn2, the downsample's bn (same rows), the residual add and relu another
    forward = fused.reports[0].regions
    assert [r.kind for r in forward] == ["reduction", "reduction"]
    assert sum(o.startswith("aten.var_mean") for r in forward for o in r.ops) == (3 if down else 2)
    assert {"add", "relu"} <= fused_ops_of(forward[-1])
    (back,) = _backward_reports(fused)
    assert sum(r.kind == "reduction" for r in back.regions) >= 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convnext_block_inference(device, layout):
    torch.manual_seed(0)
    model, x = _prepare(ConvNeXtBlock(20), torch.randn(3, 20, 13, 11), layout, device)
    fused = _infer(model, x)
    _assert_norms_fused(fused, "reduction")  # LayerNorm over channels: a row reduction in NHWC
    # layer scale and residual in one kernel (GELU sits alone between two matmuls: k = 1, eager)
    assert any(r.kind == "pointwise" and {"mul", "add"} <= fused_ops_of(r) for r in fused.report.regions)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convnext_block_training(device, layout):
    torch.manual_seed(0)
    model, x = _prepare(ConvNeXtBlock(20), torch.randn(3, 20, 13, 11), layout, device, torch.float32)
    fused = _train(model, x, steps=2)
    _assert_norms_fused(fused, "reduction")
    (back,) = _backward_reports(fused)
    assert any(r.kind == "reduction" for r in back.regions)  # LayerNorm's gradient


# ----------------------------------------------------------------------------- GroupNorm, InstanceNorm


NORMS = {
    "group_norm": lambda c: nn.GroupNorm(4, c),
    "group_norm_plain": lambda c: nn.GroupNorm(4, c, affine=False),
    "instance_norm": lambda c: nn.InstanceNorm2d(c, affine=True),
    "instance_norm_plain": lambda c: nn.InstanceNorm2d(c),
    "instance_norm_stats": lambda c: nn.InstanceNorm2d(c, affine=True, track_running_stats=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", NORMS)
def test_norm_inference(device, name, layout):
    torch.manual_seed(0)
    model, x = _prepare(nn.Sequential(nn.Conv2d(3, 12, 3), NORMS[name](12), nn.GELU()),
                        torch.randn(3, 3, 13, 11), layout, device)
    fused = _infer(model, x)
    # InstanceNorm with running stats uses them in eval: an affine; the others normalise per row
    _assert_norms_fused(fused, "affine" if name == "instance_norm_stats" else "reduction")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", NORMS)
def test_norm_training(device, name, layout):
    torch.manual_seed(0)
    model, x = _prepare(nn.Sequential(nn.Conv2d(3, 12, 3), NORMS[name](12), nn.GELU()),
                        torch.randn(3, 3, 13, 11), layout, device, torch.float32)
    fused = _train(model, x, steps=2)
    _assert_norms_fused(fused, "reduction")
    (back,) = _backward_reports(fused)
    assert any(r.kind == "reduction" and "sum" in fused_ops_of(r) for r in back.regions)
    if name != "group_norm":  # GELU's gradient, viewed per (sample, channel), joins the norm's: one kernel
        assert "erf" in fused_ops_of(back.regions[0]) and "sum" in fused_ops_of(back.regions[0])
        # the weight's and the bias's gradients (two sums over the 3 samples: adds, split.unroll_small_sums)
        # share one kernel
        assert len(back.regions) <= 2 and (len(back.regions) == 1 or len(back.regions[-1].output_shapes) == 2), back
        assert not [u for u in back.unfused if "sum" in u.op or "add" in u.op], back.unfused


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [(1, 1), (3, 2), (13, 11)], ids=["global", "ragged", "identity"])
def test_adaptive_average_pool_fuses_forward_and_backward(device, layout, size):
    """Adaptive average pooling (a ResNet's global pool, windows of a ragged size over 13x11) decomposes
    into sums and gathers the kernels take, with the ReLU before it and the scale after, in the forward
    and in the backward (its own eager kernel before); gradients as eager's."""
    torch.manual_seed(2)
    x = torch.randn(3, 12, 13, 11, device=device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)

    def fn(x):
        return nn.functional.adaptive_avg_pool2d(x.relu() * 2, size).flatten(1) * 3 + 1
    fused = fuser.fuse(fn)
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    g = torch.randn(3, 12 * size[0] * size[1], device=device)
    out, want = fused(xs[0]), fn(xs[1])
    torch.testing.assert_close(out, want, **tol(torch.float32))
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol(torch.float32))
    ops = {o for r in fused.reports for reg in r.regions for o in reg.ops}
    assert not any("adaptive" in o for o in ops | {u.op for r in fused.reports for u in r.unfused}), fused.reports
    assert all(r.regions and not r.all_fallbacks for r in fused.reports), fused.reports


@pytest.mark.parametrize("size", [(5, 7), 1], ids=["to-5x7", "global"])
def test_adaptive_pooling_over_many_image_sizes_compiles_few_graphs(device, size):
    """torch's decomposition of adaptive pooling branches on `H % out`: over symbolic sizes each residue was
    a graph of its own, until Dynamo's recompile limit ran every later size eagerly.  Pooled to more than
    one cell there, the op stays whole; a global pool still decomposes (a mean, fused), in either case with
    at most two graphs over nine sizes."""
    def fn(x):
        return nn.functional.interpolate(x, size=size, mode="area") * 1.5 + 1 if size != 1 else \
            nn.functional.adaptive_avg_pool2d(x.relu(), 1) * 1.5 + 1

    fused = fuser.fuse(fn)
    for s in (16, 31, 20, 57, 9, 24, 33, 12, 41):
        x = torch.randn(2, 4, s, s + 3, device=device)
        torch.testing.assert_close(fused(x), fn(x), **tol(torch.float32))
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report
    assert len(fused.reports) <= 2, [r.regions for r in fused.reports]
    if size == 1:
        assert any("mean" in o or "sum" in o for r in fused.report.regions for o in r.ops), fused.report


POOLS = {  # (kind, kwargs): a ResNet stem, plain windows, strides, dilation, ceil_mode, the divisor's options
    "max-3s2p1": ("max", dict(kernel_size=3, stride=2, padding=1)),
    "max-2": ("max", dict(kernel_size=2)),
    "max-3x2-dilated-ceil": ("max", dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=2, ceil_mode=True)),
    "avg-2": ("avg", dict(kernel_size=2)),
    "avg-3s2p1-ceil": ("avg", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    "avg-3s1p1-no-pad-count": ("avg", dict(kernel_size=3, stride=1, padding=1, count_include_pad=False)),
    "avg-3x2-divisor": ("avg", dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 1), divisor_override=5)),
    "avg-6x5-tiles": ("avg", dict(kernel_size=(6, 5))),  # windows that tile the input: a sum, of any size
}


def _pool(kind, kwargs, x, indices=False):
    if kind == "max":
        return nn.functional.max_pool2d(x, return_indices=indices, **kwargs)
    return nn.functional.avg_pool2d(x, **kwargs)


def _pooling_ops(reports):
    return [u.op for r in reports for u in r.unfused if "pool" in u.op]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(POOLS))
def test_pooling_fuses_with_the_ops_around_it(device, layout, name):
    """Max and average pooling decompose into strided views of the padded input: with the BatchNorm-like
    affine and ReLU before and the scale after, one kernel, in inference and training (the backward's pooling
    gradient stays eager's op); values, max pooling's indices and gradients as eager's, odd sizes (13x11),
    both layouts; the output keeps the input's layout as eager's does."""
    kind, kwargs = POOLS[name]
    torch.manual_seed(3)
    x = torch.randn(3, 12, 13, 11, device=device)
    scale = torch.rand(12, 1, 1, device=device) + 0.5
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)

    def fn(x):
        out = _pool(kind, kwargs, (x * scale - 0.2).relu(), indices=kind == "max")
        return (out[0] * 1.5, out[1]) if kind == "max" else out * 1.5
    fused = fuser.fuse(fn)
    with torch.no_grad():
        got, want = fused(x), fn(x)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    first = got[0] if kind == "max" else got
    assert first.stride() == (want[0] if kind == "max" else want).stride()
    assert fused.report.regions and not _pooling_ops([fused.report]), fused.report
    assert len(fused.report.regions) == 1, fused.report
    if name in ("max-3s2p1", "avg-3s2p1-ceil"):  # the per-channel scale loaded once, not once per window element
        assert fused.report.regions[0].source.count("tl.load(") <= 9 + 1, fused.report.regions[0].source

    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    outs = [fuser.fuse(fn)(xs[0]), fn(xs[1])]
    g = torch.randn_like(outs[1][0] if kind == "max" else outs[1])
    for o, leaf in zip(outs, xs):
        (o[0] if kind == "max" else o).backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol(torch.float32))


def test_max_pool_indices_at_ties_nans_and_infinities(device):
    """Eager's rule, not max's: a window's index is its first of tied maxima or its last NaN, and a window all
    -inf (or all padding and -inf) gives its first position inside the input; values carry the NaN."""
    x = torch.randn(2, 3, 9, 10, device=device).round()  # many ties
    x[0, 0, 1, 1] = x[0, 0, 2, 2] = float("nan")
    x[0, 1, :4, :4] = float("-inf")
    x[1, 2, 3, :] = float("inf")
    x[1, 0, ::2, ::3] = float("nan")

    def fn(x):
        return nn.functional.max_pool2d(x * 1.0, 3, stride=2, padding=1, return_indices=True)
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **tol(torch.float32))
    torch.testing.assert_close(got[1], want[1])
    assert not _pooling_ops(fused.reports), fused.reports


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_average_pool_in_16_bit_sums_in_fp32(device, dtype):
    """A 16-bit average pool sums in fp32 and rounds once, as eager's kernel; values near 1000 where a 16-bit
    running sum would lose them."""
    x = (torch.randn(2, 5, 15, 17, device=device) + 1000).to(dtype)
    fn = lambda x: nn.functional.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False) - 1000  # noqa: E731
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x), fn(x), **tol(dtype))
    assert not _pooling_ops(fused.reports), fused.reports


def test_pooling_at_symbolic_sizes(device):
    """Under dynamic=True both pools fuse at every size, one kernel (one graph on torch 2.13); ceil_mode at a symbolic size keeps the
    op (whether its last window exists is a comparison of sizes), still right."""
    def fn(x):
        return nn.functional.max_pool2d(x.relu(), 3, 2, 1) + nn.functional.avg_pool2d(x, 3, 2, 1)

    def ceil(x):
        return nn.functional.avg_pool2d(x * 2, 2, ceil_mode=True)
    fused, fused_ceil = fuser.fuse(fn, dynamic=True), fuser.fuse(ceil, dynamic=True)
    for s in (13, 20, 9):
        x = torch.randn(2, 3, s, s + 2, device=device)
        torch.testing.assert_close(fused(x), fn(x), **tol(torch.float32))
        torch.testing.assert_close(fused_ceil(x), ceil(x), **tol(torch.float32))
    # torch 2.11's meta of the pools rounds the output size with a guard on the size's parity (div_rtn): two graphs
    assert len(fused.reports) <= 2 and not _pooling_ops(fused.reports), fused.reports
    assert all(len(r.regions) == 1 for r in fused.reports), fused.reports
    assert _pooling_ops(fused_ceil.reports) and not fused_ceil.reports[0].all_fallbacks, fused_ceil.reports


@pytest.mark.parametrize("size", [(2, 3), (5, 1), (6, 6), 3])
def test_ragged_adaptive_pooling_is_one_sum(device, size):
    """Adaptive pooling to sizes that do not divide the input's (a pyramid pooling head: 37x53 to 2x3, 6x6):
    a masked gather of the windows and one sum over them, not torch's chain of one add per window element
    (380 of them for 2x3, whose partition took half a minute and whose kernel gathered 380 times); values and
    gradients as eager's, 16-bit summed in fp32."""
    torch.manual_seed(5)
    fn = lambda x: nn.functional.adaptive_avg_pool2d(x.relu(), size) * 2  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 37, 53, device=device, dtype=dtype)
        fused = fuser.fuse(fn)
        torch.testing.assert_close(fused(x), fn(x), **tol(dtype))
        (region,) = fused.report.regions
        assert region.kind == "reduction" and len(region.ops) < 40 and not fused.report.unfused, fused.report
    xs = [torch.randn(2, 3, 37, 53, device=device).requires_grad_() for _ in range(1)]
    xs.append(xs[0].detach().clone().requires_grad_())
    fuser.fuse(fn)(xs[0]).square().sum().backward()
    fn(xs[1]).square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol(torch.float32))


@pytest.mark.parametrize("act", [nn.SiLU, nn.GELU, nn.Hardswish, nn.Mish])
def test_an_activations_gradient_past_the_convolutions_backward_reads_its_input_again(device, act):
    """Conv -> activation -> conv in training: the backward recomputes the activation for the second conv's
    weight gradient (before convolution_backward) and takes the activation's gradient after it.  The op they
    share (SiLU's sigmoid) is computed again after the eager op: the kernel before it writes the activation
    alone, the one after reads its input and the incoming gradient.  Five tensors of the activation's size in
    all, as eager moves; it had been eight (the shared op and its results written, then read back)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1), act(), nn.Conv2d(8, 8, 3, 1, 1)).to(device)
    x = torch.randn(2, 8, 16, 15, device=device)
    fused = fuser.fuse(model)
    w = torch.randn(2, 8, 16, 15, device=device)
    got = torch.autograd.grad((fused(x) * w).sum(), list(model.parameters()))
    want = torch.autograd.grad((model(x) * w).sum(), list(model.parameters()))
    torch.testing.assert_close(got, want, **BLOCK_TOL[torch.float32])
    back = next(r for r in fused.reports if any("backward" in n for n in r.notes))
    size = 2 * 8 * 16 * 15 * 4
    assert back.regions and sum(r.bytes_fused for r in back.regions) <= 5 * size, back


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_max_pool_of_a_small_input_whose_windows_reach_past_it(device, size):
    """A small input pooled to a cell or two (a conv stem on a tiny image): some window elements read padding
    alone; those are left out of the chain (a constant -inf, never taken), where they had sent the graph to
    eager.  Values and indices as eager's, ceil_mode's extra window too."""
    fn = lambda x: nn.functional.max_pool2d(x.relu() * 2, 3, 2, 1, ceil_mode=True, return_indices=True)  # noqa: E731
    x = torch.randn(2, 3, size, size + 1, device=device)
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    assert fused.report.regions and not fused.report.all_fallbacks and not _pooling_ops(fused.reports), fused.report


def test_stacked_average_pools_at_symbolic_sizes_compile_few_graphs(device):
    """Four 2x2 average pools in a row under dynamic=True over six sizes: the pools whose windows tile the input
    are a reshape and one sum only where the size is known to divide (else a guard on each size's residue, a
    graph per pattern, to Dynamo's recompile limit); otherwise strided views.  One graph on torch 2.13 (2.11's
    meta of the pool guards each size's parity); channels_last kept as eager keeps it."""
    model = nn.Sequential(*[nn.Sequential(nn.AvgPool2d(2), nn.ReLU()) for _ in range(4)]).to(device)
    fused = fuser.fuse(model, dynamic=True)
    for s in (33, 34, 36, 41, 44, 47):  # residues mod 2, 4, 8 and 16 in several patterns
        x = torch.randn(1, 2, s, s + 1, device=device).to(memory_format=torch.channels_last)
        got, want = fused(x), model(x)
        torch.testing.assert_close(got, want, **tol(torch.float32))
    assert len(fused.reports) <= 2 and not any(r.all_fallbacks for r in fused.reports), len(fused.reports)
    assert not _pooling_ops(fused.reports), fused.reports
    ragged = fuser.fuse(lambda x: nn.functional.adaptive_avg_pool2d(x, (4, 3)))
    x = torch.randn(2, 5, 9, 8, device=device).to(memory_format=torch.channels_last)
    assert ragged(x).stride() == nn.functional.adaptive_avg_pool2d(x, (4, 3)).stride()
