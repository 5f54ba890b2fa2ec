"""Python loops over ``range`` rolled before dynamo unrolls them: dynamo traces the step once, as torch's ``scan``,
so the first step's compile time does not grow with T.

Dynamo runs a model's Python: a ``for t in range(T)`` loop is traced T times, ~3 ms a step on a CPU, before any
backend sees the graph (40 s at T = 8192 for a three-line recurrence). This module rewrites such a loop in the
source of the function that holds it, ahead of dynamo. Before and after::

    h = torch.zeros_like(x[:, 0])             h = torch.zeros_like(x[:, 0])
    hs = []                                   hs = []
    for t in range(x.shape[1]):               _r = range(x.shape[1])
        h = a[:, t] * h + b[:, t]             if loop_runtime.ok(_r, (a, b), (1, 1), (a, b)):
        hs.append(h)                              def _step(_c, _x, _i):
    y = torch.stack(hs, 1)                            (h,) = _c
                                                      (_x0, _x1) = _x
                                                      h = _x0 * h + _x1
                                                      _y0 = h
                                                      return (h,), (_y0,)
                                                  (h,), _ys = loop_runtime.run(_step, (h,), (a, b), (1, 1), _r, ())
                                                  hs = loop_runtime.stacked(_ys[0], True)
                                              else:
                                                  for t in _r:  <the loop as written>
                                              y = loop_runtime.stack(hs, 1)

The rewritten function is what dynamo inlines in place of the original (its ``_torchdynamo_inline``, the attribute
dynamo itself reads to unwrap a function); the original is not changed and runs as written in eager and for every
other backend (``ok`` is false unless the trace is for ``backend="adjoint"`` with ``roll_loops`` on). The rolled
form is then an ordinary torch ``scan`` to the backend's recognizers (passes/match/find_recurrences.py).

A loop is rolled only when this can be read from its source (otherwise it stays as written, and the reason is
logged at INFO and kept in :func:`rolled`):

* ``t`` appears only as an index ``X[t]``, ``X[:, t]``, ``X[..., t, 1:]``: after full slices or an ellipsis, into a
  sequence ``X`` (a name or ``self.attr``) the body does not assign;
* the body is assignments to names and ``L.append(expr)`` to lists made empty before the loop; no control flow, no
  ``t`` arithmetic, no writes into tensors or attributes;
* every call is a torch function or tensor method that is not in-place and does not leave the graph (``item``,
  ``nonzero``, ...), or a call of a submodule or method whose own code is such (checked on the modules reachable from
  the compiled frame);
* a name the body assigns and reads first is a carry, defined before the loop; any other name it assigns (and ``t``)
  is not read after the loop; a list is read after it only by ``torch.stack`` (else it is rebuilt as a list);
* at trace time (``loop_runtime.ok``): at least three steps, the indexed sequences are tensors long enough, and no
  name of the function the step reads (but ``self``) holds a float (scan refuses one that dynamo made symbolic) or
  a module (its calls were not checked).

NB: the function is found on the modules and functions reachable from the frame dynamo starts compiling (its
locals, closure and the globals it names), in the compile-start callback. For a loop in the compiled callable itself
(``torch.compile(model)``'s ``forward``), ``torch.compile`` compiles a frame around it (:mod:`.loop_install`).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import logging
import sys
import types
import warnings
import weakref
from typing import Any

import torch

from ..errors import AdjointCompileWarning
from . import _ORIGINS, loop_runtime
from .loop_calls import EVERY, _const_int, _Fn, _Reject, _attr_path, _check_calls, _names, _parse, _root, self_param
from .loop_source import _accumulated, _following, _live, _made_empty, _stack_uses

log = logging.getLogger(__name__)

__all__ = ["analyse", "rolled", "refused", "LoopReport"]

_ORIGINS.update(loop_runtime.ORIGINS)

P = "__ac_"  # prefix of every name the rewrite adds


@dataclasses.dataclass(frozen=True)
class LoopReport:
    """One ``for`` loop over ``range`` in a function's source, and what became of it."""
    where: str           # file:line
    rolled: bool
    reason: str          # why not, or what it carries


#: code object -> (the rewritten code or None, a report per loop, the step's self.x(...) calls)
_RESULTS: dict[types.CodeType, tuple[types.CodeType | None, tuple[LoopReport, ...], set[tuple[str, ...]]]] = {}
#: function -> its rolled form (the rewritten code with this function's globals, closure cells and defaults)
_ROLLED: weakref.WeakKeyDictionary[types.FunctionType, types.FunctionType] = weakref.WeakKeyDictionary()
#: (file, line) of the functions already warned about: their module is not sys.modules' (loops left unrolled)
_UNREGISTERED: set[tuple[str, int]] = set()


def rolled() -> dict[str, tuple[LoopReport, ...]]:
    """Function qualname -> its loops over ``range`` and whether each is rolled (functions looked at so far)."""
    return {code.co_qualname if hasattr(code, "co_qualname") else code.co_name: reps
            for code, (_, reps, _) in _RESULTS.items() if reps}


def refused(fn: types.FunctionType, why: str) -> None:
    """Record that ``fn``'s rolled form is not used (an instance's step calls a submodule that may not trace inside
    torch's scan): its loops run as written."""
    code = fn.__code__
    if code in _RESULTS:
        new, reps, calls = _RESULTS[code]
        _RESULTS[code] = (new, tuple(dataclasses.replace(r, rolled=False, reason=why) if r.rolled else r
                                     for r in reps), calls)


def _full_slice(e: ast.expr) -> bool:
    return isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None


def _ellipsis(e: ast.expr) -> bool:
    return isinstance(e, ast.Constant) and e.value is Ellipsis


class _IndexByT(ast.NodeTransformer):
    """Replaces each ``X[..., t, rest]`` by ``__ac_x{i}[..., rest]`` (``X`` moved time first and indexed at the
    step); records (X, dim) per sequence."""

    def __init__(self, var: str, assigned: set[str]) -> None:
        self.var, self.assigned = var, assigned
        self.xs: list[tuple[ast.expr, int]] = []
        self._keys: dict[tuple[str, int], int] = {}

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        pos = [i for i, e in enumerate(elts) if isinstance(e, ast.Name) and e.id == self.var]
        if not pos:
            return self.generic_visit(node)
        if len(pos) > 1 or not isinstance(node.ctx, ast.Load):
            raise _Reject("t indexes a write, or twice")
        k = pos[0]
        before, after = elts[:k], elts[k + 1:]
        root = _root(node.value)
        if _attr_path(node.value) is None or root in self.assigned or root == self.var:
            raise _Reject("t indexes something the step assigns, or not a name")
        if all(_full_slice(e) for e in before):
            # NB: the step's slice has X's dims but t's, in order: the items after t (``...``, ``None`` too) index
            # the same dims of it as of X
            dim = len(before)
        elif len(before) == 1 and _ellipsis(before[0]):
            if any(_ellipsis(e) or (isinstance(e, ast.Constant) and e.value is None) for e in after):
                raise _Reject("an ellipsis or None after t, after an ellipsis")
            dim = -(len(after) + 1)
        else:
            raise _Reject("t indexes after something other than full slices")
        key = (ast.dump(node.value), dim)
        if key not in self._keys:
            self._keys[key] = len(self.xs)
            self.xs.append((node.value, dim))
        x = ast.Name(f"{P}x{self._keys[key]}", ast.Load())
        rest = [self.visit(e) for e in before + after]
        if not rest:
            return ast.copy_location(x, node)
        sl = rest[0] if len(rest) == 1 and not before else ast.Tuple(rest, ast.Load())
        return ast.copy_location(ast.Subscript(x, sl, ast.Load()), node)


def _range_args(loop: ast.For) -> list[ast.expr]:
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and not it.keywords
            and 1 <= len(it.args) <= 3 and not any(isinstance(a, ast.Starred) for a in it.args)):
        raise _Reject("not a loop over range(...)")
    if not isinstance(loop.target, ast.Name):
        raise _Reject("the loop variable is not a name")
    if loop.orelse:
        raise _Reject("for ... else")
    return it.args


def _append_target(s: ast.stmt) -> str | None:
    if (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Attribute)
            and s.value.func.attr == "append" and isinstance(s.value.func.value, ast.Name)
            and len(s.value.args) == 1 and not s.value.keywords):
        return s.value.func.value.id
    return None


def _stmt_stores(s: ast.stmt, var: str) -> tuple[set[str], set[str]]:
    """The names ``s`` assigns, and the lists it writes an item of (``hs[l] = h``: a list of per-layer states, by a
    name or a number; a tensor there is refused at trace time, :func:`.loop_runtime.ok`)."""
    if isinstance(s, ast.Assign):
        targets = s.targets
    elif isinstance(s, ast.AugAssign):
        # NB: on a tensor ``h += x`` writes in place (every step's appended h is one tensor); scan refuses it
        raise _Reject(f"an in-place update ({ast.unparse(s).strip()}) in the step")
    elif isinstance(s, ast.AnnAssign) and s.value is not None:
        targets = [s.target]
    else:
        raise _Reject(f"a {type(s).__name__} statement in the step")
    out: set[str] = set()
    items: set[str] = set()
    for t in targets:
        if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id != var
                and (isinstance(t.slice, ast.Name) and t.slice.id != var or _const_int(t.slice) is not None)):
            items.add(t.value.id)
            continue
        for n in ast.walk(t):
            if isinstance(n, (ast.Subscript, ast.Attribute, ast.Starred)):
                raise _Reject("a write into a tensor, attribute or starred target")
            if isinstance(n, ast.Name):
                out.add(n.id)
    return out, items


def _inner_head(s: ast.For, var: str, f: _Fn) -> set[str]:
    """Checks a loop inside the step (over the layers: ``for l, cell in enumerate(self.cells)``), which dynamo
    unrolls in the traced step; the names it binds. The instance's containers it goes over are checked item by
    item, as ``self.cells[l](...)`` is."""
    if s.orelse or var in _names(s.iter, ast.Load):
        raise _Reject("a loop in the step goes over the steps, or has an else")
    if any(isinstance(n, ast.For) for b in s.body for n in ast.walk(b)):
        raise _Reject("loops nested two deep in the step")
    _check_calls(s.iter, f)
    heads = s.iter.args if isinstance(s.iter, ast.Call) and getattr(s.iter.func, "id", None) in (
        "enumerate", "zip", "reversed") else [s.iter]
    for h in heads:
        path = _attr_path(h)
        if path is not None and path[0] == f.self_name and len(path) >= 2:
            f.module_calls.add((*path[1:], EVERY))
    return _names(s.target, ast.Store)


@dataclasses.dataclass
class _Plan:
    loop: ast.For
    path: list[tuple[list[ast.stmt], int, ast.AST]]
    carries: list[str]
    lists: list[str]
    stacks: list[list[ast.Call] | None]
    xs: list[tuple[ast.expr, int]]
    body: list[ast.stmt]
    #: the function's own names the step reads and does not assign, but self (loop_runtime.ok checks them)
    invariants: list[str]
    #: sums over the steps (``loss = loss + e``): a per-step output e, added up after the loop
    sums: list[str]
    #: carries that are lists the step writes items of (``hs[l] = ...``): lists at trace time, carried as their items
    items: list[str]


def _plan(loop: ast.For, path: list[tuple[list[ast.stmt], int, ast.AST]], f: _Fn, tree: ast.FunctionDef) -> _Plan:
    _range_args(loop)
    var = loop.target.id
    block, idx, _ = path[-1]
    lists: list[str] = []
    assigned: set[str] = set()
    read_first: list[str] = []
    accs: dict[str, ast.stmt] = {}
    items: set[str] = set()

    def note(loads: set[str], stores: set[str]) -> None:
        nonlocal assigned
        read_first.extend(n for n in sorted(loads) if n not in assigned and n not in read_first)
        assigned |= stores

    def visit(stmts: list[ast.stmt], inner: bool) -> None:
        for s in stmts:
            if isinstance(s, ast.Pass):
                continue
            if isinstance(s, ast.For) and not inner:
                note(_names(s.iter, ast.Load), _inner_head(s, var, f))
                visit(s.body, True)
                continue
            lst = _append_target(s)
            if inner and lst is not None:
                raise _Reject(f"{lst} is appended to in a loop inside the step")
            if not inner and (acc := _accumulated(s, loop.body, block[:idx])) is not None:
                accs[acc[0]] = s
                _check_calls(acc[1], f)
                note(_names(acc[1], ast.Load), set())
            elif lst is not None:
                if lst in lists:
                    raise _Reject(f"{lst} is appended to twice a step")
                lists.append(lst)
                _check_calls(s.value.args[0], f)
                note(_names(s.value.args[0], ast.Load), set())
            else:
                stores, written = _stmt_stores(s, var)
                _check_calls(s, f)
                items.update(written)
                note(_names(s, ast.Load), stores | written)
    visit(loop.body, False)
    if not lists and not assigned and not accs:
        raise _Reject("the step assigns nothing")
    for lst in lists:
        if lst in assigned or lst in read_first:
            raise _Reject(f"the step uses the list {lst} other than by append")
        made = [j for j in range(idx) if lst in _names(block[j], ast.Store) | _names(block[j], ast.Load)]
        if not made or not _made_empty(block[made[-1]], lst):
            raise _Reject(f"{lst} is not made empty just before the loop")
    if var in assigned:
        raise _Reject("the step assigns the loop variable")
    carries = [n for n in read_first if n in assigned]
    if both := next((n for n in items if any(n in _stmt_stores(s, var)[0] for s in ast.walk(loop)
                                               if isinstance(s, (ast.Assign, ast.AnnAssign)))), None):
        raise _Reject(f"the step writes items of {both} and assigns it")
    before = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
              and n.lineno < loop.lineno}
    for c in carries + list(accs):
        if c not in before and c not in f.params:
            raise _Reject(f"the carry {c} is not assigned before the loop")
    indexer = _IndexByT(var, assigned | set(lists) | set(accs))
    body = [indexer.visit(copy.deepcopy(s)) for s in loop.body]
    if var in set().union(*(_names(s, ast.Load) for s in body)):
        raise _Reject("t is used other than as an index")
    if not indexer.xs:
        raise _Reject("the step indexes no sequence by t")
    after = _following(path)
    for n in (assigned - set(carries)) | {var}:
        if _live(n, after):
            raise _Reject(f"{n} is read after the loop")
    torch_names = {k for k, v in f.fn.__globals__.items() if v is torch}
    if "torch" not in f.fn.__globals__:
        torch_names.add("torch")  # NB: an ``import torch`` in an enclosing function
    stacks = [_stack_uses(lst, after, torch_names) for lst in lists]
    own = before | f.params | set(f.fn.__code__.co_freevars)
    # NB: self's submodule calls are checked per instance (loop_install); any other module the step reads is not
    invariants = [n for n in read_first if n not in assigned and n != var and n in own and n != f.self_name]
    return _Plan(loop, path, carries, lists, stacks, indexer.xs, body, invariants, list(accs),
                 [c for c in carries if c in items])


def _tup(names: list[str], ctx: type) -> ast.Tuple:
    return ast.Tuple([ast.Name(n, ctx()) for n in names], ctx())


def _rewrite(p: _Plan, k: int) -> list[ast.stmt]:
    """The statements that replace the loop (see the module doc)."""
    rt = f"{P}rt"
    r, step, ys = f"{P}r{k}", f"{P}step{k}", f"{P}ys{k}"
    xs = ast.Tuple([copy.deepcopy(x) for x, _ in p.xs], ast.Load())
    dims = ast.Tuple([ast.Constant(d) for _, d in p.xs], ast.Load())
    inner: list[ast.stmt] = []
    if p.carries:
        inner.append(ast.Assign([_tup(p.carries, ast.Store)], ast.Name(f"{P}c", ast.Load())))
    if p.invariants:
        inner.append(ast.Assign([_tup(p.invariants, ast.Store)], ast.Name(f"{P}i", ast.Load())))
    inner.append(ast.Assign([_tup([f"{P}x{i}" for i in range(len(p.xs))], ast.Store)], ast.Name(f"{P}x", ast.Load())))
    j, out_of = 0, {}
    for s in p.body:
        acc = _accumulated(s) if p.sums else None
        if _append_target(s) is not None or acc is not None and acc[0] in p.sums:
            out_of[_append_target(s) or acc[0]] = j
            inner.append(ast.Assign([ast.Name(f"{P}y{j}", ast.Store())], acc[1] if acc else s.value.args[0]))
            j += 1
        else:
            inner.append(s)
    inner.append(ast.Return(ast.Tuple([_tup(p.carries, ast.Load),
                                       _tup([f"{P}y{i}" for i in range(j)], ast.Load)], ast.Load())))
    fdef = _def(step, [f"{P}c", f"{P}x", f"{P}i"], inner)
    call = ast.Call(ast.Attribute(ast.Name(rt, ast.Load()), "run", ast.Load()),
                    [ast.Name(step, ast.Load()), _tup(p.carries, ast.Load), xs, dims, ast.Name(r, ast.Load()),
                     _tup(p.invariants, ast.Load),
                     ast.Tuple([ast.Constant(p.carries.index(c)) for c in p.items], ast.Load())], [])
    # NB: a list the step writes items of gets its final items written back into it (``hs[:] = ...``), as the
    # loop's writes would have: another name for the list (``saved = hs``, the caller's) sees them
    got = [f"{P}items{k}_{c}" if c in p.items else c for c in p.carries]
    rolled: list[ast.stmt] = [fdef, ast.Assign([ast.Tuple([_tup(got, ast.Store), ast.Name(ys, ast.Store())],
                                                          ast.Store())], call)]
    rolled += [ast.Assign([ast.Subscript(ast.Name(c, ast.Load()), ast.Slice(), ast.Store())], ast.Name(g, ast.Load()))
               for c, g in zip(p.carries, got) if c != g]
    for i, lst in enumerate(p.lists):
        rolled.append(ast.Assign([ast.Name(lst, ast.Store())], ast.Call(
            ast.Attribute(ast.Name(rt, ast.Load()), "stacked", ast.Load()),
            [ast.Subscript(ast.Name(ys, ast.Load()), ast.Constant(out_of[lst]), ast.Load()),
             ast.Constant(p.stacks[i] is not None)], [])))
        for c in p.stacks[i] or ():
            c.func = ast.Attribute(ast.Name(rt, ast.Load()), "stack", ast.Load())
    for c in p.sums:
        rolled.append(ast.Assign([ast.Name(c, ast.Store())], ast.Call(
            ast.Attribute(ast.Name(rt, ast.Load()), "total", ast.Load()),
            [ast.Name(c, ast.Load()), ast.Subscript(ast.Name(ys, ast.Load()), ast.Constant(out_of[c]), ast.Load())],
            [])))
    loop = p.loop
    args = _range_args(loop)
    loop.iter = ast.Name(r, ast.Load())
    guard = ast.Call(ast.Attribute(ast.Name(rt, ast.Load()), "ok", ast.Load()),
                     [ast.Name(r, ast.Load()), ast.Tuple([copy.deepcopy(x) for x, _ in p.xs], ast.Load()), dims,
                      _tup(p.invariants, ast.Load), _tup(p.items, ast.Load)], [])
    out = [ast.Assign([ast.Name(r, ast.Store())], ast.Call(ast.Name("range", ast.Load()), args, [])),
           ast.If(guard, rolled, [loop])]
    for s in out:
        ast.copy_location(s, loop)
    return out


def _def(name: str, params: list[str], body: list[ast.stmt]) -> ast.FunctionDef:
    extra: dict[str, Any] = {"type_params": []} if sys.version_info >= (3, 12) else {}
    return ast.FunctionDef(name, ast.arguments([], [ast.arg(n) for n in params], None, [], [], None, []), body, [],
                           None, **extra)


def _loops(tree: ast.FunctionDef) -> list[tuple[ast.For, list[tuple[list[ast.stmt], int, ast.AST]]]]:
    """Every ``for`` statement of the function (not of functions nested in it), with its path of blocks."""
    out: list[tuple[ast.For, list[tuple[list[ast.stmt], int, ast.AST]]]] = []

    def visit(owner: ast.AST, path: list[tuple[list[ast.stmt], int, ast.AST]]) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(owner, field, None)
            if not isinstance(block, list):
                continue
            for i, s in enumerate(block):
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                here = path + [(block, i, owner)]
                if isinstance(s, ast.For):
                    out.append((s, here))
                visit(s, here)
    visit(tree, [])
    return out


def analyse(fn: types.FunctionType) -> tuple[types.FunctionType | None, tuple[LoopReport, ...], set[tuple[str, ...]]]:
    """The function with its rollable loops rewritten (None when none is), a report per loop over ``range``, and
    the ``self.x(...)`` calls its rolled steps make (to check on each instance). The rewrite is made once per code
    object; each function object gets its own rolled form, with its own closure cells."""
    code = fn.__code__
    if code not in _RESULTS:
        _RESULTS[code] = _analyse(fn)
        for rep in _RESULTS[code][1]:
            log.info("adjoint-compile loop at %s: %s", rep.where,
                     "rolled" if rep.rolled else f"not rolled: {rep.reason}")
    new_code, reports, calls = _RESULTS[code]
    if new_code is None:
        return None, reports, calls
    if getattr(sys.modules.get(fn.__globals__.get("__name__", "")), "__dict__", None) is not fn.__globals__:
        # NB: dynamo guards the runtime global through sys.modules[name]: a module loaded from a file path
        # (spec_from_file_location) is not there, or another module is
        why = (f"its module {fn.__globals__.get('__name__')!r} is not sys.modules' (loaded from a file path?): "
               "register it there (sys.modules[name] = module) to roll its loops")
        if (at := (code.co_filename, code.co_firstlineno)) not in _UNREGISTERED:  # NB: equal code objects of two files
            _UNREGISTERED.add(at)
            warnings.warn(AdjointCompileWarning(
                f"adjoint-compile: the loop(s) of {fn.__qualname__} are not rolled: {why}; dynamo unrolls them "
                "(compile time grows with the length)"), stacklevel=2)
        return None, tuple(dataclasses.replace(r, rolled=False, reason=why) for r in reports if r.rolled), calls
    if fn not in _ROLLED:
        # NB: dynamo reaches a closure cell and a global of the inlined function through the original function, so
        # the cells are the original's, in its order, and the runtime is a global of the function's module
        fn.__globals__.setdefault(f"{P}rt", loop_runtime)
        new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
        new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
        _ROLLED[fn] = new
    return _ROLLED[fn], reports, calls


def _analyse(fn: types.FunctionType) -> tuple[types.CodeType | None, tuple[LoopReport, ...], set[tuple[str, ...]]]:
    if "range" not in fn.__code__.co_names:
        return None, (), set()
    try:
        tree = _parse(fn)
    except (OSError, TypeError, SyntaxError, _Reject):
        return None, (), set()
    params = {a.arg for a in ast.walk(tree.args) if isinstance(a, ast.arg)}
    f = _Fn(fn, params, _names(tree, ast.Store) | params, self_name=self_param(fn, tree))
    tree.decorator_list = []
    plans, reports = [], []
    for loop, path in _loops(tree):
        where = f"{fn.__code__.co_filename}:{loop.lineno}"
        if any(owner is p.loop for p in plans for _, _, owner in path):
            continue  # NB: a loop over the layers in a rolled step: dynamo unrolls it in the traced step
        try:
            plan = _plan(loop, path, f, tree)
        except _Reject as e:
            if isinstance(loop.iter, ast.Call) and getattr(loop.iter.func, "id", None) == "range":
                reports.append(LoopReport(where, False, str(e)))
            continue
        plans.append(plan)
        reports.append(LoopReport(where, True, f"carries {', '.join(plan.carries) or 'nothing'}; "
                                               f"collects {', '.join(plan.lists) or 'nothing'}"
                                  + (f"; sums {', '.join(plan.sums)}" if plan.sums else "")))
    if not plans:
        return None, tuple(reports), set()
    # NB: innermost blocks last in source order: replace from the end so earlier indices stay valid
    for k, plan in sorted(enumerate(plans), key=lambda kp: -kp[1].loop.lineno):
        block, i, _ = plan.path[-1]
        block[i:i + 1] = _rewrite(plan, k)
    try:
        new_code = _compile(fn, tree)
    except Exception as e:  # noqa: BLE001 - a rewrite that does not compile leaves the function as written
        log.warning("adjoint-compile: could not rebuild %s with its loops rolled (%s: %s); dynamo unrolls them",
                    fn.__qualname__, type(e).__name__, e)
        return None, tuple(dataclasses.replace(r, rolled=False, reason=f"rebuild failed: {e}") for r in reports), set()
    return new_code, tuple(reports), set(f.module_calls)


def _compile(fn: types.FunctionType, tree: ast.FunctionDef) -> types.CodeType:
    """The rewritten def compiled with the original's file and lines, and its free variables in the same order
    (the cells are the original function's)."""
    free = fn.__code__.co_freevars
    body: ast.stmt = tree
    if "__class__" in free:
        body = ast.ClassDef(f"{P}K", [], [], [tree], [])  # NB: zero-argument super() needs a __class__ cell
    outer = _def(f"{P}outer", [n for n in free if n != "__class__"], [body, ast.Return(ast.Constant(None))])
    mod = ast.Module([outer], [])
    ast.copy_location(outer, tree)
    ast.fix_missing_locations(mod)
    code = compile(mod, fn.__code__.co_filename, "exec")
    scope = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    if "__class__" in free:
        scope = next(c for c in scope.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in scope.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    if inner.co_freevars != free:
        raise _Reject(f"closure {inner.co_freevars} differs from {free}")
    return inner
