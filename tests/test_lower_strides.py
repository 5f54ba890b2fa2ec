"""Programs traced on fake tensors run on real ones whose strides the fake kernels did not predict (inner.py
``stride_checked``): the fake kernels of elu_backward and softplus_backward (PyTorch decompositions) lay their result
out like the forward's input where the real kernels follow the gradient, and _log_softmax_backward_data's like the
gradient where the real one follows the output, so a view the trace recorded after one of them was invalid at run
time ("view size is not compatible with input tensor's size and stride"). Each case here raised that before: in a
shard's recompute + VJP (make_fx, inner "eager", and aot_eager's retrace of it), in a loss chunk's value and gradient,
and in aot_eager's backward of a partition. Against eager autograd on a deep copy, in fp64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import adjoint_compile as ac
from adjoint_compile.inner import stride_checked

DT = torch.float64
H, K = 2, 3


def _same_as_eager(model: nn.Module, args: tuple, inner: str, shard_size: int) -> None:
    """``model`` compiled by the adjoint backend: a region rewritten, its output and every parameter's gradient those
    of eager autograd."""
    ref = copy.deepcopy(model)
    want = ref(*args)
    want.backward()
    f = torch.compile(model, backend="adjoint", options={"shard_size": shard_size, "inner": inner})
    got = f(*args)
    got.backward()
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), str(ac.report(f))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_a_view_after_an_op_whose_fake_strides_are_not_the_real_ones():
    g = torch.randn(2, H, 5, K, dtype=DT)  # the gradient, contiguous
    x = torch.randn(2, 5, H, K, dtype=DT).transpose(1, 2)  # the forward's input, [B, H, T, K] of a [B, T, H, K]

    def fn(g, x):
        return torch.ops.aten.elu_backward(g, 1.0, 1, 1, False, x).transpose(1, 2).reshape(2, 5, H * K)

    gm = make_fx(fn, tracing_mode="fake")(g, x)
    want = fn(g, x)
    run = stride_checked(gm)
    for _ in range(2):  # NB: the first call checks the strides node by node, the second runs the rewritten code
        torch.testing.assert_close(run(g, x), want, rtol=0, atol=0)


def test_a_program_laid_out_as_traced_is_left_as_it_is():
    x = torch.randn(2, 5, H, K, dtype=DT).transpose(1, 2)
    gm = make_fx(lambda x: torch.sigmoid(x).transpose(1, 2).reshape(2, 5, H * K), tracing_mode="fake")(x)
    code = gm.code
    torch.testing.assert_close(stride_checked(gm)(x), torch.sigmoid(x).transpose(1, 2).reshape(2, 5, H * K))
    assert gm.code == code  # NB: no copy where the real strides are the traced ones


class ELUInRegion(nn.Module):
    """A linear-attention-like feature map elu(k) + 1 on [B, H, T, K] views, inside the sharded region."""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.v = nn.Linear(H * K, H * K, dtype=DT), nn.Linear(H * K, H * K, dtype=DT)

    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """elu(k) + 1 and v, each [B, H, T, K] (transposed views)."""
        b, t, _ = x.shape
        return (F.elu(self.k(x).view(b, t, H, K).transpose(1, 2)) + 1,
                self.v(x).view(b, t, H, K).transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k, v = self.features(x)
        h = ac.ops.linear_scan(torch.sigmoid(v), k * v, dim=2)
        return h.transpose(1, 2).reshape(b, t, H * K).pow(2).sum()


class SoftplusComplexScan(nn.Module):
    """A complex diagonal recurrence h_t = exp(-softplus(.) + i·θ) h_{t-1} + v_t written as a loop."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.m, self.p = nn.Linear(d, d, dtype=DT), nn.Linear(d, d, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.exp(torch.complex(-F.softplus(self.m(x)), self.p(x)))
        v = torch.complex(x, x * 0.5)
        h, hs = torch.zeros_like(v[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + v[:, t]
            hs.append(h.abs())
        return torch.stack(hs, 1).pow(2).sum()


class ELUBeforeLoop(ELUInRegion):
    """elu(k) + 1 outside the region, the recurrence a loop over an outer-product state (aot_eager's backward of the
    partition holds elu_backward and the view of the gradient of k)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k, v = self.features(x)
        S, ys = x.new_zeros(b, H, K, K), []
        for i in range(t):
            S = 0.9 * S + k[:, :, i, :, None] * v[:, :, i, None, :]
            ys.append(S.sum(-2))
        return torch.stack(ys, 1).pow(2).sum()


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_elu_in_a_sharded_region(inner):
    torch.manual_seed(0)
    _same_as_eager(ELUInRegion(), (torch.randn(2, 12, H * K, dtype=DT),), inner, 4)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_softplus_in_a_complex_scan(inner):
    torch.manual_seed(0)
    _same_as_eager(SoftplusComplexScan(), (torch.randn(2, 16, 4, dtype=DT),), inner, 4)


def test_elu_in_a_partition_compiled_by_aot_eager():
    torch.manual_seed(0)
    _same_as_eager(ELUBeforeLoop(), (torch.randn(2, 16, H * K, dtype=DT),), "aot_eager", 4)


V, D = 11, 8


class SoftTargetsBVT(nn.Module):
    """A scan LM whose cross-entropy takes probabilities in the [B, V, T] layout (a loss chunk's program)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.decay, self.inp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = x + ac.ops.linear_scan(torch.sigmoid(self.decay(x)), self.inp(x), dim=1)
        return F.cross_entropy(self.head(h).transpose(1, 2), probs.transpose(1, 2))


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("shard_size", [4, 5])
def test_soft_targets_in_the_bvt_layout(inner, shard_size):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 13))
    probs = torch.rand(2, 13, V, dtype=DT).softmax(-1)
    _same_as_eager(SoftTargetsBVT().double(), (ids, probs), inner, shard_size)
