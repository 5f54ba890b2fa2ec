"""mambapy's sequential selective scan (``MambaBlock.selective_scan_seq``, the ``pscan=False`` path) with its
recurrence as one scan.

The library method discretizes (dA = exp(Δ ⊙ A), BX = Δ ⊙ B ⊙ x), runs h_t = dA_t ⊙ h_{t-1} + BX_t from zeros as a
Python loop over L (dynamo unrolls it: L copies of the step in the graph, and a first compile that grows with L),
stacks the states, reads y_t = h_t · C_t and adds D ⊙ x. :func:`selective_scan_seq` is the same computation, op for
op except the loop, which is one :func:`adjoint_compile.ops.linear_scan`. Its zeros start in the default dtype, as
the library's ``torch.zeros`` does, so the states have the library's dtype under autocast too.

NB: dynamo honours ``substitute_in_graph`` for functions, not for methods looked up on a module (it traces a Python
method's own code). So registration also puts a forwarder on the class, ``MambaBlock.selective_scan_seq(self, ...)
= original(self, ...)``: eagerly it runs the library's code unchanged; while dynamo traces it, the call to the
(polyfilled) original function is what gets substituted. The forwarder keeps the original as ``__wrapped__``.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch

from ..ops import linear_scan
from . import active
from .common import checked, output_error

NAME = "MambaBlock.selective_scan_seq"
ORIGINS = {__file__: "adjoint-compile's polyfill for mambapy's MambaBlock.selective_scan_seq (pscan=False)"}
TOL = 1e-5


def selective_scan_seq(self: Any, x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """The library method's math (x, Δ [B, L, ED]; A [ED, N]; B, C [B, L, N]; D [ED]) with the loop as a scan."""
    deltaA = torch.exp(delta.unsqueeze(-1) * A)  # [B, L, ED, N]
    deltaB = delta.unsqueeze(-1) * B.unsqueeze(2)  # [B, L, ED, N]
    BX = deltaB * (x.unsqueeze(-1))  # [B, L, ED, N]
    # NB: the library's h starts as torch.zeros(...) in the default dtype and type promotion carries it through
    state = torch.promote_types(torch.promote_types(deltaA.dtype, BX.dtype), torch.get_default_dtype())
    hs = linear_scan(deltaA.to(state), BX.to(state), dim=1)  # [B, L, ED, N]: h_t = dA_t h_{t-1} + BX_t, h_{-1} = 0
    y = (hs @ C.unsqueeze(-1)).squeeze(3)  # [B, L, ED]
    return y + D * x


class _Config:
    def __init__(self, d_inner: int, d_state: int) -> None:
        self.d_inner, self.d_state = d_inner, d_state


def check(original: Any, *, T: int = 7, seed: int = 0) -> float:
    """Max rel. error of :func:`selective_scan_seq` against ``original`` (eager, odd T)."""
    g = torch.Generator().manual_seed(seed)
    b, ed, n = 2, 3, 4
    r = functools.partial(torch.randn, generator=g)
    x, delta, Bm, Cm, Dv = r(b, T, ed), torch.rand(b, T, ed, generator=g), r(b, T, n), r(b, T, n), r(ed)
    A = -torch.rand(ed, n, generator=g) - 0.1
    fake_self = types.SimpleNamespace(config=_Config(ed, n))
    return output_error(original(fake_self, x, delta, A, Bm, Cm, Dv),
                        selective_scan_seq(fake_self, x, delta, A, Bm, Cm, Dv), False)


def register(module: types.ModuleType) -> str:
    """Register the polyfill for ``module.MambaBlock.selective_scan_seq``; returns what was done."""
    block = getattr(module, "MambaBlock", None)
    if block is None:
        return f"not registered: {module.__name__} has no MambaBlock"
    got = checked(block, "selective_scan_seq", ["self", "x", "delta", "A", "B", "C", "D"],
                  lambda f: max(check(f, T=T) for T in (1, 7)), TOL, NAME, module=module.__name__)
    if isinstance(got, str):
        return got
    original, traced_original, err = got

    @torch._dynamo.substitute_in_graph(original, skip_signature_check=True)
    def mambapy_selective_scan_seq(self, x, delta, A, B, C, D):  # noqa: ANN001, ANN202
        if not active():
            return traced_original(self, x, delta, A, B, C, D)
        return selective_scan_seq(self, x, delta, A, B, C, D)

    @functools.wraps(original)
    def forwarder(self, x, delta, A, B, C, D):  # noqa: ANN001, ANN202
        return original(self, x, delta, A, B, C, D)

    block.selective_scan_seq = forwarder
    return f"registered for {module.__name__}.{NAME} (checked: max rel. error {err:.1e})"
