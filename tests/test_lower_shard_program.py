"""The shard-program layer on its own (runtime/shard_program.py), against two oracles that do not use it:

* the full region run whole with plain torch (outputs, the scans' states, ``torch.autograd.grad``);
* the model function itself, written in plain torch, run on the shard's slice with the true carries as h0.

Region: two scans (the first with an h0 input), a literal T in a view/reshape, and a previous-state readout
``cat([h0.unsqueeze(1), h[:, :-1]], 1)``, so a shard program takes x, w, h0, first, two carries and one prev.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile.ops as ac_ops
from adjoint_compile.passes.lower.sharded import outline
from adjoint_compile.analysis.fx import is_linear_scan
from adjoint_compile.analysis.grow import infer_seeds, region_around
from adjoint_compile.analysis.time_local import analyze
from adjoint_compile.runtime.shard_program import ShardProgram, default_shard_size
from helpers import grab_graph

B, D = 2, 4
DT = torch.float64
X, W, H0, FIRST = range(4)  # the region's inputs, in placeholder order (checked in region())


def model(x, w, h0):
    T = x.shape[1]
    h = ac_ops.linear_scan(torch.sigmoid(F.linear(x, w)), x, h0)
    y = torch.tanh(h).view(B, T, 2, D // 2).reshape(B, T, D)
    g = ac_ops.linear_scan(torch.sigmoid(y), y * x)
    prev = torch.cat([h0.unsqueeze(1), h[:, :-1]], 1)
    return g * 2 + prev, y


def shard_ref(x, w, first, ca, cb):
    """``model`` on a shard, in plain torch: (outputs in the region's order, final states)."""
    L = x.shape[1]
    h = ac_ops.linear_scan(torch.sigmoid(F.linear(x, w)), x, ca)
    y = torch.tanh(h).view(B, L, 2, D // 2).reshape(B, L, D)
    g = ac_ops.linear_scan(torch.sigmoid(y), y * x, cb)
    prev = torch.cat([first, h[:, :-1]], 1)
    return [y, g * 2 + prev], [h[:, -1], g[:, -1]]


@functools.lru_cache(maxsize=None)
def region(T: int):
    """(region graph, its inputs, in_step_dims, the full run's outputs, the full run's scan states h and g)."""
    torch.manual_seed(T)
    x, w, h0 = torch.randn(B, T, D, dtype=DT), torch.randn(D, D, dtype=DT) * 0.5, torch.randn(B, D, dtype=DT)
    gm, _ = grab_graph(model, x, w, h0)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    nodes, bounds = region_around(gm, scans, info)
    sub, ins, outs = outline(gm, nodes)
    assert bounds == [] and [a.name for a in ins] == ["l_x_", "l_w_", "l_h0_", "unsqueeze"]
    inputs = [x, w, h0, h0.unsqueeze(1)]
    states = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if is_linear_scan(n):
                states[n.name] = out
            return out

    with torch.no_grad():
        full = list(Rec(sub).run(*inputs))
    assert [o.name for o in outs] == ["y", "add"] and list(states) == ["h", "g"]
    return sub, inputs, [info.step_dim[a] for a in ins], full, [states["h"], states["g"]]


def carries_at(T: int, s: int) -> list:
    """The true states before step s: h0 and zeros (None) for s = 0, else the full run's h_{s-1}, g_{s-1}."""
    _, inputs, _, _, (h, g) = region(T)
    return [inputs[H0], None] if s == 0 else [h[:, s - 1], g[:, s - 1]]


def prepared(T: int, L: int, inner: str = "eager") -> ShardProgram:
    sub, inputs, dims, _, _ = region(T)
    prog = ShardProgram(sub, dims, None, inner)
    assert prog.prepare(inputs, L) == L
    return prog


#: (T, L, s): T = 1; odd T with odd L, first, middle and a last shard of one step; L = 1; L = T
CASES = [(1, 1, 0), (7, 3, 0), (7, 3, 3), (7, 3, 6), (7, 1, 4), (7, 7, 0), (8, 5, 5), (9, 2, 8)]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T,L,s", CASES)
def test_a_shard_gives_the_full_runs_outputs_and_final_state_on_its_slice(T, L, s):
    _, inputs, _, full, states = region(T)
    prog = prepared(T, L)
    n = min(L, T - s)
    assert (s, s + n) in prog.bounds()
    ys, finals = prog.run(n, prog.shard_inputs(inputs, s, n), carries_at(T, s), first_shard=s == 0, t0=s)
    assert len(ys) == 2 and len(finals) == 2
    for y, f, d in zip(ys, full, prog.out_step_dims):
        close(y, f.narrow(d, s, n))
    for fin, h in zip(finals, states):
        close(fin, h[:, s + n - 1])


def _leaves(ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("T,L,s", CASES)
def test_vjp_of_a_shard_is_autograd_of_the_shard_in_plain_torch(T, L, s):
    _, inputs, _, _, _ = region(T)
    prog = prepared(T, L)
    n = min(L, T - s)
    xs, cs = prog.shard_inputs(inputs, s, n), carries_at(T, s)
    gen = torch.Generator().manual_seed(s)
    gouts = [torch.randn(B, n, D, generator=gen, dtype=DT) for _ in range(2)]
    adjs = [torch.randn(B, D, generator=gen, dtype=DT) for _ in range(2)]
    needs_c = [True, s > 0]
    gx, gc = prog.vjp(n, xs, cs, s == 0, gouts, adjs, [True] * 4, needs_c, t0=s)
    # oracle: the model on the slice, its carries as leaves (the readout's first is the carry after shard 0)
    x, w, first = _leaves([xs[X], xs[W], xs[FIRST]])
    ca, cb = _leaves(cs)
    outs, finals = shard_ref(x, w, first if s == 0 else ca.unsqueeze(1), ca, cb)
    wrt = [x, w, first if s == 0 else None, ca, cb]
    used = [t for t in wrt if t is not None]
    ref = iter(torch.autograd.grad([*outs, *finals], used, [*gouts, *adjs], allow_unused=True))
    ref = [None if t is None else next(ref) for t in wrt]
    assert gx[H0] is None  # the scan reads its carry, not the h0 input
    for got, want in zip([gx[X], gx[W], gx[FIRST], gc[0], gc[1]], ref):
        assert (got is None) == (want is None)
        if want is not None:
            close(got, want)


@pytest.mark.parametrize("T,L,s", CASES)
def test_vjp_of_a_shard_is_autograd_of_the_full_region_restricted_to_it(T, L, s):
    """Cotangents on [s, s+n) only, no adjoint from the right: the full region's x-grad on the slice is the
    shard's; the shard's carry grads, pulled back through [0, s), give the full run's other grads (h0's is the
    first shard's carry grad; the readout's ``first`` is an input of its own)."""
    sub, inputs, _, full, _ = region(T)
    prog = prepared(T, L)
    n = min(L, T - s)
    gen = torch.Generator().manual_seed(100 + s)
    gouts = [torch.randn(B, n, D, generator=gen, dtype=DT) for _ in range(2)]
    leaves = _leaves(inputs)
    outs = sub(*leaves)
    cots = [torch.zeros_like(o) for o in outs]
    for c, g, d in zip(cots, gouts, prog.out_step_dims):
        c.narrow(d, s, n).copy_(g)
    ref = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    needs_c = [True, s > 0]  # no carry in for the second scan in the first shard
    gx, gc = prog.vjp(n, prog.shard_inputs(inputs, s, n), carries_at(T, s), s == 0, gouts, [None, None],
                      [True] * 4, needs_c, t0=s)
    close(gx[X], ref[X].narrow(1, s, n))
    if s == 0:
        close(gx[W], ref[W])
        close(gx[FIRST], ref[FIRST])
        close(gc[0], ref[H0])
        assert gc[1] is None
    else:
        # the carries' grads, pulled back through the prefix [0, s) as its final states' adjoints, give the rest
        px, pc = prog.vjp(s, prog.shard_inputs(inputs, 0, s), carries_at(T, 0), True, [None, None], gc,
                          [True] * 4, [True, False], t0=0)
        close(px[X], ref[X].narrow(1, 0, s))
        close(gx[W] + px[W], ref[W])
        assert px[FIRST] is None and not ref[FIRST].any()  # it reaches step 0 only, whose cotangent is 0 here
        close(pc[0], ref[H0])


def test_programs_are_cached_per_length_call_pattern_and_device():
    T, L = 7, 3
    _, inputs, _, _, _ = region(T)
    prog = prepared(T, L, inner="aot_eager")
    assert set(prog.specialized) == {3, 1}  # the lengths 7 = 3 + 3 + 1 needs, built and checked up front
    run = lambda s, n, xs=inputs: prog.run(n, prog.shard_inputs(xs, s, n), carries_at(T, s), s == 0, t0=s)  # noqa
    with torch.no_grad():
        run(3, 3)
        run(3, 3)
        assert len(prog.compiled) == 1
        run(0, 3)  # the first shard: the readout's prev is absent
        assert len(prog.compiled) == 2
        run(6, 1)  # a new length
        assert len(prog.compiled) == 3
        assert prog.program(3) is prog.specialized[3]
    x = inputs[X].detach().clone().requires_grad_()
    ys, _ = run(3, 3, [x, *inputs[1:]])  # x requires grad: the aot function must differentiate it
    assert len(prog.compiled) == 4 and ys[0].requires_grad
    assert {k[0] for k in prog.compiled} == {3, 1}

    xs, cs = prog.shard_inputs(inputs, 3, 3), carries_at(T, 3)
    go = [torch.ones(B, 3, D, dtype=DT)] * 2
    vjp = lambda xs=xs, cs=cs, needs=(True,) * 4, L=3: prog.vjp(L, xs, cs, False, go, [None, None],  # noqa
                                                                 list(needs), [True, True], t0=3)
    vjp()
    vjp()
    assert len(prog.vjps) == 1
    vjp(needs=(True, False, False, False))
    assert len(prog.vjps) == 2
    go = [torch.ones(B, 1, D, dtype=DT)] * 2
    vjp(prog.shard_inputs(inputs, 6, 1), carries_at(T, 6), L=1)
    assert len(prog.vjps) == 3

    # another device: new programs next to the CPU ones (meta tensors run the same graph, shapes only)
    meta = [t.to("meta") for t in inputs]
    prog.prepare(meta, L)
    with torch.no_grad():
        ys, _ = prog.run(3, prog.shard_inputs(meta, 3, 3), [c.to("meta") for c in carries_at(T, 3)], False, t0=3)
    assert ys[0].device.type == "meta" and len(prog.compiled) == 5
    devices = {k[1][0].type for k in prog.compiled}
    assert devices == {"cpu", "meta"}
    # back on the CPU the CPU programs are found again
    prog.prepare(inputs, L)
    with torch.no_grad():
        run(3, 3)
    assert len(prog.compiled) == 5 and len(prog.vjps) == 3


def test_a_new_layout_starts_a_new_cache_and_bad_lengths_are_refused():
    sub, inputs, dims, _, _ = region(7)
    prog = ShardProgram(sub, dims, None, "aot_eager")
    with pytest.raises(RuntimeError, match="prepare"):
        prog.program(3)
    assert prog.prepare(inputs, 3) == 3
    with torch.no_grad():
        prog.run(3, prog.shard_inputs(inputs, 3, 3), carries_at(7, 3), False, t0=3)
    assert len(prog.compiled) == 1 and prog.bounds() == [(0, 3), (3, 6), (6, 7)]
    # another shard size (the default: one shard, as a step's activations are far below MIN_SHARD_BYTES): the
    # compiled programs go
    assert prog.prepare(inputs, None) == default_shard_size(7, prog.boundary_bytes(), prog.step_bytes()) == 7
    assert prog.boundary_bytes() > 0 and prog.step_bytes() > 0
    assert not prog.compiled and set(prog.specialized) == {7} and prog.bounds() == [(0, 7)]
    with pytest.raises(ValueError, match="L=8"):
        prog.program(8)
