"""Highway-BP (mode="highway") against ordinary backpropagation: time of a training step and gradient fidelity.

1. A GRU written with torch's scan (examples/gru_scan.py) at T = 1024, B = 8, hidden 64: plain BP compiled with
   aot_eager and with inductor, nn.GRU itself (eager, the fused op), and backend="adjoint" in highway mode with
   k = 0, 1, 5, 10; for each, the median time of a forward + backward step and the cosine between its gradient
   (all parameters, flattened) and the exact one (nn.GRU with the same weights).
2. A deep post-LN residual MLP (depth 32, x <- LN(x + MLP(x))): the gradient's cosine with the exact one per k.

    python benchmarks/highway.py [--quick]           # writes benchmarks/results/highway.{json,png}
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
from gru_scan import GRUScan  # noqa: E402

from adjoint_compile.measure import start_timing  # noqa: E402

T, B, H = 1024, 8, 64
GRU_KS = (0, 1, 5, 10)
DEPTH, WIDTH, ROWS = 32, 64, 32
MLP_KS = (0, 1, 2, 4, 8, 16, 32)
REPEATS = 5


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def _step(run, model, x, proj) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    (run(x) * proj).sum().backward()
    return time.perf_counter() - t0


def _time(run, model, x, proj) -> tuple[float, float]:
    first = _step(run, model, x, proj)  # compile included
    times = [_step(run, model, x, proj) for _ in range(REPEATS)]
    return first, statistics.median(times)


def gru(quick: bool) -> list[dict]:
    steps = 128 if quick else T
    torch.manual_seed(0)
    model = GRUScan(H, H)
    native = nn.GRU(H, H, batch_first=True)
    with torch.no_grad():  # the same weights: nn.GRU's gates are (r, z, n), as GRUScan's chunks
        native.weight_ih_l0.copy_(model.ih.weight), native.bias_ih_l0.copy_(model.ih.bias)
        native.weight_hh_l0.copy_(model.hh.weight), native.bias_hh_l0.copy_(model.hh.bias)
    x, proj = torch.randn(B, steps, H), torch.randn(B, steps, H)
    native.zero_grad()
    (native(x)[0] * proj).sum().backward()  # the exact gradient, in each model's parameter order
    exact = {id(native): _flat_grad(native),
             id(model): torch.cat([native.weight_ih_l0.grad.reshape(-1), native.bias_ih_l0.grad,
                                   native.weight_hh_l0.grad.reshape(-1), native.bias_hh_l0.grad])}
    rows = []
    methods = [("plain BP, aot_eager", lambda: torch.compile(model, backend="aot_eager"), model),
               ("plain BP, inductor", lambda: torch.compile(model), model),
               ("nn.GRU (native, eager)", lambda: (lambda v: native(v)[0]), native)]
    methods += [(f"highway k={k}", (lambda k=k: torch.compile(model, backend="adjoint", options={
        "mode": "highway", "iterations": k, "inner": "aot_eager"})), model) for k in GRU_KS]
    for name, make, owner in methods:
        torch._dynamo.reset()
        try:
            first, median = _time(make(), owner, x, proj)
            g = _flat_grad(owner)
            rows.append({"method": name, "T": steps, "first_step_s": round(first, 3), "step_s": round(median, 4),
                         "grad_cosine": _cos(g, exact[id(owner)])})
        except Exception as e:  # noqa: BLE001 - a method that fails here is reported, not hidden
            traceback.print_exc()
            rows.append({"method": name, "T": steps, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    return rows


class PostLNMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(DEPTH))
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk, ln in zip(self.blocks, self.norms):
            x = ln(x + blk(x))
        return x


def post_ln() -> list[dict]:
    torch.manual_seed(1)
    model = PostLNMLP()
    x, proj = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    model.zero_grad()
    (model(x) * proj).sum().backward()
    exact = _flat_grad(model)
    first, median = _time(model, model, x, proj)
    rows = [{"method": "plain BP (eager)", "depth": DEPTH, "step_s": round(median, 4), "grad_cosine": 1.0}]
    print(rows[-1], flush=True)
    for k in MLP_KS:
        torch._dynamo.reset()
        run = torch.compile(model, backend="adjoint", options={"mode": "highway", "iterations": k, "inner": "eager"})
        first, median = _time(run, model, x, proj)
        rows.append({"method": f"highway k={k}", "depth": DEPTH, "step_s": round(median, 4),
                     "grad_cosine": _cos(_flat_grad(model), exact)})
        print(rows[-1], flush=True)
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    g = [r for r in res["gru"] if r["method"].startswith("highway") and "grad_cosine" in r]
    axes[0].plot([int(r["method"].split("=")[1]) for r in g], [r["grad_cosine"] for r in g], "o-")
    axes[0].set(title=f"GRU (scan), T={g[0]['T'] if g else T}: gradient cosine vs exact", xlabel="k (iterations)",
                ylabel="cosine")
    p = [r for r in res["post_ln"] if r["method"].startswith("highway")]
    axes[1].plot([int(r["method"].split("=")[1]) for r in p], [r["grad_cosine"] for r in p], "o-")
    axes[1].set(title=f"post-LN residual MLP, depth {DEPTH}", xlabel="k (iterations)", ylabel="cosine")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    quick = "--quick" in sys.argv
    start_timing()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = {"device": "cpu", "threads": torch.get_num_threads(), "B": B, "H": H, "repeats": REPEATS,
           "gru": gru(quick), "post_ln": post_ln()}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "highway_quick" if quick else "highway"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out / f"{name}.png")
    for r in res["gru"] + res["post_ln"]:
        print(r)


if __name__ == "__main__":
    main()
