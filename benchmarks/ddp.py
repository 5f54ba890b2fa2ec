"""Per-rank peak memory of one DistributedDataParallel training step at world 2 (gloo on CPU, spawned here) with
``torch.compile(ddp_model, backend="adjoint")`` against ``backend="aot_eager"``, on the selective SSM stack of
examples/selective_ssm.py.

    python benchmarks/ddp.py [--seq-len 8192]

Each rank holds B sequences of T steps; peak = growth of the rank's resident memory during one training step after
a warm-up step (adjoint_compile/measure.py). Writes benchmarks/results/ddp_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from adjoint_compile import measure  # noqa: E402
from sequence_parallel import B, D, LAYERS, N, _model, step_and_peak  # noqa: E402

WORLD = 2


def _rank(rank: int, port: int, T: int, backend: str, out: str) -> None:
    measure.prepare_cpu_measurement()  # NB: before any tensor exists (adjoint_compile/measure.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    model = _model()
    g = torch.Generator().manual_seed(1 + rank)
    x, w = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    kw = {"options": {"inner": "aot_eager"}} if backend == "adjoint" else {}
    f = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend=backend, **kw)

    _, peak = step_and_peak(model, f, x, w)
    rows = [None] * WORLD
    dist.all_gather_object(rows, {"rank": rank, "peak_bytes": peak})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(T: int, backend: str, tmp: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"ddp_{backend}.json"
    mp.start_processes(_rank, args=(port, T, backend, str(out)), nprocs=WORLD, start_method="spawn")
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {b: run(args.seq_len, b, out) for b in ("aot_eager", "adjoint")}
    base = max(r["peak_bytes"] for r in results["aot_eager"])
    mib = 2 ** 20
    lines = [f"One DDP training step at world {WORLD} (gloo) of the selective SSM stack (examples/selective_ssm.py: "
             f"d_model {D}, d_state {N}, {LAYERS} layers), B={B} per rank, T={args.seq_len}; {platform.machine()} "
             f"CPU, 1 thread per process, on a shared {mp.cpu_count()}-core machine",
             "", "| backend | peak MiB per rank (max over ranks) | vs aot_eager |", "|---|---|---|"]
    for b, rs in results.items():
        pk = max(r["peak_bytes"] for r in rs)
        lines.append(f"| {b}{' (inner=aot_eager)' if b == 'adjoint' else ''} | {pk / mib:.1f} | {pk / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    (out / "ddp_cpu.json").write_text(json.dumps(
        {"world": WORLD, "B": B, "T": args.seq_len, "d_model": D, "d_state": N, "layers": LAYERS,
         "results": results}, indent=1))
    (out / "ddp_cpu.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
