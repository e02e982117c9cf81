"""The attention op family on its own: its kernel's source (codegen/attention.py) launched by the
runtime.  The pipeline builds the same pair for each recognised attention; this is the direct call,
for tests, benchmarks and users of the kernel alone."""
from __future__ import annotations

from fuser.codegen.attention import ScoreMod, attention_source, prepare

from .dtypes import target
from .runtime import run_attention


def flash_attention(q, k, v, *, scale: float, mod: ScoreMod = ScoreMod(()), extras: tuple = (), return_lse: bool = False):
    """``softmax(mod(q @ k^T * scale)) @ v`` in one kernel; returns ``out`` or ``(out, lse)``.

    q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] with Hq % Hkv == 0; any strides.  ``extras`` are broadcastable to
    [B, Hq, M, N] and read in place.  Out: q's dtype, contiguous [B, Hq, M, D]; lse: fp32 [B, Hq, M].
    """
    with target(q.device.type):
        source = attention_source(mod, q.shape[-1], q.dtype)
    out, lse = run_attention(source, prepare, q, k, v, tuple(extras), mod=mod, scale=scale, return_lse=return_lse)
    return (out, lse) if return_lse else out
