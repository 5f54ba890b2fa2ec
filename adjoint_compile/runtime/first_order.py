"""The backward of a rewritten region is first order: asked for a graph of its gradients, it raises.

A gradient penalty, MAML or a Hessian-vector product differentiates a gradient (``create_graph=True``, then a second
backward). The sweeps compute their gradients outside autograd, so the gradients they return have no graph behind
them. PyTorch's ``once_differentiable`` then hands back gradients that are constants (a loss's cotangent does not
require grad), and a penalty built on them adds nothing to the parameters' gradients, silently; its error node, where
there is one, hangs off fresh leaves, so ``autograd.grad`` with respect to the parameters never reaches it. So a
backward with ``create_graph=True`` through a region raises here, with the reason. Under ``torch.func`` transforms
(wrapped cotangents) the ``once_differentiable`` behaviour is kept: there a second derivative raises when taken.

A region's first call also builds and checks its programs on real tensors, with autograd; :func:`unhooked` keeps
those trial runs from the user's saved-tensor hooks (non-reentrant checkpointing counts what a forward saves and
compares it with its recomputation, which runs no trials).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["first_order", "untraced", "unhooked", "SECOND_ORDER_MESSAGE"]

SECOND_ORDER_MESSAGE = (
    "adjoint-compile: a backward with create_graph=True (for a second derivative: a gradient penalty, MAML, a "
    "Hessian-vector product) reached a region with the adjoint backward, whose gradients are computed shard by shard "
    "outside autograd and cannot be differentiated again. Compute that loss with the uncompiled model or another "
    "backend, or leave create_graph off")


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def unhooked() -> contextlib.AbstractContextManager:
    """A context in which tensors saved for backward bypass the saved-tensor hooks of the code around it (the
    innermost hooks are the ones applied); nothing where there are none (``torch.func``'s transforms refuse any
    saved-tensor hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None and top(True) is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def untraced(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` never traced by dynamo: one run from a compiled train step (``loss.backward()`` inside
    ``torch.compile``, a graph break) runs under dynamo's frame callback, which would compile its Python frame by
    frame."""
    return torch._dynamo.disable(backward, recursive=True)


def first_order(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` (an ``autograd.Function``'s) run without grad, refusing ``create_graph=True`` (module
    docstring), and never traced by dynamo."""
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled() and not any(isinstance(g, torch.Tensor) and
                                               torch._C._functorch.is_functorch_wrapped_tensor(g) for g in grads):
            raise RuntimeError(SECOND_ORDER_MESSAGE)
        return once(ctx, *grads)

    return untraced(wrapper)
