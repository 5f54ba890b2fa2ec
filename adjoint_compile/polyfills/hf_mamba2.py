"""transformers' ``mamba2_chunk_scan`` (Mamba2ForCausalLM's pure-torch SSD path) as one scan.

The library's function computes Mamba2's selective SSM in the chunked "state-space dual" form: within each chunk a
masked (chunk x chunk) matrix exp(segsum(A dt)), across chunks a dense (T/chunk)² decay matrix. No recurrence is
left in the graph for a matcher to prove. Per head it is the recurrence

    h_t = exp(A dt_t) h_{t-1} + (dt_t x_t) ⊗ B_t      (h: [head_dim, state], h_{-1} = initial_states or 0)
    y_t = h_t C_t + D x_t

which :func:`chunk_scan` writes with one :func:`adjoint_compile.ops.linear_scan` along T. Same values up to
rounding (the chunked form sums in a different order): :func:`check` compares both eagerly.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import linear_scan
from . import active
from .common import checked, flag_cases, output_error

NAME = "mamba2_chunk_scan"
ORIGINS = {__file__: "adjoint-compile's polyfill for transformers' "
                     "mamba2_chunk_scan (Mamba2ForCausalLM and its copies)"}
TOL = 1e-5


def chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
               dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False) -> Any:
    """The library function's result (x [b, T, h, p], dt [b, T, h], A [h], B, C [b, T, g, n]) by a scan along T."""
    num_heads = hidden_states.shape[2]
    num_groups = B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states.float()
    B = B.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    C = C.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    xdt = x * dt[..., None].float()                                     # [b, T, h, p]
    decay = torch.exp(A.to(x.dtype) * dt.float())                       # [b, T, h]
    inp = xdt[..., :, None] * B[..., None, :]                           # [b, T, h, p, n]
    h0 = initial_states.to(dtype=inp.dtype) if initial_states is not None else None
    states = linear_scan(decay[..., None, None].expand_as(inp), inp, h0, dim=1)
    output = (states * C[..., None, :]).sum(-1)                         # [b, T, h, p]
    if D is not None:
        output = output + D[..., None] * x
    if return_final_states:
        return output, states[:, -1]
    return output


def check(original: Any, *, T: int = 7, chunk: int = 4, seed: int = 0) -> float:
    """Max rel. error of :func:`chunk_scan` against ``original`` (eager; flags (:func:`~.common.flag_cases`), initial
    state, padding, groups)."""
    g = torch.Generator().manual_seed(seed)
    b, h, p, grp, n, worst = 2, 4, 3, 2, 5, 0.0
    r = functools.partial(torch.randn, generator=g)
    x, dt, Bm, Cm = r(b, T, h, p), r(b, T, h), r(b, T, grp, n), r(b, T, grp, n)
    A, Dv, bias, init = -torch.rand(h, generator=g) - 0.1, r(h), r(h), r(b, h, p, n)
    for use_d, use_bias, softplus, use_init, last, limit in flag_cases(6):
        kw = dict(D=Dv if use_d else None, dt_bias=bias if use_bias else None, dt_softplus=bool(softplus),
                  initial_states=init if use_init else None, return_final_states=bool(last),
                  dt_limit=(0.01, 0.6) if limit else (0.0, float("inf")))
        dtx = dt if softplus else dt.abs() * 0.5
        want = original(x, dtx, A, Bm, Cm, chunk, **kw)
        got = chunk_scan(x, dtx, A, Bm, Cm, chunk, **kw)
        worst = max(worst, output_error(want, got, bool(last)))
    return worst


def register(module: types.ModuleType) -> str:
    """Register the polyfill for ``module.mamba2_chunk_scan``'s torch function; returns what was done."""
    got = checked(module, NAME, ["hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states",
                                 "dt_softplus", "dt_limit", "return_final_states", "kwargs"],
                  lambda f: max(check(f, T=T, chunk=c) for T, c in ((1, 4), (7, 4), (8, 4), (13, 16))), TOL, NAME)
    if isinstance(got, str):
        return got
    original, traced_original, err = got

    @torch._dynamo.substitute_in_graph(original, skip_signature_check=True)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,  # noqa: ANN001, ANN202
                          initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                          return_final_states=False, **kwargs):
        if kwargs or not active():
            return traced_original(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus,
                                   dt_limit, return_final_states, **kwargs)
        return chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
                          return_final_states)

    return f"registered for {module.__name__}.{NAME} (checked: max rel. error {err:.1e})"
