"""adjoint-compile: a torch.compile backend ("adjoint") that gives linear recurrences and residual chains an
adjoint-sharded, truncated-adjoint or Highway-BP backward. See README.md and DESIGN.md."""
from __future__ import annotations

import logging

from . import backend, ops
from .errors import OptionsError
from .explain import Report, explain
from .options import Options, validate as validate_options

__all__ = ["backend", "ops", "explain", "Report", "Options", "OptionsError", "validate_options", "__version__"]
__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
