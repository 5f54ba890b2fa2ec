"""A small ReLU ResNet (MLP blocks): x <- ReLU(x + W2 ReLU(W1 x)) (Highway-BP Table 1, "ReLU(x + z)"): K_i is the
diagonal ReLU mask.

    python examples/relu_resnet.py               # prints adjoint_compile.explain(...)
"""
from __future__ import annotations

import torch
import torch.nn as nn


class ResBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.fc2(torch.relu(self.fc1(x))))


class ReLUResNet(nn.Module):
    """x [B, d_in] -> logits [B, n_classes]."""

    def __init__(self, d_in: int = 16, width: int = 32, n_layers: int = 6, n_classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(ResBlock(width) for _ in range(n_layers))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def make(d_in: int = 16, width: int = 32, n_layers: int = 6, n_classes: int = 10) -> ReLUResNet:
    return ReLUResNet(d_in, width, n_layers, n_classes)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(8, 16),)


if __name__ == "__main__":
    from adjoint_compile.models import print_explain

    print_explain(make, example_inputs)
