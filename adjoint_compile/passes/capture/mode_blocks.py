"""Detach what leaves a ``torch.no_grad()`` block, so that the passes' reordering cannot make it differentiable.

Dynamo writes a ``with torch.no_grad():`` (or ``torch.inference_mode()``) block inside the compiled code as calls
around its ops, ``torch._C._set_grad_enabled(False)`` ... ``(True)``; what the block computes is a constant for
autograd only because those ops run between the calls. A pass that replaces ops (a loop rolled into one scan, a
library's scan recognized) or reorders them (every rewrite ends in a topological sort) can move an op of the block
past the closing call, where it runs with grad: a teacher's output, a pseudo-target or a no-grad reference then
carries a gradient eager never computes (a distillation step updating the teacher).

So, first of all, each value the block hands to an op outside it (or returns) passes through ``detach()``::

    before:  set_grad_enabled(False); t = model(x_weak); set_grad_enabled(True); loss = f(model(x), t)
    after:   set_grad_enabled(False); t = model(x_weak); t_d = t.detach(); set_grad_enabled(True); loss = f(..., t_d)

The same values, and a constant for autograd wherever the block's ops end up. The same holds for what a block
writes in place: ``with torch.no_grad(): self.h.copy_(hs[:, -1])`` (a streaming model keeping its last state) must
leave the buffer without a graph, also where the ``hs[:, -1]`` and the ``copy_`` end up after the closing call (the
loop making ``hs`` rolled into one scan placed later). So each value with grad that an op of the block reads from
outside it is read through a ``detach()`` as well, except the tensor an in-place op writes into (a parameter updated
in place under ``no_grad``, as an EMA does, must stay that parameter)::

    before:  set_grad_enabled(False); last = hs[:, -1]; h.copy_(last); set_grad_enabled(True)
    after:   hs_d = hs.detach(); set_grad_enabled(False); last = hs_d[:, -1]; h.copy_(last); set_grad_enabled(True)

Autocast blocks change dtypes, not differentiability: moving an op across one is refused where it would happen (the
sharded lowering's check).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ...analysis.fx import example_value, is_inplace
from ...analysis.modes import entry_grad_mode, mode_states
from .noop_ops import rewritten

log = logging.getLogger(__name__)

__all__ = ["detach_no_grad_outputs"]

PROVENANCE = "adjoint_compile: detach at the end of a no_grad block"


def detach_no_grad_outputs(gm: fx.GraphModule) -> int:
    """Route every use outside a no-grad (or inference-mode) block of a tensor made inside it, and every use inside
    one of a tensor with grad made outside it, through a ``detach()`` (module docstring); returns how many values
    were detached."""
    if not entry_grad_mode(gm.graph):  # NB: the whole graph runs without grad: nothing it computes is differentiable
        return 0
    states = mode_states(gm.graph)

    def no_grad(st: tuple[bool, tuple[str, ...]] | None) -> bool:
        return st is not None and (not st[0] or "torch.inference_mode" in st[1])

    done = 0
    for n in list(gm.graph.nodes):
        v = example_value(n)
        if not isinstance(v, torch.Tensor):
            continue
        if no_grad(states.get(n)):
            uses = [u for u in n.users if not no_grad(states.get(u)) and u.target is not torch._C._set_grad_enabled]
        elif v.requires_grad:  # read by the block's ops (not where one writes into it)
            uses = [u for u in n.users if no_grad(states.get(u)) and not (is_inplace(u) and u.args and u.args[0] is n)]
        else:
            continue
        if uses:
            _detach_for(gm, n, uses)
            done += 1
    return rewritten(gm, done, log, "capture: %d value(s) entering or leaving no_grad blocks detached")


def _detach_for(gm: fx.GraphModule, n: fx.Node, uses: list[fx.Node]) -> None:
    with gm.graph.inserting_after(n):
        d = gm.graph.call_method("detach", (n,))
    d.meta = {k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")}
    for k in ("example_value", "val"):  # NB: detached: what it hands on requires no grad (analysis/modes.py reads it)
        if isinstance(v := n.meta.get(k), torch.Tensor):
            d.meta[k] = v.detach()
    d.meta["provenance"] = PROVENANCE
    for u in uses:
        u.replace_input_with(n, d)
