"""PyTorch's own elementwise ops (OpInfo's op_db) through fuser, held to eager and asserted fused.

Denominator: every `UnaryUfuncInfo` and `BinaryUfuncInfo` entry of
`torch.testing._internal.common_methods_invocations.op_db` (one entry per name + variant) that
supports at least one real dtype on CPU, except the `jiterator_*` entries (CUDA-only test fixtures,
not torch ops). Entries that stay eager are on `EAGER`, each with its reason; every other entry
must be fused in every dtype tested (`DTYPES`, where the entry supports it).

An entry that promotes a bool input to a float, as it does an int64 one (sin, exp, true division, the
special functions, ...), is not run on bool: the kernel casts the integral input to the float and
runs the float op, the path its int64 case runs (the bool load is every other bool case's, its cast
to a float test_ops.py's test_to_dtype[bool-*]'s); where bool keeps its own dtype (logical,
bitwise, comparisons, min/max, ...) it runs.

Each test takes the entry's own `sample_inputs` (the first `N_SAMPLES` with real arguments), puts
the op after an exact identity (-(-x), or ~~x for bool) so that it sits in a chain, fuses all the
samples in one graph, and compares with eager under OpInfo's tolerance for that dtype (its
`toleranceOverride`s) or tests/tolerances.py's, whichever is wider, NaNs where eager has them.
"""
import pytest
import torch
import torch.testing._internal.common_utils
import torch.testing._internal.opinfo.core
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo
from torch.testing._internal.common_device_type import toleranceOverride
from torch.utils._pytree import tree_flatten, tree_unflatten

import fuser
from conftest import DEVICE
from tolerances import tol

# OpInfo looks for the unittest.TestCase running it (to tag failures with the sample) by walking the whole
# stack with inspect.stack(), which reads every frame's source: ~250 ms a sample_inputs call, a third of
# this file's time.  These are pytest functions: the walk finds nothing.
for _module in (torch.testing._internal.common_utils, torch.testing._internal.opinfo.core):
    _module.extract_test_fn = lambda: None

# float16 is left out for time: it takes bfloat16's path (held in fp32, rounded once at the store)
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]
N_SAMPLES = 3
MIN_FUSED = 165

# entry -> why it stays eager
EAGER = {
    "complex": "complex result", "polar": "complex result",
    "cfloat": "complex result", "cdouble": "complex result", "chalf": "complex result",
    "frexp": "two results (mantissa, exponent): a region's op has one",
    "igamma": "regularized incomplete gamma: no lowering written yet",
    "igammac": "regularized incomplete gamma: no lowering written yet",
    "special.airy_ai": "Airy Ai: no lowering written yet",
    **{f"special.{p}_polynomial_{k}": "orthogonal polynomial of data-dependent degree: no lowering written yet"
       for p, ks in (("chebyshev", "tuvw"), ("shifted_chebyshev", "tuvw"), ("hermite", ("h", "he")),
                     ("laguerre", "l"), ("legendre", "p")) for k in ks},
}

# (entry, dtype) -> why it stays eager in that dtype only
EAGER_IN = {("nextafter", dt): "its step is the 16-bit format's: fp32 compute would round it away"
            for dt in (torch.float16, torch.bfloat16)}

# (entry, dtype) -> tolerance where eager is the less accurate side: on CUDA, eager's fp64 Bessel
# functions (Cephes) are off by up to ~1e-6 absolute, libdevice's by ~1e-14 (checked against mpmath)
LOOSER = {} if DEVICE == "cpu" else {
    (f"special.bessel_{f}", torch.float64): dict(atol=2e-6, rtol=1e-4) for f in ("j0", "j1", "y0", "y1")}


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


REAL = set(DTYPES) | {torch.float16, torch.int32}
ENTRIES = {_name(op): op for op in op_db
           if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)) and not op.name.startswith("jiterator")
           and op.supported_dtypes("cpu") & REAL}
CASES = [pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}")
         for name, op in ENTRIES.items() for dt in DTYPES if dt in op.supported_dtypes(DEVICE)]


# torch.testing.assert_close's defaults, which OpInfo's tests hold ops to (rtol, atol)
TORCH_DEFAULT = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                 torch.float64: (1e-7, 1e-7)}


def _tolerance(op, in_dtype, out_dtype) -> dict:
    """For a float result: the widest of tests/tolerances.py's, assert_close's default (what OpInfo's
    own tests use) and the op's toleranceOverrides for its input dtype.  Ints and bools: exact."""
    if out_dtype.is_complex:  # the allowlisted complex casts: compared as their real parts are
        out_dtype = out_dtype.to_real()
    t = tol(out_dtype)
    if not out_dtype.is_floating_point:
        return t
    rtol, atol = TORCH_DEFAULT[out_dtype]
    t = dict(atol=max(t["atol"], atol), rtol=max(t["rtol"], rtol))
    for info in op.decorators:
        for d in getattr(info, "decorators", [info]):
            if isinstance(d, toleranceOverride) and in_dtype in d.d:
                t = dict(atol=max(t["atol"], d.d[in_dtype].atol), rtol=max(t["rtol"], d.d[in_dtype].rtol))
    return t


def _real(x) -> bool:
    return not (isinstance(x, complex) or isinstance(x, torch.Tensor) and x.is_complex())


def _samples(op, dtype) -> list:
    out = []
    for s in op.sample_inputs(DEVICE, dtype):
        leaves, _ = tree_flatten((s.input, s.args, s.kwargs))
        if not isinstance(s.input, torch.Tensor) or not all(_real(v) for v in leaves):
            continue
        try:
            op.op(s.input, *s.args, **s.kwargs)
        except Exception:
            continue  # eager refuses this sample (e.g. integer division by zero): nothing to compare
        out.append(s)
        if len(out) == N_SAMPLES:
            break
    return out


def _same(x):
    """An exact identity that is an op (so the op under test sits in a chain)."""
    return ~~x if x.dtype == torch.bool else -(-x)


def _program(op, samples):
    """fn(*tensors) running op on every sample; the tensors it takes."""
    structs = [tree_flatten((s.input, s.args, s.kwargs)) for s in samples]
    tensors = [v for leaves, _ in structs for v in leaves if isinstance(v, torch.Tensor)]

    def fn(*flat):
        it, outs = iter(flat), []
        for leaves, spec in structs:
            x, args, kwargs = tree_unflatten([next(it) if isinstance(v, torch.Tensor) else v for v in leaves], spec)
            outs.append(op.op(_same(x), *args, **kwargs))
        return outs
    return fn, tensors


def _promotes_to_float(op, sample) -> bool:
    """Whether eager's result for this (integral) sample is a float: the op casts its input up."""
    out = op.op(sample.input, *sample.args, **sample.kwargs)
    return all(o.dtype.is_floating_point for o in (out if isinstance(out, (tuple, list)) else [out]))


def _all_fused(report) -> bool:
    """Every op has a lowering and the graph ran fused: the only ops left eager are ones the
    partitioner chose to leave alone (a lone cast of a broadcast operand, k = 1)."""
    return (bool(report.regions) and not report.all_fallbacks
            and all(u.reason.startswith("alone") for u in report.unfused))


def _compare(got, want, op, dtype):
    for g, w in zip(got, want, strict=True):
        for gi, wi in zip(*(x if isinstance(x, (tuple, list)) else [x] for x in (g, w)), strict=True):
            t = LOOSER.get((_name(op), dtype)) or _tolerance(op, dtype, wi.dtype)
            torch.testing.assert_close(gi, wi, equal_nan=True, **t)


@pytest.mark.parametrize("name,dtype", CASES)
def test_opinfo(name, dtype):
    op = ENTRIES[name]
    samples = _samples(op, dtype)
    if not samples:
        pytest.skip("no real sample inputs")
    if dtype == torch.bool and torch.int64 in op.supported_dtypes(DEVICE) and _promotes_to_float(op, samples[0]):
        pytest.skip("bool promoted to a float, as int64 is: the int64 case runs that path")
    fn, tensors = _program(op, samples)
    fused = fuser.fuse(fn)
    got, want = fused(*tensors), fn(*tensors)
    _compare(got, want, op, dtype)
    if name in EAGER or (name, dtype) in EAGER_IN:
        assert not _all_fused(fused.report), f"{name} is on EAGER ({EAGER.get(name)}) but fused: take it off"
    else:
        assert _all_fused(fused.report), f"{name} ({dtype}) is not fused:\n{fused.report}"


def test_opinfo_count():
    """The denominator and the fused count (test_opinfo holds every entry off EAGER to it)."""
    assert set(EAGER) <= set(ENTRIES), set(EAGER) - set(ENTRIES)
    fused = len(ENTRIES) - len(EAGER)
    print(f"OpInfo unary/binary ufuncs fused: {fused} of {len(ENTRIES)}")
    assert fused >= MIN_FUSED


# ----------------------------------------------------------------------------- fixed semantics


def _check(fn, *inputs):
    fused = fuser.fuse(fn)
    got, want = fused(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want, equal_nan=True, **tol(want.dtype))
    assert _all_fused(fused.report), fused.report
    return got


SPECIAL = [0.0, -0.0, 1.5, -2.0, float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sign_sgn_nan(device, dtype):
    x = torch.tensor(SPECIAL, dtype=dtype, device=device)
    got = _check(lambda x: torch.sign(-(-x)), x)
    assert got[4] == 0  # sign(NaN) is 0
    _check(lambda x: torch.sgn(-(-x)), x)
    _check(lambda x: torch.signbit(-(-x)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fn", [torch.logical_and, torch.logical_or, torch.logical_xor])
def test_logical_binary(device, dtype, fn):
    if dtype == torch.bool:
        x = torch.tensor([True, False, True, False], device=device)
        y = torch.tensor([True, True, False, False], device=device)
        _check(lambda x, y: fn(~~x, y), x, y)
        _check(lambda x: fn(~~x, torch.tensor(True, device=device)), x)
        return
    x = torch.tensor(SPECIAL if dtype.is_floating_point else [0, 1, -2, 3, 0, 5, 0], dtype=dtype, device=device)
    y = torch.flip(x, [0])
    _check(lambda x, y: fn(-(-x), y), x, y)
    _check(lambda x, s: fn(-(-x), s), x, y[3])  # a 0-d operand: a scalar inside the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_logical_not(device, dtype):
    x = torch.tensor(SPECIAL, device=device).to(dtype) if dtype != torch.bool else torch.tensor([True, False], device=device)
    _check(lambda x: torch.logical_not(_same(x)), x)
