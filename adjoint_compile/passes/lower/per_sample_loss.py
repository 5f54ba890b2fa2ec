"""Language-model losses under ``per_sample_clip`` (issue 33): the parts of passes/lower/per_sample.py's analysis that
concern the head and the loss.

- A head on flattened rows: ``linear(h.flatten(0, 1), W, b)`` (``F.linear_cross_entropy``'s reference path, a head
  applied after ``view(-1, D)``), ``h.view(-1, D) @ W`` and ``addmm(b, h.view(-1, D), W)`` (transformers' Conv1D)
  take rows of [B, T, D] activations merged into [B·T, D]: :func:`flat_rows` finds the activation before the
  merge, so the use is lowered on it (rows stay attributed to their examples) and its output flattened after.
- The tail of the loss: a value reduced over the batch axis ("R") may only meet a linear tail on its way to the
  output. A reduction over the batch of a value computed without parameters (``mask.sum()``, a count of valid
  targets) is a constant of the gradient, kind "D": it may scale or divide the loss (``(ce * mask).sum() /
  mask.sum()``), like the count that ``reduction="mean"`` divides by. :func:`tail_kind` decides; a loss in a
  divisor (``2 / loss``), a product of two losses, or a batch reduction meeting an activation is refused.
"""
from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.fx import example_value as _val
from ...analysis.optable import target_name as _name
from ...errors import AdjointCompileWarning

__all__ = ["direct_param", "flat_rows", "on_merged_rows", "param_dependent", "region_loss_kind",
           "tail_kind", "warn_data_divisor", "short_of"]

#: what may follow a batch reduction on the way to the output: the loss stays a sum of per-example losses
LINEAR_TAIL = frozenset("add sub neg mul truediv div iadd isub imul itruediv __add__ __sub__ __mul__ __truediv__ "
                        "__neg__ sum mean float double to stack cat concat getitem unsqueeze squeeze view reshape "
                        "flatten clone contiguous matmul __matmul__ dot mv".split())
_PRODUCTS = frozenset("mul imul __mul__ matmul __matmul__ dot mv".split())
_QUOTIENTS = frozenset("truediv div itruediv __truediv__".split())
_MERGES = frozenset("view reshape flatten".split())


def direct_param(a: Any, kind_of: dict[fx.Node, str]) -> bool:
    """Whether ``a`` is a parameter itself (a placeholder or attribute of kind "P"), not a value computed from one."""
    return isinstance(a, fx.Node) and a.op in ("placeholder", "get_attr") and kind_of.get(a) == "P"


def flat_rows(n: fx.Node, kind_of: dict[fx.Node, str], bd: int, batch: int) -> tuple[fx.Node, Any, Any, bool] | None:
    """``(x, W, b, transposed)`` when ``n`` applies a parameter matrix to rows of ``x`` (an activation with the
    examples on ``bd``) merged into [rows, d]: ``addmm(b, x.view(-1, d), W)``, ``x.view(-1, d) @ W`` or
    ``linear(x.flatten(0, 1), W, b)``; else None."""
    args = n.args
    if n.target is torch.addmm and len(args) == 3 and not n.kwargs and direct_param(args[0], kind_of) and \
            direct_param(args[2], kind_of):
        v, w, b, transposed = args[1], args[2], args[0], True
    elif n.target in (torch._C._nn.linear, F.linear) and len(args) >= 2 and direct_param(args[1], kind_of):
        b = args[2] if len(args) > 2 else n.kwargs.get("bias")
        if not (b is None or direct_param(b, kind_of)) or (len(args) > 3 or set(n.kwargs) - {"bias"}):
            return None
        v, w, transposed = args[0], args[1], False
    elif (n.target in (operator.matmul, torch.matmul, torch.mm) or n.op == "call_method" and _name(n) in (
            "matmul", "mm")) and \
            len(args) == 2 and not n.kwargs and direct_param(args[1], kind_of):
        v, w, b, transposed = args[0], args[1], None, True
    else:
        return None
    x = _row_merge(v, kind_of, bd, batch)
    if x is None or not (_val(v).dim() == 2 and isinstance(_val(w), torch.Tensor) and _val(w).dim() == 2):
        return None
    return x, w, b, transposed


def _row_merge(v: Any, kind_of: dict[fx.Node, str], bd: int, batch: int) -> fx.Node | None:
    """``x`` when ``v`` merges the leading axes of the activation ``x``, its examples' axis ``bd`` among them, into
    rows ``[rows, *x.shape[k:]]`` (``view``, ``reshape``, ``flatten``; row-major, so each row is one example's); else
    None."""
    if not (isinstance(v, fx.Node) and _name(v) in _MERGES and v.args and isinstance(v.args[0], fx.Node) and
            kind_of.get(v.args[0]) in ("A", "M")):
        return None
    x, xv, vv = v.args[0], _val(v.args[0]), _val(v)
    if not (isinstance(xv, torch.Tensor) and isinstance(vv, torch.Tensor) and vv.dim() >= 1):
        return None
    k = xv.dim() - (vv.dim() - 1)  # NB: x's axes from k on are the rows' own
    if not (k > bd and int(xv.shape[bd]) == batch and tuple(xv.shape[k:]) == tuple(vv.shape[1:])):
        return None
    return x


#: element-wise parameter uses, and norms: each row of merged rows by itself when the parameters stop short of them
_ROWWISE = frozenset("mul add sub truediv div __mul__ __add__ __sub__ __truediv__ __rmul__ __radd__ __rsub__ "
                     "__rtruediv__".split())
_NORMS = frozenset("layer_norm rms_norm".split())
_PRODUCTS_OF_ROWS = frozenset("linear matmul mm".split())


def short_of(p: Any, nd: int, bd: int) -> bool:
    """Whether the value ``p`` broadcast against ``nd`` axes stops short of axis ``bd`` (its axes there are 1s)."""
    pv = _val(p)
    if not isinstance(pv, torch.Tensor):
        return not isinstance(p, fx.Node)  # NB: a number
    lead = nd - pv.dim()  # NB: p's axis j lines up with axis lead + j
    return all(int(pv.shape[j]) == 1 for j in range(max(0, bd + 1 - lead)))


def on_merged_rows(n: fx.Node, rows: fx.Node, kind_of: dict[fx.Node, str], bd: int, batch: int) -> bool:
    """Whether the parameter use ``n`` works on each row of ``rows`` by itself, where ``rows`` has the examples as
    the outermost factor of its axis ``bd`` (``[B·T, D]``, merged row-major: analysis/batch_axes.py) rather than on
    it: element-wise with a parameter that stops short of that axis (``h.flatten(0, 1) * g``, ``h.view(-1, D) @ W +
    b``), a norm over later axes, a product on the last axis. Then n on ``rows.unflatten(bd, (B, -1))``, flattened
    after, is the same value with the examples on their own axis."""
    rv, v, name = _val(rows), _val(n), _name(n)
    if not (isinstance(rv, torch.Tensor) and isinstance(v, torch.Tensor) and rv.dim() > bd and v.dim() > bd and
            int(rv.shape[bd]) != batch and int(rv.shape[bd]) % batch == 0 and v.shape[bd] == rv.shape[bd]):
        return False
    if name in _ROWWISE and len(n.args) == 2 and not n.kwargs and rows in n.args:
        # NB: a parameter, or a value of parameters alone (``/ torch.exp(s)``: lowered by the generic vmap)
        p = n.args[1] if n.args[0] is rows else n.args[0]
        return kind_of.get(p) == "P" and short_of(p, v.dim(), bd) and tuple(v.shape) == tuple(rv.shape)
    if name in _NORMS and n.args and n.args[0] is rows and len(n.args) > 1:
        return isinstance(n.args[1], (list, tuple)) and len(n.args[1]) < rv.dim() - bd
    if name in _PRODUCTS_OF_ROWS and len(n.args) >= 2 and n.args[0] is rows and direct_param(n.args[1], kind_of):
        return rv.dim() - 1 > bd and _val(n.args[1]).dim() == 2
    return False


def region_loss_kind(n: fx.Node, gm: fx.GraphModule) -> str | None:
    """The kind ("R" or "D") of ``n`` when it is an output of a sharded region that sums over the examples (the loss
    the region took in; runtime/sharded_ps.py), else None."""
    call = n.args[0] if n.target is operator.getitem and n.args else None
    if not (isinstance(call, fx.Node) and call.op == "call_module"):
        return None
    ps = getattr(gm.get_submodule(str(call.target)), "per_sample", None)
    return None if ps is None else ps.loss_kinds.get(n.args[1])


def param_dependent(n: fx.Node, kind_of: dict[fx.Node, str]) -> bool:
    """Whether ``n`` is computed from a parameter (a "P" or "M" value among its ancestors, itself included)."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if kind_of.get(m) in ("P", "M"):
            return True
        todo += m.all_input_nodes
    return False


def tail_kind(n: fx.Node, kind_of: dict[fx.Node, str]) -> str | None:
    """The kind of ``n``, one of whose inputs is reduced over the batch ("R" the loss, "D" a constant of the
    gradient): "R", "D", or None when the examples would interact (the caller refuses it)."""
    ins = [kind_of.get(a, "C") for a in n.all_input_nodes]
    if any(k in ("A", "P", "M") for k in ins):
        return None
    if "R" not in ins:
        return "D"  # NB: data only (counts, masks' sums) and constants: any op
    name = _name(n)
    if name not in LINEAR_TAIL or (name in _PRODUCTS | _QUOTIENTS and ins.count("R") > 1):
        return None
    if name in _QUOTIENTS and len(n.args) > 1 and isinstance(n.args[1], fx.Node) and kind_of.get(n.args[1]) == "R":
        return None  # NB: a loss in the divisor (2 / loss): not a sum of per-example losses
    return "R"


_WARNED: set[str] = set()


def warn_data_divisor(gm: fx.GraphModule, kind_of: dict[fx.Node, str], clip: float,
                      where: Callable[[fx.Node], str]) -> None:
    """A loss divided by a batch-wide count (``/ mask.sum()``) divides every example's gradient and its norm by
    it, as a mean does (passes/lower/per_sample.py warns about means): once per source line."""
    if clip == float("inf"):
        return
    for n in gm.graph.nodes:
        if not (_name(n) in _QUOTIENTS and kind_of.get(n) == "R" and len(n.args) > 1 and
                isinstance(n.args[1], fx.Node) and kind_of.get(n.args[1]) == "D"):
            continue
        if (key := f"{where(n)} {n.name}") in _WARNED:
            continue
        _WARNED.add(key)
        warnings.warn(f"adjoint-compile per_sample_clip: the loss is divided by a value reduced over the batch "
                      f"({n.args[1].name} at {where(n)}), e.g. a count of valid targets: it divides every example's "
                      f"gradient and its norm by that count, so per_sample_clip={clip:g} bounds the summed loss's "
                      f"norms at count·C and may clip nothing. Reduce with a sum and divide the clipped gradients "
                      f"yourself (DP-SGD's form)", AdjointCompileWarning, stacklevel=2)
