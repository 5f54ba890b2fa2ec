"""A compiled CPU kernel for the full-scan primitive; same contract as :func:`.ref.blocked_scan` (tested against it
and against :func:`.ref.naive_scan`).

    h_t = a_t ⊙ h_{t∓1} + b_t        (h_{-1} = h0, or zeros; ∓: forward / reverse)

Why: the torch reference is a blocked scan, ~3√T small torch ops per call. On the long sequences of a plain
``torch.compile`` that overhead is amortized, but the adjoint-sharded backward scans every shard (tens to hundreds
of steps) three times (forward, recompute, adjoint), and there per-op overhead dominated the training step (on 2
CPU cores, a 4-layer SSM at T = 8192 spent ~60 % of its step in 128-step reference scans). One pass of C makes the
scan memory-bound: every element is read and written once, in the layouts the tensors come in (strided, permuted
and broadcast ones too, up to :data:`MAX_OUTER_DIMS` outer loops: a shard program's scan inputs are often
permuted by inductor, and a decay is often broadcast over channels; copying them contiguous first cost more than
the scan), vectorized by the compiler along the innermost dim.

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
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import AdjointCompileWarning
from . import ref as _ref

log = logging.getLogger(__name__)

__all__ = ["available", "scan_cpu", "scan_backward_cpu", "prim_cpu"]

# NB: the tensors are walked as loops over up to four outer dims, the step dim and one inner dim, each tensor with its
# own strides, so that permuted layouts (an inductor program's output, its T stride smaller than a channel's) and
# broadcast decays (a stride 0 over the channels) need no copy. The previous step's output (or h0) is the state, so
# the loop needs no scratch. Rows of outer dims go in blocks of RB, stepped together: a row's steps are a chain of
# dependent multiply-adds, and RB independent chains keep the core busy where the inner dim is short. The two common
# inner layouts get loops of unit stride, which the compiler vectorizes: all contiguous, and a decay broadcast over
# the inner dim.
_SOURCE = r"""
#include <stdint.h>
#define RB 32
#define SCAN(NAME, T_)                                                                                  \
void NAME(const T_* a, const T_* b, const T_* h0, T_* out, int64_t n_od, const int64_t* od_size,         \
          const int64_t* a_so, const int64_t* b_so, const int64_t* o_so, const int64_t* h_so,            \
          int64_t n_t, int64_t a_st, int64_t b_st, int64_t o_st,                                         \
          int64_t n_in, int64_t a_si, int64_t b_si, int64_t o_si, int64_t h_si, int reverse) {           \
    int64_t n_outer = 1, idx[4] = {0, 0, 0, 0}, ca = 0, cb = 0, co = 0, ch = 0;                          \
    int64_t ao[RB], bo[RB], oo[RB], ho[RB];                                                              \
    for (int64_t j = 0; j < n_od; ++j) n_outer *= od_size[j];                                            \
    const int64_t back = reverse ? o_st : -o_st;                                                         \
    /* a row at a time when the inner dim is one element: such rows are often far apart, at strides      \
       that map a block of them onto the same cache sets */                                              \
    const int64_t rb = n_in == 1 ? 1 : RB;                                                               \
    for (int64_t o0 = 0; o0 < n_outer; o0 += rb) {                                                       \
        const int64_t nr = n_outer - o0 < rb ? n_outer - o0 : rb;                                        \
        for (int64_t r = 0; r < nr; ++r) {                                                               \
            ao[r] = ca; bo[r] = cb; oo[r] = co; ho[r] = ch;                                              \
            for (int64_t j = n_od - 1; j >= 0; --j) {                                                    \
                ++idx[j]; ca += a_so[j]; cb += b_so[j]; co += o_so[j]; ch += h_so[j];                    \
                if (idx[j] < od_size[j]) break;                                                          \
                ca -= a_so[j] * od_size[j]; cb -= b_so[j] * od_size[j];                                  \
                co -= o_so[j] * od_size[j]; ch -= h_so[j] * od_size[j]; idx[j] = 0;                      \
            }                                                                                            \
        }                                                                                                \
        for (int64_t r = 0; r < nr; ++r) {                                                               \
            const int64_t t = reverse ? n_t - 1 : 0;                                                     \
            const T_* at = a + ao[r] + t * a_st;                                                         \
            const T_* bt = b + bo[r] + t * b_st;                                                         \
            T_* ot = out + oo[r] + t * o_st;                                                             \
            if (h0) {                                                                                    \
                const T_* hp = h0 + ho[r];                                                               \
                for (int64_t i = 0; i < n_in; ++i) ot[i * o_si] = at[i * a_si] * hp[i * h_si] + bt[i * b_si]; \
            } else {                                                                                     \
                for (int64_t i = 0; i < n_in; ++i) ot[i * o_si] = bt[i * b_si];                          \
            }                                                                                            \
        }                                                                                                \
        for (int64_t k = 1; k < n_t; ++k) {                                                              \
            const int64_t t = reverse ? n_t - 1 - k : k;                                                 \
            const T_* a_t = a + t * a_st;                                                                \
            const T_* b_t = b + t * b_st;                                                                \
            T_* o_t = out + t * o_st;                                                                    \
            if (a_si == 1 && b_si == 1 && o_si == 1) {                                                   \
                for (int64_t r = 0; r < nr; ++r) {                                                       \
                    const T_* at = a_t + ao[r]; const T_* bt = b_t + bo[r];                              \
                    T_* ot = o_t + oo[r]; const T_* prev = ot + back;                                    \
                    for (int64_t i = 0; i < n_in; ++i) ot[i] = at[i] * prev[i] + bt[i];                  \
                }                                                                                        \
            } else if (a_si == 0 && b_si == 1 && o_si == 1) {                                            \
                for (int64_t r = 0; r < nr; ++r) {                                                       \
                    const T_ s = a_t[ao[r]]; const T_* bt = b_t + bo[r];                                 \
                    T_* ot = o_t + oo[r]; const T_* prev = ot + back;                                    \
                    for (int64_t i = 0; i < n_in; ++i) ot[i] = s * prev[i] + bt[i];                      \
                }                                                                                        \
            } else if (n_in == 1) {                                                                      \
                for (int64_t r = 0; r < nr; ++r) o_t[oo[r]] = a_t[ao[r]] * o_t[oo[r] + back] + b_t[bo[r]]; \
            } else {                                                                                     \
                for (int64_t r = 0; r < nr; ++r) {                                                       \
                    const T_* at = a_t + ao[r]; const T_* bt = b_t + bo[r];                              \
                    T_* ot = o_t + oo[r]; const T_* prev = ot + back;                                    \
                    for (int64_t i = 0; i < n_in; ++i)                                                   \
                        ot[i * o_si] = at[i * a_si] * prev[i * o_si] + bt[i * b_si];                     \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}
SCAN(ac_scan_nd_f32, float)
SCAN(ac_scan_nd_f64, double)
"""

#: outer loops the kernel takes; a layout that does not coalesce into as few is copied contiguous first
MAX_OUTER_DIMS = 4

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
        for fn in (lib.ac_scan_nd_f32, lib.ac_scan_nd_f64):
            fn.restype = None
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                           i64, i64, i64, i64, i64, ctypes.c_int]
        _lib = lib
        return lib


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on the first call; False without a C compiler)."""
    return _load() is not None


def why_unavailable() -> str | None:
    """The reason :func:`available` is False, or None."""
    _load()
    return _failed


def loops(shape: Sequence[int], d: int, strides: Sequence[Sequence[int]]
          ) -> tuple[list[int], list[list[int]], int, list[int]] | None:
    """The kernel's loops over tensors of ``shape`` scanned along ``d``, each tensor with its ``strides`` (one per
    dim; 0 where it is broadcast): ``(outer sizes, per tensor its outer strides, inner size, per tensor its inner
    stride)``, or None when more than :data:`MAX_OUTER_DIMS` outer loops remain.

    The dims other than ``d`` are ordered by the first tensor's strides, then the others' (largest first: the loops
    follow its memory), and neighbours that are one dim for every tensor are merged. The last becomes the inner loop
    when its strides are all 0 or 1 for the first two tensors (else the inner loop has one element and every dim is
    an outer loop: a strided inner loop would touch a cache line per element)."""
    n = len(strides)
    dims = sorted((i for i in range(len(shape)) if i != d and shape[i] != 1),
                  key=lambda i: tuple(-st[i] for st in strides))
    groups: list[tuple[int, list[int]]] = []
    for i in dims:
        st = [s[i] for s in strides]
        if groups and all(g == x * shape[i] for g, x in zip(groups[-1][1], st)):
            groups[-1] = (groups[-1][0] * shape[i], st)
        else:
            groups.append((shape[i], st))
    n_in, inner = 1, [0] * n
    if groups and all(x in (0, 1) for x in groups[-1][1][:2]):
        n_in, inner = groups.pop()
    if len(groups) > MAX_OUTER_DIMS:
        return None
    return [g[0] for g in groups], [[g[1][k] for g in groups] for k in range(n)], n_in, inner


def _i64s(xs: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(1, len(xs)))(*xs)


@functools.lru_cache(maxsize=512)
def _kernel_args(shape: tuple[int, ...], d: int, strides: tuple[tuple[int, ...], ...]) -> tuple | None:
    """:func:`loops` of (b, out, a, h0) as the kernel's arguments; cached: a shard program calls the scan with the
    same layouts every shard, and building them is a visible part of a short scan's time."""
    plan = loops(shape, d, strides)
    if plan is None:
        return None
    sizes, (b_so, o_so, a_so, h_so), n_in, (b_si, o_si, a_si, h_si) = plan
    return (len(sizes), _i64s(sizes), _i64s(a_so), _i64s(b_so), _i64s(o_so), _i64s(h_so),
            n_in, a_si, b_si, o_si, h_si)


def _strides(b: Tensor, out: Tensor, a: Tensor, h0: Tensor | None, d: int) -> tuple[tuple[int, ...], ...]:
    """The strides of (b, out, a, h0), h0's with a 0 at ``d`` (all 0 without h0)."""
    hs = (0,) * b.dim() if h0 is None else h0.stride()[:d] + (0,) + h0.stride()[d:]
    return b.stride(), out.stride(), a.stride(), hs


def prim_cpu(a: Tensor, b: Tensor, h0: Tensor | None, d: int, reverse: bool, out: Tensor | None = None) -> Tensor:
    """The full scan along ``d`` in the compute dtype, written into ``out``; same contract as
    :func:`.ref.blocked_scan` (``a``, ``b``: same shape, any strides, broadcast ones included; ``h0``: ``a``'s shape
    without ``d`` or None; ``out``: ``a``'s shape in the compute dtype, any strides without overlap, or None to
    allocate)."""
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
    dst = out
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), shape)):
        dst = torch.empty(shape, dtype=cdt)               # an overlapping out (expanded) cannot be written in place
    args = _kernel_args(tuple(shape), d, _strides(b, dst, a, h0, d))
    if args is None:
        a, b = a.contiguous(), b.contiguous()
        h0 = None if h0 is None else h0.contiguous()
        if not dst.is_contiguous():
            dst = torch.empty(shape, dtype=cdt)
        args = _kernel_args(tuple(shape), d, _strides(b, dst, a, h0, d))
    n_od, sizes, a_so, b_so, o_so, h_so, n_in, a_si, b_si, o_si, h_si = args
    fn = lib.ac_scan_nd_f32 if cdt == torch.float32 else lib.ac_scan_nd_f64
    fn(a.data_ptr(), b.data_ptr(), None if h0 is None else h0.data_ptr(), dst.data_ptr(), n_od, sizes,
       a_so, b_so, o_so, h_so, T, a.stride(d), b.stride(d), dst.stride(d), n_in, a_si, b_si, o_si, h_si, int(reverse))
    if dst is not out:
        out.copy_(dst)
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
