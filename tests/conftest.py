import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty dynamo caches, so a compile in one test never serves another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _prefilter_agrees(monkeypatch):
    """Every graph a test runs the pipeline on also checks the matchers' pre-filter (passes/match/prefilter.py): a matcher
    it skips runs anyway (its findings are used) and must have found nothing."""
    from adjoint_compile.passes.match import prefilter

    monkeypatch.setattr(prefilter, "CHECK", True)
    prefilter.DISAGREEMENTS.clear()
    yield
    assert not prefilter.DISAGREEMENTS, f"the pre-filter skipped a matcher that finds something: {prefilter.DISAGREEMENTS}"
