"""The ``"adjoint"`` torch.compile backend (DESIGN.md §2).

Dynamo hands us one FX graph per captured frame. The pipeline is a chain of small typed stages, one module each::

    capture ─► recognize ─► decide ─► lower ─► stitch
    (normalize  (once: typed  (plan per     (regions      (inner-compiled partitions around the
     once)       records)      region)       → runtime     region calls)
                                             calls)

and the callable it returns carries its own record (:class:`CompiledGraph`), which ``adjoint_compile.report``
finds from the compiled model and ``explain()`` builds the same way.

Registered under the ``torch_dynamo_backends`` entry-point group (pyproject.toml), so
``torch.compile(model, backend="adjoint")`` works without importing this package first.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

from . import options as _options
from . import timing
from . import polyfills  # noqa: F401 - registers library polyfills when dynamo starts a compile
from .errors import AdjointCompileWarning, AdjointVerifyReport, PerSampleError
from .frames import calling_modules, count_loop_compiles, frame_modules, frame_self, refuse_data_parallel
from .inner import compile_inner
from .lengths import LengthDispatch
from .options import Options
from .passes import decide
from .passes.capture import Captured, capture
from .passes.capture.known_scans import has_known_scans
from .passes.capture.buffer_writes import has_buffer_writes
from .passes.match.find_generic_scan import has_generic_scans
from .passes.lower import lower, lower_sequence_parallel, lowered_calls
from .passes.lower.per_sample import PerSampleLowering, lower_per_sample
from .passes.stitch import stitch, stitch_partitions
from .passes.recognize import recognize_captured as recognize
from .analysis.fx import source_line
from .regions import Fallback, NotLowered, Region, Rejection, group_rejections, rejection_lines
from .runtime.first_order import unhooked
from .runtime.per_sample import guard_parameter
from .runtime.seqpar import ReduceGrads, SeqParCall, SequenceParallelError, watch_unreduced
from .analysis.optable import draws_random
from .runtime.verify import DRAWS_RANDOM, ForwardCheck, check_skipped, copy_graph_module, graph_fidelity
from .timing import timed

log = logging.getLogger(__name__)

__all__ = ["adjoint_backend", "run_pipeline", "CompiledGraph", "CompiledGraphFn", "compile_inner"]

_sequence = itertools.count()


@dataclasses.dataclass
class CompiledGraph:
    """What the pipeline made of one dynamo graph: the records ``explain()`` and ``adjoint_compile.report`` show
    are exactly the ones that were lowered."""

    captured: Captured
    regions: list[Region]
    rejections: list[Rejection]
    #: names of the region call nodes that replaced recognized regions in ``captured.gm``.
    lowered: list[str]
    #: the callable that runs the graph (None when the pipeline ran for a report only).
    fn: Callable[..., Any] | None
    options: Options | None = None
    #: for a graph with symbolic sizes: the graphs it was specialized to, one per call signature, in order.
    specializations: list["CompiledGraph"] = dataclasses.field(default_factory=list)
    #: order of creation in this process (reports list graphs oldest first).
    seq: int = dataclasses.field(default_factory=lambda: next(_sequence))
    #: ``verify=True``: the whole graph's gradients against plain autograd of the captured graph, from its first
    #: call (runtime/verify.py); None before it, or when nothing was rewritten.
    fidelity: dict[str, Any] | None = None
    #: ``per_sample_clip``: the parameter uses lowered into per-example book-keeping calls, and the graph's clipper
    #: (its ``last_norms`` are ``adjoint_compile.per_sample_grad_norms``'s answer)
    per_sample: PerSampleLowering | None = None
    #: calls that ran with ordinary autograd although the graph had a rewrite, with cause and remedy
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    #: seconds spent, by stage (``check_forward_s``: the first-call check's extra forward)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    #: for the specialization whose regions serve every length: the lengths they have run (filled as they run)
    lengths: set[int] | None = None
    #: the module whose forward dynamo was compiling (weak; None for a function): the report of one compiled
    #: instance lists its own graphs, not its class's
    frame_module: Any = None
    #: per call, the graph's first parameter input: another instance of the class whose calls reuse this graph
    #: (dynamo serves them from one cache entry) has it reported too
    callers: Any = dataclasses.field(default_factory=weakref.WeakValueDictionary)  # NB: by id: tensors' == is no bool


class CompiledGraphFn:
    """The callable handed back to dynamo: runs the compiled graph and carries its :class:`CompiledGraph` (dynamo
    keeps it in the compiled frame's globals, where ``adjoint_compile.report`` finds it)."""

    def __init__(self, result: CompiledGraph, original: fx.GraphModule | None = None,
                 param_at: int | None = None) -> None:
        self.result = result
        self._fn = result.fn
        self._param_at = param_at
        #: ``verify=True``: the graph as captured, compared with the rewritten one on the first call, then dropped
        self._original = original

    def __call__(self, *args: Any) -> Any:
        # NB: not under inference_mode, whose tensors have no autograd at all: the first call outside it verifies
        if self._original is not None and not torch.is_inference_mode_enabled():
            original, self._original = self._original, None
            self._verify(original, args)
        if self._param_at is not None and id(args[self._param_at]) not in self.result.callers:
            self.result.callers[id(args[self._param_at])] = args[self._param_at]
        return timing.call(self.result.timing, self._fn, args)  # NB: run-time compiles count to this graph

    def _verify(self, original: fx.GraphModule, args: tuple) -> None:
        if any(draws_random(n) for n in original.graph.nodes):
            self.result.fidelity = {"skipped": DRAWS_RANDOM}
            warnings.warn(AdjointVerifyReport(f"adjoint-compile verify: whole graph not compared with plain autograd: "
                                              f"{DRAWS_RANDOM}"), stacklevel=3)
            return
        with unhooked():
            fid = graph_fidelity(original, self._fn, args)
        self.result.fidelity = fid
        log.info("adjoint-compile verify: the whole graph's gradients against plain autograd: %s", fid)
        warnings.warn(AdjointVerifyReport(
            f"adjoint-compile verify: whole graph ({len(self.result.lowered)} rewritten region call(s), mode="
            f"{self.result.options.mode if self.result.options else '?'}) against plain autograd: gradient relative "
            f"error {fid['grad_rel_err']:.3g}, cosine {fid['grad_cosine']:.6g} over {fid['tensors']} tensor(s); "
            f"worst {fid['worst']} ({fid['worst_rel_err']:.3g})"), stacklevel=3)


def _checked(result: "CompiledGraph", fn: Callable[..., Any], pristine: fx.GraphModule, opts: Options) -> Callable[..., Any]:
    """``fn`` wrapped in the first-call forward check (runtime/verify.py), when it applies: something was rewritten,
    ``check_forward`` is on, and the graph draws no random numbers (dropout: the inner compiler draws other numbers than eager, so its
    outputs cannot be compared with an eager run)."""
    if not opts.check_forward or opts.sequence_parallel is not None:
        return fn
    if any(draws_random(n) for n in pristine.graph.nodes):
        result.timing["check_forward_skipped"] = 1.0
        log.info("adjoint-compile: first-call check skipped: the graph draws random numbers (dropout), which the "
                 "inner compiler draws differently from eager")
        return fn
    if check_skipped(result.timing, pristine, result.regions):
        return fn
    names = ", ".join(f"{r.kind} {r.name}" for r in result.regions if r.rewrite != "none") or (
        "per-example book-keeping" if result.per_sample is not None else "re-rolled loops")

    def fallback(reference: fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
        if opts.per_sample_clip is not None:
            # NB: ordinary autograd would give unclipped gradients: never fall back to it
            raise PerSampleError(f"adjoint-compile per_sample_clip: {result.fallbacks[-1].cause}; no fallback is "
                                 f"possible under per_sample_clip (please report the model)")
        return compile_inner(reference, list(args), opts.inner)

    return ForwardCheck(fn, pristine, fallback, names, result.fallbacks, result.timing)


def _run_seqpar(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options, compile: bool) -> CompiledGraph:
    """The pipeline under ``sequence_parallel`` (passes/lower/seqpar.py): every scan and causal conv along time
    exchanges its carry / halo with the other ranks; in exact mode, recognized one-scan regions are sharded inside
    the rank as well (runtime/seqpar_sharded.py)."""
    captured = timed("capture", capture, gm, example_inputs, seed_dropout=False)
    regions, rejections = timed("recognize", recognize, captured, opts)
    plans = timed("decide", decide.plan, regions, opts)
    result = CompiledGraph(captured, regions, rejections, [], None, opts)
    settled, refusal = False, None
    if captured.symbolic:
        if compile:
            result.fn = LengthDispatch(result, opts, run_pipeline, stitch(captured, [], opts))
    else:
        sp, settled = timed("lower", lower_sequence_parallel, captured, regions, plans, opts)
        result.lowered, refusal = list(sp.calls), sp.refusal
        if sp.refusal is not None:
            result.rejections.append(Rejection("sequence_parallel", "<graph>", sp.refusal))
        if compile:
            fn = stitch(captured, sp.calls, opts) if sp.refusal is None else None
            reduce = ReduceGrads(sp.state.group, sp.params) if opts.reduce_grads else None
            result.fn = SeqParCall(fn, sp.state, sp.fingerprint, sp.length, sp.refusal, reduce, sp.numbers,
                                   sp.suspects)
            if reduce is not None:
                watch_unreduced([m for _, m in frame_modules()])
    if not settled:
        # NB: a graph refused for sequence parallelism lowers nothing: its regions say why (their plans' reason is
        # empty where a rewrite was planned)
        decide.settle(regions, plans, [NotLowered(f"not lowered: {refusal}") if refusal and p.rewrite != "none"
                                       else None for p in plans])
    captured.example_inputs = []
    _log_decisions(result, opts)
    if compile and not captured.symbolic:
        _warn_unsaved(result, opts)
    return result


def guard_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Make every parameter of the compiled frame raise :class:`PerSampleError` when an ordinary autograd backward
    accumulates into its ``.grad`` (a use that bypassed the book-keeping); returns how many are guarded."""
    n = 0
    for _, mod in frame_modules():
        for pname, p in mod.named_parameters():
            guard_parameter(p, pname)
            n += 1
    # NB: and those of the modules running eagerly around this frame: a forward dynamo skipped runs its parameters'
    # uses eagerly (unclipped) while only an inner frame, without them, compiles
    for cls, mod in calling_modules():
        for pname, p in mod.named_parameters():
            guard_parameter(p, f"{cls}.{pname}")
            n += 1
    holders = [m for m in gm.graph.nodes if m.op == "placeholder"]
    for m, ex in zip(holders, example_inputs):
        if isinstance(ex, torch.nn.Parameter):
            ga = m.meta.get("grapharg")
            guard_parameter(ex, getattr(getattr(ga, "source", None), "name", m.name) if ga is not None else m.name)
            n += 1
    return n


def run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options, *,
                 compile: bool = True) -> CompiledGraph:
    """capture -> recognize -> decide -> lower -> stitch on ``gm`` (modified in place).

    ``compile=False`` stops before stitch (``explain()``: decisions and lowering only, nothing compiled). The
    seconds of each stage are in the record's ``timing`` (adjoint_compile/timing.py), logged at INFO.
    """
    with timing.recording() as spent:
        result = (_run_seqpar if opts.sequence_parallel is not None else _run_pipeline)(gm, example_inputs, opts,
                                                                                         compile)
    result.timing.update(spent)
    if log.isEnabledFor(logging.INFO):
        log.info("adjoint-compile: compile time of a graph of %d nodes: %s", len(gm.graph.nodes),
                 timing.summary([result.timing]))
    return result


def _run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options, compile: bool) -> CompiledGraph:
    # NB: normalization rewrites gm in place; the graph as captured goes to the inner compiler when nothing is
    # rewritten, and is the reference of the first-call check otherwise
    pristine = timed("copy", copy_graph_module, gm) if compile else None
    captured = timed("capture", capture, gm, example_inputs, seed_dropout=opts.mode in decide.RECOMPUTING_MODES,
                     seed_chains=opts.mode == "highway")
    regions, rejections = timed("recognize", recognize, captured, opts)
    plans = timed("decide", decide.plan, regions, opts)
    # NB: per_sample_clip lowers with concrete sizes: a symbolic graph (a batch size that changed) is specialized
    # per call signature like one with regions to shard
    # NB: and one calling a library's scan, which only a specialization's capture replaces (mambapy's PScan)
    # NB: and one writing a loop's steps into a buffer, which only a specialization's capture stacks
    # NB: and a generic-mode associative_scan, whose tree only a specialization's sizes can be read in
    symbolic = captured.symbolic and (any(p.rewrite != "none" for p in plans) or opts.per_sample_clip is not None
                                      or has_known_scans(gm) or has_buffer_writes(gm) or has_generic_scans(gm))
    if symbolic:  # NB: sharded per call signature once specialized; this graph only says so
        plans = decide.plan(regions, opts, symbolic=True)
    outcomes = (timed("lower", lower, captured, regions, plans, opts) if regions and not captured.symbolic
                else [None] * len(regions))
    decide.settle(regions, plans, outcomes)
    result = CompiledGraph(captured, regions, rejections, lowered_calls(outcomes), None, opts)
    calls = list(result.lowered)
    if opts.per_sample_clip is not None and not captured.symbolic:
        # NB: after the lowering: a sharded region (exact adjoint) is one parameter use that records its own
        # per-example gradients; the uses it lowers run eagerly (their own partitions), the rest with the inner
        # compiler
        result.per_sample = timed("per_sample", lower_per_sample, captured.gm, example_inputs, opts)
        calls += result.per_sample.calls
    if opts.per_sample_clip is not None and compile:
        # NB: before anything of this frame can run eagerly (a later recompile past dynamo's limit, a graph break)
        guard_parameters(gm, example_inputs)
    if compile and symbolic:
        # NB: the fallback compiles on first use, by dynamo with symbolic sizes (stitch_partitions' dynamic mode):
        # compiled now, inside the outer frame's tracing context, inductor's guards on T (e.g. T <= 128) would
        # become the frame's and recompile it at longer lengths
        fallback = stitch_partitions(pristine if pristine is not None else gm, [], opts.inner, dynamic=True,
                                     fallbacks=result.fallbacks)
        result.fn = LengthDispatch(result, opts, run_pipeline, fallback)
    elif compile:
        # NB: loops capture re-rolled but nothing rewritten: the re-rolled graph (one linear_scan per loop) compiles
        # in seconds where the unrolled one takes the inner compiler minutes, and steps faster; checked on its first
        # call against the graph as captured, which it falls back to
        rolled = not calls and bool(captured.normalized.get("rerolled")) and not captured.normalized.get("dropouts") \
            and opts.per_sample_clip is None
        result.fn = stitch(captured, calls, opts, None if rolled else pristine)
        if calls or rolled:
            result.fn = _checked(result, result.fn, pristine, opts)
    # NB: the record lives as long as dynamo's cache entry; it must not keep the first call's inputs alive
    captured.example_inputs = []
    _log_decisions(result, opts)
    if compile and not symbolic:  # NB: a symbolic graph's specializations each run (and warn) here themselves
        _warn_unsaved(result, opts)
    return result


def adjoint_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Any = None, mode: str | None = None
) -> Callable[..., Any]:
    """``torch.compile(model, backend="adjoint", options={...})``.

    ``options`` is validated here, on the first call (an :class:`~adjoint_compile.OptionsError`, a ``ValueError``,
    reaches the caller unwrapped). torch.compile's own ``mode=`` argument has no meaning for this backend; the
    adjoint mode is ``options={"mode": ...}``; another ``mode=`` gives an :class:`AdjointCompileWarning`.
    """
    opts = _options.validate(options)
    if mode not in (None, "default"):
        warnings.warn(f"adjoint-compile ignores torch.compile(mode={mode!r}); choose the backward with "
                      f"options={{'mode': ...}}", AdjointCompileWarning, stacklevel=2)
    if opts.per_sample_clip is not None:
        refuse_data_parallel(opts.per_sample_clip)
    original = copy_graph_module(gm) if opts.verify else None
    ddp = _ddp_split_of(gm, opts)
    with unhooked():  # NB: the pipeline's trial runs are not the user's forward (a checkpoint counts what it saves)
        result = run_pipeline(gm, example_inputs, opts)
    own = frame_self()
    result.frame_module = weakref.ref(own) if own is not None else None
    count_loop_compiles(result)
    if ddp is not None:
        _check_ddp_split(ddp, result)
    # NB: graphs with symbolic sizes are verified per specialization by their regions only
    # NB: and not under sequence_parallel, where plain autograd of one rank's graph is not the reference
    keep = (original is not None and bool(result.lowered) and not isinstance(result.fn, LengthDispatch)
            and opts.sequence_parallel is None)
    param_at = next((i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)), None)
    return CompiledGraphFn(result, original if keep else None, param_at)


@dataclasses.dataclass
class _DDPSplit:
    """One graph DDPOptimizer split at DDP's gradient buckets: the recurrence steps rewritten in the whole graph,
    and in its pieces so far."""

    pieces: int
    whole_steps: int
    seen: int = 0
    piece_steps: int = 0


def _rewritten_steps(result: CompiledGraph) -> int:
    return sum(r.length or 0 for r in result.regions if r.rewrite != "none" and r.kind != "residual_chain")


def _ddp_split_of(gm: fx.GraphModule, opts: Options) -> _DDPSplit | None:
    """For a piece of a graph DDPOptimizer split (it marks the pieces it hands to the backend), the record of the
    whole graph, which the first piece analyzes (DDPOptimizer keeps its buckets, whose nodes are the whole graph's)."""
    if "DDPOptimizer" not in str(getattr(gm, "compile_subgraph_reason", "")):
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        chain = polyfills._compiler_chain(InstructionTranslator.current_tx().output.compiler_fn)
        ddp = next(f.__self__ for f in chain if hasattr(getattr(f, "__self__", None), "buckets"))
    except Exception:  # noqa: BLE001 - not under DDPOptimizer's compile after all: nothing to compare with
        return None
    if getattr(ddp, "_adjoint_split", (None,))[0] is not ddp.buckets:
        whole = ddp.buckets[0].nodes[0].graph.owning_module
        steps = _rewritten_steps(run_pipeline(copy_graph_module(whole), [], opts, compile=False))
        ddp._adjoint_split = (ddp.buckets, _DDPSplit(len(ddp.buckets), steps))
    return ddp._adjoint_split[1]


def _check_ddp_split(split: _DDPSplit, piece: CompiledGraph) -> None:
    """After the last piece: warn when the pieces rewrote fewer recurrence steps than the whole graph would have."""
    split.seen += 1
    split.piece_steps += _rewritten_steps(piece)
    if split.seen == split.pieces and split.piece_steps < split.whole_steps:
        warnings.warn(f"adjoint-compile: DDPOptimizer split the graph at DistributedDataParallel's gradient buckets "
                      f"into {split.pieces} pieces and cut recurrences: the pieces rewrite {split.piece_steps} of "
                      f"the {split.whole_steps} recurrence steps the whole graph would, the rest stays with "
                      f"autograd. Set torch._dynamo.config.optimize_ddp = False (one graph; DDP then all-reduces "
                      f"after the backward) or a larger bucket_cap_mb", AdjointCompileWarning, stacklevel=2)


#: polyfills.active() looks for this mark on the compiler dynamo traces for
adjoint_backend._adjoint_compile_backend = True  # type: ignore[attr-defined]


def _log_decisions(result: CompiledGraph, opts: Options) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    n = len(result.captured.gm.graph.nodes)
    log.info(
        "adjoint-compile: graph with %d nodes, %d region(s), %d lowered, %d rejected candidate(s); inner=%s mode=%s",
        n,
        len(result.regions),
        len(result.lowered),
        len(result.rejections),
        opts.inner,
        opts.mode,
    )
    for r in result.regions:
        log.info("  region %s %s/%s length=%s rewrite=%s %s", r.name, r.kind, r.source, r.length, r.rewrite, r.reason)
    for j in result.rejections:
        log.debug("  rejected %s at %s: %s", j.candidate, j.node, j.reason)


#: what to do when recognition found nothing, or could not prove a candidate
REMEDY_UNRECOGNIZED = ("write the recurrence with adjoint_compile.ops.linear_scan, torch's scan or associative_scan, "
                       "or register your library's scan (adjoint_compile.register_scan); "
                       "adjoint_compile.explain(model, *inputs) shows what was looked at and why")


def _declined(r: Region, opts: Options) -> bool:
    """A region left to ordinary autograd that no other rewrite covers, so the user gets nothing from it."""
    if r.rewrite != "none" or r.details.get("covered"):
        return False
    # NB: under sequence_parallel an unsharded scan still runs distributed: each rank holds its slice only
    return not (opts.sequence_parallel is not None and r.reason.startswith("sequence_parallel"))


def unsaved_message(result: CompiledGraph, opts: Options) -> str | None:
    """The warning for one compiled graph when something in it saves nothing: recognized regions left to
    ordinary autograd (with their reasons, which name the remedy), rejected candidates grouped by reason, or
    nothing recognized at all. None when every region is rewritten (or covered by a rewrite)."""
    gm = result.captured.gm
    nodes = {n.name: n for n in gm.graph.nodes}

    def at(name: str) -> str:
        line = source_line(nodes[name]) if name in nodes else None
        return f" [{line}]" if line else ""

    declined = [r for r in result.regions if _declined(r, opts)]
    # NB: with recurrences in the graph, a residual chain left alone by a mode without its rewrite (Highway-BP) is
    # informational: the recurrences' rows say what was kept; it is listed, not counted
    quiet = opts.mode != "highway" and any(x.kind != "residual_chain" for x in result.regions)
    info = [r for r in declined if r.kind == "residual_chain" and quiet]
    declined = [r for r in declined if r not in info]
    lines = [f"{r.kind} {r.name} ({r.source}, length {r.length}) not rewritten{at(r.name)}: {r.reason}"
             for r in declined]
    # NB: so is a rejected residual-chain candidate: no rewrite for it in this mode had it been recognized; and a
    # candidate at an op a rewritten region covers (an LSTM's other carry, its scan rewritten in highway mode)
    covered = {n.name for r in result.regions if r.rewrite != "none" for n in r.nodes if isinstance(n, fx.Node)}
    rejections = [j for j in result.rejections if not (quiet and j.candidate == "residual_chain")
                  and j.node.split("[")[0] not in covered]
    groups = group_rejections(rejections, nodes)
    lines += [f"rejected {line}{at(where[0])}" for line, (_, _, where) in zip(rejection_lines(groups), groups)]
    if lines:
        lines += [f"(informational, not counted) {r.kind} {r.name} ({r.source}, length {r.length}){at(r.name)}: "
                  f"{r.reason}" for r in info]
    if not result.regions and not (result.per_sample is not None and result.per_sample.uses):
        remedy = REMEDY_UNRECOGNIZED
        if any(isinstance(n.target, torch._ops.HigherOrderOperator) and "checkpoint" in n.target.name()
               for n in gm.graph.nodes):
            # NB: the layers are inside torch.utils.checkpoint's regions, which the recognizers do not enter
            remedy = ("the model runs its layers under activation checkpointing (torch.utils.checkpoint, "
                      "gradient_checkpointing_enable()), which hides them from the backend: turn it off (e.g. "
                      "model.gradient_checkpointing_disable()); the adjoint backward keeps little memory without it")
        head = (f"adjoint-compile: nothing recognized in a graph of {len(nodes)} nodes (mode={opts.mode}): no linear "
                f"recurrence, scan or residual chain, so it compiles with the inner compiler ({opts.inner}) as is "
                f"and saves no memory; {remedy}")
        return "\n  ".join([head, *lines])
    if not lines:
        return None
    tail = (f"; for rejected candidates: {REMEDY_UNRECOGNIZED}" if groups else
            "; adjoint_compile.explain(model, *inputs) shows every decision")
    done = sum(1 for r in result.regions if r.rewrite != "none")
    head = (f"adjoint-compile: {len(declined)} recognized region(s) kept ordinary autograd and {len(rejections)} "
            f"candidate(s) were rejected" + (f" ({done} other region(s) rewritten)" if done else "") +
            f" in a graph of {len(nodes)} nodes (mode={opts.mode}); each reason names its remedy{tail}")
    return "\n  ".join([head, *lines])


def _warn_unsaved(result: CompiledGraph, opts: Options) -> None:
    """One WARNING per compiled graph (this logger: ``logging`` or ``TORCH_LOGS`` control it) when part of it saves
    nothing; never repeated per call; small graphs split off by graph breaks: one per compile (analysis/breaks.py)."""
    from .analysis.breaks import collapse  # NB: which also notes the graph for report()
    msg = collapse(result, unsaved_message(result, opts), opts)
    if msg is None:
        return
    if not torch.is_grad_enabled():
        # NB: no backward runs through this graph (validation under no_grad, generation): nothing to save. A graph
        # whose inputs need no gradient may be a piece of a model split by a break, which the warning is about
        log.info("%s (no gradient flows through this graph: nothing to save)", msg)
        return
    log.warning("%s", msg)


def _register() -> None:
    # The entry point makes the name known without importing us; registering here as well covers
    # `import adjoint_compile` in an environment where the package is on sys.path but not installed.
    if "adjoint" not in _COMPILER_FNS and _BACKENDS.get("adjoint") is None:
        register_backend(name="adjoint")(adjoint_backend)


_register()
