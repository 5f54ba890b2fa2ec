"""per_sample_clip on stacks with causal convs: the conv's halo (the p input steps before a shard) is carried from
shard to shard per example too, so a Mamba-style stack (conv, scan, gate, residual), with its embedding, head and
loss, is one sharded region under per-example clipping, as it is without it. The conv's weight is made per example
as a conv grouped by example (runtime/per_example_conv.py). Against torch.func.vmap(grad) and a loop over the examples
(custom stacks) and an eager loop (transformers' Mamba and Mamba-2 with their loss)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.runtime import sharded_ps
from adjoint_compile.runtime.per_example_conv import example_conv
from test_capture_token_shift import TokenShiftStack
from test_lower_halo import ConvScan
from test_lower_per_sample import check


def _one_region(rep: ac.Report, scans: int = 2) -> list:
    rows = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(rows) == scans and all(r.rewrite == "adjoint" for r in rows), str(rep)
    assert len({r.details.get("region_call") for r in rows}) == 1, str(rep)
    return rows


@pytest.mark.parametrize("form,dilation", [("slice", 1), ("pad", 2)])
@pytest.mark.parametrize("shard", [1, 4, 5])
def test_conv_scan_stack_is_one_region_with_exact_per_example_gradients(form, dilation, shard):
    """T = 13 (odd), shards of 1, 4 and 5 steps: the halo crosses every kind of boundary, and with dilation 2 a
    halo of 6 steps spans several one- and four-step shards."""
    model = ConvScan(form, dilation=dilation)
    x = torch.randn(3, 13, 6)
    _one_region(check(model, x, clip=0.5, shard_size=shard))


@pytest.mark.parametrize("which", ["conv", "token shift"])
def test_masked_vjps_take_the_halo_cotangents(monkeypatch, which):
    """Where the parameters are not expanded, one backward per example (masked cotangents) pairs every carry with its
    examples' axis, the conv halos' and token shifts' too (they were left out of the pairing: their cotangents
    dropped)."""
    monkeypatch.setattr(sharded_ps, "_EXPANDED", [False])
    model, d = (ConvScan("slice"), 6) if which == "conv" else (TokenShiftStack("fill", 2), 5)
    _one_region(check(model, torch.randn(3, 11, d), clip=0.5, shard_size=4))


@pytest.mark.parametrize("form,p", [("pad", 1), ("cat", 3), ("fill", 2)])
@pytest.mark.parametrize("shard", [1, 4])
def test_token_shift_stack_is_one_region_with_exact_per_example_gradients(form, p, shard):
    """RWKV-like token shifts (``F.pad(x, (0, 0, p, -p))``, a cat with zeros, a constant fill): the shifted-out steps
    are carried per example like a conv's halo."""
    _one_region(check(TokenShiftStack(form, p), torch.randn(3, 11, 5), clip=0.5, shard_size=shard))


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("bias", [True, False])
def test_example_conv_is_each_examples_own_conv(groups, bias):
    torch.manual_seed(0)
    B, C, O, k = 3, 6, 4 if groups != 6 else 6, 3
    x = torch.randn(B, C, 9, dtype=torch.float64)
    w = torch.randn(B, O, C // groups, k, dtype=torch.float64)
    b = torch.randn(B, O, dtype=torch.float64) if bias else None
    got = example_conv(x, w, b, 1, 2, 2, groups)
    want = torch.stack([F.conv1d(x[n:n + 1], w[n], None if b is None else b[n], 1, 2, 2, groups)[0]
                        for n in range(B)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- transformers' Mamba and Mamba-2, their loss included --------------------------------------------------------------

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
from test_models_hf_loss_only import _mamba, _mamba2  # noqa: E402


def _per_example_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                       mask: torch.Tensor) -> list[dict]:
    """Each example's gradient of the batch's loss (a mean over the batch's valid targets): the example alone, its
    mean rescaled by its share of the targets."""
    valid = (labels[:, 1:] != -100).sum(1)
    out = []
    for n in range(ids.shape[0]):
        m = copy.deepcopy(model)
        loss = m(input_ids=ids[n:n + 1], attention_mask=mask[n:n + 1], labels=labels[n:n + 1]).loss
        (loss * (valid[n] / valid.sum())).backward()
        out.append({k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in m.named_parameters()})
    return out


@pytest.mark.parametrize("make", [_mamba, _mamba2], ids=["mamba", "mamba2"])
@pytest.mark.parametrize("shard,padded", [(4, False), (5, False), (5, True)])
def test_transformers_mamba_with_its_loss_is_one_region_under_per_example_clipping(make, shard, padded):
    """``loss_only(MambaForCausalLM)`` with labels (some ignored, one at a shard boundary; ``padded``: an
    ``attention_mask`` with a right-padded sequence, its padding ignored) under per_sample_clip: the lookup, both
    layers (convs included), the head and the loss are one region; norms and the clipped sum against the examples
    run alone (transformers computes parts in fp32: 1e-6)."""
    ref = make().double()
    torch.manual_seed(3)
    ids = torch.randint(0, 11, (3, 13))
    labels = ids.clone()
    labels[0, 5] = labels[2, 9:] = -100
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 8:] = 0
        labels[1, 8:] = -100
    per = _per_example_grads(ref, ids, labels, mask)
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in d.values())) for d in per], dtype=torch.float64)
    clip = float(norms.min() + norms.max()) / 2
    want = {k: sum(min(1.0, clip / float(nm)) * d[k] for d, nm in zip(per, norms)) for k in per[0]}
    model = ac.loss_only(copy.deepcopy(ref))
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "shard_size": shard,
                                                          "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f), norms, rtol=1e-6, atol=0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    rows = _one_region(ac.report(f))
    assert all(r.details.get("sums_over_time") and r.details.get("embeddings") for r in rows), str(ac.report(f))


def test_mingru_lm_with_convs_is_exact_and_sharded_as_without_clipping():
    """mingru-pytorch's ``minLM(enable_conv=True)`` (a causal depthwise conv before each minGRU): under
    per_sample_clip the same regions as without it, exact against vmap and a loop."""
    mingru = pytest.importorskip("minGRU_pytorch.minLM")

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = mingru.minLM(num_tokens=17, dim=8, depth=2, enable_conv=True)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(ids)
    ids = torch.randint(0, 17, (3, 13), generator=torch.Generator().manual_seed(4))
    clipped = check(Logits(), ids, clip=0.3, shard_size=5)
    plain = ac.explain(Logits(), ids, options={"shard_size": 5})
    rows = [r for r in clipped.regions if r.kind == "linear_recurrence"]
    assert rows and all(r.rewrite == "adjoint" for r in rows), str(clipped)
    assert len({r.details["region_call"] for r in rows}) == len(
        {r.group if r.group is not None else r.name for r in plain.regions
         if r.kind == "linear_recurrence" and r.rewrite == "adjoint"}), (str(clipped), str(plain))
