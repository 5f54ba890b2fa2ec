"""Stage 3 of the pipeline: decide, for every recognized region, which rewrite it gets and say why.

The one writer of ``Region.rewrite`` and ``Region.reason`` (and of the report's ``group``/``bounds`` for lowered
regions). Two steps around the lowering::

    plans = plan(regions, options)            # (mode, kind) -> the rewrite to try, or why there is none
    outcomes = lower(captured, regions, plans, options)      # passes/lower/: Lowered | NotLowered per region
    settle(regions, plans, outcomes)          # rewrite, reason, group, bounds, report details

A new rewrite is a new lowering module plus an entry in :data:`TABLE`. Recognition's records arrive undecided;
lowerings return typed outcomes (:class:`~adjoint_compile.regions.Lowered`,
:class:`~adjoint_compile.regions.NotLowered`) and write nothing on the records.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch.fx as fx

from ..match.find_recurrences import COUPLED, is_scan_hop
from ...options import Options
from ...regions import MORE_THAN_ONE_STATE, Lowered, NotLowered, Region, Rewrite

log = logging.getLogger(__name__)

__all__ = ["Plan", "TABLE", "RECOMPUTING_MODES", "plan", "settle", "mib", "declines", "lowered_per_length",
           "nothing_at_any_length", "short_lengths"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision for one region before lowering: the rewrite to try ("none": keep ordinary autograd) and why."""

    rewrite: Rewrite
    reason: str = ""


#: (mode, region kind) -> the rewrite to try, or the reason there is none (``{mode!r}`` is filled in).
TABLE: dict[tuple[str, str], Plan] = {
    ("exact", "linear_recurrence"): Plan("adjoint"),
    ("exact", "gated_recurrence"): Plan("none", "a gated recurrence (its update is not a*h + b with a and b "
                                                "free of the carried states) has no adjoint-sharded rewrite; it "
                                                "keeps ordinary autograd (mode='highway' rewrites it)"),
    ("exact", "residual_chain"): Plan("none", "mode='exact' shards recurrences only; a residual_chain's own rewrite "
                                              "is Highway-BP (mode='highway')"),
    ("truncated", "linear_recurrence"): Plan("truncated"),
    ("truncated", "gated_recurrence"): Plan("none", "a gated recurrence (its update is not a*h + b with a and "
                                                    "b free of the carried states) has no truncated-adjoint rewrite: "
                                                    "the windowed adjoint needs a_t independent of h; it keeps "
                                                    "ordinary autograd (exact gradients; mode='highway' rewrites it)"),
    ("truncated", "residual_chain"): Plan("none", "mode='truncated' truncates recurrences along time; a residual "
                                                  "chain runs along layers and keeps ordinary autograd (exact "
                                                  "gradients); its own rewrite is Highway-BP (mode='highway')"),
    # NB: a linear recurrence's J is zero (its coefficient does not depend on h): Highway-BP is its exact adjoint
    ("highway", "linear_recurrence"): Plan("adjoint"),
    ("highway", "gated_recurrence"): Plan("highway"),
    ("highway", "residual_chain"): Plan("highway"),
}

#: modes whose rewrites recompute parts of the forward in the backward: capture makes their dropout masks
#: reproducible (passes/capture/seeded_dropout.py).
RECOMPUTING_MODES = frozenset({"exact", "truncated", "highway"})

#: the reason of a rewritable region under ``sequence_parallel`` (passes/lower/seqpar.py)
SEQUENCE_PARALLEL = ("sequence_parallel: each scan runs as the distributed scan of runtime/seqpar.py on this rank's "
                     "slice (carry from the ranks before it), with ordinary autograd around it; not sharded inside "
                     "the rank (only mode='exact' shards regions inside each rank)")

#: the reason of an exact-mode region with several scans under ``sequence_parallel``: its last states are not affine
#: in its carries-in (a scan may feed another through a nonlinearity), which the per-rank carry exchange needs
SEQUENCE_PARALLEL_MULTI = ("sequence_parallel: a region of {scans} scans is not sharded inside the rank (the carry "
                           "exchange needs a region's last state affine in its carry-in: one scan per region); its "
                           "scans run as distributed scans with ordinary autograd around them")

#: the reason of a linear recurrence in a graph with symbolic sizes: each call's sizes get their own graph
SYMBOLIC = ("dynamic shapes: the graph is specialized to the first call's sizes, lowered there and run for every "
            "length (see the later compiled graphs)")


#: the reason of a region under per_sample_clip whose rewrite is not the exact adjoint (only the exact sharded VJP
#: keeps per-example gradients: runtime/sharded_ps.py)
PER_SAMPLE = ("per_sample_clip: kept unrewritten (ordinary autograd with per-example book-keeping of its "
              "parameters); of the rewrites only the exact adjoint composes with per-example clipping yet")


def lowered_per_length(regions: Sequence[Region], why: str) -> None:
    """The regions of a graph with symbolic sizes whose lowering cannot serve every length: each new length is
    specialized, lowered and compiled again (lengths.py); their reason says so instead of :data:`SYMBOLIC`."""
    for r in regions:
        if r.reason == SYMBOLIC:
            r.reason = (f"dynamic shapes: each new length is specialized, lowered and compiled again (see the later "
                        f"compiled graphs): the regions cannot serve every length ({why})")


def nothing_at_any_length(regions: Sequence[Region]) -> None:
    """The regions of a graph with symbolic sizes whose specialization rewrites nothing, at any size (lengths.py):
    the graph runs with its symbolic sizes; their reason says so instead of :data:`SYMBOLIC`."""
    for r in regions:
        if r.reason == SYMBOLIC:
            r.reason = ("dynamic shapes: its specialization rewrites nothing, whatever the length (the later compiled "
                        "graph's rows say why): the graph runs as captured, with ordinary autograd")


def short_lengths(regions: Sequence[Region], sizes: Sequence[str], lowered_at: str = "") -> None:
    """The regions of a graph with symbolic sizes whose calls so far (``sizes``) were too short to shard (lengths.py):
    their reason says so instead of :data:`SYMBOLIC`, and, once a longer call (``lowered_at``) made the graph for
    every length, that the calls before it ran with ordinary autograd."""
    listed = ", ".join(sizes) if len(sizes) <= 6 else f"{', '.join(sizes[:5])}, ..., {sizes[-1]}"
    for r in regions:
        if r.reason == SYMBOLIC or r.reason.startswith(_SHORT):
            r.reason = (f"dynamic shapes: lowered at the first call long enough to shard ({lowered_at}) and run for "
                        f"every length since (see the later compiled graphs); the calls before it ({listed}) ran "
                        f"with ordinary autograd" if lowered_at else
                        f"{_SHORT} ({listed}): they ran with ordinary autograd (the next graph's rows say why, at the "
                        f"longest); a call longer than these is lowered again")


#: the start of a reason :func:`short_lengths` wrote
_SHORT = "dynamic shapes: nothing to shard at the sizes run so far"


def plan(regions: Sequence[Region], opts: Options, *, symbolic: bool = False) -> list[Plan]:
    """One :class:`Plan` per region, from :data:`TABLE`.

    ``symbolic``: the graph has symbolic sizes and is lowered from a specialization (lengths.py); its rewritable
    regions are planned "none" here and say so.
    """
    plans = []
    for r in regions:
        p = TABLE.get((opts.mode, r.kind), Plan("none", f"no rewrite for a {r.kind} in mode={opts.mode!r}"))
        p = dataclasses.replace(p, reason=p.reason.format(mode=opts.mode))
        if p.rewrite != "none":
            if opts.per_sample_clip is not None and p.rewrite != "adjoint":
                p = Plan("none", PER_SAMPLE)
            elif getattr(r, "not_rerolled", None):
                p = Plan("none", r.not_rerolled)
            elif opts.sequence_parallel is not None and opts.mode != "exact":
                # NB: exact mode shards one-scan regions inside each rank (runtime/seqpar_sharded.py)
                p = Plan("none", SEQUENCE_PARALLEL)
            elif symbolic:
                p = Plan("none", SYMBOLIC)
        elif r.kind == "gated_recurrence" and opts.mode != "highway" and _a_sum(r):
            p = Plan("none", SUM_NOT_STATE.format(name=r.name))
        elif r.kind == "gated_recurrence" and opts.mode != "highway" and \
                (getattr(r, "details", None) or {}).get("gated_because") == COUPLED:
            p = Plan("none", COUPLED_PLAN.format(mode=opts.mode))
        elif r.kind == "gated_recurrence" and opts.mode != "highway" and (why := _highway_refusal(r)):
            p = Plan("none", p.reason.replace("mode='highway' rewrites it", f"mode='highway' would not either: {why}"))
        elif r.kind == "gated_recurrence" and opts.mode != "highway" and rolled_loop(r):
            # NB: mode='highway' unrolls the loops it rolls here, and proves the unrolled steps: not provable from here
            p = Plan("none", p.reason.replace(
                "mode='highway' rewrites it", "mode='highway' unrolls the loop and may rewrite it: "
                "ac.explain(..., options={'mode': 'highway'}) tells"))
        plans.append(p)
    return plans


#: carries linear in one another (match/find_recurrences.COUPLED)
COUPLED_PLAN = (f"{COUPLED}: only an elementwise a*h + b is sharded, so it keeps ordinary autograd in "
                "mode={mode!r}. Write such a state as one complex tensor (torch.complex(re, im), h = lam * h + b "
                "with a complex lam): a complex linear recurrence is sharded")


#: a "gated recurrence" that is a sum over the steps of a loop left unrolled
SUM_NOT_STATE = ("{name} is a sum over the loop's steps (c = c + e, its terms reading the loop's state), which the "
                 "loop carries beside its state: unrolled, the two are not told apart, and both keep ordinary "
                 "autograd. A loop that rolls (roll_loops, the default: a loop in a module's forward or a function "
                 "it calls; adjoint_compile.polyfills.loops.rolled() says why one does not) adds up such a sum after "
                 "the loop; else append the terms to a list and sum them after the loop")


def _a_sum(r: Region) -> bool:
    """Whether ``r`` is ``c = c + e`` with e reading another carried value (a loss summed in the loop)."""
    d = getattr(r, "details", None) or {}
    return getattr(r, "source", None) == "unrolled_loop" and str(d.get("a")) in ("1", "1.0") and \
        "b depends on the carry" in str(d.get("gated_because", ""))


def rolled_loop(r: Region) -> bool:
    """Whether ``r`` is a Python loop rolled into torch's scan before dynamo (polyfills/loop_runtime.py's call)."""
    return any(isinstance(n, fx.Node) and is_scan_hop(n) and "polyfills/loop_runtime.py" in
               str(n.meta.get("stack_trace") or "").replace("\\", "/") for n in r.nodes)


def _read_carries(scan: fx.Node) -> int:
    """How many of a scan's carries its step function reads."""
    ref, init = scan.args[0], scan.args[1]
    sub = getattr(scan.graph.owning_module, str(ref.target), None) if isinstance(ref, fx.Node) else ref
    if not isinstance(sub, fx.GraphModule) or not isinstance(init, (list, tuple)):
        return 0
    return sum(1 for n in [n for n in sub.graph.nodes if n.op == "placeholder"][:len(init)] if n.users)


def _highway_refusal(r: Region) -> str | None:
    """Why mode='highway' would not take the gated recurrence ``r`` either (passes/lower/highway.py's structural
    checks), or None: the reasons of the other modes then point to it."""
    if r.details.get("cell"):
        return None
    scans = [n for n in r.nodes if isinstance(n, fx.Node) and is_scan_hop(n)]
    if scans:
        # NB: a rolled loop is unrolled for mode='highway'; the carries its step reads stay carried there
        return MORE_THAN_ONE_STATE if rolled_loop(r) and max(map(_read_carries, scans)) > 1 else None
    rec = getattr(r, "reroll", None)
    if r.source != "unrolled_loop" or rec is None:
        return f"it rewrites gated recurrences written as loops or torch's scan, not from {r.source!r}"
    return rec.highway_refusal()


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**17 else f"{n / 2**10:.0f} KiB"


def declines(memory: dict[str, int], shards: int) -> str:
    """Why a sharded rewrite with this estimate (lower_adjoint.expected_memory) would not pay, or "" when it does.

    The rewrite always costs time (each shard's forward is recomputed in the backward), so it must save memory:
    it is declined when what it keeps (boundary states, one shard's recomputed activations, and the full-length
    outputs that per-step ops outside the region keep alive because the region hands them over whole) exceeds what
    ordinary autograd saves for the region's ops (a region that runs as one shard is declined by the
    lowering).
    """
    kept = memory["sharded"] + memory.get("kept_outside", 0)
    if kept <= memory["autograd"]:
        return ""
    outside = (f" + {mib(memory['kept_outside'])} of full-length outputs that per-step ops outside the region keep "
               f"alive" if memory.get("kept_outside") else "")
    pe = (f", {mib(memory['per_example'])} of them per-example parameter gradients for per_sample_clip"
          if memory.get("per_example") else "")
    return (f"declined: the rewrite would not pay: it would keep ~{mib(memory['sharded'])} (boundary states and one "
            f"shard{pe}){outside} against <= {mib(memory['autograd'])} for ordinary autograd, and recompute the region's "
            f"forward in {shards} shard(s) in the backward; it keeps ordinary autograd")


def _lowered_reason(r: Region, out: Lowered) -> str:
    if out.note:
        captured = r.details.get("captured_by")
        return f"{out.note} (captured by {captured})" if captured else out.note
    mem = out.memory
    if out.rewrite == "truncated":
        # NB: "at T": a region serving every length is truncated at the longer ones
        exact = f" >= T: exact gradients at T={out.steps}" if out.window >= out.steps else ""
        how = f"sharded truncated adjoint (window={out.window}{exact})"
    else:
        how = "sharded exact adjoint"
    why = (f"{how}: {out.scans} scan(s), {out.nodes} nodes, shard_size={out.shard_size} of "
           f"T={out.steps}; activations <= {mib(mem['autograd'])} -> ~{mib(mem['sharded'])}")
    if mem.get("kept_outside"):
        why += f" + {mib(mem['kept_outside'])} kept by per-step ops outside"
    took = [f"{len(out.details[k])} {what}" for k, what in (("embeddings", "embedding lookup(s)"),
                                                               ("sums_over_time", "sum(s) over time"))
            if out.details.get(k)]
    if took:
        # NB: what the region starts or ends with is never stored whole: its inputs' and outputs' [B, T, ...]
        why += f"; takes in {' and '.join(took)}"
    if tail := out.details.get("loss_tail"):
        # NB: the loss ends the graph: its gradient is known up to the scalar cotangent (runtime/loss_tail.py)
        why += (f"; its loss runs once, with its gradient, in the forward, {tail['chunk']} of {tail['steps']} steps "
                f"at a time")
        if tail.get("fused_heads"):
            why += " (vocabulary head and cross-entropy fused: no logits kept)"
    if returned := out.details.get("returned_whole"):
        # NB: a graph's outputs exist whole whatever the region does: the logits a model returns with its loss
        what = ", ".join(f"{o['name']} {o['shape']}" for o in returned)
        why += (f"; keeps {what} whole ({mib(sum(o['bytes'] for o in returned))}): an output of the model besides "
                f"the loss (the logits, when it returns them), and the compiled function's outputs are never "
                f"sharded; return the loss alone (transformers' ...ForCausalLM: adjoint_compile.loss_only(model))")
    if before := out.details.get("before_loss"):
        # NB: under sequence parallelism (or per-example clipping of a loss it cannot split by example) the region
        # ends before the loss: the logits whole
        what, mode = ", ".join(f"{o['name']} {o['shape']}" for o in before), before[0]["mode"]
        cause = f" ({before[0]['cause']})" if before[0].get("cause") else ""
        why += (f"; ends before the loss under {mode}{cause}, so {what} ({mib(sum(o['bytes'] for o in before))}) is "
                f"made whole for it (without {mode} the loss joins the region)")
    if out.details.get("resets"):
        # NB: packed sequences (analysis/resets.py): the decay is zeroed where a document starts
        why += f"; resets the state at document boundaries ({len(out.details['resets'])} mask(s))"
    if getattr(r, "rerolled_from", None):
        # NB: loops and scan ops are re-rolled; closed forms (log-space, cumprod) and registered scans are replaced
        how = "re-rolled" if r.source in ("scan", "associative_scan", "unrolled_loop") else "rewritten"
        why += f" ({how} into {r.nodes[0].name})"
    if r.details.get("captured_by"):
        why += f" (captured by {r.details['captured_by']})"
    return why


def settle(regions: Sequence[Region], plans: Sequence[Plan],
           outcomes: Sequence[Lowered | NotLowered | None]) -> None:
    """Write each region's decision: its plan, or for a region a lowering was tried on, the outcome.

    Regions lowered into the same call share a ``group`` when the call holds more than one of them (numbered in
    graph order; a lowered region alone in its call has none); a residual chain whose nodes went into sharded
    regions says so (its own rewrite is Highway-BP).
    """
    calls = list(dict.fromkeys(o.call for o in outcomes if isinstance(o, Lowered)))
    per_call = {c: sum(1 for o in outcomes if isinstance(o, Lowered) and o.call == c) for c in calls}
    shared = [c for c in calls if per_call[c] > 1]
    inside: set[str] = set().union(*(o.members for o in outcomes if isinstance(o, Lowered)))
    for r, p, out in zip(regions, plans, outcomes):
        if isinstance(out, Lowered):
            r.rewrite, r.reason, r.bounds = out.rewrite, _lowered_reason(r, out), list(out.bounds)
            # NB: the lowering's grouping replaces recognition's neighbourhood groups for what was lowered
            r.group = shared.index(out.call) if out.call in shared else None
            r.details.update({"region_call": out.call, "shard_size": out.shard_size, "region_nodes": out.nodes,
                              "members": sorted(out.members), "expected_memory_bytes": dict(out.memory),
                              **out.details})
            if out.window is not None:
                r.details["window"] = out.window
            continue
        r.rewrite, r.reason = "none", out.why if isinstance(out, NotLowered) else p.reason
        if isinstance(out, NotLowered) and out.memory:
            r.details["expected_memory_bytes"] = dict(out.memory)
        elif isinstance(out, NotLowered) and not out.covered:
            # NB: a lowering that failed on the region itself, not on its size: a longer call fails the same way
            r.details["lowering_failed"] = True
        if isinstance(out, NotLowered) and out.covered:
            r.details["covered"] = True
        if r.kind == "residual_chain" and calls and r.nodes:
            _chain_inside(r, inside, calls, any(isinstance(o, Lowered) and o.rewrite == "truncated" for o in outcomes))


def _chain_inside(r: Region, inside: set[str], calls: list[str], truncated: bool) -> None:
    n = sum(1 for x in r.nodes if x.name in inside)
    where = ", ".join(calls)
    if n == len(r.nodes):
        # NB: truncated mode truncates along time only: the joins between layers are differentiated exactly
        exact = "adjoint (truncated along time only)" if truncated else "exact adjoint"
        r.reason = (f"all of its nodes run inside the sharded region ({where}), whose {exact} already carries "
                    f"∂L/∂Y_k-1 through every layer (exactly, in every mode)")
        r.details["covered"] = True
    elif n:
        r.reason += f"; {n} of its {len(r.nodes)} nodes run inside sharded regions ({where})"
    r.details["nodes_in_sharded_regions"] = n
