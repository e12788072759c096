"""The JSON manifest of a cache entry: its files and tensors with SHA-256 digests, strictly validated.

A manifest is read from disk that another process (or a bit flip) wrote, so it is treated as untrusted
input: every field is type-checked, shard file names must match one fixed pattern (they are joined to the
entry directory, so ``../`` or ``/`` must never get through), tensor names must be dotted identifiers, and
the key inside must equal the directory's key. No pickle: the format is plain JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weight_sync.errors import CacheError
from weight_sync.offload.cache.identity import CACHE_FORMAT_VERSION

__all__ = [
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "SUPPORTED_DTYPES",
    "EntryManifest",
    "FileRecord",
    "TensorRecord",
    "parse_manifest",
    "shard_name",
]

MANIFEST_NAME = "manifest.json"
# A manifest lists one record per tensor; this bound is far above any real model and stops a corrupted
# or hostile file from being read into memory whole.
MAX_MANIFEST_BYTES = 64 << 20

# Final-weight dtypes the cache stores. Quantized storage (int8/uint8/fp8) is excluded: its meaning
# depends on scales and packing the cache does not model (v1 limitation).
SUPPORTED_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}

_SHARD_RE = re.compile(r"shard-(\d{5})-of-(\d{5})\.safetensors")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_KEY_RE = _SHA_RE


def shard_name(index: int, count: int) -> str:
    """The file name of shard ``index`` of ``count`` (the only file names an entry may contain)."""
    return f"shard-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One shard file: validated name, size in bytes and SHA-256 of its full contents."""

    name: str
    nbytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One cached tensor: qualified name, the shard holding it, dtype, shape and SHA-256 of its bytes."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sha256: str


@dataclass(frozen=True, slots=True)
class EntryManifest:
    """A parsed, validated entry manifest."""

    key: str
    key_material: Mapping[str, object]
    created_unix_s: float
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_json(self) -> str:
        doc = {
            "format": CACHE_FORMAT_VERSION,
            "key": self.key,
            "key_material": self.key_material,
            "created_unix_s": self.created_unix_s,
            "files": [{"name": f.name, "bytes": f.nbytes, "sha256": f.sha256} for f in self.files],
            "tensors": [
                {
                    "name": t.name,
                    "file": t.file,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "sha256": t.sha256,
                }
                for t in self.tensors
            ],
        }
        return json.dumps(doc, sort_keys=True, indent=1)


def _field(
    doc: Mapping[str, object], name: str, kind: type | tuple[type, ...], where: str
) -> object:
    if name not in doc:
        raise CacheError(f"{where}: missing field {name!r}")
    value = doc[name]
    # bool is an int subclass; a count written as true/false is corruption, not a number.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise CacheError(f"{where}: field {name!r} must be {kind}, found {value!r}")
    if not isinstance(value, kind):
        raise CacheError(f"{where}: field {name!r} must be {kind}, found {type(value).__name__}")
    return value


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not _SHA_RE.fullmatch(value):
        raise CacheError(f"{where}: expected a 64-hex-digit SHA-256, found {value!r}")
    return value


def parse_manifest(raw: bytes, *, expect_key: str, source: str) -> EntryManifest:
    """Parse and validate manifest bytes read from ``source``; raise :class:`CacheError` naming the problem."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CacheError(
            f"{source}: manifest is {len(raw)} bytes, expected at most {MAX_MANIFEST_BYTES}"
        )
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(f"{source}: manifest is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CacheError(f"{source}: manifest must be a JSON object, found {type(doc).__name__}")
    fmt = _field(doc, "format", int, source)
    if fmt != CACHE_FORMAT_VERSION:
        raise CacheError(f"{source}: manifest format {fmt}, expected {CACHE_FORMAT_VERSION}")
    key = _field(doc, "key", str, source)
    if key != expect_key or not _KEY_RE.fullmatch(str(key)):
        raise CacheError(
            f"{source}: manifest key {key!r} does not match its directory {expect_key!r}"
        )
    material = _field(doc, "key_material", dict, source)
    assert isinstance(material, dict)
    created = _field(doc, "created_unix_s", (int, float), source)
    assert isinstance(created, (int, float))

    raw_files = _field(doc, "files", list, source)
    assert isinstance(raw_files, list)
    if not raw_files:
        raise CacheError(f"{source}: manifest lists no files")
    files: list[FileRecord] = []
    for i, rec in enumerate(raw_files):
        where = f"{source}: files[{i}]"
        if not isinstance(rec, dict):
            raise CacheError(f"{where}: expected an object, found {type(rec).__name__}")
        name = _field(rec, "name", str, where)
        m = _SHARD_RE.fullmatch(str(name))
        # The name is joined to the entry directory later: only the exact generated pattern, in order,
        # is accepted, which rules out path separators, "..", absolute paths and duplicates.
        if not m or int(m.group(1)) != i or int(m.group(2)) != len(raw_files):
            raise CacheError(
                f"{where}: file name {name!r} is not {shard_name(i, len(raw_files))!r} "
                f"(names are never turned into paths unchecked)"
            )
        nbytes = _field(rec, "bytes", int, where)
        assert isinstance(nbytes, int)
        if nbytes < 8:
            raise CacheError(f"{where}: size {nbytes} is too small for a safetensors file")
        files.append(FileRecord(str(name), nbytes, _sha(rec.get("sha256"), where)))
    file_names = {f.name for f in files}

    raw_tensors = _field(doc, "tensors", list, source)
    assert isinstance(raw_tensors, list)
    tensors: list[TensorRecord] = []
    seen: set[str] = set()
    for i, rec in enumerate(raw_tensors):
        where = f"{source}: tensors[{i}]"
        if not isinstance(rec, dict):
            raise CacheError(f"{where}: expected an object, found {type(rec).__name__}")
        name = str(_field(rec, "name", str, where))
        if not _NAME_RE.fullmatch(name):
            raise CacheError(f"{where}: tensor name {name!r} is not a dotted identifier")
        if name in seen:
            raise CacheError(f"{where}: tensor {name!r} is listed twice")
        seen.add(name)
        file = _field(rec, "file", str, where)
        if file not in file_names:
            raise CacheError(f"{where}: tensor {name!r} names file {file!r}, not in the file list")
        dtype_name = _field(rec, "dtype", str, where)
        if dtype_name not in SUPPORTED_DTYPES:
            raise CacheError(
                f"{where}: tensor {name!r} has dtype {dtype_name!r}, expected one of "
                f"{sorted(SUPPORTED_DTYPES)}"
            )
        shape = _field(rec, "shape", list, where)
        assert isinstance(shape, list)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CacheError(
                f"{where}: tensor {name!r} has shape {shape!r}, expected non-negative ints"
            )
        tensors.append(
            TensorRecord(
                name,
                str(file),
                SUPPORTED_DTYPES[str(dtype_name)],
                tuple(shape),
                _sha(rec.get("sha256"), where),
            )
        )
    return EntryManifest(str(key), dict(material), float(created), tuple(files), tuple(tensors))
