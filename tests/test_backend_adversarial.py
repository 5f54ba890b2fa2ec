"""The backend probed as a user and a fuzzer would: many sequence lengths, concurrent first calls, autocast,
dynamic=True, bad options twice in a row. Each case ends in values and gradients equal to eager autograd on the same
model, or in a clear error of ours, never in a crash deep in torch."""
from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch

import adjoint_compile as ac
from adjoint_compile import backend

ROOT = Path(__file__).resolve().parent.parent


def _ssm():
    spec = importlib.util.spec_from_file_location("example_selective_ssm", ROOT / "examples" / "selective_ssm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _grads(f, model, x):
    """Output and the gradients of every parameter and of the input, of sum(f(x) * w) with a fixed w."""
    x = x.detach().requires_grad_()
    out = f(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    return [out.detach(), *torch.autograd.grad((out.float() * w).sum(), [*params, x])]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def _assert_close(got, ref, tol=1e-5):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert _rel(a, b) <= tol, (i, _rel(a, b))


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.slow
def test_more_lengths_than_dynamos_recompile_limit_keep_the_rewrite(inner, caplog):
    """More distinct lengths than dynamo's recompile limit (8) all run the rewrite: one symbolic graph serves them
    (there was a limit of 8 specializations, past which the symbolic graph ran with ordinary autograd)."""
    torch.manual_seed(0)
    model = _ssm().SSMStack(d_model=8, d_state=3, n_layers=2)
    f = torch.compile(model, backend="adjoint", options={"inner": inner, "shard_size": 4})
    lengths = (10, 12, 14, 16, 18, 12, 20, 22, 24, 26, 28, 30, 11)
    with caplog.at_level("WARNING", logger="adjoint_compile"):
        for T in lengths:
            x = torch.randn(2, T, 8)
            _assert_close(_grads(f, model, x), _grads(model, model, x))
    assert "ordinary autograd" not in caplog.text
    graphs = ac.report(f).compiled
    # T = 10 static, then one symbolic graph for all the others (and the specialization it was lowered from)
    assert sum(1 for g in graphs if g.lowered) == 3


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.slow
def test_concurrent_first_calls_compile_once_each_and_give_exact_gradients(inner):
    """Two threads make the first calls of one compiled model at once (T = 24 and 30, forward and backward). The
    run-time compiles (FX tracing, fake propagation, make_fx, aot_autograd) take turns under dynamo's compile lock;
    without it both threads crashed in torch (functorch levels, FX's patcher)."""
    for round_ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(round_)
        model = _ssm().SSMStack(d_model=8, d_state=3, n_layers=2)
        f = torch.compile(model, backend="adjoint", options={"inner": inner, "shard_size": 4})
        xs = {T: torch.randn(2, T, 8) for T in (24, 30)}
        got, errors = {}, []

        def work(T):
            try:
                got[T] = _grads(f, model, xs[T])
            except Exception as e:  # noqa: BLE001 - reported below with the thread's length
                errors.append(f"T={T}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(T,)) for T in xs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for T, x in xs.items():
            _assert_close(got[T], _grads(model, model, x))


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_autocast_recomputes_shards_under_the_forwards_settings(inner):
    """Under torch.autocast the forward ran in bf16; the backward's shard recomputation must too (as
    torch.utils.checkpoint does), else the VJP is that of another function: the gradients were 3-5% off eager
    autocast's. Now they differ by bf16 rounding only (fp32 sums over shards)."""
    torch.manual_seed(0)
    model = _ssm().SSMStack(d_model=8, d_state=3, n_layers=2)
    f = torch.compile(model, backend="adjoint", options={"inner": inner, "shard_size": 4})
    x = torch.randn(2, 13, 8)

    def under_autocast(fn):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x)
        return run

    got = _grads(under_autocast(f), model, x)
    ref = _grads(under_autocast(model), model, x)
    _assert_close(got, ref, tol=1.5e-2)
    (cg,) = ac.report(f).compiled
    region = cg.captured.gm.get_submodule(cg.lowered[0])
    assert any(("cpu", True, torch.bfloat16) in key[2] for key in region._plan.vjps)  # recomputed under autocast


def test_dynamic_true_with_a_python_loop_is_rerolled_per_length():
    def loop(x, W, h):
        outs = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(x[:, t] @ W) * h + x[:, t]
            outs.append(h)
        return torch.stack(outs, 1)

    W = torch.randn(4, 4, requires_grad=True)
    f = torch.compile(loop, backend="adjoint", dynamic=True, options={"inner": "eager", "shard_size": 3})
    for T in (5, 8):
        x, h = torch.randn(2, T, 4, requires_grad=True), torch.zeros(2, 4)
        out = f(x, W, h)
        ref = loop(x, W, h)
        g = torch.autograd.grad(out.sum(), [x, W])
        gr = torch.autograd.grad(ref.sum(), [x, W])
        _assert_close([out, *g], [ref, *gr])
    rows = [r for c in ac.report(f).compiled for r in c.regions if r.kind == "linear_recurrence"]
    # NB: the loop rolls (source scan; its two peeled steps show as a short unrolled loop) and range() specializes T
    assert {r.source for r in rows} <= {"scan", "unrolled_loop"}
    assert {r.length for r in rows if r.rewrite == "adjoint"} == {5, 8}, [(r.length, r.rewrite) for r in rows]


def test_bad_options_raise_every_time_and_a_good_compile_still_works():
    model = _ssm().SSMStack(d_model=8, d_state=3, n_layers=1)
    x = torch.randn(2, 6, 8)
    bad = torch.compile(model, backend="adjoint", options={"mode": "exactly"})
    for _ in range(2):  # NB: the second call must not find a cached fallback and run silently
        with pytest.raises(ValueError, match="'mode'='exactly'"):
            bad(x)
    good = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 2})
    _assert_close(_grads(good, model, x), _grads(model, model, x))


def test_the_removed_devices_option_and_sequence_parallel_without_distributed_are_refused():
    for value in (["cpu"], ["cuda:0", "cuda:1"]):
        with pytest.raises(ac.OptionsError) as info:
            ac.validate_options({"devices": value})
        msg = str(info.value)
        assert f"'devices'={value!r} no longer exists" in msg and "'sequence_parallel'" in msg and "torchrun" in msg
    with pytest.raises(ac.OptionsError, match="init_process_group"):
        ac.validate_options({"sequence_parallel": True})


class _RMSNorm(torch.nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _NormScan(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = _RMSNorm(8), torch.nn.Linear(8, 16)

    def forward(self, x):
        a, b = self.proj(self.norm(x)).chunk(2, -1)
        return ac.ops.linear_scan(torch.sigmoid(a), b)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_dynamic_true_with_a_float_attribute_is_specialized_and_sharded(inner):
    """dynamic=True turns the float eps into a 0-dim tensor input read with .item(): specialization failed on it
    (DataDependentOutputException) and the model kept ordinary autograd. Now the read stays a run-time value, so a
    changed eps is used without a recompile."""
    torch.manual_seed(0)
    model = _NormScan()
    f = torch.compile(model, backend="adjoint", dynamic=True, options={"inner": inner, "shard_size": 4})
    for T, eps in ((9, 1e-5), (12, 1e-5), (12, 0.5)):
        model.norm.eps = eps
        x = torch.randn(2, T, 8)
        _assert_close(_grads(f, model, x), _grads(model, model, x))
    lowered = [g for g in ac.report(f).compiled if g.lowered]
    assert len(lowered) == 2  # one specialization per length, each sharded
