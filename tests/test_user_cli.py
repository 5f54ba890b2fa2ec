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
    scans = [ln for ln in labels if "linear_scan" in (ln.split("[label=")[1].split("\\n")[1:2] or [""])[0]]
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


# ---------------------------------------------------------------------------------------- dump: rows, boxes, names


def _dump_ssm(tmp_path, monkeypatch) -> str:
    _no_graphviz(monkeypatch)
    rc = cli.main(["dump", f"{EXAMPLES / 'selective_ssm.py'}:make", "--input", "randn(2,64,16)",
                   "--options", '{"shard_size": 16}', "--out", str(tmp_path)])
    assert rc == 0
    return (tmp_path / "graph_0.dot").read_text()


def _label(dot: str, node: str) -> str:
    (line,) = [ln for ln in dot.splitlines() if ln.strip().startswith(f'"{node}" [label=')]
    return line.split("[label=")[1]


def test_dump_labels_each_node_by_its_report_row_and_region(tmp_path, monkeypatch):
    """selective_ssm: rows #0 (h) and #1 (h_1) are lowered into one call, adjoint_region_0. Each scan is labelled by
    its own row, the ops the call took in by the call and both rows; no node of row #0 says #1 (issue 36)."""
    dot = _dump_ssm(tmp_path, monkeypatch)
    assert "#0 linear_recurrence (linear_scan)" in _label(dot, "h")
    assert "#1 linear_recurrence (linear_scan)" in _label(dot, "h_1")
    assert "adjoint_region_0: rows #0, #1" in _label(dot, "mul_3")  # the readout of layer 0: in the call
    row1 = [ln for ln in dot.splitlines() if "#1 linear_recurrence" in ln and "[label=" in ln and "legend" not in ln]
    assert [ln.strip().split(" ")[0] for ln in row1] == ['"h_1"'], row1
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [r["name"] for r in rep["regions"][:2]] == ["h", "h_1"]  # the rows the picture names


def test_dump_draws_a_box_around_each_region_and_a_legend(tmp_path, monkeypatch):
    dot = _dump_ssm(tmp_path, monkeypatch)
    boxes = [ln for ln in dot.splitlines() if ln.strip().startswith("subgraph cluster_")]
    assert len(boxes) == 2 and "subgraph cluster_legend {" in boxes[-1]
    box = dot.split("subgraph cluster_0 {")[1].split("\n  }")[0]
    assert 'label="adjoint_region_0 (rewrite adjoint): #0 linear_recurrence h; #1 linear_recurrence h_1"' in box
    assert '"h" [label=' in box and '"h_1" [label=' in box and '"mul_3" [label=' in box
    assert '"l_x_" [label=' not in box  # the input is outside the region
    legend = dot.split("subgraph cluster_legend {")[1]
    for words in ("#2 residual_chain", "adjoint_region_0 (rewrite adjoint)", "grey: a region left to ordinary "
                  "autograd", "white: outside every region"):
        assert words in legend, words
    assert dot.rstrip().endswith("}") and dot.count("{") == dot.count("}")


def test_dump_shortens_parameter_placeholder_names(tmp_path, monkeypatch):
    dot = _dump_ssm(tmp_path, monkeypatch)
    assert _label(dot, "l_self_modules_layers_modules_0_modules_in_proj_parameters_weight_").startswith(
        '"layers.0.in_proj.weight\\nplaceholder')
    assert _label(dot, "l_self_modules_layers_modules_1_parameters_a_log_").startswith('"layers.1.A_log\\n')
    assert _label(dot, "l_x_").startswith('"x\\n')
    assert "(layers.0.in_proj.weight)" in (tmp_path / "graph_0.txt").read_text()


@pytest.mark.parametrize("target,short", [
    ("L_self_modules_layers_modules_0_modules_in_proj_parameters_weight_", "layers.0.in_proj.weight"),
    ("L_self_parameters_w_", "w"), ("L_self_buffers_running_mean_", "running_mean"), ("L_x_", "x"),
    ("L_tokens_", "tokens"), ("plain", "plain")])
def test_short_name(target, short):
    g = torch.fx.Graph()
    n = g.placeholder(target)
    assert cli.short_name(n) == short


# ------------------------------------------------------------------------------------------------ CLI errors


@pytest.mark.parametrize("text,words", [
    ("{mode: highway}", ["--options", "not valid JSON", "double quotes"]),
    ("[1, 2]", ["--options", "expected a JSON object"]),
    ('{"mode": "fast"}', ["--options", "'mode'='fast'"]),
])
def test_bad_options_name_the_flag_without_a_traceback(capsys, text, words):
    rc = cli.main(["explain", f"{EXAMPLES / 'gru_scan.py'}:make", "--input", "randn(2,5,8)", "--options", text])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("adjoint-compile explain: error: --options") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_a_missing_input_is_a_clean_message(capsys):
    rc = cli.main(["dump", f"{EXAMPLES / 'gru_scan.py'}:make"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "missing --input" in err and "takes 1 input(s) (x)" in err and 'randn(2,1024,64)' in err


def test_too_many_inputs_is_a_clean_message(capsys):
    rc = cli.main(["explain", f"{EXAMPLES / 'gru_scan.py'}:make", "--input", "randn(2,5,8)", "--input", "randn(2)"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "too many --input" in err and "at most 1" in err, err


def test_help_lists_every_option_without_pointing_into_the_repository(capsys):
    """A wheel has no docs/: the epilog lists the options itself (options.SUMMARY, one line each)."""
    from adjoint_compile.options import ALLOWED_KEYS, SUMMARY

    assert list(SUMMARY) == list(ALLOWED_KEYS)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "docs/" not in out
    for key in ALLOWED_KEYS:
        assert f"\n  {key:18s} {SUMMARY[key]}" in out, key


# ------------------------------------------------------------------------------- the user's file, as they import it

LOOP_FILE = """\
import torch


class Local(torch.nn.Module):  # a loop in a class of this very file: rolled only if its module is sys.modules'
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            outs.append(h)
        return torch.stack(outs, 1)


def make():
    m = Local()
    return lambda x: m(x).square().mean()
"""


def test_the_loops_of_a_class_in_the_users_file_are_rolled_as_in_their_script(tmp_path, capsys, recwarn):
    """The file is imported as a registered module, as the user's own script would have it: its loop is rolled into
    one scan (polyfills/loops.py needs the function's module in sys.modules), not unrolled with a warning to register
    the module, which a CLI user cannot do."""
    f = tmp_path / "loopmodel.py"
    f.write_text(LOOP_FILE)
    rc = cli.main(["explain", f"{f}:make", "--input", "randn(2,16,8)", "--options", '{"shard_size": 4}', "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and [(r["source"], r["rewrite"]) for r in d["regions"]] == [("scan", "adjoint")], d["regions"]
    assert not [w for w in recwarn if "not rolled" in str(w.message)], [str(w.message) for w in recwarn]


MISTAKES = """\
import torch


class Layer(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.a(x)


class Needs(Layer):
    def __init__(self, d):
        super().__init__(d)


def make():
    return Layer()


def make_tokens():
    emb, m = torch.nn.Embedding(10, 8), Layer()
    return lambda t: m(emb(t)).mean()


def loss_fn(x):
    return x.sum()


def broken():
    raise RuntimeError("user factory failed")
"""


@pytest.mark.parametrize("model,inputs,words", [
    ("make", ["randn(2,6,9)"], ["the model raised RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                                "(at mistakes.py:10 in forward) on --input 'randn(2,6,9)'", "the shape and dtype"]),
    ("make_tokens", ["randint(20, (2, 6))"], ["the model raised IndexError: index out of range",
                                              "(at mistakes.py:24 in <lambda>)", "token ids below its vocabulary"]),
    ("Needs", ["randn(2,6,8)"], ["Needs() needs argument(s) d", "def make(): return Needs(d=...)"]),
    ("loss_fn", ["randn(2,6,8)"], ["loss_fn() needs argument(s) x", "if loss_fn is the model itself, add def make(): "
                                   "return loss_fn"]),
    ("broken", ["randn(2,6,8)"], ["broken() raised RuntimeError: user factory failed (at mistakes.py:32 in broken)"]),
])
def test_a_mistake_in_the_model_or_its_inputs_is_one_line_naming_it(tmp_path, capsys, model, inputs, words):
    f = tmp_path / "mistakes.py"
    f.write_text(MISTAKES)
    rc = cli.main(["explain", f"{f}:{model}", *(a for i in inputs for a in ("--input", i))])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("adjoint-compile explain: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_a_file_that_raises_on_import_is_one_line_and_traceback_shows_the_cause(tmp_path, capsys):
    f = tmp_path / "bad.py"
    f.write_text("import torch\nraise ImportError('no module named mamba_ssm')\n")
    rc = cli.main(["explain", f"{f}:make", "--input", "randn(2,6,8)"])
    err = capsys.readouterr().err
    assert rc == 2 and "importing" in err and "raised ImportError: no module named mamba_ssm (at bad.py:2" in err
    assert "_adjoint_compile_user_bad" not in sys.modules
    g = tmp_path / "mistakes.py"
    g.write_text(MISTAKES)
    with pytest.raises(cli.CliError, match="the model raised RuntimeError") as info:
        cli.main(["explain", f"{g}:make", "--input", "randn(2,6,9)", "--traceback"])
    assert isinstance(info.value.__cause__, RuntimeError)



def test_a_model_that_takes_gradients_in_its_forward_is_explained(tmp_path, capsys):
    """The eager run before explain keeps autograd on: a forward calling torch.autograd.grad is not a mistake."""
    f = tmp_path / "gradfwd.py"
    f.write_text("import torch\n\n\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.l = torch.nn.Linear(4, 1)\n\n    def forward(self, x):\n"
                 "        x = x.detach().requires_grad_()\n"
                 "        return torch.autograd.grad(self.l(x).sum(), x, create_graph=True)[0].square().sum()\n")
    rc = cli.main(["explain", f"{f}:M", "--input", "randn(2,3,4)"])
    out = capsys.readouterr()
    assert rc == 0 and "adjoint-compile report" in out.out and "error" not in out.err, out.err

@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_dump_out_that_cannot_be_a_directory_is_refused_before_the_model_runs(tmp_path, capsys, where):
    f = tmp_path / "mistakes.py"
    f.write_text(MISTAKES.replace("def make():\n", "def make():\n    raise AssertionError('the model was built')\n"))
    out = f if where == "file" else f / "sub"
    rc = cli.main(["dump", f"{f}:make", "--input", "randn(2,6,8)", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"--out {out}: " in err, err
    assert ("is a file" if where == "file" else "cannot be made") in err and "name a directory" in err


# --------------------------------------------------------------------------------------------- demo: arguments


@pytest.mark.parametrize("argv,words", [
    (["--seq-len", "0"], "--seq-len 0: must exceed 2 * --n-data = 4"),
    (["--train-len", "4"], "--train-len 4: must exceed"),
    (["--steps", "-1"], "--steps -1: must be at least 1"),
    (["--vocab", "2"], "--vocab 2: must be at least 3"),
    (["--device", "tpu"], "--device tpu: the demo runs on cpu or cuda"),
    (["--shard-size", "0"], "--shard-size 0: must be at least 1"),
    (["--lr", "0"], "--lr 0.0: must be positive"),
    (["--out", __file__], f"--out {__file__}: is a file"),
])
def test_demo_refuses_arguments_it_cannot_use_before_training(capsys, argv, words):
    from adjoint_compile import demo

    with pytest.raises(SystemExit) as info:
        demo.parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"adjoint-compile demo: error: {words}" in err, err
    assert demo.parse_args(["--device", "cuda:1", "--shard-size", "1"]).shard_size == 1


def test_demo_help_states_the_parsers_own_defaults():
    """The help text is formatted from each flag's default (one source: set_defaults changes both)."""
    from adjoint_compile import demo

    p = demo.parser()
    shown = [a for a in p._actions if a.default not in (None, argparse.SUPPRESS) and a.dest not in ("out", "help")]
    assert [a.dest for a in shown if "%(default)s" not in a.help] == []
    text = " ".join(p.format_help().split("options:")[1].split())
    assert "(default 2)" in text.split("--n-data N_DATA")[1][:60] and "(default 0.01)" in text.split("--lr LR")[1][:60]


def test_docs_cli_md_states_the_demos_real_defaults():
    from adjoint_compile import demo

    page = (EXAMPLES.parent / "docs" / "cli.md").read_text().split("## `adjoint-compile demo`")[1]
    rows = [ln.split("|")[1:3] for ln in page.splitlines() if ln.startswith("| `--")]
    defaults = {a.option_strings[0]: a.default for a in demo.parser()._actions if a.option_strings[0] != "-h"}
    documented = {}
    for flags, values in rows:
        names, vals = flags.replace("`", "").strip().split(", "), values.replace("`", "").strip().split(", ")
        documented.update(zip(names, vals if len(vals) == len(names) else [values.strip()] * len(names)))
    assert sorted(documented) == sorted(defaults)
    for flag, doc in documented.items():
        real = defaults[flag]
        if flag == "--out":
            assert doc == "out/" and str(real).rstrip("/").endswith("out")
        elif real is None:
            assert doc == "chosen", flag
        else:
            assert (float(doc) == real if isinstance(real, (int, float)) else doc == real), (flag, doc, real)
