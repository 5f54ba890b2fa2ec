"""Benchmark the linear scan: forward and forward+backward time and effective bandwidth vs sequence length.

    python benchmarks/scan.py                      # quick CPU sizes (T = 1K .. 1M), about a minute
    python benchmarks/scan.py --device cuda --full # GPU sizes; also reports the fraction of peak bandwidth

Methods: ``linear_scan`` (impl "reference" everywhere, "cpu" (the compiled C loop) on CPU, "triton" on CUDA), a
per-step Python loop (the spec;
only up to --loop-max-t steps), torch's ``associative_scan`` (combine_mode "generic" on CPU, "pointwise" on
CUDA) where it runs, and accelerated-scan / flash-linear-attention's HGRN kernels when installed (else reported
as "not installed"). Effective bandwidth counts the bytes a scan must move at least: forward reads a, b and
writes h (3 tensors); forward+backward adds reading ∂h, a, h and writing ∂a, ∂b (8 tensors in all).
Time: median of --repeats after a warm-up, all methods in one run. Writes JSON and a PNG under
benchmarks/results/ (scan_<device>.json / .png).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adjoint_compile.kernels.scan import naive_scan  # noqa: E402
from adjoint_compile.ops import linear_scan  # noqa: E402

log = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parent / "results"

QUICK = [(4, 1 << 10, 64), (4, 1 << 12, 64), (4, 1 << 14, 64), (4, 1 << 15, 64), (1, 1 << 17, 16),
         (1, 1 << 20, 16)]
FULL = [(8, 1 << 10, 1024), (8, 1 << 12, 1024), (8, 1 << 14, 1024), (4, 1 << 16, 1024), (2, 1 << 18, 1024),
        (1, 1 << 20, 1024)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call."""
    fn()
    _sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _combine(x, y):
    a1, b1 = x
    a2, b2 = y
    return a1 * a2, b1 * a2 + b2


def _methods(device, loop_max_t):
    """name -> (callable(a, b) -> h, applicable(T) -> str | None); the string says why it is skipped."""
    ms = {
        "linear_scan[reference]": (lambda a, b: linear_scan(a, b, impl="reference"), lambda T: None),
    }
    if device.type == "cuda":
        ms["linear_scan[triton]"] = (lambda a, b: linear_scan(a, b, impl="triton"), lambda T: None)
    if device.type == "cpu":
        from adjoint_compile.kernels.scan import cpu as _cpu

        why = None if _cpu.available() else f"unavailable: {_cpu.why_unavailable()}"
        ms["linear_scan[cpu]"] = (lambda a, b: linear_scan(a, b, impl="cpu"), lambda T: why)
    ms["per-step loop"] = (lambda a, b: naive_scan(a, b, None, 1),
                           lambda T: None if T <= loop_max_t else f"skipped above T={loop_max_t} (too slow)")
    try:
        from torch._higher_order_ops.associative_scan import associative_scan
        mode = "pointwise" if device.type == "cuda" else "generic"
        ms[f"torch associative_scan[{mode}]"] = (
            lambda a, b: associative_scan(_combine, (a, b), dim=1, combine_mode=mode)[1], lambda T: None)
    except ImportError as e:
        ms["torch associative_scan"] = (None, lambda T, e=e: f"unavailable: {e}")
    if importlib.util.find_spec("accelerated_scan") is None:
        ms["accelerated-scan"] = (None, lambda T: "not installed")
    else:
        def acc_scan(a, b):
            from accelerated_scan.warp import scan  # [B, D, T] layout, T a power of two
            return scan(a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()).transpose(1, 2)
        ms["accelerated-scan"] = (acc_scan, lambda T: None if device.type == "cuda" else "CUDA only")
    if importlib.util.find_spec("fla") is None:
        ms["fla hgrn"] = (None, lambda T: "not installed")
    else:
        def fla_hgrn(a, b):
            # HGRN: h_t = exp(g_t) h_{t-1} + x_t with g = log a (a > 0 in this benchmark)
            from fla.ops.hgrn import fused_recurrent_hgrn
            return fused_recurrent_hgrn(b, a.log())[0]
        ms["fla hgrn"] = (fla_hgrn, lambda T: None if device.type == "cuda" else "CUDA only")
    return ms


def _peak_bandwidth(device) -> dict:
    """Theoretical (from the memory clock and bus width) and measured (a large copy) bandwidth, bytes/s."""
    if device.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(device)
    out = {"name": p.name}
    clock, width = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    if clock and width:
        out["theoretical"] = 2 * clock * 1e3 * width / 8        # DDR: two transfers per clock
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), device, 10)
    out["copy"] = 2 * x.numel() * 4 / t
    return out


def run(device: torch.device, sizes, repeats: int, loop_max_t: int, dtype=torch.float32) -> dict:
    results = []
    methods = _methods(device, loop_max_t)
    esize = torch.tensor([], dtype=dtype).element_size()
    for (B, T, D) in sizes:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = (torch.rand(B, T, D, generator=g) * 0.1 + 0.9).to(device, dtype)
        b = torch.randn(B, T, D, generator=g).to(device, dtype)
        gh = torch.randn(B, T, D, generator=g).to(device, dtype)
        ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
        n = a.numel()
        rows, jobs = {}, {}
        for name, (fn, why) in methods.items():
            rows[name] = {"method": name, "B": B, "T": T, "D": D, "dtype": str(dtype).replace("torch.", "")}
            reason = why(T)
            if reason is not None or fn is None:
                rows[name]["skipped"] = reason
                continue

            def fwd_bwd(fn=fn):
                torch.autograd.grad(fn(ar, br), [ar, br], gh)
            jobs[name] = {"fwd": lambda fn=fn: fn(a, b), "fwd_bwd": fwd_bwd}
        # NB: methods take turns inside each round, so a busy machine (other jobs on these 2 cores) slows all
        # methods of a round alike and the ratios stay meaningful; the per-step loop sits out after 3 rounds.
        times = {name: {"fwd": [], "fwd_bwd": []} for name in jobs}
        for rnd in range(repeats + 1):
            for name, job in list(jobs.items()):
                if name == "per-step loop" and rnd > 3:
                    continue
                for kind in ("fwd", "fwd_bwd"):
                    try:
                        _sync(device)
                        t0 = time.perf_counter()
                        job[kind]()
                        _sync(device)
                        dt = time.perf_counter() - t0
                    except Exception as e:  # a library that fails at a size is reported, not fatal
                        rows[name]["skipped"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                        del jobs[name]
                        break
                    if rnd > 0:                       # round 0 is the warm-up
                        times[name][kind].append(dt)
        for name in jobs:
            fwd, fb = statistics.median(times[name]["fwd"]), statistics.median(times[name]["fwd_bwd"])
            rows[name].update(fwd_s=fwd, fwd_bwd_s=fb, fwd_GBps=3 * n * esize / fwd / 1e9,
                              fwd_bwd_GBps=8 * n * esize / fb / 1e9)
            log.info("%-32s B=%d T=%-8d D=%-5d fwd %9.3f ms  fwd+bwd %9.3f ms", name, B, T, D, fwd * 1e3, fb * 1e3)
        results.extend(rows.values())
    return {"device": str(device), "device_name": _device_name(device), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "platform": platform.platform(), "repeats": repeats,
            "peak_bandwidth_Bps": _peak_bandwidth(device), "results": results}


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def table(report: dict) -> str:
    peak = report["peak_bandwidth_Bps"]
    ref = peak.get("theoretical") or peak.get("copy")
    lines = [f"linear scan on {report['device_name']} (torch {report['torch']}, {report['threads']} threads)",
             f"{'method':32s} {'B':>2s} {'T':>8s} {'D':>5s} {'fwd ms':>10s} {'f+b ms':>10s} {'fwd GB/s':>9s} "
             f"{'f+b GB/s':>9s}" + ("  f+b % peak" if ref else "")]
    for r in report["results"]:
        head = f"{r['method']:32s} {r['B']:>2d} {r['T']:>8d} {r['D']:>5d}"
        if "skipped" in r:
            lines.append(f"{head} {r['skipped']}")
            continue
        s = (f"{head} {r['fwd_s'] * 1e3:10.3f} {r['fwd_bwd_s'] * 1e3:10.3f} {r['fwd_GBps']:9.2f} "
             f"{r['fwd_bwd_GBps']:9.2f}")
        if ref:
            s += f"  {100 * r['fwd_bwd_GBps'] * 1e9 / ref:9.1f}%"
        lines.append(s)
    # speed-up of the reference over the per-step loop where both ran
    by = {(r["method"], r["T"]): r for r in report["results"] if "fwd_s" in r}
    for (m, T), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        loop = by.get(("per-step loop", T))
        if m == "linear_scan[reference]" and loop:
            lines.append(f"T={T}: reference is {loop['fwd_s'] / r['fwd_s']:.1f}x (fwd) and "
                         f"{loop['fwd_bwd_s'] / r['fwd_bwd_s']:.1f}x (fwd+bwd) faster than the per-step loop")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    methods = sorted({r["method"] for r in report["results"] if "fwd_s" in r})
    for m in methods:
        rows = sorted((r for r in report["results"] if r["method"] == m and "fwd_s" in r), key=lambda r: r["T"])
        Ts = [r["T"] for r in rows]
        axes[0].plot(Ts, [r["fwd_bwd_s"] * 1e3 for r in rows], marker="o", label=m)
        axes[1].plot(Ts, [r["fwd_bwd_GBps"] for r in rows], marker="o", label=m)
    for ax, yl in zip(axes, ["forward+backward time (ms)", "effective GB/s (forward+backward)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"linear scan, {report['device_name']} (B·D = 256 for T <= 32K, 16 above; fp32)"
                 if report["device"] == "cpu" else f"linear scan, {report['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--full", action="store_true", help="the GPU sizes (B·D = 8K, T up to 1M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loop-max-t", type=int, default=1 << 15, help="largest T the per-step loop is run at")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    report = run(device, FULL if args.full else QUICK, args.repeats, args.loop_max_t)
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"scan_{device.type}" + ("_full" if args.full else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
