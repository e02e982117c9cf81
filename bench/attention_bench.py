"""Hand-written attention: eager, Inductor, fuser and SDPA (flash) side by side on the GPU.

Each row is attention as research code writes it (matmul, scale, mask, softmax, matmul); SDPA is the
same attention through `F.scaled_dot_product_attention`, the bar fuser's kernel is held to.  Writes
bench/results/<gpu>-<date>-attention.{json,md} (or to --out).

    python bench/attention_bench.py [--out DIR]
"""
import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fuser  # noqa: E402

BF16 = torch.bfloat16


def hand_written(causal: bool, groups: int):
    def attn(q, k, v):
        if groups > 1:  # repeat_kv, as HF writes it
            b, h, n, d = k.shape
            k = k[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
            v = v[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if causal:
            m = q.shape[-2]
            s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return attn


def sdpa(causal: bool, groups: int):
    def attn(q, k, v):
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attn


ROWS = [  # name, B, Hq, Hkv, S, D, causal
    ("no mask", 4, 16, 16, 4096, 128, False),
    ("causal (masked_fill)", 4, 16, 16, 4096, 128, True),
    ("causal, short", 16, 16, 16, 1024, 64, True),
    ("GQA 32/8, causal", 4, 32, 8, 2048, 128, True),
]


def peak_extra(fn, args):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_row(name, b, hq, hkv, s, d, causal):
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=BF16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=BF16)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=BF16)
    groups = hq // hkv
    eager, ref_fn = hand_written(causal, groups), sdpa(causal, groups)
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    row = {"row": name, "shape": f"B{b} H{hq}/{hkv} S{s} D{d}"}
    with torch.no_grad():
        ref = ref_fn(q, k, v)
        t = time.perf_counter()
        fused = fuser.fuse(eager)
        out = fused(q, k, v)
        torch.cuda.synchronize()
        row["fuser_compile_s"] = time.perf_counter() - t
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        row["rel_err_vs_sdpa"] = err
        row["recognised"] = [r.kind for r in fused.report.regions].count("attention")
        torch._dynamo.reset()
        inductor = torch.compile(eager)
        inductor(q, k, v)
        for label, fn in (("eager", eager), ("inductor", inductor), ("fuser", fused), ("sdpa", ref_fn)):
            ms = do_bench(lambda fn=fn: fn(q, k, v), warmup=25, rep=100, return_mode="median")
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = flops / ms / 1e9
        if s >= 4096:
            row["fuser_peak_mib"] = peak_extra(fused, (q, k, v))
            row["sdpa_peak_mib"] = peak_extra(ref_fn, (q, k, v))
    row["fuser_vs_sdpa"] = row["sdpa_ms"] / row["fuser_ms"]
    row["fuser_vs_inductor"] = row["inductor_ms"] / row["fuser_ms"]
    return row


def table(rows, gpu):
    head = ("| row | shape | eager ms | inductor ms | fuser ms | SDPA ms | fuser TFLOP/s | fuser/SDPA | "
            "fuser/Inductor | peak MiB fuser / SDPA | rel. err vs SDPA | recognised |")
    lines = [f"# fuser attention bench: {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; bf16; do_bench medians; ratios are speed ratios (>1: fuser faster).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r.get('shape', '')} | error: {r['error']} |")
            continue
        peak = f"{r['fuser_peak_mib']:.0f} / {r['sdpa_peak_mib']:.0f}" if "fuser_peak_mib" in r else ""
        lines.append(f"| {r['row']} | {r['shape']} | {r['eager_ms']:.3f} | {r['inductor_ms']:.3f} | {r['fuser_ms']:.3f} | "
                     f"{r['sdpa_ms']:.3f} | {r['fuser_tflops']:.0f} | {r['fuser_vs_sdpa']:.2f}× | "
                     f"{r['fuser_vs_inductor']:.2f}× | {peak} | {r['rel_err_vs_sdpa']:.1e} | {r['recognised']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for spec in ROWS:
        try:
            rows.append(run_row(*spec))
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            rows.append({"row": spec[0], "error": f"{type(e).__name__}: {e}"[:300]})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    md = table(rows, gpu)
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-attention"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    stem.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
