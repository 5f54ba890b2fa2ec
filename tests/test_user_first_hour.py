"""What a new user meets in the first hour says the right thing (issue 36, section 2): nn.GRU / nn.LSTM in the default
mode say why nothing is rewritten and which mode does (in the warning and in both reports), an option of another mode
is refused, the warning's count leaves out an informational residual-chain row, the example's comment matches what
the backend does, and the results folder is named after what it holds."""
from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.backend import unsaved_message
from adjoint_compile.models.selective_ssm import make as make_ssm

ROOT = Path(__file__).resolve().parent.parent
RNN_LOGGER = "adjoint_compile.polyfills.torch_rnn"


# ------------------------------------------------------------------------- nn.GRU / nn.LSTM outside highway mode


class _RNNHead(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn, self.lin = rnn, nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.lin(x))[0].sum()


def _says_why(text: str, kind: str, mode: str) -> None:
    assert f"nn.{kind} is left out of dynamo's graph" in text and "not rewritten" in text, text
    assert f"mode={mode!r} {'shards' if mode == 'exact' else 'truncates'} linear recurrences only" in text, text
    assert "nonlinear in its state" in text and "mode='highway'" in text and "Highway-BP" in text, text


@pytest.mark.parametrize("kind,mode", [("GRU", "exact"), ("LSTM", "exact"), ("GRU", "truncated")])
def test_an_rnn_module_outside_highway_mode_warns_why_and_the_report_lists_it(caplog, kind, mode):
    torch.manual_seed(0)
    model = _RNNHead(getattr(nn, kind)(5, 5, batch_first=True))
    opts = {"inner": "eager", **({"mode": "truncated", "window": 4} if mode == "truncated" else {})}
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=opts)
    with caplog.at_level(logging.WARNING, logger=RNN_LOGGER):
        for _ in range(2):
            f(torch.randn(2, 7, 5)).backward()
    warned = [r.getMessage() for r in caplog.records if r.name == RNN_LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once per torch.compile, not per call
    _says_why(warned[0], kind, mode)
    breaks = [b.reason for b in ac.report(f).graph_breaks]
    assert len(breaks) == 1, breaks
    _says_why(breaks[0], kind, mode)
    assert breaks[0] in str(ac.report(f))
    # explain() and report() agree
    assert [b.reason for b in ac.explain(model, torch.randn(2, 7, 5), options=opts).graph_breaks] == breaks


def test_explain_does_not_warn_about_an_rnn_module(caplog):
    with caplog.at_level(logging.WARNING, logger=RNN_LOGGER):
        rep = ac.explain(_RNNHead(nn.GRU(5, 5, batch_first=True)), torch.randn(2, 7, 5))
    assert rep.graph_breaks and not [r for r in caplog.records if r.name == RNN_LOGGER]


# ----------------------------------------------------------------------------------------- options of a mode


@pytest.mark.parametrize("options", [{"window": 8}, {"mode": "exact", "window": 8},
                                     {"mode": "highway", "iterations": 2, "window": 8}])
def test_window_outside_truncated_mode_is_refused_like_tolerance(options):
    with pytest.raises(ac.OptionsError, match=r"'window'=8 is not valid: it applies to mode='truncated' only"):
        ac.explain(lambda x: x * 2, torch.randn(3), options=options)
    with pytest.raises(ac.OptionsError, match=r"'tolerance'=0.1 is not valid: it applies to mode='highway' only"):
        ac.explain(lambda x: x * 2, torch.randn(3), options={"mode": "truncated", "window": 2, "tolerance": 0.1})
    ac.explain(lambda x: x * 2, torch.randn(3), options={"mode": "truncated", "window": 8})  # its own mode


@pytest.mark.parametrize("options", [{"iterations": 3}, {"mode": "truncated", "window": 2, "iterations": 3}])
def test_iterations_outside_highway_mode_is_refused(options):
    with pytest.raises(ac.OptionsError, match=r"'iterations'=3 is not valid: it applies to mode='highway' only"):
        ac.explain(lambda x: x * 2, torch.randn(3), options=options)
    ac.explain(lambda x: x * 2, torch.randn(3), options={"mode": "highway", "iterations": 3})  # its own mode


# --------------------------------------------------------------------------------------------- the warning


def test_the_warning_does_not_count_an_informational_residual_chain_row():
    """selective_ssm at T = 12: two scans of one shard each are declined; the residual chain over the layers (its
    rewrite is Highway-BP, not this mode's) is listed as informational, not counted among the regions kept."""
    torch.manual_seed(0)
    rep = ac.explain(make_ssm(), torch.randn(2, 12, 16))
    assert [r.kind for r in rep.regions] == ["linear_recurrence"] * 2 + ["residual_chain"]
    msg = unsaved_message(rep.compiled[0], rep.options)
    assert "adjoint-compile: 2 recognized region(s) kept ordinary autograd" in msg, msg
    (chain,) = [ln for ln in msg.splitlines() if "residual_chain" in ln]
    assert chain.strip().startswith("(informational, not counted) residual_chain") and "not rewritten" not in chain


def test_a_residual_chain_alone_is_still_counted():
    resnet = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])

    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = resnet

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    rep = ac.explain(Res(), torch.randn(2, 8))
    assert [r.kind for r in rep.regions] == ["residual_chain"]
    assert "1 recognized region(s) kept ordinary autograd" in unsaved_message(rep.compiled[0], rep.options)


# -------------------------------------------------------------------------------------- examples and results


def test_the_selective_ssm_examples_comment_matches_the_default_shard():
    """examples/selective_ssm.py says what shard_size the backend chooses at the example's length with one CPU thread,
    and that two threads double it (shards hold at least 8 MiB per thread): check both."""
    text = (ROOT / "examples" / "selective_ssm.py").read_text()
    m = re.search(r"with one thread (\d+) steps at\s+#?\s*T = (\d+)", text)
    assert m is not None, "the comment on the default shard size is gone"
    shard, T = int(m.group(1)), int(m.group(2))
    assert "declined" not in text and "twice that with two" in text
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            rep = ac.explain(make_ssm(), torch.randn(2, T, 16))
            lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
            assert lin and all(r.rewrite == "adjoint" and r.details["shard_size"] == threads * shard
                               for r in lin), str(rep)
    finally:
        torch.set_num_threads(n)


def test_the_long_size_results_are_named_for_what_they_hold():
    assert (ROOT / "benchmarks" / "results" / "real_models_long" / "real_models_cpu.md").is_file()
    assert not (ROOT / "benchmarks" / "results" / "issue_sizes").exists()
    found = subprocess.run(["git", "grep", "-l", "issue_sizes", "--", ":!tests/test_user_first_hour.py"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == "", found.stdout  # every link follows the rename


def test_one_shard_message_fits_whether_shard_size_was_set():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    mine = [r.reason for r in ac.explain(make_ssm(), x, options={"shard_size": 64}).regions
            if r.kind == "linear_recurrence"]
    assert len(mine) == 2 and all(r == "one shard: T=12 ≤ shard 64; shard_size=64 was set: a smaller one (< 12) "
                                       "shards it" for r in mine), mine
    auto = [r.reason for r in ac.explain(make_ssm(), x).regions if r.kind == "linear_recurrence"]
    assert auto and all(r.startswith("one shard: T=12 ≤ shard ") and r.endswith("; set shard_size to shard it")
                        for r in auto), auto
    one = [r.reason for r in ac.explain(make_ssm(), torch.randn(2, 1, 16), options={"shard_size": 1}).regions
           if r.kind == "linear_recurrence"]
    assert one and all(r == "one shard: T=1 ≤ shard 1; a single step has nothing to shard" for r in one), one


class _ShiftMix(nn.Module):
    """A token-shift layer (RWKV's mix): the shifted input is read beside the layer, a skip across layers."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.mu, self.k, self.out = nn.Parameter(torch.rand(d)), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xx = torch.nn.functional.pad(x, (0, 0, 1, -1))
        k = self.k(x * self.mu + xx * (1 - self.mu))
        a = torch.sigmoid(k + xx)
        return x + self.out(ac.ops.linear_scan(a, (1 - a) * k))


def test_rejected_residual_chains_beside_rewritten_recurrences_do_not_warn():
    """Every scan rewritten, only residual-chain candidates rejected (exact mode has no rewrite for them anyway):
    the warning said '0 recognized region(s) kept ordinary autograd and 4 candidate(s) were rejected' and told to
    write the recurrence with linear_scan."""
    torch.manual_seed(0)
    rep = ac.explain(nn.Sequential(_ShiftMix(), _ShiftMix()), torch.randn(2, 17, 6), options={"shard_size": 4})
    assert all(r.rewrite == "adjoint" for r in rep.regions if r.kind == "linear_recurrence"), str(rep)
    assert any(j.candidate == "residual_chain" for j in rep.rejections), "the case should reject a residual chain"
    assert unsaved_message(rep.compiled[0], rep.options) is None


class _Checkpointed(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        return ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def test_activation_checkpointing_is_named_as_the_cause():
    """A model under gradient checkpointing hides its scans inside checkpoint regions: the warning told to write
    the recurrence with linear_scan (which it was); it names checkpointing and how to turn it off."""
    rep = ac.explain(_Checkpointed(), torch.randn(2, 17, 6), options={"shard_size": 4})
    msg = unsaved_message(rep.compiled[0], rep.options)
    assert "nothing recognized" in msg and "activation checkpointing" in msg and "gradient_checkpointing_disable" \
        in msg, msg


def test_a_candidate_at_an_op_a_rewritten_region_covers_does_not_warn():
    """nn.LSTM in highway mode: its scan is rewritten (the gated carry), and the other carry's rejection as a
    linear recurrence made the warning say '0 kept, 1 rejected: write the recurrence with linear_scan'."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.lin = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.rnn(x)[0]).pow(2).sum()

    rep = ac.explain(M(), torch.randn(2, 5, 3), options={"mode": "highway", "iterations": 5})
    assert [r.rewrite for r in rep.regions] == ["highway"] and rep.rejections, str(rep)
    assert unsaved_message(rep.compiled[0], rep.options) is None


class _ScanAndDenseLoop(nn.Module):
    """A scan that is rewritten, and a dense loop (h @ W) that is rejected."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.w = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = self.w(h) + x[:, t]
            hs.append(h)
        return y + torch.stack(hs, 1)


def test_the_warning_counts_the_regions_rewritten_beside_the_rejected():
    """The warning read '0 recognized region(s) kept ordinary autograd and 1 candidate(s) were rejected' where a
    region was rewritten: it says so."""
    rep = ac.explain(_ScanAndDenseLoop(), torch.randn(2, 9, 6), options={"shard_size": 4})
    assert [r.rewrite for r in rep.regions if r.kind == "linear_recurrence"] == ["adjoint"], str(rep)
    msg = unsaved_message(rep.compiled[0], rep.options)
    assert msg is not None and "(1 other region(s) rewritten)" in msg, msg
