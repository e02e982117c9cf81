"""Column sums (a weight's or bias's gradient) split into partial sums (fuser/split.py), and column
reductions tiled along memory (plan.block_plan): eager's values, and the split only where the rule says."""
import pytest
import torch
import torch.nn as nn

import fuser
from fuser import split
from fuser.plan import block_plan
from tolerances import assert_close_to_eager, tol


@pytest.fixture
def split_everywhere(monkeypatch):
    """The rule on the test device too (on CPU through the interpreter)."""
    monkeypatch.setattr(split, "DEVICES", ("cpu", "cuda"))


def _prologue_sums(x, w, b):
    """A bias gradient over two leading dims with a prologue; a keepdim sum cast by the program."""
    return (x * w + b).sum((0, 1)), (x * x).sum(0, keepdim=True).to(torch.float32) * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 423, 213), (2, 1536, 40)])
def test_column_sums_split_match_fp64(device, split_everywhere, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype)
    w, b = torch.randn(shape[-1], device=device, dtype=dtype), torch.randn(shape[-1], device=device, dtype=dtype)
    fused = fuser.fuse(_prologue_sums)
    got = fused(x, w, b)
    want = _prologue_sums(x.double(), w.double(), b.double())
    for g, r in zip(got, want):  # eager rounds y to the dtype before summing; the kernel, once at the end
        assert g.dtype == (dtype if g is got[0] else torch.float32)
        torch.testing.assert_close(g.double(), r.double(), **tol(dtype, scale=4))
    notes = [n for n in fused.report.notes if "column sums split" in n]
    assert notes and f"over {shape[0] * shape[1]} rows in" in notes[0], fused.report.notes
    # the prologue fused into the partial sums: a reduction region reading x, writing [parts, D]
    partial = [r for r in fused.report.regions if r.kind == "reduction" and "aten.mul.Tensor" in r.ops]
    assert partial and any(s.endswith(f", {shape[-1]}] float32") for r in partial for s in r.output_shapes), \
        fused.report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_column_sum_runs_as_our_kernels(device, split_everywhere, dtype):
    """A bias gradient alone (no prologue to fuse): split, its partial sums run as our kernel even
    though the cost model would leave a lone op to eager (eager's column sum is the slower one)."""
    torch.manual_seed(3)
    g = torch.randn(2048, 96, device=device, dtype=dtype)
    fused = fuser.fuse(lambda g: g.sum(0))
    got = fused(g)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), g.double().sum(0), **tol(dtype, scale=4))
    assert any("column sums split" in n for n in fused.report.notes), fused.report.notes
    assert [r.output_shapes for r in fused.report.regions][0] == ["[16, 96] float32"], fused.report
    assert not fused.report.unfused, fused.report.unfused


def test_rows_without_a_divisor_stay_one_sum(device, split_everywhere):
    """2053 rows (a prime): no split; a transposed input: no split; a sum over the last dim: a row
    reduction already.  All still eager's values."""
    torch.manual_seed(1)
    x = torch.randn(2053, 70, device=device)
    t = torch.randn(70, 2048, device=device).t()

    def f(x, t):
        return (x * 2).sum(0), (t + 1).sum(0), (x - 1).sum(-1)
    fused = fuser.fuse(f)
    assert_close_to_eager(fused(x, t), f(x, t), scale=4)
    assert not any("column sums split" in n for n in fused.report.notes), fused.report.notes


def test_norm_weight_gradients_split_in_training(device, split_everywhere):
    """LayerNorm's weight and bias gradients and a Linear's bias gradient (column sums over 2048 tokens
    in the backward graph) are split, and every gradient matches eager's."""
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.LayerNorm(40)).to(device)
    ref = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.LayerNorm(40)).to(device)
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():  # a LayerNorm weight and bias other than 1 and 0
        for p in (m[2].weight, m[2].bias):
            p.normal_()
        ref.load_state_dict(m.state_dict())
    x = torch.randn(8, 256, 48, device=device)
    compiled = torch.compile(m, backend="fuser")
    (compiled(x) ** 2).mean().backward()
    (ref(x) ** 2).mean().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(torch.float32, scale=10), msg=name)
    backward = [r for r in fuser.reports() if any("backward" in n for n in r.notes)]
    assert any("column sums split" in n for r in backward for n in r.notes), [r.notes for r in backward]


def test_column_plan_tiles_along_memory():
    """Past 64 reduced rows a column reduction runs 64 columns x 64 rows tiles, looped; a row
    reduction keeps the whole row of one row a program."""
    plan = block_plan(2048, 8192, "cuda", column=True)
    assert (plan.xblock, plan.rblock, plan.programs, plan.persistent) == (64, 64, 32, False)
    assert block_plan(2048, 32, "cuda", column=True).persistent  # few rows: held in registers
    row = block_plan(2048, 8192, "cuda")
    assert (row.xblock, row.persistent) == (1, True)


@pytest.mark.parametrize("op", ["mean", "sum", "mean_keepdim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_whole_tensor_sum_of_a_prologue_is_split_and_fused(device, split_everywhere, dtype, op):
    """A loss over a whole output (`out.float().square().mean()`): the cast and square fused into the
    partial sums (no fp32 copy written), the parts summed and divided in a second kernel; eager's value,
    NaN and Inf carried.  A whole sum of an input (no prologue) stays eager's one reduction."""
    torch.manual_seed(4)
    x = torch.randn(3, 423, 213, device=device, dtype=dtype)
    x[1, 7, 9] = float("inf") if op == "sum" else x[1, 7, 9]
    loss = {"mean": lambda x: x.float().square().mean(), "sum": lambda x: (x * 0.5 - 1).sum(),
            "mean_keepdim": lambda x: torch.tanh(x).mean((0, 1, 2), keepdim=True)}[op]
    fused = fuser.fuse(loss)
    got, want = fused(x), loss(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), loss(x.double()).to(want.dtype).double(), **tol(dtype, scale=4))
    assert any("whole-tensor sums split" in n for n in fused.report.notes), fused.report.notes
    assert len(fused.report.regions) == 2 and not fused.report.unfused, fused.report
    assert not any(s.startswith("[3, 423, 213]") for r in fused.report.regions for s in r.output_shapes), fused.report
    plain = fuser.fuse(lambda x: x.sum())
    torch.testing.assert_close(plain(x).double(), x.double().sum().to(dtype).double(), **tol(dtype, scale=4))
    assert not any("whole-tensor" in n for n in plain.report.notes)


def test_a_whole_sum_with_a_narrower_dtype_stays_eagers(device, split_everywhere):
    """sum(dtype=float16) of fp32 values casts each element first (70000 is inf in fp16, inf - inf NaN): not split
    into fp32 parts, which would give the finite total."""
    x = torch.randn(3, 423, 213, device=device)
    x[0, 0, 0], x[0, 0, 1] = 70000.0, -70000.0
    fn = lambda x: (x * 1.5).sum(dtype=torch.float16)  # noqa: E731
    fused = fuser.fuse(fn)
    got, want = fused(x), fn(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert not any("whole-tensor" in n for n in fused.report.notes)
