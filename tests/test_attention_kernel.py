"""fuser.codegen.attention against eager attention computed in float64.

Tolerances (kernel output vs the float64 reference; the kernel accumulates in fp32):
  float32   atol = rtol = 2e-5   fp32 scores (no tf32: the kernel asks for IEEE dots), fp32 output
  float16   atol = rtol = 5e-3   P is rounded to fp16 before P@V, output rounded to fp16 (2^-11 relative)
  bfloat16  atol = rtol = 3e-2   same with 8 mantissa bits; CUDA only: the interpreter's bf16 tl.dot is wrong
  lse       atol = rtol = 1e-4   fp32 logsumexp, any input dtype

Runs on the Triton interpreter on CPU; FUSER_TEST_DEVICE=cuda (with a GPU) runs the compiled kernels instead.
"""
import os

import pytest
import torch

from fuser.attention import flash_attention
from fuser.codegen.attention import ScoreMod, attention_source, list_launches
from fuser.dropout import dropout as fuser_dropout
from fuser.runtime import load, run_kernels

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("FUSER_TEST_DEVICE") == "cuda" else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fuser-cache"))


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def qkv(B, Hq, Hkv, M, N, D, dtype=torch.float32):
    return rand(B, Hq, M, D, dtype=dtype), rand(B, Hkv, N, D, dtype=dtype), rand(B, Hkv, N, D, dtype=dtype)


def reference(q, k, v, scale, mod=None, causal=False, offset=0, window=None, dropout=0.0, seed=None):
    """Eager attention in float64: ``mod(s, q_idx, k_idx)`` sees the scaled scores, as the kernel's lines do;
    dropout on the probabilities is fuser::dropout's, whose mask the kernel must draw too."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    M, N = s.shape[-2:]
    q_idx = torch.arange(M, device=q.device)[:, None]
    k_idx = torch.arange(N, device=q.device)[None, :]
    if mod is not None:
        s = mod(s, q_idx, k_idx)
    if causal:
        s = s.masked_fill(k_idx > q_idx + offset, NEG_INF)
    if window is not None:
        s = s.masked_fill(q_idx + offset - k_idx >= window, NEG_INF)
    p = torch.softmax(s, -1)
    if dropout:
        p = fuser_dropout(p, dropout, seed=seed)
    return p @ v, torch.logsumexp(s, -1)


def check(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


def check_lse(lse, ref_lse):
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 40, 64, 256])
@pytest.mark.parametrize("M,N", [(37, 37), (50, 50), (29, 64), (50, 23)])
def test_plain(dtype, D, M, N):
    torch.manual_seed(0)
    q, k, v = qkv(1, 2, 2, M, N, D, dtype)
    out, lse = flash_attention(q, k, v, scale=D ** -0.5, return_lse=True)
    ref, ref_lse = reference(q, k, v, D ** -0.5)
    check(out, ref, dtype)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv", [2, 1])
def test_gqa(dtype, Hkv):
    torch.manual_seed(1)
    q, k, v = qkv(2, 4, Hkv, 37, 45, 32, dtype)
    check(flash_attention(q, k, v, scale=0.2), reference(q, k, v, 0.2)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype):
    """(B, T, H, D) activations and a packed (B, T, 3, H, D) qkv, read through permuted views without a copy."""
    torch.manual_seed(2)
    B, T, H, D = 2, 37, 3, 24
    q = rand(B, T, H, D, dtype=dtype).permute(0, 2, 1, 3)
    packed = rand(B, T + 4, 3, H, D, dtype=dtype)[:, 2:-2]
    k, v = packed[:, :, 1].permute(0, 2, 1, 3), packed[:, :, 2].permute(0, 2, 1, 3)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check(flash_attention(q, k, v, scale=D ** -0.5), reference(q, k, v, D ** -0.5)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,offset", [(37, 37, 0), (50, 50, 0), (20, 45, 25), (45, 20, 0), (45, 20, -25)])
def test_causal(dtype, M, N, offset):
    """Top-left (0) and bottom-right (N - M) alignment; a negative offset leaves whole rows masked: NaN, as eager."""
    torch.manual_seed(3)
    q, k, v = qkv(1, 4, 2, M, N, 40, dtype)
    out, lse = flash_attention(q, k, v, scale=0.15, mod=ScoreMod((), causal=True, causal_offset=offset), return_lse=True)
    ref, ref_lse = reference(q, k, v, 0.15, causal=True, offset=offset)
    assert ref.isnan().any() == (offset < 0)
    check(out, ref, dtype)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_as_score_mod(dtype):
    """The recogniser's fallback when it cannot prove the structure: the mask as a line, every tile visited."""
    torch.manual_seed(4)
    q, k, v = qkv(2, 2, 1, 37, 37, 32, dtype)
    mod = ScoreMod(('s = tl.where(k_idx <= q_idx, s, float("-inf"))',))
    out = flash_attention(q, k, v, scale=0.2, mod=mod)
    check(out, reference(q, k, v, 0.2, causal=True)[0], dtype)
    structural = flash_attention(q, k, v, scale=0.2, mod=ScoreMod((), causal=True))
    torch.testing.assert_close(out, structural, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bool_mask_extra(dtype):
    """A [B, 1, M, N] bool mask read in place, with some rows masked entirely: NaN there, as eager gives."""
    torch.manual_seed(5)
    B, H, M, N = 2, 2, 37, 41
    q, k, v = qkv(B, H, H, M, N, 16, dtype)
    mask = torch.rand(B, 1, M, N, device=DEVICE) > 0.3
    mask[0, 0, 3] = False
    mask[1, 0, 30:] = False
    mod = ScoreMod(('s = tl.where(extra0, s, float("-inf"))',), n_extra=1)
    out = flash_attention(q, k, v, scale=0.25, mod=mod, extras=(mask,))
    ref = reference(q, k, v, 0.25, mod=lambda s, qi, ki: s.masked_fill(~mask, NEG_INF))[0]
    assert ref[0, :, 3].isnan().all() and ref[1, :, 30:].isnan().all() and not ref[0, :, 4].isnan().any()
    check(out, ref, dtype)


def test_key_padding_mask_broadcast():
    """A [B, N] key-padding mask viewed as [B, 1, 1, N]: stride 0 over heads and queries."""
    torch.manual_seed(6)
    B, H, M, N = 3, 2, 29, 29
    q, k, v = qkv(B, H, H, M, N, 32)
    lengths = torch.tensor([29, 17, 5], device=DEVICE)
    keep = torch.arange(N, device=DEVICE)[None, :] < lengths[:, None]
    mod = ScoreMod(('s = tl.where(extra0, s, float("-inf"))',), n_extra=1)
    out = flash_attention(q, k, v, scale=0.2, mod=mod, extras=(keep[:, None, None, :],))
    ref = reference(q, k, v, 0.2, mod=lambda s, qi, ki: s.masked_fill(~keep[:, None, None, :], NEG_INF))[0]
    check(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_finfo_min_mask(dtype):
    """BERT's (1 - mask) * finfo(dtype).min: a sample with every key masked gets eager's uniform average over keys."""
    torch.manual_seed(7)
    B, H, M, N = 3, 2, 21, 37
    q, k, v = qkv(B, H, H, M, N, 32, dtype)
    keep = (torch.arange(N, device=DEVICE)[None, :] < torch.tensor([37, 12, 0], device=DEVICE)[:, None])
    bias = ((1.0 - keep.to(dtype)) * torch.finfo(dtype).min)[:, None, None, :]
    if dtype == torch.float32:
        mod, ref_mod = ("s = s + extra0",), lambda s, qi, ki: s + bias
    else:  # eager adds in the 16-bit dtype; keeping that rounding keeps its fully masked rows (module docstring)
        tl_dtype = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}[dtype]
        mod = (f"s = (s.to({tl_dtype}) + extra0).to(tl.float32)",)
        ref_mod = lambda s, qi, ki: (s.to(dtype) + bias).double()  # noqa: E731
    out = flash_attention(q, k, v, scale=0.2, mod=ScoreMod(mod, n_extra=1), extras=(bias,))
    ref = reference(q, k, v, 0.2, mod=ref_mod)[0]
    uniform = v[2].double().mean(1, keepdim=True).expand(H, M, 32)
    torch.testing.assert_close(ref[2], uniform)
    check(out, ref, dtype)


def alibi_slopes(H):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=DEVICE, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_bias_extra(dtype):
    """ALiBi as a materialised [1, H, M, N] fp32 bias, broadcast over the batch, with the causal structure."""
    torch.manual_seed(8)
    B, H, M, N = 2, 4, 37, 37
    q, k, v = qkv(B, H, H, M, N, 16, dtype)
    rel = (torch.arange(N, device=DEVICE)[None, :] - torch.arange(M, device=DEVICE)[:, None]).double()
    bias = (alibi_slopes(H)[:, None, None] * rel)[None].float()
    mod = ScoreMod(("s = s + extra0",), n_extra=1, causal=True)
    out = flash_attention(q, k, v, scale=0.25, mod=mod, extras=(bias,))
    check(out, reference(q, k, v, 0.25, mod=lambda s, qi, ki: s + bias.double(), causal=True)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_in_kernel(dtype):
    """ALiBi computed from h_idx, q_idx, k_idx: no bias tensor read at all."""
    torch.manual_seed(9)
    B, H, M, N = 2, 4, 37, 37
    q, k, v = qkv(B, H, H, M, N, 16, dtype)
    mod = ScoreMod((
        f"slope = tl.exp2(-8.0 * (h_idx + 1).to(tl.float32) / {H})",
        "s = s + slope * (k_idx - q_idx).to(tl.float32)",
    ), causal=True)
    out = flash_attention(q, k, v, scale=0.25, mod=mod)
    ref_mod = lambda s, qi, ki: s + alibi_slopes(H)[:, None, None] * (ki - qi)  # noqa: E731
    check(out, reference(q, k, v, 0.25, mod=ref_mod, causal=True)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_softcap(dtype):
    """Gemma-2 style cap * tanh(s / cap), tanh via tl.exp (libdevice is unavailable in the interpreter)."""
    torch.manual_seed(10)
    q, k, v = qkv(2, 2, 1, 37, 37, 32, dtype)
    q = q * 4  # scores well past the cap
    cap = 5.0
    mod = ScoreMod((f"s = {cap} * (1.0 - 2.0 / (tl.exp(2.0 * s / {cap}) + 1.0))",), causal=True)
    out = flash_attention(q, k, v, scale=32 ** -0.5, mod=mod)
    ref = reference(q, k, v, 32 ** -0.5, mod=lambda s, qi, ki: cap * torch.tanh(s / cap), causal=True)[0]
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,M,N,offset,window", [
    (True, 50, 50, 0, 8), (True, 20, 45, 25, 13), (False, 37, 37, 0, 5), (True, 37, 37, 0, 1)])
def test_sliding_window(dtype, causal, M, N, offset, window):
    torch.manual_seed(11)
    q, k, v = qkv(1, 4, 2, M, N, 24, dtype)
    mod = ScoreMod((), causal=causal, causal_offset=offset, window=window)
    out = flash_attention(q, k, v, scale=0.2, mod=mod)
    check(out, reference(q, k, v, 0.2, causal=causal, offset=offset, window=window)[0], dtype)


def test_masked_tiles_are_skipped():
    """K/V rows that no query of a block may see are never loaded: NaN planted there does not reach the output.

    (Had they been loaded, 0 * NaN in P@V would poison the rows.)  Assumes BLOCK_M, BLOCK_N <= 128, true of every
    configuration the module picks.
    """
    torch.manual_seed(12)
    q, k, v = qkv(1, 2, 2, 16, 272, 32)
    ref = reference(q, k, v, 0.2, causal=True)[0]
    k[:, :, 128:], v[:, :, 128:] = float("nan"), float("nan")
    check(flash_attention(q, k, v, scale=0.2, mod=ScoreMod((), causal=True)), ref, torch.float32)

    q, k, v = qkv(1, 2, 2, 272, 272, 32)
    ref = reference(q, k, v, 0.2, causal=True, window=8)[0]
    k[:, :, :128], v[:, :, :128] = float("nan"), float("nan")
    out = flash_attention(q, k, v, scale=0.2, mod=ScoreMod((), causal=True, window=8))
    check(out[:, :, 256:], ref[:, :, 256:], torch.float32)


def test_generated_source_is_cached_and_readable(tmp_path, monkeypatch):
    import inspect

    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    mod = ScoreMod(("s = s + extra0",), n_extra=1, causal=True, causal_offset=3, window=16)
    src = attention_source(mod, 40, torch.float16)
    assert "HBM bytes" in src and "s = s + extra0" in src and "k_idx <= q_idx + 3" in src
    assert src == attention_source(mod, 40, torch.float16)
    torch.manual_seed(13)
    q, k, v = qkv(1, 1, 1, 5, 8, 40, torch.float16)
    bias = rand(1, 1, 5, 8)
    flash_attention(q, k, v, scale=1.0, mod=mod, extras=(bias,))
    files = list(tmp_path.rglob("*.py"))
    assert len(files) == 1 and files[0].read_text() == src
    fn = load(src, "attention_fwd", "cpu")
    assert fn is load(src, "attention_fwd", "cpu")
    assert "def attention_fwd" in inspect.getsource(getattr(fn, "fn", fn))


def test_lse_of_masked_rows_is_minus_inf():
    torch.manual_seed(14)
    q, k, v = qkv(1, 1, 1, 20, 10, 16)
    _, lse = flash_attention(q, k, v, scale=0.3, mod=ScoreMod((), causal=True, causal_offset=-12), return_lse=True)
    assert torch.isneginf(lse[0, 0, :12]).all() and torch.isfinite(lse[0, 0, 12:]).all()
    check_lse(lse, reference(q, k, v, 0.3, causal=True, offset=-12)[1])


def test_wrong_number_of_extras():
    q, k, v = qkv(1, 1, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="extra"):
        flash_attention(q, k, v, scale=1.0, mod=ScoreMod(("s = s + extra0",), n_extra=1))


def _grads(fn, w, *xs):
    """Gradients of sum(fn(*xs) * w): a random w, so every output element counts."""
    return _output_and_grads(fn, w, *xs)[1]


def _output_and_grads(fn, w, *xs):
    """fn(*xs) and the gradients of sum(fn(*xs) * w), from one call (the forward kernel is the one a call
    without gradients runs: in the interpreter a second forward only costs time)."""
    xs = [x.detach().requires_grad_() for x in xs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad((out * w.to(out.dtype)).sum(), xs)


BWD_CASES = {  # name: (B, Hq, Hkv, M, N, D, ScoreMod, reference mod, reference causal/offset/window)
    "plain, odd sizes, D padded": (2, 3, 3, 37, 45, 24, ScoreMod(()), None, {}),
    "causal, prefill offset": (1, 2, 2, 20, 45, 16, ScoreMod((), causal=True, causal_offset=25), None,
                               dict(causal=True, offset=25)),
    "window": (1, 2, 2, 50, 50, 16, ScoreMod((), causal=True, window=9), None, dict(causal=True, window=9)),
    "wide window, whole tiles inside it": (1, 2, 2, 70, 70, 16, ScoreMod((), causal=True, window=40), None,
                                           dict(causal=True, window=40)),
    "GQA 4/2, causal": (2, 4, 2, 33, 33, 16, ScoreMod((), causal=True), None, dict(causal=True)),
    "tanh soft-cap": (1, 2, 1, 37, 37, 32, ScoreMod(("s = 5.0 * (1.0 - 2.0 / (tl.exp(2.0 * s / 5.0) + 1.0))",),
                                                    causal=True, grad=("g = 1.0 - (s / 5.0) * (s / 5.0)",)),
                      lambda s, qi, ki: 5.0 * torch.tanh(s / 5.0), dict(causal=True)),
    "ALiBi in the kernel": (1, 4, 4, 29, 29, 16, ScoreMod(("s = s + tl.exp2(-8.0 * (h_idx + 1).to(tl.float32) / 4)"
                                                           " * (k_idx - q_idx).to(tl.float32)",),
                                                          causal=True, grad=("g = 1.0",)),
                            lambda s, qi, ki: s + alibi_slopes(4)[:, None, None] * (ki - qi), dict(causal=True)),
}


# gradients against fp64, relative to the largest: in 16 bits P and dS are rounded before their dots
BWD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(BWD_CASES))
def test_backward_matches_eager_fp64(case, dtype):
    """dQ, dK, dV of the backward kernels (scores recomputed from Q, K and the LSE, never stored)
    against autograd through the float64 reference: odd lengths, a padded head dim, structural masks,
    GQA (dK, dV summed over the query heads of a K/V head) and score mods with their gradient."""
    torch.manual_seed(20)
    B, Hq, Hkv, M, N, D, mod, ref_mod, structure = BWD_CASES[case]
    q, k, v = qkv(B, Hq, Hkv, M, N, D, dtype)
    q = q * 2  # scores past the soft-cap
    w = rand(B, Hq, M, D)
    got = _grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod), w, q, k, v)
    want = _grads(lambda q, k, v: reference(q, k, v, 0.3, mod=ref_mod, **structure)[0], w, q.double(), k.double(),
                  v.double())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        tol = BWD_TOL[dtype] * w.abs().max().item()
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Dv,Hkv,causal", [(48, 32, 2, True), (24, 40, 1, False), (40, 40, 4, True), (192, 128, 2, True),
                                             (256, 256, 1, False)])
def test_v_head_dim_of_its_own_forward_and_backward(dtype, D, Dv, Hkv, causal):
    """MLA (DeepSeek-V2/V3: Q and K at 192, V at 128): V's head dim is its own, the output's is V's; padded
    dims on either side, GQA, a score mod, odd lengths; the forward's LSE and the three gradients."""
    torch.manual_seed(21)
    B, Hq, M, N = 2, 4, 37, 45
    q, k = rand(B, Hq, M, D, dtype=dtype), rand(B, Hkv, N, D, dtype=dtype)
    v = rand(B, Hkv, N, Dv, dtype=dtype)
    mod = ScoreMod(("s = 5.0 * (1.0 - 2.0 / (tl.exp(2.0 * s / 5.0) + 1.0))",), causal=causal, causal_offset=N - M,
                   grad=("g = 1.0 - (s / 5.0) * (s / 5.0)",))
    ref_mod = lambda s, qi, ki: 5.0 * torch.tanh(s / 5.0)  # noqa: E731
    structure = dict(causal=causal, offset=N - M)
    w = rand(B, Hq, M, Dv)
    out, got = _output_and_grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod), w, q, k, v)
    ref_out, want = _output_and_grads(lambda q, k, v: reference(q, k, v, 0.3, mod=ref_mod, **structure)[0], w,
                                      q.double(), k.double(), v.double())
    assert out.shape == (B, Hq, M, Dv)
    check(out, ref_out, dtype)
    with torch.no_grad():
        check_lse(flash_attention(q, k, v, scale=0.3, mod=mod, return_lse=True)[1],
                  reference(q, k, v, 0.3, mod=ref_mod, **structure)[1])
    for g, x, r in zip(got, (q, k, v), want):
        assert g.dtype == dtype and g.shape == x.shape
        tol = BWD_TOL[dtype] * r.abs().max().item()
        torch.testing.assert_close(g.double(), r, atol=tol, rtol=BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_of_rows_a_finite_fill_masks_whole(dtype):
    """Left padding under a causal mask, as Hugging Face builds it (finfo.min added to the scores): a pad
    query sees no key at all, and eager's probabilities there are uniform (every score rounds to the same
    fill), so its gradients are too.  The backward recomputes P from the row maximum and the log of the row
    sum kept apart; from their sum, the log-sum-exp (-3.4e38 + log N rounds to -3.4e38), P would be 1."""
    torch.manual_seed(21)
    B, H, M, D = 2, 2, 29, 16
    q, k, v = qkv(B, H, H, M, M, D, dtype)
    pos = torch.arange(M, device=DEVICE)
    pad = torch.tensor([0, 7], device=DEVICE)[:, None, None]
    masked = (pos[None, None, :] < pad) | (pos[None, None, :] > pos[None, :, None])  # [B, M, N]
    bias = (masked.float() * torch.finfo(torch.float32).min)[:, None]
    w = rand(B, H, M, D)
    mod = ScoreMod(("s = s + extra0",), n_extra=1, grad=("g = 1.0",))
    got = _grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod, extras=(bias,)), w, q, k, v)
    want = _grads(lambda q, k, v: reference(q, k, v, 0.3, mod=lambda s, qi, ki: s + bias.double())[0], w,
                  q.double(), k.double(), v.double())
    assert want[0][1, :, :7].abs().amax() > 0.1  # the pad rows' own gradient is not zero in eager
    for g, w in zip(got, want):
        tol = BWD_TOL[dtype] * w.abs().max().item()
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dropout_on_the_probabilities(dtype, p):
    """Dropout inside the kernel draws fuser::dropout's mask for the [B, Hq, M, N] probabilities (the same
    Philox counters), in the forward and again in the backward: output and gradients equal fp64 attention
    with fuser::dropout applied to its probabilities.  GQA, causal, odd sizes, a padded head dim; p = 1
    drops everything (zeros, as eager).  Another seed gives another mask.  21 queries and keys: on CPU (16 x 16
    tiles) two tiles each way, the second partial, so the counters are offset by tile in both; the interpreter's
    Philox draws per element made 37 three times the cost."""
    torch.manual_seed(22)
    q, k, v = qkv(2, 4, 2, 21, 21, 24, dtype)
    seed = torch.tensor(1234567, dtype=torch.int64, device=DEVICE)
    mod, structure = ScoreMod((), causal=True), dict(causal=True)
    w = rand(2, 4, 21, 24)
    run = lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod, dropout=p, seed=seed)  # noqa: E731
    ref = lambda q, k, v: reference(q, k, v, 0.3, dropout=p, seed=seed, **structure)[0]  # noqa: E731
    out, got = _output_and_grads(run, w, q, k, v)
    check(out, ref(q, k, v), dtype)
    want = _grads(ref, w, q.double(), k.double(), v.double())
    for g, w_ in zip(got, want):
        tol = BWD_TOL[dtype] * w_.abs().max().item()
        torch.testing.assert_close(g.double(), w_, atol=tol, rtol=BWD_TOL[dtype])
    if p < 1:
        other = flash_attention(q, k, v, scale=0.3, mod=mod, dropout=p, seed=seed + 1)
        assert (other.double() - out.double()).abs().max() > 0.1


def block_lists(mask, kind, M, N, block_m, block_n, by_keys=False):
    """The data mask's tile lists, as the kernels get them (`list_launches` run first)."""
    e = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    lists, launches = list_launches(mask, kind, e.shape[0], e.shape[1], M, N, block_m, block_n, by_keys)
    run_kernels(launches, DEVICE)
    return lists[-1].cpu()


def _listed(blocks, row, which):
    """The tile indices on list `which` (0: kept whole, 1: kept in part) of one row of `block_lists`, its runs
    (first tile, one past the last) expanded; runs are ascending, apart and not empty."""
    runs = blocks[row][which]
    pairs = [(runs[1 + 2 * r].item(), runs[2 + 2 * r].item()) for r in range(runs[0].item())]
    assert all(a < b for a, b in pairs) and all(b < a for (_, b), (a, _) in zip(pairs, pairs[1:])), pairs
    return [t for a, b in pairs for t in range(a, b)]


def test_data_mask_tile_lists():
    """A causal mask held as data, 64 x 64 in 16 x 16 tiles: query block m keeps key tiles 0..m-1 whole, the
    diagonal in part and skips the rest; by keys (dK/dV), key block n is seen whole by query blocks past n.
    A query block holding a row the mask hides whole (left padding) skips nothing: eager's row is uniform.
    Tiles past M or N are never kept whole.  A key padding mask broadcasts over heads and rows."""
    pos = torch.arange(64, device=DEVICE)
    causal = (pos[None, :] > pos[:, None]).float() * torch.finfo(torch.float32).min
    blocks = block_lists(causal, "add", 64, 64, 16, 16)[0, 0]
    by_keys = block_lists(causal, "add", 64, 64, 16, 16, by_keys=True)[0, 0]
    for t in range(4):
        assert _listed(blocks, t, 0) == list(range(t)) and _listed(blocks, t, 1) == [t]
        assert _listed(by_keys, t, 0) == list(range(t + 1, 4)) and _listed(by_keys, t, 1) == [t]
    padded = causal.clone()
    padded[:, :20] = torch.finfo(torch.float32).min  # rows 0..19 see no key
    blocks = block_lists(padded, "add", 64, 64, 16, 16)[0, 0]
    assert _listed(blocks, 0, 1) == _listed(blocks, 1, 1) == [0, 1, 2, 3]  # blocks with a hidden row skip nothing
    assert _listed(blocks, 2, 0) == [] and _listed(blocks, 2, 1) == [1, 2]  # keys 0..19 hidden: tile 0 skipped
    keep = torch.ones(2, 1, 1, 45, dtype=torch.bool, device=DEVICE)
    keep[1, ..., 30:] = False
    blocks = block_lists(keep, "keep", 37, 45, 16, 16)
    assert blocks.shape[:2] == (2, 1)
    assert _listed(blocks[0, 0], 0, 0) == [0, 1] and _listed(blocks[0, 0], 0, 1) == [2]  # tile 2 crosses N
    assert _listed(blocks[0, 0], 2, 0) == [] and _listed(blocks[0, 0], 2, 1) == [0, 1, 2]  # block 2 crosses M
    assert _listed(blocks[1, 0], 0, 0) == [0] and _listed(blocks[1, 0], 0, 1) == [1]  # keys 32.. skipped


def expected_lists(hidden, block_m, block_n, by_keys):
    """The lists `tile_lists` must give for one [M, N] boolean `hidden` (True: masked), worked out in Python:
    per outer block, the inner tiles kept whole (inside M and N, nothing masked) and those kept in part
    (something kept, or anything at all where the query block holds a row that keeps no key)."""
    M, N = hidden.shape
    tm, tn = -(-M // block_m), -(-N // block_n)
    lost = [bool(hidden[i * block_m:(i + 1) * block_m].all(1).any()) for i in range(tm)]
    lists = {}
    for mb in range(tm):
        for nb in range(tn):
            tile = hidden[mb * block_m:(mb + 1) * block_m, nb * block_n:(nb + 1) * block_n]
            inside = (mb + 1) * block_m <= M and (nb + 1) * block_n <= N
            cls = 0 if (inside and not tile.any()) else 1 if (not tile.all() or lost[mb]) else None
            outer, inner = (nb, mb) if by_keys else (mb, nb)
            lists.setdefault(outer, ([], []))
            if cls is not None:
                lists[outer][cls].append(inner)
    return lists


@pytest.mark.parametrize("seed", range(4))
def test_data_mask_tile_lists_random(seed):
    """Random masks (causal with padding, random holes, whole rows and key blocks hidden) at odd sizes: the
    lists per query block and per key block equal the Python reference's, as a boolean keep, boolean drop and
    additive mask."""
    g = torch.Generator().manual_seed(seed)
    M, N = (int(x) for x in torch.randint(20, 140, (2,), generator=g))
    block_m, block_n = [(16, 16), (32, 16), (16, 32), (64, 32)][seed]
    pos_q, pos_k = torch.arange(M)[:, None], torch.arange(N)[None, :]
    hidden = (pos_k > pos_q + int(torch.randint(0, N, (), generator=g))) | (pos_k < int(torch.randint(0, 30, (), generator=g)))
    hidden |= torch.rand(M, N, generator=g) < 0.02  # holes: partial tiles anywhere
    hidden[int(torch.randint(0, M, (), generator=g))] = True  # a row that keeps no key
    hidden[:, N // 2:N // 2 + 20] = True  # a band of keys hidden from every row
    masks = {"keep": ~hidden, "drop": hidden, "add": hidden.float() * torch.finfo(torch.float32).min}
    for by_keys in (False, True):
        want = expected_lists(hidden, block_m, block_n, by_keys)
        for kind, mask in masks.items():
            got = block_lists(mask.to(DEVICE), kind, M, N, block_m, block_n, by_keys)[0, 0]
            for outer, (whole, part) in want.items():
                assert (_listed(got, outer, 0), _listed(got, outer, 1)) == (whole, part), (kind, by_keys, outer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_splits_the_query_heads_of_a_kv_head_when_programs_are_few(dtype, monkeypatch):
    """MQA with few key blocks would leave most processors idle with a dK/dV program per K/V head: the query
    heads are then shared over several programs, their sums added atomically in fp32 (here forced: a GPU of
    many processors).  Gradients equal fp64 autograd's, causal, a padded head dim."""
    import fuser.codegen.attention_bwd as bwd
    monkeypatch.setattr(bwd, "_processors", lambda device: 10_000)
    assert bwd._split(4, 6, torch.device(DEVICE)) == 6 and bwd._split(40_000, 6, torch.device(DEVICE)) == 1
    torch.manual_seed(32)
    q, k, v = qkv(2, 6, 1, 37, 37, 24, dtype)
    w = rand(2, 6, 37, 24)
    mod = ScoreMod((), causal=True)
    got = _grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod), w, q, k, v)
    want = _grads(lambda q, k, v: reference(q, k, v, 0.3, causal=True)[0], w, q.double(), k.double(), v.double())
    for g, w_ in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w_, atol=BWD_TOL[dtype] * w_.abs().max().item(), rtol=BWD_TOL[dtype])


@pytest.mark.parametrize("case", ["plain, odd sizes, D padded", "window", "GQA 4/2, causal"])
def test_64_bit_offsets_forward_and_backward(case, monkeypatch):
    """Past 2**31 elements of offset (a [B, M, H, D] layout at half a million rows, a materialised [B, 1, M, N]
    mask at 46341 squared) the kernels index in 64 bits (WIDE): forced here on small tensors, the same
    gradients as fp64 autograd's.  `wide` itself is checked on a tensor of such strides (nothing allocated)."""
    import fuser.codegen.attention as fwd
    import fuser.codegen.attention_bwd as bwd
    huge = torch.empty(0, device="meta").as_strided((1, 1, 2, 2), (0, 0, 2**31, 1))
    assert fwd.wide(huge) and not fwd.wide(huge[:, :, :1])
    monkeypatch.setattr(fwd, "wide", lambda *ts: True)
    monkeypatch.setattr(bwd, "wide", lambda *ts: True)
    torch.manual_seed(34)
    B, Hq, Hkv, M, N, D, mod, ref_mod, structure = BWD_CASES[case]
    q, k, v = qkv(B, Hq, Hkv, M, N, D, torch.float32)
    w = rand(B, Hq, M, D)
    got = _output_and_grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod), w, q, k, v)
    want = _output_and_grads(lambda q, k, v: reference(q, k, v, 0.3, mod=ref_mod, **structure)[0], w, q.double(),
                             k.double(), v.double())
    for g, w_ in zip((got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(g.double(), w_, atol=BWD_TOL[torch.float32] * w_.abs().max().item(),
                                   rtol=BWD_TOL[torch.float32])


def test_backward_reads_the_output_gradient_in_its_own_layout():
    """dO arrives strided (the output transposed after the attention, as models do before their output
    projection) and Q, K, V are views of one packed projection: the gradients still equal fp64 autograd's, GQA
    summed on chip, a padded head dim, causal."""
    torch.manual_seed(31)
    B, Hq, Hkv, M, D = 2, 6, 2, 41, 24
    packed = rand(B, M, (Hq + 2 * Hkv) * D).view(B, M, Hq + 2 * Hkv, D).transpose(1, 2)
    q, k, v = packed[:, :Hq], packed[:, Hq:Hq + Hkv], packed[:, Hq + Hkv:]
    w = rand(B, M, Hq, D)
    mod = ScoreMod((), causal=True)
    got = _grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod).transpose(1, 2), w, q, k, v)
    want = _grads(lambda q, k, v: reference(q, k, v, 0.3, causal=True)[0].transpose(1, 2), w,
                  q.double(), k.double(), v.double())
    for g, w_ in zip(got, want):
        assert g.shape == w_.shape
        torch.testing.assert_close(g.double(), w_, atol=BWD_TOL[torch.float32] * w_.abs().max().item(),
                                   rtol=BWD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["add", "keep", "drop"])
def test_data_mask_skips_tiles_forward_and_backward(dtype, kind):
    """A mask held as data (causal with left padding, or a key padding mask), applied last: the kernels walk
    its tile lists.  Output and gradients match fp64 eager, fully hidden rows included (finite fills); NaN
    planted in keys no query may see never reaches them (their tiles are skipped, not loaded).  Sized to the
    tiles (fuser/plan.py): on CPU 16 x 16, so 75 rows (5 tiles, the last partial) and keys 48.. padded (a whole
    tile and the partial last one); the GPU's tiles are up to 128 wide.  On CPU fp16 runs with the additive mask
    alone: the lists (list_launches) and the mask's lines depend on the mask's kind, not on q's dtype, so fp32
    covers the three kinds and fp16 the 16-bit kernels walking the lists (the add: the one passing a gradient
    through hidden rows)."""
    if DEVICE != "cuda" and dtype != torch.float32 and kind != "add":
        pytest.skip("CPU: fp16 walks the same lists as fp32; [add-dtype1] runs it")
    torch.manual_seed(23)
    B, H, D = 2, 2, 16
    M, P = (150, 128) if DEVICE == "cuda" else (75, 48)
    q, k, v = qkv(B, H, H, M, M, D, dtype)
    pos = torch.arange(M, device=DEVICE)
    hidden = (pos[None, None, :] < torch.tensor([0, 20], device=DEVICE)[:, None, None]) | (pos[None, None, :] > pos[None, :, None])
    hidden[0, :, P:] = True  # sample 0: keys P.. padded away for every query: whole tiles
    hidden = hidden[:, None]
    fill = torch.finfo(torch.float32).min
    extra, lines, grad, ref_mod = {
        "add": (hidden.float() * fill, "s = s + extra0", "g = 1.0", lambda s, qi, ki: s + (hidden.double() * fill)),
        "keep": (~hidden, f"s = tl.where(extra0, s, {fill!r})", "g = tl.where(extra0, 1.0, 0.0)",
                 lambda s, qi, ki: s.masked_fill(hidden, fill)),
        "drop": (hidden, f"s = tl.where(extra0, {fill!r}, s)", "g = tl.where(extra0, 0.0, 1.0)",
                 lambda s, qi, ki: s.masked_fill(hidden, fill))}[kind]
    mod = ScoreMod((lines,), n_extra=1, grad=(grad,), data_mask=(0, kind, extra.dtype))
    k[0, :, P:], v[0, :, P:] = float("nan"), float("nan")
    w = rand(B, H, M, D)
    clean = lambda x: torch.where(torch.isnan(x), 0.0, x)  # noqa: E731  the reference never reads them either
    out, got = _output_and_grads(lambda q, k, v: flash_attention(q, k, v, scale=0.3, mod=mod, extras=(extra,)), w,
                                 q, k, v)
    check(out, reference(q, clean(k), clean(v), 0.3, mod=ref_mod)[0], dtype)
    want = _grads(lambda q, k, v: reference(q, clean(k), clean(v), 0.3, mod=ref_mod)[0], w, q.double(), k.double(),
                  v.double())
    # hidden rows pass a gradient to q through an add (not through masked_fill); hidden keys get none
    assert (want[0][1, :, :20].abs().amax() > 0.1) == (kind == "add") and (want[1][0, :, P:] == 0).all()
    for g, w_ in zip(got, want):
        tol = BWD_TOL[dtype] * w_.abs().max().item()
        torch.testing.assert_close(g.double(), w_, atol=tol, rtol=BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_learned_bias_gets_its_gradient(dtype):
    """A bias the mod names in `bias_grads` (d(final s)/d(bias) lines) gets its gradient from the dQ kernel,
    summed over the batch it broadcasts over, through soft-capping after it; GQA, odd sizes."""
    torch.manual_seed(33)
    q, k, v = qkv(3, 4, 2, 29, 37, 16, dtype)
    bias = rand(1, 4, 29, 37, dtype=dtype)
    mod = ScoreMod(("c0 = s + extra0.to(tl.float32)", "c1 = 8.0 * (1.0 - 2.0 / (tl.exp(2.0 * c0 / 8.0) + 1.0))", "s = c1"),
                   n_extra=1, grad=("g = 1.0 - (c1 / 8.0) * (c1 / 8.0)",),
                   bias_grads=((0, ("g0 = 1.0 - (c1 / 8.0) * (c1 / 8.0)",)),))
    w = rand(3, 4, 29, 16)
    got = _grads(lambda q, k, v, b: flash_attention(q, k, v, scale=0.3, mod=mod, extras=(b,)), w, q, k, v, bias)
    want = _grads(lambda q, k, v, b: reference(q, k, v, 0.3, mod=lambda s, qi, ki: 8.0 * torch.tanh((s + b) / 8.0))[0],
                  w, q.double(), k.double(), v.double(), bias.double())
    for g, w_ in zip(got, want):
        assert g.shape == w_.shape and g.dtype == dtype
        torch.testing.assert_close(g.double(), w_, atol=BWD_TOL[dtype] * w_.abs().max().item(), rtol=BWD_TOL[dtype])


def test_backward_refuses_what_it_cannot_differentiate():
    """A score mod without gradient lines, or an extra tensor asking for its gradient: an error naming
    it, never a silent zero."""
    from fuser.codegen.attention_bwd import NoGradient
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 16, 16, 16))
    out = flash_attention(q, k, v, scale=0.3, mod=ScoreMod(("s = s * s",)))
    with pytest.raises(NoGradient, match="no gradient"):
        out.sum().backward()
    bias = torch.randn(16, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(NotImplementedError, match="extra tensors"):
        flash_attention(q, k, v, scale=0.3, mod=ScoreMod(("s = s + extra0",), n_extra=1), extras=(bias,))


@pytest.mark.parametrize("path", ["structured", "flash", "cudnn"])
@pytest.mark.parametrize("groups", [1, 4])
def test_a_buffer_found_causal_at_run_time_runs_the_structured_or_sdpa_kernels(path, groups):
    """fuser::flash_attention at a call site whose data mask comes from a buffer (fuser/attention_op.py): found
    causal, the op runs SDPA's kernel (flash or cuDNN, as SDPA picks under the backend switches) or our kernel made
    for the structure, and the backward takes its forward's path.  The row statistics are one log-sum-exp
    whichever ran; output, statistics and gradients match fp64 eager.  GQA, odd sizes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fuser import attention_op
    if path != "structured" and DEVICE != "cuda":
        pytest.skip("SDPA's flash and cuDNN kernels: CUDA")
    dtype = torch.bfloat16 if path != "structured" else torch.float32
    torch.manual_seed(34)
    # 77 rows: past the GPU's 64-wide tiles; on CPU (16 x 16 tiles) 37 (three tiles, the last partial) does that
    B, Hkv, M, D = 2, 2, 77 if DEVICE == "cuda" else 37, 64
    q, k, v = qkv(B, Hkv * groups, Hkv, M, M, D, dtype)
    buffer = torch.ones(M, M, device=DEVICE).triu(1).bool()
    mod = ScoreMod(("s = tl.where(extra0, float('-inf'), s)",), n_extra=1, grad=("g = tl.where(extra0, 0.0, 1.0)",),
                   data_mask=(0, "drop", torch.bool))
    site = attention_op.register_site(0.3 if path != "structured" else None)
    backend = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}.get(
        path, [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    w = rand(B, Hkv * groups, M, D)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(backend):
        if path != "structured" and torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=0.3,
                                                            enable_gqa=groups > 1) != backend[0].value:
            pytest.skip(f"SDPA does not take {path} here")
        out, lse = attention_op.flash_attention_op(*xs, [buffer], 0.3 if path == "structured" else 1.0,
                                                   attention_op.register_mod(mod), 0.0, [], site, [buffer], False, [])
        taken = attention_op._taken(out)
        got = torch.autograd.grad((out * w).sum(), xs)
    assert taken[0] == ("structured" if path == "structured" else "sdpa"), taken
    assert path == "structured" or taken[2] == backend[0].value
    ref, ref_lse = reference(q.double(), k.double(), v.double(), 0.3, causal=True)
    check(out, ref, dtype)
    check_lse(lse[0] + lse[1], ref_lse)
    want = _grads(lambda q, k, v: reference(q, k, v, 0.3, causal=True)[0], w.double(), q.double(), k.double(), v.double())
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g.double(), w_, atol=BWD_TOL[dtype] * w_.abs().max().item(), rtol=BWD_TOL[dtype])


def test_kept_tile_lists_follow_the_mask_tensor():
    """A data mask's lists kept across calls (fuser::flash_attention with keep_lists, runtime.lists_cache) are
    used again only for a mask over the same memory, alive, of the same layout and version: a view of it hits
    (a slice made again each call, a saved tensor given back to the backward); a write in place (its version),
    the tensor pointed at other memory (`.data =`), or a new tensor where a freed one was get new lists.  An
    entry pins no memory.  Outputs match fp64 eager throughout."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    import fuser.codegen.attention as codegen_attention
    from fuser import attention_op
    torch.manual_seed(35)
    # 70 keys: past the GPU's 64-wide tiles; on CPU (16 x 16 tiles) 37, three tiles, and the lengths below scaled
    B, H, M, D = 2, 2, 70 if DEVICE == "cuda" else 37, 16
    at = lambda n: n * M // 70  # noqa: E731  a length given for 70 keys
    q, k, v = qkv(B, H, H, M, M, D)
    fill = torch.finfo(torch.float32).min
    keys = torch.arange(M, device=DEVICE)
    mod = ScoreMod(("s = s + extra0",), n_extra=1, grad=("g = 1.0",), data_mask=(0, "add", torch.float32))
    key = attention_op.register_mod(mod)
    made = []
    real = codegen_attention.list_launches
    codegen_attention.list_launches = lambda *a: made.append(1) or real(*a)

    def run(mask):
        out, _ = attention_op.flash_attention_op(q, k, v, [mask], 0.3, key, 0.0, [], -1, [], True, [])
        check(out, reference(q, k, v, 0.3, mod=lambda s, qi, ki: s + mask.double())[0], torch.float32)
        return len(made)

    def padding(lengths):
        lengths = torch.tensor([at(n) for n in lengths], device=DEVICE)
        mask = torch.where(keys[None, :] >= lengths[:, None], fill, 0.0)[:, None, None]
        return mask.expand(B, 1, M, M).contiguous()
    try:
        mask = padding([50, 20])
        assert run(mask) == 1 and run(mask) == 1  # kept
        mask[0, ..., at(30):] = fill  # written in place
        assert run(mask) == 2
        assert run(mask.view(B, 1, M, M)) == 2 and run(mask.detach()) == 2  # its version counter: the same value
        old = StorageWeakRef(mask.untyped_storage())
        mask.data = padding([60, 10])  # the same object, other memory
        assert run(mask) == 3
        gc.collect()
        assert old.expired()  # the entries pinned nothing
        ptr = mask.data_ptr()
        del mask
        gc.collect()
        for _ in range(20):  # a new mask, other values, at the freed address where the allocator gives it again
            other = padding([30, 40])
            if other.data_ptr() == ptr:
                break
        assert run(other) == 4
    finally:
        codegen_attention.list_launches = real


def test_backward_path_is_the_forward_output_storages():
    """The backward takes its forward's path (`attention_op._taken`) only for the very output the forward made:
    a copy of it (a saved-tensor hook bringing it back from elsewhere) gets none, and so the tile lists."""
    from fuser import attention_op
    torch.manual_seed(36)
    q, k, v = qkv(1, 2, 2, 40, 40, 16)
    buffer = torch.ones(40, 40, device=DEVICE).triu(1).bool()
    mod = ScoreMod(("s = tl.where(extra0, float('-inf'), s)",), n_extra=1, grad=("g = tl.where(extra0, 0.0, 1.0)",),
                   data_mask=(0, "drop", torch.bool))
    site = attention_op.register_site(None)
    out, _ = attention_op.flash_attention_op(q, k, v, [buffer], 0.3, attention_op.register_mod(mod), 0.0, [], site,
                                             [buffer], False, [])
    assert attention_op._taken(out)[0] == "structured"
    assert attention_op._taken(out.clone()) is None
