"""Tree scans written in plain torch (passes/match/find_tree_scans.py): a recursive even/odd parallel scan that dynamo
unrolls into strided slices, muls, adds and interleaving is proven numerically to be a linear scan, rewritten into
one linear_scan node and sharded with exact gradients; a tree that is not one is rejected and keeps autograd.

The forms (none of the libraries is needed; each is written here from its description):

* ``accel``: accelerated-scan's ``ref.scan`` style on ``[B, C, T]`` along the last dim: T padded to a power of two,
  the up-sweep combines (odd, even) pairs and recurses on them, the down-sweep fills in the even steps;
* ``accel_excl``: the same with an exclusive down-sweep (the identity, ``zeros_like``, shifted in first);
* ``gateloop``: gateloop-transformer's ``associative_scan(binary_operator, (a, kv), axis=1)`` (its jax port: odd/even
  slices, ``_interleave`` with pad + stack + flatten), a ``[B, T, D, 1]`` against kv ``[B, T, D, E]``;
* ``gateloop_h0``: the same with an initial state as a prepended step (``cat``), the first output step dropped;
* ``gateloop_complex``: complex a and kv (gateloop's own use);
* ``transformers``: transformers' Mamba ``associative_scan(combine_fn, (dA, dBu), dim=2, combine_mode="generic")``,
  which dynamo inlines as the same tree under vmap (passes/match/find_generic_scan.py proves that one).

Each model: a = sigmoid(x W_a) (complex: times exp(i x W_p)), b = x W_b, h = the scan, loss = Σ (h W_o)²; compiled
whole with backend="adjoint", shard_size 4, inner aot_eager; the loss and every gradient against eager autograd of
the same model (fp64: 1e-10 relative, max |g - g_ref| / max |g_ref|; fp32: 1e-5 against fp64 eager).
"""
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

import adjoint_compile as ac

OPTIONS = {"shard_size": 4, "inner": "aot_eager"}
D = 3


# ----------------------------------------------------------------------------------------------------------------
# the scans, in plain torch


def _blelloch(a, b, exclusive=False):
    """Inclusive scan of [..., T] (T a power of two) along the last dim by an even/odd split."""
    if a.shape[-1] == 1:
        return b
    ae, ao, be, bo = a[..., 0::2], a[..., 1::2], b[..., 0::2], b[..., 1::2]
    ho = _blelloch(ao * ae, ao * be + bo, exclusive)  # up-sweep: each (even, odd) pair combined; the odd steps
    if exclusive:  # down-sweep from the exclusive scan: the identity first
        he = ae * torch.cat([torch.zeros_like(ho[..., :1]), ho[..., :-1]], dim=-1) + be
    else:
        he = torch.cat([be[..., :1], ae[..., 1:] * ho[..., :-1] + be[..., 1:]], dim=-1)
    return torch.stack([he, ho], dim=-1).flatten(-2)


def accel_scan(gates, tokens, exclusive=False):
    """accelerated-scan's ref.scan signature: gates, tokens [B, C, T], the scan along T."""
    T = gates.shape[-1]
    P = 1 << (T - 1).bit_length()
    if P != T:
        gates, tokens = F.pad(gates, (0, P - T), value=1.0), F.pad(tokens, (0, P - T))
    return _blelloch(gates, tokens, exclusive)[..., :T]


def _slice_along_axis(x, start=0, end=None, step=1, axis=0):
    s = [slice(None)] * x.ndim
    s[axis % x.ndim] = slice(start, end, step)
    return x[tuple(s)]


def _interleave(a, b, axis):
    if b_trunc := (a.shape[axis] == b.shape[axis] + 1):
        pad = [0, 0] * b.ndim
        pad[(b.ndim - axis - 1) * 2 + 1] = 1
        b = F.pad(b, pad)
    out = torch.flatten(torch.stack([a, b], dim=axis + 1), start_dim=axis, end_dim=axis + 1)
    return _slice_along_axis(out, 0, b.shape[axis] + a.shape[axis] - 1, axis=axis) if b_trunc else out


def gl_associative_scan(operator, elems, axis=0):
    """gateloop-transformer's associative_scan (a port of jax.lax.associative_scan)."""
    def _scan(elems):
        n = elems[0].shape[axis]
        if n < 2:
            return elems
        reduced = operator([_slice_along_axis(e, 0, -1, step=2, axis=axis) for e in elems],
                           [_slice_along_axis(e, 1, None, step=2, axis=axis) for e in elems])
        odd = _scan(reduced)
        if n % 2 == 0:
            even = operator([_slice_along_axis(e, 0, -1, axis=axis) for e in odd],
                            [_slice_along_axis(e, 2, None, step=2, axis=axis) for e in elems])
        else:
            even = operator(odd, [_slice_along_axis(e, 2, None, step=2, axis=axis) for e in elems])
        even = [torch.cat([_slice_along_axis(e, 0, 1, axis=axis), r], dim=axis) for e, r in zip(elems, even)]
        return list(map(partial(_interleave, axis=axis), even, odd))
    return _scan(list(elems))


def binary_operator(e_i, e_j):
    a_i, kv_i = e_i
    a_j, kv_j = e_j
    return a_j * a_i, a_j * kv_i + kv_j


def wrong_operator(e_i, e_j):  # the sign of the input: not a linear scan
    return e_j[0] * e_i[0], e_j[0] * e_i[1] - e_j[1]


def max_operator(e_i, e_j):  # a max-plus-like combine: not a linear scan
    return e_j[0] * e_i[0], torch.maximum(e_j[0] * e_i[1], e_j[1])


def hf_combine_fn(left, right):  # transformers' Mamba
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right


# ----------------------------------------------------------------------------------------------------------------
# the model


class Model(nn.Module):
    def __init__(self, form, dtype):
        super().__init__()
        self.form = form
        self.wa, self.wb, self.wp, self.out = (nn.Linear(D, D, dtype=dtype) for _ in range(4))
        self.h0 = nn.Parameter(torch.randn(D, 2, dtype=dtype))

    def forward(self, x):  # x: [B, T, D]
        f, a, b = self.form, torch.sigmoid(self.wa(x)), self.wb(x)
        if f in ("accel", "accel_excl"):
            h = accel_scan(a.transpose(1, 2), b.transpose(1, 2), f == "accel_excl").transpose(1, 2)
        elif f == "gateloop":  # a [B, T, D, 1] against kv [B, T, D, 2]
            kv = b[..., None] * self.h0
            h = gl_associative_scan(binary_operator, (a[..., None], kv), axis=1)[1].sum(-1)
        elif f == "gateloop_h0":
            ones = torch.ones_like(a[:, :1])
            h0 = self.h0[:, 0].expand(x.shape[0], 1, D)
            h = gl_associative_scan(binary_operator, (torch.cat([ones, a], 1), torch.cat([h0, b], 1)), axis=1)[1]
            h = h[:, 1:]
        elif f == "gateloop_complex":
            a = a * torch.exp(1j * self.wp(x))
            h = gl_associative_scan(binary_operator, (a, b + 0j), axis=1)[1]
            h = torch.cat([h.real, h.imag], -1)
        elif f in ("wrong", "max"):
            op = wrong_operator if f == "wrong" else max_operator
            h = gl_associative_scan(op, (a, b), axis=1)[1]
        elif f == "transformers":  # [B, D, T, 2] along dim 2, as transformers' Mamba
            dA = a.transpose(1, 2)[..., None].expand(-1, -1, -1, 2)
            dBu = b.transpose(1, 2)[..., None] * self.h0[:, None, :]
            h = associative_scan(hf_combine_fn, (dA, dBu), dim=2, combine_mode="generic")[1]
            h = h.sum(-1).transpose(1, 2)
        else:
            raise AssertionError(f)
        y = self.out(h[..., :D]) if f != "gateloop_complex" else self.out(h[..., :D]) + h[..., D:]
        return (y ** 2).sum()


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _loss_and_grads(f, model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss = f(x)
    loss.backward()
    return [loss.detach()] + [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                              for p in model.parameters()] + [x.grad.detach().clone()]


def _check(form, T, dtype, seed=0):
    """Compile, compare loss and gradients with eager (fp64 eager for fp32), return the report's result."""
    torch.manual_seed(seed)
    model = Model(form, dtype)
    x = torch.randn(2, T, D, dtype=dtype)
    ref_model = Model(form, torch.float64)
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    want = _loss_and_grads(ref_model, ref_model, x.double())
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=OPTIONS)
    got = _loss_and_grads(f, model, x)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and _rel(g, w) <= tol, (form, T, dtype, i, _rel(g, w))
    res = ac.report(f).compiled[-1]
    # NB: a rewritten forward that differs on the first call falls back to autograd (check_forward): the values
    # above would then be eager's whatever the rewrite did
    assert not res.fallbacks, res.fallbacks
    return res


def _recurrences(res):
    return [r for r in res.regions if r.kind == "linear_recurrence"]


SOURCE = {"accel": "associative_scan", "accel_excl": "associative_scan", "gateloop": "associative_scan",
          "gateloop_h0": "associative_scan", "gateloop_complex": "associative_scan", "transformers": "associative_scan"}


@pytest.mark.parametrize("T", [5, 13, 64, 100])
@pytest.mark.parametrize("form", ["accel", "gateloop", "transformers"])
def test_tree_scan_rewritten_and_exact_fp64(form, T):
    res = _check(form, T, torch.float64)
    recs = _recurrences(res)
    assert [(r.source, r.rewrite, r.length) for r in recs] == [(SOURCE[form], "adjoint", T)], str(res.regions)
    assert res.lowered and not res.rejections, res.rejections


@pytest.mark.parametrize("form,T", [("accel", 13), ("accel_excl", 100), ("gateloop", 100), ("gateloop_h0", 13),
                                    ("transformers", 13)])
def test_tree_scan_rewritten_and_exact_fp32(form, T):
    res = _check(form, T, torch.float32)
    assert [(r.source, r.rewrite) for r in _recurrences(res)] == [(SOURCE[form], "adjoint")], str(res.regions)


@pytest.mark.parametrize("form", ["accel_excl", "gateloop_h0"])
def test_tree_scan_variants_fp64(form):
    res = _check(form, 64, torch.float64)
    (r,) = _recurrences(res)
    assert (r.source, r.rewrite, r.length) == (SOURCE[form], "adjoint", 64)
    if form == "gateloop_h0":  # the prepended step is the scan's h0, not a step of it
        assert r.details["h0"] is not None


@pytest.mark.parametrize("form", ["accel", "gateloop", "transformers"])
def test_one_step_has_nothing_to_scan(form):
    """T = 1: the recursion stops at once (no combine runs): nothing to recognize, the same values."""
    res = _check(form, 1, torch.float64)
    assert not _recurrences(res) and not res.lowered


@pytest.mark.parametrize("complex_op", ["as installed", "real only"])
def test_complex_tree_scan_exact(complex_op, monkeypatch):
    """gateloop's complex a and kv: recognized; rewritten when linear_scan takes complex, else (a linear_scan
    without complex dtypes, simulated by "real only") a rejection that says so. Either way the loss and gradients
    are eager's."""
    from adjoint_compile.passes.capture import scan_forms

    if complex_op == "real only":
        monkeypatch.setattr(scan_forms, "_complex_scans", lambda: False)
    res = _check("gateloop_complex", 13, torch.float64)
    recs = _recurrences(res)
    if scan_forms._complex_scans():
        assert [(r.source, r.rewrite) for r in recs] == [("associative_scan", "adjoint")], str(res.regions)
    else:
        assert not [r for r in recs if r.rewrite != "none"] and not res.lowered
        (j,) = [j for j in res.rejections if "tree scan" in j.reason]
        assert "proven a linear scan, not rewritten: its values are complex" in j.reason, j.reason


@pytest.mark.parametrize("form,why", [("wrong", "no value computed from them equals their linear scan"),
                                      ("max", "the tree is read by maximum")])
def test_a_tree_that_is_not_a_linear_scan_is_rejected_and_exact(form, why):
    res = _check(form, 13, torch.float64)
    assert not [r for r in _recurrences(res) if r.rewrite != "none"] and not res.lowered
    assert any(j.reason.startswith("tree scan over") and why in j.reason for j in res.rejections), res.rejections


def test_a_combine_off_by_one_part_in_a_million_is_rejected():
    """The proof compares values to 1e-9: a combine ``a_j * kv_i * (1 + 1e-6) + kv_j`` is not the scan."""
    from adjoint_compile.passes.match.find_tree_scans import find_tree_scans
    from helpers import trace

    def close(e_i, e_j):
        return e_j[0] * e_i[0], e_j[0] * e_i[1] * (1 + 1e-6) + e_j[1]

    args = torch.rand(2, 13, D, dtype=torch.float64), torch.randn(2, 13, D, dtype=torch.float64)
    for op, found in ((binary_operator, 1), (close, 0)):
        forms, rejected = find_tree_scans(trace(lambda a, b: gl_associative_scan(op, (a, b), axis=1)[1], *args))
        assert (len(forms), len(rejected)) == (found, 1 - found), (op.__name__, rejected)
    assert "rel. error" in rejected[0].reason


# ----------------------------------------------------------------------------------------------------------------
# register_scan on a plain function: dynamo would inline it, so registering keeps its calls whole


def loop_scan(a, b, h0):
    """A library's scan as a plain function: h_t = a_t h_{t-1} + b_t along dim 1."""
    hs, h = [], h0
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, 1)


class LoopModel(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.wa, self.wb, self.out = fn, nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.fn(torch.sigmoid(self.wa(x)), self.wb(x), x[:, 0] * 0.5)
        return (self.out(h) ** 2).sum()


def _loop_report(fn, T=11):
    torch.manual_seed(0)
    model = LoopModel(fn)
    x = torch.randn(2, T, D)
    want = _loss_and_grads(model, model, x)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=OPTIONS)
    got = _loss_and_grads(f, model, x)
    for g, w in zip(got, want):
        assert _rel(g, w) <= 1e-5
    res = ac.report(f).compiled[-1]
    assert not res.fallbacks
    return _recurrences(res)


@pytest.fixture
def registered_loop_scan():
    ac.register_scan(loop_scan, ac.ScanAdapter(a=0, b=1, h0=2, dim=1))
    yield
    ac.unregister_scan(loop_scan)


def test_a_registered_plain_function_is_kept_whole_and_replaced(registered_loop_scan):
    (r,) = _loop_report(loop_scan)
    assert (r.source, r.rewrite) == ("registered_scan", "adjoint")
    assert r.details["implementation"] == f"{__name__}.loop_scan"
    ac.unregister_scan(loop_scan)  # dynamo inlines it again: the unrolled loop is re-rolled instead
    (r,) = _loop_report(loop_scan)
    assert r.source == "unrolled_loop"


def test_register_scan_refuses_what_it_cannot_keep_whole():
    with pytest.raises(TypeError, match="plain Python function"):
        ac.register_scan(partial(loop_scan), ac.ScanAdapter(a=0, b=1, h0=2))
    with pytest.raises(TypeError, match="plain Python function"):
        ac.register_scan(nn.Linear(2, 2), ac.ScanAdapter(a=0, b=1))


def test_a_plain_function_registered_by_name_before_its_import_warns_then_works():
    import sys
    import types

    mod = types.ModuleType("_tree_scans_lazy_lib")
    exec("import torch\n" + "\n".join(
        ln for ln in __import__("inspect").getsource(loop_scan).splitlines() if not ln.lstrip().startswith('"""')),
        mod.__dict__)
    ac.register_scan("_tree_scans_lazy_lib.loop_scan", ac.ScanAdapter(a=0, b=1, h0=2, dim=1))
    try:
        sys.modules[mod.__name__] = mod  # imported after it was registered
        with pytest.warns(UserWarning, match="registered by name before its module was imported"):
            (r,) = _loop_report(mod.loop_scan)
        assert r.source == "unrolled_loop"  # this compile inlined it
        (r,) = _loop_report(mod.loop_scan)  # the next one keeps it whole
        assert (r.source, r.rewrite) == ("registered_scan", "adjoint")
    finally:
        ac.unregister_scan("_tree_scans_lazy_lib.loop_scan")
        sys.modules.pop(mod.__name__, None)
