"""Rows longer than registers hold: the looped kernels, with the max and the sum of exp in one pass
and the target logit gathered without a pass of its own.  140 rows so the cost model (which wants a
program per SM) fuses them; fp32 tolerances."""
import pytest
import torch
import torch.nn.functional as F

import fuser

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
