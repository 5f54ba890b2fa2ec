"""The first-call forward check (option ``check_forward``, on by default): :class:`ForwardCheck` runs a rewritten
graph's first call next to the graph as captured (eagerly, without autograd) and falls back to that graph when their
outputs differ.

``verify=True`` for a whole graph: the gradients the rewritten graph gives against those of the graph as dynamo
captured it, under plain autograd, on the first call's inputs (the per-region figures are in :mod:`.sharded`).

Both runs get the same inputs (detached copies; the tensors that require grad keep requiring it) and the same random
cotangents (fp32 ``randn`` from ``torch.Generator().manual_seed(1)``, cast to each output), and every gradient is
compared as one vector: ``grad_rel_err`` = ‖g − g_exact‖ / ‖g_exact‖, ``grad_cosine``, and the worst tensor.
"""
from __future__ import annotations

import functools
import logging
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..analysis.fx import is_view_op, written_inputs
from ..errors import AdjointCompileWarning
from ..regions import Fallback
from .shard_parts import own_bytes

log = logging.getLogger(__name__)

__all__ = ["copy_graph_module", "compare_grads", "grads_of", "graph_fidelity", "ForwardCheck", "output_mismatch",
           "FORWARD_TOLERANCE", "forward_peak_bytes", "check_skipped"]

#: the first-call check runs the graph as captured, whose forward alone can hold far more than the rewritten step
#: (a language model's [B, T, V] logits at a long T): it is skipped when it would hold more than both of these
CHECK_MIN_BYTES = 256 * 2**20
CHECK_FACTOR = 4


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (node meta copied shallowly), for a pass to rewrite or to keep as is."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def grads_of(run: Callable[..., Any], args: Sequence[Any], named: dict[str, torch.Tensor] | None = None,
             seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of Σ ⟨output, cotangent⟩ (module docstring) of ``run(*args)``, the forward run from RNG state
    ``seed``: w.r.t. ``named`` (tensors ``args`` lead to), or when None w.r.t. detached copies of the ``args`` (all of
    them copied) that require grad (named ``input i``)."""
    if named is None:
        # NB: every tensor copied, integer ones too: a forward's in-place updates (a step counter) stay on the copy
        args = [x.detach().clone().requires_grad_(x.requires_grad and (x.is_floating_point() or x.is_complex()))
                if isinstance(x, torch.Tensor) else x for x in args]
        named = {f"input {i}": x for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        out = run(*args)
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        gen = torch.Generator().manual_seed(1)
        cots = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
        grads = torch.autograd.grad(outs, list(named.values()), cots, allow_unused=True) if outs and named else []
    return {n: g.detach() for n, g in zip(named, grads) if g is not None}


def compare_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``grad_rel_err``, ``grad_cosine`` (all tensors as one vector), ``worst`` / ``worst_rel_err`` (per tensor),
    ``tensors`` compared and ``missing`` (names with a gradient on one side only)."""
    names = [n for n in want if n in got]
    if not names:
        return {"grad_rel_err": 0.0, "grad_cosine": 1.0, "worst": "", "worst_rel_err": 0.0, "tensors": 0,
                "missing": sorted(set(want) ^ set(got))}
    def real(x: torch.Tensor) -> torch.Tensor:  # NB: a complex gradient as (real, imaginary) pairs, never its real part
        return torch.view_as_real(x.to(torch.complex128)) if x.is_complex() else x.double()

    a = torch.cat([real(got[n]).flatten().cpu() for n in names])
    b = torch.cat([real(want[n]).flatten().cpu() for n in names])
    rel = {n: float((real(got[n]) - real(want[n])).norm() / real(want[n]).norm().clamp_min(1e-30)) for n in names}
    worst = max(rel, key=rel.__getitem__)
    return {"grad_rel_err": float((a - b).norm() / b.norm().clamp_min(1e-30)),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "worst": worst, "worst_rel_err": rel[worst], "tensors": len(names),
            "missing": sorted(set(want) ^ set(got))}


def graph_fidelity(original: fx.GraphModule, rewritten: Callable[..., Any], args: Sequence[Any]) -> dict[str, Any]:
    """:func:`compare_grads` of ``rewritten`` against plain autograd of ``original`` on ``args``."""
    want = grads_of(original, args)
    got = grads_of(rewritten, args)
    return compare_grads(got, want)


#: largest ‖got − want‖ / ‖want‖ (each output as one vector) that the first-call check accepts, by dtype: rounding of
#: another summation order (the scan kernels, the inner compiler's fused kernels) stays orders of magnitude below,
#: a rewrite that computes something else lands near 1
FORWARD_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-3, torch.complex128: 1e-7, torch.complex64: 1e-3,
                     torch.bfloat16: 5e-2, torch.float16: 1e-2}


def least_precise_tolerance(gm: fx.GraphModule) -> float:
    """The loosest :data:`FORWARD_TOLERANCE` of the floating dtypes ``gm``'s values have, and autocast's now: an
    fp64 loss of a bf16 scan differs by bf16's rounding, not fp64's."""
    dtypes = {torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
    for n in gm.graph.nodes:
        for v in torch.utils._pytree.tree_leaves(n.meta.get("val", n.meta.get("example_value"))):
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                dtypes.add(v.dtype)
    return max((FORWARD_TOLERANCE.get(d, 1e-3) for d in dtypes), default=0.0)


def output_mismatch(got: Any, want: Any, floor: float = 0.0) -> dict[str, Any] | None:
    """None when the outputs agree (the same structure, shapes and dtypes; integers and bools equal; floating
    tensors within :data:`FORWARD_TOLERANCE` of their dtype or ``floor``, non-finite values in the same places),
    else the first difference: ``{"output": i, "what": ..., "rel_err": ...}``."""
    gl, wl = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    if len(gl) != len(wl):
        return {"output": None, "what": f"{len(gl)} outputs, the captured graph has {len(wl)}", "rel_err": None}
    for i, (g, w) in enumerate(zip(gl, wl)):
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor) or (g != w and not (g != g and w != w)):
                return {"output": i, "what": f"{g!r} instead of {w!r}", "rel_err": None}
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return {"output": i, "what": f"{tuple(g.shape)} {g.dtype} instead of {tuple(w.shape)} {w.dtype}",
                    "rel_err": None}
        g, w = g.detach(), w.detach()
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                return {"output": i, "what": "integer values differ", "rel_err": None}
            continue
        fin = torch.isfinite(w)
        if not torch.equal(fin, torch.isfinite(g)) or not torch.allclose(g[~fin], w[~fin], equal_nan=True):
            return {"output": i, "what": "non-finite values (nan, inf) in other places", "rel_err": None}
        gd, wd = g[fin].to(torch.complex128 if w.is_complex() else torch.float64), \
            w[fin].to(torch.complex128 if w.is_complex() else torch.float64)
        rel = float((gd - wd).norm() / wd.norm().clamp_min(1e-30)) if wd.numel() else 0.0
        if not rel <= max(FORWARD_TOLERANCE.get(w.dtype, 1e-3), floor):
            return {"output": i, "what": f"values differ (relative error {rel:.3g})", "rel_err": rel}
    return None


def forward_peak_bytes(gm: fx.GraphModule) -> int:
    """The most bytes a run of ``gm`` without autograd holds at once besides its inputs, from the nodes' example
    values: each value is allocated at its node and freed after its last use; a view allocates nothing. While a node
    runs, it may hold a temporary as large as its largest input (``cross_entropy``'s log-softmax of the logits)."""
    nodes = list(gm.graph.nodes)
    last = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    freed: dict[int, int] = {}
    live = peak = 0
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "call_method", "call_module"):
            v = n.meta.get("val", n.meta.get("example_value"))
            b = sum(own_bytes(x) for x in torch.utils._pytree.tree_leaves(v))
            live += b
            work = max((_size(a.meta.get("val", a.meta.get("example_value"))) for a in n.all_input_nodes), default=0)
            peak = max(peak, live + work)
            at = last.get(n, i)
            freed[at] = freed.get(at, 0) + b
        live -= freed.pop(i, 0)
    return peak


def _size(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def check_skipped(timing: dict[str, float], gm: fx.GraphModule, regions: Sequence[Any]) -> bool:
    """Whether the first-call check is skipped because the graph as captured (``gm``, concrete sizes) would hold more
    than :data:`CHECK_MIN_BYTES` and :data:`CHECK_FACTOR` times what the sharded ``regions`` hold
    (:func:`forward_peak_bytes`); never without a sharded region. Said in the log and in ``report()``'s timing line."""
    try:
        need = forward_peak_bytes(gm)
    except Exception:  # noqa: BLE001 - symbolic sizes or odd meta: the check runs as before
        log.debug("adjoint-compile: the first-call check's memory could not be estimated", exc_info=True)
        return False
    held = sum(r.details.get("expected_memory_bytes", {}).get("sharded", 0) for r in regions if r.rewrite != "none")
    # NB: nothing sharded (a re-rolled loop, per-example book-keeping): the step itself holds what the check holds
    if not held or need <= max(CHECK_MIN_BYTES, CHECK_FACTOR * held):
        return False
    timing["check_forward_skipped"] = 1.0
    timing["check_forward_skipped_bytes"] = float(need)
    log.info("adjoint-compile: first-call check skipped: the graph as captured would hold %.0f MiB at once without "
             "autograd, more than %dx the rewritten regions' %.0f MiB", need / 2**20, CHECK_FACTOR, held / 2**20)
    return True


#: functions that update tensor arguments inside the op, not by a visible in-place op: batch norm's running
#: statistics in training mode (``nn.BatchNorm1d``, ``InstanceNorm1d(track_running_stats=True)``)
_UPDATES_ARGS = frozenset({F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm,
                           torch.native_batch_norm, torch.fused_moving_avg_obs_fake_quant})
#: module buffers the check runs on private copies of (any op may update one inside it), up to this size in all
BUFFER_COPY_BYTES = 64 * 2**20


def written_placeholders(gm: fx.GraphModule) -> set[int]:
    """The positions of the graph's inputs that it writes into in place (a module buffer updated by the forward,
    running statistics updated by batch norm)."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    targets = [w.args[0] for w in written_inputs(gm.graph)[0]]
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _UPDATES_ARGS:
            targets += [a for a in (*n.args[1:], *n.kwargs.values()) if isinstance(a, fx.Node)]
    roots = set()
    for t in targets:
        while t.op != "placeholder" and t.args and isinstance(t.args[0], fx.Node) and is_view_op(t):
            t = t.args[0]
        roots.add(t)
    return {i for i, h in enumerate(holders) if h in roots}


class ForwardCheck:
    """The callable of a rewritten graph while its first call has not run: that call also runs ``reference`` (the
    graph as captured, eager, under ``no_grad``, from the same RNG state, with private copies of the inputs it writes
    into and of the module buffers, so that module state is updated once) and compares the outputs. On a difference
    it warns (naming ``regions``), records a :class:`Fallback` in ``fallbacks``, puts back the inputs the graph writes
    into, and this call and every later one run ``fallback(reference, args)`` (the captured graph, inner-compiled)."""

    def __init__(self, fn: Callable[..., Any], reference: fx.GraphModule,
                 fallback: Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]],
                 regions: str, fallbacks: list[Fallback], timing: dict[str, float]) -> None:
        self.fn, self._reference, self._fallback = fn, reference, fallback
        self._regions, self._fallbacks, self._timing = regions, fallbacks, timing
        self._written = written_placeholders(reference)
        self._static = [i for i, h in enumerate(n for n in reference.graph.nodes if n.op == "placeholder")
                        if "_dynamo_static_input_type" in (h.meta.get("tensor_dict") or {})]
        self._checked = False

    def _buffers(self, args: Sequence[Any]) -> set[int]:
        """Module buffers among ``args`` (static inputs that are not parameters), the first up to
        :data:`BUFFER_COPY_BYTES`: an op the check does not know may update one inside it."""
        out, total = set(), 0
        for i in self._static:
            if isinstance(a := args[i], torch.Tensor) and not isinstance(a, torch.nn.Parameter):
                total += a.numel() * a.element_size()
                if total > BUFFER_COPY_BYTES:
                    break
                out.add(i)
        return out

    def __call__(self, *args: Any) -> Any:
        if self._checked:
            return self.fn(*args)
        self._checked = True
        reference, self._reference = self._reference, None  # NB: one check; the copy is not kept alive
        saved = {i: args[i].detach().clone() for i in self._written | self._buffers(args)
                 if isinstance(args[i], torch.Tensor)}
        ref_args = [saved[i].clone() if i in saved else a for i, a in enumerate(args)]
        rng = torch.get_rng_state()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                want = reference(*ref_args)
        except RuntimeError as e:
            # NB: the graph as captured may not run without autograd (a hook registered on an intermediate tensor);
            # the check needs no_grad (with autograd it would hold what the rewrite saves): unchecked, said in report
            self._timing["check_forward_unrunnable"] = 1.0
            log.info("adjoint-compile: first-call check skipped: the graph as captured does not run without "
                     "autograd (%s)", e)
            torch.set_rng_state(rng)
            return self.fn(*args)
        self._timing["check_forward_s"] = time.perf_counter() - t0
        torch.set_rng_state(rng)
        got = self.fn(*args)
        bad = output_mismatch(got, want, least_precise_tolerance(reference))
        if bad is None:
            return got
        cause = (f"the rewritten graph's forward differs from the graph as captured on its first call: output "
                 f"{bad['output']}: {bad['what']}")
        remedy = ("it runs with the inner compiler and ordinary autograd from now on (no memory saved); please report "
                  "the model (adjoint_compile.explain shows what was rewritten); options={'check_forward': False} "
                  "switches the check off")
        self._fallbacks.append(Fallback(cause, remedy, {"regions": self._regions, **bad}))
        warnings.warn(AdjointCompileWarning(f"adjoint-compile: {cause} (rewritten: {self._regions}); {remedy}"),
                      stacklevel=2)
        log.warning("adjoint-compile: %s (rewritten: %s); falling back", cause, self._regions)
        self.fn = self._fallback(reference, args)
        with torch.no_grad():
            for i, x in saved.items():
                args[i].copy_(x)
        torch.set_rng_state(rng)
        return self.fn(*args)


#: why verify=True leaves a graph's (or a model's) gradients uncompared with plain autograd's
DRAWS_RANDOM = ("it draws random numbers (dropout), which the rewrite draws differently from plain autograd; each "
                "rewritten region's own check compares its gradients with the same numbers")


def parameters_of(fn: Any) -> dict[str, torch.Tensor]:
    """The parameters of ``fn`` (a module), or of the modules a function reaches by name (:func:`modules_of`)."""
    if isinstance(fn, torch.nn.Module):
        return dict(fn.named_parameters())
    params: dict[str, torch.Tensor] = {}
    for name, m in modules_of(fn).items():
        params.update({f"{name}.{n}": p for n, p in m.named_parameters() if all(p is not q for q in params.values())})
    return params


def modules_of(fn: Any) -> dict[str, torch.nn.Module]:
    """``fn`` itself when a module, else the modules it reaches by name: its bound ``self``, a
    ``functools.partial``'s arguments, its closure and the globals its code (and the code nested in it) reads."""
    if isinstance(fn, torch.nn.Module):
        return {"": fn}
    found: dict[str, Any] = {}
    if isinstance(fn, functools.partial):
        found.update({f"partial arg {i}": a for i, a in enumerate(fn.args)})
        found.update({f"partial {k}": v for k, v in fn.keywords.items()})
        fn = fn.func
    found["self"] = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or ())
        found.update({name: c.cell_contents for name, c in cells if _filled(c)})
        todo, globs = [code], getattr(fn, "__globals__", {})
        while todo:
            c = todo.pop()
            found.update({n: globs[n] for n in c.co_names if n in globs and n not in found})
            todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return {name: m for name, m in found.items() if isinstance(m, torch.nn.Module)}


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # NB: a closure variable not assigned yet
        return False
    return True
