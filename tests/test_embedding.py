"""An embedding's gradient over a small table by our one-hot kernel (fuser/embedding.py), against an fp64
reference and eager: odd shapes, a padding index, int32 indices, a non-contiguous gradient, indices split
across programs, a table narrower than a tile; in a model, the graph calls it (and says so) and the
parameters' gradients match eager's."""
import copy

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.embedding import embedding_dense_backward
from tolerances import tol

aten = torch.ops.aten


def _dtypes(device):
    # the interpreter's tl.dot is wrong in bf16: bf16 is tested on the GPU only (and never taken on CPU)
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def _reference(grad, idx, v, padding_idx):
    return aten.embedding_dense_backward(grad.double(), idx, v, padding_idx, False)


# (index shape, table rows, width, padding_idx): odd sizes; a padded row; T5's relative bias (many indices
# into few buckets, 8 heads: the indices split across programs, the width under a tile); one row
CASES = [((3, 423), 213, 37, -1), ((5, 61), 512, 64, 0), ((256, 256), 32, 8, -1), ((7,), 1, 16, -1),
         ((2, 9), 70, 130, 69)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-pad{c[3]}")
@pytest.mark.parametrize("dtype_index", [0, 1, 2])
def test_matches_the_reference(device, case, dtype_index):
    dtypes = _dtypes(device)
    if dtype_index >= len(dtypes):
        pytest.skip("bf16 on the GPU only")
    dtype = dtypes[dtype_index]
    shape, v, d, padding_idx = case
    torch.manual_seed(0)
    idx = torch.randint(0, v, shape, device=device)
    if padding_idx >= 0:
        idx.view(-1)[::5] = padding_idx  # some rows are the padding index: they count for none
    grad = torch.randn(*shape, d, device=device, dtype=dtype)
    got = embedding_dense_backward(grad, idx, v, padding_idx, False)
    want = _reference(grad, idx, v, padding_idx)
    assert got.dtype == dtype and got.shape == (v, d)
    # an fp32 row sums ~N / V terms of size ~1: its rounding grows as sqrt(N / V) eps of them (a 16-bit
    # result's own rounding is far larger)
    scale = max(1.0, (idx.numel() / v) ** 0.5) if dtype == torch.float32 else 1.0
    torch.testing.assert_close(got, want.to(dtype), **tol(dtype, scale))
    if dtype == torch.float32:  # eager's 16-bit kernels on CPU sum in the 16-bit dtype: the fp64 reference judges those
        torch.testing.assert_close(got, aten.embedding_dense_backward(grad, idx, v, padding_idx, False),
                                   **tol(dtype, 2.0 * scale))
    if padding_idx >= 0:
        assert (got[padding_idx] == 0).all()


def test_int32_indices_and_a_strided_gradient(device):
    torch.manual_seed(0)
    idx = torch.randint(0, 300, (4, 33), device=device, dtype=torch.int32)
    grad = torch.randn(4, 90, 33, device=device).transpose(1, 2)[:, :, ::2]  # [4, 33, 45], not contiguous
    got = embedding_dense_backward(grad, idx, 300, -1, False)
    torch.testing.assert_close(got, _reference(grad, idx.long(), 300, -1).float(), **tol(torch.float32))


def test_no_indices_gives_zeros(device):
    grad = torch.randn(0, 24, device=device)
    got = embedding_dense_backward(grad, torch.zeros(0, dtype=torch.long, device=device), 50, -1, False)
    assert got.shape == (50, 24) and (got == 0).all()


class _Positions(nn.Module):
    """Word, position and token-type embeddings summed, as BERT's embeddings are, then a projection."""

    def __init__(self, words=3001, positions=128, d=48):
        super().__init__()
        self.words, self.positions, self.types = nn.Embedding(words, d), nn.Embedding(positions, d), nn.Embedding(2, d)
        self.proj = nn.Linear(d, d)

    def forward(self, ids, types):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.proj(self.words(ids) + self.positions(pos)[None] + self.types(types)).square().mean()


def test_a_model_calls_it_for_its_small_tables(device):
    torch.manual_seed(0)
    model = _Positions().to(device)
    ids = torch.randint(0, 3001, (3, 117), device=device)
    types = torch.randint(0, 2, (3, 117), device=device)
    before = len(fuser.reports())
    fuser.fuse(model)(ids, types).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model(ids, types).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, **tol(torch.float32), msg=k)
    backward = [r for r in fuser.reports()[before:] if any("backward graph" in n for n in r.notes)]
    notes = [n for r in backward for n in r.notes if n.startswith("embedding gradients as our kernel")]
    assert notes and "[128, 48]" in notes[0] and "[2, 48]" in notes[0], [r.notes for r in backward]
    assert "embedding_dense_backward" in "".join(r.code[0] for r in backward)  # called by name, ours
    assert not [u for r in backward for u in r.unfused if "[128" in u.node], backward


def test_bf16_on_cpu_and_scaled_by_frequency_stay_eager():
    torch.manual_seed(0)
    model = nn.Embedding(40, 16, scale_grad_by_freq=True)
    ids = torch.randint(0, 40, (2, 30))
    before = len(fuser.reports())
    fuser.fuse(model)(ids).square().mean().backward()
    got = model.weight.grad.clone()
    model.zero_grad()
    model(ids).square().mean().backward()
    torch.testing.assert_close(got, model.weight.grad, **tol(torch.float32))
    reports = fuser.reports()[before:]
    assert not [n for r in reports for n in r.notes if n.startswith("embedding gradients as our kernel")]
    assert [u for r in reports for u in r.unfused if "embedding_dense_backward" in u.op]

    bf16 = nn.Embedding(40, 16).to(torch.bfloat16)
    before = len(fuser.reports())
    fuser.fuse(bf16)(ids).float().square().mean().backward()
    reports = fuser.reports()[before:]
    assert not [n for r in reports for n in r.notes if n.startswith("embedding gradients as our kernel")]


def test_an_empty_tables_gradient_needs_no_kernel(device):
    """A table of width 0: its gradient is an empty tensor, made without a kernel (eager's CUDA kernel
    reads past such a table: an illegal memory access), and the rest of the graph is still fused."""
    torch.manual_seed(0)
    assert embedding_dense_backward(torch.randn(3, 0, device=device), torch.zeros(3, dtype=torch.long, device=device),
                                    10, -1, False).shape == (10, 0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.empty, self.proj = nn.Embedding(10, 0), nn.Linear(8, 8)

        def forward(self, ids, x):
            return nn.functional.gelu(self.proj(x)).sum() + self.empty(ids).sum()

    model = Model()
    twin = copy.deepcopy(model)  # eager on CPU: on CUDA its embedding gradient faults
    ids, x = torch.randint(0, 10, (4,)), torch.randn(4, 8)
    before = len(fuser.reports())
    fuser.fuse(model.to(device))(ids.to(device), x.to(device)).backward()
    twin(ids, x).backward()
    reports = fuser.reports()[before:]
    assert not [r.fallback for r in reports if r.fallback], [r.fallback for r in reports]
    assert any(r.regions for r in reports if any("backward graph" in n for n in r.notes))
    assert any("an empty [10, 0] table's gradient" in n for r in reports for n in r.notes), [r.notes for r in reports]
    assert model.empty.weight.grad.shape == (10, 0)
    for p, q in zip(model.proj.parameters(), twin.proj.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, **tol(torch.float32))
