"""Small FX graph utilities shared by the passes."""
from __future__ import annotations

import heapq

import torch.fx as fx


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
