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
from helpers import oracle_scan

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


# ------------------------------------------------------------------------------------------- the sharded runtime


class LRU(nn.Module):
    """A linear recurrent unit: h_t = λ ⊙ h_{t-1} + B x_t with λ = exp(-exp(ν) + i exp(θ)), y_t = Re(C h_t) + D ⊙ x_t;
    B and C complex, held as real and imaginary parameter pairs. ``scan(a, b)`` is the recurrence (the op by
    default; the loops above as oracles); ``loop=True`` writes it as a Python loop over steps instead."""

    def __init__(self, d: int = 4, n: int = 6, dtype: torch.dtype = torch.float64, loop: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        r = torch.rand(n, generator=gen, dtype=dtype) * 0.5 + 0.45              # |λ| in [0.45, 0.95]
        self.nu_log = nn.Parameter(torch.log(-torch.log(r)))
        self.theta_log = nn.Parameter(torch.log(torch.rand(n, generator=gen, dtype=dtype) * 6.28 + 0.01))
        self.B_re, self.B_im, self.C_re, self.C_im = (
            nn.Parameter(torch.randn(*s, generator=gen, dtype=dtype) / 2) for s in ((n, d), (n, d), (d, n), (d, n)))
        self.D = nn.Parameter(torch.randn(d, generator=gen, dtype=dtype))
        self.loop = loop
        self.scan = lambda a, b: ac.ops.linear_scan(a, b, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = torch.exp(-torch.exp(self.nu_log) + 1j * torch.exp(self.theta_log))
        C = torch.complex(self.C_re, self.C_im)
        if self.loop:
            B = torch.complex(self.B_re, self.B_im)
            h = torch.zeros(x.shape[0], lam.shape[0], dtype=lam.dtype)
            ys = []
            for t in range(x.shape[1]):
                h = lam * h + x[:, t].to(B.dtype) @ B.T
                ys.append((h @ C.T).real + self.D * x[:, t])
            return torch.stack(ys, 1)
        bx = torch.complex(x @ self.B_re.T, x @ self.B_im.T)          # B x_t
        h = self.scan(lam.expand_as(bx), bx)
        return (h @ C.T).real + self.D * x


def lru_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def loss_and_grads(model, fn, x):
    loss = fn(x)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def assert_close(got, want, tol):
    (l1, g1), (l2, g2) = got, want
    assert rel(l1, l2) < tol, (float(l1), float(l2))
    for (name, _), a, b in zip(LRU().named_parameters(), g1, g2):
        assert rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("dtype, T, shard", [
    (torch.float64, 13, 1), (torch.float64, 13, 4), (torch.float64, 13, 5), (torch.float64, 1, 1),
    (torch.float32, 13, 4),
])
def test_lru_sharded_matches_eager(dtype, T, shard):
    model = LRU(dtype=dtype)
    x = torch.randn(2, T, 4, dtype=dtype, generator=torch.Generator().manual_seed(T))
    step = torch.compile(lambda x: lru_loss(model, x), backend="adjoint",
                         options={"shard_size": shard, "inner": "aot_eager"})
    got = loss_and_grads(model, step, x)
    assert_close(got, loss_and_grads(model, lambda x: lru_loss(model, x), x), TOL[dtype])
    (region,) = ac.report(step).regions
    if T > shard:  # T = 1 is one shard: declined, ordinary autograd (also exact)
        assert region.rewrite == "adjoint", region.reason
        assert not region.bounds, region.bounds           # the complex ops around the scan are inside the region
        assert region.details["sums_over_time"]           # down to the loss


@pytest.mark.parametrize("T, shard", [(1, 1), (13, 1), (13, 5)])
def test_sharded_region_of_complex_ops(T, shard):
    """The runtime alone, whatever the recognition does: a region graph with complex ops on both sides of the scan,
    run by make_sharded (T = 1 included, where the backend would decline the one shard)."""
    def region(x, lam_re, lam_im, c):
        lam = torch.polar(torch.sigmoid(lam_re), lam_im)            # a complex decay per step
        b = torch.view_as_complex(torch.stack([x, x.sin()], -1))
        h = torch.ops.adjoint_compile.linear_scan.default(lam, b.conj(), None, 1, False, None, None)
        return torch.view_as_real(h * c).sum(-1) + h.abs() * h.angle() + h.imag

    gm = fx.symbolic_trace(region)
    gen = torch.Generator().manual_seed(3)
    x, lr, li = (torch.randn(2, T, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    c = torch.randn(3, generator=gen, dtype=torch.complex128)
    inputs = (x, lr, li, c)
    w = torch.randn(2, T, 3, generator=gen, dtype=torch.float64)
    got = grads_of(make_sharded(gm, [1, 1, 1, None], None, shard), inputs, w)
    want = grads_of(region, inputs, w)
    assert rel(got[0], want[0]) < 1e-12
    for a, b in zip(got[1], want[1]):
        assert rel(a, b) < 1e-10


@pytest.mark.parametrize("window", [3, 13])
def test_lru_truncated_mode(window):
    """mode="truncated": the gradient of the model whose scans restart from h_{t-W}.detach() (W >= T: exact)."""
    model = LRU()
    x = torch.randn(2, 13, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    step = torch.compile(lambda x: lru_loss(model, x), backend="adjoint",
                         options={"mode": "truncated", "window": window, "shard_size": 4, "inner": "aot_eager"})
    got = loss_and_grads(model, step, x)
    assert ac.report(step).regions[0].rewrite == "truncated"
    model.scan = lambda a, b: oracle_scan(a, b, W=window)
    want = loss_and_grads(model, lambda x: lru_loss(model, x), x)
    assert_close(got, want, 1e-10)
    if window < 13:  # and it is not the exact gradient
        model.scan = lambda a, b: loop_scan(a, b)
        exact = loss_and_grads(model, lambda x: lru_loss(model, x), x)
        assert max(rel(a, b) for a, b in zip(got[1], exact[1])) > 1e-3


def test_lru_written_as_a_loop_is_rerolled_and_exact():
    model = LRU(loop=True)
    x = torch.randn(2, 13, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    step = torch.compile(lambda x: lru_loss(model, x), backend="adjoint",
                         options={"shard_size": 4, "inner": "aot_eager"})
    got = loss_and_grads(model, step, x)
    assert_close(got, loss_and_grads(model, lambda x: lru_loss(model, x), x), 1e-10)
    rep = ac.report(step)
    (region,) = rep.regions
    assert region.source == "unrolled_loop" and region.rewrite == "adjoint", region.reason
    assert region.rerolled_from is not None
    readouts = rep.to_dict()["graphs"][0]["normalized"]["readouts"]
    assert all(v.startswith("re-rolled") for v in readouts.values()), readouts  # Re(C h_t) too: x.real batched


def test_loop_with_a_complex_constant_decay_and_real_pair_readouts():
    """h = (0.6 + 0.5j) h + x_t W: a Python complex constant is a coefficient of the re-rolled scan, and the readout
    through view_as_real and abs is re-rolled with it."""
    W = torch.randn(4, 6, dtype=torch.complex128, generator=torch.Generator().manual_seed(8), requires_grad=True)

    def f(x):
        h = torch.zeros(x.shape[0], 6, dtype=torch.complex128)
        ys = []
        for t in range(x.shape[1]):
            h = (0.6 + 0.5j) * h + x[:, t].to(torch.complex128) @ W
            ys.append(torch.view_as_real(h).sum(-1) + h.abs())
        return torch.stack(ys, 1).pow(2).mean()

    x = torch.randn(2, 13, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    step = torch.compile(f, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    loss = step(x)
    assert rel(loss, f(x)) < 1e-12
    assert rel(torch.autograd.grad(loss, W)[0], torch.autograd.grad(f(x), W)[0]) < 1e-10
    (region,) = ac.report(step).regions
    assert (region.source, region.rewrite) == ("unrolled_loop", "adjoint"), region.reason
    assert region.details["sums_over_time"]  # the readouts and the loss are inside the region


def test_complex_ops_are_time_local():
    """torch.complex, polar, view_as_complex / view_as_real, conj, real / imag, abs and angle act on each step alone:
    one region from the inputs to the loss, with no bound."""
    def f(x, p):
        lam = torch.polar(torch.sigmoid(x @ p), x.cos())
        b = torch.view_as_complex(torch.stack([x, x.sin()], -1)).conj()
        h = ac.ops.linear_scan(lam, torch.complex(b.real, b.imag * 2))
        y = torch.view_as_real(h).sum(-1) + h.abs() * h.angle() + h.imag
        return y.pow(2).mean()

    gen = torch.Generator().manual_seed(10)
    x, p = torch.randn(2, 13, 3, dtype=torch.float64, generator=gen), torch.randn(3, 3, dtype=torch.float64)
    p.requires_grad_()
    step = torch.compile(f, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    loss = step(x, p)
    (region,) = ac.report(step).regions
    assert region.rewrite == "adjoint" and not region.bounds, (region.reason, region.bounds)
    assert region.details["sums_over_time"]
    assert rel(torch.autograd.grad(loss, p)[0], torch.autograd.grad(f(x, p), p)[0]) < 1e-10


# --------------------------------------------------------------------------------------------- inductor's fallback


def _complex_view_graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    def f(x, w):
        z = torch.view_as_complex(x * 2)
        return ((z * w).real.sum(),)

    gm = fx.symbolic_trace(f)
    return gm, [torch.randn(3, 4, 2, requires_grad=True), torch.randn(4, dtype=torch.complex64)]


def _failing_inductor(monkeypatch, calls):
    import torch._inductor.compile_fx as cfx

    def fail(gm, example_inputs, *args, **kwargs):
        calls.append(gm)
        raise NotImplementedError("view_as_complex: complex views are not supported\nnode dump ...")

    monkeypatch.setattr(cfx, "compile_fx", fail)
    monkeypatch.setattr(inner_mod, "_warned", set())


def test_compile_inner_falls_back_to_aot_eager_with_one_warning(monkeypatch):
    calls: list = []
    _failing_inductor(monkeypatch, calls)
    gm, (x, w) = _complex_view_graph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fns = [inner_mod.compile_inner(gm, [x, w], "inductor") for _ in range(2)]
    ours = [c for c in caught if issubclass(c.category, AdjointCompileWarning)]
    assert len(calls) == 2 and len(ours) == 1, [str(c.message) for c in caught]
    assert "NotImplementedError: view_as_complex: complex views are not supported" in str(ours[0].message)
    assert "aot_eager" in str(ours[0].message)
    want = torch.autograd.grad(gm(x, w)[0], x)[0]
    for fn in fns:
        out = fn(x, w)[0]
        assert torch.equal(out, gm(x, w)[0])
        assert torch.allclose(torch.autograd.grad(out, x)[0], want)


def test_a_model_inductor_cannot_compile_still_trains(monkeypatch):
    """Every inner compile of the backend (partitions, shard forwards, shard VJPs) fails with inductor: all of them run
    with aot_eager, one warning in all, and the gradients are eager's."""
    calls: list = []
    _failing_inductor(monkeypatch, calls)
    model = LRU()
    x = torch.randn(2, 13, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    step = torch.compile(lambda x: lru_loss(model, x), backend="adjoint", options={"shard_size": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loss_and_grads(model, step, x)
    ours = [c for c in caught if issubclass(c.category, AdjointCompileWarning)]
    assert len(calls) >= 3 and len(ours) == 1, [str(c.message) for c in ours]
    assert ac.report(step).regions[0].rewrite == "adjoint"
    assert_close(got, loss_and_grads(model, lambda x: lru_loss(model, x), x), 1e-10)


@pytest.mark.slow
def test_lru_trains_with_inductor():
    """The default inner compiler, no monkeypatch: inductor compiles what it can (or falls back), the sharded LRU's
    gradients equal eager's and a few Adam steps lower the loss."""
    torch.manual_seed(0)
    model, ref = LRU(dtype=torch.float32), LRU(dtype=torch.float32)
    x = torch.randn(4, 24, 4)
    y = torch.roll(x, 1, 1) * 0.5
    step = torch.compile(lambda x: (model(x) - y).pow(2).mean(), backend="adjoint", options={"shard_size": 8})
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for i in range(6):
        loss = step(x)
        opt.zero_grad()
        loss.backward()
        if i == 0:
            want = torch.autograd.grad((ref(x) - y).pow(2).mean(), list(ref.parameters()))
            for p, g in zip(model.parameters(), want):
                assert rel(p.grad, g) < 1e-4
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert ac.report(step).regions[0].rewrite == "adjoint"
