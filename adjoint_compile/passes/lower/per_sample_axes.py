"""Refusals of parameter uses whose examples' axis is not where per-example book-keeping needs it (``per_sample_clip``);
the axis itself is followed by analysis/batch_axes.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...analysis.batch_axes import broadcast_over_examples, moved_batch_axes, permutation, use_name
from ...analysis.fx import example_value, source_at
from ...errors import PerSampleError

__all__ = ["permutation", "moved_batch_axes", "broadcast_over_examples", "check_batched", "refuse", "use_name",
           "origin"]

def refuse(n: fx.Node, why: str) -> PerSampleError:
    return PerSampleError(f"adjoint-compile per_sample_clip: {use_name(n)} ({n.name}) {why}; at {source_at(n)}")


def check_batched(n: fx.Node, a: fx.Node, bd: int, batch: int, output: bool = True) -> None:
    """Raise :class:`PerSampleError` unless ``a`` (and, with ``output``, n's output) has the examples on axis ``bd``."""
    for what, v in (("its input " + a.name, example_value(a)), ("its output", example_value(n)))[:2 if output else 1]:
        if not (isinstance(v, torch.Tensor) and v.dim() > bd and int(v.shape[bd]) == batch):
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            where = f"axis {bd}, where its input has them" if what == "its output" else f"axis {bd}"
            raise refuse(n, f"uses a parameter, but {what} {shape} does not carry the {batch} examples on {where}"
                            f"{'' if isinstance(v, torch.Tensor) else ' (not one tensor)'}: its gradient cannot be "
                            f"attributed to examples")


def origin(n: fx.Node, kind_of: dict[fx.Node, str]) -> str:
    """Where the reduction over the batch that ``n`` reads was made (for the refusal's message)."""
    while any(kind_of.get(a) in ("R", "D") for a in n.all_input_nodes):
        n = next(a for a in n.all_input_nodes if kind_of.get(a) in ("R", "D"))
    return f"{use_name(n)} ({n.name}) at {source_at(n)}"
