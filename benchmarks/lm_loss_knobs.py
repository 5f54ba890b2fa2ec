"""Where an adjoint LM step's time goes on CUDA, and how it moves with the least bytes of a recurrent shard and of a
loss chunk: several settings side by side in one process, with ``torch.compile``'s step as the baseline.

The model and loss are those of ``lm_loss.py``. A setting ``R/C`` runs the step with at least R MiB of activations
per recurrent shard and C MiB per loss chunk (defaults 64/128). Each setting is compiled afresh; its step is the
median of ``--repeats`` after two warm-up steps; its peak is ``max_memory_allocated`` over one step (CUDA graphs'
pools are reserved, not allocated, between replays, and every setting's graphs stay in one process: ``lm_loss.py``
measures each method in a process of its own, pools included).

    python benchmarks/lm_loss_knobs.py --vocab 50257 --length 32768 --settings 64/64,64/256,256/64 --profile
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--settings", default="64/128")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="a torch.profiler table of the first setting's step")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile's baseline")
    p.add_argument("--device", default="cuda")
    p.add_argument("--options", default="", help="extra adjoint options, k=v,k=v (bools: true/false)")
    args = p.parse_args()
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import adjoint_compile as ac
    from adjoint_compile.models.selective_ssm import SSMStack
    from adjoint_compile.runtime import shard_parts

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    V, T = args.vocab, args.length
    emb, stack = nn.Embedding(V, 64).to(dev), SSMStack(64, 8, 2).to(dev)
    head = nn.Linear(64, V, bias=False).to(dev)
    params = [*emb.parameters(), *stack.parameters(), *head.parameters()]
    ids = torch.randint(0, V, (1, T + 1), device=dev)
    extra = {k: {"true": True, "false": False}.get(v, v) for k, v in
             (kv.split("=") for kv in args.options.split(",") if kv)}

    def step(ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(stack(emb(ids[:, :-1]))).flatten(0, 1), ids[:, 1:].flatten())

    def measure(fn) -> tuple[float, float, float]:
        def one() -> None:
            for q in params:
                q.grad = None
            fn(ids).backward()
        for _ in range(2):
            one()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        one()
        sync()
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            one()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), peak, torch.cuda.memory_reserved() if cuda else 0

    rows = []
    if not args.no_compile:
        t0 = time.perf_counter()
        s, pk, rs = measure(torch.compile(step))
        rows.append(("compile", s, pk, rs, time.perf_counter() - t0))
        print(f"compile: step {s * 1e3:.1f} ms peak {pk / 2**20:.0f} MiB", flush=True)
        torch._dynamo.reset()
    for k, setting in enumerate(args.settings.split(",")):
        r, c = (int(float(x) * 2**20) for x in setting.split("/"))
        shard_parts.MIN_SHARD_BYTES_GPU = r
        shard_parts.MIN_CHUNK_BYTES_GPU = c
        torch._dynamo.reset()
        t0 = time.perf_counter()
        fn = torch.compile(step, backend="adjoint", options=extra)
        s, pk, rs = measure(fn)
        rows.append((f"adjoint {setting}", s, pk, rs, time.perf_counter() - t0))
        rep = ac.report(fn)
        lowered = [x for x in rep.regions if x.rewrite == "adjoint"]
        det = lowered[0].details if lowered else {}
        print(f"adjoint {setting}: step {s * 1e3:.1f} ms peak {pk / 2**20:.0f} MiB shard {det.get('shard_size')} "
              f"chunk {det.get('loss_tail', {}).get('chunk')}", flush=True)
        if args.profile and k == 0:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for q in params:
                    q.grad = None
                fn(ids).backward()
                sync()
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
            print(ka.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))
    print(f"\n{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, V={V}, T={T}")
    print("| run | step (ms) | peak allocated (MiB) | reserved after (MiB) | compile + measure (s) |")
    print("|---|---|---|---|---|")
    for name, s, pk, rs, w in rows:
        print(f"| {name} | {s * 1e3:.1f} | {pk / 2**20:.0f} | {rs / 2**20:.0f} | {w:.0f} |")


if __name__ == "__main__":
    main()
