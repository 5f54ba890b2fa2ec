"""``verify=True`` for a whole graph: the gradients the rewritten graph gives against those of the graph as dynamo
captured it, under plain autograd, on the first call's inputs (the per-region figures are in :mod:`.sharded`).

Both runs get the same inputs (detached copies; the tensors that require grad keep requiring it) and the same random
cotangents (fp32 ``randn`` from ``torch.Generator().manual_seed(1)``, cast to each output), and every gradient is
compared as one vector: ``grad_rel_err`` = ‖g − g_exact‖ / ‖g_exact‖, ``grad_cosine``, and the worst tensor.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

__all__ = ["copy_graph_module", "compare_grads", "grads_of", "graph_fidelity"]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (node meta copied shallowly), for a pass to rewrite or to keep as is."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def grads_of(run: Callable[..., Any], args: Sequence[Any], named: dict[str, torch.Tensor] | None = None,
             seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of Σ ⟨output, cotangent⟩ (module docstring) of ``run(*args)``, the forward run from RNG state
    ``seed``: w.r.t. ``named`` (tensors ``args`` lead to), or when None w.r.t. detached copies of the floating-point
    ``args`` that require grad (named ``input i``)."""
    if named is None:
        args = [x.detach().clone().requires_grad_(x.requires_grad)
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args]
        named = {f"input {i}": x for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        out = run(*args)
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        gen = torch.Generator().manual_seed(1)
        cots = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
        grads = torch.autograd.grad(outs, list(named.values()), cots, allow_unused=True) if outs and named else []
    return {n: g.detach() for n, g in zip(named, grads) if g is not None}


def compare_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``grad_rel_err``, ``grad_cosine`` (all tensors as one vector), ``worst`` / ``worst_rel_err`` (per tensor),
    ``tensors`` compared and ``missing`` (names with a gradient on one side only)."""
    names = [n for n in want if n in got]
    if not names:
        return {"grad_rel_err": 0.0, "grad_cosine": 1.0, "worst": "", "worst_rel_err": 0.0, "tensors": 0,
                "missing": sorted(set(want) ^ set(got))}
    a = torch.cat([got[n].double().flatten().cpu() for n in names])
    b = torch.cat([want[n].double().flatten().cpu() for n in names])
    rel = {n: float((got[n].double() - want[n].double()).norm() / want[n].double().norm().clamp_min(1e-30))
           for n in names}
    worst = max(rel, key=rel.__getitem__)
    return {"grad_rel_err": float((a - b).norm() / b.norm().clamp_min(1e-30)),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "worst": worst, "worst_rel_err": rel[worst], "tensors": len(names),
            "missing": sorted(set(want) ^ set(got))}


def graph_fidelity(original: fx.GraphModule, rewritten: Callable[..., Any], args: Sequence[Any]) -> dict[str, Any]:
    """:func:`compare_grads` of ``rewritten`` against plain autograd of ``original`` on ``args``."""
    want = grads_of(original, args)
    got = grads_of(rewritten, args)
    return compare_grads(got, want)
