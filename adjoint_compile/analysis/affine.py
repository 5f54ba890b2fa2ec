"""Affine algebra over FX nodes: is a value ``C ⊙ h + O`` in a carried value ``h``, and what are C and O?

Every recurrence and residual matcher asks the same question of one node ``n`` and one candidate carry ``h``:
does ``n`` equal ``C ⊙ h + O`` (elementwise, with broadcasting), and do ``C`` and ``O`` depend on ``h``?

* linear recurrence: ``C`` (= a) and ``O`` (= b) are independent of h;
* gated recurrence / gated residual layer: ``C`` (= z1) or ``O`` (= z2) depend on h;
* anything else (``tanh(W h + x)``, ``h * h``) is not affine in h and gets a reason.

:func:`affine` expands ``n`` through the ops that keep a value affine (add, sub, rsub, neg, mul and div by an
h-free value, addcmul, lerp, clone, and a select by an h-free mask: ``where``, ``masked_fill``); any other op whose output depends on h is an opaque atom. The coefficients are
small expression trees (:class:`Expr`) over the graph's nodes, so a matcher can report the node that *is* ``a``
when there is one (``a * h + b``) and an expression when there is not (``h * a - b`` has ``b = -(b)``), and a test
can evaluate them (:meth:`Expr.evaluate`) against the real values.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .fx import bfs_inputs, example_value, hinted_shape
from .fx import reachable as forward_reach
from .optable import LINEAR_IN_CARRY as _AFFINE_OPS
from .optable import FILL_LIKE, MATMULS, op_name, raw_name

log = logging.getLogger(__name__)

__all__ = [
    "linear_combine",
    "Expr", "Const", "Atom", "Sum", "Prod", "Quot", "Select", "Affine", "NotAffine", "affine", "UpdateForm", "classify_update",
]


# ----------------------------------------------------------------------------------------------------------------
# expressions


class Expr:
    """A small expression over FX nodes: constants, atoms (nodes), sums, products and quotients."""

    def nodes(self) -> list[fx.Node]:
        out: list[fx.Node] = []
        self._collect(out)
        seen: set[fx.Node] = set()
        return [n for n in out if not (n in seen or seen.add(n))]

    def _collect(self, out: list[fx.Node]) -> None:
        raise NotImplementedError

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        """The value of the expression, with ``env(node)`` giving each atom's value."""
        raise NotImplementedError

    @property
    def node(self) -> fx.Node | None:
        """The node, when the expression is one node; else None."""
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class Const(Expr):
    value: float

    def _collect(self, out: list[fx.Node]) -> None:
        pass

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        return self.value

    def __str__(self) -> str:
        return repr(self.value)


@dataclasses.dataclass(frozen=True, eq=False)
class Atom(Expr):
    n: fx.Node

    def _collect(self, out: list[fx.Node]) -> None:
        out.append(self.n)

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        return env(self.n)

    @property
    def node(self) -> fx.Node | None:
        return self.n

    def __str__(self) -> str:
        return self.n.name


@dataclasses.dataclass(frozen=True, eq=False)
class Sum(Expr):
    #: (coefficient, term) pairs: Σ c_k · e_k
    terms: tuple[tuple[float, Expr], ...]

    def _collect(self, out: list[fx.Node]) -> None:
        for _, e in self.terms:
            e._collect(out)

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        total: Any = 0
        for c, e in self.terms:
            total = total + (e.evaluate(env) if c == 1 else c * e.evaluate(env))
        return total

    def __str__(self) -> str:
        out = ""
        for i, (c, e) in enumerate(self.terms):
            s = f"({e})" if isinstance(e, Sum) else str(e)
            piece = s if abs(c) == 1 else f"{abs(c)!r}*{s}"
            sign = "-" if c < 0 else "+"
            out = (("-" if sign == "-" else "") + piece) if i == 0 else f"{out} {sign} {piece}"
        return out or "0"


@dataclasses.dataclass(frozen=True, eq=False)
class Prod(Expr):
    factors: tuple[Expr, ...]

    def _collect(self, out: list[fx.Node]) -> None:
        for e in self.factors:
            e._collect(out)

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        v: Any = 1
        for e in self.factors:
            v = v * e.evaluate(env)
        return v

    def __str__(self) -> str:
        return "*".join(f"({e})" if isinstance(e, Sum) else str(e) for e in self.factors)


@dataclasses.dataclass(frozen=True, eq=False)
class Quot(Expr):
    num: Expr
    den: Expr

    def _collect(self, out: list[fx.Node]) -> None:
        self.num._collect(out)
        self.den._collect(out)

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        return self.num.evaluate(env) / self.den.evaluate(env)

    def __str__(self) -> str:
        return f"({self.num})/({self.den})"


@dataclasses.dataclass(frozen=True, eq=False)
class Select(Expr):
    """``where(cond, x, y)``, None standing for zero: a state reset (``where(done, 0, h)``) selects the coefficient."""

    cond: Expr
    x: Expr | None
    y: Expr | None
    #: the select's dtype: NB two constant branches are made in it, not in the default dtype (0.9 in fp32 is not
    #: 0.9 in fp64)
    dtype: Any

    def _collect(self, out: list[fx.Node]) -> None:
        for e in (self.cond, self.x, self.y):
            if e is not None:
                e._collect(out)

    def evaluate(self, env: Callable[[fx.Node], Any]) -> Any:
        c = self.cond.evaluate(env)
        x, y = (0.0 if e is None else e.evaluate(env) for e in (self.x, self.y))
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            x = torch.full_like(c, x, dtype=self.dtype)
        return torch.where(c, x, y)

    def __str__(self) -> str:
        return f"where({self.cond}, {self.x or 0}, {self.y or 0})"


def e_select(cond: Expr, x: Expr | None, y: Expr | None, dtype: Any) -> Expr | None:
    if x is None and y is None:
        return None
    if x is y or (isinstance(x, Const) and isinstance(y, Const) and x.value == y.value):
        return x
    return Select(cond, x, y, dtype)


def _is_const(e: Expr | None, v: float | None = None) -> bool:
    return isinstance(e, Const) and (v is None or e.value == v)


def e_add(x: Expr | None, y: Expr | None, cy: float = 1.0) -> Expr | None:
    """x + cy·y, with None as zero."""
    if y is None or cy == 0:
        return x
    if x is None:
        return y if cy == 1 else (Const(cy * y.value) if isinstance(y, Const) else Sum(((cy, y),)))
    if isinstance(x, Const) and isinstance(y, Const):
        v = x.value + cy * y.value
        return None if v == 0 else Const(v)
    tx = x.terms if isinstance(x, Sum) else ((1.0, x),)
    ty = tuple((cy * c, e) for c, e in y.terms) if isinstance(y, Sum) else ((cy, y),)
    return Sum(tx + ty)


def e_mul(x: Expr | None, y: Expr | None) -> Expr | None:
    if x is None or y is None:
        return None
    if _is_const(x, 0) or _is_const(y, 0):
        return None
    if _is_const(x, 1):
        return y
    if _is_const(y, 1):
        return x
    if isinstance(x, Const) and isinstance(y, Const):
        return Const(x.value * y.value)
    if isinstance(x, Const):
        return Sum(((x.value, y),))
    if isinstance(y, Const):
        return Sum(((y.value, x),))
    fx_ = x.factors if isinstance(x, Prod) else (x,)
    fy = y.factors if isinstance(y, Prod) else (y,)
    return Prod(fx_ + fy)


def e_div(x: Expr | None, y: Expr) -> Expr | None:
    if x is None:
        return None
    if isinstance(y, Const):
        return e_mul(x, Const(1.0 / y.value))
    return Quot(x, y)


def e_scale(x: Expr | None, c: float) -> Expr | None:
    return e_add(None, x, c)


# ----------------------------------------------------------------------------------------------------------------
# affine expansion


@dataclasses.dataclass
class Affine:
    """``value = coef ⊙ h + offset``; None stands for zero."""

    coef: Expr | None
    offset: Expr | None


class NotAffine(Exception):
    """The value is not affine in the carry; ``node`` is where it stops being so."""

    def __init__(self, node: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, default)


def affine(n: Any, carry: fx.Node, depends: Callable[[fx.Node], bool],
           memo: dict[fx.Node, Affine] | None = None) -> Affine:
    """Expand ``n`` as ``coef ⊙ carry + offset``.

    ``depends(node)`` says whether ``node`` depends on ``carry`` (is a descendant of it). Nodes that do not are
    atoms of the offset; nodes that do but are not one of the affine ops (add, sub, rsub, neg, mul, div by an
    h-free value, addcmul, clone/contiguous) are opaque atoms with no coefficient. Raises :class:`NotAffine` when
    the carry meets itself in a product (``h * h``: quadratic) or is divided by.
    """
    memo = {} if memo is None else memo
    return _affine(n, carry, depends, memo)


def _affine(n: Any, carry: fx.Node, depends: Callable[[fx.Node], bool], memo: dict[fx.Node, Affine]) -> Affine:
    if n is carry:
        return Affine(Const(1.0), None)
    if not isinstance(n, fx.Node):
        if _num(n):
            return Affine(None, None if n == 0 else Const(float(n)))
        if isinstance(n, complex):  # a complex constant (``(0.6 + 0.5j) * h``): kept complex
            return Affine(None, None if n == 0 else Const(n))
        raise NotAffine(carry, f"unexpected operand {n!r}")
    if n in memo:
        return memo[n]
    if not depends(n):
        res = Affine(None, Atom(n))
        memo[n] = res
        return res
    res = _expand(n, carry, depends, memo)
    if res.coef is None and not (res.offset is None or isinstance(res.offset, Const)):
        # NB: an h-dependent value with no h-linear part is kept as one atom (e.g. the gate `1 - z`), so reports
        # can name the node instead of an expression.
        res = Affine(None, Atom(n))
    memo[n] = res
    return res


def _expand(n: fx.Node, carry: fx.Node, depends: Callable[[fx.Node], bool], memo: dict[fx.Node, Affine]) -> Affine:
    name = op_name(n)
    rec = lambda v: _affine(v, carry, depends, memo)  # noqa: E731
    if name in ("add", "sub") and len(n.args) >= 2:
        x, y = rec(n.args[0]), rec(n.args[1])
        alpha = n.kwargs.get("alpha", 1)
        if not _num(alpha):
            return Affine(None, Atom(n))
        s = alpha if name == "add" else -alpha
        return Affine(e_add(x.coef, y.coef, s), e_add(x.offset, y.offset, s))
    if name == "rsub" and len(n.args) >= 2:  # rsub(x, y, alpha) = y - alpha * x
        x, y = rec(n.args[0]), rec(n.args[1])
        alpha = n.kwargs.get("alpha", 1)
        if not _num(alpha):
            return Affine(None, Atom(n))
        return Affine(e_add(y.coef, x.coef, -alpha), e_add(y.offset, x.offset, -alpha))
    if name in ("neg", "pos") and len(n.args) == 1:
        x = rec(n.args[0])
        s = -1.0 if name == "neg" else 1.0
        return Affine(e_scale(x.coef, s), e_scale(x.offset, s))
    if name in ("clone", "contiguous") and n.args:
        x = rec(n.args[0])
        return Affine(x.coef, x.offset)
    if name == "mul" and len(n.args) == 2 and not n.kwargs:
        x, y = rec(n.args[0]), rec(n.args[1])
        return _mul(n, x, y)
    if name == "div" and len(n.args) == 2 and not n.kwargs:
        x, y = rec(n.args[0]), rec(n.args[1])
        if y.coef is not None:
            raise NotAffine(n, f"the carry is divided by at node {n.name}")
        if y.offset is None:
            return Affine(None, Atom(n))
        return Affine(e_div(x.coef, y.offset), e_div(x.offset, y.offset))
    if name == "lerp" and len(n.args) >= 3 and not n.kwargs:  # lerp(s, e, w) = s + w ⊙ (e - s) = (1 - w) ⊙ s + w ⊙ e
        st, en, w = (rec(v) for v in n.args[:3])
        if w.coef is not None:
            raise NotAffine(n, f"the carry is a lerp weight at node {n.name}")
        one_minus_w = e_add(Const(1.0), w.offset, -1.0) if w.offset is not None else Const(1.0)
        left, right = _mul(n, Affine(None, one_minus_w), st), _mul(n, w, en)
        return Affine(e_add(left.coef, right.coef), e_add(left.offset, right.offset))
    if name == "addcmul" and len(n.args) >= 3:
        inp, t1, t2 = (rec(v) for v in n.args[:3])
        value = _arg(n, 3, "value", 1)
        if not _num(value):
            return Affine(None, Atom(n))
        prod = _mul(n, t1, t2)
        return Affine(e_add(inp.coef, prod.coef, value), e_add(inp.offset, prod.offset, value))
    if name in FILL_LIKE and n.args and set(n.kwargs) <= {"memory_format"}:
        # NB: zeros_like(h) reads only h's shape: a constant (the reset ``where(keep, h, zeros_like(h))``)
        fill = 0.0 if name == "zeros_like" else 1.0 if name == "ones_like" else _arg(n, 1, "fill_value")
        if _num(fill):
            return Affine(None, None if fill == 0 else Const(float(fill)))
    if name in ("where", "masked_fill") and not n.kwargs:
        return _select(n, name, rec, depends)
    return Affine(None, Atom(n))


def _select(n: fx.Node, name: str, rec: Callable[[Any], Affine], depends: Callable[[fx.Node], bool]) -> Affine:
    """``where(m, x, y)`` = (where(m, cx, cy)) ⊙ h + where(m, ox, oy) when the mask m is free of the carry: a state
    reset (``where(done, 0, h)``, ``h.masked_fill(done, 0)``) is linear in h with a selected coefficient."""
    if name == "where" and len(n.args) == 3:
        # NB: torch.where(cond, x, y), but the method x.where(cond, y)
        cond, x, y = (n.args[1], n.args[0], n.args[2]) if n.op == "call_method" else n.args
    elif name == "masked_fill" and len(n.args) == 3 and raw_name(n) == "masked_fill":  # not masked_fill_ (in place)
        cond, x, y = n.args[1], n.args[2], n.args[0]  # masked_fill(x, m, v) = where(m, v, x)
    else:
        return Affine(None, Atom(n))
    ev = example_value(n)
    if not isinstance(cond, fx.Node) or depends(cond) or not isinstance(ev, torch.Tensor):
        return Affine(None, Atom(n))  # NB: a mask computed from the state (where(h > 0, ...)) is a nonlinearity
    c, xa, ya = Atom(cond), rec(x), rec(y)
    return Affine(e_select(c, xa.coef, ya.coef, ev.dtype), e_select(c, xa.offset, ya.offset, ev.dtype))


def _mul(n: fx.Node, x: Affine, y: Affine) -> Affine:
    if x.coef is not None and y.coef is not None:
        raise NotAffine(n, f"the carry multiplies itself at node {n.name} (quadratic in the state, e.g. h*h)")
    if x.coef is None:
        return Affine(e_mul(x.offset, y.coef), e_mul(x.offset, y.offset))
    return Affine(e_mul(y.offset, x.coef), e_mul(y.offset, x.offset))


# ----------------------------------------------------------------------------------------------------------------
# classification of one state update


@dataclasses.dataclass
class UpdateForm:
    """How a new state relates to its carry: ``new = coef ⊙ carry + offset``.

    ``kind`` is ``"linear"`` (coef, offset independent of the carry), ``"gated"`` (one of them depends on it) or
    ``"general"`` (not affine in the carry; ``reason`` says why, ``where`` names the node).
    """

    kind: str
    coef: Expr | None = None
    offset: Expr | None = None
    reason: str = ""
    where: str = ""

    def describe(self) -> dict[str, Any]:
        """JSON-able: the expressions of a (or z1) and b (or z2)."""
        return {"form": self.kind, "a": None if self.coef is None else str(self.coef),
                "b": "0" if self.offset is None else str(self.offset)}


def _matrix_product(n: fx.Node, carry: fx.Node, depends: Callable[[fx.Node], bool]) -> fx.Node | None:
    """The matrix product of a carry-dependent operand and carry-free ones (``h @ A``, ``A @ h``, ``linear(h, W)``)
    that ``n`` is built from through affine ops only (add, mul, ...), if any: a dense linear recurrence."""
    on_path = lambda a: a is carry or depends(a)  # noqa: E731
    if op_name(n) not in _AFFINE_OPS | MATMULS | {"linear"}:
        return None  # NB: tanh(h @ W + x) is a nonlinear recurrence, not a dense linear one
    for m in [n, *bfs_inputs(n, 16, lambda a: on_path(a) and op_name(a) in _AFFINE_OPS)]:
        dep = [on_path(a) for a in m.all_input_nodes]
        if (op_name(m) in MATMULS or op_name(m) == "linear") and sum(dep) == 1 and len(dep) >= 2:
            return m
    return None


def classify_update(new: fx.Node, carry: fx.Node, depends: Callable[[fx.Node], bool]) -> UpdateForm:
    """Classify ``new`` as linear / gated / general in ``carry`` (DESIGN.md §3–4).

    ``depends(node)``: whether ``node`` depends on the carry *or on any other state* of a multi-state recurrence
    (e.g. an LSTM's h when classifying its cell c): a coefficient that depends on another state is a gate.
    """
    if new is carry:
        return UpdateForm("general", reason="the new state is the carry itself (no update)", where=new.name)
    try:
        aff = affine(new, carry, depends)
    except NotAffine as e:
        return UpdateForm("general", reason=e.reason, where=e.node.name)
    if aff.coef is None:
        if not depends(new):
            return UpdateForm("general", reason="the new state does not depend on the carry", where=new.name)
        culprit = next((a for a in (aff.offset.nodes() if aff.offset else []) if depends(a)), new)
        while op_name(culprit) in ("clone", "contiguous") and culprit.args and isinstance(culprit.args[0], fx.Node):
            culprit = culprit.args[0]  # NB: a rolled loop's carries are copied (loop_runtime): name what is copied
        what = op_name(culprit) or culprit.op
        mm = _matrix_product(culprit, carry, depends)
        if mm is not None:
            return UpdateForm(
                "general", reason=f"the carry is multiplied by a matrix ({op_name(mm)} at node {mm.name}): "
                                  f"h' = h @ A + b has a matrix coefficient, not an elementwise one; only "
                                  f"h' = a ⊙ h + b (a diagonal coefficient) is recognized", where=mm.name)
        return UpdateForm(
            "general", reason=f"not linear in the carry: it passes through {what} at node {culprit.name} "
                              f"(a general nonlinear recurrence)", where=culprit.name)
    sn, sc = hinted_shape(new), hinted_shape(carry)
    if sn is not None and sc is not None and sn != sc:
        return UpdateForm("general", reason=f"the new state's shape {list(sn)} differs from the carry's {list(sc)}",
                          where=new.name)
    dep_c = [a for a in aff.coef.nodes() if depends(a)]
    dep_o = [a for a in (aff.offset.nodes() if aff.offset else []) if depends(a)]
    if dep_c or dep_o:
        if dep_c:
            why = f"a depends on the carry (via node {dep_c[0].name})"
        else:
            why = f"b depends on the carry (via node {dep_o[0].name})"
        return UpdateForm("gated", aff.coef, aff.offset, reason=why, where=(dep_c or dep_o)[0].name)
    return UpdateForm("linear", aff.coef, aff.offset)


# ----------------------------------------------------------------------------------------------------------------
# the combine of an associative scan


def linear_combine(xl: list[fx.Node], yl: list[fx.Node], res: list[Any]) -> tuple[set[int], dict[int, Any]] | str:
    """Classify a combine ``res = combine(xl, yl)`` (one result per leaf) as the linear-recurrence combine: its
    decay leaves (``x_k * y_k``) and state leaves (leaf -> its decay leaf, or ``"one"`` for ``x_k + y_k``), or the
    reason it is not that combine. Used by the matchers of an ``associative_scan`` node (passes/match/find_recurrences.py) and of its
    generic mode (passes/match/find_generic_scan.py)."""
    n = len(xl)
    depends = forward_reach(list(xl)).__contains__
    decay: set[int] = set()
    state: dict[int, Any] = {}  # leaf -> index of its decay leaf, or "one"
    for k in range(n):
        r = res[k]
        if not isinstance(r, fx.Node):
            return f"combine output {k} is not a graph value"
        try:
            aff = affine(r, xl[k], depends)
        except NotAffine as e:
            return f"combine output {k}: {e.reason}"
        c, o = aff.coef, aff.offset
        free = lambda e: e is None or not any(depends(a) for a in e.nodes())  # noqa: E731
        if c is None or not free(c) or not free(o):
            return f"combine output {k} is not a ⊙ x + b in its own leaf with a, b from y only"
        if o is None and isinstance(c, Atom) and c.n is yl[k]:
            decay.add(k)
        elif isinstance(o, Atom) and o.n is yl[k] and isinstance(c, Atom) and c.n in yl:
            state[k] = yl.index(c.n)
        elif isinstance(o, Atom) and o.n is yl[k] and isinstance(c, Const) and c.value == 1:
            state[k] = "one"
        else:
            return f"combine output {k} = ({c})*x + ({o}) is not the associative linear combine"
    for k, j in state.items():
        if j != "one" and j not in decay:
            return f"combine: leaf {k} is scaled by leaf {j}, which is not a running product (x*y)"
    return decay, state
