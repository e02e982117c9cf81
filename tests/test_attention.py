"""Attention written out by hand is recognised and runs as one flash-attention kernel.

fp32 on CPU (the interpreter's tl.dot is right there), bf16 on the GPU.  Fully masked rows must give
what eager gives (NaN for -inf masks), so comparisons use equal_nan.
"""
import math

import pytest
import torch

import fuser

TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
transformers = pytest.importorskip("transformers")


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _check(fn, *args, attention=1):
    fused = fuser.fuse(fn)
    with torch.no_grad():
        out, ref = fused(*args), fn(*args)
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[args[0].dtype])
    kinds = [r.kind for r in fused.report.regions]
    assert kinds.count("attention") == attention, fused.report
    return fused


def _qkv(device, b=2, h=3, m=37, n=37, d=16, hkv=None):
    dt = _dtype(device)
    return (torch.randn(b, h, m, d, device=device, dtype=dt), torch.randn(b, hkv or h, n, d, device=device, dtype=dt),
            torch.randn(b, hkv or h, n, d, device=device, dtype=dt))


@pytest.mark.parametrize("where", ["in_graph", "closure"])
def test_causal_masked_fill(where, device):
    """The research-code form Inductor misses: a triangular mask through masked_fill.  Built in the
    graph from constants, the mask is folded at compile time and known causal (tiles above the
    diagonal are skipped); a tensor from outside is data, loaded per tile."""
    torch.manual_seed(0)
    q, k, v = _qkv(device)
    outside = torch.ones(37, 37, device=device, dtype=torch.bool).triu(1)

    def attn(q, k, v):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(37, 37, device=q.device, dtype=torch.bool).triu(1) if where == "in_graph" else outside
        s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    fused = _check(attn, q, k, v)
    r = [r for r in fused.report.regions if r.kind == "attention"][0]
    assert r.k > 2 and "attention_fwd" in r.source
    assert ("causal (offset 0)" in r.source) == (where == "in_graph")


def test_softcap_alibi_and_padding_with_fully_masked_rows(device):
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

    _check(attn, q, k, v)


def test_additive_finfo_min_mask(device):
    torch.manual_seed(2)
    q, k, v = _qkv(device, m=23, n=23)
    pad = torch.ones(2, 23, device=device)
    pad[1, 15:] = 0
    bias = ((1.0 - pad[:, None, None, :]) * torch.finfo(q.dtype).min).to(q.dtype)  # as BERT builds it

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v

    _check(attn, q, k, v)


def test_gqa_repeat_kv_is_not_materialised(device):
    torch.manual_seed(3)
    q, k, v = _qkv(device, h=4, hkv=2)

    def attn(q, k, v):
        k = k[:, :, None].expand(2, 2, 2, 37, 16).reshape(2, 4, 37, 16)
        v = v[:, :, None].expand(2, 2, 2, 37, 16).reshape(2, 4, 37, 16)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v

    fused = _check(attn, q, k, v)
    (r,) = [r for r in fused.report.regions if r.kind == "attention"]
    assert any("[2, 2, 37, 16]" in s for s in r.input_shapes)  # the shared heads, not the repeated copy


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


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hf_eager_attention_is_recognised(name, device):
    torch.manual_seed(6)
    kw = {}
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="eager"))
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
    if name == "bert":  # a padding mask is data: never taken for a causal structure
        assert not any("causal (offset" in r.source for r in fused.report.regions if r.kind == "attention")
    key = "last_hidden_state" if name == "bert" else "logits"
    tol = dict(atol=1e-3, rtol=1e-3) if device == "cpu" else dict(atol=8e-2, rtol=8e-2)
    torch.testing.assert_close(out[key], ref[key], **tol)
    assert [r.kind for r in fused.report.regions].count("attention") == 2
