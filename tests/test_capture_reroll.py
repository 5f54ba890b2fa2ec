"""Re-rolling (passes/capture/reroll.py): unrolled loops, torch's scan and associative_scan become one linear_scan node whose
outputs and gradients equal plain eager autograd; gated / nonlinear twins stay untouched."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan_op
from torch._higher_order_ops.scan import scan as torch_scan

import adjoint_compile.ops  # noqa: F401 - registers linear_scan
import adjoint_compile as ac
from adjoint_compile.passes.capture import reroll as reroll_mod
from adjoint_compile.passes.match.find_recurrences import is_linear_scan
from adjoint_compile.passes.recognize import recognize
from adjoint_compile.passes.capture.reroll import needs_reroll, reroll
from adjoint_compile.regions import PROVENANCE
from helpers import trace

B, D = 2, 3


# ------------------------------------------------------------------------------------------------------ helpers


def call(gm, names, args):
    """Run ``gm`` with ``args`` given by the traced function's parameter names (dynamo orders placeholders by use)."""
    by = dict(zip(names, args))
    phs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return gm(*[by[p[2:-1]] for p in phs])


def rel_err(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-12)).item()


def check_against_eager(fn, gm, names, make):
    """Outputs and the gradients of every input of the rewritten graph equal eager autograd (rel err <= 1e-5)."""
    args = [x.requires_grad_() for x in make()]
    ref = fn(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    w = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(ref, args, w)
    out = call(gm, names, args)
    assert len(out) == len(ref)
    g = torch.autograd.grad(out, args, w)
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= 1e-5
    for gi, gr in zip(g, g_ref):
        assert rel_err(gi, gr) <= 1e-5


def scans(gm):
    return [n for n in gm.graph.nodes if is_linear_scan(n)]


def ops(gm, *names):
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", n.target) in names]


def reroll_one(gm, source):
    regions, _ = recognize(gm, None)
    (r,) = [r for r in regions if r.kind == "linear_recurrence"]
    assert r.source == source and needs_reroll(r)
    made = reroll(gm, regions)
    assert made == [n.name for n in scans(gm)] and len(made) == 1, (made, r.reason)
    (s,) = scans(gm)
    assert s.meta[PROVENANCE] == {"pass": "reroll", "source": source, "region": r.name}
    assert r.details["rerolled_into"] == s.name
    # recognition of the re-rolled graph reports the original capture form
    (again,) = recognize(gm, None)[0]
    assert (again.source, again.kind, again.length, again.rerolled_from) == \
        (source, "linear_recurrence", r.length, r.name)
    return r, s


# ------------------------------------------------------------------------------------------------- unrolled loops


def loop(a, b, h):
    outs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        outs.append(h)
    return torch.stack(outs, 1), h


def loop_reversed(a, b, h):
    outs = []
    for t in reversed(range(a.shape[1])):
        h = a[:, t] * h + b[:, t]
        outs.append(h)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("T", [2, 3, 7])
def test_unrolled_loop_becomes_one_scan_with_eager_gradients(T):
    make = lambda: (torch.rand(B, T, D), torch.randn(B, T, D), torch.randn(B, D))  # noqa: E731
    gm = trace(loop, *make())
    r, s = reroll_one(gm, "unrolled_loop")
    assert r.details["reroll"] == "batched"
    # no per-step state is left: the T products and sums are gone
    assert ops(gm, "mul", "add") == [] and len(list(gm.graph.nodes)) < 12
    check_against_eager(loop, gm, ["a", "b", "h"], make)


@pytest.mark.parametrize("T", [1, 2, 9])
def test_committed_states_read_the_scan_output_with_exact_example_values(T):
    """Re-rolling commits each used per-step state as ``H[k]``; those nodes' example values (made from one fake
    unbind of H, not T fake selects) are exactly H[k]'s: shape, strides and storage offset."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from adjoint_compile.passes.capture.batching import Emitter

    mode = FakeTensorMode()
    g = fx.Graph()
    H = g.placeholder("H")
    states = [g.placeholder(f"s{k}") for k in range(T)]
    g.output(tuple(g.call_function(torch.relu, (s,)) for s in states))
    with mode:
        H.meta["example_value"] = torch.empty(T, B, D)
        for s in states:
            s.meta["example_value"] = torch.empty(B, D)
    gm = fx.GraphModule(torch.nn.Module(), g)
    reroll_mod._commit_states(gm, Emitter(gm, {"pass": "test"}), H, states, None)
    picks = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] is H]
    assert [n.args[1] for n in picks] == list(range(T))
    for n in picks:
        got, want = n.meta["example_value"], H.meta["example_value"][n.args[1]]
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    assert not any(s.users for s in states)


def loop_shifted(a, b, h):
    outs = []
    for t in range(a.shape[1] - 2):
        h = a[:, t + 2] * h + b[:, t]  # a read two steps ahead: part of each sequence
        outs.append(h)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("fn,op", [(loop_reversed, "flip"), (loop_shifted, "narrow")])
def test_loops_over_part_of_a_sequence_or_backwards(fn, op):
    T = 5
    make = lambda: (torch.rand(B, T, D), torch.randn(B, T, D), torch.randn(B, D))  # noqa: E731
    gm = trace(fn, *make())
    r, _ = reroll_one(gm, "unrolled_loop")
    assert r.details["reroll"] == "batched" and ops(gm, op)
    check_against_eager(fn, gm, ["a", "b", "h"], make)


def gate_loop(x, W, h):
    outs = []
    for t in range(x.shape[1]):
        a_t = torch.sigmoid(x[:, t] @ W)
        h = a_t * h + (1 - a_t) * x[:, t]
        outs.append(h)
    return torch.stack(outs, 1), h


def gate_loop_unbind(x, W, h):
    outs = []
    for x_t in x.unbind(1):
        a_t = torch.sigmoid(F.linear(x_t, W))
        h = a_t * h + x_t
        outs.append(h.sum(-1))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("fn", [gate_loop, gate_loop_unbind])
@pytest.mark.parametrize("T", [2, 7])
def test_step_computation_is_batched_over_all_steps(fn, T):
    make = lambda: (torch.randn(B, T, D), torch.randn(D, D), torch.randn(B, D))  # noqa: E731
    gm = trace(fn, *make())
    r, s = reroll_one(gm, "unrolled_loop")
    # a_t = sigmoid(x_t W) is computed once for all steps (time-local ops the sharded lowering can include)
    assert r.details["reroll"] == "batched"
    assert len(ops(gm, "matmul", "linear")) == 1 and len(ops(gm, "sigmoid")) == 1
    check_against_eager(fn, gm, ["x", "W", "h"], make)


def normalize_loop(x, h):
    outs = []
    for t in range(x.shape[1]):
        h = F.normalize(x[:, t], dim=-1) * h + x[:, t]
        outs.append(h)
    return torch.stack(outs, 1)


def test_step_without_batching_rule_stacks_the_per_step_values():
    T = 5
    make = lambda: (torch.randn(B, T, D), torch.randn(B, D))  # noqa: E731
    gm = trace(normalize_loop, *make())
    r, _ = reroll_one(gm, "unrolled_loop")
    assert r.details["reroll"] == "stacked" and "normalize" in r.details["reroll_batched_failed"]
    assert len(ops(gm, "normalize")) == T
    check_against_eager(normalize_loop, gm, ["x", "h"], make)


# ----------------------------------------------------------------------------------------- scan higher-order op


def scan_fn(a, b, h, W):
    def step(h, xs):
        a_t, b_t = xs
        hn = a_t * h + b_t @ W
        return hn, (hn.clone(), torch.tanh(h) * b_t)

    hT, (ys, zs) = torch_scan(step, h, (a, b), dim=1)
    return ys, zs, hT


@pytest.mark.parametrize("T", [1, 2, 7])
def test_scan_op_becomes_one_linear_scan(T):
    make = lambda: (torch.rand(B, T, D), torch.randn(B, T, D), torch.randn(B, D), torch.randn(D, D))  # noqa: E731
    gm = trace(scan_fn, *make())
    reroll_one(gm, "scan")
    assert not [n for n in gm.graph.nodes if "scan" in str(n.target) and not is_linear_scan(n)]
    check_against_eager(scan_fn, gm, ["a", "b", "h", "W"], make)


def _combine(xa, xb, ya, yb):
    return [xa * ya, ya * xb + yb]


def assoc_fn(a, b):
    out = associative_scan_op(_combine, [a, b], ())
    return out[1], out[0]


def assoc_loop(a, b):
    """The same recurrence and running product as a plain loop: the reference for gradients.

    NB: eager autograd of associative_scan with several leaves gives wrong gradients in torch 2.13 (reported
    upstream in pytorch/pytorch#172568), so the op itself cannot be the reference for ∂a.
    """
    h, p, hs, ps = torch.zeros_like(b[0]), torch.ones_like(a[0]), [], []
    for t in range(a.shape[0]):
        h, p = a[t] * h + b[t], p * a[t]
        hs.append(h)
        ps.append(p)
    return torch.stack(hs), torch.stack(ps)


@pytest.mark.parametrize("T", [1, 6])
def test_associative_scan_and_its_running_product(T):
    make = lambda: (torch.rand(T, B, D), torch.randn(T, B, D))  # noqa: E731
    gm = trace(assoc_fn, *make())
    regions, _ = recognize(gm, None)
    made = reroll(gm, regions)
    assert len(made) == 2 and len(scans(gm)) == 2  # the recurrence and the running product of a
    assert all(s.meta[PROVENANCE]["source"] == "associative_scan" for s in scans(gm))
    assert not [n for n in gm.graph.nodes if "associative_scan" in str(n.target)]
    check_against_eager(assoc_loop, gm, ["a", "b"], make)


# ----------------------------------------------------------------------------------------------- negative twins


def gated_loop(x, W, h):
    outs = []
    for t in range(x.shape[1]):
        a_t = torch.sigmoid(h @ W + x[:, t])  # the gate reads the state: not a linear recurrence
        h = a_t * h + x[:, t]
        outs.append(h)
    return torch.stack(outs, 1)


def tanh_scan(a, b, h):
    def step(h, xs):
        hn = torch.tanh(xs[0] * h + xs[1])
        return hn, hn.clone()

    return torch_scan(step, h, (a, b), dim=1)[1]


def two_carry_scan(a, b, h):
    def step(carry, xs):
        h, g = carry
        hn = xs[0] * h + xs[1]
        gn = torch.sigmoid(g) * g + hn  # gated in its own carry: the op must stay
        return (hn, gn), hn.clone()

    return torch_scan(step, (h, h), (a, b), dim=1)[1]


@pytest.mark.parametrize("fn,names,make", [
    (gated_loop, ["x", "W", "h"], lambda: (torch.randn(B, 4, D), torch.randn(D, D), torch.randn(B, D))),
    (tanh_scan, ["a", "b", "h"], lambda: (torch.rand(B, 4, D), torch.randn(B, 4, D), torch.randn(B, D))),
    (two_carry_scan, ["a", "b", "h"], lambda: (torch.rand(B, 4, D), torch.randn(B, 4, D), torch.randn(B, D))),
])
def test_gated_and_nonlinear_recurrences_stay_untouched(fn, names, make):
    gm = trace(fn, *make())
    before = gm.code
    regions, _ = recognize(gm, None)
    assert reroll(gm, regions) == []
    assert gm.code == before and not scans(gm)
    for r in regions:
        if r.kind == "linear_recurrence":  # the linear carry of two_carry_scan: refused with the reason
            assert "carry 1" in r.not_rerolled and "not re-rolled" in r.not_rerolled
    check_against_eager(fn, gm, names, make)


def test_without_the_linear_scan_op_nothing_changes(monkeypatch):
    gm = trace(loop, torch.rand(B, 3, D), torch.randn(B, 3, D), torch.randn(B, D))
    before = gm.code
    regions, _ = recognize(gm, None)
    monkeypatch.setattr(reroll_mod, "_scan_op", lambda: None)
    assert reroll(gm, regions) == [] and gm.code == before
    assert "not registered" in regions[0].not_rerolled


# ------------------------------------------------------------------------------------ through the adjoint backend


def readout_loop(x, W, h):
    outs = []
    for t in range(x.shape[1]):
        a_t = torch.sigmoid(x[:, t] @ W)
        h = a_t * h + x[:, t]
        outs.append(h)
    return torch.stack(outs, 1).square().sum(-1)


def scan_model(a, b, h, W):
    ys, zs, hT = scan_fn(a, b, h, W)
    return ys * 2, zs, hT


@pytest.mark.parametrize("fn,names,source,make", [
    (readout_loop, ["x", "W", "h"], "unrolled_loop",
     lambda: (torch.randn(B, 7, D), torch.randn(D, D), torch.randn(B, D))),
    (scan_model, ["a", "b", "h", "W"], "scan",
     lambda: (torch.rand(B, 7, D), torch.randn(B, 7, D), torch.randn(B, D), torch.randn(D, D))),
])
def test_backend_lowers_the_rerolled_recurrence_with_eager_gradients(fn, names, source, make):
    args = [x.requires_grad_() for x in make()]
    ref = fn(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    w = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(ref, args, w)
    # NB: the loop as dynamo unrolls it (the roller would trace it as a scan before dynamo)
    f = torch.compile(fn, backend="adjoint", options={"inner": "eager", "shard_size": 3, "roll_loops": False})
    out = f(*args)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.autograd.grad(out, args, w)
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= 1e-5
    for gi, gr in zip(g, g_ref):
        assert rel_err(gi, gr) <= 1e-5
    result = ac.report(f).compiled[-1]
    (r,) = [r for r in result.regions if r.kind == "linear_recurrence"]
    assert (r.source, r.rewrite) == (source, "adjoint"), r.reason
    assert "re-rolled into" in r.reason and result.lowered
    assert not scans(result.captured.gm)  # the scan went into the sharded region
