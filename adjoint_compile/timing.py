"""Where compile time goes: a per-stage profile on each graph's record (``CompiledGraph.timing``).

While the pipeline runs on a graph, ``recording(timing)`` makes ``timing`` (a dict) the current record, and every
``stage(name)`` under it adds its ``time.perf_counter`` seconds to ``timing[f"{path}_s"]``, ``path`` being the
names of the enclosing stages joined by dots (``"capture"``, ``"capture.reroll"``, ``"recognize.find_residuals"``).
Outside a recording a stage costs one context-variable read and records nothing.

Compiles at run time (an inner-compiled partition on its first call, a shard program's forward on its first call,
its recompute + VJP program on the first backward) are counted by :func:`add_run_time`, which
:func:`~adjoint_compile.inner.compile_inner` calls: to the process-wide :data:`TOTALS`, and to the record of the
graph being run: :func:`call` makes it current while the graph's callable runs, and, for a backward that follows a
call that compiled something (or a graph's first call), while that backward runs (a pre-hook on the outputs'
autograd nodes, cleared at the end of the backward pass). Keys: ``f"inner.{what}_s"`` (seconds) and
``f"inner.{what}_n"`` (how many); ``what`` is ``whole_graph``, ``partitions``, ``shard_programs``, ``shard_vjps`` (a
shard's recompute + VJP compiled), ``loss_chunks`` (a loss chunk's value and gradient, traced and compiled, in the
forward) or ``vjp_traces`` (make_fx tracing the shard VJPs).

A leaf module (torch only), so the inner compiler, every pass and the runtime can use it. It also keeps one line
of dynamo's out of a DDP user's log (:class:`_DDPRecordFunctionNoise`).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["stage", "timed", "recording", "current", "add_run_time", "call", "summary", "TOTALS", "PASSES"]

#: the current record (a graph's ``timing`` dict) and the dotted path of the stages open in it
_record: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("adjoint_timing", default=None)
_path: contextvars.ContextVar[str] = contextvars.ContextVar("adjoint_timing_path", default="")
#: per thread: the record whose backward is running (set by an autograd pre-hook, cleared at the end of backward)
_backward: dict[int, dict[str, float]] = {}
#: process-wide run-time compile figures, keyed like a record's (``inner.partitions_s``, ``inner.partitions_n``)
TOTALS: dict[str, float] = {}
_count = [0]
_lock = threading.Lock()

#: the pipeline's top-level stages, in order (``summary`` shows these)
PASSES = ("copy", "capture", "recognize", "decide", "lower", "per_sample", "stitch")
#: run-time compile kinds, in the order ``summary`` shows them, with their names there
RUN_TIME = (("whole_graph", "whole graph"), ("partitions", "partitions"), ("shard_programs", "shard programs"),
            ("shard_vjps", "shard VJPs"), ("loss_chunks", "loss chunks"), ("vjp_traces", "VJP traces"))


def current() -> dict[str, float] | None:
    """The record stages add to now (None outside a recording)."""
    return _record.get()


@contextlib.contextmanager
def recording(timing: dict[str, float] | None = None) -> Iterator[dict[str, float]]:
    """Make ``timing`` (a new dict when None) the current record, with no stage open, and time the whole block
    as ``pipeline_s``."""
    timing = {} if timing is None else timing
    tokens = _record.set(timing), _path.set("")
    t0 = time.perf_counter()
    try:
        yield timing
    finally:
        timing["pipeline_s"] = timing.get("pipeline_s", 0.0) + time.perf_counter() - t0
        _path.reset(tokens[1])
        _record.reset(tokens[0])


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Add this block's seconds to the current record under the open stages' path + ``name`` (nested: fine)."""
    rec = _record.get()
    if rec is None:
        yield
        return
    parent = _path.get()
    path = f"{parent}.{name}" if parent else name
    token = _path.set(path)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _path.reset(token)
        key = f"{path}_s"
        rec[key] = rec.get(key, 0.0) + time.perf_counter() - t0


def add_run_time(what: str, seconds: float, count: bool = True) -> None:
    """Count one run-time compile (or trace) of kind ``what``: process-wide, and in the record of the graph being
    run or differentiated in this thread, if any. ``count=False``: add the seconds to the last one (a trace that
    belongs to the compile after it)."""
    with _lock:
        _count[0] += 1
        rec = _record.get()
        for rec in (TOTALS, rec if rec is not None else _backward.get(threading.get_ident())):
            if rec is not None:
                rec[f"inner.{what}_s"] = rec.get(f"inner.{what}_s", 0.0) + seconds
                rec[f"inner.{what}_n"] = rec.get(f"inner.{what}_n", 0) + int(count)


def call(record: dict[str, float], fn: Callable[..., Any], args: tuple, watch: bool = True) -> Any:
    """``fn(*args)`` with ``record`` current; when ``watch`` and this is its first call or the call compiled
    something, the backward through its outputs is accounted to ``record`` too. The first call's seconds (its
    compiles included) are ``record["first_call_s"]``."""
    first = "first_call_s" not in record
    before = _count[0]
    tokens = _record.set(record), _path.set("")
    t0 = time.perf_counter()
    try:
        out = fn(*args)
    finally:
        _path.reset(tokens[1])
        _record.reset(tokens[0])
    if first:
        record["first_call_s"] = time.perf_counter() - t0
    if watch and torch.is_grad_enabled() and (first or _count[0] != before):
        _watch_backward(record, out)
    return out


def _watch_backward(record: dict[str, float], out: Any) -> None:
    """Pre-hooks on the autograd nodes of ``out``'s tensors: while a backward through them runs (until the end of
    that backward pass), run-time compiles in its thread count to ``record``."""
    nodes = {id(t.grad_fn): t.grad_fn for t in (out if isinstance(out, (tuple, list)) else (out,))
             if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    if not nodes:
        return
    try:
        from torch._dynamo import compiled_autograd
        if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
            return  # NB: the hooks would be traced into a compiled backward: leave it as it is
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        pass

    def enter(grad_outputs: Any) -> None:
        if torch.compiler.is_compiling():
            return None  # NB: a backward traced by dynamo (``loss.backward()`` inside the compiled function)
        ident = threading.get_ident()
        if _backward.get(ident) is record:
            return None
        _backward[ident] = record

        def leave() -> None:
            if _backward.get(ident) is record:
                del _backward[ident]
        torch.autograd.Variable._execution_engine.queue_callback(leave)
        return None

    for n in nodes.values():
        n.register_prehook(enter)


def summary(timings: list[dict[str, float]]) -> str | None:
    """One line for these records together (a report's graphs): the backend's passes with the largest sub-stage
    of each, then the inner compiles by kind; None when none was timed."""
    tot: dict[str, float] = {}
    for t in timings:
        for k, v in t.items():
            tot[k] = tot.get(k, 0.0) + v
    if not any(f"{p}_s" in tot for p in PASSES) and not any(k.startswith("inner.") for k in tot):
        return None
    parts = []
    for p in PASSES:
        if f"{p}_s" not in tot:
            continue
        subs = [(v, k[len(p) + 1: -2]) for k, v in tot.items() if k.startswith(f"{p}.") and k.endswith("_s")
                and k.count(".") == 1]
        top = max(subs, default=None)
        parts.append(f"{p} {tot[p + '_s']:.3f}" + (f" ({top[1]} {top[0]:.3f})" if top and top[0] >= 0.001 else ""))
    line = f"passes {sum(tot.get(f'{p}_s', 0.0) for p in PASSES):.2f} s [{', '.join(parts)}]"
    kinds = [(name, tot[f"inner.{k}_n"], tot[f"inner.{k}_s"]) for k, name in RUN_TIME if f"inner.{k}_n" in tot]
    compiles = [(name, n, s) for name, n, s in kinds if name != "VJP traces"]
    if compiles:
        line += (f"; inner compiles {sum(n for _, n, _ in compiles):.0f}x {sum(s for _, _, s in compiles):.2f} s ["
                 + ", ".join(f"{name} {n:.0f}x {s:.2f}" for name, n, s in compiles) + "]")
    line += "".join(f"; shard VJP traces {n:.0f}x {s:.2f} s" for name, n, s in kinds if name == "VJP traces")
    if "check_forward_s" in tot:
        line += f"; first-call check {tot['check_forward_s']:.2f} s"
    if "check_forward_skipped_bytes" in tot:
        line += (f"; first-call check skipped (the graph as captured would hold "
                 f"{tot['check_forward_skipped_bytes'] / 2**20:.0f} MiB at once)")
    if "check_forward_unrunnable" in tot:
        line += "; first-call check skipped (the graph as captured does not run without autograd)"
    return line


def timed(name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` as stage ``name``."""
    with stage(name):
        return fn(*args, **kw)


class _DDPRecordFunctionNoise(logging.Filter):
    """Drops dynamo's "Profiler record function ... will be ignored" when the ``record_function`` is
    DistributedDataParallel's own (``DistributedDataParallel.forward`` opens one around every forward): every
    ``torch.compile`` of a DDP model logs it once per rank, about a profiler range the user never wrote and dynamo
    drops. A ``record_function`` in the user's own code still gets the warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Profiler record function") and _tracing_ddp_forward())


def _tracing_ddp_forward() -> bool:
    """Whether the innermost function dynamo is tracing now (the innermost instruction translator on the Python
    stack) is in torch.nn.parallel.distributed."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    except ImportError:  # pragma: no cover - another torch
        return False
    f = sys._getframe(1)
    while f is not None:
        tx = f.f_locals.get("self")
        if isinstance(tx, InstructionTranslatorBase):
            name = getattr(getattr(tx, "f_code", None), "co_filename", "")
            return name.endswith(os.path.join("nn", "parallel", "distributed.py"))
        f = f.f_back
    return False


_DYNAMO_CTX_LOG = logging.getLogger("torch._dynamo.variables.ctx_manager")
if not any(isinstance(f, _DDPRecordFunctionNoise) for f in _DYNAMO_CTX_LOG.filters):
    _DYNAMO_CTX_LOG.addFilter(_DDPRecordFunctionNoise())
