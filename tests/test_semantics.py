"""Eager's semantics on eager's device: NaN/Inf as torch propagates them, eager's errors raised, and
no kernel that is known to compute wrongly (the interpreter's bf16 dot) ever runs.

Each test checks the fused answer (or error) against eager's, and that the op under test was fused:
a fallback to eager must not make a semantics test pass.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fuser
from helpers import fused_ops
from tolerances import assert_close_to_eager

transformers = pytest.importorskip("transformers")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _rows_with_nan(device, dtype, shape=(6, 37)):
    a = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    a[1, 3] = a[1, 9] = float("nan")   # two NaNs: the first one's index
    a[2, 0] = float("nan")
    a[3, -1] = float("nan")
    a[4, 5] = float("inf")              # inf is not NaN: the max is still the inf
    a[5, 7] = -float("inf")
    return a.to(device)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["argmax", "argmin"])
@pytest.mark.parametrize("dim", [-1, 0, None])
def test_argmax_argmin_nan(op, dim, dtype, device):
    a = _rows_with_nan(device, dtype)

    def fn(a):
        return getattr(a * 2, op)(dim)

    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(a), fn(a), atol=0, rtol=0)
    assert op in fused_ops(fused.report)


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_negative_zero_in_the_program_keeps_its_sign(dtype, device):
    """x * -0.0, a -0.0 filled in by `where` and a pad of -0.0: the zeros' signs as eager's (Triton's compiler
    made a -0.0 constant +0.0: 1 / that gave +inf where eager gives -inf, run 196)."""
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)

    def fn(x):
        return (x * -0.0 + 1) * (x * -0.0), torch.where(x > 0, x, -0.0) * 2, F.pad(x * 3, (0, 2), value=-0.0)
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    assert_close_to_eager(got, want)
    for g, w in zip(got, want):
        assert torch.equal(torch.signbit(g), torch.signbit(w))
    assert {"mul", "where", "constant_pad_nd"} <= fused_ops(fused.report), fused.report


_EDGES = [-0.0, 0.0, -float("inf"), float("inf"), float("nan"), -1e-30, 1e-30, -0.3, 0.3, -2.5, 2.5, -1.0, 1.0, -3.0, 3.0]
# Each op at the IEEE edge values, as a fused kernel computes it. Left out where eager itself differs by device or
# dtype or torch's decomposition does not compute what eager's kernel does (a fusion pass cannot be held to
# both): gelu(-0.0) (+0.0 on CPU, -0.0 by its formula), x ** 0.5 at -0.0 and -inf (CPU's fp16 kernel takes C's
# pow, others sqrt), softshrink's and tanhshrink's zeros (their decompositions: x * 0, x - tanh(x) rounded).
# The sign of a zero result is not held where eager's differs by device (relu and clamp_min: -0.0 on CPU, +0.0
# on CUDA) or the GPU's compiler drops it (frac(-0.0): x - trunc(x) came out -0.0, run 198).
_ZERO_SIGN_FREE = {"relu", "clamp_min", "frac"}
_EDGE_OPS = {
    "neg": torch.neg, "abs": torch.abs, "reciprocal": torch.reciprocal, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "exp": torch.exp, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2, "log10": torch.log10,
    "log1p": torch.log1p, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "silu": F.silu, "relu": torch.relu, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh,
    "hardswish": F.hardswish, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "erf": torch.erf,
    "x**3": lambda x: x ** 3, "x**-1": lambda x: x ** -1, "x**-3": lambda x: x ** -3, "x**(1/3)": lambda x: x ** (1 / 3),
    "x**2.5": lambda x: x ** 2.5, "x**0": lambda x: x ** 0, "0**x": lambda x: torch.pow(0.0, x),
    "clamp": lambda x: x.clamp(-1, 1), "clamp_min": lambda x: x.clamp_min(0),
    "clamp_by_tensor": lambda x: x.clamp(min=x.flip(-1)), "clamp_nan": lambda x: x.clamp(max=float("nan")),
    "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round,
    "frac": torch.frac, "asin": torch.asin, "atan": torch.atan, "sinh": torch.sinh, "asinh": torch.asinh,
    "atanh": torch.atanh, "elu": F.elu, "softplus": F.softplus, "mish": F.mish, "logsigmoid": F.logsigmoid,
    "sinc": torch.sinc, "x*-0": lambda x: x * -0.0, "0-x": lambda x: 0.0 - x, "x/-inf": lambda x: x / -float("inf"),
    "remainder": lambda x: torch.remainder(x, -2.0), "fmod": lambda x: torch.fmod(x, 2.0),
    "floor_divide": lambda x: torch.floor_divide(x, 2.0), "maximum": lambda x: torch.maximum(x, torch.full_like(x, 0.1)),
    "where": lambda x: torch.where(x > 0, x, -x), "copysign": lambda x: torch.copysign(torch.ones_like(x) * 2, x.nan_to_num()),  # a NaN's sign: unspecified
    "atan2": lambda x: torch.atan2(x, -torch.ones_like(x)), "hypot": lambda x: torch.hypot(x, x),
    "ldexp": lambda x: torch.ldexp(x, torch.ones_like(x, dtype=torch.int32)), "digamma": torch.digamma,
    "nextafter": lambda x: torch.nextafter(x, torch.zeros_like(x)), "full": lambda x: x + torch.full_like(x, 0.1),
    "to_bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
}


@pytest.mark.parametrize("dtype", FLOATS)
def test_ops_at_signed_zeros_infinities_and_nan(dtype, device):
    """Every op above at +-0, +-inf, NaN, tiny and ordinary values, fused: eager's values, NaN where eager's,
    and eager's sign on every zero and infinity (1 / x tells -0.0 from 0.0). The interpreter and the GPU's
    compiler each lost some (tanh(-0.0) was +0.0; expm1(inf), log1p(inf), digamma(inf) NaN; (-0.0) ** -3
    +inf; round(-0.3) +0.0; a NaN rounded to bf16 by hand became -0.0; ones_like(x) was an int in a float
    kernel, so copysign(ones_like(x) * 2, x) read its bits)."""
    x = torch.tensor(_EDGES, dtype=dtype).repeat(3, 1).to(device)
    # a NaN clamp bound: CUDA's eager ignores it in clamp(min=) and clamp(max=) but not in clamp_min or clamp(lo,
    # hi) (run 205); CPU's, and ours, give NaN
    ops = {k: f for k, f in _EDGE_OPS.items() if not (k == "clamp_nan" and device == "cuda")}

    def fn(x):
        x = x * 1.0  # every op reads a value computed in the kernel, not only a load
        return tuple(f(x) * 1.0 for f in ops.values())
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    assert not fused.report.all_fallbacks, fused.report
    for name, g, w in zip(ops, got, want):
        assert_close_to_eager(g, w, equal_nan=True, msg=name)
        zero_or_inf = w.isinf() if name in _ZERO_SIGN_FREE else (w == 0) | w.isinf()
        assert torch.equal(g.signbit()[zero_or_inf], w.signbit()[zero_or_inf]), (name, x[0], g[0], w[0])
    assert {"tanh", "expm1", "log1p", "copysign", "digamma", "round", "pow", "div", "ldexp", "atan2",
            "atanh"} <= fused_ops(fused.report), fused_ops(fused.report)
    # nextafter's step is the dtype's: fp32 compute cannot take a 16-bit one, so there it stays eager, saying so
    sixteen = dtype in (torch.float16, torch.bfloat16)
    assert ("nextafter" in fused_ops(fused.report)) != sixteen
    assert not sixteen or any("nextafter in a 16-bit dtype" in u.reason for u in fused.report.unfused)


def test_bf16_subnormals_keep_their_values(device):
    """bf16 values below 1.2e-38 (subnormal) loaded, computed on, cast and stored as eager's: Triton's
    interpreter flushed them to 0 in its own bf16 <-> fp32 conversions (relu(1e-40) was 0; the CPU's kernels
    convert by bits now)."""
    x = torch.tensor([1e-40, -1e-40, 1e-39, -3e-39, 2.0, -3.5, float("inf"), -0.0, 1.0117], dtype=torch.bfloat16)
    x = x.repeat(3, 1).to(device)

    def fn(x):
        return torch.relu(x * 2.0) * 0.5, x * 1e-39 * 2.0, (x * 1.0).float() * 1.0, (x.float() * 1.0001).bfloat16() * 1.0
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=0, equal_nan=True)
    assert {"relu", "mul", "_to_copy"} <= fused_ops(fused.report) and not fused.report.all_fallbacks, fused.report


def test_gradient_of_x_to_the_one_at_infinities(device):
    """x ** 1.0's gradient is g * 1.0 * x ** 0.0: 1 at +-inf and NaN too (x * 0 + 1 made it NaN there)."""
    x = torch.tensor([[float("inf"), -float("inf"), 2.0, 0.0, -0.0, -3.0, 0.5]], device=device).repeat(3, 1)
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(2)).to(device)

    def fn(x):
        return ((x * 1.5) ** 1.0 * w).sum()
    fused = fuser.fuse(fn)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, = torch.autograd.grad(fused(a), a)
    want, = torch.autograd.grad(fn(b), b)
    assert_close_to_eager(got, want)
    assert "pow" in {o for r in fused.reports for o in fused_ops(r)}, fused.reports


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_through_max_min_clamp_where(dtype, device):
    a = _rows_with_nan(device, dtype)
    b = torch.randn(a.shape, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    b[0, :5] = float("nan")

    def fn(a, b):
        return (torch.maximum(a * 2, b), torch.minimum(a * 2, b), (a * 2).clamp(-0.5, 0.5),
                torch.where(a * 2 > 0, a, b) + 1, (a * 2).amax(-1), (a * 2).amin(0))

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(a, b), fn(a, b))
    assert {"maximum", "minimum", "clamp", "where", "amax", "amin"} <= fused_ops(fused.report)


@pytest.mark.parametrize("op", [torch.minimum, torch.maximum])
def test_nan_through_min_max_with_a_0d_tensor(op, device):
    """A 0-d tensor (an input, or a constant folded at compile time) read by a kernel as a scalar,
    against a block holding NaNs: NaN wins from either side, and the op is fused."""
    s, x = torch.tensor(0.3, device=device), torch.randn(3, 423, device=device)
    x[1, 5] = float("nan")
    nan_s = torch.tensor(float("nan"), device=device)
    for a, b in ((s, x), (x, s), (nan_s, x)):
        fused = fuser.fuse(lambda a, b: op(a, b) * 2)
        assert_close_to_eager(fused(a, b), op(a, b) * 2, equal_nan=True)
        assert not fused.report.all_fallbacks and op.__name__ in fused_ops(fused.report), fused.report


def test_softmax_over_rows_all_minus_inf(device):
    """A fully masked row: eager's softmax gives NaN (0/0), so does the kernel."""
    a = torch.randn(5, 33, device=device)
    mask = torch.rand(5, 33, device=device) < 0.3
    mask[2] = True

    def fn(a, m):
        return torch.softmax((a * 2).masked_fill(m, -float("inf")), -1)

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(a, mask), fn(a, mask))
    assert fused(a, mask)[2].isnan().all()
    assert "amax" in fused_ops(fused.report)


def test_gather_index_out_of_range_raises(device):
    if device != "cpu":
        pytest.skip("CUDA: eager and fuser both stop on a device-side assert, which ends the process")
    a = torch.randn(4, 5, device=device)
    idx = torch.randint(0, 5, (4, 3), device=device)

    def fn(a, i):
        return torch.gather(a * 2, 1, i) + 1

    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(a, idx), fn(a, idx))  # in range: eager's values
    assert "gather" in fused_ops(fused.report)
    for bad in (5, -1):
        idx[2, 1] = bad
        with pytest.raises(RuntimeError, match="out of bounds"):
            fn(a, idx)
        with pytest.raises(RuntimeError, match="index out of bounds for dimension 1 with size 5"):
            fused(a, idx)


def test_gather_kernel_guards_its_loads_on_gpu(device):
    """On the GPU the kernel asserts on the device (as eager's gather does) and masks the load, so an
    out-of-range index never reads outside the tensor."""
    if device != "cuda":
        pytest.skip("the compiled (GPU) kernel source")
    fused = fuser.fuse(lambda a, i: torch.gather(a * 2, 1, i) + 1)
    fused(torch.randn(4, 5, device=device), torch.randint(0, 5, (4, 3), device=device))
    src = fused.report.regions[0].source
    assert "tl.device_assert" in src and "@triton.jit(debug=True)" in src


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["floor_divide", "remainder", "fmod", "div_trunc", "div_floor"])
def test_integer_division_by_zero(op, dtype, device):
    fns = {"floor_divide": lambda a, b: (a * 2) // b + 1, "remainder": lambda a, b: (a * 2) % b + 1,
           "fmod": lambda a, b: torch.fmod(a * 2, b) + 1,
           "div_trunc": lambda a, b: torch.div(a * 2, b, rounding_mode="trunc") + 1,
           "div_floor": lambda a, b: torch.div(a * 2, b, rounding_mode="floor") + 1}
    fn = fns[op]
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-50, 50, (9, 13), generator=g, dtype=dtype).to(device)
    b = torch.randint(1, 7, (9, 13), generator=g, dtype=dtype).to(device) * torch.where(
        torch.rand(9, 13, generator=g) < 0.5, -1, 1).to(dtype).to(device)
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(a, b), fn(a, b), atol=0, rtol=0)
    assert fused.report.regions
    if device != "cpu":
        return  # CUDA eager does not raise on integer division by zero
    b[4, 6] = 0
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fn(a, b)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fused(a, b)


@pytest.mark.parametrize("dtype, value", [(torch.int64, -100.0), (torch.int64, -1.7), (torch.int32, 7),
                                          (torch.int8, 127.0), (torch.uint8, 200), (torch.bool, 0.5)])
def test_an_integer_pad_keeps_its_dtype(dtype, value, device):
    """F.pad of an integer tensor with a float value fills with the value in the tensor's dtype (truncated, as
    eager): the fill was a float literal, which made the kernel's result fp32 (int64 past 2**24 rounded; HF's
    labels, padded with -100, an fp32 index).  Found by a sweep of unseen architectures (Cohere, Gemma3)."""
    def fn(x):
        y = F.pad(x, (1, 2), value=value)
        return y.logical_not() if dtype == torch.bool else y * 2 + 1
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2, (3, 37), generator=g).bool() if dtype == torch.bool else \
        torch.randint(0, 100, (3, 37), generator=g).to(dtype)
    if dtype == torch.int64:
        x[0, :3] = torch.tensor([2**30, 2**25 + 1, -(2**40) - 3])
    x = x.to(device)
    fused = fuser.fuse(fn)
    out, want = fused(x), fn(x)
    assert out.dtype == want.dtype and torch.equal(out, want), (out, want)
    assert "constant_pad_nd" in fused_ops(fused.report), fused.report


def test_float_division_by_zero_gives_inf_not_an_error(device):
    a, b = torch.randn(7, 9, device=device), torch.randn(7, 9, device=device)
    b[1, 1] = 0.0
    b[2, 2] = -0.0

    def fn(a, b):
        return (a * 2) / b, torch.remainder(a * 2, b), torch.floor_divide(a * 2, b)

    assert_close_to_eager(fuser.fuse(fn)(a, b), fn(a, b))


def test_amax_over_an_empty_dim_raises_eagers_error(device):
    fused = fuser.fuse(lambda a: (a * 2).amax(1))
    with pytest.raises(IndexError, match="Expected reduction dim 1 to have non-zero size"):
        fused(torch.randn(3, 0, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 37, 9000])  # unrolled as adds, one pass in registers, a loop
def test_sum_into_a_16_bit_dtype_rounds_each_element_first(dtype, width, device):
    """sum(x, dtype=D) is x.to(D).sum(): each element rounded to D before it is added (80000 is inf in
    fp16: the row's sum NaN; 1.001 rounds to 1 in bf16), not summed in fp32 and rounded once."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(7))
    x[:, 0], x[:, 1], x[1, 2] = 40000.0, -39999.0, 1.001 / 2
    i = torch.randint(-3000, 3000, (3, width), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    i[:, 0], i[:, 1] = 2049, -2049
    x, i = x.to(device), i.to(device)

    def fn(x, i):
        return (x * 2.0).sum(-1, dtype=dtype), (i * 1).sum(-1, dtype=dtype) * 2, (x * 2.0).sum(dtype=dtype)
    fused = fuser.fuse(fn)
    got, want = fused(x, i), fn(x, i)
    assert_close_to_eager(got, want)
    assert want[0].isnan().all() == (dtype == torch.float16)
    assert {"mul"} < fused_ops(fused.report) and not fused.report.all_fallbacks, fused.report


@pytest.mark.parametrize("fn, x", [
    (lambda b: torch.abs(b & b), torch.tensor([[True, False, True]])),
    (lambda b: (b & b).argmax(-1), torch.tensor([[True, False, True]])),
    (lambda h: (h * 2.0).clamp(max=1e5), torch.ones(3, 5, dtype=torch.float16)),
    (lambda i: (i * 2).clamp_min(1000), torch.ones(3, 5, dtype=torch.int8)),
    (lambda i: torch.sub(i * 2, i, alpha=1000), torch.ones(3, 5, dtype=torch.int8)),
    (lambda b: (b & b) + 2**63, torch.tensor([[True, False, True]]))],
    ids=["abs-bool", "argmax-bool", "clamp-past-fp16", "clamp-past-int8", "alpha-past-int8", "bool-plus-uint64"])
def test_what_eager_refuses_is_refused(fn, x, device):
    """Ops eager raises on (abs and argmax of bools, a clamp bound its dtype cannot hold) stay eager, so
    the same error reaches the caller, not a value; where eager's CUDA kernels take them (abs of bools, an
    fp16 clamp bound held in fp32), the same value."""
    x = x.to(device)
    try:
        want = fn(x)
    except (RuntimeError, NotImplementedError) as e:
        with pytest.raises(type(e)):
            fuser.fuse(fn)(x)
        return
    assert device == "cuda"  # CPU's kernels raise on all six
    assert_close_to_eager(fuser.fuse(fn)(x), want)


def test_a_clamp_bound_an_unsigned_dtype_wraps_stays_eager(device):
    x = torch.arange(6, dtype=torch.uint8, device=device).reshape(2, 3)
    fused = fuser.fuse(lambda x: (x * 2).clamp_min(-1) + 1)
    assert torch.equal(fused(x), (x * 2).clamp_min(-1) + 1)  # -1 is 255 to eager: every value 0 after the + 1
    assert "clamp_min" not in fused_ops(fused.report)
    assert any("clamp bound outside" in u.reason for u in fused.report.unfused), fused.report


_WRAPPING_OPS = {
    "add": lambda x: (x + 1) + 1000, "sub": lambda x: (x - 200) * 3, "rsub": lambda x: 200 - (x * 3),
    "mul": lambda x: (x + 1) * -129, "and": lambda x: (x + 1) & 300, "xor": lambda x: (x + 1) ^ -300,
    "shift": lambda x: ((x + 1) << 257) + ((x * 3) >> 1) + ((x - 1) >> -1), "floor_divide": lambda x: (x + 1) // 1000, "remainder": lambda x: (x + 1) % 1000,
    "fmod": lambda x: torch.fmod(x + 1, -1000), "compare": lambda x: ((x + 1) > 1000) | ((x * 2) == 232),
    "alpha": lambda x: torch.add(x + 1, 3, alpha=100), "past_int32": lambda x: (x + 1) + (2**40 + 7),
    "true_divide": lambda x: (x + 1) / 32768 - x / -300,  # a float result: the scalar is not cast to x's dtype
}


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
@pytest.mark.parametrize("op", sorted(_WRAPPING_OPS))
def test_an_int_scalar_past_the_dtype_wraps_as_eagers(op, dtype, device):
    """A Python int past the tensor's dtype is cast to it by eager's binary ops as C's casts do (int8 + 1000
    adds -24; int8 > 1000 compares with -24): the kernel computes with the same value (it had made Triton
    refuse the literal, and the graph ran eagerly).  Where eager raises instead (clamp, masked_fill, an
    alpha of a tensor-tensor add), see test_what_eager_refuses_is_refused."""
    fn = _WRAPPING_OPS[op]
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -1000), min(info.max, 1000), (3, 423), generator=torch.Generator().manual_seed(3),
                      dtype=torch.int64).to(dtype).to(device)
    try:
        want = fn(x)
    except RuntimeError as e:  # x // 1000 is x // 0 in uint8 (1000 % 256 = 232: not here) or a shift eager refuses
        with pytest.raises(RuntimeError, match=str(e)[:20]):
            fuser.fuse(fn)(x)
        return
    fused = fuser.fuse(fn)
    got = fused(x)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close_to_eager(got, want) if want.is_floating_point() else torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert fused.report.regions and not fused.report.all_fallbacks, fused.report


class _ComplexRope(torch.nn.Module):
    """Meta's LLaMA rotation: a complex table multiplied in (its backward multiplies by the table's conj())."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)
        self.freqs_cis = torch.polar(torch.ones(16, 4), torch.randn(16, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        t = x.shape[1]
        q = torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], 4, 2))
        y = torch.view_as_real(q * self.freqs_cis[:t].view(1, t, 4)).flatten(2)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def _conjugated(x, w):
    c = (torch.view_as_complex(x.sin() * 2) * w[:4]).conj()
    return c.imag * 3 + 1, torch.view_as_real(c.resolve_conj()) * 2 + 1, torch.view_as_real(
        torch.view_as_complex(x * 2) * w[:4].conj()) * 3 + 1


def test_views_by_the_conjugate_and_negative_bits(device):
    """conj() and `.imag` of a conjugate are views by a bit (aten._conj, aten._neg_view): a kernel reads the
    memory, so the bit must be applied (the negation lowered, or the operand left to eager), never dropped
    by a view's reinterpretation.  Found by a helper's sweep: Meta's LLaMA rotation trained with gradients
    rotated the wrong way (the backward's freqs.conj()), conj().imag read with its sign flipped."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, 2, device=device), torch.polar(torch.ones(6), torch.randn(6)).to(device)
    fused = fuser.fuse(_conjugated)
    with torch.no_grad():
        assert_close_to_eager(fused(x, w), _conjugated(x, w))
    assert fused.report.regions and not fused.report.all_fallbacks, fused.report
    model = _ComplexRope().to(device)
    model.freqs_cis = model.freqs_cis.to(device)
    x, g = torch.randn(2, 5, 8, device=device), torch.randn(2, 5, 8, device=device)
    model(x).mul(g).sum().backward()
    want, model.lin.weight.grad = model.lin.weight.grad.clone(), None
    fused = fuser.fuse(model)
    fused(x).mul(g).sum().backward()
    assert_close_to_eager(model.lin.weight.grad, want)
    assert any(r.regions for r in fused.reports), fused.reports


def _attention(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, -1) @ v


def test_bf16_attention_matches_eager(device):
    """In bf16 the interpreter's tl.dot is wrong (values ~1e8): the CPU kernel upcasts its tiles to
    fp32 before each dot; on the GPU bf16 dots are native.  Compared with an fp64 reference: eager
    bf16 rounds the scores and probabilities, the kernel does not."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g).to(device, torch.bfloat16) for _ in range(3))
    mask = torch.where(torch.rand(37, 37, generator=g) < 0.2, -1e4, 0.0).to(device, torch.bfloat16)
    fused = fuser.fuse(_attention)
    with torch.no_grad():
        got, want = fused(q, k, v, mask), _attention(q, k, v, mask)
    ref = _attention(*(t.double() for t in (q, k, v, mask)))
    assert [r.kind for r in fused.report.regions].count("attention") == 1
    assert (got.double() - ref).abs().max() <= 2 * (want.double() - ref).abs().max() + 1e-2


def test_hf_llama_bf16_gives_eagers_tokens(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()
    ids = torch.randint(0, 211, (2, 23), device=device)
    fused = fuser.fuse(model)
    with torch.no_grad():
        got, want = fused(input_ids=ids).logits, model(input_ids=ids).logits
    assert "attention" in [r.kind for r in fused.report.regions]
    assert got.abs().max() < 100  # the broken dot gave values of ~1e8
    torch.testing.assert_close(got, want, atol=6e-2, rtol=6e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95  # ties in bf16 may flip a few


def test_interpreter_is_quiet(device):
    """Masked-off lanes compute log(0), 0/0, exp overflow: numpy's warnings about them never reach the user."""
    a = torch.randn(5, 37, device=device)

    def fn(a):
        return torch.log(a.abs() * 0) + torch.exp(a * 1e4) / (a * 0), torch.softmax(a * 3, -1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fuser.fuse(fn)(a)
    assert_close_to_eager(got, fn(a))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_comparison_with_a_python_float_in_16_bits(dtype, device):
    """A comparison converts a Python float to the tensor's 16-bit dtype before comparing (eager's common dtype,
    CPU and CUDA): `x_half == 4 / 3` holds where x holds half(4 / 3).  Compared in fp32 with the unrounded number,
    it had been False there: a silent wrong answer."""
    value = 4 / 3
    x = torch.randn(3, 423, 21, device=device).to(dtype)
    x[:, ::3] = torch.tensor(value, dtype=dtype)  # a third of the values equal the number, rounded
    fn = lambda x: ((x == value).float() * 2 + (x > value).float() - (x <= value).float(), torch.where(x >= value, x, 0.5))  # noqa: E731, E501
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x), fn(x))
    assert fused.report.regions and not fused.report.unfused, fused.report


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_pad_holds_its_value_rounded(dtype, device):
    """F.pad of a 16-bit tensor with a value its dtype cannot hold writes the value rounded to that dtype; read in
    fp32 by the next op of the kernel it had been the unrounded number."""
    x = torch.randn(3, 423, 21, device=device).to(dtype)
    fn = lambda x: F.pad(x, (1, 2), value=1 / 3).float().sum(-1)  # noqa: E731
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x), fn(x), atol=0, rtol=1e-6)
