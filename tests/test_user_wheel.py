"""The package as a user installs it: a wheel built from this tree, installed into a clean virtual environment
with torch alone, must pull only networkx besides torch, ship the demo model and the license, run
``adjoint-compile demo --steps 2`` (at a small T) (with the ``demo`` extra) and be found by ``torch.compile(backend="adjoint")``
by name, without importing Triton."""
from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKEND_BY_NAME = """
import sys, torch
def f(x, w):
    h = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h = torch.sigmoid(w) * h + x[:, t]
    return h
x, w = torch.randn(2, 9, 3, requires_grad=True), torch.randn(3, requires_grad=True)
assert "adjoint" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
out = torch.compile(f, backend="adjoint", options={"inner": "eager"})(x, w)
out.sum().backward()
g = x.grad.clone(); x.grad = None
f(x, w).sum().backward()
assert torch.allclose(g, x.grad, atol=1e-6)
import adjoint_compile as ac
assert "triton" not in sys.modules
print("backend ok", ac.__file__)
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_the_wheel_installs_light_and_runs_the_demo_and_the_backend(tmp_path):
    import torch

    dist = tmp_path / "dist"
    # NB: no build isolation: the setuptools this environment has (>= 77, from the dev install) builds it offline
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)])
    (wheel,) = dist.glob("adjoint_compile-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "adjoint_compile/models/selective_ssm.py" in names and "adjoint_compile/demo.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    plain = sorted(r.split(">")[0].split("=")[0].split(";")[0].strip() for r in requires if "extra ==" not in r)
    assert plain == ["networkx", "torch"], requires
    assert "License-Expression: Apache-2.0" in meta

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # NB: torch first, pinned to the version running this test (a bare requirement could pull CUDA wheels)
    version = torch.__version__.split("+")[0]
    _run([str(py), "-m", "pip", "install", "-q", f"torch=={version}"])
    _run([str(py), "-m", "pip", "install", "-q", f"{wheel}[demo]"])
    installed = _run([str(py), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "triton" not in installed and "adjoint-compile" in installed.replace("_", "-")

    work = tmp_path / "user"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    ok = _run([str(py), "-c", BACKEND_BY_NAME], cwd=work, env=env)
    assert "backend ok" in ok.stdout and str(env_dir) in ok.stdout  # the installed copy, not this checkout
    # NB: small sizes: the demo's cost here is compiling its four methods, which does not shrink with T
    demo = _run([str(env_dir / "bin" / "adjoint-compile"), "demo", "--steps", "2", "--seq-len", "128", "--batch", "2"],
                cwd=work, env=env)
    assert "loss: first" in demo.stdout and (work / "out" / "demo.json").is_file() and (work / "out" / "demo.png").is_file()
