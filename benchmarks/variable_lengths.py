"""Training on data as it comes: a loop over sequence lengths drawn from a long-tailed distribution (256 … 16384),
for adjoint, ``torch.compile`` (inductor) and activation checkpointing, side by side in one run.

Each method runs in its own fresh process on the same lengths (same seed), on the shipped selective SSM stack with
its loss compiled in (``model(x).square().mean()``):

* pass 1, timed as a user sees it: every step of the loop (forward + backward) with its compiles; total seconds, and
  the compile count (dynamo's graphs; for adjoint also the shard programs compiled);
* pass 2, memory: one more step per distinct length under ``adjoint_compile.measure.track_peak`` (live tensor bytes
  on CPU, ``max_memory_allocated`` on CUDA), after everything is compiled.

Writes ``benchmarks/results/variable_lengths_<device>.json``, ``variable_lengths.png`` (peak per length per method)
and prints the table.

    python benchmarks/variable_lengths.py                  # CPU: 16 lengths up to 16384 (about 10 minutes, 2 cores)
    python benchmarks/variable_lengths.py --n 40 --device cuda
    python benchmarks/variable_lengths.py --model hf-mamba --max-len 4096 --methods adjoint,compile
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("adjoint", "compile", "checkpoint")


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n lengths, most of them short: T = lo·(hi/lo)^(u²), u uniform; the longest, hi, last."""
    rng = random.Random(seed)
    out = [round(lo * (hi / lo) ** (rng.random() ** 2)) for _ in range(n - 1)]
    return out + [hi]


def _model(args: argparse.Namespace):
    """The shipped SSM stack, or transformers' Mamba (``--model hf-mamba``: a language model whose loss is the
    library's own, ``model(ids, labels=ids).loss``, wrapped so that ``model(ids).square().mean()`` is that loss)."""
    import torch

    if args.model == "ssm":
        from adjoint_compile.models.selective_ssm import SSMStack
        return SSMStack(args.d_model, args.d_state, args.layers)
    import transformers

    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, state_size=args.d_state,
                                   num_hidden_layers=args.layers, expand=2, conv_kernel=4)
    lm = transformers.MambaForCausalLM(cfg)

    class Loss(torch.nn.Module):  # NB: sqrt, so that the step's .square().mean() is the LM's loss
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids, labels=ids).loss.sqrt()
    return Loss()


def _inputs(args: argparse.Namespace, T: int, dev):
    import torch

    if args.model == "ssm":
        return torch.randn(args.batch, T, args.d_model, device=dev)
    return torch.randint(0, args.vocab, (args.batch, T), device=dev)


def run_method(method: str, Ts: list[int], args: argparse.Namespace) -> dict:
    """One method's two passes (module docstring), in this process."""
    import torch

    import adjoint_compile as ac
    from adjoint_compile import measure
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = _model(args).to(dev)
    shard_compiles = []
    if method == "adjoint":
        import adjoint_compile.runtime.shard_program as sp
        real = sp.compile_inner

        def counting(*args, **kwargs):
            shard_compiles.append(1)
            return real(*args, **kwargs)
        sp.compile_inner = counting
        step = torch.compile(lambda x: model(x).square().mean(), backend="adjoint")
    elif method == "compile":
        step = torch.compile(lambda x: model(x).square().mean())
    else:
        ck = measure.checkpoint_layers(model)

        def step(x):
            return ck(x).square().mean()
    xs = {T: _inputs(args, T, dev) for T in sorted(set(Ts))}
    measure.start_timing() if dev.type == "cuda" else None
    t0 = time.perf_counter()
    for T in Ts:
        step(xs[T]).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    peaks = {}
    for T in sorted(set(Ts)):
        with measure.track_peak(dev) as m:
            step(xs[T]).backward()
        peaks[T] = m["peak"]
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    out = {"method": method, "total_s": total, "graphs": graphs, "shard_program_compiles": len(shard_compiles),
           "peak_bytes": {str(T): p for T, p in peaks.items()}}
    if method == "adjoint":
        rep = ac.report(step)
        out["fallbacks"] = [f.cause for f in rep.fallbacks]
        out["rewritten"] = sum(r.rewrite != "none" for r in rep.regions)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="ssm", choices=("ssm", "hf-mamba"),
                   help="the shipped SSM stack, or transformers' Mamba LM with its own loss")
    p.add_argument("--vocab", type=int, default=256, help="--model hf-mamba: the vocabulary")
    p.add_argument("--n", type=int, default=16, help="number of steps (lengths drawn, the longest last)")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-state", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method, print its JSON
    args = p.parse_args(argv)
    Ts = lengths(args.n, args.min_len, args.max_len, args.seed)
    if args.one:
        print("RESULT " + json.dumps(run_method(args.one, Ts, args)), flush=True)
        return
    print(f"lengths ({len(Ts)} steps, {len(set(Ts))} distinct): {Ts}", flush=True)
    load = os.getloadavg()[0]
    results = []
    for method in args.methods.split(","):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", method]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{method} failed (exit {proc.returncode})")
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        print(f"{method:10s} total {r['total_s']:7.1f} s  graphs {r['graphs']:2d}  shard programs "
              f"{r['shard_program_compiles']:3d}  peak at T={Ts[-1]}: {r['peak_bytes'][str(Ts[-1])] / 2**20:8.1f} MiB",
              flush=True)
    by = {r["method"]: r for r in results}
    longest = str(Ts[-1])
    ratios = {}
    if "adjoint" in by and "compile" in by:
        ratios = {"peak_at_longest_adjoint_over_compile": by["adjoint"]["peak_bytes"][longest]
                  / max(1, by["compile"]["peak_bytes"][longest]),
                  "total_time_adjoint_over_compile": by["adjoint"]["total_s"] / by["compile"]["total_s"]}
        print(f"adjoint / compile: peak at T={longest} {ratios['peak_at_longest_adjoint_over_compile']:.3f}x, total "
              f"time {ratios['total_time_adjoint_over_compile']:.2f}x")
    import torch
    meta = {"device": args.device if args.device != "cpu" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "model": f"{'SSMStack' if args.model == 'ssm' else 'transformers MambaForCausalLM'}"
            f" d_model={args.d_model} d_state={args.d_state} layers={args.layers}"
            f"{'' if args.model == 'ssm' else f' vocab={args.vocab}'}, batch {args.batch}, loss compiled in",
            "load_average_1min_at_start": load,
            "lengths": Ts}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.model == "ssm" else f"_{args.model}"
    (out / f"variable_lengths{tag}_{args.device}.json").write_text(json.dumps({"meta": meta, "results": results,
                                                                          "ratios": ratios}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install 'adjoint-compile[demo]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        T = sorted(int(t) for t in r["peak_bytes"])
        ax.plot(T, [r["peak_bytes"][str(t)] / 2**20 for t in T], "o-", ms=3,
                label=f"{r['method']} (loop {r['total_s']:.0f} s, {r['graphs']} graphs)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak memory of one training step (MiB)")
    ax.set_title(f"{len(Ts)} steps over {len(set(Ts))} lengths, {meta['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"variable_lengths{tag}.png", dpi=120)


if __name__ == "__main__":
    main()
