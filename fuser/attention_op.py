"""fuser::flash_attention: the attention op training graphs call (claimed by fuser/pregrad.py before AOT
Autograd), its backward op, and the choice of kernels per call.

The forward is our kernel (codegen/attention.py) and its gradient our backward kernels
(codegen/attention_bwd.py), for any score chain.  A data mask (a tensor the chain masks the scores with:
`ScoreMod.data_mask`) is unknown at compile time, and the kernels walk lists of the tiles it keeps, built
per call.  But the commonest data mask is nanoGPT's causal `bias` buffer, or Mistral's window, whose
values never change: a call site whose mask is computed from parameters and buffers alone (`sources`)
checks the mask once (and again only when a source is another tensor or was written in place:
codegen/sdpa.RunTimeCheck, as inference's causal_or_masked) and where it is exactly causal or a
window over the positions:
  - SDPA's kernel (flash or cuDNN, as SDPA itself would pick), forward and backward, where the chain is
    that mask and a constant scale alone (`sdpa_scale`), the mask causal from the top-left, no dropout, CUDA;
  - else our kernels made for that structure (the tiles skipped by index arithmetic, no lists, the
    mask not read).
Every path gives the forward's output and its row statistics in one layout, [2, B, H, M] (row maximum,
log of the row sum; SDPA's log-sum-exp with a zero log-sum), which every backward path reads; the
backward takes the path its forward took (`_TAKEN`, keyed by the output's address and checked against its
storage), else the tile lists, which are right for any mask.
The check syncs with the host, so it never runs under CUDA-graph capture (the lists are captured).

Output layout: contiguous (`_out_like`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend

from fuser.codegen.attention import IndexMask, ScoreMod, attention_source, mask_structure, prepare
from fuser.codegen.sdpa import RunTimeCheck
from fuser.codegen.attention_bwd import attention_bwd_source, prepare_bwd

from .dropout import check as check_dropout
from .dtypes import target
from .runtime import Recent, call_directly, lists_cache, run_attention, run_kernels

log = logging.getLogger("fuser")
aten = torch.ops.aten

_MODS: dict[str, ScoreMod] = {}


def register_mod(mod: ScoreMod) -> str:
    """The op takes the score mod by name (a custom op's arguments are tensors and plain values)."""
    key = hashlib.sha256(repr(mod).encode()).hexdigest()[:20]
    _MODS[key] = mod
    return key


@dataclasses.dataclass
class Site:
    """One call site's run-time facts: the scale SDPA would use (None: the chain is more than a mask and a
    scale), and its data mask's structure as last checked."""
    sdpa_scale: float | None
    check: RunTimeCheck = dataclasses.field(default_factory=RunTimeCheck)


_SITES: list[Site] = []
# forward output's data_ptr -> (its storage, weakly; ("sdpa", scale, backend) | ("structured", mod) | None); an
# entry dropped early costs its backward the lists path, never a wrong answer
_TAKEN = Recent(4096)


def register_site(sdpa_scale: float | None) -> int:
    """A new call site with a data mask made from parameters and buffers; its index for the op."""
    _SITES.append(Site(sdpa_scale))
    return len(_SITES) - 1


def _source(make, mod: ScoreMod, q: torch.Tensor, v: torch.Tensor, dropout: float) -> str:
    return _made(make, mod, q.shape[-1], v.shape[-1], q.dtype, q.device.type, dropout)


@functools.lru_cache(maxsize=128)
def _made(make, mod: ScoreMod, head_dim: int, head_dim_v: int, dtype, device_type: str, dropout: float) -> str:
    with target(device_type):
        return make(mod, head_dim, dtype, dropout, head_dim_v)


def _check_dropout(q: torch.Tensor, dropout: float, seeds: list[torch.Tensor]) -> torch.Tensor | None:
    """The seed of dropout on the probabilities, or None without dropout.  The ops take it as a list of
    zero or one tensors: torch.library's autograd glue mis-structures an optional tensor passed as None."""
    torch._check(len(seeds) == (1 if dropout else 0),
                 lambda: f"fuser::flash_attention: dropout {dropout} with {len(seeds)} seeds (one with dropout, else none)")
    if not dropout:
        return None
    check_dropout(q, seeds[0], dropout)
    return seeds[0]


# ------------------------------------------------------------------------------ the run-time check
def _checked(site: int, sources: list[torch.Tensor], extras, mod: ScoreMod, m: int, n: int):
    """The structure of the site's data mask this call (codegen.sdpa.RunTimeCheck); None under CUDA-graph capture
    (a replay would keep the path of the capture whatever the buffers hold later)."""
    if site < 0 or not mod.data_mask or (extras[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    i, kind, _ = mod.data_mask

    def check():
        found = mask_structure(extras[i], kind, m, n)
        log.info("fuser: attention site %d: its data mask at run time: %s", site, "no structure (the tile lists)"
                 if found is None else f"causal from offset {found[0]}" + (f", window {found[1]}" if found[1] else ""))
        return found
    return _SITES[site].check(sources, check)


def _structured(mod: ScoreMod, structure: tuple) -> ScoreMod:
    """The mod with its data mask computed from the positions, as the structure found says."""
    i, kind, dtype = mod.data_mask
    offset, window = structure
    forms = list(mod.forms) + [None] * (mod.n_extra - len(mod.forms))
    # an additive mask's fill: -inf, whatever the mask's own (all <= DEAD_FILL): the structure leaves every row
    # a key, so exp(s + fill - max) is 0 for either
    forms[i] = IndexMask(offset, window, dtype, masks=kind != "keep", fill=float("-inf") if kind == "add" else None)
    return dataclasses.replace(mod, causal=True, causal_offset=offset, window=window, forms=tuple(forms), data_mask=None)


_FLASH, _CUDNN = SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value


def _sdpa_backend(q, k, v, scale: float, dropout: float, structure: tuple) -> int | None:
    """The kernel SDPA itself would pick for causal attention here (torch._fused_sdp_choice: the user's
    backend switches included), where it is flash or cuDNN (their private ops are called with the forward's
    statistics kept for the backward); None where SDPA cannot compute it: a causal mask from the top-left
    (offset 0, no window), no dropout, CUDA."""
    if structure[0] != 0 or structure[1] is not None or dropout or not q.is_cuda or q.shape[-1] % 8 or q.shape[-1] > 128 \
            or v.shape[-1] != q.shape[-1]:
        return None  # head dims: as SDPA pads them (its private ops do not), and within every GPU's backward
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return choice if choice in (_FLASH, _CUDNN) else None


def _take(q, k, v, extras, mod: ScoreMod, dropout: float, site: int, sources, scale: float) -> tuple | None:
    """The forward's path this call: ("sdpa", scale, backend), ("structured", mod) or None (the tile lists,
    or no data mask)."""
    structure = _checked(site, sources, extras, mod, q.shape[2], k.shape[2])
    if structure is None:
        return None
    if _SITES[site].sdpa_scale is not None:
        scale = _SITES[site].sdpa_scale * scale
        backend = _sdpa_backend(q, k, v, scale, dropout, structure)
        if backend is not None:
            return ("sdpa", scale, backend)
    return ("structured", _structured(mod, structure))


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The op's output: contiguous, the layout the replaced `P @ V` had, whatever reads it (a view, an
    expand then a view, ...).  Decision: SDPA's output in q's layout is copied where they differ (a q viewed
    from [B, M, H, D]); a layout of q's own broke views after an expand (found by review)."""
    return q.new_empty((*q.shape[:3], v.shape[-1]))


def _taken(out: torch.Tensor):
    """The path of the forward that made `out`: its entry where it was made for this very storage (alive: a
    tensor brought back by a saved-tensor hook, or another one at a freed address, finds none), else None
    (the tile lists, right for any forward: every path's statistics are one log-sum-exp)."""
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # the forward was captured over the lists too (`_checked`)
    entry = _TAKEN.get(out.data_ptr())
    if entry is None or entry[0].expired() or entry[0] != StorageWeakRef(out.untyped_storage()):
        return None
    return entry[1]


# ------------------------------------------------------------------------------ the custom ops and their gradient
@torch.library.custom_op("fuser::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                       scale: float, mod: str, dropout: float, seeds: list[torch.Tensor], site: int,
                       sources: list[torch.Tensor], keep_lists: bool, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(mod(q @ k^T * scale)) @ v, and [2, B, H, M]: each row's maximum score and the log of its
    sum of exponentials (kept apart for the backward; their sum is the log-sum-exp).  `site` >= 0: a call
    site whose data mask is made from `sources` (parameters, buffers), checked at run time (module doc).
    `keep_lists`: the data mask is an input of the calling graph, whose buffers the graph's program never
    writes over, so its tile lists may be kept for the calls after (runtime.lists_cache).  `sizes`: a site
    whose data mask is made from these sizes alone (aranges at symbolic lengths), checked once per set of them."""
    seed = _check_dropout(q, dropout, seeds)
    m = _MODS[mod]
    taken = _take(q, k, v, extras, m, dropout, site, sources or list(sizes), scale)
    if taken is not None and taken[0] == "sdpa":
        _, s, backend = taken
        if backend == _FLASH:
            o, lse = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True, False, scale=s)[:2]
        else:
            o, lse = aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, True, False, scale=s)[:2]
        out = o.contiguous()  # SDPA's output is in q's layout
        lse = lse.reshape(q.shape[:3])  # cuDNN's [B, H, M, 1]
        lse = torch.stack((lse, torch.zeros_like(lse)))  # log l = 0: the maximum's row holds the log-sum-exp
    else:
        m = taken[1] if taken is not None else m
        source = _source(attention_source, m, q, v, dropout)
        out, lse = run_attention(source, prepare, q, k, v, tuple(extras), mod=m, scale=scale, return_lse=True,
                                 seed=seed, out=_out_like(q, v), lists_cache=lists_cache(q) if keep_lists else None)
    _TAKEN[out.data_ptr()] = (StorageWeakRef(out.untyped_storage()), taken)
    return out, lse


@flash_attention_op.register_fake
def _(q, k, v, extras, scale, mod, dropout, seeds, site, sources, keep_lists, sizes):
    _check_dropout(q, dropout, seeds)
    return _out_like(q, v), q.new_empty((2, *q.shape[:3]), dtype=torch.float32)


@torch.library.custom_op("fuser::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, extras: list[torch.Tensor], scale: float,
                                mod: str, dropout: float, seeds: list[torch.Tensor],
                                keep_lists: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dq, dk, dv (dk, dv summed over the query heads of each K/V head), and the gradients of the extras the
    score mod's `bias_grads` names (learned biases), in their dtypes; by the kernels of the forward's path."""
    seed = _check_dropout(q, dropout, seeds)
    m = _MODS[mod]
    taken = _taken(out)
    if taken is not None and taken[0] == "sdpa":
        _, s, backend = taken
        lse = lse[0]  # SDPA's log-sum-exp (its forward wrote log l = 0 beside it)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        if backend == _FLASH:
            nothing = torch.empty(0, dtype=torch.uint64, device=q.device)  # the philox state: dropout only
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward.default(
                dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, True, nothing, nothing, scale=s)
        else:
            nothing = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward.default(
                dout, q, k, v, out, lse.unsqueeze(-1), nothing, nothing, None, None, None, q.shape[2], k.shape[2], 0.0,
                True, scale=s)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), []
    m = taken[1] if taken is not None else m
    source = _source(attention_bwd_source, m, q, v, dropout)
    dq, dk, dv, dextras, launches, args, first = prepare_bwd(q, k, v, out, dout, lse, tuple(extras), mod=m,
                                                                   scale=scale, seed=seed,
                                                                   lists_cache=lists_cache(q) if keep_lists else None)
    run_kernels(first + [(source, name, grid, args, meta) for name, grid, meta in launches], q.device.type)
    return dq, dk.to(k.dtype), dv.to(v.dtype), [g.to(extras[i].dtype) for (i, _), g in zip(m.bias_grads, dextras)]


@flash_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, extras, scale, mod, dropout, seeds, keep_lists):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            [extras[i].new_empty(extras[i].shape) for i, _ in _MODS[mod].bias_grads])


def _setup(ctx, inputs, output):
    q, k, v, extras, scale, mod, dropout, seeds, _, sources, keep_lists, sizes = inputs
    ctx.sizes = None if sizes else []  # its "gradient" as the autograd glue flattens it: ints a leaf, none a list
    ctx.save_for_backward(q, k, v, output[0], output[1], *seeds, *extras)  # the seed, never the dropout mask
    ctx.scale, ctx.mod, ctx.dropout, ctx.n_seeds, ctx.n_sources = scale, mod, dropout, len(seeds), len(sources)
    ctx.keep_lists = keep_lists


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    seeds, extras = rest[:ctx.n_seeds], rest[ctx.n_seeds:]
    dq, dk, dv, learned = flash_attention_backward_op(dout, q, k, v, out, lse, extras, ctx.scale, ctx.mod, ctx.dropout,
                                                      seeds, ctx.keep_lists)
    dextras = [None] * len(extras)
    for (i, _), g in zip(_MODS[ctx.mod].bias_grads, learned):
        dextras[i] = g
    return dq, dk, dv, dextras, None, None, None, [None] * len(seeds), None, [None] * ctx.n_sources, None, ctx.sizes


flash_attention_op.register_autograd(_backward, setup_context=_setup)
call_directly(flash_attention_op)
call_directly(flash_attention_backward_op)
