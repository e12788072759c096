"""Cache keys: what identifies a runtime-weight entry, computed before any weight is loaded.

A key is the SHA-256 of a canonical JSON document holding the checkpoint file identity, the caller's
transform identity, the runtime layout identity and the schema (name, shape, dtype) of the tensors the
module expects. Everything in it is known once the module is constructed, so a hit can skip the ordinary
load entirely (the reference design hashed the loaded bytes, so a hit still paid for the full load).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from weight_sync.errors import ConfigError

__all__ = [
    "CACHE_FORMAT_VERSION",
    "CacheKey",
    "CheckpointIdentityMode",
    "LayoutIdentity",
    "TensorSpec",
    "checkpoint_identity",
    "compute_cache_key",
]

# Bumped whenever the on-disk entry format or the key material changes meaning, so old entries miss.
CACHE_FORMAT_VERSION = 1

CheckpointIdentityMode = Literal["stat", "sha256"]

_HASH_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutIdentity:
    """The runtime layout a process's final weights have: which processes may share one entry.

    DP rank and SP rank are deliberately not fields: replicas that differ only there hold identical final
    weights and must share. TP world size and rank are fields, so two independent TP=2 engines share two
    entries (both TP0 workers map one, both TP1 workers the other). ``sp_impl``/``sp_size`` are a
    conservative guard: an SP implementation that reshapes weights must not share with one that does not.
    """

    tp_size: int
    tp_rank: int
    sp_impl: str | None
    sp_size: int
    dtype: str
    layout: str
    model_version: str

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"LayoutIdentity.tp_size must be an int >= 1, got: {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"LayoutIdentity.tp_rank must be in [0, {self.tp_size}), got: {self.tp_rank!r}"
            )
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ConfigError(f"LayoutIdentity.sp_size must be an int >= 1, got: {self.sp_size!r}")
        if self.sp_impl is not None and (not isinstance(self.sp_impl, str) or not self.sp_impl):
            raise ConfigError(
                f"LayoutIdentity.sp_impl must be None or a non-empty str, got: {self.sp_impl!r}"
            )
        if self.sp_size > 1 and self.sp_impl is None:
            raise ConfigError(
                f"LayoutIdentity.sp_impl must name the SP implementation when sp_size > 1, "
                f"got sp_size={self.sp_size} with sp_impl=None"
            )
        for field in ("dtype", "layout", "model_version"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"LayoutIdentity.{field} must be a non-empty str, got: {value!r}")

    def to_json(self) -> dict[str, object]:
        """The identity as a JSON-ready dict (field order is irrelevant: keys are sorted when hashed)."""
        return asdict(self)

    def describe(self) -> str:
        """A short human-readable form for logs and ``weight-sync cache ls``."""
        sp = f"sp={self.sp_impl}x{self.sp_size}" if self.sp_impl else f"sp={self.sp_size}"
        return (
            f"tp={self.tp_rank}/{self.tp_size} {sp} {self.dtype} {self.layout} "
            f"model={self.model_version}"
        )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the module expects of one cached tensor before loading: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(int(d) for d in t.shape), t.dtype)

    def to_json(self) -> list[object]:
        return [self.name, list(self.shape), str(self.dtype).removeprefix("torch.")]


@dataclass(frozen=True, slots=True)
class CacheKey:
    """The entry key: ``digest`` names the entry directory; ``material`` is what was hashed."""

    digest: str
    material: Mapping[str, object]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_identity(
    files: Sequence[str | os.PathLike], *, mode: CheckpointIdentityMode = "stat"
) -> list[dict[str, object]]:
    """Identify checkpoint files without loading them.

    ``"stat"`` (cheap, the default) uses the resolved path, size, inode, mtime_ns and ctime_ns: a file
    rewritten in place or replaced (even by ``cp -p``, which keeps mtime) changes ctime or inode, so a
    stale entry is never hit; the price is a miss after a harmless ``chmod``. ``"sha256"`` hashes the
    contents (one read of the checkpoint) and keys on file name, size and hash, so copies of the same
    checkpoint at different paths share entries.
    """
    if mode not in ("stat", "sha256"):
        raise ConfigError(f"checkpoint identity mode must be 'stat' or 'sha256', got: {mode!r}")
    if not files:
        raise ConfigError("checkpoint_files must name at least one file, got an empty sequence")
    out: list[dict[str, object]] = []
    for f in sorted({Path(os.path.realpath(p)) for p in files}):
        try:
            st = f.stat()
        except OSError as e:
            raise ConfigError(f"checkpoint file {f} cannot be read: {e}") from e
        if mode == "stat":
            out.append(
                {
                    "path": str(f),
                    "size": st.st_size,
                    "ino": st.st_ino,
                    "mtime_ns": st.st_mtime_ns,
                    "ctime_ns": st.st_ctime_ns,
                }
            )
        else:
            out.append({"name": f.name, "size": st.st_size, "sha256": _sha256_file(f)})
    if mode == "sha256":
        out.sort(key=lambda d: (str(d["name"]), str(d["sha256"])))
    return out


def compute_cache_key(
    *,
    checkpoint: Sequence[Mapping[str, object]],
    transform_id: str,
    layout: LayoutIdentity,
    tensors: Sequence[TensorSpec],
) -> CacheKey:
    """Hash the key material into the entry digest (canonical JSON: sorted keys, no whitespace)."""
    if not isinstance(transform_id, str) or not transform_id.strip():
        raise ConfigError(f"transform_id must be a non-empty str, got: {transform_id!r}")
    material: dict[str, object] = {
        "format": CACHE_FORMAT_VERSION,
        "checkpoint": [dict(c) for c in checkpoint],
        "transform_id": transform_id,
        "layout": layout.to_json(),
        "tensors": [t.to_json() for t in sorted(tensors, key=lambda t: t.name)],
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), material)
