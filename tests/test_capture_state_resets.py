"""A loop that resets its state by a mask (an episode ends, a document starts): ``h = torch.where(done, 0, h)``,
``h.masked_fill(done, 0)``, ``torch.where(keep, h, torch.zeros_like(h))``, a reset to a learned state. Selecting
by a mask free of the state is linear in the state, so the loop is an ordinary linear recurrence with the selected
coefficient (analysis/affine.py's ``Select``); a mask computed from the state is a nonlinearity and stays with
autograd. Each form against the eager model, fp64 to 1e-10, every gradient by name; gated loops with a reset under
Highway-BP against the levels oracle."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from highway_oracle import levels_oracle

import adjoint_compile as ac
from adjoint_compile.analysis import affine
from adjoint_compile.analysis.fx import reachable
from helpers import trace

TOL = 1e-10
D = 5


def _reset(form: str, h, d, h0):
    if form == "where":
        return torch.where(d, 0.0, h)
    if form == "masked_fill":
        return h.masked_fill(d, 0.0)
    if form == "method_where":
        return h.where(~d, 0.0)
    if form == "keep_zeros_like":
        return torch.where(~d, h, torch.zeros_like(h))
    if form == "learned_state":
        return torch.where(d, h0, h)
    if form == "decay_at_reset":  # two constant branches: where(d, 0.9, 1.0) must be made in the state's dtype
        return torch.where(d, 0.9 * h, h)
    raise AssertionError(form)


class Loop(nn.Module):
    """h_t = a_t ⊙ reset(h_{t-1}) + b_t, a per-step readout summed into the loss."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a, self.b, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.h0 = nn.Parameter(torch.randn(D)) if form == "learned_state" else None

    def forward(self, x, done):
        B, T, _ = x.shape
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, outs = x.new_zeros(B, D), []
        for t in range(T):
            h = a[:, t] * _reset(self.form, h, done[:, t, None], self.h0) + b[:, t]
            outs.append(h)
        return self.out(torch.stack(outs, 1)).square().mean()


class UpdateThenReset(Loop):
    """The reset after the update: h_t = where(done_t, b_t, a_t ⊙ h_{t-1} + b_t)."""

    def forward(self, x, done):
        B, T, _ = x.shape
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, outs = x.new_zeros(B, D), []
        for t in range(T):
            h = torch.where(done[:, t, None], b[:, t], a[:, t] * h + b[:, t])
            outs.append(h)
        return self.out(torch.stack(outs, 1)).square().mean()


def _inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    done = torch.rand(3, T, generator=g) < 0.3
    done[1, 4:8] = True  # a whole shard of 4 reset at every step
    done[2, 0] = True
    return x, done


def _check_exact(model: nn.Module, T: int, S: int):
    x, done = _inputs(T)
    named = dict(model.named_parameters())
    want_loss = model(x, done)
    want = torch.autograd.grad(want_loss, [x, *named.values()])
    compiled = torch.compile(model, backend="adjoint", options={"shard_size": S, "inner": "aot_eager"})
    loss = compiled(x, done)
    got = torch.autograd.grad(loss, [x, *named.values()])
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    for name, g, w in zip(["x", *named], got, want):
        assert (g - w).norm() <= TOL * w.norm(), (name, ((g - w).norm() / w.norm()).item())
    return ac.report(compiled)


FORMS = ["where", "masked_fill", "method_where", "keep_zeros_like", "learned_state", "decay_at_reset"]


@pytest.mark.parametrize("form", FORMS)
def test_a_reset_in_the_loop_is_sharded_exactly(form):
    torch.manual_seed(0)
    rep = _check_exact(Loop(form).double(), T=13, S=4)
    [r] = rep.regions
    assert r.kind == "linear_recurrence" and r.rewrite == "adjoint", rep


@pytest.mark.parametrize("T,S", [(13, 1), (7, 5), (2, 1)])
def test_shard_sizes_and_short_loops(T, S):
    torch.manual_seed(1)
    rep = _check_exact(Loop("where").double(), T=T, S=S)
    assert [r.rewrite for r in rep.regions] == ["adjoint"], rep


def test_the_reset_after_the_update():
    torch.manual_seed(2)
    rep = _check_exact(UpdateThenReset("where").double(), T=11, S=4)
    assert [r.rewrite for r in rep.regions] == ["adjoint"], rep


class StateMask(nn.Module):
    """where(h > 0, h, 0.5 h): the mask reads the state, so the update is a leaky ReLU of it, not linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, done):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, outs = x.new_zeros(x.shape[0], D), []
        for t in range(x.shape[1]):
            h = a[:, t] * torch.where(h > 0, h, 0.5 * h) + b[:, t]
            outs.append(h)
        return torch.stack(outs, 1).square().mean()


def test_a_mask_read_from_the_state_is_not_linear():
    torch.manual_seed(3)
    rep = _check_exact(StateMask().double(), T=9, S=4)
    assert not any(r.rewrite == "adjoint" for r in rep.regions), rep
    assert "not linear in the carry" in str(rep), rep


def test_the_selected_coefficient_evaluates_to_the_step():
    """The affine algebra's a and b of ``where(m, 0, h) * a + b`` give the step's new state for any h."""
    def step(h, a, b, m):
        return torch.where(m, 0.0, h) * a + b

    args = (torch.randn(4, 3, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64),
            torch.randn(4, 3, dtype=torch.float64), torch.rand(4, 1) < 0.5)
    gm = trace(step, *args)
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}  # NB: dynamo orders them by first use
    ph = [ph[f"l_{k}_"] for k in "habm"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    form = affine.classify_update(out, ph[0], reachable([ph[0]]).__contains__)
    assert form.kind == "linear", form
    env = dict(zip(ph, args)).__getitem__
    coef, offset = form.coef.evaluate(env), form.offset.evaluate(env)
    assert torch.equal(coef * args[0] + offset, step(*args))
    assert any(isinstance(e, affine.Select) for e in getattr(form.coef, "factors", (form.coef,)))


class GatedReset(nn.Module):
    """A GRU-like gated update after a reset: z = σ(W x_t + U h'), h' = where(done_t, 0, h), h_t = (1 - z) h' + z c_t."""

    def __init__(self) -> None:
        super().__init__()
        self.wz, self.uz, self.wc = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)

    def g(self, h, xt):
        x, d = xt
        hr = torch.where(d, 0.0, h)
        z = torch.sigmoid(self.wz(x) + self.uz(hr))
        return (1 - z) * torch.where(d, 0.0, torch.ones_like(h)), z * torch.tanh(self.wc(x))

    def forward(self, x, done):
        h, outs = x.new_zeros(x.shape[0], D), []
        for t in range(x.shape[1]):
            d = done[:, t, None]
            h = torch.where(d, 0.0, h)
            z = torch.sigmoid(self.wz(x[:, t]) + self.uz(h))
            h = (1 - z) * h + z * torch.tanh(self.wc(x[:, t]))
            outs.append(h)
        return torch.stack(outs, 1)


@pytest.mark.parametrize("k", [2, 9])
def test_a_gated_loop_with_a_reset_under_highway_bp(k):
    torch.manual_seed(4)
    model = GatedReset().double()
    x, done = _inputs(9)
    named = dict(model.named_parameters())
    w = torch.randn(3, 9, D, dtype=torch.float64)
    xs = [(x[:, t], done[:, t, None]) for t in range(9)]
    levels = levels_oracle(model.g, lambda h, Z: Z[0] * h + Z[1], x.new_zeros(3, D), xs, k)
    want = torch.autograd.grad((levels.transpose(0, 1) * w).sum(), [x, *named.values()])
    compiled = torch.compile(model, backend="adjoint", options={"mode": "highway", "iterations": k,
                                                                "inner": "aot_eager"})
    got = torch.autograd.grad((compiled(x, done) * w).sum(), [x, *named.values()])
    for name, g, e in zip(["x", *named], got, want):
        assert (g - e).norm() <= TOL * e.norm(), (name, ((g - e).norm() / e.norm()).item())
    assert [r.rewrite for r in ac.report(compiled).regions] == ["highway"]
