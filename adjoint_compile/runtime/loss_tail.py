"""The loss at the end of a sharded region, computed with its gradient in the forward, a chunk of steps at a time.

A region whose outputs include a scalar sum over time (a loss: cross-entropy, a mean of squares, a z-loss) ends in
a *tail*: the ops that feed those outputs and nothing else. Typically the vocabulary head and the loss::

    before:  ShardedRegion( x ─► scans, joins ─► y ─► head ─► logits ─► cross_entropy ─► loss )
    after:   ShardedRegion( x ─► scans, joins ─► y )  ─►  LossTail( y ─► head ─► logits ─► cross_entropy ─► loss )

The loss ℓ is a scalar whose cotangent g arrives in the backward, and its gradient is linear in g:
∂L/∂y = g · ∂ℓ/∂y and ∂L/∂θ = g · ∂ℓ/∂θ for the tail's parameters θ (the head's weight). So the tail runs once, in
the forward, chunk by chunk over the steps: one program per chunk gives the chunk's share of ℓ and of ∂ℓ/∂y and
∂ℓ/∂θ, and the chunk's logits are gone before the next chunk starts; its backward multiplies by g. The rest of the
region is swept as before, with g · ∂ℓ/∂y as the cotangent of y. Exact, like the sweep; the head and the loss are
never recomputed, and their chunks are sized by the tail's own activations (a shard of the rest can be long while a
chunk of logits stays small).

The cut is a minimum cut over the region's graph at the cheapest values per step (usually the last hidden state, far
smaller than the logits). What is kept: ∂ℓ/∂y for every step and ∂ℓ/∂θ; the split is made only where the tail makes at
least twice the bytes per step that it keeps. A tail with a causal conv or a token shift, a loss per sequence (not a
scalar), or a cut through a value without the step axis is not split: the region runs as one sweep as before.

Under ``per_sample_clip`` the tail's chunks run their program made per example (runtime/sharded_ps.py): one backward
gives ∂ℓ/∂y and the per-example gradients of the tail's parameters, summed over the chunks and scaled by g in the
backward, where they are recorded with the rest's. The head then runs as written (not fused), and a region that ends
in two losses keeps them in the sweep (their per-example gradients would need one backward each).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .. import timing
from ..analysis.fx import is_linear_scan, is_view_op
from ..errors import UnsupportedRegion
from ..inner import COMPILE_LOCK, compile_inner, stride_checked
from ..kernels.linear_ce import kernel_serves
from .first_order import first_order
from .fused_loss import find_head_losses, fuse_head_losses
from .graphed import captured, graphable, replayed
from .shard_parts import (accumulate, accumulated, arg_layout, autocast_as, autocast_off, autocast_state,
                          min_chunk_bytes, serial_kernels, wanted_shard_size)
from .shard_program import ShardProgram, _devices, _ev
from .sharded_ps import record_region, tail_example_grads

log = logging.getLogger(__name__)

__all__ = ["TailSplit", "split_tail", "check_tail", "tail_inputs", "run_tail"]


@dataclasses.dataclass
class TailSplit:
    """A region cut into the sweep of its rest and its loss tail (module docstring)."""

    #: the region without its tail: the same inputs; outputs: the region's outputs the tail does not make, then the
    #: frontier values the tail reads from it
    rest: ShardProgram
    #: the tail: inputs are ``sources`` in order; outputs: the region's outputs at ``tail_pos``
    tail: ShardProgram
    #: per tail input, ("rest", k): the rest's k-th frontier output, or ("input", i): the region's input i
    sources: list[tuple[str, int]]
    #: the region's outputs made by the tail, and by the rest (each in the region's order)
    tail_pos: list[int]
    rest_pos: list[int]
    #: the tail's activations per step (its values along time that are not views)
    step_bytes: int = 0
    #: the heads whose cross-entropy runs fused, without their logits (:mod:`.fused_loss`)
    fused_heads: int = 0
    #: the region's values the tail reads, in the order of ``sources``
    frontier: list[fx.Node] = dataclasses.field(default_factory=list)

    def chunk(self, shard_size: int | None, device: torch.device | None) -> int | None:
        """The tail's steps per chunk: None (chosen by the tail from its own activations) when ``shard_size`` is
        None, else ``shard_size`` cut to the least bytes of a loss chunk (a long shard's logits in chunks)."""
        if shard_size is None:
            return None
        return min(shard_size, wanted_shard_size(shard_size, 0, max(1, self.step_bytes), min_chunk_bytes(device)))


def split_tail(plan: ShardProgram, fused: bool | str = False) -> TailSplit | str:
    """The loss tail of the prepared region ``plan`` as a :class:`TailSplit`, or why there is none (a string);
    ``fused``: the ``fused_loss`` option (its heads and cross-entropies fused where it applies)."""
    info, gm = plan.info, plan.region_gm
    outs = plan.out_nodes
    tail_pos = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and o in info.sums and _scalar(o)]
    if not tail_pos:
        return "no scalar sum over time among the outputs"
    got = _min_cut(plan, [outs[i] for i in tail_pos], {o for i, o in enumerate(outs) if i not in tail_pos})
    if got is None:
        return "every cut before the loss reads a value without the step axis as a dim of its own"
    tail, frontier = got
    inner = [f for f in frontier if f.op != "placeholder"]
    kept = sum(_nbytes(_ev(f)) for f in inner) // plan.T
    made = sum(_nbytes(_ev(n)) for n in tail if info.step_dim.get(n) is not None and not is_view_op(n)) // plan.T
    if 2 * kept > made:
        return (f"the loss reads {kept} bytes per step from the rest of the region ({', '.join(f.name for f in inner)})"
                f" and makes {made}: keeping their gradients would cost more than recomputing it saves")
    rest_gm = _rest_graph(gm, tail, [outs[i] for i in range(len(outs)) if i not in tail_pos] + inner)
    tail_gm = _tail_graph(gm, tail, frontier, [outs[i] for i in tail_pos])
    dims = [info.step_dim.get(f) if f.op != "placeholder" else plan.in_step_dims[plan.placeholders.index(f)]
            for f in frontier]
    try:
        rest = ShardProgram(rest_gm, plan.in_step_dims, None, plan.inner, plan.window)
        tail_prog = ShardProgram(tail_gm, dims, None, plan.inner, None, scans_required=False)
        tail_prog.loss_chunks = True
    except (UnsupportedRegion, ValueError) as e:
        return f"the split does not make two shard programs: {e}"
    for p in (rest, tail_prog):
        p.length_free, p.shared = plan.length_free, plan.shared
    n_rest = len(outs) - len(tail_pos)
    sources = [("input", plan.placeholders.index(f)) if f.op == "placeholder" else ("rest", n_rest + inner.index(f))
               for f in frontier]
    split = TailSplit(rest, tail_prog, sources, tail_pos, [i for i in range(len(outs)) if i not in tail_pos], made,
                      frontier=frontier)
    heads = [hl for hl in find_head_losses(gm, _ev) if hl.logits in tail] if fused else []
    if heads and (fused is True or all(kernel_serves(_ev(hl.h), _ev(hl.weight)) for hl in heads)):
        # NB: the chunks are then sized without the logits (a chunk holds its rows' hidden states and their gradient)
        gone = {n for hl in heads for n in hl.chain}
        split.step_bytes = tail_prog.fused_step_bytes = max(1, sum(
            _nbytes(_ev(n)) for n in tail if n not in gone and info.step_dim.get(n) is not None
            and not is_view_op(n)) + sum(_nbytes(_ev(hl.h)) for hl in heads)) // plan.T
        split.fused_heads = tail_prog.fused_heads = len(heads)
    return split


def _min_cut(plan: ShardProgram, tail_outs: list[fx.Node],
             rest_outs: set[fx.Node]) -> tuple[set[fx.Node], list[fx.Node]] | None:
    """The tail with the cheapest frontier: (the nodes the tail computes, the values it reads from the rest or the
    region's inputs, in graph order), or None when every cut reads a value the rest cannot hand over.

    A minimum cut (networkx) over the region's nodes, each split in two: ``(n, 0)`` on the sink side means n is
    computed by the tail, ``(n, 1)`` there means the tail reads n; the edge between them costs what the tail would
    keep of n per step (its gradient), or cannot be cut (a tuple, a value without the step axis). The scans, the
    region's inputs and its other outputs stay with the rest; a tail node's users are tail nodes."""
    info, T = plan.info, plan.T
    g = nx.DiGraph()
    nodes = list(plan.region_gm.graph.nodes)
    for k, n in enumerate(nodes):
        if n.op == "output":
            continue
        v = _ev(n)
        if n.op == "placeholder":
            d = plan.in_step_dims[plan.placeholders.index(n)]
            cost = _nbytes(v) // T * len(nodes) if d is not None and isinstance(v, torch.Tensor) and \
                v.is_floating_point() else 0
        elif isinstance(v, torch.Tensor) and info.step_dim.get(n) is not None and n not in info.folds:
            # NB: ties go to the earlier value (a later one costs a little more): the larger tail, run once
            cost = max(1, _nbytes(v) // T) * len(nodes) + k
        else:
            cost = None  # NB: no capacity: networkx takes the edge as uncuttable
        g.add_edge((n, 0), (n, 1), **({} if cost is None else {"capacity": cost}))
        g.add_edge((n, 1), (n, 0))
        for u in n.users:
            if u.op != "output":
                g.add_edge((n, 1), (u, 0))
                g.add_edge((u, 0), (n, 0))
        if n.op == "placeholder" or n in rest_outs or is_linear_scan(n):
            g.add_edge("rest", (n, 0))
    for o in tail_outs:
        g.add_edge((o, 0), "tail")
    try:
        _, (_, sink) = nx.minimum_cut(g, "rest", "tail")
    except nx.NetworkXUnbounded:
        return None
    tail = {n for n in nodes if (n, 0) in sink}
    return tail, [n for n in nodes if (n, 1) in sink and n not in tail]


def _scalar(n: fx.Node) -> bool:
    v = _ev(n)
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype.is_floating_point


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _copy(g: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    new = g.node_copy(n, env.__getitem__)
    # NB: dynamo's example values are those of the length the graph was captured at (a region serving every length
    # is retargeted from it): the split programs' analysis must read the values their own propagation gives
    new.meta.pop("example_value", None)
    return new


def _rest_graph(gm: fx.GraphModule, tail: set[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op != "output" and n not in tail:
            env[n] = _copy(g, n, env)
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g)


def _tail_graph(gm: fx.GraphModule, tail: set[fx.Node], frontier: list[fx.Node],
                outputs: list[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env = {f: g.placeholder(f.name) for f in frontier}
    for n in gm.graph.nodes:
        if n in tail:
            env[n] = _copy(g, n, env)
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g)


def check_tail(tail: ShardProgram) -> str:
    """Why the prepared tail cannot run chunk by chunk without carries ("" when it can)."""
    if tail.convs or tail.shift_scans:
        return "the loss reads a causal conv or a token shift along time"
    if any(d is not None for d in tail.out_step_dims):
        return "the loss part has outputs along time"
    return ""


class _TailFn(torch.autograd.Function):
    """``apply(tail, (want_grads, graphs), *inputs)``: the tail's outputs (sums over the chunks), with its gradients
    on the way and scaled by the cotangents in the backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, tail: ShardProgram, how: tuple[bool, bool],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        want, graphs = how
        wrt = [i for i, (x, n) in enumerate(zip(inputs, ctx.needs_input_grad[2:])) if want and n]
        ps = getattr(tail, "per_sample", None) if wrt else None
        # per_sample_clip: the parameters' per-example gradients, made with the loss's (runtime/sharded_ps.py)
        acc: dict[int, torch.Tensor] | None = {} if ps is not None else None
        ctx.tail, ctx.ps_params = tail, {i: inputs[i] for i in ps.params if i in wrt} if ps is not None else {}
        if ps is None and graphs and wrt and not tail.random and graphable(inputs, tail.inner):
            outs, grads = _looped(tail, inputs, wrt)
        else:
            outs, grads = _chunks(tail, inputs, wrt, graphs and ps is None, acc)
        # NB: saved, not kept on ctx: autograd frees them once the backward has used them, before the rest's sweep
        ctx.ps_keys = list(acc or ())
        ctx.save_for_backward(*(acc or {}).values())
        ctx.grads = grads
        # the counts of a mean over valid targets, and an output no input reaches with grad (an accuracy of detached
        # logits, returned with the loss): requires no grad, as in eager
        ctx.mark_non_differentiable(*outs[len(grads):], *(o for j, (o, row) in enumerate(zip(outs, grads)) if wrt and
                                                          all(g is None for g in row) and not (j == 0 and ctx.ps_keys)))
        return tuple(outs)

    @staticmethod
    @first_order
    def backward(ctx: Any, *gouts: torch.Tensor) -> tuple[Any, ...]:
        n = len(ctx.grads[0]) if ctx.grads else 0
        res: list[Any] = [None] * n
        for gj, row in zip(gouts, ctx.grads):
            if gj is None:
                continue
            for i, G in enumerate(row):
                if G is not None:
                    v = _scaled(G, gj)
                    res[i] = v if res[i] is None else res[i] + v
        if ctx.ps_keys and gouts[0] is not None:
            record_region(ctx.tail.per_sample, ctx.ps_params,
                          {i: _scaled(a, gouts[0]) for i, a in zip(ctx.ps_keys, ctx.saved_tensors)})
        return (None, None, *res)


def _scaled(G: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``G · g``, with 0 where ``G`` is 0 whatever ``g``: eager's cross-entropy writes 0 for an ignored target
    whatever its cotangent, and a sum over no valid target divided by their count (0) has an infinite one."""
    v = (G * g).to(G.dtype)
    return v.masked_fill_((G == 0) & ~torch.isfinite(g), 0)  # NB: no host sync; the mask is False where g is finite


def _chunks(tail: ShardProgram, inputs: Sequence[torch.Tensor], wrt: list[int], graphs: bool,
            ps_acc: dict[int, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[list[Any]]]:
    """The tail's outputs, summed over its chunks, and per differentiable output j and input i the gradient
    ∂out_j/∂x_i (None where the loss does not reach x_i), chunk by chunk; ``graphs``: each chunk's program replayed
    from a CUDA graph where it can be; ``ps_acc`` (per_sample_clip): the parameters' per-example gradients are
    added there instead."""
    n_out = len(tail.out_nodes)
    outs: list[torch.Tensor] | None = None
    grads: list[list[Any]] = [[None] * len(inputs) for _ in range(n_out)]
    free: list[dict[int, torch.Tensor]] = [{} for _ in range(n_out)]  # the step-free inputs' gradients
    for s, e in tail.bounds():
        xs = tail.shard_inputs(inputs, s, e - s)
        if wrt and ps_acc is not None:
            vals, got = tail_example_grads(tail, e - s, xs, wrt, s, ps_acc)
        elif wrt:
            vals, got = value_and_grad(tail, e - s, xs, wrt, s, graphs)
        else:
            vals, got = tail.run(e - s, xs, [], first_shard=s == 0, t0=s, graphs=graphs)[0], {}
        if outs is None:
            outs = [v.new_zeros(v.shape, dtype=torch.promote_types(v.dtype, torch.float32)
                                if v.dtype.is_floating_point else v.dtype) for v in vals]
        for o, v in zip(outs, vals):
            o.add_(v)
        for (j, i), g in got.items():
            d = tail.in_step_dims[i]
            if d is None:
                accumulate(free[j], i, g)
                continue
            if grads[j][i] is None:
                grads[j][i] = torch.zeros_like(inputs[i])
            grads[j][i].narrow(d, s, e - s).copy_(g)
    assert outs is not None
    for j in range(n_out):
        accumulated(free[j], grads[j], inputs)
    # NB: the counts of a mean over valid targets stay in fp32 at least: a weight sum of 2^16 tokens is inf in fp16
    return [o.to(v.dtype) if j < n_out else o for j, (o, v) in enumerate(zip(outs, vals))], grads[:n_out]


#: chunk loops seen once, by tail and key (lengths, layout), the most recent last: the (j, i) pairs of the gradients
#: they make; and those seen again, captured as one graph each with their pairs (:func:`_looped`)
_SEEN: collections.OrderedDict = collections.OrderedDict()
_LOOPS: collections.OrderedDict = collections.OrderedDict()

#: whether the first call of a length replays each chunk's program from a graph of its own (fast for a length seen
#: once; those graphs keep a chunk's working set in the pool, which the loop's capture did not reuse on an H200)
FIRST_CALL_GRAPHS = True

#: the most captured chunk loops kept in a process: each holds its full-length inputs and gradients in the graphs'
#: pool, so lengths that keep changing do not pile up graphs (a length seen once runs its chunks' own graphs)
MAX_LOOPS = 4


def _looped(tail: ShardProgram, inputs: Sequence[torch.Tensor],
            wrt: list[int]) -> tuple[list[torch.Tensor], list[list[Any]]]:
    """:func:`_chunks` on CUDA graphs: the first call with some lengths and layout replays each chunk's program from
    its own graph; the second captures the whole loop over the chunks as one graph, replayed from then on (one launch
    per step instead of one per chunk). The loop's results are copied out, as the next replay overwrites them."""
    ref = weakref.ref(tail)  # NB: weak: a region dropped for its length lets its tail and graph go
    key = (ref, tail.T, tail.shard_size, _devices(inputs), autocast_state(), tuple(wrt), arg_layout(inputs))
    entry = _LOOPS.pop(key, None)
    if entry is None:
        pairs = _SEEN.pop(key, None)
        if pairs is None:
            outs, grads = _chunks(tail, inputs, wrt, FIRST_CALL_GRAPHS)
            _SEEN[key] = [(j, i) for j, row in enumerate(grads) for i, g in enumerate(row) if g is not None]
            while len(_SEEN) > 64:
                _SEEN.popitem(last=False)
            return outs, grads

        def loop(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outs, grads = _chunks(ref(), xs, wrt, False)
            return (*outs, *(grads[j][i] for j, i in pairs))
        entry = (captured(loop, inputs, "loss's chunk loop"), pairs)
    _LOOPS[key] = entry
    while len(_LOOPS) > MAX_LOOPS:
        _LOOPS.popitem(last=False)
    call, pairs = entry
    res = [r.clone() for r in call(*inputs)]
    n = len(res) - len(pairs)
    grads = [[None] * len(inputs) for _ in range(len(tail.out_nodes))]
    for (j, i), g in zip(pairs, res[n:]):
        grads[j][i] = g
    return res[:n], grads

def value_and_grad(tail: ShardProgram, L: int, xs: Sequence[Any], wrt: list[int], t0: int,
                   graphs: bool = False) -> tuple[list[torch.Tensor], dict[tuple[int, int], torch.Tensor]]:
    """One chunk of the tail: its outputs, and per (differentiable output j, input i in ``wrt``) ∂out_j/∂x_i, from
    one program (the chunk's forward and one VJP per output, traced together and compiled by the inner compiler)."""
    fwd = autocast_state()
    args = [*xs, *tail._offset(t0)]
    key = ("value_and_grad", L, _devices(args), fwd, tuple(wrt), arg_layout(args))
    if tail.shared is not None:
        key += (tail.program(L).code,)
    entry = tail.vjps.get(key)
    with autocast_off():
        if entry is None:
            with COMPILE_LOCK:
                entry = tail.vjps.get(key) or _build(tail, L, wrt, args, fwd)
                tail.vjps[key] = entry
        fn, pairs = entry
        # NB: replayed from a CUDA graph where it can be: the caller adds the values up and copies the gradients
        got = list(replayed(fn, args, tail.inner, "loss chunk")(*args) if graphs and not tail.random else fn(*args))
    n = len(tail.out_step_dims)
    vals = tail._mean_scaled(got[:n])
    grads = dict(zip(pairs, got[n:]))
    if tail.length_free and any(tail.out_means):  # NB: a mean over time: its program gives L·mean, the value /T
        grads = {(j, i): g / tail.T if tail.out_means[j] else g for (j, i), g in grads.items()}
    return vals, grads


#: the fused op's implementation in loss chunks (None: the kernels where they serve; tests set "triton")
FUSED_IMPL: str | None = None


def _fused(tail: ShardProgram, prog: fx.GraphModule, example: list[Any], fwd: tuple) -> fx.GraphModule:
    """``prog`` with its heads and cross-entropies fused (:mod:`.fused_loss`), as many as the split counted."""
    g = fx.Graph()
    g.output(g.graph_copy(prog.graph, {}))
    gm = fx.GraphModule(prog, g)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example)
    dev = next(x.device.type for x in example if isinstance(x, torch.Tensor))
    cast = next((dt for d, on, dt in fwd if on and d == dev), None)
    got = fuse_head_losses(gm, lambda n: n.meta.get("val"), FUSED_IMPL, cast)
    if got != tail.fused_heads:
        # NB: the chunks were sized without these logits: a head left as written holds more than planned
        warnings.warn(f"adjoint-compile: a loss chunk's program has {got} fusable vocabulary heads where its region "
                      f"had {tail.fused_heads}: the others keep their logits, in chunks sized without them")
    return gm


def _build(tail: ShardProgram, L: int, wrt: list[int], example: list[Any], fwd: tuple) -> tuple[Any, list]:
    prog = tail.program(L)
    if getattr(tail, "fused_heads", 0):
        prog = _fused(tail, prog, example, fwd)
    n_x = len(tail.placeholders)
    off = tuple((d, False, dt) for d, _, dt in fwd)
    pairs: list[tuple[int, int]] = []

    def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(i in wrt) for i, x in enumerate(flat[:n_x])]
            with autocast_as(fwd):
                res = prog(*xs, *flat[n_x:])
            got: list[torch.Tensor] = []
            pairs.clear()
            diff = [j for j, y in enumerate(res) if isinstance(y, torch.Tensor) and y.requires_grad]
            # NB: the VJPs run without autocast, as eager's backward does
            with autocast_as(off):
                for k, j in enumerate(diff):
                    gs = torch.autograd.grad(res[j], [xs[i] for i in wrt], torch.ones_like(res[j]),
                                             retain_graph=k < len(diff) - 1, allow_unused=True)
                    for i, g in zip(wrt, gs):
                        # NB: an input the loss does not reach (a parameter seen only through .detach()) gets None,
                        # as from autograd, not zeros (an optimizer would decay it as though it had a gradient)
                        if g is not None:
                            pairs.append((j, i))
                            got.append(g)
        return (*(r.detach() for r in res), *got)

    t = time.perf_counter()
    # NB: anomaly mode's NaN check would read the fake tensors' values (a data-dependent guard) while tracing;
    # the traced program's ops are checked by no one in either case, as in any compiled backward
    with torch.autograd.set_detect_anomaly(False):
        gm = make_fx(joint, tracing_mode="fake")(*example)
    gm.meta = {**getattr(gm, "meta", {}), "provenance": "adjoint_compile: loss chunk value and gradient"}
    log.debug("adjoint-compile: loss chunk program for L=%d: %d nodes", L, len(gm.graph.nodes))
    # NB: the trace and the compile count as one loss chunk program
    timing.add_run_time("loss_chunks", time.perf_counter() - t, count=tail.inner == "eager")
    fn = stride_checked(gm) if tail.inner == "eager" else compile_inner(
        gm, example, tail.inner, what="loss_chunks", serial=serial_kernels(tail, L, example))
    return fn, list(pairs)


def tail_inputs(split: TailSplit, inputs: Sequence[Any], rest_outputs: Sequence[Any]) -> list[Any]:
    """The tail's inputs: the rest's frontier outputs and the region's inputs it reads."""
    return [rest_outputs[k] if src == "rest" else inputs[k] for src, k in split.sources]


def run_tail(tail: ShardProgram, inputs: Sequence[torch.Tensor], shard_size: int | None,
             graphs: bool = False) -> list[torch.Tensor]:
    """The tail's outputs on ``inputs`` (the frontier values and region inputs it reads), chunk by chunk, with the
    gradients kept for the backward when grad mode is on and an input requires grad; ``graphs``: its programs
    replayed from CUDA graphs where they can be (:mod:`.graphed`)."""
    tail.prepare(inputs, shard_size)
    want = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
    return list(_TailFn.apply(tail, (want, graphs), *inputs))
