"""Random programs of pointwise, broadcast, layout and reduction ops: fuser.fuse held to eager, and
fusing what the program allows.

Hypothesis builds each program from a small grammar over 1-3 inputs of random small odd shapes
(2..40 per dim) and one dtype per program:
  float (fp32 / fp16)
    pointwise   exp(tanh(.)), tanh, sigmoid, abs, neg, sign; add / sub / maximum / where(a > 0, a, b)
                with a tensor or a scalar operand; a * tanh(b) (products stay bounded)
    to bool     a > b, a == b, logical_and / or / xor of two float values (their results are outputs)
    reduction   sum / amax / amin / mean over the first or the last dim, keepdim or not;
                argmax / argmin (int64 results are outputs)
    specials    (a strategy flag) inputs sprinkled with NaN, +inf and -inf; row 0 always holds a NaN,
                so reductions run over rows with NaN
  int (int32 / int64)
    pointwise   abs, neg; add / sub / mul / maximum / where(a > 0, a, b), tensor or scalar operand
    to bool     a > b, a == b
    reduction   sum / amax / amin / argmax / argmin (int32 sums are int64: outputs)
  bool
    pointwise   logical_not; logical_and / or / xor, maximum, where(a > 0, a, b)
    reduction   any / amax
  broadcast     operands of shape [D] or [R, 1] next to [R, D] ones (inputs and reduction results)
  layout        transpose, view (flatten; reshape [a, b] -> [b, a] in a second test),
                slice (::2 on the last dim, 1: on the first), cat (along any dim), expand (a size-1
                dim to R or D)
At most two reductions.  A value whose dtype is not the program's (a comparison's bool, an argmax's
int64) is never an operand again: it is an output.  Float values are kept bounded (exp only of tanh,
products with tanh) so fp16 never overflows.  Inputs may be transposed views (non-contiguous).  The
program returns every value that no later step reads (so no dead code; side branches become extra
region outputs).

Comparison: integer and bool outputs must equal eager's exactly.  For floats, eager rounds after
every op, the fused kernel once (see tests/tolerances.py).  In a random program eager's rounding
errors can cancel into a small result, so the fixed atol/rtol are widened, elementwise, by twice
eager's own error against a float64 run of the same program:
    |fused - eager| <= atol + rtol * |eager| + 2 * |eager - ref64|
i.e. the fused result must be as close to the truth as eager is, up to the dtype's tolerance; NaN
and infinities must sit where eager has them.  A float -> bool/int step (comparison, argmax) in an
fp16 program reads only inputs: on computed values, fp16 rounding once vs per op legitimately flips
near-ties.

Fusion: `required_fused_ops` derives from the program a lower bound on what must land in fused
regions (same-shape pointwise chains, a reduction and its pointwise producer), checked against the
report; no op of the grammar may be left eager for want of a lowering or a codegen failure.
"""
from __future__ import annotations

import os
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

import fuser
from tolerances import tol

MAX_STEPS = 7
MAX_REDUCTIONS = 2
FLOATS, INTS, BOOL = (torch.float32, torch.float16), (torch.int32, torch.int64), (torch.bool,)

# ----------------------------------------------------------------------------- the grammar


def _gt(a, b):
    return a > b


def _where(a, b):
    return torch.where(a > 0, a, b)


def _maximum(a, b):
    return torch.maximum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_min(a, b)


# name -> (function, the ATen ops it lowers to: the first reads operand a, the last writes the result)
UNARY = {
    "exp_tanh": (lambda a: torch.exp(torch.tanh(a)), ["tanh", "exp"]),
    "tanh": (torch.tanh, ["tanh"]),
    "sigmoid": (torch.sigmoid, ["sigmoid"]),
    "abs": (torch.abs, ["abs"]),
    "neg": (torch.neg, ["neg"]),
    "sign": (torch.sign, ["sign"]),
    "logical_not": (torch.logical_not, ["logical_not"]),
}
BINARY = {  # b is a tensor or a Python scalar
    "add": (lambda a, b: a + b, ["add"]),
    "sub": (lambda a, b: a - b, ["sub"]),
    "mul": (lambda a, b: a * b, ["mul"]),
    "mul_tanh": (lambda a, b: a * (torch.tanh(b) if isinstance(b, torch.Tensor) else b), ["mul"]),
    "maximum": (_maximum, None),  # maximum, or clamp_min with a scalar
    "where": (_where, ["gt", "where"]),
    "gt": (_gt, ["gt"]),
    "eq": (lambda a, b: a == b, ["eq"]),
    "logical_and": (torch.logical_and, ["logical_and"]),
    "logical_or": (torch.logical_or, ["logical_or"]),
    "logical_xor": (torch.logical_xor, ["logical_xor"]),
}
REDUCE = {
    "sum": torch.sum, "amax": torch.amax, "amin": torch.amin, "mean": torch.mean,
    "argmax": torch.argmax, "argmin": torch.argmin, "any": torch.any,
}
NO_SCALAR = {"logical_and", "logical_or", "logical_xor"}  # torch takes only tensors there

# the ops of each dtype family; "to bool" / int64 results are outputs (never operands again)
GRAMMAR = {
    "float": dict(unary=["exp_tanh", "tanh", "sigmoid", "abs", "neg", "sign"],
                  binary=["add", "sub", "mul_tanh", "maximum", "where"],
                  cast=["gt", "eq", "logical_and", "logical_or", "logical_xor"],
                  reduce=["sum", "amax", "amin", "mean", "argmax", "argmin"],
                  scalars=[-1.5, -0.5, 0.25, 0.75, 2.0]),
    "int": dict(unary=["abs", "neg"], binary=["add", "sub", "mul", "maximum", "where"], cast=["gt", "eq"],
                reduce=["sum", "amax", "amin", "argmax", "argmin"], scalars=[-3, -1, 2, 5]),
    "bool": dict(unary=["logical_not"], binary=["logical_and", "logical_or", "logical_xor", "maximum", "where"],
                 cast=[], reduce=["any", "amax"], scalars=[]),
}


def family(dtype) -> str:
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "int"


def aten_ops(step) -> list:
    """The ATen ops (short names) a step lowers to, in order; [] for views."""
    op = step[0]
    if op in UNARY:
        return UNARY[op][1]
    if op in BINARY:
        if op == "maximum":
            return ["clamp_min" if step[3] else "maximum"]
        return BINARY[op][1]
    if op in REDUCE:
        return [op]
    return ["cat"] if op == "cat" else []


def apply(step, vals):
    """One step of a program: ('op', args...) where ints name earlier values."""
    op, *args = step
    if op in UNARY:
        return UNARY[op][0](vals[args[0]])
    if op in BINARY:
        a, b, is_scalar = args
        return BINARY[op][0](vals[a], b if is_scalar else vals[b])
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
    specials: bool = False  # float inputs sprinkled with NaN / +inf / -inf

    def __call__(self, *tensors):
        vals = list(tensors)
        for step in self.steps:
            vals.append(apply(step, vals))
        out = tuple(vals[i] for i in self.outputs)
        return out if len(out) > 1 else out[0]

    def __repr__(self):
        n = len(self.inputs)
        lines = [f"Program({self.dtype}, seed={self.seed}{', specials=True' if self.specials else ''})"]
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


def _meta(shape, dtype):
    return torch.empty(shape, device="meta", dtype=dtype)


@st.composite
def programs(draw, reshapes: bool = False, dtypes=FLOATS, specials: bool = False):
    dtype = draw(st.sampled_from(dtypes))
    g = GRAMMAR[family(dtype)]
    dim = st.integers(2, 40)
    R, D = draw(dim), draw(dim)
    n_inputs = draw(st.integers(1, 3))
    inputs = [((R, D), draw(st.booleans()))]
    for _ in range(n_inputs - 1):
        shape = draw(st.sampled_from([(R, D), (D,), (R, 1)]))
        inputs.append((shape, len(shape) == 2 and shape[1] > 1 and draw(st.booleans())))
    prog = Program(dtype, inputs, seed=draw(st.integers(0, 2**31 - 1)), specials=specials)
    metas = [_meta(s, dtype) for s, _ in inputs]
    reductions = 0
    n_steps = draw(st.integers(3, MAX_STEPS))
    for k in range(n_steps):
        last_step = k == n_steps - 1
        live = [i for i, m in enumerate(metas) if m.dtype == dtype]  # operands: the program's dtype only
        # mostly the latest value, so programs are chains rather than bushes; the last step always
        # computes on the latest value (a program whose result is a bare view fuses nothing)
        a = live[-1] if last_step or draw(st.integers(0, 3)) else draw(st.sampled_from(live))
        sa = tuple(metas[a].shape)
        kinds = ["unary", "unary", "binary", "binary", "binary"]
        # fp16: a comparison or argmax of a computed value may flip on a near-tie (rounding once vs per op)
        exact_operand = a < len(inputs) or dtype != torch.float16
        if g["cast"] and exact_operand:
            kinds.append("cast")
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
            step = (draw(st.sampled_from(g["unary"])), a)
        elif kind in ("binary", "cast"):
            op = draw(st.sampled_from(g[kind if kind == "binary" else "cast"]))
            partners = [i for i in live if _broadcasts(tuple(metas[i].shape), sa)
                        and (kind == "binary" or i < len(inputs) or dtype != torch.float16)]
            scalar_ok = g["scalars"] and op not in NO_SCALAR
            if scalar_ok and (draw(st.integers(0, 3)) == 0 or not partners):
                step = (op, a, draw(st.sampled_from(g["scalars"])), True)
            else:
                step = (op, a, draw(st.sampled_from(partners)), False)
        elif kind == "reduce":
            reductions += 1
            d = draw(st.sampled_from([0, -1])) if len(sa) > 1 else 0
            ops = [o for o in g["reduce"] if exact_operand or not o.startswith("arg")]
            step = (draw(st.sampled_from(ops)), a, d, draw(st.booleans()))
        elif kind == "cat":
            d = draw(st.integers(0, len(sa) - 1))
            partners = [i for i in live if len(metas[i].shape) == len(sa) and all(
                x == y for j, (x, y) in enumerate(zip(metas[i].shape, sa)) if j != d)]
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


# ----------------------------------------------------------------------------- what must be fused

def required_fused_ops(prog: Program) -> Counter:
    """A lower bound, from the program alone, on the ATen ops (short names, with multiplicity) that
    the partitioner must put in fused regions.  At these sizes a kernel launch (4 us in the cost
    model) dwarfs the bytes, so every legal merge pays; what is left is what is always legal:
      * the ops inside one step that form a same-shape chain (tanh -> exp; gt -> where);
      * a pointwise step reading, directly (no view or layout op between), a pointwise step whose
        result has the same shape as its own: the producer's last op and the consumer's first;
      * a reduction reading, directly, a pointwise step, when no reduction comes before it in the
        program (two reductions over different dims cannot share a kernel, so a producer already
        fused with an earlier reduction may be unavailable).
    Each op is counted once, however many rules ask for it."""
    n = len(prog.inputs)
    metas = [_meta(s, prog.dtype) for s, _ in prog.inputs]
    for step in prog.steps:
        metas.append(apply(step, metas))
    required: set = set()   # (step index, position of the op in aten_ops(step))
    seen_reduction = False
    for k, step in enumerate(prog.steps):
        ops = aten_ops(step)
        op, a = step[0], step[1]
        pointwise = op in UNARY or op in BINARY
        if pointwise and len(ops) > 1:
            required |= {(k, i) for i in range(len(ops))}
        p = a - n   # the step that made operand a, if a step did
        producer_pointwise = p >= 0 and (prog.steps[p][0] in UNARY or prog.steps[p][0] in BINARY)
        if producer_pointwise:
            last = len(aten_ops(prog.steps[p])) - 1
            if pointwise and metas[a].shape == metas[n + k].shape:
                required |= {(p, last), (k, 0)}
            if op in REDUCE and not seen_reduction:
                required |= {(p, last), (k, 0)}
        seen_reduction |= op in REDUCE
    return Counter(aten_ops(prog.steps[k])[i] for k, i in required)


ALIASES = {"clamp": "clamp_min"}  # clamp_min(a, s) is sometimes captured as clamp(a, s, None)


def fused_op_counts(report) -> Counter:
    names = (o.replace("aten.", "").split(".")[0] for r in report.regions for o in r.ops)
    return Counter(ALIASES.get(n, n) for n in names)


def check_fusion(prog: Program, report):
    assert not report.all_fallbacks, report.all_fallbacks
    for u in report.unfused:  # every op of the grammar has a lowering and compiles
        assert not u.reason.startswith(("no Triton lowering", "codegen:", "left out")), (u.op, u.reason)
    need, got = required_fused_ops(prog), fused_op_counts(report)
    missing = need - got
    assert not missing, f"ops the program lets fuse but left eager: {dict(missing)}; fused: {dict(got)}"
    event(f"fused ops beyond the lower bound: {sum((got - need).values()) > 0}")


# ----------------------------------------------------------------------------- inputs and the check

SPECIALS = (float("nan"), float("inf"), -float("inf"))


def make_inputs(prog: Program, device: str) -> list:
    g = torch.Generator().manual_seed(prog.seed)
    out = []
    for shape, transposed in prog.inputs:
        made = tuple(reversed(shape)) if transposed else shape
        if prog.dtype.is_floating_point:
            t = torch.randn(made, generator=g)
            if prog.specials:  # about one element in eight; the first one in row 0 is a NaN
                flat = t.view(-1)
                picks = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 8)]
                kinds = torch.randint(0, 3, (len(picks),), generator=g)
                for i, kind in zip(picks.tolist(), kinds.tolist()):
                    flat[i] = SPECIALS[kind]
                t = t.t() if transposed else t
                t[(0,) * t.dim()] = float("nan")
                t = t.t() if transposed else t
        elif prog.dtype == torch.bool:
            t = torch.randint(0, 2, made, generator=g).bool()
        else:
            t = torch.randint(-4, 5, made, generator=g)
        t = t.t() if transposed else t
        out.append(t.to(device=device, dtype=prog.dtype))
    return out


def assert_close_widened(got, want, ref64, label=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (label, got.shape, want.shape, got.dtype, want.dtype)
    if not want.dtype.is_floating_point:  # ints and bools: bit for bit
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=0, rtol=0, msg=lambda m: f"{label}: {m}")
        return
    t = tol(want.dtype)
    g, w = got.double().cpu(), want.double().cpu()
    r = ref64.double().cpu()
    diff = (g - w).abs()
    allowed = t["atol"] + t["rtol"] * w.abs() + 2 * (w - r).abs()
    bad = ~(diff <= allowed) & ~(g.isnan() & w.isnan()) & ~(g == w)  # g == w: the same infinity
    if bad.any():
        i = (torch.where(bad, (diff - allowed).nan_to_num(nan=float("inf")), torch.zeros_like(diff))).argmax()
        idx = tuple(int(k) for k in torch.unravel_index(i, diff.shape)) if diff.dim() else ()
        raise AssertionError(
            f"{label}: {int(bad.sum())} / {bad.numel()} elements off; worst at {idx}: fused {g[idx].item()!r}, "
            f"eager {w[idx].item()!r}, float64 {r[idx].item()!r}, allowed |fused - eager| <= {allowed[idx].item():.3g}")


# FUSER_FUZZ_EXAMPLES=500 for a longer hunt (the default, 40 per test, keeps the file near a minute and a half on 2 cores)
SETTINGS = dict(max_examples=int(os.environ.get("FUSER_FUZZ_EXAMPLES", 40)), deadline=None, derandomize=True,
                database=None, print_blob=True,
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


def _nan_case(steps, outputs, dtype=torch.float32):
    return Program(dtype, [((5, 7), False), ((7,), False)], steps=steps, outputs=outputs, seed=1, specials=True)


@settings(**SETTINGS)
@given(prog=programs(specials=True))
# always run, whatever hypothesis draws: the cases fixed for NaN (argmax/argmin take the first NaN as
# torch does; sign(NaN) is 0, as eager gives; logical ops on floats read NaN as true)
@example(prog=_nan_case([("tanh", 0), ("argmax", 2, -1, False), ("argmin", 2, 0, True)], [4, 3]))
@example(prog=_nan_case([("sub", 0, 1, False), ("argmin", 2, -1, True), ("amin", 2, 0, False)], [4, 3]))
@example(prog=_nan_case([("sign", 0), ("abs", 2), ("mul_tanh", 3, 1, False)], [4]))
@example(prog=_nan_case([("neg", 0), ("logical_xor", 2, 1, False), ("logical_and", 2, 0, False),
                         ("logical_or", 0, 2, False)], [5, 4, 3], torch.float16))
@example(prog=_nan_case([("exp_tanh", 0), ("mean", 2, -1, True), ("sum", 2, 0, False), ("maximum", 3, 0.25, True)],
                        [5, 4]))
def test_random_program_nan_inf(prog, device):
    """Float inputs with NaN, +inf and -inf sprinkled in (row 0 always has a NaN): NaN and the
    infinities must come out where eager puts them, through reductions (argmax/argmin included)."""
    check_program(prog, device)


@settings(**SETTINGS)
@given(prog=programs(dtypes=INTS + BOOL))
def test_random_program_int_bool(prog, device):
    """int32 / int64 / bool programs: results equal eager's bit for bit (dtype promotion included)."""
    check_program(prog, device)


def check_program(prog: Program, device: str):
    torch._dynamo.reset()
    note(repr(prog))
    inputs = make_inputs(prog, device)
    fused = fuser.fuse(prog)
    got = fused(*inputs)
    want = prog(*inputs)
    ref = prog(*[t.double() if t.is_floating_point() else t for t in inputs])
    note(str(fused.report))
    event(f"fused regions: {len(fused.report.regions)}")
    got, want, ref = [x if isinstance(x, tuple) else (x,) for x in (got, want, ref)]
    assert len(got) == len(want)
    for k, (g, w, r) in enumerate(zip(got, want, ref)):
        assert_close_widened(g, w, r, f"output {k}")
    check_fusion(prog, fused.report)


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
