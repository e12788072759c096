"""Hand a weights iterator to engine worker processes through a private spool, never through pickle.

vLLM forwards ``collective_rpc`` arguments to worker processes with msgpack and then pickle, which cannot
carry tensors ("cannot pickle memoryview objects") and would copy them twice if it could. Instead the
caller's side streams the iterator once into a spool directory (``data.bin`` plus ``manifest.json``, in
/dev/shm when available, mode 0700) and sends a small JSON-able handle; each worker maps ``data.bin``
read-only and iterates zero-copy views in the original order. The manifest (names, dtypes, shapes) is
complete before any worker reads a byte, so the update is validated before its first write.

Tensor names never become file paths; the handle names only the spool directory, which the reader checks
(absolute, a real directory, our prefix, no symlinks) before opening anything in it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from weight_sync.checksum import raw_bytes
from weight_sync.errors import (
    DuplicateTensorError,
    LayoutMismatchError,
    ManifestError,
)
from weight_sync.manifest import Manifest, TensorMeta, dtype_from_str, dtype_to_str
from weight_sync.reload.api import guarded_source

__all__ = [
    "HANDLE_KEY",
    "WeightsHandoff",
    "as_handle",
    "is_handoff",
    "open_handoff",
    "share_weights",
]

HANDLE_KEY = "weight_sync_handoff"
_FORMAT = "weight_sync.handoff/1"
_PREFIX = "ws-handoff-"
_ALIGN = 64  # every tensor starts on a 64-byte boundary, so typed views need no copy


def _default_dir() -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


class WeightsHandoff:
    """A spool written from (name, tensor) pairs; use as a context manager, pass :attr:`handle` on.

    ``close()`` (or leaving the ``with`` block) deletes the spool. Readers that still map it keep their
    pages until they drop their tensors, so closing right after the receiving call returns is safe.
    """

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest

    @property
    def handle(self) -> dict[str, str]:
        """What travels to the workers: ``{"weight_sync_handoff": "/dev/shm/ws-handoff-..."}``."""
        return {HANDLE_KEY: str(self.path)}

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> WeightsHandoff:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    directory: str | os.PathLike | None = None,
    version: int | str | None = None,
) -> WeightsHandoff:
    """Stream ``weights`` into a new spool (order kept) and return it; device tensors are copied to host.

    Raises :class:`SourceError` if the iterator fails, naming the last tensor written; the partial spool
    is removed.
    """
    base = Path(directory) if directory is not None else Path(_default_dir())
    path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=base))  # mkdtemp creates it 0700
    try:
        metas: list[TensorMeta] = []
        offsets: list[int] = []
        seen: set[str] = set()
        offset = 0
        with open(path / "data.bin", "wb") as f:
            for item in guarded_source(weights):
                name, tensor = _check_item(item)
                if name in seen:
                    raise DuplicateTensorError(f"{name}: appears twice in the weights to share")
                seen.add(name)
                pad = (-offset) % _ALIGN
                if pad:
                    f.write(b"\0" * pad)
                    offset += pad
                host = tensor.detach().to("cpu").contiguous()
                raw = raw_bytes(host)
                if raw.numel():
                    f.write(raw.numpy().data)
                metas.append(TensorMeta(name, host.dtype, tuple(host.shape)))
                offsets.append(offset)
                offset += raw.numel()
        manifest = Manifest(tuple(metas), version=version)
        doc = {
            "format": _FORMAT,
            "version": version,
            "tensors": [{**m.to_json(), "offset": o} for m, o in zip(metas, offsets)],
        }
        tmp = path / "manifest.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path / "manifest.json")
        return WeightsHandoff(path, manifest)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _check_item(item: Any) -> tuple[str, torch.Tensor]:
    try:
        name, tensor = item
    except (TypeError, ValueError):
        raise LayoutMismatchError(
            f"weights must be (name, tensor) pairs, got {type(item).__name__}"
        ) from None
    if not isinstance(name, str) or not name:
        raise ManifestError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise LayoutMismatchError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype_to_str(tensor.dtype)  # refuses dtypes the manifest cannot name
    return name, tensor


def is_handoff(obj: Any) -> bool:
    """Whether ``obj`` is a handle made by :func:`share_weights` (after any JSON/msgpack round trip)."""
    return isinstance(obj, dict) and set(obj) == {HANDLE_KEY} and isinstance(obj[HANDLE_KEY], str)


def as_handle(obj: Any) -> dict[str, str] | None:
    """``obj`` as a handle if it is one, or its JSON text (HTTP routes pass strings); else None."""
    if is_handoff(obj):
        return obj
    if isinstance(obj, str) and obj.lstrip().startswith("{"):
        try:
            parsed = json.loads(obj)
        except json.JSONDecodeError:
            return None
        return parsed if is_handoff(parsed) else None
    return None


class HandoffReader:
    """The receiving side of a spool: its manifest and an iterator of zero-copy read-only views."""

    def __init__(self, path: Path, manifest: Manifest, offsets: list[int]) -> None:
        self.path = path
        self.manifest = manifest
        self._offsets = offsets

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        data = self.path / "data.bin"
        size = data.stat().st_size
        if size == 0:
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            # A private mapping: the workers never write, and the page cache is shared with the writer.
            storage = torch.UntypedStorage.from_file(str(data), shared=False, nbytes=size)
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload, arg-type]
        for meta, offset in zip(self.manifest, self._offsets):
            end = offset + meta.nbytes
            if end > size:
                raise ManifestError(
                    f"{meta.name}: spool {self.path} declares bytes {offset}..{end}, past its end ({size})"
                )
            yield meta.name, flat[offset:end].view(meta.dtype).view(meta.shape)


def open_handoff(handle: Any) -> HandoffReader:
    """Open the spool a handle (or its JSON text) names; raises :class:`ManifestError` naming the problem."""
    parsed = as_handle(handle)
    if parsed is None:
        raise ManifestError(f"not a weight_sync handoff handle: {handle!r}")
    handle = parsed
    path = Path(handle[HANDLE_KEY])
    if not path.is_absolute() or not path.name.startswith(_PREFIX):
        raise ManifestError(f"handoff path {str(path)!r} is not an absolute {_PREFIX}* directory")
    if path.is_symlink() or not path.is_dir():
        raise ManifestError(f"handoff path {str(path)!r} is not a directory (was it closed already?)")
    try:
        doc = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"handoff {path}: cannot read manifest.json: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ManifestError(f"handoff {path}: format is {doc.get('format')!r}, expected {_FORMAT!r}")
    metas, offsets = [], []
    for entry in doc.get("tensors", []):
        try:
            metas.append(TensorMeta(entry["name"], dtype_from_str(entry["dtype"]),
                                    tuple(int(d) for d in entry["shape"])))
            offsets.append(int(entry["offset"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"handoff {path}: malformed entry {entry!r}") from e
    return HandoffReader(path, Manifest(tuple(metas), version=doc.get("version")), offsets)
