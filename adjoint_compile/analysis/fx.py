"""FX graph utilities shared by the analyses, the passes and the runtime: linear_scan nodes and their arguments,
example values and shapes (symbolic-safe), reachability and convexity of node sets, a stable topological sort."""
from __future__ import annotations

import contextlib
import functools
import heapq
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "SCAN_ARGS", "SCAN_DEFAULTS", "is_linear_scan", "scan_args", "example_value", "size", "shape", "hinted_shape", "nodes_in",
    "reachable", "reentry", "is_convex", "bfs_inputs", "stable_toposort", "callables_named", "fresh_name",
    "is_inplace", "eliminate_dead_code", "written_inputs", "reread_inputs", "registers_hook",
    "shares_memory", "allocated_bytes", "source_line", "source_at", "is_copy", "batch_size_arg",
    "refresh_example_values", "has_symbolic_sizes", "in_vmaps", "SYM_TYPES",
]

#: linear_scan's arguments in schema order, and the defaults of the optional ones.
SCAN_ARGS = ("a", "b", "h0", "dim", "reverse", "window", "impl")
SCAN_DEFAULTS: dict[str, Any] = {"h0": None, "dim": 1, "reverse": False, "window": None, "impl": None}


def is_linear_scan(node: fx.Node) -> bool:
    """True for a call of ``torch.ops.adjoint_compile.linear_scan`` (overload or packet)."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name == "adjoint_compile::linear_scan"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name == "adjoint_compile::linear_scan"
    return False


def scan_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a linear_scan node by name: a, b, h0, dim, reverse, window, impl."""
    t = node.target
    names = list(SCAN_ARGS)
    if isinstance(t, torch._ops.OpOverload):
        names = [a.name for a in t._schema.arguments]
    out = dict(SCAN_DEFAULTS)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


#: ``x op= y`` as dynamo records it for tensors: in place on ``x``
_INPLACE_OPERATORS = frozenset(getattr(operator, f"i{op}") for op in
                               "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split())


def is_inplace(n: fx.Node) -> bool:
    """Whether ``n`` writes into a tensor it was given: ``o[i] = v``, ``x.copy_(y)``, ``x += y``, ``torch.relu_(x)``,
    ``f(x, out=o)``, ``F.relu(x, inplace=True)``, or an aten op whose schema mutates an argument."""
    if n.op not in ("call_function", "call_method"):
        return False
    if n.kwargs.get("out") is not None or n.kwargs.get("inplace") is True:
        return True
    t = n.target
    if n.op == "call_method":
        return isinstance(t, str) and t.endswith("_") and not t.startswith("_")
    if t is operator.setitem or t in _INPLACE_OPERATORS:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    name = getattr(t, "__name__", "")
    # NB: operator.not_, and_, or_ are named like in-place methods and are not
    return name.endswith("_") and not name.startswith("_") and getattr(t, "__module__", None) not in ("operator", "_operator")


def eliminate_dead_code(graph: fx.Graph, keep: Callable[[fx.Node], bool] = lambda n: False) -> bool:
    """``graph.eliminate_dead_code()`` that keeps in-place writes (:func:`is_inplace`), on this graph only.

    NB: FX's own rule keeps only impure *functions*; on dynamo's torch-level graph a ``buf[j].copy_(h)`` is a
    ``call_method`` node without users, which FX would drop, and with it the write into ``buf``. And FX's pass
    recurses into the sub-graphs of higher-order ops (a custom ``autograd.Function``'s bodies) with its own rule,
    dropping their in-place writes: mambapy's PScan body lost its whole scan, in a module every copy of the graph
    shares. Sub-graphs are left as dynamo made them.
    """
    graph.lint()
    changed = False
    for n in reversed(graph.nodes):
        if not n.users and n.op not in ("placeholder", "output") and not (n.is_impure() or is_inplace(n) or
                                                                          registers_hook(n) or _nesting(n)
                                                                          or keep(n)):
            graph.erase_node(n)
            changed = True
    return changed


#: the types of dynamo's symbolic numbers
SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(v: Any) -> bool:
    if isinstance(v, SYM_TYPES):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in v.shape)
    if isinstance(v, (tuple, list)):
        return any(_symbolic(x) for x in v)
    return False


def has_symbolic_sizes(gm: fx.GraphModule) -> bool:
    """Whether any placeholder of dynamo's graph has a symbolic value or shape."""
    return any(_symbolic(n.meta.get("example_value", n.meta.get("val")))
               for n in gm.graph.nodes if n.op == "placeholder")


def _nesting(n: fx.Node, names: tuple[str, ...] = ("_vmap_increment_nesting", "_vmap_decrement_nesting")) -> bool:
    """A vmap's enter or exit (generic associative_scan's combines): FX does not count them impure, but a specialized
    graph folds the level they return into its users, and without them the vmap would not be entered."""
    return n.op == "call_function" and getattr(n.target, "__name__", "") in names and \
        "functorch" in getattr(n.target, "__module__", "")


def in_vmaps(graph: fx.Graph) -> set[fx.Node]:
    """The nodes between a vmap's enter and its exit, as dynamo lays them out (in graph order)."""
    inside: set[fx.Node] = set()
    depth = 0
    for n in graph.nodes:
        depth -= _nesting(n, ("_vmap_decrement_nesting",))
        if depth > 0:
            inside.add(n)
        depth += _nesting(n, ("_vmap_increment_nesting",))
    return inside


#: ops whose result may share storage with their first argument (a write into it reaches the argument)
_VIEWS = frozenset("getitem view view_as reshape reshape_as transpose permute select narrow unsqueeze squeeze expand "
                   "expand_as t T mT flatten unflatten as_strided detach alias split chunk unbind movedim swapaxes "
                   "diagonal unfold real imag view_as_real view_as_complex contiguous".split())


#: ops whose result is always a view of their first argument (never a copy, unlike reshape or contiguous)
_ALWAYS_VIEWS = frozenset("view view_as transpose permute select narrow unsqueeze squeeze expand expand_as t T mT "
                          "as_strided detach alias split chunk unbind movedim swapaxes diagonal unfold real imag "
                          "view_as_real view_as_complex".split())


def is_view_op(n: fx.Node) -> bool:
    """Whether ``n`` is an op whose result may share storage with its first argument (a view, a reshape, ...)."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return n.op in ("call_function", "call_method") and name in _VIEWS


def written_inputs(graph: fx.Graph) -> tuple[list[fx.Node], list[fx.Node]]:
    """The in-place writes of ``graph`` (:func:`is_inplace`), split by what they write into: ``(into_inputs,
    into_intermediates)``. A write reaches an input when its target is a placeholder or a chain of views of one
    (a module buffer updated in place), or the result of a write into one (``ema.mul_(0.9).add_(0.1 * m)``); every
    other write is into a tensor the graph made, conservatively."""
    into_inputs, into_made = [], []
    for n in graph.nodes:
        if not is_inplace(n):
            continue
        t = _written(n)
        while isinstance(t, fx.Node) and t.args and (is_view_op(t) or is_inplace(t)):
            t = _written(t) if is_inplace(t) else t.args[0]
        (into_inputs if isinstance(t, fx.Node) and t.op == "placeholder" else into_made).append(n)
    return into_inputs, into_made


def _written(n: fx.Node) -> Any:
    """What in-place op ``n`` writes into: its ``out=``, else its first argument."""
    return n.kwargs["out"] if n.kwargs.get("out") is not None else n.args[0] if n.args else None


def shares_memory(n: fx.Node, x: fx.Node) -> bool:
    """Whether a value ``n`` makes (a tensor, or tensors in a tuple: a ``split``'s parts) may share ``x``'s memory,
    by their traced fake tensors' storages (dynamo's tracing keeps them: ``ravel``, ``swapdims``, ``.data``,
    ``atleast_2d`` of x share it, whatever their names); True when either value is unknown."""
    xv, v = example_value(x), example_value(n)
    if not isinstance(xv, torch.Tensor) or v is None:
        return True
    ref = StorageWeakRef(xv.untyped_storage())
    return any(isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) == ref
               for t in pytree.tree_leaves(v))


def allocated_bytes(nodes: Iterable[fx.Node], count: Callable[[fx.Node], bool] = lambda n: True) -> int:
    """The bytes the values of ``nodes`` (in graph order) allocate, once per storage: a value sharing the storage of
    one before it or of a value they read (a view: movedim, expand, a slice; an in-place op) adds nothing; of the
    others, those of the nodes ``count`` accepts add their size.

    NB: by storage, not ``Tensor._is_view()``: ``F.linear`` of a 3-d input is a view of the 2-d result it makes
    itself (counted 0, though autograd saves it), and fake propagation detaches every value (a specialization's
    movedims counted whole), so one region's estimate differed between explain() and a later length. A view made
    before a pass put an op between it and its base (a clone) keeps its base's storage: hence "one before it", not
    only the values it reads; an op that always makes a view (:data:`_ALWAYS_VIEWS`) counts 0 whatever its value
    says (a rolled loop's stack keeps the value dynamo traced, not one of its new base)."""
    nodes = list(nodes)
    names = {n: n.target if n.op == "call_method" else getattr(n.target, "__name__", "") for n in nodes}
    seen = {StorageWeakRef(t.untyped_storage()) for n in nodes for a in n.all_input_nodes if a not in nodes
            for t in pytree.tree_leaves(example_value(a)) if isinstance(t, torch.Tensor)}
    total = 0
    for n in nodes:
        for t in pytree.tree_leaves(example_value(n)):
            if isinstance(t, torch.Tensor) and (ref := StorageWeakRef(t.untyped_storage())) not in seen:
                seen.add(ref)
                total += t.numel() * t.element_size() if count(n) and names[n] not in _ALWAYS_VIEWS else 0
    return total


def reread_inputs(graph: fx.Graph, into_inputs: list[fx.Node]) -> list[fx.Node]:
    """The writes of ``into_inputs`` (into a graph input, :func:`written_inputs`) after which an op reads that input
    again, directly or through a value sharing its memory made without going through a write (``self.state.copy_(h)``
    then ``self.state[:, None]``): only the graph's order puts that read after the write, and a pass that moves nodes
    by data flow could read the old values."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for w in into_inputs:
        root = _written(w)
        while root.op != "placeholder":
            root = _written(root) if is_inplace(root) else root.args[0]
        seen, todo = {root}, [root]
        while todo:  # NB: the input and the values sharing its memory, not through a write (its users are ordered)
            for u in todo.pop().users:
                if u not in seen and u.op != "output" and not is_inplace(u) and shares_memory(u, root):
                    seen.add(u)
                    todo.append(u)
        if any(pos[u] > pos[w] and u.op != "output" and not is_inplace(u) for a in seen for u in a.users):
            out.append(w)
    return out


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder ``graph`` so that every node follows its inputs, keeping the current order wherever it is valid."""
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    indeg = {n: len(set(n.all_input_nodes)) for n in order}
    ready = [(index[n], n.name) for n in order if indeg[n] == 0]
    by_name = {n.name: n for n in order}
    heapq.heapify(ready)
    out: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        n = by_name[name]
        out.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (index[u], u.name))
    if len(out) != len(order):
        raise RuntimeError("a pass made a cycle in the graph")  # NB: a bug in a pass, never a user error
    if out == order:
        return
    prev = out[0]
    if order[0] is not prev:
        order[0].prepend(prev)
    for n in out[1:]:
        prev.append(n)
        prev = n


def callables_named(name: str, modules: Iterable[Any]) -> Iterator[Any]:
    """Every hashable callable called ``name`` in ``modules`` (``torch.add``, ``Tensor.add``, ``operator.add``...):
    the keys a table of torch-level ops needs so that every spelling of an op in a dynamo graph finds it."""
    for mod in modules:
        obj = getattr(mod, name, None)
        if obj is None or not callable(obj):
            continue
        try:
            hash(obj)
        except TypeError:
            continue
        yield obj


# --------------------------------------------------------------------------------------------------------------
# example values and shapes


def example_value(n: Any) -> Any:
    """The FakeTensor (or tuple of them) dynamo recorded for ``n``; ``meta["val"]`` as a fallback; None for
    non-nodes."""
    if not isinstance(n, fx.Node):
        return None
    return n.meta.get("example_value", n.meta.get("val"))


def refresh_example_values(nodes: list[fx.Node]) -> None:
    """New example values for ``nodes`` (in graph order, after a pass rewrote them), run on their inputs' fake
    tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    for n in nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), example_value)
        # NB: the inputs' own mode (dynamo's tracing context may hold another)
        mode = next((v.fake_mode for v in map(example_value, nodes_in((n.args, n.kwargs))) if isinstance(
            v, FakeTensor)), None)
        with mode if mode is not None else contextlib.nullcontext():
            v = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        n.meta["example_value"] = v
        if "val" in n.meta:
            n.meta["val"] = v


def size(x: Any, hint: bool = False) -> Any:
    """An int, or for a symbolic size (dynamic shapes) its sympy expression; with ``hint``, the size dynamo traced
    with (None when it has none).

    NB: comparing SymInts (or ``int()`` of one) would install guards in dynamo's shape environment; sympy
    expressions compare structurally and hints are plain ints, so an analysis stays a pure read of the graph.
    """
    if isinstance(x, torch.SymInt):
        if hint:
            return x.node.hint
        expr = x.node.expr
        return int(expr) if expr.is_number else expr
    return x


def shape(n: Any, first_of_tuple: bool = False, hint: bool = False) -> tuple[Any, ...] | None:
    """The shape of ``n``'s example value, each size as :func:`size` gives it; None for a non-tensor value (or,
    with ``hint``, a size without a hint). ``first_of_tuple``: a tuple of tensors (split, max(dim)) has its first
    one's."""
    v = example_value(n)
    if first_of_tuple and isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        v = v[0]
    if not isinstance(v, torch.Tensor):
        return None
    out = tuple(size(x, hint) for x in v.shape)
    return None if hint and any(x is None for x in out) else out


#: shapes with the sizes dynamo traced with: recognition reads a symbolic graph only to decide whether to
#: specialize it per call (passes/capture/specialize.py), and reports lengths as numbers.
hinted_shape = functools.partial(shape, hint=True)


def nodes_in(x: Any) -> list[fx.Node]:
    """The nodes in a (nested) argument structure, in order, with repeats."""
    out: list[fx.Node] = []
    fx.node.map_arg(x, out.append)
    return out


# --------------------------------------------------------------------------------------------------------------
# reachability and convexity (linear in the nodes and edges visited: region graphs have ~20k nodes)


def reachable(start: fx.Node | Iterable[fx.Node], limit: fx.Node | None = None,
              order: dict[fx.Node, int] | None = None, *, forward: bool = True) -> set[fx.Node]:
    """Nodes reachable from ``start`` (included) along users (``forward``) or inputs; forward, not past ``limit``
    in graph order (``order``: position of every node)."""
    starts = [start] if isinstance(start, fx.Node) else list(start)
    cap = order[limit] if (limit is not None and order is not None) else None
    seen: set[fx.Node] = set(starts)
    stack = list(starts)
    while stack:
        n = stack.pop()
        for u in (n.users if forward else n.all_input_nodes):
            if u in seen:
                continue
            if cap is not None and order.get(u, cap + 1) > cap:
                continue
            seen.add(u)
            stack.append(u)
    return seen


def reentry(graph_nodes: Iterable[fx.Node], members: set[fx.Node]) -> fx.Node | None:
    """Where a path that leaves ``members`` comes back (member -> non-member -> member): the first such non-member
    read by a member, in graph order; None when ``members`` is convex (can be outlined into one call)."""
    tainted: set[fx.Node] = set()
    for n in graph_nodes:
        ins = n.all_input_nodes
        if n in members:
            entry = next((a for a in ins if a in tainted), None)
            if entry is not None:
                return entry
        elif any(a in members or a in tainted for a in ins):
            tainted.add(n)
    return None


def is_convex(nodes: list[fx.Node]) -> bool:
    """No path leaves ``nodes`` and comes back (the set can be outlined into one call)."""
    # NB: torch.fx.passes.utils.fuser_utils.validate_partition answers the same, but region_around needs the
    # node where the path comes back, so both use reentry.
    return not nodes or reentry(nodes[0].graph.nodes, set(nodes)) is None


def bfs_inputs(start: fx.Node, budget: int, expand: Callable[[fx.Node], bool]) -> Iterator[fx.Node]:
    """Ancestors of ``start`` breadth-first along inputs, each once, while fewer than ``budget`` nodes were seen;
    the walk goes on past the nodes for which ``expand(node)`` is true."""
    seen = {start}
    queue = deque([start])
    while queue and len(seen) < budget:
        n = queue.popleft()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if expand(a):
                queue.append(a)
            yield a


def fresh_name(gm: "torch.fx.GraphModule", prefix: str) -> str:
    """``prefix`` numbered by how many submodules of ``gm`` already carry it (``adjoint_region_0``, ``_1``, ...)."""
    return f"{prefix}_{sum(1 for k, _ in gm.named_children() if k.startswith(prefix + '_'))}"


#: this package's own files, skipped when naming the user's line of a node (its models/ are example user code)
_PACKAGE_DIR = __file__.rsplit("/analysis/", 1)[0] + "/"


def _user_frame(node: fx.Node) -> tuple[str, str, str] | None:
    """(``file:line``, its function, its code) of the last frame of ``node``'s stack trace outside this package, or None."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith('File "'):
            continue
        path, _, rest = lines[i][len('File "'):].partition('", line ')
        if path.startswith(_PACKAGE_DIR) and not path.startswith(_PACKAGE_DIR + "models/"):
            continue
        code = ""
        for ln in lines[i + 1:]:
            if ln.startswith('File "'):
                break
            if not code and set(ln) - set("^~ "):  # NB: not the ^^^ line under it
                code = ln
        line, _, fn = rest.partition(", in ")
        return f"{path}:{line}", fn.strip(), code
    return None


def source_line(node: fx.Node) -> str | None:
    """``file:line`` of the user's code that made ``node``: the last frame of its stack trace outside this package
    (``ac.ops.linear_scan``'s own frame is not the user's line), or None."""
    frame = _user_frame(node)
    return frame[0] if frame else None


def source_at(node: fx.Node) -> str:
    """``file:line in function: code`` of the user's code that made ``node`` (:func:`source_line`, with the function
    and the line's text), for messages that refuse it; ``node <name> (no source line recorded)`` without a stack
    trace."""
    frame = _user_frame(node)
    if frame is None:
        return f"node {node.name} (no source line recorded)"
    where, fn, code = frame
    return where + (f" in {fn}" if fn else "") + (f": {code}" if code else "")


def registers_hook(n: fx.Node) -> bool:
    """``t.register_hook(fn)`` on a value the graph made (dynamo's ``register_hook`` higher-order op; its result,
    t itself, is often unused)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) and \
        n.target.__name__ == "register_hook"


def is_copy(n: fx.Node) -> bool:
    """Whether ``n`` copies its one tensor operand (clone, contiguous, alias): the same values."""
    if n.op == "call_method":
        return n.target in ("clone", "contiguous") and len(n.args) == 1
    return n.op == "call_function" and n.target in (torch.clone, torch.ops.aten.clone.default,
                                                    torch.ops.aten.alias.default) and len(n.args) == 1


#: parameter-only ops whose size arguments can broadcast a parameter to the batch
_BROADCASTS = {"expand", "broadcast_to", "repeat", torch.Tensor.expand, torch.broadcast_to, torch.Tensor.repeat}
#: factories of tensors whose rows along any axis are alike (zeros, ones, one value): per op, the position of its sizes
_ROW_CONSTANTS = {torch.zeros: 0, torch.ones: 0, torch.full: 0, "new_zeros": 1, "new_ones": 1, "new_full": 1}
_KWARGS = frozenset("dtype device layout pin_memory requires_grad fill_value".split())


def batch_size_arg(m: fx.Node, bd: int, batch: int) -> tuple[int | None, int] | None:
    """Where ``m`` gives the batch size ``batch`` of its result along ``bd``, when it broadcasts a parameter to the
    batch (``h0.expand(B, -1)``) or makes a constant with alike rows (``torch.zeros(B, D)``, ``x.new_ones(B, D)``):
    (None, j) for its j-th argument, (i, k) for entry k of the list in argument i; else None. Per example the batch
    is 1, and such a value made for one example is the same for every one."""
    key = m.target if m.op in ("call_function", "call_method") else None
    val = example_value(m)
    first = 1 if key in _BROADCASTS else _ROW_CONSTANTS.get(key)
    if first is None or not isinstance(val, torch.Tensor) or not 0 <= bd < val.dim() or val.shape[bd] != batch or \
            (m.kwargs.keys() - (_KWARGS if key in _ROW_CONSTANTS else set())):
        return None
    if len(m.args) > first and isinstance(m.args[first], (list, tuple)):
        sizes, at, k0 = m.args[first], first, 0
    elif key in (torch.full, "new_full"):
        return None  # NB: their sizes are a list, never spread
    else:
        sizes, at, k0 = m.args[first:], None, first
    k = bd - (val.dim() - len(sizes))  # NB: sizes align with the result's last dims
    if not 0 <= k < len(sizes):
        return None
    v = sizes[k]
    v = example_value(v) if isinstance(v, fx.Node) else v
    if not isinstance(v, (int, torch.SymInt)) or v != batch or batch == 1:
        return None
    return (at, k + k0)
