"""What a rolled loop calls while dynamo traces it (:mod:`.loops` writes the calls): the guard that picks the rolled
form, the run that traces the step once as torch's ``scan``, and the stack that reads its stacked outputs.

A loop ``for t in range(start, stop): <step>`` over ``n = stop - start`` steps becomes, while dynamo traces for
``backend="adjoint"``::

    c_1, y_0 = step(c_0, x[0])            # two steps traced as written, to read their metadata
    c_2, y_1 = step(c_1, x[1])
    c_n, y   = scan(step, c_0, x)         # all n steps traced once, whatever n: y is [n, ...], time first

or, when ``c_0`` differs from ``c_1`` in metadata, ``scan(step, c_2, x[2:])`` after the two steps, whose outputs are
joined to scan's.

with ``x[i]`` the step's slices ``X[:, t]`` of each sequence the body indexes by ``t`` (``X`` moved time first).
NB: the two peeled steps are the check that scan cannot fail: torch's ``scan`` raises (it does not fall back) when
its carry changes metadata from one step to the next, and a loop's first step often does (``h = 0``, a zeros init
that broadcasts, a dtype that promotes, ``requires_grad`` appearing). After two steps whose carries and outputs are
tensors of the same metadata, every later step has it too (it is a function of the metadata alone). Otherwise the
steps run on as a Python loop (dynamo unrolls it, as before). The dead peeled steps are dropped with the graph's
dead code.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._higher_order_ops.scan import scan

from . import rolling

__all__ = ["ok", "run", "stacked", "stack", "total", "ORIGINS"]

ORIGINS = {__file__: "adjoint-compile's loop roller (a Python loop over range traced once, as torch's scan)"}
#: fewest steps worth rolling: two are peeled, the scan takes at least one
MIN_STEPS = 3


def ok(r: Any, xs: tuple[Any, ...], dims: tuple[int, ...], invariants: tuple[Any, ...] = (),
       items: tuple[Any, ...] = ()) -> bool:
    """Whether the rolled form computes what the loop over ``r`` does: tracing for the adjoint backend, a plain
    range of at least :data:`MIN_STEPS` steps, every indexed sequence a tensor with those steps along its dim,
    neither a float nor a module among the values the step reads from its function (``invariants``, self aside),
    and a list each carry the step writes an item of (``items``; into a tensor that write is in place) that the
    step does not also read through another name.

    NB: dynamo holds a float that changed between calls symbolic, and scan refuses a symbolic float input (it
    raises); a traced float looks the same whether symbolic or not, so any float keeps the loop as written. A module
    passed in (``m.cell(h)``) was not checked for calls that scan refuses, as ``self``'s submodules are."""
    if not rolling() or not isinstance(r, range) or r.step != 1 or r.start < 0 or len(r) < MIN_STEPS:
        return False
    if any(isinstance(v, (float, torch.nn.Module)) for v in invariants) or any(type(v) is not list for v in items):
        return False
    # NB: the step would read such a list through another name as it was before the loop, not as the loop writes it
    held = [w for v in invariants for w in ((v, *v) if isinstance(v, (list, tuple)) else (v, *v.values())
                                               if isinstance(v, dict) else (v,))]
    if any(w is v for v in items for w in held):
        return False
    for x, d in zip(xs, dims):
        if not isinstance(x, torch.Tensor) or not -x.dim() <= d < x.dim() or x.shape[d] < r.stop:
            return False
    return True


def _tensors(*groups: tuple[Any, ...]) -> bool:
    # NB: complex carries are left to the Python loop: scan's autograd fails on them (_conj_copy, torch 2.13)
    return all(isinstance(v, torch.Tensor) and not v.is_complex() for g in groups for v in g)


def _floating(*groups: tuple[Any, ...]) -> bool:
    # NB: scan's autograd fails on an integer carry ("outs_to_grad length != tangents length", torch 2.13); such a
    # loop runs as written. Integer outputs reach scan as floats (:func:`_as_floats`)
    return all(v.is_floating_point() for g in groups for v in g)


#: integer dtypes whose every value a float64 holds exactly; an int64 goes as two of them (:func:`_as_floats`)
_EXACT_IN_F64 = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32)
_HALF = 2 ** 32


def _codes(ys: tuple[torch.Tensor, ...]) -> tuple[torch.dtype | None, ...] | None:
    """Per output, the integer dtype it is carried through scan as floats, None for a floating one; None when an
    output's dtype has no exact float form."""
    codes = tuple(None if v.is_floating_point() else v.dtype for v in ys)
    return codes if all(k is None or k in _EXACT_IN_F64 or k == torch.int64 for k in codes) else None


def _as_floats(step: Callable[..., Any], codes: tuple[torch.dtype | None, ...]) -> Callable[..., Any]:
    """The step with its integer outputs as float64, exactly: a count or an argmax per step (``n = n + (y_t !=
    -100).sum()``). Scan's autograd fails on integer outputs (torch 2.13). An int64 ``v`` goes as ``v // 2**32``
    and ``v % 2**32``, each exact in float64 whatever ``v`` is (:func:`_as_ints` joins them)."""
    def body(c: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        c2, y = step(c, x)
        out: list[torch.Tensor] = []
        for v, k in zip(y, codes):
            if k == torch.int64:
                out += [(v // _HALF).to(torch.float64), (v % _HALF).to(torch.float64)]
            else:
                out.append(v if k is None else v.to(torch.float64))
        return c2, tuple(out)
    return body


def _as_ints(ys: tuple[torch.Tensor, ...], codes: tuple[torch.dtype | None, ...]) -> tuple[torch.Tensor, ...]:
    """Scan's stacked outputs in the step's own dtypes (:func:`_as_floats` undone)."""
    out, it = [], iter(ys)
    for k in codes:
        v = next(it)
        if k == torch.int64:
            v = v.to(torch.int64) * _HALF + next(it).to(torch.int64)
        out.append(v if k is None else v.to(k))
    return tuple(out)


def _same_meta(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    # NB: what scan's check_meta_consistency compares (shape, dtype, strides, contiguity, device)
    return len(a) == len(b) and all(
        u.shape == v.shape and u.dtype == v.dtype and u.device == v.device and u.stride() == v.stride()
        and u.is_contiguous() == v.is_contiguous() for u, v in zip(a, b))


def _fresh(step: Callable[..., Any]) -> Callable[..., Any]:
    """The step with its carries and outputs cloned: scan refuses outputs that alias its inputs or each other (a
    loop that appends its carry, ``h = x_t``). The carries are made contiguous, as their initial values are
    (:func:`_carried`): a step of strided inputs (a gate permuted from [D, T, B]) makes carries whose strides follow
    them, which scan would refuse as another layout than the initial one's."""
    def body(c: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        c2, y = step(c, x)
        return _carried(c2), tuple(v.clone() for v in y)
    return body


def _carried(c: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(v.clone(memory_format=torch.contiguous_format) for v in c)


def run(step: Callable[..., Any], carry: tuple[Any, ...], xs: tuple[torch.Tensor, ...], dims: tuple[int, ...],
        r: range, invariants: tuple[Any, ...] = (), items: tuple[int, ...] = ()
        ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The loop's final carries and its per-step outputs, each a tensor ``[n, ...]`` (time first) when rolled or a
    list of n tensors when the steps ran as a Python loop. ``step(carry, x_t, invariants) -> (carry, ys_t)``, where
    ``invariants`` are the values of the function the step reads and does not assign, and the carries at
    ``items`` are lists the step writes items of (a state per layer), each carried as its items."""
    if items:
        sizes = tuple(len(v) if k in items else None for k, v in enumerate(carry))
        c, ys = run(_gathered(step, sizes), _spread(carry, sizes), xs, dims, r, invariants)
        return _gather(c, sizes), ys
    # NB: scan refuses inputs that alias each other; views among the values the step reads (``decay, gain =
    # p.unbind(0)``, ``x.real`` and ``x.imag``) would be two of them: each view is read through a copy
    inv = tuple(v.clone() if isinstance(v, torch.Tensor) and v._base is not None else v for v in invariants)
    step = _with(step, inv)
    # NB: int() specializes a length dynamo holds symbolic (a model seen at several lengths): inductor lowers a scan
    # of symbolic length to a while loop it cannot compile; the loop as written specializes it too
    r = range(int(r.start), int(r.stop))
    seq = tuple(x.movedim(d, 0)[r.start:r.stop] for x, d in zip(xs, dims))
    c1, y0 = step(carry, tuple(x[0] for x in seq))
    c2, y1 = step(c1, tuple(x[1] for x in seq))
    # NB: a loop without carries (it only sums or collects per-step values) runs as written: scan needs a carry
    codes = _codes(y0) if _tensors(y0) else None
    if not (carry and _tensors(c1, c2, y0, y1, seq) and _floating(c1) and codes is not None and _same_meta(c1, c2)
            and _same_meta(y0, y1)):
        lists = tuple([a, b] for a, b in zip(y0, y1))
        c = c2
        for i in range(2, len(r)):
            c, y = step(c, tuple(x[i] for x in seq))
            for acc, v in zip(lists, y):
                acc.append(v)
        return c, lists
    body = _fresh(_as_floats(step, codes))
    # NB: the carries go through the same clone as scan's own, so their strides are those scan compares
    c2 = _carried(c2)
    if _tensors(carry):
        c0 = _carried(carry)
        if _same_meta(c0, c2):
            # NB: the peeled steps only proved the metadata; scan all n steps, so the outputs are scan's own (the
            # peeled ones are dead code)
            c, ys = scan(body, c0, seq)
            return c, _as_ints(ys, codes)
    c, ys = scan(body, c2, tuple(x[2:] for x in seq))
    ys = _as_ints(ys, codes)
    return c, tuple(torch.cat([a.unsqueeze(0), b.unsqueeze(0), rest]) for a, b, rest in zip(y0, y1, ys))


def _spread(c: tuple[Any, ...], sizes: tuple[int | None, ...]) -> tuple[Any, ...]:
    """The carries with each list (its size given) replaced by its items."""
    return tuple(w for v, n in zip(c, sizes) for w in ((v,) if n is None else v))


def _gather(c: tuple[Any, ...], sizes: tuple[int | None, ...]) -> tuple[Any, ...]:
    """:func:`_spread` undone, each list a new one (the caller's is not written into)."""
    out, it = [], iter(c)
    for n in sizes:
        out.append(next(it) if n is None else [next(it) for _ in range(n)])
    return tuple(out)


def _gathered(step: Callable[..., Any], sizes: tuple[int | None, ...]) -> Callable[..., Any]:
    def body(c: tuple[Any, ...], x: tuple[Any, ...], inv: tuple[Any, ...]) -> Any:
        c2, y = step(_gather(c, sizes), x, inv)
        return _spread(c2, sizes), y
    return body


def _with(step: Callable[..., Any], inv: tuple[Any, ...]) -> Callable[..., Any]:
    def bound(c: tuple[Any, ...], x: tuple[Any, ...]) -> Any:
        return step(c, x, inv)
    return bound


def stacked(ys: Any, keep: bool) -> Any:
    """What a list the loop appended to holds after it: ``ys`` itself where every later use is ``torch.stack``
    (``keep``), else a list of its steps."""
    if isinstance(ys, torch.Tensor) and not keep:
        return list(ys.unbind(0))
    return ys


def stack(tensors: Any, dim: int = 0) -> torch.Tensor:
    """``torch.stack(tensors, dim)``, where ``tensors`` may be a rolled loop's outputs stacked time first."""
    if isinstance(tensors, torch.Tensor):
        return tensors.movedim(0, dim).contiguous()
    return torch.stack(tensors, dim)


def total(c0: Any, ys: Any) -> Any:
    """``c0 + ys[0] + ys[1] + ...``: a sum the loop accumulated (``loss = loss + e``). Rolled, ``ys`` holds the
    terms stacked time first, added in the dtype each step's sum takes (a 0-dim fp32 ``c0`` keeps bf16 terms in
    fp32), as are the terms of a loop run as written when they are tensors of one shape and dtype; others (lists)
    are added in order, as the loop did."""
    if not isinstance(ys, torch.Tensor) and ys and all(
            isinstance(y, torch.Tensor) and y.shape == ys[0].shape and y.dtype == ys[0].dtype for y in ys):
        ys = torch.stack(ys)  # NB: one sum, not a chain of T adds that reads as another recurrence
    if isinstance(ys, torch.Tensor):
        dtype = (c0 + ys[0]).dtype  # NB: torch.result_type does not trace; dynamo drops the unused sum
        return c0 + ys.to(dtype).sum(0)
    for y in ys:
        c0 = c0 + y
    return c0
