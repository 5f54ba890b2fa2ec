"""Helpers shared by the pass-level tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import torch


def grab_graph(fn, *args, dynamic=False):
    """The one dynamo graph of ``fn(*args)`` (fullgraph) and the example inputs dynamo passed with it."""
    got = []

    def grab(gm, ex):
        got.append((gm, ex))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True, dynamic=dynamic)(*args)
    assert len(got) == 1
    return got[0]


def trace(fn, *args, dynamic=False):
    """The dynamo graph of ``fn(*args)``."""
    return grab_graph(fn, *args, dynamic=dynamic)[0]
