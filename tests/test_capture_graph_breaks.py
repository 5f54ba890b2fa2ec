"""Graph breaks that cut a model into many small graphs: ``report()`` counts every graph of the compiled model, on
whatever code object dynamo keeps it (a nested function that breaks, its resume functions), and the backend says
so in one warning that names the break, not one warning per small graph. Rejection reasons grouped by cause keep
their words: only node names that differ between the group's members are masked. A break inside the loop of the
compiled callable's own forward makes dynamo run it eagerly, without any graph: that is warned and reported too."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import adjoint_compile as ac
from adjoint_compile.explain import Report
from adjoint_compile.options import validate
from adjoint_compile.regions import FIRST_OF_GROUP, Rejection, group_rejections, rejection_lines

LOGGER = "adjoint_compile.backend"


def _slstm_pointwise(wx, ry, b, states):
    """One step of an sLSTM cell (xLSTM's pure-torch backend, in short), with its data-dependent branch."""
    raw = wx + ry + b
    y, c, n, m = torch.unbind(states, dim=0)
    iraw, fraw, zraw, oraw = torch.unbind(raw.view(raw.shape[0], 4, -1), dim=1)
    logfplusm = m + torch.nn.functional.logsigmoid(fraw)
    # the break: dynamo cannot trace a branch on a tensor's value
    if torch.all(n == 0.0):
        mnew = iraw
    else:
        mnew = torch.max(iraw, logfplusm)
    igate = torch.exp(iraw - mnew)
    fgate = torch.exp(logfplusm - mnew)
    cnew = fgate * c + igate * torch.tanh(zraw)
    nnew = fgate * n + igate
    ynew = torch.sigmoid(oraw) * cnew / nnew
    return torch.stack((ynew, cnew, nnew, mnew), dim=0)


class SLSTM(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.d = d
        self.W = torch.nn.Linear(d, 4 * d)
        self.R = torch.nn.Parameter(torch.randn(d, 4 * d) / d)
        self.b = torch.nn.Parameter(torch.zeros(4 * d))

    def forward(self, x):
        wx = self.W(x)
        states = x.new_zeros(4, x.shape[0], self.d)
        out = []
        # NB: a break inside the loop: dynamo skips this frame and compiles the step function's own frame
        for t in range(x.shape[1]):
            states = _slstm_pointwise(wx[:, t], states[0] @ self.R, self.b, states)
            out.append(states[0])
        return torch.stack(out, 1)


def _branch_line() -> int:
    import inspect

    lines, first = inspect.getsourcelines(_slstm_pointwise)
    return first + next(i for i, ln in enumerate(lines) if "if torch.all(n == 0.0)" in ln)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_report_counts_the_graphs_a_break_in_a_nested_function_makes():
    torch.manual_seed(0)
    model, x = SLSTM(), torch.randn(2, 6, 8)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager"})
    f(x).sum().backward()
    rep = ac.report(f)
    # the step function before the branch and its resume function after it, for both branches: none of them is on
    # the model's forward (which dynamo skipped), all are this compile's
    assert len(rep.compiled) >= 2 and len(rep.graphs) == len(rep.compiled)
    assert str(rep).startswith(f"adjoint-compile report: {len(rep.compiled)} graph(s), ")
    assert rep.graph_breaks and all(b.reason.startswith("data-dependent branching") for b in rep.graph_breaks)
    where = f"test_capture_graph_breaks.py:{_branch_line()} in _slstm_pointwise"
    assert all(b.location.endswith(where) and b.code == "if torch.all(n == 0.0):" for b in rep.graph_breaks)
    text = str(rep)
    assert f"graph breaks:\n  1. data-dependent branching" in text and "`if torch.all(n == 0.0):`" in text
    assert f"{len(rep.compiled)} graphs of <= " in text and "nothing recognized, split by these breaks" in text
    assert len(text.splitlines()) < 12  # the same break at every step is one line
    # explain() sees the same graphs
    assert len(ac.explain(model, x).graphs) == len(rep.compiled)


def test_the_small_graphs_a_break_splits_off_are_one_warning_that_names_the_break(caplog):
    torch.manual_seed(0)
    f = torch.compile(SLSTM(), backend="adjoint", options={"inner": "eager"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            f(torch.randn(2, 6, 8)).sum().backward()
    graphs = len(ac.report(f).compiled)
    assert graphs >= 2
    (msg,) = _warnings(caplog)  # NB: one, not one per graph
    assert f"test_capture_graph_breaks.py:{_branch_line()} in _slstm_pointwise (`if torch.all(n == 0.0):`)" in msg
    assert "data-dependent branching" in msg and "torch.where" in msg
    assert "a recurrence split by a break cannot be rewritten" in msg.lower()
    assert "adjoint_compile.report(compiled)" in msg


def test_each_compile_warns_once_and_reports_only_its_own_graphs(caplog):
    """Two compiled models share the step function's code: each compile warns once and counts its graphs."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        f = torch.compile(SLSTM(), backend="adjoint", options={"inner": "eager"})
        f(torch.randn(2, 5, 8))
        g = torch.compile(SLSTM(), backend="adjoint", options={"inner": "eager", "shard_size": 4})
        g(torch.randn(2, 5, 8))
    assert len(_warnings(caplog)) == 2
    ours, theirs = ac.report(f).compiled, ac.report(g).compiled
    assert ours and theirs and not {c.seq for c in ours} & {c.seq for c in theirs}
    assert {c.options.shard_size for c in theirs} == {4}


def test_a_graph_without_breaks_still_warns_on_its_own(caplog):
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        torch.compile(mlp, backend="adjoint", options={"inner": "eager"})(torch.randn(2, 4))
    (msg,) = _warnings(caplog)
    assert msg.startswith("adjoint-compile: nothing recognized in a graph of") and "graph break" not in msg


# --- rejection reasons: only node references are masked -------------------------------------------------------


def _words_as_names() -> fx.GraphModule:
    def f(a, skip, the):
        x = a + skip * the
        return x + x * the

    return fx.symbolic_trace(f)  # nodes: a, skip, the, mul, add, mul_1, add_1, output


def _skip_rejections() -> list[Rejection]:
    why = "block node {} of the residual layer at {} is also used by {} outside the layer (a skip across layers)"
    return [Rejection("residual_chain", "add", why.format("mul", "add", "a")),
            Rejection("residual_chain", "add_1", why.format("mul_1", "add_1", "skip")),
            Rejection("recurrence", "the", "the carry the passes through a skip: not linear")]


def test_words_that_are_also_node_names_are_not_masked():
    gm = _words_as_names()
    assert {"a", "skip", "the"} <= {n.name for n in gm.graph.nodes}
    groups = group_rejections(_skip_rejections(), (n.name for n in gm.graph.nodes))
    assert groups[0] == ("residual_chain",
                         "block node mul of the residual layer at add is also used by a outside the layer "
                         "(a skip across layers)" + FIRST_OF_GROUP, ["add", "add_1"])
    # a group of one: its reason as written, node names included
    assert groups[1] == ("recurrence", "the carry the passes through a skip: not linear", ["the"])
    lines = rejection_lines(groups)
    assert lines[0].startswith("residual_chain x2 (at add, add_1): ") and "(a skip across layers)" in lines[0]
    assert lines[1] == "recurrence at the: the carry the passes through a skip: not linear"


def test_a_node_every_member_names_is_shown_by_name():
    """The members differ in their anchors only: the node they all mention keeps its name."""
    rej = [Rejection("residual_chain", f"add_{i}", f"layer at add_{i} also feeds skip outside the layer")
           for i in (1, 2, 3)]
    ((_, why, nodes),) = group_rejections(rej, ["skip", "add_1", "add_2", "add_3"])
    assert why == "layer at add_1 also feeds skip outside the layer" + FIRST_OF_GROUP
    assert nodes == ["add_1", "add_2", "add_3"]
    # one reason met at several nodes, word for word: as written, not marked as the first
    rej = [Rejection("recurrence", f"h_{i}", "not linear in the carry") for i in (1, 2)]
    assert group_rejections(rej, ["h_1", "h_2"]) == [("recurrence", "not linear in the carry", ["h_1", "h_2"])]


def test_the_report_text_keeps_the_words():
    gm = _words_as_names()
    rep = Report([], _skip_rejections(), [gm], [], validate(None))
    text = str(rep)
    assert "(a skip across layers)" in text and "<node>" not in text
    assert "of the residual layer at add is also used by a outside" in text and FIRST_OF_GROUP in text
    assert "recurrence at the: the carry the passes through a skip: not linear" in text


# --- a break inside the loop of the compiled callable's own forward: dynamo runs the whole frame eagerly ----------


class _BranchInLoop(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            if h.sum() > 0:  # the break
                h = h * 1.0
            out.append(h)
        return torch.stack(out, 1)


class _ItemInLoop(_BranchInLoop):
    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            scale = float(h.detach().abs().max())  # the break
            out.append(h / scale)
        return torch.stack(out, 1)


def _line_of(cls, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, ln in enumerate(lines) if text in ln)


@pytest.mark.parametrize("cls, marker, why", [(_BranchInLoop, "if h.sum() > 0:", "data-dependent branching"),
                                              (_ItemInLoop, "scale = float(", "a tensor read as a python number")])
def test_a_break_in_the_loop_of_the_compiled_forward_is_warned_and_reported(cls, marker, why):
    """dynamo skips the whole forward (it does not resume inside a loop) and runs it eagerly; it compiled nothing, so
    report() said "not called yet", and nothing warned."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 5, 8)
    line = _line_of(cls, marker)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f(x).sum().backward()
    ours = [w for w in said if issubclass(w.category, ac.AdjointCompileWarning)]
    assert len(ours) == 1, [str(w.message) for w in said]
    msg = str(ours[0].message)
    # NB: the warning points at the user's line, and names it and the function that ran eagerly
    assert (Path(ours[0].filename).name, ours[0].lineno) == ("test_capture_graph_breaks.py", line)
    assert f"test_capture_graph_breaks.py:{line} in forward (`{marker}" in msg and why in msg.lower()
    assert f"{cls.__qualname__}.forward (" in msg and "runs eagerly" in msg and "inside a loop" in msg
    rep = ac.report(f)
    (brk,) = rep.graph_breaks
    assert brk.location.endswith(f"test_capture_graph_breaks.py:{line} in forward") and brk.code.startswith(marker)
    assert brk.frame.startswith(f"{cls.__qualname__}.forward (") and brk.reason.lower().startswith(why)
    text = str(rep)
    assert text.startswith("adjoint-compile report: 0 graph(s), 1 graph break(s)")
    assert "not been called yet" not in text and f"dynamo ran {cls.__qualname__}.forward" in text
    # explain() lists the same break (torch._dynamo.explain lists none)
    (seen,) = ac.explain(model, x).graph_breaks
    assert (seen.location, seen.code, seen.frame) == (brk.location, brk.code, brk.frame)


def test_a_skipped_forward_under_a_compiled_function_is_reported_at_its_line():
    torch.manual_seed(0)
    model = _BranchInLoop()
    f = torch.compile(lambda x: model(x).square().mean(), backend="adjoint", options={"inner": "eager"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f(torch.randn(2, 5, 8)).backward()
    line = _line_of(_BranchInLoop, "if h.sum() > 0:")
    assert any(issubclass(w.category, ac.AdjointCompileWarning) and w.lineno == line for w in said)
    rep = ac.report(f)
    where = f"test_capture_graph_breaks.py:{line} in forward"
    assert [Path(b.location).name for b in rep.graph_breaks] == [where]
    assert str(rep).startswith("adjoint-compile report: 1 graph(s), 1 graph break(s)")


def test_a_skipped_frame_of_another_backend_is_not_warned_about():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.compile(_BranchInLoop(), backend="eager")(torch.randn(2, 5, 8))
    assert not [w for w in said if issubclass(w.category, ac.AdjointCompileWarning)]


class _CumulativeNorm(torch.nn.Module):
    """A BatchNorm with ``momentum=None`` (a cumulative average): it reads its batch count with ``float()``."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.norm, self.a = torch.nn.BatchNorm1d(d, momentum=None), torch.nn.Linear(d, d)

    def forward(self, x):
        u = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return ac.ops.linear_scan(torch.sigmoid(self.a(u)), u).square().sum()


def test_a_cumulative_batch_norm_break_names_its_own_remedy(caplog):
    """The break in BatchNorm(momentum=None) was answered with ``capture_scalar_outputs = True``, which only moves
    the break (dynamo then cannot guard the division), and the report's summary with "a data-dependent `if`"."""
    torch.manual_seed(0)
    m, x = _CumulativeNorm().double(), torch.randn(2, 9, 4, dtype=torch.float64)
    rep = ac.explain(m, x, options={"inner": "eager"})
    assert rep.graph_breaks and "num_batches_tracked" in rep.graph_breaks[0].code, rep.graph_breaks
    remedy = rep.graph_breaks[0].remedy()
    assert "momentum=None" in remedy and "give it a momentum" in remedy and "capture_scalar" not in remedy, remedy
    assert "data-dependent" not in str(rep), str(rep)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        torch.compile(m, backend="adjoint", options={"inner": "eager"})(x)
    said = " ".join(_warnings(caplog))
    assert "give it a momentum" in said and "capture_scalar" not in said, said


def test_a_graph_no_gradient_flows_through_is_not_warned_about(caplog):
    """Validation under ``no_grad`` (and generation) compiles graphs of its own; "saves no memory, write the
    recurrence with linear_scan" is noise there: no backward runs. The training graph still warns."""
    from helpers import StepLoop
    torch._dynamo.reset()
    m = StepLoop(4)
    f = torch.compile(m, backend="adjoint", options={"inner": "eager"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        m.eval()
        with torch.no_grad():
            f(torch.randn(2, 9, 4))
    assert not _warnings(caplog), _warnings(caplog)
    m.train()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        f(torch.randn(2, 9, 4)).sum().backward()
    assert any("kept ordinary autograd" in w for w in _warnings(caplog)), _warnings(caplog)
