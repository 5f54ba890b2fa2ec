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

The same values, and a constant for autograd wherever the block's ops end up. Autocast blocks change dtypes, not
differentiability: moving an op across one is refused where it would happen (the sharded lowering's check).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ...analysis.fx import entry_grad_mode, example_value, mode_states
from .noop_ops import rewritten

log = logging.getLogger(__name__)

__all__ = ["detach_no_grad_outputs"]

PROVENANCE = "adjoint_compile: detach at the end of a no_grad block"


def detach_no_grad_outputs(gm: fx.GraphModule) -> int:
    """Route every use outside a no-grad (or inference-mode) block of a tensor made inside it through a
    ``detach()`` (module docstring); returns how many values were detached."""
    if not entry_grad_mode(gm.graph):  # NB: the whole graph runs without grad: nothing it computes is differentiable
        return 0
    states = mode_states(gm.graph)

    def no_grad(st: tuple[bool, tuple[str, ...]] | None) -> bool:
        return st is not None and (not st[0] or "torch.inference_mode" in st[1])

    done = 0
    for n in list(gm.graph.nodes):
        st = states.get(n)
        if not no_grad(st) or not isinstance(example_value(n), torch.Tensor):
            continue
        outside = [u for u in n.users if not no_grad(states.get(u)) and u.target is not torch._C._set_grad_enabled]
        if not outside:
            continue
        with gm.graph.inserting_after(n):
            d = gm.graph.call_method("detach", (n,))
        d.meta = {k: v for k, v in n.meta.items() if k in ("example_value", "val", "stack_trace", "nn_module_stack")}
        d.meta["provenance"] = PROVENANCE
        for u in outside:
            u.replace_input_with(n, d)
        done += 1
    return rewritten(gm, done, log, "capture: %d value(s) leaving no_grad blocks detached")
