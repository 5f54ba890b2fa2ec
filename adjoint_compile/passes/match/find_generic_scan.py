"""torch's ``associative_scan(..., combine_mode="generic")`` as dynamo records it (a matcher; capture's
passes/capture/scan_forms.py rewrites what it proves into one ``linear_scan`` node per used output).

In generic mode (the one that runs on CPU, and the one transformers' Mamba takes under compile) dynamo does not
record an ``associative_scan`` node: it inlines torch's ``generic_associative_scan``, an unrolled up-sweep /
down-sweep tree over the step axis (moved to dim 0 first)::

    elem_k = movedim(x_k, d, 0)                                    # one per leaf
    _vmap_increment_nesting(...); u = _add_batch_dim(aten.slice(elem, 0, 0, -1, 2), 0, lvl); ...
    <the combine on the batched x-leaves and y-leaves>; out = _remove_batch_dim(r, lvl, n, 0); ...
    _vmap_decrement_nesting()
    ... aten.slice, cat, pad, stack, flatten ...                   # interleaving
    y_k = movedim(out_k, 0, d)

The proof has two parts. (1) Every vmapped block is the linear-recurrence combine ``(x_a·y_a, y_a·x_b + y_b)``
(the same classification as an ``associative_scan`` node's combine sub-graph: find_recurrences.linear_combine).
(2) The data movement between the blocks computes the inclusive scan: the moving ops are run on integer *codes*
(leaf, first step, last step) of shape [T, 1, ...], each block combines adjacent intervals of the same leaves (any
other input becomes invalid), and each output must hold, at step t, leaf k's interval [0, t]. The ops allowed in
between act on the leading (step) dims only, so codes with trailing dims of size 1 are exact. Anything else (a flip,
a nested vmap, an intermediate used outside the tree) is a rejection with the reason.
"""
from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from ...analysis.affine import linear_combine
from ...analysis.fx import has_symbolic_sizes, hinted_shape
from ...analysis.optable import fn_name, op_name
from ...regions import Rejection
from .find_scan_forms import ScanForm

__all__ = ["find_generic_scans", "has_generic_scans"]

_P = torch._functorch.predispatch
_INC, _DEC = _P._vmap_increment_nesting, _P._vmap_decrement_nesting
_ADD, _REMOVE, _LAZY = _P._add_batch_dim, _P._remove_batch_dim, _P.lazy_load_decompositions
_BOOK = (_INC, _DEC, _LAZY)


class _Miss(Exception):
    pass


def _name(n: fx.Node) -> str:
    return op_name(n) or fn_name(n)


def _movedim(n: Any) -> tuple[int, int] | None:
    if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and _name(n) == "movedim" and \
            len(n.args) == 3 and all(isinstance(v, int) for v in n.args[1:]) and not n.kwargs:
        rank = len(hinted_shape(n) or ())
        return n.args[1] % max(rank, 1), n.args[2] % max(rank, 1)
    return None


class _Block:
    def __init__(self, inc: fx.Node) -> None:
        self.inc, self.ins, self.outs, self.body, self.dec = inc, [], [], [], None


def _blocks(gm: fx.GraphModule) -> list[_Block]:
    blocks, cur = [], None
    for n in gm.graph.nodes:
        t = n.target if n.op == "call_function" else None
        if t is _INC:
            if cur is not None:
                raise _Miss(f"nested vmap at {n.name}")
            cur = _Block(n)
        elif cur is not None:
            if t is _DEC:
                cur.dec = n
                blocks.append(cur)
                cur = None
            elif t is _ADD:
                cur.ins.append(n)
            elif t is _REMOVE:
                cur.outs.append(n)
            elif t is not _LAZY:
                cur.body.append(n)
    return blocks


# codes: ((leaf + 1) * M + first + 1) * M + last + 1, M = T + 2; 0 is padding, -1 invalid


def _decode(c: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return c // (M * M) - 1, (c // M) % M - 1, c % M - 1


def _combine(block: _Block, env: dict, lead: dict, M: int) -> None:
    n = len(block.ins) // 2
    xs = [env[u] for u in block.ins[:n]]
    ys = [env[u] for u in block.ins[n:]]
    if len({tuple(v.shape) for v in xs + ys}) != 1:
        raise _Miss(f"the combine at {block.inc.name} takes leaves of different shapes")
    ok = torch.ones_like(xs[0], dtype=torch.bool)
    for i, (x, y) in enumerate(zip(xs, ys)):
        (lx, _, tx), (ly, fy, _) = _decode(x, M), _decode(y, M)
        ok &= (x > 0) & (y > 0) & (lx == i) & (ly == i) & (tx + 1 == fy)
        ok &= (x - xs[0] == (i * M * M)) & (y - ys[0] == (i * M * M))  # every leaf: the same interval
    first, last = _decode(xs[0], M)[1], _decode(ys[0], M)[2]
    for i, out in enumerate(block.outs):
        code = ((i + 1) * M + first + 1) * M + last + 1
        env[out], lead[out] = torch.where(ok, code, torch.full_like(code, -1)), 1


def _run(n: fx.Node, env: dict, lead: dict) -> torch.Tensor:
    """One data-movement op on codes, only where it touches the leading step dims (``lead[v]`` of them)."""
    name, args = _name(n), n.args
    val = lambda v: env[v] if isinstance(v, fx.Node) else v  # noqa: E731
    kw = {k: val(v) for k, v in n.kwargs.items()}
    if name == "slice" and isinstance(n.target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        if args[1] >= lead[args[0]]:
            raise _Miss(f"{n.name} slices a feature dim")
        lead[n] = lead[args[0]]
        return n.target(val(args[0]), *args[1:], **kw)
    if name == "cat":
        items, d = list(args[0]), args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
        if any(d >= lead[v] for v in items):
            raise _Miss(f"{n.name} concatenates along a feature dim")
        lead[n] = lead[items[0]]
        return torch.cat([env[v] for v in items], d)
    if name == "pad":
        pad = list(args[1])
        k = lead[args[0]]
        rank = env[args[0]].dim()
        if len(args) > 2 and args[2] != "constant" or (len(args) > 3 and args[3] not in (None, 0)) or \
                any(pad[: 2 * (rank - k)]):
            raise _Miss(f"{n.name} pads a feature dim, or with a value")
        lead[n] = k
        return torch.nn.functional.pad(env[args[0]], pad)
    if name == "stack":
        items, d = list(args[0]), args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
        if any(d > lead[v] for v in items):
            raise _Miss(f"{n.name} stacks along a feature dim")
        lead[n] = lead[items[0]] + 1
        return torch.stack([env[v] for v in items], d)
    if name == "flatten":
        s = args[1] if len(args) > 1 else n.kwargs.get("start_dim", 0)
        e = args[2] if len(args) > 2 else n.kwargs.get("end_dim", -1)
        if not (0 <= s <= e < lead[args[0]]):
            raise _Miss(f"{n.name} flattens feature dims")
        lead[n] = lead[args[0]] - (e - s)
        return torch.flatten(env[args[0]], s, e)
    raise _Miss(f"{n.name} ({name}) is not a data-movement op of the scan tree")


def _upstream(blocks: list[_Block]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The ``movedim(x, d, 0)`` leaves and the vmap outputs (``_remove_batch_dim``) the blocks read through data
    movement."""
    leaves: list[fx.Node] = []
    removed: list[fx.Node] = []
    seen, stack = set(), [u.args[0] for b in blocks for u in b.ins]
    while stack:
        v = stack.pop()
        if v in seen or not isinstance(v, fx.Node):
            continue
        seen.add(v)
        md = _movedim(v)
        if md is not None and md[1] == 0:
            leaves.append(v)
        elif v.target is _REMOVE:
            removed.append(v)
        elif _name(v) in ("slice", "cat", "pad", "stack", "flatten"):
            stack.extend(v.all_input_nodes)
        else:
            raise _Miss(f"{v.name} ({_name(v)}) feeds the combine and is neither a leaf nor data movement")
    return leaves, removed


def _leaves(gm: fx.GraphModule, blocks: list[_Block]) -> list[fx.Node]:
    """The ``movedim(x, d, 0)`` nodes upstream of the blocks through data movement, in graph order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(_upstream(blocks)[0], key=order.__getitem__)


def _trees(blocks: list[_Block]) -> list[list[_Block]]:
    """The blocks grouped into scans (one ``associative_scan`` call each), in graph order: blocks reading the same
    leaves, or one another's outputs, through data movement. A block whose inputs are not data movement is a scan
    of its own (its rejection says why)."""
    g = nx.Graph()
    made = {o: i for i, b in enumerate(blocks) for o in b.outs}
    for i, b in enumerate(blocks):
        g.add_node(("block", i))
        try:
            leaves, removed = _upstream([b])
        except _Miss:
            continue
        g.add_edges_from((("block", i), ("leaf", v)) for v in leaves)
        g.add_edges_from((("block", i), ("block", made[v])) for v in removed if v in made)
    groups = [sorted(k for kind, k in c if kind == "block") for c in nx.connected_components(g)]
    return [[blocks[k] for k in ks] for ks in sorted(groups)]


def _tree(gm: fx.GraphModule, blocks: list[_Block], leaves: list[fx.Node]) -> list[tuple[fx.Node, int]]:
    """The outputs ``movedim(out, 0, d)`` of the tree, each with the leaf it is the inclusive scan of."""
    dims = {_movedim(v)[0] for v in leaves}
    shapes = {hinted_shape(v) for v in leaves}
    if len(dims) != 1 or len(shapes) != 1 or None in shapes:
        raise _Miss("the leaves are moved from different dims or have different shapes")
    d, shape = dims.pop(), shapes.pop()
    T, M = shape[0], shape[0] + 2
    t = torch.arange(T).view(T, *[1] * (len(shape) - 1))
    env: dict[fx.Node, torch.Tensor] = {}
    lead: dict[fx.Node, int] = {}
    for k, v in enumerate(leaves):
        env[v], lead[v] = ((k + 1) * M + t + 1) * M + t + 1, 1
    by_dec = {b.dec: b for b in blocks}
    body = {n for b in blocks for n in b.body}
    forms = []
    for n in gm.graph.nodes:
        if n in env or n.op not in ("call_function", "call_method") or n in body or n.target in _BOOK:
            if n in by_dec:
                _combine(by_dec[n], env, lead, M)
            continue
        if not any(isinstance(v, fx.Node) and v in env for v in n.all_input_nodes):
            continue
        if n.target is _ADD:
            if n.args[1] != 0 or lead[n.args[0]] != 1:
                raise _Miss(f"{n.name} batches over a dim other than the step")
            env[n] = env[n.args[0]]
            continue
        md = _movedim(n)
        if md is not None and md == (0, d) and lead.get(n.args[0]) == 1:
            forms.append(_output(n, env[n.args[0]], t, M, leaves, shape))
            continue
        if n.target is _REMOVE:
            continue
        env[n] = _run(n, env, lead)
        if env[n].shape[:lead[n]] != tuple(hinted_shape(n) or ())[:lead[n]]:
            raise _Miss(f"{n.name}: the codes' step dims {list(env[n].shape)} differ from its shape")
    return forms


def _output(n: fx.Node, code: torch.Tensor, t: torch.Tensor, M: int, leaves: list[fx.Node],
            shape: tuple[int, ...]) -> Any:
    if tuple(code.shape[:1]) != (shape[0],):
        raise _Miss(f"{n.name} has {code.shape[0]} steps, not {shape[0]}")
    leaf = int(code.flatten()[0]) // (M * M) - 1
    if not 0 <= leaf < len(leaves) or not torch.equal(code, ((leaf + 1) * M + 0 + 1) * M + t + 1):
        raise _Miss(f"{n.name} is not the inclusive scan of the leaves (step t must combine steps 0..t)")
    return n, leaf


def _tree_blocks(gm: fx.GraphModule) -> list[_Block]:
    try:
        blocks = _blocks(gm)
    except _Miss:
        return []  # NB: nested vmaps are the user's, not generic_associative_scan's
    # NB: a block of the tree maps the combine over every other step: it reads step-2 slices along dim 0
    return [b for b in blocks if b.ins and len(b.ins) % 2 == 0 and len(b.outs) == len(b.ins) // 2 and b.dec
            and any(_name(u.args[0]) == "slice" and tuple(u.args[0].args[1:2]) == (0,)
                    and u.args[0].args[-1] == 2 for u in b.ins)]


def has_generic_scans(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds the vmapped combines of a generic-mode associative scan: one whose sizes are symbolic is
    read only once specialized to a call's sizes (its data movement is run on codes of the call's length)."""
    return bool(_tree_blocks(gm))


def find_generic_scans(gm: fx.GraphModule) -> tuple[list[ScanForm], list[Rejection]]:
    """The generic-mode associative scans of ``gm`` with the linear combine, as closed forms, and rejections."""
    blocks = _tree_blocks(gm)
    if not blocks or has_symbolic_sizes(gm):
        # NB: sizes known only at run time: the backend matches the graph specialized to each call's sizes
        return [], []
    forms: list[ScanForm] = []
    rejections: list[Rejection] = []
    for tree in _trees(blocks):
        f, r = _scan_of(gm, tree)
        forms += f
        rejections += r
    return forms, rejections


def _scan_of(gm: fx.GraphModule, blocks: list[_Block]) -> tuple[list[ScanForm], list[Rejection]]:
    """One scan's blocks (:func:`_trees`) read as a closed form, or its rejection."""
    anchor = blocks[0].outs[0].name
    try:
        combines = []
        for b in blocks:
            n = len(b.ins) // 2
            if any(u.args[1] != 0 for u in b.ins) or any(u.args[3] != 0 for u in b.outs):
                raise _Miss(f"the vmap at {b.inc.name} maps over a dim other than 0")
            res = [u.args[0] for u in b.outs]
            c = linear_combine(b.ins[:n], b.ins[n:], res)
            if isinstance(c, str):
                raise _Miss(f"the combine at {b.inc.name}: {c}")
            combines.append((n, c))
        if len({(n, tuple(sorted(dec)), tuple(sorted(st.items(), key=str))) for n, (dec, st) in combines}) != 1:
            raise _Miss("the vmapped combines differ")
        leaves = _leaves(gm, blocks)
        outs = _tree(gm, blocks, leaves)
    except _Miss as e:
        return [], [Rejection("linear_recurrence", anchor, f"associative_scan (generic mode) at {anchor}: {e}")]
    _, (decay, state) = combines[0]
    leaves_in = [(v.args[0], _movedim(v)[0]) for v in leaves]
    forms = []
    for node, k in outs:
        x, d = leaves_in[k]
        if k in state:
            j = state[k]
            a = None if j == "one" else leaves_in[j][0]
            forms.append(ScanForm("associative_scan", node, a, x, d, details={"combine_mode": "generic", "leaf": k}))
        elif k in decay:
            forms.append(ScanForm("associative_scan", node, x, None, d, running_product=True,
                                  details={"combine_mode": "generic", "leaf": k}))
    return forms, []
