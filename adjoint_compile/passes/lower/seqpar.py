"""Lowering for ``options={"sequence_parallel": group}``: the graph runs on one rank's slice of the sequence.

Before (one rank's graph, ``x`` its slice [B, n_r, D])::

    xc = torch.conv1d(x_t, w, bias, (1,), (3,), (1,), C)        # causal: padded k-1 = 3 steps on both sides
    xs = xc[(Ellipsis, slice(None, n_r))]                       # ... and the right padding dropped
    h = torch.ops.adjoint_compile.linear_scan.default(a, b, None, 1, False, None, None)

After::

    seqpar_halo_0 = SeqHalo(state, p=3, dim=-1)                 # runtime/seqpar.py
    halo = self.seqpar_halo_0(x_t)                              # the 3 steps before this slice, from the ranks before
    xs = torch.conv1d(torch.cat([halo, x_t], -1), w, bias, (1,), 0, (1,), C)
    h = self.seqpar_scan_0(a, b, None)                          # SeqScan: carry-in from the ranks before

In exact mode the recognized regions are lowered as well (passes/lower/; under ``sequence_parallel`` a region of
several scans is cut into one region per scan, passes/lower/sharded.py) and each one-scan region's ShardedRegion is
wrapped in :class:`~adjoint_compile.runtime.seqpar_sharded.SeqShardedRegion`: sharded inside the rank, its carry-in
and adjoint carry exchanged with the other ranks.  Scans left outside regions become SeqScans.

The module and call nodes are named ``seqpar_*``; the backend stitches them outside the inner compiler (as region
calls) and wraps the whole graph in :class:`~adjoint_compile.runtime.seqpar.SeqParCall`.

What may be split: every op must act on each step on its own (analysis/time_local.py), except ``linear_scan``
(forward, no window, along any dim) and causal convolutions along the last dim of their input written as above
(padding p = dilation·(k-1), stride 1, the output cut back to the input's length).  The step axis of the graph's
sequence inputs is dim 1 (``[B, T, ...]``).  Anything else that mixes steps (attention, a sum or mean over time,
a non-causal conv, a shift, a reverse scan) is a refusal naming the op and its source line; the refusal is raised
on every rank by the call's header exchange, before any model data is exchanged. So is a number read from the step
axis' length (``h / x.shape[1]``: the slice's length on a rank): refused where a symbolic graph shows it
(``meta["sizes_read"]``, passes/capture/specialize.py); a static graph's literal is compared across the ranks by the
header, and where the slices are of one length a number equal to it warns.

The graph's parameters, whose gradients are summed over the group, are its ``nn.Parameter`` inputs and the tensors
that require grad read from a module's attributes (a learnable plain attribute, passed by dynamo as an input).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import example_value, is_linear_scan, scan_args, source_at
from ...analysis.optable import POINTWISE, op_name
from ...analysis.rules import op_label, step_shape
from ...analysis.time_local import analyze, causal_conv as _causal_conv, conv_args as _conv_args
from ...options import Options
from ...runtime.seqpar import SeqHalo, SeqParState, fingerprint, resolve_group
from ...runtime.seqpar_sharded import SeqShardedRegion, distribute_scans, unsharded_region
from ...runtime.sharded import ShardedRegion

log = logging.getLogger(__name__)

__all__ = ["SeqParPlan", "lower_seqpar"]

@dataclasses.dataclass
class SeqParPlan:
    """What :func:`lower_seqpar` did to one graph, and what its :class:`SeqParCall` needs."""

    state: SeqParState
    #: the ``seqpar_*`` call nodes (stitched outside the inner compiler).
    calls: list[str]
    fingerprint: int
    #: this rank's steps (-1: no sequence input found)
    length: int
    #: why this graph cannot be split (None: it can)
    refusal: str | None
    #: positions of the graph's parameters among its inputs (learnable attribute tensors too: _held_by_model)
    params: list[int]
    scans: int = 0
    halos: int = 0
    #: sharded regions run on this rank's slice (exact mode)
    regions: int = 0
    #: the numbers of the graph's value ops, (op, source line, numbers) each, compared across the ranks
    numbers: list[tuple[str, str, tuple]] = dataclasses.field(default_factory=list)
    #: warnings for numbers equal to this rank's slice length (given when every slice has that length)
    suspects: list[str] = dataclasses.field(default_factory=list)


def _refusal(node: fx.Node, why: str) -> str:
    return (f"sequence_parallel: {op_label(node)} ({node.name}) cannot be split across ranks: {why}. "
            f"At {source_at(node)}. Only ops that act on each step on its own, linear_scan (forward, no window) and "
            f"causal convolutions along time can run on a slice of the sequence")


def _held_by_model(ph: fx.Node, ex: Any) -> bool:
    """A tensor that requires grad read from a module's attributes (``self.scale = torch.ones(D).requires_grad_()``,
    not an nn.Parameter; dynamo passes it as a plain input): the same on every rank, so its gradient is the sum of the
    ranks' like a parameter's. A tensor passed as an argument is the caller's (a slice, an ``h0``): left alone."""
    src = getattr(ph.meta.get("grapharg"), "source", None)
    if not (isinstance(ex, torch.Tensor) and ex.requires_grad):
        return False
    while src is not None:
        if "NNModuleSource" in type(src).__name__:  # NB: by name: torch._dynamo.source's classes move between versions
            return True
        src = getattr(src, "base", None)
    return False


def _fingerprint_parts(gm: fx.GraphModule, examples: list[Any], opts: Options, params: set[int]) -> list[Any]:
    parts: list[Any] = [opts.mode, opts.window, opts.reduce_grads]
    for i, (n, ex) in enumerate(zip([n for n in gm.graph.nodes if n.op == "placeholder"], examples)):
        if isinstance(ex, torch.Tensor):
            # NB: the whole shape of a parameter; of an activation all but dim 1, the rank's own number of steps
            shape = tuple(ex.shape) if i in params else tuple(
                -1 if j == 1 else int(v) for j, v in enumerate(ex.shape))
            parts.append(("in", str(ex.dtype), bool(ex.requires_grad), shape))
        # NB: not the numbers: with dynamic shapes dynamo passes sizes, and a rank's slice of a view its storage
        # offset, as inputs of their own; rank 1's x[:, 4:8] had one more than rank 0's x[:, 0:4]
    # NB: op names only, not arguments: a static graph's arguments hold the rank's own slice length
    parts += [(n.op, op_label(n)) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return parts


def _check(gm: fx.GraphModule, examples: list[Any], params: set[int]):
    """(T, convs, scans, refusal) of the graph: the analysis of the module docstring."""
    nodes = list(gm.graph.nodes)
    scans = [n for n in nodes if is_linear_scan(n)]
    phs = [n for n in nodes if n.op == "placeholder"]
    seq_in = [(i, n) for i, n in enumerate(phs) if i not in params and i < len(examples)
              and isinstance(examples[i], torch.Tensor) and examples[i].dim() >= 2]
    if scans:
        sa = scan_args(scans[0])
        v = example_value(sa["a"])
        T = v.shape[sa["dim"]] if isinstance(v, torch.Tensor) else None
    else:
        T = examples[seq_in[0][0]].shape[1] if seq_in else None
    if T is None:
        return None, [], scans, None
    base = {n: 1 for i, n in seq_in if examples[i].shape[1] == T}
    steps = {(i, 1) for i, n in seq_in if n in base}
    for s in scans:
        base[s] = scan_args(s)["dim"]
    convs: dict[fx.Node, tuple[fx.Node, int]] = {}
    for _ in range(len(nodes)):
        seeds = dict(base)
        for sl, _p in convs.values():
            seeds.setdefault(sl, len(step_shape(sl)) - 1)
        info = analyze(gm, seeds)
        more = {}
        for n in nodes:
            if n in convs or (m := _causal_conv(n)) is None:
                continue
            x = _conv_args(n)["input"]
            if info.step_dim.get(x) == len(step_shape(x)) - 1 and step_shape(m[0])[-1] == T:
                more[n] = m
        if not more:
            break
        convs.update(more)
    allowed = set(convs) | {sl for sl, _ in convs.values()}
    for n in nodes:
        if n in allowed or (n.users and all(_shape_only(u) for u in n.users)):
            continue
        why = info.mixing.get(n)
        if why is None and _numbers(n) and steps & n.meta.get("sizes_read", set()):
            # NB: a number only a symbolic graph shows to be the step length (specialize.py); a static graph's is a
            # literal, compared across the ranks instead (lower_seqpar)
            why = ("it reads the length of the step axis as a number (x.shape[1]): on a rank that is its slice's "
                   "length, not the sequence's; compute the number from the whole length outside the compiled model "
                   "and pass it in")
        if why is None and is_linear_scan(n) and scan_args(n)["window"] is not None:
            why = "a windowed linear_scan reads the inputs of the previous window on other ranks"
        if why is not None:
            return T, convs, scans, _refusal(n, why)
    return T, convs, scans, None


#: ops whose number arguments are values (``h / 5``), not sizes, dims or indices: a number there that came from the
#: length of a rank's slice (``h / x.shape[1]``) gives that rank's result for its slice, not the sequence's
_VALUE_OPS = POINTWISE | frozenset(("full_like", "fill", "fill_"))


def _numbers(n: fx.Node) -> tuple:
    """The number arguments of a value op (position or keyword, value); () for other nodes."""
    if n.op not in ("call_function", "call_method") or op_name(n) not in _VALUE_OPS:
        return ()
    items = list(enumerate(n.args)) + list(n.kwargs.items())
    return tuple((k, v) for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool))


def _value_numbers(gm: fx.GraphModule) -> list[tuple[str, str, tuple]]:
    return [(f"{op_label(n)} ({n.name})", source_at(n), nums) for n in gm.graph.nodes if (nums := _numbers(n))]


def _like_length(v: float, n: int) -> bool:
    """Whether ``v`` is n, 1/n, sqrt(n) or 1/sqrt(n) (not 1, 2 or 1/2: those are everywhere)."""
    cands = [c for c in (n, 1 / n, math.sqrt(n), 1 / math.sqrt(n)) if c not in (1, 2, 0.5)]
    return n >= 3 and any(math.isclose(v, c, rel_tol=1e-9) for c in cands)


def _suspects(numbers: list[tuple[str, str, tuple]], n: int) -> list[str]:
    return [f"adjoint-compile sequence_parallel: {op} uses the number {v!r}, which is this rank's slice length {n} "
            f"or comes from it; if it was read from an input's shape (x.shape[1]), it is the slice's length, not the "
            f"sequence's, and the result differs from one process on the whole sequence (slices of different "
            f"lengths would refuse it); compute it from the whole length outside the compiled model and pass it in. "
            f"At {where}" for op, where, nums in numbers for _, v in nums if _like_length(v, n)]


#: ops that read their input's shape, dtype and device only (``torch.zeros_like(x[:, 0])``, a loop's first state)
_SHAPE_ONLY = frozenset("zeros_like ones_like empty_like full_like new_zeros new_ones new_empty new_full".split())


def _shape_only(u: fx.Node) -> bool:
    """Whether ``u`` reads no values of its first argument: a value only they read is the same on every rank's slice
    (its shape has no step axis to cut) whatever steps it picks."""
    return op_name(u) in _SHAPE_ONLY


def lower_seqpar(gm: fx.GraphModule, examples: list[Any], opts: Options, *, rewrite: bool = True,
                 shard: Callable[[], list[str]] | None = None) -> SeqParPlan:
    """Check ``gm`` for sequence parallelism and (``rewrite``) put the distributed ops in (module docstring).

    ``shard`` (exact mode): lowers the recognized regions into sharded region calls and returns their names, after
    the check and the halos; one-scan regions then run as :class:`SeqShardedRegion` (sharded inside the rank, carries
    exchanged), others unsharded with distributed scans."""
    state = SeqParState(resolve_group(opts.sequence_parallel))
    # NB: explain() passes no inputs: dynamo's fakes in the placeholders' meta stand in (parameters stay Parameters)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [examples[i] if i < len(examples) else example_value(n) for i, n in enumerate(phs)]
    params = [i for i, ex in enumerate(examples) if isinstance(ex, torch.nn.Parameter) or _held_by_model(phs[i], ex)]
    fp = fingerprint(_fingerprint_parts(gm, examples, opts, set(params)))
    numbers = _value_numbers(gm)
    attrs = [k for k, p in gm.named_parameters() if p.requires_grad]
    try:
        T, convs, scans, refusal = _check(gm, examples, set(params))
        if attrs and refusal is None:
            # NB: their gradients would not be reduced over the group (only the graph's inputs are)
            refusal = (f"sequence_parallel: parameters held by the graph as attributes ({', '.join(attrs[:3])}) "
                       f"cannot have their gradients summed over the group; keep torch._dynamo.config."
                       f"inline_inbuilt_nn_modules=True (the default), which makes them graph inputs")
    except Exception as e:  # noqa: BLE001 - an analysis that cannot read the graph must refuse, not guess
        log.debug("sequence_parallel: analysis raised", exc_info=True)
        T, convs, scans, refusal = None, {}, [], f"sequence_parallel: the graph could not be analyzed ({e})"
    plan = SeqParPlan(state, [], fp, -1 if T is None else int(T), refusal, params, numbers=numbers,
                      suspects=[] if T is None else _suspects(numbers, int(T)))
    if refusal is not None or not rewrite:
        return plan
    window = opts.window if opts.mode == "truncated" else None
    g = gm.graph
    for i, (conv, (sliced, p)) in enumerate(convs.items()):
        name = f"seqpar_halo_{i}"
        gm.add_submodule(name, SeqHalo(state, p, -1))
        a = _conv_args(conv)
        with g.inserting_before(conv):
            halo = g.call_module(name, (a["input"],))
            cat = g.call_function(torch.cat, ([halo, a["input"]], -1))
        conv.args = (cat, a["weight"], a["bias"], a["stride"], 0, a["dilation"], a["groups"])
        conv.kwargs = {}
        sliced.replace_all_uses_with(conv)
        g.erase_node(sliced)
        plan.calls.append(halo.name)
    if shard is not None and window is None:
        for name in shard():
            mod = gm.get_submodule(name)
            if isinstance(mod, ShardedRegion):
                one = len(mod._plan.scans) == 1
                setattr(gm, name, SeqShardedRegion(mod, state) if one else unsharded_region(mod, state, None))
                plan.regions += 1
            plan.calls.append(name)
        scans = [n for n in g.nodes if is_linear_scan(n)]  # those left outside the regions
    plan.calls += [call.name for call in distribute_scans(gm, scans, state, window)]
    plan.scans, plan.halos = len(scans), len(convs)
    log.info("sequence_parallel: rank %d of %d, %d step(s): %d distributed scan(s), %d conv halo(s), %d sharded "
             "region(s)", state.rank, state.world, plan.length, plan.scans, plan.halos, plan.regions)
    return plan
