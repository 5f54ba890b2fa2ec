"""Dropout in a graph with recurrences to shard, rewritten so that a shard's recomputation sees the same mask.

Before::

    y = torch.nn.functional.dropout(x, 0.1, True, False)

After (one seed per graph call, drawn from torch's default generator)::

    dropout_seed = adjoint_compile.kernels.random.new_seed()
    y = adjoint_compile.kernels.random.hashed_dropout(x, 0.1, True, dropout_seed, stream=0)   # the k-th: stream=k

``hashed_dropout``'s mask is a hash of the seed and each element's position in the full-length tensor
(kernels/random.py), so the time-local analysis treats it as elementwise and the sharded runtime passes each
shard's first step. Dropouts that are off (``training=False`` or ``p == 0``), in-place, or of another kind
(``dropout2d``, ``alpha_dropout``, ...) are left as they are. New nodes carry
``meta["adjoint_compile"] = {"pass": "seeded_dropout", "from": <node>}``.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...regions import PROVENANCE
from ...kernels.random import hashed_dropout, new_seed

log = logging.getLogger(__name__)

__all__ = ["seed_dropouts"]


def _spec(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(input, p) of an active, out-of-place ``F.dropout`` / ``torch.dropout`` call, or None."""
    if node.op != "call_function" or node.target not in (F.dropout, torch.dropout):
        return None
    # NB: torch.dropout's flag is ``train``, with no default; F.dropout's is ``training``, True by default
    flag = "train" if node.target is torch.dropout else "training"
    names = ("input", "p", "training", "inplace") if node.target is not torch.dropout else ("input", "p", "train")
    vals: dict = {"p": 0.5, "training": True, "inplace": False} if flag == "training" else {}
    vals.update(zip(names, node.args))
    vals.update(node.kwargs)
    training = vals.get(flag)
    x, p = vals.get("input"), vals.get("p")
    if not isinstance(x, fx.Node) or not isinstance(p, (int, float)) or training is not True or vals.get("inplace"):
        return None
    return (x, float(p)) if 0 < p < 1 else None


def seed_dropouts(gm: fx.GraphModule) -> int:
    """Rewrite the active dropouts of ``gm`` in place (see the module docstring); returns how many."""
    found = [(n, spec) for n in gm.graph.nodes if (spec := _spec(n)) is not None]
    if not found:
        return 0
    g = gm.graph
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        seed = g.call_function(new_seed, ())
    seed.meta[PROVENANCE] = {"pass": "seeded_dropout"}
    ev = found[0][0].meta.get("example_value")
    with getattr(ev, "fake_mode", None) or contextlib.nullcontext():
        seed.meta["example_value"] = torch.empty((), dtype=torch.int64)
    for k, (n, (x, p)) in enumerate(found):
        # NB: a stream each: dropouts of one seed would otherwise share a mask wherever their shapes match (every
        # step of an unrolled loop, two layers of one width)
        with g.inserting_before(n):
            new = g.call_function(hashed_dropout, (x, p, True, seed), {"stream": k})
        new.meta = {**n.meta, PROVENANCE: {"pass": "seeded_dropout", "from": n.name}}
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    log.debug("adjoint-compile: %d dropout(s) rewritten to hashed_dropout", len(found))
    return len(found)
