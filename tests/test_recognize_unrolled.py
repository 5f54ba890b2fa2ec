"""Python loops that dynamo unrolled: carry chain, same-computation proof, re-roll recipe, and negative twins."""
from __future__ import annotations

import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from adjoint_compile.passes.recognize import recognize
from adjoint_compile.passes.match.unrolled import find_unrolled
from helpers import trace

B, D = 2, 3





def linear_loop(a, b, h):
    outs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        outs.append(h)
    return torch.stack(outs, 1)


def _inputs(T):
    return torch.rand(B, T, D), torch.randn(B, T, D), torch.randn(B, D)


def _placeholder(gm, name):
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == f"L_{name}_")


@pytest.mark.parametrize("T", [2, 3, 5, 8])
def test_linear_loop_is_recognized_and_its_reroll_recipe_reproduces_it(T):
    a, b, h0 = _inputs(T)
    gm = trace(linear_loop, a, b, h0)
    regions, rejections = recognize(gm, None)
    assert rejections == []
    (r,) = regions
    assert (r.kind, r.source, r.length) == ("linear_recurrence", "unrolled_loop", T)
    assert r.h0 is _placeholder(gm, "h") and r.reroll.to_dict()["first_step_matched"]
    assert r.reroll.to_dict()["stacked_by"]["dim"] == 1 and len(r.outputs) == T
    # re-roll: a scan over the recorded slices reproduces the loop
    by_src = {x["source"]: x for x in r.reroll.to_dict()["xs"]}
    assert set(by_src) == {"l_a_", "l_b_"}
    assert all((x["stride"], x["start"], x["dim"]) == (1, 0, 1) for x in by_src.values())
    assert r.a.args[0] is _placeholder(gm, "a") and r.b.args[0] is _placeholder(gm, "b")
    # the recipe's slices, scanned with h0 from the identified a and b, give back the loop's states
    env = {"l_a_": a, "l_b_": b}

    def seq(node):
        x = next(x for x in r.reroll.to_dict()["xs"] if x["node"] == node.name)
        idx = torch.arange(x["start"], x["start"] + T * x["stride"], x["stride"])
        return env[x["source"]].index_select(x["dim"], idx)

    a_seq, b_seq = seq(r.a), seq(r.b)
    h, outs = h0, []
    for t in range(T):
        h = a_seq[:, t] * h + b_seq[:, t]
        outs.append(h)
    torch.testing.assert_close(torch.stack(outs, 1), linear_loop(a, b, h0))


def test_reverse_loop_has_a_negative_stride():
    def f(a, b, h):
        for t in reversed(range(a.shape[1])):
            h = h * a[:, t] + b[:, t]
        return h

    (r,), _ = find_unrolled(trace(f, *_inputs(4)))
    assert r.length == 4 and {(x["start"], x["stride"]) for x in r.reroll.to_dict()["xs"]} == {(3, -1)}


def test_loop_of_one_step_is_no_recurrence():
    regions, rejections = recognize(trace(linear_loop, *_inputs(1)), None)
    assert regions == [] and rejections == []


def test_a_depending_on_h_is_gated_not_linear():
    def f(a, b, h):
        for t in range(a.shape[1]):
            h = torch.sigmoid(h + a[:, t]) * h + b[:, t]
        return h

    (r,), _ = find_unrolled(trace(f, *_inputs(4)))
    assert r.kind == "gated_recurrence" and "a depends on the carry" in r.details["gated_because"]


def test_h_squared_is_rejected():
    def f(a, b, h):
        for t in range(a.shape[1]):
            h = h * h + b[:, t]
        return h

    regions, rejections = find_unrolled(trace(f, *_inputs(4)))
    assert regions == [] and len(rejections) == 1 and "multiplies itself" in rejections[0].reason


def test_steps_that_differ_are_rejected_naming_the_node():
    def f(a, b, h):
        for t in range(a.shape[1]):
            at = torch.exp(-a[:, t]) if t == 2 else torch.sigmoid(a[:, t])
            h = at * h + b[:, t]
        return h

    regions, rejections = find_unrolled(trace(f, *_inputs(5)))
    assert regions == [] and len(rejections) == 1
    assert "steps differ at node" in rejections[0].reason and "step 3" in rejections[0].reason


def test_tanh_rnn_is_neither_linear_nor_gated():
    U = nn.Linear(D, D)

    def f(x, h):
        for t in range(x.shape[1]):
            h = torch.tanh(U(h) + x[:, t])
        return h

    regions, rejections = find_unrolled(trace(f, torch.randn(B, 4, D), torch.zeros(B, D)))
    assert regions == [] and "general nonlinear recurrence" in rejections[0].reason


def test_gru_over_unbind_is_gated_with_the_unbind_items_as_xs():
    W, U = nn.Linear(D, D), nn.Linear(D, D)

    def f(x, h):
        outs = []
        for xt in x.unbind(1):
            z = torch.sigmoid(W(xt) + U(h))
            h = (1 - z) * h + z * torch.tanh(xt)
            outs.append(h)
        return torch.stack(outs, 1)

    gm = trace(f, torch.randn(B, 5, D), torch.zeros(B, D))
    regions, _ = recognize(gm, None)
    assert [(r.kind, r.source, r.length) for r in regions] == [("gated_recurrence", "unrolled_loop", 5)]
    (x,) = regions[0].reroll.to_dict()["xs"]
    assert x["source"] == "unbind" and x["stride"] == 1
    assert "l_w_parameters_weight_" in " ".join(regions[0].reroll.to_dict()["shared"]) or regions[0].reroll.to_dict()["shared"]


def test_special_first_step_starts_the_chain_at_its_result():
    def f(a, b):
        h = b[:, 0]
        for t in range(1, a.shape[1]):
            h = a[:, t] * h + b[:, t]
        return h

    gm = trace(f, *_inputs(5)[:2])
    (r,), _ = find_unrolled(gm)
    assert r.kind == "linear_recurrence" and r.length == 4
    assert r.h0.op == "call_function" and r.h0.args[0] is _placeholder(gm, "b")


def test_weight_tied_loop_without_per_step_input_is_not_a_time_loop():
    W = nn.Linear(D, D)

    def f(h, c):
        for _ in range(4):
            h = 0.5 * h + torch.tanh(W(c))  # no slice of a sequence: nothing to re-roll along time
        return h

    regions, rejections = find_unrolled(trace(f, torch.zeros(B, D), torch.randn(B, D)))
    assert regions == [] and rejections == []


def _big_graph(steps: int, layers: int) -> fx.GraphModule:
    """~4 nodes per loop step + ~4 per residual layer, with example values on every node (as dynamo gives)."""
    g = fx.Graph()
    a, b, h, x, w = (g.placeholder(n) for n in ("a", "b", "h", "x", "w"))
    import operator

    for t in range(steps):
        at = g.call_function(operator.getitem, (a, (slice(None), t)))
        bt = g.call_function(operator.getitem, (b, (slice(None), t)))
        h = g.call_function(operator.add, (g.call_function(operator.mul, (at, h)), bt))
    for _ in range(layers):
        z = g.call_function(torch.tanh, (g.call_function(torch.nn.functional.linear, (x, w)),))
        x = g.call_function(torch.relu, (g.call_function(operator.add, (x, z)),))
    g.output((h, x))
    gm = fx.GraphModule(nn.Module(), g)
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        shape = (B, steps, D) if n.name in ("a", "b") else ((D, D) if n.name == "w" else (B, D))
        n.meta["example_value"] = torch.empty(shape, device="meta")
    return gm


def test_recognition_is_near_linear_on_a_20000_node_graph():
    import gc

    gm = _big_graph(2500, 2500)
    small = _big_graph(250, 250)
    assert len(gm.graph.nodes) >= 20000
    # NB: the cyclic collector's pauses over the big graph's objects are not recognition's time (one run of the
    # suite measured 37x for 10x the nodes with them)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        regions, _ = recognize(gm, None)
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        recognize(small, None)
        small_elapsed = time.perf_counter() - t1
    finally:
        gc.enable()
    kinds = sorted((r.kind, r.length) for r in regions)
    assert kinds == [("linear_recurrence", 2500), ("residual_chain", 2500)]
    # a few seconds, and no worse than ~linear (x10 nodes -> well under x100 time)
    assert elapsed < 15, elapsed
    assert elapsed < 30 * max(small_elapsed, 0.01), (elapsed, small_elapsed)


@pytest.mark.parametrize("step", ["h @ A", "mm", "linear"])
def test_dense_linear_loop_is_a_near_miss_with_the_reason(step):
    """h = h @ A + b_t is linear but its coefficient is a matrix: reported as a rejected candidate, with why."""
    A = torch.randn(D, D) * 0.1
    W = nn.Linear(D, D, bias=False)

    def f(b, h):
        for t in range(b.shape[1]):
            hA = {"h @ A": lambda: h @ A, "mm": lambda: torch.mm(h, A), "linear": lambda: W(h)}[step]()
            h = hA + b[:, t]
        return h

    gm = trace(f, torch.randn(B, 6, D), torch.zeros(B, D))
    regions, rejections = recognize(gm, None)
    assert regions == [] and len(rejections) == 1, rejections
    (j,) = rejections
    assert j.reason.startswith("unrolled loop of 6 steps: the carry is multiplied by a matrix")
    assert "not an elementwise one" in j.reason


def test_a_matmul_on_the_input_only_is_still_a_linear_loop_with_no_rejection():
    """The negative twin: x_t @ W feeds b, not h; the loop is an ordinary elementwise recurrence."""
    W = torch.randn(D, D)

    def f(a, x, h):
        for t in range(a.shape[1]):
            h = a[:, t] * h + x[:, t] @ W
        return h

    regions, rejections = recognize(trace(f, *_inputs(6)), None)
    assert [(r.kind, r.length) for r in regions] == [("linear_recurrence", 6)] and rejections == []


def test_a_stack_of_dense_layers_is_no_near_miss():
    """Different weights per step and no per-step slice: a depth chain, not a loop over time; nothing reported."""
    Ws = [torch.randn(D, D) for _ in range(4)]

    def f(x, c):
        for W in Ws:
            x = x @ W + c
        return x

    regions, rejections = find_unrolled(trace(f, torch.randn(B, D), torch.randn(B, D)))
    assert regions == [] and rejections == []


def d_skip_loop(a, b, c, x, h):
    outs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        outs.append(c[:, t] * h + 0.5 * x[:, t])
    return torch.stack(outs, 1)


@pytest.mark.parametrize("T", [4, 7])
def test_a_readout_affine_in_the_state_is_not_taken_for_one_more_step(T):
    """``y_t = c_t * h_t + D * x_t`` is affine in h_t, as the next state is: the final readout, which no next state
    follows, was linked as one more step, and the loop was rejected ("steps differ in size")."""
    a, b, h0 = _inputs(T)
    c, x = torch.randn(B, T, D), torch.randn(B, T, D)
    gm = trace(d_skip_loop, a, b, c, x, h0)
    found, rejected = find_unrolled(gm)
    assert [(r.kind, r.length) for r in found] == [("linear_recurrence", T)], (found, rejected)
    assert not rejected, rejected
    recipe = found[0].reroll
    assert recipe.steps == T and len(recipe.states) == T
