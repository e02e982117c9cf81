"""Tile sweep of our own attention kernels (attention="triton") on the rows of attention_bench.py,
beside FlexAttention and SDPA in the same run: which (BLOCK_M, BLOCK_N, warps, stages) wins per head
dim, and how far each row is from the libraries.  Forward; with --backward, the backward kernels'
tiles, timed as one training step (forward + backward) of the row: each kernel's (dK/dV, dQ) in turn, the
other's as shipped, then the two winners together.  GPU only.

    python bench/attention_tiles.py [--rows 0,3,4] [--backward] [--out DIR]
"""
import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attention_bench as ab  # noqa: E402
import fuser.codegen.attention as attention_codegen  # noqa: E402
import fuser.codegen.attention_bwd as attention_bwd  # noqa: E402

CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages); every one fits Hopper's shared memory in bf16
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 3),
         (128, 32, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4),
          (128, 64, 8, 4), (128, 128, 8, 2), (128, 64, 8, 2)],
    192: [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3),
          (64, 64, 8, 3)],  # MLA: Q and K tiles padded to 256, V's and the accumulator 128
}


BACKWARD = {  # per kernel: dK/dV owns BLOCK_N keys and walks BLOCK_M queries, dQ the other way round; each
    # holds two accumulators beside its Q, dO, K, V tiles: smaller tiles than the forward's
    64: {"dkdv": [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 2)],
         "dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2)]},
    128: {"dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3),
                   (32, 128, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2)],
          "dq": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3),
                 (128, 32, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)]},
    192: {"dkdv": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 3), (128, 64, 8, 2)],
          "dq": [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)]},
}


def ms(fn):
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def _qkv(b, hq, hkv, s, d, dv, grad=False):
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    return q, k, torch.randn(b, hkv, s, dv or d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def _shape(b, hq, hkv, s, d, dv) -> str:
    return f"B{b} H{hq}/{hkv} S{s} D{d}" + (f"/{dv}" if dv else "")


def sweep(name, b, hq, hkv, s, d, variant, dv=None):
    torch.manual_seed(0)
    q, k, v = _qkv(b, hq, hkv, s, d, dv)
    eager = ab.HandWritten(variant, hq // hkv, s, "cuda")
    row = {"row": name, "shape": _shape(b, hq, hkv, s, d, dv)}
    with torch.no_grad():
        ref = eager(q, k, v).float()
        for label, fn in (("sdpa", ab.sdpa_version(variant, hq, s, "cuda")), ("flex", ab.flex_version(variant, b, hq, s, "cuda"))):
            if fn is not None:
                fn(q, k, v)
                row[label] = ms(lambda: fn(q, k, v))
        torch._dynamo.reset()
        fused = torch.compile(eager, backend="fuser", options={"attention": "triton"})
        plan = attention_codegen.attention_plan
        row["configs"] = {}
        try:
            for cfg in CANDIDATES[d]:
                attention_codegen.attention_plan = lambda *a, cfg=cfg, **kw: cfg
                try:
                    out = fused(q, k, v)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    row["configs"][str(cfg)] = {"ms": ms(lambda: fused(q, k, v)), "err": err}
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
                    row["configs"][str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                print(name, cfg, row["configs"][str(cfg)], flush=True)
        finally:
            attention_codegen.attention_plan = plan
        out = fused(q, k, v)  # the shipped plan
        row["shipped"] = ms(lambda: fused(q, k, v))
        row["shipped_err"] = ((out.float() - ref).norm() / ref.norm()).item()
    return row


def sweep_backward(name, b, hq, hkv, s, d, variant, dv=None):
    """One training step of the row (fuser claims the attention before autograd as our kernel) per
    backward tile config, beside FlexAttention's step."""
    torch.manual_seed(0)
    q, k, v = _qkv(b, hq, hkv, s, d, dv, grad=True)
    g = torch.randn(b, hq, s, dv or d, device="cuda", dtype=torch.bfloat16)
    eager = ab.HandWritten(variant, hq // hkv, s, "cuda")

    def step(fn):
        def run():
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).backward(g)
        return run
    row = {"row": name, "shape": _shape(b, hq, hkv, s, d, dv), "configs": {}}
    step(eager)()
    ref = q.grad.float().clone()  # err: dQ against eager's

    def err():
        return ((q.grad.float() - ref).norm() / ref.norm()).item()
    flex = ab.flex_version(variant, b, hq, s, "cuda")
    step(flex)()
    row["flex"] = ms(step(flex))
    torch._dynamo.reset()
    fused = torch.compile(eager, backend="fuser", options={"attention": "triton"})
    plan = attention_bwd.attention_bwd_plan
    shipped = plan(d, torch.bfloat16, True, head_dim_v=dv)

    def timed(pair):
        attention_bwd.attention_bwd_plan = lambda *a, **kw: pair
        try:
            step(fused)()
            row["configs"][str(pair)] = {"ms": ms(step(fused)), "err": err()}
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
            row["configs"][str(pair)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        print(name, "backward", pair, row["configs"][str(pair)], flush=True)
        return row["configs"][str(pair)].get("ms", float("inf"))
    try:  # each kernel's tiles with the other's as shipped, then the two winners together; over a data mask's
        # lists (made for one tile shape) the two kernels share the dQ kernel's
        if variant == "causal-padding":
            min((c for c in BACKWARD[d]["dkdv"] + BACKWARD[d]["dq"]), key=lambda c: timed((c, c)))
        else:
            best_kv = min(BACKWARD[d]["dkdv"], key=lambda c: timed((c, shipped[1])))
            best_q = min(BACKWARD[d]["dq"], key=lambda c: timed((shipped[0], c)))
            timed((best_kv, best_q))
    finally:
        attention_bwd.attention_bwd_plan = plan
    step(fused)()
    row["shipped_err"] = err()
    row["shipped"] = ms(step(fused))
    return row


def table(rows, gpu):
    lines = [f"# our attention kernel's tiles (forward, bf16): {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; do_bench medians (ms); config = (BLOCK_M, BLOCK_N, warps, stages) (with --backward, "
             "the pair (dK/dV's, dQ's)); "
             "vs flex = flex ms / ours (>1: ours faster); err = ||a-b||/||b|| vs eager (the output; with "
             "--backward, dQ of one forward + backward step).", "",
             "| row | shape | sdpa | flex | shipped | best config | best ms | best vs flex | err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = {c: x for c, x in r["configs"].items() if "ms" in x}
        best = min(ok, key=lambda c: ok[c]["ms"]) if ok else None
        f = r.get("flex")
        lines.append(f"| {r['row']} | {r['shape']} | {r.get('sdpa', float('nan')):.3f} | {f or float('nan'):.3f} | "
                     f"{r['shipped']:.3f} | {best} | {ok[best]['ms']:.3f} | "
                     f"{(f / ok[best]['ms']) if f and best else float('nan'):.2f} | {ok[best]['err']:.1e} |")
    lines += ["", "all configs (ms):", ""]
    for r in rows:
        lines.append(f"- {r['row']}: " + ", ".join(f"{c} {x['ms']:.3f}" if "ms" in x else f"{c} {x['error']}"
                                                   for c, x in r["configs"].items()))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--rows", help="comma-separated row indices of attention_bench.ROWS (default: all)")
    ap.add_argument("--backward", action="store_true", help="the backward kernels' tiles (one training step)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    picked = [ab.ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ab.ROWS
    kind = "attention-tiles-backward" if args.backward else "attention-tiles"
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-{kind}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in picked:
        rows.append(sweep_backward(*spec) if args.backward else sweep(*spec))
        stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        stem.with_suffix(".md").write_text(table(rows, gpu))
    print(table(rows, gpu))


if __name__ == "__main__":
    main()
