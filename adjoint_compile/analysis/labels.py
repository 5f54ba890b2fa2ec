"""Node labels for comparing the steps of an unrolled loop (:mod:`adjoint_compile.passes.match.unrolled`): equal for the
same op with the same constants, with the indices of an indexing op apart (they progress from step to step)."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .optable import fn_name, target_key

__all__ = ["index_kind", "node_label", "node_args"]


def index_kind(n: fx.Node) -> str | None:
    """Which argument of an indexing op holds the per-step index: "getitem", "select" or "narrow"; else None."""
    if n.op == "call_function" and n.target is operator.getitem:
        return "getitem"
    name = fn_name(n) if n.op in ("call_function", "call_method") else ""
    if name in ("select", "narrow"):
        return name
    return None


def _abstract(v: Any, ints: list[int], vary: bool) -> Any:
    """Constants of a node's arguments with nodes replaced by a marker; with ``vary`` ints go to ``ints``."""
    if isinstance(v, fx.Node):
        return "%"
    if isinstance(v, bool) or v is None or isinstance(v, (str, float, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, int):
        if vary:
            ints.append(v)
            return "#"
        return repr(v)
    if isinstance(v, slice):
        return ("slice", _abstract(v.start, ints, vary), _abstract(v.stop, ints, vary), _abstract(v.step, ints, vary))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_abstract(x, ints, vary) for x in v))
    if isinstance(v, dict):
        return tuple(sorted((k, _abstract(x, ints, vary)) for k, x in v.items()))
    return repr(type(v))


def node_label(n: fx.Node) -> tuple[Any, tuple[int, ...]]:
    """(label, varying ints): the label is equal for the same op with the same constants; the ints are the indices
    of an indexing op (which may differ from step to step of an unrolled loop)."""
    ints: list[int] = []
    kind = index_kind(n)
    if kind == "getitem":
        args = (_abstract(n.args[0], ints, False), _abstract(n.args[1], ints, True))
        kw = _abstract(n.kwargs, ints, False)
    elif kind in ("select", "narrow"):
        args = tuple(_abstract(a, ints, i == 2) for i, a in enumerate(n.args))
        kw = tuple(sorted((k, _abstract(v, ints, k in ("index", "start"))) for k, v in n.kwargs.items()))
    else:
        args = _abstract(tuple(n.args), ints, False)
        kw = _abstract(n.kwargs, ints, False)
    return (target_key(n), args, kw), tuple(ints)


def node_args(n: fx.Node) -> list[Any]:
    """A node's arguments flattened in a fixed order (positional, then keyword by name)."""
    out: list[Any] = []

    def flat(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            for x in v:
                flat(x)
        elif isinstance(v, slice):
            flat(v.start), flat(v.stop), flat(v.step)
        elif isinstance(v, dict):
            for k in sorted(v):
                flat(v[k])
        else:
            out.append(v)

    flat(n.args)
    flat(dict(n.kwargs))
    return [v for v in out if isinstance(v, fx.Node)]
