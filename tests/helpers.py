"""Helpers shared by the pass-level tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import copy

import torch


def grab_graph(fn, *args, dynamic=False):
    """The one dynamo graph of ``fn(*args)`` (fullgraph) and the example inputs dynamo passed with it."""
    got = []

    def grab(gm, ex):
        got.append((gm, ex))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True, dynamic=dynamic)(*args)
    assert len(got) == 1
    return got[0]


def trace(fn, *args, dynamic=False):
    """The dynamo graph of ``fn(*args)``."""
    return grab_graph(fn, *args, dynamic=dynamic)[0]


def oracle_scan(a, b, h0=None, dim=1, W=1, reverse=False):
    """h^W_t, recomputed for every t from h_{t-W}.detach() (h0 if t - W < 0) over the last W steps."""
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    if reverse:
        a, b = a.flip(0), b.flip(0)
    T = a.shape[0]
    start = torch.zeros_like(b[0]) if h0 is None else h0.expand_as(b[0])
    full, h = [], start
    for t in range(T):
        h = a[t] * h + b[t]
        full.append(h)
    out = []
    for t in range(T):
        x = full[t - W].detach() if t - W >= 0 else start
        for i in range(max(0, t - W + 1), t + 1):
            x = a[i] * x + b[i]
        out.append(x)
    h = torch.stack(out, 0)
    return (h.flip(0) if reverse else h).movedim(0, dim)


class StepLoop(torch.nn.Module):
    """h_t = sigmoid(a(x_t)) * h_{t-1} + b(x_t) written as a Python loop over time from ``torch.zeros_like(b[:, 0])``
    (a state made like one step of the input)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.a(x)), self.b(x)
        h, hs = torch.zeros_like(b[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + b[:, t]
            hs.append(h)
        return torch.stack(hs, 1)


def generic_regions(step):
    """The length-generic region modules (one lowering for every length) of a compiled function's graphs."""
    import adjoint_compile as ac
    from adjoint_compile.runtime.length_generic import LengthGenericRegion

    out = []
    for rec in ac.report(step).compiled:
        fn = getattr(rec.fn, "generic", None)
        fn = getattr(fn, "fn", fn)  # under the first-call check
        if fn is not None:
            out += [m for m in fn.modules() if isinstance(m, LengthGenericRegion)]
    return out


def compiled_matches_eager(model, *inputs, loss=None, options=None, tol=1e-10):
    """``model`` (and ``loss`` of its output, when given) compiled with backend="adjoint" and run once, against a deep
    copy of it run eagerly: the value and every parameter's gradient agree to ``tol`` (a frozen parameter has none in
    both). Returns the compiled callable, for its report."""
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    # NB: without a loss the model itself is compiled (its own forward's loops roll through a frame around it)
    f = torch.compile(model if loss is None else lambda *xs: loss(model(*xs)), backend="adjoint",
                      options=options or {"shard_size": 4, "inner": "aot_eager"})
    got, want = f(*inputs), (loss or (lambda y: y))(ref(*inputs))
    got.backward()
    want.backward()
    assert (got - want).abs().max() <= tol, (got, want)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), k
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() <= tol, (k, (p.grad - q.grad).abs().max())
    return f


def stack_inputs(tokens: bool, t: int, b: int, d: int, v: int) -> tuple:
    """A stacked-RNN test's inputs of length ``t``, seeded by it: ``(ids, targets)`` (some targets -100) when
    ``tokens``, else ``(x,)`` of shape [b, t, d] in float64."""
    g = torch.Generator().manual_seed(t)
    if tokens:
        y = torch.randint(0, v, (b, t), generator=g)
        y[0, ::4] = -100
        return torch.randint(0, v, (b, t), generator=g), y
    return (torch.randn(b, t, d, generator=g, dtype=torch.float64),)
