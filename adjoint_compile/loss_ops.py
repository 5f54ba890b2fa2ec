"""``linear_cross_entropy`` as a torch.library custom op: the vocabulary head and cross-entropy of rows of hidden
states in one graph node, forward and backward, that never keeps the [N, V] logits.

    loss, lse = adjoint_compile.loss_ops.linear_cross_entropy(h, weight, bias, target, ignore_index=-100,
                                                              label_smoothing=0.0, impl=None)

For h [N, D], weight [V, D], bias [V] or None and target [N] (int64): with z = h Wᵀ + b,
``loss = F.cross_entropy(z, target, ignore_index=..., label_smoothing=..., reduction="none")`` and
``lse = torch.logsumexp(z, -1)``, both [N] in fp32 (fp64 for fp64 inputs). The logits are made in the compute dtype
and not rounded to the inputs' (for half inputs: like an upcast ``.float()`` before the loss, finer than eager
without it). The backward recomputes the logits from h, W, b and the kept lse (:mod:`.kernels.linear_ce`).

Ops (the contract the loss rewrite codes against):

* ``torch.ops.adjoint_compile.linear_cross_entropy.default``
  ``(Tensor h, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, str? impl)
  -> (Tensor loss, Tensor lse)``
* ``torch.ops.adjoint_compile.linear_cross_entropy_backward.default``
  ``(Tensor? g_loss, Tensor? g_lse, Tensor h, Tensor weight, Tensor? bias, Tensor target, Tensor lse,
  int ignore_index, float label_smoothing, str? impl, bool need_weight=True) -> (Tensor, Tensor, Tensor)``: (∂h,
  ∂weight, ∂bias; an empty tensor without bias, and both empty without ``need_weight``: a frozen head). Double
  backward is not supported.

A target outside [0, V) that is not ``ignore_index`` raises on the reference path, as eager does; the kernels give
a NaN loss for its row instead (a check would synchronize the GPU).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels import linear_ce as _lce

__all__ = ["linear_cross_entropy"]


@torch.library.custom_op(
    "adjoint_compile::linear_cross_entropy", mutates_args=(),
    schema="(Tensor h, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
           "str? impl) -> (Tensor, Tensor)")
def _lce_op(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            label_smoothing: float, impl: Optional[str]) -> tuple[Tensor, Tensor]:
    return _lce.lce_forward(h, weight, bias, target, ignore_index, label_smoothing, impl)


@_lce_op.register_fake
def _lce_fake(h, weight, bias, target, ignore_index, label_smoothing, impl):
    acc = _lce.acc_dtype(h)
    return h.new_empty(h.shape[:1], dtype=acc), h.new_empty(h.shape[:1], dtype=acc)


@torch.library.custom_op(
    "adjoint_compile::linear_cross_entropy_backward", mutates_args=(),
    schema="(Tensor? g_loss, Tensor? g_lse, Tensor h, Tensor weight, Tensor? bias, Tensor target, Tensor lse, "
           "int ignore_index, float label_smoothing, str? impl, bool need_weight=True) -> (Tensor, Tensor, Tensor)")
def _lce_backward_op(g_loss: Optional[Tensor], g_lse: Optional[Tensor], h: Tensor, weight: Tensor,
                     bias: Optional[Tensor], target: Tensor, lse: Tensor, ignore_index: int, label_smoothing: float,
                     impl: Optional[str], need_weight: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    dh, dw, db = _lce.lce_backward(g_loss, g_lse, h, weight, bias, target, lse, ignore_index, label_smoothing,
                                   impl, need_weight)
    return dh, (h.new_empty(0) if dw is None else dw), (h.new_empty(0) if db is None else db)


@_lce_backward_op.register_fake
def _lce_backward_fake(g_loss, g_lse, h, weight, bias, target, lse, ignore_index, label_smoothing, impl,
                       need_weight=True):
    return (torch.empty_like(h), torch.empty_like(weight) if need_weight else h.new_empty(0),
            h.new_empty(0) if bias is None or not need_weight else torch.empty_like(bias))


def _setup_context(ctx, inputs, output):
    h, weight, bias, target, ignore_index, label_smoothing, impl = inputs
    ctx.args = (ignore_index, label_smoothing, impl)
    ctx.save_for_backward(h, weight, bias, target, output[1])


def _backward(ctx, g_loss, g_lse):
    h, weight, bias, target, lse = ctx.saved_tensors
    # NB: a frozen head (no gradient for its weight or bias) skips the products that make them
    need_weight = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    dh, dw, db = torch.ops.adjoint_compile.linear_cross_entropy_backward.default(
        g_loss, g_lse, h, weight, bias, target, lse, *ctx.args, need_weight)
    return (dh, dw if need_weight else None, db if bias is not None and need_weight else None,
            None, None, None, None)


_lce_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """(loss [N], lse [N]) of ``F.linear(h, weight, bias)`` and cross-entropy against ``target``, without keeping
    the logits (module docstring). Checks the arguments' shapes and dtypes."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: h [N, D] and weight [V, D] expected, got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias [V={weight.shape[0]}] expected, got {tuple(bias.shape)}")
    if target.shape != h.shape[:1] or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: target [N={h.shape[0]}] of class indices expected, got "
                         f"{tuple(target.shape)} {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing={label_smoothing} is not in [0, 1]")
    return torch.ops.adjoint_compile.linear_cross_entropy.default(
        h, weight, bias, target.long(), int(ignore_index), float(label_smoothing), impl)
