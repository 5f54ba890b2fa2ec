"""Rejection reasons grouped by cause keep their words: only node names that differ between the group's members are
masked."""
from __future__ import annotations

import torch.fx as fx

from adjoint_compile.explain import Report
from adjoint_compile.options import validate
from adjoint_compile.regions import Rejection, group_rejections, rejection_lines


# --- rejection reasons: only node references are masked -------------------------------------------------------


def _words_as_names() -> fx.GraphModule:
    def f(a, skip, the):
        x = a + skip * the
        return x + x * the

    return fx.symbolic_trace(f)  # nodes: a, skip, the, mul, add, mul_1, add_1, output


def _skip_rejections() -> list[Rejection]:
    why = "block node {} of the residual layer at {} is also used by {} outside the layer (a skip across layers)"
    return [Rejection("residual_chain", "add", why.format("mul", "add", "a")),
            Rejection("residual_chain", "add_1", why.format("mul_1", "add_1", "skip")),
            Rejection("recurrence", "the", "the carry the passes through a skip: not linear")]


def test_words_that_are_also_node_names_are_not_masked():
    gm = _words_as_names()
    assert {"a", "skip", "the"} <= {n.name for n in gm.graph.nodes}
    groups = group_rejections(_skip_rejections(), (n.name for n in gm.graph.nodes))
    assert groups[0] == ("residual_chain",
                         "block node <node> of the residual layer at <node> is also used by <node> outside the layer "
                         "(a skip across layers)", ["add", "add_1"])
    # a group of one: its reason as written, node names included
    assert groups[1] == ("recurrence", "the carry the passes through a skip: not linear", ["the"])
    lines = rejection_lines(groups)
    assert lines[0].startswith("residual_chain x2 (at add, add_1): ") and "(a skip across layers)" in lines[0]
    assert lines[1] == "recurrence at the: the carry the passes through a skip: not linear"


def test_a_node_every_member_names_is_shown_by_name():
    """The members differ in their anchors only: the node they all mention keeps its name."""
    rej = [Rejection("residual_chain", f"add_{i}", f"layer at add_{i} also feeds skip outside the layer")
           for i in (1, 2, 3)]
    ((_, why, nodes),) = group_rejections(rej, ["skip", "add_1", "add_2", "add_3"])
    assert why == "layer at <node> also feeds skip outside the layer" and nodes == ["add_1", "add_2", "add_3"]


def test_the_report_text_keeps_the_words():
    gm = _words_as_names()
    rep = Report([], _skip_rejections(), [gm], [], validate(None))
    text = str(rep)
    assert "(a skip across layers)" in text and "(<node> skip" not in text
    assert "of the residual layer at <node>" in text
    assert "recurrence at the: the carry the passes through a skip: not linear" in text
