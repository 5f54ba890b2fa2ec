"""Measuring tools shared by the demo and the benchmarks (DESIGN.md §7).

Peak memory (:func:`track_peak`) counts the bytes of live tensors, on every device the same way: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the profiler's memory events (``profile_memory=True``): every allocation
and free of c10's CPU allocator inside the block, the buffers of inductor-compiled code and of this package's
runtime included, summed in time order; the peak is the largest running sum: the most bytes allocated inside the
block and live at once. (Tensors allocated before the block are not counted, nor are their frees: allocations and
frees are paired by address.)

NB: not a TorchDispatchMode (like ``torch.distributed._tools.mem_tracker``): while one is active, dynamo runs a
compiled model eagerly, so "torch.compile" would silently be measured as eager autograd. The profiler does not
change what dynamo compiles.

``track_peak(..., count="rss")`` measures the growth of the process's peak resident memory instead (the
high-water mark reset through ``/proc/self/clear_refs``, read from ``VmHWM``): it also sees memory that is not a
tensor, but glibc keeps freed blocks resident, so it reads low once the heap holds them (a second training step
at T = 65536 read 0 MiB). For it, :func:`prepare_cpu_measurement` pins glibc's mmap threshold at 64 KiB and its
trim threshold at 0 (every freed tensor goes back to the OS at once) and :func:`start_timing` sets them high again
for step times (32 MiB mmap, 64 MiB trim: about where glibc's own dynamic thresholds settle in a training loop).
NB: pinned low, every allocation over 64 KiB is a fresh mmap that page-faults on first touch, which slowed the
sharded backward ~2x more than plain compile, so :func:`measure_steps` measures every method's memory first and
every step time after, and the RSS count refuses to run once timing has begun.

Time: the median of repeats after a warm-up, with ``torch.cuda.synchronize`` on GPUs.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def graph_pool_bytes(device: torch.device | str) -> int:
    """The bytes CUDA graphs' private memory pools hold on ``device`` (their segments, used or free for the next
    replay): a replayed graph's memory, reserved, not allocated, between replays."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    index = torch.cuda.current_device() if device.index is None else device.index
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


@contextmanager
def track_peak(device: torch.device | str, count: str = "tensors") -> Iterator[dict[str, int]]:
    """``with track_peak(dev) as m: ...`` then ``m["peak"]`` is the peak bytes allocated inside the block.

    ``count``: "tensors" (live tensor bytes; module docstring) or, on CPU, "rss" (resident memory growth).
    On CUDA ``m["graph_pool"]`` is :func:`graph_pool_bytes` after the block: memory that CUDA graphs hold between
    replays, which ``max_memory_allocated`` does not count.
    """
    device = torch.device(device)
    if count not in ("tensors", "rss"):
        raise ValueError(f"count={count!r}: expected 'tensors' or 'rss'")
    result = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - base
        result["graph_pool"] = graph_pool_bytes(device)
    elif count == "tensors":
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        # NB: c10's CPU allocator logs "Memory block of unknown size was allocated before the profiling started"
        # to fd 2 when the block frees a tensor made before it (the last step's gradients: always), and kineto
        # prints "profiler_start/stop" lines: those lines are dropped, anything else on fd 2 is passed on
        with _stderr_without(_PROFILER_NOISE):
            prof.start()
            try:
                yield result
            finally:
                prof.stop()
        result["peak"] = _peak_of_memory_events(prof)
    elif _rss_available():
        if _TIMING:
            raise RuntimeError("peak CPU memory cannot be measured after step times were taken in this process "
                               "(malloc is then set up for speed; see adjoint_compile.measure): measure memory first")
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _proc_status("VmRSS:")
        yield result
        result["peak"] = max(0, _proc_status("VmHWM:") - base)
    else:
        raise RuntimeError(
            "peak resident memory needs Linux's /proc/self/clear_refs and glibc (see adjoint_compile.measure); "
            "use track_peak(..., count='tensors') instead"
        )


#: fd 2 lines of the profiler and of c10's allocator under it that say nothing about the measured code
_PROFILER_NOISE = ("Memory block of unknown size was allocated before the profiling started",
                   "] profiler_start", "] profiler_stop")


@contextmanager
def _stderr_without(drop: Sequence[str]) -> Iterator[None]:
    """Inside the block, file descriptor 2 (C++ logging, and Python's stderr) goes to a temporary file; at its end
    the lines that contain none of ``drop`` are written to the real fd 2, in their order."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True)
                    if not any(d.encode() in ln for d in drop)]
            if kept:
                os.write(2, b"".join(kept))


def _peak_of_memory_events(prof: Any) -> int:
    """The largest running sum of the CPU allocations made in the profiled block (+ size) and of their frees (- size)
    in time order. NB: paired by address: a free of memory allocated before the block is left out, even when the
    allocator reports a size for it (its size table keeps entries from earlier profiled blocks)."""
    from torch._C._profiler import _EventType

    def walk(events: Any) -> Iterator[Any]:
        for e in events:
            yield e
            yield from walk(e.children)

    allocs = sorted((e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
                    key=lambda e: e.start_time_ns)
    live: dict[int, int] = {}
    cur = peak = 0
    for e in allocs:
        ptr, size = e.extra_fields.ptr, e.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
            cur += size
            peak = max(peak, cur)
        elif ptr in live:
            cur -= live.pop(ptr)
    return peak


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


_RSS_OK: bool | None = None
_LIBC: Any = None
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def prepare_cpu_measurement() -> bool:
    """Pin malloc's thresholds for memory measurement now; returns whether CPU memory can be measured here (Linux,
    glibc). Call it at program start: blocks freed before the pinning stay in malloc's heap and are reused."""
    return _rss_available()


_TIMING = False


def start_timing() -> None:
    """Set malloc up for timing (see the module docstring); CPU memory can no longer be measured afterwards."""
    global _TIMING
    if _rss_available() and not _TIMING:
        _LIBC.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        _LIBC.mallopt(M_TRIM_THRESHOLD, 64 * 2**20)
    _TIMING = True


def _rss_available() -> bool:
    """Linux with glibc: pin malloc's mmap threshold once so that freed tensors are unmapped immediately."""
    global _RSS_OK, _LIBC
    if _RSS_OK is None:
        _RSS_OK = False
        if os.path.exists("/proc/self/clear_refs"):
            try:
                _LIBC = ctypes.CDLL("libc.so.6")
                _RSS_OK = bool(_LIBC.mallopt(M_MMAP_THRESHOLD, 64 * 1024)) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, 0))
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except (OSError, AttributeError):
                _RSS_OK = False
    return _RSS_OK


def median_time(fn: Callable[[], Any], device: torch.device | str, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds (on CPU after :func:`start_timing`)."""
    device = torch.device(device)
    if device.type == "cpu":
        start_timing()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Checkpointed(torch.nn.Module):
    """Runs ``module`` under ``torch.utils.checkpoint`` (non-reentrant): per-layer activation checkpointing."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.module, *args, use_reentrant=False)


def checkpoint_layers(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose every ``layers`` ModuleList entry is checkpointed on its own."""
    model = copy.deepcopy(model)
    found = False
    for mod in model.modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            for i, layer in enumerate(layers):
                layers[i] = Checkpointed(layer)
            found = True
    if not found:
        raise ValueError("checkpoint_layers: the model has no `layers` ModuleList to checkpoint")
    return model


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        # torch.compile and Checkpointed wrap names; the parameter is the same.
        clean = name.replace("_orig_mod.", "").replace(".module.", ".")
        out[clean] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return out


def max_rel_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over parameters of ||got - ref||_inf / max(||ref||_inf, tiny)."""
    if got.keys() != ref.keys():
        raise ValueError(f"gradient names differ: {sorted(set(got) ^ set(ref))}")
    worst = 0.0
    for k in ref:
        denom = ref[k].abs().max().item() or 1e-30
        worst = max(worst, (got[k].float() - ref[k].float()).abs().max().item() / denom)
    return worst


def format_table(rows: list[dict[str, Any]], relative_to: Sequence[str] = ("eager", "compile")) -> str:
    """Rows of {method, peak_bytes, step_s, max_grad_rel_err, ...} as an aligned text table, with each row's memory
    and time as ratios to each method named in ``relative_to`` that is among the rows (columns ``mem/<method>`` and
    ``time/<method>``; the first row when none is)."""
    if not rows:
        return "(no rows)"
    by_name = {r["method"]: r for r in rows}
    bases = [by_name[m] for m in relative_to if m in by_name] or [rows[0]]
    # NB: a zero baseline would make every ratio meaningless; guard it
    mem_b = [(b["method"], b["peak_bytes"] or 1) for b in bases]
    time_b = [(b["method"], b["step_s"] or 1e-12) for b in bases]
    header = ["method", "peak MiB", *(f"mem/{m}" for m, _ in mem_b), "step s", *(f"time/{m}" for m, _ in time_b),
              "max grad rel err"]
    lines = [header]
    for r in rows:
        err = r.get("max_grad_rel_err")
        lines.append([r["method"], f"{r['peak_bytes'] / 2**20:.1f}",
                      *(f"{r['peak_bytes'] / b:.3f}" for _, b in mem_b), f"{r['step_s']:.3f}", *(f"{r['step_s'] / b:.2f}" for _, b in time_b),
                      "-" if err is None else f"{err:.2e}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in lines)


def compare_training_step(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    device: torch.device | str,
    adjoint_options: dict[str, Any] | None = None,
    repeats: int = 3,
    methods: tuple[str, ...] = ("eager", "compile", "checkpoint", "adjoint"),
) -> list[dict[str, Any]]:
    """One training step (forward, loss, backward) of copies of ``model``, measured each way, side by side.

    Methods: "eager" autograd (the reference for gradients), "compile" (torch.compile, inductor), "checkpoint"
    (per-layer activation checkpointing, eager), "adjoint" (torch.compile(backend="adjoint")). Each row has the
    peak bytes of one step, the median step time, and the largest relative gradient difference to "eager".
    """
    def build(method: str) -> Callable[[], tuple[Callable[[], None], torch.nn.Module]]:
        def make() -> tuple[Callable[[], None], torch.nn.Module]:
            m = copy.deepcopy(model).to(device)
            if method == "eager":
                run = m
            elif method == "compile":
                run = torch.compile(m)
            elif method == "checkpoint":
                m = checkpoint_layers(m)
                run = m
            elif method == "adjoint":
                run = torch.compile(m, backend="adjoint", options=dict(adjoint_options or {}))
            else:
                raise ValueError(f"unknown method {method!r}; expected eager, compile, checkpoint or adjoint")

            def step() -> None:
                for p in m.parameters():
                    p.grad = None
                loss_fn(run(*inputs)).backward()

            return step, m
        return make

    got = measure_steps({method: build(method) for method in methods}, device, repeats)
    rows: list[dict[str, Any]] = []
    for method in methods:
        r = got[method]
        rows.append({"method": method, "device": str(torch.device(device)), "peak_bytes": r["peak_bytes"],
                     "step_s": r["step_s"],
                     "max_grad_rel_err": None if method == methods[0]
                     else max_rel_error(r["grads"], got[methods[0]]["grads"])})
    return rows


def measure_steps(
    builders: dict[Any, Callable[[], tuple[Callable[[], None], torch.nn.Module]]],
    device: torch.device | str,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[Any, dict[str, Any]]:
    """Peak memory, gradients and median step time of several training steps, measured fairly.

    ``builders[key]()`` makes a fresh ``(step, model)``: ``step()`` runs one training step (it zeroes ``model``'s
    grads itself). Phase 1 runs every builder's step once to warm up (compiling), keeps the model's gradients and
    measures one more step's peak memory; phase 2 builds each again (compile caches make this quick) and times it.
    Memory comes first because CPU peaks are only faithful before timing (module docstring). Returns
    ``{key: {"peak_bytes", "step_s", "grads"}}``.
    """
    device = torch.device(device)
    say = progress or (lambda msg: None)
    out: dict[Any, dict[str, Any]] = {}
    for key, build in builders.items():
        say(f"memory: {key}")
        step, model = build()
        step()
        grads = grads_of(model)
        with track_peak(device) as mem:
            step()
        out[key] = {"peak_bytes": mem["peak"], "grads": grads}
        del step, model
        torch._dynamo.reset()
    for key, build in builders.items():
        say(f"time: {key}")
        step, model = build()
        out[key]["step_s"] = median_time(step, device, repeats=repeats, warmup=1)
        del step, model
        torch._dynamo.reset()
    return out
