"""The length literals of a region graph: dynamo bakes sizes into shape arguments (``h.view(B, T, D, N)``,
``logits.reshape(B * T, V)``), so a program for L steps (a shard, or a region retargeted to another length) has the
literal at each step position rewritten: T becomes L, and fold·T (the batch folded in front of the steps,
:attr:`~.rules.TimeLocalInfo.folds`) becomes fold·L."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..errors import UnsupportedRegion
from .rules import TimeLocalInfo

__all__ = ["SHAPE_ARG_METHODS", "rewrite_lengths"]

SHAPE_ARG_METHODS = {"view", "reshape", "expand", "broadcast_to"}


def _ev(n: fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def rewrite_lengths(info: TimeLocalInfo, T: int, n: fx.Node, new: fx.Node, L: int) -> None:
    """Shape arguments of ``new`` (the copy of ``n``) holding T (fold·T) at the step position become L (fold·L);
    raises :class:`UnsupportedRegion` for a shape computed at run time or another literal at the step position."""
    d = info.step_dim.get(n)
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.op == "call_function" and n.target not in (torch.reshape, torch.broadcast_to, torch.unflatten):
        name = ""  # only these take a shape as a function; the checked run of the programs catches anything else
    if name == "unflatten" and d is not None:
        _unflatten(info, T, n, new, L, d)
        return
    if name not in SHAPE_ARG_METHODS or d is None:
        return
    if n.op == "call_method":
        rest = list(n.args[1:])
        packed = len(rest) == 1 and isinstance(rest[0], (list, tuple))
        sizes = list(rest[0]) if packed else rest
    else:
        packed, sizes = True, list(n.args[1])
    if any(isinstance(v, fx.Node) for v in sizes) or "shape" in n.kwargs or "size" in n.kwargs:
        raise UnsupportedRegion(f"node {n.name}: shape computed at run time ({sizes}); cannot shard it")
    if len(sizes) != len(_ev(n).shape):
        raise UnsupportedRegion(f"node {n.name}: cannot read its shape arguments {sizes}")
    if sizes[d] == -1:
        return
    fold = info.folds.get(n, 1)
    if sizes[d] != fold * T:
        raise UnsupportedRegion(f"node {n.name}: size {sizes[d]} at the step position, expected "
                                f"{'' if fold == 1 else f'{fold}·'}T={fold * T}")
    sizes[d] = fold * L
    if n.op == "call_method":
        new.args = (new.args[0], tuple(sizes)) if packed else (new.args[0], *sizes)
    else:
        new.args = (new.args[0], tuple(sizes), *new.args[2:])


def _unflatten(info: TimeLocalInfo, T: int, n: fx.Node, new: fx.Node, L: int, d: int) -> None:
    """``x.unflatten(dim, sizes)``: the size of the output's step dim among ``sizes`` (dims dim.. of the output)."""
    a = {**dict(zip(("input", "dim", "sizes"), n.args)), **n.kwargs}
    dim, sizes = a.get("dim"), a.get("sizes")
    if not isinstance(dim, int) or not isinstance(sizes, (list, tuple)) or any(isinstance(v, fx.Node) for v in sizes):
        raise UnsupportedRegion(f"node {n.name}: cannot read its unflatten sizes {sizes}")
    dim += len(_ev(n.args[0]).shape) if dim < 0 else 0
    k, sizes = d - dim, list(sizes)
    if not 0 <= k < len(sizes) or sizes[k] == -1:
        return
    fold = info.folds.get(n, 1)
    if sizes[k] != fold * T:
        raise UnsupportedRegion(f"node {n.name}: size {sizes[k]} at the step position, expected T={fold * T}")
    sizes[k] = fold * L
    args = list(new.args)
    if len(args) > 2:
        args[2] = type(a["sizes"])(sizes)
        new.args = tuple(args)
    else:
        new.kwargs = {**new.kwargs, "sizes": type(a["sizes"])(sizes)}
