"""The ``adjoint-compile`` command line: safe --input parsing, explain, dump, demo dispatch."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from adjoint_compile import cli

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("expr,shape,dtype", [
    ("randn(2,1024,64)", (2, 1024, 64), torch.float32),
    ("rand((3, 4))", (3, 4), torch.float32),
    ("ones(5)", (5,), torch.float32),
    ("zeros(2, 3, dtype=float16)", (2, 3), torch.float16),
    ("zeros(2, 3, dtype=torch.bfloat16)", (2, 3), torch.bfloat16),
    ("randint(10, (2, 7))", (2, 7), torch.int64),
    ("randint(1, 5, (4,), dtype=int32)", (4,), torch.int32),
])
def test_parse_input(expr, shape, dtype):
    t = cli.parse_input(expr)
    assert tuple(t.shape) == shape and t.dtype == dtype


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "randn(2, n)", "randn(2.5)", "eye(3)", "randn(2, device='cuda')",
    "randn(2) + 1", "randn(-1)", "randn(2, dtype=int64)", "randint(3)", "torch.randn(2)",
])
def test_parse_input_refuses_anything_else_with_a_value_error_naming_input(expr):
    with pytest.raises(ValueError, match="--input"):
        cli.parse_input(expr)


def test_load_factory_errors_name_the_model(tmp_path):
    with pytest.raises(ValueError, match="model"):
        cli.load_factory("no_colon.py")
    with pytest.raises(ValueError, match="no such file"):
        cli.load_factory(str(tmp_path / "missing.py") + ":make")
    f = tmp_path / "m.py"
    f.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\ndef make():\n    return torch.nn.ReLU()\n")
    assert isinstance(cli.load_factory(f"{f}:model"), torch.nn.Linear)
    assert isinstance(cli.load_factory(f"{f}:make"), torch.nn.ReLU)
    with pytest.raises(ValueError, match="no attribute"):
        cli.load_factory(f"{f}:nope")


def test_explain_prints_the_report(capsys):
    rc = cli.main(["explain", f"{EXAMPLES / 'relu_resnet.py'}:make", "--input", "randn(4,16)",
                   "--options", '{"inner": "eager"}'])
    out = capsys.readouterr().out
    assert rc == 0
    assert "residual_chain" in out and "residual" in out and "inner=eager" in out


def test_explain_json_and_bad_options(capsys):
    rc = cli.main(["explain", f"{EXAMPLES / 'gru_scan.py'}:make", "--input", "randn(2,5,8)", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["kind"] for r in d["regions"]] == ["gated_recurrence"]
    rc = cli.main(["explain", f"{EXAMPLES / 'gru_scan.py'}:make", "--input", "randn(2,5,8)",
                   "--options", '{"mode": "fast"}'])
    assert rc == 2 and "mode" in capsys.readouterr().err


def _no_graphviz(monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)  # NB: makes `import graphviz` raise ImportError
    monkeypatch.setattr(shutil, "which", lambda name: None)


def test_dump_writes_graph_text_and_dot_text_without_graphviz(tmp_path, capsys, monkeypatch):
    _no_graphviz(monkeypatch)
    rc = cli.main(["dump", f"{EXAMPLES / 'relu_resnet.py'}:make", "--input", "randn(4,16)", "--out", str(tmp_path)])
    assert rc == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"report.txt", "report.json", "graph_0.txt", "graph_0.dot"} <= names
    text = (tmp_path / "graph_0.txt").read_text()
    assert "def forward" in text and "residual_chain" in text
    err = capsys.readouterr().err
    assert "graphviz is not installed" in err and 'pip install "adjoint-compile[graphviz]"' in err
    dot = (tmp_path / "graph_0.dot").read_text()
    assert dot.startswith("digraph") and "fillcolor" in dot


def test_dump_labels_break_lines_and_draw_rewritten_regions_on_top(tmp_path, monkeypatch):
    """selective_ssm: the residual chain over depth (left to ordinary autograd, its nodes inside the sharded region)
    holds every node of the two rewritten recurrences; the picture must show the recurrences."""
    _no_graphviz(monkeypatch)
    rc = cli.main(["dump", f"{EXAMPLES / 'selective_ssm.py'}:make", "--input", "randn(2,64,16)",
                   "--options", '{"shard_size": 16}', "--out", str(tmp_path)])
    assert rc == 0
    dot = (tmp_path / "graph_0.dot").read_text()
    labels = [ln for ln in dot.splitlines() if "[label=" in ln]
    # NB: DOT's line break is backslash-n inside the quoted label; an escaped backslash before it is a literal "\n"
    assert all("\\\\n" not in ln for ln in labels) and any("\\n" in ln for ln in labels)
    scans = [ln for ln in labels if "linear_scan" in ln.split("[label=")[1].split("\\n")[1]]
    assert len(scans) == 2
    assert all("linear_recurrence (linear_scan)\\nrewrite adjoint" in ln for ln in scans), scans
    # the time-local ops the sharded region took in are drawn as part of it, over the chain that also holds them
    assert sum("rewrite adjoint" in ln for ln in labels) > 20
    assert not [ln for ln in labels if "residual_chain" in ln and "rewrite adjoint" not in ln and "linear_scan" in ln]


def test_dump_renders_svg_with_the_graphviz_package(tmp_path, monkeypatch):
    import types

    seen = []
    fake = types.ModuleType("graphviz")

    class Source:
        def __init__(self, text):
            seen.append(text)

        def pipe(self, format):
            assert format == "svg"
            return b"<svg>" + seen[-1].encode() + b"</svg>"

    fake.Source = Source
    monkeypatch.setitem(sys.modules, "graphviz", fake)
    rc = cli.main(["dump", f"{EXAMPLES / 'relu_resnet.py'}:make", "--input", "randn(4,16)", "--out", str(tmp_path)])
    assert rc == 0 and len(seen) == 1 and seen[0].startswith("digraph")
    names = {p.name for p in tmp_path.iterdir()}
    assert "graph_0.svg" in names and "graph_0.dot" not in names
    assert (tmp_path / "graph_0.svg").read_bytes().startswith(b"<svg>digraph")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot program is not installed (optional)")
def test_dump_renders_a_real_svg_with_the_dot_program(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    rc = cli.main(["dump", f"{EXAMPLES / 'relu_resnet.py'}:make", "--input", "randn(4,16)", "--out", str(tmp_path)])
    assert rc == 0 and b"<svg" in (tmp_path / "graph_0.svg").read_bytes()


def test_demo_dispatches_to_the_demo_module(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("adjoint_compile.demo")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "adjoint_compile.demo", fake)
    import adjoint_compile

    monkeypatch.setattr(adjoint_compile, "demo", fake, raising=False)
    assert cli.main(["demo", "--quick"]) == 0
    assert seen["argv"] == ["--quick"]


def test_help_says_what_each_command_does_and_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for words in ("explain  print what the backend recognizes", "dump     the same", "demo     train",
                  "path/to/file.py:factory", "examples:"):
        assert words in out
    from adjoint_compile import demo

    parsers = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    for p in (parsers["explain"], parsers["dump"], demo.parser()):
        undocumented = [a.dest for a in p._actions if not a.help]
        assert undocumented == [], undocumented
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--seq-len SEQ_LEN     sequence length T" in out and "--shard-size" in out
