"""Shard programs replayed from captured graphs (runtime/graphed.py). On a GPU a replay writes its results into the
same tensors every call; on CPU the stand-in ``replay_on_cpu`` does the same, so a sweep that kept a result across
calls (a carried state, an adjoint, a chunk's gradient) would give wrong gradients here. Against eager autograd in
fp64, over two steps with different data (the second replays the graphs the first captured) and two more lengths."""
from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.runtime import graphed, loss_tail
from test_lower_lm_loss import LM, V, _accumulated_matches, _data, _step_matches


@pytest.fixture
def stand_in(monkeypatch):
    calls = []

    def counting(fn, static_in):
        replay = graphed.replay_on_cpu(fn, static_in)

        def counted():
            calls.append(fn)
            return replay()
        return counted
    monkeypatch.setattr(graphed, "CPU_STAND_IN", counting)
    real = graphed.graphable

    def graphable(args, inner):
        # NB: aot_eager's programs replayed as inductor's would be: the stand-in's discipline (results overwritten at
        # every call) does not depend on the compiler, whose C++ builds took most of these tests' minutes on CPU
        return real(args, "inductor" if inner == "aot_eager" else inner)
    monkeypatch.setattr(graphed, "graphable", graphable)
    monkeypatch.setattr(loss_tail, "graphable", graphable)
    monkeypatch.setattr(graphed, "_GRAPHED", collections.OrderedDict())
    monkeypatch.setattr(loss_tail, "_SEEN", collections.OrderedDict())
    monkeypatch.setattr(loss_tail, "_LOOPS", collections.OrderedDict())
    return calls


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LM()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(ids).flatten(0, 1), targets.flatten())


# NB: one case with inductor's own programs, the rest with aot_eager's (the stand_in fixture)
@pytest.mark.parametrize("options", [{"shard_size": 4, "inner": "inductor"},
                                     {"shard_size": 5, "mode": "truncated", "window": 64, "inner": "aot_eager"}])
@pytest.mark.slow
def test_replayed_programs_give_autograd_gradients(stand_in, options):
    torch.manual_seed(0)
    model = Step().double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={**options, "cuda_graphs": True})
    # NB: two steps at T = 13, then two more lengths: one graph then serves every length, its programs shared
    for seed, t in ((0, 13), (1, 13), (2, 9), (3, 22)):
        _step_matches(f, model, ref, *_data(seed, t))
    # the forward, the recompute + VJP and the loss chunk programs (per shard length), replayed shard after shard
    assert len(graphed._GRAPHED) >= 3, graphed._GRAPHED
    assert len(stand_in) >= 2 * len(graphed._GRAPHED), len(stand_in)
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)


def test_with_the_option_off_nothing_is_graphed(stand_in):
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = torch.compile(Step().double(), backend="adjoint", options={"shard_size": 4, "inner": "aot_eager",
                                                                   "cuda_graphs": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(*_data()).backward()
    assert not graphed._GRAPHED and not stand_in


def test_only_inductor_programs_on_cuda_are_graphed():
    x = torch.zeros(3)
    assert not graphed.graphable([x, None], "inductor")  # CPU tensors, no stand-in
    assert not graphed.graphable([x], "aot_eager")
    assert not graphed.graphable([None, 1], "inductor")


def test_an_argument_written_without_a_version_bump_is_copied_again(stand_in):
    """Every call copies its (non-parameter) arguments into the graph's inputs, also the very tensor of the last call
    with the same version counter: writes through ``.data`` or numpy do not bump it (a buffer updated by hand, a batch
    refilled in place by a loader), and a replay that skipped the copy used the old values."""
    def fn(w, x):
        return (x @ w,)
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    call = graphed.GraphedCall(fn, [w, x])
    assert torch.equal(call(w, x)[0], x @ w)
    v = w._version
    w.data.copy_(torch.randn(3, 2, dtype=torch.float64))         # no version bump
    assert w._version == v and torch.equal(call(w, x)[0], x @ w)
    x.numpy()[:] = 7.0                                            # nor through numpy
    assert torch.equal(call(w, x)[0], x @ w)
    w.add_(1.0)                                                   # in place, bumped
    assert torch.equal(call(w, x)[0], x @ w)


def test_a_buffer_updated_through_data_between_replays(stand_in):
    """A model's class-weight buffer re-estimated through ``.data`` between steps, with the loss's chunk loop captured
    and replayed: each step's loss and gradients are autograd's with the buffer's values of that step."""
    class Weighted(Step):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("class_w", torch.ones(V))

        def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.lm(ids).flatten(0, 1), targets.flatten(), weight=self.class_w)
    torch.manual_seed(0)
    model = Weighted().double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager", "cuda_graphs": True})
    ids, tg = _data(0, 13)
    for k in range(4):
        if k >= 2:
            w = torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) + 0.5
            model.class_w.data.copy_(w)
            ref.class_w.data.copy_(w)
            tg.numpy()[:] = _data(k, 13)[1].numpy()               # the batch refilled in place too
        _step_matches(f, model, ref, ids, tg)
    assert _loops_captured(stand_in) >= 3


@pytest.mark.slow
def test_training_steps_with_weights_updated_in_place(stand_in):
    """Three optimizer steps (weights updated in place between the replays) against eager training in fp64."""
    model, ref, f = _graphed_step()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for seed in range(3):
        _step_matches(f, model, ref, *_data(seed, 13))
        for o in opts:
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12)


def test_a_parameter_is_read_in_place_and_another_runs_as_compiled(stand_in):
    """A parameter is the graph's own input (not cloned, updates seen without a copy); a call with another parameter
    in its place, or the same one moved to other memory (as FSDP2 does), runs the program as compiled."""
    calls = []

    def fn(w, x):
        calls.append(1)
        return (x @ w,)
    w = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    x = torch.randn(4, 3, dtype=torch.float64)
    call = graphed.GraphedCall(fn, [w, x])
    assert call.static_in[0] is w
    with torch.no_grad():
        w.mul_(3.0)
    assert torch.equal(call(w, x)[0], x @ w)
    other = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    n = len(stand_in)
    assert torch.equal(call(other, x)[0], x @ other) and len(stand_in) == n   # not replayed
    w.data = w.data.clone()                                                       # same object, other memory
    assert torch.equal(call(w, x)[0], x @ w) and len(stand_in) == n


def _graphed_step():
    """A Step in fp64, its eager copy, and it compiled with CUDA graphs (the CPU stand-in) and shards of 4."""
    torch.manual_seed(0)
    model = Step().double()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager", "cuda_graphs": True})
    return model, ref, f


def _loops_captured(calls) -> int:
    return sum(1 for fn in calls if fn.__name__ == "loop")


def test_graphs_kept_are_bounded_and_an_idle_one_is_dropped(stand_in, monkeypatch):
    """Lengths that keep changing make a program per shorter last shard: a graph idle for IDLE_CALLS calls is dropped
    (its outputs and pool memory go) and captured again if called later; past MAX_GRAPHS a new program runs as
    compiled. Every step exact against autograd."""
    monkeypatch.setattr(graphed, "MAX_GRAPHS", 3)
    monkeypatch.setattr(graphed, "IDLE_CALLS", 4)
    captures = []
    real = graphed.captured

    def counting(fn, args, what):
        captures.append(fn)
        return real(fn, args, what)
    monkeypatch.setattr(graphed, "captured", counting)
    model, ref, f = _graphed_step()
    for seed, t in ((0, 13), (1, 10), (2, 13), (3, 7), (4, 13)):
        _step_matches(f, model, ref, *_data(seed, t))
        assert len(graphed._GRAPHED) <= 3, graphed._GRAPHED
    # NB: the full-shard programs serve every length: dropped while idle, they are captured again
    assert len(captures) > len(set(map(id, captures))), captures


@pytest.mark.slow
def test_the_loss_chunk_loop_is_one_graph_from_the_second_call(stand_in):
    """The loss's whole loop over its chunks is one graph: captured at the second call with a length (the first
    compiles the chunks' programs) and replayed after, each replay exact against autograd; a length seen once is not
    captured."""
    model, ref, f = _graphed_step()
    _step_matches(f, model, ref, *_data(0, 13))
    assert _loops_captured(stand_in) == 0
    for seed in (1, 2):
        _step_matches(f, model, ref, *_data(seed, 13))
    # the stand-in's calls: one at the capture, one per replay (the second call's and the third's)
    assert _loops_captured(stand_in) == 3, [fn.__name__ for fn in stand_in]
    n = _loops_captured(stand_in)
    _step_matches(f, model, ref, *_data(3, 11))                       # a new length: run chunk by chunk
    assert _loops_captured(stand_in) == n


def test_two_forwards_before_one_backward_keep_their_own_loss_gradients(stand_in):
    """Gradient accumulation over two micro-batches of one length: the second replay of the loop overwrites its
    results, so each forward must have copied out the gradients it keeps."""
    model, ref, f = _graphed_step()
    for seed in (0, 1):                                               # the loop captured at the second call
        _step_matches(f, model, ref, *_data(seed, 13))
    _accumulated_matches(f, model, ref, [(1.0, _data(2, 13)), (3.0, _data(3, 13))])
    assert _loops_captured(stand_in) >= 3


@pytest.mark.slow
def test_a_process_keeps_a_few_chunk_loops(stand_in):
    """Each length seen twice captures a loop, holding its full-length inputs and gradients: the most recent
    MAX_LOOPS are kept, so lengths that keep changing do not pile up graphs."""
    model, ref, f = _graphed_step()
    for t in range(9, 9 + loss_tail.MAX_LOOPS + 2):
        for seed in (0, 1):
            _step_matches(f, model, ref, *_data(seed, t))
    assert len(loss_tail._LOOPS) == loss_tail.MAX_LOOPS, list(loss_tail._LOOPS)
    assert _loops_captured(stand_in) == 2 * (loss_tail.MAX_LOOPS + 2)   # each: its capture and one replay


@pytest.mark.parametrize("fused", [False, True], ids=["as-written", "fused"])
@pytest.mark.slow
def test_every_loss_form_through_the_replayed_chunk_loop(stand_in, fused):
    """All the loss forms of one forward (several losses, means over valid targets with their counts, a z-loss, label
    smoothing, shifts) through the captured chunk loop: three calls at one length (the loop captured at the second,
    replayed at the third), each loss and the gradients of a random combination against autograd in fp64; also with
    the heads fused (the default on a GPU)."""
    from test_lower_fused_loss import FUSED
    from test_lower_lm_loss import FORMS, AllForms
    torch.manual_seed(0)
    model = AllForms().double()
    if fused:  # NB: only the forms the op takes: another reader of the logits (a log_softmax) keeps them as written
        model.forms = [f for k, (f, _) in FORMS.items() if k in FUSED]
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 5, "inner": "aot_eager", "cuda_graphs": True,
                                                         "fused_loss": fused})
    for seed in range(3):
        c = torch.rand(len(FORMS), generator=torch.Generator().manual_seed(seed)).add(0.5).tolist()[:len(model.forms)]
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        data = _data(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(*data)
        want = ref(*data)
        for k, (g, w) in enumerate(zip(got, want)):
            assert abs(g.item() - w.item()) <= 1e-10 * abs(w.item()), (seed, k)
        sum(ci * g for ci, g in zip(c, got)).backward()
        sum(ci * w for ci, w in zip(c, want)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad - q.grad).norm() <= 1e-10 * q.grad.norm(), (seed, name)
    assert _loops_captured(stand_in) == 3, [fn.__name__ for fn in stand_in]   # captured, replayed twice
    (tail,) = {str(r.details.get("loss_tail")) for r in ac.report(f).regions if r.rewrite == "adjoint"}
    assert ("'fused_heads': 1" in tail) == fused, tail


@pytest.mark.slow
def test_eval_calls_and_a_frozen_head_between_replays(stand_in):
    """At one length: training steps (the loop captured, replayed), an evaluation under no_grad, steps with the head
    frozen (another set of gradients: a loop of its own) and training again, each against autograd in fp64."""
    model, ref, f = _graphed_step()
    for seed in (0, 1):
        _step_matches(f, model, ref, *_data(seed, 13))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = _data(2, 13)
        assert abs(f(*data).item() - ref(*data).item()) <= 1e-10 * abs(ref(*data).item())
    for m in (model, ref):
        m.lm.head.weight.requires_grad_(False)
    for seed in (3, 4, 5):
        _step_matches(f, model, ref, *_data(seed, 13))
        assert model.lm.head.weight.grad is None
    for m in (model, ref):
        m.lm.head.weight.requires_grad_(True)
    _step_matches(f, model, ref, *_data(6, 13))
    assert _loops_captured(stand_in) >= 5


def test_a_first_call_without_the_chunks_own_graphs(stand_in, monkeypatch):
    """With FIRST_CALL_GRAPHS off, a length's first call runs the loss chunks' programs as compiled (the sweep's own
    programs still replayed), and the loop is captured at the second as before: exact throughout."""
    monkeypatch.setattr(loss_tail, "FIRST_CALL_GRAPHS", False)
    whats = []

    def replayed(fn, args, inner, what):
        whats.append(what)
        return graphed.replayed(fn, args, inner, what)
    monkeypatch.setattr(loss_tail, "replayed", replayed)
    model, ref, f = _graphed_step()
    _step_matches(f, model, ref, *_data(0, 13))
    assert "loss chunk" not in whats and _loops_captured(stand_in) == 0
    for seed in (1, 2):
        _step_matches(f, model, ref, *_data(seed, 13))
    assert _loops_captured(stand_in) == 3
