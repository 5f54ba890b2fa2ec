"""Assemble the halo run (adjoint peaks at T=8192, 65536, each in its own process) with compile's peaks at T=8192
from benchmarks/results/real_models_long (an earlier run on the same machine: compile's peak does not depend on load)."""
import json, re, sys
from pathlib import Path
root = Path(__file__).resolve().parents[3]
log = open(str(root / "benchmarks/results/halo/adjoint.log")).read() + open(str(root / "benchmarks/results/halo/rerun.log")).read()  # re-runs at low load win
old = json.load(open(root / "benchmarks/results/real_models_long/real_models_cpu.json"))["results"]
res, loads = {}, {}
for m in re.finditer(r"^RESULT (\S+) (\d+) (.*)$", log, re.M):
    res.setdefault(m[1], {})[m[2]] = json.loads(m[3])  # NB: a later line replaces an earlier one
for m in re.finditer(r"^END (\S+) (\d+) wall (\d+) s load: (.*)$", log, re.M):
    res.setdefault(m[1], {}).setdefault(m[2], {}).update({"wall_s_total": int(m[3]), "load_after": m[4]})
for t, r in res.items():
    for T, x in r.items():
        if "peak_bytes" not in x and "error" not in x and x.get("wall_s_total", 0) >= 420:
            x["error"] = "timed out after 420 s"
for m in re.finditer(r"^START (\S+) (\d+) (\S+) load: (.*)$", log, re.M):
    res.setdefault(m[1], {}).setdefault(m[2], {}).update({"started": m[3], "load_before": m[4]})
names = {"hf-mamba": "transformers MambaModel (tiny)", "hf-mamba2": "transformers Mamba2Model (tiny)",
         "mambapy": "mambapy Mamba, pscan=True", "mambapy-loop": "mambapy Mamba, pscan=False",
         "mingru": "minGRU stack"}
mib = lambda b: f"{b / 2**20:.1f} MiB"
rows = ["| model | adjoint peak T=8192 | compile peak T=8192 (earlier run) | ratio | adjoint peak T=65536 | 65536 / 8192 | adjoint step s T=8192 / 65536 | load (1-min) |",
        "|---|---|---|---|---|---|---|---|"]
for t, name in names.items():
    r = res.get(t, {})
    a8, a64 = r.get("8192", {}), r.get("65536", {})
    c = old.get(t, {}).get("memory", {}).get("compile", {})
    cp = c.get("peak_bytes")
    f = lambda x: mib(x["peak_bytes"]) if "peak_bytes" in x else (x.get("error") or "not run")
    ratio = f"{a8['peak_bytes'] / cp:.3f}x" if "peak_bytes" in a8 and cp else "—"
    flat = f"{a64['peak_bytes'] / a8['peak_bytes']:.2f}x" if "peak_bytes" in a8 and "peak_bytes" in a64 else "—"
    st = " / ".join(f"{x['step_s']:.2f}" if "step_s" in x else "—" for x in (a8, a64))
    ld = " / ".join(x.get("load_before", "?").split()[0] for x in (a8, a64) if x)
    rows.append(f"| {name} | {f(a8)} | {mib(cp) if cp else c.get('error', '—')} | {ratio} | {f(a64)} | {flat} | {st} | {ld} |")
md = "\n".join(rows) + "\n"
out = root / "benchmarks/results/halo"
(out / "real_models_cpu.json").write_text(json.dumps({"meta": {"device": "2-core CPU (shared by 5 engineers)", "batch": 2,
    "method": "adjoint only, benchmarks/real_models.py --child TARGET memory T adjoint, one process each, timeout 420 s",
    "compile_from": "benchmarks/results/real_models_long/real_models_cpu.json (T=8192)"}, "adjoint": res}, indent=1))
(out / "real_models_cpu.md").write_text(md)
print(md)
