"""The mpitrain exception hierarchy.

Every error raised on purpose by mpitrain derives from :class:`MpitrainError`.
Local misuse (a bad argument that this rank can see on its own) is also a
``TypeError`` or ``ValueError`` so that ordinary Python code catches it; errors that
involve other ranks (a mismatch between ranks, a stall) are ``RuntimeError``s, as
Horovod users' code expects.
"""

from __future__ import annotations


class MpitrainError(Exception):
    """Base class of every error mpitrain raises on purpose."""


class ArgumentError(MpitrainError, ValueError):
    """A value passed to mpitrain is not acceptable (wrong shape, unknown name, ...)."""


class DtypeError(MpitrainError, TypeError):
    """An array's dtype (or type) is not supported for the requested operation."""


class UnsupportedError(MpitrainError, NotImplementedError):
    """A valid request that mpitrain (like Horovod) does not support in this setting,
    e.g. Adasum over a rank count that is not a power of two."""


class CommunicationError(MpitrainError, RuntimeError):
    """An error that involves other ranks."""


class MismatchError(CommunicationError):
    """Ranks called the same collective with arguments that disagree."""


class StallError(CommunicationError):
    """A collective waited longer than the stall timeout for other ranks."""


class ResetRequired(MpitrainError, RuntimeError):
    """Raised on any rank inside :func:`mpitrain.elastic.run`: every rank recovers, as
    after the loss of a rank (the others see the default communicator revoked)."""


class NotInitializedError(MpitrainError, RuntimeError):
    """A module-level function was called before :func:`mpitrain.init`."""


class CheckpointError(MpitrainError, ValueError):
    """A checkpoint cannot be written or read (unsupported value, damaged file, ...)."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file is truncated, corrupted, or not a checkpoint at all."""
