"""Shard programs of small kernels are compiled with serial CPU kernels (runtime/shard_parts.serial_kernels): OpenMP
splits kernels of a few KiB between threads at a cost larger than their work. The decision, and that the inner
compiler really compiles them with one thread; results stay exact (the other shard tests run this path too)."""
from __future__ import annotations

import pytest
import torch

import adjoint_compile as ac
from adjoint_compile import inner
from adjoint_compile.runtime import shard_parts


class Scan(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + ac.ops.linear_scan(torch.sigmoid(self.a(x)), self.b(x), dim=1)).pow(2).sum()


@pytest.mark.parametrize("kernel_bytes, serial", [(2**20, True), (0, False)])
def test_small_shard_programs_compile_serial_kernels(monkeypatch, kernel_bytes, serial):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(shard_parts, "SERIAL_KERNEL_BYTES", kernel_bytes)
    seen = []
    real = inner._compile

    def spy(gm, example, which):
        seen.append(inductor_config.cpp.threads)
        return real(gm, example, which)
    monkeypatch.setattr(inner, "_compile", spy)
    torch.manual_seed(0)
    model = Scan()
    ref = Scan()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 37, 8)
    torch._dynamo.reset()
    f = torch.compile(model, backend="adjoint", options={"shard_size": 8})
    f(x).backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    # the partitions (whole-graph parts) keep inductor's default; the shard programs follow the decision
    assert seen and (1 in seen) == serial, seen
