"""Matmuls with an unaligned output width computed over a padded right operand (fuser/padding.py):
eager's values, the operand copied in its own memory order, and only where the rule says so."""
import pytest
import torch
import torch.nn as nn

import fuser
from fuser import padding
from tolerances import assert_close_to_eager


class TiedHead(nn.Module):
    """An LM head over a tied embedding (a transposed, column-major weight) and a Linear with a
    bias, both 37 columns wide: unaligned for every dtype."""

    def __init__(self, vocab=37, d=16):
        super().__init__()
        self.emb, self.ln, self.lin = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        return (h @ self.emb.weight.t()).softmax(-1), torch.tanh(self.lin(h))


@pytest.fixture
def pad_everywhere(monkeypatch):
    """The rule at test sizes, on the test device (on CPU through the interpreter)."""
    monkeypatch.setattr(padding, "DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(padding, "MIN_ROWS", 4)
    monkeypatch.setattr(padding, "MIN_FLOPS", 1)


def test_unaligned_matmuls_are_padded_and_give_eagers_values(device, pad_everywhere):
    torch.manual_seed(0)
    m = TiedHead().to(device)
    ids = torch.randint(0, 37, (3, 11), device=device)
    with torch.no_grad():
        fused = fuser.fuse(m)
        assert_close_to_eager(fused(ids), m(ids))
        assert_close_to_eager(fused(ids.flip(0)), m(ids.flip(0)))
    notes = [n for n in fused.report.notes if "padded" in n]
    assert notes and "40 columns wide" in notes[0], fused.report.notes
    assert fused.code.count("padded_columns(") == 3, fused.code  # the weight, the Linear's weight and bias
    assert len(fused.report.regions) >= 2  # the readers of the padded products still fuse


def test_aligned_or_small_matmuls_are_left_alone(device):
    m = TiedHead(vocab=40).to(device)  # 40 columns: aligned in fp32; and at default thresholds
    with torch.no_grad():
        fused = fuser.fuse(m)
        fused(torch.randint(0, 40, (3, 11), device=device))
    assert not any("padded" in n for n in fused.report.notes)
    assert "padded_columns" not in fused.code


@pytest.mark.parametrize("make", [
    lambda d: torch.randn(16, 37, device=d),                 # row-major
    lambda d: torch.randn(37, 16, device=d).t(),             # column-major (a transposed weight)
    lambda d: torch.randn(37, device=d),                     # a bias
    lambda d: torch.randn(3, 37, 16, device=d).transpose(1, 2),  # batched, column-major
], ids=["row-major", "column-major", "bias", "batched"])
def test_padded_columns_keeps_values_and_memory_order(make, device):
    b = make(device)
    p = padding.padded_columns(b, 40)
    assert p.shape == (*b.shape[:-1], 40)
    torch.testing.assert_close(p[..., :37], b, rtol=0, atol=0)
    if b.dim() >= 2:  # the same dimension is the fastest-moving one
        assert (p.stride(-1) == 1) == (b.stride(-1) == 1)
