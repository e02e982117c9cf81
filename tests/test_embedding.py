"""An embedding's gradient by our kernels (fuser/embedding.py), the one-hot kernel (small tables) and the
scattered rows (large ones), against an fp64 reference and eager: odd shapes, a padding index, repeated
indices, int32 indices, a non-contiguous gradient, indices split across programs, a table narrower than a
tile; in a model, the graph calls each where the cost model says (and the report says so) and the
parameters' gradients match eager's; deterministic mode keeps large tables with eager."""
import contextlib
import copy
import os

import pytest
import torch
import torch.nn as nn

import fuser
from fuser import runtime
from fuser.embedding import embedding_dense_backward, embedding_dense_backward_added, embedding_dense_backward_scattered
from tolerances import tol

aten = torch.ops.aten


KERNELS = {"one-hot": embedding_dense_backward, "scattered": embedding_dense_backward_scattered}
_CUDA = os.environ.get("FUSER_TEST_DEVICE") == "cuda" and torch.cuda.is_available()  # conftest's device


def _dtypes(device, kernel="one-hot"):
    # the interpreter's tl.dot is wrong in bf16: the one-hot kernel's bf16 is tested on the GPU only (and
    # never taken on CPU); the scatter has no tl.dot
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" or kernel == "scattered" else [])


def _reference(grad, idx, v, padding_idx):
    return aten.embedding_dense_backward(grad.double(), idx, v, padding_idx, False)


# (index shape, table rows, width, padding_idx): odd sizes; a padded row; T5's relative bias (many indices
# into few buckets, 8 heads: the indices split across programs, the width under a tile); one row
CASES = [((3, 423), 213, 37, -1), ((5, 61), 512, 64, 0), ((256, 256), 32, 8, -1), ((7,), 1, 16, -1),
         ((2, 9), 70, 130, 69)]


def _cases(kernel):
    """CASES for `kernel`.  The scatter runs a program per 32 indices whatever the table, so on CPU T5's 65536
    indices only repeat its programs (2048 of each kernel: half a minute a dtype in the interpreter); 61 x 67
    indices still put ~128 into each of the 32 buckets (a slot many atomics add into) and end in a partial
    program.  The GPU keeps T5's size (its atomics do race)."""
    if kernel != "scattered" or _CUDA:
        return CASES
    return [((61, 67),) + c[1:] if c[0] == (256, 256) else c for c in CASES]


@pytest.mark.parametrize("dtype_index", [0, 1, 2])
@pytest.mark.parametrize("kernel, case", [(k, c) for k in KERNELS for c in _cases(k)],
                         ids=lambda c: c if isinstance(c, str) else f"{c[0]}-{c[1]}x{c[2]}-pad{c[3]}")
def test_matches_the_reference(device, case, dtype_index, kernel):
    dtypes = _dtypes(device, kernel)
    if dtype_index >= len(dtypes):
        pytest.skip("bf16 on the GPU only")
    dtype = dtypes[dtype_index]
    shape, v, d, padding_idx = case
    torch.manual_seed(0)
    idx = torch.randint(0, v, shape, device=device)
    if padding_idx >= 0:
        idx.view(-1)[::5] = padding_idx  # some rows are the padding index: they count for none
    grad = torch.randn(*shape, d, device=device, dtype=dtype)
    got = KERNELS[kernel](grad, idx, v, padding_idx, False)
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


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_int32_indices_and_a_strided_gradient(device, kernel):
    torch.manual_seed(0)
    idx = torch.randint(0, 300, (4, 33), device=device, dtype=torch.int32)
    grad = torch.randn(4, 90, 33, device=device).transpose(1, 2)[:, :, ::2]  # [4, 33, 45], not contiguous
    got = KERNELS[kernel](grad, idx, 300, -1, False)
    torch.testing.assert_close(got, _reference(grad, idx.long(), 300, -1).float(), **tol(torch.float32))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_no_indices_gives_zeros(device, kernel):
    grad = torch.randn(0, 24, device=device)
    got = KERNELS[kernel](grad, torch.zeros(0, dtype=torch.long, device=device), 50, -1, False)
    assert got.shape == (50, 24) and (got == 0).all()


def test_a_bound_sequence_serves_only_aligned_gradients(device):
    """From the second call on at the same sizes, the scatter's launches go straight to the compiled kernels
    (runtime.launch_sequence); a gradient 4 bytes past 16-byte alignment goes back through the launchers (a
    kernel compiled for aligned pointers, which loads rows of 32 floats 16 bytes at a time, must not run on it)."""
    torch.manual_seed(0)
    v, d = 5001, 32
    idx = torch.randint(0, v, (3, 50), device=device)
    base = torch.randn(3 * 50 * d + 1, device=device)
    aligned, odd = base[:-1].view(3, 50, d), base[1:].view(3, 50, d)
    runtime._sequences.clear()
    for g in (aligned, aligned, odd, aligned):
        torch.testing.assert_close(embedding_dense_backward_scattered(g, idx, v, -1, False),
                                   _reference(g, idx, v, -1).float(), **tol(torch.float32, 2.0))
    assert len(runtime._sequences) == (1 if device == "cuda" else 0)  # bound on the GPU only


def test_a_scattered_table_is_written_once_whole(device):
    """Every row of the table is written: rows no index names are zero even where the buffer held other
    values (the scatter zeroes the table itself), a row named many times holds the sum of all its rows, and
    a row named only by the padding index stays zero."""
    torch.manual_seed(0)
    v, d = 5003, 19
    idx = torch.cat([torch.full((300,), 7), torch.randint(0, v, (211,)), torch.full((40,), 11)]).to(device)
    grad = torch.randn(idx.numel(), d, device=device)
    got = embedding_dense_backward_scattered(grad, idx, v, 11, False)
    want = _reference(grad, idx, v, 11)
    torch.testing.assert_close(got, want.float(), **tol(torch.float32, 17.0))  # row 7 sums 300 rows
    assert (got[11] == 0).all() and got[7].abs().sum() > 0
    named = torch.zeros(v, dtype=torch.bool, device=device)
    named[idx] = True
    named[11] = False
    assert (got[~named] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_added_to_another_table(device, dtype):
    """`other += the gradient`, in place, rounded once: rows no index names (and the padding index's) keep
    other's values; a non-contiguous `other` goes through eager's add."""
    torch.manual_seed(0)
    v, d = 4099, 33
    idx = torch.randint(0, v, (7, 61), device=device)
    idx[:, ::6] = 5
    grad = torch.randn(7, 61, d, device=device, dtype=dtype)
    other = torch.randn(v, d, device=device, dtype=dtype)
    want = (other.double() + _reference(grad, idx, v, 5)).to(dtype)
    got = embedding_dense_backward_added(other.clone(), grad, idx, v, 5, False)
    torch.testing.assert_close(got, want, **tol(dtype, 4.0))
    assert torch.equal(got[5], other[5])
    wide = torch.randn(d, v, device=device, dtype=dtype).t()  # [v, d], not contiguous
    torch.testing.assert_close(embedding_dense_backward_added(wide.clone(), grad, idx, v, 5, False),
                               (wide.double() + _reference(grad, idx, v, 5)).to(dtype), **tol(dtype, 4.0))


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


def _grads_and_notes(model, *inputs):
    model.zero_grad()
    twin = copy.deepcopy(model)
    before = len(fuser.reports())
    fuser.fuse(model)(*inputs).backward()
    twin(*inputs).backward()
    for (k, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(torch.float32, 4.0), msg=k)
    return [n for r in fuser.reports()[before:] for n in r.notes if n.startswith("embedding gradients as our kernel")]


def test_a_large_tables_rows_are_scattered(device):
    """A vocabulary past the one-hot kernel's tables: its gradient's rows are scattered (the report says so),
    repeated token ids included; under torch.use_deterministic_algorithms it stays with eager's kernels."""
    torch.manual_seed(0)
    model = _Positions(words=9001).to(device)
    ids = torch.randint(0, 9001, (3, 117), device=device)
    ids[:, ::3] = 42  # a token repeated through every row
    types = torch.randint(0, 2, (3, 117), device=device)
    notes = _grads_and_notes(model, ids, types)
    assert notes and "[9001, 48] table's gradient over 351 indices, rows scattered" in notes[0], notes
    assert "[128, 48] table's gradient over 117 indices, one-hot" in notes[0], notes

    torch._dynamo.reset()
    with _deterministic():
        notes = _grads_and_notes(model, ids, types)
    assert notes and "[9001, 48]" not in notes[0] and "[128, 48]" in notes[0], notes


@contextlib.contextmanager
def _deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_scaled_by_frequency_stays_eager_and_bf16_on_cpu_is_scattered():
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

    bf16 = nn.Embedding(40, 16).to(torch.bfloat16)  # on CPU not the one-hot kernel (tl.dot), the scatter
    twin = copy.deepcopy(bf16)
    before = len(fuser.reports())
    fuser.fuse(bf16)(ids).float().square().mean().backward()
    twin(ids).float().square().mean().backward()
    reports = fuser.reports()[before:]
    notes = [n for r in reports for n in r.notes if n.startswith("embedding gradients as our kernel")]
    assert len(notes) == 1 and "rows scattered" in notes[0] and "one-hot" not in notes[0], notes
    torch.testing.assert_close(bf16.weight.grad, twin.weight.grad, **tol(torch.bfloat16))


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


class _TiedLM(nn.Module):
    """A language model's ends with the output layer's weight the embedding's (GPT-2's tied weights): the table's
    gradient is the sum of both uses'.  With cross-entropy, fuser's linear + cross-entropy op takes the head and
    its weight gradient is scaled in a fused region the add joins; with another loss it is a matmul's result."""

    def __init__(self, cross_entropy: bool, words=6007, d=40):
        super().__init__()
        self.cross_entropy = cross_entropy
        self.words, self.mix = nn.Embedding(words, d, padding_idx=3), nn.Linear(d, d)

    def forward(self, ids):
        logits = torch.tanh(self.mix(self.words(ids))) @ self.words.weight.t()
        if self.cross_entropy:
            return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return logits.square().mean()


@pytest.mark.parametrize("cross_entropy", [False, True], ids=["matmul", "cross-entropy"])
def test_a_tied_tables_rows_are_added_to_the_output_layers_gradient(device, cross_entropy):
    """The scattered rows go straight into the output layer's gradient (no table of zeros, no add), repeated
    and padding ids included; the gradient matches eager's."""
    torch.manual_seed(0)
    model = _TiedLM(cross_entropy).to(device)
    # 46 indices (was 90: the scatter is taken for the table's size, whatever the count, and the cross-entropy
    # case's linear + cross-entropy runs a row at a time over the 6007 classes in the interpreter)
    ids = torch.randint(0, 6007, (2, 23), device=device)
    ids[:, ::4] = 17  # repeated
    ids[1, 1::5] = 3  # the padding id: its rows count for none
    before = len(fuser.reports())
    notes = _grads_and_notes(model, ids)
    assert notes and "[6007, 40] table's gradient over 46 indices, rows scattered" in notes[0], notes
    assert "its rows added into" in notes[0], notes
    code = "".join(c for r in fuser.reports()[before:] for c in r.code)
    assert "embedding_dense_backward_added" in code and "embedding_dense_backward_scattered" not in code


def test_rows_are_not_added_after_their_inputs_are_written_over(device):
    """The add comes after an op that writes over the gradient's input in place (the last reader of a kernel's
    buffer): the gradient is computed where the graph computes it, not moved to the add (review reproducer)."""
    v, d, n = 5000, 48, 351

    def f(x, ids, w, a, b):
        grad = torch.tanh(x) * 2
        g = aten.embedding_dense_backward(grad, ids, v, -1, False)
        y = grad * (grad @ w)  # the last reader of grad: written over it
        return a @ b + g, y

    torch.manual_seed(0)
    args = (torch.randn(n, d, device=device), torch.randint(0, v, (n,), device=device), torch.randn(d, d, device=device),
            torch.randn(v, 8, device=device), torch.randn(8, d, device=device))
    before = len(fuser.reports())
    got, want = fuser.fuse(f)(*args), f(*args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **tol(torch.float32, 4.0))
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert any("rows scattered" in n and "its rows added into" in n for n in notes), notes


def test_rows_added_into_a_view_return_a_tensor_of_its_own(device):
    """The tensor added to is a view of a wider matmul result: the rows go into its memory, and the result is
    returned as the add's would be, not a view (so the caller may write it in place under autograd) (review
    reproducer)."""
    v, d, n = 5000, 16, 200

    def f(grad, ids, a, b):
        return (a @ b).view(v, d) + aten.embedding_dense_backward(grad, ids, v, -1, False)

    torch.manual_seed(0)
    args = (torch.randn(n, d, device=device), torch.randint(0, v, (n,), device=device),
            torch.randn(2 * v, 8, device=device), torch.randn(8, 8, device=device, requires_grad=True))
    before = len(fuser.reports())
    got, want = fuser.fuse(f)(*args), f(*args)
    assert any("its rows added into" in n for r in fuser.reports()[before:] for n in r.notes)
    assert not got._is_view()
    torch.testing.assert_close(got.detach().mul_(2), want.detach() * 2, **tol(torch.float32, 4.0))
    got.mul_(2)  # in place on the compiled function's output: allowed, as on eager's


def test_rows_are_not_added_into_a_tensor_read_elsewhere(device):
    """The tensor the gradient is added to is read again after the add (or is an input): its memory is not the
    add's to write, so the table is made as eager makes it and added."""
    v, d, n = 5000, 16, 100

    def f(grad, ids, a, b, c):
        other = a @ b
        return other + aten.embedding_dense_backward(grad, ids, v, -1, False), other.sum(0), \
            c + aten.embedding_dense_backward(grad * 2, ids, v, -1, False)

    torch.manual_seed(0)
    args = (torch.randn(n, d, device=device), torch.randint(0, v, (n,), device=device), torch.randn(v, 8, device=device),
            torch.randn(8, d, device=device), torch.randn(v, d, device=device))
    c = args[-1].clone()
    before = len(fuser.reports())
    got, want = fuser.fuse(f)(*args), f(*args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **tol(torch.float32, 4.0))
    assert torch.equal(args[-1], c)  # the input added to is not written
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert any("rows scattered" in n for n in notes) and not any("rows added into" in n for n in notes), notes
