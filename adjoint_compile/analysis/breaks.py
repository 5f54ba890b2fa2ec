"""Where dynamo split a model into graphs (graph breaks), and what the backend saw under one ``torch.compile`` call.

* :func:`break_of`: the graph break that ended a dynamo graph (dynamo's ``compile_subgraph_reason``), as a
  :class:`Break` with a readable reason and the user's source line;
* :class:`CompileNotes`: one per ``torch.compile`` call, kept on torch's wrappers of the backend (every frame that
  call compiles shares them: resume functions after a break, a nested function's own frame after a break inside
  it, the frames a skipped frame calls). It holds the frames compiled and their graphs (weakly), so that
  ``adjoint_compile.report`` finds graphs that live on code objects other than the compiled model's;
* :func:`collapse`: the backend's warning for one graph, or None when the graph is one more small graph with
  nothing recognized that graph breaks split off: those are one WARNING per ``torch.compile`` call, naming the break.

NB: there is no hook at the end of a compiled call, so the one warning comes with the first such graph; the count
of all of them is in ``adjoint_compile.report(compiled)``.
"""
from __future__ import annotations

import dataclasses
import inspect
import linecache
import logging
import re
import weakref
from typing import Any

log = logging.getLogger(__name__)

#: graphs with at most this many nodes and nothing recognized, next to a graph break, are pieces of a model that
#: breaks cut up (a loop's step or two): their warnings are one per torch.compile call
SMALL_GRAPH_NODES = 64

#: the attribute of torch's backend wrappers that holds a compile's :class:`CompileNotes`
NOTES = "_adjoint_compile_notes"

#: dynamo's reasons (GraphCompileReason.reason) that name its own bytecode handler, in words
_READABLE = (("generic_jump", "data-dependent branching: an `if` (or `while`, `and`/`or`) on a tensor's value"),
             ("step_unsupported", "an instruction dynamo cannot trace"))

_RESUME = re.compile(r"torch_dynamo_resume_in_(?P<fn>.+)_at_(?P<line>\d+)$")


@dataclasses.dataclass(frozen=True)
class Break:
    """One graph break: why (in words) and where in the user's code."""

    reason: str
    #: "file:line in function"
    location: str = ""
    #: the source line there, stripped ("" when unknown)
    code: str = ""

    @property
    def data_dependent(self) -> bool:
        return self.reason.startswith("data-dependent")

    def remedy(self) -> str:
        how = ("compute both branches and choose with torch.where, or use torch.cond; " if self.data_dependent
               else "")
        return f"{how}TORCH_LOGS=graph_breaks shows every break and why"

    def where(self) -> str:
        """``location (`code`)``."""
        return self.location + (f" (`{self.code}`)" if self.code else "")


def describe(reason: Any) -> str:
    """dynamo's reason for a break, first line, with its bytecode handlers' names in words."""
    text = str(reason or "").strip()
    first = text.splitlines()[0] if text else "graph break"
    for prefix, words in _READABLE:
        if first.startswith(prefix):
            return words
    return first


def at_frame(reason: Any, frame: Any) -> Break:
    """A :class:`Break` at a ``traceback.FrameSummary`` (or None: location unknown)."""
    if frame is None:
        return Break(describe(reason))
    code = (getattr(frame, "line", None) or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return Break(describe(reason), f"{frame.filename}:{frame.lineno} in {frame.name}", code)


def break_of(gm: Any) -> Break | None:
    """The graph break that ended this dynamo graph, or None (it ended at a return, or DDPOptimizer split it: the
    report counts those apart)."""
    why = getattr(gm, "compile_subgraph_reason", None)
    if why is None or not getattr(why, "graph_break", False) or "DDPOptimizer" in str(why.reason):
        return None
    stack = list(getattr(why, "user_stack", None) or [])
    return at_frame(why.reason, stack[-1] if stack else None)


def resumed_at(code: Any) -> Break | None:
    """For the code of a resume function (``torch_dynamo_resume_in_<fn>_at_<line>``, what follows a break): the
    break it resumes after, by location; else None."""
    m = _RESUME.match(getattr(code, "co_name", ""))
    if m is None:
        return None
    fn, line = m.group("fn"), int(m.group("line"))
    while (inner := _RESUME.match(fn)) is not None:  # NB: a resume function of a resume function
        fn = inner.group("fn")
    return Break("graph break", f"{code.co_filename}:{line} in {fn}",
                 linecache.getline(code.co_filename, line).strip())


class CompileNotes:
    """What the backend saw under one ``torch.compile`` call (see the module's doc)."""

    def __init__(self) -> None:
        #: the backend's records, by ``seq``; weak: dynamo's cache entries own them
        self.graphs: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        #: the frames compiled: id(code) -> (weak code, the frame's globals, where dynamo installs the graphs)
        self.frames: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}
        #: the breaks met, in order
        self.breaks: list[Break] = []
        #: the node counts of the small graphs with nothing recognized next to breaks (the first one was warned)
        self.split: list[int] = []

    def __deepcopy__(self, memo: dict) -> "CompileNotes":
        # NB: a deep copy of a compiled model (an EMA or teacher copy) is a new compile with nothing noted yet; the
        # frames' globals hold modules, which cannot be copied
        return CompileNotes()

    def note(self, result: Any, code: Any, globs: dict[str, Any]) -> None:
        self.graphs[result.seq] = result
        if code is not None and id(code) not in self.frames:
            try:
                self.frames[id(code)] = (weakref.ref(code), globs)
            except TypeError:  # NB: not weakly referenceable: report() then finds it from the model's frames only
                pass

    def live_frames(self) -> list[tuple[Any, dict[str, Any]]]:
        out = []
        for ref, globs in list(self.frames.values()):
            code = ref()
            if code is not None:
                out.append((code, globs))
        return out

    def break_at(self, location: str) -> Break | None:
        return next((b for b in reversed(self.breaks) if b.location == location), None)


def _current_tx() -> Any:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not under a dynamo compile (a specialization at call time, a bare graph)
        return None


def _holders(compiler_fn: Any) -> list[Any]:
    """torch's wrappers of the backend in dynamo's compiler chain (not our backend, not plain functions)."""
    from ..polyfills import _compiler_chain

    return [f for f in _compiler_chain(compiler_fn)
            if not getattr(f, "_adjoint_compile_backend", False) and not inspect.isfunction(f)
            and not inspect.ismethod(f)]


def notes_here(tx: Any) -> CompileNotes | None:
    """The notes of the ``torch.compile`` call dynamo is compiling for (made on its first graph), or None."""
    holders = _holders(getattr(getattr(tx, "output", None), "compiler_fn", None))
    notes = next((n for f in holders if isinstance(n := getattr(f, NOTES, None), CompileNotes)), None)
    if notes is None:
        notes = CompileNotes()
    for f in holders:
        try:
            setattr(f, NOTES, notes)
        except (AttributeError, TypeError):
            continue
    return notes if any(getattr(f, NOTES, None) is notes for f in holders) else None


#: attributes that lead from a ``torch.compile`` result to torch's wrappers of the backend
_LINKS = ("dynamo_ctx", "_compiled_call_impl", "callback", "_torchdynamo_orig_backend", "__wrapped__", "compiler_fn")


def _linked(compiled: Any):
    """The objects reachable from a ``torch.compile`` result through torch's wrappers of the backend."""
    todo, seen = [compiled], set()
    while todo and len(seen) < 64:
        o = todo.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        for k in _LINKS:
            try:
                todo.append(getattr(o, k, None))
            except Exception:  # noqa: BLE001 - an object whose __getattr__ raises something else
                continue
        # NB: torch.compile(fn) returns eval_frame's closure over its context (and the callback)
        code = getattr(o, "__code__", None)
        if code is not None and "_dynamo" in code.co_filename:
            for cell in getattr(o, "__closure__", None) or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # NB: an empty cell
                    continue


def notes_of(compiled: Any) -> CompileNotes | None:
    """The notes of the ``torch.compile`` call that made ``compiled`` (an OptimizedModule, a compiled function, or a
    module compiled in place), or None before its first compile."""
    for o in _linked(compiled):
        try:
            n = getattr(o, NOTES, None)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(n, CompileNotes):
            return n
    return None


def options_given(compiled: Any) -> dict | None:
    """The ``options`` dict passed to the ``torch.compile(..., backend="adjoint")`` call that made ``compiled``
    (known before its first call), or None when none is found."""
    for o in _linked(compiled):
        kw = getattr(o, "kwargs", None)
        if getattr(o, "compiler_name", None) == "adjoint" and isinstance(kw, dict):
            return kw.get("options") or {}
    return None


def _unrecognized(result: Any) -> bool:
    return not result.regions and not (result.per_sample is not None and result.per_sample.uses)


def collapse(result: Any, message: str | None, opts: Any) -> str | None:
    """The warning to give for one compiled graph (``message``, the backend's), after noting the graph for
    ``report()``: None for a small graph with nothing recognized next to a graph break once one such graph of this
    ``torch.compile`` call has been warned about; for the first of them, one message that names the break."""
    tx = _current_tx()
    notes = notes_here(tx) if tx is not None else None
    if notes is None:
        return message
    code = getattr(tx, "f_code", None)
    notes.note(result, code, getattr(tx, "f_globals", None) or {})
    ended = break_of(result.captured.gm)
    if ended is not None:
        notes.breaks.append(ended)
    resumed = resumed_at(code)
    nodes = len(result.captured.gm.graph.nodes)
    if (message is None or not _unrecognized(result) or nodes > SMALL_GRAPH_NODES
            or (ended is None and resumed is None and not notes.breaks)):
        return message
    notes.split.append(nodes)
    if len(notes.split) > 1:
        log.info("adjoint-compile: one more graph of %d nodes with nothing recognized between graph breaks (%d so "
                 "far; warned once)", nodes, len(notes.split))
        return None
    brk = ended or (resumed and (notes.break_at(resumed.location) or resumed)) or notes.breaks[-1]
    return (f"adjoint-compile: nothing recognized in the small graphs that graph breaks split this model into (the "
            f"first: {nodes} nodes, mode={opts.mode}), split at {brk.where()}: {brk.reason}. A recurrence split by a "
            f"break cannot be rewritten: these graphs compile with the inner compiler ({opts.inner}) as is and save "
            f"no memory; remove the break ({brk.remedy()}). Further graphs of <= {SMALL_GRAPH_NODES} nodes with "
            f"nothing recognized from this torch.compile are not warned about one by one: "
            f"adjoint_compile.report(compiled) counts them and lists the breaks")
