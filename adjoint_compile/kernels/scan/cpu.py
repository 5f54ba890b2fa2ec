"""A compiled CPU kernel for the full-scan primitive; same contract as :func:`.ref.blocked_scan` (tested against it
and against :func:`.ref.naive_scan`).

    h_t = a_t ⊙ h_{t∓1} + b_t        (h_{-1} = h0, or zeros; ∓: forward / reverse)

Why: the torch reference is a blocked scan, ~3√T small torch ops per call. On the long sequences of a plain
``torch.compile`` that overhead is amortized, but the adjoint-sharded backward scans every shard (tens to hundreds
of steps) three times (forward, recompute, adjoint), and there per-op overhead dominated the training step (on 2
CPU cores, a 4-layer SSM at T = 8192 spent ~60 % of its step in 128-step reference scans). One pass of C over
``[outer, T, inner]`` rows makes the scan memory-bound: each row of ``inner`` contiguous channels is read and
written once, vectorized by the compiler.

The C source below is compiled once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``/
``clang``) into the user's kernel cache, ``$ADJOINT_COMPILE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/adjoint_compile``
or ``~/.cache/adjoint_compile`` (directories we create get mode 0700), and loaded with ctypes (which releases the GIL
during the call). Native code is loaded only from a place the user alone controls: the cache directory and the
shared object must be owned by the current user and not writable by group or others (the ``.so`` a regular file,
not a symlink), else the kernel is refused with an :class:`~adjoint_compile.errors.AdjointCompileWarning` and never
loaded. The source and the compiler output are written under private ``mkstemp`` names in that directory, and the
shared object is renamed into place atomically. Without a compiler, with a refused cache, or with
``ADJOINT_COMPILE_CPU_KERNEL=0``, :func:`available` is False and the dispatcher keeps the torch reference. fp32 and
fp64 (the compute dtypes); the callers upcast half precision first.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings

import torch
from torch import Tensor

from ...errors import AdjointCompileWarning
from . import ref as _ref

log = logging.getLogger(__name__)

__all__ = ["available", "scan_cpu", "scan_backward_cpu", "prim_cpu"]

# NB: one row of `inner` channels per step; `prev` is the previous step's output row (or h0), so the state lives in
# `out` itself and the loop needs no scratch. a/b/out/h0 rows are contiguous (inner stride 1); outer and step
# strides are free, so narrow()ed views along the step dim need no copy.
_SOURCE = r"""
#include <stdint.h>
#define SCAN(NAME, T_)                                                                                  \
void NAME(const T_* a, const T_* b, const T_* h0, T_* out,                                               \
          int64_t n_outer, int64_t n_t, int64_t n_inner,                                                 \
          int64_t a_so, int64_t a_st, int64_t b_so, int64_t b_st,                                        \
          int64_t o_so, int64_t o_st, int64_t h_so, int reverse) {                                       \
    for (int64_t o = 0; o < n_outer; ++o) {                                                              \
        const T_* prev = h0 ? h0 + o * h_so : 0;                                                         \
        for (int64_t k = 0; k < n_t; ++k) {                                                              \
            int64_t t = reverse ? n_t - 1 - k : k;                                                       \
            const T_* at = a + o * a_so + t * a_st;                                                      \
            const T_* bt = b + o * b_so + t * b_st;                                                      \
            T_* ot = out + o * o_so + t * o_st;                                                          \
            if (prev) {                                                                                  \
                for (int64_t i = 0; i < n_inner; ++i) ot[i] = at[i] * prev[i] + bt[i];                   \
            } else {                                                                                     \
                for (int64_t i = 0; i < n_inner; ++i) ot[i] = bt[i];                                     \
            }                                                                                            \
            prev = ot;                                                                                   \
        }                                                                                                \
    }                                                                                                    \
}
SCAN(ac_scan_f32, float)
SCAN(ac_scan_f64, double)
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


class _NoCudaRuntimeNoise(logging.Filter):
    """Drops torch.utils.cpp_extension's "No CUDA runtime is found, using CUDA_HOME=..." (a CUDA build of torch on a
    machine without a GPU, where a CUDA toolkit is installed). It is logged when that module is first imported,
    which on CPU is when inductor builds its first C++ kernel: a CPU training step of ours, not a CUDA extension
    build, so the line is about nothing the user does. Everything else that module logs passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


_CPP_EXTENSION_LOG = logging.getLogger("torch.utils.cpp_extension")
if not any(isinstance(f, _NoCudaRuntimeNoise) for f in _CPP_EXTENSION_LOG.filters):
    _CPP_EXTENSION_LOG.addFilter(_NoCudaRuntimeNoise())


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


# NB: -march=native makes the .so specific to this CPU, so the key includes the machine type and host name;
# -ffp-contract=off keeps a*h+b two roundings, like the torch reference.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


class _UnsafeCache(Exception):
    """The kernel cache (directory or shared object) is not private to the user: nothing is loaded from it."""


def _cache_dir() -> str:
    """The kernel cache: ``$ADJOINT_COMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/adjoint_compile`` (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else ``~/.cache/adjoint_compile``."""
    d = os.environ.get("ADJOINT_COMPILE_CACHE_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "adjoint_compile")


def _make_dirs(d: str) -> None:
    """Create ``d`` and the missing parents with mode 0700 (``os.makedirs`` applies ``mode`` to the leaf only).
    Existing directories are left as they are: :func:`_owned_privately` judges the cache directory."""
    missing = []
    p = d
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue                     # a concurrent process made it; the privacy check below still applies
        os.chmod(p, 0o700)               # exactly 0700 whatever the umask


def _owned_privately(path: str) -> str | None:
    """Why ``path`` (the cache directory or a shared object in it) must not be trusted, or None when it is owned by
    the current user and not writable by group or others. ``os.lstat``: a symlink is judged as itself; the cache
    directory is passed resolved, the ``.so`` must be a regular file."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "it is neither a directory nor a regular file"
    if not hasattr(os, "getuid"):
        return "its owner cannot be checked on this platform"
    uid = os.getuid()
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _check_private(path: str, cache_dir: str) -> None:
    reason = _owned_privately(path)
    if reason is not None:
        raise _UnsafeCache(
            f"refusing to load the CPU scan kernel from {path}: {reason}. Only a cache directory and files owned by "
            f"you and writable by you alone are trusted; fix it (e.g. `chmod 700 {cache_dir}`, or remove it and let "
            f"adjoint-compile recreate it) or choose another directory with ADJOINT_COMPILE_CACHE_DIR")


def _key(cc: str) -> str:
    return hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(), platform.node()]).encode()
                          ).hexdigest()[:16]


def _build(cc: str) -> str:
    """The path of the shared object in the private kernel cache, built there first if it is missing. Raises
    :class:`_UnsafeCache` when the directory or the shared object is not private to the user."""
    d = _cache_dir()
    _make_dirs(d)
    # NB: checked and used by its resolved path: a symlinked ~/.cache is fine when its target is private.
    d = os.path.realpath(d)
    _check_private(d, d)
    so = os.path.join(d, f"scan_{_key(cc)}.so")
    if os.path.lexists(so):
        _check_private(so, d)
        return so
    # the source and the compiler output under private random names (mkstemp: O_EXCL, mode 0600), never a
    # predictable path; the .so is renamed into place, so concurrent processes never load a half-written file
    fd, src = tempfile.mkstemp(prefix="scan_", suffix=".c", dir=d)
    tmp = None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_SOURCE)
        tfd, tmp = tempfile.mkstemp(prefix="scan_", suffix=".so.tmp", dir=d)
        os.close(tfd)
        res = subprocess.run([cc, *_FLAGS, src, "-o", tmp], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            # -march=native is not understood everywhere (e.g. some clang targets): retry portable
            res = subprocess.run([cc, *[f for f in _FLAGS if f != "-march=native"], src, "-o", tmp],
                                 capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.chmod(tmp, 0o700)             # the linker's mode follows the umask; the cache's files are private
        os.replace(tmp, so)
        tmp = None
    finally:
        for p in (src, tmp):
            if p is not None:
                try:
                    os.unlink(p)
                except OSError:
                    pass
    _check_private(so, d)
    log.info("adjoint-compile: built the CPU scan kernel %s", so)
    return so


def _load() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        if os.environ.get("ADJOINT_COMPILE_CPU_KERNEL", "1") in ("0", "", "false", "False"):
            _failed = "disabled by ADJOINT_COMPILE_CPU_KERNEL=0"
            return None
        cc = _compiler()
        if cc is None:
            _failed = "no C compiler found (set CC)"
            log.warning("adjoint-compile: %s; CPU scans use the slower torch reference", _failed)
            return None
        try:
            lib = ctypes.CDLL(_build(cc))
        except _UnsafeCache as e:
            _failed = str(e)
            log.warning("adjoint-compile: %s; CPU scans use the slower torch reference", _failed)
            warnings.warn(f"{_failed}; CPU scans use the slower torch reference", AdjointCompileWarning,
                          stacklevel=3)
            return None
        except Exception as e:  # noqa: BLE001 - any build/load failure falls back to the torch reference
            _failed = f"{type(e).__name__}: {e}"
            log.warning("adjoint-compile: could not build the CPU scan kernel (%s); CPU scans use the slower "
                        "torch reference", _failed)
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.ac_scan_f32, lib.ac_scan_f64):
            fn.restype = None
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_int]
        _lib = lib
        return lib


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on the first call; False without a C compiler)."""
    return _load() is not None


def why_unavailable() -> str | None:
    """The reason :func:`available` is False, or None."""
    _load()
    return _failed


def _rows(x: Tensor, outer: int, T: int | None, inner: int) -> Tensor | None:
    """``x`` as a ``[outer, T, inner]`` (or ``[outer, inner]``) view with contiguous rows, or None."""
    shape = (outer, inner) if T is None else (outer, T, inner)
    try:
        v = x.view(shape)
    except RuntimeError:
        return None
    return v if inner == 1 or v.stride(-1) == 1 else None


def prim_cpu(a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, out: Tensor | None = None) -> Tensor:
    """The full scan along ``d`` in the compute dtype, written into ``out``; same contract as
    :func:`.ref.blocked_scan` (``a``, ``b``: same shape, any strides; ``h0``: ``a``'s shape without ``d`` or None;
    ``out``: ``a``'s shape in the compute dtype, any strides, or None to allocate)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU scan kernel is unavailable: {_failed}")
    cdt = torch.float64 if torch.float64 in (a.dtype, b.dtype, None if h0 is None else h0.dtype) else torch.float32
    a, b = a.to(cdt), b.to(cdt)
    if h0 is not None:
        h0 = h0.to(cdt)
    if out is None:
        out = torch.empty(a.shape, dtype=cdt, device=a.device)
    shape = a.shape
    T = shape[d]
    if T == 0 or out.numel() == 0:
        return out
    inner = math.prod(shape[d + 1:])
    outer = out.numel() // (T * inner)
    # NB: the common case (contiguous tensors: the shard programs' own) skips the view checks; this call is made
    # three times per shard and scan, where Python overhead is a visible part of a small shard's time.
    if a.is_contiguous() and b.is_contiguous() and out.is_contiguous() and (h0 is None or h0.is_contiguous()):
        av, bv, ov, hv, direct = a, b, out, h0, True
        sa = sb = so = (T * inner, inner)
        sh = inner
    else:
        av = _rows(a, outer, T, inner)
        av = av if av is not None else a.contiguous().view(outer, T, inner)
        bv = _rows(b, outer, T, inner)
        bv = bv if bv is not None else b.contiguous().view(outer, T, inner)
        hv = None
        if h0 is not None:
            hv = _rows(h0, outer, None, inner)
            hv = hv if hv is not None else h0.contiguous().view(outer, inner)
        ov = _rows(out, outer, T, inner)
        direct = ov is not None
        if not direct:
            ov = torch.empty((outer, T, inner), dtype=cdt)
        sa, sb, so = av.stride()[:2], bv.stride()[:2], ov.stride()[:2]
        sh = 0 if hv is None else hv.stride(0)
    fn = lib.ac_scan_f32 if cdt == torch.float32 else lib.ac_scan_f64
    fn(av.data_ptr(), bv.data_ptr(), None if hv is None else hv.data_ptr(), ov.data_ptr(),
       outer, T, inner, sa[0], sa[1], sb[0], sb[1], so[0], so[1], sh, int(reverse))
    if not direct:
        out.copy_(ov.view(out.shape))
    return out


def scan_cpu(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1, reverse: bool = False,
             window: int | None = None) -> Tensor:
    """The linear scan (full or windowed) with the compiled kernel; same contract as :func:`.ref.scan_ref`."""
    if a.device.type != "cpu":
        raise ValueError(f"scan_cpu: tensors must be on the CPU, got {a.device}")
    return _ref.forward_with(prim_cpu, a, b, h0, dim, reverse, window)


def scan_backward_cpu(grad: Tensor, a: Tensor, b: Tensor | None, h0: Tensor | None, h: Tensor | None,
                      dim: int = 1, reverse: bool = False, window: int | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(∂a, ∂b, ∂h0) with the compiled kernel; same contract as :func:`.ref.scan_backward_ref`."""
    return _ref.backward_with(prim_cpu, grad, a, b, h0, h, dim % a.ndim, reverse, window)
