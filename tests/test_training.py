"""Training through fuser: forward and backward ATen graphs both go through the pipeline.

Gradients match eager (fp32: reordering tolerances), and a short AdamW run follows eager's losses.
Dropout is 0 in the model tests; fused dropout (fuser/dropout.py) has its own tests at the end.
"""
import copy

import pytest
import torch
import torch.fx as fx

import fuser
from fuser.backend import GraphRunner, ReleasingRunner
from fuser.dropout import dropout as fuser_dropout
from fuser.report import FusionReport
from tolerances import tol

transformers = pytest.importorskip("transformers")


def _models(attn="sdpa"):
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation=attn, bos_token_id=0, eos_token_id=0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation=attn))
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn))
    return {"gpt2": gpt2, "llama": llama, "bert": bert}


def _loss(name, model, ids):
    if name == "bert":  # no LM head: a loss over the hidden states
        return model(input_ids=ids).last_hidden_state.pow(2).mean()
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_gradients_match_eager(name, attn, device):
    """attn="eager": attention written out by hand is claimed before autograd and runs as SDPA,
    forward and backward (the forward saves no N x N probabilities)."""
    model = _models(attn)[name].to(device)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 29), device=device)
    fused = fuser.fuse(model)
    _loss(name, fused, ids).backward()
    _loss(name, twin, ids).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if q.grad is None:  # not on the loss's path (BERT's pooler): no gradient, or zeros
            assert p.grad is None or not p.grad.any(), n
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=2e-4, rtol=2e-4, msg=n)
    backward = [r for r in fused.reports if any("backward" in note for note in r.notes)]
    assert backward and backward[0].regions  # the backward graph was fused too
    claimed = [n for r in fused.reports for n in r.notes if n.startswith("attention claimed before autograd")]
    assert len(claimed) == (2 if attn == "eager" else 0), [n for r in fused.reports for n in r.notes]
    assert {"reduction", "pointwise"} <= {r.kind for b in backward for r in b.regions}


def test_adamw_follows_eager(device):
    model = _models()["llama"].to(device)
    twin = copy.deepcopy(model)
    fused = fuser.fuse(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, twin)]
    torch.manual_seed(1)
    batches = [torch.randint(0, 101, (2, 29), device=device)] * 8  # one batch, memorised: the loss must fall
    losses = {"fused": [], "eager": []}
    for ids in batches:
        for key, m, opt in (("fused", fused, opts[0]), ("eager", twin, opts[1])):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["fused"]), torch.tensor(losses["eager"]), atol=1e-3, rtol=1e-3)
    assert losses["fused"][-1] < losses["fused"][0]


def test_train_example(capsys):
    """examples/train.py: every step's loss through fuser follows eager's, the loss falls, and the
    backward graphs were fused (not merely printed)."""
    import re
    import runpy
    from pathlib import Path
    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "train.py"))
    steps = 2  # the second runs on parameters AdamW moved; more repeat it (eight: test_adamw_follows_eager)
    before = len(fuser.reports())  # the process's reports so far (other tests' graphs)
    history, reports = example["main"](steps=steps, batch=2, seq=24)  # the example's (4, 64): twice the time
    reports = reports[before:]
    assert len(history["fuser"]) == len(history["eager"]) == steps
    torch.testing.assert_close(torch.tensor(history["fuser"]), torch.tensor(history["eager"]), atol=1e-3, rtol=1e-3)
    assert history["fuser"][-1] < history["fuser"][0] - 0.05  # it trains
    # what it printed is what it measured
    printed = re.findall(r"step +(\d+) +fuser ([\d.]+) +eager ([\d.]+)", capsys.readouterr().out)
    assert [int(s) for s, _, _ in printed] == list(range(steps))
    for (_, f, e), lf, le in zip(printed, history["fuser"], history["eager"]):
        assert abs(float(f) - lf) < 1e-4 and abs(float(e) - le) < 1e-4
    backward = [r for r in reports if any("backward" in n for n in r.notes)]
    forward = [r for r in reports if r not in backward]
    assert backward and forward
    for group in (forward, backward):
        regions = [reg for r in group for reg in r.regions]
        assert {"reduction", "pointwise"} <= {reg.kind for reg in regions}
        assert all(reg.k >= 1.0 for reg in regions)
        assert not [f for r in group for f in r.all_fallbacks]  # no graph ran as given


class _Attention(torch.nn.Module):
    """Causal self-attention written by hand; `detached` computes a bias under no_grad from a value
    that needs gradients (what a plain trace would get wrong), `p` is dropout on the probabilities."""

    def __init__(self, detached=False, p=0.0):
        super().__init__()
        self.qkv, self.out, self.detached, self.p = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), detached, p

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
        if self.detached:
            with torch.no_grad():
                s = s + x.mean(-1)[:, None, None, :]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        p = torch.nn.functional.dropout(torch.softmax(s, -1), self.p, training=self.training)
        return self.out((p @ v).transpose(1, 2).reshape(b, t, 32))


def _claims(fused):
    return [n for r in fused.reports for n in r.notes if n.startswith("attention ")]


@pytest.mark.parametrize("case", ["static", "dynamic", "no_grad_region", "autocast", "dropout"])
def test_attention_claimed_before_autograd_or_left_with_a_reason(case, device):
    """Claimed (static or symbolic sizes): SDPA's gradients equal eager's.  Left to its ops, with
    the reason in the report: gradients switched off around a value that needs them, autocast around
    the call.  Dropout on the probabilities becomes SDPA's dropout_p (its own random stream: checked
    in law by test_attention_dropout_in_training)."""
    torch.manual_seed(11)
    model = _Attention(detached=case == "no_grad_region", p=0.3 if case == "dropout" else 0.0).to(device)
    twin = copy.deepcopy(model)
    fused = fuser.fuse(model, dynamic=True if case == "dynamic" else None)
    for t in (13, 21) if case == "dynamic" else (13,):
        x = torch.randn(2, t, 32, device=device, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        amp = torch.autocast(device, dtype=torch.bfloat16, enabled=case == "autocast")
        torch.manual_seed(12)
        with amp:
            out = fused(x)
        torch.manual_seed(12)
        with amp:
            ref = twin(x2)
        if case == "dropout":  # another random stream: check shapes and that gradients flow
            out.sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
            continue
        tol = dict(atol=2e-2, rtol=2e-2) if case == "autocast" else dict(atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, ref, **tol)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, **tol)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)
            p.grad = q.grad = None
    if case == "dynamic":  # one graph for both lengths: the claim's trace specialises no size
        assert len([r for r in fused.reports if not any(n.startswith("backward graph") for n in r.notes)]) == 1
    notes = _claims(fused)
    expected = {"static": "attention claimed before autograd", "dynamic": "attention claimed before autograd",
                "no_grad_region": "computed with gradients off", "autocast": "autocast is on",
                "dropout": "dropout_p=0.3"}[case]
    assert any(expected in n for n in notes), notes


def test_attention_option_triton_claims_our_kernel_in_training(device):
    """`attention="triton"` (our kernel always) holds in training too: attention SDPA would take is claimed as
    our op and its backward (it had been left to its ops, the probabilities saved, without a note)."""
    torch.manual_seed(14)
    model = _Attention().to(device)
    twin = copy.deepcopy(model)
    fused = fuser.fuse(model, attention="triton")
    x = torch.randn(2, 13, 32, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = fused(x), twin(x2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=2e-5, rtol=2e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=2e-5)
    assert any("attention claimed before autograd (our kernel" in n for n in _claims(fused)), _claims(fused)


def test_attention_dropout_in_training(device):
    """Dropout on the attention probabilities runs inside SDPA: seeded (the same seed, the same output
    and gradients), its mean over draws is the output without dropout, and gradients flow."""
    torch.manual_seed(15)
    model = _Attention(p=0.25).to(device)
    fused = fuser.fuse(model)
    x = torch.randn(2, 13, 32, device=device, requires_grad=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(16)
        out = fused(x)
        out.sum().backward()
        runs.append((out.detach(), x.grad.clone()))
        x.grad = None
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=0, rtol=0)  # reproducible
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=0, rtol=0)
    with torch.no_grad():
        mean = torch.stack([fused(x) for _ in range(300)]).mean(0)
        model.eval()
        clean = model(x)
    assert not torch.equal(runs[0][0], clean)  # dropout happened
    err = (mean - clean).abs().max().item() / clean.abs().max().item()
    assert err < 0.1, err  # 300 draws: the mean of the kept-and-scaled values is the clean output
    assert any("dropout_p=0.25" in n for n in _claims(fused)), _claims(fused)


def test_padded_attention_with_dropout_runs_our_kernel_with_eagers_masks(device, monkeypatch):
    """BERT fine-tuning as users run it: a padding mask (data: not SDPA, whose backward loses a row it
    masks whole) and dropout on the probabilities: claimed as our kernel with its dropout, the mask drawn
    from a seed per attention.  Exact check: the eager twin's attention dropout is replaced by
    fuser::dropout (fuser/dropout.py), which draws its seed the way the claimed graph does (one per
    layer, in order, from torch's generator) and numbers the probabilities as the kernel does; so from
    the same torch.manual_seed both drop the same elements, and outputs and gradients match."""
    torch.manual_seed(0)
    # two heads of 12 (the interpreter's dropout draws cost per head): the seed numbers heads, batch and positions
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=101, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.2, attn_implementation="eager")).to(device)
    model.train()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (3, 19), device=device)
    mask = torch.ones(3, 19, dtype=torch.long, device=device)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    fused = fuser.fuse(lambda ids, mask: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    w = torch.randn(3, 19, 24, device=device)
    torch.manual_seed(5)
    out = fused(ids, mask)
    (out * w).sum().backward()
    original = torch.nn.functional.dropout
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p=0.5, training=True, inplace=False:
                        fuser_dropout(x, p) if training and p else original(x, p, training, inplace))
    torch.manual_seed(5)
    ref = twin(input_ids=ids, attention_mask=mask).last_hidden_state
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-4, rtol=2e-4, msg=n)
    notes = _claims(fused)
    assert sum("attention claimed before autograd (our kernel" in n for n in notes) == 2, notes  # one a layer
    monkeypatch.undo()
    torch.manual_seed(6)
    assert not torch.allclose(fused(ids, mask), out)  # another seed, another mask


class _CausalAndPadding(torch.nn.Module):
    """A causal mask built from the positions, then a padding mask that is data: two masks, the data one last."""

    def forward(self, q, k, v, pad):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        i = torch.arange(s.shape[-1], device=q.device)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf")) + pad
        return torch.softmax(s, -1) @ v


def test_data_mask_after_another_mask_skips_no_tiles(device):
    """Tiles are skipped from the data mask alone only where nothing before it masks too: here a pad query
    row keeps keys the causal mask already hid and sees its padded keys alone (eager: uniform over them);
    skipping the tiles the padding hides would leave that row nothing (NaN).  Found by review."""
    torch.manual_seed(24)
    q, k, v = (torch.randn(2, 2, 40, 16, device=device, requires_grad=True) for _ in range(3))
    pad = torch.zeros(2, 1, 1, 40, device=device)
    pad[1, ..., :20] = torch.finfo(torch.float32).min
    fused = fuser.fuse(_CausalAndPadding())
    out = fused(q, k, v, pad)
    twin = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = _CausalAndPadding()(*twin, pad)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), twin)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    notes = _claims(fused)
    assert any("attention claimed before autograd (our kernel" in n for n in notes), notes
    assert not any("masks whole skipped" in n for n in notes), notes


class _PerHeadProjection(torch.nn.Module):
    """nanoGPT's q, k, v (views of one [B, T, C] tensor, transposed), soft-capped (our kernel), and the output
    projected per head by a matmul that expands, then views, the attention's output."""

    def __init__(self, heads=2, d=16, e=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(heads, d, e))
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (x.view(b, t, self.heads, c // self.heads).transpose(1, 2) for _ in range(3))
        s = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.25 / 5.0)
        return torch.matmul(torch.softmax(s, -1) @ v, self.w).sum(1)


def test_attention_output_read_through_an_expand_and_a_view(device):
    """The claimed op's output is what the replaced P @ V was (contiguous), so a view after an expand of it still
    views; found by review, where an output in q's layout made AOT Autograd fail and the call raise."""
    torch.manual_seed(27)
    model = _PerHeadProjection().to(device)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 24, 32, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    fused = fuser.fuse(model)
    w = torch.randn(2, 24, 8, device=device)
    (fused(x) * w).sum().backward()
    (twin(x2) * w).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **tol(torch.float32, 3))
    torch.testing.assert_close(model.w.grad, twin.w.grad, **tol(torch.float32, 3))
    assert any(n.startswith("attention claimed before autograd (our kernel") for n in _claims(fused)), _claims(fused)


def test_a_claimed_graph_aot_cannot_trace_falls_back_to_the_graph_as_given(device, monkeypatch):
    """Where AOT Autograd fails on the graph the claims made, Dynamo's own graph goes through AOT instead (fused,
    nothing claimed, the reason in the notes), not to eager as a whole; gradients are eager's."""
    import fuser.backend as backend

    def broken(gm, example_inputs, *args):
        def fails(x):
            raise RuntimeError("a claim AOT cannot trace")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            gm.graph.call_function(fails, (next(n for n in gm.graph.nodes if n.op == "placeholder"),))
        gm.recompile()
        return gm, ["attention claimed before autograd (pretend)"]
    monkeypatch.setattr(backend, "claim", lambda gm, *a: broken(fx.GraphModule(gm, copy.deepcopy(gm.graph)), *a))
    torch.manual_seed(28)
    model = _BufferMasked(48, True, 1, device)
    q, k, v = (torch.randn(2, 3, 37, 16, device=device, requires_grad=True) for _ in range(3))
    fused = fuser.fuse(model)
    got = torch.autograd.grad(fused(q, k, v).sum(), (q, k, v))
    want = torch.autograd.grad(model(q, k, v).sum(), (q, k, v))
    torch.testing.assert_close(got, want, **tol(torch.float32, 3))
    notes = [n for r in fused.reports for n in r.notes]
    assert any("AOT Autograd failed on the graph that claimed them" in n for n in notes), notes
    assert any(r.regions for r in fused.reports) and not any(r.all_fallbacks for r in fused.reports), notes


class _LayersSharingAMask(torch.nn.Module):
    """Two attention layers reading one padding mask (an input: data, new every call), as a model's layers do."""

    def forward(self, q, k, v, pad):
        if pad.dim() == 2:  # [B, N]: viewed as [B, 1, 1, N] in the graph, as HF's models do
            pad = pad[:, None, None, :]
        for _ in range(2):
            s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + pad
            q = torch.softmax(s, -1) @ v
        return q


@pytest.mark.parametrize("viewed", [False, True])
def test_layers_sharing_a_data_mask_make_its_tile_lists_once(viewed, device, monkeypatch):
    """The tile lists of a data mask are made once for the forwards of the layers sharing it and once for their
    backwards (fuser/attention_op.py's cache, keyed by the mask's address, layout and version); a mask written in
    place between calls gets new lists.  Gradients match eager."""
    import fuser.codegen.attention as codegen_attention
    made = []
    real = codegen_attention.list_launches
    monkeypatch.setattr(codegen_attention, "list_launches", lambda *a: made.append(a[-1]) or real(*a))
    torch.manual_seed(26)
    fused = fuser.fuse(_LayersSharingAMask())
    pad = torch.zeros(2, 1, 1, 40, device=device)
    pad[1, ..., 30:] = torch.finfo(torch.float32).min
    for step in range(2):
        if step == 1:
            pad[0, ..., 25:] = torch.finfo(torch.float32).min  # written in place: its version changes
        q, k, v = (torch.randn(2, 2, 40, 16, device=device, requires_grad=True) for _ in range(3))
        twin = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        w = torch.randn(2, 2, 40, 16, device=device)
        got = torch.autograd.grad((fused(q, k, v, pad[:, 0, 0] if viewed else pad) * w).sum(), (q, k, v))
        want = torch.autograd.grad((_LayersSharingAMask()(*twin, pad) * w).sum(), twin)
        torch.testing.assert_close(got, want, **tol(torch.float32, 3))  # 3: two attentions deep
    assert made == [False, True] * 2, made  # per step: the forwards' lists, the backwards' (by query and by key)
    assert any("masks whole skipped" in n for n in _claims(fused)), _claims(fused)


class _BufferMasked(torch.nn.Module):
    """nanoGPT's attention: the causal mask a buffer, sliced to the length and compared; `softcap`: a chain
    SDPA cannot express; `groups` query heads a K/V head, repeated as HF's repeat_kv writes it."""

    def __init__(self, n, softcap, groups, device):
        super().__init__()
        self.softcap, self.groups = softcap, groups
        self.register_buffer("bias", torch.ones(n, n, device=device).tril()[None, None])

    def forward(self, q, k, v):
        b, h, t, d = k.shape
        k, v = (x[:, :, None].expand(b, h, self.groups, t, d).reshape(b, h * self.groups, t, d) for x in (k, v))
        s = (q @ k.transpose(-1, -2)) * d ** -0.5
        if self.softcap:
            s = 5.0 * torch.tanh(s / 5.0)
        s = s.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("groups", [1, 3])
def test_a_mask_in_a_buffer_is_checked_at_run_time_in_training(softcap, groups, device, monkeypatch):
    """A data mask made from a buffer alone is checked when first seen and again only when the buffer is written
    (its version): causal, it runs SDPA's flash kernels forward and backward where the chain is the mask and a
    scale (16-bit CUDA), else our kernels made for the structure; a window, ours for the window; no structure,
    ours over the tile lists.  The backward takes its forward's path.  Gradients match an fp32 eager reference
    at every step."""
    from fuser import attention_op
    if device != "cuda" and softcap != (groups > 1):
        # on CPU (no SDPA flash kernel) soft-cap or not takes the same paths (our kernels made for the structure,
        # then over the tile lists); the soft-cap adds a score mod and its gradient, groups > 1 the K/V heads each
        # read by several query heads: [1-False] (neither) and [3-True] (both) run every path the grid does
        pytest.skip("CPU: the same paths as [1-False] and [3-True]")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(25)
    model = _BufferMasked(48, softcap, groups, device)
    fused = fuser.fuse(model)
    forward, backward, checks = [], [], []
    take, bwd, structure = attention_op._take, attention_op.prepare_bwd, attention_op.mask_structure
    monkeypatch.setattr(attention_op, "_take", lambda *a: forward.append(take(*a)) or forward[-1])
    monkeypatch.setattr(attention_op, "prepare_bwd", lambda *a, **kw: backward.append(
        "lists" if kw["mod"].data_mask else "structured") or bwd(*a, **kw))
    monkeypatch.setattr(attention_op, "mask_structure", lambda *a: checks.append(structure(*a)) or checks[-1])
    for step in range(6):
        if step == 2:  # a window of 5 keys: Mistral's sliding window
            model.bias.tril_().triu_(-4)
        if step == 4:  # no structure left (each row still keeps its own key)
            model.bias[..., 20, 2] = 1.0
        # two K/V heads (the kernels' time grows with the query heads): groups of 3 still repeat each
        q = torch.randn(2, 2 * groups, 37, 16, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, 2, 37, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        w = torch.randn(2, 2 * groups, 37, 16, device=device, dtype=dtype)
        got = torch.autograd.grad((fused(q, k, v) * w).float().sum(), (q, k, v))
        ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
        want = torch.autograd.grad((model(*ref) * w.float()).sum(), ref)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.float(), e, **tol(dtype, 3))  # 3: bf16 P and dS against fp32's
    flash = device == "cuda" and not softcap
    assert [t and t[0] for t in forward] == ["sdpa" if flash else "structured"] * 2 + ["structured"] * 2 + [None] * 2
    assert backward == ([] if flash else ["structured"] * 2) + ["structured"] * 2 + ["lists"] * 2, backward
    assert [c and c[:2] for c in checks] == [(0, None), (0, 5), None], checks  # once per value of the buffer
    notes = _claims(fused)
    assert any("checked at run time" in n for n in notes), notes


def test_t5_learned_position_bias_trains_through_our_kernel(device):
    """T5's attention adds a learned relative-position bias (an embedding's output, with the padding mask
    added to it): claimed before autograd as our kernel, whose backward also gives the bias's gradient
    (summed over the batch it broadcasts over), so the embedding of the buckets trains.  Every parameter's
    gradient matches eager's; the loss projects the output on random directions (T5's final RMSNorm, with
    its unit weights, makes the gradient of a sum of squares zero)."""
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=101, d_model=48, d_kv=12, d_ff=80, num_layers=2, num_heads=4, dropout_rate=0.0,
        attn_implementation="eager")).to(device)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 29), device=device)
    mask = torch.ones(2, 29, dtype=torch.long, device=device)
    mask[1, 20:] = 0
    proj = torch.randn(2, 29, 48, device=device)
    fused = fuser.fuse(model)
    (fused(input_ids=ids, attention_mask=mask).last_hidden_state * proj).sum().backward()
    (twin(input_ids=ids, attention_mask=mask).last_hidden_state * proj).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-4 * q.grad.abs().max().item(), rtol=2e-4, msg=n)
    assert model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad.abs().max() > 0
    notes = [n for r in fused.reports for n in r.notes]
    assert sum(n.startswith("attention claimed before autograd (our kernel") for n in notes) == 2, notes


@pytest.mark.parametrize("multi_query", [True, False])
def test_falcon_in_place_scaled_scores_are_claimed(multi_query, device):
    """Falcon's eager attention scales its scores in place (`scores /= math.sqrt(d)`), an aten.div_ the trace
    before autograd keeps: made functional (nothing else reads those scores), the attention is recognised and
    claimed (our kernel: left padding is a data mask), and every gradient is eager's."""
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, attn_implementation="eager",
        new_decoder_architecture=False, multi_query=multi_query)).to(device)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 19), device=device)
    mask = torch.ones(2, 19, dtype=torch.long, device=device)
    mask[0, :5] = 0
    fused = fuser.fuse(model)
    fused(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    twin(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-4 * q.grad.abs().max().item(), rtol=2e-4, msg=n)
    notes = [n for r in fused.reports for n in r.notes]
    assert sum(n.startswith("attention claimed before autograd (our kernel") for n in notes) == 2, notes


def test_bloom_attention_in_training_is_left_with_its_reason(device):
    """BLOOM's GELU is a custom autograd.Function, which the claim's trace before autograd cannot keep
    (its backward need not be its forward's gradient): the attention is left to its ops, the notes
    name the reason, and the gradients are eager's.  (In inference its baddbmm(alibi, q, kᵀ) scores
    are lowered to SDPA: test_attention.)"""
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=101, hidden_size=48, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)).to(device)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 29), device=device)
    fused = fuser.fuse(model)
    fused(input_ids=ids, labels=ids).loss.backward()
    twin(input_ids=ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-4, rtol=2e-4, msg=n)
    notes = [n for r in fused.reports for n in r.notes]
    assert any("left to its ops" in n and "autograd_function_apply" in n for n in notes), notes


def _attention_gradients_match_eager(attention, device):
    """attention(q, k, v) compiled with fuser: the gradients of q, k and v as eager's (fp32, [2, 3, 37, 16])."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 3, 37, 16, device=device, requires_grad=True) for _ in range(3))
    w = torch.randn(2, 3, 37, 16, device=device)
    got = torch.autograd.grad((torch.compile(attention, backend="fuser")(q, k, v) * w).sum(), (q, k, v))
    want = torch.autograd.grad((attention(q, k, v) * w).sum(), (q, k, v))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **tol(torch.float32))


def test_our_ops_are_called_as_python_functions_in_the_program(device):
    """The forward and backward programs call fuser's own custom ops (attention here) as their Python
    functions, past the dispatcher, in a graph with no fused region too; gradients stay eager's."""
    def attention(q, k, v):
        s = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.3 / 5.0)  # soft-capped: our kernel, not SDPA
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    _attention_gradients_match_eager(attention, device)
    forward, backward = ("\n".join(r.code) for r in fuser.reports()[-2:])
    assert "fuser_attention_op_flash_attention_op(" in forward and "fuser_attention_op_flash_attention_backward_op(" in backward
    assert "torch.ops.fuser" not in forward + backward


def test_attention_over_a_second_head_dim_is_claimed_in_its_own_graph(device):
    """The same attention code called with a second head dim: Dynamo recompiles with the head dim symbolic;
    the recogniser fixes it at its value (a guard: a kernel is made for one head dim), so the second graph's
    attention is claimed too; the first head dim at other lengths compiles one graph more, then reuses it.
    Gradients are eager's throughout.  Soft-capped, so that only our kernel can take it."""
    def attention(q, k, v):
        s = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.3 / 5.0)
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="fuser")
    before = len(fuser.reports())
    for s, d in [(37, 16), (45, 24), (29, 16), (53, 16)]:
        q, k, v = (torch.randn(2, 3, s, d, device=device, requires_grad=True) for _ in range(3))
        w = torch.randn(2, 3, s, d, device=device)
        got = torch.autograd.grad((compiled(q, k, v) * w).sum(), (q, k, v))
        want = torch.autograd.grad((attention(q, k, v) * w).sum(), (q, k, v))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, **tol(torch.float32))
        notes = fuser.reports()[-2].notes  # the forward graph's (the backward's comes after it)
        assert any(n.startswith("attention claimed before autograd") for n in notes), notes
    forward = [r for r in fuser.reports()[before:] if not any(n.startswith("backward graph") for n in r.notes)]
    assert len(forward) == 3, [r.notes for r in forward]  # 16 (static), 24, 16 at any length (the last call reuses it)


class _DropoutBlock(torch.nn.Module):
    """Linear -> dropout -> residual add -> LayerNorm, as a transformer's sublayer writes it."""

    def __init__(self, d=48, p=0.3):
        super().__init__()
        self.lin, self.norm, self.p = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), p

    def forward(self, x):
        return self.norm(x + torch.nn.functional.dropout(self.lin(x), self.p, training=self.training))


def _dropout_notes(fused):
    return [n for r in fused.reports for n in r.notes if "dropout" in n]


def test_dropout_in_training_is_fused_and_saves_no_mask(device):
    """Dropout is claimed before autograd as fuser::dropout: inside a fused region in the forward
    and in the backward, no bool mask among what the forward saves, seeded by torch.manual_seed."""
    model = _DropoutBlock().to(device).train()
    x = torch.randn(5, 37, 48, device=device, requires_grad=True)
    fused = fuser.fuse(model)
    torch.manual_seed(3)
    y = fused(x)
    y.pow(2).mean().backward()
    assert any(n.startswith("dropout claimed before autograd: 1 site") for n in _dropout_notes(fused)), _dropout_notes(fused)
    backward = [r for r in fused.reports if any("backward" in n for n in r.notes)]
    forward = [r for r in fused.reports if r not in backward]
    for group in (forward, backward):
        ops = [o for r in group for reg in r.regions for o in reg.ops]
        assert any("fuser.dropout" in o for o in ops), ops  # fused with its neighbours, not left eager
    saved = [n.meta["val"] for gm in fused.graph_modules[1:] for n in gm.graph.nodes
             if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    assert not any(t.dtype == torch.bool for t in saved), [t.dtype for t in saved]
    first, grad = y.detach().clone(), x.grad.clone()
    x.grad = None
    torch.manual_seed(3)  # the same seed: the same masks, the same output and gradient
    again = fused(x)
    again.pow(2).mean().backward()
    torch.testing.assert_close(again.detach(), first, atol=0, rtol=0)
    torch.testing.assert_close(x.grad, grad, atol=0, rtol=0)
    torch.manual_seed(4)  # another seed: other masks
    assert not torch.equal(fused(x).detach(), first)


def test_dropout_law_and_its_gradient_use_the_forwards_mask(device):
    """Keep rate 1 - p within 6 sigma, kept values x / (1 - p), and the gradient through the same mask."""
    p = 0.3
    fn = fuser.fuse(lambda x, w: torch.nn.functional.dropout(x, p, training=True) * w)
    x = (torch.rand(3, 423, 213, device=device) + 0.5).requires_grad_()  # never 0: a 0 output means dropped
    w = torch.randn(213, device=device)
    y = fn(x, w)
    kept = y != 0
    n = kept.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(y[kept], (x.detach() / (1 - p) * w)[kept], **tol(torch.float32))
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(dx, torch.where(kept, g * w / (1 - p), torch.zeros_like(g)), **tol(torch.float32))
    assert any(n.startswith("dropout claimed before autograd") for n in _dropout_notes(fn))


def test_dropout_option_off_leaves_it_eager(device):
    model = _DropoutBlock().to(device).train()
    fused = fuser.fuse(model, dropout=False)
    fused(torch.randn(2, 7, 48, device=device, requires_grad=True)).sum().backward()
    assert not any("claimed" in n for n in _dropout_notes(fused))
    assert any("dropout" in u.op for r in fused.reports for u in r.unfused)


_BROKEN = []


@torch.fx.wrap
def _kernel_of_ours(a):
    if _BROKEN:
        raise RuntimeError("a kernel of ours failed")
    return a * 2


def _fused_fn(a, b):
    return (_kernel_of_ours(a) + b,)


def test_backward_releases_its_inputs_after_the_first_call(device):
    """A backward graph's first call keeps its inputs (to rerun the graph as given on a failure of
    ours); later calls run boxed: the list is emptied and each input dropped at its last use.  A
    failure after the release is raised with its reason, and later calls run the graph as given."""
    _BROKEN.clear()
    gm = torch.fx.symbolic_trace(_fused_fn)
    runner = ReleasingRunner(GraphRunner(gm.forward, lambda a, b: (a * 2 + b,), FusionReport()), gm)
    a, b = torch.randn(3, 423, device=device), torch.randn(423, device=device)
    for call in range(3):
        args = [a, b]
        (out,) = runner(args)
        torch.testing.assert_close(out, a * 2 + b, **tol(torch.float32))
        assert args == ([a, b] if call == 0 else []), call
    _BROKEN.append(True)
    with pytest.raises(RuntimeError, match="after it released its inputs.*a kernel of ours failed"):
        runner([a, b])
    assert "after its inputs were released" in runner.runner.report.fallback
    args = [a, b]
    torch.testing.assert_close(runner(args)[0], a * 2 + b, **tol(torch.float32))  # as given from now on
    ints = [a, b, 3]  # an int input (symbolic sizes): never released
    runner = ReleasingRunner(GraphRunner(lambda a, b, n: (a * n,), lambda a, b, n: (a * n,), FusionReport()), gm)
    for _ in range(2):
        runner(ints)
        assert len(ints) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on CUDA")
def test_backward_frees_saved_activations_as_it_goes(device):
    """An MLP whose backward reads 16 saved [2048, 2048] fp32 activations (16 MiB each) and writes 8
    weight gradients of 16 MiB: from the second step the activations are freed as the backward
    consumes them, so the gradients no longer stack on top of them all."""
    if device != "cuda":
        pytest.skip("the CUDA run of the suite measures it")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU())
                                  for _ in range(8)]).cuda()
    compiled = torch.compile(model, backend="fuser")
    x = torch.randn(2048, 2048, device="cuda")
    peaks = []
    for _ in range(3):
        loss = compiled(x).square().mean()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
    assert peaks[2] < peaks[0] - 64 * 2**20, [p / 2**20 for p in peaks]


def test_backward_writes_over_donated_activations(device):
    """From its second call a backward graph writes over the saved activations AOT Autograd donates
    (runtime.write_over_donated; here the last linear's output, read once by the loss's gradient):
    the gradients match eager every step, the report says which ops write over them, and
    `retain_graph=True`, which would read them again, is refused (by AOT Autograd)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).to(device)
    ref = copy.deepcopy(model)
    compiled = torch.compile(lambda x: model(x).square().mean(), backend="fuser")
    x = torch.randn(37, 64, device=device)
    for _ in range(3):
        compiled(x).backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol(torch.float32))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    notes = [n for r in fuser.backend.all_reports() for n in r.notes if "AOT Autograd donates" in n]
    assert notes, [r.notes for r in fuser.backend.all_reports()]
    with pytest.raises(RuntimeError, match="retain_graph"):
        compiled(x).backward(retain_graph=True)


@pytest.mark.parametrize("case", ["llama_eager", "falcon_sdpa"])
def test_left_padding_in_training_keeps_eagers_gradients(case, device):
    """Left padding in a causal LM: a pad row's query sees no key.  Eager's probabilities there are
    uniform (Hugging Face's finite fill) or 0 (SDPA's math path, _safe_softmax), and their gradients
    flow back (the labels' shift reads the last pad row).  SDPA's backward recomputes those
    probabilities from a log-sum-exp that lost them (so a data mask goes to our kernel, which keeps the
    row maximum and the log of the row sum apart), and the trace's decomposed _safe_softmax backward
    gives NaN (so a math path the trace could not claim back is traced again whole, left to its ops).
    Gradients: eager's."""
    torch.manual_seed(0)
    if case == "llama_eager":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="eager"))
    else:
        model = transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=False,
            attn_implementation="sdpa", hidden_dropout=0.0, attention_dropout=0.0))
    model = model.to(device)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 16), device=device)
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[1, :4] = 0  # left padding
    fused = fuser.fuse(lambda ids, mask: model(input_ids=ids, attention_mask=mask, labels=ids).loss)  # the loss claimed too
    fused(ids, mask).backward()
    twin(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert not p.grad.isnan().any(), n
        torch.testing.assert_close(p.grad, q.grad, atol=2e-4, rtol=2e-4, msg=n)
    notes = [n for r in fused.reports for n in r.notes]
    if case == "llama_eager":
        assert any("attention claimed before autograd (our kernel" in n and "masks whole skipped" in n for n in notes), notes
    else:
        assert any("left to its ops" in n for n in notes), notes


def test_a_mask_built_from_constants_is_folded_in_both_graphs_not_saved(device):
    """A mask made each call from arange and cumsum (Hugging Face's packed-sequence and causal masks, here with a
    window, so that it is not SDPA's is_causal, which test_sdpa_calls covers) is a constant: the backward
    recomputes it instead of the forward saving it, so each graph folds it and neither runs its ops (cumsum has
    no lowering: it was an eager launch every step); gradients as eager's."""
    def attention(q, k, v):
        pos = torch.arange(q.shape[2], device=q.device) + 0
        seq = (torch.diff(pos, prepend=pos[:1] - 1) != 1).cumsum(-1)  # one packed sequence: all zeros
        mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 5)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _attention_gradients_match_eager(attention, device)
    forward, backward = fuser.reports()[-2:]
    code = "\n".join(forward.code + backward.code)
    assert "cumsum" not in code and "arange" not in code, code
    assert all(any("computed once, at compile time" in n for n in r.notes) for r in (forward, backward)), \
        [forward.notes, backward.notes]


def test_a_small_constant_made_from_a_large_one_is_saved_not_the_large_one(device, monkeypatch):
    """Only constants within the fold limit, made of such constants, are recomputed by the backward: a small
    one made from a larger (here past a lowered limit) would have the min-cut save the larger for the
    backward (cumsum may not be recomputed)."""
    from fuser import fold
    monkeypatch.setattr(fold, "FOLD_LIMIT_BYTES", 1 << 12)

    def f(x):
        big = torch.ones(1 << 12, device=x.device).cumsum(0)  # 16 KiB: past the limit
        small = big.view(-1, 32).amax(1)                        # 512 B
        return (x * small).sum()
    torch._dynamo.reset()
    x = torch.randn(128, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(f, backend="fuser")(x)
    (got,) = torch.autograd.grad(out, x)
    (want,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    assert max(saved, default=0) <= 512, saved


def test_a_claimed_graph_keeps_its_parameters_static(device, monkeypatch):
    """pregrad.claim traces Dynamo's graph again; AOT Autograd reads which inputs are parameters (the static inputs
    CUDA graphs read in place) from Dynamo's attributes on the graph and its placeholders.  Lost, none was static:
    every weight was copied into the CUDA graph's buffers before each replay (run 101)."""
    from fuser import backend
    seen = []

    def spy(gm, n_dynamo, n_inputs, backward, *rest):
        static = backend_static(gm, n_dynamo, n_inputs, backward, *rest)
        seen.append((backward, static))
        return static
    backend_static = backend.static_inputs
    monkeypatch.setattr(backend, "static_inputs", spy)
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)).to(device)
    head = torch.nn.Linear(32, 53, bias=False).to(device)

    def loss(x, y):
        return torch.nn.functional.cross_entropy(head(body(x)), y)
    x, y = torch.randn(37, 24, device=device), torch.randint(0, 53, (37,), device=device)
    first = len(fuser.reports())
    got = torch.compile(loss, backend="fuser")(x, y)
    torch.testing.assert_close(got, loss(x, y), **tol(torch.float32))
    notes = [n for r in fuser.reports()[first:] for n in r.notes]
    assert any(n.startswith("linear + cross-entropy claimed before autograd") for n in notes), notes
    (forward,) = [s for b, s in seen if not b]
    assert len(forward) == len(list(body.parameters())) + len(list(head.parameters())), forward
