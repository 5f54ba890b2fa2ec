"""The cost of the first-call forward check (option ``check_forward``, on by default): on a rewritten graph's first
call the graph as captured runs once more, eagerly and without autograd, and its outputs are compared.

For the shipped selective SSM stack (with its loss compiled in) at several lengths, in one process and one run:
the first step (compile + forward + backward) with the check on and off, the check's own forward, and a later
step. Prints a table and writes ``benchmarks/results/check_forward_<device>.json``.

    python benchmarks/check_forward.py                      # CPU: T = 1024, 4096, 16384 (about 2 minutes, 2 cores)
    python benchmarks/check_forward.py --lens 2048 --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import adjoint_compile as ac  # noqa: E402
from adjoint_compile.models.selective_ssm import SSMStack  # noqa: E402


def first_and_later(check: bool, T: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = SSMStack(args.d_model, args.d_state, args.layers).to(args.device)

    def loss_fn(x):
        return model(x).square().mean()

    opts = {"inner": args.inner, "check_forward": check}
    step = torch.compile(loss_fn, backend="adjoint", options=opts)
    x = torch.randn(args.batch, T, args.d_model, device=args.device)
    t0 = time.perf_counter()
    step(x).backward()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(x).backward()
    later = time.perf_counter() - t0
    rec = ac.report(step)
    rewritten = sum(r.rewrite != "none" for r in rec.regions)
    check_s = sum(c.timing.get("check_forward_s", 0.0) for c in rec.compiled)
    return {"first_s": first, "later_s": later, "check_s": check_s, "rewritten": rewritten,
            "fallbacks": sum(len(c.fallbacks) for c in rec.compiled)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lens", default="1024,4096,16384")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-state", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--inner", default="inductor")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    rows = []
    for T in [int(v) for v in args.lens.split(",")]:
        # NB: a discarded first compile, so that both measured ones find inductor's caches equally warm
        first_and_later(False, T, args)
        off, on = first_and_later(False, T, args), first_and_later(True, T, args)
        rows.append({"T": T, "first_on_s": on["first_s"], "first_off_s": off["first_s"], "check_s": on["check_s"],
                     "later_s": off["later_s"], "rewritten": on["rewritten"], "fallbacks": on["fallbacks"],
                     "check_share_of_first": on["check_s"] / on["first_s"]})
        r = rows[-1]
        print(f"T={T:6d}  first step: check on {r['first_on_s']:.2f} s, off {r['first_off_s']:.2f} s; the check's "
              f"forward {r['check_s']:.3f} s ({100 * r['check_share_of_first']:.1f}% of the first step); later step "
              f"{r['later_s']:.3f} s; regions rewritten {r['rewritten']}, fallbacks {r['fallbacks']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} threads)", "torch": torch.__version__,
            "model": f"SSMStack d_model={args.d_model} d_state={args.d_state} layers={args.layers}, batch "
                     f"{args.batch}, loss compiled in", "inner": args.inner, "load_average_1min_at_end": os.getloadavg()[0]}
    (out / f"check_forward_{args.device}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
