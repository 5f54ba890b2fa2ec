"""The exact-adjoint lowering under ``per_sample_clip`` (issue 14): what a sharded region needs so that its
parameters get per-example gradients (runtime/sharded_ps.py).

- Parameter math feeding the region (``A = -exp(A_log)``) is copied into it, so that every parameter input of the
  region is a parameter itself: its per-example gradient is recorded for the parameter, not for a derived value.
- The examples' axis of every region output and scan state is found and checked: ``batch_dim`` with the batch size
  there and not the step axis (a scan state loses its step axis: the examples' axis moves down by one when the step
  axis came before it). A region that does not carry the examples there keeps ordinary autograd (with per-example
  book-keeping of its parameters), and explain() says why. A scalar sum over time the region ends in (the loss)
  sums over the examples too: it has no examples' axis, and its kind ("R" or "D") is recorded for the per-example
  analysis of the graph around the region.
- A causal conv's halo (the steps of its input before a shard, carried from shard to shard like a scan state) has
  the examples on its conv input's axis (:func:`with_halo_axes`, once the shard programs know their convs).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.fx as fx

from ...analysis.batch_axes import followed_axes, moved_batch_axes
from ...analysis.fx import example_value as _ev
from ...analysis.rules import TimeLocalInfo
from ...errors import UnsupportedRegion
from ...options import Options
from ...runtime.sharded_ps import PerSampleRegion
from .per_sample import classify_kinds, region_out_axes, warn_batch_mean

log = logging.getLogger(__name__)

__all__ = ["pull_in_parameter_math", "per_sample_region", "with_halo_axes"]


def pull_in_parameter_math(gm: fx.GraphModule, nodes: list[fx.Node], info: TimeLocalInfo,
                           opts: Options) -> tuple[list[fx.Node], dict[fx.Node, str], int]:
    """``nodes`` plus copies of the parameter-only nodes feeding them (the originals stay for other users);
    returns (nodes, the per-example kinds of the graph's values, the batch size)."""
    kind_of, batch = classify_kinds(gm, opts.batch_dim)
    if batch is None:
        raise UnsupportedRegion(f"per_sample_clip: no graph input has an example axis batch_dim={opts.batch_dim}")
    # NB: now, while the loss is in the graph: the region may take it in
    warn_batch_mean(gm, kind_of, opts.batch_dim, float(opts.per_sample_clip or float("inf")))
    members = set(nodes)
    chain: list[fx.Node] = []
    todo = [a for n in nodes for a in n.all_input_nodes
            if a not in members and kind_of.get(a) == "P" and a.op not in ("placeholder", "get_attr")]
    while todo:
        m = todo.pop()
        if m not in chain:
            chain.append(m)
            todo += [a for a in m.all_input_nodes if kind_of.get(a) == "P" and a.op not in ("placeholder", "get_attr")]
    if not chain:
        return nodes, kind_of, batch
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chain.sort(key=order.__getitem__)
    env: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(min(nodes, key=order.__getitem__)):
        for m in chain:
            env[m] = gm.graph.node_copy(m, lambda a: env.get(a, a))
            env[m].meta = dict(m.meta)
            kind_of[env[m]] = "P"
            info.step_dim[env[m]] = None
    for n in nodes:
        for a in list(n.all_input_nodes):
            if a in env:
                n.replace_input_with(a, env[a])
    log.debug("per_sample_clip: %d parameter-only node(s) copied into the region", len(chain))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted([*env.values(), *nodes], key=order.__getitem__), kind_of, batch


def _bdim(n: fx.Node, info: TimeLocalInfo, k: int | None, batch: int, what: str, carry: bool = False) -> int:
    """The examples' axis ``k`` of region output or scan state ``n`` (followed from the graph's inputs: None where a
    permutation lost it), checked: the batch size there and not the step axis; a scan state's with its step axis
    gone."""
    v, sd = _ev(n), info.step_dim.get(n)
    if k is None or not (isinstance(v, torch.Tensor) and v.dim() > k and int(v.shape[k]) == batch and sd != k):
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        where = "an axis it lost" if k is None else f"axis {k}"
        raise UnsupportedRegion(f"per_sample_clip: {what} {n.name} {shape} does not carry the {batch} examples on "
                                f"{where} (apart from its step axis {sd}); kept unsharded")
    return k - 1 if carry and sd is not None and sd < k else k


def per_sample_region(gm: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node], scans: list[fx.Node],
                      info: TimeLocalInfo, kind_of: dict[fx.Node, Any], opts: Options, batch: int) -> PerSampleRegion:
    bd = opts.batch_dim
    params = tuple(i for i, a in enumerate(inputs) if kind_of.get(a) == "P")
    # NB: the examples' axis of every activation, followed through permutations (a [T, B, D] value where T == B has
    # B at axis 0 but not the examples)
    acts = {n for n, kd in kind_of.items() if kd in ("A", "M")}
    moved = moved_batch_axes(gm, acts, bd, batch, calls=region_out_axes(gm))
    # NB: a loss taken into the region sums over the examples too: a scalar whose per-example parts the expanded
    # parameters tell apart (runtime/sharded_ps.py)
    losses = {k: kind_of.get(o) for k, o in enumerate(outputs) if o in info.sums and _scalar(o)}
    if any(kd not in ("R", "D") for kd in losses.values()):
        raise UnsupportedRegion("per_sample_clip: a sum over time the region ends in is not a sum over examples")
    outs = tuple(None if k in losses else _bdim(o, info, moved.get(o, bd), batch, "output")
                 for k, o in enumerate(outputs))
    carries = tuple(_bdim(s, info, moved.get(s, bd), batch, "scan state", carry=True) for s in scans)
    # NB: -1: examples on an axis a permutation lost
    ins = tuple(None if a not in acts else -1 if (k := moved.get(a, bd)) is None else k for a in inputs)
    per_example = batch * sum(_ev(inputs[i]).numel() * _ev(inputs[i]).element_size() for i in params)
    return PerSampleRegion(params, outs, carries, batch=batch, loss_kinds=losses, example_bytes=per_example,
                           in_bdims=ins)


def _scalar(n: fx.Node) -> bool:
    v = _ev(n)
    return isinstance(v, torch.Tensor) and v.dim() == 0


def with_halo_axes(ps: PerSampleRegion, plan: Any, bd: int) -> PerSampleRegion:
    """``ps`` with the examples' axis of each conv halo the sweep carries after the scans' states (``plan``: the
    region's prepared :class:`~adjoint_compile.runtime.shard_program.ShardProgram`): its conv input's, followed from
    the region's inputs through the region graph. Its per-example backward pairs every carry's cotangent with that
    axis; a halo without the examples is refused (the region keeps ordinary autograd)."""
    if len(ps.carry_bdims) != len(plan.scans) or not plan.convs:
        return ps
    gm, B = plan.region_gm, ps.batch
    seeds = {n: None if k < 0 else k for n, k in zip(plan.placeholders, ps.in_bdims) if k is not None}
    acts, moved = followed_axes(gm, seeds, bd, B)
    halos = []
    for cc in plan.convs:
        k = moved.get(cc.input, bd) if cc.input in acts else None
        v = _ev(cc.input)
        if k is None or k == cc.dim or not (isinstance(v, torch.Tensor) and v.dim() > k and int(v.shape[k]) == B):
            raise UnsupportedRegion(f"per_sample_clip: the causal conv input {cc.input.name} does not carry the {B} "
                                    f"examples on an axis followed from the region's inputs; kept unsharded")
        halos.append(k)
    return dataclasses.replace(ps, carry_bdims=(*ps.carry_bdims, *halos))
