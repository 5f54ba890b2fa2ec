"""Dropout whose mask is a pure function of (seed, position): the same mask when a shard is recomputed.

A shard's recomputation in the backward must see the forward's dropout mask. Drawing it from torch's generator
would give a new one; saving it would keep a full-length tensor. Instead each element's keep/drop decision is a
hash of the per-call ``seed``, the dropout's ``stream`` (each dropout of a graph its own, so two dropouts never share a
mask) and the element's linear index in the *full-length* tensor, so the mask of steps [t0, t0 + L) is the same
whether it is made for the whole sequence, for a shard, or again in the backward:

    keep[i] = hash32(seed, stream, i) / 2^32 >= p          i = linear index of the element in the [.., T, ..] tensor
    out     = x * keep / (1 - p)

The hash is a 32-bit integer mixer in int64 arithmetic (no product exceeds 2^63, so eager, inductor and Triton
agree bit for bit). The distribution is Bernoulli(1 - p) per element as with ``F.dropout``, but the numbers are not
those of torch's generator: a model run with backend="adjoint" draws different masks than in eager mode (as
inductor's own RNG does). ``seed`` is drawn once per forward call from torch's default generator, so
``torch.manual_seed`` makes runs reproducible.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["hashed_dropout", "new_seed"]

_M32 = 0xFFFFFFFF


def new_seed() -> Tensor:
    """A fresh 31-bit seed (an int64 scalar tensor) from torch's default CPU generator."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64)


def _mix(x: Tensor) -> Tensor:
    # NB: multipliers < 2^31 on values < 2^32 keep every product below 2^63 (no signed overflow in C++/Triton)
    x = (x ^ (x >> 16)) * 0x7FEB352D & _M32
    x = (x ^ (x >> 15)) * 0x2C1B3C6D & _M32
    x = (x ^ (x >> 16)) * 0x297A2D39 & _M32
    return x ^ (x >> 15)


def _linear_index(x: Tensor, step_dim: int | None, t0: Tensor | int, T: int | None, fold: int = 1) -> Tensor:
    """Each element's linear index in the full-length tensor (``x`` itself when ``step_dim`` is None); ``fold``: the
    step dim holds ``fold`` sequences one after another (a batch folded into rows, ``[B·L, D]``), row b·L + t of the
    shard being row b·T + t0 + t of the full tensor."""
    shape = list(x.shape)
    full = list(shape)
    if step_dim is not None:
        full[step_dim] = T * fold
    stride, strides = 1, []
    for s in reversed(full):
        strides.append(stride)
        stride *= s
    strides.reverse()
    idx = torch.zeros((), dtype=torch.int64, device=x.device)
    for j, (n, st) in enumerate(zip(shape, strides)):
        ar = torch.arange(n, dtype=torch.int64, device=x.device)
        if j == step_dim:
            L = n // fold
            ar = (ar // L) * T + ar % L + t0 if fold > 1 else ar + t0
        view = [1] * len(shape)
        view[j] = n
        idx = idx + (ar * st).view(view)
    return idx


def hashed_dropout(x: Tensor, p: float, training: bool, seed: Tensor, t0: Tensor | int = 0,
                   step_dim: int | None = None, T: int | None = None, *, stream: int = 0, fold: int = 1) -> Tensor:
    """``F.dropout(x, p, training)`` with the mask ``hash(seed, stream, position) >= p`` (module docstring).

    Args:
        x: the input; with ``step_dim`` None, the whole sequence.
        seed: an int64 scalar tensor (:func:`new_seed`).
        t0: the global index of ``x``'s first step (a shard's start), an int or an int64 scalar tensor.
        step_dim, T: the step dim of ``x`` and the full sequence length, for a shard; None for the whole tensor.
        stream: which dropout of the graph this is (an int >= 0): dropouts sharing a seed draw independent masks.
        fold: for a shard whose step dim holds ``fold`` sequences' steps one after another (``[B·L, D]`` rows), the
            number of them: the mask is that of the full ``[B·T, D]`` tensor's rows.
    """
    if not training or p == 0:
        return x
    if p >= 1:
        return x * 0
    idx = _linear_index(x, step_dim, t0, T, fold)
    s = seed.to(device=x.device, dtype=torch.int64)
    if stream:  # NB: the stream's mix is a Python int (the mixer's ops are the same on ints): no tensor per call
        s = _mix(s ^ _mix(stream))
    h = _mix(_mix((idx & _M32) ^ s) ^ (idx >> 32))
    keep = h >= int(p * 2**32)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
