"""Packed sequences: documents packed into one row with the state reset at each document's first token (the decay
multiplied by 1 - reset_t) are an ordinary linear recurrence, sharded exactly wherever the shard boundaries fall
relative to the documents'. The packed row's gradients equal those of each document run on its own through the
eager model (fp64, to 1e-9), and the report says the region resets its state (analysis/resets.py)."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack, resets_from_cu_seqlens, resets_from_position_ids
from adjoint_compile.ops import linear_scan

TOL = 1e-9
D = 4


def _model(layers: int = 2) -> SSMStack:
    """fp64, parameters moved off their initial values (the final RMSNorm's weight of ones would make the sum of
    squares of the output a constant)."""
    torch.manual_seed(0)
    model = SSMStack(d_model=D, d_state=2, n_layers=layers).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _unpacked_grads(model: SSMStack, x: torch.Tensor, rows: list[list[int]], wrt: list[torch.Tensor]):
    """The reference: every document of every row through the eager model on its own (its state starts at zero),
    combined as the packed loss combines them: mean over the packed [B, T, D] output = Σ_docs Σ y² / numel."""
    loss = 0.0
    for b, lens in enumerate(rows):
        cu = _cu(lens)
        for s, n in zip(cu, lens):
            loss = loss + model(x[b:b + 1, s:s + n]).square().sum()
    return torch.autograd.grad(loss / x.numel(), wrt)


def _packed(model: SSMStack, S: int):
    def step(x, reset):
        return model(x, reset).square().mean()
    return torch.compile(step, backend="adjoint", options={"shard_size": S, "inner": "aot_eager"})


def _check(got, want) -> None:
    for g, w in zip(got, want):
        assert (g - w).norm() <= TOL * w.norm(), ((g - w).norm() / w.norm()).item()


CASES = [
    (4, [[4, 3, 5, 1, 7]]),           # boundaries at 4 (= a shard's), 7 (before 8), 12 (at), 13 (after); a 1-step document
    (4, [[5, 4, 4]]),                 # every boundary one step after a shard boundary
    (4, [[1, 1, 2, 8, 3]]),           # documents shorter than a shard, two in one shard
    (3, [[2, 7, 1, 4]]),              # shard_size 3: boundaries inside shards
    (4, [[13]]),                      # one document: no reset but the first step
    (4, [[4, 3, 6], [1, 9, 3]]),      # two rows with different documents
]


@pytest.mark.parametrize("S,rows", CASES, ids=[f"S{S}-" + "_".join("-".join(map(str, r)) for r in rows)
                                               for S, rows in CASES])
def test_packed_row_gradients_equal_the_unpacked_documents(S, rows):
    model = _model()
    T = sum(rows[0])
    assert all(sum(r) == T for r in rows)
    x = torch.randn(len(rows), T, D, dtype=torch.float64, requires_grad=True)
    reset = torch.stack([resets_from_cu_seqlens(_cu(r), T) for r in rows])
    wrt = [x, *model.parameters()]
    step = _packed(model, S)
    got = torch.autograd.grad(step(x, reset), wrt)
    _check(got, _unpacked_grads(model, x, rows, wrt))
    rep = ac.report(step)
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(scans) == 2 and all(r.rewrite == "adjoint" for r in scans), rep
    assert all(r.details["shard_size"] == S for r in scans)
    for r in scans:
        assert "resets the state at document boundaries (2 mask(s))" in r.reason, r.reason
        assert [(d["mask"], d["form"]) for d in r.details["resets"]] == [("reset", "a * (1 - r)")] * 2
    assert "resets the state at document boundaries" in str(rep)


def test_float_resets_and_position_ids_give_the_same_gradients():
    """Resets as 0/1 floats, and from restarting position ids (transformers' DataCollatorWithFlattening)."""
    model = _model(layers=1)
    lens = [3, 6, 2, 5]
    T = sum(lens)
    x = torch.randn(1, T, D, dtype=torch.float64)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    reset = resets_from_position_ids(position_ids)
    assert torch.equal(reset[0], resets_from_cu_seqlens(_cu(lens), T))
    want = _unpacked_grads(model, x, [lens], list(model.parameters()))
    step = _packed(model, 4)
    for r in (reset, reset.double()):
        _check(torch.autograd.grad(step(x, r), list(model.parameters())), want)


def test_the_default_is_unchanged():
    model = _model(layers=1)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    assert torch.equal(model(x), model(x, None))
    assert torch.equal(model(x, torch.zeros(2, 9, dtype=torch.bool)), model(x))
    rep = ac.explain(model, x, options={"shard_size": 4})
    scans = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert scans and all(r.rewrite == "adjoint" and "resets" not in r.details and "document" not in r.reason
                         for r in scans), rep


def test_resets_from_cu_seqlens():
    assert resets_from_cu_seqlens([0, 4, 7], 10).nonzero().flatten().tolist() == [0, 4, 7]
    # NB: the row's end and padding past the last document start nothing
    assert resets_from_cu_seqlens(torch.tensor([0, 4, 10]), 10).nonzero().flatten().tolist() == [0, 4]
    assert resets_from_cu_seqlens([0, 3, 12], 8).dtype == torch.bool
    with pytest.raises(ValueError, match="non-decreasing"):
        resets_from_cu_seqlens([0, 5, 3], 8)


# --- which forms are found --------------------------------------------------------------------------------------

W = torch.randn(D, D, dtype=torch.float64) / 2


def _a(x):
    return torch.sigmoid(x @ W)


FORMS = {
    "1 - r": (lambda x, r: linear_scan(_a(x) * (1 - r.to(x.dtype))[..., None], x), "a * (1 - r)"),
    "1.0 - r.float()": (lambda x, r: linear_scan((1.0 - r.float()).double()[..., None] * _a(x), x), "a * (1 - r)"),
    "~m": (lambda x, r: linear_scan(_a(x) * (~r)[..., None], x), "a * ~m"),
    "where(m, 0, a)": (lambda x, r: linear_scan(torch.where(r[..., None], 0.0, _a(x)), x), "where(m, 0, a)"),
    "where(keep, a, 0)": (lambda x, r: linear_scan(torch.where(~r[..., None], _a(x), 0.0), x), "where(keep, a, 0)"),
    "masked_fill": (lambda x, r: linear_scan(_a(x).masked_fill(r[..., None], 0.0), x), "masked_fill(a, m, 0)"),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_reset_forms_are_found_and_exact(form):
    fn, want = FORMS[form]
    lens = [3, 5, 1, 4]
    T = sum(lens)
    x = torch.randn(2, T, D, dtype=torch.float64, requires_grad=True)
    r = resets_from_cu_seqlens(_cu(lens), T).expand(2, T).contiguous()
    rep = ac.explain(fn, x, r, options={"shard_size": 4})
    regions = [g for g in rep.regions if g.kind == "linear_recurrence"]
    assert regions and regions[0].rewrite == "adjoint", rep
    assert [d["form"] for d in regions[0].details["resets"]] == [want], regions[0].details
    step = torch.compile(lambda x, r: fn(x, r).square().sum(), backend="adjoint",
                         options={"shard_size": 4, "inner": "aot_eager"})
    _check(torch.autograd.grad(step(x, r), [x]), torch.autograd.grad(fn(x, r).square().sum(), [x]))


def test_a_mask_from_position_ids_in_the_graph_is_found():
    lens = [4, 2, 6]
    pos = torch.cat([torch.arange(n) for n in lens])[None].expand(2, -1)
    x = torch.randn(2, sum(lens), D, dtype=torch.float64)
    rep = ac.explain(lambda x, pos: linear_scan(_a(x) * (pos != 0)[..., None], x), x, pos, options={"shard_size": 4})
    assert rep.regions[0].details["resets"] == [{"scan": rep.regions[0].details["resets"][0]["scan"],
                                                 "mask": "pos", "form": "a * m"}], rep.regions[0].details


@pytest.mark.parametrize("decay", ["gate", "float_input"])
def test_no_reset_is_reported_for_ordinary_decays(decay):
    """1 - sigmoid(...) and a float input multiplied in are not masks."""
    x = torch.randn(2, 12, D, dtype=torch.float64)
    w = torch.rand(2, 12, D, dtype=torch.float64)
    if decay == "gate":
        def fn(x, w):
            return linear_scan(1 - torch.sigmoid(x @ W), x)
    else:
        def fn(x, w):
            return linear_scan(_a(x) * w, x)
    rep = ac.explain(fn, x, w, options={"shard_size": 4})
    assert rep.regions and all("resets" not in g.details for g in rep.regions), [g.details for g in rep.regions]


def test_pad_of_a_shifted_comparison_is_a_mask():
    """seq_idx (mamba_ssm's document index per token): a document starts where it changes, a comparison of the
    ids with their shift; the mask is the comparison (a boolean value), whatever made its inputs."""
    lens = [5, 3, 4]
    seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None].expand(2, -1)
    x = torch.randn(2, sum(lens), D, dtype=torch.float64)

    def fn(x, seq_idx):
        prev = F.pad(seq_idx, (1, 0), value=-1)[:, :-1]
        return linear_scan(_a(x) * (seq_idx == prev)[..., None], x)
    rep = ac.explain(fn, x, seq_idx, options={"shard_size": 4})
    resets = rep.regions[0].details.get("resets")
    assert resets and resets[0]["form"] == "a * m", rep.regions[0].details


@pytest.mark.slow
def test_the_example_trains_and_checks_its_gradients(capsys):
    """examples/packed_sequences.py (inductor: ~50 s on 2 cores)."""
    runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "packed_sequences.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "resets the state at document boundaries (2 mask(s))" in out and "max relative error" in out, out
