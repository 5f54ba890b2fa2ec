"""The fused vocabulary head + cross-entropy op (adjoint_compile.loss_ops) and its kernels.

Chain of trust: the torch reference against eager ``F.linear`` + ``F.cross_entropy`` + ``torch.logsumexp`` under
autograd (fp64, every gradient by name), then the Triton kernels (under TRITON_INTERPRET=1) against the reference
with per-dtype tolerances. Awkward sizes: one row, rows and vocabularies that are not multiples of the kernels'
blocks, a hidden size that is not a power of two.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adjoint_compile.kernels import linear_ce  # noqa: E402
from adjoint_compile.kernels.linear_ce import ref as lce_ref  # noqa: E402
from adjoint_compile.loss_ops import linear_cross_entropy  # noqa: E402

SIZES = [(1, 5, 3), (7, 16, 97), (130, 40, 200)]  # (N, D, V)


def _case(N, D, V, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(V, D, generator=g, dtype=dtype) / D ** 0.5).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::3] = -100
    return h, W, b, t


def _eager(h, W, b, t, eps, ignore_index=-100):
    z = F.linear(h, W, b)
    return (F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=eps, reduction="none"),
            torch.logsumexp(z, -1))


def _grads(loss, lse, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    cl, cs = torch.randn(loss.shape, generator=g, dtype=loss.dtype), torch.randn(lse.shape, generator=g,
                                                                                 dtype=lse.dtype)
    return torch.autograd.grad((loss * cl).sum() + (lse * cs).sum(), params)


@pytest.mark.parametrize("N, D, V", SIZES)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_op_matches_eager_in_fp64(N, D, V, eps, bias):
    h, W, b, t = _case(N, D, V, bias)
    params = [h, W] + ([b] if bias else [])
    loss, lse = linear_cross_entropy(h, W, b, t, label_smoothing=eps)
    ref_loss, ref_lse = _eager(h, W, b, t, eps)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(("h", "weight", "bias"), _grads(loss, lse, params), _grads(ref_loss, ref_lse, params)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_reference_blocks_are_longer_on_a_gpu():
    """4 MiB of logits per block on a CPU, 64 MiB elsewhere (launches cost more than a block's arithmetic there)."""
    assert lce_ref._rows(32000, torch.device("cpu")) == 32
    assert lce_ref._rows(32000, torch.device("cuda")) == 524
    assert lce_ref._rows(10 ** 7, torch.device("cuda")) == 16


def test_op_reference_blocks_rows(monkeypatch):
    # NB: 16 rows per block of logits: the 130 rows run in 9 blocks
    monkeypatch.setattr(lce_ref, "ROWS", 16 * 200)
    h, W, b, t = _case(130, 40, 200)
    loss, lse = linear_cross_entropy(h, W, b, t, label_smoothing=0.2)
    ref_loss, ref_lse = _eager(h, W, b, t, 0.2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(loss, lse, [h, W, b]), _grads(ref_loss, ref_lse, [h, W, b])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_op_gradcheck_and_only_one_cotangent():
    h, W, b, t = _case(6, 4, 9)
    assert torch.autograd.gradcheck(lambda h, W, b: linear_cross_entropy(h, W, b, t, label_smoothing=0.3), (h, W, b))
    # the loss alone (lse's cotangent None) and the lse alone
    loss, lse = linear_cross_entropy(h, W, b, t)
    ref_loss, ref_lse = _eager(h, W, b, t, 0.0)
    for a, r in [(loss.sum(), ref_loss.sum()), (lse.sum(), ref_lse.sum())]:
        for got, want in zip(torch.autograd.grad(a, [h, W, b], retain_graph=True),
                             torch.autograd.grad(r, [h, W, b], retain_graph=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_all_targets_ignored_and_custom_ignore_index():
    h, W, b, t = _case(5, 4, 7)
    t[:] = 3
    loss, _ = linear_cross_entropy(h, W, b, t, ignore_index=3)
    assert torch.equal(loss, torch.zeros_like(loss))
    (gh,) = torch.autograd.grad(loss.sum(), [h])
    assert torch.equal(gh, torch.zeros_like(gh))


def test_bad_arguments_are_refused():
    h, W, b, t = _case(5, 4, 7)
    with pytest.raises(IndexError, match="out of bounds"):
        linear_cross_entropy(h, W, b, torch.full((5,), 7))
    with pytest.raises(ValueError, match=r"h \[N, D\] and weight \[V, D\]"):
        linear_cross_entropy(h, W.T, b, t)
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(h, W, b, t[:4])
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(h, W, b, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="impl"):
        linear_ce.lce_forward(h, W, b, t, impl="cuda")
    with pytest.raises(ValueError, match="fp32 / bf16 / fp16"):
        linear_ce.lce_forward(h, W, b, t, impl="triton")  # fp64


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    h, W, b, t = _case(5, 4, 7, dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_ce.lce_forward(h.detach(), W.detach(), b.detach(), t, impl="triton")


def test_the_default_picks_the_kernels_on_cuda_only():
    h = torch.zeros(2, 8)
    assert not linear_ce.kernel_serves(h, torch.zeros(5, 8))  # CPU
    assert not linear_ce.kernel_serves(torch.zeros(2, 8, device="meta"), torch.zeros(5, 8, device="meta"))


# ------------------------------------------------------------------------------------ kernels against the reference
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


# NB: the interpreter takes ~10 s a case at the two larger sizes: those run with the slow tests
@pytest.mark.parametrize("N, D, V", SIZES[:2] + [pytest.param(*ndv, marks=pytest.mark.slow)
                                                 for ndv in (SIZES[2], (65, 24, 130))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps, bias", [(0.0, True), (0.1, False)])
def test_triton_matches_the_reference(N, D, V, dtype, eps, bias):
    h, W, b, t = (x.detach() if x is not None and x.is_floating_point() else x
                  for x in _case(N, D, V, bias, dtype=torch.float32))
    if N > 1:
        t[1] = 5  # a target that is not ignored
    h, W = h.to(dtype), W.to(dtype)
    b = None if b is None else b.to(dtype)
    gen = torch.Generator().manual_seed(2)
    gl, gs = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    want = linear_ce.lce_forward(h, W, b, t, -100, eps, impl="reference")
    got = linear_ce.lce_forward(h, W, b, t, -100, eps, impl="triton")
    for name, x, y in zip(("loss", "lse"), got, want):
        torch.testing.assert_close(x, y, **TOL[dtype], msg=name)
    want_g = linear_ce.lce_backward(gl, gs, h, W, b, t, want[1], -100, eps, impl="reference")
    got_g = linear_ce.lce_backward(gl, gs, h, W, b, t, want[1], -100, eps, impl="triton")
    for name, x, y in zip(("h", "weight", "bias"), got_g, want_g):
        if y is None:
            assert x is None, name
            continue
        assert x.dtype == y.dtype == dtype, name
        torch.testing.assert_close(x.float(), y.float(), **TOL[dtype], msg=name)


def test_triton_one_cotangent_and_a_bad_target():
    h, W, b, t = (x.detach() for x in _case(9, 8, 33, dtype=torch.float32))
    loss, lse = linear_ce.lce_forward(h, W, b, t, impl="reference")
    for gl, gs in [(torch.ones(9), None), (None, torch.ones(9))]:
        want = linear_ce.lce_backward(gl, gs, h, W, b, t, lse, impl="reference")
        got = linear_ce.lce_backward(gl, gs, h, W, b, t, lse, impl="triton")
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)
    t[2] = 40  # outside [0, 33): the kernels cannot raise without a sync; the row's loss is NaN, the others exact
    got, _ = linear_ce.lce_forward(h, W, b, t, impl="triton")
    assert torch.isnan(got[2]) and not torch.isnan(got[torch.arange(9) != 2]).any()


def test_triton_reads_strided_targets():
    """A target that is a strided view (labels[..., 0] of [N, 2] labels) reads its own rows."""
    h, W, b, t = (x.detach() for x in _case(70, 8, 33, dtype=torch.float32))
    labels = torch.stack([t, torch.randint(0, 33, (70,))], -1)
    strided = labels[:, 0]
    assert strided.stride() == (2,)
    want = linear_ce.lce_forward(h, W, b, t, impl="reference")
    got = linear_ce.lce_forward(h, W, b, strided, impl="triton")
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)
    g = torch.ones(70)
    for x, y in zip(linear_ce.lce_backward(g, g, h, W, b, strided, want[1], impl="triton"),
                    linear_ce.lce_backward(g, g, h, W, b, t, want[1], impl="reference")):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)


def test_kernels_that_fail_where_the_default_picked_them_fall_back_to_the_reference_with_a_warning(monkeypatch):
    import types

    from adjoint_compile.errors import AdjointCompileWarning

    def broken(*a, **k):
        raise RuntimeError("no such GPU feature")
    monkeypatch.setattr(linear_ce, "kernel_serves", lambda h, w: True)
    monkeypatch.setattr(linear_ce, "KERNEL_FAILED", None)
    monkeypatch.setattr(linear_ce, "_triton", lambda: types.SimpleNamespace(lce_forward_triton=broken,
                                                                           lce_backward_triton=broken))
    h, W, b, t = _case(9, 4, 7)
    with pytest.warns(AdjointCompileWarning, match="no such GPU feature"):
        loss, lse = linear_cross_entropy(h, W, b, t)
    ref_loss, _ = _eager(h, W, b, t, 0.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert "no such GPU feature" in linear_ce.KERNEL_FAILED
    loss.sum().backward()  # the reference from then on, without another warning
    with pytest.raises(RuntimeError, match="no such GPU feature"):  # asked for by name: raised
        monkeypatch.setattr(linear_ce, "KERNEL_FAILED", None)
        linear_ce.lce_forward(h.detach().float(), W.detach().float(), None, t, impl="triton")


def test_triton_large_logits_in_a_partial_block_of_rows():
    """Logits near 100 (exp overflows fp32): the rows past N in the last block must add nothing to ∂W and ∂b."""
    h, W, b, t = (x.detach() for x in _case(5, 8, 70, dtype=torch.float32))
    b = b + 100.0
    loss, lse = linear_ce.lce_forward(h, W, b, t, impl="reference")
    got = linear_ce.lce_forward(h, W, b, t, impl="triton")
    for x, y in zip(got, (loss, lse)):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-4)
    g = torch.ones(5)
    for x, y in zip(linear_ce.lce_backward(g, g, h, W, b, t, lse, impl="triton"),
                    linear_ce.lce_backward(g, g, h, W, b, t, lse, impl="reference")):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_atomic_backward_matches_the_reference(monkeypatch, dtype):
    """The one-pass backward (∂W and ∂b added with atomics), for the GPU's tuning: same values to rounding."""
    from adjoint_compile.kernels.linear_ce import triton as lce_triton
    monkeypatch.setitem(lce_triton.CONFIG, "backward", "atomic")
    h, W, b, t = (x.detach().to(dtype) if x.is_floating_point() else x for x in _case(130, 40, 200))
    loss, lse = linear_ce.lce_forward(h, W, b, t, -100, 0.1, impl="reference")
    gen = torch.Generator().manual_seed(3)
    gl, gs = torch.randn(130, generator=gen), torch.randn(130, generator=gen)
    want = linear_ce.lce_backward(gl, gs, h, W, b, t, lse, -100, 0.1, impl="reference")
    got = linear_ce.lce_backward(gl, gs, h, W, b, t, lse, -100, 0.1, impl="triton")
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    for name, x, y in zip(("h", "weight", "bias"), got, want):
        assert x.dtype == y.dtype == dtype, name
        torch.testing.assert_close(x.float(), y.float(), **tol, msg=name)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_frozen_head_skips_its_weight_gradient(impl, monkeypatch):
    """``need_weight=False`` gives ∂h alone; through the op, a head that requires no gradient asks for no ∂W."""
    h, W, b, t = (x.detach() for x in _case(70, 8, 33, dtype=torch.float32))
    _, lse = linear_ce.lce_forward(h, W, b, t, impl="reference")
    g = torch.ones(70)
    dh, dw, db = linear_ce.lce_backward(g, g, h, W, b, t, lse, impl=impl, need_weight=False)
    want = linear_ce.lce_backward(g, g, h, W, b, t, lse, impl="reference")
    assert dw is None and db is None
    torch.testing.assert_close(dh, want[0], rtol=2e-5, atol=2e-5)

    asked = []
    real = linear_ce.lce_backward

    def spy(*a, **k):
        asked.append(a[-1] if len(a) > 10 else k.get("need_weight", True))
        return real(*a, **k)
    monkeypatch.setattr(linear_ce, "lce_backward", spy)
    h64, W64, b64, t64 = _case(9, 4, 7)
    W64.requires_grad_(False)
    b64.requires_grad_(False)
    loss, _ = linear_cross_entropy(h64, W64, b64, t64, label_smoothing=0.1)
    (gh,) = torch.autograd.grad(loss.sum(), [h64])
    ref_loss, _ = _eager(h64, W64, b64, t64, 0.1)
    torch.testing.assert_close(gh, torch.autograd.grad(ref_loss.sum(), [h64])[0], rtol=1e-10, atol=1e-12)
    assert asked == [False]


@pytest.mark.parametrize("layout", ["column", "expanded"])
def test_triton_reads_a_strided_bias(layout):
    """A bias that is a column of a [V, 2] parameter (stride 2) or a scalar expanded to [V] (stride 0) reads its own
    entries (the kernels read it as [V] one apart, silently off before)."""
    h, W, _, t = (x.detach() for x in _case(5, 3, 7, dtype=torch.float32))
    base = torch.randn(7, 2) if layout == "column" else torch.randn(1)
    b = base[:, 0] if layout == "column" else base.expand(7)
    assert not b.is_contiguous()
    gl, gs = torch.randn(5), torch.randn(5)
    want = linear_ce.lce_forward(h, W, b.contiguous(), t, impl="reference")
    got = linear_ce.lce_forward(h, W, b, t, impl="triton")
    for name, x, y in zip(("loss", "lse"), got, want):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5, msg=name)
    want_g = linear_ce.lce_backward(gl, gs, h, W, b.contiguous(), t, want[1], impl="reference")
    got_g = linear_ce.lce_backward(gl, gs, h, W, b, t, want[1], impl="triton")
    for name, x, y in zip(("h", "weight", "bias"), got_g, want_g):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("precision, fp32_highest, want", [("highest", "tf32x3", "tf32x3"), ("highest", "ieee", "ieee"),
                                                             ("high", "ieee", "tf32"), ("medium", "tf32x3", "tf32")])
def test_fp32_products_follow_the_matmul_precision(precision, fp32_highest, want, monkeypatch):
    """TF32 where torch lets cuBLAS use it; at "highest" three TF32 products by default (the kernels' products in
    fp32 on CUDA cores ran ~25x slower than the eager head on a GPU), plain fp32 on request; the kernels take
    either and match the reference (the interpreter multiplies in fp32 whatever the precision)."""
    from adjoint_compile.kernels.linear_ce import triton as lce_triton
    monkeypatch.setitem(lce_triton.CONFIG, "fp32_highest", fp32_highest)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert lce_triton.precision() == want
        h, W, b, t = (x.detach().float() if x.is_floating_point() else x for x in _case(70, 24, 130))
        for got, ref in zip(linear_ce.lce_forward(h, W, b, t, -100, 0.0, impl="triton"),
                            linear_ce.lce_forward(h, W, b, t, -100, 0.0, impl="reference")):
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    finally:
        torch.set_float32_matmul_precision(before)
