"""Random programs of pointwise, broadcast, layout and reduction ops: fuser.fuse held to eager.

Hypothesis builds each program from a small grammar over 1-3 inputs of random small odd shapes
(2..40 per dim) and a random dtype (fp32 / fp16):
  pointwise   exp(tanh(.)), tanh, sigmoid, abs, neg; add / sub / maximum / where(a > 0, a, b) with a
              tensor or a scalar operand; a * tanh(b) (products stay bounded)
  broadcast   operands of shape [D] or [R, 1] next to [R, D] ones (inputs and reduction results)
  layout      transpose, view (flatten; reshape [a, b] -> [b, a] in a second test),
              slice (::2 on the last dim,
              1: on the first), cat (along any dim), expand (a size-1 dim to R or D)
  reduction   sum / amax / mean over the first or the last dim, keepdim or not (at most two)
Values are kept bounded (exp only of tanh, products with tanh) so fp16 never overflows.  Inputs may be
transposed views (non-contiguous).  The program returns every value that no later step reads (so no dead code; side branches become extra
region outputs).

Comparison: eager rounds after every op, the fused kernel once (see tests/tolerances.py).  In a random
program eager's rounding errors can cancel into a small result, so the fixed atol/rtol are widened,
elementwise, by twice eager's own error against a float64 run of the same program:
    |fused - eager| <= atol + rtol * |eager| + 2 * |eager - ref64|
i.e. the fused result must be as close to the truth as eager is, up to the dtype's tolerance.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

import fuser
from tolerances import tol

MAX_STEPS = 7
MAX_REDUCTIONS = 2

# ----------------------------------------------------------------------------- the grammar

UNARY = {
    "exp_tanh": lambda a: torch.exp(torch.tanh(a)),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "abs": torch.abs,
    "neg": torch.neg,
}
BINARY = {  # b is a tensor or a Python float
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul_tanh": lambda a, b: a * (torch.tanh(b) if isinstance(b, torch.Tensor) else b),
    "maximum": lambda a, b: torch.maximum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_min(a, b),
    "where": lambda a, b: torch.where(a > 0, a, b),
}
REDUCE = {"sum": torch.sum, "amax": torch.amax, "mean": torch.mean}


def apply(step, vals):
    """One step of a program: ('op', args...) where ints name earlier values."""
    op, *args = step
    if op in UNARY:
        return UNARY[op](vals[args[0]])
    if op in BINARY:
        a, b, is_scalar = args
        return BINARY[op](vals[a], b if is_scalar else vals[b])
    if op in REDUCE:
        a, dim, keepdim = args
        return REDUCE[op](vals[a], dim=dim, keepdim=keepdim)
    a = vals[args[0]]
    if op == "transpose":
        return a.transpose(0, 1)
    if op == "flatten":
        return a.reshape(-1)
    if op == "view_swap":
        return a.reshape(a.shape[1], a.shape[0])
    if op == "slice_last":
        return a[..., ::2]
    if op == "slice_first":
        return a[1:]
    if op == "cat":
        return torch.cat([a, vals[args[1]]], dim=args[2])
    if op == "expand":
        return a.expand(*args[1])
    raise ValueError(op)


@dataclass
class Program:
    dtype: torch.dtype
    inputs: list            # (shape, transposed): a transposed input is made as [D, R] and .t()'d
    steps: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    seed: int = 0

    def __call__(self, *tensors):
        vals = list(tensors)
        for step in self.steps:
            vals.append(apply(step, vals))
        out = tuple(vals[i] for i in self.outputs)
        return out if len(out) > 1 else out[0]

    def __repr__(self):
        n = len(self.inputs)
        lines = [f"Program({self.dtype}, seed={self.seed})"]
        lines += [f"  v{i} = input{list(s)}{'.t() (transposed view)' if t else ''}"
                  for i, (s, t) in enumerate(self.inputs)]
        lines += [f"  v{n + k} = {_fmt(*step)}" for k, step in enumerate(self.steps)]
        lines.append(f"  return {', '.join(f'v{i}' for i in self.outputs)}")
        return "\n".join(lines)


def _fmt(op, *args) -> str:
    v = "v{}".format
    if op in UNARY:
        return f"{op}({v(args[0])})"
    if op in BINARY:
        a, b, is_scalar = args
        return f"{op}({v(a)}, {b if is_scalar else v(b)})"
    if op in REDUCE:
        a, d, keepdim = args
        return f"{op}({v(a)}, dim={d}, keepdim={keepdim})"
    if op == "cat":
        return f"cat([{v(args[0])}, {v(args[1])}], dim={args[2]})"
    if op == "expand":
        return f"expand({v(args[0])}, {args[1]})"
    return f"{op}({v(args[0])})"


def _meta(shape):
    return torch.empty(shape, device="meta")


@st.composite
def programs(draw, reshapes: bool = False):
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    dim = st.integers(2, 40)
    R, D = draw(dim), draw(dim)
    n_inputs = draw(st.integers(1, 3))
    inputs = [((R, D), draw(st.booleans()))]
    for _ in range(n_inputs - 1):
        shape = draw(st.sampled_from([(R, D), (D,), (R, 1)]))
        inputs.append((shape, len(shape) == 2 and shape[1] > 1 and draw(st.booleans())))
    prog = Program(dtype, inputs, seed=draw(st.integers(0, 2**31 - 1)))
    metas = [_meta(s) for s, _ in inputs]
    reductions = 0
    n_steps = draw(st.integers(3, MAX_STEPS))
    for k in range(n_steps):
        last_step = k == n_steps - 1
        # mostly the latest value, so programs are chains rather than bushes; the last step always
        # computes on the latest value (a program whose result is a bare view fuses nothing)
        a = len(metas) - 1 if last_step or draw(st.integers(0, 3)) else draw(st.integers(0, len(metas) - 1))
        sa = tuple(metas[a].shape)
        kinds = ["unary", "unary", "binary", "binary", "binary"]
        if not last_step:
            if len(sa) == 2:
                kinds += ["transpose", "flatten"] + (["view_swap", "view_swap"] if reshapes else [])
            if len(sa) >= 1:
                kinds += ["slice_last", "cat"] + (["slice_first"] if sa[0] >= 2 else [])
                kinds += ["reduce", "reduce"] if reductions < MAX_REDUCTIONS else []
            if 1 in sa:
                kinds.append("expand")
        kind = draw(st.sampled_from(kinds))
        if kind == "unary":
            step = (draw(st.sampled_from(sorted(UNARY))), a)
        elif kind == "binary":
            op = draw(st.sampled_from(sorted(BINARY)))
            partners = [i for i, m in enumerate(metas) if _broadcasts(tuple(m.shape), sa)]
            if draw(st.integers(0, 3)) == 0 or not partners:
                step = (op, a, draw(st.sampled_from([-1.5, -0.5, 0.25, 0.75, 2.0])), True)
            else:
                step = (op, a, draw(st.sampled_from(partners)), False)
        elif kind == "reduce":
            reductions += 1
            d = draw(st.sampled_from([0, -1])) if len(sa) > 1 else 0
            step = (draw(st.sampled_from(sorted(REDUCE))), a, d, draw(st.booleans()))
        elif kind == "cat":
            d = draw(st.integers(0, len(sa) - 1))
            partners = [i for i, m in enumerate(metas) if len(m.shape) == len(sa) and all(
                x == y for j, (x, y) in enumerate(zip(m.shape, sa)) if j != d)]
            step = ("cat", a, draw(st.sampled_from(partners)), d)
        elif kind == "expand":
            step = ("expand", a, tuple(draw(st.sampled_from([R, D])) if s == 1 else s for s in sa))
        else:
            step = (kind, a)
        metas.append(apply(step, metas))
        prog.steps.append(step)
    # return every value nothing else reads (the last one first): no dead code, and side branches
    # become extra (multi-output) region outputs
    used = {a for step in prog.steps for j, a in enumerate(step[1:]) if _is_operand(step, j)}
    prog.outputs = [i for i in range(len(metas) - 1, len(inputs) - 1, -1) if i not in used]
    return prog


def _is_operand(step, j) -> bool:
    """Whether argument j of a step names a value (rather than a dim, a scalar or a shape)."""
    op = step[0]
    if j == 0:
        return True
    if op in BINARY:
        return j == 1 and not step[3]
    return op == "cat" and j == 1


def _broadcasts(sb, sa) -> bool:
    """b can be an operand of an elementwise op with a without changing a's shape."""
    try:
        return tuple(torch.broadcast_shapes(sb, sa)) == sa
    except RuntimeError:
        return False


# ----------------------------------------------------------------------------- inputs and the check

def make_inputs(prog: Program, device: str) -> list:
    g = torch.Generator().manual_seed(prog.seed)
    out = []
    for shape, transposed in prog.inputs:
        if transposed:
            t = torch.randn(tuple(reversed(shape)), generator=g).t()
        else:
            t = torch.randn(shape, generator=g)
        out.append(t.to(device=device, dtype=prog.dtype))
    return out


def assert_close_widened(got, want, ref64, label=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (label, got.shape, want.shape, got.dtype, want.dtype)
    t = tol(want.dtype)
    g, w = got.double().cpu(), want.double().cpu()
    r = ref64.double().cpu()
    diff = (g - w).abs()
    allowed = t["atol"] + t["rtol"] * w.abs() + 2 * (w - r).abs()
    bad = ~(diff <= allowed) & ~(g.isnan() & w.isnan())
    if bad.any():
        i = (torch.where(bad, diff - allowed, torch.zeros_like(diff))).argmax()
        idx = tuple(int(k) for k in torch.unravel_index(i, diff.shape)) if diff.dim() else ()
        raise AssertionError(
            f"{label}: {int(bad.sum())} / {bad.numel()} elements off; worst at {idx}: fused {g[idx].item()!r}, "
            f"eager {w[idx].item()!r}, float64 {r[idx].item()!r}, allowed |fused - eager| <= {allowed[idx].item():.3g}")


SETTINGS = dict(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(**SETTINGS)
@given(prog=programs())
def test_random_program(prog, device):
    check_program(prog, device)


@settings(**SETTINGS)
@given(prog=programs(reshapes=True))
@example(prog=Program(torch.float32, [((2, 3), True), ((3,), False), ((2, 3), False)],   # found by hypothesis
                      steps=[("view_swap", 0), ("abs", 3), ("abs", 4)], outputs=[5], seed=0))
def test_random_program_with_reshapes(prog, device):
    """The same grammar plus `view_swap` (reshape [a, b] -> [b, a]) on any value."""
    check_program(prog, device)


def check_program(prog: Program, device: str):
    torch._dynamo.reset()
    note(repr(prog))
    inputs = make_inputs(prog, device)
    fused = fuser.fuse(prog)
    got = fused(*inputs)
    want = prog(*inputs)
    ref = prog(*[t.double() for t in inputs])
    note(str(fused.report))
    event(f"fused regions: {len(fused.report.regions)}")
    got, want, ref = [x if isinstance(x, tuple) else (x,) for x in (got, want, ref)]
    assert len(got) == len(want)
    for k, (g, w, r) in enumerate(zip(got, want, ref)):
        assert_close_widened(g, w, r, f"output {k}")


# ----------------------------------------------------------------------------- the harness itself

def test_program_repr_and_run():
    """The interpreter and the printer agree on a hand-written program (guards the grammar itself)."""
    prog = Program(torch.float32, [((3, 5), False), ((5,), False)],
                   steps=[("add", 0, 1, False), ("exp_tanh", 2), ("sum", 3, -1, True), ("sub", 3, 4, False)],
                   outputs=[5, 3], seed=zlib.crc32(b"repr"))
    x, y = make_inputs(prog, "cpu")
    out, mid = prog(x, y)
    e = torch.exp(torch.tanh(x + y))
    torch.testing.assert_close(mid, e)
    torch.testing.assert_close(out, e - e.sum(-1, keepdim=True))
    assert "v4 = sum(v3, dim=-1, keepdim=True)" in repr(prog), repr(prog)
