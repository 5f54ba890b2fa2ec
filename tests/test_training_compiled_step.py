"""A whole train step compiled (``loss.backward()`` and ``opt.step()`` inside ``torch.compile``): with this package
imported it hung for every backend (the backward compiles its graphs inside the compiled frame, where dynamo traced
the package's compile-start callback while holding the callbacks' lock), and with the adjoint backend dynamo
compiled the regions' backward, frame by frame. Run in a subprocess with a time limit: a hang fails the test instead
of stopping the suite. Oracle: the same steps run eagerly on a copy, parameters after each step."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent("""
    import copy, sys, torch, torch.nn as nn
    import adjoint_compile as ac
    torch.manual_seed(0); torch.set_default_dtype(torch.float64)
    backend = sys.argv[1]

    class Layer(nn.Module):
        def __init__(self, d=6):
            super().__init__()
            self.a, self.b, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        def forward(self, x):
            return x + self.o(ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x)))

    model = nn.Sequential(Layer(), Layer())
    eager = copy.deepcopy(model)
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    kw = {"options": {"shard_size": 4, "inner": "aot_eager"}} if backend == "adjoint" else {}

    @torch.compile(backend=backend, **kw)
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    import warnings
    said = warnings.catch_warnings(record=True)
    caught = said.__enter__()
    warnings.simplefilter("always")
    for i in range(2):
        x = torch.randn(2, 13, 6)
        got = step(x)
        want = eager(x).square().mean()
        want.backward(); opt_e.step(); opt_e.zero_grad()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    said.__exit__(None, None, None)
    # NB: dynamo traced the package's backward pre-hook ("does not know how to trace the builtin
    # _thread.get_ident"), and the small graph after loss.backward() was warned as "nothing recognized"
    noise = [str(w.message)[:200] for w in caught if "get_ident" in str(w.message) or "nothing recognized" in
             str(w.message) or "adjoint_compile" in str(w.filename) and "timing" in str(w.filename)]
    assert not noise, noise
    if backend == "adjoint":
        rep = ac.report(step)
        assert any(r.rewrite == "adjoint" for r in rep.regions), rep
        inside = [b for b in rep.graph_breaks if "adjoint_compile" in str(b)]
        assert not inside, inside  # NB: the regions' backward is not traced by dynamo
    print("OK")
""")


@pytest.mark.parametrize("backend", ["adjoint", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_a_compiled_train_step_runs_and_matches_eager(backend, tmp_path):
    script = tmp_path / "step.py"
    script.write_text(_SCRIPT)
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}  # NB: this checkout's package
        done = subprocess.run([sys.executable, str(script), backend], capture_output=True, text=True, timeout=300,
                              env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the compiled train step hung")
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
