"""Recognition passes on toy dynamo graphs: every positive case has a near-miss negative twin that must not match."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._higher_order_ops.associative_scan import associative_scan_op
from torch._higher_order_ops.scan import scan as torch_scan

import adjoint_compile.ops as ac_ops
from adjoint_compile.passes import recognize as recognize_mod
from adjoint_compile.analysis.affine import classify_update
from adjoint_compile.analysis.fx import reachable as forward_reach
from adjoint_compile.passes.match.find_recurrences import find_recurrences
from adjoint_compile.passes.match.find_residuals import find_residuals
from adjoint_compile.passes.recognize import recognize
from helpers import trace

B, T, D = 2, 5, 3


def lscan(a, b, h0=None, dim=1, reverse=False):
    return ac_ops.linear_scan(a, b, h0, dim=dim, reverse=reverse)





def x_(*shape):
    return torch.randn(*(shape or (B, T, D)))


# ------------------------------------------------------------------------------------------------------------
# the affine algebra, checked against real values (chain of trust: the expressions it reports are the values)


@pytest.mark.parametrize("name,fn,kind", [
    ("a*h+b", lambda h, a, b: a * h + b, "linear"),
    ("h*a-b", lambda h, a, b: h * a - b, "linear"),
    ("b+h*a reversed", lambda h, a, b: b + h * a, "linear"),
    ("addcmul", lambda h, a, b: torch.addcmul(b, a, h, value=0.5), "linear"),
    ("scalar a", lambda h, a, b: 0.9 * h + b, "linear"),
    ("broadcast a", lambda h, a, b: a[0] * h + b, "linear"),
    ("sub of sums", lambda h, a, b: (a * h + b) - (b * h) / 2, "linear"),
    ("b - a*h", lambda h, a, b: b - a * h, "linear"),
    ("gated", lambda h, a, b: torch.sigmoid(h + a) * h + b, "gated"),
    ("gated offset", lambda h, a, b: a * h + torch.tanh(h * b), "gated"),
    ("tanh rnn", lambda h, a, b: torch.tanh(a * h + b), "general"),
    ("h squared", lambda h, a, b: h * h + b, "general"),
    ("no carry", lambda h, a, b: a + b, "general"),
])
def test_classify_update_and_its_coefficients_evaluate_to_the_new_state(name, fn, kind):
    gm = fx.symbolic_trace(fn)
    h_, a_, b_ = torch.randn(4, 3), torch.rand(4, 3), torch.randn(4, 3)
    env = {}
    interp = fx.Interpreter(gm)
    orig = interp.run_node

    def run_node(n):
        env[n] = orig(n)
        return env[n]

    interp.run_node = run_node
    interp.run(h_, a_, b_)
    nodes = list(gm.graph.nodes)
    h, out = nodes[0], next(n for n in nodes if n.op == "output").args[0]
    form = classify_update(out, h, forward_reach(h).__contains__)
    assert form.kind == kind, (form.kind, form.reason)
    if kind != "general":
        coef = form.coef.evaluate(env.__getitem__)
        off = 0 if form.offset is None else form.offset.evaluate(env.__getitem__)
        torch.testing.assert_close(coef * h_ + off, env[out])
    else:
        assert form.reason


# ------------------------------------------------------------------------------------------------------------
# linear_scan


def test_linear_scan_node_is_a_linear_recurrence_with_its_arguments():
    def f(x, h0):
        a = torch.sigmoid(x)
        return lscan(a, x * 2, h0, dim=1)

    gm = trace(f, x_(B, 7, D), torch.zeros(B, D))
    regions, rejections = recognize(gm, None)
    assert not rejections
    (r,) = regions
    assert (r.kind, r.source, r.length, r.step_dim, r.reverse) == ("linear_recurrence", "linear_scan", 7, 1, False)
    assert r.a.target is torch.sigmoid and r.b.target is operator.mul and r.h0.op == "placeholder"
    assert r.rewrite == "none" and r.reason == "rewrite not implemented yet"
    assert r.outputs == [n for n in gm.graph.nodes if n.op == "call_function" and "linear_scan" in str(n.target)]


def test_cumsum_is_not_a_linear_scan_node():
    regions, _ = recognize(trace(lambda x: torch.cumsum(x, 1) * 2, x_()), None)
    assert regions == []


def test_stack_of_scans_joined_by_time_local_ops_is_one_group_bounded_by_a_time_mixing_op():
    W1, W2 = torch.randn(D, D), torch.randn(D, D)

    def f(x):
        y = x
        for w in (W1, W2):
            u = torch.nn.functional.linear(torch.nn.functional.layer_norm(y, (D,)), w)
            y = y + lscan(torch.sigmoid(u), u)
        return torch.cumsum(y, 1)

    def g(x):  # twin: the two scans are separated by a sum over time
        h = lscan(torch.sigmoid(x), x)
        s = h - h.mean(1, keepdim=True)
        return lscan(torch.sigmoid(s), s)

    regions, _ = recognize(trace(f, x_()), None)
    recs = [r for r in regions if r.kind == "linear_recurrence"]
    assert len(recs) == 2 and recs[0].group == recs[1].group == 0
    assert any("cumsum" in why for _, why in recs[0].bounds)
    assert set(recs[0].outputs) <= set(recs[0].neighbourhood)
    regions, _ = recognize(trace(g, x_()), None)
    recs = [r for r in regions if r.kind == "linear_recurrence"]
    assert len(recs) == 2 and recs[0].group is None and recs[1].group is None
    assert any("mean" in why for _, why in recs[0].bounds)


# ------------------------------------------------------------------------------------------------------------
# torch's scan higher-order op


def _scan_fn(update):
    def f(a, b, h0):
        def step(h, inp):
            hn = update(h, inp[0], inp[1])
            return hn, hn.clone()

        return torch_scan(step, h0, [a, b], dim=1)

    return f


@pytest.mark.parametrize("update,kind,why", [
    (lambda h, a, b: h * a - b, "linear_recurrence", None),
    (lambda h, a, b: torch.sigmoid(h + a) * h + b, "gated_recurrence", "a depends on the carry"),
    (lambda h, a, b: torch.tanh(h * a + b), None, "general nonlinear recurrence"),
    (lambda h, a, b: h * h + b, None, "h*h"),
])
def test_scan_step_subgraph_is_classified(update, kind, why):
    gm = trace(_scan_fn(update), torch.rand(B, T, D), x_(), torch.zeros(B, D))
    regions, rejections = recognize(gm, None)
    if kind is None:
        assert regions == [] and len(rejections) == 1 and why in rejections[0].reason
        return
    (r,) = regions
    assert (r.kind, r.source, r.length) == (kind, "scan", T)
    assert r.h0.op == "placeholder" and r.carry.op == "placeholder" and r.details["user_dim"] == 1
    if why:
        assert why in r.details["gated_because"]
    else:
        assert r.a is not None and r.details["b"].startswith("-")


def test_lstm_scan_cell_state_is_gated_and_hidden_state_is_rejected():
    W = nn.Linear(D, 4 * D)

    def f(x, h0, c0):
        def step(carry, xt):
            h, c = carry
            i, fg, g, o = (W(xt) + W(h)).chunk(4, -1)
            c2 = torch.sigmoid(fg) * c + torch.sigmoid(i) * torch.tanh(g)
            h2 = torch.sigmoid(o) * torch.tanh(c2)
            return (h2, c2), h2.clone()

        return torch_scan(step, (h0, c0), x, dim=1)

    regions, rejections = recognize(trace(f, x_(), torch.zeros(B, D), torch.ones(B, D)), None)
    assert [r.kind for r in regions] == ["gated_recurrence"] and regions[0].details["carry_index"] == 1
    assert len(rejections) == 1 and "carry 0" in rejections[0].node


def test_reverse_scan_is_recorded():
    gm = trace(lambda a, b, h0: torch_scan(lambda h, i: (i[0] * h + i[1], (i[0] * h + i[1]).clone()), h0, [a, b],
                                          dim=1, reverse=True), torch.rand(B, T, D), x_(), torch.zeros(B, D))
    (r,), _ = find_recurrences(gm)
    assert r.reverse is True and r.kind == "linear_recurrence"


# ------------------------------------------------------------------------------------------------------------
# associative_scan higher-order op (as dynamo records it: a graph node with a combine sub-graph)


def _combine_linear(xa, xb, ya, yb):
    return [xa * ya, ya * xb + yb]


def _combine_wrong(xa, xb, ya, yb):  # twin: a + instead of * for the decay: not associative as a recurrence
    return [xa + ya, ya * xb + yb]


def _combine_scaled(xa, xb, ya, yb):  # twin: 2*y_b is not associative either
    return [xa * ya, ya * xb + 2 * yb]


@pytest.mark.parametrize("combine,ok", [(_combine_linear, True), (_combine_wrong, False), (_combine_scaled, False)])
def test_associative_scan_with_the_linear_combine(combine, ok):
    gm = trace(lambda a, b: associative_scan_op(combine, [a, b], ()), torch.rand(T, B, D), x_(T, B, D))
    regions, rejections = recognize(gm, None)
    if ok:
        (r,) = regions
        assert (r.kind, r.source, r.length) == ("linear_recurrence", "associative_scan", T)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert (r.a, r.b) == (phs[0], phs[1])
    else:
        assert regions == [] and len(rejections) == 1 and "combine" in rejections[0].reason


# ------------------------------------------------------------------------------------------------------------
# residual chains


class _Res(nn.Module):
    def __init__(self, form, n=3, width=D):
        super().__init__()
        self.form = form
        self.fc = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.gate = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, y):
        for fc, gate in zip(self.fc, self.gate):
            if self.form == "add":
                x = x + torch.tanh(fc(x))
            elif self.form == "relu_add":
                x = torch.relu(x + fc(x))
            elif self.form == "scalar":
                x = self.alpha * x + fc(x)
            elif self.form == "gated":  # highway: t ⊙ h(x) + (1 - t) ⊙ x
                t = torch.sigmoid(gate(x))
                x = t * torch.tanh(fc(x)) + (1 - t) * x
            elif self.form == "unrelated":  # twin: the other operand does not depend on x
                x = x + fc(y)
            elif self.form == "skip_across":  # twin: each block also feeds the next layer (DenseNet-like)
                z = fc(x)
                x = x + z + y
                y = z
        return x


@pytest.mark.parametrize("form,K", [("add", "identity"), ("relu_add", "diagonal"), ("scalar", "scalar"),
                                    ("gated", "diagonal")])
def test_residual_chain_forms(form, K):
    gm = trace(_Res(form), x_(), x_())
    chains, _ = find_residuals(gm)
    (c,) = chains
    assert (c.kind, c.source, c.length) == ("residual_chain", "residual", 3)
    want = "add" if form == "scalar" else form
    assert [layer.form for layer in c.layers] == [want] * 3 and {layer.K for layer in c.layers} == {K}
    for prev, nxt in zip(c.layers, c.layers[1:]):
        assert prev.out is nxt.x
    # the block g holds the Linear; r does not
    assert all(any(n.target is torch._C._nn.linear for n in layer.block) for layer in c.layers)
    assert c.details["isomorphic_layers"] is True


def test_residual_add_with_unrelated_operands_is_no_chain():
    chains, rejections = find_residuals(trace(_Res("unrelated"), x_(), x_()))
    assert chains == [] and rejections == []


def test_block_used_across_layers_breaks_the_chain_with_a_reason():
    chains, rejections = find_residuals(trace(_Res("skip_across"), x_(), x_()))
    assert chains == []
    assert rejections and all("outside the layer" in j.reason for j in rejections)


def test_lstm_like_residual_layer():
    W = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(3))

    def f(c, o):
        for w in W:
            h = torch.sigmoid(o) * torch.tanh(c)
            i, fg, g = w(h).chunk(3, -1)
            c = torch.sigmoid(fg) * c + torch.sigmoid(i) * torch.tanh(g)
        return c

    (c,), _ = find_residuals(trace(f, x_(), x_()))
    assert [layer.form for layer in c.layers] == ["lstm"] * 3


# ------------------------------------------------------------------------------------------------------------
# the entry point: never raises, never mutates, region fields


def test_recognize_never_raises_and_turns_matcher_errors_into_rejections(monkeypatch):
    gm = trace(_Res("add"), x_(), x_())

    def boom(gm):
        raise RuntimeError("kaput")

    monkeypatch.setattr(recognize_mod, "find_residuals", boom)
    regions, rejections = recognize(gm, None)
    assert regions == [] and any("kaput" in j.reason for j in rejections)


def test_recognize_does_not_mutate_the_graph():
    gm = trace(_scan_fn(lambda h, a, b: a * h + b), torch.rand(B, T, D), x_(), torch.zeros(B, D))
    before = (gm.code, [(n.name, n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes])
    regions, _ = recognize(gm, None)
    assert regions
    assert before == (gm.code, [(n.name, n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes])
    d = regions[0].to_dict()
    assert {"kind", "source", "length", "rewrite", "reason", "group"} <= set(d)
