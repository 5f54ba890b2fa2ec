"""The ``adjoint-compile`` command line (``adjoint-compile --help``; docs/cli.md).

    adjoint-compile explain path/to/file.py:factory --input "randn(2,1024,64)" [--input ...] [--options JSON] [--json]
    adjoint-compile dump    path/to/file.py:factory --input "randn(2,1024,64)" [--out DIR (default out/dump)]
    adjoint-compile demo    [demo arguments]

``factory`` is a function in the file that returns an ``nn.Module`` or a function (called with no arguments; a
module-level ``nn.Module`` or function is used as is). ``--input`` builds one tensor from a small, safe
expression language: ``randn(2,1024,64)``, ``rand(...)``, ``ones(...)``, ``zeros(...)``, ``randint(low, high,
(shape))`` with int arguments and an optional ``dtype=float32|float16|bfloat16|float64|int64|int32|bool``; nothing
else is evaluated. ``dump`` writes each captured FX graph as text and a picture with the recognized regions
highlighted (graphviz SVG when the ``dot`` program is installed; otherwise it says so and writes the DOT text).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import OptionsError
from .explain import Report, explain
from .options import SUMMARY, validate

log = logging.getLogger(__name__)

__all__ = ["main", "parse_input", "load_factory", "dump"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
           "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool}
DEFAULT_DUMP = os.path.join("out", "dump")
_MAKERS = {"randn": torch.randn, "rand": torch.rand, "ones": torch.ones, "zeros": torch.zeros}


def _int(node: ast.AST, expr: str) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int(node.operand, expr)
    raise ValueError(f"--input {expr!r}: expected an int, got {ast.unparse(node)!r}")


def parse_input(expr: str) -> torch.Tensor:
    """A tensor from ``randn(2,1024,64)``-style text, parsed with :mod:`ast` (no ``eval``).

    Allowed: ``randn|rand|ones|zeros(*sizes, dtype=...)`` and ``randint(low, high, (sizes), dtype=...)`` (also
    ``randint(high, (sizes))``); sizes are int literals (or one tuple/list of them). Raises ValueError naming
    ``--input`` otherwise.
    """
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"--input {expr!r} is not an expression like randn(2,1024,64): {e.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"--input {expr!r}: expected a call like randn(2,1024,64)")
    name = call.func.id
    if name not in _MAKERS and name != "randint":
        raise ValueError(f"--input {expr!r}: {name!r} is not allowed; use one of randn, rand, ones, zeros, randint")
    kw: dict[str, Any] = {}
    for k in call.keywords:
        if k.arg != "dtype":
            raise ValueError(f"--input {expr!r}: only the dtype= keyword is allowed, got {k.arg}=")
        v = k.value
        dname = v.attr if isinstance(v, ast.Attribute) else (v.id if isinstance(v, ast.Name) else
                                                             (v.value if isinstance(v, ast.Constant) else None))
        if dname not in _DTYPES:
            raise ValueError(f"--input {expr!r}: dtype must be one of {', '.join(_DTYPES)}")
        kw["dtype"] = _DTYPES[dname]

    def sizes(args: list[ast.expr]) -> list[int]:
        if len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List)):
            args = list(args[0].elts)
        out = [_int(a, expr) for a in args]
        if any(s < 0 for s in out):
            raise ValueError(f"--input {expr!r}: sizes must be >= 0")
        return out

    if name == "randint":
        args = list(call.args)
        if len(args) == 2:
            low, high, shape = 0, _int(args[0], expr), sizes([args[1]])
        elif len(args) == 3:
            low, high, shape = _int(args[0], expr), _int(args[1], expr), sizes([args[2]])
        else:
            raise ValueError(f"--input {expr!r}: randint takes (high, (sizes)) or (low, high, (sizes))")
        return torch.randint(low, high, tuple(shape), dtype=kw.get("dtype", torch.int64))
    shape = sizes(list(call.args))
    dtype = kw.get("dtype", torch.float32)
    if name in ("randn", "rand") and not dtype.is_floating_point:
        raise ValueError(f"--input {expr!r}: {name} needs a floating dtype")
    return _MAKERS[name](*shape, dtype=dtype)


def load_factory(spec: str) -> Any:
    """``path/to/file.py:factory`` -> the model or function the factory returns."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr:
        raise ValueError(f"model {spec!r}: expected path/to/file.py:factory")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"model {spec!r}: no such file {path!r}")
    mod_name = f"_adjoint_compile_user_{file.stem}"
    spec_ = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec_)
    sys.path.insert(0, str(file.resolve().parent))  # NB: let the file import its neighbours
    try:
        spec_.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.pop(0)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"model {spec!r}: {path} has no attribute {attr!r}")
    if isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return obj()
    if callable(obj):
        made = obj()
        if isinstance(made, torch.nn.Module) or callable(made):
            return made
    raise ValueError(f"model {spec!r}: {attr} must be an nn.Module or a factory returning one (or a function)")


def parse_options(text: str | None) -> dict[str, Any] | None:
    """``--options`` text -> the options dict (validated, so a bad key fails before the model is built); a
    ValueError naming ``--options`` otherwise."""
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options {text!r} is not valid JSON ({e.msg} at column {e.colno}): write a JSON object, "
                         f"e.g. --options '{{\"mode\": \"truncated\", \"window\": 256}}' (double quotes, lowercase "
                         f"true/false)") from None
    if not isinstance(options, dict):
        raise ValueError(f"--options {text!r}: expected a JSON object of the backend's options, e.g. "
                         f"'{{\"shard_size\": 256}}', got {type(options).__name__}")
    try:
        validate(options)
    except OptionsError as e:
        raise ValueError(f"--options: {e}") from None
    return options


def _required_inputs(model: Any) -> list[str] | None:
    """The names of the positional arguments the model needs (None when its signature cannot be read)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _most_inputs(model: Any) -> int | None:
    """How many positional arguments the model takes at most (None: unbounded or unreadable)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _report(args: argparse.Namespace) -> Report:
    options = parse_options(args.options)
    torch.manual_seed(args.seed)
    model = load_factory(args.model)
    inputs = [parse_input(s) for s in args.input]
    need = _required_inputs(model)
    most = _most_inputs(model)
    if most is not None and len(inputs) > most:
        raise ValueError(f"too many --input: {args.model} takes at most {most} input(s) and got {len(inputs)}; give "
                         f"one --input per argument, in order")
    if need is not None and len(inputs) < len(need):
        given = f"got {len(inputs)} --input" if inputs else "no --input was given"
        raise ValueError(f"missing --input: {args.model} takes {len(need)} input(s) ({', '.join(need)}) and "
                         f"{given}; give one --input per argument, in order, e.g. --input \"randn(2,1024,64)\" "
                         f"(shape [batch, time, features]) or --input \"randint(0, 32, (2, 512))\" (token ids)")
    return explain(model, *inputs, options=options)


# ----------------------------------------------------------------------------------------------------------------
# dump


_PALETTE = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f6bd60", "#84a59d", "#bde0fe"]
_GREY, _LIGHT = "#d9d9d9", "#eeeeee"


def short_name(n: torch.fx.Node) -> str:
    """A placeholder's parameter path as the model names it: dynamo's
    ``L_self_modules_layers_modules_0_modules_in_proj_parameters_weight_`` -> ``layers.0.in_proj.weight``
    (``L_x_`` -> ``x``); any other node keeps its FX name."""
    t = str(n.target)
    if n.op != "placeholder" or not re.match(r"[LG]_.", t):
        return n.name
    t = t[2:].removesuffix("_")
    t = re.sub(r"^self_(?=(modules|parameters|buffers)_)", "", t)
    t = re.sub(r"(^|_)(modules|parameters|buffers)_", lambda m: "." if m.group(1) else "", t)
    return t or n.name


@dataclasses.dataclass
class _Region:
    """One box of the picture: a sharded call (the report rows lowered into it) or one report row."""

    key: str
    title: str
    colour: str
    rows: list[int]
    nodes: set[str] = dataclasses.field(default_factory=set)


def _highlight(report: Any) -> tuple[list[dict[str, tuple[str, str, str]]], list[list[_Region]]]:
    """Per graph: node name -> (fill colour, label, box key) of the region drawn on the node, and the boxes.

    Labels name the report's rows: a scan node its own row (``#0 linear_recurrence (linear_scan)``), a node that a
    sharded call took in the call and every row lowered into it (``adjoint_region_0: #0, #1``). A node can sit in
    several regions (a scan inside a residual chain): rewritten regions are drawn on top of the ones left to ordinary
    autograd (grey), so what the backend rewrote is what the picture shows; each node is in one box, its top one."""
    marks: list[dict[str, tuple[str, str, str]]] = [{} for _ in report.graphs]
    boxes: list[dict[str, _Region]] = [{} for _ in report.graphs]

    def graph(i: int) -> int:
        return report.graph_index[i] if i < len(report.graph_index) else 0

    for i, r in enumerate(report.regions):  # NB: neighbourhoods first: everything else is drawn over them
        for n in getattr(r, "neighbourhood", []) or []:
            marks[graph(i)].setdefault(n.name, (_LIGHT, f"#{i} time-local", ""))
    calls: dict[tuple[int, str], list[int]] = {}
    for i, r in enumerate(report.regions):
        if r.rewrite != "none" and r.details.get("region_call"):
            calls.setdefault((graph(i), r.details["region_call"]), []).append(i)
    # NB: painted in this order, later over earlier: regions not rewritten, then what sharded calls took in, then the
    # rewritten rows' own nodes (their scans)
    order = sorted(range(len(report.regions)), key=lambda i: report.regions[i].rewrite != "none")
    for layer in ("none", "members", "own"):
        for i in order:
            r, gi = report.regions[i], graph(i)
            call = r.details.get("region_call") if r.rewrite != "none" else None
            if (layer == "none") != (r.rewrite == "none"):
                continue
            rows = calls.get((gi, call), [i]) if call else [i]
            colour = _PALETTE[min(rows) % len(_PALETTE)] if call else _GREY
            key = call or f"row{i}"
            if key not in boxes[gi]:
                what = "; ".join(f"#{j} {report.regions[j].kind} {report.regions[j].name}" for j in rows)
                title = (f"{call} (rewrite {r.rewrite}): {what}" if call else
                         f"#{i} {r.kind} ({r.source}) {r.name}: rewrite {r.rewrite}")
                boxes[gi][key] = _Region(key, title, colour, rows)
            own = f"#{i} {r.kind} ({r.source})\nrewrite {r.rewrite}" + (f" in {call}" if call else "")
            # NB: a sharded call takes in the time-local ops around its scans (details["members"]), not only r.nodes:
            # those belong to every row lowered into the call; a row's own nodes (its scan) to the row
            if layer == "members" and not call:
                continue
            if layer == "members":
                names, tag = list(r.details.get("members", ())), f"{call}: rows {', '.join(f'#{j}' for j in rows)}"
                tag += f"\nrewrite {r.rewrite}"
            else:
                names, tag = [n.name for n in r.nodes] + list(r.details.get("members", ()) if not call else ()), own
            for name in names:
                marks[gi][name] = (colour, tag, key)
    for gi, mk in enumerate(marks):
        for name, (_, _, key) in mk.items():
            if key:
                boxes[gi][key].nodes.add(name)
    return marks, [sorted(b.values(), key=lambda x: min(x.rows)) for b in boxes]


def _q(s: str) -> str:
    # NB: backslashes escaped first, then newlines written as DOT's own line break (\n in the file)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _legend(boxes: Sequence[_Region]) -> list[str]:
    """A box of coloured swatches: one per region (its report rows), and what grey, light grey, white mean."""
    items = [(b.colour, b.title + ("" if b.nodes else " (all its nodes are drawn in the boxes above)"))
             for b in boxes]
    items += [(_GREY, "grey: a region left to ordinary autograd"), (_LIGHT, "light grey: time-local ops next to a "
              "region, not taken in"), ("white", "white: outside every region")]
    lines = ["  subgraph cluster_legend {", f"    label={_q('legend (report rows: adjoint_compile.report / explain)')};",
             '    style="dashed"; node [shape=box, style=filled];']
    for k, (colour, text) in enumerate(items):
        lines.append(f"    legend_{k} [label={_q(text)}, fillcolor={_q(colour)}];")
    lines += [f"    legend_{k} -> legend_{k + 1} [style=invis];" for k in range(len(items) - 1)]
    return lines + ["  }"]


def _dot(gm: torch.fx.GraphModule, marks: dict[str, tuple[str, str, str]], title: str,
         boxes: Sequence[_Region] = ()) -> str:
    lines = [f"digraph {_q(title)} {{", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fillcolor=white,'
             ' fontname="Helvetica", fontsize=10];', f"  label={_q(title)};"]
    by_box: dict[str, list[str]] = {}
    edges = []
    for n in gm.graph.nodes:
        what = n.op if n.op in ("placeholder", "output", "get_attr") else (
            str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target)))
        colour, tag, key = marks.get(n.name, ("white", "", ""))
        label = f"{short_name(n)}\n{what}" + (f"\n{tag}" if tag else "")
        by_box.setdefault(key, []).append(f"{_q(n.name)} [label={_q(label)}, fillcolor={_q(colour)}];")
        edges += [f"  {_q(a.name)} -> {_q(n.name)};" for a in n.all_input_nodes]
    lines += [f"  {ln}" for ln in by_box.pop("", [])]
    for k, b in enumerate(x for x in boxes if x.nodes):  # NB: one cluster box per region, titled by its rows
        lines += [f"  subgraph cluster_{k} {{", f"    label={_q(b.title)};", f"    color={_q(b.colour)};",
                  "    penwidth=2;", *(f"    {ln}" for ln in by_box.pop(b.key, []))] + ["  }"]
    lines += [f"  {ln}" for rest in by_box.values() for ln in rest]
    lines += edges + _legend(boxes) + ["}"]
    return "\n".join(lines)


def _render_svg(dot: str) -> tuple[bytes | None, str]:
    """The SVG of ``dot`` (graphviz's Python package if installed, else its ``dot`` program), or None and why."""
    try:
        import graphviz  # the optional extra: pip install "adjoint-compile[graphviz]"
    except ImportError:
        graphviz = None
    if graphviz is not None:
        try:
            return graphviz.Source(dot).pipe(format="svg"), ""
        except Exception as e:  # noqa: BLE001 - graphviz.ExecutableNotFound and rendering errors alike
            return None, f"graphviz could not render ({type(e).__name__}: {e})"
    exe = shutil.which("dot")
    if exe is None:
        return None, "graphviz is not installed"
    try:
        return subprocess.run([exe, "-Tsvg"], input=dot.encode(), check=True, timeout=120,
                              capture_output=True).stdout, ""
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"dot failed ({e})"


def dump(report: Any, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write report.txt, report.json, and per graph graph_<i>.txt (FX code and node table) and graph_<i>.svg
    (or graph_<i>.dot when graphviz's ``dot`` is missing). Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    (out / "report.txt").write_text(str(report) + "\n")
    (out / "report.json").write_text(report.to_json(indent=1, default=str) + "\n")
    written += [out / "report.txt", out / "report.json"]
    marks, boxes = _highlight(report)
    missing = ""
    for i, gm in enumerate(report.graphs):
        table = [(f"{n.name:30s} {n.op:14s} {marks[i].get(n.name, ('', '', ''))[1]}".replace("\n", ", ")
                  + (f"  ({short_name(n)})" if short_name(n) != n.name else "")) for n in gm.graph.nodes]
        txt = out / f"graph_{i}.txt"
        txt.write_text(gm.code + "\n# nodes (name, op, region: report row(s); parameter path)\n" + "\n".join(table)
                       + "\n")
        written.append(txt)
        dot = _dot(gm, marks[i], f"graph {i}", boxes[i])
        svg, missing = _render_svg(dot)
        if svg is not None:
            (out / f"graph_{i}.svg").write_bytes(svg)
            written.append(out / f"graph_{i}.svg")
            continue
        path = out / f"graph_{i}.dot"
        path.write_text(dot + "\n")
        written.append(path)
    if missing:
        print(f"note: {missing}: wrote the graph pictures as DOT text (graph_<i>.dot). For SVG pictures install "
              f"graphviz: pip install \"adjoint-compile[graphviz]\" and the dot program (apt-get install graphviz, "
              f"brew install graphviz, conda install graphviz); or render one with `dot -Tsvg graph_0.dot -o "
              f"graph_0.svg`", file=sys.stderr)
    return written


# ----------------------------------------------------------------------------------------------------------------


DESCRIPTION = """\
adjoint-compile: see what the torch.compile backend "adjoint" does with your model, and run its demo.

  explain  print what the backend recognizes in a model (recurrences, scans, residual chains), how it rewrites each
           one, and why not elsewhere
  dump     the same, plus each captured FX graph as text and a picture with the regions coloured
  demo     train a small selective SSM on a long-context copying task with backend="adjoint", then measure one
           training step four ways (eager, torch.compile, checkpointing, adjoint)

The model is path/to/file.py:factory, where factory is a function (or nn.Module class) in that file returning an
nn.Module or a function, or a module-level nn.Module. --input builds an example input from a small safe expression:
randn(2,1024,64), rand(...), ones(...), zeros(...), randint(low, high, (shape)), with an optional
dtype=float32|float16|bfloat16|float64|int64|int32|bool (repeat --input for several inputs)."""

EPILOG = """\
examples:
  adjoint-compile explain examples/selective_ssm.py:make --input "randn(2,2048,16)"
  adjoint-compile explain examples/gru_scan.py:make --input "randn(2,64,8)" --options '{"mode": "highway", "iterations": 2}'
  adjoint-compile dump examples/mamba_conv.py:make --input "randn(2,512,16)" --out out/dump
  adjoint-compile demo --seq-len 1024 --steps 50

--options takes the backend's options as a JSON object, the dict of torch.compile(..., backend="adjoint",
options={...}) (a bad key or value exits with status 2 and names it):
""" + "\n".join(f"  {k:18s} {v}" for k, v in SUMMARY.items())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adjoint-compile", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{explain,dump,demo}")
    for name, help_ in (("explain", "print what the backend recognizes and how it would rewrite it"),
                        ("dump", "write the report and each FX graph as text and a picture (SVG with graphviz, "
                                 "else DOT text) with the regions coloured")):
        s = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        s.add_argument("model", help="path/to/file.py:factory (a function or nn.Module class returning the model, "
                                     "or a module-level nn.Module)")
        s.add_argument("--input", action="append", default=[], metavar="EXPR",
                       help='an example input, e.g. "randn(2,1024,64)" or "randint(0, 32, (2, 512))" (repeat for '
                            'several, in the order the model takes them)')
        s.add_argument("--options", default=None, metavar="JSON",
                       help='backend options as JSON, e.g. \'{"mode": "truncated", "window": 256}\' (default: exact '
                            'mode, shard size chosen automatically; every key: adjoint-compile --help)')
        s.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model (default 0)")
        if name == "explain":
            s.add_argument("--json", action="store_true", help="print report.to_dict() as JSON instead of the table")
        else:
            s.add_argument("--out", default=DEFAULT_DUMP, metavar="DIR",
                           help=f"output directory (default {DEFAULT_DUMP}; out/ is ignored by git in a checkout)")
    # NB: its arguments are the demo's own parser's (adjoint_compile/demo.py): `adjoint-compile demo --help`
    sub.add_parser("demo", help="train the demo model and compare one step four ways (demo --help for its flags)",
                   add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo  # NB: on demand: the demo pulls in matplotlib and the benchmark helpers

        return int(demo.main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        report = _report(args)
    except ValueError as e:  # NB: OptionsError and bad --input/--options/model alike: a message, not a traceback
        print(f"adjoint-compile {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "explain":
        print(report.to_json(indent=1, default=str) if args.json else report)
        return 0
    files = dump(report, args.out)
    print(report)
    print(f"wrote {len(files)} file(s) to {args.out}: " + ", ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
