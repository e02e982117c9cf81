"""Per-dtype tolerances for holding fused kernels to eager PyTorch (defined once, used by every op test).

How the two sides compute:
  * eager runs one kernel per op and rounds to the tensor dtype after *every* op;
  * a fused kernel loads 16-bit floats, computes the whole chain in fp32 and rounds *once* at the store.
So for fp16/bf16 the fused result is the more accurate one, and the gap to eager is eager's own
accumulated rounding: about one half-ulp per op in the chain (propagated through the ops after it),
plus the final rounding of the fused result.  The tolerances allow a chain of ~3-4 ops:

  dtype     ulp at 1.0   atol     rtol     why
  float32   1.2e-7       1e-5     1e-5     both sides fp32; differences come from reordered sums
                                           (tree vs sequential, sqrt(n)*eps growth over rows up to
                                           40000), and from Triton's transcendentals (ex2.approx,
                                           div.full, libdevice vs. SLEEF / numpy in the interpreter:
                                           a few ulp, amplified by e.g. exp's slope).  atol covers
                                           results near 0 (sums and differences that cancel).
  float16   9.8e-4       1e-3     2e-3     eager: k roundings of 2^-11 relative each; fused: one.
                                           rtol = 4 half-ulps; atol = 1 ulp at 1.0 for values near 0
                                           (sums/differences whose inputs were rounded by eager).
  bfloat16  7.8e-3       1e-2     1.6e-2   same argument with 8 mantissa bits (torch's default bf16
                                           rtol, ~4 half-ulps); atol ~1.3 ulp at 1.0.
  ints/bool exact        0        0        integer and boolean results must match bit for bit.

`tol(dtype, scale)` widens the float tolerances by `scale` for the few ops that amplify an input's
rounding error (pow with large exponents, tan near its poles, long cancelling chains): such a test
passes `scale` explicitly and says why.
"""
import torch

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.int8: dict(atol=0, rtol=0),
    torch.uint8: dict(atol=0, rtol=0),
    torch.int16: dict(atol=0, rtol=0),
    torch.int32: dict(atol=0, rtol=0),
    torch.int64: dict(atol=0, rtol=0),
    torch.bool: dict(atol=0, rtol=0),
}


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """atol/rtol for comparing a fused result of `dtype` with eager (float tolerances times `scale`)."""
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)


def assert_close_to_eager(got, want, scale: float = 1.0, **kw):
    """torch.testing.assert_close over (nested) outputs, with the tolerance of each output's dtype.

    Dtypes must match exactly (the fused kernel must produce eager's result dtype); NaNs must sit
    where eager has them.
    """
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), (type(got), type(want))
        for g, w in zip(got, want):
            assert_close_to_eager(g, w, scale, **kw)
        return
    assert isinstance(got, torch.Tensor), type(got)
    opts = dict(equal_nan=True, **tol(want.dtype, scale))
    opts.update(kw)
    torch.testing.assert_close(got, want, **opts)
