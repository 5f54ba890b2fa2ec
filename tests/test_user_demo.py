"""A user's run writes to the ignored out/ folder; the checked-in figures change only on purpose; the demo table
gives ratios to eager and to compile."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from adjoint_compile import cli, demo
from adjoint_compile.measure import format_table

ROOT = Path(__file__).resolve().parent.parent


def _ignored(path: Path) -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


def test_the_demo_writes_to_an_ignored_folder_by_default():
    out = Path(demo.parse_args([]).out)
    assert out == ROOT / "out"
    assert _ignored(out / "demo.json") and _ignored(out / "demo.png")
    assert not _ignored(ROOT / "benchmarks" / "results" / "demo.json")  # the checked-in one stays tracked


def test_dump_writes_to_an_ignored_folder_by_default():
    args = cli._parser().parse_args(["dump", "model.py:make", "--input", "randn(2)"])
    assert Path(args.out) == Path("out") / "dump" and _ignored(ROOT / args.out / "report.txt")


def test_make_demo_figures_is_the_one_target_that_writes_the_checked_in_figures():
    make = (ROOT / "Makefile").read_text()
    demo_rule = make.split("\ndemo: setup\n")[1].split("\n\n")[0]
    figures_rule = make.split("\ndemo-figures: setup\n")[1].split("\n\n")[0]
    assert "--out" not in demo_rule and "--out benchmarks/results" in figures_rule


def test_the_table_has_ratios_to_eager_and_to_compile():
    rows = [{"method": m, "peak_bytes": b * 2**20, "step_s": s, "max_grad_rel_err": None if m == "eager" else 1e-6}
            for m, b, s in (("eager", 40, 0.1), ("compile", 20, 0.05), ("adjoint", 5, 0.1))]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["method", "peak", "MiB", "mem/eager", "mem/compile", "step", "s", "time/eager",
                                "time/compile", "max", "grad", "rel", "err"]
    assert lines[3].split() == ["adjoint", "5.0", "0.125", "0.250", "0.100", "1.00", "2.00", "1.00e-06"]
    # without those methods, ratios are to the first row
    assert format_table(rows[2:]).splitlines()[0].split()[3] == "mem/adjoint"


def test_results_files_record_no_path_of_the_machine_that_wrote_them():
    import json
    import re

    def strings(x):
        if isinstance(x, dict):
            for k, v in x.items():
                yield str(k)
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x

    paths = re.compile(r"^(/(work|home|tmp|root|Users|usr|opt)/|[A-Za-z]:\\)")
    found = {f.name: s for f in (ROOT / "benchmarks" / "results").rglob("*.json")
             for s in strings(json.loads(f.read_text())) if paths.match(s)}
    assert found == {}


def test_training_off_a_terminal_prints_plain_progress_lines(capsys, monkeypatch):
    import argparse

    import torch

    from adjoint_compile.models.selective_ssm import SSMStack

    monkeypatch.setattr(demo, "PLAIN_PROGRESS_EVERY", 2)
    args = argparse.Namespace(seq_len=24, batch=2, steps=3, n_data=2, vocab=6, lr=1e-3, seed=0, device="cpu")
    torch.manual_seed(0)
    model = demo.CopyModel(SSMStack(8, 2, 1), args.vocab, 8, args.n_data)
    curve = demo.train(model, args, {"inner": "eager", "shard_size": 8})
    out = capsys.readouterr().out
    assert len(curve["loss"]) == len(curve["acc"]) == 3 and "\r" not in out
    assert [ln.split(",")[0] for ln in out.splitlines() if ln.startswith("train")] == \
        ["train T=24: step 2/3", "train T=24: step 3/3"]


def test_the_demos_training_learns_the_task(capsys):
    """A short run of the demo's own training (its task, model, step-size initialization, learning rate, with
    backend="adjoint" sharding the scans) copies well above chance on held-out sequences. The inner compiler is
    eager here, for speed; the gradients are the same."""
    import torch

    from adjoint_compile.models.selective_ssm import SSMStack

    args = demo.parse_args(["--train-len", "32", "--train-batch", "32", "--steps", "80", "--seq-len", "128"])
    chance = 1 / (args.vocab - 2)
    torch.manual_seed(args.seed)
    stack = SSMStack(args.d_model, args.d_state, args.layers)
    demo.init_step_sizes(stack, torch.Generator().manual_seed(args.seed))
    model = demo.CopyModel(stack, args.vocab, args.d_model, args.n_data)
    assert demo.accuracy(model, args, args.train_len, 256, seed=2) < 2 * chance
    curve = demo.train(model, args, {"inner": "eager", "shard_size": 8})
    assert curve["loss"][-1] < 0.7 * curve["loss"][0]
    assert demo.accuracy(model, args, args.train_len, 256, seed=2) > 2 * chance
