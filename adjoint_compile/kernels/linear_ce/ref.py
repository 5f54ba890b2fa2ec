"""The vocabulary head and cross-entropy of a row of hidden states, fused: the torch reference (the spec the
Triton kernels are tested against, and the path wherever they do not run).

For row n with hidden state h_n [D], target t_n and the head (W [V, D], b [V]), the logits z_n = W h_n + b and

    lse_n  = log Σ_v exp(z_n,v)
    loss_n = lse_n − (1 − ε) z_n,t_n − ε · mean_v z_n,v          (0 where t_n = ignore_index)

which is ``F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=ε, reduction="none")`` row by row, and
``torch.logsumexp(z, -1)``. The backward takes the cotangents of both (g_loss, g_lse [N]) and, with p_n = softmax(z_n)
and m_n = [t_n ≠ ignore_index],

    ∂z_n = g_loss_n · m_n · (p_n − (1 − ε) onehot(t_n) − ε / V) + g_lse_n · p_n
    ∂h = ∂z W,   ∂W = ∂zᵀ h,   ∂b = Σ_n ∂z_n

recomputing z from h, W and b: only lse is kept between the two, never the [N, V] logits.

Shapes: h [N, D], weight [V, D], bias [V] or None, target [N] (int64), loss and lse [N] in the compute dtype
(fp64 for fp64 inputs, else fp32); the gradients in the dtypes of h, weight and bias. This reference makes one
block of rows of logits at a time (``ROWS`` logits, ``ROWS_GPU`` on a GPU), so its memory is bounded whatever N is.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["acc_dtype", "check_targets", "lce_forward_ref", "lce_backward_ref", "ROWS", "ROWS_GPU"]

#: the most logits (elements) the reference makes at once (4 MiB in fp32): a block of ROWS // V rows, at least 16
ROWS = 1 << 20

#: the same on a GPU (64 MiB in fp32), where a block's dozen kernel launches cost more than its arithmetic: on an
#: H200 (N = 16384, V = 32000, d = 64, forward and backward) 4 MiB blocks took 255 ms, 64 MiB blocks 21 ms (eager's
#: unchunked head and loss: 9.4 ms)
ROWS_GPU = 1 << 24


def _rows(V: int, device: torch.device) -> int:
    return max(16, (ROWS if device.type == "cpu" else ROWS_GPU) // max(1, V))


def acc_dtype(h: Tensor) -> torch.dtype:
    """The compute dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if h.dtype == torch.float64 else torch.float32


def check_targets(target: Tensor, V: int, ignore_index: int) -> None:
    """Raise as ``F.cross_entropy`` does for a target outside [0, V) that is not ``ignore_index``."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        raise IndexError(f"Target {int(target[bad][0])} is out of bounds (the vocabulary has {V} classes)")


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype) -> Tensor:
    z = h.to(acc) @ weight.to(acc).T
    return z if bias is None else z + bias.to(acc)


def lce_forward_ref(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
                    label_smoothing: float) -> tuple[Tensor, Tensor]:
    """(loss [N], lse [N]) of the head and cross-entropy (module docstring)."""
    if h.device.type == "cpu":  # NB: elsewhere a check would synchronize: the row's loss is NaN instead
        check_targets(target, weight.shape[0], ignore_index)
    acc = acc_dtype(h)
    loss = torch.empty(h.shape[0], dtype=acc, device=h.device)
    lse = torch.empty_like(loss)
    R = _rows(weight.shape[0], h.device)
    for s in range(0, h.shape[0], R):
        z = _logits(h[s:s + R], weight, bias, acc)
        t = target[s:s + R]
        valid = t != ignore_index
        lse[s:s + R] = torch.logsumexp(z, -1)
        # NB: an out-of-range target reads class 0 here; it raised above on a CPU and is NaN elsewhere, as in the kernels
        zt = z.gather(1, torch.where(valid & (t >= 0) & (t < z.shape[1]), t, 0)[:, None])[:, 0]
        row = lse[s:s + R] - (1 - label_smoothing) * zt
        if label_smoothing:
            row = row - label_smoothing * z.mean(-1)
        row = torch.where((t >= 0) & (t < z.shape[1]), row, float("nan"))
        loss[s:s + R] = torch.where(valid, row, 0)
    return loss, lse


def lce_backward_ref(g_loss: Tensor | None, g_lse: Tensor | None, h: Tensor, weight: Tensor, bias: Tensor | None,
                     target: Tensor, lse: Tensor, ignore_index: int, label_smoothing: float,
                     need_weight: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(∂h, ∂weight, ∂bias) for the cotangents of loss and lse (None: zero), from the kept lse (module docstring);
    without ``need_weight``, (∂h, None, None)."""
    acc = acc_dtype(h)
    V = weight.shape[0]
    dh = torch.empty(h.shape, dtype=acc, device=h.device)
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_weight else None
    db = None if bias is None or not need_weight else torch.zeros(V, dtype=acc, device=h.device)
    R = _rows(V, h.device)
    w = weight.to(acc)
    for s in range(0, h.shape[0], R):
        hs = h[s:s + R].to(acc)
        t = target[s:s + R]
        # NB: in place on the block of logits: p, then ∂z = (c + g_lse)·p − c·ε/V − (1 − ε)·c·onehot
        dz = _logits(hs, weight, bias, acc).sub_(lse[s:s + R, None]).exp_()
        c = torch.zeros(dz.shape[0], 1, dtype=acc, device=h.device)
        if g_loss is not None:
            c = (g_loss[s:s + R].to(acc) * (t != ignore_index))[:, None]
        dz.mul_(c + (0 if g_lse is None else g_lse[s:s + R].to(acc)[:, None]))
        if g_loss is not None:
            if label_smoothing:
                dz.sub_(c * (label_smoothing / V))
            hit = (t != ignore_index) & (t >= 0) & (t < V)
            dz.scatter_add_(1, torch.where(hit, t, 0)[:, None], -(1 - label_smoothing) * c * hit[:, None])
        torch.mm(dz, w, out=dh[s:s + R])
        if dw is not None:
            dw.addmm_(dz.T, hs)
        if db is not None:
            db += dz.sum(0)
    return dh.to(h.dtype), None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)
