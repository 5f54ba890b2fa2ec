"""Property: on any loop program that writes into buffers, reads earlier steps back and branches on shapes, the
backend gives the outputs and gradients of the same code run eagerly (fp64), whatever it rewrites.

Programs are drawn by hypothesis from a small grammar (derandomized, so CI sees the same 200 programs every run):
a recurrence of T steps (linear ``a * h + b``, or through ``tanh``), its states collected by one of several write
forms into a buffer of one of two layouts (partial, reversed, nested, through views, accumulated, read back), an
optional branch on a shape, and an optional second buffer that copies the first row by row."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adjoint_compile.errors import AdjointCompileWarning

DT = torch.float64
WRITES = ("setitem", "copy", "slice", "list", "partial", "reversed", "view", "accumulate", "read_back", "index_put")


def make_program(T: int, D: int, write: str, time_first: bool, tanh: bool, branch: bool, nested: bool,
                 readout: bool):
    """The loop program drawn, as a plain function of (x, a, w)."""

    def step(h, a_t, x_t):
        h = a_t * h + x_t
        return torch.tanh(h) if tanh else h

    def put(o, t, h):
        idx = (t,) if time_first else (slice(None), t)
        if write == "setitem":
            o[idx] = h
        elif write == "copy":
            o[idx].copy_(h)
        elif write == "slice":
            o[idx + (slice(None),)] = h
        elif write == "partial":
            if t != T // 2:
                o[idx] = h
        elif write == "reversed":
            o[(T - 1 - t,) if time_first else (slice(None), T - 1 - t)] = h
        elif write == "view":
            o[idx][..., : max(D - 1, 1)] = h[..., : max(D - 1, 1)]
        elif write == "accumulate":
            o[idx] += h
        elif write == "read_back":
            prev = o[(t - 1,) if time_first else (slice(None), t - 1)] if t else 0
            o[idx] = h + 0.5 * prev
        elif write == "index_put":
            o.index_put_((torch.tensor([t]),) if time_first else (torch.arange(o.shape[0]), torch.full((o.shape[0],), t)),
                         h[None] if time_first else h)

    def program(x, a, w):
        B = x.shape[0]
        h = torch.zeros(B, D, dtype=DT)
        shape = (T, B, D) if time_first else (B, T, D)
        o = torch.zeros(shape, dtype=DT)
        outs = []
        for t in range(T):
            h = step(h, a[:, t], x[:, t] * w)
            if branch and x.shape[1] % 2:     # a branch on a shape: dynamo specializes it
                h = h * 0.5
            if write == "list":
                outs.append(h)
            else:
                put(o, t, h)
        if write == "list":
            o = torch.stack(outs, 0 if time_first else 1)
        if nested:                            # an outer buffer filled row by row from the inner one
            outer = torch.empty_like(o)
            for i in range(o.shape[0]):
                outer[i] = o[i]
            o = outer
        y = o * w if readout else o
        return y.square().sum() + h.sum()

    return program


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 6), D=st.integers(1, 3), B=st.integers(1, 2), write=st.sampled_from(WRITES),
       time_first=st.booleans(), tanh=st.booleans(), branch=st.booleans(), nested=st.booleans(),
       readout=st.booleans(), shard_size=st.sampled_from([None, 1, 2, 3]))
@pytest.mark.slow
def test_buffer_writing_loops_equal_eager(T, D, B, write, time_first, tanh, branch, nested, readout, shard_size):
    program = make_program(T, D, write, time_first, tanh, branch, nested, readout)
    gen = torch.Generator().manual_seed(T * 100 + D * 10 + B)
    x = torch.randn(B, T, D, dtype=DT, generator=gen, requires_grad=True)
    a = torch.rand(B, T, D, dtype=DT, generator=gen, requires_grad=True)
    w = torch.randn(D, dtype=DT, generator=gen, requires_grad=True)
    want = program(x, a, w)
    gw = torch.autograd.grad(want, (x, a, w))
    torch._dynamo.reset()
    opts = {"inner": "eager", **({"shard_size": shard_size} if shard_size else {})}
    compiled = torch.compile(program, backend="adjoint", options=opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointCompileWarning)
        got = compiled(x, a, w)
    gg = torch.autograd.grad(got, (x, a, w))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10), (float(got), float(want))
    for name, g, r in zip("xaw", gg, gw):
        assert torch.allclose(g, r, rtol=1e-9, atol=1e-10), f"d/d{name}: {(g - r).abs().max()}"
