"""A selective SSM stack (Mamba-like, without the causal conv): the main example for the exact-adjoint backward.

The model ships inside the package (the demo trains it, also from an installed wheel): its code and the equations of
one layer are in ``adjoint_compile/models/selective_ssm.py``. This file is the example's entry point:

    python examples/selective_ssm.py             # prints adjoint_compile.explain(...) with shards of 256 steps
    adjoint-compile explain examples/selective_ssm.py:make --input "randn(2,2048,16)"
"""
from __future__ import annotations

import torch

import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SelectiveSSM, SSMStack, example_inputs, make

__all__ = ["SelectiveSSM", "SSMStack", "make", "example_inputs"]

if __name__ == "__main__":
    torch.manual_seed(0)
    # NB: left out, shard_size is chosen from T, the region's costs and the CPU threads: with one thread 649 steps at
    # T = 2048 (4 shards, activations <= 17.0 MiB -> ~5.4 MiB), twice that with two; shards of 256 steps keep less
    # and take longer (the memory knob: docs/options.md)
    print(ac.explain(make(), *example_inputs(), options={"shard_size": 256}))
