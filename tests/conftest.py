import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty dynamo caches, so a compile in one test never serves another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
