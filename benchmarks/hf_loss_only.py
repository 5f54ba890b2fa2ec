"""transformers' MambaForCausalLM called with ``labels``: peak memory of one training step (forward + backward) with
the model returning its logits (as it does by default) against ``adjoint_compile.loss_only(model)``.

The model is a tiny ``MambaForCausalLM`` (hidden 64, state 16, 2 layers, vocabulary 32000, tied head, fp32), the
step ``model(input_ids=ids, labels=ids).loss.backward()`` as the Trainer runs it (the output object is dropped
before the backward), B = 1:

* ``compile``: ``torch.compile`` (inductor), unpatched: the library's own path (its ``associative_scan``);
* ``adjoint``: ``backend="adjoint"`` (default options), unpatched: the head and the loss run in the sharded region,
  but the logits are an output of the graph, so they are made whole too (``[1, T, 32000]`` fp32);
* ``adjoint+loss_only``: the same with ``adjoint_compile.loss_only(model)``: the output has ``logits=None``, the
  logits exist one shard at a time;
* ``adjoint+loss_only+dp`` (not run by default): the same with ``per_sample_clip=1.0`` (DP-SGD's step: every
  example's gradient clipped, then summed; ``--batch`` > 1 to have several examples).

Each (method, T) runs in a fresh process: one step (compiling) and ``--warmup`` more, then one step under
``adjoint_compile.measure.track_peak`` (live tensor bytes: the profiler's allocator events on CPU, inductor's
buffers included; ``max_memory_allocated`` on CUDA), then ``--repeats`` timed steps (median).

Writes ``benchmarks/results/hf_loss_only<tag>.json`` (``--out``, ``--tag``) and prints the table.

    nice python benchmarks/hf_loss_only.py                   # CPU: T 2048 and 8192 (about 10 minutes, 2 cores)
    python benchmarks/hf_loss_only.py --device cuda --lengths 2048,8192,32768
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

METHODS = ("compile", "adjoint", "adjoint+loss_only")
#: run when named in ``--methods``
EXTRA = ("adjoint+loss_only+dp",)


def run_one(method: str, T: int, args: argparse.Namespace) -> dict:
    """One method at one length, in this process."""
    import warnings

    import torch
    import transformers

    import adjoint_compile as ac
    from adjoint_compile import measure

    dev = torch.device(args.device)
    if dev.type == "cpu":
        measure.prepare_cpu_measurement()
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.hidden, state_size=args.state,
                                   num_hidden_layers=args.layers, expand=2, conv_kernel=4)
    model = transformers.MambaForCausalLM(cfg).to(dev)
    model.train()
    if method.startswith("adjoint+loss_only"):
        ac.loss_only(model)
    opts = {"per_sample_clip": 1.0} if method.endswith("+dp") else {}
    f = torch.compile(model, dynamic=False) if method == "compile" else torch.compile(model, backend="adjoint",
                                                                                      dynamic=False, options=opts)
    ids = torch.randint(0, args.vocab, (args.batch, T), generator=torch.Generator().manual_seed(1)).to(dev)
    losses = []

    def one() -> None:
        model.zero_grad(set_to_none=True)
        loss = f(input_ids=ids, labels=ids).loss  # NB: as the Trainer: the output object is dropped here
        losses.append(loss.item())
        loss.backward()

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):  # NB: the sharded runtime compiles a shard program per shard size at first use
            one()
    model.zero_grad(set_to_none=True)
    with measure.track_peak(dev) as m:
        out = f(input_ids=ids, labels=ids)
        logits = None if out.logits is None else list(out.logits.shape)
        loss = out.loss
        del out
        loss.backward()
    step_s = measure.median_time(one, dev, repeats=args.repeats, warmup=0)
    row = {"method": method, "T": T, "peak_bytes": m["peak"], "step_s": step_s, "first_step_s": first,
           "loss": losses[0], "logits_returned": logits}
    if method != "compile":
        rep = ac.report(f)
        lin = [r for r in rep.regions if r.kind == "linear_recurrence"]
        row["rewrites"] = sorted({r.rewrite for r in lin})
        row["loss_in_region"] = any("sum(s) over time" in r.reason for r in lin)
        row["regions"] = len({r.details.get("region_call") for r in lin})
        row["report_says_logits_kept"] = any("loss_only" in r.reason for r in lin)
        row["shard_size"] = lin[0].details.get("shard_size") if lin else None
        row["fallbacks"] = [fb.cause for fb in rep.fallbacks]
    return row


def table(rows: list[dict], lengths: list[int], methods: list[str]) -> str:
    def cell(method: str, T: int) -> str:
        r = next((r for r in rows if r.get("method") == method and r.get("T") == T), None)
        if r is None or "peak_bytes" not in r:
            return "—" if r is None else r.get("failed", "failed")
        return f"{r['peak_bytes'] / 2**20:.1f} MiB, {r['step_s']:.2f} s"

    out = ["| method | " + " | ".join(f"T = {T}: peak, step" for T in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    out += [f"| {m} | " + " | ".join(cell(m, T) for T in lengths) + " |" for m in methods]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="steps after the first, before measuring")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default="", help="suffix of the JSON's name (hf_loss_only<tag>.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "method@T", prints its JSON
    args = p.parse_args(argv)
    if args.one:
        method, T = args.one.rsplit("@", 1)
        print("RESULT " + json.dumps(run_one(method, int(T), args)), flush=True)
        return
    import torch
    import transformers

    load = os.getloadavg()[0]
    dev_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS + EXTRA):
        p.error(f"--methods: unknown {sorted(unknown)}; expected some of {METHODS + EXTRA}")
    rows = []
    for T in args.lengths:
        for method in methods:
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", f"{method}@{T}"]
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rows.append({"method": method, "T": T, "failed": f"timed out after {args.timeout} s"})
                continue
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                rows.append({"method": method, "T": T, "failed": f"exit {proc.returncode}"})
                continue
            r = json.loads(line[len("RESULT "):])
            rows.append(r)
            print(f"  {method:18s} T={T:6d}: peak {r['peak_bytes'] / 2**20:9.1f} MiB  step {r['step_s']:7.3f} s  "
                  f"first {r['first_step_s']:6.1f} s  loss {r['loss']:.6f}  logits {r['logits_returned']}", flush=True)
    meta = {"device": dev_name, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "load_average_1min_at_start": load, "repeats": args.repeats,
            "warmup": args.warmup,
            "model": f"MambaForCausalLM(hidden {args.hidden}, state {args.state}, {args.layers} layers, vocabulary "
                     f"{args.vocab}, tied head, fp32), batch {args.batch}, "
                     f"model(input_ids=ids, labels=ids).loss.backward()"}
    peaks = {(r["method"], r["T"]): r.get("peak_bytes") for r in rows}
    ratios = {f"{m} / compile at T={T}": round(peaks[(m, T)] / peaks[("compile", T)], 4)
              for T in args.lengths for m in methods if m != "compile"
              if peaks.get((m, T)) and peaks.get(("compile", T))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hf_loss_only{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, "peak_ratios": ratios},
                                                                 indent=1))
    print(table(rows, args.lengths, methods))
    for k, v in ratios.items():
        print(f"peak {k}: {v}x")


if __name__ == "__main__":
    main()
