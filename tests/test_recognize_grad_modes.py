"""Ops the compiled code runs under a grad mode or an autocast it sets itself (``with torch.no_grad():`` around a
target or a frozen gate, ``torch.autocast(..., enabled=False)`` around an fp32 block) stay out of sharded regions:
a region's shard programs run under the call's own modes, so inside one those ops were differentiated (gradients
for parameters eager leaves at None, a wrong input gradient) or cast (an fp32 block computed in bf16). Each case
against eager autograd in fp64 (the autocast case against aot_eager, bit for bit)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac


def _no_grad(how: str, fn, x):
    if how == "no_grad":
        with torch.no_grad():
            return fn(x)
    if how == "set_grad_enabled":
        with torch.set_grad_enabled(False):
            return fn(x)
    return torch.no_grad()(fn)(x)


class Gated(nn.Module):
    """A recurrence whose decay comes from a gate computed without gradient; ``loop``: written as a Python loop."""

    def __init__(self, how: str = "no_grad", loop: bool = True, d: int = 8) -> None:
        super().__init__()
        self.how, self.loop = how, loop
        self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = _no_grad(self.how, lambda v: torch.sigmoid(self.a(v)), x)
        b = self.b(x)
        if not self.loop:
            return self.o(ac.ops.linear_scan(a, b, dim=1))
        h, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            outs.append(h)
        return self.o(torch.stack(outs, 1))


def _grads(f, model, x0):
    x = x0.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = f(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _against_eager(module: nn.Module):
    """``module`` in fp64 compiled (shards of 4) and eager on one input: output and input gradient checked; returns
    both runs' parameter gradients by name and the report. Its one recurrence must be rewritten."""
    torch.manual_seed(0)
    model = module.double()
    ref = copy.deepcopy(model)
    x0 = torch.randn(2, 17, 8, dtype=torch.float64)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": 4})
    y, gx, gp = _grads(f, model, x0)
    want_y, want_gx, want_gp = _grads(ref, ref, x0)
    rep = ac.report(f)
    assert [r.rewrite for r in rep.regions if r.kind == "linear_recurrence"] == ["adjoint"]
    assert (y - want_y).abs().max() <= 1e-12 * want_y.abs().max()
    assert (gx - want_gx).norm() <= 1e-10 * want_gx.norm()
    return gp, want_gp, rep


@pytest.mark.parametrize("how", ["no_grad", "set_grad_enabled", "decorator"])
@pytest.mark.parametrize("loop", [True, False])
def test_a_gate_under_no_grad_is_not_differentiated(how, loop):
    gp, want_gp, _ = _against_eager(Gated(how, loop))
    for name, g in gp.items():
        w = want_gp[name]
        assert (g is None) == (w is None), name              # the gate's weights: None, as in eager
        assert g is None or (g - w).norm() <= 1e-10 * w.norm(), name


def test_a_scan_under_no_grad_is_left_to_autograd_and_says_why():
    class Frozen(nn.Module):
        def __init__(self, d: int = 8) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            with torch.no_grad():
                target = ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x), dim=1)
            return (self.b(x) - target).square().mean()
    torch.manual_seed(0)
    model = Frozen().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 17, 8, dtype=torch.float64)
    rep = ac.explain(model, x, options={"inner": "aot_eager", "shard_size": 4})
    (row,) = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert row.rewrite != "adjoint" and "set_grad_enabled(False)" in str(rep), str(rep)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(x)
    want = ref(x)
    got.backward()
    want.backward()
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    assert model.a.weight.grad is None and ref.a.weight.grad is None
    assert (model.b.weight.grad - ref.b.weight.grad).norm() <= 1e-10 * ref.b.weight.grad.norm()


class Fp32Block(nn.Module):
    """An SSM layer that computes its decay in fp32 with autocast disabled, as SSM code does, under an outer bf16
    autocast; ``block=False``: the same without the fp32 block (what autocast alone would compute)."""

    def __init__(self, block: bool = True, d: int = 16) -> None:
        super().__init__()
        self.block = block
        self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        if self.block:
            with torch.autocast("cpu", enabled=False):
                a = torch.sigmoid(self.a(x.float()))
        else:
            a = torch.sigmoid(self.a(x))
        return self.o(ac.ops.linear_scan(a.float(), self.b(x).float(), dim=1))


def test_an_fp32_block_inside_autocast_stays_fp32():
    torch.manual_seed(0)
    base, x = Fp32Block(), torch.randn(2, 64, 16)

    def run(model, backend, **kw):
        torch._dynamo.reset()
        f = torch.compile(model, backend=backend, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = f(x)
        y.float().square().sum().backward()
        return y.detach().float(), model.a.weight.grad, f
    want, want_g, _ = run(copy.deepcopy(base), "aot_eager")
    got, got_g, f = run(copy.deepcopy(base), "adjoint", options={"inner": "aot_eager", "shard_size": 8})
    assert [r.rewrite for r in ac.report(f).regions if r.kind == "linear_recurrence"] == ["adjoint"]
    assert torch.equal(got, want)                             # the fp32 block as compiled code runs it
    assert (got_g - want_g).norm() <= 1e-5 * want_g.norm()
    plain = Fp32Block(block=False)
    plain.load_state_dict(base.state_dict())
    assert not torch.equal(run(plain, "aot_eager")[0], want)  # the block matters: the check above can fail


def test_a_tensor_hook_on_an_intermediate_is_honoured_and_the_check_steps_aside():
    """``b.register_hook(...)`` on a value the region reads: the first-call check runs the graph as captured without
    autograd, where registering a hook raises (it crashed the call); the check is skipped, said in the report's
    compile-time line, and the hook applies as in eager."""
    class Hooked(nn.Module):
        def __init__(self, d: int = 8) -> None:
            super().__init__()
            self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            b = self.b(x)
            b.register_hook(lambda g: g * 0.5)
            return self.o(ac.ops.linear_scan(torch.sigmoid(self.a(x)), b, dim=1))
    gp, want_gp, rep = _against_eager(Hooked())
    assert "first-call check skipped (the graph as captured does not run without autograd)" in str(rep), str(rep)
    for name, g in gp.items():
        assert (g - want_gp[name]).norm() <= 1e-10 * want_gp[name].norm(), name
