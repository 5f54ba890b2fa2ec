"""Python loops over range rolled before dynamo (polyfills/loops.py): the step traced once as torch's scan.

Oracle: the same module run eagerly (plain autograd) in float64: outputs and every parameter's gradient to 1e-10.
What is rolled is read from ``loops.rolled()`` and the captured graph (a ``scan`` node, no per-step copies);
whatever is not rolled must still be exact.
"""
from __future__ import annotations

import gc
import warnings
import importlib.util
import sys

import torch
import torch.nn as nn
import pytest

import adjoint_compile as ac
from adjoint_compile.polyfills import loop_runtime, loops



@pytest.fixture(autouse=True)
def _f64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()
    yield
    torch.set_default_dtype(prev)


class Gate(nn.Module):
    """The loop as users write it: h = sigmoid(W_a x_t) * h + W_b x_t, outputs collected and stacked."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h = torch.zeros_like(x[:, 0])
        hs = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return self.out(torch.stack(hs, 1))


class Cell(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * d, d)

    def forward(self, x_t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        z = torch.sigmoid(self.gate(torch.cat([x_t, h], -1)))
        return z * h + (1 - z) * x_t


class Forms(nn.Module):
    """Two carries (one a scalar at first), a submodule cell, an ellipsis index, a time-major parameter, two lists;
    one list read only by stack, one read another way."""

    def __init__(self, d: int = 5, t_max: int = 64) -> None:
        super().__init__()
        self.cell = Cell(d)
        self.pos = nn.Parameter(torch.randn(t_max, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.transpose(1, 2)  # [B, d, T]
        h, s = torch.zeros(x.shape[0], x.shape[2]), 0.0
        outs, sums = [], list()
        for t in range(1, x.shape[1]):
            h = self.cell(xt[..., t] + self.pos[t], h)
            s = 0.9 * s + h.sum(-1)
            outs.append(h * 2)
            sums.append(s)
        y = torch.stack(outs, dim=-2)
        return y.sum() + sum(v.square() for v in sums) + s.sum()


class Grows(nn.Module):
    """A carry that grows every step (scan cannot take it): the steps run as a Python loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x[:, :1] * 0
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(x[:, t] + h)
            out = torch.cat([out, h[:, None]], 1)
        return out


class Refused(nn.Module):
    """Loops the roller must leave as written: a write into a buffer, t arithmetic, control flow, .item(), a
    temporary read after the loop."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros_like(x)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            buf[:, t] = h
        g = torch.zeros_like(h)
        for t in range(1, x.shape[1]):
            g = 0.5 * g + x[:, t] - x[:, t - 1]
        k = torch.zeros_like(h)
        for t in range(x.shape[1]):
            if t > 0:
                k = k * 0.5
            k = k + x[:, t]
        m = torch.zeros_like(h)
        for t in range(x.shape[1]):
            m = m + x[:, t] * float(x[0, t, 0].item() > 0)
        for t in range(x.shape[1]):
            last = self.lin(x[:, t])
        return buf.sum() + g.sum() + k.sum() + m.sum() + last.sum()


def _check(model: nn.Module, x: torch.Tensor, **options) -> ac.explain.Report:
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    f = torch.compile(lambda v: model(v).square().sum(), backend="adjoint", options=options or None)
    got = f(x1)
    got.backward()
    g = [p.grad.clone() for p in model.parameters()] + [x1.grad.clone()]
    model.zero_grad(set_to_none=True)
    want = model(x2).square().sum()
    want.backward()
    w = [p.grad for p in model.parameters()] + [x2.grad]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, a, b in zip([n for n, _ in model.named_parameters()] + ["x"], g, w):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"grad {n}: {m}")
    return ac.report(f)


def _scans(rep) -> int:
    """Regions captured from torch's scan (a rolled loop; an unrolled one is source "unrolled_loop")."""
    return sum(1 for r in rep.regions if r.source == "scan")


@pytest.mark.parametrize("T", [1, 2, 3, 7, 50])
def test_gate_rolled_exact(T):
    rep = _check(Gate(), torch.randn(2, T, 6))
    if T >= loop_runtime.MIN_STEPS:
        assert _scans(rep) == 1 and [r.source for r in rep.regions] == ["scan"]
    else:  # too short to roll: the loop as written
        assert _scans(rep) == 0
    assert any(r.rolled for r in loops.rolled()["Gate.forward"])


def test_gate_rolled_and_sharded_exact():
    rep = _check(Gate(), torch.randn(2, 37, 6), shard_size=5)
    assert [(r.source, r.rewrite) for r in rep.regions] == [("scan", "adjoint")]


class GRULoop(nn.Module):
    """A GRU written as a loop: a gated recurrence, rolled in exact mode (it keeps autograd there)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.d, self.ih, self.hh = d, nn.Linear(d, 3 * d), nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx, h, out = self.ih(x), x.new_zeros(x.shape[0], self.d), []
        for t in range(x.shape[1]):
            r_x, z_x, n_x = gx[:, t].chunk(3, -1)
            r_h, z_h, n_h = self.hh(h).chunk(3, -1)
            r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
            h = (1 - z) * torch.tanh(n_x + r * n_h) + z * h
            out.append(h)
        return torch.stack(out, 1)


def test_the_steps_peeled_at_trace_time_are_no_region():
    """The rolled loop's two steps traced to check its carries stay in dynamo's graph, unused: no second region."""
    rep = _check(GRULoop(), torch.randn(2, 9, 6), inner="aot_eager")
    assert [(r.kind, r.source) for r in rep.regions] == [("gated_recurrence", "scan")], rep
    # NB: highway mode unrolls the loop and proves its steps there: from the rolled loop it is no promise
    assert "mode='highway' unrolls the loop and may rewrite it" in rep.regions[0].reason, rep.regions[0].reason


@pytest.mark.slow
def test_graph_does_not_grow_with_T():
    sizes = [len(_check(Gate(), torch.randn(2, T, 6)).graphs[0].graph.nodes) for T in (16, 128)]
    assert sizes[0] == sizes[1]


@pytest.mark.slow
def test_forms_rolled_exact():
    rep = _check(Forms(), torch.randn(3, 11, 5))
    assert _scans(rep) == 2  # h and s: two recurrences in the one scan
    (r,) = loops.rolled()["Forms.forward"]
    assert r.rolled and "carries h, s" in r.reason and "collects outs, sums" in r.reason


def test_growing_carry_runs_as_loop_exact():
    rep = _check(Grows(), torch.randn(2, 9, 3))
    assert _scans(rep) == 0


def test_refused_loops_stay_as_written_exact():
    _check(Refused(), torch.randn(2, 6, 4))
    why = [r.reason for r in loops.rolled()["Refused.forward"]]
    assert not any(r.rolled for r in loops.rolled()["Refused.forward"])
    assert why == ["a write into a tensor, attribute or starred target", "t is used other than as an index",
                   "a If statement in the step", "calls float, which may not trace inside torch's scan",
                   "last is read after the loop"]


def test_roll_loops_false_and_other_backends_unroll():
    rep = _check(Gate(), torch.randn(2, 9, 6), roll_loops=False)
    assert _scans(rep) == 0 and [r.source for r in rep.regions] == ["unrolled_loop"]
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    m = Gate()
    _check(m, torch.randn(2, 9, 6))  # rolled for adjoint ...
    torch._dynamo.reset()
    torch.compile(m, backend=keep)(torch.randn(2, 9, 6))  # ... and unrolled as written for any other backend
    assert not any(n.target is torch.ops.higher_order.scan for g in graphs for n in g.graph.nodes)
    assert sum(1 for g in graphs for n in g.graph.nodes if "sigmoid" in str(n.target)) == 1
    assert sum(1 for g in graphs for n in g.graph.nodes if "mul" in str(n.target)) == 9


class Counting(nn.Module):
    """A cell with a side effect in Python: it may not trace inside scan, so its caller's loop is not rolled."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x_t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x_t)


class UsesCounting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = Counting()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(x[:, t]) + h)
        return h


def test_side_effect_in_cell_is_not_rolled_exact():
    m = UsesCounting()
    rep = _check(m, torch.randn(2, 5, 4))
    assert _scans(rep) == 0 and m.cell.calls == 2 * 5  # compiled trace + eager oracle: one call a step each


def test_plain_function_rolled():
    def helper_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = b[0] * 0
        ys = []
        for t in range(a.shape[0]):
            h = a[t] * h + b[t]
            ys.append(h)
        return torch.stack(ys)
    new, (rep,), _ = loops.analyse(helper_scan)
    assert new is not None and rep.rolled
    a, b = torch.rand(7, 3), torch.randn(7, 3)
    assert torch.equal(new(a, b), helper_scan(a, b))  # eager: the rolled function runs the loop as written


class ComplexLoop(nn.Module):
    """A complex carry: torch's scan cannot differentiate it, so the steps run as a Python loop."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.rand(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = torch.exp(-0.1 + 1j * self.theta)
        h = torch.zeros(x.shape[0], x.shape[2], dtype=lam.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = lam * h + x[:, t]
            ys.append(h.real)
        return torch.stack(ys, 1)


def test_complex_carry_runs_as_loop_exact():
    rep = _check(ComplexLoop(), torch.randn(2, 7, 3))
    assert _scans(rep) == 0


def _make_decay(scale: float | torch.Tensor):
    """Functions with one code object and different closures: each must roll with its own."""
    def decay_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = b[0] * 0
        ys = []
        for t in range(a.shape[0]):
            h = scale * a[t] * h + b[t]
            ys.append(h)
        return torch.stack(ys)
    return decay_scan


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_same_code_different_closures_exact(kind):
    """Each function rolls with its own closure cells (tensors); a float read by the step keeps the loop as written
    (dynamo makes a float that changed symbolic, which scan refuses)."""
    a, b = torch.rand(9, 3), torch.randn(9, 3)
    for i, scale in enumerate((0.5, -2.0)):
        fn = _make_decay(torch.tensor(scale) if kind == "tensor" else scale)
        f = torch.compile(lambda u, v: fn(u, v), backend="adjoint")
        torch.testing.assert_close(f(a, b), fn(a, b), rtol=1e-10, atol=1e-10)
        assert _scans(ac.report(f)) == (i + 1 if kind == "tensor" else 0)  # NB: one record for the lambda's code
    assert all(r.rolled for r in loops.rolled()["_make_decay.<locals>.decay_scan"])


def _recurses(v: torch.Tensor) -> torch.Tensor:
    """Calls itself (never run here): reading it must end."""
    return _recurses(v * 0.5)


def test_a_helper_that_calls_itself_is_refused():
    from adjoint_compile.polyfills import loop_calls
    assert loop_calls._own_calls(_recurses) is None
    assert loop_calls._own_calls(_make_decay) is None  # a def inside: not straight-line


def _loop_with(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h = torch.tanh(m.cell(x[:, t]) + h)
    return h


def test_module_passed_in_is_not_rolled_exact():
    """A module handed to a function whose step calls it: its calls are not checked per instance, so not rolled."""
    owner, x = UsesCounting(), torch.randn(2, 5, 4)
    f = torch.compile(lambda v: _loop_with(owner, v).square().sum(), backend="adjoint")
    got = f(x)
    assert owner.cell.calls == 5  # one call a step: traced as written
    torch.testing.assert_close(got, _loop_with(owner, x).square().sum(), rtol=1e-10, atol=1e-10)
    assert _scans(ac.report(f)) == 0
    assert any(r.rolled for r in loops.rolled()["_loop_with"])  # rolled in source; ok() refused it at trace time


def test_highway_mode_keeps_the_loop_unrolled():
    rep = _check(Gate(), torch.randn(2, 9, 6), mode="highway", iterations=9)
    assert _scans(rep) == 0 and [r.source for r in rep.regions] == ["unrolled_loop"]


def _top_scan(x: torch.Tensor) -> torch.Tensor:
    h = torch.zeros_like(x[:, 0])
    hs = []
    for t in range(x.shape[1]):
        h = 0.5 * h + x[:, t]
        hs.append(h)
    return torch.stack(hs, 1).square().sum()


@pytest.mark.parametrize("how", ["module", "module_with_hook", "function", "unrollable_module"])
def test_a_loop_in_the_compiled_callable_itself_is_rolled_exact(how):
    """torch.compile(model) compiles model.forward's own frame, which dynamo traces as written: the backend has it
    compiled in a frame around it, so the loop rolls as anywhere else; other backends are left alone."""
    torch.manual_seed(0)
    model = Refused() if how == "unrollable_module" else Gate()
    if how == "module_with_hook":
        model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    x = torch.randn(2, 9, 4 if how == "unrollable_module" else 6)
    target = _top_scan if how == "function" else model
    f = torch.compile(target, backend="adjoint", options={"shard_size": 4})
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = f(x1), target(x2)
    got, want = (got, want) if how == "function" else (got.square().sum(), want.square().sum())
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-10)
    rep = ac.report(f)
    sources = [r.source for r in rep.regions]
    if how == "unrollable_module":  # nothing rolls: compiled as before, its own frame traced as written
        assert "scan" not in sources, sources
    else:
        assert sources == ["scan"] and [r.rewrite for r in rep.regions] == ["adjoint"], sources


def test_no_top_frame_wrap_when_rolling_is_off():
    from adjoint_compile.polyfills import loop_install
    import torch._dynamo.eval_frame as ef
    seen = []
    real = loop_install.wrap_top_frame
    try:
        def spy(ctx, target):
            got = real(ctx, target)
            if isinstance(target, Gate):
                seen.append(got)
            return got
        loop_install.wrap_top_frame = spy
        torch.compile(Gate(), backend="adjoint", options={"roll_loops": False})
        torch.compile(Gate(), backend="adjoint", options={"mode": "highway", "iterations": 2})
        torch.compile(Gate(), backend="inductor")
        torch.compile(Gate(), backend="adjoint")
    finally:
        loop_install.wrap_top_frame = real
    assert ef._TorchDynamoContext.__call__._adjoint_compile
    assert seen == [False, False, False, True], seen


@pytest.mark.slow
def test_each_callable_compiled_around_its_own_frame_keeps_its_own_graphs(tmp_path, monkeypatch):
    """Ten functions whose own loop rolls: each compiles (dynamo's limit of 8 graphs per code object would stop the
    ninth if their wrappers shared one code object) and each report lists its own graph only."""
    src = "".join(f"""
def f{k}(x):
    h = torch.zeros_like(x[:, 0])
    hs = []
    for t in range(x.shape[1]):
        h = {k + 1} / 10 * h + x[:, t]
        hs.append(h)
    return torch.stack(hs, 1)
""" for k in range(10))
    path = tmp_path / "ten_loops.py"  # NB: a file: the roller reads a loop's source
    path.write_text("import torch\n" + src)
    spec = importlib.util.spec_from_file_location("ten_loops", path)
    space = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ten_loops", space)  # NB: dynamo imports the module of a function it inlines
    spec.loader.exec_module(space)
    for k in range(10):
        T = 5 + k
        fn = getattr(space, f"f{k}")
        f = torch.compile(fn, backend="adjoint", options={"shard_size": 4, "inner": "eager"})
        x = torch.randn(2, T, 3)
        torch.testing.assert_close(f(x), fn(x), rtol=1e-10, atol=1e-10)
        got = [(r.source, r.length) for r in ac.report(f).regions]
        assert got == [("scan", T)], (k, got)


def test_report_skips_a_cache_entry_dynamo_invalidated():
    """Two classes from one factory share forward's code; once the first is collected, dynamo's entry for it has no
    code, and report() of the second must still work."""
    def make():
        class R(nn.Module):
            def __init__(self):
                super().__init__()
                self.la = nn.Linear(4, 4)

            def forward(self, x):
                return ac.ops.linear_scan(torch.sigmoid(self.la(x)), x)
        return R
    for k in range(2):
        f = torch.compile(make()(), backend="adjoint", options={"shard_size": 3, "inner": "eager"})
        f(torch.randn(2, 11, 4))
        if k == 0:
            del f
            gc.collect()
            continue
        # NB: the report of a module lists the graphs of its class's code, the first class's too while dynamo keeps it
        assert {(r.source, r.length) for r in ac.report(f).regions} == {("linear_scan", 11)}


class InPlace(nn.Module):
    """A step that updates its carry in place (``acc += ...``): every appended entry is then one tensor, the last."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.b(x)
        acc = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            acc += b[:, t]
            outs.append(acc)
        return torch.stack(outs, 1)


def test_an_in_place_update_in_the_step_keeps_the_loop_as_written():
    """Rolled, the step's ``+=`` failed inside torch's scan (a crash where eager runs); the loop now stays as written,
    with eager's values (every step's entry the final sum) and gradients."""
    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(2, 13, 6)
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"})
    got = f(x)
    want = model(x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(got[:, 0], want[:, -1], rtol=1e-12, atol=1e-12)   # aliasing as in eager
    g = torch.autograd.grad(got.square().sum(), model.b.weight)[0]
    w = torch.autograd.grad(want.square().sum(), model.b.weight)[0]
    assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    (r,) = loops.rolled()["InPlace.forward"]
    assert not r.rolled and "in-place update (acc += b[:, t])" in r.reason, r


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_declined_rolled_loop_serves_a_new_batch_size(dynamic):
    """A rolled loop too short to shard stays torch's scan; once dynamo makes the batch size symbolic (a smaller last
    batch, or dynamic=True) the scan holds that size as an operand, which dynamo refused when tracing the graph again
    (a crash where eager runs): that graph now runs eagerly, with a warning and listed by report(), exact."""
    torch.manual_seed(0)
    model = Gate()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"}, dynamic=dynamic)
    for b in (2, 3, 2):
        x = torch.randn(b, 16, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(x)
        want = model(x)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), b
        g = torch.autograd.grad(got.square().sum(), model.a.weight)[0]
        w = torch.autograd.grad(want.square().sum(), model.a.weight)[0]
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12), b
    # NB: not silent: the report lists the graph that runs eagerly, with its cause
    fell = ac.report(f).fallbacks
    assert any("could not be compiled again" in fb.cause and "eagerly" in fb.remedy for fb in fell), fell


def test_a_loop_inside_activation_checkpointing_runs_as_written():
    """A layer with a loop under ``torch.utils.checkpoint`` (non-reentrant): rolled there, checkpoint's dispatch mode
    had no rule for torch's scan (a crash where eager runs); loops inside another higher-order op's body are not
    rolled. Outputs and gradients as eager's."""
    import torch.utils.checkpoint as cp

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = Gate(), Gate()

        def forward(self, x):
            x = x + cp.checkpoint(self.l1, x, use_reentrant=False)
            return cp.checkpoint(self.l2, x, use_reentrant=False)
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 17, 6)
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(x)
    want = model(x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    w = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    for a, b in zip(g, w):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


class DetachInStep(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t].detach() * h + b[:, t]
            hs.append(h)
        return torch.stack(hs, 1)


def test_a_detach_in_the_step_keeps_the_loop_as_written():
    """Rolled, torch's scan gave the parameters reached only through the detached decay zero gradients where eager
    gives None (AdamW then decayed them); the loop stays as written, with eager's None."""
    torch.manual_seed(0)
    model = DetachInStep().double()
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"})
    f(x).square().sum().backward()
    assert model.a.weight.grad is None and model.a.bias.grad is None
    got = model.b.weight.grad.clone()
    model.b.weight.grad = None
    model(x).square().sum().backward()
    torch.testing.assert_close(got, model.b.weight.grad, rtol=1e-10, atol=1e-12)
    (r,) = loops.rolled()["DetachInStep.forward"]
    assert not r.rolled and "calls detach" in r.reason, r


def test_a_loop_that_is_not_re_rolled_says_so():
    """A loop reading the state two steps back is not re-rolled: its reason blamed the recurrence's source ("source
    'unrolled_loop' is not one yet") rather than saying the loop was not re-rolled and what to write instead."""
    class TwoBack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            a, b = torch.sigmoid(self.a(x)), self.b(x)
            hs = [torch.zeros_like(b[:, 0]), torch.zeros_like(b[:, 0])]
            for t in range(x.shape[1]):
                hs.append(a[:, t] * hs[-2] + b[:, t])
            return torch.stack(hs[2:], 1)

    torch._dynamo.reset()
    f = torch.compile(TwoBack(), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(torch.randn(2, 13, 4)).sum().backward()
    reasons = [r.reason for r in ac.report(f).regions if r.rewrite == "none"]
    assert any(r.startswith("the loop was not re-rolled into one linear_scan") and "ops.linear_scan" in r
               for r in reasons), reasons


@pytest.mark.parametrize("dynamic", [pytest.param(None, marks=pytest.mark.slow), True])
def test_a_loop_at_dynamos_recompile_limit_says_the_next_length_runs_uncompiled(dynamic):
    """A loop over range(T) recompiles at every new length; past dynamo's recompile_limit the model ran uncompiled
    (ordinary autograd, no memory saved) with dynamo's own log line only and nothing in the report. With
    ``dynamic=True`` (every graph symbolic, its loop rolled but its length still a guard) it still was."""
    from helpers import StepLoop
    torch._dynamo.reset()
    f = torch.compile(StepLoop(4), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"},
                      dynamic=dynamic)
    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for T in (9, 10, 11):
            f(torch.randn(2, T, 4)).sum().backward()
    said = [str(w.message) for w in got if "times, dynamo's recompile_limit" in str(w.message)]
    assert len(said) == 1 and "compiled 3 times" in said[0] and "ops.linear_scan" in said[0], said
    assert any("recompile_limit" in fb.cause for fb in ac.report(f).fallbacks)
    # NB: each new length's graph said this again (the loop recompiles the code at each length)
    per_length = [str(w.message) for w in got if "cannot serve every sequence length" in str(w.message)]
    assert len(per_length) == 1, per_length
    # NB: it does not promise the saving stays: the loop's recompiles reach the limit
    assert "stays up to dynamo's recompile_limit" in per_length[0], per_length


def test_static_shapes_at_dynamos_recompile_limit_say_the_next_length_runs_uncompiled():
    """With dynamic=False every new length recompiles, a linear_scan too; past the recompile_limit the saving went
    away silently (dynamo's log line only). The warning and the report's fallback say so, with the remedy; each call
    up to the limit is rewritten and exact."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    k, v = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 4).double()

    def loss(x):
        return ac.ops.linear_scan(torch.sigmoid(k(x)), v(x)).square().mean()

    f = torch.compile(loss, backend="adjoint", dynamic=False, options={"shard_size": 4, "inner": "aot_eager"})
    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for T in (9, 10, 11):
            x = torch.randn(2, T, 4, dtype=torch.float64)
            g = torch.autograd.grad(f(x), [k.weight, v.weight])
            torch.testing.assert_close(g, torch.autograd.grad(loss(x), [k.weight, v.weight]), rtol=1e-10, atol=1e-12)
    said = [str(w.message) for w in got if "times, dynamo's recompile_limit" in str(w.message)]
    assert len(said) == 1 and "compiled 3 times" in said[0] and "dynamic" in said[0], said
    assert any("recompile_limit" in fb.cause for fb in ac.report(f).fallbacks)
    assert sorted(r.length for r in ac.report(f).regions if r.rewrite == "adjoint") == [9, 10, 11]


@pytest.mark.parametrize("importable", [False, True])
def test_a_module_loaded_from_a_file_path_keeps_its_loop_unrolled(tmp_path, monkeypatch, importable):
    """A model file loaded with spec_from_file_location and not put in sys.modules (a config's path): dynamo guards a
    rolled loop's runtime through sys.modules[name], where the module is missing (or, with its folder importable,
    another copy of it is); dynamo raised. The loop stays as written (unrolled) and the report says why."""
    path = tmp_path / "model_from_path.py"
    path.write_text("import torch\n\n\ndef scan(a, b):\n    h = torch.zeros_like(b[:, 0])\n    hs = []\n"
                    "    for t in range(b.shape[1]):\n        h = a[:, t] * h + b[:, t]\n        hs.append(h)\n"
                    "    return torch.stack(hs, 1)\n")
    if importable:
        monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("model_from_path", path)
    space = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(space)
    a, b = torch.rand(2, 9, 3, requires_grad=True), torch.randn(2, 9, 3, requires_grad=True)
    with pytest.warns(ac.AdjointCompileWarning, match="not rolled: its module 'model_from_path' is not sys.modules'"):
        f = torch.compile(space.scan, backend="adjoint", options={"shard_size": 4, "inner": "eager"})
        got = torch.autograd.grad(f(a, b).square().sum(), (a, b))
    want = torch.autograd.grad(space.scan(a, b).square().sum(), (a, b))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert [(r.source, r.rewrite) for r in ac.report(f).regions] == [("unrolled_loop", "adjoint")], ac.report(f)


class _StridedGate(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(gate), self.b(x)
        h = torch.zeros_like(b[:, 0])
        hs = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return torch.stack(hs, 1)


@pytest.mark.parametrize("shard_size", [1, 4, 5])
def test_a_carry_of_strided_inputs_rolls_exact(shard_size):
    """A gate permuted from a [D, T, B] buffer: each step's carry takes its strides, not the initial state's; scan
    refused the loop (dynamo raised) until the carries were made contiguous."""
    torch.manual_seed(shard_size)
    model = _StridedGate()
    x, gate = torch.randn(2, 13, 6), torch.randn(6, 13, 2).permute(2, 1, 0).requires_grad_()
    f = torch.compile(model, backend="adjoint", options={"shard_size": shard_size, "inner": "eager"})
    out = f(x, gate)
    got = torch.autograd.grad(out.square().sum(), [gate, *model.parameters()])
    want = torch.autograd.grad(model(x, gate).square().sum(), [gate, *model.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert [r.source for r in ac.report(f).regions] == ["scan"], ac.report(f)


class _TanhLoop(nn.Module):
    """A tanh RNN: elementwise, ``tanh(a * h + x_t)``."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.w, self.a = nn.Linear(d, d), nn.Parameter(torch.rand(d))

    def forward(self, x):
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.tanh(self.a * h + x[:, t])
            hs.append(h)
        return torch.stack(hs, 1)


class _ElmanLoop(_TanhLoop):
    """Elman's: ``tanh(W h + x_t)``."""

    def forward(self, x):
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.tanh(self.w(h) + x[:, t])
            hs.append(h)
        return torch.stack(hs, 1)


@pytest.mark.parametrize("model", [_TanhLoop, _ElmanLoop])
def test_a_rolled_nonlinear_loop_names_its_nonlinearity(model):
    """The rolled step copies its carries (scan refuses aliased outputs): the reason named that copy ("passes
    through clone"), not the tanh."""
    rep = ac.explain(model(), torch.randn(2, 9, 4), options={"shard_size": 4})
    why = [j.reason for j in rep.rejections]
    assert any(w.startswith("not linear in the carry: it passes through tanh") for w in why), why
    assert not any("clone" in w for w in why), why
