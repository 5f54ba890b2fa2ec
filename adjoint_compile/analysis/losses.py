"""Losses over the steps of a sequence: ``F.cross_entropy`` and ``F.nll_loss`` (``nn.CrossEntropyLoss`` and
``nn.NLLLoss``, which dynamo inlines to them) in the time-local analysis (:mod:`.time_local`).

Each row of a loss reads its own row of the input and of the target, so a loss is time-local when both carry the
step axis at rows that line up:

* ``cross_entropy(logits.flatten(0, 1), targets.flatten())``: ``[B·T, V]`` rows and ``[B·T]`` targets, the batch
  folded in front of the steps (:attr:`~.rules.TimeLocalInfo.folds`);
* ``cross_entropy(logits.transpose(1, 2), targets)``: ``[B, V, T]`` (the class dim is dim 1) and ``[B, T]``;
* class-index targets (``ignore_index``, ``weight``, ``label_smoothing``) or class probabilities (the input's
  shape).

``reduction="none"`` gives one loss per row (:func:`row_loss`); ``"sum"`` and ``"mean"`` end a region like a sum
over time (:func:`loss_sum`): the shards' sums add up, and a mean over class-index targets is that sum over the
count of valid targets (their weights, with ``weight``), a whole-batch quantity the shards add up too
(:func:`loss_count`), so a shard whose targets are all ignored adds nothing to either.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .rules import Ctx, TimeLocalInfo, TimeSum, op_label, step_shape

__all__ = ["LOSSES", "loss_args", "row_loss", "loss_sum", "loss_count"]

#: the losses and their arguments in signature order.
LOSSES: dict[Any, tuple[str, ...]] = {
    F.cross_entropy: ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                      "label_smoothing"),
    F.nll_loss: ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"),
}
_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
             "label_smoothing": 0.0}


def loss_args(node: fx.Node) -> dict[str, Any] | None:
    """The arguments of a ``cross_entropy`` / ``nll_loss`` call by name (defaults filled in), or None for another
    node or one with the legacy ``size_average`` / ``reduce`` arguments."""
    names = LOSSES.get(node.target) if node.op == "call_function" else None
    if names is None or len(node.args) > len(names) or node.kwargs.keys() - set(names):
        return None
    a = {**{k: _DEFAULTS[k] for k in names[2:]}, **dict(zip(names, node.args)), **node.kwargs}
    if a["size_average"] is not None or a["reduce"] is not None or a["reduction"] not in ("none", "sum", "mean"):
        return None
    return a


def _rows(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None, dict[str, Any] | None]:
    """(step dim of the per-row losses, why the loss mixes steps, its arguments) as with ``reduction="none"``."""
    a = loss_args(node)
    if a is None:
        return None, f"{op_label(node)} with arguments the analysis does not read", None
    x, t, w = a["input"], a["target"], a["weight"]
    if ctx.sd(w) is not None:
        return None, f"{op_label(node)} weight depends on the step", a
    dx, dt = ctx.sd(x), ctx.sd(t)
    if dx is None and dt is None:
        return None, None, a
    sx, st = step_shape(x), step_shape(t)
    if dx is None or dt is None or sx is None or st is None:
        return None, f"{op_label(node)} whose input and target do not both carry the step axis", a
    if len(sx) < 2 or dx == 1:
        return None, f"{op_label(node)} over classes along the step dim", a
    out = 0 if dx == 0 else dx - 1
    probs = len(st) == len(sx)  # class probabilities: the input's shape
    if dt != (dx if probs else out):
        return None, f"{op_label(node)} whose input and target carry the step axis at rows that do not line up", a
    return out, None, a


def row_loss(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """The rule of a loss: time-local with ``reduction="none"`` (one loss per row: the target's shape); a sum or
    mean over the rows sums over the step dim (with ``analyze(..., halo=True)`` it ends a region:
    :func:`loss_sum`)."""
    d, why, a = _rows(node, ctx)
    if d is not None and why is None and a["reduction"] != "none":
        return None, f"{op_label(node)} sums over the step dim (reduction={a['reduction']!r})"
    return d, why


def loss_sum(node: fx.Node, info: TimeLocalInfo) -> TimeSum | None:
    """``node`` as a sum over time: a time-local loss with ``reduction="sum"`` or ``"mean"`` (a mean over
    class-index targets is a ratio: the sum over the valid targets' count), or None."""
    if node.op != "call_function" or node.target not in LOSSES:
        return None
    d, why, a = _rows(node, Ctx(node, info))
    if d is None or why is not None or a["reduction"] == "none" or info.mixing.get(a["input"]) is not None:
        return None
    folds = {info.folds.get(v, 1) for v in (a["input"], a["target"])}
    if len(folds) != 1:
        return None
    probs = len(step_shape(a["target"])) == len(step_shape(a["input"]))
    mean = a["reduction"] == "mean"
    return TimeSum(node=node, input=a["input"], dim=info.step_dim[a["input"]], mean=mean and probs,
                   ratio=mean and not probs)


def loss_count(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The denominator of a mean loss over class-index targets: how many are not ``ignore_index`` (the sum of their
    class weights, with ``weight``), as ``nll_loss`` and ``cross_entropy`` count them."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    # NB: in fp32 at least, as eager's kernels accumulate it: half-precision weights summed in their dtype round
    return torch.where(valid, weight[torch.where(valid, target, 0)], 0).sum(dtype=torch.promote_types(weight.dtype,
                                                                                                     torch.float32))
