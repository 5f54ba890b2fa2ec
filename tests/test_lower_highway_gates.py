"""mode="highway" on gated recurrences whose gate holds no example (a learned decay per step ``sigmoid(A[t])``, one
leak for every step ``sigmoid(leak)``: [H] against [B, H] states) and whose initial state is a learned [H] vector
broadcast by the first step. The backward recomputes every step's gate at once ([T, H]): it was aligned with the
states' batch axis instead of broadcast over it (silently wrong at B == T, a shape error otherwise), and the
broadcast initial state could not be stacked with the later ones. Oracle: the levels oracle (tests/highway_oracle.py)
for k < T, eager autograd for k >= T, every parameter gradient by name."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from highway_oracle import levels_oracle

import adjoint_compile as ac

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _DecayRNN(nn.Module):
    """h_t = σ(A[t]) ⊙ h_{t-1} + tanh(W h_{t-1} + U x_t), A per step ([T, H]) or one leak ([H]); h_0 zeros or a
    learned [H] vector."""

    def __init__(self, T: int, gate: str, h0: str, d: int = 3, H: int = 4) -> None:
        super().__init__()
        self.ih, self.hh, self.H = nn.Linear(d, H), nn.Linear(H, H), H
        self.A = nn.Parameter(torch.randn(T, H) if gate == "per_step" else torch.randn(H))
        self.h0 = nn.Parameter(0.5 * torch.randn(H)) if h0 == "learned" else None

    def gate(self, t: int) -> torch.Tensor:
        return torch.sigmoid(self.A[t] if self.A.dim() == 2 else self.A)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.h0 if self.h0 is not None else x.new_zeros(x.shape[0], self.H)

    def forward(self, x):
        h, out = self.first(x), []
        for t in range(x.shape[1]):
            h = self.gate(t) * h + torch.tanh(self.hh(h) + self.ih(x[:, t]))
            out.append(h)
        return torch.stack(out, 1)


def _levels(m: _DecayRNN, x: torch.Tensor, k: int) -> torch.Tensor:
    steps = [(x[:, t], m.gate(t)) for t in range(x.shape[1])]
    h0 = m.first(x).expand(x.shape[0], m.H)
    hs = levels_oracle(lambda h, s: (s[1], torch.tanh(m.hh(h) + m.ih(s[0]))), lambda h, z: z[0] * h + z[1], h0,
                       steps, k)
    return hs.transpose(0, 1)


def _grads(fn, m: nn.Module, x: torch.Tensor, proj: torch.Tensor) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    (fn(x) * proj).sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("gate", ["per_step", "leak"])
@pytest.mark.parametrize("h0", ["zeros", "learned"])
@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("k", [1, 5])
def test_a_gate_of_no_example_matches_the_oracle(gate, h0, B, k):
    T = 5  # NB: B = 5 = T is where the misaligned gate went unnoticed
    torch.manual_seed(B + 10 * k)
    m = _DecayRNN(T, gate, h0).double()
    x, proj = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, 4, dtype=torch.float64)
    ref = copy.deepcopy(m)
    want = _grads(ref if k >= T else (lambda x: _levels(ref, x, k)), ref, x, proj)  # NB: k >= T: eager autograd
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": k, "inner": "aot_eager"})
    got = _grads(c, m, x, proj)
    assert [r.rewrite for r in ac.report(c).regions] == ["highway"], ac.report(c)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-10, msg=lambda s: f"{n}: {s}")


class _DropoutChain(nn.Module):
    def __init__(self, L: int = 4, d: int = 5) -> None:
        super().__init__()
        self.fs = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.3), nn.Linear(d, d))
                                for _ in range(L))

    def forward(self, x):
        for f in self.fs:
            x = x + f(x)
        return x


@pytest.mark.parametrize("training", [False, True])
def test_a_residual_chain_with_dropout_in_eval_mode_is_rewritten(training):
    """In eval mode a dropout is the identity and draws nothing (it was refused as drawing random numbers); in
    training mode its masks are seeded, so that the recomputed blocks draw the forward's (their gradients against
    autograd's with the same masks: tests/test_capture_dropout.py)."""
    torch.manual_seed(3)
    m = _DropoutChain().double().train(training)
    x = torch.randn(3, 5, dtype=torch.float64)
    ref = copy.deepcopy(m)
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": 4, "inner": "aot_eager"})
    torch.manual_seed(0)
    got = _grads(c, m, x, torch.ones(3, 5, dtype=torch.float64))
    rows = ac.report(c).regions
    assert [r.rewrite for r in rows] == ["highway"], ac.report(c)
    if training:
        return
    want = _grads(ref, ref, x, torch.ones(3, 5, dtype=torch.float64))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-10, msg=lambda s: f"{n}: {s}")
