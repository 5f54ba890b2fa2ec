"""Closed forms of a linear recurrence (passes/match/find_scan_forms.py, passes/match/find_generic_scan.py, passes/capture/scan_forms.py):
the log-space form (minGRU), the cumprod form and ``associative_scan`` in generic mode are proven, rewritten into one
linear_scan and sharded with exact gradients; near misses are rejections with a reason and keep ordinary autograd.

Tolerance: fp32 rel. error <= 1e-5 (max |g - g_ref| / max |g_ref| per tensor) against eager autograd in float64 of
the same model (the closed forms themselves lose precision in fp32 as T grows: b / cumprod(a) grows like 1/Π a).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

import adjoint_compile as ac

D = 4


def _rel(a, b):
    # NB: a gradient that is 0 in exact arithmetic (wa at T = 1: a never matters) is ~1e-19 in float64 eager
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-9))


def _log_scan(log_a, log_b):
    """mingru-pytorch's heinsen_associative_scan_log, spelled out."""
    a_star = log_a.cumsum(dim=1)
    return (a_star + (log_b - a_star).logcumsumexp(dim=1)).exp()


def _comb(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


class Form(nn.Module):
    """a_t = 0.85 + 0.15 sigmoid(x W_a), b_t = x W_b (positive for the log-space forms); out = h ⊙ x."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.wa, self.wb = nn.Linear(D, D), nn.Linear(D, D)
        self.h0 = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        a = 0.85 + 0.15 * torch.sigmoid(self.wa(x))
        b = self.wb(x)
        f = self.form
        if f == "log_space":
            h = _log_scan(a.log(), F.softplus(b).log())
        elif f == "log_space_h0":  # minGRU's prev_hidden: one step prepended
            log_b = torch.cat((self.h0.expand(x.shape[0], 1, D).log(), F.softplus(b).log()), dim=1)
            h = _log_scan(F.pad(a.log(), (0, 0, 1, 0)), log_b)[:, -x.shape[1]:]
        elif f == "cumprod":
            P = a.cumprod(1)
            h = P * (b / P).cumsum(1)
        elif f == "cumprod_h0":
            P = torch.cumprod(a, dim=1)
            h = P * torch.cumsum(b / P, dim=1) + P * self.h0
        elif f == "cumprod_h0_inner":
            P = torch.cumprod(a, 1)
            h = P * (self.h0.view(1, 1, D) + (b / P).cumsum(dim=1))
        elif f == "generic":
            h = associative_scan(_comb, (a, b), dim=1, combine_mode="generic")[1]
        else:
            raise AssertionError(f)
        return h * x


FORMS = {"log_space": "log_space_scan", "log_space_h0": "log_space_scan", "cumprod": "cumprod_scan",
         "cumprod_h0": "cumprod_scan", "cumprod_h0_inner": "cumprod_scan", "generic": "associative_scan"}


def _grads(f, model, x, w):
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    (f(x) * w).sum().backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()] + \
        [x.grad.detach().clone()]


def _reference(model, x, w):
    m64 = Form(model.form).double()
    m64.load_state_dict(model.state_dict())
    return _grads(m64, m64, x.double(), w.double())


@pytest.mark.parametrize("T,shard", [(1, 1), (7, 1), (7, 5), (64, 5)])
@pytest.mark.parametrize("form", list(FORMS))
def test_form_rewritten_and_exact(form, T, shard):
    torch.manual_seed(0)
    model = Form(form)
    x, w = torch.randn(2, T, D), torch.randn(2, T, D)
    ref = _reference(model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": shard})
    got = _grads(f, model, x, w)
    eager = _grads(model, model, x, w)
    for a, b, e in zip(got, ref, eager):
        # NB: a declined region (one shard) runs the graph as captured: eager fp32's own rounding, whose gradient of
        # the decay at T = 1 is ~1e-9 against an exact ~1e-18
        assert _rel(a, b) <= max(1e-5, 2 * _rel(e, b)), (form, T)
    res = ac.report(f).compiled[-1]
    recs = [r for r in res.regions if r.kind == "linear_recurrence"]
    if form == "generic" and T == 1:  # no combine is ever called: the tree is the identity, nothing to recognize
        assert not recs
        return
    if T == 1:  # one shard: declined, ordinary autograd
        assert [(r.source, r.rewrite) for r in recs] == [(FORMS[form], "none")], str(ac.report(f))
        assert recs[0].reason == "one shard: T=1 ≤ shard 1; a single step has nothing to shard"
        return
    assert [(r.source, r.rewrite) for r in recs] == [(FORMS[form], "adjoint")], str(ac.report(f))
    assert res.lowered


def test_explain_reports_the_form():
    torch.manual_seed(0)
    rep = ac.explain(Form("log_space"), torch.randn(2, 9, D), options={"shard_size": 3})
    (r,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert (r.source, r.length, r.rewrite) == ("log_space_scan", 9, "adjoint")
    assert "log_space_scan" in str(rep) and not rep.rejections


# ----------------------------------------------------------------------------------------------------------------
# near misses


def _no_offset(x):  # logcumsumexp(log_b - log_a) + cumsum(log_a): the offset subtracted is not the cumsum
    la, lb = -F.softplus(x), F.softplus(x * 0.5).log()
    return (la.cumsum(1) + (lb - la).logcumsumexp(1)).exp()


def _other_dim_log(x):
    la, lb = -F.softplus(x), F.softplus(x * 0.5).log()
    a_star = la.cumsum(2)
    return (a_star + (lb - a_star).logcumsumexp(1)).exp()


def _other_dim_cumprod(x):
    P = torch.sigmoid(x).cumprod(1)
    return P * (x / P).cumsum(2)


def _not_multiplied_back(x):
    P = torch.sigmoid(x).cumprod(1)
    return x * (x / P).cumsum(1)


def _nonlinear_combine(x):
    def comb(u, v):
        return u[0] * v[0], torch.tanh(v[0] * u[1] + v[1])
    return associative_scan(comb, (torch.sigmoid(x), x), dim=1, combine_mode="generic")[1]


NEAR = [(_no_offset, "is not a cumsum"), (_other_dim_log, "along dim 2, logcumsumexp"),
        (_other_dim_cumprod, "along dim 1, cumsum"), (_not_multiplied_back, "is not multiplied back"),
        (_nonlinear_combine, "combine output 1")]


@pytest.mark.parametrize("fn,why", NEAR, ids=[f.__name__ for f, _ in NEAR])
def test_near_miss_is_rejected_and_left_alone(fn, why):
    torch.manual_seed(0)
    x = torch.randn(2, 7, D)
    rep = ac.explain(fn, x)
    assert not [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert any(j.candidate == "linear_recurrence" and why in j.reason for j in rep.rejections), str(rep)
    f = torch.compile(fn, backend="adjoint", options={"inner": "eager"})
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(x1).sum().backward()
    fn(x2).sum().backward()
    assert not ac.report(f).compiled[-1].lowered
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# mingru-pytorch's minGRU


class _Stack(nn.Module):
    # NB: not nn.Sequential: ac.report finds no graph for a compiled nn.Sequential (it follows Sequential.forward)
    def __init__(self):
        from minGRU_pytorch import minGRU

        super().__init__()
        self.layers = nn.ModuleList([minGRU(6, expansion_factor=1.5), minGRU(6)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _mingru_stack(seed=0):
    torch.manual_seed(seed)
    return _Stack()


def _step(f, model, x, w):
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    (f(x).float() * w).sum().backward()
    return [p.grad.detach().float().clone() for p in model.parameters()] + [x.grad.detach().float().clone()]


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_mingru_recognized_rewritten_exact(inner):
    model = _mingru_stack()
    x, w = torch.randn(2, 13, 6), torch.randn(2, 13, 6)
    ref = _step(model, model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": inner, "shard_size": 3})
    got = _step(f, model, x, w)
    res = ac.report(f).compiled[-1]
    recs = [r for r in res.regions if r.kind == "linear_recurrence"]
    assert [(r.source, r.rewrite) for r in recs] == [("log_space_scan", "adjoint")] * 2, str(ac.report(f))
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-5


def test_mingru_prev_hidden():
    from minGRU_pytorch import minGRU

    torch.manual_seed(0)
    model = minGRU(6)
    x, w, h0 = torch.randn(2, 11, 6), torch.randn(2, 11, 6), torch.rand(2, 1, 6) + 0.1
    ref = _step(lambda v: model(v, h0), model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 5})
    got = _step(lambda v: f(v, h0), model, x, w)
    (r,) = [r for r in ac.report(f).compiled[-1].regions if r.kind == "linear_recurrence"]
    assert (r.source, r.rewrite, r.length) == ("log_space_scan", "adjoint", 11)
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-5


def test_mingru_dynamic_shapes_match_aot_eager():
    model = _mingru_stack()
    f = torch.compile(model, backend="adjoint", dynamic=True, options={"inner": "eager", "shard_size": 4})
    g = torch.compile(model, backend="aot_eager", dynamic=True)
    for T in (9, 14):
        x, w = torch.randn(2, T, 6), torch.randn(2, T, 6)
        ref, got = _step(g, model, x, w), _step(f, model, x, w)
        for a, b in zip(got, ref):
            assert _rel(a, b) <= 1e-5, T
        assert ac.report(f).compiled[-1].lowered, T


def test_mingru_autocast_bf16_tolerance():
    model = _mingru_stack()
    x, w = torch.randn(2, 23, 6), torch.randn(2, 23, 6)
    ref32 = _step(model, model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 4})
    g = torch.compile(model, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got16 = _step(f, model, x, w)
        aot16 = _step(g, model, x, w)
    recs = [r for r in ac.report(f).compiled[-1].regions if r.kind == "linear_recurrence"]
    assert [(r.source, r.rewrite) for r in recs] == [("log_space_scan", "adjoint")] * 2, str(ac.report(f))
    for a, e, r in zip(got16, aot16, ref32):
        assert _rel(a, r) <= 2 * _rel(e, r) + 1e-2


# ----------------------------------------------------------------------------------------------------------------
# several generic-mode scans in one graph


def _generic(a, b):
    return associative_scan(_comb, (a, b), dim=1, combine_mode="generic")[1]


def _loop_scan(a, b):
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


class GenericStack(nn.Module):
    """Two layers each with its own generic-mode scan: ``chained`` (the second scans the first's output, as a stack
    does), ``beside`` (two scans of one input), ``one_bad`` (the second combine is not linear)."""

    def __init__(self, how: str, scan=_generic) -> None:
        super().__init__()
        self.how, self.scan = how, scan
        self.w = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        a1, b1 = 0.5 + 0.5 * torch.sigmoid(self.w[0](x)), self.w[1](x)
        h = self.scan(a1, b1)
        if self.how == "chained":
            return self.scan(torch.sigmoid(self.w[2](h)), self.w[3](h))
        if self.how == "beside":
            return h + self.scan(torch.sigmoid(self.w[2](x)), self.w[3](x))
        return h + _nonlinear_combine(self.w[3](x))


@pytest.mark.parametrize("how", ["chained", "beside", "one_bad"])
@pytest.mark.parametrize("T", [9, 16])
def test_every_generic_scan_of_a_graph_is_proven_on_its_own(how, T):
    """With two generic-mode scans in one graph, their vmapped combines were read as one tree: both were rejected
    ("... is not the inclusive scan of the leaves"). Each is now proven alone; chained, the second reads the first's
    linear_scan (the first's tree was kept alive for it, with ordinary autograd)."""
    torch.manual_seed(0)
    model = GenericStack(how).double()
    x, w = torch.randn(2, T, D, dtype=torch.float64), torch.randn(2, T, D, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    got = _grads(f, model, x, w)
    oracle = GenericStack(how, _loop_scan).double()
    oracle.load_state_dict(model.state_dict())
    for a, b in zip(got, _grads(oracle, oracle, x, w)):
        assert _rel(a, b) <= 1e-10
    res = ac.report(f).compiled[-1]
    assert [(r.source, r.rewrite) for r in res.regions if r.kind == "linear_recurrence"] == \
        [("associative_scan", "adjoint")] * (0 if how == "one_bad" else 2), str(ac.report(f))
    why = [j.reason for j in res.rejections if "generic" in j.reason]
    if how == "one_bad":  # NB: the tree left as written keeps the whole graph as captured (see below)
        assert len(why) == 2 and "combine output 1" in why[0] and "keeps a generic-mode" in why[1], why
    else:  # NB: and nothing of a proven tree is left in the graph: no vmap
        assert not why, why
        assert not any("vmap" in str(n.target) for n in res.captured.gm.graph.nodes), res.captured.gm.graph


class _ReverseBeside(nn.Module):
    """A generic-mode scan that is not rewritten (``reverse=True``) beside a linear_scan that would be."""

    def __init__(self) -> None:
        super().__init__()
        self.wa, self.wb = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        a, b = torch.sigmoid(self.wa(x)), self.wb(x)
        back = associative_scan(_comb, (a, b), dim=1, reverse=True, combine_mode="generic")[1]
        return back + ac.ops.linear_scan(a, b)


def test_a_generic_scan_left_as_written_keeps_its_graph_whole():
    """Lowering the linear_scan moved nodes among the unrewritten tree's vmapped blocks: the compile raised
    ("escaped from inside a function being vmapped"). The graph now keeps ordinary autograd, and says why."""
    torch.manual_seed(0)
    model = _ReverseBeside().double()
    x, w = torch.randn(2, 13, D, dtype=torch.float64), torch.randn(2, 13, D, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    got, want = _grads(f, model, x, w), _grads(model, model, x, w)
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-12
    res = ac.report(f).compiled[-1]
    assert not res.lowered and any("keeps a generic-mode associative_scan" in j.reason for j in res.rejections)
