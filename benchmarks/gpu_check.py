"""On a CUDA machine: the Triton scan kernels compiled for real (not the interpreter) against the torch reference,
and the backend end to end against eager autograd on the GPU. Prints one line per case and a summary; exits 1 if
any case is off its tolerance.

    python benchmarks/gpu_check.py                  # about two minutes on one GPU
    python benchmarks/gpu_check.py --backend-only   # the backend cases alone
    python benchmarks/gpu_check.py --backend-only --graphs   # ... with options={"cuda_graphs": True}
    python benchmarks/gpu_check.py --lce-only       # the fused head + cross-entropy kernels alone

Kernels: forward and every gradient of ``scan_triton`` / ``scan_backward_triton`` against ``scan_ref`` /
``scan_backward_ref`` run in fp64 on the same inputs, at awkward sizes (T = 1, odd, non-powers of two, 2^20), both
directions, with and without h0, a window, and fp32 / bf16 / fp16 inputs (normwise relative error; tolerances per
dtype). The fused head + cross-entropy kernels (``kernels/linear_ce``) against their reference in fp64 the same way,
up to V = 50257. Backend: the shipped SSM stack with its loss, and an LM with cross-entropy in the region, compiled with
``backend="adjoint"`` on CUDA, loss and every parameter gradient against eager autograd (fp32).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adjoint_compile.kernels import scan as K  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def kernel_cases() -> Iterator[tuple[str, float, float]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for (B, T, D) in ((2, 1, 3), (2, 7, 5), (3, 1000, 33), (1, 65537, 17), (2, 1 << 20, 4)):
            for reverse in (False, True):
                for use_h0, window in ((False, None), (True, None), (True, 5)):
                    if window is not None and T > 100000:
                        continue
                    a = torch.rand(B, T, D, device="cuda", generator=g).mul(0.5).add(0.5).to(dtype)
                    b = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
                    h0 = torch.randn(B, D, device="cuda", generator=g).to(dtype) if use_h0 else None
                    gr = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
                    h = K.scan_triton(a, b, h0, 1, reverse, window)
                    want = K.scan_ref(a.double(), b.double(), None if h0 is None else h0.double(), 1, reverse, window)
                    da, db, dh0 = K.scan_backward_triton(gr, a, b, h0, h, 1, reverse, window)
                    wa, wb, wh0 = K.scan_backward_ref(gr.double(), a.double(), b.double(),
                                                      None if h0 is None else h0.double(), want, 1, reverse, window)
                    err = max(rel(h, want), rel(da, wa), rel(db, wb), rel(dh0, wh0) if h0 is not None else 0.0)
                    name = f"scan {str(dtype)[6:]} B={B} T={T} D={D} rev={reverse} h0={use_h0} window={window}"
                    yield (name, err, TOL[dtype])


def lce_cases() -> Iterator[tuple[str, float, float]]:
    """The fused head + cross-entropy kernels against the torch reference in fp64 (loss, lse and every gradient);
    fp32 at torch's default float32 matmul precision ("highest": the kernels' three TF32 products)."""
    from adjoint_compile.kernels import linear_ce as LCE
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for (N, D, V) in ((1, 5, 3), (7, 16, 97), (4097, 64, 50257), (333, 256, 32000), (1000, 40, 130)):
            for eps, bias in ((0.0, False), (0.1, True)):
                h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
                W = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
                b = torch.randn(V, device="cuda", generator=g).to(dtype) if bias else None
                t = torch.randint(0, V, (N,), device="cuda", generator=g)
                t[::5] = -100
                gl, gs = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
                d = [x.double() if x is not None else None for x in (h, W, b)]
                want = LCE.lce_forward(*d, t, -100, eps, impl="reference")
                got = LCE.lce_forward(h, W, b, t, -100, eps, impl="triton")
                wg = LCE.lce_backward(gl.double(), gs.double(), *d, t, want[1], -100, eps, impl="reference")
                gg = LCE.lce_backward(gl, gs, h, W, b, t, got[1], -100, eps, impl="triton")
                err = max([rel(x, y) for x, y in zip(got, want)] + [rel(x, y) for x, y in zip(gg, wg) if y is not None])
                yield (f"linear_ce {str(dtype)[6:]} N={N} D={D} V={V} eps={eps} bias={bias}", err, TOL[dtype])


def backend_cases() -> Iterator[tuple[str, float, float]]:
    import adjoint_compile as ac  # noqa: F401  (registers the backend)
    opts = {"shard_size": 64, "cuda_graphs": "--graphs" in sys.argv[1:]}
    tag = " graphs" if opts["cuda_graphs"] else ""
    from adjoint_compile.models.selective_ssm import SSMStack
    for T in (1, 7, 2049):
        torch.manual_seed(0)
        model = SSMStack(32, 8, 2).cuda()
        ref = SSMStack(32, 8, 2).cuda()
        ref.load_state_dict(model.state_dict())
        x = torch.randn(2, T, 32, device="cuda")
        # NB: a fixed projection, not model(x).square().mean(): the stack ends in an RMSNorm, so that loss is ~1
        # whatever the parameters and its gradients (~1e-8) are rounding noise (seen on an H200, inductor too)
        w = torch.randn(32, device="cuda")
        f = torch.compile(lambda x: (model(x) * w).sum(), backend="adjoint", options=opts)
        loss = f(x)
        loss.backward()
        want = (ref(x) * w).sum()
        want.backward()
        err = max([rel(loss, want)] + [rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())])
        yield (f"backend SSMStack T={T} shard 64{tag}", err, 1e-4)
    V = 50257
    for T in (5, 1000):
        torch.manual_seed(0)
        mods = nn.ModuleList([nn.Embedding(V, 64), SSMStack(64, 8, 2), nn.Linear(64, V, bias=False)]).cuda()
        refm = nn.ModuleList([nn.Embedding(V, 64), SSMStack(64, 8, 2), nn.Linear(64, V, bias=False)]).cuda()
        refm.load_state_dict(mods.state_dict())

        def step(ids: torch.Tensor, tg: torch.Tensor, m: nn.ModuleList) -> torch.Tensor:
            logits = m[2](m[1](m[0](ids)))
            return F.cross_entropy(logits.flatten(0, 1), tg.flatten())
        f = torch.compile(lambda i, t: step(i, t, mods), backend="adjoint", options=opts)
        errs = []
        # NB: four steps at one length: with graphs the loss's chunk loop is captured at the second and replayed
        # after; the last step adds two micro-batches' losses before one backward (each keeps its own gradients)
        for k in range(4):
            batches = []
            for _ in range(2 if k == 3 else 1):
                ids = torch.randint(0, V, (2, T), device="cuda")
                tg = torch.randint(0, V, (2, T), device="cuda")
                tg[0, T // 2] = -100                            # an ignored target
                batches.append((ids, tg))
            for p in (*mods.parameters(), *refm.parameters()):
                p.grad = None
            loss = sum(f(i, t) for i, t in batches)
            loss.backward()
            want = sum(step(i, t, refm) for i, t in batches)
            want.backward()
            errs += [rel(loss, want)] + [rel(p.grad, q.grad) for p, q in zip(mods.parameters(), refm.parameters())]
        err = max(errs)
        rep = ac.report(f)
        tail = [r.details.get("loss_tail") for r in rep.regions if r.rewrite == "adjoint"]
        from adjoint_compile.runtime import graphed, loss_tail
        loops = sum(isinstance(e[0], graphed.GraphedCall) for e in loss_tail._LOOPS.values())
        yield (f"backend LM V={V} T={T} shard 64{tag} (fallbacks: {len(rep.fallbacks)}, loss run in the forward: "
               f"{bool(tail and tail[0])}, fused heads: {tail[0].get('fused_heads') if tail and tail[0] else 0}, "
               f"chunk loops captured: {loops})", err, 1e-4)


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    bad = 0
    groups = (backend_cases,) if "--backend-only" in sys.argv[1:] else (kernel_cases, lce_cases, backend_cases)
    if "--lce-only" in sys.argv[1:]:
        groups = (lce_cases,)
    for group in groups:
        # NB: each case printed as it ends, so that a run stopped at its time limit shows how far it got
        try:
            for name, err, tol in group():
                ok = err <= tol
                bad += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})", flush=True)
        except Exception as e:  # noqa: BLE001 - reported as a failed case, the other group still runs
            bad += 1
            print(f"FAIL {group.__name__} raised {type(e).__name__}: {e}", flush=True)
    print(f"{bad} case(s) off tolerance")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
