"""Adjoint sharding with exact gradients: a time-local region (a stack of linear scans joined by ops that act on
each step on its own) run shard by shard along time (DESIGN.md §3, "Sharded VJP" and "Regions along time").

Let the region map step-carrying inputs x_{1..T} (and step-free inputs θ, e.g. parameters) to outputs y_{1..T},
with K scans h^k_t = a^k_t ⊙ h^k_{t-1} + b^k_t inside.  Split the steps into shards [s, e).  Given the states
h^k_{s-1} at the left boundary, shard [s, e) is a closed computation

    (y_{s..e-1}, h^k_{e-1}) = F_shard(x_{s..e-1}, θ, h^k_{s-1})

so the forward sweeps shards left to right, passing each scan's final state on as the next shard's h0.  Saved:
the region's inputs and the K states at every shard boundary; nothing of length T with a state dimension.

Backward (right to left): with μ^k = ∂L/∂h^k_{e-1} (the adjoint carried in from the right neighbour through its
h0, zero for the last shard), one VJP of F_shard with cotangents (∂L/∂y_{s..e-1}, μ^k) gives ∂L/∂x_{s..e-1},
the shard's share of ∂L/∂θ and ∂L/∂h^k_{s-1} — the next adjoint carry.  This is the adjoint recursion
μ_t = g_t + a_{t+1} ⊙ μ_{t+1} cut at shard boundaries, so the gradients are exact and the peak memory is that of
one shard's recomputation.

Region graphs come from dynamo with literal sizes: view/reshape/expand arguments equal to T at the step position
are rewritten to the shard length L (one specialized graph per distinct L: at most two), and the specialized graph
is checked with fake tensors node by node before it is used; anything it cannot prove raises
:class:`~adjoint_compile.errors.UnsupportedRegion`.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..analysis.fx import is_linear_scan, scan_args
from ..analysis.time_local import TimeLocalInfo, analyze
from ..errors import UnsupportedRegion
from ..kernels.random import hashed_dropout

log = logging.getLogger(__name__)

__all__ = ["default_shard_size", "make_sharded", "ShardedRegion", "verify_region"]

_SHAPE_ARG_METHODS = {"view", "reshape", "expand", "broadcast_to"}


#: below this many state elements per shard (one scan's state times the shard's steps) a shard's fixed cost (two
#: compiled program calls and a dozen scan calls, ~3 ms on 2 CPU cores) is a visible share of its work: measured on a
#: 4-layer SSM stack at T = 8192 with 512 state elements per step, 0.41 s a step with 128-step shards, 0.30 s with
#: 256, 0.25-0.30 s with 512 (plain compile: 0.22-0.26 s).
MIN_SHARD_ELEMENTS = 2**18


def default_shard_size(T: int, step_elements: int = 0) -> int:
    """Steps per shard when ``options.shard_size`` is None: ``max(⌈√T⌉, ⌈MIN_SHARD_ELEMENTS / step_elements⌉)``,
    at most T.

    Memory is (T/S) saved boundary states + one shard's recomputed activations (S steps); with both per-step costs
    of the same order, S = √T minimizes the sum (and the number of sequential shard VJPs stays √T).  Shards are
    made at least ``MIN_SHARD_ELEMENTS / step_elements`` steps long (``step_elements``: the largest scan state's
    elements per step) so that each shard has enough work to amortize per-op overhead; one shard's memory is then
    still bounded by a constant, independent of T.
    """
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T={T!r}: expected a number of steps >= 1")
    S = max(1, math.isqrt(T - 1) + 1) if T > 1 else 1
    if step_elements > 0:
        S = max(S, -(-MIN_SHARD_ELEMENTS // step_elements))
    return min(S, T)


def _prev_or_first(prev: torch.Tensor | None, first: torch.Tensor, d: int) -> torch.Tensor:
    """The step before a shard's first one in a previous-state readout: the carried state, or ``first`` in the
    sequence's first shard (where the readout gives its own ``first``)."""
    return first if prev is None else prev.unsqueeze(d).to(first.dtype)


def _ev(n: fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def _h0_index(node: fx.Node) -> int | None:
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = t.default
    names = [a.name for a in t._schema.arguments] if isinstance(t, torch._ops.OpOverload) else None
    return names.index("h0") if names and "h0" in names else 2


class _Plan:
    """The region graph turned into shard programs: (shard inputs..., carries...) -> (outputs..., final states...)."""

    def __init__(self, region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None, inner: str = "eager") -> None:
        self.region_gm = region_gm
        #: compiler for the shard programs (backend.compile_inner's names); "eager" runs them as FX code.
        self.inner = inner
        self.compiled: dict[tuple, Any] = {}
        #: recompute + VJP programs, keyed by call pattern (see :meth:`vjp`)
        self.vjps: dict[tuple, Any] = {}
        self.placeholders = [n for n in region_gm.graph.nodes if n.op == "placeholder"]
        if len(in_step_dims) != len(self.placeholders):
            raise ValueError(f"in_step_dims: {len(in_step_dims)} entries for {len(self.placeholders)} region inputs")
        self.in_step_dims = list(in_step_dims)
        if all(d is None for d in self.in_step_dims):
            raise ValueError("in_step_dims: no input carries the step axis")
        out_node = next(n for n in region_gm.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        self.single_output = not isinstance(outs, (tuple, list))
        self.out_nodes = [outs] if self.single_output else list(outs)
        self.out_step_dims_given = None if out_step_dims is None else list(out_step_dims)
        self.scans = [n for n in region_gm.graph.nodes if n.op == "call_function" and is_linear_scan(n)]
        if not self.scans:
            raise UnsupportedRegion("the region has no linear_scan")
        self.h0_input: list[int | None] = []  # region input index holding each scan's h0, or None
        for s in self.scans:
            a = scan_args(s)
            if a["reverse"]:
                raise UnsupportedRegion(f"scan {s.name} is a reverse scan; shards sweep left to right")
            if a["window"] is not None:
                raise UnsupportedRegion(f"scan {s.name} has window={a['window']}; exact sharding needs window=None")
            h0 = a["h0"]
            if h0 is None:
                self.h0_input.append(None)
            elif isinstance(h0, fx.Node) and h0.op == "placeholder":
                self.h0_input.append(self.placeholders.index(h0))
            else:
                raise UnsupportedRegion(f"scan {s.name}: h0 must be None or an input of the region")
        self.specialized: dict[int, fx.GraphModule] = {}
        self.prepared_for: tuple | None = None
        #: hashed dropouts (kernels/random.py): their masks depend on each element's global step, so shard programs
        #: take the shard's first step as one more input
        self.random = [n for n in region_gm.graph.nodes if n.op == "call_function" and n.target is hashed_dropout]

    # ---------------------------------------------------------------------------------------------- preparation

    def prepare(self, inputs: Sequence[Any], shard_size: int | None) -> None:
        """Propagate (fake) full-length shapes, analyse the step axis, check that the region is time-local, and
        choose the shard size (``shard_size``, or :func:`default_shard_size` when None)."""
        key = (shard_size, *((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else x
                             for x in inputs))
        if self.prepared_for == key:
            return
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"expected {len(self.placeholders)} region inputs, got {len(inputs)}")
        Ts = {x.shape[d] for x, d in zip(inputs, self.in_step_dims) if d is not None}
        if len(Ts) != 1:
            raise ValueError(f"the step-carrying inputs disagree on the number of steps: {sorted(Ts)}")
        self.T = Ts.pop()
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        FakeTensorProp(self.region_gm, mode).propagate_dont_convert_inputs(*fakes)
        seeds = {p: d for p, d in zip(self.placeholders, self.in_step_dims) if d is not None}
        for s in self.scans:
            seeds[s] = scan_args(s)["dim"]
        info = analyze(self.region_gm, seeds)
        for n in self.region_gm.graph.nodes:
            if n in info.mixing and n.op != "placeholder":
                raise UnsupportedRegion(f"node {n.name} mixes steps: {info.mixing[n]}")
        self.info: TimeLocalInfo = info
        #: for each previous-state readout, the index of the scan whose carry it reads in later shards
        self.shift_scans = [self.scans.index(sh.scan) for sh in info.shifts.values()]
        self.out_step_dims = [info.step_dim.get(n) if isinstance(n, fx.Node) else None for n in self.out_nodes]
        for n, d in zip(self.out_nodes, self.out_step_dims):
            if d is None:
                raise UnsupportedRegion(f"region output {getattr(n, 'name', n)} does not carry the step axis")
        if self.out_step_dims_given is not None and [
            None if d is None else d % len(_ev(n).shape) for n, d in zip(self.out_nodes, self.out_step_dims_given)
        ] != self.out_step_dims:
            raise ValueError(f"out_step_dims={self.out_step_dims_given} but the region's outputs carry the step axis "
                             f"at {self.out_step_dims}")
        self.scan_dims = [info.step_dim[s] for s in self.scans]
        self.carry_shapes = []
        for s, d in zip(self.scans, self.scan_dims):
            shp = list(_ev(s).shape)
            del shp[d]
            self.carry_shapes.append(tuple(shp))
        self.shard_size = shard_size or default_shard_size(self.T, max(math.prod(c) for c in self.carry_shapes))
        self.specialized = {}
        self.compiled = {}
        self.vjps = {}
        self.prepared_for = key
        # build and check the programs for the lengths this T needs now, so that problems surface up front
        for L in {min(self.shard_size, self.T), self.T % self.shard_size or min(self.shard_size, self.T)}:
            self.program(L, mode, [x for x in fakes])

    def program(self, L: int, mode: Any = None, fakes: Sequence[Any] | None = None) -> fx.GraphModule:
        """The shard program for shards of L steps (built once per L, checked with fake tensors)."""
        gm = self.specialized.get(L)
        if gm is not None:
            return gm
        gm = self._build(L)
        self._check(gm, L, mode, fakes)
        self.specialized[L] = gm
        return gm

    def _build(self, L: int) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        self._origin: dict[fx.Node, fx.Node] = {}
        carries: list[fx.Node] = []
        ph = [n for n in self.region_gm.graph.nodes if n.op == "placeholder"]
        for n in ph:
            env[n] = g.node_copy(n, env.__getitem__)
        for k in range(len(self.scans)):
            carries.append(g.placeholder(f"carry_{k}"))
        shifts = list(self.info.shifts.items())
        prevs = [g.placeholder(f"prev_{j}") for j in range(len(shifts))]
        t0 = g.placeholder("step_offset") if self.random else None
        for n in self.region_gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            new = g.node_copy(n, env.__getitem__)
            env[n] = new
            if n in self.info.shifts:
                sh = self.info.shifts[n]
                with g.inserting_before(new):
                    head = g.call_function(_prev_or_first, (prevs[shifts.index((n, sh))], env[sh.first], sh.dim))
                new.args = ([head, env[sh.sliced]], *new.args[1:])
            if n in self.random:
                # hashed_dropout(x, p, training, seed, t0=0, step_dim=None, T=None): place it in the sequence
                a = list(new.args) + [None] * (7 - len(new.args))
                a[4], a[5], a[6] = t0, self.info.step_dim[n], self.T
                new.args, new.kwargs = tuple(a), {}
            if n.op in ("call_method", "call_function") and L != self.T:
                self._rewrite_lengths(n, new, L)
        for k, s in enumerate(self.scans):
            new = env[s]
            i = _h0_index(s)
            if len(new.args) > i:
                args = list(new.args)
                args[i] = carries[k]
                new.args = tuple(args)
            else:
                new.kwargs = {**new.kwargs, "h0": carries[k]}
        finals = []
        for s, d in zip(self.scans, self.scan_dims):
            finals.append(g.call_function(torch.select, (env[s], d, -1)))
        g.output(tuple(env[n] for n in self.out_nodes) + tuple(finals))
        self._env = env
        return fx.GraphModule(self.region_gm, g)

    def _rewrite_lengths(self, n: fx.Node, new: fx.Node, L: int) -> None:
        """Shape arguments holding T at the step position become L (dynamo bakes literal sizes into the graph)."""
        d = self.info.step_dim.get(n)
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if n.op == "call_function" and n.target not in (torch.reshape, torch.broadcast_to):
            name = ""  # only these take a shape as a function; the checked run below catches anything else
        if name not in _SHAPE_ARG_METHODS or d is None:
            return
        if n.op == "call_method":
            rest = list(n.args[1:])
            packed = len(rest) == 1 and isinstance(rest[0], (list, tuple))
            sizes = list(rest[0]) if packed else rest
        else:
            packed, sizes = True, list(n.args[1])
        if any(isinstance(v, fx.Node) for v in sizes) or "shape" in n.kwargs or "size" in n.kwargs:
            raise UnsupportedRegion(f"node {n.name}: shape computed at run time ({sizes}); cannot shard it")
        if len(sizes) != len(_ev(n).shape):
            raise UnsupportedRegion(f"node {n.name}: cannot read its shape arguments {sizes}")
        if sizes[d] == -1:
            return
        if sizes[d] != self.T:
            raise UnsupportedRegion(f"node {n.name}: size {sizes[d]} at the step position, expected T={self.T}")
        sizes[d] = L
        if n.op == "call_method":
            new.args = (new.args[0], tuple(sizes)) if packed else (new.args[0], *sizes)
        else:
            new.args = (new.args[0], tuple(sizes), *new.args[2:])

    def _check(self, gm: fx.GraphModule, L: int, mode: Any, fakes: Sequence[Any] | None) -> None:
        """Run the shard program on fake tensors; every node must have its full-length shape with L at the step dim."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        if mode is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
        args = []
        with mode:
            for p, d in zip(self.placeholders, self.in_step_dims):
                v = _ev(p)
                shp = list(v.shape)
                if d is not None:
                    shp[d] = L
                args.append(torch.empty(shp, dtype=v.dtype, device=v.device))
            for s, shp in zip(self.scans, self.carry_shapes):
                args.append(torch.empty(shp, dtype=_ev(s).dtype, device=_ev(s).device))
            args += [args[len(self.placeholders) + k] for k in self.shift_scans]
            if self.random:
                args.append(torch.zeros((), dtype=torch.int64))
        try:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
        except Exception as e:  # noqa: BLE001 - any failure means the program is not proven
            raise UnsupportedRegion(f"the {L}-step shard program does not run: {type(e).__name__}: {e}") from e
        for n, new in self._env.items():
            v, w = _ev(n), _ev(new)
            if not isinstance(v, torch.Tensor):
                continue
            want = list(v.shape)
            d = self.info.step_dim.get(n)
            if d is not None:
                want[d] = L - 1 if any(sh.sliced is n for sh in self.info.shifts.values()) else L
            if not isinstance(w, torch.Tensor) or list(w.shape) != want:
                got = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise UnsupportedRegion(f"node {n.name}: shape {got} in the {L}-step shard program, expected {want} "
                                        f"(a literal length that is not at the step position?)")

    # --------------------------------------------------------------------------------------------------- running

    def run(self, L: int, xs: Sequence[Any], carries: Sequence[Any],
            first_shard: bool, t0: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prevs = [None if first_shard else carries[k] for k in self.shift_scans]
        args = [*xs, *carries, *prevs, *self._offset(t0)]
        res = self._callable(L, args)(*args)
        n = len(self.out_nodes)
        return list(res[:n]), list(res[n:])

    def _callable(self, L: int, args: list[Any]) -> Any:
        """The shard program for L steps, compiled by the inner compiler on first use for this call pattern.

        NB: keyed by grad mode and each argument's requires_grad (None for an absent h0): an aot_autograd function
        compiled for inputs that did not require grad would silently return no gradient for them later.
        """
        if self.inner == "eager":
            return self.program(L)
        grad = torch.is_grad_enabled()
        key = (L, grad, tuple(None if a is None else (grad and a.requires_grad) for a in args))
        fn = self.compiled.get(key)
        if fn is None:
            from ..backend import compile_inner

            fn = self.compiled[key] = compile_inner(self.program(L), args, self.inner)
        return fn

    def _offset(self, t0: int) -> list[torch.Tensor]:
        return [torch.tensor(t0, dtype=torch.int64)] if self.random else []

    def vjp(self, L: int, xs: Sequence[Any], carries: Sequence[Any], first_shard: bool,
            gouts: Sequence[Any], adjs: Sequence[Any], needs_x: Sequence[bool], needs_c: Sequence[bool],
            t0: int = 0) -> tuple[list[Any], list[Any]]:
        """One shard's recomputation and VJP, as one program: the cotangents ``gouts`` (per output, None: unused)
        and ``adjs`` (per scan, the adjoint of its final state; None: zero) pulled back to the inputs and carries.

        Returns (per input: its grad or None, per scan: the grad of its carry or None). The program is traced once
        per call pattern (make_fx over recompute + ``autograd.grad``: forward and backward ops in one aten graph)
        and compiled by the inner compiler, so a shard costs one call instead of a compiled forward, a compiled
        backward and an autograd-engine pass between them.
        """
        wrt_x = [i for i, (x, n) in enumerate(zip(xs, needs_x)) if n and isinstance(x, torch.Tensor)]
        wrt_c = [j for j, n in enumerate(needs_c) if n]
        has_g = tuple(g is not None for g in gouts)
        has_a = tuple(a is not None for a in adjs)
        has_c = tuple(c is not None for c in carries)
        none_x, none_c = [None] * len(xs), [None] * len(carries)
        if not (wrt_x or wrt_c) or not (any(has_g) or any(has_a)):
            return none_x, none_c
        key = (L, first_shard, tuple(wrt_x), tuple(wrt_c), has_g, has_a, has_c)
        args = [*xs, *(c for c in carries if c is not None), *(g for g in gouts if g is not None),
                *(a for a in adjs if a is not None), *self._offset(t0)]
        fn = self.vjps.get(key)
        if fn is None:
            fn = self.vjps[key] = self._build_vjp(L, first_shard, wrt_x, wrt_c, has_g, has_a, has_c, args)
        got = fn(*args)
        gx, gc = list(none_x), list(none_c)
        for i, g in zip(wrt_x, got[: len(wrt_x)]):
            gx[i] = g
        for j, g in zip(wrt_c, got[len(wrt_x):]):
            gc[j] = g
        return gx, gc

    def _build_vjp(self, L: int, first_shard: bool, wrt_x: list[int], wrt_c: list[int], has_g: tuple,
                   has_a: tuple, has_c: tuple, example: list[Any]) -> Any:
        from torch.fx.experimental.proxy_tensor import make_fx

        prog = self.program(L)
        n_x, n_out = len(self.placeholders), len(self.out_nodes)
        n_c = sum(has_c)
        offset = [None] if self.random else []
        unused: list[bool] = []

        def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            it = iter(flat[n_x + n_c: len(flat) - len(offset)])
            gos = [next(it) if h else None for h in has_g]
            adjs = [next(it) if h else None for h in has_a]
            with torch.enable_grad():
                xs = [x.detach().requires_grad_(i in wrt_x) for i, x in enumerate(flat[:n_x])]
                ci = iter(flat[n_x: n_x + n_c])
                cs = [next(ci).detach().requires_grad_(j in wrt_c) if h else None for j, h in enumerate(has_c)]
                prevs = [None if first_shard else cs[k] for k in self.shift_scans]
                res = prog(*xs, *cs, *prevs, *flat[len(flat) - len(offset):])
                outs, cots = [], []
                for y, g in zip([*res[:n_out], *res[n_out:]], [*gos, *adjs]):
                    if g is not None and y.requires_grad:
                        outs.append(y)
                        cots.append(g)
                wrt = [xs[i] for i in wrt_x] + [cs[j] for j in wrt_c]
                got = (torch.autograd.grad(outs, wrt, cots, allow_unused=True) if outs
                       else [None] * len(wrt))
            # NB: zeros for inputs the outputs do not depend on (the compiled program returns tensors only); the
            # caller gets None for them, as from autograd
            unused[:] = [g is None for g in got]
            return tuple(torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt))

        gm = make_fx(joint, tracing_mode="fake")(*example)
        fn = gm if self.inner == "eager" else None
        gm.meta = {**getattr(gm, "meta", {}), "provenance": "adjoint_compile: shard recompute + VJP"}
        log.debug("adjoint-compile: shard VJP program for L=%d (first=%s): %d nodes", L, first_shard,
                  len(gm.graph.nodes))
        if fn is None:
            from ..backend import compile_inner

            fn = compile_inner(gm, example, self.inner)
        if not any(unused):
            return fn
        return lambda *a: [None if u else g for g, u in zip(fn(*a), unused)]


def _slice(x: Any, d: int | None, s: int, L: int) -> Any:
    # NB: contiguous: ops on a strided time slice take slow paths (F.linear on a narrow()ed [B, L, D]: ~10x slower)
    return x if d is None else x.narrow(d, s, L).contiguous()


class _ShardedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, shard_size: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T, S = plan.T, shard_size
        bounds = [(s, min(s + S, T)) for s in range(0, T, S)]
        carries: list[Any] = [None if i is None else inputs[i] for i in plan.h0_input]
        boundary: list[list[Any]] = []
        outs: list[torch.Tensor] | None = None
        for s, e in bounds:
            boundary.append(carries)
            xs = [_slice(x, d, s, e - s) for x, d in zip(inputs, plan.in_step_dims)]
            ys, finals = plan.run(e - s, xs, carries, first_shard=s == 0, t0=s)
            if outs is None:
                outs = []
                for y, d in zip(ys, plan.out_step_dims):
                    shp = list(y.shape)
                    shp[d] = T
                    outs.append(y.new_empty(shp))
            for o, y, d in zip(outs, ys, plan.out_step_dims):
                o.narrow(d, s, e - s).copy_(y)
            # NB: clone: a select is a view that would keep the whole shard's state tensor alive until backward
            carries = [f.clone() for f in finals]
        ctx.plan, ctx.bounds = plan, bounds
        ctx.n_in = len(inputs)
        # boundary[0] holds the h0 inputs (or None): already saved as inputs
        flat = [c for cs in boundary[1:] for c in cs]
        ctx.save_for_backward(*inputs, *flat)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *gouts: torch.Tensor) -> tuple[Any, ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        inputs, flat = saved[: ctx.n_in], saved[ctx.n_in:]
        K = len(plan.scans)
        needs = list(ctx.needs_input_grad[2:])
        grads: list[Any] = [None] * len(inputs)
        for i, (x, d) in enumerate(zip(inputs, plan.in_step_dims)):
            if needs[i] and d is not None:
                grads[i] = torch.empty_like(x)
        # step-free inputs (parameters) are whole in every shard; their grads are summed over shards
        free = [i for i, d in enumerate(plan.in_step_dims) if d is None and needs[i]]
        acc: dict[int, torch.Tensor] = {}
        adj: list[Any] = [None] * K
        for k in range(len(ctx.bounds) - 1, -1, -1):
            s, e = ctx.bounds[k]
            L = e - s
            carries = ([None if i is None else inputs[i] for i in plan.h0_input] if k == 0
                       else list(flat[(k - 1) * K: k * K]))
            xs = [_slice(x, d, s, L) for x, d in zip(inputs, plan.in_step_dims)]
            # NB: contiguous: compiled programs are specialized to their example inputs' strides
            gos = [None if g is None else g.narrow(d, s, L).contiguous() for g, d in zip(gouts, plan.out_step_dims)]
            needs_c = [c is not None and (k > 0 or needs[plan.h0_input[j]]) for j, c in enumerate(carries)]
            gx, adj = plan.vjp(L, xs, carries, k == 0, gos, adj, needs, needs_c, t0=s)
            for i, (g, d) in enumerate(zip(gx, plan.in_step_dims)):
                if g is not None and d is not None:
                    grads[i].narrow(d, s, L).copy_(g)
            old = [i for i in free if gx[i] is not None and i in acc]
            if old:
                torch._foreach_add_([acc[i] for i in old], [gx[i] for i in old])
            for i in free:
                if gx[i] is not None and i not in acc:
                    acc[i] = gx[i].clone()
        for i, g in acc.items():
            grads[i] = g
        # the first shard's carry grads are the h0 grads
        for j, i in enumerate(plan.h0_input):
            if i is not None and needs[i] and adj[j] is not None:
                g = adj[j]
                if g.shape != inputs[i].shape:  # h0 broadcast against the state
                    g = g.sum_to_size(inputs[i].shape)
                grads[i] = g if grads[i] is None else grads[i] + g
        return (None, None, *grads)


class ShardedRegion(torch.nn.Module):
    """A time-local region run shard by shard with exact gradients (see the module docstring).

    ``forward(*inputs)`` takes the region's inputs in placeholder order and returns its outputs (a tensor when the
    region graph returns one, else a tuple).  ``shard_size=None`` picks :func:`default_shard_size` of T per call.
    With ``verify=True`` the first call also runs :func:`verify_region` and logs the max relative gradient error.
    ``inner`` ("eager", "aot_eager", "inductor") compiles each shard program, forward and recompute+VJP, on first
    use; "eager" runs them as FX code.
    """

    def __init__(self, region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None = None, shard_size: int | None = None,
                 verify: bool = False, inner: str = "eager") -> None:
        super().__init__()
        if shard_size is not None and (not isinstance(shard_size, int) or isinstance(shard_size, bool)
                                       or shard_size < 1):
            raise ValueError(f"shard_size={shard_size!r}: expected an int >= 1 or None")
        self.region_gm = region_gm
        self.in_step_dims = list(in_step_dims)
        self.out_step_dims = None if out_step_dims is None else list(out_step_dims)
        self.shard_size = shard_size
        self.verify = verify
        self._plan = _Plan(region_gm, self.in_step_dims, self.out_step_dims, inner)
        self.last_verify_error: float | None = None

    def prepare(self, inputs: Sequence[Any]) -> int:
        """Check the region for these input shapes (real or fake tensors); returns the shard size used."""
        self._plan.prepare(inputs, self.shard_size)
        return self._plan.shard_size

    def forward(self, *inputs: Any) -> Any:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"region input {i} is a {type(x).__name__}, expected a tensor")
        S = self.prepare(inputs)
        if self.verify:
            self.verify = False
            self.last_verify_error = verify_region(self.region_gm, self.in_step_dims, self.out_step_dims, S,
                                                   [x.detach() for x in inputs])
        outs = _ShardedFn.apply(self._plan, S, *inputs)
        return outs[0] if self._plan.single_output else tuple(outs)


def make_sharded(region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None, shard_size: int | None,
                 verify: bool = False) -> ShardedRegion:
    """A callable running ``region_gm`` shard by shard with exact gradients.

    Args:
        region_gm: a graph whose placeholders are the region's inputs and whose output is a tensor or a tuple of
            tensors; it contains one or more forward ``linear_scan`` calls (window None) whose h0 is None or an input.
        in_step_dims: per input, the dim of its step axis (length T), or None for step-free inputs (parameters,
            h0) that every shard uses whole.
        out_step_dims: per output, the dim of its step axis (checked against the analysis), or None to infer.
        shard_size: steps per shard (>= 1); None: :func:`default_shard_size`.
    Returns ``callable(*inputs) -> outputs`` (a :class:`ShardedRegion`).  The region is analysed and its shard
    programs checked on the first call; :class:`~adjoint_compile.errors.UnsupportedRegion` says why when it
    cannot be sharded.
    """
    return ShardedRegion(region_gm, in_step_dims, out_step_dims, shard_size, verify)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def verify_region(region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                  out_step_dims: Sequence[int | None] | None, shard_size: int | None,
                  inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor] | None = None,
                  seed: int = 0) -> float:
    """Compare the sharded region with plain autograd of ``region_gm`` on ``inputs``; log and return the max
    relative error over the outputs and the gradients of every floating-point input.

    ``grad_outputs`` default to random cotangents (a fixed seed).  Relative error: max|Δ| / max|reference| per
    tensor, the max over tensors.
    """
    def leaves() -> list[torch.Tensor]:
        return [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]

    ref_in = leaves()
    ref = region_gm(*ref_in)
    ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    if grad_outputs is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        grad_outputs = [torch.randn(r.shape, generator=gen, dtype=r.dtype).to(r.device) for r in ref]
    wrt = [x for x in ref_in if x.requires_grad]
    ref_g = torch.autograd.grad(ref, wrt, grad_outputs, allow_unused=True)
    sh_in = leaves()
    out = ShardedRegion(region_gm, in_step_dims, out_step_dims, shard_size)(*sh_in)
    out = [out] if isinstance(out, torch.Tensor) else list(out)
    sh_g = torch.autograd.grad(out, [x for x in sh_in if x.requires_grad], grad_outputs, allow_unused=True)
    err = max((_rel_err(o, r) for o, r in zip(out, ref)), default=0.0)
    for a, b in zip(sh_g, ref_g):
        if (a is None) != (b is None):
            err = max(err, float("inf"))
        elif a is not None:
            err = max(err, _rel_err(a, b))
    log.info("adjoint-compile verify: sharded region (shard_size=%s) vs autograd: max relative error %.3g",
             shard_size, err)
    return err
