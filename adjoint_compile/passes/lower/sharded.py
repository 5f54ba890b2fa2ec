"""Exact and truncated mode lowering: replace a time-local region around linear scans by one call of the sharded
runtime (rewrite "adjoint" in mode "exact", "truncated" in mode "truncated": the same regions, shards and saved
tensors; the truncated one's backward keeps each scan's adjoint paths of at most ``options.window`` steps).

``lower_region`` outlines the region's nodes into a sub-GraphModule, wraps it in
:class:`~adjoint_compile.runtime.sharded.ShardedRegion` (forward shard by shard, saving only the region's inputs
and the scan states at shard boundaries; backward right to left with one VJP per shard, DESIGN.md §3), and puts
one ``call_module`` node (plus ``getitem`` per output) in its place.  Anything unproven leaves the graph untouched
and returns None with a logged reason (soft failure).

``lower_recurrences`` is the entry the pipeline calls (passes/lower/): it finds the regions around the
recognized scans with the time-local analysis, lowers each one and returns a typed outcome per record.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from ...analysis.fx import example_value as _ev
from ...analysis.fx import allocated_bytes, fresh_name, is_convex, is_linear_scan, scan_args
from ...analysis.fx import eliminate_dead_code
from ...analysis.fx import source_line, stable_toposort as _toposort
from ...analysis.modes import moved_across_modes, written_after_read
from ...analysis.optable import SAME_SHAPE, op_name
from ...analysis.grow import infer_seeds, region_around
from ...analysis.losses import loss_args
from ...analysis.resets import find_resets
from ...analysis.rules import norm_dim, step_shape
from ...analysis.shifted_losses import unshift_losses
from ...analysis.time_local import TimeLocalInfo, analyze, embedding_ids
from ...errors import UnsupportedRegion
from ...options import Options, validate
from ...regions import PROVENANCE, Lowered, NotLowered, Recurrence
from ...runtime.sharded import ShardedRegion
from ...runtime.sharded_ps import expandable_reason
from ..decide import declines
from .sharded_ps import per_sample_region, pull_in_parameter_math, with_halo_axes

log = logging.getLogger(__name__)

__all__ = ["outline", "lower_region", "lower_recurrences"]


def outline(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """Copy ``nodes`` (in graph order) into a sub-GraphModule.

    Returns ``(sub_gm, inputs, outputs)``: the outside nodes the region reads (its placeholders, in order of first
    use) and the region nodes read outside it (its outputs, a tuple, in graph order).  ``gm`` is not modified.
    """
    members = set(nodes)
    inputs: list[fx.Node] = []
    # NB: a sub-graph a member calls (a custom autograd.Function's forward and backward) is read, not passed in
    bodies = [a for n in nodes for a in n.all_input_nodes if a not in members and _sub_graph(gm, a)]
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs and a not in bodies:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: g.node_copy(a) for a in dict.fromkeys(bodies)}
    for a in inputs:
        p = g.placeholder(a.name)
        p.meta = dict(a.meta)
        env[a] = p
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, g), inputs, outputs


def _sub_graph(gm: fx.GraphModule, a: fx.Node) -> bool:
    try:
        return a.op == "get_attr" and isinstance(gm.get_submodule(str(a.target)), fx.GraphModule)
    except AttributeError:
        return False


def lower_region(gm: fx.GraphModule, nodes: list[fx.Node], info: TimeLocalInfo, options: Any) -> fx.Node | None:
    """Replace ``nodes`` (a time-local set containing linear scans) by one call of the sharded runtime.

    Args:
        gm: the dynamo graph (modified in place on success).
        nodes: the region, e.g. from :func:`~adjoint_compile.analysis.grow.region_around`.
        info: the step-dim analysis of ``gm`` that ``nodes`` came from.
        options: :class:`~adjoint_compile.options.Options` (``shard_size``, ``verify``) or a dict of them.
    Returns the ``call_module`` node that runs the region, or None (``gm`` untouched, reason logged) when the
    region cannot be proven shardable: a member that mixes steps, a reverse or windowed scan, an output without
    the step axis, a shape literal it cannot rewrite, a non-convex set, ...
    """
    opts: Options = validate(options)
    try:
        return _lower_region(gm, nodes, info, opts)
    except UnsupportedRegion as e:
        log.info("adjoint-compile: region around %s kept ordinary autograd: %s",
                 [n.name for n in nodes if n.op == "call_function" and is_linear_scan(n)], e)
        return None


class _LossNotPerExample(UnsupportedRegion):
    """Under per_sample_clip, a region's loss that its expanded parameters cannot split by example (``why``)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"per_sample_clip: the loss cannot be split by example in the region ({why})")
        self.why = why


def _lower_region(gm: fx.GraphModule, nodes: list[fx.Node], info: TimeLocalInfo, opts: Options,
                  outside: str = "") -> fx.Node:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if not nodes:
        raise UnsupportedRegion("empty region")
    nodes = sorted(dict.fromkeys(nodes), key=order.__getitem__)
    for n in nodes:
        if n.op not in ("call_function", "call_method"):
            raise UnsupportedRegion(f"node {n.name} ({n.op}) cannot be outlined")
        if not info.is_time_local(n) and n not in info.sums:
            raise UnsupportedRegion(f"node {n.name} is not time-local: {info.mixing.get(n, 'no step axis')}")
    scans = [n for n in nodes if is_linear_scan(n)]
    if not scans:
        raise UnsupportedRegion("the region has no linear_scan")
    ps_kinds: tuple[dict, int] | None = None
    if opts.per_sample_clip is not None:
        nodes, kind_of, batch = pull_in_parameter_math(gm, nodes, info, opts)
        ps_kinds = (kind_of, batch)
    if not is_convex(nodes):
        raise UnsupportedRegion("the region is not convex (a path leaves it and comes back)")
    if (moved := moved_across_modes(gm.graph, nodes)) is not None:
        raise UnsupportedRegion(f"{moved.name} runs under another grad mode or autocast than the region's end (a "
                                f"torch.no_grad() block between its ops reads it): the region's one call would move it")
    if (w := written_after_read(gm.graph, nodes)) is not None:
        raise UnsupportedRegion(f"{w.name} writes in place into {w.kwargs.get('out', w.args[0])} between the region's "
                                f"ops, after one of them reads it (at {source_line(w) or 'an unknown line'}): the "
                                f"region's one call would read the new values; make the write after the recurrence")
    sub, inputs, outputs = outline(gm, nodes)
    _tensor_inputs(inputs)
    if not outputs:
        raise UnsupportedRegion("the region has no outputs")
    for n in [*inputs, *outputs]:
        if n in info.folds:
            raise UnsupportedRegion(f"{n.name} folds the batch into its step dim: a shard's rows of it are not one "
                                    f"slice")
    in_dims = [info.step_dim.get(a) for a in inputs]
    out_dims = [info.step_dim.get(o) for o in outputs]
    if all(d is None for d in in_dims):
        raise UnsupportedRegion("no input of the region carries the step axis (it computes its steps itself)")
    T = info.length or next(_ev(a).shape[d] for a, d in zip(inputs, in_dims) if d is not None)
    for n, d in [*zip(inputs, in_dims), *zip(outputs, out_dims)]:
        v = _ev(n)
        if d is not None and isinstance(v, torch.Tensor) and v.shape[d] != T:
            # NB: a causal conv's padded input or output, cut apart from the conv by the region's edge
            raise UnsupportedRegion(f"{n.name} has {v.shape[d]} steps, not T={T}: a causal conv without its pad "
                                    f"or slice in the region")
    rewrite, window = _rewrite(opts)
    mod = ShardedRegion(sub, in_dims, out_dims, opts.shard_size, verify=opts.verify, inner=opts.inner, window=window,
                        cuda_graphs=opts.cuda_graphs, fused_loss=opts.fused_loss)
    if ps_kinds is not None:
        mod.per_sample = per_sample_region(gm, inputs, outputs, scans, info, ps_kinds[0], opts, ps_kinds[1])
    # checks the shard programs on fake tensors now (raises UnsupportedRegion)
    S = mod.prepare([_ev(a) for a in inputs])
    if ps_kinds is not None:
        mod.per_sample = with_halo_axes(mod.per_sample, mod._plan, opts.batch_dim)
        S = mod.prepare([_ev(a) for a in inputs])  # NB: again: a split loss's per-example parts read the halos' axes
    # NB: with its loss split off (runtime/loss_tail.py) the rest's shards are longer, but the loss runs in chunks
    # the size of the whole region's shards: its estimate and its one-shard test are those of the whole region
    S_all = mod._plan.shard_size if mod.tail is not None else S
    if ps_kinds is not None and mod.per_sample.loss_kinds and (why := next(filter(None, (
            expandable_reason(mod._plan, mod.per_sample, L) for L in sorted({e - s for s, e in mod._plan.bounds()}))),
            "")):
        raise _LossNotPerExample(why)
    memory = expected_memory(nodes, scans, info, T, S_all, inputs, outputs, mod._plan.halo_bytes())
    if ps_kinds is not None:
        # NB: the per-example gradients of the region's parameters ([B, *p.shape] each, over all shards) are kept
        # too: at short T they outweigh what sharding saves
        memory["per_example"] = mod.per_sample.example_bytes
        memory["sharded"] += memory["per_example"]
    # NB: in truncated mode a window shorter than T changes the gradients the user asked for: a region that would
    # not save memory is still rewritten (declined, it would give the exact gradients without a word)
    why = declines(memory, -(-T // S_all)) if rewrite == "adjoint" or window is None or window >= T else ""
    if not why and S_all >= T and rewrite == "adjoint" and opts.sequence_parallel is None:
        # NB: one shard saves nothing and recomputes the whole forward (truncated mode keeps it: its window still
        # changes the gradients the user asked for; under sequence_parallel every rank must lower the same regions,
        # whatever the length of its slice)
        fix = ("a single step has nothing to shard" if T <= 1 else "set shard_size to shard it"
               if opts.shard_size is None else f"shard_size={opts.shard_size} was set: a smaller one (< {T}) shards it")
        why = f"one shard: T={T} ≤ shard {mod._plan.wanted_shard_size}; {fix}"
    if why:
        raise Declined(why, memory)

    name = fresh_name(gm, "adjoint_region")
    mod.label = name
    gm.add_submodule(name, mod)
    sums = [n.name for n in nodes if n in info.sums]
    lookups = [n.name for n in nodes if embedding_ids(n) is not None]
    # NB: for the report only: a decay zeroed at document starts (packed sequences) is an ordinary scan here
    resets = [r for sc in scans for r in find_resets(sc, info.step_dim)]
    # NB: for the report only: with the loss inside, a full-length output the graph returns (the logits) stays whole
    returned = [{"name": o.name, "shape": list(_ev(o).shape), "bytes": _nbytes(_ev(o))}
                for o in outputs if sums and _returned(o, set(nodes), info)]
    # NB: for the report only: the modes whose regions end before the loss hand the logits to it whole
    why_outside = ("sequence_parallel" if opts.sequence_parallel is not None else
                   "per_sample_clip" if outside else None)
    before_loss = [{"name": o.name, "shape": list(_ev(o).shape), "bytes": _nbytes(_ev(o)), "mode": why_outside,
                    "cause": outside} for o in outputs if why_outside and _feeds_loss(o, set(nodes), info)]
    prov = {"rewrite": rewrite, "window": window, "scans": [s.name for s in scans], "nodes": len(nodes),
            "sums_over_time": sums, "embeddings": lookups, "resets": resets, "returned_whole": returned,
            "before_loss": before_loss,
            "shard_size": S, "steps": T, "inputs": [a.name for a in inputs], "outputs": [o.name for o in outputs],
            "members": [n.name for n in nodes],
            "memory": memory}
    if mod.tail is not None:  # the loss, with its gradient, in the forward (runtime/loss_tail.py)
        prov["loss_tail"] = {"chunk": mod.tail.tail.shard_size, "steps": T, "fused_heads": mod.tail.fused_heads,
                             "nodes": len([n for n in mod.tail.tail.region_gm.graph.nodes
                                           if n.op not in ("placeholder", "output")])}
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["example_value"] = tuple(_ev(o) for o in outputs)
    call.meta[PROVENANCE] = prov
    prev = call
    for i, o in enumerate(outputs):
        with gm.graph.inserting_after(prev):
            gi = gm.graph.call_function(operator.getitem, (call, i))
        gi.meta = {"example_value": _ev(o), PROVENANCE: {"rewrite": rewrite, "region": name, "output": o.name}}
        info.step_dim[gi] = out_dims[i]
        members = set(nodes)
        o.replace_all_uses_with(gi, delete_user_cb=lambda u: u not in members)
        prev = gi
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    _toposort(gm.graph)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    log.info("adjoint-compile: lowered a region of %d nodes with %d scan(s) over T=%d steps, shard_size=%d",
             len(nodes), len(scans), T, S)
    return call


def _folds_refused(gm: fx.GraphModule, scans: list[fx.Node], info: TimeLocalInfo, opts: Options) -> str:
    """Why a region around ``scans`` that merges the batch and the steps (``info.folds``) cannot be sharded (its
    shard programs checked on fake tensors, ``gm`` untouched), or "" when each can (or would only not pay)."""
    seen: set[fx.Node] = set()
    for s in scans:
        if s in seen:
            continue
        nodes, _ = region_around(gm, [s], info)
        seen.update(x for x in nodes if is_linear_scan(x))
        if not any(n in info.folds for n in nodes):
            continue
        try:
            sub, inputs, outputs = outline(gm, nodes)
            _tensor_inputs(inputs)
            mod = ShardedRegion(sub, [info.step_dim.get(a) for a in inputs], [info.step_dim.get(o) for o in outputs],
                                opts.shard_size, inner=opts.inner, window=_rewrite(opts)[1])
            mod.prepare([_ev(a) for a in inputs])
        except (UnsupportedRegion, ValueError) as e:
            return f"region around {s.name}: {e}"
    return ""


def _tensor_inputs(inputs: list[fx.Node]) -> None:
    """Raise :class:`UnsupportedRegion` for a region input that is not a tensor: a symbolic size, or a Python float
    that changed between calls (dynamo then passes it unspecialized, a ``SymFloat``)."""
    for a in inputs:
        v = _ev(a)
        if isinstance(v, torch.Tensor):
            continue
        if isinstance(v, torch.SymInt):
            hint = " (dynamic shapes: the sharded runtime needs static sizes; use torch.compile(..., dynamic=False))"
        elif isinstance(v, torch.SymFloat):
            hint = (" (a Python float argument that changed between calls, e.g. a label smoothing or temperature "
                    "schedule: pass it as a 0-dim tensor where the op takes one, or keep it constant)")
        else:
            hint = ""
        raise UnsupportedRegion(f"input {a.name} is not a tensor ({type(v).__name__}){hint}")


def _rewrite(opts: Options) -> tuple[str, int | None]:
    """The rewrite a lowered region gets in ``opts.mode`` and its window: ("adjoint", None) or ("truncated", W)."""
    return ("truncated", opts.window) if opts.mode == "truncated" else ("adjoint", None)


def _feeds_loss(o: fx.Node, members: set[fx.Node], info: TimeLocalInfo) -> bool:
    """True when region output ``o`` reaches a cross-entropy or nll_loss outside the region through ops that keep
    its step axis (a view, a cast, the shift by one)."""
    if info.step_dim.get(o) is None:
        return False
    todo, seen = [o], {o}
    while todo:
        for u in todo.pop().users:
            if u in members or u in seen:
                continue
            if loss_args(u) is not None:
                return True
            seen.add(u)
            if u.op != "output" and isinstance(_ev(u), torch.Tensor) and _ev(u).dim() >= 2:
                todo.append(u)
    return False


#: ops outside a region through which the graph returns a region output itself (a view, a cast, a copy)
_SAME_VALUES = SAME_SHAPE | frozenset({"view", "reshape", "flatten", "unflatten", "transpose", "permute", "squeeze",
                                       "unsqueeze", "getitem", "view_as", "reshape_as", "t"})


def _returned(o: fx.Node, members: set[fx.Node], info: TimeLocalInfo) -> bool:
    """True when the graph returns region output ``o`` whole: it reaches the graph's output directly or through
    ops outside the region that keep its values and its step axis (a view, a cast). NB: not through other ops: an
    output computed from ``o`` (a standardization over time, then a projection) is not ``o``, which is kept whole
    for the op that reads it, not because it is returned."""
    if info.step_dim.get(o) is None:
        return False
    todo, seen = [o], {o}
    while todo:
        for u in todo.pop().users:
            if u.op == "output":
                return True
            if u not in members and u not in seen and info.step_dim.get(u) is not None and op_name(u) in _SAME_VALUES:
                seen.add(u)
                todo.append(u)
    return False


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


class Declined(UnsupportedRegion):
    """The region could be sharded, but the rewrite would not pay (passes/decide/ ``declines``)."""

    def __init__(self, why: str, memory: dict[str, int]) -> None:
        super().__init__(why)
        self.memory = memory


def _per_step_read(u: fx.Node) -> bool:
    """An op that reads one step of a full-length tensor (``H[k]``, ``select``, ``unbind``): outside a region, T
    of them keep the whole tensor alive for their backward."""
    name = getattr(u.target, "__name__", str(u.target))
    if name in ("unbind", "select"):
        return True
    if u.target is operator.getitem and len(u.args) == 2:
        idx = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
        return any(isinstance(i, int) and not isinstance(i, bool) for i in idx)
    return False


def expected_memory(nodes: list[fx.Node], scans: list[fx.Node], info: TimeLocalInfo, T: int, S: int,
                    inputs: list[fx.Node] = (), outputs: list[fx.Node] = (), halos: int = 0) -> dict[str, int]:
    """What the region keeps for backward, estimated from the example shapes (bytes).

    ``autograd``: every step-carrying intermediate of the region, the most ordinary autograd can save (it saves a
    subset, so this is an upper bound on what sharding removes). ``sharded``: the scan states and the conv halos
    (``halos``: bytes per boundary) at the ⌈T/S⌉ - 1 shard boundaries plus one shard's intermediates while it is
    recomputed in backward. ``inputs``: the region's
    step-carrying inputs (saved either way). ``kept_outside``: full-length outputs read step by step outside the
    region (``unbind``, or two or more one-step reads: a bare scan whose states T unrolled ops read): what those
    ops keep alive because of the rewrite. Views (movedim, expand, slices) allocate nothing and count 0
    (``allocated_bytes``).
    """
    S = min(S, T)  # NB: a shard_size over T is one shard of T steps
    per_region = allocated_bytes(nodes, lambda n: info.step_dim.get(n) is not None)
    states = sum(_nbytes(_ev(s)) // T for s in scans)  # one step of every scan's state
    boundaries = (-(-T // S) - 1) * (states + halos)
    members = set(nodes)
    kept = sum(_nbytes(_ev(o)) for o in outputs if info.step_dim.get(o) is not None and
               sum(u not in members and _per_step_read(u) for u in o.users) >= 2 or
               any(u not in members and getattr(u.target, "__name__", "") == "unbind" for u in o.users))
    return {"autograd": per_region, "sharded": boundaries + per_region * S // T,
            "inputs": sum(_nbytes(_ev(a)) for a in inputs if info.step_dim.get(a) is not None), "kept_outside": kept}


def _per_scan(nodes: list[fx.Node], scans: list[fx.Node]) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """``nodes`` cut into one piece per scan, in graph order, each cut between scans j-1 and j a minimum cut (networkx)
    by the bytes that cross it: what a piece hands the next is saved whole, so the cut falls where the values are
    smallest (a layer's [B, T, D] residual stream, not its [B, T, D, N] states).  A piece that is not convex is
    refused by the lowering (its scan then keeps ordinary autograd)."""
    members = set(nodes)
    inf = float("inf")
    g = nx.DiGraph()
    for n in nodes:
        v = _ev(n)
        size = sum(_nbytes(x) for x in v) if isinstance(v, (tuple, list)) else _nbytes(v)
        g.add_edge(("in", n), ("out", n), capacity=size)
        for u in n.users:
            if u in members:
                g.add_edge(("out", n), ("in", u), capacity=inf)
                g.add_edge(("in", u), ("in", n), capacity=inf)  # NB: no value goes back: the pieces stay ordered
    piece = {n: len(scans) - 1 for n in nodes}
    for j in range(len(scans) - 1, 0, -1):
        h = g.copy()
        for k, sc in enumerate(scans):
            h.add_edge(*(("src", ("in", sc)) if k < j else (("in", sc), "sink")), capacity=inf)
        _, (left, _) = nx.minimum_cut(h, "src", "sink")
        for n in nodes:
            if ("in", n) in left:
                piece[n] = min(piece[n], j - 1)
    parts: list[list[fx.Node]] = [[n for n in nodes if piece[n] == k] for k in range(len(scans))]
    return [(parts[k], [s]) for k, s in enumerate(scans) if parts[k]]


def _not_a_scan(r: Recurrence, opts: Options) -> str:
    """Why a recurrence without a linear_scan node is not lowered."""
    if r.source != "unrolled_loop":
        return f"{opts.mode} mode lowers linear_scan recurrences; source {r.source!r} is not one yet"
    rec = getattr(r, "reroll", None)
    why = rec.first_step_reason if rec is not None and not rec.first_step_matched and rec.first_step_reason else ""
    return (f"the loop was not re-rolled into one linear_scan{f' ({why})' if why else ''}, which {opts.mode} mode "
            f"lowers; write the recurrence with adjoint_compile.ops.linear_scan")


def lower_recurrences(gm: fx.GraphModule, recurrences: list[Recurrence], opts: Options) -> list[Lowered | NotLowered]:
    """Lower every ``linear_scan`` recurrence (exact mode, or truncated mode with ``opts.window``); one outcome per
    record, in order.

    Scans joined by time-local ops form one region (one call, one carry per scan). Records without a linear_scan
    node (a loop capture could not re-roll) get :class:`NotLowered` with the reason; nothing is written on the
    records (passes/decide/ settles them).
    """
    out: list[Lowered | NotLowered] = [NotLowered("not lowered")] * len(recurrences)
    scan_of: dict[int, fx.Node] = {}
    for i, r in enumerate(recurrences):
        cands = [n for n in list(r.outputs) + list(r.nodes) if isinstance(n, fx.Node) and is_linear_scan(n)]
        if not cands:
            out[i] = NotLowered(_not_a_scan(r, opts))
            continue
        scan_of[i] = cands[0]
    if not scan_of:
        return out
    scans = list(dict.fromkeys(scan_of.values()))
    try:
        # NB: causal convs and token shifts join regions in the exact sweep only (runtime/sharded.py carries their
        # halos, per example too); the truncated and sequence-parallel sweeps carry scan states alone
        halo = opts.mode == "exact" and opts.sequence_parallel is None
        # NB: the truncated and per-example sweeps take in embeddings and the loss too (they hold no carries between
        # shards; per example, the loss is told apart by the expanded parameters: runtime/sharded_ps.py)
        ends = halo or (opts.sequence_parallel is None and (opts.mode == "truncated" or
                                                            opts.per_sample_clip is not None))
        info = analyze(gm, infer_seeds(gm, scans, halo, ends), halo, ends=ends)
        if ends and unshift_losses(gm, info):  # NB: a loss of logits[:, :-1]: the logits whole, the labels padded
            info = analyze(gm, infer_seeds(gm, scans, halo, ends), halo, ends=ends)
    except ValueError as e:
        info, why = None, f"step analysis failed: {e}"
    else:
        why = "" if isinstance(info.length, int) else (
            f"the sequence length is symbolic ({info.length}, dynamic shapes): the sharded runtime needs a static "
            f"length; use torch.compile(..., dynamic=False)")
    if why:
        log.info("adjoint-compile: %s", why)
        for i in scan_of:
            out[i] = NotLowered(why)
        return out
    if info.folds and (e := _folds_refused(gm, scans, info, opts)):
        # NB: a region through a merge of the batch and the steps that cannot be sharded (e.g. a literal size it cannot
        # rewrite): the regions are grown without such merges, as they were before merges joined regions
        log.info("adjoint-compile: regions without merges of batch and steps: %s", e)
        info = analyze(gm, infer_seeds(gm, scans, halo, ends), halo, folds=False, ends=ends)
    done: dict[fx.Node, Lowered | NotLowered] = {}
    for s in scans:
        if s in done:
            continue
        nodes, bounds = region_around(gm, [s], info)
        group = [x for x in nodes if is_linear_scan(x)] or [s]
        members = frozenset(n.name for n in nodes)
        # NB: under sequence_parallel a region's last state must be affine in its carry-in (runtime/seqpar_sharded.py):
        # one region per scan
        pieces = _per_scan(nodes, group) if opts.sequence_parallel is not None and len(group) > 1 else [(nodes, group)]
        for part, scans_of in pieces:
            try:
                if not part:
                    raise UnsupportedRegion(_not_grown(s, info))
                try:
                    call = _lower_region(gm, part, info, opts)
                except _LossNotPerExample as e:
                    # NB: the region as it was before it took in the loss: ending before it, the logits whole
                    log.info("adjoint-compile: %s; the region around %s ends before it", e, s.name)
                    left = [x for x in scans if x not in done and x in gm.graph.nodes]
                    plain = analyze(gm, infer_seeds(gm, left, False, False), False, ends=False)
                    part, bounds = region_around(gm, [s], plain)
                    call = _lower_region(gm, part, plain, opts, outside=f"its parameters cannot be split by "
                                                                         f"example there: {e.why}")
                    # NB: the step axes of the call's outputs, for the regions lowered after it
                    info.step_dim.update({n: d for n, d in plain.step_dim.items() if n not in info.step_dim})
            except UnsupportedRegion as e:
                log.info("adjoint-compile: scan %s keeps ordinary autograd: %s", scans_of[0].name, e)
                result: Lowered | NotLowered = NotLowered(str(e), memory=getattr(e, "memory", None))
            else:
                p = call.meta[PROVENANCE]
                p["bounds"] = bounds
                mem = members if len(pieces) == 1 else frozenset(n.name for n in part)
                result = Lowered(rewrite=p["rewrite"], call=call.name, members=mem, scans=len(p["scans"]),
                                 nodes=p["nodes"], shard_size=p["shard_size"], steps=p["steps"], window=p["window"],
                                 memory=dict(p["memory"]), bounds=list(bounds),
                                 details={k: p[k] for k in ("sums_over_time", "embeddings", "resets", "returned_whole",
                                                            "before_loss",
                                                            "loss_tail") if p.get(k)})
            for x in scans_of:
                done[x] = result
    for i, s in scan_of.items():
        out[i] = done.get(s, NotLowered("not lowered"))
    return out


def _not_grown(s: fx.Node, info: Any) -> str:
    """Why no region grew around the scan ``s``: a second length in the graph, or the step analysis's reason."""
    shp, dim = step_shape(s), scan_args(s)["dim"]
    steps = shp[norm_dim(dim, len(shp))] if shp is not None and isinstance(dim, int) else None
    if isinstance(steps, int) and isinstance(info.length, int) and steps != info.length:
        # NB: the step analysis follows one length per graph (analysis/grow.py): the first scan's
        return (f"scan {s.name} has {steps} steps where the graph's other scans have {info.length}: the regions of "
                f"one graph share one length, so this one keeps ordinary autograd; compile the parts of other lengths "
                f"on their own (e.g. the encoder and the decoder as two torch.compile'd modules)")
    return f"scan {s.name} is not time-local: {info.mixing.get(s, 'no step axis')}"
