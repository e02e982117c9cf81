"""A linear layer feeding only a cross-entropy, found in a model's graph and claimed before autograd as
one chunked op (fuser/linear_ce.py): the loss and every gradient match eager, the logits are never
held whole, and where the logits are needed elsewhere (returned) the op returns them.
The op itself (chunks, ignore_index, smoothing, dtypes) is tested in test_linear_ce.py."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from tolerances import tol

CLAIMED = "linear + cross-entropy claimed before autograd"


class TinyLM(nn.Module):
    """Embedding -> a hidden layer -> LM head -> the loss, as a training step writes it: the logits
    upcast, flattened, labels with ignored positions.  `returns_logits`: the model returns them too."""

    def __init__(self, vocab=211, d=24, bias=False, reduction="mean", returns_logits=False):
        super().__init__()
        self.emb, self.hidden = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=bias)
        self.reduction, self.returns_logits = reduction, returns_logits

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.emb(ids))))
        flat = logits.float().view(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, labels.view(-1), ignore_index=-100,
                               reduction="sum" if self.reduction != "mean" else "mean")
        if self.reduction == "sum/n":  # Hugging Face's num_items_in_batch: a sum divided by the tokens counted
            loss = loss / (labels != -100).sum()
        return (loss, logits) if self.returns_logits else loss


def _batch(vocab, device, b=3, t=19):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (b, t), device=device)
    labels = torch.randint(0, vocab, (b, t), device=device)
    labels[0, :5] = -100  # ignored positions (padding, the prompt)
    return ids, labels


def _notes(fused) -> list:
    return [n for r in fused.reports for n in r.notes]


def _check_grads(model, twin, dtype):
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(dtype, 4), msg=name)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "sum/n"])
def test_loss_and_gradients_match_eager(bias, reduction, device):
    model = TinyLM(bias=bias, reduction=reduction).to(device)
    twin = copy.deepcopy(model)
    ids, labels = _batch(211, device)
    fused = fuser.fuse(model)
    loss = fused(ids, labels)
    want = twin(ids, labels)
    torch.testing.assert_close(loss, want, **tol(torch.float32, 4))
    (loss * 1.7).backward()  # an upstream gradient other than 1
    (want * 1.7).backward()
    _check_grads(model, twin, torch.float32)
    assert any(n.startswith(CLAIMED) for n in _notes(fused)), _notes(fused)
    forward = [r for r in fused.reports if not any("backward" in n for n in r.notes)]
    assert any("linear_cross_entropy" in line for r in forward for line in r.code), "the op is not in the program"


def test_bf16_matches_an_fp32_reference(device):
    """16-bit weights: the op computes the loss in fp32 from logits rounded to bf16 as eager's are."""
    model = TinyLM().to(device, torch.bfloat16)
    ref = copy.deepcopy(model).float()
    ids, labels = _batch(211, device)
    fused = fuser.fuse(model)
    loss = fused(ids, labels)
    want = ref(ids, labels)
    torch.testing.assert_close(loss, want, **tol(torch.bfloat16))
    loss.backward()
    want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.bfloat16, name
        torch.testing.assert_close(p.grad.float(), q.grad, **tol(torch.bfloat16, 2), msg=name)
    assert any(n.startswith(CLAIMED) for n in _notes(fused))


def test_a_new_sequence_length_reuses_the_claim(device):
    """A second length makes the sizes symbolic: the op takes them (its fake implementation)."""
    model = TinyLM().to(device)
    twin = copy.deepcopy(model)
    fused = fuser.fuse(model)
    for t in (19, 26):
        ids, labels = _batch(211, device, t=t)
        torch.testing.assert_close(fused(ids, labels), twin(ids, labels), **tol(torch.float32, 4))
    assert sum(n.startswith(CLAIMED) for n in _notes(fused)) >= 1


@pytest.mark.parametrize("use_logits", [False, True], ids=["logits-unused", "logits-in-the-loss-too"])
@pytest.mark.parametrize("bias", [False, True])
def test_logits_returned_too_are_claimed_by_the_op_that_returns_them(use_logits, bias, device):
    """A model that returns its logits beside the loss (as a causal LM compiled whole does): the op returns
    them; gradients match eager's, the logits' own gradient included where the caller uses them."""
    model = TinyLM(returns_logits=True, bias=bias).to(device)
    twin = copy.deepcopy(model)
    ids, labels = _batch(211, device)
    fused = fuser.fuse(model)
    (loss, logits), (want, want_logits) = fused(ids, labels), twin(ids, labels)
    torch.testing.assert_close(loss, want, **tol(torch.float32, 4))
    torch.testing.assert_close(logits, want_logits, **tol(torch.float32))
    r = torch.randn(logits.shape, device=device, generator=torch.Generator(device).manual_seed(3))
    extra = (lambda z: (z * r).sum() / z.shape[1]) if use_logits else (lambda z: 0)
    (loss * 1.7 + extra(logits)).backward()
    (want * 1.7 + extra(want_logits)).backward()
    _check_grads(model, twin, torch.float32)
    notes = _notes(fused)
    assert any(n.startswith(CLAIMED) and "the logits returned" in n for n in notes), notes


def test_the_option_turns_it_off(device):
    model = TinyLM().to(device)
    fused = fuser.fuse(model, fused_loss=False)
    fused(*_batch(211, device)).backward()
    assert not any("cross-entropy" in n for n in _notes(fused)), _notes(fused)


def test_inference_is_left_alone(device):
    """No gradient wanted: nothing is claimed (the loss is fused as the graph's own regions)."""
    model = TinyLM().to(device)
    fused = fuser.fuse(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(*_batch(211, device)), model(*_batch(211, device)), **tol(torch.float32, 4))
    assert not any(n.startswith(CLAIMED) for n in _notes(fused))


def _tiny_llama(device):
    """A one-layer LLaMA (vocabulary 301: an odd class count), its eager twin, and a batch of ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).to(device)
    return model, copy.deepcopy(model), torch.randint(0, 301, (2, 23), device=device)


def test_a_hugging_face_training_step_that_returns_the_loss(device):
    """A step compiled around the model (its logits dead): LLaMA's head and its ForCausalLMLoss become
    the op; every parameter's gradient matches eager."""
    model, twin, ids = _tiny_llama(device)
    fused = fuser.fuse(lambda ids: model(input_ids=ids, labels=ids).loss)
    loss = fused(ids)
    want = twin(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, **tol(torch.float32, 4))
    loss.backward()
    want.backward()
    _check_grads(model, twin, torch.float32)
    assert any(n.startswith(CLAIMED) for n in _notes(fused)), _notes(fused)


def test_a_hugging_face_model_compiled_whole(device):
    """`torch.compile(model, backend="fuser")` on a causal LM called with labels: its output holds the loss
    and the logits; the head and its loss become the op that returns the logits; gradients match eager."""
    model, twin, ids = _tiny_llama(device)
    before = len(fuser.reports())
    compiled = torch.compile(model, backend="fuser")
    out, want = compiled(input_ids=ids, labels=ids), twin(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, want.loss, **tol(torch.float32, 4))
    torch.testing.assert_close(out.logits, want.logits, **tol(torch.float32, 4))
    out.loss.backward()
    want.loss.backward()
    _check_grads(model, twin, torch.float32)
    notes = [n for r in fuser.reports()[before:] for n in r.notes]
    assert any(n.startswith(CLAIMED) and "the logits returned" in n for n in notes), notes


def test_targets_computed_from_the_logits_are_left_to_their_ops(device):
    """Pseudo-labels from the logits themselves (argmax): the op would read what it makes, so the pair is
    left to its ops with the reason, and the graph's other claims stand; gradients match eager."""
    class SelfLabelled(TinyLM):
        def forward(self, ids, labels):
            logits = self.head(torch.tanh(self.hidden(self.emb(ids))))
            target = logits.detach().argmax(-1).view(-1)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target), logits

    model = SelfLabelled().to(device)
    twin = copy.deepcopy(model)
    ids, labels = _batch(211, device)
    fused = fuser.fuse(model)
    (loss, _), (want, _) = fused(ids, labels), twin(ids, labels)
    torch.testing.assert_close(loss, want, **tol(torch.float32, 4))
    loss.backward()
    want.backward()
    _check_grads(model, twin, torch.float32)
    assert any("left to its ops: the targets are computed from the logits" in n for n in _notes(fused)), _notes(fused)


class Head(nn.Module):
    """An LM head over embeddings, returning (loss, logits)."""

    def __init__(self, vocab=211, d=24):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1)), logits


def _temperature_in_place(device):
    ids, labels = _batch(211, device)
    loss, logits = fuser.fuse(Head().to(device))(ids, labels)
    logits.div_(2.0)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()


def test_returned_logits_changed_in_place_before_the_backward_raise(device):
    """The op keeps the logits it returns for its backward; a caller that divides them in place first
    (a temperature) gets an error, not a wrong gradient (AOT Autograd hands the logits out as a view that
    does not share the saved tensor's version counter, so autograd's own check is blind).  On CPU a
    RuntimeError naming the cause; on CUDA an asynchronous device-side assert (no host sync in the
    step), which leaves the process's CUDA context unusable: there it runs in a child process."""
    if device == "cuda":
        code = "import test_fused_loss as t; t._temperature_in_place('cuda')"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-2000:]
        return
    with pytest.raises(RuntimeError, match="modified in place before the backward"):
        _temperature_in_place(device)
