"""Highway mode lowering of a residual chain over depth: its L layers become one call of the Highway-BP runtime.

Before::

    x_1 = relu(x + fc2(relu(fc1(x))))          # layer 1: g = the block, r = ReLU(x + z)
    x_2 = relu(x_1 + fc2_1(relu(fc1_1(x_1))))  # layer 2 ...

After::

    highway_chain_0 = HighwayLayers(...)             # runtime/highway.py
    chain = self.highway_chain_0(x, W1, b1, W2, b2, ...)
    x_2 = chain[1]

Each layer f_i(x) = r_i(x, g_i(x)) is split as recognition found it (passes/match/find_residuals.py): g_i is the block,
r_i the rest of the layer (the sum and its post-op) with the block's outputs as inputs.  K_i = ∂r_i/∂x is a
diagonal for the forms add, pre_ln, relu_add, gated and lstm (r elementwise in x: a reverse linear scan) and dense for
post_ln (r = LN(x + z): applied as a VJP of r, a loop of cheap VJPs).  A layer whose values are used outside it
(other than its output) or a random op in a layer (the backward recomputes the blocks) keep ordinary autograd, with
the reason.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...analysis.fx import example_value as _ev
from ...analysis.fx import reachable
from ...analysis.fx import stable_toposort as _toposort
from ...analysis.optable import draws_random, fn_name, op_name
from ...kernels.random import hashed_dropout
from ...options import Options
from ...regions import PROVENANCE, Lowered, ResidualChain

__all__ = ["ChainRefused", "lower_chain", "R_OF"]

#: per form: r and K as explain() reports them.
R_OF = {"add": ("x + z (or c·x + z)", "identity / scalar"), "pre_ln": ("x + z", "identity"),
        "relu_add": ("ReLU(x + z)", "diag(x + z > 0)"), "gated": ("z1 ⊙ x + z2", "diag(z1)"),
        "post_ln": ("LN(x + z)", "∂LN/∂x (dense: a loop of cheap VJPs)"),
        # NB: the cell c is the state; the gates read it only through h = o ⊙ tanh(c), inside the block g
        "lstm": ("z1 ⊙ c + z2 (the gates z from h = o ⊙ tanh(c))", "diag(z1)")}



class ChainRefused(Exception):
    pass


def _module(gm: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env = {a: g.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[outputs[0]] if len(outputs) == 1 else [env[o] for o in outputs])
    return fx.GraphModule(gm, g)


def _signature(m: fx.GraphModule) -> tuple:
    """The computation of a block, node names left out: equal signatures are the same function of the inputs."""
    idx: dict[fx.Node, int] = {}
    out = []
    for i, n in enumerate(m.graph.nodes):
        idx[n] = i
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", idx[a]))
        out.append((n.op, None if n.op == "placeholder" else n.target, repr(args)))
    return tuple(out)


def _same_shapes(ext: list[fx.Node], ext_of: list[list[int]]) -> bool:
    shapes = [[tuple(getattr(_ev(ext[j]), "shape", ())) for j in e] for e in ext_of]
    return all(s == shapes[0] for s in shapes)


def _layer_nodes(layer) -> set[fx.Node]:
    return (reachable(layer.out, forward=False) & reachable(layer.x)) - {layer.x}


def lower_chain(gm: fx.GraphModule, r: ResidualChain, opts: Options, name: str) -> tuple[Lowered, str]:
    """Replace the chain's layers by one :class:`~adjoint_compile.runtime.highway.HighwayLayers` call named
    ``name``; returns the outcome and the report's description of the split."""
    from ...runtime.highway import HighwayLayers

    G = gm.graph
    present = set(G.nodes)
    if any(n not in present for n in r.nodes) or any(l.x not in present or l.out not in present for l in r.layers):
        raise ChainRefused("part of the chain was already rewritten (it runs inside a sharded region)")
    forms = [layer.form for layer in r.layers]
    if any(f not in R_OF for f in forms):
        raise ChainRefused(f"the {sorted(set(forms) - set(R_OF))} form is not rewritten yet")
    pos = {n: i for i, n in enumerate(G.nodes)}
    ext: list[fx.Node] = []
    gs, rs, ext_of, all_nodes = [], [], [], set()
    for i, layer in enumerate(r.layers):
        if i and layer.x is not r.layers[i - 1].out:
            raise ChainRefused(f"layer {i + 1} does not read layer {i}'s output")
        nodes = _layer_nodes(layer)
        all_nodes |= nodes
        for n in nodes:
            if n.op not in ("call_function", "call_method", "call_module"):
                raise ChainRefused(f"node {n.name} ({n.op}) cannot be outlined")
            what = op_name(n) or fn_name(n)
            if draws_random(n) and n.target is not hashed_dropout:  # NB: a seeded mask is the same when recomputed
                raise ChainRefused(f"layer {i + 1} draws random numbers ({what} at node {n.name}); Highway-BP "
                                   f"recomputes the blocks in the backward")
            if n is not layer.out and any(u not in nodes for u in n.users):
                raise ChainRefused(f"the value {n.name} of layer {i + 1} is used outside the layer")
        block = sorted((b for b in layer.block if b in nodes), key=pos.__getitem__)
        bset = set(block)
        rest = sorted(nodes - bset, key=pos.__getitem__)
        Z = [b for b in block if any(u in nodes and u not in bset for u in b.users)]
        if not Z or layer.out not in rest:
            raise ChainRefused(f"layer {i + 1}'s block does not feed its residual function")
        outer = [a for n in sorted(nodes, key=pos.__getitem__) for a in n.all_input_nodes
                 if a not in nodes and a is not layer.x]
        outer = list(dict.fromkeys(outer))
        for a in outer:
            if a not in ext:
                ext.append(a)
        ext_of.append([ext.index(a) for a in outer])
        gs.append(_module(gm, [layer.x, *outer], block, Z))
        rs.append(_module(gm, [layer.x, *Z, *outer], rest, [layer.out]))
    x0 = r.layers[0].x
    for a in ext:
        if a in all_nodes:
            raise ChainRefused(f"{a.name} is read across layers")
    dense = "post_ln" in forms
    iso = len({_signature(m) for m in gs}) == 1 and len({len(e) for e in ext_of}) == 1 and _same_shapes(ext, ext_of)
    mod = HighwayLayers(gs, rs, ext_of, opts.iterations or 0, dense=dense, tolerance=opts.tolerance, batched=iso)
    mod.label = name
    gm.add_submodule(name, mod)
    last = max((layer.out for layer in r.layers), key=pos.__getitem__)
    with G.inserting_after(last):
        call = G.call_module(name, (x0, *ext))
    prev = call
    for i, layer in enumerate(r.layers):
        with G.inserting_after(prev):
            item = G.call_function(operator.getitem, (call, i))
        item.meta = dict(layer.out.meta)
        layer.out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in all_nodes)
        prev = item
    for n in reversed(list(G.nodes)):
        if n in all_nodes and not n.users:
            G.erase_node(n)
    _toposort(G)
    call.meta[PROVENANCE] = {"rewrite": "highway", "chain": r.name, "iterations": opts.iterations}
    split = "; ".join(f"{f}: r = {R_OF[f][0]}, K = {R_OF[f][1]}" for f in dict.fromkeys(forms))
    parts = [{"form": f, "r": R_OF[f][0], "K": R_OF[f][1]} for f in forms]
    out = Lowered(rewrite="highway", call=call.name, members=frozenset(n.name for n in r.nodes), steps=len(forms),
                  nodes=len(all_nodes), details={"iterations": opts.iterations, "highway_layers": parts,
                                                 "K_dense": dense, "batched_layers": iso})
    return out, split
