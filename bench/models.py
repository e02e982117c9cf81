"""Whole models, eager vs Inductor vs fuser: step time, host/kernel split, memory, compile time, error.

Seven HF transformers models with random weights (torch.manual_seed(0)), bf16, eval, no_grad, on cuda:
gpt2 (4 layers, B4 T512), llama-gqa (d2048, 16 heads / 4 KV heads, 4 layers, B4 T512), bert-padded
(4 layers, B8 T256, last 64 positions masked out on every other row), vit (4 layers, 224 px, patch 16,
B32), t5-encoder (relative-position bias, 4 layers, B8 T256) and llama-decode (llama-gqa, B1, one new
token over a StaticCache holding 1024 prefilled tokens; every call writes the same slot) and
gemma2-softcap (llama-gqa's sizes, attention logits soft-capped at 50, no sliding window: the
attention SDPA cannot express, our kernel's, forward and backward).

Systems, each a fresh compile after torch._dynamo.reset(): eager (eager attention), eager+sdpa,
inductor, inductor-ro (mode="reduce-overhead"), fuser (backend="fuser"), fuser-cg (backend="fuser",
mode="reduce-overhead") and fuser-eager-attn (backend="fuser" on the eager-attention model). Per cell:
compile_s (first call, synchronised), ms (see interleave below; do_bench's median in bench_ms), err
(||a-b||/||b|| of the logits / last_hidden_state against eager+sdpa; ok below 2e-2), peak_mib (peak
allocated during one call over what was allocated before it), and over 5 profiled steps wall_ms,
kernel_ms (GPU time of kernels) and kernels per step.

    python bench/models.py [--only gpt2,vit] [--systems fuser,inductor] [--budget 540] [--out DIR]
    python bench/models.py --smoke --out /tmp/smoke   # CPU, tiny configs, 4 systems, perf_counter timing
    python bench/models.py --train [--only ...]       # training steps: <gpu>-<date>-train.{json,md}

--train measures one training step per cell instead: forward and loss compiled together (the causal LMs:
the model's own loss on labels = input_ids, so the logits are dead after it, as in a compiled training step;
the others: mean(output^2) in fp32), backward and an AdamW step (outside the compiled function, the same
for every system), dropout off, each system on its own copy of the same weights; err compares the first
step's loss with eager+sdpa's; peak MiB is over the memory held before the step (weights, gradients,
AdamW state).  llama-128k is llama-gqa with a 128256-token vocabulary at B4 T2048 (8192 tokens: its
logits are 2.1 GB in bf16), for the fused linear + cross-entropy; llama-128k-whole is the same with the
model itself compiled (a user's `torch.compile(model)`: its output holds the logits too, so they are made).
A host-bound step moves with the host (T5's encoder read 0.55x Inductor in one run, 1.06x and 1.07x in
turns with it in another, run 137), so after its cells are measured each system's step is timed again in
turns with the others (`interleave`, inference and training), and ms is the median of those runs.
Models: all but llama-decode (inference: all but llama-128k-whole).  Systems: eager, eager+sdpa, inductor, fuser, fuser-eager-attn.

Writes <gpu>-<date>-models.{json,md} after every cell, so a run cut short keeps what it measured.
"""
import argparse
import datetime
import gc
import inspect
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import time_limit  # noqa: E402  (bench/bench.py: one SIGALRM limit for both benches)
from fuser.backend import all_reports, fuser_backend  # noqa: E402

# installed, fuser registers its backend through an entry point; from a bare checkout, register it here
if "fuser" not in torch._dynamo.list_backends():
    torch._dynamo.register_backend(name="fuser")(fuser_backend)

BF16 = torch.bfloat16
TOL = 2e-2
SYSTEMS = ["eager", "eager+sdpa", "inductor", "inductor-ro", "fuser", "fuser-cg", "fuser-eager-attn"]
SMOKE_SYSTEMS = ["eager", "eager+sdpa", "fuser", "fuser-eager-attn"]
TRAIN_SYSTEMS = ["eager", "eager+sdpa", "inductor", "inductor-ro", "fuser", "fuser-cg", "fuser-eager-attn"]
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              "bert-padded": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "vit": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "t5-encoder": dict(dropout_rate=0.0), "llama-gqa": dict(attention_dropout=0.0),
              "gemma2-softcap": dict(attention_dropout=0.0)}
MODELS = ["gpt2", "llama-gqa", "bert-padded", "vit", "t5-encoder", "llama-decode", "gemma2-softcap", "llama-128k",
          "llama-128k-whole"]
LMS = ("gpt2", "llama-gqa", "gemma2-softcap", "llama-128k", "llama-128k-whole")  # in training: the model's own loss on labels = input_ids
WHOLE = ("llama-128k-whole",)  # training only: the model itself compiled, returning loss and logits


# ---------------------------------------------------------------- models

def _dims(smoke):
    """Full sizes, or the tiny ones of --smoke."""
    if smoke:
        return dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=16, batch=2,
                    image=32, patch=8, cache=40, prefill=32)
    return dict(layers=4, hidden=768, heads=12, llama_hidden=2048, llama_heads=16, kv_heads=4,
                llama_ffn=5632, ffn=3072, llama_vocab=32000, gpt2_vocab=50257, vocab=32128, seq=512,
                batch=4, bert_batch=8, bert_seq=256, image=224, patch=16, vit_batch=32,
                t5_hidden=512, t5_ffn=2048, t5_heads=8, t5_batch=8, t5_seq=256, cache=1040, prefill=1024,
                big_vocab=128256, big_seq=2048)


def _config(name, d):
    """(model class, config class, config kwargs) of one model."""
    import transformers as tf
    g = lambda key, default: d.get(key, d[default])  # noqa: E731  a full-size key, or the shared tiny one
    if name == "gpt2":
        v = g("gpt2_vocab", "vocab")
        return tf.GPT2LMHeadModel, tf.GPT2Config, dict(
            n_layer=d["layers"], n_embd=d["hidden"], n_head=d["heads"], vocab_size=v, n_positions=1024,
            bos_token_id=v - 1, eos_token_id=v - 1, use_cache=False)
    if name in ("llama-gqa", "llama-decode", "llama-128k", "llama-128k-whole"):
        vocab = g("big_vocab", "vocab") if name.startswith("llama-128k") else g("llama_vocab", "vocab")
        return tf.LlamaForCausalLM, tf.LlamaConfig, dict(
            hidden_size=g("llama_hidden", "hidden"), num_attention_heads=g("llama_heads", "heads"),
            num_key_value_heads=d["kv_heads"], intermediate_size=g("llama_ffn", "ffn"),
            num_hidden_layers=d["layers"], vocab_size=vocab, max_position_embeddings=2048)
    if name == "bert-padded":
        return tf.BertModel, tf.BertConfig, dict(
            hidden_size=d["hidden"], num_attention_heads=d["heads"], num_hidden_layers=d["layers"],
            intermediate_size=d["ffn"], vocab_size=d["vocab"])
    if name == "vit":
        return tf.ViTModel, tf.ViTConfig, dict(
            hidden_size=d["hidden"], num_attention_heads=d["heads"], num_hidden_layers=d["layers"],
            intermediate_size=d["ffn"], image_size=d["image"], patch_size=d["patch"])
    if name == "t5-encoder":
        return tf.T5EncoderModel, tf.T5Config, dict(
            d_model=g("t5_hidden", "hidden"), d_ff=g("t5_ffn", "ffn"), num_heads=g("t5_heads", "heads"),
            d_kv=g("t5_hidden", "hidden") // g("t5_heads", "heads"), num_layers=d["layers"], vocab_size=d["vocab"],
            use_cache=False)
    if name == "gemma2-softcap":  # attention logits soft-capped (50), GQA, every layer global (no window)
        return tf.Gemma2ForCausalLM, tf.Gemma2Config, dict(
            hidden_size=g("llama_hidden", "hidden"), num_attention_heads=g("llama_heads", "heads"),
            num_key_value_heads=d["kv_heads"], head_dim=g("llama_hidden", "hidden") // g("llama_heads", "heads"),
            intermediate_size=g("llama_ffn", "ffn"), num_hidden_layers=d["layers"], vocab_size=g("llama_vocab", "vocab"),
            max_position_embeddings=2048, attn_logit_softcapping=50.0, final_logit_softcapping=None,
            sliding_window=4096, layer_types=["full_attention"] * d["layers"], use_cache=False)
    raise ValueError(name)


def _build(name, d, attn, device, weights=None, train=False):
    """The model with attention `attn` ("sdpa" or "eager"), bf16, eval (train: training mode, dropout
    off, gradients on); weights copied from `weights`.  A model that does not support sdpa (T5 in
    transformers 4.x) is built with eager attention."""
    model_cls, config_cls, kwargs = _config(name, d)
    if train:
        kwargs.update(NO_DROPOUT.get(name, {}))
    torch.manual_seed(0)
    extra = {"add_pooling_layer": False} if name in ("bert-padded", "vit") else {}
    with torch.device(device):
        try:
            model = model_cls(config_cls(**kwargs, attn_implementation=attn), **extra)
        except ValueError:  # "does not support an attention implementation through ..."
            model = model_cls(config_cls(**kwargs, attn_implementation="eager"), **extra)
    model = model.to(BF16).train(train).requires_grad_(train)
    if getattr(model, "loss_type", "") is None:  # GPT2LMHeadModel (transformers 5): named here, else its
        model.loss_type = "ForCausalLM"  # loss_function warns on every call, a graph break under Dynamo
    if weights is not None:
        model.load_state_dict(weights.state_dict())
    return model


def _inputs(name, d, model, device):
    """Keyword arguments of one forward call, and the name of the output compared."""
    torch.manual_seed(0)
    vocab = getattr(model.config, "vocab_size", None)
    if name in ("gpt2", "llama-gqa", "gemma2-softcap", "llama-128k", "llama-128k-whole"):
        t = d.get("big_seq", d["seq"]) if name.startswith("llama-128k") else d["seq"]
        return {"input_ids": torch.randint(0, vocab, (d["batch"], t), device=device), "use_cache": False}, "logits"
    if name == "bert-padded":
        b, t = d.get("bert_batch", d["batch"]), d.get("bert_seq", d["seq"])
        mask = torch.ones(b, t, dtype=torch.long, device=device)
        mask[1::2, -(t // 4):] = 0  # every other row: its last quarter (64 of 256 tokens) is padding
        return {"input_ids": torch.randint(0, vocab, (b, t), device=device), "attention_mask": mask}, "last_hidden_state"
    if name == "vit":
        b, px = d.get("vit_batch", d["batch"]), d["image"]
        return {"pixel_values": torch.randn(b, 3, px, px, device=device, dtype=BF16)}, "last_hidden_state"
    if name == "t5-encoder":
        b, t = d.get("t5_batch", d["batch"]), d.get("t5_seq", d["seq"])
        return {"input_ids": torch.randint(0, vocab, (b, t), device=device)}, "last_hidden_state"
    raise ValueError(name)


def _static_cache(model, max_len, device):
    """A StaticCache for batch 1: transformers >= 4.56 (and 5.x) take (config, max_cache_len) and allocate
    lazily; older 4.x take max_batch_size (or batch_size), device and dtype."""
    from transformers import StaticCache
    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": max_len}
    for batch_kw in ("max_batch_size", "batch_size"):
        if batch_kw in params:
            kwargs.update({batch_kw: 1, "device": device, "dtype": BF16})
            break
    return StaticCache(**kwargs)


class DecodeStep:
    """One decode step over a prefilled StaticCache, the same every call: token `prefill` written to
    slot `prefill`. transformers 5.x place new keys at each layer's `cumulative_length` (a tensor the
    update advances), so every call first sets those back to `prefill`, one foreach copy outside the
    compiled model; 4.x place them at `cache_position`, which is passed."""

    def __init__(self, model, d, device):
        self.cache = _static_cache(model, d["cache"], device)
        self.pass_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        n = d["prefill"]
        torch.manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        self.prefill_kwargs = self._kwargs(prompt, torch.arange(n, device=device))
        model(**self.prefill_kwargs)  # eager, once: fills slots 0..n-1 (and allocates a lazy cache)
        self.kwargs = self._kwargs(prompt[:, -1:], torch.tensor([n], device=device))
        layers = getattr(self.cache, "layers", [])
        self.lengths = [layer.cumulative_length for layer in layers
                        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        self.filled = [torch.full_like(t, n) for t in self.lengths]

    def _kwargs(self, ids, positions):
        kwargs = {"input_ids": ids, "position_ids": positions[None], "past_key_values": self.cache, "use_cache": True}
        if self.pass_cache_position:
            kwargs["cache_position"] = positions
        return kwargs

    def rewind(self):
        if self.lengths:
            torch._foreach_copy_(self.lengths, self.filled)


def _prepare(name, d, device, systems):
    """({system: a maker of the step, a callable returning the compared output}, the reference output
    (eager+sdpa), {system: the attention implementation its model really uses})."""
    sdpa = _build(name, d, "sdpa", device)
    need_eager = any(s in ("eager", "fuser-eager-attn") for s in systems)
    eager = _build(name, d, "eager", device, weights=sdpa) if need_eager else None
    if name == "llama-decode":
        step = DecodeStep(sdpa, d, device)
        kwargs, out_name, pre = step.kwargs, "logits", step.rewind
    else:
        kwargs, out_name = _inputs(name, d, sdpa, device)
        pre = None

    def caller(fn):
        def call():
            if pre is not None:
                pre()
            return getattr(fn(**kwargs), out_name)
        return call

    makers = {
        "eager": lambda: eager,
        "eager+sdpa": lambda: sdpa,
        "inductor": lambda: torch.compile(sdpa),
        "inductor-ro": lambda: torch.compile(sdpa, mode="reduce-overhead"),
        "fuser": lambda: torch.compile(sdpa, backend="fuser"),
        "fuser-cg": lambda: torch.compile(sdpa, backend="fuser", mode="reduce-overhead"),
        "fuser-eager-attn": lambda: torch.compile(eager, backend="fuser"),
    }
    ref = caller(sdpa)().detach().clone()
    makes = {s: (lambda s=s: caller(makers[s]())) for s in systems}
    attn = {s: (eager if s in ("eager", "fuser-eager-attn") else sdpa).config._attn_implementation for s in systems}
    return makes, ref, attn


def _prepare_train(name, d, device, systems):
    """Training: ({system: a maker of one step, returning the step's loss}, eager+sdpa's first loss,
    {system: attention implementation})."""
    base = _build(name, d, "sdpa", device, train=True)
    kwargs, out_name = _inputs(name, d, base, device)
    compilers = {"eager": lambda f: f, "eager+sdpa": lambda f: f, "inductor": torch.compile,
                 "inductor-ro": lambda f: torch.compile(f, mode="reduce-overhead"),
                 "fuser": lambda f: torch.compile(f, backend="fuser"),
                 "fuser-cg": lambda f: torch.compile(f, backend="fuser", mode="reduce-overhead"),
                 "fuser-eager-attn": lambda f: torch.compile(f, backend="fuser")}

    def loss_of(model):  # what each system compiles: the model and its loss, returning the loss alone
        if name in LMS:
            return lambda **kw: model(**kw, labels=kw["input_ids"]).loss
        return lambda **kw: getattr(model(**kw), out_name).float().square().mean()

    def maker(system):
        attn = "eager" if system in ("eager", "fuser-eager-attn") else "sdpa"
        model = _build(name, d, attn, device, weights=base, train=True)
        whole = name in WHOLE  # a user's torch.compile(model): its output holds the loss and the logits
        compiled = compilers[system](model if whole else loss_of(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        graphed = system in ("inductor-ro", "fuser-cg")

        def step():
            start = time.perf_counter()
            if graphed:  # a new step: the previous step's graph outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(**kwargs, labels=kwargs["input_ids"]).loss if whole else compiled(**kwargs)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step.phases = (forward - start, backward - forward, time.perf_counter() - backward)
            return loss.detach()
        step.phases = None  # the host seconds of the latest step's forward, backward and optimizer (breakdown.py)
        return step

    ref = loss_of(base)(**kwargs).detach()
    attn = {s: "eager" if s in ("eager", "fuser-eager-attn") else base.config._attn_implementation for s in systems}
    return {s: (lambda s=s: maker(s)) for s in systems}, ref, attn


# ---------------------------------------------------------------- measuring one cell

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_events(prof):
    """Device-side kernel events (memcpy / memset activities left out, and user annotations such as
    the optimizer's "Optimizer.step#AdamW.step": a span over kernels already counted, not a kernel)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset")) and not getattr(e, "is_user_annotation", False)]


def profile(fn, device, steps=5):
    """Host wall ms, kernel GPU ms and kernel count per step, over `steps` profiled steps."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    _sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        wall = time.perf_counter() - start
    kernels = _kernel_events(prof)
    us = sum(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) for e in kernels)
    return {"wall_ms": wall * 1e3 / steps, "kernel_ms": us / 1e3 / steps, "kernels": len(kernels) / steps}


STREAM_STEPS = 10  # training: steps run back to back per timed run


def measure(cell, make, ref, device, smoke, streamed=False):
    """Fill `cell` in place: compile_s, err, ok, peak_mib, ms, then the profiler's numbers.
    `streamed` (training): ms is the time a step takes in a loop that does not wait for each step,
    as a training loop runs (the median of 3 runs of STREAM_STEPS steps back to back); do_bench's
    median, which waits for every step and clears the L2 cache between steps, goes in bench_ms (and in ms,
    inference).  On this host the two disagree by up to 1.8x for host-bound steps (bench/notes.md, run 40).
    On the GPU, `interleave` then times every cell again, in turns with the other systems."""
    fn = cell["_fn"] = make()
    _sync(device)
    start = time.perf_counter()
    out = fn().detach().clone()  # cloned at once: a CUDA graph's next replay overwrites its output
    _sync(device)
    cell["compile_s"] = time.perf_counter() - start
    for _ in range(3):  # warm-up; reduce-overhead records its CUDA graphs here
        fn()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    cell.update(err=err, ok=bool(err < TOL))
    del out
    if smoke:  # CPU: no do_bench, no profiler, no memory counters
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        cell["ms"] = statistics.median(times)
        return
    from triton.testing import do_bench
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    cell["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    cell["bench_ms"] = cell["ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
    if streamed:
        runs = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(STREAM_STEPS):
                fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - start) / STREAM_STEPS * 1e3)
        cell["ms"] = statistics.median(runs)
    cell.update(profile(fn, device))


def run_model(name, args, device, emit):
    d = _dims(args.smoke)
    grad = torch.enable_grad() if args.train else torch.no_grad()
    try:
        with grad:
            fns, ref, attn = (_prepare_train if args.train else _prepare)(name, d, device, args.systems)
    except Exception as e:  # noqa: BLE001 - a model that cannot be built leaves the others measured
        emit({"model": name, "system": "build", "error": _first_line(e)})
        return
    cells = []
    for system in args.systems:
        torch._dynamo.reset()
        cell = {"model": name, "system": system, "attn": attn[system]}
        cells.append(cell)
        seen = len(all_reports())
        try:
            with (torch.enable_grad() if args.train else torch.no_grad()), time_limit(args.limit):
                measure(cell, fns[system], ref, device, args.smoke, streamed=args.train)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the rest of the table
            cell["error"] = _first_line(e)
        if system.startswith("fuser"):  # graphs fuser compiled (>1: graph breaks), and any it left to eager ATen
            reports = all_reports()[seen:]
            cell["graphs"] = len(reports)
            cell["fallbacks"] = [f[:200] for r in reports for f in r.all_fallbacks]
            att = [reg for r in reports for reg in r.regions if reg.kind == "attention"]
            claimed = sum(n.startswith("attention claimed") for r in reports for n in r.notes)
            cell["attention"] = (f"{sum(a.kernel == 'sdpa' for a in att)} as SDPA, {sum(a.kernel != 'sdpa' for a in att)} "
                                 f"as our kernel, {claimed} claimed before autograd")
        emit(cell)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        with torch.enable_grad() if args.train else torch.no_grad():
            interleave([c for c in cells if "ms" in c and "error" not in c], args.limit)
        emit(None)
    for c in cells:
        c.pop("_fn", None)
    torch._dynamo.reset()


INTERLEAVED_ROUNDS = 5


def interleave(cells, limit: float):
    """A host-bound step's time moves with the host (the same code read 6.2 and 8.5 ms in two processes, and
    ±20% between the runs of one measurement): so the systems' steps are timed again in turns, one run of
    STREAM_STEPS steps each, round after round, and each cell's ms becomes the median of its runs (the
    first measurement stays in ms_sequential).  A drift of the host then weighs on every system alike.
    A cell whose graphs fail to compile again (Dynamo was reset between the systems) or run past `limit`
    seconds keeps its first measurement, with the reason in interleave_error; the others go on."""
    ready = []
    for c in cells:  # each system's graphs again, and a warm-up
        try:
            with time_limit(limit):
                for _ in range(3):
                    c["_fn"]()
            ready.append(c)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the rest of the table
            c["interleave_error"] = _first_line(e)
    cells = ready
    if len(cells) < 2:
        return
    runs = {id(c): [] for c in cells}
    for _ in range(INTERLEAVED_ROUNDS):
        for c in cells:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(STREAM_STEPS):
                c["_fn"]()
            torch.cuda.synchronize()
            runs[id(c)].append((time.perf_counter() - start) / STREAM_STEPS * 1e3)
    for c in cells:
        c["ms_sequential"], c["ms"] = c["ms"], statistics.median(runs[id(c)])
        c["ms_runs"] = [round(r, 3) for r in runs[id(c)]]


def _first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


# ---------------------------------------------------------------- output

def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(meta, cells):
    by = {(c["model"], c["system"]): c for c in cells}
    ms = lambda m, s: by.get((m, s), {}).get("ms")  # noqa: E731
    what = ("one training step (forward, the LM loss or mean(output^2), backward, AdamW; err: the first step's loss vs "
            "eager+sdpa's)" if meta.get("train") else "inference")
    lines = [f"# whole models, {what}: {meta['device']}, {meta['date']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}"
             f"{'; SMOKE (CPU, tiny configs; ms = median of 3 calls)' if meta['smoke'] else ''}.", "",
             "ms = steps back to back as a loop runs them, timed in turns with the other systems (interleave: the "
             "host drifts by up to 1.5x within a run, run 137): the median of 5 runs of 10 steps, per step (a model with one "
             "system measured: do_bench's median); do_bench's median, "
             "which waits for each step, in do_bench ms; vs inductor = inductor ms / ms (inductor-ro for reduce-overhead "
             "systems), vs eager = eager ms / ms (>1: faster); wall/kernel = host wall ms / GPU kernel ms per step "
             "over 5 profiled steps; kernels per step; peak MiB = peak allocated in one call over what was "
             "allocated before it; compile s = first call; err = ||a-b||/||b|| vs eager+sdpa (ok < 2e-2). "
             "llama-decode's step includes resetting the StaticCache's lengths (one foreach copy, transformers 5.x).",
             "",
             "| model | system | ms | vs inductor | vs eager | do_bench ms | wall/kernel | kernels | peak MiB | compile s | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        m, s = c["model"], c["system"]
        shown = s if c.get("attn") in (None, "eager" if s in ("eager", "fuser-eager-attn") else "sdpa") \
            else f"{s} (attn: {c['attn']})"  # a model without sdpa support runs eager attention
        if "ms" not in c and "error" in c:
            lines.append(f"| {m} | {shown} | ERROR: {c['error'][:120]} | | | | | | | | |")
            continue
        base = ms(m, "inductor-ro" if s in ("inductor-ro", "fuser-cg") else "inductor")
        speed = lambda b: f"{b / c['ms']:.2f}x" if b and c.get("ms") else "—"  # noqa: E731
        ratio = f"{c['wall_ms'] / c['kernel_ms']:.2f}" if c.get("kernel_ms") else "—"
        err = f"{c['err']:.1e} {'ok' if c['ok'] else 'BAD'}" if "err" in c else "—"
        if "error" in c:
            err += f" ERROR: {c['error'][:80]}"
        lines.append(f"| {m} | {shown} | {_fmt(c.get('ms'), '.3f')} | {speed(base)} | {speed(ms(m, 'eager'))} | {_fmt(c.get('bench_ms'), '.3f')} | {ratio} "
                     f"| {_fmt(c.get('kernels'), '.0f')} | {_fmt(c.get('peak_mib'), '.0f')} "
                     f"| {_fmt(c.get('compile_s'), '.1f')} | {err} |")
    graphs = 2 if meta.get("train") else 1  # training: a forward and a backward graph
    notes = [f"- {c['model']} / {c['system']}: {c['graphs']} graphs" + "".join(f"; fallback: {f}" for f in c["fallbacks"])
             for c in cells if c.get("graphs", graphs) != graphs or c.get("fallbacks")]
    lines += ["", *([f"fuser graph breaks (graphs > {graphs}) and graphs left to eager ATen:", *notes, ""] if notes else [])]
    found = [f"- {c['model']} / {c['system']}: {c['attention']}" for c in cells if c.get("attention")]
    lines += ["attention found by fuser (lowered to SDPA or our kernel; in training, claimed before autograd):", *found, ""]
    for ours, theirs in (("fuser", "inductor"), ("fuser-cg", "inductor-ro")):
        pairs = [(ms(m, theirs), ms(m, ours)) for m in dict.fromkeys(c["model"] for c in cells)]
        speedups = [t / o for t, o in pairs if t and o]
        if speedups:
            g = math.exp(sum(map(math.log, speedups)) / len(speedups))
            lines.append(f"geomean speedup {ours} vs {theirs} ({theirs} ms / {ours} ms) over "
                         f"{len(speedups)} models: {g:.3f}x  ")
    return "\n".join(lines) + "\n"


def _meta(device, smoke):
    import transformers
    import triton
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "slug": re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"),
            "date": datetime.date.today().isoformat(), "smoke": smoke, "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help=f"comma-separated models; default all: {','.join(MODELS)}")
    p.add_argument("--systems", help=f"comma-separated systems; default all: {','.join(SYSTEMS)}")
    p.add_argument("--budget", type=float, default=540, help="start no new model after this many seconds")
    p.add_argument("--limit", type=int, default=240, help="seconds allowed to one cell (model x system)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny configs, 4 systems, no do_bench/profiler")
    p.add_argument("--train", action="store_true", help="a training step (forward, backward, AdamW) per cell")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    start = time.perf_counter()
    models = args.only.split(",") if args.only else [m for m in MODELS if not (m == "llama-decode" if args.train else m in WHOLE)]
    default = TRAIN_SYSTEMS if args.train else SYSTEMS
    args.systems = args.systems.split(",") if args.systems else (
        [s for s in SMOKE_SYSTEMS if s in default] if args.smoke else default)
    for bad in set(models) - set(MODELS) | set(args.systems) - set(SYSTEMS):
        p.error(f"unknown model or system {bad!r}")
    device = torch.device("cpu" if args.smoke else "cuda")
    meta = _meta(device, args.smoke)
    meta["train"] = args.train
    stem = args.out / f"{meta['slug']}-{meta['date']}-{'train' if args.train else 'models'}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    cells = []

    def emit(cell):  # None: the cells emitted so far changed (interleave)
        if cell is not None:
            cells.append(cell)
            print({k: v for k, v in cell.items() if k != "_fn"}, flush=True)
        stem.with_suffix(".json").write_text(json.dumps([{k: v for k, v in c.items() if k != "_fn"} for c in cells], indent=1))
        stem.with_suffix(".md").write_text(markdown(meta, cells))

    for name in models:
        if time.perf_counter() - start > args.budget:
            emit({"model": name, "system": "-", "error": f"skipped: past the {args.budget:.0f} s budget"})
            continue
        print(f"=== {name} ({time.perf_counter() - start:.0f} s in)", flush=True)
        run_model(name, args, device, emit)
        gc.collect()  # the model, its compiled versions and their CUDA graph pools
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nwrote {stem}.json and .md in {time.perf_counter() - start:.0f} s\n\n{markdown(meta, cells)}", flush=True)
    return 0 if all(c.get("ok") and "error" not in c for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
