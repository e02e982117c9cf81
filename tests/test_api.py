"""The public API: fuse(), the report, the backend name, and clear errors on bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fuser
from torch.fx.experimental.proxy_tensor import make_fx

from fuser.capture import decompositions
from fuser.launch import RegionKernel
from fuser.partition import Partitioner

TOL = dict(atol=1e-5, rtol=1e-5)


def chain(a, b):
    return F.gelu(a + b) * 0.5 + a


def test_fuse_function_and_report(device):
    a = torch.randn(3, 423, 213, device=device)
    b = torch.randn(213, device=device)
    fused = fuser.fuse(chain)
    torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)
    rep = fused.report
    (r,) = rep.regions
    assert r.kind == "pointwise" and r.k == pytest.approx(r.bytes_unfused / r.bytes_fused)
    assert "aten.gelu.default" in r.ops and "@triton.jit" in r.source and "HBM" in r.source
    assert "pointwise" in str(rep) and "k =" in str(rep)
    assert json.loads(rep.to_json())["regions"][0]["kernel"] == r.kernel
    assert "self.fused_0(" in fused.code


def test_example_inputs_capture_now_and_non_contiguous_inputs(device):
    a = torch.randn(213, 3, 423, device=device).permute(1, 2, 0)  # non-contiguous
    b = torch.randn(3, 1, 213, device=device)                      # broadcast
    fused = fuser.fuse(chain, example_inputs=(a, b))
    assert fused.report.regions
    torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)


def test_new_dtype_recaptures(device):
    fused = fuser.fuse(chain)
    for dtype, tol in ((torch.float32, TOL), (torch.float16, dict(atol=2e-3, rtol=2e-3))):
        a, b = torch.randn(37, 53, device=device, dtype=dtype), torch.randn(53, device=device, dtype=dtype)
        torch.testing.assert_close(fused(a, b), chain(a.float(), b.float()).to(dtype), **tol)
        assert str(dtype).replace("torch.", "") in fused.report.regions[0].output_shapes[0]


def test_kernel_refuses_other_shapes(device):
    a, b = torch.randn(37, 53, device=device), torch.randn(53, device=device)
    gm = make_fx(chain, decomposition_table=decompositions(), tracing_mode="fake")(a, b)
    (region,) = Partitioner(gm.graph).partition()
    kernel = RegionKernel(region, "fused_0")
    torch.testing.assert_close(kernel(a, b)[0], chain(a, b), **TOL)
    with pytest.raises(RuntimeError, match="made for"):
        kernel(torch.randn(38, 53, device=device), b)
    with pytest.raises(RuntimeError, match="made for"):
        kernel(a.double(), b)


def test_unsupported_op_stays_eager_with_reason(device):
    def f(x):
        return torch.cumsum(torch.exp(x) * 2.0, -1) + 1.0

    x = torch.randn(37, 53, device=device)
    fused = fuser.fuse(f)
    torch.testing.assert_close(fused(x), f(x), **TOL)
    (u,) = [u for u in fused.report.unfused if "cumsum" in u.op]
    assert "no Triton lowering" in u.reason


def test_not_a_module_or_callable():
    with pytest.raises(TypeError, match="nn.Module or a callable"):
        fuser.fuse(42)


def test_mixed_devices_is_a_clear_error():
    lin = torch.nn.Linear(4, 4)
    fused = fuser.fuse(lin)
    with pytest.raises(ValueError, match="mixed devices"):
        fused(torch.randn(2, 4, device="meta"))


def test_backend_failure_names_the_model(monkeypatch):
    import fuser.backend as backend

    def broken(gm, **kwargs):
        raise ValueError("synthetic failure")

    monkeypatch.setattr(backend, "compile_graph", broken)
    fused = fuser.fuse(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(RuntimeError, match="fuser could not compile a graph of Sequential: ValueError: synthetic"):
        fused(torch.randn(3, 5))


def test_huggingface_style_outputs_and_graph_breaks(device):
    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.sigmoid(x) * x + 1.0
            if float(y.sum()) > -1e9:      # data-dependent Python control flow: a graph break
                y = torch.tanh(y) * 2.0 - y
            return {"out": y, "aux": (y.amax(-1),)}

    x = torch.randn(37, 53, device=device)
    fused = fuser.fuse(M())
    out, ref = fused(x), M()(x)
    torch.testing.assert_close(out["out"], ref["out"], **TOL)
    torch.testing.assert_close(out["aux"][0], ref["aux"][0], **TOL)
    assert len(fused.reports) >= 2  # one report per captured graph


def test_kernels_are_cached_on_disk(tmp_path, monkeypatch, device):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    a, b = torch.randn(7, 9, device=device), torch.randn(9, device=device)
    fuser.fuse(lambda a, b: torch.exp(a) * b + 1.0)(a, b)
    assert any(p.name.startswith("k_") for p in tmp_path.iterdir())


def test_torch_compile_backend_name_in_a_fresh_process(device):
    code = ("import torch\n"
            "f = torch.compile(lambda x: torch.exp(x) * 2 + 1, backend='fuser')\n"
            f"x = torch.randn(33, 17, device='{device}')\n"
            "torch.testing.assert_close(f(x), torch.exp(x) * 2 + 1)\n"
            "import fuser\n"
            "assert fuser.last_report().regions, fuser.last_report()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_repeated_calls_and_misaligned_inputs(device):
    """Later launches take the direct path; a misaligned input must go back through the JIT."""
    fused = fuser.fuse(chain)
    for offset in (0, 0, 1, 0, 3):
        buf = torch.randn(37 * 53 + offset, device=device)
        a = buf[offset:].view(37, 53)
        b = torch.randn(53, device=device)
        torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)


def test_options(device):
    with pytest.raises(ValueError, match="unknown option.*'tile'.*known: \\['attention'\\]"):
        fuser.fuse(chain, tile=3)

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v

    q = k = v = torch.randn(1, 2, 9, 8, device=device)
    kinds = [r.kind for r in fuser.fuse(attn, example_inputs=(q, k, v), attention=False).report.regions]
    assert "attention" not in kinds and "reduction" in kinds
