"""A causal conv with per-example weights, for a sharded region's program made per example
(runtime/per_example_program.py).

With its weight (and bias) made B copies, one per example, ``conv1d(x, W, b, groups=g)`` on x [B, C_in, L] is one
conv of the examples side by side as channels: x viewed as [1, B·C_in, L], the copies as [B·C_out, C_in / g, k],
``groups = B·g``; each example's channels meet only its own copy. The gradient of the copies is then each example's
gradient of W.

    before:  y = conv1d(x, W, b, stride, 0, dilation, g)            x: [B, C_in, L], W: [C_out, C_in / g, k]
    after:   y = example_conv(x, W + z, b + z_b, stride, 0, dilation, g)      z: [B, C_out, C_in / g, k], zeros
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..analysis.time_local import conv_args

__all__ = ["example_conv", "conv_with_copies"]


def example_conv(x: Tensor, w: Tensor, b: Tensor | None, stride: Any, padding: Any, dilation: Any,
                 groups: int) -> Tensor:
    """``conv1d`` of each example n of x [B, C_in, L] with its own weight w[n] [C_out, C_in / groups, k] and bias
    b[n] [C_out] (or None): [B, C_out, L']."""
    B = x.shape[0]
    y = torch.conv1d(x.reshape(1, -1, x.shape[-1]), w.reshape(-1, *w.shape[2:]), None if b is None else b.reshape(-1),
                     stride, padding, dilation, groups * B)
    return y.view(B, -1, y.shape[-1])


def conv_with_copies(g: fx.Graph, u: fx.Node, chain: set[fx.Node], B: int, axis: Any) -> str | None:
    """Rewrite ``u``, a conv1d whose weight is a parameter value made per example (in ``chain``), into
    :func:`example_conv`; returns why it cannot ("" when ``u`` is no such conv: left to the caller), or None when
    done."""
    a = conv_args(u)
    if a is None or a["weight"] not in chain:
        return "" if a is None or a["bias"] not in chain else f"{u.name}: a conv whose bias alone is per example"
    x, w, b = a["input"], a["weight"], a["bias"]
    # NB: wv: the parameter value's own shape (its copies are [B, *wv.shape] when the program runs)
    xv, wv = (n.meta.get("val", n.meta.get("example_value")) for n in (x, w))
    if x in chain or not isinstance(xv, Tensor) or xv.dim() != 3 or axis(x) != 0 or int(xv.shape[0]) != B:
        return f"{u.name}: a conv of a value without the examples on axis 0 of [B, C, L]"
    if not isinstance(wv, Tensor) or wv.dim() != 3 or (b is not None and b not in chain) or \
            isinstance(a["padding"], str):
        return f"{u.name}: a conv with arguments it cannot make per example"
    with g.inserting_before(u):
        y = g.call_function(example_conv, (x, w, b, a["stride"], a["padding"], a["dilation"], a["groups"]))
    y.meta = dict(u.meta)
    axis.same(y, u)
    u.replace_all_uses_with(y)
    g.erase_node(u)
    return None
