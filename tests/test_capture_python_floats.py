"""Python floats that dynamo passes unspecialized (a float argument that changed between calls; a module's float
attribute under ``dynamic=True``): no crash, exact, and the region kept where the float does not reach it
(passes/stitch ``_reads_values``, passes/lower/sharded.py ``_tensor_inputs``, passes/capture/noop_ops.py
``drop_unused_float_args``). Against eager autograd in fp64, T = 13, shard size 4."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac

V, D = 11, 8


class LM(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.emb, self.a, self.b, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)
        self.form = form

    def forward(self, ids: torch.Tensor, t: torch.Tensor, x: float = 1.0) -> torch.Tensor:
        e = self.emb(ids)
        lg = self.head(ac.ops.linear_scan(torch.sigmoid(self.a(e)), self.b(e))).flatten(0, 1)
        if self.form == "scale":
            return x * F.cross_entropy(lg, t.flatten())
        if self.form == "label_smoothing":
            return F.cross_entropy(lg, t.flatten(), label_smoothing=x)
        return F.cross_entropy(lg / x, t.flatten())


def _check(model: nn.Module, f, calls) -> None:
    ref = copy.deepcopy(model)
    for args in calls:
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(*args)
        want = ref(*args)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        got.backward()
        want.backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("form", ["scale", "label_smoothing", "temperature"])
@pytest.mark.slow
def test_a_float_argument_that_changes_between_calls(form):
    torch.manual_seed(0)
    model = LM(form).double()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    ids, t = torch.randint(0, V, (2, 13)), torch.randint(0, V, (2, 13))
    _check(model, f, [(ids, t, 0.1), (ids, t, 0.2), (ids, t, 0.3)])
    # NB: where the float reaches the loss, the region of its graph ends before the loss (it cannot take the float)
    rep = ac.report(f)
    assert len(rep.compiled) >= 2 and all(r.rewrite == "adjoint" for r in rep.regions), str(rep)


def test_a_temperature_that_changes_between_calls_keeps_the_loss_in_the_region():
    """dynamo passes a float that changed as a 0-dim tensor read by ``.item()``: the region could not take the number,
    so from the second value on it ended before the loss and kept the logits. The 0-dim tensor itself is the same
    divisor; the loss stays in the region at every value."""
    torch.manual_seed(0)
    model = LM("temperature").double()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    ids, t = torch.randint(0, V, (2, 13)), torch.randint(0, V, (2, 13))
    _check(model, f, [(ids, t, 0.5), (ids, t, 0.7), (ids, t, 2.0)])
    rep = ac.report(f)
    assert len(rep.compiled) >= 2 and all(r.rewrite == "adjoint" and "its loss runs once" in r.reason
                                          for r in rep.regions), str(rep)


def test_dynamic_true_with_an_embedding_is_sharded():
    """dynamo passes nn.Embedding's norm_type as a 0-dim tensor read by .item() under dynamic=True: the region
    starting at the token lookup was never lowered (and once crashed)."""
    torch.manual_seed(0)
    model = LM("scale").double()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"}, dynamic=True)
    _check(model, f, [(torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T))) for T in (13, 21, 9)])
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), str(ac.report(f))


class _Dropped(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(D, D), nn.Linear(D, D), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x)))


def test_dynamic_true_with_a_dropout_is_sharded_and_follows_its_p():
    """dynamo passes nn.Dropout's p as a 0-dim tensor read by .item() under dynamic=True: specializing the graph
    guarded on the unknown number and nothing was rewritten. p is folded per specialization, keyed by its value: a
    changed p is never served by a graph holding the old one."""
    torch.manual_seed(0)
    model = _Dropped(0.0).double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"}, dynamic=True)
    for T in (13, 21, 9):
        x = torch.randn(2, T, D, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(x)
        torch.testing.assert_close(got, ref(x), rtol=1e-12, atol=0)
        g = torch.autograd.grad(got.square().sum(), model.a.weight)[0]
        w = torch.autograd.grad(ref(x).square().sum(), ref.a.weight)[0]
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), str(ac.report(f))
    model.drop.p = 0.999
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(torch.randn(2, 13, D, dtype=torch.float64))
    assert float((out == 0).double().mean()) > 0.9
