"""Dropout inside a sharded region: masks that are a hash of (seed, position), so a shard's recomputation sees the
forward's mask (kernels/random.py, passes/capture/seeded_dropout.py)."""
import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.kernels.random import hashed_dropout, new_seed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import selective_ssm  # noqa: E402


def test_hashed_dropout_is_bernoulli_scaled_and_off_when_asked():
    x = torch.ones(200_000)
    seed = torch.tensor(7)
    y = hashed_dropout(x, 0.3, True, seed)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.005
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.7))
    assert torch.equal(hashed_dropout(x, 0.3, False, seed), x) and torch.equal(hashed_dropout(x, 0.0, True, seed), x)
    assert not torch.equal(hashed_dropout(x, 0.3, True, torch.tensor(8)), y)  # another seed, another mask
    # neighbouring elements are not correlated: P(both kept) ~ 0.49
    assert abs((kept[1:] & kept[:-1]).float().mean().item() - 0.49) < 0.01


def test_streams_of_one_seed_are_independent():
    x, seed = torch.ones(100_000), torch.tensor(7)
    masks = [hashed_dropout(x, 0.5, True, seed, stream=k) != 0 for k in range(3)]
    assert torch.equal(masks[0], hashed_dropout(x, 0.5, True, seed) != 0)  # stream 0 is the seed's own
    for i in range(3):
        for j in range(i):  # P(both kept) ~ 0.25 for independent masks, 0.5 for one shared mask
            assert abs((masks[i] & masks[j]).float().mean().item() - 0.25) < 0.01


@pytest.mark.parametrize("d", [0, 1, 2])
def test_a_shard_gets_the_slice_of_the_full_mask(d):
    """The property the sharded runtime relies on: shard [t0, t0+L) of the mask = the full mask's slice."""
    x = torch.randn(3, 11, 4).movedim(1, d).contiguous()
    T = x.shape[d]
    seed = torch.tensor(12345)
    full = hashed_dropout(x, 0.4, True, seed)
    for t0, L in [(0, 4), (4, 4), (8, 3), (5, 1)]:
        part = hashed_dropout(x.narrow(d, t0, L).contiguous(), 0.4, True, seed, torch.tensor(t0), d, T)
        assert torch.equal(part, full.narrow(d, t0, L))
        part = hashed_dropout(x.narrow(d, t0, L).contiguous(), 0.4, True, seed, torch.tensor(t0), d, T, stream=3)
        assert torch.equal(part, hashed_dropout(x, 0.4, True, seed, stream=3).narrow(d, t0, L))



def test_a_shard_of_folded_rows_gets_its_rows_of_the_full_mask():
    """Rows ``[B·L, D]`` of shard [t0, t0+L) of a ``[B·T, D]`` tensor: row b·L + t has row b·T + t0 + t's mask."""
    B, T, D = 3, 11, 4
    x, seed = torch.randn(B * T, D), torch.tensor(777)
    full = hashed_dropout(x, 0.4, True, seed, stream=2)
    for t0, L in [(0, 4), (4, 4), (8, 3), (5, 1)]:
        rows = torch.cat([torch.arange(b * T + t0, b * T + t0 + L) for b in range(B)])
        part = hashed_dropout(x[rows], 0.4, True, seed, torch.tensor(t0), 0, T, stream=2, fold=B)
        assert torch.equal(part, full[rows]), (t0, L)

@pytest.mark.slow
def test_inductor_computes_the_same_mask():
    x, seed, t0 = torch.randn(2, 5, 8), torch.tensor(99), torch.tensor(10)
    for stream in (0, 5):
        f = lambda x, seed, t0: hashed_dropout(x, 0.3, True, seed, t0, 1, 37, stream=stream)  # noqa: E731
        torch._dynamo.reset()
        assert torch.equal(torch.compile(f, backend="inductor")(x, seed, t0), f(x, seed, t0)), stream


class DropoutStack(nn.Module):
    """The SSM stack with dropout on every layer's output, before the residual add."""

    def __init__(self, kind: str = "dropout"):
        super().__init__()
        self.stack = selective_ssm.SSMStack(8, 3, 2)
        self.kind = kind

    def forward(self, x):
        for norm, layer in zip(self.stack.norms, self.stack.layers):
            y = layer(norm(x))
            y = F.dropout(y, 0.3, self.training) if self.kind == "dropout" else F.dropout1d(y, 0.3, self.training)
            x = x + y
        return self.stack.norm_f(x)


def _streams(seed):
    """F.dropout as the backend runs it: the k-th dropout call of a forward draws from stream k of ``seed``."""
    calls = []

    def dropout(x, p=0.5, training=True, inplace=False):
        calls.append(None)
        return hashed_dropout(x, p, training, seed, stream=len(calls) - 1)
    return dropout


def _step(f, model, x, w):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(123)  # the graph draws its dropout seed first
    out = f(x)
    (out * w).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("shard", [1, 5, 36])  # NB: 37 = T would be one shard, which is declined
def test_dropout_inside_the_region_gives_autograds_gradients_for_the_same_masks(monkeypatch, inner, shard):
    torch.manual_seed(0)
    model = DropoutStack()
    x, w = torch.randn(2, 37, 8), torch.randn(2, 37, 8)
    torch.manual_seed(123)
    seed = new_seed()
    with monkeypatch.context() as mp:  # the reference: eager autograd with the masks the backend will draw
        mp.setattr(F, "dropout", _streams(seed))
        ref_out, ref_g = _step(model, model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": inner, "shard_size": shard})
    out, g = _step(f, model, x, w)
    res = ac.report(f).compiled[-1]
    assert len(res.lowered) == 1, [r.reason for r in res.regions]
    sub = res.captured.gm.get_submodule(res.lowered[0])
    assert sum(n.target is hashed_dropout for n in sub.region_gm.graph.nodes) == 2  # both dropouts inside
    assert _rel(out, ref_out) <= 1e-5
    for a, b in zip(g, ref_g):
        assert _rel(a, b) <= 1e-5


def test_other_dropouts_still_end_the_region():
    torch.manual_seed(0)
    model = DropoutStack("dropout1d")
    x = torch.randn(2, 12, 8)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 4})
    f(x)
    res = ac.report(f).compiled[-1]
    assert len(res.lowered) == 2  # one region per layer: dropout1d (whole channels) is not rewritten
    assert not any(n.target is hashed_dropout for n in res.captured.gm.graph.nodes)


class StepDropout(nn.Module):
    """Dropout inside a Python loop's step, as users write it: eager draws a new mask at every step."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.la, self.lb, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.3)

    def forward(self, x):
        a, b = torch.sigmoid(self.la(x)), self.lb(x)
        h, outs = torch.zeros(x.shape[0], x.shape[2]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + self.drop(b[:, t])
            outs.append(h)
        return torch.stack(outs, 1)


@pytest.mark.parametrize("roll_loops", [True, False])
def test_dropout_in_a_loop_step_draws_a_mask_per_step(monkeypatch, roll_loops):
    """Every step's dropout its own mask (one shared seed once gave all 13 steps the same mask), and the gradients
    those of eager autograd with the same masks."""
    torch.manual_seed(0)
    model = StepDropout().train()
    x, w = torch.randn(2, 13, 8), torch.randn(2, 13, 8)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 3, "roll_loops": roll_loops})
    out, g = _step(f, model, x, w)
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions), [r.reason for r in ac.report(f).regions]
    with torch.no_grad():  # the masks back from the outputs: drop(b_t) = h_t - a_t h_{t-1}
        a, b = torch.sigmoid(model.la(x)), model.lb(x)
        prev = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)
        kept = ((out - a * prev) / b).abs() > 1e-6
    assert (kept != kept[:, :1]).any(-1).float().mean() > 0.5  # most steps differ from the first
    torch.manual_seed(123)
    seed = new_seed()
    with monkeypatch.context() as mp:
        mp.setattr(F, "dropout", _streams(seed))
        ref_out, ref_g = _step(model, model, x, w)
    assert _rel(out, ref_out) <= 1e-5
    for a, b in zip(g, ref_g):
        assert _rel(a, b) <= 1e-5


class FoldedDropoutLM(nn.Module):
    """Dropout on the batch folded into rows (``[B·T, D]``, as ``rearrange('b l d -> (b l) d')`` code writes it)
    inside the region; ``seed`` set: the reference, the mask of the whole ``[B·T, D]`` tensor."""

    def __init__(self, V: int = 11, D: int = 8) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.a, self.b, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.seed = None

    def forward(self, ids, tg):
        x = self.emb(ids)
        b, t, d = x.shape
        rows = self.o(ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x), dim=1)).reshape(b * t, d)
        rows = F.dropout(rows, 0.5, self.training) if self.seed is None else hashed_dropout(rows, 0.5, True, self.seed)
        return F.cross_entropy(self.head(x + rows.view(b, t, d)).flatten(0, 1), tg.flatten())


@pytest.mark.parametrize("shard", [1, 4, 5])
@pytest.mark.slow
def test_dropout_on_rows_with_the_batch_folded_in_draws_the_full_masks(shard):
    """Each row of a shard of ``[B·L, D]`` rows gets the mask of its row b·T + t in the whole ``[B·T, D]`` tensor:
    the same whatever the shard size and over several lengths (a shard once hashed its rows as steps s + b·L + t:
    masks that changed with the shard size and repeated across the batch)."""
    torch.manual_seed(0)
    model = FoldedDropoutLM().double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": shard})
    for k, t in enumerate((13, 9, 17)):
        g = torch.Generator().manual_seed(k)
        ids, tg = torch.randint(0, 11, (2, t), generator=g), torch.randint(0, 11, (2, t), generator=g)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(5 + k)
        got = f(ids, tg)
        torch.manual_seed(5 + k)
        ref.seed = new_seed()                        # the seed the compiled graph draws first
        want = ref(ids, tg)
        got.backward()
        want.backward()
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item()), (t, got.item(), want.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-9, (t, name)
    rep = ac.report(f)
    assert any(r.rewrite == "adjoint" for r in rep.regions), str(rep)


def test_new_lengths_reuse_one_lowering_with_dropout(monkeypatch):
    """Dropout's seed is made by a capture pass, which the graph for every length did not run: each new length was
    lowered and compiled again. Now one lowering serves them, with autograd's gradients for the same masks."""
    from helpers import generic_regions

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DropoutStack()
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 5})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for T in (37, 23, 41):
            x, w = torch.randn(2, T, 8), torch.randn(2, T, 8)
            torch.manual_seed(123)
            seed = new_seed()
            with monkeypatch.context() as mp:
                mp.setattr(F, "dropout", _streams(seed))
                ref_out, ref_g = _step(model, model, x, w)
            out, g = _step(f, model, x, w)
            assert _rel(out, ref_out) <= 1e-5, T
            assert all(_rel(a, b) <= 1e-5 for a, b in zip(g, ref_g)), T
    assert not [str(m.message) for m in said if issubclass(m.category, ac.AdjointCompileWarning)]
    (region,) = generic_regions(f)
    assert region.lengths == {23, 41}, region.lengths


class DropBlocks(nn.Module):
    """A pre-norm residual stack with dropout in every block (``nn.Dropout``) and on the residual branch
    (``F.dropout``), as transformers and MLP stacks write it."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.2),
                                                  nn.Linear(2 * d, d)) for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = x + F.dropout(blk(x), 0.1, self.training)
        return x


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_dropout_in_a_residual_chain_gets_highway_bp_with_the_forwards_masks(monkeypatch, inner):
    """Highway-BP recomputes each block in the backward: a dropout there drew another mask, so the chain was
    refused ("layer 1 draws random numbers"). Its dropouts are now seeded as a sharded region's are; with k = the
    chain's length the gradients are autograd's for the same masks."""
    torch.manual_seed(0)
    model = DropBlocks().double()
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(123)
    seed = new_seed()
    with monkeypatch.context() as mp:
        mp.setattr(F, "dropout", _streams(seed))
        ref_out, ref_g = _step(model, model, x, w)
    f = torch.compile(model, backend="adjoint", options={"inner": inner, "mode": "highway", "iterations": 3})
    out, g = _step(f, model, x, w)
    assert [r.rewrite for r in ac.report(f).regions] == ["highway"], ac.report(f)
    assert _rel(out, ref_out) <= 1e-12
    for a, b in zip(g, ref_g):
        assert _rel(a, b) <= 1e-10
    model.eval()  # NB: no dropout in eval: the same as eager
    torch.testing.assert_close(f(x), model(x), rtol=1e-12, atol=1e-12)


class _TorchDropoutScan(nn.Module):
    """``torch.dropout(x, p, train)`` (whose flag is ``train``, with no default) on a scan's input."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return ac.ops.linear_scan(torch.sigmoid(self.a(x)), torch.dropout(self.b(x), 0.3, self.training))


class _TorchDropoutChain(nn.Module):
    def __init__(self, d: int = 6, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = x + torch.dropout(blk(x), 0.3, self.training)
        return x


@pytest.mark.parametrize("model, options", [(_TorchDropoutScan, {"shard_size": 4}),
                                            (_TorchDropoutChain, {"mode": "highway", "iterations": 3})])
def test_torch_dropout_in_eval_mode_draws_nothing(model, options):
    """The seeding read torch.dropout's ``train=False`` as F.dropout's default ``training=True``: in eval mode the
    rewritten model kept dropping (silently: the first-call check skips graphs with dropout). Eval mode is the
    identity, as eagerly, and the chain is still rewritten there."""
    torch.manual_seed(0)
    m = model().double().eval()
    x = torch.randn(2, 16, 6, dtype=torch.float64)
    f = torch.compile(m, backend="adjoint", options={"inner": "aot_eager", **options})
    torch.testing.assert_close(f(x), m(x), rtol=1e-12, atol=1e-12)
    assert [r.rewrite for r in ac.report(f).regions] == ["adjoint" if "shard_size" in options else "highway"], \
        ac.report(f)
