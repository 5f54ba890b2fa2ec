"""The callable of a graph with symbolic sizes (a new sequence length made dynamo recompile with a symbolic T, or
``torch.compile(dynamic=True)``) that holds something to rewrite.

On its first call the graph is specialized to that call's sizes (passes/capture/specialize.py) and run through the pipeline
up to lowering; the lowered regions are then put back into the symbolic graph (passes/lower/length_generic.py), whose
partitions compile for symbolic sizes once. From then on every length runs that one graph: the regions read T from
their inputs at each call (runtime/length_generic.py). Where the regions hold another size (a batch size), each
value of it gets such a graph, up to :data:`MAX_GENERIC`; a graph whose specialization rewrites nothing at any size
runs as captured.

Where the regions cannot be put back (they read the length as a number) or per-example clipping needs concrete sizes,
each call signature is specialized and compiled on its own, without a limit on how many (each costs a compile). Nothing
falls back to ordinary autograd silently: a length that runs without the rewrite is an ``AdjointCompileWarning``
naming the cause, once, and a row of ``report()``'s fallbacks with the lengths it affected.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .analysis.optable import draws_random
from .errors import AdjointCompileWarning
from .frames import compiling_code, first_notice, loops_over_time, rewritten
from .inner import COMPILE_LOCK
from .passes import decide
from .passes.lower.length_generic import generalize
from .passes.capture.mode_blocks import detach_no_grad_outputs
from .passes.capture.seeded_dropout import seed_dropouts
from .passes.capture.specialize import attribute_floats, specialize
from .passes.stitch import stitch_partitions
from .regions import Fallback
from .runtime.first_order import unhooked
from .runtime.verify import ForwardCheck, check_skipped, copy_graph_module

log = logging.getLogger(__name__)

__all__ = ["LengthDispatch"]


def _key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args)


#: the start of ``generic_failed`` when a region's lowering failed on the region itself, not on its size
LOWERING_FAILED = "lowering failed: "
#: ``generic_failed`` when no region of the specialized graph can be rewritten at any size (none was declined for its
#: size): every call runs the graph with symbolic sizes
NOTHING = "nothing to rewrite"


def _symbol_places(gm: Any) -> dict[Any, tuple[int, int | None]]:
    """Where each plain size symbol of the symbolic graph ``gm`` is read from its call's arguments: (argument index,
    dim), or (index, None) for a size passed as a number."""
    out: dict[Any, tuple[int, int | None]] = {}
    for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = p.meta.get("example_value", p.meta.get("val"))
        sizes = list(enumerate(v.shape)) if isinstance(v, torch.Tensor) else [(None, v)]
        for d, s in sizes:
            if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                out.setdefault(s.node.expr, (i, d))
    return out


def _size_at(args: tuple, at: tuple[int, int | None]) -> int:
    i, d = at
    return int(args[i]) if d is None else int(args[i].shape[d])


def _holds(args: tuple, pins: dict, values: dict) -> bool:
    """Whether this call has the sizes (``pins``) and the module floats (``values``) a graph for every length holds."""
    return all(_size_at(args, at) == v for at, v in pins.values()) and \
        all(float(args[i]) == v for i, v in values.items())


def _longer(dims: list[int], tried: list[int]) -> bool:
    """Whether a call's sizes are larger in some dim than the largest ``tried`` (dim by dim, not by total size: a long
    sequence in a smaller batch than the short ones tried is longer)."""
    return any(n > (tried[i] if i < len(tried) else 0) for i, n in enumerate(dims))


#: graphs for every length one symbolic graph makes, one per value of the sizes they hold (batch sizes)
MAX_GENERIC = 4


class LengthDispatch:
    """See the module docstring. ``owner`` is the symbolic graph's record (``CompiledGraph``); ``pipeline(gm, args,
    opts, compile)`` runs the backend's pipeline on a specialized graph; ``fallback`` runs the symbolic graph with the
    inner compiler (compiled while dynamo's symbolic context is active)."""

    def __init__(self, owner: Any, opts: Any, pipeline: Callable[..., Any], fallback: Callable[..., Any]) -> None:
        self.owner, self.gm, self.opts, self.pipeline, self.fallback = owner, owner.captured.gm, opts, pipeline, fallback
        # NB: copied now, before anything runs: the first-call check's reference and the generic graph's base
        self.pristine = copy_graph_module(self.gm)
        #: the graphs for every length: (pins, value_pins, fn) each; more than one where the regions hold a size other
        #: than the length (a batch size) and calls came with other values of it (at most :data:`MAX_GENERIC`)
        self.generics: list[tuple[dict, dict, Callable[..., Any]]] = []
        #: the held sizes' values a graph for every length was tried at (:meth:`_held`): the call's sizes, dim by dim,
        #: where that try found only lengths too short to shard (a longer call tries again), else None
        self.tried_held: dict[tuple, list[int] | None] = {}
        #: why the one graph for every length could not be made ("" not tried yet; "short": retried on a new size)
        self.generic_failed = ""
        self.declined: Any = None
        #: the inputs' sizes, dim by dim, the largest tried ("short" is retried on a call longer in one of them)
        self.tried_dims: list[int] = []
        self.cache: dict[tuple, Callable[..., Any]] = {}
        self.fallback_lengths: dict[str, list[tuple]] = {}
        #: the sizes of the calls too short to shard before the graph for every length was made (:meth:`_short`)
        self.short_sizes: list[str] = []
        #: the try at a short call whose rows the report shows (the longest so far)
        self.shown: Any = None
        #: the code dynamo compiled this graph for: whether another graph of it (the first call's, before dynamo made
        #: the length symbolic) was rewritten decides whether a short call is a fallback or a decline
        self.code = compiling_code()
        #: sizes other than the length that the graph for every length holds: symbol -> (where, value)
        self.pins: dict[Any, tuple[tuple[int, int | None], int]] = {}
        #: module float attributes passed as 0-dim tensors (a dropout's p): folded per specialization, keyed by
        #: their values; those the graph for every length holds
        self.values = attribute_floats(self.gm)
        self.value_pins: dict[int, float] = {}

    @property
    def generic(self) -> Callable[..., Any] | None:
        """The first graph for every length (None before one is made)."""
        return self.generics[0][2] if self.generics else None

    def _generic_for(self, args: tuple) -> Callable[..., Any] | None:
        return next((fn for pins, values, fn in self.generics if _holds(args, pins, values)), None)

    def _held(self, args: tuple) -> tuple:
        """This call's values of the sizes the first graph for every length holds."""
        pins, values, _ = self.generics[0]
        return (*(_size_at(args, at) for at, _ in pins.values()), *(float(args[i]) for i in values))

    def _another_generic(self, args: tuple) -> Callable[..., Any] | None:
        """A graph for every length at this call's values of the held sizes (another batch size), or None: tried once
        per value, up to :data:`MAX_GENERIC` graphs, said once when that is reached."""
        held = self._held(args)
        dims = [int(n) for a in args if isinstance(a, torch.Tensor) for n in a.shape]
        if held in self.tried_held and (self.tried_held[held] is None or not _longer(dims, self.tried_held[held])):
            return None
        self.tried_held[held] = None
        if len(self.generics) >= MAX_GENERIC:
            if len(self.tried_held) == len(self.generics) + 1:
                warnings.warn(AdjointCompileWarning(
                    f"adjoint-compile: the regions hold a size other than the length (values so far: "
                    f"{sorted(self.tried_held)}); {MAX_GENERIC} graphs for every length are made, and calls with other "
                    f"values are specialized per length (each new one lowered and compiled); pad or drop the odd "
                    f"batches to keep the compile time bounded"), stacklevel=4)
            return None
        try:
            fn, why = self._try_generic(args)
        except Exception as e:  # noqa: BLE001 - fail soft: per-length specialization still works
            fn, why = None, f"{type(e).__name__}: {e}"
        if fn is None:
            log.info("adjoint-compile: no graph for every length at %s (%s); these calls are specialized", held, why)
            if why == "short":
                self.tried_held[held] = dims
            return None
        self.generics.append((self.pins, self.value_pins, fn))
        log.info("adjoint-compile: another graph for every length, for the held sizes at %s", held)
        return fn

    def _sizes(self, args: tuple) -> str:
        """This call's sizes, for users: the shapes of the inputs whose sizes are symbols (``(2, 37, 8)``)."""
        holders = [n.meta.get("example_value", n.meta.get("val")) for n in self.gm.graph.nodes if n.op == "placeholder"]
        at = [i for i, v in enumerate(holders) if isinstance(v, torch.Tensor) and i < len(args) and
              any(isinstance(n, torch.SymInt) for n in v.shape)]
        return " and ".join(str(tuple(args[i].shape)) for i in at) or str(_key(args))

    def _fell_back(self, cause: str, remedy: str, key: tuple, why: str = "",
                   sizes: list[str] | None = None) -> Callable[..., Any]:
        """Run this call signature with ordinary autograd, said once per cause, listed in the report with every
        signature it affected (and ``sizes``: theirs for users)."""
        seen = self.fallback_lengths.setdefault(cause, [])
        seen.append(key)
        if len(seen) == 1:
            more = {"sizes": sizes} if sizes is not None else {}
            self.owner.fallbacks.append(Fallback(cause, remedy, {"signatures": seen, "first": why, **more}))
            warnings.warn(AdjointCompileWarning(f"adjoint-compile: {cause}{f' ({why})' if why else ''}; these sizes "
                                                f"run with ordinary autograd (no memory saved); {remedy}"), stacklevel=3)
        return self.fallback

    def _per_length(self, why: str) -> None:
        """Said once per code object (a loop over time recompiles it at each new length: each graph would say it
        again): every new length costs a pipeline run and its inner compiles."""
        decide.lowered_per_length(self.owner.regions, why)
        said = not first_notice(self.code, "per_length")
        # NB: per_sample_clip, sequence_parallel and highway are specialized per size by design (docs)
        if said:
            log.info("adjoint-compile: the rewritten regions cannot serve every sequence length (%s)", why)
        elif self.opts.per_sample_clip is None and self.opts.sequence_parallel is None and self.opts.mode != "highway":
            # NB: a float attribute that changed between calls (a dropout's p) makes the graph symbolic too
            also = " (and every value of a float attribute the graph reads, such as a dropout's p)" if self.values \
                else ""
            # NB: a loop's code recompiles per length anyway, up to dynamo's limit (frames.count_loop_compiles)
            stays = ("the memory saving stays up to dynamo's recompile_limit, as the Python loop over time recompiles "
                     "the code at each new length; a warning says when it is reached" if loops_over_time(self.code)
                     else "the memory saving stays")
            warnings.warn(AdjointCompileWarning(
                f"adjoint-compile: the rewritten regions cannot serve every sequence length{also} ({why}): each new "
                f"length is specialized, lowered and compiled again ({stays}); pad batches to a few "
                f"lengths to bound the compile time"), stacklevel=4)

    def _try_generic(self, args: tuple) -> tuple[Callable[..., Any] | None, str]:
        """The one graph for every length (module docstring), or (None, why not): ``"short"`` when nothing was lowered
        at these sizes (too short to shard: a longer call may still make it), :data:`NOTHING` when nothing would be at
        any size, else the reason."""
        opts = self.opts
        if opts.per_sample_clip is not None or opts.sequence_parallel is not None or opts.mode == "highway":
            return None, "per-example clipping, sequence parallelism and Highway-BP are specialized per size"
        sgm = specialize(copy_graph_module(self.gm), args, self.values)
        concrete = copy_graph_module(sgm) if opts.check_forward else None  # NB: the pipeline rewrites sgm
        result = self.pipeline(sgm, list(args), opts, compile=False)
        if not result.lowered:
            failed = sorted({r.reason for r in result.regions if r.details.get("lowering_failed")})
            if failed:
                return None, LOWERING_FAILED + "; ".join(failed)
            self.declined = result
            if not any("expected_memory_bytes" in r.details for r in result.regions):
                self.owner.specializations.append(result)  # NB: its rows say why, in the report
                return None, NOTHING
            return None, "short"
        sym = copy_graph_module(self.pristine)
        done = result.captured.normalized
        # NB: the capture passes that make a region's inputs (detached no_grad values, dropout's seed), run on the
        # graph with symbolic sizes too, so that its regions' inputs are found there by name
        if done.get("no_grad_detached"):
            detach_no_grad_outputs(sym)
        if done.get("dropouts"):
            seed_dropouts(sym)
        pinned: set = set()
        calls, why = generalize(sym, result.captured.gm, result.lowered, opts.shard_size, pinned)
        self.pins = {}
        if not why and pinned:
            where = _symbol_places(self.gm)
            if not pinned <= set(where):
                why = f"the regions hold sizes ({', '.join(map(str, pinned))}) not read from the inputs"
            else:
                self.pins = {s: (where[s], _size_at(args, where[s])) for s in pinned}
                log.info("adjoint-compile: the graph for every length holds %s at this call's values; other values "
                         "get graphs of their own", ", ".join(f"{s} = {v}" for s, (_, v) in self.pins.items()))
        if why:
            log.info("adjoint-compile: the regions cannot serve every length (%s); each length is specialized", why)
            return None, why
        self.value_pins = {i: float(args[i]) for i in self.values}
        self.owner.specializations.append(result)
        self.owner.lowered = list(calls)
        result.lengths = set()
        for c in calls:  # NB: one set for the report: every region of the graph runs at each call's length
            region = sym.get_submodule(next(n.target for n in sym.graph.nodes if n.name == c))
            region.lengths, region.fallbacks = result.lengths, self.owner.fallbacks
        fn = stitch_partitions(sym, calls, opts.inner, dynamic=True, fallbacks=self.owner.fallbacks)
        # NB: not with dropout: the compiled graph draws other numbers than the graph as captured (backend._checked)
        if opts.check_forward and not any(draws_random(n) for n in self.pristine.graph.nodes) and \
                not check_skipped(self.owner.timing, concrete, result.regions):
            names = ", ".join(f"{r.kind} {r.name}" for r in result.regions if r.rewrite != "none")
            fn = ForwardCheck(fn, copy_graph_module(self.pristine), lambda ref, a: self.fallback, names,
                              self.owner.fallbacks, self.owner.timing)
        rewritten(self.code, now=True)
        if self.short_sizes:
            decide.short_lengths(self.owner.regions, self.short_sizes, self._sizes(args))
        log.info("adjoint-compile: one graph with %d region call(s) serves every length", len(calls))
        return fn, ""

    def _specialize(self, key: tuple, args: tuple) -> Callable[..., Any]:
        why = self.generic_failed
        dims = [int(n) for a in args if isinstance(a, torch.Tensor) for n in a.shape]
        # NB: with a graph for every length made, a call it cannot serve (another batch size it holds) gets one of its
        # own (:meth:`_another_generic`), or is specialized
        longer = _longer(dims, self.tried_dims)
        if self.generics and (fn := self._another_generic(args)) is not None:
            return fn
        tried = not self.generics and (not why or why == "short" and longer)
        if tried:
            self.tried_dims = [max(n, self.tried_dims[i] if i < len(self.tried_dims) else 0)
                               for i, n in enumerate(dims)]
            fn = None
            try:
                fn, why = self._try_generic(args)
            except Exception as e:  # noqa: BLE001 - fail soft: per-length specialization still works
                why = f"{type(e).__name__}: {e}"
                log.warning("adjoint-compile: lowering once for every length failed (%s); each length is "
                            "specialized", why, exc_info=log.isEnabledFor(logging.DEBUG))
            self.generic_failed = why
            if fn is not None:
                self.generics.append((self.pins, self.value_pins, fn))
                self.tried_held[self._held(args)] = None
                return fn
            if why and why not in ("short", NOTHING) and not why.startswith(LOWERING_FAILED):
                self._per_length(why)
        if why == NOTHING:
            decide.nothing_at_any_length(self.owner.regions)
            self.cache[key] = self.fallback
            return self.fallback
        if why.startswith(LOWERING_FAILED):
            # NB: the regions themselves cannot be lowered, whatever the length: the symbolic graph serves every
            # length (a specialized graph compiled outside dynamo's context can hold reads of tensor data)
            fn = self._fell_back("the recognized regions could not be lowered", "see the reasons in ac.report; "
                                 "report the model", key, why[len(LOWERING_FAILED):])
            self.cache[key] = fn
            return fn
        if why == "short":
            fn = self.cache[key] = self._short(key, args, tried)
            return fn
        try:
            sgm = specialize(copy_graph_module(self.gm), args, self.values)
        except Exception as e:  # noqa: BLE001 - fail soft: the symbolic graph still runs
            if self.opts.per_sample_clip is not None:
                raise
            fn = self._fell_back(f"a graph with symbolic sizes could not be specialized ({type(e).__name__}: {e})",
                                 "compile with dynamic=False, or report the model", key)
            self.cache[key] = fn
            return fn
        result = self.pipeline(sgm, list(args), self.opts)
        self.owner.specializations.append(result)
        fn = result.fn
        self.cache[key] = fn
        return fn

    def _short(self, key: tuple, args: tuple, tried: bool) -> Callable[..., Any]:
        """A call too short to shard before the graph for every length was made: it runs with ordinary autograd, and
        a longer call tries again. A fallback where another graph of this code was rewritten (the first call's, at
        a length that shards), else a decline like a static graph's, said once with its reason; either way the
        report lists its sizes (the symbolic graph's rows) and the tries' reasons (their specializations' rows)."""
        if tried:
            # NB: the longest try's rows only (each longer call tries again): the symbolic graph's rows list the sizes
            if self.shown in self.owner.specializations:
                self.owner.specializations.remove(self.shown)
            self.shown = self.declined
            self.owner.specializations.append(self.declined)
        sizes = self._sizes(args)
        self.short_sizes.append(sizes)
        decide.short_lengths(self.owner.regions, self.short_sizes)
        reasons = "; ".join(sorted({r.reason for r in self.declined.regions if r.kind != "residual_chain"}))
        if rewritten(self.code):
            return self._fell_back("a length too short to shard, before any longer one", "a call longer than any so "
                                   "far is lowered again, and once one shards, one graph serves every length, these "
                                   "too; a smaller shard_size may shard shorter ones", key, reasons, self.short_sizes)
        if len(self.short_sizes) == 1:
            warnings.warn(AdjointCompileWarning(
                f"adjoint-compile: nothing rewritten at the sizes {sizes}, too short to shard ({reasons}); these "
                f"calls run with ordinary autograd (no memory saved), and a call longer than any so far is lowered "
                f"again; ac.report lists the sizes"), stacklevel=3)
        return self.fallback

    def __call__(self, *args: Any) -> Any:
        if (fn := self._generic_for(args)) is not None:
            return fn(*args)
        key = (*_key(args), *(float(args[i]) for i in self.values))
        fn = self.cache.get(key)
        if fn is None:
            with COMPILE_LOCK, unhooked():  # NB: the pipeline's trial runs are not the user's forward (backend.py)
                fn = self._generic_for(args) or self.cache.get(key) or self._specialize(key, args)
        return fn(*args)
