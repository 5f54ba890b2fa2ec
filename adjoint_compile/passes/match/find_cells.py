"""Loops over torch's recurrent cells (``nn.GRUCell``, ``nn.LSTMCell``): gated recurrences, recognized and reported.

Dynamo records a cell call as one opaque node, ``torch.gru_cell(x_t, h, w_ih, w_hh, b_ih, b_hh)`` or
``torch.lstm_cell(x_t, (h, c), ...)`` (a tuple: ``[0]`` is h, ``[1]`` is c). Their updates are the gated forms of
DESIGN.md §3: GRU ``h' = (1 - z) ⊙ n + z ⊙ h`` and the LSTM cell state ``c' = f ⊙ c + i ⊙ g``, with the gates
z, n, f, i, g computed from h. A chain of such calls, each reading the previous one's state with the same weights,
is one ``gated_recurrence`` (source ``unrolled_loop``); nothing is re-rolled (exact mode has no rewrite for a gated
recurrence: passes/decide/ says so; highway mode lowers the chain with passes/lower/highway_cells.py). A chain whose calls read different weights is a stack of layers, not a loop
over time, and is not reported.
"""
from __future__ import annotations

import logging
import operator

import torch.fx as fx

from ...analysis.fx import hinted_shape
from ...regions import Recurrence, Rejection

log = logging.getLogger(__name__)

__all__ = ["find_cells"]

_CELLS = {"gru_cell": "h' = (1 - z) ⊙ n + z ⊙ h with the gates z, n computed from h (torch.gru_cell)",
          "lstm_cell": "c' = f ⊙ c + i ⊙ g with the gates f, i, g computed from h (torch.lstm_cell)"}


def _cell(n: fx.Node) -> str | None:
    name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
    return name if name in _CELLS else None


def _prev(n: fx.Node, kind: str) -> fx.Node | None:
    """The cell call whose state ``n`` reads, if any."""
    if len(n.args) < 2:
        return None
    hx = n.args[1]
    if kind == "gru_cell":
        return hx if isinstance(hx, fx.Node) and _cell(hx) == kind else None
    if not isinstance(hx, (tuple, list)) or len(hx) != 2:
        return None
    srcs = set()
    for i, v in enumerate(hx):
        if not (isinstance(v, fx.Node) and v.target is operator.getitem and v.args[1] == i and
                isinstance(v.args[0], fx.Node) and _cell(v.args[0]) == kind):
            return None
        srcs.add(v.args[0])
    return srcs.pop() if len(srcs) == 1 else None


def find_cells(gm: fx.GraphModule) -> tuple[list[Recurrence], list[Rejection]]:
    """Gated recurrences of ``gm`` written as loops over ``torch.gru_cell`` / ``torch.lstm_cell``."""
    nxt: dict[fx.Node, fx.Node] = {}
    cells = [n for n in gm.graph.nodes if _cell(n)]
    for n in cells:
        p = _prev(n, _cell(n))
        if p is not None and p not in nxt and list(p.args[2:]) == list(n.args[2:]) and p.kwargs == n.kwargs:
            nxt[p] = n
    has_prev = set(nxt.values())
    out = []
    for n in cells:
        if n in has_prev or n not in nxt:
            continue
        chain = [n]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        kind = _cell(n)
        hx = n.args[1]
        h0 = hx if isinstance(hx, fx.Node) else (hx[1] if isinstance(hx, (tuple, list)) else None)
        shp = hinted_shape(chain[-1]) if kind == "gru_cell" else None
        out.append(Recurrence(
            kind="gated_recurrence", source="unrolled_loop", length=len(chain), nodes=list(chain),
            name=chain[-1].name, h0=h0 if isinstance(h0, fx.Node) else None, carry=n, outputs=list(chain),
            step_dim=0, details={"form": "gated", "cell": kind, "gated_because": _CELLS[kind],
                                 **({"shape": list(shp)} if shp else {})}))
        log.debug("find_cells: %d %s calls at %s", len(chain), kind, chain[-1].name)
    return out, []
