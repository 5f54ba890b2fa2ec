"""Training data as it comes: one compiled graph serves every sequence length, exactly, with bounded compile work.

The oracle is the same model run eagerly; every length's loss and every gradient are compared."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import adjoint_compile as ac
from adjoint_compile import inner as inner_mod
from adjoint_compile import lengths as lengths_mod
from adjoint_compile.errors import AdjointCompileWarning
from adjoint_compile.models.selective_ssm import SSMStack
from helpers import generic_regions

#: 50 distinct lengths: odd, prime, below, at and above two shards of 8, and a long tail, in a shuffled order
LENGTHS = [17, 3, 64, 31, 8, 9, 100, 2, 23, 47, 16, 5, 33, 61, 12, 127, 7, 40, 19, 53, 11, 90, 29, 15, 37, 41, 24,
           43, 13, 71, 18, 59, 6, 67, 25, 73, 4, 79, 83, 27, 89, 21, 97, 10, 35, 101, 14, 103, 45, 1]
assert len(set(LENGTHS)) == 50


def _run(lengths, options, dynamic=None, dtype=torch.float64, tol=1e-9, after=None):
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).to(dtype)
    params = list(model.parameters())

    def loss_fn(x):
        return model(x).square().mean()

    step = torch.compile(loss_fn, backend="adjoint", options=options, dynamic=dynamic)
    for T in lengths:
        x = torch.randn(2, T, 8, dtype=dtype)
        want = loss_fn(x)
        gw = torch.autograd.grad(want, params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            got = step(x)
        gg = torch.autograd.grad(got, params)
        assert torch.allclose(got, want, rtol=tol, atol=tol), T
        for a, b in zip(gg, gw):
            assert torch.allclose(a, b, rtol=tol, atol=tol), (T, float((a - b).abs().max()))
        if after is not None:
            after(T)
    return step


@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
@pytest.mark.slow
def test_fifty_lengths_keep_the_rewrite_with_bounded_compiles(dynamic, monkeypatch):
    pipelines, compiles = [], []
    real_compile = inner_mod.compile_inner

    def counting(gm, ex, inner, **kw):
        compiles.append(len(ex))
        return real_compile(gm, ex, inner, **kw)

    import adjoint_compile.runtime.shard_program as sp
    monkeypatch.setattr(sp, "compile_inner", counting)
    real_dispatch = lengths_mod.LengthDispatch._specialize

    def spec(self, key, args):
        pipelines.append(key)
        return real_dispatch(self, key, args)

    monkeypatch.setattr(lengths_mod.LengthDispatch, "_specialize", spec)
    step = _run(LENGTHS, {"inner": "aot_eager", "shard_size": 8}, dynamic)
    (region,) = generic_regions(step)
    # every length from the first one that shards on; the static first call (17) and T = 1 (dynamo specializes it)
    # have graphs of their own, and the short ones before the first long one run with ordinary autograd
    assert set(LENGTHS[2:-1]) <= region.lengths, sorted(set(LENGTHS) - region.lengths)
    # the one graph was made by at most one try at a short length and one that lowered
    assert len(pipelines) <= 2, pipelines
    # shard programs: lengths 8, 4, 2, 1 (forward, and recompute + VJP per call pattern): bounded, not per length
    assert len(compiles) <= 24, len(compiles)
    report = ac.report(step)
    assert any(r.rewrite == "adjoint" for r in report.regions)
    # the report's row of the region serving every length names the lengths it ran, not only the one it was lowered at
    rows = [d for d in report.to_dict()["regions"] if d.get("lengths")]
    assert rows and all(d["lengths"] == sorted(region.lengths) and d["rewrite"] == "adjoint" for d in rows)
    line = next(ln for ln in str(report).splitlines() if "serves every length" in ln)
    assert f"{min(region.lengths)}..{max(region.lengths)}" in line and f"({len(region.lengths)} so far:" in line
    fallbacks = [f for rec in report.compiled for f in rec.fallbacks]
    # a length too short to shard, said once per graph, is the only fallback, with the sizes it affected (auto-dynamic:
    # T = 3 before the first long call; dynamic=True: T = 1, which dynamo compiles with batch symbolic and T static)
    assert fallbacks and {f.cause for f in fallbacks} == {"a length too short to shard, before any longer one"}
    assert all("one shard" in f.details["first"] for f in fallbacks)
    shorts = [next(a for a in sig if isinstance(a, tuple) and len(a[0]) == 3)[0][1]
              for f in fallbacks for sig in f.details["signatures"]]
    assert shorts and all(T <= 3 for T in shorts), shorts


@pytest.mark.slow
def test_short_lengths_and_zero_behave_as_eager():
    step = _run([5, 7, 1, 2, 3], {"inner": "aot_eager", "shard_size": 4})
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).double()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": 4})
    empty = torch.randn(2, 0, 8, dtype=torch.float64)
    assert f(empty).shape == model(empty).shape == (2, 0, 8)
    assert step is not None


def test_pow2_tail_partitions_the_steps():
    from adjoint_compile.runtime.shard_parts import shard_bounds

    for T in range(1, 40):
        b = shard_bounds(T, 8, pow2_tail=True)
        assert b[0][0] == 0 and b[-1][1] == T and all(e1 == s2 for (_, e1), (s2, _) in zip(b, b[1:]))
        assert {e - s for s, e in b} <= {8, 4, 2, 1}


@pytest.mark.slow
def test_fifty_lengths_with_the_default_shard_size_keep_the_rewrite():
    """The default shard size (for this model in fp64 about 750 steps, 512 once rounded to a power of two, for every
    length): 50 lengths below and above two shards, each exact, the rewrite there at the last, and at most
    1 + log2(S) shard lengths compiled per call pattern."""
    compiles = []
    import adjoint_compile.runtime.shard_program as sp
    real = sp.compile_inner

    def counting(gm, ex, inner, **kw):
        compiles.append(gm)
        return real(gm, ex, inner, **kw)

    rng = torch.Generator().manual_seed(0)
    lengths = [3001, 2503] + sorted(set(torch.randint(1100, 4400, (80,), generator=rng).tolist()) - {3001, 2503})[:48]
    lengths = lengths[:2] + [lengths[2:][i] for i in torch.randperm(48, generator=rng).tolist()]
    assert len(set(lengths)) == 50
    sp.compile_inner, saved = counting, sp.compile_inner
    try:
        step = _run(lengths, {"inner": "aot_eager"})
    finally:
        sp.compile_inner = saved
    (region,) = generic_regions(step)
    assert region.lengths == set(lengths[1:])  # 3001 ran its own static graph
    (S,) = {r._plan.shard_size for r in region.regions.values()}
    assert S & (S - 1) == 0 and 2 * S < max(lengths)
    assert len(compiles) <= 6 * (1 + S.bit_length()), len(compiles)
    assert ac.report(step).fallbacks == []


@pytest.mark.slow
def test_short_lengths_before_a_long_one_are_said_once_with_their_sizes():
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).double()
    step = torch.compile(lambda x: model(x).square().mean(), backend="adjoint",
                         options={"inner": "aot_eager", "shard_size": 8})
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for T in (40, 3, 5, 6, 7, 40, 33):
            step(torch.randn(2, T, 8, dtype=torch.float64)).backward()
    short = [w for w in got if "too short to shard" in str(w.message)]
    assert len(short) == 1 and issubclass(short[0].category, AdjointCompileWarning)
    (fb,) = ac.report(step).fallbacks
    assert [next(a for a in sig if isinstance(a, tuple) and len(a[0]) == 3)[0][1]
            for sig in fb.details["signatures"]] == [3, 5, 6, 7]
    (region,) = generic_regions(step)
    assert region.lengths == {40, 33}  # 40 first ran its static graph
    # the report names the short calls' sizes, and the symbolic graph's rows where the graph was lowered
    text = str(ac.report(step))
    assert "(sizes so far: (2, 3, 8), (2, 5, 8), (2, 6, 8), (2, 7, 8))" in text, text
    assert "lowered at the first call long enough to shard ((2, 40, 8))" in text, text
    assert "longer sequences are sharded" not in str(short[0].message)


def test_a_buffer_written_by_the_forward_is_written_once_per_call_at_every_length():
    """The first-call check of the one graph for every length runs the graph as captured on copies of the inputs it
    writes into (a call counter, like BatchNorm's running statistics)."""
    from test_capture_never_wrong import Scan

    torch.manual_seed(0)
    m = Scan()
    f = torch.compile(m, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    for i, T in enumerate((9, 13, 17, 11), start=1):
        x = torch.randn(2, T, 6, dtype=torch.float64)
        want = Scan.forward(m, x)  # NB: counts too
        m.calls -= 1
        got = f(x)
        assert float(m.calls) == i and torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert len(generic_regions(f)) == 1


@pytest.mark.slow
def test_prepared_lengths_are_bounded(monkeypatch):
    from adjoint_compile.runtime import length_generic

    monkeypatch.setattr(length_generic, "KEEP", 3)
    step = _run([20, 21, 22, 23, 24, 25, 22], {"inner": "aot_eager", "shard_size": 4})
    (region,) = generic_regions(step)
    assert [key[0] for key in region.regions] == [24, 25, 22] and region.lengths == {21, 22, 23, 24, 25}


def test_a_new_length_builds_only_shard_lengths_not_built_before(monkeypatch):
    """A new length prepares its region (shapes and analysis) but takes the shard programs another length built and
    checked from the same analysis: only a shard length not seen before is built. Exact at every length."""
    import adjoint_compile.runtime.shard_program as sp

    built = []
    real = sp.ShardProgram._build
    monkeypatch.setattr(sp.ShardProgram, "_build", lambda self, L: (built.append(L), real(self, L))[1])
    per_length = {}

    def after(T):
        per_length[T] = sorted(built)
        built.clear()
    _run([20, 21, 22, 23, 27, 29], {"inner": "aot_eager", "shard_size": 4}, after=after)
    # shards of 4 and a tail of powers of two: 21, the first length served by the lowering at 20, builds its 4- and
    # 1-step programs (the lowered length's own are not free of T), 22 a 2-step one, later lengths nothing
    assert set(per_length[21]) == {1, 4}, per_length
    assert per_length[22] and set(per_length[22]) == {2}, per_length
    assert per_length[23] == per_length[27] == per_length[29] == [], per_length


@pytest.mark.slow
def test_sizes_fold_when_fake_propagation_drops_python_numbers(monkeypatch):
    """Before torch 2.13 FakeTensorProp recorded tensors and symbolic numbers only: a size computed from a now static
    shape kept dynamo's symbolic value (a tuple of sizes became Nones). Specialization must fold those sizes anyway,
    or every length after the first runs with ordinary autograd."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    real = FakeTensorProp.run_node

    def before_2_13(self, n):
        before = n.meta.get("val")
        out = real(self, n)
        if isinstance(out, (bool, int, float)):
            n.meta["val"] = before
        elif isinstance(out, (tuple, list)) and not any(isinstance(x, torch.Tensor) for x in out):
            n.meta["val"] = tuple(None for _ in out)
        return out

    monkeypatch.setattr(FakeTensorProp, "run_node", before_2_13)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        step = _run([40, 33, 57, 21], {"inner": "aot_eager", "shard_size": 8})
    assert not [w for w in got if issubclass(w.category, AdjointCompileWarning)], [str(w.message) for w in got]
    assert ac.report(step).fallbacks == []
    (region,) = generic_regions(step)
    assert region.lengths == {33, 57, 21}


def test_a_lowering_failure_is_not_called_a_short_length(monkeypatch):
    """A region whose lowering fails for a reason other than its size is not reported as "too short to shard": the
    graph with symbolic sizes serves every later length, said once with the reason, and listed in the report."""
    from adjoint_compile.passes.lower import sharded as lower_adjoint

    def failing(gm, nodes):
        raise lower_adjoint.UnsupportedRegion("a planted failure")

    monkeypatch.setattr(lower_adjoint, "outline", failing)
    step = _run([40, 33, 57], {"inner": "aot_eager", "shard_size": 8})  # NB: exact against eager at each length
    (fb,) = ac.report(step).fallbacks
    assert fb.cause == "the recognized regions could not be lowered", fb.cause
    assert "a planted failure" in fb.details["first"] and len(fb.details["signatures"]) == 2


def _scaled(by: str):
    def model(a, b):
        n = a.shape[1] if by == "length" else a.shape[0]
        return ac.ops.linear_scan(torch.sigmoid(a), b / n)  # a size read as a number inside the region
    return model


@pytest.mark.parametrize("by", ["length", "batch"])
def test_a_size_read_as_a_number_inside_the_region_is_exact_at_every_size(by):
    """The graph for every length is lowered at one call's sizes: a length read as a number (``b / T``) would keep
    that call's T (off by 1 - 7/13 at T = 7), so such a graph is specialized per size instead; a batch size is held
    at its value and other batch sizes are specialized."""
    model = _scaled(by)
    f = torch.compile(model, backend="adjoint", options={"shard_size": 3, "inner": "eager"})
    torch.manual_seed(0)
    sizes = [(2, 11), (2, 13), (2, 7), (2, 17)] if by == "length" else [(1, 11), (2, 11), (3, 11), (2, 11)]
    for B, T in sizes:
        a = torch.randn(B, T, 4, dtype=torch.float64, requires_grad=True)
        b = torch.randn(B, T, 4, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            got = f(a, b)
        want = model(a, b)
        w = torch.randn_like(want)
        (gg,), (gw,) = torch.autograd.grad(got, a, w), torch.autograd.grad(want, a, w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{(B, T)}: {m}")
        torch.testing.assert_close(gg, gw, rtol=1e-12, atol=1e-12, msg=lambda m: f"{(B, T)}: {m}")
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions)


@pytest.mark.slow
def test_a_batch_size_held_by_the_regions_keeps_one_graph_for_its_lengths():
    """SSMStack reshapes by its batch size: with dynamic=True (every size symbolic) the graph for every length holds
    B at its first value, serves every length at that B, and a call at another B is specialized, all exact."""
    torch.manual_seed(0)
    model = SSMStack(d_model=6, d_state=3, n_layers=2).double()
    f = torch.compile(model, backend="adjoint", dynamic=True, options={"shard_size": 3, "inner": "eager"})
    for B, T in [(2, 11), (2, 13), (3, 7), (1, 17), (2, 9), (3, 7)]:
        x = torch.randn(B, T, 6, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            got = f(x)
        want = model(x)
        w = torch.randn_like(want)
        gg = torch.autograd.grad(got, list(model.parameters()), w)
        gw = torch.autograd.grad(want, list(model.parameters()), w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{(B, T)}: {m}")
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{(B, T)}: {m}")
    (region,) = generic_regions(f)[:1]
    assert {11, 13, 9} <= region.lengths and not {7, 17} & region.lengths


class _ReshapeByBatch(torch.nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.la, self.lb = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        B, T = x.shape[0], x.shape[1]
        return ac.ops.linear_scan(torch.sigmoid(self.la(x)).reshape(B, T, -1), self.lb(x).reshape(B, T, -1))


def test_a_first_call_with_as_many_sequences_as_steps_is_exact_later():
    """dynamic=True with a first call of B == T: dynamo gives both one symbol, so the region cannot tell its batch
    from its length; each size is specialized (a later [2, 2] call ran with B = 3 and raised)."""
    torch.manual_seed(0)
    model = _ReshapeByBatch().double()
    f = torch.compile(model, backend="adjoint", dynamic=True, options={"shard_size": 2, "inner": "eager"})
    for B, T in [(3, 3), (2, 2), (2, 5), (4, 4)]:
        x = torch.randn(B, T, 6, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            got = f(x)
        torch.testing.assert_close(got, model(x), rtol=1e-12, atol=1e-12, msg=lambda m: f"{(B, T)}: {m}")


class _TinyLM(torch.nn.Module):
    def __init__(self, d: int = 8, V: int = 11) -> None:
        super().__init__()
        self.emb, self.dec, self.inp = torch.nn.Embedding(V, d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, V)

    def forward(self, ids):
        x = self.emb(ids)
        h = x + ac.ops.linear_scan(torch.sigmoid(self.dec(x)), self.inp(x))
        return torch.nn.functional.cross_entropy(self.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def test_batches_of_one_compile_no_programs_per_length(monkeypatch):
    """At B = 1 a shard [1, L] of a [1, T] input keeps T as the stride of its size-1 batch dim, which keyed the shard
    programs: every new length compiled 8-15 programs more (115 for 12 lengths), without end."""
    import adjoint_compile.runtime.shard_program as sp
    compiles = []
    real = sp.compile_inner
    monkeypatch.setattr(sp, "compile_inner", lambda gm, ex, *a, **k: (compiles.append(1), real(gm, ex, *a, **k))[1])
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyLM().double()
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="adjoint", options={"shard_size": 16, "inner": "aot_eager"})
    counts = []
    for T in (100, 120, 68, 86, 83, 224, 126, 197):
        ids = torch.randint(0, 11, (1, T))
        got = torch.autograd.grad(step(ids), list(model.parameters()))
        want = torch.autograd.grad(ref(ids), list(ref.parameters()))
        for a, b in zip(got, want):
            assert (a - b).norm() <= 1e-10 * b.norm(), T
        counts.append(len(compiles))
    # a few programs per shard length (the short last shards' lengths), none per sequence length
    assert counts[-1] == counts[-4] and counts[-1] <= 10, counts


@pytest.mark.slow
def test_a_long_sequence_in_a_smaller_batch_than_the_short_ones_is_sharded():
    """Short calls in big batches ((64, 10), (48, 12): too short to shard), then long ones in a batch of 2: the retry
    was keyed on the inputs' total size, smaller at (2, 100), so every long call kept ordinary autograd."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyLM().double()
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="adjoint", options={"shard_size": 16, "inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for B, T in ((64, 10), (48, 12), (2, 100), (2, 140)):
            ids = torch.randint(0, 11, (B, T))
            got = torch.autograd.grad(step(ids), list(model.parameters()))
            want = torch.autograd.grad(ref(ids), list(ref.parameters()))
            for a, b in zip(got, want):
                assert (a - b).norm() <= 1e-10 * b.norm(), (B, T)
    (region,) = generic_regions(step)
    assert max(region.lengths) >= 139, region.lengths


class _TokenShift(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.k = torch.nn.Linear(d, d)

    def forward(self, x):
        k = self.k(x + torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1))
        a = torch.sigmoid(k)
        return (x + ac.ops.linear_scan(a, (1 - a) * k)).square().mean()


class _CausalConv(torch.nn.Module):
    """A depthwise causal conv before the scan, written as transformers' Mamba writes it (cut to the length read
    from the input) or with an explicit left pad."""

    def __init__(self, padded: bool, d: int = 8) -> None:
        super().__init__()
        self.padded = padded
        self.conv = torch.nn.Conv1d(d, d, 4, groups=d, padding=0 if padded else 3)
        self.k = torch.nn.Linear(d, d)

    def forward(self, x):
        xt = x.transpose(1, 2)
        if self.padded:
            u = self.conv(torch.nn.functional.pad(xt, (3, 0)))
        else:
            u = self.conv(xt)[..., :x.shape[1]]
        u = u.transpose(1, 2)
        a = torch.sigmoid(self.k(u))
        return (x + ac.ops.linear_scan(a, (1 - a) * u)).square().mean()


@pytest.mark.parametrize("make", [_TokenShift, lambda: _CausalConv(False), lambda: _CausalConv(True)],
                         ids=["token-shift", "conv-cut", "conv-pad"])
def test_token_shifts_and_causal_convs_serve_every_length_from_one_lowering(make):
    """A token shift (rewritten to one op before lowering) and a causal conv cut at the length read from the input
    were lowered and compiled again at every new length. Now the graph for every length takes them in: each length
    exact against eager, its region run in shards with the conv's or shift's halo, no warning."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="adjoint", options={"shard_size": 16, "inner": "aot_eager"})
    lengths = (100, 120, 141, 37, 160)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for T in lengths:
            x = torch.randn(2, T, 8, dtype=torch.float64)
            g = torch.autograd.grad(step(x), list(model.parameters()))
            w = torch.autograd.grad(ref(x), list(ref.parameters()))
            assert all((a - b).norm() <= 1e-10 * b.norm() for a, b in zip(g, w)), T
    assert not [x.message for x in got if issubclass(x.category, AdjointCompileWarning)]
    (region,) = generic_regions(step)
    assert region.lengths == set(lengths[1:]), region.lengths
    prepared = [r for (T, *_), r in region.regions.items() if T == 141]
    assert len(prepared) == 1 and len(prepared[0]._plan.convs) == 1, prepared


def test_regions_lowered_per_length_say_so_once():
    """A region that reads the length as a number (``b / T``) cannot serve every length from one lowering: every new
    length is lowered and compiled again. That was said at INFO only, while the symbolic graph's rows claimed one
    lowering for every length."""
    torch._dynamo.reset()
    model = _scaled("length")
    step = torch.compile(model, backend="adjoint", options={"shard_size": 3, "inner": "eager"})
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for T in (11, 13, 7, 17):
            a = torch.randn(2, T, 4, dtype=torch.float64, requires_grad=True)
            b = torch.randn(2, T, 4, dtype=torch.float64)
            torch.testing.assert_close(step(a, b), model(a, b), rtol=1e-12, atol=1e-12)
    said = [str(x.message) for x in got if "cannot serve every sequence length" in str(x.message)]
    assert len(said) == 1 and "compiled again" in said[0] and "reads the length as a number" in said[0], said
    rows = [r.reason for r in ac.report(step).regions if r.reason.startswith("dynamic shapes")]
    assert rows and all("each new length is specialized, lowered and compiled again" in r for r in rows), rows


class _Loop(torch.nn.Module):
    """A loop over the steps that writes them into a buffer, or that carries two states, the second reading the
    first (g = c·g + h: taken for a gated recurrence, which exact mode does not rewrite)."""

    def __init__(self, form: str, d: int = 8) -> None:
        super().__init__()
        self.form = form
        self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        a, b = torch.sigmoid(self.k(x)), self.v(x)
        h, g, out, hs = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0]), torch.zeros_like(x), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            if self.form == "buffer":
                out[:, t] = h
            else:
                g = a[:, t] * g + h
                hs.append(g * h)
        return (x + self.o(out if self.form == "buffer" else torch.stack(hs, 1))).square().mean()


def test_a_loop_writing_a_buffer_is_rewritten_at_every_length():
    """From the second length on, dynamo hands a graph with symbolic sizes, which is not normalized: its loop
    writing into a buffer was not recognized there, and every later length ran with ordinary autograd, silently."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Loop("buffer").double()
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "eager"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for T in (13, 9, 17):
            x = torch.randn(2, T, 8, dtype=torch.float64)
            g = torch.autograd.grad(step(x), list(model.parameters()))
            w = torch.autograd.grad(ref(x), list(ref.parameters()))
            assert all((a - b).norm() <= 1e-10 * b.norm() for a, b in zip(g, w)), T
    assert not [x.message for x in said if issubclass(x.category, AdjointCompileWarning)]
    rows = [(r.length, r.rewrite) for r in ac.report(step).regions if r.kind == "linear_recurrence"]
    assert {T for T, how in rows if how == "adjoint"} == {13, 9, 17}, rows


@pytest.mark.slow
def test_a_graph_with_nothing_to_rewrite_at_any_length_is_not_called_short():
    """A symbolic graph whose specialization rewrites nothing (two carried states, one reading the other) was run as
    'a length too short to shard', warned, and specialized again at every longer length. Now it runs as captured,
    without that warning, and its rows say why."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Loop("two states").double()
    step = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "eager"}, dynamic=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for T in (13, 9, 17, 40):
            x = torch.randn(2, T, 8, dtype=torch.float64)
            torch.testing.assert_close(step(x), model(x), rtol=1e-12, atol=1e-12)
    assert not [x.message for x in said if "too short" in str(x.message)], [str(x.message) for x in said]
    assert not ac.report(step).fallbacks
    # NB: the rows say why: the symbolic graph's specialization rewrites nothing, or (where the loop's chain of a*g
    # products is recognized whole, its last readout not taken for a step) the two-state loop is a gated recurrence
    rows = [(r.rewrite, r.reason) for r in ac.report(step).regions]
    assert rows and all(w == "none" and ("rewrites nothing, whatever the length" in r or "gated recurrence" in r)
                        for w, r in rows), rows


class _ShiftedLM(torch.nn.Module):
    def __init__(self, V: int = 32, d: int = 8) -> None:
        super().__init__()
        self.V, self.emb, self.k, self.v = V, torch.nn.Embedding(V, d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, V)

    def forward(self, ids):
        x = self.emb(ids)
        a = torch.sigmoid(self.k(x))
        h = ac.ops.linear_scan(a, (1 - a) * self.v(x)).reshape(ids.shape[0], ids.shape[1], -1)  # NB: holds B
        logits = self.head(x + h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.V), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_a_loss_shifted_by_slicing_the_logits_serves_every_length_from_one_lowering(dynamic):
    """The loss's shift by one written on the logits (``logits[:, :-1]`` against ``ids[:, 1:]``) is rewritten at
    lowering into labels padded with an ignored target, which the graph for every length did not have: each new
    length was lowered and compiled again. The padded labels are now made there too (with dynamic=True, without
    specializing the batch size the regions hold in the shape environment)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ShiftedLM().double()
    ref = copy.deepcopy(model)
    step = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "eager"}, dynamic=dynamic)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for T in (13, 9, 17, 31):
            ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
            got, want = step(ids), ref(ids)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            g = torch.autograd.grad(got, list(model.parameters()))
            w = torch.autograd.grad(want, list(ref.parameters()))
            assert all((a - b).norm() <= 1e-10 * b.norm() for a, b in zip(g, w)), T
    assert not [str(x.message) for x in said if issubclass(x.category, AdjointCompileWarning)]
    (region,) = generic_regions(step)
    assert region.lengths == ({13, 9, 17, 31} if dynamic else {9, 17, 31}), region.lengths


def _lowerings(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes (the [B, T, D] argument) of the calls specialized or lowered from now on, as they come."""
    lowered: list[tuple[int, ...]] = []
    real = lengths_mod.LengthDispatch._specialize

    def spec(self, key, args):
        lowered.append(next(tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 3))
        return real(self, key, args)

    monkeypatch.setattr(lengths_mod.LengthDispatch, "_specialize", spec)
    return lowered


def _exact_at_lengths(step, loss, model, ref, inputs, tol=1e-10, tols=None):
    """``step``'s gradients at each input equal ``loss(ref, input)``'s (relative ``tol``, or ``tols[name]``); returns
    the AdjointCompileWarnings said."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in inputs:
            g = torch.autograd.grad(step(x), list(model.parameters()))
            w = torch.autograd.grad(loss(ref, x), list(ref.parameters()))
            for (name, _), a, b in zip(model.named_parameters(), g, w):
                assert (a - b).norm() <= (tols or {}).get(name.split(".")[-1], tol) * b.norm(), (x.shape, name)
    return [str(m.message) for m in said if issubclass(m.category, AdjointCompileWarning)]


def test_min_gru_keeps_its_last_steps_and_serves_every_length_from_one_lowering():
    """minGRU ends with ``out[:, -seq_len:]``, a slice of the whole, read from the length: every new length was
    lowered and compiled again ("reads the length as a number"). At every length it keeps the whole, as capture
    found at the lowered one."""
    from minGRU_pytorch.minGRU import minGRU

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(minGRU(16), minGRU(16)).double()
    ref = copy.deepcopy(model)
    step = torch.compile(lambda x: model(x).square().mean(), backend="adjoint",
                         options={"shard_size": 16, "inner": "eager"})
    xs = [torch.randn(2, T, 16, dtype=torch.float64) for T in (64, 100, 150, 37)]
    assert not _exact_at_lengths(step, lambda m, x: m(x).square().mean(), model, ref, xs)
    assert {T for r in generic_regions(step) for T in r.lengths} == {100, 150, 37}


@pytest.mark.slow
def test_a_batch_of_another_size_does_not_make_every_later_length_compile_again(monkeypatch):
    """A batch of another size (an epoch's last, short batch) makes dynamo recompile with a symbolic batch size; the
    graph for every length it makes holds that size (SSMStack reshapes by it), and every later call of the usual
    size was specialized, lowered and compiled per length, silently. Now each held value gets one graph for every
    length."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).double()
    ref = copy.deepcopy(model)
    lowered = _lowerings(monkeypatch)
    c = torch.randn(8, dtype=torch.float64)  # NB: not square().mean() after the final norm: its gradient is ~0

    def loss(m, x):
        return (m(x) * c).mean()

    step = torch.compile(lambda x: loss(model, x), backend="adjoint", options={"shard_size": 8, "inner": "eager"})
    xs = [torch.randn(B, T, 8, dtype=torch.float64) for B, T in [(2, 40), (2, 50), (2, 60), (3, 47)]]
    said = _exact_at_lengths(step, loss, model, ref, xs)
    before = len(lowered)
    xs = [torch.randn(B, T, 8, dtype=torch.float64) for B, T in [(2, 40), (2, 50), (2, 60), (2, 70), (2, 41)]]
    said += _exact_at_lengths(step, loss, model, ref, xs)
    assert len(lowered) - before <= 1, lowered  # NB: one graph for every length at B = 2 in the new graph, once
    assert not said, said


@pytest.mark.slow
def test_graphs_for_every_length_per_held_batch_size_are_bounded_and_said():
    """Each batch size the regions hold gets a graph for every length, up to MAX_GENERIC; calls at further batch
    sizes are specialized per length, said once, and stay exact."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).double()
    ref = copy.deepcopy(model)
    c = torch.randn(8, dtype=torch.float64)
    step = torch.compile(lambda x: (model(x) * c).mean(), backend="adjoint",
                         options={"shard_size": 8, "inner": "eager"}, dynamic=True)
    sizes = [(B, T) for B in range(2, 3 + lengths_mod.MAX_GENERIC) for T in (20, 27)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for B, T in sizes:
            x = torch.randn(B, T, 8, dtype=torch.float64)
            g = torch.autograd.grad(step(x), list(model.parameters()))
            w = torch.autograd.grad((ref(x) * c).mean(), list(ref.parameters()))
            assert all((a - b).norm() <= 1e-10 * b.norm() for a, b in zip(g, w)), (B, T)
    held = [str(x.message) for x in said if "graphs for every length are made" in str(x.message)]
    assert len(held) == 1, [str(x.message) for x in said]


@pytest.mark.slow
def test_min_lm_with_its_loss_serves_every_length_from_one_lowering():
    """minLM (conv, two minGRU layers, its own loss on ``ids[:, :-1]`` against ``ids[:, 1:]``) lowers into two
    region calls, the second reading the first's output, and its minGRU keeps ``out[:, -seq_len:]`` of T - 1 steps:
    every new length was lowered and compiled again."""
    from minGRU_pytorch.minLM import minLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = minLM(num_tokens=32, dim=16, depth=2, enable_conv=True).double()
    ref = copy.deepcopy(model)
    step = torch.compile(lambda ids: model(ids, return_loss=True), backend="adjoint",
                         options={"shard_size": 16, "inner": "eager"})
    ids = [torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T)) for T in (65, 40, 101, 33)]
    assert not _exact_at_lengths(step, lambda m, x: m(x, return_loss=True), model, ref, ids)
    regions = generic_regions(step)
    assert len(regions) == 2 and all(r.lengths == {39, 100, 32} for r in regions), [r.lengths for r in regions]


@pytest.mark.slow
def test_mambapy_pscan_lengths_of_one_padded_size_share_one_lowering():
    """mambapy's PScan (an autograd.Function, captured as a known scan) is called with the length among its
    arguments: each new length was lowered and compiled again ("reads the length as a number"). Lengths that its
    Python pads to one power of two share dynamo's graph and now one lowering."""
    from mambapy.mamba import Mamba, MambaConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mamba(MambaConfig(d_model=8, n_layers=1, d_state=4, pscan=True)).double()
    ref = copy.deepcopy(model)
    c = torch.randn(8, dtype=torch.float64)
    step = torch.compile(lambda x: (model(x) * c).mean(), backend="adjoint",
                         options={"shard_size": 8, "inner": "eager"})
    xs = [torch.randn(2, T, 8, dtype=torch.float64) for T in (40, 50, 63, 45)]
    # NB: 1e-6 for A_log and D: mambapy computes with A_log.float() and D.float() whatever the model's dtype
    assert not _exact_at_lengths(step, lambda m, x: (m(x) * c).mean(), model, ref, xs, tols={"A_log": 1e-6, "D": 1e-6})
    assert {T for r in generic_regions(step) for T in r.lengths} == {50, 63, 45}


@pytest.mark.slow
def test_a_batch_size_first_seen_too_short_to_shard_gets_its_graph_at_a_longer_call(monkeypatch):
    """Another batch size whose first call is too short to shard is tried again at a longer call, which makes its
    graph for every length; the calls after it are not lowered again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SSMStack(d_model=8, d_state=3, n_layers=2).double()
    ref = copy.deepcopy(model)
    lowered = _lowerings(monkeypatch)
    c = torch.randn(8, dtype=torch.float64)
    step = torch.compile(lambda x: (model(x) * c).mean(), backend="adjoint",
                         options={"shard_size": 8, "inner": "eager"}, dynamic=True)
    xs = [torch.randn(B, T, 8, dtype=torch.float64) for B, T in ((2, 40), (2, 50), (3, 5), (3, 45), (3, 60), (3, 33))]
    _exact_at_lengths(step, lambda m, x: (m(x) * c).mean(), model, ref, xs)
    assert lowered[-2:] == [(3, 5, 8), (3, 45, 8)], lowered



class _Scan(torch.nn.Module):
    def __init__(self, d: int = 8, wide: int = 0) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.o = torch.nn.Sequential(torch.nn.Linear(d, wide), torch.nn.GELU(), torch.nn.Linear(wide, d)) if wide \
            else torch.nn.Linear(d, d)

    def forward(self, x):
        return self.o(ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x)))


def test_a_model_declined_at_every_length_is_no_fallback_and_every_length_is_reported():
    """The default shard size (tens of thousands of steps here) leaves T = 64, 37, 100 one shard each: nothing is
    ever rewritten. The second length was warned as "too short to shard, before any longer one ... longer sequences
    are sharded", listed as a fallback of a rewrite there never was, its rows pointed at "later compiled graphs"
    that did not exist, and T = 100 appeared nowhere."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scan().double()
    ref = copy.deepcopy(model)
    step = torch.compile(lambda x: model(x).square().mean(), backend="adjoint", options={"inner": "eager"})
    xs = [torch.randn(2, T, 8, dtype=torch.float64) for T in (64, 37, 100)]
    said = _exact_at_lengths(step, lambda m, x: m(x).square().mean(), model, ref, xs)
    assert not [w for w in said if "longer sequences are sharded" in w or "before any longer" in w], said
    assert [w for w in said if "nothing rewritten at the sizes (2, 37, 8)" in w and "one shard: T=37" in w], said
    report = ac.report(step)
    assert report.fallbacks == [] and not any(r.rewrite != "none" for r in report.regions)
    text = str(report)
    assert "see the later compiled graphs" not in text and "fallbacks" not in text, text
    assert "nothing to shard at the sizes run so far ((2, 37, 8), (2, 100, 8))" in text, text
    assert [r for r in report.regions if r.length == 100 and r.reason.startswith("one shard: T=100")], text


def _saved_bytes(model, x, loss) -> int:
    """What eager autograd saves for ``loss(model, x)``: the storages of its saved tensors, less the parameters' and
    the input's."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model, x)
    return sum(seen.values())


@pytest.mark.parametrize("wide", [0, 32], ids=["linear", "mlp"])
def test_a_later_lengths_memory_figures_are_explains_at_that_length(wide):
    """A later length's graph (specialized from the symbolic one) counted every view (movedim) as an allocation: 5 KiB
    at T = 7 where explain() said 2 KiB. explain() counted F.linear's 3-d outputs (views of the 2-d results the op
    makes itself) as nothing, so its bound fell below what eager autograd saves (7 KiB against 11 KiB for the MLP).
    Both now count storages: the same figures, at least what autograd saves."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scan(wide=wide)
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    opts = {"shard_size": 4, "inner": "eager"}
    step = torch.compile(lambda x: loss(model, x), backend="adjoint", options=opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdjointCompileWarning)
        for T in (16, 7):
            step(torch.randn(2, T, 8)).backward()
    got = {r.length: r.details["expected_memory_bytes"] for r in ac.report(step).regions if r.rewrite != "none"}
    assert set(got) == {16, 7}, got
    for T in (16, 7):
        x = torch.randn(2, T, 8)
        (want,) = [r.details["expected_memory_bytes"] for r in ac.explain(lambda x: loss(model, x), x, options=opts)
                   .regions if r.rewrite != "none"]
        assert got[T] == want, (T, got[T], want)
        assert want["autograd"] >= _saved_bytes(model, x, loss), (T, want)


def _generic_scan_loss(a, b):
    from torch._higher_order_ops.associative_scan import associative_scan

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    _, h = associative_scan(combine, (a, b), dim=0, combine_mode="generic")
    return h.square().sum()


@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_a_generic_associative_scan_is_rewritten_at_every_length(dynamic):
    """torch's ``associative_scan`` in generic mode (the CPU path) is dynamo's unrolled tree of vmapped combines,
    read by running its data movement on the call's length. With symbolic sizes the graph is now specialized to each
    call's length and read there. Before, only the first length was rewritten: the symbolic graph's matcher raised
    (a slice end that is a graph node), the specialization dropped the vmaps' enter and exit nodes as dead code, and
    the memory saving was gone from the second length on."""
    torch._dynamo.reset()
    step = torch.compile(_generic_scan_loss, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"},
                         dynamic=dynamic)
    for T in (23, 31, 17):
        g = torch.Generator().manual_seed(T)
        a = torch.rand(T, 3, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(T, 3, generator=g, dtype=torch.float64, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdjointCompileWarning)
            got = torch.autograd.grad(step(a, b), (a, b))
        want = torch.autograd.grad(_generic_scan_loss(a, b), (a, b))
        for x, y in zip(got, want):
            assert (x - y).abs().max() < 1e-10
        assert torch._C._functorch.maybe_current_level() is None  # NB: no vmap left entered by a failed pass
    rep = ac.report(step)
    assert [(r.source, r.rewrite, r.length) for r in rep.regions] == [
        ("associative_scan", "adjoint", T) for T in (23, 31, 17)], str(rep)
    assert not rep.rejections and not rep.fallbacks, str(rep)
