"""``linear_scan`` as a torch.library custom op: one graph node under torch.compile, forward and backward.

    h = adjoint_compile.ops.linear_scan(a, b, h0=None, *, dim=1, reverse=False, window=None, impl=None)

Math (0-indexed steps t along ``dim``): h_t = a_t ⊙ h_{t-1} + b_t with h_{-1} = h0; ``reverse=True``:
h_t = a_t ⊙ h_{t+1} + b_t with h_T = h0. ``window=W``: only the last W inputs count,
h_t = Σ_{i=t-W+1..t} (Π_{j=i+1..t} a_j) ⊙ b_i, h0 being the input at index -1 (mirrored for reverse);
W > T (or W >= T without h0) is the full scan.

Ops (the contract other passes code against):

* ``torch.ops.adjoint_compile.linear_scan.default``
  ``(Tensor a, Tensor b, Tensor? h0, int dim, bool reverse, int? window, str? impl) -> Tensor``
* ``torch.ops.adjoint_compile.linear_scan_backward.default``
  ``(Tensor grad, Tensor a, Tensor? b, Tensor? h0, Tensor? h, int dim, bool reverse, int? window, str? impl,
  ScalarType b_dtype) -> (Tensor, Tensor, Tensor)``: (∂a, ∂b, ∂h0), the whole backward as one node
  (a shifted scan in the other direction, DESIGN.md §3). It needs ``h`` (the output) for the full scan and ``b``
  for windows; double backward is not supported.

Both have fake implementations that allocate contiguous outputs of the input's shape, so dynamo and
aot_autograd keep them whole and symbolic shapes are not specialised.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from .kernels import scan as _scan

log = logging.getLogger(__name__)

__all__ = ["linear_scan", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _drop(shape, d: int) -> list:
    return list(shape[:d]) + list(shape[d + 1:])


@torch.library.custom_op(
    "adjoint_compile::linear_scan", mutates_args=(),
    schema="(Tensor a, Tensor b, Tensor? h0, int dim, bool reverse, int? window, str? impl) -> Tensor")
def _linear_scan(a: Tensor, b: Tensor, h0: Optional[Tensor], dim: int, reverse: bool, window: Optional[int],
                 impl: Optional[str]) -> Tensor:
    return _scan.scan(a, b, h0, dim, reverse, window, impl)


@_linear_scan.register_fake
def _linear_scan_fake(a, b, h0, dim, reverse, window, impl):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


@torch.library.custom_op(
    "adjoint_compile::linear_scan_backward", mutates_args=(),
    schema="(Tensor grad, Tensor a, Tensor? b, Tensor? h0, Tensor? h, int dim, bool reverse, int? window, "
           "str? impl, ScalarType b_dtype) -> (Tensor, Tensor, Tensor)")
def _linear_scan_backward(grad: Tensor, a: Tensor, b: Optional[Tensor], h0: Optional[Tensor], h: Optional[Tensor],
                          dim: int, reverse: bool, window: Optional[int], impl: Optional[str],
                          b_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    ga, gb, gh0 = _scan.scan_backward(grad, a, b, h0, h, dim, reverse, window, impl)
    h0_dtype = h0.dtype if h0 is not None else a.dtype
    # NB: .to() may return its input; custom ops must not return views of their own intermediates twice, so
    # contiguous() copies only when needed and each output is a distinct tensor.
    return ga.to(a.dtype).contiguous(), gb.to(b_dtype).contiguous(), gh0.to(h0_dtype).contiguous()


@_linear_scan_backward.register_fake
def _linear_scan_backward_fake(grad, a, b, h0, h, dim, reverse, window, impl, b_dtype):
    h0_dtype = h0.dtype if h0 is not None else a.dtype
    return (a.new_empty(a.shape), a.new_empty(a.shape, dtype=b_dtype),
            a.new_empty(_drop(a.shape, dim), dtype=h0_dtype))


def _setup_context(ctx, inputs, output):
    a, b, h0, dim, reverse, window, impl = inputs
    ctx.args = (dim, reverse, window, impl, b.dtype)
    ctx.has_h0 = h0 is not None
    if window is None:
        # full scan: ∂a needs the states h, not b (b may then be freed after the forward)
        ctx.save_for_backward(a, None, h0, output)
    else:
        ctx.save_for_backward(a, b, h0, None)


def _backward(ctx, grad):
    a, b, h0, h = ctx.saved_tensors
    dim, reverse, window, impl, b_dtype = ctx.args
    ga, gb, gh0 = torch.ops.adjoint_compile.linear_scan_backward.default(
        grad, a, b, h0, h, dim, reverse, window, impl, b_dtype)
    return ga, gb, (gh0 if ctx.has_h0 else None), None, None, None, None


_linear_scan.register_autograd(_backward, setup_context=_setup_context)


def linear_scan(a: Tensor, b: Tensor, h0: Tensor | None = None, *, dim: int = 1, reverse: bool = False,
                window: int | None = None, impl: str | None = None) -> Tensor:
    """First-order linear scan along ``dim``, as one graph node (``torch.ops.adjoint_compile.linear_scan``).

    Forward: h_t = a_t ⊙ h_{t-1} + b_t (h_{-1} = h0). ``reverse``: h_t = a_t ⊙ h_{t+1} + b_t (h_T = h0).
    ``window=W``: h_t = Σ_{i=t-W+1..t} (Π_{j=i+1..t} a_j) ⊙ b_i with h0 the input at index -1 (mirrored for
    reverse); computed without subtracting long scans. Differentiable in a, b and h0.

    Args:
        a, b: same shape ``[..., T, ...]``, floating point (fp32 / bf16 / fp16 / fp64), any strides; T steps
            along ``dim``. Accumulation is fp32 (fp64 for fp64); h has dtype ``promote_types(a.dtype, b.dtype)``.
        h0: the state before the first step (after the last, for reverse), shaped like ``a`` without ``dim``;
            None means zeros. To carry a state across slices of a sequence, pass the previous slice's
            ``h.select(dim, -1)`` (reverse: ``h.select(dim, 0)``).
        dim: the step dim (negative counts from the end).
        reverse: scan from the last step to the first.
        window: W >= 1, or None for the full scan.
        impl: None (Triton for CUDA tensors; the compiled C kernel for CPU tensors, or the torch reference when
            no C compiler is found), "triton" (CUDA, or CPU under ``TRITON_INTERPRET=1``), "cpu" or "reference".
    Returns:
        h, a new contiguous tensor shaped like ``a``.
    Raises:
        ValueError naming the argument: non-tensor or integer inputs, shape / device mismatch, ``dim`` out of
        range, ``window < 1``, an unknown ``impl``, or ``h0`` of the wrong shape.
    """
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, Tensor):
            raise ValueError(f"linear_scan: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"linear_scan: {name} must be floating point (float32, bfloat16, float16 or "
                             f"float64), got {x.dtype}")
    if a.ndim == 0:
        raise ValueError("linear_scan: a must have at least one dim (the steps), got a 0-dim tensor")
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a and b must have the same shape, got a {tuple(a.shape)} and "
                         f"b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"linear_scan: a and b must be on the same device, got a on {a.device} and b on {b.device}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"linear_scan: dim must be an int, got {dim!r}")
    if not -a.ndim <= dim < a.ndim:
        raise ValueError(f"linear_scan: dim={dim} is out of range for a with {a.ndim} dims "
                         f"(allowed: {-a.ndim}..{a.ndim - 1})")
    d = dim % a.ndim
    if not isinstance(reverse, bool):
        raise ValueError(f"linear_scan: reverse must be a bool, got {reverse!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"linear_scan: window must be an int >= 1 or None, got {window!r}")
    if impl not in _scan.IMPLS:
        raise ValueError(f"linear_scan: impl must be None, 'triton', 'cpu' or 'reference', got {impl!r}")
    if h0 is not None:
        if not isinstance(h0, Tensor):
            raise ValueError(f"linear_scan: h0 must be a torch.Tensor or None, got {type(h0).__name__}")
        if h0.dtype not in FLOAT_DTYPES:
            raise ValueError(f"linear_scan: h0 must be floating point, got {h0.dtype}")
        want = tuple(_drop(a.shape, d))
        if tuple(h0.shape) != want:
            raise ValueError(f"linear_scan: h0 must have the shape of a without dim {d}, i.e. {want}, "
                             f"got {tuple(h0.shape)}")
        if h0.device != a.device:
            raise ValueError(f"linear_scan: h0 must be on a's device {a.device}, got {h0.device}")
    return torch.ops.adjoint_compile.linear_scan.default(a, b, h0, d, reverse, window, impl)
