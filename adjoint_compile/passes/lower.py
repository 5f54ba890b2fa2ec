"""Stage 3: lower each recognized region with the rewrite its kind and ``options["mode"]`` call for.

Every region leaves this stage with ``rewrite`` set: the rewrite applied, or ``"none"`` and a ``reason``.
A lowering that cannot prove its preconditions returns None and the region keeps ordinary autograd.
"""
from __future__ import annotations

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
            r.reason = r.reason or f"mode='exact' rewrites recurrences; a {r.kind} keeps ordinary autograd"
    if not recurrences:
        return []
    return lower_recurrences(captured.gm, recurrences, opts)
