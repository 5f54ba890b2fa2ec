"""The inner compiler: what compiles everything the backend does not rewrite (the ``inner`` option).

A leaf module (it imports torch only), so that every stage and the runtime can compile with it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

__all__ = ["compile_inner"]


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> Callable[..., Any]:
    """Compile ``gm`` with the inner compiler named by the ``inner`` option ("eager", "aot_eager", "inductor")."""
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, list(example_inputs))
    if inner == "inductor":
        # NB: imported on first use: inductor's import costs seconds, and eager/aot_eager users never need it
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    raise AssertionError(f"inner={inner!r} should have been rejected by options.validate")
