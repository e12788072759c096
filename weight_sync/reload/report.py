"""What an update did (UpdateReport) and a fingerprint of a model's kernel tensors."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any

import torch
from torch import nn

from weight_sync.checksum import tensor_checksums
from weight_sync.layers.tensors import iter_graph_visible_tensors
from weight_sync.manifest import dtype_to_str

__all__ = ["UpdateReport", "fingerprint"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateReport:
    """The result of one update: what arrived, which path each layer took, how long each phase ran.

    ``layers_direct`` were written straight into live storage; ``layers_processed`` were buffered in
    model format, processed (e.g. quantized) and copied into their kernel tensors; of those,
    ``layers_per_unit`` completed and were processed one unit (expert) at a time, straight into their
    kernel tensors (``units_processed`` units in all); ``layers_banded`` were quantized key by key
    straight into their kernel tensors, with no staging (``weight_sync.reload.bands``); the rest were
    processed as whole layers.
    ``per_unit_fallbacks`` names the layers that offer per-unit processing but took the layer path in
    this update, with why (e.g. the first load). ``keys_replayed`` went
    through recorded copies, ``keys_via_loader`` through the real loader (plan fallback).
    ``peak_buffered_bytes`` counts model-format staging of pending layers on the model's device;
    ``spilled_bytes`` is staging that went to host memory because the budget was full.
    """

    version: Any
    num_tensors: int
    num_bytes: int
    layers_direct: tuple[str, ...]
    layers_processed: tuple[str, ...]
    keys_replayed: int
    keys_via_loader: int
    keys_ignored: tuple[str, ...]
    peak_buffered_bytes: int
    spilled_bytes: int
    budget_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    fingerprint: str | None = None
    partial: bool = False
    layers_per_unit: tuple[str, ...] = ()
    units_processed: int = 0
    per_unit_fallbacks: dict[str, str] = field(default_factory=dict)
    layers_banded: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (what ``dataclasses.asdict`` gives, without its deep copy of every name)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["seconds"] = dict(self.seconds)
        out["per_unit_fallbacks"] = dict(self.per_unit_fallbacks)
        return out

    def summary(self) -> str:
        """One line for logs: version, tensors, MB, paths, peak buffer, seconds."""
        return (
            f"version={self.version} tensors={self.num_tensors} MB={self.num_bytes / 1e6:.1f} "
            f"direct={len(self.layers_direct)} processed={len(self.layers_processed)} "
            f"per_unit={len(self.layers_per_unit)} banded={len(self.layers_banded)} "
            f"peak_buffered_MB={self.peak_buffered_bytes / 1e6:.1f} "
            f"total_s={self.seconds.get('total', 0.0):.3f}"
        )


def fingerprint(model: nn.Module, checksums: Mapping[int, int] | None = None,
                named: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
    """A SHA-256 over names, dtypes, shapes and on-device checksums of all graph-visible tensors.

    Two models with bitwise-equal kernel tensors under the same names have the same fingerprint; data
    never leaves the device except as one 64-bit checksum per tensor. ``checksums``: checksums already
    computed elsewhere, by tensor ``id`` (an offloaded model's streamed blocks, checksummed where their
    served bytes are), used in place of reading those tensors. ``named``: the model's graph-visible
    (name, tensor) pairs when the caller already walked it.
    """
    sums = dict(checksums or {})
    if named is None:
        named = iter_graph_visible_tensors(model)
    items = sorted(((name, t) for name, t in named if t.device.type != "meta"), key=itemgetter(0))
    todo = [t for _, t in items if id(t) not in sums]
    sums.update(zip(map(id, todo), tensor_checksums(todo)))
    # One update over the concatenation: the same digest as an update per field, at a fraction of
    # the host time (this runs at the end of every update, over hundreds of tensors).
    parts = []
    for name, t in items:
        parts.append(_described(name, t.dtype, tuple(t.shape)))
        parts.append(sums[id(t)].to_bytes(8, "little", signed=False))
    return hashlib.sha256(b"".join(parts)).hexdigest()


@functools.lru_cache(maxsize=1 << 16)
def _described(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return name.encode() + dtype_to_str(dtype).encode() + repr(shape).encode()
