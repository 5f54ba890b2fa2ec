"""Batching rules for a loss computed at every step of a loop: ``F.cross_entropy`` / ``F.nll_loss`` of the step's
logits and its targets, emitted once for all T steps (:class:`.batching.Batcher`).

A loop that scores each step (``out.append(F.cross_entropy(head(h), y[:, t]))``, or ``loss = loss + ...``, which
the loop roller turns into the same) reduces over the step's own rows only. Batched, the step axis leads::

    per step: x [N, C, *d], y [N, *d]  ->  batched x [T, N, C, *d], y [T, N, *d]:
        ce(x.movedim(0, 1).flatten(0, 1), y.movedim(0, 1).flatten(0, 1), reduction="none")   # [N·T, *d]
            .unflatten(0, (-1, T)).movedim(1, 0)                                               # [T, N, *d]
    reduction "sum":   that summed over its dims after the first                               # [T]
    reduction "mean":  that sum / (Σ weight[y] or the count, over targets not ignore_index)   # [T]

and for one row per step (x [C], y []), the loss of each step's row. The mean is eager's own (a step whose targets
are all ignored is nan in both). Not batched (:class:`NotBatched`, unproven to the batching): probability targets, per-step class
weights, a target the same at every step, and the legacy ``size_average``/``reduce``.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F

from ...analysis.fx import example_value

__all__ = ["LOSSES", "NotBatched", "batch_loss"]

#: the table's name of a loss -> the function its arguments are bound against
LOSSES = {"cross_entropy": F.cross_entropy, "nll_loss": F.nll_loss}


class NotBatched(Exception):
    """The loss has no exact batched form here; the message says why (the batching takes it as unproven)."""


def _per_step(x: Any) -> bool:
    return bool(getattr(x, "batched", False))


def batch_loss(b: Any, v: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """The per-step loss ``v`` for all steps, step axis first: its node. ``b``: the :class:`.batching.Batcher`;
    the arguments are its values (a node and whether it has the step axis first)."""
    try:
        bound = inspect.signature(LOSSES[name]).bind(*args, **kwargs)
    except TypeError as e:
        raise NotBatched(f"{name} {v.name}: {e}") from e
    bound.apply_defaults()
    a = dict(bound.arguments)
    x, y, reduction = a.pop("input"), a.pop("target"), a.pop("reduction")
    if a.pop("size_average") is not None or a.pop("reduce") is not None:
        raise NotBatched(f"{name} {v.name} uses the legacy size_average/reduce arguments")
    if not (_per_step(x) and _per_step(y)):
        raise NotBatched(f"{name} {v.name}: its input and its target are not both per-step values")
    weight, ignore = a.get("weight"), a.get("ignore_index")
    target = example_value(y.node)
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.is_complex():
        raise NotBatched(f"{name} {v.name} has probability targets")
    if _per_step(weight):
        raise NotBatched(f"{name} {v.name} has per-step class weights")
    if reduction not in ("none", "sum", "mean") or not isinstance(ignore, int):
        raise NotBatched(f"{name} {v.name} has reduction={reduction!r}, ignore_index={ignore!r}")
    em, r = b.em, x.rank()
    rest = {k: getattr(w, "node", w) for k, w in a.items()}
    if r == 1:  # NB: one row per step: x [T, C] and y [T] are T rows
        loss = em(LOSSES[name], (x.node, y.node), {**rest, "reduction": "none"})
    else:
        # NB: rows merged with the steps innermost ([N, T] -> N·T, as a [B, T, V] -> [B·T, V] flatten): the form the
        # time-local analysis follows through the loss (a [T, N] merge would mix the steps' rows)
        rows = [em(torch.flatten, (em(torch.movedim, (z.node, 0, 1)), 0, 1)) for z in (x, y)]
        flat = em(LOSSES[name], tuple(rows), {**rest, "reduction": "none"})
        loss = em(torch.movedim, (em(torch.unflatten, (flat, 0, (-1, b.T))), 1, 0))
    if reduction == "none":
        return loss
    dims = tuple(range(1, r))
    total = em(torch.sum, (loss, dims)) if dims else loss
    if reduction == "sum":
        return total
    valid = em(operator.ne, (y.node, ignore))
    if weight is None:
        count = em("to", (valid, example_value(loss).dtype), {}, True)
    else:
        # NB: a lookup (as of token embeddings), which the time-local analysis follows; an ignored target reads row 0
        table = em(torch.unsqueeze, (getattr(weight, "node", weight), -1))
        picked = em(torch.squeeze, (em(F.embedding, (em(torch.where, (valid, y.node, 0)), table)), -1))
        count = em(operator.mul, (picked, valid))
    den = em(torch.sum, (count, dims)) if dims else count
    return em(operator.truediv, (total, den))
