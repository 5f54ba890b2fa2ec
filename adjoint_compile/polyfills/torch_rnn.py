"""``nn.GRU`` / ``nn.LSTM`` in highway mode: the fused ``torch.gru`` / ``torch.lstm`` call written as its cell
equations, one torch ``scan`` per layer, with the module's own weights.

Dynamo leaves these modules out of its graph by default: wrapping one raises "Attempted to wrap RNN, GRU, or LSTM"
unless ``torch._dynamo.config.allow_rnn`` (a graph break: the module runs natively). Two small hooks change that
only while dynamo traces for ``backend="adjoint"`` with ``mode="highway"`` (:func:`~adjoint_compile.polyfills.
traced_mode`):

* ``VariableBuilder.wrap_module`` wraps an ``nn.GRU`` / ``nn.LSTM`` under ``allow_rnn=True``, so dynamo traces the
  module's own ``forward`` (hx defaults, unbatched inputs) up to its ``_VF.gru`` / ``_VF.lstm`` call;
* that call has a handler among dynamo's ``TorchInGraphFunctionVariable`` handlers, which inlines :func:`gru` /
  :func:`lstm` instead of recording the fused op. NB: ``substitute_in_graph`` refuses ``torch.gru`` (dynamo already
  has a rule for it), and a module's ``forward`` is traced from its code, not looked up among polyfills.

A form the decomposition does not cover (bidirectional, ``proj_size``, dropout between layers while training, a
``PackedSequence``) is a graph break whose reason names it (``explain()`` lists it): the module then runs natively,
with exact gradients, as before. In exact and truncated modes the module runs natively too (a gated recurrence has no
rewrite there): a WARNING per torch.compile and the reports (explain and report) say why and that mode='highway'
rewrites it. For every other backend neither hook does anything.

The step is written as ``examples/gru_scan.py`` and the LSTM test's ``LSTMScan`` are, so the highway split is the
same: GRU h' = z ⊙ h + (1 - z) ⊙ n (K = diag(z)); LSTM c' = f ⊙ c + i ⊙ g (K = diag(f)) beside h' = o ⊙ tanh(c').
Registration first runs the decomposition (its step in a Python loop) against ``torch.gru`` / ``torch.lstm`` on
random inputs, every flag combination (bias, batch_first, 1 or 2 layers, h0 zero or not, T = 1 and 5).
"""
from __future__ import annotations

import functools
import itertools
import logging
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import _FORCE, traced_mode, traced_options
from .common import output_error, refuse_if_different

log = logging.getLogger(__name__)

__all__ = ["gru", "lstm", "refusal", "register", "ensure_hooks", "take_notes", "LISTENERS"]

NAME = "torch.gru / torch.lstm (nn.GRU, nn.LSTM)"
ORIGINS = {__file__: "adjoint-compile's decomposition of nn.GRU / nn.LSTM (torch.gru / torch.lstm as its cell "
                     "equations, one scan per layer)"}
TOL = 1e-5
GB_TYPE = "adjoint-compile: nn.GRU / nn.LSTM not decomposed"


def _gru_step(w_hh: torch.Tensor, b_hh: torch.Tensor | None) -> Callable[..., Any]:
    def step(h: torch.Tensor, gx_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r_x, z_x, n_x = gx_t.chunk(3, -1)
        r_h, z_h, n_h = F.linear(h, w_hh, b_hh).chunk(3, -1)
        r = torch.sigmoid(r_x + r_h)
        z = torch.sigmoid(z_x + z_h)
        n = torch.tanh(n_x + r * n_h)
        h_new = (1 - z) * n + z * h
        return h_new, h_new.clone()
    return step


def _lstm_step(w_hh: torch.Tensor, b_hh: torch.Tensor | None) -> Callable[..., Any]:
    def step(h: torch.Tensor, c: torch.Tensor, gx_t: torch.Tensor) -> Any:
        i, f, g, o = (gx_t + F.linear(h, w_hh, b_hh)).chunk(4, -1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        return (h_new, c_new), (h_new.clone(), c_new.clone())

    def combine(carry: tuple[torch.Tensor, torch.Tensor], gx_t: torch.Tensor) -> Any:
        return step(*carry, gx_t)
    return combine


def _loop(step: Callable[..., Any], init: Any, xs: torch.Tensor, dim: int) -> Any:
    """torch's scan semantics as a Python loop (the registration check: an eager scan would call torch.compile)."""
    carry, ys = init, []
    for x_t in xs.unbind(dim):
        carry, y = step(carry, x_t)
        ys.append(y)
    if isinstance(ys[0], tuple):
        return carry, tuple(torch.stack(v, dim) for v in zip(*ys))
    return carry, torch.stack(ys, dim)


def _scan(step: Callable[..., Any], init: Any, xs: torch.Tensor, dim: int) -> Any:
    from torch._higher_order_ops.scan import scan
    return scan(step, init, xs, dim=dim)


def _layers(kind: str, x: torch.Tensor, hx: Any, params: Any, has_biases: bool, num_layers: int,
            batch_first: bool, run: Callable[..., Any]) -> Any:
    n = 4 if has_biases else 2
    dim = 1 if batch_first else 0
    last_h, last_c = [], []
    for layer in range(num_layers):
        w = list(params[n * layer:n * (layer + 1)])
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        gx = F.linear(x, w_ih, b_ih)  # every step's input projection at once
        if kind == "gru":
            hT, x = run(_gru_step(w_hh, b_hh), hx[layer], gx, dim)
            last_h.append(hT)
        else:
            (hT, cT), (x, _) = run(_lstm_step(w_hh, b_hh), (hx[0][layer], hx[1][layer]), gx, dim)
            last_h.append(hT)
            last_c.append(cT)
    if kind == "gru":
        return x, torch.stack(last_h)
    return x, torch.stack(last_h), torch.stack(last_c)


def gru(input: torch.Tensor, hx: torch.Tensor, params: Any, has_biases: bool, num_layers: int, dropout: float,
        train: bool, bidirectional: bool, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.gru``'s ``input`` overload (one direction, no dropout) as one scan per layer."""
    return _layers("gru", input, hx, params, has_biases, num_layers, batch_first, _scan)


def lstm(input: torch.Tensor, hx: Any, params: Any, has_biases: bool, num_layers: int, dropout: float,
         train: bool, bidirectional: bool, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.lstm``'s ``input`` overload (one direction, no projection, no dropout) as one scan per layer."""
    return _layers("lstm", input, hx, params, has_biases, num_layers, batch_first, _scan)


def refusal(kind: str, packed: bool, has_biases: bool, num_layers: int, dropout: float, train: bool,
            bidirectional: bool, n_params: int) -> str | None:
    """Why a ``torch.gru`` / ``torch.lstm`` call is not decomposed, or None."""
    mod = "nn.GRU" if kind == "gru" else "nn.LSTM"
    if packed:
        return f"{mod} on a PackedSequence is not decomposed yet; it runs natively (exact gradients)"
    if bidirectional:
        return (f"{mod}(bidirectional=True) is not decomposed yet (its reverse direction would be a second "
                f"recurrence per layer); it runs natively (exact gradients)")
    if dropout > 0 and train and num_layers > 1:
        return (f"{mod} with dropout={dropout:g} between layers while training is not decomposed yet; it runs "
                f"natively (exact gradients)")
    if n_params != (4 if has_biases else 2) * num_layers:
        return f"{mod} with proj_size > 0 is not decomposed yet; it runs natively (exact gradients)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# the check run before registering


def check(kind: str, *, seed: int = 0) -> float:
    """Max rel. error of the decomposition (its step in a Python loop) against ``torch.gru`` / ``torch.lstm``."""
    g = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=g)
    worst, d, H, B = 0.0, 3, 4, 2
    gates = 3 if kind == "gru" else 4
    for bias, bf, layers, h0, T in itertools.product((0, 1), (0, 1), (1, 2), (0, 1), (1, 5)):
        params = []
        for layer in range(layers):
            params += [r(gates * H, d if layer == 0 else H), r(gates * H, H)]
            params += [r(gates * H), r(gates * H)] if bias else []
        x = r(B, T, d) if bf else r(T, B, d)
        hs = [r(layers, B, H) * h0 for _ in range(1 if kind == "gru" else 2)]
        hx = hs[0] if kind == "gru" else tuple(hs)
        fused = torch.gru if kind == "gru" else torch.lstm
        want = fused(x, hx, params, bool(bias), layers, 0.0, False, False, bool(bf))
        got = _layers(kind, x, hx, params, bool(bias), layers, bool(bf), _loop)
        worst = max(worst, output_error(want, got, True))
    return worst


# ---------------------------------------------------------------------------------------------------------------
# the two dynamo hooks


_STATE: dict[str, Any] = {}
#: why an nn.GRU / nn.LSTM met while tracing for backend="adjoint" was not decomposed (explain() lists them as graph
#: breaks: dynamo's own record of a break inside an inlined module call does not reach torch._dynamo.explain).
_NOTES: list[str] = []


#: called with each note made under torch.compile (not explain()); each returns whether the note is new to that
#: torch.compile call. adjoint_compile.explain subscribes, to keep them for report(): this module, of the foundation
#: stage, imports nothing of the later ones.
LISTENERS: list[Callable[[str], bool]] = []


def _note(why: str) -> None:
    """Note a module left native: explain() lists it; under torch.compile it is warned once per compile and kept
    for ``adjoint_compile.report`` (:data:`LISTENERS`)."""
    if why not in _NOTES:
        _NOTES.append(why)
    log.info("adjoint-compile: %s", why)
    if getattr(_FORCE, "on", False):
        return  # NB: explain() traces: it reports, it does not warn
    if all([listen(why) for listen in LISTENERS]):  # NB: every listener called; no listener: warned each time
        log.warning("adjoint-compile: %s", why)


def _left_native(kind: str, mode: str) -> str:
    """Why an nn.GRU / nn.LSTM traced for ``mode`` (not highway) is not rewritten, and what would rewrite it."""
    cell = "h' = (1 - z) * n + z * h" if kind == "GRU" else "c' = f * c + i * g"
    what = "shards" if mode == "exact" else "truncates"
    return (f"nn.{kind} is left out of dynamo's graph (torch._dynamo.config.allow_rnn=False) and not rewritten: "
            f"mode={mode!r} {what} linear recurrences only (h' = a * h + b with a independent of h), and nn.{kind}'s "
            f"cell is nonlinear in its state ({cell} with gates computed from h), so it runs natively with ordinary "
            f"autograd (exact gradients, no memory saved); mode='highway' (options={{'mode': 'highway', "
            f"'iterations': k}}) decomposes it into its cell equations and gives it Highway-BP's backward")


def take_notes() -> list[str]:
    """The refusals noted since the last call (and forget them)."""
    out = list(_NOTES)
    _NOTES.clear()
    return out


def _highway() -> bool:
    return traced_mode() == "highway"


def _wrap_module(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrap_module(self: Any, value: Any) -> Any:
        from torch._dynamo import config
        if isinstance(value, (torch.nn.GRU, torch.nn.LSTM)) and not config.allow_rnn:
            mode = traced_mode()
            clip = (traced_options() or {}).get("per_sample_clip") if mode is not None else None
            if clip is not None and not getattr(_FORCE, "on", False):
                # NB: left out of the graph, its parameters' gradients (and those of everything dynamo then runs
                # eagerly around it) would be summed unclipped, in silence; in highway mode its polyfill's scan
                # returns a tuple of states the per-example book-keeping cannot attribute
                from ..errors import PerSampleError
                how = ("in highway mode its fused call becomes a scan over a tuple of states, which the per-example "
                       "book-keeping cannot attribute to examples" if mode == "highway" else
                       "dynamo leaves it out of the graph (allow_rnn=False), so it runs natively and its parameters "
                       "would get the plain summed gradient")
                raise PerSampleError(
                    f"adjoint-compile: per_sample_clip={clip} cannot clip the gradients of nn."
                    f"{type(value).__name__}: {how}; write the recurrence in the compiled code with its own layers "
                    f"(a loop over time)")
            if mode == "highway":
                with config.patch(allow_rnn=True):
                    return original(self, value)
            if mode is not None:
                _note(_left_native(type(value).__name__, mode))
        return original(self, value)
    wrap_module._adjoint_compile_hook = True  # type: ignore[attr-defined]
    return wrap_module


def _const(v: Any) -> Any:
    if v.is_python_constant():
        return v.as_python_constant()
    try:
        # NB: a module's float passed unspecialized under dynamic=True (the dropout p): read, with a guard on it
        return v.evaluate_expr()
    except Exception:  # noqa: BLE001 - not a symbolic number: unreadable
        return None


def _handler(kind: str) -> Callable[..., Any]:
    poly = gru if kind == "gru" else lstm

    def handle(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if not _highway():
            return None
        from torch._dynamo.exc import unimplemented
        from torch._dynamo.variables import UserFunctionVariable
        packed = len(args) != 9 or not args[3].is_python_constant()  # the data overload: (data, batch_sizes, ...)
        flags = [None] * 5 if packed else [_const(a) for a in args[3:8]]
        n_params = -1
        if not packed and hasattr(args[2], "items"):
            n_params = len(args[2].items)
        why = "unreadable arguments" if kwargs or (not packed and None in flags) else refusal(
            kind, packed, *(flags if not packed else (True, 1, 0.0, False, False)), n_params)
        if why is not None:
            _note(why)
            unimplemented(gb_type=GB_TYPE, context=f"torch.{kind}", explanation=why, hints=[])
        return UserFunctionVariable(poly).call_function(tx, list(args), {})
    handle._adjoint_compile_hook = True  # type: ignore[attr-defined]
    return handle


def ensure_hooks() -> str:
    """Install the two hooks (idempotent; again after anything that rebuilt dynamo's handler table)."""
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable
    if not getattr(VariableBuilder.wrap_module, "_adjoint_compile_hook", False):
        VariableBuilder.wrap_module = _wrap_module(VariableBuilder.wrap_module)
    handlers = TorchInGraphFunctionVariable._get_handlers()
    for kind, fn in (("gru", torch.gru), ("lstm", torch.lstm)):
        have = handlers.get(fn)
        if have is None:
            handlers[fn] = _handler(kind)
        elif not getattr(have, "_adjoint_compile_hook", False):
            return f"not registered: dynamo already handles torch.{kind} itself"
    return "hooks installed"


def register(module: types.ModuleType) -> str:
    """Check the decomposition against ``torch.gru`` / ``torch.lstm`` and install the hooks; returns what was done."""
    if not all(hasattr(module, c) for c in ("GRU", "LSTM")):
        return f"not registered: {module.__name__} has no GRU / LSTM"
    with torch.no_grad():
        err = max(check("gru"), check("lstm"))
    if (why := refuse_if_different(NAME, err, TOL)) is not None:
        return why
    try:
        done = ensure_hooks()
    except (ImportError, AttributeError) as e:  # another torch: the modules keep running natively
        return f"not registered: dynamo's internals differ ({type(e).__name__}: {e})"
    if done != "hooks installed":
        return done
    _STATE["registered"] = True
    return f"registered for nn.GRU / nn.LSTM in highway mode (checked: max rel. error {err:.1e})"


def refresh() -> None:
    """Called when dynamo starts compiling a frame: the handler table is cached and may have been rebuilt."""
    if _STATE.get("registered"):
        ensure_hooks()
