"""One compiled program per shard pattern (issue 34): the first shard gets zero tensors for absent carries (no h0,
a causal conv's padding, a token shift's fill) and the last shard zero adjoints, so that a sharded region compiles
one forward and one recompute + VJP program per shard length; only regions with previous-state readouts keep a
first-shard program, and put their remainder shard first, where it coincides with it.  Gradients stay exact."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import adjoint_compile as ac
import adjoint_compile.runtime.shard_program as shard_program
import adjoint_compile.runtime.shard_vjp as shard_vjp
from adjoint_compile.runtime.sharded import ShardedRegion, make_sharded
from test_lower_halo import ConvScan
from test_lower_shift_readout import PrevReadout
from test_lower_sharded import grads, region_inputs, stack_case
from test_capture_token_shift import TokenShiftStack
from test_lower_truncated import oracle_region, region_grads

S = 4
TS = [1, 7, 8]  # T = 1, odd T (a shorter shard), T divisible by S


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _counting(monkeypatch) -> dict[str, int]:
    n = {"fwd": 0, "vjp": 0}
    for mod, kind in ((shard_program, "fwd"), (shard_vjp, "vjp")):
        real = mod.compile_inner

        def counted(gm, ex, inner, _real=real, _kind=kind, **kw):
            n[_kind] += 1
            return _real(gm, ex, inner, **kw)
        monkeypatch.setattr(mod, "compile_inner", counted)
    return n


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T,want", [(12, 1), (14, 2), (3, 1)])  # T % S == 0: one program each; else one per length
def test_one_forward_and_one_vjp_program_per_shard_length(monkeypatch, T, want, with_h0):
    n = _counting(monkeypatch)
    case = stack_case(2, T, torch.float64, with_h0)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    region = ShardedRegion(sub, in_dims, out_dims, S, inner="aot_eager")
    outs, got = grads(region, region_inputs(case))
    ref_outs, ref = grads(sub, region_inputs(case))
    assert len(region._plan.compiled) == n["fwd"] == want
    assert len(region._plan.vjps) == n["vjp"] == want
    for a, b in zip([*outs, *got], [*ref_outs, *ref]):
        assert _rel(a, b) <= 1e-10
    # a second step compiles nothing more
    grads(region, region_inputs(case))
    assert (n["fwd"], n["vjp"]) == (want, want)


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T", TS)
def test_ssm_stack_gradients_equal_autograd(T, with_h0):
    case = stack_case(2, T, torch.float64, with_h0)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    outs, got = grads(make_sharded(sub, in_dims, out_dims, S), region_inputs(case))
    ref_outs, ref = grads(sub, region_inputs(case))
    for a, b in zip([*outs, *got], [*ref_outs, *ref]):
        assert _rel(a, b) <= 1e-10


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T", TS)
def test_truncated_gradients_equal_the_oracle(T, with_h0):
    case = stack_case(2, T, torch.float64, with_h0)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    outs, got = region_grads(make_sharded(sub, in_dims, out_dims, S, window=3), region_inputs(case))
    ref_outs, ref = region_grads(oracle_region(sub, 3), region_inputs(case))
    for a, b in zip([*outs, *got], [*ref_outs, *ref]):
        assert (a is None) == (b is None)
        assert a is None or _rel(a, b) <= 1e-10


def _compiled_grads(model: torch.nn.Module, x: torch.Tensor, *extra: torch.Tensor, inner: str = "eager"):
    """Output and gradients (parameters, x, extras) of backend="adjoint" and of eager autograd, fp64."""
    res = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        leaves = [t.detach().clone().requires_grad_() for t in (x, *extra)]
        torch._dynamo.reset()
        f = torch.compile(m, backend="adjoint", options={"inner": inner, "shard_size": S}) if compiled else m
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = f(*leaves)
            (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        res.append([y.detach(), *(p.grad for p in m.parameters()), *(t.grad for t in leaves)])
    return res


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        assert a is None or _rel(a, b) <= 1e-10


@pytest.mark.parametrize("first", ["h0", "zeros", "learned"])
@pytest.mark.parametrize("T", TS)
def test_previous_state_readout_gradients_equal_autograd(T, first):
    torch.manual_seed(0)
    # NB: fp64 by default: the model's zeros ``first`` is made with the default dtype (a narrower one is tested in
    # tests/test_lower_shift_readout.py)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = PrevReadout(first)
        x = torch.randn(2, T, 5)
        extra = (torch.randn(2, 5),) if first == "h0" else ()
        want, got = _compiled_grads(model, x, *extra)
    finally:
        torch.set_default_dtype(old)
    _assert_same(got, want)


@pytest.mark.parametrize("T", TS)
def test_causal_conv_gradients_equal_autograd(T):
    want, got = _compiled_grads(ConvScan().double(), torch.randn(2, T, 6, dtype=torch.float64))
    _assert_same(got, want)


@pytest.mark.parametrize("form", ["pad", "fill"])
@pytest.mark.parametrize("T", TS)
def test_token_shift_gradients_equal_autograd(T, form):
    want, got = _compiled_grads(TokenShiftStack(form).double(), torch.randn(2, T, 5, dtype=torch.float64))
    _assert_same(got, want)
