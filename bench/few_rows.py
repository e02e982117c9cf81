"""Row reductions over few, long rows (a decode step's softmax over the vocabulary, a norm over few tokens) on
the GPU: eager, Inductor and fuser in one run, and fuser with the cost model's occupancy penalty off (every
merge of the decomposed op taken: one kernel, a program a row), to read what a program a row costs against
eager's reductions, which split a row over many blocks.  GB/s counts the input read once and the output
written once, against the measured copy bandwidth.

    python bench/few_rows.py [--out DIR]
"""
import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fuser  # noqa: E402
import fuser.cost as cost  # noqa: E402
from bench.column_sums import copy_bandwidth, ms  # noqa: E402  (do_bench's median; a bf16 copy's GB/s)

SHAPES = [(1, 128256), (4, 32000), (8, 50257), (32, 32000), (64, 128256), (512, 4096)]
CASES = {  # name: (fn, dtype)
    "softmax(x / 0.7), bf16": (lambda x, w: torch.softmax(x / 0.7, -1), torch.bfloat16),
    "softmax(x / 0.7), fp32": (lambda x, w: torch.softmax(x / 0.7, -1), torch.float32),
    "log_softmax(x.float()), bf16": (lambda x, w: torch.log_softmax(x.float(), -1), torch.bfloat16),
    "layer_norm, bf16": (lambda x, w: F.layer_norm(x, x.shape[-1:], w, w), torch.bfloat16),
    "rms_norm(x) * w, bf16": (lambda x, w: (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w,
                              torch.bfloat16),
}


def fused_run(fn, x, w, want):
    torch._dynamo.reset()
    f = torch.compile(fn, backend="fuser")
    got = f(x, w)
    rep = fuser.last_report()
    err = ((got.double() - want).norm() / want.norm()).item()
    return {"ms": ms(lambda: f(x, w)), "err": err, "regions": len(rep.regions), "eager_ops": len(rep.unfused)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rows, real = [], cost.Cost.time_fused
    for name, (fn, dtype) in CASES.items():
        for shape in SHAPES:
            torch.manual_seed(0)
            x = torch.randn(shape, device="cuda", dtype=dtype)
            w = torch.randn(shape[-1], device="cuda", dtype=dtype)
            want = fn(x.double(), w.double())
            nbytes = x.numel() * x.element_size() + want.numel() * (4 if "log_softmax" in name else x.element_size())
            row = {"case": name, "shape": "x".join(map(str, shape)), "eager": ms(lambda: fn(x, w))}
            torch._dynamo.reset()
            ind = torch.compile(fn)
            ind(x, w)
            row["inductor"] = ms(lambda: ind(x, w))
            row["fuser"] = fused_run(fn, x, w, want)
            try:  # every merge taken: no occupancy penalty in the model
                cost.Cost.time_fused = lambda self: self.sizes.hint(self.bytes_fused) / cost.HBM_BYTES_PER_S + cost.LAUNCH_S
                row["fuser_whole"] = fused_run(fn, x, w, want)
            finally:
                cost.Cost.time_fused = real
            row["gbps_whole"] = nbytes / row["fuser_whole"]["ms"] / 1e6
            print(name, row["shape"], f"eager {row['eager']:.4f} inductor {row['inductor']:.4f} fuser {row['fuser']['ms']:.4f} "
                  f"({row['fuser']['regions']} regions, {row['fuser']['eager_ops']} eager) whole {row['fuser_whole']['ms']:.4f} "
                  f"({row['fuser_whole']['regions']} regions, {row['gbps_whole'] / bw:.0%} of copy)", flush=True)
            rows.append(row)
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-few-rows"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))
    lines = [f"# row reductions over few long rows: {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s; do_bench medians (ms). fuser: as shipped (regions, "
             "ops left eager); whole: the cost model's occupancy penalty off (one kernel, a program a row).", "",
             "| case | shape | eager | inductor | fuser | fuser regions/eager ops | whole | whole % copy | err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, wh = r["fuser"], r["fuser_whole"]
        lines.append(f"| {r['case']} | {r['shape']} | {r['eager']:.4f} | {r['inductor']:.4f} | {f['ms']:.4f} | "
                     f"{f['regions']}/{f['eager_ops']} | {wh['ms']:.4f} | {r['gbps_whole'] / bw:.0%} | {max(f['err'], wh['err']):.1e} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
