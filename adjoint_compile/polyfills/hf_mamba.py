"""transformers' ``mamba_selective_scan`` (MambaForCausalLM's pure-torch path) with its recurrence as one scan.

The library's function discretizes (dA = exp(A ⊙ dt), dBu = dt ⊙ B ⊙ x), runs h_t = dA_t ⊙ h_{t-1} + dBu_t from
zeros, reads y_t = h_t · C_t, and adds D ⊙ x and the silu(z) gate. It runs the recurrence as a Python loop over T
(dynamo unrolls it: T copies of the step in the graph, and a first compile that grows with T) or, under
torch.compile with ``use_associative_scan``, as ``associative_scan``, which dynamo inlines on CPU into log2(T) levels
of vmapped combines that no matcher can read back. :func:`selective_scan` is the same computation, op for op except
the recurrence, which is one :func:`adjoint_compile.ops.linear_scan`. The mambapy path (``use_mambapy`` with mambapy
installed) is left to the library.
"""
from __future__ import annotations

import functools
import itertools
import types
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import linear_scan
from . import active
from .common import checked, output_error

NAME = "mamba_selective_scan"
ORIGINS = {__file__: "adjoint-compile's polyfill for transformers' "
                     "mamba_selective_scan (MambaForCausalLM and its copies)"}
TOL = 1e-5


def selective_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                   delta_softplus: bool = False, return_last_state: bool = False) -> Any:
    """The library function's math (its layout: x, dt, z [B, D, T]; A [D, N]; B, C [B, N, T]), scan included."""
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
    states = linear_scan(discrete_A, deltaB_u, dim=2)  # [B, D, T, N]: h_t = dA_t * h_{t-1} + dBu_t, h_{-1} = 0
    scan_output = torch.matmul(states.transpose(1, 2).to(input_dtype), C.unsqueeze(-1))
    scan_output = scan_output.squeeze(-1).transpose(1, 2)
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, states[:, :, -1]
    return scan_output


def _mambapy(module: types.ModuleType) -> bool:
    check = getattr(module, "is_mambapy_available", None)
    return bool(check()) if callable(check) else False


def check(original: Any, *, T: int = 7, seed: int = 0) -> float:
    """Max rel. error of :func:`selective_scan` against ``original`` (eager, every flag combination, odd T)."""
    g = torch.Generator().manual_seed(seed)
    b, d, n, worst = 2, 3, 4, 0.0
    r = functools.partial(torch.randn, generator=g)
    x, dt, z = r(b, d, T), r(b, d, T), r(b, d, T)
    A, Bm, Cm, Dv, bias = -torch.rand(d, n, generator=g) - 0.1, r(b, n, T), r(b, n, T), r(d), r(d)
    for use_d, use_z, use_bias, softplus, last in itertools.product((0, 1), repeat=5):
        kw = dict(D=Dv if use_d else None, z=z if use_z else None, delta_bias=bias if use_bias else None,
                  delta_softplus=bool(softplus), return_last_state=bool(last))
        dtx = dt if softplus else dt.abs() * 0.5  # a decay in (0, 1] either way
        want = original(x, dtx, A, Bm, Cm, **kw)
        got = selective_scan(x, dtx, A, Bm, Cm, **kw)
        worst = max(worst, output_error(want, got, bool(last)))
    return worst


def register(module: types.ModuleType) -> str:
    """Register the polyfill for ``module.mamba_selective_scan``'s torch function; returns what was done."""
    got = checked(module, NAME, ["hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                                 "return_last_state", "use_mambapy", "use_associative_scan", "kwargs"],
                  lambda f: max(check(f, T=T) for T in (1, 7)), TOL, NAME)
    if isinstance(got, str):
        return got
    original, traced_original, err = got
    mambapy = _mambapy(module)

    @torch._dynamo.substitute_in_graph(original, skip_signature_check=True)
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,  # noqa: ANN001, ANN202
                             delta_softplus=False, return_last_state=False, use_mambapy=False,
                             use_associative_scan=False, **kwargs):
        if kwargs or (use_mambapy and mambapy) or not active():
            return traced_original(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                                   use_mambapy, use_associative_scan, **kwargs)
        return selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)

    return f"registered for {module.__name__}.{NAME} (checked: max rel. error {err:.1e})"
