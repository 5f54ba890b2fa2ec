"""Compile-time profile (adjoint_compile/timing.py) and the matchers' pre-filter (passes/match/prefilter.py).

* every stage of the pipeline, and the inner compiles at run time (partitions, shard programs and their VJPs), are
  on the graph's record (``CompiledGraph.timing``) with non-negative seconds; ``report()`` / ``explain()`` show them
  in one "compile time:" line and the backend logs them at INFO;
* the pre-filter skips the matchers of a graph with nothing for them, and agrees with the full matchers on every
  example and the tests' models: a matcher it would skip finds nothing there.
"""
from __future__ import annotations

import logging
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
import adjoint_compile.passes.capture as capture_mod
import adjoint_compile.passes.recognize as recognize_mod
from adjoint_compile import timing
from adjoint_compile.backend import run_pipeline
from adjoint_compile.options import validate
from adjoint_compile.passes.match import prefilter
from adjoint_compile.passes.match.find_cells import find_cells
from adjoint_compile.passes.match.find_recurrences import find_recurrences
from adjoint_compile.passes.match.find_residuals import find_residuals
from adjoint_compile.passes.capture.scan_forms import match_scan_forms
from adjoint_compile.passes.match.unrolled import find_unrolled
from adjoint_compile.runtime.verify import copy_graph_module
from helpers import trace

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ("copy", "capture", "recognize", "decide", "lower", "stitch")


class _SSM(nn.Module):
    """One linear_scan between time-local ops: lowered and sharded (shards of 4 steps)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ac.ops.linear_scan(torch.sigmoid(self.gate(x)), self.inp(x))
        return self.out(h).square().mean()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 1))


def _sharded_step():
    torch.manual_seed(0)
    f = torch.compile(_SSM(), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    return f, f(torch.randn(2, 16, 4))


def test_every_stage_and_the_run_time_compiles_are_on_the_record():
    before = dict(timing.TOTALS)
    f, loss = _sharded_step()
    t = ac.report(f).compiled[0].timing
    assert not [k for k in ("inner.shard_vjps_n", "inner.vjp_traces_n") if k in t]  # NB: no backward yet
    loss.backward()
    t = ac.report(f).compiled[0].timing
    for stage in PIPELINE + ("pipeline",):
        assert t.get(f"{stage}_s", -1.0) >= 0.0, (stage, t)
    # NB: each normalization pass and each matcher, nested under its stage
    for sub in ("capture.prefilter", "capture.known_scans", "capture.noop_ops", "capture.match",
                "capture.match.find_recurrences", "capture.match.find_unrolled", "recognize.prefilter",
                "recognize.find_residuals", "recognize.time_local"):
        assert f"{sub}_s" in t, (sub, sorted(t))
    assert all(v >= 0.0 for v in t.values()), t
    # NB: compiled at run time: the partitions and shard programs at the first forward, the VJPs at the backward
    for kind in ("partitions", "shard_programs", "shard_vjps", "vjp_traces"):
        assert t.get(f"inner.{kind}_n", 0) >= 1 and t[f"inner.{kind}_s"] > 0.0, (kind, t)
        assert timing.TOTALS[f"inner.{kind}_n"] - before.get(f"inner.{kind}_n", 0) == t[f"inner.{kind}_n"]
    assert t["pipeline_s"] >= sum(t[f"{s}_s"] for s in PIPELINE) * 0.999
    assert t["first_call_s"] >= t["inner.partitions_s"] + t["inner.shard_programs_s"]
    # NB: a later step compiles nothing and adds nothing
    n = {k: v for k, v in t.items() if k.endswith("_n")}
    f(torch.randn(2, 16, 4)).backward()
    assert {k: v for k, v in t.items() if k.endswith("_n")} == n


def test_a_graph_with_nothing_rewritten_counts_its_whole_graph_compile():
    f = torch.compile(_mlp(), backend="adjoint", options={"inner": "aot_eager"})
    f(torch.randn(3, 8)).sum().backward()
    t = ac.report(f).compiled[0].timing
    assert t["inner.whole_graph_n"] == 1 and t["inner.whole_graph_s"] > 0.0
    assert "lower_s" not in t and not any(k.startswith("inner.shard") for k in t)


def test_the_report_and_the_log_show_the_compile_time(caplog):
    with caplog.at_level(logging.INFO, logger="adjoint_compile.backend"):
        f, loss = _sharded_step()
        loss.backward()
    logged = [r.getMessage() for r in caplog.records if "compile time" in r.getMessage()]
    assert logged and "capture" in logged[0] and "recognize" in logged[0], logged
    text = str(ac.report(f))
    line = next(ln for ln in text.splitlines() if ln.startswith("compile time: "))
    for word in ("passes", "capture", "recognize", "decide", "lower", "stitch", "inner compiles", "partitions",
                 "shard programs", "shard VJPs"):
        assert word in line, (word, line)
    assert ac.report(f).to_dict()["graphs"][0]["timing"]["capture_s"] >= 0.0
    rep = ac.explain(_SSM(), torch.randn(2, 16, 4), options={"shard_size": 4})
    line = next(ln for ln in str(rep).splitlines() if ln.startswith("compile time: "))
    assert "capture" in line and "lower" in line and "inner compiles" not in line  # NB: explain compiles nothing


def test_stages_outside_a_recording_record_nothing():
    with timing.stage("capture"):
        pass
    assert timing.current() is None
    with timing.recording() as t:
        with timing.stage("capture"), timing.stage("reroll"):
            pass
    assert set(t) == {"capture_s", "capture.reroll_s", "pipeline_s"} and min(t.values()) >= 0.0
    assert timing.summary([t]).startswith("passes ")


# ----------------------------------------------------------------------------------------------------------------
# the pre-filter


def test_the_matchers_do_not_run_on_a_graph_without_candidates(monkeypatch):
    """An MLP has no scan, slice, recurrent cell or sum: no matcher runs on it (each would raise here)."""
    def boom(gm):
        raise AssertionError("a matcher ran")

    for mod, name in [(capture_mod, "find_recurrences"), (capture_mod, "find_unrolled"), (capture_mod, "find_cells"),
                      (capture_mod, "rewrite_scan_forms"), (recognize_mod, "find_recurrences"),
                      (recognize_mod, "find_unrolled"), (recognize_mod, "find_cells"), (recognize_mod, "find_residuals")]:
        monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(prefilter, "CHECK", False)
    res = run_pipeline(trace(_mlp(), torch.randn(3, 8)), [], validate(None), compile=False)
    assert res.regions == [] and res.rejections == [], res.rejections
    # NB: with a candidate (a sum: the residual matcher's), that matcher runs, and here raises: a rejection says so
    res = run_pipeline(trace(lambda x: torch.tanh(x) + x, torch.randn(3, 8)), [], validate(None), compile=False)
    assert any("a matcher ran" in j.reason for j in res.rejections), res.rejections


def _examples() -> dict:
    out = {}
    for name in ("selective_ssm", "mamba_conv", "gru_scan", "pre_ln_transformer", "post_ln_transformer",
                 "relu_resnet"):
        mod = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
        out[f"example:{name}"] = (lambda mod=mod: (mod["make"](), tuple(mod["example_inputs"]())))
    return out


def _test_models() -> dict:
    import test_lower_highway_rnn as rnn
    import test_recognize_known_scans as known
    import test_capture_loop_forms as loops
    import test_recognize_regions as rec
    import test_recognize_unrolled as unrolled
    import test_recognize_scan_forms as forms
    import test_lower_shift_readout as shifts
    import test_capture_token_shift as token
    import test_recognize_tree_scans as trees

    out = {f"loop_forms:{k}": (lambda fn=fn, make=make: (fn, tuple(make(6).values())))
           for k, (fn, make) in loops.CASES.items()}
    D = loops.D
    out["loop_forms:gru_cell"] = lambda: (loops.GRULoop(), (torch.randn(2, 5, D), torch.randn(2, D)))
    out["loop_forms:lstm_cell"] = lambda: (loops.LSTMLoop(), (torch.randn(2, 5, D), torch.randn(2, D)))
    out.update({f"highway_rnn:cells_{lstm}_{feed}": (lambda lstm=lstm, feed=feed: (
        rnn.CellLoop(lstm, feed), (torch.randn(2, 6, 5),))) for lstm in (False, True) for feed in (False, True)})
    out.update({f"scan_forms:{k}": (lambda k=k: (forms.Form(k), (torch.randn(2, 7, forms.D),))) for k in forms.FORMS})
    out.update({f"tree_scans:{k}": (lambda k=k: (trees.Model(k, torch.float32), (torch.randn(2, 9, trees.D),)))
                for k in ("accel", "gateloop", "transformers", "wrong", "max")})
    out.update({f"known_scans:{fn.__name__}": (lambda fn=fn: (known.Layer(6, fn), (torch.randn(2, 5, 6),)))
                for fn in (known.LoopScan, known.Twice)})
    out.update({f"recognize:res_{k}": (lambda k=k: (rec._Res(k), (torch.randn(2, 5, rec.D), torch.randn(2, 5, rec.D))))
                for k in ("add", "relu_add", "scalar", "gated", "unrelated", "skip_across")})
    out["recognize_unrolled:linear_loop"] = lambda: (unrolled.linear_loop, unrolled._inputs(5))
    out["token_shift:pad"] = lambda: (token.TokenShiftStack("pad"), (torch.randn(2, 7, token.D),))
    out["shift_readout:zeros"] = lambda: (shifts.PrevReadout("zeros"), (torch.randn(2, 7, shifts.D),))
    out["mlp"] = lambda: (_mlp(), (torch.randn(3, 8),))
    out["transformer"] = lambda: (nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                  (torch.randn(2, 5, 16),))
    return out


MODELS = {**_examples(), **_test_models()}


def _full(gm) -> dict[str, bool]:
    """For each family: whether its full matchers find or reject anything in ``gm``."""
    def some(fn):
        found, rejected = fn(copy_graph_module(gm))
        return bool(found or rejected)
    return {"scans": some(find_recurrences), "slices": some(find_unrolled), "cells": some(find_cells),
            "sums": some(find_residuals), "forms": some(match_scan_forms)}


def _wanted(gm) -> dict[str, bool]:
    """For each family: whether the pre-filter lets its matchers run on ``gm``."""
    c = prefilter.candidates(gm)
    return {"scans": c.scans, "slices": c.slices, "cells": c.cells, "sums": c.sums, "forms": c.scans or c.slices}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_prefilter_agrees_with_the_full_matchers(name, monkeypatch):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    monkeypatch.setattr(prefilter, "CHECK", True)
    prefilter.DISAGREEMENTS.clear()
    # NB: explain runs the pipeline: under CHECK every matcher the pre-filter skips in capture (on the graph as
    # captured) and in recognition (on the normalized graph) runs anyway and notes what it finds
    rep = ac.explain(model, *inputs)
    assert not prefilter.DISAGREEMENTS, prefilter.DISAGREEMENTS
    for gm in rep.graphs:  # NB: and on the graphs as dynamo made them, family by family
        wanted, full = _wanted(gm), _full(gm)
        missed = [k for k, v in full.items() if v and not wanted[k]]
        assert not missed, (name, missed, wanted)


def test_the_agreement_test_sees_each_family_with_and_without_candidates():
    """The agreement test is not vacuous: among its models, each family has one with candidates and one without
    (a few of them, traced by dynamo alone, suffice to show it)."""
    seen: dict[str, set[bool]] = {}
    for name in ("mlp", "example:selective_ssm", "loop_forms:gru_cell", "recognize:res_add"):
        torch._dynamo.reset()
        model, inputs = MODELS[name]()
        graphs = []
        torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm.forward)(*inputs)
        for gm in graphs:
            for k, v in _wanted(gm).items():
                seen.setdefault(k, set()).add(v)
    assert seen and all(v == {True, False} for v in seen.values()), seen


# ----------------------------------------------------------------------------------------------------------------
# a loop re-rolled but not rewritten compiles re-rolled


def _loop(a, b, h):
    hs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, 1).square().mean()


def test_a_declined_rerolled_loop_compiles_rerolled_and_checked(monkeypatch):
    from adjoint_compile.passes import stitch as stitch_mod

    compiled = []
    real = stitch_mod.compile_inner
    monkeypatch.setattr(stitch_mod, "compile_inner", lambda gm, ex, inner, **kw: compiled.append(gm) or real(gm, ex,
                                                                                                            inner, **kw))
    torch.manual_seed(0)
    a, b, h = torch.rand(2, 24, 3, requires_grad=True), torch.randn(2, 24, 3, requires_grad=True), torch.randn(2, 3)
    f = torch.compile(_loop, backend="adjoint", options={"inner": "aot_eager"})
    f(a, b, h).backward()
    got = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    _loop(a, b, h).backward()
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, (a.grad, b.grad)))
    rec = ac.report(f).compiled[0]
    assert rec.lowered == [] and [r.rewrite for r in rec.regions] == ["none"]  # NB: one shard: declined
    assert len(compiled) == 1 and len(compiled[0].graph.nodes) < 30, len(compiled[0].graph.nodes)  # NB: not 24 steps
    assert any("linear_scan" in str(n.target) for n in compiled[0].graph.nodes)
    assert "check_forward_s" in rec.timing and not rec.fallbacks  # NB: checked against the loop as captured
