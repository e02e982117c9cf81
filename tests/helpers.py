"""Small helpers the tests share."""
import torch
import torch.profiler


def fused_ops(report) -> set:
    """Short ATen op names (e.g. 'add', 'var_mean') inside fused regions."""
    return {o.replace("aten.", "").split(".")[0] for r in report.regions for o in r.ops}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))



def peak_bytes(fn, *args):
    """fn(*args) and the peak of the bytes it held allocated through ATen's allocator at once (a CPU stand-in
    for torch.cuda.max_memory_allocated, which compiled code runs under; a dispatch mode would not: Dynamo
    runs a call eagerly under one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args)
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak
