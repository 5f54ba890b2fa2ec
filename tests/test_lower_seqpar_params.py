"""Sequence parallelism: what a rank's graph holds besides its slice (runtime/seqpar.py, passes/lower/seqpar.py).

Found by probing, each silently different from one process on the whole sequence:

* a tied embedding: the lookup runs outside the compiled model (embedding is refused inside), the readout inside
  with the same weight; the graph's part of the weight's gradient was summed over the ranks, the lookup's part
  stayed the rank's own (max error 2.9);
* a learnable tensor held as a plain module attribute (``requires_grad``, not an ``nn.Parameter``): dynamo passes it
  as an ordinary graph input, so its gradient was the rank's share only (max error 4.1);
* ``h / x.shape[1]``: each rank's static graph holds its slice length as a literal (outputs off by 0.33).

Two gloo processes (the spawn helpers of test_lower_seqpar.py), float64, uneven slices; every output and gradient
is compared with single-process eager autograd on the whole sequence.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from test_lower_seqpar import _init, _port, _rank_errors, _spawn

B, D, V = 2, 6, 11
LENGTHS = [5, 4]
EVEN = [4, 4]


class _TiedLM(nn.Module):
    """Embedded tokens in (the lookup is the caller's), logits out through the embedding's own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, e):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(e)), self.b(e))
        return h @ self.emb.weight.t()


class _AttrScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.scale = torch.linspace(0.5, 1.5, D, dtype=torch.float64).requires_grad_()  # not an nn.Parameter

    def forward(self, x):
        return ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x)) * self.scale


class _PerLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        return h / x.shape[1]


def _make(cls):
    torch.manual_seed(0)
    return cls().double()


def _tokens(T):
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, V, (B, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _data(T):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(B, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, T, D, generator=g, dtype=torch.float64))


def _ce(logits, tgt):
    return nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="sum")


def _grads(model):
    out = {k: p.grad.clone() for k, p in model.named_parameters()}
    if isinstance(model, _AttrScale):
        out["scale"] = model.scale.grad.clone()
    return out


def _compile(model, **opts):
    torch._dynamo.reset()
    dynamic = opts.pop("dynamic", None)
    return torch.compile(model, backend="adjoint", dynamic=dynamic,
                         options={"sequence_parallel": True, "inner": "aot_eager", "shard_size": 2, **opts})


def _tied_step(sl, reduce_grads=True):
    model = _make(_TiedLM)
    tok, tgt = _tokens(sum(LENGTHS))
    f = _compile(model, reduce_grads=reduce_grads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ce(f(model.emb(tok[:, sl])), tgt[:, sl]).backward()
    said = [str(w.message) for w in caught if issubclass(w.category, ac.AdjointCompileWarning)]
    return _grads(model), said, [r.rewrite for r in ac.report(f).regions]


def _refusal(cls, sl, x, **opts):
    f = _compile(_make(cls), **opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            f(x[:, sl])
            res = "no error"
        except ac.SequenceParallelError as e:
            res = str(e)
    return res, [str(w.message) for w in caught if issubclass(w.category, ac.AdjointCompileWarning)]


def _worker(rank, world, port, out_dir):
    with _rank_errors(rank, out_dir):
        torch.set_num_threads(1)
        _init(rank, world, port, 60)
        o = sum(LENGTHS[:rank])
        sl = slice(o, o + LENGTHS[rank])
        res = {"tied": _tied_step(sl), "tied_no_reduce": _tied_step(sl, reduce_grads=False)}
        model = _make(_AttrScale)
        x, w = _data(sum(LENGTHS))
        f = _compile(model)
        y = f(x[:, sl])
        (y * w[:, sl]).sum().backward()
        res["attr"] = (y.detach(), _grads(model))
        model.zero_grad()
        model.scale.grad = None
        (f(x[:, sl]) * w[:, sl] + f(w[:, sl]) * x[:, sl]).sum().backward()  # NB: two sequences, one backward
        res["attr_twice"] = _grads(model)
        res["per_length"] = _refusal(_PerLength, sl, x)
        res["per_length_dynamic"] = _refusal(_PerLength, sl, x, dynamic=True)
        e = slice(rank * EVEN[0], (rank + 1) * EVEN[0])  # NB: equal slices: the numbers cannot differ, it warns
        res["per_length_even"] = _refusal(_PerLength, e, _data(sum(EVEN))[0])
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _close(got, ref, tol=1e-10):
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) < tol


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("seqpar_params")
    _spawn(_worker, 2, (_port(), str(out)), timeout=400)
    errs = sorted(out.glob("*.err"))
    assert not errs, errs[0].read_text()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_a_tied_embedding_looked_up_outside_the_model_gets_the_whole_gradient(ranks):
    model = _make(_TiedLM)
    tok, tgt = _tokens(sum(LENGTHS))
    _ce(model(model.emb(tok)), tgt).backward()
    for r, got in enumerate(ranks):
        grads, said, rewrites = got["tied"]
        assert rewrites == ["adjoint"] and not said, (rewrites, said)
        for k, p in model.named_parameters():  # emb.weight: the readout's part and the lookup's, summed
            assert _close(grads[k], p.grad), (r, k, float((grads[k] - p.grad).abs().max()))
    # reduce_grads=False: each rank keeps its own part of both uses, which sum to the whole
    local = [got["tied_no_reduce"][0] for got in ranks]
    for k, p in model.named_parameters():
        assert _close(local[0][k] + local[1][k], p.grad), k
        assert not _close(local[0][k], p.grad, 1e-3), k


@pytest.mark.slow
def test_a_learnable_attribute_tensor_is_summed_like_a_parameter(ranks):
    model = _make(_AttrScale)
    x, w = _data(sum(LENGTHS))
    y = model(x)
    (y * w).sum().backward()
    assert _close(torch.cat([got["attr"][0] for got in ranks], 1), y.detach())
    ref = {**{k: p.grad for k, p in model.named_parameters()}, "scale": model.scale.grad}
    for r, got in enumerate(ranks):
        for k in ref:
            assert _close(got["attr"][1][k], ref[k]), (r, k, float((got["attr"][1][k] - ref[k]).abs().max()))
    # two calls before one backward: each leaf gets the graphs' two gradients, summed over the ranks
    model = _make(_AttrScale)
    (model(x) * w + model(w) * x).sum().backward()
    ref = {**{k: p.grad for k, p in model.named_parameters()}, "scale": model.scale.grad}
    for r, got in enumerate(ranks):
        for k in ref:
            assert _close(got["attr_twice"][k], ref[k]), (r, k, float((got["attr_twice"][k] - ref[k]).abs().max()))


@pytest.mark.slow
def test_a_number_read_from_the_slice_length_is_refused_or_warned(ranks):
    for got in ranks:
        msg, _ = got["per_length"]  # static shapes: the literal differs across the uneven slices
        assert "differ across the ranks: [(5,), (4,)]" in msg and "return h / x.shape[1]" in msg, msg
        msg, _ = got["per_length_dynamic"]  # symbolic: the number is read from the step axis' size
        assert "reads the length of the step axis" in msg and "return h / x.shape[1]" in msg, msg
        msg, said = got["per_length_even"]  # equal slices: runs, and says which number may be a slice length
        assert msg == "no error", msg
        assert len(said) == 1 and "the number 4" in said[0] and "return h / x.shape[1]" in said[0], said
