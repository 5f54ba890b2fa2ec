"""Lower once for every length: the regions lowered in a graph specialized to one call's sizes, put back into the
graph with symbolic sizes that dynamo captured, so that one compiled graph serves every sequence length.

Before (dynamo's graph with a symbolic length ``s27``, and the same graph specialized to T₀ = 256 and lowered)::

    x: f32[2, s27, 16]                    x: f32[2, 256, 16]
    u = norm(x); a = ...; b = ...         adjoint_region_0 = ShardedRegion(norm ... linear_scan ... mean)
    h = linear_scan(a, b)                 loss = adjoint_region_0(x, W, ...)
    y = h.view(2, s27, 4, 16) ...
    loss = y.mean()

After (the symbolic graph)::

    x: f32[2, s27, 16]
    loss = adjoint_region_0(x, W, ...)    # LengthGenericRegion: the T₀ region, retargeted per call's T

The region's nodes are found in the symbolic graph by name. Anything that does not match (normalization made or
dropped nodes in the region, a member reads a value that is neither a member, a region input nor a size) leaves the
symbolic graph alone and says why; the caller then specializes per length. The partitions between region calls
are compiled for symbolic sizes (passes/stitch/), once.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ...analysis.fx import eliminate_dead_code
from ...analysis.fx import example_value as _ev
from ...analysis.fx import stable_toposort
from ...regions import PROVENANCE
from ...runtime.length_generic import LengthGenericRegion
from ...runtime.sharded import ShardedRegion

log = logging.getLogger(__name__)

__all__ = ["generalize"]


def _is_size(n: fx.Node) -> bool:
    return not isinstance(_ev(n), torch.Tensor)


def generalize(sym: fx.GraphModule, lowered: fx.GraphModule, calls: list[str],
               shard_size: int | None) -> tuple[list[str], str]:
    """Put the region calls ``calls`` of ``lowered`` (specialized and lowered) into ``sym`` (in place, only on
    success). Returns (the region call names in ``sym``, "") or ([], why not)."""
    by_name = {n.name: n for n in sym.graph.nodes}
    plans = []
    for c in calls:
        call = next((n for n in lowered.graph.nodes if n.name == c), None)
        mod = lowered.get_submodule(call.target) if call is not None and call.op == "call_module" else None
        if not isinstance(mod, ShardedRegion):
            return [], f"{c} is not a sharded region call"
        prov = call.meta.get(PROVENANCE, {})
        members = prov.get("members", [])
        missing = [m for m in [*members, *prov.get("inputs", []), *prov.get("outputs", [])] if m not in by_name]
        if missing:
            return [], f"{c}: node(s) {', '.join(missing[:3])} of the lowered region are not in the captured graph"
        mset = {by_name[m] for m in members}
        inputs = [by_name[a] for a in prov["inputs"]]
        outputs = [by_name[o] for o in prov["outputs"]]
        for m in mset:
            for a in m.all_input_nodes:
                if a not in mset and a not in inputs and not _is_size(a):
                    return [], f"{c}: member {m.name} reads {a.name}, which the lowered region does not take in"
            if any(u not in mset for u in m.users) and m not in outputs:
                return [], f"{c}: member {m.name} is read outside the region"
        plans.append((call.target, mod, mset, inputs, outputs))
    order = {n: i for i, n in enumerate(sym.graph.nodes)}
    made = []
    for target, mod, mset, inputs, outputs in plans:
        sym.add_submodule(target, LengthGenericRegion(mod, shard_size))
        last = max(mset, key=order.__getitem__)
        with sym.graph.inserting_after(last):
            call = sym.graph.call_module(target, tuple(inputs))
        call.meta["example_value"] = tuple(_ev(o) for o in outputs)
        call.meta[PROVENANCE] = {"pass": "lower_generic", "region": target}
        prev = call
        for i, o in enumerate(outputs):
            with sym.graph.inserting_after(prev):
                gi = sym.graph.call_function(operator.getitem, (call, i))
            gi.meta = {"example_value": _ev(o), PROVENANCE: {"region": target, "output": o.name}}
            o.replace_all_uses_with(gi, delete_user_cb=lambda u: u not in mset)
            prev = gi
        for n in sorted(mset, key=order.__getitem__, reverse=True):
            sym.graph.erase_node(n)
        made.append(call.name)
    stable_toposort(sym.graph)
    eliminate_dead_code(sym.graph)
    sym.graph.lint()
    sym.recompile()
    log.info("adjoint-compile: %d region(s) lowered once for every length", len(made))
    return made, ""
