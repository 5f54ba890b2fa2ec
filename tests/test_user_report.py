"""``adjoint_compile.report(compiled)``: the records a compile made travel with the compiled callable, and they are
the same records ``explain()`` shows and the lowering used."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import adjoint_compile as ac

ROOT = Path(__file__).resolve().parent.parent


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # NB: dynamo's graph-break continuations look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _rows(report):
    return [(r["kind"], r["source"], r["length"], r["rewrite"], r["group"], r["name"], r["reason"])
            for r in report.to_dict()["regions"]]


def test_report_of_a_compiled_model_equals_explain_and_names_the_lowered_calls():
    ssm = _example("selective_ssm")
    torch.manual_seed(0)
    model = ssm.SSMStack(d_model=8, d_state=3, n_layers=2)
    x = torch.randn(2, 24, 8)
    opts = {"inner": "eager", "shard_size": 5}
    f = torch.compile(model, backend="adjoint", options=opts)
    before = ac.report(f)
    assert before.compiled == [] and before.regions == []  # nothing compiled before the first call
    # the options given, not the defaults, and no claim about a model not yet seen
    assert before.options.shard_size == 5 and before.options.inner == "eager"
    assert "not been called yet" in str(before) and "no recurrence" not in str(before)
    f(x).sum().backward()
    got = ac.report(f)
    assert len(got.compiled) == 1 and got.options.shard_size == 5
    (cg,) = got.compiled
    lowered = [r for r in got.regions if r.rewrite == "adjoint"]
    assert lowered and {r.details["region_call"] for r in lowered} == set(cg.lowered)
    for call in cg.lowered:  # the calls the records name are in the graph that ran
        assert call in {n.name for n in cg.captured.gm.graph.nodes}
    want = ac.explain(model, x, options=opts)
    assert _rows(got) == _rows(want)
    # NB: the compile-time line differs by nature (report() has the compile and the first call, explain() passes only)
    assert [ln for ln in str(got).splitlines()[1:] if not ln.startswith("compile time:")] == \
        [ln for ln in str(want).splitlines()[1:] if not ln.startswith("compile time:")]


def test_report_follows_graph_breaks_and_new_sizes():
    ssm = _example("selective_ssm")

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = ssm.SSMStack(d_model=8, d_state=3, n_layers=1), ssm.SSMStack(d_model=8, d_state=3,
                                                                                          n_layers=1)

        def forward(self, x):
            y = self.a(x)
            torch._dynamo.graph_break()
            return self.b(y)

    torch.manual_seed(0)
    f = torch.compile(Broken(), backend="adjoint", options={"inner": "eager", "shard_size": 4}, dynamic=False)
    f(torch.randn(2, 12, 8))
    first = ac.report(f)
    assert len(first.compiled) == 2 and sum(len(c.lowered) for c in first.compiled) == 2
    f(torch.randn(2, 15, 8))  # a new length: two more graphs, listed after the first two
    later = ac.report(f)
    assert len(later.compiled) == 4 and later.compiled[:2] == first.compiled
    assert [r.length for r in later.regions if r.kind == "linear_recurrence"][-2:] == [15, 15]


def test_report_of_a_compiled_function():
    def fn(a, b):
        return ac.ops.linear_scan(a, b).sum(-1)

    f = torch.compile(fn, backend="adjoint", options={"inner": "eager"})
    f(torch.rand(2, 6, 3), torch.randn(2, 6, 3))
    (r,) = ac.report(f).regions
    assert (r.kind, r.source, r.length) == ("linear_recurrence", "linear_scan", 6)


def test_report_of_a_compiled_bound_method_lists_every_graph():
    """``torch.compile(model.loss)``: the graphs of later lengths too, not only the first call's."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 6)

        def loss(self, x):
            a, b = self.lin(x).chunk(2, -1)
            return ac.ops.linear_scan(torch.sigmoid(a), b).square().mean()

    m = Model()
    f = torch.compile(m.loss, backend="adjoint", options={"inner": "eager", "shard_size": 4})
    for T in (12, 15):
        f(torch.randn(2, T, 3))
    rep = ac.report(f)
    assert len(rep.graphs) >= 2 and 15 in [r.length for r in rep.regions], rep


def test_report_refuses_what_torch_compile_did_not_make():
    with pytest.raises(TypeError, match="torch.compile"):
        ac.report(torch.nn.Linear(2, 2))


def test_the_records_do_not_keep_the_first_calls_inputs_alive():
    """The records live as long as dynamo's cache entries; the first call's inputs must not live with them."""
    import gc
    import weakref

    ssm = _example("selective_ssm")
    torch.manual_seed(0)
    f = torch.compile(ssm.SSMStack(d_model=8, d_state=3, n_layers=1), backend="adjoint",
                      options={"inner": "eager", "shard_size": 4})
    x = torch.randn(2, 12, 8)
    f(x)
    assert ac.report(f).compiled[0].lowered
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None


def test_report_of_a_compiled_torch_nn_container():
    """dynamo compiles a wrapper function around torch.nn's own modules (Sequential), not their forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3))
    f = torch.compile(model, backend="adjoint", options={"inner": "eager"})
    f(torch.randn(2, 3))
    assert len(ac.report(f).compiled) == 1


@pytest.mark.parametrize("how", ["function", "module", "in_place"])
def test_report_before_the_first_call_states_the_options_given(how):
    opts = {"mode": "truncated", "window": 3, "inner": "aot_eager"}
    if how == "function":
        f = torch.compile(lambda x: x + 1, backend="adjoint", options=opts)
    elif how == "module":
        f = torch.compile(torch.nn.Linear(2, 2), backend="adjoint", options=opts)
    else:
        f = torch.nn.Linear(2, 2)
        f.compile(backend="adjoint", options=opts)
    head = str(ac.report(f)).splitlines()[0]
    assert head.endswith("mode=truncated window=3, inner=aot_eager"), head


class _Scan(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))


def test_two_instances_of_one_class_report_their_own_graphs():
    """Both instances' graphs hang off the class's forward code: each report listed both."""
    x = torch.randn(2, 40, 6)
    fa = torch.compile(_Scan(), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    fb = torch.compile(_Scan(), backend="adjoint", options={"shard_size": 8, "inner": "aot_eager"})
    fa(x).sum().backward()
    fb(x).sum().backward()
    for f, s in ((fa, 4), (fb, 8)):
        sizes = [r.details.get("shard_size") for r in ac.report(f).regions]
        assert sizes == [s], (s, str(ac.report(f)))


def test_an_instance_that_runs_another_instances_graph_reports_it():
    """With the same options the second instance's calls run the graph compiled for the first (one dynamo cache
    entry): its report said no graph had been compiled, though its region ran sharded. A third, never called,
    reports nothing."""
    torch._dynamo.reset()
    x = torch.randn(2, 40, 6)
    opts = {"shard_size": 4, "inner": "aot_eager"}
    fa, fb, fc = (torch.compile(_Scan(), backend="adjoint", options=opts) for _ in range(3))
    fa(x).sum().backward()
    fb(x).sum().backward()
    for f in (fa, fb):
        assert [r.rewrite for r in ac.report(f).regions] == ["adjoint"], str(ac.report(f))
    assert ac.report(fc).regions == [], str(ac.report(fc))


def test_a_deep_copy_of_a_compiled_model_trains_and_reports():
    """An EMA or teacher copy made after training started: copy.deepcopy raised "cannot pickle 'module' object"
    (the compile's notes held its frames' globals). The copy is a model of its own: its gradients are its own, exact,
    and its report lists the graph its calls ran."""
    import copy

    torch._dynamo.reset()
    x = torch.randn(2, 40, 6, dtype=torch.float64)
    f = torch.compile(_Scan().double(), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    f(x).sum().backward()
    g = copy.deepcopy(f)
    g._orig_mod.zero_grad()
    g(x).square().sum().backward()
    want = copy.deepcopy(g._orig_mod)
    want.zero_grad()
    want(x).square().sum().backward()
    for (n, p), q in zip(g._orig_mod.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=n)
        assert p is not dict(f._orig_mod.named_parameters())[n]
    assert [r.rewrite for r in ac.report(g).regions] == ["adjoint"], str(ac.report(g))


def test_report_after_explain_says_dynamos_caches_were_reset():
    """explain() resets dynamo's caches, which hold the compiled graphs: the report said "not called yet"."""
    torch.manual_seed(0)
    model, x = _Scan(), torch.randn(2, 16, 6)
    step = torch.compile(lambda x: model(x).square().mean(), backend="adjoint", options={"inner": "eager"})
    step(x).backward()
    assert ac.report(step).compiled
    ac.explain(lambda x: model(x).square().mean(), x)
    text = str(ac.report(step))
    assert "not been called yet" not in text
    assert "dynamo's caches were reset after the compiled model's calls" in text and "next call" in text
    step(x).backward()
    assert len(ac.report(step).compiled) == 1


def test_report_of_a_model_compiled_with_another_backend_says_so():
    f = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    f(torch.randn(3, 2))
    text = str(ac.report(f))
    assert "not been called yet" not in text
    assert "compiled with backend='eager', not backend='adjoint'" in text
    assert "backend='eager'" in ac.report(f).to_dict()["no_graph"]
    # torch.compile's default (not called here: inductor needs a C compiler)
    default = torch.compile(torch.nn.Linear(2, 2))
    assert "compiled with backend='inductor', not backend='adjoint'" in str(ac.report(default))


def test_two_compiles_of_the_same_code_with_other_options_report_their_own_graphs():
    """Compiling one loss (or one model) twice to compare modes: each report listed both compiles' graphs, and the
    second one's header said the first one's mode."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    k, v = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def loss(x):
        return ac.ops.linear_scan(torch.sigmoid(k(x)), v(x)).square().mean()

    model = _Scan()
    x = torch.randn(2, 16, 4)
    for target, inputs in ((loss, x), (model, torch.randn(2, 16, 6))):
        exact = torch.compile(target, backend="adjoint", options={"shard_size": 4, "inner": "eager"})
        truncated = torch.compile(target, backend="adjoint", options={"mode": "truncated", "window": 2,
                                                                     "shard_size": 4, "inner": "eager"})
        exact(inputs).sum().backward()
        truncated(inputs).sum().backward()
        for f, rewrite, mode in ((exact, "adjoint", "exact"), (truncated, "truncated", "truncated")):
            rep = ac.report(f)
            assert [r.rewrite for r in rep.regions] == [rewrite] and rep.options.mode == mode, str(rep)
