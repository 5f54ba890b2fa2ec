"""A language model's training step, head and loss included: peak memory and step time against T, for adjoint,
``torch.compile`` (inductor), ``torch.compile`` with ``F.linear_cross_entropy``'s chunked path, and activation
checkpointing, side by side in one run.

The model is a small Mamba-style LM: an embedding, the shipped selective-SSM stack (d_model 64, 2 layers) and an
untied vocabulary head. The loss is written as training scripts write it:

    logits = model(ids[:, :-1])                                             # [B, T, V]
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

* ``adjoint``: that step under ``backend="adjoint"`` (default options: on CUDA, shard programs replayed from CUDA
  graphs);
* ``compile``: that step under ``torch.compile`` (inductor);
* ``compile_lce``: the stack and ``F.linear_cross_entropy(hidden, head.weight, targets,
  options=nn.LinearCrossEntropyOptions())`` (torch's chunked head + loss, written by hand) under ``torch.compile``;
* ``checkpoint``: eager, each SSM layer under ``torch.utils.checkpoint``, the head and loss as written;
* ``adjoint-graphs`` (not run by default): ``adjoint`` with ``options={"cuda_graphs": False}``;
* ``adjoint-unfused`` / ``adjoint-fused`` (not run by default): ``adjoint`` with ``fused_loss=False`` (the head and
  cross-entropy as written, chunk by chunk) / ``True`` (fused also on a CPU, with the op's torch reference); the
  default (``"auto"``) fuses them on CUDA only;
* ``adjoint-dp`` (not run by default): ``adjoint`` with ``per_sample_clip=1.0`` (DP-SGD's clipped step: every
  example's gradient clipped, then summed), the head and loss inside the region, made per example there;
* ``adjoint@M`` (not run by default): ``adjoint`` with at least M MiB of activations per shard and loss chunk
  (per thread on a CPU) instead of the defaults (8 MiB per thread on a CPU; on a GPU 64 MiB per shard and 128 MiB
  per loss chunk), to see the trade between peak and step time; ``adjoint@R/C``: R MiB per shard, C per loss chunk
  on a GPU; ``adjoint@M-graphs`` both.

Each method runs in a fresh process. For each V and T it runs one step (compiling), one step under
``adjoint_compile.measure.track_peak`` (live tensor bytes on CPU, ``max_memory_allocated`` on CUDA, parameters and
gradients included; on CUDA plus the memory CUDA graphs' pools hold, which ``max_memory_allocated`` leaves out) and
``--repeats`` timed steps (median). A size whose logits alone would not fit (three
``[B, T, V]`` fp32 tensors against 55% of the free memory) is skipped and recorded as such.

Writes ``benchmarks/results/lm_loss_<device>.json``, ``lm_loss_<device>.png`` and prints the table and the targets.

    python benchmarks/lm_loss.py                                  # CPU: T 2048 … 32768, V 32000 and 50257
    python benchmarks/lm_loss.py --device cuda --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("adjoint", "compile", "compile_lce", "checkpoint")


def _free_bytes(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
    return info["MemAvailable"]


def run_method(method: str, args: argparse.Namespace) -> dict:
    """One method's measurements at every (V, T), in this process."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import adjoint_compile as ac
    from adjoint_compile import measure
    from adjoint_compile.models.selective_ssm import SSMStack

    dev = torch.device(args.device)
    if dev.type == "cpu":
        measure.prepare_cpu_measurement()
    if "@" in method:
        # NB: a sweep of the least bytes per shard (runtime/shard_parts.py): how the default was chosen
        from adjoint_compile.runtime import shard_parts
        mib = [float(x) for x in method.split("@")[1].split("-")[0].split("/")]
        shard_parts.MIN_SHARD_BYTES = shard_parts.MIN_SHARD_BYTES_GPU = int(mib[0] * 2**20)
        shard_parts.MIN_CHUNK_BYTES_GPU = int(mib[-1] * 2**20)
    rows = []
    for V in args.vocab:
        torch.manual_seed(0)
        emb, stack = nn.Embedding(V, args.d_model).to(dev), SSMStack(args.d_model, args.d_state, args.layers).to(dev)
        head = nn.Linear(args.d_model, V, bias=False).to(dev)
        params = [*emb.parameters(), *stack.parameters(), *head.parameters()]
        body = measure.checkpoint_layers(stack) if method == "checkpoint" else stack

        def step(ids: torch.Tensor) -> torch.Tensor:
            logits = head(body(emb(ids[:, :-1])))
            return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

        def step_lce(ids: torch.Tensor) -> torch.Tensor:
            hidden = stack(emb(ids[:, :-1]))
            return F.linear_cross_entropy(hidden.flatten(0, 1), head.weight, ids[:, 1:].flatten(),
                                          options=nn.LinearCrossEntropyOptions())

        if method.startswith("adjoint"):
            fused = False if "-unfused" in method else True if "-fused" in method else "auto"
            opts = {"cuda_graphs": "-graphs" not in method, "fused_loss": fused}
            if "-dp" in method:
                opts["per_sample_clip"] = 1.0
            fn = torch.compile(step, backend="adjoint", options=opts)
        elif method == "compile":
            fn = torch.compile(step)
        elif method == "compile_lce":
            if not hasattr(F, "linear_cross_entropy"):
                rows.append({"V": V, "skipped": f"torch {torch.__version__} has no F.linear_cross_entropy"})
                continue
            fn = torch.compile(step_lce)
        else:
            fn = step
        for T in args.lengths:
            need = 3 * args.batch * T * V * 4
            if method in ("compile", "checkpoint") and need > 0.55 * _free_bytes(args.device):
                rows.append({"V": V, "T": T, "skipped": f"the logits alone need ~{need / 2**30:.1f} GiB"})
                print(f"  {method} V={V} T={T}: skipped (~{need / 2**30:.1f} GiB of logits)", flush=True)
                continue
            ids = torch.randint(0, V, (args.batch, T + 1), device=dev)

            def one() -> None:
                for p in params:
                    p.grad = None
                fn(ids).backward()
            if dev.type == "cuda":  # NB: the first step's peak: compiling, first-call check and capture included
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            one()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                first_peak = torch.cuda.max_memory_allocated() - base
            first = time.perf_counter() - t0
            if dev.type == "cuda":  # NB: a second call captures CUDA graphs (the loss's chunk loop): not yet steady
                one()
            for p in params:
                p.grad = None
            with measure.track_peak(dev) as m:
                fn(ids).backward()
            step_s = measure.median_time(one, dev, repeats=args.repeats, warmup=0)
            row = {"V": V, "T": T, "peak_bytes": m["peak"], "step_s": step_s, "first_step_s": first}
            if dev.type == "cuda":  # NB: CUDA graphs' private pools are reserved, not allocated, between replays
                row["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
                row["first_step_peak_bytes"] = first_peak
                row["graph_pool_bytes"] = m["graph_pool"]
                row["peak_bytes_without_pool"] = m["peak"]
                row["peak_bytes"] = m["peak"] + m["graph_pool"]
            if method.startswith("adjoint"):
                rep = ac.report(fn)
                row["fallbacks"] = [f.cause for f in rep.fallbacks]
                row["loss_in_region"] = any("cross-entropy" in (r.reason or "") or "sum(s) over time" in
                                            (r.reason or "") for r in rep.regions if r.rewrite == "adjoint")
                lowered = [r for r in rep.regions if r.rewrite == "adjoint"]
                # NB: the step's code object is shared by every V: its report lists the graphs of earlier
                # vocabularies and lengths too; the latest one lowered at this length is this row's (none: the
                # region was not rewritten at this length)
                here = [r for r in lowered if r.length == T]
                if here:
                    row["shard_size"] = here[-1].details.get("shard_size")
                    row["loss_chunk"] = here[-1].details.get("loss_tail", {}).get("chunk")
                    row["fused_heads"] = here[-1].details.get("loss_tail", {}).get("fused_heads", 0)
            rows.append(row)
            print(f"  {method} V={V} T={T}: peak {row['peak_bytes'] / 2**20:9.1f} MiB  step {step_s:7.3f} s  "
                  f"first {first:6.1f} s" + (f"  graphs' pool {m['graph_pool'] / 2**20:.0f} MiB  first-step peak "
                                             f"{first_peak / 2**20:.0f} MiB  reserved "
                                             f"{torch.cuda.max_memory_reserved() / 2**20:.0f} MiB"
                                             if dev.type == "cuda" else ""), flush=True)
    return {"method": method, "rows": rows}


def _get(results: dict, method: str, V: int, T: int, key: str) -> float | None:
    for r in results.get(method, {}).get("rows", []):
        if r.get("V") == V and r.get("T") == T and key in r:
            return r[key]
    return None


def targets(results: dict, Vs: list[int], Ts: list[int]) -> list[dict]:
    """The issue's three targets per V, from this run's own baselines (None where a size was not measured)."""
    out = []
    for V in Vs:
        a16, c16 = _get(results, "adjoint", V, 16384, "peak_bytes"), _get(results, "compile", V, 16384, "peak_bytes")
        a8, a32 = _get(results, "adjoint", V, 8192, "peak_bytes"), _get(results, "adjoint", V, 32768, "peak_bytes")
        steps = [(_get(results, "adjoint", V, T, "step_s"), _get(results, "compile", V, T, "step_s")) for T in Ts]
        ratios = [a / c for a, c in steps if a and c]
        out.append({"V": V,
                    "peak_16384_adjoint_over_compile": a16 / c16 if a16 and c16 else None,
                    "peak_growth_adjoint_8192_to_32768": a32 / a8 if a8 and a32 else None,
                    "step_adjoint_over_compile_max": max(ratios) if ratios else None,
                    "step_adjoint_over_compile_per_T": {str(T): (a / c if a and c else None)
                                                        for T, (a, c) in zip(Ts, steps)}})
    return out


def table(results: dict, Vs: list[int], Ts: list[int]) -> str:
    lines = ["| V | T | " + " | ".join(f"{m} peak (MiB) | {m} step (s)" for m in results) + " |",
             "|---|---|" + "---|---|" * len(results)]
    for V in Vs:
        for T in Ts:
            cells = []
            for m in results:
                p, s = _get(results, m, V, T, "peak_bytes"), _get(results, m, V, T, "step_s")
                cells += [f"{p / 2**20:.0f}" if p is not None else "—", f"{s:.2f}" if s is not None else "—"]
            lines.append(f"| {V} | {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, Vs: list[int], meta: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install 'adjoint-compile[demo]'): no plot")
        return
    fig, axes = plt.subplots(2, len(Vs), figsize=(5.2 * len(Vs), 7.2), squeeze=False)
    for j, V in enumerate(Vs):
        for i, (key, label) in enumerate((("peak_bytes", "peak memory of one step (MiB)"),
                                          ("step_s", "step time (s)"))):
            ax = axes[i][j]
            for m, res in results.items():
                pts = [(r["T"], r[key]) for r in res["rows"] if r.get("V") == V and key in r]
                if pts:
                    ax.plot([t for t, _ in pts], [v / 2**20 if key == "peak_bytes" else v for _, v in pts], "o-",
                            ms=3, label=m)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(label)
            ax.set_title(f"V = {V}", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(f"LM step, head and cross-entropy included: {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192, 16384,
                                                                                        32768])
    p.add_argument("--vocab", type=lambda s: [int(x) for x in s.split(",")], default=[32000, 50257])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-state", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method, print its JSON
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_method(args.one, args)), flush=True)
        return
    import torch
    load = os.getloadavg()[0]
    dev_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    meta = {"device": dev_name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "model": f"Embedding + SSMStack(d_model={args.d_model}, d_state={args.d_state}, layers={args.layers}) + "
                     f"untied head, batch {args.batch}, cross-entropy on logits.flatten(0, 1)",
            "load_average_1min_at_start": load, "repeats": args.repeats}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    results = {}
    for method in args.methods.split(","):
        print(f"{method}:", flush=True)
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", method]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
        if line is None:
            results[method] = {"method": method, "rows": [], "failed": f"exit {proc.returncode}"}
        else:
            results[method] = json.loads(line[len("RESULT "):])
        # NB: written after every method, so that a run stopped at its time limit keeps the methods it finished
        tg = targets(results, args.vocab, args.lengths)
        (out / f"lm_loss_{tag}.json").write_text(json.dumps({"meta": meta, "results": results, "targets": tg},
                                                            indent=1))
    print(table(results, args.vocab, args.lengths))
    for t in tg:
        print(f"V={t['V']}: peak at 16384 adjoint/compile {t['peak_16384_adjoint_over_compile']} (target <= 0.05); "
              f"adjoint growth 8192->32768 {t['peak_growth_adjoint_8192_to_32768']} (<= 1.5); step adjoint/compile "
              f"max {t['step_adjoint_over_compile_max']} (<= 1.3)")
    plot(results, args.vocab, meta, out / f"lm_loss_{tag}.png")


if __name__ == "__main__":
    main()
