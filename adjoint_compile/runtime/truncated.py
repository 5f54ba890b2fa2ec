"""The truncated adjoint of a linear scan inside a shard (DESIGN.md §3 "Truncated adjoint"; the adjoint-sharding paper's truncated adjoint).

Semantics (0-indexed steps, h_{-1} = h0, window W): with g_t the cotangent h_t receives directly from the rest of
the graph (readouts, later layers, previous-state readouts of h_t),

    μ̄_i = Σ_{t=i}^{min(i+W-1, T-1)} (Π_{j=i+1}^{t} a_j) ⊙ g_t,
    ∂a_i = μ̄_i ⊙ h_{i-1},   ∂b_i = μ̄_i,   ∂h0 = a_0 ⊙ μ̄_0,

i.e. the gradient of a model in which every h_t is recomputed from h_{t-W} detached (h0 when t - W < 0): each
output step t sends its cotangent to steps i in (t-W, t] only. W >= T is the exact adjoint.

Across shards (the sweep of :mod:`.sharded`, right to left), each scan's adjoint carry is not one state but the
partial sums of the right neighbour's first m steps, m = 1..W:

    ν_m = Σ_{t=e}^{e+m-1} (Π_{j=e}^{t} a_j) ⊙ g_t          (the right side starts at step e; 0 beyond T)

held as a tensor shaped like the scan's output with W at its step dim (transient, O(W · state); never saved).
Shard [s, e) adds (Π_{j=i+1}^{e-1} a_j) ⊙ ν_{W-(e-i)} to its local windowed reverse scan for i > e - W, and passes
on ν'_m = (its local partial sum, m <= L) or (its whole-shard sum + (Π_{j=s}^{e-1} a_j) ⊙ ν_{m-L}, m > L).
At the sequence start, ∂h0 = ν'_W.  Products are running products (cumprod), sums are sums of products: nothing is
subtracted, so no cancellation.  The scan's own recurrence reaches the boundary state h_{s-1} only through ν; a
direct use of the carry in a shard (a previous-state readout) still sends its cotangent to the left shard as
a cotangent of that shard's final state (added to its g_{e-1}), as in exact mode.

:func:`truncate_program` rewrites a shard program (:meth:`ShardProgram.program`) so that each ``linear_scan``
carries ν: ``(..., nu_0..nu_{K-1}) -> (..., nu_out_0..nu_out_{K-1})``; the VJP of that program with cotangent ν
on ``nu_out_k`` gives ν' as the gradient of ``nu_k`` (forward values are unchanged).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import Tensor

from ..analysis.fx import is_linear_scan, scan_args
from .first_order import untraced

__all__ = ["truncated_scan", "truncated_scan_backward", "truncate_program", "nu_shape"]


def nu_shape(state_shape: tuple, dim: int, window: int) -> tuple:
    """The shape of a scan's ν carry: its state shape with W inserted at the scan's step dim."""
    shp = list(state_shape)
    shp.insert(dim, window)
    return tuple(shp)


def _rev_cumprod(x: Tensor, d: int) -> Tensor:
    """r_i = Π_{j>=i} x_j along d (products only)."""
    return torch.flip(torch.cumprod(torch.flip(x, (d,)), d), (d,))


def truncated_scan_backward(g: Tensor, nu: Tensor, a: Tensor, h: Tensor, h0: Tensor | None, dim: int,
                            window: int, reverse: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(∂a, ∂b, ν') of one shard's scan ``h = linear_scan(a, b, h0, dim)`` with cotangent ``g`` on h and the
    carry ``nu`` (ν from the right neighbour, W entries at ``dim``; zeros at the sequence end), window W.

    ν' (W entries) is the carry for the left neighbour; ν'_W is ∂h0 in the sequence's first shard.  ``reverse``:
    the mirror image (a reverse scan's steps read right to left; ν_m still counts m steps in the scan's direction)."""
    if reverse:
        ga, gb, nu_out = truncated_scan_backward(g.flip(dim), nu, a.flip(dim), h.flip(dim), h0, dim, window)
        return ga.flip(dim), gb.flip(dim), nu_out
    if h.is_complex():
        # complex: autograd's gradient J^H g is conj(J^T conj(g)) (h is holomorphic in a, b, h0), so the formulas
        # below (transposes) run on conj(g) and conj(ν) and their results are conjugated back: ν carries stay in
        # autograd's convention from shard to shard. NB: physical conjugates, as in the scan kernels (ops/ref.py).
        ga, gb, nu_out = _truncated_backward(torch.conj_physical(g), torch.conj_physical(nu), a, h, h0, dim, window)
        ga = torch.conj_physical(ga)
        ga = (ga if a.is_complex() else ga.real).to(a.dtype)
        return ga, torch.conj_physical(gb), torch.conj_physical(nu_out)
    ga, gb, nu_out = _truncated_backward(g, nu, a, h, h0, dim, window)
    return ga.to(a.dtype), gb, nu_out


def _truncated_backward(g: Tensor, nu: Tensor, a: Tensor, h: Tensor, h0: Tensor | None, dim: int, window: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`truncated_scan_backward` of a forward scan with the real formulas (the transposes, no conjugation), in
    h's dtype."""
    from ..ops import linear_scan  # NB: the op's node stays one node in traced VJP programs

    d, W, L = dim, window, a.shape[dim]
    cdt = h.dtype
    g, a_, nu = g.to(cdt), a.to(cdt), nu.to(cdt)
    # a1_i = a_{i+1} (1 past the end): the windowed reverse scan of g with it is Σ_t Π_{j=i+1..t} a_j g_t
    a1 = torch.cat([a_.narrow(d, 1, L - 1), torch.ones_like(a_.narrow(d, 0, 1))], d)
    mu = linear_scan(a1, g, dim=d, reverse=True, window=W)
    n = min(W - 1, L)  # steps whose window reaches past the shard's end
    if n > 0:
        r = _rev_cumprod(a1.narrow(d, L - n, n), d)  # Π_{j=i+1..L-1} a_j for the last n steps
        tail = mu.narrow(d, L - n, n) + r * nu.narrow(d, W - 1 - n, n)
        mu = torch.cat([mu.narrow(d, 0, L - n), tail], d)
    first = torch.zeros_like(h.narrow(d, 0, 1)) if h0 is None else h0.to(cdt).unsqueeze(d).expand_as(
        h.narrow(d, 0, 1))
    h_prev = torch.cat([first, h.narrow(d, 0, L - 1)], d)
    q = min(W, L)
    p = torch.cumprod(a_.narrow(d, 0, q), d)  # Π_{j=0..t} a_j
    nu_out = torch.cumsum(p * g.narrow(d, 0, q), d)  # ν'_m for m <= min(W, L)
    if W > L:
        more = nu_out.narrow(d, L - 1, 1) + p.narrow(d, L - 1, 1) * nu.narrow(d, 0, W - L)
        nu_out = torch.cat([nu_out, more], d)
    return mu * h_prev, mu, nu_out


class _TruncatedScan(torch.autograd.Function):
    """(h, ν dummy) = (linear_scan(a, b, h0), zeros like ``nu``); backward: :func:`truncated_scan_backward`, the
    gradient of ``nu`` being ν' and none for h0 (the recurrence reaches the boundary state only through ν)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, h0: Tensor | None, nu: Tensor, dim: int, window: int, reverse: bool):
        h = torch.ops.adjoint_compile.linear_scan.default(a, b, h0, dim, reverse, None, None)
        ctx.save_for_backward(a, h, h0)
        ctx.args = (dim, window, reverse, b.dtype)
        return h, torch.zeros_like(nu)

    @staticmethod
    @untraced
    def backward(ctx, g: Tensor, g_nu: Tensor):
        a, h, h0 = ctx.saved_tensors
        dim, window, reverse, b_dtype = ctx.args
        ga, gb, nu_out = truncated_scan_backward(g, g_nu, a, h, h0, dim, window, reverse)
        if gb.is_complex() and not b_dtype.is_complex:
            gb = gb.real  # a real b of a complex scan: the real part (autograd's convention)
        return ga, gb.to(b_dtype), None, nu_out, None, None, None


def truncated_scan(a: Tensor, b: Tensor, h0: Tensor | None, nu: Tensor, dim: int, window: int,
                   reverse: bool = False) -> tuple:
    """``(h, ν dummy)``: the scan of a shard, its adjoint truncated to ``window`` steps (module docstring)."""
    return _TruncatedScan.apply(a, b, h0, nu, dim, window, reverse)


def truncate_program(gm: fx.GraphModule, window: int) -> fx.GraphModule:
    """A copy of the shard program ``gm`` whose scans take one more input each (ν in, after the existing inputs)
    and give one more output each (after the existing outputs), their backward truncated to ``window`` steps."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    last_ph = [n for n in nodes if n.op == "placeholder"][-1]
    scans = [n for n in nodes if n.op == "call_function" and is_linear_scan(n)]
    nus, dummies = [], []
    for n in nodes:
        if n.op == "output":
            continue
        if n in scans:
            sa = scan_args(n)
            h0 = sa["h0"]
            call = g.call_function(truncated_scan, (env[sa["a"]], env[sa["b"]], None if h0 is None else env[h0],
                                                    nus[scans.index(n)], sa["dim"], window, sa["reverse"]))
            env[n] = g.call_function(operator.getitem, (call, 0))
            env[n].meta = dict(n.meta)
            dummies.append(g.call_function(operator.getitem, (call, 1)))
        else:
            env[n] = g.node_copy(n, env.__getitem__)
        if n is last_ph:
            nus += [g.placeholder(f"nu_{k}") for k in range(len(scans))]
    out = next(n for n in nodes if n.op == "output").args[0]
    g.output(tuple(env[o] for o in out) + tuple(dummies))
    return fx.GraphModule(gm, g)
