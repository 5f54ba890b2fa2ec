"""A small language model trained with its loss compiled in: the token lookup, a recurrent stack, the vocabulary head
and the cross-entropy as training scripts write it become one sharded region (docs/exact.md, "Language models"), so
the [B, T, V] logits are never whole: the loss runs once, with its gradient, in the forward, a chunk of steps at a
time. On a GPU the head and the cross-entropy run as one fused kernel that makes no logits at all (``fused_loss``,
on by default there); ``--fused`` runs the op's torch reference on a CPU too.

The data: sequences from a fixed random Markov chain over V tokens (each token followed by one of 4 likely ones), so
the next-token loss falls from log V toward the chain's entropy. The gradients of one batch are checked once against
eager autograd before training.

    python examples/language_model.py [--fused] [--steps 40]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack

V, D, B, T = 512, 32, 4, 256


class LM(nn.Module):
    """Embedding -> 2 selective-SSM layers (pre-norm residuals, final RMSNorm) -> vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.stack = SSMStack(d_model=D, d_state=8, n_layers=2)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.emb(ids)))


def markov_chain(gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """A transition matrix [V, V] (4 likely successors per token, 0.22 each; the rest share 0.12) and its entropy
    rate in nats, the loss a perfect model reaches."""
    probs = torch.full((V, V), 0.12 / (V - 4))
    likely = torch.rand(V, V, generator=gen).argsort(-1)[:, :4]
    probs.scatter_(1, likely, 0.22)
    return probs, float(-(probs * probs.log()).sum(-1).mean())


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """B sequences of T + 1 tokens from the chain."""
    ids = [torch.randint(0, V, (B,), generator=gen)]
    for _ in range(T):
        ids.append(torch.multinomial(probs[ids[-1]], 1, generator=gen)[:, 0])
    return torch.stack(ids, 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fused", action="store_true", help="fuse the head and the loss on a CPU too (torch reference)")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    probs, entropy = markov_chain(gen)
    model = LM()
    params = list(model.parameters())

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids[:, :-1])                                          # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())  # as training scripts write it

    f = torch.compile(step, backend="adjoint", options={"shard_size": 64, "fused_loss": args.fused or "auto"})

    ids = sample(probs, gen)
    got = torch.autograd.grad(f(ids), params)
    want = torch.autograd.grad(step(ids), params)
    err = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
    print(f"gradients against eager autograd: max relative error {err:.1e}")

    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for i in range(args.steps):
        loss = f(sample(probs, gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}: loss {losses[-1]:.3f}  (log V = {math.log(V):.3f}, the chain's entropy {entropy:.3f})")

    (row, *_) = [r for r in ac.report(f).regions if r.rewrite == "adjoint"]
    print(row.reason)
    return {"max_rel_err": err, "losses": losses, "entropy": entropy, "reason": row.reason}


if __name__ == "__main__":
    main()
