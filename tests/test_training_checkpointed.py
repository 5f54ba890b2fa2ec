"""A compiled model inside non-reentrant activation checkpointing (``torch.utils.checkpoint(...,
use_reentrant=False)``), from its very first call.

The checkpoint counts the tensors its forward saves and compares them with its recomputation in the backward. The
first call also compiles, and the pipeline's trial runs (shard programs checked on real tensors, ``verify=True``'s
comparison) save tensors of their own: they must not be counted as the forward's. The oracle is eager autograd on a
copy of the model, or for the truncated backward (not plain autograd's gradient) the same compiled model without the
checkpoint.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import adjoint_compile as ac

B, D = 2, 6


class _Scan(torch.nn.Module):
    def __init__(self, p: float = 0.0, loop: bool = True):
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(D, D), torch.nn.Linear(D, D), torch.nn.Dropout(p)
        self.loop = loop

    def forward(self, x):
        x = self.drop(x)
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        if not self.loop:
            return ac.ops.linear_scan(a, b)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return torch.stack(hs, 1)


def _train(model, options, xs, checkpointed, seed=5):
    compiled = torch.compile(model, backend="adjoint", options=options)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verify's report
        for i, x in enumerate(xs):
            torch.manual_seed(seed + i)
            y = checkpoint(compiled, x, use_reentrant=False) if checkpointed else compiled(x)
            y.square().sum().backward()
            outs.append(y.detach())
    rewrite = "truncated" if options.get("mode") == "truncated" else "adjoint"
    done = {r.length for r in ac.report(compiled).regions if r.rewrite == rewrite}
    assert done >= {x.shape[1] for x in xs}, ac.report(compiled)  # each length ran rewritten
    return outs, {n: p.grad for n, p in model.named_parameters()}


def _inputs(*Ts):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, T, D, dtype=torch.float64, generator=g) for T in Ts]


@pytest.mark.parametrize("options", [
    {"shard_size": 4},
    {"shard_size": 5, "verify": True},
    {"shard_size": 4, "per_sample_clip": 1e12},  # a bound no example reaches: the gradient is the plain sum
], ids=["exact", "verify", "per_sample_clip"])
@pytest.mark.slow
def test_first_call_checkpointed_is_eager(options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scan().double()
    eager = copy.deepcopy(model)
    xs = _inputs(13, 9)  # NB: a second length compiles (or prepares) again under the checkpoint
    outs, grads = _train(model, options, xs, checkpointed=True)
    for x, y in zip(xs, outs):
        y_e = eager(x)
        y_e.square().sum().backward()
        torch.testing.assert_close(y, y_e.detach(), rtol=1e-9, atol=1e-10)
    for n, p in eager.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("options", [
    {"shard_size": 4, "mode": "truncated", "window": 3},
    {"shard_size": 4, "inner": "eager"},
], ids=["truncated", "dropout"])
@pytest.mark.slow
def test_first_call_checkpointed_is_unchecked(options):
    """The checkpoint replays the forward's random state: with dropout its masks are those of the run without it."""
    runs = []
    for checkpointed in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Scan(p=0.3).double()
        runs.append(_train(model, options, _inputs(11, 11), checkpointed))
    (outs, grads), (outs_ck, grads_ck) = runs
    for y, y_ck in zip(outs, outs_ck):
        torch.testing.assert_close(y_ck, y, rtol=1e-12, atol=1e-12)
    for n in grads:
        torch.testing.assert_close(grads_ck[n], grads[n], rtol=1e-12, atol=1e-12, msg=lambda m: f"{n}: {m}")


def test_torch_func_grad_over_the_compiled_model():
    """Without saved-tensor hooks around it the first call installs none: ``torch.func``'s transforms refuse any
    (``grad`` of a ``functional_call`` raised "don't yet support saved tensor hooks" from the backend's entry)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scan(loop=False).double()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "eager"})
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = _inputs(13)[0]

    def loss(p, module):
        return torch.func.functional_call(module, p, (x,)).square().mean()

    got, want = torch.func.grad(loss)(params, compiled), torch.func.grad(loss)(params, eager)
    for n in params:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")
