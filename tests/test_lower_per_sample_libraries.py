"""per_sample_clip on recurrent layers as libraries write them: mambapy's Mamba (its own parallel-scan
autograd.Function, and its sequential loop) and mingru-pytorch's minGRU (a log-space scan). The oracle is an eager
backward per example (test_lower_per_sample.loop_clipped; mambapy's scan does not run under torch.func)."""
from __future__ import annotations

import pytest
import torch

import adjoint_compile as ac
from test_lower_per_sample import _loss, loop_clipped

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _mambapy(pscan: bool) -> torch.nn.Module:
    mamba = pytest.importorskip("mambapy.mamba")
    return mamba.Mamba(mamba.MambaConfig(d_model=8, n_layers=2, d_state=4, pscan=pscan))


def _mingru() -> torch.nn.Module:
    mingru = pytest.importorskip("minGRU_pytorch")
    return torch.nn.Sequential(mingru.minGRU(8), mingru.minGRU(8))


@pytest.mark.parametrize("make", [lambda: _mambapy(True), lambda: _mambapy(False), _mingru],
                         ids=["mambapy-pscan", "mambapy-loop", "mingru"])
def test_library_layers_clip_each_example_exactly(make):
    torch.manual_seed(0)
    model, x, clip = make(), torch.randn(3, 21, 8), 0.5
    want, norms = loop_clipped(model, (x,), clip)
    assert (norms > clip).any()
    f = torch.compile(model, backend="adjoint",
                      options={"per_sample_clip": clip, "shard_size": 4, "inner": "aot_eager"})
    _loss(f(x)).backward()
    rep = ac.report(f)
    assert any(r.rewrite == "adjoint" for r in rep.regions), rep
    torch.testing.assert_close(ac.per_sample_grad_norms(f), norms, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
