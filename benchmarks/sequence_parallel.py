"""Per-rank peak memory and step time of one training step with ``sequence_parallel`` at world sizes 1, 2 and 4
(gloo on CPU; one process per rank, spawned here), on the selective SSM stack of examples/selective_ssm.py.

    python benchmarks/sequence_parallel.py [--seq-len 16384] [--worlds 1 2 4]

Each rank holds T / world steps of the same sequence; peak = growth of the rank's resident memory during one
training step after a warm-up step (adjoint_compile/measure.py), step time = median of 3 steps (after the memory
is measured). The reference row is one process without ``sequence_parallel`` (the sharded exact adjoint), measured
the same way. Writes benchmarks/results/sequence_parallel_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from adjoint_compile import measure  # noqa: E402

B, D, N, LAYERS = 4, 16, 4, 2


def _model():
    spec = importlib.util.spec_from_file_location("example_selective_ssm", ROOT / "examples" / "selective_ssm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    return mod.SSMStack(D, N, LAYERS)


def step_and_peak(model: torch.nn.Module, f: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, int]:
    """One training step of ``f`` (loss (f(x) * w).sum()) and its peak memory, measured after a warm-up step that
    all ranks finish first."""
    def step():
        for p in model.parameters():
            p.grad = None
        (f(x) * w).sum().backward()

    step()
    dist.barrier()
    with measure.track_peak("cpu") as m:
        step()
    return step, m["peak"]


def _rank(rank: int, world: int, port: int, T: int, sp: bool, inner: str, out: str) -> None:
    measure.prepare_cpu_measurement()  # NB: before any tensor exists (adjoint_compile/measure.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    model = _model()
    n, extra = divmod(T, world)
    start = rank * n + min(rank, extra)
    sl = slice(start, start + n + (rank < extra))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, T, D, generator=g)[:, sl].clone(), torch.randn(B, T, D, generator=g)[:, sl].clone()
    opts = {"inner": inner, **({"sequence_parallel": True} if sp else {})}
    f = torch.compile(model, backend="adjoint", options=opts)

    step, peak = step_and_peak(model, f, x, w)
    dist.barrier()
    times = []
    measure.start_timing()
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "steps": sl.stop - sl.start, "peak_bytes": peak,
                                  "step_s": statistics.median(times)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(world: int, T: int, sp: bool, inner: str, tmp: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"w{world}_{int(sp)}.json"
    mp.start_processes(_rank, args=(world, port, T, sp, inner, str(out)), nprocs=world, start_method="spawn")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".seqpar_tmp"
    tmp.mkdir(exist_ok=True)
    results = {}
    for world in args.worlds:
        t0 = time.perf_counter()
        results[world] = run(world, args.seq_len, True, args.inner, tmp)
        print(f"world {world}: {results[world]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    ref = run(1, args.seq_len, False, args.inner, tmp)[0]
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    base = max(r["peak_bytes"] for r in results[min(results)])
    base_t = max(r["step_s"] for r in results[min(results)])
    mib = 2 ** 20
    lines = [f"One training step of the selective SSM stack (examples/selective_ssm.py: d_model {D}, d_state {N}, "
             f"{LAYERS} layers), B={B}, T={args.seq_len}, inner={args.inner}; {platform.machine()} CPU, "
             f"1 thread per process, on a shared {mp.cpu_count()}-core machine (timings noisy)",
             "", "| run | steps per rank | peak MiB per rank (max over ranks) | vs world 1 | step s (slowest rank) |"
             " vs world 1 |", "|---|---|---|---|---|---|"]
    rows = []
    for world, rs in results.items():
        pk, st = max(r["peak_bytes"] for r in rs), max(r["step_s"] for r in rs)
        steps = "/".join(str(r["steps"]) for r in rs)
        rows.append({"world": world, "sequence_parallel": True, "ranks": rs, "peak_bytes": pk, "step_s": st,
                     "peak_vs_world1": pk / base, "time_vs_world1": st / base_t})
        lines.append(f"| sequence_parallel, world {world} | {steps} | {pk / mib:.1f} | {pk / base:.2f}x | {st:.2f} | "
                     f"{st / base_t:.2f}x |")
    rows.append({"world": 1, "sequence_parallel": False, "ranks": [ref], "peak_bytes": ref["peak_bytes"],
                 "step_s": ref["step_s"]})
    lines.append(f"| one process, no sequence_parallel (sharded exact adjoint) | {args.seq_len} | "
                 f"{ref['peak_bytes'] / mib:.1f} | {ref['peak_bytes'] / base:.2f}x | {ref['step_s']:.2f} | "
                 f"{ref['step_s'] / base_t:.2f}x |")
    table = "\n".join(lines)
    print(table)
    (out / "sequence_parallel_cpu.json").write_text(json.dumps(
        {"B": B, "T": args.seq_len, "d_model": D, "d_state": N, "layers": LAYERS, "inner": args.inner,
         "rows": rows}, indent=1))
    (out / "sequence_parallel_cpu.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
