"""Stage 4 of the pipeline: lower each region with the rewrite its plan names (passes/decide/).

Before (a region planned "adjoint")::

    h = linear_scan(a, b)            # + the time-local ops around it
    y = h * c

After::

    adjoint_region_0 = ShardedRegion(...)      # runtime/sharded.py
    region = self.adjoint_region_0(a, b, c)
    y = region[0]

A lowering takes the graph and the regions planned for it and returns one typed outcome per region
(:class:`~adjoint_compile.regions.Lowered` or :class:`~adjoint_compile.regions.NotLowered` with the reason); it
writes nothing on the records. A new rewrite is an entry in :data:`LOWERINGS` (and in decide.TABLE).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch.fx as fx

from ...options import Options
from ...regions import Lowered, NotLowered, Region
from ..capture import Captured
from .. import decide
from ..decide import Plan
from .sharded import lower_recurrences
from .highway import lower_highway
from .seqpar import SeqParPlan, lower_seqpar

log = logging.getLogger(__name__)

__all__ = ["LOWERINGS", "lower", "lower_sequence_parallel", "lowered_calls"]

Lowering = Callable[[fx.GraphModule, list, Options], "list[Lowered | NotLowered]"]

#: rewrite name -> the lowering that applies it to the regions planned for it.
LOWERINGS: dict[str, Lowering] = {
    "adjoint": lower_recurrences,
    # NB: the same lowering: the regions, shards and saved tensors are exact mode's; it reads opts.window
    "truncated": lower_recurrences,
    "highway": lower_highway,
}


def lower(captured: Captured, regions: Sequence[Region], plans: Sequence[Plan],
          opts: Options) -> list[Lowered | NotLowered | None]:
    """Rewrite ``captured.gm`` in place; per region its outcome, or None when its plan is "none"."""
    outcomes: list[Lowered | NotLowered | None] = [None] * len(regions)
    order = list(LOWERINGS.items())
    if opts.mode == "highway":
        # NB: the split: a chain over depth gets Highway-BP even where its blocks hold linear scans (a
        # pre-LN SSM stack), rather than being absorbed by the scans' sharded exact region; those scans then run
        # inside the chain's blocks, differentiated by linear_scan's own exact adjoint
        order.sort(key=lambda kv: kv[0] != "highway")
    for rewrite, lowering in order:
        idx = [i for i, p in enumerate(plans) if p.rewrite == rewrite]
        if rewrite != "highway":
            idx = [i for i in idx if not _taken(captured.gm, regions[i], outcomes, i)]
        if not idx:
            continue
        for i, out in zip(idx, lowering(captured.gm, [regions[i] for i in idx], opts)):
            outcomes[i] = out
    missing = {p.rewrite for p in plans} - set(LOWERINGS) - {"none"}
    if missing:  # NB: a TABLE entry without its lowering is a bug of ours; the regions keep ordinary autograd
        log.warning("adjoint-compile: no lowering for rewrite(s) %s", sorted(missing))
        for i, p in enumerate(plans):
            if p.rewrite in missing:
                outcomes[i] = NotLowered(f"the {p.rewrite!r} lowering is not available")
    return outcomes


def _taken(gm: fx.GraphModule, r: Region, outcomes: list[Lowered | NotLowered | None], i: int) -> bool:
    """True (and its outcome set) when a Highway-BP chain lowered first took region ``r``'s nodes into its blocks."""
    present = set(gm.graph.nodes)
    if all(n in present for n in r.nodes if isinstance(n, fx.Node)):
        return False
    chains = [o.call for o in outcomes if isinstance(o, Lowered) and o.rewrite == "highway"]
    where = f"the Highway-BP chain {', '.join(chains)}" if chains else "a Highway-BP region"
    outcomes[i] = NotLowered(f"runs inside the blocks of {where}: differentiated there by linear_scan's own exact "
                             f"adjoint (a reverse scan over all steps, not sharded; J = 0, so exact in highway mode)",
                             covered=True)
    return True


def lowered_calls(outcomes: Sequence[Lowered | NotLowered | None]) -> list[str]:
    """The names of the region call nodes the outcomes made, in order, each once."""
    return list(dict.fromkeys(o.call for o in outcomes if isinstance(o, Lowered)))


def lower_sequence_parallel(captured: Captured, regions: Sequence[Region], plans: Sequence[Plan],
                            opts: Options) -> tuple[SeqParPlan, bool]:
    """Under ``sequence_parallel``: the distributed scans and halos put in (:mod:`.seqpar`), and in exact mode the
    one-scan regions sharded inside each rank (a region of several scans is cut into one region per scan: it is
    not lowered whole). Returns the lowering and whether the regions' decisions were settled."""
    settled = []

    def shard() -> list[str]:
        outcomes = lower(captured, regions, plans, opts)
        calls = lowered_calls(outcomes)
        for i, o in enumerate(outcomes):
            if isinstance(o, Lowered) and o.scans > 1:
                outcomes[i] = NotLowered(decide.SEQUENCE_PARALLEL_MULTI.format(scans=o.scans))
        decide.settle(regions, plans, outcomes)
        settled.append(True)
        return calls

    sp = lower_seqpar(captured.gm, list(captured.example_inputs), opts, shard=shard if regions else None)
    return sp, bool(settled)
