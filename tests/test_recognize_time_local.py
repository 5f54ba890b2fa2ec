"""Step-dim propagation (analysis/time_local.py) on toy dynamo graphs: every positive case has a negative twin."""
from __future__ import annotations

import time

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import adjoint_compile.ops as ac_ops
from adjoint_compile.analysis.fx import is_linear_scan, scan_args
from adjoint_compile.analysis.grow import region_around
from adjoint_compile.analysis.time_local import analyze
from helpers import trace

B, T, D = 2, 5, 6


def scan(a, b, h0=None, dim=1, reverse=False):
    return ac_ops.linear_scan(a, b, h0, dim=dim, reverse=reverse)





def node(gm, pred):
    hits = [n for n in gm.graph.nodes if pred(n)]
    assert len(hits) == 1, [n.format_node() for n in hits]
    return hits[0]


def by_method(name):
    return lambda n: n.op == "call_method" and n.target == name


def by_fn(*fns):
    return lambda n: n.op == "call_function" and n.target in fns


def placeholder(gm, name):
    """The placeholder dynamo made for the argument called ``name``."""
    return node(gm, lambda n: n.op == "placeholder" and n.target == f"L_{name}_")


def run(fn, *args, seeds=None):
    gm = trace(fn, *args)
    info = analyze(gm, {placeholder(gm, k): d for k, d in (seeds or {"x": 1}).items()})
    return gm, info


def x_():
    return torch.randn(B, T, D)


# ---------------------------------------------------------------------------------------------------- reductions


def test_sum_over_features_is_local_sum_over_time_mixes():
    gm, info = run(lambda x: x.sum(-1) * 2, x_())
    s = node(gm, by_method("sum"))
    assert info.is_time_local(s) and info.step_dim[s] == 1
    gm, info = run(lambda x: x.sum(1) * 2, x_())
    s = node(gm, by_method("sum"))
    assert not info.is_time_local(s) and "step dim" in info.mixing[s] and info.step_dim[s] is None
    gm, info = run(lambda x: x.mean() * 2, x_())
    assert "all dims" in info.mixing[node(gm, by_method("mean"))]


def test_keepdim_and_multi_dim_reductions_track_the_step():
    gm, info = run(lambda x: x.view(B, T, 2, 3).sum((0, 3), keepdim=False), x_())
    assert info.step_dim[node(gm, by_method("sum"))] == 0
    gm, info = run(lambda x: x.view(B, T, 2, 3).amax((0, 1)), x_())
    assert "step dim" in info.mixing[node(gm, by_method("amax"))]


def test_softmax_over_features_local_over_time_mixes():
    gm, info = run(lambda x: F.softmax(x, -1), x_())
    assert info.is_time_local(node(gm, by_fn(F.softmax)))
    gm, info = run(lambda x: torch.cumsum(x, 1) + 1, x_())
    c = node(gm, by_fn(torch.cumsum))
    assert "step dim" in info.mixing[c]
    # a cumsum over time keeps a full-length step axis: the op after it is local again
    add = node(gm, lambda n: n.target is torch.add or getattr(n.target, "__name__", "") == "add")
    assert info.is_time_local(add) and info.step_dim[add] == 1


def test_layer_norm_over_features_local_over_time_mixes():
    w = torch.randn(D)
    gm, info = run(lambda x, w: F.layer_norm(x, (D,), w), x_(), w)
    assert info.is_time_local(node(gm, by_fn(F.layer_norm)))
    gm, info = run(lambda x, w: F.layer_norm(x, (T, D), w.expand(T, D)), x_(), w)
    assert "normalizes over the step" in info.mixing[node(gm, by_fn(F.layer_norm))]


# ------------------------------------------------------------------------------------------------------ views


def test_view_keeping_step_is_local_merging_mixes():
    gm, info = run(lambda x: x.view(B, T, 2, 3) * 2, x_())
    v = node(gm, by_method("view"))
    assert info.is_time_local(v) and info.step_dim[v] == 1
    gm, info = run(lambda x: x.view(B * T, D) * 2, x_())
    v = node(gm, by_method("view"))
    assert "merges or splits the step dim" in info.mixing[v] and info.step_dim[v] is None


def test_view_dropping_unit_batch_tracks_step():
    gm, info = run(lambda x: x.reshape(T, D) + 1, torch.randn(1, T, D))
    assert info.step_dim[node(gm, by_method("reshape"))] == 0
    gm, info = run(lambda x: x.reshape(T * D) + 1, torch.randn(1, T, D))
    assert node(gm, by_method("reshape")) in info.mixing


def test_transpose_moves_step_dim_and_it_is_tracked():
    gm, info = run(lambda x: x.transpose(1, 2).sum(1), x_())
    t, s = node(gm, by_method("transpose")), node(gm, by_method("sum"))
    assert info.step_dim[t] == 2 and info.is_time_local(s) and info.step_dim[s] == 1
    gm, info = run(lambda x: x.transpose(1, 2).sum(2), x_())
    assert node(gm, by_method("sum")) in info.mixing


def test_permute_unsqueeze_squeeze_expand():
    def f(x):
        y = x.permute(2, 0, 1).unsqueeze(0)  # [1, D, B, T]
        return y.squeeze(0).expand(3, D, B, T)

    gm, info = run(f, x_())
    assert info.step_dim[node(gm, by_method("permute"))] == 2
    assert info.step_dim[node(gm, by_method("unsqueeze"))] == 3
    assert info.step_dim[node(gm, by_method("squeeze"))] == 2
    assert info.step_dim[node(gm, by_method("expand"))] == 3
    assert not info.mixing
    # squeezing the step dim away (T == 1) loses it
    gm, info = run(lambda x: x.squeeze(1) + 1, torch.randn(B, 1, D))
    assert "removes the step dim" in info.mixing[node(gm, by_method("squeeze"))]


def test_getitem_on_features_local_on_time_mixes():
    gm, info = run(lambda x: x[..., :2] * 3, x_())
    g = node(gm, by_fn(__import__("operator").getitem))
    assert info.is_time_local(g) and info.step_dim[g] == 1
    gm, info = run(lambda x: x[:, None, :, 1] * 3, x_())
    assert info.step_dim[node(gm, by_fn(__import__("operator").getitem))] == 2
    gm, info = run(lambda x: x[:, 1:] * 3, x_())
    assert "slicing along the step dim" in info.mixing[node(gm, by_fn(__import__("operator").getitem))]
    gm, info = run(lambda x: x[:, -1] * 3, x_())
    assert "single step" in info.mixing[node(gm, by_fn(__import__("operator").getitem))]


def test_chunk_on_features_local_on_time_mixes():
    gm, info = run(lambda x: x.chunk(2, dim=-1)[1] + 1, x_())
    assert info.is_time_local(node(gm, by_method("chunk")))
    assert not info.mixing
    gm, info = run(lambda x: x.chunk(5, dim=1)[1] + 1, x_())
    assert "along the step dim" in info.mixing[node(gm, by_method("chunk"))]


def test_cat_along_features_local_along_time_mixes():
    gm, info = run(lambda x: torch.cat([x, x * 2], -1), x_())
    assert info.is_time_local(node(gm, by_fn(torch.cat)))
    gm, info = run(lambda x: torch.cat([x, x * 2], 1), x_())
    assert "cat along the step dim" in info.mixing[node(gm, by_fn(torch.cat))]


# ------------------------------------------------------------------------------------------ contractions


def test_linear_over_features_local_attention_mixes():
    w = torch.randn(4, D)
    gm, info = run(lambda x, w: F.linear(x, w), x_(), w)
    assert info.is_time_local(node(gm, by_fn(F.linear)))
    gm, info = run(lambda x: torch.softmax(x @ x.transpose(1, 2), -1) @ x, x_())
    mm = [n for n in gm.graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
    assert "different dims" in info.mixing[mm[0]]


def test_matmul_by_weight_local_time_matrix_mixes():
    w, m = torch.randn(D, 3), torch.randn(T, T)
    gm, info = run(lambda x, w: x @ w, x_(), w)
    mm = node(gm, lambda n: n.op == "call_function" and "matmul" in str(n.target))
    assert info.is_time_local(mm) and info.step_dim[mm] == 1
    gm, info = run(lambda x, m: m @ x, x_(), m)
    mm = node(gm, lambda n: n.op == "call_function" and "matmul" in str(n.target))
    assert "contracts the step dim" in info.mixing[mm]


def test_einsum_keeps_or_contracts_the_step_index():
    w = torch.randn(D, 3)
    gm, info = run(lambda x, w: torch.einsum("btd,de->bte", x, w), x_(), w)
    e = node(gm, by_fn(torch.einsum))
    assert info.is_time_local(e) and info.step_dim[e] == 1
    gm, info = run(lambda x, w: torch.einsum("...d,de->...e", x, w), x_(), w)
    assert info.is_time_local(node(gm, by_fn(torch.einsum)))
    gm, info = run(lambda x: torch.einsum("btd,bsd->bts", x, x), x_())
    assert "different indices" in info.mixing[node(gm, by_fn(torch.einsum))]
    gm, info = run(lambda x: torch.einsum("btd->bd", x), x_())
    assert "contracts the step index" in info.mixing[node(gm, by_fn(torch.einsum))]


def test_conv_along_time_mixes_but_keeps_the_axis():
    w = torch.randn(D, 1, 3)

    def f(x, w):
        y = F.conv1d(x.transpose(1, 2), w, padding=2, groups=D)[..., :T]
        return F.silu(y)

    gm, info = run(f, x_(), w)
    c = node(gm, by_fn(F.conv1d))
    assert "convolution along the step axis" in info.mixing[c]
    # the conv output is T+2 long: its step axis is lost, and the slice back to T does not recover it
    assert info.step_dim[c] is None
    w1 = torch.randn(4, D, 1)
    gm, info = run(lambda x, w: F.conv1d(x.transpose(1, 2), w), x_(), w1)
    c = node(gm, by_fn(F.conv1d))
    assert info.step_dim[c] == 2 and c in info.mixing


# --------------------------------------------------------------------------------------------------- pointwise


def test_pointwise_with_params_local_with_per_step_table_mixes():
    p = torch.randn(D)
    gm, info = run(lambda x, p: torch.exp(x * p) + F.softplus(x), x_(), p)
    assert not info.mixing and all(info.is_time_local(n) for n in gm.graph.nodes if n.op == "call_function")
    table = torch.randn(T, D)
    gm, info = run(lambda x, p: x + p, x_(), table)
    add = node(gm, lambda n: n.op == "call_function")
    assert "not tracked along the step axis" in info.mixing[add]
    # seeding the table makes it a per-step input: local again
    gm, info = run(lambda x, p: x + p, x_(), table, seeds={"x": 1, "p": 0})
    assert not info.mixing


def test_step_free_parameter_math_is_step_free():
    A = torch.randn(D, 4)
    gm, info = run(lambda x, A: x.unsqueeze(-1) * -torch.exp(A), x_(), A)
    e = node(gm, by_fn(torch.exp))
    assert info.kind(e) == "step_free"
    assert info.kind(node(gm, by_method("unsqueeze"))) == "local"


def test_unknown_op_is_mixing_and_never_guessed():
    gm, info = run(lambda x: torch.fft.rfft(x, dim=-1).real, x_())
    f = node(gm, by_fn(torch.fft.rfft))
    assert info.mixing[f].startswith("unknown op")
    assert info.step_dim[f] is None


def test_dropout_in_training_mixes_in_eval_is_local():
    gm, info = run(lambda x: F.dropout(x, 0.5, training=False) + 1, x_())
    assert not info.mixing
    gm, info = run(lambda x: F.dropout(x, 0.5, training=True) + 1, x_())
    assert "random" in info.mixing[node(gm, by_fn(F.dropout))]


def test_bad_seeds_raise_value_error():
    gm = trace(lambda x, y: x + y.sum(), x_(), torch.randn(B, 3, D))
    with pytest.raises(ValueError, match="seeds"):
        analyze(gm, {placeholder(gm, "x"): 1, placeholder(gm, "y"): 1})
    with pytest.raises(ValueError, match="seeds"):
        analyze(gm, {placeholder(gm, "x"): 3})


# -------------------------------------------------------------------------------------------------- scans


def _stack(x, w1, w2, A, h0=None):
    """Two scan layers joined by a norm and a Linear, then a cumsum over time (mixing)."""
    y = x
    for w in (w1, w2):
        u = F.linear(F.layer_norm(y, (D,)), w)
        a = torch.exp(F.softplus(u).unsqueeze(-1) * -torch.exp(A))
        h = scan(a, u.unsqueeze(-1) * a, h0)
        y = y + h.sum(-1)
    return torch.cumsum(y, 1)


def _stack_args():
    return x_(), torch.randn(D, D), torch.randn(D, D), torch.randn(D, 3)


def test_scan_is_a_time_local_carrier_and_the_stack_is_one_region():
    gm, info = run(_stack, *_stack_args())
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    assert len(scans) == 2 and all(info.is_time_local(s) and info.step_dim[s] == 1 for s in scans)
    assert scan_args(scans[0])["dim"] == 1
    nodes, bounds = region_around(gm, scans[:1], info)
    assert set(scans) <= set(nodes)
    order = list(gm.graph.nodes)
    assert nodes == sorted(nodes, key=order.index)
    assert [why for _, why in bounds] == ["cumsum along the step dim"]
    assert all(n.op in ("call_function", "call_method") and info.is_time_local(n) for n in nodes)
    # the parameter math (exp(A)) is step-free: an input, not a member
    assert not any(n.target is torch.exp and info.step_dim[n] is None for n in nodes)


def test_reverse_scan_mixes_and_splits_the_region():
    def f(x, w1, w2, A):
        a = torch.sigmoid(x)
        h = scan(a, x)
        g = scan(a, h, reverse=True)
        return scan(a, g * 2)

    gm, info = run(f, *_stack_args())
    scans = [n for n in gm.graph.nodes if is_linear_scan(n)]
    assert "reverse" in info.mixing[scans[1]]
    nodes, bounds = region_around(gm, scans[:1], info)
    assert scans[0] in nodes and scans[1] not in nodes and scans[2] not in nodes
    assert any("reverse" in why for _, why in bounds)


def test_scan_with_untracked_inputs_is_rejected_with_a_reason():
    gm = trace(lambda x, a: scan(a, x), x_(), torch.rand(B, T, D))
    s = node(gm, is_linear_scan)
    info = analyze(gm, {s: 1})
    assert "not tracked along the step axis" in info.mixing[s]
    nodes, bounds = region_around(gm, [s], info)
    assert nodes == [] and bounds and bounds[0][0] == s.name


def test_region_is_convex_around_a_mixing_detour():
    def f(x):
        y = scan(torch.sigmoid(x), x)
        z = torch.cumsum(y, 1)  # mixing, depends on y
        return torch.tanh(y) + z  # time-local, but fed by y both directly and through the cumsum

    gm, info = run(f, x_())
    s = node(gm, is_linear_scan)
    nodes, bounds = region_around(gm, [s], info)
    add = node(gm, lambda n: n.op == "call_function" and "add" in str(n.target))
    assert info.is_time_local(add) and add not in nodes and s in nodes
    # outlining the set must not create a cycle: no member is fed by a non-member that depends on a member
    members = set(nodes)
    for n in nodes:
        for a in n.all_input_nodes:
            assert a in members or not any(m in members for m in a.all_input_nodes)


def test_symbolic_sizes_are_read_without_guards():
    gm = trace(lambda x: x.view(x.shape[0], x.shape[1], 2, 3).sum(-1) + x.sum(1, keepdim=True)[..., :2],
               torch.randn(B, T, D), dynamic=True)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta["example_value"], torch.Tensor)]
    assert not all(isinstance(d, int) for d in ph[0].meta["example_value"].shape)  # really symbolic
    info = analyze(gm, {ph[0]: 1})
    assert info.step_dim[node(gm, by_method("view"))] == 1
    sums = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum"]
    assert [n in info.mixing for n in sums] == [False, True]


def _chain_graph(n_ops):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(B, T, D)
    y = x
    for i in range(n_ops):
        y = g.call_function(torch.tanh if i % 2 else torch.sigmoid, (y,))
        y.meta["example_value"] = torch.empty(B, T, D)
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g), x


def test_analysis_is_near_linear_in_graph_size():
    times = []
    for n in (2000, 8000):
        gm, x = _chain_graph(n)
        t0 = time.perf_counter()
        info = analyze(gm, {x: 1})
        nodes, _ = region_around(gm, [list(gm.graph.nodes)[1]], info)
        times.append(time.perf_counter() - t0)
        assert len(nodes) == n
    assert times[1] < 12 * times[0] + 0.05  # 4x the nodes: linear is ~4x, quadratic ~16x
