"""Where a model's step goes: GPU time per kernel and host time per Python function, per system.

The model bench (models.py) says how fast each system is; this says why.  For each model x system
(the same models and makers as models.py), after warm-up:
- kernels: torch.profiler over 5 steps, GPU time and launches per step grouped by kernel name, the
  largest first, with each name's share of the step's kernel time; the host's CUDA API calls
  (synchronisations, copies, launches that block on a full queue); without a profiler, the step
  back to back, the host's own time per step and the synchronising calls in one step;
- host: cProfile over 20 steps (no synchronisation inside), the functions with the most own time
  per step (for systems without CUDA graphs, whose host work is the step's launches; in training for all:
  under CUDA graphs the host still runs autograd, the replays and the optimizer).

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

TOP_KERNELS, TOP_HOST, TOP_API, TOP_FILES = 25, 25, 8, 20  # --top sets the first two


def kernels(fn, steps=5):
    """[(name, us per step, launches per step, the ATen op it ran under)], largest first, the step's total
    kernel us, and the CUDA runtime and driver calls the host made: [(name, own us per step, calls per step)].  Those
    show where the host waited for the GPU (a synchronize, a copy to the host, a full launch queue
    that makes launches block) rather than worked."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    us, count = defaultdict(float), defaultdict(int)
    for e in M._kernel_events(prof):
        us[e.name] += (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / steps
        count[e.name] += 1
    under = _launched_under(prof)
    rows = sorted(((n, t, count[n] / steps, under.get(n, "")) for n, t in us.items()), key=lambda r: -r[1])
    api_us, api_count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")):
            api_us[e.name] += e.self_cpu_time_total / steps
            api_count[e.name] += 1
    api = sorted(((n, t, api_count[n] / steps) for n, t in api_us.items()), key=lambda r: -r[1])
    return rows, sum(us.values()), api


def _launched_under(prof) -> dict:
    """kernel name -> the ATen op that launched it (the most frequent, with its input shapes where the profile
    recorded them), or "" for launches under no ATen op (ours, through the runtime): what an eager kernel of a
    compiled step is (run 154 found the decode step's 4 extra launches so: a fill under `where`)."""
    ops = defaultdict(lambda: defaultdict(int))
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not getattr(e, "kernels", None):
            continue
        p = e
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is None:
            continue
        while p.cpu_parent is not None and p.cpu_parent.name.startswith("aten::"):  # the outermost ATen op
            p = p.cpu_parent
        shapes = getattr(p, "input_shapes", None)
        for k in e.kernels:
            ops[k.name][p.name + (f" {shapes}" if shapes else "")] += 1
    return {k: max(by.items(), key=lambda kv: kv[1])[0] for k, by in ops.items()}


def unprofiled(fn, steps=20):
    """(host us, step us, synchronising calls, host us of the forward, backward and optimizer or
    None) per step, without a profiler.  Host: the step's
    Python with ~100 ms of GPU work queued ahead of it, so that it never waits for the GPU (unless
    it synchronises): what the host costs.  Step: steps back to back, as a training loop runs them.
    Synchronising calls: see `synchronising`.  Host above the kernel time: the step waits on the host."""
    hosts = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - t0, getattr(fn, "phases", None)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    step = (time.perf_counter() - start) / steps
    syncs = synchronising(fn)
    torch.cuda.synchronize()
    best, phases = min(hosts, key=lambda h: h[0])
    return best * 1e6, step * 1e6, syncs, None if phases is None else [p * 1e6 for p in phases]


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def synchronising(fn) -> str:
    """The calls in one step that make the host wait for the GPU (each drains the queue the host had run
    ahead with), counted from the profiler's CUDA runtime events, each with the ops it ran under.  Torch's
    sync debug mode, used before, warns once a process: it read 0 where a decode step synchronised 4 times
    (a CPU scalar copied to the GPU per call, run 142)."""
    def count(f):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            f()
        where = defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.name in _SYNCS:
                chain, p = [], e.cpu_parent
                while p is not None and len(chain) < 3:
                    chain.append(p.name)
                    p = p.cpu_parent
                where[f"{e.name} in {' < '.join(chain) or 'the step'}"] += 1
        return where
    where, profiler = count(fn), count(lambda: None)  # the profiler's own synchronisation, taken out
    where = {w: n - profiler.get(w, 0) for w, n in where.items() if n > profiler.get(w, 0)}
    total = sum(where.values())
    return f"{total}" + (f" ({'; '.join(f'{n}x {w}' for w, n in where.items())})" if total else "")


def host(fn, steps=20):
    """[(function, own us per step, calls per step)], the most own time first, the wall us per step, and
    [(source file, own us per step, calls per step)]."""
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
    files = defaultdict(lambda: [0.0, 0.0])  # own time per source file (a package's share of the host)
    for (file, _, _), (_, calls, tt, _, _) in stats.items():
        key = "/".join(Path(file).parts[-2:]) if file != "~" else "~ (builtins)"
        files[key][0] += tt / steps * 1e6
        files[key][1] += calls / steps
    by_file = sorted(((k, t, c) for k, (t, c) in files.items()), key=lambda r: -r[1])
    return sorted(rows, key=lambda r: -r[1]), wall, by_file


def cell(name, system, fns, with_host):
    fn = fns[system]()
    for _ in range(4):  # compile, then warm-up (reduce-overhead records its graphs here)
        fn()
    rows, total, api = kernels(fn)
    host_us, step_us, syncs, phases = unprofiled(fn)
    split = "" if phases is None else " (forward {:.0f}, backward {:.0f}, optimizer {:.0f})".format(*phases)
    lines = [f"### {name} / {system}", "", f"kernel time {total:.1f} us per step, "
             f"{sum(r[2] for r in rows):.0f} launches; without a profiler: step {step_us:.0f} us (back to back), "
             f"host {host_us:.0f} us{split} (the GPU busy ahead of it), {syncs} synchronising calls", "",
             "| kernel | us/step | launches | share | launched under |", "|---|---|---|---|---|"]
    lines += [f"| {n[:90]} | {t:.1f} | {c:.0f} | {t / total:.1%} | {u[:80]} |" for n, t, c, u in rows[:TOP_KERNELS]]
    lines += ["", "| CUDA API call on the host | own us/step | calls/step |", "|---|---|---|"]
    lines += [f"| {n[:90]} | {t:.1f} | {c:.1f} |" for n, t, c in api[:TOP_API]]
    if with_host:
        hrows, wall, by_file = host(fn)
        lines += ["", f"host: {wall:.0f} us wall per step (cProfile on; slower than without)", "",
                  "| function | own us/step | calls/step |", "|---|---|---|"]
        lines += [f"| {n[:90]} | {t:.1f} | {c:.0f} |" for n, t, c in hrows[:TOP_HOST]]
        lines += ["", "| source file | own us/step | calls/step |", "|---|---|---|"]
        lines += [f"| {n[:90]} | {t:.1f} | {c:.0f} |" for n, t, c in by_file[:TOP_FILES]]
    return lines + [""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="llama-decode,gpt2")
    p.add_argument("--systems", default="inductor,fuser")
    p.add_argument("--train", action="store_true", help="training steps (models.py --train's makers)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--top", type=int, default=25, help="kernels and host functions listed per cell")
    args = p.parse_args(argv)
    global TOP_KERNELS, TOP_HOST
    TOP_KERNELS = TOP_HOST = args.top
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
                    out += cell(name, system, fns, with_host=args.train or system not in ("inductor-ro", "fuser-cg"))
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
