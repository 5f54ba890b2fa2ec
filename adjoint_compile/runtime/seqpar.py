"""Sequence parallelism across processes (DESIGN.md §6; the scheme of sequence-parallel Mamba-2 implementations): the distributed ops a graph runs when
``options={"sequence_parallel": group}`` splits one sequence over the ranks of a ``torch.distributed`` group.

Rank r holds the contiguous steps [o_r, o_r + n_r) of the sequence (n_r >= 1; the slices may differ in length).

* :class:`SeqScan`, ``h = linear_scan(a, b, h0, dim)`` over the whole sequence.  Forward: each rank scans its slice
  from zero (rank 0 from h0), the ranks all-gather (A_r = Π a, last state s_r), rank r folds its carry-in
  c_r = A_{r-1} c_{r-1} + s_{r-1} over the ranks before it and rescans its slice from c_r.  Backward (exact), the
  mirror image: a local reverse scan from zero gives e_r = a_0 ⊙ μ̃_0, the ranks all-gather (A_r, e_r), rank r
  folds the adjoint carry d_r = e_{r+1} + A_{r+1} d_{r+1} over the ranks after it, adds it to the cotangent of its
  last state, and one full scan backward gives ∂a = μ ⊙ h_{t-1} (h_{-1} = c_r), ∂b = μ, ∂h0 (rank 0) = a_0 ⊙ μ_0.
  Truncated (window W): the ranks all-gather the first min(W, n_r) steps of a and of the cotangent; rank r reads
  the W steps after its slice from them and turns them into the ν carry of :mod:`.truncated` (the same windowed
  adjoint as one process).  Bytes exchanged per scan: world × state (exact), world × W × state (truncated).
* :class:`SeqHalo`, the p = dilation·(k-1) steps before a rank's slice that a causal conv along time reads: the
  ranks all-gather their last min(p, n_r) steps; rank r takes the p steps before o_r (zeros before the sequence
  start).  Backward: the ranks all-gather the halos' cotangents and each adds the parts that fall in its slice.
* :class:`ReduceGrads`, identity on the graph's parameters whose backward all-reduces (SUM) their gradients over the
  group, as DDP's hooks do: p.grad is then the gradient of the sum of every rank's loss. A leaf that code outside the
  graphs uses as well (a tied embedding's lookup) gets its whole gradient of the backward summed by a hook on it
  (:func:`_fold_outside`): that part comes from the rank's slice too.
* :class:`SeqParCall`, the compiled graph's callable: on every call the ranks first all-gather one small header
  (graph fingerprint, refusal flag, slice length, a hash of the value ops' numbers), so that ranks with different
  models, dtypes or options, a graph that was refused on some rank, or a number that differs across the ranks (a
  static graph's ``x.shape[1]`` is the rank's slice length) raise on every rank instead of waiting for each other.

Every collective is issued in the same order on every rank (the same graph, autograd's deterministic order), and
waits at most the group's timeout (``init_process_group(timeout=...)``): a rank that dies or raises makes the
others raise then.
"""
from __future__ import annotations

import hashlib
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import AdjointCompileWarning, SequenceParallelError
from .first_order import untraced
from .truncated import truncated_scan_backward

log = logging.getLogger(__name__)

__all__ = ["SequenceParallelError", "SeqParState", "SeqScan", "SeqHalo", "ReduceGrads", "SeqParCall",
           "resolve_group", "fingerprint"]


def resolve_group(sp: Any) -> Any:
    """The process group of ``options["sequence_parallel"]`` (True: the default group)."""
    return dist.group.WORLD if sp is True else sp


def _gather(x: Tensor, group: Any) -> Tensor:
    """``[world, *x.shape]``: x from every rank of ``group``, in rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    if world == 1:
        return x.unsqueeze(0)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class SeqParState:
    """What one compiled graph's distributed ops share: the group, this rank, and the slice lengths of the current
    call (set by :class:`SeqParCall` from the header exchange)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.lengths: list[int] = []

    def offsets(self) -> list[int]:
        out, o = [], 0
        for n in self.lengths:
            out.append(o)
            o += n
        return out


# --------------------------------------------------------------------------------------------------------------
# the distributed scan


def _scan(a: Tensor, b: Tensor, h0: Tensor | None, dim: int) -> Tensor:
    return torch.ops.adjoint_compile.linear_scan.default(a, b, h0, dim, False, None, None)


def _scan_bwd(g: Tensor, a: Tensor, h0: Tensor | None, h: Tensor, dim: int, b_dtype: torch.dtype):
    return torch.ops.adjoint_compile.linear_scan_backward.default(g, a, None, h0, h, dim, False, None, None, b_dtype)


class _SeqScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, h0: Tensor | None, dim: int, window: int | None, st: SeqParState):
        first = st.rank == 0
        h_loc = _scan(a, b, h0 if first else None, dim)
        cdt = h_loc.dtype
        A = torch.prod(a.to(cdt), dim)
        gathered = _gather(torch.stack([A, h_loc.select(dim, -1)]), st.group)  # [world, 2, *state]
        if first:
            c, h = (h0.to(cdt) if h0 is not None else None), h_loc
        else:
            c = torch.zeros_like(A)
            for k in range(st.rank):
                c = gathered[k, 0] * c + gathered[k, 1]
            h = _scan(a, b, c, dim)  # NB: a rescan, not h̃ + cumprod(a)·c: no [T, state] product, no underflow
        ctx.save_for_backward(a, h, c, A)
        ctx.args = (dim, window, st, b.dtype, h0 is not None and first)
        ctx.h0_meta = None if h0 is None else (h0.shape, h0.dtype)
        return h

    @staticmethod
    @untraced
    def backward(ctx, g: Tensor):
        a, h, c, A = ctx.saved_tensors
        dim, window, st, b_dtype, grad_h0 = ctx.args
        g = g.to(h.dtype)
        if window is None:
            ga, gb, gh0 = _exact_backward(g, a, h, c, A, dim, st, b_dtype)
        else:
            ga, gb, gh0 = _truncated_backward(g, a, h, c, dim, window, st, b_dtype)
        if ctx.h0_meta is None:
            gh0 = None
        elif not grad_h0:  # NB: only rank 0's h0 starts the sequence; the others' is not read
            gh0 = torch.zeros(ctx.h0_meta[0], dtype=ctx.h0_meta[1], device=a.device)
        else:
            gh0 = gh0.to(ctx.h0_meta[1])
        return ga, gb, gh0, None, None, None


def _exact_backward(g, a, h, c, A, dim, st, b_dtype):
    last = st.rank == st.world - 1
    if st.rank > 0:
        ga, gb, e = _scan_bwd(g, a, c, h, dim, b_dtype)  # e = a_0 ⊙ μ̃_0: what the ranks before need
    else:
        e = torch.zeros_like(A)  # NB: no rank before rank 0 reads it; still sent, so that all ranks gather alike
    gathered = _gather(torch.stack([A, e.to(A.dtype)]), st.group)
    if last and st.rank > 0:
        return ga, gb, None
    d = torch.zeros_like(A)
    for k in range(st.world - 1, st.rank, -1):
        d = gathered[k, 1] + gathered[k, 0] * d
    g = g.clone()
    g.select(dim, -1).add_(d)
    return _scan_bwd(g, a, c, h, dim, b_dtype)


def _truncated_backward(g, a, h, c, dim, W, st, b_dtype):
    n = a.shape[dim]
    m = min(W, n)
    cdt = h.dtype
    head_a = torch.ones(_with(h.shape, dim, W), dtype=cdt, device=h.device)
    head_g = torch.zeros_like(head_a)
    head_a.narrow(dim, 0, m).copy_(a.narrow(dim, 0, m))
    head_g.narrow(dim, 0, m).copy_(g.narrow(dim, 0, m))
    gathered = _gather(torch.stack([head_a, head_g]), st.group)  # [world, 2, ..., W, ...]
    # the W steps after this slice, rank by rank (ones / zeros past the sequence end: they add nothing)
    parts_a, parts_g, got = [], [], 0
    for k in range(st.rank + 1, st.world):
        take = min(W - got, st.lengths[k])
        parts_a.append(gathered[k, 0].narrow(dim, 0, take))
        parts_g.append(gathered[k, 1].narrow(dim, 0, take))
        got += take
        if got == W:
            break
    if got < W:
        parts_a.append(torch.ones_like(head_a.narrow(dim, 0, W - got)))
        parts_g.append(torch.zeros_like(head_a.narrow(dim, 0, W - got)))
    ra, rg = torch.cat(parts_a, dim).to(cdt), torch.cat(parts_g, dim).to(cdt)
    nu = torch.cumsum(torch.cumprod(ra, dim) * rg, dim)  # ν_m = Σ_{t<m} (Π_{j<=t} a_j) g_t of the right side
    ga, gb, nu_out = truncated_scan_backward(g, nu, a, h, c, dim, W)
    return ga, gb.to(b_dtype), nu_out.select(dim, W - 1)


def _with(shape: Sequence[int], dim: int, n: int) -> list[int]:
    s = list(shape)
    s[dim] = n
    return s


class SeqScan(torch.nn.Module):
    """``linear_scan(a, b, h0, dim)`` over the sequence split across the ranks (module docstring); ``window``:
    truncated mode's adjoint window (None: exact)."""

    def __init__(self, state: SeqParState, dim: int, window: int | None) -> None:
        super().__init__()
        self.state, self.dim, self.window = state, dim, window

    def forward(self, a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
        dim = self.dim % a.dim()
        return _SeqScanFn.apply(a, b, h0, dim, self.window, self.state)


# --------------------------------------------------------------------------------------------------------------
# the causal conv halo


class _HaloFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: int, dim: int, st: SeqParState):
        n = x.shape[dim]
        m = min(p, n)
        tail = x.new_zeros(_with(x.shape, dim, p))
        tail.narrow(dim, p - m, m).copy_(x.narrow(dim, n - m, m))
        gathered = _gather(tail, st.group)  # [world, ..., p, ...]: each rank's last steps, right-aligned
        parts, got = [], 0
        for k in range(st.rank - 1, -1, -1):
            take = min(p - got, st.lengths[k])
            parts.insert(0, gathered[k].narrow(dim, p - take, take))
            got += take
            if got == p:
                break
        if got < p:
            parts.insert(0, x.new_zeros(_with(x.shape, dim, p - got)))
        ctx.args = (p, dim, st, tuple(x.shape))
        return torch.cat(parts, dim)

    @staticmethod
    @untraced
    def backward(ctx, g: Tensor):
        p, dim, st, shape = ctx.args
        gathered = _gather(g, st.group)  # every rank's halo cotangent
        off = st.offsets()
        lo, hi = off[st.rank], off[st.rank] + shape[dim]
        gx = g.new_zeros(shape)
        for q in range(st.rank + 1, st.world):
            start = off[q] - p  # rank q's halo covers the global steps [off[q] - p, off[q])
            a, b = max(start, lo), min(off[q], hi)
            if a < b:
                gx.narrow(dim, a - lo, b - a).add_(gathered[q].narrow(dim, a - start, b - a))
        return gx, None, None, None


class SeqHalo(torch.nn.Module):
    """The ``p`` steps along ``dim`` before this rank's slice, from the ranks before it (zeros before step 0)."""

    def __init__(self, state: SeqParState, p: int, dim: int) -> None:
        super().__init__()
        self.state, self.p, self.dim = state, p, dim

    def forward(self, x: Tensor) -> Tensor:
        return _HaloFn.apply(x, self.p, self.dim % x.dim(), self.state)


# --------------------------------------------------------------------------------------------------------------
# parameter gradients, and the per-call header


class _ReduceGradsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Any, *params: Tensor):
        ctx.group = group
        ctx.meta = [(p.shape, p.dtype, p.device) for p in params]
        # NB: the leaves, whose gradient _fold_outside completes: they get the local one from here
        ctx.leaves = [id(p) if p.is_leaf else None for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    @untraced
    def backward(ctx, *grads: Tensor):
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, dt, _) in enumerate(ctx.meta):
            by_dtype.setdefault(dt, []).append(i)
        local = [g if g is not None else torch.zeros(m[0], dtype=m[1], device=m[2]) for g, m in zip(grads, ctx.meta)]
        out: list[Tensor | None] = [None] * len(grads)
        for dt, idx in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            flat = torch.cat([local[i].reshape(-1) for i in idx])
            # NB: one collective per dtype per graph, like a DDP bucket; SUM, since the loss is the ranks' sum
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
            for i, piece in zip(idx, flat.split([ctx.meta[i][0].numel() for i in idx])):
                out[i] = piece.view(ctx.meta[i][0])
        leaves = [(k, local[i], out[i]) for i, k in enumerate(ctx.leaves) if k is not None]
        _note_reduced(leaves, ctx.group)
        for i, k in enumerate(ctx.leaves):  # NB: _fold_outside gives the leaf the reduced gradient, or the whole's
            if k is not None:
                out[i] = local[i]
        return (None, *out)


class ReduceGrads:
    """Identity on the parameters at ``indices`` of a call's arguments; their gradients are summed over ``group``."""

    def __init__(self, group: Any, indices: Sequence[int]) -> None:
        self.group, self.indices = group, list(indices)

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        idx = [i for i in self.indices if isinstance(args[i], Tensor) and args[i].requires_grad]
        if not idx or not torch.is_grad_enabled():
            return list(args)
        out = list(args)
        for i in idx:
            if args[i].is_leaf:
                _hook_outside(args[i])
        for i, t in zip(idx, _ReduceGradsFn.apply(self.group, *[args[i] for i in idx])):
            out[i] = t
        return out


#: parameters watched for a gradient no compiled graph reduced, and the leaves whose gradients the graphs reduce (by
#: id, held weakly: a tensor's == is elementwise, so weak sets of tensors cannot be used)
_WATCHED: dict[int, weakref.ref] = {}
_HOOKED: dict[int, weakref.ref] = {}
_WARNED: set[str] = set()
#: per running backward (autograd's graph task), the leaves the graphs reduced: id -> [the graphs' local gradient (None
#: where several graphs gave one), its sum over the group, the group]; None once the leaf's hook has run
_TASKS: dict[int, dict[int, list | None]] = {}


def _has(d: dict[int, weakref.ref], p: Tensor) -> bool:
    r = d.get(id(p))
    return r is not None and r() is p


def _hook_outside(p: Tensor) -> None:
    """Once per leaf a graph reduces: a hook on its gradient of each backward (:func:`_fold_outside`)."""
    if not _has(_HOOKED, p):
        _HOOKED[id(p)] = weakref.ref(p)
        p.register_hook(lambda g, key=id(p): _fold_outside(key, g))  # NB: by id: the hook must not hold p


def _note_reduced(leaves: Sequence[tuple[int, Tensor, Tensor]], group: Any) -> None:
    """Record (id, local gradient, reduced gradient) of the leaves a graph reduced in this backward."""
    if not leaves:
        return
    task = torch._C._current_graph_task_id()
    if task not in _TASKS:
        _TASKS[task] = {}
        # NB: at the end of the backward: a leaf whose gradient is not asked for never reaches its hook
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _TASKS.pop(task, None))
    seen = _TASKS[task]
    for key, local, reduced in leaves:
        e = seen.get(key)
        seen[key] = [local, reduced, group] if e is None else [None, e[1] + reduced, group]


def _fold_outside(key: int, g: Tensor) -> Tensor | None:
    """The hook on a reduced leaf's gradient of a backward, every use summed (autograd runs it once, on the sum).

    Where the graph's local gradient alone reached the leaf, it gets the graph's reduced gradient. Where code
    outside the compiled graphs used the leaf as well (a tied embedding's lookup before the model, whose readout is
    inside), that part comes from this rank's slice as the graph's does: the leaf gets the whole gradient summed over
    the group (one more all-reduce, of the leaf's size). Every rank runs the same code, so each finds the same uses
    and the all-reduces pair up, in autograd's order as the graphs' collectives do."""
    seen = _TASKS.get(torch._C._current_graph_task_id())
    e = seen.get(key) if seen is not None else None
    if e is None:
        return None
    seen[key] = None  # NB: reduced in this backward (for _check_reduced); the gradients are let go
    local, reduced, group = e
    if g is local:  # NB: autograd passes a single gradient on as it is
        return reduced
    with torch.no_grad():
        whole = g.to_dense() if g.is_sparse else g.clone(memory_format=torch.contiguous_format)  # NB: for NCCL/gloo
        dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group)
    return whole


def watch_unreduced(modules: Sequence[torch.nn.Module]) -> None:
    """Warn (once per parameter) when a parameter of the compiled ``modules`` gets a gradient in a backward where no
    compiled graph reduced it over the ranks: used outside every graph (a ``torch._dynamo.disable``d submodule runs
    eagerly), its ``.grad`` is this rank's share of the sequence's gradient only."""
    for m in modules:
        for name, p in m.named_parameters():
            if p.requires_grad and not _has(_WATCHED, p):
                _WATCHED[id(p)] = weakref.ref(p)
                p.register_post_accumulate_grad_hook(lambda q, name=name: _check_reduced(q, name))


def _check_reduced(p: Tensor, name: str) -> None:
    seen = _TASKS.get(torch._C._current_graph_task_id())
    if (seen is None or id(p) not in seen) and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"adjoint-compile sequence_parallel: the parameter {name} {tuple(p.shape)} got a gradient "
                      f"outside every compiled graph (a submodule run eagerly, e.g. under torch._dynamo.disable): its "
                      f".grad is this rank's share of the sequence's gradient, not the whole; keep it in the compiled "
                      f"model, or all-reduce its .grad over the group yourself", AdjointCompileWarning, stacklevel=2)


def fingerprint(parts: Sequence[Any]) -> int:
    """A 62-bit hash of ``parts`` (their reprs), the same on every rank for the same graph and options."""
    h = hashlib.sha256(repr(list(parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 2


class SeqParCall:
    """The callable of a graph compiled with ``sequence_parallel``: the header exchange, then ``fn`` on this rank's
    slice with the parameters' gradients reduced (``reduce``) over the group.

    ``refusal``: why this rank cannot run the graph split (raised on every rank after the header, with no model data
    exchanged); ``length``: this rank's number of steps (-1: the graph exchanges nothing that needs it);
    ``numbers``: the numbers of the graph's value ops, (op, source line, numbers) each, which must be the same on every
    rank (a static graph holds ``x.shape[1]`` as the literal slice length); ``suspects``: warnings for numbers equal to
    this rank's slice length, given once where every slice has the same length (then they cannot differ)."""

    def __init__(self, fn: Callable[..., Any] | None, state: SeqParState, fp: int, length: int,
                 refusal: str | None, reduce: ReduceGrads | None, numbers: Sequence[tuple[str, str, tuple]] = (),
                 suspects: Sequence[str] = ()) -> None:
        self.fn, self.state, self.fp, self.length, self.refusal, self.reduce = fn, state, fp, length, refusal, reduce
        self.numbers, self.suspects = list(numbers), list(suspects)
        self.nfp = fingerprint([nums for _, _, nums in self.numbers])

    def header(self) -> None:
        st = self.state
        # NB: NCCL moves CUDA tensors only
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(st.group) == "nccl" else "cpu"
        mine = torch.tensor([self.fp, int(self.refusal is not None), self.length, self.nfp], dtype=torch.int64,
                            device=dev)
        allh = _gather(mine, st.group).tolist()
        if any(r[1] for r in allh):
            whys = [None] * st.world
            dist.all_gather_object(whys, self.refusal, group=st.group)
            bad = [(k, w) for k, w in enumerate(whys) if w]
            if self.refusal is not None:
                raise SequenceParallelError(self.refusal)
            k, w = bad[0]
            raise SequenceParallelError(f"sequence_parallel: rank {k} of the group refused the graph: {w}")
        fps = [r[0] for r in allh]
        if len(set(fps)) > 1:
            raise SequenceParallelError(
                f"sequence_parallel: the ranks disagree on the model: graph fingerprints {fps} (rank order) differ "
                f"(different models, parameter shapes, dtypes or adjoint-compile options); every rank must compile "
                f"the same model with the same options")
        lengths = [r[2] for r in allh]
        if self.length >= 0 and min(lengths) < 1:
            raise SequenceParallelError(f"sequence_parallel: every rank needs at least one step; slice lengths "
                                        f"(rank order): {lengths}")
        if len({r[3] for r in allh}) > 1:
            self._numbers_differ(lengths)
        if self.suspects and st.world > 1 and len(set(lengths)) == 1:  # NB: one rank holds the whole sequence
            for msg in self.suspects:
                warnings.warn(msg, AdjointCompileWarning, stacklevel=3)
            self.suspects = []  # NB: once per graph
        st.lengths = lengths

    def _numbers_differ(self, lengths: list[int]) -> None:
        """Raise on every rank, naming the first value op whose numbers differ across the ranks (the same graph
        otherwise: the fingerprints agree)."""
        st = self.state
        every: list[Any] = [None] * st.world
        dist.all_gather_object(every, [nums for _, _, nums in self.numbers], group=st.group)
        for j, (op, where, _) in enumerate(self.numbers):
            got = [r[j] if j < len(r) else None for r in every]
            if any(repr(g) != repr(got[0]) for g in got):  # NB: by repr, as hashed: nan != nan
                vals = [tuple(v for _, v in g) if g else g for g in got]
                raise SequenceParallelError(
                    f"sequence_parallel: {op} uses numbers that differ across the ranks: {vals} (rank order; slice "
                    f"lengths {lengths}): a number read from the length of the step axis (x.shape[1]) is the slice's "
                    f"length on each rank, not the sequence's, and would give results that differ from one process on "
                    f"the whole sequence; compute it from the whole length outside the compiled model and pass it in. "
                    f"At {where}")
        raise SequenceParallelError(f"sequence_parallel: the ranks' graphs hold different numbers (slice lengths "
                                    f"{lengths}); every rank must compile the same model")

    def __call__(self, *args: Any) -> Any:
        self.header()
        if self.reduce is not None:
            args = tuple(self.reduce(args))
        return self.fn(*args)
