"""Sequence parallelism: one long sequence split across processes, trained with the demo's selective SSM.

    torchrun --nproc_per_node=2 examples/sequence_parallel.py                 # T = 8192 split in two
    torchrun --nproc_per_node=2 examples/sequence_parallel.py --seq-len 64 --steps 2    # a quick check

Each rank holds a contiguous slice of the steps of every sequence (rank r the r-th slice), calls the compiled model
on it with ``options={"sequence_parallel": True}`` and backpropagates its own part of the loss; the loss of the
whole sequence is the sum of the ranks' parts, and after ``loss.backward()`` every rank's ``p.grad`` is its gradient
(the backend sums parameter gradients over the group, as DDP does), so each rank's optimizer takes the same step.

The task is the demo's selective copying (adjoint_compile/demo.py): ``n_data`` tokens scattered over the sequence
must be recalled at the last ``n_data`` steps, which lie on the last rank; the state that carries them crosses the
ranks through the distributed scan. The model works on one-hot features (made outside the compiled model: data
preparation has no parameters): in_proj -> SSM stack (examples/selective_ssm.py) -> per-step logits.

Before training, rank 0 measures one training step of the whole sequence in one process (the same options on a
group of one rank), and at the end every rank measures one step on its slice: the table puts the two side by side
(peak = growth of resident memory during the step, adjoint_compile/measure.py). Without torchrun the script runs
as a group of one process.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from selective_ssm import SSMStack  # noqa: E402

from adjoint_compile import measure  # noqa: E402
from adjoint_compile.demo import add_task_args, selective_copy_batch  # noqa: E402

IGNORE = -100


class CopySSM(nn.Module):
    """One-hot tokens [B, T, vocab] -> per-step logits [B, T, vocab]; every op acts on each step except the scans."""

    def __init__(self, vocab: int, d_model: int, d_state: int, layers: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(vocab, d_model)
        self.stack = SSMStack(d_model, d_state, layers)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.in_proj(x)))


def batch(args: argparse.Namespace, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot inputs [B, T, vocab] and per-step targets [B, T] (IGNORE except at the last n_data steps)."""
    tokens, data = selective_copy_batch(args.batch, args.seq_len, args.n_data, args.vocab, gen)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, -args.n_data:] = data
    return F.one_hot(tokens, args.vocab).float(), targets


def local_loss(logits: torch.Tensor, targets: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """This slice's part of the loss: the ranks' parts sum to the mean cross-entropy over the recalled tokens (a
    slice without recall steps gives 0, and still runs its backward, which the other ranks' carries need)."""
    ce = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return ce / (args.batch * args.n_data)


def my_slice(T: int, rank: int, world: int) -> slice:
    """Rank r's contiguous steps: T split as evenly as it goes (the first T % world ranks one step longer)."""
    n, extra = divmod(T, world)
    start = rank * n + min(rank, extra)
    return slice(start, start + n + (rank < extra))


def step(model, f, x, y, args) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = local_loss(f(x), y, args)
    loss.backward()
    return loss.detach()


def measure_step(model, f, x, y, args) -> int:
    step(model, f, x, y, args)  # NB: compile and warm up outside the measurement
    with measure.track_peak("cpu") as m:
        step(model, f, x, y, args)
    return m["peak"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    add_task_args(p)
    p.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    return p.parse_args(argv)


def init() -> None:
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measure.prepare_cpu_measurement()  # NB: before any tensor exists (see adjoint_compile.measure)
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = dist.new_group([0])  # NB: every rank must call new_group, even those not in it
    torch.manual_seed(0)
    model = CopySSM(args.vocab, args.d_model, args.d_state, args.layers)
    x, y = batch(args, torch.Generator().manual_seed(1))

    single = None
    if rank == 0:
        f = torch.compile(model, backend="adjoint", options={"sequence_parallel": solo, "inner": args.inner})
        single = measure_step(model, f, x, y, args)
        torch._dynamo.reset()
    dist.barrier()

    f = torch.compile(model, backend="adjoint", options={"sequence_parallel": True, "inner": args.inner})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(2)  # NB: the same seed on every rank: the ranks see the same sequences
    sl = my_slice(args.seq_len, rank, world)
    for i in range(args.steps):
        xb, yb = batch(args, gen)
        loss = step(model, f, xb[:, sl], yb[:, sl], args)
        opt.step()
        dist.all_reduce(loss)  # only for the printout: the loss of the whole sequence
        if rank == 0 and (i % 10 == 0 or i == args.steps - 1):
            print(f"step {i:3d}  loss {loss.item():.4f}", flush=True)

    peak = measure_step(model, f, x[:, sl], y[:, sl], args)
    peaks = [None] * world
    dist.all_gather_object(peaks, (sl.stop - sl.start, peak))
    if rank == 0:
        mib = 2 ** 20
        print(f"\none training step, B={args.batch}, T={args.seq_len}, inner={args.inner} (CPU, gloo)")
        print("| run | steps | peak MiB | vs one process |\n|---|---|---|---|")
        print(f"| one process | {args.seq_len} | {single / mib:.1f} | 1.00x |")
        for r, (n, pk) in enumerate(peaks):
            print(f"| rank {r} of {world} | {n} | {pk / mib:.1f} | {pk / max(single, 1):.2f}x |")
    dist.barrier()  # NB: no rank tears its gloo connections down while another still prints or reads them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NB: past this point only static destructors run; the profiler behind measure.track_peak (kineto) can abort in
    # them ("terminate called without an active exception": twice under the full test suite's load, after the table
    # was printed), so each rank exits without them
    os._exit(code)
