"""Dynamic shapes: a dynamo graph with symbolic sizes, specialized to the concrete sizes of one call.

After a recompile for a new sequence length (or with ``torch.compile(dynamic=True)``) dynamo hands the backend a
graph whose sizes are symbols.  The sharded runtime needs literal lengths (it rewrites T to the shard length in
view/reshape arguments), so such a graph is specialized per call signature and run through the pipeline again:

Before (symbolic)::

    s0: Sym(s0) = placeholder[target=s0]
    x: f32[2, s0, 16] = placeholder[target=x]
    size = x.size(1)                                  # Sym(s0)
    view = h.view(2, size, 64)

After, for a call with T = 96::

    s0 = placeholder[target=s0]                       # kept (callers pass it), unused
    x: f32[2, 96, 16] = placeholder[target=x]
    view = h.view(2, 96, 64)

Every node whose value is a Python number, bool or size tuple is evaluated on the call's shapes (fake tensors of
static shape) and replaced by its literal in its users; the dead size computations are removed; every node's
``example_value``/``val`` is the static fake tensor.  Provenance: ``meta["adjoint_compile"]["specialized_from"]``
on the graph module names the symbolic graph's sizes; a node given a literal records in ``meta["sizes_read"]`` the
(placeholder, dim) sizes it came from (``h / x.shape[1]``: ``{(x's position, 1)}``), which the static graph no longer
shows (sequence parallelism refuses a slice's length used as a number).
"""
from __future__ import annotations

import contextlib
import operator
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ...analysis.fx import SYM_TYPES, eliminate_dead_code, has_symbolic_sizes, in_vmaps

log = logging.getLogger(__name__)

__all__ = ["has_symbolic_sizes", "no_guards", "specialize", "attribute_floats"]


def no_guards(gm: fx.GraphModule) -> Any:
    """A context in which inspecting ``gm``'s symbolic sizes adds no guard to dynamo's shape environment.

    NB: comparing a symbolic size in Python (``T == 17``) makes dynamo guard on it, and a guard that pins T turns
    the graph static again, so every new length would recompile (and dynamo gives up after its recompile limit).
    Recognition of a symbolic graph only decides whether to specialize it per call; the real decisions are made
    again on each static specialization.
    """
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("example_value", n.meta.get("val"))
        syms = [v] if isinstance(v, torch.SymInt) else list(v.shape) if isinstance(v, torch.Tensor) else []
        for s in syms:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env.suppress_guards()
    return contextlib.nullcontext()


def attribute_floats(gm: fx.GraphModule) -> list[int]:
    """The placeholders (by position) that are a module's float attribute passed unspecialized (``dynamic=True``
    makes ``nn.Dropout.p`` a 0-dim tensor input read by ``.item()``). A dropout's probability read so cannot be
    traced with fake values (its range check is a guard on the unknown number); such numbers are constants in
    practice, so a specialization folds them and is keyed by them."""
    out = []
    for i, n in enumerate(p for p in gm.graph.nodes if p.op == "placeholder"):
        v = n.meta.get("example_value", n.meta.get("val"))
        src = getattr(n.meta.get("grapharg"), "source", None)
        if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point() and \
                type(src).__name__ == "AttrSource" and n.users and \
                all(u.op == "call_method" and u.target == "item" for u in n.users) and \
                not all(_arith_with_tensor(w, u) for u in n.users for w in u.users):
            out.append(i)  # NB: one only ever added to tensors (an eps) stays a run-time value, fed as a tensor
    return out


def _literal(v: Any) -> bool:
    if isinstance(v, (bool, int, float)):
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in v)


#: binary arithmetic whose result is the same with a 0-dim floating tensor in place of a Python float, when the
#: other operand is a floating tensor with dims (it then decides the result's dtype either way)
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul, torch.div,
          "add", "sub", "mul", "div"}


def _scalar_items_as_tensors(graph: fx.Graph) -> int:
    """``x + t.item()`` -> ``x + t`` for a 0-dim floating tensor ``t`` and a floating tensor ``x`` with dims.

    NB: with dynamic=True dynamo turns a float attribute (an RMSNorm's eps) into a 0-dim float64 input and reads
    it with ``.item()``; the number is unknown until run time, so it could only enter a sharded region as a Python
    scalar. Fed as the tensor itself, the arithmetic gives the same values and the region takes it as an input.
    """
    done = 0
    for n in list(graph.nodes):
        t = n.args[0] if n.op == "call_method" and n.target == "item" and n.args else None
        tv = t.meta.get("val", t.meta.get("example_value")) if isinstance(t, fx.Node) else None
        if not (isinstance(tv, torch.Tensor) and tv.ndim == 0 and tv.is_floating_point()):
            continue
        users = list(n.users)
        if not users or not all(_arith_with_tensor(u, n) for u in users):
            continue
        for u in users:
            u.args = fx.node.map_arg(u.args, lambda x: t if x is n else x)
            u.kwargs = fx.node.map_arg(u.kwargs, lambda x: t if x is n else x)
        done += 1
    return done


def float_args_as_tensors(gm: fx.GraphModule) -> int:
    """:func:`_scalar_items_as_tensors` in a graph dynamo made: a float argument that changed between calls (a
    temperature or loss-scale schedule) comes as a 0-dim tensor read by ``.item()``; the sharded region takes tensors
    only, so a loss scaled so ended its region before the loss, keeping the logits. Returns how many."""
    done = _scalar_items_as_tensors(gm.graph)
    if done:
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
        log.debug("capture: %d float argument(s) fed to tensor arithmetic as the 0-dim tensors dynamo passes", done)
    return done


def _arith_with_tensor(u: fx.Node, item: fx.Node) -> bool:
    if u.target not in _ARITH or u.kwargs or len(u.args) != 2:
        return False
    other = u.args[1] if u.args[0] is item else u.args[0]
    ov = other.meta.get("val", other.meta.get("example_value")) if isinstance(other, fx.Node) else None
    return isinstance(ov, torch.Tensor) and ov.ndim >= 1 and ov.is_floating_point()


class _Propagate(FakeTensorProp):
    """Fake propagation that records every node's Python number, bool or size tuple in ``meta["val"]``.

    NB: FakeTensorProp before torch 2.13 records tensors and symbolic numbers only (a plain int became None), so
    a size computation on the now static shapes kept no literal to fold and stayed an input of the region."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if _literal(result):
            n.meta["val"] = fx.node.map_aggregate(result, lambda x: x)
        else:
            # NB: FakeTensorProp records detached snapshots; dynamo's example values say which values have grad (the
            # no_grad block pass reads it: a buffer written under no_grad kept the step's graph)
            flags = [getattr(x, "requires_grad", False) for x in pytree.tree_leaves(result)]
            vals = pytree.tree_leaves(n.meta.get("val"))
            # NB: not inside a vmap (a generic associative_scan's combines): functorch refuses requires_grad_ there
            if any(flags) and len(vals) == len(flags) and torch._C._functorch.maybe_current_level() is None:
                for v, f in zip(vals, flags):
                    if f and isinstance(v, torch.Tensor) and v.is_leaf and not v.requires_grad:
                        v.requires_grad_(True)
        return result


def _sizes_read(gm: fx.GraphModule) -> dict[fx.Node, frozenset[tuple[int, int]]]:
    """For each node of the symbolic graph ``gm`` whose value is a symbolic number: the (placeholder position, dim)
    sizes its symbols stand for."""
    places: dict[Any, set[tuple[int, int]]] = {}
    for i, n in enumerate(p for p in gm.graph.nodes if p.op == "placeholder"):
        v = n.meta.get("example_value", n.meta.get("val"))
        for d, size in enumerate(v.shape if isinstance(v, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                places.setdefault(size.node.expr, set()).add((i, d))
    out = {}
    for n in gm.graph.nodes:
        v = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(v, SYM_TYPES):
            out[n] = frozenset(pd for s in v.node.expr.free_symbols for pd in places.get(s, ()))
    return out


def specialize(gm: fx.GraphModule, args: Sequence[Any], values: Sequence[int] = ()) -> fx.GraphModule:
    """A copy of ``gm`` with every size literal for these call arguments (real tensors and Python numbers), and
    the numbers read from the 0-dim tensors ``args[i]`` for i in ``values`` (:func:`attribute_floats`).

    Raises whatever fake propagation raises when the graph does not run on these arguments.
    """

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    new = fx.GraphModule(gm, g)
    # NB: a shape environment, so that a value read from tensor data (``.item()`` of a float attribute that
    # dynamic=True turned into a 0-dim tensor input) is an unbacked symbol that stays a run-time node, not an error
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    holders = [n for n in new.graph.nodes if n.op == "placeholder"]
    for i in values:  # NB: the number itself in place of its .item(), before propagation guards on it
        for item in list(holders[i].users):
            for user in list(item.users):
                user.args = fx.node.map_arg(user.args, lambda x: float(args[i]) if x is item else x)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda x: float(args[i]) if x is item else x)
            new.graph.erase_node(item)
    reads = _sizes_read(new)
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    level = torch._C._functorch.maybe_current_level()
    try:
        _Propagate(new, mode).propagate_dont_convert_inputs(*fakes)
    finally:
        # NB: a failure between a vmap's increment and decrement nodes would leave the process inside that vmap
        while (torch._C._functorch.maybe_current_level() or 0) > (level or 0):
            torch._C._functorch._vmap_decrement_nesting()
    for n, a in zip([n for n in new.graph.nodes if n.op == "placeholder"], args):
        v = n.meta.get("val")
        if isinstance(a, torch.nn.Parameter) and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            # NB: a parameter's value is a Parameter, as in dynamo's graphs: per_sample_clip's lowering tells the
            # parameters by it (a sharded region's parameters were taken for activations in specializations)
            n.meta["val"] = torch.nn.Parameter(v, requires_grad=a.requires_grad)
    folded = 0
    for n in list(new.graph.nodes):
        v = n.meta.get("val")
        n.meta["example_value"] = v
        if n.op == "output" or not _literal(v):
            continue
        for user in list(n.users):
            user.args = fx.node.map_arg(user.args, lambda x: v if x is n else x)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda x: v if x is n else x)
            if reads.get(n):
                user.meta["sizes_read"] = user.meta.get("sizes_read", frozenset()) | reads[n]
        folded += 1
    items = _scalar_items_as_tensors(new.graph)
    # NB: a vmap's body stays whole, dead outputs too: generic associative_scan's tree is read by its vmapped blocks
    eliminate_dead_code(new.graph, in_vmaps(new.graph).__contains__)
    new.graph.lint()
    new.recompile()
    sizes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
    new.meta["adjoint_compile"] = {"specialized_from": "symbolic sizes", "sizes": sizes}
    log.debug("adjoint-compile: specialized a symbolic graph to %s (%d size values folded, %d scalar reads fed as "
              "tensors)", sizes, folded, items)
    return new
