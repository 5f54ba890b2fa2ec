"""Where ``adjoint_compile.report`` finds what the backend recorded for a ``torch.compile`` result: the frames dynamo
compiles first for it (:func:`root_frames`), and the backend's records in dynamo's cache entries for them, their
resume functions and the other frames the same ``torch.compile`` call compiled (:func:`compiled_graphs`)."""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.eval_frame import OptimizedModule, _debug_get_cache_entry_list

from .analysis.breaks import notes_of, options_given
from .backend import CompiledGraph, CompiledGraphFn
from .options import Options, validate

__all__ = ["root_frames", "compiled_graphs", "declared_options"]


def _wrapped_functions(fn: Any) -> list[Any]:
    """``fn`` and the functions its ``__wrapped__`` chain leads to (stopping at anything that is not a function); a
    bound method (``torch.compile(model.loss)``) is its function."""
    out = []
    fn = getattr(fn, "__func__", fn)
    while inspect.isfunction(fn) and fn not in out:
        out.append(fn)
        fn = getattr(getattr(fn, "__wrapped__", None), "__func__", getattr(fn, "__wrapped__", None))
    return out


def _is_distributed(model: torch.nn.Module) -> bool:
    """Whether ``model`` is wrapped in DistributedDataParallel or holds a module sharded by FSDP2's fully_shard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # NB: torch built without distributed
        return False
    return isinstance(model, torch.nn.parallel.DistributedDataParallel) or any(
        isinstance(m, FSDPModule) for m in model.modules())


def root_frames(compiled_model: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The (code, globals) of the frames dynamo compiles first for ``compiled_model``; TypeError for anything that
    ``torch.compile`` did not make."""
    if isinstance(compiled_model, torch.nn.Module) and getattr(compiled_model, "_compiled_call_impl", None):
        # NB: model.compile(backend="adjoint") compiles in place: dynamo compiles Module._call_impl's frame
        roots = [*_wrapped_functions(getattr(compiled_model.forward, "__func__", compiled_model.forward)),
                 torch.nn.Module._call_impl, *_wrapped_functions(compiled_model._compiled_call_impl)]
    elif isinstance(compiled_model, OptimizedModule):
        # NB: dynamo compiles the module's forward, or for torch.nn's own modules (Sequential, ...) a wrapper
        # function around the module, which the compiled forward's __wrapped__ chain reaches
        # NB: every layer of a decorated forward (a library's decorator, e.g. transformers' output handling): dynamo
        # compiles the outermost frame it enters, whose module globals hold the compiled graph
        orig = compiled_model._orig_mod.forward
        roots = [*_wrapped_functions(getattr(orig, "__func__", orig)), *_wrapped_functions(compiled_model.forward)]
        if _is_distributed(compiled_model._orig_mod):
            # NB: dynamo skips DistributedDataParallel's forward and FSDP2's hooks, and compiles the frames of the
            # modules they call (the wrapped model; with fully_shard, each sharded submodule's own forward)
            roots += [f for m in compiled_model._orig_mod.modules()
                      for f in _wrapped_functions(getattr(m.forward, "__func__", m.forward))]
    elif callable(getattr(compiled_model, "_torchdynamo_orig_callable", None)):
        # NB: the whole __wrapped__ chain: a function whose own loops roll is compiled in a frame around it
        roots = _wrapped_functions(compiled_model._torchdynamo_orig_callable)
    else:
        raise TypeError(f"adjoint_compile.report expects the result of torch.compile(..., backend='adjoint'), got "
                        f"{type(compiled_model).__name__}")
    return [(getattr(f, "__code__", None), getattr(f, "__globals__", {})) for f in (getattr(r, "__func__", r)
                                                                                   for r in roots)]


def compiled_graphs(compiled_model: Any) -> list[CompiledGraph]:
    """The records of backend="adjoint" that dynamo holds for ``compiled_model``'s frames.

    NB: dynamo installs each compiled graph as a global ``__compiled_fn_*`` of the frame's module (wrapped, with
    ``__wrapped__`` set) and each graph break's continuation as a global ``__resume_at_*`` function; its cache entries
    for a code object list the names its transformed bytecode uses.
    """
    found = _cached_records(root_frames(compiled_model))
    if isinstance(compiled_model, OptimizedModule):
        # NB: every instance of a class compiles the same forward code: only this instance's frames' graphs, and
        # those another instance compiled that this one's calls ran (dynamo serves both from one cache entry)
        mine = {id(m) for m in compiled_model._orig_mod.modules()}
        params = list(compiled_model._orig_mod.parameters())
        found = {k: c for k, c in found.items() if c.frame_module is None or c.frame_module() is None
                 or id(c.frame_module()) in mine or any(c.callers.get(id(p)) is p for p in params)}
    notes = notes_of(compiled_model)
    if notes is not None:
        # NB: another torch.compile of the same code (to compare modes) has its own cache entries on that code: not
        # its graphs, which this compile's notes do not hold, where their options differ from this one's
        given = declared_options(compiled_model)
        found = {k: c for k, c in found.items() if notes.graphs.get(c.seq) is c or given is None
                 or c.options is None or c.options == given}
        found.update({k: c for k, c in _cached_records(notes.live_frames()).items() if notes.graphs.get(c.seq) is c})
    return list(found.values())


def declared_options(compiled_model: Any) -> Options | None:
    """The options of the ``torch.compile(..., backend="adjoint")`` call that made ``compiled_model`` (known before
    its first graph, which records its own); None when none is found or they are bad (they raise at the first
    call, with the message that names them)."""
    try:
        given = options_given(compiled_model)
        return None if given is None else validate(given)
    except (ValueError, TypeError):
        return None


def _cached_records(frames: list[tuple[Any, dict[str, Any]]]) -> dict[int, CompiledGraph]:
    """The backend's records in dynamo's cache entries for these (code, globals) frames and the resume functions
    their compiled code calls, by id."""
    found: dict[int, CompiledGraph] = {}
    todo = list(frames)
    seen: set[int] = set()
    while todo:
        code, globs = todo.pop()
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        for entry in _debug_get_cache_entry_list(code):
            # NB: an entry dynamo invalidated (its frame's objects collected) has no code
            for name in getattr(entry.code, "co_names", ()):
                v = globs.get(name)
                if name.startswith("__resume_at"):
                    todo.append((getattr(v, "__code__", None), getattr(v, "__globals__", {})))
                elif name.startswith("__compiled_fn"):
                    found.update((id(r.result), r.result) for r in _records_in(v))
    return found


def _records_in(compiled_fn: Any) -> list[CompiledGraphFn]:
    """The backend's records behind one ``__compiled_fn_*``: itself (under its ``__wrapped__`` chain), or, when
    DDPOptimizer split the graph at DDP's bucket boundaries, one per piece (the split GraphModule's submodules each
    hold the backend's result of one piece as ``submod``)."""
    v = compiled_fn
    while v is not None and not isinstance(v, CompiledGraphFn):
        if isinstance(v, OptimizedModule):
            v = v._orig_mod
        if isinstance(v, fx.GraphModule):
            return [r for m in v.modules() if hasattr(m, "submod") for r in _records_in(m.submod)]
        v = getattr(v, "__wrapped__", None)
    return [] if v is None else [v]
