"""Refusals of parameter uses whose examples' axis is not where per-example book-keeping needs it, and of ops that
reduce or work along that axis (``per_sample_clip``); the axis itself is followed by analysis/batch_axes.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...analysis.batch_axes import BatchAxes, broadcast_over_examples, moved_batch_axes, permutation, use_name
from ...analysis.fx import example_value, is_linear_scan, source_at
from ...errors import PerSampleError

__all__ = ["permutation", "moved_batch_axes", "BatchAxes", "broadcast_over_examples", "check_batched", "refuse",
           "use_name", "origin", "reduction", "combines_examples", "REDUCTIONS", "NONLINEAR_REDUCTIONS", "ALONG",
           "LOSSES", "BROADCASTING"]

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
    d = n.kwargs.get("dim", n.kwargs.get("axis", n.kwargs.get("dims")))
    at = 2 if use_name(n) == "roll" else 1  # NB: roll(shifts, dims)
    if d is None and len(n.args) > at and isinstance(n.args[at], (int, tuple, list)) and not isinstance(n.args[at], bool):
        d = n.args[at]
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
    if name == "embedding" and bool(n.args[5] if len(n.args) > 5 else n.kwargs.get("scale_grad_by_freq", False)):
        return "mix"  # NB: each row's gradient divided by its count in the whole batch
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


#: ops of several operands that broadcast them against each other, element by element
BROADCASTING = frozenset("add sub mul div truediv floordiv remainder pow where maximum minimum fmax fmin atan2 lerp "
                         "addcmul addcdiv masked_fill copysign hypot eq ne lt le gt ge logical_and logical_or "
                         "logical_xor bitwise_and bitwise_or bitwise_xor clamp clip xlogy __add__ __sub__ __mul__ "
                         "__truediv__ __radd__ __rsub__ __rmul__ __rtruediv__ __pow__ __and__ __or__ __xor__ iadd isub "
                         "imul itruediv complex polar logaddexp logaddexp2".split())
#: element-wise over broadcast operands, reduced along ``dim`` (arg 2; default): per example unless dim is theirs
PAIRWISE = {"cosine_similarity": 1, "pairwise_distance": -1, "vecdot": -1}
#: ops whose second operand gives a shape or dtype only
SHAPE_ONLY = frozenset("expand_as view_as reshape_as type_as broadcast_to new_zeros new_ones new_empty new_full "
                       "zeros_like ones_like empty_like".split())
#: products whose leading axes are batch axes (the last two are the matrices')
BATCHED_PRODUCTS = frozenset("matmul bmm baddbmm mm __matmul__ scaled_dot_product_attention cdist inner outer kron "
                             "tensordot".split())
#: ops that place the examples' axis of their operands themselves (analysis/batch_axes.py), or along one axis
PLACED = frozenset("cat concat concatenate stack einsum gather take_along_dim".split())


def combines_examples(n: fx.Node, acts: set[fx.Node], axes: BatchAxes) -> str | None:
    """Why ``n``, an op of two or more example values, would make examples meet (each output entry reading several
    examples: ``h @ h.T``, a contrastive loss's logits, ``cdist(h, h)``, ``h * h[perm]``), or None when their examples
    line up: element-wise ops with the examples' axes on one output axis, products batched over them, stacks, cats,
    einsums and gathers that place them on one axis, any other op (a loss, an index) with them on one axis of every
    operand."""
    every: list[fx.Node] = []  # NB: each operand as often as it is one (``einsum("bd,cd->bc", h, h)``)
    fx.node.map_arg((n.args, n.kwargs), every.append)
    ins = [a for a in every if a in acts and isinstance(example_value(a), torch.Tensor)]
    out = example_value(n)
    if len(ins) < 2 or n.op == "call_module" or is_linear_scan(n) or not isinstance(out, torch.Tensor):
        return None
    name, at = use_name(n).rstrip("_"), [axes(a) for a in ins]  # NB: in place (``masked_fill_``) alike
    if name in SHAPE_ONLY:
        return None
    if None in at:
        return "an operand whose examples' axis is not known"
    right = {k + out.dim() - example_value(a).dim() for a, k in zip(ins, at)}
    if name in BROADCASTING:
        return None if len(right) == 1 else "operands whose examples' axes do not line up"
    if name in PAIRWISE:  # NB: the operands broadcast to nd axes, then reduced along dim
        d = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", PAIRWISE[name])
        nd = max(example_value(a).dim() for a in ins)
        aligned = {k + nd - example_value(a).dim() for a, k in zip(ins, at)}
        along = not isinstance(d, int) or d % nd in aligned
        return None if len(aligned) == 1 and not along else "operands compared along the examples' axis"
    if name in BATCHED_PRODUCTS:
        batch_axes = all(k < example_value(a).dim() - 2 for a, k in zip(ins, at))
        return None if len(right) == 1 and batch_axes else "a product over the examples' axis"
    if name in PLACED:
        return None if axes(n) is not None else "operands whose examples' axes do not line up"
    # NB: losses and any other op: the examples on one axis of every operand (``h[arange(B), last]``, a triplet loss)
    return None if len(set(at)) == 1 else "operands whose examples' axes differ"
