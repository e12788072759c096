"""Every record that crosses the wire, in one place: JSON for metadata, fixed int64 words for trailers.

Nothing here is ever pickled. Records are frozen dataclasses with ``to_json`` / ``from_json``; decoding
checks the protocol version and required fields and raises :class:`TransportError` naming the record.

Wire layout of a bucket (the same for broadcast and shared-buffer backends)::

    [ payload: tensors at 256-byte aligned offsets | trailer: 8 little-endian int64 words ]

The trailer words are ``TRAILER_FIELDS`` in order; the checksum halves are the two 32-bit sums of
:func:`weight_sync.checksum.bucket_checksum`.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from weight_sync.errors import TransportError

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "RECORD_WORDS",
    "STATUS_ABORT",
    "STATUS_OK",
    "STATUS_SLOT_BYTES",
    "TRAILER_BYTES",
    "TRAILER_FIELDS",
    "ControlHeader",
    "Hello",
    "IpcBufferHandle",
    "RankStatus",
    "ShmBufferHandle",
    "WireParams",
    "b64decode",
    "b64encode",
    "decode_json",
]

# 2: control messages carry their first 4 KiB inline (one broadcast), ``verify`` in the wire parameters,
# shm/ipc doorbells over a local socket instead of per-bucket collectives.
# 3: send() to one receiver may carry its call in the start header (``call_in_start``).
PROTOCOL_VERSION = 3
MAGIC = 0x5753_5943  # "WSYC": a trailer without it was never written by a sender
TRAILER_FIELDS = ("magic", "seq", "call", "bucket", "status", "payload_bytes", "checksum_hi", "checksum_lo")
TRAILER_BYTES = 8 * len(TRAILER_FIELDS)
STATUS_OK = 0
STATUS_ABORT = 1  # the sender could not produce this bucket; receivers must stop loading
STATUS_SLOT_BYTES = 8192  # one rank's status JSON in the all-gather (longer messages are truncated)
RECORD_WORDS = 8  # a doorbell record (READY / RELEASE of one bucket): 8 little-endian int64 words


def decode_json(raw: str | bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object sent by a peer; ``what`` names the record in the error."""
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TransportError(f"{what}: not valid JSON from the peer: {e}") from e
    if not isinstance(d, dict):
        raise TransportError(f"{what}: expected a JSON object from the peer, got {type(d).__name__}")
    proto = d.get("protocol", PROTOCOL_VERSION)
    if proto != PROTOCOL_VERSION:
        raise TransportError(
            f"{what}: peer speaks weight_sync wire protocol {proto}, this side speaks {PROTOCOL_VERSION}"
        )
    return d


R = TypeVar("R")


def _record(cls: type[R], d: dict[str, Any], what: str, *keys: str) -> R:
    """Build the wire record ``cls`` from a peer's dict: ``keys`` must be present, unknown keys are
    ignored (a newer peer may add fields), and a missing one is a TransportError naming the record."""
    missing = [k for k in keys if k not in d]
    if missing:
        raise TransportError(f"{what}: record lacks field(s) {missing}: {sorted(d)}")
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return cls(**{k: d[k] for k in fields if k in d})


def b64encode(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def b64decode(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text.encode("ascii"), validate=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class WireParams:
    """What the sender decided and every receiver must use (shipped at connect)."""

    backend: str
    bucket_bytes: int
    num_buffers: int
    checksum: bool
    timeout_s: float
    align_bytes: int
    world_size: int
    verify: str = "deferred"
    zero_copy: bool = False
    protocol: int = PROTOCOL_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WireParams:
        d = decode_json(raw, "wire parameters")
        return _record(cls, d, "wire parameters", "backend", "bucket_bytes", "num_buffers", "checksum",
                 "timeout_s", "align_bytes", "world_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hello:
    """A receiver announcing itself at connect: who it is, where, on which device."""

    rank: int
    host: str
    pid: int
    device: str
    device_uuid: str | None = None
    protocol: int = PROTOCOL_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Hello:
        d = decode_json(raw, "receiver hello")
        return _record(cls, d, "receiver hello", "rank", "host", "pid", "device")

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host}, {self.device})"


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlHeader:
    """A phase announcement from the sender: 'start' (with the manifest), 'call', 'finish' or 'close'.

    start: ``version`` and ``manifest`` (Manifest JSON), or ``reuse_manifest_of``: the update whose
    (agreed) manifest this one repeats, so an unchanged manifest is not re-encoded every step.
    call: ``first`` and ``count`` select a run of the manifest, ``num_buckets`` lets receivers
    cross-check their own layout of it; ``then_finish``: the sender finishes right after this call (its
    ``send``), so receivers that run the whole update may prepare the commit and vote on it in the call's
    status exchange (``WeightReceiver._on_call``). zero_copy (zero-copy transports): ``drop`` (region ids
    receivers release, any kind), ``reset`` (release every region), and for a call ``regions`` (new
    exports) and ``table`` ([region id, byte offset] per tensor; None when the sender failed to
    produce the call's tensors).
    delta (start, delta sync): ``mode`` ('full' records the receivers' delta base, 'delta' applies on
    it), ``base_version``, ``base_fingerprints`` and ``wire`` (see ``transport/delta_sync.py``).
    call_in_start (start, ``send()`` to one receiver of a manifest it accepted before): the header is
    also the update's one call (``call``, ``first``, ``count``, ``num_buckets``, ``then_finish``,
    ``zero_copy``) and the start has no status exchange of its own: the call's exchange carries the
    receiver's verdict on the manifest too. With one receiver, no other receiver can have written when it
    refuses, so this keeps the start's promise.
    """

    kind: str
    seq: int
    call: int = 0
    version: Any = None
    manifest: str | None = None
    reuse_manifest_of: int | None = None
    first: int = 0
    count: int = 0
    num_buckets: int = 0
    then_finish: bool = False
    zero_copy: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    call_in_start: bool = False
    protocol: int = PROTOCOL_VERSION

    KINDS = ("start", "call", "finish", "close")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise TransportError(f"control header: kind must be one of {self.KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ControlHeader:
        d = decode_json(raw, "control header")
        return _record(cls, d, "control header", "kind", "seq")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStatus:
    """One rank's outcome of a phase, all-gathered so that every rank sees every rank's result."""

    rank: int
    ok: bool
    phase: str
    error_type: str | None = None
    message: str | None = None
    report: dict[str, Any] = field(default_factory=dict)
    protocol: int = PROTOCOL_VERSION

    def _fields(self) -> dict[str, Any]:
        # Not ``asdict``: it deep-copies the report, and a status is encoded several times per update.
        return {"rank": self.rank, "ok": self.ok, "phase": self.phase, "error_type": self.error_type,
                "message": self.message, "report": self.report, "protocol": self.protocol}

    def to_bytes(self) -> bytes:
        raw = json.dumps(self._fields(), default=str).encode()
        if len(raw) <= STATUS_SLOT_BYTES:
            return raw
        # Keep the record valid JSON: shorten the message (then drop the report) until it fits.
        msg = self.message or ""
        short = RankStatus(rank=self.rank, ok=self.ok, phase=self.phase, error_type=self.error_type,
                           message=msg[: STATUS_SLOT_BYTES // 2] + " ...(truncated)", report={})
        return json.dumps(short._fields(), default=str).encode()[:STATUS_SLOT_BYTES]

    @classmethod
    def from_bytes(cls, raw: bytes, rank_hint: int) -> RankStatus:
        end = raw.find(b"\x00")  # a record is its JSON, then NUL padding to the slot's end
        raw = raw if end < 0 else raw[:end]
        if not raw:
            return cls(rank=rank_hint, ok=False, phase="?", error_type="TransportError",
                       message=f"rank {rank_hint} sent an empty status record")
        d = decode_json(raw, f"status of rank {rank_hint}")
        return _record(cls, d, f"status of rank {rank_hint}", "rank", "ok", "phase")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShmBufferHandle:
    """A CPU shared-memory buffer: a file name inside the sender's shm directory and its size."""

    name: str
    directory: str
    nbytes: int
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShmBufferHandle:
        return _record(cls, d, "shm buffer handle", "name", "directory", "nbytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class IpcBufferHandle:
    """A CUDA IPC export of one sender buffer for one receiver (torch's ``_share_cuda_`` fields).

    Byte fields are base64. ``device_uuid`` identifies the physical GPU, because device indices differ
    between processes with different CUDA_VISIBLE_DEVICES.
    """

    device_uuid: str
    handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool
    nbytes: int
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IpcBufferHandle:
        return _record(cls, d, "CUDA IPC buffer handle", "device_uuid", "handle", "storage_size_bytes",
                 "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle",
                 "event_sync_required", "nbytes")
