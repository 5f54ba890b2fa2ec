"""What the statements around a loop over ``range`` read and write, read from its source (the loop roller,
:mod:`.loops`): what may run after the loop, whether a name is read there, how a list is read after it, and the
sums a step adds to (``loss = loss + e``).
"""
from __future__ import annotations

import ast

from .loop_calls import _Reject, _names


def _following(path: list[tuple[list[ast.stmt], int, ast.AST]]) -> list[ast.stmt]:
    """The statements that may run after the loop at ``path`` (innermost block first), with the bodies of enclosing
    loops from their start (their next iteration)."""
    out: list[ast.stmt] = []
    for level, (block, i, owner) in enumerate(reversed(path)):
        out.extend(block[i + 1:])
        if isinstance(owner, (ast.For, ast.While, ast.AsyncFor)):
            if level:
                raise _Reject("the loop is inside a block within another loop")
            out.extend(block[:i])
    return out


def _live(name: str, after: list[ast.stmt]) -> bool:
    """Whether ``name`` may be read after the loop before being assigned again (conservative)."""
    for s in after:
        if isinstance(s, ast.For) and isinstance(s.target, ast.Name) and s.target.id == name and \
                name not in _names(s.iter, ast.Load):
            continue  # NB: another loop over the same name rebinds it before its body reads it
        if name in _names(s, ast.Load) or isinstance(s, ast.AugAssign) and name in _names(s.target, ast.Store):
            return True
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets):
            return False
    return False


def _stack_uses(name: str, after: list[ast.stmt], torch_names: set[str]) -> list[ast.Call] | None:
    """The ``torch.stack(name, dim)`` calls that read the list ``name`` after the loop, or None when it is read
    some other way."""
    calls: list[ast.Call] = []
    for s in after:
        loads = [n for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        ok = {id(c.args[0]): c for c in ast.walk(s) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
              and c.func.attr == "stack" and isinstance(c.func.value, ast.Name) and c.func.value.id in torch_names
              and c.args and isinstance(c.args[0], ast.Name) and c.args[0].id == name and len(c.args) <= 2
              and all(k.arg == "dim" for k in c.keywords)}
        for n in loads:
            if id(n) not in ok:
                return None
            calls.append(ok[id(n)])
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets):
            break
    return calls


def _accumulated(s: ast.stmt, body: list[ast.stmt] | None = None,
                 before: list[ast.stmt] | None = None) -> tuple[str, ast.expr] | None:
    """``c = c + e``, ``c = e + c`` or ``c += e`` (c: a name): (c, e). Given the loop's ``body`` and the statements
    ``before`` it, only where c is a sum over the steps: no other statement of the step reads or writes c, nor does
    e; and ``+=`` only onto a number (on a tensor made before the loop it would write into that tensor)."""
    if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Add) and isinstance(s.target, ast.Name):
        c, term = s.target.id, s.value
    elif (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
          and isinstance(s.value, ast.BinOp) and isinstance(s.value.op, ast.Add)):
        c = s.targets[0].id
        mine = [(x, y) for x, y in ((s.value.left, s.value.right), (s.value.right, s.value.left))
                if isinstance(x, ast.Name) and x.id == c]
        if not mine:
            return None
        term = mine[0][1]
    else:
        return None
    if body is None:
        return c, term
    if c in _names(term, ast.Load) or any(c in _names(o, ast.Load) | _names(o, ast.Store) for o in body if o is not s):
        return None
    if isinstance(s, ast.AugAssign):
        made = [o for o in before or () if c in _names(o, ast.Store)]
        value = _assigned(made[-1], c) if made else None
        if not (isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
                and not isinstance(value.value, bool)):
            return None
    return c, term


def _assigned(s: ast.stmt, name: str) -> ast.expr | None:
    """The expression ``s`` assigns to ``name``: ``name = e``, or its item of ``a, name = e1, e2``."""
    if not (isinstance(s, ast.Assign) and len(s.targets) == 1):
        return None
    target, value = s.targets[0], s.value
    if isinstance(target, ast.Name):
        return value if target.id == name else None
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return next((v for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name) and t.id == name), None)
    return None


def _made_empty(s: ast.stmt, name: str) -> bool:
    """``name = []`` / ``list()``, or one of ``a, name = [], []``."""
    v = _assigned(s, name)
    return isinstance(v, ast.List) and not v.elts or \
        isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "list" and not v.args
