"""Shard programs: a time-local region (a stack of linear scans joined by ops that act on each step on its own)
cut to L steps, checked, compiled and cached — the layer every sharded runtime (the exact sweep in
:mod:`.sharded`, and the truncated, Highway-BP and sequence-parallel sweeps) runs on.

Let the region map step-carrying inputs x_{1..T} (and step-free inputs θ, e.g. parameters) to outputs y_{1..T},
with K scans h^k_t = a^k_t ⊙ h^k_{t-1} + b^k_t inside.  Given the states h^k_{s-1} before a shard's first step,
the steps [s, s+L) are a closed computation

    (y_{s..s+L-1}, h^k_{s+L-1}) = F_L(x_{s..s+L-1}, θ, h^k_{s-1})

and :meth:`ShardProgram.program` is F_L as an FX graph::

    (region inputs, each step-carrying one sliced to L steps at its step dim,
     carry_0..carry_{K-1}          the state before the shard, scan k's state shape (its output without the step dim),
                                   or None for the sequence's h0 = zeros,
     halo_0..halo_{C-1}            per causal conv or token shift along time, the p steps of its input before the
                                   shard (None in the sequence's first shard: zeros, the conv's own padding, or the
                                   shift's fill),
     prev_0..prev_{J-1}            per previous-state readout cat([first, h^k[:, :-1]]): the carry of scan k,
                                   or None in the sequence's first shard (the readout then gives its own ``first``),
     [step_offset])                the shard's first step s as an int64 scalar, only when the region has hashed
                                   dropouts (their masks are a function of each element's position in the full tensor)
    -> (outputs, each with L steps at its step dim, ..., final state of scan 0, ..., of scan K-1,
        last p input steps of conv 0, ..., of conv C-1)

The carries (K scan states, then C conv halos) flow left to right in the forward and their cotangents right to left
in the backward: a conv's halo cotangent is what the shard on its left adds to its last p input steps.

Region graphs come from dynamo with literal sizes: view/reshape/expand arguments equal to T at the step position
are rewritten to L, and the L-step program is run on fake tensors node by node: every node must have its
full-length shape with L at its step dim.  Anything that cannot be proven raises
:class:`~adjoint_compile.errors.UnsupportedRegion`.

Compiled callables (the forward, and recompute + VJP traced as one program) are cached per shard length, call
pattern (grad mode, requires_grad, which cotangents and carries are present and their shapes, first shard or not where
previous-state readouts tell it apart) and device, so a runtime may call :meth:`~ShardProgram.run` and
:meth:`~ShardProgram.vjp` once per shard without recompiling.  The exact sweep passes zeros for the first shard's
absent carries and the last shard's adjoints (:meth:`~ShardProgram.initial_carries`), so that all its shards of one
length share one forward and one recompute + VJP program.
"""
from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..analysis.fx import is_linear_scan, scan_args
from ..analysis.grow import scan_seeds
from ..analysis.losses import loss_args, loss_count
from ..analysis.step_literals import rewrite_lengths
from ..analysis.time_local import TimeLocalInfo, analyze, conv_args
from ..errors import UnsupportedRegion
from ..inner import COMPILE_LOCK, compile_inner
from ..kernels.random import hashed_dropout
from .shard_parts import (MIN_SHARD_BYTES, _halo_out, _prev_or_first, _shifted, _with_halo, arg_layout, differentiable,
                          autocast_as, autocast_off, autocast_state, default_shard_size, initial_zeros,
                          least_shard_steps, own_bytes, serial_kernels, shard_bounds, wanted_shard_size, without_steps,
                          built_from, h0_index as _h0_index)
from .graphed import replayed
from .shard_vjp import build_vjp
from .truncated import nu_shape

log = logging.getLogger(__name__)

__all__ = ["MIN_SHARD_BYTES", "ShardProgram", "default_shard_size", "wanted_shard_size"]


def _ev(n: fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def _devices(args: Sequence[Any]) -> tuple:
    return tuple(a.device for a in args if isinstance(a, torch.Tensor))


def _layout(key: tuple) -> tuple:
    """A :meth:`ShardProgram.prepare` key without the devices (the compiled callables' own keys hold those)."""
    return tuple(x[:2] if isinstance(x, tuple) else x for x in key)


class ShardProgram:
    """The region graph as shard programs: (shard inputs, carries, prev readouts, [step offset]) -> (outputs,
    final states), specialized per shard length L, checked, compiled by ``inner`` and cached (module docstring).

    Args:
        region_gm: placeholders are the region's inputs; the output is a tensor or a tuple of tensors; it contains
            one or more forward ``linear_scan`` calls (window None) whose h0 is None or a region input.
        in_step_dims: per input, the dim of its step axis (length T), or None for step-free inputs (parameters,
            h0) that every shard uses whole.
        out_step_dims: per output, the dim of its step axis (checked against the analysis), or None to infer.
        inner: the compiler for the shard programs (:func:`~adjoint_compile.inner.compile_inner`'s names);
            "eager" runs the forward as FX code.
        window: None for the exact adjoint; W: the VJPs truncate each scan's adjoint to W steps
            (:mod:`.truncated`) when W < T, carrying ν (:meth:`nu_zeros`) between shards.

    Call :meth:`prepare` with the full-length inputs (real or fake) first; it sets ``T``, ``shard_size``,
    ``out_step_dims``, ``scan_dims`` and ``carry_shapes``.  Then, for a shard [s, s+L): :meth:`shard_inputs`
    slices the inputs, :meth:`initial_carries` gives the first shard's carries, :meth:`run` is the forward and
    :meth:`vjp` one recompute + VJP.  ``h0_input[k]`` is the region input holding scan k's h0 (None: zeros).
    """
    loss_chunks = False  # a loss tail's chunks (loss_tail.py): sized as such on a GPU (shard_parts.least_shard_steps)

    def __init__(self, region_gm: fx.GraphModule, in_step_dims: Sequence[int | None],
                 out_step_dims: Sequence[int | None] | None = None, inner: str = "eager",
                 window: int | None = None, scans_required: bool = True) -> None:
        self.region_gm = region_gm
        self.inner = inner
        self.window = window
        #: compiled forwards, keyed by (L, devices, grad mode, per-argument requires_grad); see :meth:`_callable`
        self.compiled: dict[tuple, Any] = {}
        #: recompute + VJP programs, keyed by (L, devices, call pattern); see :meth:`vjp`
        self.vjps: dict[tuple, Any] = {}
        self.placeholders = [n for n in region_gm.graph.nodes if n.op == "placeholder"]
        if len(in_step_dims) != len(self.placeholders):
            raise ValueError(f"in_step_dims: {len(in_step_dims)} entries for {len(self.placeholders)} region inputs")
        self.in_step_dims = list(in_step_dims)
        if all(d is None for d in self.in_step_dims):
            raise ValueError("in_step_dims: no input carries the step axis")
        outs = next(n for n in region_gm.graph.nodes if n.op == "output").args[0]
        self.single_output = not isinstance(outs, (tuple, list))
        self.out_nodes = [outs] if self.single_output else list(outs)
        self.out_step_dims_given = None if out_step_dims is None else list(out_step_dims)
        self.scans = [n for n in region_gm.graph.nodes if n.op == "call_function" and is_linear_scan(n)]
        if not self.scans and scans_required:  # NB: not required by a loss run chunk by chunk (loss_tail.py)
            raise UnsupportedRegion("the region has no linear_scan")
        self.h0_input: list[int | None] = []
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
        #: for a region that serves every length (length_generic.py): shards of ``shard_size`` steps, a tail of powers
        #: of two, programs free of T (a mean over time scaled by 1/T outside) shared through ``shared`` by layout
        self.length_free = False
        self.shared: dict[tuple, tuple[dict, dict, dict]] | None = None
        self.prepared_for: tuple | None = None
        #: hashed dropouts (kernels/random.py): their masks depend on each element's global step, so shard programs
        #: take the shard's first step as one more input
        self.random = [n for n in region_gm.graph.nodes if n.op == "call_function" and n.target is hashed_dropout]

    # ---------------------------------------------------------------------------------------------- preparation

    def boundary_bytes(self, start: int = 0) -> int:
        """Bytes a sweep keeps per shard boundary: the scans' states and the conv halos (the carries from ``start``)."""
        return sum(math.prod(c) * dt.itemsize for c, dt in zip(self.carry_shapes[start:], self.carry_dtypes[start:]))

    def step_bytes(self) -> int:
        """The region's activations per step (estimated): the bytes of its step-carrying values over T."""
        return sum(own_bytes(_ev(n)) for n in self.region_gm.graph.nodes
                   if n.op != "placeholder" and self.info.step_dim.get(n) is not None) // self.T

    def halo_bytes(self) -> int:
        """Bytes of one shard boundary's conv halos (the carries after the scans' states)."""
        return self.boundary_bytes(len(self.scans))

    def prepare(self, inputs: Sequence[Any], shard_size: int | None) -> int:
        """Propagate (fake) full-length shapes, analyse the step axis, check that the region is time-local, choose
        the shard size (``shard_size``, or :func:`default_shard_size` when None) and build and check the programs
        for the shard lengths it gives.  Returns the shard size.  A no-op for the inputs' layout of the last call."""
        key = (shard_size, *((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x
                             for x in inputs))
        if self.prepared_for == key:
            return self.shard_size
        with COMPILE_LOCK:
            if self.prepared_for == key:  # prepared by another thread meanwhile
                return self.shard_size
            return self._prepare(inputs, shard_size, key)

    def _prepare(self, inputs: Sequence[Any], shard_size: int | None, key: tuple) -> int:
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"expected {len(self.placeholders)} region inputs, got {len(inputs)}")
        Ts = {x.shape[d] for x, d in zip(inputs, self.in_step_dims) if d is not None}
        if len(Ts) != 1:
            raise ValueError(f"the step-carrying inputs disagree on the number of steps: {sorted(Ts)}")
        self.T = Ts.pop()
        if self.T < 1:
            raise UnsupportedRegion(f"T={self.T} steps: nothing to shard")
        self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [self._mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        FakeTensorProp(self.region_gm, self._mode).propagate_dont_convert_inputs(*fakes)
        seeds = {p: d for p, d in zip(self.placeholders, self.in_step_dims) if d is not None}
        seeds.update(scan_seeds(self.scans))  # the scans, and a constant decay expanded over the steps
        # NB: causal convs are carried by the exact sweep only; the truncated adjoint's ν carries scans alone
        info = analyze(self.region_gm, seeds, halo=self.window is None, ends=True)
        for n in self.region_gm.graph.nodes:
            if n in info.mixing and n.op != "placeholder":
                raise UnsupportedRegion(f"node {n.name} mixes steps: {info.mixing[n]}")
        self.info: TimeLocalInfo = info
        #: for each previous-state readout, the index of the scan whose carry it reads in later shards
        self.shift_scans = [self.scans.index(sh.scan) for sh in info.shifts.values()]
        #: the causal convs along time, whose halos are carried after the scans' states
        self.convs = list(info.convs.values())
        self.out_step_dims = [info.step_dim.get(n) if isinstance(n, fx.Node) else None for n in self.out_nodes]
        #: per output, whether it is a sum over time (``info.sums``): a sweep adds up its shards' values
        self.out_sums = [n in info.sums for n in self.out_nodes]
        self.out_means = [n in info.sums and info.sums[n].mean for n in self.out_nodes]
        for n, d, is_sum in zip(self.out_nodes, self.out_step_dims, self.out_sums):
            if (d is None and not is_sum) or n in info.folds:
                raise UnsupportedRegion(f"region output {getattr(n, 'name', n)} does not carry the step axis"
                                        + (" as a dim of its own" if n in info.folds else ""))
        for n in info.sums:
            if any(u.op != "output" for u in n.users):
                raise UnsupportedRegion(f"node {n.name} sums over the step dim and is read inside the region")
        if self.out_step_dims_given is not None and [
            None if d is None else d % len(_ev(n).shape) for n, d in zip(self.out_nodes, self.out_step_dims_given)
        ] != self.out_step_dims:
            raise ValueError(f"out_step_dims={self.out_step_dims_given} but the region's outputs carry the step axis "
                             f"at {self.out_step_dims}")
        #: the outputs that are means over valid targets (a loss, analysis/losses.py): each shard gives its sum and its
        #: count, one more output per ratio after the others (summed like them; ShardedRegion divides)
        self.ratios = [i for i, n in enumerate(self.out_nodes) if n in info.sums and info.sums[n].ratio]
        self.out_step_dims += [None] * len(self.ratios)
        self.out_sums += [True] * len(self.ratios)
        self.out_means += [False] * len(self.ratios)
        self.scan_dims = [info.step_dim[s] for s in self.scans]
        self.carry_shapes = []
        self.carry_dtypes = []
        for s, d in zip(self.scans, self.scan_dims):
            shp = list(_ev(s).shape)
            del shp[d]
            self.carry_shapes.append(tuple(shp))
            self.carry_dtypes.append(_ev(s).dtype)
        for cc in self.convs:
            shp = list(_ev(cc.input).shape)
            shp[cc.dim] = cc.halo
            self.carry_shapes.append(tuple(shp))
            self.carry_dtypes.append(_ev(cc.input).dtype)
        #: scan states, then conv halos: the carries a sweep hands from shard to shard
        self.n_carries = len(self.carry_shapes)
        #: the shard size asked for (``shard_size``, or :func:`least_shard_steps`), before it is cut to T
        dev = next((x.device for x in inputs if isinstance(x, torch.Tensor)), None)
        self.wanted_shard_size = shard_size or least_shard_steps(self, dev)
        self.shard_size = min(self.wanted_shard_size, self.T) if shard_size is None else shard_size
        if self.length_free and shard_size is None:  # NB: a power of two: few shard lengths over all T
            self.shard_size = 1 << (self.wanted_shard_size.bit_length() - 1)
        self.specialized = {}
        # NB: compiled callables outlive a change of device only (their keys hold the devices): the same region on two
        # devices compiles twice, not on every switch; built programs serve each length of one analysis (not dropouts)
        if self.shared is not None:
            self.compiled, self.vjps, built = self.shared.setdefault(
                _layout(without_steps(key[1:], self.in_step_dims)), ({}, {}, {}))
            self.specialized = built.setdefault(built_from(self), {}) if not self.random else {}
        elif self.prepared_for is None or _layout(self.prepared_for) != _layout(key):
            self.compiled, self.vjps = {}, {}
        self.prepared_for = key
        # build and check the programs for the lengths this T needs now, so that problems surface up front
        for L in {e - s for s, e in self.bounds()}:
            self.program(L)
        return self.shard_size

    def program(self, L: int) -> fx.GraphModule:
        """The shard program for shards of L steps (built once per L, checked with fake tensors)."""
        gm = self.specialized.get(L)
        if gm is not None:
            return gm
        with COMPILE_LOCK:
            gm = self.specialized.get(L)
            if gm is not None:
                return gm
            if self.prepared_for is None:
                raise RuntimeError("ShardProgram.program: call prepare(inputs, shard_size) first")
            if not 1 <= L <= self.T:
                raise ValueError(f"L={L}: a shard has 1 to T={self.T} steps")
            gm, env = self._build(L)
            self._check(gm, env, L)
            self.specialized[L] = gm
        return gm

    def _build(self, L: int) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.placeholders:
            env[n] = g.node_copy(n, env.__getitem__)
        carries = [g.placeholder(f"carry_{k}") for k in range(len(self.scans))]
        halos = [g.placeholder(f"halo_{j}") for j in range(len(self.convs))]
        conv_of = {cc.conv: j for j, cc in enumerate(self.convs)}
        # NB: a conv of a padded shard input gives L steps: the cut after it, or the pad before it, goes
        skip = {cc.sliced: cc.conv for cc in self.convs if cc.sliced is not None}
        skip.update({cc.pad: cc.input for cc in self.convs if cc.pad is not None})
        padded: list[fx.Node] = []
        shifts = list(self.info.shifts.items())
        prevs = [g.placeholder(f"prev_{j}") for j in range(len(shifts))]
        t0 = g.placeholder("step_offset") if self.random else None
        dens: dict[fx.Node, fx.Node] = {}
        for n in self.region_gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n in skip:
                env[n] = env[skip[n]]
                continue
            if n in conv_of and self.convs[conv_of[n]].kind == "shift":
                # NB: a token shift of the shard: cat(halo, x) cut to the shard's L steps; x's last p steps go on
                cc = self.convs[conv_of[n]]
                xp = g.call_function(_with_halo, (halos[conv_of[n]], env[cc.input], cc.halo, cc.dim, cc.fill))
                padded.append(xp)
                env[n] = g.call_function(_shifted, (xp, cc.halo, cc.dim))
                continue
            new = g.node_copy(n, env.__getitem__)
            env[n] = new
            if n in self.info.shifts:
                sh = self.info.shifts[n]
                with g.inserting_before(new):
                    head = g.call_function(_prev_or_first, (prevs[shifts.index((n, sh))], env[sh.first], sh.dim))
                new.args = ([head, env[sh.sliced]], *new.args[1:])
            if n in conv_of:
                cc = self.convs[conv_of[n]]
                a = conv_args(new)
                with g.inserting_before(new):
                    xp = g.call_function(_with_halo, (halos[conv_of[n]], a["input"], cc.halo, cc.dim))
                padded.append(xp)
                new.args = (xp, a["weight"], a["bias"], a["stride"], 0, a["dilation"], a["groups"])
                new.kwargs = {}
            if n in self.random:
                # hashed_dropout(x, p, training, seed, t0=0, step_dim=None, T=None, *, stream): place it in time
                a = list(new.args) + [None] * (7 - len(new.args))
                a[4], a[5], a[6] = t0, self.info.step_dim[n], self.T
                new.args, new.kwargs = tuple(a), {**new.kwargs, "fold": self.info.folds.get(n, 1)}
            if n.op in ("call_method", "call_function") and L != self.T:
                self._rewrite_lengths(n, new, L)
            if n in self.info.sums and self.info.sums[n].ratio:  # NB: the shard's sum, and its count of targets
                a = {k: v for k, v in loss_args(new).items() if k not in ("size_average", "reduce")}
                new.args, new.kwargs = (), {**a, "reduction": "sum"}
                with g.inserting_after(new):
                    dens[n] = g.call_function(loss_count, (a["target"], a["ignore_index"], a["weight"]))
            if n in self.info.sums and self.info.sums[n].mean and (L != self.T or self.length_free):
                # NB: a shard's mean weighted by L/T: the shards' values then add up to the mean over all T steps
                # (length-free programs weigh by L alone; run() and vjp() apply the 1/T)
                with g.inserting_after(new):
                    env[n] = g.call_function(operator.mul, (new, float(L) if self.length_free else L / self.T))
        for k, s in enumerate(self.scans):
            new, i = env[s], _h0_index(s)
            if len(new.args) > i:
                new.args = (*new.args[:i], carries[k], *new.args[i + 1:])
            else:
                new.kwargs = {**new.kwargs, "h0": carries[k]}
        finals = [g.call_function(torch.select, (env[s], d, -1)) for s, d in zip(self.scans, self.scan_dims)]
        finals += [g.call_function(_halo_out, (xp, cc.halo, cc.dim)) for xp, cc in zip(padded, self.convs)]
        dens_out = tuple(dens[self.out_nodes[i]] for i in self.ratios)
        g.output(tuple(env[n] for n in self.out_nodes) + dens_out + tuple(finals))
        return fx.GraphModule(self.region_gm, g), env

    def _rewrite_lengths(self, n: fx.Node, new: fx.Node, L: int) -> None:
        """Shape arguments holding T (fold·T) at the step position become L (fold·L): dynamo bakes literal sizes."""
        rewrite_lengths(self.info, self.T, n, new, L)

    def _check(self, gm: fx.GraphModule, env: dict[fx.Node, fx.Node], L: int) -> None:
        """Run the shard program on fake tensors; every node must have its full-length shape with L at the step dim."""
        args = []
        with self._mode:
            for p, d in zip(self.placeholders, self.in_step_dims):
                v = _ev(p)
                shp = list(v.shape)
                if d is not None:
                    shp[d] = L
                args.append(torch.empty(shp, dtype=v.dtype, device=v.device))
            dev = _ev(self.scans[0]).device if self.scans else None
            for shp, dt in zip(self.carry_shapes, self.carry_dtypes):
                args.append(torch.empty(shp, dtype=dt, device=dev))
            args += [args[len(self.placeholders) + k] for k in self.shift_scans]
            if self.random:
                args.append(torch.zeros((), dtype=torch.int64))
        try:
            FakeTensorProp(gm, self._mode).propagate_dont_convert_inputs(*args)
        except Exception as e:  # noqa: BLE001 - any failure means the program is not proven
            raise UnsupportedRegion(f"the {L}-step shard program does not run: {type(e).__name__}: {e}") from e
        for n, new in env.items():
            v, w = _ev(n), _ev(new)
            if not isinstance(v, torch.Tensor):
                continue
            want = list(v.shape)
            d = self.info.step_dim.get(n)
            if d is not None:
                want[d] = L - 1 if any(sh.sliced is n for sh in self.info.shifts.values()) else L
                want[d] *= self.info.folds.get(n, 1)
            if not isinstance(w, torch.Tensor) or list(w.shape) != want:
                got = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise UnsupportedRegion(f"node {n.name}: shape {got} in the {L}-step shard program, expected {want} "
                                        f"(a literal length that is not at the step position?)")

    # --------------------------------------------------------------------------------------------------- running

    def bounds(self) -> list[tuple[int, int]]:
        """The shards [s, e) of the prepared T, left to right (:func:`~.shard_parts.shard_bounds`)."""
        return shard_bounds(self.T, self.shard_size, self.length_free)

    def _mean_scaled(self, values: Sequence[Any]) -> list[Any]:
        """Length-free programs: the outputs that are means over time, times 1/T (see :meth:`_build`)."""
        if not self.length_free or not self.out_means:
            return list(values)
        return [v / self.T if m and v is not None else v for v, m in zip(values, self.out_means)]

    def initial_carries(self, inputs: Sequence[Any], zeros: bool = False) -> list[Any]:
        """The first shard's carries: per scan, its h0 input, or None (zeros); per conv, None (its zero padding).

        ``zeros``: zero tensors (a token shift's halo: its fill) instead of the Nones, the same values, so that the
        first shard runs the compiled program of the others (:func:`~.shard_parts.initial_zeros`)."""
        if zeros:
            return initial_zeros(self, inputs)
        return [None if i is None else inputs[i] for i in self.h0_input] + [None] * len(self.convs)

    def shard_inputs(self, inputs: Sequence[Any], s: int, L: int) -> list[Any]:
        """The region inputs for steps [s, s+L): step-carrying ones sliced, step-free ones whole.

        NB: contiguous: ops on a strided time slice take slow paths (F.linear on a narrow()ed [B, L, D]: ~10x
        slower), and compiled programs are specialized to their example inputs' strides.
        """
        return [x if d is None else x.narrow(d, s, L).contiguous() for x, d in zip(inputs, self.in_step_dims)]

    def run(self, L: int, xs: Sequence[Any], carries: Sequence[Any], first_shard: bool, t0: int = 0,
            graphs: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The L-step program on shard inputs ``xs`` and ``carries`` (per scan, None: zeros): (outputs, final
        states).  ``first_shard``: previous-state readouts give their own first step; ``t0``: the shard's first
        step; ``graphs``: replayed from a CUDA graph where it can be, valid until the next call (:mod:`.graphed`)."""
        prevs = [None if first_shard else carries[k] for k in self.shift_scans]
        args = [*xs, *carries, *prevs, *self._offset(t0)]
        fn = self._callable(L, args)
        res = (replayed(fn, args, self.inner, "shard program") if graphs and not self.random else fn)(*args)
        n = len(self.out_step_dims)
        return self._mean_scaled(res[:n]), list(res[n:])

    def _callable(self, L: int, args: list[Any]) -> Any:
        """The shard program for L steps, compiled by the inner compiler on first use for this call pattern.

        NB: keyed by grad mode and each argument's requires_grad (None for an absent h0): an aot_autograd function
        compiled for inputs that did not require grad would silently return no gradient for them later."""
        if self.inner == "eager":
            return self.program(L)
        grad = torch.is_grad_enabled()
        key = (L, _devices(args), autocast_state(), grad,
               tuple(None if a is None else (grad and a.requires_grad) for a in args), arg_layout(args))
        if self.shared is not None:
            key += (self.program(L).code,)  # NB: shared with other lengths: the same key must mean the same graph
        fn = self.compiled.get(key)
        if fn is None:
            with COMPILE_LOCK:
                fn = self.compiled.get(key) or compile_inner(self.program(L), args, self.inner,
                                                             serial=serial_kernels(self, L, args))
                self.compiled[key] = fn
        return fn

    def _offset(self, t0: int) -> list[torch.Tensor]:
        return [torch.tensor(t0, dtype=torch.int64)] if self.random else []

    def vjp(self, L: int, xs: Sequence[Any], carries: Sequence[Any], first_shard: bool,
            gouts: Sequence[Any], adjs: Sequence[Any], needs_x: Sequence[bool], needs_c: Sequence[bool],
            t0: int = 0, autocast: tuple | None = None, nus: Sequence[Any] | None = None,
            graphs: bool = False) -> tuple[list[Any], ...]:
        """One shard's recomputation and VJP, as one program: the cotangents ``gouts`` (per output, None: unused)
        and ``adjs`` (per scan, the adjoint of its final state; None: zero) pulled back to the inputs ``xs`` (those
        with ``needs_x``) and the carries (those with ``needs_c``).

        ``autocast``: the forward's autocast settings (:func:`autocast_state`; None: those in effect now): the
        recomputation runs under them, traced into the program, which runs without autocast (a backward's own).

        ``nus`` (only when :attr:`truncating`): per scan, the ν carry from the right neighbour (:mod:`.truncated`);
        the result then has a third list, per scan the ν' carry for the left neighbour. ``graphs``: as in :meth:`run`.
        Returns (per input: its grad or None, per scan: the grad of its carry or None). The program is traced once
        per call pattern (make_fx over recompute + ``autograd.grad``: forward and backward ops in one aten graph)
        and compiled by the inner compiler, so a shard costs one call instead of a compiled forward, a compiled
        backward and an autograd-engine pass between them.
        """
        gouts = self._mean_scaled(gouts)
        first_shard = first_shard and bool(self.shift_scans)  # NB: only previous-state readouts tell it apart
        wrt_x = [i for i, (x, n) in enumerate(zip(xs, needs_x)) if n and differentiable(x)]
        wrt_c = [j for j, n in enumerate(needs_c) if n and differentiable(carries[j])]
        has_g, has_a, has_c = (tuple(v is not None for v in vs) for vs in (gouts, adjs, carries))
        gx, gc = [None] * len(xs), [None] * len(carries)
        trunc = self.truncating
        if trunc != (nus is not None):
            raise ValueError(f"vjp: nus must be given exactly when truncating (window={self.window}, T={self.T})")
        if not trunc and (not (wrt_x or wrt_c) or not (any(has_g) or any(has_a))):
            return gx, gc
        # NB: contiguous carries and cotangents: a conv halo's adjoint is a slice of the right shard's input grad, its
        # strides set by that shard's length, and compiled programs are specialized to their example's strides
        args = [*xs, *(c.contiguous() for c in carries if c is not None),
                *(g for g in gouts if g is not None), *(a.contiguous() for a in adjs if a is not None),
                *(nus or []), *self._offset(t0)]
        # NB: the devices are part of the key: make_fx bakes them into factory calls of the traced program
        fwd = autocast_state() if autocast is None else autocast
        key = (L, _devices(args), fwd, autocast_state(), first_shard, tuple(wrt_x), tuple(wrt_c), has_g, has_a, has_c,
               arg_layout(args))
        if self.shared is not None:
            key += (self.program(L).code,)
        fn = self.vjps.get(key)
        with autocast_off():
            if fn is None:
                with COMPILE_LOCK:
                    fn = self.vjps.get(key) or build_vjp(self, L, first_shard, wrt_x, wrt_c, has_g, has_a, has_c,
                                                               args, fwd)
                    self.vjps[key] = fn
            got = (replayed(fn, args, self.inner, "shard VJP") if graphs and not self.random else fn)(*args)
        for i, g in zip(wrt_x, got[: len(wrt_x)]):
            gx[i] = g
        for j, g in zip(wrt_c, got[len(wrt_x): len(wrt_x) + len(wrt_c)]):
            gc[j] = g
        return (gx, gc, list(got[len(wrt_x) + len(wrt_c):])) if trunc else (gx, gc)

    truncating = property(lambda self: self.window is not None and self.window < self.T,
                          doc="Whether the VJPs truncate the adjoint: a window W < the prepared T (W >= T is exact).")

    def nu_zeros(self, device: torch.device) -> list[torch.Tensor]:
        """Per scan, the ν carry at the sequence's end (zeros): its state shape with W at its step dim."""
        return [torch.zeros(nu_shape(c, d, self.window), dtype=_ev(s).dtype, device=device)
                for s, c, d in zip(self.scans, self.carry_shapes, self.scan_dims)]
