"""Real models, called the normal way: Hugging Face GPT-2, LLaMA and BERT from small configs.

Outputs match eager, and the memory-bound work outside attention (norms, activations and gates,
residual adds, RoPE) sits inside fused regions.  fp32 on CPU: tolerances are fp32 reordering.
"""
import re

import pytest
import torch

import fuser
from helpers import fused_ops

transformers = pytest.importorskip("transformers")

TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _run(model, inputs, device):
    model = model.to(device, _dtype(device)).eval()
    fused = fuser.fuse(model)
    with torch.no_grad():
        out = fused(**inputs)
        ref = model(**inputs)
    return fused, out, ref


def test_llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa")
    ids = torch.randint(0, 211, (2, 37), device=device)
    fused, out, ref = _run(transformers.LlamaForCausalLM(cfg), {"input_ids": ids}, device)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.logits, ref.logits, **TOL[_dtype(device)])
    ops = fused_ops(fused.report)
    # RMSNorm (pow/mean/rsqrt), SiLU gate (sigmoid), RoPE (neg/cat), residual adds
    assert {"pow", "mean", "rsqrt", "sigmoid", "neg", "cat", "add"} <= ops
    kinds = {r.kind for r in fused.report.regions}
    assert kinds == {"pointwise", "reduction"}
    assert all(r.k >= 1.0 for r in fused.report.regions)
    assert "matmul" in " ".join(u.reason for u in fused.report.unfused)


def test_gpt2(device):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=211, n_embd=96, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 211, (2, 37), device=device)
    fused, out, ref = _run(transformers.GPT2LMHeadModel(cfg), {"input_ids": ids}, device)
    torch.testing.assert_close(out.logits, ref.logits, **TOL[_dtype(device)])
    ops = fused_ops(fused.report)
    assert {"var_mean", "rsqrt", "add"} <= ops  # LayerNorm with its residual add
    if _dtype(device) in (torch.float16, torch.bfloat16):  # GELU(tanh) in c_fc's epilogue (fuser/epilogue.py)
        assert "tanh" not in ops and any("gelu (tanh) in cuBLASLt's epilogue" in n for n in fused.report.notes)
    else:  # fp32: GELU(tanh) a region
        assert "tanh" in ops
    text = str(fused.report)
    rows = _table_rows(text)
    assert len(rows) == len(fused.report.regions) > 0, text
    assert text.splitlines()[0].startswith(f"fuser: {len(fused.report.regions)} fused regions"), text
    for row, r in zip(rows, fused.report.regions):
        assert row["kind"] == r.kind and row["#"] == f"{r.graph}.{r.id}", (row, r)
        k = float(row["k"])
        assert r.bytes_fused > 0 and abs(k - r.bytes_unfused / r.bytes_fused) <= 0.005, (row, r)
        if any("var_mean" in o for o in r.ops):  # LayerNorm: x read once instead of once per op
            assert r.kind == "reduction" and k > 1.5, (row, r)
    assert sum("var_mean" in row["ops"] for row in rows) >= 2 * cfg.n_layer + 1  # ln_1, ln_2 per block, ln_f


def _table_rows(text: str) -> list[dict]:
    """The region table of a printed FusionReport, as dicts keyed by its header (cells are separated
    by two or more spaces; no cell contains two spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return rows


def test_bert_with_padding_mask(device):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=211, hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=160, max_position_embeddings=64, attn_implementation="sdpa")
    ids = torch.randint(0, 211, (2, 37), device=device)
    mask = torch.ones(2, 37, dtype=torch.long, device=device)
    mask[1, 30:] = 0
    fused, out, ref = _run(transformers.BertModel(cfg), {"input_ids": ids, "attention_mask": mask}, device)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, **TOL[_dtype(device)])
    assert {"var_mean", "rsqrt", "add"} <= fused_ops(fused.report)  # LayerNorm with its residual add
    # GELU sits alone between two matmuls: k = 1, so the cost model leaves it eager, and says so
    assert any(u.op.startswith("aten.gelu") and "alone" in u.reason for u in fused.report.unfused)


def test_llama_new_length_compiles_once_generically(device):
    """A new sequence length compiles once more, with the length symbolic: later lengths reuse that
    graph; no kernel made for other sizes runs (each kernel checks the sizes it is given)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(device, _dtype(device)).eval()
    fused = fuser.fuse(model)
    with torch.no_grad():
        for t in (9, 17, 23):
            ids = torch.randint(0, 97, (1, t), device=device)
            torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits,
                                       **TOL[_dtype(device)])
            shapes = [s for r in fused.report.regions for s in r.output_shapes]
            if t == 9:
                assert any("[1, 9, 64]" in s for s in shapes), shapes
            else:
                assert fused.report.regions and all(r.symbolic for r in fused.report.regions if r.kind != "attention")
    assert len([r for r in fused.reports if not r.notes or "backward" not in " ".join(r.notes)]) == 2


def test_llama_decode_over_a_static_cache(device):
    """Decode steps over a StaticCache (GQA 6/2 heads, one token a step, positions given as tensors:
    one graph).  Logits and the cache follow eager's step by step; the cache is written in place
    (no copy of it, no copy back) by the kernel that rotates the keys, beside the queries', and K/V
    are not repeated to every query head."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(device, _dtype(device)).eval()
    caches = [transformers.StaticCache(config=cfg, max_cache_len=41) for _ in range(2)]
    prompt = torch.randint(0, 97, (1, 13), device=device)
    fused = fuser.fuse(model, dynamic=False)
    with torch.no_grad():
        for cache in caches:  # prefill, eagerly, both caches alike
            model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(13, device=device))
        for step in range(4):
            pos = torch.tensor([13 + step], device=device)
            tok = torch.randint(0, 97, (1, 1), device=device)
            kw = dict(input_ids=tok, position_ids=pos[None], use_cache=True, cache_position=pos)
            out = fused(past_key_values=caches[0], **kw).logits
            ref = model(past_key_values=caches[1], **kw).logits
            torch.testing.assert_close(out, ref, **TOL[_dtype(device)])
            for a, b in zip(caches[0].layers, caches[1].layers):
                torch.testing.assert_close(a.keys, b.keys, **TOL[_dtype(device)])
                torch.testing.assert_close(a.values, b.values, **TOL[_dtype(device)])
    assert not [f for r in fused.reports for f in r.all_fallbacks], [r.all_fallbacks for r in fused.reports]
    code, notes = fused.code, " ".join(fused.report.notes)
    assert "index_put" not in code and "clone" not in code and "copy_" not in code, code
    layers = [r for r in fused.report.regions if r.ops.count("aten.index_put.default") == 2]
    # per layer one kernel: q and k rotated (neg: rotate_half), k and v stored into the cache at the position
    assert len(layers) == 2 and all("aten.neg.default" in r.ops and len(set(r.output_shapes)) == 2 for r in layers), \
        fused.report
    assert "written in place" in notes and "shares K and V" in notes, notes
    assert len(fused.reports) == 1
