"""What the CUDA graphs of an adjoint LM step hold: the graphs' pool after each of the first steps (per-program
graphs at the first call, the loss's chunk loop captured at the second), and the bytes of the graphs' own inputs
and outputs (the rest of the pool is their intermediates).

    python benchmarks/graph_pool.py [V] [T] [--first-plain]

``--first-plain``: a length's first call runs the loss chunks' programs without graphs of their own
(``loss_tail.FIRST_CALL_GRAPHS = False``), so the only graph of the loss is its chunk loop.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import torch.nn as nn
import torch.nn.functional as F

from adjoint_compile.measure import graph_pool_bytes
from adjoint_compile.models.selective_ssm import SSMStack
from adjoint_compile.runtime import graphed, loss_tail

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
V = int(ARGS[0]) if ARGS else 32000
T = int(ARGS[1]) if len(ARGS) > 1 else 16384
loss_tail.FIRST_CALL_GRAPHS = "--first-plain" not in sys.argv[1:]
dev = torch.device("cuda")
torch.manual_seed(0)
emb, stack, head = nn.Embedding(V, 64).to(dev), SSMStack(64, 8, 2).to(dev), nn.Linear(64, V, bias=False).to(dev)


def step(ids):
    return F.cross_entropy(head(stack(emb(ids[:, :-1]))).flatten(0, 1), ids[:, 1:].flatten())


def nbytes(xs):
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(xs) if isinstance(t, torch.Tensor))


def own(call):
    if not isinstance(call, graphed.GraphedCall):
        return 0
    return nbytes([s for s, al in zip(call.static_in, call.aliased) if not al]) + nbytes(call.static_out)


fn = torch.compile(step, backend="adjoint")
ids = torch.randint(0, V, (1, T + 1), device=dev)
MiB = 2**20
for k in range(3):
    fn(ids).backward()
    torch.cuda.synchronize()
    progs = sum(own(c) for _, c in graphed._GRAPHED.values())
    loops = sum(own(e[0]) for e in loss_tail._LOOPS.values())
    print(f"V={V} T={T} after step {k + 1}: graphs' pool {graph_pool_bytes(dev) / MiB:.0f} MiB; "
          f"{len(graphed._GRAPHED)} program graphs, their inputs and outputs {progs / MiB:.1f} MiB; "
          f"{len(loss_tail._LOOPS)} chunk loops, theirs {loops / MiB:.1f} MiB; allocated outside "
          f"{torch.cuda.memory_allocated() / MiB:.0f} MiB", flush=True)
