"""Re-roll recurrences into one ``linear_scan`` node (DESIGN.md §3 "Unrolled loops are re-rolled into one scan first").

Recognition finds linear recurrences h_t = a_t ⊙ h_{t-1} + b_t in four capture forms; the exact lowering
(:mod:`.lower_adjoint`) handles one of them, the ``linear_scan`` node. This pass rewrites the other three so that
each recurrence becomes

    A = a for all steps at once      [T, *state]   (step axis first)
    B = b for all steps at once      [T, *state]
    H = linear_scan(A, B, h0, dim=0) [T, *state]   H[t] = A[t] ⊙ H[t-1] + B[t],  H[-1] := h0

and every former use of a per-step state (or of the scan op's outputs) reads from H:

* ``unrolled_loop`` (a Python loop dynamo unrolled): state k is ``H[k]``; a ``torch.stack`` of all states along
  ``d`` becomes ``H.movedim(0, d)``. A and B come, in order of preference, from

  - the *batched* step: the template step's computation of a_t and b_t re-emitted once for all steps, with each
    per-step slice ``x[:, t]`` replaced by the whole sequence ``x.movedim(1, 0)`` (op by op, under rules that
    are exact for every op they accept: pointwise ops with broadcasting, ``matmul``/``linear`` with the step on the
    left, feature-dim norms, reductions and views with their dims shifted). These ops keep the step axis, so the
    sharded lowering can include them in its time-local region;
  - the *stacked* steps: ``torch.stack`` of the per-step a_k and b_k already in the graph, each proven by its own
    affine expansion of h_k in h_{k-1} (no reliance on the loop's same-computation proof).

* ``scan`` (``torch.ops.higher_order.scan``): the step sub-graph's a and b batched over the scan's ``xs`` (which
  dynamo already moved to dim 0); the final carry is ``H[-1]``; each ``ys`` output is ``H`` when it is the new
  state, else its step computation batched with the new state as ``H`` and the old one as ``[h0, H[:-1]]``.
  Every carry of the op must be linear, so that the op itself disappears.
* ``associative_scan`` with the linear combine: A and B are its leaves (a = 1 for a running sum); a running
  product leaf is ``linear_scan(a, 0, h0=1)``.

Soft failure: a recurrence whose rewrite cannot be proven keeps its nodes untouched, ``region.not_rerolled`` says
why (also recorded on its anchor node as ``meta["adjoint_compile"] = {"pass": "reroll", "not_rerolled": why}``, so
that recognition of the normalized graph can report it), and the pass goes on with the next one. New nodes carry
``node.meta["adjoint_compile"] = {"pass": "reroll", "source": ..., "region": ...}``;
:func:`~adjoint_compile.passes.find_recurrences.match_linear_scan` reads it back, so the scan is recognized under
the capture form and the name the user wrote it with.

Part of the capture stage (:func:`~adjoint_compile.passes.capture.capture`): the graph is normalized once, before
recognition runs on it.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..regions import PROVENANCE, Recurrence, Region
from .affine import Atom, Const, Expr, Prod, Quot, Sum, classify_update, example_value, forward_reach, shape_of

from .graph_utils import stable_toposort as _toposort

log = logging.getLogger(__name__)

__all__ = ["reroll", "needs_reroll", "REROLL_SOURCES"]

#: the capture forms this pass turns into a linear_scan node.
REROLL_SOURCES = ("scan", "associative_scan", "unrolled_loop")


def needs_reroll(region: Region) -> bool:
    """True for a linear recurrence captured as a scan op, an associative_scan op or an unrolled loop."""
    return isinstance(region, Recurrence) and region.kind == "linear_recurrence" and region.source in REROLL_SOURCES


class _Unproven(Exception):
    """The rewrite of one recurrence could not be proven; the message is the reason."""


# ----------------------------------------------------------------------------------------------------------------
# op tables: which torch-level ops the batched re-emission accepts, and how

_MODULES = (operator, torch, F, torch._C._nn, torch.special, torch.Tensor, torch._C._VariableFunctions)
_POINTWISE = set("""add sub rsub mul div truediv true_divide floordiv neg pos clone contiguous sigmoid tanh exp exp2
expm1 log log1p log2 relu gelu silu softplus abs sqrt rsqrt sin cos square pow reciprocal clamp clamp_min clamp_max
elu leaky_relu logsigmoid mish softsign hardtanh where maximum minimum float double half bfloat16 to type_as sign
erf""".split())
#: ops with dim arguments (position, keyword) that index a per-step tensor: shifted by one when batched.
_DIMS: dict[str, tuple[tuple[int, str], ...]] = {
    "softmax": ((1, "dim"),), "log_softmax": ((1, "dim"),), "sum": ((1, "dim"),), "mean": ((1, "dim"),),
    "amax": ((1, "dim"),), "amin": ((1, "dim"),), "logsumexp": ((1, "dim"),), "cumsum": ((1, "dim"),),
    "unsqueeze": ((1, "dim"),), "squeeze": ((1, "dim"),), "transpose": ((1, "dim0"), (2, "dim1")),
}
_VIEWS = {"view", "reshape"}
_NORMS = {"layer_norm", "rms_norm", "linear"}
_MATMUL = {"matmul"}
_FN_NAME: dict[Any, str] = {}
for _name in sorted(_POINTWISE | set(_DIMS) | _VIEWS | _NORMS | _MATMUL):
    for _mod in _MODULES:
        _obj = getattr(_mod, _name, None)
        if _obj is not None and callable(_obj):
            try:
                _FN_NAME.setdefault(_obj, _name)
            except TypeError:
                pass


def _op(n: fx.Node) -> str | None:
    """Short name of a node's op when it is one this pass knows (``operator.add`` and ``x.add`` -> "add")."""
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        try:
            return _FN_NAME.get(n.target)
        except TypeError:
            return None
    return None


def _scan_op() -> Any:
    ns = getattr(torch.ops, "adjoint_compile", None)
    try:
        return ns.linear_scan.default if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# emitting nodes with their example values


@dataclasses.dataclass
class _V:
    """A value in the outer graph: ``node`` (or a Python scalar) and whether it has the step axis first."""

    node: Any
    batched: bool

    def rank(self) -> int:
        ev = example_value(self.node)
        if not isinstance(ev, torch.Tensor):
            return 0
        return ev.dim() - (1 if self.batched else 0)


class _Emit:
    """Creates nodes before the graph's output, with ``example_value`` from fake tensors and provenance.

    Nothing it creates is used by the old graph until the caller commits, so :meth:`rollback` can erase it all.
    """

    def __init__(self, gm: fx.GraphModule, prov: dict[str, Any]) -> None:
        self.gm = gm
        self.prov = prov
        self.made: list[fx.Node] = []
        self.out = next(n for n in gm.graph.nodes if n.op == "output")
        self.mode = _fake_mode(gm)

    def __call__(self, target: Any, args: tuple = (), kwargs: dict | None = None, method: bool = False) -> fx.Node:
        kwargs = kwargs or {}
        fa = fx.node.map_arg(args, example_value)
        fk = fx.node.map_arg(kwargs, example_value)
        try:
            with self.mode:
                ev = getattr(fa[0], target)(*fa[1:], **fk) if method else target(*fa, **fk)
        except Exception as e:  # noqa: BLE001 - a rule produced an op torch refuses: not provable
            raise _Unproven(f"{getattr(target, '__name__', target)} on the batched values fails: "
                            f"{type(e).__name__}: {e}") from e
        with self.gm.graph.inserting_before(self.out):
            n = self.gm.graph.create_node("call_method" if method else "call_function", target, args, kwargs)
        n.meta["example_value"] = ev
        n.meta[PROVENANCE] = dict(self.prov)
        self.made.append(n)
        return n

    def rollback(self) -> None:
        for n in reversed(self.made):
            self.gm.graph.erase_node(n)
        self.made.clear()


def _fake_mode(gm: fx.GraphModule) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # NB: the mode of the graph's own example values: inside a backend call, the tracing context's mode can be
    # another one, and fake tensors of two modes do not mix
    for n in gm.graph.nodes:
        v = example_value(n)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _shape(v: Any) -> tuple[int, ...] | None:
    return shape_of(v) if isinstance(v, fx.Node) else None


# ----------------------------------------------------------------------------------------------------------------
# the batched re-emission of one step's computation


class _Batcher:
    """Re-emit a step's computation once for all T steps, step axis first.

    ``leaves`` map step values to outer values (per-step slices -> whole sequences, sub-graph inputs -> outer
    nodes); ``inside(v)`` says whether ``v`` belongs to the step (and is re-emitted); ``outer_ok(v)`` whether a
    value outside the step may be read as it is (a weight shared by all steps).
    """

    def __init__(self, em: _Emit, T: int, leaves: dict[fx.Node, _V], inside: Callable[[fx.Node], bool],
                 outer_ok: Callable[[fx.Node], bool], lazy: dict[fx.Node, Callable[[], _V]] | None = None) -> None:
        self.em, self.T, self.inside, self.outer_ok = em, T, inside, outer_ok
        self.memo: dict[fx.Node, _V] = dict(leaves)
        #: leaves whose outer value is made on first use (a per-step slice that a and b may not read)
        self.lazy = dict(lazy or {})
        self.seqs: dict[tuple, _V] = {}

    def value(self, v: Any) -> _V:
        if not isinstance(v, fx.Node):
            return _V(v, False)
        if v in self.memo:
            return self.memo[v]
        if v in self.lazy:
            self.memo[v] = self.lazy.pop(v)()
            return self.memo[v]
        if not self.inside(v):
            if self.outer_ok(v):
                self.memo[v] = _V(v, False)
                return self.memo[v]
            raise _Unproven(f"the step reads {v.name}, which is neither a per-step slice nor shared by all steps")
        if v.op not in ("call_function", "call_method"):
            raise _Unproven(f"step value {v.name} is a {v.op}")
        name = _op(v)
        if name is None:
            raise _Unproven(f"step op {v.name} ({v.target}) has no batching rule")
        for a in v.all_input_nodes:
            self.value(a)
        args = fx.node.map_arg(v.args, self.memo.__getitem__) if v.all_input_nodes else v.args
        kwargs = fx.node.map_arg(v.kwargs, self.memo.__getitem__) if v.all_input_nodes else v.kwargs
        res = self._emit(v, name, args, kwargs)
        want = _shape(v)
        got = _shape(res.node)
        if want is not None and got is not None and got != ((self.T,) + want if res.batched else want):
            raise _Unproven(f"batched {v.name} has shape {list(got)}, expected {[self.T, *want]}")
        self.memo[v] = res
        return res

    def _emit(self, v: fx.Node, name: str, args: Any, kwargs: Any) -> _V:
        vals = [x for x in _flat(args) + _flat(kwargs) if isinstance(x, _V)]
        method = v.op == "call_method"
        if not any(x.batched for x in vals):
            # NB: a value that is the same at every step (computed from shared weights only) is copied once
            return _V(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), False)
        first = args[0] if args else None
        rest_unbatched = all(not x.batched for x in vals if x is not first)
        if name in _POINTWISE:
            if any(k in ("dim", "dims", "axis") for k in kwargs):
                raise _Unproven(f"pointwise op {v.name} has a dim argument")
            R = max(x.rank() for x in vals)
            args = _map_vals(args, lambda x: self.pad(x, R))
            kwargs = _map_vals(kwargs, lambda x: self.pad(x, R))
            return _V(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), True)
        if not isinstance(first, _V) or not first.batched:
            raise _Unproven(f"op {v.name} ({name}) reads a per-step value in an argument other than its first")
        if name in _MATMUL and len(args) == 2 and not kwargs:
            x, w = args
            if isinstance(w, _V) and w.batched:
                R = max(x.rank(), w.rank())
                if min(x.rank(), w.rank()) < 2:
                    raise _Unproven(f"matmul {v.name} of two per-step values of rank < 2")
                x, w = self.pad(x, R), self.pad(w, R)
            return _V(self.em(v.target, _unwrap((x, w)), {}, method), True)
        if not rest_unbatched:
            raise _Unproven(f"op {v.name} ({name}) reads per-step values in several arguments")
        if name in _NORMS:
            # NB: linear/layer_norm/rms_norm act on the trailing feature dims only: a leading step axis is a batch dim
            return _V(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), True)
        if name in _VIEWS:
            shape = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            if kwargs or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
                raise _Unproven(f"{name} {v.name} has a shape that is not a tuple of ints")
            return _V(self.em(v.target, (first.node, (self.T, *shape)), {}, method), True)
        if name in _DIMS:
            args, kwargs = list(args), dict(kwargs)
            for pos, kw in _DIMS[name]:
                if pos < len(args):
                    args[pos] = _shift(args[pos], v.name)
                elif kw in kwargs:
                    kwargs[kw] = _shift(kwargs[kw], v.name)
                else:
                    raise _Unproven(f"{name} {v.name} has no dim argument (all dims, the step's included)")
            return _V(self.em(v.target, _unwrap(tuple(args)), _unwrap(kwargs), method), True)
        raise _Unproven(f"op {v.name} ({name}) has no batching rule")

    def pad(self, x: Any, R: int) -> Any:
        """A batched value with unit dims after the step axis, so that its per-step rank is R (broadcasting)."""
        if not isinstance(x, _V) or not x.batched:
            return x
        node = x.node
        for _ in range(R - x.rank()):
            node = self.em(torch.unsqueeze, (node, 1))
        return _V(node, True)


def _shift(d: Any, where: str) -> Any:
    """A dim of a per-step tensor as a dim of the batched one (negative dims count from the end: unchanged)."""
    if isinstance(d, bool) or d is None:
        raise _Unproven(f"op {where} has dim={d!r}")
    if isinstance(d, int):
        return d + 1 if d >= 0 else d
    if isinstance(d, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in d):
        return type(d)(x + 1 if x >= 0 else x for x in d)
    raise _Unproven(f"op {where} has dim={d!r}")


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


def _map_vals(x: Any, fn: Callable[[_V], Any]) -> Any:
    if isinstance(x, _V):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_vals(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_vals(v, fn) for k, v in x.items()}
    return x


def _unwrap(x: Any) -> Any:
    return _map_vals(x, lambda v: v.node)


# ----------------------------------------------------------------------------------------------------------------
# a and b as [T, *state] tensors, and the scan


def _expr(b: _Batcher, e: Expr, atom: Callable[[fx.Node], _V]) -> _V:
    """Emit an affine coefficient expression with its atoms' values (broadcasting like the step did)."""
    em = b.em

    def pw(fn: Any, x: _V, y: _V) -> _V:
        R = max(x.rank(), y.rank())
        x, y = b.pad(x, R), b.pad(y, R)
        if not isinstance(x.node, fx.Node) and not isinstance(y.node, fx.Node):
            return _V(fn(x.node, y.node), False)
        return _V(em(fn, (x.node, y.node)), x.batched or y.batched)

    if isinstance(e, Const):
        return _V(float(e.value), False)
    if isinstance(e, Atom):
        return atom(e.n)
    if isinstance(e, Sum):
        total: _V | None = None
        for c, t in e.terms:
            v = _expr(b, t, atom)
            if c != 1:
                v = pw(operator.mul, _V(float(c), False), v)
            total = v if total is None else pw(operator.add, total, v)
        assert total is not None
        return total
    if isinstance(e, Prod):
        out = _expr(b, e.factors[0], atom)
        for f in e.factors[1:]:
            out = pw(operator.mul, out, _expr(b, f, atom))
        return out
    if isinstance(e, Quot):
        return pw(operator.truediv, _expr(b, e.num, atom), _expr(b, e.den, atom))
    raise _Unproven(f"unknown coefficient expression {e}")


def _full(b: _Batcher, v: _V | None, state: tuple[int, ...], like: fx.Node | None, fill: float) -> fx.Node:
    """``v`` as a [T, *state] tensor: broadcast over the state, repeated over the steps when it does not vary."""
    em, T = b.em, b.T
    if v is None or not isinstance(v.node, fx.Node):
        value = fill if v is None else v.node
        if like is None:
            raise _Unproven("both a and b are constants")
        return em(torch.full_like, (like, value))
    node = v.node
    if not v.batched:
        node = em(torch.unsqueeze, (node, 0))
    if _shape(node) != (T, *state):
        node = em("expand", (node, T, *state), method=True)
    return node


def _check_scan_inputs(A: fx.Node, B: fx.Node, h0: Any, T: int, state: tuple[int, ...], dtype: Any) -> None:
    for what, x in (("a", A), ("b", B)):
        ev = example_value(x)
        if tuple(ev.shape) != (T, *state):
            raise _Unproven(f"{what} for all steps has shape {list(ev.shape)}, expected {[T, *state]}")
        if ev.dtype != dtype:
            raise _Unproven(f"{what} has dtype {ev.dtype}, the state {dtype}")


def _h0(em: _Emit, h0: Any, state: tuple[int, ...]) -> Any:
    if h0 is None:
        return None
    if not isinstance(h0, fx.Node) or not isinstance(example_value(h0), torch.Tensor):
        raise _Unproven(f"the initial state {h0!r} is not a tensor in the graph")
    if _shape(h0) != state:
        h0 = em("expand", (h0, *state), method=True)
    return h0


def _scan(em: _Emit, A: fx.Node, B: fx.Node, h0: Any, T: int, state: tuple[int, ...], dtype: Any) -> fx.Node:
    op = _scan_op()
    if op is None:
        raise _Unproven("the linear_scan op (torch.ops.adjoint_compile.linear_scan) is not registered")
    _check_scan_inputs(A, B, h0, T, state, dtype)
    # NB: every argument positionally: (a, b, h0, dim, reverse, window, impl), as lower_adjoint reads them
    H = em(op, (A, B, _h0(em, h0, state), 0, False, None, None))
    if tuple(example_value(H).shape) != (T, *state):
        raise _Unproven(f"linear_scan gives shape {list(example_value(H).shape)}, expected {[T, *state]}")
    return H


# ----------------------------------------------------------------------------------------------------------------
# unrolled loops


def _slice_seq(b: _Batcher, slot: fx.Node, x: dict[str, Any], first_step: int) -> _V:
    """The whole sequence [T, ...] that a per-step slice ``slot`` (``x[:, t]``, ``select``, an unbind item) reads."""
    em, T = b.em, b.T
    if x.get("first_step") != first_step:
        raise _Unproven(f"slice {slot.name} has no value recorded for the loop's first step")
    stride, start = x.get("stride"), x.get("start")
    if stride not in (1, -1) or not isinstance(start, int):
        raise _Unproven(f"slice {slot.name} steps by {stride}, not by 1 or -1")
    src, dim = None, None
    fname = _op(slot) or getattr(slot.target, "__name__", str(slot.target))
    if slot.op == "call_function" and slot.target is operator.getitem and slot.args:
        base, idx = slot.args[0], slot.args[1]
        if isinstance(base, fx.Node) and base.op in ("call_function", "call_method") and \
                (base.target == "unbind" or getattr(base.target, "__name__", "") == "unbind"):
            if isinstance(idx, int) and base.args:
                src = base.args[0]
                dim = base.args[1] if len(base.args) > 1 else base.kwargs.get("dim", 0)
        elif x.get("index_position") == 0:
            items = idx if isinstance(idx, tuple) else (idx,)
            ints = [i for i, it in enumerate(items) if isinstance(it, int) and not isinstance(it, bool)]
            full = all(isinstance(it, slice) and (it.start, it.stop, it.step) == (None, None, None)
                       for i, it in enumerate(items) if i not in ints)
            if len(ints) == 1 and full:
                src, dim = base, ints[0]
    elif fname == "select" and x.get("index_position") == 0:
        src = slot.args[0]
        dim = slot.args[1] if len(slot.args) > 1 else slot.kwargs.get("dim")
    if not isinstance(src, fx.Node) or not isinstance(dim, int) or _shape(src) is None:
        raise _Unproven(f"slice {slot.name} is not x[..., t, ...], select or an unbind item")
    size = _shape(src)
    dim = dim % len(size)
    n = size[dim]
    start = start + n if start < 0 else start
    lo = start if stride == 1 else start - T + 1
    if not (0 <= lo and lo + T <= n):
        raise _Unproven(f"slice {slot.name} reads steps {lo}..{lo + T - 1} of {n}")
    if not b.outer_ok(src):
        raise _Unproven(f"slice {slot.name} reads {src.name}, which is computed inside the loop")
    key = (src, dim, lo, stride)
    if key in b.seqs:  # NB: x[:, t] read twice in a step (dynamo slices once per use) is one sequence
        return b.seqs[key]
    seq = src if dim == 0 else em(torch.movedim, (src, dim, 0))
    if lo != 0 or T != n:
        seq = em(torch.narrow, (seq, 0, lo, T))
    if stride == -1:
        seq = em(torch.flip, (seq, [0]))
    b.seqs[key] = _V(seq, True)
    return b.seqs[key]


def _loop(gm: fx.GraphModule, r: Recurrence) -> tuple[list[fx.Node], fx.Node, dict[str, fx.Node], dict[fx.Node, int]]:
    recipe = r.reroll or {}
    by_name = {n.name: n for n in gm.graph.nodes}
    try:
        states = [by_name[s] for s in recipe["states"]]
    except KeyError as e:
        raise _Unproven(f"the loop's state {e} is no longer in the graph") from None
    h0 = by_name.get(recipe.get("h0") or "")
    if h0 is None:
        raise _Unproven("the loop's initial state is not a graph value")
    if len(states) != r.length or len(states) < 2:
        raise _Unproven(f"the re-roll recipe has {len(states)} states for {r.length} steps")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return states, h0, by_name, pos


def _unrolled_batched(gm: fx.GraphModule, r: Recurrence, em: _Emit, states: list[fx.Node], h0: fx.Node,
                      by_name: dict[str, fx.Node], pos: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node]:
    """A and B from the template step batched over the loop's per-step slices."""
    recipe = r.reroll or {}
    T = len(states)
    matched = bool(recipe.get("first_step_matched"))
    tmpl_new, tmpl_prev = (states[1], states[0]) if matched else (states[0], h0)
    try:
        template = [by_name[s] for s in recipe["template_step"]]
        carried = [by_name[c["template"]] for c in recipe.get("carried", [])]
    except KeyError as e:
        raise _Unproven(f"the template step's node {e} is no longer in the graph") from None
    if template[-1] is not tmpl_new:
        raise _Unproven("the template step does not end in the loop's state")
    loop_start = min(pos[n] for n in r.nodes if n in pos) if r.nodes else pos[states[0]]
    depends = forward_reach([tmpl_prev, *carried], tmpl_new, pos).__contains__
    form = classify_update(tmpl_new, tmpl_prev, depends)
    if form.kind != "linear":
        raise _Unproven(f"the template step is not linear in the carry ({form.reason})")
    inside = set(template)
    slots = {}
    for x in recipe.get("xs", []):
        n = by_name.get(x.get("node", ""))
        if n is None:
            raise _Unproven(f"per-step slice {x.get('node')} is no longer in the graph")
        if n in slots:
            raise _Unproven(f"slice {n.name} varies in more than one index")
        slots[n] = x
    first = 1 if matched else 2
    b = _Batcher(em, T, {}, inside.__contains__, lambda v: pos.get(v, len(pos)) < loop_start and v not in slots)
    b.lazy = {n: (lambda n=n, x=x: _slice_seq(b, n, x, first)) for n, x in slots.items()}
    state = _shape(tmpl_new)
    A = _expr(b, form.coef, b.value)
    Bv = _expr(b, form.offset, b.value) if form.offset is not None else None
    A_full = _full(b, A, state, None, 1.0) if isinstance(A.node, fx.Node) else None
    B_full = _full(b, Bv, state, A_full, 0.0) if Bv is not None or A_full is not None else None
    if A_full is None:
        A_full = _full(b, A, state, B_full, 1.0)
    return A_full, B_full


def _unrolled_stacked(gm: fx.GraphModule, r: Recurrence, em: _Emit, states: list[fx.Node],
                      h0: fx.Node) -> tuple[fx.Node, fx.Node]:
    """A and B as stacks of the per-step a_k, b_k, each from the affine expansion of h_k in h_{k-1}."""
    T = len(states)
    state = _shape(states[-1])
    chain = forward_reach([h0, *states]).__contains__
    b = _Batcher(em, T, {}, lambda v: False, lambda v: not chain(v))
    a_k, b_k = [], []
    for k, s in enumerate(states):
        prev = h0 if k == 0 else states[k - 1]
        form = classify_update(s, prev, chain)
        if form.kind != "linear":
            raise _Unproven(f"step {k + 1} is not linear in the state ({form.reason or form.kind})")
        a = _expr(b, form.coef, b.value)
        bb = _expr(b, form.offset, b.value) if form.offset is not None else _V(0.0, False)
        like = s
        for v, out in ((a, a_k), (bb, b_k)):
            if isinstance(v.node, fx.Node):
                out.append(v.node if _shape(v.node) == state else em("expand", (v.node, *state), method=True))
            else:
                out.append(em(torch.full_like, (like, v.node)))
    return em(torch.stack, (a_k, 0)), em(torch.stack, (b_k, 0))


def _reroll_unrolled(gm: fx.GraphModule, r: Recurrence, prov: dict[str, Any]) -> tuple[fx.Node, str]:
    states, h0, by_name, pos = _loop(gm, r)
    T, state = len(states), _shape(states[-1])
    dtype = example_value(states[-1]).dtype
    if state is None:
        raise _Unproven("the state has no static shape")
    why = []
    for how, build in (("batched", _unrolled_batched), ("stacked", None)):
        em = _Emit(gm, prov)
        try:
            if build is not None:
                A, B = build(gm, r, em, states, h0, by_name, pos)
            else:
                A, B = _unrolled_stacked(gm, r, em, states, h0)
            H = _scan(em, A, B, h0, T, state, dtype)
        except _Unproven as e:
            em.rollback()
            why.append(f"{how}: {e}")
            log.debug("reroll %s: the %s form is not provable: %s", r.name, how, e)
            continue
        _commit_states(gm, em, H, states, r)
        if why:
            r.details["reroll_batched_failed"] = why[0]
        return H, how
    raise _Unproven("; ".join(why))


def _commit_states(gm: fx.GraphModule, em: _Emit, H: fx.Node, states: list[fx.Node], r: Recurrence) -> None:
    """Every use of state k reads H[k]; a stack of exactly the states along d is H.movedim(0, d)."""
    for u in list(states[-1].users):
        if u.op == "call_function" and u.target is torch.stack and u.args and list(u.args[0]) == states:
            d = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
            if isinstance(d, int):
                nd = len(_shape(states[-1])) + 1
                mv = em(torch.movedim, (H, 0, d % nd))
                u.replace_all_uses_with(mv)
                gm.graph.erase_node(u)
    for k, s in enumerate(states):
        if s.users:
            s.replace_all_uses_with(em(operator.getitem, (H, k)))


# ----------------------------------------------------------------------------------------------------------------
# scan and associative_scan ops


def _sub(gm: fx.GraphModule, ref: Any) -> fx.GraphModule:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        sub: Any = gm
        for part in str(ref.target).split("."):
            sub = getattr(sub, part, None)
        if isinstance(sub, fx.GraphModule):
            return sub
    raise _Unproven("the step function is not a readable sub-graph")


def _items(node: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            out.setdefault(u.args[1], []).append(u)
        else:
            raise _Unproven(f"{node.name} is used by {u.name} other than through its outputs")
    return out


def _reroll_scan(gm: fx.GraphModule, node: fx.Node, recs: list[Recurrence], prov: dict[str, Any]) -> list[fx.Node]:
    """Rewrite one ``scan`` op whose every carry is a linear recurrence; returns one linear_scan node per carry."""
    sub = _sub(gm, node.args[0])
    init, xs = list(node.args[1]), list(node.args[2])
    add = list(node.args[3]) if len(node.args) > 3 else []
    if node.kwargs:
        raise _Unproven(f"the scan op has keyword arguments {sorted(node.kwargs)}")
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    n_c, n_x = len(init), len(xs)
    if len(phs) != n_c + n_x + len(add) or len(results) < n_c:
        raise _Unproven("the step sub-graph's signature does not match the scan's operands")
    by_carry = {r.carry_index: r for r in recs}
    if sorted(k for k in by_carry if isinstance(k, int)) != list(range(n_c)):
        missing = [i for i in range(n_c) if i not in by_carry]
        raise _Unproven(f"carry {missing[0]} of the scan is not a linear recurrence; the op must stay")
    if not xs or _shape(xs[0]) is None:
        raise _Unproven("the scan has no sequence input with a static length")
    T = _shape(xs[0])[0]
    items = _items(node)
    carries, news, ys = phs[:n_c], results[:n_c], results[n_c:]
    em = _Emit(gm, prov)
    try:
        depends = forward_reach(list(carries)).__contains__
        leaves = {p: _V(x, True) for p, x in zip(phs[n_c:n_c + n_x], xs)}
        leaves.update({p: _V(a, False) for p, a in zip(phs[n_c + n_x:], add)})
        in_sub = {n for n in sub.graph.nodes if n.op in ("call_function", "call_method")}
        b = _Batcher(em, T, leaves, in_sub.__contains__, lambda v: False)
        Hs: list[fx.Node] = []
        for i in range(n_c):
            new = news[i]
            if not isinstance(new, fx.Node):
                raise _Unproven(f"new carry {i} is not a graph value")
            form = classify_update(new, carries[i], depends)
            if form.kind != "linear":
                raise _Unproven(f"carry {i}: {form.reason or form.kind}")
            state = _shape(init[i])
            if state is None:
                raise _Unproven(f"carry {i} has no static shape")
            A = _expr(b, form.coef, b.value)
            Bv = _expr(b, form.offset, b.value) if form.offset is not None else None
            A_full = _full(b, A, state, None, 1.0) if isinstance(A.node, fx.Node) else None
            B_full = _full(b, Bv, state, A_full, 0.0) if Bv is not None or A_full is not None else None
            A_full = A_full if A_full is not None else _full(b, A, state, B_full, 1.0)
            Hs.append(_scan(em, A_full, B_full, init[i], T, state, example_value(init[i]).dtype))
        # the step's outputs, now with the states known for all steps: new state i -> H_i, carry i -> [h0, H_i[:-1]]
        b.memo.update({news[i]: _V(Hs[i], True) for i in range(n_c)})
        for i in range(n_c):
            if carries[i] not in b.memo and any(k - n_c >= 0 for k in items):
                prev = em(torch.cat, ([em(torch.unsqueeze, (_h0(em, init[i], _shape(init[i])), 0)),
                                       em(torch.narrow, (Hs[i], 0, 0, T - 1))], 0)) if T > 1 else \
                    em(torch.unsqueeze, (_h0(em, init[i], _shape(init[i])), 0))
                b.memo[carries[i]] = _V(prev, True)
        repl: dict[fx.Node, fx.Node] = {}
        for k, users in items.items():
            if k < n_c:
                last = em(operator.getitem, (Hs[k], -1))
                repl.update({u: last for u in users})
                continue
            y = ys[k - n_c] if k - n_c < len(ys) else None
            if not isinstance(y, fx.Node):
                raise _Unproven(f"output {k} of the scan is not a graph value")
            v = b.value(y)
            if not v.batched:
                v = _V(em("expand", (em(torch.unsqueeze, (v.node, 0)), T, *_shape(v.node)), method=True), True)
            repl.update({u: v.node for u in users})
    except _Unproven:
        em.rollback()
        raise
    for u, n in repl.items():
        u.replace_all_uses_with(n)
    return Hs


def _reroll_assoc(gm: fx.GraphModule, node: fx.Node, recs: list[Recurrence],
                  prov: dict[str, Any]) -> dict[int, fx.Node]:
    """Rewrite one ``associative_scan`` op with the linear combine: each used leaf becomes a linear_scan (returned
    by leaf index)."""
    xs = list(node.args[1])
    if len(node.args) > 2 and list(node.args[2]):
        raise _Unproven("the associative_scan has additional inputs")
    items = _items(node)
    leaf_of = {r.leaf: r for r in recs}
    # running-product leaves: a state leaf names its decay leaf in its a (a node among xs)
    decay = {xs.index(r.a) for r in recs if isinstance(r.a, fx.Node) and r.a in xs and r.b is not None}
    em = _Emit(gm, prov)
    made: dict[int, fx.Node] = {}
    repl: dict[fx.Node, fx.Node] = {}
    try:
        for k, users in sorted(items.items()):
            out = users[0]
            state_full = _shape(out)
            if state_full is None or not state_full:
                raise _Unproven(f"output {k} has no static shape")
            T, state = state_full[0], state_full[1:]
            b = _Batcher(em, T, {}, lambda v: False, lambda v: True)
            r = leaf_of.get(k)
            if r is not None and r.b is not None:
                B = _full(b, _V(r.b, True), state, None, 0.0)
                A = _full(b, _V(r.a, True), state, None, 1.0) if r.a is not None else em(torch.ones_like, (B,))
                h0 = None
            elif (r is not None and r.b is None and r.a is not None) or k in decay:
                A = _full(b, _V(xs[k], True), state, None, 1.0)
                B = em(torch.zeros_like, (A,))
                h0 = em(torch.ones_like, (em(operator.getitem, (A, 0)),))
            else:
                raise _Unproven(f"output {k} of the associative_scan is neither a recurrence nor a running product")
            H = _scan(em, A, B, h0, T, state, example_value(out).dtype)
            made[k] = H
            repl.update({u: H for u in users})
    except _Unproven:
        em.rollback()
        raise
    for u, n in repl.items():
        u.replace_all_uses_with(n)
    return made


# ----------------------------------------------------------------------------------------------------------------
# the pass


def reroll(gm: fx.GraphModule, regions: list[Region]) -> list[str]:
    """Rewrite each linear recurrence captured as ``scan``, ``associative_scan`` or an unrolled loop into one
    ``linear_scan`` node in ``gm`` (in place); return the names of the linear_scan nodes made.

    Args:
        gm: a dynamo graph (torch-level, ``meta["example_value"]`` on every node), as recognition saw it.
        regions: recognition's records; those for which :func:`needs_reroll` is true are rewritten. On success a
            record gets ``details["rerolled_into"]`` (the linear_scan node's name) and ``details["reroll"]`` (how a
            and b were computed: "batched", "stacked", "scan", "associative_scan"), for reports; on failure
            its ``not_rerolled`` says why (see :func:`_refuse`) and the graph keeps its nodes.
    """
    todo = [r for r in regions if needs_reroll(r)]
    if not todo:
        return []
    if _scan_op() is None:
        for r in todo:
            _refuse(r, "the linear_scan op (torch.ops.adjoint_compile.linear_scan) is not registered")
        log.info("reroll: the linear_scan op is not registered; %d recurrence(s) keep their form", len(todo))
        return []
    made: list[str] = []
    ops: dict[fx.Node, list[Recurrence]] = {}
    loops: list[Recurrence] = []
    for r in todo:
        if r.source == "unrolled_loop":
            loops.append(r)
            continue
        op = next((n for n in r.nodes if n.op == "call_function" and n.target is not operator.getitem), None)
        if op is None:
            _refuse(r, "the record names no scan op")
            continue
        ops.setdefault(op, []).append(r)
    changed = False
    for op, recs in ops.items():
        prov = {"pass": "reroll", "source": recs[0].source, "region": recs[0].name}
        try:
            if op.graph is not gm.graph:
                raise _Unproven("the scan op is no longer in the graph")
            if recs[0].source == "scan":
                Hs = _reroll_scan(gm, op, recs, prov)
                pairs = [(r, Hs[r.carry_index]) for r in recs]
                new = Hs
            else:
                by_leaf = _reroll_assoc(gm, op, recs, prov)
                pairs = [(r, by_leaf.get(r.leaf)) for r in recs]
                new = list(by_leaf.values())
        except _Unproven as e:
            for r in recs:
                _refuse(r, str(e))
            log.info("reroll: %s %s keeps its form: %s", recs[0].source, op.name, e)
            continue
        changed = True
        made += [H.name for H in new]
        _done(pairs, recs[0].source)
    for r in loops:
        prov = {"pass": "reroll", "source": r.source, "region": r.name}
        if changed:
            _toposort(gm.graph)
        try:
            H, how = _reroll_unrolled(gm, r, prov)
        except _Unproven as e:
            _refuse(r, str(e))
            log.info("reroll: unrolled loop %s keeps its form: %s", r.name, e)
            continue
        changed = True
        made.append(H.name)
        _done([(r, H)], how)
    if changed:
        _toposort(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return made


def _refuse(r: Recurrence, why: str) -> None:
    """Record why ``r`` keeps its form, on the record and on its anchor nodes (recognition reads it back there)."""
    r.not_rerolled = f"not re-rolled: {why}"
    for n in [*r.outputs[-1:], *r.nodes[-1:]]:
        if n.op != "placeholder":
            n.meta[PROVENANCE] = {"pass": "reroll", **n.meta.get(PROVENANCE, {}), "not_rerolled": r.not_rerolled}


def _done(pairs: list[tuple[Recurrence, fx.Node | None]], how: str) -> None:
    for r, H in pairs:
        if H is None:
            continue  # its output was unused: the recurrence is gone with the op
        r.details["rerolled_into"] = H.name
        r.details["reroll"] = how
        log.info("reroll: %s %s -> linear_scan %s (%s, T=%s)", r.source, r.name, H.name, how, r.length)
