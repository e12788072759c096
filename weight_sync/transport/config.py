"""TransportConfig: the sender's choice of backend and wire parameters, validated once.

The sender decides every wire parameter (bucket size, buffer count, checksums, timeout) and ships them to
the receivers at connect time, so the two ends can never disagree about how bytes are cut into buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weight_sync.errors import ConfigError

__all__ = ["ALIGN_BYTES", "BACKENDS", "VERIFY_MODES", "TransportConfig"]

BACKENDS = ("disk", "gloo", "ipc", "nccl", "shm")
# "deferred": each bucket's trailer and checksum are compared on the device into a per-call table that the
# host reads once, after the call's last bucket; "before_load": each bucket is read back and checked before
# any of it is loaded (one device->host round trip per bucket).
VERIFY_MODES = ("deferred", "before_load")
# Every tensor starts on a 256-byte boundary inside a bucket: typed views of any dtype are aligned and
# device copies use full-width loads.
ALIGN_BYTES = 256
_MIN_BUCKET_BYTES = 4 * ALIGN_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """How a :class:`~weight_sync.transport.WeightSender` moves weights.

    backend: 'nccl' (GPU broadcast), 'gloo' (CPU broadcast, same code path), 'ipc' (colocated, CUDA IPC
    buffers on the sender's GPU), 'shm' (colocated, CPU shared memory) or 'disk' (a safetensors
    directory). bucket_bytes: payload bytes per bucket; buckets hold complete blocks in block order and
    a block larger than a bucket spans several. num_buffers: buffers per side, allocated once (2 lets
    packing of bucket k+1 overlap the transfer of bucket k). timeout_s: bound on every blocking wait.
    checksum: compare an on-device checksum of every bucket end to end. verify: when receivers act on the
    trailer and checksum of a bucket: 'deferred' (default; compared on the device while later buckets
    keep flowing, read back once per update_weights call: a corrupt bucket may already be loaded when it is
    detected, but the update is then never committed) or 'before_load' (read back and checked before a
    byte of the bucket is loaded: one device->host synchronization per bucket). device: where the sender's
    buffers live (default: the current CUDA device for nccl/ipc, the CPU otherwise). host/port: where the
    rendezvous store listens (port 0: the OS picks one). directory: the disk backend's root.
    shm_dir: where shm buffers are created (a tmpfs). keep_versions: updates the disk backend keeps.
    zero_copy (ipc, shm): no buffers, no packing; receivers read the sender's own tensors in place, each
    storage exported once and kept mapped while it lives (see ``weight_sync.transport.zerocopy``): one
    device copy per byte. Needs ``checksum=False`` (nothing is in transit to checksum).
    delta: ``send()`` ships each tensor as its exact byte changes against the version every engine last
    committed (see ``weight_sync.transport.delta_sync``); the sender keeps a copy of the sent weights as
    that base, on the tensors' device (``delta_base="device"``) or in host memory (``"pinned"``), and
    every engine rank keeps one in host memory. delta_chunk_elems: elements per encoding chunk (a
    multiple of 8); each chunk goes as a bitmask, an index list or plain, whichever is smallest.
    """

    backend: str = "gloo"
    bucket_bytes: int = 64 << 20
    num_buffers: int = 2
    timeout_s: float = 120.0
    checksum: bool = True
    verify: str = "deferred"
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    directory: str | None = None
    shm_dir: str = "/dev/shm"
    keep_versions: int = 2
    zero_copy: bool = False
    delta: bool = False
    delta_base: str = "pinned"
    delta_chunk_elems: int = 1 << 16

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < _MIN_BUCKET_BYTES:
            raise ConfigError(f"bucket_bytes must be an int >= {_MIN_BUCKET_BYTES}, got {self.bucket_bytes!r}")
        if self.bucket_bytes % ALIGN_BYTES:
            raise ConfigError(
                f"bucket_bytes must be a multiple of {ALIGN_BYTES}, got {self.bucket_bytes} "
                f"(try {self.bucket_bytes - self.bucket_bytes % ALIGN_BYTES})"
            )
        if not isinstance(self.num_buffers, int) or not 2 <= self.num_buffers <= 8:
            raise ConfigError(f"num_buffers must be an int in [2, 8], got {self.num_buffers!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {list(VERIFY_MODES)}, got {self.verify!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65536), got {self.port!r}")
        if self.backend == "disk" and not self.directory:
            raise ConfigError("backend 'disk' needs directory= (where updates are written)")
        if not isinstance(self.keep_versions, int) or self.keep_versions < 1:
            raise ConfigError(f"keep_versions must be an int >= 1, got {self.keep_versions!r}")
        if self.zero_copy:
            if self.backend not in ("ipc", "shm"):
                raise ConfigError(
                    f"zero_copy needs a colocated backend ('ipc' or 'shm'), got backend={self.backend!r}"
                )
            if self.checksum:
                raise ConfigError(
                    "zero_copy reads the sender's tensors in place: no byte is in transit to checksum; "
                    "pass checksum=False with zero_copy=True"
                )
        if self.delta_base not in ("device", "pinned"):
            raise ConfigError(f"delta_base must be 'device' or 'pinned', got {self.delta_base!r}")
        if not isinstance(self.delta_chunk_elems, int) or not 8 <= self.delta_chunk_elems < 1 << 31 \
                or self.delta_chunk_elems % 8:
            raise ConfigError(f"delta_chunk_elems must be a multiple of 8 in [8, 2**31), got {self.delta_chunk_elems!r}")
        if self.delta and (self.zero_copy or self.backend == "disk"):
            raise ConfigError(
                f"delta needs a buffered transport (gloo, nccl, shm, ipc without zero_copy), got "
                f"backend={self.backend!r}, zero_copy={self.zero_copy}"
            )
        if self.device is not None:
            kind = self.device.split(":")[0]
            if self.backend in ("nccl", "ipc") and kind != "cuda":
                raise ConfigError(f"backend {self.backend!r} needs a CUDA device, got device={self.device!r}")
            if self.backend in ("gloo", "shm") and kind != "cpu":
                raise ConfigError(f"backend {self.backend!r} keeps its buffers on the CPU, got device={self.device!r}")

    @property
    def uses_group(self) -> bool:
        """Whether the backend forms a process group with the receivers (all but 'disk')."""
        return self.backend != "disk"

    def buffer_device(self) -> str:
        """The device of the sender's buffers ('cuda:N' resolved lazily by the sender)."""
        if self.device is not None:
            return self.device
        return "cuda" if self.backend in ("nccl", "ipc") else "cpu"
