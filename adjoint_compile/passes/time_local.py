"""Step-dim propagation over a dynamo FX graph: which nodes act on each step on its own (DESIGN.md §3,
"Regions along time").

Given seeds ``{node: step_dim}`` (sequence inputs ``[B, T, D]`` with step dim 1, ``linear_scan`` nodes with their
``dim``), :func:`analyze` walks the graph once in topological order and, for every node, records

* ``step_dim[n]``: the dim of ``n``'s output that is the step (time) axis of length T, or ``None`` when the output
  does not carry it as a dim of its own;
* ``mixing[n]``: why ``n`` mixes steps (a convolution along time, a sum over time, attention, slicing along time,
  a reshape that merges the step dim with another, an unknown op, ...).

A node is *time-local* when it carries the step axis and does not mix (output step t depends only on input step t
of every step-carrying input, and on step-free tensors); *step-free* when none of its inputs carries the step axis
(parameter math); *step-mixing* otherwise.  A mixing node still reports the dim of its output's step axis when it
keeps one of full length (e.g. a causal conv along time), so that the ops after it can be classified.

Every rule checks shapes (``node.meta["example_value"]``): an operand that is not tracked along the step axis but
has full length there (e.g. a ``[T, D]`` positional table added to ``[B, T, D]``) makes the op mixing, because a
shard could not take its slice.  Unknown ops are mixing with reason ``"unknown op X"``: the analysis never guesses.

:func:`region_around` then grows the maximal connected set of time-local nodes around some scans and reports the
mixing nodes that bound it.  Both are linear in the size of the graph (times the arity of its nodes).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.random import hashed_dropout
from .graph_utils import callables_named, is_linear_scan, scan_args

log = logging.getLogger(__name__)

__all__ = ["TimeLocalInfo", "analyze", "region_around", "infer_seeds", "is_linear_scan", "scan_args"]


@dataclasses.dataclass
class TimeLocalInfo:
    """Result of :func:`analyze`.

    ``step_dim[n]`` is the dim of ``n``'s output holding the step axis (None: not carried); ``mixing[n]`` says why
    ``n`` mixes steps.  ``length`` is the number of steps T (from the seeds).
    """

    step_dim: dict[fx.Node, int | None]
    mixing: dict[fx.Node, str]
    length: int | None = None
    #: previous-state readouts ``cat([first, h[:, :-1]], dim=d)`` of a scan output ``h``: cat node -> the parts.
    #: Within a shard, the step before the shard's first one is the scan's carry, so the shift stays time-local.
    shifts: dict[fx.Node, "Shift"] = dataclasses.field(default_factory=dict)

    def carries_step(self, n: fx.Node) -> bool:
        return self.step_dim.get(n) is not None

    def is_time_local(self, n: fx.Node) -> bool:
        """True for a node that carries the step axis and acts on each step on its own."""
        return self.step_dim.get(n) is not None and n not in self.mixing

    def kind(self, n: fx.Node) -> str:
        """``"mixing"``, ``"local"`` or ``"step_free"``."""
        if n in self.mixing:
            return "mixing"
        return "local" if self.step_dim.get(n) is not None else "step_free"


@dataclasses.dataclass(frozen=True)
class Shift:
    """``out = cat([first, scan[..., :-1 along d]], dim=d)``: out_t = h_{t-1}, and out_0 = first.

    ``first`` is step-free (length 1 at d); ``sliced`` is the ``getitem`` that drops the last step of ``scan``.
    """

    first: fx.Node
    sliced: fx.Node
    scan: fx.Node
    dim: int


# --------------------------------------------------------------------------------------------------------------
# helpers

Rule = Callable[[fx.Node, "_Ctx"], "tuple[int | None, str | None]"]


def _ev(n: Any) -> Any:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _size(x: Any) -> Any:
    """An int, or for a symbolic size (dynamic shapes) its sympy expression.

    NB: comparing SymInts would install guards in dynamo's shape environment; sympy expressions compare
    structurally and never guard, so the analysis stays a pure read of the graph.
    """
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        return int(expr) if expr.is_number else expr
    return x


def _shape(n: Any) -> tuple[Any, ...] | None:
    v = _ev(n)
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        v = v[0]  # NB: tuple outputs (split, max(dim)) share their step dim; rules check ndim only.
    if isinstance(v, torch.Tensor):
        return tuple(_size(x) for x in v.shape)
    return None


def _nodes_in(x: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(x, out.append)
    return out


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Ctx:
    """Per-node view used by the rules: argument access and step dims of inputs."""

    def __init__(self, node: fx.Node, info: TimeLocalInfo) -> None:
        self.node = node
        self.info = info
        self.method = node.op == "call_method"

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument i (counting self for methods) or keyword ``name``."""
        args = self.node.args
        if i < len(args):
            return args[i]
        return self.node.kwargs.get(name, default)

    def sd(self, n: Any) -> int | None:
        return self.info.step_dim.get(n) if isinstance(n, fx.Node) else None

    @property
    def out_shape(self) -> tuple[int, ...] | None:
        return _shape(self.node)

    @property
    def T(self) -> int | None:
        return self.info.length


# --------------------------------------------------------------------------------------------------------------
# rules: each returns (output step dim or None, mixing reason or None)


def _broadcast(node: fx.Node, ctx: _Ctx, operands: list[Any] | None = None) -> tuple[int | None, str | None]:
    """Elementwise op with numpy broadcasting: operands align on their trailing dims."""
    out = ctx.out_shape
    if out is None:
        return None, f"no shape for {node.name}"
    ops = operands if operands is not None else _nodes_in((node.args, node.kwargs))
    tensors = [a for a in ops if isinstance(a, fx.Node) and _shape(a) is not None]
    d_out: int | None = None
    for a in tensors:
        if ctx.sd(a) is None:
            continue
        s = _shape(a)
        d = ctx.sd(a) + len(out) - len(s)
        if d_out is not None and d != d_out:
            return d_out, f"step axes of the operands do not line up ({a.name} at dim {d}, others at {d_out})"
        d_out = d
    if d_out is None:
        return None, None
    if out[d_out] != ctx.T and ctx.T is not None:
        return None, f"output length {out[d_out]} at the step dim differs from T={ctx.T}"
    for a in tensors:
        if ctx.sd(a) is not None:
            continue
        s = _shape(a)
        pos = d_out - (len(out) - len(s))
        if 0 <= pos < len(s) and s[pos] != 1:
            return d_out, (f"operand {a.name} is not tracked along the step axis but has length {s[pos]} there "
                           f"(a per-step table?)")
    return d_out, None


def _pointwise(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    return _broadcast(node, ctx)


def _unary(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    """Ops whose output has the shape of their first argument (to, contiguous, clone, zeros_like, ...)."""
    x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    d = ctx.sd(x)
    out = ctx.out_shape
    if d is not None and (out is None or _shape(x) != out):
        return None, f"{_op_name(node)} changes the shape"
    return d, None


def _dropout(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    p = ctx.arg(1, "p", 0.5)
    if node.target is torch.dropout:  # torch.dropout(input, p, train)
        training = ctx.arg(2, "train")
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        training = ctx.arg(2, "training", True)
    if training is False or p == 0:
        return _unary(node, ctx)
    return ctx.sd(node.args[0]), "random op (dropout): a shard's recomputation would draw a different mask"


def _random(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    return None, f"random op {_op_name(node)}: a shard's recomputation would draw different numbers"


def _metadata(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    # size(), dim(), ...: plain numbers, no step axis. Lowering refuses regions that consume them as shapes.
    return None, None


def _linear(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, w, b = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias")
    if ctx.sd(w) is not None or ctx.sd(b) is not None:
        return None, "Linear weight or bias depends on the step"
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    if d == len(s) - 1:
        return None, "Linear contracts the step dim"
    return d, None


def _matmul(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, y = ctx.arg(0, "input"), ctx.arg(1, "other", ctx.arg(1, "mat2"))
    sx, sy, out = _shape(x), _shape(y), ctx.out_shape
    if sx is None or sy is None or out is None:
        return None, f"no shape for {node.name}"
    dx, dy = ctx.sd(x), ctx.sd(y)
    if len(sx) < 2 or len(sy) < 2:
        if len(sy) == 1 and dy is None and dx is not None and dx < len(sx) - 1:
            return dx, None  # matrix-vector over features
        return None, "matmul with a 1-D operand along the step axis"
    cands: list[int] = []
    for d, s, contract, keep in ((dx, sx, len(sx) - 1, len(sx) - 2), (dy, sy, len(sy) - 2, len(sy) - 1)):
        if d is None:
            continue
        if d == contract:
            return None, "matmul contracts the step dim (attention-like or a time mixing matrix)"
        if d == keep:
            cands.append(len(out) - 2 if s is sx else len(out) - 1)
        else:
            cands.append(d + len(out) - len(s))
    if len(set(cands)) != 1:
        return None, "both matmul operands carry the step axis at different dims (attention-like scores)"
    d_out = cands[0]
    if d_out < len(out) - 2:  # a batch dim: the untracked operand must broadcast along it
        for d, s in ((dx, sx), (dy, sy)):
            if d is None:
                pos = d_out - (len(out) - len(s))
                if 0 <= pos < len(s) - 2 and s[pos] != 1:
                    return d_out, "matmul operand is not tracked along the step axis but has its length there"
    return d_out, None


def _einsum(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    eq = node.args[0]
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str):
        return None, "einsum with a non-literal equation"
    eq = eq.replace(" ", "")
    if "->" not in eq:
        return None, "einsum without an explicit output"
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        return None, "einsum operand count does not match the equation"
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]

    def expand(term: str, ndim: int) -> str:
        if "..." not in term:
            return term
        k = ndim - (len(term) - 3)
        return term.replace("...", "".join(free[-k:]) if k > 0 else "")

    ell_nd = max((len(_shape(o) or ()) - (len(t) - 3) for t, o in zip(terms, ops) if "..." in t), default=0)
    terms = [expand(t, len(_shape(o) or ())) for t, o in zip(terms, ops)]
    rhs = rhs.replace("...", "".join(free[-ell_nd:]) if ell_nd > 0 else "")
    letter = None
    for t, o in zip(terms, ops):
        d = ctx.sd(o)
        if d is None:
            continue
        if len(t) != len(_shape(o) or ()):
            return None, "einsum term does not match its operand's rank"
        if letter is not None and t[d] != letter:
            return None, "einsum operands carry the step axis under different indices"
        letter = t[d]
    if letter is None:
        return None, None
    if letter not in rhs:
        return None, f"einsum contracts the step index {letter!r}"
    for t, o in zip(terms, ops):
        if ctx.sd(o) is None and letter in t and (_shape(o) or ())[t.index(letter)] != 1:
            return rhs.index(letter), "einsum operand is not tracked along the step axis but carries its index"
    return rhs.index(letter), None


def _dims_arg(dim: Any, ndim: int) -> list[int] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return [_norm(dim, ndim)]
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return [_norm(d, ndim) for d in dim] if dim else None  # NB: sum(x, ()) reduces everything
    return []


def _reduction(dim_pos: int, keep_pos: int, dim_kw: str = "dim") -> Rule:
    def rule(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), _shape(x)
        if d is None:
            return None, None
        dim = ctx.arg(dim_pos, dim_kw)
        if isinstance(dim, fx.Node):  # max(x, y) / min(x, y): elementwise
            return _broadcast(node, ctx)
        dims = _dims_arg(dim, len(s))
        if dims is None:
            return None, f"{_op_name(node)} over all dims (including the step dim)"
        if dims == [] :
            return None, f"{_op_name(node)} with an unreadable dim argument {dim!r}"
        if d in dims:
            return None, f"{_op_name(node)} over the step dim"
        keep = ctx.arg(keep_pos, "keepdim", False)
        return (d if keep else d - sum(1 for k in dims if k < d)), None

    return rule


def _along_dim(dim_pos: int, dim_kw: str = "dim", default: Any = None) -> Rule:
    """Shape-preserving ops along one dim (softmax, cumsum, normalize, flip, sort): local unless dim is the step."""

    def rule(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), _shape(x)
        if d is None:
            return None, None
        dims = _dims_arg(ctx.arg(dim_pos, dim_kw, default), len(s))
        if not dims:
            return d, f"{_op_name(node)} with an implicit or unreadable dim"
        if d in dims:
            return d, f"{_op_name(node)} along the step dim"
        return d, None

    return rule


def _norm_layer(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, shape = ctx.arg(0, "input"), ctx.arg(1, "normalized_shape")
    for extra in _nodes_in((node.args[2:], {k: v for k, v in node.kwargs.items() if k != "input"})):
        if ctx.sd(extra) is not None:
            return None, f"{_op_name(node)} weight depends on the step"
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    if d >= len(s) - k:
        return None, f"{_op_name(node)} normalizes over the step dim"
    return d, None


def _reshape_map(sin: tuple[int, ...], sout: tuple[int, ...], d: int) -> int | None:
    """Where the step axis (dim d of sin) lands in a row-major reshape to sout, if it stays a dim of its own.

    The axis survives iff some dim d' of sout has the same size and the same number of elements before it.
    NB: with several candidates (only possible next to size-1 dims when T == 1) the first is taken; with T == 1
    every choice is time-local.
    """
    before = math.prod(sin[:d])
    acc = 1
    for k, n in enumerate(sout):
        if acc == before and n == sin[d]:
            return k
        acc *= n
        if isinstance(acc, int) and isinstance(before, int) and acc > before > 0:
            break
    return None


def _view(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0] if node.args else node.kwargs.get("input")
    d, s, out = ctx.sd(x), _shape(x), ctx.out_shape
    if d is None:
        return None, None
    if out is None:
        return None, f"no shape for {node.name}"
    k = _reshape_map(s, out, d)
    if k is None:
        return None, f"{_op_name(node)} merges or splits the step dim ({list(s)} -> {list(out)})"
    return k, None


def _expand(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s, out = ctx.sd(x), _shape(x), ctx.out_shape
    if d is None:
        return None, None
    if out is None:
        return None, f"no shape for {node.name}"
    return d + len(out) - len(s), None


def _int_list(args: Any) -> list[int] | None:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    return list(args) if all(isinstance(a, int) for a in args) else None


def _permute(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    perm = _int_list(node.args[1:]) if node.args[1:] else _int_list((node.kwargs.get("dims"),))
    if perm is None or len(perm) != len(s):
        return None, "permute with unreadable dims"
    return [_norm(p, len(s)) for p in perm].index(d), None


def _transpose(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    if _op_name(node) == "t":
        d0, d1 = 0, len(s) - 1
    else:
        d0, d1 = ctx.arg(1, "dim0"), ctx.arg(2, "dim1")
        if not (isinstance(d0, int) and isinstance(d1, int)):
            return None, "transpose with unreadable dims"
        d0, d1 = _norm(d0, len(s)), _norm(d1, len(s))
    return (d1 if d == d0 else d0 if d == d1 else d), None


def _movedim(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    src, dst = ctx.arg(1, "source"), ctx.arg(2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    n = len(s)
    src, dst = [_norm(a, n) for a in src], [_norm(a, n) for a in dst]
    order = [None] * n
    for a, b in zip(src, dst):
        order[b] = a
    rest = iter([k for k in range(n) if k not in src])
    order = [o if o is not None else next(rest) for o in order]
    return order.index(d), None


def _unsqueeze(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    k = ctx.arg(1, "dim")
    if not isinstance(k, int):
        return None, "unsqueeze with an unreadable dim"
    k = _norm(k, len(s) + 1)
    return (d + 1 if k <= d else d), None


def _squeeze(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    dims = _dims_arg(ctx.arg(1, "dim"), len(s))
    if dims == []:
        return None, "squeeze with an unreadable dim"
    gone = [k for k in (range(len(s)) if dims is None else dims) if s[k] == 1]
    if d in gone:
        return None, "squeeze removes the step dim"
    return d - sum(1 for k in gone if k < d), None


def _getitem(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, idx = node.args[0], node.args[1]
    d = ctx.sd(x)
    if isinstance(_ev(x), (tuple, list)):
        # element of a multi-output node (split, chunk, max(dim)): they share the step dim
        return (d, None) if isinstance(idx, int) else (None, "getitem on a tuple with a non-int index")
    s = _shape(x)
    if d is None:
        return None, None
    if s is None:
        return None, f"no shape for {x.name}"
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, (fx.Node, list, torch.Tensor)) for i in items):
        return None, "advanced (tensor) indexing"
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (len(s) - n_real))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (len(s) - sum(1 for i in expanded if i is not None)))
    din = dout = 0
    for i in expanded:
        if i is None:
            dout += 1
            continue
        if din == d:
            if isinstance(i, slice):
                full = (i.start in (None, 0)) and (i.step in (None, 1)) and (i.stop is None or
                                                                           (isinstance(i.stop, int) and i.stop >= s[d]))
                if full:
                    return dout, None
                return None, f"slicing along the step dim ({i})"
            return None, "indexing a single step"
        if isinstance(i, slice):
            dout += 1
        din += 1
    return None, "unreadable index"


def _split_like(dim_pos: int, default: int | None = 0, drop: bool = False) -> Rule:
    """select/narrow/split/chunk/unbind along ``dim`` (argument ``dim_pos``): time-local unless along the step dim;
    ``drop``: the op removes ``dim``."""
    def rule(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), _shape(x)
        if d is None:
            return None, None
        dim = ctx.arg(dim_pos, "dim", default)
        if not isinstance(dim, int):
            return None, f"{_op_name(node)} with an unreadable dim"
        dim = _norm(dim, len(s))
        if dim == d:
            return None, f"{_op_name(node)} along the step dim"
        return (d - 1 if drop and dim < d else d), None

    return rule


def _index_select(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d, s = ctx.sd(x), _shape(x)
    if ctx.sd(idx) is not None:
        return None, "index_select with a step-dependent index"
    if d is None:
        return None, None
    if not isinstance(dim, int) or _norm(dim, len(s)) == d:
        return None, "index_select along the step dim"
    return d, None


def _cat(stack: bool) -> Rule:
    def rule(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
        tensors = ctx.arg(0, "tensors")
        dim = ctx.arg(1, "dim", 0)
        if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
            return None, f"{_op_name(node)} with unreadable arguments"
        dims = {ctx.sd(t) for t in tensors}
        if dims == {None}:
            return None, None
        if None in dims:
            return None, f"{_op_name(node)} of step-carrying and untracked tensors"
        if len(dims) != 1:
            return None, f"{_op_name(node)} of tensors with the step axis at different dims"
        d = dims.pop()
        nd = len(_shape(tensors[0]))
        if stack:
            k = _norm(dim, nd + 1)
            return (d + 1 if k <= d else d), None
        if _norm(dim, nd) == d:
            return None, "cat along the step dim"
        return d, None

    return rule


def _conv(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, w, b = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias")
    if ctx.sd(w) is not None or ctx.sd(b) is not None:
        return None, "convolution weight depends on the step"
    d, out = ctx.sd(x), ctx.out_shape
    if d is None:
        return None, None
    if d == 0:
        return 0, None
    if d == 1:
        return None, "convolution mixes channels, and the step axis is the channel dim"
    keep = d if out is not None and out[d] == _shape(x)[d] else None
    return keep, "convolution along the step axis"


def _pad(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    x, pad = ctx.arg(0, "input"), ctx.arg(1, "pad")
    d, s = ctx.sd(x), _shape(x)
    if d is None:
        return None, None
    if not isinstance(pad, (list, tuple)) or not all(isinstance(p, int) for p in pad):
        return None, "pad with unreadable amounts"
    k = len(s) - 1 - d  # pad pairs run from the last dim backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return None, "pad along the step dim"
    return d, None


def _scan(node: fx.Node, ctx: _Ctx) -> tuple[int | None, str | None]:
    a = scan_args(node)
    shp = ctx.out_shape
    if shp is None or not isinstance(a["dim"], int):
        return None, "linear_scan with unreadable arguments"
    dim = _norm(a["dim"], len(shp))
    if ctx.sd(a["h0"]) is not None:
        return dim, "linear_scan's h0 carries the step axis"
    for key in ("a", "b"):
        v = a[key]
        if ctx.sd(v) is None:
            if isinstance(v, fx.Node) and (_shape(v) or ()) and len(_shape(v)) == len(shp) and _shape(v)[dim] != 1:
                return dim, f"linear_scan input {key} ({v.name}) is not tracked along the step axis (seed its source)"
            continue
        if ctx.sd(v) + len(shp) - len(_shape(v)) != dim:
            return dim, f"linear_scan runs along dim {dim} but its input {key} carries the step axis elsewhere"
    if a["reverse"]:
        return dim, "reverse linear_scan: state flows from the last step to the first"
    return dim, None


# --------------------------------------------------------------------------------------------------------------
# rule table

_POINTWISE = """add sub rsub mul div true_divide truediv floordiv floor_divide mod remainder fmod pow float_power
neg pos abs absolute exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan tanh sinh cosh asin acos atan atan2
arcsin arccos arctan sigmoid logit relu relu6 gelu silu mish softplus softsign elu selu celu leaky_relu hardtanh
hardswish hardsigmoid logsigmoid tanhshrink softshrink hardshrink threshold clamp clip clamp_min clamp_max
where maximum minimum fmax fmin reciprocal square sign sgn floor ceil round trunc frac lerp addcmul addcdiv eq ne lt
le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not and_ or_ xor
invert erf erfc erfinv nan_to_num masked_fill xlogy hypot copysign heaviside isnan isinf isfinite signbit""".split()
_UNARY = """to type type_as float half double bfloat16 int long bool contiguous clone detach cpu cuda
zeros_like ones_like empty_like full_like requires_grad_ alias""".split()
_METADATA = "size dim numel stride is_contiguous element_size nelement".split()
_RANDOM = "rand_like randn_like randint_like bernoulli multinomial normal poisson".split()
_VIEW = "view reshape flatten unflatten view_as reshape_as".split()

_MODULES = (torch, F, torch._C._nn, torch.special, operator, torch.Tensor, torch._C._VariableFunctions)


def _by_name(names: Iterable[str], rule: Rule, table_fn: dict, table_m: dict) -> None:
    for name in names:
        table_m.setdefault(name, rule)
        for obj in callables_named(name, _MODULES):
            table_fn.setdefault(obj, rule)


_FN: dict[Any, Rule] = {}
_METHOD: dict[str, Rule] = {}
_by_name(_POINTWISE, _pointwise, _FN, _METHOD)
_by_name(_UNARY, _unary, _FN, _METHOD)
_by_name(_METADATA, _metadata, _FN, _METHOD)
_by_name(_RANDOM, _random, _FN, _METHOD)
_by_name(["dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"], _dropout,
         _FN, _METHOD)
_by_name(["linear"], _linear, _FN, _METHOD)
_by_name(["matmul", "mm", "bmm"], _matmul, _FN, _METHOD)
_FN[operator.matmul] = _matmul
_by_name(["einsum"], _einsum, _FN, _METHOD)
for _names, _rule in (
    ("sum mean amax amin prod std var nansum nanmean logsumexp all any argmax argmin count_nonzero std_mean var_mean "
     "max min median nanmedian mode", _reduction(1, 2)),
):
    _by_name(_names.split(), _rule, _FN, _METHOD)
_by_name(["norm"], _reduction(2, 3), _FN, _METHOD)  # torch.norm(input, p, dim, keepdim)
_FN[torch.linalg.vector_norm] = _reduction(2, 3)
for _name in ("softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort"):
    _by_name([_name], _along_dim(1), _FN, _METHOD)
_by_name(["normalize"], _along_dim(2, default=1), _FN, _METHOD)  # F.normalize(input, p=2.0, dim=1)
_by_name(["flip"], _along_dim(1, "dims"), _FN, _METHOD)
_by_name(["roll"], _along_dim(2, "dims"), _FN, _METHOD)
_by_name(["topk"], _along_dim(2, default=-1), _FN, _METHOD)
_by_name(["layer_norm", "rms_norm"], _norm_layer, _FN, _METHOD)
_by_name(_VIEW, _view, _FN, _METHOD)
_by_name(["expand", "expand_as", "broadcast_to"], _expand, _FN, _METHOD)
_by_name(["permute"], _permute, _FN, _METHOD)
_by_name(["transpose", "swapaxes", "swapdims", "t"], _transpose, _FN, _METHOD)
_by_name(["movedim", "moveaxis"], _movedim, _FN, _METHOD)
_by_name(["unsqueeze"], _unsqueeze, _FN, _METHOD)
_by_name(["squeeze"], _squeeze, _FN, _METHOD)
_FN[operator.getitem] = _getitem
_by_name(["select"], _split_like(1, None, drop=True), _FN, _METHOD)
_by_name(["narrow"], _split_like(1, None), _FN, _METHOD)
_by_name(["index_select"], _index_select, _FN, _METHOD)
_by_name(["split", "chunk", "tensor_split"], _split_like(2), _FN, _METHOD)
_by_name(["unbind"], _split_like(1, drop=True), _FN, _METHOD)
_by_name(["cat", "concat", "concatenate"], _cat(False), _FN, _METHOD)
_by_name(["stack"], _cat(True), _FN, _METHOD)
_by_name(["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d"], _conv, _FN, _METHOD)
_FN[F.pad] = _pad
_FN[torch.dropout] = _dropout
_FN[hashed_dropout] = _unary  # its mask is a function of (seed, position): a shard recomputes the same one


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return getattr(t, "__name__", str(t))


def _rule_for(node: fx.Node) -> Rule | None:
    if node.op == "call_method":
        return _METHOD.get(node.target)
    if node.op == "call_function":
        if is_linear_scan(node):
            return _scan
        try:
            rule = _FN.get(node.target)
        except TypeError:
            rule = None
        if rule is None and isinstance(node.target, torch._ops.OpOverload):
            name = node.target.overloadpacket.__name__
            if name in _POINTWISE:
                return _pointwise
        return rule
    return None


# --------------------------------------------------------------------------------------------------------------
# public API


def _length_of_seeds(seeds: dict[fx.Node, int]) -> int | None:
    lengths = {}
    for n, d in seeds.items():
        if not isinstance(n, fx.Node):
            raise ValueError(f"seeds: keys must be fx.Node, got {type(n).__name__}")
        s = _shape(n)
        if s is None:
            raise ValueError(f"seeds: node {n.name} has no tensor example_value to read the step length from")
        if not isinstance(d, int) or not -len(s) <= d < len(s):
            raise ValueError(f"seeds: step dim {d!r} of node {n.name} is not a dim of its shape {list(s)}")
        lengths[n.name] = s[d]
    if len(set(lengths.values())) > 1:
        raise ValueError(f"seeds: the seeds disagree on the number of steps: {lengths}")
    return next(iter(lengths.values()), None)


def drops_last_step(sliced: fx.Node, d: int) -> bool:
    """``sliced`` is ``x[..., :-1, ...]`` with the ``:-1`` at dim d and full slices elsewhere."""
    if not (sliced.op == "call_function" and sliced.target is operator.getitem and len(sliced.args) == 2):
        return False
    x, idx = sliced.args
    s = _shape(x)
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if s is None or any(not isinstance(i, slice) and i is not Ellipsis for i in items) or items.count(Ellipsis) > 1:
        return False
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (len(s) - len(items) + 1) + items[k + 1:]
    items += [slice(None)] * (len(s) - len(items))
    for j, i in enumerate(items):
        want_stop = -1 if j == d else None
        if i.start not in (None, 0) or i.step not in (None, 1) or i.stop != want_stop:
            return False
    return True


def _shift_slice_dim(node: fx.Node, info: TimeLocalInfo) -> int | None:
    """The step dim when ``node`` drops the last step of a scan output and its only user may be a shift's cat."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args
            and isinstance(node.args[0], fx.Node) and is_linear_scan(node.args[0])):
        return None
    d = info.step_dim.get(node.args[0])
    if d is None or len(node.users) != 1 or not drops_last_step(node, d):
        return None
    (user,) = node.users
    return d if _op_name(user) in ("cat", "concat", "concatenate") else None


def _shift_of(node: fx.Node, info: TimeLocalInfo) -> Shift | None:
    """``node`` as a previous-state readout ``cat([first, h[..., :-1]], d)`` (see :class:`Shift`), or None."""
    if _op_name(node) not in ("cat", "concat", "concatenate") or node.kwargs.keys() - {"dim"}:
        return None
    tensors = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not isinstance(dim, int):
        return None
    first, sliced = tensors
    if not (isinstance(first, fx.Node) and isinstance(sliced, fx.Node)):
        return None
    d = info.step_dim.get(sliced)
    if d is None or _shift_slice_dim(sliced, info) != d or _norm(dim, len(_shape(node) or ())) != d:
        return None
    fs, hs = _shape(first), _shape(sliced.args[0])
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


def analyze(gm: fx.GraphModule, seeds: dict[fx.Node, int]) -> TimeLocalInfo:
    """Propagate the step axis through ``gm`` from ``seeds`` (``{node: step dim}``); classify every node.

    Seeded placeholders are sources; a seeded op (e.g. a linear_scan) takes the seed's dim as its output step dim and
    is classified by its own rule (a scan whose a/b do not carry the step axis there is mixing).  Linear in the size
    of the graph.  Raises ValueError when the seeds are not nodes of tensors or disagree on the number of steps.
    """
    T = _length_of_seeds(seeds)
    info = TimeLocalInfo(step_dim={}, mixing={}, length=T)
    pending_slices = _PendingSlices(info)
    for node in gm.graph.nodes:
        seed = seeds.get(node)
        if seed is not None:
            seed = _norm(seed, len(_shape(node)))
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
        for a in _nodes_in((node.args, node.kwargs)):
            if a in pending_slices and node not in info.shifts:
                info.step_dim[a] = None
                info.mixing[a] = "slicing along the step dim (not part of a previous-state readout)"
        inputs = _nodes_in((node.args, node.kwargs))
        if not any(info.step_dim.get(a) is not None for a in inputs) and seed is None:
            info.step_dim[node] = None  # step-free: parameter math and constants, whatever the op
            continue
        rule = _rule_for(node)
        if rule is None:
            d, why = None, f"unknown op {_op_name(node)}"
        else:
            try:
                d, why = rule(node, _Ctx(node, info))
            except Exception as e:  # a rule that cannot read its node must not guess
                d, why = None, f"could not analyze {_op_name(node)}: {type(e).__name__}: {e}"
        if seed is not None and d != seed:
            why = why or f"seeded at step dim {seed} but the op puts it at {d}"
            d = seed
        if (d is not None and T is not None and (s := _shape(node)) is not None
                and not isinstance(_ev(node), (tuple, list)) and (d >= len(s) or s[d] != T)):
            why, d = why or f"output has length {s[d] if d < len(s) else '?'} at the step dim, not T={T}", None
        info.step_dim[node] = d
        if why is not None:
            info.mixing[node] = why
    log.debug("time-local analysis: %d nodes, %d mixing", len(info.step_dim), len(info.mixing))
    return info


def _region_candidates(gm: fx.GraphModule, info: TimeLocalInfo) -> set[fx.Node]:
    return {n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and info.is_time_local(n)}


def region_around(gm: fx.GraphModule, scan_nodes: list[fx.Node],
                  info: TimeLocalInfo) -> tuple[list[fx.Node], list[tuple[str, str]]]:
    """The maximal connected time-local set of nodes containing ``scan_nodes``, and the mixing nodes bounding it.

    Connectivity follows def-use edges in both directions between time-local ops (placeholders, step-free nodes and
    mixing nodes are not members: they are the region's inputs or its bounds).  The set is also made convex: a
    member reachable from another member through a non-member (e.g. ``y + cumsum(y)``) is dropped, so that the set
    can be outlined into one call.  Returns ``(nodes in graph order, [(name, why) of bounding mixing nodes])``;
    ``([], bounds)`` when no scan is time-local.
    """
    cand = _region_candidates(gm, info)
    seeds = [s for s in scan_nodes if s in cand]
    bad = [s for s in scan_nodes if s not in cand]
    for s in bad:
        log.debug("scan %s is not time-local: %s", s.name, info.mixing.get(s, "no step axis"))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members: set[fx.Node] = set()
    while True:
        # connected component(s) of cand containing the seeds
        members = set()
        stack = [s for s in seeds if s in cand]
        while stack:
            n = stack.pop()
            if n in members:
                continue
            members.add(n)
            for m in list(n.all_input_nodes) + list(n.users):
                if m in cand and m not in members:
                    stack.append(m)
        # a getitem of a tuple made outside the region becomes an input: region inputs must be tensors
        cut = {n for n in members if n.op == "call_function" and n.target is operator.getitem
               and isinstance(n.args[0], fx.Node) and n.args[0] not in members
               and isinstance(_ev(n.args[0]), (tuple, list))}
        if cut:
            cand -= cut
            continue
        # convexity: a path that leaves the members and comes back (member -> non-member -> member)
        tainted: set[fx.Node] = set()
        entry = None
        for n in gm.graph.nodes:
            if n in members:
                if entry is None and any(a in tainted for a in n.all_input_nodes):
                    entry = next(a for a in n.all_input_nodes if a in tainted)
            elif any(a in members or a in tainted for a in n.all_input_nodes):
                tainted.add(n)
        if entry is None:
            break
        # NB: drop the members downstream of the path, unless that drops a scan we grow the region for (e.g. a
        # causal conv between two SSM layers): then drop the members upstream of it, which go to a later region.
        dropped = _reachable(entry, members, forward=True)
        if any(x in dropped for x in seeds):
            near = _reachable(entry, members, forward=False)
            if not any(x in near for x in seeds):
                dropped = near
        cand -= dropped
        log.debug("region_around: dropping %s to keep the region convex", sorted(x.name for x in dropped))
    nodes = sorted(members, key=order.__getitem__)
    bounds: list[tuple[str, str]] = []
    seen: set[fx.Node] = set()
    for n in nodes:
        for m in list(n.all_input_nodes) + list(n.users):
            if m in info.mixing and m not in seen:
                seen.add(m)
                bounds.append((m.name, info.mixing[m]))
    for s in bad:
        if s not in seen:
            seen.add(s)
            bounds.append((s.name, info.mixing.get(s, "does not carry the step axis")))
    return nodes, bounds


def _reachable(start: fx.Node, members: set[fx.Node], forward: bool) -> set[fx.Node]:
    """The members reachable from ``start`` through any nodes, along users (``forward``) or inputs."""
    out: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in members:
            out.add(n)
        stack.extend(n.users if forward else n.all_input_nodes)
    return out


def _inverse(node: fx.Node, d_out: int, T: int) -> dict[fx.Node, int] | None:
    """Which inputs of ``node`` carry the step axis, given that its output carries it at ``d_out``.

    Found by trying the forward rule on every assignment of candidate dims (dims of length T, or none) to the tensor
    inputs: an assignment is valid when the rule puts the output's step axis at ``d_out``.  Time-local assignments
    beat mixing ones, then fewer tracked inputs win (a parameter that broadcasts stays whole); a tie with T > 1 is
    ambiguous and gives None, as does an op without a rule.
    """
    import itertools

    rule = _rule_for(node)
    if rule is None:
        return None
    ins = [a for a in dict.fromkeys(_nodes_in((node.args, node.kwargs))) if _shape(a) is not None]
    cands = [[None] + [k for k, n in enumerate(_shape(a)) if n == T] for a in ins]
    if math.prod(len(c) for c in cands) > 256:
        return None
    best: list[tuple[tuple[int, int], dict[fx.Node, int]]] = []
    for combo in itertools.product(*cands):
        if all(c is None for c in combo):
            continue
        trial = TimeLocalInfo(step_dim=dict(zip(ins, combo)), mixing={}, length=T)
        try:
            d, why = rule(node, _Ctx(node, trial))
        except Exception:  # noqa: BLE001 - an assignment the rule cannot read is not valid
            continue
        if d != d_out:
            continue
        assign = {a: k for a, k in zip(ins, combo) if k is not None}
        best.append(((why is not None, len(assign)), assign))
    if not best:
        return None
    best.sort(key=lambda x: x[0])
    if len(best) > 1 and best[0][0] == best[1][0] and T > 1 and best[0][1] != best[1][1]:
        return None
    return best[0][1]


def infer_seeds(gm: fx.GraphModule, scan_nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Seeds for :func:`analyze` found from the scans alone: the scans (at their ``dim``) and the sources of their
    ``a`` and ``b`` along the step axis.

    Walks back from every scan's a and b through ops whose rule can be inverted exactly (broadcasting aligns a
    per-step operand with the step axis; Linear passes it to its input, never to its weight; views map it by the
    row-major rule).  A node where the walk stops (a placeholder, a conv along time, an op without a rule) becomes a
    seed itself: its output is a step-carrying input of any region after it.  The forward :func:`analyze` then checks
    everything; a node asked for at two different dims keeps the first and is logged.
    """
    seeds: dict[fx.Node, int] = {}
    T = None
    want: dict[fx.Node, int] = {}
    work: list[fx.Node] = []
    for s in scan_nodes:
        a = scan_args(s)
        shp = _shape(s)
        if shp is None or not isinstance(a["dim"], int):
            continue
        dim = _norm(a["dim"], len(shp))
        if T is not None and shp[dim] != T:
            log.debug("infer_seeds: scan %s has %d steps, others %d: skipped", s.name, shp[dim], T)
            continue
        T = shp[dim]
        seeds[s] = dim
        for key in ("a", "b"):
            v = a[key]
            vs = _shape(v)
            if vs is None or dim + len(vs) - len(shp) < 0 or vs[dim + len(vs) - len(shp)] != T:
                continue  # broadcast along time: step-free
            d = dim + len(vs) - len(shp)
            if want.setdefault(v, d) != d:
                log.debug("infer_seeds: %s wanted at dims %d and %d", v.name, want[v], d)
            else:
                work.append(v)
    done: set[fx.Node] = set()
    while work:
        n = work.pop()
        if n in done or n in seeds:
            continue
        done.add(n)
        d = want[n]
        inv = _inverse(n, d, T) if n.op in ("call_function", "call_method") else None
        if not inv:
            seeds[n] = d
            continue
        for a, k in inv.items():
            if want.setdefault(a, k) != k:
                log.debug("infer_seeds: %s wanted at dims %d and %d", a.name, want[a], k)
            elif a not in done:
                work.append(a)
    return seeds
