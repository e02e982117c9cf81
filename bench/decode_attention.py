"""GQA attention of one new token over a KV cache: which SDPA call is fastest (fuser/gqa.py's choice).

LLaMA-style decode: B1, 16 query heads over 4 KV heads, one query row, a cache of S tokens, D128,
bf16, an additive mask [1, 1, 1, S].  Variants, each checked against the first:
- repeat: K and V repeated to 16 heads (HF's repeat_kv: expand + clone), then SDPA (what models do);
- fold: the 4 query heads sharing a KV head as 4 query rows of it, no repeat; SDPA's own choice;
- fold-efficient / fold-math...: the same under one SDPA backend;
- gqa: SDPA with enable_gqa=True and the mask.
Times are do_bench medians (us), in one run.

    python bench/decode_attention.py [--cache 1040,4096]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def variants(q, k, v, mask, g):
    b, h, _, d = q.shape
    hkv = k.shape[1]

    def repeat():
        kr = k[:, :, None].expand(b, hkv, g, *k.shape[2:]).reshape(b, h, *k.shape[2:])
        vr = v[:, :, None].expand(b, hkv, g, *v.shape[2:]).reshape(b, h, *v.shape[2:])
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)

    def fold():
        return F.scaled_dot_product_attention(q.reshape(b, hkv, g, d), k, v, attn_mask=mask).reshape(b, h, 1, d)

    def under(backend):
        def run():
            with sdpa_kernel([backend]):
                return fold()
        return run

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return {"repeat": repeat, "fold": fold, "fold-efficient": under(SDPBackend.EFFICIENT_ATTENTION),
            "fold-cudnn": under(SDPBackend.CUDNN_ATTENTION), "fold-math": under(SDPBackend.MATH), "gqa": gqa}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="1040,4096")
    args = p.parse_args()
    print(f"# GQA decode attention: {torch.cuda.get_device_name()}, torch {torch.version.__version__}\n")
    print("| cache | variant | us | max err vs repeat |\n|---|---|---|---|")
    for s in map(int, args.cache.split(",")):
        torch.manual_seed(0)
        q = torch.randn(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 4, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = torch.zeros(1, 1, 1, s, device="cuda", dtype=torch.bfloat16)
        mask[..., s - 7:] = torch.finfo(torch.bfloat16).min  # the cache's unfilled slots
        runs = variants(q, k, v, mask, 4)
        ref = runs["repeat"]()
        for name, fn in runs.items():
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
                print(f"| {s} | {name} | {us:.1f} | {err:.1e} |")
            except RuntimeError as e:
                print(f"| {s} | {name} | — | {str(e).splitlines()[0][:80]} |")


if __name__ == "__main__":
    main()
