"""Block-size sweep for the rows that miss the bandwidth target: which (XBLOCK, RBLOCK, warps) wins.

Times the fused module (what users run) and the bare kernel launch (no Python around it) for each
plan, so launch overhead and kernel time are told apart.  GPU only.

    python bench/sweep.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fuser  # noqa: E402
import fuser.runtime as runtime  # noqa: E402
from fuser.plan import BlockPlan, block_plan  # noqa: E402
from fuser.runtime import RegionKernel  # noqa: E402


def rmsnorm(x, w):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def swiglu(g):
    a, b = g.chunk(2, -1)
    return F.silu(a) * b


def layernorm(x, r, w, b):
    return F.layer_norm(x + r, (x.shape[-1],), w, b)


def chain4(a, b):
    return F.gelu(a + b) * 0.5 + a


def cross_entropy(logits, target):
    return F.cross_entropy(logits.float(), target)


def plans(reduction: bool, r: int):
    if reduction and r > 16384:  # looped rows: (rows per program, tile, warps)
        for xb, rb, w in ((1, 2048, 8), (1, 4096, 8), (1, 4096, 16), (1, 8192, 16), (2, 2048, 8), (2, 4096, 16)):
            yield BlockPlan(xb, rb, w, 0, False)
        return
    if reduction:
        rb = triton.next_power_of_2(r)
        for xb, w in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)):
            yield BlockPlan(xb, rb, w, 0, True)
    else:
        for xb, w in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16)):
            yield BlockPlan(xb, 1, w, 0, True)


def sweep(name, fn, inputs, copy_bw):
    moved = sum(t.numel() * t.element_size() for t in inputs) + fn(*inputs).numel() * 2
    for plan in plans(*_shape_of(fn, inputs)):
        def forced(rows, r, device_type, plan=plan):
            base = block_plan(rows, r, device_type)
            programs = triton.cdiv(max(rows, 1), plan.xblock)
            return BlockPlan(plan.xblock, plan.rblock if r is not None else 1, plan.num_warps,
                             programs, base.persistent)
        runtime.block_plan = forced
        torch._dynamo.reset()
        fused = fuser.fuse(fn)
        fused(*inputs)
        ms = do_bench(lambda: fused(*inputs), warmup=25, rep=100, return_mode="median")
        k = max(_kernels(fused), key=lambda k: k._rows * max(k._r, 1))
        launcher, outs = _direct(k)
        ins = _region_inputs(k, inputs) if fn is not cross_entropy else list(inputs)
        bare = do_bench(lambda: launcher(k._plan.programs, *ins, *outs), warmup=25, rep=100, return_mode="median")
        print(f"{name:10s} XBLOCK={plan.xblock:5d} RBLOCK={plan.rblock:5d} warps={plan.num_warps:2d}  "
              f"module {ms:.3f} ms ({moved / ms / 1e6 / copy_bw:5.1%})  bare kernel {bare:.3f} ms "
              f"({moved / bare / 1e6 / copy_bw:5.1%})", flush=True)
    runtime.block_plan = block_plan


def _direct(k):
    """The launcher of a static RegionKernel's captured variant and outputs to launch it into."""
    variant, out_sigs = k._captured
    outs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="cuda") for s in out_sigs]
    return variant.launcher(k._plan, "cuda", k.reduction), outs


def _shape_of(fn, inputs):
    return fn in (rmsnorm, layernorm, cross_entropy), inputs[0].shape[-1]


def _kernels(fused):
    return [m for gm in fused.graph_modules for m in gm.modules() if isinstance(m, RegionKernel)]


def _region_inputs(k, inputs):
    """The region's inputs are the graph's tensors in order (these rows have no eager ops before them),
    except SwiGLU, whose inputs are the two halves of g."""
    if len(k.in_sigs) == len(inputs):
        return inputs
    return list(inputs[0].chunk(2, -1))


def host_overhead():
    """Host time per call (no sync inside the loop) of eager, Inductor and fuser on a small RMSNorm:
    when it exceeds the kernel's time, the GPU waits on Python."""
    import time
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    systems = {"eager": rmsnorm, "inductor": torch.compile(rmsnorm), "fuser": fuser.fuse(rmsnorm)}
    for name, fn in systems.items():
        for _ in range(50):
            fn(x, w)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn(x, w)
        host = (time.perf_counter() - t) / 2000 * 1e6
        torch.cuda.synchronize()
        print(f"host time per call  {name:9s} {host:6.1f} us", flush=True)
    (k,) = _kernels(systems["fuser"])
    launcher, outs = _direct(k)
    for label, fn in (("RegionKernel", lambda: k(x, w)), ("direct launch", lambda: launcher(k._plan.programs, x, w, *outs))):
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        print(f"host time per call  {label:13s} {(time.perf_counter() - t) / 2000 * 1e6:6.1f} us", flush=True)


def main():
    if "--overhead" in sys.argv:
        return host_overhead()
    if "--cross-entropy" in sys.argv:
        dev = "cuda"
        src = torch.randn(2**30, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        bw = 4 * src.numel() / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
        src = dst = None
        logits = torch.randn(8192, 128256, device=dev, dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (8192,), device=dev)
        return sweep("xent", cross_entropy, (logits, target), bw)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    csrc = torch.randn(2**30, device=dev, dtype=bf)
    cdst = torch.empty_like(csrc)
    copy_bw = 2 * csrc.numel() * 2 / do_bench(lambda: cdst.copy_(csrc), return_mode="median") / 1e6
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    csrc = cdst = None  # free 4 GiB before the rows
    x = torch.randn(16384, 4096, device=dev, dtype=bf)
    w = torch.randn(4096, device=dev, dtype=bf)
    sweep("rmsnorm", rmsnorm, (x, w), copy_bw)
    sweep("layernorm", layernorm, (x, torch.randn_like(x), w, torch.randn_like(w)), copy_bw)
    sweep("swiglu", swiglu, (torch.randn(16384, 8192, device=dev, dtype=bf),), copy_bw)
    sweep("chain4", chain4, (torch.randn(2**28, device=dev, dtype=bf), torch.randn(2**28, device=dev, dtype=bf)),
          copy_bw)


if __name__ == "__main__":
    main()
