"""A small pre-LN transformer: each block is x + Attn(LN(x)) then x + MLP(LN(x)), a residual chain of 2 layers per
block (Highway-BP Table 1, "pre-LN"), with a final LN after the last block.

Its code (``Block``, ``Transformer``) is in ``adjoint_compile/models/transformer.py``, shared with
examples/post_ln_transformer.py; ``make()`` builds 3 pre-LN blocks of d_model = 32 and 4 heads.

    python examples/pre_ln_transformer.py        # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

from adjoint_compile.models import print_explain
from adjoint_compile.models.transformer import Block, Transformer, example_inputs

__all__ = ["Block", "Transformer", "make", "example_inputs"]

make = Transformer  # pre_ln=True by default

if __name__ == "__main__":
    print_explain(make, example_inputs)
