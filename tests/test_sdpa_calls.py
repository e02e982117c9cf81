"""SDPA calls in Dynamo's graph (fuser/sdpa_calls.py): a mask made from constants that keeps every key is
dropped, one that is the causal mask made is_causal, any other mask kept; in training on CUDA, the fused kernel eager picks is pinned for the trace."""
import pytest
import torch
import torch.nn.functional as F

import fuser
from tolerances import tol

DROPPED = "attention masks that keep every key dropped"
CAUSAL_NOTE = "causal attention masks made is_causal"
B, S, H, D = 2, 37, 3, 16


def _keep_all_arange(q):  # transformers' bidirectional mask under compile (5.17): q_index >= 0, expanded
    s = q.shape[-2]
    return (torch.arange(s, device=q.device)[None, None, :, None] >= 0).expand(q.shape[0], -1, s, s)


KEEP_ALL = {
    "arange >= 0, expanded": _keep_all_arange,
    "additive zeros": lambda q: torch.zeros(q.shape[-2], q.shape[-2], device=q.device, dtype=q.dtype),
    "ones as bool": lambda q: torch.ones(q.shape[-2], q.shape[-2], device=q.device).bool(),
}
def _positions(q):
    s = q.shape[-2]
    return torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]


def _hf_causal(q):  # transformers' causal mask under compile (5.17): kv <= q, and the packed-sequence check
    b, s = q.shape[0], q.shape[-2]
    pos = torch.arange(s, device=q.device)[None].expand(b, -1)
    packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    qi, ki = _positions(q)
    same = packed[:, None, :, None] == packed[:, None, None, :]
    return ((ki <= qi)[None, None] & same).expand(b, -1, s, s)


CAUSAL = {
    "transformers' (aranges, packed-sequence check)": _hf_causal,
    "tril of ones": lambda q: torch.ones(q.shape[-2], q.shape[-2], device=q.device, dtype=torch.bool).tril(),
    "additive -inf above the diagonal": lambda q: torch.zeros(q.shape[-2], q.shape[-2], device=q.device).masked_fill(
        _positions(q)[1] > _positions(q)[0], float("-inf")),
    "additive fp32 lowest above the diagonal": lambda q: torch.where(
        _positions(q)[1] > _positions(q)[0], torch.finfo(torch.float32).min, 0.0).to(q.dtype),
}
MASKS_SOMETHING = {
    "causal shifted by one key": lambda q: _positions(q)[1] <= _positions(q)[0] + 1,
    "additive fp16 lowest above the diagonal": lambda q: torch.where(  # a score near fp16's largest outweighs it
        _positions(q)[1] > _positions(q)[0], torch.finfo(torch.float16).min, 0.0).to(q.dtype),
    "causal but one key": lambda q: (_positions(q)[1] <= _positions(q)[0]) & (_positions(q)[1] != 5),
    "additive -inf on key 3": lambda q: torch.where(torch.arange(q.shape[-2], device=q.device) == 3,
                                                   float("-inf"), 0.0).to(q.dtype)[None, :],
    "additive NaN on key 0": lambda q: torch.where(torch.arange(q.shape[-2], device=q.device) == 0,
                                                  float("nan"), 0.0).to(q.dtype)[None, :],
}


_first = [0]  # the first report of the running test


@pytest.fixture(autouse=True)
def _own_reports():
    _first[0] = len(fuser.reports())


def _reports():
    return fuser.reports()[_first[0]:]


def _dropped() -> list[str]:
    return [n for r in _reports() for n in r.notes if n.startswith(DROPPED)]


def _qkv(device, grad=False):
    """q, k, v: [B, H, S, D] viewed from [B, S, H, D] (not contiguous), as models make them."""
    torch.manual_seed(0)
    return [torch.randn(B, S, H, D, device=device).transpose(1, 2).requires_grad_(grad) for _ in range(3)]


def _attention(make_mask):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(q)) * 1.5
    return f


def _check(f, device, train, dynamic=None):
    q, k, v = _qkv(device, grad=train)
    compiled = torch.compile(f, backend="fuser", dynamic=dynamic)
    if not train:
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), equal_nan=True, **tol(torch.float32))
        return
    w = torch.randn(B, H, S, D, device=device)
    got = torch.autograd.grad((compiled(q, k, v) * w).sum(), (q, k, v))
    want = torch.autograd.grad((f(q, k, v) * w).sum(), (q, k, v))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, equal_nan=True, **tol(torch.float32))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask", list(KEEP_ALL))
def test_a_constant_mask_that_keeps_every_key_is_dropped(device, mask, train):
    _check(_attention(KEEP_ALL[mask]), device, train)
    notes = _dropped()
    assert len(notes) == 1 and notes[0].startswith(f"{DROPPED}: 1 SDPA call"), notes
    code = "\n".join(line for r in _reports() for line in r.code)
    assert "arange" not in code and "ones" not in code and "zeros" not in code, code


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask", list(CAUSAL))
def test_a_constant_causal_mask_becomes_is_causal(device, mask, train):
    _check(_attention(CAUSAL[mask]), device, train)
    assert not _dropped()
    notes = [n for r in _reports() for n in r.notes if n.startswith(CAUSAL_NOTE)]
    assert len(notes) == 1 and notes[0].startswith(f"{CAUSAL_NOTE}: 1 SDPA call"), notes
    code = "\n".join(line for r in _reports() for line in r.code)
    assert "arange" not in code and "tril" not in code and "where" not in code, code


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask", list(MASKS_SOMETHING))
def test_a_mask_that_masks_a_key_is_kept(device, mask, train):
    _check(_attention(MASKS_SOMETHING[mask]), device, train)
    assert not _dropped()
    assert not [n for r in _reports() for n in r.notes if n.startswith(CAUSAL_NOTE)]


def test_a_mask_from_an_input_or_a_random_op_or_a_size_that_varies_is_kept(device):
    """Only a value known at compile time is evaluated: an input's mask (all True here) stays, as does one
    drawn from a generator (all True too, but evaluating it would move the generator), and one whose size
    is symbolic."""
    keep = torch.ones(S, S, dtype=torch.bool, device=device)
    _check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep), device, False)
    _check(_attention(lambda q: torch.rand(q.shape[-2], q.shape[-2], device=q.device) >= 0), device, False)
    _check(_attention(_keep_all_arange), device, False, dynamic=True)
    assert not _dropped()


def test_a_dropped_mask_still_returned_is_kept_for_its_reader(device):
    def f(q, k, v):
        mask = _keep_all_arange(q)
        return F.scaled_dot_product_attention(q, k, v, mask), mask
    q, k, v = _qkv(device)
    got, want = torch.compile(f, backend="fuser")(q, k, v), f(q, k, v)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **tol(g.dtype))
    assert len(_dropped()) == 1


def test_mask_dropping_is_off_with_attention_off(device):
    q, k, v = _qkv(device)
    f = _attention(_keep_all_arange)
    torch.testing.assert_close(torch.compile(f, backend="fuser", options={"attention": False})(q, k, v), f(q, k, v),
                               **tol(torch.float32))
    assert not _dropped()


@pytest.mark.parametrize("mask", [None, "arange >= 0, expanded"])
def test_sdpa_calls_run_the_kernel_eager_picks_in_training(device, mask):
    """Attention over queries viewed from [B, S, H, D] (197 tokens, bf16, no mask or one that keeps every key):
    traced with fake tensors SDPA takes its math path (fp32 matmuls, 5x slower) where real tensors take cuDNN
    or flash; the claim pins the kernel eager picks, whose own backward AOT traces.  Gradients as eager's
    either way, and the note exactly where the two choices differ."""
    if device != "cuda":
        pytest.skip("SDPA's fused kernels (and the trace's disagreement over them) are CUDA's")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fuser.sdpa_calls import eager_sdpa_choice
    b, s, h, d = 32, 197, 12, 64  # the math path under fake tensors on an H200 (run 97)
    proj = torch.nn.Linear(h * d, 3 * h * d, device=device, dtype=torch.bfloat16)

    def f(x):
        q, k, v = proj(x).view(b, s, 3, h, d).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else KEEP_ALL[mask](q))
        return o.float().square().mean()
    x = torch.randn(b, s, h * d, device=device, dtype=torch.bfloat16, requires_grad=True)
    got = torch.autograd.grad(torch.compile(f, backend="fuser")(x), [x, proj.weight])
    want = torch.autograd.grad(f(x), [x, proj.weight])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **tol(torch.bfloat16, scale=2))
    q = torch.empty(b, s, 3, h, d, device=device, dtype=torch.bfloat16)[:, :, 0].transpose(1, 2).requires_grad_()
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        traced_choice = int(torch._fused_sdp_choice(fq, fq, fq))
        eager_choice = eager_sdpa_choice(fq, fq, fq, False, None)
    notes = [n for r in _reports() for n in r.notes if n.startswith("SDPA calls claimed")]
    assert bool(notes) == (traced_choice != eager_choice and eager_choice != 0), (traced_choice, eager_choice, notes)
    assert len(_dropped()) == (mask is not None)


def _written_in_place(kind):
    def f(q, k, v):
        s = q.shape[-2]
        if kind == "tril_":
            m = torch.ones(s, s, dtype=torch.bool, device=q.device)
            m.tril_()
        elif kind == "setitem":
            m = torch.zeros(s, s, device=q.device)
            m[:, 3] = float("-inf")
        elif kind == "masked_fill_":
            m = torch.zeros(s, s, device=q.device)
            m.masked_fill_(torch.arange(s, device=q.device)[None, :] > torch.arange(s, device=q.device)[:, None], -1e4)
        elif kind == "out=":
            m = torch.zeros(s, s, device=q.device)
            torch.add(m, torch.full((s, s), -1e4, device=q.device).triu(1), out=m)
        elif kind == "a view's base":
            base = torch.ones(s, s + 5, dtype=torch.bool, device=q.device)
            m = base[:, :s]
            base[:, 3] = False
        else:  # "zero_, its base read after": dropping must not erase the write
            t = torch.full((s, s), 5.0, device=q.device)
            m = t.zero_()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m) + t.sum()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return f


@pytest.mark.parametrize("kind", ["tril_", "setitem", "masked_fill_", "out=", "a view's base", "zero_, its base read after"])
def test_a_mask_written_in_place_is_kept(device, kind):
    """Dynamo's graph is not functional: the mask's node is the tensor as made, the write a node of its own that
    the call does not read.  Evaluated alone, these masks keep every key; written, they do not."""
    _check(_written_in_place(kind), device, False)
    assert not _dropped()


def test_a_mask_made_under_autocast_in_the_graph_is_kept(device):
    """A mask 0 in fp32 but not under autocast's 16-bit matmul: evaluated without the autocast the graph
    switches on, it would look all-keep."""
    def f(q, k, v):
        row = torch.tensor([[257.0] + [256.0] * (q.shape[-2] - 1)], device=q.device)
        with torch.autocast(q.device.type, dtype=torch.bfloat16):
            m = (torch.mm(torch.ones(1, 1, device=q.device), row) - row).float()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    _check(f, device, False)
    assert not _dropped()


def test_a_mask_that_widens_the_output_or_comes_with_is_causal_is_kept(device):
    """Eager raises for both (a mask broadcast past the scores' shape; a mask with is_causal on its math path):
    dropping the mask would answer where eager does not."""
    q, k, v = (torch.randn(3, S, D, device=device) for _ in range(3))

    def wide(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 3, S, S, dtype=torch.bool, device=q.device))

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_keep_all_arange(q), is_causal=True)
    for f in (wide, causal):
        torch._dynamo.reset()
        try:
            torch.compile(f, backend="fuser")(q, k, v)
        except Exception:  # noqa: BLE001 - raising, as eager does, is right; answering from a dropped mask is not
            pass
    assert not _dropped()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_mask_with_a_strided_last_dimension_is_laid_out_for_the_fused_kernels(device, train):
    """T5's position bias: a learned [1, H, S, S] bias viewed from [1, S, S, H], so its last dimension is strided;
    SDPA's fused kernels need it contiguous (eager takes the math path).  On CUDA it is copied first (the note);
    values and gradients (the bias's too) as eager's; on CPU nothing changes."""
    bias = torch.randn(1, S, S, H, device=device, requires_grad=train)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.permute(0, 3, 1, 2)) * 1.5
    q, k, v = _qkv(device, grad=train)
    compiled = torch.compile(f, backend="fuser")
    if train:
        w = torch.randn(B, H, S, D, device=device)
        got = torch.autograd.grad((compiled(q, k, v) * w).sum(), (q, k, v, bias))
        want = torch.autograd.grad((f(q, k, v) * w).sum(), (q, k, v, bias))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, **tol(torch.float32, scale=10))  # the fused kernel's sums against math's
    else:
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), **tol(torch.float32, scale=10))
    notes = [n for r in _reports() for n in r.notes if n.startswith("attention masks laid out for SDPA's fused kernels")]
    assert len(notes) == (device == "cuda"), notes


def test_operators_are_no_writes_in_place():
    """Dynamo keeps a tensor `a == b` as `call_method __eq__` (torch 2.11) and `a & b` as operator.and_: neither
    writes its tensor, so a mask made with them is still evaluated; `__iand__`, `add_` and setitem write."""
    import operator

    import torch.fx as fx

    from fuser.sdpa_calls import _plain, _writes
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    reads = [g.call_method("__eq__", (a, b)), g.call_method("__and__", (a, b)), g.call_function(operator.and_, (a, b)),
             g.call_function(operator.or_, (a, b)), g.call_method("cumsum", (a, -1))]
    writes = [g.call_method("__iand__", (a, b)), g.call_method("add_", (a, b)), g.call_function(operator.setitem, (a, 0, b)),
              g.call_function(operator.iand, (a, b))]
    for n in reads:
        assert _writes(n) == [] and _plain(n), n.format_node()
    for n in writes:
        assert list(_writes(n)) == [a], n.format_node()
    assert not any(_plain(n) for n in writes[:2])


def test_a_mask_past_the_evaluation_limit_is_kept(device, monkeypatch):
    """A mask is evaluated at compile time only within MASK_LIMIT_BYTES a value: past it (lowered here below the
    [B, 1, S, S] mask's bytes) the mask stays, as SDPA's mask; the limit as shipped reads a causal LM's mask at
    B8 T4096 (bool), where the causal kernels save the most."""
    from fuser import fold, sdpa_calls
    assert sdpa_calls.MASK_LIMIT_BYTES >= 8 * 4096 * 4096 > fold.FOLD_LIMIT_BYTES
    monkeypatch.setattr(sdpa_calls, "MASK_LIMIT_BYTES", B * S * S - 1)
    _check(_attention(_hf_causal), device, False)
    assert not [n for r in _reports() for n in r.notes if n.startswith(CAUSAL_NOTE)]


def test_a_broadcast_mask_is_checked_at_its_own_size():
    """A mask expanded over batch and heads (stride 0) is compared at its stored size: a [L, S] tril expanded to
    2^24 batches (1 GiB as bool) is checked without materialising the expansion; a row broadcast over the queries
    is causal only for one query."""
    from fuser.sdpa_calls import _causal, _keeps_every_key, _stored
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    wide = tril.expand(1 << 24, 8, 8)
    assert _stored(wide).numel() == 64
    assert _causal(wide, 8, 8) and not _keeps_every_key(wide)
    assert _causal(torch.where(wide, 0.0, float("-inf")), 8, 8)
    row = tril[:1]  # [1, 8]: key 0 only
    assert not _causal(row.expand(3, 8, 8), 8, 8) and _causal(row.expand(3, 1, 8), 1, 8)
    assert _keeps_every_key(torch.ones(1, 1, dtype=torch.bool).expand(1 << 24, 8, 8))
