"""Regions grown from the time-local analysis (:mod:`.time_local`): the maximal convex set of time-local nodes
around some scans (:func:`region_around`), and the seeds of the analysis found from the scans alone
(:func:`infer_seeds`). Both are linear in the size of the graph (times the arity of its nodes).
"""
from __future__ import annotations

import itertools
import logging
import math
import operator

import torch.fx as fx

from .fx import example_value, nodes_in, reachable, reentry, scan_args
from .rules import Ctx, norm_dim, step_shape
from .optable import EXPANDS, POINTWISE, op_name, raw_name
from .losses import loss_args
from .time_local import (TimeLocalInfo, analyze, causal_conv, conv_args, embedding_ids, padded_causal_conv, rule_for,
                         shift_of)

log = logging.getLogger(__name__)

__all__ = ["region_around", "infer_seeds", "scan_seeds"]


def _region_candidates(gm: fx.GraphModule, info: TimeLocalInfo) -> set[fx.Node]:
    return {n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and info.is_time_local(n)}


def region_around(gm: fx.GraphModule, scan_nodes: list[fx.Node],
                  info: TimeLocalInfo) -> tuple[list[fx.Node], list[tuple[str, str]]]:
    """The maximal connected time-local set of nodes containing ``scan_nodes``, and the mixing nodes bounding it.

    Connectivity follows def-use edges in both directions between time-local ops (placeholders, step-free nodes and
    mixing nodes are not members: they are the region's inputs or its bounds).  The set is also made convex: a
    member reachable from another member through a non-member (e.g. ``y + cumsum(y)``) is dropped, so that the set
    can be outlined into one call.  A sum over time of a member (``info.sums``: a loss) joins as a last node when
    the set stays convex; the growth passes through it to its other operands (a loss's targets).  A value with the
    batch folded into its step dim (``info.folds``) is never an input or an output of the set: a shard's rows of
    it are not one slice (the members that would make it one are dropped).  Returns ``(nodes in graph order, [(name, why) of bounding mixing nodes])``;
    ``([], bounds)`` when no scan is time-local.
    """
    cand = _region_candidates(gm, info)
    seeds = [s for s in scan_nodes if s in cand]
    bad = [s for s in scan_nodes if s not in cand]
    for s in bad:
        log.debug("scan %s is not time-local: %s", s.name, info.mixing.get(s, "no step axis"))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members: set[fx.Node] = set()
    while True:
        # connected component(s) of cand containing the seeds
        members = set()
        stack = [s for s in seeds if s in cand]
        while stack:
            n = stack.pop()
            if n in members:
                continue
            members.add(n)
            # NB: through a sum over time that reads n (a loss), to its other operands (the targets' views)
            via_sums = [a for u in n.users if u in info.sums and info.sums[u].input is n for a in u.all_input_nodes]
            for m in list(n.all_input_nodes) + list(n.users) + via_sums:
                if m in cand and m not in members:
                    stack.append(m)
        # a getitem of a tuple made outside the region becomes an input: region inputs must be tensors
        cut = {n for n in members if n.op == "call_function" and n.target is operator.getitem
               and isinstance(n.args[0], fx.Node) and n.args[0] not in members
               and isinstance(example_value(n.args[0]), (tuple, list))}
        # NB: a value with the batch folded into its step dim is neither a region input nor an output: a shard's
        # rows of it are not one slice
        cut |= {n for n in members if (n in info.folds and any(u not in members and u not in info.sums
                                                                for u in n.users))
                or any(a in info.folds and a not in members for a in n.all_input_nodes)}
        if cut:
            cand -= cut
            continue
        # convexity: a path that leaves the members and comes back (member -> non-member -> member)
        entry = reentry(gm.graph.nodes, members)
        if entry is not None:
            # NB: drop the members downstream of the path, unless that drops a scan we grow the region for (e.g. a
            # causal conv between two SSM layers): then drop the members upstream of it, which go to a later region.
            dropped = reachable(entry) & members
            if any(x in dropped for x in seeds):
                near = reachable(entry, forward=False) & members
                if not any(x in near for x in seeds):
                    dropped = near
            cand -= dropped
            log.debug("region_around: dropping %s to keep the region convex", sorted(x.name for x in dropped))
            continue
        # a sum over time of a member ends the region: its shards' sums add up (none of its users may be members)
        for t, ts in info.sums.items():
            if (ts.input in members and not any(u in members for u in t.users)
                    and not any(a in info.folds and a not in members for a in t.all_input_nodes)
                    and reentry(gm.graph.nodes, members | {t}) is None):
                members.add(t)
        # NB: a folded value read outside (by a sum that could not join) would be an output: it stays out
        cut = {n for n in members if n in info.folds and any(u not in members for u in n.users)}
        if not cut:
            break
        cand -= cut
    nodes = sorted(members, key=order.__getitem__)
    bounds: list[tuple[str, str]] = []
    seen: set[fx.Node] = set()
    for n in nodes:
        for m in list(n.all_input_nodes) + list(n.users):
            if m in info.mixing and m not in seen:
                seen.add(m)
                bounds.append((m.name, info.mixing[m]))
    for s in bad:
        if s not in seen:
            seen.add(s)
            bounds.append((s.name, info.mixing.get(s, "does not carry the step axis")))
    return nodes, bounds


def _inverse(node: fx.Node, d_out: int, T: int) -> dict[fx.Node, int] | None:
    """Which inputs of ``node`` carry the step axis, given that its output carries it at ``d_out``.

    Found by trying the forward rule on every assignment of candidate dims (dims of length T, or none) to the tensor
    inputs: an assignment is valid when the rule puts the output's step axis at ``d_out``.  Time-local assignments
    beat mixing ones, then fewer tracked inputs win (a parameter that broadcasts stays whole); a tie with T > 1 is
    ambiguous and gives None, as does an op without a rule.
    """
    rule = rule_for(node)
    if rule is None:
        return None
    ins = [a for a in dict.fromkeys(nodes_in((node.args, node.kwargs))) if step_shape(a) is not None]
    # NB: an output with the batch folded into its step dim ([B·T] rows, ``mask.view(-1).to(dtype)``) has inputs
    # folded alike: their dims of its length are candidates too (only sources of T steps become seeds)
    out = step_shape(node)
    folded = out[d_out] if out is not None and d_out < len(out) else T
    cands = [[None] + [k for k, n in enumerate(step_shape(a)) if n in (T, folded)] for a in ins]
    if math.prod(len(c) for c in cands) > 256:
        return None
    best: list[tuple[tuple[int, int], dict[fx.Node, int]]] = []
    for combo in itertools.product(*cands):
        if all(c is None for c in combo):
            continue
        trial = TimeLocalInfo(step_dim=dict(zip(ins, combo)), mixing={}, length=T, fold_ok=True)
        try:
            d, why = rule(node, Ctx(node, trial))
        except Exception:  # noqa: BLE001 - an assignment the rule cannot read is not valid
            continue
        if d != d_out:
            continue
        assign = {a: k for a, k in zip(ins, combo) if k is not None}
        best.append(((why is not None, len(assign)), assign))
    if not best:
        return None
    best.sort(key=lambda x: x[0])
    if len(best) > 1 and best[0][0] == best[1][0] and T > 1 and best[0][1] != best[1][1]:
        return None
    return best[0][1]


def _through_conv(n: fx.Node, d: int) -> dict[fx.Node, int] | None:
    """The walk back through a causal conv along time (:func:`~.time_local.causal_conv`): its slice wants the conv,
    the conv its input, at the same (last) dim."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        m = causal_conv(n.args[0])
        if m is not None and m[0] is n and d == len(step_shape(n)) - 1:
            return {n.args[0]: d}
    if (causal_conv(n) is not None or padded_causal_conv(n) is not None) and d == len(step_shape(n)) - 1:
        return {conv_args(n)["input"]: d}
    if (m := shift_of(n)) is not None:  # a token shift along time: its input at the same dim
        return {m[0]: d} if d == m[2] else None
    if len(n.users) == 1 and (m := padded_causal_conv(next(iter(n.users)))) is not None and m[0] is n:
        return {n.args[0]: d} if d == len(step_shape(n)) - 1 else None
    return None


def _through_embedding(n: fx.Node, d: int) -> dict[fx.Node, int] | None:
    """The walk back through an embedding lookup: row t of its output is ids' element t (the output adds the
    feature dim last)."""
    m = embedding_ids(n)
    s = step_shape(n)
    if m is None or s is None or d >= len(s) - 1:
        return None
    return {m[0]: d}


def _backward_seeds(gm: fx.GraphModule, scan_nodes: list[fx.Node], extra: dict[fx.Node, int] | None = None,
                    halo: bool = False, ends: bool | None = None) -> dict[fx.Node, int]:
    """The scans (at their ``dim``) and the sources of their ``a`` and ``b`` (and of ``extra``: node -> step dim)
    along the step axis, by the walk :func:`infer_seeds` describes."""
    seeds: dict[fx.Node, int] = {}
    T = None
    want: dict[fx.Node, int] = {}
    work: list[fx.Node] = []
    for s in scan_nodes:
        a = scan_args(s)
        shp = step_shape(s)
        if shp is None or not isinstance(a["dim"], int):
            continue
        dim = norm_dim(a["dim"], len(shp))
        if T is not None and shp[dim] != T:
            log.debug("infer_seeds: scan %s has %d steps, others %d: skipped", s.name, shp[dim], T)
            continue
        T = shp[dim]
        seeds[s] = dim
        for key in ("a", "b"):
            v = a[key]
            vs = step_shape(v)
            if vs is None or dim + len(vs) - len(shp) < 0 or vs[dim + len(vs) - len(shp)] != T:
                continue  # broadcast along time: step-free
            d = dim + len(vs) - len(shp)
            if want.setdefault(v, d) != d:
                log.debug("infer_seeds: %s wanted at dims %d and %d", v.name, want[v], d)
            else:
                work.append(v)
    for v, d in (extra or {}).items():
        if want.setdefault(v, d) == d:
            work.append(v)
    done: set[fx.Node] = set()
    while work:
        n = work.pop()
        if n in done or n in seeds:
            continue
        done.add(n)
        d = want[n]
        inv = (halo and _through_conv(n, d)) or ((halo if ends is None else ends) and _through_embedding(n, d)) or (
            _inverse(n, d, T) if n.op in ("call_function", "call_method") else None)
        if not inv:
            if (sn := step_shape(n)) is None or sn[d] == T:  # NB: a value with the batch folded in is no seed
                seeds[n] = d
            continue
        for a, k in inv.items():
            if want.setdefault(a, k) != k:
                log.debug("infer_seeds: %s wanted at dims %d and %d", a.name, want[a], k)
            elif a not in done:
                work.append(a)
    return seeds


def _readout_operands(gm: fx.GraphModule, info: TimeLocalInfo) -> dict[fx.Node, int]:
    """Step-free operands of elementwise ops on step-carrying values whose broadcast lines their dim of length T up
    with the step axis, e.g. ``q`` in ``(q[..., None] * states).sum(-2)`` when ``q`` is an input of its own, the
    index of a ``gather`` (each step's targets) and the targets of a loss (analysis/losses.py; ``t.flatten()`` of
    ``[B, T]`` targets against ``[B·T, V]`` rows: the walk back finds ``t``): step t reads element t of them, so they
    carry the step axis at that dim (nothing is guessed: the alignment is the broadcast's, gather's same-shape rule,
    or the loss's rows)."""
    found: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if (m := loss_args(n)) is not None and info.step_dim.get(m["input"]) is not None:
            # the targets of a loss: row for row with its input (analysis/losses.py)
            t, x, d = m["target"], m["input"], info.step_dim[m["input"]]
            st = step_shape(t)
            k = d if st is not None and len(st) == len(step_shape(x)) else max(d - 1, 0)
            if (isinstance(t, fx.Node) and t not in found and info.step_dim.get(t) is None and st is not None
                    and k < len(st) and st[k] == info.steps_at(x) and d != 1):
                found[t] = k
            continue
        d = info.step_dim.get(n)
        if d is None or n.op not in ("call_function", "call_method") or op_name(n) not in POINTWISE | {"gather"}:
            continue
        out = step_shape(n)
        for a in n.all_input_nodes:
            shp = step_shape(a)
            if a in found or info.step_dim.get(a) is not None or shp is None or out is None:
                continue
            k = d - (len(out) - len(shp))
            if 0 <= k < len(shp) and shp[k] == info.steps_at(n) and shp[k] > 1:
                found[a] = k
    return found


def infer_seeds(gm: fx.GraphModule, scan_nodes: list[fx.Node], halo: bool = False,
                ends: bool | None = None) -> dict[fx.Node, int]:
    """Seeds for :func:`analyze` found from the scans alone: the scans (at their ``dim``) and the sources of their
    ``a`` and ``b`` along the step axis (:func:`_backward_seeds`), then the sources of the step-free operands that
    readouts broadcast against the steps (:func:`_readout_operands`), until none is left (at most 4 rounds).

    Walks back from every scan's a and b through ops whose rule can be inverted exactly (broadcasting aligns a
    per-step operand with the step axis; Linear passes it to its input, never to its weight; views map it by the
    row-major rule; with ``halo``, a causal conv along time passes it to its input).  A node where the walk stops (a placeholder, a conv along time, an op without a rule) becomes a
    seed itself: its output is a step-carrying input of any region after it.  The forward :func:`analyze` then checks
    everything; a node asked for at two different dims keeps the first and is logged.
    """
    extra: dict[fx.Node, int] = {}
    seeds = _backward_seeds(gm, scan_nodes, halo=halo, ends=ends)
    for _ in range(4):
        more = {a: k for a, k in _readout_operands(gm, analyze(gm, seeds, halo, ends=ends)).items() if a not in extra}
        if not more:
            break
        extra.update(more)
        seeds = _backward_seeds(gm, scan_nodes, extra, halo, ends)
    return seeds


def scan_seeds(scan_nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Seeds of a region graph's scans for :func:`analyze` (its inputs are seeded apart): each scan at its ``dim``,
    and an ``a`` or ``b`` that expands a step-free value over the steps (a constant decay ``lam.expand_as(bx)``,
    ``lam.expand(T, B, N)`` of a re-rolled loop) at the scan's dim too, where :func:`analyze` accepts an expand
    along it."""
    seeds: dict[fx.Node, int] = {}
    for s in scan_nodes:
        sa = scan_args(s)
        seeds[s] = sa["dim"]
        for v in (sa["a"], sa["b"]):
            if isinstance(v, fx.Node) and v.op != "placeholder" and raw_name(v) in EXPANDS:
                seeds.setdefault(v, sa["dim"])
    return seeds
