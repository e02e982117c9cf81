"""Host time per call (issue 10): how long Python takes to issue one call of a compiled graph.

Three graphs: one kernel (an RMSNorm, 64x4096 bf16, whose kernel takes a few microseconds), about
twenty (ten blocks of matmul -> LayerNorm + GELU), and a launch-bound GPT-2 (2 layers, B1 T32, HF).
Systems: eager, Inductor (default and reduce-overhead), fuser through torch.compile (default and
reduce-overhead, i.e. CUDA graphs), fuser through fuse() (static and dynamic=True). For each: host us
per call (calls issued back to back without synchronising, best of 5 x 1000, the rounds interleaved
across systems: the host's slow spells last seconds and once fell on one system only; when host time
exceeds the GPU time, the GPU waits on Python) and the synchronised wall time per call (do_bench median). GPU only.

    python bench/host.py [--out DIR]      # writes <gpu>-<date>-host.{md,json}
    python bench/host.py --profile 300    # also cProfile 300 calls of each cell: <stem>-profile.txt
"""
import argparse
import cProfile
import io
import pstats
import datetime
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fuser  # noqa: E402

BF16 = torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Blocks(nn.Module):
    """Ten matmuls, each followed by LayerNorm + GELU: ~20 kernels a call."""

    def __init__(self, d, n=10):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        for lin, norm in zip(self.linears, self.norms):
            x = F.gelu(norm(lin(x)))
        return x


def host_us(fn, x, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(1000):
            fn(x)
        best = min(best, (time.perf_counter() - start) / 1000 * 1e6)
        torch.cuda.synchronize()
    return best


def profile(fn, x, calls: int, top: int = 25) -> str:
    """Where the host time of `calls` calls goes: cProfile's top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn(x)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def systems(module):
    yield "eager", module
    yield "inductor", torch.compile(module)
    yield "inductor reduce-overhead", torch.compile(module, mode="reduce-overhead")
    yield "fuser", torch.compile(module, backend="fuser")
    yield "fuser reduce-overhead", torch.compile(module, backend="fuser", mode="reduce-overhead")
    yield "fuser.fuse()", fuser.fuse(module)
    yield "fuser.fuse(dynamic=True)", fuser.fuse(module, dynamic=True)


def gpt2():
    import transformers  # only this graph needs it
    cfg = transformers.GPT2Config(n_layer=2, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--profile", type=int, default=0, help="cProfile this many calls of each cell")
    args = p.parse_args()
    torch.manual_seed(0)
    graphs = {"one kernel (RMSNorm 64x4096)": (RMSNorm(4096), (64, 4096)),
              "~20 kernels (10 x matmul, LayerNorm, GELU; 64x1024)": (Blocks(1024), (64, 1024)),
              "GPT-2, 2 layers, B1 T32 (HF)": (gpt2(), None)}
    rows, profiles = [], []
    with torch.no_grad():
        for graph, (module, shape) in graphs.items():
            module = module.to("cuda", BF16).eval()
            x = (torch.randn(shape, device="cuda", dtype=BF16) if shape else
                 torch.randint(0, 50257, (1, 32), device="cuda"))
            fns, cells = {}, {}
            for name, fn in systems(module):
                torch._dynamo.reset()
                cells[name] = {"graph": graph, "system": name}
                try:
                    for _ in range(30):  # compile, warm up (reduce-overhead records its graph)
                        fn(x)
                    fns[name] = fn
                except Exception as e:  # one system failing leaves the others measured
                    cells[name]["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            for fn in fns.values():  # a later system's reset dropped the earlier ones' caches: recompile now
                for _ in range(5):
                    fn(x)
            for name, fn in fns.items():
                cells[name]["wall_us"] = do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median") * 1000
            # host time: rounds interleaved across systems, best round each, so a slow spell of the
            # host (they last seconds) does not land on one system only
            for _ in range(5):
                for name, fn in fns.items():
                    cells[name]["host_us"] = min(cells[name].get("host_us", float("inf")), host_us(fn, x, rounds=1))
            for name, fn in fns.items():
                if args.profile:
                    profiles.append(f"## {graph} / {name}\n{profile(fn, x, args.profile)}")
            rows += cells.values()
            for c in cells.values():
                print(c, flush=True)
    gpu = torch.cuda.get_device_name()
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-host"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = [f"# host time per call: {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; host us = Python's time to issue one call (best of 5 x 1000 calls, no "
             "sync; the 5 rounds interleaved across the graph's systems); wall us = do_bench median of one synchronised call.", "",
             "| graph | system | host us/call | wall us/call |", "|---|---|---|---|"]
    lines += [f"| {r['graph']} | {r['system']} | {r['host_us']:.1f} | {r['wall_us']:.1f} |" if "error" not in r
              else f"| {r['graph']} | {r['system']} | {r['error'][:80]} | |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if profiles:
        Path(f"{stem}-profile.txt").write_text("\n".join(profiles))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
