"""Grouped-query attention of one new token reads the KV cache as cached, not once per query head.

Models repeat K and V to every query head before calling SDPA with a mask (HF's `repeat_kv`:
unsqueeze -> expand -> clone -> view).  In a decode step (query length 1) the copies are most of the
attention: on an H100, LLaMA's 4 KV heads x 1040 cached tokens copied to 16 heads took 48 us of a
466 us step.  SDPA shares the heads itself with `enable_gqa=True`, with a mask too: for one query
row over 1040 / 4096 cached tokens (bf16, 16/4 heads, D128) 13.8 / 16.1 us against 30.6 / 62.1 us
for repeat + SDPA (bench/decode_attention.py, H100, 2026-11-23).  Viewing the query heads that share
a KV head as query rows of it (no enable_gqa) was no faster there (cuDNN picks a 64-row tile for
4 rows), so this is the rewrite.  Longer queries keep the repeat: enable_gqa with a mask was not
measured for them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fuser.patterns.attention import undo_repeat_kv

from .graph import fake_mode_of, insert, refresh_fake, shape

aten = torch.ops.aten
# SDPA as AOT Autograd leaves it (one op per backend, chosen at trace time), and as our lowering emits it
_SDPA = {aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default, aten.scaled_dot_product_attention.default}


def shared(q, kv) -> fx.Node | None:
    """The K or V that repeat_kv copied to each of q's heads (patterns' undo_repeat_kv), when its
    heads map onto q's as enable_gqa maps them (head h reads h // g), else None."""
    x = undo_repeat_kv(kv, [])
    if x is kv:
        return None
    (b, h), (bx, hx) = shape(q)[:2], shape(x)[:2]
    if bx != b or shape(x)[2:] != shape(kv)[2:] or shape(kv)[1] != h or not (h / hx).is_Integer:
        return None
    return x


def share_kv_heads(gm: fx.GraphModule) -> list[str]:
    """Rewrites every SDPA call of one query row over repeated K and V into SDPA with enable_gqa
    over K and V as they were; returns a line per call for the report.  Only where nothing reads the
    call's other outputs (inference), without dropout."""
    notes, made, mode = [], [], None
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _SDPA:
            continue
        a = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True).kwargs
        q, k, v = a["query"], a["key"], a["value"]
        k0, v0 = shared(q, k), shared(q, v)
        if k0 is None or v0 is None or shape(k0)[1] != shape(v0)[1] or a.get("dropout_p", 0.0) \
                or a.get("enable_gqa", False) or shape(q)[2] != 1:
            continue
        users = [n] if n.target is aten.scaled_dot_product_attention.default else list(n.users)
        if n.target is not aten.scaled_dot_product_attention.default and any(
                u.target is not operator.getitem or u.args[1] != 0 for u in users):
            continue  # the log-sum-exp is used (a forward saving it for a backward)
        mode = mode or fake_mode_of(gm.graph)
        out = insert(gm.graph, n, mode, aten.scaled_dot_product_attention.default, q, k0, v0,
                     attn_mask=a.get("attn_mask", a.get("attn_bias")), is_causal=a.get("is_causal", False),
                     scale=a.get("scale"), enable_gqa=True)
        made.append(out)
        notes.append(f"{n.name}: {shape(q)[1]} query heads over {shape(k0)[1]} KV heads (enable_gqa)")
        for u in users:
            u.replace_all_uses_with(out)
            if u is not n:
                gm.graph.erase_node(u)
        gm.graph.erase_node(n)  # explicitly: a seeded op (dropout_p) is not dead code to fx
    if notes:
        gm.graph.eliminate_dead_code()
        refresh_fake(gm, made)  # the output's strides are SDPA's: the views reading it are traced again
        gm.recompile()
    return notes
