"""Sequence parallelism across processes (``options={"sequence_parallel": group}``; runtime/seqpar.py).

Each test spawns a few CPU processes on gloo (``torch.multiprocessing``, spawn start method), each holding one
contiguous slice of the same sequence; every rank writes what it got to a file, and the parent compares with an
oracle it computes itself: plain eager autograd of the whole sequence (exact mode), or the same model with every
scan state recomputed from the state W steps back, detached (truncated mode; an explicit loop over steps).
Slices are uneven and include one of a single step, shorter than the conv's halo.  Exact mode shards each region
inside the rank (runtime/seqpar_sharded.py); ``shard_size=3`` makes shards shorter than the slices, and a mutation
that drops the adjoint carry from the ranks after must break rank 0's gradients. Spawns are few: each costs
seconds (dynamo compiles every model in every process; ``inner="aot_eager"`` skips inductor).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp

import adjoint_compile as ac
from adjoint_compile.runtime import seqpar_sharded
from helpers import StepLoop

ROOT = Path(__file__).resolve().parent.parent
B, D, N = 2, 6, 2
W = 3  # truncated mode's window: shorter than the longest slice, longer than the shortest


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(name):
    torch.manual_seed(0)
    if name == "selective_ssm":
        return _example("selective_ssm").SSMStack(d_model=D, d_state=N, n_layers=2)
    return _example("mamba_conv").MambaStack(d_model=D, d_state=N, n_layers=2)


def _data(T):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


class _TimeMean(torch.nn.Module):
    """Mixes steps across the whole sequence: a mean over time, subtracted from every step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return y - y.mean(dim=1, keepdim=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, timeout_s):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _run_case(name, mode, x, w):
    model = _model(name)
    opts = {"sequence_parallel": True, "inner": "aot_eager", "mode": "exact" if mode != "truncated" else mode}
    if mode in ("exact_s3", "no_carry"):  # sharded inside the rank: shards shorter than the slices
        opts["shard_size"] = 3
    if mode == "no_reduce":
        opts["reduce_grads"] = False
    if mode == "truncated":
        opts["window"] = W
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=opts)
    x = x.clone().requires_grad_()
    fold = seqpar_sharded._fold_backward
    if mode == "no_carry":  # the mutation: the adjoint carry from the ranks after is dropped
        seqpar_sharded._fold_backward = lambda g, r, w: torch.zeros_like(g[0, 1])
    try:
        y = f(x)
        (y * w).sum().backward()
    finally:
        seqpar_sharded._fold_backward = fold
    return {"y": y.detach(), "x_grad": x.grad, **{k: p.grad for k, p in model.named_parameters()}}


@contextlib.contextmanager
def _rank_errors(rank, out_dir):
    """Leaves this rank's error in ``out_dir`` for the parent to read, and the process group in any case."""
    try:
        yield
    except BaseException:  # noqa: BLE001 - the parent reads it
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank, world, port, lengths, cases, out_dir):
    with _rank_errors(rank, out_dir):
        _init(rank, world, port, 30)
        x, w = _data(sum(lengths))
        o = sum(lengths[:rank])
        sl = slice(o, o + lengths[rank])
        res = {}
        for name, mode in cases:
            res[(name, mode)] = _run_case(name, mode, x[:, sl], w[:, sl])
        rep = ac.explain(_model("mamba_conv"), x[:, sl], options={"sequence_parallel": True, "inner": "eager"})
        rep_t = ac.explain(_model("mamba_conv"), x[:, sl], options={"sequence_parallel": True, "inner": "eager",
                                                                      "mode": "truncated", "window": W})
        res["explain"] = ([(r.rewrite, r.reason) for r in rep.regions if r.kind == "linear_recurrence"],
                          [r.reason for r in rep_t.regions if r.kind == "linear_recurrence"],
                          [j.reason for j in rep.rejections + rep_t.rejections])
        torch._dynamo.reset()
        f = torch.compile(_TimeMean(), backend="adjoint", options={"sequence_parallel": True, "inner": "eager"})
        try:
            f(x[:, sl])
            res["mixing"] = "no error"
        except ac.SequenceParallelError as e:
            res["mixing"] = str(e)
        torch._dynamo.reset()
        torch.manual_seed(0)
        other = _example("selective_ssm").SSMStack(d_model=D, d_state=N + (rank == 1), n_layers=1)
        f = torch.compile(other, backend="adjoint", options={"sequence_parallel": True, "inner": "eager"})
        try:
            f(x[:, sl])
            res["disagree"] = "no error"
        except ac.SequenceParallelError as e:
            res["disagree"] = str(e)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(target, world, args, timeout):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s"


def _trunc_scan(a, b, h0=None, dim=1, **kw):
    """Oracle of the truncated adjoint: h_t recomputed from h_{t-W} detached (from zero when t - W < 0)."""
    assert h0 is None and dim == 1 and not kw
    T = a.shape[1]
    hs, exact = [], []
    h = torch.zeros_like(b[:, 0])
    for t in range(T):
        h = a[:, t] * h + b[:, t]
        exact.append(h)
    for t in range(T):
        s = exact[t - W].detach() if t - W >= 0 else torch.zeros_like(b[:, 0])
        for i in range(max(0, t - W + 1), t + 1):
            s = a[:, i] * s + b[:, i]
        hs.append(s)
    return torch.stack(hs, 1)


def _oracle(name, mode, x, w, monkeypatch):
    model = _model(name)
    with monkeypatch.context() as m:
        if mode == "truncated":
            m.setattr(ac.ops, "linear_scan", _trunc_scan)
        x = x.clone().requires_grad_()
        y = model(x)
        (y * w).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, **{k: p.grad for k, p in model.named_parameters()}}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


CASES = [("selective_ssm", "exact"), ("mamba_conv", "exact"), ("selective_ssm", "truncated"),
         ("mamba_conv", "truncated")]


@pytest.mark.parametrize("lengths", [[1, 6, 4], [7, 4]], ids=["world3_uneven_one_step", "world2_uneven"])
@pytest.mark.slow
def test_outputs_and_gradients_equal_the_single_process_run(lengths, tmp_path, monkeypatch):
    world = len(lengths)
    # NB: 3 ranks on 2 cores compile slowly: the truncated selective SSM (no halo) runs at 2 ranks only
    cases = CASES + [("selective_ssm", "no_reduce"), ("selective_ssm", "no_carry")] if world == 2 else [
        c for c in CASES if c != CASES[2]]
    cases += [("selective_ssm", "exact_s3")]
    _spawn(_worker, world, (_port(), lengths, cases, str(tmp_path)), timeout=240)
    errs = sorted(tmp_path.glob("*.err"))
    assert not errs, errs[0].read_text()
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    x, w = _data(sum(lengths))
    if world == 2:  # reduce_grads=False: each rank keeps the gradient of its own part of the loss
        ref = _oracle("selective_ssm", "exact", x, w, monkeypatch)
        local = [g[("selective_ssm", "no_reduce")] for g in got]
        for k in ref:
            if k not in ("y", "x_grad"):
                assert _rel(local[0][k] + local[1][k], ref[k]) < 1e-5, k
                assert _rel(local[0][k], ref[k]) > 1e-3, k
    if world == 2:  # the mutation check: without the adjoint carry from rank 1, rank 0's gradients are wrong
        ref = _oracle("selective_ssm", "exact", x, w, monkeypatch)
        assert _rel(got[0][("selective_ssm", "no_carry")]["x_grad"], ref["x_grad"][:, :lengths[0]]) > 1e-3
        assert _rel(got[0][("selective_ssm", "no_carry")]["y"], ref["y"][:, :lengths[0]]) < 1e-5
    for case in [c for c in cases if c[1] not in ("no_reduce", "no_carry")]:
        ref = _oracle(case[0], "exact" if case[1] == "exact_s3" else case[1], x, w, monkeypatch)
        for key in ("y", "x_grad"):
            full = torch.cat([g[case][key] for g in got], 1)
            assert _rel(full, ref[key]) < 1e-5, (case, key, _rel(full, ref[key]))
        for k in ref:
            if k in ("y", "x_grad"):
                continue
            for r in range(world):  # every rank holds the whole sequence's gradient, with no call of the user's
                assert _rel(got[r][case][k], ref[k]) < 1e-5, (case, k, r, _rel(got[r][case][k], ref[k]))
    # the truncated oracle differs from the exact one here: the window matters at these sizes
    ex, tr = _oracle("selective_ssm", "exact", x, w, monkeypatch), _oracle("selective_ssm", "truncated", x, w,
                                                                           monkeypatch)
    assert _rel(tr["layers.0.A_log"], ex["layers.0.A_log"]) > 1e-3
    for g in got:  # refused on every rank, naming the op and its source line
        msg = g["mixing"]
        assert "mean" in msg and "test_lower_seqpar.py" in msg and "y.mean(dim=1, keepdim=True)" in msg, msg
        assert "disagree on the model" in g["disagree"], g["disagree"]
        exact, trunc, rejected = g["explain"]  # explain() says what the ranks run, and refuses nothing here
        # exact mode: one-scan regions sharded inside the rank; truncated: distributed scans, ordinary autograd
        assert exact and all(rw == "adjoint" and "sharded" in r for rw, r in exact), exact
        assert trunc and all(r.startswith("sequence_parallel: each scan runs as the distributed scan") for r in
                             trunc), trunc
        assert not any("sequence_parallel" in j for j in rejected), rejected


def _dies_worker(rank, world, port, out_dir):
    try:
        _init(rank, world, port, 6)
        torch.manual_seed(0)
        model = _model("selective_ssm")
        f = torch.compile(model, backend="adjoint", options={"sequence_parallel": True, "inner": "eager"})
        if rank == 1:
            try:
                raise ValueError("rank 1 fails before its first step")
            except ValueError as e:
                Path(out_dir, "rank1.txt").write_text(str(e))
                time.sleep(12)  # NB: stuck, not gone: rank 0 can only learn it from the group's timeout
                return
        t0 = time.monotonic()
        try:
            f(torch.randn(B, 5, D)).sum().backward()
            res = "no error"
        except Exception:  # noqa: BLE001
            res = f"raised after {time.monotonic() - t0:.1f} s"
        Path(out_dir, f"rank{rank}.txt").write_text(res)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_that_raises_makes_the_others_fail_within_the_group_timeout(tmp_path):
    _spawn(_dies_worker, 2, (_port(), str(tmp_path)), timeout=90)
    assert (tmp_path / "rank1.txt").read_text() == "rank 1 fails before its first step"
    got = (tmp_path / "rank0.txt").read_text()
    assert got.startswith("raised after"), got
    assert float(got.split()[2]) < 11, got  # the group's timeout is 6 s; rank 1 stays stuck for 12 s


@pytest.mark.slow
def test_the_example_runs_under_torchrun(tmp_path):
    """examples/sequence_parallel.py at a tiny size, launched as docs/sequence-parallel.md says (torchrun, two processes)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "sequence_parallel.py"), "--seq-len", "37", "--steps", "2", "--inner", "eager"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| one process | 37 |" in out.stdout and "| rank 1 of 2 | 18 |" in out.stdout, out.stdout


def test_option_reduce_grads_is_validated():
    with pytest.raises(ac.OptionsError, match="'reduce_grads'=1 .*True or False"):
        ac.validate_options({"reduce_grads": 1})
    assert ac.validate_options({"reduce_grads": False}).reduce_grads is False
    assert ac.validate_options({}).reduce_grads is True


def test_per_sample_clip_with_sequence_parallel_is_refused(tmp_path):
    # NB: a rank holds part of every example's gradient, so clipping per rank would not be the clipped sum
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(ac.OptionsError, match="'per_sample_clip'=1.0 .*sequence_parallel"):
            ac.validate_options({"sequence_parallel": True, "per_sample_clip": 1.0})
        assert ac.validate_options({"sequence_parallel": False, "per_sample_clip": 1.0}).per_sample_clip == 1.0
    finally:
        dist.destroy_process_group()


class _Eager(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    @torch._dynamo.disable
    def forward(self, x):
        return self.lin(x)


class _WithEagerPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid = nn.Linear(6, 6), _Eager()

    def forward(self, x):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), x)
        return self.mid(h)


def test_a_parameter_used_outside_every_compiled_graph_warns(tmp_path):
    """Under sequence_parallel a submodule dynamo runs eagerly (torch._dynamo.disable) gets this rank's share of
    its parameters' gradient only: nothing reduced it (found by probing: relative errors 0.45-0.76 on two ranks,
    silently). It warns, naming the parameter; the compiled graph's own parameters do not."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = _WithEagerPart()
        f = torch.compile(model, backend="adjoint", options={"sequence_parallel": True, "inner": "aot_eager"})
        with pytest.warns(ac.AdjointCompileWarning) as rec:
            f(torch.randn(2, 8, 6)).sum().backward()
        said = [str(w.message) for w in rec if "outside every compiled graph" in str(w.message)]
        assert sorted(m.split()[4] for m in said) == ["mid.lin.bias", "mid.lin.weight"], said
    finally:
        dist.destroy_process_group()


def _views_worker(rank, world, port, out_dir):
    with _rank_errors(rank, out_dir):
        _init(rank, world, port, 30)
        model = _model("selective_ssm")
        f = torch.compile(model, backend="adjoint", dynamic=True,
                          options={"sequence_parallel": True, "inner": "aot_eager", "shard_size": 2})
        grads = []
        for lengths in ([4, 4], [5, 3]):
            x, w = _data(sum(lengths))
            o = sum(lengths[:rank])
            model.zero_grad()
            (f(x[:, o:o + lengths[rank]]) * w[:, o:o + lengths[rank]]).sum().backward()  # NB: views, as written
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_slices_passed_as_views_under_dynamic_shapes(tmp_path):
    """A rank's slice x[:, 4:8] is a view with a storage offset, which dynamo passes as an input of its own under
    dynamic shapes: the ranks' fingerprints differed and every step raised 'the ranks disagree on the model' (found
    by probing). Every rank's gradients equal the single-process run's at two sets of lengths."""
    _spawn(_views_worker, 2, (_port(), str(tmp_path)), timeout=240)
    errs = sorted(tmp_path.glob("rank*.err"))
    assert not errs, errs[0].read_text()
    for lengths, got0, got1 in zip(([4, 4], [5, 3]), *(torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))):
        model = _model("selective_ssm")
        x, w = _data(sum(lengths))
        (model(x) * w).sum().backward()
        for k, p in model.named_parameters():
            for got in (got0, got1):
                assert _rel(got[k], p.grad) < 1e-5, (lengths, k, _rel(got[k], p.grad))


def _loop_from_a_step() -> nn.Module:
    torch.manual_seed(0)
    return StepLoop(D)


def _loop_worker(rank, world, port, out_dir):
    with _rank_errors(rank, out_dir):
        _init(rank, world, port, 30)
        model = _loop_from_a_step().double()
        f = torch.compile(model, backend="adjoint", options={"sequence_parallel": True, "inner": "aot_eager",
                                                             "shard_size": 2})
        x, w = (t.double() for t in _data(9))
        sl = slice(0, 5) if rank == 0 else slice(5, 9)
        (f(x[:, sl]) * w[:, sl]).sum().backward()
        rewrites = [r.rewrite for r in ac.report(f).regions]
        torch.save(({k: p.grad for k, p in model.named_parameters()}, rewrites), os.path.join(out_dir,
                                                                                             f"rank{rank}.pt"))


@pytest.mark.slow
def test_a_loop_whose_first_state_is_made_like_a_step(tmp_path):
    """The slice `b[:, 0]` read only for its shape (a loop's zero first state) picks a step, but no values: the graph
    was refused ("indexing a single step"), and its region's reason in report() was empty. Both ranks' gradients
    equal the single-process run's."""
    _spawn(_loop_worker, 2, (_port(), str(tmp_path)), timeout=240)
    errs = sorted(tmp_path.glob("rank*.err"))
    assert not errs, errs[0].read_text()
    model = _loop_from_a_step().double()
    x, w = (t.double() for t in _data(9))
    (model(x) * w).sum().backward()
    for r in (0, 1):
        got, rewrites = torch.load(tmp_path / f"rank{r}.pt")
        assert rewrites == ["adjoint"], rewrites
        for k, p in model.named_parameters():
            assert _rel(got[k], p.grad) < 1e-12, (r, k, _rel(got[k], p.grad))


class _ScanThenTimeMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        h = ac.ops.linear_scan(torch.sigmoid(self.a(x)), x)
        return h - h.mean(dim=1, keepdim=True)


def test_the_regions_of_a_refused_graph_say_why(tmp_path):
    """The recurrence of a graph refused for sequence parallelism had an empty reason in report()."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        f = torch.compile(_ScanThenTimeMean(), backend="adjoint", options={"sequence_parallel": True,
                                                                           "inner": "aot_eager"})
        with pytest.raises(ac.SequenceParallelError, match="mean over the step dim"):
            f(torch.randn(2, 8, D))
        (r,) = ac.report(f).regions
        assert r.rewrite == "none" and r.reason.startswith("not lowered: sequence_parallel: mean"), r.reason
    finally:
        dist.destroy_process_group()
