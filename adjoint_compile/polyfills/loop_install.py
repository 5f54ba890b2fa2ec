"""Where the loop roller (:mod:`.loops`) finds the functions to roll: when dynamo starts compiling a frame for
``backend="adjoint"``, the modules and functions the frame can reach, and the instances whose submodules each rolled
step calls (:func:`.loop_calls._callee_ok`).

The frame dynamo compiles first is the compiled callable's own (``torch.compile(model)``: the model's ``forward``);
dynamo traces that code as it is, so a loop there would be unrolled. For such a callable, ``torch.compile(...,
backend="adjoint")`` compiles a frame around it instead (as dynamo's ``wrap_top_frame`` does, for this call only),
and the callable's code is inlined in its rolled form like any other function's (:func:`wrap_top_frame`). Each such
callable gets a wrapper code object of its own, so that dynamo's caches and recompile limits stay per callable."""
from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any

import torch.nn as nn

from . import _FORCE, options_for, rolls, traced_options
from .loop_calls import EVERY, _callee_ok
from .loops import analyse, refused

log = logging.getLogger(__name__)

__all__ = ["roll_reachable", "wrap_top_frame", "patch_compile_entry"]

_LIBS = ("torch", "builtins", "adjoint_compile")


def wrap_top_frame(ctx: Any, target: Any) -> bool:
    """Whether ``torch.compile(target, backend="adjoint")`` (dynamo's context ``ctx``) should compile a frame around
    ``target``: a module whose ``forward``, or a function whose own code, has a loop that rolls."""
    opts = options_for(getattr(ctx, "callback", None))
    if opts is None and getattr(_FORCE, "on", False):  # NB: explain() traces as torch.compile(backend="adjoint") would
        opts = traced_options()
    if not rolls(opts):
        return False
    fn = type(target).forward if isinstance(target, nn.Module) else getattr(target, "__func__", target)
    if not isinstance(fn, types.FunctionType) or "range" not in fn.__code__.co_names \
            or (fn.__module__ or "").split(".")[0] in _LIBS:
        return False
    return analyse(fn)[0] is not None


def patch_compile_entry() -> None:
    """Have ``torch.compile`` for this backend wrap a callable whose own loops roll (:func:`wrap_top_frame`); every
    other ``torch.compile`` call is left as it is. Idempotent; without dynamo's hook points, nothing changes."""
    try:
        from torch._dynamo import eval_frame, external_utils
        ctx_cls = eval_frame._TorchDynamoContext
        orig = ctx_cls.__call__
        wrap_inline = external_utils.wrap_inline
    except (ImportError, AttributeError) as e:
        log.debug("adjoint-compile: loops in the compiled callable itself stay unrolled (%s)", e)
        return
    if getattr(orig, "_adjoint_compile", False):
        return

    @functools.wraps(orig)
    def __call__(self: Any, fn: Any) -> Any:
        try:
            wrap = wrap_top_frame(self, fn)
        except Exception as e:  # noqa: BLE001 - an optimisation: torch.compile goes on as it would
            log.debug("adjoint-compile: top frame not wrapped (%s: %s)", type(e).__name__, e)
            wrap = False
        if not wrap:
            return orig(self, fn)
        log.info("adjoint-compile: %s compiled in a frame around it, so that its own loops roll",
                 getattr(fn, "__qualname__", type(fn).__qualname__))
        inner = wrap_inline(fn)
        # NB: a code object of its own (as dynamo's debug_force_nested_calls makes): dynamo keeps its compiled graphs
        # and its recompile limit per code object, which wrap_inline's one `inner` would share among every target
        inner.__code__ = inner.__code__.replace(co_varnames=inner.__code__.co_varnames)
        if not isinstance(fn, nn.Module):
            return orig(self, inner)
        opt = orig(self, fn)  # NB: the OptimizedModule, whose compiled forward then enters through `inner`
        setattr(opt, "_forward" if hasattr(opt, "_forward") else "forward", self(inner))
        return opt

    __call__._adjoint_compile = True  # type: ignore[attr-defined]
    ctx_cls.__call__ = __call__


def _compile_frame() -> tuple[types.CodeType, dict[str, Any], dict[str, Any], tuple[Any, ...], Any] | None:
    """The frame dynamo is starting to compile (its code, globals, locals, closure) and the compiler it compiles
    for, read from dynamo's ``_compile`` frame up the stack (None when not found: nothing is rolled)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_code.co_filename.endswith("convert_frame.py"):
            loc = f.f_locals
            try:
                return loc["code"], loc["globals"], loc["locals"], tuple(loc["closure"] or ()), loc["compiler_fn"]
            except KeyError:
                return None
        f = f.f_back
    return None


def _reachable(code: types.CodeType, glob: dict[str, Any], loc: dict[str, Any], closure: tuple[Any, ...]
               ) -> tuple[list[nn.Module], list[types.FunctionType]]:
    """The modules and plain functions the frame can reach: its locals, closure cells and the globals it names,
    through closures and submodules (bounded)."""
    seen: set[int] = set()
    mods: list[nn.Module] = []
    fns: list[types.FunctionType] = []
    todo: list[tuple[Any, int]] = [(v, 0) for v in loc.values()]
    todo += [(c.cell_contents, 0) for c in closure if _has(c)]
    todo += [(glob[n], 0) for n in code.co_names if n in glob]
    while todo:
        v, depth = todo.pop()
        if id(v) in seen or depth > 3:
            continue
        seen.add(id(v))
        if isinstance(v, nn.Module):
            for m in v.modules():
                if m is v or id(m) not in seen:
                    seen.add(id(m))
                    mods.append(m)
        elif isinstance(v, types.MethodType):
            todo += [(v.__func__, depth), (v.__self__, depth)]
        elif isinstance(v, types.FunctionType):
            if v.__module__ and v.__module__.split(".")[0] in ("torch", "adjoint_compile"):
                continue
            fns.append(v)
            todo += [(c.cell_contents, depth + 1) for c in v.__closure__ or () if _has(c)]
            todo += [(v.__globals__[n], depth + 1) for n in v.__code__.co_names if n in v.__globals__]
    return mods, fns


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    """What ``path`` (a ``module_calls`` entry) reaches from ``obj``; the container at an :data:`EVERY` item."""
    for a in path:
        if a == EVERY:
            break
        indexed = isinstance(a, int) and isinstance(obj, (nn.ModuleList, nn.Sequential))
        obj = obj[a] if indexed else getattr(obj, a, None)
    return obj


def _dotted(path: tuple[Any, ...]) -> str:
    """``cells[0].gate``, ``cells[...]``: a ``module_calls`` entry as the source reads."""
    return "".join(f"[{'...' if a == EVERY else a}]" if a == EVERY or isinstance(a, int) else f".{a}"
                   for a in path).lstrip(".")


def _has(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _install(fn: Any, instances: list[Any]) -> str:
    """Point dynamo at ``fn``'s rolled form when it has one and every instance passes its step's calls."""
    if not isinstance(fn, types.FunctionType) or fn.__module__.split(".")[0] in _LIBS:
        return "skipped"
    new, _, calls = analyse(fn)
    if new is None:
        return "nothing to roll"
    if calls and not instances:
        return "no instance to check"  # NB: a method reached as a plain function; its class's instances decide
    bad = next(((i, c) for i in instances for c in calls if not _callee_ok(i, c)), None)
    mine = getattr(fn, "_torchdynamo_inline", None)
    if bad is not None:
        if mine is new:
            del fn._torchdynamo_inline  # NB: an instance whose submodule may not trace inside scan
        log.info("adjoint-compile: loops of %s not rolled: %s.%s may not trace inside torch's scan",
                 fn.__qualname__, type(bad[0]).__name__, _dotted(bad[1]))
        refused(fn, f"the step calls self.{_dotted(bad[1])} ({type(_at(bad[0], bad[1])).__name__}), which may "
                    "not trace inside torch's scan")
        return "instance refused"
    if mine is None:
        fn._torchdynamo_inline = new
    return "rolled" if fn._torchdynamo_inline is new else "has its own _torchdynamo_inline"


def roll_reachable() -> None:
    """Called as dynamo starts compiling a frame: for ``backend="adjoint"`` (``roll_loops`` on), give every function
    the frame can reach whose loops roll its rolled form (see the module doc). Never raises."""
    try:
        got = _compile_frame()
        if got is None:
            return
        code, glob, loc, closure, compiler_fn = got
        opts = options_for(compiler_fn)
        if opts is None and getattr(_FORCE, "on", False):  # NB: explain() traces as the backend would
            opts = traced_options()
        if not rolls(opts):
            return
        mods, fns = _reachable(code, glob, loc, closure)
        by_class: dict[type, list[nn.Module]] = {}
        for m in mods:
            by_class.setdefault(type(m), []).append(m)
        methods: dict[str, Any] = {}
        for cls, insts in by_class.items():
            for klass in cls.__mro__:
                if klass.__module__.split(".")[0] in _LIBS:
                    continue
                for v in vars(klass).values():
                    # NB: a static method's loops too (no instance); a class method's calls on cls are not checked
                    v = v.__func__ if isinstance(v, staticmethod) else v
                    if isinstance(v, types.FunctionType):
                        methods[f"m{len(methods)}"] = v
                        if "range" in v.__code__.co_names:
                            _install(v, insts)
        # NB: and the plain functions the methods call (a module-level ``selective_scan(...)`` or ``wkv(...)`` that
        # holds the loop), found through the methods' globals and closures as the frame's own are
        fns += [f for f in _reachable(code, {}, methods, ())[1] if f not in methods.values() and f not in fns]
        for fn in fns:
            if "range" in fn.__code__.co_names:
                _install(fn, [])
    except Exception as e:  # noqa: BLE001 - rolling is an optimisation: a failure leaves tracing as it was
        log.warning("adjoint-compile: loop rolling skipped (%s: %s)", type(e).__name__, e)
