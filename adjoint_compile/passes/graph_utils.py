"""Small FX graph utilities shared by the passes."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx

#: linear_scan's arguments in schema order, and the defaults of the optional ones.
SCAN_ARGS = ("a", "b", "h0", "dim", "reverse", "window", "impl")
SCAN_DEFAULTS: dict[str, Any] = {"h0": None, "dim": 1, "reverse": False, "window": None, "impl": None}


def is_linear_scan(node: fx.Node) -> bool:
    """True for a call of ``torch.ops.adjoint_compile.linear_scan`` (overload or packet)."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name == "adjoint_compile::linear_scan"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name == "adjoint_compile::linear_scan"
    return False


def scan_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a linear_scan node by name: a, b, h0, dim, reverse, window, impl."""
    t = node.target
    names = list(SCAN_ARGS)
    if isinstance(t, torch._ops.OpOverload):
        names = [a.name for a in t._schema.arguments]
    out = dict(SCAN_DEFAULTS)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder ``graph`` so that every node follows its inputs, keeping the current order wherever it is valid."""
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    indeg = {n: len(set(n.all_input_nodes)) for n in order}
    ready = [(index[n], n.name) for n in order if indeg[n] == 0]
    by_name = {n.name: n for n in order}
    heapq.heapify(ready)
    out: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        n = by_name[name]
        out.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (index[u], u.name))
    if len(out) != len(order):
        raise RuntimeError("a pass made a cycle in the graph")  # NB: a bug in a pass, never a user error
    if out == order:
        return
    prev = out[0]
    if order[0] is not prev:
        order[0].prepend(prev)
    for n in out[1:]:
        prev.append(n)
        prev = n


def callables_named(name: str, modules: Iterable[Any]) -> Iterator[Any]:
    """Every hashable callable called ``name`` in ``modules`` (``torch.add``, ``Tensor.add``, ``operator.add``...):
    the keys a table of torch-level ops needs so that every spelling of an op in a dynamo graph finds it."""
    for mod in modules:
        obj = getattr(mod, name, None)
        if obj is None or not callable(obj):
            continue
        try:
            hash(obj)
        except TypeError:
            continue
        yield obj
