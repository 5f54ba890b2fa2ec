"""The independent oracle of the Highway-BP tests (issue 12): the path count, written without the runtime.

With k iterations the gradient is the sum over all backward paths through at most k Jacobians of the blocks g.
Run the chain k + 1 times; level m feeds each g with the states of level m - 1 (level -1: the forward states,
detached) and each r with its own previous state; the loss reads level k.  A path from the loss drops one level at
every g it goes through, so it meets at most k of them, and the parameter gradients summed over the levels are
exactly those paths.
"""
from __future__ import annotations

import torch


def levels_oracle(g, r, h0, xs, k):
    """States of level k of the chain h_t = r(h_{t-1}, g(h_{t-1}, x_t)) (module docstring)."""
    with torch.no_grad():
        prev = [h0]
        for t in range(len(xs)):
            prev.append(r(prev[-1], g(prev[-1], xs[t])))
    prev = [p.detach() for p in prev]  # level -1
    for _ in range(k + 1):
        cur = [h0]
        for t in range(len(xs)):
            cur.append(r(cur[-1], g(prev[t], xs[t])))
        prev = cur
    return torch.stack(prev[1:])


def chain_levels(layers, x0, k):
    """The same for a chain of different layers: ``layers[i] = (g_i, r_i)``, x_i = r_i(x_{i-1}, g_i(x_{i-1}));
    returns the level-k states x_1..x_L (a list)."""
    with torch.no_grad():
        prev = [x0]
        for g, r in layers:
            prev.append(r(prev[-1], g(prev[-1])))
    prev = [p.detach() for p in prev]
    for _ in range(k + 1):
        cur = [x0]
        for i, (g, r) in enumerate(layers):
            cur.append(r(cur[-1], g(prev[i])))
        prev = cur
    return prev[1:]
