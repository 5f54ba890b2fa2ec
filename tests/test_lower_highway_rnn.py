"""nn.GRU / nn.LSTM in highway mode (issue 12): dynamo leaves them out of its graph by default; with
``mode="highway"`` their fused op is written as its cell equations, one scan per layer (polyfills/torch_rnn.py),
and Highway-BP rewrites each layer. Gradients against the levels oracle (tests/highway_oracle.py), written here from
the module's weights, every parameter by name, the input's and h0's too."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from highway_oracle import levels_oracle

import adjoint_compile as ac

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _weights(m, layer):
    sfx = "" if layer is None else f"_l{layer}"  # NB: None: a cell (nn.GRUCell / nn.LSTMCell)
    w = [getattr(m, f"{n}{sfx}") for n in ("weight_ih", "weight_hh")]
    b = [getattr(m, f"{n}{sfx}") for n in ("bias_ih", "bias_hh")] if m.bias else [None, None]
    return w[0], w[1], b[0], b[1]


def _gru_layer(m, layer, x, h0, k):
    """x [T, B, d] -> level-k states [T, B, H]: g = [z, (1 - z) ⊙ n], r = z1 ⊙ h + z2."""
    w_ih, w_hh, b_ih, b_hh = _weights(m, layer)

    def g(h, gx_t):
        r_x, z_x, n_x = gx_t.chunk(3, -1)
        r_h, z_h, n_h = F.linear(h, w_hh, b_hh).chunk(3, -1)
        r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
        return z, (1 - z) * torch.tanh(n_x + r * n_h)

    return levels_oracle(g, lambda h, z: z[0] * h + z[1], h0, list(F.linear(x, w_ih, b_ih)), k)


def _lstm_layer(m, layer, x, h0, k):
    """The state is [h, c]: g = [h' (from the old state), f, i ⊙ g], r = [z_h, f ⊙ c + z_b]."""
    w_ih, w_hh, b_ih, b_hh = _weights(m, layer)
    H = m.hidden_size

    def g(s, gx_t):
        h, c = s[..., :H], s[..., H:]
        i, f, gg, o = (gx_t + F.linear(h, w_hh, b_hh)).chunk(4, -1)
        i, f, gg, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(gg), torch.sigmoid(o)
        return o * torch.tanh(f * c + i * gg), f, i * gg

    def r(s, z):
        return torch.cat([z[0], z[1] * s[..., H:] + z[2]], -1)

    return levels_oracle(g, r, torch.cat(h0, -1), list(F.linear(x, w_ih, b_ih)), k)


def _oracle(m, x, hx, k):
    """The module's outputs, each layer through the levels oracle with k iterations (the next layer reads them)."""
    lstm = isinstance(m, nn.LSTM)
    B = x.shape[0 if m.batch_first else 1]
    seq = x.transpose(0, 1) if m.batch_first else x
    H = m.hidden_size
    if hx is None:
        z = seq.new_zeros(m.num_layers, B, H)
        hx = (z, z) if lstm else z
    last_h, last_c = [], []
    for layer in range(m.num_layers):
        if lstm:
            s = _lstm_layer(m, layer, seq, (hx[0][layer], hx[1][layer]), k)
            seq = s[..., :H]
            last_c.append(s[-1, ..., H:])
        else:
            seq = _gru_layer(m, layer, seq, hx[layer], k)
        last_h.append(seq[-1])
    out = seq.transpose(0, 1) if m.batch_first else seq
    return (out, (torch.stack(last_h), torch.stack(last_c))) if lstm else (out, torch.stack(last_h))


def _flat(res):
    out, h = res
    return [out, *(h if isinstance(h, tuple) else (h,))]


def _grads(run, m, x, hx, proj):
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    hx = None if hx is None else (tuple(h.detach().requires_grad_() for h in hx) if isinstance(hx, tuple)
                                  else hx.detach().requires_grad_())
    outs = _flat(run(x, hx))
    sum((o * p).sum() + o.pow(2).sum() for o, p in zip(outs, proj)).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    got["<input>"] = x.grad.clone()
    for i, h in enumerate(hx if isinstance(hx, tuple) else () if hx is None else (hx,)):
        got[f"<h0 {i}>"] = h.grad.clone()
    return got, [o.detach() for o in outs]


def _compiled(m, k):
    torch._dynamo.reset()
    return torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": k, "inner": "eager"})


def _assert_same(got, want, what):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=f"{what}: {n}")


CASES = {  # name: (module, T, h0 given)
    "gru_1layer_batch_first": (lambda: nn.GRU(5, 6, batch_first=True), 7, False),
    "gru_2layers_seq_first_h0": (lambda: nn.GRU(5, 6, num_layers=2), 7, True),
    "gru_T1": (lambda: nn.GRU(5, 6, num_layers=2, batch_first=True), 1, True),
    "gru_no_bias_odd_T": (lambda: nn.GRU(5, 6, bias=False), 5, False),
    "lstm_2layers_batch_first_h0": (lambda: nn.LSTM(5, 6, num_layers=2, batch_first=True), 7, True),
    "lstm_1layer_seq_first": (lambda: nn.LSTM(5, 6), 5, False),
}


@pytest.mark.parametrize("k", [0, 1, 2, "T"])
@pytest.mark.parametrize("name", list(CASES))
def test_rnn_module_matches_the_levels_oracle(name, k):
    torch.manual_seed(11)
    make, T, given = CASES[name]
    m = make()
    k = T if k == "T" else k
    B = 3
    x = torch.randn(B, T, 5) if m.batch_first else torch.randn(T, B, 5)
    hx = None
    if given:
        h = torch.randn(m.num_layers, B, 6)
        hx = (h, torch.randn(m.num_layers, B, 6)) if isinstance(m, nn.LSTM) else h
    shapes = [o.shape for o in _flat(m(x, hx))]
    proj = [torch.randn(s) for s in shapes]
    c = _compiled(m, k)
    got, outs = _grads(lambda x, h: c(x, h), m, x, hx, proj)
    want, oracle_outs = _grads(lambda x, h: _oracle(m, x, h, k), m, x, hx, proj)
    _assert_same(got, want, f"{name} k={k}")
    native, native_outs = _grads(lambda x, h: m(x, h), m, x, hx, proj)
    for a, b in zip(outs, native_outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if k >= T:
        _assert_same(got, native, f"{name} k>=T vs nn's own autograd")
    elif T > 2 and k == 0:
        assert not torch.allclose(got[f"weight_hh_l{m.num_layers - 1}"], native[f"weight_hh_l{m.num_layers - 1}"],
                                  rtol=1e-3, atol=1e-5)
    regions = ac.report(c).regions
    assert [r.rewrite for r in regions] == ["highway"] * m.num_layers
    assert all("captured by adjoint-compile's decomposition of nn.GRU / nn.LSTM" in r.reason for r in regions)
    assert all(r.details["iterations"] == k for r in regions)


@pytest.mark.parametrize("name", ["gru_2layers_seq_first_h0", "lstm_2layers_batch_first_h0"])
def test_dynamic_shapes_decompose_the_module_at_every_length(name):
    """Under dynamic=True the module's dropout p arrives as a symbolic float: the module was left native ("unreadable
    arguments") and its gradients were the exact ones, not Highway-BP's."""
    make, _, _ = CASES[name]
    torch.manual_seed(11)
    m = make()
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", dynamic=True, options={"mode": "highway", "iterations": 1,
                                                                   "inner": "eager"})
    for T in (7, 9, 5):
        x = torch.randn(3, T, 5) if m.batch_first else torch.randn(T, 3, 5)
        h = torch.randn(m.num_layers, 3, 6)
        hx = (h, torch.randn(m.num_layers, 3, 6)) if isinstance(m, nn.LSTM) else h
        proj = [torch.randn(o.shape) for o in _flat(m(x, hx))]
        got, _ = _grads(lambda x, h: c(x, h), m, x, hx, proj)
        want, _ = _grads(lambda x, h: _oracle(m, x, h, 1), m, x, hx, proj)
        _assert_same(got, want, f"{name} T={T}")
    assert not ac.report(c).graph_breaks, ac.report(c).graph_breaks


def test_exact_mode_leaves_the_module_native_with_exact_gradients():
    torch.manual_seed(12)
    m, x = nn.GRU(5, 6, num_layers=2, batch_first=True), torch.randn(2, 6, 5)
    proj = [torch.randn(2, 6, 6), torch.randn(2, 2, 6)]
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"inner": "eager"})
    got, _ = _grads(lambda x, h: c(x, h), m, x, None, proj)
    _assert_same(got, _grads(lambda x, h: m(x, h), m, x, None, proj)[0], "exact mode")
    rep = ac.explain(m, x)
    assert not rep.regions
    assert any("nn.GRU is left out of dynamo's graph" in b.reason and "mode='highway'" in b.reason
               for b in rep.graph_breaks)


class _Sum(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0].tanh().sum()


@pytest.mark.parametrize("make, words", [
    (lambda: nn.GRU(5, 6, batch_first=True, bidirectional=True), "bidirectional=True"),
    (lambda: nn.LSTM(5, 6, batch_first=True, proj_size=3), "proj_size"),
    (lambda: nn.GRU(5, 6, num_layers=2, dropout=0.3, batch_first=True), "dropout=0.3"),
])
def test_forms_not_decomposed_run_natively_and_explain_says_why(make, words):
    torch.manual_seed(13)
    m, x = _Sum(make()), torch.randn(2, 6, 5)
    rep = ac.explain(m, x, options={"mode": "highway", "iterations": 1})
    assert all(r.rewrite != "highway" for r in rep.regions)
    assert any(words in b.reason and "natively" in b.reason for b in rep.graph_breaks), rep.graph_breaks
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": 0, "inner": "eager"})
    torch.manual_seed(0)
    c(x).backward()
    got = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in c.named_parameters()}
    m.zero_grad()
    torch.manual_seed(0)
    m(x).backward()
    _assert_same(got, {n: p.grad for n, p in m.named_parameters()}, "native")


def test_a_tanh_rnn_module_is_left_alone():
    """The negative twin: nn.RNN is neither gated nor decomposed; it keeps dynamo's default (native)."""
    torch.manual_seed(14)
    m, x = _Sum(nn.RNN(5, 6, batch_first=True)), torch.randn(2, 6, 5)
    rep = ac.explain(m, x, options={"mode": "highway", "iterations": 1})
    assert not rep.regions
    torch._dynamo.reset()
    c = torch.compile(m, backend="adjoint", options={"mode": "highway", "iterations": 0, "inner": "eager"})
    c(x).backward()
    rep = ac.report(c)  # NB: dynamo ran the frame without a graph (it does not wrap nn.RNN); the report says so
    assert not rep.graphs and "no graph compiled: dynamo ran _Sum.forward (" in str(rep), rep
    (brk,) = rep.graph_breaks
    assert brk.frame.startswith("_Sum.forward (") and "nn.RNN" in brk.reason and "self.rnn(x)" in brk.code
    got = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in c.named_parameters()}
    m.zero_grad()
    m(x).backward()
    _assert_same(got, {n: p.grad for n, p in m.named_parameters()}, "nn.RNN")


def test_other_backends_are_unchanged():
    """aot_eager still sees no nn.GRU in its graph (dynamo's default), after a highway trace in the same process."""
    torch.manual_seed(15)
    m, x = _Sum(nn.GRU(5, 6, batch_first=True)), torch.randn(2, 4, 5)
    _compiled(m, 1)(x)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(m, backend=backend)(x)
    targets = {getattr(n.target, "__name__", str(n.target)) for gm in seen for n in gm.graph.nodes}
    assert "gru" not in targets and "scan" not in " ".join(targets)


def test_unbatched_input_k_at_least_T_is_the_module_s_own_autograd():
    torch.manual_seed(16)
    m, x = nn.LSTM(5, 6, num_layers=2), torch.randn(5, 5)  # [T, d]: the module adds and drops the batch dim itself
    proj = [torch.randn(5, 6), torch.randn(2, 6), torch.randn(2, 6)]
    c = _compiled(m, 5)
    got, outs = _grads(lambda x, h: c(x, h), m, x, None, proj)
    want, native_outs = _grads(lambda x, h: m(x, h), m, x, None, proj)
    _assert_same(got, want, "unbatched")
    for a, b in zip(outs, native_outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r.rewrite for r in ac.report(c).regions] == ["highway", "highway"]


# ---------------------------------------------------------------------------------------------------------------
# loops over nn.GRUCell / nn.LSTMCell: one opaque cell call per step, the chain lowered as one HighwayScan


class CellLoop(nn.Module):
    def __init__(self, lstm, feed=False):
        super().__init__()
        self.lstm, self.feed = lstm, feed
        self.cell = nn.LSTMCell(5, 6) if lstm else nn.GRUCell(5, 6)
        self.back = nn.Linear(6, 5)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 6)
        c, out = h, []
        for t in range(x.shape[1]):
            x_t = x[:, t] + self.back(h) if self.feed else x[:, t]  # feed: input feeding, not a scan over inputs
            if self.lstm:
                h, c = self.cell(x_t, (h, c))
            else:
                h = self.cell(x_t, h)
            out.append(h)
        return torch.stack(out, 1)


def _cell_oracle(m, x, k):
    seq, z = x.transpose(0, 1), x.new_zeros(x.shape[0], 6)
    if m.lstm:
        return _lstm_layer(m.cell, None, seq, (z, z), k)[..., :6].transpose(0, 1)
    return _gru_layer(m.cell, None, seq, z, k).transpose(0, 1)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("lstm", [False, True])
def test_cell_loop_matches_the_levels_oracle(lstm, k):
    torch.manual_seed(17)
    m, x = CellLoop(lstm), torch.randn(3, 5, 5)
    proj = [torch.randn(3, 5, 6)]
    c = _compiled(m, k)
    got, _ = _grads(lambda x, h: (c(x), ()), m, x, None, proj)
    want, _ = _grads(lambda x, h: (_cell_oracle(m, x, k), ()), m, x, None, proj)
    _assert_same(got, want, f"cells k={k}")
    native, _ = _grads(lambda x, h: (m(x), ()), m, x, None, proj)
    if k >= 5:
        _assert_same(got, native, "cells k>=T vs autograd")
    else:
        assert not torch.allclose(got["cell.weight_hh"], native["cell.weight_hh"], rtol=1e-3, atol=1e-5)
    (r,) = ac.report(c).regions
    assert (r.kind, r.source, r.rewrite, r.length) == ("gated_recurrence", "unrolled_loop", "highway", 5)
    assert ("K = diag(f)" if lstm else "K = diag(z)") in r.reason


def test_a_cell_loop_with_input_feeding_keeps_ordinary_autograd():
    """The negative twin: x_t reads h_{t-1}, so the steps' inputs are not known before the loop."""
    torch.manual_seed(18)
    m, x = CellLoop(False, feed=True), torch.randn(3, 5, 5)
    proj = [torch.randn(3, 5, 6)]
    c = _compiled(m, 0)
    got, _ = _grads(lambda x, h: (c(x), ()), m, x, None, proj)
    _assert_same(got, _grads(lambda x, h: (m(x), ()), m, x, None, proj)[0], "input feeding")
    (r,) = ac.report(c).regions
    assert r.rewrite == "none" and "input feeding" in r.reason


class _Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(5, 6, batch_first=True)

    def forward(self, x):
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([4, 2]), batch_first=True)
        return self.rnn(packed)[1].sum()


def test_a_packed_sequence_runs_natively():
    torch.manual_seed(19)
    m, x = _Packed(), torch.randn(2, 4, 5)
    c = _compiled(m, 0)
    c(x).backward()
    got = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in c.named_parameters()}
    m.zero_grad()
    m(x).backward()
    _assert_same(got, {n: p.grad for n, p in m.named_parameters()}, "packed")
    assert all(r.rewrite != "highway" for r in ac.report(c).regions)
