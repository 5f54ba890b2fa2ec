"""Per-example gradient norms and the DP-SGD clipped sum in one backward (``options={"per_sample_clip": C}``).

Book-keeping style (Bu et al.; the ghost-clipping papers' squared-norm functions): every use of a parameter with an activation is
one autograd.Function here (passes/lower/per_sample.py puts them in the graph). Its backward returns the input
gradient as usual but, for the parameter, no summed gradient: it records what the example norms and the clipped
sum need (a :class:`Record`). At the end of the backward (an engine final callback) :func:`_finalize` adds the
records' squared norms per example over all parameters, takes c_n = min(1, C / ‖g_n‖) and writes
``p.grad += Σ_n c_n g_n`` for every parameter; the [B] norms go to each graph's :class:`Clipper`.

Records, by the layer kind that made them (the Gram vs direct trade-off of ghost clipping):

- :class:`LinearRecord` (a matmul of a parameter with an activation, ``nn.Linear`` on [B, T, D] included): the
  Gram form ⟨ζζᵀ, ggᵀ⟩ costs B·T²·(i+o) and B·T² memory, the direct form ‖ζ_nᵀ g_n‖² B·T·i·o and B·i·o; the Gram
  form is used when 2·T² < i·o (mixed ghost clipping's rule), otherwise the per-example gradient is formed at once
  and kept instead of ζ and g when it is the smaller of the two;
- :class:`EmbeddingRecord`: the rows an example's tokens hit, summed per distinct (example, token) (ghost clipping's
  n_j(x) counts), O(B·T·D) without a [B, V, D] tensor;
- :class:`DirectRecord`: a per-example gradient [B, *p.shape]: bias adds, layer-norm affine, element-wise uses
  (small: the parameter's size per example), tied parameters (uses summed before the norm) and the generic
  fallback (``torch.func.vmap`` of the op's VJP).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import PerSampleError
from .first_order import untraced
from .per_sample_backward import accumulates, per_example_vjp, refuse_autograd_grad

log = logging.getLogger(__name__)

__all__ = ["Clipper", "Site", "ps_linear", "ps_embedding", "ps_elementwise", "ps_generic", "gram_is_cheaper",
           "guard_parameter"]


@dataclasses.dataclass(eq=False)
class Clipper:
    """One compiled graph's clipping bound and the norms of the last backward it took part in."""

    clip: float
    batch_dim: int
    #: the [B] per-example gradient norms of the last backward (over the parameters of every graph in it).
    last_norms: Tensor | None = None
    #: which backward (in this process) ``last_norms`` are from: the newest wins across a model's graphs
    step: int = 0


@dataclasses.dataclass(eq=False)
class Site:
    """One parameter use in the graph (for the report and for the records' book-keeping)."""

    clipper: Clipper
    node: str
    kind: str
    params: tuple[str, ...]
    #: the parameter appears in more than one use (here or in another graph): its uses' per-example gradients are
    #: summed before the norm, so each use keeps its per-example gradient (not the Gram form)
    tied: bool = False
    #: the example axis of this use's activations when it is not the graph's (``multi_head_attention_forward``
    #: works on [T, B, E] whatever the model's layout)
    batch_dim: int | None = None

    @property
    def bd(self) -> int:
        return self.clipper.batch_dim if self.batch_dim is None else self.batch_dim


def gram_is_cheaper(steps: int, d_in: int, d_out: int) -> bool:
    return 2 * steps * steps < d_in * d_out


class Record:
    def sq_norms(self) -> Tensor: ...
    def per_example(self) -> Tensor: ...
    def clipped_sum(self, c: Tensor) -> Tensor: ...


class DirectRecord(Record):
    def __init__(self, g: Tensor) -> None:
        self.g = g  # [B, *p.shape]

    def sq_norms(self) -> Tensor:
        # NB: reshape, not flatten(1): a 0-dim parameter's gradients are [B]
        return self.g.reshape(len(self.g), -1).to(torch.promote_types(self.g.dtype, torch.float32)).pow(2).sum(1)

    def per_example(self) -> Tensor:
        return self.g

    def clipped_sum(self, c: Tensor) -> Tensor:
        # NB: matmuls, not torch.einsum: on CPU einsum took ~30x longer for these contractions
        return (c.to(self.g.dtype) @ self.g.reshape(len(self.g), -1)).view(self.g.shape[1:])


class LinearRecord(Record):
    """The parameter W is [o, i] (``linear``) or [i, o] (``x @ W``); ζ [B, T, i], g [B, T, o]."""

    def __init__(self, zeta: Tensor, g: Tensor, transposed: bool) -> None:
        self.zeta, self.g, self.transposed = zeta, g, transposed

    def sq_norms(self) -> Tensor:
        z, g = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (self.zeta, self.g))
        return ((z @ z.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))

    def per_example(self) -> Tensor:
        if self.transposed:
            return torch.bmm(self.zeta.transpose(1, 2), self.g)
        return torch.bmm(self.g.transpose(1, 2), self.zeta)

    def clipped_sum(self, c: Tensor) -> Tensor:
        gc = (self.g * c.to(self.g.dtype)[:, None, None]).reshape(-1, self.g.shape[-1])
        z = self.zeta.reshape(-1, self.zeta.shape[-1])
        return z.t() @ gc if self.transposed else gc.t() @ z


class EmbeddingRecord(Record):
    def __init__(self, idx: Tensor, g: Tensor, rows: int) -> None:
        self.idx, self.g, self.rows = idx, g, rows  # idx [B, T], g [B, T, D]

    def _keys(self) -> Tensor:
        b = torch.arange(self.idx.shape[0], device=self.idx.device)[:, None]
        return (b * self.rows + self.idx).reshape(-1)

    def sq_norms(self) -> Tensor:
        B, D = self.idx.shape[0], self.g.shape[-1]
        uniq, inv = torch.unique(self._keys(), return_inverse=True)
        wide = torch.promote_types(self.g.dtype, torch.float32)  # NB: fp32 at least; fp64 stays fp64
        acc = self.g.new_zeros(len(uniq), D, dtype=wide).index_add_(0, inv, self.g.reshape(-1, D).to(wide))
        return acc.new_zeros(B).index_add_(0, uniq // self.rows, acc.pow(2).sum(1))

    def per_example(self) -> Tensor:
        B, D = self.idx.shape[0], self.g.shape[-1]
        out = self.g.new_zeros(B * self.rows, D).index_add_(0, self._keys(), self.g.reshape(-1, D))
        return out.view(B, self.rows, D)

    def clipped_sum(self, c: Tensor) -> Tensor:
        D = self.g.shape[-1]
        gc = (self.g * c.to(self.g.dtype)[:, None, None]).reshape(-1, D)
        return self.g.new_zeros(self.rows, D).index_add_(0, self.idx.reshape(-1), gc)


# --- the records of the backward under way ------------------------------------------------------------------------

_LOCK = threading.Lock()
#: the backward under way: its graph task id and its (param, record, site, rows) records (rows: the slice of the
#: parameter's first axis the record is for, None: all of it). NB: module-global, not
#: thread-local: on a GPU the engine runs backward functions on its device threads. Keyed by the graph task so that
#: a backward that raised half-way (its final callback never ran) leaves nothing behind for the next one
_pending: tuple[int, list[tuple[Tensor, Record, Site, tuple[int, int] | None]]] | None = None
_STEPS = itertools.count(1)


def _record(param: Tensor, rec: Record, site: Site, rows: tuple[int, int] | None = None) -> None:
    global _pending
    if not accumulates(param):  # NB: autograd.grad (its hook refuses it), or backward(inputs=...) without it
        return
    task = torch._C._current_graph_task_id()
    # NB: before the parameter's AccumulateGrad runs (it is downstream of this op): what its guard compares with
    param._adjoint_ps_snap = (task, *_grad_state(param))
    with _LOCK:
        if _pending is None or _pending[0] != task:
            _pending = (task, [])
            torch.autograd.Variable._execution_engine.queue_callback(_finalize)
        _pending[1].append((param, rec, site, rows))


def _finalize() -> None:
    global _pending
    with _LOCK:
        pending = _pending[1] if _pending is not None else []
        _pending = None
    if not pending:
        return
    # NB: disjoint row slices of one parameter (the packed q/k/v projection of attention) have no cross terms in
    # the norm: each slice is its own group
    groups: dict[tuple[int, tuple[int, int] | None], tuple[Tensor, list[Record]]] = {}
    for p, rec, _, rows in pending:
        groups.setdefault((id(p), rows), (p, []))[1].append(rec)
    sliced = {i for i, r in groups if r is not None}
    if any((i, None) in groups for i in sliced):
        raise RuntimeError("adjoint-compile per_sample_clip: a parameter used both whole and by row slices in one "
                           "backward (e.g. an attention's packed in_proj_weight shared with another layer) is not "
                           "supported")
    clippers = list({id(s.clipper): s.clipper for _, _, s, _ in pending}.values())
    clip = min(c.clip for c in clippers)
    parts: list[tuple[Tensor, Record, tuple[int, int] | None]] = []
    sq: Tensor | None = None
    for (_, rows), (p, recs) in groups.items():
        # NB: a parameter used more than once: ‖Σ_u G_u,n‖² has cross terms, so the uses' per-example gradients are
        # summed first
        each = [r.per_example() for r in recs] if len(recs) > 1 else []
        rec = recs[0] if not each else DirectRecord(sum(each)) if len({g.shape[0] for g in each}) == 1 else None
        s = None if rec is None else rec.sq_norms()
        if s is None or (sq is not None and s.shape != sq.shape):
            raise RuntimeError("adjoint-compile per_sample_clip: parameter uses in one backward disagree on the batch "
                               "size (two calls of the compiled model with batches of other sizes in one loss?): call "
                               "backward after each micro-batch")
        sq = s if sq is None else sq + s.to(sq.device)
        parts.append((p, rec, rows))
    assert sq is not None
    norms = sq.sqrt()
    c = torch.where(norms > clip, clip / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.ones_like(norms))
    last = (next(_STEPS), norms.detach())
    for p, rec, rows in parts:
        if rows is None:
            g = rec.clipped_sum(c.to(p.device)).to(p.dtype).reshape(p.shape)
        else:
            g = p.new_zeros(p.shape)
            g[rows[0]:rows[1]] = rec.clipped_sum(c.to(p.device)).to(p.dtype).reshape(g[rows[0]:rows[1]].shape)
        # NB: accumulated in place like autograd's: micro-batches add up, a .grad viewing a flat buffer stays one
        p.grad = g if p.grad is None else p.grad.add_(g)
        p._adjoint_ps_norms = (id(p), *last)  # NB: per model too (instances share graphs); id: deepcopy copies it
    for cl in clippers:
        cl.step, cl.last_norms = last
    log.debug("per_sample_clip: %d parameter(s), %d record(s), B=%d", len(parts), len(pending), norms.shape[0])


# --- never unclipped in silence -------------------------------------------------------------------------------------

def _unclipped(name: str) -> Callable[[Tensor], None]:
    def hook(p: Tensor) -> None:
        # NB: the book-keeping ops return no gradient for a parameter (the engine still runs its AccumulateGrad,
        # with nothing to add) and _finalize writes p.grad itself: p.grad changed since this backward's book-keeping
        # saw it means autograd accumulated a gradient from a use outside the backend's calls
        snap = getattr(p, "_adjoint_ps_snap", None)
        if snap is not None and snap == (torch._C._current_graph_task_id(), *_grad_state(p)):
            return
        raise PerSampleError(
            f"adjoint-compile per_sample_clip: the parameter {name} {tuple(p.shape)} received an unclipped gradient: "
            "a use of it ran outside the per-example book-keeping (dynamo's recompile limit or another eager "
            "fallback, a graph break that ran it eagerly, or the uncompiled model). Clipping would be bypassed; "
            "pad batches to a few fixed sizes (or compile with dynamic=True), keep parameter uses inside the "
            "compiled graph, and run an unclipped backward on a copy of the model")
    return hook


def _grad_state(p: Tensor) -> tuple[int, int]:
    g = p.grad
    return (0, 0) if g is None else (id(g), g._version)


def guard_parameter(p: Tensor, name: str) -> None:
    """From now on, an ordinary autograd accumulation into ``p.grad`` raises :class:`PerSampleError`."""
    # NB: the mark holds the parameter's id: copy.deepcopy carries attributes over but not hooks
    if (not isinstance(p, torch.nn.Parameter) or not p.requires_grad or isinstance(p, torch._subclasses.FakeTensor)
            or getattr(p, "_adjoint_ps_guard", None) == id(p)):
        return
    p.register_post_accumulate_grad_hook(_unclipped(name))
    p.register_hook(refuse_autograd_grad(p, name))
    p._adjoint_ps_guard = id(p)


# --- the ops --------------------------------------------------------------------------------------------------------

def _to_front(x: Tensor, batch_dim: int) -> Tensor:
    """[..., B (at batch_dim), ..., d] -> [B, T, d] (T: every other axis but the last)."""
    x = x.movedim(batch_dim, 0)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _rows(p: Tensor | None, rows: tuple[int, int] | None) -> Tensor | None:
    return p if p is None or rows is None else p[rows[0]:rows[1]]


class _Linear(torch.autograd.Function):
    """``w_rows`` / ``b_rows``: the use takes rows [r0, r1) of the parameter (a packed projection's slice)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, transposed: bool, site: Site,
                w_rows: tuple[int, int] | None = None, b_rows: tuple[int, int] | None = None) -> Tensor:
        wv, bv = _rows(w, w_rows), _rows(b, b_rows)
        ctx.save_for_backward(x, wv)
        # NB: the parameters themselves (not their saved copies): their .grad is written at the end of the backward
        ctx.w, ctx.bias, ctx.transposed, ctx.site, ctx.rows = w, b, transposed, site, (w_rows, b_rows)
        if transposed:
            return x @ wv if bv is None else x @ wv + bv
        return torch.nn.functional.linear(x, wv, bv)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        site, bd = ctx.site, ctx.site.bd
        gx = (g @ w.t() if ctx.transposed else g @ w) if ctx.needs_input_grad[0] else None
        z, gf = _to_front(x, bd), _to_front(g, bd)
        if ctx.needs_input_grad[1]:
            rec: Record = LinearRecord(z, gf, ctx.transposed)
            T, d_in, d_out = z.shape[1], z.shape[2], gf.shape[2]
            if site.tied or not gram_is_cheaper(T, d_in, d_out):
                # NB: direct form: the per-example gradient is formed now and kept instead of ζ and g when smaller
                if site.tied or d_in * d_out <= T * (d_in + d_out):
                    rec = DirectRecord(rec.per_example())
                else:
                    rec = _DirectNorm(rec)
            _record(ctx.w, rec, site, ctx.rows[0])
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            _record(ctx.bias, DirectRecord(gf.sum(1)), site, ctx.rows[1])
        return gx, None, None, None, None, None, None


class _DirectNorm(Record):
    """A :class:`LinearRecord` whose norm is taken the direct way (per-example gradient formed, then dropped) but
    whose clipped sum keeps ζ and g (they are smaller than the [B, i, o] gradients)."""

    def __init__(self, rec: LinearRecord) -> None:
        self.rec, self.sq = rec, DirectRecord(rec.per_example()).sq_norms()

    def sq_norms(self) -> Tensor:
        return self.sq

    def per_example(self) -> Tensor:
        return self.rec.per_example()

    def clipped_sum(self, c: Tensor) -> Tensor:
        return self.rec.clipped_sum(c)


def ps_linear(x: Tensor, w: Tensor, b: Tensor | None, transposed: bool, site: Site,
              w_rows: tuple[int, int] | None = None, b_rows: tuple[int, int] | None = None) -> Tensor:
    """``linear(x, w, b)`` (or ``x @ w + b`` when ``transposed``) with per-example book-keeping for w and b (rows
    [r0, r1) of them when ``w_rows`` / ``b_rows`` are given)."""
    return _Linear.apply(x, w, b, transposed, site, w_rows, b_rows)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, idx: Tensor, w: Tensor, padding_idx: int | None, site: Site) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.w, ctx.padding_idx, ctx.site = w, padding_idx, site
        return torch.nn.functional.embedding(idx, w, padding_idx)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[None, ...]:
        (idx,) = ctx.saved_tensors
        bd = ctx.site.bd
        i = idx.movedim(bd, 0).reshape(idx.shape[bd], -1)
        gf = _to_front(g, bd)
        if ctx.padding_idx is not None:
            gf = gf * (i != ctx.padding_idx).unsqueeze(-1).to(gf.dtype)
        rec: Record = EmbeddingRecord(i, gf, ctx.w.shape[0])
        _record(ctx.w, DirectRecord(rec.per_example()) if ctx.site.tied else rec, ctx.site)
        return None, None, None, None


def ps_embedding(idx: Tensor, w: Tensor, padding_idx: int | None, site: Site) -> Tensor:
    return _Embedding.apply(idx, w, padding_idx, site)


def _per_example_reduce(t: Tensor, shape: torch.Size, batch_dim: int) -> Tensor:
    """Σ of ``t`` (the output's shape) down to [B, *shape], where ``shape`` broadcasts against t's axes after the
    example axis."""
    t = t.movedim(batch_dim, 0)
    lead = t.dim() - 1 - len(shape)
    red = t.sum_to_size(t.shape[0], *([1] * lead), *shape)
    return red.reshape(t.shape[0], *shape)


class _Elementwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, p: Tensor, op: str, site: Site) -> Tensor:
        ctx.save_for_backward(x if op == "mul" else None, p if op == "mul" else None)
        ctx.op, ctx.site, ctx.p, ctx.xshape = op, site, p, x.shape
        return {"mul": torch.mul, "add": torch.add, "sub": torch.sub, "rsub": lambda a, b: b - a}[op](x, p)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, p = ctx.saved_tensors
        op, bd = ctx.op, ctx.site.bd
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g * p if op == "mul" else -g if op == "rsub" else g).sum_to_size(ctx.xshape)
        if ctx.needs_input_grad[1]:
            gp = g * x if op == "mul" else -g if op == "sub" else g
            _record(ctx.p, DirectRecord(_per_example_reduce(gp, ctx.p.shape, bd)), ctx.site)
        return gx, None, None, None


def ps_elementwise(x: Tensor, p: Tensor, op: str, site: Site) -> Tensor:
    """``x * p``, ``x + p``, ``x - p`` or ``p - x`` (``op``: mul, add, sub, rsub), p broadcast over the examples."""
    return _Elementwise.apply(x, p, op, site)


class _Generic(torch.autograd.Function):
    """Any other use: ``fn(*args)`` with the parameters among ``args``. The input gradients are one VJP; the
    parameters' per-example gradients are ``torch.func.vmap`` over the examples of the op's VJP (memory: B times
    the parameters' size)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], dims: tuple[int | None, ...], is_param: tuple[bool, ...],
                site: Site, *args: Tensor) -> Tensor:
        ctx.fn, ctx.dims, ctx.is_param, ctx.site = fn, dims, is_param, site
        ctx.params = {i: a for i, a in enumerate(args) if is_param[i]}
        ctx.save_for_backward(*args)
        return fn(*args)

    @staticmethod
    @untraced
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        args = ctx.saved_tensors
        fn, dims, is_param, bd = ctx.fn, ctx.dims, ctx.is_param, ctx.site.bd
        grads: list[Tensor | None] = [None] * len(args)
        out = None  # NB: the op's output on the batch, when the inputs' VJP has computed it
        want = [i for i, a in enumerate(args) if not is_param[i] and ctx.needs_input_grad[4 + i]]
        if want:
            def f_in(*xs: Tensor) -> Tensor:
                full = list(args)
                for i, x in zip(want, xs):
                    full[i] = x
                return fn(*full)
            out, vjp = torch.func.vjp(f_in, *[args[i] for i in want])
            for i, gi in zip(want, vjp(g)):
                grads[i] = gi
        pidx = [i for i in range(len(args)) if is_param[i] and ctx.needs_input_grad[4 + i]]
        if pidx:
            per = per_example_vjp(ctx.site.node, fn, args, dims, pidx, g, bd, out)
            for i, gp in zip(pidx, per):
                _record(ctx.params[i], DirectRecord(gp), ctx.site)
        return (None, None, None, None, *grads)


def ps_generic(fn: Callable[..., Tensor], dims: tuple[int | None, ...], is_param: tuple[bool, ...], site: Site,
               *args: Tensor) -> Tensor:
    return _Generic.apply(fn, dims, is_param, site, *args)


def ps_attention(site: Site, a: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """``F.multi_head_attention_forward`` on batched [T, B, E] inputs (``a``: its arguments by name; no bias_k /
    bias_v / add_zero_attn / static_k / static_v): the in- and out-projections with per-example book-keeping (the
    packed in_proj_weight by row slices: q, k and v occupy disjoint rows), the attention itself as torch computes
    it (scaled_dot_product_attention, or the explicit softmax when the weights are asked for)."""
    F = torch.nn.functional
    q, k, v, E, H = a["query"], a["key"], a["value"], a["embed_dim_to_check"], a["num_heads"]
    T, B, _ = q.shape
    S, hd = k.shape[0], E // H
    b_in = a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        ws = [(a["q_proj_weight"], None), (a["k_proj_weight"], None), (a["v_proj_weight"], None)]
    else:
        ws = [(a["in_proj_weight"], (i * E, (i + 1) * E)) for i in range(3)]
    if not a["use_separate_proj_weight"] and q is k and k is v:
        qp, kp, vp = ps_linear(q, a["in_proj_weight"], b_in, False, site).chunk(3, dim=-1)
    else:
        qp, kp, vp = (ps_linear(x, w, b_in, False, site, rows, (i * E, (i + 1) * E))
                      for i, (x, (w, rows)) in enumerate(zip((q, k, v), ws)))
    qh, kh, vh = (t.reshape(t.shape[0], B, H, hd).permute(1, 2, 0, 3) for t in (qp, kp, vp))  # [B, H, L, hd]
    attn_mask, kpm, need_weights, is_causal = a["attn_mask"], a["key_padding_mask"], a["need_weights"], a["is_causal"]
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    kpm = F._canonical_mask(mask=kpm, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
                            other_name="attn_mask", target_type=q.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint")
    if is_causal and kpm is None and not need_weights:
        mask = None
    else:
        is_causal = False
        mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                 target_type=q.dtype, check_other=False)
        if mask is not None:
            mask = mask.view(B, H, T, S) if mask.dim() == 3 else mask.view(1, 1, T, S)
        if kpm is not None:
            kpm = kpm.view(B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
    weights = None
    if need_weights:
        scores = (qh * math.sqrt(1.0 / hd)) @ kh.transpose(-2, -1)
        w = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        if dropout_p > 0.0:
            w = F.dropout(w, p=dropout_p)
        out = w @ vh
        weights = w.mean(dim=1) if a["average_attn_weights"] else w
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, mask, dropout_p, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(T, B, E)
    return ps_linear(out, a["out_proj_weight"], a["out_proj_bias"], False, site), weights


class PerSampleCall(torch.nn.Module):
    """The graph's call of one parameter use (passes/lower/per_sample.py): a partition of its own, run eagerly,
    because the inner compiler would trace through the autograd.Function and drop its book-keeping."""

    def __init__(self, site: Site, kind: str, *, transposed: bool = False, padding_idx: int | None = None,
                 op: str = "", fn: torch.nn.Module | None = None, dims: tuple[int | None, ...] = (),
                 is_param: tuple[bool, ...] = (), names: tuple[str, ...] = (),
                 consts: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.site, self.kind, self.transposed, self.padding_idx, self.op = site, kind, transposed, padding_idx, op
        self.fn, self.dims, self.is_param = fn, dims, is_param
        #: "attention": the names of the tensor arguments (in call order) and the other arguments' values
        self.names, self.consts = names, consts or {}

    def forward(self, *args: Any) -> Tensor:
        if self.kind == "linear":
            x, w, b = (*args, None)[:3]
            return ps_linear(x, w, b, self.transposed, self.site)
        if self.kind == "embedding":
            return ps_embedding(args[0], args[1], self.padding_idx, self.site)
        if self.kind == "elementwise":
            return ps_elementwise(args[0], args[1], self.op, self.site)
        if self.kind == "attention":
            return ps_attention(self.site, {**self.consts, **dict(zip(self.names, args))})
        assert self.fn is not None
        return ps_generic(self.fn, self.dims, self.is_param, self.site, *args)
