"""Known scan implementations (passes/capture/known_scans.py): mambapy's Mamba as its users write it, registered and
unknown custom autograd.Functions, and an adapter that is wrong on purpose."""
from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.passes.capture import capture
from helpers import grab_graph

mamba = pytest.importorskip("mambapy.mamba")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _check_grads(model: nn.Module, x: torch.Tensor, options: dict) -> ac.Report:
    """One training step compiled with backend="adjoint" against eager autograd: every parameter's and the
    input's gradient within 1e-5 relative; returns the compiled model's report."""
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    xc = x.detach().clone().requires_grad_()
    f = torch.compile(model, backend="adjoint", options=options)
    f(xc).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or _rel(p.grad, q.grad) <= 1e-5, name
    assert _rel(xc.grad, xr.grad) <= 1e-5
    return ac.report(f)


def _mamba(pscan: bool, d_model: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return mamba.Mamba(mamba.MambaConfig(d_model=d_model, n_layers=2, d_state=4, pscan=pscan))


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("shard_size", [1, 7])
def test_mambapy_pscan_is_recognized_sharded_and_exact(inner, shard_size):
    x = torch.randn(2, 29, 8)  # NB: 29 is not a power of two: PScan pads to 32 and cuts
    rep = _check_grads(_mamba(pscan=True), x, {"inner": inner, "shard_size": shard_size})
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(scans) == 2
    for r in scans:
        assert (r.source, r.rewrite, r.length) == ("registered_scan", "adjoint", 29)
        assert r.details["implementation"] == "mambapy.pscan.PScan"
        assert r.name.startswith("PScan(autograd_function_apply")
        assert f"shard_size={shard_size}" in r.reason
    assert "registered_scan" in str(rep) and not rep.rejections


@pytest.mark.slow
def test_mambapy_pscan_with_symbolic_lengths_is_sharded_and_exact():
    """A new length (or dynamic=True) makes the graph symbolic: its PScan was not looked at before specializing, so
    nothing was rewritten and no reason given; its call then has the sizes among its operands. And dead-code
    elimination ran into the Function's bodies, dropping their in-place scan (1e-4 off in fp64). Three lengths in
    fp64, every gradient against eager; each specialization rewrites both scans."""
    model = _mamba(pscan=True).double()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", dynamic=True, options={"inner": "aot_eager", "shard_size": 4})
    for T in (16, 13, 22):
        x = torch.randn(2, T, 8, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # NB: the scan's order of sums is not PScan's: A_log's small, cancelling gradient is ~1e-7 off in fp64
            assert _rel(p.grad, q.grad) <= 1e-6, (T, name, _rel(p.grad, q.grad))
        model.zero_grad()
        ref.zero_grad()
    lengths = {r.length for r in ac.report(f).regions if r.source == "registered_scan" and r.rewrite == "adjoint"}
    assert lengths == {16, 13, 22}, str(ac.report(f))


@pytest.mark.parametrize("shard_size", [1, 5])
def test_mambapy_sequential_loop_is_one_scan_sharded_and_exact(shard_size):
    """``pscan=False``: the polyfill (polyfills/mambapy_seq.py) replaces the per-step loop of
    ``MambaBlock.selective_scan_seq`` by one linear_scan."""
    x = torch.randn(2, 23, 8)
    rep = _check_grads(_mamba(pscan=False), x, {"inner": "aot_eager", "shard_size": shard_size})
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [(r.source, r.rewrite) for r in scans] == [("linear_scan", "adjoint")] * 2, str(rep)
    assert all("polyfill for mambapy's MambaBlock.selective_scan_seq" in r.reason for r in scans), str(rep)


def test_mambapy_sequential_graph_does_not_grow_with_T():
    sizes = []
    for T in (8, 40):
        rep = ac.explain(_mamba(pscan=False), torch.randn(1, T, 8), options={"inner": "eager"})
        assert [r.length for r in rep.regions if r.kind == "linear_recurrence"] == [T, T]
        sizes.append(len(rep.graphs[0].graph.nodes))
    assert sizes[0] == sizes[1]


def test_mambapy_polyfill_matches_the_library_and_eager_calls_run_the_library():
    from adjoint_compile import polyfills
    from adjoint_compile.polyfills import mambapy_seq
    assert polyfills.installed()["mambapy.mamba"].startswith("registered"), polyfills.installed()
    original = mamba.MambaBlock.selective_scan_seq.__wrapped__
    assert original.__module__ == "mambapy.mamba"
    assert mambapy_seq.check(original, T=1) <= mambapy_seq.TOL and mambapy_seq.check(original, T=9) <= mambapy_seq.TOL
    m = _mamba(pscan=False)  # eagerly, the forwarder runs the library's own loop: same values bit for bit
    blk = m.layers[0].mixer
    ed = blk.config.d_inner
    args = (torch.randn(2, 6, ed), torch.rand(2, 6, ed), -torch.rand(ed, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 4),
            torch.randn(ed))
    assert torch.equal(blk.selective_scan_seq(*args), original(blk, *args))


def test_polyfills_survive_dynamo_reset_and_late_imports():
    """Registered when the library is imported after adjoint_compile, even if ``torch._dynamo.reset()`` cleared
    dynamo's start callbacks before the first compile (a fresh process: nothing imported yet)."""
    code = ("import torch, adjoint_compile, sys; torch._dynamo.reset(); import mambapy.mamba; "
            "from adjoint_compile import polyfills; print(polyfills.installed().get('mambapy.mamba', 'missing'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("registered"), out.stdout


def test_explain_names_the_implementation():
    rep = ac.explain(_mamba(pscan=True, d_model=16), torch.randn(1, 64, 16), options={"shard_size": 16})
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [(r.source, r.rewrite, r.length) for r in scans] == [("registered_scan", "adjoint", 64)] * 2
    assert rep.to_dict()["regions"][0]["details"]["implementation"] == "mambapy.pscan.PScan"


def test_the_check_leaves_the_rng_alone_and_the_builtin_entry_is_listed():
    assert ac.registered_scans()["mambapy.pscan.PScan"] == ac.ScanAdapter(a=0, b=1, dim=1)
    m, x = _mamba(pscan=True), torch.randn(2, 16, 8)
    gm, ex = grab_graph(m, x)
    state = torch.random.get_rng_state()
    cap = capture(gm, ex)
    assert torch.equal(state, torch.random.get_rng_state())
    assert len(cap.normalized["known_scans"]) == 2


# ----------------------------------------------------------------------------------------------------------------
# custom autograd.Functions: registered, wrong on purpose, unknown


class LoopScan(torch.autograd.Function):
    """h_t = a_t * h_{t-1} + b_t along dim 1 from h0 (a hand-written forward and backward)."""

    @staticmethod
    def forward(ctx, b, a, h0):
        hs, h = [], h0
        for t in range(a.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        out = torch.stack(hs, 1)
        ctx.save_for_backward(a, h0, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, h0, out = ctx.saved_tensors
        prev = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
        mus, mu = [], torch.zeros_like(h0)
        for t in reversed(range(a.shape[1])):
            mu = g[:, t] + (a[:, t + 1] * mu if t + 1 < a.shape[1] else 0)
            mus.append(mu)
        mu = torch.stack(mus[::-1], 1)
        return mu, mu * prev, a[:, 0] * mu[:, 0]


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class Layer(nn.Module):
    def __init__(self, d: int = 6, fn: type = LoopScan):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.h0 = nn.Parameter(torch.randn(d) * 0.1)
        self.twice = fn is Twice  # NB: not the class as an attribute: dynamo breaks the graph at self.fn.apply

    def forward(self, x):
        a, b = torch.sigmoid(self.gate(x)), self.inp(x)
        if self.twice:
            return x + self.out(Twice.apply(b) * a)
        return x + self.out(LoopScan.apply(b, a, self.h0.expand(x.shape[0], -1)))


@pytest.fixture
def registry():
    yield
    ac.unregister_scan(LoopScan)


def test_a_registered_function_is_recognized_sharded_and_exact(registry):
    ac.register_scan(LoopScan, ac.ScanAdapter(a=1, b=0, h0=2, dim=1))
    torch.manual_seed(0)
    rep = _check_grads(Layer(), torch.randn(3, 11, 6), {"inner": "aot_eager", "shard_size": 3})
    (r,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert (r.source, r.rewrite) == ("registered_scan", "adjoint")
    assert r.details["implementation"].endswith("LoopScan")


def test_a_wrong_adapter_falls_back_with_a_warning_and_exact_gradients(registry):
    ac.register_scan(LoopScan, ac.ScanAdapter(a=0, b=1, h0=2, dim=1))  # a and b swapped on purpose
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"registered scan .*LoopScan not used: the adapter disagrees"):
        rep = _check_grads(Layer(), torch.randn(3, 11, 6), {"inner": "aot_eager"})
    assert not [r for r in rep.regions if r.kind == "linear_recurrence"]
    (j,) = rep.rejections
    assert "LoopScan" in j.reason and "disagrees with the original" in j.reason and "ordinary autograd" in j.reason
    assert "rejected candidates" in str(rep) and j.node.startswith("autograd_function_apply")


def test_an_adapter_naming_missing_operands_falls_back(registry):
    ac.register_scan(LoopScan, ac.ScanAdapter(a=1, b=0, h0=5))
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="names arguments"):
        rep = _check_grads(Layer(), torch.randn(2, 5, 6), {"inner": "eager"})
    assert len(rep.rejections) == 1


@pytest.mark.parametrize("fn", [LoopScan, Twice])
def test_an_unknown_function_keeps_ordinary_autograd_and_explain_says_why(fn):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning: nothing was registered for it
        rep = _check_grads(Layer(fn=fn), torch.randn(2, 9, 6), {"inner": "aot_eager"})
    assert not [r for r in rep.regions if r.kind == "linear_recurrence"]
    (j,) = rep.rejections
    assert f"custom autograd.Function {fn.__module__}.{fn.__qualname__} runs its own forward and backward" in j.reason
    assert "register_scan" in str(ac.explain(Layer(fn=fn), torch.randn(2, 9, 6)))


def test_register_scan_validates_its_adapter():
    with pytest.raises(TypeError, match="ScanAdapter"):
        ac.register_scan("x.Y", {"a": 0, "b": 1})


class _InPlaceCumsum(torch.autograd.Function):
    """An unknown Function whose forward writes in place into a clone (as library scans do)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        for t in range(1, y.shape[1]):
            y[:, t].add_(y[:, t - 1])
        return y

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        return _InPlaceCumsum.apply(h)


def test_an_unknown_functions_in_place_body_survives_the_rewrite():
    """Dead-code elimination after a region's lowering ran into the Function's forward body with FX's rule and
    dropped its in-place writes (the Function then returned its input). Exact against eager, fp64."""
    torch.manual_seed(0)
    rep = _check_grads(_WithFunction().double(), torch.randn(2, 13, 6, dtype=torch.float64),
                       {"inner": "aot_eager", "shard_size": 4})
    assert any(r.rewrite == "adjoint" for r in rep.regions), str(rep)
