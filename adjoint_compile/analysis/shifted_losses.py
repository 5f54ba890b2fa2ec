"""The shift of a language-model loss written on the logits, rewritten so that the loss joins a region.

A loss of step t's logits against token t+1 is often written by dropping the last step of the logits and the first of
the labels (transformers before 4.46, many training scripts)::

    shift_logits = logits[..., :-1, :].contiguous()         # [B, T-1, V]: not T steps, ends the region
    shift_labels = labels[..., 1:].contiguous()
    loss = F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))

and a head that predicts k tokens ahead (multi-token prediction, Medusa's heads) drops k: ``logits[:, :-k]`` against
``labels[:, k:]``; a prompt of a steps may be dropped too, ``logits[:, a:-k]`` against ``labels[:, a+k:]``. A sum or a
mean over class-index targets is the same with the logits whole and the labels padded with ignored targets, a at the
start and k at the end (transformers' ``ForCausalLMLoss`` writes it that way for a = 0, k = 1): those steps add
nothing to the sum nor to the count of valid targets. :func:`unshift_losses` rewrites the first form to the second::

    shift_labels = F.pad(labels[..., a + k:], (a, k), value=ignore_index).contiguous()
    loss = F.cross_entropy(logits.contiguous().view(-1, V), shift_labels.view(-1))

The ops between the slices and the loss must be views, casts and transposes read by the time-local analysis (each
used once); their literal sizes of the T-a-k steps (fold·(T-a-k)) become T (fold·T). Anything else is left as it is.
"""
from __future__ import annotations

import logging
import operator
import types
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import UnsupportedRegion
from ..regions import PROVENANCE
from .fx import example_value, nodes_in, refresh_example_values
from .losses import loss_args
from .optable import RESHAPES, SAME_SHAPE, TRANSPOSES, raw_name
from .rules import TimeLocalInfo, step_shape
from .step_literals import rewrite_lengths
from .time_local import analyze, slice_items

log = logging.getLogger(__name__)

__all__ = ["unshift_losses"]

_CHAIN_OPS = RESHAPES | SAME_SHAPE | TRANSPOSES | {"permute"}


def _chain(end: fx.Node, stop: Any) -> tuple[list[fx.Node], fx.Node] | None:
    """The unary ops from a node where ``stop(node)`` holds down to ``end`` (each read once, by the next), in order,
    and that node; None when something else comes first."""
    chain, n = [], end
    while not stop(n):
        if (n.op not in ("call_method", "call_function") or raw_name(n) not in _CHAIN_OPS or len(n.users) > 1
                or not n.args or not isinstance(n.args[0], fx.Node) or nodes_in((n.args[1:], n.kwargs))):
            return None
        chain.append(n)
        n = n.args[0]
    return chain[::-1], n


def _cut(n: fx.Node, T: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) when ``n`` is ``y[..., start:stop, ...]`` of a y with T steps at dim (a step 1 slice there,
    full slices elsewhere), start and stop in [0, T]."""
    items = slice_items(n)
    if items is None:
        return None
    cut = [j for j, i in enumerate(items) if i.start not in (None, 0) or i.stop is not None or i.step not in (None, 1)]
    if len(cut) != 1 or items[cut[0]].step not in (None, 1) or step_shape(n.args[0])[cut[0]] != T or not all(
            isinstance(b, int) or b is None for b in (items[cut[0]].start, items[cut[0]].stop)):
        return None
    start, stop, _ = items[cut[0]].indices(T)
    return cut[0], start, stop


def _label_cut(n: fx.Node, T: int) -> tuple[int, int] | None:
    """(dim e, j) when ``n`` is ``y[..., j:, ...]`` (j ≥ 1 at dim e) of a y with T steps there."""
    c = _cut(n, T)
    return (c[0], c[1]) if c is not None and c[1] >= 1 and c[2] == T else None


def _logit_cut(n: fx.Node, d: int, T: int) -> tuple[int, int] | None:
    """(a, k) when ``n`` is ``x[..., a:T-k, ...]`` at dim d (``:-k``, ``a:``, ``a:-k``; a, k ≥ 0, not both 0) of an
    x with T steps there."""
    c = _cut(n, T)
    return (c[1], T - c[2]) if c is not None and c[0] == d and 0 < c[1] + T - c[2] < T else None


def _one(gm: fx.GraphModule, loss: fx.Node, info: TimeLocalInfo) -> bool:
    a = loss_args(loss)
    T = info.length
    if a is None or a["reduction"] == "none" or not isinstance(a["ignore_index"], int) or not isinstance(T, int):
        return False
    xs = _chain(a["input"], lambda n: n.op == "call_function" and n.target is operator.getitem and isinstance(
        n.args[0], fx.Node) and info.step_dim.get(n.args[0]) is not None and _logit_cut(
        n, info.step_dim[n.args[0]], T) is not None)
    ts = _chain(a["target"], lambda n: n.op == "call_function" and n.target is operator.getitem and isinstance(
        n.args[0], fx.Node) and step_shape(n.args[0]) is not None and _label_cut(n, T) is not None)
    if xs is None or ts is None or len(xs[1].users) != 1 or not info.is_time_local(xs[1].args[0]):
        return False
    (x_chain, s), (t_chain, r) = xs, ts
    h, d = s.args[0], info.step_dim[s.args[0]]
    (e, j), (first, k) = _label_cut(r, T), _logit_cut(s, d, T)
    if j != first + k:
        return False  # NB: logits of steps [a, T - k) against the labels of [a + k, T): step t against t + k
    if len(step_shape(a["target"])) == len(step_shape(a["input"])):
        return False  # class probabilities: the padded rows would not be ignored
    # NB: where the step axis runs through the chains, read with the T-a-k steps of the slices
    short = analyze(gm, {s: d, r: e}, halo=True)
    if loss not in short.sums:
        return False
    new_args = {}
    try:
        for c in x_chain + t_chain:
            rewrite_lengths(short, T - first - k, c, (out := types.SimpleNamespace(args=c.args)), T)
            new_args[c] = out.args
    except UnsupportedRegion:  # NB: a literal that is not the steps': nothing is rewritten
        return False
    for c, args in new_args.items():
        c.args = args
    g, prov = gm.graph, {"pass": "unshift_losses", "from": loss.name}
    nd = len(step_shape(r))
    with g.inserting_after(r):
        pad = g.call_function(F.pad, (r, [0, 0] * (nd - 1 - e) + [first, k]), {"value": a["ignore_index"]})
    pad.meta[PROVENANCE] = prov
    (t_chain[0] if t_chain else loss).replace_input_with(r, pad)
    (x_chain[0] if x_chain else loss).replace_input_with(s, h)
    g.erase_node(s)
    refresh_example_values([pad, *x_chain, *t_chain])
    for c in x_chain + t_chain:
        c.meta[PROVENANCE] = {**c.meta.get(PROVENANCE, {}), **prov}
    return True


def unshift_losses(gm: fx.GraphModule, info: TimeLocalInfo) -> int:
    """Rewrite every loss of time-local logits without some first and last steps against labels cut to the same steps
    k ahead (module docstring) to the logits whole and the labels padded with ignored targets; returns how many."""
    done = sum(_one(gm, n, info) for n in list(gm.graph.nodes) if loss_args(n) is not None)
    if done:
        gm.graph.lint()
        gm.recompile()
        log.debug("adjoint-compile: %d loss(es) of shifted logits rewritten to padded labels", done)
    return done
