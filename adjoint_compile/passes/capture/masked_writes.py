"""A value written into a copy the graph made (``labels = labels.clone(); labels[labels == pad] = -100``) becomes a
new value (``labels.masked_fill(labels == pad, -100)``), so that one masked write in a loss no longer leaves the
whole graph with ordinary autograd.

Training scripts edit their targets this way before the loss::

    t = labels.clone()
    t[t == pad_id] = -100              # setitem(t, eq, -100)        ->  t_1 = t.masked_fill(eq, -100)
    t[:, :prompt_len] = -100           # setitem(t_1, (:, :k), -100) ->  t_2 = written(t_1, (:, :k), -100)
    loss = F.cross_entropy(logits.flatten(0, 1), t.flatten())

Dynamo records the writes as in-place ``setitem`` nodes and later reads of ``t`` as reads of the clone, so their
order is in the graph's node order only; the capture stage refuses such a graph whole (passes/capture/). Here each
write becomes a new node and every later read of the tensor reads it:

* a boolean mask of the tensor's shape, or of its leading axes: ``masked_fill`` (element-wise: a loss with such
  targets still joins a sharded region);
* basic indexing (ints, slices, ``...``): :func:`written`, a copy with the slice written (one opaque call: the
  positions it writes are not each step's own, so a region ends before it).

Only where it is safe: the tensor is a fresh copy the graph made (``clone``, or a factory such as ``zeros_like`` or
``full``: nothing else shares its memory), the value written is a number, and nothing viewed the tensor, cast it
(``.to`` of its own dtype is the tensor itself), made a value sharing its memory (by the traced fake tensors'
storages) or wrote into it before this write (they would see the write). Anything else keeps its write, and the
graph its refusal, as before.

Part of the capture stage (passes/capture/), with :mod:`.buffer_writes`, before the check for writes left.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import example_value, is_inplace, is_view_op, refresh_example_values, shares_memory
from ...regions import PROVENANCE

log = logging.getLogger(__name__)

__all__ = ["rewrite_masked_writes", "written"]

#: ops that may return their input itself (a cast to its own dtype or device): a read of one before the write
#: would see the write
_MAY_ALIAS = frozenset("to type type_as float double half bfloat16 long int short bool byte char cpu cuda "
                       "contiguous requires_grad_".split())
#: ops whose result is a tensor of its own (no other tensor shares its memory)
_FRESH = frozenset("clone zeros zeros_like empty empty_like full full_like ones ones_like new_zeros new_empty "
                   "new_full new_ones masked_fill written".split())


def written(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """A copy of ``x`` with ``value`` written at the basic ``index`` (``y = x.clone(); y[index] = value``)."""
    y = x.clone()
    y[index] = value
    return y


def _name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")


def _basic(idx: Any) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(i is Ellipsis or isinstance(i, slice) and all(
        s is None or isinstance(s, int) for s in (i.start, i.stop, i.step)) or
        isinstance(i, int) and not isinstance(i, bool) for i in items)


def _mask(idx: Any, x: torch.Tensor) -> fx.Node | None:
    """The boolean mask ``idx`` (alone or as a 1-tuple) when it covers x's leading axes; else None."""
    m = idx[0] if isinstance(idx, tuple) and len(idx) == 1 else idx
    v = example_value(m) if isinstance(m, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dtype != torch.bool or v.dim() == 0 or v.dim() > x.dim() or \
            tuple(v.shape) != tuple(x.shape[:v.dim()]):
        return None
    return m


def _why_not(w: fx.Node) -> str:
    """Why the write ``w`` (a setitem) cannot become a value, by its operands alone ("" when it may)."""
    x, idx, value = w.args
    xv = example_value(x)
    if not (isinstance(x, fx.Node) and x.op in ("call_function", "call_method") and _name(x) in _FRESH):
        return "it writes into a tensor that is not a fresh copy the graph made"
    if not isinstance(xv, torch.Tensor) or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "the value written is not a number"
    if _mask(idx, xv) is None and not _basic(idx):
        return "its index is neither a boolean mask nor ints and slices"
    return ""


def _seen_before(w: fx.Node, pos: dict[fx.Node, int]) -> str:
    """Why the tensor ``w`` writes into may be seen through another name: a view or a write of it before ``w``."""
    x = w.args[0]
    for u in x.users:
        if u is not w and pos[u] < pos[w] and (is_view_op(u) or is_inplace(u) or _name(u) in _MAY_ALIAS or
                                               shares_memory(u, x)):
            return f"{u.name} viewed, cast or wrote the tensor before"
    return ""


def rewrite_masked_writes(gm: fx.GraphModule) -> int:
    """Rewrite every write into a fresh copy that qualifies (module docstring), in place; returns how many."""
    done = 0
    pos: dict[fx.Node, int] = {}
    for w in list(gm.graph.nodes):
        if w.op != "call_function" or w.target is not operator.setitem or len(w.args) != 3 or w.kwargs:
            continue
        if not (why := _why_not(w)):
            # NB: positions made again only after a rewrite moved them (a graph of many writes stays linear)
            pos = pos if w in pos else {n: i for i, n in enumerate(gm.graph.nodes)}
            why = _seen_before(w, pos)
        if why:
            log.debug("masked_writes: %s keeps its write: %s", w.name, why)
            continue
        x, idx, value = w.args
        xv = example_value(x)
        m = _mask(idx, xv)
        with gm.graph.inserting_before(w):
            if m is not None:
                made = []
                if example_value(m).dim() < xv.dim():  # NB: a mask of the leading axes covers the rest whole
                    m = gm.graph.call_method("reshape", (m, *example_value(m).shape,
                                                         *[1] * (xv.dim() - example_value(m).dim())))
                    made.append(m)
                new = gm.graph.call_method("masked_fill", (x, m, value))
                refresh_example_values([*made, new])
            else:
                new = gm.graph.call_function(written, (x, idx, value))
                new.meta["example_value"] = xv  # NB: the same shape, dtype and device
        new.meta["stack_trace"] = w.meta.get("stack_trace")
        new.meta[PROVENANCE] = {"pass": "masked_writes", "write": w.name}
        later = {u for u in x.users if pos.get(u, -1) > pos[w]}
        x.replace_all_uses_with(new, delete_user_cb=lambda u: u in later)
        gm.graph.erase_node(w)
        pos = {}
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
