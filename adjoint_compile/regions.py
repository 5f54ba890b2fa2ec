"""Typed region records: what recognition found in a graph (DESIGN.md §1, §4).

A matcher returns one of these records or ``None``; a candidate it could not prove becomes a
:class:`Rejection` so that ``explain()`` can say why. Records hold the FX nodes they cover (for the passes that
rewrite them) and a JSON-able view (:meth:`Region.to_dict`) for reports.

Who writes what: matchers fill the typed fields (recognition); ``rewrite`` and ``reason`` are written by the
decision step alone (passes/decide/), from its table and from the typed :class:`Lowered`/:class:`NotLowered`
outcomes the lowerings return. ``details`` is for reports only: no pass reads it back.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch.fx as fx

RegionKind = Literal["linear_recurrence", "gated_recurrence", "residual_chain"]
Source = Literal["linear_scan", "scan", "associative_scan", "unrolled_loop", "residual", "log_space_scan",
                 "cumprod_scan", "registered_scan"]  # the last three: passes/capture/scan_forms.py, passes/capture/known_scans.py
Rewrite = Literal["adjoint", "truncated", "highway", "none"]

#: the reason of a record no decision has been made for yet (straight from recognition).
UNDECIDED = "rewrite not implemented yet"

#: key under which passes record provenance on nodes they create or claim (``node.meta[PROVENANCE]``).
PROVENANCE = "adjoint_compile"


def _name(n: Any) -> Any:
    if isinstance(n, fx.Node):
        return n.name
    if isinstance(n, (list, tuple)):
        return [_name(x) for x in n]
    return n


#: why Highway-BP's loop lowering refuses a loop with two carried states
MORE_THAN_ONE_STATE = "the loop carries more than its one state (e.g. an LSTM's h and c): not supported yet"

@dataclasses.dataclass
class Region:
    """Common fields of every region (DESIGN.md §1: kind, source, length, rewrite, reason)."""

    kind: RegionKind
    source: Source
    #: number of steps (recurrences) or layers (chains); None when not static.
    length: int | None
    #: the FX nodes the region covers, in graph order.
    nodes: list[fx.Node] = dataclasses.field(default_factory=list, repr=False)
    rewrite: Rewrite = "none"
    #: why the region is not rewritten (when rewrite == "none"), or a note on how it is; written by the decision
    #: step (passes/decide/) only.
    reason: str = UNDECIDED
    #: regions that a rewrite treats together (a stack of recurrences joined by time-local ops) share a group id.
    group: int | None = None
    #: a short human name, e.g. the FX node that anchors the region.
    name: str = ""
    #: anything a pass wants to show in reports (JSON-able values only); never read back by a pass.
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "nodes":
                out["nodes"] = [n.name for n in v]
            elif isinstance(v, (fx.Node, list, tuple)):
                out[f.name] = _name(v)
            elif callable(getattr(v, "to_dict", None)):
                out[f.name] = v.to_dict()
            elif dataclasses.is_dataclass(v):
                out[f.name] = dataclasses.asdict(v)
            else:
                out[f.name] = v
        return out


@dataclasses.dataclass
class PerStepSlice:
    """A per-step slice of an unrolled loop: ``node`` reads ``source`` at index ``start + k·stride`` in step k."""

    node: fx.Node
    source: fx.Node | None
    #: "getitem", "select", "unbind" ... (how the slice is taken)
    op: str | None
    #: the source dim the varying index selects (None when not readable)
    dim: int | None
    #: which of the node's int arguments varies
    index_position: int
    #: the first loop step that has this slice (1: every step; 2: the first step is special)
    first_step: int
    start: int
    stride: int

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["node"], d["source"] = self.node.name, getattr(self.source, "name", None)
        return d


@dataclasses.dataclass
class LoopRecipe:
    """How to re-roll an unrolled loop into one scan (found by passes/match/unrolled.py, used by passes/capture/reroll.py)."""

    steps: int
    #: ops per step
    step_ops: int
    #: the loop's state after each step, in order
    states: list[fx.Node]
    #: the nodes of the template step (step 2, or step 1 when the first step matched too), in order
    template_step: list[fx.Node]
    h0: fx.Node | None
    xs: list[PerStepSlice]
    #: values made before the loop that every step reads (weights)
    shared: list[fx.Node]
    #: values carried from one step to the next besides the state: (template node, its value before step 1)
    carried: list[tuple[fx.Node, fx.Node | None]]
    #: values computed at the end of a step from its new state (a loop body that starts mid-way, e.g. an LSTM's h
    #: after its cell c): (template node, its value in step 1)
    rotated: list[tuple[fx.Node, fx.Node | None]]
    first_step_matched: bool
    first_step_reason: str
    #: the stack/cat that collects the states: {"node": name, "op": "stack" | "cat", "dim": d}, or None
    stacked_by: dict[str, Any] | None

    def highway_refusal(self) -> str | None:
        """Why Highway-BP's loop lowering cannot take this loop (None: its structure can)."""
        if self.h0 is None or not self.first_step_matched or len(self.states) < 2:
            return "the loop's steps are not all the same (its first step differs) or it has no initial state"
        if self.rotated or len(self.carried) != 1 or self.carried[0][0] is not self.states[0]:
            return MORE_THAN_ONE_STATE
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with node names."""
        def pairs(ps: list[tuple[fx.Node, fx.Node | None]], second: str) -> list[dict[str, Any]]:
            return [{"template": a.name, second: getattr(b, "name", None)} for a, b in ps]

        return {"steps": self.steps, "step_ops": self.step_ops, "states": [s.name for s in self.states],
                "template_step": [n.name for n in self.template_step], "h0": getattr(self.h0, "name", None),
                "xs": [x.to_dict() for x in self.xs], "shared": [n.name for n in self.shared],
                "carried": pairs(self.carried, "initial"), "rotated": pairs(self.rotated, "initial"),
                "first_step_matched": self.first_step_matched, "first_step_reason": self.first_step_reason,
                "stacked_by": self.stacked_by}


@dataclasses.dataclass
class Recurrence(Region):
    """h_t = a_t ⊙ h_{t-1} + b_t (linear) or z1_t ⊙ h_{t-1} + z2_t with z depending on h (gated)."""

    #: FX nodes (or None when implicit) for a, b, the initial state h0, and the carried state.
    a: fx.Node | None = None
    b: fx.Node | None = None
    h0: fx.Node | None = None
    carry: fx.Node | None = None
    #: the nodes that give the recurrence's results to the rest of the graph (e.g. the scan output h).
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    #: the dimension of the step (time) axis in the region's sequence tensors.
    step_dim: int = 1
    reverse: bool = False
    window: int | None = None
    #: time-local neighbourhood: ops that act on each step on its own and can be recomputed shard by shard.
    neighbourhood: list[fx.Node] = dataclasses.field(default_factory=list, repr=False)
    #: ops that mix steps and bound the neighbourhood, as (node name, why).
    bounds: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: for unrolled loops: how to re-roll the steps into one scan.
    reroll: LoopRecipe | None = None
    #: for one carry of a ``scan`` op: the carry's index among the op's carries.
    carry_index: int | None = None
    #: for one leaf of an ``associative_scan`` op: the leaf's index among the op's xs.
    leaf: int | None = None
    #: for a linear_scan made by the reroll pass (capture): the name of the loop or scan op it was written as.
    rerolled_from: str | None = None
    #: for a recurrence the reroll pass tried and could not re-roll: why (from the node's provenance).
    not_rerolled: str | None = None


@dataclasses.dataclass
class ResidualLayer:
    """One layer f_i(x) = r_i(x, g_i(x)) of a residual chain."""

    #: the layer's input x and output f(x).
    x: fx.Node
    out: fx.Node
    #: one of the Highway-BP decompositions (DESIGN.md §3): "add", "relu_add", "pre_ln", "post_ln", "gated", "lstm".
    form: str
    #: the nodes of the expensive block g_i (everything that is not the cheap residual function r_i).
    block: list[fx.Node] = dataclasses.field(default_factory=list, repr=False)
    #: K_i = ∂r_i/∂x: "identity", "diagonal" or "scalar".
    K: str = "identity"
    #: the coefficient C of x in the layer's sum s = C ⊙ x + O (an :class:`~adjoint_compile.analysis.affine.Expr`
    #: over graph nodes; ``Expr.evaluate`` gives its value). K_i is C for the forms add and gated; for relu_add and
    #: post_ln it is the VJP of ``out`` with respect to the sum, times C.
    coef: Any = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"x": self.x.name, "out": self.out.name, "form": self.form, "K": self.K, "block": len(self.block)}


@dataclasses.dataclass
class ResidualChain(Region):
    layers: list[ResidualLayer] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["layers"] = [layer.to_dict() for layer in self.layers]
        return d


@dataclasses.dataclass
class Lowered:
    """What a lowering made of a region: the call node that runs it and the figures ``explain()`` reports."""

    #: the rewrite applied ("adjoint", ...).
    rewrite: Rewrite
    #: the name of the call node that replaced the region's nodes.
    call: str
    #: the nodes the call took over (names, in the graph before lowering), e.g. for chains that run inside it.
    members: frozenset[str]
    scans: int = 0
    nodes: int = 0
    shard_size: int | None = None
    steps: int | None = None
    #: the truncated adjoint's window W (rewrite "truncated"), else None.
    window: int | None = None
    #: expected activation memory in bytes: {"autograd": ..., "sharded": ...}.
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the step-mixing ops that bound the region, as (node name, why).
    bounds: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: for rewrites other than "adjoint": the report's reason, as the lowering words it (e.g. Highway-BP's k, form, K).
    note: str = ""
    #: JSON-able figures for the region's report details (e.g. {"iterations": k}).
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class NotLowered:
    """A lowering that could not prove its preconditions: the region keeps ordinary autograd."""

    why: str
    bounds: list[tuple[str, str]] | None = None
    #: the lowering's estimate (bytes), when the region was declined because the rewrite would not pay.
    memory: dict[str, int] | None = None
    #: True when another rewrite differentiates the region's nodes (e.g. a scan inside a Highway-BP chain's blocks):
    #: not rewritten on its own, but nothing is lost.
    covered: bool = False


@dataclasses.dataclass
class Rejection:
    """A candidate that recognition looked at and could not prove (DESIGN.md: never guess)."""

    #: what it looked like, e.g. "linear_recurrence", "residual_chain".
    candidate: str
    #: the FX node that anchored the candidate.
    node: str
    #: why it was rejected, e.g. "a depends on the carry", "steps differ at node mul_3".
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Fallback:
    """A graph (or some of its calls) that ran with ordinary autograd although it had a rewrite: warned once, listed
    by ``report()``."""

    #: what happened, e.g. "the rewritten forward differs from the captured graph's on the first call"
    cause: str
    #: what the user can do about it
    remedy: str
    #: figures for reports (the outputs that differed and by how much, the lengths it affected, ...)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: a word of a reason that may name a node (``re.split`` with it keeps the words at the odd places)
_WORD = re.compile(r"([A-Za-z_]\w*)")


#: what stands for a node name in a rejection reason while grouping
NODE = "<node>"
#: after a group's reason that is its first member's: the others name their own nodes
FIRST_OF_GROUP = " (at the first; the others alike, each at its own nodes)"


def group_rejections(rejections: Sequence[Rejection], node_names: Iterable[str]) -> list[tuple[str, str, list[str]]]:
    """Rejections grouped by candidate and reason, where reasons that differ only in words that are node names of
    the graph are one group (one cause met at many layers): (candidate, reason, anchor nodes), largest group first.

    A group's reason is its members' where they agree word for word; where they name different nodes, it is the
    first member's, as written, marked as such (a word that merely is a node name too, "a", "skip", an op's name,
    does not split a group's words)."""
    names = set(node_names)
    groups: dict[tuple[str, str], list[Rejection]] = {}
    for j in rejections:
        why = _WORD.sub(lambda m: NODE if m.group(0) in names else m.group(0), j.reason)
        groups.setdefault((j.candidate, why), []).append(j)
    out = [(c, _shown([j.reason for j in js]), [j.node for j in js]) for (c, why), js in groups.items()]
    return sorted(out, key=lambda g: -len(g[2]))


def _shown(reasons: list[str]) -> str:
    """The reasons of one group: as written where they all agree, else the first one, marked as the first."""
    return reasons[0] if all(r == reasons[0] for r in reasons) else reasons[0] + FIRST_OF_GROUP


def rejection_lines(groups: Sequence[tuple[str, str, list[str]]], where: int = 3) -> list[str]:
    """One line per group of :func:`group_rejections`: the candidate, how many and at which nodes (the first
    ``where``), and the reason."""
    out = []
    for cand, why, nodes in groups:
        if len(nodes) == 1:
            out.append(f"{cand} at {nodes[0]}: {why}")
        else:
            more = f", ... ({len(nodes) - where} more)" if len(nodes) > where else ""
            out.append(f"{cand} x{len(nodes)} (at {', '.join(nodes[:where])}{more}): {why}")
    return out
