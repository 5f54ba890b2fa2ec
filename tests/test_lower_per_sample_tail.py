"""per_sample_clip on a language model whose loss is split off its sharded region: the head and the loss run once,
in the forward, chunk by chunk, with the loss's gradient and the head's per-example gradients (scaled by the loss's
cotangent in the backward); the rest of the region is swept without them. Every p.grad and the norms equal the
oracle of tests/test_lower_per_sample_lm_loss.py (plain eager autograd, one copy of the parameters per example) in
fp64 to 1e-8, at T = 13 with shard sizes 1, 4 and 5, targets ignored at shard boundaries, in whole shards and for a
whole example; and the split really runs (its chunk function is called, the report lists the loss tail).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.runtime import loss_tail
from adjoint_compile.runtime.sharded import ShardedRegion
from test_lower_lm_loss import FORMS, LM
from test_lower_per_sample_lm_loss import Step, _ce, _data, _data3, check


@pytest.fixture
def tail_chunks(monkeypatch):
    """The number of loss chunks run with per-example gradients."""
    calls = [0]
    real = loss_tail.tail_example_grads

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(loss_tail, "tail_example_grads", counted)
    return calls


def _split_rows(rep: ac.Report) -> list[dict]:
    return [r.details["loss_tail"] for r in rep.regions if r.rewrite == "adjoint" and "loss_tail" in r.details]


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied head"])
@pytest.mark.parametrize("shard", [1, 4, 5])
def test_the_loss_runs_once_with_the_heads_per_example_gradients(shard, tied, tail_chunks):
    """reduction="sum" with label smoothing: the split runs (13 steps in chunks of at most the shard size) and the
    clipped sum and the norms are the oracle's; a tied head's two uses (the lookup in the sweep, the head in the
    loss) are summed per example before the norm."""
    torch.manual_seed(3)
    rep = check(Step(LM(tied=tied), _ce("sum", label_smoothing=0.1)).double(), *_data3(), shard=shard)
    rows = _split_rows(rep)
    assert rows and all(r["chunk"] <= shard and r["steps"] == 13 for r in rows), str(rep)
    assert tail_chunks[0] >= -(-13 // shard), tail_chunks


@pytest.mark.parametrize("form", ["flatten(0, 1)", "[B, V, T]", "logits[:, :-1], labels[:, 1:]"])
def test_a_mean_over_valid_targets_and_the_shift(form, tail_chunks):
    """A mean over the targets not ignored (its count made in the loss's chunks, divided outside) and the shift by
    one: the split's loss as the sweep's was."""
    torch.manual_seed(4)
    rep = check(Step(LM(), FORMS[form][0]).double(), *_data(), shard=4)
    assert _split_rows(rep) and tail_chunks[0] > 0, str(rep)


def test_the_losss_cotangent_scales_the_heads_per_example_gradients(tail_chunks):
    """The loss times 3 outside the compiled code: the per-example gradients made in the forward are scaled in the
    backward (norms 3x those of the loss alone; the clip then cuts other examples)."""
    torch.manual_seed(5)
    model = Step(LM(), lambda lg, t: (F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum"),)).double()
    check(model, *_data3(), shard=5, weights=[3.0])
    assert tail_chunks[0] > 0


def test_two_losses_keep_the_loss_in_the_sweep(tail_chunks):
    """Cross-entropy and a z-loss as two sums the region ends in: their per-example gradients would need one
    backward each, so the loss stays in the sweep (recomputed there, as before), exact."""
    torch.manual_seed(6)
    rep = check(Step(LM(), FORMS["z-loss"][0]).double(), *_data(), shard=4)
    assert not _split_rows(rep) and tail_chunks[0] == 0, str(rep)


def test_the_split_programs_record_the_parameters_they_read():
    """The rest records the embedding and the layers, not the final norm and the head it no longer reads; the tail
    records those three."""
    torch.manual_seed(7)
    model = Step(LM(), _ce("sum")).double()
    ids, tg = _data3()
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "shard_size": 4,
                                                          "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(ids, tg).backward()
    regions = [m for rec in ac.report(f).compiled for m in rec.fn.fn.modules() if isinstance(m, ShardedRegion)]
    split = [r.tail for r in regions if r.tail is not None]
    assert len(split) == 1, regions
    s, region = split[0], next(r for r in regions if r.tail is not None)
    # the tail's parameters: the final norm's and the head's, which the rest does not read
    mine = [k for k, (src, i) in enumerate(s.sources) if src == "input" and i in region.per_sample.params]
    unread = {k for k, (src, i) in enumerate(s.sources) if src == "input" and not s.rest.placeholders[i].users}
    assert s.tail.per_sample is not None and list(s.tail.per_sample.params) == mine and len(mine) == 3, \
        s.tail.per_sample
    assert set(mine) <= unread, (mine, unread)
    assert s.rest.per_sample is not None and all(s.rest.placeholders[i].users for i in s.rest.per_sample.params)
    assert len(s.rest.per_sample.params) == len(region.per_sample.params) - 3
