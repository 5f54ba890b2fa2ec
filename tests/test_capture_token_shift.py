"""Token shifts (fixed-width shifts of a time-local value along time, as RWKV writes them) inside sharded regions:
``passes/capture/canonical_shifts.py`` rewrites their spellings to ``shift_steps(x, p, dim, fill)``, and in exact mode each
shard reads the p steps of x before it from the shard on its left (a halo, carried like a causal conv's) and
returns their cotangent to it.  Other modes keep ending the region at the shift."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.kernels.shift import shift_steps
from adjoint_compile.ops import linear_scan

D = 5


def _shift(x: torch.Tensor, form: str, p: int) -> torch.Tensor:
    if form == "pad":  # one call, negative padding crops
        return F.pad(x, (0, 0, p, -p))
    if form == "cat":
        return torch.cat([torch.zeros_like(x[:, :p]), x[:, :-p]], dim=1)
    if form == "pad_slice":
        return F.pad(x, (0, 0, p, 0))[:, :-p]
    if form == "module":  # RWKV-v4's time_shift
        return nn.ZeroPad2d((0, 0, p, -p))(x)
    if form == "fill":  # a constant fill
        return torch.cat([torch.full_like(x[:, :p], 0.5), x[:, :-p]], dim=1)
    raise ValueError(form)


class TokenShiftStack(nn.Module):
    """Two RWKV-like layers: token shift, mix with the current step, Linear, a gated scan, a residual."""

    def __init__(self, form: str = "pad", p: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.p = form, p
        self.mix = nn.Parameter(torch.rand(2, D))
        self.k = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.g = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            xx = _shift(x, self.form, self.p)
            m = self.mix[i]
            k = self.k[i](x * m + xx * (1 - m))
            a = torch.sigmoid(self.g[i](xx))
            x = x + linear_scan(a, (1 - a) * torch.tanh(k), dim=1)
        return x


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _check(model: nn.Module, x: torch.Tensor, options: dict) -> ac.Report:
    """Output, input and parameter gradients of backend="adjoint" against eager autograd (1e-5 relative), for the
    loss (y * r).sum() with a fixed random r."""
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    yr = ref(xr)
    (yr * r).sum().backward()
    xc = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yc = f(xc)
        (yc * r).sum().backward()
    assert _rel(yc.detach(), yr.detach()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert _rel(p.grad, q.grad) <= 1e-5, (name, _rel(p.grad, q.grad))
    assert _rel(xc.grad, xr.grad) <= 1e-5, _rel(xc.grad, xr.grad)
    return ac.report(f)


def _one_region(rep: ac.Report, shard: int) -> None:
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" for r in lin), str(rep)
    assert len({r.details["region_call"] for r in lin}) == 1, str(rep)  # one region over both layers
    assert all(r.details["shard_size"] == shard for r in lin), str(rep)


def test_shift_steps_matches_its_spellings():
    x = torch.randn(2, 7, D)
    for p in (1, 3, 7):
        want = F.pad(x, (0, 0, p, -p)) if p < 7 else torch.zeros_like(x)
        assert torch.equal(shift_steps(x, p, 1), want)
    assert torch.equal(shift_steps(x, 2, 1, 0.5)[:, :2], torch.full((2, 2, D), 0.5))


@pytest.mark.parametrize("form", ["pad", "cat", "pad_slice", "module"])
@pytest.mark.parametrize("shard", [1, 2, 5])  # 1 = p, p + 1, odd
def test_width_1_stack_is_one_region_with_exact_gradients(form, shard):
    _one_region(_check(TokenShiftStack(form, 1), torch.randn(2, 11, D), {"shard_size": shard}), shard)


@pytest.mark.parametrize("form", ["pad", "cat", "pad_slice"])
@pytest.mark.parametrize("shard", [1, 2, 3, 4, 5])  # shorter than the halo (p = 3: it spans shards), p, p + 1, odd
def test_width_3_stack_is_one_region_with_exact_gradients(form, shard):
    _one_region(_check(TokenShiftStack(form, 3), torch.randn(2, 13, D), {"shard_size": shard}), shard)


@pytest.mark.parametrize("shard", [1, 4])
def test_constant_fill(shard):
    _one_region(_check(TokenShiftStack("fill", 2), torch.randn(2, 9, D), {"shard_size": shard}), shard)


def test_t1_is_exact():
    """T = 1 runs as one shard (declined); a width-3 shift of one step is all fill."""
    for p in (1, 3):
        rep = _check(TokenShiftStack("pad" if p == 1 else "cat", p), torch.randn(2, 1, D), {"shard_size": 1})
        lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
        assert lin and all(r.rewrite == "none" for r in lin), str(rep)


def test_halo_cotangent_reaches_the_shard_on_the_left():
    """A loss on the last step only, shard size 1: the gradient of every earlier step comes back through the
    halos of the shards to its right."""
    model = TokenShiftStack("pad", 3)
    x = torch.randn(1, 9, D)
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    ref(xr)[:, -1].sum().backward()
    xc = x.clone().requires_grad_()
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": 1})
    f(xc)[:, -1].sum().backward()
    assert xr.grad[:, 0].abs().max() > 0
    assert _rel(xc.grad, xr.grad) <= 1e-5
    _one_region(ac.report(f), 1)


def test_truncated_mode_ends_the_region_at_the_shift():
    rep = ac.explain(TokenShiftStack("pad", 1), torch.randn(2, 13, D),
                     options={"inner": "eager", "shard_size": 4, "mode": "truncated", "window": 4})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and len({r.details.get("region_call") for r in lin}) == 2, str(rep)
    assert any("shift along the step dim" in why for r in lin for _, why in r.bounds), str(rep)


def test_explain_in_exact_mode_is_one_region():
    rep = ac.explain(TokenShiftStack("cat", 2), torch.randn(2, 16, D), options={"inner": "eager", "shard_size": 4})
    _one_region(rep, 4)


@pytest.mark.slow
def test_inductor_inner_with_a_short_last_shard():
    """Halos and their cotangents are handed on as contiguous copies: a compiled program is specialized to its
    example inputs' strides, and a slice of a padded shard's has strides that depend on the shard's length."""
    _one_region(_check(TokenShiftStack("pad", 2), torch.randn(2, 13, D), {"shard_size": 3, "inner": "inductor"}), 3)
