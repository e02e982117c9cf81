"""fuse(dynamic=...), attribute forwarding, fused.generate() for Hugging Face models, graph breaks
said in the log and the report, and a model called at many lengths through fuse()."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.api import FusedModule
from tolerances import assert_close_to_eager

transformers = pytest.importorskip("transformers")

GREEDY = dict(do_sample=False, pad_token_id=0)


def _forward_graphs(fused) -> list:
    """The forward graphs this FusedModule compiled (backward graphs carry the note "backward graph")."""
    return [r for r in fused.reports if not any("backward graph" in n for n in r.notes)]


def _tiny_gpt2(device):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).to(device).eval()


def _tiny_llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def _prompt(device, length=7):
    return torch.randint(1, 97, (1, length), generator=torch.Generator().manual_seed(1)).to(device)


# -- dynamic= ------------------------------------------------------------------------------------

def test_dynamic_is_validated_and_stored(device):
    def f(x):
        return torch.exp(x) * 2 + 1

    assert fuser.fuse(f).dynamic is None  # the default: automatic dynamic, as torch.compile
    assert fuser.fuse(f, dynamic=True).dynamic is True
    assert fuser.fuse(f, dynamic=False).dynamic is False
    for bad in ("yes", 1, 0, "auto"):
        with pytest.raises(ValueError, match="dynamic="):
            fuser.fuse(f, dynamic=bad)
    with pytest.raises(TypeError):
        fuser.fuse(f, None, True)  # keyword only: not a second positional argument


def test_dynamic_true_is_symbolic_from_the_first_call(device):
    def f(x):
        return torch.exp(x) * 2 + 1

    fused = fuser.fuse(f, dynamic=True)
    for n in (5, 9):
        x = torch.randn(3, n, device=device)
        assert_close_to_eager(fused(x), f(x))
    (graph,) = _forward_graphs(fused)
    assert graph.regions[0].symbolic


# -- attribute forwarding ------------------------------------------------------------------------

def test_attributes_of_the_model_are_forwarded(device):
    model = _tiny_gpt2(device)
    model.my_flag = "here"
    fused = fuser.fuse(model)
    assert fused.config is model.config
    assert fused.device == model.device and fused.device.type == device
    assert fused.dtype == model.dtype == torch.float32
    assert fused.generation_config is model.generation_config
    assert fused.my_flag == "here"
    assert fused.transformer is model.transformer  # a submodule of the model
    assert fused.get_input_embeddings() is model.get_input_embeddings()  # a method
    assert fused.dynamic is None and isinstance(fused.report, fuser.FusionReport)  # its own come first
    assert dict(fused.named_parameters()).keys() == {f"model.{k}" for k, _ in model.named_parameters()}
    with pytest.raises(AttributeError, match="no_such_thing.*GPT2LMHeadModel"):
        fused.no_such_thing
    assert not hasattr(fused, "__no_such_dunder__")


def test_forwarding_without_a_model_does_not_recurse(device):
    empty = FusedModule.__new__(FusedModule)  # as unpickling or copy meet it: no __init__, no `model`
    with pytest.raises(AttributeError):
        empty.config
    assert not hasattr(empty, "model")
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    model.tag = "mine"
    twin = copy.deepcopy(fuser.fuse(model))
    assert twin.model is not model and twin.tag == "mine"


# -- generate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_generate_16_tokens_matches_and_compiles_at_most_three_graphs(build, device):
    """Greedy decoding through fuser gives HF's tokens; prefill and decode run fused regions; a
    KV cache that grows every step compiles at most 3 graphs (prefill, the first decode step at fixed
    sizes, then one generic over the cache length: 14 more lengths on it).  16 tokens, not 32: the
    same three graphs, half the interpreted steps (CI's time)."""
    model = build(device)
    ids = _prompt(device)
    want = model.generate(ids, max_new_tokens=16, **GREEDY)
    fused = fuser.fuse(model)
    got = fused.generate(ids, max_new_tokens=16, **GREEDY)
    assert torch.equal(got, want), (got, want)
    assert "forward" not in model.__dict__  # the model's forward is its own again
    report = fused.report
    assert report.regions and not report.fallbacks, report
    graphs = _forward_graphs(fused)
    assert len(graphs) <= 3, [str(g) for g in graphs]
    assert len(graphs) >= 2 and all(g.regions and not g.fallback for g in graphs), [str(g) for g in graphs]
    assert {g.graph for g in graphs} <= {r.graph for r in report.regions}  # prefill's and decode's ran fused


@pytest.mark.parametrize("build", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_generate_sees_the_models_forward_signature(build, device):
    """HF's generate reads the forward's signature to decide what it passes (position_ids from the attention
    mask, the mask, logits_to_keep): the forward fused.generate routes through carries the model's signature.
    Hidden, GPT-2 decoded a left-padded row from positions 0..T-1 (wrong logits and tokens), and a generate
    continuing from a returned cache decoded other tokens (found by a helper's sweep)."""
    model = build(device)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, output_logits=True, **GREEDY)
    want = model.generate(ids, **kw)
    fused = fuser.fuse(model)
    got = fused.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert_close_to_eager(list(got.logits), list(want.logits))
    more = torch.cat([want.sequences, torch.randint(3, 97, (2, 2), generator=torch.Generator().manual_seed(2)).to(device)], 1)
    mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long, device=device)], 1)
    kw.update(attention_mask=mask, max_new_tokens=3)
    want = model.generate(more, past_key_values=want.past_key_values, **kw)
    got = fused.generate(more, past_key_values=got.past_key_values, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert fused.report.regions and not fused.report.all_fallbacks, fused.report


def test_generate_with_every_shape_specialised(device):
    """dynamic=False: a graph per shape; the tokens are HF's all the same."""
    model = _tiny_gpt2(device)
    ids = _prompt(device, 5)
    want = model.generate(ids, max_new_tokens=4, **GREEDY)
    fused = fuser.fuse(model, dynamic=False)
    assert torch.equal(fused.generate(ids, max_new_tokens=4, **GREEDY), want)
    graphs = _forward_graphs(fused)
    assert len(graphs) >= 3 and not any(r.symbolic for g in graphs for r in g.regions)
    assert fused.report.regions and not fused.report.fallbacks
    assert "forward" not in model.__dict__


class _Stepper(nn.Module):
    """Not a Hugging Face model: a `generate` that calls the model, the way GenerationMixin does."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.outer = None

    def forward(self, x):
        return F.gelu(self.ln(x)) * 2 + x

    def generate(self, x, steps=2, fail=False):
        for _ in range(steps):
            x = self(x)
            if fail:
                raise KeyError("inside generate")
            if self.outer is not None:
                self.outer.generate(x)
        return x


def test_generate_routes_forward_restores_it_and_refuses_recursion(device):
    model = _Stepper().to(device)
    x = torch.randn(3, 16, device=device)
    want = model.generate(x)
    fused = fuser.fuse(model)
    assert_close_to_eager(fused.generate(x), want)
    assert fused.report.regions and "forward" not in model.__dict__
    with pytest.raises(KeyError, match="inside generate"):
        fused.generate(x, fail=True)
    assert "forward" not in model.__dict__  # restored on an exception too
    model.outer = fused
    with pytest.raises(RuntimeError, match="inside itself"):
        fused.generate(x)
    model.outer = None
    assert "forward" not in model.__dict__
    assert_close_to_eager(fused.generate(x), want)  # still usable


def test_generate_needs_a_model_with_generate(device):
    fused = fuser.fuse(nn.Linear(4, 4))
    with pytest.raises(AttributeError, match="Linear has no generate"):
        fused.generate(torch.randn(2, 4))


# -- graph breaks --------------------------------------------------------------------------------

def test_graph_break_is_said_in_the_log_and_the_report(device, caplog):
    def f(x, y):
        a = torch.exp(x * 2) + y
        torch._dynamo.graph_break()
        return torch.tanh(a * 3) - y

    fused = fuser.fuse(f)
    x, y = torch.randn(4, 9, device=device), torch.randn(4, 9, device=device)
    with caplog.at_level(logging.WARNING, logger="fuser"):
        assert_close_to_eager(fused(x, y), f(x, y))
        assert_close_to_eager(fused(x, y), f(x, y))  # compiled code reused: no second warning
    warnings = [r for r in caplog.records if r.name == "fuser" and "graph break" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "graph_break()" in warnings[0].getMessage() and "f" in warnings[0].getMessage()
    report = fused.report  # the latest call: both pieces ran fused, and the break is named
    assert len({r.graph for r in report.regions}) == 2 and not report.fallbacks, report
    (note,) = [n for n in report.notes if n.startswith("graph break:")]
    assert "graph_break()" in note and "runs eagerly" in note and note in str(report)


def test_untraceable_call_is_a_graph_break_with_its_reason(device, caplog):
    def f(x):
        a = torch.exp(x) * 2
        print(end="")  # Dynamo does not trace print
        return torch.sigmoid(a) + 1

    fused = fuser.fuse(f)
    x = torch.randn(5, 7, device=device)
    with caplog.at_level(logging.WARNING, logger="fuser"):
        assert_close_to_eager(fused(x), f(x))
    assert "graph break" in caplog.text and "print" in caplog.text
    assert any("graph break" in n and "print" in n for n in fused.report.notes), fused.report


# -- many lengths through fuse() -----------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)

    def forward(self, x):
        g, u = self.up(self.ln(x)).chunk(2, -1)
        y = F.silu(g) * u
        return torch.softmax(y @ y.transpose(1, 2) / 4.0, -1).sum(-1) + y.mean(-1)


LENGTHS = [5, 7, 9, 12, 17, 3, 30, 11, 8, 21, 6, 14, 4]


def test_fuse_at_thirteen_lengths_bounded_graphs_fused_every_call(device):
    torch.manual_seed(0)
    model = _Block().to(device)
    fused = fuser.fuse(model)
    with torch.no_grad():
        for t in LENGTHS:
            x = torch.randn(2, t, 16, device=device)
            assert_close_to_eager(fused(x), model(x))
            assert fused.report.regions and not fused.report.fallbacks, (t, str(fused.report))
    graphs = _forward_graphs(fused)
    assert len(graphs) <= 4, [str(g) for g in graphs]
    assert any(r.symbolic for r in graphs[-1].regions)
