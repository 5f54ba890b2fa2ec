"""Per-example parameter gradients inside a sharded region (``per_sample_clip`` with the exact adjoint; issue 14).

Each shard's backward recomputes the shard once with every parameter p made per example (p + z_p, z_p a zero
[B, *p.shape] input: runtime/per_example_program.py): one backward with the whole cotangents gives the gradient
of z_p, the per-example gradients of p (examples do not interact inside a region: batch-mixing ops are refused by
passes/lower/per_sample.py), and the shard's pullback to its inputs and carries, so it is the shard's only backward.
The [B, *p.shape] gradients are summed over the shards (the direct form adds up over shards; the Gram form would
not), so nothing of length T is kept, and handed to runtime/per_sample.py as one :class:`~.per_sample.DirectRecord`
per parameter.

A loss the region takes in is a scalar summed over the examples too: its cotangent is one number, and the expanded
parameters alone tell the examples' parts apart, so such a region must expand (:func:`expandable_reason`, checked
by the lowering, which otherwise ends the region before the loss).

A region whose parameters meet the examples any other way (the rewrite is checked op by op:
:class:`~.per_example_program.NotExpandable`) takes masked VJPs instead: per example n, the cotangents masked to
example n, one backward each (B backward passes of the shard). NB: not ``torch.func.vmap`` over the examples: the
shard programs are specialized to the batch size (a ``reshape(B, L, D*N)`` in the region). ``EXAMPLES_PER_VJP`` > 1
batches the masked VJPs (``is_grads_batched``); on CPU that was not faster and cost memory, so the default is one
VJP per example.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..analysis.batch_axes import followed_axes
from .per_example_program import NotExpandable, expanded_program, row_grads
from .per_sample import DirectRecord, Site, _record
from .shard_parts import accumulate, autocast_off, autocast_state, differentiable
from .shard_program import ShardProgram, _ev, autocast_as

log = logging.getLogger(__name__)

__all__ = ["PerSampleRegion", "per_example_param_grads", "record_region", "add_example_grad"]


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
                            needs_c: Sequence[bool] = ()) -> tuple[dict[int, Any], Any]:
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
        except NotExpandable as e:
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


def split_per_sample(split: Any, ps: PerSampleRegion, plan: ShardProgram) -> str:
    """Under ``per_sample_clip``, a region whose loss is split off (:mod:`.loss_tail`): ``per_sample`` of its rest
    (the parameters it reads; its frontier outputs have the examples on axis 0) and of its tail (one loss, summed
    over the examples: the parameters it reads, the head's weight, get their per-example gradients with the loss's
    in the forward, scaled by its cotangent in the backward). Returns why not ("" when set)."""
    rest, tail = split.rest, split.tail
    if len(split.tail_pos) != 1:
        return "per-example clipping takes one loss split off a region"
    seeds = {n: None if k < 0 else k for n, k in zip(plan.placeholders, ps.in_bdims) if k is not None}
    acts, moved = followed_axes(plan.region_gm, seeds, 0, ps.batch)
    bdims: list[int | None] = []
    for f, (src, i) in zip(split.frontier, split.sources):
        if src == "input":
            bdims.append(ps.in_bdims[i])
            continue
        v, k = _ev(f), moved.get(f, 0) if f in acts else None
        if k != 0 or plan.info.step_dim.get(f) == 0 or not (isinstance(v, Tensor) and v.dim() > 0 and
                                                             int(v.shape[0]) == ps.batch):
            return f"the loss reads {f.name}, which does not carry the examples on axis 0"
        bdims.append(0)

    def used(prog: ShardProgram, params: Sequence[int], region_input: Any) -> PerSampleRegion | None:
        """The parameters ``prog`` reads, with the bytes of their per-example gradients; None: it reads none."""
        mine = tuple(i for i in params if prog.placeholders[i].users)
        if not mine:
            return None
        vs = [_ev(plan.placeholders[region_input(i)]) for i in mine]
        return PerSampleRegion(mine, (), (), site=ps.site, batch=ps.batch,
                               example_bytes=ps.batch * sum(v.numel() * v.element_size() for v in vs))

    rest.per_sample = used(rest, ps.params, lambda i: i)
    if rest.per_sample is not None:
        rest.per_sample = dataclasses.replace(
            rest.per_sample, carry_bdims=ps.carry_bdims, in_bdims=ps.in_bdims,
            out_bdims=(*(ps.out_bdims[i] for i in split.rest_pos),
                       *(d for (src, _), d in zip(split.sources, bdims) if src == "rest")),
            loss_kinds={k: ps.loss_kinds[i] for k, i in enumerate(split.rest_pos) if i in ps.loss_kinds})
    tail.per_sample = used(tail, [k for k, (src, i) in enumerate(split.sources) if src == "input" and i in ps.params],
                           lambda k: split.sources[k][1])
    if tail.per_sample is not None:
        tail.per_sample = dataclasses.replace(tail.per_sample, out_bdims=(None,), in_bdims=tuple(bdims),
                                              loss_kinds={0: ps.loss_kinds.get(split.tail_pos[0], "R")})
    return ""


def tail_example_grads(tail: ShardProgram, L: int, xs: Sequence[Any], wrt: list[int], t0: int,
                       acc: dict[int, Tensor]) -> tuple[list[Tensor], dict[tuple[int, int], Tensor]]:
    """One chunk of a loss tail under per_sample_clip (:func:`split_per_sample`), from its expanded program: its
    outputs, and per input i in ``wrt`` other than a parameter the loss's gradient ``{(0, i): ∂ℓ/∂x_i}`` (as
    loss_tail.value_and_grad gives them); its parameters' per-example gradients are added to ``acc``."""
    ps = tail.per_sample
    fwd = autocast_state()
    want = [i for i in ps.params if i in wrt]
    wrt_x = [i for i in wrt if i not in ps.params]
    values: list[Tensor] = []
    # NB: the loss's cotangent is 1 here (1/T for a length-free mean over time); the backward scales by the real one
    with autocast_off():
        got, res = _expanded_grads(tail, ps, L, xs, [], t0 == 0, tail._mean_scaled([1.0]), [], t0, fwd, want, wrt_x,
                                   [], values)
    for i, g in got.items():
        add_example_grad(acc, i, g)
    gx = res[0] if res is not None else [None] * len(xs)
    return tail._mean_scaled(values), {(0, i): gx[i] for i in wrt_x if gx[i] is not None}


def expandable_reason(prog: ShardProgram, ps: PerSampleRegion, L: int) -> str:
    """Why the region's parameters cannot be made per example in its ``L``-step program ("" when they can). A region
    whose loss sums over the examples needs that: its masked VJPs could not tell the examples apart."""
    if any(d not in (0, None) for d in (*ps.out_bdims, *ps.carry_bdims)):
        return "the examples are not on axis 0"
    try:
        expanded_program(prog, ps, L, ps.batch)
    except NotExpandable as e:
        return str(e)
    return ""


def _expanded_grads(prog: ShardProgram, ps: PerSampleRegion, L: int, xs: Sequence[Any], carries: Sequence[Any],
                    first_shard: bool, gos: Sequence[Any], adjs: Sequence[Any], t0: int, autocast: tuple,
                    want: list[int], wrt_x: list[int], wrt_c: list[int],
                    values: list[Tensor] | None = None) -> tuple[dict[int, "ExampleGrad"], Any]:
    """The expanded program's backward (``gos``: a float c is ``full_like(output, c)``); ``values``: filled with
    the program's outputs."""
    if ps.out_bdims and any(d not in (0, None) for d in (*ps.out_bdims, *ps.carry_bdims)):
        raise NotExpandable("the examples are not on axis 0")
    B = ps.batch or next(g.shape[0] for g, d in zip([*gos, *adjs], [*ps.out_bdims, *ps.carry_bdims])
                         if g is not None and d is not None)
    gm = expanded_program(prog, ps, L, B)
    with torch.enable_grad():
        x_in = [x.detach().requires_grad_(i in wrt_x) if isinstance(x, Tensor) else x for i, x in enumerate(xs)]
        # NB: zeros of no memory: the program reads them only as the copies' gradient (per_example_program.copies)
        zs = [torch.zeros((), dtype=x_in[i].dtype, device=x_in[i].device).expand(B, *x_in[i].shape)
              .requires_grad_(i in want) for i in ps.params]
        cs = [None if c is None else c.detach().requires_grad_(j in wrt_c) for j, c in enumerate(carries)]
        prevs = [None if first_shard else cs[k] for k in prog.shift_scans]
        with autocast_as(autocast):
            res = gm(*x_in, *cs, *prevs, *prog._offset(t0), *zs)
        if values is not None:
            values[:] = [r.detach() for r in res]
        pairs = [(y, torch.full_like(y, g) if isinstance(g, float) else g) for y, g in zip(res, [*gos, *adjs])
                 if g is not None and y.requires_grad]
        wrt = [z for i, z in zip(ps.params, zs) if i in want]
        if not pairs:
            return {}, None
        with row_grads() as rows:
            got = torch.autograd.grad([y for y, _ in pairs], [*wrt, *(x_in[i] for i in wrt_x),
                                                              *(cs[j] for j in wrt_c)],
                                      [g for _, g in pairs], allow_unused=True)
    gx: list[Any] = [None] * len(xs)
    gc: list[Any] = [None] * len(carries)
    for i, g in zip(wrt_x, got[len(wrt):]):
        gx[i] = g
    for j, g in zip(wrt_c, got[len(wrt) + len(wrt_x):]):
        gc[j] = g
    return {i: ExampleGrad(z, g, [(ids, r) for y, ids, r in rows if y is z]) for i, z, g in zip(want, wrt, got)}, \
        (gx, gc)


@dataclasses.dataclass
class ExampleGrad:
    """A shard's per-example gradient of one parameter, [B, *p.shape] like ``like``: a dense part (None: none) and
    the rows an embedding's lookups add (ids [B, ...], their gradients [B, ..., d]; runtime/per_example_program.py),
    so that the [B, V, d] table of a shard's lookups is never made."""

    like: Tensor
    dense: Tensor | None
    rows: list[tuple[Tensor, Tensor]]


def add_example_grad(acc: dict[int, Tensor], i: int, g: Any) -> None:
    """``acc[i] += g`` for a per-example gradient (a tensor or an :class:`ExampleGrad`), kept in fp32 at least."""
    if isinstance(g, Tensor):
        accumulate(acc, i, g)
        return
    if g.dense is not None:
        accumulate(acc, i, g.dense)
    if i not in acc:
        acc[i] = torch.zeros(g.like.shape, dtype=torch.promote_types(g.like.dtype, torch.float32), device=g.like.device)
    for ids, r in g.rows:
        b = torch.arange(ids.shape[0], device=ids.device).view(-1, *([1] * (ids.dim() - 1))).expand_as(ids)
        acc[i].index_put_((b, ids), r.to(acc[i].dtype), accumulate=True)


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
