"""Torch references for the linear scan: the per-step spec (:func:`naive_scan`) and the fast blocked scan.

Notation (0-indexed steps t = 0..T-1 along ``dim``; every other dim is an independent channel):

    forward:   h_t = a_t ⊙ h_{t-1} + b_t,   h_{-1} = h0 (zeros when h0 is None)
    reverse:   h_t = a_t ⊙ h_{t+1} + b_t,   h_T    = h0

The blocked scan (:func:`blocked_scan`) is exact in fp32: it splits the T steps into ``nc`` chunks of C ≈ √T
steps and runs three passes, each sequential over only C or ``nc`` steps and vectorised over everything else:

    1. per chunk k, its summary (P_k = Π a over the chunk, S_k = the chunk's scan from a zero state),
    2. the carries into each chunk: a scan of length nc over the summaries (recursively blocked),
    3. the chunk-local scan again, started from the true carry, written to the output.

Pass 3 performs exactly the per-step recurrence inside each chunk, so only the carries differ from a
sequential loop in rounding. No cumprod division, no log-space: a_t = 0 and negative a_t are fine.

:func:`scan_backward_ref` gives the gradients; the full-scan backward is one shifted scan in the other direction
(DESIGN.md §3): μ_t = g_t + a_{t+1} ⊙ μ_{t+1}, ∂a_t = μ_t ⊙ h_{t-1}, ∂b_t = μ_t, ∂h0 = a_0 ⊙ μ_0.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from . import window as _window

log = logging.getLogger(__name__)

#: below this many steps a scan is a plain per-step loop (blocking only pays off beyond it).
SEQUENTIAL_MAX_T = 48


COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def compute_dtype(*xs: Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: half-precision inputs accumulate in fp32. With a complex input the
    complex dtype of that precision: complex128 if any input is fp64 or complex128, else complex64."""
    dts = {x.dtype for x in xs if x is not None}
    wide = torch.float64 in dts or torch.complex128 in dts
    if dts & set(COMPLEX_DTYPES):
        return torch.complex128 if wide else torch.complex64
    return torch.float64 if wide else torch.float32


def is_complex_scan(*xs: Tensor | None) -> bool:
    """Whether any of the scan's tensors is complex (the scan then runs in a complex compute dtype)."""
    return any(x is not None and x.is_complex() for x in xs)


def out_dtype(a: Tensor, b: Tensor, h0: Tensor | None = None) -> torch.dtype:
    """The dtype of h: ``promote_types(a.dtype, b.dtype)``, made complex when only ``h0`` is complex."""
    dt = torch.promote_types(a.dtype, b.dtype)
    if h0 is not None and h0.is_complex() and not dt.is_complex:
        dt = torch.promote_types(dt, h0.dtype)
    return dt


def _abs(x: Tensor) -> Tensor:
    """|x| as a real tensor: in place for real x (no allocation), a new tensor for complex x."""
    return x.abs() if x.is_complex() else x.abs_()


# --------------------------------------------------------------------------------------------------------------
# the spec: one Python step per time step (and O(T·W) for windows); autograd through it is the gradient spec
# --------------------------------------------------------------------------------------------------------------
def naive_scan(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1, reverse: bool = False,
               window: int | None = None) -> Tensor:
    """Per-step loop: the specification every other implementation is tested against.

    Full scan: h_t = a_t ⊙ h_{t∓1} + b_t (∓: forward / reverse). ``window=W``: only the last W inputs count,
    h_t = Σ_{i=t-W+1..t} (Π_{j=i+1..t} a_j) ⊙ b_i, where h0 is the input at index -1 and counts when
    -1 >= t-W+1; reverse mirrors it (h0 at index T).

    Args:
        a, b: same shape ``[..., T, ...]`` with the steps along ``dim``.
        h0: shape of ``a`` without ``dim``, or None (zeros).
    Returns:
        h, shaped like ``a``, in ``promote_types(a.dtype, b.dtype)``; accumulated in fp32 (fp64 for fp64).
    Differentiable in a, b and h0 by autograd (slow: for tests and small sizes).
    """
    d = dim % a.ndim
    T = a.shape[d]
    cdt = compute_dtype(a, b, h0)
    odt = out_dtype(a, b, h0)
    a_s = [x.to(cdt) for x in a.unbind(d)]
    b_s = [x.to(cdt) for x in b.unbind(d)]
    if reverse:
        a_s, b_s = a_s[::-1], b_s[::-1]
    init = None if h0 is None else h0.to(cdt)
    hs = []
    if window is None:
        state = init
        for t in range(T):
            state = b_s[t] if state is None else a_s[t] * state + b_s[t]
            hs.append(state)
    else:
        for t in range(T):
            start = t - window + 1
            state = init if start <= -1 else None
            for i in range(max(start, 0), t + 1):
                state = b_s[i] if state is None else a_s[i] * state + b_s[i]
            hs.append(state)
    if reverse:
        hs = hs[::-1]
    if T == 0:
        return torch.empty(a.shape, dtype=odt, device=a.device)
    return torch.stack(hs, d).to(odt)


# --------------------------------------------------------------------------------------------------------------
# the blocked scan: the primitive every reference variant is built from
# --------------------------------------------------------------------------------------------------------------
def _sequential(a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, out: Tensor) -> None:
    T = a.shape[d]
    order = range(T - 1, -1, -1) if reverse else range(T)
    prev = h0
    for t in order:
        o = out.select(d, t)
        if prev is None:
            o.copy_(b.select(d, t))
        else:
            torch.addcmul(b.select(d, t), a.select(d, t), prev, out=o)
        prev = o


def blocked_scan(a: Tensor, b: Tensor, h0: Tensor | None, dim: int, reverse: bool,
                 out: Tensor | None = None) -> Tensor:
    """The full linear scan in the compute dtype, written into ``out``.

    Args:
        a, b: same shape with T steps along ``dim`` (any strides, stride-0 expanded views included); they are
            converted to the compute dtype (fp32, or fp64 for fp64 inputs) when they are not in it already.
        h0: shape of ``a`` without ``dim``, or None (zeros).
        dim: the step dim (non-negative).
        out: a tensor (any strides, may be a view) of ``a``'s shape in the compute dtype, or None to allocate.
    Returns:
        ``out``: h_t = a_t ⊙ h_{t∓1} + b_t.
    """
    d = dim
    cdt = compute_dtype(a, b, h0)
    a, b = a.to(cdt), b.to(cdt)
    if h0 is not None:
        h0 = h0.to(cdt)
    if out is None:
        out = torch.empty(a.shape, dtype=cdt, device=a.device)
    T = a.shape[d]
    if T == 0 or out.numel() == 0:
        return out
    if T <= SEQUENTIAL_MAX_T:
        _sequential(a, b, h0, d, reverse, out)
        return out

    C = math.isqrt(T - 1) + 1                      # ceil(sqrt(T))
    nc = T // C
    main = nc * C
    # NB: forward chunks start at step 0 and the < C leftover steps are a tail after them; reverse mirrors this
    # (chunks end at step T-1, the tail is at the front), so the tail is always scanned last, from the carry.
    lo = 0 if not reverse else T - main
    av = a.narrow(d, lo, main).unflatten(d, (nc, C))
    bv = b.narrow(d, lo, main).unflatten(d, (nc, C))
    ov = out.narrow(d, lo, main).unflatten(d, (nc, C))
    steps = list(range(C - 1, -1, -1)) if reverse else list(range(C))
    c0 = steps[0]

    # pass 1: chunk summaries (P: product of a, S: scan from a zero state), vectorised over chunks
    P = av.select(d + 1, c0).clone()
    S = bv.select(d + 1, c0).clone()
    for c in steps[1:]:
        ac = av.select(d + 1, c)
        S = torch.addcmul(bv.select(d + 1, c), ac, S)
        P.mul_(ac)

    # pass 2: carries. H_k = P_k ⊙ H_{k∓1} + S_k is itself a linear scan over the chunk dim: recurse.
    H = blocked_scan(P, S, h0, d, reverse)
    cin = torch.empty_like(H)
    if not reverse:
        cin.narrow(d, 1, nc - 1).copy_(H.narrow(d, 0, nc - 1))
        first = cin.select(d, 0)
    else:
        cin.narrow(d, 0, nc - 1).copy_(H.narrow(d, 1, nc - 1))
        first = cin.select(d, nc - 1)
    if h0 is None:
        first.zero_()
    else:
        first.copy_(h0)

    # pass 3: the per-step recurrence inside every chunk at once, from the true carries
    prev = cin
    for c in steps:
        o = ov.select(d + 1, c)
        torch.addcmul(bv.select(d + 1, c), av.select(d + 1, c), prev, out=o)
        if prev is cin and h0 is None:
            # the loop's first step is h = b (no a·0: a = inf must not give nan)
            k0 = 0 if not reverse else nc - 1
            o.select(d, k0).copy_(bv.select(d + 1, c).select(d, k0))
        prev = o

    # tail (< C steps) after the last chunk in scan order
    if main < T:
        last = H.select(d, nc - 1) if not reverse else H.select(d, 0)
        if not reverse:
            _sequential(a.narrow(d, main, T - main), b.narrow(d, main, T - main), last, d, False,
                        out.narrow(d, main, T - main))
        else:
            _sequential(a.narrow(d, 0, lo), b.narrow(d, 0, lo), last, d, True, out.narrow(d, 0, lo))

    # check: the carry pass 2 handed on from chunk k (H_k, from the product P_k) must agree, to rounding, with
    # pass 3's own end of chunk k (E_k, the per-step loop from the same carry). Products of a's can over- or
    # underflow where the loop does not (a = 1e-25, 1e-25, 1e25, 1e25: P = 0, the loop keeps h): channels where
    # any chunk disagrees are redone by the per-step loop, so the result is the loop's wherever it differs.
    E = ov.select(d + 1, steps[-1])
    tol = _abs(P * cin).add_(S.abs()).mul_(4 * (C + 2) * torch.finfo(cdt).eps)
    diff = _abs(H - E)
    ok = (H == E) | (torch.isnan(H) & torch.isnan(E)) | (torch.isfinite(diff) & (diff <= tol))
    bad = ~ok.all(dim=d)
    if bool(bad.any()):
        _redo_sequential(a, b, h0, d, reverse, out, bad)
    return out


def _redo_sequential(a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, out: Tensor, bad: Tensor
                     ) -> None:
    """Recompute the channels ``bad`` (a bool mask shaped like ``a`` without ``d``) with the per-step loop."""
    am, bm = a.movedim(d, -1)[bad], b.movedim(d, -1)[bad]
    om = torch.empty_like(am)
    _sequential(am, bm, None if h0 is None else h0[bad], 1, reverse, om)
    log.debug("blocked scan: %d channel(s) redone sequentially (chunk products over/underflowed)", om.shape[0])
    out.movedim(d, -1)[bad] = om


def _full_backward(prim, grad: Tensor, a: Tensor, h: Tensor, h0: Tensor | None, d: int, reverse: bool
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the full scan, given the saved output h, in the compute dtype.

    Forward direction: μ_{T-1} = g_{T-1}, μ_t = g_t + a_{t+1} ⊙ μ_{t+1} (a reverse scan over a shifted by one:
    views, no copy); ∂b = μ, ∂a_t = μ_t ⊙ h_{t-1} (h_{-1} = h0), ∂h0 = a_0 ⊙ μ_0. Reverse direction mirrors it.
    For complex scans these are the transposed formulas; :func:`backward_with` conjugates around them.
    """
    cdt = compute_dtype(grad, a, h0)
    T = a.shape[d]
    mu = torch.empty(a.shape, dtype=cdt, device=a.device)
    ga = torch.empty(a.shape, dtype=cdt, device=a.device)
    if T == 0:
        return ga, mu, torch.zeros(_drop(a.shape, d), dtype=cdt, device=a.device)
    # f / l: the first / last step in the forward scan order
    f, l = (0, T - 1) if not reverse else (T - 1, 0)
    mu.select(d, l).copy_(grad.select(d, l))
    if T > 1:
        # forward: μ on [0, T-1) from a on [1, T); reverse: μ on [1, T) from a on [0, T-1)
        s_lo, n_lo = (0, 1) if not reverse else (1, 0)
        prim(a.narrow(d, n_lo, T - 1), grad.narrow(d, s_lo, T - 1), mu.select(d, l), d, not reverse,
             mu.narrow(d, s_lo, T - 1))
        # ∂a_t = μ_t ⊙ (state before step t): h_{t-1} forward, h_{t+1} reverse
        if not reverse:
            torch.mul(mu.narrow(d, 1, T - 1), h.narrow(d, 0, T - 1), out=ga.narrow(d, 1, T - 1))
        else:
            torch.mul(mu.narrow(d, 0, T - 1), h.narrow(d, 1, T - 1), out=ga.narrow(d, 0, T - 1))
    if h0 is None:
        ga.select(d, f).zero_()
    else:
        torch.mul(mu.select(d, f), h0, out=ga.select(d, f))
    gh0 = mu.select(d, f) * a.select(d, f)
    return ga, mu, gh0


def _drop(shape: torch.Size, d: int) -> list[int]:
    return list(shape[:d]) + list(shape[d + 1:])


def _prim_ref(a, b, h0, d, reverse, out):
    return blocked_scan(a, b, h0, d, reverse, out)


def scan_ref(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1, reverse: bool = False,
             window: int | None = None) -> Tensor:
    """The linear scan (full or windowed), fast torch reference; same contract as :func:`naive_scan`.

    Returns a new contiguous tensor of ``a``'s shape in ``promote_types(a.dtype, b.dtype)``.
    """
    return forward_with(_prim_ref, a, b, h0, dim, reverse, window)


def forward_with(prim, a: Tensor, b: Tensor, h0: Tensor | None, dim: int, reverse: bool, window: int | None
                 ) -> Tensor:
    """The scan (full or windowed) built on the full-scan primitive ``prim`` (shared by the reference and the CPU
    kernel): a new contiguous tensor of ``a``'s shape in :func:`out_dtype` (``promote_types(a.dtype, b.dtype)``)."""
    d = dim % a.ndim
    odt = out_dtype(a, b, h0)
    if window is None or _window.is_full(window, a.shape[d], h0 is not None):
        h = prim(a, b, h0, d, reverse, None)
    else:
        h = _window.windowed_scan(prim, a, b, h0, d, reverse, window)
    return h.to(odt).contiguous()


def scan_backward_ref(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None,
                      dim: int = 1, reverse: bool = False, window: int | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (∂a, ∂b, ∂h0) of ``scan_ref`` given ∂L/∂h = ``grad``, in the compute dtype (caller casts).

    Args:
        grad: shape of ``a``.
        b: needed for windows (None allowed for the full scan).
        h: the forward output; needed for the full scan (recomputed from b when None).
        h0: as in the forward, or None.
    Returns:
        (∂a, ∂b, ∂h0) with ∂h0 shaped like ``a`` without ``dim`` (zeros-valued math when h0 was None).
    """
    d = dim % a.ndim
    return backward_with(_prim_ref, grad, a, b, h0, h, d, reverse, window)


def backward_with(prim, grad, a, b, h0, h, d, reverse, window):
    """Backward of the scan built on the full-scan primitive ``prim`` (shared by the reference and Triton)."""
    cplx = is_complex_scan(grad, a, b, h0)
    if cplx:
        # Complex: h is a polynomial in a, b and h0 (holomorphic), so autograd's gradient (the conjugate Wirtinger
        # one, J^H g) is conj(J^T conj(g)): the real formulas (transposes) applied to conj(g), conjugated back.
        # For the full scan that is μ_t = g_t + conj(a_{t+1}) ⊙ μ_{t+1}, ∂a_t = μ_t ⊙ conj(h_{t-1}), ∂b_t = μ_t,
        # ∂h0 = conj(a_0) ⊙ μ_0. NB: physical conjugates, never conj() views: a kernel called from a compiled graph
        # runs with the Conjugate dispatch key excluded and would read a conj view's data unconjugated.
        grad = torch.conj_physical(grad.to(compute_dtype(grad, a, b, h0)))
    if window is None or _window.is_full(window, a.shape[d], h0 is not None):
        if h is None:
            h = prim(a, b, h0, d, reverse, None)
        got = _full_backward(prim, grad, a, h, h0, d, reverse)
    else:
        got = _window.windowed_backward(prim, grad, a, b, h0, d, reverse, window)
    if cplx:
        for x in got:
            torch.conj_physical_(x)   # fresh tensors of the formulas, conjugated in place
    return got
