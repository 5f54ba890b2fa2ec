"""DP-SGD on a language model with its loss compiled in: ``per_sample_clip=C`` makes one ``loss.backward()`` leave
Σ_n min(1, C/‖g_n‖) g_n in every ``p.grad`` (each example's gradient clipped to norm C, then summed), with the token
lookup, the recurrent stack, the vocabulary head and the cross-entropy in one sharded region, so memory stays nearly
flat in T as without clipping. The Gaussian noise of DP-SGD (σ·C per coordinate) is then added to the clipped sum
by hand, before the optimizer's step.

The model and the data are those of ``examples/language_model.py`` (a Markov chain over V tokens). Each example's
loss is its own mean over its tokens and the batch's loss their sum: a mean over the whole batch would divide every
example's gradient, and so its clipping threshold, by B (the backend warns). The norms of one batch are checked
against an eager loop over the examples first.

    python examples/dp_sgd.py [--steps 30] [--clip 0.3] [--sigma 0.3] [--batches 4]

With opacus installed (``pip install "adjoint-compile[dp]"``), its RDP accountant prints the ε spent.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import adjoint_compile as ac

sys.path.insert(0, str(Path(__file__).resolve().parent))
from language_model import LM, V, markov_chain, sample  # noqa: E402  (the same model and data)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Σ over the examples of each one's mean next-token loss."""
    logits = model(ids[:, :-1])
    per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T]
    return per_token.mean(1).sum()


def loop_norms(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """‖g_n‖ of each example alone, by eager autograd."""
    ref = copy.deepcopy(model)
    out = []
    for n in range(ids.shape[0]):
        grads = torch.autograd.grad(loss_of(ref, ids[n:n + 1]), list(ref.parameters()))
        out.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
    return torch.tensor(out)


def epsilon(sigma: float, batch: int, steps: int, delta: float, dataset: int) -> float | None:
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        return None
    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=batch / dataset)
    return acc.get_epsilon(delta)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--clip", type=float, default=0.3, help="C: each example's gradient norm at most C")
    p.add_argument("--sigma", type=float, default=0.3, help="noise multiplier: N(0, (σC)²) added to the clipped sum")
    p.add_argument("--batches", type=int, default=4, help="the example model's batches of 4 sequences per step")
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    probs, entropy = markov_chain(gen)
    model = LM()
    params = list(model.parameters())
    step = torch.compile(lambda ids: loss_of(model, ids), backend="adjoint",
                         options={"per_sample_clip": args.clip, "shard_size": 64})

    def batch() -> torch.Tensor:
        return torch.cat([sample(probs, gen) for _ in range(args.batches)])  # NB: DP-SGD's noise wants large batches

    ids = batch()
    step(ids).backward()
    got, want = ac.per_sample_grad_norms(step), loop_norms(model, ids)
    err = float(((got - want).abs() / want).max())
    print(f"per-example gradient norms from {float(got.min()):.3f} to {float(got.max()):.3f}: against an eager loop, "
          f"max relative error {err:.1e}")

    opt = torch.optim.AdamW(params, lr=args.lr)
    losses, clipped = [], []
    for i in range(args.steps):
        ids = batch()
        B = ids.shape[0]
        opt.zero_grad()
        loss = step(ids)
        loss.backward()                                          # p.grad: the clipped sum
        norms = ac.per_sample_grad_norms(step)
        with torch.no_grad():
            for q in params:                                     # the Gaussian mechanism, then the batch's mean
                q.grad.add_(torch.randn_like(q) * args.sigma * args.clip).div_(B)
        opt.step()
        losses.append(loss.item() / B)
        clipped.append(float((norms > args.clip).float().mean()))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}: loss {losses[-1]:.3f} (log V = {math.log(V):.3f}, the chain's entropy "
                  f"{entropy:.3f}); examples clipped {clipped[-1]:.0%}")

    eps = epsilon(args.sigma, B, args.steps, delta=1e-5, dataset=10_000)
    if eps is not None:
        print(f"ε = {eps:.1f} at δ = 1e-5 (RDP accountant; batches of {B} drawn from 10000 sequences)")
    (row, *_) = [r for r in ac.report(step).regions if r.rewrite == "adjoint"]
    print(row.reason)
    return {"norm_rel_err": err, "losses": losses, "clipped": clipped, "entropy": entropy, "reason": row.reason,
            "epsilon": eps}


if __name__ == "__main__":
    main()
