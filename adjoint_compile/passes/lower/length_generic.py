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

import contextlib
import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.fx import eliminate_dead_code, source_at
from ...analysis.fx import example_value as _ev
from ...analysis.fx import stable_toposort
from ...analysis.step_literals import SHAPE_ARG_METHODS
from ..capture.buffer_writes import buffer_write
from ...regions import PROVENANCE
from ...runtime.length_generic import LengthGenericRegion
from ...runtime.sharded import ShardedRegion

log = logging.getLogger(__name__)

__all__ = ["generalize"]


def _at(n: fx.Node) -> str:
    """``name at file:line: code`` for messages (the node's own name when no source line was recorded)."""
    where = source_at(n)
    return where if where.startswith("node ") else f"{n.name} at {where}"


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
    its inputs, are the same either way; a buffer's writes are members with it. A size is a member only where the
    lowered region computed it (``named``); any other is read from outside (:func:`_size_read`)."""
    seen, todo, ins = set(), list(outputs), set(inputs)
    while todo:
        n = todo.pop()
        if n in seen or n in ins:
            continue
        if n.op == "get_attr" and not isinstance(_ev(n), torch.Tensor):
            continue  # NB: a subgraph a higher-order op calls (a library scan's autograd.Function): not a value
        if n.op in ("placeholder", "get_attr"):
            return f"its outputs read {n.name}, which the lowered region does not take in"
        seen.add(n)
        # NB: a number read from an input (an eps kept as a tensor, ``eps.item()``) is the region's, as the input is;
        # a tuple-valued op (a higher-order op's results) is walked through, not a size
        todo += [a for a in n.all_input_nodes if not _is_size(a) or a in named or isinstance(_ev(a), tuple) or (
            a.op == "call_method" and a.target == "item" and a.args[0] in ins)]
        # NB: a buffer the outputs read was written step by step (``o[:, t] = h``), which capture stacked before
        # lowering: its writes are part of what it holds
        todo += [w for u in n.users if buffer_write(u, n) is not None for w in (u, *u.users)]
    return seen


#: capture and lowering passes whose nodes a region may take as inputs, made again in the graph with symbolic sizes
#: from the values they are made of: a loss's shifted labels (analysis/shifted_losses.py: a pad with one ignored target)
_REMADE = frozenset({"unshift_losses"})


def _remakes(n: fx.Node | None, by_name: dict[str, fx.Node]) -> bool:
    """Whether the lowered graph's node ``n``, absent from the captured graph, can be made there: a node of a pass in
    :data:`_REMADE`, which holds no size, whose inputs all are in the captured graph."""
    return (n is not None and n.meta.get(PROVENANCE, {}).get("pass") in _REMADE and n.target is F.pad
            and bool(n.all_input_nodes) and all(a.name in by_name for a in n.all_input_nodes))


def _remake(sym: fx.GraphModule, n: fx.Node, by_name: dict[str, fx.Node]) -> fx.Node:
    """The lowered graph's node ``n`` (:func:`_remakes`) made in ``sym`` after its first input, its value too."""
    with sym.graph.inserting_after(by_name[n.args[0].name]):
        new = sym.graph.node_copy(n, lambda a: by_name[a.name])
    new.meta = {PROVENANCE: dict(n.meta.get(PROVENANCE, {}))}
    # NB: its shape by hand: F.pad on the symbolic sizes would guard on them, specializing the shape environment
    x, pad = _ev(by_name[n.args[0].name]), n.args[1] if len(n.args) > 1 else n.kwargs["pad"]
    shape = list(x.shape)
    for k in range(len(pad) // 2):
        shape[-1 - k] = shape[-1 - k] + pad[2 * k] + pad[2 * k + 1]
    with getattr(x, "fake_mode", None) or contextlib.nullcontext():
        new.meta["example_value"] = x.new_empty(shape)
    return new


def _region_output(n: fx.Node | None, calls: list[str]) -> str | None:
    """The name of the value the lowered graph's ``n`` reads from a region call among ``calls``
    (``getitem(adjoint_region_0, k)``), or None."""
    if n is None or not (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)
                         and n.args[0].name in calls):
        return None
    return n.meta.get(PROVENANCE, {}).get("output")


def _length_exprs(inputs: list[fx.Node], dims: list[int | None]) -> set:
    """The region's length as its inputs' symbolic sizes give it along their step dims (``s27``, or ``s27 - 1`` for
    a model fed ``ids[:, :-1]``)."""
    return {v.shape[d].node.expr for x, d in zip(inputs, dims)
            if d is not None and isinstance(v := _ev(x), torch.Tensor) and isinstance(v.shape[d], torch.SymInt)}


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


def _length_bound(m: fx.Node, a: fx.Node, lengths: set) -> tuple[int, str, int] | None:
    """(position in ``m``'s index, "start" or "stop", sign) of the one slice bound that is the size ``a``, when ``a``
    is the length itself (one of ``lengths``, :func:`_length_exprs`) or its negative and ``m`` is ``x[..., :T]`` (a
    causal conv's cut) or ``x[:, -T:]`` (minGRU keeps its last T steps), else None: the lowered region holds ±T₀
    there, which :func:`~adjoint_compile.runtime.length_generic.retarget` rewrites per call."""
    if not (m.op == "call_function" and m.target is operator.getitem and len(m.args) == 2 and m.args[0] is not a):
        return None
    v, idx = _ev(a), m.args[1]
    if not isinstance(v, torch.SymInt):
        return None
    expr = v.node.expr
    sign = 1 if expr in lengths else -1 if -expr in lengths else 0
    items = list(idx) if isinstance(idx, tuple) else [idx]
    fields = [(j, f, getattr(i, f)) if isinstance(i, slice) else (j, "", i) for j, i in enumerate(items)
              for f in (("start", "stop", "step") if isinstance(i, slice) else ("",))]
    at = [(j, f) for j, f, x in fields if x is a]
    return (*at[0], sign) if sign and len(at) == 1 and at[0][1] in ("start", "stop") else None


def _whole(m: fx.Node, at: tuple[int, str, int]) -> bool:
    """Whether the slice bound ``at`` (:func:`_length_bound`) of ``m`` keeps its input whole at every length:
    ``x[:, -T:]`` or ``x[:, :T]`` where x has T entries along that dim, nothing else sliced there."""
    j, field, sign = at
    items = list(m.args[1]) if isinstance(m.args[1], tuple) else [m.args[1]]
    x, i = _ev(m.args[0]), items[j]
    if not isinstance(x, torch.Tensor) or not all(isinstance(k, slice) for k in items[:j]) or j >= x.dim():
        return False
    size, bound = x.shape[j], _ev(i.start if field == "start" else i.stop)
    other = i.stop if field == "start" else i.start
    return (isinstance(size, torch.SymInt) and isinstance(bound, torch.SymInt) and other is None
            and i.step in (None, 1) and (field, sign) in (("start", -1), ("stop", 1))
            and size.node.expr == sign * bound.node.expr)


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
        low = {n.name: n for n in lowered.graph.nodes}
        # NB: an input that is another region's output is read in the lowered graph from that region's call
        names = [_region_output(low.get(a), calls) or a for a in prov.get("inputs", [])]
        prov = {**prov, "inputs": names}
        remade = {a: low[a] for a in names if a not in by_name and _remakes(low.get(a), by_name)}
        # NB: a fill of a shape made a constant (passes/capture/noop_ops.py): the captured graph's fill is that value
        filled = {a: f for a in names if a not in by_name and a in low
                  and (f := low[a].meta.get(PROVENANCE, {}).get("fill_of")) in by_name}
        ends = [*names, *prov.get("outputs", [])]
        missing = [m for m in ends if m not in by_name and m not in remade and m not in filled]
        # NB: a name the captured graph gives another op (a pass made it in one graph only) is not the same value
        other = [m for m in ends if m in by_name and m in low and (
            (low[m].op, low[m].target) != (by_name[m].op, by_name[m].target) if low[m].op != "placeholder"
            else by_name[m].op != "placeholder")]
        if other:
            return [], f"{c}: node(s) {', '.join(other[:3])} of the lowered region are other ops in the captured graph"
        if missing:
            return [], f"{c}: node(s) {', '.join(missing[:3])} of the lowered region are not in the captured graph"
        # NB: a remade input stands for the value it is made from, until it is made (below)
        inputs = [by_name[filled.get(a, a)] if a not in remade else by_name[remade[a].args[0].name] for a in names]
        outputs = [by_name[o] for o in prov.get("outputs", [])]
        mset = _members(outputs, inputs, {by_name[m] for m in members if m in by_name})
        if isinstance(mset, str):
            return [], f"{c}: {mset}"
        steps = _length_symbols(inputs, mod.in_step_dims)
        if (shared := _shared_with_other_dims(inputs, mod.in_step_dims, steps)):
            return [], f"{c}: {shared}"
        stops: dict[str, tuple[int, str, int]] = {}
        lengths = _length_exprs(inputs, mod.in_step_dims)
        for m in mset:
            for a in m.all_input_nodes:
                if a not in mset and a not in inputs and not _is_size(a):
                    return [], f"{c}: member {m.name} reads {a.name}, which the lowered region does not take in"
                if a in mset or a in inputs:
                    continue
                if (j := _length_bound(m, a, lengths)) is not None and m.name in members:
                    stops[m.name] = j
                elif j is not None and _whole(m, j):
                    continue  # NB: x[:, -T:] of T steps: capture dropped it from the lowered graph as a no-op
                elif isinstance(m.target, torch._ops.HigherOrderOperator) and m.name not in members:
                    continue  # NB: a library scan's call, which capture replaced by the scan: its sizes are its own
                elif (why := _size_read(m, a, steps, pinned)):
                    return [], f"{c}: {why}"
            if (reader := next((u for u in m.users if u not in mset), None)) is not None and m not in outputs:
                return [], (f"{c}: a value it computes ({_at(m)}) is also read outside it ({_at(reader)}), and would "
                            "have to be kept at every length")
        plans.append((call.target, mod, mset, inputs, outputs, stops, remade, names))
    order = {n: i for i, n in enumerate(sym.graph.nodes)}
    made = []
    replaced: dict[fx.Node, fx.Node] = {}  # NB: an earlier region's outputs, now read from its call
    for target, mod, mset, inputs, outputs, stops, remade, names in plans:
        inputs = [replaced.get(x, x) for x in inputs]
        for a, ln in remade.items():
            inputs[names.index(a)] = _remake(sym, ln, by_name)
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
            replaced[o] = gi
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
