"""Adjoint sharding with exact gradients: a time-local region run shard by shard along time, forward left to
right and backward right to left (DESIGN.md §3, "Sharded VJP" and "Regions along time").

With the shard programs of :mod:`.shard_program`, shard [s, e) of a region with K scans is the closed computation

    (y_{s..e-1}, h^k_{e-1}) = F_shard(x_{s..e-1}, θ, h^k_{s-1})

so the forward sweeps shards left to right, passing each scan's final state on as the next shard's h0.  Saved:
the region's inputs and the K states at every shard boundary; nothing of length T with a state dimension.

Backward (right to left): with μ^k = ∂L/∂h^k_{e-1} (the adjoint carried in from the right neighbour through its
h0, zero for the last shard), one VJP of F_shard with cotangents (∂L/∂y_{s..e-1}, μ^k) gives ∂L/∂x_{s..e-1},
the shard's share of ∂L/∂θ and ∂L/∂h^k_{s-1} — the next adjoint carry.  This is the adjoint recursion
μ_t = g_t + a_{t+1} ⊙ μ_{t+1} cut at shard boundaries, so the gradients are exact and the peak memory is that of
one shard's recomputation.  Regions the shard programs cannot be proven for raise
:class:`~adjoint_compile.errors.UnsupportedRegion`.

Truncated mode (``window=W`` < T, DESIGN.md §3): the same sweeps over the same saved tensors; each shard's VJP
truncates every scan's adjoint to W steps and the carry between shards is, per scan, ν (the right side's partial
adjoint sums over its first 1..W steps, :mod:`.truncated`) instead of μ; ∂h0 = ν_W at the sequence start.  Only the
scans are truncated: every other op, and the joins between stacked layers, are differentiated exactly.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..errors import AdjointVerifyReport, UnsupportedRegion
from .first_order import first_order, unhooked
from .loss_tail import TailSplit, check_tail, run_tail, split_tail, tail_inputs
from .shard_parts import accumulate, accumulated, zero_adjoints, zeros_exact
from .shard_program import MIN_SHARD_BYTES, ShardProgram, _ev, autocast_state, default_shard_size
from .sharded_ps import PerSampleRegion, add_example_grad, expandable_reason, per_example_param_grads, record_region
from .sharded_ps import split_per_sample

log = logging.getLogger(__name__)

__all__ = ["MIN_SHARD_BYTES", "default_shard_size", "make_sharded", "ShardedRegion", "verify_region",
           "region_fidelity"]


class _ShardedFn(torch.autograd.Function):
    """``apply(prog, graphs, *inputs)``: the exact sweep over a prepared :class:`ShardProgram` (module docstring);
    ``graphs``: its programs replayed from CUDA graphs where they can be (:mod:`.graphed`)."""

    @staticmethod
    def forward(ctx: Any, prog: ShardProgram, graphs: bool, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.graphs = graphs
        T, bounds = prog.T, prog.bounds()
        # NB: zeros for absent carries: the first shard runs the others' compiled program (shard_parts.initial_zeros)
        zeros = zeros_exact(autocast_state())
        carries: list[Any] = prog.initial_carries(inputs, zeros)
        boundary: list[list[Any]] = []
        outs: list[torch.Tensor] | None = None
        for s, e in bounds:
            boundary.append(carries)
            xs = prog.shard_inputs(inputs, s, e - s)
            # NB: graphs: the results are valid until the next call; the outputs are copied and the states cloned
            ys, finals = prog.run(e - s, xs, carries, first_shard=s == 0, t0=s, graphs=ctx.graphs)
            if outs is None:
                outs = []
                for y, d in zip(ys, prog.out_step_dims):
                    if d is None:  # a sum over time: the shards' sums add up, in fp32 at least (floats)
                        acc = torch.promote_types(y.dtype, torch.float32) if y.dtype.is_floating_point else y.dtype
                        outs.append(y.new_zeros(y.shape, dtype=acc))
                        continue
                    shp = list(y.shape)
                    shp[d] = T
                    outs.append(y.new_empty(shp))
            for o, y, d in zip(outs, ys, prog.out_step_dims):
                if d is None:
                    o.add_(y)
                else:
                    o.narrow(d, s, e - s).copy_(y)
            # NB: clone: a select is a view that would keep the whole shard's state tensor alive until backward
            carries = [f.clone() for f in finals]
        assert outs is not None
        # NB: the counts of a mean over valid targets (after the region's outputs) stay in fp32 at least: a class-weight
        # sum rounds to bf16 or overflows fp16 (2^16 tokens), where eager's cross-entropy accumulates in fp32
        n = len(prog.out_nodes)
        outs = [o.to(y.dtype) if d is None and i < n else o
                for i, (o, y, d) in enumerate(zip(outs, ys, prog.out_step_dims))]
        # NB: an output the region computes from detached values only (``logits.detach()`` returned for metrics)
        # requires no grad, as in eager: backward through it would give zeros where eager gives None
        ctx.mark_non_differentiable(*(o for o, keep in zip(outs, _differentiable(prog)) if not keep))
        ctx.prog, ctx.bounds = prog, bounds
        ps: PerSampleRegion | None = getattr(prog, "per_sample", None)
        # NB: the parameters themselves (not their saved copies): their .grad is written at the end of the backward
        ctx.ps_params = {i: inputs[i] for i in ps.params} if ps is not None else {}
        ctx.n_in = len(inputs)
        ctx.autocast = autocast_state()
        # boundary[0] holds the h0 inputs (or None): already saved as inputs
        flat = [c for cs in boundary[1:] for c in cs]
        ctx.save_for_backward(*inputs, *flat)
        return tuple(outs)

    @staticmethod
    @first_order
    def backward(ctx: Any, *gouts: torch.Tensor) -> tuple[Any, ...]:
        prog: ShardProgram = ctx.prog
        saved = ctx.saved_tensors
        inputs, flat = saved[: ctx.n_in], saved[ctx.n_in:]
        K = prog.n_carries
        needs = list(ctx.needs_input_grad[2:])
        ps: PerSampleRegion | None = getattr(prog, "per_sample", None)
        # per_sample_clip: the parameters get per-example gradients (runtime/sharded_ps.py), not summed ones
        ps_want = [i for i in ctx.ps_params if needs[i]]
        needs_vjp = [n and i not in ctx.ps_params for i, n in enumerate(needs)]
        ps_acc: dict[int, torch.Tensor] = {}
        # NB: made at a shard's first gradient, as zeros: an input the programs do not read (a loss's targets, once
        # the loss is split off: loss_tail.py) gets None, as from autograd, never uninitialized memory
        grads: list[Any] = [None] * len(inputs)
        # step-free inputs (parameters) are whole in every shard; their grads are summed over shards
        free = [i for i, d in enumerate(prog.in_step_dims) if d is None and needs[i]]
        acc: dict[int, torch.Tensor] = {}
        # NB: zero tensors, not None, for the last shard's adjoints and the first shard's absent carries: every shard
        # then runs one recompute + VJP program (the first keeps its own where previous-state readouts tell it apart)
        zeros = zeros_exact(ctx.autocast)
        adj: list[Any] = zero_adjoints(prog, inputs[0].device) if zeros else [None] * K
        trunc = prog.truncating
        nus = prog.nu_zeros(inputs[0].device) if trunc else None
        for k in range(len(ctx.bounds) - 1, -1, -1):
            s, e = ctx.bounds[k]
            L = e - s
            carries = prog.initial_carries(inputs, zeros) if k == 0 else list(flat[(k - 1) * K: k * K])
            xs = prog.shard_inputs(inputs, s, L)
            # NB: contiguous: compiled programs are specialized to their example inputs' strides
            # a sum over time (d None) passes its whole cotangent to every shard
            gos = [None if g is None else g.contiguous() if d is None else g.narrow(d, s, L).contiguous()
                   for g, d in zip(gouts, prog.out_step_dims)]
            # NB: the first shard's carry grads are wanted as the others' are (one program); unused ones are dropped
            needs_c = [c is not None and (k > 0 or zeros or needs[prog.h0_input[j]]) for j, c in enumerate(carries)]
            res = None
            if ps_want:
                assert ps is not None
                # NB: where the parameters are expanded per example, that backward is the shard's VJP too (res)
                got, res = per_example_param_grads(prog, dataclasses.replace(ps, params=tuple(ps_want)), L, xs,
                                                   carries, k == 0, gos, adj, s, ctx.autocast,
                                                   *(([], []) if trunc else (needs_vjp, needs_c)))
                for i, g in got.items():
                    add_example_grad(ps_acc, i, g)
            # NB: graphs: gx is copied or added up below, the carries are inputs of the next call (which copies them)
            if res is None:
                res = prog.vjp(L, xs, carries, k == 0, gos, adj, needs_vjp, needs_c, t0=s, autocast=ctx.autocast,
                               nus=nus, graphs=ctx.graphs)
            gx, adj, nus = res if trunc else (*res, None)
            for i, (g, d) in enumerate(zip(gx, prog.in_step_dims)):
                if g is not None and d is not None:
                    if grads[i] is None:
                        grads[i] = torch.zeros_like(inputs[i])
                    grads[i].narrow(d, s, L).copy_(g)
            for i in free:
                if gx[i] is not None:
                    accumulate(acc, i, gx[i])
        accumulated(acc, grads, inputs)
        if ps_acc:
            assert ps is not None
            record_region(ps, ctx.ps_params, ps_acc)
        # the first shard's carry grads are the h0 grads (truncated: ν_W, + direct uses of the carry)
        if trunc:
            adj = [nu.select(d, -1) if a is None else a + nu.select(d, -1) for a, nu, d in zip(adj, nus, prog.scan_dims)]
        for j, i in enumerate(prog.h0_input):
            if i is not None and needs[i] and adj[j] is not None:
                g = adj[j].to(inputs[i].dtype, copy=True)  # NB: not the last call's result itself (graphs)
                if g.shape != inputs[i].shape:  # h0 broadcast against the state
                    g = g.sum_to_size(inputs[i].shape)
                grads[i] = g if grads[i] is None else grads[i] + g
        return (None, None, *grads)


class ShardedRegion(torch.nn.Module):
    """A time-local region run shard by shard (see the module docstring): exact gradients, or with ``window=W``
    the truncated adjoint of every scan (W >= T: exact).

    ``forward(*inputs)`` takes the region's inputs in placeholder order and returns its outputs (a tensor when the
    region graph returns one, else a tuple).  ``shard_size=None`` picks :func:`default_shard_size` of T per call.
    With ``verify=True`` the first call also runs :func:`region_fidelity`, keeps its figures in ``last_verify``
    (``{"max_rel_err", "grad_rel_err", "grad_cosine", "output_max_rel_err", "shard_size", "steps", "window"}``)
    and warns them as an :class:`~adjoint_compile.errors.AdjointVerifyReport`.
    ``inner`` ("eager", "aot_eager", "inductor") compiles each shard program, forward and recompute+VJP, on first
    use; "eager" runs them as FX code.
    """

    def __init__(self, region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None = None, shard_size: int | None = None,
                 verify: bool = False, inner: str = "eager", window: int | None = None,
                 cuda_graphs: bool = True, fused_loss: bool | str = "auto") -> None:
        super().__init__()
        for key, v in (("shard_size", shard_size), ("window", window)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{key}={v!r}: expected an int >= 1 or None")
        self.region_gm = region_gm
        self.in_step_dims = list(in_step_dims)
        self.out_step_dims = None if out_step_dims is None else list(out_step_dims)
        self.shard_size = shard_size
        self.window = window
        self.verify = verify
        #: replay the shard programs from CUDA graphs where they can be (runtime/graphed.py)
        self.cuda_graphs = cuda_graphs
        #: a split-off loss's head and cross-entropy as one fused op: "auto", True or False (runtime/fused_loss.py)
        self.fused_loss = fused_loss
        #: the shard programs (named _plan for the tests and tools that look into a region)
        self._plan = ShardProgram(region_gm, self.in_step_dims, self.out_step_dims, inner, window)
        self.last_verify_error: float | None = None
        self.last_verify: dict[str, Any] | None = None
        #: how the warnings name the region (the lowering sets the name of its call)
        self.label = "sharded region"
        #: the loss split off the sweep (loss_tail.py), or why not; None until the first prepare
        self._split: TailSplit | str | None = None

    @property
    def per_sample(self) -> PerSampleRegion | None:
        """Under ``per_sample_clip``: which inputs are parameters, recorded per example (runtime/sharded_ps.py)."""
        return getattr(self._plan, "per_sample", None)

    @per_sample.setter
    def per_sample(self, ps: PerSampleRegion | None) -> None:
        self._plan.per_sample = ps
        self._split = None

    def prepare(self, inputs: Sequence[Any]) -> int:
        """Check the region for these input shapes (real or fake tensors); returns the shard size used (of the rest of
        the region, when its loss is split off: :attr:`tail`)."""
        S = self._plan.prepare(inputs, self.shard_size)
        if self._split is None:
            self._split = self._split_tail()
        split = self._split
        if isinstance(split, TailSplit):
            try:
                S_rest = split.rest.prepare(inputs, self.shard_size)
                split.tail.prepare(tail_inputs(split, inputs, [_ev(o) for o in split.rest.out_nodes]),
                                   split.chunk(self.shard_size, _device(inputs)))
                why = check_tail(split.tail) or _expands(split)
            except UnsupportedRegion as e:
                why = str(e)
            if not why:
                for prog in (split.rest, split.tail):
                    if getattr(prog, "per_sample", None) is not None:  # NB: the lowering sets the site after the split
                        prog.per_sample.site = self.per_sample.site
                return S_rest
            log.debug("adjoint-compile: %s keeps its loss in the sweep: %s", self.label, why)
            self._split = why
        return S

    def _split_tail(self) -> TailSplit | str:
        ps = self.per_sample
        # NB: under per_sample_clip the head runs as written: its per-example gradients need its logits' chunks
        got = split_tail(self._plan, False if ps is not None else self.fused_loss)
        if isinstance(got, TailSplit) and ps is not None:
            got = split_per_sample(got, ps, self._plan) or got
        if isinstance(got, str):
            log.debug("adjoint-compile: %s keeps its loss in the sweep: %s", self.label, got)
        return got

    @property
    def tail(self) -> TailSplit | None:
        """The region's loss, run once in the forward with its gradient (:mod:`.loss_tail`), or None."""
        return self._split if isinstance(self._split, TailSplit) else None

    def forward(self, *inputs: Any) -> Any:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"region input {i} is a {type(x).__name__}, expected a tensor")
        with unhooked():
            S = self.prepare(inputs)
        if self.verify and not torch.is_inference_mode_enabled():  # NB: no autograd to compare with there
            self.verify = False
            with unhooked():
                fid = region_fidelity(self.region_gm, self.in_step_dims, self.out_step_dims, S,
                                      [x.detach() for x in inputs], window=self.window)
            self.last_verify_error, self.last_verify = fid["max_rel_err"], fid
            log.info("adjoint-compile verify: %s: %s", self.label, fid)
            warnings.warn(AdjointVerifyReport(f"adjoint-compile verify: {self.label} {_describe(fid)}"), stacklevel=2)
        split = self.tail
        if split is None:
            outs = _ratios(self._plan, _ShardedFn.apply(self._plan, self.cuda_graphs, *inputs))
        else:
            rest = _ratios(split.rest, _ShardedFn.apply(split.rest, self.cuda_graphs, *inputs))
            got = _ratios(split.tail, run_tail(split.tail, tail_inputs(split, inputs, rest),
                                               split.chunk(self.shard_size, _device(inputs)),
                                               self.cuda_graphs))
            outs = [None] * (len(split.tail_pos) + len(split.rest_pos))
            for i, o in [*zip(split.rest_pos, rest), *zip(split.tail_pos, got)]:
                outs[i] = o
        return outs[0] if self._plan.single_output else tuple(outs)


def _expands(split: TailSplit) -> str:
    """Why a split region under per_sample_clip would not expand its parameters per example in every program of its
    rest and its tail ("" when it does; the whole region did, or it was not lowered)."""
    for prog in (split.rest, split.tail):
        ps = getattr(prog, "per_sample", None)
        for L in sorted({e - s for s, e in prog.bounds()}) if ps is not None else ():
            if why := expandable_reason(prog, ps, L):
                return f"per-example clipping of the split loss: {why}"
    return ""


_DETACH = {torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default}


#: per region program, :func:`_differentiable` (read at every forward: walked once)
_DIFFERENTIABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _differentiable(prog: ShardProgram) -> list[bool]:
    """Per output of ``prog``'s region graph, whether a path from an input reaches it without a ``detach`` and
    through floating-point values only (an accuracy, ``argmax(...) == targets``, requires no grad)."""
    got = _DIFFERENTIABLE.get(prog)
    if got is None:
        live: set[fx.Node] = set()
        for n in prog.region_gm.graph.nodes:
            v = _ev(n)
            if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
                continue
            if n.op == "placeholder" or (n.op != "output" and not (n.target in _DETACH or n.target == "detach")
                                         and any(a in live for a in n.all_input_nodes)):
                live.add(n)
        got = _DIFFERENTIABLE[prog] = [isinstance(o, fx.Node) and o in live for o in prog.out_nodes]
    return got


def _device(inputs: Sequence[Any]) -> torch.device | None:
    return next((x.device for x in inputs if isinstance(x, torch.Tensor)), None)


class _MeanOverValid(torch.autograd.Function):
    """``total / count`` (nan when ``count`` is 0, every target ignored, as eager's cross-entropy gives), whose
    gradient is zero there, as eager's is; a plain division would make it nan (0 · ∞ through the sum's gradient)."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(count)
        ctx.dtype = total.dtype
        return (total / count).to(total.dtype)  # NB: the count is fp32 at least; the mean has the loss's dtype

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (count,) = ctx.saved_tensors
        # NB: divided by 1 where count is 0, so a second derivative (through g) is 0 there too, not 0 · ∞
        nz = count != 0
        return torch.where(nz, g / torch.where(nz, count, torch.ones_like(count)), torch.zeros_like(g)).to(ctx.dtype), \
            None


def _ratios(plan: ShardProgram, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A sweep's outputs with each loss's mean over valid targets made: the sum of the shards' sums over the sum of
    their counts (the counts follow the outputs and are dropped)."""
    n = len(plan.out_nodes)
    outs = list(outs)
    for k, i in enumerate(plan.ratios):
        outs[i] = _MeanOverValid.apply(outs[i], outs[n + k])
    return outs[:n]


def _describe(fid: dict[str, Any]) -> str:
    where = f"shard_size={fid['shard_size']} of T={fid['steps']}"
    if fid.get("window") is not None:
        return (f"(truncated, window={fid['window']}, {where}) against exact autograd: gradient relative error "
                f"{fid['grad_rel_err']:.3g}, cosine {fid['grad_cosine']:.6f}; outputs: max relative error "
                f"{fid['output_max_rel_err']:.3g}")
    return (f"({where}) against plain autograd: max relative error {fid['max_rel_err']:.3g} over outputs and "
            f"gradients; gradient cosine {fid['grad_cosine']:.6f}")


def make_sharded(region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None, shard_size: int | None,
                 verify: bool = False, window: int | None = None) -> ShardedRegion:
    """A callable running ``region_gm`` shard by shard with exact gradients (``window=None``) or every scan's
    adjoint truncated to ``window`` steps (module docstring of :mod:`.truncated`).

    Args:
        region_gm: a graph whose placeholders are the region's inputs and whose output is a tensor or a tuple of
            tensors; it contains one or more forward ``linear_scan`` calls (window None) whose h0 is None or an input.
        in_step_dims: per input, the dim of its step axis (length T), or None for step-free inputs (parameters,
            h0) that every shard uses whole.
        out_step_dims: per output, the dim of its step axis (checked against the analysis), or None to infer.
        shard_size: steps per shard (>= 1); None: :func:`default_shard_size`.
        window: None (exact) or the truncated adjoint's window W >= 1 (W >= T: exact).
    Returns ``callable(*inputs) -> outputs`` (a :class:`ShardedRegion`).  The region is analysed and its shard
    programs checked on the first call; :class:`~adjoint_compile.errors.UnsupportedRegion` says why when it
    cannot be sharded.
    """
    return ShardedRegion(region_gm, in_step_dims, out_step_dims, shard_size, verify, window=window)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x detached in fp64 (complex128 for complex x: never its real part alone)."""
    return x.detach().to(torch.complex128 if x.is_complex() else torch.float64)


def _flat_real(x: torch.Tensor) -> torch.Tensor:
    """x as a flat fp64 vector, a complex x as its (real, imaginary) pairs: dot products and norms of these are the
    real inner products of the gradients."""
    x = _wide(x)
    return (torch.view_as_real(x) if x.is_complex() else x).flatten()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _wide(a), _wide(b)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def verify_region(region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                  out_step_dims: Sequence[int | None] | None, shard_size: int | None,
                  inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor] | None = None,
                  seed: int = 0) -> float:
    """The max relative error of the exactly sharded region against plain autograd (:func:`region_fidelity`)."""
    return region_fidelity(region_gm, in_step_dims, out_step_dims, shard_size, inputs, grad_outputs,
                           seed)["max_rel_err"]


def region_fidelity(region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                    out_step_dims: Sequence[int | None] | None, shard_size: int | None,
                    inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor] | None = None,
                    seed: int = 0, window: int | None = None) -> dict[str, Any]:
    """Compare the sharded region (exact, or truncated to ``window``) with plain autograd of ``region_gm`` on
    ``inputs``, for the gradients of every floating-point input; log and return the figures:

    ``max_rel_err`` (max|Δ| / max|reference| per tensor, the max over outputs and gradients), ``grad_rel_err``
    (‖Δ‖ / ‖reference‖ over all gradients as one vector), ``grad_cosine`` (their cosine similarity),
    ``output_max_rel_err`` (outputs only), ``shard_size``, ``steps`` and ``window`` (None: exact).
    ``grad_outputs`` default to random cotangents (a fixed seed).
    """
    def leaves() -> list[torch.Tensor]:
        return [x.detach().clone().requires_grad_(x.is_floating_point() or x.is_complex()) for x in inputs]

    ref_in = leaves()
    ref = region_gm(*ref_in)
    ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    if grad_outputs is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        grad_outputs = [torch.randn(r.shape, generator=gen, dtype=r.dtype).to(r.device) for r in ref]
    wrt = [x for x in ref_in if x.requires_grad]
    # NB: an output made under no_grad (a statistic for a buffer, ``ema.mul_(0.9).add_(h.mean(0))``) has no gradient
    diff = [i for i, r in enumerate(ref) if r.requires_grad]
    ref_g = torch.autograd.grad([ref[i] for i in diff], wrt, [grad_outputs[i] for i in diff], allow_unused=True)
    sh_in = leaves()
    region = ShardedRegion(region_gm, in_step_dims, out_step_dims, shard_size, window=window)
    out = region(*sh_in)
    out = [out] if isinstance(out, torch.Tensor) else list(out)
    sh_g = torch.autograd.grad([out[i] for i in diff], [x for x in sh_in if x.requires_grad],
                               [grad_outputs[i] for i in diff], allow_unused=True)
    out_err = max((_rel_err(o, r) for o, r in zip(out, ref)), default=0.0)
    err, got, want = out_err, [], []
    for a, b in zip(sh_g, ref_g):
        if (a is None) != (b is None):
            err = max(err, float("inf"))
        elif a is not None:
            err = max(err, _rel_err(a, b))
            got.append(_flat_real(a))
            want.append(_flat_real(b))
    g, r = (torch.cat(v) if v else torch.zeros(1, dtype=torch.double) for v in (got, want))
    rn = float(r.norm())
    fid = {"max_rel_err": err, "grad_rel_err": float((g - r).norm()) / max(rn, 1e-30),
           "grad_cosine": float(torch.dot(g, r)) / max(float(g.norm()) * rn, 1e-30) if rn or g.norm() else 1.0,
           "output_max_rel_err": out_err, "shard_size": region._plan.shard_size, "steps": region._plan.T,
           "window": window}
    log.info("adjoint-compile verify: sharded region (shard_size=%s, window=%s) vs autograd: %s", shard_size, window,
             fid)
    return fid
