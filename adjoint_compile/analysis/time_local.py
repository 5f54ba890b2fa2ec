"""Step-dim propagation over a dynamo FX graph: which nodes act on each step on its own (DESIGN.md §3,
"Regions along time").

Given seeds ``{node: step_dim}`` (sequence inputs ``[B, T, D]`` with step dim 1, ``linear_scan`` nodes with their
``dim``), :func:`analyze` walks the graph once in topological order and, for every node, records

* ``step_dim[n]``: the dim of ``n``'s output that is the step (time) axis of length T, or ``None`` when the output
  does not carry it as a dim of its own; with ``halo``, a dim of fold·T that holds the batch folded in front of the
  steps (``[B, T, V] -> [B·T, V]``, ``info.folds[n]`` = B) carries it too;
* ``mixing[n]``: why ``n`` mixes steps (a convolution along time, a sum over time, attention, slicing along time,
  a reshape that merges the step dim with another otherwise, an unknown op, ...).

A node is *time-local* when it carries the step axis and does not mix (output step t depends only on input step t
of every step-carrying input, and on step-free tensors); *step-free* when none of its inputs carries the step axis
(parameter math); *step-mixing* otherwise.  A mixing node still reports the dim of its output's step axis when it
keeps one of full length (e.g. a causal conv along time), so that the ops after it can be classified.

Every rule checks shapes (``node.meta["example_value"]``): an operand that is not tracked along the step axis but
has full length there (e.g. a ``[T, D]`` positional table added to ``[B, T, D]``) makes the op mixing, because a
shard could not take its slice.  Unknown ops are mixing with reason ``"unknown op X"``: the analysis never guesses.

:func:`~.grow.region_around` then grows the maximal connected set of time-local nodes around some scans and
reports the mixing nodes that bound it.  Both are linear in the size of the graph (times the arity of its nodes).

The rules are in :mod:`.rules` (ops that compute) and :mod:`.layout_rules` (ops that move data), keyed here by the
op names of :mod:`.optable`.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import layout_rules as lr
from . import optable as ops
from .losses import loss_sum, row_loss
from . import rules as r
from .fx import example_value, is_linear_scan, nodes_in, registers_hook
from .modes import changed_modes
from ..kernels.shift import shift_steps
from .rules import CausalConv, Ctx, Rule, Shift, TimeLocalInfo, TimeSum, dims_arg, norm_dim, op_label, step_shape

log = logging.getLogger(__name__)

__all__ = ["TimeLocalInfo", "Shift", "CausalConv", "TimeSum", "analyze", "causal_conv", "conv_args", "embedding_ids",
           "padded_causal_conv", "drops_last_step", "shift_of", "cat_pair", "rule_for", "slice_items"]

# --------------------------------------------------------------------------------------------------------------
# rule table: op name (optable) -> rule

RULES: dict[str, Rule] = {}


def _by_name(names: Any, rule: Rule) -> None:
    for name in sorted(names):
        RULES.setdefault(name, rule)


_by_name(ops.POINTWISE, r.pointwise)
_by_name(ops.SAME_SHAPE, r.same_shape)
_by_name(ops.METADATA, r.metadata)
_by_name(ops.NEW_FACTORIES, r.new_factory)
_by_name(ops.RANDOM, r.random_draw)
_by_name(ops.DROPOUT, r.dropout)
_by_name(["linear"], r.linear)
_by_name(ops.MATMULS, r.matmul)
_by_name(["einsum"], r.einsum)
_by_name(ops.REDUCTIONS, r.reduction(1, 2))
_by_name(["norm", "vector_norm"], r.reduction(2, 3))  # torch.norm(input, p, dim, keepdim)
_by_name(ops.ALONG_DIM, r.along_dim(1))
_by_name(["normalize"], r.along_dim(2, default=1))  # F.normalize(input, p=2.0, dim=1)
_by_name(["flip"], r.along_dim(1, "dims"))
_by_name(["roll"], r.along_dim(2, "dims"))
_by_name(["topk"], r.along_dim(2, default=-1))
_by_name(ops.NORM_LAYERS, r.norm_layer)
_by_name(ops.RESHAPES, lr.view)
_by_name(ops.EXPANDS, lr.expand)
_by_name(["permute"], lr.permute)
_by_name(ops.TRANSPOSES, lr.transpose)
_by_name(ops.MOVEDIMS, lr.movedim)
_by_name(["unsqueeze"], lr.unsqueeze)
_by_name(["squeeze"], lr.squeeze)
_by_name(["getitem"], lr.getitem)
_by_name(["select"], lr.split_like(1, None, drop=True))
_by_name(["narrow"], lr.split_like(1, None))
_by_name(["index_select"], lr.index_select)
_by_name(["gather"], lr.gather)
_by_name(ops.SPLITS, lr.split_like(2))
_by_name(["unbind"], lr.split_like(1, drop=True))
_by_name(ops.CATS, lr.cat(False))
_by_name(["stack"], lr.cat(True))
_by_name(ops.CONVS, r.conv)
_by_name(ops.REPEATS, r.repeat_interleave)
_by_name(ops.COMPLEX_VIEWS, lr.complex_view)
_by_name(["pad"], r.pad)
_by_name(["shift_steps"], r.shift)
_by_name(ops.LOSS_OPS, row_loss)
# NB: hashed_dropout's mask is a function of (seed, position): a shard's recomputation makes the same one
_by_name(["hashed_dropout"], r.same_shape)
assert set(RULES) <= ops.KNOWN, sorted(set(RULES) - ops.KNOWN)  # NB: a name the table lacks would match nothing


def rule_for(node: fx.Node) -> Rule | None:
    """The step-dim rule of a node's op; None for an op without one (the analysis never guesses)."""
    if node.op == "call_method":
        return RULES.get(node.target)
    if node.op == "call_function":
        if is_linear_scan(node):
            return r.scan
        if isinstance(node.target, torch._ops.HigherOrderOperator) and node.target.name() == "autograd_function_apply":
            return r.custom_function
        if node.target is getattr and len(node.args) == 2 and node.args[1] in ops.COMPLEX_PARTS:
            return r.same_shape  # x.real, x.imag: elementwise views of the same shape
        name = ops.spelling(node.target)
        if name is not None:
            return RULES.get(name)
        if isinstance(node.target, torch._ops.OpOverload):
            # NB: aten overloads only as pointwise ops: the other rules read torch-level signatures
            name = node.target.overloadpacket.__name__
            if name in ops.POINTWISE:
                return r.pointwise
    return None


# --------------------------------------------------------------------------------------------------------------
# public API


def _length_of_seeds(seeds: dict[fx.Node, int]) -> int | None:
    lengths = {}
    for n, d in seeds.items():
        if not isinstance(n, fx.Node):
            raise ValueError(f"seeds: keys must be fx.Node, got {type(n).__name__}")
        s = step_shape(n)
        if s is None:
            raise ValueError(f"seeds: node {n.name} has no tensor example_value to read the step length from")
        if not isinstance(d, int) or not -len(s) <= d < len(s):
            raise ValueError(f"seeds: step dim {d!r} of node {n.name} is not a dim of its shape {list(s)}")
        lengths[n.name] = s[d]
    if len(set(lengths.values())) > 1:
        raise ValueError(f"seeds: the seeds disagree on the number of steps: {lengths}")
    return next(iter(lengths.values()), None)


def slice_items(sliced: fx.Node) -> list[slice] | None:
    """The index of ``sliced = x[idx]`` as one slice per dim of x (Ellipsis and trailing dims filled in), or None
    when ``sliced`` is not such a getitem of plain slices."""
    if not (sliced.op == "call_function" and sliced.target is operator.getitem and len(sliced.args) == 2):
        return None
    x, idx = sliced.args
    s = step_shape(x)
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if s is None or any(not isinstance(i, slice) and i is not Ellipsis for i in items) or items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (len(s) - len(items) + 1) + items[k + 1:]
    items += [slice(None)] * (len(s) - len(items))
    return items if len(items) == len(s) else None


def drops_last_step(sliced: fx.Node, d: int) -> bool:
    """``sliced`` is ``x[..., :-1, ...]`` with the ``:-1`` at dim d and full slices elsewhere."""
    items = slice_items(sliced)
    if items is None:
        return False
    for j, i in enumerate(items):
        want_stop = -1 if j == d else None
        if i.start not in (None, 0) or i.step not in (None, 1) or i.stop != want_stop:
            return False
    return True


_CONV1D = (torch.conv1d, torch.nn.functional.conv1d)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _one(v: Any) -> Any:
    return v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v


def conv_args(node: fx.Node) -> dict[str, Any] | None:
    """A conv1d call's arguments by name (defaults filled in), or None for another node."""
    if not (node.op == "call_function" and node.target in _CONV1D):
        return None
    out = dict(_CONV_DEFAULTS)
    out.update(zip(_CONV_ARGS, node.args))
    out.update(node.kwargs)
    return out


def _keeps_first(sliced: fx.Node, length: int, dim: int) -> bool:
    """``sliced`` is ``x[..., :length]`` (or ``:-p``) along ``dim`` (the last), full slices elsewhere."""
    items = slice_items(sliced)
    if items is None:
        return False
    s = step_shape(sliced.args[0])
    for j, i in enumerate(items):
        if i.start not in (None, 0) or i.step not in (None, 1):
            return False
        stop = None if i.stop is None else (i.stop if i.stop >= 0 else s[j] + i.stop)
        if j == dim % len(s) and stop != length:
            return False
        if j != dim % len(s) and stop not in (None, s[j]) and not (i.stop is None):
            return False
    return True


def causal_conv(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the slice after it, halo p) when ``node`` is a causal conv1d along its input's last dim:
    ``conv1d(x, w, b, stride=1, padding=p, dilation)[..., :T]`` with p = dilation·(k-1) > 0."""
    a = conv_args(node)
    if a is None or not isinstance(a["input"], fx.Node) or len(node.users) != 1:
        return None
    xs, ws = step_shape(a["input"]), step_shape(a["weight"]) if isinstance(a["weight"], fx.Node) else None
    stride, pad, dil = _one(a["stride"]), _one(a["padding"]), _one(a["dilation"])
    if xs is None or ws is None or len(ws) != 3 or not all(isinstance(v, int) for v in (stride, pad, dil)):
        return None
    p = dil * (ws[-1] - 1)
    if stride != 1 or pad != p or p <= 0:
        return None
    (user,) = node.users
    return (user, p) if _keeps_first(user, xs[-1], -1) else None


def _left_pad(node: fx.Node) -> int | None:
    """p when ``node`` is ``F.pad(x, (p, 0))`` with zeros (p > 0) along x's last dim only."""
    if not (node.op == "call_function" and node.target in (F.pad, torch._C._nn.pad)):
        return None
    names = ("input", "pad", "mode", "value")
    a = {**dict(zip(names, node.args)), **node.kwargs}
    pad = a.get("pad")
    if (not isinstance(a.get("input"), fx.Node) or a.get("mode", "constant") != "constant"
            or a.get("value") not in (None, 0, 0.0) or not isinstance(pad, (list, tuple)) or len(pad) != 2
            or not all(isinstance(v, int) for v in pad) or pad[1] != 0 or pad[0] <= 0):
        return None
    return pad[0]


def padded_causal_conv(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the pad before it, halo p) when ``node`` is ``conv1d(F.pad(x, (p, 0)), w, b, stride=1, padding=0,
    dilation)`` with p = dilation·(k-1) > 0: a causal conv along x's last dim written with an explicit pad."""
    a = conv_args(node)
    if a is None or not isinstance(a["input"], fx.Node) or len(a["input"].users) != 1:
        return None
    ws = step_shape(a["weight"]) if isinstance(a["weight"], fx.Node) else None
    stride, pad, dil = _one(a["stride"]), _one(a["padding"]), _one(a["dilation"])
    p = _left_pad(a["input"])
    if p is None or ws is None or len(ws) != 3 or stride != 1 or pad != 0 or not isinstance(dil, int):
        return None
    return (a["input"], p) if p == dil * (ws[-1] - 1) else None


def _conv_in_region(node: fx.Node, info: TimeLocalInfo) -> CausalConv | None:
    """``node`` as a causal conv whose input carries the step axis at its last dim and whose weight and bias are
    step-free: a shard computes it from its own steps and the p steps before it (the halo)."""
    a = conv_args(node)
    if (m := causal_conv(node)) is not None:
        (sliced, p), pad, x = m, None, a["input"]
    elif (m := padded_causal_conv(node)) is not None:
        (pad, p), sliced = m, node
        x = pad.args[0] if pad.args else pad.kwargs["input"]
    else:
        return None
    s = step_shape(x)
    d = info.step_dim.get(x)
    if (d is None or d != len(s) - 1 or x in info.mixing or info.step_dim.get(a["weight"]) is not None
            or (isinstance(a["bias"], fx.Node) and info.step_dim.get(a["bias"]) is not None)
            or (info.length is not None and step_shape(sliced)[d] != info.length)):
        return None
    return CausalConv(conv=node, sliced=None if pad is not None else sliced, input=x, halo=p, dim=d, pad=pad)


def embedding_ids(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(ids, weight) of ``F.embedding(ids, weight)`` when each output row depends on its own index alone (no
    ``max_norm``, which renormalizes rows of the weight in place, no ``scale_grad_by_freq``, whose counts are over
    the whole batch, no sparse gradient), or None."""
    if node.op != "call_function":
        return None
    if node.target is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    elif node.target is torch.embedding:
        names = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")
    else:
        return None
    a = {**dict(zip(names, node.args)), **node.kwargs}
    ids, w = a.get("input"), a.get("weight")
    if (not isinstance(ids, fx.Node) or not isinstance(w, fx.Node) or a.get("max_norm") is not None
            or a.get("scale_grad_by_freq") or a.get("sparse")):
        return None
    return ids, w


def _embedding_in_region(node: fx.Node, info: TimeLocalInfo) -> int | None:
    """The step dim of ``F.embedding(ids, weight)`` whose ids carry the step axis and whose weight is step-free: a
    shard looks up its own steps' rows."""
    m = embedding_ids(node)
    # NB: ids that mix steps themselves (a slice of a longer input) still carry the axis: the region reads them
    if m is None or info.step_dim.get(m[0]) is None or info.step_dim.get(m[1]) is not None or m[1] in info.mixing:
        return None
    if m[0] in info.folds:  # NB: ids with the batch folded into their step dim give rows folded alike
        info.folds[node] = info.folds[m[0]]
    return info.step_dim[m[0]]


def _time_sum(node: fx.Node, info: TimeLocalInfo) -> TimeSum | None:
    """``node`` as a sum or mean over dims that include the step dim of a time-local value, or None."""
    if node.op not in ("call_function", "call_method") or op_label(node) not in ("sum", "mean"):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node) or node.kwargs.keys() - {"dim", "keepdim", "dtype"}:
        return None
    x = node.args[0]
    s, d = step_shape(x), info.step_dim.get(x)
    if s is None or d is None or x in info.mixing or len(node.args) > 3:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = dims_arg(dim, len(s))
    if dims == [] or (dims is not None and d not in dims):
        return None
    return TimeSum(node=node, input=x, dim=d, mean=op_label(node) == "mean")


def shift_of(node: fx.Node) -> tuple[fx.Node, int, int, float] | None:
    """(x, p, dim, fill) when ``node`` is ``shift_steps(x, p, dim, fill)`` (a token shift), else None."""
    if not (node.op == "call_function" and node.target is shift_steps):
        return None
    a = {**dict(zip(("x", "p", "dim", "value"), node.args)), **node.kwargs}
    x, p, dim, v = a.get("x"), a.get("p"), a.get("dim"), a.get("value", 0.0)
    s = step_shape(x) if isinstance(x, fx.Node) else None
    if s is None or not isinstance(p, int) or p < 1 or not isinstance(dim, int) or not isinstance(v, (int, float)):
        return None
    return x, p, norm_dim(dim, len(s)), float(v)


def _token_shift_in_region(node: fx.Node, info: TimeLocalInfo) -> CausalConv | None:
    """``node`` as a token shift along the step dim of a time-local value: a shard computes it from its own steps
    and the p steps before it (the halo)."""
    m = shift_of(node)
    if m is None:
        return None
    x, p, dim, fill = m
    d = info.step_dim.get(x)
    if d is None or d != dim or x in info.mixing or x in info.folds:
        return None
    return CausalConv(conv=node, sliced=None, input=x, halo=p, dim=d, kind="shift", fill=fill)


def _shift_slice_dim(node: fx.Node, info: TimeLocalInfo) -> int | None:
    """The step dim when ``node`` drops the last step of a scan output and its only user may be a shift's cat."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args
            and isinstance(node.args[0], fx.Node) and is_linear_scan(node.args[0])):
        return None
    d = info.step_dim.get(node.args[0])
    if d is None or len(node.users) != 1 or not drops_last_step(node, d):
        return None
    (user,) = node.users
    return d if op_label(user) in ("cat", "concat", "concatenate") else None


def cat_pair(node: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(first, second, dim) when ``node`` is ``cat([first, second], dim)`` of two nodes with a literal dim."""
    if op_label(node) not in ("cat", "concat", "concatenate") or node.kwargs.keys() - {"dim"}:
        return None
    tensors = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not isinstance(dim, int):
        return None
    first, second = tensors
    return (first, second, dim) if isinstance(first, fx.Node) and isinstance(second, fx.Node) else None


def _shift_of(node: fx.Node, info: TimeLocalInfo) -> Shift | None:
    """``node`` as a previous-state readout ``cat([first, h[..., :-1]], d)`` (see :class:`Shift`), or None."""
    m = cat_pair(node)
    if m is None:
        return None
    first, sliced, dim = m
    d = info.step_dim.get(sliced)
    if d is None or _shift_slice_dim(sliced, info) != d or norm_dim(dim, len(step_shape(node) or ())) != d:
        return None
    fs, hs = step_shape(first), step_shape(sliced.args[0])
    if (info.step_dim.get(first) is not None or first in info.mixing or fs is None or hs is None
            or len(fs) != len(hs) or fs[d] != 1 or any(a != b for j, (a, b) in enumerate(zip(fs, hs)) if j != d)):
        return None
    return Shift(first=first, sliced=sliced, scan=sliced.args[0], dim=d)


class _PendingSlices:
    """Membership test for slices tentatively kept local by :func:`_shift_slice_dim` and not yet confirmed."""

    def __init__(self, info: TimeLocalInfo) -> None:
        self.info = info

    def __contains__(self, node: fx.Node) -> bool:
        return (node in self.info.step_dim and self.info.step_dim[node] is not None and node not in self.info.mixing
                and node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], fx.Node) and is_linear_scan(node.args[0])
                and not any(sh.sliced is node for sh in self.info.shifts.values()))


def analyze(gm: fx.GraphModule, seeds: dict[fx.Node, int], halo: bool = False, folds: bool = True,
            ends: bool | None = None) -> TimeLocalInfo:
    """Propagate the step axis through ``gm`` from ``seeds`` (``{node: step dim}``); classify every node.

    Seeded placeholders are sources; a seeded op (e.g. a linear_scan) takes the seed's dim as its output step dim and
    is classified by its own rule (a scan whose a/b do not carry the step axis there is mixing).  With ``halo``, a
    causal conv along time (:func:`causal_conv`) on a time-local input is time-local too, and so is the slice after
    it (recorded in ``info.convs``): a shard reads the p steps before it from its left neighbour; so is a token shift
    ``shift_steps(x, p, step dim)`` of a time-local x (recorded there too, ``kind="shift"``); an embedding lookup of
    step-carrying indices is time-local; a sum or mean over the step dim of a time-local value is recorded in
    ``info.sums`` (a region may end in it), and so is a loss's sum or mean over rows (:mod:`.losses`); with ``folds``
    too, a reshape that merges the batch in front of the steps keeps the step axis (``info.folds``).  Linear in the
    size of the graph.  ``ends`` (default: ``halo``) turns the embeddings, sums and folds on or off apart from the
    convs and shifts (a truncated sweep takes a region's loss but carries no halos).  Raises ValueError when the seeds
    are not nodes of tensors or disagree on the number of steps.
    """
    T = _length_of_seeds(seeds)
    ends = halo if ends is None else ends
    info = TimeLocalInfo(step_dim={}, mixing={}, length=T, fold_ok=ends and folds)
    pending_slices = _PendingSlices(info)
    for node in gm.graph.nodes:
        seed = seeds.get(node)
        if seed is not None:
            seed = norm_dim(seed, len(step_shape(node)))
        if node.op in ("placeholder", "get_attr", "output"):
            info.step_dim[node] = seed if node.op != "output" else None
            continue
        if (d := _shift_slice_dim(node, info)) is not None:
            # NB: tentatively local (T-1 steps); confirmed by its one user, the shift's cat, or marked mixing there
            info.step_dim[node] = d
            continue
        if (shift := _shift_of(node, info)) is not None:
            info.step_dim[node] = shift.dim
            info.shifts[node] = shift
            continue
        for a in nodes_in((node.args, node.kwargs)):
            if a in pending_slices and node not in info.shifts:
                info.step_dim[a] = None
                info.mixing[a] = "slicing along the step dim (not part of a previous-state readout)"
        if halo and node.op == "call_function" and _left_pad(node) is not None and len(node.users) == 1 and (
                padded_causal_conv(next(iter(node.users))) is not None):
            # NB: tentatively local (T + p steps); the conv after it, when it joins, cuts it back to T
            info.step_dim[node] = info.step_dim.get(node.args[0] if node.args else node.kwargs.get("input"))
            continue
        if halo and (cc := (_conv_in_region(node, info) or _token_shift_in_region(node, info))) is not None:
            info.step_dim[node] = cc.dim
            info.convs[node] = cc
            continue
        if halo and (m := padded_causal_conv(node)) is not None and m[0] not in info.mixing:
            info.step_dim[m[0]] = None  # NB: the tentatively local pad before a conv that does not join
            info.mixing[m[0]] = "pad along the step dim (before a conv that cannot join a region)"
        if ends and (ts := (_time_sum(node, info) or loss_sum(node, info))) is not None:
            # NB: no step axis and not mixing: a region may end in it (analysis/grow.py), summing its shards' sums
            info.step_dim[node] = None
            info.sums[node] = ts
            continue
        if ends and (d := _embedding_in_region(node, info)) is not None:
            info.step_dim[node] = d
            continue
        if (node.op == "call_function" and node.target is operator.getitem and node.args
                and node.args[0] in info.convs and info.convs[node.args[0]].sliced is node):
            info.step_dim[node] = info.convs[node.args[0]].dim
            continue
        inputs = nodes_in((node.args, node.kwargs))
        if not any(info.step_dim.get(a) is not None for a in inputs) and seed is None:
            # step-free: parameter math and constants, whatever the op; but a step-free value broadcast to T steps
            # (a time-invariant step size ``dt.expand(B, T, H)``, a per-sequence vector ``c[:, None].expand(B, T, D)``)
            # carries the step axis, each step the same values
            info.step_dim[node] = lr.broadcast_steps(node, T)
            continue
        rule, ctx = rule_for(node), Ctx(node, info)
        if rule is None:
            d, why = None, f"unknown op {op_label(node)}"
        else:
            try:
                d, why = rule(node, ctx)
            except Exception as e:  # a rule that cannot read its node must not guess
                d, why = None, f"could not analyze {op_label(node)}: {type(e).__name__}: {e}"
        if seed is not None and d is None and why is None and r.expands_along(node, seed, T):
            d = seed  # a step-free value broadcast along the step dim, e.g. a constant decay lam.expand(B, T, N)
        if seed is not None and d != seed:
            why = why or f"seeded at step dim {seed} but the op puts it at {d}"
            d = seed
        if d is not None:
            folds = {info.folds.get(a, 1) for a in inputs if info.step_dim.get(a) is not None} or {1}
            fold = ctx.fold or (1 if seed is not None else folds.pop() if len(folds) == 1 else None)
            if fold is None:
                why = why or "operands with the batch folded into their step dim differently"
            elif fold > 1:
                info.folds[node] = fold
        if (d is not None and T is not None and (s := step_shape(node)) is not None
                and not isinstance(example_value(node), (tuple, list))
                and (d >= len(s) or s[d] != info.steps_at(node))):
            why, d = why or f"output has length {s[d] if d < len(s) else '?'} at the step dim, not T={T}", None
            info.folds.pop(node, None)
        info.step_dim[node] = d
        if why is not None:
            info.mixing[node] = why
    # NB: a region's shard programs run under the grad mode and autocast of the call: what runs under others the
    # code sets itself (a no_grad target, an fp32 block) would be differentiated or cast there, so it bounds regions
    for node, why in changed_modes(gm.graph).items():
        if info.step_dim.get(node) is not None or node in info.sums:
            info.mixing.setdefault(node, why)
            info.sums.pop(node, None)
    # NB: a gradient hook on a value must see its whole gradient; inside a region, the value's uses there would send
    # theirs around it (the shard programs' VJPs never call it)
    for node in gm.graph.nodes:
        if any(registers_hook(u) for u in node.users) and (info.step_dim.get(node) is not None or node in info.sums):
            info.mixing.setdefault(node, "a gradient hook is registered on it (t.register_hook): it is computed "
                                         "outside regions, so that the hook sees its whole gradient")
            info.sums.pop(node, None)
    log.debug("time-local analysis: %d nodes, %d mixing", len(info.step_dim), len(info.mixing))
    return info
