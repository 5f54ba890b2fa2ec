"""Adversarial linear-scan inputs (issue 16): every CPU-available impl against the per-step loop written here.

Inputs: magnitudes at the fp limits (1e±38, subnormals, products that over/underflow), zeros, ±inf and nan,
windows 1, T-1, T, > T, T = 1 and odd T, both directions, h0, transposed / non-contiguous layouts.

Checks, per impl ("reference", "cpu", "triton" under TRITON_INTERPRET=1):

* values: the same inf / nan pattern as the loop in the same dtype, and where that loop is finite
  |h - loop| <= tol = 8·eps·(n+2)·A + 4·tiny·M·Z, A = the loop on |a|, |b|, |h0| (fp64), Z = the loop on |a| with
  b = 1, M = max(1, |b|, |h0|), n = the window length (rounding and underflow bounds of a first-order recurrence);
* gradients (eager autograd of the loop is the spec): wherever the loop's gradient is finite, ours is within the
  same kind of bound (A from the loop's autograd on absolute values).

Hypothesis runs derandomized with a fixed number of examples, so CI is deterministic.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from adjoint_compile.kernels import scan as K  # noqa: E402
from adjoint_compile.ops import linear_scan  # noqa: E402

INF, NAN = float("inf"), float("nan")
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-25, 1e25, 1e-30, 1e30, 1e38, -1e38, 3e38, 1e-40, -1e-44, 1e-45,
           1e19, 1e-19, INF, -INF, NAN]
FINITE = [x for x in SPECIAL if x == x and abs(x) != INF]


def _loop(a, b, h0, dim, reverse, window):
    return K.naive_scan(a, b, h0, dim, reverse, window)


def _cases(finite):
    pool = FINITE if finite else SPECIAL
    value = st.one_of(st.sampled_from(pool), st.floats(-2.0, 2.0, width=32))

    @st.composite
    def case(draw):
        T = draw(st.sampled_from([1, 2, 3, 5, 7, 8, 13, 49, 61]))
        C = draw(st.sampled_from([1, 2, 3]))
        n = T * C
        a = draw(st.lists(value, min_size=n, max_size=n))
        b = draw(st.lists(value, min_size=n, max_size=n))
        h0 = draw(st.one_of(st.none(), st.lists(value, min_size=C, max_size=C)))
        window = draw(st.sampled_from([None, 1, 2, 3, T - 1, T, T + 1, "rand"]))
        if window == "rand":
            window = draw(st.integers(1, T + 2))
        window = None if window is not None and window < 1 else window
        layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
        return T, C, a, b, h0, window, draw(st.booleans()), layout
    return case()


def _tensors(T, C, a, b, h0, layout, dtype):
    """a, b as [1, T, C] (dim 1) or [C, T]ᵀ / every-other-element views (non-contiguous), and the step dim."""
    def make(v):
        x = torch.tensor(v, dtype=torch.float64).to(dtype)
        if layout == "transposed":
            return x.view(C, T).t(), 0                  # [T, C], dim 0, non-contiguous
        if layout == "strided":
            return torch.stack([x, torch.zeros_like(x)], -1).view(1, T, C, 2)[..., 0], 1
        return x.view(1, T, C), 1
    (ta, d), (tb, _) = make(a), make(b)
    th0 = None
    if h0 is not None:
        th0 = torch.tensor(h0, dtype=torch.float64).to(dtype)
        th0 = th0 if layout == "transposed" else th0.view(1, C)
    return ta, tb, th0, d


def _tol(a, b, h0, d, reverse, window, dtype):
    """The rounding + underflow bound of the module docstring (fp64), shaped like h."""
    fi = torch.finfo(dtype)
    ab = lambda x: None if x is None else x.double().abs()  # noqa: E731
    A = _loop(ab(a), ab(b), ab(h0), d, reverse, window)
    Z = _loop(ab(a), torch.ones_like(ab(b)), None if h0 is None else torch.ones_like(ab(h0)), d, reverse, window)
    n = a.shape[d] if window is None else min(window, a.shape[d])
    big = [1.0] + [float(x.nan_to_num(0, 0, 0).abs().max()) for x in (b, h0) if x is not None and x.numel()]
    return 8 * fi.eps * (n + 2) * A + 4 * fi.tiny * max(big) * Z


def _assert_matches(got, loop, tol, what):
    assert torch.equal(torch.isnan(got), torch.isnan(loop)), f"{what}: nan pattern differs"
    assert torch.equal(torch.isposinf(got), torch.isposinf(loop)), f"{what}: +inf pattern differs"
    assert torch.equal(torch.isneginf(got), torch.isneginf(loop)), f"{what}: -inf pattern differs"
    fin = torch.isfinite(loop)
    err = (got.double() - loop.double()).abs()
    ok = ~fin | (err <= tol) | (got.double() == loop.double())
    assert bool(ok.all()), f"{what}: max excess {float((err - tol)[~ok].max())} at {(~ok).nonzero()[:3].tolist()}"


def _impls():
    return ["reference", "cpu", "triton"] if K.resolve_impl(None, torch.device("cpu")) == "cpu" else \
        ["reference", "triton"]


def _check_case(case, dtype, impls, grads=True):
    T, C, a_, b_, h0_, window, reverse, layout = case
    a, b, h0, d = _tensors(T, C, a_, b_, h0_, layout, dtype)
    loop = _loop(a, b, h0, d, reverse, window)
    tol = _tol(a, b, h0, d, reverse, window, dtype)
    g = torch.linspace(-1.5, 2.0, a.numel(), dtype=dtype).view(a.shape)
    if grads:
        ins = [x.detach().clone().requires_grad_() for x in (a, b) + ((h0,) if h0 is not None else ())]
        want = torch.autograd.grad(_loop(*ins[:2], ins[2] if h0 is not None else None, d, reverse, window), ins, g,
                                   allow_unused=True)
        ab = [x.detach().double().abs().requires_grad_() for x in ins]
        bound = torch.autograd.grad(_loop(*ab[:2], ab[2] if h0 is not None else None, d, reverse, window), ab,
                                    g.double().abs(), allow_unused=True)
    for impl in impls:
        ins = [x.detach().clone().requires_grad_() for x in (a, b) + ((h0,) if h0 is not None else ())]
        h = linear_scan(*ins[:2], ins[2] if h0 is not None else None, dim=d, reverse=reverse, window=window,
                        impl=impl)
        _assert_matches(h, loop, tol, f"{impl} values")
        if not grads:
            continue
        got = torch.autograd.grad(h, ins, g, allow_unused=True)
        fi = torch.finfo(dtype)
        n = T if window is None else min(window, T)
        for name, x, w, bd in zip(["a", "b", "h0"], got, want, bound):
            x = torch.zeros_like(ins[0] if name != "h0" else ins[2]) if x is None else x
            w = torch.zeros_like(x) if w is None else w
            bd = torch.zeros_like(x, dtype=torch.float64) if bd is None else bd
            fin = torch.isfinite(w)
            err = (x.double() - w.double()).abs()
            tol_g = 8 * fi.eps * (n + 2) * bd.nan_to_num(0, fi.max, fi.max) + 1e3 * fi.tiny
            ok = ~fin | (err <= tol_g)
            assert bool(ok.all()), f"{impl} ∂{name}: {x[~ok][:3].tolist()} vs loop {w[~ok][:3].tolist()}"


SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **SETTINGS)
@given(case=_cases(finite=False))
def test_fp32_extremes_match_the_loop_cpu_impls(case):
    _check_case(case, torch.float32, [i for i in _impls() if i != "triton"])


@settings(max_examples=60, **SETTINGS)
@given(case=_cases(finite=True))
def test_fp64_finite_extremes_match_the_loop(case):
    _check_case(case, torch.float64, [i for i in _impls() if i != "triton"])


@settings(max_examples=15, **SETTINGS)
@given(case=_cases(finite=False))
@pytest.mark.slow
def test_fp32_extremes_match_the_loop_triton(case):
    _check_case(case, torch.float32, ["triton"])


# ---------------------------------------------------------------------------------------------------------------
# the three probes of issue 16, as plain regression tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_window_block_product_overflow(impl):
    """W = 4, T = 8, a_3 = 1e-30, a_4 = a_5 = 1e25: no window forms a4·a5·a6·a7, so h_7 = 1e25 (was nan)."""
    a = torch.ones(1, 8, 1)
    a[0, 3], a[0, 4], a[0, 5] = 1e-30, 1e25, 1e25
    b = torch.ones(1, 8, 1)
    h = linear_scan(a, b, window=4, impl=impl)
    loop = _loop(a, b, None, 1, False, 4)
    assert float(h[0, 7, 0]) == pytest.approx(1e25, rel=1e-6)
    _assert_matches(h, loop, _tol(a, b, None, 1, False, 4, torch.float32), impl)


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_chunk_product_underflow(impl):
    """T = 100, b_0 = 1e30, a = 1e-25 at 11, 12 and 1e25 at 13, 14: the loop keeps h = 1e30 (the reference gave 0)."""
    a = torch.ones(1, 100, 1)
    a[0, 11], a[0, 12], a[0, 13], a[0, 14] = 1e-25, 1e-25, 1e25, 1e25
    b = torch.zeros(1, 100, 1)
    b[0, 0] = 1e30
    h = linear_scan(a, b, impl=impl)
    assert float(h[0, 99, 0]) == pytest.approx(1e30, rel=1e-5)
    _assert_matches(h, _loop(a, b, None, 1, False, None), _tol(a, b, None, 1, False, None, torch.float32), impl)


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("window", [None, 3])
def test_inf_in_a(impl, window):
    """a_4 = inf, b = 1: the loop gives inf at step 5 (was nan with window 3), values and gradients."""
    case = (8, 1, [1.0, 1, 1, 1, INF, 1, 1, 1], [1.0] * 8, None, window, False, "contiguous")
    _check_case(case, torch.float32, [impl])
    h = linear_scan(torch.tensor(case[2]).view(1, 8, 1), torch.ones(1, 8, 1), window=window, impl=impl)
    assert float(h[0, 5, 0]) == INF


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_inf_in_first_a_without_h0(impl):
    """The loop's first step is h = b (no a·0): a_0 = inf must not give nan (blocked path: T = 100)."""
    a = torch.full((1, 100, 2), 0.5)
    a[0, 0] = INF
    b = torch.ones(1, 100, 2)
    h = linear_scan(a, b, impl=impl)
    assert bool(torch.isfinite(h).all())
    torch.testing.assert_close(h, _loop(a, b, None, 1, False, None))
