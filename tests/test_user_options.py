"""Option validation: one test per rule of DESIGN.md §1's table, through torch.compile as users hit it."""
import pytest
import torch

import adjoint_compile as ac
from adjoint_compile.options import validate


def _compile_and_call(options):
    f = torch.compile(lambda x: x * 2, backend="adjoint", options=options)
    return f(torch.ones(3))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"mode": "truncated"}, ["window", "required", "truncated"]),
        ({"mode": "highway"}, ["iterations", "required", "highway"]),
        ({"mode": "truncated", "window": 0}, ["window", "0", ">= 1"]),
        ({"mode": "highway", "iterations": -1}, ["iterations", "-1", ">= 0"]),
        ({"inner": "foo"}, ["inner", "foo", "inductor", "aot_eager", "eager"]),
        ({"windw": 8}, ["windw", "window"]),
        ({"mode": "fast"}, ["mode", "fast", "exact", "truncated", "highway"]),
        ({"shard_size": 0}, ["shard_size", "0"]),
        ({"shard_size": 2.5}, ["shard_size", "2.5"]),
        ({"window": True, "mode": "truncated"}, ["window", "True"]),
        ({"verify": "yes"}, ["verify", "yes"]),
        ({"cuda_graphs": 1}, ["cuda_graphs", "1", "True or False"]),
        ({"devices": ["cpu"]}, ["devices", "no longer exists", "sequence_parallel"]),
        ({"sequence_parallel": "world"}, ["sequence_parallel", "world"]),
    ],
)
def test_bad_option_raises_value_error_naming_key_and_value(options, words):
    with pytest.raises(ValueError) as info:
        _compile_and_call(options)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert isinstance(info.value, ac.OptionsError)


def test_options_must_be_a_dict():
    with pytest.raises(ValueError, match="must be a dict"):
        validate(["mode", "exact"])


def test_defaults_and_good_values():
    assert validate(None) == validate({}) == ac.Options()
    o = validate({"mode": "truncated", "window": 16, "shard_size": 3, "inner": "eager", "verify": True})
    assert (o.mode, o.window, o.shard_size, o.inner, o.verify) == ("truncated", 16, 3, "eager", True)
    assert validate({}).cuda_graphs is True and validate({"cuda_graphs": False}).cuda_graphs is False
    assert validate({"mode": "highway", "iterations": 0}).iterations == 0
    assert validate({"sequence_parallel": False}).sequence_parallel is None


def test_good_options_compile_and_run():
    out = _compile_and_call({"mode": "truncated", "window": 4, "inner": "eager"})
    assert torch.equal(out, torch.full((3,), 2.0))


def test_explain_validates_options_too():
    with pytest.raises(ValueError, match="iterations"):
        ac.explain(lambda x: x + 1, torch.ones(2), options={"mode": "highway"})
