"""Pieces of the shard programs (:mod:`.shard_program`) that the sweeps share: the default shard size, the
autocast settings a program runs under, and a causal conv's halo in a shard."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["MIN_SHARD_BYTES", "MIN_SHARD_BYTES_GPU", "SHARD_THREADS", "SERIAL_KERNEL_BYTES", "serial_kernels",
           "min_shard_bytes", "MIN_CHUNK_BYTES_GPU", "CHUNK_ROWS_GPU", "least_shard_steps", "min_chunk_bytes",
           "default_shard_size", "wanted_shard_size", "own_bytes", "autocast_state", "autocast_as", "autocast_off",
           "accumulate", "accumulated"]


#: the least activation bytes a shard recomputes on a CPU, per intra-op thread (up to :data:`SHARD_THREADS`; estimated,
#: see :func:`wanted_shard_size`): below it a shard's fixed cost (two compiled program calls and a few scan calls,
#: ~1.5 ms on 2 idle CPU cores) is a visible share of its work, which the threads divide. Measured on a 2-core CPU
#: with tiny configs of minGRU, transformers' Mamba and Mamba-2 at T = 8192: shards of ~4 MiB of estimated activations
#: cost 1.0-1.3x the step time of shards 4-8x as long; Mamba-2 at T = 4096 with two threads: 8, 16 and 32 MiB shards
#: step in 1.44x, 1.11x and 0.96x torch.compile's time (one thread: 1.07x, 0.89x, 0.83x).
MIN_SHARD_BYTES = 8 * 2**20

#: the most threads :data:`MIN_SHARD_BYTES` is multiplied by
SHARD_THREADS = 8

#: the same on a GPU, where a shard's fixed cost (Python, and launching its programs' kernels) is about the same as on
#: a CPU while its work runs ~100x faster: shards of 8 MiB left an LM step's time almost all overhead there
MIN_SHARD_BYTES_GPU = 64 * 2**20

#: the least activation bytes of a loss chunk on a GPU (:mod:`.loss_tail`). Its logits live within one program, and
#: the head's three matrix products over a chunk of few rows run far below the GPU's rate: on an H200 (V = 50257,
#: fp32), 167-row chunks spent 45 ms of GPU time where torch.compile's whole step took 33 ms
MIN_CHUNK_BYTES_GPU = 128 * 2**20

#: on a GPU a loss chunk's steps are a multiple of this (the row tile of its matrix products), when it has that many
CHUNK_ROWS_GPU = 64


def min_shard_bytes(device: torch.device | None) -> int:
    """The least activation bytes of one shard on ``device``: on a GPU :data:`MIN_SHARD_BYTES_GPU`, else
    :data:`MIN_SHARD_BYTES` times the intra-op threads (``torch.get_num_threads()``, at most :data:`SHARD_THREADS`)."""
    if _gpu(device):
        return MIN_SHARD_BYTES_GPU
    return MIN_SHARD_BYTES * max(1, min(torch.get_num_threads(), SHARD_THREADS))


#: below these bytes per kernel (a shard's activations over its program's ops), a shard program's CPU kernels run on
#: one thread: splitting kernels of a few KiB between threads costs more than it saves. Measured on the 2-core CPU,
#: transformers' Mamba-2 (tiny config, T = 4096, 127-step shards of ~40 KiB kernels), 2 threads: 0.184 s a step with
#: OpenMP kernels, 0.097 s with serial ones (compile: 0.065 s).
SERIAL_KERNEL_BYTES = 2**20


def serial_kernels(prog: Any, L: int, args: Sequence[Any]) -> bool:
    """Whether the L-step programs of ``prog`` (prepared) on ``args`` are compiled with serial CPU kernels
    (:data:`SERIAL_KERNEL_BYTES`)."""
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        return False
    ops = sum(1 for n in prog.region_gm.graph.nodes if n.op in ("call_function", "call_method"))
    return L * prog.step_bytes() < SERIAL_KERNEL_BYTES * max(1, ops)


def least_shard_steps(prog: Any, device: torch.device | None) -> int:
    """The steps per shard the prepared ``prog`` wants (:func:`wanted_shard_size`), before it is cut to T: a loss
    chunk (``prog.loss_chunks``) sized by :data:`MIN_CHUNK_BYTES_GPU` and a multiple of :data:`CHUNK_ROWS_GPU` on a
    GPU, anything else by :func:`min_shard_bytes`, or under ``per_sample_clip`` by the bytes of the parameters'
    per-example gradients if more."""
    if not prog.loss_chunks:
        # NB: per example, each shard makes and sums B copies of the parameters' gradients: a shard shorter than that
        # is all fixed cost (an LM at B = 2, V = 32000, T = 4096 on a CPU: 8.9 s a step in shards of 29 steps, 5.3 s
        # in shards of 128), and its peak is of that order anyway
        ps = getattr(prog, "per_sample", None)
        least = max(min_shard_bytes(device), ps.example_bytes if ps is not None else 0)
        return wanted_shard_size(prog.T, prog.boundary_bytes(), prog.step_bytes(), least)
    # NB: a chunk whose head runs fused (runtime/fused_loss.py) holds no logits; under per_sample_clip each chunk
    # makes and sums B copies of the head's gradient, as a shard does
    step = getattr(prog, "fused_step_bytes", None) or prog.step_bytes()
    ps = getattr(prog, "per_sample", None)
    S = wanted_shard_size(prog.T, prog.boundary_bytes(), step,
                          max(min_chunk_bytes(device), ps.example_bytes if ps is not None else 0))
    return S - S % CHUNK_ROWS_GPU if S >= CHUNK_ROWS_GPU and _gpu(device) else S


def _gpu(device: torch.device | None) -> bool:
    return device is not None and device.type not in ("cpu", "meta")


def min_chunk_bytes(device: torch.device | None) -> int:
    """The least activation bytes of a loss chunk on ``device``: on a GPU :data:`MIN_CHUNK_BYTES_GPU`, else
    :func:`min_shard_bytes`."""
    return MIN_CHUNK_BYTES_GPU if _gpu(device) else min_shard_bytes(device)


def default_shard_size(T: int, boundary_bytes: int = 0, step_bytes: int = 0, min_bytes: int | None = None) -> int:
    """Steps per shard when ``options.shard_size`` is None: :func:`wanted_shard_size`, at most T."""
    return min(wanted_shard_size(T, boundary_bytes, step_bytes, min_bytes), T)


def wanted_shard_size(T: int, boundary_bytes: int = 0, step_bytes: int = 0, min_bytes: int | None = None) -> int:
    """The default shard size before it is cut to T (a region of fewer steps runs as one shard of T):
    ``max(⌈√(T·c_b / c_a)⌉, ⌈m / c_a⌉)`` with m = ``min_bytes`` (default :data:`MIN_SHARD_BYTES`), ``⌈m / c_a⌉`` for
    a region with nothing to carry between shards (c_b = 0: a loss computed chunk by chunk), or ``⌈√T⌉`` when the
    activations are unknown (0).

    ``c_b`` (``boundary_bytes``) is what the sweep keeps per shard boundary (the scans' states and the conv halos),
    ``c_a`` (``step_bytes``) the region's activations per step (every step-carrying value it makes). A sweep keeps
    (T/S)·c_b of boundaries and recomputes S·c_a at a time, which is least at S = √(T·c_b / c_a); shards are made at
    least ``MIN_SHARD_BYTES / c_a`` steps long so that each has enough work to amortize its fixed cost, which in
    small models keeps S, and so the peak, the same over a wide range of T.
    """
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T={T!r}: expected a number of steps >= 1")
    least = MIN_SHARD_BYTES if min_bytes is None else min_bytes
    if step_bytes <= 0:
        return max(1, math.isqrt(T - 1) + 1) if T > 1 else 1
    if boundary_bytes <= 0:
        return max(1, -(-least // step_bytes))
    balance = math.isqrt(-(-T * boundary_bytes // step_bytes) - 1) + 1
    return max(1, balance, -(-least // step_bytes))


def accumulate(acc: dict[int, torch.Tensor], i: int, g: torch.Tensor) -> None:
    """Add a shard's gradient ``g`` of a step-free input (a parameter) to ``acc[i]``, kept in fp32 at least.

    NB: a half-precision model's parameter gradient summed over many shards in its own dtype loses a rounding per
    shard (bf16, T = 1024 in shards of 1: 0.11 relative error where eager autograd's one reduction gives 0.003)."""
    if i in acc:
        acc[i].add_(g)
    else:
        acc[i] = g.to(torch.promote_types(g.dtype, torch.float32), copy=True)


def accumulated(acc: dict[int, torch.Tensor], grads: list[Any], like: Sequence[Any]) -> None:
    """``grads[i]`` from ``acc[i]`` (:func:`accumulate`) in the dtype of ``like[i]``'s gradient."""
    for i, g in acc.items():
        grads[i] = g.to(like[i].dtype)


def h0_index(node: fx.Node) -> int | None:
    """The position of a linear_scan node's h0 argument."""
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = t.default
    names = [a.name for a in t._schema.arguments] if isinstance(t, torch._ops.OpOverload) else None
    return names.index("h0") if names and "h0" in names else 2


def shard_bounds(T: int, S: int, pow2_tail: bool = False) -> list[tuple[int, int]]:
    """The shards [s, e) of T steps in shards of S, left to right: the last one shorter, or (``pow2_tail``) the rest
    after the full shards cut into powers of two, largest first, so that every length needs few shard programs."""
    if not pow2_tail:
        return [(s, min(s + S, T)) for s in range(0, T, S)]
    out = [(s, s + S) for s in range(0, T - T % S, S)]
    s, rest = T - T % S, T % S
    while rest:
        L = 1 << (rest.bit_length() - 1)
        out.append((s, s + L))
        s, rest = s + L, rest - L
    return out


def arg_layout(args: Sequence[Any]) -> tuple:
    """Per argument of a shard program, (shape, dtype, strides) or None: part of the compiled programs' keys, as the
    programs are specialized to their examples' shapes and strides (an h0 broadcast against the state is not a
    carry's shape; a learned h0 expanded over the batch, stride 0, is not a carry's layout).

    NB: not the stride of a dim of size 1, which addresses nothing (the compiled programs' checks skip it too): a
    [1, L] shard of a [1, T] batch keeps T as its first stride, and would compile anew for every T."""
    return tuple((tuple(a.shape), a.dtype, tuple(st if n != 1 else 0 for n, st in zip(a.shape, a.stride())))
                 if isinstance(a, torch.Tensor) else None for a in args)


def zeros_exact(autocast: tuple) -> bool:
    """Whether zero tensors may stand for absent carries and adjoints (None) in shard programs run under the
    autocast settings ``autocast`` (:func:`autocast_state`): not under autocast, where a state's dtype is the
    autocast one rather than the one :meth:`~.shard_program.ShardProgram.prepare` saw."""
    return not any(enabled for _, enabled, _ in autocast)


def initial_zeros(prog: Any, inputs: Sequence[Any]) -> list[Any]:
    """The first shard's carries as tensors: per scan its h0 input or zeros of its state (what h0=None means), per
    causal conv zeros of its halo (its padding; a token shift's: its fill). One state's bytes each, made per sweep
    and not saved for the backward (which makes them again): the memory they cost is that of one shard boundary,
    transient."""
    dev = next(x.device for x, d in zip(inputs, prog.in_step_dims) if d is not None)
    K = len(prog.scans)
    # NB: an h0 contiguous like the carries the other shards get (a learned h0 expanded over the batch is a stride-0
    # view), so the first shard runs their program
    out: list[Any] = [torch.zeros(shp, dtype=dt, device=dev) if i is None else inputs[i].contiguous()
                      for i, shp, dt in zip(prog.h0_input, prog.carry_shapes, prog.carry_dtypes)]
    for cc, shp, dt in zip(prog.convs, prog.carry_shapes[K:], prog.carry_dtypes[K:]):
        out.append(torch.full(shp, cc.fill if cc.kind == "shift" else 0.0, dtype=dt, device=dev))
    return out


def zero_adjoints(prog: Any, device: torch.device) -> list[torch.Tensor]:
    """The adjoints of the last shard's final carries: zeros (nothing after the sequence reads them), as tensors so
    that the last shard runs the recompute + VJP program of the middle ones."""
    return [torch.zeros(shp, dtype=dt, device=device) for shp, dt in zip(prog.carry_shapes, prog.carry_dtypes)]


def without_steps(layout: tuple, step_dims: list) -> tuple:
    """Per-input ``(shape, dtype, ...)`` entries with the step dim's size replaced by -1 (other entries as they are)."""
    return tuple(((*(-1 if i == d else v for i, v in enumerate(x[0])),), *x[1:]) if d is not None else x
                 for x, d in zip(layout, step_dims))


def built_from(prog: Any) -> tuple:
    """What a length-free shard program is built from besides the literal length in the region graph's shapes (which
    each program rewrites to its own L): the graph's nodes and the step analysis, by node name. Two lengths of a
    region with the same key build the same program for each L, so one serves both (runtime/length_generic.py)."""
    info = prog.info

    def named(d: dict) -> str:
        return repr(sorted((k.name, repr(v)) for k, v in d.items()))
    nodes = tuple((n.name, n.op, str(n.target), info.step_dim.get(n)) for n in prog.region_gm.graph.nodes)
    return (nodes, named(info.shifts), named(info.sums), named(info.folds), repr(prog.convs), tuple(prog.scan_dims),
            tuple(prog.out_step_dims), tuple(prog.shift_scans))


def differentiable(x: object) -> bool:
    """Whether ``x`` can have a gradient: a floating or complex tensor (not a carry of token ids shifted right)."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def own_bytes(v: object) -> int:
    """Bytes a value allocates: 0 for a view (movedim, expand, a slice), which shares its base's memory."""
    if not isinstance(v, torch.Tensor) or v._is_view():
        return 0
    return v.numel() * v.element_size()


def _prev_or_first(prev: torch.Tensor | None, first: torch.Tensor, d: int) -> torch.Tensor:
    """The step before a shard's first one in a previous-state readout: the carried state, or ``first`` in the
    sequence's first shard (where the readout gives its own ``first``)."""
    # NB: in the dtype the readout's cat promotes to, not ``first``'s: a narrower fill (float32 zeros beside a float64
    # state) would round the carried state at every shard boundary, where eager's cat keeps it
    return first if prev is None else prev.unsqueeze(d).to(torch.promote_types(first.dtype, prev.dtype))


def _with_halo(halo: torch.Tensor | None, x: torch.Tensor, p: int, d: int, fill: float = 0.0) -> torch.Tensor:
    """A causal conv's (or token shift's) shard input with the p steps before it: the carried halo, or ``fill``
    (zeros: the conv's padding) in the sequence's first shard."""
    if halo is None:
        shp = list(x.shape)
        shp[d] = p
        halo = x.new_full(shp, fill)
    return torch.cat([halo.to(x.dtype), x], d)


def _shifted(xp: torch.Tensor, p: int, d: int) -> torch.Tensor:
    """A token shift of a shard from its padded input ``cat(halo, x)``: its first L steps (out_t = x_{t-p})."""
    return xp.narrow(d, 0, xp.shape[d] - p)


def _halo_out(xp: torch.Tensor, p: int, d: int) -> torch.Tensor:
    """The halo the next shard reads: the last p steps of this shard's padded conv input.

    NB: a copy, not a view: a view would keep the whole padded shard alive in the saved boundary carries."""
    return xp.narrow(d, xp.shape[d] - p, p).contiguous()


_AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types whose autocast settings a shard program depends on


def autocast_state() -> tuple:
    """The autocast settings in effect, per device type: (device type, enabled, dtype).

    A shard program traced or compiled under autocast has its casts baked in, so the settings are part of the
    caches' keys; and a shard's recomputation in the backward runs under the forward's settings
    (:func:`autocast_as`), as ``torch.utils.checkpoint`` does, so that the VJP is that of the forward that ran.
    """
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def autocast_off() -> contextlib.AbstractContextManager:
    """No autocast: for tracing and running a joint program whose casts were traced in (a VJP's recomputation under
    the forward's settings); the autocast a backward runs under would cast its ops a second time."""
    return autocast_as(tuple((d, False, dt) for d, _, dt in autocast_state()))


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Run under the autocast settings ``state`` (from :func:`autocast_state`)."""
    with contextlib.ExitStack() as stack:
        for (device, enabled, dtype), (_, now, now_dtype) in zip(state, autocast_state()):
            if (enabled, dtype) != (now, now_dtype):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
