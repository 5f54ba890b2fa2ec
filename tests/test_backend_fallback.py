"""With nothing to rewrite, backend="adjoint" must train exactly as its inner compiler alone."""
import pytest
import torch
import torch.nn as nn

import adjoint_compile  # noqa: F401  (registers nothing we rely on: the entry point does; see test_entry_point)

INNERS = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))

    def forward(self, x):
        return self.net(x).log_softmax(-1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 3 * 3, 7)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.relu(self.c2(x))
        return self.fc(x.flatten(1))


class WithGraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum().item() > 0:  # data-dependent branch: dynamo breaks the graph here
            h = h * 2
        return self.b(h)


CASES = {
    "mlp": (MLP, lambda: torch.randn(9, 12)),
    "convnet": (ConvNet, lambda: torch.randn(2, 3, 7, 7)),
    "graph_break": (WithGraphBreak, lambda: torch.randn(4, 6)),
}


def _train_steps(model, x, steps=2):
    """A couple of SGD steps; returns the outputs and gradients of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        y = model(x)
        y.float().pow(2).mean().backward()
        outs.append(y.detach().clone())
        grads.append({n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return outs, grads


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("case", list(CASES))
def test_same_outputs_and_grads_as_inner_compiler_alone(case, inner):
    make, data = CASES[case]
    torch.manual_seed(0)
    base = make()
    x = data()
    ours = make()
    ours.load_state_dict(base.state_dict())
    ref_backend = {"eager": "eager", "aot_eager": "aot_eager", "inductor": "inductor"}[inner]
    ref = torch.compile(base, backend=ref_backend)
    got = torch.compile(ours, backend="adjoint", options={"inner": inner})
    ref_outs, ref_grads = _train_steps(ref, x)
    outs, grads = _train_steps(got, x)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for ga, gb in zip(grads, ref_grads):
        assert ga.keys() == gb.keys()
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_plain_eager_numerically(case):
    """Also against no compiler at all (loose tolerance: inductor may reorder float math)."""
    make, data = CASES[case]
    torch.manual_seed(0)
    m = make()
    x = data()
    ref_outs, ref_grads = _train_steps(m, x)
    torch.manual_seed(0)
    m2 = make()
    got = torch.compile(m2, backend="adjoint")
    outs, grads = _train_steps(got, x)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for ga, gb in zip(grads, ref_grads):
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-5)


def test_graph_break_gives_two_graphs_through_the_pipeline():
    m = WithGraphBreak()
    f = torch.compile(m, backend="adjoint", options={"inner": "eager"})
    f(torch.ones(2, 6))
    assert len(adjoint_compile.report(f).compiled) >= 2


def test_a_retrace_inductor_asks_for_reaches_dynamo(monkeypatch):
    """Inductor asks dynamo to trace the frame again (``TensorifyScalarRestartAnalysis``: a Python float made a
    tensor). Under dynamo's compile the request goes through and the retraced graph keeps inductor; outside it (a
    program compiled at its first use) the graph runs with aot_eager, with a warning naming the cause."""
    import warnings

    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._inductor import compile_fx as cfx

    from adjoint_compile import inner
    from adjoint_compile.errors import AdjointCompileWarning

    calls = []

    def compile_fx(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        if len(calls) == 1:
            raise TensorifyScalarRestartAnalysis
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    monkeypatch.setattr(inner, "_warned", set())
    torch._dynamo.reset()
    model, x = MLP(), torch.randn(4, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="adjoint")(x)
    assert len(calls) == 2, calls
    assert not [w for w in caught if "could not compile" in str(w.message)], [str(w.message) for w in caught]
    torch.testing.assert_close(out, model(x))
    calls.clear()

    class Tupled(nn.Module):  # NB: aot_eager takes graphs with tuple outputs, as dynamo's are
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return (self.m(x),)

    with pytest.warns(AdjointCompileWarning, match="TensorifyScalarRestartAnalysis"):
        fn = inner.inductor_or_aot_eager(torch.fx.symbolic_trace(Tupled()), [x])
    torch.testing.assert_close(fn(x)[0], model(x))
