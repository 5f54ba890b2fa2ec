"""Where dynamo split a model into graphs (graph breaks), and what the backend saw under one ``torch.compile`` call.

* :func:`break_of`: the graph break that ended a dynamo graph (dynamo's ``compile_subgraph_reason``), as a
  :class:`Break` with a readable reason and the user's source line;
* :class:`CompileNotes`: one per ``torch.compile`` call, kept on torch's wrappers of the backend (every frame that
  call compiles shares them: resume functions after a break, a nested function's own frame after a break inside
  it, the frames a skipped frame calls). It holds the frames compiled and their graphs (weakly), so that
  ``adjoint_compile.report`` finds graphs that live on code objects other than the compiled model's;
* :func:`collapse`: the backend's warning for one graph, or None when the graph is one more small graph with
  nothing recognized that graph breaks split off: those are one WARNING per ``torch.compile`` call, naming the break;
* :func:`frame_skipped`: a frame dynamo compiled no graph for at all, because of a graph break it cannot resume
  after (one inside a loop): the whole function runs eagerly. Dynamo says so only in its logs, and
  ``torch._dynamo.explain`` lists no break; this warns, naming the break's line, and keeps it for ``report()``
  (:func:`skipped_in`) and ``explain()`` (:func:`collect_skips`).

NB: there is no hook at the end of a compiled call, so the one warning comes with the first such graph; the count
of all of them is in ``adjoint_compile.report(compiled)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import logging
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import AdjointCompileWarning

log = logging.getLogger(__name__)

#: graphs with at most this many nodes and nothing recognized, next to a graph break, are pieces of a model that
#: breaks cut up (a loop's step or two): their warnings are one per torch.compile call
SMALL_GRAPH_NODES = 64

#: the attribute of torch's backend wrappers that holds a compile's :class:`CompileNotes`
NOTES = "_adjoint_compile_notes"

#: a torch recurrent module in a frame: dynamo skips the whole frame (torch._dynamo.config.allow_rnn=False)
RNN_WORDS = "a torch nn.RNN, nn.GRU or nn.LSTM module, which dynamo leaves out of its graph"

#: dynamo's reasons (GraphCompileReason.reason) that name its own bytecode handler, in words
_READABLE = (("generic_jump", "data-dependent branching: an `if` (or `while`, `and`/`or`) on a tensor's value"),
             ("data-dependent branching", "data-dependent branching: an `if` (or `while`, `and`/`or`) on a tensor's "
                                          "value"),
             ("unsupported tensor.item() call", "a tensor read as a Python number (`.item()`, `float(t)`, `int(t)`), "
                                                "which dynamo does not keep in its graph"),
             ("attempted to wrap rnn, gru, or lstm", RNN_WORDS),
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
    #: the function dynamo ran without a graph because of this break, "name (file:line)" ("" when none)
    frame: str = ""

    @property
    def data_dependent(self) -> bool:
        return self.reason.lower().startswith("data-dependent")

    def remedy(self) -> str:
        if "num_batches_tracked" in self.code and "batchnorm" in self.location:
            # NB: momentum=None makes BatchNorm's factor 1 / float(count); capture_scalar_outputs then breaks on
            # guarding the division instead
            return ("a BatchNorm with momentum=None (a cumulative average) reads its batch count as a number: give "
                    "it a momentum (nn.BatchNorm1d(d, momentum=0.1)); TORCH_LOGS=graph_breaks shows every break and "
                    "why")
        how = ("compute both branches and choose with torch.where, or use torch.cond; " if self.data_dependent
               else "keep the number a tensor (`h / h.abs().amax()`, not `h / float(h.abs().max())`), or set "
                    "torch._dynamo.config.capture_scalar_outputs = True; " if self.reason.startswith("a tensor read")
               else "mode='highway' decomposes nn.GRU and nn.LSTM into their cell equations; "
               if self.reason.startswith(RNN_WORDS) else "")
        return f"{how}TORCH_LOGS=graph_breaks shows every break and why"

    def where(self) -> str:
        """``location (`code`)``."""
        return self.location + (f" (`{self.code}`)" if self.code else "")


def describe(reason: Any) -> str:
    """dynamo's reason for a break, first line, with its bytecode handlers' names in words."""
    text = str(reason or "").strip()
    first = text.splitlines()[0] if text else "graph break"
    for prefix, words in _READABLE:
        if first.lower().startswith(prefix):
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
        self.note_frame(code, globs)

    def note_frame(self, code: Any, globs: dict[str, Any]) -> None:
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
    return notes_for(getattr(getattr(tx, "output", None), "compiler_fn", None))


def notes_for(compiler_fn: Any) -> CompileNotes | None:
    """The notes of the ``torch.compile`` call whose backend chain ``compiler_fn`` is (made when first asked), or
    None."""
    holders = _holders(compiler_fn)
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


def backend_name(compiled: Any) -> str | None:
    """The backend of the ``torch.compile`` call that made ``compiled``: "adjoint" for this package's (by name or
    as the function), else the name torch keeps ("inductor", ...); None when none is found."""
    names = []
    for o in _linked(compiled):
        try:
            if getattr(o, "_adjoint_compile_backend", False):
                return "adjoint"
            name = getattr(o, "compiler_name", None)
        except Exception:  # noqa: BLE001 - an object whose __getattr__ raises something else
            continue
        if isinstance(name, str):
            names.append(name)
    return "adjoint" if "adjoint" in names else next(iter(names), None)


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
    if any(getattr(g, "lowered", None) for g in notes.graphs.values() if g is not result):
        # NB: a graph of this compile was rewritten (the model's loss before a ``loss.backward()`` that breaks):
        # "nothing recognized" would read as the whole model's verdict; report() lists this graph
        log.info("adjoint-compile: a graph of %d nodes with nothing recognized beside a graph break, next to "
                 "rewritten ones (not warned)", nodes)
        return None
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


# --- frames dynamo ran without a graph ---------------------------------------------------------------------------

#: the frames dynamo skipped because of a graph break it cannot resume after, by code object: that break. An entry
#: holds while dynamo still marks the code as converted and holds no graph for it (torch._dynamo.reset() forgets both)
_SKIPPED: weakref.WeakKeyDictionary[Any, Break] = weakref.WeakKeyDictionary()
#: explain()'s list of the frames skipped while it traces (:func:`collect_skips`)
_COLLECT = threading.local()


@contextlib.contextmanager
def collect_skips() -> Iterator[list[Break]]:
    """The frames dynamo skips while this block traces (in this thread), each as the :class:`Break` that made it
    skip them; ``torch._dynamo.explain`` lists no break for them."""
    prev, _COLLECT.skips = getattr(_COLLECT, "skips", None), []
    try:
        yield _COLLECT.skips
    finally:
        _COLLECT.skips = prev


def _compiling(err: BaseException) -> tuple[Any, dict[str, Any], Any, bool] | None:
    """The frame dynamo's ``_compile`` (up the stack) was compiling when ``err`` ended it: its code, globals, the
    compiler it compiled for, and whether dynamo raises ``err`` to the caller (``fullgraph=True``, export); None when
    ``err`` is not that compile's (an exception the caller of the compiled code was handling)."""
    ours: set[int] = set()
    f = sys._getframe(1)
    while f is not None:
        ours.add(id(f))
        if f.f_code.co_name == "_compile" and f.f_code.co_filename.endswith("convert_frame.py"):
            break
        f = f.f_back
    if f is None:
        return None
    tb = err.__traceback__
    while tb is not None and id(tb.tb_frame) not in ours:
        tb = tb.tb_next
    loc = f.f_locals
    if tb is None or "code" not in loc:
        return None
    return loc["code"], loc.get("globals") or {}, loc.get("compiler_fn"), bool(loc.get("one_graph") or
                                                                              loc.get("export"))


def frame_skipped() -> None:
    """Called at the end of each frame dynamo compiles (polyfills.END_LISTENERS), inside the exception that ended
    it, if any: when that is a graph break dynamo does not resume after, dynamo runs the whole frame eagerly with
    only a log line. For ``backend="adjoint"``: warn (at the break's line) and keep the break for ``report()``; under
    :func:`collect_skips` (explain()): keep it there."""
    err = sys.exc_info()[1]
    try:
        from torch._dynamo.exc import Unsupported, UserError
    except ImportError:  # NB: an older torch
        return
    if not isinstance(err, (Unsupported, UserError)):
        return
    stack = [str(getattr(f, "filename", "")).replace("\\", "/") for f in getattr(err, "real_stack", None) or []]
    if any("/torch/distributed/" in f for f in stack):
        # NB: FSDP2's hooks, which dynamo skips by design: it compiles each sharded module's forward on its own
        return
    got = _compiling(err)
    if got is None or got[3]:  # NB: fullgraph=True raises the break to the caller
        return
    code, globs, compiler_fn, _ = got
    user = (getattr(err, "real_stack", None) or [None])[-1]
    brk = at_frame(err, user)
    loop = "loop" in str(getattr(err, "gb_type", "") or "")
    resumed = resumed_at(code)  # NB: a resume function: what follows an earlier break in a function
    frame = (f"the rest of {resumed.location.rsplit(' in ', 1)[-1]} after its graph break at "
             f"{resumed.location.rsplit(' in ', 1)[0]}" if resumed is not None else
             f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})")
    brk = dataclasses.replace(brk, reason=brk.reason + (", inside a loop" if loop else ""), frame=frame)
    collect = getattr(_COLLECT, "skips", None)
    if collect is not None:
        collect.append(brk)  # NB: explain() reports; it does not warn
        return
    from ..polyfills import options_for

    if options_for(compiler_fn) is None:
        return
    _SKIPPED[code] = brk
    notes = notes_for(compiler_fn)
    if notes is not None:
        notes.note_frame(code, globs)
    where = f" at {brk.where()}" if brk.location else ""
    why = ("dynamo does not resume after a graph break inside a loop" if loop
           else "dynamo does not resume after this graph break")
    msg = (f"adjoint-compile: {brk.frame} runs eagerly, without a graph: nothing in it is rewritten and it saves no "
           f"memory (ordinary autograd). Cause: a graph break{where}: {brk.reason}; {why}, so it skips the whole "
           f"function (what it calls is compiled on its own). Remove the break ({brk.remedy()}); "
           f"adjoint_compile.report(compiled) lists it")
    log.debug("%s", msg)
    if "functorch" in str(getattr(err, "gb_type", "") or "") + str(err).split("\n", 1)[0]:
        # NB: torch.func.grad/vmap of a compiled function: dynamo refuses every frame under the transform, the
        # library's and Python's own among them; one warning says so
        if not _FUNCTORCH_WARNED:
            _FUNCTORCH_WARNED.append(True)
            warnings.warn(AdjointCompileWarning(
                "adjoint-compile: a compiled function called under a torch.func transform (torch.func.grad, vmap, "
                "jvp of it) runs eagerly: dynamo does not trace under the transform, so nothing is rewritten and it "
                "saves no memory (ordinary autograd; the values are exact). adjoint_compile.report(compiled) lists "
                "the functions that ran eagerly"), stacklevel=2)
        return
    if user is not None and getattr(user, "lineno", None):
        warnings.warn_explicit(AdjointCompileWarning(msg), AdjointCompileWarning, user.filename, user.lineno)
    else:
        warnings.warn(AdjointCompileWarning(msg), stacklevel=2)


#: whether the warning for functions compiled under a torch.func transform was given (once a process)
_FUNCTORCH_WARNED: list[bool] = []


def skipped_in(codes: Iterable[Any]) -> list[Break]:
    """The breaks that made dynamo skip these frames (code objects) and still do (:func:`frame_skipped`)."""
    try:
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # NB: an older torch
        return []
    out: list[Break] = []
    for code in codes:
        try:
            brk = _SKIPPED.get(code)
        except TypeError:  # NB: not weakly referenceable
            continue
        if brk is not None and brk not in out and code in input_codes and not _debug_get_cache_entry_list(code):
            out.append(brk)
    return out


def _listen() -> None:
    from ..polyfills import END_LISTENERS

    if frame_skipped not in END_LISTENERS:
        END_LISTENERS.append(frame_skipped)


_listen()
