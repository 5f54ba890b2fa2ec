"""per_sample_clip with constants sized by the batch: ``x.new_zeros(B, D)`` (an RNN's initial state, a token shift's
zeros) reads x's dtype and device only, as ``torch.zeros(B, D)`` does, and a parameter applied to such a constant
(``Linear(torch.ones(B, D))`` as a learned initial state) is made for each example's batch of one. Exact against the
per-example oracles of test_lower_per_sample.py (an eager backward per example, and vmap's norms)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from test_lower_per_sample import check

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning",
                                        "ignore:.*the loss is a mean over the batch")

_INITS = {
    "zeros": lambda m, x, B, D: torch.zeros(B, D, dtype=x.dtype),
    "new_zeros": lambda m, x, B, D: x.new_zeros(B, D),
    "new_full": lambda m, x, B, D: x.new_full((B, D), 0.5),
    "linear_of_ones": lambda m, x, B, D: m.init(torch.ones(B, D, dtype=x.dtype)),
    "linear_of_new_ones": lambda m, x, B, D: m.init(x.new_ones(B, D)),
}


class _Rnn(nn.Module):
    """h_t = σ(W_a x_t) ⊙ h_{t-1} + W_b x_t from an initial state made as ``init`` says; optionally a token shift
    with zeros made by ``x.new_zeros``."""

    def __init__(self, init: str, shift: bool = False, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.kind, self.shift = init, shift
        if init.startswith("linear"):
            self.init = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        if self.shift:
            x = x + torch.cat([x.new_zeros(B, 1, D), x[:, :-1]], 1)
        h = _INITS[self.kind](self, x, B, D)
        hs = []
        for t in range(T):
            h = torch.sigmoid(self.a(x[:, t])) * h + self.b(x[:, t])
            hs.append(h)
        return self.out(torch.stack(hs, 1))


def _rows(rep) -> list[str]:
    return [r.rewrite for r in rep.regions]


@pytest.mark.parametrize("init", ["zeros", "new_zeros", "new_full"])
@pytest.mark.parametrize("T", [1, 7, 29])
def test_an_initial_state_made_by_new_zeros_is_a_constant(init, T):
    torch.manual_seed(T)
    rep = check(_Rnn(init), torch.randn(3, T, 6), clip=0.5, shard_size=4)
    if T > 13:  # NB: shorter, the rewrite would not pay here
        assert "adjoint" in _rows(rep), rep


@pytest.mark.parametrize("shard_size", [1, 4, 5])
def test_a_token_shift_with_new_zeros(shard_size):
    torch.manual_seed(shard_size)
    rep = check(_Rnn("new_zeros", shift=True), torch.randn(2, 11, 6), clip=0.5, shard_size=shard_size)
    assert "adjoint" in _rows(rep), rep


@pytest.mark.parametrize("init", ["linear_of_ones", "linear_of_new_ones"])
def test_a_parameter_applied_to_a_batch_sized_constant(init):
    """Each example's share of the initial state's parameters: the constant made for a batch of one (it raised an
    internal shape error in the backward)."""
    torch.manual_seed(5)
    rep = check(_Rnn(init), torch.randn(3, 9, 6), clip=0.5, shard_size=4)
    uses = [u for c in rep.compiled if c.per_sample is not None for u in c.per_sample.uses]
    assert any(any("init" in p for p in u["params"]) for u in uses), uses


def test_reads_no_values_names_only_factories():
    import torch.fx as fx
    from adjoint_compile.analysis.batch_axes import reads_no_values

    g = fx.Graph()
    x = g.placeholder("x")
    made = [g.call_method(m, (x, 2, 3)) for m in ("new_zeros", "new_ones", "new_empty")]
    kept = [g.call_method("add", (x, 1)), g.call_function(torch.zeros_like, (x,)),
            g.call_function(torch.ops.aten.add.Tensor, (x, x))]
    aten = g.call_function(torch.ops.aten.new_zeros.default, (x, [2, 3]))
    assert all(map(reads_no_values, made + [aten])) and not any(map(reads_no_values, kept))


class _RowsAlongTime(nn.Module):
    """A value of the parameters with one row per step, ``[T, D]``: where T == B its rows are not the examples'."""

    def __init__(self, kind: str, d: int = 6) -> None:
        super().__init__()
        self.kind, self.out = kind, nn.Linear(d, 2)
        if kind.startswith("expand"):
            self.p = nn.Parameter(torch.randn(d))
        else:
            self.w = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        c = self.p.expand(T, D) if self.kind.startswith("expand") else self.w(torch.ones(T, D, dtype=x.dtype))
        if self.kind.endswith("last"):  # NB: for a batch of one, [1, D]: the step T - 1 is not there
            return self.out(torch.tanh(x * c.cumsum(0)[T - 1]))
        c = c.cumsum(0) if self.kind.endswith("cumsum") else c * torch.arange(T, dtype=x.dtype)[:, None]
        return self.out(torch.tanh(x * c))


@pytest.mark.parametrize("kind", ["expand_cumsum", "ones_cumsum", "expand_scaled", "ones_scaled", "expand_last"])
@pytest.mark.parametrize("B", [3, 4])
def test_a_value_of_the_parameters_along_time_as_long_as_the_batch(kind, B):
    """At B == T a [T, D] value of the parameters is made for a batch of one as if its rows were examples': exact
    where its rows are alike along the way (scaled by the step), refused where they are not (a cumsum over them),
    exact at B != T."""
    torch.manual_seed(B)
    x = torch.randn(B, 4, 6)
    if B == 4 and kind.endswith(("cumsum", "last")):
        with pytest.raises(ac.PerSampleError, match="not that example's part of its run on the batch"):
            check(_RowsAlongTime(kind), x, clip=0.5)
    else:
        check(_RowsAlongTime(kind), x, clip=0.5)


@pytest.mark.parametrize("B", [2, 3])
def test_a_constant_along_time_times_a_parameter(B):
    """``x + x.new_ones(T, D) * g``: the constant's rows are steps (T == B at B = 3), its product with g every
    example's alike."""
    from test_lower_per_sample_edges import _Reordered

    torch.manual_seed(B)
    check(_Reordered("new_ones"), torch.randn(B, 3, 4), clip=0.05)


class _ZeroStateRnn(nn.Module):
    """An Elman (tanh) or GRU cell run from ``x.new_zeros(B, H)``: the first step's ``hh(h)`` is a Linear of a
    batch-sized constant, added to the input's projection (no axis broadcast: both [B, H])."""

    def __init__(self, gru: bool, d: int = 5, h: int = 4) -> None:
        super().__init__()
        self.gru, self.h = gru, h
        self.ih, self.hh = nn.Linear(d, 3 * h if gru else h), nn.Linear(h, 3 * h if gru else h)
        self.out = nn.Linear(h, 2)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.h)
        for t in range(x.shape[1]):
            if self.gru:
                (r_x, z_x, n_x), (r_h, z_h, n_h) = self.ih(x[:, t]).chunk(3, -1), self.hh(h).chunk(3, -1)
                r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
                h = (1 - z) * torch.tanh(n_x + r * n_h) + z * h
            else:
                h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
        return self.out(h)


@pytest.mark.parametrize("gru", [False, True])
@pytest.mark.parametrize("T", [1, 7])
def test_a_linear_of_a_zero_initial_state_added_to_the_input(gru, T):
    """``tanh(ih(x_t) + hh(x.new_zeros(B, H)))``, every hand-written RNN's first step: it was refused as broadcasting
    hh's value along the examples' axis. fp64, exact against one eager backward per example, clipped and summed."""
    from test_lower_per_sample import _loss

    torch.manual_seed(T + gru)
    model = _ZeroStateRnn(gru).double()
    x, clip = torch.randn(3, T, 5, dtype=torch.float64), 0.5
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = []
    for i in range(3):
        model.zero_grad()
        _loss(model(x[i:i + 1])).backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())))
        for n, p in model.named_parameters():
            want[n] += min(1.0, clip / float(norms[-1])) * p.grad
    assert max(norms) > clip, "the test should clip something"
    model.zero_grad()
    compiled = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "inner": "aot_eager"})
    _loss(compiled(x)).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(compiled), torch.stack(norms), rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
