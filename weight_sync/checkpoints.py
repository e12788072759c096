"""Local checkpoints in the formats vLLM's default loader reads: safetensors, and torch files.

A checkpoint is a directory (or one file) holding either safetensors files (mapped zero-copy, headers
parsed before any data is touched) or torch files (``pytorch_model*.bin``, ``*.pt``) read with
``torch.load(weights_only=True)``: tensors and plain containers only, never a full unpickle of
arbitrary objects, and memory-mapped where the file is in torch's zip format so only the tensors that
are loaded are read. Safetensors win where a directory holds both, as in vLLM. A hub id is resolved
only from the local Hugging Face cache (nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from weight_sync.errors import WeightSyncError
from weight_sync.layers.blocks import order_by_block
from weight_sync.manifest import TensorMeta
from weight_sync.safetensors_io import checkpoint_files, map_safetensors, read_header

__all__ = [
    "checkpoint_format",
    "checkpoint_metas",
    "iter_any_checkpoint",
    "map_checkpoint",
    "resolve_checkpoint",
    "torch_checkpoint_files",
]

_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
_TORCH_INDEX = "pytorch_model.bin.index.json"


def checkpoint_format(path: str | os.PathLike) -> str:
    """'safetensors' or 'torch': what the checkpoint at ``path`` holds (safetensors first, as vLLM)."""
    path = Path(path)
    if path.is_file():
        return "torch" if path.suffix in _TORCH_SUFFIXES else "safetensors"
    if not path.is_dir():
        raise WeightSyncError(f"checkpoint path {path} does not exist")
    if (path / "model.safetensors.index.json").exists() or any(path.glob("*.safetensors")):
        return "safetensors"
    if (path / _TORCH_INDEX).exists() or any(p.suffix in _TORCH_SUFFIXES for p in path.iterdir()):
        return "torch"
    raise WeightSyncError(
        f"{path}: no weights found (expected *.safetensors, a safetensors index, pytorch_model*.bin or *.pt)"
    )


def torch_checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """Torch weight files of a checkpoint directory (or a single file), in index or name order."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / _TORCH_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, OSError, TypeError) as e:
            raise WeightSyncError(f"{index}: not a valid weight index: {e}") from e
        files = sorted(set(weight_map.values()))
        bad = [f for f in files if not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".")]
        if bad:
            raise WeightSyncError(f"{index}: file names must be plain file names, got {bad[:3]}")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightSyncError(f"{index} names files that do not exist: {missing}")
        return [path / f for f in files]
    # Training states saved beside the weights are not weights (vLLM skips them too).
    skip = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")
    found = sorted(p for p in path.iterdir() if p.suffix in _TORCH_SUFFIXES and p.name not in skip)
    if not found:
        raise WeightSyncError(f"{path}: no pytorch_model*.bin or *.pt files")
    return found


def _load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A flat name -> tensor mapping from one torch file, via ``torch.load(weights_only=True)``."""
    try:
        # mmap needs torch's zip format; the legacy format is read whole.
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise WeightSyncError(
            f"{path}: cannot read as a weights-only torch file ({type(e).__name__}: {e}); weight_sync never "
            "unpickles arbitrary objects: save a state dict of tensors (or use safetensors)"
        ) from e
    if not isinstance(obj, dict):
        raise WeightSyncError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    bad = [(k, type(v).__name__) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightSyncError(
            f"{path}: expected a flat state dict of tensors, found {len(bad)} other entries, e.g. "
            f"{bad[0][0]!r}: {bad[0][1]}"
        )
    return obj


def map_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint by name, mapped where the format allows (no data read yet)."""
    out: dict[str, torch.Tensor] = {}
    if checkpoint_format(path) == "safetensors":
        for f in checkpoint_files(path):
            _merge(out, map_safetensors(f), f)
    else:
        for f in torch_checkpoint_files(path):
            _merge(out, _load_torch_file(f), f)
    return out


def _merge(out: dict[str, torch.Tensor], more: dict[str, torch.Tensor], source: Path) -> None:
    twice = [n for n in more if n in out]
    if twice:
        raise WeightSyncError(f"{source}: tensor {twice[0]!r} is also in another file of the checkpoint")
    out.update(more)


def checkpoint_metas(path: str | os.PathLike) -> list[TensorMeta]:
    """Names, dtypes and shapes of every tensor of a local checkpoint, before any weight is read."""
    if checkpoint_format(path) == "safetensors":
        return [TensorMeta(e.name, e.dtype, e.shape) for f in checkpoint_files(path) for e in read_header(f).values()]
    return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in map_checkpoint(path).items()]


def iter_any_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a local checkpoint of either format, complete blocks in forward order."""
    mapped = map_checkpoint(path)
    for name in order_by_block(mapped):
        yield name, mapped[name]


def resolve_checkpoint(name_or_path: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local checkpoint directory or file for ``name_or_path``: a path as it is, or a hub id found in
    the local Hugging Face cache. Nothing is downloaded; an id that is not cached is refused clearly."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not name.strip("/"):
        raise WeightSyncError(f"checkpoint path {name!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise WeightSyncError(
            f"{name!r} is neither a local path nor resolvable: looking a hub id up in the local cache needs "
            "huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as e:
        raise WeightSyncError(
            f"{name!r} is not a local path and not in the local Hugging Face cache "
            f"(revision {revision or 'main'}); weight_sync reloads only local weights and never downloads: "
            "download it first or pass a directory"
        ) from e
