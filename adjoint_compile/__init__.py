"""adjoint-compile: a torch.compile backend ("adjoint") that gives linear recurrences, gated recurrences and residual
chains a different backward: adjoint-sharded (exact), truncated-adjoint or Highway-BP; sequences split over
torch.distributed ranks; per-example gradient norms and DP-SGD clipping. See README.md (what users get) and
docs/DESIGN.md (the design: contract, the pipeline's stages and their files, math)."""
from __future__ import annotations

import warnings as _warnings

with _warnings.catch_warnings():
    # NB: torch's own import says this when numpy is absent; nothing here needs numpy, so it is no news to the user
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

from . import backend, ops
from .errors import AdjointCompileWarning, AdjointVerifyReport, OptionsError, PerSampleError, SequenceParallelError
from .explain import Report, explain, per_sample_grad_norms, report
from .options import Options, validate as validate_options
from .passes.capture.known_scans import ScanAdapter, register_scan, registered_scans, unregister_scan
from .polyfills.hf_causal_lm import is_loss_only, loss_only

__all__ = ["backend", "ops", "explain", "report", "Report", "Options", "OptionsError", "SequenceParallelError",
           "AdjointCompileWarning", "AdjointVerifyReport", "PerSampleError", "per_sample_grad_norms", "validate_options",
           "register_scan", "unregister_scan", "registered_scans",
           "ScanAdapter", "loss_only", "is_loss_only", "__version__"]
__version__ = "0.1.0"

# NB: no NullHandler on the package's logger: with no handler configured anywhere (no TORCH_LOGS, no
# logging.basicConfig), Python's last-resort handler prints WARNING and above to stderr, so the backend's warnings
# (a graph kept with ordinary autograd, a missing C compiler, ...) reach the user by default. INFO and DEBUG stay
# silent until asked for (TORCH_LOGS="adjoint_compile" / "+adjoint_compile").
