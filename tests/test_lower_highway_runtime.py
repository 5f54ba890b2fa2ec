"""The Highway-BP runtime (runtime/highway.py) against an independent oracle (issue 12).

The oracle is the path count itself, written without the runtime: with k iterations the gradient is the sum over
all backward paths that go through at most k Jacobians of the blocks g.  Run the chain k + 1 times; level m feeds
each g with the states of level m - 1 (level -1: the forward states, detached) and each r with its own previous
state; the loss reads level k.  A path from the loss then drops one level at every g it goes through, so it meets
at most k of them, and the parameter gradients summed over the levels are exactly those paths.
"""
from __future__ import annotations

import pytest
import torch

from highway_oracle import levels_oracle

from adjoint_compile.runtime.highway import HighwayStats, StepChain, cumsumprod, highway_scan

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def gru_g(h, x_t, W):
    """A GRU cell's block g(h) = [z, (1 - z) ⊙ n] (Highway-BP Table 1: r = z1 ⊙ h + z2)."""
    w_hh, b_hh = W
    r_x, z_x, n_x = x_t.chunk(3, -1)
    r_h, z_h, n_h = (h @ w_hh.T + b_hh).chunk(3, -1)
    r = torch.sigmoid(r_x + r_h)
    z = torch.sigmoid(z_x + z_h)
    n = torch.tanh(n_x + r * n_h)
    return z, (1 - z) * n


def _gru_problem(T=7, B=3, H=4, seed=0):
    torch.manual_seed(seed)
    w_ih = torch.randn(3 * H, 5, requires_grad=True)
    w_hh = (0.7 * torch.randn(3 * H, H)).requires_grad_()
    b_hh = torch.randn(3 * H, requires_grad=True)
    u = torch.randn(T, B, 5, requires_grad=True)
    h0 = torch.randn(B, H, requires_grad=True)
    proj = torch.randn(T, B, H)
    return w_ih, w_hh, b_hh, u, h0, proj


def _runtime(k, tolerance=None, stats=None):
    def step(h, x, ex):
        (hc,), (xt,), W = h, x, ex
        z1, z2 = gru_g(hc, xt, W)
        new = z1 * hc + z2
        return [new], [new]

    def g(h, x, ex):
        return list(gru_g(h[0], x[0], ex))

    def r(h, Z):
        return [Z[0] * h[0] + Z[1]]

    return StepChain(step, g, r, y_of=[0], iterations=k, tolerance=tolerance,
                     stats=stats if stats is not None else HighwayStats())


def _grads_of(fn, leaves):
    for p in leaves:
        p.grad = None
    fn().backward()
    return [p.grad.clone() for p in leaves]


@pytest.mark.parametrize("k", [0, 1, 2, 7, 9])
def test_gru_chain_matches_the_levels_oracle(k):
    w_ih, w_hh, b_hh, u, h0, proj = _gru_problem()
    leaves = [w_ih, w_hh, b_hh, u, h0]

    def via_runtime():
        xs = u @ w_ih.T
        hT, hs = highway_scan(_runtime(k), [h0], [xs], [w_hh, b_hh])
        return (hs * proj).sum() + (hT ** 2).sum()

    def via_oracle():
        xs = u @ w_ih.T
        hs = levels_oracle(lambda h, x: gru_g(h, x, (w_hh, b_hh)), lambda h, z: z[0] * h + z[1], h0, xs, k)
        return (hs * proj).sum() + (hs[-1] ** 2).sum()

    got, want = _grads_of(via_runtime, leaves), _grads_of(via_oracle, leaves)
    for name, a, b in zip(["w_ih", "w_hh", "b_hh", "u", "h0"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{name} (k={k})")


def test_k_at_least_the_length_is_plain_autograd_and_small_k_is_not():
    w_ih, w_hh, b_hh, u, h0, proj = _gru_problem(T=6)
    leaves = [w_ih, w_hh, b_hh, u, h0]

    def loss(k):
        def f():
            hT, hs = highway_scan(_runtime(k), [h0], [u @ w_ih.T], [w_hh, b_hh])
            return (hs * proj).sum()
        return f

    def plain():
        h, out = h0, []
        for t in range(6):
            z1, z2 = gru_g(h, (u @ w_ih.T)[t], (w_hh, b_hh))
            h = z1 * h + z2
            out.append(h)
        return (torch.stack(out) * proj).sum()

    want = _grads_of(plain, leaves)
    for a, b in zip(_grads_of(loss(6), leaves), want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert not torch.allclose(_grads_of(loss(1), leaves)[1], want[1], rtol=1e-6, atol=1e-8)


def test_tolerance_stops_early_and_reports_the_iterations_used():
    w_ih, w_hh, b_hh, u, h0, proj = _gru_problem(T=12)
    stats = HighwayStats()
    hT, hs = highway_scan(_runtime(50, tolerance=1e-6, stats=stats), [h0], [u @ w_ih.T], [w_hh, b_hh])
    (hs * proj).sum().backward()
    assert stats.iterations is not None and stats.iterations < 50
    assert stats.last_update < 1e-6


def test_cumsumprod_is_the_reverse_recursion():
    torch.manual_seed(1)
    v, K = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    got = cumsumprod([v], [K])[0]
    want = [v[4]]
    for i in range(3, -1, -1):
        want.insert(0, v[i] + K[i + 1] * want[0])
    torch.testing.assert_close(got, torch.stack(want))


def _mlp_layers(L=5, D=6, seed=0):
    torch.manual_seed(seed)
    return [(0.5 * torch.randn(D, D)).requires_grad_() for _ in range(L)], torch.randn(4, D, requires_grad=True)


class _G(torch.nn.Module):
    def forward(self, x, W):
        return torch.tanh(x @ W)


class _ReluAdd(torch.nn.Module):
    def forward(self, x, z, W):
        return torch.relu(x + z)


class _PostLN(torch.nn.Module):
    def forward(self, x, z, W):
        return torch.nn.functional.layer_norm(x + z, x.shape[-1:])


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("r_mod,dense", [(_ReluAdd, False), (_PostLN, True)])
def test_layer_chain_matches_the_levels_oracle(k, r_mod, dense, batched):
    from highway_oracle import chain_levels

    from adjoint_compile.runtime.highway import HighwayLayers

    Ws, x0 = _mlp_layers()
    L = len(Ws)
    proj = torch.randn(4, 6)
    r = r_mod()
    mod = HighwayLayers([_G() for _ in Ws], [r_mod() for _ in Ws], [[i] for i in range(L)], k, dense=dense,
                        batched=batched)

    def via_runtime():
        outs = mod(x0, *Ws)
        return (outs[-1] * proj).sum() + outs[1].pow(2).sum()

    def via_oracle():
        layers = [(lambda x, W=W: torch.tanh(x @ W), lambda x, z, W=W: r(x, z, W)) for W in Ws]
        outs = chain_levels(layers, x0, k)
        return (outs[-1] * proj).sum() + outs[1].pow(2).sum()

    got, want = _grads_of(via_runtime, [*Ws, x0]), _grads_of(via_oracle, [*Ws, x0])
    assert mod.stats.batched == batched
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"leaf {i} (k={k})")


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_the_forward_saves_no_more_than_ordinary_backpropagation():
    """Highway-BP saves the states (and its inputs); g is recomputed in the backward, not kept per step."""
    w_ih, w_hh, b_hh, u, h0, proj = _gru_problem(T=32, B=4, H=16)
    xs = (u @ w_ih.T).detach().requires_grad_()

    def plain():
        h, out = h0, []
        for t in range(32):
            z1, z2 = gru_g(h, xs[t], (w_hh, b_hh))
            h = z1 * h + z2
            out.append(h)
        return torch.stack(out)

    ours, hs = _saved_bytes(lambda: highway_scan(_runtime(2), [h0], [xs], [w_hh, b_hh])[1])
    theirs, ref = _saved_bytes(plain)
    torch.testing.assert_close(hs, ref)
    assert ours < theirs, (ours, theirs)  # here 72.6 KB (states, xs, weights) against 104 KB
