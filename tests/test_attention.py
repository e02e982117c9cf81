"""Attention written out by hand is recognised and runs as SDPA where that is exact, else as our own
flash-attention kernel; `attention="triton"` forces our kernel.  Each test asserts the lowering chosen.

fp32 on CPU (the interpreter's tl.dot is right there), bf16 on the GPU.  Fully masked rows must give
what eager gives (NaN for -inf masks), so comparisons use equal_nan.
"""
import contextlib
import math

import pytest
import torch

import fuser

TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
transformers = pytest.importorskip("transformers")


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _check(fn, *args, attention=1, lowering=True, expect=None):
    """Fused vs eager; `expect`: "sdpa" or "triton", the lowering every attention must get."""
    fused = fuser.fuse(fn, attention=lowering)
    with torch.no_grad():
        out, ref = fused(*args), fn(*args)
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[args[0].dtype])
    kinds = [r.kind for r in fused.report.regions]
    assert kinds.count("attention") == attention, fused.report
    if expect is not None:
        chosen = [r.kernel == "sdpa" for r in fused.report.regions if r.kind == "attention"]
        assert chosen == [expect == "sdpa"] * attention, str(fused.report)
    return fused


def _attention_regions(fused):
    return [r for r in fused.report.regions if r.kind == "attention"]


def _qkv(device, b=2, h=3, m=37, n=37, d=16, hkv=None):
    dt = _dtype(device)
    return (torch.randn(b, h, m, d, device=device, dtype=dt), torch.randn(b, hkv or h, n, d, device=device, dtype=dt),
            torch.randn(b, hkv or h, n, d, device=device, dtype=dt))


@pytest.mark.parametrize("lowering", [True, "triton"])
@pytest.mark.parametrize("where", ["in_graph", "closure"])
def test_causal_masked_fill(where, lowering, device):
    """The research-code form Inductor misses: a triangular mask through masked_fill.  Built in the
    graph from constants, the mask is evaluated at compile time and known causal: SDPA's is_causal,
    or tiles above the diagonal skipped in our kernel.  A tensor from outside is data: SDPA's mask
    (its rows checked for -inf, as eager gives NaN there), or loaded per tile."""
    torch.manual_seed(0)
    q, k, v = _qkv(device)
    outside = torch.ones(37, 37, device=device, dtype=torch.bool).triu(1)

    def attn(q, k, v):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(37, 37, device=q.device, dtype=torch.bool).triu(1) if where == "in_graph" else outside
        s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    fused = _check(attn, q, k, v, lowering=lowering, expect="sdpa" if lowering is True else "triton")
    (r,) = _attention_regions(fused)
    assert r.k > 2
    if lowering is True:
        assert ("is_causal=True" in r.source) == (where == "in_graph"), r.source
        assert ("attn_mask=None" in r.source) == (where == "in_graph")
    else:
        assert "attention_fwd" in r.source and "attention='triton'" in r.lowering
        assert ("causal (offset 0)" in r.source) == (where == "in_graph")


@pytest.mark.parametrize("lowering", [True, "triton"])
def test_the_copy_after_heads_are_merged_is_made_only_where_needed(lowering, device):
    """HF's `out.transpose(1, 2).contiguous()` after attention: AOT's clone, as the traced [B, H, M, D] needed
    one.  SDPA writes [B, M, H, D], so the transposed output is contiguous already: no copy is made
    (`aten.contiguous`, folded into the views to the projection); our kernel's [B, H, M, D] output is copied."""
    torch.manual_seed(3)
    q, k, v = _qkv(device, m=29, n=29)
    w = torch.randn(48, 40, device=device, dtype=q.dtype)

    def attn(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.25
        o = torch.softmax(s, -1) @ v
        return o.transpose(1, 2).contiguous().view(2, 29, 48) @ w

    fused = _check(attn, q, k, v, lowering=lowering, expect="sdpa" if lowering is True else "triton")
    code = fused.code
    if lowering is True:
        assert "clone(" not in code and "aten.contiguous.default" in code, code
    else:
        assert "clone(" in code, code


def test_softcap_alibi_and_padding_with_fully_masked_rows(device):
    """Soft-capping is not a scale and a mask: our kernel, and the report says why."""
    torch.manual_seed(1)
    q, k, v = _qkv(device, m=29, n=50)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(3)], device=device)
    alibi = (slopes[:, None, None] * -(torch.arange(50, device=device) - torch.arange(29, device=device)[:, None]).abs())
    keep = torch.rand(2, 1, 29, 50, device=device) > 0.3
    keep[0, 0, 5] = False  # a query that sees nothing: NaN in eager

    def attn(q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * 0.25
        s = 30.0 * torch.tanh(s / 30.0) + alibi
        s = torch.where(keep, s, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    fused = _check(attn, q, k, v, expect="triton")
    assert "not SDPA: aten.tanh on the scores" in _attention_regions(fused)[0].lowering


@pytest.mark.parametrize("softcap", [False, True], ids=["sdpa", "ours"])
@pytest.mark.parametrize("where", ["q", "k", "inf in k"])
def test_nan_and_inf_in_q_k_v_reach_the_outputs_and_gradients_eager_puts_them_in(where, softcap, device):
    """A NaN in one query row makes that row's output NaN; in one key, every row that sees it (the online max
    must not skip a NaN score, as a GPU's fmax would); an inf in a key gives
    inf - inf scores (NaN). Inference through SDPA (a causal mask) and our kernel (soft-capped); training
    through our kernel and its backward."""
    torch.manual_seed(3)
    q, k, v = _qkv(device, m=29, n=41)
    target = {"q": q, "k": k, "inf in k": k}[where]
    target[1, 2, 7, 5] = float("inf") if where == "inf in k" else float("nan")
    causal = torch.ones(29, 41, dtype=torch.bool, device=device).tril(12)

    def attn(q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * 0.25
        s = 20.0 * torch.tanh(s / 20.0) if softcap else s
        return torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v

    _check(attn, q, k, v, expect="triton" if softcap else "sdpa")  # NaN where eager's (equal_nan)
    fused = fuser.fuse(attn)
    args, refs = [t.clone().requires_grad_() for t in (q, k, v)], [t.clone().requires_grad_() for t in (q, k, v)]
    out, ref = fused(*args), attn(*refs)
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[q.dtype])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out)
    got, want = torch.autograd.grad(out, args, g), torch.autograd.grad(ref, refs, g)
    # where a gradient is NaN past the rows and keys eager's is may differ: eager's masked_fill passes 0 to a
    # masked score, and 0 * NaN reaches dK in the NaN's one column there, where a kernel's tile has NaN
    # throughout (SDPA's own kernels as ours); so: NaN in the same gradients, equal where both are numbers
    for name, a, b in zip("qkv", got, want):
        assert a.isnan().any() == b.isnan().any(), (where, "d" + name)
        both = ~(a.isnan() | b.isnan())
        torch.testing.assert_close(a[both], b[both], **TOL[q.dtype])
    notes = [n for r in fused.reports for n in r.notes]
    assert any("attention claimed before autograd (our kernel" in n for n in notes), notes  # a closure's mask: data


def _random_keep(n: int, dtype, device) -> torch.Tensor:
    """A [1, 1, n, n] mask of no structure (True-ish = keep), every query keeping its own key."""
    keep = (torch.rand(1, 1, n, n, device=device) < 0.6).to(dtype)
    keep.diagonal(dim1=-2, dim2=-1).fill_(1)
    return keep


@contextlib.contextmanager
def _lists_made():
    """The data masks' tile lists made inside (codegen.attention.list_launches calls), as a growing list."""
    import fuser.codegen.attention as codegen_attention
    made, real = [], codegen_attention.list_launches
    codegen_attention.list_launches = lambda *a: made.append(1) or real(*a)
    try:
        yield made
    finally:
        codegen_attention.list_launches = real


class _Layers(torch.nn.Module):
    """Several attentions over one mask in a buffer, as a model's layers."""

    def __init__(self, keep, layers):
        super().__init__()
        self.register_buffer("keep", keep)
        self.layers = layers

    def forward(self, q, k, v):
        out = 0
        for i in range(self.layers):
            s = (q @ k.transpose(-1, -2)) * (0.3 + 0.1 * i)
            out = out + torch.softmax(s.masked_fill(self.keep == 0, float("-inf")), -1) @ v
        return out


def test_layers_sharing_a_buffer_mask_make_its_lists_once(device):
    """Five attentions over one buffer mask of no structure (more than the lists cache holds entries): the
    lists are made once, on the first call, and shared by every layer after; outputs equal eager's."""
    torch.manual_seed(40)
    model = _Layers(_random_keep(33, torch.float32, device), 5)
    with _lists_made() as made:
        fused = fuser.fuse(model)
        with torch.no_grad():
            for _ in range(2):
                q, k, v = (torch.randn(1, 2, 33, 16, device=device) for _ in range(3))
                torch.testing.assert_close(fused(q, k, v), model(q, k, v), **TOL[torch.float32])
    assert len(made) == 1, made
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks


def test_a_buffer_mask_made_under_inference_mode(device):
    """A model whose buffers were made under torch.inference_mode() (they keep no version): compiled and run
    there, the mask is applied as given, never checked once and trusted after; outputs equal eager's."""
    torch.manual_seed(41)
    with torch.inference_mode():
        keep = torch.ones(40, 40, device=device).tril()[None, None]
        model = _KeepBuffer(keep)
        fused = fuser.fuse(model)
        for step in range(2):
            q, k, v = (torch.randn(2, 2, 40, 16, device=device) for _ in range(3))
            torch.testing.assert_close(fused(q, k, v), model(q, k, v), **TOL[torch.float32])
            model.keep[..., 3, :] = 1  # no version to see: the next call must still follow it
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks


@pytest.mark.parametrize("after", ["transpose, scale", "reshape to heads, add"])
def test_a_region_after_our_kernel_reads_its_output_through_views(after, device):
    """Our kernel's output read by a region through views (the heads moved back, as before an output projection):
    the region reads the kernel's output, not the P @ V product inside the unit the output is a view of (that
    compile raised, and the graph ran eagerly: Gemma2's soft-capped attention on the GPU)."""
    torch.manual_seed(39)
    q, k, v = _qkv(device)
    bias = torch.randn(37, 48, device=device)

    def attn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        o = torch.softmax((20.0 * torch.tanh(s / 20.0)).float(), -1).to(q.dtype) @ v
        if after == "transpose, scale":
            return o.transpose(1, 2).contiguous() * 2.0
        return o.transpose(1, 2).reshape(o.shape[0], 37, 48) + bias

    fused = _check(attn, q, k, v, expect="triton")
    assert any(r.kind != "attention" for r in fused.report.regions), fused.report
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks


@pytest.mark.parametrize("chain", ["sdpa, ours", "ours, sdpa", "sdpa, sdpa on its output, ours"])
def test_attentions_chained_with_no_projection_between(chain, device):
    """An attention reading another's output directly (no projection between; the second one's q, k or v a view
    of the first's output), the first lowered to SDPA: the report's cost of the second was read through the new
    SDPA call (KeyError, the whole graph ran eagerly).  Each attention gets its lowering; gradients match (the
    longest chain)."""
    torch.manual_seed(40)
    q, k, v = _qkv(device)
    m = q.shape[2]
    pos = torch.arange(m, device=device)
    bias = (2.0 ** -torch.arange(1, q.shape[1] + 1, device=device)[:, None, None] * (pos[None, :] - pos[:, None])).to(q.dtype)
    causal = torch.ones(m, m, dtype=torch.bool, device=device).triu(1)

    def att(q, k, v, cap=None):
        s = q @ k.transpose(-1, -2) * 0.25
        if cap:  # soft-capping: not SDPA's, ours
            s = torch.tanh(s / cap) * cap
        return torch.softmax((s + bias).masked_fill(causal, float("-inf")), -1) @ v

    def fn(q, k, v):
        if chain == "sdpa, ours":
            return att(att(q, k, v), k, v, cap=20.0)
        if chain == "ours, sdpa":
            return att(q, att(q, k, v, cap=20.0), v)
        o = att(q, k, v)
        o = att(o, o, v)
        b, h, _, d = o.shape  # q: o's heads moved and back (views)
        return att(o.transpose(1, 2).reshape(b, m, h, d).transpose(1, 2), k, o, cap=5.0)

    fused = _check(fn, q, k, v, attention=chain.count(",") + 1)
    assert [r.kernel == "sdpa" for r in _attention_regions(fused)] == \
        sorted((part.strip() != "ours" for part in chain.split(",")), reverse=True), fused.report
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    if chain != "sdpa, sdpa on its output, ours":
        return  # training (claimed before autograd, fuser.pregrad): once, on the chain with every pairing
    torch._dynamo.reset()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.compile(fn, backend="fuser")(*leaves).float().sum().backward()
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    fn(*ref).float().sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, **TOL[q.dtype])


def test_a_bias_with_its_heads_innermost_reaches_sdpa_with_its_keys_adjacent(device):
    """T5's position bias is an embedding looked up per (query, key) and moved to [1, H, M, N]: its heads innermost
    in memory.  SDPA's fused kernels read a mask whose keys are adjacent; given this one, SDPA ran its math path
    (fp32 matmuls, the scores written: T5 at 2x Inductor's GPU time).  The region making the bias writes it so."""
    torch.manual_seed(41)
    q, k, v = _qkv(device)
    m, h = q.shape[2], q.shape[1]
    table = torch.randn(32, h, device=device, dtype=q.dtype)
    pos = torch.arange(m, device=device)
    buckets = (pos[None, :] - pos[:, None]).abs().clamp(max=31)

    def attn(q, k, v, table=table):
        bias = torch.nn.functional.embedding(buckets, table).permute(2, 0, 1)[None]  # [1, H, M, N], heads innermost
        return torch.softmax((q @ k.transpose(-1, -2) + bias).float(), -1).to(q.dtype) @ v

    fused = fuser.fuse(attn)
    with torch.no_grad():
        fused(q, k, v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fused(q, k, v)
        ref = attn(*(x.double() for x in (q, k, v, table)))  # fp64: eager's 16-bit scores round where SDPA's do not
    torch.testing.assert_close(out.double(), ref, **TOL[q.dtype])
    assert [r.kernel for r in _attention_regions(fused)] == ["sdpa"], fused.report
    assert "keys adjacent" in _attention_regions(fused)[0].source, fused.report  # the report says why the copy
    seen = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in name for name in seen), seen
    # neither SDPA's math path (CUDA: _safe_softmax) nor a copy of the mask per call (CPU: its flash kernel's)
    assert not any("softmax" in name or name in ("aten::contiguous", "aten::clone") for name in seen), seen


def test_a_broadcast_mask_with_its_keys_strided_is_copied_once_not_per_head(device):
    """A [N, M] mask transposed and expanded over batch and heads: SDPA needs its keys at stride 1, so it is
    copied, but one [M, N] slice (then expanded back, a view), not a [B, H, M, N] tensor per call."""
    torch.manual_seed(42)
    q, k, v = _qkv(device, b=3, h=4, m=24, n=24)
    nm = torch.randn(24, 24, device=device, dtype=q.dtype)

    def attn(q, k, v, nm):
        return torch.softmax((q @ k.transpose(-1, -2) * 0.25 + nm.t().expand(3, 4, 24, 24)).float(), -1).to(q.dtype) @ v

    fused = _check(attn, q, k, v, nm, expect="sdpa")
    assert "keys adjacent" in _attention_regions(fused)[0].source, fused.report
    written = [s for r in fused.report.regions if r.kind != "attention" for s in r.output_shapes]
    assert written and not any(s.startswith("[3, 4, 24, 24]") for s in written), fused.report


def _constant_score_mod(form, m, n, h):
    """Score chains whose masks and biases are built in the graph from constants (positions, slopes)."""
    def chain(s):
        dev = s.device
        q_pos, k_pos = torch.arange(m, device=dev)[:, None], torch.arange(n, device=dev)[None, :]
        causal = torch.ones(m, n, device=dev, dtype=torch.bool).triu(n - m + 1)
        if form == "alibi + causal":
            slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device=dev) / h)
            s = s + slopes[:, None, None] * (k_pos - q_pos)
            return s.masked_fill(causal, float("-inf"))
        if form == "window":
            far = torch.ones(m, n, device=dev, dtype=torch.bool).tril(n - m - 7)
            return s.masked_fill(causal | far, float("-inf"))
        if form == "additive causal, kept where True":
            keep = ~causal
            return torch.where(keep, s, torch.finfo(s.dtype).min)
        if form == "symmetric alibi (not linear)":
            return s - 0.5 * (k_pos - q_pos).abs()
        raise AssertionError(form)
    return chain


@pytest.mark.parametrize("form", ["alibi + causal", "window", "additive causal, kept where True",
                                  "symmetric alibi (not linear)"])
@pytest.mark.parametrize("m, n", [(45, 45), (20, 45)])
def test_masks_and_biases_built_from_constants_are_computed_from_indices(form, m, n, device):
    """A causal or window mask, or a bias slope * (k - q), built in the graph from constants is
    computed in the kernel from the positions (no M x N tile loaded per step, no M x N tensor made) and its
    structure skips tiles; checked on every element at compile time, so a bias of another form (|k - q|)
    stays a load.  Prefill alignment (m < n) included."""
    torch.manual_seed(3)
    q, k, v = _qkv(device, m=m, n=n)
    chain = _constant_score_mod(form, m, n, q.shape[1])

    def attn(q, k, v):
        s = chain(q @ k.transpose(-1, -2) * 0.25)
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    fused = _check(attn, q, k, v, lowering="triton", expect="triton")
    (r,) = _attention_regions(fused)
    loads = "_base + q_idx * extra" in r.source  # a tile loaded per step
    assert loads == (form == "symmetric alibi (not linear)"), r.source
    if not loads:
        assert "computed from the indices, not read" in r.source
        assert f"causal (offset {n - m})" in r.source
        # nor made: the graph computes only the elements the kernel reads (a slope per head), no M x N tensor
        made = [x for reg in fused.report.regions if reg.kind != "attention" for x in reg.output_shapes]
        assert not any(f"{m}, {n}]" in x for x in made), made
    assert ("window 7" in r.source) == (form == "window"), r.source


@pytest.mark.parametrize("form", ["soft-cap + causal", "alibi + causal", "soft-cap + alibi + causal",
                                  "soft-cap + learned bias", "learned bias, soft-cap, causal; broadcast over heads"])
def test_attention_sdpa_cannot_express_trains_through_our_backward(form, device):
    """In training, an attention SDPA cannot express is claimed before autograd as our kernel: the
    forward saves the log-sum-exp, not the scores, and the backward kernels recompute them, with the
    score chain's derivative (tanh's, the mask's).  Gradients of q, k, v match autograd through the
    fp64 program; so does a learned bias's (T5's relative-position bias), summed over where it
    broadcasts, through the chain after it (soft-capping, a mask)."""
    torch.manual_seed(5)
    q, k, v = _qkv(device, m=45, n=45)
    learned = torch.randn(3, 45, 45, device=device, requires_grad=True)
    alibi = _constant_score_mod("alibi + causal", 45, 45, 3)

    def attn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        if form == "soft-cap + causal":
            s = 20.0 * torch.tanh(s / 20.0)
            s = s.masked_fill(torch.ones(45, 45, device=s.device, dtype=torch.bool).triu(1), float("-inf"))
        elif form == "alibi + causal":
            s = alibi(s)
        elif form == "soft-cap + alibi + causal":
            s = alibi(20.0 * torch.tanh(s / 20.0))
        elif form == "soft-cap + learned bias":
            s = 20.0 * torch.tanh(s / 20.0) + learned.to(s.dtype)
        else:
            s = 10.0 * torch.tanh((s + shared.to(s.dtype)) / 10.0)
            s = s.masked_fill(torch.ones(45, 45, device=s.device, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    shared = torch.randn(1, 45, 45, device=device, requires_grad=True)  # one bias for every head
    before = len(fuser.reports())
    w = torch.randn(q.shape, device=device)
    xs = [x.detach().requires_grad_() for x in (q * 3, k, v)]
    biases = [learned] if form == "soft-cap + learned bias" else [shared] if "learned" in form else []
    got = torch.autograd.grad((torch.compile(attn, backend="fuser")(*xs).float() * w).sum(), xs + biases)
    x64 = [x.detach().double().requires_grad_() for x in xs + biases]
    if biases:
        learned, shared = (x64[3], shared) if form == "soft-cap + learned bias" else (learned, x64[3])
    want = torch.autograd.grad((attn(*x64[:3]) * w.double()).sum(), x64)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        torch.testing.assert_close(g.double(), r, atol=TOL[q.dtype]["atol"] * r.abs().max().item(), rtol=TOL[q.dtype]["rtol"])
    notes = [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("attention")]
    # ALiBi's fp32 bias goes to SDPA in fp32, to our kernel in 16 bits (SDPA would round it); a learned bias
    # with soft-capping: ours
    ours = form.startswith("soft-cap") or "learned" in form or q.dtype != torch.float32
    assert any("claimed before autograd (our kernel and its backward" in n for n in notes) == ours, notes
    # (on CPU, SDPA's math path as AOT decomposes it saves its probabilities: "attention at ... left to its ops")
    assert not any("in training left to its ops" in n for n in notes), notes


def test_additive_finfo_min_mask(device):
    torch.manual_seed(2)
    q, k, v = _qkv(device, m=23, n=23)
    pad = torch.ones(2, 23, device=device)
    pad[1, 15:] = 0
    bias = ((1.0 - pad[:, None, None, :]) * torch.finfo(q.dtype).min).to(q.dtype)  # as BERT builds it

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v

    fused = _check(attn, q, k, v, expect="sdpa")
    assert "set to NaN" in _attention_regions(fused)[0].source  # a float input: -inf not ruled out
    # the fix-up (where(row fully masked, nan, out)) in a kernel of ours: eager's where with a number is two
    # launches, a fill of a 0-d tensor and the where (4 a llama decode step, run 154)
    assert not any(u.op.startswith("aten.where") for u in fused.report.unfused), fused.report.unfused


def test_gqa_repeat_kv_is_not_materialised(device):
    torch.manual_seed(3)
    q, k, v = _qkv(device, h=4, hkv=2)

    def attn(q, k, v):
        k = k[:, :, None].expand(2, 2, 2, 37, 16).reshape(2, 4, 37, 16)
        v = v[:, :, None].expand(2, 2, 2, 37, 16).reshape(2, 4, 37, 16)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v

    fused = _check(attn, q, k, v, expect="sdpa")
    (r,) = _attention_regions(fused)
    assert any("[2, 2, 37, 16]" in s for s in r.input_shapes)  # the shared heads, not the repeated copy
    assert "enable_gqa=True" in r.source
    fused = _check(attn, q, k, v, lowering="triton", expect="triton")


@pytest.mark.parametrize("train", [False, True])
def test_attention_whose_probabilities_are_returned_says_why_it_is_left(train, device):
    """Attention weights returned beside the output (JetMoE's, past a graph break; `output_attentions`): the N x N
    probabilities are made anyway, so the unit stays with its ops, and the report says so (inference had said
    nothing; found by a sweep of unseen architectures)."""
    torch.manual_seed(18)
    q, k, v = (x.requires_grad_(train) for x in _qkv(device, m=13, n=13))
    mask = torch.zeros(2, 1, 13, 13, device=device)
    mask[1, ..., :4] = -1e9

    def attn(q, k, v):
        w = torch.softmax(q @ k.transpose(2, 3) * 0.25 + mask, -1, dtype=torch.float32).to(q.dtype)
        return (w @ v).transpose(1, 2).contiguous(), w

    compiled = torch.compile(attn, backend="fuser")
    before = len(fuser.reports())
    with torch.set_grad_enabled(train):
        for got, want in zip(compiled(q, k, v), attn(q, k, v)):
            torch.testing.assert_close(got, want, **TOL[q.dtype])
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert any("probabilities are read outside it" in n for n in notes), notes


def test_softmax_over_the_wrong_dim_is_not_attention(device):
    torch.manual_seed(4)
    q, k, v = _qkv(device)
    _check(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -2) @ v, q, k, v, attention=0)


def test_mask_computed_from_v_is_not_rewritten(device):
    torch.manual_seed(5)
    q, k, v = _qkv(device)

    def attn(q, k, v):
        bias = v.sum(-1, keepdim=True).transpose(-1, -2)  # [B, H, 1, N], from V
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v

    _check(attn, q, k, v, attention=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "bloom", "falcon", "falcon_no_mask", "falcon_rope",
                                  "falcon_new_arch", "deepseek_v3"])
def test_hf_eager_attention_is_recognised(name, device):
    """BLOOM writes its scores as baddbmm(alibi, q, kᵀ) over [B·H, ., .] with Kᵀ transposed after
    that view: the ALiBi bias joins the additive mask.  Falcon (ALiBi, multi-query) broadcasts its
    one K/V head to all query heads and views its scores to the shape they have; without a mask its
    ALiBi and causal mask are constants, and it flattens the attention's output (a view of the bmm's
    layout, which SDPA's output does not have: a reshape there).  Falcon with RoPE scales its scores
    in place: a view to [B·H, M, N] and back around the division.  DeepSeek-V3's latent attention has V's
    head dim apart from Q's and K's."""
    torch.manual_seed(6)
    kw = {}
    if name.startswith("falcon"):
        arch = dict(falcon=dict(alibi=True), falcon_no_mask=dict(alibi=True, multi_query=False),
                    falcon_rope=dict(alibi=False), falcon_new_arch=dict(alibi=False, new_decoder_architecture=True,
                                                                        num_kv_heads=2))[name]
        model = transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, attn_implementation="eager", **arch))
        if name != "falcon_no_mask":
            kw["attention_mask"] = torch.ones(2, 37, dtype=torch.long, device=device)
            kw["attention_mask"][1, :6] = 0
    elif name == "bloom":
        model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=97, hidden_size=64, n_layer=2, n_head=4))
        kw["attention_mask"] = torch.ones(2, 37, dtype=torch.long, device=device)
        kw["attention_mask"][1, :6] = 0  # left padding
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="eager"))
    elif name == "deepseek_v3":  # MLA: q and k at 32 + 16, v at 32; its MoE kept small
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, attn_implementation="eager"))
    elif name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation="eager",
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            attn_implementation="eager"))
        kw["attention_mask"] = torch.ones(2, 37, dtype=torch.long, device=device)
        kw["attention_mask"][1, 25:] = 0
    model = model.to(device, _dtype(device)).eval()
    ids = torch.randint(0, 97, (2, 37), device=device)
    fused = fuser.fuse(model)
    with torch.no_grad():
        out, ref = fused(ids, **kw), model(ids, **kw)
    regions = _attention_regions(fused)
    assert all(r.kernel == "sdpa" for r in regions), str(fused.report)
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    if "attention_mask" in kw:  # a padding mask is data: never taken for a causal structure
        assert not any("is_causal=True" in r.source for r in regions)
    if name in ("llama", "gpt2"):  # HF's mask where(keep, 0, finfo.min) is finite: no NaN fix-up
        assert not any("NaN" in r.source for r in regions)
    key = "last_hidden_state" if name == "bert" else "logits"
    tol = dict(atol=1e-3, rtol=1e-3) if device == "cpu" else dict(atol=8e-2, rtol=8e-2)
    torch.testing.assert_close(out[key], ref[key], **tol)
    assert [r.kind for r in fused.report.regions].count("attention") == 2, fused.report


class _BloomScores(torch.nn.Module):
    """BLOOM's scores: baddbmm(bias, q, kᵀ) over [B·H, ., .], viewed to [B, H, M, N] for the softmax; q, k, v
    given as [B·H, S, D], or as [B, H, S, D] reshaped (Kᵀ then a transpose of a view of a 4-D tensor)."""

    def forward(self, q, k, v, bias):
        if q.dim() == 4:
            b, h, n, d = q.shape
            q, k, v = (t.reshape(b * h, n, d) for t in (q, k, v))
        s = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=0.25).view(2, 4, q.shape[1], k.shape[1])
        return torch.bmm(torch.softmax(s, dim=-1).view(8, q.shape[1], k.shape[1]), v)


@pytest.mark.parametrize("four_d", [False, True], ids=["3d", "4d"])
def test_bloom_scores_over_symbolic_lengths(four_d, device):
    """BLOOM's scores at a second length (sizes symbolic on the recompile): written out as bmm, mul and add with
    the graph's own size nodes (sympy sizes made the whole graph fall back to eager, in the scores' view and in
    Kᵀ's reshape; found by sweeps of unseen architectures)."""
    model, fused = _BloomScores(), fuser.fuse(_BloomScores())
    for n in (13, 37):
        q, k, v = (torch.randn(*((2, 4) if four_d else (8,)), n, 16, device=device) for _ in range(3))
        bias = torch.randn(8, 1, n, device=device)
        with torch.no_grad():
            torch.testing.assert_close(fused(q, k, v, bias), model(q, k, v, bias), atol=1e-4, rtol=1e-4)
        assert not fused.report.all_fallbacks, fused.report
        assert not any("baddbmm" in u.op for u in fused.report.unfused), fused.report  # written out as bmm, mul, add


class _SlicedBias(torch.nn.Module):
    """MPT's ALiBi: a bias made for the longest length, sliced from `max(0, L - s)` per call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("alibi", torch.randn(4, 1, 64))

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        bias = self.alibi[:, :, max(0, 64 - k.shape[2]):]
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = (s + bias.to(s.dtype)).masked_fill(causal, torch.finfo(s.dtype).min)
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("lowering", [True, "triton"])
def test_a_bias_sliced_by_a_length_that_varies(lowering, device):
    """MPT's bias sliced at `max(0, L - s)`: its last size is `L - Max(0, L - s)`, s only by the guard the
    trace took (compared structurally, no attention was found at symbolic lengths); in training too."""
    torch.manual_seed(11)
    model = _SlicedBias().to(device)
    fused = torch.compile(model, backend="fuser", dynamic=True, options={"attention": lowering})
    before = len(fuser.reports())
    for n in (37, 45):
        q, k, v = (torch.randn(2, 4, n, 16, device=device, dtype=_dtype(device)) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(fused(q, k, v), model(q, k, v), **TOL[q.dtype])
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        got = torch.autograd.grad(fused(*xs).float().sum(), xs)
        want = torch.autograd.grad(model(*xs).float().sum(), xs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL[q.dtype])
    reports = fuser.reports()[before:]
    assert any(r.kind == "attention" for rep in reports for r in rep.regions), reports
    assert any("claimed before autograd" in n for rep in reports for n in rep.notes), [rep.notes for rep in reports]
    assert not any(rep.all_fallbacks for rep in reports)
    assert any(r.symbolic for rep in reports for r in rep.regions if r.kind == "attention")  # found at symbolic lengths


def _pad_mask(device, b, n, fill_row=None):
    """A key-padding mask [B, 1, 1, N] (True = keep); row `fill_row` entirely padded (every key masked)."""
    keep = torch.ones(b, 1, 1, n, device=device, dtype=torch.bool)
    keep[1, ..., n - 7:] = False
    if fill_row is not None:
        keep[fill_row] = False
    return keep


# Chains SDPA expresses exactly: scale (before or after the matmul, mul or div), additive masks and
# biases, masked_fill/where with an absorbing fill, constant shifts, negation.
SDPA_CHAINS = {
    "div_then_masked_fill_-inf": lambda s, q, keep, bias: (s / 4.0).masked_fill(~keep, float("-inf")),
    "where_keep_finfo_min": lambda s, q, keep, bias: torch.where(keep, s * 0.25, torch.finfo(s.dtype).min),
    "bias_then_scale": lambda s, q, keep, bias: (s + bias) * 0.3,
    "shift_and_negate": lambda s, q, keep, bias: bias - (-(s * 0.2) + 3.0),
    "scaled_query": None,  # q * scale before the matmul
}


@pytest.mark.parametrize("chain", list(SDPA_CHAINS))
def test_sdpa_expressible_chains_match_eager(chain, device):
    torch.manual_seed(7)
    q, k, v = _qkv(device, m=29, n=41)
    keep = _pad_mask(device, 2, 41, fill_row=0)  # batch 0: every key masked, eager gives NaN or a uniform row
    bias = torch.randn(3, 29, 41, device=device, dtype=q.dtype)

    def attn(q, k, v):
        if SDPA_CHAINS[chain] is None:
            s = (q * 0.125) @ k.transpose(-1, -2)
        else:
            s = SDPA_CHAINS[chain](q @ k.transpose(-1, -2), q, keep, bias)
        return torch.softmax(s, -1) @ v

    fused = _check(attn, q, k, v, expect="sdpa")
    (r,) = _attention_regions(fused)
    if chain == "where_keep_finfo_min":  # HF's form: finite, no fix-up
        assert "NaN" not in r.source
    if chain == "div_then_masked_fill_-inf":
        assert "set to NaN" in r.source


@pytest.mark.parametrize("chain, reason", [
    ("fill_-1e4", "replaces the score"),
    ("multiplicative_mask", "multiplicative mask"),
    ("fp32_bias_on_fp16", "wider than the torch.float16"),
])
def test_chains_sdpa_cannot_express_run_our_kernel(chain, reason, device):
    """A fill that replaces the score (a fully masked row: eager averages uniformly, SDPA would not),
    a multiplicative mask, a bias SDPA would round: our kernel, with the reason in the report."""
    torch.manual_seed(8)
    q, k, v = _qkv(device, m=19, n=33)
    if chain == "fp32_bias_on_fp16":
        q, k, v = (x.half() for x in (q, k, v))
    keep = _pad_mask(device, 2, 33, fill_row=1)
    bias = torch.randn(2, 3, 19, 33, device=device)

    def attn(q, k, v):
        s = q @ k.transpose(-1, -2)
        if chain == "fill_-1e4":
            s = (s * 0.25).masked_fill(~keep, -1e4)
        elif chain == "multiplicative_mask":
            s = s * keep
        else:
            s = s.float() * 0.25 + bias
        return torch.softmax(s, -1).to(q.dtype) @ v

    tol = dict(atol=2e-3, rtol=2e-3) if q.dtype == torch.float16 else TOL[q.dtype]
    fused = fuser.fuse(attn)
    with torch.no_grad():
        torch.testing.assert_close(fused(q, k, v), attn(q, k, v), equal_nan=True, **tol)
    (r,) = _attention_regions(fused)
    assert r.kernel != "sdpa" and reason in r.lowering, r.lowering


def _mla(device, hkv=3):
    """q and k at head dim 48 (DeepSeek's "nope" 32 + "rope" 16), v at 32: multi-head latent attention."""
    dt = _dtype(device)
    return (torch.randn(2, 3, 37, 48, device=device, dtype=dt), torch.randn(2, hkv, 37, 48, device=device, dtype=dt),
            torch.randn(2, hkv, 37, 32, device=device, dtype=dt))


def _mla_attention(form: str):
    causal = torch.ones(37, 37, dtype=torch.bool).triu(1)

    def attn(q, k, v):
        if k.shape[1] != q.shape[1]:  # repeat_kv
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
        s = q @ k.transpose(-1, -2) * 48 ** -0.5
        if form == "soft-cap + causal":
            s = 20.0 * torch.tanh(s / 20.0)
        s = s.masked_fill(causal.to(s.device), float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
    return attn


@pytest.mark.parametrize("lowering,form,hkv", [(True, "causal", 3), ("triton", "causal", 1),
                                               (True, "soft-cap + causal", 3)])
def test_mla_value_head_dim_of_its_own(lowering, form, hkv, device):
    """V's head dim differs from Q's and K's (DeepSeek-V2/V3): recognised; SDPA takes it where it is exact,
    else (or asked) our kernel, whose output has V's head dim."""
    torch.manual_seed(9)
    q, k, v = _mla(device, hkv)
    expect = "sdpa" if lowering is True and form == "causal" else "triton"
    (r,) = _attention_regions(_check(_mla_attention(form), q, k, v, lowering=lowering, expect=expect))
    assert r.output_shapes == [f"[2, 3, 37, 32] {str(q.dtype).removeprefix('torch.')}"], r.output_shapes


@pytest.mark.parametrize("dims", [(64, 320), (320, 64)])
def test_a_head_dim_past_the_kernels_leaves_that_attention_alone(dims, device):
    """A head dim our kernels do not take (past 256), where SDPA cannot express the chain either: that
    attention stays with its ops, with the reason, and the rest of the graph still fuses (the kernel's
    ValueError had sent the whole graph to eager; found by review)."""
    torch.manual_seed(16)
    d, dv = dims
    q, k = torch.randn(1, 2, 37, d, device=device), torch.randn(1, 2, 45, d, device=device)
    v, x = torch.randn(1, 2, 45, dv, device=device), torch.randn(1000, device=device)

    def f(q, k, v, x):
        s = 30 * torch.tanh(q @ k.transpose(-1, -2) * 0.125 / 30)
        return torch.softmax(s, -1) @ v, torch.nn.functional.gelu(x * 2 + 1)

    fused = fuser.fuse(f)
    with torch.no_grad():
        torch.testing.assert_close(fused(q, k, v, x), f(q, k, v, x), **TOL[torch.float32])
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    assert "pointwise" in [r.kind for r in fused.report.regions]
    assert any("left to its ops" in n and "head dims up to 256" in n for n in fused.report.notes), fused.report.notes


@pytest.mark.parametrize("form", ["causal", "soft-cap + causal"])
def test_mla_trains(form, device):
    """MLA in training: claimed before autograd (SDPA, or our kernel and its backward), gradients of q, k
    (head dim 48) and v (32) against autograd through the fp64 program."""
    torch.manual_seed(10)
    attn = _mla_attention(form)
    before = len(fuser.reports())
    xs = [x.requires_grad_() for x in _mla(device)]
    w = torch.randn(2, 3, 37, 32, device=device)
    got = torch.autograd.grad((torch.compile(attn, backend="fuser")(*xs).float() * w).sum(), xs)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    want = torch.autograd.grad((attn(*x64) * w.double()).sum(), x64)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        torch.testing.assert_close(g.double(), r, atol=TOL[g.dtype]["atol"] * r.abs().max().item(), rtol=TOL[g.dtype]["rtol"])
    notes = [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("attention")]
    assert any("claimed before autograd" in n for n in notes), notes
    assert not any("left to its ops" in n for n in notes), notes


def test_decode_step_causal_mask_becomes_no_mask(device):
    """One new query over N keys with the causal mask aligned bottom-right (a decode step): every key
    is visible, so SDPA gets no mask at all; a chunk of 5 queries gets the constant mask."""
    torch.manual_seed(9)
    for m in (1, 5):
        torch._dynamo.reset()  # static sizes: the mask is a constant (symbolic lengths make it data)
        q, k, v = _qkv(device, m=m, n=40)

        def attn(q, k, v):
            qi = torch.arange(40 - m, 40, device=q.device)[:, None]
            ki = torch.arange(40, device=q.device)[None, :]
            s = (q @ k.transpose(-1, -2)) * 0.25
            return torch.softmax(s.masked_fill(ki > qi, float("-inf")), -1) @ v

        fused = _check(attn, q, k, v, expect="sdpa")
        (r,) = _attention_regions(fused)
        assert ("attn_mask=None" in r.source) == (m == 1), r.source
        assert "NaN" not in r.source, str(fused.report)  # constant: checked at compile time


def test_symbolic_lengths_and_a_scale_given_at_run_time(device):
    """dynamic=True: lengths are symbols and Dynamo passes the module's float scale as an input
    tensor; SDPA still takes the attention (the scale multiplies q), at every length."""
    torch.manual_seed(10)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager")).to(device, _dtype(device)).eval()
    fused = fuser.fuse(model, dynamic=True)
    tol = dict(atol=1e-4, rtol=1e-4) if device == "cpu" else dict(atol=8e-2, rtol=8e-2)
    with torch.no_grad():
        for t in (13, 29):
            ids = torch.randint(0, 97, (2, t), device=device)
            mask = torch.ones(2, t, dtype=torch.long, device=device)
            mask[1, :5] = 0  # left padding
            torch.testing.assert_close(fused(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, **tol)
    regions = _attention_regions(fused)
    assert regions and all(r.kernel == "sdpa" for r in regions), [r.lowering for r in regions]
    assert any(r.symbolic for r in regions)


@pytest.mark.parametrize("form", ["sdpa", "triton"])
def test_a_head_dim_passed_in_under_dynamic_is_fixed_per_graph(form, device):
    """q, k and v passed in under dynamic=True: the head dim is a size symbol (on a recompile q's and k's one
    symbol, v's another) and the scale `d ** -0.5` a computation on it.  The attention is recognised: its head
    dim fixed by a guard (another head dim compiles another graph; one seen before reuses its graph), the
    lengths symbolic.  Forward and, for our kernel, training through the op claimed before autograd."""
    torch.manual_seed(21)
    dt = _dtype(device)

    def attn(q, k, v, bias):
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s + bias if form == "sdpa" else 5.0 * torch.tanh(s / 5.0) + bias
        return torch.softmax(s.float(), -1).to(q.dtype) @ v

    compiled = torch.compile(attn, backend="fuser", dynamic=True)
    before = len(fuser.reports())
    for b, h, m, n, d in [(2, 3, 37, 41, 24), (2, 3, 23, 29, 16), (2, 3, 19, 45, 24)]:
        q, k, v = _qkv(device, b=b, h=h, m=m, n=n, d=d)
        bias = torch.randn(1, 1, m, n, device=device, dtype=dt)
        train = form == "triton"
        q, k, v = (t.requires_grad_(train) for t in (q, k, v))
        with torch.set_grad_enabled(train):
            out, ref = compiled(q, k, v, bias), attn(q, k, v, bias)
        torch.testing.assert_close(out, ref, **TOL[dt])
        if train:
            g = torch.randn_like(ref)
            for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
                torch.testing.assert_close(got, want, **TOL[dt])
    graphs = [r for r in fuser.reports()[before:] if not any(x.startswith("backward graph") for x in r.notes)]
    assert len(graphs) == 2, [r.notes for r in graphs]  # head dims 24 and 16; the third call reuses the first graph
    for r in graphs:
        if form == "sdpa":
            assert [x.kernel for x in r.regions if x.kind == "attention"] == ["sdpa"], str(r)
        else:
            assert any("claimed before autograd (our kernel and its backward" in x for x in r.notes), r.notes


class _BufferMasked(torch.nn.Module):
    """nanoGPT's form: the causal mask a buffer, sliced to the length and compared."""

    def __init__(self, n, device):
        super().__init__()
        self.register_buffer("bias", torch.ones(n, n, device=device).tril()[None, None])

    def forward(self, q, k, v):
        t = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return torch.softmax(s, -1) @ v


def test_a_causal_mask_in_a_buffer_is_recognised_at_run_time(device):
    """The mask is data (a buffer), so SDPA gets it as a tensor; at run time it is found to be torch's
    causal mask and SDPA runs with is_causal=True.  Written in place (its version changes) it is
    checked again: a sliding window then runs our kernel over the window's tiles; a mask of no
    structure runs our kernel over the tiles it keeps (its data-mask lists).  The output equals eager's
    throughout (NaN rows included)."""
    from fuser.codegen import sdpa
    torch.manual_seed(13)
    model = _BufferMasked(40, device)
    q, k, v = _qkv(device, m=33, n=33)
    fused = fuser.fuse(model)
    calls, windowed = [], []
    real, real_run = sdpa._structure, fuser.pipeline.run_attention
    sdpa._structure = lambda *a: calls.append(real(*a)) or calls[-1]
    fuser.pipeline.run_attention = lambda *a, **kw: windowed.append(kw["mod"].window or bool(kw["mod"].data_mask)) \
        or real_run(*a, **kw)
    try:
        with torch.no_grad():
            for step in range(6):
                if step == 2:  # a window of 5 keys: Mistral's sliding window
                    model.bias.tril_().triu_(-4)
                if step == 4:  # no longer a structure (rows 0-2 see no key: NaN in eager)
                    model.bias.tril_(-3)
                torch.testing.assert_close(fused(q, k, v), model(q, k, v), equal_nan=True, **TOL[q.dtype])
    finally:
        sdpa._structure, fuser.pipeline.run_attention = real, real_run
    assert calls == [(0, None), (0, 5), None], calls  # checked once per value of the buffer, not per call
    assert windowed == [5, 5, True, True]  # our kernel: over the window's tiles, then over the mask's lists
    (r,) = _attention_regions(fused)
    assert "checked at run time" in r.source and "sliding window" in r.source and r.kernel == "sdpa"


def test_a_causal_mask_from_aranges_at_symbolic_lengths_is_recognised_at_run_time(monkeypatch, device):
    """A causal mask the program builds from aranges (or a window over them) is a constant at a static length
    (is_causal at compile time); at symbolic lengths it is checked at run time, once per length, and SDPA runs
    is_causal (it had run SDPA's masked kernel, reading the T x T mask, from the second length on).  A mask
    of no structure at some length is used as given there."""
    from fuser.codegen import sdpa
    calls = []
    real = sdpa._structure
    monkeypatch.setattr(sdpa, "_structure", lambda *a: calls.append(real(*a)) or calls[-1])

    def attn(q, k, v, window):
        i = torch.arange(q.shape[2], device=q.device)
        keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window + (q.shape[2] > 30) * 1000)
        s = (q @ k.transpose(-1, -2)) * 0.25
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v

    torch.manual_seed(14)
    fused = fuser.fuse(attn)
    lengths = (12, 17, 33, 17, 21, 33)
    with torch.no_grad():
        for n in lengths:
            q, k, v = _qkv(device, m=n, n=n)
            window = 1000 if n != 21 else 4  # a window where the length is 21: not causal alone
            torch.testing.assert_close(fused(q, k, v, window), attn(q, k, v, window), equal_nan=True, **TOL[q.dtype])
    assert calls == [(0, None), (0, None), (0, 4)], calls  # lengths 17, 33, 21: once each (12 static, no check)
    (r,) = _attention_regions(fused)
    assert "checked at run time" in r.source, r.source


def test_a_causal_mask_from_aranges_at_symbolic_lengths_in_training(device):
    """In training the same mask goes to our op claimed before autograd, its structure checked at run time once
    per length (SDPA's flash kernel where it is causal on the GPU, our kernel made for the structure else; it had
    run SDPA's masked kernel, the T x T mask read forward and backward); gradients as eager's."""
    from fuser import attention_op

    def attn(q, k, v):
        i = torch.arange(q.shape[2], device=q.device)
        s = (q @ k.transpose(-1, -2)) * 0.25
        return torch.softmax(s.masked_fill(i[None, :] > i[:, None], float("-inf")), -1) @ v

    torch.manual_seed(15)
    compiled = torch.compile(attn, backend="fuser", dynamic=True)
    before, sites = len(fuser.reports()), len(attention_op._SITES)
    for n in (12, 17, 33, 17):
        q, k, v = (x.requires_grad_() for x in _qkv(device, m=n, n=n))
        w = torch.randn(q.shape, device=device)
        got = torch.autograd.grad((compiled(q, k, v).float() * w).sum(), (q, k, v))
        want = torch.autograd.grad((attn(q, k, v).float() * w).sum(), (q, k, v))
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, **TOL[q.dtype])
    notes = [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("attention")]
    assert any("made from sizes alone, checked at run time" in n for n in notes), notes
    (site,) = attention_op._SITES[sites:]
    assert site.check.by_size == {(12,): (0, None), (17,): (0, None), (33,): (0, None)}, site.check.by_size


def test_hf_llama_training_at_varying_lengths_checks_its_mask_at_run_time(device):
    """Hugging Face's LLaMA (eager attention, no attention_mask) in training at a second length: its additive
    causal mask, built from aranges at the symbolic length, goes to our op with its structure checked per length;
    the loss and every gradient as eager's."""
    from fuser import attention_op
    torch.manual_seed(17)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager")).to(device).train()  # fp32: the mask's path is the point
    compiled = torch.compile(model, backend="fuser")
    before, sites = len(fuser.reports()), len(attention_op._SITES)
    tol = dict(atol=1e-4, rtol=1e-3) if device == "cpu" else dict(atol=2e-3, rtol=2e-2)
    for t in (13, 21):  # the second length recompiles with it symbolic
        ids = torch.randint(0, 97, (2, t), device=device)
        got, want = compiled(ids, labels=ids).loss, model(ids, labels=ids).loss
        torch.testing.assert_close(got, want, **tol)
        for (name, _), g, r in zip(model.named_parameters(), torch.autograd.grad(got, list(model.parameters())),
                                   torch.autograd.grad(want, list(model.parameters()))):
            torch.testing.assert_close(g, r, **tol, msg=name)
    notes = [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("attention")]
    assert any("made from sizes alone, checked at run time" in n for n in notes), notes
    assert [s.check.by_size for s in attention_op._SITES[sites:]] == [{(21,): (0, None)}]


def test_no_run_time_check_under_cuda_graphs(device):
    """A replayed CUDA graph cannot branch on a value: the mask is then always applied as given."""
    torch.manual_seed(14)
    model = _BufferMasked(40, device)
    q, k, v = _qkv(device, m=33, n=33)
    fused = fuser.fuse(model, cuda_graphs=True)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fused(q, k, v), model(q, k, v), equal_nan=True, **TOL[q.dtype])
    (r,) = _attention_regions(fused)
    assert r.kernel == "sdpa" and "checked at run time" not in r.source


@pytest.mark.parametrize("form", ["program dtype", "bf16", "bf16, bool mask made additive", "explicit casts"])
def test_sdpa_math_path_decomposed_by_the_tracer_is_fused_back(form, device):
    """When the tracer picks SDPA's math path (ViT under torch.compile on the H100), it arrives
    decomposed: q and k each scaled by sqrt(scale), _safe_softmax (a fully masked row gives 0, not
    NaN), and 16-bit q, k, v cast to fp32 first while the mask is promoted by the add (or cast, or
    made additive from a boolean in fp32: values bf16 holds exactly).  It is recognised and runs as
    one SDPA call on the program's own tensors: scales folded, casts dropped, fully masked rows 0 as
    the math path."""
    torch.manual_seed(11)
    q, k, v = _qkv(device, m=29, n=41)
    if form != "program dtype":  # SDPA (ATen's, not the interpreter's tl.dot) runs them in bf16 on CPU too
        q, k, v = (x.bfloat16() for x in (q, k, v))
    if form.endswith("additive"):
        keep = torch.randn(2, 1, 29, 41, device=device) > -1
        keep[1, :, 3] = False  # one row with every key masked
    else:
        mask = torch.randn(2, 1, 29, 41, device=device, dtype=q.dtype)
        mask[1, :, 3] = float("-inf")

    def attn(q, k, v):
        if form == "explicit casts":
            out = torch.ops.aten._scaled_dot_product_attention_math(q.float(), k.float(), v.float(), mask.float(), scale=0.3)[0]
            return out.to(q.dtype)
        if form.endswith("additive"):  # fp32 in the graph, as SDPA makes a boolean mask additive
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, torch.where(keep, 0.0, float("-inf")), scale=0.3)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, scale=0.3)[0]

    fused = _check(attn, q, k, v, expect="sdpa")
    (r,) = _attention_regions(fused)
    assert "math path" in r.source and "scale=0.3" in r.source and "NaN" not in r.source, r.source
    assert ("16-bit" in r.source) == (q.dtype != torch.float32), r.source
    assert not [u for u in fused.report.unfused if "mul" in u.op or "bmm" in u.op], fused.report
    out = fused(q, k, v)
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))  # the math path's 0, not NaN


def test_sdpa_math_path_that_sdpa_would_take_again_is_left_decomposed(device):
    """Where SDPA itself would pick its math path for the real tensors (here: only the math backend
    enabled, as T5's position bias gets on the H100), one SDPA call would run the same decomposition
    in eager ops: it is left to the fused regions, with the reason."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(13)
    q, k, v = _qkv(device, m=19, n=23)
    mask = torch.randn(2, 1, 19, 23, device=device, dtype=q.dtype)

    def attn(q, k, v):
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, scale=0.3)[0]

    with sdpa_kernel([SDPBackend.MATH]):
        fused = _check(attn, q, k, v, attention=0)
    assert fused.report.regions and any("would take it again" in n for n in fused.report.notes), fused.report.notes


def test_sdpa_math_path_with_upcast_inputs_but_an_fp32_mask_is_left_decomposed(device):
    """16-bit q, k, v upcast by the math path but an fp32 mask: no SDPA in fp32 beside the casts, and
    not our kernel either (its fully masked rows would be NaN): left to the fused regions, the
    reason in the report."""
    torch.manual_seed(12)
    q, k, v = (x.bfloat16() for x in _qkv(device, m=19, n=23))
    bias = torch.randn(2, 3, 19, 23, device=device)

    def attn(q, k, v):
        out = torch.ops.aten._scaled_dot_product_attention_math(q.float(), k.float(), v.float(), bias, scale=0.3)[0]
        return out.to(q.dtype)

    fused = _check(attn, q, k, v, attention=0)
    assert fused.report.regions  # the softmax is still fused
    assert any("left to its ops" in n and "fp32 mask" in n for n in fused.report.notes), fused.report.notes


def test_attention_in_float64_training_stays_with_its_ops(device):
    """Our kernel takes 16- and 32-bit floats: a float64 attention SDPA cannot express is left to its
    ops in training, with the reason, and its gradients are eager's."""
    torch.manual_seed(6)
    q, k, v = (x.double() for x in _qkv(device, m=21, n=21))

    def attn(q, k, v):
        s = 20.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.25 / 20.0)
        return torch.softmax(s, dim=-1) @ v

    before = len(fuser.reports())
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(torch.compile(attn, backend="fuser")(*xs).sum(), xs)
    x2 = [x.detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(attn(*x2).sum(), x2)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)
    notes = [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("attention")]
    assert any("left to its ops" in n and "torch.float64" in n for n in notes), notes


class _KeepBuffer(torch.nn.Module):
    def __init__(self, keep, form="masked_fill"):
        super().__init__()
        self.register_buffer("keep", keep)
        self.form = form

    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.3
        if self.form == "where, finfo.min":  # a row masked whole: eager's uniform average, not NaN
            s = torch.where(self.keep != 0, s, torch.finfo(s.dtype).min)
        elif self.form == "additive":  # a mask and a bias: no boolean to read as it is
            s = s.masked_fill(self.keep == 0, float("-inf")) + 0.5 * self.keep
        else:
            s = s.masked_fill(self.keep == 0, float("-inf"))
        return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype, d, ours", [(torch.float32, 24, True), (torch.float64, 16, False),
                                            (torch.float32, 320, False)])
def test_a_buffer_mask_of_no_structure_runs_our_kernel_where_it_can(dtype, d, ours, device):
    """A mask in a buffer found at run time to be neither causal nor a window runs our kernel over its tile
    lists where our kernel takes q (16/32-bit floats, head dims up to 256), else SDPA with the mask; found by
    review, where fp64 raised inside the call and the graph ran eagerly."""
    import fuser.pipeline as pipeline
    torch.manual_seed(37)
    keep = (torch.rand(1, 1, 48, 48, device=device) < 0.6).to(dtype)
    keep.diagonal(dim1=-2, dim2=-1).fill_(1)
    model = _KeepBuffer(keep)
    q, k, v = (torch.randn(2, 2, 48, d, device=device, dtype=dtype) for _ in range(3))
    listed, real = [], pipeline.run_attention
    pipeline.run_attention = lambda *a, **kw: listed.append(bool(kw["mod"].data_mask)) or real(*a, **kw)
    try:
        fused = fuser.fuse(model)
        with torch.no_grad():
            got = fused(q, k, v)
    finally:
        pipeline.run_attention = real
    torch.testing.assert_close(got, model(q, k, v), **TOL.get(dtype, TOL[torch.float32]))
    assert listed == ([True] if ours else []), listed
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks


@pytest.mark.parametrize("dtype, d, form", [(torch.float32, 24, "masked_fill"), (torch.float64, 16, "masked_fill"),
                                            (torch.float32, 24, "where, finfo.min"), (torch.float64, 16, "where, finfo.min"),
                                            (torch.float32, 24, "additive")])
def test_a_buffer_mask_of_no_structure_keeps_its_lists_and_nan_rows(dtype, d, form, device):
    """A mask made from a buffer alone, of no structure, with a row that keeps no key: eager's NaN there (-inf
    fill) or uniform average (finfo.min), from our kernel itself (fp32) or SDPA's call with the mask clamped and
    that row set back to NaN (fp64, which our kernel does not take); neither the clamp nor the row check is
    computed in the graph, and a boolean mask (masked_fill's, torch.where's) is read as it is, no additive copy
    made.  Its tile lists are made once while the buffer is unchanged, and again after a write in place or the
    buffer pointed at other memory (`.data =`), whose values the outputs follow."""
    torch.manual_seed(38)
    keep = _random_keep(45, dtype, device)
    keep[..., 5, :] = 0  # row 5 keeps no key: NaN in eager
    model = _KeepBuffer(keep, form)
    with _lists_made() as made:
        fused = fuser.fuse(model)
        with torch.no_grad():
            for step in range(6):
                if step == 2:
                    model.keep[..., 30, :7] = 1 - model.keep[..., 30, :7]  # a write in place: new value, new lists
                if step == 4:  # other memory under the same tensor (no version bump): new lists too
                    model.keep.data = model.keep.flip(-1).clone()
                    model.keep[..., 5, :] = 0
                q, k, v = (torch.randn(2, 3, 45, d, device=device, dtype=dtype) for _ in range(3))
                got, want = fused(q, k, v), model(q, k, v)
                assert want[:, :, 5].isnan().all() == (form != "where, finfo.min")
                torch.testing.assert_close(got, want, equal_nan=True, **TOL.get(dtype, TOL[torch.float32]))
    assert len(made) == (3 if dtype == torch.float32 else 0), made
    text = str(fused.report)
    assert "where SDPA takes it" in text or dtype == torch.float32 and "clamped" not in text, text
    assert ("read as the mask" in text) == (form != "additive"), text
    assert not any(r.kind == "reduction" for r in fused.report.regions), fused.report  # no row check in the graph
    assert all(r.kind == "attention" for r in fused.report.regions) == (form != "additive"), fused.report  # nor a mask
