"""One sharded region for every sequence length: the region lowered at one length T₀ serves calls of any T ≥ 1.

The region graph is lowered from a graph specialized to T₀ (passes/capture/specialize.py), so its shape arguments hold T₀
as a literal at the step position (``h.view(B, T₀, D, N)``). The shard programs already rewrite that literal to
their shard length L; a call of another length T gets the region graph with the literal rewritten to T
(:func:`retarget`), prepared once per T (shape propagation and analysis on fake tensors), and shares the shard
programs of every other length, built, checked and compiled once per shard length:

    calls of T = 300, 301, 977 ─► LengthGenericRegion ─► ShardedRegion(T) per T  (cheap: analysis only)
                                                   └────► shard programs of S, S/2, S/4, ... steps
                                                          (compiled once; the sweep cuts T into S-step shards
                                                           and a tail of powers of two)

Whatever T, the shards partition the steps, so the gradients are exact; the compiled programs number at most
1 + log₂ S per call pattern, not one per length.
"""
from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..analysis.layout_rules import BROADCAST_DIM
from ..errors import AdjointCompileWarning, UnsupportedRegion
from ..regions import Fallback
from .sharded import ShardedRegion

log = logging.getLogger(__name__)

__all__ = ["LengthGenericRegion", "retarget", "KEEP"]

#: prepared lengths (and input shapes) kept per region
KEEP = 64


def retarget(region: ShardedRegion, T: int, stops: dict[str, tuple[int, str, int]] | None = None) -> fx.GraphModule:
    """``region``'s graph (prepared at its own length) with the length literal at every step position rewritten to
    ``T``; raises :class:`UnsupportedRegion` where a shape argument holds another literal at a step position.
    ``stops``: per getitem node's name, a slice bound of its index that is ±the length (``x[..., :T]`` after a causal
    conv, ``x[:, -T:]``), read from the graph with symbolic sizes (item, "start" or "stop", sign): it becomes ±T too."""
    plan = region._plan
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in region.region_gm.graph.nodes:
        new = g.node_copy(n, env.__getitem__)
        # NB: dynamo's example values are of the call the graph was lowered at: its batch too, which a loss that
        # folds it into rows (logits.flatten(0, 1)) keeps in a shape; the region's analysis reads fresh ones
        new.meta.pop("example_value", None)
        if n.op != "placeholder" and (d := plan.info.step_dim.get(n)) is not None and all(
                plan.info.step_dim.get(a) is None for a in n.all_input_nodes):
            new.meta[BROADCAST_DIM] = d  # NB: a step-free value broadcast along time: at T = B its dim is ambiguous
        env[n] = new
        if n.op in ("call_method", "call_function") and T != plan.T:
            plan._rewrite_lengths(n, new, T)
            if stops and n.name in stops:
                new.args = (new.args[0], _bound_to(n.args[1], stops[n.name], plan.T, T, n.name))
    return fx.GraphModule(region.region_gm, g)


def _bound_to(idx: Any, at: tuple[int, str, int], T0: int, T: int, name: str) -> Any:
    """The index ``idx`` with the slice bound ``at`` = (item, "start" or "stop", sign), sign·T₀, made sign·T."""
    j, field, sign = at
    items = list(idx) if isinstance(idx, tuple) else [idx]
    i = items[j] if j < len(items) else None
    if not isinstance(i, slice) or getattr(i, field) != sign * T0:
        raise UnsupportedRegion(f"node {name}: index {idx} does not hold the lowered length {sign * T0} at item {j}")
    bounds = {"start": i.start, "stop": i.stop, "step": i.step, field: sign * T}
    items[j] = slice(bounds["start"], bounds["stop"], bounds["step"])
    return tuple(items) if isinstance(idx, tuple) else items[0]


class LengthGenericRegion(torch.nn.Module):
    """A region call that serves every length (module docstring). ``template`` is the region lowered and prepared
    at its own length; ``shard_size`` (None: chosen per length from the region's costs, rounded down to a power of
    two so that the shard lengths stay few)."""

    def __init__(self, template: ShardedRegion, shard_size: int | None,
                 stops: dict[str, tuple[int, str, int]] | None = None) -> None:
        super().__init__()
        #: the slice bounds that are ±the length (:func:`retarget`)
        self.stops = dict(stops or {})
        if getattr(template._plan, "per_sample", None) is not None:
            raise UnsupportedRegion("per-example clipping regions are specialized per length")
        self.template = template
        self.shard_size = shard_size
        self.label = template.label
        self.T0 = template._plan.T
        #: the built and compiled shard programs of every length, by layout without step dims (ShardProgram.shared)
        self.shared: dict[tuple, tuple[dict, dict, dict]] = {}
        #: the prepared region of each recent length and input shapes, by (T, shapes...) (the least recently used
        #: beyond :data:`KEEP` are dropped: they hold shape analyses only, the compiled programs stay in ``shared``)
        self.regions: OrderedDict[tuple, ShardedRegion] = OrderedDict()
        #: distinct lengths seen (report)
        self.lengths: set[int] = set()
        #: the report's fallbacks (set by the caller), where a call the region cannot serve is listed
        self.fallbacks: list[Fallback] = []
        #: calls it could not serve, by (T, shapes...): why, and the region's graph at T, which they run with
        #: ordinary autograd
        self.unserved: dict[tuple, tuple[str, fx.GraphModule]] = {}
        self._fallback: Fallback | None = None

    def _length(self, inputs: Sequence[Any]) -> int:
        return next(x.shape[d] for x, d in zip(inputs, self.template.in_step_dims) if d is not None)

    def _region(self, key: tuple, T: int) -> ShardedRegion:
        # NB: one region per set of input shapes, not per length: a region is prepared for its inputs' shapes, and
        # a forward's backward runs on that preparation (micro-batches of two batch sizes at one length, one backward)
        r = self.regions.get(key)
        if r is not None:
            self.regions.move_to_end(key)
            return r
        t = self.template
        r = ShardedRegion(retarget(t, T, self.stops), t.in_step_dims, t.out_step_dims, self.shard_size, inner=t._plan.inner,
                          window=t.window, cuda_graphs=t.cuda_graphs, fused_loss=t.fused_loss)
        r.label = t.label
        r._plan.length_free, r._plan.shared = True, self.shared
        self.regions[key] = r
        while len(self.regions) > KEEP:
            self.regions.popitem(last=False)
        return r

    def forward(self, *inputs: Any) -> Any:
        T = self._length(inputs)
        if T < 1:
            raise ValueError(f"{self.label}: T={T} steps; a sharded region needs at least one")
        self.lengths.add(T)
        key = (T, *(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)))
        if key not in self.unserved:
            try:
                return self._region(key, T)(*inputs)
            except UnsupportedRegion as e:
                self._unserve(key, str(e))
        return self.unserved[key][1](*inputs)

    def _unserve(self, key: tuple, why: str) -> None:
        """Run the calls of these sizes with ordinary autograd: warned once per region, listed in the report."""
        self.regions.pop(key, None)
        self.unserved[key] = (why, retarget(self.template, key[0], self.stops))
        log.info("adjoint-compile: %s cannot be sharded at sizes %s: %s", self.label, key, why)
        if self._fallback is not None:
            self._fallback.details["signatures"] = list(self.unserved)
        else:
            self._fallback = Fallback(f"region {self.label} could not be sharded at a length it had not run at",
                                      "report it with the model; calls of other sizes keep the rewrite",
                                      {"signatures": list(self.unserved), "first": why})
            self.fallbacks.append(self._fallback)
            warnings.warn(AdjointCompileWarning(
                f"adjoint-compile: region {self.label} cannot be sharded at T={key[0]} ({why}); calls of these sizes "
                f"run with ordinary autograd (no memory saved there), other sizes keep the rewrite"), stacklevel=3)
