"""Real SSM / RNN implementations under backend="adjoint", as their users wrote them, side by side with
torch.compile (inductor): what is recognized and rewritten, the gradient error against eager autograd, the peak
memory of one training step, and the time of the first (compiling) step at two lengths.

    python benchmarks/real_models.py                      # quick sizes: memory at T=4096, first step at 1024, 4096
    python benchmarks/real_models.py --mem-lens 8192 65536 --first-lens      # long sequences (slow on CPU)
    python benchmarks/real_models.py --targets mingru mambapy
    python benchmarks/real_models.py --threads 1 2 --mem-lens 4096 --first-lens   # later steps with 1 and 2 threads

The model and its loss (a fixed random projection of the last hidden state, summed) are compiled as one module, as
when a whole training step is compiled; ``--loss-outside`` compiles the model alone (its [B, T, D] output and that
output's gradient then live outside the compiled code and grow with T). Peak memory is the most bytes of tensors
live at once during one training step (:func:`adjoint_compile.measure.track_peak`), step time the median of 3.
``--threads N …`` adds the later step's time (median of 7 after 2 warm-up steps) with ``torch.set_num_threads(N)``
for each N, adjoint and compile each in a fresh process, and a plot of them (``--plot JSON`` draws it again).

Every measurement (each method's memory, each first step) runs in a fresh process with its own time limit
(``--timeout``), so compile caches and allocator state do not leak between them and a compile that does not finish
costs only its own figure. Writes
``benchmarks/results/real_models_<device>.json`` and ``.md`` (the README's table). Targets whose library is not
installed are listed as such. The libraries are the test dependencies (``pip install -e ".[dev]"``).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

B = 2


def _mambapy(pscan: bool) -> Callable[[int], tuple[nn.Module, tuple]]:
    def build(T: int) -> tuple[nn.Module, tuple]:
        from mambapy.mamba import Mamba, MambaConfig

        model = Mamba(MambaConfig(d_model=16, n_layers=2, d_state=8, pscan=pscan))
        return model, (torch.randn(B, T, 16),)
    return build


def _mingru(T: int) -> tuple[nn.Module, tuple]:
    from minGRU_pytorch import minGRU

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([minGRU(32, expansion_factor=2.0) for _ in range(2)])
            self.norms = nn.ModuleList([nn.RMSNorm(32) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for norm, layer in zip(self.norms, self.layers):
                x = x + layer(norm(x))
            return x

    return Stack(), (torch.randn(B, T, 32),)


def _hf(kind: str) -> Callable[[int], tuple[nn.Module, tuple]]:
    def build(T: int) -> tuple[nn.Module, tuple]:
        import transformers

        if kind == "mamba":
            cfg = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=8, num_hidden_layers=2,
                                           expand=2, conv_kernel=4)
            base = transformers.MambaModel(cfg)
        elif kind == "mamba2":
            cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                            num_heads=4, head_dim=16, expand=2, n_groups=1, chunk_size=16)
            base = transformers.Mamba2Model(cfg)
        elif kind == "bamba":  # NB: a hybrid carrying its own copy of Mamba2's chunked scan; Mamba layers only
            cfg = transformers.BambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[],
                                           mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                           mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, use_cache=False)
            base = transformers.BambaModel(cfg)
        else:  # NB: Griffin's RG-LRU blocks only (its local attention would end the region)
            cfg = transformers.RecurrentGemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                    head_dim=16, lru_width=32, attention_window_size=16,
                                                    conv1d_width=4, block_types=("recurrent",), use_cache=False)
            base = transformers.RecurrentGemmaModel(cfg)

        class Hidden(nn.Module):  # NB: last hidden state as a tensor, so every method gets the same loss
            def __init__(self) -> None:
                super().__init__()
                self.base = base

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.base(input_ids=ids).last_hidden_state

        return Hidden(), (torch.randint(0, 64, (B, T)),)
    return build


TARGETS: dict[str, tuple[str, str, Callable[[int], tuple[nn.Module, tuple]]]] = {
    "mambapy": ("mambapy", "Mamba, pscan=True", _mambapy(True)),
    "mambapy-loop": ("mambapy", "Mamba, pscan=False (a loop)", _mambapy(False)),
    "mingru": ("mingru-pytorch", "minGRU stack (log-space scan)", _mingru),
    "hf-mamba": ("transformers", "MambaModel (tiny config)", _hf("mamba")),
    "hf-mamba2": ("transformers", "Mamba2Model (tiny config)", _hf("mamba2")),
    "hf-bamba": ("transformers", "BambaModel, Mamba layers (tiny config)", _hf("bamba")),
    "hf-recurrent-gemma": ("transformers", "RecurrentGemmaModel, RG-LRU blocks (tiny config)", _hf("recurrent_gemma")),
}


def _loss(y: torch.Tensor) -> torch.Tensor:
    # NB: a fixed random projection, not y.pow(2).mean(): the models end in an RMSNorm, whose output's squared norm
    # hardly depends on its input, so that loss's gradients are ~1e-9 and mostly fp32 cancellation (eager fp32 was
    # 2.7e-2 away from eager fp64 on Mamba2's A_log)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return (y.float() * r.to(y.device)).sum() / y.numel() ** 0.5


class WithLoss(nn.Module):
    """The model and its loss as one module, as when a whole training step is compiled: ``forward(*inputs, r)``
    is :func:`_loss` of the model's output with the projection ``r`` given (made once, like the labels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        y = self.model(*args[:-1])
        return (y.float() * args[-1]).sum() / y.numel() ** 0.5


def _with_loss(model: nn.Module, inputs: tuple) -> tuple[nn.Module, tuple]:
    with torch.no_grad():
        shape = model(*inputs).shape
    r = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return WithLoss(model), (*inputs, r)


def _child(target: str, what: str, T: int, method: str, loss_inside: bool = True) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    from adjoint_compile.measure import compare_training_step, prepare_cpu_measurement

    prepare_cpu_measurement()  # NB: before anything is allocated (adjoint_compile.measure)
    import adjoint_compile as ac

    torch.manual_seed(0)
    model, inputs = TARGETS[target][2](T)
    if what == "recognize":
        f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 7})
        # NB: copied before a forward: a model may keep non-leaf tensors of its last call (RecurrentGemma's states)
        m64 = copy.deepcopy(model).double()
        x_grads = []
        for run in (f, model):
            for p in model.parameters():
                p.grad = None
            _loss(run(*inputs)).backward()
            x_grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        err = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*x_grads))
        # the floor: how far eager fp32 itself is from eager fp64 on the same loss
        _loss(m64(*(x.double() if x.is_floating_point() else x for x in inputs))).backward()
        g64 = [p.grad for p in m64.parameters() if p.grad is not None]
        floor = max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(x_grads[1], g64))
        rep = ac.report(f)
        rec = [r for r in rep.regions if r.kind != "residual_chain"]
        return {"sources": sorted({r.source for r in rec}), "recurrences": len(rec),
                "rewritten": sum(r.rewrite != "none" for r in rec), "grad_rel_err": err, "eager_fp64_err": floor,
                "reasons": sorted({r.reason[:120] for r in rec if r.rewrite == "none"})}
    if what == "memory":  # one method per process: a compile that does not finish costs only its own figure
        if loss_inside:
            model, inputs = _with_loss(model, inputs)
        rows = compare_training_step(model, inputs, (lambda loss: loss) if loss_inside else _loss, "cpu",
                                     repeats=3, methods=(method,))
        return {"peak_bytes": rows[0]["peak_bytes"], "step_s": rows[0]["step_s"]}
    if what.startswith("step"):  # "step<N>": the later step with N threads
        torch.set_num_threads(int(what[4:]))
        if loss_inside:
            model, inputs = _with_loss(model, inputs)
        run = torch.compile(model) if method == "compile" else torch.compile(model, backend="adjoint")

        def one() -> None:
            for p in model.parameters():
                p.grad = None
            out = run(*inputs)
            (out if loss_inside else _loss(out)).backward()
        from adjoint_compile.measure import median_time
        return {"step_s": median_time(one, "cpu", repeats=7, warmup=2), "threads": torch.get_num_threads()}
    run = torch.compile(model) if method == "compile" else torch.compile(model, backend="adjoint")
    times = []
    for _ in range(2):  # the second step is the run alone: first - second is what compiling cost
        t0 = time.perf_counter()
        _loss(run(*inputs)).backward()
        times.append(time.perf_counter() - t0)
    return {"first_step_s": times[0], "second_step_s": times[1]}


def _measure(target: str, what: str, T: int, method: str = "", timeout: int = 1800,
             extra: list[str] = ()) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", target, what, str(T), method or "-", *extra]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {out.returncode}: {tail[0][:200]}"}
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t0
    return res


def _mib(n: Any) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, (int, float)) else "—"


def _pair(a: dict[str, Any], c: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
    """``adjoint / compile (ratio)`` of one figure, or the error in its place."""
    x, y = a.get(key), c.get(key)
    show = [fmt(v) if v is not None else str(m.get("error", "?"))[:40] for v, m in ((x, a), (y, c))]
    ratio = f" ({x / y:.3f}x)" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else ""
    return " / ".join(show) + ratio


def _table(results: dict[str, Any], mem_lens: list[int], first_lens: list[int]) -> str:
    head = ["library", "model", "recognized as", "rewritten", "grad rel err (T=64): adjoint vs eager (eager fp32 vs fp64)"]
    for T in mem_lens:
        head += [f"peak T={T}: adjoint / compile", f"step T={T}: adjoint / compile"]
    if len(mem_lens) > 1:
        head.append(f"adjoint peak T={mem_lens[-1]} / T={mem_lens[0]}")
    head += [f"first step T={T}: adjoint / compile (second step)" for T in first_lens]
    threads = sorted({k for r in results.values() for k in r.get("step", {})}, key=int)
    head += [f"later step T={mem_lens[0]}, {n} thread(s): adjoint / compile" for n in threads]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        lib, model = TARGETS[name][0], TARGETS[name][1]
        if "missing" in r:
            rows.append(f"| {lib} | {model} | not installed |" + " |" * (len(head) - 3))
            continue
        rec = r["recognize"]
        recog = "error: " + rec["error"] if "error" in rec else (", ".join(rec["sources"]) or "nothing")
        rew = "" if "error" in rec else f"{rec['rewritten']} of {rec['recurrences']}"
        err = "" if "error" in rec else f"{rec['grad_rel_err']:.1e} ({rec['eager_fp64_err']:.1e})"
        cells = [lib, model, recog, rew, err]
        for T in mem_lens:
            m = r["memory"].get(str(T), {"adjoint": {"error": "not measured"}, "compile": {"error": "not measured"}})
            cells.append(_pair(m["adjoint"], m["compile"], "peak_bytes", _mib))
            cells.append(_pair(m["adjoint"], m["compile"], "step_s", lambda v: f"{v:.2f} s"))
        if len(mem_lens) > 1:
            lo, hi = (r["memory"].get(str(T), {}).get("adjoint", {}).get("peak_bytes")
                      for T in (mem_lens[0], mem_lens[-1]))
            cells.append(f"{hi / lo:.2f}x" if isinstance(lo, int) and isinstance(hi, int) and lo else "—")
        for T in first_lens:
            show = [(f"{x['first_step_s']:.1f} s ({x['second_step_s']:.1f} s)") if "first_step_s" in x
                    else x.get("error", "?")[:40] for x in (r["first"][str(T)][m] for m in ("adjoint", "compile"))]
            cells.append(" / ".join(show))
        for n in threads:
            st = r.get("step", {}).get(n, {})
            cells.append(_pair(st.get("adjoint", {}), st.get("compile", {}), "step_s", lambda v: f"{v:.3f} s")
                         if st else "—")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        target, what, T, method = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        inside = "--loss-outside" not in sys.argv
        print("RESULT " + json.dumps(_child(target, what, T, "" if method == "-" else method, inside)), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--mem-lens", type=int, nargs="+", default=[4096],
                   help="sequence lengths of the memory and step-time measurements (default 4096)")
    p.add_argument("--first-lens", type=int, nargs="*", default=[1024, 4096],
                   help="sequence lengths of the first (compiling) step (default 1024 4096; none: skip)")
    p.add_argument("--loss-outside", action="store_true",
                   help="compile the model alone and take the loss outside it (default: model and loss compiled "
                        "as one module, as a compiled training step)")
    p.add_argument("--threads", type=int, nargs="*", default=[],
                   help="also time the later step at the first --mem-lens length with each of these thread counts")
    p.add_argument("--skip-memory", action="store_true", help="no memory measurement (with --threads: times only)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement (each in its own process)")
    p.add_argument("--plot", metavar="JSON",
                   help="draw the step-time plot of a --threads run's JSON, measuring nothing")
    a = p.parse_args()
    if a.plot:
        data = json.loads(Path(a.plot).read_text())
        plot_steps(data["results"], data["meta"], Path(a.plot).with_suffix(".png"))
        return
    results: dict[str, Any] = {}
    extra = ["--loss-outside"] if a.loss_outside else []
    for name in a.targets:
        lib = TARGETS[name][0]
        try:
            TARGETS[name][2](1)
        except ImportError as e:
            print(f"{name}: {lib} is not installed ({e})", flush=True)
            results[name] = {"missing": lib}
            continue
        r: dict[str, Any] = {"recognize": _measure(name, "recognize", 64, timeout=a.timeout)}
        print(f"{name}: recognized {r['recognize']}", flush=True)
        r["memory"] = {}
        for T in ([] if a.skip_memory else a.mem_lens):
            r["memory"][str(T)] = {m: _measure(name, "memory", T, m, timeout=a.timeout, extra=extra)
                                   for m in ("adjoint", "compile")}
            print(f"{name}: memory T={T} {r['memory'][str(T)]}", flush=True)
            results[name] = r
            _write(results, a)  # NB: after every figure: a long run that is stopped keeps what it measured
        r["step"] = {}
        for n in a.threads:
            r["step"][str(n)] = {m: _measure(name, f"step{n}", a.mem_lens[0], m, timeout=a.timeout, extra=extra)
                                 for m in ("adjoint", "compile")}
            print(f"{name}: later step T={a.mem_lens[0]}, {n} thread(s) {r['step'][str(n)]}", flush=True)
        r["first"] = {}
        for T in a.first_lens:
            r["first"][str(T)] = {m: _measure(name, "first", T, m, timeout=a.timeout) for m in ("adjoint", "compile")}
            print(f"{name}: first step T={T} {r['first'][str(T)]}", flush=True)
        results[name] = r
        _write(results, a)
    print(_table(results, a.mem_lens, a.first_lens))


def _write(results: dict[str, Any], a: argparse.Namespace) -> None:
    meta = {"device": "cpu", "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "step_threads": a.threads,
            "torch": torch.__version__, "batch": B, "mem_lens": a.mem_lens, "first_lens": a.first_lens,
            "loss": "outside the compiled model" if a.loss_outside else "compiled with the model",
            "peak": "live tensor bytes (adjoint_compile.measure.track_peak, count='tensors')"}
    done = {k: v for k, v in results.items() if "missing" in v or a.skip_memory
            or len(v.get("memory", {})) == len(a.mem_lens)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "real_models_cpu_threads" if a.skip_memory else "real_models_cpu"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / f"{name}.md").write_text(_table(done, a.mem_lens, a.first_lens if all(
        "first" in v for v in done.values() if "missing" not in v) else []) + "\n")
    if a.threads:
        plot_steps(results, meta, out / f"{name}.png")


def plot_steps(results: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """Later-step time per model, adjoint beside compile, per thread count (log scale), each bar pair labelled with
    adjoint's ratio to compile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in results.items() if v.get("step")]
    threads = [str(n) for n in meta["step_threads"]]
    if not names or not threads:
        return
    fig, axes = plt.subplots(1, len(threads), figsize=(4.2 * len(threads), 3.6), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], threads):
        for i, name in enumerate(names):
            st = results[name]["step"].get(n, {})
            ad, co = (st.get(m, {}).get("step_s") for m in ("adjoint", "compile"))
            for dx, v, colour, label in ((-0.2, ad, "tab:blue", "adjoint"), (0.2, co, "tab:gray", "torch.compile")):
                if v:
                    ax.bar(i + dx, v, 0.4, color=colour, label=label if i == 0 else None)
            if ad and co:
                ax.text(i, max(ad, co) * 1.1, f"{ad / co:.2f}x", ha="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{n} thread{'s' if n != '1' else ''}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("later training step (s)")
    axes[0][0].legend(fontsize=8)
    T = meta["mem_lens"][0]
    fig.suptitle(f"Later step at T = {T}, B = {meta['batch']}, adjoint / compile ({meta['machine']}, "
                 f"torch {meta['torch']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
