"""per_sample_clip at its edges: torch.autograd.grad of the parameters is refused with a PerSampleError that says to
call .backward() (p.grad untouched), a loss that is a mean over the batch warns once (it shrinks every example's norm
by 1/N), and clipping over 50 sequence lengths (each one a specialization of the symbolic graph) equals the
torch.func oracles of tests/test_lower_per_sample.py."""
from __future__ import annotations

import copy
import math
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack
from test_lower_per_sample import _loss, loop_clipped, vmap_norms

OPTS = {"inner": "aot_eager"}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _ssm() -> nn.Module:
    """The shipped SSM at d_model=4, its parameters moved off their initial values (the final RMSNorm's weight of
    ones makes the sum of squares of the output a constant)."""
    torch.manual_seed(1)
    model = SSMStack(d_model=4, d_state=2, n_layers=1).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


# --- torch.autograd.grad --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("allow_unused", [False, True])
def test_autograd_grad_of_the_parameters_raises_naming_the_option_and_backward(allow_unused):
    model = _mlp()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    x = torch.randn(3, 4)
    with pytest.raises(ac.PerSampleError, match=r"per_sample_clip.*torch\.autograd\.grad.*loss\.backward\(\)"):
        torch.autograd.grad(_loss(f(x)), list(model.parameters()), allow_unused=allow_unused)
    assert all(p.grad is None for p in model.parameters()), "a refused autograd.grad wrote p.grad"
    # NB: one parameter asked for is enough; a p.grad from an earlier backward stays as it was
    _loss(f(x)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ac.PerSampleError, match=r"0\.weight"):
        torch.autograd.grad(_loss(f(x)), [model[0].weight])
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_after_a_refused_autograd_grad_backward_clips_as_before():
    model = _mlp()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, **OPTS})
    x = torch.randn(4, 4)
    want, _ = loop_clipped(model, (x,), 0.5)
    with pytest.raises(ac.PerSampleError):
        torch.autograd.grad(_loss(f(x)), list(model.parameters()))
    _loss(f(x)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)


def test_autograd_grad_of_the_inputs_only_runs_and_writes_no_p_grad():
    model = _mlp()
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    x = torch.randn(3, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(_loss(f(x)), [x])
    (want,) = torch.autograd.grad(_loss(ref(x)), [x])
    torch.testing.assert_close(gx, want)
    assert all(p.grad is None for p in model.parameters())


def test_autograd_grad_through_a_sharded_region_raises_and_writes_no_p_grad():
    model = _ssm()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "shard_size": 4, **OPTS})
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    with pytest.raises(ac.PerSampleError, match="loss.backward()"):
        torch.autograd.grad(_loss(f(x)), list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), ac.report(f)


def test_backward_with_inputs_clips_over_the_named_parameters_and_writes_only_theirs():
    model = _mlp()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.3, **OPTS})
    x = torch.randn(4, 4)
    named = [model[2].weight, model[2].bias]
    _loss(f(x)).backward(inputs=named)
    assert model[0].weight.grad is None and model[0].bias.grad is None
    ref = copy.deepcopy(model)
    per = []
    for i in range(4):
        per.append(torch.autograd.grad(_loss(ref(x[i:i + 1])), [ref[2].weight, ref[2].bias]))
    norms = torch.stack([math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) * torch.ones(()) for gs in per])
    torch.testing.assert_close(ac.per_sample_grad_norms(f), norms, rtol=1e-5, atol=0)
    c = torch.clamp(0.3 / norms, max=1)
    assert (c < 1).any()
    for k, p in enumerate(named):
        torch.testing.assert_close(p.grad, sum(c[i] * per[i][k] for i in range(4)), rtol=1e-4, atol=1e-6)


# --- a mean over the batch --------------------------------------------------------------------------------------

def _warnings_of(step, *inputs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*inputs).backward()
    return [str(w.message) for w in caught if issubclass(w.category, ac.AdjointCompileWarning)
            and "mean over the batch" in str(w.message)]


def test_a_mean_over_the_batch_warns_once_with_the_remedy():
    model = _mlp()
    x = torch.randn(6, 4)

    def mean_loss(x):
        return model(x).pow(2).mean()
    got = _warnings_of(torch.compile(mean_loss, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS}), x)
    assert len(got) == 1, got
    msg = got[0]
    assert "N = 12" in msg and "per_sample_clip=1" in msg and "reduction=\"sum\"" in msg, msg
    assert "C/N (here 0.0833333)" in msg and "mean_loss" in msg, msg
    # NB: once: the same loss compiled again (or a new batch size) does not repeat it
    assert _warnings_of(torch.compile(mean_loss, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS}),
                        torch.randn(5, 4)) == []


def test_cross_entropy_with_its_default_mean_warns():
    model = _mlp()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    step = torch.compile(lambda x: F.cross_entropy(model(x), y), backend="adjoint",
                         options={"per_sample_clip": 1.0, **OPTS})
    got = _warnings_of(step, x)
    assert len(got) == 1 and "cross_entropy" in got[0] and "N = 6" in got[0], got


@pytest.mark.parametrize("form", ["sum", "cross_entropy_sum", "mean_over_features", "inf"])
def test_a_sum_or_a_mean_over_other_axes_does_not_warn(form):
    model = _mlp()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    loss = {"sum": lambda x: model(x).pow(2).sum(),
            "cross_entropy_sum": lambda x: F.cross_entropy(model(x), y, reduction="sum"),
            "mean_over_features": lambda x: model(x).pow(2).mean(-1).sum(),
            "inf": lambda x: model(x).pow(2).mean()}[form]
    clip = float("inf") if form == "inf" else 1.0
    assert _warnings_of(torch.compile(loss, backend="adjoint", options={"per_sample_clip": clip, **OPTS}), x) == []


# --- 50 lengths -----------------------------------------------------------------------------------------------------

class _ScanLayer(nn.Module):
    """Linear gates around one ac.ops.linear_scan: the smallest sequence model with a sharded region."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.gate, self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(ac.ops.linear_scan(torch.sigmoid(self.gate(x)), self.inp(x)))


def _scan_layer() -> nn.Module:
    torch.manual_seed(2)
    return _ScanLayer().double()


@pytest.mark.parametrize("make,sharded_from", [
    (_scan_layer, 12),
    # NB: ~110 s on a 2-core CPU (each length compiles the SSM's shard programs anew); at T = 5 the estimate ties
    # (~12 KiB either way: the rewrite would not pay)
    pytest.param(_ssm, 6, marks=pytest.mark.slow)], ids=["scan_layer", "ssm"])
@pytest.mark.slow
def test_clipping_over_50_lengths_equals_the_torch_func_oracle(make, sharded_from):
    """A model under per_sample_clip with shard_size=4 at T = 1..50, fp64: one dynamo graph with a symbolic length,
    specialized and compiled per length (short lengths keep ordinary autograd with per-example book-keeping: one
    shard, or a rewrite that would not pay). Norms against vmap(grad), the clipped sum against a loop over the
    examples, to 1e-9; every length from ``sharded_from`` on is sharded."""
    model = make()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "shard_size": 4, **OPTS})
    start, clipped = time.perf_counter(), 0
    for T in range(1, 51):
        x = torch.randn(3, T, 4, dtype=torch.float64)
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NB: the short lengths' 'declined' warnings
            _loss(f(x)).backward()
        want_norms = vmap_norms(model, (x,))
        want, _ = loop_clipped(model, (x,), 1.0)
        got = ac.per_sample_grad_norms(f)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want_norms, rtol=1e-9, atol=0, msg=lambda m: f"T={T}: {m}")
        clipped += int((want_norms > 1.0).sum())
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"T={T} {n}: {m}")
    assert clipped > 50, "the test should clip"
    rep = ac.report(f)
    rewritten = {r.length for r in rep.regions if r.kind == "linear_recurrence" and r.rewrite == "adjoint"}
    assert rewritten >= set(range(sharded_from, 51)), sorted(rewritten)
    print(f"50 lengths: {time.perf_counter() - start:.1f} s")


def test_an_rnn_module_left_out_of_the_graph_is_refused_under_clipping():
    """An nn.GRU / nn.LSTM that dynamo leaves out of the graph runs natively: its parameters' gradients (and, when
    the frame then runs eagerly, every parameter's) would be the plain summed ones. Under per_sample_clip that is
    refused loudly (it was silent: the whole step's gradients came back unclipped)."""
    class WithRNN(torch.nn.Module):
        def __init__(self, rnn: type) -> None:
            super().__init__()
            self.i, self.r, self.o = torch.nn.Linear(8, 8), rnn(8, 8, batch_first=True), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.o(self.r(torch.tanh(self.i(x)))[0])
    # in highway mode the module is traced as a scan over a tuple of states: refused with the same message
    for rnn, mode in [(torch.nn.GRU, {}), (torch.nn.LSTM, {}), (torch.nn.GRU, {"mode": "highway", "iterations": 2})]:
        torch._dynamo.reset()
        m = WithRNN(rnn)
        f = torch.compile(m, backend="adjoint", options={"per_sample_clip": 1.0, "inner": "aot_eager", **mode})
        with pytest.raises(Exception, match=f"per_sample_clip=1.0 cannot clip the gradients of nn.{rnn.__name__}"):
            f(torch.randn(3, 12, 8)).square().sum().backward()
        assert all(p.grad is None for p in m.parameters())     # nothing unclipped was written


def _clipped_matches(model: nn.Module, clip: float, x: torch.Tensor, **opts) -> dict:
    """One clipped backward of ``model`` compiled with per_sample_clip=clip on x: its norms against vmap(grad) and
    every p.grad against the loop over the examples (fp64, 1e-9); returns the loop's clipped sums."""
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, **OPTS, **opts})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loss(f(x)).backward()
    want_norms = vmap_norms(model, (x,))
    torch.testing.assert_close(ac.per_sample_grad_norms(f), want_norms, rtol=1e-9, atol=0)
    want, _ = loop_clipped(model, (x,), clip)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"{n}: {m}")
    return {"norms": want_norms, **want}


class _LearnedH0(nn.Module):
    """A scan whose initial state is a parameter broadcast over the batch, as RNNs with a learned h0 write it."""

    def __init__(self, form: str, d: int = 4) -> None:
        super().__init__()
        self.gate, self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.h0, self.form = nn.Parameter(torch.randn(d)), form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        h0 = self.h0.expand(B, -1) if self.form == "expand" else self.h0[None].repeat(B, 1)
        return self.out(ac.ops.linear_scan(torch.sigmoid(self.gate(x)), self.inp(x), h0=h0))


@pytest.mark.parametrize("form", ["expand", "repeat"])
def test_a_learned_h0_broadcast_over_the_batch_is_clipped_per_example(form):
    """The h0 parameter expanded to the batch feeds the scan: per example its gradient is that example's (the
    broadcast's batch size is read per example, not held at B), and the scan op runs under torch.func; it crashed.
    Norms against vmap(grad), the clipped sum against a loop over the examples, fp64."""
    torch.manual_seed(3)
    want = _clipped_matches(_LearnedH0(form).double(), 1.0, torch.randn(3, 13, 4, dtype=torch.float64),
                            shard_size=4)
    assert float(want["h0"].abs().max()) > 1e-3


class _StepLinear(nn.Module):
    """A loop-written RNN with Linears inside the step: rolled, they apply to the time-first [T, B, D] input."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            xt = x[:, t]
            h = torch.sigmoid(self.a(xt)) * h + self.b(xt)
            hs.append(h)
        return self.o(torch.stack(hs, 1))


class _TimeFirst(nn.Module):
    """The model's own time-first block: the examples on axis 1 between the transposes."""

    def __init__(self, d: int = 4, reshape: bool = False) -> None:
        super().__init__()
        self.a, self.o, self.norm, self.reshape = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d), reshape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.tanh(self.a(x.transpose(0, 1))))  # [T, B, D]
        if self.reshape:  # NB: the same shape when T == B, other examples in each row
            y = y.reshape(x.shape[0], x.shape[1], -1)
        return self.o(y).transpose(0, 1) if not self.reshape else self.o(y)


@pytest.mark.parametrize("make", [_StepLinear, _TimeFirst], ids=["step_linear", "time_first"])
@pytest.mark.parametrize("T", [3, 5])
def test_examples_moved_off_the_batch_axis_are_followed(make, T):
    """With the examples on axis 1 ([T, B, D]) their axis was told by size: refused where T != B, and where T == B
    each step's gradient was taken for an example's (clipped sums off by up to 0.02 against 0.05). Followed through
    the permutation now: norms against vmap(grad), the clipped sum against a loop over the examples, fp64, B = 3."""
    torch.manual_seed(4)
    want = _clipped_matches(make().double(), 0.05, torch.randn(3, T, 4, dtype=torch.float64))
    assert bool((want["norms"] > 0.05).all())


def test_a_reshape_after_moving_the_examples_is_refused():
    """[T, B, D] reshaped to [B, T, D] has the right shape where T == B but other examples in each row: refused."""
    model = _TimeFirst(reshape=True).double()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(Exception, match="examples' axis of its input .* is not known"):
        _loss(f(torch.randn(3, 3, 4, dtype=torch.float64))).backward()


class _ClsToken(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.cls, self.lin = nn.Parameter(torch.randn(1, 1, d)), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1))


def test_a_class_token_expanded_to_the_batch_is_clipped_per_example():
    torch.manual_seed(5)
    want = _clipped_matches(_ClsToken().double(), 0.05, torch.randn(3, 5, 4, dtype=torch.float64))
    assert bool((want["norms"] > 0.05).all())


def test_a_regularizer_of_the_parameters_alone_is_refused_naming_it():
    """A loss plus 0.1 * (w**2).sum(): refused (no example owns that gradient); the message blamed the loss's
    reduction over the batch ('the examples interact') instead of the regularizer."""
    model = _mlp()
    step = torch.compile(lambda x: model(x).pow(2).sum() + 0.1 * model[0].weight.pow(2).sum(), backend="adjoint",
                         options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(Exception, match="a term of the parameters alone .* weight decay"):
        step(torch.randn(3, 4)).backward()


def test_the_loss_scaled_by_a_parameter_is_refused_as_such():
    """The loss times a learned scalar: refused with a reason of its own (it said "a regularizer")."""
    model, temp = _mlp(), torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    step = torch.compile(lambda x: model(x).pow(2).sum() * temp, backend="adjoint",
                         options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(Exception, match="scales the loss by a value of the parameters alone"):
        step(torch.randn(3, 4)).backward()


# --- the training set-ups around it ---------------------------------------------------------------------------------

class _Named(nn.Module):
    """A module whose methods name their instance ``this``: the report and the norms must still tell instances apart."""

    def __init__(this) -> None:
        super().__init__()
        this.a, this.b = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(this, x):
        return this.b(torch.tanh(this.a(x)))


@pytest.mark.parametrize("make", [_mlp, _Named], ids=["sequential", "own_class"])
def test_norms_are_the_models_own_when_instances_share_graphs(make):
    """Two instances of one class share their compiled graphs and clippers: per_sample_grad_norms of the first
    returned the second's norms (B = 5 for a model that ran B = 3), and a third instance compiled without
    per_sample_clip returned them too instead of refusing."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m1, m2, m3 = make().double(), make().double(), make().double()
    f1, f2 = (torch.compile(m, backend="adjoint", options={"per_sample_clip": 0.5, **OPTS}) for m in (m1, m2))
    x1, x2 = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loss(f1(x1)).backward()
        _loss(f2(x2)).backward()
        g = torch.compile(m3, backend="adjoint", options=OPTS)
        g(x1).sum().backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f1), vmap_norms(m1, (x1,)), rtol=1e-9, atol=0)
    torch.testing.assert_close(ac.per_sample_grad_norms(f2), vmap_norms(m2, (x2,)), rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="not compiled with"):
        ac.per_sample_grad_norms(g)


def test_clipped_sums_accumulate_into_the_grad_tensors_in_place():
    """A .grad that views a flat buffer (as an optimizer's or DDP's flat gradients do) was replaced by a new tensor:
    the buffer kept zeros. Accumulated in place, as autograd does, over two micro-batches."""
    torch._dynamo.reset()
    model = _mlp().double()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    views, k = [], 0
    for p in model.parameters():
        p.grad = flat[k:k + p.numel()].view_as(p)
        views.append(p.grad)
        k += p.numel()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, **OPTS})
    xs = [torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in xs:
            _loss(f(x)).backward()
    want = [loop_clipped(model, (x,), 0.5)[0] for x in xs]
    for (n, p), v in zip(model.named_parameters(), views):
        assert p.grad is v
        torch.testing.assert_close(p.grad, want[0][n] + want[1][n], rtol=1e-9, atol=1e-12)
    assert flat.norm() > 0


def test_two_calls_with_batches_of_other_sizes_before_one_backward_say_so():
    """Two calls in one loss pair their rows as one example each (two views of the same examples); with batches of
    different sizes the backward raised a bare shape error from inside the book-keeping."""
    torch._dynamo.reset()
    f = torch.compile(_mlp().double(), backend="adjoint", options={"per_sample_clip": 0.5, **OPTS})
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = _loss(f(a)) + _loss(f(b))
        with pytest.raises(RuntimeError, match="disagree on the batch size .*call backward after each micro-batch"):
            loss.backward()


def test_distributed_data_parallel_is_refused(tmp_path):
    """Under DDP the clipped sums were lost (DDP reduced the empty gradients autograd accumulated and wrote them
    back over p.grad: all zeros, silently)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        model = _Named().double()
        f = torch.compile(nn.parallel.DistributedDataParallel(model), backend="adjoint",
                          options={"per_sample_clip": 0.5, **OPTS})
        with pytest.raises(ac.PerSampleError, match="cannot run under DistributedDataParallel"):
            _loss(f(torch.randn(3, 4, dtype=torch.float64))).backward()
        assert all(p.grad is None for p in model.parameters())
    finally:
        dist.destroy_process_group()


class _Reversed(nn.Module):
    """A pooled [B, D] activation turned around by ``how`` (its examples then on axis 1, or on axis 2 of a [B, T, D]
    activation), scaled by a [1, 1] parameter and turned back; B == D, so sizes alone cannot tell the axes apart."""

    FORMS = {"x.T": lambda p, c: (p.T * c).T, "x.mT": lambda p, c: (p.mT * c).mT,
             "torch.adjoint": lambda p, c: torch.adjoint(torch.adjoint(p) * c),
             "einsum": lambda p, c: torch.einsum("db->bd", torch.einsum("bd->db", p) * c),
             "3-D x.T": lambda h, c: (h.T * c).T}

    def __init__(self, how: str, d: int = 4) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(d, d)
        self.c = nn.Parameter(torch.full((1, 1), 1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "3-D x.T":
            return self.lin(self.FORMS[self.how](torch.tanh(x), self.c))
        return self.lin(x + self.FORMS[self.how](torch.tanh(x.mean(1)), self.c)[:, None, :])


@pytest.mark.parametrize("how", list(_Reversed.FORMS))
def test_examples_turned_around_by_t_attributes_and_einsum_are_followed(how):
    """``x.T``, ``x.mT``, ``torch.adjoint`` and a permuting ``einsum`` move the examples as ``transpose`` does: with
    B == D their axis was taken to stay first by size (each example's gradient of the scale went to a feature).
    Norms against vmap(grad), the clipped sum against a loop over the examples, fp64."""
    torch.manual_seed(6)
    _clipped_matches(_Reversed(how).double(), 0.05, torch.randn(4, 5, 4, dtype=torch.float64))


class _Moved(nn.Module):
    def __init__(self, how: str, d: int = 4) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(d, d)
        self.c = nn.Parameter(torch.full((1, 1, 1), 1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "rot90":
            return self.lin(torch.rot90(torch.rot90(x, 1, (0, 2)) * self.c, -1, (0, 2)))
        z = torch.stack([x, 0.5 * x]) * self.c  # NB: [2, B, T, D] where B == 2
        return self.lin(z[0] + z[1])


@pytest.mark.parametrize("how,B", [("rot90", 4)])
def test_examples_moved_by_ops_it_cannot_follow_are_refused(how, B):
    """``rot90`` moves the examples where the book-keeping does not follow them: refused with a PerSampleError, never
    a gradient attributed by size (B equals the moved axis' size here)."""
    f = torch.compile(_Moved(how).double(), backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError, match="examples' axis of its input .* is not known"):
        _loss(f(torch.randn(B, 3, 4, dtype=torch.float64))).backward()


def test_a_stack_indexed_back_is_followed():
    """``torch.stack([x, 0.5 * x])[0]`` (B == 2, the stack's size): the examples followed through the index, exact
    (it was refused: the axis was lost at the index)."""
    torch.manual_seed(7)
    _clipped_matches(_Moved("stack").double(), 0.05, torch.randn(2, 3, 4, dtype=torch.float64))


class _Reordered(nn.Module):
    """The examples reordered along the batch axis and restored (sort by length, then unsort), or a constant made
    from an activation's shape meeting a parameter."""

    def __init__(self, how: str, d: int = 4) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(d, d)
        self.g = nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        perm = torch.arange(B - 1, -1, -1)
        if self.how == "x[perm]":
            y = (x[perm] * self.g)[perm]
        elif self.how == "roll":
            y = torch.roll(torch.roll(x, 1, 0) * self.g, -1, 0)
        elif self.how == "index_select":
            y = torch.index_select(torch.index_select(x, 0, perm) * self.g, 0, perm)
        elif self.how == "x[perm[:, None], t[None]]":  # NB: a 2-D index whose rows are other examples'
            t = torch.arange(x.shape[1])[None]
            y = (x[perm[:, None], t] * self.g)[perm[:, None], t]
        else:  # NB: [T, D] where T == B: values of no example, every example's alike
            y = x + x.new_ones(x.shape[1], x.shape[2]) * self.g
        return self.lin(y)


@pytest.mark.parametrize("how", ["x[perm]", "roll", "index_select", "x[perm[:, None], t[None]]"])
def test_examples_reordered_along_the_batch_are_refused(how):
    """Each row of a reordered value is another example's (the gradient of g would go to the wrong one, at any B):
    refused, never attributed by position. (``x.new_ones(T, D) * g``, a constant: in
    test_lower_per_sample_constants.py.)"""
    f = torch.compile(_Reordered(how).double(), backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError,
                       match="examples' axis of its input .* is not known|roll .*mixes the examples|"
                             "an operand whose examples' axis is not known"):
        _loss(f(torch.randn(3, 3, 4, dtype=torch.float64))).backward()


# --- parameters on rows merged from the examples --------------------------------------------------------------------

class MergedRows(nn.Module):
    """Per-token layers on [B·T, d] rows (``x.flatten(0, 1)``), no recurrence: a gain, a Linear, a bias added to its
    output, a division by a value of a [1, d] parameter, a LayerNorm, a Linear, then back to [B, T, o]."""

    def __init__(self) -> None:
        super().__init__()
        self.g, self.b = nn.Parameter(1 + 0.3 * torch.randn(4)), nn.Parameter(0.3 * torch.randn(5))
        self.s = nn.Parameter(0.3 * torch.randn(1, 5))
        self.inp, self.norm, self.out = nn.Linear(4, 5, bias=False), nn.LayerNorm(5), nn.Linear(5, 3)
        with torch.no_grad():
            self.norm.weight.add_(0.3 * torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = (self.inp(x.flatten(0, 1) * self.g) + self.b) / torch.exp(self.s)
        return self.out(self.norm(torch.tanh(r))).view(x.shape[0], x.shape[1], -1)


@pytest.mark.parametrize("B,T", [(3, 5), (4, 1), (2, 4)])
def test_parameters_on_merged_rows_without_a_region(B, T):
    """Each use is made on the rows unflattened to [B, T, ...]: equal to an eager loop over the examples (B = 4,
    T = 1: the rows are the examples; B = 2, T = 4: B divides every size)."""
    torch.manual_seed(B * 10 + T)
    model = MergedRows().double()
    x = torch.randn(B, T, 4, dtype=torch.float64)
    norms = vmap_norms(model, (x,))
    clip = float(norms.min() + norms.max()) / 2
    want, _ = loop_clipped(model, (x,), clip)
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, **OPTS})
    _loss(f(x)).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f), norms, rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12)


# --- ops along the examples' axis after it moved ----------------------------------------------------------------------

#: a reduction or along-axis op over the examples' axis where a transpose, permute, stack or unsqueeze moved it: the
#: examples interact (each norm would depend on the others), so refused as the same op on axis 0 is
MIXING = {
    "transpose(0, 1).softmax(1)": lambda h: h.transpose(0, 1).softmax(1).pow(2).sum(),
    "transpose(0, 1).cumsum(1)": lambda h: h.transpose(0, 1).cumsum(1).pow(2).sum(),
    "transpose(0, 1).max(1)": lambda h: h.transpose(0, 1).max(1).values.pow(2).sum(),
    "transpose(0, 1).sum(1).pow(2)": lambda h: h.transpose(0, 1).sum(1).pow(2).sum(),
    "permute(1, 2, 0).logsumexp(-1)": lambda h: h.permute(1, 2, 0).logsumexp(-1).pow(2).sum(),
    "stack([h, h]).softmax(1)": lambda h: torch.stack([h, h]).softmax(1).pow(2).sum(),
    "unsqueeze(0).max(1)": lambda h: h.unsqueeze(0).max(1).values.pow(2).sum(),
    "stack(losses).max(1)": lambda h: torch.stack([h.pow(2).sum((1, 2)), h.sum((1, 2))]).max(1).values.sum(),
    "stack(losses).flatten().sort()": lambda h: torch.stack([h.pow(2).sum((1, 2)), h.sum((1, 2))]).flatten()
    .sort().values[:2].sum(),
}
#: the same ops over another axis: valid, exact
VALID = {
    "transpose(0, 1).softmax(-1)": lambda h: h.transpose(0, 1).softmax(-1).pow(2).sum(),
    "transpose(0, 1).max(0)": lambda h: h.transpose(0, 1).max(0).values.pow(2).sum(),
    "unsqueeze(0).logsumexp(-1)": lambda h: h.unsqueeze(0).logsumexp(-1).pow(2).sum(),
    "stack(losses).max(0)": lambda h: torch.stack([h.pow(2).sum((1, 2)), h.sum((1, 2))]).max(0).values.sum(),
}


class AlongAxis(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.lin = op, nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("form", list(MIXING))
def test_ops_along_a_moved_examples_axis_are_refused(form):
    """They were accepted, with norms that moved when only another example's input changed."""
    torch._dynamo.reset()
    f = torch.compile(AlongAxis(MIXING[form]).double(), backend="adjoint",
                      options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError, match="mixes the examples|reduced over the batch axis"):
        f(torch.randn(3, 4, 5, dtype=torch.float64))


@pytest.mark.parametrize("form", list(VALID))
def test_ops_along_another_axis_after_a_move_are_exact(form):
    torch.manual_seed(5)
    _exact(AlongAxis(VALID[form]).double(), torch.randn(3, 4, 5, dtype=torch.float64))


def _exact(model: nn.Module, x: torch.Tensor) -> None:
    """Compiled with per_sample_clip half-way between the least and largest norm: the norms against vmap(grad) and
    every p.grad against a loop over the examples, fp64."""
    torch._dynamo.reset()
    norms = vmap_norms_of(model, x)
    clip = float(norms.min() + norms.max()) / 2
    want = loop_clipped_of(model, x, clip)
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, **OPTS})
    f(x).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f), norms, rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12)


def vmap_norms_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """‖g_n‖ of the model's own output (its loss) on each example alone."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    per = torch.func.vmap(torch.func.grad(lambda p, xi: torch.func.functional_call(model, p, (xi[None],))),
                          in_dims=(None, 0))(params, x)
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))


def loop_clipped_of(model: nn.Module, x: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for i in range(x.shape[0]):
        ref.zero_grad()
        ref(x[i:i + 1]).backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
        for n, p in ref.named_parameters():
            total[n] += min(1.0, clip / norm) * p.grad
    return total


def test_a_parameter_broadcast_along_the_examples_axis_is_refused():
    """A [B, D] parameter added to [B, D] activations pairs example n with row n of it: per-example gradients of such
    a parameter are not supported, refused by name (it crashed in the backward: a shape mismatch)."""
    class PerRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.P = nn.Linear(3, 6), nn.Parameter(torch.randn(4, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(torch.tanh(self.inp(x)) + self.P)

    torch._dynamo.reset()
    f = torch.compile(PerRow(), backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError, match=r"broadcasts the parameter value \w+ \(4, 6\) along the examples"):
        _loss(f(torch.randn(4, 3)))


# --- two example values meeting ---------------------------------------------------------------------------------------

_PERM = torch.tensor([2, 0, 3, 1])
#: ops of two example values whose output entries read several examples: refused (a contrastive loss's logits first)
COMBINING = {
    "cross_entropy(h @ h.T, arange(B))": lambda h: F.cross_entropy(h @ h.T, torch.arange(4), reduction="sum"),
    "(h @ h.T).pow(2)": lambda h: (h @ h.T).pow(2).sum(),
    "einsum('bd,cd->bc', h, h)": lambda h: torch.einsum("bd,cd->bc", h, h).pow(2).sum(),
    "h * h[perm]": lambda h: (h * h[_PERM]).sum(),
    "cdist(h, h)": lambda h: torch.cdist(h, h).sum(),
    "cosine_similarity along the examples": lambda h: F.cosine_similarity(h, h * 2 + 1, dim=0).sum(),
    "mse_loss(h, h.roll(1, 0))": lambda h: F.mse_loss(h, h.roll(1, 0), reduction="sum"),
    "mse_loss(h, h[perm])": lambda h: F.mse_loss(h, h[_PERM], reduction="sum"),
}
#: the same examples meeting themselves: valid, exact
ALIGNED = {
    "h * h": lambda h: (h * h).sum(),
    "h.T.T * h": lambda h: (h.T.T * h).pow(2).sum(),
    "(h.T * h.T).sum(0)": lambda h: (h.T * h.T).sum(0).sum(),
    "einsum('bd,bd->b', h, h)": lambda h: torch.einsum("bd,bd->b", h, h).pow(2).sum(),
    "bmm over the examples": lambda h: (h[:, :, None] @ h[:, None, :]).pow(2).sum(),
    "cosine_similarity(h, 2h + 1)": lambda h: F.cosine_similarity(h, h * 2 + 1, dim=1).pow(2).sum(),
    "pairwise_distance(h, h.flip(1))": lambda h: F.pairwise_distance(h, h.flip(1)).sum(),
}


@pytest.mark.parametrize("form", list(COMBINING))
def test_example_values_meeting_other_examples_are_refused(form):
    """They were accepted: a contrastive loss under per_sample_clip gave per-example norms that read every example."""
    torch._dynamo.reset()
    f = torch.compile(AlongAxis(COMBINING[form]).double(), backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError, match="mixes the examples of the batch"):
        f(torch.randn(4, 5, dtype=torch.float64))


@pytest.mark.parametrize("form", list(ALIGNED))
def test_example_values_meeting_their_own_example_are_exact(form):
    torch.manual_seed(6)
    _exact(AlongAxis(ALIGNED[form]).double(), torch.randn(4, 5, dtype=torch.float64))


def test_an_embedding_scaling_by_batch_frequency_is_refused():
    """``scale_grad_by_freq`` divides each row's gradient by the token's count in the whole batch: examples interact
    (the clipped sum at C = inf was the per-example frequencies', not eager's gradient)."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Embedding(7, 4, scale_grad_by_freq=True), nn.Linear(4, 3))
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, **OPTS})
    with pytest.raises(ac.PerSampleError, match="embedding .*mixes the examples"):
        f(torch.randint(0, 7, (3, 5)))


#: [B, T, D] values of one example meeting through indexing, scatter, unbind, diag_embed: valid, exact (transformers'
#: sequence classification pools with ``logits[arange(B), last]``)
ALIGNED_STEPS = {
    "h[arange(B), last]": lambda h: h[torch.arange(h.shape[0]), (h[..., 0] > 0).sum(1).clamp(max=3)].pow(2).sum(),
    "h[arange(B)[:, None], t.flip(0)[None]]": lambda h: (h[torch.arange(h.shape[0])[:, None],
                                                                   torch.arange(4).flip(0)[None]] * h).sum(),
    "h[arange(B).view(B, 1, 1), t[:, None], d]": lambda h: h[
        torch.arange(h.shape[0]).view(-1, 1, 1), torch.arange(4)[:, None], torch.arange(5).flip(0)].pow(2).sum(),
    "logaddexp(h, 2h)": lambda h: torch.logaddexp(h, 2 * h).sum(),
    "scatter_add along time": lambda h: torch.zeros_like(h).scatter_add(1, h.abs().argsort(1), h * h).pow(2).sum(),
    "h[:, [0, 2]] * h[:, [1, 3]]": lambda h: (h[:, [0, 2]] * h[:, [1, 3]]).sum(),
    "diag_embed(h[:, 0]) @ h.mT": lambda h: (torch.diag_embed(h[:, 0]) @ h.mT).pow(2).sum(),
    "cat(h.transpose(0, 1).unbind(0)[1], h[:, 0])": lambda h: torch.cat([h.transpose(0, 1).unbind(0)[1], h[:, 0]],
                                                                         -1).pow(2).sum(),
}


@pytest.mark.parametrize("form", list(ALIGNED_STEPS))
def test_values_of_one_example_meeting_through_indexing_are_exact(form):
    torch.manual_seed(8)
    _exact(AlongAxis(ALIGNED_STEPS[form]).double(), torch.randn(3, 4, 5, dtype=torch.float64))


# --- inputs whose examples are not on axis 0 --------------------------------------------------------------------------

class _TimeMajor(nn.Module):
    """A time-major input ([T, B, D], batch_dim=1) moved to [B, T, D] first; ``mix``: the loss sums over the examples
    before a square (the examples interact), else the output is time-major again."""

    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.mix, self.lin = mix, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x.transpose(0, 1)))
        return y.sum(0).pow(2).sum() if self.mix else y.transpose(0, 1)


def test_an_inputs_moved_examples_are_followed_and_mixing_them_is_refused():
    """The input's own move was not followed (its axis taken as batch_dim=1 after the transpose): ``y.sum(0)`` over
    the examples passed for a sum over time, and the clipped step was silently wrong. Refused now."""
    torch._dynamo.reset()
    f = torch.compile(_TimeMajor(True).double(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "batch_dim": 1, **OPTS})
    with pytest.raises(ac.PerSampleError, match="reduced over the batch axis"):
        f(torch.randn(5, 3, 4, dtype=torch.float64)).backward()


def test_a_time_major_input_moved_to_batch_first_is_exact():
    from test_lower_per_sample import check
    torch.manual_seed(9)
    check(_TimeMajor(False), torch.randn(5, 3, 4), clip=0.5, bd=1)


def test_a_time_major_conv_scan_stack_is_exact():
    """[T, B, D] moved to [B, T, D], then a Mamba-like stack whose ``chunk(2, -1)`` cuts the features (its parts were
    left without an examples' axis, refused as mixing the examples)."""
    from test_lower_halo import ConvScan
    from test_lower_per_sample import check

    class TimeMajorStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = ConvScan("slice")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(x.transpose(0, 1)).transpose(0, 1)
    check(TimeMajorStack(), torch.randn(11, 3, 6), clip=0.5, bd=1, shard_size=4)


class _LoopLayer(nn.Module):
    """x + o(h), h_t = σ(a(LN x_t)) ⊙ h_{t-1} + b(LN x_t) written as a Python loop (a region per layer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.a, self.b, self.o = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        u = self.norm(x)
        a, b = torch.sigmoid(self.a(u)), self.b(u)
        h, hs = torch.zeros_like(b[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return x + self.o(torch.stack(hs, 1))


def test_a_stack_of_two_loop_regions_reads_the_first_regions_outputs():
    """The second layer's residual add reads the first region's output: that region read a time-major [T, B, D]
    value, and its outputs' axes were taken as unknown ("add mixes the examples of the batch"), though the region,
    lowered first, had checked them on batch_dim."""
    from test_lower_per_sample import check

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), _LoopLayer(8), _LoopLayer(8), nn.Linear(8, 3))
    rep = check(model, torch.randn(3, 13, 4), clip=0.5, shard_size=4)
    assert [r.rewrite for r in rep.regions].count("adjoint") == 2, rep
