"""A cheap look at a graph before the matchers run: which matcher families have a candidate at all.

One pass over the nodes, reading each node's op once, tells for each family of matchers whether the graph holds
the ops its candidates are made of; a family without any is not run (capture and recognition ask
:func:`candidates`). What each family needs, read off its matcher (nothing the matcher would record, accept or
reject is missed, an exception inside a matcher aside):

* ``scans`` (:func:`~.find_recurrences.find_recurrences`): a ``linear_scan`` node, torch's ``scan`` /
  ``associative_scan`` op, a closed form (``cumprod``, ``logcumsumexp``; a generic-mode associative_scan, which
  dynamo inlines as vmap blocks), or a node whose provenance says why an earlier pass left it (``not_recognized``);
* ``slices`` (:func:`~.unrolled.find_unrolled`, and tree scans written in plain torch): an indexing op
  (``getitem``, ``select``, ``narrow``): an unrolled loop is recorded only with per-step slices, and reported as a
  near miss only when it reads one;
* ``cells`` (:func:`~.find_cells.find_cells`): a ``torch.gru_cell`` / ``torch.lstm_cell`` call;
* ``sums`` (:func:`~.find_residuals.find_residuals`): an add, sub or addcmul (a residual layer's sum).

``CHECK`` (set by the environment variable ``ADJOINT_COMPILE_CHECK_PREFILTER=1``, and by the test suite) runs a
skipped matcher anyway: whatever it finds is used, and a note is appended to :data:`DISAGREEMENTS` (the tests
fail on one).
"""
from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...analysis import optable as ops
from ...analysis.fx import is_linear_scan
from ...regions import PROVENANCE

__all__ = ["Candidates", "candidates", "run_or_skip", "CHECK", "DISAGREEMENTS"]

#: run skipped matchers anyway and note what they find (module docstring)
CHECK = os.environ.get("ADJOINT_COMPILE_CHECK_PREFILTER", "") not in ("", "0")
#: what skipped matchers found under CHECK: (family, matcher, graph size, what)
DISAGREEMENTS: list[str] = []

_CLOSED_FORMS = frozenset({"cumprod", "logcumsumexp"})
_CELLS = frozenset({"gru_cell", "lstm_cell"})
_INDEXING = frozenset({"select", "narrow"})
_VMAP = torch._functorch.predispatch._vmap_increment_nesting


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Which matcher families have a candidate in a graph (module docstring)."""

    scans: bool = True
    slices: bool = True
    cells: bool = True
    sums: bool = True

    @property
    def any(self) -> bool:
        return self.scans or self.slices or self.cells or self.sums


def candidates(gm: fx.GraphModule) -> Candidates:
    """The families with a candidate in ``gm`` (one pass over its nodes; each op is classified once)."""
    found: set[str] = set()
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            key = (n.op, n.target)
            try:
                fam = _FAMILY[key]
            except KeyError:
                fam = _FAMILY[key] = _family(n)
            except TypeError:  # NB: an unhashable target
                fam = _family(n)
            if fam is not None:
                found.add(fam)
        if "scans" not in found and isinstance(prov := n.meta.get(PROVENANCE), dict) and prov.get("not_recognized"):
            found.add("scans")
    return Candidates("scans" in found, "slices" in found, "cells" in found, "sums" in found)


#: (node op, target) -> the family its op is a candidate of (None: none)
_FAMILY: dict[tuple[str, Any], str | None] = {}


def _family(n: fx.Node) -> str | None:
    if n.op == "call_function":
        t = n.target
        if t is operator.getitem:
            return "slices"
        if isinstance(t, torch._ops.HigherOrderOperator):
            return "scans" if t.name() in ("scan", "associative_scan") else None
        if t is _VMAP or is_linear_scan(n):
            return "scans"
    fname = ops.fn_name(n)
    name = ops.op_name(n) or fname
    if name in ops.SUM_OPS:
        return "sums"
    if name in _INDEXING or fname in _INDEXING:
        return "slices"
    if name in _CLOSED_FORMS or fname in _CLOSED_FORMS:
        return "scans"
    if n.op == "call_function" and fname in _CELLS:
        return "cells"
    return None


def run_or_skip(wanted: bool, family: str, fn: Callable[[fx.GraphModule], tuple[list[Any], list[Any]]],
                gm: fx.GraphModule) -> tuple[list[Any], list[Any]]:
    """``fn(gm)`` when ``wanted``; else nothing, or under ``CHECK`` ``fn(gm)`` with a note when it finds anything."""
    if wanted:
        return fn(gm)
    if not CHECK:
        return [], []
    found, rejected = fn(gm)
    if found or rejected:
        DISAGREEMENTS.append(f"{family}: {getattr(fn, '__name__', fn)} found {len(found)} and rejected {len(rejected)} "
                             f"in a graph of {len(gm.graph.nodes)} nodes the pre-filter skipped "
                             f"({[getattr(j, 'reason', j) for j in rejected][:2]})")
    return found, rejected
