"""Re-roll the per-step readouts of a re-rolled loop with its recurrence (after :mod:`.reroll`).

A loop that reads its state out at every step (transformers' Mamba: ``ys.append(h @ C[:, t, :, None])``; fla's
GLA: ``o_t = (q_t[..., None] * S).sum(-2)``) leaves, once :mod:`.reroll` has made the scan ``H`` and replaced state
k by ``H[k]``, T copies of the readout, each on ``H[k]`` and the step's slices of other inputs::

    y_k = f(H[k], C[:, k, :, None])        k = 0 .. T-1
    y   = torch.stack([y_0, ..., y_{T-1}], 1)

Kept like that, each ``H[k]``'s backward allocates a zero tensor of the full length: O(T²) time and memory, and
the per-step nodes keep the whole ``H`` alive outside any sharded region. This pass proves the T copies are one
computation and emits it once, ``Y = f(H, C.movedim(1, 0)[..., None])`` (the batched re-emission of
:mod:`.batching`), so the readout joins the scan's time-local region:

1. **Steps.** Each node is tagged with the one step k whose ``H[k]`` it depends on (or "many"); step k's readout
   is the nodes tagged k. Every step 0..T-1 must have one.
2. **Same computation.** Step k's nodes, in graph order, must match step 0's op by op (same op and constants);
   each argument is the step's ``H[k]``, a node of the step at the same position, the very same node outside
   (a shared weight), or a *side value*: a node made per step from outside values only (``C[:, k]`` and what is
   computed from it, such as ``.unsqueeze(-1)``), matched recursively. Indices of side slices must progress by
   ±1 per step (``C[:, k]``, ``C[:, k:k + 1]``, ``C[:, T - 1 - k]``).
3. **Uses.** A ``stack`` (or ``cat``) of all T copies of a readout value becomes ``Y.movedim(0, d)`` (flattened
   into d for ``cat``); any other use of copy k reads ``Y.unbind(0)[k]``.

Whatever cannot be proven leaves the readouts as they are, but then their remaining reads of ``H[k]`` go through
one ``H.unbind(0)`` (whose backward is one ``stack``: O(T)), and the scan's provenance says why
(``readouts``: shown in ``explain()``'s details). Part of the capture stage (passes/capture/).
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import hinted_shape, is_linear_scan
from ...analysis.fx import eliminate_dead_code
from ...analysis.fx import stable_toposort as _toposort
from ...analysis.labels import index_kind, node_args, node_label
from ...regions import PROVENANCE
from .batching import Batcher, Emitter, Unproven, Value
from .reroll import step_sequence

log = logging.getLogger(__name__)

__all__ = ["reroll_readouts"]

_MANY = -1


def _picks(H: fx.Node, T: int) -> dict[int, fx.Node]:
    """Step k -> the one node ``H[k]`` (duplicates merged into the first)."""
    out: dict[int, fx.Node] = {}
    for u in list(H.users):
        if u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 and \
                isinstance(u.args[1], int) and not isinstance(u.args[1], bool) and -T <= u.args[1] < T:
            k = u.args[1] % T
            if k in out:
                u.replace_all_uses_with(out[k])
            else:
                out[k] = u
    return out


def _tags(gm: fx.GraphModule, picks: dict[int, fx.Node]) -> dict[fx.Node, int]:
    """Each node that depends on some ``H[k]``: k when it depends on exactly one, else ``_MANY``."""
    tags = {g: k for k, g in picks.items()}
    started = False
    for n in gm.graph.nodes:
        if n in tags:
            started = True
            continue
        if not started:
            continue
        ts = {tags[a] for a in n.all_input_nodes if a in tags}
        if ts:
            tags[n] = ts.pop() if len(ts) == 1 else _MANY
    return tags


class _Steps:
    """The T readout copies, matched against step 0's."""

    def __init__(self, picks: dict[int, fx.Node], tags: dict[fx.Node, int], T: int) -> None:
        self.picks, self.tags, self.T = picks, tags, T
        per: dict[int, list[fx.Node]] = {k: [] for k in range(T)}
        for n, k in tags.items():
            if k != _MANY and n is not picks[k]:
                per[k].append(n)
        order = {n: i for i, n in enumerate(next(iter(picks.values())).graph.nodes)}
        self.steps = {k: sorted(v, key=order.__getitem__) for k, v in per.items()}
        self.tmpl = self.steps[0]
        self.tmpl_set = set(self.tmpl)
        #: template side node -> {k: step-k node}; template side slices -> {k: varying ints}
        self.side: dict[fx.Node, dict[int, fx.Node]] = {}
        self.slices: dict[fx.Node, dict[int, tuple[int, ...]]] = {}

    def check(self) -> None:
        if not self.tmpl:
            raise Unproven("no readout")
        for k in range(1, self.T):
            nodes = self.steps[k]
            if len(nodes) != len(self.tmpl):
                raise Unproven(f"the readout of step {k} has {len(nodes)} ops, step 0's {len(self.tmpl)}")
            pair = dict(zip(self.tmpl, nodes))
            for u0, uk in pair.items():
                self._node(u0, uk, k, pair)

    def _node(self, u0: fx.Node, uk: fx.Node, k: int, pair: dict[fx.Node, fx.Node]) -> None:
        if node_label(u0)[0] != node_label(uk)[0] or node_label(u0)[1] != node_label(uk)[1]:
            raise Unproven(f"the readouts differ at node {uk.name} (step {k}) and {u0.name} (step 0)")
        for a0, ak in zip(node_args(u0), node_args(uk)):
            if a0 is self.picks[0]:
                ok = ak is self.picks[k]
            elif a0 in self.tmpl_set:
                ok = pair.get(a0) is ak
            elif a0 is ak:
                ok = a0 not in self.tags
            else:
                ok = a0 not in self.tags and ak not in self.tags and self._side(a0, ak, k)
            if not ok:
                raise Unproven(f"the readouts are wired differently at node {uk.name} (step {k})")

    def _side(self, a0: fx.Node, ak: fx.Node, k: int) -> bool:
        """Match a per-step value made outside the readout (``C[:, k]``, ``C[:, k].unsqueeze(-1)``)."""
        seen = self.side.setdefault(a0, {0: a0})
        if k in seen:
            return seen[k] is ak
        if a0.op not in ("call_function", "call_method") or ak.op != a0.op:
            return False
        (lab0, ints0), (labk, intsk) = node_label(a0), node_label(ak)
        if lab0 != labk:
            return False
        seen[k] = ak
        if index_kind(a0) == "getitem" and a0.args[0] is ak.args[0] and ints0 != intsk:
            self.slices.setdefault(a0, {0: ints0})[k] = intsk
            return a0.args[0] not in self.tags
        if ints0 != intsk:
            return False
        for b0, bk in zip(node_args(a0), node_args(ak)):
            if b0 is bk:
                if b0 in self.tags:
                    return False
            elif b0 in self.tags or bk in self.tags or not self._side(b0, bk, k):
                return False
        return True


def _sequence(b: Batcher, s0: fx.Node, ints: dict[int, tuple[int, ...]]) -> Value:
    """The batched value [T, ...] of the side slice ``s0 = src[idx]`` whose index ints move by ±1 per step."""
    em, T = b.em, b.T
    src, idx = s0.args[0], s0.args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    vals = [ints[k] for k in range(T)]
    vary = [q for q in range(len(vals[0])) if len({v[q] for v in vals}) > 1]
    stride = vals[1][vary[0]] - vals[0][vary[0]] if T > 1 and vary else 0
    if not vary or stride not in (1, -1) or any(v[q] - vals[0][q] != stride * k for k, v in enumerate(vals)
                                                 for q in vary):
        raise Unproven(f"the index of {s0.name} does not move by one per step")
    q, out_dim, found = 0, 0, None
    new_items: list[Any] = []
    for it in items:
        n_ints = sum(isinstance(v, int) and not isinstance(v, bool) for v in
                     ((it.start, it.stop, it.step) if isinstance(it, slice) else (it,)))
        mine = [p for p in vary if q <= p < q + n_ints]
        if mine:
            unit = isinstance(it, slice) and isinstance(it.start, int) and isinstance(it.stop, int) and \
                it.stop - it.start == 1 and it.step in (None, 1) and mine == [q, q + 1]
            if found is not None or not (unit or (isinstance(it, int) and not isinstance(it, bool))):
                raise Unproven(f"the index of {s0.name} is not x[..., k, ...] or x[..., k:k + 1, ...]")
            found = (out_dim, unit, it.start if unit else it)
            new_items.append(slice(None))
        elif it is Ellipsis:
            raise Unproven(f"the index of {s0.name} has ... before its step")
        else:
            new_items.append(it)
        out_dim += 0 if isinstance(it, int) and not isinstance(it, bool) and not mine else 1
        q += n_ints
    assert found is not None
    d, unit, start = found
    shp = hinted_shape(src)
    full = src if all(it == slice(None) for it in new_items) else em(operator.getitem, (src, tuple(new_items)))
    if hinted_shape(full) is None or shp is None:
        raise Unproven(f"{s0.name} has no static shape")
    return Value(step_sequence(em, T, full, d, start, stride, unit, s0.name), True)


def _stacks(gm: fx.GraphModule, em: Emitter, copies: list[fx.Node], y: fx.Node) -> None:
    """A ``stack``/``cat`` of exactly ``copies`` (one per step, in order) becomes ``y`` ([T, ...]) moved there."""
    nd = len(hinted_shape(copies[0]) or ())
    for user in list(copies[-1].users):
        if user.op == "call_function" and user.target in (torch.stack, torch.cat) and user.args and \
                isinstance(user.args[0], (list, tuple)) and list(user.args[0]) == copies:
            d = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
            if not isinstance(d, int) or nd == 0 and user.target is torch.cat:
                continue
            if user.target is torch.stack:
                new = em(torch.movedim, (y, 0, d % (nd + 1)))
            else:
                d = d % nd
                new = em(torch.flatten, (em(torch.movedim, (y, 0, d)), d, d + 1))
            user.replace_all_uses_with(new)
            gm.graph.erase_node(user)


def _commit(gm: fx.GraphModule, em: Emitter, st: _Steps, Y: dict[fx.Node, fx.Node]) -> None:
    """Uses of every readout copy read the batched values: stacks and cats of all copies at once."""
    T = st.T
    for u0, y in Y.items():
        copies = [u0] + [dict(zip(st.tmpl, st.steps[k]))[u0] for k in range(1, T)]
        members = set(copies)
        items = None
        _stacks(gm, em, copies, y)
        for k, c in enumerate(copies):
            outside = [u for u in c.users if not (u in members or st.tags.get(u) == k)]
            if outside:
                if items is None:
                    items = em(torch.unbind, (y, 0))
                c.replace_all_uses_with(em(operator.getitem, (items, k)), delete_user_cb=outside.__contains__)


def _unbind_rest(gm: fx.GraphModule, H: fx.Node, T: int) -> int:
    """Remaining reads ``H[k]`` (two or more) go through one ``H.unbind(0)``: an O(T) backward. Returns how many
    (-1: none, but a cat of all of them became ``H`` itself)."""
    picks = {k: g for k, g in _picks(H, T).items() if g.users}
    if len(picks) < 2:
        return 0
    em = Emitter(gm, {"pass": "reroll_readouts", "scan": H.name}, at=H.next)
    if len(picks) == T:  # NB: a stack or cat of the states themselves (cat: reroll's commit handles stacks only)
        _stacks(gm, em, [picks[k] for k in range(T)], H)
        picks = {k: g for k, g in picks.items() if g.users}
        if len(picks) < 2:
            return -1 if em.made else 0
    items = em(torch.unbind, (H, 0))
    for k, g in picks.items():
        g.replace_all_uses_with(em(operator.getitem, (items, k)))
    return len(picks)


def _one(gm: fx.GraphModule, H: fx.Node) -> str:
    shp = hinted_shape(H)
    if not shp:
        return ""
    T = shp[0]
    picks = _picks(H, T)
    if len(picks) < 2:
        return ""
    if len(picks) != T:
        raise Unproven(f"the loop reads {len(picks)} of its {T} states")
    st = _Steps(picks, _tags(gm, picks), T)
    if not st.tmpl:
        return ""  # NB: the states are used as they are (a stack of them, a cat): nothing per step to re-roll
    st.check()
    em = Emitter(gm, {"pass": "reroll_readouts", "scan": H.name}, at=H.next)
    with em:
        side_slices = set(st.slices)
        inside = st.tmpl_set | (set(st.side) - side_slices)
        shared = lambda v: v not in st.tags and v not in st.side  # noqa: E731
        b = Batcher(em, T, {picks[0]: Value(H, True)}, inside.__contains__, shared)
        b.lazy = {s: (lambda s=s: _sequence(b, s, st.slices[s])) for s in side_slices}
        leaving = [u for u in st.tmpl if any(x not in st.tmpl_set for x in u.users)]
        Y = {}
        for u in leaving:
            v = b.value(u)
            if not v.batched:
                raise Unproven(f"readout {u.name} does not vary with the step")
            Y[u] = v.node
        _commit(gm, em, st, Y)
    return f"re-rolled with the scan: {len(st.tmpl)} op(s) per step, once for all {T} steps"


def reroll_readouts(gm: fx.GraphModule, scans: list[str]) -> dict[str, str]:
    """Re-roll the per-step readouts of each re-rolled scan named in ``scans`` (in place); returns scan name -> what
    happened to its readouts (also on the scan node's provenance as ``readouts``)."""
    by_name = {n.name: n for n in gm.graph.nodes if n.name in set(scans) and is_linear_scan(n)}
    out: dict[str, str] = {}
    changed = False
    for name, H in by_name.items():
        try:
            what = _one(gm, H)
        except Unproven as e:
            what = f"not re-rolled: {e}"
            log.info("reroll_readouts: the readouts of %s stay per step: %s", name, e)
        else:
            changed |= bool(what)
        _toposort(gm.graph)
        eliminate_dead_code(gm.graph)
        n = _unbind_rest(gm, H, (hinted_shape(H) or (0,))[0])
        changed |= n != 0
        if n > 0:
            what = what or f"{n} per-step reads of the state go through one unbind"
        if what:
            out[name] = what
            H.meta[PROVENANCE] = {**H.meta.get(PROVENANCE, {}), "readouts": what}
    if changed:
        _toposort(gm.graph)
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return out
