"""State resets of packed sequences: a scan whose decay is zeroed where a document starts.

Long-context training packs several documents into one row and restarts the recurrent state at each document's
first token (``seq_idx`` / ``cu_seqlens`` in mamba_ssm and flash-linear-attention, restarting ``position_ids`` in
transformers' flattening collator). Written into the decay, h_t = a_t (1 - r_t) h_{t-1} + b_t is an ordinary linear
recurrence: nothing in the lowering treats it apart, and the sharded adjoint is exact whatever the shard
boundaries are relative to the documents'. This module only *finds* such a factor, for the report
(passes/lower/sharded.py records it; passes/decide/ says "resets the state at document boundaries").

A reset factor of a scan's ``a``, seen through views, dtype conversions and unsqueezes, is one of

- ``a * (1 - r)`` (``1 - r``, ``rsub(r, 1)``), r a 0/1 graph input or a boolean value;
- ``a * ~m`` / ``a * m.logical_not()``, m boolean;
- ``a * m``, m boolean (a keep mask, e.g. ``position_ids != 0``);
- ``where(m, 0, a)`` / ``masked_fill(a, m, 0)`` (m: the resets) or ``where(m, a, 0)`` (m: a keep mask);

where the mask comes, through views, conversions, comparisons and logical ops, from a graph input (not a parameter)
or from a boolean value, and carries the step axis (when the step analysis is given).
"""
from __future__ import annotations

import logging
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from .fx import example_value, scan_args
from .optable import target_name as _name

__all__ = ["find_resets"]

log = logging.getLogger(__name__)

#: ops that keep a value's meaning as a factor or a mask: views, dtype conversions, copies
_TRANSPARENT = frozenset("view reshape flatten unflatten permute transpose movedim moveaxis contiguous expand "
                         "expand_as unsqueeze squeeze clone to float double half bfloat16 type type_as detach "
                         "broadcast_to _to_copy".split())
#: ops that turn a mask into another mask (comparisons with a constant, logical ops)
_BOOLEAN = frozenset("eq ne lt le gt ge __eq__ __ne__ __lt__ __le__ __gt__ __ge__ logical_not logical_and "
                     "logical_or logical_xor bitwise_not invert __invert__ __and__ __or__ and_ or_ isin".split())
_NOT = frozenset("logical_not bitwise_not invert __invert__".split())
_MUL = frozenset("mul __mul__ multiply".split())
_SUB = frozenset("sub __sub__ subtract".split())
_ZEROS = frozenset("zeros_like zeros new_zeros".split())


def _index_only(n: fx.Node) -> bool:
    """``x[:, :, None, None]``: a getitem with slices, None and Ellipsis only (a view of every step)."""
    idx = n.args[1] if len(n.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx)


def _through(n: Any) -> Any:
    """``n`` with views, conversions and copies peeled off."""
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.args and \
            isinstance(n.args[0], fx.Node):
        name = _name(n)
        if name in _TRANSPARENT or (n.target is operator.getitem and _index_only(n)):
            n = n.args[0]
            continue
        break
    return n


def _is_zero(x: Any) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    return isinstance(x, fx.Node) and _name(x) in _ZEROS


def _is_one(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1


def _is_bool(n: fx.Node) -> bool:
    v = example_value(n)
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def _source(n: Any, step_dim: Mapping[fx.Node, Any] | None, *, need_bool: bool) -> fx.Node | None:
    """The graph input (or boolean value) a mask comes from, or None when ``n`` is not one.

    Walks back through views, conversions, comparisons with constants and logical ops. ``need_bool``: a 0/1 float
    input alone does not do (``a * m`` with a float m is any product); a boolean value on the way does.
    """
    seen_bool = False
    while isinstance(n, fx.Node):
        if step_dim is not None and step_dim.get(n) is None:
            return None
        seen_bool = seen_bool or _is_bool(n)
        if n.op == "placeholder":
            if isinstance(example_value(n), torch.nn.Parameter):
                return None
            return n if seen_bool or not need_bool else None
        if n.op not in ("call_function", "call_method") or not n.args:
            return None
        name = _name(n)
        if name in _TRANSPARENT or (n.target is operator.getitem and _index_only(n)) or name in _BOOLEAN:
            ins = [a for a in n.all_input_nodes]
            if len(ins) != 1:  # NB: a logical op of two masks: follow the one with the step axis
                ins = [a for a in ins if step_dim is None or step_dim.get(a) is not None]
                if len(ins) != 1:
                    return n if seen_bool else None
            n = ins[0]
            continue
        # NB: a boolean value made by anything else (a comparison of shifted ids, seq_idx[t] != seq_idx[t-1]) is a
        # mask in its own right
        return n if seen_bool else None
    return None


def _label(n: fx.Node) -> str:
    """A graph input by its argument's name (dynamo's ``L['reset']`` / placeholder ``l_reset_``: ``reset``)."""
    ga = n.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", None)
    src = src() if callable(src) else src
    m = re.fullmatch(r"L\['(\w+)'\]", str(src)) if src else None
    if m:
        return m.group(1)
    m = re.fullmatch(r"[lL]_(\w+?)_", n.name) if n.op == "placeholder" else None
    return m.group(1) if m else n.name


def _factors(n: Any, out: list[tuple[str, Any]]) -> None:
    """The factors of ``n`` (a product, a where with a zero branch), each as (form, node); a non-product is one
    factor with form ""."""
    n = _through(n)
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        out.append(("", n))
        return
    name, args = _name(n), n.args
    if name in _MUL and len(args) == 2:
        for x in args:
            _factors(x, out)
    elif name == "where" and len(args) == 3 and _is_zero(args[1]):
        out.append(("where(m, 0, a)", args[0]))
        _factors(args[2], out)
    elif name == "where" and len(args) == 3 and _is_zero(args[2]):
        out.append(("where(keep, a, 0)", args[0]))
        _factors(args[1], out)
    elif name == "masked_fill" and len(args) == 3 and _is_zero(args[2]):
        out.append(("masked_fill(a, m, 0)", args[1]))
        _factors(args[0], out)
    else:
        out.append(("", n))


def find_resets(scan: fx.Node, step_dim: Mapping[fx.Node, Any] | None = None) -> list[dict[str, str]]:
    """The reset masks in the decay ``a`` of the linear_scan node ``scan``: one dict per mask factor, with the scan's
    name, the mask's source (a graph input by its argument's name, e.g. ``reset``, or the boolean node) and the
    form it takes (``a * (1 - r)``, ``a * ~m``, ``a * m``, ``where(m, 0, a)``, ...). Empty when there is none.

    ``step_dim``: the step axis of each node (analysis.time_local's ``TimeLocalInfo.step_dim``); when given, a mask
    must carry the step axis all the way (a mask without it does not reset at a step).
    """
    try:
        return _find(scan, step_dim)
    except Exception:  # noqa: BLE001 - for the report only: never in the way of a lowering
        log.debug("adjoint-compile: looking for resets in %s failed", scan.name, exc_info=True)
        return []


def _find(scan: fx.Node, step_dim: Mapping[fx.Node, Any] | None) -> list[dict[str, str]]:
    a = scan_args(scan).get("a")
    if not isinstance(a, fx.Node):
        return []
    factors: list[tuple[str, Any]] = []
    _factors(a, factors)
    found: list[dict[str, str]] = []
    for form, f in factors:
        src, how = None, form
        if form:
            src = _source(f, step_dim, need_bool=form == "where(m, 0, a)" or "keep" in form or "masked" in form)
        elif isinstance(f, fx.Node) and f.op in ("call_function", "call_method") and f.args:
            name = _name(f)
            if name in _SUB and len(f.args) == 2 and _is_one(f.args[0]):
                src, how = _source(f.args[1], step_dim, need_bool=False), "a * (1 - r)"
            elif name == "rsub" and len(f.args) >= 2 and _is_one(f.args[1]):
                src, how = _source(f.args[0], step_dim, need_bool=False), "a * (1 - r)"
            elif name in _NOT:
                src, how = _source(f.args[0], step_dim, need_bool=True), "a * ~m"
            else:
                src, how = _source(f, step_dim, need_bool=True), "a * m"
        if src is not None:
            found.append({"scan": scan.name, "mask": _label(src), "form": how})
    return found
