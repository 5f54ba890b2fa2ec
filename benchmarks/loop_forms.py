"""Loops as libraries write them (issue 17): one training step (forward + backward) of a loop with its readout
inside (transformers' Mamba slow path) and of fla's naive GLA step, compiled with backend="adjoint" (inner
aot_eager) and with aot_eager alone. Peak memory (RSS growth, adjoint_compile.measure) first, then the median step
time. Writes benchmarks/results/loop_forms_cpu.json.

    python benchmarks/loop_forms.py [--mamba-T 512] [--gla-T 256]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from adjoint_compile.measure import median_time, prepare_cpu_measurement, start_timing, track_peak

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_loop_forms import gla, mamba_readout  # noqa: E402


def inputs(name: str, T: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "mamba_readout":
        B, D, N = 2, 16, 16
        xs = dict(dA=torch.rand(B, D, T, N, generator=g), dBu=torch.randn(B, D, T, N, generator=g),
                  C=torch.randn(B, T, N, generator=g), h=torch.randn(B, D, N, generator=g))
    else:
        B, H, K, V = 2, 2, 16, 16
        xs = dict(q=torch.randn(B, H, T, K, generator=g), k=torch.randn(B, H, T, K, generator=g),
                  v=torch.randn(B, H, T, V, generator=g), gk=-torch.rand(B, H, T, K, generator=g),
                  S=torch.randn(B, H, K, V, generator=g))
    return {k: v.requires_grad_() for k, v in xs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mamba-T", type=int, default=512)
    p.add_argument("--gla-T", type=int, default=256)
    args = p.parse_args()
    prepare_cpu_measurement()
    torch.set_num_threads(1)
    cases = [("mamba_readout", mamba_readout, args.mamba_T), ("gla", gla, args.gla_T)]
    methods = {"adjoint": dict(backend="adjoint", options={"inner": "aot_eager"}), "aot_eager": dict(backend="aot_eager")}
    steps, rows = {}, []
    for name, fn, T in cases:
        xs = inputs(name, T)
        for m, kw in methods.items():
            torch._dynamo.reset()
            f = torch.compile(fn, **kw)

            def step(f=f, xs=xs):
                out = f(**xs)
                out = out[0] if isinstance(out, tuple) else out
                out.square().sum().backward()
                for v in xs.values():
                    v.grad = None

            t0 = time.perf_counter()
            step()
            first = time.perf_counter() - t0
            with track_peak("cpu") as mem:
                step()
            steps[(name, m)] = step
            rows.append({"case": name, "T": T, "method": m, "first_step_s": round(first, 2),
                         "peak_MiB": round(mem["peak"] / 2**20, 2)})
    start_timing()
    for r in rows:
        r["step_s"] = round(median_time(steps[(r["case"], r["method"])], "cpu", repeats=5), 4)
        print(r, flush=True)
    out = Path(__file__).resolve().parent / "results" / "loop_forms_cpu.json"
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
