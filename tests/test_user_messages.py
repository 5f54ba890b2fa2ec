"""What the user asked for is shown, with no setup: warnings by default, verify's figures, option errors without
dynamo's boilerplate, and no foreign warnings in our test runs."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

import adjoint_compile as ac

ROOT = Path(__file__).resolve().parent.parent


class ScanModel(torch.nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.w = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ac.ops.linear_scan(torch.sigmoid(self.w(x)), x)


def test_torch_compile_mode_is_ignored_with_a_user_warning():
    f = torch.compile(ScanModel(), backend="adjoint", mode="max-autotune-no-cudagraphs")
    with pytest.warns(ac.AdjointCompileWarning, match=r"ignores torch.compile\(mode='max-autotune-no-cudagraphs'\)"):
        f(torch.randn(2, 8, 4))


def test_no_mode_no_warning():
    f = torch.compile(ScanModel(), backend="adjoint", options={"inner": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ac.AdjointCompileWarning)
        f(torch.randn(2, 8, 4)).sum().backward()


def test_verify_warns_its_result_and_the_report_holds_it():
    f = torch.compile(ScanModel(), backend="adjoint", options={"verify": True, "inner": "eager", "shard_size": 4})
    with pytest.warns(ac.AdjointVerifyReport, match=r"adjoint_region_0 \(shard_size=4 of T=16\).*max relative error"):
        f(torch.randn(2, 16, 4)).sum().backward()
    (region,) = ac.report(f).regions
    fid = region.details["fidelity"]
    assert fid["shard_size"] == 4 and fid["steps"] == 16 and 0 <= fid["max_rel_err"] < 1e-5
    assert ac.report(f).to_dict()["regions"][0]["details"]["fidelity"] == fid
    with warnings.catch_warnings():  # only the first call verifies
        warnings.simplefilter("error", ac.AdjointVerifyReport)
        f(torch.randn(2, 16, 4))


def test_verify_waits_for_a_first_call_outside_inference_mode():
    """Under inference_mode there is no autograd to compare with: the call runs, the next one verifies."""
    f = torch.compile(ScanModel(), backend="adjoint", options={"verify": True, "inner": "eager", "shard_size": 4})
    x = torch.randn(2, 16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ac.AdjointVerifyReport)
        with torch.inference_mode():
            got = f(x)
    torch.testing.assert_close(got, ScanModel.forward(f._orig_mod, x))
    with pytest.warns(ac.AdjointVerifyReport, match="max relative error"):
        f(x).sum().backward()


def test_without_verify_there_is_no_fidelity():
    f = torch.compile(ScanModel(), backend="adjoint", options={"inner": "eager", "shard_size": 4})
    f(torch.randn(2, 16, 4)).sum().backward()
    (region,) = ac.report(f).regions
    assert region.details["region_call"] == "adjoint_region_0" and "fidelity" not in region.details


def test_backend_warnings_reach_stderr_without_any_logging_setup():
    # NB: a fresh interpreter: pytest installs its own logging handlers here
    code = ("import logging, adjoint_compile\n"
            "logging.getLogger('adjoint_compile.backend').warning('adjoint-compile: a warning for the user')\n"
            "logging.getLogger('adjoint_compile.backend').info('adjoint-compile: info stays quiet')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "adjoint-compile: a warning for the user" in r.stderr and "info stays quiet" not in r.stderr


def test_an_options_error_says_only_our_message():
    f = torch.compile(ScanModel(), backend="adjoint", options={"shard_sise": 3})
    with pytest.raises(ValueError) as info:
        f(torch.randn(2, 8, 4))
    assert isinstance(info.value, ac.OptionsError)
    assert str(info.value) == ("unknown adjoint-compile option 'shard_sise'=3 (did you mean 'shard_size'?); allowed "
                               "keys: mode, window, iterations, shard_size, sequence_parallel, reduce_grads, inner, "
                               "verify, check_forward, tolerance, per_sample_clip, batch_dim, cuda_graphs, roll_loops, "
                               "fused_loss")
    assert "TORCHDYNAMO_VERBOSE" in info.value.args[0]  # dynamo did append it: __str__ is what hides it


def test_mode_and_options_together_is_torchs_own_error():
    """docs/options.md says so: torch.compile refuses ``mode=`` with ``options=`` before any backend sees them."""
    with pytest.raises(RuntimeError, match="Either mode or options can be specified"):
        torch.compile(ScanModel(), backend="adjoint", mode="max-autotune", options={"shard_size": 3})


def test_the_pytest_filter_matches_exactly_torchs_script_method_warnings():
    """pyproject's filterwarnings hides the 14 DeprecationWarnings that torch.utils.mkldnn raises when inductor is
    first imported, and nothing else: the filter must match them, and they must come from torch, not from us."""
    from _pytest.config import parse_warning_filter

    (spec,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    action, message, category, module, lineno = parse_warning_filter(spec, escape=False)
    code = ("import warnings, sys\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n    import torch.utils.mkldnn\n"
            "for x in w: print(x.category.__name__, x.filename, str(x.message), sep='|')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    rows = [line.split("|") for line in r.stdout.splitlines()]
    assert len(rows) == 14, r.stdout + r.stderr
    for cat, filename, msg in rows:
        assert cat == "DeprecationWarning" and category is DeprecationWarning and action == "ignore"
        assert filename.endswith("torch/jit/_script.py") and re.match(module, "torch.jit._script")
        assert re.match(module, filename.removesuffix(".py"))  # how pytest.warns re-emits it
        assert re.match(message, msg)
    assert not re.match(module, "adjoint_compile.backend") and not re.match(message, "adjoint-compile ignores")
