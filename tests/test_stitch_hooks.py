"""Gradient hooks registered in the compiled code on values it makes (``b.register_hook(lambda g: 3 * g)``): the
hook must see the value's whole gradient. A hooked value is computed outside the sharded regions (a region's uses of
it would send their gradient around the hook), and the hook runs in the value's own partition of the inner compiler
(registered on a partition's input it was dropped). Oracle: the eager model with the same hooks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac


class _Layer(nn.Module):
    def __init__(self, hook_at: str | None, d: int = 4) -> None:
        super().__init__()
        self.norm, self.decay, self.inp, self.out = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.hook_at = hook_at

    def forward(self, x):
        u = self.norm(x)
        a, b = torch.sigmoid(self.decay(u)), self.inp(u)
        h = ac.ops.linear_scan(a, b)
        y = self.out(h)
        if self.hook_at is not None:
            {"u": u, "a": a, "b": b, "h": h, "y": y}[self.hook_at].register_hook(lambda g: 3.0 * g)
        return x + y


@pytest.mark.parametrize("at", ["u", "a", "b", "h", "y"])
@pytest.mark.parametrize("layer", [0, 1])
def test_a_hook_on_a_value_sees_its_whole_gradient(at, layer):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Layer(at if i == layer else None) for i in range(2)]).double()
    eager, x = copy.deepcopy(model), torch.randn(2, 16, 4, dtype=torch.float64)
    f = torch.compile(lambda x: model(x).square().mean(), backend="adjoint",
                      options={"shard_size": 4, "inner": "aot_eager"})
    f(x).backward()
    eager(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
    rows = ac.report(f).regions
    assert sum(r.rewrite == "adjoint" for r in rows) == (1 if at == "h" else 2), ac.report(f)
    if at == "h":  # NB: the hooked scan itself stays with autograd, and says why
        assert any("gradient hook" in r.reason for r in rows if r.rewrite == "none"), ac.report(f)


@pytest.mark.slow
def test_a_hook_between_two_grouped_layers_with_inductor():
    """The hooked value joins two layers' regions (an input of the second made by the first's): with inductor."""
    torch.manual_seed(1)
    model = nn.Sequential(_Layer(None), _Layer("b")).double()
    eager, x = copy.deepcopy(model), torch.randn(2, 16, 4, dtype=torch.float64)
    f = torch.compile(lambda x: model(x).square().mean(), backend="adjoint", options={"shard_size": 4})
    f(x).backward()
    eager(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
