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

torch.func: both ops have vmap rules (one scan over the batch); under torch.func transforms :func:`linear_scan`
applies ``_ScanFn``, the same autograd formula as an autograd.Function torch.func accepts (see the note there).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from .kernels import scan as _scan

log = logging.getLogger(__name__)

__all__ = ["linear_scan", "FLOAT_DTYPES", "COMPLEX_DTYPES", "SCAN_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
#: the dtypes a, b and h0 may have (real and complex may be mixed: they promote)
SCAN_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES


def _drop(shape, d: int) -> list:
    return list(shape[:d]) + list(shape[d + 1:])


@torch.library.custom_op(
    "adjoint_compile::linear_scan", mutates_args=(),
    schema="(Tensor a, Tensor b, Tensor? h0, int dim, bool reverse, int? window, str? impl) -> Tensor")
def _linear_scan(a: Tensor, b: Tensor, h0: Optional[Tensor], dim: int, reverse: bool, window: Optional[int],
                 impl: Optional[str]) -> Tensor:
    a, b, h0 = _resolved(a, b, h0)
    return _scan.scan(a, b, h0, dim, reverse, window, impl)


def _resolved(*xs: Optional[Tensor]) -> tuple:
    """Complex inputs with their lazy conjugate / negative bits applied (a copy only where a bit is set).

    NB: a kernel called from a compiled graph runs with the Conjugate and Negative dispatch keys excluded, so the
    kernels must never see a ``conj()`` view: they would read its data unconjugated."""
    return tuple(x.resolve_conj().resolve_neg() if x is not None and x.is_complex() else x for x in xs)


@_linear_scan.register_fake
def _linear_scan_fake(a, b, h0, dim, reverse, window, impl):
    return a.new_empty(a.shape, dtype=_scan.out_dtype(a, b, h0))


@torch.library.custom_op(
    "adjoint_compile::linear_scan_backward", mutates_args=(),
    schema="(Tensor grad, Tensor a, Tensor? b, Tensor? h0, Tensor? h, int dim, bool reverse, int? window, "
           "str? impl, ScalarType b_dtype) -> (Tensor, Tensor, Tensor)")
def _linear_scan_backward(grad: Tensor, a: Tensor, b: Optional[Tensor], h0: Optional[Tensor], h: Optional[Tensor],
                          dim: int, reverse: bool, window: Optional[int], impl: Optional[str],
                          b_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    grad, a, b, h0, h = _resolved(grad, a, b, h0, h)
    ga, gb, gh0 = _scan.scan_backward(grad, a, b, h0, h, dim, reverse, window, impl)
    h0_dtype = h0.dtype if h0 is not None else a.dtype
    # NB: .to() may return its input; custom ops must not return views of their own intermediates twice, so
    # contiguous() copies only when needed and each output is a distinct tensor.
    return _cast(ga, a.dtype), _cast(gb, b_dtype), _cast(gh0, h0_dtype)


def _cast(g: Tensor, dtype: torch.dtype) -> Tensor:
    """A gradient in its input's dtype, contiguous: a real input of a complex scan gets the real part (autograd's
    convention), never a lazily conjugated view."""
    if g.is_complex() and not dtype.is_complex:
        g = g.real
    return g.to(dtype).contiguous()


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


# --------------------------------------------------------------------------------------------------------------
# torch.func (grad, vjp, vmap, jacrev)
#
# NB: register_autograd (torch <= 2.13) wraps the formula above in a generated legacy autograd.Function
# (forward(ctx, ...), no setup_context), and autograd.Function.apply refuses such a Function whenever a torch.func
# transform is active: grad / vjp / jacrev of the op raise "it must override the setup_context staticmethod"
# (pytorch/pytorch#168393, #170834). An Autograd kernel of our own cannot fix it: torch.func handles an
# autograd.Function above the dispatcher, so one applied from inside an Autograd kernel finds no functorch rule.
# So under torch.func transforms `linear_scan` applies _ScanFn, the same formula as a torch.func-style
# autograd.Function, whose forward / backward call the two ops; vmap goes to the ops' batching rules below (one
# scan of the whole batch, not a loop over examples). Elsewhere (plain autograd, torch.compile) the op is called
# directly, so graphs keep their single node.
# --------------------------------------------------------------------------------------------------------------
def _batch_first(x: Optional[Tensor], bdim: Optional[int], n: int) -> Optional[Tensor]:
    """x with the vmapped dim first: moved there, or (x not vmapped) broadcast to ``[n, *x.shape]`` (a view)."""
    if x is None:
        return None
    return x.expand(n, *x.shape) if bdim is None else x.movedim(bdim, 0)


@_linear_scan.register_vmap
def _linear_scan_vmap(info, in_dims, a, b, h0, dim, reverse, window, impl):
    """Batching rule: per example, a scan along ``dim`` of ``[...]``; batched, one scan along ``dim + 1`` of
    ``[n, ...]`` (inputs that are not vmapped are broadcast)."""
    a, b, h0 = (_batch_first(x, d, info.batch_size) for x, d in zip((a, b, h0), in_dims[:3]))
    d = dim % (a.ndim - 1) + 1
    return torch.ops.adjoint_compile.linear_scan.default(a, b, h0, d, reverse, window, impl), 0


@_linear_scan_backward.register_vmap
def _linear_scan_backward_vmap(info, in_dims, grad, a, b, h0, h, dim, reverse, window, impl, b_dtype):
    """Batching rule of the backward (vmap of grad, jacrev's vmap over cotangents): one batched backward scan."""
    grad, a, b, h0, h = (_batch_first(x, d, info.batch_size) for x, d in zip((grad, a, b, h0, h), in_dims[:5]))
    d = dim % (a.ndim - 1) + 1
    out = torch.ops.adjoint_compile.linear_scan_backward.default(grad, a, b, h0, h, d, reverse, window, impl,
                                                                  b_dtype)
    return out, (0, 0, 0)


class _ScanFn(torch.autograd.Function):
    """``linear_scan`` under torch.func: h = scan(a, b, h0); (∂a, ∂b, ∂h0) = ``linear_scan_backward``.

    The same contract as the op's registered autograd (:func:`_setup_context`, :func:`_backward`), in the form
    torch.func accepts (forward without ctx, setup_context); vmap of forward and backward is generated, i.e. the
    ops' batching rules.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, h0, dim, reverse, window, impl):
        return torch.ops.adjoint_compile.linear_scan.default(a, b, h0, dim, reverse, window, impl)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, grad):
        a, b, h0, h = ctx.saved_tensors
        dim, reverse, window, impl, b_dtype = ctx.args
        # NB: through _ScanBackwardFn, not the op: torch.func.grad differentiates with create_graph=True, and the
        # op's generated autograd would refuse the transform just like the forward's
        ga, gb, gh0 = _ScanBackwardFn.apply(grad, a, b, h0, h, dim, reverse, window, impl, b_dtype)
        return ga, gb, (gh0 if ctx.has_h0 else None), None, None, None, None


class _ScanBackwardFn(torch.autograd.Function):
    """``linear_scan_backward`` under torch.func; it has no derivative (double backward raises when reached)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return torch.ops.adjoint_compile.linear_scan_backward.default(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("linear_scan: double backward (a derivative of linear_scan_backward) is not supported")


def linear_scan(a: Tensor, b: Tensor, h0: Tensor | None = None, *, dim: int = 1, reverse: bool = False,
                window: int | None = None, impl: str | None = None) -> Tensor:
    """First-order linear scan along ``dim``, as one graph node (``torch.ops.adjoint_compile.linear_scan``).

    Forward: h_t = a_t ⊙ h_{t-1} + b_t (h_{-1} = h0). ``reverse``: h_t = a_t ⊙ h_{t+1} + b_t (h_T = h0).
    ``window=W``: h_t = Σ_{i=t-W+1..t} (Π_{j=i+1..t} a_j) ⊙ b_i with h0 the input at index -1 (mirrored for
    reverse); computed without subtracting long scans. Differentiable in a, b and h0; composes with torch.func
    (grad, vjp, jacrev; vmap as one scan of the batch); no forward mode, no double backward.

    Args:
        a, b: same shape ``[..., T, ...]``, floating point (fp32 / bf16 / fp16 / fp64) or complex (complex64 /
            complex128; real and complex mix and promote), any strides; T steps along ``dim``. Accumulation is fp32
            (fp64 for fp64; complex64 / complex128 for complex); h has dtype ``promote_types(a.dtype, b.dtype)``
            (complex when only h0 is). Complex scans run the torch reference whatever ``impl`` says; their
            gradients follow autograd's convention (∂a_t = μ_t ⊙ conj(h_{t-1}), μ_t = g_t + conj(a_{t+1}) ⊙ μ_{t+1}),
            and a real input of a complex scan gets the real part.
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
        if x.dtype not in SCAN_DTYPES:
            raise ValueError(f"linear_scan: {name} must be floating point (float32, bfloat16, float16 or "
                             f"float64) or complex (complex64, complex128), got {x.dtype}")
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
        if h0.dtype not in SCAN_DTYPES:
            raise ValueError(f"linear_scan: h0 must be floating point or complex, got {h0.dtype}")
        want = tuple(_drop(a.shape, d))
        if tuple(h0.shape) != want:
            raise ValueError(f"linear_scan: h0 must have the shape of a without dim {d}, i.e. {want}, "
                             f"got {tuple(h0.shape)}")
        if h0.device != a.device:
            raise ValueError(f"linear_scan: h0 must be on a's device {a.device}, got {h0.device}")
    return scan_op(a, b, h0, d, reverse, window, impl)


def scan_op(a: Tensor, b: Tensor, h0: Tensor | None, dim: int, reverse: bool, window: int | None,
            impl: str | None) -> Tensor:
    """The op ``torch.ops.adjoint_compile.linear_scan`` (arguments unchecked), through :class:`_ScanFn` under
    torch.func transforms, which refuse the op's own autograd (note above); a graph that calls the op and is run
    under torch.func calls this in its place."""
    # NB: dynamo must see the op itself (one node)
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        return _ScanFn.apply(a, b, h0, dim, reverse, window, impl)
    return torch.ops.adjoint_compile.linear_scan.default(a, b, h0, dim, reverse, window, impl)
