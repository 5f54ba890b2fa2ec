"""The vocabulary head + cross-entropy alone, forward and backward: the fused op's Triton kernels at several tile
configurations (the backward in two passes or one with atomics), its torch reference, and ``F.linear`` + ``F.cross_entropy`` eager and under ``torch.compile``, side
by side in one run: step time (median) and peak memory, and each fused configuration's error against the eager loss
and gradients. For tuning the kernels on a GPU (``kernels/linear_ce/triton.py`` ``CONFIG``).

    python benchmarks/lce_kernels.py --device cuda                  # N 4096 / 16384 / 32768 rows, V 32000 / 50257
    python benchmarks/lce_kernels.py --device cpu --tiny            # a dry run under TRITON_INTERPRET=1

Writes ``benchmarks/results/lce_kernels_<device>.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (BLOCK_N, BLOCK_V, num_warps, num_stages, backward) tried for the kernels
CONFIGS = [(64, 64, 4, 2, "two-pass"), (64, 128, 4, 2, "two-pass"), (128, 64, 8, 2, "two-pass"),
           (128, 128, 8, 2, "two-pass"), (64, 64, 4, 3, "two-pass"), (64, 64, 4, 2, "atomic"),
           (128, 64, 8, 2, "atomic")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small sizes and two configurations (a dry run)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--sizes", default=None, help="rows x vocabulary, e.g. 4096x32000,16384x50257")
    p.add_argument("--precisions", default=None,
                   help="torch float32 matmul precisions to run the Triton configurations under (highest, high, "
                        "medium; highest:ieee or highest:tf32x3 names the kernels' fp32 products at highest)")
    p.add_argument("--ref-rows", default=None, help="logits per block of the torch reference, e.g. 1048576,16777216")
    p.add_argument("--configs", default=None, help="indices into CONFIGS (default: all)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.nn.functional as F

    from adjoint_compile import measure
    from adjoint_compile.kernels import linear_ce
    from adjoint_compile.kernels.linear_ce import ref as lce_ref
    from adjoint_compile.kernels.linear_ce import triton as lce_triton

    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    sizes = [(96, 130)] if args.tiny else [(N, V) for V in (32000, 50257) for N in (4096, 16384, 32768)]
    if args.sizes:
        sizes = [tuple(int(x) for x in nv.split("x")) for nv in args.sizes.split(",")]
    configs = [CONFIGS[0], CONFIGS[-1]] if args.tiny else CONFIGS
    if args.configs:
        configs = [CONFIGS[int(i)] for i in args.configs.split(",")]
    precisions = args.precisions.split(",") if args.precisions else [torch.get_float32_matmul_precision()]
    ref_rows = [int(r) for r in args.ref_rows.split(",")] if args.ref_rows else [lce_ref._rows(1, dev)]
    compiled = torch.compile(lambda h, W, t: F.cross_entropy(F.linear(h, W), t, reduction="sum"))
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "d": args.d, "dtype": args.dtype,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    base_precision, base_rows = torch.get_float32_matmul_precision(), (lce_ref.ROWS, lce_ref.ROWS_GPU)
    base_fp32 = lce_triton.CONFIG["fp32_highest"]
    for N, V in sizes:
        torch.set_float32_matmul_precision(base_precision)
        lce_ref.ROWS, lce_ref.ROWS_GPU = base_rows
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(N, args.d, device=dev, generator=g).to(dt).requires_grad_()
        W = (torch.randn(V, args.d, device=dev, generator=g) / args.d ** 0.5).to(dt).requires_grad_()
        t = torch.randint(0, V, (N,), device=dev, generator=g)
        t[::7] = -100

        def eager():
            return torch.autograd.grad(F.cross_entropy(F.linear(h, W), t, reduction="sum"), (h, W))

        def comp():
            return torch.autograd.grad(compiled(h, W, t), (h, W))

        def fused(impl):
            def run():
                loss, lse = linear_ce.lce_forward(h.detach(), W.detach(), None, t, -100, 0.0, impl=impl)
                dh, dw, _ = linear_ce.lce_backward(torch.ones_like(loss), None, h.detach(), W.detach(), None, t, lse,
                                                   -100, 0.0, impl=impl)
                return loss.sum(), dh, dw
            return run

        want = eager()
        want_loss = F.cross_entropy(F.linear(h, W), t, reduction="sum").detach()
        methods = [("eager", eager)] + ([] if args.no_compile else [("compile", comp)])
        methods += [(f"reference rows={r}", fused("reference"), None, r) for r in ref_rows]
        methods += [(f"triton {c} {prec}", fused("triton"), c, None, prec) for prec in precisions for c in configs]
        for name, fn, *cfg in methods:
            if cfg and cfg[0] is not None:
                b_n, b_v, warps, stages, backward = cfg[0]
                lce_triton.CONFIG.update(BLOCK_N=b_n, BLOCK_V=b_v, num_warps=warps, num_stages=stages,
                                         backward=backward)
                prec, _, fp32 = cfg[2].partition(":")
                torch.set_float32_matmul_precision(prec)
                lce_triton.CONFIG["fp32_highest"] = fp32 or base_fp32
            elif cfg:
                lce_ref.ROWS = lce_ref.ROWS_GPU = cfg[1]
            try:
                got = fn()
                if name.startswith(("triton", "reference")):
                    loss, dh, dw = got
                    err = max(measure_rel(loss, want_loss), measure_rel(dh, want[0]), measure_rel(dw, want[1]))
                else:
                    err = 0.0
                with measure.track_peak(dev) as m:
                    fn()
                step = measure.median_time(fn, dev, repeats=args.repeats)
                row = {"N": N, "V": V, "method": name, "step_s": step, "peak_bytes": m["peak"], "max_rel_err": err}
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a row, not the end
                row = {"N": N, "V": V, "method": name, "failed": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(row)
            # NB: written after every row, so that a run stopped at its time limit keeps what it measured
            (out / f"lce_kernels_{dev.type}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def measure_rel(x, y) -> float:
    x, y = x.detach().double(), y.detach().double()
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


if __name__ == "__main__":
    main()
