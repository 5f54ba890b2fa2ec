"""Re-roll recurrences into one ``linear_scan`` node (DESIGN.md §3 "Unrolled loops are re-rolled into one scan first").

Recognition finds linear recurrences h_t = a_t ⊙ h_{t-1} + b_t in four capture forms; the exact lowering
(:mod:`.lower_adjoint`) handles one of them, the ``linear_scan`` node. This pass rewrites the other three so that
each recurrence becomes

    A = a for all steps at once      [T, *state]   (step axis first)
    B = b for all steps at once      [T, *state]
    H = linear_scan(A, B, h0, dim=0) [T, *state]   H[t] = A[t] ⊙ H[t-1] + B[t],  H[-1] := h0

and every former use of a per-step state (or of the scan op's outputs) reads from H:

* ``unrolled_loop`` (a Python loop dynamo unrolled): state k is ``H[k]``; a ``torch.stack`` of all states along
  ``d`` becomes ``H.movedim(0, d)`` (flipped along ``d`` when they are stacked in reverse, as a loop over
  ``reversed(range(T))`` does). A and B come, in order of preference, from

  - the *batched* step: the template step's computation of a_t and b_t re-emitted once for all steps, with each
    per-step slice ``x[:, t]`` replaced by the whole sequence ``x.movedim(1, 0)`` (op by op, under rules that
    are exact for every op they accept: pointwise ops with broadcasting, ``matmul``/``linear`` with the step on the
    left, feature-dim norms, reductions and views with their dims shifted). These ops keep the step axis, so the
    sharded lowering can include them in its time-local region;
  - the *stacked* steps: ``torch.stack`` of the per-step a_k and b_k already in the graph, each proven by its own
    affine expansion of h_k in h_{k-1} (no reliance on the loop's same-computation proof).

* ``scan`` (``torch.ops.higher_order.scan``): the step sub-graph's a and b batched over the scan's ``xs`` (which
  dynamo already moved to dim 0); the final carry is ``H[-1]``; each ``ys`` output is ``H`` when it is the new
  state, else its step computation batched with the new state as ``H`` and the old one as ``[h0, H[:-1]]``.
  Every carry of the op must be linear, so that the op itself disappears.
* ``associative_scan`` with the linear combine: A and B are its leaves (a = 1 for a running sum); a running
  product leaf is ``linear_scan(a, 0, h0=1)``.

Soft failure: a recurrence whose rewrite cannot be proven keeps its nodes untouched, ``region.not_rerolled`` says
why (also recorded on its anchor node as ``meta["adjoint_compile"] = {"pass": "reroll", "not_rerolled": why}``, so
that recognition of the normalized graph can report it), and the pass goes on with the next one. New nodes carry
``node.meta["adjoint_compile"] = {"pass": "reroll", "source": ..., "region": ...}``;
:func:`~adjoint_compile.passes.match.find_recurrences.match_linear_scan` reads it back, so the scan is recognized under
the capture form and the name the user wrote it with.

Part of the capture stage (:func:`~adjoint_compile.passes.capture.capture`): the graph is normalized once, before
recognition runs on it. The batched re-emission (values, the emitter that can take its nodes back, the per-op
rules) is :mod:`.batching`.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.affine import classify_update
from ...analysis.fx import eliminate_dead_code, example_value, hinted_shape, is_copy
from ...analysis.fx import reachable as forward_reach, stable_toposort as _toposort
from ...regions import PROVENANCE, LoopRecipe, PerStepSlice, Recurrence, Region
from ..match.find_recurrences import classify_carries
from .batching import Batcher, Emitter, Value, batch_op, coefficients, emit_expr, emit_scan, full_steps, initial_state
from .batching import Unproven as _Unproven
from .batching import scan_op as _scan_op

log = logging.getLogger(__name__)

__all__ = ["reroll", "needs_reroll", "step_sequence", "REROLL_SOURCES"]

#: the capture forms this pass turns into a linear_scan node.
REROLL_SOURCES = ("scan", "associative_scan", "unrolled_loop")


def needs_reroll(region: Region) -> bool:
    """True for a linear recurrence captured as a scan op, an associative_scan op or an unrolled loop (not yet a
    linear_scan: capture's scan_forms pass makes one for ``associative_scan`` in generic mode)."""
    return isinstance(region, Recurrence) and region.kind == "linear_recurrence" and \
        region.source in REROLL_SOURCES and region.rerolled_from is None


# ----------------------------------------------------------------------------------------------------------------
# unrolled loops


def _slice_seq(b: Batcher, slot: fx.Node, xs: list[PerStepSlice], first_step: int) -> Value:
    """The whole sequence [T, ...] that a per-step slice ``slot`` (``x[:, t]``, ``x[:, t:t + 1]``, ``select``, an
    unbind item) reads; ``xs``: its varying index ints (two for a one-step slice ``t:t + 1``)."""
    x = min(xs, key=lambda v: v.index_position)
    if any(v.first_step != first_step for v in xs):
        raise _Unproven(f"slice {slot.name} has no value recorded for the loop's first step")
    stride, start = x.stride, x.start
    if stride not in (1, -1) or not isinstance(start, int):
        raise _Unproven(f"slice {slot.name} steps by {stride}, not by 1 or -1")
    src, dim, keep = None, None, False
    fname = batch_op(slot) or getattr(slot.target, "__name__", str(slot.target))
    if slot.op == "call_function" and slot.target is operator.getitem and slot.args:
        base, idx = slot.args[0], slot.args[1]
        if isinstance(base, fx.Node) and base.op in ("call_function", "call_method") and \
                (base.target == "unbind" or getattr(base.target, "__name__", "") == "unbind"):
            if isinstance(idx, int) and base.args and len(xs) == 1:
                src = base.args[0]
                dim = base.args[1] if len(base.args) > 1 else base.kwargs.get("dim", 0)
        else:
            src, dim, keep = _one_step_item(base, idx, xs)
    elif fname == "select" and x.index_position == 0 and len(xs) == 1:
        src = slot.args[0]
        dim = slot.args[1] if len(slot.args) > 1 else slot.kwargs.get("dim")
    if not isinstance(src, fx.Node) or not isinstance(dim, int) or hinted_shape(src) is None:
        raise _Unproven(f"slice {slot.name} is not x[..., t, ...], x[..., t:t + 1, ...], select or an unbind item")
    size = hinted_shape(src)
    dim = dim % len(size)
    if not b.outer_ok(src):
        raise _Unproven(f"slice {slot.name} reads {src.name}, which is computed inside the loop")
    key = (src, dim, start + size[dim] if start < 0 else start, stride, keep)
    if key not in b.seqs:  # NB: x[:, t] read twice in a step (dynamo slices once per use) is one sequence
        b.seqs[key] = Value(step_sequence(b.em, b.T, src, dim, start, stride, keep, f"slice {slot.name}"), True)
    return b.seqs[key]


def step_sequence(em: Emitter, T: int, src: fx.Node, dim: int, start: int, stride: int, keep: bool,
                  what: str) -> fx.Node:
    """The T steps that a loop reads one a step from ``src`` along ``dim`` (``src[..., start + stride * t, ...]``,
    ``start`` < 0 counting from the end, ``stride`` ±1) as one [T, ...] node: ``dim`` moved to the front, narrowed to
    the steps read, flipped when they run backwards, with a kept unit dim (``x[..., t:t + 1, ...]``) at ``dim + 1``.
    Raises Unproven (naming ``what``) when the steps run past an end of ``dim``."""
    n = hinted_shape(src)[dim]
    start = start + n if start < 0 else start
    lo = start if stride == 1 else start - T + 1
    if not (0 <= lo and lo + T <= n):
        raise _Unproven(f"{what} reads steps {lo}..{lo + T - 1} of {n}")
    seq = em(torch.movedim, (src, dim, 0)) if dim else src
    if lo != 0 or T != n:
        seq = em(torch.narrow, (seq, 0, lo, T))
    if stride == -1:
        seq = em(torch.flip, (seq, [0]))
    if keep:
        seq = em(torch.unsqueeze, (seq, dim + 1))
    return seq


def _one_step_item(base: Any, idx: Any, xs: list[PerStepSlice]) -> tuple[Any, Any, bool]:
    """(source, dim, keeps the dim) of ``base[idx]`` with one varying item, ``t`` or ``t:t + 1``, and full slices
    around it; (None, None, False) otherwise."""
    items = idx if isinstance(idx, tuple) else (idx,)
    q = 0
    found = None
    for i, it in enumerate(items):
        if isinstance(it, int) and not isinstance(it, bool):
            ints, one = [q], True
        elif isinstance(it, slice) and all(v is None or isinstance(v, int) for v in (it.start, it.stop, it.step)):
            ints = [q + k for k, v in enumerate((it.start, it.stop, it.step)) if v is not None]
            one = isinstance(it.start, int) and isinstance(it.stop, int) and it.stop - it.start == 1 and \
                it.step in (None, 1)
            if not ints:
                continue
        else:
            return None, None, False
        if found is not None or not one or sorted(v.index_position for v in xs) != ints[:len(xs)] or \
                len(ints) - (1 if isinstance(it, slice) and it.step is not None else 0) != len(xs):
            return None, None, False
        found = (i, isinstance(it, slice))
        q += len(ints)
    if found is None:
        return None, None, False
    return base, found[0], found[1]


def _loop(gm: fx.GraphModule, r: Recurrence) -> tuple[LoopRecipe, dict[fx.Node, int]]:
    """The record's recipe, checked against the graph as it is now; and the position of every node."""
    recipe = r.reroll
    if recipe is None:
        raise _Unproven("the record has no re-roll recipe")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    gone = [n.name for n in (*recipe.states, *recipe.template_step, *(c for c, _ in recipe.carried),
                             *(x.node for x in recipe.xs)) if n not in pos]
    if gone:
        raise _Unproven(f"the loop's node {gone[0]} is no longer in the graph")
    if recipe.h0 is None and recipe.first_step_matched:
        # NB: step 1 matched the template but not where it reads the state: a loop of alternating steps
        raise _Unproven("steps differ: the first step does not read the loop's state where the others do (do the "
                        "loop's steps alternate?); write every step as the same computation")
    if recipe.h0 is None or recipe.h0 not in pos:
        raise _Unproven("the loop's initial state is not a graph value")
    if len(recipe.states) != r.length or len(recipe.states) < 2:
        raise _Unproven(f"the re-roll recipe has {len(recipe.states)} states for {r.length} steps")
    return recipe, pos


def _unrolled_batched(gm: fx.GraphModule, r: Recurrence, em: Emitter, recipe: LoopRecipe,
                      pos: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node]:
    """A and B from the template step batched over the loop's per-step slices."""
    states, h0 = recipe.states, recipe.h0
    T = len(states)
    matched = recipe.first_step_matched
    tmpl_new, tmpl_prev = (states[1], states[0]) if matched else (states[0], h0)
    template = recipe.template_step
    carried = [c for c, _ in recipe.carried]
    if template[-1] is not tmpl_new:
        raise _Unproven("the template step does not end in the loop's state")
    loop_start = min(pos[n] for n in r.nodes if n in pos) if r.nodes else pos[states[0]]
    depends = forward_reach([tmpl_prev, *carried], tmpl_new, pos).__contains__
    form = classify_update(tmpl_new, tmpl_prev, depends)
    if form.kind != "linear":
        raise _Unproven(f"the template step is not linear in the carry ({form.reason})")
    inside = set(template)
    slots: dict[fx.Node, list[PerStepSlice]] = {}
    for x in recipe.xs:
        slots.setdefault(x.node, []).append(x)
    first = 1 if matched else 2
    b = Batcher(em, T, {}, inside.__contains__, lambda v: pos.get(v, len(pos)) < loop_start and v not in slots)
    b.lazy = {n: (lambda n=n, x=x: _slice_seq(b, n, x, first)) for n, x in slots.items()}
    state = hinted_shape(tmpl_new)
    return coefficients(b, form, state)


def _unrolled_stacked(gm: fx.GraphModule, r: Recurrence, em: Emitter, recipe: LoopRecipe,
                      pos: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node]:
    """A and B as stacks of the per-step a_k, b_k, each from the affine expansion of h_k in h_{k-1}."""
    states, h0 = recipe.states, recipe.h0
    T = len(states)
    state = hinted_shape(states[-1])
    chain = forward_reach([h0, *states]).__contains__
    b = Batcher(em, T, {}, lambda v: False, lambda v: not chain(v))
    a_k, b_k = [], []
    for k, s in enumerate(states):
        prev = h0 if k == 0 else states[k - 1]
        form = classify_update(s, prev, chain)
        if form.kind != "linear":
            raise _Unproven(f"step {k + 1} is not linear in the state ({form.reason or form.kind})")
        a = emit_expr(b, form.coef, b.value)
        bb = emit_expr(b, form.offset, b.value) if form.offset is not None else Value(0.0, False)
        ev = example_value(s)
        for v, out in ((a, a_k), (bb, b_k)):
            if isinstance(v.node, fx.Node):
                out.append(v.node if hinted_shape(v.node) == state else em("expand", (v.node, *state), method=True))
            else:
                # NB: not full_like(s): every use of s becomes H[k], so A or B would read H (a cycle)
                out.append(em(torch.full, (tuple(state), v.node), {"dtype": ev.dtype, "device": ev.device}))
    return em(torch.stack, (a_k, 0)), em(torch.stack, (b_k, 0))


def _reroll_unrolled(gm: fx.GraphModule, r: Recurrence, prov: dict[str, Any]) -> tuple[fx.Node, str]:
    recipe, pos = _loop(gm, r)
    states, h0 = recipe.states, recipe.h0
    T, state = len(states), hinted_shape(states[-1])
    dtype = example_value(states[-1]).dtype
    if state is None:
        raise _Unproven("the state has no static shape")
    why = []
    for how, build in (("batched", _unrolled_batched), ("stacked", _unrolled_stacked)):
        em = Emitter(gm, prov, at=states[-1])
        try:
            A, B = build(gm, r, em, recipe, pos)
            H = emit_scan(em, A, B, h0, T, state, dtype)
        except _Unproven as e:
            em.rollback()
            why.append(f"{how}: {e}")
            log.debug("reroll %s: the %s form is not provable: %s", r.name, how, e)
            continue
        _commit_states(gm, em, H, states, r)
        if why:
            r.details["reroll_batched_failed"] = why[0]
        return H, how
    raise _Unproven("; ".join(why))


def _commit_states(gm: fx.GraphModule, em: Emitter, H: fx.Node, states: list[fx.Node], r: Recurrence) -> None:
    """Every use of state k reads H[k]; a stack of exactly the states along d is H.movedim(0, d) (flipped: in
    reverse)."""
    for u in list(states[-1].users):
        d = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
        order = list(u.args[0]) if u.target is torch.stack and u.args else None
        if isinstance(d, int) and order in (states, states[::-1]):
            nd = len(hinted_shape(states[-1])) + 1
            mv = em(torch.movedim, (H, 0, d % nd))
            if order != states:
                mv = em(torch.flip, (mv, [d % nd]))
            u.replace_all_uses_with(mv)
            gm.graph.erase_node(u)
    used = [(k, s) for k, s in enumerate(states) if s.users]
    # NB: the example values of all T reads H[k] from one fake unbind: fake-tensor dispatch of T selects, one at a
    # time, was ~0.4 ms each, the largest part of re-rolling a loop at T = 8192
    views = None
    if len(used) > 1:
        try:
            views = em.value(torch.unbind, (H, 0))
        except _Unproven:  # NB: then each read computes its own, as before
            views = None
    for k, s in used:
        s.replace_all_uses_with(em(operator.getitem, (H, k), value=None if views is None else views[k]))


# ----------------------------------------------------------------------------------------------------------------
# scan and associative_scan ops


def _sub(gm: fx.GraphModule, ref: Any) -> fx.GraphModule:
    sub: Any = gm if isinstance(ref, fx.Node) and ref.op == "get_attr" else None
    for part in str(ref.target).split(".") if sub is not None else ():
        sub = getattr(sub, part, None)
    if isinstance(sub, fx.GraphModule):
        return sub
    raise _Unproven("the step function is not a readable sub-graph")


def _items(node: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            out.setdefault(u.args[1], []).append(u)
        else:
            raise _Unproven(f"{node.name} is used by {u.name} other than through its outputs")
    return out


def _reroll_scan(gm: fx.GraphModule, node: fx.Node, recs: list[Recurrence], prov: dict[str, Any]) -> list[fx.Node]:
    """Rewrite one ``scan`` op whose every carry is a linear recurrence; returns one linear_scan node per carry."""
    sub = _sub(gm, node.args[0])
    init, xs = list(node.args[1]), list(node.args[2])
    add = list(node.args[3]) if len(node.args) > 3 else []
    if node.kwargs:
        raise _Unproven(f"the scan op has keyword arguments {sorted(node.kwargs)}")
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    n_c, n_x = len(init), len(xs)
    if len(phs) != n_c + n_x + len(add) or len(results) < n_c:
        raise _Unproven("the step sub-graph's signature does not match the scan's operands")
    by_carry = {r.carry_index: r for r in recs}
    if sorted(k for k in by_carry if isinstance(k, int)) != list(range(n_c)):
        missing = [i for i in range(n_c) if i not in by_carry]
        raise _Unproven(f"carry {missing[0]} of the scan is not a linear recurrence; the op must stay")
    if not xs or hinted_shape(xs[0]) is None:
        raise _Unproven("the scan has no sequence input with a static length")
    T = hinted_shape(xs[0])[0]
    items = _items(node)
    carries, news, ys = phs[:n_c], results[:n_c], results[n_c:]
    with Emitter(gm, prov, at=node) as em:  # NB: an unproven rewrite takes back every node it made
        leaves = {p: Value(x, True) for p, x in zip(phs[n_c:n_c + n_x], xs)}
        leaves.update({p: Value(a, False) for p, a in zip(phs[n_c + n_x:], add)})
        in_sub = {n for n in sub.graph.nodes if n.op in ("call_function", "call_method")}
        b = Batcher(em, T, leaves, in_sub.__contains__, lambda v: False)
        Hs: dict[int, fx.Node] = {}
        # NB: in the order the carries solve in (a stacked carry's a and b read the states of those before it)
        for i, form in classify_carries(carries, news).items():
            if form.kind != "linear":
                raise _Unproven(f"carry {i}: {form.reason or form.kind}")
            state = hinted_shape(init[i])
            if state is None:
                raise _Unproven(f"carry {i} has no static shape")
            A_full, B_full = coefficients(b, form, state)
            Hs[i] = emit_scan(em, A_full, B_full, init[i], T, state, example_value(init[i]).dtype)
            # the states known for all steps: new state i -> H_i, carry i -> [h0, H_i[:-1]] (dead code if unread)
            b.memo[news[i]] = Value(Hs[i], True)
            # NB: and the value a new state copies (the loop roller returns clones of one h as the carry and as the
            # appended output): read from H_i too, not recomputed from [h0, H_i[:-1]] as one more step outside the
            # scan, which under the truncated adjoint would widen every window by that step
            src = news[i]
            while is_copy(src) and isinstance(src.args[0], fx.Node) and src.args[0] not in b.memo:
                src = src.args[0]
                b.memo[src] = Value(Hs[i], True)
            if carries[i] not in b.memo:
                h0 = em(torch.unsqueeze, (initial_state(em, init[i], state), 0))
                b.memo[carries[i]] = Value(em(torch.cat, ([h0, em(torch.narrow, (Hs[i], 0, 0, T - 1))], 0))
                                           if T > 1 else h0, True)
        if len(Hs) < n_c:
            raise _Unproven(f"new carry {min(set(range(n_c)) - set(Hs))} is not a graph value")
        repl: dict[fx.Node, fx.Node] = {}
        for k, users in items.items():
            if k < n_c:
                last = em(operator.getitem, (Hs[k], -1))
                repl.update({u: last for u in users})
                continue
            y = ys[k - n_c] if k - n_c < len(ys) else None
            if not isinstance(y, fx.Node):
                raise _Unproven(f"output {k} of the scan is not a graph value")
            v = b.value(y)
            if not v.batched:
                v = Value(em("expand", (em(torch.unsqueeze, (v.node, 0)), T, *hinted_shape(v.node)), method=True), True)
            repl.update({u: v.node for u in users})
    for u, n in repl.items():
        u.replace_all_uses_with(n)
    return [Hs[i] for i in range(n_c)]


def _reroll_assoc(gm: fx.GraphModule, node: fx.Node, recs: list[Recurrence],
                  prov: dict[str, Any]) -> dict[int, fx.Node]:
    """Rewrite one ``associative_scan`` op with the linear combine: each used leaf becomes a linear_scan (returned
    by leaf index)."""
    xs = list(node.args[1])
    if len(node.args) > 2 and list(node.args[2]):
        raise _Unproven("the associative_scan has additional inputs")
    items = _items(node)
    leaf_of = {r.leaf: r for r in recs}
    # running-product leaves: a state leaf names its decay leaf in its a (a node among xs)
    decay = {xs.index(r.a) for r in recs if isinstance(r.a, fx.Node) and r.a in xs and r.b is not None}
    made: dict[int, fx.Node] = {}
    repl: dict[fx.Node, fx.Node] = {}
    with Emitter(gm, prov, at=node) as em:
        for k, users in sorted(items.items()):
            out = users[0]
            state_full = hinted_shape(out)
            if state_full is None or not state_full:
                raise _Unproven(f"output {k} has no static shape")
            T, state = state_full[0], state_full[1:]
            b = Batcher(em, T, {}, lambda v: False, lambda v: True)
            r = leaf_of.get(k)
            if r is not None and r.b is not None:
                B = full_steps(b, Value(r.b, True), state, None, 0.0)
                A = full_steps(b, Value(r.a, True), state, None, 1.0) if r.a is not None else em(torch.ones_like, (B,))
                h0 = None
            elif (r is not None and r.b is None and r.a is not None) or k in decay:
                A = full_steps(b, Value(xs[k], True), state, None, 1.0)
                B = em(torch.zeros_like, (A,))
                h0 = em(torch.ones_like, (em(operator.getitem, (A, 0)),))
            else:
                raise _Unproven(f"output {k} of the associative_scan is neither a recurrence nor a running product")
            H = emit_scan(em, A, B, h0, T, state, example_value(out).dtype)
            made[k] = H
            repl.update({u: H for u in users})
    for u, n in repl.items():
        u.replace_all_uses_with(n)
    return made


# ----------------------------------------------------------------------------------------------------------------
# the pass


def reroll(gm: fx.GraphModule, regions: list[Region]) -> list[str]:
    """Rewrite each linear recurrence captured as ``scan``, ``associative_scan`` or an unrolled loop into one
    ``linear_scan`` node in ``gm`` (in place); return the names of the linear_scan nodes made.

    Args:
        gm: a dynamo graph (torch-level, ``meta["example_value"]`` on every node), as recognition saw it.
        regions: recognition's records; those for which :func:`needs_reroll` is true are rewritten. On success a
            record gets ``details["rerolled_into"]`` (the linear_scan node's name) and ``details["reroll"]`` (how a
            and b were computed: "batched", "stacked", "scan", "associative_scan"), for reports; on failure
            its ``not_rerolled`` says why (see :func:`_refuse`) and the graph keeps its nodes.
    """
    todo = [r for r in regions if needs_reroll(r)]
    if not todo:
        return []
    if _scan_op() is None:
        for r in todo:
            _refuse(r, "the linear_scan op (torch.ops.adjoint_compile.linear_scan) is not registered")
        log.info("reroll: the linear_scan op is not registered; %d recurrence(s) keep their form", len(todo))
        return []
    made: list[str] = []
    ops: dict[fx.Node, list[Recurrence]] = {}
    loops: list[Recurrence] = []
    for r in todo:
        if r.source == "unrolled_loop":
            loops.append(r)
            continue
        op = next((n for n in r.nodes if n.op == "call_function" and n.target is not operator.getitem), None)
        if op is None:
            _refuse(r, "the record names no scan op")
            continue
        ops.setdefault(op, []).append(r)
    changed = False
    for op, recs in ops.items():
        prov = {"pass": "reroll", "source": recs[0].source, "region": recs[0].name}
        try:
            if op.graph is not gm.graph:
                raise _Unproven("the scan op is no longer in the graph")
            if recs[0].source == "scan":
                Hs = _reroll_scan(gm, op, recs, prov)
                pairs = [(r, Hs[r.carry_index]) for r in recs]
                for r, H in pairs:  # NB: each carry's scan is reported under its own name (scan[carry 1], ...)
                    H.meta[PROVENANCE] = {**H.meta.get(PROVENANCE, {}), "region": r.name}
                new = Hs
            else:
                by_leaf = _reroll_assoc(gm, op, recs, prov)
                pairs = [(r, by_leaf.get(r.leaf)) for r in recs]
                new = list(by_leaf.values())
        except _Unproven as e:
            for r in recs:
                _refuse(r, str(e))
            log.info("reroll: %s %s keeps its form: %s", recs[0].source, op.name, e)
            continue
        changed = True
        made += [H.name for H in new]
        _done(pairs, recs[0].source)
    for r in loops:
        prov = {"pass": "reroll", "source": r.source, "region": r.name}
        if changed:
            _toposort(gm.graph)
        try:
            H, how = _reroll_unrolled(gm, r, prov)
        except _Unproven as e:
            _refuse(r, str(e))
            log.info("reroll: unrolled loop %s keeps its form: %s", r.name, e)
            continue
        changed = True
        made.append(H.name)
        _done([(r, H)], how)
    if changed:
        _toposort(gm.graph)
        eliminate_dead_code(gm.graph)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return made


def _refuse(r: Recurrence, why: str) -> None:
    """Record why ``r`` keeps its form, on the record and on its anchor nodes (recognition reads it back there)."""
    r.not_rerolled = f"not re-rolled: {why}"
    for n in [*r.outputs[-1:], *r.nodes[-1:]]:
        if n.op != "placeholder":
            n.meta[PROVENANCE] = {"pass": "reroll", **n.meta.get(PROVENANCE, {}), "not_rerolled": r.not_rerolled}


def _done(pairs: list[tuple[Recurrence, fx.Node | None]], how: str) -> None:
    for r, H in pairs:
        if H is None:
            continue  # its output was unused: the recurrence is gone with the op
        r.details["rerolled_into"] = H.name
        r.details["reroll"] = how
        log.info("reroll: %s %s -> linear_scan %s (%s, T=%s)", r.source, r.name, H.name, how, r.length)
