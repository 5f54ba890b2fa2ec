"""Linear-scan kernels (DESIGN.md §5): h_t = a_t ⊙ h_{t∓1} + b_t, full or windowed, forward or reverse.

Four implementations with one signature ``f(a, b, h0, dim, reverse, window)``:

* :func:`naive_scan`: the per-step loop, the spec (differentiable by autograd; slow).
* :func:`scan_ref`: the blocked torch reference, exact in fp32; the CPU path when no C compiler is found.
* :func:`scan_cpu`: a compiled C loop (:mod:`.cpu`), tested against the reference; the CPU path by default
  (per-op overhead of the reference dominates the short shard scans of the adjoint-sharded backward).
* :func:`scan_triton`: the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``); imported lazily.

Backward: :func:`scan_backward_ref` / :func:`scan_backward_cpu` / :func:`scan_backward_triton`
``(grad, a, b, h0, h, dim, reverse, window)`` return (∂a, ∂b, ∂h0) in the compute dtype. :func:`scan` and
:func:`scan_backward` are the one place that picks an implementation (``impl`` None / "triton" / "cpu" /
"reference").
"""
from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from . import cpu as _cpu
from .cpu import scan_backward_cpu, scan_cpu
from .ref import is_complex_scan, naive_scan, out_dtype, scan_backward_ref, scan_ref

log = logging.getLogger(__name__)

IMPLS = (None, "triton", "cpu", "reference")

__all__ = ["naive_scan", "scan_ref", "scan_cpu", "scan_triton", "scan_backward_ref", "scan_backward_cpu",
           "scan_backward_triton", "scan",
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
    """``impl`` → "triton", "cpu" or "reference". None means Triton for CUDA tensors (when installed), the compiled
    C kernel for CPU tensors (when a C compiler is found), else the reference.

    Raises ValueError for an unknown ``impl``, "triton" on a CPU tensor without ``TRITON_INTERPRET=1``, or "cpu"
    on a non-CPU tensor or without the kernel.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of None, 'triton', 'cpu', 'reference'; got {impl!r}")
    if impl is None:
        if device.type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device.type == "cpu" and _cpu.available() else "reference"
    if impl == "cpu":
        if device.type != "cpu":
            raise ValueError(f"impl='cpu' needs CPU tensors, got {device.type} ones")
        if not _cpu.available():
            raise ValueError(f"impl='cpu': the compiled CPU kernel is unavailable ({_cpu.why_unavailable()})")
    if impl == "triton":
        if not triton_available():
            raise ValueError("impl='triton' needs the triton package, which is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError(f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                             "(set before triton kernels are first used); use impl='reference' or CUDA tensors")
    return impl


def _which(impl: str | None, *xs: Tensor | None) -> str:
    """The implementation for these tensors: :func:`resolve_impl`, except that complex scans (any complex input)
    always run the torch reference (the C and Triton kernels are real-only)."""
    a = xs[0]
    if is_complex_scan(*xs):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of None, 'triton', 'cpu', 'reference'; got {impl!r}")
        return "reference"
    return resolve_impl(impl, a.device)


def scan(a: Tensor, b: Tensor, h0: Tensor | None, dim: int, reverse: bool, window: int | None,
         impl: str | None) -> Tensor:
    """Forward dispatch: a new contiguous h of ``a``'s shape in ``promote_types(a.dtype, b.dtype)`` (complex when
    ``h0`` alone is complex)."""
    which = _which(impl, a, b, h0)
    if which == "triton":
        return scan_triton(a, b, h0, dim, reverse, window).contiguous()
    if which == "cpu":
        return scan_cpu(a, b, h0, dim, reverse, window)
    return scan_ref(a, b, h0, dim, reverse, window)


def scan_backward(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None, dim: int,
                  reverse: bool, window: int | None, impl: str | None):
    """Backward dispatch: (∂a, ∂b, ∂h0) in the compute dtype."""
    which = _which(impl, a, grad, b, h0, h)
    if which == "triton":
        return scan_backward_triton(grad, a, b, h0, h, dim, reverse, window)
    if which == "cpu":
        return scan_backward_cpu(grad, a, b, h0, h, dim, reverse, window)
    return scan_backward_ref(grad, a, b, h0, h, dim, reverse, window)
