"""Exact adjoint sharding inside each rank under ``sequence_parallel``: a sharded region (:mod:`.sharded`) holding
one linear scan, run on this rank's slice, its carry-in from the ranks before it and its adjoint carry from the
ranks after it (DESIGN.md §6).

The region's last state is affine in the carry-in c: h_last(c) = A ⊙ c + h̃ (A = Π a over the slice, diagonal),
and the adjoint at the slice start is affine in the adjoint λ of the last state: μ_start(λ) = A ⊙ λ + e.  So:

* Forward, rank r > 0: one sweep from c = 0 without saving gives h̃_r; one VJP sweep with cotangent 1 on the last
  state and none on the outputs gives A_r = ∂h_last/∂c exactly (no subtraction, no [T, state] product).  The ranks
  all-gather (A, h̃) and each folds c_r = A_{r-1} c_{r-1} + h̃_{r-1} as :class:`~.seqpar.SeqScan` does; then the
  ordinary sharded forward from c_r.  Rank 0's carry-in is known (h0 or zeros): it sends its true last state and
  runs one sweep.
* Backward: one VJP sweep with no adjoint from the right and only the carries wanted gives e_r (the adjoint at the
  slice start of this rank's own loss); the ranks all-gather (A, e) and fold λ_r = e_{r+1} + A_{r+1} λ_{r+1} over
  the ranks after; then the ordinary sharded backward with λ_r as the adjoint of the last shard's final state.
  The gradient w.r.t. c_r is not returned: the ranks before take it from e_r through their own fold.

Cost: rank r > 0 runs the region's forward about three times and its VJP twice per step (rank 0: once and twice);
memory: the boundary states and one shard, as in one process.  Regions with several scans are not affine in their
carries (a scan may feed another through a nonlinearity); they run unsharded (:func:`unsharded_region`).
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..analysis.fx import is_linear_scan, scan_args
from .first_order import first_order
from .seqpar import SeqParState, SeqScan, _gather
from .sharded import ShardedRegion
from .shard_parts import accumulate, accumulated
from .shard_program import ShardProgram, autocast_state

log = logging.getLogger(__name__)

__all__ = ["SeqShardedRegion", "distribute_scans", "unsharded_region"]


def _fold_forward(gathered: Tensor, rank: int) -> Tensor:
    c = torch.zeros_like(gathered[0, 1])
    for k in range(rank):
        c = gathered[k, 0] * c + gathered[k, 1]
    return c


def _fold_backward(gathered: Tensor, rank: int, world: int) -> Tensor:
    d = torch.zeros_like(gathered[0, 1])
    for k in range(world - 1, rank, -1):
        d = gathered[k, 1] + gathered[k, 0] * d
    return d


class _SeqShardedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, prog: ShardProgram, st: SeqParState, *inputs: Tensor) -> tuple[Tensor, ...]:
        T, bounds = prog.T, prog.bounds()
        t0 = st.offsets()[st.rank]
        first = st.rank == 0
        shape, dev = prog.carry_shapes[0], inputs[0].device
        dt = prog.scans[0].meta["example_value"].dtype if "example_value" in prog.scans[0].meta else inputs[0].dtype
        zero = torch.zeros(shape, dtype=dt, device=dev)
        if first:
            outs, boundary, last = _sweep(prog, inputs, bounds, prog.initial_carries(inputs), True, t0)
            A = zero
        else:
            carries: list[list[Any]] = []
            c = [zero]
            with torch.no_grad():
                for s, e in bounds:  # pass 1: h̃ from c = 0; only the (state-sized) shard boundaries kept
                    carries.append(c)
                    _, fin = prog.run(e - s, prog.shard_inputs(inputs, s, e - s), c, False, t0 + s)
                    c = [fin[0].clone()]
            last = c[0]
            A = _decay(prog, inputs, bounds, carries, zero, t0)
            del carries
        # rank 0 sends its true last state (its carry-in is known); the others h̃, folded with the A's
        gathered = _gather(torch.stack([A, last.to(A.dtype)]), st.group)
        if not first:
            c0 = _fold_forward(gathered, st.rank).to(dt)
            outs, boundary, _ = _sweep(prog, inputs, bounds, [c0], False, t0)
        ctx.prog, ctx.st, ctx.bounds, ctx.n_in, ctx.autocast = prog, st, bounds, len(inputs), autocast_state()
        flat = [cs[0] if cs[0] is not None else zero for cs in boundary]
        ctx.has_h0 = boundary[0][0] is not None
        ctx.save_for_backward(A, *inputs, *flat)
        return tuple(outs)

    @staticmethod
    @first_order
    def backward(ctx: Any, *gouts: Tensor) -> tuple[Any, ...]:
        prog: ShardProgram = ctx.prog
        st: SeqParState = ctx.st
        saved = ctx.saved_tensors
        A, inputs, flat = saved[0], saved[1: 1 + ctx.n_in], list(saved[1 + ctx.n_in:])
        first, t0 = st.rank == 0, st.offsets()[st.rank]
        carries = [[c] for c in flat]
        if first and not ctx.has_h0:
            carries[0] = [None]
        needs = list(ctx.needs_input_grad[2:])
        if not first:  # pass 1: e, the adjoint at the slice start of this rank's own loss
            e = _adjoint_sweep(prog, inputs, ctx.bounds, carries, gouts, None, [False] * len(inputs), t0,
                               ctx.autocast, first)[1]
            e = torch.zeros_like(A) if e is None else e
        else:
            e = torch.zeros_like(A)
        gathered = _gather(torch.stack([A, e.to(A.dtype)]), st.group)
        lam = None if st.rank == st.world - 1 else _fold_backward(gathered, st.rank, st.world).to(flat[0].dtype)
        grads, adj = _adjoint_sweep(prog, inputs, ctx.bounds, carries, gouts, lam, needs, t0, ctx.autocast, first)
        i = prog.h0_input[0]
        if i is not None and needs[i]:
            if first and adj is not None:
                g = adj.to(inputs[i].dtype)
                g = g.sum_to_size(inputs[i].shape) if g.shape != inputs[i].shape else g
            else:  # NB: only rank 0's h0 starts the sequence (as SeqScan)
                g = torch.zeros_like(inputs[i])
            grads[i] = g if grads[i] is None else grads[i] + g
        return (None, None, *grads)


def _decay(prog: ShardProgram, inputs: Any, bounds: list, carries: list, zero: Tensor, t0: int) -> Tensor:
    """A = ∂h_last/∂c (diagonal): a VJP sweep with cotangent 1 on the last state and none on the outputs."""
    adj: list[Any] = [torch.ones_like(zero)]
    none_out = [None] * len(prog.out_nodes)
    for k in range(len(bounds) - 1, -1, -1):
        s, e = bounds[k]
        _, adj = prog.vjp(e - s, prog.shard_inputs(inputs, s, e - s), carries[k], False, none_out, adj,
                          [False] * len(inputs), [True], t0=t0 + s)
        adj = [torch.zeros_like(zero) if adj[0] is None else adj[0]]
    return adj[0]


def _sweep(prog: ShardProgram, inputs: Any, bounds: list, carries: list[Any], first: bool, t0: int):
    outs: list[Tensor] | None = None
    boundary: list[list[Any]] = []
    for s, e in bounds:
        boundary.append(carries)
        ys, fin = prog.run(e - s, prog.shard_inputs(inputs, s, e - s), carries, first and s == 0, t0 + s)
        if outs is None:
            outs = []
            for y, d in zip(ys, prog.out_step_dims):
                shp = list(y.shape)
                shp[d] = prog.T
                outs.append(y.new_empty(shp))
        for o, y, d in zip(outs, ys, prog.out_step_dims):
            o.narrow(d, s, e - s).copy_(y)
        carries = [fin[0].clone()]  # NB: clone: a select would keep the shard's whole state tensor alive
    return outs, boundary, carries[0]


def _adjoint_sweep(prog: ShardProgram, inputs: Any, bounds: list, carries: list, gouts: Any, lam: Any,
                   needs: list[bool], t0: int, autocast: tuple, first: bool):
    """Right to left with ``lam`` the adjoint of the last state: (input grads, adjoint at the slice start)."""
    grads: list[Any] = [None] * len(inputs)
    for i, (x, d) in enumerate(zip(inputs, prog.in_step_dims)):
        if needs[i] and d is not None:
            grads[i] = torch.empty_like(x)
    free = [i for i, d in enumerate(prog.in_step_dims) if d is None and needs[i]]
    acc: dict[int, Tensor] = {}
    adj: list[Any] = [lam]
    for k in range(len(bounds) - 1, -1, -1):
        s, e = bounds[k]
        L = e - s
        xs = prog.shard_inputs(inputs, s, L)
        gos = [None if g is None else g.narrow(d, s, L).contiguous() for g, d in zip(gouts, prog.out_step_dims)]
        c = carries[k]
        needs_c = [c[0] is not None]
        gx, adj = prog.vjp(L, xs, c, first and k == 0, gos, adj, needs, needs_c, t0=t0 + s, autocast=autocast)
        for i, (g, d) in enumerate(zip(gx, prog.in_step_dims)):
            if g is not None and d is not None:
                grads[i].narrow(d, s, L).copy_(g)
        for i in free:
            if gx[i] is not None:
                accumulate(acc, i, gx[i])
    accumulated(acc, grads, inputs)
    return grads, adj[0]


class SeqShardedRegion(torch.nn.Module):
    """A one-scan :class:`~.sharded.ShardedRegion` run on this rank's slice (module docstring)."""

    def __init__(self, region: ShardedRegion, state: SeqParState) -> None:
        super().__init__()
        if len(region._plan.scans) != 1 or region.window is not None:
            raise ValueError("SeqShardedRegion: exact mode, one scan per region")
        self.region, self.state = region, state

    def forward(self, *inputs: Tensor) -> Any:
        prog = self.region._plan
        self.region.prepare(inputs)
        outs = _SeqShardedFn.apply(prog, self.state, *inputs)
        return outs[0] if prog.single_output else tuple(outs)


def distribute_scans(gm: fx.GraphModule, scans: list[fx.Node], state: SeqParState,
                     window: int | None) -> list[fx.Node]:
    """Each of ``scans`` (linear_scan nodes of ``gm``) made a call of a distributed :class:`~.seqpar.SeqScan`."""
    g, calls = gm.graph, []
    for i, s in enumerate(scans):
        sa = scan_args(s)
        name = f"seqpar_scan_{i}"
        gm.add_submodule(name, SeqScan(state, sa["dim"], window))
        with g.inserting_before(s):
            call = g.call_module(name, (sa["a"], sa["b"], sa["h0"]))
        call.meta = dict(s.meta)
        s.replace_all_uses_with(call)
        g.erase_node(s)
        calls.append(call)
    gm.recompile()
    return calls


def unsharded_region(region: ShardedRegion, state: SeqParState, window: int | None) -> fx.GraphModule:
    """The region's graph with each scan made a distributed :class:`~.seqpar.SeqScan`, under ordinary autograd."""
    gm = copy.deepcopy(region.region_gm)
    distribute_scans(gm, [n for n in gm.graph.nodes if is_linear_scan(n)], state, window)
    return gm
