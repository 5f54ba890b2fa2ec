"""Where an adjoint LM step spends its time on CUDA: torch.profiler tables of one step at a first length (its graph
specialized to it) and at a second one (the graph that serves every later length).

    python benchmarks/gpu_profile.py [V] [T1] [T2] [--graphs]
"""
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, ".")
import adjoint_compile as ac
from adjoint_compile.models.selective_ssm import SSMStack
from torch.profiler import profile, ProfilerActivity
GRAPHS = "--graphs" in sys.argv[1:]
ARGS = [a for a in sys.argv[1:] if a != "--graphs"]
V = int(ARGS[0]) if ARGS else 50257
TS = [int(x) for x in ARGS[1:]] or [2048, 4096]
torch.manual_seed(0)
dev = torch.device("cuda")
emb, stack, head = nn.Embedding(V, 64).to(dev), SSMStack(64, 8, 2).to(dev), nn.Linear(64, V, bias=False).to(dev)
def step(ids):
    return F.cross_entropy(head(stack(emb(ids[:, :-1]))).flatten(0, 1), ids[:, 1:].flatten())
fn = torch.compile(step, backend="adjoint", options={"cuda_graphs": GRAPHS})
for T in TS:
    ids = torch.randint(0, V, (1, T + 1), device=dev)
    fn(ids).backward(); fn(ids).backward(); torch.cuda.synchronize()
    t = time.perf_counter(); fn(ids).backward(); torch.cuda.synchronize(); print(f"T={T} step {time.perf_counter()-t:.4f}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(ids).backward(); torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))
print(ac.report(fn))
