"""What every polyfill does the same way: find the library's own function, compare it with the polyfill on random
inputs before registering, and keep a traceable copy of the original for the traces that are not ours."""
from __future__ import annotations

import inspect
import logging
import types
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["library_function", "copy_function", "output_error", "refuse_if_different", "flag_cases", "checked"]


def library_function(owner: Any, name: str, params: list[str], module: str | None = None) -> types.FunctionType | str:
    """``owner.name`` (``owner`` a module, or a class of ``module``) unwrapped to the library's own Python function,
    with exactly these parameters in this order (the polyfill passes them on by position), or why not."""
    module = module or owner.__name__
    wrapper = getattr(owner, name, None)
    original = inspect.unwrap(wrapper) if wrapper is not None else None
    if not isinstance(original, types.FunctionType) or original.__module__ != module:
        return f"not registered: {module}.{name} is not the library's torch function"
    have = list(inspect.signature(original).parameters)
    if have != params:
        return f"not registered: {name}'s signature changed ({have}, expected {params})"
    return original


def copy_function(fn: types.FunctionType) -> types.FunctionType:
    """The library's function as a new object (dynamo traces it as it is: the polyfill is keyed on the original)."""
    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__ = fn.__kwdefaults__
    g.__qualname__ = fn.__qualname__
    return g


def output_error(want: Any, got: Any, several: bool) -> float:
    """Max relative error of ``got`` against ``want`` (tuples of tensors when ``several``); inf when a shape or
    dtype differs."""
    worst = 0.0
    for w, o in (zip(want, got) if several else [(want, got)]):
        if w.shape != o.shape or w.dtype != o.dtype:
            return float("inf")
        worst = max(worst, float((o - w).abs().max() / w.abs().max().clamp_min(1e-30)))
    return worst


def refuse_if_different(name: str, err: float, tol: float) -> str | None:
    """Why the polyfill of ``name`` is not registered (logged as a warning), or None when ``err <= tol``."""
    if err <= tol:
        return None
    msg = f"not registered: differs from {name} (max rel. error {err:.2e} > {tol:g})"
    log.warning("adjoint-compile: polyfill %s", msg)
    return msg


def flag_cases(n: int) -> list[tuple[int, ...]]:
    """Settings of ``n`` on/off flags a check runs: all off, all on, each flag alone on and alone off (2n + 2
    cases, every flag seen both ways next to every other's both values, at a fraction of the 2**n product)."""
    cases = {(0,) * n, (1,) * n}
    for i in range(n):
        cases.add(tuple(int(j == i) for j in range(n)))
        cases.add(tuple(int(j != i) for j in range(n)))
    return sorted(cases)


def checked(owner: Any, name: str, params: list[str], check: Callable[[types.FunctionType], float], tol: float,
            label: str, module: str | None = None) -> tuple[types.FunctionType, types.FunctionType, float] | str:
    """The library function (:func:`library_function`), a traceable copy of it (:func:`copy_function`) and the
    polyfill's error against it (``check(original)``, run without grad), or why the polyfill is not registered."""
    original = library_function(owner, name, params, module)
    if isinstance(original, str):
        return original
    with torch.no_grad():
        err = check(original)
    if (why := refuse_if_different(label, err, tol)) is not None:
        return why
    return original, copy_function(original), err
