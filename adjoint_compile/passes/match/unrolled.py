"""Recurrences in Python loops that dynamo unrolled (DESIGN.md §4): follow the carry chain, prove that every step
is the same computation, classify the update, and record how to re-roll the steps into one scan.

A loop ``for t in range(T): h = a[:, t] * h + b[:, t]`` reaches us as T copies of the body, one after the other
in graph order. The matcher works in three stages, each linear in the size of the graph:

1. **Carry links.** For every affine-looking state node ``s`` (add, sub, mul, addcmul, ...) the candidate
   previous state is a node ``p`` of the same op and shape inside ``s``'s affine expansion (``s = C ⊙ p + O``
   with ``C != 0``, :func:`~adjoint_compile.analysis.affine.affine`); for a nonlinear state (``tanh``, ...) the
   nearest same-op ancestor within a small radius. Links are kept one-to-one and joined into chains
   (networkx paths) ``c_1 → c_2 → … → c_m``.
2. **Same computation.** Dynamo emits each iteration's ops in program order, so step k is the window of nodes
   after ``c_{k-1}`` up to ``c_k``. Windows 2..m must be equal op by op (same targets, same constants) with the
   same wiring: an argument is either a node of the same window (same offset), of the previous window (same
   offset: a carried value), or the very same node outside the loop (a shared weight). Indices of per-step slices
   (``x[:, t]``, ``select``, ``unbind`` items) may differ but must progress evenly (start + k·stride); those are
   the loop's ``xs``. Step 1 is matched backwards from ``c_1`` along window 2's pattern, which finds the initial
   carry h0 (and the initial values of other carried states). Any difference rejects the whole chain with
   "steps differ at node X".
3. **Classification.** ``c_2`` against ``c_1``: linear (a ⊙ h + b, a and b free of the carried values), gated,
   or general (rejected with the reason).

A chain needs at least 2 steps and at least one per-step slice: a chain of layers that read different weights, or
a weight-tied loop with no per-step input, is a depth chain (see :mod:`.find_residuals`), not a loop over time.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch.fx as fx

from ...analysis import optable as ops
from ...analysis.affine import NotAffine, affine, classify_update
from ...analysis.fx import bfs_inputs, hinted_shape
from ...analysis.fx import reachable as forward_reach
from ...analysis.labels import index_kind, node_args, node_label
from ...analysis.optable import fn_name as _fname
from ...analysis.optable import name_of, op_name
from ...regions import LoopRecipe, PerStepSlice, Recurrence, Rejection

log = logging.getLogger(__name__)

__all__ = ["find_unrolled"]

#: how far (nodes visited) a linear expansion or a nonlinear-state search may look back for the previous state.
_BUDGET = 32
_GENERAL_BUDGET = 32


class _Mismatch(Exception):
    def __init__(self, reason: str, node: fx.Node | None = None, kind: str = "differ") -> None:
        super().__init__(reason)
        self.reason = reason
        self.node = node
        #: "differ" (a real difference between steps) or "inputs" (steps read different outside values:
        #: typical of a layer stack, reported only when the chain otherwise looks like a time loop).
        self.kind = kind


# ----------------------------------------------------------------------------------------------------------------
# stage 1: carry links


@dataclasses.dataclass
class _Ctx:
    nodes: list[fx.Node]
    pos: dict[fx.Node, int]
    labels: dict[fx.Node, tuple[Any, tuple[int, ...]]]

    def label(self, n: fx.Node) -> Any:
        lab = self.labels.get(n)
        if lab is None:
            lab = self.labels[n] = node_label(n)
        return lab[0]

    def ints(self, n: fx.Node) -> tuple[int, ...]:
        self.label(n)
        return self.labels[n][1]


def _affine_pred(s: fx.Node, ctx: _Ctx) -> fx.Node | None:
    """The previous state of ``s`` if ``s`` is affine in a same-op, same-shape node of its linear expansion."""
    same = _same_op(s, ctx)
    # NB: not past a previous state: expanding past it would walk back along the whole chain
    cands = [a for a in bfs_inputs(s, _BUDGET, lambda a: not same(a) and op_name(a) in _THROUGH_AFFINE)
             if same(a)]
    for p in cands:
        reach = forward_reach(p, s, ctx.pos)
        try:
            aff = affine(s, p, reach.__contains__)
        except NotAffine:
            return p  # h*h: a state update nonetheless; classification will say why it is no recurrence
        if aff.coef is not None:
            return p
    return None


def _general_pred(s: fx.Node, ctx: _Ctx) -> fx.Node | None:
    """Nearest same-op, same-shape ancestor of a nonlinear state (``tanh(W h + x)``), within a small radius."""
    same = _same_op(s, ctx)
    return next((a for a in bfs_inputs(s, _GENERAL_BUDGET, lambda a: not same(a)) if same(a)), None)


def _matrix_pred(s: fx.Node, ctx: _Ctx) -> fx.Node | None:
    """A same-op, same-shape node that reaches ``s`` through a matrix product (``h = h @ A + b_t``): a dense linear
    recurrence, which has no elementwise coefficient; linked only to report it as a near miss."""
    same = _same_op(s, ctx)
    for m in bfs_inputs(s, _BUDGET, lambda a: not same(a) and op_name(a) in _THROUGH_MATMUL):
        if op_name(m) in _MATRIX_OPS:
            p = next((a for a in m.all_input_nodes if same(a)), None)
            if p is not None:
                return p
    return None


_THROUGH_AFFINE = ops.LINEAR_IN_CARRY | ops.SELECT_OPS
_MATRIX_OPS = ops.MATMULS | {"linear"}
_THROUGH_MATMUL = ops.LINEAR_IN_CARRY | _MATRIX_OPS


def _same_op(s: fx.Node, ctx: _Ctx) -> Callable[[fx.Node], bool]:
    """Whether a node is an op like ``s``: same label (op and constants), same shape."""
    lab, shp = ctx.label(s), hinted_shape(s)
    return lambda a: a.op in ("call_function", "call_method") and ctx.label(a) == lab and hinted_shape(a) == shp


def _chains(ctx: _Ctx) -> list[tuple[list[fx.Node], str]]:
    """Chains of states c_1 → … → c_m (m >= 2) with the kind of their links ("affine" or "general")."""
    links: dict[fx.Node, tuple[fx.Node, str]] = {}
    for s in ctx.nodes:
        if s.op not in ("call_function", "call_method") or hinted_shape(s) is None:
            continue
        name = op_name(s)
        p, kind = None, ""
        if name in ops.STATE_OPS or name in ops.SELECT_OPS:
            p, kind = _affine_pred(s, ctx), "affine"
        if p is None and (name in ops.NONLINEAR_STATE or _fname(s) in ops.NONLINEAR_STATE):
            p, kind = _general_pred(s, ctx), "general"
        if p is not None:
            links[s] = (p, kind)
    succ: dict[fx.Node, list[fx.Node]] = {}
    for s, (p, _) in links.items():
        succ.setdefault(p, []).append(s)
    g = nx.DiGraph()
    for p, ss in succ.items():
        if len(ss) > 1:
            # NB: several ops of one step can be affine in the carry (h + x inside a gate, and the new h); the
            # step's new state is the last of them. A wrong pick is caught by the window check, never accepted.
            affine_ss = [s for s in ss if links[s][1] == "affine"]
            if not affine_ss:
                continue
            ss = [max(affine_ss, key=ctx.pos.__getitem__)]
        g.add_edge(p, ss[0], kind=links[ss[0]][1])
    out = _paths(g, ctx, lambda kinds: "affine" if kinds == {"affine"} else "general")
    # NB: matrix links only among states no other chain holds, so they add near-miss reports and change nothing else
    dense = nx.DiGraph()
    for s in ctx.nodes:
        if s not in g and op_name(s) in ops.STATE_OPS and hinted_shape(s) is not None:
            p = _matrix_pred(s, ctx)
            if p is not None and p not in g and (p not in dense or not dense.out_degree(p)):
                dense.add_edge(p, s, kind="matrix")
    out += _paths(dense, ctx, lambda kinds: "matrix")
    return sorted(out, key=lambda c: ctx.pos[c[0][0]])


def _paths(g: nx.DiGraph, ctx: _Ctx, kind: Callable[[set[str]], str]) -> list[tuple[list[fx.Node], str]]:
    out = []
    for comp in nx.weakly_connected_components(g):
        path = sorted(comp, key=ctx.pos.__getitem__)
        if len(path) >= 2 and all(g.has_edge(path[i], path[i + 1]) for i in range(len(path) - 1)):
            out.append((path, kind({g.edges[path[i], path[i + 1]]["kind"] for i in range(len(path) - 1)})))
    return out


# ----------------------------------------------------------------------------------------------------------------
# stage 2: same computation


@dataclasses.dataclass
class _Loop:
    anchors: list[fx.Node]
    #: window k (k = 2..m) as node lists; windows[0] is window 2 (the template).
    windows: list[list[fx.Node]]
    #: template node -> step-1 node (empty when step 1 did not match)
    step1: dict[fx.Node, fx.Node]
    first_step_ok: bool
    first_step_reason: str
    #: template-relative offsets in the previous window (carried values) -> initial value node
    init: dict[int, Any]
    #: (template node or per-step slice, position in its index ints) -> {step number: index value}
    slots: dict[tuple[fx.Node, int], dict[int, int]]
    shared: list[fx.Node]


def _check_windows(chain: list[fx.Node], ctx: _Ctx) -> _Loop:
    pos = ctx.pos
    m = len(chain)
    windows = [ctx.nodes[pos[chain[k - 1]] + 1: pos[chain[k]] + 1] for k in range(1, m)]
    L = len(windows[0])
    tmpl = windows[0]
    start = pos[tmpl[0]]
    slots: dict[tuple[fx.Node, int], dict[int, int]] = {}
    shared: dict[fx.Node, None] = {}
    for k in range(1, len(windows)):
        w, prev = windows[k], windows[k - 1]
        for j, (u, v) in enumerate(zip(tmpl, w)):
            if ctx.label(u) != ctx.label(v):
                raise _Mismatch(f"steps differ at node {v.name}: step {k + 2} has {_describe(v)} where step 2 has "
                                f"{_describe(u)}", v)
            for au, av in zip(node_args(u), node_args(v)):
                if au is av and pos[au] < start:
                    shared[au] = None
                    continue
                pa = pos[au]
                if start <= pa < start + L:
                    if av is not w[pa - start]:
                        raise _Mismatch(f"steps differ at node {v.name}: its input {av.name} is wired differently",
                                        v)
                elif start - L <= pa < start and av is prev[pa - start + L]:
                    pass
                elif _same_slice(au, av, ctx):
                    # NB: per-step slices made before the loop (``for x_t in x.unbind(1)``)
                    _add_slot(slots, au, av, k, ctx)
                else:
                    raise _Mismatch(f"steps read different inputs at node {v.name}: {av.name} where step 2 reads "
                                    f"{au.name}", v, kind="inputs")
            _add_slot(slots, u, v, k, ctx)
        if len(w) != L:
            raise _Mismatch(f"steps differ in size: step {k + 2} has {len(w)} ops, step 2 has {L}", chain[k + 1])
    if len(windows) == 1:
        for u in tmpl:
            for q, val in enumerate(ctx.ints(u)):
                slots[(u, q)] = {2: val}
            for au in node_args(u):
                if pos[au] < start and index_kind(au):
                    for q, val in enumerate(ctx.ints(au)):
                        slots[(au, q)] = {2: val}
    # step 1, matched backwards from c_1 along the template
    step1: dict[fx.Node, fx.Node] = {tmpl[-1]: chain[0]}
    init: dict[int, Any] = {}
    ok, why = True, ""
    carried = forward_reach(chain[0], chain[1], pos)
    for j in range(L - 1, -1, -1):
        u = tmpl[j]
        u1 = step1.get(u)
        if u1 is None:
            continue
        if not isinstance(u1, fx.Node) or u1.op not in ("call_function", "call_method") or \
                ctx.label(u) != ctx.label(u1):
            if u in carried and u is not tmpl[-1]:
                init[j] = u1  # NB: a carried value computed at the end of a step (rotated loop body)
                del step1[u]
                continue
            ok, why = False, f"step 1 differs at node {getattr(u1, 'name', u1)} (the loop's first iteration is special)"
            break
        for au, a1 in zip(node_args(u), node_args(u1)):
            if au is a1:
                continue
            pa = pos[au]
            if (au, 0) in slots and _same_slice(au, a1, ctx):
                step1[au] = a1
            elif start <= pa < start + L:
                if au in step1 and step1[au] is not a1:
                    ok, why = False, f"step 1 is wired differently at node {u1.name}"
                    break
                step1[au] = a1
            elif start - L <= pa < start:
                if init.setdefault(pa - start + L, a1) is not a1:
                    ok, why = False, f"step 1 reads two initial values for one carried value at node {u1.name}"
                    break
            else:
                ok, why = False, f"step 1 reads {a1.name} where the other steps read {au.name}"
                break
        if not ok:
            break
    if ok:
        # NB: slices off the carry's path (a per-step readout) have no step-1 counterpart on that path; their
        # progression is read from steps 2..m.
        for (u, q), vals in slots.items():
            if u in step1 and len(ctx.ints(step1[u])) > q:
                vals[1] = ctx.ints(step1[u])[q]
    if not ok:
        step1, init = {}, {}
    return _Loop(chain, windows, step1, ok, why, init, slots, list(shared))


def _same_slice(au: fx.Node, av: fx.Node, ctx: _Ctx) -> bool:
    """Both are the same indexing op of the same source (maybe at different indices)."""
    return bool(index_kind(au)) and ctx.label(au) == ctx.label(av) and bool(au.args) and bool(av.args) \
        and au.args[0] is av.args[0]


def _add_slot(slots: dict[tuple[fx.Node, int], dict[int, int]], u: fx.Node, v: fx.Node, k: int, ctx: _Ctx) -> None:
    iu, iv = ctx.ints(u), ctx.ints(v)
    for q in range(min(len(iu), len(iv))):
        vals = slots.setdefault((u, q), {})
        vals[2] = iu[q]
        vals[k + 2] = iv[q]


def _describe(n: fx.Node) -> str:
    return f"{name_of(n) or n.op}({', '.join(a.name for a in n.all_input_nodes)})"


# ----------------------------------------------------------------------------------------------------------------
# stage 3: classification and the record


def _xs(loop: _Loop, ctx: _Ctx) -> list[PerStepSlice]:
    """Per-step slices: index slots whose value progresses by a nonzero stride. Raises on uneven progressions."""
    xs = []
    for (u, q), by_step in loop.slots.items():
        vals = [by_step[k] for k in sorted(by_step)]
        steps = [b - a for a, b in zip(vals, vals[1:])]
        if len(set(steps)) > 1:
            raise _Mismatch(f"steps differ at node {u.name}: its index does not progress evenly ({vals[:6]})", u)
        if steps and steps[0] != 0:
            src = u.args[0] if u.args else None
            xs.append(PerStepSlice(node=u, source=src if isinstance(src, fx.Node) else None, op=index_kind(u),
                                   dim=_slot_dim(u, q), index_position=q, first_step=min(by_step), start=vals[0],
                                   stride=steps[0]))
    return xs


def _slot_dim(u: fx.Node, q: int) -> int | None:
    """The source dim that the q-th varying int of an indexing node indexes (None when not readable)."""
    kind = index_kind(u)
    if kind in ("select", "narrow"):
        d = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
        return d if isinstance(d, int) else None
    idx = u.args[1] if len(u.args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(it is Ellipsis for it in items):
        return None
    dim, k = 0, 0
    for it in items:
        if it is None:
            continue  # a new axis: indexes no source dim
        n_ints = sum(isinstance(v, int) and not isinstance(v, bool)
                     for v in ((it.start, it.stop, it.step) if isinstance(it, slice) else (it,)))
        if q < k + n_ints:
            return dim
        k += n_ints
        dim += 1
    return None


def _match_chain(chain: list[fx.Node], link_kind: str, ctx: _Ctx) -> tuple[Recurrence | None, Rejection | None]:
    try:
        loop = _check_windows(chain, ctx)
        xs = _xs(loop, ctx)
    except _Mismatch as e:
        if len(chain) > 3 and e.node is not None and ctx.pos[e.node] > ctx.pos[chain[-2]]:
            # NB: the last link is a readout of the final state that is affine in it (``y = c_t * h + D * x_t``):
            # at every other step the next state follows it, and is the one linked
            return _match_chain(chain[:-1], link_kind, ctx)
        if e.kind == "inputs" or link_kind == "matrix" or not _reads_slices(chain, ctx):
            # NB: a chain of layers (different weights, attention then MLP) is a depth chain: not reported here
            log.debug("chain at %s is not a loop over time: %s", chain[-1].name, e.reason)
            return None, None
        return None, Rejection("recurrence", chain[-1].name, f"unrolled loop of {len(chain)} steps: {e.reason}")
    if not xs:
        log.debug("chain at %s has no per-step input: a weight-tied layer loop, not a loop over time", chain[-1].name)
        return None, None
    T = len(chain) if loop.first_step_ok else len(chain) - 1
    tmpl = loop.windows[0]
    L = len(tmpl)
    c_prev, c_new = chain[0], chain[1]
    if T < 2:
        return None, Rejection("recurrence", chain[-1].name, f"a loop of one step is not a recurrence "
                                                              f"({loop.first_step_reason})")
    # carried values of the template: the previous window's nodes it reads (besides shared ones)
    start = ctx.pos[tmpl[0]]
    carried_in: list[fx.Node] = []
    # NB: per-step slices made before the loop (unbind items) may sit just before the template: not carried values
    slices = {u for u, _ in loop.slots if ctx.pos[u] < start}
    for u in tmpl:
        for a in node_args(u):
            if start - L <= ctx.pos[a] < start and a not in loop.shared and a not in carried_in and a not in slices:
                carried_in.append(a)
    reach = forward_reach(list(carried_in) or [c_prev], c_new, ctx.pos)
    form = classify_update(c_new, c_prev, reach.__contains__)
    if link_kind == "matrix" and form.kind != "general":
        return None, None  # NB: matrix links exist to report dense recurrences; anything else is not ours to judge
    if form.kind == "general":
        return None, Rejection("recurrence", chain[-1].name, f"unrolled loop of {T} steps: {form.reason}")
    h0 = loop.init.get(L - 1) if loop.first_step_ok else chain[0]
    states = chain if loop.first_step_ok else chain[1:]
    nodes = sorted(set(loop.step1.values()) | {n for w in loop.windows for n in w}, key=ctx.pos.__getitem__)
    nodes = [n for n in nodes if isinstance(n, fx.Node)]
    stacked = _stacked_by(chain[-1], states)
    node_or_none = lambda v: v if isinstance(v, fx.Node) else None  # noqa: E731
    reroll = LoopRecipe(
        steps=T, step_ops=L, states=list(states), template_step=list(tmpl), h0=node_or_none(h0), xs=xs,
        shared=list(loop.shared),
        carried=[(a, node_or_none(loop.init.get(ctx.pos[a] - start + L))) for a in carried_in],
        rotated=[(tmpl[j], node_or_none(v)) for j, v in sorted(loop.init.items())
                 if j != L - 1 and tmpl[j] not in carried_in],
        first_step_matched=loop.first_step_ok, first_step_reason=loop.first_step_reason, stacked_by=stacked,
    )
    kind = "linear_recurrence" if form.kind == "linear" else "gated_recurrence"
    details = form.describe()
    if form.kind == "gated":
        details["gated_because"] = form.reason
    details["template"] = "a and b name nodes of step 2 (the template step)"
    rec = Recurrence(
        kind=kind, source="unrolled_loop", length=T, nodes=nodes,
        name=states[-1].name, a=form.coef.node if form.coef is not None else None,
        b=form.offset.node if form.offset is not None else None, h0=h0 if isinstance(h0, fx.Node) else None,
        carry=c_prev, outputs=list(states), step_dim=0, details=details, reroll=reroll,
    )
    return rec, None


def _reads_slices(chain: list[fx.Node], ctx: _Ctx) -> bool:
    """Whether step 2 reads a slice of a tensor made before the loop (``a[:, t]``, an ``unbind`` item): the mark of
    a loop over time, as opposed to a stack of layers."""
    start, end = ctx.pos[chain[0]], ctx.pos[chain[1]]
    first = ctx.pos[chain[0]] - (end - start)
    for u in ctx.nodes[start + 1: end + 1]:
        for a in [u] + node_args(u):
            if index_kind(a) and a.args and isinstance(a.args[0], fx.Node) and ctx.pos[a.args[0]] < first:
                return True
    return False


def _stacked_by(last: fx.Node, states: list[fx.Node]) -> dict[str, Any] | None:
    """The stack/cat node that collects the states in order (``torch.stack(outs, dim)``), if any."""
    for u in last.users:
        if _fname(u) in ("stack", "cat") and u.args and isinstance(u.args[0], (list, tuple)):
            items = list(u.args[0])
            if items[-len(states):] == states or items == states:
                dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
                return {"node": u.name, "op": _fname(u), "dim": dim}
    return None


def find_unrolled(gm: fx.GraphModule) -> tuple[list[Recurrence], list[Rejection]]:
    """Recurrences in unrolled loops of ``gm``, and the rejected loop-like chains with their reasons."""
    nodes = list(gm.graph.nodes)
    ctx = _Ctx(nodes, {n: i for i, n in enumerate(nodes)}, {})
    regions: list[Recurrence] = []
    rejections: list[Rejection] = []
    results = []
    for chain, kind in _chains(ctx):
        try:
            rec, rej = _match_chain(chain, kind, ctx)
        except Exception as e:  # noqa: BLE001 - never raise on odd graphs
            log.debug("unrolled matcher failed on chain at %s", chain[-1].name, exc_info=True)
            rec, rej = None, Rejection("recurrence", chain[-1].name, f"matcher error {type(e).__name__}: {e}")
        # NB: a recurrence's own last state, which is not the chain's last node when a readout ended the chain
        span = (ctx.pos[chain[0]], ctx.pos[rec.outputs[-1] if rec is not None and rec.outputs else chain[-1]])
        results.append((rec, rej, span, len(chain)))
    # NB: one loop can show several chains (h = a*h + b links both the adds and the a*h products); keep the chain
    # with the most steps, then the one whose states come last in each step (the loop's real carry).
    taken: list[tuple[int, int]] = []
    overlaps = lambda sp: any(sp[0] <= t[1] and t[0] <= sp[1] for t in taken)  # noqa: E731
    recs = [r for r in results if r[0] is not None]
    recs.sort(key=lambda r: (-(r[0].length or 0), -r[2][1]))
    for rec, _, span, _ in recs:
        if not overlaps(span):
            regions.append(rec)
            taken.append(span)
    rejs = [r for r in results if r[1] is not None]
    rejs.sort(key=lambda r: (-r[3], -r[2][1]))
    for _, rej, span, _ in rejs:
        if not overlaps(span):
            rejections.append(rej)
            taken.append(span)
    regions.sort(key=lambda r: ctx.pos[r.outputs[-1]])
    return regions, rejections
