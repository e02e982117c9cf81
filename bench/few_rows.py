"""Row reductions over few, long rows (a decode step's softmax over the vocabulary, a norm over few tokens) on
the GPU: eager, Inductor and fuser in one run, and fuser with the cost model's occupancy penalty off (every
merge of the decomposed op taken: one kernel, a program a row), to read what a program a row costs against
eager's reductions, which split a row over many blocks.  GB/s counts the input read once and the output
written once (fwd+bwd rows: x and the gradient read, x's gradient written), against the measured copy bandwidth.
The norms (layer_norm, RMSNorm as Hugging Face writes it and by hand in the tensor's dtype), forward and
forward+backward, check the partition's rule for few long rows (Partitioner.absorb_whole: one kernel where the
pairwise merges split it): fuser should leave no op eager, match `whole`, and run one region a forward.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from column_sums import copy_bandwidth, ms  # noqa: E402  (do_bench's median; a bf16 copy's GB/s)

SHAPES = [(1, 128256), (4, 32000), (8, 50257), (32, 32000), (64, 128256), (512, 4096)]


def layer_norm(x, w):
    return F.layer_norm(x, x.shape[-1:], w, w)


def rms_norm(x, w):  # as Hugging Face's LlamaRMSNorm
    return (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rms_norm_by_hand(x, w):  # in the tensor's dtype
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


CASES = {  # name: (fn, dtype, backward too)
    "softmax(x / 0.7), bf16": (lambda x, w: torch.softmax(x / 0.7, -1), torch.bfloat16, False),
    "softmax(x / 0.7), fp32": (lambda x, w: torch.softmax(x / 0.7, -1), torch.float32, False),
    "log_softmax(x.float()), bf16": (lambda x, w: torch.log_softmax(x.float(), -1), torch.bfloat16, False),
    "layer_norm, bf16": (layer_norm, torch.bfloat16, False),
    "rms_norm(x) * w, bf16": (rms_norm, torch.bfloat16, False),
    "x * rsqrt(mean(x * x)) * w, bf16": (rms_norm_by_hand, torch.bfloat16, False),
    "layer_norm fwd+bwd, bf16": (layer_norm, torch.bfloat16, True),
    "rms_norm(x) * w fwd+bwd, bf16": (rms_norm, torch.bfloat16, True),
}


def step(f, x, w, g):
    """The call timed: f's output, or with a gradient g, the gradients of x and w."""
    return (lambda: f(x, w)) if g is None else (lambda: torch.autograd.grad(f(x, w), (x, w), g))


def rel_err(got, want) -> float:
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    return max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want))


def fused_run(fn, x, w, g, want):
    """fuser's time; regions and eager ops summed over the graphs compiled (forward, and backward with g)."""
    torch._dynamo.reset()
    run, made = step(torch.compile(fn, backend="fuser"), x, w, g), len(fuser.reports())
    err = rel_err(run(), want)
    reps = fuser.reports()[made:]
    return {"ms": ms(run), "err": err, "regions": sum(len(r.regions) for r in reps),
            "eager_ops": sum(len(r.unfused) for r in reps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rows, real = [], cost.Cost.time_fused
    for name, (fn, dtype, backward) in CASES.items():
        for shape in SHAPES:
            torch.manual_seed(0)
            x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=backward)
            w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=backward)
            g = torch.randn(shape, device="cuda", dtype=dtype) if backward else None
            xd, wd = (t.detach().double().requires_grad_(backward) for t in (x, w))
            want = step(fn, xd, wd, None if g is None else g.double())()
            out_bytes = 4 if "log_softmax" in name else x.element_size()
            nbytes = x.numel() * (3 * x.element_size() if backward else x.element_size() + out_bytes)
            row = {"case": name, "shape": "x".join(map(str, shape)), "eager": ms(step(fn, x, w, g))}
            torch._dynamo.reset()
            ind = step(torch.compile(fn), x, w, g)
            ind()
            row["inductor"] = ms(ind)
            row["fuser"] = fused_run(fn, x, w, g, want)
            try:  # every merge taken: no occupancy penalty in the model
                cost.Cost.time_fused = lambda self: self.sizes.hint(self.bytes_fused) / cost.HBM_BYTES_PER_S + cost.LAUNCH_S
                row["fuser_whole"] = fused_run(fn, x, w, g, want)
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
