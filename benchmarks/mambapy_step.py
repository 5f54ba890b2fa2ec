"""mambapy's Mamba (pscan=True) trained one step three ways: eager, torch.compile (inductor), backend="adjoint".

    python benchmarks/mambapy_step.py --seq-len 4096            # peak memory and step time, side by side
    python benchmarks/mambapy_step.py --seq-len 1024 --first    # the first step's (compile) time of backend="adjoint"

Prints a table (adjoint_compile.measure); nothing is written. Needs ``pip install mambapy``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import adjoint_compile as ac  # noqa: E402
from adjoint_compile.measure import compare_training_step, format_table, prepare_cpu_measurement  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--d-state", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--inner", default="inductor")
    p.add_argument("--first", action="store_true", help="time the first (compiling) step of backend='adjoint' only")
    a = p.parse_args()
    prepare_cpu_measurement()  # NB: before anything is allocated, or CPU peaks read low (adjoint_compile.measure)
    from mambapy.mamba import Mamba, MambaConfig

    torch.manual_seed(0)
    model = Mamba(MambaConfig(d_model=a.d_model, n_layers=a.layers, d_state=a.d_state, pscan=True))
    x = torch.randn(a.batch, a.seq_len, a.d_model)
    if a.first:
        f = torch.compile(model, backend="adjoint", options={"inner": a.inner})
        t0 = time.perf_counter()
        f(x).pow(2).mean().backward()
        print(f"first step (compile) T={a.seq_len}: {time.perf_counter() - t0:.1f} s")
        print(ac.report(f))
        return
    rows = compare_training_step(model, (x,), lambda y: y.pow(2).mean(), "cpu", {"inner": a.inner}, repeats=3,
                                 methods=("eager", "compile", "adjoint"))
    print(f"mambapy Mamba pscan=True, B={a.batch}, T={a.seq_len}, d_model={a.d_model}, N={a.d_state}, "
          f"{a.layers} layers")
    print(format_table(rows))


if __name__ == "__main__":
    main()
