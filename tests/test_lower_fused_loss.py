"""A loss's vocabulary head and cross-entropy fused into one op without logits (runtime/fused_loss.py,
``fused_loss`` option): the loss forms training scripts write, compiled with ``fused_loss=True`` (the op's torch
reference on a CPU), against eager autograd in fp64 at T = 13 with shard sizes 1, 4 and 5, ignored targets at shard
boundaries and whole shards of them; the forms the op cannot take (class weights, nll_loss, a softcap, the logits
returned) are left as written and stay exact. With ``TRITON_INTERPRET=1`` the same runs through the Triton kernels
(fp32). The op's own tests are in test_kernels_linear_ce.py.
"""
from __future__ import annotations

import copy
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_lower_lm_loss import FORMS, LM, SHARDS, V, Step, _data, _rel  # noqa: E402

import adjoint_compile as ac  # noqa: E402
from adjoint_compile.kernels import linear_ce  # noqa: E402
from adjoint_compile.runtime import loss_tail  # noqa: E402

#: the forms whose head and cross-entropy the op takes (the others keep their logits)
FUSED = {"flatten(0, 1)", "view(-1, V)", "reshape(B*T, V)", "[B, V, T]", "sum", "none, mean", "none, mask",
         "label smoothing", "nn.CrossEntropyLoss", "ignore_index=3", "z-loss", "labels padded by -100, [..., 1:]",
         "logits[:, :-1], labels[:, 1:]", "logits[..., :-1, :].contiguous()", "logits[:, :-1].reshape(B*(T-1), V), sum",
         "logits[:, :-1].transpose(1, 2)", "upcast", "logits[:, :-2], labels[:, 2:], sum",
         "logits[:, :T-3].transpose(1, 2), labels[:, 3:]", "logits[:, 3:-1], labels[:, 4:]",
         "logits[:, 3:], labels[:, 3:], sum"}
#: the loss is not a scalar sum: it is not split off the sweep, so nothing is fused
NOT_SPLIT = {"none, per sequence"}


@pytest.fixture
def op_calls(monkeypatch):
    """How many times the fused op's forward ran."""
    calls = [0]
    real = linear_ce.lce_forward

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(linear_ce, "lce_forward", counted)
    return calls


def _run(model: nn.Module, shard: int | None, data, fused=True, tol: float = 1e-10, inner: str = "aot_eager"):
    """One step of ``model`` compiled with ``fused_loss=fused`` against eager: the loss and every gradient."""
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    opts = {"inner": inner, "fused_loss": fused, **({"shard_size": shard} if shard else {})}
    f = torch.compile(model, backend="adjoint", options=opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(*data)
    # NB: the split and the chunk's program must agree on what is fused (the chunks are sized by it)
    assert not [w for w in caught if "fusable vocabulary heads" in str(w.message)]
    want = ref(*data)
    assert abs(got.item() - want.item()) <= tol * abs(want.item()), (got.item(), want.item())
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or _rel(p.grad, q.grad) <= tol, (name, _rel(p.grad, q.grad))
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)
    return rep


def _tail(rep: ac.Report) -> dict:
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "adjoint" for r in lin), str(rep)
    return lin[0].details.get("loss_tail") or {}


# NB: the forms the op does not take run as written (tests/test_lower_lm_loss.py): one shard size checks they stay so.
# The fused ones at shard sizes 1 and 4 run with the slow tests (~6 s each): 5, which leaves a short last shard, here
@pytest.mark.parametrize("form, shard", [
    (f, s) if f not in FUSED or s == 5 else pytest.param(f, s, marks=pytest.mark.slow)
    for f in FORMS for s in (SHARDS if f in FUSED else [4])])
def test_every_form_is_exact_and_fused_where_it_fits(form, shard, op_calls):
    torch.manual_seed(0)
    rep = _run(Step(FORMS[form][0]).double(), shard, _data())
    tail = _tail(rep)
    fused = form in FUSED
    assert bool(tail.get("fused_heads")) == fused, (form, tail)
    assert (op_calls[0] > 0) == fused, (form, op_calls[0])
    reason = next(r.reason for r in rep.regions if r.kind == "linear_recurrence")
    assert ("head and cross-entropy fused" in reason) == fused, reason
    if form not in NOT_SPLIT:
        assert tail, (form, rep)


def test_tied_head_and_no_bias(op_calls):
    torch.manual_seed(0)
    _run(Step(FORMS["label smoothing"][0], tied=True).double(), 4, _data())
    assert op_calls[0] > 0


@pytest.mark.slow
def test_default_and_off_leave_a_cpu_loss_as_written(op_calls):
    for fused in ("auto", False):
        torch.manual_seed(0)
        rep = _run(Step(FORMS["flatten(0, 1)"][0]).double(), 4, _data(), fused=fused)
        assert _tail(rep) and not _tail(rep)["fused_heads"]
    assert op_calls[0] == 0


class BigVocab(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.lm = LM()
        self.lm.head = nn.Linear(self.lm.head.in_features, vocab)

    def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(ids).flatten(0, 1), tg.flatten())


@pytest.mark.slow
def test_a_fused_loss_runs_in_longer_chunks(monkeypatch, op_calls):
    """Without logits a chunk holds a few hidden states per step: with the same least bytes per chunk, the fused
    loss's chunks are far longer than those of the loss as written (sized by their logits)."""
    from adjoint_compile.runtime import shard_parts

    vocab = 1000
    monkeypatch.setattr(shard_parts, "MIN_SHARD_BYTES", 2 * 2 * vocab * 8)  # two steps of fp64 logits
    ids, tg = _data(t=301)
    chunks = {}
    for fused, shard in [(True, 5), (False, 5), (True, None)]:
        torch.manual_seed(0)
        chunks[fused, shard] = _tail(_run(BigVocab(vocab).double(), shard, (ids, tg), fused=fused))["chunk"]
    # NB: a given shard_size bounds the chunks too
    assert chunks[False, 5] < 5 and chunks[True, 5] == 5 and chunks[True, None] >= 20 * chunks[False, 5], chunks


class Softcapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        lg = self.lm(ids)
        return F.cross_entropy((30 * torch.tanh(lg / 30)).flatten(0, 1), tg.flatten())


class ArgmaxToo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        lg = self.lm(ids)
        # an accuracy read from the same logits: the head has another reader, so it stays as written
        hits = (lg.argmax(-1) == tg).sum()
        return F.cross_entropy(lg.flatten(0, 1), tg.flatten()) + 0 * hits


#: more z-loss forms: (loss, whether fused)
Z_FORMS = {
    # a logsumexp of the flattened logits, keepdim: its own shape ([B·T, 1]), not the hidden states' leading dims
    "flat, keepdim": (lambda lg, t: F.cross_entropy(lg.view(-1, V), t.view(-1))
                      + 1e-2 * torch.logsumexp(lg.view(-1, V), -1, keepdim=True).pow(2).mean(), True),
    "[B, V, T] and lse of the upcast": (lambda lg, t: F.cross_entropy(lg.float().transpose(1, 2), t, reduction="sum")
                                        / 7 + 1e-2 * torch.logsumexp(lg.float(), dim=(-1,)).square().sum(), True),
    # a masked z-loss per row of the flattened logits: the rows' lse must keep the [B·T] shape it is multiplied in
    "flat, masked per row": (lambda lg, t: F.cross_entropy(lg.view(-1, V), t.view(-1))
                             + 1e-2 * (torch.logsumexp(lg.view(-1, V), -1).pow(2) * (t.view(-1) % 2)).sum(), True),
    # the logsumexp computed before the loss: the op would run after it, so the head stays as written
    "lse first": (lambda lg, t: 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()
                  + F.cross_entropy(lg.flatten(0, 1), t.flatten()), False),
}


@pytest.mark.parametrize("form", list(Z_FORMS))
def test_z_loss_forms(form, op_calls):
    torch.manual_seed(0)
    loss, fused = Z_FORMS[form]
    step = Step(loss)
    rep = _run(step if "upcast" in form else step.double(), 4, _data(), tol=2e-6 if "upcast" in form else 1e-10)
    assert bool(_tail(rep).get("fused_heads")) == fused and (op_calls[0] > 0) == fused


@pytest.mark.parametrize("model", [Softcapped, ArgmaxToo])
def test_another_reader_of_the_logits_keeps_them(model, op_calls):
    torch.manual_seed(0)
    rep = _run(model().double(), 4, _data())
    assert not _tail(rep).get("fused_heads") and op_calls[0] == 0


@pytest.mark.slow
def test_many_lengths(op_calls):
    """The lengths a training run sees, one compiled step: fused at each, exact at each."""
    torch.manual_seed(0)
    model = Step(FORMS["labels padded by -100, [..., 1:]"][0]).double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "fused_loss": True, "shard_size": 5})
    for t in (23, 37, 64, 101):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        ids, tg = _data(seed=t, t=t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(ids, tg)
        want = ref(ids, tg)
        got.backward()
        want.backward()
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item()), t
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-10, (t, name)
    assert op_calls[0] >= 4


@pytest.mark.parametrize("form", ["[B, V, T]", "z-loss", "labels padded by -100, [..., 1:]"])
@pytest.mark.slow
def test_through_the_triton_kernels(form, monkeypatch, op_calls):
    """fp32, the kernels under the interpreter (the same code a GPU compiles), against eager fp32."""
    monkeypatch.setattr(loss_tail, "FUSED_IMPL", "triton")
    torch.manual_seed(0)
    _run(Step(FORMS[form][0]), 5, _data(), tol=2e-5, inner="eager")
    assert op_calls[0] > 0


def test_the_option_is_checked():
    from adjoint_compile.options import validate
    assert validate({}).fused_loss == "auto" and validate({"fused_loss": False}).fused_loss is False
    for bad in ("yes", 1, None, 1.0):
        with pytest.raises(ac.OptionsError, match="fused_loss"):
            validate({"fused_loss": bad})


def test_under_autocast_no_worse_than_eager_autocast(op_calls):
    """bf16 autocast on a CPU: the head's inputs are cast as ``linear`` would cast them, the logits made in fp32. Both
    the fused step and eager autocast are compared with the fp64 step; the fused error stays within 2x eager's +
    1e-2 (loss and every gradient)."""
    torch.manual_seed(0)
    # NB: a vocabulary large enough that the bf16 logits outweigh the fp32 hidden state (else the loss is not split)
    model = BigVocab(200)
    exact = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, V, (2, 13), generator=g), torch.randint(0, 200, (2, 13), generator=g)
    want = exact(*data)
    want.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = eager(*data)
    e.backward()
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "fused_loss": True, "shard_size": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = f(*data)
    got.backward()
    assert op_calls[0] > 0
    assert abs(got.item() - want.item()) <= 2 * abs(e.item() - want.item()) + 1e-2 * abs(want.item())
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        assert _rel(p.grad.double(), r.grad) <= 2 * _rel(q.grad.double(), r.grad) + 1e-2, name


def test_f_linear_cross_entropy_reference_path(op_calls):
    """``F.linear_cross_entropy`` without options (torch traces it as the head's linear and cross_entropy)."""
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip("F.linear_cross_entropy is new in torch 2.13")
    from test_lower_lm_loss import Fused
    torch.manual_seed(0)
    rep = _run(Fused().double(), 5, _data())
    assert _tail(rep).get("fused_heads") == 1 and op_calls[0] > 0


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["as-written", "fused"])
def test_the_language_model_example_trains(fused):
    """examples/language_model.py (inductor): its gradient check, a falling loss, and the report's row."""
    import runpy
    from pathlib import Path
    main = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "language_model.py"))["main"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = main(["--steps", "12"] + (["--fused"] if fused else []))
    assert got["max_rel_err"] <= 1e-5 and got["losses"][-1] < got["losses"][0] - 0.5, got
    assert "its loss runs once" in got["reason"] and ("no logits kept" in got["reason"]) == fused, got["reason"]


def test_a_frozen_head(op_calls):
    """A head whose weight and bias require no gradient (fine-tuning the rest): exact, and the head's grads None."""
    torch.manual_seed(0)
    model = Step(FORMS["label smoothing"][0]).double()
    model.lm.head.requires_grad_(False)
    _run(model, 4, _data())
    assert op_calls[0] > 0 and model.lm.head.weight.grad is None
