"""A language model compiled with its loss, head and cross-entropy included, flat in T (analysis/losses.py,
analysis/layout_rules.py folds, runtime/shard_program.py): the loss forms training scripts write (flattened
``(B·T, V)`` logits, the ``[B, V, T]`` layout, reductions "mean", "sum" and "none" followed by a reduction or a mask,
``ignore_index`` with the mean over valid targets, label smoothing, class weights, the shift by one, a z-loss,
``nn.CrossEntropyLoss``, transformers' ``ForCausalLMLoss``) join the sharded region, so the ``[B, T, V]`` logits
exist one shard at a time. Against eager autograd in fp64 at T = 13 with shard sizes 1, 4 and 5, ignored targets at
shard boundaries and whole shards of them; each form's report names the loss among the sums over time it takes in.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac

V, D, B, T = 11, 8, 2, 13
SHARDS = [1, 4, 5]
#: ignored targets: at shard boundaries (t = 0, 4, 5) and every step from 8 on (the whole shards [8, 12), [10, 13)
#: and [12, 13) at shard sizes 4 and 5; any of them at 1)
IGNORED = [(0, 0), (1, 4), (0, 5), (1, 5)] + [(b, t) for b in range(B) for t in range(8, T)]


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.decay, self.inp, self.out = RMSNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.norm(x)
        return x + self.out(ac.ops.linear_scan(torch.sigmoid(self.decay(u)), self.inp(u), dim=1))


class LM(nn.Module):
    """Embedding -> 2 x (RMSNorm, Linear, sigmoid decay, linear_scan, Linear, residual) -> RMSNorm -> head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.Sequential(Layer(D), Layer(D))
        self.norm, self.head = RMSNorm(D), nn.Linear(D, V, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.emb(ids))))


def _masked_gather(lg: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logp = lg.view(-1, V).log_softmax(-1).gather(-1, t.clamp_min(0).view(-1, 1)).squeeze(-1)
    valid = (t != -100).view(-1).to(lg.dtype)
    return -(logp * valid).sum() / valid.sum()


def _z_loss(lg: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lg.flatten(0, 1), t.flatten()) + 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()


_CE = nn.CrossEntropyLoss(label_smoothing=0.05)
_W = torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5

#: form -> (loss of the logits [B, T, V] and the targets [B, T], how many sums over time the region takes in)
FORMS = {
    "flatten(0, 1)": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten()), 1),
    "view(-1, V)": (lambda lg, t: F.cross_entropy(lg.view(-1, V), t.view(-1)), 1),
    "reshape(B*T, V)": (lambda lg, t: F.cross_entropy(lg.reshape(B * T, V), t.reshape(B * T)), 1),
    "[B, V, T]": (lambda lg, t: F.cross_entropy(lg.transpose(1, 2), t), 1),
    "sum": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum") / 50, 1),
    "none, mean": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="none").mean(), 1),
    "none, mask": (lambda lg, t: (F.cross_entropy(lg.view(-1, V), t.view(-1), reduction="none")
                                  * (t % 3 != 0).view(-1)).sum() / (t % 3 != 0).sum(), 1),
    "none, per sequence": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="none")
                           .view(B, T).sum(1).pow(2).mean() / 100, 1),
    "label smoothing": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), label_smoothing=0.2), 1),
    "class weights": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), weight=_W.to(lg.dtype),
                                                    label_smoothing=0.1), 1),
    "nn.CrossEntropyLoss": (lambda lg, t: _CE(lg.view(-1, V), t.view(-1)), 1),
    "ignore_index=3": (lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.clamp_min(0).flatten(), ignore_index=3), 1),
    "nll_loss": (lambda lg, t: F.nll_loss(lg.log_softmax(-1).flatten(0, 1), t.flatten()), 1),
    "log_softmax, gather": (_masked_gather, 2),
    "z-loss": (_z_loss, 2),
    "upcast": (lambda lg, t: F.cross_entropy(lg.double().view(-1, V), t.view(-1)), 1),
    "labels padded by -100, [..., 1:]": (lambda lg, t: F.cross_entropy(
        lg.view(-1, V), F.pad(t, (0, 1), value=-100)[..., 1:].contiguous().view(-1)), 1),
    # the shift by one on the logits: rewritten to the logits whole and the labels padded (analysis/shifted_losses.py)
    "logits[:, :-1], labels[:, 1:]": (lambda lg, t: F.cross_entropy(lg[:, :-1].flatten(0, 1), t[:, 1:].flatten()), 1),
    # k tokens ahead (multi-token prediction, Medusa's heads): the labels padded with k ignored targets
    "logits[:, :-2], labels[:, 2:], sum": (lambda lg, t: F.cross_entropy(
        lg[:, :-2].flatten(0, 1), t[:, 2:].flatten(), reduction="sum") / 50, 1),
    "logits[:, :T-3].transpose(1, 2), labels[:, 3:]": (lambda lg, t: F.cross_entropy(
        lg[:, :T - 3].transpose(1, 2), t[:, 3:], label_smoothing=0.1), 1),
    # a prompt of 3 steps dropped, with or without the shift
    "logits[:, 3:-1], labels[:, 4:]": (lambda lg, t: F.cross_entropy(lg[:, 3:-1].reshape(-1, V), t[:, 4:].reshape(-1)),
                                       1),
    "logits[:, 3:], labels[:, 3:], sum": (lambda lg, t: F.cross_entropy(
        lg[:, 3:].flatten(0, 1), t[:, 3:].flatten(), reduction="sum") / 50, 1),
    "logits[..., :-1, :].contiguous()": (lambda lg, t: _CE(lg[..., :-1, :].contiguous().view(-1, V),
                                                          t[..., 1:].contiguous().view(-1)), 1),
    "logits[:, :-1].reshape(B*(T-1), V), sum": (lambda lg, t: F.cross_entropy(
        lg[:, :-1].reshape(B * (T - 1), V), t[:, 1:].reshape(B * (T - 1)), reduction="sum") / 50, 1),
    "logits[:, :-1].transpose(1, 2)": (lambda lg, t: F.cross_entropy(lg[:, :-1].transpose(1, 2), t[:, 1:],
                                                                      label_smoothing=0.1), 1),
}


class Step(nn.Module):
    """The model and its loss compiled as one: ``forward(ids, targets)`` returns the loss."""

    def __init__(self, loss, tied: bool = False) -> None:
        super().__init__()
        self.lm, self.loss = LM(tied), loss

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.lm(ids), targets)


class AllForms(nn.Module):
    """Every form's loss of one forward: ``forward(ids, targets)`` returns them as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()
        #: the losses it returns (all forms; a test may keep fewer)
        self.forms = [f for f, _ in FORMS.values()]

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lg = self.lm(ids)
        return tuple(f(lg, targets) for f in self.forms)


def _data(seed: int = 0, t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids, tg = torch.randint(0, V, (B, t), generator=g), torch.randint(0, V, (B, t), generator=g)
    for b, s in IGNORED:
        if s < t:
            tg[b, s] = -100
    return ids, tg


def _compile(model: nn.Module, shard: int) -> nn.Module:
    torch._dynamo.reset()
    return torch.compile(model, backend="adjoint", options={"shard_size": shard, "inner": "aot_eager"})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _step_matches(f, model: nn.Module, ref: nn.Module, *data: torch.Tensor, tol: float = 1e-10) -> None:
    """One step of the compiled ``f`` (over ``model``) against eager ``ref``: the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(*data)
    want = ref(*data)
    got.backward()
    want.backward()
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name     # a frozen or unreached parameter: None, as in eager
        assert p.grad is None or _rel(p.grad, q.grad) <= tol, name


def _accumulated_matches(f, model: nn.Module, ref: nn.Module, batches: list, tol: float = 1e-10) -> None:
    """Micro-batches ``[(scale, data), ...]``: the compiled ``f``'s losses, scaled and added, then one backward,
    against eager ``ref``'s: the total and every gradient."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sum(c * f(*d) for c, d in batches)
    want = sum(c * ref(*d) for c, d in batches)
    got.backward()
    want.backward()
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= tol, name


def _takes_in(rep: ac.Report, n_sums: int, tail: bool | None = True) -> dict:
    """The one sharded region's details; it takes in the head and ``n_sums`` sums over time (the loss); ``tail``:
    whether the loss (a scalar) runs once, with its gradient, in the forward (None: either)."""
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "adjoint" for r in lin), str(rep)
    assert len({r.details["region_call"] for r in lin}) == 1, str(rep)
    details = lin[0].details
    assert len(details.get("sums_over_time", [])) == n_sums, str(rep)
    assert "sum(s) over time" in lin[0].reason, lin[0].reason
    # the head and the loss run once, with their gradient, in the forward (runtime/loss_tail.py)
    if tail is not None:
        assert bool(details.get("loss_tail")) == tail, str(rep)
        assert ("its loss runs once, with its gradient, in the forward" in lin[0].reason) == tail, lin[0].reason
    return details


@pytest.mark.parametrize("form", list(FORMS))
def test_the_region_takes_in_the_loss(form):
    """Each form: the region runs from the token lookup to the loss (the report's sums over time), so the logits
    are never an output of it."""
    torch.manual_seed(0)
    step = Step(FORMS[form][0]).double()
    rep = ac.explain(step, *_data(), options={"shard_size": 4})
    # a sum per sequence is not a scalar: its cotangent is one per sequence, and that form's loss stays in the sweep
    details = _takes_in(rep, FORMS[form][1], tail=form != "none, per sequence")
    assert details["embeddings"], details


def _check(model: nn.Module, shard: int, *data: torch.Tensor, tol: float = 1e-10, n_sums: int = 1,
           weights: list[float] | None = None, tail: bool = True) -> ac.Report:
    """The loss(es) of ``model`` compiled with shards of ``shard`` steps against eager autograd: values and every
    parameter's gradient (of the losses weighted by ``weights``: one backward) to ``tol`` relative."""
    ref = copy.deepcopy(model)
    f = _compile(model, shard)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(*data)
    want = ref(*data)
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    for k, (g, w) in enumerate(zip(got, want)):
        assert abs(g.item() - w.item()) <= tol * abs(w.item()), (k, g.item(), w.item())
    c = weights or [1.0] * len(got)
    sum(ci * g for ci, g in zip(c, got)).backward()
    sum(ci * w for ci, w in zip(c, want)).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= tol, (name, _rel(p.grad, q.grad))
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)  # NB: the first-call check found no difference: the sharded run is compared
    _takes_in(rep, n_sums, tail)
    return rep


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.slow
def test_every_form_is_exact(shard):
    """All forms from one forward (fp64, 1e-10): each loss's value, and the gradients of a random combination of
    them (a wrong gradient of any one form shows)."""
    torch.manual_seed(0)
    c = torch.rand(len(FORMS), generator=torch.Generator().manual_seed(shard)).add(0.5).tolist()
    _check(AllForms().double(), shard, *_data(), n_sums=sum(n for _, n in FORMS.values()), weights=c)


class MaskedMean(nn.Module):
    """The per-token loss masked by an attention mask given as its own input (int64 or bool, as tokenizers return
    it), flattened and cast in either order, divided by its count."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lm, self.how = LM(), how

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.lm(ids).view(-1, V), targets.view(-1), reduction="none")
        m = mask.view(-1).to(loss.dtype) if self.how == "view, cast" else mask.to(loss.dtype).view(-1)
        return (loss * m).sum() / m.sum()


@pytest.mark.parametrize("how,dtype", [("view, cast", torch.int64), ("view, cast", torch.bool),
                                       ("cast, view", torch.int64)])
@pytest.mark.parametrize("shard", [4, 5])
@pytest.mark.slow
def test_a_mask_given_as_an_input(how, dtype, shard):
    """The mask's rows are the steps' (flattened like the logits): the region takes it in with the loss. Flattened
    before the cast, it was not followed back to the input, and the loss stayed outside (exact, O(B·T·V))."""
    torch.manual_seed(0)
    ids, tg = _data()
    mask = (torch.arange(T) < torch.tensor([[9], [T]])).to(dtype)
    _check(MaskedMean(how).double(), shard, ids, tg, mask, n_sums=2)


class ShiftedInputs(nn.Module):
    """``ids`` and ``labels`` of T+1 steps: the model reads ``ids[:, :-1]``, the loss the labels ``labels[:, 1:]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(ids[:, :-1]).reshape(-1, V), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("shard", [1, 5])
def test_shift_by_slicing_the_inputs(shard):
    torch.manual_seed(0)
    ids, labels = _data(t=T + 1)
    labels[:, 1:] = labels[:, :-1].clone()  # NB: the ignored targets where IGNORED puts them, after the shift
    _check(ShiftedInputs().double(), shard, ids, labels)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("items", [None, 17])
@pytest.mark.slow
def test_transformers_causal_lm_loss(items, dtype):
    """transformers' ForCausalLMLoss (labels padded with -100 and shifted, ``.float()``, ``view(-1, V)``; a sum over
    ``num_items_in_batch`` when given) as a model's ``loss_function`` would call it. NB: its ``.float()`` rounds the
    fp64 logits to fp32: the loss is exact to fp32 rounding only; and with this tiny vocabulary those fp32 logits
    are the cheapest values to hand the loss, too cheap to split it off. In fp32 the loss runs once in the forward."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    n = None if items is None else torch.tensor(items)

    def loss(lg, labels):
        return loss_utils.ForCausalLMLoss(lg, labels, vocab_size=V, num_items_in_batch=n)

    torch.manual_seed(0)
    _check(Step(loss).to(dtype), 5, *_data(), tol=1e-6 if dtype == torch.float64 else 2e-5,
           tail=dtype == torch.float32)


@pytest.mark.parametrize("shard", [4])
def test_tied_head(shard):
    """head.weight is emb.weight: one step-free input of the region, its gradient (lookups and projection) summed
    over the shards."""
    torch.manual_seed(0)
    step = Step(FORMS["flatten(0, 1)"][0], tied=True).double()
    assert step.lm.head.weight is step.lm.emb.weight
    _check(step, shard, *_data())


def test_upcast_logits():
    """The logits upcast for the loss, as mixed-precision scripts write ``logits.float()``: here an fp32 model whose
    logits are cast to fp64 inside the region (exact to the fp32 rounding of the model)."""
    torch.manual_seed(0)
    step = Step(lambda lg, t: F.cross_entropy(lg.double().flatten(0, 1), t.flatten()))
    rep = _check(step, 4, *_data(), tol=1e-5)
    assert rep.regions[0].details["sums_over_time"] == ["cross_entropy"]


_ALL_IGNORED = {
    "mean": lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten()),
    "sum": lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum"),
    "label_smoothing": lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), label_smoothing=0.1),
    "weight": lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), weight=_W),
    # the mean written out: 0 / 0 is nan, and the sum's cotangent 1 / 0 is inf
    "sum / count": lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum") / (t != -100).sum(),
    "none, sum / count": lambda lg, t: (F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="none").sum()
                                        / (t != -100).sum()),
    "nll, sum / count, z-loss": lambda lg, t: (F.nll_loss(lg.log_softmax(-1).flatten(0, 1), t.flatten(),
                                                          reduction="sum") / (t != -100).sum()
                                               + 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()),
}


@pytest.mark.parametrize("form", list(_ALL_IGNORED))
@pytest.mark.slow
def test_every_target_ignored(form):
    """A mean over no valid target is nan, as in eager, and its gradients are eager's: zero (a fully padded
    micro-batch must not put nan into the optimizer); a sum is 0 with zero gradients. Where the loss is a sum over
    the valid targets divided by their count, its gradient is eager's too: the ignored targets' are 0, not 0 · inf."""
    torch.manual_seed(0)
    ids, tg = _data()
    tg[:] = -100
    step = Step(_ALL_IGNORED[form]).double()
    ref = copy.deepcopy(step)
    f = _compile(step, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(ids, tg)
    _takes_in(ac.report(f), 2 if "z-loss" in form else 1)
    want = ref(ids, tg)
    assert got.isnan() == want.isnan() and (got.isnan() or got.item() == want.item() == 0)
    got.backward()
    want.backward()
    for (name, p), q in zip(step.named_parameters(), ref.parameters()):
        if "z-loss" in form:  # the z-loss's gradient is finite and not zero: eager's to rounding
            assert not q.grad.isnan().any() and _rel(p.grad, q.grad) <= 1e-10, name
            continue
        assert q.grad is not None and not q.grad.any(), name  # eager's: zeros
        assert p.grad is None or torch.equal(p.grad, q.grad), (name, p.grad)


class LogitsToo(nn.Module):
    """The loss and the logits: the logits are an output of the region ([B, T, V]), the loss is taken in too."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lg = self.lm(ids)
        return F.cross_entropy(lg.view(-1, V), targets.view(-1)), lg


def test_logits_returned_with_the_loss():
    torch.manual_seed(0)
    model = LogitsToo().double()
    ref = copy.deepcopy(model)
    ids, tg = _data()
    f = _compile(model, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, lg = f(ids, tg)
    want, wlg = ref(ids, tg)
    assert _rel(lg, wlg) <= 1e-12 and abs(loss.item() - want.item()) <= 1e-10 * abs(want.item())
    r = torch.randn(lg.shape, dtype=lg.dtype, generator=torch.Generator().manual_seed(1))
    (loss + (lg * r).sum() / 100).backward()
    (want + (wlg * r).sum() / 100).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-10, name
    rep = ac.report(f)
    # the logits are an output: a loss split off would keep their gradient as well
    assert not rep.fallbacks and _takes_in(rep, 1, tail=False)


@pytest.mark.slow
def test_one_graph_for_every_length():
    """Lengths 13, 17, 9, 22: one compiled graph serves them (runtime/length_generic.py retargets the folded
    literal fold·T of ``reshape(B * T, V)`` too), each exact."""
    from adjoint_compile.runtime.length_generic import LengthGenericRegion

    torch.manual_seed(0)
    step = Step(lambda lg, t: F.cross_entropy(lg.reshape(lg.shape[0] * lg.shape[1], V),
                                              t.reshape(t.shape[0] * t.shape[1]))).double()
    ref = copy.deepcopy(step)
    f = _compile(step, 4)
    for t in (13, 17, 9, 22):
        ids, tg = _data(seed=t, t=t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(ids, tg)
        want = ref(ids, tg)
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item()), t
        for a, b in zip(torch.autograd.grad(got, list(step.parameters())),
                        torch.autograd.grad(want, list(ref.parameters()))):
            assert _rel(a, b) <= 1e-10, t
    fns = [getattr(rec.fn, "generic", None) for rec in ac.report(f).compiled]
    regions = [m for fn in fns if fn is not None for m in getattr(fn, "fn", fn).modules()
               if isinstance(m, LengthGenericRegion)]
    assert len(regions) == 1 and {17, 9, 22} <= regions[0].lengths, regions
    # every length runs its loss once, in the forward: the split programs are analysed at their own length, not at
    # the one the graph was captured at
    per_length = regions[0].regions
    assert {9, 22} <= {key[0] for key in per_length} and all(r.tail is not None for r in per_length.values()), per_length



def _batch(B: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, t), generator=g), torch.randint(0, V, (B, t), generator=g)


@pytest.mark.slow
def test_batch_size_changing_with_the_length():
    """Batches of 3 at several lengths, a smaller last batch of an epoch, then batches of 3 again: the graph for
    every length folds the batch into the loss's rows, and each region is analysed at its own call's sizes (a
    region once read dynamo's example values of the call the graph was lowered at and refused the next batch of 3)."""
    torch.manual_seed(0)
    step = Step(FORMS["flatten(0, 1)"][0]).double()
    ref = copy.deepcopy(step)
    f = _compile(step, 4)
    for k, (b, t) in enumerate([(3, 13), (3, 9), (3, 17), (2, 11), (3, 15), (2, 15), (3, 11)]):
        _step_matches(f, step, ref, *_batch(b, t, k))


@pytest.mark.slow
def test_micro_batches_of_two_batch_sizes_at_one_length_before_one_backward():
    """Gradient accumulation over micro-batches of batch sizes 3 and 4 at one length, one backward: each forward's
    backward runs with its own batch's sizes."""
    torch.manual_seed(0)
    step = Step(FORMS["[B, V, T]"][0]).double()
    ref = copy.deepcopy(step)
    f = _compile(step, 4)
    for k, (b, t) in enumerate([(2, 13), (3, 9), (4, 9)]):          # the graph for every length exists from here
        _step_matches(f, step, ref, *_batch(b, t, k))
    _accumulated_matches(f, step, ref, [(1.0, _batch(3, 9, 10)), (0.5, _batch(4, 9, 11))])

class FlatLayer(nn.Module):
    """A layer that computes its decay on ``[B·T, D]`` rows and puts them back (``view``, ``unflatten`` or
    ``reshape(B, -1, D)``), as implementations written with ``rearrange('b l d -> (b l) d')`` do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(D, D), nn.Linear(D, D), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        a = torch.sigmoid(self.a(x.reshape(b * t, D)))
        a = {"view": lambda: a.view(b, t, D), "unflatten": lambda: a.unflatten(0, (b, t)),
             "reshape": lambda: a.reshape(b, -1, D)}[self.how]()
        return x + ac.ops.linear_scan(a, self.b(x), dim=1)


@pytest.mark.parametrize("how", ["view", "unflatten", "reshape"])
def test_a_merge_of_batch_and_steps_inside_a_layer(how):
    """Two such layers are one region (the merge and its inverse are time-local: literals B·T and T rewritten
    per shard), exact."""
    torch.manual_seed(0)
    model = nn.Sequential(FlatLayer(how), FlatLayer(how)).double()
    step = Step(lambda y, t: y.pow(2).mean())
    step.lm = model
    x = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # NB: the mean of squares makes no more per step than it reads: it stays in the sweep (runtime/loss_tail.py)
    rep = _check(step, 4, x, x, tail=False)
    assert {r.details["region_nodes"] for r in rep.regions if r.kind == "linear_recurrence"} == {16}, str(rep)


def test_a_merge_that_cannot_be_sharded_leaves_the_region_as_before(monkeypatch):
    """A region through a merge whose shard programs cannot be built (here: every folded literal refused) is grown
    again without merges: the two smaller regions of before, exact."""
    import adjoint_compile.runtime.shard_program as sp
    from adjoint_compile.errors import UnsupportedRegion

    real = sp.rewrite_lengths

    def refuse_folds(info, T, n, new, L):
        if n in info.folds:
            raise UnsupportedRegion(f"node {n.name}: refused by the test")
        real(info, T, n, new, L)

    monkeypatch.setattr(sp, "rewrite_lengths", refuse_folds)
    torch.manual_seed(0)
    step = Step(lambda y, t: y.pow(2).mean())
    step.lm = nn.Sequential(FlatLayer("view"), FlatLayer("view")).double()
    x = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(step)
    f = _compile(step, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(x, x).backward()
    ref(x, x).backward()
    for (name, p), q in zip(step.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-10, name
    rep = ac.report(f)
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [r.rewrite for r in lin] == ["adjoint", "adjoint"] and len({r.details["region_call"] for r in lin}) == 2


@pytest.mark.slow
def test_logits_exist_one_shard_at_a_time():
    """A training step's live tensors at T = 2048 exceed those at T = 256 by the boundary states alone: the
    [B, T, V] logits, their log-softmax and gradient are made one shard at a time, forward and backward (eager
    autograd's grow by several times the logits)."""
    from adjoint_compile.measure import track_peak

    S, vocab = 64, 256

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.layers = nn.Embedding(vocab, D), nn.Sequential(Layer(D), Layer(D))
            self.head = nn.Linear(D, vocab)

        def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(self.layers(self.emb(ids))).flatten(0, 1), tg.flatten())

    def peak(t: int, adjoint: bool) -> int:
        model = Big()
        g = torch.Generator().manual_seed(2)
        ids, tg = torch.randint(0, vocab, (B, t), generator=g), torch.randint(0, vocab, (B, t), generator=g)
        tg[:, ::3] = -100
        torch._dynamo.reset()
        f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": S}) if adjoint else model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f(ids, tg).backward()
        if adjoint:
            _takes_in(ac.report(f), 1)
        model.zero_grad(set_to_none=True)
        with track_peak("cpu") as m:
            f(ids, tg).backward()
        return m["peak"]

    boundary = 2 * B * D * 4  # two layers' scan states [B, D], fp32
    # the loss, run once with its gradient in the forward (runtime/loss_tail.py), keeps ∂loss/∂hidden [B, T, D] for
    # the backward, where it is scaled once and meets the input gradient [B, T, D]: a few hidden states per step
    hidden = 4 * B * D * 4
    grow = peak(2048, True) - peak(256, True)
    assert grow <= (2048 - 256) // S * boundary * 1.5 + (2048 - 256) * hidden + 64 * 1024, grow
    logits = B * (2048 - 256) * vocab * 4
    assert peak(2048, False) - peak(256, False) > 2 * logits


class Fused(nn.Module):
    """``F.linear_cross_entropy`` (its reference path, ``options=None``: dynamo traces it as the head's linear and
    cross_entropy) of the final norm's rows, the head's weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        h = self.lm.norm(self.lm.layers(self.lm.emb(ids)))
        return F.linear_cross_entropy(h.flatten(0, 1), self.lm.head.weight, tg.flatten(),
                                      linear_bias=self.lm.head.bias, label_smoothing=0.1)


def test_linear_cross_entropy():
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip("F.linear_cross_entropy is new in torch 2.13")
    torch.manual_seed(0)
    _check(Fused().double(), 5, *_data())


class HFWithLabels(nn.Module):
    """A transformers causal LM called with ``labels``: ``forward(ids, labels)`` returns its ``.loss``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


@pytest.mark.slow
def test_transformers_mamba_for_causal_lm_with_labels():
    """transformers' MambaForCausalLM called with ``labels``: its loss_function (ForCausalLMLoss) joins the region
    with the embedding, the mixer layer and the head (exact to its ``.float()``'s fp32 rounding)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=V, hidden_size=8, state_size=4, num_hidden_layers=1, expand=2,
                                   conv_kernel=4, use_associative_scan=False)
    rep = _check(HFWithLabels(transformers.MambaForCausalLM(cfg).double()), 5, *_data(), tol=1e-6)
    assert rep.regions[0].details["embeddings"]


def test_a_long_shard_runs_its_loss_in_chunks(monkeypatch):
    """A long ``shard_size`` (7 of T = 13): the recurrent shards have 7 steps, the loss run in the forward is cut to
    the least bytes of a shard (here made tiny: two steps of logits), and the result stays exact."""
    from adjoint_compile.runtime import shard_parts

    monkeypatch.setattr(shard_parts, "MIN_SHARD_BYTES", 2 * B * V * 8)  # two steps of fp64 logits
    torch.manual_seed(0)
    rep = _check(Step(FORMS["flatten(0, 1)"][0]).double(), 7, *_data())
    details = _takes_in(rep, 1)
    assert details["shard_size"] == 7 and 1 <= details["loss_tail"]["chunk"] < 7, details


def test_one_recurrent_shard_with_its_loss_in_chunks_is_kept(monkeypatch):
    """Default shard sizes where the recurrent part fits one shard but the logits do not: the region is kept (its
    loss runs in chunks, so the logits never exist whole) rather than declined as one shard, and stays exact."""
    from adjoint_compile.runtime import shard_parts

    vocab, t = 2000, 64

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(vocab, D), nn.Sequential(Layer(D), Layer(D)), \
                nn.Linear(D, vocab)

        def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(self.layers(self.emb(ids))).flatten(0, 1), tg.flatten())

    monkeypatch.setattr(shard_parts, "MIN_SHARD_BYTES", 200_000)
    torch.manual_seed(0)
    model = Big().double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    ids, tg = torch.randint(0, vocab, (B, t), generator=g), torch.randint(0, vocab, (B, t), generator=g)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"})
    _step_matches(f, model, ref, ids, tg)
    details = _takes_in(ac.report(f), 1)
    assert details["shard_size"] == t and details["loss_tail"]["chunk"] < t, details


class SelfDistill(nn.Module):
    """Soft targets from a second head, detached (self-distillation): the teacher's parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lm, self.teacher = LM(), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        h = lm.norm(lm.layers(lm.emb(ids)))
        return F.cross_entropy(lm.head(h).flatten(0, 1), self.teacher(h).softmax(-1).detach().flatten(0, 1))


@pytest.mark.parametrize("shard", SHARDS)
def test_a_parameter_the_loss_reaches_only_through_detach_gets_none(shard):
    """As from autograd: None, not zeros (AdamW's weight decay would move a zero-grad parameter, not a None one)."""
    torch.manual_seed(0)
    step = SelfDistill().double()
    ref = copy.deepcopy(step)
    f = _compile(step, shard)
    ids, tg = _data()
    got, want = f(ids, tg), ref(ids, tg)
    got.backward()
    want.backward()
    _takes_in(ac.report(f), 1)
    assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
    for (name, p), q in zip(step.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or _rel(p.grad, q.grad) <= 1e-10, name
    assert step.teacher.weight.grad is None and step.teacher.bias.grad is None


class DetachedToo(nn.Module):
    """The loss, and the logits detached for metrics: whole, and means over time that join the loss (an accuracy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor):
        lg = self.lm(ids)
        return (F.cross_entropy(lg.flatten(0, 1), targets.flatten()), lg.detach(), lg.detach().square() * 2,
                (lg.detach().argmax(-1) == targets).to(lg.dtype).mean(), lg.detach().logsumexp(-1).mean())


class AccuracyToo(nn.Module):
    """The loss and an accuracy, both means over time: they run in the forward, split off the sweep."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor):
        lg = self.lm(ids)
        return F.cross_entropy(lg.flatten(0, 1), targets.flatten()), (lg.detach().argmax(-1) == targets).double().mean()


@pytest.mark.parametrize("make", [DetachedToo, AccuracyToo])
def test_outputs_detached_inside_the_region_require_no_grad(make):
    """A region output computed from detached values only requires no grad, as in eager (it came back with the
    region's grad_fn: a backward through it gave zeros where eager gives None); the loss is exact."""
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    f = _compile(model, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(*_data())
    want = ref(*_data())
    assert [o.requires_grad for o in got] == [o.requires_grad for o in want] == [True] + [False] * (len(got) - 1)
    for g, w in zip(got, want):
        assert _rel(g, w) <= 1e-10
    got[0].backward()
    want[0].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-10, name
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions)


class ConcatenatedLosses(nn.Module):
    """Two losses of one forward made 1-element tensors and concatenated, then summed (a list of loss terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lg = self.lm(ids)
        l1 = F.cross_entropy(lg.flatten(0, 1), targets.flatten())
        l2 = 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()
        return torch.cat([l1[None], l2[None]]).sum()


@pytest.mark.parametrize("shard", [1, 4])
def test_losses_concatenated_from_scalars(shard):
    """``cat([l1[None], l2[None]])`` of 0-dim losses: a cat the token-shift canonicalization reads as a candidate
    shift; it crashed the compile (integer modulo by zero) and now runs exact, both sums taken in."""
    torch.manual_seed(0)
    _check(ConcatenatedLosses().double(), shard, *_data(), n_sums=2, tail=None)
