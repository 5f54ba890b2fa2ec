"""Stage 3: lower each recognized region with the rewrite its kind and ``options["mode"]`` call for.

Every region leaves this stage with ``rewrite`` set: the rewrite applied, or ``"none"`` and a ``reason``.
A lowering that cannot prove its preconditions returns None and the region keeps ordinary autograd.
"""
from __future__ import annotations

import dataclasses
import logging

from ..options import Options
from ..regions import Recurrence, Region
from .capture import Captured

log = logging.getLogger(__name__)


def lower_regions(captured: Captured, regions: list[Region], opts: Options) -> list[str]:
    """Rewrite what can be rewritten in ``captured.gm`` (in place); return the names of the region call nodes."""
    if opts.mode != "exact":
        for r in regions:
            r.rewrite = "none"
            r.reason = f"mode={opts.mode!r} is not implemented yet; the region keeps ordinary autograd"
        return []
    try:
        from .lower_adjoint import lower_recurrences
    except ImportError as e:
        for r in regions:
            r.rewrite = "none"
            r.reason = f"the exact adjoint lowering is not available ({e})"
        return []
    recurrences = [r for r in regions if isinstance(r, Recurrence)]
    for r in regions:
        if not isinstance(r, Recurrence):
            r.rewrite = "none"
            # NB: overwrite recognition's placeholder reason: in exact mode a chain is not rewritten by design.
            r.reason = (f"mode='exact' shards recurrences only; a {r.kind}'s own rewrite is Highway-BP "
                        "(mode='highway', not implemented yet)")
    if not recurrences:
        return []
    from .canonical_shifts import canonicalize_shifts
    from .seeded_dropout import seed_dropouts

    canonicalize_shifts(captured.gm)
    seed_dropouts(captured.gm)
    pairs = _reroll(captured, recurrences, opts)
    made = lower_recurrences(captured.gm, [v for v, _ in pairs], opts)
    for r in recurrences:
        if r.kind == "gated_recurrence" and r.rewrite == "none":
            r.reason = ("a gated recurrence (its coefficient depends on h) has no adjoint-sharded rewrite yet; "
                        "it keeps ordinary autograd")
    for r in regions:
        if isinstance(r, Recurrence) or not r.nodes:
            continue
        # NB: lowering erases the nodes it moves into a region call; a chain whose every node went there is
        # differentiated exactly by the sharded adjoint already (its rewrite is still "none": the chain is not
        # rewritten as a chain).
        inside = sum(1 for n in r.nodes if getattr(n, "_erased", False))
        if inside == len(r.nodes):
            r.reason = (f"all of its nodes run inside the sharded region ({', '.join(made)}), whose exact adjoint "
                        f"already carries ∂L/∂Y_k-1 through every layer; mode='highway' (not implemented yet) would "
                        f"rewrite the chain itself")
        elif inside:
            r.reason += f"; {inside} of its {len(r.nodes)} nodes run inside sharded regions ({', '.join(made)})"
        r.details["nodes_in_sharded_regions"] = inside
    for view, originals in pairs:
        for r in originals:
            into = r.details.get("rerolled_into")
            r.rewrite, r.group, r.bounds = view.rewrite, view.group, list(view.bounds)
            r.reason = view.reason + (f" (re-rolled into {into})" if into else "")
            r.details.update({k: view.details[k] for k in ("region_call", "shard_size", "region_nodes",
                                                           "expected_memory_bytes")
                              if k in view.details})
    return made


def _reroll(captured: Captured, recurrences: list[Recurrence], opts: Options) -> list[tuple[Recurrence, list]]:
    """recognize -> reroll -> recognize again: (record to lower, original records that take its outcome).

    Recurrences captured as torch's scan, associative_scan or an unrolled loop become linear_scan nodes
    (:mod:`.reroll`); their fresh records are lowered under source "linear_scan", and the outcome is copied to the
    records the report holds.
    """
    from .reroll import needs_reroll, reroll

    pairs: list[tuple[Recurrence, list]] = [(r, []) for r in recurrences]
    if not any(needs_reroll(r) for r in recurrences) or not reroll(captured.gm, recurrences):
        return pairs
    from .find_recurrences import is_linear_scan
    from .recognize import recognize

    fresh = {r.nodes[0].name: r for r in recognize(captured.gm, opts)[0]
             if isinstance(r, Recurrence) and r.nodes and is_linear_scan(r.nodes[0]) and r.source != "linear_scan"}
    out: list[tuple[Recurrence, list]] = []
    for r in recurrences:
        f = fresh.pop(r.details.get("rerolled_into", ""), None) if needs_reroll(r) else None
        out.append((r, []) if f is None else (dataclasses.replace(f, source="linear_scan"), [r, f]))
    # NB: scans with no record of their own (an associative_scan's running product) are lowered too
    out += [(dataclasses.replace(f, source="linear_scan"), [f]) for f in fresh.values()]
    return out
