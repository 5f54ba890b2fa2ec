"""A small post-LN transformer (the original layout): x <- LN(x + Attn(x)), x <- LN(x + MLP(x)). Each sub-layer is
LN(x + Block(x)) = x ⊙ a(x) + b(x) (Highway-BP Table 1, "post-LN"): K_i is diagonal.

    python examples/post_ln_transformer.py       # prints adjoint_compile.explain(...)

The model is ``adjoint_compile.models.transformer.Transformer`` with ``pre_ln=False`` (no final LN).
"""
from __future__ import annotations

import functools

from adjoint_compile.models import print_explain
from adjoint_compile.models.transformer import Block, Transformer, example_inputs

__all__ = ["Block", "Transformer", "make", "example_inputs"]

#: make(d_model=32, n_heads=4, n_layers=3): x [B, T, d_model] -> [B, T, d_model]
make = functools.partial(Transformer, pre_ln=False)

if __name__ == "__main__":
    print_explain(make, example_inputs)
