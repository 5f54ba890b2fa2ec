"""Truncated adjoint (mode="truncated", window W; runtime/truncated.py): gradients against an eager oracle written
here, independently of the package: every scan replaced by h^W_t = the scan of steps max(0, t-W+1)..t started from
h_{t-W}.detach() (h0 when t - W < 0), in a plain Python loop.  Forward values are the true h, so outputs equal exact
mode's; W >= T gives exact autograd."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
import adjoint_compile.ops as ac_ops
from adjoint_compile.analysis.fx import is_linear_scan, scan_args
from helpers import oracle_scan
from adjoint_compile.errors import AdjointVerifyReport
from adjoint_compile.runtime.sharded import make_sharded
from adjoint_compile.runtime.truncated import truncated_scan
from test_lower_sharded import B, D, N, ShapeLog, _full_state, region_inputs, stack_case

# ------------------------------------------------------------------------------------------------ the oracle


def oracle_region(sub, W):
    """The region graph with every linear_scan replaced by :func:`oracle_scan`."""
    gm = copy.deepcopy(sub)
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_linear_scan(n):
            sa = scan_args(n)
            n.target, n.args, n.kwargs = oracle_scan, (sa["a"], sa["b"], sa["h0"], sa["dim"]), {"W": W}
    gm.recompile()
    return gm


def _list(x):
    return [x] if isinstance(x, torch.Tensor) else list(x)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def region_grads(fn, inputs, seed=1):
    outs = _list(fn(*inputs))
    gen = torch.Generator().manual_seed(seed)
    gos = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, inputs, gos, allow_unused=True)


def test_the_oracle_is_autograd_at_w_ge_t_and_differs_below():
    torch.manual_seed(0)
    a, b = torch.rand(2, 9, 3, dtype=torch.double, requires_grad=True), torch.randn(2, 9, 3, dtype=torch.double)
    g = torch.randn(2, 9, 3, dtype=torch.double)
    exact = torch.autograd.grad(ac_ops.linear_scan(a, b), a, g)[0]
    assert rel(torch.autograd.grad(oracle_scan(a, b, W=9), a, g)[0], exact) < 1e-12
    assert rel(torch.autograd.grad(oracle_scan(a, b, W=3), a, g)[0], exact) > 1e-3


# ------------------------------------------------------------------------------------ runtime (make_sharded)

# (T, W, shard size): W = 1, 2, odd, = shard size, > shard size, >= T; shard sizes 1, odd, >= T; T = 1 and odd T
RUNTIME_CASES = [
    (13, 1, 5), (13, 2, 5), (13, 3, 5), (13, 5, 5), (13, 7, 5), (13, 12, 5), (13, 13, 5), (13, 20, 5),
    (13, 3, 1), (13, 4, 1), (13, 6, 3), (13, 3, 13), (13, 3, 20), (13, 9, 4), (1, 1, 1), (1, 3, 1), (2, 1, 1),
]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T,W,S", RUNTIME_CASES)
def test_region_gradients_equal_the_oracle(T, W, S, with_h0):
    case = stack_case(2, T, torch.float64, with_h0)  # 2 SSM layers in one region (h0 shared by both scans)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    f = make_sharded(sub, in_dims, out_dims, S, window=W)
    outs, got = region_grads(f, region_inputs(case))
    ref_outs, want = region_grads(oracle_region(sub, W), region_inputs(case))
    exact_outs, exact = region_grads(sub, region_inputs(case))
    for o, r, e in zip(outs, ref_outs, exact_outs):
        assert rel(o, e) < 1e-12 and rel(r, e) < 1e-12  # forward values are exact
    assert len(got) == len(want) and all((x is None) == (y is None) for x, y in zip(got, want))
    for x, y in zip(got, want):
        if y is not None:
            assert rel(x, y) < 1e-10
    if W < T and T > 2:  # non-vacuous: the truncation changes the gradients
        assert max(rel(x, y) for x, y in zip(got, exact) if y is not None) > 1e-4


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("W,S", [(1, 3), (2, 4), (5, 3), (4, 1), (11, 4)])
def test_scan_vjp_with_nu_carries_equals_the_oracle_both_directions(W, S, reverse):
    """The shard VJP of one scan (runtime/truncated.py) swept by hand with its ν carry, h0 requiring grad;
    reverse scans are the mirror image (the sweep goes left to right)."""
    torch.manual_seed(W * 10 + S)
    T = 11
    a = torch.rand(B, T, D, dtype=torch.double, requires_grad=True)
    b = torch.randn(B, T, D, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(B, D, dtype=torch.double, requires_grad=True)
    g = torch.randn(B, T, D, dtype=torch.double)
    want = torch.autograd.grad(oracle_scan(a, b, h0, 1, W, reverse), (a, b, h0), g)
    bounds = [(s, min(s + S, T)) for s in range(0, T, S)]
    if reverse:
        bounds = bounds[::-1]  # a reverse scan runs from the last shard to the first
    carries, c = [], h0.detach()
    with torch.no_grad():
        for s, e in bounds:
            carries.append(c)
            h, _ = truncated_scan(a[:, s:e], b[:, s:e], c, torch.zeros(B, W, D, dtype=torch.double), 1, W, reverse)
            c = h[:, 0] if reverse else h[:, -1]
    nu, ga, gb = torch.zeros(B, W, D, dtype=torch.double), torch.zeros_like(a), torch.zeros_like(b)
    for k in range(len(bounds) - 1, -1, -1):
        s, e = bounds[k]
        aa, bb = a[:, s:e].detach().requires_grad_(), b[:, s:e].detach().requires_grad_()
        leaf = torch.zeros(B, W, D, dtype=torch.double, requires_grad=True)
        h, dummy = truncated_scan(aa, bb, carries[k], leaf, 1, W, reverse)
        ga[:, s:e], gb[:, s:e], nu = torch.autograd.grad((h, dummy), (aa, bb, leaf), (g[:, s:e], nu))
    for x, y in zip((ga, gb, nu[:, W - 1]), want):
        assert rel(x, y) < 1e-10


def test_no_full_length_state_tensor_is_allocated_in_truncated_mode():
    T, S = 37, 7
    case = stack_case(3, T, torch.float32, True)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    for W in (3, 12):  # within a shard, and over more than one shard
        f = make_sharded(sub, in_dims, out_dims, S, window=W)
        inputs = region_inputs(case)
        f.prepare(inputs)
        with ShapeLog() as rec:
            outs = _list(f(*inputs))
            torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs], allow_unused=True)
        assert rec.shapes and not _full_state(rec.shapes, T)
        assert any(len(s) == 4 and s[1] == S and s[-1] == N for s in rec.shapes)  # shard-length states do appear
        assert (B, W, D, N) in rec.shapes  # the ν carry: W steps of state, not T
    with ShapeLog() as ref:  # positive control: the oracle (and plain autograd) materialize [B, T, D, N]
        region_grads(sub, region_inputs(case))
    assert _full_state(ref.shapes, T)


def test_saved_tensors_are_exact_modes():
    T = 37
    case = stack_case(3, T, torch.float32, False)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    shapes = {}
    for window in (None, 5):
        saved = []
        f = make_sharded(sub, in_dims, out_dims, 7, window=window)
        inputs = region_inputs(case)
        f.prepare(inputs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            f(*inputs)
        shapes[window] = saved
    assert shapes[5] == shapes[None]


# ------------------------------------------------------------------------------------------ end to end


class Layer(nn.Module):
    def __init__(self, d, n, scan):
        super().__init__()
        self.scan = scan
        self.norm = nn.LayerNorm(d)
        self.inp, self.dt, self.B, self.C = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, n), nn.Linear(d, n)
        self.out = nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.randn(d, n) * 0.3)

    def forward(self, x, h0=None):
        u = self.inp(self.norm(x))
        dt = F.softplus(self.dt(u))
        a = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.A_log))
        h = self.scan(a, (dt * u).unsqueeze(-1) * self.B(u).unsqueeze(2), h0)
        return x + self.out((h * self.C(u).unsqueeze(2)).sum(-1))


class TwoLayers(nn.Module):
    def __init__(self, scan=None):
        super().__init__()
        scan = scan or (lambda a, b, h0: ac_ops.linear_scan(a, b, h0))
        self.layers = nn.ModuleList([Layer(D, N, scan), Layer(D, N, scan)])

    def forward(self, x, h0=None):
        for layer in self.layers:
            x = layer(x, h0)
        return x


def _models(W):
    torch.manual_seed(0)
    m = TwoLayers().double()
    oracle = TwoLayers(lambda a, b, h0: oracle_scan(a, b, h0, 1, W)).double()
    oracle.load_state_dict(m.state_dict())
    return m, oracle


def _named_grads(model, x, h0, g):
    model.zero_grad()
    xs = [t.detach().clone().requires_grad_() for t in (x, h0) if t is not None]
    y = model(*xs)
    y.backward(g)
    params = getattr(model, "_orig_mod", model).named_parameters()  # (a compiled module: its model's names)
    return y.detach(), {n: p.grad.clone() for n, p in params}, [t.grad for t in xs]


@pytest.mark.parametrize("T,W,S,with_h0,inner", [
    (13, 1, 4, False, "eager"), (13, 3, 4, True, "eager"), (13, 4, 4, False, "aot_eager"),
    (13, 6, 4, True, "aot_eager"), (13, 13, 4, True, "eager"), (13, 2, 1, False, "eager"),
    (13, 5, 13, True, "eager"), (1, 1, 1, True, "eager"),
])
def test_torch_compile_truncated_gradients_equal_the_oracle(T, W, S, with_h0, inner):
    m, oracle = _models(W)
    torch.manual_seed(1)
    x, g = torch.randn(B, T, D, dtype=torch.double), torch.randn(B, T, D, dtype=torch.double)
    h0 = torch.randn(B, D, N, dtype=torch.double) if with_h0 else None
    f = torch.compile(m, backend="adjoint", options={"mode": "truncated", "window": W, "shard_size": S,
                                                      "inner": inner})
    y, got, got_in = _named_grads(f, x, h0, g)
    y_ref, want, want_in = _named_grads(oracle, x, h0, g)
    assert [r.rewrite for r in ac.report(f).regions if r.kind == "linear_recurrence"] == ["truncated"] * 2
    assert rel(y, y_ref) < 1e-12
    assert got.keys() == want.keys()
    for name in want:
        assert rel(got[name], want[name]) < 1e-10, name
    for a, b in zip(got_in, want_in):
        assert rel(a, b) < 1e-10


def test_forward_equals_exact_mode_and_w_ge_t_gradients_are_exact():
    m, _ = _models(1)
    torch.manual_seed(2)
    x, g = torch.randn(B, 11, D, dtype=torch.double), torch.randn(B, 11, D, dtype=torch.double)
    runs = {}
    for mode, window in (("exact", None), ("truncated", 11), ("truncated", 30), ("truncated", 2)):
        torch._dynamo.reset()
        opts = {"mode": mode, "shard_size": 3, "inner": "eager", **({"window": window} if window else {})}
        runs[window] = _named_grads(torch.compile(m, backend="adjoint", options=opts), x, None, g)
    for w in (11, 30, 2):
        assert rel(runs[w][0], runs[None][0]) < 1e-13  # forward values
    for w in (11, 30):
        for name, grad in runs[None][1].items():
            assert rel(runs[w][1][name], grad) < 1e-10
    assert max(rel(runs[2][1][n], gr) for n, gr in runs[None][1].items()) > 1e-3


# ------------------------------------------------------------------------------------- options and reports


@pytest.mark.parametrize("window", [0, -3, True, False, 2.0, 2.5, "4", None])
def test_bad_windows_are_rejected_naming_the_key(window):
    opts = {"mode": "truncated"} if window is None else {"mode": "truncated", "window": window}
    with pytest.raises(ValueError, match="'window'"):
        ac.explain(TwoLayers(), torch.randn(B, 5, D), options=opts)


def test_explain_shows_the_truncated_rewrite_window_and_shard_size():
    rep = ac.explain(TwoLayers(), torch.randn(B, 13, D), options={"mode": "truncated", "window": 4,
                                                                  "shard_size": 5})
    text = str(rep)
    assert "mode=truncated window=4" in text
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [r.rewrite for r in lin] == ["truncated"] * 2
    assert all("sharded truncated adjoint (window=4)" in r.reason and "shard_size=5 of T=13" in r.reason
               for r in lin)
    assert all(r.details["window"] == 4 and r.details["shard_size"] == 5 for r in lin)
    (chain,) = [r for r in rep.regions if r.kind == "residual_chain"]
    assert chain.rewrite == "none" and "truncated along time only" in chain.reason
    d = rep.to_dict()["regions"][0]
    assert d["rewrite"] == "truncated" and d["details"]["window"] == 4
    wide = ac.explain(TwoLayers(), torch.randn(B, 13, D), options={"mode": "truncated", "window": 13})
    assert ">= T: exact gradients" in wide.regions[0].reason


def test_gated_recurrences_and_residual_chains_say_why_in_truncated_mode():
    from adjoint_compile.passes.decide import TABLE
    gated, chain = TABLE["truncated", "gated_recurrence"], TABLE["truncated", "residual_chain"]
    assert gated.rewrite == "none" and "not a*h + b" in gated.reason and "truncated" in gated.reason
    assert chain.rewrite == "none" and "along layers" in chain.reason

    def gru(x, w):
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            z = torch.sigmoid(x[:, t] + h * w)
            h = z * h + (1 - z) * torch.tanh(x[:, t])
            hs.append(h)
        return torch.stack(hs, 1)

    rep = ac.explain(gru, torch.randn(2, 5, 3), torch.randn(3), options={"mode": "truncated", "window": 2})
    gated_regions = [r for r in rep.regions if r.kind == "gated_recurrence"]
    assert gated_regions and all(r.rewrite == "none" and "not a*h + b" in r.reason for r in gated_regions)


@pytest.mark.slow
def test_verify_reports_fidelity_in_truncated_mode():
    m, _ = _models(3)
    x = torch.randn(B, 13, D, dtype=torch.double)
    opts = {"mode": "truncated", "window": 3, "shard_size": 5, "inner": "eager", "verify": True}
    f = torch.compile(m, backend="adjoint", options=opts)
    with pytest.warns(AdjointVerifyReport, match=r"truncated, window=3, shard_size=5 of T=13.*cosine"):
        f(x).sum().backward()
    fid = ac.report(f).regions[0].details["fidelity"]
    assert fid["window"] == 3 and fid["shard_size"] == 5 and fid["steps"] == 13
    assert fid["output_max_rel_err"] < 1e-12  # forward values are exact
    assert 1e-4 < fid["grad_rel_err"] < 1 and 0.5 < fid["grad_cosine"] < 1 - 1e-8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointVerifyReport)
        rep = ac.explain(m, x, options=opts)
    got = rep.regions[0].details["fidelity"]
    assert got["grad_cosine"] == pytest.approx(fid["grad_cosine"], rel=1e-9)
    torch._dynamo.reset()
    exact = dict(opts, window=13)  # W >= T: exact
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointVerifyReport)
        rep = ac.explain(m, x, options=exact)
    fid = rep.regions[0].details["fidelity"]
    assert fid["grad_rel_err"] < 1e-10 and fid["grad_cosine"] == pytest.approx(1.0, abs=1e-12)


def test_explain_verify_reports_the_whole_models_fidelity_against_the_oracle():
    """``report.fidelity``: all gradients (parameters and the input) of the truncated model against eager autograd,
    for the cotangent explain uses (fp32 randn from torch.Generator().manual_seed(1)). Expected: the oracle model's
    distance from eager autograd, computed here."""
    W, T = 3, 13
    m, oracle = _models(W)
    x = torch.randn(B, T, D, dtype=torch.double)
    g = torch.randn((B, T, D), generator=torch.Generator().manual_seed(1)).double()

    def flat(model):
        xi = x.clone().requires_grad_()
        model.zero_grad()
        model(xi).backward(g)
        return torch.cat([xi.grad.flatten(), *(p.grad.flatten() for p in model.parameters())])

    want_rel = float((flat(oracle) - flat(m)).norm() / flat(m).norm())
    opts = {"mode": "truncated", "window": W, "shard_size": 5, "inner": "eager", "verify": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointVerifyReport)
        rep = ac.explain(m, x, options=opts)
    assert rep.fidelity["tensors"] == 1 + len(list(m.parameters())) and not rep.fidelity["missing"]
    assert want_rel > 1e-4 and rep.fidelity["grad_rel_err"] == pytest.approx(want_rel, rel=1e-9)
    assert rep.fidelity["grad_cosine"] < 1 - 1e-8
    assert "fidelity (all gradients against plain autograd)" in str(rep) and "fidelity" in rep.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointVerifyReport)
        rep = ac.explain(m, x, options=dict(opts, mode="exact", window=None))
    assert rep.fidelity["grad_rel_err"] < 1e-12


def test_backend_verify_reports_the_graphs_fidelity_on_the_first_call():
    """torch.compile(..., verify=True): on the first call, the rewritten graph's gradients against plain autograd
    of the captured graph, warned and in ``report(f).fidelity``: the oracle's distance in truncated mode."""
    W, T = 2, 11
    m, oracle = _models(W)
    x = torch.randn(B, T, D, dtype=torch.double)
    g = torch.randn((B, T, D), generator=torch.Generator().manual_seed(1)).double()

    def flat(model):  # the parameters, in the order dynamo lifts them, do not matter: one vector of all of them
        model.zero_grad()
        model(x).backward(g)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    want_rel = float((flat(oracle) - flat(m)).norm() / flat(m).norm())
    f = torch.compile(m, backend="adjoint", options={"mode": "truncated", "window": W, "shard_size": 3,
                                                     "inner": "eager", "verify": True})
    with pytest.warns(AdjointVerifyReport, match=r"whole graph .*mode=truncated.* gradient relative error"):
        f(x)
    fid = ac.report(f).fidelity
    assert fid["tensors"] == len(list(m.parameters())) and not fid["missing"]
    assert want_rel > 1e-4 and fid["grad_rel_err"] == pytest.approx(want_rel, rel=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointVerifyReport)
        f(x)  # once only


class LoopLayer(nn.Module):
    """The recurrence as a Python loop (rolled into torch's scan, then re-rolled into a linear scan); ``scan`` set:
    the same with that scan function (the oracle)."""

    def __init__(self, scan=None, d: int = 8) -> None:
        super().__init__()
        self.scan, self.l, self.o = scan, nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):
        a, b = self.l(x).chunk(2, -1)
        a = torch.sigmoid(a)
        if self.scan is not None:
            h = self.scan(a, b)
        else:
            h, out = x.new_zeros(x.shape[0], x.shape[2]), []
            for t in range(x.shape[1]):
                h = a[:, t] * h + b[:, t]
                out.append(h)
            h = torch.stack(out, 1)
        return self.o(torch.tanh(h))


@pytest.mark.parametrize("W", [1, 3, 5])
def test_a_rolled_loop_is_truncated_to_its_window(W):
    """A loop over time rolled by the loop roller: the step's appended output is the new state itself, read from the
    re-rolled scan (it was recomputed as one more step outside it, so every window was W + 1)."""
    from adjoint_compile.polyfills import loops
    torch.manual_seed(0)
    m = LoopLayer().double()
    oracle = LoopLayer(lambda a, b: oracle_scan(a, b, None, 1, W)).double()
    oracle.load_state_dict(m.state_dict())
    x, g = torch.randn(2, 13, 8, dtype=torch.float64), torch.randn(2, 13, 8, dtype=torch.float64)
    torch._dynamo.reset()
    f = torch.compile(m, backend="adjoint", options={"mode": "truncated", "window": W, "shard_size": 4,
                                                     "inner": "aot_eager"})
    y = f(x)
    assert any(r.rolled for r in loops.rolled()["LoopLayer.forward"])
    assert [r.rewrite for r in ac.report(f).regions if r.kind == "linear_recurrence"] == ["truncated"]
    got = torch.autograd.grad(y, list(m.parameters()), g)
    want = torch.autograd.grad(oracle(x), list(oracle.parameters()), g)
    assert rel(y, oracle(x)) <= 1e-12
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-10


def test_a_region_that_would_not_save_memory_is_still_truncated():
    """The window changes the gradients asked for: a region the memory estimate declines in exact mode (a reverse-time
    loop of one op, little to save) was declined in truncated mode too, and gave the exact gradients in silence."""
    torch.manual_seed(0)
    B_, T, C, W = 2, 13, 4, 3
    x, cot = torch.randn(B_, T, C, dtype=torch.float64), torch.randn(B_, T, C, dtype=torch.float64)
    wa, wb = (torch.randn(C, C, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def reverse_loop(x, wa, wb):
        a, b = torch.sigmoid(x @ wa), x @ wb
        h, hs = torch.zeros(B_, C, dtype=x.dtype), [None] * T
        for t in reversed(range(T)):
            h = a[:, t] * h + b[:, t]
            hs[t] = h
        return (torch.stack(hs, 1) * cot).sum()

    def oracle(x, wa, wb):
        return (oracle_scan(torch.sigmoid(x @ wa), x @ wb, dim=1, W=W, reverse=True) * cot).sum()

    torch._dynamo.reset()
    f = torch.compile(reverse_loop, backend="adjoint", options={"mode": "truncated", "window": W, "shard_size": 4,
                                                                "inner": "aot_eager"})
    got = torch.autograd.grad(f(x, wa, wb), (wa, wb))
    assert [r.rewrite for r in ac.report(f).regions] == ["truncated"], str(ac.report(f))
    want = torch.autograd.grad(oracle(x, wa, wb), (wa, wb))
    exact = torch.autograd.grad(reverse_loop(x, wa, wb), (wa, wb))
    for a, b, e in zip(got, want, exact):
        assert rel(a, b) <= 1e-12 and rel(a, e) > 1e-2


class _PositionDecay(nn.Module):
    """A decay per position, ``pos[:T]`` of shape [T, 1], broadcast over the batch and the channels."""

    def __init__(self, form: str, scan=None) -> None:
        super().__init__()
        self.lin, self.pos, self.form, self.scan = nn.Linear(6, 6), nn.Parameter(torch.randn(13, 1)), form, scan

    def forward(self, x):
        b, a = self.lin(x), torch.sigmoid(self.pos)[: x.shape[1]]
        if self.scan is not None:
            return self.scan(a.expand_as(b), b)
        if self.form == "linear_scan":
            return ac.ops.linear_scan(a.expand_as(b), b)
        h, out = torch.zeros_like(b[:, 0]), []
        for t in range(x.shape[1]):
            h = a[t] * h + b[:, t]
            out.append(h)
        return torch.stack(out, 1)


@pytest.mark.parametrize("mode", ["exact", "truncated"])
@pytest.mark.parametrize("form, roll", [("linear_scan", True), ("loop", True), ("loop", False)])
def test_a_decay_per_position(mode, form, roll):
    """A [T, 1] decay table: its expand_as was taken for a constant broadcast over the steps (the shard programs then
    failed on it, and the reason was a RuntimeError), and the loop roller aligned its [T, 1] against the state from
    the left ("expand on the batched values fails"). Both kept ordinary autograd: in truncated mode, no window."""
    torch.manual_seed(0)
    m = _PositionDecay(form).double()
    x, g = torch.randn(2, 13, 6, dtype=torch.float64), torch.randn(2, 13, 6, dtype=torch.float64)
    W = 3 if mode == "truncated" else 13
    oracle = _PositionDecay(form, lambda a, b: oracle_scan(a, b, None, 1, W)).double()
    oracle.load_state_dict(m.state_dict())
    torch._dynamo.reset()
    opts = {"mode": mode, "shard_size": 4, "inner": "aot_eager", "roll_loops": roll}
    f = torch.compile(m, backend="adjoint", options={**opts, **({"window": W} if mode == "truncated" else {})})
    y = f(x)
    assert [r.rewrite for r in ac.report(f).regions] == ["adjoint" if mode == "exact" else "truncated"]
    got = torch.autograd.grad(y, list(m.parameters()), g)
    want = torch.autograd.grad(oracle(x), list(oracle.parameters()), g)
    assert rel(y, oracle(x)) <= 1e-12
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-10


@pytest.mark.parametrize("W", [None, 3])
def test_a_reverse_linear_scan_is_sharded_as_the_flipped_forward_scan(W):
    """linear_scan(reverse=True) kept ordinary autograd (exact gradients in truncated mode too) where the same
    recurrence written as a loop over reversed(range(T)) was sharded and truncated: both are now, against the reverse
    oracle, with an h0 (the state after the last step)."""
    torch.manual_seed(0)
    x, cot = torch.randn(2, 13, 4, dtype=torch.float64), torch.randn(2, 13, 4, dtype=torch.float64)
    wa, wb = (torch.randn(4, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    h0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)

    def f(x, wa, wb, h0):
        return (ac.ops.linear_scan(torch.sigmoid(x @ wa), x @ wb, h0, dim=1, reverse=True) * cot).sum()

    def oracle(x, wa, wb, h0):
        return (oracle_scan(torch.sigmoid(x @ wa), x @ wb, h0, dim=1, W=W or 13, reverse=True) * cot).sum()

    torch._dynamo.reset()
    mode = {"mode": "truncated", "window": W} if W else {"mode": "exact"}
    c = torch.compile(f, backend="adjoint", options={**mode, "shard_size": 4, "inner": "aot_eager"})
    got = torch.autograd.grad(c(x, wa, wb, h0), (wa, wb, h0))
    assert [r.rewrite for r in ac.report(c).regions] == ["truncated" if W else "adjoint"], str(ac.report(c))
    for a, b in zip(got, torch.autograd.grad(oracle(x, wa, wb, h0), (wa, wb, h0))):
        assert rel(a, b) <= 1e-12
