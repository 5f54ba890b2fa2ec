"""A number written into a copy the graph made (``t = labels.clone(); t[t == pad] = -100``) becomes a new value
(passes/capture/masked_writes.py), so that a loss that edits its targets this way no longer leaves the whole model
with ordinary autograd (the graph was refused whole: "the graph writes in place into a tensor it made"). Against
eager autograd at fp64, shards of 1, 4 and 5 steps of T = 13; writes that are not safe to turn into values keep
the old refusal and eager's results."""
from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.passes.capture.masked_writes import rewrite_masked_writes
from helpers import trace
from test_lower_lm_loss import SHARDS, V, Step, _check, _compile, _data


def _mask_pad(lg, t):
    t = t.clone()
    t[t == 3] = -100
    return F.cross_entropy(lg.flatten(0, 1), t.flatten())


def _prompt(lg, t):
    t = t.clone()
    t[:, :4] = -100  # NB: a prompt masked out: the first 4 steps of every sequence
    return F.cross_entropy(lg.flatten(0, 1), t.flatten())


def _factory_then_writes(lg, t):
    u = torch.full_like(t, 5)
    u[..., 2:] = 7
    u[u == 7] = 1
    u[1] = 2
    return F.cross_entropy(lg.flatten(0, 1), u.flatten())


def _row_mask(lg, t):
    t = t.clone()
    t[torch.tensor([True, False])] = -100  # NB: a mask of the batch axis only: whole sequences ignored
    return F.cross_entropy(lg.transpose(1, 2), t)


def _read_before(lg, t):
    t = t.clone()
    n = (t != -100).sum()  # NB: read before the write: the count of the targets as they were
    t[t == 3] = -100
    return F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum") / n


#: form -> (loss of (logits, targets), the sums over time the region takes in: the loss, and a count read before)
FORMS = {"t[t == 3] = -100": (_mask_pad, 1), "t[:, :4] = -100": (_prompt, 1),
         "full_like, then three writes": (_factory_then_writes, 1), "t[row mask] = -100": (_row_mask, 1),
         "read before the write": (_read_before, 2)}


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_targets_edited_in_place_are_exact_and_the_loss_joins_the_region(form, shard):
    torch.manual_seed(0)
    loss, sums = FORMS[form]
    _check(Step(loss).double(), shard, *_data(), n_sums=sums)


def test_the_pass_turns_each_write_into_a_value():
    """Before: ``clone``, ``eq``, ``setitem`` (and the loss reading the clone); after: no write left, the loss reads
    ``masked_fill`` (element-wise) or ``written`` (a slice), each recording its write."""
    gm = trace(lambda t: _prompt(torch.zeros(2, 13, V), t) + _mask_pad(torch.zeros(2, 13, V), t), _data()[1])
    assert sum(n.target is operator.setitem for n in gm.graph.nodes) == 2
    assert rewrite_masked_writes(gm) == 2
    assert not any(n.target is operator.setitem for n in gm.graph.nodes)
    made = [n for n in gm.graph.nodes if n.meta.get("adjoint_compile", {}).get("pass") == "masked_writes"]
    assert sorted(str(n.target) if n.op == "call_method" else n.target.__name__ for n in made) == ["masked_fill",
                                                                                                  "written"]
    t = _data()[1]
    torch.testing.assert_close(gm(t)[0], _prompt(torch.zeros(2, 13, V), t) + _mask_pad(torch.zeros(2, 13, V), t))


def _view_before(lg, t):
    t = t.clone()
    flat = t.view(-1)  # NB: a view taken before the write sees it
    t[t == 3] = -100
    return F.cross_entropy(lg.flatten(0, 1), flat)


def _cast_before(lg, t):
    t = t.clone()
    same = t.long()  # NB: already int64: ``same`` is t itself and sees the write
    t[t == 3] = -100
    return F.cross_entropy(lg.flatten(0, 1), same.flatten())


def _tensor_value(lg, t):
    t = t.clone()
    t[:, :2] = t[:, 2:4]  # NB: a tensor written, not a number
    return F.cross_entropy(lg.flatten(0, 1), t.flatten())


def _not_a_copy(lg, t):
    t = t + 0  # NB: not known to be a fresh copy here
    t[t == 3] = -100
    return F.cross_entropy(lg.flatten(0, 1), t.flatten())


def _aliased_before(alias):
    """A value sharing the copy's memory made before the write, by an op no list of views names: it sees the write."""
    def loss(lg, t):
        t = t.clone()
        a = alias(t)
        t[t == 3] = -100
        return F.cross_entropy(lg.flatten(0, 1), a.reshape(t.shape).flatten())
    loss.__name__ = f"_aliased_before_{alias.__name__}"
    return loss


def _ravel(t): return t.ravel()
def _swapdims(t): return t.swapdims(0, 1).swapdims(0, 1)
def _atleast_2d(t): return torch.atleast_2d(t)
def _positive(t): return torch.positive(t)
def _data_attr(t): return t.data
def _sum_to_size(t): return t.sum_to_size(t.shape)
def _split_part(t): return t.split(t.shape[1], 1)[0]


@pytest.mark.parametrize("loss", [_view_before, _cast_before, _tensor_value, _not_a_copy, *map(_aliased_before, [
    _ravel, _swapdims, _atleast_2d, _positive, _data_attr, _sum_to_size, _split_part])], ids=lambda f: f.__name__)
def test_writes_it_cannot_prove_safe_keep_the_refusal_and_eagers_results(loss):
    torch.manual_seed(0)
    model = Step(loss).double()
    ref = copy.deepcopy(model)
    f = _compile(model, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(*_data())
    want = ref(*_data())
    got.backward()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    rep = ac.report(f)
    assert any("writes in place into a tensor it made" in r.reason for r in rep.rejections), str(rep)


@pytest.mark.parametrize("form", ["t[t == 3] = -100", "t[:, :4] = -100"])
def test_per_example_clipping_with_targets_edited_in_place(form):
    """The same losses under per_sample_clip: each example's gradient against one eager forward per example."""
    from test_lower_lm_loss import LM
    from test_lower_per_sample_lm_loss import Step as PerExampleStep
    from test_lower_per_sample_lm_loss import check
    torch.manual_seed(0)
    check(PerExampleStep(LM(), FORMS[form][0]).double(), *_data(), shard=4)


class _LoopWithWrites(torch.nn.Module):
    """A loop over steps, each writing a number into a copy of its state (``g[g.abs() > 1] = 0``) for its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.dec = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        outs = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.dec(x[:, t])) * h + self.lin(x[:, t])
            g = h.clone()
            g[g.abs() > 1.0] = 0.0
            outs.append(g)
        return torch.stack(outs, 1)


def test_a_loop_writing_into_copies_of_its_state_is_sharded_and_exact():
    """The writes become values, so the recurrence is re-rolled and sharded (the graph was refused whole)."""
    torch.manual_seed(1)
    model = _LoopWithWrites().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager", "roll_loops": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(x)
    want = ref(x)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    rows = [r for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert rows and all(r.rewrite == "adjoint" for r in rows), str(ac.report(f))
