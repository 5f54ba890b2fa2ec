"""Training under ``torch.autograd.detect_anomaly()``: the shard VJPs and the loss chunks are traced on fake tensors
at the first backward of each length, where anomaly mode's NaN check would read their values. The gradients equal
the eager model's (fp64, every parameter by name), a sharded SSM and an LM with its head and loss in the region."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac

TOL = 1e-10
pytestmark = pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")


class LM(nn.Module):
    def __init__(self, V: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb, self.a, self.b, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, V)

    def forward(self, tokens):
        x = self.emb(tokens[:, :-1])
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        logits = self.head(x + h)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class SSM(LM):
    def forward(self, x):
        return (x + ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))).square().mean()


@pytest.mark.parametrize("kind", ["ssm", "lm"])
def test_gradients_under_anomaly_mode_equal_eager(kind):
    torch.manual_seed(0)
    model = (SSM() if kind == "ssm" else LM()).double()
    compiled = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    named = dict(model.named_parameters())
    for T in (13, 7):
        x = torch.randint(0, 11, (2, T + 1)) if kind == "lm" else torch.randn(2, T, 6, dtype=torch.float64)
        with torch.autograd.detect_anomaly():
            got = torch.autograd.grad(compiled(x), list(named.values()), allow_unused=True)
        want = torch.autograd.grad(model(x), list(named.values()), allow_unused=True)
        for name, g, w in zip(named, got, want):
            if w is None:
                assert g is None, name
                continue
            assert (g - w).norm() <= TOL * w.norm(), (T, name, ((g - w).norm() / w.norm()).item())
    assert any(r.rewrite == "adjoint" for r in ac.report(compiled).regions), ac.report(compiled)
