"""Step-dim rules of the time-local analysis (:mod:`.time_local`) for ops that compute: elementwise ops,
contractions, reductions, norms, convolutions, random ops and the scan. The rules that only move data (views,
indexing, cat) are in :mod:`.layout_rules`.

A rule reads one node and the step dims of its inputs (:class:`Ctx`) and returns ``(step dim of the output or
None, why it mixes steps or None)``. Every rule checks shapes: an operand that is not tracked along the step axis
but has full length there makes the op mixing, because a shard could not take its slice.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .fx import nodes_in, scan_args, shape
from .optable import POINTWISE, SAME_SHAPE, raw_name

@dataclasses.dataclass
class TimeLocalInfo:
    """Result of :func:`~adjoint_compile.analysis.time_local.analyze` (defined here, where the rules read it).

    ``step_dim[n]`` is the dim of ``n``'s output holding the step axis (None: not carried); ``mixing[n]`` says why
    ``n`` mixes steps.  ``length`` is the number of steps T (from the seeds).
    """

    step_dim: dict[fx.Node, int | None]
    mixing: dict[fx.Node, str]
    length: int | None = None
    #: previous-state readouts ``cat([first, h[:, :-1]], dim=d)`` of a scan output ``h``: cat node -> the parts.
    #: Within a shard, the step before the shard's first one is the scan's carry, so the shift stays time-local.
    shifts: dict[fx.Node, "Shift"] = dataclasses.field(default_factory=dict)
    #: causal convolutions along time joined to regions (``analyze(..., halo=True)``): conv node -> the parts.
    #: Within a shard, the ``halo`` steps before the shard's first one are carried from the shard on its left.
    convs: dict[fx.Node, "CausalConv"] = dataclasses.field(default_factory=dict)
    #: sums (and means) over the step axis of a time-local value (``analyze(..., halo=True)``): node -> the parts.
    #: Their outputs carry no step axis; a region may end in them, adding up its shards' partial sums.
    sums: dict[fx.Node, "TimeSum"] = dataclasses.field(default_factory=dict)
    #: values whose step dim holds the batch folded in front of the steps (``logits.flatten(0, 1)`` of a
    #: ``[B, T, V]`` value: a ``[B·T, V]`` value whose row b·T + t is step t of sequence b): node -> the fold (B).
    #: Its length there is fold·T; a shard's is fold·L. Only with ``fold_ok`` (``analyze(..., halo=True)``).
    folds: dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    fold_ok: bool = False

    def steps_at(self, n: fx.Node) -> int | None:
        """The length of ``n``'s step dim: T, or fold·T for a value with the batch folded into it."""
        return None if self.length is None else self.length * self.folds.get(n, 1)

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


@dataclasses.dataclass(frozen=True)
class CausalConv:
    """``out = conv1d(x, w, b, stride=1, padding=p, dilation)[..., :T]`` (``sliced`` is the cut) or
    ``out = conv1d(F.pad(x, (p, 0)), w, b, dilation=...)`` (``pad`` is the pad) along x's last dim (its step dim
    ``dim``), with p = dilation·(k-1): out_t reads x_{t-p..t}, zeros before the first step.

    ``kind="shift"``: ``conv`` is a ``shift_steps(x, p, dim, value)`` node (a token shift, out_t = x_{t-p}, ``value``
    before the first p steps; ``sliced`` and ``pad`` are None). Both kinds read the p steps of x before a shard: its
    halo, carried after the scans' states."""

    conv: fx.Node
    sliced: fx.Node | None
    input: fx.Node
    halo: int
    dim: int
    pad: fx.Node | None = None
    kind: str = "conv"
    fill: float = 0.0


@dataclasses.dataclass(frozen=True)
class TimeSum:
    """``out = x.sum(dims)`` or ``x.mean(dims)`` over dims that include x's step dim ``dim`` (``dims`` None: all of
    them): the sum of the shards' own sums; a mean is the sum of the shards' means, each weighted by L/T."""

    node: fx.Node
    input: fx.Node
    dim: int
    mean: bool
    #: a loss's mean over its valid targets (``cross_entropy(..., reduction="mean")``): the sum of the shards'
    #: sums over the sum of their counts (:func:`~.losses.loss_count`), both whole-batch quantities
    ratio: bool = False


Rule = Callable[[fx.Node, "Ctx"], "tuple[int | None, str | None]"]

#: a node's shape; a tuple of tensors (split, max(dim)) has its first one's: they share their step dim, and the
#: rules check ndim only.
step_shape = functools.partial(shape, first_of_tuple=True)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def op_label(node: fx.Node) -> str:
    """The op's name in a reason (``"unknown op X"``, ``"sum over the step dim"``)."""
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return getattr(t, "__name__", str(t))


def expands_along(node: fx.Node, d: int, T: int | None) -> bool:
    """``node`` is ``x.expand(...)`` / ``broadcast_to`` of a step-free x whose output has T steps at dim ``d``, where x
    has no dim or a dim of 1: each step sees the same x, so a shard's expand to L steps is the same op (the shard
    program rewrites the literal T there)."""
    if node.op not in ("call_method", "call_function") or op_label(node) not in ("expand", "broadcast_to"):
        return False
    x, out = node.args[0] if node.args else None, step_shape(node)
    s = step_shape(x)
    if s is None or out is None or T is None or not 0 <= d < len(out) or out[d] != T:
        return False
    k = d - (len(out) - len(s))
    return k < 0 or s[k] == 1


class Ctx:
    """Per-node view used by the rules: argument access and step dims of inputs."""

    def __init__(self, node: fx.Node, info: "TimeLocalInfo") -> None:
        self.node = node
        self.info = info
        self.method = node.op == "call_method"
        #: the fold of the output's step dim, when the rule sets it (a reshape that merges or splits the batch and
        #: the steps); None: the fold of the step-carrying inputs
        self.fold: int | None = None

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
        return step_shape(self.node)

    @property
    def T(self) -> int | None:
        return self.info.length


# --------------------------------------------------------------------------------------------------------------
# rules: each returns (output step dim or None, mixing reason or None)


def broadcast(node: fx.Node, ctx: Ctx, operands: list[Any] | None = None,
              out: tuple[int, ...] | None = None) -> tuple[int | None, str | None]:
    """Elementwise op with numpy broadcasting: operands align on their trailing dims."""
    out = out if out is not None else ctx.out_shape
    if out is None:
        return None, f"no shape for {node.name}"
    ops = operands if operands is not None else nodes_in((node.args, node.kwargs))
    tensors = [a for a in ops if isinstance(a, fx.Node) and step_shape(a) is not None]
    d_out: int | None = None
    for a in tensors:
        if ctx.sd(a) is None:
            continue
        s = step_shape(a)
        d = ctx.sd(a) + len(out) - len(s)
        if d_out is not None and d != d_out:
            return d_out, f"step axes of the operands do not line up ({a.name} at dim {d}, others at {d_out})"
        d_out = d
    if d_out is None:
        return None, None
    want = ctx.info.steps_at(next(a for a in tensors if ctx.sd(a) is not None))
    if want is not None and out[d_out] != want:
        return None, f"output length {out[d_out]} at the step dim differs from T={ctx.T}"
    for a in tensors:
        if ctx.sd(a) is not None:
            continue
        s = step_shape(a)
        pos = d_out - (len(out) - len(s))
        if 0 <= pos < len(s) and s[pos] != 1:
            if (b := _ambiguous_broadcast(a, ctx.T)) is not None:
                return d_out, (f"operand {a.name} is {b.name} broadcast along two dims of {ctx.T} entries (as many "
                               f"sequences as steps): which one is time is not known here; other batch sizes shard it")
            return d_out, (f"operand {a.name} is not tracked along the step axis but has length {s[pos]} there "
                           f"(a per-step table?)")
    return d_out, None


def _ambiguous_broadcast(a: fx.Node, T: int | None, depth: int = 4) -> fx.Node | None:
    """The broadcast behind ``a`` (itself, or up to ``depth`` ops before it) along more than one dim of T entries,
    or None."""
    if T is None or T < 2 or depth < 0:
        return None
    out = step_shape(a)
    if out is not None and sum(expands_along(a, d, T) for d in range(len(out))) > 1:
        return a
    return next((b for x in a.all_input_nodes if (b := _ambiguous_broadcast(x, T, depth - 1)) is not None), None)


def pointwise(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    return broadcast(node, ctx)


def custom_function(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """A custom ``autograd.Function`` (dynamo's ``autograd_function_apply``) whose forward and backward are both
    elementwise (RecurrentGemma's ``SqrtBoundDerivative``: a sqrt with a clamped gradient): every output is the
    operands' broadcast shape, element for element, so a shard computes and differentiates its own steps. Its own
    backward is kept: the shard's VJP runs it."""
    gm = node.graph.owning_module
    bodies = [getattr(gm, str(a.target), None) if isinstance(a, fx.Node) and a.op == "get_attr" else None
              for a in node.args[:2]]
    if gm is None or not all(isinstance(b, fx.GraphModule) for b in bodies):
        return None, "custom autograd.Function whose forward and backward are not readable"
    elementwise = POINTWISE | SAME_SHAPE
    for body in bodies:
        for n in body.graph.nodes:
            if n.op in ("placeholder", "output") or n.target is torch._C._set_grad_enabled:
                continue
            if n.op not in ("call_function", "call_method") or raw_name(n) not in elementwise:
                return None, (f"custom autograd.Function with {op_label(n)} in its "
                              f"{'forward' if body is bodies[0] else 'backward'} (only elementwise ones join a region)")
    v = node.meta.get("example_value", node.meta.get("val"))
    outs = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in (v if isinstance(v, tuple) else [v])]
    if not outs or any(o is None or o != outs[0] for o in outs):
        return None, "custom autograd.Function whose outputs differ in shape"
    return broadcast(node, ctx, [a for a in node.args[2:] if isinstance(a, fx.Node)], tuple(outs[0]))


def same_shape(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """Ops whose output has the shape of their first argument (to, contiguous, clone, zeros_like, ...)."""
    x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    d = ctx.sd(x)
    out = ctx.out_shape
    if d is not None and (out is None or step_shape(x) != out):
        return None, f"{op_label(node)} changes the shape"
    return d, None


def dropout(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    p = ctx.arg(1, "p", 0.5)
    if node.target is torch.dropout:  # torch.dropout(input, p, train)
        training = ctx.arg(2, "train")
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        training = ctx.arg(2, "training", True)
    if training is False or p == 0:
        return same_shape(node, ctx)
    return ctx.sd(node.args[0]), "random op (dropout): a shard's recomputation would draw a different mask"


def random_draw(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    return None, f"random op {op_label(node)}: a shard's recomputation would draw different numbers"


def metadata(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    # size(), dim(), ...: plain numbers, no step axis. Lowering refuses regions that consume them as shapes.
    return None, None


def new_factory(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    # x.new_zeros(B, D) (a loop's first state): a constant, unless it has the steps' length (a buffer over time,
    # which a shard would make whole)
    out, T = ctx.out_shape, ctx.T
    if out is None:
        return None, f"no shape for {node.name}"
    if T is not None and T > 1 and T in out:
        return None, f"{op_label(node)} makes a tensor with a dim of the steps' length ({list(out)})"
    return None, None


def linear(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, w, b = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias")
    if ctx.sd(w) is not None or ctx.sd(b) is not None:
        return None, "Linear weight or bias depends on the step"
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    if d == len(s) - 1:
        return None, "Linear contracts the step dim"
    return d, None


def matmul(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, y = ctx.arg(0, "input"), ctx.arg(1, "other", ctx.arg(1, "mat2"))
    sx, sy, out = step_shape(x), step_shape(y), ctx.out_shape
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


def einsum(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
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

    ell_nd = max((len(step_shape(o) or ()) - (len(t) - 3) for t, o in zip(terms, ops) if "..." in t), default=0)
    terms = [expand(t, len(step_shape(o) or ())) for t, o in zip(terms, ops)]
    rhs = rhs.replace("...", "".join(free[-ell_nd:]) if ell_nd > 0 else "")
    letter = None
    for t, o in zip(terms, ops):
        d = ctx.sd(o)
        if d is None:
            continue
        if len(t) != len(step_shape(o) or ()):
            return None, "einsum term does not match its operand's rank"
        if letter is not None and t[d] != letter:
            return None, "einsum operands carry the step axis under different indices"
        letter = t[d]
    if letter is None:
        return None, None
    if letter not in rhs:
        return None, f"einsum contracts the step index {letter!r}"
    for t, o in zip(terms, ops):
        if ctx.sd(o) is None and letter in t and (step_shape(o) or ())[t.index(letter)] != 1:
            return rhs.index(letter), "einsum operand is not tracked along the step axis but carries its index"
    return rhs.index(letter), None


def dims_arg(dim: Any, ndim: int) -> list[int] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return [norm_dim(dim, ndim)]
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return [norm_dim(d, ndim) for d in dim] if dim else None  # NB: sum(x, ()) reduces everything
    return []


def reduction(dim_pos: int, keep_pos: int, dim_kw: str = "dim") -> Rule:
    def rule(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), step_shape(x)
        if d is None:
            return None, None
        dim = ctx.arg(dim_pos, dim_kw)
        if isinstance(dim, fx.Node):  # max(x, y) / min(x, y): elementwise
            return broadcast(node, ctx)
        dims = dims_arg(dim, len(s))
        if dims is None:
            return None, f"{op_label(node)} over all dims (including the step dim)"
        if dims == [] :
            return None, f"{op_label(node)} with an unreadable dim argument {dim!r}"
        if d in dims:
            return None, f"{op_label(node)} over the step dim"
        keep = ctx.arg(keep_pos, "keepdim", False)
        return (d if keep else d - sum(1 for k in dims if k < d)), None

    return rule


def along_dim(dim_pos: int, dim_kw: str = "dim", default: Any = None) -> Rule:
    """Shape-preserving ops along one dim (softmax, cumsum, normalize, flip, sort): local unless dim is the step."""

    def rule(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), step_shape(x)
        if d is None:
            return None, None
        dims = dims_arg(ctx.arg(dim_pos, dim_kw, default), len(s))
        if not dims:
            return d, f"{op_label(node)} with an implicit or unreadable dim"
        if d in dims:
            return d, f"{op_label(node)} along the step dim"
        return d, None

    return rule


def repeat_interleave(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """``x.repeat_interleave(repeats, dim)``: local along any dim but the step (no dim: a flattening, mixing)."""
    if ctx.sd(ctx.arg(1, "repeats")) is not None:
        return None, "repeat_interleave with per-step repeats"
    return along_dim(2)(node, ctx)


def norm_layer(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, shape = ctx.arg(0, "input"), ctx.arg(1, "normalized_shape")
    d, s = ctx.sd(x), step_shape(x)
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    if d is not None and d >= len(s) - k:
        return None, f"{op_label(node)} normalizes over the step dim"
    for extra in nodes_in((node.args[2:], {k: v for k, v in node.kwargs.items() if k != "input"})):
        if ctx.sd(extra) is not None:
            return None, f"{op_label(node)} weight depends on the step"
    return d, None


def conv(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
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
    keep = d if out is not None and out[d] == step_shape(x)[d] else None
    return keep, "convolution along the step axis"


def pad(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, pad = ctx.arg(0, "input"), ctx.arg(1, "pad")
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    if not isinstance(pad, (list, tuple)) or not all(isinstance(p, int) for p in pad):
        return None, "pad with unreadable amounts"
    k = len(s) - 1 - d  # pad pairs run from the last dim backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return None, "pad along the step dim"
    return d, None


def shift(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """``shift_steps(x, p, dim, value)``: time-local along another dim; a shift along the step dim mixes (with
    ``analyze(..., halo=True)`` it joins a region as a halo instead, see :class:`CausalConv`)."""
    x, dim = ctx.arg(0, "x"), ctx.arg(2, "dim")
    d = ctx.sd(x)
    if d is None:
        return None, None
    if not isinstance(dim, int):
        return None, "shift_steps with an unreadable dim"
    if norm_dim(dim, len(step_shape(x))) == d:
        return d, "shift along the step dim (a token shift: joins a region in exact mode only)"
    return d, None


def scan(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    a = scan_args(node)
    shp = ctx.out_shape
    if shp is None or not isinstance(a["dim"], int):
        return None, "linear_scan with unreadable arguments"
    dim = norm_dim(a["dim"], len(shp))
    if ctx.sd(a["h0"]) is not None:
        return dim, "linear_scan's h0 carries the step axis"
    for key in ("a", "b"):
        v = a[key]
        if ctx.sd(v) is None:
            vs = step_shape(v) if isinstance(v, fx.Node) else None
            if vs and len(vs) == len(shp) and vs[dim] != 1:
                return dim, f"linear_scan input {key} ({v.name}) is not tracked along the step axis (seed its source)"
            continue
        if ctx.sd(v) + len(shp) - len(step_shape(v)) != dim:
            return dim, f"linear_scan runs along dim {dim} but its input {key} carries the step axis elsewhere"
    if a["reverse"]:
        return dim, "reverse linear_scan: state flows from the last step to the first"
    return dim, None
