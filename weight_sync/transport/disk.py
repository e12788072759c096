"""The disk backend: each update becomes a directory of safetensors files, read back in block order.

The writer cuts the update into the same block-complete buckets as the wire backends, writes one
safetensors file per bucket into a private temporary directory (0700), then a ``manifest.json`` with
per-tensor checksums, renames the directory into place and finally replaces ``LATEST`` (JSON) to point at
it, so a reader never sees a half-written update. Readers wait for ``LATEST`` to move past the last update
they applied, validate the manifest against the model before any write, map each file (mmap, zero copy),
verify every tensor's checksum, and load the files in order. No pickle anywhere; file names come from the
manifest only after matching a fixed pattern.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from weight_sync.checksum import tensor_checksum
from weight_sync.errors import ChecksumError, ManifestError, TransportError, TransportTimeout
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.safetensors_io import map_safetensors
from weight_sync.transport.config import ALIGN_BYTES, TransportConfig
from weight_sync.transport.layout import plan_buckets
from weight_sync.transport.wire import PROTOCOL_VERSION, decode_json

__all__ = ["DiskReader", "DiskWriter"]

_UPDATE_DIR = re.compile(r"^update-[0-9]{8}$")
_FILE = re.compile(r"^bucket-[0-9]{5}-[0-9]{5}\.safetensors$")
LATEST = "LATEST"


class DiskWriter:
    """Sender half: writes updates under ``config.directory`` (created 0700 if missing)."""

    def __init__(self, config: TransportConfig) -> None:
        assert config.directory is not None
        self.config = config
        self.root = Path(config.directory)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._tmp: Path | None = None
        self._files: list[dict[str, Any]] = []
        self._metas: list[TensorMeta] = []
        self._seq = self._latest_seq()
        self._call = 0

    def _latest_seq(self) -> int:
        p = self.root / LATEST
        if not p.exists():
            return 0
        return int(decode_json(p.read_text(), f"{p}")["seq"])

    def start(self, manifest: Manifest, version: Any, seq: int) -> None:
        self.abort()
        # Continue numbering after whatever this directory already holds (a restarted trainer).
        self._seq = max(self._seq, self._latest_seq()) + 1
        self._manifest, self._version = manifest, version
        self._tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        self._tmp.mkdir(mode=0o700)
        self._files, self._metas, self._call = [], [], 0

    def write_call(self, metas: tuple[TensorMeta, ...], source: Any) -> int:
        """Write one call's tensors (``source`` is the sender's checked stream) bucket by bucket."""
        from safetensors.torch import save_file

        assert self._tmp is not None
        self._call += 1
        layout = plan_buckets(metas, self.config.bucket_bytes, ALIGN_BYTES)
        index = 0
        for bucket in layout.buckets:
            tensors: dict[str, torch.Tensor] = {}
            entries = []
            for seg in bucket.segments:
                if seg.tensor_offset:  # a split tensor was written whole where it started
                    continue
                flat = source.next_flat(seg.index)
                meta = metas[seg.index]
                t = flat.view(meta.dtype).view(meta.shape)
                checksum = tensor_checksum(t)
                tensors[meta.name] = t.cpu()
                entries.append({"name": meta.name, "checksum": checksum})
                self._metas.append(TensorMeta(meta.name, meta.dtype, meta.shape, checksum))
                index += 1
            if tensors:
                name = f"bucket-{self._call:05d}-{bucket.index:05d}.safetensors"
                save_file(tensors, str(self._tmp / name), metadata={"format": "pt"})
                self._files.append({"file": name, "tensors": entries})
        return index

    def finish(self) -> Path:
        assert self._tmp is not None
        manifest = Manifest(tuple(self._metas), version=self._version)
        body = {"protocol": PROTOCOL_VERSION, "seq": self._seq, "version": self._version,
                "manifest": json.loads(manifest.to_json()), "files": self._files}
        (self._tmp / "manifest.json").write_text(json.dumps(body))
        final = self.root / f"update-{self._seq:08d}"
        os.replace(self._tmp, final)
        self._tmp = None
        tmp_latest = self.root / f".{LATEST}.{uuid.uuid4().hex}"
        tmp_latest.write_text(json.dumps({"protocol": PROTOCOL_VERSION, "seq": self._seq, "dir": final.name}))
        os.replace(tmp_latest, self.root / LATEST)
        self._prune()
        return final

    def _prune(self) -> None:
        dirs = sorted(p for p in self.root.iterdir() if _UPDATE_DIR.match(p.name))
        for old in dirs[: -self.config.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


class DiskReader:
    """Receiver half: applies the updates a DiskWriter publishes under ``root``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise TransportError(f"disk transport directory {self.root} does not exist")
        self.last_seq = 0
        self._dir: Path | None = None
        self._files: list[dict[str, Any]] = []

    def start(self, timeout_s: float) -> tuple[Manifest, Any]:
        """Wait for an update newer than the last one applied; return its manifest and version."""
        deadline = time.monotonic() + timeout_s
        latest = self.root / LATEST
        while True:
            if latest.exists():
                d = decode_json(latest.read_text(), str(latest))
                if int(d["seq"]) > self.last_seq:
                    break
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"disk transport: no update newer than {self.last_seq} appeared in {self.root} "
                    f"within {timeout_s:.1f} s"
                )
            time.sleep(0.01)
        name = d.get("dir", "")
        if not isinstance(name, str) or not _UPDATE_DIR.match(name):
            raise TransportError(f"{latest}: update directory {name!r} is not an update-NNNNNNNN name")
        self._dir = self.root / name
        body = decode_json((self._dir / "manifest.json").read_text(), f"{self._dir}/manifest.json")
        manifest = Manifest.from_json(json.dumps(body["manifest"]))
        self._files = body["files"]
        for f in self._files:
            if not isinstance(f.get("file"), str) or not _FILE.match(f["file"]):
                raise TransportError(f"{self._dir}/manifest.json: file name {f.get('file')!r} is not a bucket file name")
        self._manifest = manifest
        self._seq = int(body["seq"])
        return manifest, body.get("version")

    def load_all(self, session: Any) -> int:
        """Verify and load every file in order; the checksums of a file are checked before its load."""
        assert self._dir is not None
        count = 0
        for f in self._files:
            mapped = map_safetensors(self._dir / f["file"])
            batch = []
            for e in f["tensors"]:
                name = e["name"]
                if name not in mapped:
                    raise ManifestError(f"{self._dir / f['file']}: lacks {name!r} listed in manifest.json")
                got = tensor_checksum(mapped[name])
                if got != e["checksum"]:
                    raise ChecksumError(
                        f"{self._dir / f['file']}: {name} checksum {got:#018x}, manifest says {e['checksum']:#018x}"
                    )
                batch.append((name, mapped[name]))
            session.load(batch)
            count += len(batch)
        self.last_seq = self._seq
        return count

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current update's tensors in block order (mapped, unverified): for inspection."""
        assert self._dir is not None
        for f in self._files:
            mapped = map_safetensors(self._dir / f["file"])
            for e in f["tensors"]:
                yield e["name"], mapped[e["name"]]
