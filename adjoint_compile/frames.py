"""What the backend reads from the frame dynamo is compiling: its module (``self``) and the modules among its locals,
how often a frame holding a Python loop over time has been compiled, and whether it runs under a data-parallel
wrapper that per-example clipping cannot run under."""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch

from .errors import AdjointCompileWarning, PerSampleError
from .passes.decide import rolled_loop
from .regions import Fallback

__all__ = ["frame_modules", "calling_modules", "frame_self", "compiling_code", "rewritten", "count_loop_compiles",
           "loops_over_time", "refuse_data_parallel"]


def frame_modules() -> list[tuple[str, torch.nn.Module]]:
    """The modules among the locals of the frame dynamo is compiling (``self`` of a compiled module's forward, or of
    a graph break's resumed frame): their parameters are guarded even when this graph does not use them."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except (AttributeError, ImportError):  # NB: no frame under way (explain() on a bare graph)
        return []
    return [(k, v) for k, v in (getattr(tx, "f_locals", None) or {}).items() if isinstance(v, torch.nn.Module)]


def calling_modules() -> list[tuple[str, torch.nn.Module]]:
    """The modules whose methods are running eagerly below the frame dynamo is compiling (``self`` of each frame on
    the Python stack): a forward dynamo skipped (a graph break inside its loop over layers) calls a compiled frame
    that holds none of its parameters, which would otherwise never be guarded."""
    out = []
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            own = f.f_locals.get("self")
            if isinstance(own, torch.nn.Module):
                out.append((type(own).__name__, own))
        f = f.f_back
    return out


def frame_self() -> torch.nn.Module | None:
    """The module whose method dynamo is compiling: the frame's first argument (``self``, whatever its name)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        first = tx.f_code.co_varnames[0] if tx.f_code.co_argcount else None
        own = (getattr(tx, "f_locals", None) or {}).get(first)
    except (AttributeError, ImportError, IndexError):  # NB: no frame under way (explain() on a bare graph)
        return None
    return own if isinstance(own, torch.nn.Module) else None


#: the code objects whose compiled graphs held re-rolled loops since dynamo's cache for them was last empty
_LOOP_CODES: weakref.WeakSet = weakref.WeakSet()
#: the code objects whose compiled graphs held rewritten regions since then
_REWRITTEN_CODES: weakref.WeakSet = weakref.WeakSet()
#: those whose graphs with symbolic sizes made a graph for every length since then (at a call, not a compile: apart,
#: so that the recompile limit's warning stays with the graphs that held rewritten regions when compiled)
_GENERIC_CODES: weakref.WeakSet = weakref.WeakSet()
#: what was said once per code object (:func:`first_notice`)
_NOTICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiling_code() -> Any:
    """The code object dynamo is compiling (None outside a dynamo compile)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx().f_code
    except (AttributeError, ImportError, TypeError):  # NB: not under a dynamo compile
        return None


def rewritten(code: Any, now: bool = False) -> bool:
    """Whether a graph of ``code`` held rewritten regions since dynamo's cache for it was last empty; ``now``: say so
    (a graph with symbolic sizes whose graph for every length was made at a call)."""
    if code is None:
        return False
    if now:
        _GENERIC_CODES.add(code)
    return code in _REWRITTEN_CODES or code in _GENERIC_CODES


def first_notice(code: Any, what: str) -> bool:
    """Whether ``what`` is said of ``code`` for the first time since dynamo's cache for it was last empty (a loop over
    time recompiles its code at each new length: each graph would say it again)."""
    if code is None:
        return True
    said = _NOTICES.setdefault(code, set())
    if what in said:
        return False
    said.add(what)
    return True


def loops_over_time(code: Any) -> bool:
    """Whether ``code``'s graphs held a Python loop over time (it recompiles at every new length)."""
    return code is not None and code in _LOOP_CODES


def count_loop_compiles(result: Any) -> None:
    """Warn, and list in report(), when a frame whose graphs held rewritten regions has been compiled as often as
    dynamo's recompile limit allows: past the limit dynamo runs the frame uncompiled (ordinary autograd, no memory
    saved) with only its own log line. A Python loop over time recompiles at each new length (its trip count is a
    guard), and so does any frame compiled with ``dynamic=False``."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.symbolic_convert import InstructionTranslator
        code = InstructionTranslator.current_tx().f_code
        # NB: dynamo's own count: this compile is one more than the code's cache entries (torch._dynamo.reset() empties
        # them); the later graphs of a loop's frame are symbolic (not normalized): the code counts once it had one
        n = len(_debug_get_cache_entry_list(code)) + 1
    except (AttributeError, ImportError, TypeError):  # NB: not under a dynamo compile
        return
    if n == 1:
        _NOTICES.pop(code, None)
        _LOOP_CODES.discard(code)
        _REWRITTEN_CODES.discard(code)
        _GENERIC_CODES.discard(code)
    # NB: a graph with symbolic sizes (dynamic=True, or a second length) is not normalized at compile time: its
    # loop is a region read from the unrolled steps, and its regions are lowered per call signature when it runs
    if result.captured.normalized.get("rerolled") or any(r.source == "unrolled_loop" for r in result.regions) or \
            result.captured.symbolic and any(rolled_loop(r) for r in result.regions):
        _LOOP_CODES.add(code)
    if result.lowered:
        _REWRITTEN_CODES.add(code)
    if code not in _LOOP_CODES and not rewritten(code) or \
            n != getattr(torch._dynamo.config, "recompile_limit", 8):
        return
    if code in _LOOP_CODES:
        cause = (f"the code with a Python loop over time has been compiled {n} times, dynamo's recompile_limit: the "
                 f"loop recompiles at every new length (its trip count is a guard), and from the next new length "
                 f"dynamo runs it uncompiled, with ordinary autograd and no memory saved")
        remedy = ("write the recurrence with adjoint_compile.ops.linear_scan (one graph serves every length), pad "
                  "batches to a few lengths, or raise torch._dynamo.config.recompile_limit")
    else:
        cause = (f"the code with rewritten regions has been compiled {n} times, dynamo's recompile_limit (each failed "
                 f"guard recompiles: a new input size under torch.compile(dynamic=False), a new dtype or mode): from "
                 f"the next recompile dynamo runs it uncompiled, with ordinary autograd and no memory saved")
        remedy = ("leave torch.compile's dynamic at its default (a graph for every length), pad batches to a few "
                  "lengths, or raise torch._dynamo.config.recompile_limit")
    result.fallbacks.append(Fallback(cause, remedy, {"compiles": n}))
    warnings.warn(AdjointCompileWarning(f"adjoint-compile: {cause}; {remedy}"), stacklevel=3)


def refuse_data_parallel(clip: float) -> None:
    """per_sample_clip under DistributedDataParallel or FSDP raises: their hooks reduce (or reshard) the gradients
    autograd accumulates, whereas the clipped sums are written after the backward (all zeros or unclipped, silently)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        wrappers: tuple = (torch.nn.parallel.DistributedDataParallel, FSDPModule, FullyShardedDataParallel)
    except ImportError:  # NB: a torch built without distributed
        return
    frame = sys._getframe(1)
    while frame is not None:
        own = frame.f_locals.get(frame.f_code.co_varnames[0]) if frame.f_code.co_argcount else None
        if isinstance(own, wrappers):
            raise PerSampleError(
                f"adjoint-compile: per_sample_clip={clip} cannot run under {type(own).__name__}: it reduces the "
                f"gradients autograd accumulates, while the clipped sums are written after the backward (they would "
                f"be lost or unclipped); compile the model itself and all-reduce p.grad after each backward")
        frame = frame.f_back
