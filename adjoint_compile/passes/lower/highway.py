"""Highway mode lowering: a gated recurrence written as torch's ``scan`` becomes one call of the Highway-BP runtime.

Before::

    scan = torch.ops.higher_order.scan(scan_combine_fn_0, [h0], [xs], [W, b])
    out = scan[1]

After::

    highway_region_0 = HighwayScan(...)          # runtime/highway.py
    scan = self.highway_region_0(h0, xs, W, b)   # same results; its backward is Highway-BP with k iterations
    out = scan[1]

The split f(h) = r(h, g(h)) of each carry is read from the step sub-graph (the Highway-BP decompositions, DESIGN.md §3): a gated carry
h' = z1 ⊙ h + z2 (z depending on the state) has g = [z1, z2], r = z1 ⊙ h + z2 and K = diag(z1); a carry that is not
affine in itself (an LSTM's h beside its cell c) has g = its new value and r = z (K = 0), as in Highway-BP's LSTM form.  Every
per-step output must be a new state (the usual ``return h, h.clone()``); anything else, or a random op in the step
(its recomputation in the backward would draw new numbers), keeps ordinary autograd with the reason.
"""
from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...analysis.affine import Const, Expr, UpdateForm, classify_update
from ...analysis.fx import example_value as _ev
from ...analysis.fx import fresh_name, hinted_shape, reachable
from ...analysis.fx import stable_toposort as _toposort
from ...analysis.optable import draws_random, fn_name, op_name
from ...options import Options
from ...regions import PROVENANCE, Lowered, NotLowered, PerStepSlice, Recurrence, Region, ResidualChain
from ...runtime.highway import HighwayScan, StepChain
from ..match.find_recurrences import is_scan_hop
from .highway_cells import CellsRefused, lower_cells
from .highway_chain import ChainRefused, lower_chain

log = logging.getLogger(__name__)

__all__ = ["lower_highway", "PATHS"]

#: what k means, for reports (docs/highway.md).
PATHS = "gradient = the sum over all backward paths through at most {k} Jacobian(s) of the blocks g"



class _Refused(Exception):
    pass


def _sub(gm: fx.GraphModule, ref: Any) -> fx.GraphModule:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        m = gm
        for part in str(ref.target).split("."):
            m = getattr(m, part, None)
        if isinstance(m, fx.GraphModule):
            return m
    raise _Refused("the scan's step function is not a readable sub-graph")


def _slot(e: Expr | None) -> tuple[str, Any]:
    if e is None:
        return ("zero", None)
    if isinstance(e, Const):
        return ("const", e.value)
    return ("slot", e)


def _y_of(ys: list[Any], news: list[Any]) -> list[int]:
    out = []
    for j, y in enumerate(ys):
        base = y.args[0] if isinstance(y, fx.Node) and op_name(y) in ("clone", "contiguous") else y
        if not any(base is n for n in news):
            raise _Refused(f"per-step output {j} of the scan is not a new state (Highway-BP treats per-step losses "
                           f"on the states only)")
        out.append(next(c for c, n in enumerate(news) if base is n))
    return out


def _chain(sub: fx.GraphModule, n_c: int, forms: list[UpdateForm], news: list[fx.Node], y_of: list[int],
           opts: Options) -> StepChain:
    plans = [None if f.kind == "general" else (_slot(f.coef), _slot(f.offset)) for f in forms]

    def step(h: list, x: list, ex: list) -> tuple[list, list]:
        out = sub(*h, *x, *ex)
        return list(out[:n_c]), list(out[n_c:])

    def g(h: list, x: list, ex: list) -> list:
        it = fx.Interpreter(sub, garbage_collect_values=False)
        it.run(*h, *x, *ex)
        env = it.env.__getitem__
        Z = []
        for c, p in enumerate(plans):
            if p is None:
                Z.append(env(news[c]))
                continue
            Z += [e.evaluate(env) for kind, e in p if kind == "slot"]
        return Z

    def r(h: list, Z: list) -> list:
        it = iter(Z)
        out = []
        for c, p in enumerate(plans):
            if p is None:
                out.append(next(it))
                continue
            (ck, cv), (ok, ov) = p
            coef = next(it) if ck == "slot" else cv
            new = coef * h[c] if ck != "zero" else torch.zeros_like(h[c])
            if ok != "zero":
                new = new + (next(it) if ok == "slot" else ov)
            out.append(new)
        return out

    return StepChain(step, g, r, y_of, opts.iterations or 0, opts.tolerance)


def describe(forms: list[UpdateForm]) -> list[dict[str, str]]:
    """Per carry: its form, r and K, for ``explain()``."""
    out = []
    for f in forms:
        if f.kind == "general":
            out.append({"form": "state (z)", "r": "z", "K": "0"})
        else:
            a, b = str(f.coef), "0" if f.offset is None else str(f.offset)
            out.append({"form": f.kind, "r": f"z1 ⊙ h + z2 (z1 = {a}, z2 = {b})", "K": f"diag({a})"})
    return out


def lower_scan(gm: fx.GraphModule, scan: fx.Node, opts: Options) -> Lowered:
    """Replace one ``scan`` node by a :class:`~adjoint_compile.runtime.highway.HighwayScan` call (raises
    :class:`_Refused` with the reason, the graph untouched)."""
    sub = _sub(gm, scan.args[0])
    init, xs = list(scan.args[1]), list(scan.args[2])
    extra = list(scan.args[3]) if len(scan.args) > 3 else list(scan.kwargs.get("additional_inputs", []))
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    n_c = len(init)
    if not xs or len(phs) != n_c + len(xs) + len(extra) or len(results) < n_c:
        raise _Refused("the scan's step sub-graph does not match its arguments")
    for n in sub.graph.nodes:
        _no_random(n)
    carries, news = phs[:n_c], results[:n_c]
    depends = reachable(list(carries)).__contains__
    forms = [classify_update(new, c, depends) if isinstance(new, fx.Node) else UpdateForm("general")
             for new, c in zip(news, carries)]
    if all(f.kind == "general" for f in forms):
        raise _Refused("no carry of the scan is of the form z1 ⊙ h + z2 (K would be 0: no highway)")
    y_of = _y_of(results[n_c:], news)
    mod = HighwayScan(_chain(sub, n_c, forms, news, y_of, opts), n_c, len(xs), sub)
    name = fresh_name(gm, "highway_region")
    mod.label = name
    gm.add_submodule(name, mod)
    with gm.graph.inserting_before(scan):
        call = gm.graph.call_module(name, tuple(init + xs + extra))
    call.meta = dict(scan.meta)
    shape = getattr(_ev(xs[0]), "shape", None)
    parts = describe(forms)
    call.meta[PROVENANCE] = {"rewrite": "highway", "scan": scan.name, "iterations": opts.iterations,
                             "carries": parts}
    scan.replace_all_uses_with(call)
    ref = scan.args[0]
    gm.graph.erase_node(scan)
    if isinstance(ref, fx.Node) and not ref.users:
        gm.graph.erase_node(ref)
    steps = int(shape[0]) if shape is not None else None
    return Lowered(rewrite="highway", call=call.name, members=frozenset({scan.name}), steps=steps,
                   nodes=sum(1 for n in sub.graph.nodes if n.op not in ("placeholder", "output")),
                   note=_note(opts, parts, steps), details={"iterations": opts.iterations, "highway_carries": parts})


def _note(opts: Options, parts: list[dict[str, str]], length: int | None) -> str:
    k = opts.iterations or 0
    forms = "; ".join(f"{p['form']}: r = {p['r']}, K = {p['K']}" for p in parts) or ""
    exact = " (exact: k >= length)" if length is not None and k >= length else ""
    return f"Highway-BP k={k}{exact}: {forms}; {PATHS.format(k=k)}"


# ---------------------------------------------------------------------------------------------------------------
# a loop dynamo unrolled: the template step (passes/match/unrolled.py's recipe) becomes the step function


def _seq(gm: fx.GraphModule, x: PerStepSlice, n_slots: int, T: int) -> fx.Node:
    """The whole sequence [T, ...] that the per-step slice ``x.node`` reads (``x[:, t]``, ``select``, an unbind
    item), emitted before ``x.node``'s source is used (the caller re-sorts the graph)."""
    slot = x.node
    if n_slots != 1 or x.first_step != 1 or x.stride not in (1, -1) or not isinstance(x.start, int):
        raise _Refused(f"the per-step slice {slot.name} is not one index stepping by 1 from the first step")
    src, dim, rest = None, None, ()
    if slot.target is operator.getitem and len(slot.args) == 2:
        base, idx = slot.args
        if isinstance(base, fx.Node) and (fn_name(base) == "unbind") and isinstance(idx, int):
            src, dim = base.args[0], base.args[1] if len(base.args) > 1 else base.kwargs.get("dim", 0)
        else:
            idx = idx if isinstance(idx, tuple) else (idx,)
            ints = [i for i, v in enumerate(idx) if isinstance(v, int)]
            if len(ints) == 1 and all(v is None or v == slice(None) for i, v in enumerate(idx) if i != ints[0]):
                # NB: x[:, t, None] is select(x, 1, t)[:, None]: the Nones index the step's value, after the step
                src, dim = base, sum(v is not None for v in idx[:ints[0]])
                rest = idx[:ints[0]] + idx[ints[0] + 1:] if None in idx else ()
    elif fn_name(slot) == "select" and len(slot.args) == 3:
        src, dim = slot.args[0], slot.args[1]
    shape = hinted_shape(src) if isinstance(src, fx.Node) else None
    if shape is None or not isinstance(dim, int):
        raise _Refused(f"the per-step slice {slot.name} is not x[:, t], select or an unbind item")
    dim %= len(shape)
    start = x.start + shape[dim] if x.start < 0 else x.start
    lo = start if x.stride == 1 else start - T + 1
    if not 0 <= lo <= shape[dim] - T:
        raise _Refused(f"the per-step slice {slot.name} reads steps {lo}..{lo + T - 1} of {shape[dim]}")
    with gm.graph.inserting_after(src):
        seq = gm.graph.call_function(torch.movedim, (src, dim, 0))
    with gm.graph.inserting_after(seq):
        seq = gm.graph.call_function(torch.narrow, (seq, 0, lo, T))
    if x.stride == -1:
        with gm.graph.inserting_after(seq):
            seq = gm.graph.call_function(torch.flip, (seq, [0]))
    if rest:
        with gm.graph.inserting_after(seq):
            seq = gm.graph.call_function(operator.getitem, (seq, (slice(None), *rest)))
    return seq


def _no_random(n: fx.Node) -> None:
    if draws_random(n):
        raise _Refused(f"the step draws random numbers ({op_name(n) or fn_name(n)} at node {n.name}); Highway-BP "
                       f"recomputes the step in the backward")


def lower_loop(gm: fx.GraphModule, r: Recurrence, opts: Options) -> Lowered:
    """Replace an unrolled loop (a gated recurrence with a re-roll recipe) by one HighwayScan call."""
    rec = r.reroll
    if rec is None or (why := rec.highway_refusal()) is not None:
        raise _Refused(why or "the loop has no re-roll recipe")
    states, T = rec.states, len(rec.states)
    prev, new = rec.states[0], rec.states[1]
    slots = [x.node for x in rec.xs]
    outer = [rec.h0, *rec.shared, *(x.source for x in rec.xs if x.source is not None)]
    pre = reachable(outer, forward=False)
    loop = {n for n in reachable(states[-1], forward=False) - pre if n.op not in ("placeholder", "get_attr")}
    for n in loop:
        if n not in states and any(u not in loop for u in n.users):
            raise _Refused(f"the loop's value {n.name} is used after the loop (only its states may be)")
    # the step function: the template step with its state, slices and shared values as placeholders
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {prev: g.placeholder("h")}
    env.update({s: g.placeholder(f"x{j}") for j, s in enumerate(slots)})
    env.update({s: g.placeholder(f"w{j}") for j, s in enumerate(rec.shared)})
    inside = set(rec.template_step)
    for n in rec.template_step:
        _no_random(n)
        if n in env:
            continue
        for a in n.all_input_nodes:
            if a not in env and T < 3:  # NB: shared inputs are told by comparing two steps after the first
                raise _Refused(f"a loop of {T} steps is too short for Highway-BP to tell the weights its steps share "
                               f"(it compares the second and third steps); ordinary autograd")
            if a not in env:
                raise _Refused(f"the template step reads {a.name}, which is neither its state, a slice nor shared")
        env[n] = g.node_copy(n, env.__getitem__)
    if new not in inside:
        raise _Refused("the template step does not end in the loop's state")
    g.output([env[new], env[new]])
    sub = fx.GraphModule(gm, g)
    carry = env[prev]
    form = classify_update(env[new], carry, reachable([carry]).__contains__)
    if form.kind == "general":
        raise _Refused(f"the step is not of the form z1 ⊙ h + z2: {form.reason}")
    before = set(gm.graph.nodes)
    try:
        seqs = [_seq(gm, x, sum(1 for y in rec.xs if y.node is x.node), T) for x in rec.xs]
    except _Refused:
        for n in reversed([n for n in gm.graph.nodes if n not in before]):  # NB: leave the graph as it was
            gm.graph.erase_node(n)
        raise
    mod = HighwayScan(_chain(sub, 1, [form], [env[new]], [0], opts), 1, len(seqs), sub)
    name = fresh_name(gm, "highway_region")
    mod.label = name
    gm.add_submodule(name, mod)
    G = gm.graph
    with G.inserting_after(states[-1]):
        call = G.call_function(operator.getitem, (None, 0))  # placeholder node, replaced below
    with G.inserting_before(call):
        region = G.call_module(name, (rec.h0, *seqs, *rec.shared))
    call.args = (region, 1)
    ys = call
    stack = rec.stacked_by
    for t, st in enumerate(states):
        for u in list(st.users):
            if u in loop:
                continue
            if stack and u.name == stack["node"] and stack["op"] == "stack" and list(u.args[0]) == states:
                with G.inserting_before(u):
                    whole = G.call_function(torch.movedim, (ys, 0, stack["dim"]))
                whole.meta = dict(u.meta)
                u.replace_all_uses_with(whole)
                G.erase_node(u)
                continue
            with G.inserting_before(u):
                sel = G.call_function(torch.select, (ys, 0, t))
            sel.meta = dict(st.meta)
            u.replace_input_with(st, sel)
    for n in reversed(list(G.nodes)):
        if n in loop and not n.users:
            G.erase_node(n)
    _toposort(G)
    parts = describe([form])
    region.meta[PROVENANCE] = {"rewrite": "highway", "loop": r.name, "iterations": opts.iterations}
    return Lowered(rewrite="highway", call=region.name, members=frozenset(n.name for n in r.nodes), steps=T,
                   nodes=len(g.nodes) - 2 - len(slots) - len(rec.shared), note=_note(opts, parts, T),
                   details={"iterations": opts.iterations, "highway_carries": parts})


def _attempt(what: str, name: str, refused: type[Exception],
             lower: Callable[[], Lowered]) -> Lowered | NotLowered:
    try:
        return lower()
    except refused as e:
        log.info("adjoint-compile: %s %s keeps ordinary autograd: %s", what, name, e)
        return NotLowered(str(e))


def _noted(opts: Options, low: Lowered, parts: Any, chain: ResidualChain | None = None) -> Lowered:
    """A chain's note names its split (``parts`` is the split's text); a cell loop's lists its carries."""
    low.note = (_note(opts, [], chain.length).replace(": ;", f": {parts};") if chain is not None
                else _note(opts, parts, low.steps))
    return low


def lower_highway(gm: fx.GraphModule, regions: list[Region], opts: Options) -> list[Lowered | NotLowered]:
    """One outcome per region planned "highway" (passes/decide/), in order."""
    out: list[Lowered | NotLowered] = []
    done: dict[fx.Node, Lowered | NotLowered] = {}
    for r in regions:
        if isinstance(r, ResidualChain):
            out.append(_attempt("residual chain", r.name, ChainRefused,
                                lambda: _noted(opts, *lower_chain(gm, r, opts, fresh_name(gm, "highway_chain")), r)))
            continue
        scan = next((n for n in r.nodes if isinstance(n, fx.Node) and is_scan_hop(n)), None)
        if r.kind == "gated_recurrence" and r.details.get("cell"):  # a loop over nn.GRUCell / nn.LSTMCell
            out.append(_attempt("cell loop", r.name, CellsRefused,
                                lambda: _noted(opts, *lower_cells(gm, r, opts, fresh_name(gm, "highway_region")))))
            continue
        if r.kind == "gated_recurrence" and r.source == "unrolled_loop" and getattr(r, "reroll", None) is not None:
            out.append(_attempt("loop", r.name, _Refused, lambda: lower_loop(gm, r, opts)))
            continue
        if r.kind != "gated_recurrence" or scan is None:
            out.append(NotLowered(f"highway mode rewrites gated recurrences written as torch's scan so far; a "
                                  f"{r.kind} from source {r.source!r} keeps ordinary autograd"))
            continue
        if scan not in done:
            done[scan] = _attempt("scan", scan.name, _Refused, lambda: lower_scan(gm, scan, opts))
        out.append(done[scan])
    if any(isinstance(o, Lowered) for o in out):
        gm.graph.lint()
        gm.recompile()
    return out
