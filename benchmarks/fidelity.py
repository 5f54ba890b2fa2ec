"""Truncated adjoint (``mode="truncated"``): how close its gradients are to the exact ones, and what that does to
training, for windows W in {1, 4, 16, 64, 256, T} on the demo model and task (adjoint_compile/demo.py: a 2-layer
selective SSM, examples/selective_ssm.py, on selective copying).

* gradient fidelity: on one fixed batch, all parameter gradients (one vector) of ``torch.compile(backend="adjoint",
  options={"mode": "truncated", "window": W})`` against exact mode's: cosine similarity and relative error
  ‖g_W - g‖ / ‖g‖; at the initial weights and at the weights the exact run ends with;
* a short training run per W (same seed, same batches, AdamW): the loss after N steps (mean of the last 20) and the
  copy accuracy on a held-out batch.

Writes ``benchmarks/results/fidelity.json`` and ``fidelity.png`` (with the device it ran on).

    python benchmarks/fidelity.py                  # CPU defaults (100 steps): about 6 minutes on 2 cores
    python benchmarks/fidelity.py --steps 300      # the checked-in results (about 15 minutes)
    python benchmarks/fidelity.py --seq-len 1024 --steps 600 --device cuda
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adjoint_compile.demo import CopyModel, add_task_args, selective_copy_batch  # noqa: E402
from adjoint_compile.models.selective_ssm import SSMStack  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--windows", default="1,4,16,64,256", help="comma-separated W < T; T (exact) is always added")
    p.add_argument("--shard-size", type=int, default=64)
    add_task_args(p)
    p.add_argument("--inner", default="aot_eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--replot", action="store_true", help="only redraw fidelity.png from --out's fidelity.json")
    return p.parse_args(argv)


def options(args: argparse.Namespace, W: int) -> dict:
    base = {"shard_size": args.shard_size, "inner": args.inner}
    return {**base, "mode": "exact"} if W >= args.seq_len else {**base, "mode": "truncated", "window": W}


def flat_grad(model: torch.nn.Module, opts: dict, tokens: torch.Tensor, target: torch.Tensor, vocab: int):
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=opts)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(f(tokens).reshape(-1, vocab), target.reshape(-1)).backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


def fidelity(g: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"cosine": float(g @ ref / (g.norm() * ref.norm())), "rel_err": float((g - ref).norm() / ref.norm())}


def train(model: torch.nn.Module, args: argparse.Namespace, W: int) -> dict:
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options=options(args, W))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        tokens, target = (x.to(args.device) for x in selective_copy_batch(args.batch, args.seq_len, args.n_data,
                                                                          args.vocab, gen))
        loss = F.cross_entropy(f(tokens).reshape(-1, args.vocab), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    tokens, target = (x.to(args.device) for x in selective_copy_batch(
        64, args.seq_len, args.n_data, args.vocab, torch.Generator().manual_seed(12345)))
    with torch.no_grad():
        acc = float((model(tokens).argmax(-1) == target).float().mean())
    tail = losses[-20:]
    return {"losses": losses, "final_loss": sum(tail) / len(tail), "heldout_copy_accuracy": acc,
            "train_seconds": seconds}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, T = res["runs"], res["args"]["seq_len"]
    ws = [r["window"] for r in runs]
    labels = [f"T={w}" if w >= T else str(w) for w in ws]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    floor = 1e-17  # exact zeros (W = T) drawn here on the log scale
    for key, style in (("init", "o-"), ("trained", "s--")):
        ax[0].plot(range(len(ws)), [max(1 - r["fidelity"][key]["cosine"], floor) for r in runs], style,
                   label=f"{key} weights")
        ax[1].plot(range(len(ws)), [max(r["fidelity"][key]["rel_err"], floor) for r in runs], style,
                   label=f"{key} weights")
    for a, t in ((ax[0], "1 - gradient cosine vs exact"), (ax[1], "gradient relative error vs exact")):
        a.set_xticks(range(len(ws)), labels)
        a.set(title=t, xlabel="window W", yscale="log")
        a.legend(fontsize=8)
    for r, lab in zip(runs, labels):
        losses = torch.tensor(r["train"]["losses"])  # NB: a 10-step running mean, shorter for short runs
        ax[2].plot(losses.unfold(0, min(10, len(losses)), 1).mean(1).tolist(), label=f"W={lab}")
    ax[2].set(title=f"training loss (10-step mean), T={T}", xlabel="step", ylabel="cross-entropy")
    ax[2].legend(fontsize=7)
    fig.suptitle(f"truncated adjoint on the demo task, {res['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        out = Path(args.out)
        plot(json.loads((out / "fidelity.json").read_text()), out / "fidelity.png")
        return 0
    T = args.seq_len
    windows = sorted({w for w in map(int, args.windows.split(",")) if w < T}) + [T]
    torch.manual_seed(args.seed)
    init = CopyModel(SSMStack(args.d_model, args.d_state, args.layers), args.vocab, args.d_model,
                     args.n_data).to(args.device)
    batch = [x.to(args.device) for x in selective_copy_batch(args.batch, T, args.n_data, args.vocab,
                                                             torch.Generator().manual_seed(7))]
    trained = {}
    for W in reversed(windows):  # T (exact) first: its final weights are the "trained" point
        model = copy.deepcopy(init)
        print(f"training W={W} ({args.steps} steps, T={T}) ...", flush=True)
        trained[W] = (train(model, args, W), model)
    exact_end = trained[T][1]
    ref = {"init": flat_grad(copy.deepcopy(init), options(args, T), *batch, args.vocab),
           "trained": flat_grad(copy.deepcopy(exact_end), options(args, T), *batch, args.vocab)}
    runs = []
    for W in windows:
        fid = {k: fidelity(flat_grad(copy.deepcopy(m), options(args, W), *batch, args.vocab), ref[k])
               for k, m in (("init", init), ("trained", exact_end))}
        tr = trained[W][0]
        runs.append({"window": W, "exact": W >= T, "fidelity": fid, "train": tr})
        print(f"W={W:>5}: cosine {fid['init']['cosine']:.4f} (trained {fid['trained']['cosine']:.4f}), "
              f"rel err {fid['init']['rel_err']:.3g} (trained {fid['trained']['rel_err']:.3g}); "
              f"loss after {args.steps} steps {tr['final_loss']:.3f}, held-out copy accuracy "
              f"{tr['heldout_copy_accuracy']:.3f}, {tr['train_seconds']:.0f} s", flush=True)
    dev = (torch.cuda.get_device_name() if args.device.startswith("cuda")
           else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    res = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "device": dev, "torch": torch.__version__, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "fidelity.png")
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.png'} (device: {dev})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
