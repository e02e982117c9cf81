"""fuser side by side with eager and Inductor, one row per workload (usage: bench/README.md)."""
import os
import tempfile

# Fresh cache directories before torch (or fuser) is imported, so that every
# "cold" compile time below really compiles, even after the test suite ran.
_CACHE_ROOT = tempfile.mkdtemp(prefix="fuser-bench-")
for _var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FUSER_CACHE_DIR"):
    os.environ[_var] = os.path.join(_CACHE_ROOT, _var.lower())

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import platform
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # fuser runs from the source tree; it is not pip-installed on the GPU machine

BF16 = torch.bfloat16
TOL = 2e-2


# ---------------------------------------------------------------- workloads, as a user writes them

class Chain4(nn.Module):
    def forward(self, a, b):
        return F.gelu(a + b) * 0.5 + a


class Chain8(nn.Module):
    def forward(self, a, b):
        t = a + b
        t = t * torch.sigmoid(t)
        t = t * 1.5 - 0.25
        t = torch.relu(t) + b
        return t.exp() * 0.01


class ResidualLayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x, r):
        return F.layer_norm(x + r, (self.d,), self.weight, self.bias)


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, line for line."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class ScaledSoftmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x.float() * 0.125, -1).to(x.dtype)


class SwiGLU(nn.Module):
    def forward(self, g):
        a, b = g.chunk(2, -1)
        return F.silu(a) * b


class WeightGrad(nn.Module):
    """A norm's weight gradient as the backward graph holds it: a product summed over the tokens
    (a column sum: fuser/split.py)."""

    def forward(self, grad, x):
        return (grad * x).sum(0)


class EmbeddingGrad(nn.Module):
    """A word embedding's gradient as the backward graph holds it: the gradient rows of each token id summed
    into a [vocabulary, width] table (fuser/embedding.py scatters them; Inductor's index_put)."""

    def __init__(self, vocabulary: int):
        super().__init__()
        self.vocabulary = vocabulary

    def forward(self, grad, ids):
        return torch.ops.aten.embedding_dense_backward(grad, ids, self.vocabulary, -1, False)


class CrossEntropy(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits.float(), target)


class LlamaBlock(nn.Module):
    """HF's decoder layer behind positional inputs, since fuse() takes example_inputs as a tuple."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, cos, sin):
        out = self.layer(hidden_states, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x returned a tuple; 5.x a tensor


# ---------------------------------------------------------------- rows

@dataclasses.dataclass
class Case:
    module: nn.Module
    inputs: tuple
    shape: str
    relnorm: bool = False  # compare by ‖a−b‖/‖b‖ rather than elementwise


@dataclasses.dataclass
class Row:
    name: str
    build: Callable[[bool, torch.device], Case]
    dynamic: bool = False  # compiled for symbolic sizes (fuse(dynamic=True), torch.compile(dynamic=True))


def _randn(shape, device):
    return torch.randn(shape, device=device, dtype=BF16)


def _on(module, device):
    """Inference module in bf16 on the device; no autograd state for any system to trace."""
    return module.to(device=device, dtype=BF16).eval().requires_grad_(False)


def _chain(cls):
    def build(quick, device):
        n = 2**16 if quick else 2**28
        return Case(_on(cls(), device), (_randn(n, device), _randn(n, device)), f"2^{n.bit_length() - 1}")
    return build


def _layer_norm(quick, device):
    m, d = (256, 512) if quick else (16384, 4096)
    return Case(_on(ResidualLayerNorm(d), device), (_randn((m, d), device), _randn((m, d), device)), f"{m}×{d}")


def _rms_norm(quick, device):
    m, d = (256, 512) if quick else (16384, 4096)
    return Case(_on(RMSNorm(d), device), (_randn((m, d), device),), f"{m}×{d}")


def _softmax(quick, device):
    m, d = (256, 512) if quick else (16384, 4096)
    return Case(_on(ScaledSoftmax(), device), (_randn((m, d), device),), f"{m}×{d}")


def _swiglu(quick, device):
    m, d = (256, 1024) if quick else (16384, 8192)
    return Case(_on(SwiGLU(), device), (_randn((m, d), device),), f"{m}×{d} in")


def _weight_grad(quick, device):
    m, d = (256, 512) if quick else (8192, 2048)
    return Case(_on(WeightGrad(), device), (_randn((m, d), device), _randn((m, d), device)), f"{m}×{d} -> {d}")


def _cross_entropy(quick, device):
    n, v = (64, 1000) if quick else (8192, 128256)
    target = torch.randint(0, v, (n,), device=device)
    return Case(_on(CrossEntropy(), device), (_randn((n, v), device), target), f"{n}×{v}")


def _embedding_grad(n, v, d):
    def build(quick, device):
        n_, v_, d_ = (256, 5000, 64) if quick else (n, v, d)
        ids = torch.randint(0, v_, (n_,), device=device)
        return Case(_on(EmbeddingGrad(v_), device), (_randn((n_, d_), device), ids), f"{n_} ids -> {v_}×{d_}")
    return build


def _llama_block(quick, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    if quick:
        dims, batch, seq = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2), 2, 64
    else:
        dims, batch, seq = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8), 4, 2048
    config = LlamaConfig(num_hidden_layers=1, attn_implementation="sdpa", **dims)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    with torch.no_grad():  # norm weights start at 1: make them random so a dropped `* w` shows
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    hidden = _randn((batch, seq, config.hidden_size), device)
    position_ids = torch.arange(seq, device=device)[None].expand(batch, seq)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(hidden, position_ids)
    shape = f"B{batch} T{seq} d{config.hidden_size}"
    return Case(_on(LlamaBlock(layer), device), (hidden, cos, sin), shape, relnorm=True)


def _bn_relu(channels_last, pool=None):
    """BatchNorm (eval: a per-channel affine from the running stats) + ReLU, as after every conv; `pool`
    after them: a ResNet stem's max pool (3x3, stride 2) at its size, 64 channels at 112x112."""
    def build(quick, device):
        n, c, hw = (4, 16, 14) if quick else (64, 64, 112) if pool else (64, 128, 56)
        bn = nn.BatchNorm2d(c)
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.normal_()
            bn.bias.normal_()
        x = _randn((n, c, hw, hw), device)
        layout = "channels_last" if channels_last else "NCHW"
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        return Case(_on(nn.Sequential(bn, nn.ReLU(), *[pool] if pool else []), device), (x,), f"{n}×{c}×{hw}×{hw} {layout}")
    return build


ROWS = [
    Row("4-op chain", _chain(Chain4)),
    Row("8-op chain", _chain(Chain8)),
    Row("residual + LayerNorm", _layer_norm),
    Row("RMSNorm", _rms_norm),
    Row("scaled softmax", _softmax),
    Row("SwiGLU gate", _swiglu),
    Row("norm weight gradient (column sum)", _weight_grad),
    Row("cross-entropy", _cross_entropy),
    Row("word embedding gradient (bert)", _embedding_grad(2048, 30522, 768)),
    Row("word embedding gradient (128K vocabulary)", _embedding_grad(8192, 128256, 2048)),
    Row("LlamaDecoderLayer (whole block)", _llama_block),
    Row("BatchNorm + ReLU, eval, NCHW", _bn_relu(False)),
    Row("BatchNorm + ReLU, eval, channels_last", _bn_relu(True)),
    Row("BatchNorm + ReLU + max pool 3x3/2, eval, NCHW", _bn_relu(False, nn.MaxPool2d(3, 2, 1))),
    Row("BatchNorm + ReLU + max pool 3x3/2, eval, channels_last", _bn_relu(True, nn.MaxPool2d(3, 2, 1))),
    Row("BatchNorm + ReLU + avg pool 2x2, eval, channels_last", _bn_relu(True, nn.AvgPool2d(2))),
]

# The same workloads with kernels compiled for symbolic sizes: same builder, same shape, timed at that
# shape after a first call at another size (`_grown`); the row also times fuser static, back to back.
DYNAMIC = ["8-op chain", "residual + LayerNorm", "RMSNorm", "scaled softmax", "SwiGLU gate", "cross-entropy"]
ROWS += [Row(f"{row.name} [dynamic]", row.build, dynamic=True) for row in ROWS if row.name in DYNAMIC]


def _grown(inputs):
    """The inputs with their leading (row / sequence) dimension one longer: every input whose dim 0
    matches the first one's gets a copy of its first slice appended (targets stay valid class ids)."""
    n = inputs[0].shape[0]
    return tuple(torch.cat([x, x[:1]]) if x.dim() and x.shape[0] == n else x for x in inputs)


def _grown_shape(inputs):
    """The shape of the first input that _grown makes, without making it."""
    return "×".join(map(str, (inputs[0].shape[0] + 1, *inputs[0].shape[1:])))


# ---------------------------------------------------------------- timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn, device):
    """Median ms from do_bench; None off CUDA, where do_bench cannot time."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def first_call(fn, device):
    """Wall seconds of fn() through to a synchronised device, and its result."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def copy_gbps(device):
    """Device-to-device copy bandwidth (bytes read + written) of a 2 GiB bf16 copy_: the roofline every row is held to."""
    if device.type != "cuda":
        return None
    src = _randn(2**30, device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / ms / 1e6


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in the main thread after `seconds`, so one stuck compile cannot eat the whole run."""
    def expire(signum, frame):
        raise TimeoutError(f"over the {seconds} s limit per system")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- correctness

def _mismatch(out, ref, relnorm):
    """None when out matches ref, else a one-paragraph reason."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"got {tuple(out.shape)} {out.dtype}, want {tuple(ref.shape)} {ref.dtype}"
    if relnorm:
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        return None if rel < TOL else f"‖a−b‖/‖b‖ = {rel:.3g} (want < {TOL})"
    try:
        torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    except AssertionError as e:
        return " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return None


def _fp32_reference(case):
    """The same module and inputs in fp32: the exact answer that eager's bf16 only approximates."""
    module = copy.deepcopy(case.module).float()
    inputs = tuple(x.float() if x.is_floating_point() else x for x in case.inputs)
    return module(*inputs)


def check(out, ref, case):
    """Hold fuser to eager; failing that, to fp32 math (eager rounds each op to bf16,
    which already puts it more than 2e-2 off the exact 8-op chain on ~0.6% of elements)."""
    reason = _mismatch(out, ref, case.relnorm)
    if reason is None:
        return "pass", None
    if _mismatch(out, _fp32_reference(case).to(ref.dtype), case.relnorm) is None:
        return "pass (fp32 ref)", reason
    return "FAIL", reason


# ---------------------------------------------------------------- systems

def _import_fuser():
    """fuser is written concurrently: return (module, None) or (None, why it cannot be used)."""
    try:
        import fuser
        if not hasattr(fuser, "fuse"):
            return None, f"the fuser package at {list(getattr(fuser, '__path__', []))} has no fuse() yet"
        return fuser, None
    except Exception as e:  # noqa: BLE001 - any import failure means the same: no fuser column
        traceback.print_exc()
        return None, f"import fuser failed: {type(e).__name__}: {e}"


def _report(fused):
    """fused.report's regions as JSON; byte counts may be sympy expressions, hence str()."""
    def num(x):
        try:
            return int(x)
        except (TypeError, ValueError):
            return str(x)
    return [
        {"kind": str(r.kind), "ops": [str(op) for op in r.ops], "k": num(r.k),
         "bytes_unfused": num(r.bytes_unfused), "bytes_fused": num(r.bytes_fused),
         "bytes_fused_expr": str(getattr(r, "bytes_fused_expr", r.bytes_fused))}
        for r in fused.report.regions
    ]


def _symbolic(regions):
    """"yes" when the report has regions and every one's fused bytes are a formula in size symbols
    (Dynamo's s0, s1, ...), i.e. its kernel was compiled for symbolic sizes; else "no"."""
    if not isinstance(regions, list) or not regions:
        return "no"
    return "yes" if all(re.search(r"[A-Za-z]", r["bytes_fused_expr"]) for r in regions) else "no"


def run_eager(case, device):
    _, ref = first_call(lambda: case.module(*case.inputs), device)
    return {"eager_ms": bench_ms(lambda: case.module(*case.inputs), device), "_ref": ref}


def run_inductor(case, device):
    compiled = torch.compile(case.module)
    seconds, _ = first_call(lambda: compiled(*case.inputs), device)
    return {"inductor_cold_s": seconds, "inductor_ms": bench_ms(lambda: compiled(*case.inputs), device)}


def run_fuser(fuser, case, ref, device):
    seconds, (fused, out) = first_call(lambda: _fuse_and_call(fuser, case), device)
    correct, reason = check(out, ref, case)
    del out
    result = {"fuser_cold_s": seconds, "correct": correct, "mismatch": reason}
    try:
        result["report"] = _report(fused)
    except Exception as e:  # noqa: BLE001 - a missing report must not hide the timings
        result["report"] = f"unreadable: {type(e).__name__}: {e}"
    result["fuser_ms"] = bench_ms(lambda: fused(*case.inputs), device)
    return result


def run_inductor_dynamic(case, device):
    """torch.compile(dynamic=True): first call at the grown size (cold s), timed at the row's shape."""
    compiled = torch.compile(case.module, dynamic=True)
    grown = _grown(case.inputs)
    seconds, _ = first_call(functools.partial(compiled, *grown), device)
    del grown, _  # free the grown copies before timing
    compiled(*case.inputs)
    return {"inductor_cold_s": seconds, "inductor_ms": bench_ms(lambda: compiled(*case.inputs), device)}


def kernel_ms(fn, device, calls=20):
    """GPU time of fuser's own kernels (fused_*, attention_*) per call, from the profiler: the kernels
    alone, without the host time around them (which the module times above include)."""
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ours = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and e.name.startswith(("fused_", "attention_"))]
    return sum(e.device_time for e in ours) / calls / 1000 if ours else None


def run_fuser_static(fuser, case, device):
    """The static baseline of a dynamic row, as the static row runs it, timed just before the dynamic one."""
    fused, out = _fuse_and_call(fuser, case)
    del out
    return {"fuser_static_ms": bench_ms(lambda: fused(*case.inputs), device),
            "fuser_static_kernel_ms": kernel_ms(lambda: fused(*case.inputs), device)}


_SEVERITY = {"pass": 0, "pass (fp32 ref)": 1, "FAIL": 2}


def run_fuser_dynamic(fuser, case, ref, device):
    """fuse(dynamic=True): first call at the grown size (cold s = fuse() + that call), then at the row's
    shape; both outputs checked against eager, the report read after the row-shape call, then timed."""
    grown = dataclasses.replace(case, inputs=_grown(case.inputs))

    def fuse_and_call(inputs):
        fused = fuser.fuse(case.module, dynamic=True)
        return fused, fused(*inputs)

    seconds, (fused, out) = first_call(functools.partial(fuse_and_call, grown.inputs), device)
    grown_check = check(out, case.module(*grown.inputs), grown)
    del out, grown
    out = fused(*case.inputs)
    checks = [("", check(out, ref, case)), (f"at the warm-up shape {_grown_shape(case.inputs)}: ", grown_check)]
    del out
    prefix, (correct, reason) = max(checks, key=lambda c: _SEVERITY[c[1][0]])
    result = {"fuser_cold_s": seconds, "correct": correct, "mismatch": reason and prefix + reason}
    try:
        result["report"] = _report(fused)
        result["fallbacks"] = list(fused.report.all_fallbacks)
        result["captures"] = len(fused.reports)  # graphs captured over both sizes: 1 when one kernel set serves both
    except Exception as e:  # noqa: BLE001 - a missing report must not hide the timings
        result["report"] = f"unreadable: {type(e).__name__}: {e}"
    result["symbolic"] = _symbolic(result["report"])
    result["fuser_ms"] = bench_ms(lambda: fused(*case.inputs), device)
    result["fuser_kernel_ms"] = kernel_ms(lambda: fused(*case.inputs), device)
    return result


def _dyn_over_static(result):
    """dyn/static = fuser dynamic ms / fuser static ms, of the module and of the kernels alone; the
    issue's target (a kernel for symbolic sizes within 10 % of the static one) is on the kernels."""
    dyn, static = result.get("fuser_ms"), result.get("fuser_static_ms")
    result["dyn_over_static"] = dyn / static if dyn and static else None
    kdyn, kstatic = result.get("fuser_kernel_ms"), result.get("fuser_static_kernel_ms")
    ratio = kdyn / kstatic if kdyn and kstatic else None
    result["kernel_dyn_over_static"] = ratio
    result["within_10pct"] = None if ratio is None else ("yes" if ratio <= 1.10 else "no")


def run_fuser_warm(fuser, case, device):
    seconds, _ = first_call(lambda: _fuse_and_call(fuser, case), device)
    return {"fuser_warm_s": seconds}


def _fuse_and_call(fuser, case):
    fused = fuser.fuse(case.module, example_inputs=case.inputs)
    return fused, fused(*case.inputs)


def guarded(result, system, fn, limit):
    """Run one system of one row; on any failure print the traceback and mark the cell, then go on."""
    try:
        with time_limit(limit):
            result.update(fn())
        return True
    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest of the table
        print(f"--- {result['name']}: {system} failed", flush=True)
        traceback.print_exc()
        result["errors"][system] = " ".join([f"{type(e).__name__}:", *str(e).split()])[:300]
        return False


def run_row(row, device, quick, fuser, fuser_missing, limit):
    """Eager, then Inductor, then fuser cold, then fuser warm; each guarded, each freed before the next."""
    result = {"name": row.name, "shape": None, "errors": {}}
    with torch.no_grad():
        if not guarded(result, "build", lambda: {"_case": row.build(quick, device)}, limit):
            return result
        case = result.pop("_case")
        result["shape"] = case.shape
        if row.dynamic:
            result["warm_shape"] = _grown_shape(case.inputs)
        if not guarded(result, "eager", lambda: run_eager(case, device), limit):
            return result
        ref = result.pop("_ref")
        result["bytes"] = io_bytes(case, ref)
        torch._dynamo.reset()
        inductor = run_inductor_dynamic if row.dynamic else run_inductor
        guarded(result, "inductor", lambda: inductor(case, device), limit)
        torch._dynamo.reset()
        if fuser is None:
            print(f"--- {row.name}: fuser skipped: {fuser_missing}", flush=True)
            result["errors"]["fuser"] = fuser_missing
            return result
        if row.dynamic:  # fuser static, then fuser dynamic; no warm (disk-cache) run
            result["dynamic"] = True
            guarded(result, "fuser static", lambda: run_fuser_static(fuser, case, device), limit)
            torch._dynamo.reset()
            guarded(result, "fuser", lambda: run_fuser_dynamic(fuser, case, ref, device), limit)
            _dyn_over_static(result)
            return result
        if guarded(result, "fuser", lambda: run_fuser(fuser, case, ref, device), limit):
            torch._dynamo.reset()
            guarded(result, "fuser warm", lambda: run_fuser_warm(fuser, case, device), limit)
    return result


def io_bytes(case, out):
    """Bytes a perfect kernel moves: every input, parameter and buffer read once, the output written once."""
    tensors = [*case.inputs, *case.module.parameters(), *case.module.buffers(), out]
    return sum(t.nbytes for t in tensors)


class _WarmUp(nn.Module):
    def forward(self, x):
        return x * 2 + 1


def warm_up(device, fuser, limit):
    """Compile a tiny unrelated graph with each compiler first, so per-row cold times count
    the row's own graph, not once-per-process costs (worker pools, imports, driver setup)."""
    x, module = _randn(1000, device), _WarmUp()
    compilers = {"inductor": lambda: torch.compile(module)(x)}
    if fuser is not None:
        compilers["fuser"] = lambda: fuser.fuse(module, example_inputs=(x,))(x)
    result = {"name": "warm-up", "errors": {}}
    with torch.no_grad():
        for name, fn in compilers.items():
            guarded(result, name, lambda: {name: first_call(fn, device)[0]}, limit)
            torch._dynamo.reset()
    del result["name"]
    return result


# ---------------------------------------------------------------- output

COLUMNS = ["row", "shape", "eager ms", "inductor ms", "fuser ms", "fuser GB/s", "% copy BW",
           "fuser/inductor", "compile s inductor cold", "fuser cold", "fuser warm", "correct"]


def _cells(r, copy_bw):
    def num(key, fmt):
        if key in r and r[key] is not None:
            return format(r[key], fmt)
        return "ERR" if _failed(r, key) else "—"

    gbps = r["bytes"] / r["fuser_ms"] / 1e6 if r.get("fuser_ms") else None
    ratio = r["inductor_ms"] / r["fuser_ms"] if r.get("fuser_ms") and r.get("inductor_ms") else None
    correct = r.get("correct") or ("ERR" if _failed(r, "correct") else "—")
    return [
        r["name"], r["shape"] or "—", num("eager_ms", ".3f"), num("inductor_ms", ".3f"), num("fuser_ms", ".3f"),
        "—" if gbps is None else f"{gbps:.0f}",
        "—" if gbps is None or copy_bw is None else f"{100 * gbps / copy_bw:.0f}%",
        "—" if ratio is None else f"{ratio:.2f}×",
        num("inductor_cold_s", ".1f"), num("fuser_cold_s", ".1f"), num("fuser_warm_s", ".2f"), correct,
    ]


def _failed(r, key):
    """Which system's error explains an empty cell."""
    system = {"eager_ms": "eager", "inductor_ms": "inductor", "inductor_cold_s": "inductor",
              "fuser_ms": "fuser", "fuser_cold_s": "fuser", "correct": "fuser", "fuser_warm_s": "fuser warm"}[key]
    return any(k in r["errors"] for k in ("build", "eager", system))


def markdown(meta, rows):
    copy_bw = meta["copy_gbps"]
    lines = [
        f"# fuser bench: {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}; "
        f"copy bandwidth {'—' if copy_bw is None else f'{copy_bw:.0f} GB/s'} (2 GiB bf16 `copy_`, read + write); "
        f"{'quick shapes' if meta['quick'] else 'full shapes'}.",
        "Times are do_bench medians. GB/s counts each input (parameters too) read once and the output written once. "
        "fuser/inductor = inductor ms / fuser ms (>1: fuser faster). Compile s = wall time of the first call, "
        "synchronised (fuse() included for fuser), after a warm-up compile of an unrelated graph; "
        "fuser warm = the same after `torch._dynamo.reset()` with its disk cache populated. "
        "`[dynamic]` rows: inductor and fuser compiled for symbolic sizes (see Dynamic sizes below).",
        "",
    ]
    errors = [f"- {r['name']}: {system}: {msg}" for r in rows for system, msg in r["errors"].items()]
    mismatches = [f"- {r['name']}: {r['correct']}; vs eager bf16: {r['mismatch']}" for r in rows if r.get("mismatch")]
    if errors or mismatches:
        lines += ["Errors and mismatches:", *errors, *mismatches, ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r, copy_bw)) + " |" for r in rows]
    dynamic = [r for r in rows if r.get("dynamic") or r["name"].endswith(" [dynamic]")]
    if dynamic:
        lines += ["", *_dynamic_section(dynamic)]
    return "\n".join(lines) + "\n"


DYNAMIC_COLUMNS = ["workload", "shape", "warm-up shape", "fuser static ms", "fuser dynamic ms", "dyn/static",
                   "static kernels ms", "dynamic kernels ms", "kernels dyn/static", "within 10% (kernels)",
                   "inductor dynamic ms", "fuser/inductor dynamic", "symbolic", "graphs captured"]


def _dynamic_section(rows):
    def num(r, key, system, fmt=".3f"):
        if r.get(key) is not None:
            return format(r[key], fmt)
        return "ERR" if any(k in r["errors"] for k in ("build", "eager", system)) else "—"

    lines = [
        "## Dynamic sizes",
        "",
        "Each `[dynamic]` row compiles its workload for symbolic sizes: fuser as `fuser.fuse(m, dynamic=True)`, "
        "Inductor as `torch.compile(m, dynamic=True)`. Both are called first at the warm-up shape (the leading "
        "dimension one longer), then timed at the row's shape; its table row above holds those dynamic numbers "
        "(compile s: fuse() or compile plus the warm-up-shape call). fuser static = `fuser.fuse(m)` on the same "
        "inputs, timed just before. dyn/static = fuser dynamic ms / fuser static ms (the module, host time "
        "included); kernels ms = GPU time of fuser's kernels alone per call (torch.profiler), and the target, "
        "a kernel for symbolic sizes within 10% of the static one, is on those. symbolic = every fused region's byte count is a formula in size symbols (its kernel "
        "takes the sizes as arguments); graphs captured = graphs fuser captured over both calls (1: the "
        "warm-up-shape graph served the row's shape too).",
        "",
        "| " + " | ".join(DYNAMIC_COLUMNS) + " |",
        "|" + "---|" * len(DYNAMIC_COLUMNS),
    ]
    for r in rows:
        ratio, inductor = r.get("dyn_over_static"), r.get("inductor_ms")
        speed = inductor / r["fuser_ms"] if inductor and r.get("fuser_ms") else None
        cells = [
            r["name"].removesuffix(" [dynamic]"), r["shape"] or "—", r.get("warm_shape") or "—",
            num(r, "fuser_static_ms", "fuser static"), num(r, "fuser_ms", "fuser"),
            "—" if ratio is None else f"{ratio:.3f}",
            num(r, "fuser_static_kernel_ms", "fuser static"), num(r, "fuser_kernel_ms", "fuser"),
            "—" if r.get("kernel_dyn_over_static") is None else f"{r['kernel_dyn_over_static']:.3f}",
            r.get("within_10pct") or "—",
            num(r, "inductor_ms", "inductor"), "—" if speed is None else f"{speed:.2f}×",
            r.get("symbolic") or ("ERR" if _failed(r, "fuser_ms") else "—"), str(r.get("captures", "—")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write(meta, rows, out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{meta['gpu_slug']}-{meta['date']}{'-quick' if meta['quick'] else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, ensure_ascii=False))
    stem.with_suffix(".md").write_text(markdown(meta, rows))
    return stem


def _meta(device, quick):
    import transformers
    import triton
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") if device.type == "cuda" else "cpu"
    return {"gpu": gpu, "gpu_slug": slug, "date": datetime.date.today().isoformat(), "quick": quick,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cache_dir": _CACHE_ROOT, "copy_gbps": None, "warm_up": {}}


# ---------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", help="comma-separated name substrings (case-insensitive); default: all rows")
    p.add_argument("--quick", action="store_true", help="small shapes, for a smoke test (on CPU: no timings)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="directory for the .json and .md")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=300, help="start no new row after this many seconds")
    p.add_argument("--limit", type=int, default=150, help="seconds allowed to each system of each row")
    p.add_argument("--no-dynamic", action="store_true", help="skip the [dynamic] rows (symbolic-size compiles)")
    args = p.parse_args(argv)

    start = time.perf_counter()
    device = torch.device(args.device)
    wanted = [w.strip().lower() for w in args.rows.split(",")] if args.rows else [""]
    rows = [row for row in ROWS if any(w in row.name.lower() for w in wanted) and not (args.no_dynamic and row.dynamic)]
    if not rows:
        p.error(f"no row matches {args.rows!r}; rows: {', '.join(r.name for r in ROWS)}")
    torch.manual_seed(0)

    meta = _meta(device, args.quick)
    try:
        meta["copy_gbps"] = copy_gbps(device)
    except Exception:  # noqa: BLE001 - the rows are still worth timing without the % column
        traceback.print_exc()
    fuser, fuser_missing = _import_fuser()
    meta["warm_up"] = warm_up(device, fuser, args.limit)

    results = []
    for row in rows:
        if time.perf_counter() - start > args.budget:
            results.append({"name": row.name, "shape": None, "errors": {"build": f"skipped: past the {args.budget:.0f} s budget"}})
            continue
        print(f"=== {row.name} ({time.perf_counter() - start:.0f} s in)", flush=True)
        results.append(run_row(row, device, args.quick, fuser, fuser_missing, args.limit))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(meta, results, args.out)  # after every row, so a killed run still leaves its rows

    meta["total_s"] = time.perf_counter() - start
    stem = write(meta, results, args.out)
    print(f"\nwrote {stem}.json and .md in {meta['total_s']:.0f} s\n")
    print(markdown(meta, results), flush=True)
    ok = all(not r["errors"] and r.get("correct", "").startswith("pass") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
