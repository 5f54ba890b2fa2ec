"""Lower every parameter use into a per-example book-keeping call (``options={"per_sample_clip": C}``; issue 14).

On dynamo's torch-level graph each value is classified as

- ``P``: computed from parameters (and constants) only, e.g. ``-exp(A_log)``;
- ``A``: depends on an example (a graph input with the batch axis);
- ``R``: reduced over the batch axis (a loss; only a linear tail may follow, up to the output);
- ``D``: a value without parameters reduced over the batch axis (``mask.sum()``): it may scale or divide the loss;
- ``C``: anything else (buffers, masks, sizes).

A node with an ``A`` and a ``P`` input is a parameter use. It becomes a call of runtime/per_sample.py:
``linear``/``matmul`` with a parameter matrix (``LinearRecord``: Gram or direct form), ``embedding``
(``EmbeddingRecord``), ``layer_norm``/``rms_norm`` affine and ``x * p``, ``x + p``, ``x - p`` (element-wise, a
per-example gradient of the parameter's size), and any other use (the generic fallback: the op with the
parameter-only nodes that feed it, differentiated per example with ``torch.func.vmap``). A use on rows merged from
the examples (``h.flatten(0, 1) * g``: [B·T, D], each example's rows one block) is made on the rows unflattened to
[B, T, D] and merged again after (passes/lower/per_sample_loss.py: ``on_merged_rows``).

Ops that mix examples are refused with :class:`~adjoint_compile.errors.PerSampleError` naming the op and its source
line: batch norm in training mode, softmax / cumsum / sort along the batch axis, a reduction over it that is not a
sum or mean (``out.max()``), and a sum or mean over the batch axis whose result meets anything but a linear tail to
the output (``x - x.mean(0)``, ``out.sum(0).pow(2)``).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.batch_axes import reads_no_values
from ...analysis.fx import batch_size_arg, refresh_example_values, source_at
from ...errors import AdjointCompileWarning, PerSampleError
from ...ops import scan_op
from ...options import Options
from ...runtime.per_sample import Clipper, PerSampleCall, Site, gram_is_cheaper
from ...runtime.sharded import ShardedRegion
from .per_sample_axes import LOSSES, BatchAxes, broadcast_over_examples, check_batched as _check_batched
from .per_sample_axes import BROADCASTING, combines_examples
from .per_sample_axes import moved_batch_axes, origin as _origin, reduction, refuse as _refuse, use_name as _name
from .per_sample_attention import lower_attention
from .per_sample_loss import direct_param, flat_rows, on_merged_rows, param_dependent, region_loss_kind, tail_kind
from .per_sample_loss import short_of as _short_of, warn_data_divisor

SCAN_OP = torch.ops.adjoint_compile.linear_scan.default

log = logging.getLogger(__name__)

__all__ = ["PerSampleLowering", "lower_per_sample", "classify_kinds", "warn_batch_mean"]

LINEARS = (torch._C._nn.linear, F.linear)
MATMULS = (operator.matmul, torch.matmul, torch.mm)
LAYER_NORMS = (F.layer_norm, torch.layer_norm)
RMS_NORMS = (F.rms_norm, torch.rms_norm)
ELEMENTWISE = {operator.mul: "mul", torch.mul: "mul", "mul": "mul", operator.add: "add", torch.add: "add",
               "add": "add", operator.sub: "sub", torch.sub: "sub", "sub": "sub"}


@dataclasses.dataclass
class PerSampleLowering:
    """What the lowering did to one graph: the calls (stitch keeps them out of the inner compiler) and, for the
    report, one entry per parameter use."""

    clipper: Clipper
    batch_size: int
    calls: list[str] = dataclasses.field(default_factory=list)
    uses: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _val(n: Any) -> Any:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else n


def _is_param(n: fx.Node, gm: fx.GraphModule, example: Any) -> bool:
    if n.op == "get_attr":
        try:
            v = gm.get_parameter(str(n.target))
        except AttributeError:
            return False
        return v.requires_grad
    # NB: dynamo's fake example values of parameters are Parameters too (explain() has no real inputs)
    for v in (example, _val(n)):
        if isinstance(v, torch.nn.Parameter):
            return v.requires_grad
    return False


def _arg(n: fx.Node, i: int, key: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def _classify(gm: fx.GraphModule, example_inputs: Sequence[Any], bd: int) -> tuple[dict[fx.Node, str], int | None]:
    kind_of: dict[fx.Node, str] = {}
    batch: int | None = None
    axes: BatchAxes | None = None  # NB: where the examples are, followed as the values are classified
    acts: set[fx.Node] = set()
    i = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ex = example_inputs[i] if i < len(example_inputs) else None
            i += 1
            v = _val(n)
            # NB: module state (buffers, frozen parameters) is marked static by dynamo: never the examples
            static = "_dynamo_static_input_type" in (n.meta.get("tensor_dict") or {}) or isinstance(
                v, torch.nn.Parameter) or isinstance(ex, torch.nn.Parameter)
            if _is_param(n, gm, ex):
                kind_of[n] = "P"
            elif not static and isinstance(v, torch.Tensor) and v.dim() > bd:
                batch = int(v.shape[bd]) if batch is None else batch
                kind_of[n] = "A" if int(v.shape[bd]) == batch else "C"
                if kind_of[n] == "A":  # NB: followed from here: an input's examples moved (``x.transpose(0, 1)``)
                    acts.add(n)
            else:
                kind_of[n] = "C"
            continue
        if n.op == "get_attr":
            kind_of[n] = "P" if _is_param(n, gm, None) else "C"
            continue
        if n.op == "output" or (k := region_loss_kind(n, gm)) and kind_of.setdefault(n, k):
            continue  # NB: a loss a sharded region took in: a sum over the examples
        if axes is None and batch is not None:
            axes = BatchAxes(bd, batch, calls=region_out_axes(gm))
        ins = [kind_of.get(a, "C") for a in n.all_input_nodes]
        v = _val(n)
        tensorish = isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and
                                                     any(isinstance(x, torch.Tensor) for x in v))
        if not tensorish:
            kind_of[n] = "C"
            continue
        if reads_no_values(n):  # NB: x.new_zeros(B, D) is torch.zeros(B, D): x gives its dtype and device only
            kind_of[n] = "C"
            continue
        red = reduction(n, kind_of, bd, axes)
        if red == "mix":
            at = axes(n.args[0]) if axes is not None else bd
            where = f"axis {at}" if at is not None else "an axis of a value whose examples' axis is not known"
            raise _refuse(n, "mixes the examples of the batch (batch norm in training mode, an op along the batch "
                             f"axis ({where}), or a reduction over it that is not a sum or mean): per-example "
                             "gradients are not defined")
        if "R" in ins or "D" in ins:  # NB: the loss's tail (passes/lower/per_sample_loss.py)
            if (tail := tail_kind(n, kind_of)) is None and any(kind_of.get(a) == "P" for a in n.all_input_nodes):
                if _name(n).strip("_").lstrip("ri") not in ("add", "sub"):
                    raise _refuse(n, "scales the loss by a value of the parameters alone (a learned temperature "
                                     "times the loss): not supported under per_sample_clip; apply the factor outside "
                                     "the compiled code, or make it a constant")
                raise _refuse(n, "adds a term of the parameters alone to the loss (a regularizer, 0.1 * (w**2).sum()):"
                                 " its gradient belongs to no example; apply it as the optimizer's weight decay, or "
                                 "add its gradient after the clipped backward")
            if tail is None:
                src = next(a for a in n.all_input_nodes if kind_of.get(a) in ("R", "D"))
                raise _refuse(n, f"uses a value reduced over the batch axis before the loss ({_origin(src, kind_of)}"
                                 "): the examples interact, so per-example gradients are not defined")
            kind_of[n] = tail
        elif red == "R":  # NB: "D": a reduction of data alone (mask.sum()), a constant of the gradient
            kind_of[n] = "R" if param_dependent(n.args[0], kind_of) else "D"
            if axes is not None and (why := combines_examples(n, acts, axes)) is not None:
                raise _refuse(n, f"mixes the examples of the batch ({why}): each example's loss reads others'")
        elif "A" in ins or "M" in ins:
            kind_of[n] = "M" if "P" in ins else "A"
            acts.add(n)
            if axes is not None:
                axes.visit(n, acts)
                if (why := combines_examples(n, acts, axes)) is not None:
                    raise _refuse(n, f"mixes the examples of the batch ({why}): each example's output reads others'"
                                     ", so per-example gradients are not defined")
        elif "P" in ins:
            kind_of[n] = "P"
        else:  # NB: a constant expanded over the examples (position ids) is every example's own, alike
            kind_of[n] = "A" if batch is not None and broadcast_over_examples(n, bd, batch) else "C"
            acts.update([n] if kind_of[n] == "A" else [])
    return kind_of, batch


def region_out_axes(gm: fx.GraphModule) -> dict[fx.Node, tuple[int | None, ...]]:
    """Per call of a sharded region lowered under per_sample_clip, its outputs' examples' axes (sharded_ps.py checked
    them), whatever the axes of what it reads."""
    ps = {n: getattr(gm.get_submodule(str(n.target)), "per_sample", None) for n in gm.graph.nodes
          if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), ShardedRegion)}
    return {n: p.out_bdims for n, p in ps.items() if p is not None and len(p.out_bdims) == (
        len(_val(n)) if isinstance(_val(n), (tuple, list)) else 1)}


def classify_kinds(gm: fx.GraphModule, bd: int) -> tuple[dict[fx.Node, str], int | None]:
    """The per-example kind of every value ("P", "A", "R", "C", "M": the module docstring) and the batch size."""
    return _classify(gm, [], bd)


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


class _Lowerer:
    def __init__(self, gm: fx.GraphModule, kind_of: dict[fx.Node, str], opts: Options, batch: int) -> None:
        self.gm, self.kind_of, self.bd, self.batch = gm, kind_of, opts.batch_dim, batch
        self.moved = moved_batch_axes(gm, {n for n, k in kind_of.items() if k in ("A", "M")}, self.bd, batch,
                                      calls=region_out_axes(gm))
        self.out = PerSampleLowering(Clipper(float(opts.per_sample_clip or float("inf")), opts.batch_dim), batch)
        self.uses_of: dict[fx.Node, int] = {}

    def _param_leaves(self, n: fx.Node) -> list[fx.Node]:
        """The parameter placeholders a P value is computed from."""
        seen, todo, out = set(), [n], []
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.op in ("placeholder", "get_attr"):
                out += [m] if self.kind_of.get(m) == "P" else []
                continue
            todo += [a for a in m.all_input_nodes if self.kind_of.get(a) == "P"]
        return out

    def _call(self, n: fx.Node, mod: PerSampleCall, args: tuple, kind: str, params: list[fx.Node],
              **info: Any) -> fx.Node:
        name = f"per_sample_{len(self.out.calls)}"
        self.gm.add_submodule(name, mod)
        with self.gm.graph.inserting_before(n):
            call = self.gm.graph.call_module(name, args)
        call.meta.update(n.meta)
        self.kind_of[call] = "A"
        self.out.calls.append(name)
        self.out.uses.append({"node": n.name, "op": _name(n), "kind": kind, "call": name,
                              "params": [p.name for p in params], "tied": mod.site.tied, "at": source_at(n), **info})
        return call

    def _site(self, n: fx.Node, kind: str, params: list[fx.Node], axis: int | None = None) -> Site:
        return Site(self.out.clipper, n.name, kind, tuple(p.name for p in params),
                    tied=any(self.uses_of.get(p, 0) > 1 for p in params),
                    batch_dim=None if axis is None or axis == self.bd else axis)

    def _batched(self, n: fx.Node, a: fx.Node, output: bool = True, moved_ok: bool = False) -> int:
        """The axis of ``a`` (an input of the use ``n``) that carries the examples, checked on ``a`` and, with
        ``output``, on n's output (per_sample_axes.py: a permutation may have moved it off batch_dim)."""
        k = self.moved.get(a, self.bd)
        if k is None or (k != self.bd and not moved_ok):
            where = "is not known" if k is None else f"was moved to axis {k}"
            raise _refuse(n, f"uses a parameter, but the examples' axis of its input {a.name} {where} (moved by a "
                             f"permutation, then an op this use cannot follow): its gradient cannot be attributed")
        _check_batched(n, a, k, self.batch, output)
        return k

    def lower(self, n: fx.Node) -> None:
        k, name, args = self.kind_of, _name(n), n.args
        act = next((a for a in n.all_input_nodes if k.get(a) in ("A", "M")), None)
        assert act is not None
        new: fx.Node | None = None
        region = self.gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(region, ShardedRegion) and region.per_sample is not None:
            self._region(n, region)
            return
        if act not in self.moved and flat_rows(n, k, self.bd, self.batch) is None and \
                on_merged_rows(n, act, k, self.bd, self.batch):
            n, act = self._unmerged(n, act)
            args = n.args
        if n.target is F.multi_head_attention_forward:
            new = lower_attention(self, n)
        elif act not in self.moved and (flat := flat_rows(n, k, self.bd, self.batch)) is not None:
            new = self._flat(n, *flat)
        elif n.target in LINEARS and len(args) >= 2 and args[0] is act and direct_param(args[1], k) and (
                _arg(n, 2, "bias") is None or direct_param(_arg(n, 2, "bias"), k)):
            new = self._linear(n, act, args[1], _arg(n, 2, "bias"), transposed=False)
        elif (n.target in MATMULS or (n.op == "call_method" and name == "matmul")) and len(args) == 2 and \
                args[0] is act and direct_param(args[1], k) and _val(args[1]).dim() == 2:
            new = self._linear(n, act, args[1], None, transposed=True)
        elif n.target is F.embedding and args[0] is act and direct_param(args[1], k) and \
                _arg(n, 3, "max_norm") is None and not _arg(n, 5, "scale_grad_by_freq", False) and \
                not _arg(n, 6, "sparse", False):
            self._batched(n, act)
            site = self._site(n, "embedding", [args[1]])
            new = self._call(n, PerSampleCall(site, "embedding", padding_idx=_arg(n, 2, "padding_idx")),
                             (act, args[1]), "embedding", [args[1]], form="distinct rows per example")
        elif n.target in LAYER_NORMS + RMS_NORMS and args[0] is act and all(
                a is None or direct_param(a, k) for a in self._affine(n)):
            new = self._norm(n, act)
        elif ELEMENTWISE.get(n.target if n.op == "call_function" else name) and len(args) == 2 and not n.kwargs \
                and act in args and any(direct_param(a, k) for a in args) and self._fits(n, args):
            p = next(a for a in args if direct_param(a, k))
            op = ELEMENTWISE[n.target if n.op == "call_function" else name]
            op = "rsub" if op == "sub" and args[0] is p else op
            new = self._elementwise(n, act, p, op)
        if new is None and n.target is F.embedding and _arg(n, 3, "max_norm") is not None:
            raise _refuse(n, "has max_norm (rows renormalized in place in the forward): per-example gradients cannot "
                             "follow it; renormalize the weight yourself after the optimizer's step")
        if new is None:
            new = self._generic(n)
        if n in self.moved:
            self.moved[new] = self.moved.pop(n)
        n.replace_all_uses_with(new)
        self.gm.graph.erase_node(n)

    def _region(self, n: fx.Node, region: ShardedRegion) -> None:
        """A sharded region (lowered under per_sample_clip): it records its parameters' per-example gradients,
        summed over its shards, itself (runtime/sharded_ps.py); the call stays."""
        ps = region.per_sample
        params = [n.args[i] for i in ps.params]
        ps.site = self._site(n, "sharded", params)
        self.out.uses.append({"node": n.name, "op": str(n.target), "kind": "sharded region", "call": str(n.target),
                              "params": [p.name for p in params], "tied": ps.site.tied, "at": source_at(n),
                              "form": "per-example gradients summed over the shards (parameters expanded per "
                                      "example: one more backward per shard; else one masked VJP per example)",
                              "extra_bytes": self.batch * sum(_nbytes(_val(p)) for p in params)})

    def _flat(self, n: fx.Node, x: fx.Node, w: fx.Node, b: Any, transposed: bool) -> fx.Node:
        """A parameter matrix on rows of x merged into [rows, d] (passes/lower/per_sample_loss.py): the use on x
        itself, its output flattened the same way."""
        lin = self._linear(n, x, w, b, transposed=transposed, flat=True)
        # NB: the call's value is on x's rows, not merged: its meta (copied from n) said n's merged shape
        lin.meta["example_value"] = _val(n).new_empty((*_val(x).shape[:-1], _val(n).shape[-1]))
        return self._merged(n, "reshape", (lin, -1, int(_val(n).shape[-1])))

    def _merged(self, n: fx.Node, method: str, args: tuple) -> fx.Node:
        with self.gm.graph.inserting_before(n):
            flat = self.gm.graph.call_method(method, args)
        flat.meta.update(n.meta)
        self.kind_of[flat] = "A"
        return flat

    def _unmerged(self, n: fx.Node, rows: fx.Node) -> tuple[fx.Node, fx.Node]:
        """n on merged rows (per_sample_loss.on_merged_rows) made on ``rows.unflatten(bd, (B, -1))``: (the new use,
        which lower() goes on with, and its input); n's users read its output merged again."""
        g = self.gm.graph
        with g.inserting_before(n):
            x = g.call_method("unflatten", (rows, self.bd, (self.batch, -1)))
            inner = g.node_copy(n, lambda a: x if a is rows else a)
        x.meta, inner.meta = dict(rows.meta), dict(n.meta)
        refresh_example_values([x, inner])
        self.kind_of[x], self.kind_of[inner] = "A", "M"
        n.replace_all_uses_with(self._merged(n, "flatten", (inner, self.bd, self.bd + 1)))
        g.erase_node(n)
        return inner, x

    def _affine(self, n: fx.Node) -> list[Any]:
        return [_arg(n, 2, "weight")] + ([_arg(n, 3, "bias")] if n.target in LAYER_NORMS else [])

    def _fits(self, n: fx.Node, args: tuple) -> bool:
        """Element-wise with a parameter that stays off the batch axis (it is shared by every example)."""
        p = next(a for a in args if direct_param(a, self.kind_of))
        out = _val(n)
        act = next((a for a in args if isinstance(a, fx.Node) and self.kind_of.get(a) in ("A", "M")), None)
        axis = self.moved.get(act, self.bd)
        return isinstance(out, torch.Tensor) and axis is not None and out.dim() - _val(p).dim() > axis

    def _linear(self, n: fx.Node, x: fx.Node, w: fx.Node, b: Any, transposed: bool, flat: bool = False) -> fx.Node:
        """``flat``: n's output is the linear's with the leading axes flattened (``_addmm``)."""
        axis = self._batched(n, x, output=not flat, moved_ok=not flat)
        xv, wv = _val(x), _val(w)
        steps = max(1, xv.numel() // max(1, self.batch * xv.shape[-1]))
        d_in, d_out = (wv.shape[0], wv.shape[1]) if transposed else (wv.shape[1], wv.shape[0])
        params = [w] + ([b] if b is not None else [])
        site = self._site(n, "linear", params, axis)
        form = "direct (tied)" if site.tied else "gram" if gram_is_cheaper(steps, d_in, d_out) else "direct"
        return self._call(n, PerSampleCall(site, "linear", transposed=transposed),
                          (x, w) + ((b,) if b is not None else ()), "matmul" if transposed else "linear", params,
                          form=form, steps=steps, d_in=int(d_in), d_out=int(d_out))

    def _elementwise(self, n: fx.Node, x: fx.Node, p: fx.Node, op: str) -> fx.Node:
        axis = self._batched(n, x, moved_ok=True)
        site = self._site(n, "elementwise", [p], axis)
        return self._call(n, PerSampleCall(site, "elementwise", op=op), (x, p), "elementwise", [p],
                          form="direct", extra_bytes=self.batch * _nbytes(_val(p)))

    def _norm(self, n: fx.Node, x: fx.Node) -> fx.Node:
        """layer_norm / rms_norm with an affine: the normalization without it, then ``* w`` and ``+ b``."""
        w, *rest = self._affine(n)
        g = self.gm.graph
        with g.inserting_before(n):
            if n.target in LAYER_NORMS:
                plain = g.call_function(F.layer_norm, (x, _arg(n, 1, "normalized_shape"), None, None,
                                                        _arg(n, 4, "eps", 1e-5)))
            else:
                plain = g.call_function(F.rms_norm, (x, _arg(n, 1, "normalized_shape"), None, _arg(n, 3, "eps")))
        plain.meta.update(n.meta)
        self.kind_of[plain] = "A"
        out = plain
        for p, op in ((None, ""), (w, "mul"), (rest[0] if rest else None, "add")):
            out = self._elementwise(n, out, p, op) if p is not None else out
            if x in self.moved:  # NB: the examples stay where the norm's input has them
                self.moved[out] = self.moved[x]
        return out

    def _generic(self, n: fx.Node) -> fx.Node:
        """The op and the parameter-only nodes feeding it, as one function of (examples' tensors, other tensors,
        parameters); the parameters' per-example gradients by vmap."""
        k = self.kind_of
        sub, env = fx.Graph(), {}
        inputs: list[fx.Node] = []
        dims: list[int | None] = []
        is_param: list[bool] = []
        p_nodes: list[fx.Node] = []

        def inlined(a: fx.Node) -> bool:  # NB: a constant of alike rows is made again for each example's batch of 1
            return (k.get(a) == "P" and a.op not in ("placeholder", "get_attr")) or (
                k.get(a) == "C" and batch_size_arg(a, self.bd, self.batch) is not None)
        todo = [a for a in n.all_input_nodes if inlined(a)]
        while todo:
            m = todo.pop()
            if m not in p_nodes:
                p_nodes.append(m)
                todo += [a for a in m.all_input_nodes if inlined(a)]
        order = {m: i for i, m in enumerate(self.gm.graph.nodes)}
        p_nodes.sort(key=order.__getitem__)

        # NB: x of x.new_zeros(B, D) gives a dtype and device: whole, not an example's part
        read = {a for m in [*p_nodes, n] if not reads_no_values(m) for a in m.all_input_nodes}

        def inp(a: fx.Node) -> fx.Node:
            if a not in env:
                env[a] = sub.placeholder(f"in_{len(inputs)}")
                inputs.append(a)
                batched = k.get(a) in ("A", "M") and isinstance(_val(a), torch.Tensor) and a in read
                dims.append(self._batched(n, a, moved_ok=True) if batched else None)
                is_param.append(k.get(a) == "P")
            return env[a]
        for m in [*p_nodes, n]:
            for a in m.all_input_nodes:
                if a not in env and (a.op in ("placeholder", "get_attr") or a not in p_nodes):
                    inp(a)
            env[m] = sub.node_copy(m, lambda a: env[a])
            if m.target is SCAN_OP:
                env[m].target = scan_op  # NB: the op's own autograd is refused under torch.func (ops.py)
        held, held_dim = next(((env[a], d) for a, d in zip(inputs, dims) if d is not None), (None, None))
        remade: set[fx.Node] = set()  # NB: values made again for each example's batch of one, and those read them
        for m in p_nodes:
            if any(a in remade for a in m.all_input_nodes):
                remade.add(m)
            if held is not None and (at := batch_size_arg(m, self.bd, self.batch)) is not None:
                remade.add(m)
                # NB: a parameter broadcast to the batch (a learned h0's `expand(B, -1)`): per example its batch is
                # 1, so the size is read from a batched input of the function, not held at B
                with sub.inserting_before(env[m]):
                    size = sub.call_function(torch.ops.aten.sym_size.int, (held, held_dim))
                args = list(env[m].args)
                if at[0] is None:
                    args[at[1]] = size
                else:
                    args[at[0]] = [*args[at[0]][:at[1]], size, *args[at[0]][at[1] + 1:]]
                env[m].args = tuple(args)
        if not isinstance(_val(n), torch.Tensor):
            raise _refuse(n, f"uses a parameter and returns {type(_val(n)).__name__}, not one tensor: the generic "
                             "per-example fallback takes single-tensor ops only")
        sub.output(env[n])
        fn = fx.GraphModule(self.gm, sub)
        params = [a for a, p in zip(inputs, is_param) if p]
        if (out_axis := self.moved.get(n, self.bd)) is None:
            raise _refuse(n, "uses a parameter, but the examples' axis of its output is not known")
        # NB: a value of parameters made from a constant of the batch's size (``Linear(x.new_zeros(B, H))``, an RNN's
        # first step) has the examples' axis, but is made again per example above: one row each, broadcast nowhere
        # (a mix of its rows, a cumsum over them, is caught in the backward: per_sample_backward.check_lined_up)
        if _name(n) in BROADCASTING and (p := next((a for a in n.all_input_nodes if self.kind_of.get(a) == "P" and
                                                  a not in remade and not _short_of(a, _val(n).dim(), out_axis)),
                                                 None)) is not None:
            raise _refuse(n, f"broadcasts the parameter value {p.name} {tuple(_val(p).shape)} along the examples' axis "
                             "(each example would meet its own part of it): not supported under per_sample_clip")
        site = self._site(n, "generic", params, out_axis)
        extra = self.batch * sum(_nbytes(_val(p)) for p in params)
        call = self._call(n, PerSampleCall(site, "generic", fn=fn, dims=tuple(dims), is_param=tuple(is_param)),
                          tuple(inputs), "generic", params, form="per-example gradients (vmap)", extra_bytes=extra)
        return call


_MEANS_WARNED: set[str] = set()  # the batch means warned about (their source lines): once each


def warn_batch_mean(gm: fx.GraphModule, kind_of: dict[fx.Node, str], bd: int, clip: float) -> None:
    """A loss that is a mean over the examples divides each example's gradient by the N values averaged: the bound
    C then acts as N·C on the summed loss's per-example norms (C = 1 clips nothing of a typical model)."""
    for n in gm.graph.nodes:
        name, red = _name(n), n.kwargs.get("reduction", next((a for a in n.args if a in ("none", "sum")), "mean"))
        if kind_of.get(n) == "D" or reduction(n, kind_of, bd) != "R" or clip == float("inf") or name not in (
                "mean", "nanmean") and (name not in LOSSES or red != "mean") or (
                key := f"{source_at(n)} {n.name}") in _MEANS_WARNED:
            continue
        t = _val(n.args[1]) if name in ("cross_entropy", "nll_loss") and len(n.args) > 1 else None
        N = t.numel() if isinstance(t, torch.Tensor) else _val(n.args[0]).numel() // max(1, _val(n).numel())
        if N > 1:
            _MEANS_WARNED.add(key)
            warnings.warn(f"adjoint-compile per_sample_clip: the loss is a mean over the batch ({name} at "
                          f"{source_at(n)}): it divides every example's gradient and its norm by the N = {N} values "
                          f"averaged, so per_sample_clip={clip:g} bounds the summed loss's norms at N·C = "
                          f"{N * clip:g} and may clip nothing. Reduce with a sum (.sum(), reduction=\"sum\") and "
                          f"divide the clipped gradients by the batch size yourself (DP-SGD's form), or pass C/N "
                          f"(here {clip / N:g}) to bound them at C", AdjointCompileWarning, stacklevel=2)


def lower_per_sample(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options) -> PerSampleLowering:
    """Replace every parameter use in ``gm`` with a book-keeping call; raise :class:`PerSampleError` for ops that
    mix examples."""
    kind_of, batch = _classify(gm, example_inputs, opts.batch_dim)
    uses = [n for n in gm.graph.nodes if kind_of.get(n) == "M"]
    if batch is None:
        raise PerSampleError(f"adjoint-compile per_sample_clip: no graph input has an example axis batch_dim="
                             f"{opts.batch_dim}; per-example gradients need one")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out_node.all_input_nodes:
        if kind_of.get(a) == "P":
            raise _refuse(a, "is a parameter value returned by the graph without meeting an example: its gradient "
                             "could not be attributed to examples")
    warn_batch_mean(gm, kind_of, opts.batch_dim, float(opts.per_sample_clip or float("inf")))
    warn_data_divisor(gm, kind_of, float(opts.per_sample_clip or float("inf")), source_at)
    low = _Lowerer(gm, kind_of, opts, batch)
    for n in uses:
        for p in {q for a in n.all_input_nodes if kind_of.get(a) == "P" for q in low._param_leaves(a)}:
            low.uses_of[p] = low.uses_of.get(p, 0) + 1
    for n in uses:
        low.lower(n)
    for n in reversed(list(gm.graph.nodes)):  # the parameter-only nodes the generic calls took in
        if kind_of.get(n) == "P" and n.op not in ("placeholder", "get_attr") and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    log.info("per_sample_clip: %d parameter use(s) lowered (B=%d): %s", len(low.out.uses), batch,
             [(u["node"], u["kind"], u.get("form")) for u in low.out.uses])
    return low.out
