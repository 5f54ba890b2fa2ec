"""Triton kernels for the linear scan; same contract as :mod:`.ref` (the spec they are tested against).

Kernels work on a canonical strided view ``[N1, N2, T, R]`` of each tensor (two batch dims, the steps, one
channel dim; any strides, stride 0 included), so the block views the windowed scan uses need no copies.
One program owns (n1, n2, a block of R channels) and walks the T steps in tiles of BLOCK_T: inside a tile
``tl.associative_scan`` with the affine combine (a1, b1)∘(a2, b2) = (a1 a2, b1 a2 + b2); between tiles the
state is carried in registers. Loads are upcast to fp32 (fp64 stays fp64); offsets are int64.

* ``_scan_kernel``: forward or reverse scan with optional h0.
* ``_scan_bwd_kernel``: the full-scan backward fused in one pass (DESIGN.md §3): μ_t = g_t + a_{t±1} μ_{t±1}
  scanned in the opposite direction, ∂b = μ, ∂a_t = μ_t h_{t∓1} (h0 at the edge), ∂h0 = a_first μ_first.

Extreme inputs: the step loop (the interpreter's default) is the per-step loop's arithmetic (first step h = b
without h0); the tiled variant multiplies up to BLOCK_T consecutive a's in a tile, so where those products
over/underflow it can differ from the loop (e.g. a = 1e-25, 1e-25, 1e25, 1e25 drops the state to 0).

On a machine without a GPU these run under ``TRITON_INTERPRET=1`` (the env var must be set before this module
is imported: Triton decides at decoration time). This module is imported lazily by the dispatcher.
"""
from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import ref as _ref
from . import window as _window

log = logging.getLogger(__name__)


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


# NB: only core builtins and our own @jit helpers inside kernels: tl.zeros / tl.sum are @jit functions of
# triton's standard library, which the interpreter fails to call when triton was imported before
# TRITON_INTERPRET was set (e.g. by torch inductor earlier in the same process).
@triton.jit
def _add(x, y):
    return x + y


@triton.jit
def _program_rows(N2, R, BLOCK_R: tl.constexpr):
    """This program's (n1, n2) and its BLOCK_R channels: (i1, i2, r, rmask), int64 offsets."""
    pid = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return pid // N2, pid % N2, r, r < R


@triton.jit
def _row(X, i1, i2, r, s1, s2, sr):
    """Pointers to the channels r of row (i1, i2) of X (step 0 for [N1, N2, T, R] tensors)."""
    return X + i1 * s1 + i2 * s2 + r * sr


@triton.jit
def _load_state(H0, i1, i2, r, rmask, s1, s2, sr,
                HAS_H0: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr):
    """The state h0 of row (i1, i2) in ACC, or zeros without h0."""
    if HAS_H0:
        h0 = tl.load(_row(H0, i1, i2, r, s1, s2, sr), mask=rmask, other=0.0).to(ACC)
    else:
        h0 = tl.full([BLOCK_R], 0, dtype=ACC)
    return h0


@triton.jit
def _visit(i, T, LAST_FIRST: tl.constexpr):
    """The i-th step visited, int64, and the visiting direction dt: (T-1-i, -1) from the last step, else (i, +1)."""
    if LAST_FIRST:
        t = tl.cast(T - 1 - i, tl.int64)
        dt = -1
    else:
        t = tl.cast(i, tl.int64)
        dt = 1
    return t, dt


@triton.jit
def _scan_kernel(A, B, H0, OUT, N2, T, R,
                 sa1, sa2, sat, sar, sb1, sb2, sbt, sbr, so1, so2, sot, sor, sh1, sh2, shr,
                 HAS_H0: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, TILED: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    i1, i2, r, rmask = _program_rows(N2, R, BLOCK_R)
    pa = _row(A, i1, i2, r, sa1, sa2, sar)
    pb = _row(B, i1, i2, r, sb1, sb2, sbr)
    po = _row(OUT, i1, i2, r, so1, so2, sor)
    # the state carried between tiles / steps starts at h0
    carry = _load_state(H0, i1, i2, r, rmask, sh1, sh2, shr, HAS_H0, ACC, BLOCK_R)
    if TILED:
        k = tl.arange(0, BLOCK_T)
        for start in range(0, T, BLOCK_T):
            kk = start + k
            t, _ = _visit(kk, T, REVERSE)
            m = (kk < T)[:, None] & rmask[None, :]
            # padding rows are the identity (a=1, b=0) and come last in scan order: the last row is the state
            a = tl.load(pa[None, :] + t[:, None] * sat, mask=m, other=1.0).to(ACC)
            b = tl.load(pb[None, :] + t[:, None] * sbt, mask=m, other=0.0).to(ACC)
            ca, cb = tl.associative_scan((a, b), 0, _combine)
            if HAS_H0:
                h = ca * carry[None, :] + cb
            else:
                # no state before step 0: the loop's first step is h = b, never a·0 (nan for a = inf)
                h = tl.where(start > 0, ca * carry[None, :] + cb, cb)
            tl.store(po[None, :] + t[:, None] * sot, h.to(OUT.dtype.element_ty), mask=m)
            carry = tl.reduce(tl.where((k == BLOCK_T - 1)[:, None], h, 0.0), 0, _add)
    else:
        for i in range(0, T):
            t, _ = _visit(i, T, REVERSE)
            a = tl.load(pa + t * sat, mask=rmask, other=1.0).to(ACC)
            b = tl.load(pb + t * sbt, mask=rmask, other=0.0).to(ACC)
            if HAS_H0:
                carry = a * carry + b
            else:
                carry = tl.where(i > 0, a * carry + b, b)
            tl.store(po + t * sot, carry.to(OUT.dtype.element_ty), mask=rmask)


@triton.jit
def _scan_bwd_kernel(G, A, H, H0, GA, GB, GH0, N2, T, R,
                     sg1, sg2, sgt, sgr, sa1, sa2, sat, sar, sh1, sh2, sht, shr, s01, s02, s0r,
                     sga1, sga2, sgat, sgar, sgb1, sgb2, sgbt, sgbr, sgh1, sgh2, sghr, first_off,
                     HAS_H0: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, TILED: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    i1, i2, r, rmask = _program_rows(N2, R, BLOCK_R)
    h0 = _load_state(H0, i1, i2, r, rmask, s01, s02, s0r, HAS_H0, ACC, BLOCK_R)
    pg = _row(G, i1, i2, r, sg1, sg2, sgr)
    pa = _row(A, i1, i2, r, sa1, sa2, sar)
    ph = _row(H, i1, i2, r, sh1, sh2, shr)
    pga = _row(GA, i1, i2, r, sga1, sga2, sgar)
    pgb = _row(GB, i1, i2, r, sgb1, sgb2, sgbr)
    # the adjoint state μ carried between tiles / steps, and μ at the forward order's first step (for ∂h0)
    carry = tl.full([BLOCK_R], 0, dtype=ACC)
    mu_first = tl.full([BLOCK_R], 0, dtype=ACC)
    if TILED:
        k = tl.arange(0, BLOCK_T)
        for start in range(0, T, BLOCK_T):
            kk = start + k
            # the adjoint visits the forward order backwards; nxt / prv: the forward order's next / previous step
            t, dt = _visit(kk, T, not REVERSE)
            nxt = t - dt
            prv = t + dt
            valid = kk < T
            m = valid[:, None] & rmask[None, :]
            mn = (valid & (nxt >= 0) & (nxt < T))[:, None] & rmask[None, :]
            mp = (valid & (prv >= 0) & (prv < T))[:, None] & rmask[None, :]
            an = tl.load(pa[None, :] + nxt[:, None] * sat, mask=mn, other=0.0).to(ACC)
            g = tl.load(pg[None, :] + t[:, None] * sgt, mask=m, other=0.0).to(ACC)
            ca, cb = tl.associative_scan((an, g), 0, _combine)
            mu = ca * carry[None, :] + cb
            hp = tl.load(ph[None, :] + prv[:, None] * sht, mask=mp, other=0.0).to(ACC)
            hp = tl.where(mp, hp, h0[None, :])
            tl.store(pgb[None, :] + t[:, None] * sgbt, mu.to(GB.dtype.element_ty), mask=m)
            ga = mu * hp
            if not HAS_H0:
                ga = tl.where(mp, ga, 0.0)   # a at the first step is unused without h0: ∂a = 0, not μ·0
            tl.store(pga[None, :] + t[:, None] * sgat, ga.to(GA.dtype.element_ty), mask=m)
            carry = tl.reduce(tl.where((k == BLOCK_T - 1)[:, None], mu, 0.0), 0, _add)
            mu_first += tl.reduce(tl.where((kk == T - 1)[:, None], mu, 0.0), 0, _add)
    else:
        # a_next: a at the forward order's next step (0 past the end), kept from the previous iteration
        an = tl.full([BLOCK_R], 0, dtype=ACC)
        for i in range(0, T):
            t, dt = _visit(i, T, not REVERSE)
            prv = t + dt
            g = tl.load(pg + t * sgt, mask=rmask, other=0.0).to(ACC)
            carry = an * carry + g
            # NB: the mask is built from a vector: the interpreter rejects vector & scalar int1 masks
            prvv = prv + tl.full([BLOCK_R], 0, dtype=tl.int64)
            has_prev = (prvv >= 0) & (prvv < T)
            hp = tl.load(ph + prv * sht, mask=rmask & has_prev, other=0.0).to(ACC)
            hp = tl.where(has_prev, hp, h0)
            tl.store(pgb + t * sgbt, carry.to(GB.dtype.element_ty), mask=rmask)
            ga = carry * hp
            if not HAS_H0:
                ga = tl.where(has_prev, ga, 0.0)   # a at the first step is unused without h0: ∂a = 0
            tl.store(pga + t * sgat, ga.to(GA.dtype.element_ty), mask=rmask)
            an = tl.load(pa + t * sat, mask=rmask, other=0.0).to(ACC)
        mu_first = carry
    # first_off: offset of the forward order's first step (0, or (T-1)·stride for reverse), int64 from the host
    a_first = tl.load(pa + first_off, mask=rmask, other=0.0).to(ACC)
    tl.store(_row(GH0, i1, i2, r, sgh1, sgh2, sghr), (a_first * mu_first).to(GH0.dtype.element_ty), mask=rmask)


# --------------------------------------------------------------------------------------------------------------
# canonical [N1, N2, T, R] views
# --------------------------------------------------------------------------------------------------------------
def _splits(lead: tuple[int, ...]):
    """Candidate (N1, N2) splits of the leading dims, one dim first (the common case)."""
    n = len(lead)
    yield math.prod(lead), 1
    for i in range(1, n):
        yield math.prod(lead[:i]), math.prod(lead[i:])


def _view4(x: Tensor, d: int, n1: int, n2: int) -> Tensor | None:
    T = x.shape[d]
    R = math.prod(x.shape[d + 1:])
    try:
        return x.view(n1, n2, T, R)
    except RuntimeError:
        return None


def _view3(x: Tensor, n1: int, n2: int) -> Tensor | None:
    try:
        return x.view(n1, n2, -1 if x.numel() else 0)
    except RuntimeError:
        return None


def _canon(xs: list[Tensor | None], d: int, states: list[Tensor | None]):
    """Views of ``xs`` (shape of a) as [N1, N2, T, R] and of ``states`` (a without d) as [N1, N2, R].

    Picks a split of the leading dims that the first tensor admits; any tensor that cannot take it as a view is
    made contiguous (a copy). Returns (views, state views, copied flags of xs).
    """
    ref = next(x for x in xs if x is not None)
    lead = tuple(ref.shape[:d])
    split = None
    for n1, n2 in _splits(lead):
        if _view4(ref, d, n1, n2) is not None:
            split = (n1, n2)
            break
    if split is None:
        split = (math.prod(lead), 1)
    n1, n2 = split
    views, copied = [], []
    for x in xs:
        if x is None:
            views.append(None)
            copied.append(False)
            continue
        v = _view4(x, d, n1, n2)
        copied.append(v is None)
        views.append(v if v is not None else _view4(x.contiguous(), d, n1, n2))
    svs = []
    for s in states:
        if s is None:
            svs.append(None)
            continue
        v = _view3(s, n1, n2)
        svs.append(v if v is not None else _view3(s.contiguous(), n1, n2))
    return views, svs, copied


#: kernel variant: None picks tiled (tl.associative_scan over BLOCK_T-step tiles) on CUDA and the step loop under
#: the interpreter, whose associative_scan runs one Python call per element; True / False force one (tests).
TILED: bool | None = None


def _config(R: int, T: int, interpret: bool) -> tuple[bool, int, int]:
    """(tiled, BLOCK_R, BLOCK_T) for a launch."""
    tiled = (not interpret) if TILED is None else TILED
    if interpret:
        # NB: the interpreter pays per program and per op, not per element: few, wide programs are fastest there.
        br = triton.next_power_of_2(max(min(R, 1024 if not tiled else 16), 1))
        return tiled, br, triton.next_power_of_2(max(min(T, 8), 1))
    return tiled, triton.next_power_of_2(max(min(R, 32), 1)), 32


def _interpreting(x: Tensor) -> bool:
    return x.device.type != "cuda"


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def prim_triton(a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, out: Tensor | None = None
                ) -> Tensor:
    """Full scan in the compute dtype written into ``out`` (allocated when None): Triton's ``blocked_scan``."""
    cdt = _ref.compute_dtype(a, b, h0)
    if out is None:
        out = torch.empty(a.shape, dtype=cdt, device=a.device)
    T = a.shape[d]
    if T == 0 or out.numel() == 0:
        return out
    (av, bv, ov), (hv,), copied = _canon([a, b, out], d, [h0])
    N1, N2, _, R = av.shape
    tiled, BR, BT = _config(R, T, _interpreting(a))
    grid = (N1 * N2, triton.cdiv(R, BR))
    hs = hv.stride() if hv is not None else (0, 0, 0)
    _scan_kernel[grid](av, bv, hv if hv is not None else av, ov, N2, T, R,
                       *av.stride(), *bv.stride(), *ov.stride(), *hs,
                       HAS_H0=hv is not None, REVERSE=reverse, ACC=_acc(cdt), TILED=tiled, BLOCK_T=BT, BLOCK_R=BR)
    if copied[2]:
        out.copy_(ov.view(out.shape))
    return out


def _full_backward_triton(grad, a, h, h0, d, reverse):
    cdt = _ref.compute_dtype(grad, a, h0)
    ga = torch.empty(a.shape, dtype=cdt, device=a.device)
    gb = torch.empty(a.shape, dtype=cdt, device=a.device)
    gh0 = torch.empty(_ref._drop(a.shape, d), dtype=cdt, device=a.device)
    T = a.shape[d]
    if T == 0 or a.numel() == 0:
        return ga, gb, gh0.zero_()
    (gv, av, hv, gav, gbv), (h0v, gh0v), copied = _canon([grad, a, h, ga, gb], d, [h0, gh0])
    N1, N2, _, R = av.shape
    tiled, BR, BT = _config(R, T, _interpreting(a))
    grid = (N1 * N2, triton.cdiv(R, BR))
    s0 = h0v.stride() if h0v is not None else (0, 0, 0)
    _scan_bwd_kernel[grid](gv, av, hv, h0v if h0v is not None else av, gav, gbv, gh0v, N2, T, R,
                           *gv.stride(), *av.stride(), *hv.stride(), *s0,
                           *gav.stride(), *gbv.stride(), *gh0v.stride(), (T - 1) * av.stride(2) if reverse else 0,
                           HAS_H0=h0v is not None, REVERSE=reverse, ACC=_acc(cdt), TILED=tiled, BLOCK_T=BT, BLOCK_R=BR)
    # ga, gb, gh0 are fresh and contiguous, so their views are never copies
    assert not copied[3] and not copied[4]
    return ga, gb, gh0


def scan_triton(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1, reverse: bool = False,
                window: int | None = None) -> Tensor:
    """The linear scan (full or windowed) with Triton kernels; same contract as :func:`.ref.scan_ref`."""
    d = dim % a.ndim
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    if window is None or _window.is_full(window, a.shape[d], h0 is not None):
        if out_dtype == _ref.compute_dtype(a, b, h0):
            return prim_triton(a, b, h0, d, reverse, None)
        # NB: the kernel stores in the output's dtype after fp32 accumulation: no fp32 round trip in memory
        return prim_triton(a, b, h0, d, reverse, torch.empty(a.shape, dtype=out_dtype, device=a.device))
    return _window.windowed_scan(prim_triton, a, b, h0, d, reverse, window).to(out_dtype)


def scan_backward_triton(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None,
                         dim: int = 1, reverse: bool = False, window: int | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (∂a, ∂b, ∂h0) with Triton kernels; same contract as :func:`.ref.scan_backward_ref`."""
    d = dim % a.ndim
    if window is None or _window.is_full(window, a.shape[d], h0 is not None):
        if h is None:
            h = prim_triton(a, b, h0, d, reverse, None)
        return _full_backward_triton(grad, a, h, h0, d, reverse)
    return _window.windowed_backward(prim_triton, grad, a, b, h0, d, reverse, window)
