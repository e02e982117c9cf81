"""The score chain of a recognised attention, as the lines of its kernel's score modification.

Each chain node becomes one line over fp32 tiles: the scores are `s`, the masks and biases the
chain reads are `extra0..`, loaded per tile by the kernel.  The op table lowers each node, exactly
as it does in pointwise kernels.
"""
from __future__ import annotations


import torch

from fuser import ops
from fuser.graph import meta

from .attention import ScoreMod
from .kernel import lower_pointwise


def score_mod(scores, chain: list, extras: list, cg, causal_offset: int | None = None) -> ScoreMod:
    """The lines; with `causal_offset` (the chain masks every key past q + offset) the kernel also
    applies that mask itself and skips the tiles it empties."""
    names = {scores: "s"}
    dtypes = {"s": torch.float32}
    for i, e in enumerate(extras):
        names[e] = f"extra{i}"
        dtypes[f"extra{i}"] = meta(e).dtype
    lines = []
    for i, n in enumerate(chain):
        expr, dt, checks = lower_pointwise(n, cg.info[n], names.__getitem__, dtypes)
        if checks:
            raise ValueError(f"attention score chain: {n.name} needs a check eager makes ({checks[0].message})")
        names[n] = f"c{i}"
        dtypes[f"c{i}"] = dt
        lines.append(f"c{i} = {expr}")
    last = names[chain[-1]] if chain else "s"
    if dtypes[last] != torch.float32:
        last = f"{last}.to(tl.float32)"
    lines.append(f"s = {last}")
    text = "\n".join(lines)
    used = tuple(ops.helpers_for(text))
    return ScoreMod(tuple(lines), n_extra=len(extras), helpers=used, causal=causal_offset is not None,
                    causal_offset=causal_offset or 0)

