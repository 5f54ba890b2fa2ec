"""Exceptions users can catch."""
from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback


class OptionsError(ShortenTraceback, ValueError):
    """A bad ``options={...}`` entry.

    NB: it derives from dynamo's ``ShortenTraceback`` as well as ``ValueError`` because dynamo re-raises
    ``ShortenTraceback`` from a backend unchanged, whereas any other exception is wrapped in
    ``BackendCompilerFailed`` (a ``RuntimeError``); users should be able to write ``except ValueError``.

    ``str(error)`` is our message alone: on its way out dynamo appends its "Set TORCHDYNAMO_VERBOSE=1 for the
    internal stack trace ..." advice to ``args[0]`` (``torch._dynamo.exc.augment_exc_message``), which is about
    dynamo's own frames, not about the option; ``message`` keeps the text as raised.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)
        self.message = message

    def __str__(self) -> str:
        return self.message


class AdjointCompileWarning(UserWarning):
    """A warning from adjoint-compile meant for the user (e.g. torch.compile's ``mode=`` is ignored). Shown once per
    message by Python's default filters; ``warnings.filterwarnings("ignore", category=AdjointCompileWarning)``
    silences them all."""


class AdjointVerifyReport(AdjointCompileWarning):
    """The result of ``options={"verify": True}``: a sharded region's outputs and gradients against plain autograd
    on its first call. Also in ``adjoint_compile.report(compiled)``: ``region.details["fidelity"]``."""


class UnsupportedRegion(Exception):
    """Raised inside a pass when a candidate cannot be proven; callers turn it into a soft rejection."""


class SequenceParallelError(RuntimeError):
    """``sequence_parallel``: the graph cannot run split over the ranks (an op that mixes steps across the sequence,
    ranks that disagree on the model), raised on every rank of the group before any model data is exchanged."""


class PerSampleError(ShortenTraceback, ValueError):
    """``per_sample_clip`` cannot be honoured for this graph: an op mixes examples (batch norm in training mode, a
    reduction over the batch axis before the loss) or a parameter use cannot be attributed to examples. The message
    names the op and its source line.

    NB: a ``ShortenTraceback`` for the same reason as :class:`OptionsError`: dynamo re-raises it from the backend
    unwrapped, so ``except ValueError`` works.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)
        self.message = message

    def __str__(self) -> str:
        return self.message
