"""Exceptions raised by weight_sync: one root class, a few subclasses callers can act on.

Every message names the thing (a tensor, a file, a flag), what was expected and what was found.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ChecksumError",
    "ConfigError",
    "DeltaBaseError",
    "DuplicateTensorError",
    "IncompleteUpdateError",
    "LayoutMismatchError",
    "ManifestError",
    "PointerChangedError",
    "SourceError",
    "TornModelError",
    "TransportError",
    "TransportTimeout",
    "UnknownTensorError",
    "UpdateStateError",
    "WeightSyncError",
]


class WeightSyncError(Exception):
    """Root of every error weight_sync raises on purpose."""


class ConfigError(WeightSyncError, ValueError):
    """A configuration value or combination is invalid (says which and why)."""


class ManifestError(WeightSyncError, ValueError):
    """A manifest disagrees with the receiver's plan or with the data that followed it."""


class DeltaBaseError(ManifestError):
    """A delta update's base (version, fingerprint) is not the engine's committed state; nothing written."""


class UnknownTensorError(WeightSyncError, KeyError):
    """A tensor name the model has no destination for."""

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable.
        return str(self.args[0]) if self.args else ""


class DuplicateTensorError(WeightSyncError, ValueError):
    """The same tensor name arrived twice within one update."""


class LayoutMismatchError(WeightSyncError, ValueError):
    """A tensor's shape, dtype or stride differs from what its destination expects."""


class IncompleteUpdateError(WeightSyncError):
    """An update finished while some expected tensors never arrived."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class PointerChangedError(WeightSyncError):
    """A graph-visible tensor changed data_ptr, shape, dtype or stride during an update."""


class SourceError(WeightSyncError):
    """The weight source (an iterator, a file, a sender) failed in the middle of an update."""


class TornModelError(WeightSyncError):
    """The model holds a mix of weight versions after a failed update and refuses to serve."""


class UpdateStateError(WeightSyncError):
    """A lifecycle call arrived in the wrong state (e.g. load after finish)."""


class ChecksumError(WeightSyncError):
    """Received bytes do not match the checksum the sender computed."""


class TransportError(WeightSyncError):
    """A transport operation failed; the message names the peer and the phase."""


class TransportTimeout(TransportError, TimeoutError):
    """A blocking transport wait ran past its timeout."""


class CacheError(WeightSyncError):
    """The runtime-weight cache could not be used (lock timeout, validation, layout)."""
