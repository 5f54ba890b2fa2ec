"""adjoint-compile: a torch.compile backend ("adjoint") that gives linear recurrences and residual chains an
adjoint-sharded, truncated-adjoint or Highway-BP backward. See README.md (its Architecture section maps the
pipeline's stages to files)."""
from __future__ import annotations

import logging

from . import backend, ops
from .errors import OptionsError
from .explain import Report, explain, report
from .options import Options, validate as validate_options
from .passes.known_scans import ScanAdapter, register_scan, registered_scans, unregister_scan

__all__ = ["backend", "ops", "explain", "report", "Report", "Options", "OptionsError", "validate_options",
           "register_scan", "unregister_scan", "registered_scans", "ScanAdapter", "__version__"]
__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
