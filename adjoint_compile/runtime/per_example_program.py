"""A sharded region's program made per example, for ``per_sample_clip`` (runtime/sharded_ps.py runs it).

Every parameter p of the region becomes ``p + z_p``, z_p a zero [B, *p.shape] input: B copies of p, one per example,
on a new leading axis (made as p expanded, :func:`copies`: neither z_p nor the copies take memory). Ops on the
parameter values alone compute on the copies (element-wise ops, indexing and ops on the value's own axes shifted past
the copies' axis). Where a parameter value meets an example's value, the copies
are re-viewed as [B, 1, ..., *shape] against values that carry the examples on axis 0 (element-wise ops, a norm's
affine split off), or the op is made per example: a linear's weight or ``x @ W`` / ``W @ x`` as one batched matmul,
an embedding's table as a lookup in its B copies, a conv's weight as a conv grouped by example
(runtime/per_example_conv.py). On rows merged from [B, ..., d] with the examples first
([B·L, d]: ``h.flatten(0, 1) * g``, ``h.view(-1, d) @ W + b``) the op is made on the rows unflattened to [B, L, d].
The gradient of z_p is then each example's gradient of p.

    before:  y = linear(x, W)                  x: [B, L, d], W: [o, d]
    after:   y = matmul(x, (W + z).view(B, o, d).transpose(-1, -2))     z: [B, o, d], zeros

Where the examples are is followed from the region's inputs through the ops that move them (analysis/
batch_axes.py), never told by size: a [L, B, d] value of a shard of L = B steps has B at axis 0, and its steps are
not examples. Anything else raises :class:`NotExpandable`, and the caller falls back (masked VJPs, or a region that
ends before its loss).
"""
from __future__ import annotations

import heapq
import operator
import threading
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..analysis.batch_axes import followed_axes, permutation
from ..analysis.time_local import embedding_ids
from .first_order import untraced
from .per_example_conv import conv_with_copies
from .shard_program import ShardProgram

__all__ = ["NotExpandable", "expanded_program", "copies", "row_grads"]


class NotExpandable(Exception):
    """The region's parameters cannot be made per example in its program (why: the message)."""


#: ops a parameter may pass through before it meets the examples (an extra leading example axis changes nothing)
_CHAIN = frozenset("exp neg sigmoid tanh softplus log relu silu abs sqrt rsqrt reciprocal clamp float to".split())
#: element-wise ops where a parameter value meets an example's value (broadcasting from the right)
_MEET = frozenset("mul add sub truediv div".split())
_MEET_FNS = {operator.mul, operator.add, operator.sub, operator.truediv, torch.mul, torch.add, torch.sub, torch.div}


def _target_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def expanded_program(prog: ShardProgram, ps: Any, L: int, B: int) -> fx.GraphModule:
    """The L-step program with every parameter p replaced by ``p + z_p`` (z_p: a zero [B, *p.shape] input) and
    re-viewed as [B, 1, ..., *shape] where it meets the examples: the gradient of z_p is the per-example gradient
    of p, from one backward with the whole cotangents."""
    key = (L, B, ps.params)
    cache = prog.__dict__.setdefault("ps_expanded", {})
    if key in cache:
        return cache[key]
    gm = fx.GraphModule(prog.program(L), _copy_graph(prog.program(L)))
    gm.meta = {**getattr(gm, "meta", {}), "provenance": "adjoint_compile: shard program made per example"}
    g = gm.graph
    holders = [n for n in g.nodes if n.op == "placeholder"]
    axis = _example_axes(gm, holders, ps, B)
    last = holders[-1]
    zs = []
    for i in ps.params:
        with g.inserting_after(last):
            z = g.placeholder(f"per_example_{i}")
        last = z
        zs.append(z)
    chain: set[fx.Node] = set()
    done: set[fx.Node] = set()
    # NB: visited in graph order: a node with two parameter values (``W + W.T``) is reached after both are marked
    order = {n: k for k, n in enumerate(g.nodes)}
    todo = _Queue(order)
    for i, z in zip(ps.params, zs):
        p = holders[i]
        users = list(p.users)
        with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
            pb = g.call_function(copies, (p, z))
        pb.meta = dict(p.meta)  # NB: the parameter's shape: the re-views at the meeting points read it
        chain.add(pb)
        todo += users
        for u in users:
            u.replace_input_with(p, pb)
    while todo:
        u = todo.pop()
        name = _target_name(u)
        if u in chain or u in done:
            continue
        done.add(u)
        ins = [a for a in u.all_input_nodes]
        # NB: with more than one parameter value (a clamp's tensor bound), only values of one rank: their copies' axes
        # line up
        if all(a in chain for a in ins) and name in _CHAIN and u.op in ("call_function", "call_method") and \
                not u.kwargs.get("dim") and _same_rank(u):
            chain.add(u)
            todo += list(u.users)
            continue
        if u.target is operator.getitem and u.args[0] in chain and (idx := _example_index(u.args[1])) is not None:
            u.args = (u.args[0], idx)  # NB: the parameter value's copies come first: index after them
            chain.add(u)
            todo += list(u.users)
            continue
        if ins and all(a in chain for a in ins) and _param_op(u, B):
            chain.add(u)
            todo += list(u.users)
            continue
        out = u.meta.get("val", u.meta.get("example_value"))
        if (prod := _product(u, chain)) is not None:
            _batched_product(g, u, *prod, B, axis)
            continue
        if (why := conv_with_copies(g, u, chain, B, axis)) is None:
            continue
        if why:
            raise NotExpandable(why)
        if (m := embedding_ids(u)) is not None and m[1] in chain:
            if (y := _batched_embedding(g, u, chain, m, B, axis)) is not None:  # a table of the copies' own rows
                chain.add(y)
                order[y] = order[u]
                todo += list(y.users)
            continue
        if (inner := _unmerged(g, u, chain, B, axis)) is not None:
            order[inner] = order[u]
            u, out = inner, _val(inner)
            ins = [a for a in u.all_input_nodes]
        if not isinstance(out, Tensor) or out.dim() == 0 or int(out.shape[0]) != B or axis(u) != 0:
            raise NotExpandable(f"{u.name}: its output does not carry the examples on axis 0")
        if u.target in _NORMS and u.args[0] not in chain and not u.kwargs:
            old, u = u, _split_affine(g, u, chain)
            axis.same(u, old)
            ins = [a for a in u.all_input_nodes]
        elif name not in _MEET or not (u.op == "call_method" or u.target in _MEET_FNS) or len(u.args) != 2:
            raise NotExpandable(f"{u.name} ({name}) uses a parameter value")
        for a in ins:
            if a in chain:
                pv = a.meta.get("val", a.meta.get("example_value"))
                shape = list(pv.shape) if isinstance(pv, Tensor) else []
                while len(shape) > out.dim() - 1 and shape[0] == 1:
                    shape.pop(0)  # NB: a leading axis of 1 (``D[None, :, None]``) is broadcast over the examples
                if out.dim() - 1 < len(shape):
                    raise NotExpandable(f"{u.name}: the parameter value has more axes than an example")
                with g.inserting_before(u):
                    v = g.call_method("view", (a, B, *([1] * (out.dim() - 1 - len(shape))), *shape))
                u.replace_input_with(a, v)
    g.lint()
    gm.recompile()
    cache[key] = gm
    return gm


_LINEARS = (torch.nn.functional.linear, torch._C._nn.linear)
_NORMS = {torch.rms_norm: 2, torch.nn.functional.rms_norm: 2, torch.layer_norm: 3, torch.nn.functional.layer_norm: 3}


def _split_affine(g: fx.Graph, u: fx.Node, chain: set[fx.Node]) -> fx.Node:
    """``norm(x, shape, w, [b,] eps)`` -> ``norm(x, shape, None, [None,] eps) * w (+ b)``; returns the node whose
    inputs are the parameter values (the caller re-views them)."""
    n_aff = _NORMS[u.target] - 1
    args = list(u.args) + [None] * (2 + n_aff + 1 - len(u.args))
    w, b = args[2], args[3] if n_aff == 2 else None
    if any(a is not None and a not in chain for a in (w, b)):
        raise NotExpandable(f"{u.name}: a norm's affine mixes parameters and examples")
    with g.inserting_before(u):
        # NB: the arguments given after the affine ones only: a missing eps keeps its default
        plain = g.call_function(u.target, (args[0], args[1], None, *([None] if n_aff == 2 else []),
                                           *u.args[2 + n_aff:]))
        out = plain if w is None else g.call_function(operator.mul, (plain, w))
        if b is not None:
            out = g.call_function(operator.add, (out, b))
    for m in (plain, out):
        m.meta = dict(u.meta)
    u.replace_all_uses_with(out)
    g.erase_node(u)
    if b is not None and w is not None:  # NB: two meeting nodes: re-view w in the product here, b by the caller
        mul = out.args[0]
        pv = w.meta.get("val", w.meta.get("example_value"))
        o = u.meta.get("val", u.meta.get("example_value"))
        with g.inserting_before(mul):
            v = g.call_method("view", (w, o.shape[0], *([1] * (o.dim() - 1 - pv.dim())), *list(pv.shape)))
        mul.replace_input_with(w, v)
    return out


def _product(u: fx.Node, chain: set[fx.Node]) -> tuple[fx.Node, fx.Node, Any, bool] | None:
    """``(x, W, b, transposed)`` when ``u`` applies a parameter value W to an example value x: ``linear(x, W, b)``
    (transposed True), ``x @ W`` (False) or ``W @ x`` (None); else None."""
    if u.target in _LINEARS:
        args = list(u.args) + [u.kwargs.get("bias")] * (3 - len(u.args))
        if set(u.kwargs) - {"bias"} or len(u.args) > 3:
            raise NotExpandable(f"{u.name}: a linear with arguments it cannot follow")
        x, w, b, t = *args[:3], True
    elif (u.target in (operator.matmul, torch.matmul, torch.mm) or u.op == "call_method" and _target_name(u) in (
            "matmul", "mm")) and \
            len(u.args) == 2 and not u.kwargs:
        (x, w), b, t = u.args, None, False
        if w not in chain and x in chain:  # NB: W @ x (transformers' Mamba: dt_proj.weight @ time_step.T)
            (w, x), t = u.args, None
    else:
        return None
    if x in chain or w not in chain or (b is not None and b not in chain):
        return None if w not in chain and b not in chain else _refuse_product(u)
    return x, w, b, t


def _refuse_product(u: fx.Node) -> None:
    raise NotExpandable(f"{u.name}: a product of two parameter values, or an example value as its weight")


def _batched_product(g: fx.Graph, u: fx.Node, x: fx.Node, w: fx.Node, b: Any, transposed: bool | None,
                     B: int, axis: Any) -> None:
    """``linear(x, W, b)``, ``x @ W`` or ``W @ x`` with W (and b) per example: ``x @ W_n^T + b_n`` as one batched
    matmul. When x's rows are those of a [B, ..., d] value merged (a head on flattened rows, the examples first), on
    that value."""
    out, wv, xv = _val(u), _val(w), _val(x)
    # NB: rows with the examples as the outermost factor of their axis 0 (merged from [B, ..., d] row-major,
    # analysis/batch_axes.py): viewed as [B, rows / B, d], each example's rows are its own block
    rows = x if transposed is not None and isinstance(xv, Tensor) and xv.dim() >= 2 and axis(x) == 0 and \
        int(xv.shape[0]) % B == 0 and (int(xv.shape[0]) != B or xv.dim() == 2) else None
    if not isinstance(wv, Tensor) or wv.dim() != 2 or out.dim() < (2 if rows is not None else 3) or (
            rows is None and (int(out.shape[0]) != B or axis(x) != 0 or axis(u) != 0)):
        raise NotExpandable(f"{u.name}: a product with a parameter matrix whose rows are not the examples'")
    dim = 3 if rows is not None else out.dim()
    pad = [1] * (dim - 3)
    with g.inserting_before(u):
        if rows is not None:
            x = g.call_method("reshape", (rows, B, -1, _val(rows).shape[-1]))
        wt = g.call_method("view", (w, B, *pad, *wv.shape))
        if transposed:
            wt = g.call_method("transpose", (wt, -1, -2))
        y = g.call_function(torch.matmul, (x, wt) if transposed is not None else (wt, x))
        if b is not None:
            y = g.call_function(operator.add, (y, g.call_method("view", (b, B, *pad, 1, _val(b).shape[0]))))
        if rows is not None:
            y = g.call_method("reshape", (y, *out.shape))
    y.meta = dict(u.meta)
    axis.same(y, u)
    u.replace_all_uses_with(y)
    g.erase_node(u)


def _val(n: fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def _example_axes(gm: fx.GraphModule, holders: list[fx.Node], ps: Any, B: int) -> Any:
    """``axis(n)``: the axis of the examples in the program's value n, followed from the region's inputs and carries
    through the ops that move it (analysis/batch_axes.py); None for a value without them or where it is lost. NB: not
    the size alone: a [L, B, d] value of a shard whose length L is B has B at axis 0, and its steps are not examples."""
    if len(ps.in_bdims) + len(ps.carry_bdims) > len(holders):
        raise NotExpandable("the region's inputs do not match its program")
    seeds: dict[fx.Node, int | None] = {}
    for n, k in zip(holders, ps.in_bdims):
        if k is not None:
            seeds[n] = None if k < 0 else k
    for n, k in zip(holders[len(ps.in_bdims):], ps.carry_bdims):
        seeds[n] = k
    acts, moved = followed_axes(gm, seeds, 0, B)
    return _Axes(acts, moved)


class _Queue:
    """The nodes to visit, the earliest in graph order first (``order``; nodes made later take their original's)."""

    def __init__(self, order: dict[fx.Node, int]) -> None:
        self.order, self.heap, self.k = order, [], 0

    def __iadd__(self, nodes: Any) -> "_Queue":
        for n in nodes:
            self.k += 1
            heapq.heappush(self.heap, (self.order.get(n, len(self.order)), self.k, n))
        return self

    def __bool__(self) -> bool:
        return bool(self.heap)

    def pop(self) -> fx.Node:
        return heapq.heappop(self.heap)[2]


class _Axes:
    """``axes(n)``: the examples' axis of value n (None: none, or lost); ``axes.same(new, old)``: a node made in
    old's place has old's."""

    def __init__(self, acts: set[fx.Node], moved: dict[fx.Node, int | None]) -> None:
        self.acts, self.moved = acts, moved

    def __call__(self, n: Any) -> int | None:
        return self.moved.get(n, 0) if n in self.acts else None

    def same(self, new: fx.Node, old: fx.Node) -> None:
        if old in self.acts:
            self.acts.add(new)
            if old in self.moved:
                self.moved[new] = self.moved[old]


#: element-wise ops among parameter values (and numbers): the same ranks, so their copies' axes line up
_AMONG = frozenset("mul add sub truediv div pow".split())
_AMONG_FNS = {*_MEET_FNS, operator.pow, torch.pow}
#: ops on a parameter value's own axes besides permutations, shifted past its copies' leading axis
_AXES = frozenset("unsqueeze squeeze view reshape".split())
_AXES_FNS = (torch.unsqueeze, torch.squeeze, torch.reshape)


def _same_rank(u: fx.Node) -> bool:
    out = _val(u)
    return isinstance(out, Tensor) and all(isinstance(_val(a), Tensor) and _val(a).dim() == out.dim()
                                           for a in u.all_input_nodes)


def _param_op(u: fx.Node, B: int) -> bool:
    """Whether ``u``, whose tensor inputs are all parameter values (each [B, *shape] in the program made per example),
    can compute on the copies: element-wise among values of one rank, ``detach``, or an op on the value's own axes
    (rewritten in place to skip the copies' axis); False leaves it to the caller (a meeting with the examples, or
    not expandable)."""
    name = _target_name(u)
    out = _val(u)
    if u.op not in ("call_function", "call_method") or not isinstance(out, Tensor):
        return False
    if name == "detach":
        return True
    if name in _AMONG and (u.op == "call_method" or u.target in _AMONG_FNS) and not u.kwargs:
        return _same_rank(u)
    if (perm := permutation(u)) is not None:  # NB: t, .T, .mT, transpose, permute, movedim: after the copies' axis
        args, name = (u.args[0], 0, *(k + 1 for k in perm)), "permute"
    elif name not in _AXES or u.kwargs or (u.op == "call_function" and u.target not in _AXES_FNS):
        return False
    else:
        x, rest = u.args[0], list(u.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
            rest = list(rest[0])
        if not rest or not all(isinstance(d, int) and not isinstance(d, bool) for d in rest):
            return False
        if name == "unsqueeze" and len(rest) == 1:
            args = (x, rest[0] % (_val(x).dim() + 1) + 1)
        elif name == "squeeze" and len(rest) == 1:  # NB: one named axis: a bare squeeze would drop B = 1 copies
            args = (x, rest[0] % _val(x).dim() + 1)
        elif name in ("view", "reshape"):
            # NB: reshape: the copies of a value that was a contiguous view (``W[0]``) need not be one
            args, name = (x, B, *rest), "reshape"
        else:
            return False
    u.op, u.target, u.args, u.kwargs = "call_method", name, args, {}
    return True


def _example_index(idx: Any) -> tuple | None:
    """``idx`` (a parameter value's index: ints, slices, None, ...) for its B copies on a new leading axis, or None
    when it holds anything else (a tensor)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items):
        return None
    if isinstance(idx, slice) and idx == slice(None) or items and items[0] is Ellipsis:
        return idx
    return (slice(None), *items)


def _rank_past_ones(v: Any) -> int:
    """The rank of ``v`` without its leading axes of size 1 (they broadcast over anything)."""
    shape = list(v.shape) if isinstance(v, Tensor) else []
    while shape and shape[0] == 1:
        shape.pop(0)
    return len(shape)


def _unmerged(g: fx.Graph, u: fx.Node, chain: set[fx.Node], B: int, axis: Any) -> fx.Node | None:
    """When ``u`` applies parameter values to each row of a value with the examples as the outermost factor of its
    axis 0 (rows merged row-major: ``h.flatten(0, 1) * g``, ``(h.view(-1, d) @ W) + b``, a norm on merged rows; the
    parameters stop short of that axis), ``u`` made on the value unflattened to [B, rows / B, ...] and flattened after
    (the same value, the examples first): the new node, which meets the parameters."""
    norm = u.target in _NORMS
    if u.kwargs or not (norm or _target_name(u) in _MEET and (u.op == "call_method" or u.target in _MEET_FNS)):
        return None
    rows = next((a for a in u.all_input_nodes if a not in chain), None)
    out, rv = _val(u), _val(rows) if rows is not None else None
    if not (isinstance(out, Tensor) and isinstance(rv, Tensor) and axis(rows) == 0 and rv.dim() >= 1 and
            out.shape == rv.shape and int(rv.shape[0]) != B and int(rv.shape[0]) % B == 0):
        return None
    if norm and (u.args[0] is not rows or len(u.args[1]) >= out.dim()) or \
            any(a in chain and _rank_past_ones(_val(a)) >= out.dim() for a in u.all_input_nodes):
        return None  # NB: a parameter value reaching the rows' axis pairs each row with its own entry
    with g.inserting_before(u):
        x = g.call_method("unflatten", (rows, 0, (B, -1)))
        inner = g.node_copy(u, lambda a: x if a is rows else a)
        y = g.call_method("flatten", (inner, 0, 1))
    shape = (B, int(rv.shape[0]) // B, *rv.shape[1:])
    for m, like in ((x, rv), (inner, out)):
        m.meta = {**u.meta, **{k: like.new_empty(shape) for k in ("val", "example_value") if k in u.meta}}
        axis.same(m, rows)
    y.meta = dict(u.meta)
    axis.same(y, u)
    u.replace_all_uses_with(y)
    g.erase_node(u)
    return inner


class _Copies(torch.autograd.Function):
    """``p + z`` for a zero z [B, *p.shape], without making it: p expanded over the copies' axis (no memory), and
    z's gradient is the cotangent itself (each example's gradient of p)."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, z: Tensor) -> Tensor:
        return p.expand(z.shape)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor]:
        return (g.sum(0) if ctx.needs_input_grad[0] else None), g


def copies(p: Tensor, z: Tensor) -> Tensor:
    """The B copies of the parameter value p ([B, *p.shape], read-only): z's gradient is each copy's."""
    return _Copies.apply(p, z)


#: per backward under way (runtime/sharded_ps.py), the lookups' row gradients: (z, ids, g) each
_ROWS = threading.local()


class _Lookup(torch.autograd.Function):
    """``embedding(ids, p)`` read from the examples' copies of p (each example's rows from its own copy, all equal
    to p). Its backward hands z's gradient over as rows, (z, ids [B, ...], g [B, ..., d]), to the backward under way
    (:func:`row_grads`) instead of a [B, V, d] tensor that is mostly zeros."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, z: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.z = z
        return torch.nn.functional.embedding(ids, p)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        sink = getattr(_ROWS, "sink", None)
        if sink is None:
            raise RuntimeError("adjoint-compile per_sample_clip: an example lookup differentiated outside the region's "
                               "backward")
        sink.append((ctx.z, ids, g))
        return None, None, None


def example_lookup(p: Tensor, z: Tensor, ids: Tensor) -> Tensor:
    return _Lookup.apply(p, z, ids)


class row_grads:
    """``with row_grads() as rows:`` the example lookups' gradients of the backward run inside, as (z, ids, g)."""

    def __enter__(self) -> list:
        self.prev = getattr(_ROWS, "sink", None)
        _ROWS.sink = []
        return _ROWS.sink

    def __exit__(self, *exc: Any) -> None:
        _ROWS.sink = self.prev


def _examples_of(ids: Tensor) -> Tensor:
    """[B, 1, ...]: example n's index on the copies' axis, against ``ids`` [B, ...]."""
    return torch.arange(ids.shape[0], device=ids.device).view(-1, *([1] * (ids.dim() - 1)))


def _batched_embedding(g: fx.Graph, u: fx.Node, chain: set[fx.Node], m: tuple[fx.Node, fx.Node], B: int,
                       axis: Any) -> fx.Node | None:
    """``embedding(ids, W)`` with W per example ([B, V, d]): each example's rows looked up in its own copy; a
    padding index's rows get no gradient, as in ``embedding``. Indices without the examples (positions,
    ``pos(arange(T))``) look up every copy alike: the result is a parameter value's copies, returned (else None)."""
    ids, w = m
    pad = ({**dict(zip(("input", "weight", "padding_idx"), u.args)), **u.kwargs} if u.target is not torch.embedding
           else dict(zip(("weight", "input", "padding_idx"), u.args))).get("padding_idx")
    if u.target is torch.embedding and pad == -1:  # NB: its -1 means none (F.embedding's -1 is row V - 1)
        pad = None
    iv, wv = _val(ids), _val(w)
    shared = ids not in chain and axis(ids) is None
    if w not in chain or not isinstance(iv, Tensor) or not isinstance(wv, Tensor) or wv.dim() != 2 or not shared and (
            axis(ids) != 0 or iv.dim() == 0 or int(iv.shape[0]) != B):
        raise NotExpandable(f"{u.name}: an embedding that is not a lookup of the examples' indices in a parameter")
    V = int(wv.shape[0])
    with g.inserting_before(u):
        if shared:
            y = g.call_function(operator.getitem, (w, (slice(None), ids)))
        elif w.target is copies:  # NB: every copy is p: its rows, their gradients handed over as rows
            y = g.call_function(example_lookup, (*w.args, ids))
        else:
            # NB: rows of each example's own copy, read in place (the copies are one table expanded, never made)
            y = g.call_function(operator.getitem, (w, (g.call_function(_examples_of, (ids,)), ids)))
        if pad is not None:
            keep = g.call_method("unsqueeze", (g.call_function(operator.eq, (ids, pad % V)), -1))
            y = g.call_function(torch.where, (keep, g.call_method("detach", (y,)), y))
    y.meta = dict(u.meta)
    axis.same(y, u)
    u.replace_all_uses_with(y)
    g.erase_node(u)
    return y if shared else None


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return g
