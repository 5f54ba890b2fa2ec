"""Causal convolutions along time inside sharded regions (analysis/time_local.py ``halo``, runtime/shard_program.py):
each shard reads the conv's p = dilation·(k-1) input steps before it from the shard on its left and returns their
cotangent to it, so a whole Mamba-style stack (conv, scan, gate, residual) is one region with exact gradients.
Also: a region that would run as one shard is declined with its reason."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.analysis.fx import is_linear_scan
from adjoint_compile.analysis.grow import infer_seeds
from adjoint_compile.analysis.time_local import analyze
from adjoint_compile.ops import linear_scan
from helpers import trace

D, K = 6, 4


class ConvScan(nn.Module):
    """Two Mamba-like layers: in_proj, causal depthwise conv along time, a gated scan, a gate, a residual.
    ``form``: "slice" (``conv1d(padding=p)[..., :T]``) or "pad" (``conv1d(F.pad(x, (p, 0)))``)."""

    def __init__(self, form: str = "slice", k: int = K, dilation: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.k, self.dil = form, k, dilation
        self.inp = nn.ModuleList([nn.Linear(D, 2 * D) for _ in range(2)])
        self.gate = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.w = nn.Parameter(torch.randn(2, D, 1, k) * 0.4)
        self.b = nn.Parameter(torch.randn(2, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, p = x.shape[1], self.dil * (self.k - 1)
        for i in range(2):
            u, g = self.inp[i](F.layer_norm(x, (D,))).chunk(2, -1)
            if self.form == "slice":
                c = F.conv1d(u.transpose(1, 2), self.w[i], self.b[i], padding=p, dilation=self.dil, groups=D)[..., :T]
            else:
                c = F.conv1d(F.pad(u.transpose(1, 2), (p, 0)), self.w[i], self.b[i], dilation=self.dil, groups=D)
            c = F.silu(c.transpose(1, 2))
            a = torch.sigmoid(self.gate[i](c))
            x = x + linear_scan(a, (1 - a) * c, dim=1) * F.silu(g)
        return x


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _check(model: nn.Module, x: torch.Tensor, options: dict, loss=lambda y: y.pow(2).sum()) -> ac.Report:
    """Output, input and parameter gradients of backend="adjoint" against eager autograd (1e-5 relative)."""
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_(x.is_floating_point())
    yr = ref(xr)
    loss(yr).backward()
    xc = x.detach().clone().requires_grad_(x.is_floating_point())
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yc = f(xc)
        loss(yc).backward()
    assert _rel(yc.detach(), yr.detach()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or _rel(p.grad, q.grad) <= 1e-5, (name, _rel(p.grad, q.grad))
    if x.is_floating_point():
        assert _rel(xc.grad, xr.grad) <= 1e-5
    return ac.report(f)


def _one_region(rep: ac.Report, scans: int, shard: int) -> None:
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == scans and all(r.rewrite == "adjoint" for r in lin), str(rep)
    assert len({r.details["region_call"] for r in lin}) == 1, str(rep)  # one region for the whole stack
    assert all(r.details["shard_size"] == shard for r in lin), str(rep)


@pytest.mark.parametrize("shard", range(1, K + 2))  # 1 .. k+1: shards shorter than, equal to and past the halo
def test_conv_scan_stack_is_one_region_with_exact_gradients(shard):
    x = torch.randn(2, 13, D)  # NB: odd T: the last shard is short
    _one_region(_check(ConvScan(), x, {"shard_size": shard}), 2, shard)


@pytest.mark.parametrize("shard", [1, 3, 5, 7])
def test_padded_dilated_conv_joins_with_a_halo_of_dilation_times_k_minus_1(shard):
    """F.pad(x, (p, 0)) + conv1d, dilation 2, k 3: a halo of p = 4 steps, longer than some shards."""
    x = torch.randn(2, 11, D)
    _one_region(_check(ConvScan("pad", k=3, dilation=2), x, {"shard_size": shard}), 2, shard)


@pytest.mark.slow
def test_inductor_programs_take_halos_from_shards_of_another_length():
    """T = 13 in shards of 4: the last shard is 1 step long, so the halo cotangent it hands left is a slice of a
    shorter buffer (other strides) than the one the full shards hand on; compiled programs must accept both."""
    x = torch.randn(2, 13, D)
    _one_region(_check(ConvScan(), x, {"shard_size": 4, "inner": "inductor"}), 2, 4)


def test_halo_cotangent_reaches_the_shard_on_the_left():
    """A loss on the last step only: with shard size 1 every step's gradient from the conv comes back through the
    halos of the shards to its right (a dropped halo cotangent zeroes them)."""
    x = torch.randn(1, 9, D)
    rep = _check(ConvScan(), x, {"shard_size": 1}, loss=lambda y: y[:, -1].sum())
    _one_region(rep, 2, 1)


def test_one_shard_is_declined_with_its_reason():
    x = torch.randn(2, 64, D)
    rep = ac.explain(ConvScan(), x, options={"inner": "eager"})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "none" for r in lin), str(rep)
    for r in lin:
        assert r.reason.startswith("one shard: T=64 ≤ shard "), r.reason
        assert r.reason.endswith("; set shard_size to shard it"), r.reason
    rep = ac.explain(ConvScan(), x, options={"inner": "eager", "shard_size": 8})
    assert all(r.rewrite == "adjoint" for r in rep.regions if r.kind == "linear_recurrence"), str(rep)


def test_t1_is_one_shard_declined_and_exact():
    rep = _check(ConvScan(), torch.randn(2, 1, D), {"shard_size": 1})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "none" and r.reason.startswith("one shard: T=1 ≤ shard 1") for r in lin)


def test_halo_counts_in_the_memory_estimate():
    """The boundary estimate holds the scan states and the conv halos: (⌈T/S⌉-1) · (state + p·channels) elements."""
    T, S = 12, 4
    rep = ac.explain(ConvScan(), torch.randn(2, T, D), options={"inner": "eager", "shard_size": S})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    mem = lin[0].details["expected_memory_bytes"]
    per_region = mem["autograd"]
    states = 2 * (2 * D) * 4  # two scans, [B=2, D] fp32 each
    halos = 2 * (2 * D * (K - 1)) * 4  # two convs, [B=2, D, k-1] fp32 each
    assert mem["sharded"] == (T // S - 1) * (states + halos) + per_region * S // T


def _analysis(fn, x, halo):
    gm = trace(fn, x)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans, halo), halo)
    # NB: by op, not node name (dynamo names a node after the variable it is assigned to)
    return {("conv1d" if n.target in (F.conv1d, torch.conv1d) else n.name): info.mixing.get(n)
            for n in gm.graph.nodes if n.op == "call_function"}, info


@pytest.mark.parametrize("padding", [1, "same"])
def test_a_non_causal_conv_still_bounds_the_region(padding):
    w = torch.randn(D, 1, 3)

    def fn(x):
        c = F.conv1d(x.transpose(1, 2), w, padding=padding, groups=D).transpose(1, 2)
        return linear_scan(torch.sigmoid(c), c, dim=1)

    x = torch.randn(2, 9, D)
    for halo in (False, True):
        mixing, info = _analysis(fn, x, halo)
        assert not info.convs
        assert mixing["conv1d"] == "convolution along the step axis"
    rep = ac.explain(fn, x, options={"inner": "eager", "shard_size": 3})
    (r,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert r.rewrite == "adjoint" and ("conv1d", "convolution along the step axis") in r.bounds, str(rep)


def test_a_conv_over_features_is_handled_as_before():
    """conv1d over the feature dim of each step ([B·T, 1, D] rows would merge steps; here the step axis is the
    conv's batch dim): time-local with or without halos, and no halo recorded."""
    w = torch.randn(1, 1, 3)

    def fn(x):  # x: [T, 1, D], steps along dim 0 (the conv's batch)
        c = F.conv1d(x, w, padding=1)
        return linear_scan(torch.sigmoid(c), c, dim=0)

    x = torch.randn(9, 1, D)
    got = [_analysis(fn, x, halo) for halo in (False, True)]
    assert got[0][0] == got[1][0] and got[0][0]["conv1d"] is None and not got[1][1].convs


def test_truncated_mode_keeps_convs_as_bounds():
    """Only the exact sweep carries halos: truncated mode's regions stop at the conv as before."""
    rep = ac.explain(ConvScan(), torch.randn(2, 13, D), options={"inner": "eager", "shard_size": 4,
                                                                    "mode": "truncated", "window": 4})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len({r.details["region_call"] for r in lin}) == 2, str(rep)
    assert any(why == "convolution along the step axis" for r in lin for _, why in r.bounds), str(rep)


# --------------------------------------------------------------------------------------------------------------
# the libraries


@pytest.mark.parametrize("shard", [1, 3, 4, 5])  # k = 4: 1, k-1, k, odd
def test_mambapy_stack_is_one_region(shard):
    mamba = pytest.importorskip("mambapy.mamba")
    torch.manual_seed(0)
    model = mamba.Mamba(mamba.MambaConfig(d_model=8, n_layers=2, d_state=4, pscan=False))
    _one_region(_check(model, torch.randn(2, 13, 8), {"shard_size": shard}), 2, shard)


def _hf_loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean() + y.float().sum() * 1e-2


@pytest.mark.parametrize("kind,shard", [("mamba", 1), ("mamba", 3), ("mamba", 4), ("mamba2", 1), ("mamba2", 5)])
def test_transformers_mamba_stacks_are_one_region(kind, shard):
    from test_models_real_modes import _hf

    model, call, ids = _hf(kind)  # tiny configs, 2 layers, T = 21

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return call(self.model, i)

    _one_region(_check(Logits(), ids, {"shard_size": shard}, loss=_hf_loss), 2, shard)
