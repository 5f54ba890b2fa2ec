"""Shard programs replayed from captured graphs (runtime/graphed.py). On a GPU a replay writes its results into the
same tensors every call; on CPU the stand-in ``replay_on_cpu`` does the same, so a sweep that kept a result across
calls (a carried state, an adjoint, a chunk's gradient) would give wrong gradients here. Against eager autograd in
fp64, over two steps with different data (the second replays the graphs the first captured) and two more lengths."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.runtime import graphed
from test_lower_lm_loss import LM, _data, _step_matches


@pytest.fixture
def stand_in(monkeypatch):
    calls = []

    def counting(fn, static_in):
        replay = graphed.replay_on_cpu(fn, static_in)

        def counted():
            calls.append(fn)
            return replay()
        return counted
    monkeypatch.setattr(graphed, "CPU_STAND_IN", counting)
    monkeypatch.setattr(graphed, "_GRAPHED", {})
    return calls


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(ids).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("options", [{"shard_size": 4}, {"shard_size": 5, "mode": "truncated", "window": 64}])
def test_replayed_programs_give_autograd_gradients(stand_in, options):
    torch.manual_seed(0)
    model = Step().double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={**options, "inner": "inductor", "cuda_graphs": True})
    # NB: two steps at T = 13, then two more lengths: one graph then serves every length, its programs shared
    for seed, t in ((0, 13), (1, 13), (2, 9), (3, 22)):
        _step_matches(f, model, ref, *_data(seed, t))
    # the forward, the recompute + VJP and the loss chunk programs (per shard length), replayed shard after shard
    assert len(graphed._GRAPHED) >= 3, graphed._GRAPHED
    assert len(stand_in) >= 2 * len(graphed._GRAPHED), len(stand_in)
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)


def test_without_the_option_nothing_is_graphed(stand_in):
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = torch.compile(Step().double(), backend="adjoint", options={"shard_size": 4, "inner": "inductor"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(*_data()).backward()
    assert not graphed._GRAPHED and not stand_in


def test_only_inductor_programs_on_cuda_are_graphed():
    x = torch.zeros(3)
    assert not graphed.graphable([x, None], "inductor")  # CPU tensors, no stand-in
    assert not graphed.graphable([x], "aot_eager")
    assert not graphed.graphable([None, 1], "inductor")
