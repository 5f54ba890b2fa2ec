"""Compile time: the first training step (compile + forward + backward) with backend="adjoint" and with inductor
(torch.compile's default backend), side by side, each in a fresh subprocess with a fresh inductor cache
(TORCHINDUCTOR_CACHE_DIR: a new temporary directory per measurement), and where the adjoint backend's time goes
(adjoint_compile/timing.py: its passes, and the inner compiles of partitions, shard programs and shard VJPs).

Cases: the shipped SSM (adjoint_compile.models.selective_ssm.SSMStack, loss compiled in, shards of 256 steps), two
examples (pre_ln_transformer and relu_resnet: residual chains, nothing rewritten in exact mode; mamba_conv, a sharded
region with causal convs, takes both backends over 3 minutes cold and is not in the default run), a Python loop
h = a_t * h + b_t in a module's forward, at T = 512, 2048 and 8192 (adjoint rolls it before dynamo: traced once, as
torch's scan; default options decline it, one shard; --cases loop512_sharded shards it; loop8192_unrolled turns
rolling off: dynamo unrolls it and the backend re-rolls the graph), and an MLP (nothing to rewrite).
Inductor gets the loops unrolled by dynamo and takes minutes: those measurements stop at --loop-timeout. Every step's loss is
compiled in; each measurement also times later steps (the steady state: the median of up to 21, within 5 s).

Prints a table and writes benchmarks/results/compile_time_cpu.json, compile_time.md and compile_time_cpu.png.

    python benchmarks/compile_time.py                   # the default cases, about 8 minutes on 2 cores
    python benchmarks/compile_time.py --cases mlp,ssm   # some of them
    python benchmarks/compile_time.py --one ssm --backend adjoint   # one measurement (what the driver runs)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import importlib.util
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: case -> what it is (the table's and the results page's words)
#: the cases run by default (the others: --cases)
DEFAULT = ("ssm", "pre_ln_transformer", "relu_resnet", "loop512", "loop2048", "loop8192", "loop8192_unrolled", "mlp")
CASES = {
    "ssm": "SSMStack (2 layers, d_model 16, d_state 4), B=2, T=2048, shard_size=256, loss compiled in",
    "relu_resnet": "examples/relu_resnet.py (6 residual layers, width 32), B=8: a residual chain, nothing rewritten in "
                   "exact mode",
    "mamba_conv": "examples/mamba_conv.py (3 layers with causal convs), B=2, T=2048: both backends over 3 minutes "
                  "cold here (not in the default run)",
    "pre_ln_transformer": "examples/pre_ln_transformer.py (3 layers), B=2, T=16, loss compiled in",
    "loop512": "Python loop h = sigmoid(W_a x_t) * h + W_b x_t in a module's forward, d=16, B=2, T=512, default "
               "options: adjoint rolls it before dynamo (traced once, as torch's scan; one shard: compiled as "
               "captured); inductor gets it unrolled by dynamo",
    "loop2048": "the same loop at T=2048",
    "loop8192": "the same loop at T=8192",
    "loop512_sharded": "the same loop at T=512 with shard_size=128: re-rolled and sharded (adjoint only; inductor: "
                       "see loop512)",
    "loop2048_sharded": "the same loop at T=2048 with shard_size=512 (adjoint only)",
    "loop8192_unrolled": "the same loop at T=8192 with roll_loops=False: dynamo unrolls it, the backend re-rolls the "
                         "graph into one linear_scan and compiles that (adjoint only)",
    "mlp": "MLP, 8 x (Linear(256, 256) + GELU), B=64: nothing to rewrite",
}
BACKENDS = ("adjoint", "inductor")
#: the line of compile_time.md under which notes written by hand are kept when the page is written again
KEEP = "<!-- written by hand below this line: kept when the page is written again -->"
#: cases measured with backend="adjoint" only (their inductor figure is another case's)
ADJOINT_ONLY = {"loop512_sharded": "loop512", "loop2048_sharded": "loop2048", "loop8192_unrolled": "loop8192"}


def _build(case: str):
    """(model, inputs, adjoint options) of one case, seeded."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if case == "ssm":
        from adjoint_compile.models.selective_ssm import SSMStack
        return SSMStack(16, 4, 2), (torch.randn(2, 2048, 16),), {"shard_size": 256}
    if case in ("mamba_conv", "pre_ln_transformer", "relu_resnet"):
        # NB: a real module (dynamo looks its globals up by module name)
        spec = importlib.util.spec_from_file_location(f"example_{case}", ROOT / "examples" / f"{case}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod.make(), tuple(mod.example_inputs()), {}
    if case.startswith("loop"):
        T = int(case[4:].split("_")[0])

        class Loop(nn.Module):
            def __init__(self, d: int = 16) -> None:
                super().__init__()
                self.a, self.b, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                a, b = torch.sigmoid(self.a(x)), self.b(x)
                h = torch.zeros_like(x[:, 0])
                hs = []
                for t in range(x.shape[1]):
                    h = a[:, t] * h + b[:, t]
                    hs.append(h)
                return self.out(torch.stack(hs, 1))

        opts = {"shard_size": T // 4} if case.endswith("_sharded") else {}
        return Loop(), (torch.randn(2, T, 16),), ({"roll_loops": False} if case.endswith("_unrolled") else opts)
    if case == "mlp":
        return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())]), \
            (torch.randn(64, 256),), {}
    raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def measure_one(case: str, backend: str) -> dict:
    """One measurement in this process: the first step and the median of up to 21 later ones (5 s at most, 3 at
    least); for adjoint, its record's timings."""
    import torch
    import torch._dynamo

    model, xs, opts = _build(case)
    if case.startswith("loop"):
        # NB: dynamo unrolls the loop: one frame of T iterations
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8)

    def loss_fn(*a):
        return model(*a).square().mean()

    import adjoint_compile as ac
    from adjoint_compile import timing as timing_mod
    kw = {"backend": "adjoint", "options": opts} if backend == "adjoint" else {}
    step = torch.compile(loss_fn, **kw)
    t0 = time.perf_counter()
    loss = step(*xs)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    later: list[float] = []
    t_end = time.perf_counter() + 5.0
    while len(later) < 3 or (len(later) < 21 and time.perf_counter() < t_end):  # NB: the steady state
        model.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        step(*xs).backward()
        later.append(time.perf_counter() - t3)
    second = sorted(later)[len(later) // 2]
    out = {"case": case, "backend": backend, "first_step_s": t2 - t0, "first_forward_s": t1 - t0,
           "first_backward_s": t2 - t1, "later_step_s": second, "later_steps": len(later)}
    if backend == "adjoint":
        rep = ac.report(step)
        timing: dict[str, float] = {}
        for c in rep.compiled:
            for k, v in c.timing.items():
                timing[k] = timing.get(k, 0.0) + v
        out["timing"] = timing
        out["graphs"] = len(rep.compiled)
        out["rewritten"] = sorted({f"{r.kind}:{r.rewrite}" for r in rep.regions if r.rewrite != "none"})
        out["summary"] = timing_mod.summary([c.timing for c in rep.compiled])
    return out


def _run(case: str, backend: str, timeout: float) -> dict:
    """``measure_one`` in a fresh subprocess (its own process group) with a fresh inductor cache; past ``timeout``
    seconds the group is killed and the result says so."""
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               "PYTHONWARNINGS": "ignore"}
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, __file__, "--one", case, "--backend", backend], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # NB: the child and inductor's compile workers it started
            p.communicate()
            return {"case": case, "backend": backend, "timed_out_s": timeout,
                    "error": f"> {timeout:.0f} s (stopped)"}
        wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if p.returncode != 0 or line is None:
        return {"case": case, "backend": backend, "error": (err.strip().splitlines() or ["?"])[-1][:300]}
    res = json.loads(line)
    res["process_wall_s"] = wall
    return res


PASSES = ("copy", "capture", "recognize", "decide", "lower", "per_sample", "stitch")
KINDS = (("whole_graph", "graph"), ("partitions", "parts"), ("shard_programs", "shard fwd"),
         ("shard_vjps", "shard vjp"), ("vjp_traces", "vjp trace"))


def profile_cells(t: dict[str, float]) -> str:
    """The adjoint first step's profile in one cell: the passes, then the inner compiles by kind."""
    passes = sum(t.get(f"{p}_s", 0.0) for p in PASSES)
    top = sorted(((t.get(f"{p}_s", 0.0), p) for p in PASSES), reverse=True)[:2]
    named = ", ".join(f"{p} {v:.2f}" for v, p in top if v >= 0.005)
    cells = [f"passes {passes:.2f}" + (f" ({named})" if named else "")]
    cells += [f"{name} {t[f'inner.{k}_n']:.0f}x {t[f'inner.{k}_s']:.2f}" for k, name in KINDS if f"inner.{k}_n" in t]
    return "; ".join(cells)


def table(rows: list[dict]) -> list[str]:
    by = {(r["case"], r["backend"]): r for r in rows}
    out = ["| case | first step adjoint (s) | first step inductor (s) | ratio | later step adjoint / inductor (s) | "
           "adjoint's first step: where the time goes (s) |", "|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        a, i = by.get((case, "adjoint"), {}), by.get((ADJOINT_ONLY.get(case, case), "inductor"), {})
        fa, fi = a.get("first_step_s"), i.get("first_step_s")
        ratio = (f"{fa / fi:.2f}" if fa and fi else
                 f"< {fa / i['timed_out_s']:.2f}" if fa and "timed_out_s" in i else "-")
        second = (f"{a['later_step_s']:.4f} / {i['later_step_s']:.4f}" if "later_step_s" in a and
                  "later_step_s" in i else "-")
        prof = profile_cells(a["timing"]) if "timing" in a else a.get("error", "-")
        if "timing" in a:
            inner = sum(v for k, v in a["timing"].items() if k.startswith("inner.") and k.endswith("_s"))
            passes = sum(a["timing"].get(f"{p}_s", 0.0) for p in PASSES)
            prof += f"; rest (dynamo, shard program build, running) {fa - inner - passes:.2f}"
        cell = lambda v, r: f"{v:.2f}" if v is not None else r.get("error", "-")  # noqa: E731
        out.append(f"| {case} | {cell(fa, a)} | {cell(fi, i)} | {ratio} | {second} | {prof} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT),
                   help=f"comma-separated, of: {', '.join(CASES)} (default: {', '.join(DEFAULT)})")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per measurement (process start included)")
    p.add_argument("--loop-timeout", type=float, default=75.0,
                   help="the same for the loop cases: inductor compiles the unrolled loop, minutes on 2 cores")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--render", action="store_true",
                   help="write the .md again from the .json, measuring nothing (notes under its KEEP line stay)")
    args = p.parse_args(argv)
    if args.render:
        render(Path(args.out))
        return
    if args.one:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(measure_one(args.one, args.backend)), flush=True)
        return
    import torch

    load0 = os.getloadavg()
    start = time.time()
    rows = []
    for case in args.cases.split(","):
        for backend in BACKENDS[:1] if case in ADJOINT_ONLY else BACKENDS:
            loop = case.startswith("loop") and case not in ADJOINT_ONLY  # NB: inductor on an unrolled loop
            r = _run(case, backend, args.loop_timeout if loop else args.timeout)
            rows.append(r)
            what = (f"first step {r['first_step_s']:.2f} s (forward {r['first_forward_s']:.2f}, backward "
                    f"{r['first_backward_s']:.2f}), later steps {r['later_step_s']:.4f} s" if "error" not in r
                    else r["error"])
            print(f"{case:20s} {backend:9s} {what}", flush=True)
            if r.get("summary"):
                print(f"{'':31s}{r['summary']}", flush=True)
    meta = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": [round(v, 2) for v in load0],
            "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
            "wall_s": round(time.time() - start, 1), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cases": {c: CASES[c] for c in args.cases.split(",")},
            "method": "one fresh subprocess per (case, backend), TORCHINDUCTOR_CACHE_DIR a fresh temporary "
                      "directory; first step = compile + forward + backward of the loss, timed from the first call "
                      "(imports done before); inner compiler of backend='adjoint': inductor"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_time_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    render(out)


def render(out: Path) -> None:
    """benchmarks/results/compile_time.md from the JSON in ``out`` (``--render``: again, without measuring)."""
    data = json.loads((out / "compile_time_cpu.json").read_text())
    meta, rows = data["meta"], data["rows"]
    lines = table(rows)
    print("\n".join(lines))
    md = ["# Compile time: the first step, adjoint against inductor", "",
          "`python benchmarks/compile_time.py` (" + __doc__.splitlines()[0].rstrip(".") + ").", "",
          f"Device: {meta['device']}, torch {meta['torch']}; load average (1, 5, 15 min) at start "
          f"{', '.join(map(str, meta['load_average_at_start']))}, at end "
          f"{', '.join(map(str, meta['load_average_at_end']))} (the machine is shared: other jobs ran meanwhile); "
          f"{meta['date']}; the whole run took {meta['wall_s']:.0f} s.", "",
          "Each measurement is one fresh process with a fresh inductor cache: the first step is compile + forward + "
          "backward of the loss (dynamo, the backend, inductor; imports done before), the later step the median of up to "
          "21 steps after it (5 s at most; the shared machine makes single steps jitter). For `adjoint`, the last column is its record (`ac.report(f).compiled[i].timing`, "
          "adjoint_compile/timing.py): the backend's own passes (the two largest named), and the inner compiles by "
          "kind (graph: the whole graph when nothing is rewritten; parts: partitions around region calls; shard "
          "fwd / shard vjp: a shard program's forward / recompute + VJP, compiled at the first forward / backward; "
          "vjp trace: make_fx tracing the latter); the rest is dynamo's tracing, building and checking shard "
          "programs, and running.", "", "Cases:", ""]
    md += [f"- `{c}`: {d}" for c, d in meta["cases"].items()] + [""] + lines + [""]
    md += ["Reading it: with nothing rewritten (the transformer, the resnet, the MLP) adjoint's first step is the "
           "inner compiler's compile of the same graph (inductor, its backward compiled at once) plus the backend's "
           "passes, milliseconds; differences between the two columns there are within the run-to-run spread of this "
           "shared machine. On the loops inductor compiles the unrolled graph (T copies of the step, forward and "
           "backward) and is stopped at the time limit; adjoint traces the loop once (rolled before dynamo: "
           "flat in T), or, with roll_loops=False, pays dynamo's unrolling and compiles the re-rolled graph. On a "
           "sharded region (ssm) the shard programs' compiles, a forward and a recompute + VJP per call pattern "
           "(first, middle and last shard), come on top of the partitions' and dominate the first step.", ""]
    page = out / "compile_time.md"
    old = page.read_text() if page.exists() else ""
    if KEEP in old:  # NB: the notes written by hand under the marker stay
        md += [KEEP + old.split(KEEP, 1)[1]]
    page.write_text("\n".join(md))
    print(f"wrote {page}")
    plot(rows, meta, out / "compile_time_cpu.png")


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """First step per case, adjoint beside inductor, labelled with the ratio; an inductor run stopped at its time
    limit is drawn hatched at that limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["case"], r["backend"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.3 * len(cases) + 2, 3.6))
    for i, case in enumerate(cases):
        a, ind = by.get((case, "adjoint"), {}), by.get((ADJOINT_ONLY.get(case, case), "inductor"), {})
        fa, fi, stopped = a.get("first_step_s"), ind.get("first_step_s"), ind.get("timed_out_s")
        if fa:
            ax.bar(i - 0.2, fa, 0.4, color="tab:blue", label="adjoint" if i == 0 else None)
        if fi or stopped:
            ax.bar(i + 0.2, fi or stopped, 0.4, color="tab:gray", hatch=None if fi else "//",
                   label="inductor" if i == 0 else None)
        if fa and (fi or stopped):
            ax.text(i, max(fa, fi or stopped) * 1.02, f"{'<' if not fi else ''}{fa / (fi or stopped):.2f}x",
                    ha="center", fontsize=8)
    ax.set_xticks(range(len(cases)), cases, rotation=20, fontsize=8)
    ax.set_ylabel("first step: compile + forward + backward (s)")
    ax.set_title(f"First step, fresh caches ({meta['device']}, torch {meta['torch']}, {meta['date']}); "
                 "hatched: stopped at the time limit", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
