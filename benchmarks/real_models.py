"""Real SSM / RNN implementations under backend="adjoint", as their users wrote them, side by side with
torch.compile (inductor): what is recognized and rewritten, the gradient error against eager autograd, the peak
memory of one training step, and the time of the first (compiling) step at two lengths.

    python benchmarks/real_models.py                      # quick sizes: memory at T=4096, first step at 1024, 4096
    python benchmarks/real_models.py --mem-len 8192 --first-lens 1024 16384     # the issue's sizes (slow on CPU)
    python benchmarks/real_models.py --targets mingru mambapy

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
        else:
            cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                            num_heads=4, head_dim=16, expand=2, n_groups=1, chunk_size=16)
            base = transformers.Mamba2Model(cfg)

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
}


def _loss(y: torch.Tensor) -> torch.Tensor:
    # NB: a fixed random projection, not y.pow(2).mean(): the models end in an RMSNorm, whose output's squared norm
    # hardly depends on its input, so that loss's gradients are ~1e-9 and mostly fp32 cancellation (eager fp32 was
    # 2.7e-2 away from eager fp64 on Mamba2's A_log)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return (y.float() * r.to(y.device)).sum() / y.numel() ** 0.5


def _child(target: str, what: str, T: int, method: str) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    from adjoint_compile.measure import compare_training_step, prepare_cpu_measurement

    prepare_cpu_measurement()  # NB: before anything is allocated (adjoint_compile.measure)
    import adjoint_compile as ac

    torch.manual_seed(0)
    model, inputs = TARGETS[target][2](T)
    if what == "recognize":
        f = torch.compile(model, backend="adjoint", options={"inner": "eager", "shard_size": 7})
        x_grads = []
        for run in (f, model):
            for p in model.parameters():
                p.grad = None
            _loss(run(*inputs)).backward()
            x_grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        err = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*x_grads))
        # the floor: how far eager fp32 itself is from eager fp64 on the same loss
        m64 = copy.deepcopy(model).double()
        _loss(m64(*(x.double() if x.is_floating_point() else x for x in inputs))).backward()
        g64 = [p.grad for p in m64.parameters() if p.grad is not None]
        floor = max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(x_grads[1], g64))
        rep = ac.report(f)
        rec = [r for r in rep.regions if r.kind != "residual_chain"]
        return {"sources": sorted({r.source for r in rec}), "recurrences": len(rec),
                "rewritten": sum(r.rewrite != "none" for r in rec), "grad_rel_err": err, "eager_fp64_err": floor,
                "reasons": sorted({r.reason[:120] for r in rec if r.rewrite == "none"})}
    if what == "memory":  # one method per process: a compile that does not finish costs only its own figure
        rows = compare_training_step(model, inputs, _loss, "cpu", repeats=1, methods=(method,))
        return {"peak_bytes": rows[0]["peak_bytes"], "step_s": rows[0]["step_s"]}
    run = torch.compile(model) if method == "compile" else torch.compile(model, backend="adjoint")
    times = []
    for _ in range(2):  # the second step is the run alone: first - second is what compiling cost
        t0 = time.perf_counter()
        _loss(run(*inputs)).backward()
        times.append(time.perf_counter() - t0)
    return {"first_step_s": times[0], "second_step_s": times[1]}


def _measure(target: str, what: str, T: int, method: str = "", timeout: int = 1800) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", target, what, str(T), method or "-"]
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


def _has_second(results: dict[str, Any]) -> bool:
    return any("second_step_s" in x for r in results.values() for f in r.get("first", {}).values() for x in f.values())


def _table(results: dict[str, Any], mem_len: int, first_lens: list[int]) -> str:
    head = (["library", "model", "recognized as", "rewritten", "grad rel err (T=64): adjoint vs eager (eager fp32 vs fp64)",
             f"peak memory adjoint / compile (T={mem_len})"]
            + [f"first step T={T}: adjoint / compile" + (" (second step)" if _has_second(results) else "")
               for T in first_lens])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        lib, model = TARGETS[name][0], TARGETS[name][1]
        if "missing" in r:
            rows.append(f"| {lib} | {model} | not installed | | | | " + " | " * (len(first_lens) - 1) + "|")
            continue
        rec, mem = r["recognize"], r["memory"]
        recog = "error: " + rec["error"] if "error" in rec else (", ".join(rec["sources"]) or "nothing")
        rew = "" if "error" in rec else f"{rec['rewritten']} of {rec['recurrences']}"
        err = "" if "error" in rec else f"{rec['grad_rel_err']:.1e}" + (
            f" ({rec['eager_fp64_err']:.1e})" if "eager_fp64_err" in rec else "")
        if "error" in mem:  # an older results file: one process for all methods
            memc = "error: " + mem["error"]
        else:
            a, c = (mem[m].get("peak_bytes", mem[m].get("error", "?")[:40]) for m in ("adjoint", "compile"))
            memc = (f"{_mib(a)} / {_mib(c)} ({a / c:.2f}x)" if isinstance(a, int) and isinstance(c, int) and c
                    else f"{_mib(a) if isinstance(a, int) else a} / {_mib(c) if isinstance(c, int) else c}")
        firsts = []
        for T in first_lens:
            fa, fc = r["first"][str(T)]["adjoint"], r["first"][str(T)]["compile"]
            show = [(f"{x['first_step_s']:.1f} s" + (f" ({x['second_step_s']:.1f} s)" if "second_step_s" in x else ""))
                    if "first_step_s" in x else x.get("error", "?")[:40] for x in (fa, fc)]
            firsts.append(" / ".join(show))
        rows.append("| " + " | ".join([lib, model, recog, rew, err, memc, *firsts]) + " |")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        target, what, T, method = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        print("RESULT " + json.dumps(_child(target, what, T, "" if method == "-" else method)), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--mem-len", type=int, default=4096)
    p.add_argument("--first-lens", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement (each in its own process)")
    a = p.parse_args()
    results: dict[str, Any] = {}
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
        r["memory"] = {m: _measure(name, "memory", a.mem_len, m, timeout=a.timeout)
                       for m in ("adjoint", "compile", "eager")}
        print(f"{name}: memory T={a.mem_len} {r['memory']}", flush=True)
        r["first"] = {}
        for T in a.first_lens:
            r["first"][str(T)] = {m: _measure(name, "first", T, m, timeout=a.timeout) for m in ("adjoint", "compile")}
            print(f"{name}: first step T={T} {r['first'][str(T)]}", flush=True)
        results[name] = r
        _write(results, a)  # NB: after every target: a long run that is stopped keeps what it measured
    print(_table(results, a.mem_len, a.first_lens))


def _write(results: dict[str, Any], a: argparse.Namespace) -> None:
    meta = {"device": "cpu", "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "batch": B, "mem_len": a.mem_len, "first_lens": a.first_lens}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_models_cpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "real_models_cpu.md").write_text(_table(results, a.mem_len, a.first_lens) + "\n")


if __name__ == "__main__":
    main()
