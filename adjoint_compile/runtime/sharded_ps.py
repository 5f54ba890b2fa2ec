"""Per-example parameter gradients inside a sharded region (``per_sample_clip`` with the exact adjoint; issue 14).

Each shard's backward recomputes the shard once with every parameter p made per example: p + z_p with z_p a zero
[B, *p.shape] input, re-viewed as [B, 1, ..., *p.shape] where it meets the examples (element-wise ops, a norm's
affine, a linear's weight or ``x @ W`` as one batched matmul, also on rows merged from [B, ..., d] with the examples
first, an embedding's table as a lookup in its B copies): one backward with the whole cotangents gives the gradient
of z_p, the per-example gradients of p (examples do not interact inside a region: batch-mixing ops are refused by
passes/lower/per_sample.py), and the shard's pullback to its inputs and carries, so it is the shard's only backward.
The [B, *p.shape] gradients are summed over the shards (the direct form adds up over shards; the Gram form would
not), so nothing of length T is kept, and handed to runtime/per_sample.py as one :class:`~.per_sample.DirectRecord`
per parameter.

A loss the region takes in is a scalar summed over the examples too: its cotangent is one number, and the expanded
parameters alone tell the examples' parts apart, so such a region must expand (:func:`expandable_reason`, checked
by the lowering, which otherwise ends the region before the loss).

A region whose parameters meet the examples any other way (the rewrite is checked op by op; :class:`_NotExpandable`)
takes masked VJPs instead: per example n, the cotangents masked to example n, one backward each (B backward passes
of the shard). NB: not ``torch.func.vmap`` over the examples: the shard programs are specialized to the batch size
(a ``reshape(B, L, D*N)`` in the region). ``EXAMPLES_PER_VJP`` > 1 batches the masked VJPs (``is_grads_batched``);
on CPU that was not faster and cost memory, so the default is one VJP per example.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..analysis.batch_axes import moved_batch_axes
from ..analysis.time_local import embedding_ids
from .per_sample import DirectRecord, Site, _record
from .shard_parts import differentiable
from .shard_program import ShardProgram, autocast_as

log = logging.getLogger(__name__)

__all__ = ["PerSampleRegion", "per_example_param_grads", "record_region"]


@dataclasses.dataclass(eq=False)
class PerSampleRegion:
    """How a sharded region takes part in per-example clipping (set by passes/lower/per_sample.py)."""

    #: the region inputs that are parameters (their gradients are per example, recorded, not returned)
    params: tuple[int, ...]
    #: per region output and per scan state, the axis of the examples (batch_dim, moved by a scan's step axis); None
    #: for an output summed over the examples too (the loss taken into the region)
    out_bdims: tuple[int | None, ...]
    carry_bdims: tuple[int, ...]
    site: Site | None = None
    #: the number of examples
    batch: int = 0
    #: per output without the examples' axis, its per-example kind (passes/lower/per_sample.py): "R", a sum of
    #: per-example terms made from parameters (the loss), or "D", a constant of the gradient (a count of targets)
    loss_kinds: dict[int, str] = dataclasses.field(default_factory=dict)
    #: the bytes of the parameters' per-example gradients (B copies): the least activations of a shard
    #: (runtime/shard_parts.py), whose expanded recompute makes and sums that many every time
    example_bytes: int = 0
    #: per region input, the axis of the examples (None: an input without them, a parameter or a constant; -1: on an
    #: axis a permutation lost), followed through the program made per example (analysis/batch_axes.py)
    in_bdims: tuple[int | None, ...] = ()


def per_example_param_grads(prog: ShardProgram, ps: PerSampleRegion, L: int, xs: Sequence[Any],
                            carries: Sequence[Any], first_shard: bool, gos: Sequence[Any], adjs: Sequence[Any],
                            t0: int, autocast: tuple, needs_x: Sequence[bool] = (),
                            needs_c: Sequence[bool] = ()) -> tuple[dict[int, Tensor], Any]:
    """Per parameter input i of the region, its [B, *p.shape] per-example gradient over this shard; and, when the
    parameters were expanded (one backward for everything), the shard's VJP as :meth:`ShardProgram.vjp` gives it
    (grads of the inputs with ``needs_x``, of the carries with ``needs_c``), else None."""
    want = [i for i in ps.params if isinstance(xs[i], Tensor)]
    if not want:
        return {}, None
    # NB: kept on the program: ``ps`` is a fresh copy per call (the parameters wanted this time)
    summed = any(d is None for d in ps.out_bdims)
    if (_EXPANDED[0] or summed) and getattr(prog, "ps_expandable", None) is not False:
        # NB: the expanded program is the region's own with p + 0: its pullback to the inputs and carries is the
        # shard's VJP, so the shard needs no other backward (the cotangents scaled as the VJP scales them)
        wrt_x = [i for i, n in enumerate(needs_x) if n and i not in ps.params and differentiable(xs[i])]
        wrt_c = [j for j, n in enumerate(needs_c) if n and differentiable(carries[j])]
        try:
            got = _expanded_grads(prog, ps, L, xs, carries, first_shard, prog._mean_scaled(gos), adjs, t0, autocast,
                                  want, wrt_x, wrt_c)
        except _NotExpandable as e:
            if summed:  # NB: expandable_reason() let the region take in its loss: every length's program expands
                raise RuntimeError(f"adjoint-compile per_sample_clip: the region's loss cannot be split by example "
                                   f"at {L} steps ({e}); please report the model") from e
            prog.ps_expandable = False
            log.info("per_sample_clip: region parameters not expandable per example (%s); masked VJPs", e)
        else:
            prog.ps_expandable = True
            return got if (needs_x or needs_c) else (got[0], None)
    with torch.enable_grad():
        x_in = [x.detach().requires_grad_(i in want) if isinstance(x, Tensor) else x for i, x in enumerate(xs)]
        cs = [None if c is None else c.detach() for c in carries]
        prevs = [None if first_shard else cs[k] for k in prog.shift_scans]
        with autocast_as(autocast):
            res = prog.program(L)(*x_in, *cs, *prevs, *prog._offset(t0))
        pairs = [(y, g, d) for y, g, d in zip(res, [*gos, *adjs], [*ps.out_bdims, *ps.carry_bdims])
                 if g is not None and y.requires_grad]
        wrt = [x_in[i] for i in want]
        if not pairs:
            return {}, None
        B = pairs[0][0].shape[pairs[0][2]]
        ys = [y for y, _, _ in pairs]
        step = EXAMPLES_PER_VJP if _BATCHED[0] else 1
        parts: list[tuple[int, tuple[Tensor | None, ...]]] = []
        n0 = 0
        while n0 < B:
            n1 = min(B, n0 + step)
            last = n1 == B
            if step > 1:
                # NB: one backward vmapped over the masked cotangents of examples n0..n1 (is_grads_batched): the
                # arithmetic of n1 - n0 backward passes without as many trips through the autograd engine
                cots = [_one_hot(g, d, n0, n1) for _, g, d in pairs]
                try:
                    # NB: retain_graph: a backward that failed half-way must leave the graph for the fallback
                    got = torch.autograd.grad(ys, wrt, cots, retain_graph=True, allow_unused=True,
                                              is_grads_batched=True)
                except RuntimeError as e:  # an op of the region without a batching rule for its backward
                    _BATCHED[0], step = False, 1
                    log.info("per_sample_clip: batched VJP over the examples failed (%s); one VJP per example", e)
                    continue
            else:
                got = tuple(None if g is None else g.unsqueeze(0) for g in torch.autograd.grad(
                    ys, wrt, [_one_hot(g, d, n0, n1)[0] for _, g, d in pairs], retain_graph=not last,
                    allow_unused=True))
            parts.append((n1 - n0, got))
            n0 = n1
    out = {}
    for k, (i, w) in enumerate(zip(want, wrt)):
        chunks = [got[k] if got[k] is not None else w.new_zeros((m, *w.shape)) for m, got in parts]
        out[i] = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    return out, None


class _NotExpandable(Exception):
    pass


#: ops a parameter may pass through before it meets the examples (an extra leading example axis changes nothing)
_CHAIN = frozenset("exp neg sigmoid tanh softplus log relu silu abs sqrt rsqrt reciprocal clamp float to".split())
#: element-wise ops where a parameter value meets an example's value (broadcasting from the right)
_MEET = frozenset("mul add sub truediv div".split())
_MEET_FNS = {operator.mul, operator.add, operator.sub, operator.truediv, torch.mul, torch.add, torch.sub, torch.div}


def _target_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def expandable_reason(prog: ShardProgram, ps: PerSampleRegion, L: int) -> str:
    """Why the region's parameters cannot be made per example in its ``L``-step program ("" when they can). A region
    whose loss sums over the examples needs that: its masked VJPs could not tell the examples apart."""
    if any(d not in (0, None) for d in (*ps.out_bdims, *ps.carry_bdims)):
        return "the examples are not on axis 0"
    try:
        _expanded_program(prog, ps, L, ps.batch)
    except _NotExpandable as e:
        return str(e)
    return ""


def _expanded_program(prog: ShardProgram, ps: PerSampleRegion, L: int, B: int) -> fx.GraphModule:
    """The L-step program with every parameter p replaced by ``p + z_p`` (z_p: a zero [B, *p.shape] input) and
    re-viewed as [B, 1, ..., *shape] where it meets the examples: the gradient of z_p is the per-example gradient
    of p, from one backward with the whole cotangents."""
    key = (L, B, ps.params)
    cache = prog.__dict__.setdefault("ps_expanded", {})
    if key in cache:
        return cache[key]
    gm = fx.GraphModule(prog.program(L), _copy_graph(prog.program(L)))
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
    todo: list[fx.Node] = []
    for i, z in zip(ps.params, zs):
        p = holders[i]
        users = list(p.users)
        with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
            pb = g.call_function(operator.add, (p, z))
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
        if all(a in chain for a in ins) and name in _CHAIN and u.op in ("call_function", "call_method") and \
                not u.kwargs.get("dim"):
            chain.add(u)
            todo += list(u.users)
            continue
        if u.target is operator.getitem and u.args[0] in chain and (idx := _example_index(u.args[1])) is not None:
            u.args = (u.args[0], idx)  # NB: the parameter value's copies come first: index after them
            chain.add(u)
            todo += list(u.users)
            continue
        out = u.meta.get("val", u.meta.get("example_value"))
        if (prod := _product(u, chain)) is not None:
            _batched_product(g, u, *prod, B, axis)
            continue
        if (m := embedding_ids(u)) is not None and m[1] in chain:
            _batched_embedding(g, u, chain, m, B, axis)
            continue
        if not isinstance(out, Tensor) or out.dim() == 0 or int(out.shape[0]) != B or axis(u) != 0:
            raise _NotExpandable(f"{u.name}: its output does not carry the examples on axis 0")
        if u.target in _NORMS and u.args[0] not in chain and not u.kwargs:
            u = _split_affine(g, u, chain)
            ins = [a for a in u.all_input_nodes]
        elif name not in _MEET or not (u.op == "call_method" or u.target in _MEET_FNS) or len(u.args) != 2:
            raise _NotExpandable(f"{u.name} ({name}) uses a parameter value")
        for a in ins:
            if a in chain:
                pv = a.meta.get("val", a.meta.get("example_value"))
                shape = list(pv.shape) if isinstance(pv, Tensor) else []
                while len(shape) > out.dim() - 1 and shape[0] == 1:
                    shape.pop(0)  # NB: a leading axis of 1 (``D[None, :, None]``) is broadcast over the examples
                if out.dim() - 1 < len(shape):
                    raise _NotExpandable(f"{u.name}: the parameter value has more axes than an example")
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
        raise _NotExpandable(f"{u.name}: a norm's affine mixes parameters and examples")
    with g.inserting_before(u):
        # NB: the arguments given after the affine ones only: a missing eps keeps its default
        plain = g.call_function(u.target, (args[0], args[1], None, *([None] if n_aff == 2 else []), *u.args[2 + n_aff:]))
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
            raise _NotExpandable(f"{u.name}: a linear with arguments it cannot follow")
        x, w, b, t = *args[:3], True
    elif (u.target in (operator.matmul, torch.matmul) or u.op == "call_method" and _target_name(u) == "matmul") and \
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
    raise _NotExpandable(f"{u.name}: a product of two parameter values, or an example value as its weight")


def _batched_product(g: fx.Graph, u: fx.Node, x: fx.Node, w: fx.Node, b: Any, transposed: bool | None,
                     B: int, axis: Any) -> None:
    """``linear(x, W, b)``, ``x @ W`` or ``W @ x`` with W (and b) per example: ``x @ W_n^T + b_n`` as one batched
    matmul. When
    x's rows are those of a [B, ..., d] value merged (a head on flattened rows, the examples first), on that value."""
    out, wv = _val(u), _val(w)
    rows = _merged_rows(x, B, axis) if transposed is not None else None
    if not isinstance(wv, Tensor) or wv.dim() != 2 or out.dim() < (2 if rows is not None else 3) or (
            rows is None and (int(out.shape[0]) != B or axis(x) != 0 or axis(u) != 0)):
        raise _NotExpandable(f"{u.name}: a product with a parameter matrix whose rows are not the examples'")
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
    u.replace_all_uses_with(y)
    g.erase_node(u)


def _val(n: fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def _example_axes(gm: fx.GraphModule, holders: list[fx.Node], ps: PerSampleRegion, B: int) -> Any:
    """``axis(n)``: the axis of the examples in the program's value n, followed from the region's inputs and carries
    through the ops that move it (analysis/batch_axes.py); None for a value without them or where it is lost. NB: not
    the size alone: a [L, B, d] value of a shard whose length L is B has B at axis 0, and its steps are not examples."""
    if len(ps.in_bdims) + len(ps.carry_bdims) > len(holders):
        raise _NotExpandable("the region's inputs do not match its program")
    seeds: dict[fx.Node, int | None] = {}
    for n, k in zip(holders, ps.in_bdims):
        if k is not None:
            seeds[n] = None if k < 0 else k
    for n, k in zip(holders[len(ps.in_bdims):], ps.carry_bdims):
        seeds[n] = k
    acts = set(seeds)
    for n in gm.graph.nodes:
        if n.op != "placeholder" and any(a in acts for a in n.all_input_nodes):
            acts.add(n)
    moved = moved_batch_axes(gm, acts, 0, B, seeds)
    return lambda n: (moved.get(n, 0) if n in acts else None)


def _example_index(idx: Any) -> tuple | None:
    """``idx`` (a parameter value's index: ints, slices, None, ...) for its B copies on a new leading axis, or None
    when it holds anything else (a tensor)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items):
        return None
    if isinstance(idx, slice) and idx == slice(None) or items and items[0] is Ellipsis:
        return idx
    return (slice(None), *items)


def _merged_rows(x: Any, B: int, axis: Any) -> fx.Node | None:
    """The [B, ..., d] value whose leading axes ``x`` ([rows, d]) merges (``view(-1, d)``, ``flatten(0, 1)``,
    ``reshape``), the examples first, so each example's rows are one block; else None."""
    if not (isinstance(x, fx.Node) and x.op in ("call_method", "call_function") and _target_name(x) in _MERGES and
            x.args and isinstance(x.args[0], fx.Node)):
        return None
    src, v, xv = x.args[0], _val(x.args[0]), _val(x)
    if not (axis(src) == 0 and isinstance(v, Tensor) and isinstance(xv, Tensor) and xv.dim() == 2 and v.dim() >= 3 and
            int(v.shape[0]) == B and xv.shape[1] == v.shape[-1] and xv.shape[0] == v.numel() // v.shape[-1]):
        return None
    return src


_MERGES = frozenset("view reshape flatten".split())


def _example_rows(ids: Tensor, V: int) -> Tensor:
    """``ids`` [B, ...] moved to example n's copy of a [V, d] table: rows of the [B·V, d] table the copies make."""
    off = torch.arange(ids.shape[0], device=ids.device, dtype=ids.dtype) * V
    return ids + off.view(-1, *([1] * (ids.dim() - 1)))


def _batched_embedding(g: fx.Graph, u: fx.Node, chain: set[fx.Node], m: tuple[fx.Node, fx.Node], B: int,
                       axis: Any) -> None:
    """``embedding(ids, W)`` with W per example ([B, V, d]): a lookup in the [B·V, d] table of the examples'
    copies; a padding index's rows get no gradient, as in ``embedding``."""
    ids, w = m
    pad = ({**dict(zip(("input", "weight", "padding_idx"), u.args)), **u.kwargs} if u.target is not torch.embedding
           else dict(zip(("weight", "input", "padding_idx"), u.args))).get("padding_idx")
    if u.target is torch.embedding and pad == -1:  # NB: its -1 means none (F.embedding's -1 is row V - 1)
        pad = None
    iv, wv = _val(ids), _val(w)
    if w not in chain or axis(ids) != 0 or not isinstance(iv, Tensor) or iv.dim() == 0 or int(iv.shape[0]) != B or \
            not isinstance(wv, Tensor) or wv.dim() != 2:
        raise _NotExpandable(f"{u.name}: an embedding that is not a lookup of the examples' indices in a parameter")
    V, d = (int(s) for s in wv.shape)
    with g.inserting_before(u):
        table = g.call_method("reshape", (w, B * V, d))
        y = g.call_function(torch.nn.functional.embedding, (g.call_function(_example_rows, (ids, V)), table))
        if pad is not None:
            keep = g.call_method("unsqueeze", (g.call_function(operator.eq, (ids, pad % V)), -1))
            y = g.call_function(torch.where, (keep, g.call_method("detach", (y,)), y))
    y.meta = dict(u.meta)
    u.replace_all_uses_with(y)
    g.erase_node(u)


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return g


def _expanded_grads(prog: ShardProgram, ps: PerSampleRegion, L: int, xs: Sequence[Any], carries: Sequence[Any],
                    first_shard: bool, gos: Sequence[Any], adjs: Sequence[Any], t0: int, autocast: tuple,
                    want: list[int], wrt_x: list[int], wrt_c: list[int]) -> tuple[dict[int, Tensor], Any]:
    if ps.out_bdims and any(d not in (0, None) for d in (*ps.out_bdims, *ps.carry_bdims)):
        raise _NotExpandable("the examples are not on axis 0")
    B = ps.batch or next(g.shape[0] for g, d in zip([*gos, *adjs], [*ps.out_bdims, *ps.carry_bdims])
                         if g is not None and d is not None)
    gm = _expanded_program(prog, ps, L, B)
    with torch.enable_grad():
        x_in = [x.detach().requires_grad_(i in wrt_x) if isinstance(x, Tensor) else x for i, x in enumerate(xs)]
        zs = [torch.zeros(B, *x_in[i].shape, dtype=x_in[i].dtype, device=x_in[i].device, requires_grad=i in want)
              for i in ps.params]
        cs = [None if c is None else c.detach().requires_grad_(j in wrt_c) for j, c in enumerate(carries)]
        prevs = [None if first_shard else cs[k] for k in prog.shift_scans]
        with autocast_as(autocast):
            res = gm(*x_in, *cs, *prevs, *prog._offset(t0), *zs)
        pairs = [(y, g) for y, g in zip(res, [*gos, *adjs]) if g is not None and y.requires_grad]
        wrt = [z for i, z in zip(ps.params, zs) if i in want]
        if not pairs:
            return {}, None
        got = torch.autograd.grad([y for y, _ in pairs], [*wrt, *(x_in[i] for i in wrt_x), *(cs[j] for j in wrt_c)],
                                  [g for _, g in pairs], allow_unused=True)
    gx: list[Any] = [None] * len(xs)
    gc: list[Any] = [None] * len(carries)
    for i, g in zip(wrt_x, got[len(wrt):]):
        gx[i] = g
    for j, g in zip(wrt_c, got[len(wrt) + len(wrt_x):]):
        gc[j] = g
    return {i: (g if g is not None else torch.zeros_like(z)) for i, z, g in zip(want, wrt, got)}, (gx, gc)


#: whether the per-example expansion of the parameters is tried (tests switch it off to reach the masked VJPs)
_EXPANDED = [True]

#: examples per VJP (> 1: batched with is_grads_batched). NB: 1: on the SSM of benchmarks/dp.py (B=8, T=128, CPU)
#: 4 and 8 were no faster than one VJP per example (40-55 and 35-40 ms against 28-45 ms, noisy) and held 3.4x and
#: 6.3x the non-private step's peak memory against 1.5x
EXAMPLES_PER_VJP = 1
#: whether the batched VJP (is_grads_batched) has worked so far in this process; one VJP per example once it has not
_BATCHED = [True]


def _one_hot(g: Tensor, d: int, n0: int, n1: int) -> Tensor:
    """[n1 - n0, *g.shape]: entry k is ``g`` masked to example n0 + k on axis d."""
    B = g.shape[d]
    eye = torch.eye(B, dtype=g.dtype, device=g.device)[n0:n1]
    shape = [n1 - n0] + [1] * g.dim()
    shape[d + 1] = B
    return eye.reshape(shape) * g.unsqueeze(0)


def record_region(ps: PerSampleRegion, params: dict[int, Tensor], acc: dict[int, Tensor]) -> None:
    """Hand the per-example gradients summed over the shards to the per-example book-keeping."""
    assert ps.site is not None, "a per-sample region without its site: lower_per_sample did not see it"
    for i, g in acc.items():
        _record(params[i], DirectRecord(g), ps.site)
    log.debug("per_sample_clip: sharded region recorded %d parameter(s)", len(acc))
