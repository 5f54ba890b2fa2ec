"""Linear recurrences written as closed forms over whole sequences (matchers; capture's passes/capture/scan_forms.py rewrites
what they prove into one ``linear_scan`` node).

Two closed forms of h_t = a_t ⊙ h_{t-1} + b_t (h_{-1} = h0, 0 when absent), as dynamo records them:

* **log-space** (Heinsen's sequence, minGRU's ``heinsen_associative_scan_log``)::

      a_star = cumsum(log_a, d)
      h      = exp(a_star + logcumsumexp(log_b - a_star, d))

  is h_t = Σ_{s<=t} (Π_{s<r<=t} a_r) b_s with a = exp(log_a), b = exp(log_b). minGRU's initial state is a first
  step prepended: ``log_b = cat([log_h0, log_b'], d)``, ``log_a = F.pad(log_a', (.., 1, 0))`` (a = 1 there), so
  h = cat([exp(log_h0), linear_scan(exp(log_a'), exp(log_b'), h0=exp(log_h0))], d); a slice ``h[..., -T:, ...]``
  of it is the scan itself.
* **cumprod**::

      P = cumprod(a, d)
      h = P * cumsum(b / P, d)            (+ P * h0, or P * (h0 + cumsum(...)), h0 of size 1 along d)

Each form is proven node by node (ops, their dims, shapes); nothing is guessed. A candidate (a ``logcumsumexp``, or
a ``cumprod`` divided into) that is not exactly the form is a :class:`~adjoint_compile.regions.Rejection` with the
reason, and the graph keeps it. Matchers never mutate the graph.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx

from ...analysis.fx import hinted_shape
from ...analysis.optable import fn_name, op_name
from ...regions import Rejection

__all__ = ["ScanForm", "find_scan_forms", "dim_of", "is_getitem_last"]


@dataclasses.dataclass
class ScanForm:
    """A proven closed form: ``anchor`` equals ``linear_scan(A, B, h0, dim)`` (see :func:`emit` in scan_forms)."""

    source: str
    #: the node whose value is the scan's output (its uses are redirected to the scan).
    anchor: fx.Node
    #: a and b, or their logs when ``log`` (None: a = 1, or b = 0 for a running product with h0 = 1).
    a: fx.Node | None
    b: fx.Node | None
    dim: int
    log: bool = False
    #: the initial state, [*shape] with size 1 along ``dim`` (or broadcastable to it), or None (0).
    h0: fx.Node | None = None
    #: log-space with a prepended first step: the output is cat([exp(h0), H]) (h0 then holds the log).
    prepended: bool = False
    running_product: bool = False
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Miss(Exception):
    """The candidate is not the form; the message says why."""


def _is(n: Any, *names: str) -> bool:
    return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and (op_name(n) or fn_name(n)) in names


def dim_of(n: fx.Node, pos: int = 1, key: str = "dim") -> int | None:
    """The normalized dim argument of ``op(x, dim)`` (positional or keyword); None when absent or not an int."""
    d = n.args[pos] if len(n.args) > pos else n.kwargs.get(key)
    shp = hinted_shape(n)
    if not isinstance(d, int) or isinstance(d, bool) or shp is None or not -len(shp) <= d < max(len(shp), 1):
        return None
    return d % len(shp)


def _along(n: fx.Node, what: str) -> int:
    if set(n.kwargs) - {"dim"} or len(n.args) > 2:
        raise _Miss(f"{what} {n.name} has extra arguments ({sorted(set(n.kwargs) - {'dim'})}, e.g. a dtype)")
    d = dim_of(n)
    if d is None:
        raise _Miss(f"{what} {n.name} has no static dim")
    return d


def _other(n: fx.Node, one: fx.Node) -> Any:
    """For a binary ``n`` with ``one`` as an operand, the other operand."""
    x, y = n.args[0], n.args[1] if len(n.args) > 1 else None
    if len(n.args) != 2 or n.kwargs or (x is one) == (y is one):
        raise _Miss(f"{n.name} is not a binary op of {one.name} and another value")
    return y if x is one else x


def _same_shape(*ns: Any) -> tuple[int, ...]:
    shapes = {hinted_shape(n) if isinstance(n, fx.Node) else None for n in ns}
    if len(shapes) != 1 or None in shapes:
        names = ", ".join(f"{n.name} {list(hinted_shape(n) or [])}" for n in ns if isinstance(n, fx.Node))
        raise _Miss(f"shapes differ or are not static: {names}")
    return next(iter(shapes))


# ----------------------------------------------------------------------------------------------------------------
# log-space


def _log_space(q: fx.Node) -> ScanForm:
    """``q`` = logcumsumexp(log_b - a_star, d) with a_star = cumsum(log_a, d) and h = exp(a_star + q)."""
    d = _along(q, "logcumsumexp")
    sub = q.args[0]
    if not _is(sub, "sub") or len(sub.args) != 2 or sub.kwargs:
        raise _Miss(f"logcumsumexp along dim {d} of {getattr(sub, 'name', sub)}, not of (log_b - cumsum(log_a))")
    log_b, star = sub.args
    if not _is(star, "cumsum"):
        raise _Miss(f"the offset {getattr(star, 'name', star)} subtracted before logcumsumexp is not a cumsum")
    if _along(star, "cumsum") != d:
        raise _Miss(f"cumsum {star.name} is along dim {dim_of(star)}, logcumsumexp {q.name} along dim {d}")
    log_a = star.args[0]
    adds = [u for u in q.users if _is(u, "add") and star in u.args[:2] and len(u.args) == 2 and not u.kwargs]
    if not adds:
        raise _Miss(f"the result of {q.name} is not added back to the offset {star.name} (a_star + logcumsumexp)")
    exps = [e for u in adds for e in u.users if _is(e, "exp") and len(e.args) == 1 and not e.kwargs]
    if not exps:
        raise _Miss(f"{adds[0].name} = a_star + logcumsumexp(...) is not exponentiated")
    shape = _same_shape(log_a, log_b, star, q, adds[0], exps[0])
    T = shape[d]
    # minGRU's initial state: one step prepended, a = exp(0) = 1 there and log b = log h0
    h0 = None
    if _is(log_b, "cat") and _is(log_a, "pad") and T >= 2:
        h0, log_a_, log_b_ = _prepended(log_a, log_b, d, shape)
        if h0 is not None:
            return ScanForm("log_space_scan", exps[0], log_a_, log_b_, d, log=True, h0=h0, prepended=True,
                            details={"logcumsumexp": q.name, "cumsum": star.name, "steps": T - 1})
    return ScanForm("log_space_scan", exps[0], log_a, log_b, d, log=True,
                    details={"logcumsumexp": q.name, "cumsum": star.name, "steps": T})


def _prepended(log_a: fx.Node, log_b: fx.Node, d: int, shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """(log h0, log a', log b') for log_b = cat([log h0, log b'], d), log_a = pad(log a', 1 step of 0 before d);
    (None, ..) when they are not exactly that (the form then stands for a scan of all T steps, also exact)."""
    items = log_b.args[0] if log_b.args else None
    cd = log_b.args[1] if len(log_b.args) > 1 else log_b.kwargs.get("dim", 0)
    if not isinstance(items, (list, tuple)) or len(items) != 2 or not isinstance(cd, int) or \
            cd % len(shape) != d:
        return None, None, None
    first, rest = items
    pad = log_a.args[1] if len(log_a.args) > 1 else log_a.kwargs.get("pad")
    mode = log_a.args[2] if len(log_a.args) > 2 else log_a.kwargs.get("mode", "constant")
    value = log_a.args[3] if len(log_a.args) > 3 else log_a.kwargs.get("value")
    want = [0] * (2 * (len(shape) - d))
    want[-2] = 1
    if list(pad or []) != want or mode != "constant" or value not in (None, 0, 0.0):
        return None, None, None
    inner = log_a.args[0]
    fs, rs = hinted_shape(first), hinted_shape(rest)
    if fs is None or rs is None or fs[d] != 1 or list(rs) != list(hinted_shape(inner) or []):
        return None, None, None
    return first, inner, rest


# ----------------------------------------------------------------------------------------------------------------
# cumprod


def _cumprod(p: fx.Node, divs: list[fx.Node]) -> ScanForm:
    """``p`` = cumprod(a, d), h = p * cumsum(b / p, d) [+ p * h0 | p * (h0 + cumsum(..))]."""
    d = _along(p, "cumprod")
    a = p.args[0]
    why = []
    for div in divs:
        b = div.args[0]
        sums = [u for u in div.users if _is(u, "cumsum")]
        if not sums:
            why.append(f"{div.name} = {getattr(b, 'name', b)} / {p.name} is not cumsum'd")
            continue
        for c in sums:
            if _along(c, "cumsum") != d:
                why.append(f"cumprod {p.name} is along dim {d}, cumsum {c.name} along dim {dim_of(c)}")
                continue
            for form in _cumprod_outputs(p, c, d):
                anchor, h0 = form
                _same_shape(a, b, p, div, c, anchor)
                if h0 is not None:
                    _check_h0(h0, hinted_shape(p), d)
                return ScanForm("cumprod_scan", anchor, a, b, d, h0=h0,
                                details={"cumprod": p.name, "cumsum": c.name})
            why.append(f"cumsum {c.name} is not multiplied back by {p.name} (cumprod(a) * cumsum(b / cumprod(a)))")
    raise _Miss("; ".join(why) or f"{p.name} has no b / {p.name}")


def _cumprod_outputs(p: fx.Node, c: fx.Node, d: int) -> list[tuple[fx.Node, fx.Node | None]]:
    """The nodes equal to the scan's output: p * c, p * c + p * h0, p * (c + h0) (as (node, h0) pairs)."""
    out = []
    for u in c.users:
        if _is(u, "mul") and p in u.args and _other(u, c) is p:
            plus = [v for v in u.users if _is(v, "add") and len(v.args) == 2 and not v.kwargs]
            for v in plus:
                m = _other(v, u)
                if _is(m, "mul") and p in m.args and len(m.args) == 2 and not m.kwargs:
                    h0 = _other(m, p)
                    if isinstance(h0, fx.Node) and _const_along(h0, d, hinted_shape(p)):
                        out.append((v, h0))
            out.append((u, None))
        elif _is(u, "add") and len(u.args) == 2 and not u.kwargs:
            h0 = _other(u, c)
            if isinstance(h0, fx.Node) and _const_along(h0, d, hinted_shape(p)):
                out += [(m, h0) for m in u.users if _is(m, "mul") and len(m.args) == 2 and _other(m, u) is p]
    return out


def _const_along(h0: fx.Node, d: int, shape: Any) -> bool:
    """``h0`` broadcasts to ``shape`` with size 1 along ``d`` (it does not vary along the steps)."""
    s = hinted_shape(h0)
    if s is None or shape is None or len(s) > len(shape):
        return False
    full = (1,) * (len(shape) - len(s)) + tuple(s)
    return full[d] == 1 and all(x in (1, y) for x, y in zip(full, shape))


def _check_h0(h0: fx.Node, shape: Any, d: int) -> None:
    if not _const_along(h0, d, shape):
        raise _Miss(f"the initial-state term {h0.name} varies along dim {d}")


# ----------------------------------------------------------------------------------------------------------------


def find_scan_forms(gm: fx.GraphModule) -> tuple[list[ScanForm], list[Rejection]]:
    """The log-space and cumprod forms of ``gm`` (proven), and the candidates that are not exactly one."""
    forms: list[ScanForm] = []
    rejected: list[Rejection] = []
    for n in gm.graph.nodes:
        try:
            if _is(n, "logcumsumexp"):
                forms.append(_log_space(n))
            elif _is(n, "cumprod"):
                divs = [u for u in n.users if _is(u, "div") and len(u.args) == 2 and u.args[1] is n
                        and u.args[0] is not n and not u.kwargs]
                if divs:
                    forms.append(_cumprod(n, divs))
        except _Miss as e:
            kind = "log-space scan" if _is(n, "logcumsumexp") else "cumprod scan"
            rejected.append(Rejection("linear_recurrence", n.name, f"{kind} at {n.name}: {e}"))
    return forms, rejected


def is_getitem_last(u: fx.Node, d: int, T: int) -> bool:
    """``u`` is ``x[..., -T:, ...]`` (full slices elsewhere) along ``d``: the last T steps of x."""
    if not (u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2):
        return False
    idx = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
    if len(idx) != d + 1 or not all(isinstance(s, slice) for s in idx):
        return False
    if any((s.start, s.stop, s.step) != (None, None, None) for s in idx[:d]):
        return False
    s = idx[d]
    shp = hinted_shape(u)
    return s.step in (None, 1) and s.stop is None and s.start == -T and shp is not None and shp[d] == T

