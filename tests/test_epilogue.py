"""fuser/epilogue.py: a bias matmul read only by a tanh-GELU or a ReLU runs as one `_addmm_activation`, whatever
the activation's spelling; anything else (erf GELU, a pre-activation read twice or saved for a backward, fp32)
stays as it was.  Outputs against eager at the dtype's tolerance."""
import math

import pytest
import torch
import torch.nn.functional as F

import fuser
from tests.helpers import fused_ops
from tests.tolerances import tol


def gelu_new(x):  # Hugging Face's NewGELUActivation (GPT-2)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def bloom_gelu(x):  # BLOOM's, with its own constants and factoring
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


ACTIVATIONS = {
    "gelu_new": gelu_new,
    "bloom": bloom_gelu,
    "F.gelu tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu in fp32": lambda x: gelu_new(x.float()).to(x.dtype),
    "relu": torch.relu,
    "clamp_min": lambda x: x.clamp_min(0),
}
KEPT = {
    "erf gelu": F.gelu,
    "gelu of 2x": lambda x: gelu_new(2 * x),
    "leaky relu": lambda x: F.leaky_relu(x, 0.01),
    "through fp16": lambda x: torch.relu(x.half()).to(x.dtype),
    "where (NaN -> 0, relu keeps NaN)": lambda x: torch.where(x > 0, x, 0.0),
}


class MLP(torch.nn.Module):
    """GPT-2's block MLP: a 3-d input's linear (view, addmm, view), the activation, the projection back."""

    def __init__(self, act, d=48, hidden=112, bias=True):
        super().__init__()
        self.fc, self.proj, self.act = torch.nn.Linear(d, hidden, bias), torch.nn.Linear(hidden, d, bias), act

    def forward(self, x):
        return self.proj(self.act(self.fc(x))) + x


def _run(act, dtype, device, x_shape=(3, 37, 48), bias=True):
    torch.manual_seed(0)
    model = MLP(act, bias=bias).to(device=device, dtype=dtype)
    x = torch.randn(*x_shape, device=device, dtype=dtype)
    fused = fuser.fuse(model)
    with torch.no_grad():  # inference: the pre-activation is not saved for a backward
        out, want = fused(x), model(x)
    torch.testing.assert_close(out, want, **tol(dtype))
    return fused.report


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_runs_in_the_matmul_epilogue(name, dtype, device):
    report = _run(ACTIVATIONS[name], dtype, device)
    assert any("epilogue" in note and ("relu" in note) == ("gelu" not in note) for note in report.notes), report
    assert "_addmm_activation" in {u.op.split(".")[1] for u in report.unfused if u.op.startswith("aten.")}, report
    assert not {"tanh", "relu", "clamp_min", "maximum", "where"} & fused_ops(report), report


@pytest.mark.parametrize("name", ["relu", "F.gelu tanh"])
def test_a_matmul_without_bias_gets_a_zero_one(name, device):
    """T5's MLP (wi without a bias, ReLU, wo): the same epilogue over a zero bias made once."""
    report = _run(ACTIVATIONS[name], torch.bfloat16, device, bias=False)
    assert any("epilogue" in note for note in report.notes), report
    assert not {"tanh", "relu"} & fused_ops(report), report


@pytest.mark.parametrize("name", list(KEPT))
def test_other_functions_stay_as_they_were(name, device):
    report = _run(KEPT[name], torch.bfloat16, device)
    assert not any("epilogue" in note for note in report.notes), report


def test_fp32_stays_as_it_was(device):
    report = _run(gelu_new, torch.float32, device)
    assert not any("epilogue" in note for note in report.notes), report


def test_a_scaled_activation_keeps_its_scale(device):
    """2 * gelu(h): the GELU goes into the epilogue, the product stays a region after it."""
    report = _run(lambda x: 2 * gelu_new(x), torch.bfloat16, device)
    assert any("gelu" in note and "epilogue" in note for note in report.notes), report


def test_a_pre_activation_read_twice_stays(device):
    class Twice(MLP):
        def forward(self, x):
            h = self.fc(x)
            return self.proj(gelu_new(h)) + h[..., :48]
    torch.manual_seed(0)
    model = Twice(None).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 5, 48, device=device, dtype=torch.bfloat16)
    fused = fuser.fuse(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), **tol(torch.bfloat16))
    assert not any("epilogue" in note for note in fused.report.notes), fused.report


def test_nan_and_inf_where_eager_puts_them(device):
    torch.manual_seed(0)
    model = MLP(gelu_new).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 9, 48, device=device, dtype=torch.bfloat16)
    x[0, 0, 0], x[0, 1, 0], x[1, 2, 0] = float("nan"), float("inf"), -float("inf")
    fused = fuser.fuse(model)
    with torch.no_grad():
        out, want = fused(x), model(x)
    assert any("epilogue" in note for note in fused.report.notes), fused.report
    torch.testing.assert_close(out, want, equal_nan=True, **tol(torch.bfloat16))


@pytest.mark.parametrize("act", [torch.relu, gelu_new], ids=["relu", "gelu_new"])
def test_training_gradients(act, device):
    """In training the forward saves the pre-activation (the partition recomputes the activation in the backward
    from it), so the matmul keeps its ops there; the gradients match eager's."""
    torch.manual_seed(0)
    model = MLP(act).to(device=device, dtype=torch.bfloat16)
    ref = MLP(act).to(device=device, dtype=torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 11, 48, device=device, dtype=torch.bfloat16)
    torch.compile(model, backend="fuser")(x).float().square().mean().backward()
    ref(x).float().square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(torch.bfloat16, 2))


@pytest.mark.parametrize("bias", [True, False], ids=["addmm", "mm"])
def test_symbolic_sizes(bias, device):
    """fuse(dynamic=True): the linear's views take the symbolic row count; the epilogue is taken and one graph
    serves two lengths; an mm's zero bias needs a fixed width only.  (Not gelu_new here: under dynamic=True
    Dynamo passes its math.pi in as an input.)"""
    torch.manual_seed(0)
    act = (lambda x: F.gelu(x, approximate="tanh")) if bias else torch.relu
    model = MLP(act, bias=bias).to(device=device, dtype=torch.bfloat16)
    fused = fuser.fuse(model, dynamic=True)
    for t in (13, 29):
        x = torch.randn(2, t, 48, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), **tol(torch.bfloat16))
        assert any("epilogue" in note for note in fused.report.notes), fused.report


class _Probe(torch.nn.Module):
    """A linear [N, 8] -> [N, 6] and a function of its result, in 16-bit."""

    def __init__(self, f):
        super().__init__()
        self.fc, self.f = torch.nn.Linear(8, 6), f

    def forward(self, x):
        return self.f(self.fc(x))


def _probe(f, dtype=torch.bfloat16, scale=1.0, device="cpu", compile_=False):
    torch.manual_seed(0)
    model = _Probe(f).to(device=device, dtype=dtype)
    x = (torch.randn(4, 8) * scale).to(device=device, dtype=dtype)  # made on CPU: the same values on every device
    fused = torch.compile(model, backend="fuser") if compile_ else fuser.fuse(model)
    with torch.no_grad():
        out, want = fused(x), model(x)
    torch.testing.assert_close(out, want, equal_nan=True, **tol(dtype))
    return out, fuser.last_report()


def test_two_views_broadcast_in_the_chain_stay(device):
    """relu(h) + h.view(4, 1, 6).clamp(0, 0) broadcasts to [4, 4, 6]: elementwise per value it is relu, but not
    one output per matmul element (review of 8cdaa73: the rewrite gave it the last view's shape)."""
    for reduce in (False, True):
        out, report = _probe(lambda h: (lambda y: y.sum(1) if reduce else y)(torch.relu(h) + h.view(4, 1, 6).clamp(0, 0)),
                             device=device)
        assert not any("epilogue" in note for note in report.notes), report


def test_a_narrowing_cast_inside_the_chain_stays(device):
    """(h.float() * 4096).half() overflows past |h| = 16 in fp16 (the epilogue would not): kept.  Inputs ~100 put
    |h| past 16 somewhere, asserted (run 189 on CUDA drew its inputs there, and none was)."""
    out, report = _probe(lambda h: torch.relu((h.float() * 4096.0).half()) * (1 / 4096.0), torch.float16, 100.0, device)
    assert out.isinf().any() and not any("epilogue" in note for note in report.notes), report


def test_a_threshold_between_zero_and_the_smallest_sample_is_not_relu(device):
    """threshold(h, 5e-7, 0) differs from relu only on (0, 5e-7]: every 16-bit value is evaluated."""
    out, report = _probe(lambda h: F.threshold(h, 5e-7, 0.0), device=device)
    assert not any("epilogue" in note for note in report.notes), report


def test_the_returned_activation_is_no_view(device):
    """A 3-d input's linear and relu returned as they are: the result is not a view (detach_ works, as eager's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU()).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(model, backend="fuser")(x)
        torch.testing.assert_close(out, model(x), **tol(torch.bfloat16))
    assert any("epilogue" in note for note in fuser.last_report().notes), fuser.last_report()
    assert not out._is_view()
    out.detach_()
