"""FlashAttention-2 forward kernel, generated as Triton source around a pluggable score modification.

The attention recogniser hands over what sits between ``Q @ K^T`` and ``softmax`` (scaling, masks, biases,
soft-capping) as a :class:`ScoreMod`; :func:`attention_source` splices it into one fused kernel so the
``M x N`` score matrix never reaches HBM.  `prepare` is the host side of a launch; the runtime loads and launches.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fuser.dtypes import interpreting, math_import
from fuser.ops import dropout_expr, helpers_for
from fuser.plan import WIDE, attention_plan, cdiv, max_offset, next_pow2

__all__ = ["IndexMask", "LinearBias", "ScoreMod", "attention_source", "mask_structure", "prepare", "structure_of"]


@dataclass(frozen=True)
class IndexMask:
    """An extra that is a structural mask of the positions, computed from the indices instead of
    loaded: masked where k > q + offset (causal) or, with a window, where q + offset - k >= window.
    Boolean (`masks`: whether True means masked), or a float holding `fill` where masked, else 0."""
    offset: int
    window: int | None
    dtype: torch.dtype
    masks: bool = True
    fill: float | None = None

    def expression(self) -> str:
        masked = f"(k_idx > q_idx + {self.offset})" if self.offset else "(k_idx > q_idx)"
        if self.window is not None:
            masked = f"({masked} | (q_idx + {self.offset} - k_idx >= {self.window}))"
        if self.dtype == torch.bool:
            return masked if self.masks else f"({masked} == 0)"
        return f"tl.where({masked}, {_float(self.fill)}, 0.0).to({_TL_DTYPE[self.dtype]})"


@dataclass(frozen=True)
class LinearBias:
    """An extra equal to slope[b, h] * (k - q) rounded to its dtype (ALiBi), its slope being its own
    element at q = 0, k = 1: one scalar load per program instead of a tile per step."""
    dtype: torch.dtype

    def setup(self, i: int) -> str:
        return f"extra{i}_slope = tl.load(extra{i}_base + extra{i}_s3).to(tl.float32)"

    def expression(self, i: int) -> str:
        return f"(extra{i}_slope * (k_idx - q_idx).to(tl.float32)).to({_TL_DTYPE[self.dtype]})"


def structure_of(masked: torch.Tensor, m: int, n: int) -> tuple[int, int | None] | None:
    """(offset, window) when the [m, n] boolean `masked` is exactly k > q + offset [or q + offset - k
    >= window], for the offsets of top-left (0) and bottom-right (n - m) alignment; None otherwise,
    and where a row keeps no key (eager averages over a fully masked row: no structure gives that)."""
    kept = (~masked).sum(1)
    if not bool((kept > 0).all()):
        return None
    d = torch.arange(n, device=masked.device)[None, :] - torch.arange(m, device=masked.device)[:, None]  # k - q
    window = int(kept.max())
    for off in sorted({0, n - m}):
        causal = d > off
        if torch.equal(masked, causal):
            return off, None
        if window < n and torch.equal(masked, causal | (off - d >= window)):
            return off, window
    return None


def mask_structure(extra: torch.Tensor, kind: str, m: int, n: int) -> tuple[int, int | None] | None:
    """`structure_of` a data mask (of ScoreMod.data_mask's `kind`: "add", masked at <= DEAD_FILL and kept at
    0; "keep"/"drop", boolean), broadcastable to [B, H, m, n] and the same in every batch and head; None
    otherwise (a bias, a padding mask broadcast along the queries or keys).  Syncs with the host."""
    if extra.dim() < 2 or tuple(extra.shape[-2:]) != (m, n) or not m or not n:
        return None
    planes = extra.reshape(-1, m, n)
    plane = planes[0]
    if planes.shape[0] > 1 and not bool((planes == plane).all()):
        return None
    if kind == "add":
        masked = plane.float() <= DEAD_FILL
        if not bool((masked | (plane == 0)).all()):
            return None
    else:
        masked = plane if kind == "drop" else ~plane
    return structure_of(masked, m, n)


def _float(x: float) -> str:
    return f'float("{x}")' if x != x or x in (float("inf"), float("-inf")) else repr(x)


def mask_line(kind: str, fill: float = 0.0) -> str:
    """The score mod's line that applies a data mask `extra0` of `kind` (ScoreMod.data_mask's: "add" adds it;
    boolean "drop" / "keep": where True drops / keeps the key, a dropped key's score `fill`)."""
    return {"add": "s = s + extra0.to(tl.float32)", "drop": f"s = tl.where(extra0 != 0, {_float(fill)}, s)",
            "keep": f"s = tl.where(extra0 != 0, s, {_float(fill)})"}[kind]


@dataclass(frozen=True)
class ScoreMod:
    """Pointwise code applied to the fp32 score tile inside the inner loop.

    ``lines`` are Triton statements.  They read ``s`` (fp32 ``[BLOCK_M, BLOCK_N]`` scores, already multiplied by
    ``scale``, natural-log scale) and may use ``q_idx`` (``[BLOCK_M, 1]`` query positions), ``k_idx``
    (``[1, BLOCK_N]`` key positions), ``b_idx``/``h_idx`` (scalars: batch, query head), ``M``/``N`` (sequence
    lengths) and, for each extra tensor ``i``, the loaded tile ``extra{i}`` (``[BLOCK_M, BLOCK_N]`` in the
    tensor's own dtype, 0 outside the valid region) or the raw ``extra{i}_ptr``/``extra{i}_s0..s3``.  The last line
    assigns ``s``.  A masked-out score is ``-inf`` (or ``finfo.min``, as eager had it).

    Structural masks use the query's position aligned to the keys, ``q_idx + causal_offset``:
    ``causal`` keeps keys ``k_idx <= q_idx + causal_offset`` (``causal_offset = N - M`` is the bottom-right
    alignment of decoding / chunked prefill; 0 is torch's ``is_causal`` top-left alignment), and ``window`` keeps
    keys with ``q_idx + causal_offset - k_idx < window``.  Tiles that these masks empty entirely are skipped.

    The lines run in fp32; where eager rounded the scores to a 16-bit dtype (a ``finfo(float16).min`` additive
    mask, say), keep that rounding in the lines, ``s = (s.to(tl.float16) + extra0).to(tl.float32)``, to
    reproduce eager's fully masked rows.
    """

    lines: tuple[str, ...]
    n_extra: int = 0
    causal: bool = False
    causal_offset: int = 0
    window: int | None = None
    helpers: tuple[str, ...] = ()  # sources of @triton.jit functions the lines call
    forms: tuple = ()  # per extra: IndexMask / LinearBias (computed from the indices), or None (loaded)
    grad: tuple[str, ...] | None = None  # lines setting g = d(final s)/d(scaled s), for the backward; None: none
    # (i, kind): loaded extra i is a mask the chain applies last (only casts after it), so a tile where it
    # masks every score contributes nothing and a tile where it masks none is the chain without it.
    # kind "add": s + extra, masked at <= DEAD_FILL, kept at 0; "keep": where(extra, s, fill <= DEAD_FILL);
    # "drop": where(extra, fill, s) or masked_fill(s, extra, fill).  Its tiles are classed per call
    # (`list_launches`) and the kernel walks the lists: masked tiles skipped, kept ones run without it.
    data_mask: tuple[int, str, torch.dtype] | None = None  # (i, kind, the extra's dtype)
    # (i, lines setting g{i} = d(final s)/d(extra i)) per extra that needs a gradient (a learned bias): the
    # backward's dQ kernel adds P * (dP - delta) * g{i} into its gradient; lines None: no rule, no kernel
    bias_grads: tuple[tuple[int, tuple[str, ...] | None], ...] = ()

    def form(self, i: int):
        return self.forms[i] if i < len(self.forms) else None


_TL_DTYPE = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _indent(lines, n: int) -> str:
    return "\n".join(" " * n + line for line in lines)


# a mask value at or below this leaves exp(s + mask - m) = 0 in fp32 for any finite score s and row maximum
# m of a row that keeps some key (finfo(bfloat16 or float32).min, -1e36 and -inf all are)
DEAD_FILL = -1e30
_NEUTRAL = {"add": 0, "keep": 1, "drop": 0}  # the data mask's value on a tile it keeps whole


# The data mask's tiles as lists (`ScoreMod.data_mask`), built per call by small kernels launched before
# the attention kernel (`list_launches`), each program a tile or a block, so that they take microseconds
# (the first version, a program per query block walking its row of tiles, took 30-60 us on an H100).
# `tile_classes`: one program per tile, its class (0: masked whole, past M or N counting as masked; 1: kept
# in part; 2: kept whole, inside M and N) and, per row, whether the row keeps a key (an atomic max into
# one int32 a row: B*H*M*4 bytes, whatever N).
# `tile_lists`: per query block (per key block with BY_KEYS, the backward's dK/dV), the tiles on two lists
# of runs, [0] = the number of runs, then each run's first tile and one past its last: the tiles kept
# whole, then those kept in part (the kernels loop over a range inside a run, as over a structural mask's
# tiles: the K/V addresses follow the loop variable, not an index loaded each step; whether that times
# better is not measured yet; causal, window and padding masks give one or two runs), a tile masked whole on
# neither unless its query block holds a row that keeps no key at all (eager's uniform row: that block
# skips nothing; the per-query-block launch finds those blocks, the per-key-block one, launched after it,
# reads them).  HBM bytes: the mask read once (tile_classes); the rest is bytes per tile or row.
BLOCK_LISTS_SOURCE = f"""\
import triton
import triton.language as tl


@triton.jit
def _classes(x, KIND: tl.constexpr):
    # (masked, kept) per element: KIND 0 additive (masked at <= {DEAD_FILL!r}, kept at 0), 1 boolean keep, 2 boolean drop
    x = x.to(tl.float32)
    if KIND == 0:
        return x <= {DEAD_FILL!r}, x == 0.0
    elif KIND == 1:
        return x == 0.0, x != 0.0
    else:
        return x != 0.0, x == 0.0


@triton.jit
def tile_classes(E, e_sb, e_sh, e_sm, e_sn, CLASS, SEEN, H, M, N, T_M, T_N,
                 KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # CLASS: [B*H, T_M, T_N] int8; SEEN: [B*H, M] int32, zeroed, raised to 1 where the row keeps a key here
    t = tl.program_id(0)
    bh = tl.program_id(1)
    mb = t // T_N
    nb = t % T_N
    base = E + (bh // H).to(tl.int64) * e_sb + (bh % H).to(tl.int64) * e_sh
    rows = (mb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # a mask of 2**31 elements or more: 64-bit offsets
    cols = (nb * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    masked, kept = _classes(tl.load(base + rows[:, None] * e_sm + cols[None, :] * e_sn, mask=ok, other=0), KIND)
    all_masked = tl.min(tl.min((masked | (ok == 0)).to(tl.int32), 1), 0)
    all_kept = tl.min(tl.min((kept & ok).to(tl.int32), 1), 0)
    tl.store(CLASS + (bh.to(tl.int64) * T_M + mb) * T_N + nb, tl.where(all_kept == 1, 2, 1 - all_masked).to(tl.int8))
    sees = tl.max((ok & (masked == 0)).to(tl.int32), 1)
    tl.atomic_max(SEEN + bh.to(tl.int64) * M + rows, sees, mask=(rows < M) & (sees > 0))


@triton.jit
def tile_lists(CLASS, SEEN, HIDDEN, OUT, M, T_M, T_N,
               BY_KEYS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # OUT: [B*H, outer, 2, 1 + 2 * inner] int32; HIDDEN: [B*H, T_M] int32, written per query block, read per key block
    o = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if BY_KEYS:  # key block o: its query blocks
        inner = T_M
        cls = CLASS + bh * T_M * T_N + o
        step = T_N
        out = OUT + (bh * T_N + o) * 2 * (1 + 2 * T_M)
        hidden = 0
    else:  # query block o: its key blocks, and whether a row of it keeps no key at all
        inner = T_N
        cls = CLASS + (bh * T_M + o) * T_N
        step = 1
        out = OUT + (bh * T_M + o) * 2 * (1 + 2 * T_N)
        rows = o * BLOCK_M + tl.arange(0, BLOCK_M)
        sees = tl.load(SEEN + bh * M + rows, mask=rows < M, other=0)
        hidden = tl.max(((rows < M) & (sees == 0)).to(tl.int32), 0)
        tl.store(HIDDEN + bh * T_M + o, hidden)
    n_kept = tl.zeros((), tl.int32)
    n_part = tl.zeros((), tl.int32)
    for i0 in range(0, inner, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        whole, part = _listed(cls, step, HIDDEN + bh * T_M, hidden, i, inner, BY_KEYS, CHUNK)
        whole_before, part_before = _listed(cls, step, HIDDEN + bh * T_M, hidden, i - 1, inner, BY_KEYS, CHUNK)
        whole_after, part_after = _listed(cls, step, HIDDEN + bh * T_M, hidden, i + 1, inner, BY_KEYS, CHUNK)
        n_kept = _runs(out, whole, whole & (whole_before == 0), whole & (whole_after == 0), i, n_kept)
        n_part = _runs(out + 1 + 2 * inner, part, part & (part_before == 0), part & (part_after == 0), i, n_part)
    tl.store(out, n_kept)
    tl.store(out + 1 + 2 * inner, n_part)


@triton.jit
def _listed(cls, step, hidden_at, hidden, i, inner, BY_KEYS: tl.constexpr, CHUNK: tl.constexpr):
    # (kept whole, kept in part) for inner tiles i; False outside 0..inner-1
    valid = (i >= 0) & (i < inner)
    c = tl.load(cls + i * step, mask=valid, other=0)
    if BY_KEYS:
        h = tl.load(hidden_at + i, mask=valid, other=0)
    else:
        h = tl.zeros([CHUNK], tl.int32) + hidden  # a vector: the interpreter's masks want one
    return valid & (c == 2), valid & ((c == 1) | ((c == 0) & (h != 0)))


@triton.jit
def _runs(out, on, starts, ends, i, n):
    # append the runs of `on` (first tile, one past the last) after the n runs so far; a run begun in an
    # earlier chunk ends in this one at index n - 1
    k = n + tl.cumsum(starts.to(tl.int32), 0) - 1
    tl.store(out + 1 + 2 * k, i, mask=starts)
    tl.store(out + 2 + 2 * k, i + 1, mask=ends)
    return n + tl.sum(starts.to(tl.int32), 0)
"""

_KIND = {"add": 0, "keep": 1, "drop": 2}
_CHUNK = 32  # tiles a tile_lists step looks at


def list_launches(extra: torch.Tensor, kind: str, B: int, H: int, M: int, N: int, block_m: int, block_n: int,
                  by_keys: bool = False) -> tuple[list, list]:
    """The data mask's tile lists: ([per query block, and with `by_keys` per key block, the [B, H, T, 2, 1 + 2U]
    int32 lists of runs, expanded where the mask broadcasts], the launches that fill them, as (source, kernel name,
    grid, args, meta), to run before the attention kernel).  The kernels run over the mask's own batch and
    head dims (1 where it broadcasts)."""
    e = extra.reshape((1,) * (4 - extra.dim()) + tuple(extra.shape))
    be, he = e.shape[:2]
    e = e.expand(be, he, M, N)
    if e.dtype == torch.bool:
        e = e.view(torch.uint8)
    tm, tn = cdiv(M, block_m), cdiv(N, block_n)
    new = functools.partial(torch.empty, dtype=torch.int32, device=extra.device)
    classes = torch.empty((be * he, tm, tn), dtype=torch.int8, device=extra.device)
    seen = torch.zeros((be * he, M), dtype=torch.int32, device=extra.device)
    hidden = new((be * he, tm))
    launches = [(BLOCK_LISTS_SOURCE, "tile_classes", (tm * tn, be * he), (e, *e.stride(), classes, seen, he, M, N, tm, tn),
                 dict(KIND=_KIND[kind], BLOCK_M=block_m, BLOCK_N=block_n))]
    lists = []
    for keys in (False, True) if by_keys else (False,):  # per query block first: it finds the hidden rows
        outer, inner = (tn, tm) if keys else (tm, tn)
        blocks = new((be, he, outer, 2, 1 + 2 * inner))
        launches.append((BLOCK_LISTS_SOURCE, "tile_lists", (outer, be * he), (classes, seen, hidden, blocks, M, tm, tn),
                         dict(BY_KEYS=keys, BLOCK_M=block_m, CHUNK=_CHUNK)))
        lists.append(blocks.expand(B, H, *blocks.shape[2:]))
    return lists, launches


def over_tiles(var: str, block: str, lo: str, hi: str, listed: str | None, body: list[str]) -> list[str]:
    """A loop over tiles running `body`: `var` from lo to hi by `block`, or over the runs of the list at
    `blk + listed` (`list_launches`: the number of runs, then each run's first tile and one past its last)."""
    if listed is None:
        return [f"for {var} in range({lo}, {hi}, {block}):"] + ["    " + x for x in body]
    return [f"for run in range(0, tl.load(blk + {listed})):",
            f"    for {var} in range(tl.load(blk + {listed} + 1 + 2 * run) * {block}, "
            f"tl.load(blk + {listed} + 2 + 2 * run) * {block}, {block}):"] + ["        " + x for x in body]


def _extra_lines(mod: ScoreMod, full: bool) -> list[str]:
    """The extras of one tile.  In a full tile (every key visible under the kernel's structure) a
    structural mask of that same structure keeps everything: a constant the compiler folds away."""
    lines = []
    for i in range(mod.n_extra):
        form = mod.form(i)
        same = isinstance(form, IndexMask) and mod.causal and (form.offset, form.window) == (mod.causal_offset, mod.window)
        if full and same:
            kept = 0 if form.masks or form.dtype != torch.bool else 1
            dt = "tl.int1" if form.dtype == torch.bool else _TL_DTYPE[form.dtype]
            lines.append(f"extra{i} = tl.full([BLOCK_M, BLOCK_N], {kept}, {dt})  # the structural mask keeps this tile")
        elif full and mod.data_mask and mod.data_mask[0] == i:
            _, kind, dtype = mod.data_mask
            dt = "tl.int1" if dtype == torch.bool else _TL_DTYPE[dtype]
            lines.append(f"extra{i} = tl.full([1, 1], {_NEUTRAL[kind]}, {dt})  # the data mask keeps this tile whole: not loaded")
        elif isinstance(form, IndexMask):
            lines.append(f"extra{i} = {form.expression()}  # a structural mask, from the indices")
        elif isinstance(form, LinearBias):
            lines.append(f"extra{i} = {form.expression(i)}  # ALiBi-like: slope * (k - q)")
        else:
            lines.append(f"extra{i} = tl.load(extra{i}_base + q_idx * extra{i}_s2 + k_idx * extra{i}_s3, "
                         f"mask=q_ok & k_ok, other=0)")
    return lines


def probability_dropout(x: str, dropout: float) -> str:
    """Dropout of the probabilities' tile `x` (fuser::dropout's mask, fuser/ops.py): element (b, h, q, k)
    of the [B, Hq, M, N] probabilities draws Philox's counter ((b * Hq + h) * M + q) * N + k from the
    kernel's seed, in the forward and again in the backward, so the mask is never stored."""
    return dropout_expr(x, "seed", "(bh.to(tl.int64) * M + q_idx) * N + k_idx", dropout, 0)


def refusal(dtype, head_dim, head_dim_v) -> str | None:
    """Why the kernels do not take q of `dtype` and these head dims (sizes: ints or sympy expressions), or None."""
    dims = (head_dim, head_dim_v)
    if not all(getattr(d, "is_Integer", isinstance(d, int)) for d in dims):
        return f"a head dim that varies between calls ({dims}: the kernel is made for static head dims)"
    if dtype not in _TL_DTYPE or not all(0 < int(d) <= 256 for d in dims):
        return f"{dtype} q with head dims {tuple(map(int, dims))} (the kernel takes 16- and 32-bit floats, head dims up to 256)"
    return None


def check(dtype, head_dim: int, head_dim_v: int) -> None:
    """`refusal` as an error, for the kernels' makers: a tile of each head dim lives in registers."""
    why = refusal(dtype, head_dim, head_dim_v)
    if why is not None:
        raise ValueError(f"attention: {why}")


def attention_source(mod: ScoreMod, head_dim: int, dtype, dropout: float = 0.0, head_dim_v: int | None = None) -> str:
    """Triton source of the forward kernel ``attention_fwd`` for one score mod, head dims and element dtype;
    `dropout`: the probability of dropout on the softmax's output (training), drawn from the SEED operand.
    `head_dim` is Q's and K's, `head_dim_v` V's and the output's where it differs (MLA: DeepSeek's 192 and 128)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    check(dtype, head_dim, head_dim_v)
    if mod.window is not None and mod.window < 1:
        raise ValueError("attention: window must be >= 1")
    block_d, block_dv = max(16, next_pow2(head_dim)), max(16, next_pow2(head_dim_v))
    # Triton's interpreter computes bf16 dots wrongly (values ~1e8): there, tiles are upcast to fp32
    # before each dot (exact products, fp32 accumulation as on the GPU).
    upcast = ".to(tl.float32)" if interpreting() and dtype == torch.bfloat16 else ""
    p_dtype = "tl.float32" if upcast else _TL_DTYPE[dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    has_mod = bool(mod.lines)
    off = mod.causal_offset
    qpos = f"q_idx + {off}" if off else "q_idx"
    d_pad = block_d != head_dim  # only then do loads need a mask along D
    dv_pad = block_dv != head_dim_v

    # Without a score mod, scale and log2(e) fold into one multiply and the softmax runs in base 2.  A score mod
    # must see natural-log scores, so there the scores stay natural and log2(e) is applied to the *difference*
    # s - m: multiplying a finfo.min score by log2(e) would overflow to -inf and turn eager's uniform average over a
    # fully finfo.min-masked row into NaN.
    if has_mod:
        to_base2 = " * LOG2E"
        m_nat = "m_i"
    else:
        to_base2 = ""
        m_nat = "m_i * LN2"

    def scores(full: bool) -> list[str]:
        if not has_mod:
            return ["s = tl.dot(q, kT, input_precision=DOT_PRECISION) * (scale * LOG2E)  # base-2 scores"]
        return (["s = tl.dot(q, kT, input_precision=DOT_PRECISION) * scale"] + _extra_lines(mod, full)
                + ["# score mod"] + [line.strip() for line in mod.lines])

    keep = ["k_ok"]
    if mod.causal:
        keep.append(f"(k_idx <= {qpos})")
    if mod.window is not None:
        keep.append(f"({qpos} - k_idx < {mod.window})")

    def loop(lo: str, hi: str, full: bool, what: str, listed: str | None = None) -> str:
        """One loop over key tiles, [lo, hi) or the data mask's list at `blk + listed`.  Full tiles lie
        inside N and inside the structure (or the data mask keeps them whole): no bounds and no mask at all
        (the unmasked loads vectorise); the others mask as the structure says."""
        d_k = "d_ok[:, None]" if d_pad else None
        d_v = "dv_ok[None, :]" if dv_pad else None
        k_mask = d_k if full else " & ".join(x for x in (d_k, "k_ok") if x)
        v_mask = d_v if full else " & ".join(x for x in ("(kn[:, None] < N)", d_v) if x)
        k_load = f"tl.load(k_base + offs_d[:, None] * stride_kd + k_idx * stride_kn{f', mask={k_mask}, other=0.0' if k_mask else ''}){upcast}"
        v_load = f"tl.load(v_base + kn[:, None] * stride_vn + offs_dv[None, :] * stride_vd{f', mask={v_mask}, other=0.0' if v_mask else ''}){upcast}"
        body = ["kn = start_n + offs_n", "k_idx = kn[None, :]", "k_ok = k_idx < N", f"kT = {k_load}",
                *scores(full)]
        if not full:
            body.append(f's = tl.where({" & ".join(keep)}, s, float("-inf"))')
        body += [
            "m_new = tl.maximum(m_i, tl.max(s, 1))",
            "# A row with every score so far -inf has m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.",
            'm_sub = tl.where(m_new == float("-inf"), 0.0, m_new)',
            f"alpha = tl.exp2((m_i - m_sub){to_base2})",
            f"p = tl.exp2((s - m_sub[:, None]){to_base2})",
            "l_i = l_i * alpha + tl.sum(p, 1)",
            *([f"p = {probability_dropout('p', dropout)}  # dropout: linear in p, so the sum above stays undropped"]
              if dropout else []),
            f"v = {v_load}",
            f"acc = tl.dot(p.to({p_dtype}), v, acc * alpha[:, None], input_precision=DOT_PRECISION)",
            "m_i = m_new",
        ]
        return f"    # {what}\n{_indent(over_tiles('start_n', 'BLOCK_N', lo, hi, listed, body), 4)}\n"

    # Key ranges: [lo, hi) is what any row of this query block may see (the rest is skipped);
    # inside it, [lo_full, hi_full) are the tiles every row sees whole, run without masks.
    row0 = f"start_m * BLOCK_M + {off}" if off else "start_m * BLOCK_M"  # the first row's position
    ranges = ["lo = 0", "hi = N", "n_full = N // BLOCK_N * BLOCK_N  # key tiles inside N"]
    if mod.causal:  # the last row sees up to its position; the first row sees the tiles that end at its own
        ranges[1] = f"hi = tl.minimum(N, {row0} + BLOCK_M)"
        ranges.append(f"hi_full = tl.minimum(tl.maximum({row0} + 1, 0) // BLOCK_N * BLOCK_N, n_full)")
    else:
        ranges.append("hi_full = n_full")
    if mod.window is not None:  # the first row sees back to its position - (window - 1); the last row, full
        ranges[0] = f"lo = tl.maximum(0, {row0} - {mod.window - 1}) // BLOCK_N * BLOCK_N"
        ranges.append(f"lo_full = tl.minimum(tl.maximum((tl.maximum({row0} + BLOCK_M - {mod.window}, 0) + BLOCK_N - 1)"
                      f" // BLOCK_N * BLOCK_N, lo), hi)")
    else:
        ranges.append("lo_full = lo")
    ranges.append("hi_full = tl.minimum(tl.maximum(hi_full, lo_full), hi)")
    loops = (loop("lo", "lo_full", False, "tiles before the window's full ones: masked") if mod.window is not None else "")
    loops += loop("lo_full", "hi_full", True, "full tiles: no mask")
    loops += loop("hi_full", "hi", False, "the diagonal's tiles, and the last one past N: masked")
    if mod.data_mask:  # the tiles the data mask keeps (whole, then in part), listed per call; the rest skipped
        ranges = ["blk = BLOCKS + b64 * blk_sb + h64 * blk_sh + start_m * blk_st  # this query block's lists"]
        loops = (loop("", "", True, "tiles the data mask keeps whole: no mask, not loaded", listed="0")
                 + loop("", "", False, "tiles it keeps in part, and those past N: masked", listed="blk_sk"))
    # causal: the query blocks with the most keys start first, so the last wave is of short ones
    start_m = ("tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first" if mod.causal
               else "tl.program_id(0)")

    extra_params = "".join(f"extra{i}_ptr, extra{i}_s0, extra{i}_s1, extra{i}_s2, extra{i}_s3,\n    "
                           for i in range(mod.n_extra)) + ("BLOCKS, blk_sb, blk_sh, blk_st, blk_sk,\n    " if mod.data_mask else "")
    extra_bases = [f"extra{i}_base = extra{i}_ptr + b64 * extra{i}_s0 + h64 * extra{i}_s1"
                   for i in range(mod.n_extra)]
    extra_bases += [mod.form(i).setup(i) for i in range(mod.n_extra) if isinstance(mod.form(i), LinearBias)]
    loaded = [i for i in range(mod.n_extra) if mod.form(i) is None]
    computed = [i for i in range(mod.n_extra) if mod.form(i) is not None]
    extras_io = (f"extras {', '.join(f'extra{i}' for i in loaded)}: B*Hq*M*N*sizeof(extra) each, less where "
                 f"broadcast (stride-0 dims hit in cache)" if loaded else "no extra tensor")
    if computed:
        extras_io += f"; {', '.join(f'extra{i}' for i in computed)} computed from the indices, not read"
    dims_v = f"; V's and O's Dv = {head_dim_v} (padded to {block_dv})" if head_dim_v != head_dim else ", Dv = D"
    n_ops = len(mod.lines) + 1  # the scale multiply is an op in eager too
    desc = [f"causal (offset {off})" if mod.causal else "non-causal"]
    if mod.window is not None:
        desc.append(f"window {mod.window}")
    desc.append(f"{len(mod.lines)} score-mod line(s), {mod.n_extra} extra tensor(s)")
    if dropout:
        desc.append(f"dropout {dropout} on the probabilities (Philox from SEED, never stored)")

    return f'''\
# Generated by fuser.codegen.attention: FlashAttention-2 forward, {", ".join(desc)}.
# head_dim D = {head_dim} (padded to {block_d}){dims_v}, {dtype} (e = {esize} bytes an element), fp32 accumulation.
#
# HBM bytes, with Tm = cdiv(M, BLOCK_M) query blocks:
#   read   Q      B*Hq*M*D*e              once: the tile stays on chip for the whole key loop
#   read   K, V   B*Hq*N*(D+Dv)*e*Tm      once per query block (causal: about half; GQA heads share via L2)
#   read   {extras_io}
#   write  O      B*Hq*M*Dv*e             (+ the row maximum and log-sum: 2*B*Hq*M*4 when asked for)
# Eager moves the B*Hq*M*N score matrix on top of Q, K, V and O: Q@K^T writes it, each of the {n_ops}
# pointwise op(s) (scale, score mod) reads and writes it, softmax reads it and writes P, P@V reads P:
#   (4 + 2*{n_ops}) * B*Hq*M*N*e bytes that this kernel never moves.
import triton
import triton.language as tl
{math_import("".join(mod.helpers) + "".join(mod.lines))}{"".join(helpers_for(loops))}
HEAD_DIM = tl.constexpr({head_dim})
BLOCK_D = tl.constexpr({block_d})
HEAD_DIM_V = tl.constexpr({head_dim_v})
BLOCK_DV = tl.constexpr({block_dv})
LOG2E = tl.constexpr({_LOG2E!r})
LN2 = tl.constexpr({_LN2!r})
{"".join(mod.helpers)}

@triton.jit
def attention_fwd(
    Q, K, V, O, LSE, SEED,
    {extra_params}stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, M, N, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
    WIDE: tl.constexpr,
):
    start_m = {start_m}
    bh = tl.program_id(1)
    b_idx = bh // H
    h_idx = bh % H
    b64 = b_idx.to(tl.int64)
    h64 = h_idx.to(tl.int64)
    kv64 = (h_idx // GROUP).to(tl.int64)  # GQA/MQA: GROUP query heads read one K/V head, never repeated
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + kv64 * stride_kh
    v_base = V + b64 * stride_vb + kv64 * stride_vh
{_indent(extra_bases, 4)}
    {"seed = tl.load(SEED)  # dropout's" if dropout else "# no dropout: SEED unused"}

{_indent(WIDE_ARANGES, 4)}
    offs_m = start_m * BLOCK_M + ar_m
    offs_n = ar_n
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    q_idx = offs_m[:, None]
    q_ok = q_idx < M
    q = tl.load(q_base + q_idx * stride_qm + offs_d[None, :] * stride_qd, mask=q_ok & d_ok[None, :], other=0.0){upcast}

    # Online softmax state; m_i is in the base the scores are in (see the exp2 arguments below).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

{_indent(ranges, 4)}
{loops}
    # Not special-cased: a row with no visible key has l_i = 0 and gives NaN, as eager softmax over all -inf does.
    o = acc / l_i[:, None]
    o_base = O + b64 * stride_ob + h64 * stride_oh
    tl.store(o_base + q_idx * stride_om + offs_dv[None, :] * stride_od, o.to({_TL_DTYPE[dtype]}), mask=q_ok & dv_ok[None, :])
    if STORE_LSE:  # for the backward: the row maximum (natural log) and log of the row's sum, kept apart
        # (their sum, the log-sum-exp, loses log l where a finite fill masks the whole row: -1e36 + log N)
        lse_at = LSE + bh.to(tl.int64) * M + offs_m
        tl.store(lse_at, {m_nat}, mask=offs_m < M)
        tl.store(lse_at + tl.num_programs(1).to(tl.int64) * M, tl.log(l_i), mask=offs_m < M)
'''


def _extra_args(extras, mod: ScoreMod, B: int, Hq: int, M: int, N: int, block_m: int, block_n: int,
                by_keys: bool = False, lists_cache=None, same_value=None) -> tuple[list, list]:
    """(Each extra with its [B, Hq, M, N] strides (0 where it broadcasts), then, with a data mask, its tile
    lists per query block and, with `by_keys` (the backward's blocks), per key block; the launches that
    fill those lists, to run first: `list_launches`).  `lists_cache`: a mapping that keeps lists made
    before for the same mask and the same blocks, so that the layers of a model that share one mask make
    its lists once a step.  The same mask: with `same_value` (an object that stands for the mask's value
    while it lives: sdpa.RunTimeCheck.same_value), a mask of its shape, strides and dtype; else a tensor
    over the same memory (still alive: no other can have its address), of the same layout and version
    (views and detached tensors share the version of what they view: the slice of a buffer each call, a
    saved tensor given back to the backward).  An entry holds no tensor and no memory, only the lists.  The caller passes a
    mapping only for a mask whose writes bump its version, or whose value `same_value` vouches for (not a
    buffer a graph's program writes over; not under CUDA-graph capture); a write through a tensor of a version
    counter of its own (`.data`, `set_`) is not seen, as by torch's checks of saved tensors."""
    args = []
    for e in extras:
        e = e.expand(B, Hq, M, N)
        args += [e, *e.stride()]
    if not mod.data_mask:
        return args, []
    i, kind, _ = mod.data_mask
    mask = extras[i]
    blocks = (mask.device, tuple(mask.shape), mask.stride(), mask.dtype, kind, B, Hq, M, N, block_m, block_n, by_keys)
    key = alive = None
    if lists_cache is not None and same_value is not None:
        key, alive = ("value", id(same_value), *blocks), weakref.ref(same_value)
    elif lists_cache is not None and not mask.is_inference():
        key, memory = (mask.data_ptr(), mask._version, *blocks), StorageWeakRef(mask.untyped_storage())
        alive = lambda: not memory.expired()  # noqa: E731
    made = lists_cache.get(key) if key is not None else None
    if made is not None and made[0]():
        lists, launches = made[1], []
    else:
        lists, launches = list_launches(mask, kind, B, Hq, M, N, block_m, block_n, by_keys)
        if key is not None:  # an entry whose token or memory is gone is never hit again; the cache's bound drops it
            lists_cache[key] = (alive, lists)
    for blocks in lists:
        args += [blocks, *blocks.stride()[:4]]
    return args, launches


# The tiles' row and column offsets, 64-bit where an operand's offsets pass 2**31 (a [B, M, H, D] layout at M of
# half a million, a [B, 1, M, N] mask at 46341 squared): an int32 offset times a stride would wrap there.
WIDE_ARANGES = ["ar_m = tl.arange(0, BLOCK_M)", "ar_n = tl.arange(0, BLOCK_N)",
                "if WIDE:  # some operand's offsets pass 2**31: index math in 64 bits",
                "    ar_m = ar_m.to(tl.int64)", "    ar_n = ar_n.to(tl.int64)"]


def wide(*tensors) -> bool:
    """Whether some tensor's element offsets (its own strides) reach 2**31: the kernels' WIDE."""
    return any(max_offset(t.shape, t.stride()) > WIDE for t in tensors if isinstance(t, torch.Tensor) and t.numel())


def prepare(q, k, v, extras=(), *, mod: ScoreMod, scale: float = 1.0, return_lse: bool = False, seed=None, out=None,
            lists_cache=None, same_value=None):
    """Host side of one launch of ``attention_source(mod, D, dtype)``: checks the operands, allocates the output
    (and the row statistics) and gives ``(out, lse, grid, args, meta, first)``; the runtime loads the kernel and
    launches it, after `first`: launches (source, name, grid, args, meta) that fill a data mask's tile lists.

    q, k: [B, Hq, M, D], [B, Hkv, N, D]; v: [B, Hkv, N, Dv] with Hq % Hkv == 0; any strides.  ``extras`` are
    broadcastable to [B, Hq, M, N] and read in place (broadcast dims get stride 0).  Out: q's dtype, contiguous
    [B, Hq, M, Dv];
    lse: fp32 [2, B, Hq, M], each row's maximum score (natural log) and the log of its sum of exponentials;
    the log-sum-exp is their sum.  Computes ``softmax(mod(q @ k^T * scale)) @ v``.  `seed`: dropout's 0-d
    int64 seed, for a kernel made with dropout.  `out`: the output, any strides, where the caller allocates it.
    `lists_cache`, `same_value`: see `_extra_args`.
    """
    B, Hq, M, D = q.shape
    Bk, Hkv, N, Dk = k.shape
    if k.shape[:3] != v.shape[:3] or Bk != B or Dk != D or Hq % Hkv:
        raise ValueError(f"attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("attention: q, k, v must share a dtype")
    if len(extras) != mod.n_extra:
        raise ValueError(f"attention: score mod wants {mod.n_extra} extra tensor(s), got {len(extras)}")
    block_m, block_n, num_warps, num_stages = attention_plan(D, q.dtype, q.is_cuda, listed=bool(mod.data_mask),
                                                             head_dim_v=v.shape[-1])
    # fp32 inputs: tf32 only where torch's matmul would use it too; 16-bit inputs ignore it (tf32 is Triton's default).
    ieee = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    if out is None:
        out = torch.empty((B, Hq, M, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((2, B, Hq, M) if return_lse else (0,), dtype=torch.float32, device=q.device)
    extra_args, first = _extra_args(extras, mod, B, Hq, M, N, block_m, block_n, lists_cache=lists_cache,
                                    same_value=same_value)
    grid = (cdiv(M, block_m), B * Hq)
    args = (q, k, v, out, lse, out if seed is None else seed, *extra_args, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            Hq, Hq // Hkv, M, N, float(scale))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if ieee else "tf32", STORE_LSE=return_lse,
                WIDE=wide(q, k, v, out, *extras), num_warps=num_warps, num_stages=num_stages)
    return out, (lse if return_lse else None), grid, args, meta, first
