"""A compiled graph that saves nothing says so: one WARNING per compiled graph (never per call) naming what was not
rewritten, where in the user's code, and what to do; silence when every recognized region is rewritten or covered by
another rewrite."""
from __future__ import annotations

import logging
import runpy
from pathlib import Path

import pytest
import torch

import adjoint_compile as ac
from test_capture_loop_forms import residual_loop  # six residual layers whose inputs also feed the output: rejected
from adjoint_compile.models.selective_ssm import make as make_ssm

ROOT = Path(__file__).resolve().parent.parent
LOGGER = "adjoint_compile.backend"


def _train(model, *inputs, options, calls: int = 3):
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", **options})
    for _ in range(calls):
        f(*inputs).sum().backward()
    return f


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_nothing_recognized_warns_once_with_the_remedy(caplog):
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(mlp, torch.randn(2, 4), options={})
    (msg,) = _warnings(caplog)
    assert "nothing recognized" in msg and "saves no memory" in msg
    assert "adjoint_compile.ops.linear_scan" in msg and "adjoint_compile.explain(model, *inputs)" in msg


def test_a_region_left_to_autograd_is_named_with_its_source_line_and_remedy(caplog):
    resnet = runpy.run_path(str(ROOT / "examples" / "relu_resnet.py"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(resnet["make"](), *resnet["example_inputs"](), options={})
    (msg,) = _warnings(caplog)
    assert "1 recognized region(s) kept ordinary autograd" in msg
    assert "residual_chain" in msg and "not rewritten [" in msg and "relu_resnet.py:" in msg
    assert "mode='highway'" in msg  # the remedy, from the decision's reason


def test_rejected_candidates_are_grouped_in_one_warning(caplog):
    x, W = torch.randn(2, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(residual_loop, x, W, options={})
    (msg,) = _warnings(caplog)
    assert "nothing recognized" in msg  # the five candidates were rejected: no region at all
    # NB: five rejections of one cause are one line, not five
    lines = [ln for ln in msg.splitlines() if ln.strip().startswith("rejected")]
    assert len(lines) == 1 and "residual_chain x5 (at x_1, x_2, x_3, ... (2 more))" in lines[0]
    assert "test_capture_loop_forms.py:" in lines[0] and "register_scan" in msg  # where residual_loop is written


@pytest.mark.parametrize("options", [{"shard_size": 16}, {"mode": "highway", "iterations": 1}],
                         ids=["exact-sharded", "highway-covers-the-scans"])
def test_no_warning_when_everything_is_rewritten_or_covered(caplog, options):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        f = _train(make_ssm(), torch.randn(2, 40, 16), options=options)
    rep = ac.report(f)
    assert rep.regions and all(r.rewrite != "none" or r.details.get("covered") for r in rep.regions)
    assert _warnings(caplog) == []


def test_explain_does_not_warn_it_reports(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rep = ac.explain(residual_loop, torch.randn(2, 4), torch.randn(4, 4))
    assert rep.rejections and _warnings(caplog) == []


def test_a_declined_scan_is_named_at_the_users_line_not_inside_the_package(caplog):
    """A region of one shard is declined (it would save nothing); the warning points at the model's own line that
    called ``ac.ops.linear_scan``, not at the op's wrapper."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(make_ssm(), torch.randn(2, 12, 16), options={})
    (msg,) = _warnings(caplog)
    declined = [ln for ln in msg.splitlines() if "one shard: T=12" in ln]
    assert len(declined) == 2 and "set shard_size to shard it" in declined[0]
    assert all("models/selective_ssm.py:" in ln and "ops.py" not in ln for ln in declined), declined
