"""``adjoint_compile.explain``: what the backend would recognize and rewrite, and why not elsewhere.

It captures the graphs exactly as ``torch.compile`` would (dynamo, with its graph breaks) and runs the backend's
recognize and lower stages on copies of them, without compiling or running anything else.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .options import Options, validate
from .regions import Region, Rejection

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GraphBreak:
    reason: str
    #: "file:line in function" of the user frame where dynamo broke the graph, when known.
    location: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """The result of :func:`explain`. ``str(report)`` is a table; :meth:`to_dict` is JSON-able."""

    regions: list[Region]
    rejections: list[Rejection]
    #: the dynamo graphs, as captured (before any rewrite).
    graphs: list[fx.GraphModule]
    graph_breaks: list[GraphBreak]
    options: Options
    #: for each region, the index of the graph it was found in.
    graph_index: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        regions = []
        for i, r in enumerate(self.regions):
            d = r.to_dict()
            d["graph"] = self.graph_index[i] if i < len(self.graph_index) else None
            regions.append(d)
        return {
            "options": self.options.to_dict(),
            "graphs": [{"index": i, "nodes": len(g.graph.nodes)} for i, g in enumerate(self.graphs)],
            "graph_breaks": [b.to_dict() for b in self.graph_breaks],
            "regions": regions,
            "rejections": [j.to_dict() for j in self.rejections],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        o = self.options
        mode = o.mode + (f" window={o.window}" if o.window else "") + (f" iterations={o.iterations}" if o.iterations is not None else "")
        lines = [
            f"adjoint-compile report: {len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s), "
            f"mode={mode}, inner={o.inner}"
        ]
        if self.regions:
            header = ("#", "graph", "kind", "source", "length", "rewrite", "group", "name", "reason")
            rows = [header]
            for i, r in enumerate(self.regions):
                g = self.graph_index[i] if i < len(self.graph_index) else ""
                grp = "" if r.group is None else str(r.group)
                rows.append((str(i), str(g), r.kind, r.source, str(r.length), r.rewrite, grp, r.name, r.reason))
            widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
            for row in rows:
                cells = [row[c].ljust(widths[c]) for c in range(len(header) - 1)] + [row[-1]]
                lines.append("  " + "  ".join(cells).rstrip())
        else:
            lines.append("  no recurrence or residual chain recognized: the model compiles with the inner compiler as is")
        if self.rejections:
            lines.append("rejected candidates:")
            lines += [f"  {j.candidate} at {j.node}: {j.reason}" for j in self.rejections]
        if self.graph_breaks:
            lines.append("graph breaks:")
            lines += [f"  {i + 1}. {b.reason}" + (f" ({b.location})" if b.location else "") for i, b in enumerate(self.graph_breaks)]
        return "\n".join(lines)

    __repr__ = __str__


def copy_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` with its own graph (node meta copied shallowly), and the old-node -> new-node map."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    return fx.GraphModule(gm, graph), val_map


def remap_region(region: Any, val_map: dict[fx.Node, fx.Node]) -> Any:
    """``region`` with every FX node it refers to (also in lists and nested dataclasses) replaced via ``val_map``."""

    def m(v: Any) -> Any:
        if isinstance(v, fx.Node):
            return val_map.get(v, v)
        if isinstance(v, list):
            return [m(x) for x in v]
        if isinstance(v, tuple):
            return tuple(m(x) for x in v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.replace(v, **{f.name: m(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init})
        return v

    return m(region)


def _graph_breaks(explain_output: Any) -> list[GraphBreak]:
    out = []
    for br in explain_output.break_reasons:
        loc = ""
        stack = getattr(br, "user_stack", None) or []
        if stack:
            f = stack[-1]
            loc = f"{f.filename}:{f.lineno} in {f.name}"
        out.append(GraphBreak(reason=str(br.reason).strip().splitlines()[0], location=loc))
    return out


def explain(model_or_fn: torch.nn.Module | Callable[..., Any], *example_inputs: Any, options: Any = None) -> Report:
    """What ``torch.compile(model_or_fn, backend="adjoint", options=options)`` would do on these inputs.

    Runs ``model_or_fn(*example_inputs)`` once under dynamo (so, like ``torch._dynamo.explain``, it resets dynamo's
    caches), then recognition and the lowering decisions on copies of the captured graphs.
    """
    from .backend import lower, recognize
    from .passes.capture import capture

    opts = validate(options)
    out = torch._dynamo.explain(model_or_fn)(*example_inputs)
    regions: list[Region] = []
    rejections: list[Rejection] = []
    graph_index: list[int] = []
    for gi, gm in enumerate(out.graphs):
        found, rejected = recognize(capture(gm, []), opts)
        if found:
            # Decide rewrites on a copy, so report.graphs stay as captured.
            gm2, val_map = copy_graph_module(gm)
            found2 = [remap_region(r, val_map) for r in found]
            lower(capture(gm2, []), found2, opts)
            for r, r2 in zip(found, found2):
                r.rewrite, r.reason, r.details = r2.rewrite, r2.reason, {**r.details, **r2.details}
        regions += found
        rejections += rejected
        graph_index += [gi] * len(found)
    return Report(regions, rejections, list(out.graphs), _graph_breaks(out), opts, graph_index)
