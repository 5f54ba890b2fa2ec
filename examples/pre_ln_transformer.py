"""A small pre-LN transformer: each block is x + Attn(LN(x)) then x + MLP(LN(x)), a residual chain of 2 layers per
block (Highway-BP Table 1, "pre-LN").

    python examples/pre_ln_transformer.py        # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.n_heads = n_heads

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PreLNTransformer(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)


def make(d_model: int = 32, n_heads: int = 4, n_layers: int = 3) -> PreLNTransformer:
    return PreLNTransformer(d_model, n_heads, n_layers)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 16, 32),)


if __name__ == "__main__":
    import adjoint_compile

    torch.manual_seed(0)
    print(adjoint_compile.explain(make(), *example_inputs()))
