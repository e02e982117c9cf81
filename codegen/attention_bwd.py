"""FlashAttention-2 backward kernels, generated around the same score modification as the forward.

The scores are recomputed tile by tile from Q, K and the forward's log-sum-exp, so the M x N matrix
never reaches HBM in the backward either.  Two kernels, as FlashAttention-2: `attention_bwd_dkdv`
walks the query blocks for one key block (dK, dV), `attention_bwd_dq` walks the key blocks for one
query block (dQ); each recomputes P.  The score chain's gradient is `ScoreMod.grad`: lines that set
`g`, d(final scores)/d(scaled scores), from the forward's variables (the lines are recomputed
first).  With GQA, dK and dV come out per query head in fp32 and are summed over the group after.
"""
from __future__ import annotations

import torch
import triton

from fuser.dtypes import interpreting, math_import
from fuser.plan import attention_plan

from .attention import _LOG2E, _TL_DTYPE, ScoreMod, _extra_lines, _indent

__all__ = ["attention_bwd_source", "prepare_bwd"]


class NoGradient(ValueError):
    """The score modification has no gradient lines (a chain whose derivative was not derived)."""


def attention_bwd_source(mod: ScoreMod, head_dim: int, dtype) -> str:
    """Triton source of `attention_bwd_dkdv` and `attention_bwd_dq` for one score mod, head dim, dtype."""
    if mod.lines and mod.grad is None:
        raise NoGradient("attention backward: the score modification has no gradient")
    block_d = max(16, triton.next_power_of_2(head_dim))
    upcast = ".to(tl.float32)" if interpreting() and dtype == torch.bfloat16 else ""
    low = "tl.float32" if upcast else _TL_DTYPE[dtype]
    off = mod.causal_offset
    qpos = f"q_idx + {off}" if off else "q_idx"
    keep = ["q_ok", "k_ok"]
    if mod.causal:
        keep.append(f"(k_idx <= {qpos})")
    if mod.window is not None:
        keep.append(f"({qpos} - k_idx < {mod.window})")
    scores = ["s = tl.dot(q, kT, input_precision=DOT_PRECISION) * scale"]
    if mod.lines:
        scores += _extra_lines(mod, False) + ["# score mod"] + [x.strip() for x in mod.lines]
        scores += ["# its gradient: g = d(scores after the mod) / d(scores before)"] + [x.strip() for x in mod.grad]
    else:
        scores.append("g = 1.0")
    scores += [f's = tl.where({" & ".join(keep)}, s, float("-inf"))',
               "p = tl.exp2((s - lse[:, None]) * LOG2E)  # the forward's probabilities, recomputed",
               "dp = tl.dot(do, vT, input_precision=DOT_PRECISION)",
               "ds = tl.where(p == 0.0, 0.0, p * (dp - delta[:, None]) * g)  # masked scores pass no gradient"]

    # query blocks that see key block start_n, and key blocks that query block start_m sees
    m_range = ["m_lo = 0", "m_hi = M"]
    n_range = ["n_lo = 0", "n_hi = N"]
    if mod.causal:  # key k is seen by the queries q + off >= k
        m_range[0] = f"m_lo = tl.maximum(start_n - {off}, 0) // BLOCK_M * BLOCK_M"
        n_range[1] = f"n_hi = tl.minimum(N, start_m * BLOCK_M + {off} + BLOCK_M)"
    if mod.window is not None:  # and by the queries with q + off - k < window
        m_range[1] = f"m_hi = tl.minimum(M, start_n + BLOCK_N - 1 - {off} + {mod.window})"
        n_range[0] = f"n_lo = tl.maximum(0, start_m * BLOCK_M + {off} - {mod.window - 1}) // BLOCK_N * BLOCK_N"

    extra_params = "".join(f"extra{i}_ptr, extra{i}_s0, extra{i}_s1, extra{i}_s2, extra{i}_s3,\n    "
                           for i in range(mod.n_extra))
    extra_bases = [f"extra{i}_base = extra{i}_ptr + b64 * extra{i}_s0 + h64 * extra{i}_s1" for i in range(mod.n_extra)]
    extra_bases += [mod.form(i).setup(i) for i in range(mod.n_extra) if hasattr(mod.form(i), "setup")]
    params = f"""Q, K, V, DO, LSE, DELTA, DQ, DK, DV,
    {extra_params}stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, M, N, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,"""
    head = f"""bh = tl.program_id(1)
b_idx = bh // H
h_idx = bh % H
b64 = b_idx.to(tl.int64)
h64 = h_idx.to(tl.int64)
kv64 = (h_idx // GROUP).to(tl.int64)
q_base = Q + b64 * stride_qb + h64 * stride_qh
do_base = DO + b64 * stride_ob + h64 * stride_oh  # dO has O's layout (contiguous, made so by the caller)
k_base = K + b64 * stride_kb + kv64 * stride_kh
v_base = V + b64 * stride_vb + kv64 * stride_vh
row = bh.to(tl.int64) * M  # LSE, DELTA: [B*Hq, M]
{chr(10).join(extra_bases)}
offs_d = tl.arange(0, BLOCK_D)
d_ok = offs_d < HEAD_DIM""".split("\n")

    def q_tiles(rows: str) -> list[str]:
        return [f"offs_m = {rows}", "q_idx = offs_m[:, None]", "q_ok = q_idx < M",
                f"q = tl.load(q_base + q_idx * stride_qm + offs_d[None, :] * stride_qd, mask=q_ok & d_ok[None, :], other=0.0){upcast}",
                f"do = tl.load(do_base + q_idx * stride_om + offs_d[None, :] * stride_od, mask=q_ok & d_ok[None, :], other=0.0){upcast}",
                "lse = tl.load(LSE + row + offs_m, mask=offs_m < M, other=float('inf'))",
                "delta = tl.load(DELTA + row + offs_m, mask=offs_m < M, other=0.0)"]

    def k_tiles(cols: str) -> list[str]:
        return [f"kn = {cols}", "k_idx = kn[None, :]", "k_ok = k_idx < N",
                f"kT = tl.load(k_base + offs_d[:, None] * stride_kd + k_idx * stride_kn, mask=d_ok[:, None] & k_ok, other=0.0){upcast}",
                f"vT = tl.load(v_base + offs_d[:, None] * stride_vd + k_idx * stride_vn, mask=d_ok[:, None] & k_ok, other=0.0){upcast}"]

    dkdv = head + ["start_n = tl.program_id(0) * BLOCK_N"] + k_tiles("start_n + tl.arange(0, BLOCK_N)") + [
        "dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)", "dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)", *m_range,
        "for start_m in range(m_lo, m_hi, BLOCK_M):"] + ["    " + x for x in [
            *q_tiles("start_m + tl.arange(0, BLOCK_M)"), *scores,
            f"dv += tl.dot(tl.trans(p.to({low})), do, input_precision=DOT_PRECISION)",
            f"dk += tl.dot(tl.trans(ds.to({low})), q, input_precision=DOT_PRECISION)"]] + [
        "out = (bh.to(tl.int64) * N + kn[:, None]) * BLOCK_D + offs_d[None, :]  # fp32 [B*Hq, N, BLOCK_D]",
        "tl.store(DK + out, dk * scale, mask=kn[:, None] < N)",
        "tl.store(DV + out, dv, mask=kn[:, None] < N)"]
    dq = head + ["start_m = tl.program_id(0)"] + q_tiles("start_m * BLOCK_M + tl.arange(0, BLOCK_M)") + [
        "dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)", *n_range,
        "for start_n in range(n_lo, n_hi, BLOCK_N):"] + ["    " + x for x in [
            *k_tiles("start_n + tl.arange(0, BLOCK_N)"), *scores,
            f"dq += tl.dot(ds.to({low}), tl.trans(kT), input_precision=DOT_PRECISION)"]] + [
        "tl.store(DQ + (bh.to(tl.int64) * M + offs_m[:, None]) * BLOCK_D + offs_d[None, :], dq * scale, mask=q_ok)"]
    return f'''\
# Generated by fuser.codegen.attention_bwd: FlashAttention-2 backward, {len(mod.lines)} score-mod line(s).
# head_dim {head_dim} (padded to {block_d}), {dtype}, fp32 accumulation; P recomputed from Q, K and LSE.
# HBM bytes: dK/dV read Q, dO (and LSE, delta) once per key block, K, V once, write dK, dV (fp32);
# dQ reads K, V once per query block, Q, dO once, writes dQ (fp32).  No M x N matrix is stored.
import triton
import triton.language as tl
{math_import("".join(mod.helpers) + "".join(mod.lines) + "".join(mod.grad or ()))}
HEAD_DIM = tl.constexpr({head_dim})
BLOCK_D = tl.constexpr({block_d})
LOG2E = tl.constexpr({_LOG2E!r})
{"".join(mod.helpers)}

@triton.jit
def attention_bwd_dkdv(
    {params}
):
{_indent(dkdv, 4)}


@triton.jit
def attention_bwd_dq(
    {params}
):
{_indent(dq, 4)}
'''


def prepare_bwd(q, k, v, out, dout, lse, extras=(), *, mod: ScoreMod, scale: float = 1.0):
    """Host side of the two launches: (dq, dk, dv buffers, delta, [(name, grid)], args, meta).  dout is
    made contiguous like out; delta = rowsum(dO * O) in fp32 (FlashAttention-2's D)."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    block_m, block_n, num_warps, num_stages = attention_plan(D, q.dtype, q.is_cuda)
    block_d = max(16, triton.next_power_of_2(D))
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.zeros((B, Hq, M, block_d), dtype=torch.float32, device=q.device)
    dk = torch.zeros((B, Hq, N, block_d), dtype=torch.float32, device=q.device)
    dv = torch.zeros((B, Hq, N, block_d), dtype=torch.float32, device=q.device)
    extra_args = []
    for e in extras:
        e = e.expand(B, Hq, M, N)
        extra_args += [e, *e.stride()]
    ieee = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    args = (q, k, v, dout, lse, delta, dq, dk, dv, *extra_args, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
            Hq, Hq // k.shape[1], M, N, float(scale))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if ieee else "tf32",
                num_warps=num_warps, num_stages=num_stages)
    launches = [("attention_bwd_dkdv", (triton.cdiv(N, block_n), B * Hq)), ("attention_bwd_dq", (triton.cdiv(M, block_m), B * Hq))]
    return dq, dk, dv, launches, args, meta
