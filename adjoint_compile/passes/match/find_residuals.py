"""Residual chains along depth (DESIGN.md §3–4, the Highway-BP decompositions): consecutive layers f_i(x) = r_i(x, g_i(x)).

A layer is found at a sum-like node ``s`` (add, sub, addcmul) that is affine in one of its atoms ``x`` with the
rest depending on ``x``: ``s = C ⊙ x + O`` where ``O`` (or ``C``) is computed from ``x`` by the block g. Its form:

=========  ==================================  =========
form       r_i(x, z)                           K_i = ∂r/∂x
=========  ==================================  =========
add        x + z  (or c·x + z, c a scalar)     identity (scalar)
pre_ln     x + Block(LN(x))                    identity
relu_add   ReLU(x + z)                         diagonal
post_ln    LN(x + Block(x)) = x ⊙ a(x) + b(x)  dense (∂LN/∂x mixes the features)
gated      a(x) ⊙ x + b(x)                     diagonal
lstm       [a ⊙ c + b, h = o ⊙ tanh(c)]        diagonal
=========  ==================================  =========

Layers link into a chain when one layer's output is the next layer's input; a chain has at least 2 layers. The
block of a layer is every node that depends on ``x`` and feeds ``s`` other than through r; a block node used
outside its layer (a skip across layers) or a layer input used elsewhere breaks the chain: the matcher rejects
that layer with the reason instead of guessing. "Depends on" uses one bitset per node over the candidate inputs,
computed in one pass over the graph: near-linear in the graph's size.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import networkx as nx
import torch.fx as fx

from ...analysis import optable as ops
from ...analysis.affine import Atom, Const, NotAffine, affine
from ...analysis.fx import bfs_inputs, hinted_shape
from ...analysis.optable import name_of as _name
from ...analysis.optable import op_name, target_key
from ...regions import Rejection, ResidualChain, ResidualLayer

log = logging.getLogger(__name__)

__all__ = ["find_residuals", "LayerMatch"]

_BUDGET = 24


@dataclasses.dataclass
class LayerMatch:
    """One residual layer before chaining: ``out = r(x, g(x))`` anchored at the sum node ``s``."""

    x: fx.Node
    s: fx.Node
    out: fx.Node
    form: str
    K: str
    block: list[fx.Node]
    #: the cheap residual function's nodes (the sum's linear expansion, the post-op)
    r_nodes: list[fx.Node]
    #: the coefficient of x in the sum (an affine Expr): K's expression
    coef: Any = None


def _expansion(s: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(linear-op nodes under ``s`` including ``s``, atoms) of ``s``'s syntactic affine expansion."""
    inner, atoms = [s], []
    for a in bfs_inputs(s, _BUDGET, _inner):
        (inner if _inner(a) else atoms).append(a)
    return inner, atoms


def _inner(a: fx.Node) -> bool:
    return op_name(a) in ops.LINEAR_IN_CARRY and a.op != "placeholder" and len(a.users) == 1


def _numel(n: Any) -> int | None:
    s = hinted_shape(n)
    if s is None:
        return None
    k = 1
    for d in s:
        k *= d
    return k


def find_residuals(gm: fx.GraphModule) -> tuple[list[ResidualChain], list[Rejection]]:
    """Residual chains of ``gm`` and the rejected residual-looking layers."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # pass 1: candidate layer inputs per sum node
    cands: dict[fx.Node, tuple[list[fx.Node], list[fx.Node], list[fx.Node]]] = {}
    bit: dict[fx.Node, int] = {}
    for s in nodes:
        if s.op not in ("call_function", "call_method") or op_name(s) not in ops.SUM_OPS:
            continue
        shp = hinted_shape(s)
        if shp is None:
            continue
        inner, atoms = _expansion(s)
        xs = [a for a in atoms if hinted_shape(a) == shp and a.op != "get_attr"]
        if len(atoms) < 2 or not xs:
            continue
        cands[s] = (inner, atoms, xs)
        for a in xs:
            bit.setdefault(a, len(bit))
    if not cands:
        return [], []
    # pass 2: for every node, the set (bitset) of candidate inputs it depends on
    anc: dict[fx.Node, int] = {}
    for n in nodes:
        v = 0
        for a in n.all_input_nodes:
            v |= anc.get(a, 0)
        b = bit.get(n)
        if b is not None:
            v |= 1 << b
        anc[n] = v
    layers: list[LayerMatch] = []
    rejections: list[Rejection] = []
    for s, (inner, atoms, xs) in cands.items():
        try:
            m, why = _match_layer(s, inner, atoms, xs, anc, bit, pos)
        except Exception as e:  # noqa: BLE001 - never raise on odd graphs
            log.debug("residual matcher failed at %s", s.name, exc_info=True)
            m, why = None, f"matcher error {type(e).__name__}: {e}"
        if m is not None:
            layers.append(m)
        elif why:
            rejections.append(Rejection("residual_chain", s.name, why))
    chains, singles = _link(layers, pos)
    for lm in singles:
        # NB: not a rejection: a lone skip (y = D ⊙ x + g(x) inside a block) is common and not a chain candidate
        log.debug("single %s residual layer at %s (input %s) is not a chain", lm.form, lm.out.name, lm.x.name)
    return chains, rejections


def _match_layer(s: fx.Node, inner: list[fx.Node], atoms: list[fx.Node], xs: list[fx.Node],
                 anc: dict[fx.Node, int], bit: dict[fx.Node, int], pos: dict[fx.Node, int]
                 ) -> tuple[LayerMatch | None, str]:
    def dep_on(x: fx.Node):
        b = 1 << bit[x]
        return lambda n: n is x or bool(anc.get(n, 0) & b)

    # x: an atom that the other atoms are computed from (the earliest such, if several)
    scored = []
    for x in xs:
        b = 1 << bit[x]
        k = sum(1 for a in atoms if a is not x and anc.get(a, 0) & b)
        if k:
            scored.append((-k, pos[x], x))
    if not scored:
        return None, ""  # an add of unrelated operands: no residual candidate
    scored.sort(key=lambda t: (t[0], t[1]))
    x = scored[0][2]
    depends = dep_on(x)
    try:
        aff = affine(s, x, depends)
    except NotAffine as e:
        return None, f"not a residual layer: {e.reason}"
    C, O = aff.coef, aff.offset
    if C is None:
        return None, ""
    dep_o = O is not None and any(depends(a) for a in O.nodes())
    dep_c = any(depends(a) for a in C.nodes())
    if not (dep_o or dep_c):
        return None, ""
    # form and K
    out = s
    if isinstance(C, Const) and C.value == 1:
        form, K = "add", "identity"
    elif isinstance(C, Const) or (isinstance(C, Atom) and not dep_c and _numel(C.n) == 1):
        form, K = "add", "scalar"
    else:
        form, K = "gated", "diagonal"
    r_nodes = [n for n in inner if depends(n)]
    # block: nodes depending on x that feed the non-x atoms
    seeds = [a for a in (C.nodes() + (O.nodes() if O is not None else [])) if a is not x and depends(a)]
    block = _cone(seeds, x, depends)
    pre_norm = form == "add" and K == "identity" and _pre_norm(x, block)
    users = list(s.users)
    if form == "add" and len(users) == 1 and _name(users[0]) == "relu":
        out, form, K = users[0], "relu_add", "diagonal"
        r_nodes.append(out)
    elif not pre_norm and len(users) == 1 and _name(users[0]) in ("layer_norm", "rms_norm") and users[0].args \
            and users[0].args[0] is s:
        # NB: after a pre-normed block a LayerNorm is the model's final norm, not part of the layer
        out, form, K = users[0], "post_ln", "dense"
        r_nodes.append(out)
    r_set = set(r_nodes)
    inside = block | r_set
    for n in block:
        for u in n.users:
            if u not in inside and u.op != "output":
                return None, (f"block node {n.name} of the residual layer at {s.name} is also used by {u.name} "
                              f"outside the layer (a skip across layers)")
    for u in x.users:
        if u not in inside and u.op != "output":
            return None, f"layer input {x.name} of the residual layer at {s.name} also feeds {u.name} outside the layer"
    if pre_norm:
        form = "pre_ln"
    if form == "gated" and _lstm_like(x, block, seeds, C, O):
        form = "lstm"
    order = sorted(block, key=pos.__getitem__)
    return LayerMatch(x=x, s=s, out=out, form=form, K=K, block=order, r_nodes=sorted(r_set, key=pos.__getitem__),
                      coef=C), ""


def _cone(seeds: list[fx.Node], x: fx.Node, depends) -> set[fx.Node]:
    block: set[fx.Node] = set()
    stack = list(seeds)
    while stack:
        n = stack.pop()
        if n in block or n is x or not depends(n):
            continue
        block.add(n)
        stack.extend(n.all_input_nodes)
    return block


def _pre_norm(x: fx.Node, block: set[fx.Node]) -> bool:
    """Every use of x inside the block is a normalization (LayerNorm/RMSNorm, also written out by hand)."""
    uses = [u for u in x.users if u in block]
    if not uses:
        return False
    if all(_name(u) in ops.RESIDUAL_NORMS for u in uses):
        return True
    # hand-written RMSNorm / LayerNorm: x.pow(2).mean(-1) -> rsqrt -> x * r (* w)
    if not all(_name(u) in ops.RMS_PARTS for u in uses):
        return False
    frontier, seen = list(uses), set(uses)
    for _ in range(4):
        nxt = []
        for n in frontier:
            if _name(n) in ("rsqrt", "sqrt", "var", "std"):
                return True
            for u in n.users:
                if u in block and u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def _lstm_like(x: fx.Node, block: set[fx.Node], seeds: list[fx.Node], C: Any, O: Any) -> bool:
    """LSTM form: the gates reach the cell x only through h = o ⊙ tanh(x) (Highway-BP's LSTM form [a ⊙ c + b, h])."""
    hs = []
    for t in x.users:
        if t in block and _name(t) == "tanh":
            hs += [u for u in t.users if u in block and _name(u) == "mul"]
    if len(hs) != 1:
        return False
    h = hs[0]
    # forward from x inside the block, not through h: the gates must be unreachable
    reach, stack = set(), [x]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in block and u is not h and u not in reach:
                reach.add(u)
                stack.append(u)
    gate_atoms = [a for a in (C.nodes() + (O.nodes() if O is not None else [])) if a is not x]
    return bool(gate_atoms) and not any(a in reach for a in gate_atoms if a in block)


def _link(layers: list[LayerMatch], pos: dict[fx.Node, int]) -> tuple[list[ResidualChain], list[LayerMatch]]:
    """Join layers whose output is the next layer's input; forks end a chain."""
    by_x: dict[fx.Node, list[LayerMatch]] = {}
    for lm in layers:
        by_x.setdefault(lm.x, []).append(lm)
    g = nx.DiGraph()
    for i, lm in enumerate(layers):
        g.add_node(i)
    idx = {id(lm): i for i, lm in enumerate(layers)}
    for lm in layers:
        nxt = by_x.get(lm.out, [])
        if len(nxt) == 1:
            g.add_edge(idx[id(lm)], idx[id(nxt[0])])
    chains, singles = [], []
    for comp in nx.weakly_connected_components(g):
        sub = g.subgraph(comp)
        if any(d > 1 for _, d in sub.in_degree()) or any(d > 1 for _, d in sub.out_degree()):
            continue
        path = list(nx.topological_sort(sub))
        members = [layers[i] for i in path]
        if len(members) < 2:
            singles.extend(members)
            continue
        chains.append(_chain_record(members, pos))
    chains.sort(key=lambda c: pos[c.layers[0].x])
    return chains, singles


def _wl_hash(lm: LayerMatch) -> str:
    g = nx.DiGraph()
    inside = set(lm.block)
    for n in lm.block:
        g.add_node(n.name, label=target_key(n))
        for a in n.all_input_nodes:
            if a in inside:
                g.add_edge(a.name, n.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # networkx >= 3.5 warns that directed hashes changed; we only compare them
        return nx.weisfeiler_lehman_graph_hash(g, node_attr="label") + f"/{lm.form}"


def _chain_record(members: list[LayerMatch], pos: dict[fx.Node, int]) -> ResidualChain:
    nodes: set[fx.Node] = set()
    for lm in members:
        nodes.update(lm.block)
        nodes.update(lm.r_nodes)
    hashes = {_wl_hash(lm) for lm in members}
    forms = [lm.form for lm in members]
    return ResidualChain(
        kind="residual_chain", source="residual", length=len(members),
        nodes=sorted(nodes, key=pos.__getitem__), name=members[-1].out.name,
        layers=[ResidualLayer(x=lm.x, out=lm.out, form=lm.form, block=lm.block, K=lm.K, coef=lm.coef) for lm in members],
        details={"input": members[0].x.name, "output": members[-1].out.name, "forms": sorted(set(forms)),
                 "K": sorted({lm.K for lm in members}),
                 # NB: isomorphic blocks (same WL hash) can share one batched VJP with stacked weights (Highway-BP)
                 "isomorphic_layers": len(hashes) == 1},
    )
