"""torch.func transforms and the backend, against eager autograd in fp64.

* ``torch.compile(vmap(functional_call(...)))`` over a stacked ensemble (``stack_module_state``): dynamo traces the
  vmap inline and the graph's values are batched. The compile raised: the rolled loop's scan refused the batched
  carries, and the sharded region's preparation touched tensors that escaped the vmap. The graph is now refused
  whole with its reason, loops under the transform stay unrolled, and the values are eager's.
* ``torch.func.grad`` of a compiled function: dynamo refuses every frame under the transform, and each one warned
  (14 warnings a call, naming inspect's and contextlib's functions). One warning says it now.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

import adjoint_compile as ac
from adjoint_compile.analysis import breaks

D, V, B, T = 6, 11, 2, 9


class Layer(nn.Module):
    def __init__(self, loop: bool) -> None:
        super().__init__()
        self.inp, self.out, self.loop = nn.Linear(D, 2 * D), nn.Linear(D, D), loop

    def forward(self, x):
        a, b = self.inp(x).chunk(2, -1)
        a = torch.sigmoid(a)
        if not self.loop:
            return x + self.out(ac.ops.linear_scan(a, b, dim=1))
        h, hs = x.new_zeros(x.shape[0], x.shape[2]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return x + self.out(torch.stack(hs, 1))


class LM(nn.Module):
    def __init__(self, loop: bool) -> None:
        super().__init__()
        self.emb, self.layer, self.head = nn.Embedding(V, D), Layer(loop), nn.Linear(D, V)

    def forward(self, ids, y):
        return F.cross_entropy(self.head(self.layer(self.emb(ids))).flatten(0, 1), y.flatten())


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("loop", [False, True])
def test_a_compiled_vmap_over_an_ensemble_is_refused_with_its_reason(loop):
    torch.manual_seed(0)
    models = [LM(loop).double() for _ in range(3)]
    params, bufs = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    ids, y = _data()

    def one(p, b, i, t):
        return functional_call(base, (p, b), (i, t))

    torch._dynamo.reset()
    f = torch.compile(vmap(one, in_dims=(0, 0, None, None)), backend="adjoint",
                      options={"shard_size": 4, "inner": "aot_eager"})
    got = f(params, bufs, ids, y)
    want = torch.stack([m(ids, y) for m in models])
    assert (got - want).abs().max() < 1e-12
    names = list(params)
    grads = torch.autograd.grad(got.sum(), [params[k] for k in names])
    want_grads = torch.autograd.grad(want.sum(), [dict(m.named_parameters())[k] for k in names for m in models])
    for j, g in enumerate(grads):
        for k in range(3):
            assert (g[k] - want_grads[j * 3 + k]).abs().max() < 1e-10, names[j]
    rep = ac.report(f)
    assert not rep.regions and any("torch.func transform" in r.reason for r in rep.rejections), str(rep)


def test_func_grad_of_a_compiled_function_warns_once(monkeypatch):
    monkeypatch.setattr(breaks, "_FUNCTORCH_WARNED", [])
    torch.manual_seed(0)
    model = LM(False).double()
    ref = copy.deepcopy(model)
    ids, y = _data()
    params = {k: v.detach() for k, v in model.named_parameters()}
    torch._dynamo.reset()
    f = torch.compile(lambda p: functional_call(model, p, (ids, y)), backend="adjoint",
                      options={"shard_size": 4, "inner": "aot_eager"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        g = torch.func.grad(f)(params)
        g2 = torch.func.grad(f)(params)
    ours = [str(w.message) for w in said if issubclass(w.category, ac.AdjointCompileWarning)]
    assert len(ours) == 1 and "under a torch.func transform" in ours[0], ours
    want = torch.autograd.grad(ref(ids, y), list(ref.parameters()))
    for k, w in zip(params, want):
        assert (g[k] - w).abs().max() < 1e-12 and torch.equal(g[k], g2[k]), k
