"""The pipeline's shape, checked on the source: stages import only earlier stages (no cycles), only the decision
step writes a region's rewrite/reason, no module is over ~500 lines, and every example's explain() output is the one
recorded in tests/golden (the restructurings must not change what users are told)."""
from __future__ import annotations

import ast
import runpy
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "adjoint_compile"

#: the pipeline's stages in order (DESIGN.md §2); a module may import its own stage or an earlier one.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "options", "regions", "timing", "inner", "ops", "loss_ops", "kernels", "kernels.*", "polyfills",
                    "polyfills.*")),
    ("analysis", ("analysis", "analysis.*")),
    ("runtime", ("runtime", "runtime.*")),
    # NB: the matchers are pure functions from a graph to typed records: capture uses the recurrence matchers to
    # find what to re-roll, recognition runs them all on the normalized graph
    ("match", ("passes", "passes.match", "passes.match.*")),
    ("capture", ("passes.capture", "passes.capture.*")),
    ("recognize", ("passes.recognize", "passes.recognize.*")),
    ("decide", ("passes.decide", "passes.decide.*")),
    ("lower", ("passes.lower", "passes.lower.*")),
    ("stitch", ("passes.stitch", "passes.stitch.*")),
    ("backend", ("backend", "lengths", "frames")),
    ("user", ("", "explain", "records", "cli", "cli_dump", "demo", "measure", "models", "models.*")),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _stage(mod: str) -> int:
    for i, (_, pats) in enumerate(STAGES):
        for pat in pats:
            if mod == pat or (pat.endswith(".*") and mod.startswith(pat[:-1])):
                return i
    raise AssertionError(f"module adjoint_compile.{mod} has no stage in tests/test_architecture.py STAGES: place it")


def _imports(mod: str, path: Path) -> set[str]:
    """Package modules that ``mod`` imports anywhere in its file (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    mods = _modules()
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] if node.level > 1 else pkg
                prefix = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                prefix = node.module or ""
                if not (prefix == "adjoint_compile" or prefix.startswith("adjoint_compile.")):
                    continue
                prefix = prefix[len("adjoint_compile"):].lstrip(".")
            names = [f"adjoint_compile.{prefix}.{a.name}".replace("..", ".").rstrip(".") for a in node.names]
            names = [n if n[len("adjoint_compile."):] in mods else f"adjoint_compile.{prefix}".rstrip(".")
                     for n in names]
        for n in names:
            if n == "adjoint_compile" or n.startswith("adjoint_compile."):
                m = n[len("adjoint_compile"):].lstrip(".")
                if m in mods and m != mod:
                    out.add(m)
    return out


def test_no_module_imports_a_later_stage_and_there_are_no_cycles():
    graph = nx.DiGraph()
    later = []
    for mod, path in _modules().items():
        graph.add_node(mod)
        for dep in _imports(mod, path):
            graph.add_edge(mod, dep)
            # NB: the package __init__ files re-export; importing a package's __init__ is importing its stage
            if _stage(dep) > _stage(mod):
                later.append(f"{mod} ({STAGES[_stage(mod)][0]}) imports {dep} ({STAGES[_stage(dep)][0]})")
    assert not later, "\n".join(later)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


def test_only_the_decision_step_writes_rewrite_and_reason():
    writers = []
    for mod, path in _modules().items():
        if mod == "passes.decide":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in ("rewrite", "reason") and not (
                            isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not writers, writers


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 520}
    assert not long, long


EXAMPLES = ["selective_ssm", "mamba_conv", "gru_scan", "pre_ln_transformer", "post_ln_transformer", "relu_resnet"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_explain_output_is_unchanged(name, capsys):
    runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name="__main__")
    # NB: the report's compile-time line (adjoint_compile/timing.py) differs from run to run
    got = "".join(line for line in capsys.readouterr().out.splitlines(True) if not line.startswith("compile time: "))
    want = (ROOT / "tests" / "golden" / f"explain_{name}.txt").read_text()
    assert got == want


def test_make_test_leaves_the_slow_tests_to_ci_which_runs_both():
    make = (ROOT / "Makefile").read_text()
    rule = lambda name: make.split(f"\n{name}: setup\n")[1].split("\n\n")[0]  # noqa: E731
    assert '-m "not slow"' in rule("test") and "-m slow" in rule("test-slow")
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci and "make test-slow" in ci


def test_the_passes_are_the_stages_in_pipeline_order():
    """passes/ holds one sub-package per stage, each with a docstring saying what it takes in and hands on, and the
    stages' order here is the order passes/__init__.py lists them in."""
    subs = sorted(p.name for p in (PKG / "passes").iterdir() if (p / "__init__.py").exists())
    stages = [name for name, _ in STAGES]
    assert set(subs) <= set(stages), subs
    doc = (PKG / "passes" / "__init__.py").read_text()
    numbered = [s for s in subs if s != "match"]  # NB: the shared matchers are listed after the numbered stages
    assert sorted(numbered, key=lambda s: doc.index(f":mod:`.{s}` —")) == [s for s in stages if s in numbered]
    assert ":mod:`.match`" in doc
    for s in subs:
        assert ast.get_docstring(ast.parse((PKG / "passes" / s / "__init__.py").read_text())), s
