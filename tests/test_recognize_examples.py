"""The five example models in examples/: what explain() recognizes in each (docs/known-scans.md shows these reports)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import adjoint_compile
import adjoint_compile.ops as ac_ops

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def linear_scan_available(monkeypatch):
    """The selective SSM needs ``ac.ops.linear_scan``; until ops.py provides it, a reference stand-in with the
    same contract (registered once per process under the same op name)."""
    if hasattr(ac_ops, "linear_scan"):
        return
    if not hasattr(torch.ops.adjoint_compile, "linear_scan"):
        @torch.library.custom_op("adjoint_compile::linear_scan", mutates_args=())
        def _standin(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, dim: int = 1,
                     reverse: bool = False, window: int | None = None, impl: str | None = None) -> torch.Tensor:
            a_, b_ = a.movedim(dim, 0), b.movedim(dim, 0)
            h = torch.zeros_like(b_[0]) if h0 is None else h0.expand_as(b_[0])
            out = []
            for t in range(a_.shape[0]):
                h = a_[t] * h + b_[t]
                out.append(h)
            return torch.stack(out, 0).movedim(0, dim).contiguous()

        @_standin.register_fake
        def _(a, b, h0=None, dim=1, reverse=False, window=None, impl=None):
            return torch.empty_like(b)

    monkeypatch.setattr(ac_ops, "linear_scan", lambda a, b, h0=None, dim=1, reverse=False, window=None, impl=None:
                        torch.ops.adjoint_compile.linear_scan.default(a, b, h0, dim, reverse, window, impl),
                        raising=False)


def _explain(name, *inputs):
    mod = _load(name)
    torch.manual_seed(0)
    model = mod.make()
    inputs = inputs or mod.example_inputs()
    return adjoint_compile.explain(model, *inputs, options={"inner": "eager"})


def test_selective_ssm_stack(linear_scan_available):
    mod = _load("selective_ssm")
    model = mod.SSMStack(d_model=8, d_state=3, n_layers=3)
    report = adjoint_compile.explain(model, torch.randn(2, 7, 8), options={"inner": "eager"})
    assert len(report.graphs) == 1 and not report.graph_breaks
    recs = [r for r in report.regions if r.kind == "linear_recurrence"]
    chains = [r for r in report.regions if r.kind == "residual_chain"]
    assert [(r.source, r.length) for r in recs] == [("linear_scan", 7)] * 3
    assert len({r.group for r in recs}) == 1 and recs[0].group is not None  # one time-local region
    assert all(r.bounds == [] for r in recs)
    (c,) = chains
    assert c.length == 3 and [layer.form for layer in c.layers] == ["pre_ln"] * 3


def test_gru_on_scan():
    report = _explain("gru_scan")
    (r,) = report.regions
    assert (r.kind, r.source, r.length) == ("gated_recurrence", "scan", 12)


@pytest.mark.parametrize("name,form,K", [("pre_ln_transformer", "pre_ln", "identity"),
                                         ("post_ln_transformer", "post_ln", "dense"),
                                         ("relu_resnet", "relu_add", "diagonal")])
def test_depth_chains(name, form, K):
    report = _explain(name)
    (c,) = report.regions
    n_layers = 6  # transformers: 3 blocks x (attention, MLP); the ResNet: 6 blocks
    assert (c.kind, c.source, c.length) == ("residual_chain", "residual", n_layers)
    assert {layer.form for layer in c.layers} == {form} and {layer.K for layer in c.layers} == {K}
    assert report.rejections == []
    assert "residual_chain" in str(report)


def test_examples_run_as_scripts(linear_scan_available, capsys, monkeypatch):
    """Each example's __main__ prints a report (run in-process to keep the suite fast)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["x"])
    for name in ("relu_resnet", "gru_scan"):
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
        assert "adjoint-compile report" in capsys.readouterr().out
