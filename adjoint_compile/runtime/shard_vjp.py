"""The recompute + VJP program of one shard (:meth:`.shard_program.ShardProgram.vjp`): the shard's forward and its
``autograd.grad`` traced together by ``make_fx`` into one aten graph, compiled by the inner compiler, so that a
shard's backward is one compiled call with no autograd-engine pass of its own."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .. import timing
from ..inner import compile_inner, stride_checked
from .shard_parts import autocast_as, serial_kernels
from .truncated import truncate_program

log = logging.getLogger(__name__)

__all__ = ["build_vjp"]


def build_vjp(sp: Any, L: int, first_shard: bool, wrt_x: list[int], wrt_c: list[int], has_g: tuple,
              has_a: tuple, has_c: tuple, example: list[Any], fwd_autocast: tuple) -> Any:
    """The callable ``fn(*example-like args) -> grads`` for :meth:`ShardProgram.vjp` of shard program ``sp`` at
    shard length L and one call pattern (which inputs and carries want grads, which cotangents are present)."""
    trunc = sp.truncating
    prog = truncate_program(sp.program(L), sp.window) if trunc else sp.program(L)
    n_x = len(sp.placeholders)
    n_c = sum(has_c)
    offset = [None] if sp.random else []
    unused: list[bool] = []

    def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(flat[n_x + n_c: len(flat) - len(offset)])
        gos = [next(it) if h else None for h in has_g]
        adjs = [next(it) if h else None for h in has_a]
        nus = list(it)  # truncated: the ν carries from the right (cotangents of the scans' ν outputs)
        with torch.enable_grad():
            nu_in = [torch.zeros_like(n).requires_grad_() for n in nus]
            xs = [x.detach().requires_grad_(i in wrt_x) for i, x in enumerate(flat[:n_x])]
            ci = iter(flat[n_x: n_x + n_c])
            cs = [next(ci).detach().requires_grad_(j in wrt_c) if h else None for j, h in enumerate(has_c)]
            prevs = [None if first_shard else cs[k] for k in sp.shift_scans]
            with autocast_as(fwd_autocast):
                res = prog(*xs, *cs, *prevs, *flat[len(flat) - len(offset):], *nu_in)
            outs, cots = [], []
            for y, g in zip(res, [*gos, *adjs, *nus]):
                if g is not None and y.requires_grad:
                    outs.append(y)
                    cots.append(g)
            wrt = [xs[i] for i in wrt_x] + [cs[j] for j in wrt_c] + nu_in
            got = torch.autograd.grad(outs, wrt, cots, allow_unused=True) if outs else [None] * len(wrt)
        # NB: zeros for inputs the outputs do not depend on (the compiled program returns tensors only); the
        # caller gets None for them, as from autograd
        unused[:] = [g is None for g in got]
        return tuple(torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt))

    t0 = time.perf_counter()
    # NB: anomaly mode's NaN check would read the fake tensors' values (a data-dependent guard) while tracing;
    # the traced program's ops are checked by no one in either case, as in any compiled backward
    with torch.autograd.set_detect_anomaly(False):
        gm = make_fx(joint, tracing_mode="fake")(*example)
    timing.add_run_time("vjp_traces", time.perf_counter() - t0)
    gm.meta = {**getattr(gm, "meta", {}), "provenance": "adjoint_compile: shard recompute + VJP"}
    log.debug("adjoint-compile: shard VJP program for L=%d (first=%s): %d nodes", L, first_shard,
              len(gm.graph.nodes))
    fn = stride_checked(gm) if sp.inner == "eager" else compile_inner(gm, example, sp.inner,
                                                                       serial=serial_kernels(sp, L, example))
    if not any(unused):
        return fn
    return lambda *a: [None if u else g for g, u in zip(fn(*a), unused)]
