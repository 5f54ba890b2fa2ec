"""Pieces of the shard programs (:mod:`.shard_program`) that the sweeps share: the default shard size, the
autocast settings a program runs under, and a causal conv's halo in a shard."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

__all__ = ["MIN_SHARD_ELEMENTS", "default_shard_size", "wanted_shard_size", "autocast_state", "autocast_as"]


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
    return min(wanted_shard_size(T, step_elements), T)


def wanted_shard_size(T: int, step_elements: int = 0) -> int:
    """:func:`default_shard_size` before it is cut to T (a region of fewer steps runs as one shard of T)."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T={T!r}: expected a number of steps >= 1")
    S = max(1, math.isqrt(T - 1) + 1) if T > 1 else 1
    if step_elements > 0:
        S = max(S, -(-MIN_SHARD_ELEMENTS // step_elements))
    return S


def _prev_or_first(prev: torch.Tensor | None, first: torch.Tensor, d: int) -> torch.Tensor:
    """The step before a shard's first one in a previous-state readout: the carried state, or ``first`` in the
    sequence's first shard (where the readout gives its own ``first``)."""
    return first if prev is None else prev.unsqueeze(d).to(first.dtype)


def _with_halo(halo: torch.Tensor | None, x: torch.Tensor, p: int, d: int, fill: float = 0.0) -> torch.Tensor:
    """A causal conv's (or token shift's) shard input with the p steps before it: the carried halo, or ``fill``
    (zeros: the conv's padding) in the sequence's first shard."""
    if halo is None:
        shp = list(x.shape)
        shp[d] = p
        halo = x.new_full(shp, fill)
    return torch.cat([halo.to(x.dtype), x], d)


def _shifted(xp: torch.Tensor, p: int, d: int) -> torch.Tensor:
    """A token shift of a shard from its padded input ``cat(halo, x)``: its first L steps (out_t = x_{t-p})."""
    return xp.narrow(d, 0, xp.shape[d] - p)


def _halo_out(xp: torch.Tensor, p: int, d: int) -> torch.Tensor:
    """The halo the next shard reads: the last p steps of this shard's padded conv input.

    NB: a copy, not a view: a view would keep the whole padded shard alive in the saved boundary carries, and its
    strides (which depend on the shard's length) would not match those a compiled program was specialized to."""
    return xp.narrow(d, xp.shape[d] - p, p).contiguous()


_AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types whose autocast settings a shard program depends on


def autocast_state() -> tuple:
    """The autocast settings in effect, per device type: (device type, enabled, dtype).

    A shard program traced or compiled under autocast has its casts baked in, so the settings are part of the
    caches' keys; and a shard's recomputation in the backward runs under the forward's settings
    (:func:`autocast_as`), as ``torch.utils.checkpoint`` does, so that the VJP is that of the forward that ran.
    """
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Run under the autocast settings ``state`` (from :func:`autocast_state`)."""
    with contextlib.ExitStack() as stack:
        for (device, enabled, dtype), (_, now, now_dtype) in zip(state, autocast_state()):
            if (enabled, dtype) != (now, now_dtype):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
