"""The runtime (issue 10): one generated wrapper per graph (outputs allocated in the program, buffers
reused, only foreign inputs checked), and CUDA-graph replay (`mode="reduce-overhead"`,
`options={"cuda_graphs": True}`, `fuse(cuda_graphs=True)`): accepted everywhere, effective on the GPU."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fuser
from fuser import runtime
from fuser.runtime import RegionKernel, reuse_buffers, write_over_donated
from tolerances import assert_close_to_eager

aten = torch.ops.aten


class Blocks(nn.Module):
    """Matmul -> LayerNorm + GELU, three times: a fused region between eager matmuls."""

    def __init__(self, d=24, n=3):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        for lin, norm in zip(self.linears, self.norms):
            x = F.gelu(norm(lin(x)))
        return x


def _model(device, d=24):
    torch.manual_seed(0)
    return Blocks(d).to(device)


def test_wrapper_code_allocates_reuses_and_calls_kernels_directly(device):
    """The printed program of a small model: each kernel is one plain call, its output written over
    the eager matmul result it reads (nothing reads that afterwards), no module calls."""
    m = _model(device)
    x = torch.randn(5, 24, device=device)
    with torch.no_grad():
        fused = fuser.fuse(m)
        assert_close_to_eager(fused(x), m(x))
    code = fused.code
    assert len(fused.report.regions) == 3
    for i in range(3):
        assert f"kernels_fused_{i}(" in code
    # each LayerNorm + GELU writes over the matmul output it reads (dead after it): no buffer at all
    assert "empty_strided" not in code and code.count("kernels_take_in_place(addmm") == 3, code
    assert "self.fused_" not in code
    # the kernels are still attributes of the program, for tools and tests
    (gm,) = fused.graph_modules
    assert sum(isinstance(k, RegionKernel) for k in gm.modules()) == 3


def test_outputs_written_over_inputs_that_die_there(device):
    """A softmax over an eager bmm's scores writes its probabilities over them, a GELU left alone
    after a matmul runs in place, a LayerNorm writes over the matmul output it reads; where the
    input is read again later (or returned) the kernel keeps its own buffer.  Values as eager's."""
    torch.manual_seed(1)
    w, w2 = torch.randn(16, 48, device=device), torch.randn(48, 16, device=device)

    def f(a, b, keep: bool):
        s = torch.bmm(a, b)
        p = torch.softmax(s * 0.3, -1)
        h = F.gelu(torch.bmm(p, a).reshape(-1, 16) @ w)  # between two matmuls: alone, eager
        n = F.layer_norm(h @ w2, (16,))
        return (n, s, h) if keep else n

    a, b = torch.randn(3, 37, 16, device=device), torch.randn(3, 16, 37, device=device)
    for keep in (False, True):
        fused = fuser.fuse(lambda a, b: f(a, b, keep))
        with torch.no_grad():
            assert_close_to_eager(fused(a, b), f(a, b, keep))
        code, notes = fused.code, " ".join(fused.report.notes)
        if keep:  # the scores are returned: the softmax has a buffer of its own (the GELU's output is
            assert "take_in_place(bmm," not in code and "buf0" in code, code  # returned: written over mm, fine)
        else:
            assert "kernels_take_in_place(bmm," in code and "kernels_take_in_place(mm_1," in code, code
            assert "aten.gelu_.default" in code, code
            assert "3 kernels write their output over" in notes, notes  # softmax, GELU, LayerNorm


def test_no_in_place_where_the_kernel_reads_other_elements(device):
    """A kernel that reads its input at other places than it writes (a shifted sum, a transpose)
    never writes over it."""
    def f(a, b):
        s = torch.bmm(a, b)
        return (s[:, 1:] + s[:, :-1]) * 2, torch.bmm(a, b).transpose(1, 2) + 1

    a, b = torch.randn(2, 19, 8, device=device), torch.randn(2, 8, 19, device=device)
    fused = fuser.fuse(f)
    assert_close_to_eager(fused(a, b), f(a, b))
    assert fused.report.regions and "take_in_place" not in fused.code, fused.code


def test_take_in_place_checks_the_layout_at_run_time(device):
    """An eager result is written over only where it has the layout the kernel was made for."""
    t = torch.randn(4, 6, device=device)
    same = runtime._take_in_place(t, (2, 12), (12, 1), t.dtype, (4, 6), (6, 1))
    assert same.data_ptr() == t.data_ptr() and same.shape == (2, 12)
    other = runtime._take_in_place(t.t(), (6, 4), (4, 1), t.dtype, (6, 4), (4, 1))  # strides (1, 6): not as made
    assert other.data_ptr() != t.data_ptr() and other.stride() == (4, 1)


def test_wrapper_checks_only_inputs_it_did_not_allocate(device):
    """A kernel reading another kernel's buffer skips the check; one reading a graph input keeps it."""
    def f(x):
        h = torch.softmax(x, -1)               # a reduction over rows...
        return (h.t() * 2).amax(1), h.sum(-1)  # ...whose output a reduction over columns reads

    x = torch.randn(37, 23, device=device)
    fused = fuser.fuse(f)
    assert_close_to_eager(fused(x), f(x))
    (gm,) = fused.graph_modules
    kernels = [k for k in gm.modules() if isinstance(k, RegionKernel)]
    assert len(kernels) == 2
    produced = {o for k in kernels for o in k.region.outputs}
    for k in kernels:
        for i, n in enumerate(k.region.inputs):
            assert (i in k.checked) == (n not in produced), (k.name, n.name)
    assert any(n in produced for k in kernels for n in k.region.inputs)


def test_into_with_other_strides_gets_its_variant_and_other_shapes_raise(device):
    """`into` (the wrapper's entry) meets an input whose strides are not the captured ones: a variant
    for them runs, with eager's result; other shapes are refused with the cause."""
    fused = fuser.fuse(lambda a, b: torch.exp(a) * b + 1)
    a, b = torch.randn(13, 17, device=device), torch.randn(13, 17, device=device)
    fused(a, b)
    (k,) = [k for gm in fused.graph_modules for k in gm.modules() if isinstance(k, RegionKernel)]
    (shape, stride, dtype, dev), = k.buffers()
    out = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
    at, bt = (torch.randn(17, 13, device=device).t() for _ in range(2))  # same shapes, transposed strides
    assert_close_to_eager(k.into(at, bt, out), torch.exp(at) * bt + 1)
    assert_close_to_eager(k.into(a, bt, out), torch.exp(a) * bt + 1)
    with pytest.raises(RuntimeError, match="made for"):
        k.into(torch.randn(13, 18, device=device), b, out)


def _alloc(g, name, shape=(4, 4)):
    return g.create_node("call_function", runtime.allocator(torch.device("cpu")), (shape, (shape[-1], 1), torch.float32),
                         name=name)


def _kernel(n_in):
    return runtime.named("k", lambda *a: a[n_in], returns_args=slice(n_in, None))


def test_reuse_buffers_respects_views_and_outputs():
    """A buffer seen through a view is busy until the view's last use; a buffer (or view) that is an
    output of the graph is never handed on; a dead one is."""
    g = fx.Graph()
    x = g.placeholder("x")
    allocs = set()
    b0 = _alloc(g, "b0")
    k0 = g.call_function(_kernel(1), (x, b0))
    v = g.call_function(aten.t.default, (k0,))           # a view of b0
    b1 = _alloc(g, "b1")
    k1 = g.call_function(_kernel(1), (x, b1))              # b0 is still seen through v: no reuse
    m = g.call_function(aten.mm.default, (v, k1))          # last use of v and of b1
    b2 = _alloc(g, "b2")
    k2 = g.call_function(_kernel(1), (m, b2))              # b0 and b1 are dead here: b2 takes one
    b3 = _alloc(g, "b3")
    k3 = g.call_function(_kernel(1), (k2, b3))             # b2's buffer is busy (read here)...
    g.output((k3, g.call_function(operator.getitem, ((k2, k3), 0))))
    allocs = {b0, b1, b2, b3}
    saved = reuse_buffers(g, allocs)
    names = [n.name for n in g.nodes if n.name.startswith("b")]
    assert saved == 2 and names == ["b0", "b1"], names
    assert k2.args[1] is b0 and k3.args[1] is b1


def test_reuse_buffers_keeps_graph_outputs_apart():
    g = fx.Graph()
    x = g.placeholder("x")
    b0 = _alloc(g, "b0")
    k0 = g.call_function(_kernel(1), (x, b0))
    b1 = _alloc(g, "b1")
    k1 = g.call_function(_kernel(1), (x, b1))
    g.output((k0, k1))
    assert reuse_buffers(g, {b0, b1}) == 0


# ------------------------------------------------------------------------------------------ views
class Heads(nn.Module):
    """A projection split into three, reshaped to heads and fed to eager matmuls: the views stay
    outside any region (they feed matmuls), so the wrapper runs them."""

    def __init__(self, d=24, h=4):
        super().__init__()
        self.h, self.lin = h, nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.lin(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        w = torch.relu(q @ k.transpose(-1, -2))
        return (w @ v).transpose(1, 2).reshape(b, t, d) * 2


def test_views_in_the_wrapper_reinterpret_their_base(device):
    """Views over static layouts (split pieces, view, transpose) print as reinterpretations of their
    base; the program's result is eager's."""
    torch.manual_seed(0)
    m = Heads().to(device)
    x = torch.randn(3, 7, 24, device=device)
    with torch.no_grad():
        fused = fuser.fuse(m)
        assert_close_to_eager(fused(x), m(x))
    code = fused.code
    assert "kernels_view_chain(" in code, code
    assert not any(f"= torch.ops.aten.{op}" in code for op in ("permute", "split", "view", "expand")), code
    # the chains' arguments are constants, which Python builds once (no op lookups or lists per call)
    chains = [line for line in code.splitlines() if "kernels_view_chain(" in line]
    assert not any("torch.ops" in line or "[" in line or "{" in line for line in chains), code


def _chain_of(captured, steps):
    """The traced layout of `steps` applied to `captured`, as fast_views writes it into the program."""
    t = captured
    for op, args, kwargs, index in steps:
        t = op(t, *args, **kwargs) if index is None else op(t, *args, **kwargs)[index]
    return (tuple(t.shape), t.stride(), t.storage_offset() - captured.storage_offset(),
            tuple(captured.shape), captured.stride(), *(runtime.view_step(*s) for s in steps))


@pytest.mark.parametrize("steps", [
    [(aten.permute.default, ([2, 0, 1],), {}, None)],
    [(aten.view.default, ([6, 35],), {}, None)],
    [(aten.slice.Tensor, (2, 1, 5), {}, None), (aten.expand.default, ([2, 5, 6, 4],), {}, None)],
    [(aten.split.Tensor, (2, 1), {}, 1), (aten.unsqueeze.default, (0,), {}, None),
     (aten.permute.default, ([0, 3, 1, 2],), {}, None)],
], ids=["permute", "view", "slice-expand", "split-unsqueeze-permute"])
def test_a_chain_of_views_is_one_reinterpretation_or_its_ops(steps):
    """The wrapper's view chain checks the tensor it starts from: in the traced layout (at any
    storage offset: the view's offset is relative to it), one reinterpretation; in other strides, the
    ops themselves.  Each time eager's values and layout."""
    captured = torch.randn(5, 6, 7)
    chain = _chain_of(captured, steps)
    shifted = torch.randn(2, 5, 6, 7)[1]  # the traced strides at another offset
    strided = torch.randn(7, 6, 5).permute(2, 1, 0)  # same shape, other strides
    bases = [captured, shifted] + ([] if steps[0][0] is aten.view.default else [strided])  # view refuses those
    for base in bases:
        got, want = runtime.view_chain(base, *chain), base
        for op, args, kwargs, index in steps:
            want = op(want, *args, **kwargs) if index is None else op(want, *args, **kwargs)[index]
        assert got.data_ptr() == want.data_ptr() and got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class TwiceTransposed(nn.Module):
    """A weight read as W.t().t() (every backward graph reads its forward's W.t() so) by an eager matmul."""

    def forward(self, x, w):
        return torch.sigmoid((torch.relu(x) * 3 + 1) @ w.t().t() * 2 + 1)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
def test_views_that_give_their_root_back_are_the_root(device, strided):
    """Permutes that compose to none (and aliases, views to the same size) give their root back whatever its
    strides: the program reads the root itself, with no view call nor layout check."""
    torch.manual_seed(0)
    x = torch.randn(5, 7, device=device)
    w = torch.randn(3, 7, device=device).t() if strided else torch.randn(7, 3, device=device)
    m = TwiceTransposed()
    fused = fuser.fuse(m)
    assert_close_to_eager(fused(x, w), m(x, w))
    assert "view_chain" not in fused.code and "permute" not in fused.code and "reinterpret" not in fused.code, fused.code


@pytest.mark.parametrize("steps,identity", [
    ([("aten.permute.default", ((1, 0, 2),)), ("aten.permute.default", ((1, 0, 2),))], True),
    ([("aten.permute.default", ((2, 0, 1),)), ("aten.permute.default", ((1, 2, 0),))], True),
    ([("aten.permute.default", ((2, 0, 1),)), ("aten.permute.default", ((2, 0, 1),))], False),
    ([("aten.transpose.int", (-1, -2)), ("aten.alias.default", ()), ("aten.transpose.int", (1, 2))], True),
    ([("aten.transpose.int", (0, 1)), ("aten.view.default", ((3, 2, 4),)), ("aten.transpose.int", (0, 1))], True),
    ([("aten.view.default", ((2, 3, 4),)), ("aten.alias.default", ())], True),
    ([("aten.view.default", ((2, 12),)), ("aten.view.default", ((2, 3, 4),))], False),  # not layout-free
    ([("aten.slice.Tensor", (0, 0, 1))], False),
])
def test_a_chain_gives_its_root_back(steps, identity):
    assert runtime._identity([(name, args, (), None) for name, args in steps], (2, 3, 4)) is identity


@pytest.mark.parametrize("shape", [(), (5,)], ids=["0-d", "1-d"])
def test_a_transpose_of_a_scalar_or_a_vector_gives_it_back(shape):
    steps = [("aten.t.default", ()), ("aten.transpose.int", (0, -1)), ("aten.permute.default", (tuple(range(len(shape))),))]
    for name, args in steps:
        assert runtime._identity([(name, args, (), None)], shape), name


# ------------------------------------------------------------------------------------------ folding
class MaskEveryCall(nn.Module):
    """What Hugging Face models do each step: positions and a causal mask built from arange, then
    used by eager matmuls and a fused softmax."""

    def __init__(self, d=16, t=11):
        super().__init__()
        self.pos = nn.Embedding(t, d)

    def forward(self, x):
        t = x.shape[1]
        i = torch.arange(t, device=x.device)
        causal = (i[None, :] <= i[:, None]).cumsum(-1) > 0  # a scan: eager, unless folded
        h = x + self.pos(i)
        s = (h @ h.transpose(-1, -2)).masked_fill(~causal, -1e4)
        return torch.relu(s) @ h


def test_constants_are_computed_once_at_compile_time(device):
    """Everything computed from no input (arange, the comparisons, the cumsum) is folded into buffers
    of the program, listed in the report; results stay eager's."""
    torch.manual_seed(0)
    m = MaskEveryCall().to(device)
    x = torch.randn(2, 11, 16, device=device)
    with torch.no_grad():
        fused = fuser.fuse(m)
        assert_close_to_eager(fused(x), m(x))
        assert_close_to_eager(fused(x + 1), m(x + 1))
    code = fused.code
    assert "aten.arange" not in code and "aten.cumsum" not in code, code
    assert "kernels_reinterpret(fused_0" in code, code  # a view of a kernel's buffer: no check needed
    notes = [n for n in fused.report.notes if "compile time" in n]
    assert notes, fused.report.notes
    (gm,) = fused.graph_modules
    assert any(name.startswith("_folded_") for name, _ in gm.named_buffers())


def test_random_and_symbolic_values_are_not_folded(device):
    """A random tensor is redrawn every call, and one whose size follows the input's (dynamic) is
    computed per call: neither is folded."""
    def noisy(x):
        return x * torch.rand(x.shape[-1], device=x.device) + torch.arange(x.shape[0], device=x.device)[:, None]

    x = torch.randn(6, 13, device=device)
    fused = fuser.fuse(noisy)
    a, b = fused(x), fused(x)
    assert not torch.equal(a, b)  # the random part was drawn twice
    assert "rand" in fused.code
    d = fuser.fuse(lambda x: x * torch.arange(x.shape[0], device=x.device)[:, None], dynamic=True)
    for n in (6, 9):
        y = torch.randn(n, 13, device=device)
        assert_close_to_eager(d(y), y * torch.arange(n, device=device)[:, None])


# ------------------------------------------------------------------------------------------ options
def test_cuda_graph_options_are_accepted_and_reported_on_cpu():
    """On CPU every spelling is accepted, the outputs are eager's, and the report says the option had
    no effect; unknown modes and bad values are errors naming the choices."""
    m = _model("cpu")
    x = torch.randn(5, 24)
    for compiled in (torch.compile(m, backend="fuser", mode="reduce-overhead"),
                     torch.compile(m, backend="fuser", options={"cuda_graphs": True})):
        torch._dynamo.reset()
        with torch.no_grad():
            assert_close_to_eager(compiled(x), m(x))
        assert any("cuda_graphs: not used" in n and "CPU" in n for n in fuser.last_report().notes)
    fused = fuser.fuse(m, cuda_graphs=True)
    with torch.no_grad():
        assert_close_to_eager(fused(x), m(x))
    assert any("no effect" in n for n in fused.report.notes)
    with pytest.raises(ValueError, match="cuda_graphs"):
        fuser.fuse(m, cuda_graphs="yes")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mode='fastest' is not known"):
        torch.compile(m, backend="fuser", mode="fastest")(x)


# ------------------------------------------------------------------------------------------ GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _launches(monkeypatch) -> list:
    """Counts Python-side launches of fuser's region kernels."""
    calls = []
    original = runtime.Launcher.__call__

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)
    monkeypatch.setattr(runtime.Launcher, "__call__", counted)
    return calls


@cuda
@pytest.mark.parametrize("how", ["mode", "options", "fuse"])
def test_cuda_graph_replay_matches_eager_across_addresses_and_sizes(how, monkeypatch):
    """Inputs at new addresses on every call, three sizes (a graph each): eager's outputs every time,
    and once recorded, a call launches nothing from Python."""
    m = _model("cuda", 64)
    if how == "mode":
        compiled = torch.compile(m, backend="fuser", mode="reduce-overhead", dynamic=False)
    elif how == "options":
        compiled = torch.compile(m, backend="fuser", options={"cuda_graphs": True}, dynamic=False)
    else:
        compiled = fuser.fuse(m, cuda_graphs=True, dynamic=False)
    calls = _launches(monkeypatch)
    with torch.no_grad():
        for rows in (5, 9, 5, 17, 9):
            for _ in range(3):
                x = torch.randn(rows, 64, device="cuda")  # a new tensor (address) each call
                calls.clear()
                assert_close_to_eager(compiled(x), m(x))
        assert not calls  # the third call at each size replays
    notes = fuser.last_report().notes
    assert any("replayed as CUDA graphs" in n for n in notes)


@cuda
def test_cuda_graph_outputs_kept_by_the_caller_keep_their_values():
    m = _model("cuda", 64)
    fused = fuser.fuse(m, cuda_graphs=True)
    xs = [torch.randn(8, 64, device="cuda") for _ in range(6)]
    with torch.no_grad():
        kept = [fused(x) for x in xs]  # each replay would write over the previous output
        for x, y in zip(xs, kept):
            assert_close_to_eager(y, m(x))


@cuda
def test_cuda_graph_symbolic_sizes_and_training_step():
    """dynamic=True: one graph, CUDA graphs per size seen; a training step's gradients match eager."""
    m = _model("cuda", 64)
    ref = _model("cuda", 64)
    compiled = torch.compile(m, backend="fuser", mode="reduce-overhead", dynamic=True)
    with torch.no_grad():
        for rows in (7, 11, 7, 13, 11):
            x = torch.randn(rows, 64, device="cuda")
            assert_close_to_eager(compiled(x), ref(x))
    for step in range(4):
        x = torch.randn(16, 64, device="cuda")
        loss = compiled(x).square().mean()
        loss.backward()
        ref(x).square().mean().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert_close_to_eager(p.grad, q.grad, scale=10)
            p.grad = q.grad = None


class Cache(nn.Module):
    """A KV-cache-like buffer written at a position each call, then read through a fused region.
    `how`: "index" (cache[:, :, pos] = k, an index_put), "index_copy", "accumulate" (index_put with
    accumulate: not an overwrite) or "read_before" (the old cache is also read by a region that runs
    after the write: the write must not be in place)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.randn(2, 3, 37, 8))

    def forward(self, k, pos):
        old = self.cache * 2 if self.how == "read_before" else None
        if self.how == "index_copy":
            self.cache.index_copy_(2, pos, k)
        elif self.how == "accumulate":
            self.cache.index_put_((torch.arange(2, device=k.device)[:, None, None], torch.arange(3, device=k.device)[:, None], pos),
                                  k, accumulate=True)
        else:
            self.cache[:, :, pos] = k
        out = torch.softmax(self.cache.float() * 0.5, dim=-1).sum(-2)
        return out if old is None else out + old.sum(-2)


@pytest.mark.parametrize("how", ["index", "index_copy", "accumulate", "read_before"])
def test_a_mutated_input_is_written_in_place_only_where_that_is_exact(device, how):
    """A buffer written at new positions each call: outputs and the buffer follow eager's over calls.
    An overwrite (index_put, index_copy) runs in place on the buffer, with no copy_ back; a write that
    accumulates, or one whose old value a later kernel still reads, keeps the copy."""
    torch.manual_seed(0)
    m, ref = Cache(how).to(device), Cache(how).to(device)
    ref.load_state_dict(m.state_dict())
    fused = fuser.fuse(m, dynamic=False)
    with torch.no_grad():
        for p in ([5], [0], [36]):
            k = torch.randn(2, 3, 1, 8, device=device)
            pos = torch.tensor(p, device=device)
            assert_close_to_eager(fused(k, pos), ref(k, pos))
            assert_close_to_eager(m.cache, ref.cache)
    code = fused.code
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    in_place = how in ("index", "index_copy")
    copies_back = "Tensor_copy_(" in code or "aten.copy_" in code
    assert copies_back != in_place, code
    assert (any("written in place" in n for n in fused.report.notes)) == in_place
    assert fused.report.regions  # the read after the write is fused


class RotaryCache(nn.Module):
    """A decode step's cache write: the keys rotated (RoPE: cos, sin over the head dim), then written with
    the values at `pos` (`cache[:, :, pos] = x`, an index_put each), the queries rotated beside them (more
    tokens than keys: another shape), attention over the whole cache after."""

    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("keys", torch.randn(2, 3, 37, 24).to(dtype))
        self.register_buffer("values", torch.randn(2, 3, 37, 24).to(dtype))

    def forward(self, q, k, v, pos, cos, sin):
        def rotate(x):
            return x * cos + torch.cat((-x[..., 12:], x[..., :12]), -1) * sin
        self.keys[:, :, pos] = rotate(k)
        self.values[:, :, pos] = v
        scores = (torch.matmul(rotate(q), self.keys.transpose(-1, -2)) * 0.2).float().softmax(-1)
        return torch.matmul(scores.to(q.dtype), self.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cache_is_written_by_the_kernel_that_makes_its_keys(device, dtype):
    """The rotated keys and the values are stored into the cache at the new positions by the kernel that
    rotates the keys and the queries (one launch, not a kernel and two index_put_), in place: no copy of
    the cache, no copy back.  Positions negative (from the end, as eager) and at both ends; keys not
    contiguous.  Outputs and the cache follow eager's over calls, against eager in fp64 rounded once (the
    kernel rounds the rotation once, eager's fp16 at every op)."""
    torch.manual_seed(0)
    m, ref = RotaryCache(dtype).to(device), RotaryCache(torch.float64).to(device)
    ref.load_state_dict({name: t.double() for name, t in m.state_dict().items()})
    fused = fuser.fuse(m, dynamic=False)
    cos, sin = torch.randn(24, device=device, dtype=dtype), torch.randn(24, device=device, dtype=dtype)
    with torch.no_grad():
        for p in ([5, -2], [0, 36], [36, 11]):
            q = torch.randn(2, 3, 4, 24, device=device, dtype=dtype)
            k = torch.randn(2, 2, 3, 24, device=device, dtype=dtype).transpose(1, 2)
            v = torch.randn(2, 3, 2, 24, device=device, dtype=dtype)
            pos = torch.tensor(p, device=device)
            want = ref(*(t.double() for t in (q, k, v)), pos, cos.double(), sin.double())
            assert_close_to_eager(fused(q, k, v, pos, cos, sin), want.to(dtype))
            assert_close_to_eager(m.keys, ref.keys.to(dtype))
            assert_close_to_eager(m.values, ref.values.to(dtype))
    code, report = fused.code, fused.report
    assert not report.all_fallbacks and "index_put" not in code and "copy_" not in code, code
    (region,) = [r for r in report.regions if "aten.index_put.default" in r.ops]
    assert region.ops.count("aten.index_put.default") == 2 and "aten.neg.default" in region.ops, report
    assert region.source.count("in place, at its indexed positions") == 2, region.source  # its header: k and v


def test_a_cache_write_beside_symbolic_sizes_keeps_the_graph_fused(device):
    """A cache write (static sizes) beside work over a length that varies: a kernel over symbolic sizes allocates
    its own outputs, so the write keeps a kernel of its own, over static sizes, apart from the symbolic one (not
    a fallback of the whole graph); cache and output follow eager's over lengths."""
    def f(cache, pos, k, w):
        cache[:, pos] = k * 2
        return (w * k).exp()

    torch.manual_seed(0)
    mine = torch.randn(3, 10, 4, device=device)
    theirs = mine.clone()
    compiled = torch.compile(f, backend="fuser")
    k, pos = torch.randn(3, 2, 4, device=device), torch.tensor([1, 7], device=device)
    before = len(fuser.reports())
    for t in (7, 9, 11):
        w = torch.randn(t, 3, 2, 4, device=device)
        assert_close_to_eager(compiled(mine, pos, k, w), f(theirs, pos, k, w))
        assert_close_to_eager(mine, theirs)
    reports = fuser.reports()[before:]
    assert reports and not [r.all_fallbacks for r in reports if r.all_fallbacks], reports
    (last,) = [r for r in reports if any(x.symbolic for x in r.regions)]
    assert [("aten.index_put.default" in x.ops, x.symbolic) for x in last.regions] == [(True, False), (False, True)], last


def test_a_cache_write_stays_eager_under_deterministic_algorithms(device):
    """Repeated positions: eager's deterministic index_put writes them in order, our kernel's lanes in no order;
    under torch.use_deterministic_algorithms the write stays eager's, with the reason."""
    torch.manual_seed(0)
    m, ref = RotaryCache(torch.float32).to(device), RotaryCache(torch.float32).to(device)
    ref.load_state_dict(m.state_dict())
    cos, sin = torch.randn(24, device=device), torch.randn(24, device=device)
    q, k, v = torch.randn(2, 3, 4, 24, device=device), torch.randn(2, 3, 2, 24, device=device), torch.randn(2, 3, 2, 24, device=device)
    pos = torch.tensor([4, 4], device=device)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fused = fuser.fuse(m, dynamic=False)
        with torch.no_grad():
            assert_close_to_eager(fused(q, k, v, pos, cos, sin), ref(q, k, v, pos, cos, sin))
            assert_close_to_eager(m.keys, ref.keys)
    finally:
        torch.use_deterministic_algorithms(was)
    assert not any("aten.index_put.default" in r.ops for r in fused.report.regions), fused.report
    assert any("deterministic" in u.reason for u in fused.report.unfused if "index_put" in u.op), fused.report


def test_a_cache_write_out_of_range_raises(device):
    """An index past the cache raises, as eager's does, the cache left as it was (on CPU: the kernel flags it,
    and the launch puts back what its in-range lanes wrote; on the GPU a device-side assert, as eager's, ends
    the process, so not tested there)."""
    if device != "cpu":
        pytest.skip("CUDA: eager and fuser both stop on a device-side assert, which ends the process")
    torch.manual_seed(0)
    m = RotaryCache(torch.float32)
    fused = fuser.fuse(m, dynamic=False)
    cos, sin = torch.randn(24), torch.randn(24)
    q, k, v = torch.randn(2, 3, 4, 24), torch.randn(2, 3, 2, 24), torch.randn(2, 3, 2, 24)
    with torch.no_grad():
        fused(q, k, v, torch.tensor([1, 2]), cos, sin)
        assert any("aten.index_put.default" in r.ops for r in fused.report.regions), fused.report
        for bad in ([37, 1], [2, -38]):
            with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
                m(q, k, v, torch.tensor(bad), cos, sin)
            before = m.keys.clone()
            with pytest.raises(RuntimeError, match="index out of bounds for dimension 2 with size 37"):
                fused(q, k, v, torch.tensor(bad), cos, sin)
            assert torch.equal(m.keys, before)  # eager checks every index before it writes: nothing written


class StaticLayer(torch.nn.Module):
    """transformers 5.x's StaticCache layer: new keys written at `arange(n) + length`, a 0-d buffer the call
    advances; `read_after`: the length is read again after it was advanced (by the returned sum)."""

    def __init__(self, read_after=False):
        super().__init__()
        self.read_after = read_after
        self.register_buffer("length", torch.tensor(3))
        self.register_buffer("keys", torch.randn(2, 3, 37, 8))

    def forward(self, k):
        pos = torch.arange(k.shape[-2], device=k.device) + self.length
        self.length.add_(k.shape[-2])
        self.keys.index_copy_(2, pos, k * 2)
        out = torch.softmax(self.keys.float() * 0.5, dim=-1).sum(-2)
        return out * self.length if self.read_after else out


def test_counters_advanced_in_place_share_one_launch(device):
    """Every layer's cache advances its own length (`length.add_(n)`, run in place where AOT's copy back
    was): the adds, back to back at the graph's end, run as one foreach call (one multi-tensor launch, not
    one a layer).  Lengths and caches follow eager's over calls."""
    torch.manual_seed(0)
    m, ref = nn.Sequential(StaticLayer(), StaticLayer()).to(device), nn.Sequential(StaticLayer(), StaticLayer()).to(device)
    ref.load_state_dict(m.state_dict())
    fused = fuser.fuse(lambda k: m[1](m[0](k)[..., None, :].expand(2, 3, 2, 8)), dynamic=False)
    with torch.no_grad():
        for _ in range(3):
            k = torch.randn(2, 3, 2, 8, device=device)
            assert_close_to_eager(fused(k), ref[1](ref[0](k)[..., None, :].expand(2, 3, 2, 8)))
            for a, b in zip(m, ref):
                assert_close_to_eager(a.keys, b.keys)
                assert int(a.length) == int(b.length)
    code = fused.code
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    assert code.count("_foreach_add_(") == 1 and "add_.Tensor" not in code, code
    assert any("2 in-place updates of mutated inputs in one foreach launch" in n for n in fused.report.notes)


@pytest.mark.parametrize("read_after, dynamic", [(False, False), (True, False), (False, True)],
                         ids=["", "read_after", "dynamic"])
def test_a_counter_advanced_in_place_is_written_last(device, read_after, dynamic):
    """The cache's length, `length.add_(n)`: AOT makes it an add and a copy_ back at the graph's end; the add
    runs in place where the copy_ was (last: every read before it sees the old length), no copy.  Where the
    program reads the new length after advancing it, those reads compute the add again from the old length
    (fold.recompute_past_eager: the copy_ is an eager op the add feeds), so there too the add runs in place,
    no copy.  The cache and the length follow eager's over calls; over a symbolic count of new keys too (the
    add reads a size)."""
    torch.manual_seed(0)
    m, ref = StaticLayer(read_after).to(device), StaticLayer(read_after).to(device)
    ref.load_state_dict(m.state_dict())
    fused = fuser.fuse(m, dynamic=dynamic)
    with torch.no_grad():
        for n in (2, 3, 2) if dynamic else (1, 1, 2):  # dynamic: past 0/1, so the count is a size symbol
            k = torch.randn(2, 3, n, 8, device=device)
            assert_close_to_eager(fused(k), ref(k))
            assert_close_to_eager(m.keys, ref.keys)
            assert int(m.length) == int(ref.length)
    code = fused.code
    assert not fused.report.all_fallbacks, fused.report.all_fallbacks
    assert "Tensor_copy_(" not in code and "aten.copy_" not in code and "aten.add_.Tensor(" in code, code
    assert "2 mutated inputs written in place" in " ".join(fused.report.notes), fused.report.notes


@cuda
def test_cuda_graph_replay_writes_a_buffer_in_place():
    """Under CUDA graphs the in-place write of a buffer is part of the replay: the buffer and the
    outputs follow eager's over calls."""
    torch.manual_seed(0)
    m, ref = Cache("index").cuda(), Cache("index").cuda()
    ref.load_state_dict(m.state_dict())
    fused = fuser.fuse(m, cuda_graphs=True, dynamic=False)
    with torch.no_grad():
        for p in range(6):
            k = torch.randn(2, 3, 1, 8, device="cuda")
            pos = torch.tensor([p * 5], device="cuda")
            assert_close_to_eager(fused(k, pos), ref(k, pos))
            assert_close_to_eager(m.cache, ref.cache)
    assert any("replayed as CUDA graphs" in n for n in fused.report.notes), fused.report.notes


def test_an_interpreted_kernel_leaves_triton_language_as_it_was():
    """A CPU region whose kernel calls Triton's @jit helpers (the softmax's tl.max and tl.sum) runs
    through the interpreter, which patches triton.language while it runs.  Afterwards the language is
    as it was, so a kernel compiled for the GPU next in the same process builds its own IR (the
    interpreter's leftover patches made it fail, depending on which test ran first)."""
    import triton.language as tl

    def names(obj):
        return {k: v for k, v in vars(obj).items()}

    before = [names(o) for o in (tl, tl.core, tl.math, tl.core.tensor)]
    x = torch.randn(3, 37, 21).transpose(1, 2)
    f = fuser.fuse(lambda t: torch.softmax(t * 2.0, dim=-1) + t.sum(-1, keepdim=True))
    assert_close_to_eager(f(x), torch.softmax(x * 2.0, dim=-1) + x.sum(-1, keepdim=True))
    assert f.report.regions
    after = [names(o) for o in (tl, tl.core, tl.math, tl.core.tensor)]
    for b, a in zip(before, after):
        changed = sorted(k for k in b.keys() | a.keys() if b.get(k) is not a.get(k))
        assert not changed, changed
    if torch.cuda.is_available():  # then the GPU's kernels compile as in a fresh process
        y = x.cuda()
        g = fuser.fuse(lambda t: torch.sigmoid(t) * t + 1.0)
        assert_close_to_eager(g(y), torch.sigmoid(y) * y + 1.0)
        assert g.report.regions and not g.report.all_fallbacks, g.report.all_fallbacks


@pytest.mark.parametrize("shared", [False, True], ids=["own_storage", "shared_storage"])
def test_donated_inputs_are_written_over_unless_they_share_storage(shared):
    """write_over_donated: an eager pointwise op whose donated input dies there becomes its in-place
    form, unless that input shares its storage with another input (AOT Autograd checks donated
    activations against the forward's inputs and outputs, not against each other)."""
    with FakeTensorMode():
        base = torch.empty(8)
        a, b = (base[:4], base[4:]) if shared else (torch.empty(4), torch.empty(4))
        prod = a * 2
        total = prod + b
    graph = torch.fx.Graph()
    pa, pb = graph.placeholder("a"), graph.placeholder("b")
    pa.meta["val"], pb.meta["val"] = a, b
    mul = graph.call_function(torch.ops.aten.mul.Tensor, (pa, 2.0))
    mul.meta["val"] = prod
    add = graph.call_function(torch.ops.aten.add.Tensor, (mul, pb))
    add.meta["val"] = total
    graph.output((add,))
    written = write_over_donated(graph, {pa})
    assert (mul.target is torch.ops.aten.mul_.Tensor) is not shared and (mul.name in written) is not shared, written


def test_kernels_compile_ahead_in_the_compile_pool(device, monkeypatch):
    """On the GPU a static kernel starts compiling when its graph is compiled, in a thread of the compile pool
    (Triton's compiles run side by side, mostly outside the GIL: an H200's BERT training step compiled in 16.0 s
    instead of 26.7, run 214); its first launch waits for it and launches what it compiled.  Interpreted
    kernels (CPU) compile nothing ahead."""
    import threading
    from triton.runtime.jit import JITFunction
    threads = []
    warmup = JITFunction.warmup

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return warmup(self, *args, **kwargs)
    monkeypatch.setattr(JITFunction, "warmup", recorded)
    fn = lambda x, y: (x * y + 1).relu() * 3  # noqa: E731
    x, y = torch.randn(37, 53, device=device), torch.randn(53, device=device)
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, y), fn(x, y))
    assert fused.report.regions
    if device == "cpu":
        assert threads == []
    else:
        assert threads and all(t.startswith("fuser-compile") for t in threads), threads
