"""Rows longer than registers hold: the looped kernels, with the max and the sum of exp in one pass
and the target logit gathered without a pass of its own, over 140 rows (a program per SM); and the norms
over fewer rows than processors, one kernel all the same (Partitioner.absorb_whole)."""
import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

import fuser
from fuser.decompositions import decompositions
from fuser.ops import reduction_dims
from fuser.partition import Partitioner
from tolerances import assert_close_to_eager

R = 20000


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp", "cross_entropy"])
def test_looped_rows(name, device):
    torch.manual_seed(0)
    x = torch.randn(140, R, device=device) * 3
    x[3, 7] = float("-inf")
    target = torch.randint(0, R, (140,), device=device)
    target[5] = -100  # ignore_index
    fns = {"softmax": lambda x, t: torch.softmax(x, -1), "log_softmax": lambda x, t: torch.log_softmax(x, -1),
           "logsumexp": lambda x, t: torch.logsumexp(x, -1), "cross_entropy": lambda x, t: F.cross_entropy(x, t)}
    fn = fns[name]
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x, target), fn(x, target), atol=1e-5, rtol=1e-5)
    (big,) = [r for r in fused.report.regions if any("amax" in o for o in r.ops)]
    assert "looped over the row" in big.source
    assert big.source.count("for roffset in range") <= 2  # online max+sum pass (+ the write pass)


@pytest.mark.parametrize("shape", [(4, 32000), (1, 3, 50257)])
def test_softmax_over_few_long_rows_stays_eagers_op_on_the_gpu(shape, device):
    """Fewer rows than the GPU's processors, each longer than a program holds (a decode step's softmax over the
    vocabulary): eager's softmax kernel, whole, with the reason in the report (the cost model had split the
    decomposition into pieces, some eager: slower than eager, bench/few_rows.py)."""
    if device != "cuda":
        pytest.skip("a GPU rule: on CPU the decomposition always runs")
    x = torch.randn(shape, device=device)
    fn = lambda x: (torch.softmax(x / 0.7, -1), torch.log_softmax(x, -1))  # noqa: E731
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x), fn(x))
    kept = {u.op: u.reason for u in fused.report.unfused}
    assert "aten._softmax.default" in kept and "aten._log_softmax.default" in kept, fused.report
    assert "processors" in kept["aten._softmax.default"]


# Norms over fewer rows than the GPU's processors, each longer than a program holds (a decode step's norm over a
# vocabulary-sized row): pair by pair, the cost model's merges split them into pieces and eager reductions (each
# merge charged the few programs); Partitioner.absorb_whole weighs the whole group, host time counted, and keeps
# one kernel a program a row (bench/few_rows.py, H200 runs 218-219: layer_norm [1, 128256] 0.045 ms one kernel,
# 0.07-0.13 split, eager 0.24).
def layer_norm(x, w):
    return F.layer_norm(x, x.shape[-1:], w, w)


def rms_norm(x, w):  # as Hugging Face's LlamaRMSNorm
    return (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rms_norm_by_hand(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


NORMS = {"layer_norm": layer_norm, "rms_norm": rms_norm, "rms_norm_by_hand": rms_norm_by_hand,
         "softmax": lambda x, w: torch.softmax(x / 0.7, -1) * w,
         "log_softmax": lambda x, w: torch.log_softmax(x.float(), -1) * w}
FEW_LONG_ROWS = [(1, 128256), (8, 50257), (64, 128256)]


def _traced(fn, shape, device="cpu", backward=False, launch_host=True):
    """The graphs fuser partitions for fn over bf16 fake tensors of `shape` (forward, and backward by AOT's
    split; no kernel runs): [(graph, regions, unfused)]."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, w = (torch.empty(s, dtype=torch.bfloat16, device=device, requires_grad=backward)
                for s in (shape, shape[-1:]))
        f = aot_function(fn, fw_compiler=keep, bw_compiler=keep, decompositions=decompositions())
        y = f(x, w)
        if backward:
            y.backward(torch.empty_like(y))
    out = []
    for gm in graphs:
        part = Partitioner(gm.graph, launch_host=launch_host)
        regions = part.partition()
        out.append((gm, regions, [str(n.target) for n, _ in part.unfused(regions)]))
    return out


ROW_REDUCTIONS = (torch.ops.aten.amax.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim,
                  torch.ops.aten.var_mean.correction)


def _row_reductions(gm) -> list:
    """The reductions over the last dim of a 2-D graph."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ROW_REDUCTIONS
            and reduction_dims(n) == (1,)]


@pytest.mark.parametrize("trace_device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", FEW_LONG_ROWS)
@pytest.mark.parametrize("name", NORMS)
def test_a_norm_over_few_long_rows_is_one_kernel(name, shape, trace_device):
    """The forward is one kernel, nothing left eager; but softmax and log_softmax traced on CUDA, which stay eager's
    op there (decompositions.softmax_over_many_rows: eager's kernel beats our one kernel, measured), and Hugging
    Face's RMSNorm over 64 rows, which reads `x.float()` twice: two kernels of ours, its sum of squares and then
    the product at every processor, modelled faster than one kernel of 64 programs (runs 218-219: 0.032-0.055 ms
    against 0.049-0.050, a tie).  Traced on fake tensors (CUDA ones need no GPU)."""
    ((_, regions, eager),) = _traced(NORMS[name], shape, trace_device)
    if trace_device == "cuda" and "softmax" in name:
        assert f"aten._{name}.default" in eager, eager
    else:
        assert len(regions) == 1 + (name == "rms_norm" and shape[0] == 64) and not eager, (regions, eager)


def test_under_cuda_graphs_launches_cost_no_host_time():
    """Under CUDA graphs the replay issues the launches, not the host: the cost model weighs GPU time alone, and
    there layer_norm over one long row is modelled faster split (one kernel's single program against pieces over
    many programs); with the host's launches counted, one kernel."""
    ((_, _, left),) = _traced(layer_norm, (1, 128256), "cuda", launch_host=False)
    ((_, whole, eager),) = _traced(layer_norm, (1, 128256), "cuda")
    assert len(whole) == 1 and not eager and left, (whole, left)  # split: some of it left to eager ops


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "rms_norm_by_hand", "softmax", "log_softmax"])
def test_a_norms_gradient_over_few_long_rows_is_one_kernel(name):
    """The backward's row reductions (the input's gradient) share one kernel, none eager, over 8 rows.  Not at
    1 or 64 rows: at 1, the weight's gradient is a sum over one element, in another space (unroll_small_sums
    takes 2 to 8), and log_softmax's gradient sums the incoming gradient alone (eager's sum and one kernel of
    ours, modelled faster); at 64, the weight's gradient (a column sum) takes the products both read before
    the row sums can, and one kernel would read them back in fp32 on every pass."""
    (_, (gm, regions, eager)) = _traced(NORMS[name], (8, 50257), backward=True)
    rows = _row_reductions(gm)
    assert rows and any(set(rows) <= set(r.nodes) for r in regions), (rows, regions)
    assert not any(op in eager for op in map(str, ROW_REDUCTIONS)), eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NORMS)
def test_a_norm_over_few_long_rows_runs_as_one_kernel_a_graph(name, dtype, device):
    """Forward and backward through the interpreter, held to eager (the gradients in fp32: in bf16 eager rounds each
    op's result, and the weight's gradient sums two rows that may cancel to eager's 0 against our 1 ulp): the
    forward one region, the backward one reduction region (and the weight's gradient, 2 rows summed as adds),
    nothing eager.  4-D, so that softmax decomposes on CUDA too (2 rows, each past PERSISTENT_MAX_R)."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 1, R, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(R, device=device, dtype=dtype, requires_grad=True)
    fn = NORMS[name]
    fused = fuser.fuse(fn)
    y = fused(x, w)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), g)
    want = fn(x, w)
    assert_close_to_eager(y, want)
    if dtype == torch.float32:
        assert_close_to_eager(got, torch.autograd.grad(want, (x, w), g))
    rep = fused.report
    assert not rep.unfused, rep
    first = min(r.graph for r in rep.regions)  # the forward's graph, compiled before the backward's
    forward, backward = ([r for r in rep.regions if (r.graph == first) == fwd] for fwd in (True, False))
    assert len(forward) == 1, rep
    assert [r.kind for r in backward].count("reduction") == 1, rep
