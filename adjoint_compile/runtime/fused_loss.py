"""The vocabulary head and its cross-entropy in a loss chunk's program, as one fused op that never makes the logits.

A loss tail (:mod:`.loss_tail`) computes each chunk's logits and their gradient, [rows, V] each: at V = 50k that is
most of what a chunk holds and most of its time in memory traffic. Where the head feeds only the loss, the chunk's
program is rewritten to :func:`adjoint_compile.loss_ops.linear_cross_entropy` (one tile of logits at a time, in
registers on a GPU)::

    before:  z = linear(h, W, b)  ─►  [.float(), flatten / view / transpose(1, 2)]  ─►  cross_entropy(·, t, …)
                                  └─►  logsumexp(·, -1)                        (a z-loss, optional)
    after:   loss_rows, lse_rows = linear_cross_entropy(h.reshape(-1, D), W, b, t.reshape(-1), …)
             cross_entropy  ─►  loss_rows.sum() | loss_rows.sum() / (t != ignore_index).sum() | loss_rows.view_as(t)
             logsumexp      ─►  lse_rows.reshape(its shape)

The head is ``linear(h, W, b)`` or ``h @ Wt`` (a tied embedding's ``weight.T``); between it and the losses only
casts, views that keep the vocabulary as the last dim, and one ``transpose`` / ``movedim`` that puts it at dim 1
(the ``[B, V, T]`` layout); the losses are ``cross_entropy`` with class-index targets and no class ``weight``
(``ignore_index``, ``label_smoothing``, any reduction) and ``logsumexp`` over the vocabulary. Anything else reading
the logits (an output, an argmax, a softcap) leaves that head as written. Under autocast the head's inputs are cast
to the autocast dtype first, as ``linear`` would be.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import loss_ops  # noqa: F401  (registers the fused op)
from ..analysis.losses import loss_args

log = logging.getLogger(__name__)

__all__ = ["HeadLoss", "find_head_losses", "fuse_head_losses"]

_LINEAR = {torch._C._nn.linear, F.linear}
_MATMUL = {operator.matmul, torch.matmul}
_CASTS = {"float", "double", "to", "contiguous", "type"}
_REGROUPS_METHOD = {"view", "reshape", "flatten"}
_REGROUPS_FN = {torch.reshape, torch.flatten}
_LSE = {torch.logsumexp, "logsumexp"}


@dataclasses.dataclass
class HeadLoss:
    """A head whose logits feed only cross-entropies and logsumexps (module docstring)."""

    logits: fx.Node
    h: fx.Node
    #: the weight as [V, D], or as [D, V] when ``transposed`` (``h @ weight.T``)
    weight: fx.Node
    transposed: bool
    bias: fx.Node | None
    #: the cross_entropy nodes, with their arguments by name
    losses: list[tuple[fx.Node, dict[str, Any]]]
    #: logsumexp nodes over the vocabulary
    lses: list[fx.Node]
    #: every node between the head and the losses (the head included): gone after the rewrite
    chain: list[fx.Node]


def _head(n: fx.Node, val: Callable[[Any], Any]) -> tuple[fx.Node, fx.Node, bool, fx.Node | None] | None:
    """(h, weight, transposed, bias) when ``n`` is a vocabulary projection, else None."""
    if n.op != "call_function" or n.kwargs.keys() - {"bias"}:
        return None
    if n.target in _LINEAR and 2 <= len(n.args) + len(n.kwargs) <= 3:
        h, w, b = (*n.args, n.kwargs.get("bias"))[:3] if len(n.args) < 3 else n.args
        transposed = False
    elif n.target in _MATMUL and len(n.args) == 2 and not n.kwargs:
        (h, w), b, transposed = n.args, None, True
    else:
        return None
    vh, vw = val(h), val(w)
    if not (isinstance(h, fx.Node) and isinstance(w, fx.Node) and isinstance(vh, torch.Tensor)
            and isinstance(vw, torch.Tensor) and vw.dim() == 2 and vh.dim() >= 1 and vh.dtype.is_floating_point):
        return None
    if b is not None and not (isinstance(b, fx.Node) and isinstance(val(b), torch.Tensor) and val(b).dim() == 1):
        return None
    D = vw.shape[0] if transposed else vw.shape[1]
    return (h, w, transposed, b) if vh.shape[-1] == D else None


def _dims(n: fx.Node, names: tuple[str, ...]) -> list[Any]:
    return [n.kwargs.get(k, n.args[i + 1] if len(n.args) > i + 1 else None) for i, k in enumerate(names)]


def _moves_vocab_to_1(n: fx.Node, nd: int) -> bool:
    """``transpose`` of the last dim with dim 1 of a 3-dim value, or ``movedim(-1, 1)``: the classes at dim 1 with
    the other dims in order."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if name == "transpose":
        a, b = _dims(n, ("dim0", "dim1"))
        return nd == 3 and isinstance(a, int) and isinstance(b, int) and {a % 3, b % 3} == {1, 2}
    if name == "movedim":
        a, b = _dims(n, ("source", "destination"))
        return isinstance(a, int) and isinstance(b, int) and a % nd == nd - 1 and b % nd == 1
    return False


def _follow(logits: fx.Node, V: int, val: Callable[[Any], Any]) -> tuple[list, list, list] | None:
    """(losses, lses, chain) when every use of ``logits`` is an allowed path to a loss, else None."""
    losses: list[tuple[fx.Node, dict[str, Any]]] = []
    lses: list[fx.Node] = []
    chain = [logits]
    todo = [(logits, False)]  # (node, whether its vocabulary is at dim 1)
    while todo:
        x, moved = todo.pop()
        vx = val(x)
        if not isinstance(vx, torch.Tensor) or not vx.dtype.is_floating_point:
            return None
        for u in x.users:
            vu = val(u)
            a = loss_args(u) if u.op == "call_function" else None
            if a is not None and u.target is F.cross_entropy and a["input"] is x and a["target"] is not x:
                vt = val(a["target"])
                rows = list(vx.shape[:1]) + list(vx.shape[2:])
                ok = (a["weight"] is None and isinstance(a["target"], fx.Node) and isinstance(vt, torch.Tensor)
                      and vt.dtype == torch.int64 and list(vt.shape) == rows and vx.shape[1] == V
                      and (moved or vx.dim() == 2) and isinstance(a["ignore_index"], int)
                      and isinstance(a["label_smoothing"], (int, float)) and 0 <= a["label_smoothing"] <= 1)
                if not ok:
                    return None
                losses.append((u, a))
                continue
            name = u.target if u.op == "call_method" else (
                u.target if u.target in _REGROUPS_FN or u.target is torch.logsumexp else
                getattr(u.target, "__name__", None) if u.target in (torch.transpose, torch.movedim) else None)
            if u.op not in ("call_method", "call_function") or not u.args or u.args[0] is not x or \
                    any(a is x for a in [*u.args[1:], *u.kwargs.values()]) or not isinstance(vu, torch.Tensor):
                return None
            if name in _LSE and not moved:
                (dim,) = _dims(u, ("dim",))
                dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
                if not isinstance(dim, int) or dim % vx.dim() != vx.dim() - 1:
                    return None
                lses.append(u)
                continue
            if name in _CASTS and vu.shape == vx.shape and vu.dtype.is_floating_point:
                pass
            elif (name in _REGROUPS_METHOD or name in _REGROUPS_FN) and not moved and vu.dim() >= 1 \
                    and vu.shape[-1] == V and vu.numel() == vx.numel():
                pass
            elif name in ("transpose", "movedim") and not moved and _moves_vocab_to_1(u, vx.dim()):
                todo.append((u, True))
                chain.append(u)
                continue
            else:
                return None
            todo.append((u, moved))
            chain.append(u)
    return (losses, lses, chain) if losses else None


def find_head_losses(gm: fx.GraphModule, val: Callable[[Any], Any]) -> list[HeadLoss]:
    """The heads of ``gm`` that feed only losses (module docstring); ``val(node)``: its example value."""
    given = val
    val = lambda x: given(x) if isinstance(x, fx.Node) else None  # noqa: E731
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    for n in gm.graph.nodes:
        head = _head(n, val)
        if head is None:
            continue
        h, w, transposed, b = head
        vw, vh = val(w), val(h)
        if vw.dtype != vh.dtype or (b is not None and val(b).dtype != vh.dtype):
            continue
        got = _follow(n, vw.shape[1] if transposed else vw.shape[0], val)
        if got is None:
            continue
        losses = sorted(got[0], key=lambda la: order[la[0]])
        # NB: the logsumexps read the op of the first loss in the graph: one before it keeps the head as written
        if all(order[lse] > order[losses[0][0]] for lse in got[1]):
            found.append(HeadLoss(n, h, w, transposed, b, losses, *got[1:]))
    return found


def fuse_head_losses(gm: fx.GraphModule, val: Callable[[Any], Any], impl: str | None = None,
                     autocast_dtype: torch.dtype | None = None) -> int:
    """Rewrite the heads :func:`find_head_losses` finds in ``gm`` to the fused op, in place; the number rewritten.
    ``autocast_dtype``: the dtype ``linear`` would run in under the autocast in effect (None: none)."""
    heads = find_head_losses(gm, val)
    g = gm.graph
    op = torch.ops.adjoint_compile.linear_cross_entropy.default
    for hl in heads:
        with g.inserting_before(hl.logits):
            D = val(hl.h).shape[-1]
            h = g.call_function(torch.reshape, (hl.h, (-1, D)))
            w = g.call_function(torch.t, (hl.weight,)) if hl.transposed else hl.weight
            b = hl.bias
            if autocast_dtype is not None:
                h, w = (g.call_method("to", (x, autocast_dtype)) for x in (h, w))
                b = None if b is None else g.call_method("to", (b, autocast_dtype))
        first_lse = None
        for ce, a in hl.losses:
            with g.inserting_before(ce):
                t = g.call_function(torch.reshape, (a["target"], (-1,)))
                both = g.call_function(op, (h, w, b, t, a["ignore_index"], float(a["label_smoothing"]), impl))
                rows = g.call_function(operator.getitem, (both, 0))
                first_lse = first_lse or g.call_function(operator.getitem, (both, 1))
                if a["reduction"] == "none":
                    out = g.call_method("view_as", (rows, a["target"]))
                else:
                    out = g.call_method("sum", (rows,))
                    if a["reduction"] == "mean":
                        valid = g.call_method("sum", (g.call_function(operator.ne, (t, a["ignore_index"])),))
                        out = g.call_function(operator.truediv, (out, valid))
                out = g.call_method("to", (out, val(ce).dtype))
            ce.replace_all_uses_with(out)
            g.erase_node(ce)
        for lse in hl.lses:
            with g.inserting_before(lse):
                # NB: the logsumexp may read regrouped logits ([B·T, V]): its own shape, keepdim's 1 included (a
                # loss chunk's program is traced for one length, so the sizes are literal)
                out = g.call_function(torch.reshape, (first_lse, tuple(val(lse).shape)))
                out = g.call_method("to", (out, val(lse).dtype))
            lse.replace_all_uses_with(out)
            g.erase_node(lse)
        for n in reversed(hl.chain):
            g.erase_node(n)
    if heads:
        g.lint()
        gm.recompile()
        log.debug("adjoint-compile: %d vocabulary head(s) and their losses fused in a loss chunk", len(heads))
    return len(heads)
