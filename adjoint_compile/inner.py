"""The inner compiler: what compiles the parts of a graph that are not rewritten, and the shard programs.

``compile_inner(gm, example_inputs, inner)`` returns a callable equivalent to ``gm.forward``:

    "eager"      gm.forward itself (FX code, no compilation)
    "aot_eager"  dynamo's aot_eager backend (aot_autograd tracing, eager kernels)
    "inductor"   torch._inductor.compile_fx, and aot_eager where inductor cannot compile the graph

A graph inductor fails on (an op or dtype its lowering does not handle: complex views have been such a case) is not
an error: it runs with aot_eager instead (the same aot_autograd tracing, eager kernels), and one
:class:`~adjoint_compile.errors.AdjointCompileWarning` per distinct cause names it. Inductor compiles the backward
here too (not lazily at the first ``backward()``), so that a backward it cannot compile falls back the same way
instead of raising in the middle of a training step.

A leaf module (it imports torch and the package's errors only), so every stage of the pipeline and every runtime can
use it without importing a later stage.  ``inner`` has been validated by :mod:`adjoint_compile.options` before it
gets here.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.exc import RestartAnalysis

from . import timing
from .errors import AdjointCompileWarning

log = logging.getLogger(__name__)

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

#: the causes of inductor failures already warned about (one warning per distinct cause, per process)
_warned: set[str] = set()

#: what a compile is, by the module that asks for it (adjoint_compile.timing: ``inner.{what}_s`` / ``_n``)
_CALLERS = {"adjoint_compile.passes.stitch": "partitions", "adjoint_compile.runtime.shard_program": "shard_programs",
            "adjoint_compile.runtime.shard_vjp": "shard_vjps"}


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str,
                  what: str | None = None, serial: bool = False) -> Callable[..., Any]:
    """Compile ``gm`` with the inner compiler named by the ``inner`` option (under :data:`COMPILE_LOCK`); with
    "inductor", aot_eager where inductor fails (module docstring). The seconds it takes count to the graph being
    compiled or run (adjoint_compile.timing), by what asked for it (``what``, else the calling module: a partition, a
    shard program, ...). ``serial``: inductor's CPU kernels without OpenMP (one thread), for programs of kernels too
    small to split between threads."""
    if inner == "eager":
        return gm.forward
    what = what or _CALLERS.get(sys._getframe(1).f_globals.get("__name__", ""), "whole_graph")
    t0 = time.perf_counter()
    try:
        if serial and inner == "inductor":
            import torch._inductor.config as inductor_config
            with inductor_config.patch({"cpp.threads": 1}):
                return _compile(gm, example_inputs, inner)
        return _compile(gm, example_inputs, inner)
    finally:
        timing.add_run_time(what, time.perf_counter() - t0)


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str) -> Callable[..., Any]:
    with COMPILE_LOCK:
        if inner == "aot_eager":
            return lookup_backend("aot_eager")(gm, list(example_inputs))
        if inner == "inductor":
            return inductor_or_aot_eager(gm, example_inputs)
    raise AssertionError(f"inner={inner!r} should have been rejected by options.validate")


def inductor_or_aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    # NB: imported on first use: loading inductor costs seconds, and eager/aot_eager users never need it
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    try:
        # NB: the backward compiled now: a lazy one would fail at the first backward(), past any fallback
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return compile_fx(gm, list(example_inputs))
    except Exception as e:  # noqa: BLE001 - whatever inductor cannot compile runs with aot_eager
        if isinstance(e, RestartAnalysis) and _under_dynamo():
            # NB: inductor asks dynamo to trace the frame again (a Python float made a tensor): under way, dynamo
            # does, and calls the backend with the new graph; caught, the graph would lose inductor
            raise
        cause = _cause(e)
        log.debug("adjoint-compile: inductor failed on a graph of %d nodes (%s); using aot_eager",
                  len(gm.graph.nodes), cause, exc_info=True)
        if cause not in _warned:
            _warned.add(cause)
            warnings.warn(f"adjoint-compile: inductor could not compile a graph ({cause}); it runs with aot_eager "
                          f"instead (same results, eager kernels). Pass options={{'inner': 'aot_eager'}} to use it "
                          f"everywhere, or TORCH_LOGS='+adjoint_compile' for inductor's traceback",
                          AdjointCompileWarning, stacklevel=4)
    return lookup_backend("aot_eager")(gm, list(example_inputs))


def _under_dynamo() -> bool:
    """Whether dynamo is tracing a frame in this thread (the backend called from it)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx() is not None
    except (AttributeError, ImportError):
        return False


def _cause(e: BaseException) -> str:
    """An inductor failure in one line: the innermost exception's type and the first line of its message (inductor
    wraps lowering errors in ``LoweringException`` / ``BackendCompilerFailed``, whose own text is the node dump)."""
    inner = e
    while inner.__cause__ is not None and inner.__cause__ is not inner:
        inner = inner.__cause__
    text = str(inner).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(inner).__name__}: {first[:200]}" if first else type(inner).__name__
