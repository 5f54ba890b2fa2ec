"""``make demo``: train a small selective SSM on selective copying with backend="adjoint", then measure a long step.

Selective copying (Gu & Dao, Mamba §4.1): a sequence of T tokens is blank except for ``n_data`` data tokens at random
positions; the last ``n_data`` positions hold a marker, where the model must emit the data tokens in order. Solving
it needs content-dependent memory across the whole sequence, which is what a selective state space gives.

The demo's task is small enough to be learnt in under a minute on a CPU: 2 data tokens (6 values) to copy, trained
on sequences of ``--train-len`` 64 steps, 32 a step, with Mamba's initial step sizes (Δ from 0.001 to 0.1, so that
the state remembers across the sequence from the start): the accuracy goes from chance (1/6) to 1 in ~500 steps.
The trained model is then scored at T = ``--seq-len`` too, 64 times longer than anything it saw.

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
import math
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
#: a progress line every this many steps (or every tenth of the run, if longer) when stdout is not a terminal
PLAIN_PROGRESS_EVERY = 10
#: sequences the final accuracy is scored on, at the training length and at --seq-len
EVAL_BATCH = (256, 16)


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
    p.add_argument("--d-model", type=int, default=16, help="model width (default %(default)s)")
    p.add_argument("--d-state", type=int, default=4, help="SSM state size per channel (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="number of SSM layers (default %(default)s)")
    p.add_argument("--n-data", type=int, default=4, help="data tokens to copy per sequence (default %(default)s)")
    p.add_argument("--vocab", type=int, default=8,
                   help="vocabulary size, 2 of them blank and marker (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")


def parser() -> argparse.ArgumentParser:
    """``adjoint-compile demo``'s arguments."""
    p = argparse.ArgumentParser(prog="adjoint-compile demo", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--device", default="cpu", help="cpu or cuda, or cuda:N (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=4096,
                   help="sequence length T of the measured step, and of the second accuracy (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences in the measured step (default %(default)s)")
    p.add_argument("--train-len", type=int, default=64,
                   help="sequence length of the training run (default %(default)s: short enough to learn in a minute)")
    p.add_argument("--train-batch", type=int, default=32, help="sequences per training step (default %(default)s)")
    p.add_argument("--steps", type=int, default=1000,
                   help="training steps before the measurement (default %(default)s)")
    add_task_args(p)
    # NB: the demo's own task: 2 tokens to copy and a higher learning rate than the benchmarks' defaults, so that it
    # is learnt within the run (the module docstring)
    p.set_defaults(n_data=2, lr=1e-2)
    p.add_argument("--shard-size", type=int, default=None,
                   help="steps per shard of the sharded backward, at least 1 (default: chosen from the sizes)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="where demo.json and demo.png go (default: out/ of the checkout, ignored by git; "
                        "`make demo-figures` writes the checked-in benchmarks/results/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default %(default)s)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's arguments, checked before minutes of training: a value the run cannot use is argparse's error
    (one line naming the flag, exit status 2)."""
    p = parser()
    args = p.parse_args(argv)
    for flag in ("steps", "batch", "train_batch", "d_model", "d_state", "layers", "n_data", "shard_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            p.error(f"--{flag.replace('_', '-')} {v}: must be at least 1")
    if not args.lr > 0:
        p.error(f"--lr {args.lr}: must be positive")
    if args.vocab < 3:
        p.error(f"--vocab {args.vocab}: must be at least 3 (blank, marker and at least one data token)")
    for flag in ("seq_len", "train_len"):
        if getattr(args, flag) <= 2 * args.n_data:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must exceed 2 * --n-data = {2 * args.n_data} "
                    f"(the data tokens to copy, and as many markers at the end)")
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: the demo runs on cpu or cuda (cuda:N for one GPU of several)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out}: is a file; name a directory (made if missing) for demo.json and demo.png")
    return args


def init_step_sizes(stack: nn.Module, gen: torch.Generator, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Mamba's initialization of the step size Δ = softplus(dt_proj(x)): the bias of each channel's dt_proj set so
    that Δ starts log-uniform in [dt_min, dt_max]. The default bias (about 0) starts Δ at about 0.7, a decay of
    about 0.5 per step, under which nothing reaches the end of the sequence and the loss stays at chance."""
    with torch.no_grad():
        for layer in stack.layers:
            bias = layer.dt_proj.bias
            u = torch.rand(bias.shape, generator=gen)
            dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            bias.copy_(dt + torch.log(-torch.expm1(-dt)))          # softplus⁻¹(dt)


def accuracy(model: nn.Module, args: argparse.Namespace, seq_len: int, batch: int, seed: int) -> float:
    """The fraction of data tokens copied right, on ``batch`` fresh sequences of length ``seq_len`` (no gradient)."""
    tokens, target = selective_copy_batch(batch, seq_len, args.n_data, args.vocab, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (model(tokens.to(args.device)).argmax(-1) == target.to(args.device)).float().mean().item()


def train(model: nn.Module, args: argparse.Namespace, options: dict[str, Any]) -> dict[str, list[float]]:
    """Train with backend="adjoint" on sequences of ``args.train_len`` (``args.seq_len`` without it), showing a
    progress bar with the loss and copy accuracy. Returns each step's ``loss`` and ``acc``."""
    seq_len, batch = getattr(args, "train_len", args.seq_len), getattr(args, "train_batch", args.batch)
    gen = torch.Generator().manual_seed(args.seed)
    step_fn = torch.compile(model, backend="adjoint", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # NB: tqdm redraws its bar with carriage returns, which a log file keeps as one ever-growing line: off a
    # terminal, print a plain line every PLAIN_PROGRESS_EVERY steps instead
    tty = sys.stdout.isatty()
    bar = (_need("tqdm", "its progress bar").tqdm(range(args.steps), desc=f"train T={seq_len}", unit="step",
                                                   file=sys.stdout, dynamic_ncols=True) if tty else range(args.steps))
    start = time.perf_counter()
    # NB: one CPU thread while training: a step of this size is a few hundred small ops, where a second thread
    # only waits on the first, and on a machine shared with other jobs those waits made the steps ~20x slower
    threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    try:
        return _train_steps(step_fn, opt, bar, tty, gen, seq_len, batch, args, start)
    finally:
        torch.set_num_threads(threads)


def _train_steps(step_fn: Any, opt: torch.optim.Optimizer, bar: Any, tty: bool, gen: torch.Generator, seq_len: int,
                 batch: int, args: argparse.Namespace, start: float) -> dict[str, list[float]]:
    losses: list[float] = []
    accs: list[float] = []
    every = max(PLAIN_PROGRESS_EVERY, args.steps // 10)
    for i in bar:
        tokens, target = selective_copy_batch(batch, seq_len, args.n_data, args.vocab, gen)
        tokens, target = tokens.to(args.device), target.to(args.device)
        logits = step_fn(tokens)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc = (logits.argmax(-1) == target).float().mean().item()
        losses.append(loss.item())
        accs.append(acc)
        if tty:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
        elif (i + 1) % every == 0 or i + 1 == args.steps:
            print(f"train T={seq_len}: step {i + 1}/{args.steps}, loss {loss.item():.3f}, acc {acc:.2f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return {"loss": losses, "acc": accs}


def plot(rows: list[dict[str, Any]], curve: dict[str, list[float]], final: dict[str, float], args: argparse.Namespace,
         path: Path) -> None:
    """Three panels: the training loss and accuracy, and peak memory and step time of each method."""
    matplotlib = _need("matplotlib", "its plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(curve["loss"], color="#4c72b0", lw=0.8)
    ax[0].set(xlabel="step", ylabel="cross-entropy", title=f"selective copying, trained at T={args.train_len}\n"
              + ", ".join(f"accuracy {a:.2f} at T={t}" for t, a in final.items()))
    acc_ax = ax[0].twinx()
    k = 10                                                   # a running mean: one step scores only a few tokens
    smooth = [sum(curve["acc"][max(0, i - k + 1): i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(curve["acc"]))]
    acc_ax.plot(smooth, color="#dd8452")
    acc_ax.axhline(1 / (args.vocab - 2), color="#999999", ls=":", lw=0.8)
    acc_ax.set(ylabel="accuracy (orange; dotted: chance)", ylim=(0, 1.02))
    names = [r["method"] for r in rows]
    colors = ["#999999", "#4c72b0", "#dd8452", "#55a868"][: len(rows)]
    ax[1].bar(names, [r["peak_bytes"] / 2**20 for r in rows], color=colors)
    ax[1].set(title=f"peak memory of one training step (T={args.seq_len}, B={args.batch})", ylabel="MiB")
    ax[2].bar(names, [r["step_s"] for r in rows], color=colors)
    ax[2].set(title="step time (median)", ylabel="s")
    fig.suptitle(f"adjoint-compile demo on {rows[0]['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _need("matplotlib", "its plot")  # NB: now, not after minutes of training
    # NB: no measure.prepare_cpu_measurement(): the table counts live tensor bytes (the profiler's memory events),
    # which malloc's settings do not change, and malloc pinned for resident-memory counts made every compile of
    # the run (training's and the measurement's) ~10x slower.
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    torch.manual_seed(args.seed)
    stack = selective_ssm.SSMStack(args.d_model, args.d_state, args.layers)
    init_step_sizes(stack, torch.Generator().manual_seed(args.seed))
    model = CopyModel(stack, args.vocab, args.d_model, args.n_data).to(args.device)


    options: dict[str, Any] = {}
    if args.shard_size is not None:
        options["shard_size"] = args.shard_size
    tokens, _ = selective_copy_batch(args.batch, args.seq_len, args.n_data, args.vocab, torch.Generator().manual_seed(0))
    report = explain(model, tokens.to(args.device), options=options)
    print(report, flush=True)
    torch._dynamo.reset()

    curve = train(model, args, options)
    losses = curve["loss"]
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} after {len(losses)} steps")
    final = {T: accuracy(model, args, T, n, seed=2) for T, n in zip((args.train_len, args.seq_len), EVAL_BATCH)}
    print("final accuracy: " + ", ".join(f"{a:.2f} at T={T}" for T, a in final.items())
          + f" (held-out sequences; chance {1 / (args.vocab - 2):.2f})", flush=True)

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
    (out / "demo.json").write_text(json.dumps({"args": run_args, "final_accuracy": {str(T): a for T, a in final.items()},
                                               "losses": losses, "accuracies": curve["acc"], "methods": rows},
                                              indent=1))
    plot(rows, curve, final, args, out / "demo.png")
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
