"""The vocabulary head and cross-entropy fused, so that the [N, V] logits are never kept (see :mod:`.ref` for the
math): loss_n and lse_n of z_n = W h_n + b, and their backward from lse alone.

Two implementations with one signature each:

* :func:`lce_forward_ref` / :func:`lce_backward_ref`: torch, a block of rows of logits at a time; the spec, and the
  path wherever the kernels do not run.
* :func:`lce_forward_triton` / :func:`lce_backward_triton`: Triton kernels that make each tile of logits in
  registers (CUDA, or CPU under ``TRITON_INTERPRET=1``); imported lazily.

:func:`lce_forward` and :func:`lce_backward` are the one place that picks (``impl`` None / "triton" / "reference"):
by default the kernels on CUDA for fp32 / bf16 / fp16 inputs with a hidden size of at most 256, the reference
otherwise. Where the default's kernels fail (a Triton that cannot compile them), it warns once and runs the reference
from then on.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import Tensor

from ...errors import AdjointCompileWarning
from ..scan import triton_available

from .ref import ROWS, acc_dtype, check_targets, lce_backward_ref, lce_forward_ref

__all__ = ["lce_forward", "lce_backward", "lce_forward_ref", "lce_backward_ref", "kernel_serves", "IMPLS",
           "acc_dtype", "check_targets", "ROWS"]

IMPLS = (None, "triton", "reference")

log = logging.getLogger(__name__)

#: the largest hidden size the kernels take (here, so that asking does not import Triton)
MAX_D = 256

#: why the kernels failed once where the default picked them (the reference runs from then on), or None
KERNEL_FAILED: str | None = None


def _triton():
    from . import triton as _t  # NB: lazy: Triton decides interpreted-or-compiled at import (see kernels/scan)
    return _t


def kernel_serves(h: Tensor, weight: Tensor) -> bool:
    """Whether the default picks the Triton kernels for these inputs (CUDA, fp32 / bf16 / fp16, D ≤ 256)."""
    if h.device.type != "cuda" or h.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return h.shape[-1] <= MAX_D and triton_available()


def _use_triton(h: Tensor, weight: Tensor, impl: str | None) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "triton":
        if h.dtype == torch.float64 or h.shape[-1] > MAX_D:
            raise ValueError(f"impl='triton': the kernels take fp32 / bf16 / fp16 inputs with a hidden size of at "
                             f"most {MAX_D} (got {h.dtype}, {h.shape[-1]})")
        if h.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError(f"impl='triton' on {h.device.type} tensors needs TRITON_INTERPRET=1 (set before Triton is "
                             f"imported) or CUDA tensors")
        return True
    return impl is None and KERNEL_FAILED is None and kernel_serves(h, weight)


def _failed(e: Exception) -> None:
    # NB: the default picked the kernels: a machine where they do not compile still trains, on the reference, said
    global KERNEL_FAILED
    KERNEL_FAILED = f"{type(e).__name__}: {e}"
    log.warning("adjoint-compile: the fused head + cross-entropy kernels failed (%s); the torch reference runs instead",
                KERNEL_FAILED)
    warnings.warn(AdjointCompileWarning(f"adjoint-compile: the fused head + cross-entropy kernels failed "
                                        f"({KERNEL_FAILED[:300]}); the torch reference runs instead"), stacklevel=3)


def lce_forward(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int = -100,
                label_smoothing: float = 0.0, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """(loss [N], lse [N]) for h [N, D], weight [V, D], bias [V] or None, target [N] (int64)."""
    if _use_triton(h, weight, impl):
        try:
            return _triton().lce_forward_triton(h, weight, bias, target, ignore_index, label_smoothing)
        except Exception as e:  # noqa: BLE001 - any failure of a kernel the default picked: said, then the reference
            if impl is not None:
                raise
            _failed(e)
    return lce_forward_ref(h, weight, bias, target, ignore_index, label_smoothing)


def lce_backward(g_loss: Tensor | None, g_lse: Tensor | None, h: Tensor, weight: Tensor, bias: Tensor | None,
                 target: Tensor, lse: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                 impl: str | None = None, need_weight: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(∂h, ∂weight, ∂bias) for the cotangents of loss and lse (None: zero); ``need_weight=False`` (a frozen head)
    gives (∂h, None, None) without the products that make ∂weight."""
    if _use_triton(h, weight, impl):
        try:
            return _triton().lce_backward_triton(g_loss, g_lse, h, weight, bias, target, lse, ignore_index,
                                                 label_smoothing, need_weight)
        except Exception as e:  # noqa: BLE001 - as in lce_forward
            if impl is not None:
                raise
            _failed(e)
    return lce_backward_ref(g_loss, g_lse, h, weight, bias, target, lse, ignore_index, label_smoothing, need_weight)
