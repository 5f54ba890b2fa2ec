"""``loss_only(model)``: a transformers ``...ForCausalLM`` called with ``labels`` returns its loss without the logits.

Why: a causal LM's forward computes ``logits = lm_head(hidden_states)`` and, given ``labels``, ``loss =
self.loss_function(logits, labels, vocab_size, **kwargs)``, and returns both. Compiled with ``backend="adjoint"``,
the head and the loss join the sharded region, so the ``[B, T, V]`` logits exist one shard at a time; but an output
of the compiled graph is kept whole (the backend cannot drop what the model returns), so returning them with the
loss costs ``B·T·V`` floats (4 bytes each: transformers' Mamba upcasts them with ``.float()``), the step's largest
tensor at long T. The Hugging Face Trainer calls ``model(**inputs)`` and keeps the output object: the logits are
always returned there.

:func:`loss_only` patches one model instance's ``forward``: it runs the library's own forward unchanged and, when
the call has ``labels`` and the model trains (``model.training`` and grad enabled: Liger-Kernel's
rule for its fused loss, ``self.training and labels is not None``, plus grad mode), returns the output with
``logits=None``. Traced by dynamo, the logits are then an intermediate of the graph, not an output: the region
shards them. Everything else (``logits_to_keep``, ``num_items_in_batch`` and other loss kwargs, ``return_dict``, the
cache, hidden states) passes through, so the loss and gradients are the library's own. Eager, or under another
backend, the logits are still computed whole (only not returned). ``when="always"`` drops them whenever labels are
given; ``loss_only(model, False)`` restores the forward. With ``return_dict=False`` the tuple is the unpatched
model's with None where the logits were.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

__all__ = ["loss_only", "is_loss_only"]

#: attribute on the patched forward: (the forward it wraps, or its function when it was a method of the instance;
#: whether that one was an instance attribute; whether it was a method of the instance)
_MARK = "_adjoint_compile_loss_only"
#: instance attribute: the ``when`` of the patch (on the instance, so that a ``copy.deepcopy`` has its own)
_WHEN = "_adjoint_compile_loss_only_when"
WHEN = ("training", "always")


def is_loss_only(model: torch.nn.Module) -> bool:
    """True when :func:`loss_only` patched ``model`` (or the module a ``torch.compile`` result wraps)."""
    return hasattr(_target(model).__dict__.get("forward"), _MARK)


def _target(model: Any) -> Any:
    return getattr(model, "_orig_mod", model)  # NB: torch.compile(model) wraps it in an OptimizedModule


def _refuse(model: Any) -> str:
    """Why ``model`` is not a causal LM :func:`loss_only` can handle, or "" when it is."""
    name = type(model).__name__
    if not isinstance(model, torch.nn.Module):
        return f"{name} is not a torch.nn.Module"
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return f"{name}.forward has no signature to read"
    if "labels" not in params:
        return f"{name}.forward takes no `labels` (a backbone without its head? use the ...ForCausalLM class)"
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, torch.nn.Module):
        return (f"{name} has no vocabulary head (get_output_embeddings() is {head!r}): not a transformers "
                f"...ForCausalLM")
    return ""


def loss_only(model: torch.nn.Module, enabled: bool = True, *, when: str = "training") -> torch.nn.Module:
    """Make ``model`` (a transformers ``...ForCausalLM``, or ``torch.compile`` of one) return its loss with
    ``logits=None`` when called with ``labels``; returns ``model``.

    Args:
        model: patched in place, this instance only (its class and other instances are untouched). Call it before
            the first compiled call (a later patch recompiles the graph at the next call).
        enabled: False restores the forward the model had before (a no-op on a model never patched).
        when: "training" (the default): drop the logits when ``model.training`` and ``torch.is_grad_enabled()``
            (evaluation under ``torch.no_grad()``, e.g. the Trainer's, keeps them for its metrics); "always": on
            every call with labels.
    Idempotent: a second call only updates ``when``. Raises TypeError for a model without a ``labels`` argument
    or without a vocabulary head (``get_output_embeddings()``); a patched call whose output has no loss or no
    ``logits`` field raises TypeError too.
    """
    if when not in WHEN:
        raise ValueError(f"loss_only: when={when!r}; expected one of {WHEN}")
    target = _target(model)
    current = target.__dict__.get("forward") if isinstance(target, torch.nn.Module) else None
    done = getattr(current, _MARK, None)
    if not enabled:
        if done is not None:
            original, own, bound = done
            if own:  # NB: a method of the instance is bound again: to this instance, when it is a deepcopy
                target.forward = types.MethodType(original, target) if bound else original
            else:
                del target.__dict__["forward"]
            target.__dict__.pop(_WHEN, None)
        return model
    if done is not None:
        target.__dict__[_WHEN] = when
        return model
    if why := _refuse(target):
        raise TypeError(f"adjoint_compile.loss_only: {why}")
    original = target.forward
    target.__dict__[_WHEN] = when
    target.forward = _patched(target, original, own=current is not None)
    return model


def _patched(model: torch.nn.Module, original: Any, *, own: bool) -> Any:
    """The forward that wraps ``original`` (the bound forward the instance had): a method bound to ``model`` whose
    ``__wrapped__`` is the function behind ``original`` (so signature checks and ``report()`` see the library's),
    or, for a plain function stored on the instance, a function wrapping it.

    NB: the method reads its model and the library's forward through ``self`` at each call: ``copy.deepcopy`` binds
    the method to the copy (a reference or EMA model), which then runs its own weights, not the original's."""
    sig = inspect.signature(original).parameters
    params = list(sig)
    at = {k: params.index(k) for k in ("labels", "return_dict") if k in params}
    # NB: return_dict=True is passed only where the forward takes it (by name, or in its **kwargs)
    takes_rd = "return_dict" in sig or any(p.kind is p.VAR_KEYWORD for p in sig.values())

    def forward(self: torch.nn.Module, run: Any, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels", args[at["labels"]] if len(args) > at["labels"] else None)
        drop = labels is not None  # NB: a ForCausalLM computes its loss when given labels (shift_labels only with them)
        if drop and self.__dict__.get(_WHEN, "training") == "training":
            drop = self.training and torch.is_grad_enabled()
        if not drop:
            return run(*args, **kwargs)
        as_dict = None
        if takes_rd:
            args, as_dict = _ask_for_a_dict(self, args, kwargs, at.get("return_dict"))
        out = run(*args, **kwargs)
        names = [f.name for f in dataclasses.fields(out)] if dataclasses.is_dataclass(out) else []
        if "logits" not in names or getattr(out, "loss", None) is None:
            raise TypeError(f"adjoint_compile.loss_only: {type(self).__name__}.forward with labels returned "
                            f"{type(out).__name__} without a loss and a `logits` field: not a transformers "
                            f"...ForCausalLM output; loss_only(model, False) restores the forward")
        # NB: the fields the unpatched model's tuple holds (a ModelOutput's tuple skips None fields), in order
        kept = [k for k in names if getattr(out, k) is not None]
        out = type(out)(**{k: None if k == "logits" else getattr(out, k) for k in names})
        if as_dict is None or as_dict:
            return out
        # NB: None where the logits were, as Liger-Kernel's patched forwards do: `loss, logits, *rest = out` and
        # out[2] still name what they name on the unpatched model
        return tuple(None if k == "logits" else getattr(out, k) for k in kept)

    func = getattr(original, "__func__", None)
    if func is None or getattr(original, "__self__", None) is not model:
        patched = functools.wraps(original)(lambda *args, **kwargs: forward(model, original, *args, **kwargs))
        mark: tuple = (original, own, False)
    else:
        def method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return forward(self, functools.partial(func, self), *args, **kwargs)

        patched = types.MethodType(functools.wraps(func)(method), model)
        mark = (func, own, True)
    setattr(getattr(patched, "__func__", patched), _MARK, mark)
    return patched


def _ask_for_a_dict(model: torch.nn.Module, args: tuple, kwargs: dict, pos: int | None) -> tuple[tuple, bool]:
    """The call's arguments with ``return_dict=True`` (``kwargs`` updated in place), and whether the caller asked
    for a dict (its ``return_dict``, else the config's)."""
    if pos is not None and len(args) > pos:
        asked = args[pos]
        args = (*args[:pos], True, *args[pos + 1:])
    else:
        asked = kwargs.get("return_dict")
        kwargs["return_dict"] = True
    if asked is None:
        asked = getattr(getattr(model, "config", None), "return_dict", True)
    return args, bool(asked)
