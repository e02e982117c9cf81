"""Column sums (a weight's or a bias's gradient: [tokens, D] summed over the tokens) swept on the GPU: how
many programs the split's first sum runs (split.PROGRAMS_WANTED) and the looped column tile
(plan.COLUMN_TILE: columns a program, elements a tile, warps), beside eager and Inductor in the same run.
GB/s counts the inputs read once and the output written once, against the measured copy bandwidth.

    python bench/column_sums.py [--whole] [--out DIR]
"""
import argparse
import datetime
import itertools
import json
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fuser  # noqa: E402,F401  (registers the backend)
import fuser.plan as plan  # noqa: E402
import fuser.split as split  # noqa: E402

SHAPES = [(8192, 2048), (8192, 768), (16384, 4096), (4096, 8192), (8, 1024, 4096)]
CASES = {  # name: (fn, dtype, inputs)
    "(g * x).sum over tokens, bf16": (lambda g, x: (g * x).sum(list(range(g.dim() - 1))), torch.bfloat16, 2),
    "g.sum over tokens, fp32": (lambda g: g.sum(list(range(g.dim() - 1))), torch.float32, 1),
}
WANTED = [2, 4, 8, 16]  # x NUM_SMS
TILES = [(64, 4096, 8), (64, 2048, 4), (128, 8192, 8), (256, 8192, 8)]


WHOLE = {  # a loss over a model's output, summed whole (split.split_whole_sums): name: (fn, shape)
    "(y.float() ** 2).mean(), bf16": (lambda y: y.float().square().mean(), (8, 1024, 4096)),
    "((y - t) ** 2).sum(), bf16": (lambda y, t: ((y - t) ** 2).sum(), (4096, 3000)),
}
WHOLE_PARTS = [1, 2, 4, 8]  # x NUM_SMS


def whole_sums(bw):
    rows, parts0 = [], split.WHOLE_PARTS
    for name, (fn, shape) in WHOLE.items():
        n_in = fn.__code__.co_argcount
        xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(n_in)]
        want = fn(*(x.double() for x in xs))
        row = {"case": name, "shape": "x".join(map(str, shape)), "eager": ms(lambda: fn(*xs))}
        torch._dynamo.reset()
        ind = torch.compile(fn)
        ind(*xs)
        row["inductor"], row["configs"] = ms(lambda: ind(*xs)), {}
        try:
            for p in WHOLE_PARTS:
                split.WHOLE_PARTS = p * plan.NUM_SMS
                torch._dynamo.reset()
                f = torch.compile(fn, backend="fuser")
                err = abs((f(*xs).double() - want) / want).item()
                row["configs"][f"{p}xSMs"] = {"ms": ms(lambda: f(*xs)), "err": err}
        finally:
            split.WHOLE_PARTS = parts0
        print(row, flush=True)
        rows.append(row)
    return rows


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / ms(lambda: y.copy_(x)) / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--whole", action="store_true", help="the whole-tensor sums only")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rows, wanted0, tile0 = [], split.PROGRAMS_WANTED, plan.COLUMN_TILE
    for (name, (fn, dtype, n_in)), shape in itertools.product(CASES.items(), SHAPES if not args.whole else []):
        torch.manual_seed(0)
        xs = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(n_in)]
        want = fn(*(x.double() for x in xs))
        nbytes = sum(x.numel() * x.element_size() for x in xs) + want.numel() * xs[0].element_size()
        row = {"case": name, "shape": "x".join(map(str, shape)), "eager": ms(lambda: fn(*xs))}
        torch._dynamo.reset()
        ind = torch.compile(fn)
        ind(*xs)
        row["inductor"] = ms(lambda: ind(*xs))
        row["configs"] = {}
        try:
            for w, tile in itertools.product(WANTED, TILES):
                split.PROGRAMS_WANTED, plan.COLUMN_TILE = w * plan.NUM_SMS, tile
                torch._dynamo.reset()
                f = torch.compile(fn, backend="fuser")
                got = f(*xs)
                err = ((got.double() - want).norm() / want.norm()).item()
                row["configs"][f"{w}xSMs {tile}"] = {"ms": ms(lambda: f(*xs)), "err": err}
        finally:
            split.PROGRAMS_WANTED, plan.COLUMN_TILE = wanted0, tile0
        best = min(row["configs"], key=lambda c: row["configs"][c]["ms"])
        row["best"], row["best_ms"] = best, row["configs"][best]["ms"]
        row["shipped"] = row["configs"].get(f"{wanted0 // plan.NUM_SMS}xSMs {tile0}", {}).get("ms")
        row["gbps_best"] = nbytes / row["best_ms"] / 1e6
        print(row["case"], row["shape"], f"eager {row['eager']:.4f} inductor {row['inductor']:.4f} shipped "
              f"{row['shipped']:.4f} best {best} {row['best_ms']:.4f} ({row['gbps_best'] / bw:.0%} of copy)", flush=True)
        rows.append(row)
    whole = whole_sums(bw)
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-column-sums"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"copy_gbps": bw, "rows": rows, "whole": whole}, indent=1))
    lines = [f"# column sums: {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s; do_bench medians (ms); config = programs the "
             "split's first sum runs (x SMs), column tile (columns, elements, warps); vs inductor = inductor ms / ms.", "",
             "| case | shape | eager | inductor | shipped | best config | best ms | best vs inductor | % copy BW |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['shape']} | {r['eager']:.4f} | {r['inductor']:.4f} | {r['shipped']:.4f} | "
                     f"{r['best']} | {r['best_ms']:.4f} | {r['inductor'] / r['best_ms']:.2f} | {r['gbps_best'] / bw:.0%} |")
    lines += ["", "every config (ms):", ""]
    for r in rows:
        lines.append(f"- {r['case']} {r['shape']}: " + ", ".join(f"{c} {x['ms']:.4f}" for c, x in r["configs"].items()))
    lines += ["", "whole-tensor sums (parts of the first sum, x SMs; ms):", ""]
    for r in whole:
        lines.append(f"- {r['case']} {r['shape']}: eager {r['eager']:.4f}, inductor {r['inductor']:.4f}, "
                     + ", ".join(f"{c} {x['ms']:.4f}" for c, x in r["configs"].items()))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
