"""Step-dim rules of the time-local analysis (:mod:`.time_local`) for ops that move data: views and reshapes,
permutations, indexing and slicing, split and cat. Each returns ``(step dim of the output or None, why it mixes
steps or None)`` (see :mod:`.rules`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from .fx import example_value
from .rules import Ctx, Rule, dims_arg, expands_along, norm_dim, op_label, step_shape


def _reshape_map(sin: tuple[int, ...], sout: tuple[int, ...], d: int, fold: int = 1,
                 T: int | None = None) -> tuple[int, int] | None:
    """Where the step axis (dim d of sin) lands in a row-major reshape to sout: (dim k of sout, its fold), or None
    when it does not stay a dim of its own.

    The axis survives at k iff dim k of sout has the same size and the same number of elements before it (fold
    1). With ``T`` given, a dim k of G·T elements whose last T are the steps (the dims merged into it end with the
    step dim: ``[B, T, V] -> [B·T, V]``) carries them with G folded in front (fold G); a step dim of ``fold``·T is
    read as ``fold`` dims in front of T (so ``[B·T] -> [B, T]`` unfolds it).
    NB: with several candidates (only possible next to size-1 dims when T == 1) the first is taken, fold 1 first;
    with T == 1 every choice is time-local.
    """
    if fold > 1:
        if T is None or sin[d] != fold * T:
            return None
        sin, d = (*sin[:d], fold, T, *sin[d + 1:]), d + 1
    before = math.prod(sin[:d])
    acc, folded = 1, None
    for k, n in enumerate(sout):
        if acc == before and n == sin[d]:
            return k, 1
        if folded is None and T and acc * n == before * sin[d] and n % T == 0 and n > T:
            folded = (k, n // T)
        acc *= n
        if isinstance(acc, int) and isinstance(before, int) and acc > before * sin[d] > 0:
            break
    return folded


def view(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0] if node.args else node.kwargs.get("input")
    d, s, out = ctx.sd(x), step_shape(x), ctx.out_shape
    if d is None:
        return None, None
    if out is None:
        return None, f"no shape for {node.name}"
    m = _reshape_map(s, out, d, ctx.info.folds.get(x, 1), ctx.T if ctx.info.fold_ok else None)
    if m is None:
        return None, f"{op_label(node)} merges or splits the step dim ({list(s)} -> {list(out)})"
    ctx.fold = m[1]
    return m[0], None


def expand(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s, out = ctx.sd(x), step_shape(x), ctx.out_shape
    if d is None:
        # a step-free x broadcast to a step-carrying tensor's shape (``lam.expand_as(bx)``, a constant decay):
        # the output carries that tensor's step axis, and a shard's expand gives its L steps
        other = ctx.arg(1, "other") if op_label(node) == "expand_as" else None
        do = ctx.sd(other)
        if do is None or out is None or step_shape(other) != out:
            return None, None
        if s is not None and 0 <= (k := do - (len(out) - len(s))) < len(s) and s[k] != 1:
            # NB: x has the steps itself (a decay per position, ``pos[:T]`` of shape [T, 1]): a table, not a constant
            return None, f"{node.args[0].name} has {s[k]} values along the step axis (a per-step table?)"
        return do, None
    if out is None:
        return None, f"no shape for {node.name}"
    return d + len(out) - len(s), None


def _int_list(args: Any) -> list[int] | None:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    return list(args) if all(isinstance(a, int) for a in args) else None


def permute(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    perm = _int_list(node.args[1:]) if node.args[1:] else _int_list((node.kwargs.get("dims"),))
    if perm is None or len(perm) != len(s):
        return None, "permute with unreadable dims"
    return [norm_dim(p, len(s)) for p in perm].index(d), None


def transpose(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    if op_label(node) == "t":
        d0, d1 = 0, len(s) - 1
    else:
        d0, d1 = ctx.arg(1, "dim0"), ctx.arg(2, "dim1")
        if not (isinstance(d0, int) and isinstance(d1, int)):
            return None, "transpose with unreadable dims"
        d0, d1 = norm_dim(d0, len(s)), norm_dim(d1, len(s))
    return (d1 if d == d0 else d0 if d == d1 else d), None


def movedim(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    src, dst = ctx.arg(1, "source"), ctx.arg(2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    n = len(s)
    src, dst = [norm_dim(a, n) for a in src], [norm_dim(a, n) for a in dst]
    order = [None] * n
    for a, b in zip(src, dst):
        order[b] = a
    rest = iter([k for k in range(n) if k not in src])
    order = [o if o is not None else next(rest) for o in order]
    return order.index(d), None


def unsqueeze(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    k = ctx.arg(1, "dim")
    if not isinstance(k, int):
        return None, "unsqueeze with an unreadable dim"
    k = norm_dim(k, len(s) + 1)
    return (d + 1 if k <= d else d), None


def squeeze(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x = node.args[0]
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    dims = dims_arg(ctx.arg(1, "dim"), len(s))
    if dims == []:
        return None, "squeeze with an unreadable dim"
    gone = [k for k in (range(len(s)) if dims is None else dims) if s[k] == 1]
    if d in gone:
        return None, "squeeze removes the step dim"
    return d - sum(1 for k in gone if k < d), None


def getitem(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, idx = node.args[0], node.args[1]
    d = ctx.sd(x)
    if isinstance(example_value(x), (tuple, list)):
        # element of a multi-output node (split, chunk, max(dim)): they share the step dim
        return (d, None) if isinstance(idx, int) else (None, "getitem on a tuple with a non-int index")
    s = step_shape(x)
    if d is None:
        return None, None
    if s is None:
        return None, f"no shape for {x.name}"
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, (fx.Node, list, torch.Tensor)) for i in items):
        return None, "advanced (tensor) indexing"
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (len(s) - n_real))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (len(s) - sum(1 for i in expanded if i is not None)))
    din = dout = 0
    for i in expanded:
        if i is None:
            dout += 1
            continue
        if din == d:
            if isinstance(i, slice):
                full = (i.start in (None, 0)) and (i.step in (None, 1)) and (i.stop is None or
                                                                           (isinstance(i.stop, int) and i.stop >= s[d]))
                if full:
                    return dout, None
                return None, f"slicing along the step dim ({i})"
            return None, "indexing a single step"
        if isinstance(i, slice):
            dout += 1
        din += 1
    return None, "unreadable index"


def split_like(dim_pos: int, default: int | None = 0, drop: bool = False) -> Rule:
    """select/narrow/split/chunk/unbind along ``dim`` (argument ``dim_pos``): time-local unless along the step dim;
    ``drop``: the op removes ``dim``."""
    def rule(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
        x = node.args[0]
        d, s = ctx.sd(x), step_shape(x)
        if d is None:
            return None, None
        dim = ctx.arg(dim_pos, "dim", default)
        if not isinstance(dim, int):
            return None, f"{op_label(node)} with an unreadable dim"
        dim = norm_dim(dim, len(s))
        if dim == d:
            return None, f"{op_label(node)} along the step dim"
        return (d - 1 if drop and dim < d else d), None

    return rule


def index_select(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    x, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d, s = ctx.sd(x), step_shape(x)
    if ctx.sd(idx) is not None:
        return None, "index_select with a step-dependent index"
    if d is None:
        return None, None
    if not isinstance(dim, int) or norm_dim(dim, len(s)) == d:
        return None, "index_select along the step dim"
    return d, None


def gather(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """``x.gather(dim, index)``: out[..., t, ...] reads x[..., t, ...] at the indices of index[..., t, ...] when
    both carry the step axis at the same dim and ``dim`` is another one (e.g. each step's target log-probability)."""
    x, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d, di = ctx.sd(x), ctx.sd(idx)
    if d is None and di is None:
        return None, None
    s = step_shape(x)
    if d is None or di is None or d != di or s is None or step_shape(idx) is None or len(step_shape(idx)) != len(s):
        return di if d is None else d, "gather whose input and index do not carry the step axis at one dim"
    if not isinstance(dim, int) or norm_dim(dim, len(s)) == d:
        return d, "gather along the step dim"
    return d, None


def cat(stack: bool) -> Rule:
    def rule(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
        tensors = ctx.arg(0, "tensors")
        dim = ctx.arg(1, "dim", 0)
        if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
            return None, f"{op_label(node)} with unreadable arguments"
        dims = {ctx.sd(t) for t in tensors}
        if dims == {None}:
            return None, None
        if None in dims:
            return None, f"{op_label(node)} of step-carrying and untracked tensors"
        if len(dims) != 1:
            return None, f"{op_label(node)} of tensors with the step axis at different dims"
        d = dims.pop()
        nd = len(step_shape(tensors[0]))
        if stack:
            k = norm_dim(dim, nd + 1)
            return (d + 1 if k <= d else d), None
        if norm_dim(dim, nd) == d:
            return None, "cat along the step dim"
        return d, None

    return rule


def complex_view(node: fx.Node, ctx: Ctx) -> tuple[int | None, str | None]:
    """``view_as_real`` (a new last dim of 2: the real and imaginary parts) and ``view_as_complex`` (the last dim of
    2 folded into complex elements): every other dim, the step dim included, stays where it was."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    d, s = ctx.sd(x), step_shape(x)
    if d is None:
        return None, None
    if s is None:
        return None, f"no shape for {node.name}"
    if op_label(node) == "view_as_complex" and d == len(s) - 1:
        return None, "view_as_complex folds the step dim into complex elements"
    return d, None


#: node meta: the step dim the analysis gave a broadcast at the length a region was lowered at, kept by the copy of
#: the region graph made for another length (runtime/length_generic.retarget), where the shapes may not tell
BROADCAST_DIM = "adjoint_broadcast_dim"


def broadcast_steps(node: fx.Node, T: int | None) -> int | None:
    """The one dim of ``node``'s output along which :func:`expands_along` holds, else None (none, or several: a
    batch of as many sequences as steps leaves which one is the step axis unknown, and the value stays step-free;
    at T = 1 every dim of 1 would do). A region graph copied for another length names the dim (:data:`BROADCAST_DIM`)."""
    out = step_shape(node)
    if T is None or out is None:
        return None
    hint = node.meta.get(BROADCAST_DIM)
    if hint is not None:
        return hint if expands_along(node, hint, T) else None
    dims = [d for d in range(len(out)) if expands_along(node, d, T)]
    return dims[0] if len(dims) == 1 and T > 1 else None
