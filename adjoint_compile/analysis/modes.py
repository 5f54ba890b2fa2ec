"""Where a pass may move a graph's ops: the grad mode and autocast block each op runs under (``with torch.no_grad():``
inside the compiled code), and the in-place writes a region's ops must not be moved across.

Replacing a region's ops by one call at the last of them moves the ops between them that read them past the call,
and the ops that read none of them before it. :func:`moved_across_modes` finds an op so moved into another grad mode
or autocast block, :func:`written_after_read` an in-place write the call would come to follow.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .fx import example_value, is_inplace, shares_memory

__all__ = ["entry_grad_mode", "mode_states", "changed_modes", "moved_across_modes", "written_after_read"]


def entry_grad_mode(graph: fx.Graph) -> bool:
    """The grad mode the graph is entered with: the value of its last ``_set_grad_enabled`` (dynamo restores it at
    the end of every block it sets), else True."""
    toggles = [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    return bool(toggles[-1].args[0]) if toggles and toggles[-1].args else True


def mode_states(graph: fx.Graph) -> dict[fx.Node, tuple[bool, tuple[str, ...]]]:
    """Per op node, the grad mode and the autocast / inference-mode blocks (innermost last) it runs under, as the
    graph itself sets them (``with torch.no_grad():`` inside the compiled code; see :func:`changed_modes`). Two
    nodes with equal states can trade places; a pass must not move a node to where the state differs."""
    grad = entry_grad_mode(graph)
    blocks: list[str] = []
    out: dict[fx.Node, tuple[bool, tuple[str, ...]]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            grad = n.args[0] if n.args else grad
        elif n.op == "call_function" and n.target in _ENTERS:
            blocks.append(_ENTERS[n.target])
        elif n.op == "call_function" and n.target in _EXITS:
            blocks = blocks[:-1]
        elif n.op in ("call_function", "call_method", "call_module"):
            out[n] = (grad, tuple(blocks))
    return out


_ENTERS = {torch.amp.autocast_mode._enter_autocast: "a torch.autocast",
           torch.autograd.grad_mode._enter_inference_mode: "torch.inference_mode"}
_EXITS = {torch.amp.autocast_mode._exit_autocast, torch.autograd.grad_mode._exit_inference_mode}


def changed_modes(graph: fx.Graph) -> dict[fx.Node, str]:
    """The nodes that run under a grad mode or an autocast the graph itself sets (``with torch.no_grad():``,
    ``torch.autocast(..., enabled=False)``, ``torch.inference_mode()`` inside the compiled code), each with why.

    Dynamo writes such a block as calls around its ops (``torch._C._set_grad_enabled(False)`` ... ``(True)``,
    ``_enter_autocast`` ... ``_exit_autocast``)."""
    states, entry = mode_states(graph), entry_grad_mode(graph)
    out = {}
    for n, (grad, blocks) in states.items():
        if grad != entry:
            out[n] = f"runs under torch.set_grad_enabled({grad}) set inside the compiled code (left to autograd)"
        elif blocks:
            out[n] = f"runs under {blocks[-1]} entered inside the compiled code (left to autograd)"
    return out


def moved_across_modes(graph: fx.Graph, members: list[fx.Node]) -> fx.Node | None:
    """A node that replacing ``members`` (in graph order) by one call at the last of them would move to another
    grad mode or autocast block (:func:`mode_states`), or None. Such a node lies between the members and reads
    one of them: it must follow the call, past whatever toggles the mode in between (a ``torch.no_grad()`` block
    reading a value the region computes before the block and whose scan comes after it). A node that reads no
    value that may require grad moves across a change of grad mode alone: it computes the same either side (the
    block's ops reading a value detached on its way in, see passes/capture/mode_blocks.py)."""
    states = mode_states(graph)
    inside, last = set(members), members[-1]
    at = states.get(last)
    after: set[fx.Node] = set(inside)
    grad: set[fx.Node] | None = None
    for n in graph.nodes:
        if n is last:
            break
        if n in inside:
            if states.get(n, at) != at:
                return n
            continue
        if any(a in after for a in n.all_input_nodes):
            after.add(n)
            st = states.get(n, at)
            if st == at:
                continue
            if at is None or st[1] != at[1] or "torch.inference_mode" in st[1]:
                return n
            grad = _with_grad(graph, states) if grad is None else grad
            if any(a in grad for a in n.all_input_nodes):
                return n
    return None


def written_after_read(graph: fx.Graph, members: list[fx.Node]) -> fx.Node | None:
    """An in-place write among ``members`` (in graph order), not one of them and reading none of them, into memory
    a member before it reads, or None: replacing the members by one call at the last of them would run that read
    after the write (``self.bias.mul_(0.9)`` under ``no_grad`` between a layer reading the bias and the scan). A
    write that reads a member follows the call, as every op reading one does."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    inside, first, last = set(members), pos[members[0]], pos[members[-1]]
    after = set(inside)
    for w in graph.nodes:
        if not first < pos[w] < last or w in inside:
            continue
        if any(a in after for a in w.all_input_nodes):
            after.add(w)
            continue
        target = w.kwargs.get("out", w.args[0] if w.args else None) if is_inplace(w) else None
        if isinstance(target, fx.Node) and any(pos[m] < pos[w] and any(shares_memory(a, target)
                                                                     for a in m.all_input_nodes) for m in members):
            return w
    return None


def _with_grad(graph: fx.Graph, states: dict) -> set[fx.Node]:
    """The nodes whose value may require grad: the inputs that do, and what an op run with grad makes of one of them,
    or an in-place op writes into one (an over-estimate: it knows no op that makes none, save ``detach``). Worked out
    here, for dynamo records some values made under ``no_grad`` as requiring grad."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            v = example_value(n)
            if v is None or isinstance(v, torch.Tensor) and v.requires_grad:
                out.add(n)
        elif n.op == "get_attr":
            out.add(n)
        elif (n.op == "call_method" and n.target == "detach") or n.target in (torch.detach, torch.Tensor.detach):
            continue
        elif (st := states.get(n)) is not None and st[0] and "torch.inference_mode" not in st[1]:
            if any(a in out for a in n.all_input_nodes):
                out.add(n)
        elif is_inplace(n) and n.args and n.args[0] in out:
            out.add(n)
    return out
