"""Highway-BP (mode="highway") against ordinary backpropagation: time of a training step and gradient fidelity.

1. A GRU written with torch's scan (examples/gru_scan.py) at T = 1024, B = 8, hidden 64: plain BP compiled with
   aot_eager and with inductor, nn.GRU itself (eager, the fused op), and backend="adjoint" in highway mode with
   k = 0, 1, 5, 10; for each, the median time of a forward + backward step and the cosine between its gradient
   (all parameters, flattened) and the exact one (nn.GRU with the same weights).
   nn.GRU itself also runs in highway mode (its fused op decomposed into the cell equations: k = 0 and 5).
2. A deep post-LN residual MLP (depth 32, x <- LN(x + MLP(x))): the gradient's cosine with the exact one per k.
3. A short training run: a character-level GRU language model (Embedding -> nn.GRU -> Linear) on text built into
   Python (the Zen of Python and the docstrings of a few standard-library modules), the same initial weights and
   batches for each method: exact gradients (nn.GRU natively) and backend="adjoint" highway k = 0 and 5. The loss
   curves go in the JSON and the plot.

    python benchmarks/highway.py [--quick] [--parts gru,post_ln,train] [--threads 1] [--train-steps 400]
                                                      # writes benchmarks/results/highway.{json,png}

One thread by default: on the shared 2-core machine (load 4-6), two intra-op threads contend with the other jobs and
nn.GRU's per-step kernels slowed by 10-50x (measured: 0.44 s a step with one thread, 4-12 s with two).
"""
from __future__ import annotations

import argparse
import copy
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
NATIVE_KS = (0, 5)
DEPTH, WIDTH, ROWS = 32, 64, 32
MLP_KS = (0, 1, 2, 4, 8, 16, 32)
REPEATS = 5


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def _first(run):
    return lambda v: run(v)[0]


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
    methods += [(f"nn.GRU, highway k={k}", (lambda k=k: _first(torch.compile(native, backend="adjoint", options={
        "mode": "highway", "iterations": k, "inner": "aot_eager"}))), native) for k in NATIVE_KS]
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


TEXT_MODULES = ("argparse", "difflib", "unittest", "collections", "json", "heapq", "bisect", "doctest", "logging",
                "pickle", "pydoc", "textwrap", "functools", "itertools", "statistics", "string", "random", "shutil",
                "tarfile", "zipfile", "subprocess", "threading", "email", "http.client", "urllib.parse", "csv",
                "datetime", "decimal", "fractions", "pathlib")


def corpus() -> str:
    """Real text that every Python install has (~160 KB on 3.11): the Zen of Python and the docstrings of a few
    standard-library modules and of their public functions and classes."""
    import codecs
    import contextlib
    import importlib
    import inspect
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # NB: importing it prints the Zen; its text is rot13 in this.s
        import this  # noqa: F401
    docs = [codecs.decode(sys.modules["this"].s, "rot13")]
    for name in TEXT_MODULES:
        mod = importlib.import_module(name)
        docs.append(mod.__doc__ or "")
        for n, o in sorted(vars(mod).items()):
            if not n.startswith("_") and getattr(o, "__module__", None) == mod.__name__ and (
                    inspect.isfunction(o) or inspect.isclass(o)):
                docs.append(inspect.getdoc(o) or "")
    return "\n\n".join(d for d in docs if d)


class CharGRU(nn.Module):
    def __init__(self, vocab: int, d: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(vocab, d), nn.GRU(d, hidden, batch_first=True), nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(idx))[0])


VAL_EVERY = 50


def _val_loss(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor], loss_fn: nn.Module, vocab: int) -> float:
    """Held-out loss with the model's own (eager, exact) forward: every method's forward computes the same values."""
    with torch.no_grad():
        return float(loss_fn(model(xy[0]).reshape(-1, vocab), xy[1].reshape(-1)))


def train(steps: int, seq: int = 128, batch: int = 16, lr: float = 3e-3) -> dict:
    """Next-character prediction, the same initial weights and batches for every method."""
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * len(data))
    train_d, val_d = data[:split], data[split:]
    torch.manual_seed(2)
    base = CharGRU(len(chars))
    g = torch.Generator().manual_seed(3)
    starts = [torch.randint(0, len(train_d) - seq - 1, (batch,), generator=g) for _ in range(steps)]
    val_starts = torch.arange(0, len(val_d) - seq - 1, seq)[:64]
    loss_fn = nn.CrossEntropyLoss()

    def batch_of(d, st):
        idx = torch.stack([d[s:s + seq + 1] for s in st.tolist()])
        return idx[:, :-1], idx[:, 1:]

    out = {"text_chars": len(text), "vocab": len(chars), "seq": seq, "batch": batch, "steps": steps, "lr": lr,
           "hidden": 128, "runs": []}
    methods = [("exact (nn.GRU, eager)", None), ("highway k=0", 0), ("highway k=5", 5)]
    for name, k in methods:
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        run = model if k is None else torch.compile(model, backend="adjoint", options={
            "mode": "highway", "iterations": k, "inner": "aot_eager"})
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        losses, times, vals = [], [], []
        for step, st in enumerate(starts):
            if step % VAL_EVERY == 0:
                vals.append((step, _val_loss(model, batch_of(val_d, val_starts), loss_fn, len(chars))))
            x, y = batch_of(train_d, st)
            t0 = time.perf_counter()
            loss = loss_fn(run(x).reshape(-1, len(chars)), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        val = _val_loss(model, batch_of(val_d, val_starts), loss_fn, len(chars))
        vals.append((steps, val))
        out["runs"].append({"method": name, "loss": [round(v, 4) for v in losses], "val_loss": round(val, 4),
                            "val_curve": [[s_, round(v, 4)] for s_, v in vals],
                            "first_step_s": round(times[0], 3), "step_s": round(statistics.median(times[1:]), 4),
                            "total_s": round(sum(times), 2)})
        r = out["runs"][-1]
        print({k2: v for k2, v in r.items() if k2 != "loss"}, "last loss", losses[-1], flush=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("gru", "post_ln", "train") if res.get(p)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if "gru" in axes:
        g = [r for r in res["gru"] if r["method"].startswith("highway") and "grad_cosine" in r]
        axes["gru"].plot([int(r["method"].split("=")[1]) for r in g], [r["grad_cosine"] for r in g], "o-")
        axes["gru"].set(title=f"GRU (scan), T={g[0]['T'] if g else T}: gradient cosine vs exact",
                        xlabel="k (iterations)", ylabel="cosine")
    if "post_ln" in axes:
        p = [r for r in res["post_ln"] if r["method"].startswith("highway")]
        axes["post_ln"].plot([int(r["method"].split("=")[1]) for r in p], [r["grad_cosine"] for r in p], "o-")
        axes["post_ln"].set(title=f"post-LN residual MLP, depth {DEPTH}", xlabel="k (iterations)", ylabel="cosine")
    if "train" in axes:
        tr = res["train"]
        for r in tr["runs"]:
            loss = torch.tensor(r["loss"])
            w = min(10, len(loss))
            smooth = loss.unfold(0, w, 1).mean(1) if len(loss) >= w else loss
            line, = axes["train"].plot(range(w, w + len(smooth)), smooth.tolist(),
                                       label=f"{r['method']} ({r['step_s']:.3f} s/step)")
            vc = r.get("val_curve", [])
            axes["train"].plot([v[0] for v in vc], [v[1] for v in vc], "o--", color=line.get_color(), markersize=3)
        axes["train"].set(title=f"char-level nn.GRU, T={tr['seq']}, B={tr['batch']}: loss",
                          xlabel="step", ylabel="cross-entropy (train: mean of 10 steps; o--: held out)")
        axes["train"].legend(fontsize=7)
    for ax in axes.values():
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GRU at T=128 (and results under highway_quick.*)")
    ap.add_argument("--parts", default="gru,post_ln,train", help="comma-separated: gru, post_ln, train")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-steps", type=int, default=400)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    start_timing()
    torch.set_num_threads(args.threads)
    res = {"device": "cpu", "threads": torch.get_num_threads(), "B": B, "H": H, "repeats": REPEATS}
    if "gru" in parts:
        res["gru"] = gru(args.quick)
    if "post_ln" in parts:
        res["post_ln"] = post_ln()
    if "train" in parts:
        res["train"] = train(args.train_steps)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "highway_quick" if args.quick else "highway"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out / f"{name}.png")
    for r in res.get("gru", []) + res.get("post_ln", []):
        print(r)


if __name__ == "__main__":
    main()
