"""Linear-scan kernels (DESIGN.md §5): h_t = a_t ⊙ h_{t∓1} + b_t, full or windowed, forward or reverse.

Three implementations with one signature ``f(a, b, h0, dim, reverse, window)``:

* :func:`naive_scan`: the per-step loop, the spec (differentiable by autograd; slow).
* :func:`scan_ref`: the blocked torch reference, exact in fp32 and the CPU path.
* :func:`scan_triton`: the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``); imported lazily.

Backward: :func:`scan_backward_ref` / :func:`scan_backward_triton` ``(grad, a, b, h0, h, dim, reverse, window)``
return (∂a, ∂b, ∂h0) in the compute dtype. :func:`scan` and :func:`scan_backward` are the one place that picks
an implementation (``impl`` None / "triton" / "reference").
"""
from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from .ref import naive_scan, scan_backward_ref, scan_ref

log = logging.getLogger(__name__)

IMPLS = (None, "triton", "reference")

__all__ = ["naive_scan", "scan_ref", "scan_triton", "scan_backward_ref", "scan_backward_triton", "scan",
           "scan_backward", "resolve_impl", "IMPLS"]


def _triton_module():
    # NB: lazy, because Triton decides interpreted-or-compiled when a kernel is decorated, i.e. at import:
    # importing on first use lets a test set TRITON_INTERPRET=1 first, and CPU-only users never import Triton.
    from . import triton as _t
    return _t


def scan_triton(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1, reverse: bool = False,
                window: int | None = None) -> Tensor:
    """The linear scan with Triton kernels (see :func:`.triton.scan_triton`)."""
    return _triton_module().scan_triton(a, b, h0, dim, reverse, window)


def scan_backward_triton(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None,
                         dim: int = 1, reverse: bool = False, window: int | None = None):
    """Gradients with Triton kernels (see :func:`.triton.scan_backward_triton`)."""
    return _triton_module().scan_backward_triton(grad, a, b, h0, h, dim, reverse, window)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """``impl`` → "triton" or "reference": None means Triton for CUDA tensors (when installed), else reference.

    Raises ValueError for an unknown ``impl``, or "triton" on a CPU tensor without ``TRITON_INTERPRET=1``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of None, 'triton', 'reference'; got {impl!r}")
    if impl is None:
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if impl == "triton":
        if not triton_available():
            raise ValueError("impl='triton' needs the triton package, which is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError(f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                             "(set before triton kernels are first used); use impl='reference' or CUDA tensors")
    return impl


def scan(a: Tensor, b: Tensor, h0: Tensor | None, dim: int, reverse: bool, window: int | None,
         impl: str | None) -> Tensor:
    """Forward dispatch: a new contiguous h of ``a``'s shape in ``promote_types(a.dtype, b.dtype)``."""
    if resolve_impl(impl, a.device) == "triton":
        return scan_triton(a, b, h0, dim, reverse, window).contiguous()
    return scan_ref(a, b, h0, dim, reverse, window)


def scan_backward(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None, dim: int,
                  reverse: bool, window: int | None, impl: str | None):
    """Backward dispatch: (∂a, ∂b, ∂h0) in the compute dtype."""
    if resolve_impl(impl, a.device) == "triton":
        return scan_backward_triton(grad, a, b, h0, h, dim, reverse, window)
    return scan_backward_ref(grad, a, b, h0, h, dim, reverse, window)
