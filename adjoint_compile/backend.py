"""The ``"adjoint"`` torch.compile backend (DESIGN.md §2).

Dynamo hands us one FX graph per captured frame. The pipeline is a chain of small typed stages::

    capture ─► recognize ─► lower ─► stitch
    (Captured)  (regions,    (regions replaced   (callable: inner-compiled partitions around
                rejections)  by runtime calls)   region autograd.Functions)

Registered under the ``torch_dynamo_backends`` entry-point group (pyproject.toml), so
``torch.compile(model, backend="adjoint")`` works without importing this package first.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from . import options as _options
from .inner import compile_inner
from .options import Options
from .passes.capture import Captured, capture
from .regions import Region, Rejection

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompiledGraph:
    """What the pipeline produced for one dynamo graph: kept for tests, explain() and debugging."""

    captured: Captured
    regions: list[Region]
    rejections: list[Rejection]
    #: names of region call nodes that replaced recognized regions in ``captured.gm``.
    lowered: list[str]
    fn: Callable[..., Any]


#: the pipeline's results for the graphs compiled in this process, newest last (bounded, for debugging/tests).
HISTORY: list[CompiledGraph] = []
_HISTORY_LIMIT = 32


def recognize(captured: Captured, opts: Options) -> tuple[list[Region], list[Rejection]]:
    """Stage 2: find recurrences and residual chains. Never raises: a failure is a rejection."""
    try:
        from .passes.recognize import recognize as _recognize

        return _recognize(captured.gm, opts)
    except Exception as e:  # noqa: BLE001 - recognition must fail soft (DESIGN.md §4)
        log.warning("adjoint-compile: recognition failed, the graph keeps ordinary autograd: %s", e, exc_info=True)
        return [], [Rejection("graph", "<graph>", f"recognition raised {type(e).__name__}: {e}")]


def lower(captured: Captured, regions: list[Region], opts: Options) -> list[str]:
    """Stage 3: replace each region that has a rewrite for ``opts.mode`` by one runtime call node.

    Returns the names of the call nodes made. Regions that are not rewritten get ``rewrite="none"`` and a reason.
    """
    from .passes.lower import lower_regions

    return lower_regions(captured, regions, opts)


def stitch(captured: Captured, lowered: list[str], opts: Options) -> Callable[..., Any]:
    """Stage 4: compile what was not rewritten with the inner compiler and join it with the region calls."""
    if not lowered:
        # NB: nothing rewritten -> hand the untouched dynamo graph to the inner compiler, so the result is exactly
        # what that compiler alone would give (same kernels, same numerics).
        return compile_inner(captured.gm, captured.example_inputs, opts.inner)
    from .passes.partition import stitch_partitions

    return stitch_partitions(captured.gm, lowered, opts.inner)


#: distinct call signatures a graph with symbolic sizes is specialized to (like dynamo's recompile limit); later
#: signatures run the symbolic graph with ordinary autograd, with a warning.
SPECIALIZE_LIMIT = 8


class _Specializing:
    """The callable for a graph with symbolic sizes that holds recurrences the sharded runtime could take: each new
    call signature gets the graph specialized to its sizes (passes/specialize.py) and its own pipeline run."""

    def __init__(self, gm: fx.GraphModule, opts: Options, fallback: Callable[[], Callable[..., Any]]) -> None:
        self.gm, self.opts, self._fallback_factory = gm, opts, fallback
        self._fallback: Callable[..., Any] | None = None
        self.cache: dict[tuple, Callable[..., Any]] = {}
        self._warned = False

    def fallback(self, *args: Any) -> Any:
        if self._fallback is None:
            self._fallback = self._fallback_factory()
        return self._fallback(*args)

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args)
        fn = self.cache.get(key)
        if fn is None:
            if len(self.cache) >= SPECIALIZE_LIMIT:
                if not self._warned:
                    self._warned = True
                    log.warning("adjoint-compile: %d call signatures already specialized (SPECIALIZE_LIMIT); further "
                                "sizes run with ordinary autograd", SPECIALIZE_LIMIT)
                return self.fallback(*args)
            from .passes.specialize import specialize

            try:
                sgm = specialize(self.gm, args)
            except Exception as e:  # noqa: BLE001 - fail soft: the symbolic graph still runs
                log.warning("adjoint-compile: could not specialize a graph with symbolic sizes (%s: %s); it keeps "
                            "ordinary autograd", type(e).__name__, e)
                fn = self.fallback
            else:
                fn = run_pipeline(sgm, list(args), self.opts).fn
            self.cache[key] = fn
        return fn(*args)


def run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options) -> CompiledGraph:
    captured = capture(gm, example_inputs)
    from .passes.specialize import has_symbolic_sizes, no_guards

    if opts.mode == "exact" and has_symbolic_sizes(captured.gm):
        with no_guards(captured.gm):
            regions, rejections = recognize(captured, opts)
        symbolic = [r for r in regions if r.kind == "linear_recurrence"]
        if symbolic:
            for r in symbolic:
                r.rewrite = "none"
                r.reason = ("dynamic shapes: the graph is specialized to each call's sizes and sharded then "
                            f"(up to {SPECIALIZE_LIMIT} signatures; see the later compiled graphs)")
            fn = _Specializing(captured.gm, opts, lambda: stitch(captured, [], opts))
            return _record(CompiledGraph(captured, regions, rejections, [], fn), opts)
    else:
        regions, rejections = recognize(captured, opts)
    lowered = lower(captured, regions, opts) if regions else []
    fn = stitch(captured, lowered, opts)
    return _record(CompiledGraph(captured, regions, rejections, lowered, fn), opts)


def _record(result: CompiledGraph, opts: Options) -> CompiledGraph:
    _log_decisions(result, opts)
    HISTORY.append(result)
    del HISTORY[:-_HISTORY_LIMIT]
    return result


def adjoint_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Any = None, mode: str | None = None
) -> Callable[..., Any]:
    """``torch.compile(model, backend="adjoint", options={...})``.

    ``options`` is validated here, on the first call (an :class:`~adjoint_compile.OptionsError`, a ``ValueError``,
    reaches the caller unwrapped). torch.compile's own ``mode=`` argument has no meaning for this backend; the
    adjoint mode is ``options={"mode": ...}``.
    """
    opts = _options.validate(options)
    if mode not in (None, "default"):
        log.warning(
            "adjoint-compile ignores torch.compile(mode=%r); choose the backward with options={'mode': ...}", mode
        )
    return run_pipeline(gm, example_inputs, opts).fn


def _log_decisions(result: CompiledGraph, opts: Options) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    n = len(result.captured.gm.graph.nodes)
    log.info(
        "adjoint-compile: graph with %d nodes, %d region(s), %d lowered, %d rejected candidate(s); inner=%s mode=%s",
        n,
        len(result.regions),
        len(result.lowered),
        len(result.rejections),
        opts.inner,
        opts.mode,
    )
    for r in result.regions:
        log.info("  region %s %s/%s length=%s rewrite=%s %s", r.name, r.kind, r.source, r.length, r.rewrite, r.reason)
    for j in result.rejections:
        log.debug("  rejected %s at %s: %s", j.candidate, j.node, j.reason)


def _register() -> None:
    # The entry point makes the name known without importing us; registering here as well covers
    # `import adjoint_compile` in an environment where the package is on sys.path but not installed.
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "adjoint" not in _COMPILER_FNS and _BACKENDS.get("adjoint") is None:
        register_backend(name="adjoint")(adjoint_backend)


_register()
