"""A loop that runs backwards in time (``for t in reversed(range(T))``, or ``range(T - 1, -1, -1)``) and collects
its states in time order (``torch.stack(out[::-1])``, or ``out[t] = h``): the re-rolled scan runs over the flipped
steps, and the stack of the states in reverse is the scan's output flipped back. That stack was left outside the
region, keeping every state alive, and the rewrite was declined as not paying. A bidirectional layer has one such
loop beside a forward one. Each against eager in fp64."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac

D = 4


class _Backward(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.a, self.b, self.form = nn.Linear(D, D), nn.Linear(D, D), form

    def backward_states(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        T, h = x.shape[1], torch.zeros_like(x[:, 0])
        if self.form == "reversed":
            out = []
            for t in reversed(range(T)):
                h = a[:, t] * h + b[:, t]
                out.append(h)
            return torch.stack(out[::-1], 1)
        out = [None] * T
        for t in range(T - 1, -1, -1):
            h = a[:, t] * h + b[:, t]
            out[t] = h
        return torch.stack(out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backward_states(x)


class _Bidirectional(_Backward):
    def __init__(self, form: str) -> None:
        super().__init__(form)
        self.fa, self.fb = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.fa(x)), self.fb(x)
        h, fwd = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            fwd.append(h)
        return torch.stack(fwd, 1) + self.backward_states(x)


def _grads(f, model, x):
    model.zero_grad()
    (f(x) * torch.linspace(-1, 1, x.shape[1], dtype=x.dtype)[:, None]).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [_Backward, _Bidirectional])
@pytest.mark.parametrize("form", ["reversed", "indexed"])
@pytest.mark.parametrize("shard, T", [(1, 7), (5, 13)])
@pytest.mark.parametrize("wrapped", [False, True], ids=["own_forward", "called"])
def test_a_loop_backwards_in_time_is_sharded_and_exact(cls, form, shard, T, wrapped):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = cls(form).double(), torch.randn(2, T, D, dtype=torch.float64)
    target = (lambda x: model(x)) if wrapped else model
    f = torch.compile(target, backend="adjoint", options={"shard_size": shard, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _grads(f, model, x)
    want = _grads(model, model, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)
    rows = ac.report(f).regions
    assert rows and [r.rewrite for r in rows] == ["adjoint"] * len(rows), str(ac.report(f))
