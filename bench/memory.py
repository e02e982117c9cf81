"""Where one inference call's peak memory goes: the tensors live at the peak, per system (GPU).

    python bench/memory.py --only t5-encoder,bert-padded --systems inductor,fuser

For each model x system: one warm call, then one call under torch.cuda.memory's history recorder;
the allocation events of that call are replayed to find the peak, and the blocks live there are
listed (size, the Python line that allocated them: a line of the generated program, or torch's).
"""
from __future__ import annotations

import argparse
import linecache
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import models as M  # noqa: E402


def _where(frames) -> str:
    """The innermost frame that is not torch's own Python: the program's line, or ours."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and "/triton/" not in name and name not in ("??", ""):
            text = linecache.getline(name, f.get("line", 0)).strip()[:110]  # fx registers its code there
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}: {text}"
    return frames[0].get("name", "?") if frames else "?"


def peak_of_one_call(call) -> tuple[float, list]:
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
        call()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    live, now, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            now += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
        if now > peak:
            peak, at_peak = now, dict(live)
    return peak / 2**20, sorted(at_peak.values(), key=lambda x: -x[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="t5-encoder,bert-padded")
    p.add_argument("--systems", default="inductor,fuser")
    args = p.parse_args()
    d = M._dims(False)
    for name in args.only.split(","):
        systems = args.systems.split(",")
        makes, _, _ = M._prepare(name, d, "cuda", systems)
        for s in systems:
            peak, blocks = peak_of_one_call(makes[s]())
            print(f"### {name} / {s}: peak {peak:.1f} MiB over the call, {len(blocks)} blocks live at the peak")
            for size, where in blocks[:12]:
                print(f"  {size / 2**20:8.2f} MiB  {where}")


if __name__ == "__main__":
    main()
