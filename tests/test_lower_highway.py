"""mode="highway" end to end (issue 12): torch.compile(..., backend="adjoint", options={"mode": "highway",
"iterations": k}) against the levels oracle (tests/highway_oracle.py), every parameter gradient by name."""
from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from highway_oracle import levels_oracle
from torch._higher_order_ops.scan import scan

import adjoint_compile as ac
from adjoint_compile.runtime.highway import HighwayScan

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss_fn(model(x)).backward()
    out = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    out["<input>"] = x.grad.clone()
    return out


def _compiled_grads(model, x, loss_fn, k, **extra):
    torch._dynamo.reset()
    c = torch.compile(model, backend="adjoint", options={"mode": "highway", "iterations": k, "inner": "eager",
                                                         **extra})
    return _grads(c, x, loss_fn), c


def _assert_same(got, want, what):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=f"{what}: {n}")


def _gru_scan_oracle(m, x, k):
    """GRUScan (examples/gru_scan.py) through the levels oracle: g = [z, (1 - z) ⊙ n], r = z1 ⊙ h + z2."""
    H = m.d_hidden

    def g(h, gx_t):
        r_x, z_x, n_x = gx_t.chunk(3, -1)
        r_h, z_h, n_h = m.hh(h).chunk(3, -1)
        r = torch.sigmoid(r_x + r_h)
        z = torch.sigmoid(z_x + z_h)
        n = torch.tanh(n_x + r * n_h)
        return z, (1 - z) * n

    gx = m.ih(x).transpose(0, 1)
    hs = levels_oracle(g, lambda h, z: z[0] * h + z[1], x.new_zeros(x.shape[0], H), list(gx), k)
    return hs.transpose(0, 1)


def _gru_loop(m, x, _):
    """GRUScan's forward as a plain Python loop (torch's scan in eager mode would itself call torch.compile)."""
    gx, h, out = m.ih(x), x.new_zeros(x.shape[0], m.d_hidden), []
    for t in range(x.shape[1]):
        r_x, z_x, n_x = gx[:, t].chunk(3, -1)
        r_h, z_h, n_h = m.hh(h).chunk(3, -1)
        r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
        h = (1 - z) * torch.tanh(n_x + r * n_h) + z * h
        out.append(h)
    return torch.stack(out, 1)


class _Oracle(nn.Module):
    def __init__(self, m, k, fn):
        super().__init__()
        self.m, self.k, self.fn = m, k, fn

    def forward(self, x):
        return self.fn(self.m, x, self.k)


def _named(oracle_grads):
    return {n.removeprefix("m."): v for n, v in oracle_grads.items()}


@pytest.mark.parametrize("k", [0, 1, 2, 12])
def test_gru_scan_matches_the_levels_oracle(k):
    torch.manual_seed(0)
    ex = _example("gru_scan")
    m, x = ex["make"](), torch.randn(3, 12, 8)
    proj = torch.randn(3, 12, 16)
    loss = lambda y: (y * proj).sum() + y[:, -1].pow(2).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, k)
    want = _named(_grads(_Oracle(m, k, _gru_scan_oracle), x, loss))
    _assert_same(got, want, f"k={k}")
    rep = ac.report(c)
    (r,) = rep.regions
    assert (r.kind, r.source, r.rewrite) == ("gated_recurrence", "scan", "highway")
    assert f"k={k}" in r.reason and "K = diag(z)" in r.reason and f"at most {k} Jacobian" in r.reason
    assert r.details["iterations"] == k


def test_gru_scan_k_at_least_the_length_is_ordinary_autograd():
    torch.manual_seed(1)
    ex = _example("gru_scan")
    m, x = ex["make"](), torch.randn(2, 12, 8)
    loss = lambda y: y.sin().sum()  # noqa: E731
    got, _ = _compiled_grads(m, x, loss, 12)
    _assert_same(got, _named(_grads(_Oracle(m, None, _gru_loop), x, loss)), "k=T vs autograd")
    few, _ = _compiled_grads(m, x, loss, 1)
    assert not torch.allclose(few["hh.weight"], got["hh.weight"], rtol=1e-3, atol=1e-5)


class _TanhRNN(nn.Module):
    """A negative twin: h' = tanh(W h + x) is not of the form z1 ⊙ h + z2 (no highway)."""

    def __init__(self):
        super().__init__()
        self.hh = nn.Linear(16, 16)

    def forward(self, x):
        def step(h, x_t):
            h = torch.tanh(self.hh(h) + x_t)
            return h, h.clone()
        return scan(step, x.new_zeros(x.shape[0], 16), x, dim=1)[1]


def test_a_tanh_rnn_keeps_ordinary_autograd():
    torch.manual_seed(2)
    m, x = _TanhRNN(), torch.randn(2, 6, 16)
    loss = lambda y: y.sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, 0)
    _assert_same(got, _grads(m, x, loss), "tanh RNN")
    assert not ac.report(c).regions or all(r.rewrite == "none" for r in ac.report(c).regions)


class _LinearScan(nn.Module):
    """A linear recurrence written as torch's scan: in highway mode it keeps the exact adjoint (J = 0)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)

        def step(h, ab):
            h = ab[0] * h + ab[1]
            return h, h.clone()
        return scan(step, x.new_zeros(x.shape[0], 8), (a, b), dim=1)[1]


def test_a_linear_recurrence_keeps_the_exact_adjoint_in_highway_mode():
    torch.manual_seed(3)
    m, x = _LinearScan(), torch.randn(2, 10, 8)
    loss = lambda y: y.pow(2).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, 0, shard_size=4)  # NB: one shard of all 10 steps would be declined
    _assert_same(got, _grads(m, x, loss), "linear recurrence, k=0")
    (r,) = ac.report(c).regions
    assert (r.kind, r.rewrite) == ("linear_recurrence", "adjoint")


def test_explain_reports_highway_k_form_and_K():
    torch.manual_seed(0)
    ex = _example("gru_scan")
    rep = ac.explain(ex["make"](), *ex["example_inputs"](), options={"mode": "highway", "iterations": 3})
    (r,) = rep.regions
    assert r.rewrite == "highway"
    assert r.details["highway_carries"] == [{"form": "gated", "r": "z1 ⊙ h + z2 (z1 = z, z2 = mul_1)",
                                             "K": "diag(z)"}]
    assert "Highway-BP k=3" in str(rep)


def test_the_runtime_module_is_in_the_compiled_graph():
    torch.manual_seed(0)
    ex = _example("gru_scan")
    m, x = ex["make"](), torch.randn(2, 12, 8)
    _, c = _compiled_grads(m, x, lambda y: y.sum(), 2)
    (rec,) = ac.report(c).compiled
    mods = [mm for mm in rec.captured.gm.modules() if isinstance(mm, HighwayScan)]
    assert len(mods) == 1 and mods[0].stats.iterations == 2 and mods[0].stats.calls == 1


class GRULoop(nn.Module):
    """The same GRU as a Python loop that dynamo unrolls."""

    def __init__(self, d_in=8, H=16):
        super().__init__()
        self.d_hidden = H
        self.ih, self.hh = nn.Linear(d_in, 3 * H), nn.Linear(H, 3 * H)

    def forward(self, x):
        return _gru_loop(self, x, None)


@pytest.mark.parametrize("k", [0, 1, 2, 7])
def test_gru_unrolled_loop_matches_the_levels_oracle(k):
    torch.manual_seed(4)
    m, x = GRULoop(), torch.randn(3, 7, 8)
    proj = torch.randn(3, 7, 16)
    loss = lambda y: (y * proj).sum() + y[:, 3].pow(2).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, k)
    want = _named(_grads(_Oracle(m, k, _gru_scan_oracle), x, loss))
    _assert_same(got, want, f"loop k={k}")
    (r,) = ac.report(c).regions
    assert (r.kind, r.source, r.rewrite) == ("gated_recurrence", "unrolled_loop", "highway")
    if k >= 7:
        _assert_same(got, _named(_grads(_Oracle(m, None, _gru_loop), x, loss)), "loop k=T vs autograd")


class _DroppedGRULoop(nn.Module):
    def __init__(self, d: int = 4, H: int = 5) -> None:
        super().__init__()
        self.ih, self.hh, self.drop = nn.Linear(d, 3 * H), nn.Linear(H, 3 * H), nn.Dropout(0.5)
        self.H = H

    def forward(self, x):
        gx, h, out = self.ih(x), x.new_zeros(x.shape[0], self.H), []
        for t in range(x.shape[1]):
            r_x, z_x, n_x = gx[:, t].chunk(3, -1)
            r_h, z_h, n_h = self.hh(h).chunk(3, -1)
            r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
            n = self.drop(torch.tanh(n_x + r * n_h))
            h = (1 - z) * n + z * h
            out.append(h)
        return torch.stack(out, 1)


def test_a_dropout_inside_the_loops_step_is_refused_with_the_reason():
    """Highway-BP recomputes the step in the backward: a loop's step drawing random numbers was rewritten and its
    backward raised inside vmap (as the scan form is refused already). It keeps ordinary autograd: the same
    gradients as aot_eager with the same draws."""
    torch.manual_seed(0)
    m, x = _DroppedGRULoop(), torch.randn(2, 6, 4)
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": 6, "inner": "aot_eager"})
    torch.manual_seed(1)
    f(x).pow(2).sum().backward()
    (r,) = [r for r in ac.report(f).regions if r.kind == "gated_recurrence"]
    assert r.rewrite == "none" and "draws random numbers" in r.reason, r.reason
    g = torch.compile(ref, backend="aot_eager")
    torch.manual_seed(1)
    g(x).pow(2).sum().backward()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=n)


# ---------------------------------------------------------------------------------------------------------------
# residual chains over depth


def _relu_resnet_oracle(m, x, k):
    from highway_oracle import chain_levels

    layers = [(lambda v, b=b: b.fc2(torch.relu(b.fc1(v))), lambda v, z: torch.relu(v + z)) for b in m.blocks]
    return m.head(chain_levels(layers, m.inp(x), k)[-1])


def _post_ln_oracle(m, x, k):
    from highway_oracle import chain_levels

    layers = []
    for b in m.blocks:
        layers.append((b.attn, lambda v, z, ln=b.ln1: ln(v + z)))
        layers.append((b.mlp, lambda v, z, ln=b.ln2: ln(v + z)))
    return chain_levels(layers, x, k)[-1]


def _pre_ln_oracle(m, x, k):
    from highway_oracle import chain_levels

    layers = []
    for b in m.blocks:
        layers.append((lambda v, b=b: b.attn(b.ln1(v)), lambda v, z: v + z))
        layers.append((lambda v, b=b: b.mlp(b.ln2(v)), lambda v, z: v + z))
    return m.ln_f(chain_levels(layers, x, k)[-1])


CHAINS = {"relu_resnet": (_relu_resnet_oracle, "relu_add"), "post_ln_transformer": (_post_ln_oracle, "post_ln"),
          "pre_ln_transformer": (_pre_ln_oracle, "pre_ln")}


@pytest.mark.parametrize("k", [0, 1, 2, 6])
@pytest.mark.parametrize("name", list(CHAINS))
def test_residual_chain_matches_the_levels_oracle(name, k):
    torch.manual_seed(5)
    ex = _example(name)
    m, (x,) = ex["make"](), ex["example_inputs"]()
    proj = torch.randn_like(m(x)) if name == "relu_resnet" else None
    loss = (lambda y: (y * proj).sum()) if proj is not None else (lambda y: y.pow(3).mean() + y[:, 0].sum())
    oracle, form = CHAINS[name]
    got, c = _compiled_grads(m, x, loss, k)
    want = _named(_grads(_Oracle(m, k, oracle), x, loss))
    _assert_same(got, want, f"{name} k={k}")
    (r,) = ac.report(c).regions
    assert (r.kind, r.rewrite) == ("residual_chain", "highway") and f"{form}: r = " in r.reason
    # the ResNet's blocks are isomorphic: one vmap over the layers; the transformers alternate attention and MLP
    assert r.details["batched_layers"] == (name == "relu_resnet")
    if k >= r.length:
        _assert_same(got, _grads(m, x, loss), f"{name} k>=L vs autograd")


class _Skip(nn.Module):
    """A negative twin: every layer also reads the input x (a skip across layers, h' = ReLU(h + f(h) + x)): the
    layers' blocks are not functions of h alone, recognition rejects them and nothing is rewritten."""

    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(x)
        for f in self.fc:
            h = torch.relu(h + f(h) * x)
        return h


def test_a_chain_with_a_skip_across_layers_keeps_ordinary_autograd():
    torch.manual_seed(6)
    m, x = _Skip(), torch.randn(4, 8)
    loss = lambda y: y.pow(2).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, 0)
    _assert_same(got, _grads(m, x, loss), "skip")
    assert all(r.rewrite != "highway" for r in ac.report(c).regions)


# ---------------------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("options, words", [
    ({"mode": "highway"}, ["iterations", "required"]),
    ({"mode": "highway", "iterations": -1}, ["iterations", "-1", ">= 0"]),
    ({"mode": "highway", "iterations": True}, ["iterations", "True"]),
    ({"mode": "highway", "iterations": 2.0}, ["iterations", "2.0"]),
    ({"mode": "highway", "iterations": 2, "tolerance": 0}, ["tolerance", "0", "> 0"]),
    ({"mode": "highway", "iterations": 2, "tolerance": True}, ["tolerance", "True"]),
    ({"mode": "exact", "tolerance": 1e-3}, ["tolerance", "highway"]),
])
def test_highway_options_are_validated(options, words):
    with pytest.raises(ac.OptionsError) as info:
        ac.options.validate(options)
    for w in words:
        assert w in str(info.value)


def test_tolerance_stops_early_and_the_report_says_how_many_iterations_ran():
    torch.manual_seed(7)
    ex = _example("gru_scan")
    m, x = ex["make"](), torch.randn(2, 12, 8)
    loss = lambda y: y.sin().sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, 12, tolerance=1e-9)
    _assert_same(got, _named(_grads(_Oracle(m, None, _gru_loop), x, loss)), "tolerance 1e-9")
    (r,) = ac.report(c).regions
    assert 1 <= r.details["highway_iterations_used"] <= 12
    assert r.details["highway_last_update"] < 1e-9
    _, c = _compiled_grads(m, x, loss, 12, tolerance=0.5)
    (r,) = ac.report(c).regions
    assert r.details["highway_iterations_used"] < 12


# ---------------------------------------------------------------------------------------------------------------
# an LSTM written with torch's scan: carries (h, c); c' = f ⊙ c + i ⊙ g is gated (K = diag(f)), h' = o ⊙ tanh(c')
# is not affine in h (r = z, K = 0): Highway-BP Table 1's LSTM [a ⊙ c + b, z3]


class LSTMScan(nn.Module):
    def __init__(self, d_in=6, H=8):
        super().__init__()
        self.H = H
        self.ih, self.hh = nn.Linear(d_in, 4 * H), nn.Linear(H, 4 * H)

    def gates(self, h, gx_t):
        i, f, g, o = (gx_t + self.hh(h)).chunk(4, -1)
        return torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)

    def forward(self, x):
        gx = self.ih(x)
        z = x.new_zeros(x.shape[0], self.H)

        def step(h, c, gx_t):
            i, f, g, o = self.gates(h, gx_t)
            c_new = f * c + i * g
            h_new = o * torch.tanh(c_new)
            return (h_new, c_new), h_new.clone()

        def combine(carry, gx_t):
            (h, c), y = step(*carry, gx_t)
            return (h, c), y

        return scan(combine, (z, z), gx, dim=1)[1]


def _lstm_oracle(m, x, k):
    """The state is [h, c] concatenated: g = [h', f, i ⊙ g] (h' computed from the old state), r = [z_h, f ⊙ c + z_b]."""
    H = m.H

    def g(s, gx_t):
        h, c = s[..., :H], s[..., H:]
        i, f, gg, o = m.gates(h, gx_t)
        return o * torch.tanh(f * c + i * gg), f, i * gg

    def r(s, z):
        return torch.cat([z[0], z[1] * s[..., H:] + z[2]], -1)

    gx = m.ih(x).transpose(0, 1)
    s = levels_oracle(g, r, x.new_zeros(x.shape[0], 2 * H), list(gx), k)
    return s[..., :H].transpose(0, 1)


@pytest.mark.parametrize("k", [0, 1, 2, 6])
def test_lstm_scan_matches_the_levels_oracle(k):
    torch.manual_seed(8)
    m, x = LSTMScan(), torch.randn(3, 6, 6)
    proj = torch.randn(3, 6, 8)
    loss = lambda y: (y * proj).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, k)
    _assert_same(got, _named(_grads(_Oracle(m, k, _lstm_oracle), x, loss)), f"LSTM k={k}")
    regions = ac.report(c).regions
    assert [r.rewrite for r in regions] == ["highway"]
    forms = regions[0].details["highway_carries"]
    assert forms[0]["K"] == "0" and forms[1]["K"].startswith("diag(")
    if k >= 6:
        _assert_same(got, _grads(m, x, loss), "LSTM k=T vs autograd")


class LSTMDepth(nn.Module):
    """Highway-BP Table 1's LSTM form over depth: the cell c is the chain's state; each layer's gates read
    h = σ(o) ⊙ tanh(c), with o fixed across layers, so r = σ(f) ⊙ c + σ(i) ⊙ tanh(g) and K = diag(σ(f))."""

    def __init__(self, d=6, L=4):
        super().__init__()
        self.o = nn.Parameter(torch.randn(d))
        self.w = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(L))

    def forward(self, c):
        for w in self.w:
            h = torch.sigmoid(self.o) * torch.tanh(c)
            i, f, g = w(h).chunk(3, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return c


def _lstm_depth_oracle(m, x, k):
    from highway_oracle import chain_levels

    def g(v, w):
        i, f, gg = w(torch.sigmoid(m.o) * torch.tanh(v)).chunk(3, -1)
        return torch.sigmoid(f), torch.sigmoid(i) * torch.tanh(gg)

    layers = [(lambda v, w=w: g(v, w), lambda v, z: z[0] * v + z[1]) for w in m.w]
    return chain_levels(layers, x, k)[-1]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_lstm_chain_form_matches_the_levels_oracle(k):
    torch.manual_seed(7)
    m, x = LSTMDepth(), torch.randn(5, 6)
    proj = torch.randn(5, 6)
    loss = lambda y: (y * proj).sum() + y.pow(2).sum()  # noqa: E731
    got, c = _compiled_grads(m, x, loss, k)
    _assert_same(got, _named(_grads(_Oracle(m, k, _lstm_depth_oracle), x, loss)), f"lstm chain k={k}")
    (r,) = [r for r in ac.report(c).regions if r.kind == "residual_chain"]
    assert r.rewrite == "highway" and "lstm: r = " in r.reason, r.reason
    if k >= r.length:
        _assert_same(got, _grads(m, x, loss), "lstm chain k>=L vs autograd")


class _TwoStateLoop(torch.nn.Module):
    """An LSTM-like loop carrying h and c."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.g = torch.nn.Linear(2 * d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype)
        out = []
        for t in range(x.shape[1]):
            f, i = torch.sigmoid(self.g(torch.cat([x[:, t], h], -1))).chunk(2, -1)
            c = f * c + i * x[:, t]
            h = torch.tanh(c)
            out.append(h)
        return torch.stack(out, 1)


def test_exact_mode_points_to_highway_only_where_highway_takes_the_loop():
    """The exact-mode reason of a gated loop said "mode='highway' rewrites it" for a loop highway then refused (and
    of a loop rolled into a scan, "may rewrite it")."""
    import warnings
    reasons = {}
    for mode in ({"mode": "exact"}, {"mode": "highway", "iterations": 2}):
        torch._dynamo.reset()
        f = torch.compile(_TwoStateLoop(), backend="adjoint", options={**mode, "inner": "aot_eager"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f(torch.randn(2, 9, 6)).sum().backward()
        # NB: exact mode rolls the loop into a scan, highway unrolls it: the same gated carry, by either source
        reasons[mode["mode"]] = [r.reason for r in ac.report(f).regions if r.kind == "gated_recurrence"]
    assert reasons["highway"] and all("carries more than its one state" in r for r in reasons["highway"])
    assert reasons["exact"] and all("mode='highway' would not either: the loop carries more than its one state" in r
                                    for r in reasons["exact"]), reasons["exact"]


class _GRULoop(torch.nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.z, self.c = torch.nn.Linear(2 * d, d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            xh = torch.cat([x[:, t], h], -1)
            z = torch.sigmoid(self.z(xh))
            h = (1 - z) * h + z * torch.tanh(self.c(xh))
            out.append(h)
        return torch.stack(out, 1)


def test_a_two_step_loop_says_it_is_too_short():
    """Its reason named an internal node ("the template step reads l_s_modules_z_parameters_weight_, which is
    neither its state, a slice nor shared")."""
    import warnings
    torch._dynamo.reset()
    torch.manual_seed(0)
    m, x = _GRULoop().double(), torch.randn(2, 2, 4, dtype=torch.float64)
    f = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": 2, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.autograd.grad(f(x).square().sum(), list(m.parameters()))
    want = torch.autograd.grad(m(x).square().sum(), list(m.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
    (r,) = ac.report(f).regions
    assert r.rewrite == "none" and r.reason.startswith("a loop of 2 steps is too short for Highway-BP"), r.reason
