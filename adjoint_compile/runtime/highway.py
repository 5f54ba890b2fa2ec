"""Highway-BP (DESIGN.md §3, after the Highway backpropagation paper): an iterative, parallel backward for a chain of steps f_i(x) = r_i(x, g_i(x)).

K_i = ∂r_i/∂x is cheap (diagonal, scalar or identity: a tensor; dense: a VJP), J_i = ∂r_i/∂z · ∂g_i/∂x is the
expensive part (a VJP of the block g_i).  With G_i = ∂L_i/∂x_i the direct gradients of the states x_1..x_L::

    w⁰_i     = G_i + K_{i+1}ᵀ w⁰_{i+1}                               (CumSumProd(G, K): a reverse linear scan)
    w^{m+1}  = w⁰ + CumSumProd((J_{i+1}ᵀ w^m_{i+1})_i, K)             (m = 0 .. k-1)

w^k_i is the sum over all backward paths from the loss to x_i through at most k Jacobians J of the blocks
(Highway-BP Theorem 2); k >= L gives ∂L/∂x_i exactly.  Parameter and input gradients are one VJP of the blocks
with the final w; the gradient of the chain's input is w^k_0 = K_1ᵀ w^k_1 + J_1ᵀ w^{k-1}_1 (the same path count).

The forward runs the chain as written and saves only the states x_0..x_L (what ordinary backpropagation saves at
least).  The backward recomputes every g_i(x_{i-1}) at once — one ``vmap``-batched call when the steps share their
weights (the time steps of a recurrence), one call per layer otherwise — and keeps that graph for the k VJPs.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..ops import linear_scan
from .first_order import untraced

log = logging.getLogger(__name__)

__all__ = ["cumsumprod", "dense_cumsumprod", "solve", "HighwayStats", "StepChain", "highway_scan", "HighwayScan",
           "HighwayLayers"]


@dataclasses.dataclass
class HighwayStats:
    """What the last backward did: iterations run (fewer than k when ``tolerance`` stopped it) and the last
    update's relative norm."""

    iterations: int | None = None
    last_update: float | None = None
    calls: int = 0
    #: a chain's blocks ran as one vmap over its layers (HighwayLayers with isomorphic layers)
    batched: bool = False


def _zeros_like_step(v: Tensor) -> Tensor:
    return torch.zeros_like(v[:1])


def cumsumprod(v: Sequence[Tensor], K: Sequence[Tensor | None]) -> list[Tensor]:
    """out_i = v_i + K_{i+1} ⊙ out_{i+1} along dim 0, per state component; ``K[c]`` None means K = 0.

    ``K[c]`` holds K_1..K_L (dim 0) broadcastable to ``v[c]``: the diagonal of K_i.  One reverse
    :func:`~adjoint_compile.ops.linear_scan` per component.
    """
    out = []
    for vc, kc in zip(v, K):
        if kc is None or vc.shape[0] == 1:
            out.append(vc)
            continue
        kc = kc.to(vc.dtype).broadcast_to(vc.shape)
        a = torch.cat([kc[1:], _zeros_like_step(vc)]).contiguous()
        out.append(linear_scan(a, vc.contiguous(), dim=0, reverse=True))
    return out


def dense_cumsumprod(v: Sequence[Tensor], Kt: Callable[[int, list[Tensor]], list[Tensor]]) -> list[Tensor]:
    """:func:`cumsumprod` for a dense K: ``Kt(i, w)`` gives K_{i+1}ᵀ w (0-based i), a loop of cheap VJPs."""
    L = v[0].shape[0]
    out: list[list[Tensor]] = [[] for _ in v]
    acc = [vc[L - 1] for vc in v]
    for c, a in enumerate(acc):
        out[c].append(a)
    for i in range(L - 2, -1, -1):
        kw = Kt(i + 1, acc)
        acc = [vc[i] + k for vc, k in zip(v, kw)]
        for c, a in enumerate(acc):
            out[c].append(a)
    return [torch.stack(o[::-1]) for o in out]


def _shift(p: Tensor) -> Tensor:
    """(P_1..P_L) -> (P_2..P_L, 0): v_i = J_{i+1}ᵀ w_{i+1}."""
    return torch.cat([p[1:], _zeros_like_step(p)])


def solve(G: Sequence[Tensor], scan: Callable[[Sequence[Tensor]], list[Tensor]],
          jT: Callable[[list[Tensor]], list[Tensor]], k: int, tolerance: float | None = None,
          stats: HighwayStats | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
    """The Highway-BP iteration (module docstring).

    ``G``: per state component, the direct gradients of x_1..x_L stacked on dim 0. ``scan``: CumSumProd with the
    chain's K. ``jT(w)``: per component, (J_jᵀ w_j)_{j=1..L} (the gradient reaching x_{j-1}). Returns (w^k, the
    last ``jT`` result or None when k = 0): the latter's first step is J_1ᵀ w^{k-1}_1, the input's J path.
    """
    w0 = scan(G)
    w, P = w0, None
    used, rel = 0, None
    for _ in range(k):
        P = jT(w)
        new = [a + u for a, u in zip(w0, scan([_shift(p) for p in P]))]
        used += 1
        if tolerance is not None:
            num = sum(float((n - o).double().pow(2).sum()) for n, o in zip(new, w)) ** 0.5
            den = sum(float(n.double().pow(2).sum()) for n in new) ** 0.5
            rel = num / den if den > 0 else 0.0
        w = new
        if tolerance is not None and rel < tolerance:
            break
    if stats is not None:
        stats.iterations, stats.last_update, stats.calls = used, rel, stats.calls + 1
    return w, P


def _leaf(x: Any, grad: bool) -> Any:
    if not isinstance(x, Tensor):
        return x
    return x.detach().requires_grad_(grad and (x.is_floating_point() or x.is_complex()))


def _grads(outs: Sequence[Tensor], ins: Sequence[Any], cots: Sequence[Tensor | None],
           retain: bool) -> list[Tensor | None]:
    """VJP of ``outs`` w.r.t. the tensors of ``ins`` that require grad (None elsewhere)."""
    pairs = [(o, c) for o, c in zip(outs, cots) if isinstance(o, Tensor) and o.requires_grad and c is not None]
    idx = [i for i, x in enumerate(ins) if isinstance(x, Tensor) and x.requires_grad]
    res: list[Tensor | None] = [None] * len(ins)
    if not pairs or not idx:
        return res
    got = torch.autograd.grad([o for o, _ in pairs], [ins[i] for i in idx], [c for _, c in pairs],
                              retain_graph=retain, allow_unused=True)
    for i, g in zip(idx, got):
        res[i] = g
    return res


class _Linearized:
    """g and r recomputed from the saved states (steps on dim 0), with the VJPs Highway-BP needs.

    ``Z = g(X_prev, ...)`` (a graph kept for k + 1 VJPs) and ``R = r(X_prev', Z')`` on separate leaves, so that
    ∂r/∂x (K) and ∂r/∂z are read apart.
    """

    def __init__(self, xprev: list[Tensor], Z: list[Tensor], r: Callable[[list[Tensor], list[Tensor]], list[Tensor]]):
        self.xprev, self.Z = xprev, Z
        self.xr = [x.detach().requires_grad_() for x in xprev]
        self.Zr = [_leaf(z, True) for z in Z]
        with torch.enable_grad():
            self.R = r(self.xr, self.Zr)

    def diag_K(self) -> list[Tensor | None]:
        """K_i as a diagonal (r is elementwise in x: add, ReLU(x + z), z1 ⊙ x + z2): ∂r/∂x applied to ones."""
        ones = [torch.ones_like(o) for o in self.R]
        return [None if g is None else g.detach() for g in _grads(self.R, self.xr, ones, retain=True)]

    def dz(self, w: Sequence[Tensor]) -> list[Tensor | None]:
        return _grads(self.R, self.Zr, list(w), retain=True)

    def jT(self, w: Sequence[Tensor]) -> list[Tensor]:
        got = _grads(self.Z, self.xprev, self.dz(w), retain=True)
        return [torch.zeros_like(x) if g is None else g for x, g in zip(self.xprev, got)]


# ---------------------------------------------------------------------------------------------------------------
# a recurrence: every step the same function with the same weights


@dataclasses.dataclass
class StepChain:
    """A recurrence given as functions of one step.

    ``step(carries, xs_t, extra) -> (new carries, ys)``: the forward as written; ``g(carries, xs_t, extra) ->
    Z`` (a list of tensors) and ``r(carries, Z) -> new carries``: its Highway-BP split, r elementwise in the
    carries (K diagonal).  ``y_of[j]``: the carry that output j of ``ys`` is (each per-step output is a new state).
    """

    step: Callable[..., tuple[list[Tensor], list[Tensor]]]
    g: Callable[..., list[Tensor]]
    r: Callable[[list[Tensor], list[Tensor]], list[Tensor]]
    y_of: list[int]
    iterations: int
    tolerance: float | None = None
    stats: HighwayStats = dataclasses.field(default_factory=HighwayStats)


class _ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, chain: StepChain, n_c: int, n_x: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        init, xs, extra = list(inputs[:n_c]), list(inputs[n_c:n_c + n_x]), list(inputs[n_c + n_x:])
        T = xs[0].shape[0]
        states = [[h] for h in init]
        h = init
        for t in range(T):
            h, _ = chain.step(h, [x[t] for x in xs], extra)
            for c, hc in enumerate(h):
                states[c].append(hc)
        for s in states:  # NB: an initial state broadcast by the first step (a learned [H] against [B, H] states)
            s[0] = s[0].expand(s[1].shape) if len(s) > 1 and s[0].shape != s[1].shape else s[0]
        H = [torch.stack(s) for s in states]  # x_0..x_T per carry
        ctx.chain, ctx.n, ctx.init_shapes = chain, (n_c, n_x), [h.shape for h in init]
        ctx.save_for_backward(*H, *xs, *[e if isinstance(e, Tensor) else None for e in extra])
        ctx.extra_const = [None if isinstance(e, Tensor) else e for e in extra]
        return (*[hc[-1].clone() for hc in H], *[H[c][1:].clone() for c in chain.y_of])

    @staticmethod
    @untraced
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        chain: StepChain = ctx.chain
        n_c, n_x = ctx.n
        saved = ctx.saved_tensors
        H, xs = list(saved[:n_c]), list(saved[n_c:n_c + n_x])
        extra = [s if s is not None else c for s, c in zip(saved[n_c + n_x:], ctx.extra_const)]
        need = ctx.needs_input_grad[3:]
        G = [torch.zeros_like(hc[1:]) for hc in H]
        for c, gr in enumerate(grads[:n_c]):
            if gr is not None:
                G[c][-1] += gr
        for j, c in enumerate(chain.y_of):
            if grads[n_c + j] is not None:
                G[c] = G[c] + grads[n_c + j]
        with torch.enable_grad():
            xprev = [hc[:-1].detach().requires_grad_() for hc in H]
            xs_l = [_leaf(x, need[n_c + i]) for i, x in enumerate(xs)]
            ex_l = [_leaf(e, need[n_c + n_x + i]) for i, e in enumerate(extra)]
            batched = torch.func.vmap(lambda hp, xt, ex: chain.g(hp, xt, ex), in_dims=(0, 0, None),
                                      randomness="error")
            Z = _aligned(list(batched(xprev, xs_l, ex_l)), xprev)
        lin = _Linearized(xprev, Z, chain.r)
        K = lin.diag_K()
        w, P = solve(G, lambda v: cumsumprod(v, K), lin.jT, chain.iterations, chain.tolerance, chain.stats)
        # the chain's input: K_1ᵀ w^k_1 (+ J_1ᵀ w^{k-1}_1, the last iteration's J product)
        d_init = []
        for c in range(n_c):
            g0 = torch.zeros_like(H[c][0]) if K[c] is None else (K[c][0].broadcast_to(w[c][0].shape) * w[c][0])
            if P is not None:
                g0 = g0 + P[c][0]
            d_init.append(g0.sum_to_size(ctx.init_shapes[c]))
        rest = _grads(Z, xs_l + ex_l, lin.dz(w), retain=False)
        return (None, None, None, *d_init, *rest)


def _aligned(Z: list[Tensor], xprev: list[Tensor]) -> list[Tensor]:
    """The steps' Z (steps on dim 0) with singleton axes after the steps' up to the carries' rank: ``r`` combines
    them with the carries for all steps at once, where a gate of no example (``sigmoid(A[t])``, [T, H]) would align
    its steps with the carries' batch ([T, B, H]) instead of broadcasting over it, as each step did."""
    n = max(v.dim() for v in [*Z, *xprev])
    return [z.reshape(z.shape[:1] + (1,) * (n - z.dim()) + z.shape[1:]) for z in Z]


def highway_scan(chain: StepChain, init: Sequence[Tensor], xs: Sequence[Tensor],
                 extra: Sequence[Any] = ()) -> tuple[Tensor, ...]:
    """Run the recurrence over dim 0 of ``xs``: returns (final carries..., ys stacked on dim 0...), like torch's
    ``scan``; its backward is Highway-BP with ``chain.iterations``."""
    return _ScanFn.apply(chain, len(init), len(xs), *init, *xs, *extra)


class HighwayScan(torch.nn.Module):
    """A graph's ``scan`` call replaced by Highway-BP: called with (init..., xs..., extra...) like the scan op, it
    returns the op's list (final carries..., ys...).  ``step_module`` is the scan's step sub-graph (kept for
    reports); ``chain`` holds the split (passes/lower/highway.py)."""

    def __init__(self, chain: StepChain, n_carries: int, n_xs: int, step_module: torch.nn.Module) -> None:
        super().__init__()
        self.chain, self.n = chain, (n_carries, n_xs)
        self.step_module = step_module
        self.label = ""

    @property
    def stats(self) -> HighwayStats:
        return self.chain.stats

    def forward(self, *args: Any) -> list[Tensor]:
        n_c, n_x = self.n
        return list(highway_scan(self.chain, args[:n_c], args[n_c:n_c + n_x], args[n_c + n_x:]))


# ---------------------------------------------------------------------------------------------------------------
# a chain of layers (residual chains over depth): each layer its own g and r


class _LayersFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mod: "HighwayLayers", x0: Tensor, *ext: Tensor) -> tuple[Tensor, ...]:
        states = [x0]
        for i in range(len(mod.gs)):
            e = [ext[j] for j in mod.ext_of[i]]
            z = mod.gs[i](states[-1], *e)
            states.append(mod.rs[i](states[-1], *_as_list(z), *e))
        ctx.mod = mod
        ctx.save_for_backward(*states, *ext)
        return tuple(s.clone() for s in states[1:])

    @staticmethod
    @untraced
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        mod: HighwayLayers = ctx.mod
        L = len(mod.gs)
        saved = ctx.saved_tensors
        states, ext = saved[:L + 1], saved[L + 1:]
        need = ctx.needs_input_grad[2:]
        G = torch.stack([torch.zeros_like(states[i + 1]) if g is None else g for i, g in enumerate(grads)])
        ext_l = [_leaf(e, need[j]) for j, e in enumerate(ext)]
        xprev, Z, xr, Zr, R = [], [], [], [], []
        batched = _batched_g(mod, states[:L], ext_l) if mod.batched else None
        mod.stats.batched = batched is not None
        with torch.enable_grad():
            for i in range(L):
                e = [ext_l[j] for j in mod.ext_of[i]]
                if batched is None:
                    xp = states[i].detach().requires_grad_()
                    z = _as_list(mod.gs[i](xp, *e))
                else:
                    xp, z = states[i], [v[i] for v in batched[1]]
                xl, zl = xp.detach().requires_grad_(), [_leaf(v, True) for v in z]
                xprev.append(xp), Z.append(z), xr.append(xl), Zr.append(zl)
                R.append(mod.rs[i](xl, *zl, *e))

        def dz(i: int, w: Tensor) -> list[Tensor | None]:
            return _grads([R[i]], Zr[i], [w], retain=True)

        def dz_all(W: Tensor) -> list[Tensor]:
            per = [dz(i, W[i]) for i in range(L)]
            return [torch.stack([torch.zeros_like(Zr[i][s]) if p[s] is None else p[s] for i, p in enumerate(per)])
                    for s in range(len(batched[1]))]

        def jT(W: list[Tensor]) -> list[Tensor]:
            if batched is not None:  # one VJP of the vmap-batched blocks
                g = _grads(batched[1], [batched[0]], dz_all(W[0]), retain=True)[0]
                return [torch.zeros_like(batched[0]) if g is None else g]
            out = []
            for i in range(L):
                g = _grads(Z[i], [xprev[i]], dz(i, W[0][i]), retain=True)[0]
                out.append(torch.zeros_like(xprev[i]) if g is None else g)
            return [torch.stack(out)]

        def Kt(i: int, w: Tensor) -> Tensor:
            g = _grads([R[i]], [xr[i]], [w], retain=True)[0]
            return torch.zeros_like(w) if g is None else g

        if mod.dense:
            scan = lambda v: dense_cumsumprod(v, lambda i, acc: [Kt(i, acc[0])])  # noqa: E731
        else:
            K = torch.stack([Kt(i, torch.ones_like(xr[i])) for i in range(L)])
            scan = lambda v: cumsumprod(v, [K])  # noqa: E731
        (w,), P = solve([G], scan, jT, mod.iterations, mod.tolerance, mod.stats)
        d_x0 = Kt(0, w[0]) + (P[0][0] if P is not None else 0)
        d_ext: list[Tensor | None] = [None] * len(ext)
        if batched is not None:
            d_ext = _grads(batched[1], ext_l, dz_all(w), retain=True)
        for i in range(L):
            idx = mod.ext_of[i]
            es = [ext_l[j] for j in idx]
            via_r = _grads([R[i]], es, [w[i]], retain=True)
            via_g = _grads(Z[i], es, dz(i, w[i]), retain=True) if batched is None else [None] * len(es)
            for j, a, b in zip(idx, via_r, via_g):
                for v in (a, b):
                    if v is not None:
                        d_ext[j] = v if d_ext[j] is None else d_ext[j] + v
        return (None, d_x0, *d_ext)


def _batched_g(mod: "HighwayLayers", xs: Sequence[Tensor], ext_l: Sequence[Any]) -> tuple[Tensor, list[Tensor]] | None:
    """The blocks of isomorphic layers as one ``vmap`` over the layer dim (their inputs stacked), or None when they
    cannot be stacked (the layers then run one by one)."""
    cols = list(zip(*mod.ext_of))
    try:
        with torch.enable_grad():
            xstack = torch.stack([x.detach() for x in xs]).requires_grad_()
            stacked = [torch.stack([ext_l[j] for j in col]) for col in cols]
            Z = torch.func.vmap(lambda x, *e: tuple(_as_list(mod.gs[0](x, *e))), randomness="error")(xstack, *stacked)
    except Exception as e:  # noqa: BLE001 - e.g. an op without a batching rule: run the layers one by one
        log.info("adjoint-compile highway: the layers' blocks could not be batched (%s: %s)", type(e).__name__, e)
        return None
    return xstack, list(Z)


def _as_list(z: Any) -> list[Tensor]:
    return list(z) if isinstance(z, (list, tuple)) else [z]


class HighwayLayers(torch.nn.Module):
    """A chain of L layers x_i = r_i(x_{i-1}, g_i(x_{i-1}, e), e) with Highway-BP as its backward.

    ``gs[i](x, *e) -> Z`` (a tensor or list), ``rs[i](x, *Z, *e) -> x'``; ``ext_of[i]``: which of the call's
    extra inputs (weights, other activations) layer i reads. ``dense``: some r mixes features (post-LN: r = LN(x + z)),
    so K is applied as a VJP in a loop; otherwise r is elementwise in x and K is a diagonal (a reverse linear scan).
    ``batched``: the blocks are isomorphic (``gs[0]`` computes every one of them given its layer's inputs): their
    recomputation and VJPs run as one ``vmap`` over stacked inputs.
    Called as ``(x0, *extra)``; returns the L states.
    """

    def __init__(self, gs: Sequence[torch.nn.Module], rs: Sequence[torch.nn.Module], ext_of: Sequence[Sequence[int]],
                 iterations: int, dense: bool = False, tolerance: float | None = None, batched: bool = False) -> None:
        super().__init__()
        #: the blocks are the same computation (isomorphic layers): recompute and differentiate them as one vmap
        self.batched = batched
        self.gs, self.rs = torch.nn.ModuleList(gs), torch.nn.ModuleList(rs)
        self.ext_of = [list(e) for e in ext_of]
        self.iterations, self.dense, self.tolerance = iterations, dense, tolerance
        self.stats = HighwayStats()
        self.label = ""

    def forward(self, x0: Tensor, *ext: Tensor) -> tuple[Tensor, ...]:
        return _LayersFn.apply(self, x0, *ext)
