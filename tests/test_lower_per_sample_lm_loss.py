"""per_sample_clip on a language model compiled with its loss (issue 33, part 4): embedding -> linear recurrences
(``ac.ops.linear_scan``, or the shipped selective SSM) -> head -> cross-entropy in the forms training scripts write
(tests/test_lower_lm_loss.py's FORMS: flattened ``(B·T, V)`` logits, ``[B, V, T]``, reductions, ignore_index, label
smoothing, class weights, the shift by one, a z-loss, ``.float()``/``.double()``, masks divided by their count),
a head on flattened rows (``F.linear_cross_entropy``), a tied head. Every p.grad and ``per_sample_grad_norms`` equal,
in fp64 to 1e-8, an oracle of plain eager autograd: example n's gradient is the gradient of the loss as written with
respect to a copy of the parameters that only example n uses (one copy per example, the logits concatenated), then
clipped and summed. For a loss that is a sum over examples that is each example's own loss's gradient (checked
against a loop over the examples); for a mean it is that divided by the count the mean divides by. T = 13 (odd),
shard sizes 1, 4, 5, ignored targets at shard boundaries, whole shards and a whole example of them. Forms the
per-example analysis cannot attribute are refused with a PerSampleError naming the op.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack
from adjoint_compile.passes.lower import per_sample as lower_per_sample
from adjoint_compile.passes.lower import per_sample_loss as lower_per_sample_loss
from test_lower_lm_loss import FORMS, LM, D, V, RMSNorm, _data

TOL = 1e-8
T3 = 13


def _data3(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """B = 3 examples of 13 steps: example 0's targets ignored at t = 0, 4, 5 (shard boundaries at sizes 4 and 5),
    example 1's from 8 on (whole shards), every one of example 2's."""
    g = torch.Generator().manual_seed(seed)
    ids, tg = torch.randint(0, V, (3, T3), generator=g), torch.randint(0, V, (3, T3), generator=g)
    tg[0, [0, 4, 5]] = -100
    tg[1, 8:] = -100
    tg[2] = -100
    return ids, tg


def _ce(reduction: str, **kw):
    return lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction=reduction, **kw)


class Step(nn.Module):
    """``forward(ids, targets)``: the loss(es) of ``lm``'s logits; ``logits`` is what the oracle concatenates."""

    def __init__(self, lm: nn.Module, loss) -> None:
        super().__init__()
        self.lm, self.loss = lm, loss

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor):
        return self.loss(self.logits(ids), targets)


def oracle(model: Step, ids: torch.Tensor, tg: torch.Tensor, weights=None) -> list[dict[str, torch.Tensor]]:
    """Per example n, the gradient of the loss as written with respect to a copy of the parameters only example n
    uses: one eager forward per example, the logits concatenated, one backward."""
    copies = [copy.deepcopy(model) for _ in range(ids.shape[0])]
    lg = torch.cat([c.logits(ids[n:n + 1]) for n, c in enumerate(copies)])
    out = model.loss(lg, tg)
    out = out if isinstance(out, torch.Tensor) else sum(w * o for w, o in zip(weights, out))
    out.backward()
    return [{k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in c.named_parameters()}
            for c in copies]


def clipped(per: list[dict[str, torch.Tensor]], clip: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in d.values())) for d in per],
                         dtype=torch.float64)
    c = [1.0 if n <= clip else clip / n for n in norms.tolist()]
    return {k: sum(ci * d[k] for ci, d in zip(c, per)) for k in per[0]}, norms


def check(model: Step, ids: torch.Tensor, tg: torch.Tensor, shard: int, weights=None,
          clip: float | None = None, inside: bool = True) -> ac.Report:
    """Compile ``model`` with per_sample_clip (half-way between the least and the largest nonzero oracle norm, so
    some examples are clipped and some not, unless ``clip`` is given), one backward, p.grad and the norms against the
    oracle; ``inside``: the sharded region takes in the loss (its report row lists it among its sums over time, and
    no logits are handed out whole). Returns the report."""
    per = oracle(model, ids, tg, weights)
    _, norms = clipped(per, math.inf)
    pos = norms[norms > 0]
    clip = float(pos.min() + pos.max()) / 2 if clip is None else clip
    want, _ = clipped(per, clip)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "shard_size": shard,
                                                          "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(ids, tg)
    out = out if isinstance(out, torch.Tensor) else sum(w * o for w, o in zip(weights, out))
    out.backward()
    got = ac.per_sample_grad_norms(f)
    assert torch.allclose(got, norms, rtol=TOL, atol=1e-300), (got, norms)
    assert len(norms) == 1 or (norms > clip).any() and (norms < clip).any(), "some examples clipped, some not"
    for k, p in model.named_parameters():
        if not p.requires_grad:
            continue
        err = float((p.grad - want[k]).norm() / want[k].norm().clamp_min(1e-300))
        assert err <= TOL or float((p.grad - want[k]).abs().max()) <= 1e-14, (k, err)
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)
    assert any(r.rewrite == "adjoint" for r in rep.regions), str(rep)
    if inside:
        rows = [r for r in rep.regions if r.rewrite == "adjoint"]
        assert any(r.details.get("sums_over_time") for r in rows), str(rep)
        assert not any(r.details.get("before_loss") for r in rows), str(rep)
    return rep


@pytest.mark.parametrize("shard", [1, 4, 5])
def test_every_form_at_once(shard):
    """All forms of tests/test_lower_lm_loss.py from one forward (B = 2, T = 13, targets ignored at shard boundaries and
    in whole shards), one backward of a random combination of them: a wrong per-example gradient of any one form
    shows in the norms and the clipped sum."""
    torch.manual_seed(0)
    model = Step(LM(), lambda lg, t: tuple(fn(lg, t) for fn, _ in FORMS.values())).double()
    w = (torch.rand(len(FORMS), generator=torch.Generator().manual_seed(shard), dtype=torch.float64) + 0.5).tolist()
    check(model, *_data(), shard=shard, weights=w)


@pytest.mark.parametrize("form", ["[B, V, T]", "log_softmax, gather", "z-loss", "logits[:, :-1], labels[:, 1:]"])
def test_each_form_alone(form):
    """A few forms alone (their norms are not blended with the others')."""
    torch.manual_seed(0)
    check(Step(LM(), FORMS[form][0]).double(), *_data(), shard=4)


@pytest.mark.parametrize("shard", [1, 5])
def test_a_sum_is_each_examples_own_loss_a_whole_example_ignored(shard):
    """reduction="sum": example n's gradient is that of its own loss alone (an eager loop over the examples, which
    the oracle also equals); the example whose every target is ignored has norm 0 and adds nothing."""
    torch.manual_seed(2)
    model = Step(LM(), _ce("sum", label_smoothing=0.1)).double()
    ids, tg = _data3()
    per = oracle(model, ids, tg)
    for n in range(3):
        one = copy.deepcopy(model)
        one(ids[n:n + 1], tg[n:n + 1]).backward()
        for k, p in one.named_parameters():
            assert torch.allclose(p.grad, per[n][k], rtol=1e-12, atol=1e-14), (n, k)
    check(model, ids, tg, shard)


def test_every_target_ignored_sum_over_count():
    """A batch of padding only, its loss the sum over valid targets divided by their count (0): the loss is nan and
    the gradients are eager's, zero, whatever the infinite cotangent of the sum; not nan in the optimizer."""
    torch.manual_seed(2)
    ids, tg = _data3()
    tg[:] = -100
    model = Step(LM(), lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum")
                 / (t != -100).sum()).double()
    ref = copy.deepcopy(model)
    ref(ids, tg).backward()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "shard_size": 4,
                                                          "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = f(ids, tg)
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), ac.report(f)
    loss.backward()
    assert loss.isnan()
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert not q.grad.any() and torch.equal(p.grad, q.grad), (k, p.grad)


def test_a_mean_divides_each_norm_by_the_count_of_valid_targets(monkeypatch):
    """reduction="mean" (the default): per_sample_clip bounds the norms of the mean loss's per-example gradients,
    each the sum loss's divided by the number of targets that are not ignored in the whole batch (here 39 - 3 - 5 -
    13 = 18), as for every model under per_sample_clip; the warning names it."""
    torch.manual_seed(2)
    ids, tg = _data3()
    mean = Step(LM(), _ce("mean")).double()
    summed = copy.deepcopy(mean)
    summed.loss = _ce("sum")
    valid = int((tg != -100).sum())
    _, n_mean = clipped(oracle(mean, ids, tg), math.inf)
    _, n_sum = clipped(oracle(summed, ids, tg), math.inf)
    assert valid == 18 and torch.allclose(n_mean * valid, n_sum, rtol=1e-12)
    check(mean, ids, tg, 4)
    monkeypatch.setattr(lower_per_sample, "_MEANS_WARNED", set())  # NB: warned once per source line
    f = torch.compile(copy.deepcopy(mean), backend="adjoint", options={"per_sample_clip": 1e-3, "shard_size": 4,
                                                                      "inner": "aot_eager"})
    with pytest.warns(ac.AdjointCompileWarning, match="mean over the batch"):
        f(ids, tg)


class FlatHead(nn.Module):
    """The head on rows of the final norm's output merged into [B·T, D]."""

    def __init__(self, how: str, reduction: str) -> None:
        super().__init__()
        self.lm, self.how, self.reduction = LM(), how, reduction
        self.w = nn.Parameter(0.3 * torch.randn(D, V))

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.norm(self.lm.layers(self.lm.emb(ids)))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.hidden(ids)
        return h @ self.w if self.how in ("view @ W", "h @ W") else self.lm.head(h)

    def loss(self, lg: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lg.flatten(0, 1), t.flatten(), label_smoothing=0.1, reduction=self.reduction)

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.hidden(ids)
        if self.how == "linear_cross_entropy":
            return F.linear_cross_entropy(h.flatten(0, 1), self.lm.head.weight, t.flatten(),
                                          linear_bias=self.lm.head.bias, label_smoothing=0.1,
                                          reduction=self.reduction)
        flat = h.view(-1, D) @ self.w if self.how == "view @ W" else (h @ self.w).flatten(0, 1) \
            if self.how == "h @ W" else self.lm.head(h.flatten(0, 1))
        return F.cross_entropy(flat, t.flatten(), label_smoothing=0.1, reduction=self.reduction)


@pytest.mark.parametrize("how,reduction", [("linear(flatten)", "sum"), ("linear_cross_entropy", "mean"),
                                           ("linear_cross_entropy", "sum"), ("view @ W", "mean"), ("h @ W", "sum")])
def test_a_head_on_flattened_rows(how, reduction):
    """``head(h.flatten(0, 1))``, ``F.linear_cross_entropy(h.flatten(0, 1), W, ...)`` (its reference path) and
    ``h.view(-1, D) @ W``: the head joins the region, its rows of [B·T, D] attributed to their examples (the
    product made per example on h, the examples first)."""
    if how == "linear_cross_entropy" and not hasattr(F, "linear_cross_entropy"):
        pytest.skip("F.linear_cross_entropy is new in torch 2.13")
    torch.manual_seed(3)
    model = FlatHead(how, reduction).double()
    for p in ([model.w] if "@ W" not in how else model.lm.head.parameters()):
        p.requires_grad_(False)  # NB: the head this form does not use
    rep = check(model, *_data3(), shard=4)
    uses = [u for c in rep.compiled if c.per_sample is not None for u in c.per_sample.uses]
    assert not [u for u in uses if u["kind"] in ("linear", "matmul")], uses
    region = [p for u in uses if u["kind"] == "sharded region" for p in u["params"]]
    assert any(("w" if "@ W" in how else "head") in p for p in region), uses


class RowsHead(FlatHead):
    """Parameters applied to rows already merged into [B·T, D] or [B·T, V]: a bias after the product, a gain before
    it, a norm on the rows (its affine, or rms_norm's weight decomposed by the trace into element-wise ops)."""

    #: form -> (rows of logits from the hidden state h, the parameters beyond the LM's body it uses)
    FORMS = {
        "view(-1, D) @ W + b": (lambda m, h: h.view(-1, D) @ m.w + m.b, "w b"),
        "b + reshape(-1, D) @ W": (lambda m, h: m.b + h.reshape(-1, D) @ m.w, "w b"),
        "(flatten * g) @ W": (lambda m, h: (h.flatten(0, 1) * m.g) @ m.w, "w g"),
        "layer_norm(flatten) @ W": (lambda m, h: m.ln(h.flatten(0, 1)) @ m.w, "w ln"),
        "rms_norm(flatten, g) @ W": (lambda m, h: F.rms_norm(h.flatten(0, 1), (D,), m.g) @ m.w, "w g"),
        "head(flatten - g)": (lambda m, h: m.lm.head(h.flatten(0, 1) - m.g), "lm.head g"),
        "(flatten + c[1, D]) @ W": (lambda m, h: (h.flatten(0, 1) + m.c) @ m.w, "w c"),
        "(flatten / exp(g)) @ W": (lambda m, h: (h.flatten(0, 1) / torch.exp(m.g)) @ m.w, "w g"),
        "torch.mm(view(-1, D), W)": (lambda m, h: torch.mm(h.view(-1, D), m.w), "w"),
    }

    def __init__(self, how: str) -> None:
        super().__init__(how, "sum")
        self.b, self.g = nn.Parameter(0.3 * torch.randn(V)), nn.Parameter(1 + 0.3 * torch.randn(D))
        self.c, self.ln = nn.Parameter(0.3 * torch.randn(1, D)), nn.LayerNorm(D)
        with torch.no_grad():
            self.ln.weight.add_(0.3 * torch.randn(D))
        used = self.FORMS[how][1].split()
        for name in ("w", "b", "g", "c", "ln", "lm.head"):
            (self.get_submodule(name) if name in ("ln", "lm.head") else getattr(self, name)).requires_grad_(
                name in used)

    def rows(self, h: torch.Tensor) -> torch.Tensor:
        return self.FORMS[self.how][0](self, h)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(self.hidden(ids)).view(ids.shape[0], -1, V)

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.rows(self.hidden(ids)), t.flatten(), label_smoothing=0.1, reduction="sum")


@pytest.mark.parametrize("how,shard", [(h, 4) for h in RowsHead.FORMS] + [("view(-1, D) @ W + b", 1),
                                                                         ("rms_norm(flatten, g) @ W", 5)])
def test_parameters_on_rows_merged_from_the_examples(how, shard):
    """A parameter use on rows merged from [B, T, ...] (the examples the outermost factor of the rows) is made on the
    rows unflattened to [B, T, ...], outside the region and in its per-example program: exact, the loss inside. They
    were refused with a PerSampleError ("does not carry the examples on axis 0")."""
    torch.manual_seed(3)
    check(RowsHead(how).double(), *_data3(), shard=shard)


def test_parameters_on_time_major_merged_rows_are_refused():
    """Rows merged from a [T, B, D] value (``h.transpose(0, 1).reshape(-1, D)``): row t·B + b is example b's, so the
    examples are not the rows' outermost factor, whatever B divides; refused by name, never a wrong gradient."""
    class TimeMajor(RowsHead):
        def rows(self, h: torch.Tensor) -> torch.Tensor:
            return (h.transpose(0, 1).reshape(-1, D) * self.g) @ self.w

    torch._dynamo.reset()
    f = torch.compile(TimeMajor("(flatten * g) @ W").double(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "shard_size": 4, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=r"(mul|cross_entropy) .*examples' axis"):
        f(*_data3())


@pytest.mark.parametrize("shard", [4])
def test_a_tied_head(shard):
    torch.manual_seed(4)
    check(Step(LM(tied=True), _ce("sum")).double(), *_data3(), shard=shard)


class SSMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ssm, self.head = nn.Embedding(V, D), SSMStack(d_model=D, d_state=2, n_layers=1), nn.Linear(D, V)
        with torch.no_grad():
            for p in self.ssm.parameters():
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ssm(self.emb(ids)))


def test_the_selective_ssm_lm():
    torch.manual_seed(5)
    ids, tg = _data3()
    check(Step(SSMLM(), lambda lg, t: F.cross_entropy(lg[:, :-1].flatten(0, 1), t[:, 1:].flatten())).double(),
          ids, tg, shard=4)


def test_a_loss_divided_by_a_count_of_its_targets_warns(monkeypatch):
    """``(ce * mask).sum() / mask.sum()`` divides every example's norm by the count, as a mean does: warned."""
    monkeypatch.setattr(lower_per_sample_loss, "_WARNED", set())
    torch.manual_seed(0)
    f = torch.compile(Step(LM(), FORMS["none, mask"][0]).double(), backend="adjoint",
                      options={"per_sample_clip": 1e-3, "shard_size": 4, "inner": "aot_eager"})
    with pytest.warns(ac.AdjointCompileWarning, match="divided by a value reduced over the batch"):
        f(*_data()).backward()


def _refused(loss, match: str) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = torch.compile(Step(LM(), loss).double(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "shard_size": 4, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=match):
        f(*_data())


def test_an_embedding_with_max_norm_is_refused():
    """max_norm renormalizes the table in place in the forward: refused, naming the op and the remedy."""
    class MaxNormLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D, max_norm=1.0)
    torch._dynamo.reset()
    f = torch.compile(Step(MaxNormLM(), _ce("sum")).double(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "shard_size": 4, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=r"embedding \(\w+\) has max_norm .*renormalize the weight yourself"):
        f(*_data())


@pytest.mark.parametrize("what", ["a loss in the divisor", "a product of losses", "logits over a batch count",
                                  "per-row losses over a batch count"])
def test_forms_it_cannot_attribute_are_refused(what):
    """Not a sum of per-example losses (the first two), or a batch-wide count meeting per-example values before the
    loss's reduction (refused, though a constant of the gradient): a PerSampleError naming the op, never a
    gradient."""
    mask = lambda t: (t != -100).to(torch.float64)  # noqa: E731
    loss = {
        "a loss in the divisor": lambda lg, t: 1.0 / F.cross_entropy(lg.flatten(0, 1), t.flatten()),
        "a product of losses": lambda lg, t: _ce("sum")(lg, t) * _ce("mean")(lg, t),
        "logits over a batch count": lambda lg, t: _ce("sum")(lg / mask(t).sum(), t),
        "per-row losses over a batch count": lambda lg, t: (_ce("none")(lg, t) / mask(t).sum()).pow(2).sum(),
    }[what]
    _refused(loss, r"per_sample_clip: \w+ .*reduced over the batch axis before the loss")


class PaddedLM(LM):
    """The embedding with a padding index (its row gets no gradient) and a batch of one example too."""

    def __init__(self, padding_idx: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        with torch.no_grad():
            self.emb.weight[padding_idx].normal_()  # NB: a row that is looked up but not trained


@pytest.mark.parametrize("padding_idx,batch", [(0, 3), (-1, 3), (0, 1)])
def test_an_embedding_with_a_padding_index_in_the_region(padding_idx, batch):
    """The lookup joins the region with its table made per example; the padding row, looked up in every example,
    gets no gradient in any (a batch of one: the examples' copies of the table are one)."""
    torch.manual_seed(6)
    ids, tg = _data3()
    ids[:, ::3] = padding_idx % V
    model = Step(PaddedLM(padding_idx), _ce("sum", label_smoothing=0.1)).double()
    if batch == 1:
        check(model, ids[:1], tg[:1], shard=4, clip=1e-3)
    else:
        check(model, ids, tg, shard=4)
    assert float(model.lm.emb.weight.grad[padding_idx].abs().max()) == 0.0


class PositionsLM(LM):
    """Learned absolute positions added to the token embeddings: ``pos(arange(T))``, the same rows for every example."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.pos, self.expanded = nn.Embedding(32, D, padding_idx=padding_idx), False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        if self.expanded:  # NB: transformers' position_ids
            pos = pos[None].expand(ids.shape[0], -1)
        return self.head(self.norm(self.layers(self.emb(ids) + self.pos(pos))))


@pytest.mark.parametrize("padding_idx,expanded", [(None, False), (3, False), (None, True)])
def test_learned_positions_in_the_region(padding_idx, expanded):
    """The position table is looked up in the region for every example alike: each example's copy of it, exact; ids
    expanded over the batch (``arange(T)[None].expand(B, -1)``) are every example's own."""
    torch.manual_seed(10)
    lm = PositionsLM(padding_idx)
    lm.expanded = expanded
    model = Step(lm, _ce("sum")).double()
    check(model, *_data3(), shard=4)
    if padding_idx is not None:
        assert float(model.lm.pos.weight.grad[padding_idx].abs().max()) == 0.0


class TiedHead(nn.Module):
    """The head tied to the embedding, written ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lm, self.how = LM(), how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, w = self.lm.norm(self.lm.layers(self.lm.emb(ids))), self.lm.emb.weight
        return {"h @ W.T": lambda: h @ w.T, "h @ W.t()": lambda: h @ w.t(),
                "matmul(h, W.transpose(0, 1))": lambda: torch.matmul(h, w.transpose(0, 1)),
                "h @ W.permute(1, 0)": lambda: h @ w.permute(1, 0)}[self.how]()


@pytest.mark.parametrize("how", ["h @ W.T", "h @ W.t()", "matmul(h, W.transpose(0, 1))", "h @ W.permute(1, 0)"])
def test_a_tied_head_through_a_transpose(how):
    """A head tied to the embedding through a transpose of its table: the transpose made on the table's copies."""
    torch.manual_seed(4)
    model = Step(TiedHead(how), _ce("sum")).double()
    model.lm.lm.head.requires_grad_(False)  # NB: the untied head, unused
    check(model, *_data3(), shard=4)


class IndexedLayer(nn.Module):
    """A layer whose parameters meet the examples through ``W @ x`` (transformers' Mamba's ``dt_proj.weight @
    time_step.T``), an index with leading new axes (``g[None, None, :]``, Mamba-2's ``D[None, :, None]``) and an
    integer index (``c[0]``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.inp, self.out = RMSNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.wd, self.g, self.c = (nn.Parameter(0.5 * torch.randn(*s)) for s in ((d, d), (d,), (2, d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.norm(x)
        a = torch.sigmoid((self.wd @ u.transpose(1, 2)).transpose(1, 2))
        return x + self.out(ac.ops.linear_scan(a, self.inp(u), dim=1)) * self.g[None, None, :] + self.c[0]


def test_parameters_indexed_or_on_the_left_of_a_product_in_the_region():
    """The region with such a layer still takes in the loss: the parameter values indexed after their per-example
    copies and ``W @ x`` made one batched product."""
    torch.manual_seed(7)
    lm = LM()
    lm.layers = nn.Sequential(IndexedLayer(D), IndexedLayer(D))
    check(Step(lm, _ce("sum")).double(), *_data3(), shard=4)


class FormLayer(nn.Module):
    """A layer whose parameters ``g``, ``b`` (vectors) and ``alpha`` (0-dim) meet the examples in the form ``how``."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.decay, self.out, self.how = nn.Linear(d, d), nn.Linear(d, d), how
        self.g, self.b = nn.Parameter(1 + 0.3 * torch.randn(d)), nn.Parameter(0.3 * torch.randn(d))
        self.alpha = nn.Parameter(torch.tensor(0.7))
        unused = {"a parameter summed": [self.alpha, self.b], "a 0-dim parameter": [self.g, self.b],
                  "clamp(g, max=alpha)": [self.b]}.get(how, [self.alpha])
        for p in unused:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = {"layer_norm without eps": lambda: F.layer_norm(x, x.shape[-1:], self.g, self.b),
             "a parameter summed": lambda: x * self.g.sum(),
             "a 0-dim parameter": lambda: x * self.alpha,
             "view, unsqueeze": lambda: x * self.g.view(1, 1, -1) + self.b.unsqueeze(0),
             "1 + g, g * g, g ** 2": lambda: x * (1 + self.g) * (self.g * self.g) + self.b ** 2,
             "reshape, detach": lambda: x * self.g.reshape(1, -1) + self.b.detach(),
             "clamp(g, max=alpha)": lambda: x * torch.clamp(self.g, max=self.alpha)}[self.how]()
        return x + self.out(ac.ops.linear_scan(torch.sigmoid(self.decay(x)), v, dim=1))


@pytest.mark.parametrize("how,inside", [("layer_norm without eps", True), ("a parameter summed", False),
                                        ("a 0-dim parameter", True), ("view, unsqueeze", True),
                                        ("1 + g, g * g, g ** 2", True), ("reshape, detach", True),
                                        ("clamp(g, max=alpha)", False)])
def test_parameter_forms_made_per_example_or_left_outside(how, inside):
    """Exact either way: a norm's default eps kept when its affine is split off, a parameter reduced to a scalar (not
    made per example: the loss stays outside), a 0-dim parameter's per-example gradients ([B]), a clamp bounded by
    a parameter of another rank (its copies would broadcast along the wrong axis: left outside). B = D = 8: a
    parameter's axis of the examples' size cannot pass for the examples'."""
    torch.manual_seed(9)
    lm = LM()
    lm.layers = nn.Sequential(FormLayer(D, how), FormLayer(D, how))
    g = torch.Generator().manual_seed(2)
    ids, tg = torch.randint(0, V, (D, 13), generator=g), torch.randint(0, V, (D, 13), generator=g)
    check(Step(lm, _ce("sum")).double(), ids, tg, shard=4, inside=inside)


class ChainedLayer(nn.Module):
    """nn.LayerNorm straight into two chained Linears (a low-rank projection), and a symmetrized weight ``W + W.T``:
    values the per-example program makes itself, then reads again."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.down, self.up = nn.LayerNorm(d), nn.Linear(d, 3), nn.Linear(3, d)
        self.decay, self.w = nn.Linear(d, d), nn.Parameter(0.3 * torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.up(self.down(self.norm(x)))
        return x + ac.ops.linear_scan(torch.sigmoid(self.decay(x)), u @ ((self.w + self.w.T) / 2), dim=1)


def test_values_the_per_example_program_makes_are_read_again():
    """The norm's split affine feeds a Linear, a Linear feeds a Linear, and both halves of ``W + W.T`` are parameter
    values when the sum is reached: all made per example, the loss inside the region."""
    torch.manual_seed(11)
    lm = LM()
    lm.layers = nn.Sequential(ChainedLayer(D), ChainedLayer(D))
    check(Step(lm, _ce("sum")).double(), *_data3(), shard=4)


class TimeMajorLayer(nn.Module):
    """A layer that applies a Linear to its input time-major (``[L, B, D]`` inside a shard of L steps)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.decay, self.inp = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.inp(x.transpose(0, 1)).transpose(0, 1)
        return x + ac.ops.linear_scan(torch.sigmoid(self.decay(x)), v, dim=1)


@pytest.mark.parametrize("batch,steps,shard", [(2, 24, 2), (3, 23, 5)], ids=["every shard L == B", "last shard L == B"])
def test_a_time_major_value_whose_shard_length_is_the_batch_size(batch, steps, shard):
    """In a shard of L = B steps a [L, B, D] value has B at axis 0, but its steps are not the examples: the examples'
    axis is followed through the transposes, so its parameter is not made per example by size (each step's gradient
    would be given to an example: silently wrong norms). The region ends before the loss and stays exact."""
    torch.manual_seed(8)
    lm = LM()
    lm.layers = nn.Sequential(TimeMajorLayer(D))
    g = torch.Generator().manual_seed(1)
    ids, tg = torch.randint(0, V, (batch, steps), generator=g), torch.randint(0, V, (batch, steps), generator=g)
    check(Step(lm, _ce("sum")).double(), ids, tg, shard=shard, inside=False)


class NormalizedHead(nn.Module):
    """An LM whose head's rows are normalized to unit length (nGPT's head): the weight's norm over each row, made
    of the parameter alone, cannot be made per example in the region, so the region ends before the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lm.norm(self.lm.layers(self.lm.emb(ids)))
        w = self.lm.head.weight
        return F.linear(h, w / w.norm(dim=1, keepdim=True), self.lm.head.bias)


@pytest.mark.slow
def test_a_head_it_cannot_make_per_example_stays_outside_and_the_report_says_why():
    """The region ends before the loss, exact as before (the head lowered on the logits' rows outside), and its row
    names the logits handed to the loss whole, their size and the cause; without per_sample_clip the loss joins."""
    torch.manual_seed(0)
    model = Step(NormalizedHead(), _ce("sum")).double()
    rep = check(model, *_data3(), shard=4, inside=False)
    (row, *_) = [r for r in rep.regions if r.rewrite == "adjoint"]
    assert row.details["before_loss"][0]["shape"] == [3, 13, V], row.details
    assert "ends before the loss under per_sample_clip" in row.reason and f"[3, 13, {V}]" in row.reason, row.reason
    assert "cannot be split by example" in row.reason, row.reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = ac.explain(model, *_data3(), options={"shard_size": 4})
    (row, *_) = [r for r in plain.regions if r.rewrite == "adjoint"]
    assert not row.details.get("before_loss") and "ends before the loss" not in row.reason, row.reason
