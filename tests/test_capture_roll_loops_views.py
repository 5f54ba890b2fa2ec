"""Loops whose step reads views of one tensor, or makes complex values: the loop roller (polyfills/loops.py) traced
them as torch's scan, which refuses both, and the compile raised (UncapturedHigherOrderOpError "input-to-input
aliasing"; "view_as_complex_copy does not support automatic differentiation"). Views the step reads are now passed
to the scan as copies; a step that makes complex values runs unrolled. Against eager autograd in fp64.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.polyfills import loops
from helpers import compiled_matches_eager

N, B, T = 4, 2, 7


class Unbound(nn.Module):
    """``decay, gain = sigmoid(p).unbind(0)``: two views of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(2, N))

    def forward(self, x):
        decay, gain = torch.sigmoid(self.p).unbind(0)
        h, ys = torch.zeros(x.shape[0], N, dtype=x.dtype), []
        for t in range(x.shape[1]):
            h = decay * h + gain * x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)


class RealImag(nn.Module):
    """An S5-style pair of real states rotated by ``lam.real`` and ``lam.imag`` (two views of one complex tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.nu, self.theta = nn.Parameter(torch.rand(N)), nn.Parameter(torch.rand(N))

    def forward(self, x):
        lam = torch.exp(torch.complex(-self.nu, self.theta))
        lr, li = lam.real, lam.imag
        re, im, ys = torch.zeros(x.shape[0], N, dtype=x.dtype), torch.zeros(x.shape[0], N, dtype=x.dtype), []
        for t in range(x.shape[1]):
            re, im = lr * re - li * im + x[:, t], li * re + lr * im
            ys.append(re)
        return torch.stack(ys, 1)


class ViewOfTheInput(nn.Module):
    """The step reads the input whole, a slice of it and its per-step slices."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(N))

    def forward(self, x):
        decay, first = torch.sigmoid(self.p), x[:, 0]
        h, ys = torch.zeros(x.shape[0], N, dtype=x.dtype), []
        for t in range(x.shape[1]):
            h = decay * h + x[:, t] + 0.1 * first + 0.01 * x.sum(1)
            ys.append(h)
        return torch.stack(ys, 1)


class MadeComplex(nn.Module):
    """A complex readout made in the step (``view_as_complex``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lr, self.li = nn.Parameter(torch.rand(N) * 0.9), nn.Parameter(torch.rand(N) * 0.3)
        self.c = nn.Parameter(torch.randn(N, dtype=torch.complex128))

    def forward(self, x):
        re, im, ys = torch.zeros(x.shape[0], N, dtype=x.dtype), torch.zeros(x.shape[0], N, dtype=x.dtype), []
        for t in range(x.shape[1]):
            re, im = self.lr * re - self.li * im + x[:, t], self.li * re + self.lr * im
            ys.append((torch.view_as_complex(torch.stack([re, im], -1)) * self.c).real)
        return torch.stack(ys, 1)


def _exact(cls: type) -> object:
    torch.manual_seed(0)
    return compiled_matches_eager(cls().double(), torch.randn(B, T, N, dtype=torch.float64),
                                  loss=lambda y: y.square().mean())


@pytest.mark.parametrize("cls", [Unbound, ViewOfTheInput])
def test_views_the_step_reads_roll_and_shard(cls):
    f = _exact(cls)
    (loop,) = loops.rolled()[f"{cls.__name__}.forward"]
    assert loop.rolled, loop
    assert [(r.source, r.rewrite) for r in ac.report(f).regions] == [("scan", "adjoint")], str(ac.report(f))


def test_real_and_imaginary_parts_roll():
    """Rolled (a coupled pair of states is not one diagonal recurrence, so nothing is sharded), and exact."""
    _exact(RealImag)
    (loop,) = loops.rolled()["RealImag.forward"]
    assert loop.rolled, loop


def test_a_step_that_makes_complex_values_runs_unrolled():
    _exact(MadeComplex)
    (loop,) = loops.rolled()["MadeComplex.forward"]
    assert not loop.rolled and "view_as_complex" in loop.reason, loop


class NoneAfterT(nn.Module):
    """A matrix state indexed ``a[:, t, :, None]`` and read out with ``x[:, t, ..., None]`` (mLSTM's recurrent
    form): the roller refused an ellipsis or None after t."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(N, N), nn.Linear(N, N)

    def forward(self, x):
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        C, outs = torch.zeros(x.shape[0], N, N, dtype=x.dtype), []
        for t in range(x.shape[1]):
            C = a[:, t, :, None] * C + b[:, t, :, None] * b[:, t, None, :]
            outs.append((C @ x[:, t, ..., None])[..., 0])
        return torch.stack(outs, 1)


def test_an_index_with_none_or_an_ellipsis_after_t_rolls():
    f = _exact(NoneAfterT)
    (loop,) = loops.rolled()["NoneAfterT.forward"]
    assert loop.rolled, loop
    assert [(r.source, r.rewrite) for r in ac.report(f).regions] == [("scan", "adjoint")], str(ac.report(f))
