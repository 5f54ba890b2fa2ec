"""Triton kernels for the fused head and cross-entropy; same contract as :mod:`.ref` (the spec they are tested
against). No kernel writes a logit to memory: each makes its [BLOCK_N, BLOCK_V] tile of z = h Wᵀ + b in registers.

* ``_lce_fwd_kernel``: one program per BLOCK_N rows walks the vocabulary in BLOCK_V columns with an online
  logsumexp, gathering the target's logit and the row's sum of logits: loss and lse.
* ``_lce_dh_kernel``: one program per BLOCK_N rows walks the vocabulary again: ∂z tile from the kept lse, ∂h += ∂z W.
* ``_lce_dw_kernel``: one program per BLOCK_V columns walks the rows: ∂W += ∂zᵀ h, ∂b += Σ_rows ∂z.

Two backward kernels instead of one with atomic adds: each writes its own block, so the gradients do not depend on
the order programs run in (deterministic), for one more product per tile. ``_lce_dh_kernel`` with ``ATOMIC`` is the
one-pass variant (``CONFIG["backward"] = "atomic"``), kept for measuring the trade on a GPU. The hidden size is one
block (D ≤ the package's ``MAX_D``); products take the inputs' dtype into fp32 accumulators, fp32 ones with
``input_precision`` from torch's float32 matmul precision (:func:`precision`). Offsets are int64.

On a machine without a GPU these run under ``TRITON_INTERPRET=1`` (set before this module is imported). This
module is imported lazily by the dispatcher.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .ref import acc_dtype


# NB: only core builtins and our own @jit helpers inside kernels (see kernels/scan/triton.py): tl.sum / tl.max /
# tl.zeros are @jit functions of triton's standard library, which the interpreter fails to call when triton was
# imported before TRITON_INTERPRET was set.
@triton.jit
def _add(x, y):
    return x + y


@triton.jit
def _max(x, y):
    return tl.maximum(x, y)


@triton.jit
def _tile(h, W, Bias, v, vmask, d, dmask, swv, swd, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """z = h Wᵀ + b for the columns v: [BLOCK_N, BLOCK_V] fp32 (columns past V are −inf)."""
    # w: [BLOCK_D, BLOCK_V]
    w = tl.load(W + d[:, None] * swd + v[None, :] * swv, mask=dmask[:, None] & vmask[None, :], other=0.0)
    z = tl.dot(h, w.to(h.dtype), input_precision=PREC, out_dtype=tl.float32)
    if HAS_BIAS:
        # b: [BLOCK_V]
        z += tl.load(Bias + v, mask=vmask, other=0.0).to(tl.float32)[None, :]
    return tl.where(vmask[None, :], z, float("-inf"))


@triton.jit
def _dz(z, lse, tgt, valid, g_loss, g_lse, v, V, EPS: tl.constexpr):
    """∂z for a tile of logits z: [BLOCK_N, BLOCK_V] fp32, 0 in columns past V (see ref.py)."""
    p = tl.exp(z - lse[:, None])
    hit = (v[None, :] == tgt[:, None]).to(tl.float32)
    c = tl.where(valid, g_loss, 0.0)[:, None]
    return c * (p - (1.0 - EPS) * hit - EPS / V) * (z > float("-inf")).to(tl.float32) + g_lse[:, None] * p


@triton.jit
def _rows(H, Tgt, n, nmask, d, dmask, shn, shd, ignore_index, DOT: tl.constexpr):
    """The rows n of h ([BLOCK_N, BLOCK_D], in DOT) and their targets ([BLOCK_N]; ignored past N)."""
    h = tl.load(H + n[:, None] * shn + d[None, :] * shd, mask=nmask[:, None] & dmask[None, :], other=0.0).to(DOT)
    tgt = tl.load(Tgt + n, mask=nmask, other=ignore_index)
    return h, tgt


@triton.jit
def _cotangents(Lse, GLoss, GLse, n, nmask):
    """lse, g_loss, g_lse of the rows n ([BLOCK_N] each, fp32); past N, lse = inf and no cotangent, so ∂z = 0 there
    whatever the bias."""
    lse = tl.load(Lse + n, mask=nmask, other=float("inf"))
    g_loss = tl.load(GLoss + n, mask=nmask, other=0.0).to(tl.float32)
    g_lse = tl.load(GLse + n, mask=nmask, other=0.0).to(tl.float32)
    return lse, g_loss, g_lse


@triton.jit
def _lce_fwd_kernel(H, W, Bias, Tgt, Loss, Lse, N, V, D, shn, shd, swv, swd, ignore_index,
                    EPS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    h, tgt = _rows(H, Tgt, n, nmask, d, dmask, shn, shd, ignore_index, DOT)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.full([BLOCK_N], 0.0, tl.float32)
    zt = tl.full([BLOCK_N], 0.0, tl.float32)
    zsum = tl.full([BLOCK_N], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        vmask = v < V
        z = _tile(h, W, Bias, v, vmask, d, dmask, swv, swd, HAS_BIAS, PREC)
        m_new = tl.maximum(m, tl.reduce(z, 1, _max))
        s = s * tl.exp(m - m_new) + tl.reduce(tl.exp(z - m_new[:, None]), 1, _add)
        m = m_new
        zt += tl.reduce(tl.where(v[None, :] == tgt[:, None], z, 0.0), 1, _add)
        zsum += tl.reduce(tl.where(vmask[None, :], z, 0.0), 1, _add)
    lse = m + tl.log(s)
    valid = tgt != ignore_index
    # NB: a target outside [0, V) that is not ignored gives a NaN loss (eager raises; checking would synchronize)
    inside = (tgt >= 0) & (tgt < V)
    loss = lse - (1.0 - EPS) * zt - EPS * zsum / V
    loss = tl.where(valid, tl.where(inside, loss, float("nan")), 0.0)
    tl.store(Loss + n, loss, mask=nmask)
    tl.store(Lse + n, lse, mask=nmask)


@triton.jit
def _lce_dh_kernel(H, W, Bias, Tgt, Lse, GLoss, GLse, DH, DW, DB, N, V, D, shn, shd, swv, swd, sdn, sdd, ignore_index,
                   EPS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                   ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """∂h of BLOCK_N rows; with ATOMIC, also ∂W and ∂b of the same tiles added to fp32 [V, D] and [V] buffers with
    atomics (one pass: one product fewer per tile than the two-pass backward; the sums' order, so their last bits,
    vary from run to run)."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    h, tgt = _rows(H, Tgt, n, nmask, d, dmask, shn, shd, ignore_index, DOT)
    lse, g_loss, g_lse = _cotangents(Lse, GLoss, GLse, n, nmask)
    valid = tgt != ignore_index
    dh = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        vmask = v < V
        z = _tile(h, W, Bias, v, vmask, d, dmask, swv, swd, HAS_BIAS, PREC)
        dz = _dz(z, lse, tgt, valid, g_loss, g_lse, v, V, EPS)
        # w: [BLOCK_V, BLOCK_D]
        w = tl.load(W + v[:, None] * swv + d[None, :] * swd, mask=vmask[:, None] & dmask[None, :], other=0.0)
        dh += tl.dot(dz.to(h.dtype), w.to(h.dtype), input_precision=PREC, out_dtype=tl.float32)
        if ATOMIC:
            dw = tl.dot(tl.trans(dz.to(h.dtype)), h, input_precision=PREC, out_dtype=tl.float32)
            tl.atomic_add(DW + v[:, None] * D + d[None, :], dw, mask=vmask[:, None] & dmask[None, :])
            if HAS_BIAS:
                tl.atomic_add(DB + v, tl.reduce(dz, 0, _add), mask=vmask)
    tl.store(DH + n[:, None] * sdn + d[None, :] * sdd, dh.to(DH.dtype.element_ty),
             mask=nmask[:, None] & dmask[None, :])


@triton.jit
def _lce_dw_kernel(H, W, Bias, Tgt, Lse, GLoss, GLse, DW, DB, N, V, D, shn, shd, swv, swd, sdv, sdd, ignore_index,
                   EPS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = v < V
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    dw = tl.full([BLOCK_V, BLOCK_D], 0.0, tl.float32)
    db = tl.full([BLOCK_V], 0.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        nmask = n < N
        h, tgt = _rows(H, Tgt, n, nmask, d, dmask, shn, shd, ignore_index, DOT)
        lse, g_loss, g_lse = _cotangents(Lse, GLoss, GLse, n, nmask)
        z = _tile(h, W, Bias, v, vmask, d, dmask, swv, swd, HAS_BIAS, PREC)
        dz = _dz(z, lse, tgt, tgt != ignore_index, g_loss, g_lse, v, V, EPS)
        dw += tl.dot(tl.trans(dz.to(h.dtype)), h, input_precision=PREC, out_dtype=tl.float32)
        db += tl.reduce(dz, 0, _add)
    tl.store(DW + v[:, None] * sdv + d[None, :] * sdd, dw.to(DW.dtype.element_ty),
             mask=vmask[:, None] & dmask[None, :])
    if HAS_BIAS:
        tl.store(DB + v, db.to(DB.dtype.element_ty), mask=vmask)


def precision() -> str:
    """The fp32 products' input precision for torch's float32 matmul precision: TF32 at "high" and "medium" (as
    cuBLAS), and at "highest" ``CONFIG["fp32_highest"]``."""
    prec = torch.get_float32_matmul_precision()
    return CONFIG["fp32_highest"] if prec == "highest" else "tf32"


#: rows and vocabulary columns per tile, the launch's warps and pipeline stages, the backward: "two-pass" (∂h over
#: rows, ∂W and ∂b over the vocabulary: deterministic) or "atomic" (one pass, ∂W and ∂b added with atomics), and the
#: fp32 products at "highest": "tf32x3" (three TF32 products on tensor cores, an error near fp32's) or "ieee" (fp32
#: on the CUDA cores: ~25x slower than cuBLAS's head on an H200, benchmarks/lce_kernels.py).
CONFIG = {"BLOCK_N": 64, "BLOCK_V": 64, "num_warps": 4, "num_stages": 2, "backward": "two-pass",
          "fp32_highest": "tf32x3"}


def _blocks(D: int) -> dict:
    blocks = {k: v for k, v in CONFIG.items() if k != "fp32_highest"}
    return {**blocks, "BLOCK_D": max(16, triton.next_power_of_2(D))}


def _dot(h: Tensor):
    # NB: Triton's interpreter multiplies bf16 tiles wrongly (it reads their raw bits): there they are upcast first
    interp = h.device.type != "cuda"
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.float32 if interp else tl.bfloat16}[h.dtype]


def _prec(h: Tensor) -> str:
    # NB: tf32 applies to fp32 inputs only; half inputs multiply exactly into fp32 accumulators
    return precision() if h.dtype == torch.float32 else "ieee"


def lce_forward_triton(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
                       label_smoothing: float) -> tuple[Tensor, Tensor]:
    """(loss [N], lse [N]) in fp32 (see :func:`.ref.lce_forward_ref`)."""
    N, D = h.shape
    V = weight.shape[0]
    # NB: the kernels read the targets as [N] rows one apart and the bias as [V] entries one apart (a column of a
    # [V, 2] parameter, a scalar expanded to [V], would be read out of place)
    target, bias = target.contiguous(), None if bias is None else bias.contiguous()
    loss = torch.empty(N, dtype=acc_dtype(h), device=h.device)
    lse = torch.empty_like(loss)
    blocks = _blocks(D)
    del blocks["backward"]
    _lce_fwd_kernel[(triton.cdiv(N, blocks["BLOCK_N"]),)](
        h, weight, h if bias is None else bias, target, loss, lse, N, V, D, *h.stride(), *weight.stride(),
        ignore_index, EPS=float(label_smoothing), HAS_BIAS=bias is not None, PREC=_prec(h), DOT=_dot(h),
        **blocks)
    return loss, lse


def lce_backward_triton(g_loss: Tensor | None, g_lse: Tensor | None, h: Tensor, weight: Tensor, bias: Tensor | None,
                        target: Tensor, lse: Tensor, ignore_index: int, label_smoothing: float,
                        need_weight: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(∂h, ∂weight, ∂bias) (see :func:`.ref.lce_backward_ref`)."""
    N, D = h.shape
    V = weight.shape[0]
    zero = lse.new_zeros(())
    g_loss = zero.expand(N) if g_loss is None else g_loss
    g_lse = zero.expand(N) if g_lse is None else g_lse
    # NB: strides of a 0-stride expand: the kernels read the rows' cotangents as contiguous [N]
    g_loss, g_lse, target, lse = g_loss.contiguous(), g_lse.contiguous(), target.contiguous(), lse.contiguous()
    bias = None if bias is None else bias.contiguous()
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=h.device) if need_weight else None
    db = None if bias is None or not need_weight else torch.empty(V, dtype=bias.dtype, device=h.device)
    common = dict(EPS=float(label_smoothing), HAS_BIAS=bias is not None, PREC=_prec(h), DOT=_dot(h), **_blocks(D))
    atomic = common.pop("backward") == "atomic" and need_weight
    BN, BV = common["BLOCK_N"], common["BLOCK_V"]
    b = h if bias is None else bias
    if atomic:
        dw32 = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        db32 = torch.zeros(V, dtype=torch.float32, device=h.device)
        _lce_dh_kernel[(triton.cdiv(N, BN),)](
            h, weight, b, target, lse, g_loss, g_lse, dh, dw32, db32, N, V, D, *h.stride(), *weight.stride(),
            *dh.stride(), ignore_index, ATOMIC=True, **common)
        return dh, dw32.to(weight.dtype), None if bias is None else db32.to(bias.dtype)
    _lce_dh_kernel[(triton.cdiv(N, BN),)](
        h, weight, b, target, lse, g_loss, g_lse, dh, dh, dh, N, V, D, *h.stride(), *weight.stride(), *dh.stride(),
        ignore_index, ATOMIC=False, **common)
    if not need_weight:  # NB: a frozen head: the products that make ∂W are skipped
        return dh, None, None
    _lce_dw_kernel[(triton.cdiv(V, BV),)](
        h, weight, b, target, lse, g_loss, g_lse, dw, dh if db is None else db, N, V, D, *h.stride(),
        *weight.stride(), *dw.stride(), ignore_index, **common)
    return dh, dw, db
