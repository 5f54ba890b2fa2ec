"""A reverse ``linear_scan`` as a forward one over the flipped steps, so that it is sharded and truncated as a
Python loop over ``reversed(range(T))`` is (the loop roller writes that loop in this form).

h_t = a_t ⊙ h_{t+1} + b_t (h_T = h0) is the forward scan of the reversed steps, read back reversed::

    before:  h = linear_scan(a, b, h0, dim, True, None, impl)
    after:   h = flip(linear_scan(flip(a, [dim]), flip(b, [dim]), h0, dim, False, None, impl), [dim])

Exact, value for value (the same products and sums in the same order). The flips mix steps, so they bound the
scan's region as the roller's do. A windowed reverse scan is left as written (its window counts from the other end).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ...analysis.fx import SCAN_ARGS, example_value, is_linear_scan, scan_args
from ...regions import PROVENANCE
from .batching import _fake_mode

log = logging.getLogger(__name__)

__all__ = ["forward_reverse_scans"]


def forward_reverse_scans(gm: fx.GraphModule) -> int:
    """Rewrite every reverse, unwindowed ``linear_scan`` of ``gm`` in place (module docstring); how many."""
    done = 0
    mode = None
    for n in list(gm.graph.nodes):
        if not is_linear_scan(n):
            continue
        args = scan_args(n)
        if not args["reverse"] or args["window"] is not None or not isinstance(args["dim"], int):
            continue
        mode = mode or _fake_mode(gm)
        prov = {"pass": "reverse_scans", "from": n.name}
        with gm.graph.inserting_before(n):
            fa, fb = (_flip(gm, args[k], args["dim"], prov, mode, n) for k in ("a", "b"))
            scan = gm.graph.call_function(n.target, tuple({**args, "a": fa, "b": fb, "reverse": False}[k]
                                                          for k in SCAN_ARGS))
        scan.meta = {**n.meta, PROVENANCE: prov}
        with gm.graph.inserting_after(scan):
            out = _flip(gm, scan, args["dim"], prov, mode, n)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
        log.debug("reverse_scans: %d reverse linear_scan(s) written as forward scans of the flipped steps", done)
    return done


def _flip(gm: fx.GraphModule, x: fx.Node, dim: int, prov: dict, mode, scan: fx.Node) -> fx.Node:
    f = gm.graph.call_function(torch.flip, (x, [dim]))
    f.meta = {k: v for k, v in scan.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")}
    with mode:
        f.meta["example_value"] = torch.flip(example_value(x), [dim])
    f.meta[PROVENANCE] = dict(prov)
    return f
