"""The exceptions libspice calls raise: each carries the C status and says why and what to do."""

from __future__ import annotations


class SpiceError(RuntimeError):
    """A libspice call failed; the message says why and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DecodeFailedError(SpiceError):
    """libspice stopped a decode because it could not go on exactly (the message
    says why: e.g. a read of the model file failed); nothing was generated from it."""


class IncompatibleModelError(SpiceError):
    """The model cannot be served by the hook (dense, or loaded with the wrong settings)."""
