"""Closed forms of a linear recurrence become one ``linear_scan`` node (part of the capture stage).

The matchers prove each form node by node (passes/match/find_scan_forms.py: the log-space form of minGRU and the cumprod
form; passes/match/find_generic_scan.py: ``associative_scan`` in generic mode, which dynamo inlines as a tree); this pass
replaces the form's output by

    H = linear_scan(A, B, h0, dim=d)      A = exp(log_a) | a | 1,  B = exp(log_b) | b | 0

and leaves the old nodes to dead-code elimination (those still used elsewhere stay). The new nodes carry
``meta["adjoint_compile"] = {"pass": "scan_forms", "source": ..., "region": ...}``, so recognition reports the scan
under the form the user wrote (``log_space_scan``, ``cumprod_scan``, ``associative_scan``).

Numerics: the result is the same recurrence computed in linear space. The log-space form exists to avoid
under/overflow of Π a_r and of b_s / Π a_r; the scan never forms those products (it accumulates a_t ⊙ h + b_t in
fp32), so it has no such issue, but exp(log_b) must itself be representable (it is the state's own scale). Where
the cumprod form divides by a product that underflows to 0 (nan or inf in eager), the scan gives the finite value.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from ...analysis.fx import example_value, hinted_shape
from ...analysis.fx import eliminate_dead_code
from ...analysis.fx import stable_toposort as _toposort
from ...regions import PROVENANCE, Rejection
from .batching import Emitter, Unproven, scan_op
from ..match.find_generic_scan import find_generic_scans
from ..match.find_scan_forms import ScanForm, find_scan_forms, is_getitem_last
from ..match.find_tree_scans import TREE_FORM, find_tree_scans

log = logging.getLogger(__name__)

__all__ = ["rewrite_scan_forms", "match_scan_forms"]


def match_scan_forms(gm: fx.GraphModule) -> tuple[list[ScanForm], list[Rejection]]:
    """The three matchers: proven forms and rejected candidates."""
    forms, rejected = find_scan_forms(gm)
    generic, rejected_generic = find_generic_scans(gm)
    trees, rejected_trees = find_tree_scans(gm)
    return [*forms, *generic, *trees], [*rejected, *rejected_generic, *rejected_trees]


def _emit(em: Emitter, f: ScanForm) -> fx.Node:
    op = scan_op()
    if op is None:
        raise Unproven("the linear_scan op is not registered")
    src = f.b if f.b is not None else f.a
    shape = hinted_shape(src)
    if shape is None:
        raise Unproven("no static shape")
    A = em(torch.exp, (f.a,)) if f.log and f.a is not None else f.a
    B = em(torch.exp, (f.b,)) if f.log and f.b is not None else f.b
    A = em(torch.ones_like, (B,)) if A is None else A
    if f.details.get("form") == TREE_FORM:
        if example_value(f.anchor).is_complex() and not _complex_scans():
            raise Unproven("its values are complex and this linear_scan takes real dtypes only")
        A, B = _like_output(em, f, A, B)
        shape = hinted_shape(B)
    h0 = None
    if f.running_product:
        B = em(torch.zeros_like, (A,))
        h0 = em(torch.ones_like, (em(torch.select, (A, f.dim, 0)),))
    elif f.h0 is not None:
        first = list(shape)
        first[f.dim] = 1
        v = em(torch.exp, (f.h0,)) if f.log else f.h0
        h0 = em(torch.squeeze, (em("expand", (v, *first), method=True), f.dim))
    if example_value(A).dtype != example_value(B).dtype or hinted_shape(A) != hinted_shape(B):
        raise Unproven(f"a and b differ in dtype or shape: {example_value(A).dtype}{list(hinted_shape(A))}, "
                       f"{example_value(B).dtype}{list(hinted_shape(B))}")
    if h0 is not None and example_value(h0).dtype != example_value(A).dtype:
        h0 = em("to", (h0, example_value(A).dtype), method=True)
    # NB: every argument positionally: (a, b, h0, dim, reverse, window, impl), as lower_adjoint reads them
    return em(op, (A, B, h0, f.dim, False, None, None))


def _complex_scans() -> bool:
    """linear_scan takes complex a and b (ops.SCAN_DTYPES lists them)."""
    from ... import ops

    return torch.complex64 in getattr(ops, "SCAN_DTYPES", ())


def _like_output(em: Emitter, f: ScanForm, A: fx.Node, B: fx.Node) -> tuple[fx.Node, fx.Node]:
    """A tree scan's leaves may broadcast (gateloop's a ``[.., 1]`` against kv ``[.., d]``) and mix real and complex:
    both are expanded to the output's shape and cast to its dtype (the scan's values are the tree's)."""
    out = example_value(f.anchor)
    for name, v in (("a", A), ("b", B)):
        if hinted_shape(v) != tuple(out.shape):
            v = em("expand", (v, *out.shape), method=True)
        if example_value(v).dtype != out.dtype:
            v = em("to", (v, out.dtype), method=True)
        A, B = (v, B) if name == "a" else (A, v)
    return A, B


def _commit(gm: fx.GraphModule, em: Emitter, f: ScanForm, H: fx.Node) -> None:
    """Every use of the form's output reads H; a slice of its last T steps (minGRU's ``out[:, -seq_len:]``) is H."""
    out = f.anchor
    if not f.prepended and (hinted_shape(H) != hinted_shape(out) or
                            example_value(H).dtype != example_value(out).dtype):
        raise Unproven(f"the scan gives {list(hinted_shape(H))} {example_value(H).dtype}, the form "
                       f"{list(hinted_shape(out) or [])} {example_value(out).dtype}")
    T = hinted_shape(H)[f.dim]
    for u in list(out.users):
        if is_getitem_last(u, f.dim, T):
            u.replace_all_uses_with(H)
    if out.users:
        out.replace_all_uses_with(em(torch.cat, ([em(torch.exp, (f.h0,)), H], f.dim)) if f.prepended else H)


def rewrite_scan_forms(gm: fx.GraphModule) -> tuple[list[str], list[Rejection]]:
    """Replace every proven closed form in ``gm`` (in place) by a linear_scan node; return the new nodes' names and
    the forms that could not be rewritten (as rejections, besides the matchers' own)."""
    forms, rejected = match_scan_forms(gm)
    made: list[str] = []
    failed: list[Rejection] = []
    _note_tree_rejections(gm, rejected)
    #: a form's output -> the linear_scan now in its place: a later form may read it (a second scan of the first
    #: one's output), and would otherwise keep the first form alive
    done: dict[fx.Node, fx.Node] = {}
    for f in forms:
        if not f.anchor.users:
            continue
        f = dataclasses.replace(f, **{k: done[v] for k in ("a", "b", "h0") if (v := getattr(f, k)) in done})
        prov = {"pass": "scan_forms", "source": f.source, "region": f.anchor.name}
        em = Emitter(gm, prov)
        try:
            H = _emit(em, f)
            _commit(gm, em, f, H)
        except Unproven as e:
            em.rollback()
            f.anchor.meta[PROVENANCE] = {**f.anchor.meta.get(PROVENANCE, {}), "pass": "scan_forms",
                                          "not_rerolled": f"not rewritten into a linear_scan: {e}"}
            if f.details.get("form") == TREE_FORM:  # NB: no matcher finds the tree again: say why on its output
                f.anchor.meta[PROVENANCE]["not_recognized"] = (
                    f"tree scan over ({f.details['a']}, {f.details['b']}) along dim {f.dim} at {f.anchor.name}: "
                    f"proven a linear scan, not rewritten: {e}; it keeps ordinary autograd")
            failed.append(Rejection("linear_recurrence", f.anchor.name, f"{f.source} at {f.anchor.name}: {e}"))
            log.info("scan_forms: %s %s keeps its form: %s", f.source, f.anchor.name, e)
            continue
        made.append(H.name)
        done[f.anchor] = H
        log.info("scan_forms: %s %s -> linear_scan %s", f.source, f.anchor.name, H.name)
    if made:
        _toposort(gm.graph)
        eliminate_dead_code(gm.graph)
        _drop_vmap_bookkeeping(gm)
        gm.graph.lint()
        gm.recompile()
    return made, failed


def _note_tree_rejections(gm: fx.GraphModule, rejected: list[Rejection]) -> None:
    """A tree scan that is not proven keeps its form and says why on its anchor (recognition reads
    ``not_recognized`` back as a rejection; the other forms' matchers run again at recognition instead)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for j in rejected:
        n = by_name.get(j.node)
        if n is not None and j.reason.startswith("tree scan"):
            n.meta[PROVENANCE] = {**n.meta.get(PROVENANCE, {}), "pass": "scan_forms", "not_recognized": j.reason}
            log.info("scan_forms: %s", j.reason)


def _drop_vmap_bookkeeping(gm: fx.GraphModule) -> None:
    """A generic-mode tree's vmap enter/exit calls stay after DCE (FX keeps calls it cannot prove pure); a
    ``lazy_load_decompositions(); _vmap_increment_nesting(); _vmap_decrement_nesting()`` run with nothing left
    between them is dropped."""
    P = torch._functorch.predispatch
    nodes = [n for n in gm.graph.nodes]
    is_ = lambda k, t: 0 <= k < len(nodes) and nodes[k].op == "call_function" and nodes[k].target is t  # noqa: E731
    for i, n in enumerate(nodes):
        if is_(i, P._vmap_increment_nesting) and is_(i + 1, P._vmap_decrement_nesting) and not n.users \
                and not nodes[i + 1].users:
            gm.graph.erase_node(nodes[i + 1])
            gm.graph.erase_node(n)
            if is_(i - 1, P.lazy_load_decompositions) and not nodes[i - 1].users:
                gm.graph.erase_node(nodes[i - 1])
