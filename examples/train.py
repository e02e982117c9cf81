"""Train a small Hugging Face model through `torch.compile(backend="fuser")`: forward and backward
graphs are both fused.  Compares each step's loss with eager's.

    python examples/train.py        # GPU if there is one (bf16), else CPU through Triton's interpreter
"""
import copy

import torch
import transformers

import fuser  # noqa: F401  (registers the backend; kernels for CPU tensors run through Triton's interpreter)


def main(steps: int = 10, batch: int = 4, seq: int = 64):
    """Returns each step's losses ({"fuser": [...], "eager": [...]}) and the fused graphs' reports."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).to(device)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fuser")
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, twin)]
    ids = torch.randint(0, 256, (batch, seq), device=device)
    history = {"fuser": [], "eager": []}
    for step in range(steps):
        losses = []
        for m, opt in ((compiled, opts[0]), (twin, opts[1])):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        history["fuser"].append(losses[0])
        history["eager"].append(losses[1])
        print(f"step {step:2d}  fuser {losses[0]:.4f}  eager {losses[1]:.4f}")
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1]), losses
    reports = fuser.reports()
    backward = [r for r in reports if any("backward" in n for n in r.notes)]
    print(f"\n{len(reports)} graphs fused ({len(backward)} backward); the last forward:\n")
    print(next(r for r in reversed(reports) if r not in backward))
    return history, reports


if __name__ == "__main__":
    main()
