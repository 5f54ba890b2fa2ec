"""DP-SGD's clipped step side by side (issue 14): time and peak memory of one step, and the per-example norms'
agreement with torch.func.vmap, on a small transformer-like model (embedding, attention, MLP, layer norm) and on the
demo SSM (examples/selective_ssm.py).

Methods, each one training step (forward, loss = Σ_n ‖out_n‖², backward) on a fresh copy of the model:

- ``eager``: plain autograd, no clipping;
- ``nonprivate``: ``torch.compile(backend="adjoint")`` without clipping (same inner compiler as ``ours``);
- ``ours``: ``torch.compile(backend="adjoint", options={"per_sample_clip": C})``: p.grad = Σ_n min(1, C/‖g_n‖) g_n;
- ``vmap``: ``torch.func.vmap(grad)`` per-example gradients, then the norms, the clip factors and the sum;
- ``opacus_ghost``: Opacus' ghost clipping (``GradSampleModuleFastGradientClipping``, two backwards), when opacus
  is installed (``pip install adjoint-compile[dp]``).

    python benchmarks/dp.py [--inner aot_eager] [--repeats 3]

Writes benchmarks/results/dp.json and dp.md.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import platform
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import adjoint_compile as ac  # noqa: E402
from adjoint_compile.measure import measure_steps, prepare_cpu_measurement  # noqa: E402

CLIP = 1.0
RESULT = "RESULT "


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.h, D // self.h).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))


class MHA(nn.Module):
    """nn.MultiheadAttention as users write it (no mask: Opacus' DPMultiheadAttention refuses a 2D one with
    batch_first)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mha: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = MHA(d, heads) if mha else Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.att(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 2, mha: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d, heads, mha) for _ in range(layers)))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, i):
        return self.head(self.lnf(self.blocks(self.emb(i))))


class GPT2Logits(nn.Module):
    """transformers' GPT-2 with a tiny random config (no download): Conv1D projections, tied head."""

    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=d, n_layer=layers, n_head=heads, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=1)
        self.lm = GPT2LMHeadModel(cfg)
        self.lm.config._attn_implementation = "sdpa"

    def forward(self, i):
        return self.lm(input_ids=i).logits


def per_example_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).flatten(1).sum(1)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return per_example_loss(out).sum()


class Criterion(nn.Module):
    """The same loss for Opacus, whose ghost clipping needs a criterion with ``reduction``."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "sum"

    def forward(self, out, _target):
        per = per_example_loss(out)
        return per if self.reduction == "none" else per.sum()


def builders(model: nn.Module, x: torch.Tensor, inner: str, norms: dict[str, torch.Tensor],
             with_opacus: bool) -> dict[str, Callable[[], tuple[Callable[[], None], nn.Module]]]:
    def plain(kind: str):
        def make():
            m = copy.deepcopy(model)
            run = m if kind == "eager" else torch.compile(m, backend="adjoint", options={"inner": inner})

            def step():
                for p in m.parameters():
                    p.grad = None
                loss_fn(run(x)).backward()
            return step, m
        return make

    def ours():
        m = copy.deepcopy(model)
        run = torch.compile(m, backend="adjoint", options={"per_sample_clip": CLIP, "inner": inner})

        def step():
            for p in m.parameters():
                p.grad = None
            loss_fn(run(x)).backward()
            norms["ours"] = ac.per_sample_grad_norms(run)
        return step, m

    def vmap():
        m = copy.deepcopy(model)
        names = [n for n, _ in m.named_parameters()]

        def one(params, xi):
            return loss_fn(torch.func.functional_call(m, params, (xi.unsqueeze(0),)))

        def step():
            params = {n: p.detach() for n, p in m.named_parameters()}
            per = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, x)
            nrm = torch.sqrt(sum(per[n].flatten(1).pow(2).sum(1) for n in names))
            c = (CLIP / nrm).clamp(max=1.0)
            for n, p in m.named_parameters():
                p.grad = torch.einsum("b,b...->...", c, per[n])
            norms["vmap"] = nrm
        return step, m

    def opacus_ghost():
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        from opacus.validators import ModuleValidator

        # NB: nn.MultiheadAttention becomes Opacus' DPMultiheadAttention (same weights): its supported form
        m = ModuleValidator.fix(copy.deepcopy(model))
        gm = GradSampleModuleFastGradientClipping(m, max_grad_norm=CLIP, loss_reduction="sum",
                                                  use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(m.parameters(), lr=0.0), noise_multiplier=0.0,
                                              max_grad_norm=CLIP, expected_batch_size=x.shape[0],
                                              loss_reduction="sum")
        crit = DPLossFastGradientClipping(gm, opt, Criterion(), loss_reduction="sum")

        def step():
            opt.zero_grad(set_to_none=True)
            crit(gm(x), None).backward()
            norms["opacus_ghost"] = gm.per_sample_gradient_norms.detach().clone()
        return step, m

    out = {"eager": plain("eager"), "nonprivate": plain("adjoint"), "ours": ours, "vmap": vmap}
    if with_opacus:
        out["opacus_ghost"] = opacus_ghost
    return out


def run_case(name: str, model: nn.Module, x: torch.Tensor, inner: str, repeats: int, with_opacus: bool) -> dict:
    norms: dict[str, torch.Tensor] = {}
    rows, errors, ok = [], {}, {}
    for method, build in builders(model, x, inner, norms, with_opacus).items():
        try:  # NB: a baseline that cannot run this model is reported, not fatal; measured together below
            step, _ = build()
            step()
            ok[method] = build
        except Exception as e:  # noqa: BLE001
            errors[method] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            traceback.print_exc(limit=3)
        torch._dynamo.reset()
    got = measure_steps(ok, "cpu", repeats=repeats)
    rows = [{"method": m, "peak_bytes": got[m]["peak_bytes"], "step_s": got[m]["step_s"]} for m in ok]
    ref = norms.get("vmap")
    for r in rows:
        n = norms.get(r["method"])
        r["norm_max_rel_err"] = (None if n is None or ref is None or r["method"] == "vmap"
                                 else float(((n - ref).abs() / ref).max()))
    base = {r["method"]: r for r in rows}
    for r in rows:
        for b in ("eager", "nonprivate"):
            if b in base:
                r[f"time/{b}"] = r["step_s"] / base[b]["step_s"]
                r[f"mem/{b}"] = r["peak_bytes"] / max(1, base[b]["peak_bytes"])
    return {"case": name, "shape": list(x.shape), "rows": rows, "errors": errors}


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; inner compiler {meta['inner']}; C = {CLIP}; median of {meta['repeats']} "
             "step(s); peak memory: growth of the process's peak RSS over one step.", ""]
    for res in results:
        lines += [f"**{res['case']}** (input {res['shape']})", "",
                  "| method | step ms | time / non-private | time / eager | peak MiB | mem / non-private | "
                  "norms vs vmap (max rel err) |", "|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            err = r["norm_max_rel_err"]
            lines.append(f"| {r['method']} | {r['step_s'] * 1e3:.1f} | {r.get('time/nonprivate', math.nan):.2f} | "
                         f"{r.get('time/eager', math.nan):.2f} | {r['peak_bytes'] / 2**20:.1f} | "
                         f"{r.get('mem/nonprivate', math.nan):.2f} | {'-' if err is None else f'{err:.1e}'} |")
        for m, e in res["errors"].items():
            lines.append(f"| {m} | failed: {e} | | | | | |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine, two threads contending made every small op "
                         "10-30x slower)")
    ap.add_argument("--case", type=int, default=None, help="run one case (index) in this process")
    ap.add_argument("--cases", default=None, help="comma-separated case indices to run (default: all)")
    args = ap.parse_args()
    prepare_cpu_measurement()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with_opacus = importlib.util.find_spec("opacus") is not None
    spec = importlib.util.spec_from_file_location("example_selective_ssm", ROOT / "examples" / "selective_ssm.py")
    ssm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ssm  # NB: Opacus' ModuleValidator.fix deep-copies by pickling: the class must import
    spec.loader.exec_module(ssm)
    cases = [("transformer (vocab 128, d 64, 4 heads, 2 blocks)", Transformer, lambda: torch.randint(0, 128, (16, 32))),
             ("transformer (vocab 256, d 128, 4 heads, 2 blocks)", lambda: Transformer(256, 128, 4, 2),
              lambda: torch.randint(0, 256, (32, 64))),
             ("transformer with nn.MultiheadAttention (vocab 128, d 64, 4 heads, 2 blocks)",
              lambda: Transformer(mha=True), lambda: torch.randint(0, 128, (16, 32))),
             ("transformers' GPT-2, tiny config (vocab 128, d 64, 4 heads, 2 layers)", GPT2Logits,
              lambda: torch.randint(0, 128, (16, 32))),
             ("selective SSM (d_model 16, d_state 4, 2 layers)", lambda: ssm.make(16, 4, 2),
              lambda: torch.randn(8, 128, 16)),
             # NB: long T: where the sharded region's memory saving shows (the region is sharded under per_sample_clip)
             ("selective SSM, long T (d_model 16, d_state 4, 2 layers)", lambda: ssm.make(16, 4, 2),
              lambda: torch.randn(8, 1024, 16))]
    if args.case is not None:
        name, make, inputs = cases[args.case]
        print(RESULT + json.dumps(run_case(name, make(), inputs(), args.inner, args.repeats, with_opacus)))
        return
    # NB: one process per case: CPU peak memory is only faithful before any step time was taken in the process
    # (adjoint_compile.measure)
    results = []
    pick = None if args.cases is None else {int(c) for c in args.cases.split(",")}
    for i, (name, _, _) in enumerate(cases):
        if pick is not None and i not in pick:
            continue
        print(f"== {name}", flush=True)
        out = subprocess.run([sys.executable, __file__, "--case", str(i), "--inner", args.inner, "--repeats",
                              str(args.repeats), "--threads", str(args.threads)], capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)), None)
        if line is None:
            raise RuntimeError(f"case {name} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[len(RESULT):]))
    meta = {"machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
            "inner": args.inner, "repeats": args.repeats, "clip": CLIP,
            "opacus": None if not with_opacus else __import__("opacus").__version__}
    out = ROOT / "benchmarks" / "results"
    (out / "dp.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    md = markdown(results, meta)
    (out / "dp.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
