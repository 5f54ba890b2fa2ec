"""A user's first lines are the package's: none of the lines torch, its profiler, dynamo under DDP or setuptools print
about things the user did not do (issue 36). Each case runs in a fresh interpreter (the lines come once per
process), most with a control that shows the line does appear where our code is not in the way."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with a clean environment (no PYTHONPATH, TORCH_LOGS, PYTHONWARNINGS, ...)."""
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "ADJOINT_COMPILE_CACHE_DIR", "XDG_CACHE_HOME"}
    clean = {k: v for k, v in os.environ.items() if k in keep}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       env={**clean, **(env or {})}, cwd=cwd or ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def test_importing_the_package_prints_nothing():
    p = _python("import adjoint_compile")
    assert (p.stdout, p.stderr) == ("", "")


#: torch's own import-time warning without numpy. It comes from `import torch` itself, before any line of ours runs,
#: so only a filter around the package's first `import torch` (the top of adjoint_compile/__init__.py, which this
#: change does not own) can keep it out of `adjoint-compile explain` and `import adjoint_compile`; the demo never
#: meets it (matplotlib needs numpy). numpy is not made a dependency: the wheel pulls torch and networkx only.
NO_NUMPY = "import sys; sys.modules['numpy'] = None\n"


def test_importing_the_package_without_numpy_does_not_warn_about_numpy():
    control = _python(NO_NUMPY + "import torch")
    assert "Failed to initialize NumPy" in control.stderr
    p = _python(NO_NUMPY + "import adjoint_compile")
    assert "Failed to initialize NumPy" not in p.stderr, p.stderr


#: a CUDA build of torch without a GPU, on a machine with a CUDA toolkit: what torch.utils.cpp_extension sees
CUDA_TORCH_WITHOUT_GPU = """
import torch
torch.cuda._is_compiled = lambda: True
torch.cuda.is_available = lambda: False
torch.version.cuda = "12.8"
import torch.utils.cpp_extension as ext
assert ext.CUDA_HOME, ext.CUDA_HOME
"""


@pytest.mark.slow
def test_no_cuda_runtime_line_when_inductor_first_builds_cpu_code(tmp_path):
    env = {"CUDA_HOME": str(tmp_path)}
    # NB: dynamo first in both: importing it with the patched torch.cuda fails (it imports CUDA stream functions)
    control = _python("import torch._dynamo\n" + CUDA_TORCH_WITHOUT_GPU, env)
    assert "No CUDA runtime is found" in control.stderr
    p = _python("import adjoint_compile\n" + CUDA_TORCH_WITHOUT_GPU, env)
    assert "No CUDA runtime is found" not in p.stderr, p.stderr


MEASURE_A_STEP = """
import sys, torch
x = torch.randn(100_000)                  # made before the block and freed inside it: the allocator logs this
{block}
    y = torch.randn(1000)
    del x
    print("ours", file=sys.stderr, flush=True)
"""


@pytest.mark.slow
def test_measuring_cpu_memory_does_not_print_the_profilers_lines():
    profiler = ("from torch.profiler import ProfilerActivity, profile\n"
                "with profile(activities=[ProfilerActivity.CPU], profile_memory=True):")
    control = _python(MEASURE_A_STEP.format(block=profiler))
    assert "Memory block of unknown size" in control.stderr and "profiler_start" in control.stderr
    p = _python(MEASURE_A_STEP.format(block="from adjoint_compile.measure import track_peak\n"
                                            "with track_peak('cpu') as m:"))
    assert p.stderr == "ours\n"           # the block's own stderr passes, in its place


DDP = """
import os, sys, tempfile, torch, torch.distributed as dist
import adjoint_compile
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        if {own}:
            with torch.autograd.profiler.record_function("the user's own range"):
                return self.lin(x)
        return self.lin(x)

model = Model()
f = torch.compile(DDP(model) if {ddp} else model, backend="adjoint", options={{"inner": "eager"}})
f(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_compiling_a_ddp_model_does_not_warn_about_ddps_record_function():
    p = _python(DDP.format(own=False, ddp=True))
    assert "Profiler record function" not in p.stderr, p.stderr
    # a record_function the user wrote still gets dynamo's warning
    mine = _python(DDP.format(own=True, ddp=False))
    assert "Profiler record function" in mine.stderr, mine.stderr


def test_installing_in_editable_mode_prints_no_setuptools_warning_block(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    # the build configuration and a stub package: setuptools' choice of editable strategy (and its "!!" block)
    # depends on the layout, not on the code
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for name in ("README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "adjoint_compile").mkdir()
    (tmp_path / "adjoint_compile" / "__init__.py").write_text("")
    p = _python(f"from setuptools import build_meta as b; b.build_editable({str(tmp_path / 'dist')!r}); "
                f"b.build_wheel({str(tmp_path / 'dist')!r})", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert "!!" not in out and "Deprecat" not in out, out[-3000:]
