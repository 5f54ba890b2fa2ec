"""Stage 2 of the pipeline: find the recurrences and residual chains of a dynamo graph (DESIGN.md §3–4).

    regions, rejections = recognize(gm, options)

runs the matcher families, each in its own module, and fills in what ties their records together:

* :mod:`.find_recurrences`: ``linear_scan``, torch's ``scan`` and ``associative_scan`` nodes;
* :mod:`.unrolled`: Python loops that dynamo unrolled (carry chain, same-computation proof, re-roll recipe);
* :mod:`.find_residuals`: residual chains along depth with the r/g split and K of every layer;
* the time-local neighbourhood of every recurrence (:mod:`~adjoint_compile.analysis.time_local`): the ops that
  act on each step on its own and can be recomputed shard by shard, and the step-mixing ops that bound them;
  recurrences whose neighbourhoods join share a ``group`` id.

It runs once per graph, on the graph capture normalized (loops and scan ops already re-rolled into ``linear_scan``
nodes whose provenance names the form the user wrote), so the records it returns are the ones the later stages
decide on and lower. It never mutates ``gm`` and never raises: a matcher that fails becomes a
:class:`~adjoint_compile.regions.Rejection` with the reason. Every region comes back undecided (``rewrite="none"``);
passes/decide/ decides.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections import deque
from typing import Any

import networkx as nx
import torch.fx as fx

from ...analysis.fx import hinted_shape, source_line
from ...analysis.grow import region_around
from ...analysis.time_local import analyze
from ...options import Options
from ...regions import PROVENANCE, Recurrence, Region, Rejection, ResidualChain
from ...timing import stage
from ..capture import Captured
from ..capture.specialize import no_guards
from ..match.find_recurrences import find_recurrences, is_associative_scan_hop, is_linear_scan, is_scan_hop
from ..match.find_residuals import find_residuals
from ..match.find_cells import find_cells
from ..match.find_generic_scan import has_generic_scans
from ..match.prefilter import candidates, run_or_skip
from ..match.unrolled import find_unrolled

log = logging.getLogger(__name__)

__all__ = ["recognize"]


def recognize(gm: fx.GraphModule, options: Options | None = None, *,
              matched: tuple[list[Recurrence], list[Rejection]] | None = None) -> tuple[list[Region], list[Rejection]]:
    """All recurrences (in graph order) then all residual chains of ``gm``, and the rejected candidates.

    ``options`` is accepted for the pipeline's signature; recognition itself does not depend on the mode (what to
    rewrite is passes/decide/'s decision). ``matched``: the recurrence matchers' results on this very graph,
    when capture has them (:attr:`~adjoint_compile.passes.capture.Captured.matched`); they are not run again.
    """
    t0 = time.perf_counter()
    recurrences: list[Recurrence] = []
    chains: list[ResidualChain] = []
    rejections: list[Rejection] = []
    # NB: a matcher family with no candidate in the graph is not run (passes/match/prefilter.py)
    with stage("prefilter"):
        cands = candidates(gm)
    matchers = [("residual chains", find_residuals, chains, cands.sums)]
    if matched is None:
        matchers[:0] = [("scan nodes", find_recurrences, recurrences, cands.scans),
                        ("unrolled loops", find_unrolled, recurrences, cands.slices),
                        ("recurrent cells", find_cells, recurrences, cands.cells)]
    else:
        recurrences += matched[0]
        rejections += matched[1]
    for what, fn, out, wanted in matchers:
        try:
            with stage(fn.__name__):
                found, rejected = run_or_skip(wanted, what, fn, gm)
        except Exception as e:  # noqa: BLE001 - recognition never raises (DESIGN.md §4)
            log.debug("recognize: the %s matcher failed", what, exc_info=True)
            # NB: the first line only: an op's schema error prints its whole arguments (index tensors included)
            said = (str(e).splitlines() or [""])[0][:300]
            rejections.append(Rejection("graph", "<graph>", f"the {what} matcher raised {type(e).__name__}: {said}"))
            continue
        out.extend(found)
        rejections.extend(rejected)
    chains = _drop_time_chains(chains, recurrences)
    recurrences, chains, rejections = _drop_dead(gm, recurrences, chains, rejections)
    try:
        with stage("time_local"):
            _neighbourhoods(gm, recurrences)
    except Exception as e:  # noqa: BLE001
        log.debug("recognize: time-local analysis failed", exc_info=True)
        for r in recurrences:
            r.bounds = [("<graph>", f"time-local analysis failed: {type(e).__name__}: {e}")]
    for r in recurrences:
        r.not_rerolled = _not_rerolled(r)
    regions: list[Region] = [*recurrences, *chains]
    log.debug("recognize: %d region(s), %d rejection(s) in %d nodes, %.3fs", len(regions), len(rejections),
              len(gm.graph.nodes), time.perf_counter() - t0)
    return regions, rejections


def _not_rerolled(r: Recurrence) -> str | None:
    """Why capture's reroll pass left this recurrence in its form, from the provenance it put on the nodes."""
    for n in [*r.outputs, *r.nodes]:
        prov = n.meta.get(PROVENANCE)
        if isinstance(prov, dict) and prov.get("not_rerolled"):
            return prov["not_rerolled"]
    return None


def _drop_dead(gm: fx.GraphModule, recs: list[Recurrence], chains: list[ResidualChain],
               rejections: list[Rejection]) -> tuple[list[Recurrence], list[ResidualChain], list[Rejection]]:
    """Without what nothing reads: dead code is no region and no near miss. NB: a rolled loop's two steps peeled at
    trace time to check its carries' metadata stay in dynamo's graph, unused (polyfills/loop_runtime.py)."""
    roots = [n for n in gm.graph.nodes if n.op == "output" or (not n.users and n.is_impure())]
    live: set[fx.Node] = set(roots)
    todo = deque(roots)
    while todo:
        for a in todo.popleft().all_input_nodes:
            if a not in live:
                live.add(a)
                todo.append(a)
    if len(live) == len(gm.graph.nodes):
        return recs, chains, rejections
    dead_names = {n.name for n in gm.graph.nodes if n not in live}
    # NB: a region with one live node is live: nn.LSTM's scan makes the cell's final state, which is often unread
    kept = [r for r in recs if any(n in live for n in (*r.outputs, *r.nodes))]
    kept_chains = [c for c in chains if any(layer.out in live for layer in c.layers)]
    kept_rej = [j for j in rejections if j.node not in dead_names]
    if len(kept) != len(recs) or len(kept_chains) != len(chains) or len(kept_rej) != len(rejections):
        log.debug("recognize: %d region(s) and %d rejection(s) in dead code left out",
                  len(recs) + len(chains) - len(kept) - len(kept_chains), len(rejections) - len(kept_rej))
    return kept, kept_chains, kept_rej


def _drop_time_chains(chains: list[ResidualChain], recs: list[Recurrence]) -> list[ResidualChain]:
    """A gated update unrolled over time (``h = (1 - z) ⊙ h + z ⊙ h̃``) also reads as a gated residual chain; it
    is reported once, as the recurrence."""
    states = {s for r in recs if r.source == "unrolled_loop" for s in r.outputs}
    return [c for c in chains if not all(layer.out in states for layer in c.layers)]


# ----------------------------------------------------------------------------------------------------------------
# time-local neighbourhoods and groups


def _anchors(r: Recurrence) -> tuple[list[tuple[fx.Node, int]], list[tuple[fx.Node, int]]]:
    """(outputs, inputs) of a recurrence as (node, step dim) pairs in the outer graph."""
    scan = next((n for n in r.nodes if is_linear_scan(n) or is_scan_hop(n) or is_associative_scan_hop(n)), None)
    if scan is None:
        return [], []
    if is_linear_scan(scan):
        ins = [(v, r.step_dim) for v in (r.a, r.b) if isinstance(v, fx.Node)]
        return [(scan, r.step_dim)], ins
    outs = [(o, 0) for o in r.outputs
            if o.op == "call_function" and o.target is operator.getitem and _has_len(o, r.length)]
    xs = scan.args[2] if is_scan_hop(scan) else scan.args[1]
    ins = [(x, 0) for x in xs if isinstance(x, fx.Node) and _has_len(x, r.length)]
    return outs, ins


def _has_len(n: fx.Node, T: int | None) -> bool:
    s = hinted_shape(n)
    return bool(s) and T is not None and s[0] == T


def _sources(inputs: list[tuple[fx.Node, int]], T: int) -> dict[fx.Node, int]:
    """Seeds for the sequence inputs the recurrence is computed from: placeholders upstream of its inputs that
    are not parameters or buffers and have one dim of length T (the scan's own dim when there are several)."""
    seeds: dict[fx.Node, int] = {}
    seen: set[fx.Node] = set()
    queue = deque(n for n, _ in inputs)
    want = {d for _, d in inputs}
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            tgt = str(n.target)
            s = hinted_shape(n)
            if s is None or "parameters" in tgt or "buffers" in tgt:
                continue
            dims = [i for i, k in enumerate(s) if k == T]
            if len(dims) == 1:
                seeds[n] = dims[0]
            elif len(want) == 1 and (d := next(iter(want))) in dims and len(s) >= 3:
                seeds[n] = d
            continue
        queue.extend(n.all_input_nodes)
    return seeds


def _neighbourhoods(gm: fx.GraphModule, recs: list[Recurrence]) -> None:
    """Fill ``neighbourhood``, ``bounds`` and ``group`` of each recurrence (DESIGN.md §3 "Regions along time")."""
    by_T: dict[int, list[tuple[Recurrence, list, list]]] = {}
    for r in recs:
        outs, ins = _anchors(r)
        scan_node = any(is_linear_scan(n) for n in r.nodes)
        if r.source == "unrolled_loop" and not scan_node:
            r.details["neighbourhood"] = "per-step values carry no step axis until the loop is re-rolled"
            continue
        if not outs or r.length is None:
            r.bounds = [(r.name, "no step axis to follow from this recurrence's outputs")]
            continue
        by_T.setdefault(r.length, []).append((r, outs, ins))
    uf = nx.utils.UnionFind()
    for T, items in by_T.items():
        seeds: dict[fx.Node, int] = {}
        for _, outs, ins in items:
            seeds.update({n: d for n, d in outs})
            for n, d in list(ins) + list(_sources(ins, T).items()):
                seeds.setdefault(n, d)
        try:
            info = analyze(gm, seeds)
        except ValueError as e:
            log.debug("time-local seeds rejected (%s); seeding the recurrences' outputs only", e)
            info = analyze(gm, {n: d for _, outs, _ in items for n, d in outs})
        for r, outs, ins in items:
            anchors = [n for n, _ in outs]
            if not any(is_linear_scan(n) for n in r.nodes):
                # NB: the scan op's tuple output is no tensor with a step axis; its ys' users and its xs are
                anchors = [u for n in anchors for u in n.users] + [n for n, _ in ins]
            nodes, bounds = region_around(gm, anchors, info)
            r.neighbourhood = nodes
            r.bounds = list(bounds)
            uf[id(r)]
            members = set(nodes)
            for r2, outs2, _ in items:
                if r2 is not r and any(n in members for n, _ in outs2):
                    uf.union(id(r), id(r2))
    groups = [g for g in uf.to_sets() if len(g) > 1]
    gid = {m: i for i, g in enumerate(sorted(groups, key=lambda g: min(_order(recs, x) for x in g))) for m in g}
    for r in recs:
        r.group = gid.get(id(r))


def _order(recs: list[Recurrence], key: Any) -> int:
    return next(i for i, r in enumerate(recs) if id(r) == key)


def recognize_captured(captured: Captured, opts: Options) -> tuple[list[Region], list[Rejection]]:
    """The stage's entry (``backend.py``): :func:`recognize` on a captured graph, once. Never raises: a failure is a
    rejection, and a graph capture left with in-place writes is refused whole, as is a graph that runs a torch.func
    transform."""
    if captured.transform:
        return [], [Rejection("graph", "<graph>", f"the graph runs its inputs under a torch.func transform (vmap, "
                              f"grad or jvp, traced inline: {captured.transform}), whose values are batched or "
                              "wrapped: nothing in it is rewritten, and it keeps ordinary autograd")]
    if captured.writes:
        w = captured.writes[0]
        line = source_line(w)
        return [], [Rejection("graph", w.name, f"the graph writes in place into a tensor it made, or into an input "
                              f"it reads again after the write ({len(captured.writes)} write(s), the first "
                              f"{w.name}{f' at {line}' if line else ''}) in a way that could not be turned into "
                              f"values: it keeps ordinary autograd; {_write_remedy(w)}")]
    try:
        with no_guards(captured.gm) if captured.symbolic else contextlib.nullcontext():
            regions, rejections = recognize(captured.gm, opts, matched=captured.matched)
        if regions and not captured.symbolic and has_generic_scans(captured.gm):
            # NB: a generic-mode associative_scan left as written is a run of vmapped blocks whose levels are
            # order-bound: lowering a region moves nodes among them (a vmap level then leaks: "escaped from inside
            # a function being vmapped"), so the graph is left whole
            return [], rejections + [Rejection(
                "graph", "<graph>", "the graph keeps a generic-mode associative_scan that is not rewritten (its "
                "reason is listed beside this one): its vmapped steps must stay in place, so nothing in this graph "
                "is rewritten and it keeps ordinary autograd; write that scan with adjoint_compile.ops.linear_scan "
                "or with combine_mode='pointwise'")]
        return regions, rejections
    except Exception as e:  # noqa: BLE001 - recognition must fail soft (DESIGN.md §4)
        log.warning("adjoint-compile: recognition failed, the graph keeps ordinary autograd: %s", e, exc_info=True)
        return [], [Rejection("graph", "<graph>", f"recognition raised {type(e).__name__}: {e}")]


#: in-place spellings of an arithmetic update (``h += x``, ``h.mul_(a)``), not writes into a buffer's slice
_OPERATORS = {"iadd": "+", "isub": "-", "imul": "*", "itruediv": "/"}
_METHODS = frozenset("add_ sub_ mul_ div_ addcmul_ lerp_ masked_fill_ clamp_ zero_ fill_".split())


def _write_remedy(w: fx.Node) -> str:
    name = w.target if isinstance(w.target, str) else getattr(w.target, "__name__", "")
    if name in _OPERATORS:
        op = _OPERATORS[name]
        return f"write the update as a new value (h = h {op} x instead of h {op}= x)"
    if name in _METHODS:
        return f"write the update as a new value (h = h.{name[:-1]}(...) instead of h.{name}(...))"
    return ("collect a loop's outputs in a list and torch.stack them, or write each step's whole slice of a buffer "
            "made in the loop's graph (o[:, t] = h)")
