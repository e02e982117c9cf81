"""Kernels over symbolic sizes: what Dynamo marks dynamic (automatic dynamic, dynamic=True,
mark_dynamic) stays symbolic in the kernels, so a model called at many lengths compiles a bounded
number of graphs, matches eager every time and runs fused kernels every time."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.runtime import RegionKernel
from tolerances import assert_close_to_eager, tol

transformers = pytest.importorskip("transformers")


class Block(nn.Module):
    """Norms, a gated MLP, a KV-cache append (cat), attention-like softmax over the cache length,
    slices at both ends, row means: every kind of region over a varying length."""

    def __init__(self, d=24):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.w = nn.Parameter(torch.randn(d))
        self.up = nn.Linear(d, 2 * d)

    def forward(self, x, past):
        h = self.ln(x)
        r = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        g, u = self.up(r).chunk(2, -1)
        y = F.silu(g) * u
        kv = torch.cat([past, y[:, -1:]], 1)
        att = torch.softmax(y @ kv.transpose(1, 2) / 5.0, -1)
        return att.sum(-1) + y.mean(-1), kv * 2, F.log_softmax(x[:, 1:], -1)


def _forward_graphs(before: int) -> list:
    return [r for r in fuser.reports()[before:] if not any("backward" in n for n in r.notes)]


LENGTHS = [5, 7, 9, 12, 17, 3, 30, 11, 8, 21, 6, 14]


@pytest.mark.parametrize("mode", ["default", "dynamic", "mark_dynamic"])
def test_twelve_lengths_compile_at_most_three_graphs(mode, device):
    torch.manual_seed(0)
    model = Block().to(device)
    compiled = torch.compile(model, backend="fuser", dynamic=True if mode == "dynamic" else None)
    before = len(fuser.reports())
    with torch.no_grad():
        for t in LENGTHS:
            x, past = torch.randn(2, t, 24, device=device), torch.randn(2, t + 2, 24, device=device)
            if mode == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 1)
                torch._dynamo.mark_dynamic(past, 1)
            assert_close_to_eager(compiled(x, past), model(x, past))
            latest = fuser.last_report()
            assert len(latest.regions) >= 4 and not latest.fallback, latest
    graphs = _forward_graphs(before)
    assert len(graphs) <= 3, [str(g) for g in graphs]
    assert graphs[-1].regions[0].symbolic  # the last graph is generic over the length


def test_fuse_thirteen_lengths_and_report_values_at_each_call(device):
    """fuse() follows torch.compile: one generic recompile, not one per length.  The report gives
    each region's bytes as a formula and its value at the sizes of the latest call."""
    def chain(a, b):
        return F.gelu(a + b) * 0.5 + a

    fused = fuser.fuse(chain)
    before = len(fuser.reports())
    for t in range(3, 16):
        a, b = torch.randn(3, t, 13, device=device), torch.randn(13, device=device)
        assert_close_to_eager(fused(a, b), chain(a, b))
        (r,) = fused.report.regions
        assert r.bytes_fused == 4 * (2 * 3 * t * 13 + 13)  # a read and the result written once, b once
        assert r.bytes_unfused > 3 * r.bytes_fused
    assert len(_forward_graphs(before)) <= 4
    assert r.symbolic and "over symbolic sizes" in str(fused.report)
    assert "s" in str(r.bytes_fused_expr) and "(=" in r.source  # the header: formula (= value)


def test_long_and_short_rows_of_one_symbolic_kernel(device):
    """The persistent (row in registers) and looped variants of one kernel, chosen per call by the
    row length; the same kernel serves both."""
    def f(x):
        return torch.softmax(x * 1.5, -1) - x.mean(-1, keepdim=True)

    graphs = []
    compiled = torch.compile(f, backend=_keeping(graphs), dynamic=True)
    for n in (300, 17000, 301):
        x = torch.randn(3, n, device=device)
        assert_close_to_eager(compiled(x), f(x))
    kernels = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    assert kernels and {key[0] for k in kernels for key in k.variants} == {True, False}


def test_looped_rows_get_their_length_built_in_a_few_times(device):
    """A looped reduction gets a variant with its row length as a constant for the first few lengths
    it meets (keyed by the exact length), then shares the generic variant: all of them correct."""
    from fuser.runtime import CONSTANT_ROWS

    def f(x):
        return torch.log_softmax(x, -1)

    graphs = []
    compiled = torch.compile(f, backend=_keeping(graphs), dynamic=True)
    lengths = [16400 + 3 * i for i in range(CONSTANT_ROWS + 2)]
    for n in lengths + lengths[:1]:
        x = torch.randn(2, n, device=device)
        assert_close_to_eager(compiled(x), f(x))
    kernels = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    looped = {key[3] for k in kernels for key in k.variants if not key[0]}
    assert looped == set(lengths[:CONSTANT_ROWS]) | {None}


def test_non_contiguous_inputs_at_symbolic_sizes(device):
    """An input whose strides are not the captured ones runs a variant that takes them as arguments."""
    def f(x, y):
        return torch.relu(x * 2 + y).sum(-1) + x.amax(-1)

    graphs = []
    compiled = torch.compile(f, backend=_keeping(graphs), dynamic=True)
    x, y = torch.randn(6, 10, device=device), torch.randn(6, 10, device=device)
    assert_close_to_eager(compiled(x, y), f(x, y))
    (kernel,) = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    assert kernel.symbols
    xt = torch.randn(10, 7, device=device).t()  # [7, 10], column-major
    sizes = [dict(zip(map(str, kernel.symbols), kernel.seen))[str(s)] for s in kernel.symbols]
    sizes = [7 if v == 6 else v for v in sizes]
    out = kernel(xt, torch.randn(7, 10, device=device), *sizes)[0]
    assert out.shape == (7,)
    assert any(key[2] for key in kernel.variants)  # the generic-strides variant ran


def test_a_call_at_sizes_seen_before_is_bound(device, monkeypatch):
    """The first call at some sizes works out layouts, variant and launch config; later calls at those
    sizes reuse them (new values, new addresses), an input in another layout at the same sizes takes
    the general path again (and gets its own variant), and at most BOUND_SIZES sizes are kept."""
    from fuser.runtime import BOUND_SIZES

    def f(x, y):
        return torch.relu(x * 2 + y).sum(-1) + x.amax(-1)

    graphs = []
    compiled = torch.compile(f, backend=_keeping(graphs), dynamic=True)
    compiled(torch.randn(6, 10, device=device), torch.randn(6, 10, device=device))
    (kernel,) = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    general, run = [], RegionKernel._run_dynamic
    monkeypatch.setattr(RegionKernel, "_run_dynamic", lambda self, *a: general.append(a) or run(self, *a))
    for _ in range(3):
        x, y = torch.randn(6, 10, device=device), torch.randn(6, 10, device=device)
        assert_close_to_eager(compiled(x, y), f(x, y))
    assert general == [] and len(kernel._at) == 1
    xt, y = torch.randn(10, 6, device=device).t(), torch.randn(6, 10, device=device)
    (out,) = kernel(xt, y, *kernel.seen)
    assert_close_to_eager(out, f(xt, y))
    assert len(general) == 1 and any(key[2] for key in kernel.variants)
    for n in range(7, 7 + BOUND_SIZES + 2):
        x, y = torch.randn(n, 10, device=device), torch.randn(n, 10, device=device)
        assert_close_to_eager(compiled(x, y), f(x, y))
    assert len(kernel._at) == BOUND_SIZES and len(graphs) == 1


def test_kernel_refuses_sizes_it_was_not_given(device):
    graphs = []
    compiled = torch.compile(lambda x: torch.exp(x) * 2 + 1, backend=_keeping(graphs), dynamic=True)
    compiled(torch.randn(4, 9, device=device))
    (kernel,) = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    with pytest.raises(RuntimeError, match="made for"):
        kernel(torch.randn(4, 9, device=device), *[v + 1 for v in kernel.seen])


def test_a_reduction_over_an_empty_row_at_run_time(device):
    """A symbolic row length that is 0 in one call: no kernel serves it (eager answers with an
    identity or an error), so the graph runs as given for that call, and fused again after."""
    from fuser.backend import GraphRunner
    from fuser.runtime import NotForTheseSizes
    from fuser.report import FusionReport

    def f(x):
        return (x[:, 2:] * 2).sum(-1) + 1

    graphs = []
    compiled = torch.compile(f, backend=_keeping(graphs), dynamic=True)
    x = torch.randn(5, 7, device=device)
    assert_close_to_eager(compiled(x), f(x))
    (kernel,) = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    sizes = {str(s): v for s, v in kernel.seen_sizes().items()}
    empty = torch.randn(5, 2, device=device)
    with pytest.raises(NotForTheseSizes):
        kernel(empty, *[2 if v == 7 else v for v in sizes.values()])

    calls = []
    def fused(*args):
        calls.append(args)
        if len(calls) == 1:
            raise NotForTheseSizes("a reduction over 0 elements")
        return ("fused",)

    runner = GraphRunner(fused, lambda *args: ("given",), FusionReport())
    assert runner(1) == ("given",) and runner(2) == ("fused",) and not runner.report.fallback
    for n in (7, 2, 9):  # end to end (Dynamo guards the slice's length: a graph of its own for n = 2)
        x = torch.randn(5, n, device=device)
        assert_close_to_eager(compiled(x), f(x))


def test_training_with_batches_of_changing_length(device):
    torch.manual_seed(0)
    model = Block().to(device)
    twin = Block().to(device)
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="fuser")
    before = len(fuser.reports())
    for t in (5, 8, 11, 4):
        x, past = torch.randn(2, t, 24, device=device), torch.randn(2, t + 2, 24, device=device)
        losses = [sum(o.pow(2).mean() for o in m(x, past)) for m in (compiled, twin)]
        for loss in losses:
            loss.backward()
        assert_close_to_eager(losses[0], losses[1])
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_close_to_eager(p.grad, q.grad, scale=10)  # fp32 sums over rows in another order
            p.grad = q.grad = None
    reports = fuser.reports()[before:]
    assert len(reports) <= 4 and all(r.regions and not r.fallback for r in reports)
    assert any("backward" in n for r in reports for n in r.notes)


def test_hf_llama_at_several_lengths(device):
    """The reported crash: a tiny LLaMA called with a second sequence length."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).to(device).eval()
    compiled = torch.compile(model, backend="fuser")
    before = len(fuser.reports())
    with torch.no_grad():
        for t in (5, 8, 11, 13):
            ids = torch.randint(0, 97, (2, t), device=device)
            assert_close_to_eager(compiled(ids).logits, model(ids).logits, scale=10)
            latest = fuser.last_report()
            assert not latest.fallback and any(r.kind == "attention" for r in latest.regions), latest
    assert len(_forward_graphs(before)) <= 2


def _keeping(graphs: list):
    """The fuser backend, keeping each rewritten graph (to reach its kernels)."""
    from fuser import backend
    return backend.make_backend(lambda report, gm: graphs.append(gm))



@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_decode_loop_with_a_dynamic_cache(arch, device):
    """A hand-written greedy decode: prefill, then 32 steps of one token each with a DynamicCache
    growing by one; fused tokens equal the unfused model's, at most 3 forward graphs, and both the
    prefill and the decode steps run fused kernels."""
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64, attn_implementation="eager"))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, attn_implementation="eager"))
    model = model.to(device).eval()
    fused = fuser.fuse(model)
    prompt = torch.randint(0, 97, (1, 5), device=device)

    def decode(step):
        cache, ids, out, regions = transformers.DynamicCache(), prompt, [], []
        with torch.no_grad():
            for _ in range(33):
                logits = step(input_ids=ids, past_key_values=cache, use_cache=True).logits
                ids = logits[:, -1:].argmax(-1)
                out.append(int(ids))
                regions.append(len(fused.report.regions))
        return out, regions

    before = len(fuser.reports())
    got, regions = decode(fused)
    want, _ = decode(model)
    assert got == want
    assert len(_forward_graphs(before)) <= 3
    assert regions[0] > 0 and all(r > 0 for r in regions[1:]), regions  # prefill and every decode step


def test_index_math_prints_a_modulo_with_pythons_sign():
    """sympy's Mod (the divisor's sign, as Python's %) printed for Triton, whose % takes the dividend's: plain
    where the dividend is non-negative, else corrected; the host's Python prints it as it is."""
    import sympy
    from fuser.indexing import pyexpr, texpr
    x = sympy.Symbol("x", integer=True, nonnegative=True)
    s = sympy.Symbol("s0", integer=True, positive=True)
    y = sympy.Symbol("y", integer=True)
    assert texpr(sympy.Mod(x + 3 * s, s + 1)) == "((3*s0 + x) % (s0 + 1))"
    signed = texpr(sympy.Mod(y, s))
    c_mod = lambda a, b: a - b * int(a / b)  # noqa: E731  C's %: truncation toward zero
    for yv, sv in [(-7, 3), (7, 3), (-3, 3), (0, 5)]:
        inner = c_mod(yv, sv)
        assert signed == "(((y % s0) + s0) % s0)" and c_mod(inner + sv, sv) == yv % sv
    assert pyexpr(sympy.Mod(y, s)) == "(y % s0)"


SIZE_MATH = {  # sizes Dynamo writes with floor division of a negative, Python's %, ceil of a ratio
    "pad to a multiple (-(-n // 8) * 8)": lambda x: F.pad(x, (0, 0, 0, -(-x.shape[0] // 8) * 8 - x.shape[0])) * 2,
    "pad by (-n) % 8": lambda x: F.pad(x, (0, 0, 0, (-x.shape[0]) % 8)) * 2,
    "pad to ceil(n / 8) * 8": lambda x: F.pad(x, (0, 0, 0, math.ceil(x.shape[0] / 8) * 8 - x.shape[0])) * 2,
    "roll": lambda x: torch.roll(x, 3, 0) + 1,
}


@pytest.mark.parametrize("case", SIZE_MATH)
def test_size_math_over_negative_numbers_prints_with_pythons_rounding(case, device):
    """Floor division and % of a negative size expression (Python's rounding; Triton's `//` and `%` round as
    C's) and torch's PythonMod / CeilToInt in index math and host sizes: eager's values at each size, no
    fallback (the padded rows were left unwritten at n = 13 and 21, found by review)."""
    fn = SIZE_MATH[case]
    compiled = torch.compile(fn, backend="fuser", dynamic=True)
    for n in (13, 21, 16):
        x = torch.randn(n, 16, device=device)
        assert_close_to_eager(compiled(x), fn(x))
        report = fuser.last_report()
        assert not report.fallback and report.regions, report


def test_argmax_over_a_dynamic_row_length_stays_eager(device):
    """argmax has no looped kernel: over a row length that may pass one block (symbolic), a region with it
    would be refused at run time at such a length, and the graph with it; it stays eager, with the reason."""
    fn = lambda x: (x.argmax(1), x.sum(1))  # noqa: E731  siblings: they would merge
    compiled = torch.compile(fn, backend="fuser", dynamic=True)
    for n in (100, 300, 20000):
        x = torch.randn(3, n, device=device)
        got, want = compiled(x), fn(x)
        assert torch.equal(got[0], want[0])
        assert_close_to_eager(got[1], want[1], scale=10)
        report = fuser.last_report()
        assert not report.fallback, report
    assert any("argmax over a row length that may pass" in u.reason for u in report.unfused), report.unfused


class _Ema(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        self.ema.copy_(self.ema * 0.9 + 0.1 * x.mean(0))
        return x * 2 + 1


def _mutates_its_inputs(x, y):
    x.mul_(2).add_(1)
    y[:, 0] = x.sum(1)
    return x.exp()[:, :2], y.t()


@pytest.mark.parametrize("case", ["ema", "batch_norm_stats", "inputs"])
def test_writes_into_buffers_and_inputs_at_symbolic_sizes(case, device):
    """A buffer updated in place (an EMA, BatchNorm's running statistics recalibrated under no_grad) or an
    input the program writes into keeps every write at the second and third sizes, where the kernels are
    made over symbolic sizes (their outputs new memory: the write back into the buffer had been dropped as
    if a kernel had stored into it)."""
    torch.manual_seed(0)
    if case == "inputs":
        fused = fuser.fuse(_mutates_its_inputs)
        for n in (5, 7, 9):
            x, y = torch.randn(n, 6, device=device), torch.randn(n, 3, device=device)
            xr, yr = x.clone(), y.clone()
            assert_close_to_eager(fused(x, y), _mutates_its_inputs(xr, yr))
            assert_close_to_eager((x, y), (xr, yr))
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report
        return
    model = (_Ema() if case == "ema" else nn.BatchNorm2d(4).train()).to(device)
    twin = copy.deepcopy(model)
    fused = fuser.fuse(model)
    with torch.no_grad():
        for shape in ((5, 8), (7, 8), (9, 8)) if case == "ema" else ((3, 4, 5, 7), (2, 4, 3, 3), (5, 4, 6, 2)):
            x = torch.randn(shape, device=device)
            assert_close_to_eager(fused(x), twin(x))
            assert_close_to_eager(list(model.buffers()), list(twin.buffers()))
    assert fused.report.regions and not fused.report.all_fallbacks, fused.report


_FLOAT_SIZES = {
    "interpolate nearest x1.5": (lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest").exp() * 2,
                                 lambda n: (torch.randn(2, 3, n, n + 2),)),
    "interpolate bilinear x1.5": (lambda x: F.interpolate(x * 2, scale_factor=1.5, mode="bilinear").sin(),
                                  lambda n: (torch.randn(2, 3, n, n),)),
    "slice to int(0.7 * T)": (lambda x: (x * 2)[..., :int(0.7 * x.shape[-1])].cos() + 1, lambda n: (torch.randn(3, n),)),
    "one_hot to a capacity": (lambda x, i: F.one_hot(i.clamp(max=int(1.25 * x.shape[0] / 4)), int(1.25 * x.shape[0] / 4) + 1)
                              .float() * x[:, None], lambda n: (torch.randn(3 * n), torch.randint(0, 8, (3 * n,)))),
}


@pytest.mark.parametrize("case", list(_FLOAT_SIZES))
def test_sizes_computed_in_floats(case, device):
    """Sizes a program computes in floats (`int(0.7 * T)`, interpolate's floor(1.5 * H), an expert capacity):
    symbolic from the second size on, printed as Python's float arithmetic (fp64 in a kernel) and rounded as
    int(), floor() and ceil() are (they were printed as written: a NameError, and the graph ran eagerly)."""
    fn, make = _FLOAT_SIZES[case]
    fused = fuser.fuse(fn)
    for n in (10, 7, 13):
        args = [a.to(device) for a in make(n)]
        assert_close_to_eager(fused(*args), fn(*args))
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report


def test_a_flip_under_a_pixel_shuffle_at_symbolic_sizes(device):
    """The flip's `W - 1 - w` under the shuffle's `% 2` and `// 2` may be negative over symbolic sizes: Python's
    remainder and floor there (the region had been left to eager), and `2 * s - 1` is not a multiple of 2
    (the divisibility test read (2s - 1) / 2 as s - 1/2, a polynomial: a rational in the index)."""
    def fn(h):
        u = F.pixel_shuffle(h, 2)
        return (u + torch.flip(u, dims=[-1])).exp()
    fused = fuser.fuse(fn)
    for shape in ((2, 8, 6, 10), (3, 8, 4, 6), (1, 8, 5, 3)):
        x = torch.randn(shape, device=device)
        assert_close_to_eager(fused(x), fn(x))
        assert [r.kind for r in fused.report.regions] == ["pointwise"] and not fused.report.all_fallbacks, fused.report


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_padding_modes_at_symbolic_sizes(mode, device):
    """Circular padding's wrapped rows at a symbolic height read a row that is a function of sizes alone
    (`H - 1`): its bound, a scalar condition, is dropped where it holds at every size (Triton's interpreter
    cannot mask with a scalar: the graph had run eagerly from the second size on)."""
    def fn(x):
        return F.pad(x.sin(), (2, 3, 1, 1), mode=mode) * 2
    fused = fuser.fuse(fn)
    for n in (9, 11, 6):
        x = torch.randn(2, 3, n, n + 2, device=device)
        assert_close_to_eager(fused(x), fn(x))
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report


def _rope_cat(x):  # RoPE's inverse frequencies, an arange of step 2, read twice through a cat
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = torch.arange(x.shape[-2], device=x.device).float()[:, None] * inv[None, :]
    return x * torch.cat([ang, ang], -1).cos()


def _strided_write(x, v):  # a strided slice_scatter from a symbolic start
    y = x.clone() * 2
    y[:, x.shape[1] - 5::3] = v
    return y + 1


_BRACKETS = {  # (function, its inputs at length n)
    "arange of step 2 under a cat": (_rope_cat, lambda n: (torch.randn(2, n, 2 * n),)),
    "slice of a stepped arange": (lambda x: x + torch.arange(0, 2 * x.shape[-1] + 6, 2, device=x.device)[3:].float(),
                                  lambda n: (torch.randn(2, n, n),)),
    "strided write at a symbolic start": (_strided_write, lambda n: (torch.randn(2, n + 3),
                                                                     torch.randn(2, len(range(n - 2, n + 3, 3))))),
    "index from the end of a cat": (lambda x, i: torch.cat([x, x[:1]])[i] * 2,
                                    lambda n: (torch.randn(n, 3), torch.tensor([-(n + 1), -n, 0, n]))),
    "pool to 3 from a ceil-mode pool": (lambda h: F.adaptive_avg_pool2d(F.avg_pool2d(h, 2, ceil_mode=True), 3).exp() + 1,
                                        lambda n: (torch.randn(1, 2, 2 * n - 4, 2 * n - 4),)),
    "a pad's last column": (lambda x: F.pad(x, (0, 1), value=2.0)[..., -1].sin() + x[..., 0],
                            lambda n: (torch.randn(3, n),)),
    "a cat's last column": (lambda x: torch.cat([x, x[:, :1] * 3], 1)[:, -1] + 1, lambda n: (torch.randn(3, n),)),
}


@pytest.mark.parametrize("case", list(_BRACKETS))
def test_size_expressions_keep_their_brackets(case, device):
    """Index math spliced a symbolic size or step next to other operators unbracketed (`i - s0 - 5` for
    `i - (s0 - 5)`, `x % 8 - 4 * 2` for an arange of step 2 read at `x % 8 - 4`, `-s0 + 1` for `-(s0 + 1)`):
    silent wrong answers, and range checks that raised where eager does not.  A branch whose bound is decided
    by sizes alone (a pad's last column) is taken or skipped at compile time."""
    fn, make = _BRACKETS[case]
    fused = fuser.fuse(fn)
    for n in (8, 10, 14, 3):
        args = [a.to(device) for a in make(n)]
        assert_close_to_eager(fused(*args), fn(*args))
        assert not fused.report.all_fallbacks, fused.report
    assert fused.report.regions, fused.report


def test_a_bound_on_sizes_alone_that_no_range_decides(device):
    """The backward of a strided slice of a cat: whether the appended column sits at an even position depends on
    the size's parity, a bound no range decides at compile time: it is computed per lane (a scalar condition in a
    mask: Triton's interpreter refused it, and the backward graph ran eagerly)."""
    def fn(x):
        return torch.cat([x, x[:, :1] * 2], 1)[:, ::2].sin()

    fused = fuser.fuse(fn)
    for n in (9, 12, 15, 10):
        x = torch.randn(3, n, device=device, requires_grad=True)
        out = fused(x)
        assert_close_to_eager(out, fn(x))
        got = torch.autograd.grad(out.sum(), x)
        assert_close_to_eager(got, torch.autograd.grad(fn(x).sum(), x))
        assert not fused.report.all_fallbacks, fused.report


_FROM_THE_END = {
    "last two columns": lambda x: x[:, -2:].exp() * x[:, :2],
    "the last half": lambda x: x[:, -(x.shape[1] // 2):].sin() + 1,
    "a column from the end": lambda x: x[:, -3].tanh()[:, None] * x,
    "a strided tail": lambda x: x[:, -5::2].square(),
    "a narrow from half way back": lambda x: torch.narrow(x, 1, -(x.shape[1] // 2), 2).exp() * 2,  # start s - s // 2
}


@pytest.mark.parametrize("case", list(_FROM_THE_END))
def test_slices_from_the_end_at_symbolic_sizes(case, device):
    """A slice or select from the end (`x[:, -2:]`, Longformer's and XLM's masks) over a symbolic length: the start
    is size + start there (it had been refused as "may be negative": the region, and the backward's slice_scatter
    with it, left to eager).  Forward and gradient against eager at four lengths."""
    fn = _FROM_THE_END[case]
    fused = fuser.fuse(fn)
    for n in (8, 11, 14, 6):
        x = torch.randn(4, n, device=device, requires_grad=True)
        out = fused(x)
        assert_close_to_eager(out, fn(x))
        assert_close_to_eager(torch.autograd.grad(out.square().sum(), x), torch.autograd.grad(fn(x).square().sum(), x))
        reports = [fused.report] + fused.reports
        assert not any("negative" in u.reason for r in reports for u in r.unfused), [u for r in reports for u in r.unfused]
        assert fused.report.regions and not fused.report.all_fallbacks, fused.report


def test_xlnets_relative_shift_at_symbolic_lengths(device):
    """XLNet's rel_shift (a reshape that drops a row, then another reshape): its index has a coefficient
    s*t - s, below zero term by term over the sizes' intervals, s*(t - 1) >= 0 factored.  Bounded factored, the
    scores and the softmax are one kernel at symbolic lengths (they had been refused one)."""
    def rel_shift(x, klen):
        b, n, i, j = x.shape
        x = x.reshape(b, n, j, i)[:, :, 1:, :].reshape(b, n, i, j - 1)
        return torch.index_select(x, 3, torch.arange(klen, device=x.device))

    def fn(ac, bd):
        return torch.softmax((ac + rel_shift(bd, ac.shape[2])) * 0.25, dim=-1)

    fused = fuser.fuse(fn)
    with torch.no_grad():
        for q in (8, 12, 9):
            ac, bd = torch.randn(2, 4, q, q, device=device), torch.randn(2, 4, q, 2 * q, device=device)
            assert_close_to_eager(fused(ac, bd), fn(ac, bd))
            assert fused.report.regions and not fused.report.unfused, fused.report


def test_a_cat_piece_no_index_reaches_is_not_loaded(device):
    """`cat([a, b], -1)[..., 0]` at a symbolic width reads a's piece only: b's branch, never taken at any size, is
    dropped whole (its load had been left in the kernel at an offset outside b, masked by the lanes alone)."""
    def fn(a, b):
        c = torch.cat([a * 2, b + 1], -1)
        return c[..., 0] * 3 + c[..., 1]

    fused = fuser.fuse(fn)
    for n in (3, 5, 7):
        a, b = torch.randn(4, n, device=device), torch.randn(4, 2, device=device)
        assert_close_to_eager(fused(a, b), fn(a, b))
    (r,) = fused.report.regions
    assert "tl.load(in1_ptr" not in r.source, r.source


def test_floats_computed_from_sizes_are_kernel_operands(device):
    """A float of sizes (BatchNorm's unbiased factor n / (n - 1) at a symbolic batch, a mean as sum / n) is an
    operand our kernels compute from the sizes they take (fp64, converted as eager converts a Python float): it
    had been left eager with every op around it ("an operand is a symbolic float").  BatchNorm1d training:
    outputs, gradients and running statistics against eager at four batches."""
    def fn(x):
        n = x.shape[0]
        return (x.sum(0) * (n / (n - 1)) + 1).relu(), x * (1.0 / n) + 2

    fused = fuser.fuse(fn, dynamic=True)
    for n in (5, 9, 7):
        x = torch.randn(n, 7, device=device)
        assert_close_to_eager(fused(x), fn(x))
        assert not any("symbolic float" in u.reason for u in fused.report.unfused), fused.report
    # what stays as it was: a division by a size that may be 0 (eager raises), a float an op reads as a number
    # (pow's exponent, elu's alpha), a float stored in 16 bits (rounded as eager rounds it)
    others = {"divide by n - 3": lambda x: (x * (x.shape[0] / (x.shape[0] - 3))).sin(),
              "pow": lambda x: x.abs() ** (1 / x.shape[0]),
              "elu": lambda x: F.elu(x, alpha=x.shape[0] / 7),
              "fill in fp16": lambda x: torch.full_like(x.half(), x.shape[0] / 3).float().sum()}
    for name, f in others.items():
        fused = fuser.fuse(f, dynamic=True)
        for n in (5, 9, 4):
            x = torch.randn(n, 7, device=device)
            assert_close_to_eager(fused(x), f(x))
            assert not fused.report.all_fallbacks, (name, fused.report)
    with pytest.raises(ZeroDivisionError):
        fuser.fuse(others["divide by n - 3"], dynamic=True)(torch.randn(3, 7, device=device))
    torch.manual_seed(3)
    bn = torch.nn.BatchNorm1d(6).to(device)
    twin = copy.deepcopy(bn)
    fused_bn = fuser.fuse(bn)
    for n in (5, 9, 7, 12):
        x = torch.randn(n, 6, device=device, requires_grad=True)
        out, ref = fused_bn(x), twin(x)  # (each call updates its module's running statistics once)
        assert_close_to_eager(out, ref)
        assert_close_to_eager(torch.autograd.grad(out.square().sum(), x), torch.autograd.grad(ref.square().sum(), x))
        assert not any("symbolic float" in u.reason for r in fused_bn.reports for u in r.unfused), fused_bn.reports
    assert_close_to_eager((bn.running_mean, bn.running_var), (twin.running_mean, twin.running_var))



class _FloatScaled(nn.Module):
    """Attention scaled by the module's float (`self.scaling`, as Hugging Face's attention modules keep it)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.scaling = 8 ** -0.5

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        p = torch.softmax(q @ k.transpose(-1, -2) * self.scaling, -1)
        return (p @ v).transpose(1, 2).reshape(b, t, 16)


def test_attention_scaled_by_a_module_float_in_training(device):
    """dynamic=True leaves a module's float unspecialised (a 0-d input tensor): the trace before autograd read the
    scale off it as a number, an extra the matcher refused, and the attention was left to its ops in training.
    Claimed now, on one graph at two lengths; outputs and gradients as eager's."""
    torch.manual_seed(0)
    model = _FloatScaled().to(device)
    fused = torch.compile(model, backend="fuser", dynamic=True)
    before = len(fuser.reports())
    for t in (9, 13):
        x = torch.randn(2, t, 16, device=device)
        out, ref = fused(x), model(x)
        assert_close_to_eager(out, ref)
        assert_close_to_eager(torch.autograd.grad(out.square().sum(), list(model.parameters())),
                              torch.autograd.grad(ref.square().sum(), list(model.parameters())))
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert sum(n.startswith("attention claimed before autograd") for n in notes) == 1, notes


def test_swins_window_padding_at_symbolic_sizes_in_training(device):
    """The trace before autograd over Swin's window padding (a constant pad by amounts computed from the sizes)
    under dynamic=True: torch's C++ kernel takes no symbolic sizes, its Python reference does; the whole claim
    had failed ("the trace before autograd failed"), now traced again under the Python dispatcher.  Its attention
    (two blocks: windows, then shifted windows with their mask) is claimed there: the module's float scale, which
    dynamic=True leaves unspecialised, had come into the score chain as a number read off a 0-d input tensor, an
    extra the matcher refused.  Two sizes (5 x 5 and 9 x 9 patches, padded to windows of 4) on one graph; outputs
    and every parameter's gradient as eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(12)
    model = transformers.SwinModel(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[2], num_heads=[2], window_size=4, drop_path_rate=0.0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")).to(device).train()
    fused = torch.compile(model, backend="fuser", dynamic=True)
    before = len(fuser.reports())
    for n in (20, 36):  # dynamic=True: sizes symbolic from the first call
        x = torch.randn(1, 3, n, n, device=device)
        out, ref = fused(x).last_hidden_state, model(x).last_hidden_state
        torch.testing.assert_close(out, ref, **tol(out.dtype, 10))
        w = torch.randn_like(ref)
        got = torch.autograd.grad((out * w).sum(), list(model.parameters()))
        want = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, **tol(g.dtype, 10))
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert not any("trace before autograd failed" in n for n in notes), notes
    assert not any(r.all_fallbacks for r in fuser.reports()[before:])
    assert sum(n.startswith("attention claimed before autograd") for n in notes) == 2, notes  # one graph, two blocks


@pytest.mark.parametrize("form", ["bmm", "einsum"])
def test_a_conv_nets_attention_over_its_pixels_compiles_once(device, form):
    """A conv net's attention over [B, C, H*W] (latent diffusion's AttnBlock: V·Pᵀ, not P·V): its last dim is
    the pixels', not a head dim, and it was fixed by a guard as one, so every image size compiled a graph of
    its own under dynamic=True (to Dynamo's recompile limit).  One graph over three sizes, its softmax fused."""
    def attn(q, k, v):
        b, c, h, w = q.shape
        q, k, v = (t.reshape(b, c, h * w) for t in (q, k, v))
        if form == "einsum":
            p = torch.einsum("bci,bcj->bij", q, k).mul(c ** -0.5).softmax(-1)
            return torch.einsum("bij,bcj->bci", p, v).reshape(b, c, h, w)
        s = torch.bmm(q.permute(0, 2, 1), k) * c ** -0.5
        return torch.bmm(v, s.softmax(2).permute(0, 2, 1)).reshape(b, c, h, w)
    fused = fuser.fuse(attn, dynamic=True)
    for hw in ((5, 7), (4, 6), (3, 9)):
        q, k, v = (torch.randn(2, 8, *hw, device=device) for _ in range(3))
        assert_close_to_eager(fused(q, k, v), attn(q, k, v))
    assert len(fused.reports) == 1, [r.notes for r in fused.reports]
    assert fused.report.regions and not fused.report.all_fallbacks, fused.report
