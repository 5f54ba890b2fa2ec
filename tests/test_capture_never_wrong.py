"""Never silently different: loops that write into buffers (nested, partial, through views), the graph the inner
compiler gets when nothing is rewritten, and the first-call forward check that guards every rewrite.

The oracle everywhere is the same Python code run eagerly, in fp64."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile import backend as backend_mod
from adjoint_compile.errors import AdjointCompileWarning
from adjoint_compile.runtime.verify import output_mismatch

DT = torch.float64


def _grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)


def _assert_same(fn, compiled, params, *args, tol=1e-10):
    """Loss and every gradient of ``compiled(*args)`` against ``fn(*args)`` run eagerly."""
    want = fn(*args)
    gw = _grads(want, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointCompileWarning)
        got = compiled(*args)
    gg = _grads(got, params)
    assert torch.allclose(got, want, rtol=tol, atol=tol), (float(got), float(want))
    for i, (a, b) in enumerate(zip(gg, gw)):
        assert (a is None) == (b is None), f"gradient {i}: {a is None} vs {b is None}"
        if b is not None:
            assert torch.allclose(a, b, rtol=tol, atol=tol), f"gradient {i}: {(a - b).abs().max()}"


class NestedBuffers(nn.Module):
    """The loop of a library that writes each step into a buffer by index and then copies the buffer into an outer
    one (lru-pytorch's LRU, real-valued)."""

    def __init__(self, form: str, d_in: int = 4, d: int = 8):
        super().__init__()
        self.form, self.d = form, d
        self.a = nn.Parameter(torch.rand(d, dtype=DT))
        self.W = nn.Parameter(torch.randn(d, d_in, dtype=DT) / 2)

    def forward(self, x):
        B, T, _ = x.shape
        out = torch.empty(B, T, self.d, dtype=DT)
        for i, seq in enumerate(x):
            h = torch.zeros(self.d, dtype=DT)
            buf = torch.empty(T, self.d, dtype=DT)
            for j, step in enumerate(seq):
                h = self.a * h + self.W @ step
                if self.form == "setitem":
                    buf[j] = h
                elif self.form == "copy":
                    buf[j].copy_(h)
                else:  # "slice"
                    buf[j, :] = h
            if self.form == "copy":
                out[i].copy_(buf)
            elif self.form == "slice":
                out[i, :, :] = buf
            else:
                out[i] = buf
        return out


@pytest.mark.parametrize("form", ["setitem", "copy", "slice"])
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("shard_size", [None, 2])
def test_nested_buffer_writes_are_exact(form, inner, shard_size):
    torch.manual_seed(0)
    m = NestedBuffers(form)
    x = torch.randn(3, 7, 4, dtype=DT)

    def loss(x):
        return m(x).square().sum()

    opts = {"inner": inner, **({"shard_size": shard_size} if shard_size else {})}
    compiled = torch.compile(loss, backend="adjoint", options=opts)
    _assert_same(loss, compiled, list(m.parameters()), x)
    # the three per-row loops are recognized (and their buffers stacked), whatever is then decided
    report = ac.report(compiled)
    assert len(report.regions) == 3, report


def _loop(write):
    """A loop over T steps whose outputs reach the loss only through the buffer ``write`` fills."""
    a = torch.rand(2, 9, 3, dtype=DT)

    def f(x):
        h = torch.zeros(2, 3, dtype=DT)
        o = torch.zeros(2, 9, 3, dtype=DT)
        for t in range(9):
            h = a[:, t] * h + x[:, t]
            write(o, t, h)
        return (o * torch.arange(1.0, 4.0, dtype=DT)).square().sum()
    return f


def _w_partial(o, t, h):        # the last step is never written: the buffer keeps a zero there
    if t < 8:
        o[:, t] = h


def _w_reversed(o, t, h):       # every index once, in another order than the steps
    o[:, 8 - t] = h


def _w_slice_of_slice(o, t, h):  # a write through a view of a view
    o[:, t][:, :2] = h[:, :2]


def _w_view(o, t, h):           # a write into a view of the buffer made once
    v = o[:, 1:]
    if t > 0:
        v[:, t - 1] = h


def _w_index_put(o, t, h):
    o.index_put_((torch.arange(2), torch.full((2,), t)), h)


def _w_accumulate(o, t, h):     # o[:, t] += h reads the slice it writes
    o[:, t] += h
    o[:, t] += h


def _w_read_back(o, t, h):      # a read of an earlier step from the buffer, before later writes
    o[:, t] = h + (o[:, t - 1] if t else 0)


@pytest.mark.parametrize("write", [_w_partial, _w_reversed, _w_slice_of_slice, _w_view, _w_index_put, _w_accumulate,
                                   _w_read_back], ids=lambda w: w.__name__[3:])
def test_partial_and_indirect_buffer_writes_are_exact(write):
    f = _loop(write)
    x = torch.randn(2, 9, 3, dtype=DT, requires_grad=True)
    compiled = torch.compile(f, backend="adjoint", options={"inner": "eager", "shard_size": 2})
    _assert_same(f, compiled, [x], x)


def test_a_graph_that_keeps_in_place_writes_is_refused_with_a_reason():
    f = _loop(_w_partial)
    report = ac.explain(f, torch.randn(2, 9, 3, dtype=DT, requires_grad=True), options={"shard_size": 2})
    assert report.regions == []
    assert any("writes in place into a tensor it made" in j.reason for j in report.rejections), report


def test_an_in_place_update_of_the_state_is_refused_with_its_remedy():
    """``h += b_t`` in a loop: the remedy is the update as a new value, not the buffer advice."""
    def acc(a, b):
        h, outs = torch.zeros_like(b[:, 0]), []
        for t in range(b.shape[1]):
            h = h * a[:, t]
            h += b[:, t]
            outs.append(h)
        return torch.stack(outs, 1).square().sum()

    a, b = torch.rand(2, 9, 3, dtype=DT), torch.randn(2, 9, 3, dtype=DT)
    report = ac.explain(acc, a, b, options={"shard_size": 2})
    [j] = [j for j in report.rejections if "writes in place" in j.reason]
    assert "h = h + x instead of h += x" in j.reason and "torch.stack" not in j.reason, j.reason


def test_a_loop_whose_steps_alternate_says_the_steps_differ():
    def alternate(a, b):
        h, outs = torch.zeros_like(b[:, 0]), []
        for t in range(b.shape[1]):
            h = a[:, t] * h + b[:, t] if t % 2 == 0 else a[:, t] * h - b[:, t]
            outs.append(h)
        return torch.stack(outs, 1).square().sum()

    a, b = torch.rand(2, 13, 3, dtype=DT), torch.randn(2, 13, 3, dtype=DT)
    report = ac.explain(alternate, a, b, options={"shard_size": 4, "inner": "aot_eager"})
    assert not any(r.rewrite == "adjoint" for r in report.regions), report
    assert "steps differ" in str(report) and "initial state is not a graph value" not in str(report), report


def test_nothing_rewritten_reaches_the_inner_compiler_as_captured(monkeypatch):
    """A tanh RNN (nothing to rewrite) whose graph normalization would change (a no-op cast, an output buffer)."""
    W = torch.randn(4, 4, dtype=DT) / 4

    def rnn(x):
        h = torch.zeros(2, 4, dtype=DT)
        o = torch.empty(2, 5, 4, dtype=DT)
        for t in range(5):
            h = torch.tanh(h.double() @ W + x[:, t])
            o[:, t] = h
        return o.sum()

    seen, given = [], []
    from adjoint_compile.passes import stitch as stitch_mod
    real_backend, real_inner = backend_mod.adjoint_backend, stitch_mod.compile_inner

    def spy_backend(gm, ex, **kw):
        seen.append(gm.code)
        return real_backend(gm, ex, **kw)

    def spy_inner(gm, ex, inner, **kw):
        given.append(gm.code)
        return real_inner(gm, ex, inner, **kw)

    monkeypatch.setattr(stitch_mod, "compile_inner", spy_inner)
    x = torch.randn(2, 5, 4, dtype=DT, requires_grad=True)
    compiled = torch.compile(rnn, backend=lambda gm, ex: spy_backend(gm, ex, options={"inner": "eager"}))
    _assert_same(rnn, compiled, [x], x)
    assert len(seen) == 1 and given == seen
    # and normalization did change its own copy: the comparison above is not vacuous
    captured = ac.report(compiled).compiled[0].captured
    assert captured.normalized.get("buffer_writes") == 1 and captured.gm.code != seen[0]


class Scan(nn.Module):
    """A small selective-scan layer with a buffer updated in place (a call counter, like BatchNorm's)."""

    def __init__(self, d=6):
        super().__init__()
        self.decay, self.inp = nn.Linear(d, d, dtype=DT), nn.Linear(d, d, dtype=DT)
        self.register_buffer("calls", torch.zeros((), dtype=DT))

    def forward(self, x):
        self.calls += 1
        h = ac.ops.linear_scan(torch.sigmoid(self.decay(x)), self.inp(x))
        return h.square().mean()


def _break_capture(monkeypatch, factor=1.5):
    """Make normalization compute something else (the graph's outputs times ``factor``), as a wrong pass would."""
    real = backend_mod.capture

    def wrong(gm, *a, **kw):
        c = real(gm, *a, **kw)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = out.args[0][0]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(torch.mul, (first, factor))
        scaled.meta = dict(first.meta)
        out.args = ((scaled, *out.args[0][1:]),)
        gm.recompile()
        return c

    monkeypatch.setattr(backend_mod, "capture", wrong)


def test_first_call_check_falls_back_with_a_warning(monkeypatch):
    torch.manual_seed(0)
    m = Scan()
    x = torch.randn(2, 33, 6, dtype=DT)
    want = m(x)
    gw = _grads(want, list(m.parameters()))
    m.calls.zero_()
    _break_capture(monkeypatch)
    compiled = torch.compile(m, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    with pytest.warns(AdjointCompileWarning, match="differs from the graph as captured"):
        got = compiled(x)
    report = ac.report(compiled)
    assert [r.rewrite for r in report.regions] == ["adjoint"]
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    for a, b in zip(_grads(got, list(m.parameters())), gw):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert float(m.calls) == 1.0  # the buffer written in place is not written twice by the check or the fallback
    (fb,) = report.compiled[0].fallbacks
    assert "differs" in fb.cause and "check_forward" in fb.remedy and fb.details["rel_err"] > 0.1
    assert report.fallbacks == [fb] and "fallbacks" in str(report) and fb.cause in str(report)
    assert report.to_dict()["fallbacks"][0]["cause"] == fb.cause
    got2 = compiled(x)  # later calls run the fallback, with no new warning
    assert torch.allclose(got2, want, rtol=1e-12, atol=0) and float(m.calls) == 2.0
    assert len(report.compiled[0].fallbacks) == 1


def test_first_call_check_can_be_switched_off(monkeypatch):
    torch.manual_seed(0)
    m = Scan()
    x = torch.randn(2, 33, 6, dtype=DT)
    want = m(x)
    _break_capture(monkeypatch)
    compiled = torch.compile(m, backend="adjoint",
                             options={"shard_size": 4, "inner": "aot_eager", "check_forward": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointCompileWarning)
        got = compiled(x)
    assert torch.allclose(got, 1.5 * want, rtol=1e-10)  # the check was what caught it
    assert ac.report(compiled).compiled[0].fallbacks == []


def test_first_call_check_passes_a_correct_rewrite_silently():
    torch.manual_seed(0)
    m = Scan()
    x = torch.randn(2, 33, 6, dtype=DT)
    compiled = torch.compile(m, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointCompileWarning)
        compiled(x)
    rec = ac.report(compiled).compiled[0]
    assert rec.fallbacks == [] and rec.timing["check_forward_s"] > 0
    assert float(m.calls) == 1.0


def test_output_mismatch():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert output_mismatch((a.clone(),), (a,)) is None
    assert output_mismatch((a * (1 + 1e-6),), (a,)) is None                    # fp32 rounding
    assert output_mismatch((a * 1.01,), (a,))["rel_err"] > 1e-3                 # a real difference
    assert "non-finite" in output_mismatch((torch.tensor([1.0, 2.0, 3.0]),), (a,))["what"]
    assert "float64" in output_mismatch((a.double(),), (a,))["what"]
    assert output_mismatch((torch.tensor([1, 2]),), (torch.tensor([1, 3]),))["what"] == "integer values differ"
    assert output_mismatch((a, a), (a,))["output"] is None
    d = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert output_mismatch((d * (1 + 1e-6),), (d,)) is not None                 # fp64 is held tighter


def test_first_call_check_holds_a_low_precision_graph_to_its_precision():
    """A bf16 scan summed into an fp64 loss differs from the captured graph by bf16's rounding: held to fp64's 1e-7,
    the correct rewrite was dropped with a warning (and its memory saving with it)."""
    def f(a, b):
        h = ac.ops.linear_scan(torch.sigmoid(a), b)
        return (h.double() * torch.linspace(-1, 1, h.shape[1], dtype=torch.float64).view(1, -1, 1)).square().mean()

    torch.manual_seed(0)
    a = torch.randn(2, 37, 4, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2, 37, 4, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointCompileWarning)
        compiled(a, b).backward()
    rec = ac.report(compiled).compiled[0]
    assert rec.lowered and rec.fallbacks == [] and rec.timing["check_forward_s"] > 0
    d = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert output_mismatch((d * (1 + 1e-3),), (d,), floor=5e-2) is None       # within bf16's tolerance
    assert output_mismatch((d * 1.5,), (d,), floor=5e-2) is not None          # a real difference still fails


def _lm_head_loss(x, w, t):
    return torch.nn.functional.cross_entropy((x @ w).flatten(0, 1), t.flatten())


@pytest.mark.parametrize("fn", [_lm_head_loss, lambda x, w, t: (x @ w).log_softmax(-1).exp().sum() + t.sum()])
def test_forward_peak_bytes_bounds_the_measured_peak(fn):
    """The estimate of what the first-call check holds, against the peak measured running the graph eagerly."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from adjoint_compile.measure import track_peak
    from adjoint_compile.runtime.verify import forward_peak_bytes
    x, w, t = torch.randn(1, 300, 16), torch.randn(16, 1000), torch.randint(0, 1000, (1, 300))
    gm = make_fx(fn, tracing_mode="fake")(x, w, t)
    with torch.no_grad(), track_peak("cpu") as m:
        gm(x, w, t)
    est = forward_peak_bytes(gm)
    assert m["peak"] >= 300 * 1000 * 4                      # the logits at least
    assert m["peak"] <= est <= 2 * m["peak"], (est, m["peak"])


def _two_lengths(monkeypatch, **opts):
    from adjoint_compile.runtime import verify
    monkeypatch.setattr(verify, "CHECK_MIN_BYTES", 0)
    monkeypatch.setattr(verify, "CHECK_FACTOR", 0)
    torch.manual_seed(0)
    m = Scan()
    compiled = torch.compile(m, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager", **opts})
    return m, compiled


def test_first_call_check_skipped_where_it_would_hold_more_than_the_rewrite(monkeypatch):
    """Where running the graph as captured would hold far more than the rewritten step (a language model's logits
    at a long T), the check is skipped, and the report says so: here forced by thresholds of zero, so that the wrong
    capture is no longer caught (which shows the check did not run)."""
    m, compiled = _two_lengths(monkeypatch)
    x = torch.randn(2, 33, 6, dtype=DT)
    want = m(x)
    _break_capture(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdjointCompileWarning)
        got = compiled(x)
    assert torch.allclose(got, 1.5 * want, rtol=1e-10)
    rec = ac.report(compiled).compiled[0]
    assert rec.fallbacks == [] and "check_forward_s" not in rec.timing and rec.timing["check_forward_skipped_bytes"] > 0
    assert "first-call check skipped (the graph as captured would hold" in str(ac.report(compiled))


def test_first_call_check_skipped_for_the_graph_of_every_length(monkeypatch):
    """The same for the one graph that serves every length (its check's reference has symbolic sizes: the estimate
    is made on the specialized copy); the results stay exact."""
    m, compiled = _two_lengths(monkeypatch)
    params = list(m.parameters())
    for T in (33, 41, 57):
        x = torch.randn(2, T, 6, dtype=DT)
        _assert_same(m, compiled, params, x)
    rep = ac.report(compiled)
    owner = next(c for c in rep.compiled if c.specializations)
    assert owner.timing.get("check_forward_skipped_bytes", 0) > 0 and "check_forward_s" not in owner.timing


def test_first_call_check_never_skipped_without_a_sharded_region(monkeypatch):
    """With nothing sharded (a re-rolled loop, per-example book-keeping) the step holds what the check holds: the
    check runs however large the graph; with a sharded region over the thresholds it is skipped."""
    import types

    from torch.fx.experimental.proxy_tensor import make_fx

    from adjoint_compile.runtime import verify
    monkeypatch.setattr(verify, "CHECK_MIN_BYTES", 0)
    gm = make_fx(_lm_head_loss, tracing_mode="fake")(torch.randn(1, 30, 4), torch.randn(4, 50),
                                                     torch.randint(0, 50, (1, 30)))
    region = types.SimpleNamespace(rewrite="adjoint", details={"expected_memory_bytes": {"sharded": 1}})
    unsharded = types.SimpleNamespace(rewrite="none", details={})
    timing: dict[str, float] = {}
    assert not verify.check_skipped(timing, gm, []) and not verify.check_skipped(timing, gm, [unsharded])
    assert timing == {}
    assert verify.check_skipped(timing, gm, [region, unsharded])
    assert timing["check_forward_skipped_bytes"] == verify.forward_peak_bytes(gm) > 0


def _record_states(first_only: bool):
    """Each step's state written into a buffer under ``torch.no_grad()`` (every step, or the first only, before the
    loop): in eager a constant of the buffer, which gives the written states no gradient."""
    def f(a, b, w):
        B, T, D = a.shape
        h = b[:, 0] if first_only else a.new_zeros(B, D)
        out = a.new_zeros(B, T, D)
        if first_only:
            with torch.no_grad():
                out[:, 0] = h
        for t in range(1 if first_only else 0, T):
            h = a[:, t] * h + b[:, t]
            if first_only:
                out[:, t] = h
            else:
                with torch.no_grad():
                    out[:, t] = h
        return ((out * a + h[:, None]) * w).sum()
    return f


@pytest.mark.parametrize("first_only", [False, True], ids=["every write", "the first write"])
@pytest.mark.parametrize("shard", [1, 4])
def test_buffer_writes_under_no_grad_stay_constant(first_only, shard):
    """Stacked into one value, the writes made under no_grad give their values no gradient, as eager's do."""
    f = _record_states(first_only)
    compiled = torch.compile(f, backend="adjoint", options={"inner": "aot_eager", "shard_size": shard})
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        a = torch.sigmoid(torch.randn(2, 13, 4, generator=g, dtype=DT)).requires_grad_()
        b = torch.randn(2, 13, 4, generator=g, dtype=DT).requires_grad_()
        _assert_same(f, compiled, [a, b], a, b, torch.randn(2, 13, 4, generator=g, dtype=DT))


class _Streaming(nn.Module):
    """A streaming RNN: its last state kept in a module buffer, updated in place, and read again after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(2, 4, dtype=DT))

    def forward(self, a, b):
        b = nn.functional.normalize(b, dim=-1)
        h = self.state.clone()
        hs = []
        for t in range(a.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        self.state.copy_(h.detach())
        return torch.stack(hs, 1) + self.state[:, None]


@pytest.mark.parametrize("roll", [True, False])
def test_an_input_read_again_after_its_update_reads_the_new_values(roll):
    """Only the graph's order puts the read after the write: the graph keeps ordinary autograd (its passes move
    nodes by data flow), and every call's output and the buffer equal eager's."""
    eager, model = _Streaming(), _Streaming()
    compiled = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager",
                                                                "roll_loops": roll})
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        a, b = torch.sigmoid(torch.randn(2, 13, 4, generator=g, dtype=DT)), torch.randn(2, 13, 4, generator=g, dtype=DT)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            want, got = eager(a, b), compiled(a, b)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()
        assert torch.equal(model.state, eager.state)
    rep = ac.report(compiled)
    assert any("an input it reads again after the write" in j.reason for j in rep.rejections), str(rep)


def test_normalize_draws_no_random_numbers_and_keeps_the_first_call_check():
    """``F.normalize`` holds "normal" in its name; read as a random draw, it switched the first-call check off."""
    from adjoint_compile.analysis.optable import draws_random

    def f(x):
        return torch.nn.functional.normalize(x, dim=-1), torch.randn_like(x), torch.nn.functional.dropout(x)

    gm = torch.fx.symbolic_trace(f)
    drawn = {n.name: draws_random(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert drawn == {"normalize": False, "randn_like": True, "dropout": True}, drawn
