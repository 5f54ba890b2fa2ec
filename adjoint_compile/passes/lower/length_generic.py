"""Lower once for every length: the regions lowered in a graph specialized to one call's sizes, put back into the
graph with symbolic sizes that dynamo captured, so that one compiled graph serves every sequence length.

Before (dynamo's graph with a symbolic length ``s27``, and the same graph specialized to T₀ = 256 and lowered)::

    x: f32[2, s27, 16]                    x: f32[2, 256, 16]
    u = norm(x); a = ...; b = ...         adjoint_region_0 = ShardedRegion(norm ... linear_scan ... mean)
    h = linear_scan(a, b)                 loss = adjoint_region_0(x, W, ...)
    y = h.view(2, s27, 4, 16) ...
    loss = y.mean()

After (the symbolic graph)::

    x: f32[2, s27, 16]
    loss = adjoint_region_0(x, W, ...)    # LengthGenericRegion: the T₀ region, retargeted per call's T

The region's nodes are found in the symbolic graph by name. Anything that does not match (normalization made or
dropped nodes in the region, a member reads a value that is neither a member, a region input nor a size) leaves the
symbolic graph alone and says why; the caller then specializes per length. The partitions between region calls
are compiled for symbolic sizes (passes/stitch/), once.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ...analysis.fx import eliminate_dead_code
from ...analysis.fx import example_value as _ev
from ...analysis.fx import stable_toposort
from ...analysis.step_literals import SHAPE_ARG_METHODS
from ...regions import PROVENANCE
from ...runtime.length_generic import LengthGenericRegion
from ...runtime.sharded import ShardedRegion

log = logging.getLogger(__name__)

__all__ = ["generalize"]


def _is_size(n: fx.Node) -> bool:
    return not isinstance(_ev(n), torch.Tensor)


def _length_symbols(inputs: list[fx.Node], dims: list[int | None]) -> set:
    """The symbols of the region's length: those of its inputs' symbolic sizes along their step dims."""
    out: set = set()
    for x, d in zip(inputs, dims):
        v = _ev(x)
        if d is not None and isinstance(v, torch.Tensor) and isinstance(v.shape[d], torch.SymInt):
            out |= v.shape[d].node.expr.free_symbols
    return out


def _members(outputs: list[fx.Node], inputs: list[fx.Node], named: set[fx.Node]) -> set[fx.Node] | str:
    """The nodes of the captured graph that compute the region's ``outputs`` from its ``inputs``: everything the
    outputs read, back to the inputs, or why not (a string). Capture passes may have rewritten some of them before
    lowering (a token shift written with ``cat`` became one ``shift_steps``): the region's outputs, as functions of
    its inputs, are the same either way. A size is a member only where the lowered region computed it (``named``);
    any other is read from outside (:func:`_size_read`)."""
    seen, todo, ins = set(), list(outputs), set(inputs)
    while todo:
        n = todo.pop()
        if n in seen or n in ins:
            continue
        if n.op in ("placeholder", "get_attr"):
            return f"its outputs read {n.name}, which the lowered region does not take in"
        seen.add(n)
        todo += [a for a in n.all_input_nodes if not _is_size(a) or a in named]
    return seen


def _shared_with_other_dims(inputs: list[fx.Node], dims: list[int | None], steps: set) -> str:
    """Why the length's symbol cannot tell the length from another size ("" when it can): dynamo gives sizes that
    were equal at its first call one symbol (a batch of 3 sequences of 3 steps), and a region reading that symbol
    at another dim would have it rewritten as the length, or kept, where the two sizes later differ."""
    for x, d in zip(inputs, dims):
        v = _ev(x)
        if not isinstance(v, torch.Tensor):
            continue
        for k, size in enumerate(v.shape):
            if k != d and isinstance(size, torch.SymInt) and size.node.expr.free_symbols & steps:
                return (f"input {x.name}'s dim {k} has the length's symbol ({size}): sizes equal at the first call "
                        f"share it")
    return ""


def _length_stop(m: fx.Node, a: fx.Node, steps: set) -> int | None:
    """The position in ``m``'s index of the one slice whose stop is the size ``a``, when ``a`` is the length itself
    and ``m`` is ``x[..., :T]`` (a causal conv's cut, ``conv1d(x, padding=p)[..., :T]``), else None: the lowered
    region holds T₀ there, which :func:`~adjoint_compile.runtime.length_generic.retarget` rewrites per call."""
    if not (m.op == "call_function" and m.target is operator.getitem and len(m.args) == 2 and m.args[0] is not a):
        return None
    v, idx = _ev(a), m.args[1]
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if not (isinstance(v, torch.SymInt) and v.node.expr in steps):
        return None
    at = [j for j, i in enumerate(items) if isinstance(i, slice) and i.stop is a]
    others = [x for j, i in enumerate(items) for x in ((i.start, i.step) if isinstance(i, slice) and j in at else
                                                        (i.start, i.stop, i.step) if isinstance(i, slice) else (i,))]
    return at[0] if len(at) == 1 and a not in others else None


def _size_read(m: fx.Node, a: fx.Node, steps: set, pinned: set) -> str:
    """Why member ``m``'s read of the size ``a`` (a value from outside the region) would be wrong at another length
    ("" when it is not). The region is lowered at one call's sizes, and only its length at a step position of a shape
    argument is rewritten per call (runtime/length_generic.retarget): any other size would stay at the lowered
    call's value. A size other than the length (a batch size in ``reshape(B, T, -1)``) is added to ``pinned``: the
    graph serves the calls where it is the same; the length read as a number (``b / T``) cannot be served so."""
    v = _ev(a)
    if not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ""
    free = v.node.expr.free_symbols
    if isinstance(v, torch.SymInt) and free <= steps and _in_shape_argument(m, a):
        return ""
    if free & steps:
        return f"member {m.name} reads the length as a number ({a.name} = {v}), which a region lowered at one length keeps"
    pinned |= free
    return ""


def _in_shape_argument(m: fx.Node, a: fx.Node) -> bool:
    """Whether ``a`` is read by ``m`` only inside the shape argument of a view/reshape/expand."""
    if m.op == "call_method" and m.target in SHAPE_ARG_METHODS:
        shape = m.args[1:]
    elif m.op == "call_function" and m.target in (torch.reshape, torch.broadcast_to) and len(m.args) > 1:
        shape = m.args[1:2]
    else:
        return False
    flat = [x for s in shape for x in (s if isinstance(s, (list, tuple)) else (s,))]
    return a in flat and a is not m.args[0] and not any(a in n.all_input_nodes for n in m.kwargs.values()
                                                       if isinstance(n, fx.Node))


def generalize(sym: fx.GraphModule, lowered: fx.GraphModule, calls: list[str], shard_size: int | None,
               pinned: set | None = None) -> tuple[list[str], str]:
    """Put the region calls ``calls`` of ``lowered`` (specialized and lowered) into ``sym`` (in place, only on
    success). Returns (the region call names in ``sym``, "") or ([], why not); ``pinned`` gets the symbols of the
    sizes other than the length that the regions hold at the lowered call's values (:func:`_size_read`)."""
    by_name = {n.name: n for n in sym.graph.nodes}
    pinned = set() if pinned is None else pinned
    plans = []
    for c in calls:
        call = next((n for n in lowered.graph.nodes if n.name == c), None)
        mod = lowered.get_submodule(call.target) if call is not None and call.op == "call_module" else None
        if not isinstance(mod, ShardedRegion):
            return [], f"{c} is not a sharded region call"
        prov = call.meta.get(PROVENANCE, {})
        members = prov.get("members", [])
        missing = [m for m in [*prov.get("inputs", []), *prov.get("outputs", [])] if m not in by_name]
        if missing:
            return [], f"{c}: node(s) {', '.join(missing[:3])} of the lowered region are not in the captured graph"
        inputs = [by_name[a] for a in prov.get("inputs", [])]
        outputs = [by_name[o] for o in prov.get("outputs", [])]
        mset = _members(outputs, inputs, {by_name[m] for m in members if m in by_name})
        if isinstance(mset, str):
            return [], f"{c}: {mset}"
        steps = _length_symbols(inputs, mod.in_step_dims)
        if (shared := _shared_with_other_dims(inputs, mod.in_step_dims, steps)):
            return [], f"{c}: {shared}"
        stops: dict[str, int] = {}
        for m in mset:
            for a in m.all_input_nodes:
                if a not in mset and a not in inputs and not _is_size(a):
                    return [], f"{c}: member {m.name} reads {a.name}, which the lowered region does not take in"
                if a in mset or a in inputs:
                    continue
                if (j := _length_stop(m, a, steps)) is not None and m.name in members:
                    stops[m.name] = j
                elif (why := _size_read(m, a, steps, pinned)):
                    return [], f"{c}: {why}"
            if any(u not in mset for u in m.users) and m not in outputs:
                return [], f"{c}: member {m.name} is read outside the region"
        plans.append((call.target, mod, mset, inputs, outputs, stops))
    order = {n: i for i, n in enumerate(sym.graph.nodes)}
    made = []
    for target, mod, mset, inputs, outputs, stops in plans:
        sym.add_submodule(target, LengthGenericRegion(mod, shard_size, stops))
        last = max(mset, key=order.__getitem__)
        with sym.graph.inserting_after(last):
            call = sym.graph.call_module(target, tuple(inputs))
        call.meta["example_value"] = tuple(_ev(o) for o in outputs)
        call.meta[PROVENANCE] = {"pass": "lower_generic", "region": target}
        prev = call
        for i, o in enumerate(outputs):
            with sym.graph.inserting_after(prev):
                gi = sym.graph.call_function(operator.getitem, (call, i))
            gi.meta = {"example_value": _ev(o), PROVENANCE: {"region": target, "output": o.name}}
            o.replace_all_uses_with(gi, delete_user_cb=lambda u: u not in mset)
            prev = gi
        for n in sorted(mset, key=order.__getitem__, reverse=True):
            sym.graph.erase_node(n)
        made.append(call.name)
    stable_toposort(sym.graph)
    eliminate_dead_code(sym.graph)
    sym.graph.lint()
    sym.recompile()
    log.info("adjoint-compile: %d region(s) lowered once for every length", len(made))
    return made, ""
