"""backend="adjoint" must work in a fresh interpreter that never imports adjoint_compile."""
import subprocess
import sys
import textwrap


def test_backend_found_by_name_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        from torch._dynamo import list_backends
        assert "adjoint" in list_backends(), list_backends()
        f = torch.compile(lambda x: (x * 3).sum(), backend="adjoint", options={"inner": "eager"})
        x = torch.ones(4, requires_grad=True)
        f(x).backward()
        assert torch.equal(x.grad, torch.full((4,), 3.0)), x.grad
        print("ok", "adjoint_compile.backend" in sys.modules)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # the entry point loaded our module on demand
    assert r.stdout.split() == ["ok", "True"]


def test_torch_logs_shows_backend_decisions():
    code = textwrap.dedent(
        """
        import torch
        f = torch.compile(lambda x: x.sin() + 1, backend="adjoint", options={"inner": "eager"})
        f(torch.ones(3))
        """
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "+adjoint_compile"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "adjoint-compile: graph with" in r.stderr and "inner=eager mode=exact" in r.stderr, r.stderr
