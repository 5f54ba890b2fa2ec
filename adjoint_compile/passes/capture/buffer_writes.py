"""An output buffer written step by step (``o[:, t] = h``) becomes one ``torch.stack`` of the written values.

fla's naive references, RecurrentGemma and RWKV collect a loop's outputs by writing into a preallocated tensor::

    o = torch.zeros_like(x)                 # or empty, new_zeros, ...
    for t in range(T):
        h = a[:, t] * h + b[:, t]
        o[:, t] = h

Dynamo records T in-place ``setitem`` nodes on ``o`` (or ``o[t].copy_(h)``: a view and a copy into it), which make
the loop's steps differ (each writes the buffer the previous one wrote). When the writes cover every index of one dim exactly once, the buffer's initial values
are all overwritten, and ``o`` after the last write is ``torch.stack([v_0, ..., v_{n-1}], dim)``: the same values,
and autograd gives each ``v_t`` its slice of the gradient either way. The rewrite is refused (the graph keeps its
writes) unless: ``o`` is made in the graph by a factory (zeros, empty, full, their ``_like``/``new_`` forms), every
write indexes one dim with an int and all others with full slices, each written value has exactly the slice's
shape and dtype, and nothing reads ``o`` before its last write. Buffers written into buffers (``buf[j] = h`` per step,
then ``out[i] = buf`` per row) are rewritten inside out, until no buffer is left that qualifies.

A write that stays (a partial one, a write through another view) keeps the graph's mutation: the capture stage then
leaves the graph as it is (passes/capture/), since its other passes move nodes by data flow alone.

Part of the capture stage (passes/capture/), before the recurrence matchers: the loop's steps then read only
their state, and the stack of states is what the re-roll turns into the scan itself.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ...analysis.fx import example_value
from ...analysis.modes import mode_states

log = logging.getLogger(__name__)

__all__ = ["stack_buffer_writes", "has_buffer_writes", "buffer_write"]

_FACTORIES = frozenset("zeros zeros_like empty empty_like full full_like ones ones_like new_zeros new_empty new_full "
                       "new_ones".split())


def _fname(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")


def _one_step(it: Any) -> bool:
    """``t:t+1`` (ints): one index kept as a dim of size 1 (RWKV's ``out[:, :, t:t+1] = ...``)."""
    return isinstance(it, slice) and isinstance(it.start, int) and isinstance(it.stop, int) and \
        it.start >= 0 and it.stop == it.start + 1 and it.step in (None, 1)


def _write_dim(idx: Any, rank: int) -> tuple[int, int, bool] | None:
    """(dim, index, whether the dim is kept) of ``o[idx] = v`` when ``idx`` is full slices around one int or one
    ``t:t+1`` slice; else None."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if sum(it is Ellipsis for it in items) == 1:  # NB: o[..., t, :] = h: the ellipsis stands for full slices
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (rank - len(items) + 1) + items[k + 1:]
    ints = [i for i, it in enumerate(items) if isinstance(it, int) and not isinstance(it, bool) or _one_step(it)]
    if len(ints) != 1 or len(items) > rank:
        return None
    if not all(isinstance(it, slice) and (it.start, it.stop, it.step) == (None, None, None)
               for i, it in enumerate(items) if i != ints[0]):
        return None
    it = items[ints[0]]
    return (ints[0], it.start, True) if isinstance(it, slice) else (ints[0], it, False)


def buffer_write(u: fx.Node, buf: fx.Node) -> tuple[fx.Node, Any, Any] | None:
    """``(node, idx, value)`` when ``u`` writes into ``buf``: ``buf[idx] = value`` (``node`` is the setitem), or
    ``buf[idx].copy_(value)`` / ``buf.select(d, t).copy_(value)`` (``u`` is the view, ``node`` the copy, the view's
    only use); else None."""
    if u.op == "call_function" and u.target is operator.setitem and u.args[0] is buf:
        return (u, u.args[1], u.args[2]) if len(u.args) == 3 and not u.kwargs else (u, None, None)
    sel = _select(u)
    if sel is not None:
        u_idx = (slice(None),) * sel[0] + (sel[1],)
    elif u.op == "call_function" and u.target is operator.getitem:
        u_idx = u.args[1]
    else:
        return None
    if u.args[0] is buf and len(u.users) == 1:
        c = next(iter(u.users))
        if c.op == "call_method" and c.target == "copy_" and c.args[0] is u:
            return (c, u_idx, c.args[1]) if len(c.args) == 2 and not c.kwargs else (c, None, None)
    return None


def _select(u: fx.Node) -> tuple[int, int] | None:
    """(dim, index) of ``buf.select(dim, index)`` / ``torch.select(buf, dim, index)`` with ints (dim >= 0)."""
    if (u.op == "call_method" and u.target == "select" or u.op == "call_function" and u.target is torch.select) \
            and len(u.args) == 3 and not u.kwargs and all(isinstance(a, int) for a in u.args[1:]):
        rank = example_value(u.args[0]).dim() if isinstance(example_value(u.args[0]), torch.Tensor) else 0
        d = u.args[1] + rank if u.args[1] < 0 else u.args[1]
        return (d, u.args[2]) if 0 <= d < rank else None
    return None


def _stack_one(gm: fx.GraphModule, buf: fx.Node, pos: dict[fx.Node, int]) -> str:
    """Rewrite the writes into ``buf``; returns "" on success, else why not."""
    ev = example_value(buf)
    # NB: no check of requires_grad: dynamo's example value is the buffer after its writes
    if not isinstance(ev, torch.Tensor):
        return "the buffer is not a tensor"
    found = {u: buffer_write(u, buf) for u in buf.users}
    writes = [u for u, w in found.items() if w is not None]
    if len(writes) < 2:
        return "fewer than two writes"
    last = max(pos[found[w][0]] for w in writes)
    if any(pos[u] < last for u in buf.users if u not in writes):
        return "the buffer is read before its last write"
    by_index: dict[int, tuple[fx.Node, Any]] = {}
    dim = None
    for w in writes:
        node, idx, value = found[w]
        if idx is None or node.users:
            return f"write {node.name} is not o[idx] = v"
        got = _write_dim(idx, ev.dim())
        if got is None:
            return f"write {node.name} does not index one dim with an int (or a t:t+1 slice)"
        d, t, kept = got
        if dim is None:
            dim, keep = d, kept
        if kept != keep:
            return f"write {node.name} mixes o[t] and o[t:t+1] writes"
        n = ev.shape[d]
        t = t + n if t < 0 else t
        if d != dim or not 0 <= t < n or t in by_index:
            return f"write {node.name} writes another dim or an index twice"
        v = example_value(value)
        want = ev.shape[:d] + ((1,) if keep else ()) + ev.shape[d + 1:]
        if not isinstance(value, fx.Node) or not isinstance(v, torch.Tensor) or v.shape != want or \
                v.dtype != ev.dtype or v.device != ev.device:
            return f"write {node.name} writes a value of another shape or dtype than the slice"
        by_index[t] = (node, value)
    assert dim is not None
    if sorted(by_index) != list(range(ev.shape[dim])):
        return f"the writes cover {len(by_index)} of {ev.shape[dim]} indices"
    last_write = max((found[w][0] for w in writes), key=pos.__getitem__)
    states = mode_states(gm.graph)
    at = states.get(last_write, (True, ()))
    if any(states.get(found[w][0], at)[1] != at[1] for w in writes):
        return "its writes run under other autocast or inference-mode blocks"
    if not at[0] and any(states.get(found[w][0], at)[0] for w in writes):
        return "its last write runs under torch.no_grad() and others do not"
    values, after = [], last_write
    for t in range(ev.shape[dim]):
        node, value = by_index[t]
        if not states.get(node, at)[0]:
            # NB: a value written under torch.no_grad() is a constant of the buffer: autograd gives it nothing (and
            # a stack of the loop's states under no_grad must not become the scan's output, which is not)
            with gm.graph.inserting_after(after):
                after = gm.graph.call_method("detach", (value,))
            after.meta["example_value"] = example_value(value)
            value = after
        values.append(value)
    with gm.graph.inserting_after(after):
        st = gm.graph.call_function(torch.cat if keep else torch.stack, (values, dim))
    st.meta["example_value"] = ev  # NB: the same shape, dtype and device
    st.meta["adjoint_compile"] = {"pass": "buffer_writes", "buffer": buf.name}
    buf.replace_all_uses_with(st, delete_user_cb=lambda u: u not in writes and u is not st)
    for w in writes:
        node = found[w][0]
        gm.graph.erase_node(node)
        if node is not w:
            gm.graph.erase_node(w)
    if not buf.users:
        gm.graph.erase_node(buf)
    return ""


def has_buffer_writes(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` writes into a buffer it made (looked up, not checked). NB: a graph with symbolic sizes is not
    normalized, so its recognition cannot see a loop that writes its steps; a specialization's capture stacks them."""
    return any(n.op in ("call_function", "call_method") and _fname(n) in _FACTORIES
               and any(buffer_write(u, n) is not None for u in n.users) for n in gm.graph.nodes)


def stack_buffer_writes(gm: fx.GraphModule) -> int:
    """Rewrite every buffer written step by step in ``gm`` (in place); returns how many were rewritten."""
    done, changed = 0, True
    while changed:  # NB: a buffer written with other buffers' values qualifies once those are stacks
        changed = False
        for n in list(gm.graph.nodes):
            if getattr(n, "_erased", False) or n.op not in ("call_function", "call_method") or _fname(n) not in _FACTORIES:
                continue
            if not any(buffer_write(u, n) is not None for u in n.users):
                continue
            pos = {x: i for i, x in enumerate(gm.graph.nodes)}
            why = _stack_one(gm, n, pos)
            if why:
                log.debug("buffer_writes: %s keeps its writes: %s", n.name, why)
            else:
                done += 1
                changed = True
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
