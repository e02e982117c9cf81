"""Host time by op kind inside a compiled training step: fuser's programs and Inductor's, side by side (GPU).

breakdown.py's cProfile inflates C calls unevenly (run 87 read our matmuls at 27 us a call against Inductor's 18;
timed directly both take 15-25 us, run 92), so this times the calls themselves: every node of fuser's forward and
backward programs (its fused kernels, eager ops, allocations, views), and Inductor's kernel runs
(CachingAutotuner.run) and extern matmuls, each wrapped in a perf_counter_ns pair.  The GPU is kept ahead of the
host by a sleep kernel before each step, so no launch waits on a full queue.  The same models and makers as
models.py --train.

    python bench/op_host.py --only gpt2,vit [--steps 10] [--top 30]
"""
import argparse
import collections
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402  (bench/models.py)
from fuser.backend import make_backend  # noqa: E402

stats = collections.defaultdict(lambda: [0, 0])  # label -> [calls, ns]


def timed(fn, label):
    def call(*args, **kwargs):
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        entry = stats[label]
        entry[0] += 1
        entry[1] += time.perf_counter_ns() - start
        return out
    call.__dict__.update(getattr(fn, "__dict__", {}))  # the wrapper's passes read attributes of our callables
    call.__name__ = getattr(fn, "__name__", label)
    return call


def _time_program(report, gm):
    """fuser's sink: each call of the program, timed under "<fwd|bwd>:<callee, numbering dropped>"."""
    graph = "bwd" if any("backward graph" in n for n in report.notes) else "fwd"
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.target = timed(n.target, f"{graph}:{re.sub(r'_[0-9]+$', '', getattr(n.target, '__name__', str(n.target)))}")
    gm.recompile()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gpt2,llama-gqa,bert-padded")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch._dynamo.register_backend(name="fuser_timed")(make_backend(sink=_time_program))
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.select_algorithm import extern_kernels
    triton_heuristics.CachingAutotuner.run = timed(triton_heuristics.CachingAutotuner.run, "inductor:kernel")
    for op in ("mm", "addmm", "bmm"):
        setattr(extern_kernels, op, timed(getattr(extern_kernels, op), f"inductor:{op}"))
    dims, device, compile_ = models._dims(False), torch.device("cuda"), torch.compile
    print(f"# host us by op kind, training step: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for name in args.only.split(","):
        makes, _, _ = models._prepare_train(name, dims, device, ["inductor", "fuser"])
        for system in ("inductor", "fuser"):
            if system == "fuser":  # models.py compiles with backend="fuser": the timed backend instead
                torch.compile = lambda f, backend=None, **kw: compile_(f, backend="fuser_timed", **kw)
            try:
                step = makes[system]()
            finally:
                torch.compile = compile_
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            stats.clear()
            hosts, phases = [], []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1e8))
                start = time.perf_counter()
                step()
                hosts.append(time.perf_counter() - start)
                phases.append(step.phases)
            torch.cuda.synchronize()
            mid = args.steps // 2
            fwd, bwd, opt = (sorted(p[i] for p in phases)[mid] * 1e6 for i in range(3))
            print(f"## {name} / {system}: host {sorted(hosts)[mid] * 1e6:.0f} us a step (forward {fwd:.0f}, backward "
                  f"{bwd:.0f}, optimizer {opt:.0f}), timed calls {sum(v[1] for v in stats.values()) / args.steps / 1e3:.0f} us\n")
            print("| call | calls/step | us/call | us/step |\n|---|---|---|---|")
            for label, (calls, ns) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"| {label} | {calls / args.steps:.1f} | {ns / calls / 1e3:.2f} | {ns / args.steps / 1e3:.1f} |")
            print()


if __name__ == "__main__":
    main()
