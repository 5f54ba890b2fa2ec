"""A loop that scores each step as it goes, the way RNN training scripts write it (``loss += criterion(head(h),
y[:, t])``), or sums anything over its steps: the sum is not a second state of the recurrence. The loop roller
(polyfills/loops.py) makes each step's term an output of the rolled step and adds the terms up after the loop
(loop_runtime.total); the per-step loss is batched over the steps (passes/capture/batching_losses.py). The
recurrence is then sharded with the head and the loss in its region. Before, the loop carried (h, loss), was
reported as a gated recurrence ("its update is not a*h + b") and kept ordinary autograd, logits included.

Against eager autograd in fp64 (the loss and every gradient to 1e-10), at odd T with shard sizes 1, 4 and 5.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.polyfills import loops
from helpers import compiled_matches_eager

D, V, B = 6, 11, 3


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)
        self.register_buffer("w", torch.linspace(0.5, 2.0, V))
        self.crit = nn.CrossEntropyLoss(ignore_index=-100)

    def gates(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        return torch.sigmoid(self.a(x)), self.b(x), torch.zeros_like(x[:, 0])


class Assign(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = ids.new_zeros((), dtype=a.dtype)
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(self.head(h), y[:, t])
        return loss / ids.shape[1]


class InPlaceOntoZero(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss += self.crit(self.head(h), y[:, t])
        return loss / ids.shape[1]


class SumOverCount(_Base):
    """Two sums: the loss summed and the targets counted (a step whose targets are all ignored adds 0 to both)."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss, n = 0.0, 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = F.cross_entropy(self.head(h), y[:, t], reduction="sum") + loss
            n = n + (y[:, t] != -100).sum()
        return loss / n


class Smoothed(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(self.head(h), y[:, t], label_smoothing=0.1)
        return loss


class Weighted(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(self.head(h), y[:, t], weight=self.w)
        return loss


class Nll(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.nll_loss(F.log_softmax(self.head(h), -1), y[:, t])
        return loss


class Collected(_Base):
    """The per-step losses appended to a list and averaged after the loop."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        out = []
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            out.append(F.cross_entropy(self.head(h), y[:, t]))
        return torch.stack(out).mean()


class StateSum(_Base):
    """A sum of the states themselves (a whole-step reduction), returned with the last state."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        total = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            total = total + h.square().sum()
        return total + h.sum()


class OneRow(_Base):
    """One unbatched sequence: each step's logits are one row [V] and its target a number."""

    def forward(self, ids, y):
        a, b, _ = self.gates(ids[0])
        h, y = torch.zeros_like(a[0]), y[0]
        loss = 0
        for t in range(ids.shape[1]):
            h = a[t] * h + b[t]
            loss = loss + F.cross_entropy(self.head(h), y[t])
        return loss


class WeightedSmoothed(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(self.head(h), y[:, t], weight=self.w, label_smoothing=0.1)
        return loss


class TupleMadeSums(_Base):
    """``+=`` onto numbers made together (``loss, n = 0.0, 0``)."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss, n = 0.0, 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss += F.cross_entropy(self.head(h), y[:, t], reduction="sum")
        return loss / ids.numel()


class StaticLoop(_Base):
    """The loop in a static method the forward calls."""

    @staticmethod
    def run(a, b, h, w, c, y):
        loss = 0
        for t in range(a.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(F.linear(h, w, c), y[:, t])
        return loss

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        return self.run(a, b, h, self.head.weight, self.head.bias, y)


FORMS = {c.__name__: c for c in (Assign, InPlaceOntoZero, SumOverCount, Smoothed, Weighted, Nll, Collected,
                                 StateSum, OneRow, WeightedSmoothed, TupleMadeSums, StaticLoop)}
#: the forms whose loss (a cross-entropy) the region takes in
LOSSES = set(FORMS) - {"StateSum"}


def _data(t: int, whole_step_ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    ids, y = torch.randint(0, V, (B, t), generator=g), torch.randint(0, V, (B, t), generator=g)
    y[1, ::3] = -100  # ignored targets, at shard boundaries among others
    if whole_step_ignored:
        y[:, t // 2] = -100
    return ids, y


def _run(name: str, t: int, shard: int, whole_step_ignored: bool = False):
    torch.manual_seed(0)
    return compiled_matches_eager(FORMS[name]().double(), *_data(t, whole_step_ignored),
                                  options={"shard_size": shard, "inner": "aot_eager"})


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_loop_that_sums_each_step_is_sharded_exactly(name):
    f = _run(name, 13, 4)
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")], str(rep)
    if name in LOSSES:
        assert rep.regions[0].details.get("sums_over_time"), str(rep)  # the head and the loss are in the region
    if name == "SumOverCount":  # NB: the count of valid targets too: an integer per step, batched like the loss
        assert len(rep.regions[0].details["sums_over_time"]) == 2, str(rep)
    (loop,) = loops.rolled()[f"{name}.{'run' if name == 'StaticLoop' else 'forward'}"]
    if name != "Collected":
        assert loop.rolled and "; sums " in loop.reason, loop


@pytest.mark.parametrize("shard", [1, 5])
@pytest.mark.parametrize("name", ["Assign", "SumOverCount"])
def test_other_shard_sizes_and_a_whole_step_ignored(name, shard):
    _run(name, 7, shard, whole_step_ignored=name == "SumOverCount")


@pytest.mark.parametrize("t", [1, 2])
def test_too_short_to_roll_runs_as_written(t):
    """Fewer than three steps: the loop runs as written, with the same values."""
    _run("InPlaceOntoZero", t, 4)


class InPlaceOntoATensor(_Base):
    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = torch.zeros((), dtype=a.dtype)
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss += F.cross_entropy(self.head(h), y[:, t])
        return loss


class ListOfStates(_Base):
    """``hs = hs + [h]``: a sum of lists, added in order as the loop does."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        hs = []
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs = hs + [h]
        return self.head(torch.stack(hs, 1)).square().mean()


FORMS.update(InPlaceOntoATensor=InPlaceOntoATensor, ListOfStates=ListOfStates)


def test_a_sum_written_into_a_tensor_made_before_the_loop_is_not_rolled():
    """``+=`` onto a tensor made before the loop writes into that tensor: not a sum the roller may move."""
    _run("InPlaceOntoATensor", 9, 4)
    (loop,) = loops.rolled()["InPlaceOntoATensor.forward"]
    assert not loop.rolled and "in-place update" in loop.reason, loop


def test_a_sum_of_lists_is_added_in_order():
    f = _run("ListOfStates", 9, 4)
    (loop,) = loops.rolled()["ListOfStates.forward"]
    assert loop.rolled and "sums hs" in loop.reason, loop
    assert ac.report(f).regions, str(ac.report(f))


class CountsToo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, hs, n = torch.zeros_like(x[:, 0]), [], []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
            n.append((h > 0).sum())
        return torch.stack(hs, 1).square().mean(), torch.stack(n)


class IntegersOfEveryWidth(nn.Module):
    """Integers per step of each dtype: a bool, an int32 and int64 values far past 2**53 of both signs (an argmax
    offset by +-2**62), which a float64 alone would round."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, hs, big, low, flags, mids = torch.zeros_like(x[:, 0]), [], [], [], [], []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
            big.append(h.argmax(-1) + (2 ** 62 + 12345))
            low.append(-(2 ** 62) - 3 * h.argmin(dim=1))
            flags.append(h[:, 0] > h[:, 1])
            mids.append((h > 0).int().sum(-1, dtype=torch.int32))
        return torch.stack(hs, 1).square().mean(), torch.stack(big), torch.stack(low), torch.stack(flags), \
            torch.stack(mids)


@pytest.mark.parametrize("model", [CountsToo, IntegersOfEveryWidth])
def test_a_loop_that_also_collects_integers_is_sharded_exactly(model):
    """An integer per step (a count, an argmax) made torch's scan fail to trace its autograd ("outs_to_grad length
    != tangents length"). The rolled step now gives them to scan as float64 (an int64 as two halves), exactly: the
    integers equal eager's bit for bit and the region is the rolled scan."""
    torch.manual_seed(0)
    model = model().double()
    ref = copy.deepcopy(model)
    x = torch.randn(B, 9, D, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    (got, *ints), (want, *expected) = f(x), ref(x)
    for n, m in zip(ints, expected):
        assert n.dtype == m.dtype and torch.equal(n, m), (n, m)
    assert abs(got - want) < 1e-12
    got.backward()
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-10
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")], str(rep)


class SumsOnly(_Base):
    """A second loop that only sums the per-step losses of logits made before it: it has no carry (torch's scan
    raised "requires init leaves", dynamo skipped the whole forward), and it reuses ``t`` (the first loop was not
    rolled: "t is read after the loop")."""

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        hs = []
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        logits = self.head(torch.stack(hs, 1))
        loss = 0
        for t in range(ids.shape[1]):
            loss = loss + F.cross_entropy(logits[:, t], y[:, t])
        return loss


FORMS["SumsOnly"] = SumsOnly


def test_a_loop_that_only_sums_runs_and_the_loop_before_it_rolls():
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f = _run("SumsOnly", 13, 4)
    assert not [w for w in said if issubclass(w.category, ac.AdjointCompileWarning)], [str(w.message) for w in said]
    first, second = loops.rolled()["SumsOnly.forward"]
    assert first.rolled and second.rolled and "sums loss" in second.reason, (first, second)
    rep = ac.report(f)
    assert [(r.source, r.rewrite) for r in rep.regions if r.kind == "linear_recurrence"] == [("scan", "adjoint")], \
        str(rep)


class Dropped(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, ids, y):
        a, b, h = self.gates(ids)
        loss = 0
        for t in range(ids.shape[1]):
            h = a[:, t] * h + b[:, t]
            loss = loss + F.cross_entropy(self.head(self.drop(h)), y[:, t])
        return loss


FORMS["Dropped"] = Dropped


def test_a_loop_refused_for_its_instance_says_so():
    """A step calling a submodule that may not trace inside torch's scan (a dropout) runs as written; rolled() said
    it was rolled."""
    _run("Dropped", 9, 4)
    (loop,) = loops.rolled()["Dropped.forward"]
    assert not loop.rolled and "self.drop (Dropout)" in loop.reason, loop


def test_an_unrolled_loop_that_sums_says_the_sum_is_not_a_state():
    """Unrolled (roll_loops=False), the loop carries (h, loss) and keeps ordinary autograd: it was reported as "a
    gated recurrence (its update is not a*h + b ...)", which h's update is. The reason says what the sum is and how
    to write it."""
    torch.manual_seed(0)
    f = compiled_matches_eager(Assign().double(), *_data(13, False),
                               options={"shard_size": 4, "inner": "aot_eager", "roll_loops": False})
    (r,) = ac.report(f).regions
    assert r.rewrite == "none" and "is a sum over the loop's steps" in r.reason and "list" in r.reason, r.reason
