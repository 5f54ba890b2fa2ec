"""Stage 1 of the pipeline: take dynamo's graph as it is and give the later stages a typed handle on it.

Dynamo's graph is torch-level (``torch.*``, ``operator.*``, ``Tensor`` methods; parameters lifted to
placeholders) and every node carries ``meta["example_value"]``, a FakeTensor with its shape. Recognition works on
this level on purpose: ``linear(x)`` on ``[B, T, D]`` is visibly time-local here, whereas after decomposition to
aten it becomes ``view(x, [B*T, D]) @ W`` and the step axis is merged away.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx


@dataclasses.dataclass
class Captured:
    """One dynamo graph and its example inputs (real tensors, or fakes when dynamo passes fakes)."""

    gm: fx.GraphModule
    example_inputs: list[Any]

    @functools.cached_property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def example_value(self, node: fx.Node) -> Any:
        """The FakeTensor (or Python value) dynamo recorded for ``node``; None when unknown."""
        return node.meta.get("example_value", node.meta.get("val"))

    def nx(self):
        """The graph as a networkx DiGraph over node names (edges: producer -> user)."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self.gm.graph.nodes:
            g.add_node(n.name, op=n.op, target=str(n.target))
            for user in n.users:
                g.add_edge(n.name, user.name)
        return g


def capture(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Captured:
    """Wrap dynamo's graph; nothing is rewritten at this stage."""
    return Captured(gm=gm, example_inputs=list(example_inputs))


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("example_value", node.meta.get("val")), torch.Tensor)
