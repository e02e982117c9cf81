"""Hand-written attention through fuser against SDPA, FlexAttention, Inductor and eager, forward and
forward+backward, on the GPU (bf16).

Each row is attention as research code writes it (matmul, scale, score modification, mask, softmax
in fp32, matmul).  Columns:
- eager: that code; inductor: torch.compile of it (default mode);
- sdpa: the same attention through F.scaled_dot_product_attention, with the mask as a tensor where
  is_causal cannot say it ("—" where SDPA cannot express the row: soft-capping);
- flex: compiled flex_attention with the equivalent score_mod and block_mask (the block mask made
  once, outside the timing, as users do);
- fuser: torch.compile(backend="fuser") of the hand-written code, with the lowering it chose (SDPA
  or our Triton kernel; in training, attention claimed before autograd or left to its ops);
- fuser-triton: the same with attention="triton" (our own kernel, forward and backward).
ms are do_bench medians; fwd+bwd times one forward and one backward from a fixed output gradient;
peak MiB is the allocation peak of one fwd+bwd over what was allocated before it.

    python bench/attention_bench.py [--rows 0,1,2] [--out DIR] [--quick]
    python bench/attention_bench.py --smoke --out /tmp/att   # CPU, tiny shapes: checks the script runs
"""
import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fuser.backend import all_reports  # noqa: E402  (importing fuser registers the backend)

BF16 = torch.bfloat16
SOFTCAP = 50.0
WINDOW = 1024

# name, B, Hq, Hkv, S, D, variant[, Dv]; variant: none | causal-graph | causal-buffer | softcap | alibi | window |
# causal-padding (batch b keeps its first S * (4 - b) / 4 keys: a padded batch's mask, no structure); Dv: V's head
# dim where it differs from Q's and K's (DeepSeek's multi-head latent attention: 192 and 128)
ROWS = [
    ("no mask", 4, 16, 16, 4096, 128, "none"),
    ("causal, mask in a buffer", 4, 16, 16, 4096, 128, "causal-buffer"),
    ("causal, built in the graph", 4, 16, 16, 4096, 128, "causal-graph"),
    ("tanh soft-cap + causal", 4, 16, 16, 4096, 128, "softcap"),
    ("ALiBi + causal", 4, 16, 16, 4096, 128, "alibi"),
    (f"sliding window {WINDOW} (mask in a buffer)", 4, 16, 16, 4096, 128, "window"),
    ("D64 S1024 causal", 16, 16, 16, 1024, 64, "causal-graph"),
    ("D64 S1024 causal, mask in a buffer", 16, 16, 16, 1024, 64, "causal-buffer"),
    ("GQA 32/8 causal", 4, 32, 8, 2048, 128, "causal-graph"),
    ("causal + key padding (in a buffer)", 4, 16, 16, 4096, 128, "causal-padding"),
    ("MLA causal (q/k 192, v 128)", 4, 16, 16, 4096, 192, "causal-graph", 128),
    ("MLA soft-cap + causal (q/k 192, v 128)", 4, 16, 16, 4096, 192, "softcap", 128),
]


def _slopes(h, device):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=device)


class HandWritten(torch.nn.Module):
    """The attention as research code writes it.  The mask tensors are buffers (nanoGPT's
    `register_buffer("bias", torch.tril(...))`): data to fuser, the same tensors every call."""

    def __init__(self, variant, groups, s, device):
        super().__init__()
        self.variant, self.groups, self.s = variant, groups, s
        causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        self.register_buffer("causal_mask", causal)
        self.register_buffer("window_mask", causal | torch.ones(s, s, dtype=torch.bool, device=device).tril(-WINDOW))
        self.register_buffer("padding_mask", padding_mask(4, s, device))

    def forward(self, q, k, v):
        variant, groups, s = self.variant, self.groups, self.s
        if groups > 1:  # repeat_kv, as HF writes it
            b, h, n, d = k.shape
            k = k[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
            v = v[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
        sc = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if variant == "softcap":
            sc = SOFTCAP * torch.tanh(sc / SOFTCAP)
        if variant == "alibi":
            pos = torch.arange(s, device=q.device)
            sc = sc + _slopes(q.shape[1], q.device)[:, None, None] * (pos[None, :] - pos[:, None])
        if variant in ("causal-graph", "softcap", "alibi"):
            sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        elif variant == "causal-buffer":
            sc = sc.masked_fill(self.causal_mask, float("-inf"))
        elif variant == "window":
            sc = sc.masked_fill(self.window_mask, float("-inf"))
        elif variant == "causal-padding":
            sc = sc.masked_fill(self.padding_mask[:sc.shape[0]], float("-inf"))
        return torch.matmul(torch.softmax(sc.float(), dim=-1).to(q.dtype), v)


def _lengths(b, s, device):
    return torch.tensor([max(1, s * (4 - i % 4) // 4) for i in range(b)], device=device)


def padding_mask(b, s, device):
    """[b, 1, s, s], True where masked: keys past the diagonal or past the batch's length."""
    key = torch.arange(s, device=device)
    causal = key[None, :] > key[:, None]
    return (causal[None] | (key[None, None, :] >= _lengths(b, s, device)[:, None, None]))[:, None]


def sdpa_version(variant, hq, s, device):
    """SDPA computing the same, or None where it cannot (soft-capping)."""
    if variant == "softcap":
        return None
    mask = None
    if variant == "alibi":
        pos = torch.arange(s, device=device)
        bias = _slopes(hq, device)[:, None, None] * (pos[None, :] - pos[:, None])
        mask = bias.masked_fill(torch.ones(s, s, dtype=torch.bool, device=device).triu(1), float("-inf")).to(BF16)
    elif variant == "window":
        mask = ~(torch.ones(s, s, dtype=torch.bool, device=device).triu(1) | torch.ones(s, s, dtype=torch.bool, device=device).tril(-WINDOW))
    causal = variant in ("causal-graph", "causal-buffer")

    def attn(q, k, v):
        if variant == "causal-padding":  # the memory-efficient kernel, K/V repeated for GQA (it has none)
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~padding_mask(q.shape[0], s, q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return attn


def flex_version(variant, b, hq, s, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    slopes = _slopes(hq, device)
    causal = lambda b_, h_, q_, k_: q_ >= k_  # noqa: E731
    lengths = _lengths(b, s, device)
    mask_mod = {"causal-graph": causal, "causal-buffer": causal, "softcap": causal, "alibi": causal,
                "window": lambda b_, h_, q_, k_: (q_ >= k_) & (q_ - k_ < WINDOW),
                "causal-padding": lambda b_, h_, q_, k_: (q_ >= k_) & (k_ < lengths[b_])}.get(variant)
    score_mod = {"softcap": lambda sc, b_, h_, q_, k_: SOFTCAP * torch.tanh(sc / SOFTCAP),
                 "alibi": lambda sc, b_, h_, q_, k_: sc + slopes[h_] * (k_ - q_)}.get(variant)
    block = create_block_mask(mask_mod, b if variant == "causal-padding" else None, None, s, s, device=device) if mask_mod else None

    def attn(q, k, v):
        return flex(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=q.shape[1] != k.shape[1])
    return attn


def _fwd_bwd(fn, q, k, v, g):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(g)
    return step


def _peak(step):
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn):
    if not torch.cuda.is_available():  # --smoke on CPU: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def _lowering(seen):
    """What fuser did with the attention in the graphs compiled since `seen`."""
    reports = all_reports()[seen:]
    att = [r for rep in reports for r in rep.regions if r.kind == "attention"]
    notes = [n for rep in reports for n in rep.notes if n.startswith("attention ")]
    if notes:
        return "; ".join(dict.fromkeys(n.split(":")[0] for n in notes))
    return ", ".join(dict.fromkeys("sdpa" if r.kernel == "sdpa" else "triton" for r in att)) or "not recognised"


def run_row(name, b, hq, hkv, s, d, variant, dv=None, quick=False, dev="cuda"):
    torch.manual_seed(0)
    dv = dv or d
    q = torch.randn(b, hq, s, d, device=dev, dtype=BF16)
    k = torch.randn(b, hkv, s, d, device=dev, dtype=BF16)
    v = torch.randn(b, hkv, s, dv, device=dev, dtype=BF16)
    g = torch.randn(b, hq, s, dv, device=dev, dtype=BF16)
    eager = HandWritten(variant, hq // hkv, s, dev)
    row = {"row": name, "shape": f"B{b} H{hq}/{hkv} S{s} D{d}" + (f"/{dv}" if dv != d else ""), "variant": variant}
    systems = {"eager": lambda: eager, "inductor": lambda: torch.compile(eager),
               "sdpa": lambda: sdpa_version(variant, hq, s, dev), "flex": lambda: flex_version(variant, b, hq, s, dev),
               "fuser": lambda: torch.compile(eager, backend="fuser"),
               "fuser-triton": lambda: torch.compile(eager, backend="fuser", options={"attention": "triton"})}
    if quick:
        systems.pop("eager")
    with torch.no_grad():
        ref = None if quick else eager(q, k, v).float()
    for label, make in systems.items():
        for mode in ("fwd", "fwd+bwd"):
            torch._dynamo.reset()
            seen = len(all_reports())
            try:
                fn = make()
                if fn is None:
                    continue
                t0 = time.perf_counter()
                if mode == "fwd":
                    with torch.no_grad():
                        out = fn(q, k, v)
                        _sync()
                        row[f"{label}_compile_s"] = time.perf_counter() - t0
                        if ref is not None:
                            row[f"{label}_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                        del out
                        row[f"{label}_fwd_ms"] = _ms(lambda: fn(q, k, v))
                else:
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    step = _fwd_bwd(fn, qq, kk, vv, g)
                    step()
                    row[f"{label}_fwd+bwd_ms"] = _ms(step)
                    row[f"{label}_peak_mib"] = _peak(step)
                    del qq, kk, vv, step
                if label.startswith("fuser"):
                    row[f"{label}_{mode}_lowering"] = _lowering(seen)
            except Exception as e:  # noqa: BLE001 - one failing cell must not lose the others
                row[f"{label}_{mode}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return row


def table(rows, gpu):
    systems = ["eager", "inductor", "sdpa", "flex", "fuser", "fuser-triton"]
    lines = [f"# attention, hand-written: {gpu}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; bf16; do_bench medians (ms); fwd / fwd+bwd; `—`: not expressible or "
             "not run; vs best = best library (SDPA or FlexAttention) ms / fuser ms (>1: fuser faster).", "",
             "| row | shape | " + " | ".join(systems) + " | fuser vs best lib | fuser vs Inductor | peak MiB fwd+bwd fuser / SDPA / flex | fuser's lowering (fwd; fwd+bwd) |",
             "|" + "---|" * (len(systems) + 6)]
    for r in rows:
        cells = []
        for sname in systems:
            f, fb = r.get(f"{sname}_fwd_ms"), r.get(f"{sname}_fwd+bwd_ms")
            err = r.get(f"{sname}_fwd_error") or r.get(f"{sname}_fwd+bwd_error")
            cell = f"{f:.3f}" if f else "—"
            cell += f" / {fb:.3f}" if fb else " / —"
            cells.append(cell + (" (error)" if err else ""))

        def ratio(key, other):
            ours, theirs = r.get(f"fuser_{key}_ms"), [r.get(f"{o}_{key}_ms") for o in other]
            theirs = [t for t in theirs if t]
            return f"{min(theirs) / ours:.2f}" if ours and theirs else "—"
        best = f"{ratio('fwd', ['sdpa', 'flex'])} / {ratio('fwd+bwd', ['sdpa', 'flex'])}"
        ind = f"{ratio('fwd', ['inductor'])} / {ratio('fwd+bwd', ['inductor'])}"
        peak = " / ".join(f"{r[k]:.0f}" if k in r else "—" for k in ("fuser_peak_mib", "sdpa_peak_mib", "flex_peak_mib"))
        low = f"{r.get('fuser_fwd_lowering', '?')}; {r.get('fuser_fwd+bwd_lowering', '?')}"
        lines.append(f"| {r['row']} | {r['shape']} | " + " | ".join(cells) + f" | {best} | {ind} | {peak} | {low} |")
    errors = [f"- {r['row']}: {k}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")]
    errs = [f"- {r['row']}: fuser err {r['fuser_err']:.1e}, fuser-triton err {r.get('fuser-triton_err', float('nan')):.1e} "
            "(||a-b||/||b|| vs eager, fwd)" for r in rows if "fuser_err" in r]
    return "\n".join(lines + ["", *errs, "", *(["errors:", *errors] if errors else [])]) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--rows", help="comma-separated row indices (default: all)")
    ap.add_argument("--quick", action="store_true", help="no eager column, no error check")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (S=64), one timed call: checks the script")
    args = ap.parse_args()
    gpu = "cpu-smoke" if args.smoke else torch.cuda.get_device_name()
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    if args.smoke:
        global BF16, WINDOW
        BF16, WINDOW = torch.float32, 16
        picked = [(n, 1, h // 8, hkv // 8, 64, 24 if dv else 16, var, *([16] if dv else []))
                  for n, _, h, hkv, _, _, var, *dv in picked]
    stem = Path(args.out) / f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{datetime.date.today()}-attention"
    stem.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in picked:
        print("===", spec[0], flush=True)
        rows.append(run_row(*spec, quick=args.quick, dev="cpu" if args.smoke else "cuda"))
        print(rows[-1], flush=True)
        stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        stem.with_suffix(".md").write_text(table(rows, gpu))
    print(table(rows, gpu))


if __name__ == "__main__":
    main()
