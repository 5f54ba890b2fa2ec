"""The one table of torch-level ops: how a dynamo graph spells each op, and the categories the passes key on.

A dynamo graph names one op in several ways: ``torch.add``, ``operator.add``, ``Tensor.add`` (called as a
function), ``x.add`` (a ``call_method`` node), ``torch._C._nn.gelu``, ``F.gelu``... Every spelling of a name listed
here finds that name (:func:`spelling`, :func:`raw_name`); :func:`op_name` also folds synonyms (``truediv`` ->
``div``) and in-place spellings (``iadd`` -> ``add``) into one canonical name, for the affine algebra, which reads
values. The step analysis and the batched re-emission key on the raw names instead: an in-place op or a synonym
that a category does not list is not accepted there (their rules were checked for the spellings listed, no more).

The categories say what each pass may assume of an op; they differ on purpose (each pass proves something
different with them), and each one's comment names its users.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.random import hashed_dropout
from ..kernels.shift import shift_steps
from .fx import callables_named

__all__ = ["spelling", "raw_name", "op_name", "fn_name", "target_name", "name_of", "target_key", "KNOWN"]

#: where torch keeps the callables a dynamo graph calls.
MODULES = (operator, torch, F, torch._C._nn, torch.special, torch.Tensor, torch._C._VariableFunctions)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# --------------------------------------------------------------------------------------------------------------
# step analysis (analysis/time_local.py): ops grouped by the rule that moves the step axis through them

#: elementwise with numpy broadcasting.
POINTWISE = _names("""add sub rsub mul div true_divide truediv floordiv floor_divide mod remainder fmod pow
float_power neg pos abs absolute exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan tanh sinh cosh asin acos
atan atan2 arcsin arccos arctan sigmoid logit relu relu6 gelu silu mish softplus softsign elu selu celu leaky_relu
hardtanh hardswish hardsigmoid logsigmoid tanhshrink softshrink hardshrink threshold clamp clip clamp_min clamp_max
where maximum minimum fmax fmin reciprocal square sign sgn floor ceil round trunc frac lerp addcmul addcdiv eq ne lt
le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not and_ or_ xor
invert erf erfc erfinv nan_to_num masked_fill xlogy hypot copysign heaviside isnan isinf isfinite signbit
real imag complex polar conj conj_physical angle""")
#: the output has the shape of the first argument: casts, copies, ``*_like``.
SAME_SHAPE = _names("""to type type_as float half double bfloat16 int long bool contiguous clone detach cpu cuda
zeros_like ones_like empty_like full_like requires_grad_ alias resolve_conj resolve_neg""")
#: plain numbers about a tensor (no step axis).
METADATA = _names("size dim numel stride is_contiguous element_size nelement")
#: new tensors of a given size that read only the dtype and device of the tensor they are called on.
NEW_FACTORIES = _names("new_zeros new_ones new_full new_empty")
#: draw from torch's generator (a shard's recomputation would draw other numbers).
RANDOM = _names("rand_like randn_like randint_like bernoulli multinomial normal poisson")
DROPOUT = _names("dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout")
MATMULS = _names("matmul mm bmm")
#: reductions ``op(x, dim, keepdim)``; ``max``/``min`` of two tensors are elementwise.
REDUCTIONS = _names("""sum mean amax amin prod std var nansum nanmean logsumexp all any argmax argmin count_nonzero
std_mean var_mean max min median nanmedian mode""")
#: shape-preserving ops along one dim ``op(x, dim)``.
ALONG_DIM = _names("softmax log_softmax cumsum cumprod cummax cummin logcumsumexp sort argsort")
#: layout ops and layers with a rule each, one family a line.
NORM_LAYERS, RESHAPES, EXPANDS, TRANSPOSES, MOVEDIMS, SPLITS, CATS, CONVS = map(_names, """
layer_norm rms_norm
view reshape flatten unflatten view_as reshape_as
expand expand_as broadcast_to
transpose swapaxes swapdims t
movedim moveaxis
split chunk tensor_split
cat concat concatenate
conv1d conv2d conv3d conv_transpose1d conv_transpose2d""".strip().splitlines())
#: a complex tensor as real pairs in a new last dim of 2, and back (``x.real`` / ``x.imag`` are attribute reads:
#: :data:`COMPLEX_PARTS`).
COMPLEX_VIEWS = _names("view_as_real view_as_complex")
#: attributes of a tensor read as ``getattr(x, name)`` nodes that act on each element alone.
COMPLEX_PARTS = _names("real imag")
#: repeat each element along one dim (Mamba-2's groups of B and C spread over the heads)
REPEATS = _names("repeat_interleave")
#: losses over rows (analysis/losses.py): one loss per row, or their sum or mean.
LOSS_OPS = _names("cross_entropy nll_loss")
#: ops with a rule of their own.
SINGLE = _names("""linear einsum norm normalize flip roll topk permute unsqueeze squeeze select narrow index_select gather
unbind stack getitem""")
#: spellings found as these objects only (``F.pad``, not ``torch._C._nn.pad``), keyed by the object.
EXPLICIT: dict[Any, str] = {F.pad: "pad", torch.linalg.vector_norm: "vector_norm", hashed_dropout: "hashed_dropout",
                             shift_steps: "shift_steps"}

# --------------------------------------------------------------------------------------------------------------
# affine algebra and recognition (analysis/affine.py, passes/match/unrolled.py, passes/match/find_residuals.py)

#: ops that keep a value affine in a carried value (with a carry-free other operand): a sum-like state update,
#: and the linear expansion under it.
STATE_OPS = _names("add sub rsub mul div neg addcmul lerp")
LINEAR_IN_CARRY = STATE_OPS | _names("clone contiguous pos")
#: selects by a mask: affine in the carry when the mask is free of it (a state reset, ``where(done, 0, h)``).
SELECT_OPS = _names("where masked_fill")
#: values that read only a tensor's shape: constants in the affine algebra (``zeros_like(h)``).
FILL_LIKE = _names("zeros_like ones_like full_like")
#: the anchors of a residual layer ``x + g(x)``.
SUM_OPS = _names("add sub addcmul")
#: nonlinear state updates of an unrolled loop (``tanh(W h + x)``), linked to their previous state by op.
NONLINEAR_STATE = _names("tanh sigmoid relu gelu silu softplus elu leaky_relu hardtanh layer_norm rms_norm softsign "
                         "mish")
#: normalizations after a residual sum (post-LN), and the pieces of a hand-written RMS norm.
RESIDUAL_NORMS = _names("layer_norm rms_norm group_norm normalize")
RMS_PARTS = _names("pow square mul mean rsqrt sqrt var to float type_as sub add")
#: synonyms (a spelling -> the canonical name of the same op).
SYNONYMS = {"truediv": "div", "true_divide": "div", "negative": "neg"}
#: in-place spellings -> their op: the same value, so the affine algebra folds them (the step analysis does not).
INPLACE = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div", "relu_": "relu"}

# --------------------------------------------------------------------------------------------------------------
# batched re-emission of a step for all steps at once (passes/capture/batching.py): exact under a leading step axis

BATCH_POINTWISE = _names("""add sub rsub mul div truediv true_divide floordiv neg pos clone contiguous sigmoid tanh exp
exp2 expm1 log log1p log2 relu gelu silu softplus abs sqrt rsqrt sin cos square pow reciprocal clamp clamp_min
clamp_max elu leaky_relu logsigmoid mish softsign hardtanh where maximum minimum float double half bfloat16 to type_as
sign erf lerp real imag complex polar conj conj_physical angle resolve_conj resolve_neg eq ne lt le gt ge logical_and
logical_or logical_not logical_xor long int bool mod remainder type""")
#: basic indexing (ints, slices, None, ``...``): a leading full slice keeps the step axis.
BATCH_INDEX = _names("getitem")
#: ops with dim arguments (position, keyword) that index a per-step tensor: shifted by one when batched.
BATCH_DIM_ARGS: dict[str, tuple[tuple[int, str], ...]] = {
    "softmax": ((1, "dim"),), "log_softmax": ((1, "dim"),), "sum": ((1, "dim"),), "mean": ((1, "dim"),),
    "amax": ((1, "dim"),), "amin": ((1, "dim"),), "argmax": ((1, "dim"),), "argmin": ((1, "dim"),),
    "logsumexp": ((1, "dim"),), "cumsum": ((1, "dim"),),
    "unsqueeze": ((1, "dim"),), "squeeze": ((1, "dim"),), "transpose": ((1, "dim0"), (2, "dim1")),
}
BATCH_VIEWS = _names("view reshape")
#: act on trailing feature dims only: a leading step axis is a batch dim.
BATCH_FEATURE_OPS = _names("layer_norm rms_norm linear view_as_real view_as_complex")
BATCH_MATMULS = _names("matmul")
#: an einsum with an explicit output: the step axis is one more subscript of the per-step operands and the output.
BATCH_EINSUM = _names("einsum")
#: a loss of the step's rows (passes/capture/batching_losses.py): its rows and targets flattened with the step axis.
BATCH_LOSSES = _names("cross_entropy nll_loss")
BATCHABLE = (BATCH_POINTWISE | frozenset(BATCH_DIM_ARGS) | BATCH_VIEWS | BATCH_FEATURE_OPS | BATCH_MATMULS | BATCH_INDEX
             | BATCH_LOSSES | BATCH_EINSUM)

# --------------------------------------------------------------------------------------------------------------
# the spellings

#: every name of the table.
KNOWN: frozenset[str] = frozenset().union(
    POINTWISE, SAME_SHAPE, METADATA, NEW_FACTORIES, RANDOM, DROPOUT, MATMULS, REDUCTIONS, ALONG_DIM, NORM_LAYERS, RESHAPES,
    EXPANDS, TRANSPOSES, MOVEDIMS, SPLITS, CATS, CONVS, COMPLEX_VIEWS, REPEATS, LOSS_OPS, SINGLE, EXPLICIT.values(),
    LINEAR_IN_CARRY, SELECT_OPS, FILL_LIKE, SUM_OPS, NONLINEAR_STATE, RESIDUAL_NORMS, RMS_PARTS, SYNONYMS, INPLACE, BATCHABLE)

_SPELLED: dict[Any, str] = dict(EXPLICIT)
for _name in sorted(KNOWN - set(EXPLICIT.values())):
    for _obj in callables_named(_name, MODULES):
        # NB: no object of these modules is found under two names of the table, so the order does not matter
        _SPELLED.setdefault(_obj, _name)


def spelling(target: Any) -> str | None:
    """The table's name of a called object (``operator.add``, ``torch.add``, ``Tensor.add`` -> ``"add"``)."""
    try:
        return _SPELLED.get(target)
    except TypeError:  # unhashable target
        return None


def raw_name(n: Any) -> str | None:
    """The op of a node as spelled: a method's name, the table's name of a function, an aten overload's packet
    name; None for placeholders, unknown functions and non-nodes."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return str(n.target)
    if n.op != "call_function":
        return None
    name = spelling(n.target)
    if name is None and isinstance(n.target, torch._ops.OpOverload):
        name = n.target.overloadpacket.__name__
    return name


def op_name(n: Any) -> str | None:
    """Canonical name of a node's op, synonyms and in-place spellings folded (``x.iadd``, ``operator.truediv`` ->
    ``"add"``, ``"div"``); None for placeholders, unknown functions and non-nodes."""
    name = raw_name(n)
    if name is None:
        return None
    return SYNONYMS.get(name) or INPLACE.get(name, name)


def fn_name(n: fx.Node) -> str:
    """A method's name or a function's ``__name__`` (``""`` when it has none), for ops outside the table."""
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")


def target_name(n: fx.Node) -> str:
    """A node's target as spelled, outside the table: a method's or attribute's name, a function's ``__name__``."""
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def name_of(n: fx.Node) -> str:
    """:func:`op_name`, else :func:`fn_name`: a name for any op."""
    return op_name(n) or fn_name(n)


#: words in the name of an op that draws from torch's generator (``rand``, ``randn_like``, ``x.uniform_``, dropout)
RANDOM_WORDS = ("dropout", "rand", "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential",
                "geometric", "cauchy", "rrelu")
#: names holding such a word that draw nothing (``F.normalize``): read as random, they switched the first-call check off
_NOT_RANDOM = ("normalize",)


def draws_random(n: fx.Node) -> bool:
    """Whether the node draws random numbers: a recomputation draws others, and so does another compiler."""
    if n.op not in ("call_function", "call_method"):
        return False
    name = name_of(n)
    for w in _NOT_RANDOM:
        name = name.replace(w, "")
    if "dropout" in name and n.op == "call_function" and n.target in _DROPOUTS and \
            (n.args[2] if len(n.args) > 2 else n.kwargs.get("training", n.kwargs.get("train", True))) is False:
        return False  # NB: in eval mode (``training=False``) a dropout is the identity and draws nothing
    return any(w in name for w in RANDOM_WORDS)


#: torch's dropouts of signature (input, p, training, ...)
_DROPOUTS = frozenset({F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                       torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout})


def target_key(n: fx.Node) -> str:
    """A stable, address-free string for a node's op and target (``str(torch.add)`` contains an address)."""
    t = n.target
    if isinstance(t, str):
        return f"{n.op}:{t}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    return f"{n.op}:{mod}.{name}"
