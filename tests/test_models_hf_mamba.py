"""transformers' MambaForCausalLM under backend="adjoint": its selective scan (per-step loop, or associative_scan
under torch.compile) is captured as one linear_scan by the polyfill (adjoint_compile/polyfills/hf_mamba.py),
sharded, and its gradients equal eager autograd's (FalconMambaForCausalLM's copy of it too); the same for
Mamba2ForCausalLM's chunked SSD path
(polyfills/hf_mamba2.py). Tiny configs, no weights downloaded."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import adjoint_compile as ac  # noqa: E402
from adjoint_compile import polyfills  # noqa: E402
from adjoint_compile.polyfills import hf_mamba  # noqa: E402

CAPTURED = "captured by adjoint-compile's polyfill for transformers' mamba_selective_scan"


def _mamba(assoc: bool, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=layers, expand=2,
                                   conv_kernel=4, use_associative_scan=assoc)
    return transformers.MambaForCausalLM(cfg)


def _grads(model: torch.nn.Module, fn, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn(ids)
    (out.float().pow(2).mean() + out.float().sum() * 1e-2).backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))


def test_polyfill_is_registered_and_checked_against_the_library():
    from transformers.models.mamba import modeling_mamba
    done = polyfills.install()[modeling_mamba.__name__]
    assert done.startswith("registered"), done
    import inspect
    original = inspect.unwrap(modeling_mamba.mamba_selective_scan)
    assert hf_mamba.check(original, T=5) <= hf_mamba.TOL
    assert hf_mamba.check(original, T=1) <= hf_mamba.TOL


def test_explain_one_scan_per_layer_whatever_T_and_path():
    """The loop path at T = 16 and the associative_scan path at T = 64 give the same graph: no unrolled loop, no
    inlined scan levels."""
    sizes = []
    for T, assoc in ((16, False), (64, True)):
        model = _mamba(assoc)
        rep = ac.explain(lambda i: model(i).logits, torch.randint(0, 32, (2, T)),
                         options={"inner": "eager", "shard_size": 8})
        lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
        assert len(lin) == 2 and all(r.rewrite == "adjoint" and r.length == T for r in lin), str(rep)
        assert all(CAPTURED in r.reason for r in lin), str(rep)
        sizes.append(len(rep.graphs[0].graph.nodes))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("inner,shard,T,assoc", [("eager", 1, 16, True), ("aot_eager", 5, 29, False),
                                                 ("eager", 7, 64, False)])
def test_exact_gradients(inner, shard, T, assoc):
    model = _mamba(assoc)
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
    want_out, want = _grads(model, lambda i: model(i).logits, ids)  # eager: the library's own loop
    torch._dynamo.reset()
    f = torch.compile(lambda i: model(i).logits, backend="adjoint", options={"inner": inner, "shard_size": shard})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_out, got = _grads(model, f, ids)
    rep = ac.report(f)
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" and CAPTURED in r.reason for r in lin), str(rep)
    assert all(r.details["shard_size"] == shard for r in lin)
    assert _rel(got_out, want_out) <= 1e-5
    assert want.keys() == got.keys() and len(want) == len(list(model.parameters()))
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("module", sorted(m for m in polyfills.KNOWN if m.startswith("transformers.")))
def test_every_copy_of_the_library_functions_is_registered(module):
    """transformers' hybrid models (Jamba, Zamba, Bamba, FalconH1, GraniteMoeHybrid, NemotronH, Zamba2...) carry
    copies of the two functions: each module's own copy is checked against the polyfill and registered."""
    import importlib
    pytest.importorskip(module, reason="not in this transformers version")
    importlib.import_module(module)
    assert polyfills.install()[module].startswith("registered"), polyfills.installed()[module]


@pytest.mark.parametrize("shard,T,assoc", [(5, 29, False), (1, 16, True)])
def test_falcon_mamba_shares_the_polyfill(shard, T, assoc):
    """FalconMambaForCausalLM carries its own copy of ``mamba_selective_scan``: it is registered and checked on its
    own, and its scans are sharded with eager's gradients (before, nothing in it was recognized)."""
    from transformers.models.falcon_mamba import modeling_falcon_mamba
    assert polyfills.install()[modeling_falcon_mamba.__name__].startswith("registered")
    torch.manual_seed(0)
    model = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
        vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_associative_scan=assoc))
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
    want_out, want = _grads(model, lambda i: model(i).logits, ids)
    torch._dynamo.reset()
    f = torch.compile(lambda i: model(i).logits, backend="adjoint", options={"inner": "aot_eager", "shard_size": shard})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_out, got = _grads(model, f, ids)
    lin = [r for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" and CAPTURED in r.reason for r in lin), str(ac.report(f))
    assert _rel(got_out, want_out) <= 1e-5
    assert want.keys() == got.keys() and len(want) == len(list(model.parameters()))
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert max(errs.values()) <= 1e-5, errs


def test_bamba_shares_the_mamba2_polyfill():
    """BambaForCausalLM, one of the hybrids carrying a copy of ``mamba2_chunk_scan``: its scan is sharded with eager's
    gradients (before, no recurrence was found in it)."""
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_indices=[], mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, use_cache=False))
    ids = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(13))
    want_out, want = _grads(model, lambda i: model(i).logits, ids)
    torch._dynamo.reset()
    f = torch.compile(lambda i: model(i).logits, backend="adjoint", options={"inner": "aot_eager", "shard_size": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_out, got = _grads(model, f, ids)
    lin = [r for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert len(lin) == 1 and lin[0].rewrite == "adjoint" and "mamba2_chunk_scan" in lin[0].reason, str(ac.report(f))
    assert _rel(got_out, want_out) <= 1e-5
    assert want.keys() == got.keys() and len(want) == len(list(model.parameters()))
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert max(errs.values()) <= 1e-5, errs


def test_other_backends_trace_the_library_code():
    """The polyfill applies to backend="adjoint" (and explain) only: aot_eager compiles the library's own path."""
    model = _mamba(False, layers=1)
    polyfills.install()
    seen = []

    def backend(gm, example_inputs):
        seen.append(any("linear_scan" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda i: model(i).logits, backend=backend)(torch.randint(0, 32, (2, 6)))
    assert seen == [False]


def _mamba2(chunk: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2, num_heads=4,
                                    head_dim=8, n_groups=1, expand=2, chunk_size=chunk)
    return transformers.Mamba2ForCausalLM(cfg)


CAPTURED2 = "captured by adjoint-compile's polyfill for transformers' mamba2_chunk_scan"


def test_mamba2_explain():
    model = _mamba2()
    rep = ac.explain(lambda i: model(i).logits, torch.randint(0, 32, (2, 16)),
                     options={"inner": "eager", "shard_size": 8})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" and r.length == 16 and CAPTURED2 in r.reason
                                 for r in lin), str(rep)


@pytest.mark.parametrize("inner,shard,T", [("eager", 1, 13), ("aot_eager", 5, 21)])
def test_mamba2_exact_gradients(inner, shard, T):
    """Against eager autograd of the library's chunked SSD form (T not a multiple of the chunk: padded there)."""
    model = _mamba2()
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
    want_out, want = _grads(model, lambda i: model(i).logits, ids)
    torch._dynamo.reset()
    f = torch.compile(lambda i: model(i).logits, backend="adjoint", options={"inner": inner, "shard_size": shard})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_out, got = _grads(model, f, ids)
    lin = [r for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" and CAPTURED2 in r.reason for r in lin)
    assert _rel(got_out, want_out) <= 1e-5
    assert want.keys() == got.keys() and len(want) == len(list(model.parameters()))
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
@pytest.mark.slow
def test_new_lengths_reuse_one_lowering(dynamic):
    """A Mamba layer cuts its causal conv at the input's length (``conv1d(x)[..., :seq_len]``): the graph for every
    length now takes that cut in, so new lengths are not lowered and compiled again. Each length exact against
    eager in fp64, every layer's scan still sharded (its conv carried as a halo), no warning. With dynamic=True the
    norms' eps is a number read from a tensor input (``.item()``), which the regions read as their input."""
    from helpers import generic_regions

    model = _mamba(False).double()
    torch._dynamo.reset()
    c = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(i):  # NB: the backbone: the LM's head hands out fp32 logits whatever the model's dtype
        return model.backbone(i).last_hidden_state.mul(c).mean()

    f = torch.compile(loss, backend="adjoint", options={"inner": "eager", "shard_size": 8}, dynamic=dynamic)
    lengths = (40, 53, 64, 29)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for T in lengths:
            ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
            got = torch.autograd.grad(f(ids), list(model.parameters()), allow_unused=True, materialize_grads=True)
            want = torch.autograd.grad(loss(ids), list(model.parameters()), allow_unused=True,
                                       materialize_grads=True)
            for (name, _), a, b in zip(model.named_parameters(), got, want):
                # NB: 1e-6: the model computes its norms and A_log, D in fp32 whatever its dtype (rounding ~1e-7)
                assert (a - b).norm() <= 1e-6 * b.norm(), (T, name, float((a - b).norm() / b.norm()))
    assert not [w.message for w in said if issubclass(w.category, ac.AdjointCompileWarning)]
    generic = generic_regions(f)
    want = set(lengths if dynamic else lengths[1:])
    assert generic and all(m.lengths == want for m in generic), [m.lengths for m in generic]
    assert all(len(r._plan.convs) >= 1 for m in generic for r in m.regions.values())
