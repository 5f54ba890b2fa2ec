"""Compile-time profile (adjoint_compile/timing.py).

* every stage of the pipeline, and the inner compiles at run time (partitions, shard programs and their VJPs), are
  on the graph's record (``CompiledGraph.timing``) with non-negative seconds; ``report()`` / ``explain()`` show them
  in one "compile time:" line and the backend logs them at INFO.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile import timing

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
    for sub in ("capture.known_scans", "capture.noop_ops", "capture.match", "capture.match.find_recurrences",
                "capture.match.find_unrolled", "recognize.find_residuals", "recognize.time_local"):
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
