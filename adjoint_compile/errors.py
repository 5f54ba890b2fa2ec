"""Exceptions users can catch."""
from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback


class OptionsError(ShortenTraceback, ValueError):
    """A bad ``options={...}`` entry.

    NB: it derives from dynamo's ``ShortenTraceback`` as well as ``ValueError`` because dynamo re-raises
    ``ShortenTraceback`` from a backend unchanged, whereas any other exception is wrapped in
    ``BackendCompilerFailed`` (a ``RuntimeError``); users should be able to write ``except ValueError``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)


class UnsupportedRegion(Exception):
    """Raised inside a pass when a candidate cannot be proven; callers turn it into a soft rejection."""
