"""Refusals of parameter uses whose examples' axis is not where per-example book-keeping needs it, and of ops that
reduce or work along that axis (``per_sample_clip``); the axis itself is followed by analysis/batch_axes.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...analysis.batch_axes import BatchAxes, broadcast_over_examples, moved_batch_axes, permutation, use_name
from ...analysis.fx import example_value, source_at
from ...errors import PerSampleError

__all__ = ["permutation", "moved_batch_axes", "BatchAxes", "broadcast_over_examples", "check_batched", "refuse",
           "use_name", "origin", "reduction", "REDUCTIONS", "NONLINEAR_REDUCTIONS", "ALONG", "LOSSES"]

#: linear reductions: over the batch axis (or over everything) they make an ``R`` value, a sum of per-example terms
REDUCTIONS = frozenset("sum mean nansum nanmean".split())
#: reductions that are not linear: over the batch axis the loss is no longer a sum of per-example losses
NONLINEAR_REDUCTIONS = frozenset("amax amin max min prod std var logsumexp norm var_mean std_mean median all any "
                                 "count_nonzero".split())
#: ops along one axis that mix examples when the axis is the batch axis
ALONG = frozenset("softmax log_softmax cumsum cumprod logcumsumexp sort argsort topk cummax cummin flip roll".split())
#: in-graph losses: with reduction "mean" or "sum" they reduce over the batch
LOSSES = frozenset("cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
                   "binary_cross_entropy_with_logits kl_div".split())


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


def _dims(n: fx.Node, ndim: int) -> tuple[int, ...] | None:
    """The axes a reduction / along-axis op works on (None: all of them)."""
    d = n.kwargs.get("dim", n.kwargs.get("axis"))
    if d is None and len(n.args) > 1 and isinstance(n.args[1], (int, tuple, list)) and not isinstance(n.args[1], bool):
        d = n.args[1]
    if d is None:
        return None
    ds = d if isinstance(d, (tuple, list)) else (d,)
    return tuple(x % ndim for x in ds if isinstance(x, int)) if ndim else ()


def reduction(n: fx.Node, kind_of: dict[fx.Node, str], bd: int, axes: BatchAxes | None = None) -> str | None:
    """"R" when ``n`` reduces an example value over the examples' axis, "mix" for an along-axis op on it, else None.
    The axis is ``bd``, or where ``axes`` followed it (a value transposed or stacked); where it is not known, a sum
    over any axis counts as one over the examples, and a nonlinear reduction or along-axis op over any axis mixes."""
    if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if kind_of.get(n.args[0]) not in ("A", "M"):
        return None
    bd = axes(n.args[0]) if axes is not None else bd
    name, x = use_name(n), example_value(n.args[0])
    ndim = x.dim() if isinstance(x, torch.Tensor) else 0
    if name in LOSSES:
        red = n.kwargs.get("reduction", next((a for a in n.args if a in ("none", "mean", "sum")), "mean"))
        return "R" if red != "none" else None
    if name == "batch_norm" and bool(n.args[5] if len(n.args) > 5 else n.kwargs.get("training", False)):
        return "mix"
    if name in REDUCTIONS | NONLINEAR_REDUCTIONS and not (len(n.args) > 1 and isinstance(n.args[1], fx.Node)):
        dims = _dims(n, ndim)
        over_batch = dims is None or bd is None or bd in dims
        return None if not over_batch else "R" if name in REDUCTIONS else "mix"
    if name in ALONG:
        dims = _dims(n, ndim)
        if dims is None:  # NB: no dim given: sort / topk / softmax work along the last axis, roll / flip along all
            dims = tuple(range(ndim)) if name in ("roll", "flip") else (ndim - 1,) if ndim else ()
        return "mix" if bd is None or bd in dims else None
    return None
