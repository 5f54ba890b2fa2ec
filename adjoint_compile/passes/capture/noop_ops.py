"""Drop ops that return their input unchanged, so that a loop written with them is matched like one without.

Libraries write a recurrence's state through casts and slices that do nothing at run time: ``h.to(x.device)``,
``h.type(dtype)`` or ``h.float()`` when the state already has that device and dtype, ``(z * h + c)[:, -1:]`` when
that dim has one element, ``h[..., :]``. Each such node is a value-level identity (same shape, dtype, device and
elements; autograd passes the gradient through unchanged), so its uses can read its input instead. Kept when the
node could matter: an in-place user (a write through a view reaches the base, a write to a copy does not), a
``copy=True`` or ``memory_format`` argument, or an index holding anything but full slices and ``...``.

Part of the capture stage (passes/capture/), before the recurrence matchers.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import eliminate_dead_code, example_value, is_inplace
from ...regions import PROVENANCE

log = logging.getLogger(__name__)

__all__ = ["drop_noop_ops", "drop_unused_float_args", "rewritten"]

_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
        a.dtype == b.dtype and a.device == b.device


def _full_index(idx: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``x[idx]`` selects every element of ``x`` (of ``shape``) in place: full slices and ``...`` only."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(it is None or isinstance(it, fx.Node) or not (isinstance(it, slice) or it is Ellipsis) for it in items):
        return False
    if sum(it is Ellipsis for it in items) > 1:
        return False
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (len(shape) - len(items) + 1) + items[k + 1:]
    if len(items) > len(shape):
        return False
    for it, n in zip(items, shape):
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (it.start, it.stop, it.step)):
            return False
        if range(n)[it] != range(n):
            return False
    return True


def _is_noop(n: fx.Node) -> bool:
    if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src, out = example_value(n.args[0]), example_value(n)
    if not _same(src, out):
        return False
    if n.op == "call_function" and n.target is operator.getitem:
        return len(n.args) == 2 and _full_index(n.args[1], tuple(src.shape))
    if n.op != "call_method":
        return False
    name = str(n.target)
    if name == "to":
        if set(n.kwargs) - {"device", "dtype", "non_blocking"}:
            return False  # NB: copy=True, memory_format: not a plain identity
        return all(isinstance(a, (torch.device, torch.dtype, str)) or isinstance(a, fx.Node) and
                   isinstance(example_value(a), torch.Tensor) for a in n.args[1:])
    if name == "type":
        return len(n.args) == 2 and not n.kwargs and isinstance(n.args[1], torch.dtype)
    if name in _CASTS:
        return len(n.args) == 1 and not n.kwargs and src.dtype == _CASTS[name]
    return False


def _scan_steps(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The step sub-graphs of ``gm``'s ``torch.ops.higher_order.scan`` calls (a loop rolled before dynamo)."""
    out = []
    for n in gm.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator) and t.name() == "scan" \
                and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr":
            sub = gm.get_submodule(str(n.args[0].target))
            if isinstance(sub, fx.GraphModule):
                out.append(sub)
    return out


def drop_noop_ops(gm: fx.GraphModule) -> int:
    """Replace every no-op cast/slice of ``gm`` and of its scans' steps by its input (in place); returns how many
    were dropped."""
    # NB: a loop traced once as torch's scan has its step's casts in the scan's sub-graph
    dropped = sum(drop_noop_ops(sub) for sub in _scan_steps(gm))
    for n in list(gm.graph.nodes):
        if not _is_noop(n) or any(is_inplace(u) for u in n.users):
            continue
        src = n.args[0]
        if src.op == "placeholder" and any(u.op == "output" for u in n.users):
            continue  # NB: a graph output that would become one of its inputs: leave the aliasing as it was
        if any(is_inplace(u) for u in src.users if u is not n):
            continue
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
        dropped += 1
    dropped += _constant_fills(gm)
    return rewritten(gm, dropped, log, "noop_ops: dropped %d no-op casts/slices, or fills of a tensor's shape")


#: fills that read only their input's shape, dtype and device -> the factory that makes the same tensor
_FILLS = {"zeros_like": torch.zeros, "ones_like": torch.ones, "empty_like": torch.empty, "full_like": torch.full,
          "new_zeros": torch.zeros, "new_ones": torch.ones, "new_empty": torch.empty, "new_full": torch.full}


def _constant_fills(gm: fx.GraphModule) -> int:
    """``zeros_like(x[:, 0])`` / ``x.new_zeros(B, D)`` (a loop's first state) as ``torch.zeros((B, D), dtype, device)``:
    the same values without reading x, so that x (a layer's output, a token lookup) is not read by an op that
    selects one step, which would end the region before it. Static shapes only; kept with ``requires_grad``,
    ``memory_format`` or ``layout``, or a fill value that is not a number."""
    done = 0
    for n in list(gm.graph.nodes):
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", None)
        make = _FILLS.get(name) if n.op in ("call_function", "call_method") and isinstance(name, str) else None
        ev = example_value(n)
        if make is None or not isinstance(ev, torch.Tensor) or set(n.kwargs) - {"dtype", "device"} or \
                not all(isinstance(d, int) for d in ev.shape):
            continue
        fill = ()
        if make is torch.full:  # NB: full_like(x, v) and x.new_full(size, v): the value is the last argument
            if len(n.args) < 2 or not isinstance(n.args[-1], (int, float, bool)):
                continue
            fill = (n.args[-1],)
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(make, (tuple(ev.shape), *fill), {"dtype": ev.dtype, "device": ev.device})
        new.meta.update(n.meta)
        # NB: the same value as the captured graph's node of that name (passes/lower/length_generic.py reads it there)
        new.meta[PROVENANCE] = {"pass": "noop_ops", "fill_of": n.name}
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        done += 1
    if done:
        eliminate_dead_code(gm.graph)  # NB: the slices that only fed a shape
    return done


def rewritten(gm: fx.GraphModule, count: int, logger: logging.Logger, message: str) -> int:
    """The end of a pass that rewrote ``count`` places of ``gm``'s graph in place: when it rewrote any, lint the graph,
    regenerate ``gm``'s code and log ``message % count`` at debug level; returns ``count``."""
    if count:
        gm.graph.lint()
        gm.recompile()
        logger.debug(message, count)
    return count


def drop_unused_float_args(gm: fx.GraphModule) -> int:
    """Put the literal default back for a float argument an op ignores: ``F.embedding``'s ``norm_type`` without a
    ``max_norm``. NB: under ``dynamic=True`` dynamo passes a module's float attribute (``nn.Embedding.norm_type``)
    as a 0-dim tensor read by ``.item()``: a value the sharded region would have to take as an input that is not a
    tensor, so a language model's region starting at its token lookup was never lowered. Returns how many."""
    done = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.nn.functional.embedding:
            continue
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type")
        args = dict(zip(names, n.args)) | {k: v for k, v in n.kwargs.items() if k in names}
        if args.get("max_norm") is None and isinstance(args.get("norm_type"), fx.Node):
            if len(n.args) > 4:
                n.args = (*n.args[:4], 2.0, *n.args[5:])
            else:
                n.kwargs = {**n.kwargs, "norm_type": 2.0}
            done += 1
    if done:
        eliminate_dead_code(gm.graph)  # NB: the .item() that read the attribute
    return rewritten(gm, done, log, "noop_ops: %d unused float argument(s) put back as literals")
