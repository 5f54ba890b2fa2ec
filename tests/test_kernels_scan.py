"""linear_scan: every variant against the per-step loop (values and gradients), both impls, and its compile
contract (one node forward and backward, no graph breaks, dynamic shapes).

Triton kernels run under TRITON_INTERPRET=1 (set here before the kernels are first imported; `make test` sets it
too) on small sizes only: the interpreter runs one Python step per kernel op.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from adjoint_compile import ops  # noqa: E402
from adjoint_compile.kernels import scan as K  # noqa: E402
from adjoint_compile.ops import linear_scan  # noqa: E402

IMPLS = ["reference", "cpu", "triton"]


def _inputs(shape, dim, dtype=torch.float64, h0=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a in (-1, 1) with a few exact zeros: negative and zero decays must be exact (no cumprod division)
    a = torch.rand(shape, generator=g, dtype=torch.float64) * 1.8 - 0.9
    a[a.abs() < 0.05] = 0.0
    b = torch.randn(shape, generator=g, dtype=torch.float64)
    d = dim % len(shape)
    hs = list(shape[:d]) + list(shape[d + 1:])
    h = torch.randn(hs, generator=g, dtype=torch.float64) if h0 else None
    cast = lambda x: None if x is None else x.to(dtype).requires_grad_()  # noqa: E731
    return cast(a), cast(b), cast(h)


def _grads(out, ins, g):
    got = torch.autograd.grad(out, [x for x in ins if x is not None], g, allow_unused=True)
    got = list(got)
    res = []
    for x in ins:
        if x is None:
            continue
        gx = got.pop(0)
        res.append(torch.zeros_like(x) if gx is None else gx)
    return res


def _check(shape, dim, reverse, window, use_h0, impl, dtype=torch.float64, atol=1e-10, rtol=1e-10, seed=0):
    a, b, h0 = _inputs(shape, dim, dtype, use_h0, seed)
    ins = [a, b, h0]
    h = linear_scan(a, b, h0, dim=dim, reverse=reverse, window=window, impl=impl)
    # the spec, in fp64 from the same (possibly rounded) values
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    h064 = None if h0 is None else h0.detach().double().requires_grad_()
    ref = K.naive_scan(a64, b64, h064, dim, reverse, window)
    assert h.dtype == dtype and h.shape == a.shape
    torch.testing.assert_close(h.double(), ref, atol=atol, rtol=rtol)
    g = torch.randn(a.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    mine = _grads(h, ins, g.to(dtype))
    want = _grads(ref, [a64, b64, h064], g)
    for name, x, y in zip("a b h0".split(), mine, want):
        assert x.dtype == dtype, name
        torch.testing.assert_close(x.double(), y, atol=atol, rtol=rtol, msg=lambda m: f"grad {name}: {m}")


# ---------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("T", [1, 2, 7, 50, 131])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("wsel", ["full", "1", "3", "T-1", "T", "2T"])
@pytest.mark.parametrize("use_h0", [False, True])
def test_reference_matches_loop(T, reverse, wsel, use_h0):
    window = {"full": None, "1": 1, "3": 3, "T-1": max(T - 1, 1), "T": T, "2T": 2 * T}[wsel]
    _check((2, T, 3), 1, reverse, window, use_h0, "reference")


@pytest.mark.parametrize("reverse", [False, True])
def test_reference_long_blocked_with_recursive_carries(reverse):
    # T = 3001: 54 chunks of 55 steps (> the sequential threshold, so the carries recurse) plus a 31-step tail
    _check((1, 3001, 2), 1, reverse, None, True, "reference")
    _check((1, 3001, 2), 1, reverse, 7, True, "reference")


def test_reference_one_million_steps():
    """1M steps, checked at every step against a plain Python float loop on one channel."""
    T = (1 << 20) + 3
    g = torch.Generator().manual_seed(3)
    a = torch.rand(1, T, 2, generator=g, dtype=torch.float64) * 0.2 + 0.8
    b = torch.randn(1, T, 2, generator=g, dtype=torch.float64)
    h = linear_scan(a.float(), b.float(), dim=1, impl="reference")
    hr = linear_scan(a, b, dim=-2, reverse=True, impl="reference")
    for c in range(2):
        av, bv = a[0, :, c].tolist(), b[0, :, c].tolist()
        s, fwd = 0.0, []
        for t in range(T):
            s = av[t] * s + bv[t]
            fwd.append(s)
        torch.testing.assert_close(h[0, :, c].double(), torch.tensor(fwd, dtype=torch.float64), atol=1e-4, rtol=1e-5)
    av, bv = a[0, :, 1].tolist(), b[0, :, 1].tolist()
    s = 0.0
    rev = [0.0] * T
    for t in range(T - 1, -1, -1):
        s = av[t] * s + bv[t]
        rev[t] = s
    torch.testing.assert_close(hr[0, :, 1], torch.tensor(rev, dtype=torch.float64), atol=1e-9, rtol=1e-9)


def test_window_is_not_a_difference_of_scans():
    """a = 1 and huge early inputs: h_t - h_{t-W} would cancel catastrophically in fp32; the window must not."""
    T, W = 200, 2
    a = torch.ones(1, T, 1)
    b = torch.ones(1, T, 1)
    b[0, :100] = 1e8
    for impl in IMPLS:
        h = linear_scan(a, b, dim=1, window=W, impl=impl)
        torch.testing.assert_close(h[0, 101:, 0], torch.full((T - 101,), 2.0), atol=0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- triton
@pytest.mark.parametrize("T", [1, 6, 13])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("wsel", ["full", "1", "3", "T-1", "T", "2T"])
def test_triton_matches_loop(T, reverse, wsel):
    window = {"full": None, "1": 1, "3": 3, "T-1": max(T - 1, 1), "T": T, "2T": 2 * T}[wsel]
    _check((2, T, 3), 1, reverse, window, True, "triton")
    if wsel in ("full", "3"):
        _check((2, T, 3), 1, reverse, window, False, "triton")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_triton_tiled_variant_matches_loop(monkeypatch, reverse, window):
    """The tl.associative_scan variant (the CUDA default) on tiles of 8 steps: 19 steps = 2 tiles + a partial."""
    tr = pytest.importorskip("adjoint_compile.kernels.scan.triton")
    monkeypatch.setattr(tr, "TILED", True)
    _check((1, 19, 3), 1, reverse, window, True, "triton")


def test_impl_dispatch():
    cpu = torch.device("cpu")
    assert K.resolve_impl(None, cpu) == "cpu"  # a C compiler is there wherever inductor runs on CPU
    assert K.resolve_impl("reference", cpu) == "reference"
    assert K.resolve_impl("cpu", cpu) == "cpu"
    with pytest.raises(ValueError, match="impl"):
        K.resolve_impl("cuda", cpu)
    with pytest.raises(ValueError, match="CPU tensors"):
        K.resolve_impl("cpu", torch.device("cuda"))


# ---------------------------------------------------------------------------------------------- compiled CPU kernel
@pytest.mark.parametrize("T", [1, 2, 7, 50, 131])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("wsel", ["full", "1", "T-1", "2T"])
@pytest.mark.parametrize("use_h0", [False, True])
def test_cpu_kernel_matches_loop(T, reverse, wsel, use_h0):
    window = {"full": None, "1": 1, "T-1": max(T - 1, 1), "2T": 2 * T}[wsel]
    _check((2, T, 3), 1, reverse, window, use_h0, "cpu")


@pytest.mark.parametrize("reverse", [False, True])
def test_cpu_kernel_matches_reference_fp32(reverse):
    """The fast path against the trusted slow one in fp32, at shard-like and long sizes (contiguous, no copies)."""
    from adjoint_compile.kernels.scan import cpu
    g = torch.Generator().manual_seed(3)
    for shape in [(2, 128, 256), (3, 1001, 5)]:
        a, b = torch.rand(shape, generator=g), torch.randn(shape, generator=g)
        h0 = torch.randn(shape[0], shape[2], generator=g)
        torch.testing.assert_close(cpu.scan_cpu(a, b, h0, 1, reverse), K.scan_ref(a, b, h0, 1, reverse),
                                   atol=1e-5, rtol=1e-5)
        out = torch.full((shape[0], shape[1] + 4, shape[2]), float("nan"))
        # into a view of a bigger buffer (the backward's μ.narrow(...)): only that view is written
        view = out.narrow(1, 2, shape[1])
        cpu.prim_cpu(a, b, h0, 1, reverse, view)
        torch.testing.assert_close(view, K.scan_ref(a, b, h0, 1, reverse), atol=1e-5, rtol=1e-5)
        assert out[:, :2].isnan().all() and out[:, -2:].isnan().all()


def _fresh_cpu_kernel(monkeypatch):
    from adjoint_compile.kernels.scan import cpu
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)
    return cpu


def test_without_a_c_compiler_cpu_falls_back_to_the_reference(monkeypatch, caplog):
    cpu = _fresh_cpu_kernel(monkeypatch)
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    with caplog.at_level("WARNING", logger=cpu.__name__):
        assert not cpu.available()
    assert "no C compiler" in cpu.why_unavailable() and "reference" in caplog.text
    assert K.resolve_impl(None, torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="unavailable"):
        linear_scan(torch.ones(1, 3), torch.ones(1, 3), impl="cpu")
    a, b = torch.rand(2, 9, 3), torch.randn(2, 9, 3)
    torch.testing.assert_close(linear_scan(a, b), K.naive_scan(a, b))


def test_a_failing_compiler_falls_back_with_its_message(monkeypatch, tmp_path):
    cpu = _fresh_cpu_kernel(monkeypatch)
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho 'no such luck' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    assert not cpu.available()
    assert "no such luck" in cpu.why_unavailable()


def test_cpu_kernel_can_be_switched_off(monkeypatch):
    cpu = _fresh_cpu_kernel(monkeypatch)
    monkeypatch.setenv("ADJOINT_COMPILE_CPU_KERNEL", "0")
    assert not cpu.available() and "ADJOINT_COMPILE_CPU_KERNEL" in cpu.why_unavailable()


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_scan(torch.ones(1, 3), torch.ones(1, 3), impl="triton")


# ---------------------------------------------------------------------------------------------- both impls
@pytest.mark.parametrize("impl, shape", [("reference", (2, 5, 2)), ("cpu", (2, 5, 2)), ("triton", (1, 4, 2))])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.slow
def test_gradcheck(impl, shape, window):
    a, b, h0 = _inputs(shape, 1)
    for rev in (False, True) if impl != "triton" else (window is None,):
        f = lambda a, b, h0: linear_scan(a, b, h0, dim=1, reverse=rev, window=window, impl=impl)  # noqa: E731
        assert torch.autograd.gradcheck(f, (a, b, h0), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 4])
def test_half_precision(impl, dtype, window):
    """fp32 accumulation, output in the input dtype. Tolerance: one rounding of the output / gradient
    (bf16: 2^-8 relative, fp16: 2^-11) and the inputs' rounding is shared with the fp64 spec, so
    rtol = 2 ulp of the dtype, atol = the same times the typical magnitude (~1)."""
    ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    _check((2, 11, 3), 1, True, window, True, impl, dtype=dtype, atol=4 * ulp, rtol=2 * ulp)
    _check((2, 11, 3), 1, False, window, True, impl, dtype=dtype, atol=4 * ulp, rtol=2 * ulp)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_dtypes_promote(impl):
    a = torch.rand(2, 5, 3)
    b = torch.randn(2, 5, 3, dtype=torch.bfloat16, requires_grad=True)
    h0 = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h = linear_scan(a, b, h0, impl=impl)
    assert h.dtype == torch.float32
    gb, gh0 = torch.autograd.grad(h.sum(), [b, h0])
    assert gb.dtype == torch.bfloat16 and gh0.dtype == torch.float64
    ref = K.naive_scan(a.double(), b.double(), h0.detach(), 1)
    torch.testing.assert_close(h.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["dim0", "dim-1", "dim2_of_4d", "transposed", "strided", "expanded"])
def test_other_dims_and_layouts(impl, case):
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if case == "dim0":
        a, b, dim = r(7, 3), r(7, 3), 0
    elif case == "dim-1":
        a, b, dim = r(2, 3, 7), r(2, 3, 7), -1
    elif case == "dim2_of_4d":
        a, b, dim = r(2, 3, 7, 5), r(2, 3, 7, 5), 2
    elif case == "transposed":
        a, b, dim = r(3, 7, 2).transpose(0, 2), r(2, 7, 3), 1     # [2, 7, 3], non-contiguous a
    elif case == "strided":
        a, b, dim = r(2, 14, 6)[:, ::2, 1::2], r(4, 7, 3)[::2], 1  # step and channel strides != 1
    else:
        a, b, dim = r(2, 1, 3).expand(2, 7, 3), r(2, 7, 3), 1       # stride-0 steps
    a = (a.tanh()).requires_grad_()
    b = b.requires_grad_()
    d = dim % a.ndim
    h0 = r(*(list(a.shape[:d]) + list(a.shape[d + 1:]))).requires_grad_()
    for window in (None, 2):
        h = linear_scan(a, b, h0, dim=dim, window=window, impl=impl)
        ref = K.naive_scan(a, b, h0, dim, False, window)
        torch.testing.assert_close(h, ref, atol=1e-10, rtol=1e-10)
        go = torch.randn(a.shape, generator=g, dtype=torch.float64)
        for x, y in zip(torch.autograd.grad(h, [a, b, h0], go), torch.autograd.grad(ref, [a, b, h0], go)):
            torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_sharding_by_carrying_h0(impl, reverse):
    """Scanning slices with h0 = the carried state equals one scan, values and all gradients (h0's included)."""
    a, b, h0 = _inputs((2, 11, 3), 1)
    g = torch.randn(2, 11, 3, dtype=torch.float64)
    whole = linear_scan(a, b, h0, dim=1, reverse=reverse, impl=impl)
    cuts = [(0, 4), (4, 9), (9, 11)]
    parts, carry = {}, h0
    for lo, hi in (cuts[::-1] if reverse else cuts):
        hp = linear_scan(a[:, lo:hi], b[:, lo:hi], carry, dim=1, reverse=reverse, impl=impl)
        parts[lo] = hp
        carry = hp.select(1, 0) if reverse else hp.select(1, -1)
    sharded = torch.cat([parts[lo] for lo, _ in cuts], 1)
    torch.testing.assert_close(sharded, whole, atol=1e-12, rtol=1e-12)
    for x, y in zip(torch.autograd.grad(sharded, [a, b, h0], g), torch.autograd.grad(whole, [a, b, h0], g)):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, arg", [
    (dict(b=torch.ones(2, 4, 3)), "b"),
    (dict(window=0), "window"),
    (dict(window=-2), "window"),
    (dict(window=2.5), "window"),
    (dict(dim=3), "dim"),
    (dict(dim=-4), "dim"),
    (dict(a=torch.ones(2, 5, 3, dtype=torch.int64)), "a"),
    (dict(b=torch.ones(2, 5, 3, dtype=torch.int32)), "b"),
    (dict(h0=torch.ones(2, 5)), "h0"),
    (dict(h0=torch.ones(2, 3, dtype=torch.int64)), "h0"),
    (dict(a=[1.0, 2.0]), "a"),
    (dict(impl="cuda"), "impl"),
    (dict(reverse="yes"), "reverse"),
])
def test_bad_input_raises_value_error_naming_the_argument(kwargs, arg):
    args = dict(a=torch.ones(2, 5, 3), b=torch.ones(2, 5, 3), h0=None)
    args.update(kwargs)
    a, b, h0 = args.pop("a"), args.pop("b"), args.pop("h0")
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        linear_scan(a, b, h0, **args)


# ---------------------------------------------------------------------------------------------- compile
def _model(a, b, h0):
    return linear_scan(torch.sigmoid(a), b * 2.0, h0, dim=1).sin().sum()


def test_one_dynamo_node():
    graphs = []

    def grab(gm, ex):
        graphs.append(gm)
        return gm.forward

    a, b, h0 = _inputs((2, 9, 3), 1, torch.float32)
    torch.compile(_model, backend=grab, fullgraph=True)(a, b, h0)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    assert targets.count(torch.ops.adjoint_compile.linear_scan.default) == 1
    assert not any("scan" in str(t) and t is not torch.ops.adjoint_compile.linear_scan.default for t in targets)


def test_one_node_in_forward_and_backward_graphs():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fw, bw = [], []

    def keep(store):
        def compiler(gm, ex):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    a, b, h0 = _inputs((2, 9, 3), 1, torch.float32)
    out = torch.compile(_model, backend=aot_autograd(fw_compiler=keep(fw), bw_compiler=keep(bw)),
                        fullgraph=True)(a, b, h0)
    out.backward()
    count = lambda gm, op: sum(n.target is op for n in gm.graph.nodes)  # noqa: E731
    assert count(fw[0], torch.ops.adjoint_compile.linear_scan.default) == 1
    assert count(bw[0], torch.ops.adjoint_compile.linear_scan_backward.default) == 1
    assert count(bw[0], torch.ops.adjoint_compile.linear_scan.default) == 0


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_matches_eager(backend):
    a, b, h0 = _inputs((2, 9, 3), 1, torch.float32)
    want = torch.autograd.grad(_model(a, b, h0), [a, b, h0])
    out = torch.compile(_model, backend=backend, fullgraph=True)(a, b, h0)
    torch.testing.assert_close(out, _model(a, b, h0))
    for x, y in zip(torch.autograd.grad(out, [a, b, h0]), want):
        torch.testing.assert_close(x, y)


def test_windowed_reverse_compiles_fullgraph():
    def f(a, b):
        return linear_scan(a, b, dim=-1, reverse=True, window=3).square().sum()

    a, b, _ = _inputs((3, 8), -1, torch.float32, h0=False)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b)
    torch.testing.assert_close(out, f(a, b))
    want = torch.autograd.grad(f(a, b), [a, b])
    for x, y in zip(torch.autograd.grad(out, [a, b]), want):
        torch.testing.assert_close(x, y)


def test_dynamic_shapes_do_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(_model, backend=cnt, fullgraph=True, dynamic=True)
    for T in (5, 7, 12):
        a, b, h0 = _inputs((2, T, 3), 1, torch.float32, seed=T)
        out = f(a, b, h0)
        torch.testing.assert_close(out, _model(a, b, h0))
        want = torch.autograd.grad(_model(a, b, h0), [a, b, h0])
        for x, y in zip(torch.autograd.grad(out, [a, b, h0]), want):
            torch.testing.assert_close(x, y)
    assert cnt.frame_count == 1


def test_public_names():
    assert ops.linear_scan is linear_scan
    for name in ("naive_scan", "scan_ref", "scan_triton", "scan_backward_ref", "scan_backward_triton"):
        assert callable(getattr(K, name))
    schema = str(torch.ops.adjoint_compile.linear_scan.default._schema)
    assert "Tensor a, Tensor b, Tensor? h0, int dim, bool reverse, int? window, str? impl" in schema


# ------------------------------------------------------------------- the CPU kernel on strided and broadcast layouts
def _layout(kind, shape, d, g):
    """A float64 tensor of ``shape`` in a layout of the named kind (values random)."""
    if kind == "contiguous":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "time-inner":       # an inductor output: the step stride smaller than a channel's
        order = [i for i in range(len(shape)) if i != d][:-1] + [d, len(shape) - 1]
        base = torch.randn([shape[i] for i in order], generator=g, dtype=torch.float64)
        return base.permute([order.index(i) for i in range(len(shape))])
    if kind == "broadcast":        # a decay per (batch, step, head), broadcast over the trailing channels
        small = torch.rand(list(shape[:3]) + [1] * (len(shape) - 3), generator=g, dtype=torch.float64)
        return small.expand(shape)
    if kind == "transposed":
        return torch.randn(list(reversed(shape)), generator=g, dtype=torch.float64).permute(
            list(reversed(range(len(shape)))))
    raise AssertionError(kind)


@pytest.mark.parametrize("shape", [(2, 7, 3, 4, 5), (1, 1, 2, 3, 8), (3, 13, 1, 5, 1), (2, 40, 3, 2, 6)])
@pytest.mark.parametrize("a_kind", ["contiguous", "broadcast", "time-inner", "transposed"])
@pytest.mark.parametrize("b_kind", ["contiguous", "time-inner", "transposed"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("h0_kind", [None, "contiguous", "transposed"])
def test_cpu_kernel_on_strided_layouts_matches_loop(shape, a_kind, b_kind, reverse, h0_kind):
    """Permuted and broadcast inputs, written into a permuted output, exact against the per-step loop."""
    from adjoint_compile.kernels.scan import cpu
    g = torch.Generator().manual_seed(sum(shape))
    a, b = _layout(a_kind, shape, 1, g), _layout(b_kind, shape, 1, g)
    hshape = shape[:1] + shape[2:]
    h0 = None if h0_kind is None else _layout(h0_kind, hshape, 0, g)
    want = K.naive_scan(a.contiguous(), b.contiguous(), None if h0 is None else h0.contiguous(), 1, reverse, None)
    torch.testing.assert_close(cpu.prim_cpu(a, b, h0, 1, reverse), want, atol=1e-12, rtol=1e-12)
    out = _layout("time-inner", shape, 1, g).fill_(float("nan"))
    cpu.prim_cpu(a, b, h0, 1, reverse, out)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_cpu_kernel_loops_need_no_copy_for_permuted_and_broadcast_inputs():
    """The layouts of transformers' Mamba-2 scan in a shard program: b with the step stride 8 (``[B, H, P, T, N]`` in
    memory), a broadcast over P and N. The kernel walks them as they are: no contiguous copy, the inner loop over N
    at unit stride for b and out, stride 0 for a."""
    from adjoint_compile.kernels.scan import cpu
    shape = (2, 254, 4, 16, 8)
    b = torch.empty(2, 4, 16, 254, 8).permute(0, 3, 1, 2, 4)
    a = torch.empty(2, 254, 4)[..., None, None].expand(shape)
    out = torch.empty(shape)
    plan = cpu.loops(shape, 1, [b.stride(), out.stride(), a.stride(), (0,) * 5])
    assert plan is not None
    sizes, outer, n_in, inner = plan
    assert n_in == 8 and inner[:3] == [1, 1, 0] and sorted(sizes) == [2, 4, 16]
    # a contiguous [B, T, C] scan: one outer loop over B, the channels inner
    c = torch.empty(3, 9, 5)
    assert cpu.loops(c.shape, 1, [c.stride()] * 3) == ([3], [[45], [45], [45]], 5, [1, 1, 1])
    # dims that are one for every tensor merge; a [B, T] scan has one element inner, one row per batch
    e = torch.empty(3, 9, 4, 5)
    assert cpu.loops(e.shape, 1, [e.stride()] * 2) == ([3], [[180], [180]], 20, [1, 1])
    f = torch.empty(64, 9)
    assert cpu.loops(f.shape, 1, [f.stride()] * 2) == ([64], [[9], [9]], 1, [0, 0])


def test_cpu_kernel_with_more_outer_dims_than_loops_copies_and_stays_exact():
    from adjoint_compile.kernels.scan import cpu
    g = torch.Generator().manual_seed(5)
    shape = (2, 6, 3, 2, 3, 2, 3, 2)
    perm = [7, 1, 5, 3, 0, 2, 4, 6]
    b = torch.randn([shape[i] for i in perm], generator=g, dtype=torch.float64).permute(
        [perm.index(i) for i in range(len(shape))])
    a = torch.rand(shape, generator=g, dtype=torch.float64)
    strides = [b.stride(), torch.empty(shape).stride(), a.stride(), (0,) * len(shape)]
    assert cpu.loops(shape, 1, strides) is None           # the fallback path is the one under test
    torch.testing.assert_close(cpu.prim_cpu(a, b, None, 1, False),
                               K.naive_scan(a, b.contiguous(), None, 1, False, None), atol=1e-12, rtol=1e-12)
