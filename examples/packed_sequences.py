"""Packed sequences: documents of random lengths packed into rows of T steps, the SSM's state reset at each
document's first step, trained with the sharded exact adjoint (docs/exact.md, "Packed sequences").

The target of each step is the running mean of the inputs since its document started, so a state that leaked across
a document boundary would be wrong. The gradients of one packed batch are checked once against the documents run
one by one through the eager model.

    python examples/packed_sequences.py
"""
from __future__ import annotations

import torch

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack, resets_from_cu_seqlens

torch.manual_seed(0)
B, T, D, S = 4, 256, 8, 64


def pack(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Rows of T steps filled with documents of 1 to 80 steps: inputs, targets, resets and the documents' lengths."""
    x, y, lens_of = torch.randn(rows, T, D), torch.empty(rows, T, D), []
    for b in range(rows):
        lens, t = [], 0
        while t < T:
            lens.append(min(int(torch.randint(1, 81, ())), T - t))
            t += lens[-1]
        lens_of.append(lens)
    cu = [torch.tensor([0, *lens]).cumsum(0) for lens in lens_of]
    reset = torch.stack([resets_from_cu_seqlens(c, T) for c in cu])
    for b, c in enumerate(cu):
        for s, e in zip(c[:-1].tolist(), c[1:].tolist()):
            y[b, s:e] = x[b, s:e].cumsum(0) / torch.arange(1, e - s + 1)[:, None]   # the document's running mean
    return x, y, reset, lens_of


model = SSMStack(d_model=D, d_state=4, n_layers=2)


def loss_fn(x: torch.Tensor, y: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    return (model(x, reset) - y).square().mean()


step = torch.compile(loss_fn, backend="adjoint", options={"shard_size": S})
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for i in range(30):
    x, y, reset, _ = pack(B)
    loss = step(x, y, reset)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 10 == 0 or i == 29:
        print(f"step {i:2d}  loss {loss.item():.4f}")
print(ac.report(step))

# once: the packed batch's gradients against its documents run one by one (each from a zero state)
x, y, reset, lens_of = pack(B)
params = list(model.parameters())
packed = torch.autograd.grad(step(x, y, reset), params)
total = 0.0
for b, lens in enumerate(lens_of):
    s = 0
    for n in lens:
        total = total + (model(x[b:b + 1, s:s + n]) - y[b:b + 1, s:s + n]).square().sum()
        s += n
unpacked = torch.autograd.grad(total / y.numel(), params)
err = max(((g - u).norm() / u.norm()).item() for g, u in zip(packed, unpacked))
print(f"{sum(map(len, lens_of))} documents in {B} rows: packed vs unpacked gradients, max relative error {err:.1e}")
assert err < 1e-4, err
