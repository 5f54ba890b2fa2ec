"""Library functions whose per-step loops dynamo would unroll, replaced while dynamo traces for ``backend="adjoint"``
by the same computation written with :func:`adjoint_compile.ops.linear_scan` (one graph node whatever T).

Each polyfill is registered with ``torch._dynamo.substitute_in_graph`` on the library's own function object, and only
after it was checked against that function: both run eagerly on small random inputs for every flag combination the
polyfill handles, and a polyfill that disagrees (rel. err > 1e-5) is not registered (a warning says so). While
dynamo traces for any other backend, or for a case the polyfill does not handle, it traces a copy of the library's
own code instead, so ``aot_eager``/``inductor`` compile what they always did.

Registration happens as soon as both this package and the library module are imported (whichever comes second: an
import hook on the library module, or this package's import), before dynamo can trace the library's code; also when
dynamo starts compiling a frame, and by :func:`install`. NB: not only in a dynamo start callback, since
``torch._dynamo.reset()`` clears those. The scans a polyfill makes carry its name in
their stack trace; :func:`polyfill_origin` reads it back, and ``explain()`` says "captured by ...".

Known functions (:data:`KNOWN`): transformers' ``mamba_selective_scan`` (MambaForCausalLM's torch path: its
per-step loop, or ``associative_scan``, which dynamo inlines level by level on CPU; FalconMamba, Jamba and Zamba copy
it) and ``mamba2_chunk_scan`` (Mamba2ForCausalLM's chunked SSD torch path; Bamba, FalconH1, GraniteMoeHybrid,
NemotronH and Zamba2 copy it), mambapy's ``MambaBlock.selective_scan_seq`` (its ``pscan=False``
loop), and torch's own ``nn.GRU`` / ``nn.LSTM`` in highway mode (:mod:`.torch_rnn`: dynamo leaves them out of its
graph otherwise). A module is tried once per process; :func:`installed` says what
happened. NB: the registration is process-wide, but the polyfill only takes over while :func:`active` is true.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

__all__ = ["KNOWN", "install", "installed", "polyfill_origin", "enabled", "active", "traced_mode", "traced_options",
           "options_for", "rolling"]

#: library module -> the submodule of this package that knows how to polyfill it.
#: NB: transformers' hybrid models carry copies of the Mamba and Mamba2 functions (``# Copied from``): each module is
#: registered, and checked against its own copy, on its own
KNOWN: dict[str, str] = {
    **{f"transformers.models.{m}.modeling_{m}": "hf_mamba" for m in ("mamba", "falcon_mamba", "jamba", "zamba")},
    **{f"transformers.models.{m}.modeling_{m}": "hf_mamba2"
       for m in ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")},
    "mambapy.mamba": "mambapy_seq", "torch.nn.modules.rnn": "torch_rnn"}

_LOCK = threading.Lock()
#: library module -> description of what was registered (or why not), once tried.
_TRIED: dict[str, str] = {}
_FORCE = threading.local()
_ORIGINS: dict[str, str] = {}  # polyfill file -> description, for polyfill_origin


def installed() -> dict[str, str]:
    """Library module -> what was registered for it, or why not (only modules tried so far)."""
    return dict(_TRIED)


def install() -> dict[str, str]:
    """Register the polyfills of every known library module already imported (idempotent; cheap when done)."""
    todo = [m for m in KNOWN if m in sys.modules and m not in _TRIED]
    if not todo:
        return installed()
    with _LOCK:
        for mod in todo:
            if mod in _TRIED:
                continue
            try:
                sub = __import__(f"{__name__}.{KNOWN[mod]}", fromlist=["register"])
                # NB: the checks compare fp32 results: not under the caller's autocast
                with torch.autocast("cpu", enabled=False):
                    _TRIED[mod] = sub.register(sys.modules[mod])
                _ORIGINS.update(getattr(sub, "ORIGINS", {}))
            except Exception as e:  # noqa: BLE001 - a polyfill that cannot be set up leaves tracing as it was
                _TRIED[mod] = f"not registered: {type(e).__name__}: {e}"
            log.info("adjoint-compile polyfill for %s: %s", mod, _TRIED[mod])
    return installed()


@torch._dynamo.disable(recursive=True)
def _on_compile_start(*_: Any) -> None:
    # NB: never traced: a compile that starts inside a compiled frame (a backward in a compiled train step compiles
    # its graphs there) runs this under dynamo, which would trace it while holding the lock of the callbacks: a hang
    install()
    # NB: imported by name: the loop roller reads this module's trace state (no import cycle)
    importlib.import_module(f"{__name__}.loop_install").roll_reachable()
    rnn = sys.modules.get(f"{__name__}.torch_rnn")
    if rnn is not None:
        rnn.refresh()


class _Loader(importlib.abc.Loader):
    """The library module's own loader, and :func:`install` once the module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        install()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the library's loader has them
        return getattr(self._loader, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a :data:`KNOWN` module, wraps the spec the other finders give in :class:`_Loader`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in KNOWN or name in _TRIED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


#: called at the end of each frame dynamo compiles (its outermost compile), with no argument, inside the exception
#: that compile raises when it fails (``sys.exc_info()``): analysis/breaks.py notes a frame dynamo skips
END_LISTENERS: list[Callable[[], None]] = []


@torch._dynamo.disable(recursive=True)
def _on_compile_end(*_: Any) -> None:
    for listen in list(END_LISTENERS):
        try:
            listen()
        except Exception as e:  # noqa: BLE001 - a report's note: the compile goes on as it would
            log.debug("adjoint-compile: compile-end listener failed (%s: %s)", type(e).__name__, e)


class _Keep(list):
    """One of dynamo's lists of compile callbacks, which keeps ours through ``torch._dynamo.reset()`` (it clears
    the lists): the loops must be rolled before the first trace after a reset too, and skipped frames noted."""

    def __init__(self, items: Any, ours: Callable[..., None]) -> None:
        super().__init__(items)
        self.ours = ours

    def clear(self) -> None:
        super().clear()
        self.append(self.ours)


def _register_callbacks() -> None:
    try:
        from torch._dynamo.callback import callback_handler
        for attr, ours in (("start_callbacks", _on_compile_start), ("end_callbacks", _on_compile_end)):
            have = getattr(callback_handler, attr)
            if not isinstance(have, _Keep):
                setattr(callback_handler, attr, _Keep(have, ours))
            if ours not in getattr(callback_handler, attr):
                getattr(callback_handler, attr).append(ours)
    except Exception as e:  # noqa: BLE001 - older torch: install() must be called by hand
        log.debug("no dynamo compile callbacks (%s); call adjoint_compile.polyfills.install()", e)


@contextlib.contextmanager
def enabled(mode: str = "exact", roll_loops: bool = True) -> Iterator[None]:
    """Use the polyfills while dynamo traces in this thread, whatever the backend (``explain()`` runs under it), as
    for ``options={"mode": mode, "roll_loops": roll_loops}``."""
    prev = getattr(_FORCE, "on", False), getattr(_FORCE, "mode", None), getattr(_FORCE, "roll", True)
    _FORCE.on, _FORCE.mode, _FORCE.roll = True, mode, roll_loops
    try:
        yield
    finally:
        _FORCE.on, _FORCE.mode, _FORCE.roll = prev


def _compiler_chain(fn: Any) -> Iterator[Any]:
    for _ in range(8):
        if fn is None:
            return
        yield fn
        # NB: under DistributedDataParallel dynamo compiles with DDPOptimizer's bound compile_fn, which hands each
        # bucket's piece of the graph to the user's backend, its backend_compile_fn
        # NB: dynamo's frame converters keep the backend they convert for as _torchdynamo_orig_backend
        fn = (getattr(fn, "__wrapped__", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "_torchdynamo_orig_backend", None)
              or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None))


@torch._dynamo.assume_constant_result
def active() -> bool:
    """True while dynamo traces for ``backend="adjoint"`` (or under :func:`enabled`); evaluated at trace time."""
    return traced_options() is not None


def traced_options() -> dict[str, Any] | None:
    """The options dict of the ``backend="adjoint"`` trace under way in this thread ({} when it has none; under
    :func:`enabled`: its mode and roll_loops), or None when dynamo is not tracing for it. Read from
    ``torch.compile``'s wrapper of the backend, which keeps the ``options`` dict it was given."""
    if getattr(_FORCE, "on", False):
        return {"mode": getattr(_FORCE, "mode", None) or "exact", "roll_loops": getattr(_FORCE, "roll", True)}
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not tracing
        return None
    return options_for(getattr(getattr(tx, "output", None), "compiler_fn", None))


def options_for(compiler_fn: Any) -> dict[str, Any] | None:
    """The options dict given with ``backend="adjoint"`` along ``compiler_fn``'s chain ({} when none), or None when
    the chain is not adjoint-compile's backend."""
    options: Any = None
    for f in _compiler_chain(compiler_fn):
        kw = getattr(f, "kwargs", None)
        if isinstance(kw, dict) and isinstance(kw.get("options"), dict):
            options = kw["options"]
        if getattr(f, "_adjoint_compile_backend", False):
            return dict(options or {})
    return None


def traced_mode() -> str | None:
    """The ``mode`` option of the ``backend="adjoint"`` trace under way in this thread (:func:`enabled`'s when
    forced; "exact" when absent), or None when dynamo is not tracing for it."""
    options = traced_options()
    if options is None:
        return None
    mode = options.get("mode", "exact")
    return mode if isinstance(mode, str) else None


@torch._dynamo.assume_constant_result
def rolling() -> bool:
    """True while dynamo traces for ``backend="adjoint"`` with ``roll_loops`` on (the default), outside highway
    mode: the loops :mod:`.loops` rewrote take their rolled form. Evaluated at trace time.

    NB: highway mode rewrites gated cells from the unrolled steps (passes/match/find_cells.py), not from a scan. Nor
    inside another higher-order op's body (``torch.utils.checkpoint``, ``cond``): their tracers and dispatch modes
    refuse a scan inside (checkpoint's has no rule for it), where the loop as written traces. Nor under a
    ``torch.func`` transform (vmap, grad, jvp)."""
    # NB: nor under a torch.func transform that dynamo traces inline (a compiled vmap over an ensemble): its
    # interpreter is live while tracing, and torch's scan refuses the batched carries
    return rolls(traced_options()) and not _in_subgraph() and torch._C._functorch.peek_interpreter_stack() is None


def _in_subgraph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tracer = InstructionTranslator.current_tx().output.current_tracer
    except Exception:  # noqa: BLE001 - not tracing
        return False
    return getattr(tracer, "parent", None) is not None


def rolls(options: dict[str, Any] | None) -> bool:
    """Whether loops roll for a trace with these options (None: not for this backend)."""
    return options is not None and options.get("roll_loops", True) is not False and \
        options.get("mode", "exact") != "highway"


def polyfill_origin(node: fx.Node) -> str | None:
    """The description of the polyfill that made ``node`` (from its stack trace), or None."""
    trace = node.meta.get("stack_trace") or ""
    for path, what in _ORIGINS.items():
        if path in trace:
            return what
    return None


_register_callbacks()
importlib.import_module(f"{__name__}.loop_install").patch_compile_entry()
if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _ImportHook())
install()
