"""Loops as libraries write them (issue 17): readouts inside the loop (transformers' Mamba, fla's GLA), an output
buffer written in place, no-op casts and slices on the state, ``torch.lerp``, and loops over ``GRUCell`` /
``LSTMCell``. Each is compiled with backend="adjoint" and compared with eager autograd: outputs and the gradient of
every input and parameter, by name, at several lengths and shard sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adjoint_compile as ac
from adjoint_compile.analysis.fx import is_linear_scan
from adjoint_compile.passes.capture import capture
from helpers import trace

B, D, N, H, K, V = 2, 3, 4, 2, 3, 4


def gla(q, k, v, gk, S):
    """fla's naive GLA recurrence: a multi-head matrix state [B, H, K, V], the readout inside the loop."""
    outs = []
    for i in range(q.shape[2]):
        q_i, k_i, v_i, gk_i = q[:, :, i], k[:, :, i], v[:, :, i], gk[:, :, i]
        S = S * gk_i[..., None].exp() + k_i[..., None] * v_i[..., None, :]
        outs.append((q_i[..., None] * S).sum(-2))
    return torch.stack(outs, 2), S


def mamba_readout(dA, dBu, C, h):
    """transformers' Mamba slow path: the readout y_t = h_t C_t inside the loop."""
    ys = []
    for t in range(dA.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(h.to(dA.dtype) @ C[:, t, :].unsqueeze(-1))
    return torch.stack(ys, 1)[..., 0]


def buffer_written(a, b, h):
    """An output buffer written in place (fla's naive references, RecurrentGemma, RWKV)."""
    o = torch.zeros_like(b)
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        o[:, t] = h
    return o


def buffer_selected(a, b, h):
    """The buffer's step written through ``select`` and ``copy_`` (time-major, as LRU ports write it)."""
    o = torch.zeros(a.shape[1], a.shape[0], a.shape[2])
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        o.select(0, t).copy_(h)
    return o.transpose(0, 1)


def buffer_one_step_slices(a, b, h):
    """Each step written into a ``t:t+1`` slice (RWKV-5/6's ``out[:, :, t:t+1] = ...``)."""
    o = torch.empty_like(b)
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        o[:, t:t + 1] = h[:, None]
    return o


def buffer_ellipsis(a, b, h):
    """``o[..., t, :] = h``: the ellipsis stands for full slices."""
    o = torch.zeros_like(b)
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        o[..., t, :] = h
    return o


def noop_casts(a, b, h):
    outs = []
    for t in range(a.shape[1]):
        h = (a[:, t] * h + b[:, t]).to(a.device).type(a.dtype)
        outs.append(h)
    return torch.stack(outs, 1)


def lerp_loop(z, c, h):
    outs = []
    for t in range(z.shape[1]):
        h = torch.lerp(h, c[:, t], z[:, t])
        outs.append(h)
    return torch.stack(outs, 1)


def noop_slice(z, c, h):
    outs = []
    for t in range(z.shape[1]):
        h = (z[:, t:t + 1] * h + c[:, t:t + 1])[:, -1:]
        outs.append(h)
    return torch.cat(outs, 1)


CASES = {
    "gla": (gla, lambda T: dict(q=torch.randn(B, H, T, K), k=torch.randn(B, H, T, K), v=torch.randn(B, H, T, V),
                                gk=-torch.rand(B, H, T, K), S=torch.randn(B, H, K, V))),
    "mamba_readout": (mamba_readout, lambda T: dict(dA=torch.rand(B, D, T, N), dBu=torch.randn(B, D, T, N),
                                                    C=torch.randn(B, T, N), h=torch.randn(B, D, N))),
    "buffer_written": (buffer_written, lambda T: dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D),
                                                      h=torch.randn(B, D))),
    "buffer_selected": (buffer_selected, lambda T: dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D),
                                                        h=torch.randn(B, D))),
    "buffer_one_step_slices": (buffer_one_step_slices, lambda T: dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D),
                                                                      h=torch.randn(B, D))),
    "buffer_ellipsis": (buffer_ellipsis, lambda T: dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D),
                                                        h=torch.randn(B, D))),
    "noop_casts": (noop_casts, lambda T: dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D), h=torch.randn(B, D))),
    "lerp": (lerp_loop, lambda T: dict(z=torch.rand(B, T, D), c=torch.randn(B, T, D), h=torch.randn(B, D))),
    "noop_slice": (noop_slice, lambda T: dict(z=torch.rand(B, T, D), c=torch.randn(B, T, D), h=torch.randn(B, 1, D))),
}


def rel_err(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-12)).item()


def check(fn, inputs, options, params=()):
    """Outputs and every named gradient of ``fn`` compiled with backend="adjoint" equal eager autograd's."""
    named = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    named_params = dict(params)
    ref = fn(**named)
    ref = ref if isinstance(ref, tuple) else (ref,)
    w = [torch.randn_like(r) for r in ref]
    leaves = {**named, **named_params}
    g_ref = dict(zip(leaves, torch.autograd.grad(ref, list(leaves.values()), w)))
    torch._dynamo.reset()
    f = torch.compile(fn, backend="adjoint", options=options)
    out = f(**named)
    out = out if isinstance(out, tuple) else (out,)
    g = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), w)))
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= 1e-5
    for name in leaves:
        assert rel_err(g[name], g_ref[name]) <= 1e-5, name
    return ac.report(f)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T,shard", [(1, 1), (5, 1), (5, 3), (16, 5)])
def test_loop_form_matches_eager_autograd(name, T, shard):
    """The loop unrolled by dynamo and re-rolled from the graph (roll_loops=False; also the path of loops the roller
    refuses)."""
    fn, make = CASES[name]
    rep = check(fn, make(T), {"inner": "eager", "shard_size": shard, "roll_loops": False})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    if T == 1:
        return  # NB: a loop of one step is no recurrence: compiled as is
    (r,) = lin
    assert (r.source, r.rewrite) == ("unrolled_loop", "adjoint"), r.reason
    assert "re-rolled into" in r.reason
    assert not [n for n in rep.compiled[-1].captured.gm.graph.nodes if is_linear_scan(n)]  # inside the region


@pytest.mark.parametrize("name", ["gla", "mamba_readout"])
def test_readout_is_rerolled_with_the_recurrence(name):
    fn, make = CASES[name]
    T = 6
    inputs = make(T)
    gm = trace(fn, *inputs.values())
    captured = capture(gm, [])
    assert captured.normalized["readouts"] == {"linear_scan_default": "re-rolled with the scan: " +
                                               ("2 op(s)" if name == "gla" else "1 op(s)") +
                                               f" per step, once for all {T} steps"}
    # nothing per step is left: no read of one state, no stack of T readouts
    assert not [n for n in gm.graph.nodes if "stack" in str(n.target) or "unbind" in str(n.target)]
    # NB: the loop unrolled and re-rolled, as torch.compile does with roll_loops off (on, it rolls the compiled
    # function's own loop before dynamo traces it)
    rep = ac.explain(fn, *inputs.values(), options={"shard_size": 2, "roll_loops": False})
    (r,) = rep.regions
    assert r.details["readouts"].startswith("re-rolled with the scan")
    assert r.rewrite == "adjoint"


def test_readout_graph_does_not_grow_with_T():
    sizes = {}
    for T in (16, 64):
        gm = trace(mamba_readout, *CASES["mamba_readout"][1](T).values())
        capture(gm, [])
        sizes[T] = len(gm.graph.nodes)
    assert sizes[16] == sizes[64] < 20, sizes


def readout_without_rule(a, b, h):
    """A per-step readout the batching has no rule for (``torch.nn.functional.normalize``): kept per step."""
    ys = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        ys.append(torch.nn.functional.normalize(h, dim=-1))
    return torch.stack(ys, 1)


def test_readout_without_batching_rule_reads_the_state_through_one_unbind():
    T = 7
    inputs = dict(a=torch.rand(B, T, D), b=torch.randn(B, T, D), h=torch.randn(B, D))
    gm = trace(readout_without_rule, *inputs.values())
    captured = capture(gm, [])
    (why,) = captured.normalized["readouts"].values()
    assert why.startswith("not re-rolled:") and "normalize" in why
    unbinds = [n for n in gm.graph.nodes if "unbind" in str(n.target)]
    assert len(unbinds) == 1 and unbinds[0].args[0].op == "call_function"
    check(readout_without_rule, inputs, {"inner": "eager", "shard_size": 3})


class GRULoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(D, D)

    def forward(self, x, h):
        outs = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            outs.append(h)
        return torch.stack(outs, 1)


class LSTMLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(D, D)

    def forward(self, x, h):
        c, outs = h, []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1), c


@pytest.mark.parametrize("cls,cell", [(GRULoop, "gru_cell"), (LSTMLoop, "lstm_cell")])
@pytest.mark.parametrize("T", [1, 5])
def test_recurrent_cell_loops_are_gated_and_keep_autograd(cls, cell, T):
    torch.manual_seed(0)
    m = cls()
    inputs = dict(x=torch.randn(B, T, D), h=torch.randn(B, D))
    rep = check(m, inputs, {"inner": "eager", "shard_size": 1}, params=m.named_parameters())
    if T == 1:
        assert not rep.regions
        return
    (r,) = rep.regions
    assert (r.kind, r.source, r.length, r.rewrite) == ("gated_recurrence", "unrolled_loop", T, "none")
    assert r.details["cell"] == cell and "gated recurrence" in r.reason
    text = str(ac.explain(cls(), *inputs.values()))
    assert "gated_recurrence" in text and "unrolled_loop" in text


def test_rewrite_that_would_not_pay_is_declined_with_its_estimate():
    """A bare scan whose states T per-step ops outside read (the readout has no batching rule): sharding would keep
    the full-length states alive outside the region and recompute the scan, so it is declined."""
    T = 64
    inputs = dict(a=torch.rand(B, T, 16), b=torch.randn(B, T, 16), h=torch.randn(B, 16))
    rep = ac.explain(readout_without_rule, *inputs.values(), options={"shard_size": 8, "roll_loops": False})
    (r,) = rep.regions
    assert r.rewrite == "none" and r.reason.startswith("declined: the rewrite would not pay")
    mem = r.details["expected_memory_bytes"]
    assert mem["kept_outside"] == T * B * 16 * 4 and mem["sharded"] + mem["kept_outside"] > mem["autograd"]
    assert "declined" in str(rep)
    check(readout_without_rule, inputs, {"inner": "eager", "shard_size": 8})


def test_gla_step_is_sharded_at_a_saving():
    fn, make = CASES["gla"]
    rep = ac.explain(fn, *make(64).values(), options={"shard_size": 8})
    (r,) = rep.regions
    assert r.rewrite == "adjoint", r.reason
    mem = r.details["expected_memory_bytes"]
    assert mem["kept_outside"] == 0 and mem["sharded"] < mem["autograd"] / 4


def _saved_bytes(run, xs: dict) -> int:
    """Bytes autograd saves for backward in one call, besides the inputs themselves (saved-tensor hooks)."""
    own = {x.untyped_storage().data_ptr() for x in xs.values()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(**xs)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("name", list(CASES))
def test_loop_form_rolled_before_dynamo_matches_eager_autograd(name):
    """The same loops with the roller on (the default): traced once as torch's scan, or, where the roller refuses
    the loop, unrolled and re-rolled as above; exact either way."""
    fn, make = CASES[name]
    rep = check(fn, make(16), {"inner": "eager", "shard_size": 5})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence" and r.rewrite == "adjoint"]
    assert lin and {r.source for r in lin} <= {"scan", "unrolled_loop"}, [(r.source, r.reason) for r in rep.regions]


@pytest.mark.slow
def test_gla_readout_of_an_input_runs_inside_the_region_and_saves_less_than_aot_eager():
    """fla's naive GLA takes q as an input of its own: the readout (q_t[..., None] * S_t).sum(-2) broadcasts q
    against the states, so q is sliced per shard with them (analysis/grow.py, readout operands) and no full-length
    state is handed out of the region to be saved (before: the whole [T, B, H, K, V] state sequence was)."""
    fn, make = CASES["gla"]
    xs = {k: v.requires_grad_() for k, v in make(64).items()}
    f = torch.compile(fn, backend="adjoint", options={"inner": "eager", "shard_size": 16, "roll_loops": False})
    f(**xs)
    gm = ac.report(f).compiled[0].captured.gm
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert "l_q_" in [a.name for a in call.args]
    state = 2 * 2 * 64 * 16 * 16 * 4  # B H T K V fp32: the state sequence
    got = _saved_bytes(f, xs)
    torch._dynamo.reset()
    want = _saved_bytes(torch.compile(fn, backend="aot_eager"), xs)
    assert got < state / 8 and got <= want, (got, want)


def residual_loop(x, W):
    outs = []
    for _ in range(6):
        x = x + torch.tanh(x @ W)
        outs.append(x.sum())
    return torch.stack(outs)


def test_explain_groups_residual_chain_rejections():
    rep = ac.explain(residual_loop, torch.randn(2, 4), torch.randn(4, 4))
    assert len(rep.rejections) == 5
    text = str(rep)
    assert "residual_chain x5 (at x_1, x_2, x_3, ... (2 more)): layer input x of the residual layer at x_1 " \
           "also feeds sum_1 outside the layer (at the first; the others alike, each at its own nodes)" in text
    assert len(text.splitlines()) < 8
    verbose = rep.text(verbose=True)
    assert "residual_chain at x_5: layer input x_4 of the residual layer at x_5 also feeds sum_5" in verbose
    assert len(rep.to_dict()["rejections"]) == 5
