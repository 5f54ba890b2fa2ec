"""Peak memory and step time of a K-layer selective SSM training step against sequence length T.

Methods, on copies of one model (examples/selective_ssm.py, ``SSMStack(d_model, d_state, n_layers)``):

* ``eager``      plain autograd: saves every layer's [B, T, D, N] state-expanded activations (O(K·T·D·N));
* ``checkpoint`` per-layer activation checkpointing (torch.utils.checkpoint): layer inputs saved, one layer
                 recomputed at a time (still one layer's full-length [B, T, D, N] activations);
* ``compile``    plain ``torch.compile`` (inductor);
* ``adjoint``    ``torch.compile(backend="adjoint")``: the whole stack is one time-local region run by the sharded
                 exact adjoint (runtime/sharded.py): saves the region input and K states per shard boundary, and
                 recomputes one shard of S steps at a time (``--shard-size``, or the backend's default rule).

Peak memory: on CPU the growth of the process's resident-memory high-water mark over one step (adjoint_compile.measure;
a dispatch-mode counter would make dynamo run the compiled methods eagerly), on CUDA ``torch.cuda.max_memory_allocated``;
all memory is measured first, then all step times (CPU peaks are only faithful before timing: see measure.py);
step time: median of ``--repeats`` steps;
gradient error: max over parameters of max|g - g_eager| / max|g_eager|.  Prints a table per T, writes
``benchmarks/results/memory_<device>.json`` and a plot ``memory_<device>.png`` (peak memory and time vs T).

    python benchmarks/memory.py                        # quick CPU sizes (about a minute or two on 2 cores)
    python benchmarks/memory.py --device cuda --full   # long sequences
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import adjoint_compile as ac  # noqa: E402
from adjoint_compile.measure import (  # noqa: E402
    checkpoint_layers, format_table, max_rel_error, measure_steps)

log = logging.getLogger(__name__)

QUICK = dict(lengths=[1024, 2048, 4096, 8192], d_model=32, d_state=8, n_layers=4, batch=2, repeats=2)
FULL = dict(lengths=[1024, 4096, 16384, 65536], d_model=256, d_state=16, n_layers=8, batch=1, repeats=3)


def _compiled(m: torch.nn.Module, method: str, options: dict) -> Callable[..., torch.Tensor]:
    if method == "compile":
        return torch.compile(m)
    f = torch.compile(m, backend="adjoint", options=options)

    def call(x: torch.Tensor) -> torch.Tensor:
        out = f(x)
        graphs = ac.report(f).compiled
        if not graphs or not graphs[-1].lowered:
            raise RuntimeError("the adjoint backend did not lower the stack: "
                               f"{[r.reason for r in graphs[-1].regions] if graphs else 'no graph'}")
        return out

    call.compiled = f  # type: ignore[attr-defined]
    return call


def _shard_size_used(run_m: Callable[..., torch.Tensor]) -> int | None:
    graphs = ac.report(run_m.compiled).compiled  # type: ignore[attr-defined]
    res = graphs[-1] if graphs else None
    return next((r.details.get("shard_size") for r in res.regions if r.rewrite == "adjoint"), None) if res else None


def run(args: argparse.Namespace) -> list[dict]:
    """Every (T, method): peak memory first, then step time (adjoint_compile.measure.measure_steps)."""
    import selective_ssm

    device = torch.device(args.device)
    shard_used: dict[int, int | None] = {}
    data: dict[int, tuple] = {}
    for T in args.lengths:
        torch.manual_seed(0)
        model = selective_ssm.SSMStack(args.d_model, args.d_state, args.n_layers).to(device)
        data[T] = (model, torch.randn(args.batch, T, args.d_model, device=device),
                   torch.randn(args.batch, T, args.d_model, device=device))

    def builder(T: int, method: str) -> Callable[[], tuple[Callable[[], None], torch.nn.Module]]:
        def build() -> tuple[Callable[[], None], torch.nn.Module]:
            model, x, w = data[T]
            m = checkpoint_layers(model) if method == "checkpoint" else copy.deepcopy(model)
            if method in ("compile", "adjoint"):
                # S None: the backend's default (runtime/sharded.py default_shard_size)
                run_m = _compiled(m, method, {"inner": args.inner, "shard_size": args.shard_size})
                fwd = (lambda: run_m(x))
            else:
                fwd = (lambda: m(x))

            def step() -> None:
                for p in m.parameters():
                    p.grad = None
                (fwd() * w).mean().backward()
                if method == "adjoint":
                    shard_used[T] = _shard_size_used(run_m)

            return step, m
        return build

    methods = ("eager", "compile", "checkpoint", "adjoint")
    t0 = time.perf_counter()
    got = measure_steps({(T, meth): builder(T, meth) for T in args.lengths for meth in methods}, device,
                        repeats=args.repeats,
                        progress=lambda msg: print(f"  [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True))
    rows: list[dict] = []
    for T in args.lengths:
        ref = got[(T, "eager")]["grads"]
        part = [{"method": meth, "device": str(device), "T": T, "peak_bytes": got[(T, meth)]["peak_bytes"],
                 "step_s": got[(T, meth)]["step_s"],
                 "max_grad_rel_err": None if meth == "eager" else max_rel_error(got[(T, meth)]["grads"], ref),
                 "shard_size": shard_used.get(T) if meth == "adjoint" else None} for meth in methods]
        print(f"\nT={T}  B={args.batch} d_model={args.d_model} d_state={args.d_state} layers={args.n_layers} "
              f"shard_size={shard_used.get(T)} device={device}")
        print(format_table(part))
        rows.extend(part)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        Ts = [r["T"] for r in rs]
        ax_m.plot(Ts, [r["peak_bytes"] / 2**20 for r in rs], "o-", label=method)
        ax_t.plot(Ts, [r["step_s"] for r in rs], "o-", label=method)
    for ax, ylabel in ((ax_m, "peak memory of one training step (MiB)"), (ax_t, "step time (s, median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--full", action="store_true", help="long sequences and a wider model (meant for a GPU)")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths T")
    p.add_argument("--d-model", type=int)
    p.add_argument("--d-state", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--shard-size", type=int, default=None,
                   help="steps per shard (default: the backend's rule, runtime/sharded.py default_shard_size)")
    p.add_argument("--inner", default="inductor", choices=["eager", "aot_eager", "inductor"],
                   help="inner compiler of the adjoint backend (default inductor, like the compile baseline)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1 on CPU: steadier timings on a shared machine)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    for k, v in (FULL if args.full else QUICK).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.shard_size is not None and args.shard_size < 1:
        p.error(f"--shard-size={args.shard_size}: expected an int >= 1")
    logging.basicConfig(level=logging.WARNING)
    from adjoint_compile.measure import prepare_cpu_measurement

    prepare_cpu_measurement()
    if args.threads or torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads or 1)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device).type
    meta = {k: getattr(args, k) for k in ("lengths", "d_model", "d_state", "n_layers", "batch", "repeats",
                                          "shard_size", "inner", "full")}
    import adjoint_compile.ops as ops

    meta.update(linear_scan=f"{getattr(ops.linear_scan, '__module__', '?')}.linear_scan", device=args.device, torch=torch.__version__, machine=platform.machine(),
                threads=torch.get_num_threads(),
                gpu=torch.cuda.get_device_name() if dev == "cuda" else None, cpu_count=os.cpu_count())
    (args.out / f"memory_{dev}.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2) + "\n")
    title = (f"SSMStack d_model={args.d_model} d_state={args.d_state} layers={args.n_layers} batch={args.batch} "
             f"on {args.device}: eager, torch.compile, per-layer checkpointing, backend=\"adjoint\"")
    plot(rows, args.out / f"memory_{dev}.png", title)
    print(f"\nwrote {args.out / f'memory_{dev}.json'} and {args.out / f'memory_{dev}.png'}")


if __name__ == "__main__":
    main()
