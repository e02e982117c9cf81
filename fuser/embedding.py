"""An embedding's gradient as our kernels: one-hot products over a small table, scattered rows over a large one.

aten.embedding_dense_backward stays whole in the graph (ops.KEEP_WHOLE: decomposed, it is an index_put with
accumulate).  Eager runs it as a fill of the table and either a feature kernel (up to 3072 indices: 54-90 us a
call on an H200 whatever the table, runs 70 and 104) or a sort of the indices and segment sums (~15 launches:
T5's relative bias, 65536 indices into 32 buckets).  For a small table, one-hot rows times the gradient rows
(codegen/embedding.py) is one launch (two where the indices are split across programs), exact in fp32 and
deterministic.  For a large one (a vocabulary), the rows are scattered: the table written once, three launches,
the sums of a repeated index in fp32 by atomics (so not bit-for-bit the same run to run: as Inductor's; under
torch.use_deterministic_algorithms the large tables stay with eager's deterministic kernels).  The cost model
picks, per call site (cost.embedding_grad_times).  Not taken: scale_grad_by_freq, symbolic sizes, and the
one-hot kernel in bf16 on CPU (the interpreter's tl.dot is wrong in bf16).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fuser.codegen.embedding import DTYPES, KERNEL, SUM_KERNEL, prepare, prepare_scatter, prepare_sum, source

from . import dtypes
from .cost import embedding_grad_times
from .graph import OWN_CALL, meta, static_shape
from .plan import embedding_grad_plan, scatter_plan
from .runtime import current, launch, launch_sequence, new_tensor

aten = torch.ops.aten
MAX_ROWS = 4096  # tables past this never take the one-hot kernel (it reads the gradient once per 64 rows)


def embedding_dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> torch.Tensor:
    """aten.embedding_dense_backward's value by the one-hot kernel: the [num_weights, D] sum of the gradient
    rows of each index, rows whose index is padding_idx left out."""
    return _grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq, scattered=False)


def embedding_dense_backward_scattered(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                                       padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """The same value by the scatter kernels (a large table)."""
    return _grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq, scattered=True)


def embedding_dense_backward_added(other: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                                   padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """`other.add_(aten.embedding_dense_backward(...))` by the scatter kernels, without the table of zeros: the
    rows added to `other` in place (a tied embedding's gradient and the output layer's: `lower`).  The graph
    traced an add (a new tensor): where `other` is a view (of a wider result), what is returned shares its memory
    without being a view, as a new tensor would be (autograd refuses in-place writes to a view made inside a
    compiled function's output)."""
    out = _grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq, scattered=True, into=other)
    if out._base is None:
        return out
    return torch.empty(0, dtype=out.dtype, device=out.device).set_(out.untyped_storage(), out.storage_offset(),
                                                                   out.size(), out.stride())


embedding_dense_backward_added.returns_args = slice(0, 1)  # its result is its first argument's memory (runtime.aliased)


def _grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq, scattered: bool, into=None):
    d, n = grad.shape[-1], indices.numel()
    if into is not None and not (into.shape == (num_weights, d) and into.dtype == grad.dtype and into.is_contiguous()
                                 and into.device == grad.device):
        return into.add_(aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq))
    if num_weights == 0 or d == 0:  # nothing to sum: eager's CUDA kernel reads past a [V, 0] table (illegal access)
        return grad.new_zeros(num_weights, d) if into is None else into
    if not _ours(grad, n, num_weights, d, scattered) or scale_grad_by_freq:  # `lower` routes none of these here
        eager = aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
        return eager if into is None else into.add_(eager)
    out = grad.new_empty(num_weights, d) if into is None else into
    if n == 0:
        return out.zero_() if into is None else out
    g2 = grad.reshape(n, d)
    g2 = g2 if g2.stride(-1) == 1 or d == 1 else g2.contiguous()
    idx = indices.reshape(-1).contiguous()
    device = grad.device.type
    src = _source(grad.dtype, device)
    with current(grad.device):
        if scattered:
            slot = torch.empty(num_weights, dtype=torch.int32, device=grad.device)
            acc = torch.empty(n, d, dtype=torch.float32, device=grad.device)
            launches = prepare_scatter(g2, idx, slot, acc, out, padding_idx, scatter_plan(d), accumulate=into is not None)
            # the launches' meta and int arguments follow from these (scatter_plan: from d)
            key = (src, n, d, num_weights, g2.stride(0), idx.dtype, padding_idx, into is not None, grad.device)
            launch_sequence(src, launches, device, key)
            return out
        plan = embedding_grad_plan(n, num_weights, d)
        if plan.split == 1:
            grid, args, config = prepare(g2, idx, out, num_weights, padding_idx, plan, partial=False)
            launch(src, KERNEL, grid, args, config, device)
            return out
        part = grad.new_empty(plan.split, num_weights, d, dtype=torch.float32)
        grid, args, config = prepare(g2, idx, part, num_weights, padding_idx, plan, partial=True)
        launch(src, KERNEL, grid, args, config, device)
        grid, args, config = prepare_sum(part, out)
        launch(src, SUM_KERNEL, grid, args, config, device)
    return out


@functools.cache
def _source(dtype: torch.dtype, device_type: str) -> str:
    with dtypes.target(device_type):
        return source(dtype)


def _ours(grad: torch.Tensor, n: int, v: int, d: int, scattered: bool) -> bool:
    """What the kernels take: a float gradient on CUDA or CPU (the one-hot kernel not bf16 on CPU: the
    interpreter's tl.dot is wrong there), a table with rows and columns, offsets within int32 (n * D, V * D)."""
    device_ok = grad.device.type == "cuda" or (grad.device.type == "cpu" and (scattered or grad.dtype != torch.bfloat16))
    return grad.dtype in DTYPES and device_ok and v > 0 and d > 0 and n * d < 2**31 and v * d < 2**31


def lower(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Marks each embedding gradient of gm our kernels take (the wrapper then calls ours:
    runtime.fast_calls); a scattered one that is only added to a tensor no one else reads (a tied table's
    gradient and the output layer's) becomes one call that adds its rows into that tensor's memory (no table
    of zeros, no pass of the add over two [V, D] tables).  Before the partition, so the memory plan and the
    regions see the call where it reads.  Returns (node, a line for the report) for each."""
    out = []
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.embedding_dense_backward.default:
            continue
        why = _taken(n)
        if why is None:
            continue
        a = _added_to(n) if n.meta[OWN_CALL] is embedding_dense_backward_scattered else None
        if a is None:
            out.append((n, why))
            continue
        other = a.args[0] if a.args[1] is n else a.args[1]
        a.target, a.args, a.kwargs = embedding_dense_backward_added, (other, *n.args), {}
        a.meta[OWN_CALL] = embedding_dense_backward_added
        gm.graph.erase_node(n)
        out.append((a, f"{why}, its rows added into {other.name} (tied weights: no table of zeros, no add)"))
    if any(a.target is embedding_dense_backward_added for a, _ in out):
        gm.recompile()
    return out


def _added_to(g: fx.Node) -> fx.Node | None:
    """The add that g's rows can go into: `add(x, g)` or `add(g, x)`, no alpha, all three of one shape and
    dtype, x contiguous and all of the memory of a new tensor of an op (directly, or through views that keep
    all of it: a matmul's transposed result transposed back) that only this add reads, g read only there:
    then x's memory is the add's to write."""
    if len(g.users) != 1:
        return None
    a = next(iter(g.users))
    if a.op != "call_function" or a.target is not aten.add.Tensor or a.kwargs or len(a.args) != 2:
        return None
    x = a.args[0] if a.args[1] is g else a.args[1] if a.args[0] is g else None
    if not isinstance(x, fx.Node) or x is g:
        return None
    root = x
    while len(root.users) == 1 and isinstance(root.target, torch._ops.OpOverload) and root.target.is_view \
            and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    o, v, r, base = meta(x), meta(g), meta(a), meta(root)
    if root.op != "call_function" or len(root.users) != 1 or not new_tensor(root) or None in (o, v, r, base) \
            or not o.is_contiguous() or o.storage_offset() != 0 or base.numel() != o.numel():
        return None
    return a if o.shape == v.shape == r.shape and o.dtype == v.dtype == r.dtype and o.device == v.device else None


def _taken(n: fx.Node) -> str | None:
    """The report's line for an embedding gradient our kernels take (and the call set on the node), or None."""
    if n.kwargs or len(n.args) != 5:
        return None
    grad, indices, num_weights, _, scale = n.args
    g, i = meta(grad), meta(indices)
    if scale or g is None or i is None or not isinstance(num_weights, int):
        return None
    if i.dtype not in (torch.int32, torch.int64) or g.dim() == 0:
        return None
    if not (static_shape(g) and static_shape(i)):
        return None
    rows, d = i.numel(), g.shape[-1]
    if num_weights == 0 or d == 0:
        n.meta[OWN_CALL] = embedding_dense_backward
        return f"{n.name}: an empty [{num_weights}, {d}] table's gradient, no kernel (eager's CUDA kernel reads past it)"
    one_hot, scatter, eager = embedding_grad_times(rows, num_weights, d, g.element_size())
    if num_weights > MAX_ROWS or not _ours(g, rows, num_weights, d, scattered=False):
        one_hot = float("inf")
    if torch.are_deterministic_algorithms_enabled() or not _ours(g, rows, num_weights, d, scattered=True):
        scatter = float("inf")  # its atomics sum a repeated index's rows in no fixed order
    if min(one_hot, scatter) >= eager:
        return None
    table = f"a [{num_weights}, {d}] table's gradient over {rows} indices"
    if one_hot <= scatter:
        n.meta[OWN_CALL] = embedding_dense_backward
        return f"{n.name}: {table}, one-hot rows x gradient rows (modelled {one_hot * 1e6:.1f} us, eager's {eager * 1e6:.1f})"
    n.meta[OWN_CALL] = embedding_dense_backward_scattered
    return f"{n.name}: {table}, rows scattered (modelled {scatter * 1e6:.1f} us, eager's {eager * 1e6:.1f})"

