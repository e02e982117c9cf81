"""The public API: fuse(), the report, the backend name, and clear errors on bad input."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fuser
from torch.fx.experimental.proxy_tensor import make_fx

from fuser.codegen.kernel import generate
from fuser.cost import region_cost
from fuser.decompositions import decompositions
from fuser.runtime import RegionKernel
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
    assert "kernels_fused_0(" in fused.code


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
    kernel = RegionKernel(region, "fused_0", functools.partial(
        generate, region, device_type=device, name="fused_0", cost=region_cost(region)))
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


def _fused_chain_checked(caplog):
    """fuse(chain), called once under caplog at WARNING; its output checked against eager."""
    fused = fuser.fuse(chain)
    a, b = torch.randn(7, 9), torch.randn(9)
    with caplog.at_level("WARNING", logger="fuser"):
        torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)
    return fused


def test_pipeline_failure_falls_back_with_the_reason(monkeypatch, caplog):
    """A failure inside fuser for one graph runs that graph as given, says why (WARNING on the
    `fuser` logger and in the report), and never reaches the user as a crash."""
    import fuser.backend as backend

    def broken(gm, **kwargs):
        raise ValueError("synthetic failure")

    monkeypatch.setattr(backend, "compile_graph", broken)
    fused = _fused_chain_checked(caplog)
    assert "ValueError: synthetic failure" in caplog.text
    assert fused.report.fallbacks and "while compiling: ValueError: synthetic failure" in fused.report.fallbacks[0]
    assert "left to eager as a whole" in str(fused.report) and not fused.report.regions


def test_fallback_runs_the_graph_as_it_was_given(monkeypatch, caplog):
    """The pipeline rewrites the graph in place; one that fails half way (a lowering made, then an
    error) must not leave its half-rewritten graph to run: the fallback runs a copy taken before."""
    import fuser.backend as backend

    def broken(gm, **kwargs):
        for n in gm.graph.nodes:  # a rewrite that changes the answer: every add becomes a sub
            if n.target is torch.ops.aten.add.Tensor:
                n.target = torch.ops.aten.sub.Tensor
        gm.recompile()
        raise ValueError("synthetic failure after a rewrite")

    monkeypatch.setattr(backend, "compile_graph", broken)
    fused = _fused_chain_checked(caplog)  # held to eager
    assert "synthetic failure after a rewrite" in fused.report.fallbacks[0]


def test_capture_failure_falls_back(monkeypatch, caplog):
    """AOT Autograd (or a decomposition) failing on a graph: Dynamo's graph runs as given."""
    import fuser.backend as backend

    def broken_aot(**kwargs):
        def fail(gm, example_inputs):
            raise RuntimeError("synthetic AOT failure")
        return fail

    monkeypatch.setattr(backend, "aot_autograd", broken_aot)
    monkeypatch.setattr(fuser.api, "_BACKENDS", {})  # the shared backends bind aot_autograd when made
    fused = _fused_chain_checked(caplog)
    assert "synthetic AOT failure" in caplog.text
    assert "while capturing (AOT Autograd): RuntimeError: synthetic AOT failure" in fused.report.fallbacks[0]


def test_kernel_failure_at_run_time_falls_back(monkeypatch, caplog, device):
    """A kernel that fails at its first launch (say, Triton cannot compile it): the graph as given
    runs instead, now and on later calls; the report says why."""
    import fuser.runtime as launch

    def broken(self, *args):
        raise TypeError("synthetic kernel failure")

    monkeypatch.setattr(launch.RegionKernel, "_launch", broken)
    fused = fuser.fuse(chain)
    a, b = torch.randn(7, 9, device=device), torch.randn(9, device=device)
    with caplog.at_level("WARNING", logger="fuser"):
        for _ in range(2):
            torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)
    assert caplog.text.count("runs as given") == 1  # one warning: later calls run the given graph directly
    assert "at run time: TypeError: synthetic kernel failure" in fused.report.fallbacks[0]


def test_eager_errors_are_not_swallowed_by_the_fallback(device):
    """The fallback reruns the given graph: an error that graph raises too is the user's, and propagates."""
    a = torch.randn(4, 5, device=device)
    idx = torch.tensor([[0, 9]] * 4, device=device)
    fused = fuser.fuse(lambda a, i: torch.gather(a * 2, 1, i) + 1)
    if device == "cpu":  # on CUDA an out-of-range index is a device-side assert, fatal to the process
        with pytest.raises(RuntimeError, match="out of bounds"):
            fused(a, idx)
        assert not fused.report.fallbacks


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
    """No environment variable, fuser never imported: torch.compile finds the backend by name (and
    imports triton before fuser); CPU kernels still run through the interpreter, and quietly."""
    code = ("import warnings\n"
            "warnings.simplefilter('error', RuntimeWarning)\n"
            "import torch\n"
            "f = torch.compile(lambda x: torch.log(torch.exp(x) * 2 + 1) / x, backend='fuser')\n"
            f"x = torch.randn(33, 17, device='{device}')\n"
            "torch.testing.assert_close(f(x), torch.log(torch.exp(x) * 2 + 1) / x)\n"
            "import fuser\n"
            "assert fuser.last_report().regions, fuser.last_report()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert "RuntimeWarning" not in out.stderr, out.stderr[-3000:]


def test_repeated_calls_and_misaligned_inputs(device):
    """Later launches take the direct path; a misaligned input must go back through the JIT."""
    fused = fuser.fuse(chain)
    for offset in (0, 0, 1, 0, 3):
        buf = torch.randn(37 * 53 + offset, device=device)
        a = buf[offset:].view(37, 53)
        b = torch.randn(53, device=device)
        torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)


def test_options(device):
    with pytest.raises(ValueError, match="unknown option.*'tile'.*known: \\['attention', 'cuda_graphs', 'dropout', 'fused_loss'\\]"):
        fuser.fuse(chain, tile=3)
    with pytest.raises(ValueError, match="attention='no' is not allowed; allowed values: True, False"):
        fuser.fuse(chain, attention="no")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="attention=1 is not allowed"):  # Dynamo wraps it
        torch.compile(chain, backend="fuser", options={"attention": 1})(torch.randn(3, 4), torch.randn(4))

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v

    q = k = v = torch.randn(1, 2, 9, 8, device=device)
    kinds = [r.kind for r in fuser.fuse(attn, example_inputs=(q, k, v), attention=False).report.regions]
    assert "attention" not in kinds and "reduction" in kinds


def test_zero_dim_float64_input_is_fused_not_a_fallback(device):
    """A 0-d float64 tensor makes Dynamo restart its analysis from inside the backend (a control-flow
    exception): the backend lets it through instead of taking it for a failure."""
    def fn(x, s):
        return torch.exp(x * s) + s

    x, s = torch.randn(7, 9, device=device, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64, device=device)
    fused = fuser.fuse(fn)
    torch.testing.assert_close(fused(x, s), fn(x, s))
    assert not fused.report.fallbacks and fused.report.regions, fused.report


def test_report_is_the_latest_call_and_dynamo_giving_up_is_said(device, caplog):
    """fused.report holds the graphs that ran in the latest call; when Dynamo stops compiling (its
    recompile limit: reached here with dynamic=False, one graph per shape), the calls it runs eagerly
    say so in the report and, once, at WARNING."""
    fused = fuser.fuse(lambda x: torch.exp(x) * 2 + 1, dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    with caplog.at_level("WARNING", logger="fuser"):
        for n in range(3, 3 + limit + 2):
            x = torch.randn(2, n, device=device)
            torch.testing.assert_close(fused(x), torch.exp(x) * 2 + 1)
            if n < 3 + limit:
                assert fused.report.regions and not fused.report.fallbacks
                assert fused.report.regions[0].output_shapes == [f"[2, {n}] float32"]
        assert not fused.report.regions
        assert "recompile_limit" in fused.report.fallbacks[0] and "ran eagerly" in str(fused.report)
        assert caplog.text.count("ran eagerly") == 1
        fused(torch.randn(2, 3, device=device))  # a shape it has a graph for: fused again
    assert fused.report.regions and not fused.report.fallbacks


def test_report_after_backward_has_both_graphs(device):
    model = torch.nn.Sequential(torch.nn.Linear(9, 9), torch.nn.LayerNorm(9), torch.nn.GELU()).to(device)
    fused = fuser.fuse(model)
    fused(torch.randn(5, 9, device=device)).pow(2).sum().backward()
    assert any("backward" in note for note in fused.report.notes), fused.report
    assert len(fused.report.code) == 2  # the forward and the backward graph, as they ran


def test_separate_fuse_calls_do_not_starve_each_other(device):
    """One class fused more times than Dynamo's recompile limit (a notebook re-run, a sweep): every
    FusedModule compiles through a code object of its own, so each one's graphs are fused."""
    class Chain(torch.nn.Module):
        def forward(self, a, b):
            return chain(a, b)

    a, b = torch.randn(7, 9, device=device), torch.randn(9, device=device)
    for _ in range(max(12, torch._dynamo.config.recompile_limit + 2)):
        fused = fuser.fuse(Chain())
        torch.testing.assert_close(fused(a, b), chain(a, b), **TOL)
        assert fused.report.regions and not fused.report.fallbacks, fused.report


def _break_then_chain(a, b):
    torch._dynamo.graph_break()  # the class's forward becomes a frame of its own, shared by every instance
    return chain(a, b)


def test_models_of_one_class_breaking_in_one_function_are_each_fused(device):
    """More fused models of one class than Dynamo's recompile limit, whose graphs break in a function they all
    reach (Hugging Face's loss property, a helper): Dynamo compiles that function's frames per code object and
    backend, so with a backend per FusedModule the ninth ran eagerly. FusedModules of equal options share one:
    each model runs its own weights, fused, and its report lists the graphs it ran."""
    class Breaking(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(9, device=device))

        def forward(self, a):
            return _break_then_chain(a, self.w)

    a = torch.randn(7, 9, device=device)
    for _ in range(torch._dynamo.config.recompile_limit + 3):
        model = Breaking()
        fused = fuser.fuse(model)
        torch.testing.assert_close(fused(a), chain(a, model.w), **TOL)
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report
        assert fused.reports, "the graphs this module ran, compiled for an earlier one, are its graphs too"


def test_a_fused_model_is_freed_with_its_module(device):
    """Dynamo keeps every backend it was given for the life of the process: a backend must not hold its model
    (a notebook fusing model after model kept every one's weights)."""
    import gc
    import weakref
    model = _Block().to(device)
    fused = fuser.fuse(model)
    fused(torch.randn(3, 32, device=device, requires_grad=True)).sum().backward()
    refs = weakref.ref(model), weakref.ref(fused)
    del model, fused
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_backward_is_reported_by_the_module_that_ran_its_forward(device):
    """Two models of one class, forwards run in turn and backwards after both (a GAN's step): each module's
    report holds its own forward graph and the backward AOT Autograd made of it."""
    torch.manual_seed(0)
    first, second = fuser.fuse(_Block().to(device)), fuser.fuse(_Block().to(device))
    x = torch.randn(3, 5, 32, device=device)
    y1 = first(x)
    y2 = second(x)
    (y2.square().sum() + y1.square().sum()).backward()
    for fused in (first, second):
        forwards = [r.graph for r in fused.reports if r.forward is None]
        backwards = [r.forward for r in fused.reports if r.forward is not None]
        assert len(forwards) == 1 and backwards == forwards, fused.reports
        assert any("backward" in note for note in fused.report.notes), fused.report
    assert not {r.graph for r in first.reports} & {r.graph for r in second.reports}


class _Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 48), torch.nn.Linear(48, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


@pytest.mark.parametrize("called", [False, True], ids=["before-a-call", "after-a-call"])
def test_a_copy_or_a_saved_model_runs_its_own_weights(called, device):
    """copy.deepcopy (an EMA or teacher copy) and torch.save/load of a fused module fuse the copied model afresh:
    the copy had kept the original's compiled entry (running the original's weights: a silent wrong answer) or
    failed to copy its kernels' fake tensors; a pickle failed on the backend's closure."""
    import copy
    import io
    torch.manual_seed(0)
    fused = fuser.fuse(_Block().to(device))
    x = torch.randn(3, 5, 32, device=device)
    if called:
        fused(x)
    twin = copy.deepcopy(fused)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for p in twin.model.parameters():
            p.add_(0.5)
    for m in (twin, loaded, fused):
        with torch.no_grad():
            torch.testing.assert_close(m(x), m.model(x))
        assert m.report.regions and not m.report.all_fallbacks, m.report
    assert not torch.allclose(twin(x), fused(x))


def test_a_second_model_fused_starts_at_its_own_sizes(device):
    """Dynamo remembers which sizes changed per function (automatic dynamic): every fuse() compiles an entry of
    its own name, so a second model's first call is not made symbolic by the first model's sizes (its backward
    compiled ahead with donated buffers then refused backward(retain_graph=True))."""
    torch.manual_seed(0)
    first = fuser.fuse(_Block().to(device))
    with torch.no_grad():
        first(torch.randn(3, 5, 32, device=device))
        first(torch.randn(2, 9, 32, device=device))
    second = fuser.fuse(_Block().to(device))
    y = second(torch.randn(2, 7, 32, device=device))
    assert not any(r.symbolic for r in second.report.regions), second.report
    loss = y.square().mean()
    loss.backward(retain_graph=True)
    loss.backward()


def _shared_decorator(fn):
    def wrapped(self, x):  # one code object for every layer class (Hugging Face's deprecate_kwarg, say)
        return fn(self, x)
    return wrapped


def test_a_function_inside_the_model_dynamo_gives_up_on_is_reported(device, caplog):
    """A decorator every layer class shares, with a graph break inside the layers: Dynamo compiles the decorator's
    frame once per class and gives up on it past its recompile limit, while the graphs before it still run.  That
    part of the model then runs eagerly: said in the report's fallbacks of that call and every later one, and once
    at WARNING (it had been said nowhere but in torch's own log)."""
    def layer(i):
        class Layer(torch.nn.Module):
            @_shared_decorator
            def forward(self, x):
                y = torch.tanh(x) * 0.9 + 0.01 * i
                torch._dynamo.graph_break()
                return torch.relu(y) - 0.5 * torch.sigmoid(y)
        return Layer()

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), *[layer(i) for i in range(torch._dynamo.config.recompile_limit + 3)])
    model = model.to(device)
    fused = fuser.fuse(model)
    x = torch.randn(4, 32, device=device)
    with caplog.at_level("WARNING", logger="fuser"), torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fused(x), model(x), **TOL)
            assert any("recompile_limit" in f and "wrapped" in f for f in fused.report.all_fallbacks), fused.report
    assert caplog.text.count("runs eagerly from now on") == 1
