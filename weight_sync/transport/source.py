"""The caller's (name, tensor) stream on the sender, checked against the manifest as it is consumed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from weight_sync.checksum import raw_bytes
from weight_sync.errors import ManifestError, SourceError, WeightSyncError
from weight_sync.manifest import TensorMeta, dtype_to_str

__all__ = ["Checked", "close_source"]


def close_source(it: Any, source: Any) -> None:
    """After a failed call: close the source's iterator (a generator runs its cleanup, e.g. FSDPSource's
    abort agreement) and let a source that was never iterated release its peers (``abort()``)."""
    close = getattr(it, "close", None)
    if callable(close):
        close()
    abort = getattr(source, "abort", None)
    if callable(abort):
        abort()


class Checked:
    """The caller's (name, tensor) stream, checked against the manifest before anything is packed."""

    def __init__(self, it: Iterator[tuple[str, Any]], metas: tuple[TensorMeta, ...], first: int) -> None:
        self.raw = it
        self.metas = metas
        self.first = first
        self.pos = 0

    def next_flat(self, index: int) -> torch.Tensor:
        """The next tensor as a flat uint8 view (made contiguous first if it is not)."""
        return raw_bytes(self.next_tensor(index))

    def next_tensor(self, index: int) -> torch.Tensor:
        """The next tensor as the source yielded it, after checking it against the manifest."""
        assert index == self.pos, f"tensor {index} requested while the source is at {self.pos}"
        meta = self.metas[index]
        try:
            item = next(self.raw)
        except StopIteration:
            raise ManifestError(
                f"update_weights: the source ended after {index} tensors; the manifest announced "
                f"{meta.name!r} next (position {self.first + index})"
            ) from None
        except WeightSyncError:
            raise
        except Exception as e:
            raise SourceError(
                f"the weights source failed before {meta.name!r} (position {self.first + index}): "
                f"{type(e).__name__}: {e}"
            ) from e
        name, t = item
        if t is None:
            raise ManifestError(f"update_weights: the mapping has no tensor {meta.name!r} announced in the manifest")
        if name != meta.name or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
            raise ManifestError(
                f"update_weights: position {self.first + index} was announced as {meta.name!r} "
                f"{meta.shape} {dtype_to_str(meta.dtype)}, the source produced {name!r} {tuple(t.shape)} "
                f"{str(t.dtype).removeprefix('torch.')}"
            )
        self.pos += 1
        return t

    def expect_end(self) -> None:
        """Raise unless the source is exhausted: it must yield exactly the tensors the call announced."""
        try:
            extra = next(self.raw, None)
        except Exception as e:
            raise SourceError(f"the weights source failed after the last announced tensor: {e}") from e
        if extra is not None:
            raise ManifestError(
                f"update_weights: the source yielded {extra[0]!r} after the {len(self.metas)} tensors "
                "this call announced"
            )
