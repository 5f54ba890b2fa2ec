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

Graphs traced on fake tensors and run as they are (aot_eager's forwards and backwards, the shard VJPs and loss chunks
that make_fx traces, with "eager") run through :func:`stride_checked`: their first call checks each op's real strides
against the traced ones and copies a result into the traced strides where a fake kernel predicted others, so that a
view the trace recorded on those strides holds (instead of "view size is not compatible with input tensor's size and
stride", which plain aot_eager raises there).

A leaf module (it imports torch and the package's errors only), so every stage of the pipeline and every runtime can
use it without importing a later stage.  ``inner`` has been validated by :mod:`adjoint_compile.options` before it
gets here.
"""
from __future__ import annotations

import logging
import operator
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
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

__all__ = ["compile_inner", "COMPILE_LOCK", "stride_checked"]

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
            return _aot_eager(gm, example_inputs)
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
    return _aot_eager(gm, example_inputs)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """dynamo's aot_eager, its forward and backward graphs run by :func:`stride_checked` (as boxed calls)."""
    return lookup_backend("aot_eager")(gm, list(example_inputs), fw_compiler=_checked_nop, bw_compiler=_checked_nop)


def _checked_nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return stride_checked(gm, boxed=True)


def stride_checked(gm: fx.GraphModule, boxed: bool = False) -> Callable[..., Any]:
    """``gm``'s code, whose first call runs it node by node and, where an op's result has other strides than the
    fake value ``gm`` was traced with (``meta["val"]``), copies it into the traced strides and keeps that copy in the
    graph for the calls after it. ``boxed``: called with one list of arguments, which it empties (aot_autograd's
    boxed convention, as dynamo's ``boxed_nop``, which runs it from then on).

    NB: a graph traced on fake tensors bakes in choices made on their strides: a reshape became a view where they
    allowed one. Some ops' fake kernels (PyTorch decompositions) lay their result out otherwise than their real
    kernels when the inputs are laid out differently: elu_backward and softplus_backward follow the input where
    the real kernel follows the gradient, _log_softmax_backward_data the gradient where the real one follows the
    output. A view recorded after one of them fails at run time, plain aot_eager included. Coercing the result to
    the traced strides, as aot_autograd coerces tangents, makes every later choice hold; the values are the same."""
    done: list[Callable[..., Any]] = []
    # NB: one lock per program: the first call rewrites its graph, and may itself make the first call of another
    first = threading.RLock()

    def call(*args: Any) -> Any:
        if done:
            return done[0](args[0]) if boxed else done[0](*args)
        with first:
            if done:
                return call(*args)
            vals = list(args[0]) if boxed else list(args)
            if boxed:
                args[0].clear()  # NB: the boxed convention: the callee lets go of its inputs
            out, bad = _checked_run(gm, vals, boxed)
            _restride(gm, bad)
            if boxed:
                from torch._dynamo.backends.debugging import boxed_nop
                done.append(boxed_nop(gm, []))
            else:
                done.append(gm.forward)
            return out

    if boxed:
        return _boxed(call)
    return call


def _boxed(call: Callable[..., Any]) -> Callable[..., Any]:
    def run(args: list[Any]) -> Any:
        return call(args)
    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _checked_run(gm: fx.GraphModule, args: list[Any], boxed: bool) -> tuple[Any, dict[fx.Node, tuple[int, ...]]]:
    """``gm`` on ``args``, node by node, each result laid out as traced (:func:`_traced_strides`): (its result,
    per node whose result was copied, the strides it was copied into). ``boxed``: ``args`` let go of as read."""
    bad: dict[fx.Node, tuple[int, ...]] = {}

    class Checked(fx.Interpreter):
        def placeholder(self, target: Any, a: Any, kw: Any) -> Any:
            if not boxed:
                return super().placeholder(target, a, kw)
            # NB: each input held only until its last use, as the boxed code holds it (a backward's activations)
            i = next(self.args_iter)
            v, args[i] = args[i], None
            return v

        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            stride = _traced_strides(n, out)
            if stride is None:
                return out
            bad[n] = stride
            return _restrided(out, stride)

    return Checked(gm).run(*(range(len(args)) if boxed else args)), bad


def _traced_strides(n: fx.Node, out: Any) -> tuple[int, ...] | None:
    """The strides ``n`` was traced with where its result ``out`` (a new tensor, not a view or an input written in
    place) has others, in a dim of more than one element; else None."""
    v = n.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(v, torch.Tensor)) or n.op != "call_function":
        return None
    op = n.args[0].target if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n.target
    if not isinstance(op, torch._ops.OpOverload) or any(r.alias_info is not None for r in op._schema.returns):
        return None
    want = v.stride()
    if (out.layout != torch.strided or v.layout != torch.strided or out.numel() <= 1
            or not all(type(x) is int for x in (*v.shape, *want)) or tuple(out.shape) != tuple(v.shape)):
        return None  # NB: symbolic sizes (a graph for every length) are not checked
    if all(a == b or size == 1 for a, b, size in zip(out.stride(), want, v.shape)):
        return None
    return tuple(want) if _dense(tuple(v.shape), tuple(want)) else None


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays a tensor of ``shape`` out without gaps or overlaps (a permutation of the contiguous
    layout), one a copy can be written into."""
    step = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != step:
            return False
        step *= size
    return True


def _restrided(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``x`` copied into the (dense) strides ``stride``."""
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def _restride(gm: fx.GraphModule, bad: dict[fx.Node, tuple[int, ...]]) -> None:
    """After each node of ``bad``, its result copied into the strides given, for all its users."""
    for n, stride in bad.items():
        with gm.graph.inserting_after(n):
            r = gm.graph.call_function(_restrided, (n, stride))
        n.replace_all_uses_with(r, delete_user_cb=lambda u, r=r: u is not r)
        r.meta = dict(n.meta)
    if bad:
        log.debug("adjoint-compile: %d result(s) copied into their traced strides: %s", len(bad),
                  ", ".join(str(n.target) for n in bad))
        gm.recompile()


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
