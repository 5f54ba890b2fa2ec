"""Truncated mode with a language model's head and loss in the region (analysis/time_local.py ``ends``): the token
lookup, the head and the cross-entropy join the truncated region as they join an exact one, so the ``[B, T, V]``
logits are never whole there either; the loss runs once, with its gradient, in the forward (runtime/loss_tail.py).

Oracle: the same model run eagerly with every scan replaced by the truncated oracle of test_lower_truncated.py
(h^W_t recomputed from h_{t-W}.detach()), written apart from the package; fp64 to 1e-10 at T = 13 with shard sizes
1, 4 and 5, ignored targets at shard boundaries and whole shards of them, W = 3 and W = T (exact).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import oracle_scan
from test_lower_lm_loss import FORMS, SHARDS, T, Step, _data, _rel

import adjoint_compile as ac

#: the forms to check (each a different way into the region: flattened, [B, V, T], mean over valid targets, "none"
#: with a mask, label smoothing, a z-loss, the shift by one on logits and on padded labels)
CHECKED = ["flatten(0, 1)", "[B, V, T]", "none, mask", "label smoothing", "z-loss", "labels padded by -100, [..., 1:]",
           "logits[:, :-1], labels[:, 1:]", "class weights"]


def _oracle_step(model, W, *data):
    """The eager model with each ``linear_scan`` replaced by the truncated oracle (fp64)."""
    real = ac.ops.linear_scan
    ac.ops.linear_scan = lambda a, b, h0=None, dim=1, **k: oracle_scan(a, b, h0, dim, W)
    try:
        return model(*data)
    finally:
        ac.ops.linear_scan = real


@pytest.mark.parametrize("shard", SHARDS)
# NB: a window of the whole length (exact mode's gradients) runs with the slow tests
@pytest.mark.parametrize("W", [3, pytest.param(T, marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", CHECKED)
def test_truncated_with_the_loss_in_the_region_equals_the_oracle(form, W, shard):
    torch.manual_seed(0)
    model = Step(FORMS[form][0]).double()
    ref = copy.deepcopy(model)
    data = _data()
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"mode": "truncated", "window": W, "shard_size": shard,
                                                          "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(*data)
    want = _oracle_step(ref, W, *data)
    assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-10, (name, _rel(p.grad, q.grad))
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "truncated" for r in lin), str(rep)
    details = lin[0].details
    assert details["sums_over_time"] and details["embeddings"] and details.get("loss_tail"), details


def test_the_oracle_differs_from_exact_gradients_at_w_3():
    """Positive control: at W = 3 the truncated gradients are not the exact ones (the comparison above can fail)."""
    torch.manual_seed(0)
    model = Step(FORMS["flatten(0, 1)"][0]).double()
    data = _data()
    exact = torch.autograd.grad(model(*data), list(model.parameters()))
    trunc = torch.autograd.grad(_oracle_step(model, 3, *data), list(model.parameters()))
    assert max(_rel(a, b) for a, b in zip(trunc, exact)) > 1e-3
