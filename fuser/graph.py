"""What the partitioner and the cost model see of an fx graph: compute nodes and the data between them.

Views (and constant generators such as `full` or `arange`) cost nothing and can be re-derived by
index math anywhere, so they are transparent: an edge through a chain of views links the compute
nodes at its ends, and a view never becomes a region's output.
"""
from __future__ import annotations

import operator
from functools import cached_property

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._sympy.functions import FloatTrueDiv, IntTrueDiv, ToFloat

from . import indexing as ix
from . import ops
from .dtypes import TL_DTYPE

aten = torch.ops.aten
GENERATORS = {aten.full, aten.full_like, aten.scalar_tensor, aten.arange}


def meta(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape(n) -> tuple:
    """The node's shape as sympy expressions (ints, or Dynamo's size symbols where sizes vary)."""
    return ix.shape_of(meta(n))


def numel(n):
    return ix.numel(shape(n))


def is_tensor(n) -> bool:
    return meta(n) is not None


def static_shape(t: torch.Tensor) -> bool:
    """Every size an int (none of Dynamo's size symbols)."""
    return all(isinstance(s, int) for s in t.shape)


def _scattered(n, d: int) -> tuple:
    """The positions index_put n writes: its input's dims, dim d replaced by the index's."""
    dst = shape(n)
    return (*dst[:d], *shape(n.args[1][d]), *dst[d + 1:])


def cpu_scalar(t) -> bool:
    """A 0-d CPU tensor: eager and our kernels read it as a number, on any device."""
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"


def computed_from(nodes, source: fx.Node) -> bool:
    """Is any of `nodes` `source` or computed from it (through any nodes)?"""
    stack, seen = list(nodes), set()
    while stack:
        a = stack.pop()
        if a is source:
            return True
        if a not in seen:
            seen.add(a)
            stack.extend(a.all_input_nodes)
    return False


def is_size(n) -> bool:
    """A node computing a size (a SymInt from sym_size, or arithmetic on sizes): not data; a
    kernel that needs the value takes it as an argument."""
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _float_of_sizes_refused(n: fx.Node, a: fx.Node, sizes) -> str | None:
    """Why op n cannot take the float of sizes `a` as an operand, or None.  Only the arithmetic takes it (other
    ops read their scalars as Python numbers while lowering), and only where every division in it is by a size
    that is nonzero at every size (eager's Python division raises ZeroDivisionError where it is 0)."""
    if packet(n) not in ops.FLOAT_OPERAND_OPS:
        return "an operand is a symbolic float, which this op reads as a number"
    e = a.meta["val"].node.expr
    for d in e.atoms(IntTrueDiv, FloatTrueDiv):
        den = d.args[1]
        den = den.args[0] if isinstance(den, ToFloat) else den
        if not sizes.lt(0, den):
            return "an operand is a symbolic float dividing by a size that may be 0 (eager raises there)"
    return None


def fold_fixed_sizes(graph: fx.Graph) -> int:
    """Size nodes whose value guards have fixed (a head dim specialised: `sym_sqrt(sym_float(d))`) replaced
    in their readers by the constants they now are, so the ops reading them are plain ops on literals
    (a symbolic float leaves its reader to eager); the size computations left unread are erased."""
    done = 0
    for n in list(graph.nodes):
        v = n.meta.get("val")
        if not isinstance(v, (torch.SymInt, torch.SymFloat)) or not n.users or not (e := v.node.expr).is_number:
            continue
        value = int(e) if isinstance(v, torch.SymInt) else float(e)
        for u in list(n.users):
            u.args, u.kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: value if a is n else a)
        done += 1
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and not n.users and is_size(n):
            graph.erase_node(n)
    return done


def is_generator(n) -> bool:
    """full, arange, ...: values from the index alone (full_like reads only its operand's shape)."""
    return getattr(n.target, "overloadpacket", None) in GENERATORS


def packet(n):
    """The op packet of a call node (aten.add for aten.add.Tensor), else None."""
    return getattr(n.target, "overloadpacket", None) if isinstance(n, fx.Node) else None


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's own inputs (before AOT Autograd, Dynamo's: not the tracing
    context's, which detect_fake_mode would give first)."""
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None) or detect_fake_mode(vals)


def fake_value(n: fx.Node, mode):
    """n's fake tensor, computed from its operands' under `mode`."""
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
    with mode:
        return n.target(*args, **kwargs)


def insert(graph: fx.Graph, before: fx.Node, mode, target, *args, **kwargs) -> fx.Node:
    """A call of `target` inserted before `before`, with its fake tensor (computed under `mode`)."""
    with graph.inserting_before(before):
        n = graph.call_function(target, args, kwargs)
    n.meta["val"] = fake_value(n, mode)
    return n


def refresh_fake(gm: fx.GraphModule, changed: list):
    """The fake tensors of `changed` nodes and of everything downstream of them, again (a rewrite
    that changes a value's strides changes its readers'); the rest keep theirs."""
    mode = fake_mode_of(gm.graph)
    stale = set(changed)
    for n in gm.graph.nodes:
        if n.op != "call_function" or not (n in stale or any(a in stale for a in n.all_input_nodes)):
            continue
        stale.add(n)
        n.meta["val"] = fake_value(n, mode)


# meta key of an op that runs as our kernel even alone, where the cost model (which takes an eager
# kernel to run at full bandwidth) would leave it: split.py's partial column sums, which eager's
# reduce kernel ran at 14-19 us each for ~10 MB (ViT's bias gradients, bench/notes.md run 33)
OWN_KERNEL = "fuser_own_kernel"
# an eager op an op-family module takes (fuser/embedding.py): the function the wrapper calls instead of the
# op, with the op's arguments (runtime.fast_calls swaps it in, once no pass reads the op's schema)
OWN_CALL = "fuser_own_call"


def replaced(gm: fx.GraphModule, changed: list) -> None:
    """After a rewrite of gm's graph: check it, regenerate its code, trace the fake tensors of the
    `changed` nodes (and their readers) again."""
    gm.graph.lint()
    gm.recompile()
    refresh_fake(gm, changed)


def replace_output(old: fx.Node, new: fx.Node) -> None:
    """`old`'s uses go to `new`, an op's output that may be laid out otherwise than `old` (SDPA's memory order,
    our attention op's): its views (Falcon's flatten(0, 1)) become reshapes.  Recorded on `old` for the units
    found in the same pass that read it (attentions chained with no projection between): see `current`."""
    for u in list(old.users):
        if u.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            u.target = torch.ops.aten.reshape.default
    old.replace_all_uses_with(new)
    old.meta["replaced_by"] = new


_VIEWS = {torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.view.default,
          torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


def contiguous_where_copied(new: fx.Node) -> None:
    """A copy the program made of an SDPA call's output `new` through views to lay it out contiguously (HF's
    `out.transpose(1, 2).contiguous()`: AOT's clone, as the traced [B, H, M, D] was not) becomes
    `aten.contiguous`, a copy only where the tensor is not contiguous at run time: SDPA's fused kernels
    write [B, M, H, D], so the transpose is one already, and the fake tensors cannot say which kernel runs.
    Only for SDPA's own output: a clone after a pointwise op on it fuses into that op's region (one launch
    either way; `aten.contiguous` would be a second).  What the clone made may now share memory with `new` (a
    fresh tensor; the wrapper's buffer reuse reads the op's schema, which says so)."""
    stack = list(new.users)
    while stack:
        u = stack.pop()
        if u.target in _VIEWS and u.args[0] is not None:
            stack.extend(u.users)
        elif u.target is torch.ops.aten.clone.default and u.kwargs.get("memory_format") is torch.contiguous_format:
            with u.graph.inserting_before(u):
                c = u.graph.call_function(torch.ops.aten.contiguous.default, u.args, u.kwargs)
            c.meta = dict(u.meta)
            u.replace_all_uses_with(c)
            u.graph.erase_node(u)


def current(n):
    """What `n` stands for now: the node that replaced it (`replace_output`), or `n`."""
    while isinstance(n, fx.Node) and "replaced_by" in n.meta:
        n = n.meta["replaced_by"]
    return n


def operands(n: fx.Node) -> list[fx.Node]:
    """Node operands in order (cat's list flattened): what n must wait for, even where it reads no data."""
    out = []
    for a in (*n.args, *n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, fx.Node):
                out.append(x)
    return out


class ComputeGraph:
    """The fx graph with transparent nodes contracted away, plus each node's op-table entry."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.sizes = ix.Sizes.of_graph(graph)
        self.info = {}
        for n in self.nodes:  # in order: a getitem's kind follows its parent's
            self.info[n] = self._classify(n)

    def _classify(self, n):
        if n.op != "call_function":
            return ops.Opaque("graph input or output")
        if is_size(n):
            return ops.Opaque("a size computation (host arithmetic)")
        if n.target is operator.getitem:
            parent = n.args[0]
            kind = self.info.get(parent)
            if isinstance(kind, ops.Reduction) and is_tensor(n):
                return ops.Layout(None)
            return ops.Opaque("a component of an op left to eager")
        packet = getattr(n.target, "overloadpacket", None)
        if packet in ops.OPAQUE:
            return ops.Opaque(ops.OPAQUE[packet])
        if not is_tensor(n):
            if isinstance(n.meta.get("val"), (tuple, list)) and packet is aten.var_mean:
                return ops.classify(n)
            return ops.Opaque("its result is not a single tensor")
        v = meta(n)
        if v.dtype.is_complex or v.dtype not in TL_DTYPE:
            return ops.Opaque(f"dtype {v.dtype} has no Triton lowering here")
        if v.device.type not in ("cuda", "cpu"):
            return ops.Opaque(f"device {v.device.type} is not supported")
        kind = ops.classify(n)
        if isinstance(kind, (ops.Pointwise, ops.Layout, ops.Reduction)):
            for a in operands(n):
                if is_size(a):
                    if isinstance(a.meta["val"], torch.SymBool):
                        return ops.Opaque("an operand is a symbolic bool")
                    if isinstance(a.meta["val"], torch.SymFloat) and (reason := _float_of_sizes_refused(n, a, self.sizes)):
                        return ops.Opaque(reason)
                    continue  # a symbolic int or float: a function of the sizes the kernel takes as arguments
                if meta(a) is None:
                    return ops.Opaque("an operand is not a tensor")
                if meta(a).dtype not in TL_DTYPE:
                    return ops.Opaque(f"operand dtype {meta(a).dtype} has no Triton lowering here")
                if meta(a).device != v.device and meta(a).dim() > 0:
                    return ops.Opaque("operands on another device")
                if (meta(a).is_neg() or meta(a).is_conj()) and not self.fusible(a):
                    return ops.Opaque("an operand is a view by the negative or conjugate bit (`conj().imag`), which "
                                      "a kernel reading its memory would not apply: eager resolves it")
        if isinstance(kind, ops.Scatter):
            for a in operands(n):
                if meta(a) is None or meta(a).dtype not in TL_DTYPE or meta(a).device != v.device:
                    return ops.Opaque("index_put with an operand of another device or dtype: left to eager")
            reason = self._scatter_refusal(n, kind.dim)
            if reason is not None:
                return ops.Opaque(reason)
        if n.target is aten._to_copy.default and n.kwargs.get("device") not in (None, v.device) \
                and operands(n) and meta(operands(n)[0]).device != v.device:
            return ops.Opaque("a device transfer")
        return kind

    def fusible(self, n) -> bool:
        return isinstance(self.info[n], (ops.Pointwise, ops.Layout, ops.Reduction, ops.Scatter))

    def store_shape(self, n) -> tuple:
        """The elements n's kernel stores: its result's shape, or for a Scatter the indexed positions
        (the input's dims, the indexed one replaced by the index's)."""
        kind = self.info.get(n)
        return _scattered(n, kind.dim) if isinstance(kind, ops.Scatter) else shape(n)

    def _scatter_refusal(self, n, d: int) -> str | None:
        """Why index_put n cannot store into its input in place, in a kernel of ours: the input must be a
        graph input that nothing but n reads, which the graph's end writes back (AOT Autograd's copy_ of a
        mutated input: nothing can have wanted its old values, so writing it where n runs changes no
        read), and sizes static (the wrapper hands the input to the kernel as its output buffer)."""
        dst, values, index = n.args[0], n.args[2], n.args[1][d]
        others = [u for u in dst.users if u is not n]
        if dst.op != "placeholder" or len(others) != 1 or others[0].target is not aten.copy_.default \
                or others[0].args[1] is not n:
            return "index_put into a tensor read elsewhere in the graph: eager's (in place where nothing reads it after)"
        if torch.are_deterministic_algorithms_enabled():
            return "index_put under torch.use_deterministic_algorithms: eager's (repeated indices written in order)"
        v, into, x = meta(values), meta(dst), meta(n)
        if not all(static_shape(t) for t in (v, into, meta(index))) or x.stride() != into.stride() \
                or v.dtype != into.dtype or ix.broadcast_shapes(_scattered(n, d), shape(values)) != _scattered(n, d):
            return "index_put over symbolic sizes, another layout or dtype, or broadcast values: left to eager"
        return None

    def transparent(self, n) -> bool:
        """Costs nothing in eager and is re-derived by index math: views and generators."""
        k = self.info[n]
        if isinstance(k, ops.Layout) and n.target is not operator.getitem:
            return not k.copies
        return isinstance(k, ops.Pointwise) and is_generator(n)

    def is_compute(self, n) -> bool:
        return n.op == "call_function" and not self.transparent(n) and not is_size(n)

    @cached_property
    def _data_inputs(self) -> dict:
        out = {}
        for n in self.nodes:
            found = []
            skip = n.args[0] if isinstance(self.info.get(n), ops.Scatter) else None  # written, not read
            for a in operands(n) if n.op == "call_function" else []:
                if not is_size(a) and a is not skip:
                    found.extend(out[a] if self.transparent(a) else [a])
            out[n] = list(dict.fromkeys(found))
        return out

    def data_inputs(self, n) -> list:
        """The non-transparent nodes whose data n reads (through views)."""
        return self._data_inputs[n]

    @cached_property
    def _consumers(self) -> dict:
        out = {n: [] for n in self.nodes}
        for n in self.nodes:
            if n.op == "output":
                for a in n.all_input_nodes:
                    if is_size(a):
                        continue
                    for base in ([a] if not self.transparent(a) else self._data_inputs[a]):
                        out[base].append(n)
                        if self.transparent(a):
                            out[a].append(n)
            elif not self.transparent(n):
                for a in self._data_inputs[n]:
                    out[a].append(n)
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}

    def consumers(self, n) -> list:
        """Compute nodes (and the output node) that read n's data, through views."""
        return self._consumers[n]

    def read_elems(self, consumer, base) -> int:
        """Elements a consumer reads of `base`: the smallest tensor on the view chain between them
        (compared at the hints where sizes are symbolic)."""
        best = None
        kind = self.info.get(consumer)
        for i, a in enumerate(operands(consumer)):
            chain = self._chain_to(a, base)
            if chain is not None:
                m = min((numel(c) for c in chain), key=self.sizes.hint)
                if i == 0 and isinstance(kind, ops.Layout) and kind.indirect:  # a gather reads what it picks
                    m = min(m, numel(consumer), key=self.sizes.hint)
                best = m if best is None else max(best, m, key=self.sizes.hint)
        return best if best is not None else numel(base)

    def _chain_to(self, n, base):
        if n is base:
            return [n]
        if not self.transparent(n):
            return None
        for a in operands(n):
            c = self._chain_to(a, base)
            if c is not None:
                return [n, *c]
        return None


def real_tensors():
    """Fake mode off: for values computed at compile time."""
    return unset_fake_temporarily()


def run_node(node, values):
    def arg(a):
        return values[a] if isinstance(a, fx.Node) else a
    args = torch.utils._pytree.tree_map(arg, node.args)
    kwargs = torch.utils._pytree.tree_map(arg, node.kwargs)
    return node.target(*args, **kwargs)


def constant_value(n: fx.Node) -> torch.Tensor | None:
    """n's real value when it is computed from constants alone (compile time), else None."""
    try:
        with torch.no_grad(), real_tensors():
            return fold_into(n, {})
    except (RuntimeError, TypeError, ValueError):
        return None


def fold_into(n, values: dict, depth=0):
    """n's value when it is computed from constants alone (small graphs of them), else None; the
    values met on the way are kept in `values`.  Call with fake mode off (real_tensors)."""
    if n in values:
        return values[n]
    if n.op == "get_attr":  # a value fold.py computed at compile time, or a constant the trace lifted
        const = n.meta.get("folded") or n.target.startswith("_tensor_constant")
        value = getattr(n.graph.owning_module, n.target, None) if const else None
        values[n] = value if isinstance(value, torch.Tensor) else None
        return values[n]
    if n.op != "call_function" or depth > 64:
        return None
    for a in n.all_input_nodes:
        if fold_into(a, values, depth + 1) is None:
            return None
    values[n] = run_node(n, values)
    return values[n]
