"""Agreed failures: turning the all-gathered status records of a phase into one error on every rank.

Every rank raises the same message (each failed rank, its phase, error type and message). The class is
chosen from what failed, and is always a :class:`TransportError` as well, so callers can catch either
the specific kind (a checksum, a manifest problem, the trainer's source) or every transport failure.
"""

from __future__ import annotations

from typing import Any

from weight_sync.errors import (
    ChecksumError,
    ManifestError,
    SourceError,
    TransportError,
    TransportTimeout,
)
from weight_sync.transport.wire import RankStatus

__all__ = [
    "FOLDED",
    "AgreedChecksumError",
    "AgreedManifestError",
    "AgreedSourceError",
    "all_folded",
    "raise_agreed",
    "status_of",
]

_MANIFEST_FAMILY = {
    "ManifestError", "AgreedManifestError", "LayoutMismatchError", "UnknownTensorError",
    "DuplicateTensorError", "IncompleteUpdateError",
}


class AgreedChecksumError(ChecksumError, TransportError):
    """A bucket failed its end-to-end checksum on some rank; every rank raises this."""


class AgreedManifestError(ManifestError, TransportError):
    """The manifest or the tensors disagreed with a receiver's model (or with each other)."""


class AgreedSourceError(SourceError, TransportError):
    """The trainer's weight source failed mid-update; every rank raises this."""


def status_of(rank: int, phase: str, error: BaseException | None, report: dict[str, Any] | None = None) -> RankStatus:
    """This rank's status record for ``phase``: ok, or the error's type and message."""
    if error is None:
        return RankStatus(rank=rank, ok=True, phase=phase, report=report or {})
    return RankStatus(rank=rank, ok=False, phase=phase, error_type=type(error).__name__,
                      message=str(error), report=report or {})


# Set in a receiver's record of a call's exchange when it also prepared the commit (``then_finish``).
FOLDED = "folded"


def all_folded(statuses: list[RankStatus]) -> bool:
    """Whether every receiver (rank 1..) prepared the commit in a call's exchange: then the exchange was
    the finish's vote too, and every rank commits after it (decided from the same records everywhere)."""
    return len(statuses) > 1 and all(s.ok and s.report.get(FOLDED) for s in statuses[1:])


def raise_agreed(statuses: list[RankStatus], phase: str, world_size: int, *, local: BaseException | None = None) -> None:
    """Raise (on every rank alike) if any record of the exchange failed; ``local`` becomes the cause."""
    failed = [s for s in statuses if not s.ok]
    if not failed:
        return
    parts = [
        f"rank {s.rank}{' (sender)' if s.rank == 0 else ''} in {s.phase}: {s.error_type}: {s.message}"
        for s in failed
    ]
    msg = f"{phase} failed on {len(failed)} of {world_size} ranks: " + " | ".join(parts)
    types = {s.error_type for s in failed}
    cls: type[TransportError]
    if types & {"TransportTimeout"}:
        cls = TransportTimeout
    elif types & {"ChecksumError", "AgreedChecksumError"}:
        cls = AgreedChecksumError
    elif types & _MANIFEST_FAMILY:
        cls = AgreedManifestError
    elif types & {"SourceError", "AgreedSourceError"}:
        cls = AgreedSourceError
    else:
        cls = TransportError
    err = cls(msg)
    err.statuses = failed  # type: ignore[attr-defined]
    raise err from local
