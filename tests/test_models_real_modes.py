"""Every real implementation of issue 10 under bf16 autocast and under ``dynamic=True``, against the same model
compiled with aot_eager (autocast) or run eagerly (dynamic): mambapy's Mamba (pscan and its sequential loop),
transformers' MambaForCausalLM and Mamba2ForCausalLM (tiny configs, no weights), and a mingru-pytorch stack."""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch

import adjoint_compile as ac


def _mambapy(pscan: bool) -> tuple[torch.nn.Module, Callable, torch.Tensor]:
    mamba = pytest.importorskip("mambapy.mamba")
    torch.manual_seed(0)
    m = mamba.Mamba(mamba.MambaConfig(d_model=8, n_layers=2, d_state=4, pscan=pscan))
    return m, lambda mod, x: mod(x), torch.randn(2, 21, 8)


def _hf(which: str) -> tuple[torch.nn.Module, Callable, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if which == "mamba":
        cfg = transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                       conv_kernel=4)
        m = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2,
                                        num_heads=4, head_dim=8, n_groups=1, expand=2, chunk_size=8)
        m = transformers.Mamba2ForCausalLM(cfg)
    return m, lambda mod, i: mod(i).logits, torch.randint(0, 32, (2, 21), generator=torch.Generator().manual_seed(1))


def _mingru() -> tuple[torch.nn.Module, Callable, torch.Tensor]:
    mingru = pytest.importorskip("minGRU_pytorch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(mingru.minGRU(16), mingru.minGRU(16))
    return m, lambda mod, x: mod(x), torch.randn(2, 21, 16)


TARGETS = {"mambapy-pscan": lambda: _mambapy(True), "mambapy-seq": lambda: _mambapy(False),
           "hf-mamba": lambda: _hf("mamba"), "hf-mamba2": lambda: _hf("mamba2"), "mingru": _mingru}


def _step(model: torch.nn.Module, call: Callable, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = call(model, x)
    (out.float().pow(2).mean() + out.float().sum() * 1e-2).backward()
    return out.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))


def _compare(want: tuple, got: tuple, tol: float) -> None:  # outputs and every parameter's gradient
    (wo, wg), (go, gg) = want, got
    assert _rel(go, wo) <= tol
    assert wg.keys() == gg.keys() and wg
    errs = {n: _rel(gg[n], wg[n]) for n in wg}
    assert max(errs.values()) <= tol, errs


def _rewritten(f: Callable) -> int:
    return sum(r.rewrite == "adjoint" for r in ac.report(f).regions if r.kind == "linear_recurrence")


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.slow
def test_bf16_autocast_as_accurate_as_aot_eager(name):
    """Under CPU bf16 autocast the shards recompute with the forward's autocast settings. Measured against the fp32
    eager step, the adjoint's output and every gradient are as accurate as aot_eager's of the same model under the
    same autocast (within 2x its error + 1e-2: the scans may round in another order)."""
    model, call, x = TARGETS[name]()
    twin = copy.deepcopy(model)
    ref = _step(model, call, x)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        aot = _step(twin, torch.compile(call, backend="aot_eager"), x)
    torch._dynamo.reset()
    f = torch.compile(call, backend="adjoint", options={"inner": "aot_eager", "shard_size": 5})
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _step(model, f, x)
    assert _rewritten(f) == 2, str(ac.report(f))
    assert _rel(got[0], ref[0]) <= 2 * _rel(aot[0], ref[0]) + 1e-2
    assert got[1].keys() == ref[1].keys() == aot[1].keys()
    for n in ref[1]:
        assert _rel(got[1][n], ref[1][n]) <= 2 * _rel(aot[1][n], ref[1][n]) + 1e-2, n


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.slow
def test_dynamic_true_matches_eager_at_two_lengths(name):
    """``torch.compile(dynamic=True)``: one symbolic graph, specialized and sharded per call's length; exact."""
    model, call, x = TARGETS[name]()
    torch._dynamo.reset()
    f = torch.compile(call, backend="adjoint", dynamic=True, options={"inner": "aot_eager", "shard_size": 4})
    for T in (x.shape[1], x.shape[1] - 8):
        xt = x[:, :T].contiguous()
        want = _step(model, call, xt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _step(model, f, xt)
        _compare(want, got, 1e-5 if name != "hf-mamba2" else 1e-4)
