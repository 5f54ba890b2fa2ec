"""The windowed scan and its gradients, built from full scans restarted every W steps (no cancellation).

Forward direction, window W, 0-indexed steps; h0 is the input at index -1:

    h_t = Σ_{i=t-W+1..t} P(i, t) ⊙ b_i,     P(i, t) = Π_{j=i+1..t} a_j.

Cut the steps into blocks of W (aligned at step 0; the last may be short). A window [t-W+1, t] then lies in
t's block and the one before it, so with s the start of t's block:

    h_t = L_t + Q_t ⊙ V_t,
    L_t = Σ_{i=s..t} P(i, t) b_i            (the scan restarted at each block start)
    Q_t = Π_{j=s..t} a_j                     (running product inside the block)
    V_t = S_{t-W+1}, S_m = Σ_{i=m..e'} R_i b_i over the previous block [.., e'], R_m = Π_{j=m+1..e'} a_j
          (V_t = 0 at the block's last step: its window starts at s; in block 0, V_t = h0 while t <= W-2).

Every piece is a product or a sum of non-negative-length products: no term is subtracted. With g = ∂L/∂h and
the prefix sums G_m = Σ_{t=s..m} Q_t g_t inside a block, U_i = G_{min(i+W-1, T-1)} from the next
block (0 at a block start and in the last block), μ the adjoint restarted at each block end (μ_e = g_e, μ_m = g_m + a_{m+1} μ_{m+1}):

    ∂b_i  = μ_i + R_i U_i
    ∂a_j  = μ_j L_{j-1} + Q_{j-1} ρ_j + R_j L'_{j-1}     (terms with j-1 outside the block: L, L' → 0, Q → 1)
            ρ = the block-restarted adjoint of g ⊙ V,  L' = the block-restarted scan of b ⊙ U
    ∂h0   = G_{min(W-2, T-1)} in block 0 (0 when W = 1)

(pairs i < j <= t with t - i < W split into: both in j's block; i in the block before; t in the block after).
Reverse scans are the forward ones on flipped inputs.

``prim(a, b, h0, dim, reverse, out)`` is the full-scan primitive (reference or Triton) in the compute dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def is_full(window: int, T: int, has_h0: bool) -> bool:
    """Whether a window of ``window`` steps sees every input: W > T, or W >= T when there is no h0."""
    return window > T or (window >= T and not has_h0)


def _cdt(*xs):
    """The compute dtype (as :func:`.ref.compute_dtype`): fp32 / fp64, complex64 / complex128 with a complex input."""
    dts = {x.dtype for x in xs if x is not None}
    wide = torch.float64 in dts or torch.complex128 in dts
    if torch.complex64 in dts or torch.complex128 in dts:
        return torch.complex128 if wide else torch.complex64
    return torch.float64 if wide else torch.float32


def _every(x: Tensor, d: int, start: int, step: int) -> Tensor:
    """The view of x at steps start, start+step, ... along d."""
    idx = [slice(None)] * d + [slice(start, None, step)]
    return x[tuple(idx)]


def _blocks(d: int, T: int, W: int):
    """(view maker, scan dim) per block group: all full blocks at once, then the short tail block."""
    nb, tail = divmod(T, W)
    groups = []
    if nb:
        groups.append((lambda x: x.narrow(d, 0, nb * W).unflatten(d, (nb, W)), d + 1))
    if tail:
        groups.append((lambda x: x.narrow(d, nb * W, tail), d))
    return groups


def _const(value: float, like: Tensor, dtype) -> Tensor:
    return torch.full((), value, dtype=dtype, device=like.device).expand(like.shape)


def _seg_fwd(prim, a: Tensor, x: Tensor, d: int, W: int, init: float | None, out: Tensor) -> Tensor:
    """y_s = a_s·init + x_s at each block start s (init None: y_s = x_s), y_t = a_t y_{t-1} + x_t inside."""
    for view, dd in _blocks(d, a.shape[d], W):
        av, xv, ov = view(a), view(x), view(out)
        h0 = None if init is None else _const(init, ov.select(dd, 0), out.dtype)
        prim(av, xv, h0, dd, False, ov)
    return out


def _seg_rev_shift(prim, a: Tensor, x: Tensor, d: int, W: int, last: float | None, out: Tensor) -> Tensor:
    """y_e = x_e (or ``last``) at each block end e, y_m = x_m + a_{m+1} y_{m+1} inside the block."""
    for view, dd in _blocks(d, a.shape[d], W):
        av, xv, ov = view(a), view(x), view(out)
        n = av.shape[dd]
        ye = ov.select(dd, n - 1)
        if last is None:
            ye.copy_(xv.select(dd, n - 1))
        else:
            ye.fill_(last)
        if n > 1:
            prim(av.narrow(dd, 1, n - 1), xv.narrow(dd, 0, n - 1), ye, dd, True, ov.narrow(dd, 0, n - 1))
    return out


def _shift_back(x: Tensor, d: int, k: int, fill: Tensor | float) -> Tensor:
    """y_t = x_{t-k} (k >= 0), y_t = fill for t < k."""
    T = x.shape[d]
    y = torch.empty_like(x)
    n = min(k, T)
    if isinstance(fill, Tensor):
        y.narrow(d, 0, n).copy_(fill.unsqueeze(d).expand_as(y.narrow(d, 0, n)))
    else:
        y.narrow(d, 0, n).fill_(fill)
    if T > k:
        y.narrow(d, k, T - k).copy_(x.narrow(d, 0, T - k))
    return y


def _shift_fwd(x: Tensor, d: int, k: int) -> Tensor:
    """y_t = x_{t+k} (k >= 0), 0 past the end."""
    T = x.shape[d]
    y = torch.zeros_like(x)
    if T > k:
        y.narrow(d, 0, T - k).copy_(x.narrow(d, k, T - k))
    return y


def _pieces(prim, a: Tensor, b: Tensor, h0: Tensor | None, d: int, W: int, cdt):
    """L, Q, R, V of the module docstring (forward direction, compute dtype)."""
    a = a.to(cdt)
    b = b.to(cdt)
    zeros = _const(0.0, a, cdt)
    ones = _const(1.0, a, cdt)
    L = _seg_fwd(prim, a, b, d, W, None, torch.empty(a.shape, dtype=cdt, device=a.device))
    Q = _seg_fwd(prim, a, zeros, d, W, 1.0, torch.empty(a.shape, dtype=cdt, device=a.device))
    R = _seg_rev_shift(prim, a, zeros, d, W, 1.0, torch.empty(a.shape, dtype=cdt, device=a.device))
    S = _seg_rev_shift(prim, ones, R * b, d, W, None, torch.empty(a.shape, dtype=cdt, device=a.device))
    V = _shift_back(S, d, W - 1, 0.0 if h0 is None else h0.to(cdt))
    _every(V, d, W - 1, W).zero_()
    # NB: Q at a block's last step is a product of W a's, which no window forms (and V = 0 there): it must not
    # enter h (inf · 0 = nan where the loop is finite). Nothing else reads it (G and U stop one step short).
    _every(Q, d, W - 1, W).zero_()
    return a, b, L, Q, R, V


def _unsafe_channels(prim, a: Tensor, Q: Tensor, R: Tensor, h: Tensor, d: int, W: int) -> Tensor:
    """Channels (bool, ``a``'s shape without ``d``) where the block decomposition may differ from the per-step loop
    by more than rounding: a non-finite h, or a running product Q / R of a's that over- or underflowed (a zero
    or subnormal product with no zero a in its range, or an inf / nan one). Conservative: a channel whose products
    merely come near the fp limits is also redone."""
    tiny = torch.finfo(Q.dtype).tiny
    za = (a == 0).to(Q.dtype)
    ones = _const(1.0, a, Q.dtype)
    zq = _seg_fwd(prim, ones, za, d, W, None, torch.empty_like(Q))            # zeros of a in [s, t]
    zr = _seg_rev_shift(prim, ones, za, d, W, None, torch.empty_like(Q)).sub_(za)  # zeros in (m, e]

    def under_over(x, zeros):
        m = x.abs()
        return ~torch.isfinite(m) | ((m < tiny) & ((m != 0) | (zeros == 0)))

    qbad = under_over(Q, zq)
    _every(qbad, d, W - 1, W).fill_(False)      # Q is zeroed at block ends (module note in _pieces)
    bad = qbad | under_over(R, zr) | ~torch.isfinite(h)
    return bad.any(dim=d)


def _window_loop(a: Tensor, b: Tensor, h0: Tensor | None, W: int, keep: bool = False):
    """The windowed scan of ``[n, T]`` rows (forward direction) with exactly the per-step loop's arithmetic:
    after k rounds x_t is the loop over the k+1 inputs ending at t (fewer at the start), x_t = a_t x_{t-1} + b_t.
    O(T·W). h0 is the input at index -1 (prepended, with a = 1 unused). ``keep``: also return every round's x
    and the (prepended) a for :func:`_window_loop_bwd`."""
    if h0 is not None:
        a = torch.cat([torch.ones_like(a[:, :1]), a], 1)
        b = torch.cat([h0[:, None], b], 1)
    n = b.shape[1]
    xs = [b]
    for k in range(1, min(W, n)):
        x = xs[-1]
        x = torch.cat([x[:, :k], a[:, k:] * x[:, k - 1:n - 1] + b[:, k:]], 1)
        xs = xs + [x] if keep else [x]
    h = xs[-1][:, 1:] if h0 is not None else xs[-1]
    return (h, xs, a) if keep else h


def _window_loop_bwd(g: Tensor, xs: list, a: Tensor, has_h0: bool):
    """Reverse mode of :func:`_window_loop` (what autograd of it computes, term for term): (∂a, ∂b, ∂h0)."""
    n = a.shape[1]
    gx = torch.cat([torch.zeros_like(g[:, :1]), g], 1) if has_h0 else g
    ga = torch.zeros_like(gx)
    gb = torch.zeros_like(gx)
    for k in range(len(xs) - 1, 0, -1):
        top = gx[:, k:]
        ga[:, k:] += top * xs[k - 1][:, k - 1:n - 1]
        gb[:, k:] += top
        prev = torch.zeros_like(gx)
        prev[:, :k] = gx[:, :k]
        prev[:, k - 1:n - 1] += top * a[:, k:]
        gx = prev
    gb += gx
    if has_h0:
        return ga[:, 1:], gb[:, 1:], gb[:, 0]
    return ga, gb, None


def _redo_fwd(h: Tensor, a, b, h0, d, W, bad) -> None:
    am, bm = a.movedim(d, -1)[bad], b.movedim(d, -1)[bad]
    log.debug("windowed scan: %d channel(s) redone by the per-step loop", am.shape[0])
    h.movedim(d, -1)[bad] = _window_loop(am, bm, None if h0 is None else h0[bad].to(h.dtype), W)


def _redo_bwd(grads, g, a, b, h0, d, W, bad) -> None:
    ga, gb, gh0 = grads
    hm = None if h0 is None else h0[bad].to(ga.dtype)
    _, xs, ap = _window_loop(a.movedim(d, -1)[bad], b.movedim(d, -1)[bad], hm, W, keep=True)
    ra, rb, rh0 = _window_loop_bwd(g.movedim(d, -1)[bad], xs, ap, hm is not None)
    ga.movedim(d, -1)[bad] = ra
    gb.movedim(d, -1)[bad] = rb
    if hm is not None:
        gh0[bad] = rh0


def _windowed_fwd(prim, a, b, h0, d, W):
    cdt = _cdt(a, b, h0)
    a, b, L, Q, R, V = _pieces(prim, a, b, h0, d, W, cdt)
    h = torch.addcmul(L, Q, V, out=L)
    bad = _unsafe_channels(prim, a, Q, R, h, d, W)
    if bool(bad.any()):
        _redo_fwd(h, a, b, h0, d, W, bad)
    return h


def _windowed_bwd(prim, g, a, b, h0, d, W):
    cdt = _cdt(g, a, b, h0)
    T = a.shape[d]
    a, b, L, Q, R, V = _pieces(prim, a, b, h0, d, W, cdt)
    g = g.to(cdt)
    ones = _const(1.0, a, cdt)
    new = lambda: torch.empty(a.shape, dtype=cdt, device=a.device)  # noqa: E731
    mu = _seg_rev_shift(prim, a, g, d, W, None, new())
    G = _seg_fwd(prim, ones, Q * g, d, W, None, new())
    U = _shift_fwd(G, d, W - 1)
    # NB: a window reaching past step T-1 from the second-to-last block sees all of a short last block: G_{T-1}
    nb, tail = divmod(T, W)
    if tail and nb and W > 1:
        lo = T - W + 1
        U.narrow(d, lo, nb * W - lo).copy_(G.narrow(d, T - 1, 1).expand_as(U.narrow(d, lo, nb * W - lo)))
    _every(U, d, 0, W).zero_()
    rho = _seg_rev_shift(prim, a, g * V, d, W, None, new())
    Lp = _seg_fwd(prim, a, b * U, d, W, None, new())

    gb = torch.addcmul(mu, R, U)
    # the state "before step j inside its block": shifted by one, reset at block starts
    Lex = _shift_back(L, d, 1, 0.0)
    _every(Lex, d, 0, W).zero_()
    Lpex = _shift_back(Lp, d, 1, 0.0)
    _every(Lpex, d, 0, W).zero_()
    Qex = _shift_back(Q, d, 1, 1.0)
    _every(Qex, d, 0, W).fill_(1.0)
    ga = mu * Lex
    ga.addcmul_(Qex, rho).addcmul_(R, Lpex)
    if W >= 2 and T > 0:
        gh0 = G.select(d, min(W - 2, T - 1)).clone()
    else:
        gh0 = torch.zeros(G.select(d, 0).shape if T > 0 else _drop(G.shape, d), dtype=cdt, device=a.device)
    if T > 0:
        h = torch.addcmul(L, Q, V)
        bad = _unsafe_channels(prim, a, Q, R, h, d, W)
        bad |= ~(torch.isfinite(ga) & torch.isfinite(gb)).all(dim=d)
        if h0 is not None:
            bad |= ~torch.isfinite(gh0)
        if bool(bad.any()):
            _redo_bwd((ga, gb, gh0), g, a, b, h0, d, W, bad)
    return ga, gb, gh0


def _drop(shape, d):
    return list(shape[:d]) + list(shape[d + 1:])


def windowed_scan(prim, a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, W: int) -> Tensor:
    """The windowed scan (module docstring) in the compute dtype. a, b: [..., T, ...] along ``d``; h0: a without d."""
    if not reverse:
        return _windowed_fwd(prim, a, b, h0, d, W)
    return _windowed_fwd(prim, a.flip(d), b.flip(d), h0, d, W).flip(d)


def windowed_backward(prim, g: Tensor, a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, W: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(∂a, ∂b, ∂h0) of :func:`windowed_scan` for ∂L/∂h = g, in the compute dtype."""
    if not reverse:
        return _windowed_bwd(prim, g, a, b, h0, d, W)
    ga, gb, gh0 = _windowed_bwd(prim, g.flip(d), a.flip(d), b.flip(d), h0, d, W)
    return ga.flip(d), gb.flip(d), gh0
