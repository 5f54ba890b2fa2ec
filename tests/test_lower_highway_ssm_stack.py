"""A pre-LN SSM stack in highway mode (issue 12): Y_k = Y_{k-1} + SSM_k(RMSNorm(Y_{k-1})), each block holding a
linear scan. The residual chain over depth gets Highway-BP; the scans inside its blocks keep linear_scan's exact
adjoint (J = 0 along time), rather than a sharded exact region absorbing the chain. Against the levels oracle
(tests/highway_oracle.py) over the layers, every parameter by name."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from highway_oracle import chain_levels

import adjoint_compile as ac

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _grads(run, model, x, proj):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    (run(x) * proj).sum().backward()
    out = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    out["<input>"] = x.grad.clone()
    return out


def _oracle(m, x, k):
    layers = [(lambda v, n=n, f=f: f(n(v)), lambda v, z: v + z) for n, f in zip(m.norms, m.layers)]
    return m.norm_f(chain_levels(layers, x, k)[-1])


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("T", [1, 7])
def test_pre_ln_ssm_stack_matches_the_levels_oracle(k, T):
    torch.manual_seed(21)
    m = runpy.run_path(str(ROOT / "examples" / "selective_ssm.py"))["make"](n_layers=3)
    x, proj = torch.randn(2, T, 16), torch.randn(2, T, 16)
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": k, "inner": "eager"})
    got = _grads(c, m, x, proj)
    want = _grads(lambda v: _oracle(m, v, k), m, x, proj)
    exact = _grads(m, m, x, proj)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=f"k={k} T={T}: {n}")
        if k >= 3:
            torch.testing.assert_close(got[n], exact[n], rtol=1e-4, atol=1e-6, msg=f"k>=L: {n}")
    if k == 0:
        assert not torch.allclose(got["layers.0.in_proj.weight"], exact["layers.0.in_proj.weight"], rtol=1e-3)
    rep = ac.report(c)
    chain = [r for r in rep.regions if r.kind == "residual_chain"]
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert [(r.rewrite, r.length) for r in chain] == [("highway", 3)] and "pre_ln: r = x + z" in chain[0].reason
    assert chain[0].details["batched_layers"]  # three isomorphic layers: one vmap over them, scans included
    assert len(scans) == 3 and all("runs inside the blocks of the Highway-BP chain" in r.reason for r in scans)


def test_exact_mode_still_shards_the_stack():
    """The negative twin: in exact mode the scans' sharded region absorbs the chain (exact across layers)."""
    torch.manual_seed(22)
    m = runpy.run_path(str(ROOT / "examples" / "selective_ssm.py"))["make"](n_layers=3)
    rep = ac.explain(m, torch.randn(2, 7, 16), options={"shard_size": 3})
    assert {r.rewrite for r in rep.regions if r.kind == "linear_recurrence"} == {"adjoint"}
    assert all("run inside the sharded region" in r.reason for r in rep.regions if r.kind == "residual_chain")
