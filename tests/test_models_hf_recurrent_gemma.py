"""transformers' RecurrentGemmaForCausalLM (Griffin's RG-LRU) under backend="adjoint", as users call it with labels:
its recurrence (a Python loop writing each step into a buffer) is re-rolled and sharded with the head and the loss,
through the ``SqrtBoundDerivative`` custom Function on its input gate (which now joins the region, with its own
backward) and the ``.type(dtype)`` casts of its steps. Before, the rewrite was declined as not paying: everything
before the custom Function stayed outside with its full-length activations. Tiny config, no weights downloaded."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import adjoint_compile as ac  # noqa: E402


def test_rg_lru_is_sharded_with_eager_gradients():
    torch.manual_seed(0)
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=("recurrent",), use_cache=False)
    model = transformers.RecurrentGemmaForCausalLM(cfg).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(37))
    labels = ids.clone()
    labels[0, :5] = -100
    f = torch.compile(lambda i, y: model(input_ids=i, labels=y).loss, backend="adjoint",
                      options={"inner": "aot_eager", "shard_size": 8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(ids, labels)
    got.backward()
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    # NB: the RG-LRU accumulates in fp32 and transformers' loss upcasts the logits to fp32: fp32's rounding
    assert abs(float(got - want)) <= 1e-5 * abs(float(want))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max().clamp_min(1e-12), name
    rec = [r for r in ac.report(f).regions if r.kind == "linear_recurrence"]
    assert len(rec) == 1 and rec[0].rewrite == "adjoint", str(ac.report(f))
    assert any("autograd_function_apply" in m for m in rec[0].details["members"])
    assert rec[0].details.get("sums_over_time"), str(ac.report(f))  # the head and the loss in the region
