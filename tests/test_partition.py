"""Region formation: what must be fused, what must not, and the cost-model hand counts.

These run the partitioner on ATen graphs traced with fake tensors (no kernels run), so shapes can
be as large as the decisions need; a region that codegen refuses and the pipeline splits runs its
kernels, held to eager.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fuser
from fuser.decompositions import decompositions
from fuser.partition import Partitioner
from helpers import fused_ops, peak_bytes
from tolerances import assert_close_to_eager

F32 = 4


def regions_of(fn, *shapes):
    with FakeTensorMode():
        args = [torch.empty(s) for s in shapes]
        gm = make_fx(fn, decomposition_table=decompositions())(*args)
    part = Partitioner(gm.graph)
    regions = part.partition()
    return regions, part


def names(region):
    return {n.target.overloadpacket.__name__ for n in region.nodes if hasattr(n.target, "overloadpacket")}


def test_chain_of_k_unary_ops_has_k_equal_to_k():
    """The seed's proposition: k same-shape ops move 2kN unfused, 2N fused."""
    n = 3 * 423 * 213
    regions, part = regions_of(lambda x: torch.exp(torch.sin(torch.cos(torch.tanh(x)))), (3, 423, 213))
    (r,) = regions
    cost = part.cost(r)
    assert int(cost.bytes_unfused) == 4 * 2 * n * F32
    assert int(cost.bytes_fused) == 2 * n * F32
    assert cost.k == pytest.approx(4.0)


def test_binary_chain_counts_every_operand():
    n = 37 * 211
    regions, part = regions_of(lambda a, b, c: (a + b) * c, (37, 211), (37, 211), (37, 211))
    cost = part.cost(regions[0])
    assert int(cost.bytes_unfused) == (3 * n + 3 * n) * F32  # add: 2 reads + 1 write; mul likewise
    assert int(cost.bytes_fused) == 4 * n * F32              # a, b, c read once; one write
    assert cost.k == pytest.approx(1.5)


def test_broadcast_operand_is_read_once():
    n, d = 64 * 301, 301
    regions, part = regions_of(lambda x, w: torch.exp(x + w), (64, 301), (301,))
    cost = part.cost(regions[0])
    assert int(cost.bytes_unfused) == (n + d + n + n + n) * F32
    assert int(cost.bytes_fused) == (n + d + n) * F32


def test_softmax_counts_and_is_one_pass_when_rows_fit():
    m, r = 512, 1000
    regions, part = regions_of(lambda x: torch.softmax(x, -1), (m, r))
    (region,) = regions
    assert region.kind == "reduction" and names(region) >= {"amax", "sub", "exp", "sum", "div"}
    cost = part.cost(region)
    # amax: MR+M, sub: 2MR+M, exp: 2MR, sum: MR+M, div: 2MR+M
    assert int(cost.bytes_unfused) == (8 * m * r + 4 * m) * F32
    assert int(cost.bytes_fused) == 2 * m * r * F32


def test_long_rows_are_read_once_per_pass():
    """Rows longer than registers hold loop over R: the max and the sum of exp share one (online)
    pass, the normalised write takes a second; var needs its mean first."""
    m, r = 1024, 40000
    regions, part = regions_of(lambda x: torch.softmax(x, -1), (m, r))
    (region,) = regions
    assert not region.persistent
    assert int(part.cost(region).bytes_fused) == (2 + 1) * m * r * F32
    regions, part = regions_of(lambda x: torch.var(x * 2.0, -1), (m, r))
    assert int(part.cost(regions[0]).bytes_fused) == (2 * m * r + m) * F32


def test_cross_entropy_reads_the_logits_once():
    """Online log-sum-exp, and the target logit picked by a gather load: one pass over the logits."""
    n, v = 8192, 128256
    with FakeTensorMode():
        gm = make_fx(lambda l, t: F.cross_entropy(l.float(), t), decomposition_table=decompositions())(
            torch.empty(n, v, dtype=torch.bfloat16), torch.empty(n, dtype=torch.long))
    part = Partitioner(gm.graph)
    big = [r for r in part.partition() if "gather" in names(r)][0]
    assert {"amax", "exp", "sum", "log", "gather"} <= names(big) and not big.persistent
    assert int(part.cost(big).bytes_fused) < 1.01 * n * v * 2  # the bf16 logits, once


def test_lone_op_is_not_fused():
    regions, part = regions_of(lambda x: torch.exp(x), (1000, 1000))
    assert regions == []
    (node, reason), = part.unfused(regions)
    assert "alone" in reason


def test_opaque_op_splits_regions():
    def f(x, w):
        h = torch.relu(x * 2.0) @ w
        return torch.sigmoid(h) * 3.0 + 1.0

    regions, part = regions_of(f, (256, 512), (512, 384))
    assert len(regions) == 2
    assert names(regions[0]) == {"mul", "relu"} and names(regions[1]) == {"sigmoid", "mul", "add"}
    assert any("matmul" in reason for _, reason in part.unfused(regions))


def test_no_cycle_through_an_eager_op():
    def f(x, w):
        a = torch.exp(x) * 2.0            # used by the matmul and by the last line
        b = a @ w                           # opaque
        return torch.tanh(a) + b            # the add needs b, which needs a: it cannot join a's kernel

    regions, _ = regions_of(f, (128, 128), (128, 128))
    assert any({"exp", "tanh"} <= names(r) for r in regions)
    assert not any({"exp", "add"} <= names(r) for r in regions)


def test_no_cycle_through_a_group_already_formed(device):
    """Siblings b1 and b2 read z; b1 reads sigmoid(x), whose group also adds b2's matmul: merging the siblings
    closes a cycle of kernels (the group before b1, b1's kernel before the matmul, the matmul before the group),
    though no path of single nodes leaves and re-enters them.  The whole graph fell back to eager (Qwen2-MoE's
    router gradient, found by a sweep of unseen architectures); now the merge is refused."""
    def f(x, z, w, w2):
        s = torch.sigmoid(x)
        b1 = s.unsqueeze(1) * z
        b2 = z * 2 + 1
        a2 = s.sum(-1, keepdim=True) * 3 + b2.view(37, 128) @ w2
        return b1.view(74, 64) @ w, a2
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g).to(device) for s in ((37, 64), (37, 2, 64), (64, 64), (128, 64))]
    fused = fuser.fuse(f)
    assert_close_to_eager(fused(*args), f(*args))
    assert not fused.report.all_fallbacks, fused.report
    assert {"sigmoid", "sum"} <= fused_ops(fused.report), fused.report


def test_fusion_that_would_not_pay_is_declined():
    """A producer also needed outside, feeding a row too long for registers: fusing it would re-read
    its two inputs on each of the three passes (8N) instead of writing and re-reading its output (7N)."""
    def f(a, b):
        s = a + b
        return s, torch.softmax(s, -1)

    regions, part = regions_of(f, (4096, 40000), (4096, 40000))
    add_region = [r for r in regions if "add" in names(r)]
    assert not add_region or "amax" not in names(add_region[0])
    assert any("add" in n.name for n, _ in part.unfused(regions))


def test_layernorm_with_residual_and_multi_output():
    def f(x, r, w, b):
        h = x + r
        return h, F.layer_norm(h, (768,), w, b)

    regions, part = regions_of(f, (512, 768), (512, 768), (768,), (768,))
    (region,) = regions
    assert names(region) >= {"add", "var_mean", "rsqrt", "mul"}
    assert len(region.outputs) == 2  # the residual stream and the normalised output
    n = 512 * 768
    assert int(part.cost(region).bytes_fused) == (2 * n + 2 * 768 + 2 * n) * F32


def test_log_softmax_nll_never_writes_the_probabilities():
    def f(logits, target):
        return F.nll_loss(F.log_softmax(logits, -1), target, reduction="none")

    with FakeTensorMode():
        gm = make_fx(f, decomposition_table=decompositions())(torch.empty(64, 1000), torch.empty(64, dtype=torch.long))
    part = Partitioner(gm.graph)
    regions = part.partition()
    big = [r for r in regions if "gather" in names(r)]
    assert big and {"amax", "exp", "log", "gather"} <= names(big[0])
    assert all(tuple(o.meta["val"].shape) != (64, 1000) for o in big[0].outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_reduction_read_at_other_rows_ends_its_kernel(dtype, device):
    """The llama backward's GQA sum over the query heads sharing a key, read by RoPE's rotation: the
    rotation reads the sum half a row away, which one kernel cannot serve.  The sum ends its kernel
    and the rotation's ops are fused without it, not all left to eager with the region."""
    g = torch.Generator().manual_seed(0)
    # [B, KVH, n_rep, S, D], not contiguous (S and n_rep swapped in memory); 9 heads: a sum over at most
    # 8 is unrolled into adds (split.unroll_small_sums), which fuse (the next test)
    x = torch.randn(3, 2, 7, 9, 10, generator=g).to(dtype).to(device).transpose(2, 3)
    cos, sin = (torch.randn(7, 10, generator=g).to(dtype).to(device) for _ in range(2))

    def layer(x, cos, sin):  # the gradient of k * cos + rotate_half(k) * sin, as AOT Autograd writes it
        k = x.sum(2)
        t = k * sin
        z = torch.zeros_like(t)
        rot = torch.slice_scatter(z, -t[..., :5], -1, 5) + torch.slice_scatter(z, t[..., 5:], -1, 0, 5)
        return (rot + k * cos).transpose(1, 2).contiguous()

    def fn(x, cos, sin):  # two layers: two reductions sealed, the graph partitioned three times
        y = layer(x, cos, sin)
        if dtype != torch.float32:  # one layer in 16 bits (two: the regions' roundings add up past fp64's)
            return y
        return layer(y.transpose(1, 2).unsqueeze(2).expand(x.shape).tanh(), cos, sin) + y

    fused = fuser.fuse(fn)
    # against fp64 rounded once: eager's fp16 rounds each product, which the sum's cancellation shows
    assert_close_to_eager(fused(x, cos, sin), fn(x.double(), cos.double(), sin.double()).to(dtype))
    report = fused.report
    assert {"neg", "slice_scatter", "mul", "add", "clone"} <= fused_ops(report), report.regions
    why = [u.reason for u in report.unfused if u.op.startswith("aten.sum")]
    assert why and "read at other rows" in why[0], report.unfused  # the first sum: alone, eager
    # each rotation a kernel; the second sum sealed too, in a kernel with its producer (tanh)
    if dtype == torch.float32:
        assert sum("slice_scatter" in " ".join(r.ops) for r in report.regions) == 2, report.regions
        assert any({"aten.tanh.default", "aten.sum.dim_IntList"} <= set(r.ops) for r in report.regions), report.regions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sum_over_a_few_heads_fuses_with_a_consumer_that_reads_it_at_other_rows(dtype, device):
    """GQA's key gradient summed over its 4 repeated heads, read by RoPE's rotation half a row away:
    the sum becomes 4 adds in fp32, rounded once, and the whole gradient is one kernel."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 7, 4, 10, generator=g).to(dtype).to(device).transpose(2, 3)  # [B, KVH, 4, S, D]
    cos, sin = (torch.randn(7, 10, generator=g).to(dtype).to(device) for _ in range(2))

    def fn(x, cos, sin):
        k = x.sum(2)
        t = k * sin
        z = torch.zeros_like(t)
        rot = torch.slice_scatter(z, -t[..., :5], -1, 5) + torch.slice_scatter(z, t[..., 5:], -1, 0, 5)
        return (rot + k * cos).transpose(1, 2).contiguous()

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, cos, sin), fn(x.double(), cos.double(), sin.double()).to(dtype))
    assert len(fused.report.regions) == 1 and not fused.report.unfused, fused.report
    assert "aten.sum.dim_IntList" not in fused.report.regions[0].ops


@pytest.mark.parametrize("dims, keepdim", [((1,), True), ((-2,), False), ((0, 2), False), ((0, 1), True)])
def test_small_sums_unrolled_match_eager(dims, keepdim, device):
    """Sums over at most 8 elements, any dims, kept or dropped, in 16 bits and 32: eager's result (fp32
    accumulation, one rounding), NaN and Inf included."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 4, 3, 213, generator=g).to(dtype).to(device)
        x[0, 1, 2, 5], x[1, 0, 1, 7] = float("nan"), float("inf")
        fn = lambda x: x.sum(dims, keepdim=keepdim).tanh()  # noqa: E731
        fused = fuser.fuse(fn)
        got, want = fused(x), fn(x)
        assert_close_to_eager(got, want)
        assert got.stride() == want.stride()
        ops = [op for r in fused.report.regions for op in r.ops]
        assert "aten.add.Tensor" in ops and "aten.sum.dim_IntList" not in ops and not fused.report.unfused, fused.report


def test_small_sums_keep_eagers_layout_sign_and_sizes(device):
    """A sum over 2 of a permuted tensor is laid out as eager's (contiguous), so a view of it left to eager
    works; a sum of -0.0 is +0.0 (eager's starts from +0); over a dynamic batch, keepdim."""
    x = torch.randn(6, 5, 2, device=device).permute(2, 1, 0)  # [2, 5, 6], not contiguous
    w = torch.randn(30, 4, device=device)
    fn = lambda x, w: x.sum(0).view(1, 30) @ w  # noqa: E731
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, w), fn(x, w))
    assert not fused.report.fallback and "aten.sum.dim_IntList" not in " ".join(fused.report.regions[0].ops)
    z = torch.full((4, 3), -0.0, device=device)
    inv = fuser.fuse(lambda z: 1 / z.sum(1))
    assert bool((inv(z) == float("inf")).all())
    dyn = torch.compile(lambda x: x.sum(1, keepdim=True), backend="fuser", dynamic=True)
    for b in (3, 5):
        x = torch.randn(b, 4, 7, device=device)
        got = dyn(x)
        assert_close_to_eager(got, x.sum(1, keepdim=True))
        assert not fuser.last_report().fallback


def _partition(fn, *specs):
    """The partitioner on fn traced with fake tensors of (shape, dtype) specs."""
    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        gm = make_fx(fn, decomposition_table=decompositions())(*args)
    part = Partitioner(gm.graph)
    return part.partition(), part


@pytest.mark.parametrize("case", ["row_bias", "column_bias", "promoting"])
def test_a_lone_op_on_eagers_slow_path_runs_as_our_kernel(case):
    """Eager's elementwise kernel is not vectorised when an operand is broadcast or of another dtype
    (0.4-0.57x of copy bandwidth, measured): alone and large, such an op runs as our kernel."""
    big, bf16 = (4096, 8192), torch.bfloat16
    specs = {"row_bias": [(big, bf16), ((8192,), bf16)], "column_bias": [(big, bf16), ((4096, 1), bf16)],
             "promoting": [(big, bf16), (big, torch.float32)]}[case]
    regions, _ = _partition(lambda a, b: a + b, *specs)
    assert len(regions) == 1 and names(regions[0]) == {"add"}


@pytest.mark.parametrize("case", ["same_layout", "small", "cpu_scalar", "where", "masked_fill", "compare", "ints"])
def test_a_lone_op_on_eagers_fast_path_stays_eager(case):
    """Same shape and dtype (eager's vectorised kernel), a broadcast too small for bandwidth to count,
    a 0-d CPU tensor (eager passes it as a scalar), or operands whose dtype the op's signature fixes
    (a bool condition, a comparison's bool result, integers): eager's kernel is as good; left alone."""
    big, bf16, b8 = (4096, 8192), torch.bfloat16, torch.bool
    mul = lambda a, b: a * b  # noqa: E731
    fn, specs = {"same_layout": (mul, [(big, bf16), (big, bf16)]), "small": (mul, [((64, 128), bf16), ((128,), bf16)]),
                 "cpu_scalar": (mul, [(big, bf16), ((), torch.float32)]),
                 "where": (lambda m, a, b: torch.where(m, a, b), [(big, b8), (big, bf16), (big, bf16)]),
                 "masked_fill": (lambda a, m: a.masked_fill(m, 0.0), [(big, bf16), (big, b8)]),
                 "compare": (lambda a, b: a < b, [(big, bf16), (big, bf16)]),
                 "ints": (lambda a: a != -100, [(big, torch.int64)])}[case]
    regions, part = _partition(fn, *specs)
    assert regions == [] and "alone" in next(iter(part.reasons.values()))


def test_a_lone_op_that_eager_runs_as_two_kernels_runs_as_our_kernel(device):
    """Eager runs a generator an op reads as a kernel of its own (HF's StaticCache writes new keys at
    `arange(n) + cumulative_length`, a 0-d tensor: an arange and an add a layer of a decode step), and `where`
    with a number as a fill of a 0-d tensor, then the where: small, such an op runs as our kernel, the
    generator and the number computed in it.  Large, the same op stays eager (bandwidth, not launches)."""
    torch.manual_seed(5)
    cache, k = torch.randn(2, 3, 11, 5, device=device), torch.randn(2, 3, 2, 5, device=device)
    length = torch.tensor(4, device=device)

    def step(cache, length, k):
        return cache.index_copy(2, torch.arange(k.shape[-2], device=k.device) + length, k)

    fused = fuser.fuse(step)
    assert_close_to_eager(fused(cache, length, k), step(cache, length, k))
    assert any(r.ops == ["aten.add.Tensor"] for r in fused.report.regions), fused.report
    assert "arange" not in "".join(fused.report.code)
    for shape, fused_alone in (((7, 5), True), ((4096, 8192), False)):
        # built as codegen/sdpa.py builds its NaN fix-up (a trace would decompose where.ScalarSelf)
        graph = torch.fx.Graph()
        c, x = graph.placeholder("c"), graph.placeholder("x")
        w = graph.call_function(torch.ops.aten.where.ScalarSelf, (c, float("nan"), x))
        graph.output(w)
        with FakeTensorMode():
            c.meta["val"], x.meta["val"] = torch.empty(shape, dtype=torch.bool), torch.empty(shape)
            w.meta["val"] = torch.ops.aten.where.ScalarSelf(c.meta["val"], float("nan"), x.meta["val"])
        assert len(Partitioner(graph).partition()) == fused_alone, shape


@pytest.mark.parametrize("case", ["transpose", "repeat_kv", "slice"])
def test_a_lone_copy_from_another_layout_runs_as_our_kernel(case):
    """Eager copies a permuted, expanded or sliced tensor with its non-vectorised kernel (~0.2x of a
    copy's bandwidth: GQA's repeated K and V, run 84): large, such a copy runs as our kernel; a copy of
    a contiguous tensor stays eager."""
    bf16 = torch.bfloat16
    fn, spec = {"transpose": (lambda x: x.transpose(1, 2).contiguous(), (4, 512, 16, 128)),
                "repeat_kv": (lambda x: x[:, :, None].expand(4, 4, 4, 512, 128).reshape(4, 16, 512, 128), (4, 4, 512, 128)),
                "slice": (lambda x: x[:, :1024].contiguous(), (4096, 2048))}[case]
    regions, _ = _partition(fn, (spec, bf16))
    assert len(regions) == 1 and names(regions[0]) == {"clone"}
    regions, part = _partition(lambda x: x.clone(), ((4, 512, 16, 128), bf16))
    assert regions == [] and "alone" in next(iter(part.reasons.values()))


def test_a_lone_broadcast_runs_as_our_kernel_and_matches_eager(device):
    """End to end: a large row-broadcast add over a non-contiguous input, fused alone, held to eager."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1100, 1000, generator=g).to(device).t()  # [1000, 1100], column-major
    bias = torch.randn(1100, generator=g).to(device)
    fn = lambda x, b: x + b  # noqa: E731
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, bias), fn(x, bias))
    assert [r.ops for r in fused.report.regions] == [["aten.add.Tensor"]]


def test_no_cycle_through_a_size_read_off_a_region_member():
    """A backward that recomputes a GELU (fuser's min-cut may) and reads its sym_size to shape the view a
    matmul takes, whose product then joins the GELU's region, was a cycle at the second sequence length
    (the graph fell back to eager): sizes order their tensors' producers too."""
    class Conv1D(torch.nn.Module):  # Hugging Face's GPT-2 projection: addmm over a 2-D view
        def __init__(self, nf, nx):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
            self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.weight.shape[1])

    class MLP(torch.nn.Module):
        def __init__(self, d=32, f=128):
            super().__init__()
            self.ln, self.fc, self.proj = torch.nn.LayerNorm(d), Conv1D(f, d), Conv1D(d, f)

        def forward(self, x):
            return (x + self.proj(F.gelu(self.fc(self.ln(x)), approximate="tanh"))).square().mean()

    torch.manual_seed(0)
    model = MLP()
    fused = fuser.fuse(model)
    for t in (9, 13):
        _gradients_match_eager(fused, model, torch.randn(2, t, 32))
    assert not [r.fallback for r in fuser.reports()[-4:] if getattr(r, "fallback", None)]


def _gradients_match_eager(compiled, model, x):
    """A backward through `compiled` and one through `model` itself: the parameters' gradients agree."""
    compiled(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    model.zero_grad()


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_recomputed_op_joins_the_sibling_that_reads_its_input(dynamic):
    """The backward recomputes an MLP's GELU for the second linear's weight gradient (fuser's min-cut may)
    beside the GELU's own gradient, which reads the same activation: one kernel, not an eager GELU
    left alone between matmuls (vit's step ran 8 eager GELUs, run 66); gradients match eager.  Over a
    dynamic sequence length too, where the LayerNorm's weight and bias gradients also share a kernel."""
    class MLP(torch.nn.Module):
        def __init__(self, d=64, f=256):
            super().__init__()
            self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, f), torch.nn.Linear(f, d)

        def forward(self, x):
            return (x + self.fc2(F.gelu(self.fc1(self.ln(x))))).square().mean()

    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="fuser", dynamic=dynamic)
    for t in (23, 31) if dynamic else (23,):
        before = len(fuser.reports())
        _gradients_match_eager(compiled, model, torch.randn(3, t, 64))
        backward = [r for r in fuser.reports()[before:] if any("backward graph" in n for n in r.notes)]
        assert not [u for r in backward for u in r.unfused if "gelu" in u.op], [r.unfused for r in backward]
        assert not [r.fallback for r in fuser.reports()[before:] if r.fallback]
    backward = [r for r in fuser.reports() if any("backward graph" in n for n in r.notes)][-1]
    # the LayerNorm's weight and bias gradients, two column sums, in one kernel (beside its input's gradient)
    assert any(r.ops.count("aten.sum.dim_IntList") >= 2 for r in backward.regions), backward


@pytest.mark.parametrize("second", ["cuda:1", "cpu"])
def test_siblings_on_two_devices_stay_apart(second):
    """Two groups that read one 0-d CPU scalar (readable on any device) are not siblings across devices: one
    kernel runs on one device (partition only, on fake tensors: no GPU needed; on a machine with one GPU, fake
    tensors refuse a second)."""
    if second == "cuda:1" and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("one GPU: fake tensors check the device index against the real devices")
    def f(a, b, s):
        return torch.exp(torch.sin(a) * s), torch.exp(torch.cos(b) * s)

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(64, 64, device="cuda:0"), torch.empty(64, 64, device=second), torch.empty((), device="cpu")]
        gm = make_fx(f, decomposition_table=decompositions())(*args)
    regions = Partitioner(gm.graph).partition()
    assert len(regions) == 2
    for r in regions:
        assert len({n.meta["val"].device for n in r.nodes}) == 1, [n.name for n in r.nodes]


def test_a_sibling_merge_codegen_refuses_gives_back_the_groups_fusion(device):
    """exp + sum over rows, beside an argmax over the same rows, too long for codegen's argmax: the merged
    region is refused, and the pipeline partitions again without sibling merges for those nodes, so exp + sum
    is still one kernel (and the argmax eager), as before horizontal fusion."""
    def f(x):
        return torch.exp(x).sum(-1), torch.argmax(x, -1)

    torch.manual_seed(0)
    x = torch.randn(4, 20000, device=device)
    before = len(fuser.reports())
    got = fuser.fuse(f)(x)
    want = f(x)
    assert_close_to_eager(got[0], want[0])
    assert torch.equal(got[1], want[1])
    (report,) = fuser.reports()[before:]
    assert [{o.split(".")[1] for o in r.ops} for r in report.regions] == [{"exp", "sum"}], report
    assert [u.op for u in report.unfused] == ["aten.argmax.default"]


def test_a_view_of_a_matmul_at_an_unaligned_offset_is_checked(device):
    """A view of a matmul's result the kernels cannot take as index math (as_strided) starting 24 bytes in: the
    kernel reading it checks it (its pointer's alignment, which the compiled kernel's fast path assumes),
    while a view at offset 0 is trusted.  (A split's pieces are slices, read from the matmul's result.)"""
    from fuser.runtime import RegionKernel

    def f(x, w):
        y = x @ w
        a, b = y.as_strided((1, 6), (6, 1), 0), y.as_strided((4, 6), (6, 1), 6)
        return torch.tanh(b) * 2 + 1, torch.tanh(a) * 3 + 1

    from fuser import backend

    graphs = []
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, device=device), torch.randn(3, 6, device=device)
    compiled = torch.compile(f, backend=backend.make_backend(lambda report, gm: graphs.append(gm)))
    assert_close_to_eager(compiled(x, w), f(x, w))
    kernels = {m.in_sigs[0].shape: m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)}
    assert kernels[(4, 6)].checked == (0,), kernels

    def pieces(x, w):
        a, b = (x @ w).split([1, 4], dim=0)
        return torch.tanh(b) * 2 + 1, torch.tanh(a) * 3 + 1

    graphs.clear()
    assert_close_to_eager(torch.compile(pieces, backend=backend.make_backend(lambda report, gm: graphs.append(gm)))(x, w),
                          pieces(x, w))
    (kernel,) = [m for g in graphs for m in g.modules() if isinstance(m, RegionKernel)]
    assert kernel.in_sigs[0].shape == (5, 6) and kernel.checked == (), kernel  # the matmul's result, trusted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matmul_over_one_element_is_a_product_fused_with_its_reader(dtype, device):
    """Rotary angles as every HF decoder makes them (`inv_freq[None, :, None] @ positions[:, None, :]`, a
    bmm over one summed element) and a plain [M, 1] @ [1, N]: one kernel with the cos and sin that read
    them, eager's values (one product, rounded once); a matmul over 3 elements stays a matmul."""
    g = torch.Generator().manual_seed(0)
    inv = torch.randn(2, 17, 1, generator=g).to(dtype).to(device)
    pos = torch.randn(2, 1, 29, generator=g).to(dtype).to(device)
    a, b = torch.randn(37, 1, generator=g).to(dtype).to(device), torch.randn(1, 23, generator=g).to(dtype).to(device)

    def fn(inv, pos, a, b):
        angles = (inv @ pos).transpose(1, 2)
        return angles.cos(), angles.sin(), torch.tanh(a @ b)

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(inv, pos, a, b), fn(inv, pos, a, b))
    ops = " ".join(op for r in fused.report.regions for op in r.ops)
    assert "mm" not in ops and "aten.mul.Tensor" in ops and not fused.report.unfused, fused.report
    wide = fuser.fuse(lambda a, b: torch.tanh(a @ b))
    x, y = torch.randn(37, 3, generator=g).to(dtype).to(device), torch.randn(3, 23, generator=g).to(dtype).to(device)
    assert_close_to_eager(wide(x, y), torch.tanh(x @ y))
    assert any("mm" in u.op for u in wide.report.unfused), wide.report
    dyn = torch.compile(lambda inv, pos: (inv @ pos).cos(), backend="fuser", dynamic=True)
    for t in (29, 31):
        p = torch.randn(2, 1, t, generator=g).to(dtype).to(device)
        assert_close_to_eager(dyn(inv, p), (inv @ p).cos())
    assert not fuser.last_report().fallback


def test_ops_that_leave_their_operand_unchanged_are_dropped(device):
    """`arange(T) + 0` (HF's positions in training) becomes the arange our kernels compute in their index
    math, not an eager add; a float x * 1 goes too.  Kept: a float x + 0 (-0.0 + 0 is +0.0), and an
    identity the graph returns (it would return its operand itself)."""
    def f(x, y):
        pos = torch.arange(x.shape[1], device=x.device) + 0
        return ((x * 1) + 0) * 3, torch.tanh(y[pos] * 2.0 + pos), pos * 1
    x = torch.tensor([[-0.0, 1.5, float("nan")], [float("-inf"), -0.0, 2.0]], device=device)
    y = torch.randn(3, device=device)
    fused = fuser.fuse(f)
    got, want = fused(x, y), f(x, y)
    assert_close_to_eager(got, want)
    assert torch.equal(torch.signbit(got[0]), torch.signbit(want[0]))
    (note,) = [n for n in fused.report.notes if "unchanged dropped" in n]
    assert note.count("add by 0") == 1 and note.count("mul by 1") == 1, note
    assert "aten.add.Tensor" not in [u.op for u in fused.report.unfused], fused.report.unfused


def test_a_batched_outer_product_is_laid_out_as_the_matmuls_result(device):
    """bmm over one summed element with a batch-transposed operand: the product keeps that layout where the
    matmul's result is contiguous, so a view of it (and the caller's) must still work."""
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(5, 2, 1, generator=g).to(device), torch.randn(2, 1, 4, generator=g).to(device)
    fn = lambda x, b: (torch.bmm(x.transpose(0, 1), b).view(-1).sin(), torch.bmm(x.transpose(0, 1), b))  # noqa: E731
    fused = fuser.fuse(fn)
    got, want = fused(x, b), fn(x, b)
    assert_close_to_eager(got, want)
    assert got[1].stride() == want[1].stride() and not fused.report.fallbacks and fused.report.regions, fused.report


def test_identities_kept_where_the_graph_returns_them_through_a_view_or_they_are_complex(device):
    """x * 1 returned through a view would hand back a view of x (a later write to x would show in it), and
    complex x + 0, x * 1 differ from x ((-0-0j) + 0 is +0+0j; (1 + inf j) * 1 is nan + inf j): all kept."""
    x = torch.randn(2, 3, device=device)
    fused = fuser.fuse(lambda x: ((x * 1).t(), (x - 0).view(-1)))
    a, b = fused(x)
    assert a.data_ptr() != x.data_ptr() and b.data_ptr() != x.data_ptr()
    assert_close_to_eager((a, b), (x.t(), x.view(-1)))
    z = torch.tensor([complex(-0.0, -0.0), complex(1.0, float("inf"))], device=device)
    cf = fuser.fuse(lambda z: ((z + 0) * 2, (z * 1) * 2))
    for got, want in zip(cf(z), ((z + 0) * 2, (z * 1) * 2)):
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got.real), torch.signbit(want.real))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dynamic", [False, True])
def test_siblings_of_other_shapes_share_one_kernel(dtype, dynamic, device):
    """RoPE's rotated queries and keys (GQA: 5 query heads, 3 key heads) read the same cos and sin: one
    kernel stores both, walking the queries' elements and storing the keys where x is below their count
    (a launch fewer a layer; a decode step's launches are its time).  Queries non-contiguous (a transposed
    projection), cos and sin broadcast; over a dynamic sequence length too."""
    def f(q, k, cos, sin):
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    torch.manual_seed(0)
    compiled = torch.compile(f, backend="fuser")  # a second length: Dynamo makes that dim alone symbolic
    for t in (7, 13) if dynamic else (7,):
        q = torch.randn(2, t, 5, 24, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(2, 3, t, 24, device=device, dtype=dtype)
        cos, sin = torch.randn(t, 24, device=device, dtype=dtype), torch.randn(t, 24, device=device, dtype=dtype)
        before = len(fuser.reports())
        got = compiled(q, k, cos, sin)
        assert_close_to_eager(got, f(q, k, cos, sin))
        assert [got[0].shape, got[1].shape] == [q.shape, k.shape]
    report = fuser.reports()[before]
    (region,) = report.regions
    assert len(region.output_shapes) == 2 and region.output_shapes[0] != region.output_shapes[1], region
    assert region.symbolic == dynamic and not report.unfused, report


def test_siblings_whose_sizes_are_not_ordered_keep_their_kernels(device):
    """Two groups read one tensor, but neither output has at least the other's elements at every size
    ([s0, 3] and [s1, 5] over independent symbolic sizes): no kernel walks both, each keeps its own."""
    def f(a, b, w):
        return torch.exp(a * w).sin(), torch.cos(b * w).exp()

    torch.manual_seed(0)
    compiled = torch.compile(f, backend="fuser", dynamic=True)
    w = torch.randn((), device=device) + 2
    for m, n in ((7, 5), (11, 9)):
        a, b = torch.randn(m, 3, device=device), torch.randn(n, 5, device=device)
        assert_close_to_eager(compiled(a, b, w), f(a, b, w))
    report = fuser.reports()[-1]
    assert len(report.regions) == 2 and all(len(r.output_shapes) == 1 for r in report.regions), report


def test_a_counter_beside_its_readers_stays_an_in_place_op(device):
    """HF's StaticCache: positions `arange(1) + length` and a mask from the length are siblings of
    `length.add_(1)`.  The mask and positions share a kernel (of other shapes); the counter's add stays
    eager's in-place op (in the kernel that reads the length at every element, programs in no order could
    not write it in place, and a copy back would cost a launch more).  Values and the counter match eager."""
    def f(length, keys):
        positions = torch.arange(1, device=length.device) + length
        mask = torch.arange(keys.shape[-1], device=length.device) <= length
        length.add_(1)
        return positions, torch.where(mask, keys, -1e4)

    torch.manual_seed(0)
    keys = torch.randn(2, 3, 37, device=device)
    mine, theirs = torch.tensor(11, device=device), torch.tensor(11, device=device)
    compiled = torch.compile(f, backend="fuser")
    for _ in range(3):
        assert_close_to_eager(compiled(mine, keys), f(theirs, keys))
        assert mine.item() == theirs.item()
    report = fuser.reports()[-1]
    (region,) = report.regions
    assert sorted(region.ops) == ["aten.add.Tensor", "aten.le.Tensor", "aten.where.self"], report
    assert region.output_shapes == ["[1] int64", f"[2, 3, 37] {keys.dtype}".replace("torch.", "")], report
    assert [u.op for u in report.unfused] == ["aten.add.Tensor"], report
    assert "in place" in report.unfused[0].reason


def test_a_consumer_is_no_sibling_of_its_producer(device):
    """`a` and its broadcast consumer `b` both read x: as siblings they would share a kernel that recomputes `a`
    for every element of `b` (4x here); producer and consumer keep a kernel each, as node-by-node merges do."""
    def f(x, y):
        a = (x * 2).exp()
        return a, a.unsqueeze(1) + y * x.unsqueeze(1)

    torch.manual_seed(0)
    x, y = torch.randn(7, 33, device=device), torch.randn(7, 4, 33, device=device)
    fused = fuser.fuse(f)
    assert_close_to_eager(fused(x, y), f(x, y))
    assert len(fused.report.regions) == 2 and all(len(r.output_shapes) == 1 for r in fused.report.regions), fused.report


def test_a_wide_scatter_indexes_in_64_bits():
    """A cache past 2**31 elements written at an int32 position: the kernel widens the loaded index before it
    multiplies it by the row's stride (an int32 product would store outside the cache).  Codegen only, on fake
    tensors (no memory)."""
    from codegen.kernel import generate
    from fuser.plan import TensorSig

    def f(cache, pos, k):
        cache.index_put_((pos,), k + 1)
        return k * 2

    with FakeTensorMode():
        args = (torch.empty(70000, 32768, dtype=torch.int8), torch.empty(1, dtype=torch.int32),
                torch.empty(1, 32768, dtype=torch.int8))
        gm = make_fx(torch.func.functionalize(f, remove="mutations"), decomposition_table=decompositions())(*args)
    part = Partitioner(gm.graph)
    (region,) = part.partition()
    assert "index_put" in names(region)
    sigs = lambda nodes: [TensorSig.of(n.meta["val"]) for n in nodes]  # noqa: E731
    src = generate(region, sigs(region.inputs), sigs(region.outputs), device_type="cuda", name="k", persistent=True,
                   wide=True, cost=part.cost(region)).source
    assert ".to(tl.int64)" in src and "* 32768), " in src, src


class _LayersOfOneBias(torch.nn.Module):
    """Each layer reads its own function of one shared bias through an eager op (bmm): `scaled` gives
    every layer its own scale (siblings by the bias they read, each writing [B, T, T]), else every layer
    the same contiguous copy (T5's SDPA calls, each given the position bias)."""

    def __init__(self, scaled, layers=3, t=96, b=24):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(1, t, t))
        self.scales = torch.nn.Parameter(torch.rand(layers, t) + 0.5) if scaled else None
        self.b, self.layers = b, layers

    def forward(self, x):
        for i in range(self.layers):
            bias = self.bias * self.scales[i] if self.scales is not None else self.bias
            x = torch.tanh(torch.bmm(bias.expand(self.b, -1, -1).contiguous(), x))
        return x


def _peak(fn, x):
    with torch.no_grad():
        fn(x)  # compiled (and warm)
        return peak_bytes(fn, x)


def test_one_value_copied_for_each_eager_reader_is_made_once(device):
    """Three identical contiguous copies of a bias, each read by a bmm: made once (the others dropped, in the
    report), the outputs and the peak of live bytes as eager's."""
    torch.manual_seed(0)
    model = _LayersOfOneBias(scaled=False).to(device)
    x = torch.randn(24, 96, 7, device=device)
    fused = fuser.fuse(model)
    (got, peak), (want, eager_peak) = _peak(fused, x), _peak(model, x)
    assert_close_to_eager(got, want)
    (note,) = [n for n in fused.report.notes if "what an earlier op computed" in n]
    assert note.count(" as ") == 2, note
    assert peak <= eager_peak, (peak, eager_peak)


def test_siblings_far_apart_are_not_joined_where_that_holds_their_outputs(device):
    """Three layers' scaled copies of one bias (2.5 MiB each, from a 36 KiB read): joined as siblings they
    would all be made before the first bmm and held to the last.  Each stays its own kernel, where its
    layer reads it, with the reason in the report; the peak of live bytes stays eager's."""
    torch.manual_seed(0)
    model = _LayersOfOneBias(scaled=True, b=72).to(device)
    x = torch.randn(72, 96, 7, device=device)
    fused = fuser.fuse(model)
    (got, peak), (want, eager_peak) = _peak(fused, x), _peak(model, x)
    assert_close_to_eager(got, want)
    copies = [r for r in fused.report.regions if "mul" in {o.split(".")[1] for o in r.ops}]
    assert len(copies) == 3 and all(len(r.output_shapes) == 1 for r in copies), fused.report
    assert any("siblings kept apart for memory" in n for n in fused.report.notes), fused.report.notes
    assert peak <= eager_peak, (peak, eager_peak)


def test_duplicates_read_by_fused_ops_stay_recomputed_and_returned_ones_stay_apart(device):
    """(a * 2) written twice and read by two reductions of other shapes: each kernel computes its own (one
    written out and read back costs more).  x * 0.0 and x * -0.0 are not one value.  Two equal copies
    the graph returns are two tensors, as eager's."""
    def f(a):
        return ((a * 2).amax(-1), (a * 2).amin(0), 1 / (a * 0.0).sort(0).values, 1 / (a * -0.0).sort(0).values,
                a.t().contiguous(), a.t().contiguous())
    a = torch.rand(37, 53, device=device) + 0.5
    fused = fuser.fuse(f)
    got = fused(a)
    assert_close_to_eager(got, f(a))
    assert torch.equal(got[3], torch.full_like(got[3], float("-inf")))
    assert got[4].data_ptr() != got[5].data_ptr()
    assert not [n for n in fused.report.notes if "what an earlier op computed" in n], fused.report.notes
    assert {"amax", "amin"} <= fused_ops(fused.report), fused.report


def test_a_duplicate_written_into_later_is_not_merged():
    """Two equal copies, then one written into in place (a graph kept unfunctionalised; AOT's write only their
    inputs): the other keeps its own values."""
    from fuser.fold import merge_duplicates

    def f(x, y, w):
        a, b = x.t().contiguous(), x.t().contiguous()
        a.copy_(y)
        return torch.mm(a, w), torch.mm(b, w)
    x, y, w = torch.randn(5, 7), torch.randn(7, 5), torch.randn(5, 3)
    gm = make_fx(f)(x, y, w)
    assert merge_duplicates(gm) == []
    assert_close_to_eager(gm(x, y, w), f(x, y, w))
