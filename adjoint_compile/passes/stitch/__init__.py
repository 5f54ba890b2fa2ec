"""Stitch: split a lowered graph into inner-compiled partitions and the region calls between them.

Before (after lowering)::

    x ─► linear ─► region_0(x1, W, A) ─► add ─► region_1(...) ─► out

After::

    submod_0 = inner_compiler(linear)        # an aot_autograd / inductor callable
    region_0 = the region's autograd.Function (runs eagerly; its backward is the adjoint program)
    submod_2 = inner_compiler(add)
    ...

Region calls must stay outside the inner compiler: aot_autograd would trace through an autograd.Function and
replace its backward with the traced one, undoing the rewrite.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ...analysis.fx import registers_hook
from ...errors import AdjointCompileWarning
from ...inner import COMPILE_LOCK, _cause, compile_inner, inductor_or_aot_eager
from ...options import Options
from ...regions import Fallback
from ...timing import timed
from ..capture import Captured

log = logging.getLogger(__name__)


class _LazyInner(torch.nn.Module):
    """An inner-compiled partition, compiled on its first call with the real inputs it receives.

    NB: compiling lazily avoids re-deriving fake example inputs for every partition from dynamo's metadata; the
    cost is the inner compiler's time on the first call, which torch.compile users already expect.
    """

    def __init__(self, gm: fx.GraphModule, inner: str, dynamic: bool = False,
                 fallbacks: list[Fallback] | None = None) -> None:
        super().__init__()
        self.dynamic = dynamic
        self.fallbacks = fallbacks
        # NB: split_module returns a lone output bare; aot_autograd wants a tuple, so wrap it and unwrap on call.
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self._unwrap = not isinstance(out.args[0], (tuple, list))
        if self._unwrap:
            out.args = ((out.args[0],),)
            gm.recompile()
        self.gm = gm
        self.inner = inner
        self._compiled: Callable[..., Any] | None = None

    def forward(self, *args: Any) -> Any:
        if self._compiled is None:
            with COMPILE_LOCK:  # two threads' first calls: one compiles, the other waits and reuses it
                if self._compiled is None and self.inner != "eager" and (self.dynamic or _reads_values(self.gm)):
                    # NB: a partition of a graph with symbolic sizes: dynamo traces it once with those sizes
                    # symbolic, so one compile serves every length; what inductor cannot compile with those sizes
                    # (a torch scan of symbolic length) runs with aot_eager, as a graph with concrete sizes does.
                    # NB: so is one reading a Python float argument that changed between calls (a 0-dim tensor and
                    # its .item()): the inner compiler alone has no shape environment for the value; dynamo keeps
                    # the float unspecialized
                    backend = inductor_or_aot_eager if self.inner == "inductor" else self.inner
                    self._compiled = torch.compile(self.gm, backend=backend, dynamic=True)
                elif self._compiled is None:
                    self._compiled = compile_inner(self.gm, list(args), self.inner)
        try:
            out = self._compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not self.dynamic or self._compiled is self.gm:
                raise
            # NB: dynamo cannot always trace its own graph again: a torch scan whose step reads a symbolic size
            # (a rolled loop whose region was declined, a batch size that changed) holds that size as an operand,
            # which scan refuses when traced again; such a partition runs as captured, eagerly (same results)
            cause = f"a graph with symbolic sizes could not be compiled again ({_cause(e)})"
            remedy = "it runs eagerly as captured (same results, slower); compiling without dynamic=True avoids it"
            warnings.warn(AdjointCompileWarning(f"adjoint-compile: {cause}; {remedy}"), stacklevel=2)
            if self.fallbacks is not None:
                self.fallbacks.append(Fallback(cause, remedy, {"nodes": len(self.gm.graph.nodes)}))
            log.debug("adjoint-compile: symbolic partition runs eagerly", exc_info=True)
            self._compiled = self.gm
            out = self.gm(*args)
        return out[0] if self._unwrap else out


def _reads_values(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` reads a tensor's value as a Python number (``.item()``: an unspecialized float argument)."""
    return any(n.op == "call_method" and n.target == "item" or n.op == "call_function" and
               n.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
               for n in gm.graph.nodes)


def stitch_partitions(gm: fx.GraphModule, region_nodes: Sequence[str], inner: str, dynamic: bool = False,
                      fallbacks: list[Fallback] | None = None) -> Callable[..., Any]:
    """Split ``gm`` at the nodes named in ``region_nodes`` and compile the rest with ``inner``.

    ``region_nodes`` are call nodes made by a lowering pass; each becomes its own partition and is run as is. A
    gradient hook registered on a value (``registers_hook``) moves right after the value, into its partition.
    ``dynamic``: ``gm`` has symbolic sizes, and each partition is compiled once for all of them; a partition that
    then runs eagerly is added to ``fallbacks`` (the graph's record, listed by ``report()``).
    """
    region_set = set(region_nodes)
    for hook in [n for n in gm.graph.nodes if registers_hook(n)]:
        # NB: right after the value it hooks, in that value's partition: the inner compiler applies it to the value's
        # whole gradient there (it registers nothing on a partition's input, nor sees another partition's uses)
        value, body = hook.args[0], [a for a in hook.all_input_nodes if a.op == "get_attr"]
        if isinstance(value, fx.Node) and value.op != "placeholder" and value.name not in region_set and \
                all(len(b.users) == 1 for b in body):
            at = value
            for n in [*body, hook]:
                at.append(n)
                at = n
    gm.graph.lint()
    part_of: dict[str, int] = {}
    part = 0
    region_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.name in region_set:
            part += 1
            part_of[node.name] = part
            region_parts.add(part)
            part += 1
        else:
            part_of[node.name] = part

    split = split_module(gm, None, lambda n: part_of[n.name], keep_original_order=True)
    for name, child in list(split.named_children()):
        idx = int(name.rsplit("_", 1)[-1])
        if idx in region_parts:
            continue
        assert isinstance(child, fx.GraphModule)
        setattr(split, name, _LazyInner(child, inner, dynamic, fallbacks))
    log.debug("stitched %d partitions (%d region calls)", len(list(split.children())), len(region_parts))
    return split


def stitch(captured: Captured, lowered: list[str], opts: Options,
           pristine: fx.GraphModule | None = None) -> Callable[..., Any]:
    """The stage's entry (``backend.py``): compile what was not rewritten with the inner compiler and join it with the region calls.

    With nothing rewritten the graph goes to the inner compiler whole: as dynamo captured it (``pristine``, a copy
    taken before normalization, when given), exactly what that compiler alone would give, else as normalized."""
    if not lowered:
        return compile_inner(pristine if pristine is not None else captured.gm, captured.example_inputs, opts.inner,
                             what="whole_graph")
    return timed("stitch", stitch_partitions, captured.gm, lowered, opts.inner)
