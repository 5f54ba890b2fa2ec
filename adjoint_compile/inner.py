"""The inner compiler: what compiles the parts of a graph that are not rewritten, and the shard programs.

``compile_inner(gm, example_inputs, inner)`` returns a callable equivalent to ``gm.forward``:

    "eager"      gm.forward itself (FX code, no compilation)
    "aot_eager"  dynamo's aot_eager backend (aot_autograd tracing, eager kernels)
    "inductor"   torch._inductor.compile_fx

A leaf module (it imports torch only), so every stage of the pipeline and every runtime can use it without
importing a later stage.  ``inner`` has been validated by :mod:`adjoint_compile.options` before it gets here.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._dynamo.backends.registry import lookup_backend

#: held by every compile and trace the package does at run time (inner compiles of partitions and shard programs,
#: shard-program checks and VJP traces, per-size specializations). NB: dynamo's own lock, which dynamo holds while it
#: compiles a frame and calls the backend: FX's tracer, fake tensor propagation and functorch keep global state, so
#: two threads compiling at once (two first calls of one model) must take turns, with dynamo's compiles too.
#: Re-entrant: a compile may start another.
try:
    from torch._dynamo.convert_frame import compile_lock as COMPILE_LOCK
except ImportError:  # pragma: no cover - older or newer torch without it
    COMPILE_LOCK = threading.RLock()

__all__ = ["compile_inner", "COMPILE_LOCK"]


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> Callable[..., Any]:
    """Compile ``gm`` with the inner compiler named by the ``inner`` option (under :data:`COMPILE_LOCK`)."""
    if inner == "eager":
        return gm.forward
    with COMPILE_LOCK:
        if inner == "aot_eager":
            return lookup_backend("aot_eager")(gm, list(example_inputs))
        if inner == "inductor":
            # NB: imported on first use: loading inductor costs seconds, and eager/aot_eager users never need it
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, list(example_inputs))
    raise AssertionError(f"inner={inner!r} should have been rejected by options.validate")
