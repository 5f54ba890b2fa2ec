"""``make demo``: train a small selective SSM on a long-context selective-copying task with backend="adjoint".

Selective copying (Gu & Dao, Mamba §4.1): a sequence of T tokens is blank except for ``n_data`` data tokens at random
positions; the last ``n_data`` positions hold a marker, where the model must emit the data tokens in order. Solving
it needs content-dependent memory across the whole sequence, which is what a selective state space gives.

After training it measures one training step of the same model four ways, side by side in one run: eager
autograd, torch.compile (inductor), per-layer activation checkpointing, and backend="adjoint" — peak memory, step
time and the largest gradient difference against eager autograd — and writes a table, JSON and a plot to ``out/``
(in a checkout: its ``out/``, ignored by git; from an installed package: ``./out``). The checked-in figures in
``benchmarks/results/`` change only on purpose: ``make demo-figures`` (``--out benchmarks/results``).

Needs the ``demo`` extra (matplotlib, tqdm): ``pip install "adjoint-compile[demo]"``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from . import measure
from .explain import explain
from .models import selective_ssm

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
BLANK, MARKER = 0, 1
#: where a user's run writes its results: a checkout's out/ (ignored by git, so running the demo never changes
#: tracked files); from an installed package, out/ in the working directory
DEFAULT_OUT = ROOT / "out" if (ROOT / "pyproject.toml").is_file() and (ROOT / "adjoint_compile").is_dir() else Path("out")
#: a progress line every this many steps when stdout is not a terminal (a log file, CI)
PLAIN_PROGRESS_EVERY = 10


def _need(module: str, what: str) -> Any:
    """Import an optional dependency of the demo, or stop with the extra that provides it."""
    try:
        return __import__(module)
    except ImportError:
        raise SystemExit(f"adjoint-compile demo needs {module} for {what}: pip install \"adjoint-compile[demo]\"") from None


def selective_copy_batch(batch: int, seq_len: int, n_data: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, T] and targets [B, n_data]: data tokens (values 2..vocab-1) scattered in the first T - n_data steps."""
    if seq_len <= 2 * n_data:
        raise ValueError(f"seq_len={seq_len} must exceed 2 * n_data={2 * n_data}")
    tokens = torch.full((batch, seq_len), BLANK, dtype=torch.long)
    data = torch.randint(2, vocab, (batch, n_data), generator=gen)
    pos = torch.rand(batch, seq_len - n_data, generator=gen).argsort(dim=1)[:, :n_data].sort(dim=1).values
    tokens.scatter_(1, pos, data)
    tokens[:, -n_data:] = MARKER
    return tokens, data


class CopyModel(nn.Module):
    """Embedding -> SSM stack -> logits at the last ``n_data`` positions."""

    def __init__(self, stack: nn.Module, vocab: int, d_model: int, n_data: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.stack = stack
        self.head = nn.Linear(d_model, vocab)
        self.n_data = n_data

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.stack(self.embed(tokens))
        return self.head(h[:, -self.n_data :])


def add_task_args(p: argparse.ArgumentParser) -> None:
    """The model's and the selective-copying task's arguments, shared by the demo, the fidelity benchmark and the
    sequence-parallel example."""
    p.add_argument("--d-model", type=int, default=16, help="model width (default 16)")
    p.add_argument("--d-state", type=int, default=4, help="SSM state size per channel (default 4)")
    p.add_argument("--layers", type=int, default=2, help="number of SSM layers (default 2)")
    p.add_argument("--n-data", type=int, default=4, help="data tokens to copy per sequence (default 4)")
    p.add_argument("--vocab", type=int, default=8, help="vocabulary size, 2 of them blank and marker (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")


def parser() -> argparse.ArgumentParser:
    """``adjoint-compile demo``'s arguments."""
    p = argparse.ArgumentParser(prog="adjoint-compile demo", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length T (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--steps", type=int, default=150, help="training steps before the measurement (default 150)")
    add_task_args(p)
    p.add_argument("--shard-size", type=int, default=None,
                   help="steps per shard of the sharded backward (default: chosen from the sizes)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="where demo.json and demo.png go (default: out/ of the checkout, ignored by git; "
                        "`make demo-figures` writes the checked-in benchmarks/results/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default 0)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def train(model: nn.Module, args: argparse.Namespace, options: dict[str, Any]) -> list[float]:
    """Train with backend="adjoint", showing a progress bar with the loss and copy accuracy."""

    gen = torch.Generator().manual_seed(args.seed)
    step_fn = torch.compile(model, backend="adjoint", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    # NB: tqdm redraws its bar with carriage returns, which a log file keeps as one ever-growing line: off a
    # terminal, print a plain line every PLAIN_PROGRESS_EVERY steps instead
    tty = sys.stdout.isatty()
    bar = (_need("tqdm", "its progress bar").tqdm(range(args.steps), desc=f"train T={args.seq_len}", unit="step",
                                                   file=sys.stdout, dynamic_ncols=True) if tty else range(args.steps))
    start = time.perf_counter()
    for i in bar:
        tokens, target = selective_copy_batch(args.batch, args.seq_len, args.n_data, args.vocab, gen)
        tokens, target = tokens.to(args.device), target.to(args.device)
        logits = step_fn(tokens)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc = (logits.argmax(-1) == target).float().mean().item()
        losses.append(loss.item())
        if tty:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
        elif (i + 1) % PLAIN_PROGRESS_EVERY == 0 or i + 1 == args.steps:
            print(f"train T={args.seq_len}: step {i + 1}/{args.steps}, loss {loss.item():.3f}, acc {acc:.2f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return losses


def plot(rows: list[dict[str, Any]], losses: list[float], args: argparse.Namespace, path: Path) -> None:
    """Three panels: the training loss, and peak memory and step time of each method."""
    matplotlib = _need("matplotlib", "its plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(losses)
    ax[0].set(title=f"selective copying, T={args.seq_len}", xlabel="step", ylabel="cross-entropy")
    names = [r["method"] for r in rows]
    colors = ["#999999", "#4c72b0", "#dd8452", "#55a868"][: len(rows)]
    ax[1].bar(names, [r["peak_bytes"] / 2**20 for r in rows], color=colors)
    ax[1].set(title="peak memory of one training step", ylabel="MiB")
    ax[2].bar(names, [r["step_s"] for r in rows], color=colors)
    ax[2].set(title="step time (median)", ylabel="s")
    fig.suptitle(f"adjoint-compile demo on {rows[0]['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _need("matplotlib", "its plot")  # NB: now, not after minutes of training


    # NB: before any tensor exists, so that no freed block of the training run lingers in malloc's heap and
    # hides the measured step's allocations from the resident-memory high-water mark.
    measure.prepare_cpu_measurement()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    torch.manual_seed(args.seed)
    stack = selective_ssm.SSMStack(args.d_model, args.d_state, args.layers)
    model = CopyModel(stack, args.vocab, args.d_model, args.n_data).to(args.device)


    options: dict[str, Any] = {}
    if args.shard_size:
        options["shard_size"] = args.shard_size
    tokens, _ = selective_copy_batch(args.batch, args.seq_len, args.n_data, args.vocab, torch.Generator().manual_seed(0))
    report = explain(model, tokens.to(args.device), options=options)
    print(report, flush=True)
    torch._dynamo.reset()

    losses = train(model, args, options)
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} after {len(losses)} steps")

    tokens, target = selective_copy_batch(args.batch, args.seq_len, args.n_data, args.vocab, torch.Generator().manual_seed(1))
    tokens, target = tokens.to(args.device), target.to(args.device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

    print(f"measuring one training step four ways (B={args.batch}, T={args.seq_len}, device={args.device}) ...", flush=True)
    rows = measure.compare_training_step(model, (tokens,), loss_fn, args.device, options)
    print(measure.format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # NB: not --out itself: a results file must not record a path of the machine that wrote it
    run_args = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "demo.json").write_text(json.dumps({"args": run_args, "losses": losses, "methods": rows}, indent=1))
    plot(rows, losses, args, out / "demo.png")
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
