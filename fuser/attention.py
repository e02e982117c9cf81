"""The attention op family on its own: its kernels' sources (codegen/attention.py, forward;
codegen/attention_bwd.py, backward) launched by the runtime, through the custom op that training
graphs call (`fuser::flash_attention`, fuser/attention_op.py), whose gradient is the backward kernels.
This is the direct call, for tests, benchmarks and users of the kernel alone."""
from __future__ import annotations

import torch

from fuser.codegen.attention import ScoreMod

from .dropout import new_seed
from .attention_op import flash_attention_op, register_mod


def flash_attention(q, k, v, *, scale: float, mod: ScoreMod = ScoreMod(()), extras: tuple = (), return_lse: bool = False,
                    dropout: float = 0.0, seed: torch.Tensor | None = None):
    """``dropout(softmax(mod(q @ k^T * scale))) @ v`` in one kernel; returns ``out`` or ``(out, lse)``.

    q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] with Hq % Hkv == 0; any strides.  ``extras`` are broadcastable to
    [B, Hq, M, N] and read in place.  Out: q's dtype, [B, Hq, M, D] in q's layout where q is dense (SDPA's
    rule), else contiguous; lse: fp32 [B, Hq, M].
    Differentiable in q, k and v (the backward kernels recompute the scores; the mod's `grad` lines
    give the score chain's derivative); an extra gets a gradient where the mod's `bias_grads` gives its
    derivative, and any other that asks for one is an error, not a silent zero.  `dropout`: fuser::dropout's mask on the probabilities (fuser/dropout.py)
    from `seed` (a 0-d int64 tensor on q's device; None draws one), drawn again in the backward.
    """
    learned = {i for i, _ in mod.bias_grads}  # the extras whose derivative the mod gives (a learned bias)
    if torch.is_grad_enabled() and any(isinstance(e, torch.Tensor) and e.requires_grad and i not in learned
                                       for i, e in enumerate(extras)):
        raise NotImplementedError("flash_attention: no gradient for the score mod's extra tensors that its "
                                  "bias_grads does not name")
    if dropout and seed is None:
        seed = new_seed(q.device)
    out, stats = flash_attention_op(q, k, v, list(extras), float(scale), register_mod(mod), float(dropout),
                                    [seed] if dropout else [], -1, [], False, [])
    return (out, stats[0] + stats[1]) if return_lse else out  # the row maximum plus the log of the row's sum
