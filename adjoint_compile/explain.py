"""What the backend recognized and rewrote, and why not elsewhere: :func:`explain` before compiling,
:func:`report` after.

* ``explain(model, *inputs)`` captures the graphs exactly as ``torch.compile`` would (dynamo, with its graph breaks)
  and runs the backend's pipeline on copies of them up to lowering, without compiling or running anything else;
* ``report(compiled)`` reads the records the backend kept on the callables it gave dynamo for a
  ``torch.compile(..., backend="adjoint")`` result.

Both build a :class:`Report` from the same :class:`~adjoint_compile.backend.CompiledGraph` records, so the regions
they show are exactly the ones that were lowered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from . import polyfills, timing
from .analysis.breaks import (RNN_WORDS, SMALL_GRAPH_NODES, Break, at_frame, backend_name, break_of, collect_skips,
                              notes_here, notes_of, options_given, skipped_in)
from .polyfills import torch_rnn
from .polyfills.torch_rnn import take_notes as rnn_notes
from .backend import CompiledGraph, run_pipeline
from .options import Options, validate
from .records import compiled_graphs, declared_options, root_frames
from .regions import Fallback, Region, Rejection, group_rejections, rejection_lines
from .analysis.optable import draws_random
from .runtime.verify import DRAWS_RANDOM, compare_grads, copy_graph_module, grads_of, modules_of, parameters_of

log = logging.getLogger(__name__)


#: the line under the table that says what its ``group`` column means (passes/decide/ ``settle``)
GROUP_LEGEND = ("  group: lowered regions with the same number run in one sharded call (not lowered: recurrences "
                "whose time-local neighbourhoods join); blank: alone")


@dataclasses.dataclass
class GraphBreak:
    reason: str
    #: "file:line in function" of the user frame where dynamo broke the graph, when known.
    location: str = ""
    #: the source line there (stripped), when known.
    code: str = ""
    #: the function dynamo ran eagerly, without a graph, because of this break (one inside its loop), when any:
    #: "name (file:line)".
    frame: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def remedy(self) -> str:
        """How to remove this break (analysis/breaks.py's ``Break.remedy``)."""
        return Break(self.reason, self.location, self.code).remedy()


@dataclasses.dataclass
class Report:
    """The result of :func:`explain`. ``str(report)`` is a table; :meth:`to_dict` is JSON-able."""

    regions: list[Region]
    rejections: list[Rejection]
    #: the dynamo graphs: as captured (explain), or as the backend left them (report: normalized and lowered).
    graphs: list[fx.GraphModule]
    graph_breaks: list[GraphBreak]
    options: Options
    #: for each region, the index of the graph it was found in.
    graph_index: list[int] = dataclasses.field(default_factory=list)
    #: the pipeline's record of each graph, in the order of ``graphs``.
    compiled: list[CompiledGraph] = dataclasses.field(default_factory=list, repr=False)
    #: with ``verify=True``: all gradients against plain autograd (runtime/verify.py's ``compare_grads``:
    #: ``grad_rel_err`` = ‖g − g_exact‖ / ‖g_exact‖ over all of them, ``grad_cosine``, ``worst`` and its
    #: ``worst_rel_err``). ``explain``: the whole model (every parameter and float input) against eager;
    #: ``report``: the graph's first call against its captured graph, when exactly one graph has these figures
    #: (else see ``compiled[i].fidelity``). ``{"skipped": why}`` where the graph draws random numbers (dropout).
    fidelity: dict[str, Any] | None = None
    #: when no graph is listed and it is known why (the model was compiled with another backend, or dynamo's caches
    #: were reset since its calls): that, in words.
    no_graph: str = ""

    @classmethod
    def of(cls, compiled: list[CompiledGraph], options: Options, graph_breaks: list[GraphBreak] | None = None,
           graphs: list[fx.GraphModule] | None = None) -> "Report":
        """The report of these pipeline records (``graphs``: what to show as each one's graph)."""
        regions = [r for c in compiled for r in c.regions]
        index = [i for i, c in enumerate(compiled) for _ in c.regions]
        figures = [c.fidelity for c in compiled if c.fidelity is not None]
        return cls(regions, [j for c in compiled for j in c.rejections],
                   graphs if graphs is not None else [c.captured.gm for c in compiled], list(graph_breaks or []),
                   options, index, list(compiled), figures[0] if len(figures) == 1 else None)

    @property
    def fallbacks(self) -> list[Fallback]:
        """Calls of the compiled graphs that ran with ordinary autograd although the graph had a rewrite (a
        first-call check that found a difference, a length too short to shard, ...), each with cause and remedy."""
        return [f for c in self.compiled for f in c.fallbacks]

    def to_dict(self) -> dict[str, Any]:
        regions = []
        for i, r in enumerate(self.regions):
            d = r.to_dict()
            d["graph"] = self.graph_index[i] if i < len(self.graph_index) else None
            if (seen := self._lengths(i)) is not None and r.rewrite != "none":
                d["lengths"] = seen
            regions.append(d)
        return {
            "options": self.options.to_dict(),
            "graphs": [{"index": i, "nodes": len(g.graph.nodes),
                        "normalized": self.compiled[i].captured.normalized if i < len(self.compiled) else {},
                        **({"fidelity": self.compiled[i].fidelity}
                           if i < len(self.compiled) and self.compiled[i].fidelity is not None else {}),
                        **({"timing": dict(self.compiled[i].timing)} if i < len(self.compiled) else {})}
                       for i, g in enumerate(self.graphs)],
            "graph_breaks": [b.to_dict() for b in self.graph_breaks],
            **({"no_graph": self.no_graph} if self.no_graph else {}),
            "regions": regions,
            "rejections": [j.to_dict() for j in self.rejections],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            **({"fidelity": self.fidelity} if self.fidelity is not None else {}),
        }

    def _lengths(self, i: int) -> list[int] | None:
        """The lengths region ``i`` has run at, when its graph serves every length (else None)."""
        g = self.graph_index[i] if i < len(self.graph_index) else None
        seen = self.compiled[g].lengths if g is not None and g < len(self.compiled) else None
        return None if seen is None else sorted(seen)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        return self.text()

    def grouped_rejections(self) -> list[tuple[str, str, list[str]]]:
        """Rejections grouped by candidate and reason (reasons that differ only in the nodes they name are one
        group, shown by its first): (candidate, reason, nodes), largest group first (regions.group_rejections)."""
        return group_rejections(self.rejections, (n.name for g in self.graphs for n in g.graph.nodes))

    def text(self, verbose: bool = False) -> str:
        """The table; rejected residual-chain candidates grouped by reason (one line per reason with a count and a
        few locations) unless ``verbose``, which lists every rejection (as ``report.rejections`` does)."""
        o = self.options
        mode = (o.mode + (f" window={o.window}" if o.window else "")
                + (f" iterations={o.iterations}" if o.iterations is not None else ""))
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
                length, reason = str(r.length), r.reason
                if (seen := self._lengths(i)) is not None and r.rewrite != "none":
                    # NB: lowered at one length, run at every one: the row says which have run
                    length = f"{seen[0]}..{seen[-1]}" if len(seen) > 1 else length
                    reason += (f"; serves every length ({len(seen)} so far: {_listed(seen)}), each cut into "
                               f"power-of-two shards of the same programs")
                rows.append((str(i), str(g), r.kind, r.source, length, r.rewrite, grp, r.name, reason))
            widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
            for row in rows:
                cells = [row[c].ljust(widths[c]) for c in range(len(header) - 1)] + [row[-1]]
                lines.append("  " + "  ".join(cells).rstrip())
            lines.append(GROUP_LEGEND)
        elif not self.graphs and (eager := list(dict.fromkeys(b.frame for b in self.graph_breaks if b.frame))):
            lines.append(f"  no graph compiled: dynamo ran {', '.join(eager)} eagerly, without a graph, because of the "
                         f"graph break below: ordinary autograd, nothing rewritten, no memory saved")
        elif not self.graphs and self.no_graph:
            lines.append(f"  no graph compiled: {self.no_graph}")
        elif not self.graphs and not self.graph_breaks:
            lines.append("  no graph compiled: the compiled model has not been called yet, its calls held no tensor "
                         "ops, or dynamo ran them without a graph (as it runs torch's nn.RNN, nn.LSTM and nn.GRU "
                         "where mode='highway' does not decompose them)")
        else:
            lines.append("  no recurrence or residual chain recognized: the model compiles with the inner compiler "
                         "as is")
        if self.rejections and verbose:
            lines.append("rejected candidates:")
            lines += [f"  {j.candidate} at {j.node}: {j.reason}" for j in self.rejections]
        elif self.rejections:
            lines.append("rejected candidates:")
            groups = self.grouped_rejections()
            lines += [f"  {line}" for line in rejection_lines(groups)]
            if any(len(w) > 1 for _, _, w in groups):
                lines.append("  (rejections grouped by reason; report.text(verbose=True) or report.rejections "
                             "lists each)")
        if self.graph_breaks:
            lines += self._break_lines()
        uses = [u for c in self.compiled if c.per_sample is not None for u in c.per_sample.uses]
        if self.options.per_sample_clip is not None:
            lines += _per_sample_lines(uses, self.options.per_sample_clip)
        if self.fallbacks:
            lines.append("fallbacks (calls that ran with ordinary autograd although the graph had a rewrite):")
            lines += [f"  {i + 1}. {f.cause}; {f.remedy}" + (f" (sizes so far: {_listed(f.details['sizes'])})"
                                                           if f.details.get("sizes") else "")
                      for i, f in enumerate(self.fallbacks)]
        if self.fidelity is not None:
            f = self.fidelity
            lines.append(f"fidelity: not compared: {f['skipped']}" if "skipped" in f else
                         f"fidelity (all gradients against plain autograd): relative error {f['grad_rel_err']:.3g}, "
                         f"cosine {f['grad_cosine']:.6g}; worst {f['worst']} ({f['worst_rel_err']:.3g})"
                         if f.get("tensors", 1) else f"fidelity: nothing compared: {NOTHING_COMPARED}")
        if (spent := timing.summary([c.timing for c in self.compiled])) is not None:
            lines.append(f"compile time: {spent}")  # NB: adjoint_compile/timing.py; seconds, all graphs together
        return "\n".join(lines)

    __repr__ = __str__

    def _break_lines(self) -> list[str]:
        """The breaks, one line per place and reason (with how many graphs broke there), and how many small graphs
        with nothing recognized lie between them."""
        seen: dict[tuple[str, str, str, str], int] = {}
        for b in self.graph_breaks:
            key = (b.reason, b.location, b.code, b.frame)
            seen[key] = seen.get(key, 0) + 1
        lines = ["graph breaks:"]
        for i, ((why, where, code, frame), k) in enumerate(seen.items()):
            at = where + (f": `{code}`" if code and where else "")
            eager = (f"; dynamo does not resume after it, so it ran {frame} eagerly, without a graph (nothing in it "
                     f"rewritten)" if frame else "")
            lines.append(f"  {i + 1}. {why}" + (f" ({at})" if at else "") + (f" x{k}" if k > 1 else "") + eager)
        small = [len(g.graph.nodes) for i, g in enumerate(self.graphs)
                 if i < len(self.compiled) and not self.compiled[i].regions and len(g.graph.nodes) <= SMALL_GRAPH_NODES]
        if len(small) > 1:
            lines.append(f"  {len(small)} graphs of <= {max(small)} nodes with nothing recognized, split by these "
                         f"breaks: a recurrence split by a break cannot be rewritten; remove the break "
                         f"({self.graph_breaks[0].remedy() if self.graph_breaks else 'TORCH_LOGS=graph_breaks'})")
        return lines


def _per_sample_lines(uses: list[dict[str, Any]], clip: float) -> list[str]:
    from .passes.decide import mib

    extra = sum(u.get("extra_bytes", 0) for u in uses)
    out = [f"per-example gradients (per_sample_clip={clip:g}): {len(uses)} parameter use(s), one backward; "
           f"per-example gradient tensors: {mib(extra)}"]
    for u in uses:
        mem = f", +{mib(u['extra_bytes'])}" if u.get("extra_bytes") else ""
        shape = f" T={u['steps']} {u['d_in']}->{u['d_out']}" if "steps" in u else ""
        out.append(f"  {u['node']}: {u['kind']} of {', '.join(u['params'])}:{shape} {u.get('form', '')}{mem}")
    return out


def _graph_breaks(explain_output: Any) -> list[GraphBreak]:
    out = []
    for br in explain_output.break_reasons:
        stack = getattr(br, "user_stack", None) or []
        b = at_frame(br.reason, stack[-1] if stack else None)
        out.append(GraphBreak(reason=b.reason, location=b.location, code=b.code))
    return out


def _with_skips(breaks: list[GraphBreak], skipped: list[Break]) -> list[GraphBreak]:
    """``breaks`` with the frames dynamo ran without a graph: each on the break at its line (a break in the loop of a
    function that a compiled frame calls ends that frame's graph there too), else as a break of its own."""
    for s in skipped:
        # NB: a torch nn.GRU / nn.LSTM also has its own note (polyfills/torch_rnn.py), with no location
        same = [b for b in breaks if s.location and b.location == s.location
                or s.reason.startswith(RNN_WORDS) and not b.location and "runs natively" in b.reason]
        for b in same:
            b.frame = b.frame or s.frame
        if not same:
            breaks.append(GraphBreak(s.reason, s.location, s.code, s.frame))
    return breaks


def explain(model_or_fn: torch.nn.Module | Callable[..., Any], *example_inputs: Any, options: Any = None) -> Report:
    """What ``torch.compile(model_or_fn, backend="adjoint", options=options)`` would do on these inputs.

    Runs ``model_or_fn(*example_inputs)`` once under dynamo (so, like ``torch._dynamo.explain``, it resets dynamo's
    caches), then the backend's pipeline up to lowering on copies of the captured graphs; ``report.graphs`` are the
    graphs as captured.

    With ``options={"verify": True}`` it also compiles the model with ``backend="adjoint"`` and runs it once on the
    inputs, so that each lowered region compares its gradients with exact autograd (:func:`report`); those figures
    are then in the region's ``details["fidelity"]``, and ``report.fidelity`` compares all the gradients of one
    backend run with one eager run (the same cotangents).
    """
    opts = validate(options)
    # NB: what torch.compile returned is explained as the model it wraps: traced again, as this backend would
    for wrapped in ("_orig_mod", "_torchdynamo_orig_callable"):
        model_or_fn = getattr(model_or_fn, wrapped, model_or_fn)
    polyfills.install()
    rnn_notes()  # NB: only this trace's
    with _state_kept(model_or_fn):
        # NB: dynamo's explain backend is not ours; trace as backend="adjoint" would (which also compiles a frame
        # around a callable whose own loops roll, polyfills/loop_install.py)
        with polyfills.enabled(opts.mode, opts.roll_loops), collect_skips() as skipped:
            out = torch._dynamo.explain(model_or_fn)(*example_inputs)
        compiled = [run_pipeline(copy_graph_module(gm), [], opts, compile=False) for gm in out.graphs]
        breaks = _with_skips(_graph_breaks(out) + [GraphBreak(reason=why) for why in rnn_notes()], skipped)
        rep = Report.of(compiled, opts, breaks, list(out.graphs))
        if opts.verify:
            _verify(rep, model_or_fn, example_inputs, options)
    return rep


@contextlib.contextmanager
def _state_kept(model_or_fn: Any) -> Iterator[None]:
    """The model's buffers (BatchNorm's running statistics and count, a counter) and the random number generators
    as they were before: explaining runs the model (verify: three times more), and is not a training step."""
    # NB: by owner and name: a buffer replaced rather than written (``self.steps = self.steps + 1``) is put back
    bufs = [(sub, name, b, b.detach().clone()) for m in modules_of(model_or_fn).values() for sub in m.modules()
            for name, b in sub.named_buffers(recurse=False) if b is not None]
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    cpu = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for sub, name, b, was in bufs:
                b.copy_(was)
                if getattr(sub, name, None) is not b:
                    setattr(sub, name, b)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


#: verify=True found no gradient to compare
NOTHING_COMPARED = ("no input is a floating-point tensor and no parameter was found (explain() reads them from an "
                    "nn.Module, or from the modules a function's closure or globals hold): pass the model itself")


def _verify(rep: Report, model_or_fn: Any, example_inputs: tuple, options: Any) -> None:
    """Run the model once with backend="adjoint" (verify on) and once eagerly, with the same loss; copy each region's
    figures into ``rep`` and put the whole model's into ``rep.fidelity``."""
    torch._dynamo.reset()
    fn = torch.compile(model_or_fn, backend="adjoint", options=dict(options))
    params = parameters_of(model_or_fn)
    got = _all_grads(fn, params, example_inputs)
    ran = report(fn)
    figures = {(ran.graph_index[i], r.name): r.details["fidelity"] for i, r in enumerate(ran.regions)
               if "fidelity" in r.details}
    for i, r in enumerate(rep.regions):
        if (rep.graph_index[i], r.name) in figures:
            r.details["fidelity"] = dict(figures[rep.graph_index[i], r.name])
    torch._dynamo.reset()
    if any(draws_random(n) for gm in rep.graphs for n in gm.graph.nodes):
        rep.fidelity = {"skipped": DRAWS_RANDOM}
        log.warning("adjoint-compile verify: the model's gradients not compared with eager autograd's: %s",
                    DRAWS_RANDOM)
        return
    rep.fidelity = compare_grads(got, _all_grads(model_or_fn, params, example_inputs))
    if not rep.fidelity["tensors"]:
        log.warning("adjoint-compile verify: nothing compared: %s", NOTHING_COMPARED)
    log.info("adjoint-compile verify: all gradients against eager autograd: %s", rep.fidelity)


def _all_grads(run: Callable[..., Any], params: dict[str, torch.Tensor], example_inputs: tuple) -> dict[str, Any]:
    """Gradients w.r.t. every parameter and floating-point input (runtime.verify.grads_of's cotangents)."""
    xs = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
          for x in example_inputs]
    named = {**{f"input {i}": x for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.requires_grad},
             **{n: p for n, p in params.items() if p.requires_grad}}
    return grads_of(run, xs, named)


def report(compiled_model: Any) -> Report:
    """What ``backend="adjoint"`` did for ``compiled_model`` (a ``torch.compile`` result) in the calls made so far.

    One entry per graph dynamo compiled for it (graph breaks, recompiles for new sizes, and the per-size
    specializations of a graph with symbolic sizes), oldest first; ``report.compiled[i]`` is the pipeline's record
    (captured graph, regions, rejections, lowered region calls). Empty before the first call. That includes graphs on
    other code objects than the model's (a nested function that breaks, a frame dynamo skipped after a break in a
    loop and the functions it calls): the backend notes every frame a ``torch.compile`` call compiled
    (analysis/breaks.py). ``report.graph_breaks`` lists the break that ended each graph, and the break that made
    dynamo run a frame without any graph (``GraphBreak.frame``: one inside a loop, where dynamo cannot resume).

    NB: dynamo keeps its compiled graphs per code object, and instances of one class share them (parameters are
    graph inputs): for a module this lists the graphs compiled for it and those compiled for another instance that
    its calls ran.

    With ``options={"verify": True}``, each region whose sharded call has run has ``details["fidelity"]``: the
    figures of the comparison with plain autograd on its first call (``runtime.sharded.region_fidelity``:
    ``max_rel_err``, ``grad_rel_err``, ``grad_cosine``, ``output_max_rel_err``, ``shard_size``, ``steps``,
    ``window``).

    Raises TypeError when ``compiled_model`` is not the result of ``torch.compile``.
    """
    found = sorted(compiled_graphs(compiled_model), key=lambda c: c.seq)
    flat: list[CompiledGraph] = []
    for c in found:
        flat += [c, *c.specializations]
    for c in flat:
        _fidelity(c)
    opts = next((c.options for c in flat if c.options is not None), None) or declared_options(compiled_model) or validate(None)
    breaks = [GraphBreak(b.reason, b.location, b.code) for c in found if (b := break_of(c.captured.gm)) is not None]
    # NB: an nn.GRU / nn.LSTM left native is a break dynamo does not record on a graph (explain() lists it too)
    notes = notes_of(compiled_model)
    breaks += [GraphBreak(why) for why in (_RNN_NOTES.get(notes, ()) if notes is not None else ())
               if not any(why in b.reason for b in breaks)]
    # NB: a frame dynamo skipped (a break in its loop) has no graph; its break is on no graph either
    codes = [code for code, _ in root_frames(compiled_model) + (notes.live_frames() if notes is not None else [])]
    rep = Report.of(flat, opts, _with_skips(breaks, skipped_in(codes)) + _ddp_splits(flat))
    if not flat:
        rep.no_graph = _no_graph(compiled_model, notes)
    return rep


def _no_graph(compiled_model: Any, notes: Any) -> str:
    """Why ``report()`` lists no graph, when that is known ("" when not)."""
    other = backend_name(compiled_model)
    if other not in (None, "adjoint"):
        return (f"the model was compiled with backend={other!r}, not backend='adjoint': adjoint_compile.report lists "
                f"only what torch.compile(..., backend='adjoint') compiled")
    if notes is not None and notes.frames:
        return ("dynamo's caches were reset after the compiled model's calls (torch._dynamo.reset(), which "
                "adjoint_compile.explain() also runs), and what they compiled is gone with them; its next call "
                "compiles again, and report() then lists that")
    return ""


#: per torch.compile call (analysis.breaks.CompileNotes): the nn.GRU / nn.LSTM left native while tracing for it
_RNN_NOTES: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()


def _keep_rnn_note(why: str) -> bool:
    """polyfills.torch_rnn's listener: keep ``why`` for report(); whether it is new to this torch.compile call."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        notes = notes_here(InstructionTranslator.current_tx())
    except Exception:  # noqa: BLE001 - not under a dynamo compile
        return True
    seen = _RNN_NOTES.setdefault(notes, []) if notes is not None else None
    if seen is None or why not in seen:
        if seen is not None:
            seen.append(why)
        return True
    return False


torch_rnn.LISTENERS.append(_keep_rnn_note)


def _ddp_splits(flat: list[CompiledGraph]) -> list[GraphBreak]:
    """One graph break per piece after the first of a graph DDPOptimizer split at DDP's gradient buckets (it marks
    each piece it hands to the backend with its ``compile_subgraph_reason``)."""
    pieces = [c for c in flat if "DDPOptimizer" in str(getattr(c.captured.gm, "compile_subgraph_reason", ""))]
    return [GraphBreak(reason=f"DDPOptimizer split the graph at a DistributedDataParallel gradient bucket boundary "
                              f"(piece {i + 2} of {len(pieces)}); a recurrence cut by a split is rewritten only where a "
                              f"piece holds enough of it (a warning says so); "
                              f"torch._dynamo.config.optimize_ddp = False keeps one graph")
            for i in range(len(pieces) - 1)]


def per_sample_grad_norms(compiled_model: Any) -> torch.Tensor:
    """The [B] per-example gradient norms ‖g_n‖ (over all parameters) of the last backward through
    ``compiled_model``, a ``torch.compile(..., backend="adjoint", options={"per_sample_clip": C})`` result
    (Opacus calls them ``per_sample_gradient_norms``). The norms are of the unclipped gradients.

    Raises ValueError when the model was not compiled with ``per_sample_clip``, RuntimeError before its first
    backward.
    """
    found = sorted(compiled_graphs(compiled_model), key=lambda c: c.seq)
    flat = [g for c in found for g in (c, *c.specializations)]
    clippers = [c.per_sample.clipper for c in flat if c.per_sample is not None]
    given = options_given(compiled_model)
    if not clippers or (given is not None and given.get("per_sample_clip") is None):
        raise ValueError("adjoint_compile.per_sample_grad_norms: the model was not compiled with "
                         "options={'per_sample_clip': C}, has not been called yet, or dynamo compiled none of it "
                         "(a forward whose loop has a graph break in it runs eagerly: its gradients are NOT "
                         "clipped; ac.report(compiled) lists the graphs compiled)")
    # NB: the graphs (and their clippers) of one class serve all its compiled instances: this one's parameters say
    # which backward they last took part in
    model = getattr(compiled_model, "_orig_mod", compiled_model)
    params = model.parameters() if isinstance(model, torch.nn.Module) else []
    own = [n[1:] for p in params if (n := getattr(p, "_adjoint_ps_norms", None)) is not None and n[0] == id(p)]
    done = own or [(c.step, c.last_norms) for c in clippers if c.last_norms is not None]
    if not done:
        raise RuntimeError("adjoint_compile.per_sample_grad_norms: no backward has run through the model's compiled "
                           "graphs yet. If one did run, the model ran eagerly and its gradients were NOT clipped: "
                           "dynamo skips a whole forward whose loop has a graph break in it (a data-dependent `if`, "
                           "a .item()); ac.report(compiled) lists the graphs compiled")
    return max(done, key=lambda sn: sn[0])[1]


def _fidelity(c: CompiledGraph) -> None:
    """Copy each lowered region's verify figures (``ShardedRegion.last_verify``) into its ``details``."""
    for r in c.regions:
        call = r.details.get("region_call")
        try:
            figures = getattr(c.captured.gm.get_submodule(call), "last_verify", None) if call else None
        except AttributeError:
            continue
        if figures:
            r.details["fidelity"] = dict(figures)
        stats = getattr(c.captured.gm.get_submodule(call), "stats", None) if call else None
        if getattr(stats, "calls", 0):  # NB: Highway-BP regions: the iterations the last backward ran (tolerance)
            r.details["highway_iterations_used"] = stats.iterations
            r.details["highway_last_update"] = stats.last_update


def _listed(xs: list[Any], most: int = 6) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= most else f"{', '.join(map(str, xs[:most - 1]))}, ..., {xs[-1]}"
