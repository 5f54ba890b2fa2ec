"""A second derivative through a rewritten region raises with the reason (runtime/first_order.py), instead of the
gradient penalty silently adding nothing; a first-order backward is unchanged, and the mean over valid targets
outside the region stays differentiable twice. Against eager autograd in fp64."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.runtime.first_order import SECOND_ORDER_MESSAGE
from adjoint_compile.runtime.sharded import _MeanOverValid


class Scan(nn.Module):
    def __init__(self, d: int = 6, vocab: int = 0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab or 1)
        self.vocab = vocab

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        out = self.head(h)
        if self.vocab:
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
        return out.pow(2).mean()


def _data(vocab: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    return (x, torch.randint(0, vocab, (2, 13))) if vocab else (x,)


@pytest.mark.parametrize("vocab", [0, 7], ids=["scan", "loss_tail"])
@pytest.mark.parametrize("opts", [{"shard_size": 4}, {"mode": "truncated", "window": 3, "shard_size": 4}],
                         ids=["exact", "truncated"])
def test_gradient_penalty_raises(vocab: int, opts: dict) -> None:
    torch.manual_seed(1)
    m = Scan(vocab=vocab).double()
    step = torch.compile(m, backend="adjoint", options=opts)
    args = _data(vocab)
    got = torch.autograd.grad(step(*args), list(m.parameters()))
    if "mode" not in opts:  # the first-order gradients equal eager's (truncated ones are tested in their own file)
        ref = torch.autograd.grad(m(*args), list(m.parameters()))
        for n, (r, g) in zip([n for n, _ in m.named_parameters()], zip(ref, got)):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=n)
    rewrite = "truncated" if opts.get("mode") == "truncated" else "adjoint"
    assert any(r.rewrite == rewrite for r in ac.report(step).regions), str(ac.report(step))
    # a gradient penalty: the gradients' graph is asked for, with respect to the parameters and allow_unused
    loss = step(*args)
    # NB: the inner compiler's own backward (outside the region) may be reached first and refuse create_graph too
    with pytest.raises(RuntimeError, match="create_graph"):
        g = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        pen = sum(gi.pow(2).sum() for gi in g)
        torch.autograd.grad(loss + pen, list(m.parameters()), allow_unused=True)


def test_message_names_the_remedy() -> None:
    assert "uncompiled model" in SECOND_ORDER_MESSAGE and "create_graph" in SECOND_ORDER_MESSAGE


def test_mean_over_valid_is_twice_differentiable() -> None:
    total = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(5.0, dtype=torch.float64, requires_grad=True)
    for c in (4.0, 0.0):
        count = torch.tensor(c, dtype=torch.float64)
        # a cotangent that requires grad (a Hessian-vector product): ∂/∂w of w·t/c is t/c, and zero where every
        # target was ignored (c = 0), as eager's
        (g,) = torch.autograd.grad(_MeanOverValid.apply(total, count), total, grad_outputs=w, create_graph=True)
        (gw,) = torch.autograd.grad(g, w)
        assert float(g) == pytest.approx(5.0 / c if c else 0.0)
        assert float(gw) == pytest.approx(1.0 / c if c else 0.0)
