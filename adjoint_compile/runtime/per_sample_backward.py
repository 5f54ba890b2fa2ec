"""Which backward is running, for ``per_sample_clip`` (runtime/per_sample.py).

The book-keeping ops return no gradient for a parameter; the clipped sum Σ_n c_n g_n is formed at the end of the
backward and written to ``p.grad``. That is what ``loss.backward()`` asks for. ``torch.autograd.grad(loss,
params)`` never writes ``p.grad`` and would get nothing back (autograd's "appears to not have been used in the
graph", or None with ``allow_unused=True``): it is refused with a :class:`PerSampleError` that says to call
``.backward()``, and p.grad is left as it was. ``torch.autograd.grad`` with respect to inputs only runs as usual
and records nothing; ``loss.backward(inputs=...)`` clips over the parameters it names and writes only theirs.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import PerSampleError

__all__ = ["accumulates", "refuse_autograd_grad"]


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
