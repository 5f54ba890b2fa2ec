"""Readouts of the previous state h_{t-1} (``cat([first, h[:, :-1]], 1)``) inside a sharded region."""
import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.analysis.fx import is_linear_scan
from adjoint_compile.analysis.grow import infer_seeds
from adjoint_compile.analysis.time_local import analyze
from helpers import trace

B, D = 2, 5


class PrevReadout(nn.Module):
    """y_t = W h_{t-1} + x_t with h_{-1} = ``first`` (h0, zeros, a learned vector, or a fill made from h's shape)."""

    def __init__(self, first: str):
        super().__init__()
        self.first = first
        self.lin = nn.Linear(D, 2 * D)
        self.out = nn.Linear(D, D)
        self.h_init = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x, h0=None):
        a, b = self.lin(x).chunk(2, -1)
        h = ac.ops.linear_scan(torch.sigmoid(a), b, h0)
        if self.first == "h0":
            first = h0.unsqueeze(1)
        elif self.first == "zeros":
            first = torch.zeros(x.shape[0], 1, D)
        elif self.first == "zeros_like_slice":  # NB: fills made from h's shape: they read h
            first = torch.zeros_like(h[:, :1])
        elif self.first == "ones_like_step":
            first = torch.ones_like(h[:, 0])[:, None]
        else:
            first = self.h_init.expand(x.shape[0], 1, D)
        h_prev = torch.cat([first, h[:, :-1]], dim=1)
        return self.out(h_prev) * torch.tanh(h) + x


def _grads(f, model, x, h0):
    for p in model.parameters():
        p.grad = None
    leaves = [x] + ([h0] if h0 is not None else [])
    for t in leaves:
        t.grad = None
    out = f(x, h0) if h0 is not None else f(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in [*model.parameters(), *leaves]]


@pytest.mark.parametrize("first", ["h0", "zeros", "learned", "zeros_like_slice", "ones_like_step"])
@pytest.mark.parametrize("T,shard", [(1, 3), (7, 3), (10, 1), (10, 4)])
def test_previous_state_readout_is_sharded_with_exact_gradients(first, T, shard):
    torch.manual_seed(0)
    model = PrevReadout(first)
    x = torch.randn(B, T, D, requires_grad=True)
    h0 = torch.randn(B, D, requires_grad=True) if first == "h0" else None
    ref_out, ref_g = _grads(model, model, x, h0)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": shard})
    out, g = _grads(f, model, x, h0)
    res = ac.report(f).compiled[-1]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    if T <= shard:  # one shard saves nothing: declined (the gradients below are then ordinary autograd's)
        assert not res.lowered and any(r.reason.startswith("one shard: T=1") for r in res.regions)
    else:
        assert res.lowered, [r.reason for r in res.regions]
        region = res.captured.gm.get_submodule(res.lowered[0]) if "." not in res.lowered[0] else None
        # the whole readout is inside the region: its only output is the layer's output
        assert region is not None and len(region._plan.info.shifts) == 1
    assert len(g) == len(ref_g)
    for a, b in zip(g, ref_g):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _info(fn, *args):
    gm = trace(fn, *args)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    return gm, analyze(gm, infer_seeds(gm, scans))


def test_shift_is_recognized_and_its_near_misses_are_not():
    x = torch.randn(B, 6, D)

    def prev(x):
        h = ac.ops.linear_scan(torch.sigmoid(x), x)
        return torch.cat([torch.zeros(B, 1, D), h[:, :-1]], 1) * 2

    def ahead(x):  # h_{t+1}: looks into the future, not a readout of the carried state
        h = ac.ops.linear_scan(torch.sigmoid(x), x)
        return torch.cat([h[:, 1:], torch.zeros(B, 1, D)], 1) * 2

    def two_back(x):  # h_{t-2}: needs two steps from the left neighbour
        h = ac.ops.linear_scan(torch.sigmoid(x), x)
        return torch.cat([torch.zeros(B, 2, D), h[:, :-2]], 1) * 2

    def first_from_data(x):  # the fill comes from the sequence itself
        h = ac.ops.linear_scan(torch.sigmoid(x), x)
        return torch.cat([x[:, :1], h[:, :-1]], 1) * 2

    gm, info = _info(prev, x)
    (cat,) = [n for n in gm.graph.nodes if "cat" in n.name]
    assert cat in info.shifts and info.is_time_local(cat)
    for fn in (ahead, two_back, first_from_data):
        gm, info = _info(fn, x)
        (cat,) = [n for n in gm.graph.nodes if "cat" in n.name]
        assert cat not in info.shifts and not info.is_time_local(cat), fn.__name__


def test_previous_state_readout_with_compiled_shard_programs():
    torch.manual_seed(0)
    model = PrevReadout("learned")
    x = torch.randn(B, 7, D, requires_grad=True)
    ref_out, ref_g = _grads(model, model, x, None)
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager", "shard_size": 3})
    out, g = _grads(f, model, x, None)
    assert ac.report(f).compiled[-1].lowered
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_PADS = (torch.nn.functional.pad, torch._C._nn.pad)


class PadReadout(nn.Module):
    """y_t = W h_{t-1} + x_t with h_{-1} = ``value``, the shift written with F.pad (two forms)."""

    def __init__(self, form: str, value: float = 0.0):
        super().__init__()
        self.form, self.value = form, value
        self.lin = nn.Linear(D, 2 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, -1)
        h = ac.ops.linear_scan(torch.sigmoid(a), b)
        if self.form == "pad_then_slice":
            h_prev = torch.nn.functional.pad(h, (0, 0, 1, 0), value=self.value)[:, :-1]
        else:  # "crop": negative padding drops the last step in the same call
            h_prev = torch.nn.functional.pad(h, (0, 0, 1, -1), value=self.value)
        return self.out(h_prev) * torch.tanh(h) + x


@pytest.mark.parametrize("form", ["pad_then_slice", "crop"])
@pytest.mark.parametrize("value", [0.0, 0.5])
@pytest.mark.parametrize("T,shard", [(1, 3), (7, 3), (10, 4)])
def test_pad_style_previous_state_readout_is_sharded_with_exact_gradients(form, value, T, shard):
    torch.manual_seed(0)
    model = PadReadout(form, value)
    x = torch.randn(B, T, D, requires_grad=True)
    ref_out, ref_g = _grads(model, model, x, None)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": shard})
    out, g = _grads(f, model, x, None)
    res = ac.report(f).compiled[-1]
    if T <= shard:  # one shard saves nothing: declined
        assert not res.lowered and any(r.reason.startswith("one shard: T=1") for r in res.regions)
    else:
        assert res.lowered, [r.reason for r in res.regions]
        nodes = [n for m in res.captured.gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
        assert not any(n.target in _PADS for n in nodes)
        assert any(n.meta.get("adjoint_compile", {}).get("pass") == "canonical_shifts" for n in nodes)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_pad_that_is_not_a_one_step_shift_is_left_alone():
    from adjoint_compile.passes.capture.canonical_shifts import canonicalize_shifts

    def fn(a, b):
        h = ac.ops.linear_scan(a, b)
        two = torch.nn.functional.pad(h, (0, 0, 2, 0))[:, :-2]       # two steps back
        feat = torch.nn.functional.pad(h, (1, 0))                     # pads channels, not steps
        refl = torch.nn.functional.pad(h, (0, 0, 1, 0), mode="replicate")[:, :-1]
        return two.sum() + feat.sum() + refl.sum()

    gm = trace(fn, torch.rand(B, 6, D), torch.randn(B, 6, D))
    assert canonicalize_shifts(gm) == 0
    assert sum(n.target in _PADS for n in gm.graph.nodes) == 3


class NarrowFirst(nn.Module):
    """The fill made in the default dtype (float32) while the model runs in float64, as after ``model.double()``:
    eager's cat promotes, so h_{t-1} keeps float64 at every step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2 * D).double()

    def forward(self, x):
        a, b = self.lin(x).chunk(2, -1)
        h = ac.ops.linear_scan(torch.sigmoid(a), b)
        h_prev = torch.cat([torch.zeros(x.shape[0], 1, D, dtype=torch.float32), h[:, :-1]], dim=1)
        return h_prev * torch.tanh(h) + x


@pytest.mark.parametrize("T,shard", [(7, 3), (10, 4)])
def test_previous_state_carried_in_its_own_dtype_across_shards(T, shard):
    torch.manual_seed(0)
    model = NarrowFirst()
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    ref_out, ref_g = _grads(model, model, x, None)
    f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": shard})
    out, g = _grads(f, model, x, None)
    assert ac.report(f).compiled[-1].lowered
    assert out.dtype == ref_out.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


V = 11


class ShiftedIds(nn.Module):
    """Token ids shifted right inside the region: decoder inputs (``pad``/``cat`` of a start id) and the loss's labels
    (padded on the left with the ignore index). The carried previous id is an integer: it has no gradient."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.emb, self.dec, self.inp, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        if self.form == "pad":
            shifted = torch.nn.functional.pad(ids, (1, 0), value=0)[:, :-1]
        else:
            shifted = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], 1)
        h = self.emb(shifted)
        y = self.head(h + ac.ops.linear_scan(torch.sigmoid(self.dec(h)), self.inp(h)))
        labels = torch.nn.functional.pad(ids, (1, 0), value=-100)[:, :-1]
        return torch.nn.functional.cross_entropy(y.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("form", ["pad", "cat"])
@pytest.mark.parametrize("options", [{"shard_size": 1}, {"shard_size": 4}, {"shard_size": 5},
                                     {"shard_size": 4, "mode": "truncated", "window": 13}])
def test_integer_ids_shifted_right_inside_the_region_exact(form, options):
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = ShiftedIds(form)
        ids = torch.randint(0, V, (2, 13))
        want = model(ids)
        ref = torch.autograd.grad(want, list(model.parameters()))
        f = torch.compile(model, backend="adjoint", options={"inner": "eager", **options})
        got = f(ids)
        got.backward()
        assert ac.report(f).compiled[-1].lowered
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for (name, p), r in zip(model.named_parameters(), ref):
            torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")
    finally:
        torch.set_default_dtype(prev)
