"""linear_scan under torch.func: grad, vjp, vmap (any in_dims / out_dims), vmap of grad (per-example gradients) and
jacrev, each against an oracle written here: the per-step loop h_t = a_t h_{t-1} + b_t in fp64, differentiated by
plain autograd. vmap must run one batched scan (the ops' batching rules), not one scan per example.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.func import grad, jacrev, jvp, vjp, vmap  # noqa: E402

from adjoint_compile.kernels import scan as K  # noqa: E402
from adjoint_compile.ops import linear_scan  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-10)


def loop_scan(a, b, h0=None, dim=1, reverse=False, window=None):
    """The spec, one step at a time: h_t = a_t h_{t-1} + b_t (h_{-1} = h0, zeros when None); ``reverse`` runs from
    the last step; ``window=W``: h_t = Σ_{i=max(t-W+1, -1)..t} (Π_{j=i+1..t} a_j) x_i with x_i = b_i, x_{-1} = h0."""
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    if reverse:
        a, b = a.flip(0), b.flip(0)
    x = [torch.zeros_like(b[0]) if h0 is None else h0] + list(b.unbind(0))  # x[i + 1] is the input at step i
    hs = []
    for t in range(a.shape[0]):
        if window is None:
            hs.append(a[t] * (hs[-1] if hs else x[0]) + b[t])
            continue
        h = torch.zeros_like(b[0])
        for i in range(max(t - window + 1, -1), t + 1):
            term = x[i + 1]
            for j in range(i + 1, t + 1):
                term = term * a[j]
            h = h + term
        hs.append(h)
    h = torch.stack(hs, 0)
    return (h.flip(0) if reverse else h).movedim(0, dim)


def _example(shape, dim, use_h0, seed):
    """a in (-0.9, 0.9) with some exact zeros, b and h0 normal; fp64."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(shape, generator=g, dtype=torch.float64) * 1.8 - 0.9
    a[a.abs() < 0.05] = 0.0
    b = torch.randn(shape, generator=g, dtype=torch.float64)
    d = dim % len(shape)
    h0 = torch.randn(shape[:d] + shape[d + 1:], generator=g, dtype=torch.float64) if use_h0 else None
    w = torch.randn(shape, generator=g, dtype=torch.float64)  # loss weights: every step's state matters
    return a, b, h0, w


def _oracle_grads(a, b, h0, w, **kw):
    """∂/∂(a, b, h0) of Σ w ⊙ loop_scan(a, b, h0) by autograd through the loop."""
    ins = [x.detach().clone().requires_grad_() for x in (a, b) + ((h0,) if h0 is not None else ())]
    loss = (loop_scan(ins[0], ins[1], ins[2] if h0 is not None else None, **kw) * w).sum()
    return torch.autograd.grad(loss, ins)


def test_oracle_is_the_kernels_spec():
    # the loop here and the package's own per-step spec agree, windows and reverse included
    for window in (None, 1, 3, 8):
        for reverse in (False, True):
            a, b, h0, _ = _example((2, 7, 3), 1, True, seed=window or 0)
            torch.testing.assert_close(loop_scan(a, b, h0, 1, reverse, window),
                                       K.naive_scan(a, b, h0, 1, reverse, window), **TOL)


CASES = [  # (shape, dim)
    ((2, 7, 3), 1), ((2, 13, 3), 1), ((3, 1, 2), 1), ((7, 4), 0), ((2, 3, 13), -1), ((2, 7, 2, 3), 1)]


@pytest.mark.parametrize("shape,dim", CASES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("use_h0", [False, True])
def test_grad_matches_loop(shape, dim, reverse, window, use_h0):
    a, b, h0, w = _example(shape, dim, use_h0, seed=len(shape) + shape[dim])
    kw = dict(dim=dim, reverse=reverse, window=window)

    def loss(a, b, h0):
        return (linear_scan(a, b, h0, **kw) * w).sum()

    got = grad(loss, argnums=(0, 1, 2) if use_h0 else (0, 1))(a, b, h0)
    for name, x, y in zip(("a", "b", "h0"), got, _oracle_grads(a, b, h0, w, **kw)):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m: f"∂{name}: {m}")


@pytest.mark.parametrize("shape,dim", CASES[:3] + CASES[4:5])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_vjp_matches_loop(shape, dim, reverse, window, impl):
    a, b, h0, w = _example(shape, dim, True, seed=shape[dim])
    kw = dict(dim=dim, reverse=reverse, window=window)
    h, pullback = vjp(lambda a, b, h0: linear_scan(a, b, h0, impl=impl, **kw), a, b, h0)
    torch.testing.assert_close(h, loop_scan(a, b, h0, **kw), **TOL)
    for name, x, y in zip(("a", "b", "h0"), pullback(w), _oracle_grads(a, b, h0, w, **kw)):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m: f"∂{name}: {m}")


def _batch(xs, bdim):
    """Examples stacked along ``bdim``, or (bdim None) the first example alone, shared by all."""
    return xs[0] if bdim is None else torch.stack(xs, bdim)


def _examples(n, shape, dim, use_h0, shared):
    """n examples; the inputs named in ``shared`` are the same in every example (vmap in_dim None)."""
    exs = [_example(shape, dim, use_h0, seed=10 + i) for i in range(n)]
    return [[exs[0][k] if name in shared else exs[i][k] for i in range(n)] for k, name in enumerate("a b h0 w".split())]


# in_dims of (a, b, h0), out_dims; per example a / b are [2, T, 3] (scan dim 1) and h0 is [2, 3]
VMAP_DIMS = [((0, 0, 0), 0), ((1, 1, None), 0), ((2, 0, 1), 1), ((None, 3, 0), -1), ((3, None, None), 2)]


@pytest.mark.parametrize("in_dims,out_dims", VMAP_DIMS)
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_vmap_matches_loop_with_one_batched_scan(monkeypatch, in_dims, out_dims, T, reverse, window):
    n, shape, dim = 4, (2, T, 3), 1
    shared = {k for k, d in zip("a b h0".split(), in_dims) if d is None}
    A, B, H0, _ = _examples(n, shape, dim, True, shared)
    calls = []
    scan = K.scan
    monkeypatch.setattr(K, "scan", lambda *args: calls.append(args[0].shape) or scan(*args))
    kw = dict(dim=dim, reverse=reverse, window=window)
    got = vmap(lambda a, b, h0: linear_scan(a, b, h0, **kw), in_dims=in_dims, out_dims=out_dims)(
        _batch(A, in_dims[0]), _batch(B, in_dims[1]), _batch(H0, in_dims[2]))
    want = torch.stack([loop_scan(a, b, h0, **kw) for a, b, h0 in zip(A, B, H0)], out_dims)
    torch.testing.assert_close(got, want, **TOL)
    assert calls == [torch.Size((n,) + shape)], "vmap must run one scan over the batch"


@pytest.mark.parametrize("shape,dim", [((7, 3), 0), ((2, 13), -1), ((2, 1, 3), 1)])
@pytest.mark.parametrize("use_h0", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_vmap_of_grad_gives_per_example_gradients(monkeypatch, shape, dim, use_h0, reverse, window):
    n = 3
    A, B, H0, W = _examples(n, shape, dim, use_h0, shared=())
    calls = []
    bwd = K.scan_backward
    monkeypatch.setattr(K, "scan_backward", lambda *args: calls.append(args[1].shape) or bwd(*args))
    kw = dict(dim=dim, reverse=reverse, window=window)

    def loss(a, b, h0, w):
        return (linear_scan(a, b, h0, **kw) * w).sum()

    argnums = (0, 1, 2) if use_h0 else (0, 1)
    got = vmap(grad(loss, argnums=argnums), in_dims=(0, 0, 0 if use_h0 else None, 0))(
        torch.stack(A), torch.stack(B), torch.stack(H0) if use_h0 else None, torch.stack(W))
    for i in range(n):
        for name, x, y in zip(("a", "b", "h0"), got, _oracle_grads(A[i], B[i], H0[i], W[i], **kw)):
            torch.testing.assert_close(x[i], y, **TOL, msg=lambda m: f"example {i} ∂{name}: {m}")
    assert calls == [torch.Size((n,) + shape)], "the per-example backward must be one batched backward scan"


def test_vmap_of_grad_shared_parameters_triton():
    # a (the decays) is shared by all examples, b and the loss weights are per example; Triton kernels
    n, shape, dim = 3, (2, 7, 3), 1
    A, B, H0, W = _examples(n, shape, dim, True, shared={"a", "h0"})

    def loss(a, b, h0, w):
        return (linear_scan(a, b, h0, dim=dim, impl="triton") * w).sum()

    ga, gh0 = vmap(grad(loss, argnums=(0, 2)), in_dims=(None, 0, None, 0))(A[0], torch.stack(B), H0[0],
                                                                           torch.stack(W))
    for i in range(n):
        want_a, _, want_h0 = _oracle_grads(A[0], B[i], H0[0], W[i], dim=dim)
        torch.testing.assert_close(ga[i], want_a, **TOL)
        torch.testing.assert_close(gh0[i], want_h0, **TOL)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_jacrev_matches_loop(reverse, window):
    a, b, h0, _ = _example((2, 5, 2), 1, True, seed=3)
    kw = dict(dim=1, reverse=reverse, window=window)
    got = jacrev(lambda a, b, h0: linear_scan(a, b, h0, **kw), argnums=(0, 1, 2))(a, b, h0)
    want = torch.autograd.functional.jacobian(lambda a, b, h0: loop_scan(a, b, h0, **kw), (a, b, h0))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **TOL)


def test_plain_autograd_keeps_the_ops_own_formula():
    # outside torch.func the op is called directly (one graph node under torch.compile; tests/test_kernels_scan.py)
    a, b, h0, _ = _example((2, 5, 3), 1, True, seed=0)
    h = linear_scan(a.requires_grad_(), b, h0)
    assert "linear_scan" in type(h.grad_fn).__name__ and "_ScanFn" not in type(h.grad_fn).__name__


def test_double_backward_and_forward_mode_raise():
    a, b, h0, w = _example((2, 5, 3), 1, True, seed=0)

    def loss(a):
        return (linear_scan(a, b, h0) * w).sum()

    with pytest.raises(RuntimeError, match="double backward"):
        grad(lambda a: grad(loss)(a).sum())(a)
    with pytest.raises(NotImplementedError, match="jvp"):
        jvp(lambda a: linear_scan(a, b, h0), (a,), (torch.ones_like(a),))
