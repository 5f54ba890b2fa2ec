"""Sharded exact adjoint (runtime/sharded.py, passes/lower/sharded.py): gradients equal plain autograd."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import adjoint_compile as ac
import adjoint_compile.ops as ac_ops
from adjoint_compile.errors import AdjointVerifyReport, UnsupportedRegion
from adjoint_compile.passes import decide
from adjoint_compile.passes.lower import lowered_calls
from adjoint_compile.passes.lower.sharded import lower_recurrences, lower_region, outline
from adjoint_compile.analysis.fx import is_linear_scan
from adjoint_compile.analysis.grow import infer_seeds, region_around
from adjoint_compile.analysis.time_local import analyze
from adjoint_compile.options import Options
from adjoint_compile.regions import PROVENANCE, Recurrence
from adjoint_compile.runtime.sharded import ShardedRegion, default_shard_size, make_sharded, verify_region
from helpers import grab_graph

B, D, N = 2, 6, 3


def scan(a, b, h0=None, dim=1, reverse=False):
    return ac_ops.linear_scan(a, b, h0, dim=dim, reverse=reverse)


# ------------------------------------------------------------------------------------------------- models


class SSMLayer(nn.Module):
    """Selective-SSM-like block: pre-norm, Linear projections, softplus Δ, a = exp(Δ·A), state expansion N,
    readout sum over N, output projection (with a view that holds T), residual."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inp, self.dt, self.B, self.C, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, n), \
            nn.Linear(d, n), nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.randn(d, n) * 0.3)

    def forward(self, x, h0=None):
        u = self.inp(self.norm(x))
        dt = F.softplus(self.dt(u))
        a = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.A_log))
        b = (dt * u).unsqueeze(-1) * self.B(u).unsqueeze(2)
        h = scan(a, b, h0)
        y = (h * self.C(u).unsqueeze(2)).sum(-1)
        y = self.out(y).view(x.shape[0], x.shape[1], 2, -1).reshape(x.shape)
        return x + y


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SSMLayer(D, N) for _ in range(layers)])

    def forward(self, x, h0=None):
        for layer in self.layers:
            x = layer(x, h0)
        return x





def rel_err(a, b):
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


TOL = {torch.float32: 1e-5, torch.float64: 1e-11}


@functools.lru_cache(maxsize=None)
def stack_case(layers: int, T: int, dtype: torch.dtype, with_h0: bool):
    """(model, inputs, dynamo graph, its real inputs, outlined region, in dims, out dims)."""
    torch.manual_seed(0)
    m = Stack(layers).to(dtype)
    x = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
    h0 = torch.randn(B, D, N, dtype=dtype, requires_grad=True) if with_h0 else None
    args = (x, h0) if with_h0 else (x,)
    gm, ex = grab_graph(m, *args)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    nodes, bounds = region_around(gm, scans, info)
    assert len([n for n in nodes if is_linear_scan(n)]) == layers and bounds == []
    sub, ins, outs = outline(gm, nodes)
    return m, args, gm, ex, sub, [info.step_dim[a] for a in ins], [info.step_dim[o] for o in outs], ins


def node_values(gm, ex):
    """The value of every node of gm when run on ex, by node name."""
    vals = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            vals[n.name] = super().run_node(n)
            return vals[n.name]

    with torch.no_grad():
        Rec(gm).run(*ex)
    return vals


def region_inputs(case):
    """Fresh leaf copies of the region's inputs (parameters, x, h0, and step-free values such as -exp(A_log)),
    in its placeholder order."""
    m, args, gm, ex, sub, in_dims, out_dims, ins = case
    vals = node_values(gm, ex)
    return [vals[a.name].detach().clone().requires_grad_() for a in ins]


def grads(fn, inputs, seed=1):
    out = fn(*inputs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    gen = torch.Generator().manual_seed(seed)
    gos = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, inputs, gos)


# ----------------------------------------------------------------------------------------------- gradients


_F32, _F64 = torch.float32, torch.float64


@pytest.mark.parametrize("dtype,with_h0,shard", [
    (_F32, False, 1), (_F64, True, 1),  # every step its own shard (slow: keep two)
    (_F32, False, 7), (_F32, True, 7), (_F64, False, 7), (_F64, True, 7),  # 5 shards of 7 and one of 2
    (_F32, True, 37), (_F64, False, 37), (_F32, False, 50), (_F64, True, 50),  # one shard
])
def test_three_layer_stack_matches_autograd(dtype, with_h0, shard):
    case = stack_case(3, 37, dtype, with_h0)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    ref_out, ref_g = grads(sub, region_inputs(case))
    f = make_sharded(sub, in_dims, out_dims, shard)
    out, g = grads(f, region_inputs(case))
    assert len(g) == len(ref_g) > 30  # x, h0 and every parameter of 3 layers
    for a, b in zip(out, ref_out):
        assert rel_err(a, b) <= TOL[dtype]
    for a, b in zip(g, ref_g):
        assert rel_err(a, b) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,shard", [(1, 1), (1, 4), (2, 1), (9, 4), (16, None)])
def test_one_scan_with_readout_matches_autograd(dtype, T, shard):
    case = stack_case(1, T, dtype, True)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    ref_out, ref_g = grads(sub, region_inputs(case))
    out, g = grads(make_sharded(sub, in_dims, out_dims, shard), region_inputs(case))
    for a, b in zip(list(out) + list(g), list(ref_out) + list(ref_g)):
        assert rel_err(a, b) <= TOL[dtype]


def test_several_outputs_and_a_shorter_last_shard():
    def f(x, w):
        a = torch.sigmoid(F.linear(x, w)).unsqueeze(-1).expand(B, x.shape[1], D, N)
        h = scan(a, x.unsqueeze(-1).expand(B, x.shape[1], D, N).contiguous())
        y = h.sum(-1)
        return torch.tanh(y), y * 2, torch.cumsum(y, 1)

    torch.manual_seed(0)
    x, w = torch.randn(B, 11, D, dtype=torch.double), torch.randn(D, D, dtype=torch.double)
    gm, ex = grab_graph(f, x, w)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    nodes, bounds = region_around(gm, scans, info)
    assert [why for _, why in bounds] == ["cumsum along the step dim"]
    sub, ins, outs = outline(gm, nodes)
    assert len(outs) >= 2
    vals = node_values(gm, ex)
    mk = lambda: [vals[a.name].detach().clone().requires_grad_() for a in ins]  # noqa: E731
    ref_out, ref_g = grads(sub, mk())
    out, g = grads(make_sharded(sub, [info.step_dim[a] for a in ins], None, 4), mk())  # 4 + 4 + 3 steps
    for a, b in zip(list(out) + list(g), list(ref_out) + list(ref_g)):
        assert rel_err(a, b) <= 1e-12


# ---------------------------------------------------------------------------------------------- memory


class ShapeLog(TorchDispatchMode):
    """Records the shape of every tensor produced by an op."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _full_state(shapes, T):
    return [s for s in shapes if len(s) == 4 and s[1] == T and s[-1] == N]


def test_no_full_length_state_tensor_is_allocated():
    T = 37
    case = stack_case(3, T, torch.float32, True)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    f = make_sharded(sub, in_dims, out_dims, 7)
    inputs, inputs_ref = region_inputs(case), region_inputs(case)  # (they come from running the whole graph)
    f.prepare(inputs)  # shape checks run on fake tensors, outside the recording
    with ShapeLog() as rec:
        grads(f, inputs)
    assert rec.shapes and not _full_state(rec.shapes, T)
    assert any(len(s) == 4 and s[1] == 7 and s[-1] == N for s in rec.shapes)  # shard-length states do appear
    with ShapeLog() as ref:  # positive control: plain autograd materializes [B, T, D, N]
        grads(sub, inputs_ref)
    assert _full_state(ref.shapes, T)


def test_saved_tensors_are_inputs_and_boundary_states():
    T = 37
    case = stack_case(3, T, torch.float32, False)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    inputs = region_inputs(case)
    saved = []
    f = make_sharded(sub, in_dims, out_dims, 7)
    f.prepare(inputs)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        f(*inputs)
    n_inputs, boundaries = len(inputs), (len(range(0, T, 7)) - 1) * 3
    assert len(saved) == n_inputs + boundaries
    assert saved[n_inputs:] == [(B, D, N)] * boundaries


# --------------------------------------------------------------------------------------- graph lowering


@pytest.mark.parametrize("with_h0", [False, True])
def test_lower_region_in_the_dynamo_graph(with_h0):
    torch.manual_seed(0)
    m = Stack(2).double()
    x = torch.randn(B, 13, D, dtype=torch.double, requires_grad=True)
    args = (x, torch.randn(B, D, N, dtype=torch.double, requires_grad=True)) if with_h0 else (x,)
    gm, ex = grab_graph(m, *args)
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    nodes, _ = region_around(gm, scans, info)
    call = lower_region(gm, nodes, info, Options(shard_size=5, inner="eager"))  # compiled shards: tested below
    assert call is not None and call.op == "call_module"
    assert isinstance(gm.get_submodule(call.target), ShardedRegion)
    assert call.meta[PROVENANCE]["rewrite"] == "adjoint" and call.meta[PROVENANCE]["shard_size"] == 5
    assert not any(is_linear_scan(n) for n in gm.graph.nodes)
    gm.graph.lint()
    wrt = [t for t in ex if t.requires_grad]
    g = torch.randn(B, 13, D, dtype=torch.double)
    got = torch.autograd.grad(gm(*ex)[0], wrt, g)
    ref = torch.autograd.grad(m(*args), wrt, g)
    assert len(wrt) > 10
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= 1e-11


def test_lower_region_fails_soft_and_leaves_the_graph_alone():
    def f(x):
        a = torch.sigmoid(x)
        h = scan(a, x)
        r = scan(a, h, reverse=True)
        return torch.tanh(r)

    gm, ex = grab_graph(f, torch.randn(B, 9, D))
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    before = gm.code
    # a region with a mixing member (the reverse scan) is refused
    assert lower_region(gm, [n for n in gm.graph.nodes if n.op == "call_function"], info, {}) is None
    assert gm.code == before
    # a node that does not carry the step axis is refused too
    nodes, _ = region_around(gm, scans[:1], info)
    assert scans[0] in nodes and scans[1] not in nodes
    assert lower_region(gm, [], info, {}) is None and gm.code == before


def test_literal_length_off_the_step_position_is_caught():
    # T == D: the view's other 9 is a feature size; only the one at the step position may become the shard length
    def f(x):
        h = scan(torch.sigmoid(x), x)
        return h.view(B, 9, 3, 3).sum(-1)

    gm, ex = grab_graph(f, torch.randn(B, 9, 9, dtype=torch.double))
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    info = analyze(gm, infer_seeds(gm, scans))
    nodes, _ = region_around(gm, scans, info)
    sub, ins, outs = outline(gm, nodes)
    x = ex[0].detach().clone().requires_grad_()
    out = make_sharded(sub, [1], None, 4)(x)
    ref = sub(x)
    assert rel_err(out[0], ref[0]) <= 1e-12
    # a region that mixes steps cannot be sharded: a clear error
    with pytest.raises(UnsupportedRegion, match="mixes steps"):
        gm2, ex2 = grab_graph(lambda x: torch.cumsum(scan(torch.sigmoid(x), x), 1), torch.randn(B, 9, D))
        sub2, _, _ = outline(gm2, [n for n in gm2.graph.nodes if n.op == "call_function"])
        make_sharded(sub2, [1], None, 4)(ex2[0])


def test_lower_recurrences_marks_records():
    torch.manual_seed(0)
    m = Stack(2)
    gm, ex = grab_graph(m, torch.randn(B, 10, D))
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    recs = [Recurrence(kind="linear_recurrence", source="linear_scan", length=10, nodes=[s], outputs=[s])
            for s in scans]
    recs.append(Recurrence(kind="linear_recurrence", source="unrolled_loop", length=10))
    plans = decide.plan(recs, Options(shard_size=3))
    outcomes = lower_recurrences(gm, recs, Options(shard_size=3))
    decide.settle(recs, plans, outcomes)
    made = lowered_calls(outcomes)
    assert len(made) == 1
    assert [r.rewrite for r in recs] == ["adjoint", "adjoint", "none"]
    assert recs[0].group == recs[1].group == 0 and "shard_size=3" in recs[0].reason
    assert recs[2].reason


def test_dynamic_shapes_fail_soft_with_a_reason():
    gm, ex = grab_graph(Stack(1), torch.randn(B, 10, D), dynamic=True)
    before = gm.code
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    recs = [Recurrence(kind="linear_recurrence", source="linear_scan", length=None, nodes=[s], outputs=[s])
            for s in scans]
    outcomes = lower_recurrences(gm, recs, Options())
    decide.settle(recs, decide.plan(recs, Options()), outcomes)
    assert lowered_calls(outcomes) == []
    assert recs[0].rewrite == "none" and "dynamic" in recs[0].reason
    assert gm.code == before


# ------------------------------------------------------------------------------------------- options etc.


def test_bad_shard_size_is_rejected():
    case = stack_case(1, 9, torch.float64, True)
    with pytest.raises(ValueError, match="shard_size"):
        lower_region(case[2], [], None, {"shard_size": 0})
    with pytest.raises(ValueError, match="shard_size"):
        make_sharded(case[4], case[5], case[6], 0)
    with pytest.raises(ValueError, match="in_step_dims"):
        make_sharded(case[4], [None] * len(case[5]), case[6], 2)


def test_default_shard_size_is_ceil_sqrt():
    assert [default_shard_size(t) for t in (1, 2, 4, 5, 37, 100, 101)] == [1, 2, 2, 3, 7, 10, 11]
    with pytest.raises(ValueError, match="T="):
        default_shard_size(0)


def test_verify_region_reports_a_small_error():
    case = stack_case(1, 9, torch.float64, True)
    err = verify_region(case[4], case[5], case[6], 2, region_inputs(case))
    assert 0.0 <= err <= 1e-11
    f = make_sharded(case[4], case[5], case[6], 4, verify=True)
    with pytest.warns(AdjointVerifyReport, match=r"sharded region \(shard_size=4 of T=9\)"):
        f(*region_inputs(case))
    assert f.last_verify_error is not None and f.last_verify_error <= 1e-11
    fid = f.last_verify
    assert {k: fid[k] for k in ("max_rel_err", "shard_size", "steps", "window")} == {
        "max_rel_err": f.last_verify_error, "shard_size": 4, "steps": 9, "window": None}
    assert fid["grad_rel_err"] <= 1e-11 and abs(fid["grad_cosine"] - 1) <= 1e-11 and fid["output_max_rel_err"] <= 1e-11


def test_default_shard_size_balances_boundaries_and_shards_with_enough_work_per_shard():
    from adjoint_compile.runtime.sharded import MIN_SHARD_BYTES

    # memory (T/S)·c_b + S·c_a is least at S = √(T·c_b/c_a): T = 2^20, c_b = 4 c_a -> 2048 steps
    assert default_shard_size(2**20, 4 * 2**20, 2**20) == 2048
    # a small step: shards of at least MIN_SHARD_BYTES of activations, never more than T
    assert default_shard_size(10**6, 64, 1024) == MIN_SHARD_BYTES // 1024
    assert default_shard_size(100, 64, 1024) == 100
    assert default_shard_size(1, 10, 10) == 1
    # an unknown cost: ⌈√T⌉
    assert default_shard_size(4096, 1024, 0) == 64
    # nothing carried between shards (a loss run chunk by chunk): the least bytes per shard alone
    assert default_shard_size(10**6, 0, 1024) == MIN_SHARD_BYTES // 1024
    assert default_shard_size(10**6, 0, 1024, min_bytes=2**20) == 1024


def test_least_shard_bytes_grow_with_the_cpu_threads():
    """On a CPU a shard holds at least MIN_SHARD_BYTES per intra-op thread (the threads divide its work, not its
    fixed cost), up to SHARD_THREADS threads; a GPU's least bytes do not depend on them."""
    from adjoint_compile.runtime import shard_parts as sp
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    n = torch.get_num_threads()
    try:
        for threads, want in ((1, 1), (2, 2), (3, 3), (sp.SHARD_THREADS + 5, sp.SHARD_THREADS)):
            torch.set_num_threads(threads)
            assert sp.min_shard_bytes(cpu) == want * sp.MIN_SHARD_BYTES, threads
            assert sp.min_shard_bytes(gpu) == sp.MIN_SHARD_BYTES_GPU
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_shard_programs_compiled_by_the_inner_compiler_match_autograd(inner):
    """The compiled shard programs (forward, and recompute + VJP in backward) against plain autograd."""
    case = stack_case(2, 11, torch.float32, True)
    sub, in_dims, out_dims = case[4], case[5], case[6]
    ref_out, ref_g = grads(sub, region_inputs(case))
    f = ShardedRegion(sub, in_dims, out_dims, 4, inner=inner)  # shards of 4, 4 and 3 steps
    out, g = grads(f, region_inputs(case))
    assert f._plan.compiled, "the shard programs were not compiled"
    # with and without grad, both shard lengths, first shard (h0 input) and later ones
    assert {k[0] for k in f._plan.compiled} == {4, 3}
    for a, b in zip(out, ref_out):
        assert rel_err(a, b) <= 1e-5
    for a, b in zip(g, ref_g):
        assert rel_err(a, b) <= 1e-5


def test_a_loss_chunk_on_a_gpu_is_sized_by_its_own_bytes_in_whole_row_tiles():
    """A loss chunk on a GPU holds about MIN_CHUNK_BYTES_GPU of activations, cut to a multiple of CHUNK_ROWS_GPU
    steps (fewer steps than that: as they are); on a CPU, and for a recurrent shard anywhere, the shard bytes rule."""
    import types

    from adjoint_compile.runtime import shard_parts as sp

    def prog(chunks: bool, step_bytes: int, T: int = 10**6):
        return types.SimpleNamespace(loss_chunks=chunks, T=T, boundary_bytes=lambda: 0, step_bytes=lambda: step_bytes)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    per_step = 2 * 50257 * 4                                       # a chunk's logits and their gradient, V = 50257
    rows = -(-sp.MIN_CHUNK_BYTES_GPU // per_step)
    assert sp.least_shard_steps(prog(True, per_step), gpu) == rows - rows % sp.CHUNK_ROWS_GPU
    assert sp.least_shard_steps(prog(True, per_step), gpu) % sp.CHUNK_ROWS_GPU == 0
    assert sp.least_shard_steps(prog(True, sp.MIN_CHUNK_BYTES_GPU // 32), gpu) == 32   # under one tile: as is
    assert sp.least_shard_steps(prog(True, per_step), cpu) == -(-sp.min_shard_bytes(cpu) // per_step)
    assert sp.least_shard_steps(prog(False, per_step), gpu) == -(-sp.MIN_SHARD_BYTES_GPU // per_step)
    assert sp.min_chunk_bytes(gpu) == sp.MIN_CHUNK_BYTES_GPU and sp.min_chunk_bytes(cpu) == sp.min_shard_bytes(cpu)


class _LearnedH0(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)
        self.h0 = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.h0.expand(x.shape[0], -1)  # NB: a stride-0 view: the first shard's carry is not laid out as others'
        return self.o(scan(torch.sigmoid(self.a(x)), self.b(x), h0)).pow(2).sum()


def test_a_learned_h0_expanded_over_the_batch_with_inductor():
    """The first shard's h0 is a stride-0 view and the other shards' carries are contiguous states of the same shape:
    inductor's programs are specialized to strides, and the first shard ran the others' program (an assertion on
    the input's stride). Exact against eager, fp64, T = 13, shard 4."""
    torch.manual_seed(0)
    m = _LearnedH0().double()
    ref = copy.deepcopy(m)
    x = torch.randn(3, 13, 6, dtype=torch.float64)
    f = torch.compile(m, backend="adjoint", options={"shard_size": 4})
    f(x).backward()
    ref(x).backward()
    assert any(r.rewrite == "adjoint" for r in ac.report(f).regions)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_a_second_length_in_one_graph_says_so_and_stays_exact():
    """An encoder over T = 13 whose last state starts a decoder over T = 14: the regions of one graph share one
    length; the decoder's scan keeps autograd and its reason says why and what to do, the gradients stay exact."""
    torch.manual_seed(0)
    d = 4
    enc, dec = nn.Linear(d, 2 * d).double(), nn.Linear(d, 2 * d).double()

    def layer(lin, x, h0=None):
        a, b = lin(x).chunk(2, -1)
        return ac_ops.linear_scan(torch.sigmoid(a), b, h0)

    def f(x1, x2):
        h = layer(enc, x1)
        return layer(dec, x2, h[:, -1]).square().mean()

    x1, x2 = torch.randn(2, 13, d, dtype=torch.float64), torch.randn(2, 14, d, dtype=torch.float64)
    compiled = torch.compile(f, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager"})
    params = [*enc.parameters(), *dec.parameters()]
    got, want = torch.autograd.grad(compiled(x1, x2), params), torch.autograd.grad(f(x1, x2), params)
    for g, w in zip(got, want):
        assert (g - w).norm() <= 1e-10 * w.norm()
    rows = {r.length: r for r in ac.report(compiled).regions}
    assert rows[13].rewrite == "adjoint", rows[13].reason
    assert rows[14].rewrite == "none" and "has 14 steps where the graph's other scans have 13" in rows[14].reason, \
        rows[14].reason


class _StandardizedOverTime(nn.Module):
    """The scan's states standardized over time (``std`` reads them whole), then projected and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = ac_ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x))
        h = (h - h.mean(1, keepdim=True)) / (h.std(1, keepdim=True) + 1e-5)
        return x + self.o(h)


def test_an_output_computed_from_a_region_output_is_not_called_that_output():
    """The report said the states were kept whole as "an output of the model besides the loss": they are kept for
    the ``std`` over time that reads them; what the model returns is computed from them."""
    torch.manual_seed(0)
    m, x = _StandardizedOverTime().double(), torch.randn(3, 24, 4, dtype=torch.float64)
    rep = ac.explain(m, x, options={"shard_size": 4})
    (r,) = [r for r in rep.regions if r.rewrite == "adjoint"]
    assert "sum(s) over time" in r.reason and "an output of the model" not in r.reason, r.reason
    assert not r.details.get("returned_whole"), r.details
