"""Safetensors files and directories, mapped zero-copy and iterated in block order.

Tensors are views of a private (copy-on-write) memory map of the file, so processes that map the same file
share its pages through the page cache until someone writes. Headers are parsed here (8-byte length plus
JSON) so that names, dtypes and shapes are known before any data is touched.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from weight_sync.errors import LayoutMismatchError, WeightSyncError
from weight_sync.layers.blocks import order_by_block

__all__ = [
    "SafetensorsEntry",
    "checkpoint_files",
    "iter_checkpoint",
    "map_safetensors",
    "read_header",
    "read_index",
]

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class SafetensorsEntry:
    """One tensor's location inside a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: str | os.PathLike) -> dict[str, SafetensorsEntry]:
    """Parse a safetensors header; entries keep file order. Raises naming the file on corruption."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise WeightSyncError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw_len)
            size = path.stat().st_size
            if n > size - 8:
                raise WeightSyncError(f"{path}: header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightSyncError(f"{path}: cannot read safetensors header: {e}") from e
    base = 8 + n
    out: dict[str, SafetensorsEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightSyncError(f"{path}: malformed header entry {name!r}: {info!r}") from e
        if base + end > size or begin > end:
            raise WeightSyncError(f"{path}: tensor {name!r} spans bytes {begin}..{end}, past the file end")
        out[name] = SafetensorsEntry(name, dtype, shape, base + begin, base + end)
    return out


def map_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Map every tensor of a safetensors file zero-copy (private mmap; the file is never written)."""
    path = Path(path)
    entries = read_header(path)
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload,arg-type]
    out: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        elem = e.dtype.itemsize
        nbytes = e.end - e.begin
        numel = 1
        for d in e.shape:
            numel *= d
        if numel * elem != nbytes:
            raise LayoutMismatchError(
                f"{path}: tensor {name!r} declares {e.shape} {e.dtype} ({numel * elem} bytes) "
                f"but spans {nbytes} bytes"
            )
        raw = flat[e.begin : e.end]
        if e.begin % elem:
            raw = raw.clone()  # misaligned for a typed view: copy this one tensor
        out[name] = raw.view(e.dtype).view(e.shape)
    return out


def read_index(directory: Path) -> dict[str, str] | None:
    """The weight map of a sharded checkpoint (``model.safetensors.index.json``), if present."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, KeyError, OSError) as e:
        raise WeightSyncError(f"{index}: not a valid safetensors index: {e}") from e
    for name, fname in weight_map.items():
        if "/" in fname or "\\" in fname or fname.startswith("."):
            raise WeightSyncError(f"{index}: file name {fname!r} for {name!r} is not a plain file name")
    return dict(weight_map)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """Safetensors files of a checkpoint directory (or a single file), with a clear error if none."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightSyncError(f"checkpoint path {path} does not exist")
    weight_map = read_index(path)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightSyncError(
                f"{path}: model.safetensors.index.json names files that do not exist: {missing}"
            )
        return [path / f for f in files]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise WeightSyncError(
            f"{path}: no *.safetensors files (expected model.safetensors or a sharded index)"
        )
    return found


def iter_checkpoint(
    path: str | os.PathLike,
    *,
    reference_order: list[str] | None = None,
    names: Mapping[str, object] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a checkpoint, mapped zero-copy, complete blocks in forward order.

    ``reference_order`` (e.g. the model's parameter names) decides pre/post placement of un-indexed
    names; ``names`` restricts the output to those keys.
    """
    mapped: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        for name, t in map_safetensors(f).items():
            if names is None or name in names:
                mapped[name] = t
    for name in order_by_block(mapped, reference_order=reference_order):
        yield name, mapped[name]
