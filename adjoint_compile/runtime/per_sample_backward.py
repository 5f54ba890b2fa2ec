"""Which backward is running, for ``per_sample_clip`` (runtime/per_sample.py).

The book-keeping ops return no gradient for a parameter; the clipped sum Σ_n c_n g_n is formed at the end of the
backward and written to ``p.grad``. That is what ``loss.backward()`` asks for. ``torch.autograd.grad(loss,
params)`` never writes ``p.grad`` and would get nothing back (autograd's "appears to not have been used in the
graph", or None with ``allow_unused=True``): it is refused with a :class:`PerSampleError` that says to call
``.backward()``, and p.grad is left as it was. ``torch.autograd.grad`` with respect to inputs only runs as usual
and records nothing; ``loss.backward(inputs=...)`` clips over the parameters it names and writes only theirs.

Also here: the per-example VJP of a use with no book-keeping of its own (:func:`per_example_vjp`), checked against
the batch's run of the op.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import PerSampleError

__all__ = ["accumulates", "refuse_autograd_grad", "per_example_vjp"]


def accumulates(p: Tensor) -> bool | None:
    """Whether the backward under way writes ``p.grad``: True (``loss.backward()``, or ``backward(inputs=...)``
    naming p), False (``backward(inputs=...)`` without p), None (``torch.autograd.grad``, which never does)."""
    node = torch.autograd.graph._get_grad_fn_or_grad_acc(p)
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError as e:
        # NB: the engine refuses a leaf's AccumulateGrad node under autograd.grad(): "A leaf node was passed to
        # _will_engine_execute_node but we are currently running autograd.grad()" (torch 2.x; tests pin it)
        if "autograd.grad" in str(e):
            return None
        raise


def _message(name: str, shape: tuple[int, ...]) -> str:
    return (f"adjoint-compile per_sample_clip: torch.autograd.grad asked for the gradient of the parameter {name} "
            f"{shape}, but under per_sample_clip the clipped per-example gradients exist only as the sum "
            "Σ_n min(1, C/‖g_n‖) g_n that a backward writes to p.grad at its end (torch.autograd.grad would "
            "return nothing, or an unclipped gradient). Call loss.backward() and read p.grad (and "
            "adjoint_compile.per_sample_grad_norms(compiled) for the norms); torch.autograd.grad with respect to "
            "inputs only is fine")


def refuse_autograd_grad(p: Tensor, name: str) -> Callable[[Tensor | None], None]:
    """A tensor hook for the parameter ``p``: raises :class:`PerSampleError` when ``torch.autograd.grad`` asks
    for p's gradient (the engine runs a leaf's hooks when it captures its gradient, even an undefined one, and
    before the backward's final callback: nothing is written to p.grad)."""
    ref = weakref.ref(p)
    shape = tuple(p.shape)

    def hook(g: Tensor | None) -> None:
        q = ref()
        if q is not None and accumulates(q) is None:
            raise PerSampleError(_message(name, shape))
    return hook


#: how far an op run per example may be from the batch's run by rounding alone, per dtype
_ROUNDING = {torch.float64: 1e-9, torch.complex128: 1e-9, torch.float32: 1e-4, torch.complex64: 1e-4}


def per_example_vjp(node: str, fn: Callable[..., Tensor], args: Sequence[Tensor], dims: Sequence[int | None],
                    pidx: Sequence[int], g: Tensor, bd: int, out: Tensor | None) -> tuple[Tensor, ...]:
    """Per parameter argument ``args[i]`` (i in ``pidx``), [B, *shape] gradients of ``fn(*args)`` at cotangent ``g``
    (examples on ``bd``), one example at a time by ``torch.func.vmap``: the arguments with an axis in ``dims`` are
    cut to one example, the rest passed whole. ``out``: ``fn(*args)`` where already known."""
    batched = [i for i in range(len(args)) if dims[i] is not None]

    def one(xs_n: Sequence[Tensor], g_n: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        full = list(args)
        for i, x in zip(batched, xs_n):
            full[i] = x.unsqueeze(dims[i])

        def f_p(*ps: Tensor) -> Tensor:
            for i, p in zip(pidx, ps):
                full[i] = p
            return fn(*full)
        y, vjp = torch.func.vjp(f_p, *[args[i] for i in pidx])
        return y.squeeze(bd), vjp(g_n.unsqueeze(bd))
    try:
        y, per = torch.func.vmap(one, in_dims=([dims[i] for i in batched], bd), out_dims=(bd, 0))(
            [args[i] for i in batched], g)
    except (RuntimeError, IndexError) as e:  # NB: a [T, D] value made [1, D] for one example, then indexed at t
        raise PerSampleError(_misread(node, int(g.shape[bd])) + f" (run for one example it failed: {e})") from e
    check_lined_up(node, y, fn(*args) if out is None else out, bd)
    return per


def check_lined_up(node: str, per_example: Tensor, batched: Tensor, bd: int) -> None:
    """Raise unless ``per_example`` (an op run for each example alone, stacked) is ``batched`` (the op run on the
    batch): a size taken for the batch's that was another axis of the same length (``p.expand(T, D)`` where
    T == B) makes each example's run differ from its rows of the batch's, and its gradient would not be its own."""
    tol = _ROUNDING.get(batched.dtype, 2e-2)
    scale = float(batched.detach().abs().max()) if batched.numel() else 0.0
    if per_example.shape != batched.shape or not torch.allclose(
            per_example, batched, rtol=tol, atol=tol * scale, equal_nan=True):
        raise PerSampleError(_misread(node, int(batched.shape[bd])))


def _misread(node: str, batch: int) -> str:
    return (f"adjoint-compile per_sample_clip: {node}, run for each example alone, is not that example's part of its "
            f"run on the batch: a value of parameters or constants with an axis as long as the batch ({batch}) was "
            "taken for one row per example, which it is not, so its per-example gradients would be wrong; use a batch "
            "size other than that value's other axes' lengths")
