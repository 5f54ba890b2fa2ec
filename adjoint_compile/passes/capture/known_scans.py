"""Known scan implementations: a custom ``autograd.Function`` (or function) that computes a linear recurrence its
own way is replaced by one ``linear_scan`` node, after a check that it computes the same thing.

Libraries write h_t = a_t ⊙ h_{t-1} + b_t as a Blelloch scan inside an ``autograd.Function`` with a hand-written
backward (mambapy's ``PScan``). Dynamo keeps such a Function as one
``torch.ops.higher_order.autograd_function_apply(fwd_body, bwd_body, *operands, ...)`` node whose sub-graphs are
in-place index arithmetic: nothing a matcher can read as a recurrence, and nothing to shard. This pass looks the
Function up in a registry of known implementations instead:

* identity: dynamo keeps the Function's class nowhere on the node, but every node of ``fwd_body`` has a
  ``stack_trace`` whose frame after torch's ``autograd_function.py`` is the Function's ``forward``; an entry matches
  when that frame lies in the code of its class's ``forward`` (file and line range). A plain function matches by
  its ``module.qualname`` as a ``call_function`` node: dynamo would inline it, so :func:`register_scan` keeps it
  whole (``torch.compiler.allow_in_graph``) and :func:`unregister_scan` releases it.
* adapter: :class:`ScanAdapter` says which operands are a, b and h0, the step dim, the direction and which output
  is h; the node becomes ``linear_scan(a, b, h0, dim, reverse)`` with provenance
  ``{"pass": "known_scans", "source": "registered_scan", "region": <node name>, "implementation": <entry>}``.
* never guess: before an entry is used on a node it is checked against that node's own code, eagerly, on random
  inputs of the node's shapes and dtypes (a in (0, 1), b and h0 normal; a private generator, so the user's RNG
  is untouched): the original (its forward and its own backward) and the adapter's ``linear_scan`` must agree in
  value and in the VJP of a random cotangent. If they do not, the node stays, a warning names the entry, and
  ``meta["adjoint_compile"]["not_recognized"]`` says why (recognition reports it as a rejection).

An unknown ``autograd.Function`` also gets ``not_recognized`` on its node (naming the Function), so ``explain()``
says why it keeps ordinary autograd. Part of the capture stage (passes/capture/), run before the reroll pass.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import operator
import os
import re
import sys
import warnings
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import example_value, stable_toposort
from ...regions import PROVENANCE
from .batching import Emitter, Unproven, scan_op

log = logging.getLogger(__name__)

__all__ = ["ScanAdapter", "register_scan", "unregister_scan", "registered_scans", "replace_known_scans",
           "is_autograd_function"]

SOURCE = "registered_scan"


@dataclasses.dataclass(frozen=True)
class ScanAdapter:
    """How a scan implementation's operands map to ``linear_scan(a, b, h0, dim=dim, reverse=reverse)``.

    ``a``, ``b``, ``h0``: positions among the Function's operands (``Function.apply(*operands)``); ``h0=None``:
    the scan starts from zeros. ``output``: which of the Function's outputs is h (all steps, the operands' shape).
    """

    a: int
    b: int
    h0: int | None = None
    dim: int = 1
    reverse: bool = False
    output: int = 0


@dataclasses.dataclass
class _Entry:
    name: str
    adapter: ScanAdapter
    #: the class (or function) itself when registered by object; else resolved from ``name`` when its module is
    #: imported (never imported by this pass).
    obj: Any = None
    #: the plain function that this registry made dynamo keep whole (``torch.compiler.allow_in_graph``), to be
    #: released by :func:`unregister_scan`; None when it did not.
    kept: Any = None


#: qualified name -> entry. Built in: mambapy's Blelloch scan, H[t] = A[t] * H[t-1] + X[t] along dim 1, H[-1] = 0.
_REGISTRY: dict[str, _Entry] = {
    "mambapy.pscan.PScan": _Entry("mambapy.pscan.PScan", ScanAdapter(a=0, b=1, dim=1)),
}


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def register_scan(impl: str | type | Any, adapter: ScanAdapter) -> None:
    """Register a scan implementation: an ``autograd.Function`` subclass or a plain Python function (the object, or
    its qualified name ``"package.module.Class"``), with the :class:`ScanAdapter` that maps its operands to
    ``linear_scan``. Replaces an entry of the same name. Each use is checked against the original first.

    Dynamo inlines a plain function (its call never reaches the graph, so no entry could match it): registering
    one keeps its calls whole, as ``torch.compiler.allow_in_graph(fn)`` does, for every ``torch.compile`` from
    then on (graphs compiled before keep it inlined until ``torch._dynamo.reset()``); :func:`unregister_scan` lets
    dynamo inline it again. Its body must then trace under AOTAutograd where a check fails and the call stays
    (no data-dependent Python control flow). Registered by name before its module is imported, it is kept whole
    from the first compile after that import, with a warning.

    Raises:
        TypeError: ``adapter`` is not a :class:`ScanAdapter`, or ``impl`` is neither a name, an
            ``autograd.Function`` subclass nor a plain Python function (a bound method, a ``functools.partial``,
            a module or another callable object: register a plain function that calls it instead).
    """
    if not isinstance(adapter, ScanAdapter):
        raise TypeError(f"adapter must be an adjoint_compile.ScanAdapter, not {type(adapter).__name__}")
    if not isinstance(impl, str) and not _is_function_class(impl) and not inspect.isfunction(impl):
        raise TypeError(f"register_scan takes an autograd.Function subclass or a plain Python function (or its "
                        f"qualified name), not {type(impl).__name__} {impl!r}: register a plain function that "
                        f"calls it, and call that function in the model")
    name, obj = (impl, None) if isinstance(impl, str) else (_qualname(impl), impl)
    unregister_scan(name)  # NB: releases a function the entry it replaces kept whole
    entry = _REGISTRY[name] = _Entry(name, adapter, obj)
    fn = obj if obj is not None else _resolve(name)
    if inspect.isfunction(fn):
        _keep_whole(entry, fn)


def unregister_scan(impl: str | type | Any) -> None:
    """Remove an entry (by object or qualified name); no error if there is none. A plain function that the entry
    kept whole is inlined by dynamo again (in graphs compiled after ``torch._dynamo.reset()``)."""
    e = _REGISTRY.pop(impl if isinstance(impl, str) else _qualname(impl), None)
    if e is not None and e.kept is not None:
        try:
            from torch._dynamo import trace_rules

            trace_rules._allowed_callable_ids.remove(id(e.kept))
        except Exception:  # noqa: BLE001 - a torch without this registry: the function stays whole
            log.debug("known_scans: could not release %s from allow_in_graph", e.name, exc_info=True)


def _is_function_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, torch.autograd.Function)


def _allowed_in_graph(fn: Any) -> bool:
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.is_callable_allowed(fn))
    except Exception:  # noqa: BLE001 - unknown to this torch: treat as not kept whole
        return False


def _keep_whole(entry: _Entry, fn: Any) -> None:
    """Make dynamo keep ``fn``'s calls as one ``call_function`` node (it inlines a plain function otherwise)."""
    if _allowed_in_graph(fn):  # NB: the user's own allow_in_graph: theirs to undo
        return
    torch.compiler.allow_in_graph(fn)
    entry.kept = fn
    log.debug("known_scans: %s is kept whole in dynamo's graphs (torch.compiler.allow_in_graph)", entry.name)


def _keep_resolved_functions() -> None:
    """Entries registered by name before their module was imported: a plain function found now is kept whole from
    the next compile on; the graphs traced until now have it inlined (warned once)."""
    for e in list(_REGISTRY.values()):
        if e.obj is not None or e.kept is not None:
            continue
        fn = _resolve(e.name)
        if inspect.isfunction(fn) and not _allowed_in_graph(fn):
            _keep_whole(e, fn)
            warnings.warn(f"adjoint-compile: registered scan {e.name} is a plain function, which dynamo inlines: "
                          f"registered by name before its module was imported, it was inlined in the graphs traced "
                          f"so far (they keep ordinary autograd for it); it is kept whole (torch.compiler."
                          f"allow_in_graph) from the next compile on: call torch._dynamo.reset() to compile again, "
                          f"or register the function object itself before compiling", stacklevel=3)


def registered_scans() -> dict[str, ScanAdapter]:
    """The registry: qualified name -> adapter."""
    return {k: e.adapter for k, e in _REGISTRY.items()}


# ----------------------------------------------------------------------------------------------------------------
# which implementation a node is


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def is_autograd_function(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator) and \
        t.name() == "autograd_function_apply"


def _sub(gm: fx.GraphModule, ref: Any) -> fx.GraphModule | None:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        sub: Any = gm
        for part in str(ref.target).split("."):
            sub = getattr(sub, part, None)
        return sub if isinstance(sub, fx.GraphModule) else None
    return None


def _forward_frame(gm: fx.GraphModule, node: fx.Node) -> tuple[str, int] | None:
    """(file, line) of the Function's ``forward`` that traced ``node``'s forward sub-graph."""
    sub = _sub(gm, node.args[0]) if node.args else None
    for n in sub.graph.nodes if sub is not None else []:
        frames = _FRAME.findall(n.meta.get("stack_trace") or "")
        for k, (file, _, _) in enumerate(frames[:-1]):
            if file.replace(os.sep, "/").endswith("torch/_functorch/autograd_function.py"):
                return frames[k + 1][0], int(frames[k + 1][1])
    return None


def _code_holds(fn: Any, frame: tuple[str, int]) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    return _same_file(code.co_filename, frame[0]) and code.co_firstlineno <= frame[1] <= max(lines, default=0)


def _same_file(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _resolve(name: str) -> Any:
    """The object named ``name`` if its module is already imported (this pass imports nothing)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            obj: Any = mod
            for p in parts[i:]:
                obj = getattr(obj, p, None)
            return obj
    return None


def _function_named_at(frame: tuple[str, int]) -> str | None:
    """The qualified name of the imported ``autograd.Function`` whose forward holds ``frame`` (for reports)."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f or not _same_file(f, frame[0]):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and \
                    _code_holds(getattr(obj, "forward", None), frame):
                return _qualname(obj)
    return None


def _match(gm: fx.GraphModule, node: fx.Node) -> tuple[_Entry | None, str]:
    """(the registry entry for ``node``, the implementation's name for reports); (None, name) when unknown."""
    try:
        return _lookup(gm, node)
    except Exception as e:  # noqa: BLE001 - capture never raises: an unreadable call is an unknown one
        log.debug("known_scans: looking up %s failed", node.name, exc_info=True)
        return None, f"(not identified: {type(e).__name__}: {e})"


def _lookup(gm: fx.GraphModule, node: fx.Node) -> tuple[_Entry | None, str]:
    if is_autograd_function(node):
        frame = _forward_frame(gm, node)
        if frame is None:
            return None, "an autograd.Function (its forward's source location is not recorded)"
        for e in _REGISTRY.values():
            cls = e.obj if e.obj is not None else _resolve(e.name)
            if isinstance(cls, type) and _code_holds(getattr(cls, "forward", None), frame):
                return e, e.name
        return None, _function_named_at(frame) or f"the autograd.Function whose forward is at {frame[0]}:{frame[1]}"
    t = node.target
    name = _qualname(t) if hasattr(t, "__module__") and hasattr(t, "__qualname__") else None
    e = _REGISTRY.get(name) if name else None
    return (e, e.name) if e is not None and (e.obj is None or e.obj is t) else (None, name or "")


# ----------------------------------------------------------------------------------------------------------------
# the check: the original against the adapter, eagerly, on random inputs of the node's shapes


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 3e-2)


def _rel(x: torch.Tensor | None, y: torch.Tensor | None, like: torch.Tensor) -> float:
    x = torch.zeros_like(like) if x is None else x
    y = torch.zeros_like(like) if y is None else y
    x, y = x.detach().double(), y.detach().double()
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) if y.numel() else 0.0


def _run_original(gm: fx.GraphModule, node: fx.Node, ins: list[Any], output: int) -> torch.Tensor:
    if is_autograd_function(node):
        out = node.target(_sub(gm, node.args[0]), _sub(gm, node.args[1]), *ins, **node.kwargs)
    else:
        out = node.target(*ins, **node.kwargs)
    return out[output] if isinstance(out, (tuple, list)) else out


def _random(evs: list[Any], gen: torch.Generator, unit: set[int]) -> list[Any]:
    """Inputs like the example values: uniform in (0.01, 0.99) at the positions in ``unit``, normal elsewhere."""
    out: list[Any] = []
    for i, ev in enumerate(evs):
        if not isinstance(ev, torch.Tensor):
            out.append(ev)
            continue
        shape, dt = tuple(ev.shape), ev.dtype if ev.dtype.is_floating_point else torch.float64
        x = torch.rand(shape, generator=gen, dtype=dt) * 0.98 + 0.01 if i in unit else \
            torch.randn(shape, generator=gen, dtype=dt)
        out.append(x.to(device=ev.device, dtype=ev.dtype).requires_grad_(ev.dtype.is_floating_point))
    return out


def _bind(gm: fx.GraphModule, node: fx.Node, entry: _Entry, evs: list[Any]) -> list[int]:
    """For each positional argument of the Function's ``forward`` (after ctx), the index of the operand of dynamo's
    call that it is.

    NB: dynamo lists an autograd.Function's operands in the order its forward first uses them, not in the order
    of ``apply``'s arguments. The binding is the arrangement of the operands for which the Function's own
    ``apply`` reproduces the call's output (identity first); a wrong one could only fail the adapter's check.
    """
    if not is_autograd_function(node):
        return list(range(len(evs)))
    cls = entry.obj if entry.obj is not None else _resolve(entry.name)
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        raise Unproven(f"the signature of {entry.name}.forward is not readable") from None
    # NB: the tensors only: with symbolic sizes dynamo lifts the sizes the forward reads into the call's operands
    # (numbers once the graph is specialized); the Function's own apply does not take them
    tix = [i for i, ev in enumerate(evs) if isinstance(ev, torch.Tensor)]
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) or len(params) != len(tix):
        raise Unproven(f"{entry.name}.forward takes {len(params)} argument(s) after ctx, dynamo's call has "
                       f"{len(tix)} tensor operand(s)")
    if len(tix) > 5:
        raise Unproven(f"{len(tix)} operands: too many to bind to {entry.name}.forward's arguments")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    ins = _random(evs, torch.Generator().manual_seed(1), set(range(len(evs))))
    with unset_fake_temporarily(), torch.no_grad():
        want = _run_original(gm, node, ins, entry.adapter.output)
        for perm in itertools.permutations(tix):
            try:
                got = cls.apply(*[ins[i] for i in perm])
                got = got[entry.adapter.output] if isinstance(got, (tuple, list)) else got
                if got.shape == want.shape and _rel(got, want, want) <= _tolerance(want.dtype):
                    return list(perm)
            except Exception:  # noqa: BLE001,S112 - an arrangement forward refuses is not the binding
                continue
    raise Unproven(f"no arrangement of the call's operands as {entry.name}.forward's arguments reproduces it")


def check(gm: fx.GraphModule, node: fx.Node, perm: list[int], adapter: ScanAdapter) -> str | None:
    """None when the original and the adapter agree (values and VJP) on random inputs of the node's shapes; else
    what differs. ``perm``: positional argument -> operand of the call (:func:`_bind`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ...ops import linear_scan

    evs = [example_value(o) if isinstance(o, fx.Node) else o for o in _operands(node)]
    gen = torch.Generator().manual_seed(0)
    ins = _random(evs, gen, {perm[adapter.a]})
    pos = [ins[i] for i in perm]
    diff = [x for x in ins if isinstance(x, torch.Tensor) and x.requires_grad]
    with unset_fake_temporarily(), torch.enable_grad():
        h0 = pos[adapter.h0] if adapter.h0 is not None else None
        want = _run_original(gm, node, ins, adapter.output)
        got = linear_scan(pos[adapter.a], pos[adapter.b], h0, dim=adapter.dim, reverse=adapter.reverse)
        if want.shape != got.shape or want.dtype != got.dtype:
            return f"the original gives {want.dtype} {list(want.shape)}, the adapter {got.dtype} {list(got.shape)}"
        tol = _tolerance(want.dtype)
        if (err := _rel(got, want, want)) > tol:
            return f"values differ (rel. error {err:.2e} > {tol:.0e})"
        g = torch.randn(tuple(want.shape), generator=gen, dtype=want.dtype).to(want.device)
        gw = torch.autograd.grad(want, diff, g, allow_unused=True)
        gg = torch.autograd.grad(got, diff, g, allow_unused=True)
    for x, a, b in zip(diff, gg, gw):
        if (err := _rel(a, b, x)) > tol:
            k = next(k for k, y in enumerate(pos) if y is x)
            return f"the gradient of argument {k} differs (rel. error {err:.2e} > {tol:.0e})"
    return None


# ----------------------------------------------------------------------------------------------------------------
# the pass


def _operands(node: fx.Node) -> list[Any]:
    return list(node.args[2:]) if is_autograd_function(node) else list(node.args)


def _replace(gm: fx.GraphModule, node: fx.Node, entry: _Entry) -> fx.Node:
    ad, ops = entry.adapter, _operands(node)
    if node.kwargs and not is_autograd_function(node):
        raise Unproven(f"the call has keyword arguments {sorted(node.kwargs)}")
    idx = [i for i in (ad.a, ad.b, ad.h0) if i is not None]
    if any(not 0 <= i < len(ops) for i in idx):
        raise Unproven(f"the adapter names arguments {idx}, the call has {len(ops)} operand(s)")
    users = list(node.users)
    tuple_out = isinstance(example_value(node), (tuple, list))
    if tuple_out and any(u.target is not operator.getitem or u.args[1] != ad.output for u in users):
        raise Unproven(f"outputs other than h (output {ad.output}) are used")
    perm = _bind(gm, node, entry, [example_value(o) if isinstance(o, fx.Node) else o for o in ops])
    pos = [ops[i] for i in perm]
    if any(not isinstance(pos[i], fx.Node) for i in idx):
        raise Unproven("an argument the adapter names is not a tensor in the graph")
    like = example_value(users[0] if tuple_out and users else node)
    a, b = example_value(pos[ad.a]), example_value(pos[ad.b])
    if not isinstance(like, torch.Tensor) or tuple(a.shape) != tuple(b.shape) or tuple(a.shape) != tuple(like.shape):
        raise Unproven("a, b and h do not have one shape")
    why = check(gm, node, perm, ad)
    if why is not None:
        raise Unproven(f"the adapter disagrees with the original: {why}")
    # NB: reported as e.g. "PScan(autograd_function_apply_1)": the implementation and the call it replaced
    region = f"{entry.name.rsplit('.', 1)[-1]}({node.name})"
    prov = {"pass": "known_scans", "source": SOURCE, "region": region, "implementation": entry.name}
    em = Emitter(gm, prov, at=node)
    H = em(scan_op(), (pos[ad.a], pos[ad.b], pos[ad.h0] if ad.h0 is not None else None, ad.dim, ad.reverse,
                       None, None))
    for u in users if tuple_out else [node]:
        u.replace_all_uses_with(H)
    for u in users if tuple_out else []:
        gm.graph.erase_node(u)
    subs = [s for s in node.args[:2] if is_autograd_function(node)]
    gm.graph.erase_node(node)
    for s in subs:
        if isinstance(s, fx.Node) and not s.users:
            gm.graph.erase_node(s)
    return H


def has_known_scans(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls a registered scan implementation (looked up, not checked). NB: a graph with symbolic
    sizes is not normalized, so its recognition cannot see these; a specialization's capture replaces them."""
    return any(_match(gm, n)[0] is not None for n in gm.graph.nodes
               if is_autograd_function(n) or n.op == "call_function" and _REGISTRY)


def replace_known_scans(gm: fx.GraphModule) -> list[str]:
    """Replace each call of a registered scan implementation by a checked ``linear_scan`` node (in place); return
    the new nodes' names. Calls that are unknown, or whose check fails, stay and say why on the node."""
    _keep_resolved_functions()
    todo = [n for n in gm.graph.nodes if is_autograd_function(n) or (
        n.op == "call_function" and _REGISTRY and _match(gm, n)[0] is not None)]
    if not todo or scan_op() is None:
        return []
    made: list[str] = []
    for node in todo:
        entry, name = _match(gm, node)
        if entry is None:
            # NB: most custom Functions are not scans (a clamped sqrt's gradient): the reason does not say it is one
            _refuse(node, name, f"custom autograd.Function {name} runs its own forward and backward, not read inside "
                               f"(ordinary autograd); if it computes a linear scan, adjoint_compile.register_scan "
                               f"lets it be sharded")
            continue
        try:
            made.append(_replace(gm, node, entry).name)
        except Exception as e:  # noqa: BLE001 - an entry that cannot be proven on this call is not used
            detail = str(e) if isinstance(e, Unproven) else f"{type(e).__name__}: {e}"
            why = f"registered scan {entry.name} not used: {detail}; it keeps ordinary autograd"
            warnings.warn(f"adjoint-compile: {why}", stacklevel=2)
            _refuse(node, name, why)
            continue
        log.info("known_scans: %s (%s) -> linear_scan %s", node.name, entry.name, made[-1])
    if made:
        stable_toposort(gm.graph)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return made


def _refuse(node: fx.Node, name: str, why: str) -> None:
    log.info("known_scans: %s keeps its form: %s", node.name, why)
    node.meta[PROVENANCE] = {**node.meta.get(PROVENANCE, {}), "pass": "known_scans", "implementation": name,
                             "not_recognized": why}
