"""Where one call's peak memory goes: the tensors live at the peak, per system (GPU).

    python bench/memory.py --only t5-encoder,bert-padded --systems inductor,fuser
    python bench/memory.py --train --only llama-128k    # one training step (models.py --train's makers)

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
    return (frames[0].get("name", "?") + " (torch)") if frames else "? (no Python frame: autograd's engine)"


def peak_of_one_call(call, train: bool = False) -> tuple[float, list]:
    with torch.enable_grad() if train else torch.no_grad():
        call()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
        call()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    live, now, peak, at_peak, last = {}, 0, 0, {}, None
    for e in snap["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            last = live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            now += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
        if now > peak:
            peak, at_peak, reached = now, dict(live), last
    blocks = sorted(at_peak.values(), key=lambda x: -x[0])
    return peak / 2**20, ([("reached by", f"{reached[0] / 2**20:.2f} MiB {reached[1]}")] if at_peak else []) + blocks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="t5-encoder,bert-padded")
    p.add_argument("--systems", default="inductor,fuser")
    p.add_argument("--train", action="store_true", help="one training step (forward, backward, AdamW)")
    p.add_argument("--top", type=int, default=12, help="blocks listed per system")
    args = p.parse_args()
    d = M._dims(False)
    for name in args.only.split(","):
        systems = args.systems.split(",")
        with torch.enable_grad() if args.train else torch.no_grad():
            makes, _, _ = (M._prepare_train if args.train else M._prepare)(name, d, "cuda", systems)
        for s in systems:
            torch._dynamo.reset()
            peak, blocks = peak_of_one_call(makes[s](), args.train)
            print(f"### {name} / {s}: peak {peak:.1f} MiB over the call, {len(blocks)} blocks live at the peak")
            for size, where in blocks[:args.top + 1]:
                print(f"  {size:>8}  {where}" if isinstance(size, str) else f"  {size / 2**20:8.2f} MiB  {where}")


if __name__ == "__main__":
    main()
