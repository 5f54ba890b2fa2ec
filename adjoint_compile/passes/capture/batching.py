"""Batched re-emission for the reroll pass (:mod:`.reroll`): a step's computation emitted once for all T steps,
step axis first, with exact rules per op (:class:`Batcher`), and the ``[T, *state]`` coefficients and the
``linear_scan`` node built from it.

Values are :class:`Value` (a node or Python scalar, and whether it has the step axis first); nodes are made by an
:class:`Emitter`, which gives each its ``example_value`` from fake tensors and its provenance, and can take them
all back (a rewrite that cannot be proven leaves the graph as it was). Failures raise :class:`Unproven` with the
reason.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ...analysis import optable as ops
from ...analysis.affine import Atom, Const, Expr, Prod, Quot, Select, Sum, UpdateForm
from ...analysis.fx import example_value, hinted_shape
from ...regions import PROVENANCE
from .batching_losses import NotBatched, batch_loss

log = logging.getLogger(__name__)

__all__ = ["Unproven", "Value", "Emitter", "Batcher", "emit_expr", "full_steps", "coefficients", "initial_state",
           "emit_scan", "scan_op", "batch_op"]


class Unproven(Exception):
    """The rewrite of one recurrence could not be proven; the message is the reason."""


def batch_op(n: fx.Node) -> str | None:
    """Short name of a node's op when it is one the batching knows (``operator.add`` and ``x.add`` -> "add"); a
    method's name whatever it is."""
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function" and n.target is getattr and len(n.args) == 2 and isinstance(n.args[1], str):
        return "getattr"  # an attribute read: copied once when step-free (``C.T``); ``x.real`` / ``x.imag`` batched
    if n.op == "call_function":
        name = ops.spelling(n.target)
        return name if name in ops.BATCHABLE else None
    return None


def scan_op() -> Any:
    ns = getattr(torch.ops, "adjoint_compile", None)
    try:
        return ns.linear_scan.default if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# emitting nodes with their example values


@dataclasses.dataclass
class Value:
    """A value in the outer graph: ``node`` (or a Python scalar) and whether it has the step axis first."""

    node: Any
    batched: bool

    def rank(self) -> int:
        ev = example_value(self.node)
        if not isinstance(ev, torch.Tensor):
            return 0
        return ev.dim() - (1 if self.batched else 0)


class Emitter:
    """Creates nodes before ``at`` (the graph's output by default), with ``example_value`` from fake tensors and
    provenance.

    Nothing it creates is used by the old graph until the caller commits, so :meth:`rollback` can erase it all.
    """

    def __init__(self, gm: fx.GraphModule, prov: dict[str, Any], at: fx.Node | None = None) -> None:
        self.gm = gm
        self.prov = prov
        self.made: list[fx.Node] = []
        # NB: where the computation it replaces was (a scan op, a loop's last state), not at the graph's end: there
        # it runs under the same autocast and grad modes (dynamo's graph enters and leaves them by nodes)
        self.out = at if at is not None else next(n for n in gm.graph.nodes if n.op == "output")
        self.mode = _fake_mode(gm)

    def __call__(self, target: Any, args: tuple = (), kwargs: dict | None = None, method: bool = False,
                 value: Any = None) -> fx.Node:
        """A new node ``target(*args, **kwargs)``; ``value``: its example value when the caller has it already (else
        computed on fake tensors)."""
        kwargs = kwargs or {}
        ev = value if value is not None else self.value(target, args, kwargs, method)
        with self.gm.graph.inserting_before(self.out):
            n = self.gm.graph.create_node("call_method" if method else "call_function", target, args, kwargs)
        n.meta["example_value"] = ev
        n.meta[PROVENANCE] = dict(self.prov)
        self.made.append(n)
        return n

    def value(self, target: Any, args: tuple = (), kwargs: dict | None = None, method: bool = False) -> Any:
        """The example value of ``target(*args, **kwargs)``, on fake tensors; :class:`Unproven` where torch refuses."""
        fa = fx.node.map_arg(args, example_value)
        fk = fx.node.map_arg(kwargs or {}, example_value)
        try:
            with self.mode:
                return getattr(fa[0], target)(*fa[1:], **fk) if method else target(*fa, **fk)
        except Exception as e:  # noqa: BLE001 - a rule produced an op torch refuses: not provable
            raise Unproven(f"{getattr(target, '__name__', target)} on the batched values fails: "
                           f"{type(e).__name__}: {e}") from e

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, Unproven):
            self.rollback()

    def rollback(self) -> None:
        for n in reversed(self.made):
            self.gm.graph.erase_node(n)
        self.made.clear()


def _fake_mode(gm: fx.GraphModule) -> Any:
    # NB: the mode of the graph's own example values: inside a backend call, the tracing context's mode can be
    # another one, and fake tensors of two modes do not mix
    for n in gm.graph.nodes:
        v = example_value(n)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


# ----------------------------------------------------------------------------------------------------------------
# the batched re-emission of one step's computation


class Batcher:
    """Re-emit a step's computation once for all T steps, step axis first.

    ``leaves`` map step values to outer values (per-step slices -> whole sequences, sub-graph inputs -> outer
    nodes); ``inside(v)`` says whether ``v`` belongs to the step (and is re-emitted); ``outer_ok(v)`` whether a
    value outside the step may be read as it is (a weight shared by all steps).
    """

    def __init__(self, em: Emitter, T: int, leaves: dict[fx.Node, Value], inside: Callable[[fx.Node], bool],
                 outer_ok: Callable[[fx.Node], bool], lazy: dict[fx.Node, Callable[[], Value]] | None = None) -> None:
        self.em, self.T, self.inside, self.outer_ok = em, T, inside, outer_ok
        self.memo: dict[fx.Node, Value] = dict(leaves)
        #: leaves whose outer value is made on first use (a per-step slice that a and b may not read)
        self.lazy = dict(lazy or {})
        self.seqs: dict[tuple, Value] = {}

    def value(self, v: Any) -> Value:
        if not isinstance(v, fx.Node):
            return Value(v, False)
        if v in self.memo:
            return self.memo[v]
        if v in self.lazy:
            self.memo[v] = self.lazy.pop(v)()
            return self.memo[v]
        if not self.inside(v):
            if self.outer_ok(v):
                self.memo[v] = Value(v, False)
                return self.memo[v]
            raise Unproven(f"the step reads {v.name}, which is neither a per-step slice nor shared by all steps")
        if v.op not in ("call_function", "call_method"):
            raise Unproven(f"step value {v.name} is a {v.op}")
        name = batch_op(v)
        if name is None:
            raise Unproven(f"step op {v.name} ({v.target}) has no batching rule")
        for a in v.all_input_nodes:
            self.value(a)
        args = fx.node.map_arg(v.args, self.memo.__getitem__) if v.all_input_nodes else v.args
        kwargs = fx.node.map_arg(v.kwargs, self.memo.__getitem__) if v.all_input_nodes else v.kwargs
        res = self._emit(v, name, args, kwargs)
        want = hinted_shape(v)
        got = hinted_shape(res.node)
        if want is not None and got is not None and got != ((self.T,) + want if res.batched else want):
            raise Unproven(f"batched {v.name} has shape {list(got)}, expected {[self.T, *want]}")
        self.memo[v] = res
        return res

    def _emit(self, v: fx.Node, name: str, args: Any, kwargs: Any) -> Value:
        vals = [x for x in _flat(args) + _flat(kwargs) if isinstance(x, Value)]
        method = v.op == "call_method"
        if not any(x.batched for x in vals):
            # NB: a value that is the same at every step (computed from shared weights only) is copied once
            return Value(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), False)
        if name in ops.BATCH_LOSSES:
            try:
                return Value(batch_loss(self, v, name, args, kwargs), True)
            except NotBatched as e:
                raise Unproven(str(e)) from e
        if name in ops.BATCH_EINSUM:
            return self._einsum(v, args, kwargs)
        first = args[0] if args else None
        rest_unbatched = all(not x.batched for x in vals if x is not first)
        if name == "getattr":
            attr = args[1]
            if attr not in ops.COMPLEX_PARTS:
                raise Unproven(f"attribute {attr!r} of a per-step value ({v.name}) has no batching rule")
            # x.real, x.imag: elementwise, so the same read of the batched value (as torch.real / torch.imag)
            return Value(self.em(getattr(torch, attr), (first.node,)), True)
        if name in ops.BATCH_POINTWISE:
            if any(k in ("dim", "dims", "axis") for k in kwargs):
                raise Unproven(f"pointwise op {v.name} has a dim argument")
            R = max(x.rank() for x in vals)
            args = _map_vals(args, lambda x: self.pad(x, R))
            kwargs = _map_vals(kwargs, lambda x: self.pad(x, R))
            return Value(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), True)
        if not isinstance(first, Value) or not first.batched:
            raise Unproven(f"op {v.name} ({name}) reads a per-step value in an argument other than its first")
        if name in ops.BATCH_MATMULS and len(args) == 2 and not kwargs:
            x, w = args
            if isinstance(w, Value) and w.batched:
                R = max(x.rank(), w.rank())
                if min(x.rank(), w.rank()) < 2:
                    raise Unproven(f"matmul {v.name} of two per-step values of rank < 2")
                x, w = self.pad(x, R), self.pad(w, R)
            return Value(self.em(v.target, _unwrap((x, w)), {}, method), True)
        if not rest_unbatched:
            raise Unproven(f"op {v.name} ({name}) reads per-step values in several arguments")
        if name in ops.BATCH_INDEX:
            # NB: basic indexing of the per-step value (``gk_t[..., None]``, ``y[:, :, 0]``): the same index after a
            # full slice over the step axis
            items = args[1] if len(args) == 2 and isinstance(args[1], tuple) else args[1:]
            if kwargs or len(args) != 2 or not all(_basic(it) for it in items):
                raise Unproven(f"index {v.name} is not basic indexing (ints, slices, None, ...)")
            return Value(self.em(operator.getitem, (first.node, (slice(None), *items))), True)
        if name in ops.BATCH_FEATURE_OPS:
            # NB: linear/layer_norm/rms_norm act on the trailing feature dims only: a leading step axis is a batch dim
            return Value(self.em(v.target, _unwrap(args), _unwrap(kwargs), method), True)
        if name in ops.BATCH_VIEWS:
            sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            if kwargs or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
                raise Unproven(f"{name} {v.name} has a shape that is not a tuple of ints")
            return Value(self.em(v.target, (first.node, (self.T, *sizes)), {}, method), True)
        if name in ops.BATCH_DIM_ARGS:
            args, kwargs = list(args), dict(kwargs)
            for pos, kw in ops.BATCH_DIM_ARGS[name]:
                if pos < len(args):
                    args[pos] = _shift(args[pos], v.name)
                elif kw in kwargs:
                    kwargs[kw] = _shift(kwargs[kw], v.name)
                elif name in ("sum", "mean", "amax", "amin") and len(args) == 1 and first.rank():
                    # NB: a reduction of the whole step (``h.sum()``): over every dim but the step axis
                    args.append(tuple(range(1, first.rank() + 1)))
                else:
                    raise Unproven(f"{name} {v.name} has no dim argument (all dims, the step's included)")
            return Value(self.em(v.target, _unwrap(tuple(args)), _unwrap(kwargs), method), True)
        raise Unproven(f"op {v.name} ({name}) has no batching rule")

    def _einsum(self, v: fx.Node, args: Any, kwargs: Any) -> Value:
        """``einsum("bhk,bhkv->bhv", q_t, S_t)`` as ``einsum("zbhk,zbhkv->zbhv", q, S)``: a subscript of its own for
        the step axis on each per-step operand and on the output."""
        eq, operands = (args[0], list(args[1])) if len(args) == 2 and isinstance(args[1], (list, tuple)) else \
            (args[0] if args else None, list(args[1:]))
        if kwargs or not isinstance(eq, str):
            raise Unproven(f"einsum {v.name} is not einsum(eq, *operands)")
        eq = eq.replace(" ", "")
        if "->" not in eq:  # NB: implicit output: "..." first, then the labels seen once, in order (A-Z, then a-z)
            letters = [c for c in eq if c.isalpha()]
            once = sorted(c for c in set(letters) if letters.count(c) == 1)
            eq += "->" + ("..." if "..." in eq else "") + "".join(once)
        ins, out = eq.split("->")
        subs = ins.split(",")
        free = next((c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in eq), None)
        if len(subs) != len(operands) or free is None:
            raise Unproven(f"einsum {v.name}: {len(subs)} subscripts for {len(operands)} operands")
        batched = [isinstance(x, Value) and x.batched for x in operands]
        new_eq = ",".join(free + s if b else s for s, b in zip(subs, batched)) + "->" + free + out
        return Value(self.em(v.target, (new_eq, *_unwrap(tuple(operands))), {}), True)

    def pad(self, x: Any, R: int) -> Any:
        """A batched value with unit dims after the step axis, so that its per-step rank is R (broadcasting)."""
        if not isinstance(x, Value) or not x.batched:
            return x
        node = x.node
        for _ in range(R - x.rank()):
            node = self.em(torch.unsqueeze, (node, 1))
        return Value(node, True)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _basic(it: Any) -> bool:
    """An item of a basic index: an int, None, ``...`` or a slice of ints."""
    if it is None or it is Ellipsis or _int(it):
        return True
    return isinstance(it, slice) and all(v is None or _int(v) for v in (it.start, it.stop, it.step))


def _shift(d: Any, where: str) -> Any:
    """A dim of a per-step tensor as a dim of the batched one (negative dims count from the end: unchanged)."""
    if isinstance(d, bool) or d is None:
        raise Unproven(f"op {where} has dim={d!r}")
    if isinstance(d, int):
        return d + 1 if d >= 0 else d
    if isinstance(d, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in d):
        return type(d)(x + 1 if x >= 0 else x for x in d)
    raise Unproven(f"op {where} has dim={d!r}")


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


def _map_vals(x: Any, fn: Callable[[Value], Any]) -> Any:
    if isinstance(x, Value):
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


def emit_expr(b: Batcher, e: Expr, atom: Callable[[fx.Node], Value]) -> Value:
    """Emit an affine coefficient expression with its atoms' values (broadcasting like the step did)."""
    em = b.em

    def pw(fn: Any, x: Value, y: Value) -> Value:
        R = max(x.rank(), y.rank())
        x, y = b.pad(x, R), b.pad(y, R)
        if not isinstance(x.node, fx.Node) and not isinstance(y.node, fx.Node):
            return Value(fn(x.node, y.node), False)
        return Value(em(fn, (x.node, y.node)), x.batched or y.batched)

    if isinstance(e, Const):
        return Value(e.value if isinstance(e.value, complex) else float(e.value), False)
    if isinstance(e, Atom):
        return atom(e.n)
    if isinstance(e, Sum):
        total: Value | None = None
        for c, t in e.terms:
            v = emit_expr(b, t, atom)
            if c != 1:
                v = pw(operator.mul, Value(float(c), False), v)
            total = v if total is None else pw(operator.add, total, v)
        assert total is not None
        return total
    if isinstance(e, Prod):
        out = emit_expr(b, e.factors[0], atom)
        for f in e.factors[1:]:
            out = pw(operator.mul, out, emit_expr(b, f, atom))
        return out
    if isinstance(e, Quot):
        return pw(operator.truediv, emit_expr(b, e.num, atom), emit_expr(b, e.den, atom))
    if isinstance(e, Select):
        c = emit_expr(b, e.cond, atom)
        x, y = (Value(0.0, False) if v is None else emit_expr(b, v, atom) for v in (e.x, e.y))
        if not isinstance(x.node, fx.Node) and not isinstance(y.node, fx.Node):
            # NB: the branch that is not zero made a tensor, so that a reset reads where(m, 0, ...) (analysis/resets)
            if x.node == 0:
                y = Value(em(torch.full_like, (c.node, y.node), {"dtype": e.dtype}), c.batched)
            else:
                x = Value(em(torch.full_like, (c.node, x.node), {"dtype": e.dtype}), c.batched)
        R = max(c.rank(), x.rank(), y.rank())
        c, x, y = b.pad(c, R), b.pad(x, R), b.pad(y, R)
        return Value(em(torch.where, (c.node, x.node, y.node)), c.batched or x.batched or y.batched)
    raise Unproven(f"unknown coefficient expression {e}")


def full_steps(b: Batcher, v: Value | None, state: tuple[int, ...], like: fx.Node | None, fill: float) -> fx.Node:
    """``v`` as a [T, *state] tensor: broadcast over the state, repeated over the steps when it does not vary."""
    em, T = b.em, b.T
    if v is None or not isinstance(v.node, fx.Node):
        value = fill if v is None else v.node
        if like is None:
            raise Unproven("both a and b are constants")
        return em(torch.full_like, (like, value))
    node = v.node
    if not v.batched:
        node = em(torch.unsqueeze, (node, 0))
    elif (r := v.rank()) < len(state):
        # NB: a step's value of lower rank than the state broadcasts against its trailing dims (a decay per
        # position ``a[t]`` of shape [1]): [T, *shape] becomes [T, 1, ..., *shape], not aligned from the left
        shape = hinted_shape(node)
        node = em("reshape", (node, (shape[0], *([1] * (len(state) - r)), *shape[1:])), method=True)
    if hinted_shape(node) != (T, *state):
        node = em("expand", (node, T, *state), method=True)
    return node


def _check_scan_inputs(A: fx.Node, B: fx.Node, h0: Any, T: int, state: tuple[int, ...], dtype: Any) -> None:
    for what, x in (("a", A), ("b", B)):
        ev = example_value(x)
        if tuple(ev.shape) != (T, *state):
            raise Unproven(f"{what} for all steps has shape {list(ev.shape)}, expected {[T, *state]}")
        if ev.dtype != dtype:
            # NB: under autocast a first state made from the input (zeros_like(x[:, 0])) stays fp32 while a and b
            # come out half: the state's dtype then changes at the first step
            raise Unproven(f"{what} has dtype {ev.dtype}, the state {dtype}: make the first state in the dtype of the "
                           f"steps' {what} (e.g. from b, torch.zeros_like(b[:, 0])), or cast {what} to the state's")


def initial_state(em: Emitter, h0: Any, state: tuple[int, ...]) -> Any:
    if h0 is None:
        return None
    if not isinstance(h0, fx.Node) or not isinstance(example_value(h0), torch.Tensor):
        raise Unproven(f"the initial state {h0!r} is not a tensor in the graph")
    if hinted_shape(h0) != state:
        h0 = em("expand", (h0, *state), method=True)
    return h0


def emit_scan(em: Emitter, A: fx.Node, B: fx.Node, h0: Any, T: int, state: tuple[int, ...], dtype: Any) -> fx.Node:
    op = scan_op()
    if op is None:
        raise Unproven("the linear_scan op (torch.ops.adjoint_compile.linear_scan) is not registered")
    _check_scan_inputs(A, B, h0, T, state, dtype)
    # NB: every argument positionally: (a, b, h0, dim, reverse, window, impl), as lower_adjoint reads them
    H = em(op, (A, B, initial_state(em, h0, state), 0, False, None, None))
    if tuple(example_value(H).shape) != (T, *state):
        raise Unproven(f"linear_scan gives shape {list(example_value(H).shape)}, expected {[T, *state]}")
    return H


def coefficients(b: Batcher, form: UpdateForm, state: tuple[int, ...]) -> tuple[fx.Node, fx.Node]:
    """A and B, ``[T, *state]``, of a linear update ``form`` (``new = coef ⊙ carry + offset``) with its atoms'
    values batched by ``b``; a constant is filled in from the other one's shape."""
    A = emit_expr(b, form.coef, b.value)
    Bv = emit_expr(b, form.offset, b.value) if form.offset is not None else None
    A_full = full_steps(b, A, state, None, 1.0) if isinstance(A.node, fx.Node) else None
    B_full = full_steps(b, Bv, state, A_full, 0.0) if Bv is not None or A_full is not None else None
    if A_full is None:
        A_full = full_steps(b, A, state, B_full, 1.0)
    return A_full, B_full
