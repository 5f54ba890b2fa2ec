"""Highway mode lowering of a loop over ``nn.GRUCell`` / ``nn.LSTMCell``: the T opaque cell calls become one call
of the Highway-BP runtime.

Before (passes/match/find_cells.py's chain: each call reads the previous one's state, all with the same weights)::

    h_1 = torch.gru_cell(x_1, h0, w_ih, w_hh, b_ih, b_hh)
    h_2 = torch.gru_cell(x_2, h_1, w_ih, w_hh, b_ih, b_hh)   ...

After::

    xs = torch.stack([x_1, x_2, ...])                   # the per-step inputs, computed outside the loop
    highway_region_0 = HighwayScan(...)                  # runtime/highway.py
    scan = self.highway_region_0(h0, xs, w_ih, w_hh, b_ih, b_hh)
    h_2 = torch.select(scan[1], 0, 1)  ...

The forward runs the cell itself (``torch.gru_cell`` / ``torch.lstm_cell``); the split is the cell's equations
(gates as torch computes them): GRU h' = z ⊙ h + (1 - z) ⊙ n (K = diag(z)); LSTM c' = f ⊙ c + i ⊙ g (K = diag(f))
beside h' = o ⊙ tanh(c') (r = z, K = 0). A per-step input that depends on the loop's states (input feeding), or a
cell result used other than as the states, keeps ordinary autograd with the reason.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.fx import reachable
from ...analysis.fx import stable_toposort as _toposort
from ...options import Options
from ...regions import PROVENANCE, Lowered, Recurrence
from ...runtime.highway import HighwayScan, StepChain

__all__ = ["CellsRefused", "lower_cells", "PARTS"]


class CellsRefused(Exception):
    pass


#: per cell: the carries' forms as explain() reports them (lower_highway.describe's format).
PARTS = {"gru_cell": [{"form": "gated", "r": "z1 ⊙ h + z2 (z1 = z, z2 = (1 - z) ⊙ n)", "K": "diag(z)"}],
         "lstm_cell": [{"form": "state (z)", "r": "z", "K": "0"},
                       {"form": "gated", "r": "z1 ⊙ c + z2 (z1 = f, z2 = i ⊙ g)", "K": "diag(f)"}]}


def _gru(h: list, x: list, w: list) -> list:
    gi, gh = F.linear(x[0], w[0], w[2]), F.linear(h[0], w[1], w[3])
    r_x, z_x, n_x = gi.chunk(3, -1)
    r_h, z_h, n_h = gh.chunk(3, -1)
    r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
    return [z, (1 - z) * torch.tanh(n_x + r * n_h)]


def _lstm(h: list, x: list, w: list) -> list:
    i, f, g, o = (F.linear(x[0], w[0], w[2]) + F.linear(h[0], w[1], w[3])).chunk(4, -1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    ig = i * g
    return [o * torch.tanh(f * h[1] + ig), f, ig]


def _chain(kind: str, opts: Options) -> StepChain:
    if kind == "gru_cell":
        def step(h: list, x: list, w: list) -> tuple[list, list]:
            new = torch.gru_cell(x[0], h[0], *w)
            return [new], [new]

        return StepChain(step, _gru, lambda h, Z: [Z[0] * h[0] + Z[1]], [0], opts.iterations or 0, opts.tolerance)

    def lstm_step(h: list, x: list, w: list) -> tuple[list, list]:
        new = list(torch.lstm_cell(x[0], (h[0], h[1]), *w))
        return new, new

    return StepChain(lstm_step, _lstm, lambda h, Z: [Z[0], Z[1] * h[1] + Z[2]], [0, 1], opts.iterations or 0,
                     opts.tolerance)


def lower_cells(gm: fx.GraphModule, r: Recurrence, opts: Options, name: str) -> tuple[Lowered, list[dict[str, str]]]:
    """Replace the chain of cell calls ``r.nodes`` by one HighwayScan call named ``name`` (raises
    :class:`CellsRefused` with the reason, the graph untouched)."""
    kind = r.details.get("cell")
    cells = [n for n in r.nodes if isinstance(n, fx.Node)]
    if kind not in PARTS or len(cells) < 2:
        raise CellsRefused("not a chain of torch.gru_cell / torch.lstm_cell calls")
    if cells[0].kwargs or any(len(c.args) not in (4, 6) for c in cells):
        raise CellsRefused("a cell call with keyword arguments or without its weights")
    weights = list(cells[0].args[2:])
    weights += [None] * (4 - len(weights))
    G = gm.graph
    inside = set(cells)
    # the states: each call (GRU) or its two items (LSTM), and nothing else may read a call
    states: list[list[fx.Node | None]] = []
    for t, c in enumerate(cells):
        if kind == "gru_cell":
            states.append([c])
            continue
        items: list[fx.Node | None] = [None, None]
        for u in c.users:
            if u.target is operator.getitem and u.args[0] is c and u.args[1] in (0, 1) and items[u.args[1]] is None:
                items[u.args[1]] = u
            elif not (t + 1 < len(cells) and u is cells[t + 1]):
                raise CellsRefused(f"the cell result {c.name} is used other than as its h and c")
        states.append(items)
    xs = [c.args[0] for c in cells]
    for t, x in enumerate(xs):
        if not isinstance(x, fx.Node):
            raise CellsRefused(f"step {t}'s input is not a graph value")
    loop = reachable(cells) - set(cells)
    if any(x in loop or x in inside for x in xs):
        raise CellsRefused("a step's input depends on the loop's states (input feeding): not a scan over inputs")
    h0 = cells[0].args[1]
    init = [h0] if kind == "gru_cell" else list(h0) if isinstance(h0, (tuple, list)) else None
    if init is None or not all(isinstance(v, fx.Node) for v in init):
        raise CellsRefused("the loop's initial state is not a graph value")
    mod = HighwayScan(_chain(kind, opts), len(init), 1, torch.nn.Identity())
    mod.label = name
    gm.add_submodule(name, mod)
    with G.inserting_after(cells[-1]):
        stack = G.call_function(torch.stack, (xs,))
    with G.inserting_after(stack):
        call = G.call_module(name, (*init, stack, *weights))
    ys = []
    prev = call
    for c in range(len(init)):
        with G.inserting_after(prev):
            ys.append(G.call_function(operator.getitem, (call, len(init) + c)))
        prev = ys[-1]
    for t, per in enumerate(states):
        for c, st in enumerate(per):
            if st is None:
                continue
            users = [u for u in st.users if u not in inside]
            if not users:
                continue
            with G.inserting_after(ys[c]):
                sel = G.call_function(torch.select, (ys[c], 0, t))
            sel.meta = dict(st.meta)
            for u in users:
                u.replace_input_with(st, sel)
    for n in reversed(list(G.nodes)):
        if (n in inside or any(n in per for per in states)) and not n.users:
            G.erase_node(n)
    _toposort(G)
    call.meta[PROVENANCE] = {"rewrite": "highway", "loop": r.name, "iterations": opts.iterations}
    parts = PARTS[kind]
    return Lowered(rewrite="highway", call=call.name, members=frozenset(n.name for n in cells), steps=len(cells),
                   nodes=len(cells), details={"iterations": opts.iterations, "highway_carries": parts}), parts
