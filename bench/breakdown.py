"""Where a model's step goes: GPU time per kernel and host time per Python function, per system.

The model bench (models.py) says how fast each system is; this says why.  For each model x system
(the same models and makers as models.py), after warm-up:
- kernels: torch.profiler over 5 steps, GPU time and launches per step grouped by kernel name, the
  largest first, with each name's share of the step's kernel time;
- host: cProfile over 20 steps (no synchronisation inside), the functions with the most own time
  per step (only for systems without CUDA graphs, whose host work is the step's launches).

    python bench/breakdown.py --only llama-decode,gpt2 --systems fuser-cg,inductor-ro --out DIR
    python bench/breakdown.py --train --only llama-128k --systems inductor,fuser   # training steps

Writes <gpu>-<date>-breakdown.md in DIR.
"""
import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as M  # noqa: E402  (bench/models.py: the same models, inputs and systems)

TOP_KERNELS, TOP_HOST = 25, 25


def kernels(fn, steps=5):
    """[(name, us per step, launches per step)], largest first, and the step's total kernel us."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    us, count = defaultdict(float), defaultdict(int)
    for e in M._kernel_events(prof):
        us[e.name] += (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / steps
        count[e.name] += 1
    rows = sorted(((n, t, count[n] / steps) for n, t in us.items()), key=lambda r: -r[1])
    return rows, sum(us.values())


def host(fn, steps=20):
    """[(function, own us per step, calls per step)], the most own time first, and the wall us per step."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    wall = (time.perf_counter() - start) / steps * 1e6
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [(f"{Path(file).name}:{line} {name}", tt / steps * 1e6, calls / steps)
            for (file, line, name), (_, calls, tt, _, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[1]), wall


def cell(name, system, fns, with_host):
    fn = fns[system]()
    for _ in range(4):  # compile, then warm-up (reduce-overhead records its graphs here)
        fn()
    rows, total = kernels(fn)
    lines = [f"### {name} / {system}", "", f"kernel time {total:.1f} us per step, "
             f"{sum(r[2] for r in rows):.0f} launches", "", "| kernel | us/step | launches | share |", "|---|---|---|---|"]
    lines += [f"| {n[:90]} | {t:.1f} | {c:.0f} | {t / total:.1%} |" for n, t, c in rows[:TOP_KERNELS]]
    if with_host:
        hrows, wall = host(fn)
        lines += ["", f"host: {wall:.0f} us wall per step (cProfile on; slower than without)", "",
                  "| function | own us/step | calls/step |", "|---|---|---|"]
        lines += [f"| {n[:90]} | {t:.1f} | {c:.0f} |" for n, t, c in hrows[:TOP_HOST]]
    return lines + [""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="llama-decode,gpt2")
    p.add_argument("--systems", default="inductor,fuser")
    p.add_argument("--train", action="store_true", help="training steps (models.py --train's makers)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    meta = M._meta(device, False)
    systems = args.systems.split(",")
    out = [f"# where the step goes{' (training steps)' if args.train else ''}: {meta['device']}, {meta['date']}", "",
           f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}.", ""]
    for name in args.only.split(","):
        with contextlib.nullcontext() if args.train else torch.no_grad():
            prepare = M._prepare_train if args.train else M._prepare
            fns, _, _ = prepare(name, M._dims(False), device, systems)
            for system in systems:
                torch._dynamo.reset()
                try:
                    out += cell(name, system, fns, with_host=system not in ("inductor-ro", "fuser-cg"))
                except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
                    out += [f"### {name} / {system}: ERROR {M._first_line(e)}", ""]
                print("\n".join(out[-60:]), flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{meta['slug']}-{meta['date']}-{'train-' if args.train else ''}breakdown.md"
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
