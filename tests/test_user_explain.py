import json

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.explain import GROUP_LEGEND
from helpers import StepLoop


def test_explain_on_graph_with_nothing_to_rewrite():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    report = ac.explain(model, torch.randn(3, 4))
    assert isinstance(report, ac.Report)
    assert report.regions == []
    assert len(report.graphs) == 1 and report.graph_breaks == []
    text = str(report)
    assert "1 graph(s), 0 graph break(s)" in text and "no recurrence" in text and "group:" not in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["regions"] == [] and d["options"]["mode"] == "exact" and d["graphs"][0]["nodes"] > 3


def test_explain_reports_graph_breaks():
    def f(x):
        y = x.sin()
        print("side effect")  # dynamo breaks the graph at print
        return y.cos()

    report = ac.explain(f, torch.randn(5), options={"mode": "truncated", "window": 3})
    assert len(report.graph_breaks) == 1
    assert len(report.graphs) == 2
    assert "print" in report.graph_breaks[0].reason.lower() or "builtin" in report.graph_breaks[0].reason.lower()
    assert "test_user_explain.py" in report.graph_breaks[0].location
    assert "mode=truncated window=3" in str(report)
    assert report.to_dict()["graph_breaks"][0]["reason"]


def test_explain_shows_expected_memory_of_a_sharded_region():
    class TinySSM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x):
            a, b = self.lin(x).chunk(2, -1)
            return ac.ops.linear_scan(torch.sigmoid(a), b) * 2

    x = torch.randn(2, 64, 8)
    report = ac.explain(TinySSM(), x, options={"shard_size": 8})
    (r,) = report.regions
    assert r.rewrite == "adjoint", r.reason
    mem = r.details["expected_memory_bytes"]
    state_step = 2 * 8 * 4  # one step of the [2, 64, 8] fp32 state
    assert mem["sharded"] == (64 // 8 - 1) * state_step + mem["autograd"] * 8 // 64
    # at least sigmoid(a), h and the output, full length (the chunks a, b are views: they allocate nothing)
    assert mem["autograd"] >= 3 * 2 * 64 * 8 * 4
    assert "activations <=" in r.reason and "->" in r.reason
    assert json.loads(report.to_json())["regions"][0]["details"]["expected_memory_bytes"] == mem


def test_the_table_says_what_its_group_column_means():
    def f(a, b):
        return ac.ops.linear_scan(torch.sigmoid(a), b)

    lines = str(ac.explain(f, torch.randn(2, 8, 3), torch.randn(2, 8, 3))).splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "graph"])
    assert lines[header + 2] == GROUP_LEGEND
    assert lines[header + 2].startswith("  group: lowered regions with the same number run in one sharded call")


def _rows(rep):
    return [(r.kind, r.source, r.length, r.rewrite, r.name) for r in rep.regions]


@pytest.mark.parametrize("roll_loops", [True, False])
def test_explain_traces_a_loop_in_the_models_own_forward_as_torch_compile_does(roll_loops):
    """torch.compile(model, backend="adjoint") rolls the loop of the model's own forward (a frame around it); explain
    unrolled it (other rows, names, memory). And explain rolled loops under roll_loops=False."""
    torch.manual_seed(0)
    model, x = StepLoop(8), torch.randn(2, 12, 8)
    opts = {"inner": "eager", "shard_size": 4, "roll_loops": roll_loops}
    for target in (model, lambda x: model(x)):
        seen = ac.explain(target, x, options=opts)
        torch._dynamo.reset()
        f = torch.compile(target, backend="adjoint", options=opts)
        f(x).sum().backward()
        assert _rows(seen) == _rows(ac.report(f)), (str(seen), str(ac.report(f)))
        assert [r.source for r in seen.regions] == ["scan" if roll_loops else "unrolled_loop"]
        torch._dynamo.reset()


class _TokenLM(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 4):
        super().__init__()
        self.emb, self.a, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        a, h, out = torch.sigmoid(self.a(x)), torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out.append(h)
        return self.head(torch.stack(out, 1))


_LM = {}


def test_verify_of_a_function_over_tokens_compares_the_models_gradients(caplog):
    """With only integer inputs and a function (not a module), verify compared no tensor and printed a perfect
    "relative error 0, cosine 1"."""
    torch.manual_seed(0)
    lm, tokens = _TokenLM().double(), torch.randint(0, 11, (2, 9))
    opts = {"verify": True, "shard_size": 4, "inner": "eager"}
    rep = ac.explain(lambda t: lm(t).logsumexp(-1).mean(), tokens, options=opts)
    f = rep.fidelity
    assert f["tensors"] == 5 and not f["missing"] and f["worst"].startswith("lm."), f
    assert f["grad_rel_err"] < 1e-10 and "nothing compared" not in str(rep)
    # a model the function reaches by a lookup explain() cannot follow: said, not a perfect score
    _LM["lm"] = lm
    with caplog.at_level("WARNING", logger="adjoint_compile.explain"):
        rep = ac.explain(lambda t: _LM["lm"](t).logsumexp(-1).mean(), tokens, options=opts)
    assert rep.fidelity["tensors"] == 0 and "fidelity: nothing compared: no input is a floating-point" in str(rep)
    assert "relative error 0, cosine 1" not in str(rep)
    assert any("nothing compared" in r.getMessage() for r in caplog.records)


class _NormedScan(nn.Module):
    """A BatchNorm (its running statistics and count are buffers written in the forward) and a counter buffer
    before a scan; dropout after it when ``p``."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.bn, self.a, self.b, self.drop = nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Dropout(p)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        self.steps = self.steps + 1  # NB: replaced, not written into
        u = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return self.drop(ac.ops.linear_scan(torch.sigmoid(self.a(u)), self.b(u))).square().sum()


@pytest.mark.parametrize("verify", [False, True])
def test_explain_leaves_the_models_buffers_and_the_random_generator_as_they_were(verify):
    """explain() runs the model (verify: three more times), which advanced BatchNorm's statistics and the counter,
    and drew from the generator: a run that explained first trained differently from one that did not."""
    torch.manual_seed(0)
    m, x = _NormedScan(0.2).double(), torch.randn(2, 16, 4, dtype=torch.float64)
    before = {n: b.clone() for n, b in m.named_buffers()}
    torch.manual_seed(1)
    ac.explain(m, x, options={"shard_size": 4, "inner": "eager", "verify": verify})
    drawn = torch.rand(3)
    for n, b in m.named_buffers():
        torch.testing.assert_close(b, before[n], rtol=0, atol=0, msg=n)
    torch.manual_seed(1)
    torch.testing.assert_close(drawn, torch.rand(3), rtol=0, atol=0)
    m(x)  # NB: the model still trains: its buffers move on
    assert int(m.calls) == 1 and int(m.steps) == 1 and int(m.bn.num_batches_tracked) == 1


def test_verify_does_not_compare_a_graph_that_draws_random_numbers(recwarn):
    """Dropout's masks differ between the rewrite and plain autograd: the whole-graph comparison reported a large
    "gradient relative error" for a correct rewrite. It is now skipped and says why; the region's own check, which
    replays its masks, still runs."""
    torch.manual_seed(0)
    m, x = _NormedScan(0.3).double(), torch.randn(2, 16, 4, dtype=torch.float64)
    f = torch.compile(m, backend="adjoint", options={"verify": True, "shard_size": 4, "inner": "aot_eager"})
    f(x).backward()
    said = [str(w.message) for w in recwarn if isinstance(w.message, ac.AdjointVerifyReport)]
    assert any("whole graph not compared with plain autograd: it draws random numbers" in s for s in said), said
    assert not any("whole graph (" in s for s in said), said
    region = [s for s in said if "adjoint_region_0" in s]
    assert region and "max relative error" in region[0], said
    assert float(region[0].split("max relative error ")[1].split()[0]) < 1e-10, region
    rep = ac.report(f)
    assert "skipped" in rep.fidelity and "fidelity: not compared: it draws random numbers" in str(rep)
    rep = ac.explain(m, x, options={"verify": True, "shard_size": 4, "inner": "aot_eager"})
    assert "skipped" in rep.fidelity and "fidelity: not compared" in str(rep)
