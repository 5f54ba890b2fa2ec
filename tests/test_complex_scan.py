"""Complex linear recurrences (LRU, "Resurrecting Recurrent Neural Networks"; complex gate loops): h_t = a_t ⊙ h_{t-1} + b_t
with complex a and b.

The oracle is always autograd of a plain per-step loop written here, with torch's complex convention (the gradient of a
real loss w.r.t. a complex input is the conjugate Wirtinger form): ``ac.ops.linear_scan`` against it (values and the
gradients of a, b and h0, complex64 and complex128, forward and reverse, windows, real and complex mixed), the sharded
runtime on an LRU model against the same model run eagerly (exact mode at several shard sizes, truncated mode against a
truncated oracle), the LRU written as a Python loop (re-rolled into one scan), and inductor's fallback to aot_eager.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import adjoint_compile as ac
import adjoint_compile.inner as inner_mod
from adjoint_compile.errors import AdjointCompileWarning
from adjoint_compile.runtime.sharded import make_sharded

CDT = {torch.float64: torch.complex128, torch.float32: torch.complex64}
RDT = {torch.complex128: torch.float64, torch.complex64: torch.float32}
TOL = {torch.complex128: 1e-10, torch.complex64: 1e-5, torch.float64: 1e-10, torch.float32: 1e-5}


# ---------------------------------------------------------------------------------------------------- the oracles


def loop_scan(a, b, h0=None, dim=1, reverse=False, window=None):
    """h_t = a_t h_{t-1} + b_t, one Python step at a time (windowed: only the last W inputs, h0 the input at -1)."""
    a, b = torch.broadcast_tensors(a, b)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    if reverse:
        a, b = a.flip(0), b.flip(0)
    T, hs = a.shape[0], []
    for t in range(T):
        if window is None:
            h = (b[0] if h0 is None else a[0] * h0 + b[0]) if t == 0 else a[t] * hs[-1] + b[t]
        else:
            start = t - window + 1
            h = h0 if start <= -1 else None
            for i in range(max(start, 0), t + 1):
                h = b[i] if h is None else a[i] * h + b[i]
        hs.append(h)
    h = torch.stack(hs, 0)
    return (h.flip(0) if reverse else h).movedim(0, dim)


def truncated_loop_scan(a, b, h0=None, dim=1, W=1):
    """The truncated adjoint's semantics (runtime/truncated.py): h_t recomputed from h_{t-W}.detach() over the last W
    steps (from h0, or zeros, when t - W < 0); its values are the full scan's."""
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    T = a.shape[0]
    start = torch.zeros_like(b[0]) if h0 is None else h0.expand_as(b[0])
    full, h = [], start
    for t in range(T):
        h = a[t] * h + b[t]
        full.append(h)
    out = []
    for t in range(T):
        x = full[t - W].detach() if t - W >= 0 else start
        for i in range(max(0, t - W + 1), t + 1):
            x = a[i] * x + b[i]
        out.append(x)
    return torch.stack(out, 0).movedim(0, dim)


def rel(x, y):
    x, y = x.detach(), y.detach()
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))


def decays(shape, dtype, gen):
    """Complex decays inside the unit disc: |a| in [0.3, 0.99], any phase (the LRU's parametrization)."""
    r = torch.rand(shape, generator=gen, dtype=RDT[dtype]) * 0.69 + 0.3
    phase = torch.rand(shape, generator=gen, dtype=RDT[dtype]) * 6.28
    return torch.polar(r, phase)


def crandn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=dtype)


def grads_of(fn, inputs, w):
    """Values and gradients of the real loss Re(Σ conj(w) h) + Σ |h|² w.r.t. ``inputs`` (None: unused -> zeros)."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    h = fn(*xs)
    loss = (h * w.conj()).real.sum() + (h.abs() ** 2).sum()
    g = torch.autograd.grad(loss, xs, allow_unused=True)
    return h, [torch.zeros_like(x) if gi is None else gi for x, gi in zip(xs, g)]


# --------------------------------------------------------------------------------------------------- the op itself


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 129])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_linear_scan_matches_the_loop(dtype, T, reverse):
    gen = torch.Generator().manual_seed(T + 1000 * reverse)
    a, b, h0 = decays((2, T, 3), dtype, gen), crandn((2, T, 3), dtype, gen), crandn((2, 3), dtype, gen)
    w = crandn((2, T, 3), dtype, gen)
    h, g = grads_of(lambda a, b, h0: ac.ops.linear_scan(a, b, h0, reverse=reverse), (a, b, h0), w)
    h_ref, g_ref = grads_of(lambda a, b, h0: loop_scan(a, b, h0, reverse=reverse), (a, b, h0), w)
    assert h.dtype == dtype
    assert rel(h, h_ref) < TOL[dtype]
    for name, x, y in zip("a b h0".split(), g, g_ref):
        assert x.dtype == dtype, name
        assert rel(x, y) < TOL[dtype], (name, rel(x, y))


def test_the_gradients_are_autograds_conjugate_convention():
    """One step by hand: h = a h0 + b, L = Re(conj(w) h) -> ∂a = w conj(h0), ∂h0 = conj(a) w, ∂b = w (not w's
    conjugate, not without conj(h0)): the formulas of docs/linear-scan.md."""
    a, b, h0 = (torch.tensor([[[0.3 + 0.8j]]]), torch.tensor([[[1.0 - 2.0j]]]), torch.tensor([[0.5 + 0.25j]]))
    w = torch.tensor([[[2.0 + 1.0j]]])
    xs = [x.clone().requires_grad_() for x in (a, b, h0)]
    h = ac.ops.linear_scan(*xs)
    ga, gb, gh0 = torch.autograd.grad((h * w.conj()).real.sum(), xs)
    assert torch.allclose(h, a * h0[:, None] + b)
    assert torch.allclose(gb, w) and torch.allclose(ga, w * h0.conj()[:, None])
    assert torch.allclose(gh0, a.conj()[:, 0] * w[:, 0])


@pytest.mark.parametrize("case", ["real a", "real b", "complex h0 only", "window", "reverse window", "cpu impl"])
def test_mixed_real_and_complex_and_windows(case):
    gen = torch.Generator().manual_seed(7)
    T, dt = 10, torch.complex128
    a, b, h0 = decays((2, T, 3), dt, gen), crandn((2, T, 3), dt, gen), crandn((2, 3), dt, gen)
    kw, ref_kw = {}, {}
    if case == "real a":
        a = a.abs()
    elif case == "real b":
        b = b.real.contiguous()
    elif case == "complex h0 only":
        a, b = a.abs(), b.real.contiguous()
    elif case == "window":
        kw = ref_kw = {"window": 3}
    elif case == "reverse window":
        kw = ref_kw = {"window": 4, "reverse": True}
    else:
        kw = {"impl": "cpu"}  # the C kernel is real-only: a complex scan runs the reference whatever impl says
    w = crandn((2, T, 3), dt, gen)
    h, g = grads_of(lambda a, b, h0: ac.ops.linear_scan(a, b, h0, **kw), (a, b, h0), w)
    h_ref, g_ref = grads_of(lambda a, b, h0: loop_scan(a, b, h0, **ref_kw), (a, b, h0), w)
    assert h.dtype == torch.complex128
    assert rel(h, h_ref) < 1e-12
    for name, x, y, inp in zip("a b h0".split(), g, g_ref, (a, b, h0)):
        assert x.dtype == inp.dtype, name  # a real input gets a real gradient: the real part of the complex one
        assert rel(x, y) < 1e-12, (name, rel(x, y))
