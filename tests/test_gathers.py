"""Layout ops whose backward used to stay eager (issue 10): index_select (and torch.roll, which
decomposes to it with a computed index), indexing by one integer tensor (a relative-position-bias
table), and slice_scatter (the backward of slicing and of padding removal), steps 1 and above.
Forward and backward against eager, and asserted fused."""
import pytest
import torch
import torch.nn.functional as F

import fuser
from helpers import fused_ops
from tolerances import assert_close_to_eager

DTYPES = [torch.float32, torch.float16]


def _grads(fn, *shapes, device, dtype, seed=0):
    """Gradients of sum(fn(x) * w) for fuser and for an fp64 reference, rounded to dtype (random w,
    so every element counts; fp64 because in 16 bits eager's own roundings exceed the tolerance)."""
    torch.manual_seed(seed)
    xs = [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]
    x64 = [x.detach().double().requires_grad_() for x in xs]
    out = fn(*x64)
    w = torch.randn(out.shape, device=device, dtype=dtype)
    want = [g.to(dtype) for g in torch.autograd.grad((out * w.double()).sum(), x64)]
    got_out = torch.compile(fn, backend="fuser")(*xs)
    got = torch.autograd.grad((got_out.float() * w).sum(), xs)
    assert_close_to_eager(got_out, out.to(dtype))
    return got, want


def _backward_report():
    return next(r for r in reversed(fuser.reports()) if any("backward" in n for n in r.notes))


@pytest.mark.parametrize("dtype", DTYPES)
def test_roll_forward_and_backward_fuse(dtype, device):
    fn = lambda x: torch.roll(x * 2, shifts=(3, -2), dims=(1, 2)).sin()  # noqa: E731
    got, want = _grads(fn, (3, 423, 213), device=device, dtype=dtype)
    assert_close_to_eager(got, want)
    assert {"index_select", "mul"} <= fused_ops(_backward_report())
    assert not [u for r in fuser.reports()[-2:] for u in r.unfused if "index_select" in u.op]


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_select_with_loaded_index_and_out_of_range(dtype, device):
    torch.manual_seed(1)
    x = torch.randn(37, 19, device=device, dtype=dtype)
    idx = torch.randint(0, 19, (23,), device=device)
    fn = lambda x, i: torch.index_select(torch.sigmoid(x), 1, i) + 1  # noqa: E731
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, idx), fn(x, idx))
    assert "index_select" in fused_ops(fused.report)
    if device == "cpu":  # on CUDA an out-of-range index is a device-side assert, fatal to the process
        bad = idx.clone()
        bad[5] = 19
        with pytest.raises((RuntimeError, IndexError), match="out of"):
            fn(x, bad)
        with pytest.raises(RuntimeError, match="out of"):
            fused(x, bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_is_a_gather_in_the_region_that_reads_it(dtype, device):
    """Token and position embeddings, summed and normalised (GPT-2's first block): one region, the
    token ids loaded in it; forward and the table's gradient against eager; an id out of range
    raises, as eager does."""
    torch.manual_seed(2)
    wte, wpe = torch.randn(211, 24, device=device, dtype=dtype), torch.randn(37, 24, device=device, dtype=dtype)
    ids = torch.randint(0, 211, (3, 37), device=device)

    def fn(ids, wte, wpe):
        h = F.embedding(ids, wte) + F.embedding(torch.arange(ids.shape[1], device=ids.device), wpe)
        return F.layer_norm(h, (24,))

    fused = fuser.fuse(fn, dynamic=False)
    assert_close_to_eager(fused(ids, wte, wpe), fn(ids, wte, wpe))
    assert {"embedding", "add", "var_mean"} <= fused_ops(fused.report)
    one = ids[:1, :1].clone()  # a decode step: one token id, loaded as a scalar
    assert_close_to_eager(fused(one, wte, wpe), fn(one, wte, wpe))
    assert not [f for r in fused.reports for f in r.all_fallbacks], [r.all_fallbacks for r in fused.reports]
    assert not [u for u in fused.report.unfused if "embedding" in u.op]
    got, want = _grads(lambda w: F.layer_norm(F.embedding(ids, w) * 2, (24,)), (211, 24), device=device, dtype=dtype)
    # a table row's gradient sums the gradients of its repeats, each rounded to dtype where the program
    # casts (the norm's backward output) and the fp64 reference does not: one rounding per repeat
    assert_close_to_eager(got, want, scale=torch.bincount(ids.flatten()).max().item())
    if device == "cpu":  # on CUDA an out-of-range index is a device-side assert, fatal to the process
        bad = ids.clone()
        bad[1, 5] = 211
        with pytest.raises((RuntimeError, IndexError), match="out of"):
            fn(bad, wte, wpe)
        with pytest.raises(RuntimeError, match="out of"):
            fused(bad, wte, wpe)


SEVERAL = {  # x [5, 7, 6, 9]; i [3, 1] in [-5, 5); j [4] in [0, 6); k [3, 4] in [-9, 9), int32
    "adjacent": lambda x, i, j, k: (x[:, (i % 7), j] * 2).exp(),      # [5, 3, 4, 9]
    "apart": lambda x, i, j, k: x[i, :, j].sin() + 1,                  # [3, 4, 7, 9]: a slice between
    "three": lambda x, i, j, k: x[i, :, j, k] + 1,                     # [3, 4, 7]
    "trailing": lambda x, i, j, k: x[..., j[:3].view(3, 1), k % 9].tanh(),  # [5, 7, 3, 4]: [3, 1] with [3, 4]
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SEVERAL)
def test_indexing_by_several_tensors(case, dtype, device):
    """x[i, j] by integer tensors broadcast together (Hugging Face's mask functions index a mask by batch
    and position tensors): their dims replace the indexed dims where those are adjacent, lead the output
    where a slice separates them; negative indices count from the end; int32 indices."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 6, 9, generator=g).to(dtype).to(device)
    i = torch.randint(-5, 5, (3, 1), generator=g).to(device)
    j = torch.randint(0, 6, (4,), generator=g).to(device)
    k = torch.randint(-9, 9, (3, 4), generator=g).int().to(device)
    fn = SEVERAL[case]
    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, i, j, k), fn(x, i, j, k))
    assert "index" in fused_ops(fused.report) and not fused.report.unfused, fused.report
    if device == "cpu":  # on CUDA an out-of-range index is a device-side assert, fatal to the process
        bad = j.clone()
        bad[2] = 6 if case != "adjacent" else 9
        with pytest.raises((RuntimeError, IndexError), match="out of"):
            fn(x, i, bad, k)
        with pytest.raises(RuntimeError, match="out of"):
            fused(x, i, bad, k)


def test_a_causal_lm_builds_its_mask_in_one_kernel(device):
    """A Hugging Face LLaMA's mask (batch and position tensors indexing a padding mask) is fused: no
    indexing left to eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).to(device).eval()
    ids = torch.randint(0, 97, (2, 11), device=device)
    mask = torch.ones(2, 11, dtype=torch.long, device=device)
    mask[1, :3] = 0  # left padding
    before = len(fuser.reports())
    with torch.no_grad():
        got = torch.compile(model, backend="fuser")(input_ids=ids, attention_mask=mask).logits
        want = model(input_ids=ids, attention_mask=mask).logits
    assert_close_to_eager(got[mask.bool()], want[mask.bool()], scale=10)
    reports = fuser.reports()[before:]
    assert reports and not [u for r in reports for u in r.unfused if u.op.startswith("aten.index")], \
        [u for r in reports for u in r.unfused]


@pytest.mark.parametrize("dtype", DTYPES)
def test_relative_position_bias_table_lookup(dtype, device):
    """`table[index].view(...).permute(...)` added to scores, as Swin and T5-style code writes it;
    negative indices count from the end, as in eager."""
    torch.manual_seed(2)
    win, heads = 7, 3
    table = torch.randn((2 * win - 1) ** 2, heads, device=device, dtype=dtype)
    coords = torch.stack(torch.meshgrid(torch.arange(win), torch.arange(win), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (win - 1)
    index = (rel[..., 0] * (2 * win - 1) + rel[..., 1]).to(device)
    index[0, 0] = -1  # the last row of the table
    scores = torch.randn(5, heads, win * win, win * win, device=device, dtype=dtype)

    def fn(scores, table):
        bias = table[index.view(-1)].view(win * win, win * win, -1).permute(2, 0, 1)
        return torch.softmax(scores + bias.unsqueeze(0), dim=-1)

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(scores, table), fn(scores, table))
    assert "index" in fused_ops(fused.report)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_slice_backward_is_a_fused_slice_scatter(step, dtype, device):
    fn = lambda x: (x[:, 1::step, 2:-1] * 3).sin()  # noqa: E731
    got, want = _grads(fn, (3, 41, 29), device=device, dtype=dtype)
    assert_close_to_eager(got, want)
    assert "slice_scatter" in fused_ops(_backward_report())


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_partition_with_padding_and_shift(dtype, device):
    """Swin's layout: pad to a multiple of the window, cyclic shift, window partition; forward and
    backward against eager, no layout op left to eager."""
    ws = 4

    def fn(x):
        b, h, w, c = x.shape
        x = F.pad(x * 1.5, (0, 0, 0, (-w) % ws, 0, (-h) % ws))
        x = torch.roll(x, shifts=(-2, -2), dims=(1, 2))
        hp, wp = x.shape[1], x.shape[2]
        windows = x.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        return F.gelu(windows)

    before = len(fuser.reports())
    got, want = _grads(fn, (2, 13, 10, 6), device=device, dtype=dtype)
    assert_close_to_eager(got, want)
    layout = ("index_select", "constant_pad_nd", "slice_scatter", "clone", "slice")
    assert not [u.op for r in fuser.reports()[before:] for u in r.unfused if any(o in u.op for o in layout)]


def test_hf_swin_training_step_leaves_no_layout_op_eager(device):
    """A small Hugging Face Swin in training: gradients match eager; in the backward, what stays
    eager is matmuls, lone column sums, copies and the relative-position table's scatter-add, each
    with its reason; no slice_scatter, roll or pad."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                  window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  drop_path_rate=0.0)
    model = transformers.SwinModel(cfg).to(device).train()
    x = torch.randn(2, 3, 32, 32, device=device)
    fused = fuser.fuse(model)
    fused(pixel_values=x).last_hidden_state.square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(pixel_values=x).last_hidden_state.square().mean().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert_close_to_eager(got[n], p.grad, scale=10, msg=n)
    backward = [r for r in fused.reports if any("backward" in n for n in r.notes)]
    assert backward and all(r.regions for r in backward)
    eager = {u.op.split(".")[1] for r in backward for u in r.unfused}
    assert not eager & {"slice_scatter", "index_select", "constant_pad_nd", "roll"}, eager
    assert all(u.reason for r in backward for u in r.unfused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_hot_scatter_is_pointwise(dtype, device):
    """`x.scatter(dim, index, value)` with one index per row (the one-hot of a cross-entropy's backward) is
    where(index == position, value, x) inside the region; it had run eagerly between two kernels.  By a value
    and by a source tensor, on a middle dim, non-contiguous; an index out of range raises, as eager."""
    x = torch.randn(5, 37, 23, device=device, dtype=dtype).transpose(0, 1)  # [37, 5, 23], non-contiguous
    index = torch.randint(0, 5, (37, 1, 23), device=device)
    src = torch.randn(37, 1, 23, device=device, dtype=dtype)

    def fn(x, index, src):
        y = x * 0.5  # small values: a 16-bit rounding of eager's between the ops stays within tolerance
        return (y.scatter(1, index, -1.5) + 1).tanh(), y.scatter(1, index, src * 0.5).sin()

    fused = fuser.fuse(fn)
    assert_close_to_eager(fused(x, index, src), fn(x, index, src))
    rep = fused.report
    assert len(rep.regions) == 1 and not any("scatter" in u.op for u in rep.unfused), rep
    if device == "cpu":  # on CUDA an out-of-range index is a device-side assert, fatal to the process
        for bad_value in (5, -1):
            bad = index.clone()
            bad[3, 0, 7] = bad_value
            with pytest.raises(RuntimeError, match="out of bounds"):
                fn(x, bad, src)
            with pytest.raises(RuntimeError, match="out of bounds"):
                fused(x, bad, src)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropys_backward_is_fused_whole(smoothing, device):
    """F.cross_entropy with ignored targets and label smoothing: its backward's one-hot (a scatter of -1 at
    the target) fuses with the softmax's gradient; no op of the backward runs eagerly."""
    logits = torch.randn(37, 211, device=device, requires_grad=True)
    target = torch.randint(0, 211, (37,), device=device)
    target[::5] = -100

    def fn(logits, target):
        return F.cross_entropy(logits * 0.5, target, label_smoothing=smoothing)

    compiled = torch.compile(fn, backend="fuser")
    start = len(fuser.reports())
    loss = compiled(logits, target)
    got = torch.autograd.grad(loss, logits)
    want = torch.autograd.grad(fn(logits, target), logits)
    assert_close_to_eager(got, want)
    backward = [r for r in fuser.reports()[start:] if r.forward is not None]
    assert backward and backward[0].regions and not backward[0].unfused, backward


_PART_READ = {  # (fn, inputs with one bad index in a row the program does not read)
    "an embedding's first row": (lambda ids, w: F.embedding(ids, w)[0] * 2,
                                 lambda: (torch.tensor([[1, 2], [3, 4], [5, 99]]), torch.randn(10, 4))),
    "a gather's first row": (lambda x, i: torch.gather(x, 1, i)[0] * 2,
                             lambda: (torch.randn(3, 5), torch.tensor([[0, 1], [2, 3], [50, 0]]))),
    "a one-hot scatter's first row": (lambda x, i: (x + 1).scatter(1, i, 5.0)[0] * 2,
                                      lambda: (torch.randn(3, 7), torch.tensor([[0], [1], [99]]))),
    "an embedding's first rows, broadcast wider": (
        lambda ids, w, z: (F.embedding(ids, w * 2)[:, :2, :, None] * z).sin(),
        lambda: (torch.tensor([[1, 2, 3, 4, 5], [3, 4, 5, 6, 99]]), torch.randn(10, 4), torch.randn(64))),
}


@pytest.mark.parametrize("case", list(_PART_READ))
def test_an_index_out_of_range_where_nothing_reads_it_still_raises(case, device):
    """A gather or one-hot scatter read only in part (`embedding(ids, w)[0]`): its kernel checks each index where it
    loads it, so it is not fused with a reader that computes it at fewer elements than it has; an index out of range
    in a row nothing reads raises, as eager raises (it had passed silently)."""
    if device != "cpu":
        pytest.skip("on CUDA an out-of-range index is a device-side assert, fatal to the process")
    fn, make = _PART_READ[case]
    args = make()
    with pytest.raises((RuntimeError, IndexError)):
        fn(*args)
    with pytest.raises((RuntimeError, IndexError), match="out of"):
        fuser.fuse(fn)(*args)
