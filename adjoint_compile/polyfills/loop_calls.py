"""Which calls a loop's step may make and still trace inside torch's ``scan`` (:mod:`.loops`): read from the source,
and for ``self.x(...)`` from the modules reachable when dynamo starts compiling.

torch's ``scan`` raises, it does not fall back, when its step leaves the graph (``item``), changes state (an
in-place op on an input, ``self.n += 1``, a list's ``append``) or draws random numbers. So a call is allowed only
when it is a torch function or a tensor method outside :data:`_DENY`, a torch.nn layer of :data:`_SAFE_NN`, or a
function, method or module of the user's whose own code is straight-line and makes only such calls.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
from typing import Any

import torch
import torch.nn as nn

_SAFE_MODULES = {torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, math}
_SAFE_BUILTINS = {"len", "abs", "isinstance", "getattr", "hasattr", "range", "enumerate", "zip", "reversed"}
#: libraries of pure tensor functions that dynamo traces through (einops' rearrange, repeat, reduce, einsum, pack)
_SAFE_LIBRARIES = ("einops",)
#: an item of a ModuleList, Sequential or ParameterList, whichever: ``self.cells[l](x)``, ``for cell in self.cells``
EVERY = "*"
#: calls that leave the graph, depend on data for their shape, or draw random numbers (different streams per step)
_DENY = {"item", "tolist", "numpy", "backward", "register_hook", "retain_grad", "data_ptr", "nonzero", "argwhere",
         "masked_select", "unique", "unique_consecutive", "bincount", "histc", "manual_seed", "save", "load", "print",
         "set_grad_enabled", "no_grad", "enable_grad", "compile", "is_nonzero", "untyped_storage", "storage",
         "dropout", "dropout1d", "dropout2d", "alpha_dropout", "feature_alpha_dropout", "rand", "randn", "randint",
         "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal", "poisson", "randperm",
         # Python containers changed in place: a side effect scan refuses
         "append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard", "sort",
         "reverse", "popitem",
         # complex values made in the step: scan's autograd refuses them (view_as_complex_copy, torch 2.13)
         "view_as_complex", "view_as_real", "complex", "polar"}
_SAFE_NN = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.Embedding, nn.Identity, nn.Conv1d, nn.Conv2d,
            nn.Flatten, nn.Unflatten) + tuple(
    getattr(nn, n) for n in ("RMSNorm",) if hasattr(nn, n)) + tuple(
    v for v in vars(nn.modules.activation).values()
    if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == nn.modules.activation.__name__
    and v is not nn.MultiheadAttention) + tuple(
    # NB: the losses are functions of their inputs (a per-step criterion(head(h), y[:, t]) is batched over the steps)
    v for v in vars(nn.modules.loss).values()
    if isinstance(v, type) and issubclass(v, nn.modules.loss._Loss) and v is not nn.CTCLoss)


class _Reject(Exception):
    pass


def _names(node: ast.AST, ctx: type) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _root(e: ast.expr) -> str | None:
    while isinstance(e, ast.Attribute):
        e = e.value
    return e.id if isinstance(e, ast.Name) else None


def _const_int(e: ast.expr) -> int | None:
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        i = _const_int(e.operand)
        return None if i is None else -i
    return e.value if isinstance(e, ast.Constant) and type(e.value) is int else None


def _attr_path(e: ast.expr) -> tuple[str, ...] | None:
    parts: list[str] = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    return (e.id, *reversed(parts)) if isinstance(e, ast.Name) else None


def _resolve(path: tuple[str, ...], env: dict[str, Any]) -> Any:
    obj: Any = env.get(path[0], inspect.Parameter.empty)
    if obj is inspect.Parameter.empty:
        import builtins
        obj = getattr(builtins, path[0], None)
    for a in path[1:]:
        obj = getattr(obj, a, None)
    return obj


@dataclasses.dataclass
class _Fn:
    """What the checks need of the function being rewritten."""
    fn: types.FunctionType
    params: set[str]
    locals_: set[str]            # every name the function assigns or binds
    module_calls: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)  # self.attr(...), self.l[0](...)
    self_name: str = "self"      # what a method calls its instance (``s`` in ``def forward(s, x)``)


def _check_calls(node: ast.AST, f: _Fn) -> None:
    """Raise _Reject for a call that may leave the graph or mutate state (see the module doc)."""
    for c in ast.walk(node):
        if isinstance(c, (ast.Lambda, ast.NamedExpr, ast.IfExp, ast.ListComp, ast.SetComp, ast.DictComp,
                          ast.GeneratorExp, ast.Await, ast.Yield, ast.YieldFrom)):
            raise _Reject(f"{type(c).__name__} in the step")
        if not isinstance(c, ast.Call):
            continue
        fn = c.func
        if isinstance(fn, ast.Subscript):
            # NB: a layer of the instance's ModuleList picked by a number (``self.cells[0](x)``) or by a loop's
            # variable (``self.cells[l](x)``: every layer is checked), as a module
            path, i = _attr_path(fn.value), _const_int(fn.slice)
            if isinstance(fn.slice, ast.Name) and fn.slice.id in f.locals_:
                i = EVERY
            if path is None or path[0] != f.self_name or len(path) < 2 or i is None:
                raise _Reject("a call of a computed callable")
            f.module_calls.add((*path[1:], i))
            continue
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if name is None:
            raise _Reject("a call of a computed callable")
        if name == "detach":
            # NB: torch's scan gives a parameter reached only through the detached value a zero gradient where eager
            # gives None (an optimizer then decays it)
            raise _Reject("calls detach (a rolled loop's gradient would be zeros where eager's is None)")
        if name in _DENY or (name.endswith("_") and not name.endswith("__")):
            raise _Reject(f"calls {name} (in place, random, or leaves the graph)")
        path = _attr_path(fn)
        if path is not None and path[0] not in f.locals_ and path[0] not in f.params:
            obj = _resolve(path[:-1], f.fn.__globals__) if len(path) > 1 else None
            if len(path) > 1 and (obj in _SAFE_MODULES or _library(obj)):
                continue
            if len(path) == 1 and path[0] in _SAFE_BUILTINS:
                continue
            target = _resolve(path, f.fn.__globals__)
            if _library(target):
                continue
            if isinstance(target, types.BuiltinFunctionType) and getattr(target, "__module__", "") in (
                    "torch", "torch._C._nn", "torch._C._special", "torch._C._linalg", "math"):
                continue
            if isinstance(target, types.FunctionType) and _helper_ok(target):
                continue
            raise _Reject(f"calls {'.'.join(path)}, which may not trace inside torch's scan")
        if path is not None and path[0] == f.self_name and len(path) >= 2:
            f.module_calls.add(path[1:])  # self.mod(...) or self.method(...) or self.param.method(...)
        # else: a method of a local tensor, allowed unless denied above


def _library(obj: Any) -> bool:
    """Whether ``obj`` is a module or function of one of :data:`_SAFE_LIBRARIES`."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and name.split(".")[0] in _SAFE_LIBRARIES


@functools.lru_cache(maxsize=1024)
def _own_calls(fn: types.FunctionType) -> frozenset[tuple[str, ...]] | None:
    """The ``self.x(...)`` calls of a function or method called from a step when its own code is straight-line and
    its other calls pass :func:`_check_calls`, else None. Read once per function; a function that calls itself
    (through others too) is refused."""
    if fn in _VISITING:
        return None
    _VISITING.add(fn)
    try:
        return _read_calls(fn)
    finally:
        _VISITING.discard(fn)


_VISITING: set[types.FunctionType] = set()


def _read_calls(fn: types.FunctionType) -> frozenset[tuple[str, ...]] | None:
    try:
        tree = _parse(fn)
    except (OSError, TypeError, SyntaxError, _Reject):
        return None
    params = {a.arg for a in ast.walk(tree.args) if isinstance(a, ast.arg)}
    f = _Fn(fn, params, _names(tree, ast.Store) | params, self_name=self_param(fn, tree))
    for s in ast.walk(tree):
        if isinstance(s, (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.Raise, ast.Global, ast.Nonlocal,
                          ast.Delete, ast.FunctionDef, ast.ClassDef)) and s is not tree or (
                isinstance(s, (ast.Subscript, ast.Attribute)) and isinstance(s.ctx, ast.Store)):
            return None
    try:
        for s in tree.body:
            _check_calls(s, f)
    except _Reject:
        return None
    return frozenset(f.module_calls)


def self_param(fn: types.FunctionType, tree: ast.FunctionDef) -> str:
    """The name a method gives its instance, its first parameter (``self``, or ``s`` in ``def forward(s, x)``);
    "self" for a plain function, a static method or a class method."""
    parts = fn.__qualname__.split(".")
    args = tree.args.posonlyargs + tree.args.args
    if len(parts) < 2 or parts[-2] == "<locals>" or not args or any(
            isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in tree.decorator_list):
        return "self"
    return args[0].arg


def _helper_ok(fn: types.FunctionType, owner: Any = None, depth: int = 0) -> bool:
    """A function or method called from a step: :func:`_own_calls` passes, and its ``self.x(...)`` calls pass
    :func:`_callee_ok` on ``owner`` (three levels at most)."""
    calls = _own_calls(fn) if depth <= 3 else None
    return calls is not None and all(owner is not None and _callee_ok(owner, path, depth + 1) for path in calls)


def _callee_ok(owner: Any, path: tuple[str, ...], depth: int = 0) -> bool:
    """Whether ``owner.<path>(...)`` traces inside scan: a tensor method, a torch.nn layer without state it updates
    (:data:`_SAFE_NN`, or a Sequential of such), or a module or method of the user's whose code passes
    :func:`_helper_ok`."""
    obj: Any = owner
    prev: Any = None
    for k, a in enumerate(path):
        if a == EVERY:
            rest = path[k + 1:]
            return isinstance(obj, (nn.ModuleList, nn.Sequential, nn.ParameterList)) and all(
                isinstance(v, torch.Tensor) and not rest or _callee_ok(v, rest, depth) for v in obj)
        if isinstance(a, int):  # NB: ``self.cells[0]``: an item of a ModuleList or Sequential
            ok = isinstance(obj, (nn.ModuleList, nn.Sequential)) and -len(obj) <= a < len(obj)
            prev, obj = obj, obj[a] if ok else None
            continue
        prev, obj = obj, getattr(obj, a, None)
    if isinstance(prev, torch.Tensor):
        return True
    if isinstance(obj, nn.Module) and (obj._forward_hooks or obj._forward_pre_hooks):
        return False  # NB: a hook is Python the step would run
    if isinstance(obj, nn.Sequential):
        return all(_callee_ok(m, (), depth) for m in obj)
    if isinstance(obj, _SAFE_NN):
        return True
    if isinstance(obj, nn.Module):
        fwd = type(obj).forward
        return (not type(obj).__module__.startswith("torch.") and isinstance(fwd, types.FunctionType)
                and _helper_ok(fwd, obj, depth))
    if isinstance(obj, types.MethodType) and isinstance(obj.__func__, types.FunctionType):
        return _helper_ok(obj.__func__, obj.__self__, depth)
    return False


def _parse(fn: types.FunctionType) -> ast.FunctionDef:
    src = textwrap.dedent(inspect.getsource(fn))
    mod = ast.parse(src)
    if len(mod.body) != 1 or not isinstance(mod.body[0], ast.FunctionDef):
        raise _Reject("not a plain def")
    tree = mod.body[0]
    ast.increment_lineno(mod, fn.__code__.co_firstlineno - 1)
    return tree
