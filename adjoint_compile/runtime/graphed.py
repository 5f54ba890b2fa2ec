"""Shard programs replayed from captured CUDA graphs: one launch per program call instead of one per kernel.

A sweep calls the same few compiled programs once per shard (the forward, the recompute + VJP, a loss chunk's value
and gradient). On a GPU, a call's Python and its kernel launches cost about a millisecond, far more than a shard's
kernels run; replaying a captured graph costs a few microseconds. :class:`GraphedCall` captures ``fn`` once for its
argument layout and replays it:

    call k:  static_in[i].copy_(args[i])  ─►  graph.replay()  ─►  static_out   (the same tensors every call)

A parameter is read in place by the graph (a call with another parameter there, or the same one moved to other
memory, runs as compiled); every other tensor argument is copied in at every call. NB: even the very tensor of the
previous call with the same version counter: writes through ``.data``, numpy or DLPack change a buffer or a batch
without bumping it, and a replay that skipped the copy used the old values. A replay bumps its outputs' version
counters, so autograd sees them overwritten.

so a result is valid until the next call of the same program: the sweeps that use it (runtime/sharded.py,
runtime/loss_tail.py) copy what they keep (the outputs into the full-length buffers, the states they carry, the
gradients they add up) before the next call. All graphs on a device share one memory pool, which that discipline
makes safe. A program that cannot be captured (an op that synchronizes or reads a CPU value) runs as compiled, with
one warning per cause.

The CPU tests set :data:`CPU_STAND_IN` to a stand-in graph (:func:`replay_on_cpu`) that writes each call's results
into the same output tensors, so a sweep that kept one across calls would be found wrong against autograd.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import AdjointCompileWarning
from ..inner import _cause

log = logging.getLogger(__name__)

__all__ = ["GraphedCall", "graphable", "replayed", "captured", "replay_on_cpu"]

#: the causes of failed captures already warned about
_warned: set[str] = set()

#: whether replayed outputs can be marked changed for autograd (``increment_version``, torch >= 2.5)
_BUMP = hasattr(torch.autograd.graph, "increment_version")

#: tests set this to :func:`replay_on_cpu` to run the graphed discipline without a GPU
CPU_STAND_IN: Callable[..., Any] | None = None


def _bump(t: torch.Tensor) -> None:
    if _BUMP:
        torch.autograd.graph.increment_version(t)


def graphable(args: Sequence[Any], inner: str) -> bool:
    """Whether a program compiled by ``inner`` is replayed from a graph for these arguments: inductor programs on
    CUDA tensors (or any tensors when the CPU stand-in is set, for tests)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if inner != "inductor" or not tensors:
        return False
    if CPU_STAND_IN is not None:
        return True
    return all(t.is_cuda for t in tensors)


class GraphedCall:
    """``fn`` captured for the layout of ``example`` (module docstring); ``pool``: a graph memory pool to share."""

    def __init__(self, fn: Callable[..., Any], example: Sequence[Any], pool: Any = None) -> None:
        self.fn = fn
        # NB: a parameter is its own static input (read in place, updates and all, never cloned: a vocabulary
        # matrix would be held twice per program); any other tensor is copied in
        self.aliased = [isinstance(a, torch.nn.Parameter) for a in example]
        self.static_in = [a if al else a.detach().clone() if isinstance(a, torch.Tensor) else a
                          for a, al in zip(example, self.aliased)]
        # NB: and its memory: FSDP2 frees and re-allocates an unsharded parameter's storage under the same object
        self._ptrs = [a.data_ptr() if al else 0 for a, al in zip(example, self.aliased)]
        self.graph: Any = None
        self.replay_cpu: Callable[..., Any] | None = None
        if CPU_STAND_IN is not None and not any(isinstance(a, torch.Tensor) and a.is_cuda for a in example):
            self.replay_cpu = CPU_STAND_IN(fn, self.static_in)
            self.static_out = self.replay_cpu()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # NB: warm-up off the capture: lazy initializations (cuBLAS handles, autotune)
            for _ in range(2):
                fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # NB: thread_local: a VJP is captured in the autograd engine's device thread, while the main thread waits
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.static_out = fn(*self.static_in)

    def __call__(self, *args: Any) -> Any:
        if any(al and (a is not s or a.data_ptr() != p) for al, s, a, p in zip(self.aliased, self.static_in, args,
                                                                                 self._ptrs)):
            return self.fn(*args)  # NB: other parameters (another instance of the module): run as compiled
        for s, a, al in zip(self.static_in, args, self.aliased):
            if isinstance(s, torch.Tensor) and not al:
                s.copy_(a)
        if self.replay_cpu is not None:
            out = self.replay_cpu()
        else:
            self.graph.replay()
            out = self.static_out
        # NB: a replay writes its outputs behind autograd's back: their version counters are bumped by hand, so a
        # result saved for a backward and overwritten by the next replay fails autograd's check instead of being used
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _bump(t)
        return out


def capture_or_plain(fn: Callable[..., Any], example: Sequence[Any], pool: Any, what: str) -> Callable[..., Any]:
    """:class:`GraphedCall` of ``fn``, or ``fn`` itself (one warning per cause) when it cannot be captured."""
    try:
        return GraphedCall(fn, example, pool)
    except Exception as e:  # noqa: BLE001 - whatever cannot be captured runs as compiled
        cause = _cause(e)
        log.debug("adjoint-compile: no CUDA graph for a %s (%s)", what, cause, exc_info=True)
        if cause not in _warned:
            _warned.add(cause)
            warnings.warn(f"adjoint-compile: a {what} could not be captured as a CUDA graph ({cause}); it runs as "
                          f"compiled, one launch per kernel (same results, slower)", AdjointCompileWarning,
                          stacklevel=3)
        return fn


def replay_on_cpu(fn: Callable[..., Any], static_in: list[Any]) -> Callable[[], Any]:
    """A stand-in for a captured graph on CPU: every replay writes ``fn``'s results on ``static_in`` into the same
    output tensors, as a CUDA graph does."""
    out = list(fn(*static_in))

    def replay() -> Any:
        for o, r in zip(out, fn(*static_in)):
            if isinstance(o, torch.Tensor):
                o.data.copy_(r)  # NB: .data: like a graph's replay, the write leaves the version counter as it is
        return out
    return replay


#: the most programs kept replayable from graphs in a process: each graph holds its outputs and its share of the pool
#: while kept. Past it, a new program runs as compiled (no capture on every call when a step's programs outnumber it)
MAX_GRAPHS = 64

#: a graph not replayed in this many calls of graphed programs is dropped (its outputs and pool memory go; captured
#: again if called later), so lengths that keep changing, each with a shorter last shard, do not pile up graphs
IDLE_CALLS = 2000

#: per compiled program (by id, the program kept alive with it): its graphed call and the tick of its last call,
#: least recently called first; per device, the shared pool
_GRAPHED: collections.OrderedDict[int, tuple[Any, Callable[..., Any], int]] = collections.OrderedDict()
_TICK = [0]
_POOLS: dict[Any, Any] = {}


def replayed(fn: Callable[..., Any], args: Sequence[Any], inner: str, what: str) -> Callable[..., Any]:
    """``fn`` (a program compiled by ``inner`` for the layout of ``args``) as a :class:`GraphedCall` where it can be
    (:func:`graphable`), captured on its first call; else ``fn``. The caller copies what it keeps of a result before
    its next call of any graphed program (module docstring)."""
    if not graphable(args, inner):
        return fn
    _TICK[0] += 1
    got = _GRAPHED.pop(id(fn), None)
    if got is None:
        while _GRAPHED and _TICK[0] - next(iter(_GRAPHED.values()))[2] > IDLE_CALLS:
            _GRAPHED.popitem(last=False)
        if len(_GRAPHED) >= MAX_GRAPHS:
            return fn
        got = (fn, captured(fn, args, what), 0)
    _GRAPHED[id(fn)] = (got[0], got[1], _TICK[0])
    return got[1]


def captured(fn: Callable[..., Any], args: Sequence[Any], what: str) -> Callable[..., Any]:
    """``fn`` captured now for the layout of ``args`` on their device's shared pool (:func:`capture_or_plain`); the
    caller checked :func:`graphable` and keeps the result."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    if dev.type == "cuda" and dev not in _POOLS:
        _POOLS[dev] = torch.cuda.graph_pool_handle()
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return capture_or_plain(fn, args, _POOLS.get(dev), what)
