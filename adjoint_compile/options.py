"""The one place for adjoint-compile's options (DESIGN.md §1).

``torch.compile(model, backend="adjoint", options={...})`` and ``adjoint_compile.explain(..., options={...})``
both pass their dict through :func:`validate`, which returns a frozen :class:`Options` or raises
:class:`OptionsError` (a ``ValueError``) naming the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .errors import OptionsError

MODES = ("exact", "truncated", "highway")
INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options. Field docs mirror DESIGN.md §1's table."""

    #: "exact" (adjoint sharding, same gradients as autograd), "truncated" or "highway".
    mode: str = "exact"
    #: truncated mode: adjoint window T̄ = W in steps (>= 1): each scan's gradient is that of h_t recomputed from
    #: h_{t-W} detached (runtime/truncated.py); W >= T is exact.
    window: int | None = None
    #: highway mode: number of Highway-BP iterations k (>= 0); k >= chain length is exact.
    iterations: int | None = None
    #: steps per VJP shard (>= 1); None lets the backend choose from the sizes.
    shard_size: int | None = None
    #: a torch.distributed process group, True for WORLD, or None (off): each rank runs its own contiguous slice of
    #: the sequence (runtime/seqpar.py).
    sequence_parallel: Any = None
    #: with sequence_parallel: sum the parameters' gradients over the group in the backward, as DDP does (False:
    #: the user reduces them, e.g. together with a data-parallel reduction).
    reduce_grads: bool = True
    #: compiler for everything that is not rewritten.
    inner: str = "inductor"
    #: compare the rewritten gradients with autograd on the first call and log the error.
    verify: bool = False
    #: on a rewritten graph's first call, compare its outputs with those of the graph as captured (one extra eager
    #: forward without autograd); on a difference warn and run that graph with the inner compiler instead.
    check_forward: bool = True
    #: highway mode: stop iterating once an update's relative norm is below it (None: exactly k iterations).
    tolerance: float | None = None
    #: DP-SGD clipping bound C > 0 (``inf``: norms only): every p.grad gets Σ_n min(1, C/‖g_n‖) g_n, with g_n example
    #: n's gradient over all parameters (runtime/per_sample.py); None: off.
    per_sample_clip: float | None = None
    #: the example axis of the inputs (and of every activation a parameter meets), for ``per_sample_clip``.
    batch_dim: int = 0
    #: on CUDA with inner="inductor": replay each shard program of the exact and truncated sweeps from a captured
    #: CUDA graph (runtime/graphed.py): one launch per program call instead of one per kernel.
    cuda_graphs: bool = True
    #: trace a Python loop over ``range`` in a module or function the compiled code calls once, as torch's scan,
    #: instead of letting dynamo unroll it (polyfills/loops.py); False: dynamo unrolls it and the backend re-rolls
    #: the unrolled graph.
    roll_loops: bool = True
    #: a loss split off a sharded region (runtime/loss_tail.py) whose vocabulary head feeds only cross-entropy:
    #: "auto" runs head and loss as one fused op that never makes the logits where its Triton kernels serve (CUDA,
    #: fp32 / bf16 / fp16, hidden size <= 256); True everywhere it matches (the torch reference elsewhere); False never
    #: (runtime/fused_loss.py).
    fused_loss: bool | str = "auto"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        sp = self.sequence_parallel
        d["sequence_parallel"] = sp if sp is None or isinstance(sp, bool) else repr(sp)
        return d


ALLOWED_KEYS = tuple(f.name for f in dataclasses.fields(Options))

#: one line per option, for ``adjoint-compile --help`` (a wheel has no docs/ folder; docs/options.md has the rest)
SUMMARY = {
    "mode": "'exact' (default: the sharded exact adjoint), 'truncated' or 'highway'",
    "window": "truncated only, required there: adjoint window W in steps (int >= 1); W >= T is exact",
    "iterations": "highway only, required there: Highway-BP iterations k (int >= 0); k >= chain length is exact",
    "shard_size": "steps per shard of the sharded backward (int >= 1), the memory knob (default: chosen from T)",
    "sequence_parallel": "a torch.distributed process group (or true for WORLD): one sequence across ranks",
    "reduce_grads": "with sequence_parallel: sum parameter gradients over the group (default true)",
    "inner": "compiler for everything not rewritten: 'inductor' (default), 'aot_eager', 'eager'",
    "verify": "compare the rewritten gradients with autograd on the first call (default false)",
    "check_forward": "compare a rewritten graph's first outputs with the captured graph's (default true)",
    "tolerance": "highway only: stop iterating once an update's relative norm is below it (> 0)",
    "per_sample_clip": "DP-SGD clipping bound C > 0 (inf: per-example norms only)",
    "batch_dim": "the example axis of the inputs, for per_sample_clip (default 0)",
    "cuda_graphs": "on CUDA with inner='inductor': replay shard programs from CUDA graphs (default true)",
    "roll_loops": "trace a loop over range in called code once, as torch's scan, not unrolled (default true)",
    "fused_loss": "head + cross-entropy as one op without logits: 'auto' (default: where the kernels serve), true, false",
}


def _is_int(v: Any) -> bool:
    # bool is an int subclass; `window=True` is a mistake, not a window of 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(key: str, value: Any, allowed: str) -> OptionsError:
    return OptionsError(f"adjoint-compile option {key!r}={value!r} is not valid: {allowed}")


def _check_positive_int(key: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise _bad(key, value, f"expected an int >= {minimum}")
    return value


#: keys that were options once and are gone: what to use instead
REMOVED_KEYS = {
    "devices": "cross-device training is option 'sequence_parallel' (a torch.distributed process group, one device per "
               "rank, launched with torchrun); regions run on their inputs' device",
}


def _check_sequence_parallel(value: Any) -> Any:
    if value is None or value is False:
        return None
    if value is True:
        if not (dist.is_available() and dist.is_initialized()):
            raise _bad("sequence_parallel", value, "torch.distributed is not initialized: call "
                       "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    elif not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise _bad("sequence_parallel", value, "expected a torch.distributed ProcessGroup, True (WORLD) or False")
    return value


def validate(options: Mapping[str, Any] | Options | None) -> Options:
    """Check an options dict against DESIGN.md §1 and return the frozen :class:`Options`.

    Raises :class:`OptionsError` (a ``ValueError``) for an unknown key, a bad value, or a missing required one.
    """
    if options is None:
        return Options()
    if isinstance(options, Options):
        return options
    if not isinstance(options, Mapping):
        raise OptionsError(f"adjoint-compile options must be a dict, got {type(options).__name__}: {options!r}")
    for key in options:
        if key in REMOVED_KEYS:
            raise OptionsError(f"adjoint-compile option {key!r}={options[key]!r} no longer exists: {REMOVED_KEYS[key]}")
        if key not in ALLOWED_KEYS:
            close = difflib.get_close_matches(str(key), ALLOWED_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionsError(
                f"unknown adjoint-compile option {key!r}={options[key]!r}{hint}; allowed keys: {', '.join(ALLOWED_KEYS)}"
            )

    kw: dict[str, Any] = {}
    mode = options.get("mode", "exact")
    if mode not in MODES:
        raise _bad("mode", mode, f"expected one of {', '.join(map(repr, MODES))}")
    kw["mode"] = mode

    window = options.get("window")
    if window is not None:
        kw["window"] = _check_positive_int("window", window, 1)
        if mode != "truncated":
            # NB: as for 'tolerance' (highway only): an option of another mode is refused, not silently unused
            raise _bad("window", window, f"it applies to mode='truncated' only (mode={mode!r}); for a truncated "
                       f"adjoint pass {{'mode': 'truncated', 'window': {window}}}")
    elif mode == "truncated":
        raise OptionsError("adjoint-compile option 'window' is required when mode='truncated' (an int >= 1 steps)")

    iterations = options.get("iterations")
    if iterations is not None:
        kw["iterations"] = _check_positive_int("iterations", iterations, 0)
        if mode != "highway":
            raise _bad("iterations", iterations, f"it applies to mode='highway' only (mode={mode!r}); for Highway-BP "
                       f"pass {{'mode': 'highway', 'iterations': {iterations}}}")
    elif mode == "highway":
        raise OptionsError("adjoint-compile option 'iterations' is required when mode='highway' (an int >= 0)")

    if options.get("shard_size") is not None:
        kw["shard_size"] = _check_positive_int("shard_size", options["shard_size"], 1)
    kw["sequence_parallel"] = _check_sequence_parallel(options.get("sequence_parallel"))

    reduce_grads = options.get("reduce_grads", True)
    if not isinstance(reduce_grads, bool):
        raise _bad("reduce_grads", reduce_grads, "expected True or False")
    kw["reduce_grads"] = reduce_grads

    inner = options.get("inner", "inductor")
    if inner not in INNER_COMPILERS:
        raise _bad("inner", inner, f"expected one of {', '.join(map(repr, INNER_COMPILERS))}")
    kw["inner"] = inner

    verify = options.get("verify", False)
    if not isinstance(verify, bool):
        raise _bad("verify", verify, "expected True or False")
    kw["verify"] = verify

    check_forward = options.get("check_forward", True)
    if not isinstance(check_forward, bool):
        raise _bad("check_forward", check_forward, "expected True or False")
    kw["check_forward"] = check_forward

    tolerance = options.get("tolerance")
    if tolerance is not None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
            raise _bad("tolerance", tolerance, "expected a number > 0 (a relative norm)")
        if mode != "highway":
            raise _bad("tolerance", tolerance, f"it applies to mode='highway' only (mode={mode!r})")
        kw["tolerance"] = float(tolerance)

    clip = options.get("per_sample_clip")
    if clip is not None:
        # NB: NaN fails `> 0`; inf is allowed on purpose (norms only, no clipping)
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
            raise _bad("per_sample_clip", clip, "expected a number C > 0 (the per-example gradient norm bound), or "
                       "float('inf') for the norms only")
        kw["per_sample_clip"] = float(clip)
        if kw["sequence_parallel"] is not None:
            # NB: each rank would clip its slice's partial per-example gradients: not the clipped sum of the whole
            raise _bad("per_sample_clip", clip, "it cannot be combined with sequence_parallel yet (a rank holds only "
                       "part of each example's gradient)")
    if "batch_dim" in options:
        kw["batch_dim"] = _check_positive_int("batch_dim", options["batch_dim"], 0)
        if clip is None:
            # NB: nothing else reads the example axis: accepting it alone would look like it did something
            raise _bad("batch_dim", options["batch_dim"], "it applies to per_sample_clip only (not given)")
    cuda_graphs = options.get("cuda_graphs", True)
    if not isinstance(cuda_graphs, bool):
        raise _bad("cuda_graphs", cuda_graphs, "expected True or False")
    kw["cuda_graphs"] = cuda_graphs
    roll_loops = options.get("roll_loops", True)
    if not isinstance(roll_loops, bool):
        raise _bad("roll_loops", roll_loops, "expected True or False")
    kw["roll_loops"] = roll_loops
    fused = options.get("fused_loss", "auto")
    if not (fused is True or fused is False or fused == "auto"):
        raise _bad("fused_loss", fused, "expected 'auto', True or False")
    kw["fused_loss"] = fused
    return Options(**kw)
