"""A small causal transformer in its two layouts, for the residual-chain examples (examples/pre_ln_transformer.py,
examples/post_ln_transformer.py). Each block is two residual sub-layers, causal self-attention then an MLP:

    pre-LN  (pre_ln=True):   x <- x + Attn(LN(x)),   x <- x + MLP(LN(x)),   and a final LN after the last block
    post-LN (pre_ln=False):  x <- LN(x + Attn(x)),   x <- LN(x + MLP(x))    (the original layout)

Both are residual chains of 2 layers per block (Highway-BP Table 1): pre-LN's K_i is the identity, post-LN's
LN(x + Block(x)) = x ⊙ a(x) + b(x) has a diagonal K_i.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "Transformer", "example_inputs"]


class Block(nn.Module):
    """Causal self-attention and an MLP, each a residual sub-layer with its LayerNorm (``ln1``, ``ln2``) before
    (pre-LN) or after (post-LN) the residual sum."""

    def __init__(self, d_model: int, n_heads: int, pre_ln: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.n_heads = n_heads
        self.pre_ln = pre_ln

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Transformer(nn.Module):
    """``n_layers`` blocks (``blocks``), and with pre-LN a final LayerNorm ``ln_f``: x [B, T, d_model] -> [B, T,
    d_model]."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_layers: int = 3, pre_ln: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, n_heads, pre_ln) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model) if pre_ln else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """The examples' input: x [2, 16, 32] (B = 2, T = 16, d_model = 32)."""
    return (torch.randn(2, 16, 32),)
