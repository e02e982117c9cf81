"""Small helpers the tests share."""
import torch


def fused_ops(report) -> set:
    """Short ATen op names (e.g. 'add', 'var_mean') inside fused regions."""
    return {o.replace("aten.", "").split(".")[0] for r in report.regions for o in r.ops}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
