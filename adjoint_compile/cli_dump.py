"""``adjoint-compile dump``'s files: the report, and each captured FX graph as text and as a picture (graphviz SVG, or
DOT text without graphviz) with the recognized regions boxed and coloured by their report rows (docs/cli.md)."""
from __future__ import annotations

import dataclasses
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

log = logging.getLogger(__name__)

__all__ = ["dump", "short_name"]

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
