"""Where the examples are in each activation of a graph, when a permutation moved them (``per_sample_clip``).

A loop rolled into a scan runs its step time-first: ``x.movedim(1, 0)`` is ``[T, B, D]``, and a Linear of the step
applies to that. Telling the examples' axis by its size alone (``shape[batch_dim] == B``) then fails (``T != B``: the
use is refused) or, worse, succeeds where ``T == B`` and attributes each step's gradient to an example: clipped
gradients silently wrong. So the axis is followed from the graph's inputs through the ops that move it
(``movedim``, ``permute``, ``transpose``, ``t``, ``.T``, ``einsum``, ``stack``, indexing) and the ops that keep
every axis (element-wise, products, reshapes that keep it outermost); anything else that moves or reorders it
(``rot90``, ``x[perm]``, ``roll``, ``new_ones``) leaves its axis unknown, and a parameter use of such a value is
refused. Used on dynamo's graph (passes/lower/per_sample.py) and in a sharded region's program made per
example (runtime/sharded_ps.py).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fx import example_value, is_linear_scan, scan_args

__all__ = ["permutation", "moved_batch_axes", "followed_axes", "BatchAxes", "broadcast_over_examples", "use_name",
           "reads_no_values"]

#: methods making a new tensor that read their operand's dtype and device only
_FACTORIES = frozenset("new_zeros new_ones new_full new_empty new_tensor".split())


def reads_no_values(n: fx.Node) -> bool:
    """Whether ``n`` makes a constant from its operand's dtype and device alone (``x.new_zeros(B, D)``: an RNN's
    initial state): no example's values are in it, as in ``torch.zeros(B, D)``."""
    if n.op == "call_method":
        return n.target in _FACTORIES
    return n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
        and n.target.__name__.split(".")[0] in _FACTORIES  # NB: aten's, in a program traced to aten


_PERMUTES = {"movedim", "moveaxis", "permute", "transpose", "swapaxes", "swapdims", "t"}
_RESHAPES = {"reshape", "view", "flatten", "unflatten", "view_as", "reshape_as", "unfold", "as_strided", "expand",
             "expand_as", "broadcast_to", "repeat", "squeeze", "unsqueeze"}


_EXPANDS = frozenset("expand expand_as broadcast_to".split())
#: ops that cut a value into parts along one axis (its ``dim``, the third argument)
_SPLITS = frozenset("chunk split tensor_split split_with_sizes".split())


def broadcast_over_examples(n: fx.Node, bd: int, batch: int) -> bool:
    """Whether ``n`` expands a value without the examples to ``batch`` copies on axis ``bd`` (``arange(T)[None]
    .expand(B, -1)``, position ids): the same values for every example, so each example's own."""
    v, x = example_value(n), example_value(n.args[0]) if n.args else None
    if use_name(n) not in _EXPANDS or not isinstance(v, torch.Tensor) or not isinstance(x, torch.Tensor) or \
            v.dim() <= bd or int(v.shape[bd]) != batch:
        return False
    k = bd - (v.dim() - x.dim())  # NB: expand adds axes in front
    return k < 0 or int(x.shape[k]) == 1


def _dims(x: Any, nd: int) -> list[int] | None:
    xs = list(x) if isinstance(x, (list, tuple)) else [x]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in xs):
        return None
    return [d % nd for d in xs]


def permutation(n: fx.Node) -> list[int] | None:
    """For a node that permutes its first operand's axes: per output axis, the input axis it reads; else None."""
    name = use_name(n)
    if n.target is getattr and len(n.args) == 2 and n.args[1] in ("T", "H", "mT", "mH"):
        name = n.args[1]  # NB: x.T reverses every axis, x.mT swaps the last two (H, mH: conjugated too)
    elif name not in _PERMUTES | {"adjoint"} or not n.args or not isinstance(n.args[0], fx.Node) or n.kwargs:
        return None
    v = example_value(n.args[0])
    if not isinstance(v, torch.Tensor):
        return None
    nd, args = v.dim(), n.args[1:] if n.target is not getattr else ()
    if nd == 0:
        return None
    if name in ("T", "H"):
        return list(range(nd))[::-1]
    if name in ("mT", "mH", "adjoint"):
        return [*range(nd - 2), nd - 1, nd - 2] if nd >= 2 else None
    if name in ("movedim", "moveaxis") and len(args) == 2:
        src, dst = _dims(args[0], nd), _dims(args[1], nd)
        if src is None or dst is None or len(src) != len(dst):
            return None
        out: list[int | None] = [None] * nd
        for s, d in zip(src, dst):
            out[d] = s
        rest = iter(d for d in range(nd) if d not in src)
        return [next(rest) if o is None else o for o in out]
    if name == "permute":
        dims = _dims(args[0] if len(args) == 1 else args, nd)
        return dims if dims is not None and sorted(dims) == list(range(nd)) else None
    if name in ("transpose", "swapaxes", "swapdims") and len(args) == 2:
        ij = _dims(list(args), nd)
        if ij is None:
            return None
        perm = list(range(nd))
        perm[ij[0]], perm[ij[1]] = perm[ij[1]], perm[ij[0]]
        return perm
    if name == "t" and not args and nd <= 2:
        return list(range(nd))[::-1]
    return None


class BatchAxes:
    """The examples' axis of activations visited in graph order: ``axes.visit(n, activations)`` for each activation
    (its inputs visited before), ``axes(n)`` its axis (None: unknown). :func:`moved_batch_axes` visits a whole graph;
    a caller classifying the graph's values as it goes visits each activation as it finds it."""

    def __init__(self, bd: int, batch: int, seeds: dict[fx.Node, int | None] | None = None,
                 calls: dict[fx.Node, tuple[int | None, ...]] | None = None) -> None:
        self.bd, self.batch = bd, batch
        #: per call whose outputs' axes its caller knows (a lowered sharded region's), those axes
        self.calls = calls or {}
        #: per activation whose examples are not on ``bd``: their axis, or None where unknown
        self.moved: dict[fx.Node, int | None] = {n: k for n, k in (seeds or {}).items() if k != bd}
        #: per tuple-valued activation reading a moved one, its elements' axes
        self.elems: dict[fx.Node, list[int | None]] = {}

    def __call__(self, n: fx.Node) -> int | None:
        return self.moved.get(n, self.bd)

    def visit(self, n: fx.Node, activations: set[fx.Node]) -> None:
        bd, batch, moved, elems = self.bd, self.batch, self.moved, self.elems
        if n.op not in ("call_function", "call_method", "call_module"):
            return
        if n in self.calls:  # NB: whatever its inputs' axes (a region reading a time-major [T, B, D] value)
            ks = self.calls[n]
            if isinstance(example_value(n), (tuple, list)):
                elems[n] = list(ks)
            elif ks and ks[0] != bd:
                moved[n] = ks[0]
            return
        if n.target is operator.getitem and n.args[0] in elems:
            k = elems[n.args[0]][n.args[1]] if isinstance(n.args[1], int) else None
            if k != bd:
                moved[n] = k
            return
        if n.target is F.multi_head_attention_forward:
            # NB: it works on [T, B, E] whatever the model's layout (its lowering says so on its site); its output
            # is [T, B, E], its weights [B, ...]
            elems[n] = [1, 0]
            return
        perm = permutation(n)
        if perm is not None and n.args[0] in activations:
            k = moved[n.args[0]] if n.args[0] in moved else bd
            new = perm.index(k) if k is not None and k < len(perm) else None
            if new != bd:
                moved[n] = new
            return
        ins = [a for a in n.all_input_nodes if a in activations and isinstance(example_value(a), torch.Tensor)]
        if ins and use_name(n) in ("einsum", "stack"):  # NB: they place the examples' axis themselves
            k = _placed_axis(n, ins, {a: moved.get(a, bd) for a in ins})
            if k != bd:
                moved[n] = k
            return
        if not any(a in moved for a in ins):
            if ins and (k := _unmoved_axis(n, ins, bd, batch)) != bd:
                moved[n] = k
            return
        if n.target is operator.getitem and ins == [n.args[0]] and moved[n.args[0]] is not None:
            # NB: basic indexing of a moved value (``torch.stack([x, y])[0]``) moves its axis as it would bd's
            k = _indexed_axis(n.args[1], moved[n.args[0]], example_value(n.args[0]).dim())
            if k != bd:
                moved[n] = k
            return
        if is_linear_scan(n):
            moved[n] = _scan_axis(n, moved, activations, bd)
            if moved[n] == bd:
                del moved[n]
            return
        if use_name(n) in _RESHAPES:  # NB: the same rank is not the same axes: [T, B, D] -> [B, T, D] where T == B
            moved[n] = None
            return
        axes = {moved.get(a, bd) for a in ins}
        v = example_value(n)
        if isinstance(v, (tuple, list)):
            k = moved.get(n.args[0]) if n.args and n.args[0] in moved else None
            d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if use_name(n) == "unbind" and k is not None and isinstance(d, int) and len(ins) == 1:
                d %= example_value(n.args[0]).dim()  # NB: the unbound axis goes; the examples' shifts past it
                elems[n] = [None if d == k else k - 1 if d < k else k] * len(v)
            elif use_name(n) in _SPLITS and k is not None and len(ins) == 1 and isinstance(
                    d := n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), int):
                # NB: parts along another axis keep the examples where they were (``u, g = x.chunk(2, -1)``)
                elems[n] = [None if d % example_value(n.args[0]).dim() == k else k] * len(v)
            else:
                elems[n] = [None] * len(v)
            return
        k = axes.pop() if len(axes) == 1 else None
        same = isinstance(v, torch.Tensor) and all(example_value(a).dim() == v.dim() for a in ins)
        moved[n] = k if k is not None and same and v.dim() > k and int(v.shape[k]) == batch else None


def moved_batch_axes(gm: fx.GraphModule, activations: set[fx.Node], bd: int, batch: int,
                     seeds: dict[fx.Node, int | None] | None = None,
                     calls: dict[fx.Node, tuple[int | None, ...]] | None = None) -> dict[fx.Node, int | None]:
    """Per activation whose examples are no longer on axis ``bd``: the axis they are on, or None where unknown
    (module docstring). Activations not in the result keep them on ``bd``; ``seeds``: the axes of inputs (placeholders)
    that have them elsewhere."""
    axes = BatchAxes(bd, batch, seeds, calls)
    for n in gm.graph.nodes:
        if n in activations:
            axes.visit(n, activations)
    return axes.moved


def followed_axes(gm: fx.GraphModule, seeds: dict[fx.Node, int | None], bd: int,
                  batch: int) -> tuple[set[fx.Node], dict[fx.Node, int | None]]:
    """From placeholders with the examples on the axes ``seeds`` gives (None: lost): the values that read them, or
    expand a constant over the examples (position ids: every example's own), and the axes of those not on ``bd``
    (:func:`moved_batch_axes`). For a program whose inputs are a region's (its examples' axes already known)."""
    acts = set(seeds)
    for n in gm.graph.nodes:
        if n.op != "placeholder" and not reads_no_values(n) and (any(a in acts for a in n.all_input_nodes) or
                                                                 broadcast_over_examples(n, bd, batch)):
            acts.add(n)
    return acts, moved_batch_axes(gm, acts, bd, batch, seeds)


def _unmoved_axis(n: fx.Node, ins: list[fx.Node], bd: int, batch: int) -> int | None:
    """The examples' axis in ``n``'s output when every activation it reads has them on ``bd`` (there, or as the
    outermost factor of merged rows ``[B·T, ...]``): ``bd`` for ops that keep the leading axes (element-wise,
    products, norms, reductions over later axes, a row-major reshape whose axis ``bd`` stays a multiple of B with
    the axes before it unchanged), None for an op that moves axes another way (``rot90``, ``as_strided``,
    ``unsqueeze`` or ``expand`` in front of them). NB: by size alone a [T, B, D] value where T == B would pass for
    one with the examples first."""
    name, v, x = use_name(n), example_value(n), example_value(ins[0])
    if not isinstance(v, torch.Tensor) or not isinstance(x, torch.Tensor):
        return bd
    if name in _LOST or name.startswith("new_"):  # NB: new_ones(T, V): values of no example, [T, V] where T == B
        return None  # (reached only where a caller did not leave such constants out: reads_no_values)
    if name == "diag_embed":  # NB: its new axes come last unless told otherwise
        return bd if len(n.args) <= 2 and not (n.kwargs.keys() - {"offset"}) else None
    if name in _ALONG_DIM and _along(n, name, x.dim()) in (None, bd):
        return None  # NB: x[perm], roll along the examples: each row another example's
    if n.target is operator.getitem and n.args[0] is ins[0]:
        return _indexed_axis(n.args[1], bd, x.dim())
    if name not in _RESHAPES:
        return bd
    keeps = v.dim() > bd and x.dim() > bd and tuple(v.shape[:bd]) == tuple(x.shape[:bd]) and \
        int(v.shape[bd]) % batch == 0 and int(x.shape[bd]) % batch == 0
    if name == "unsqueeze":
        d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if isinstance(d, int) and d % v.dim() <= bd and int(x.shape[bd]) == batch:
            return bd + 1  # NB: a new axis in front of the examples' (``h.unsqueeze(0)``)
        keeps = keeps and isinstance(d, int) and d % v.dim() > bd
    elif name in ("expand", "expand_as", "broadcast_to", "repeat"):
        keeps = keeps and v.dim() == x.dim() and v.shape[bd] == x.shape[bd]  # NB: new axes come first
    return bd if keeps else None


#: ops whose output's axes are not the input's in any way followed here
_LOST = frozenset("rot90 as_strided unfold tile diag diagonal".split())
#: ops that index or shift along one axis (the examples reordered when it is theirs): the arg position of the axis
_ALONG_DIM = {"index_select": 1, "gather": 1, "take_along_dim": 2, "roll": 2, "scatter": 1, "scatter_add": 1,
              "index_add": 1, "index_copy": 1, "index_fill": 1, "repeat_interleave": 2}


def _along(n: fx.Node, name: str, nd: int) -> int | None:
    """The axis ``n`` indexes or shifts along (None: all of them, or unknown)."""
    pos = _ALONG_DIM[name]
    d = n.args[pos] if len(n.args) > pos else n.kwargs.get("dims" if name == "roll" else "dim")
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return d % nd if isinstance(d, int) and not isinstance(d, bool) and nd else None


def _is_arange(i: Any) -> bool:
    """Whether the index ``i`` is ``torch.arange(n)`` (0, 1, ..., n - 1: every example, in order)."""
    if not (isinstance(i, fx.Node) and i.op == "call_function" and i.target is torch.arange):
        return False
    a = [x for x in i.args if not isinstance(x, (torch.dtype, torch.device))]
    return len(a) == 1 or (len(a) == 2 and a[0] == 0) or (len(a) == 3 and a[0] == 0 and a[2] == 1)


def _viewed_arange(i: Any) -> bool:
    """Whether the index ``i`` is ``arange(n)`` viewed with every other axis of size 1 (``arange(B)[:, None, None,
    None]``, as transformers' masks index ``attention_mask[batch_idx, kv_idx]``)."""
    while isinstance(i, fx.Node) and not _is_arange(i):
        v, x = example_value(i), example_value(i.args[0]) if i.args else None
        if not (isinstance(v, torch.Tensor) and isinstance(x, torch.Tensor) and isinstance(i.args[0], fx.Node)) or \
                v.numel() != x.numel() or sum(int(s) != 1 for s in v.shape) > 1:
            return False
        items = i.args[1] if i.target is operator.getitem and len(i.args) == 2 else None
        basic = isinstance(items, tuple) and all(j is None or j == slice(None) for j in items)
        if use_name(i) not in ("unsqueeze", "view", "reshape") and not basic:
            return False
        i = i.args[0]
    return _is_arange(i) and example_value(i).dim() == 1


def _advanced_axis(items: tuple, adv: list[int], bd: int) -> int | None:
    """Where ``x[items]`` with tensor or list indices at ``adv`` (adjacent, 1-D or numbers) puts the examples of x
    (on ``bd``, only full slices before it): they stay when every tensor index comes after them, or when the index
    at their axis is ``arange`` (each example its own row: ``logits[arange(B), last]``, transformers' pooling) or a
    view of it that every other index broadcasts along (``mask[arange(B)[:, None, None, None], kv[None, None,
    None]]``: its examples where the arange runs); else None (a reorder, or numpy's move of separated indices to
    the front)."""
    if Ellipsis in items or None in items or adv != list(range(adv[0], adv[-1] + 1)) or any(
            items[j] != slice(None) for j in range(min(bd, len(items)))):
        return None
    if adv[0] == bd and (k := _broadcast_arange(items, adv)) is not None:
        return bd + k
    for j in adv:
        v = example_value(items[j]) if isinstance(items[j], fx.Node) else None
        if isinstance(items[j], fx.Node) and not (isinstance(v, torch.Tensor) and v.dim() <= 1):
            return None
    if adv[0] > bd:
        return bd
    return bd if adv[0] == bd and _is_arange(items[bd]) else None


def _broadcast_arange(items: tuple, adv: list[int]) -> int | None:
    """For advanced indices whose first is an ``arange`` viewed to several axes (:func:`_viewed_arange`) and whose
    others have size 1 on the axis it runs along, once broadcast: that axis of the broadcast indices; else None
    (1-D indices are left to the rule for them)."""
    vs = [example_value(items[j]) if isinstance(items[j], fx.Node) else None for j in adv]
    if not all(isinstance(v, torch.Tensor) for v in vs) or vs[0].dim() <= 1 or not _viewed_arange(items[adv[0]]):
        return None
    k = next((d for d, s in enumerate(vs[0].shape) if int(s) != 1), 0)
    rank = max(v.dim() for v in vs)
    at = rank - vs[0].dim() + k  # NB: indices broadcast right-aligned
    if any(at - (rank - v.dim()) >= 0 and int(v.shape[at - (rank - v.dim())]) != 1 for v in vs[1:]):
        return None
    return at


def _indexed_axis(idx: Any, bd: int, nd: int) -> int | None:
    """Where ``x[idx]`` puts the examples of x (on ``bd``): basic indexing before them moves them (None adds an axis,
    an int removes one), a tensor or list index anywhere may reorder or move them (None: unknown)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    adv = [j for j, i in enumerate(items) if isinstance(i, (fx.Node, list, torch.Tensor))]
    if adv:
        return _advanced_axis(items, adv, bd)
    k, axis = bd, 0  # NB: axis: the input axis the next item indexes
    for j, i in enumerate(items):
        if i is Ellipsis:  # NB: the items after it index the last axes: they must all come after the examples'
            rest = items[j + 1:]
            if axis > bd:
                return k
            if any(r is Ellipsis or not (r is None or isinstance(r, (int, slice))) for r in rest):
                return None
            return k if nd - sum(r is not None for r in rest) > bd else None
        if axis > bd:
            break
        if i is None:
            k += 1
        elif isinstance(i, bool) or not isinstance(i, (int, slice)):
            return None
        elif isinstance(i, int):
            if axis == bd:
                return None  # NB: one example
            k -= 1
            axis += 1
        else:
            if axis == bd and i != slice(None):
                return None  # NB: some of the examples
            axis += 1
    return k


def _placed_axis(n: fx.Node, ins: list[fx.Node], axes: dict[fx.Node, int | None]) -> int | None:
    """Where ``einsum`` (the output position of the examples' letter) or ``stack`` (a new axis at ``dim``) puts the
    examples of its operands (their axes in ``axes``), or None."""
    if any(k is None for k in axes.values()):
        return None
    v = example_value(n)
    if use_name(n) == "stack":
        d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        ks = set(axes.values())
        if not isinstance(d, int) or len(ks) != 1 or not isinstance(v, torch.Tensor):
            return None
        (k,) = ks
        return k + 1 if d % v.dim() <= k else k
    eq = n.args[0] if n.args and isinstance(n.args[0], str) else None
    ops = list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if eq is None or "->" not in eq or "." in eq:
        return None
    lhs, rhs = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    letters = {terms[i][axes[a]] for i, a in enumerate(ops) if a in axes and i < len(terms) and len(terms[i]) > axes[a]}
    if len(letters) != 1 or len(terms) != len(ops):
        return None
    (c,) = letters
    return rhs.index(c) if c in rhs else None


def _scan_axis(n: fx.Node, moved: dict[fx.Node, int | None], activations: set[fx.Node], bd: int) -> int | None:
    """The examples' axis of a scan's states: that of its ``a`` and ``b``, with its h0's the same axis of the state
    (the step axis removed), or None."""
    args = scan_args(n)
    dim = args["dim"] % example_value(n).dim()
    axes = {moved.get(x, bd) for x in (args["a"], args["b"]) if isinstance(x, fx.Node) and x in activations}
    k = axes.pop() if len(axes) == 1 else None
    if k is None or k == dim:
        return None
    h0 = args.get("h0")
    if isinstance(h0, fx.Node) and h0 in activations and moved.get(h0, bd) != (k if k < dim else k - 1):
        return None
    return k


def use_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))
