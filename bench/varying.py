"""Training at lengths that change from step to step: the causal mask from sizes alone.

HF's LLaMA with eager attention and no attention_mask builds its causal mask from aranges; at symbolic
lengths that mask is not a constant, so fuser checks its structure at run time (`RunTimeCheck.by_size`) and
runs SDPA's flash kernel forward and backward where it is causal.  This times a training step (forward,
loss, backward, AdamW) cycling over a few lengths, each length marked dynamic so every system compiles
symbolic sizes once (left to automatic dynamic, this loop compiled every length static on torch 2.11, in
Inductor and fuser alike: run 226).  Systems, in turns: eager+sdpa, inductor (SDPA model), fuser (SDPA
model), fuser-eager-attn (the eager model: the mask from sizes).  Per system: ms for one cycle of the
lengths, graphs compiled, the first loss against eager+sdpa's, the attention kernels of a profiled cycle.

    python bench/varying.py [--lengths 512,448,480,416] [--out DIR]     # GPU; writes <gpu>-<date>-varying.md
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import _build, _dims, _kernel_events, _meta, _sync  # noqa: E402  (bench/models.py)
from fuser.backend import all_reports, fuser_backend  # noqa: E402

if "fuser" not in torch._dynamo.list_backends():
    torch._dynamo.register_backend(name="fuser")(fuser_backend)

SYSTEMS = {"eager+sdpa": ("sdpa", None), "inductor": ("sdpa", "inductor"), "fuser": ("sdpa", "fuser"),
           "fuser-eager-attn": ("eager", "fuser")}
ROUNDS = 5


def _cycle(name, d, system, base, lengths, device):
    attn, backend = SYSTEMS[system]
    model = _build(name, d, attn, device, weights=base, train=True)
    loss_of = lambda ids: model(input_ids=ids, labels=ids).loss  # noqa: E731
    fn = loss_of if backend is None else torch.compile(loss_of, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(0)
    ids = {t: torch.randint(0, model.config.vocab_size, (d["batch"], t), device=device) for t in lengths}
    for x in ids.values():  # symbolic lengths from the first call, in every system (see the docstring)
        torch._dynamo.mark_dynamic(x, 1)

    def run():
        losses = []
        for t in lengths:
            loss = fn(ids[t])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses
    return run


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="512,448,480,416")
    p.add_argument("--model", default="llama-gqa")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated; eager+sdpa is always run (the reference)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config: the script runs, nothing timed worth reading")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    lengths = [int(t) for t in args.lengths.split(",")] if not args.smoke else [16, 12, 14]
    d = _dims(args.smoke)
    base = _build(args.model, d, "sdpa", device, train=True)
    cells = {}
    for system in dict.fromkeys(["eager+sdpa", *args.systems.split(",")]):
        torch._dynamo.reset()
        seen = len(all_reports())
        run = _cycle(args.model, d, system, base, lengths, device)
        start = time.perf_counter()
        first = [x.item() for x in run()]  # the first cycle compiles; its losses before any AdamW step differ
        _sync(device)
        cell = cells[system] = {"compile_s": time.perf_counter() - start, "first_loss": first[0], "_run": run}
        run()
        reports = all_reports()[seen:]
        if system.startswith("fuser"):
            att = [r for rep in reports for r in rep.regions if r.kind == "attention"]
            cell["graphs"] = len(reports)
            claimed = [n for rep in reports for n in rep.notes if n.startswith("attention claimed")]
            cell["attention"] = (f"{sum(a.kernel == 'sdpa' for a in att)} SDPA, {sum(a.kernel != 'sdpa' for a in att)} "
                                 f"ours, {len(claimed)} claimed before autograd")
            cell["claims"] = sorted({n[:200] for n in claimed})
            cell["fallbacks"] = sorted({f[:160] for rep in reports for f in rep.all_fallbacks})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            _sync(device)
        names = {e.name for e in _kernel_events(prof)}
        cell["attention_kernels"] = sorted(n[:60] for n in names if "flash" in n.lower() or "attention" in n.lower()
                                           or "fmha" in n.lower() or "cudnn" in n.lower())
        cell["kernels"] = len(_kernel_events(prof))
    times = {s: [] for s in cells}
    for _ in range(ROUNDS):  # in turns: a drift of the host weighs on every system alike
        for s, c in cells.items():
            _sync(device)
            start = time.perf_counter()
            c["_run"]()
            _sync(device)
            times[s].append((time.perf_counter() - start) * 1e3)
    ref = cells["eager+sdpa"]["first_loss"]
    meta = _meta(device, args.smoke)
    ind = statistics.median(times.get("inductor", times["eager+sdpa"]))
    lines = [f"# Training at changing lengths ({args.model}, B{d['batch']}, lengths {lengths}, bf16)", "",
             f"{meta['device']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"transformers {meta['transformers']}; ms: the median of {ROUNDS} cycles timed in turns", "", "| system | ms a cycle | vs inductor | compile s | graphs | first loss err | attention | "
             "attention kernels | kernels a cycle |", "|---|---|---|---|---|---|---|---|---|"]
    for s, c in cells.items():
        ms = statistics.median(times[s])
        lines.append(f"| {s} | {ms:.2f} | {ind / ms:.2f} | {c['compile_s']:.1f} | {c.get('graphs', '—')} | "
                     f"{abs(c['first_loss'] - ref) / abs(ref):.1e} | {c.get('attention', '—')} | "
                     f"{', '.join(c['attention_kernels'])} | {c['kernels']} |")
    for s, c in cells.items():
        for n in c.get("claims", []):
            lines.append(f"- {s}: {n}")
        for f in c.get("fallbacks", []):
            lines.append(f"- {s} fallback: {f}")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out) / f"{meta['slug']}-{meta['date']}-varying.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
