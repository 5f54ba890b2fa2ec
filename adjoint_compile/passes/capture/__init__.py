"""Stage 1 of the pipeline: take dynamo's graph and normalize it once, so that every later stage sees one form.

Dynamo's graph is torch-level (``torch.*``, ``operator.*``, ``Tensor`` methods; parameters lifted to
placeholders) and every node carries ``meta["example_value"]``, a FakeTensor with its shape. Recognition works on
this level on purpose: ``linear(x)`` on ``[B, T, D]`` is visibly time-local here, whereas after decomposition to
aten it becomes ``view(x, [B*T, D]) @ W`` and the step axis is merged away.

Normalization, in this order, each pass in its own module and each recording provenance on the nodes it makes:

0. :mod:`.noop_ops`, :mod:`.buffer_writes` and :mod:`.masked_writes`: casts and slices that do nothing are
   dropped, an output buffer written step by step (``o[:, t] = h``) becomes one ``torch.stack``, so loops written
   with them match, and a number written into a copy (``t[t == pad] = -100``) becomes a new value;
1. :mod:`.known_scans`: calls of registered scan implementations (a custom ``autograd.Function`` such as
   mambapy's ``PScan``), each checked against its original, become one ``linear_scan`` node;
2. :mod:`.scan_forms`: closed forms of a linear recurrence (minGRU's log-space form, cumprod form, torch's
   ``associative_scan`` in generic mode, which dynamo inlines as a tree, and tree scans written in plain torch,
   :mod:`.find_tree_scans`) become one ``linear_scan`` node; before reroll, so that the matchers below do not
   look into the tree's nodes;
3. :mod:`.reroll`: linear recurrences written as torch's ``scan``, ``associative_scan`` or a Python loop dynamo
   unrolled become one ``linear_scan`` node (the recurrence matchers of :mod:`.find_recurrences` and
   :mod:`.unrolled` find them; a recurrence that cannot be re-rolled keeps its form and its node says why);
   then :mod:`.reroll_readouts` emits a loop's per-step readouts (``ys.append(h @ C[:, t])``) once for all steps,
   and :mod:`.reverse_scans` writes a reverse scan as the forward scan of the flipped steps (as the roller writes a
   loop over ``reversed(range(T))``);
4. :mod:`.canonical_shifts`: pad-style previous-state readouts of scan outputs become ``cat([first, h[:-1]])``,
   in a graph with scans, other fixed-width shifts along one dim (token shifts) ``shift_steps(x, p, dim, fill)``;
5. :mod:`.seeded_dropout` (when the graph has scans to shard and ``seed_dropout``): ``F.dropout`` becomes
   ``hashed_dropout``, whose mask a shard's recomputation reproduces.

The passes after 0 move nodes by data flow alone. A graph that still writes in place into a tensor it made (a
partial buffer write, a write through a view) after step 0, or that reads an input again after writing into it
(a module's state updated, then read), is therefore left as it is, with every region refused: its writes order its
reads in a way data flow does not show (``Captured.writes``).

A graph with symbolic sizes (dynamic shapes) is not normalized: it is specialized per call (passes/capture/specialize.py)
and each specialization is captured again. Recognition then runs once on the normalized graph.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from ...analysis.fx import is_linear_scan, reread_inputs, written_inputs
from ...timing import timed
from ...regions import Recurrence, Rejection
from .buffer_writes import stack_buffer_writes
from .masked_writes import rewrite_masked_writes
from .canonical_shifts import canonicalize_shifts, canonicalize_token_shifts
from ..match.find_recurrences import find_recurrences
from .known_scans import replace_known_scans
from .mode_blocks import detach_no_grad_outputs
from .noop_ops import drop_noop_ops, drop_unused_float_args
from ..match import prefilter
from ..match.prefilter import Candidates, candidates, run_or_skip
from .reroll import needs_reroll
from .reroll import reroll as reroll_loops  # NB: not `reroll`, which would hide the submodule of that name
from .reroll_readouts import reroll_readouts
from .reverse_scans import forward_reverse_scans
from .scan_forms import match_scan_forms, rewrite_scan_forms
from .seeded_dropout import seed_dropouts
from .specialize import float_args_as_tensors, has_symbolic_sizes
from ..match.find_cells import find_cells
from ..match.unrolled import find_unrolled

log = logging.getLogger(__name__)

__all__ = ["Captured", "capture", "match_recurrences"]


@dataclasses.dataclass
class Captured:
    """One dynamo graph (normalized in place) and its example inputs (real tensors, or fakes when dynamo passes
    fakes)."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    #: the graph has symbolic sizes (dynamic shapes): not normalized; it is specialized per call.
    symbolic: bool = False
    #: what normalization did, for reports: pass name -> how many rewrites (``rerolled``: the scans made).
    normalized: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the recurrence matchers' results on the graph, when normalization did not change it after they ran
    #: (recognition reuses them instead of matching again); None when it did.
    matched: tuple[list[Recurrence], list[Rejection]] | None = dataclasses.field(default=None, repr=False)
    #: in-place writes into tensors the graph made that normalization could not turn into values: the graph is
    #: not normalized further, and recognition refuses it
    writes: list[fx.Node] = dataclasses.field(default_factory=list)
    #: the torch.func transform (vmap, grad, jvp) the graph runs its inputs under, traced inline: the graph is not
    #: normalized, and recognition refuses it (its values are batched or wrapped)
    transform: str | None = None


#: functorch's wrappers of a value entering a transform's level
_WRAPS = frozenset("_add_batch_dim _wrap_for_grad _make_dual".split())


def _transform(gm: fx.GraphModule) -> str | None:
    """The torch.func transform a graph runs its inputs under (``vmap(f)`` compiled over an ensemble's stacked
    weights, ``torch.func.grad`` inside the compiled code): a functorch wrapper of a graph input. NB: torch's own
    vmaps of intermediate values (the combines of a generic ``associative_scan``) are not that."""
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name in _WRAPS and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder":
            return f"{name}({n.args[0].name})"
    return None


def match_recurrences(gm: fx.GraphModule, cands: Candidates | None = None) -> tuple[list[Recurrence], list[Rejection]]:
    """The recurrence matchers (scan nodes, unrolled loops, loops over recurrent cells): records and rejections.
    Those without a candidate in ``cands`` (:func:`.prefilter.candidates` of ``gm`` when None) are not run."""
    c = candidates(gm) if cands is None else cands
    found, rejected = timed("find_recurrences", run_or_skip, c.scans, "scans", find_recurrences, gm)
    loops, loop_rejected = timed("find_unrolled", run_or_skip, c.slices, "slices", find_unrolled, gm)
    cells, _ = timed("find_cells", run_or_skip, c.cells, "cells", find_cells, gm)
    return [*found, *loops, *cells], [*rejected, *loop_rejected]


def capture(gm: fx.GraphModule, example_inputs: Sequence[Any], *, normalize: bool = True,
            seed_dropout: bool = True, seed_chains: bool = False) -> Captured:
    """Wrap dynamo's graph and normalize it in place (see the module docstring).

    ``normalize=False`` leaves the graph as dynamo gave it; ``seed_dropout=False`` leaves dropouts alone (modes
    that recompute nothing need no reproducible masks); ``seed_chains`` seeds them in a graph without scans or
    loops too (highway mode recomputes a residual chain's blocks).
    """
    if normalize:  # NB: before the symbolic check: a symbolic graph is lowered from this one too
        drop_unused_float_args(gm)
    captured = Captured(gm=gm, example_inputs=list(example_inputs), symbolic=has_symbolic_sizes(gm),
                        transform=_transform(gm))
    if not normalize or captured.symbolic or captured.transform:
        return captured
    floats = timed("float_args", float_args_as_tensors, gm)
    # NB: first: the passes below replace and reorder ops, which may carry a no_grad block's op out of it
    detached = timed("no_grad_blocks", detach_no_grad_outputs, gm)
    known = timed("known_scans", replace_known_scans, gm)
    noops, buffers = timed("noop_ops", drop_noop_ops, gm), timed("buffer_writes", stack_buffer_writes, gm)
    masked = timed("masked_writes", rewrite_masked_writes, gm)
    into_inputs, into_made = timed("written_inputs", written_inputs, gm.graph)
    captured.writes = into_made + reread_inputs(gm.graph, into_inputs)
    if captured.writes:
        captured.normalized = {"known_scans": known, "noop_ops": noops, "buffer_writes": buffers}
        log.debug("capture: in-place writes left (%s): not normalized", ", ".join(n.name for n in captured.writes))
        return captured
    try:
        cands = timed("prefilter", candidates, gm)
        forms, _ = timed("scan_forms", _scan_forms, gm, cands.scans or cands.slices)
        # NB: again after the closed-form pass ran: it makes scans, and says on a node why it left a tree scan
        cands = timed("prefilter", candidates, gm) if cands.scans or cands.slices else cands
        matched = timed("match", match_recurrences, gm, cands)
    except Exception as e:  # noqa: BLE001 - a matcher failure leaves the graph as it is; recognition reports it
        log.debug("capture: the recurrence matchers raised %s: %s", type(e).__name__, e, exc_info=True)
        return captured
    todo = [r for r in matched[0] if needs_reroll(r)]
    made = timed("reroll", reroll_loops, gm, todo) if todo else []
    readouts = timed("readouts", reroll_readouts, gm, made) if made else {}
    reversed_ = timed("reverse_scans", forward_reverse_scans, gm)
    shifts = timed("shifts", canonicalize_shifts, gm)
    has_scans = any(is_linear_scan(n) for n in gm.graph.nodes)
    token_shifts = timed("token_shifts", canonicalize_token_shifts, gm) if has_scans else 0
    # NB: not where a loop was matched: its steps' seeded dropouts differ by stream, and the loop would no longer be
    # read as one step repeated (highway mode refuses a step that draws random numbers, with that reason)
    chains = seed_chains and not matched[0]
    dropouts = timed("dropouts", seed_dropouts, gm) if seed_dropout and (has_scans or chains) else 0
    captured.normalized = {"rerolled": made, "shifts": shifts, "token_shifts": token_shifts, "dropouts": dropouts, "known_scans": known}
    if forms:
        captured.normalized["scan_forms"] = forms
    if readouts:
        captured.normalized["readouts"] = readouts
    if reversed_:
        captured.normalized["reverse_scans"] = reversed_
    if floats:
        captured.normalized["float_args"] = floats
    if noops or buffers:
        captured.normalized.update({"noop_ops": noops, "buffer_writes": buffers})
    if masked:
        captured.normalized["masked_writes"] = masked
    if detached:
        captured.normalized["no_grad_detached"] = detached
    # NB: the matchers ran after the no-op, buffer-write and closed-form passes: only what changed the graph since
    # (or a reroll that failed and said why on its nodes) makes recognition match again
    if not (made or reversed_ or shifts or token_shifts or dropouts or any(r.not_rerolled for r in todo)):
        captured.matched = matched
    log.debug("capture: %s", captured.normalized)
    return captured


def _scan_forms(gm: fx.GraphModule, wanted: bool) -> tuple[list[str], list[Rejection]]:
    """:func:`.scan_forms.rewrite_scan_forms` when the graph has candidates for it (``wanted``: closed forms, scan
    ops, indexing for tree scans); under :data:`.prefilter.CHECK` always, noting a disagreement."""
    if not wanted and prefilter.CHECK:
        run_or_skip(False, "scan forms", match_scan_forms, gm)
    return rewrite_scan_forms(gm) if wanted or prefilter.CHECK else ([], [])
