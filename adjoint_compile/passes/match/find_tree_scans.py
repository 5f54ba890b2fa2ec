"""Tree scans written in plain torch (a matcher; capture's passes/capture/scan_forms.py rewrites what it proves into one
``linear_scan`` node).

A parallel scan written with Python recursion reaches dynamo's graph as an unrolled DAG of strided slices, muls,
adds and interleaving (``cat``, ``pad``, ``stack`` + ``flatten``), log2(T) levels deep, with no scan node and no
vmap: accelerated-scan's ``ref.scan`` (Blelloch up-sweep and down-sweep by an even/odd split along the last dim,
T padded to a power of two), gateloop-transformer's ``associative_scan(binary_op, (a, b))`` (the jax port:
``_scan`` of odd/even slices, a Python combine ``(a_i * a_j, a_j * b_i + b_j)``, real or complex) and their like.
No structural reading of the tree is attempted; the proof is numerical, as for the registry of known scans:

1. **candidates**: a pair (A, B) of tensors that the tree's first level splits into even and odd steps along one
   dim d: a ``mul`` of two step-2 slices of A (the combined decays) and a ``mul`` of a step-2 slice of A with one of
   B. A and B may be right-padded along d (``F.pad``), or have one step prepended with ``cat`` (B's first step is
   then the initial state h0); the leaves a, b are what is under the padding.
2. **the tree**: every node computed from a, b (and h0) by slicing, ``cat``/``stack``/``pad``/views and
   ``mul``/``add``/``sub``/``neg``/``addcmul`` (scalars, ``zeros_like``-style constants and tensor factories
   allowed), and nothing else. A node that reads any other tensor is not in it.
3. **the proof**: the tree is run on the call's own shapes in float64 (complex128 for complex leaves), three draws
   of random a (in (0.9, 1.1), in (-1.05, 1.05) and in (0.01, 0.99): sign changes and products over the whole
   sequence both weigh) and normal b and h0; a node of the tree that equals ``linear_scan(a, b, h0, dim=d)`` in
   every draw to 1e-9 (relative to its largest value) is the scan. The tree's value is a polynomial in a, b and
   h0 (only the ops above), so agreement at random points is agreement as polynomials, not a coincidence.

A candidate whose tree has no such node (a combine ``a_j * b_i - b_j``, a ``maximum`` in the tree) is a
:class:`~adjoint_compile.regions.Rejection` saying why, and the graph keeps it. Matchers never mutate the graph.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import example_value, hinted_shape
from ...analysis.optable import name_of
from ...regions import Rejection
from .find_scan_forms import ScanForm

log = logging.getLogger(__name__)

__all__ = ["find_tree_scans", "TREE_FORM"]

#: ``details["form"]`` of a tree scan's ScanForm (its source is "associative_scan": an associative scan, as a tree)
TREE_FORM = "tree"

#: data movement: the value's elements are some of the input's, rearranged (or a constant fill).
_MOVE = frozenset("""getitem narrow select cat concat concatenate stack flatten unflatten view reshape view_as
reshape_as unsqueeze squeeze movedim moveaxis transpose swapaxes swapdims permute contiguous clone expand expand_as
pad split chunk unbind alias""".split())
#: arithmetic that keeps the tree's value a polynomial in its leaves.
_ARITH = frozenset("add sub rsub mul neg addcmul".split())
#: constants shaped like their input.
_LIKE = frozenset("zeros_like ones_like full_like".split())
#: tensor factories (no tensor inputs).
_FACTORY = frozenset("zeros ones full tensor scalar_tensor".split())
_ALLOWED = _MOVE | _ARITH | _LIKE
#: the largest leaf the numerical check runs on (elements); beyond it the candidate is rejected.
MAX_CHECK_ELEMENTS = 1 << 22
_TOL = 1e-9
_DRAWS = ((0.9, 1.1), (-1.05, 1.05), (0.01, 0.99))


class _Miss(Exception):
    """The candidate is not a tree scan; the message says why."""


# ----------------------------------------------------------------------------------------------------------------
# candidates


def _index_dims(idx: Any, rank: int) -> list[Any] | None:
    """A basic index of slices and ``...`` as one slice per dim; None for anything else (ints, None, tensors)."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if sum(i is Ellipsis for i in items) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        fill = rank - (len(items) - 1)
        if fill < 0:
            return None
        items = items[:k] + [slice(None)] * fill + items[k + 1:]
    return items + [slice(None)] * (rank - len(items)) if len(items) <= rank else None


def _strided(n: Any) -> tuple[fx.Node, int] | None:
    """(source, dim) when ``n`` is ``x[..., s::2, ...]``: a step-2 slice along one dim, full slices elsewhere."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem and
            len(n.args) == 2 and isinstance(n.args[0], fx.Node)):
        return None
    shp = hinted_shape(n.args[0])
    if shp is None:
        return None
    dims = _index_dims(n.args[1], len(shp))
    if dims is None:
        return None
    full = slice(None)
    stepped = [d for d, s in enumerate(dims) if s != full]
    if len(stepped) != 1 or dims[stepped[0]].step != 2:
        return None
    return n.args[0], stepped[0]


def _candidates(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, int]]:
    """(A, B, d) pairs: a mul of two step-2 slices of A along d, and a mul of such slices of A and of B."""
    decays: set[tuple[fx.Node, int]] = set()
    pairs: dict[tuple[fx.Node, fx.Node, int], None] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or name_of(n) != "mul" or len(n.args) != 2 or n.kwargs:
            continue
        u, v = _strided(n.args[0]), _strided(n.args[1])
        if u is None or v is None or u[1] != v[1]:
            continue
        if u[0] is v[0]:
            decays.add(u)
        else:
            pairs[(u[0], v[0], u[1])] = None
            pairs[(v[0], u[0], u[1])] = None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = [(a, b, d) for (a, b, d) in pairs if (a, d) in decays]
    return sorted(found, key=lambda p: (max(order[p[0]], order[p[1]]), order[p[0]]))


# ----------------------------------------------------------------------------------------------------------------
# leaves


def _arg(n: fx.Node, pos: int, key: str, default: Any = None) -> Any:
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(key, default)


def _right_padded(n: fx.Node, d: int) -> fx.Node | None:
    """x when ``n`` is ``F.pad(x, ...)`` that pads dim d at its end only (any constant)."""
    if name_of(n) != "pad" or not isinstance(n.args[0], fx.Node):
        return None
    pad, mode = _arg(n, 1, "pad"), _arg(n, 2, "mode", "constant")
    shp = hinted_shape(n.args[0])
    if shp is None or not isinstance(pad, (list, tuple)) or mode not in ("constant", None):
        return None
    k = len(shp) - 1 - d  # F.pad's pairs run from the last dim
    want = [0] * len(pad)
    if len(pad) % 2 or 2 * k + 1 >= len(pad):
        return None
    want[2 * k + 1] = pad[2 * k + 1]
    return n.args[0] if list(pad) == want and isinstance(pad[2 * k + 1], int) and pad[2 * k + 1] > 0 else None


def _prepended(n: fx.Node, d: int) -> tuple[fx.Node, fx.Node] | None:
    """(first, x) when ``n`` is ``cat([first, x], d)`` with one step in ``first``."""
    if name_of(n) not in ("cat", "concat", "concatenate"):
        return None
    items, cd = _arg(n, 0, "tensors"), _arg(n, 1, "dim", 0)
    shp = hinted_shape(n)
    if not isinstance(items, (list, tuple)) or len(items) != 2 or shp is None or not isinstance(cd, int) or \
            cd % len(shp) != d or not all(isinstance(i, fx.Node) for i in items):
        return None
    fs = hinted_shape(items[0])
    return (items[0], items[1]) if fs is not None and len(fs) == len(shp) and fs[d] == 1 else None


@dataclasses.dataclass
class _Leaves:
    a: fx.Node
    b: fx.Node
    h0: fx.Node | None = None
    #: inputs the scan must not depend on (the first step of a prepended a)
    extra: tuple[fx.Node, ...] = ()
    how: str = "as written"


def _leaf_options(A: fx.Node, B: fx.Node, d: int) -> list[_Leaves]:
    """The leaves to try, peeled first: under a right pad, under a prepended step (B's: h0), then A and B."""
    out = []
    pa, pb = _right_padded(A, d), _right_padded(B, d)
    if pa is not None or pb is not None:
        a, b = pa if pa is not None else A, pb if pb is not None else B
        if _len(a, d) == _len(b, d):
            out.append(_Leaves(a, b, how="under the padding"))
    ca, cb = _prepended(A, d), _prepended(B, d)
    if ca is not None and cb is not None and _len(ca[1], d) == _len(cb[1], d):
        out.append(_Leaves(ca[1], cb[1], h0=cb[0], extra=(ca[0],), how="after a prepended first step (h0)"))
    out.append(_Leaves(A, B))
    return out


def _len(n: fx.Node, d: int) -> int | None:
    s = hinted_shape(n)
    return s[d] if s is not None and len(s) > d else None


# ----------------------------------------------------------------------------------------------------------------
# the tree and its evaluation


def _allowed(n: fx.Node) -> bool:
    name = name_of(n)
    if name not in _ALLOWED:
        return False
    if name == "getitem":  # basic indexing only: no tensor index
        return len(n.all_input_nodes) == 1
    if name == "pad":
        return _arg(n, 2, "mode", "constant") in ("constant", None)
    return True


def _constant(n: fx.Node) -> bool:
    """A node whose value does not depend on any input: a tensor factory, or a lifted constant."""
    return n.op == "get_attr" or (n.op == "call_function" and not n.all_input_nodes and name_of(n) in _FACTORY)


def _tree(gm: fx.GraphModule, inputs: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(nodes computed from ``inputs`` by the allowed ops alone, in graph order; the first few nodes that read the
    tree with another op)."""
    inside: set[fx.Node] = set(inputs)
    nodes, blockers = [], []
    for n in gm.graph.nodes:
        if n in inside or n.op not in ("call_function", "call_method"):
            continue
        ins = n.all_input_nodes
        if not any(i in inside for i in ins):
            continue
        if not _allowed(n):
            if len(blockers) < 3:
                blockers.append(n)
            continue
        if all(i in inside or _constant(i) for i in ins):
            inside.add(n)
            nodes.append(n)
    return nodes, blockers


def _dtype(n: fx.Node) -> torch.dtype:
    ev = example_value(n)
    return torch.complex128 if isinstance(ev, torch.Tensor) and ev.is_complex() else torch.float64


def _draw(n: fx.Node, gen: torch.Generator, unit: tuple[float, float] | None) -> torch.Tensor:
    shape, dt = tuple(hinted_shape(n)), _dtype(n)
    if unit is None:
        return torch.randn(shape, generator=gen, dtype=dt)
    lo, hi = unit
    r = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    if dt.is_complex:  # |a| as drawn, any phase
        r = r * torch.exp(1j * torch.rand(shape, generator=gen, dtype=torch.float64) * 6.283185307179586)
    return r


def _cast(v: Any) -> Any:
    """Floating-point and complex values in float64 / complex128 (factories and constants of the graph's dtype)."""
    if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.dtype not in (
            torch.float64, torch.complex128):
        return v.to(torch.complex128 if v.is_complex() else torch.float64)
    return v


def _run(gm: fx.GraphModule, nodes: list[fx.Node], env: dict[fx.Node, Any], keep: set[fx.Node]) -> None:
    """Evaluate ``nodes`` on real tensors (values of inputs in ``env``); a value is dropped after its last use in
    ``nodes`` unless in ``keep``."""
    last: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for i in n.all_input_nodes:
            last[i] = n

    def val(x: Any) -> Any:
        if not isinstance(x, fx.Node):
            return x
        if x not in env:  # a constant
            if x.op == "get_attr":
                v: Any = gm
                for part in str(x.target).split("."):
                    v = getattr(v, part)
            else:
                v = x.target(*fx.node.map_arg(x.args, val), **fx.node.map_arg(x.kwargs, val))
            env[x] = _cast(v)
        return env[x]

    for n in nodes:
        args, kwargs = fx.node.map_arg(n.args, val), fx.node.map_arg(n.kwargs, val)
        v = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        env[n] = _cast(v)
        for i in n.all_input_nodes:
            if last.get(i) is n and i not in keep:
                env.pop(i, None)


def reference_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, d: int) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t along ``d`` (h_{-1} = h0 or 0), by doubling (Hillis-Steele): log2(T) vectorized
    steps, in the inputs' (float64 / complex128) precision."""
    a, b = torch.broadcast_tensors(a, b)
    a, b = a.movedim(d, 0).clone(), b.movedim(d, 0).clone()
    if h0 is not None:
        b[0] = b[0] + a[0] * h0.movedim(d, 0)[0]
    k, T = 1, a.shape[0]
    while k < T:
        b = torch.cat([b[:k], b[k:] + a[k:] * b[:-k]])
        a = torch.cat([a[:k], a[k:] * a[:-k]])
        k *= 2
    return b.movedim(0, d)


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-300)) if y.numel() else 0.0


def _prove(gm: fx.GraphModule, lv: _Leaves, d: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the tree's nodes that equal the scan of the leaves, the tree's nodes): raises :class:`_Miss` with the
    reason when none does."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inputs = [lv.a, lv.b, *([lv.h0] if lv.h0 is not None else []), *lv.extra]
    shapes = [hinted_shape(x) for x in inputs]
    if any(s is None for s in shapes):
        raise _Miss("the leaves have no static shape")
    try:
        out_shape = torch.broadcast_shapes(tuple(shapes[0]), tuple(shapes[1]))
    except RuntimeError:
        raise _Miss(f"a {list(shapes[0])} and b {list(shapes[1])} do not broadcast") from None
    for x in inputs[:3]:
        ev = example_value(x)
        if not isinstance(ev, torch.Tensor) or not (ev.is_floating_point() or ev.is_complex()):
            raise _Miss(f"{x.name} is not a floating-point or complex tensor")
    if out_shape[d] < 2:
        raise _Miss(f"{out_shape[d]} step(s): nothing to scan")
    big = max(torch.Size(s).numel() for s in shapes)
    if big > MAX_CHECK_ELEMENTS:
        raise _Miss(f"its leaves have {big} elements, more than the numerical check runs on "
                    f"({MAX_CHECK_ELEMENTS}; it runs on the call's own shapes)")
    nodes, blockers = _tree(gm, inputs)
    want_dt = torch.complex128 if any(_dtype(x).is_complex for x in inputs[:3]) else torch.float64
    like = [n for n in nodes if hinted_shape(n) == tuple(out_shape) and
            isinstance(example_value(n), torch.Tensor) and _dtype(n) == want_dt]
    survivors, nearest = list(like), None
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily(), torch.no_grad():
        for unit in _DRAWS:
            if not survivors:
                break
            env: dict[fx.Node, Any] = {lv.a: _draw(lv.a, gen, unit), lv.b: _draw(lv.b, gen, None)}
            for x in inputs[2:]:
                env[x] = _draw(x, gen, None)
            try:
                _run(gm, nodes, env, {*survivors, *inputs})
            except Exception as e:  # noqa: BLE001 - an op that does not run on real tensors: not provable
                raise _Miss(f"its nodes do not run on real tensors ({type(e).__name__}: {e})") from None
            want = reference_scan(env[lv.a], env[lv.b], env.get(lv.h0), d)
            errs = {n: _rel(env[n].to(want.dtype), want) for n in survivors}
            if nearest is None and errs:
                nearest = min(errs.items(), key=lambda kv: kv[1])
            survivors = [n for n in survivors if errs[n] <= _TOL]
    if survivors:
        return survivors, nodes
    why = [f"no value computed from them equals their linear scan along dim {d}"]
    if nearest is not None:
        why.append(f"(nearest: {nearest[0].name}, rel. error {nearest[1]:.1e})")
    else:
        why.append(f"(none of its {len(nodes)} node(s) has the scan's shape {list(out_shape)})")
    if blockers:
        why[-1] += ";"
        why.append("the tree is read by " + ", ".join(f"{name_of(n) or n.target} at {n.name}" for n in blockers)
                   + ", which a linear scan's tree does not use")
    raise _Miss(" ".join(why))


def _ancestors(outs: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), list(outs)
    while stack:
        n = stack.pop()
        if n in seen or n not in within:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def find_tree_scans(gm: fx.GraphModule) -> tuple[list[ScanForm], list[Rejection]]:
    """The tree scans of ``gm`` (proven numerically, see the module docstring) and the candidates that are not."""
    forms: list[ScanForm] = []
    rejected: list[Rejection] = []
    claimed: set[fx.Node] = set()
    for A, B, d in _candidates(gm):
        if A in claimed or B in claimed:
            continue
        why, found = [], None
        for lv in _leaf_options(A, B, d):
            try:
                outs, nodes = _prove(gm, lv, d)
            except _Miss as e:
                why.append(str(e))
                claimed.update(_tree(gm, [lv.a, lv.b])[0])
                continue
            found = (lv, outs, nodes)
            break
        if found is None:
            anchor = next((u for u in A.users if _strided(u)), A)
            # NB: the reason for the most peeled leaves (under a padding, after a prepended step) comes first
            rejected.append(Rejection("linear_recurrence", anchor.name,
                                      f"tree scan over ({A.name}, {B.name}) along dim {d} at {anchor.name}: {why[0]}"))
            log.debug("find_tree_scans: %s", rejected[-1].reason)
            continue
        lv, outs, nodes = found
        tree = _ancestors(outs, set(nodes))
        claimed |= tree | {A, B}
        # NB: one scan per value read outside the tree (usually the last: the output, or its slice to T steps)
        used = [n for n in outs if any(u not in tree for u in n.users)]
        for n in used:
            forms.append(ScanForm("associative_scan", n, lv.a, lv.b, d, h0=lv.h0, details={
                "form": TREE_FORM, "leaves": lv.how, "tree_nodes": len(tree), "a": lv.a.name, "b": lv.b.name}))
    return forms, rejected
