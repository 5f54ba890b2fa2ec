"""``nn.MultiheadAttention`` under ``per_sample_clip``: its one call lowered into per-example book-keeping of its
projections (passes/lower/per_sample.py lowers every other parameter use)."""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...analysis.fx import example_value as _val
from ...runtime.per_sample import PerSampleCall
from .per_sample_axes import refuse as _refuse
from .per_sample_loss import direct_param

__all__ = ["lower_attention"]


def lower_attention(low: Any, n: fx.Node) -> fx.Node:
    """``nn.MultiheadAttention``'s one call: projections with book-keeping around the attention (its [T, B, E]
    layout puts the examples on axis 1)."""
    a = inspect.signature(F.multi_head_attention_forward).bind(*n.args, **n.kwargs)
    a.apply_defaults()
    args = dict(a.arguments)
    for extra in ("bias_k", "bias_v", "static_k", "static_v"):
        if args[extra] is not None:
            raise _refuse(n, f"uses {extra}: not supported under per_sample_clip (per-example gradients of the "
                             "attention's projections only)")
    if args["add_zero_attn"]:
        raise _refuse(n, "uses add_zero_attn: not supported under per_sample_clip")
    for key in ("query", "key", "value"):
        v = _val(args[key])
        if not (isinstance(v, torch.Tensor) and v.dim() == 3 and int(v.shape[1]) == low.batch):
            raise _refuse(n, f"takes a {key} of shape {tuple(getattr(v, 'shape', ()))} without the {low.batch} "
                             "examples on its axis 1 ([T, B, E]: batch_first inputs, transposed by the module, "
                             "or sequence-first ones with batch_dim=1): its gradient cannot be attributed to "
                             "examples")
    names = tuple(k for k, v in args.items() if isinstance(v, fx.Node))
    consts = {k: v for k, v in args.items() if not isinstance(v, fx.Node)}
    params = [args[k] for k in names if low.kind_of.get(args[k]) == "P"]
    if not all(direct_param(p, low.kind_of) for p in params):
        raise _refuse(n, "takes a projection weight computed from parameters: per_sample_clip supports "
                         "nn.MultiheadAttention's own parameters")
    site = low._site(n, "attention", params)
    site.batch_dim = 1
    if site.tied and not args["use_separate_proj_weight"]:
        raise _refuse(n, "shares its packed in_proj_weight with another use: not supported under "
                         "per_sample_clip")
    return low._call(n, PerSampleCall(site, "attention", names=names, consts=consts),
                      tuple(args[k] for k in names), "attention", params,
                      form="q/k/v/out projections (gram or direct per slice), attention without parameters")

