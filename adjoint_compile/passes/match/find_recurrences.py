"""Recurrences captured as one graph node (DESIGN.md §4): ``ac.ops.linear_scan``, torch's ``scan`` higher-order op
and ``associative_scan`` with the linear combine.

* ``linear_scan(a, b, h0, dim, reverse, window, impl)`` is a linear recurrence h_t = a_t ⊙ h_{t-1} + b_t by
  construction; a, b, h0 are its arguments.
* ``torch.ops.higher_order.scan(combine_fn, init, xs, additional_inputs)``: the step sub-graph ``combine_fn``
  takes ``(*carries, *x_slices, *additional)`` and returns ``[*new_carries, *ys]``; each new carry is classified
  by :func:`~adjoint_compile.analysis.affine.classify_update` as linear (a ⊙ h + b, a and b free of every carry),
  gated (z1 ⊙ h + z2 with z depending on a carry) or general (rejected, with the reason).
* ``torch.ops.higher_order.associative_scan(combine_fn, xs, additional_inputs)``: ``combine_fn(*x, *y)`` must
  be the linear-recurrence combine ``(x_a·y_a, y_a·x_b + y_b)`` (any operand order), which is the only form that
  is associative and means h_t = a_t ⊙ h_{t-1} + b_t; a cumulative sum (``x + y``) is the case a = 1.

A call of a custom ``autograd.Function`` that capture could not replace by a checked ``linear_scan``
(passes/capture/known_scans.py) is a rejection with the reason capture recorded on it.

Each matcher returns typed records and rejections; none mutates the graph.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.affine import NotAffine, UpdateForm, affine, classify_update, linear_combine
from ...analysis.fx import hinted_shape, is_linear_scan, scan_args
from ...analysis.fx import reachable as forward_reach
from ...analysis.optable import fn_name, op_name
from ...polyfills import polyfill_origin
from ...regions import PROVENANCE, Recurrence, Rejection
from .find_generic_scan import find_generic_scans
from .find_scan_forms import ScanForm, find_scan_forms

log = logging.getLogger(__name__)

__all__ = ["is_linear_scan", "is_scan_hop", "is_associative_scan_hop", "match_linear_scan", "match_scan",
           "match_associative_scan", "classify_carries", "find_recurrences"]

#: capture forms that the reroll pass (or the scan_forms pass) turns into a linear_scan (in the node's provenance).
_REROLLED = ("scan", "associative_scan", "unrolled_loop", "log_space_scan", "cumprod_scan")


def _hop_name(node: fx.Node) -> str | None:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return None


def is_scan_hop(node: fx.Node) -> bool:
    return _hop_name(node) == "scan"


def is_associative_scan_hop(node: fx.Node) -> bool:
    return _hop_name(node) == "associative_scan"


def _subgraph(gm: fx.GraphModule, ref: Any) -> fx.GraphModule | None:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        sub = gm
        for part in str(ref.target).split("."):
            sub = getattr(sub, part, None)
        return sub if isinstance(sub, fx.GraphModule) else None
    return ref if isinstance(ref, fx.GraphModule) else None


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)}


# ----------------------------------------------------------------------------------------------------------------
# linear_scan


def match_linear_scan(node: fx.Node) -> Recurrence | None:
    """A :class:`Recurrence` for a ``linear_scan`` node, or None if ``node`` is not one (or is unreadable)."""
    if not is_linear_scan(node):
        return None
    a = scan_args(node)
    shp = hinted_shape(node)
    dim = a["dim"]
    if shp is None or not isinstance(dim, int) or not -len(shp) <= dim < len(shp):
        return None
    dim = dim % len(shp)
    # NB: a scan made by the reroll pass reports how the user wrote the recurrence (a loop, torch's scan, ...)
    prov = node.meta.get(PROVENANCE)
    rerolled = isinstance(prov, dict) and prov.get("pass") in ("reroll", "scan_forms") and prov.get("source") in _REROLLED
    details = {"a": _show(a["a"]), "b": _show(a["b"]), "h0": _show(a["h0"]), "shape": list(shp)}
    if rerolled:
        details["rerolled_from"] = prov.get("region")
        if prov.get("readouts"):  # NB: passes/capture/reroll_readouts.py: the per-step readouts of the loop
            details["readouts"] = prov["readouts"]
    origin = polyfill_origin(node)
    if origin:  # NB: the library's loop never reached the graph: a polyfill wrote this scan while dynamo traced
        details["captured_by"] = origin
    # NB: a registered scan implementation (passes/capture/known_scans.py) is reported under the name it was called as
    known = isinstance(prov, dict) and prov.get("pass") == "known_scans" and prov.get("source") == "registered_scan"
    if known:
        details.update({"implementation": prov.get("implementation"), "replaced": prov.get("region")})
    return Recurrence(
        kind="linear_recurrence", source=prov["source"] if rerolled or known else "linear_scan", length=shp[dim],
        nodes=[node],
        # NB: a re-rolled scan is reported under the name of the loop or scan op the user wrote
        name=prov.get("region") or node.name if rerolled or known else node.name,
        rerolled_from=prov.get("region") if rerolled else None,
        a=a["a"] if isinstance(a["a"], fx.Node) else None, b=a["b"] if isinstance(a["b"], fx.Node) else None,
        h0=a["h0"] if isinstance(a["h0"], fx.Node) else None, carry=None, outputs=[node], step_dim=dim,
        reverse=bool(a["reverse"]), window=a["window"] if isinstance(a["window"], int) else None,
        details=details,
    )


def _show(v: Any) -> Any:
    if isinstance(v, fx.Node):
        return v.name
    return v if v is None or isinstance(v, (int, float, bool, str)) else repr(v)


# ----------------------------------------------------------------------------------------------------------------
# scan higher-order op


def _user_dim(x: Any) -> tuple[int | None, bool]:
    """(the user's scan dim, reversed?) read from dynamo's ``movedim(x, d, 0)`` / ``flip(., [0])`` around xs."""
    rev = False
    if isinstance(x, fx.Node) and x.op in ("call_function", "call_method") and fn_name(x) == "flip":
        dims = x.args[1] if len(x.args) > 1 else x.kwargs.get("dims")
        if list(dims or []) == [0]:
            rev, x = True, x.args[0]
    if isinstance(x, fx.Node) and x.op in ("call_function", "call_method") and fn_name(x) == "movedim":
        if len(x.args) >= 3 and x.args[2] == 0 and isinstance(x.args[1], int):
            return x.args[1], rev
    return None, rev


def match_scan(node: fx.Node, gm: fx.GraphModule) -> tuple[list[Recurrence], list[Rejection]]:
    """Classify each carry of a ``torch.ops.higher_order.scan`` node; one record or rejection per carry."""
    if not is_scan_hop(node) or len(node.args) < 3:
        return [], []
    sub = _subgraph(gm, node.args[0])
    init, xs = list(node.args[1]), list(node.args[2])
    if sub is None:
        return [], [Rejection("recurrence", node.name, "the scan's step function is not a readable sub-graph")]
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    n_c = len(init)
    if len(phs) < n_c or len(results) < n_c:
        return [], [Rejection("recurrence", node.name, "the scan's step sub-graph does not match its carries")]
    carries = phs[:n_c]
    news = results[:n_c]
    ys = results[n_c:]
    forms = classify_carries(carries, news)
    length = None
    if xs and hinted_shape(xs[0]):
        length = hinted_shape(xs[0])[0]
    dims = [_user_dim(x) for x in xs]
    reverse = bool(dims) and all(r for _, r in dims)
    user_dim = dims[0][0] if dims and len({d for d, _ in dims}) == 1 else None
    items = _getitems(node)
    regions: list[Recurrence] = []
    rejections: list[Rejection] = []
    for i, (carry, new) in enumerate(zip(carries, news)):
        label = node.name if n_c == 1 else f"{node.name}[carry {i}]"
        if not isinstance(new, fx.Node):
            rejections.append(Rejection("recurrence", label, f"new carry {i} is not a graph value"))
            continue
        form = forms[i]
        if form.kind == "general":
            rejections.append(Rejection("recurrence", label, form.reason))
            continue
        ys_of = [k for k, y in enumerate(ys) if isinstance(y, fx.Node) and (
            y is new or (op_name(y) in ("clone", "contiguous") and y.args[0] is new))]
        outputs = [items[i]] if i in items else []
        outputs += [items[n_c + k] for k in ys_of if n_c + k in items]
        r = _record(form, "scan", length, node, label, carry, init[i], outputs, reverse, details={
            "subgraph": str(node.args[0].target) if isinstance(node.args[0], fx.Node) else None,
            "carry_index": i, "carries": n_c, "ys_of_state": ys_of, "user_dim": user_dim,
            "scan_dim": 0,
        })
        r.carry_index = i
        if origin := polyfill_origin(node):  # NB: nn.GRU / nn.LSTM: the fused op never reached the graph
            r.details["captured_by"] = origin
        regions.append(r)
    return regions, rejections


def classify_carries(carries: list[fx.Node], news: list[Any]) -> dict[int, UpdateForm]:
    """Each carry's update form (by carry index), the linear ones first in an order they can be solved in: a carry
    is linear when its a and b are free of the carries not solved before it (their old and new values). A stack of
    recurrences stepped together, ``h1 = a1(x_t) * h1 + b1(x_t); h2 = a2(h1) * h2 + b2(h1)``, is then two linear
    recurrences, h2's a and b read from h1's states once h1 is solved. An LSTM's c and h read each other: neither is
    solved, and each is classified against every carry (a gated or a general update)."""
    left = [i for i, n in enumerate(news) if isinstance(n, fx.Node)]
    forms: dict[int, UpdateForm] = {}
    while left:
        depends = forward_reach([carries[i] for i in left]).__contains__
        solved = [(i, classify_update(news[i], carries[i], depends)) for i in left]
        i, form = next(((i, f) for i, f in solved if f.kind == "linear"), (None, None))
        if form is None:
            break
        forms[i] = form
        left.remove(i)
    depends = forward_reach(list(carries)).__contains__
    forms.update({i: classify_update(news[i], carries[i], depends) for i in left})
    if len(left) > 1 and all(forms[i].kind == "gated" for i in left) and \
            _jointly_linear([carries[i] for i in left], [news[i] for i in left]):
        forms.update({i: dataclasses.replace(forms[i], reason=COUPLED) for i in left})
    return forms


#: the gated reason of carries that are linear in one another (h' = A h + b, A a matrix over the carries)
COUPLED = ("its states are linear in one another, jointly (h' = A h + b with A a matrix over the states: a complex "
           "state written as its real and imaginary parts, a 2x2 rotation), not each a*h + b")


def _jointly_linear(carries: list[fx.Node], news: list[Any]) -> bool:
    """Whether every new value is affine in each carry with a coefficient free of all the carries (and no other
    dependence on that carry): a linear recurrence whose coefficient is a matrix over the carries."""
    every = forward_reach(carries).__contains__
    for new in news:
        for c in carries:
            on_c = forward_reach([c]).__contains__
            try:
                aff = affine(new, c, on_c)
            except NotAffine:
                return False
            if aff.coef is not None and any(every(a) for a in aff.coef.nodes()) or \
                    aff.offset is not None and any(on_c(a) for a in aff.offset.nodes()):
                return False
    return True


def _record(form: UpdateForm, source: str, length: int | None, node: fx.Node, label: str, carry: fx.Node | None,
            h0: Any, outputs: list[fx.Node], reverse: bool, details: dict[str, Any],
            a: Any = "from_form", b: Any = "from_form", step_dim: int = 0) -> Recurrence:
    kind = "linear_recurrence" if form.kind == "linear" else "gated_recurrence"
    d = dict(details)
    d.update(form.describe())
    if form.kind == "gated":
        d["gated_because"] = form.reason
    nodes = [node] + [u for u in outputs if u is not node]
    if isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
        nodes.insert(0, node.args[0])
    return Recurrence(
        kind=kind, source=source, length=length, nodes=nodes, name=label,
        a=form.coef.node if (a == "from_form" and form.coef is not None) else (a if isinstance(a, fx.Node) else None),
        b=form.offset.node if (b == "from_form" and form.offset is not None) else (b if isinstance(b, fx.Node) else None),
        h0=h0 if isinstance(h0, fx.Node) else None, carry=carry, outputs=outputs, step_dim=step_dim,
        reverse=reverse, details=d,
    )


# ----------------------------------------------------------------------------------------------------------------
# associative_scan higher-order op


def match_associative_scan(node: fx.Node, gm: fx.GraphModule) -> tuple[list[Recurrence], list[Rejection]]:
    """Records for an ``associative_scan`` node whose combine is the linear-recurrence combine.

    Leaves are split into *decay* leaves (``out = x_k * y_k``: the running product of a) and *state* leaves
    (``out = y_j * x_k + y_k`` with j a decay leaf, or ``x_k + y_k``). Every state leaf is one linear recurrence
    with a = xs[j] (or 1) and b = xs[k]; with no state leaf, each decay leaf is h_t = a_t ⊙ h_{t-1} (b = 0).
    Any other combine is rejected: it would not be associative, or not a linear recurrence.
    """
    if not is_associative_scan_hop(node) or len(node.args) < 2:
        return [], []
    sub = _subgraph(gm, node.args[0])
    xs = list(node.args[1])
    n = len(xs)
    if sub is None:
        return [], [Rejection("linear_recurrence", node.name, "the combine function is not a readable sub-graph")]
    phs = [p for p in sub.graph.nodes if p.op == "placeholder"]
    out = next(p for p in sub.graph.nodes if p.op == "output")
    res = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    if len(phs) < 2 * n or len(res) != n:
        return [], [Rejection("linear_recurrence", node.name, "combine signature does not match its inputs")]
    combine = linear_combine(phs[:n], phs[n:2 * n], res)
    if isinstance(combine, str):
        return [], [Rejection("linear_recurrence", node.name, combine)]
    decay, state = combine
    length = hinted_shape(xs[0])[0] if hinted_shape(xs[0]) else None
    items = _getitems(node)
    regions = []
    leaves = sorted(state) if state else sorted(decay)
    for k in leaves:
        j = state.get(k, k)
        a_node = None if j == "one" else xs[j]
        b_node = xs[k] if k in state else None
        label = node.name if len(leaves) == 1 else f"{node.name}[leaf {k}]"
        form = UpdateForm("linear")
        r = _record(form, "associative_scan", length, node, label, None, None, [items[k]] if k in items else [],
                    False, details={"leaf": k, "a": "1" if j == "one" else _show(a_node),
                                    "b": _show(b_node) if b_node is not None else "0", "scan_dim": 0,
                                    "h0": "0" if k in state else "1"},
                    a=a_node, b=b_node)
        r.details.update({"a": "1" if j == "one" else _show(a_node), "b": _show(b_node) if b_node is not None else "0"})
        r.leaf = k
        regions.append(r)
    return regions, []


def find_recurrences(gm: fx.GraphModule) -> tuple[list[Recurrence], list[Rejection]]:
    """All recurrences captured as one node in ``gm`` (linear_scan, scan, associative_scan), in graph order."""
    regions: list[Recurrence] = []
    rejections: list[Rejection] = []
    for node in gm.graph.nodes:
        try:
            if is_linear_scan(node):
                r = match_linear_scan(node)
                if r is None:
                    rejections.append(Rejection("linear_recurrence", node.name,
                                                "linear_scan with unreadable arguments or shape"))
                else:
                    regions.append(r)
            elif is_scan_hop(node):
                rs, js = match_scan(node, gm)
                regions += rs
                rejections += js
            elif is_associative_scan_hop(node):
                rs, js = match_associative_scan(node, gm)
                regions += rs
                rejections += js
            elif isinstance(prov := node.meta.get(PROVENANCE), dict) and prov.get("not_recognized"):
                rejections.append(Rejection("linear_recurrence", node.name, prov["not_recognized"]))
        except Exception as e:  # noqa: BLE001 - recognition never raises (DESIGN.md §4)
            log.debug("recurrence matcher failed at %s", node.name, exc_info=True)
            rejections.append(Rejection("recurrence", node.name, f"matcher error {type(e).__name__}: {e}"))
    for find in (find_scan_forms, find_generic_scans):  # closed forms: capture rewrites them (passes/capture/scan_forms.py)
        forms, missed = find(gm)
        regions += map(_form_record, forms)
        rejections += missed
    return regions, rejections


def _form_record(f: ScanForm) -> Recurrence:
    """A closed form still in the graph: capture did not normalize it (symbolic sizes: each call's specialization is
    normalized) or could not rewrite it (its anchor's provenance says why; recognition reads it back)."""
    shp = hinted_shape(f.anchor)
    return Recurrence(kind="linear_recurrence", source=f.source, length=shp[f.dim] if shp else None,
                      nodes=[f.anchor], name=f.anchor.name, a=f.a, b=f.b, h0=f.h0, outputs=[f.anchor],
                      step_dim=f.dim, details={**f.details, "a": _show(f.a), "b": _show(f.b), "log": f.log})
