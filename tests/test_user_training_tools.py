"""Training with the tools users already use: DistributedDataParallel, FSDP2 (``fully_shard``), transformers'
``Trainer`` and Lightning, each with ``backend="adjoint"``.

The distributed cases spawn two CPU processes on gloo (test_seqpar's ``_spawn``: a timeout on every join); each rank
trains on its half of a batch and writes its gradients and ``ac.report`` to a file, and the parent compares them
with plain single-process autograd on the whole batch (DDP and FSDP2 average the ranks' gradients, and each rank's
loss is a mean over its half, so the averaged gradient is the whole batch's mean loss's gradient).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import adjoint_compile as ac
from test_lower_seqpar import _example, _init, _port, _rank_errors, _spawn

B, T, D, N = 2, 9, 6, 2
D_BIG = 256  # two layers of 1 MiB of parameters each: bucket_cap_mb=1 splits the graph at the buckets


def _ssm(d_model):
    torch.manual_seed(0)
    return _example("selective_ssm").SSMStack(d_model=d_model, d_state=N, n_layers=2)


def _hf_mamba():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=4)
    return transformers.MambaForCausalLM(cfg)


def _batch(name, world):
    g = torch.Generator().manual_seed(3)
    if name == "hf_mamba":
        return torch.randint(0, 32, (B * world, T), generator=g)
    return torch.randn(B * world, T, D if name == "ssm" else D_BIG, generator=g)


class _Loop(torch.nn.Module):
    """A gated recurrence written as a loop over steps, its gate's parameters used at every step: DDPOptimizer
    counts them at each use and splits the unrolled loop every few steps when bucket_cap_mb=1."""

    def __init__(self):
        super().__init__()
        self.gate, self.inp, self.out = (torch.nn.Linear(D_BIG, D_BIG) for _ in range(3))

    def forward(self, x):
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.gate(x[:, t])) * h + self.inp(x[:, t])
            hs.append(h)
        return self.out(torch.stack(hs, 1))


#: the backend's options here: the sequences are short, and a region of one shard would be declined (it saves
#: nothing), so ask for shards of 4 steps
ADJOINT = {"inner": "aot_eager", "shard_size": 4}


def _model(name):
    if name == "loop":
        torch.manual_seed(0)
        return _Loop()
    return _hf_mamba() if name == "hf_mamba" else _ssm(D_BIG if name == "ssm_big" else D)


def _loss(model, x):
    """The mean squared distance of the output to a fixed random target, the same for every example (so that DDP's
    average over the ranks' local means is the whole batch's mean, and training lowers it). NB: not ``y.pow(2).mean()``: the models end in
    an RMSNorm, whose squared output barely depends on its input, so those gradients are ~1e-9 and mostly float32
    cancellation, in eager autograd too."""
    y = (model(x).logits if isinstance(x, torch.Tensor) and not x.is_floating_point() else model(x)).float()
    w = torch.randn(y.shape[1:], generator=torch.Generator().manual_seed(11))
    return (y - w).pow(2).mean()


def _regions(compiled):
    rep = ac.report(compiled)
    return {"graphs": len(rep.compiled), "breaks": [b.reason for b in rep.graph_breaks],
            "regions": [(r.kind, r.rewrite, r.length, r.reason) for r in rep.regions
                        if r.kind == "linear_recurrence"]}


def _ddp_case(name, cap, split=True):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model(name)
    kw = {} if cap is None else {"bucket_cap_mb": cap}
    torch._dynamo.reset()
    f = torch.compile(DDP(model, **kw), backend="adjoint", options=ADJOINT)
    x = _batch(name, dist.get_world_size()).chunk(dist.get_world_size())[dist.get_rank()]
    with torch._dynamo.config.patch(optimize_ddp=split):
        _loss(f, x).backward()
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, **_regions(f)}


def _fsdp_case(name):
    from torch.distributed.fsdp import fully_shard
    model = _model(name)
    for layer in (model.backbone.layers if name == "hf_mamba" else model.layers):
        fully_shard(layer)
    fully_shard(model)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=ADJOINT)
    x = _batch(name, dist.get_world_size()).chunk(dist.get_world_size())[dist.get_rank()]
    _loss(f, x).backward()
    return {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}, **_regions(f)}


def _worker(rank, world, port, cases, out_dir):
    torch.set_num_threads(1)
    with _rank_errors(rank, out_dir):
        _init(rank, world, port, 60)
        res = {}
        for case in cases:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ac.AdjointCompileWarning)
                res[case] = _ddp_case(*case[1:]) if case[0] == "ddp" else _fsdp_case(case[1])
            res[case]["warnings"] = [str(w.message) for w in caught if w.category is ac.AdjointCompileWarning]
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _want(name, world):
    model = _model(name)
    _loss(model, _batch(name, world)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


#: (tool, model, bucket_cap_mb, DDPOptimizer on) -> (graphs, scan regions) ac.report shows on each rank
DIST_CASES = {("ddp", "ssm_big", 1, True): (3, 2),  # split at the buckets, between the layers: each piece its scan
              ("ddp", "ssm_big", 1, False): (1, 2),  # optimize_ddp=False: one graph
              # the default 25 MiB, but DDP caps its first bucket at 1 MiB: two pieces
              ("ddp", "ssm_big", None, True): (2, 2),
              ("ddp", "hf_mamba", None, True): (1, 2),
              ("ddp", "loop", 1, True): (None, 0),  # the loop cut into several pieces: none holds enough of it
              ("ddp", "loop", 1, False): (1, 1),
              # fully_shard: dynamo compiles each sharded layer's forward, one graph shared by both layers
              ("fsdp", "ssm"): (1, 1), ("fsdp", "hf_mamba"): (3, 1)}


@pytest.mark.slow
def test_ddp_and_fsdp2_gradients_equal_single_process_autograd(tmp_path):
    world = 2
    _spawn(_worker, world, (_port(), list(DIST_CASES), str(tmp_path)), timeout=240)
    errs = sorted(tmp_path.glob("*.err"))
    assert not errs, errs[0].read_text()
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for case, (graphs, regions) in DIST_CASES.items():
        want = _want(case[1], world)
        steps = T
        for r in range(world):
            res = got[r][case]
            assert res["graphs"] == graphs or graphs is None and res["graphs"] > 2, (case, res["graphs"])
            assert len(res["regions"]) == regions, (case, res["regions"], res["breaks"])
            assert all(kind == "linear_recurrence" and rw == "adjoint" and n == steps
                       for kind, rw, n, _ in res["regions"]), (case, res["regions"])
            assert len(res["breaks"]) == (res["graphs"] - 1 if case[0] == "ddp" else 0), res["breaks"]
            assert all("DDPOptimizer" in b for b in res["breaks"])
            # NB: dynamo skips the frame that calls FSDP2's hooks by design (each sharded layer compiles on its own)
            assert not [w for w in res["warnings"] if "runs eagerly" in w], res["warnings"]
            assert res["grads"].keys() == want.keys()
            errs = {n: _rel(res["grads"][n], want[n]) for n in want}
            assert max(errs.values()) <= 1e-4, (case, errs)
            cut = case[1] == "loop" and case[3]
            assert len(res["warnings"]) == cut, res["warnings"]
            assert not cut or f"rewrite 0 of the {T} recurrence steps" in res["warnings"][0]


class _Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences for a causal LM (labels = inputs; the model shifts them)."""

    def __init__(self, n, steps):
        self.ids = torch.randint(0, 32, (n, steps), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_losses(backend, tmp_path, steps=512):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")
    torch._dynamo.reset()
    model = _hf_mamba()
    model.compile(backend=backend, **({"options": ADJOINT} if backend == "adjoint" else {}))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / backend), max_steps=3, per_device_train_batch_size=2,
                                          use_cpu=True, logging_steps=1, report_to=[], save_strategy="no",
                                          learning_rate=1e-2, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(6, steps))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


def _trains_like_aot_eager(run, steps):
    """3 steps with backend="adjoint": both layers' scans rewritten over all ``steps``, and the losses those of the
    same run with aot_eager."""
    got, model = run("adjoint")
    rep = ac.report(model)
    lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
    assert len(lin) == 2 and all(r.rewrite == "adjoint" and r.length == steps for r in lin), str(rep)
    want, _ = run("aot_eager")
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5)
    assert got[2] < got[0]  # it trains


@pytest.mark.slow
def test_trainer_trains_with_the_backend_and_its_losses_equal_aot_eager(tmp_path):
    _trains_like_aot_eager(lambda backend: _trainer_losses(backend, tmp_path), 512)


def test_trainer_torch_compile_backend_adjoint_is_refused_by_accelerate():
    """accelerate's TorchDynamoPlugin accepts only the backends of its DynamoBackend enum: the error names ours."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, torch_compile=True,
                                          torch_compile_backend="adjoint", report_to=[])
    with pytest.raises(ValueError, match="ADJOINT"):
        transformers.Trainer(model=_hf_mamba(), args=args, train_dataset=_Tokens(2, 8))


def _lightning_losses(backend, tmp_path):
    L = pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")

    class LitSSM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _ssm(D)
            self.losses = []

        def training_step(self, batch, _):
            loss = _loss(self.model, batch[0])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch._dynamo.reset()
    lit = LitSSM()
    lit.model.compile(backend=backend, **({"options": ADJOINT} if backend == "adjoint" else {}))
    x = torch.randn(6, 17, D, generator=torch.Generator().manual_seed(5))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(lit, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2))
    return lit.losses, lit.model


def test_lightning_trains_with_the_backend_and_its_losses_equal_aot_eager(tmp_path):
    _trains_like_aot_eager(lambda backend: _lightning_losses(backend, tmp_path), 17)
