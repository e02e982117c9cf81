"""Fuse a transformer block, print what was fused and why it pays, and check it against eager.

    python examples/quickstart.py            # GPU if there is one, else CPU (Triton's interpreter)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser


class Block(nn.Module):
    """A pre-norm GPT block: LayerNorm, causal attention (SDPA), residual, LayerNorm, GELU MLP, residual."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Block().to(device, dtype).eval()
    x = torch.randn(2, 77, 256, device=device, dtype=dtype)

    fused = fuser.fuse(model)
    with torch.no_grad():
        out, ref = fused(x), model(x)
    print(fused.report)
    print("\nThe rewritten program:\n" + fused.code)
    print(f"A kernel ({fused.report.regions[0].kernel}):\n{fused.report.regions[0].source}")
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    print(f"outputs match eager on {device} ({dtype})")


if __name__ == "__main__":
    main()
