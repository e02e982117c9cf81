"""FlashAttention-2 backward kernels, generated around the same score modification as the forward.

The scores are recomputed tile by tile from Q, K and the forward's log-sum-exp, so the M x N matrix
never reaches HBM in the backward either.  Two kernels, as FlashAttention-2: `attention_bwd_dkdv`
walks the query blocks for one key block (dK, dV), `attention_bwd_dq` walks the key blocks for one
query block (dQ); each recomputes P.  The score chain's gradient is `ScoreMod.grad`: lines that set
`g`, d(final scores)/d(scaled scores), from the forward's variables (the lines are recomputed
first).  With GQA, a dK/dV program walks the query heads of its K/V head, summing on chip.  The gradients
are stored in the inputs' dtype, rounded once.  delta = rowsum(dO * O) comes from a kernel of its own.
Every tile of dQ, dK and dV is written by one program, each element once, except where the query heads of
a K/V head are shared over several programs (few programs otherwise: `_split`) and for a learned bias's
gradient (summed where it broadcasts): those are added atomically into fp32 buffers.
"""
from __future__ import annotations

import functools

import torch

from fuser.dtypes import interpreting, math_import
from fuser.plan import attention_bwd_plan, cdiv, next_pow2

from .attention import (WIDE_ARANGES, _LOG2E, _TL_DTYPE, ScoreMod, _extra_args, _extra_lines, _indent, check,
                        over_tiles, probability_dropout, wide)

__all__ = ["attention_bwd_source", "prepare_bwd"]


class NoGradient(ValueError):
    """The score modification has no gradient lines (a chain whose derivative was not derived)."""


def attention_bwd_source(mod: ScoreMod, head_dim: int, dtype, dropout: float = 0.0, head_dim_v: int | None = None) -> str:
    """Triton source of `attention_bwd_dkdv` and `attention_bwd_dq` for one score mod, head dims, dtype;
    `dropout` as the forward's (its mask drawn again from the same seed and counters); `head_dim_v`: V's
    (and dO's) head dim where it differs from Q's and K's."""
    if mod.lines and mod.grad is None or any(lines is None for _, lines in mod.bias_grads):
        raise NoGradient("attention backward: the score modification has no gradient")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    check(dtype, head_dim, head_dim_v)
    block_d, block_dv = max(16, next_pow2(head_dim)), max(16, next_pow2(head_dim_v))
    upcast = ".to(tl.float32)" if interpreting() and dtype == torch.bfloat16 else ""
    low = "tl.float32" if upcast else _TL_DTYPE[dtype]
    off = mod.causal_offset
    qpos = f"q_idx + {off}" if off else "q_idx"
    keep = ["q_ok", "k_ok"]
    if mod.causal:
        keep.append(f"(k_idx <= {qpos})")
    if mod.window is not None:
        keep.append(f"({qpos} - k_idx < {mod.window})")
    d_pad, dv_pad = block_d != head_dim, block_dv != head_dim_v

    def scores(full: bool) -> list[str]:
        """P and dS of one tile.  A full tile (inside M, N and the structure) has no mask at all."""
        lines = ["s = tl.dot(q, kT, input_precision=DOT_PRECISION) * scale"]
        if mod.lines:
            lines += _extra_lines(mod, full) + ["# score mod"] + [x.strip() for x in mod.lines]
            lines += ["# its gradient: g = d(scores after the mod) / d(scores before)"] + [x.strip() for x in mod.grad]
            for i, grad in mod.bias_grads:  # a learned bias's derivative, d(final s)/d(extra i)
                lines += [f"# d(scores after the mod) / d(extra{i})"] + [x.strip() for x in grad]
        else:
            lines.append("g = 1.0")
        if not full:
            lines.append(f's = tl.where({" & ".join(keep)}, s, float("-inf"))')
        lines += ["p = tl.exp2(((s - m_row[:, None]) - log_l[:, None]) * LOG2E)  # the forward's probabilities, recomputed",
                  "dp = tl.dot(do, vT, input_precision=DOT_PRECISION)"]
        if dropout:  # O = dropout(P) @ V: dV reads the dropped P, and dP passes back through the same mask;
            # delta = rowsum(dO * O) is still rowsum(P * dP) with the mask applied (FlashAttention-2)
            lines += [f"p_kept = {probability_dropout('p', dropout)}", f"dp = {probability_dropout('dp', dropout)}"]
        lines.append("ds = p * (dp - delta[:, None]) * g" if full else
                     "ds = tl.where(p == 0.0, 0.0, p * (dp - delta[:, None]) * g)  # masked scores pass no gradient")
        return lines

    def q_tiles(rows: str, full: bool) -> list[str]:
        rm = None if full else "q_ok"
        def masks(pad: bool, ok: str) -> str:
            m2 = " & ".join(x for x in (rm, f"{ok}[None, :]" if pad else None) if x)
            return f", mask={m2}, other=0.0" if m2 else ""
        m1 = "" if full else ", mask=offs_m < M, other=float('inf')"  # rows past M: p = 0
        m0 = "" if full else ", mask=offs_m < M, other=0.0"
        return [f"offs_m = {rows}", "q_idx = offs_m[:, None]", "q_ok = q_idx < M",
                f"q = tl.load(q_base + q_idx * stride_qm + offs_d[None, :] * stride_qd{masks(d_pad, 'd_ok')}){upcast}",
                f"do = tl.load(do_base + q_idx * stride_om + offs_dv[None, :] * stride_od{masks(dv_pad, 'dv_ok')}){upcast}",
                f"m_row = tl.load(LSE + row + offs_m{m1})",
                f"log_l = tl.load(LSE + stats + row + offs_m{m0})",
                f"delta = tl.load(DELTA + row + offs_m{m0})"]

    def k_tiles(cols: str, full: bool) -> list[str]:
        def masks(pad: bool, ok: str) -> str:
            km = " & ".join(x for x in (f"{ok}[:, None]" if pad else None, None if full else "k_ok") if x)
            return f", mask={km}, other=0.0" if km else ""
        return [f"kn = {cols}", "k_idx = kn[None, :]", "k_ok = k_idx < N",
                f"kT = tl.load(k_base + offs_d[:, None] * stride_kd + k_idx * stride_kn{masks(d_pad, 'd_ok')}){upcast}",
                f"vT = tl.load(v_base + offs_dv[:, None] * stride_vd + k_idx * stride_vn{masks(dv_pad, 'dv_ok')}){upcast}"]

    def loop(var: str, lo: str, hi: str, block: str, body: list[str], what: str, listed: str | None = None) -> list[str]:
        return [f"# {what}", *over_tiles(var, block, lo, hi, listed, body)]

    # dK, dV: the query blocks that see key block start_n, [m_lo, m_hi); inside, [mf_lo, mf_hi) see it whole
    row_k = f"start_n - {off}" if off else "start_n"  # the first query position that sees key start_n
    m_range = ["m_lo = 0", "m_hi = M", "mf_lo = 0", "mf_hi = M // BLOCK_M * BLOCK_M"]
    if mod.causal:  # key k is seen by the queries q + off >= k
        m_range[0] = f"m_lo = tl.maximum({row_k}, 0) // BLOCK_M * BLOCK_M"
        m_range[2] = f"mf_lo = (tl.maximum({row_k} + BLOCK_N - 1, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M"
    if mod.window is not None:  # and by the queries with q + off - k < window
        m_range[1] = f"m_hi = tl.minimum(M, {row_k} + BLOCK_N - 1 + {mod.window})"
        m_range[3] = (f"mf_hi = tl.minimum(M // BLOCK_M * BLOCK_M, (tl.maximum({row_k} + {mod.window} - BLOCK_M + 1, 0)"
                      f" + BLOCK_M - 1) // BLOCK_M * BLOCK_M)")
    m_range += ["mf_lo = tl.minimum(tl.maximum(mf_lo, m_lo), m_hi)",
                "mf_hi = tl.where(start_n + BLOCK_N <= N, tl.minimum(tl.maximum(mf_hi, mf_lo), m_hi), mf_lo)"]
    # dQ: the key blocks query block start_m sees, [n_lo, n_hi); inside, [nf_lo, nf_hi) seen whole
    row0 = f"start_m * BLOCK_M + {off}" if off else "start_m * BLOCK_M"
    n_range = ["n_lo = 0", "n_hi = N", "nf_lo = 0", "nf_hi = N // BLOCK_N * BLOCK_N"]
    if mod.causal:
        n_range[1] = f"n_hi = tl.minimum(N, {row0} + BLOCK_M)"
        n_range[3] = f"nf_hi = tl.minimum(tl.maximum({row0} + 1, 0) // BLOCK_N * BLOCK_N, N // BLOCK_N * BLOCK_N)"
    if mod.window is not None:
        n_range[0] = f"n_lo = tl.maximum(0, {row0} - {mod.window - 1}) // BLOCK_N * BLOCK_N"
        n_range[2] = (f"nf_lo = (tl.maximum({row0} + BLOCK_M - {mod.window}, 0) + BLOCK_N - 1)"
                      " // BLOCK_N * BLOCK_N")
    n_range += ["nf_lo = tl.minimum(tl.maximum(nf_lo, n_lo), n_hi)",
                "nf_hi = tl.where(start_m * BLOCK_M + BLOCK_M <= M, tl.minimum(tl.maximum(nf_hi, nf_lo), n_hi), nf_lo)"]

    extra_params = "".join(f"extra{i}_ptr, extra{i}_s0, extra{i}_s1, extra{i}_s2, extra{i}_s3,\n    "
                           for i in range(mod.n_extra))
    if mod.data_mask:  # the data mask's tile lists: per query block (dQ), per key block (dK, dV)
        extra_params += "BLOCKS_Q, bq_sb, bq_sh, bq_st, bq_sk,\n    BLOCKS_K, bk_sb, bk_sh, bk_st, bk_sk,\n    "
    extra_params += "".join(f"DB{i}, db{i}_s0, db{i}_s1, db{i}_s2, db{i}_s3,\n    " for i, _ in mod.bias_grads)
    extra_bases = [f"extra{i}_base = extra{i}_ptr + b64 * extra{i}_s0 + h64 * extra{i}_s1" for i in range(mod.n_extra)]
    extra_bases += [mod.form(i).setup(i) for i in range(mod.n_extra) if hasattr(mod.form(i), "setup")]
    extra_bases += [f"db{i}_base = DB{i} + b64 * db{i}_s0 + h64 * db{i}_s1  # extra {i}'s gradient, fp32"
                    for i, _ in mod.bias_grads]
    params = f"""Q, K, V, DO, LSE, DELTA, DQ, DK, DV, SEED,
    {extra_params}stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, M, N, STATS, SPLIT, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
    WIDE: tl.constexpr,"""
    # per query head: its Q, dO, statistics and extras (the dK/dV program walks the heads of its K/V head)
    per_head = f"""b64 = b_idx.to(tl.int64)
h64 = h_idx.to(tl.int64)
q_base = Q + b64 * stride_qb + h64 * stride_qh
do_base = DO + b64 * stride_ob + h64 * stride_oh
row = bh.to(tl.int64) * M  # DELTA: [B*Hq, M]; LSE: [2, B*Hq, M], the row maxima, then the logs of the row sums
{chr(10).join(extra_bases)}""".split("\n")
    common = ["stats = STATS  # B*Hq*M: LSE's second half, the logs of the row sums", *WIDE_ARANGES, "offs_d = tl.arange(0, BLOCK_D)",
              "d_ok = offs_d < HEAD_DIM", "offs_dv = tl.arange(0, BLOCK_DV)", "dv_ok = offs_dv < HEAD_DIM_V"] + (["seed = tl.load(SEED)  # dropout's, as the forward's"] if dropout else [])

    def dkdv_body(full: bool) -> list[str]:
        return [*q_tiles("start_m + ar_m", full), *scores(full),
                f"dv += tl.dot(tl.trans({'p_kept' if dropout else 'p'}.to({low})), do, input_precision=DOT_PRECISION)",
                f"dk += tl.dot(tl.trans(ds.to({low})), q, input_precision=DOT_PRECISION)"]

    def dq_body(full: bool) -> list[str]:
        # a learned bias's gradient: P * (dP - delta) * d(final s)/d(bias), summed (atomically) over where it
        # broadcasts; each tile once, here, where the program owns its query rows
        bias = [f"tl.atomic_add(db{i}_base + q_idx * db{i}_s2 + k_idx * db{i}_s3, "
                f"tl.where(p == 0.0, 0.0, p * (dp - delta[:, None]) * g{i}), mask=q_ok & k_ok)" for i, _ in mod.bias_grads]
        return [*k_tiles("start_n + ar_n", full), *scores(full),
                f"dq += tl.dot(ds.to({low}), tl.trans(kT), input_precision=DOT_PRECISION)", *bias]

    if mod.data_mask:  # the tiles the data mask keeps (whole, then in part), listed per call; the rest skipped
        dkdv_loops = [
            "blk = BLOCKS_K + b64 * bk_sb + h64 * bk_sh + tl.program_id(0) * bk_st  # this key block's lists",
            *loop("start_m", "", "", "BLOCK_M", dkdv_body(True), "query blocks the data mask keeps whole: no mask", "0"),
            *loop("start_m", "", "", "BLOCK_M", dkdv_body(False), "those it keeps in part, and past M: masked", "bk_sk")]
        dq_loops = [
            "blk = BLOCKS_Q + b64 * bq_sb + h64 * bq_sh + start_m * bq_st  # this query block's lists",
            *loop("start_n", "", "", "BLOCK_N", dq_body(True), "key blocks the data mask keeps whole: no mask", "0"),
            *loop("start_n", "", "", "BLOCK_N", dq_body(False), "those it keeps in part, and past N: masked", "bq_sk")]
    else:
        dkdv_loops = [
            *m_range,
            *loop("start_m", "m_lo", "mf_lo", "BLOCK_M", dkdv_body(False), "query blocks on the diagonal: masked"),
            *loop("start_m", "mf_lo", "mf_hi", "BLOCK_M", dkdv_body(True), "query blocks that see the whole key block: no mask"),
            *loop("start_m", "mf_hi", "m_hi", "BLOCK_M", dkdv_body(False), "the window's edge and the last block past M: masked")]
        dq_loops = [
            *n_range,
            *loop("start_n", "n_lo", "nf_lo", "BLOCK_N", dq_body(False), "key blocks at the window's edge: masked"),
            *loop("start_n", "nf_lo", "nf_hi", "BLOCK_N", dq_body(True), "key blocks the whole query block sees: no mask"),
            *loop("start_n", "nf_hi", "n_hi", "BLOCK_N", dq_body(False), "the diagonal's key blocks and the last past N: masked")]
    dkdv = ["part = tl.program_id(1) % SPLIT  # which share of the query heads (SPLIT > 1: few programs otherwise)",
            "bkv = tl.program_id(1) // SPLIT  # (batch, K/V head)", "HKV = H // GROUP", "b_idx = bkv // HKV",
            "kv64 = (bkv % HKV).to(tl.int64)", "k_base = K + b_idx.to(tl.int64) * stride_kb + kv64 * stride_kh",
            "v_base = V + b_idx.to(tl.int64) * stride_vb + kv64 * stride_vh", *common,
            "start_n = tl.program_id(0) * BLOCK_N"] + k_tiles("start_n + ar_n", False) + [
        "dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)", "dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)",
        "for grp in range(part * (GROUP // SPLIT), (part + 1) * (GROUP // SPLIT)):  # query heads reading this K/V head",
        "    h_idx = (bkv % HKV) * GROUP + grp", "    bh = b_idx * H + h_idx",
        *["    " + x for x in per_head + dkdv_loops],
        "out = (bkv.to(tl.int64) * N + kn[:, None]) * HEAD_DIM + offs_d[None, :]  # [B, Hkv, N, D], K's dtype",
        "out_v = (bkv.to(tl.int64) * N + kn[:, None]) * HEAD_DIM_V + offs_dv[None, :]  # [B, Hkv, N, Dv], V's",
        "if ATOMIC:  # the heads split over SPLIT programs: their sums added into fp32 buffers",
        "    tl.atomic_add(DK + out, dk * scale, mask=(kn[:, None] < N) & d_ok[None, :])",
        "    tl.atomic_add(DV + out_v, dv, mask=(kn[:, None] < N) & dv_ok[None, :])",
        "else:",
        f"    tl.store(DK + out, (dk * scale).to({_TL_DTYPE[dtype]}), mask=(kn[:, None] < N) & d_ok[None, :])",
        f"    tl.store(DV + out_v, dv.to({_TL_DTYPE[dtype]}), mask=(kn[:, None] < N) & dv_ok[None, :])"]
    dq = ["bh = tl.program_id(1)", "b_idx = bh // H", "h_idx = bh % H", "kv64 = (h_idx // GROUP).to(tl.int64)",
          "k_base = K + b_idx.to(tl.int64) * stride_kb + kv64 * stride_kh",
          "v_base = V + b_idx.to(tl.int64) * stride_vb + kv64 * stride_vh", *per_head, *common,
          "start_m = tl.program_id(0)"] + q_tiles("start_m * BLOCK_M + ar_m", False) + [
        "dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)", *dq_loops,
        f"tl.store(DQ + (bh.to(tl.int64) * M + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], (dq * scale).to({_TL_DTYPE[dtype]}), "
        "mask=q_ok & d_ok[None, :])  # [B, Hq, M, D], Q's dtype"]
    return f'''\
# Generated by fuser.codegen.attention_bwd: FlashAttention-2 backward, {len(mod.lines)} score-mod line(s){f", dropout {dropout} (its mask drawn again from SEED)" if dropout else ""}.
# head_dim {head_dim} (padded to {block_d}), V's {head_dim_v} (padded to {block_dv}), {dtype}, fp32 accumulation; P recomputed from Q, K and the
# forward's row maximum and log-sum, kept apart: exp(s - m - log l) is 1/N on a row a finite fill masks whole,
# as in eager, where exp(s - lse) with lse = -1e36 + log N (rounded to -1e36) would be 1.
# HBM bytes: dK/dV read Q, dO (and LSE, delta) once per key block, K, V once, write dK, dV (K's dtype, per
# K/V head); dQ reads K, V once per query block, Q, dO once, writes dQ (Q's dtype).  No M x N matrix is stored.
import triton
import triton.language as tl
{math_import("".join(mod.helpers) + "".join(mod.lines) + "".join(mod.grad or ()))}
HEAD_DIM = tl.constexpr({head_dim})
BLOCK_D = tl.constexpr({block_d})
HEAD_DIM_V = tl.constexpr({head_dim_v})
BLOCK_DV = tl.constexpr({block_dv})
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


# delta = rowsum(dO * O) in fp32 (FlashAttention-2's D), a program per block of rows.
# HBM bytes: O and dO read once (B*Hq*M*D*e each), delta written (B*Hq*M*4).
DELTA_SOURCE = """\
import triton
import triton.language as tl


@triton.jit
def attention_bwd_delta(O, DO, DELTA, so_b, so_h, so_m, so_d, sd_b, sd_h, sd_m, sd_d, H, M, D,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # dO strided past 2**31: 64-bit offsets
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < M) & (cols[None, :] < D)
    o = tl.load(O + b * so_b + h * so_h + rows[:, None] * so_m + cols[None, :] * so_d, mask=ok, other=0).to(tl.float32)
    do = tl.load(DO + b * sd_b + h * sd_h + rows[:, None] * sd_m + cols[None, :] * sd_d, mask=ok, other=0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * M + rows, tl.sum(o * do, 1), mask=rows < M)
"""


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _split(programs: int, group: int, device: torch.device) -> int:
    """Over how many dK/dV programs the `group` query heads of a K/V head are shared: 1 (each program sums
    its K/V head's every query head, stores once) unless that leaves the GPU under two programs a
    processor (MQA, few batches, short keys); then the least divisor of `group` that fills it."""
    for d in range(1, group + 1):
        if group % d == 0 and programs * d >= 2 * _processors(device):
            return d
    return group


def prepare_bwd(q, k, v, out, dout, lse, extras=(), *, mod: ScoreMod, scale: float = 1.0, seed=None, lists_cache=None):
    """Host side of the backward: (dq, dk, dv, the gradients of the extras `mod.bias_grads` names (fp32, their
    shapes), [(name, grid, meta)] of the two kernels (each its own tiles: `attention_bwd_plan`), their args, first:
    the launches to run before them, as `prepare`'s: delta = rowsum(dO * O), a data mask's tile lists).
    dout is read in its own layout.  The gradients are q's, k's and v's shapes in their dtypes, contiguous.
    `seed`: the forward's dropout seed, for kernels made with dropout.  `lists_cache`: see attention._extra_args."""
    B, Hq, M, D = q.shape
    Hkv, N, Dv = k.shape[1], k.shape[2], v.shape[-1]
    kv_plan, q_plan = attention_bwd_plan(D, q.dtype, q.is_cuda, head_dim_v=Dv, listed=bool(mod.data_mask))
    block_d = max(16, next_pow2(Dv))  # delta's tiles: O's and dO's
    delta = torch.empty((B, Hq, M), dtype=torch.float32, device=q.device)
    rows = min(64, 4096 // block_d) if q.is_cuda else 16  # O's and dO's tiles: 4096 fp32 values each at most
    first = [(DELTA_SOURCE, "attention_bwd_delta", (cdiv(M, rows), B * Hq),
              (out, dout, delta, *out.stride(), *dout.stride(), Hq, M, Dv), dict(BLOCK_M=rows, BLOCK_D=block_d))]
    dq = torch.empty((B, Hq, M, D), dtype=q.dtype, device=q.device)
    split = _split(cdiv(N, kv_plan[1]) * B * Hkv, Hq // Hkv, q.device)
    if split > 1:  # summed atomically in fp32, rounded after (the caller's .to)
        dk, dv = (torch.zeros((B, Hkv, N, d), dtype=torch.float32, device=q.device) for d in (D, Dv))
    else:
        dk = torch.empty((B, Hkv, N, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((B, Hkv, N, Dv), dtype=v.dtype, device=q.device)
    extra_args, lists = _extra_args(extras, mod, B, Hq, M, N, *q_plan[:2], by_keys=True, lists_cache=lists_cache)
    dextras = []  # a learned bias's gradient: fp32, its own shape (the kernel sums over where it broadcasts)
    for i, _ in mod.bias_grads:
        e = extras[i]
        dextras.append(torch.zeros(e.shape, dtype=torch.float32, device=q.device))
        extra_args += [dextras[-1], *dextras[-1].reshape((1,) * (4 - e.dim()) + tuple(e.shape)).expand(B, Hq, M, N).stride()]
    ieee = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    args = (q, k, v, dout, lse, delta, dq, dk, dv, dq if seed is None else seed, *extra_args, *q.stride(), *k.stride(),
            *v.stride(), *dout.stride(), Hq, Hq // Hkv, M, N, B * Hq * M, split, float(scale))
    big = wide(q, k, v, dout, dq, *extras)
    meta = [dict(BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if ieee else "tf32", ATOMIC=split > 1,
                 WIDE=big, num_warps=warps, num_stages=stages) for block_m, block_n, warps, stages in (kv_plan, q_plan)]
    launches = [("attention_bwd_dkdv", (cdiv(N, kv_plan[1]), B * Hkv * split), meta[0]),
                ("attention_bwd_dq", (cdiv(M, q_plan[0]), B * Hq), meta[1])]
    return dq, dk, dv, dextras, launches, args, first + lists
