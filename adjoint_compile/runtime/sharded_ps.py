"""Per-example parameter gradients inside a sharded region (``per_sample_clip`` with the exact adjoint; issue 14).

Each shard's backward recomputes the shard once and pulls back, per example n, the cotangents masked to example n
(zeros for every other example): since examples do not interact inside a region (batch-mixing ops are refused by
passes/lower_per_sample.py), that VJP's parameter part is example n's gradient of the shard. The [B, *p.shape]
gradients are summed over the shards (the direct form adds up over shards; the Gram form would not), so nothing of
length T is kept, and handed to runtime/per_sample.py as one :class:`~.per_sample.DirectRecord` per parameter.

NB: not ``torch.func.vmap`` over the examples: the shard programs are specialized to the batch size (a
``reshape(B, L, D*N)`` in the region), so a vmapped per-example call would not run; B masked VJPs over one
recomputation cost B backward passes of the shard instead of one. ``EXAMPLES_PER_VJP`` > 1 batches them
(``is_grads_batched``); on CPU that was not faster and cost memory, so the default is one VJP per example.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .per_sample import DirectRecord, Site, _record
from .shard_program import ShardProgram, autocast_as

log = logging.getLogger(__name__)

__all__ = ["PerSampleRegion", "per_example_param_grads", "record_region"]


@dataclasses.dataclass(eq=False)
class PerSampleRegion:
    """How a sharded region takes part in per-example clipping (set by passes/lower_per_sample.py)."""

    #: the region inputs that are parameters (their gradients are per example, recorded, not returned)
    params: tuple[int, ...]
    #: per region output and per scan state, the axis of the examples (batch_dim, moved by a scan's step axis)
    out_bdims: tuple[int, ...]
    carry_bdims: tuple[int, ...]
    site: Site | None = None


def per_example_param_grads(prog: ShardProgram, ps: PerSampleRegion, L: int, xs: Sequence[Any],
                            carries: Sequence[Any], first_shard: bool, gos: Sequence[Any], adjs: Sequence[Any],
                            t0: int, autocast: tuple) -> dict[int, Tensor]:
    """Per parameter input i of the region, its [B, *p.shape] per-example gradient over this shard."""
    want = [i for i in ps.params if isinstance(xs[i], Tensor)]
    if not want:
        return {}
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
            return {}
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
    return out


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
