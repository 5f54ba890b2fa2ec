"""What a sharded region starts and ends with in exact mode (analysis/time_local.py, analysis/grow.py,
runtime/sharded.py): an embedding lookup of step-carrying indices joins the region, so its [B, T, D] output is never
stored; a sum or mean over time of a region value (a loss) ends the region, adding up its shards' sums, so the
[B, T, ...] value it reduces is never stored either. Gradients against eager autograd; the memory of one step against
T (live tensor bytes, deterministic)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.measure import track_peak
from test_lower_halo import D, ConvScan, _rel

LOSSES = {
    "sum": lambda y, r: (y * r).sum(),
    "mean": lambda y, r: (y * r).mean() * 10,
    "mean over time and batch": lambda y, r: (y * r).mean((0, 1)).pow(2).sum(),
    "sum over time, keepdim": lambda y, r: torch.sum(y * r, dim=1, keepdim=True).tanh().sum(),
    "two sums": lambda y, r: (y * r).sum() + y.pow(2).mean(),
}


class WithLoss(nn.Module):
    """A model and its loss compiled as one module: ``forward(x, r)`` returns the loss of ``model(x)``."""

    def __init__(self, model: nn.Module, loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x), r)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _check(model: nn.Module, x: torch.Tensor, r: torch.Tensor, options: dict, tol: float = 1e-5) -> ac.Report:
    """The loss (to ``tol`` of max(|loss|, 1): a sum of terms of either sign can cancel to much less than them), the
    input's and every parameter's gradient (to ``tol`` relative) of backend="adjoint" against eager autograd."""
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_(x.is_floating_point())
    want = ref(xr, r)
    want.backward()
    xc = x.detach().clone().requires_grad_(x.is_floating_point())
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(xc, r)
        got.backward()
    assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0), (got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or _rel(p.grad, q.grad) <= tol, (name, _rel(p.grad, q.grad))
    if x.is_floating_point():
        assert _rel(xc.grad, xr.grad) <= tol
    return ac.report(f)


def _region(rep: ac.Report) -> dict:
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "adjoint" for r in lin), str(rep)
    assert len({r.details["region_call"] for r in lin}) == 1, str(rep)
    return lin[0].details


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("shard", [1, 4, 5])
def test_a_loss_over_time_ends_the_region(loss, shard):
    x, r = _randn(2, 13, D), _randn(2, 13, D, seed=1)  # NB: T = 13: the last shard is short (the mean's L/T)
    details = _region(_check(WithLoss(ConvScan(), LOSSES[loss]), x, r, {"shard_size": shard}))
    assert details["sums_over_time"], details


def test_the_sum_is_exact_in_float64():
    """Partial sums of shards add up to the whole sum: in fp64 to 1e-12, not just to fp32 rounding."""
    model = WithLoss(ConvScan(), LOSSES["mean"]).double()
    x, r = _randn(2, 17, D, dtype=torch.float64), _randn(2, 17, D, seed=1, dtype=torch.float64)
    _region(_check(model, x, r, {"shard_size": 3}, tol=1e-12))


def test_bf16_sums_add_up_in_fp32():
    """A bf16 region's sum over time: the shards' sums add up in fp32, so the sharded loss is as close to the fp32
    loss as eager bf16's one-pass sum is (within 2x its error + 1e-3)."""
    model = WithLoss(ConvScan(), lambda y, r: (y * r).pow(2).sum())  # NB: all terms positive: no cancellation
    x, r = _randn(2, 128, D), _randn(2, 128, D, seed=1)
    want = model(x, r).item()
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    eager = b16(x.bfloat16(), r.bfloat16()).item()
    torch._dynamo.reset()
    f = torch.compile(b16, backend="adjoint", options={"inner": "eager", "shard_size": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(x.bfloat16(), r.bfloat16())
    assert got.dtype == torch.bfloat16
    assert _region(ac.report(f))["sums_over_time"]
    assert abs(got.item() - want) <= 2 * abs(eager - want) + 1e-3 * max(abs(want), 1.0), (got.item(), eager, want)


def test_a_sum_read_back_by_the_steps_ends_the_region_before_them():
    """``y * y.mean(1)``: a shard cannot know the mean of all steps, so the product (and the loss after it) runs
    outside the region; the mean itself may still end it, being read outside only. Gradients stay exact."""
    loss = lambda y, r: (y * y.mean(1, keepdim=True) * r).sum()  # noqa: E731
    rep = _check(WithLoss(ConvScan(), loss), _randn(2, 12, D), _randn(2, 12, D, seed=1), {"shard_size": 4})
    assert len(_region(rep).get("sums_over_time", [])) <= 1, str(rep)  # the mean at most, never the loss's sum


def test_truncated_mode_takes_the_sum_in_too():
    """The truncated sweep carries no conv halos, but a sum over time holds nothing between shards: it ends the
    truncated region as it ends an exact one (the gradients against the truncated oracle:
    tests/test_lower_truncated_lm_loss.py)."""
    model = WithLoss(ConvScan(), LOSSES["sum"])
    rep = ac.explain(model, _randn(2, 12, D), _randn(2, 12, D, seed=1),
                     options={"inner": "eager", "shard_size": 4, "mode": "truncated", "window": 4})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    # NB: the conv ends the first layer's region; the last one takes in the loss's sum
    assert lin and all(r.rewrite == "truncated" for r in lin) and lin[-1].details.get("sums_over_time"), str(rep)


def test_t1_one_shard_is_declined_and_exact():
    rep = _check(WithLoss(ConvScan(), LOSSES["sum"]), _randn(2, 1, D), _randn(2, 1, D, seed=1), {"shard_size": 1})
    assert all(r.rewrite == "none" for r in rep.regions if r.kind == "linear_recurrence"), str(rep)


# --------------------------------------------------------------------------------------------------------------
# embeddings


class Embedded(nn.Module):
    """Token ids -> nn.Embedding -> the conv + scan stack -> a tied head's logits."""

    def __init__(self, vocab: int = 11, **embedding: object) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(vocab, D, **embedding)
        self.body = ConvScan()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(self.emb(ids)), self.emb.weight)


@pytest.mark.parametrize("shard", [1, 4, 7])
@pytest.mark.parametrize("embedding", [{}, {"padding_idx": 0}])
def test_an_embedding_lookup_joins_the_region(shard, embedding):
    ids = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(2))
    ids[0, :3] = 0  # NB: padding rows: their weight row gets no gradient
    r = _randn(2, 13, 11)
    details = _region(_check(WithLoss(Embedded(**embedding), LOSSES["sum"]), ids, r, {"shard_size": shard}))
    assert details["embeddings"] and details["sums_over_time"], details


def test_an_embedding_with_max_norm_stays_outside():
    """max_norm renormalizes rows of the weight in place while looking them up: not a per-step op."""
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(2))
    rep = _check(WithLoss(Embedded(max_norm=1.0), LOSSES["sum"]), ids, _randn(2, 12, 11), {"shard_size": 4})
    assert not _region(rep).get("embeddings"), str(rep)


# --------------------------------------------------------------------------------------------------------------
# the libraries, as their users call them with the loss compiled too


@pytest.mark.parametrize("kind,shard", [("mamba", 3), ("mamba2", 5)])
def test_transformers_mamba_from_ids_to_loss_is_one_region(kind, shard):
    from test_models_real_modes import _hf

    model, call, ids = _hf(kind)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, i: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            return (call(self.model, i).float() * r).sum()

    r = _randn(*ids.shape, model.config.vocab_size)
    details = _region(_check(Loss(), ids, r, {"shard_size": shard}, tol=1e-5))
    assert details["embeddings"] and details["sums_over_time"], details


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_T():
    """From ids to loss in one region with a fixed shard size, one training step's live tensors at T = 2048 exceed
    those at T = 256 by the boundary states alone (scans' states and convs' halos, (T/S) of each), while eager
    autograd's grow ~8x."""
    S, B = 16, 2

    def peak(T: int, adjoint: bool) -> int:
        model = WithLoss(Embedded(), LOSSES["sum"])
        ids = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(2))
        r = _randn(B, T, 11)
        torch._dynamo.reset()
        f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": S}) if adjoint else model
        f(ids, r).backward()
        model.zero_grad(set_to_none=True)
        with track_peak("cpu") as m:
            f(ids, r).backward()
        return m["peak"]

    boundary = 2 * (B * D + B * D * 3) * 4  # two layers: the scan state [B, D] and the conv halo [B, D, k - 1], fp32
    grow = peak(2048, True) - peak(256, True)
    assert grow <= (2048 - 256) // S * boundary * 1.5 + 64 * 1024, grow
    eager_small, eager_big = peak(256, False), peak(2048, False)
    assert eager_big > 6 * eager_small


# --------------------------------------------------------------------------------------------------------------
# a language-model loss written with gather


class GatherLM(nn.Module):
    """ids -> embedding -> conv + scan stack -> head -> log_softmax -> each step's target log-probability."""

    def __init__(self, vocab: int = 11, along_time: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.body, self.head = nn.Embedding(vocab, D), ConvScan(), nn.Linear(D, vocab)
        self.along_time = along_time

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = self.head(self.body(self.emb(ids))).log_softmax(-1)
        if self.along_time:  # NB: picks other steps' rows: a step of the output reads steps before it
            return -logp.gather(1, targets[..., None].expand(-1, -1, logp.shape[-1]) % logp.shape[1]).mean()
        return -logp.gather(-1, targets[..., None]).mean()


@pytest.mark.parametrize("shard", [1, 5])
def test_a_gathered_log_likelihood_is_one_region_from_ids_to_loss(shard):
    ids = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(4))
    details = _region(_check(GatherLM(), ids[:, :-1], ids[:, 1:], {"shard_size": shard}))
    assert details["embeddings"] and details["sums_over_time"], details


def test_a_gather_along_time_bounds_the_region():
    ids = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(4))
    rep = _check(GatherLM(along_time=True), ids[:, :-1], ids[:, 1:], {"shard_size": 4})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and not any(r.details.get("sums_over_time") for r in lin), str(rep)
    assert any("gather along the step dim" in why for r in lin for _, why in r.bounds), str(rep)


def test_ids_sliced_inside_the_compiled_step_start_the_region():
    """``tokens[:, :-1]`` is a slice along time made inside the graph: it is the region's input, and the lookup after
    it still joins (a user's training step compiled whole)."""
    model = GatherLM()

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
            return self.model(tokens[:, :-1], tokens[:, 1:])

    tokens = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(4))
    details = _region(_check(Step(), tokens, torch.zeros(()), {"shard_size": 5}))
    assert details["embeddings"] and details["sums_over_time"], details
