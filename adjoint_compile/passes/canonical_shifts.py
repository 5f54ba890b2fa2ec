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

from ..analysis.fx import example_value as _ev
from ..analysis.fx import is_linear_scan, scan_args
from ..analysis.time_local import drops_last_step
from ..regions import PROVENANCE

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


def canonicalize_shifts(gm: fx.GraphModule) -> int:
    """Rewrite pad-style previous-state readouts of ``linear_scan`` outputs in place; returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
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
    if done:
        gm.graph.lint()
        gm.recompile()
        log.debug("adjoint-compile: %d pad-style previous-state readout(s) rewritten to cat([first, h[:-1]])", done)
    return done

