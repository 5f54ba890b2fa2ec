"""Peak memory of one training step of a small minGRU stack (mingru-pytorch) at T = 8192, eager vs torch.compile
(inductor) vs backend="adjoint" (its log-space scans are rewritten into linear_scan and sharded), and the time of
the first step (compile included) at a given T, each in a fresh process:

    python benchmarks/mingru.py memory [T]
    python benchmarks/mingru.py first-step METHOD T
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from adjoint_compile.measure import compare_training_step, format_table, prepare_cpu_measurement  # noqa: E402

B, DIM, LAYERS = 2, 64, 4


class Stack(nn.Module):
    def __init__(self) -> None:
        from minGRU_pytorch import minGRU

        super().__init__()
        self.layers = nn.ModuleList([minGRU(DIM, expansion_factor=2.0) for _ in range(LAYERS)])
        self.norms = nn.ModuleList([nn.RMSNorm(DIM) for _ in range(LAYERS)])

    def forward(self, x):
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return x


def main() -> None:
    prepare_cpu_measurement()
    torch.manual_seed(0)
    model = Stack()
    what = sys.argv[1]
    if what == "memory":
        T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
        x = torch.randn(B, T, DIM)
        rows = compare_training_step(model, (x,), lambda y: y.square().mean(), "cpu", repeats=1,
                                     methods=("eager", "compile", "adjoint"))
        print(f"T={T}")
        print(format_table(rows))
    else:
        method, T = sys.argv[2], int(sys.argv[3])
        x = torch.randn(B, T, DIM)
        run = {"eager": model, "compile": torch.compile(model),
               "adjoint": torch.compile(model, backend="adjoint")}[method]
        t0 = time.perf_counter()
        run(x).square().mean().backward()
        t1 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        run(x).square().mean().backward()
        print(f"{method} T={T}: first step {t1 - t0:.2f} s, second step {time.perf_counter() - t1:.2f} s")


if __name__ == "__main__":
    main()
