"""Data-parallel training of a small LLaMA through `torch.compile` on two processes, each step's
loss held to a single-process eager reference.

    torchrun --nproc-per-node 2 examples/train_distributed.py --wrap ddp|fsdp2 --backend fuser|inductor|eager \
        [--size tiny|bench] [--steps N] [--out FILE.json]

CUDA + NCCL + bf16 where there are GPUs (rank r on cuda:LOCAL_RANK), else CPU + gloo + fp32 (fuser's
kernels then run through Triton's interpreter: keep --size tiny).

Recipes (wrap first, then compile).  What is wrapped is the model with its loss (WithLoss, returning
the loss alone): DDP's and FSDP2's forward hooks see the module's outputs, which makes them outputs
of the graph, so a wrapped model returning its logits would have them made whole; with the loss
inside, the logits are read by the cross-entropy alone, and fuser runs the LM head and the loss as
its chunked op, never holding the [tokens x vocabulary] logits (README, Training), under both.
  * ddp: `DistributedDataParallel(model)` compiled, as torch documents it.
    Dynamo's DDPOptimizer splits the graph where DDP's gradient buckets end and hands each piece to
    the backend, so that one bucket's all-reduce overlaps the backward of the next.  The tiny size
    has 1 MiB buckets (the least DDPOptimizer accepts) and an LM head that fills one (fp32 or bf16),
    so that its graph is split too, as the bench size's is (25 MiB buckets, DDP's default).
  * fsdp2: each decoder layer compiled (`layer.compile`) and sharded (`fully_shard`), then the root
    (WithLoss) sharded; the LM head and the loss compiled as one function of the last hidden state
    (WithLoss's head_backend), the embedding and the final norm left eager.  FSDP2's hooks run
    outside Dynamo (`torch._dynamo.disable`), so a model compiled as a whole breaks at every
    sharded layer, and Dynamo then runs the frames around the layer loop in Python (a graph break in
    a loop): the head and the loss landed in graphs of their own, the logits passing between them,
    and the loss was not fused.  Compiled per layer (torchtitan's recipe) plus the head with its
    loss, the backend gets one graph a decoder layer (compiled once, run by every layer) and one for
    the head and the loss, which fuser runs as its chunked op.

Data: one global batch, drawn from --seed identically on every rank, trained on at every step (so
the loss can fall only through the optimizer's steps); rank r takes the r-th slice of its rows.  The
global loss, the mean of the ranks' losses (equal row counts, no padding), must follow the
reference's within TOLERANCE at every step.  The reference (rank 0: the same initial weights from the
same seed, unwrapped, eager, AdamW, on the whole global batch) trains after the distributed run, so
the timings and peak memory are the distributed run's alone.
"""
import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import fuser  # registers the backend

SIZES = {
    "tiny": dict(config=dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
                 rows=4, seq=16, lr=1e-2, bucket_mb=1),  # vocab 8192: the LM head fills a bucket
    "bench": dict(config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                              num_attention_heads=16, num_key_value_heads=4),
                  rows=8, seq=1024, lr=3e-4, bucket_mb=25),
}
# relative tolerance of each step's distributed loss against the reference's, by parameter dtype
# (measured: ~1e-7 in fp32 after 3 steps, ~1e-3 in bf16)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrap", choices=("ddp", "fsdp2"), required=True)
    p.add_argument("--backend", choices=("fuser", "inductor", "eager"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 writes the results here as JSON")
    p.add_argument("--trace", help="with --profile: each rank writes its profiled steps here as a gzipped Chrome "
                   "trace, FILE.rank<r>.json.gz (the timeline: where the GPU waits, on what)")
    p.add_argument("--sync-debug", action="store_true", help="CUDA: after the timed steps, 2 steps under torch.cuda's "
                   "sync debug mode; rank 0 prints where the host waited for the GPU (see sync_points)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, 3 under torch.profiler and 3 under cProfile: rank 0 prints "
                        "its kernels and its host's busiest functions")
    return p.parse_args(argv)


def build(size: dict, seed: int, device: torch.device, dtype: torch.dtype):
    """The model from `seed`: the distributed run and the reference start from the same weights.
    No KV cache: training does not read one."""
    config = transformers.LlamaConfig(**size["config"], max_position_embeddings=size["seq"], use_cache=False,
                                      attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


class WithLoss(torch.nn.Module):
    """A causal LM and its loss on the next tokens: token ids -> the loss, the logits kept inside.
    `head_backend`: the LM head and the loss compiled as one function of the last hidden state
    (FSDP2's recipe, the module's docstring), the same ops as the LM's own forward with labels."""

    def __init__(self, lm, head_backend: str | None = None):
        super().__init__()
        self.lm = lm
        self.head_loss = torch.compile(self._head_loss, backend=head_backend) if head_backend else None

    def _head_loss(self, hidden, ids):
        return self.lm.loss_function(logits=self.lm.lm_head(hidden), labels=ids, vocab_size=self.lm.config.vocab_size)

    def forward(self, ids):
        if self.head_loss is None:
            return self.lm(input_ids=ids, labels=ids).loss
        return self.head_loss(self.lm.model(input_ids=ids).last_hidden_state, ids)


def wrap(lm, how: str, backend: str, bucket_mb: float, device: torch.device):
    """The model with its loss, wrapped, compiled (the module's docstring says why these recipes)."""
    if how == "ddp":
        model = DistributedDataParallel(WithLoss(lm), device_ids=[device.index] if device.type == "cuda" else None,
                                        bucket_cap_mb=bucket_mb)
        return torch.compile(model, backend=backend)
    model = WithLoss(lm, head_backend=backend)
    for layer in lm.model.layers:
        layer.compile(backend=backend)
        fully_shard(layer)
    fully_shard(model)
    return model


def train(model, ids, lr: float, steps: int, device: torch.device, world: int = 1):
    """Each step's loss (averaged over the ranks where world > 1) and wall time (s), and on CUDA the
    peak memory (MiB) of the first step (compiling, warming up) and of the steps after it."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times, first = [], [], None
    for step in range(steps):
        if device.type == "cuda" and step == 1:  # the first step compiles and warms up: its peak apart
            first = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())  # waits for the step's kernels, on the GPU too
        times.append(time.perf_counter() - start)
    later = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return losses, times, dict(first_step=first, later_steps=later) if later else None


def profile(model, ids, device: torch.device, steps: int = 3, trace: str | None = None) -> dict:
    """Where a step's time goes (rank 0's view): wall ms and GPU kernel ms a step, launches a step, and
    the 15 kernels with the most GPU time.  Kernel time well under the wall means the host is the limit."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same kernels' shapes; no weight moves
    acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            model(ids).backward()
            opt.step()
            opt.zero_grad()
        sync(device)
        wall = (time.perf_counter() - start) / steps
    if trace:
        prof.export_chrome_trace(trace)  # gzipped by torch (the .gz suffix)
    kernel = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ms = {e.key: e.self_device_time_total / 1e3 / steps for e in kernel}
    launches = {e.key: e.count / steps for e in kernel}
    top = sorted(ms, key=ms.get, reverse=True)[:15]
    host = cProfile.Profile()  # the host's own time per function, no profiler hooks on the kernels
    host.enable()
    for _ in range(steps):
        model(ids).backward()
        opt.step()
        opt.zero_grad()
    sync(device)
    host.disable()
    stats = pstats.Stats(host).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
    ours = str(Path(fuser.__file__).parent.parent)  # fuser's and its codegen's functions, by cumulative time
    cum = sorted((kv for kv in stats.items() if kv[0][0].startswith(ours)), key=lambda kv: -kv[1][3])[:20]
    return dict(wall_ms=wall * 1e3, kernel_ms=sum(ms.values()), launches=sum(launches.values()),
                top=[(k, ms[k], launches[k]) for k in top],
                host=[(f"{Path(f).name}:{line}({name})", v[2] * 1e3 / steps, v[0] / steps) for (f, line, name), v in own],
                ours=[(f"{Path(f).name}:{line}({name})", v[3] * 1e3 / steps, v[0] / steps) for (f, line, name), v in cum])


def sync_points(model, ids, steps: int = 2) -> list:
    """Where a warm step makes the host wait for the GPU (torch.cuda's sync debug mode): [(calls a step, the
    Python frames that made the call, innermost last)].  FSDP2 prefetches the next layer's all-gather only as far
    as the host runs ahead of the GPU: a wait inside a step serialises its communication with its compute."""
    import traceback
    import warnings
    seen: dict = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in traceback.extract_stack()[:-2]
                  if "/warnings.py" not in f.filename][-8:]
        seen[tuple(frames)] = seen.get(tuple(frames), 0) + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                model(ids).backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(torch_mode)
    return sorted(((n / steps, list(k)) for k, n in seen.items()), key=lambda x: -x[0])


def fusion(reports) -> dict:
    """What fuser did on rank 0 (the JSON's "fusion"): graphs compiled (backward ones among them),
    attention and losses claimed before autograd, regions fused in the forward and backward graphs,
    graphs left to eager as a whole (why)."""
    backward = [r for r in reports if "backward graph (from AOT Autograd)" in r.notes]
    forward = [r for r in reports if r not in backward]
    return dict(fused_graphs=len(reports), backward_graphs=len(backward),
                fused_losses=sum("linear + cross-entropy claimed" in n for r in forward for n in r.notes),
                fused_attention=sum("attention claimed before autograd" in n for r in forward for n in r.notes),
                regions={"forward": sum(len(r.regions) for r in forward),
                         "backward": sum(len(r.regions) for r in backward)},
                fallbacks=[f for r in reports for f in r.all_fallbacks])


def main(argv=None):
    """Trains; rank 0 prints the table, writes --out, checks the losses and returns the results
    (other ranks: None)."""
    args = parse(argv)
    size = SIZES[args.size]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", dist.get_node_local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    assert size["rows"] % world == 0, f"{size['rows']} rows do not split over {world} ranks"
    ids = torch.randint(0, size["config"]["vocab_size"], (size["rows"], size["seq"]),
                        generator=torch.Generator().manual_seed(args.seed)).to(device)

    model = wrap(build(size, args.seed, device, dtype), args.wrap, args.backend, size["bucket_mb"], device)
    losses, times, peak = train(model, ids.chunk(world)[rank], size["lr"], args.steps, device, world)
    kernels = profile(model, ids.chunk(world)[rank], device, trace=f"{args.trace}.rank{rank}.json.gz" if args.trace else None) \
        if args.profile else None
    syncs = sync_points(model, ids.chunk(world)[rank]) if args.sync_debug and cuda else None
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    del model  # its memory, before rank 0's reference
    if rank == 0:
        reference, _, _ = train(WithLoss(build(size, args.seed, device, dtype)), ids, size["lr"], args.steps, device)
    dist.barrier()  # every rank leaves together
    dist.destroy_process_group()
    if rank != 0:
        return None

    median = statistics.median(times[len(times) // 2:])
    result = dict(wrap=args.wrap, backend=args.backend, size=args.size, dtype=str(dtype).removeprefix("torch."),
                  device=torch.cuda.get_device_name(device) if cuda else "cpu", world_size=world,
                  losses={"distributed": losses, "reference": reference}, rtol=TOLERANCE[dtype],
                  median_step_ms=median * 1e3, peak_mib=peaks, compile_s=times[0] - median,
                  fusion=fusion(fuser.reports()) if args.backend == "fuser" else None, kernels=kernels, syncs=syncs)
    print(f"{args.wrap} + {args.backend}: {world} x {result['device']}, {result['dtype']}, size {args.size}")
    print(f"{'step':>4}  {'distributed':>12}  {'reference':>12}  {'rel diff':>9}  {'ms':>9}")
    for step, (d, r, t) in enumerate(zip(losses, reference, times)):
        print(f"{step:4d}  {d:12.6f}  {r:12.6f}  {abs(d - r) / abs(r):9.2e}  {t * 1e3:9.1f}")
    print(f"median step {result['median_step_ms']:.1f} ms (last {len(times) - len(times) // 2} steps), compile "
          f"{result['compile_s']:.1f} s (first step less the median), peak MiB per rank {peaks}")
    if result["fusion"]:
        print("fuser:", result["fusion"])
    if kernels:
        print(f"profiled: wall {kernels['wall_ms']:.1f} ms, kernels {kernels['kernel_ms']:.1f} ms, "
              f"{kernels['launches']:.0f} launches a step; the largest (name, ms, launches a step):")
        for row in kernels["top"]:
            print(f"  {row[1]:8.3f}  {row[2]:5.0f}  {row[0][:110]}")
        print("host (cProfile, own ms and calls a step):")
        for row in kernels["host"]:
            print(f"  {row[1]:8.3f}  {row[2]:6.0f}  {row[0][:110]}")
        print("fuser's functions (cumulative ms and calls a step):")
        for row in kernels["ours"]:
            print(f"  {row[1]:8.3f}  {row[2]:6.0f}  {row[0][:110]}")
    if syncs is not None:
        print(f"host waits for the GPU in a warm step: {sum(n for n, _ in syncs):.0f}")
        for n, frames in syncs[:12]:
            print(f"  {n:5.1f}  " + " <- ".join(reversed(frames[-5:])))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    off = [(s, d, r) for s, (d, r) in enumerate(zip(losses, reference)) if abs(d - r) > TOLERANCE[dtype] * abs(r)]
    assert not off, f"steps (step, distributed, reference) off by more than rtol {TOLERANCE[dtype]}: {off}"
    return result


if __name__ == "__main__":
    main()
