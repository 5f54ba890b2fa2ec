"""Small models that ship with the package: the demo trains :class:`.selective_ssm.SSMStack`, so ``adjoint-compile
demo`` works from an installed wheel as well as from a checkout. The examples (examples/*.py) build on them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["print_explain"]


def print_explain(make: Callable[[], Any], example_inputs: Callable[[], tuple[Any, ...]],
                  options: dict[str, Any] | None = None) -> None:
    """What an example prints when run as a script: ``explain(make(), *example_inputs(), options=options)``, after
    ``torch.manual_seed(0)``."""
    import torch

    from ..explain import explain

    torch.manual_seed(0)
    print(explain(make(), *example_inputs(), options=options))
