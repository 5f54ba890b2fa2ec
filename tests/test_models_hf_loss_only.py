"""``adjoint_compile.loss_only(model)`` (polyfills/hf_causal_lm.py): a transformers ``...ForCausalLM`` called with
``labels`` while training returns its loss with ``logits=None``, so under ``backend="adjoint"`` the logits are an
intermediate of the graph, not an output, and the head and the loss run shard by shard. Against the unpatched model
run eagerly (an independent copy), on Mamba and Mamba-2 compiled with the backend, Llama eagerly, and the Trainer.
Also: a region whose loss is taken in while the model returns the logits says in the report that they are kept whole,
and how to avoid it (passes/lower/sharded.py ``returned_whole``, passes/decide/)."""
from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import adjoint_compile as ac  # noqa: E402
from test_lower_lm_loss import LM, _data, _takes_in  # noqa: E402

V, B, T = 11, 2, 13
KEEPS = "adjoint_compile.loss_only(model)"


def _mamba() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=V, hidden_size=8, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_associative_scan=False)
    return transformers.MambaForCausalLM(cfg)


def _mamba2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2, num_heads=4,
                                    head_dim=8, n_groups=1, expand=2, chunk_size=8)
    return transformers.Mamba2ForCausalLM(cfg)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# NB: transformers' Mamba and Mamba-2 cast to fp32 inside their fp64 forward (the selective scan's ``.float()`` and the
# head's ``logits.float()``): compiled and eager agree to fp32 rounding, not to fp64's 1e-10
@pytest.mark.parametrize("fused", [False, True], ids=["as-written", "fused"])
@pytest.mark.parametrize("make,items", [(_mamba, None), (_mamba2, 17)], ids=["mamba", "mamba2"])
@pytest.mark.slow
def test_loss_and_gradients_equal_the_unpatched_eager_model(make, items, fused):
    """Compiled with backend="adjoint" and loss_only: logits None, the loss and every parameter's gradient those of the
    unpatched model run eagerly (num_items_in_batch passed through to its loss_function for Mamba-2), and the one
    sharded region takes in the lookup and the loss and keeps no logits whole; with ``fused_loss=True`` its head and
    cross-entropy run as the fused op (transformers' upcast and label padding included)."""
    ref = make().double()
    model = ac.loss_only(copy.deepcopy(ref))
    ids, labels = _data()
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    f = torch.compile(model, backend="adjoint", options={"shard_size": 5, "inner": "aot_eager", "fused_loss": fused})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = f(input_ids=ids, labels=labels, **kw)
    want = ref(input_ids=ids, labels=labels, **kw)
    assert got.logits is None and want.logits.shape == (B, T, V) and type(got) is type(want)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item()), (got.loss, want.loss)
    got.loss.backward()
    want.loss.backward()
    g, w = _grads(model), _grads(ref)
    assert g.keys() == w.keys() and len(w) == len(list(ref.parameters()))
    errs = {n: _rel(g[n], w[n]) for n in w}
    assert max(errs.values()) <= 1e-6, errs
    rep = ac.report(f)
    assert not rep.fallbacks, str(rep)
    details = _takes_in(rep, 1, tail=None)
    assert details["embeddings"] and "returned_whole" not in details and KEEPS not in str(rep), str(rep)
    # NB: Mamba's loss is split off the sweep and runs in the forward (then fused or not); Mamba-2's logits (V = 11) are
    # cheaper per step than its hidden state (16), so its loss stays in the sweep
    tail = details.get("loss_tail")
    assert bool(tail) == (make is _mamba) and bool(tail and tail["fused_heads"]) == (fused and make is _mamba), tail


@pytest.mark.parametrize("make", [_mamba, _mamba2], ids=["mamba", "mamba2"])
def test_per_sample_clip_with_loss_only(make):
    """DP-SGD's clipped step on transformers' Mamba and Mamba-2 with ``loss_only``: the last region takes in the head
    and the loss (no logits handed out whole), and every p.grad and norm is that of a loop of the unpatched model run
    eagerly on each example alone (its mean loss scaled to the batch's count of targets, as the batch's mean weighs
    it), clipped and summed; to the fp32 rounding of their fp32 casts."""
    ref = make().double()
    ids, labels = _data()
    n_all = int((labels[:, 1:] != -100).sum())
    per = []
    for n in range(B):
        one = copy.deepcopy(ref)
        out = one(input_ids=ids[n:n + 1], labels=labels[n:n + 1])
        (out.loss * int((labels[n, 1:] != -100).sum()) / n_all).backward()
        per.append(_grads(one))
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in d.values())) for d in per])
    clip = float(norms.min() + norms.max()) / 2
    want = {k: sum(min(1.0, clip / float(m)) * d[k] for m, d in zip(norms, per)) for k in per[0]}
    model = ac.loss_only(copy.deepcopy(ref))
    f = torch.compile(model, backend="adjoint", options={"shard_size": 4, "inner": "aot_eager",
                                                         "per_sample_clip": clip})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(input_ids=ids, labels=labels).loss.backward()
    assert _rel(ac.per_sample_grad_norms(f), norms) <= 1e-6
    errs = {k: _rel(p.grad, want[k]) for k, p in model.named_parameters()}
    assert max(errs.values()) <= 1e-6, errs
    rows = [r for r in ac.report(f).regions if r.rewrite == "adjoint"]
    assert rows and rows[-1].details.get("sums_over_time") and not any(r.details.get("before_loss") for r in rows), \
        [r.reason for r in rows]


def test_without_loss_only_the_report_says_the_logits_are_kept():
    """The same Mamba unpatched: its output object holds the logits, so the region that takes in the loss hands them
    out whole; the report names them with their size and the remedy."""
    model = _mamba().double()
    rep = ac.explain(lambda i, lab: model(input_ids=i, labels=lab), *_data(), options={"shard_size": 5})
    details = _takes_in(rep, 1, tail=False)
    assert [(o["shape"], o["bytes"]) for o in details["returned_whole"]] == [([B, T, V], B * T * V * 4)], details
    assert KEEPS in rep.regions[0].reason and re.search(r"keeps \w+ \[2, 13, 11\] whole \(1 KiB\)",
                                                          rep.regions[0].reason), str(rep)
    ac.loss_only(model)
    rep = ac.explain(lambda i, lab: model(input_ids=i, labels=lab), *_data(), options={"shard_size": 5})
    assert "returned_whole" not in _takes_in(rep, 1, tail=None) and KEEPS not in str(rep)


class LossAndLogits(nn.Module):
    """Plain torch (tests/test_lower_lm_loss.py's LM): the loss, and the logits too when ``logits`` is set."""

    def __init__(self, logits: bool) -> None:
        super().__init__()
        self.lm, self.logits = LM(), logits

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        lg = self.lm(ids)
        loss = F.cross_entropy(lg.flatten(0, 1), targets.flatten())
        return (loss, lg.transpose(1, 2)) if self.logits else loss


def test_the_report_names_logits_returned_with_the_loss():
    """Returned as a view (``transpose``: the region's output then), the logits are kept whole and named; a model
    that returns the loss alone gets no such note; neither does a region without a loss that returns its outputs (the
    usual case)."""
    torch.manual_seed(0)
    rep = ac.explain(LossAndLogits(True).double(), *_data(), options={"shard_size": 4})
    (kept,) = _takes_in(rep, 1, tail=False)["returned_whole"]
    assert kept["shape"] == [B, V, T] and kept["bytes"] == B * T * V * 8, kept
    assert all(KEEPS in r.reason for r in rep.regions if r.kind == "linear_recurrence"), str(rep)
    assert KEEPS in rep.text()
    rep = ac.explain(LossAndLogits(False).double(), *_data(), options={"shard_size": 4})
    assert "returned_whole" not in _takes_in(rep, 1, tail=True) and KEEPS not in str(rep)
    model = _mamba()
    rep = ac.explain(lambda i: model(i).logits, _data()[0], options={"shard_size": 5})
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert lin and all(r.rewrite == "adjoint" and "returned_whole" not in r.details for r in lin), str(rep)


def test_without_labels_or_training_the_output_is_unchanged():
    """Eager: no labels, eval mode, or no grad (the default when="training") leave every output field as the unpatched
    model's; when="always" drops the logits under no_grad too; return_dict=False gives the unpatched tuple with None
    where the logits were, every other entry in its place."""
    ref = _mamba().double()
    model = ac.loss_only(copy.deepcopy(ref))
    ids, labels = _data()
    for mode in ("train", "eval"):
        ref.train(mode == "train")
        model.train(mode == "train")
        for kw in ({}, {"logits_to_keep": 1}, {"labels": labels, "logits_to_keep": 0}):
            with torch.no_grad() if "labels" in kw or mode == "eval" else torch.enable_grad():
                got, want = model(input_ids=ids, **kw), ref(input_ids=ids, **kw)
            assert type(got) is type(want) and got.keys() == want.keys(), (mode, kw)
            assert torch.equal(got.logits, want.logits) and (got.loss is None) == (want.loss is None), (mode, kw)
    model.train()
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).logits is not None
        ac.loss_only(model, when="always")
        assert model(input_ids=ids, labels=labels).logits is None
    ref.train()
    for kw in ({}, {"output_hidden_states": True}):
        got = model(input_ids=ids, labels=labels, return_dict=False, **kw)
        want = ref(input_ids=ids, labels=labels, return_dict=False, **kw)
        assert len(got) == len(want) and got[1] is None and want[1] is not None, (len(got), len(want))
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[2:], want[2:]):
            assert type(g) is type(w), (type(g), type(w))
            if isinstance(w, tuple):
                assert all(torch.equal(a, b) for a, b in zip(g, w)), kw


def test_any_causal_lm_with_the_usual_forward():
    """Llama (attention, no recurrence) eagerly: the same loss and gradients bit for bit (the library's own forward
    runs), logits None, with ``num_items_in_batch`` and ``shift_labels`` passed to its loss_function."""
    ref = _llama().double()
    model = ac.loss_only(copy.deepcopy(ref))
    ids, labels = _data()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    for kw in ({"labels": labels}, {"labels": labels, "num_items_in_batch": torch.tensor(9)},
               {"labels": labels, "logits_to_keep": T}, {"labels": labels, "shift_labels": shifted}):
        model.zero_grad()
        ref.zero_grad()
        got, want = model(input_ids=ids, **kw), ref(input_ids=ids, **kw)
        assert got.logits is None and want.logits is not None and torch.equal(got.loss, want.loss), kw
        got.loss.backward()
        want.loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())), kw


def test_idempotent_reversible_and_per_instance():
    model, other = _mamba(), _mamba()
    forward = ac.loss_only(model).forward
    assert ac.loss_only(model).forward is forward and ac.is_loss_only(model) and not ac.is_loss_only(other)
    assert "forward" not in other.__dict__ and type(model).forward is type(other).forward
    ac.loss_only(model, False)
    assert "forward" not in model.__dict__ and not ac.is_loss_only(model)
    ac.loss_only(model, False)  # NB: a no-op on a model never (or no longer) patched
    ids, labels = _data()
    assert model(input_ids=ids, labels=labels).logits is not None
    # a forward already replaced on the instance (accelerate's autocast wrapper does that) is wrapped and restored
    own = model.forward
    model.forward = functools.wraps(own)(lambda *a, **k: own(*a, **k))
    mine = model.__dict__["forward"]
    compiled = torch.compile(model, backend="adjoint")
    assert ac.loss_only(compiled) is compiled and ac.is_loss_only(model) and ac.is_loss_only(compiled)
    assert model(input_ids=ids, labels=labels).logits is None
    ac.loss_only(compiled, False)
    assert model.__dict__["forward"] is mine


def test_a_deepcopy_runs_its_own_weights():
    """A deepcopy of a patched model (a reference or EMA model, trl's create_reference_model) ran the original's
    forward and weights: its logits were the original's and its parameters got no gradient. Each runs its own, and
    each keeps its own ``when`` and restores to its own forward."""
    model = _mamba().double()
    ac.loss_only(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    plain = copy.deepcopy(twin)
    ac.loss_only(plain, False)
    assert not ac.is_loss_only(plain) and "forward" not in plain.__dict__
    ids, labels = _data()
    twin.eval()
    plain.eval()
    torch.testing.assert_close(twin(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    twin.train()
    out = twin(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    assert all(p.grad is not None for p in twin.parameters()) and all(p.grad is None for p in model.parameters())
    ac.loss_only(twin, when="always")
    model.eval()
    twin.eval()
    assert model(input_ids=ids, labels=labels).logits is not None and twin(input_ids=ids, labels=labels).logits is None
    ac.loss_only(twin, False)
    assert type(twin).forward is type(model).forward and "forward" not in twin.__dict__ and ac.is_loss_only(model)


class NoHead(nn.Module):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return input_ids.float().mean()


class TupleLM(NoHead):
    """A head and ``labels``, but a forward that returns a plain tuple: refused when it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, V)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
        return (input_ids.float().mean(), self.head(torch.ones(2)))


def test_a_model_it_cannot_handle_gets_a_clear_error():
    backbone = transformers.MambaModel(_mamba().config)
    with pytest.raises(TypeError, match="takes no `labels`.*ForCausalLM"):
        ac.loss_only(backbone)
    with pytest.raises(TypeError, match="takes no `labels`"):
        ac.loss_only(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="no vocabulary head"):
        ac.loss_only(NoHead())
    with pytest.raises(TypeError, match="is not a torch.nn.Module"):
        ac.loss_only(lambda input_ids, labels=None: None)
    with pytest.raises(ValueError, match="when="):
        ac.loss_only(_mamba(), when="eval")
    model = ac.loss_only(TupleLM())
    with pytest.raises(TypeError, match="returned tuple without a loss and a `logits` field"):
        model(torch.ones(2, 3), labels=torch.ones(2, 3))
    assert model(torch.ones(2, 3))[0].item() == 1.0  # NB: without labels the forward is the model's own


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, steps: int) -> None:
        self.ids = torch.randint(0, V, (n, steps), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, compiled: bool) -> tuple[list[float], nn.Module, list]:
    """Two Trainer steps (CPU, no saving or reporting); the losses, the model, and the logits of each training call
    (compiled: loss_only and backend="adjoint" on the model compiled by hand; else the unpatched model, eager)."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")
    torch._dynamo.reset()
    model = _mamba()
    if compiled:
        ac.loss_only(model).compile(backend="adjoint", options={"shard_size": 16, "inner": "aot_eager"})
    seen = []

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
            seen.append(out.logits)
            return (loss, out) if return_outputs else loss

    args = transformers.TrainingArguments(output_dir=str(tmp_path / str(compiled)), max_steps=2,
                                          per_device_train_batch_size=2, use_cpu=True, logging_steps=1, report_to=[],
                                          save_strategy="no", learning_rate=1e-2, seed=0, disable_tqdm=True)
    trainer = Recording(model=model, args=args, train_dataset=_Tokens(4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    if compiled:  # NB: before the next run's dynamo reset empties the caches report() reads
        assert "returned_whole" not in _takes_in(ac.report(model), 1, tail=None)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model, seen


@pytest.mark.slow
def test_trainer_with_loss_only_trains_like_the_unpatched_model(tmp_path):
    """transformers.Trainer (model.compile(backend="adjoint") by hand, torch_compile off): with loss_only each step's
    output has no logits, the region takes in the loss, and the losses and trained weights are those of the same two
    steps with the unpatched model run eagerly (fp32)."""
    got, model, seen = _train(tmp_path, True)
    want, ref, logits = _train(tmp_path, False)
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-5), (got, want)
    assert seen == [None, None] and all(lg is not None and lg.shape == (2, 64, V) for lg in logits)
    errs = {n: _rel(p.detach(), q.detach()) for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    assert max(errs.values()) <= 1e-5, errs
