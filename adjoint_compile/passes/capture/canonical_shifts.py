"""Previous-state readouts written with ``F.pad``, rewritten to the one form the sharded runtime knows.

The time-local analysis recognizes a previous-state readout as ``cat([first, h[..., :-1]], d)`` (a :class:`Shift`
whose step before each shard is the scan's carry). People also write it with a pad:

    F.pad(h, (0, 0, 1, 0))[:, :-1]        # one step of `value` in front, then drop the last step
    F.pad(h, (0, 0, 1, -1))               # the same in one call (negative padding crops)

Before (``h``: [B, T, D], d = 1)::

    pad = torch.nn.functional.pad(h, (0, 0, 1, 0), value=v)      # [B, T+1, D]
    getitem = pad[(slice(None), slice(None, -1))]                # [B, T, D]

After::

    shift_first = torch.full([B, 1, D], v, dtype=h.dtype, device=h.device)
    shift_sliced = h[(slice(None), slice(None, -1))]             # [B, T-1, D]
    shift = torch.cat([shift_first, shift_sliced], 1)            # [B, T, D]

Only constant-mode pads of exactly one step in front of the scan's step dim (and nothing at its end but 0 or -1,
nothing on other dims) of a ``linear_scan`` output are rewritten; anything else is left as it is and ends the
region as before. New nodes carry ``meta["adjoint_compile"] = {"pass": "canonical_shifts", "from": <pad>}``.
"""
from __future__ import annotations

import contextlib
import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.fx import example_value as _ev
from ...analysis.fx import is_linear_scan, scan_args
from ...analysis.time_local import cat_pair, drops_last_step
from ...regions import PROVENANCE
from .noop_ops import rewritten

log = logging.getLogger(__name__)

__all__ = ["canonicalize_shifts"]


def _pad_spec(node: fx.Node) -> tuple[fx.Node, list[int], float] | None:
    """(input, pad list, fill value) of a constant-mode ``F.pad`` call, or None."""
    if not (node.op == "call_function" and node.target in (F.pad, torch._C._nn.pad)):
        return None
    args = list(node.args) + [None] * (4 - len(node.args))
    x = args[0]
    pad = args[1] if args[1] is not None else node.kwargs.get("pad")
    mode = args[2] if args[2] is not None else node.kwargs.get("mode", "constant")
    value = args[3] if args[3] is not None else node.kwargs.get("value")
    if not isinstance(x, fx.Node) or not isinstance(pad, (list, tuple)) or mode != "constant":
        return None
    if not all(isinstance(p, int) for p in pad) or len(pad) % 2:
        return None
    if value is not None and not isinstance(value, (int, float)):
        return None
    return x, list(pad), float(value or 0.0)


def _front_shift_dim(pad: list[int], ndim: int) -> tuple[int, int] | None:
    """(dim, end padding) when ``pad`` adds exactly one step in front of one dim and 0 or -1 at its end."""
    hits = []
    for k in range(len(pad) // 2):
        lo, hi = pad[2 * k], pad[2 * k + 1]
        if (lo, hi) != (0, 0):
            hits.append((ndim - 1 - k, lo, hi))
    if len(hits) != 1:
        return None
    d, lo, hi = hits[0]
    return (d, hi) if lo == 1 and hi in (0, -1) else None


def _filled_first(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(first, fill) of a readout ``cat([first, h[..., :-1]], d)`` of a scan output h whose first step is a fill made
    from a value's shape alone (``zeros_like(h[:, :1])``, ``zeros_like(h[:, 0])[:, None]``): it reads h, so the
    analysis could not take it for a constant."""
    m = cat_pair(node) if node.op == "call_function" and node.target in (torch.cat, torch.concat) else None
    if m is None or not (m[1].op == "call_function" and m[1].target is operator.getitem and is_linear_scan(h :=
                                                                                                      m[1].args[0])):
        return None
    first, hv, fv = m[0], _ev(h), _ev(m[0])
    if not (isinstance(hv, torch.Tensor) and isinstance(fv, torch.Tensor)) or m[2] % hv.ndim != scan_args(h)["dim"] \
            % hv.ndim or not drops_last_step(m[1], m[2] % hv.ndim) or fv.shape[m[2] % hv.ndim] != 1:
        return None
    inner = first
    if first.op == "call_method" and first.target == "unsqueeze" or (first.target is operator.getitem and all(
            i is None or i == slice(None) for i in (first.args[1] if isinstance(first.args[1], tuple) else ()))):
        inner = first.args[0]  # NB: a fill of one step, then a view that puts the step axis back
    fill = _fill_of(inner, list(_ev(inner).shape)) if isinstance(inner, fx.Node) and isinstance(
        _ev(inner), torch.Tensor) else None
    return (first, fill) if fill is not None and inner.all_input_nodes else None


def canonicalize_shifts(gm: fx.GraphModule) -> int:
    """Rewrite pad-style previous-state readouts of ``linear_scan`` outputs in place, and those whose first step is a
    fill made from h's shape (:func:`_filled_first`); returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if (ff := _filled_first(node)) is not None:
            first, fill = ff
            fv = _ev(first)
            with gm.graph.inserting_before(node):
                const = gm.graph.call_function(torch.full, (list(fv.shape), fill),
                                               {"dtype": fv.dtype, "device": fv.device})
            const.meta["example_value"], const.meta[PROVENANCE] = fv, {"pass": "canonical_shifts", "from": first.name}
            node.replace_input_with(first, const)
            done += 1
            continue
        spec = _pad_spec(node)
        if spec is None:
            continue
        h, pad, value = spec
        hv = _ev(h)
        if not (is_linear_scan(h) and isinstance(hv, torch.Tensor)):
            continue
        front = _front_shift_dim(pad, hv.ndim)
        if front is None or front[0] != scan_args(h)["dim"] % hv.ndim:
            continue
        d, hi = front
        if hi == -1:
            out = node                      # the pad crops itself
        elif len(node.users) == 1 and drops_last_step(next(iter(node.users)), d):
            out = next(iter(node.users))    # pad, then drop the last step
        else:
            continue
        ov = _ev(out)
        if not isinstance(ov, torch.Tensor) or tuple(ov.shape) != tuple(hv.shape) or hv.shape[d] < 1:
            continue
        first_shape = list(hv.shape)
        first_shape[d] = 1
        idx = tuple(slice(None, -1) if j == d else slice(None) for j in range(d + 1))
        prov = {"pass": "canonical_shifts", "from": node.name}
        g = gm.graph
        with g.inserting_before(node):
            first = g.call_function(torch.full, (first_shape, value), {"dtype": hv.dtype, "device": hv.device})
            sliced = g.call_function(operator.getitem, (h, idx))
            cat = g.call_function(torch.cat, ([first, sliced], d))
        with hv.fake_mode if hasattr(hv, "fake_mode") else contextlib.nullcontext():
            first.meta["example_value"] = torch.full(first_shape, value, dtype=hv.dtype, device=hv.device)
            sliced.meta["example_value"] = hv[idx]
        cat.meta["example_value"] = ov
        for n in (first, sliced, cat):
            n.meta[PROVENANCE] = dict(prov)
        out.replace_all_uses_with(cat)
        g.erase_node(out)
        if out is not node:
            g.erase_node(node)
        done += 1
    return rewritten(gm, done, log,
                     "adjoint-compile: %d pad-style previous-state readout(s) rewritten to cat([first, h[:-1]])")



# ----------------------------------------------------------------------------------------------------------------
# token shifts: fixed-width shifts of any value, rewritten to one shift_steps call


def _drops_last(sliced: fx.Node, d: int, p: int) -> bool:
    """``sliced`` is ``x[..., :-p, ...]`` with the cut at dim d and full slices elsewhere."""
    from ...analysis.time_local import slice_items
    items = slice_items(sliced)
    xv = _ev(sliced.args[0]) if items is not None else None
    if items is None or not isinstance(xv, torch.Tensor):
        return False
    n = xv.shape[d]
    for j, i in enumerate(items):
        if i.start not in (None, 0) or i.step not in (None, 1):
            return False
        stop = None if i.stop is None else (i.stop if i.stop >= 0 else xv.shape[j] + i.stop)
        if j == d and stop != n - p:
            return False
        if j != d and stop not in (None, xv.shape[j]):
            return False
    return True


_FILLS = {torch.zeros_like: 0.0, torch.ones_like: 1.0}


def _fill_of(first: fx.Node, shape: list[int]) -> float | None:
    """The constant of a ``first`` block made by zeros_like / ones_like / full_like / zeros / full with ``shape``."""
    fv = _ev(first)
    if not (first.op == "call_function" and isinstance(fv, torch.Tensor) and list(fv.shape) == shape):
        return None
    t = first.target
    if t in _FILLS:
        return _FILLS[t]
    if t is torch.full_like and len(first.args) > 1 and isinstance(first.args[1], (int, float)):
        return float(first.args[1])
    if t is torch.zeros and not any(isinstance(a, fx.Node) for a in fx.node.map_aggregate(first.args, lambda a: a)):
        return 0.0
    if t is torch.full and len(first.args) > 1 and isinstance(first.args[1], (int, float)) and not isinstance(
            first.args[0], fx.Node):
        return float(first.args[1])
    return None


def _token_shift(node: fx.Node) -> tuple[fx.Node, fx.Node, int, int, float, list[fx.Node]] | None:
    """(x, the node to replace, p, dim, fill, nodes that die with it) for a token shift, else None."""
    spec = _pad_spec(node)
    if spec is not None:
        x, pad, value = spec
        xv = _ev(x)
        if not isinstance(xv, torch.Tensor):
            return None
        hits = [(xv.ndim - 1 - k, pad[2 * k], pad[2 * k + 1]) for k in range(len(pad) // 2)
                if (pad[2 * k], pad[2 * k + 1]) != (0, 0)]
        if len(hits) != 1 or hits[0][1] < 1 or hits[0][1] >= xv.shape[hits[0][0]]:
            return None
        d, lo, hi = hits[0]
        if hi == -lo:
            return x, node, lo, d, value, []
        if hi == 0 and len(node.users) == 1 and _drops_last(next(iter(node.users)), d, lo):
            return x, next(iter(node.users)), lo, d, value, [node]
        return None
    m = cat_pair(node) if node.op == "call_function" and node.target in (torch.cat, torch.concat) else None
    if m is None:
        return None
    first, sliced, dim = m
    if not (sliced.op == "call_function" and sliced.target is operator.getitem and isinstance(sliced.args[0], fx.Node)):
        return None
    x, xv = sliced.args[0], _ev(sliced.args[0])
    if not isinstance(xv, torch.Tensor) or xv.ndim == 0:  # NB: cat([l1[None], l2[None]]) of 0-dim losses
        return None
    d = dim % xv.ndim
    p = xv.shape[d] - (_ev(sliced).shape[d] if isinstance(_ev(sliced), torch.Tensor) else xv.shape[d])
    if p < 1 or not _drops_last(sliced, d, p):
        return None
    shape = list(xv.shape)
    shape[d] = p
    fill = _fill_of(first, shape)
    if fill is None:
        return None
    dead = [sliced, first] + ([first.args[0]] if first.args and isinstance(first.args[0], fx.Node)
                              and first.args[0].op == "call_function" else [])
    return x, node, p, d, fill, dead


def canonicalize_token_shifts(gm: fx.GraphModule) -> int:
    """Rewrite fixed-width shifts along one dim with a constant fill (``F.pad(x, (0, 0, p, -p))``,
    ``F.pad(x, (0, 0, p, 0))[:, :-p]``, ``cat([zeros_like(x[:, :p]), x[:, :-p]], 1)``) to
    ``shift_steps(x, p, dim, fill)`` in place; returns how many.  One-step shifts of ``linear_scan`` outputs are
    left to :func:`canonicalize_shifts` (previous-state readouts that read the scan's carry)."""
    from ...kernels.shift import shift_steps
    done = 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node.op != "call_function":
            continue
        m = _token_shift(node)
        if m is None:
            continue
        x, out, p, d, fill, dead = m
        if is_linear_scan(x) and p == 1:
            continue
        ov, xv = _ev(out), _ev(x)
        if not isinstance(ov, torch.Tensor) or tuple(ov.shape) != tuple(xv.shape):
            continue
        g = gm.graph
        with g.inserting_before(out):
            new = g.call_function(shift_steps, (x, p, d, fill))
        new.meta["example_value"] = ov
        new.meta[PROVENANCE] = {"pass": "canonical_shifts", "from": out.name}
        out.replace_all_uses_with(new)
        g.erase_node(out)
        for n in dead:
            if not n.users:
                g.erase_node(n)
        done += 1
    return rewritten(gm, done, log, "adjoint-compile: %d token shift(s) rewritten to shift_steps")
