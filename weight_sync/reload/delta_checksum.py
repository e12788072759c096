"""How a scattered write moves a tensor's checksum: delta sync checksums only the changed words.

The fingerprint's per-tensor checksum (``weight_sync.checksum``) is two sums of 32-bit words, the second
weighted by ``(word index % 65521) + 1``, so writing ``new`` over ``old`` at some elements moves it by the
``(new - old)`` of the words those elements sit in, placed at their bytes inside the word. These are the
reference formulas (torch for a device, numpy for the host); the grouped scatter kernel
(``weight_sync.reload.scatter_many``) and the native CPU kernel compute the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync.reload.lanes import to_device

__all__ = ["MASK32", "checksum_change", "checksum_change_np", "checksum_changes"]

MASK32 = 0xFFFFFFFF
_MASK32 = MASK32
_PERIOD = 65521  # the checksum's weight period (weight_sync.checksum)


def checksum_change(byte_pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor, itemsize: int) -> torch.Tensor:
    """int64 ``[plain, weighted]``: how writing ``new`` over ``old`` (integer views, one element each at
    byte offset ``byte_pos`` of a tensor) moves that tensor's two checksum sums, mod 2**32."""
    return checksum_changes([(byte_pos, old, new)], itemsize)[0]


def checksum_changes(writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], itemsize: int) -> torch.Tensor:
    """:func:`checksum_change` of several ``(byte_pos, old, new)`` writes of one item size (one device),
    as int64 rows ``[plain, weighted]``: one set of launches for all of them (a bucket's direct tensors)."""
    dev = writes[0][0].device
    sizes = [w[0].numel() for w in writes]
    byte_pos, old, new = (torch.cat([w[k] for w in writes]) if len(writes) > 1 else writes[0][k] for k in range(3))
    if itemsize == 8:
        o, n = old.to(torch.int64), new.to(torch.int64)
        # Two words per element: low halves first, then high halves (each write's run once in each).
        d = torch.cat([(n & _MASK32) - (o & _MASK32), ((n >> 32) & _MASK32) - ((o >> 32) & _MASK32)])
        words = torch.cat([byte_pos >> 2, (byte_pos >> 2) + 1])
        sizes = sizes + sizes
    else:
        mask = (1 << (8 * itemsize)) - 1
        d = (new.to(torch.int64) & mask) - (old.to(torch.int64) & mask)
        if itemsize < 4:
            d = d << ((byte_pos & 3) * 8)  # little-endian: the element's bytes inside its word
        words = byte_pos >> 2
    d = d & _MASK32  # each term mod 2**32: sums of up to 2**31 terms fit int64
    weighted = (d * (words % _PERIOD + 1)) & _MASK32
    terms = torch.stack([d, weighted], 1)
    if len(writes) == 1:
        return terms.sum(0, keepdim=True)
    seg = torch.arange(len(writes), device=dev).repeat(2 if itemsize == 8 else 1)
    seg = torch.repeat_interleave(seg, to_device(torch.tensor(sizes), dev), output_size=d.numel())
    return torch.zeros(len(writes), 2, dtype=torch.int64, device=dev).index_add_(0, seg, terms)


def checksum_change_np(byte_pos: np.ndarray, old: np.ndarray, new: np.ndarray, itemsize: int) -> np.ndarray:
    """:func:`checksum_change` in numpy (CPU): the same arithmetic, an int64 array ``[plain, weighted]``."""
    if itemsize == 8:
        o, n = old.astype(np.int64), new.astype(np.int64)
        d = np.concatenate([(n & _MASK32) - (o & _MASK32), ((n >> 32) & _MASK32) - ((o >> 32) & _MASK32)])
        words = np.concatenate([byte_pos >> 2, (byte_pos >> 2) + 1])
    else:
        mask = (1 << (8 * itemsize)) - 1
        d = (new.astype(np.int64) & mask) - (old.astype(np.int64) & mask)
        if itemsize < 4:
            d = d << ((byte_pos & 3) * 8)
        words = byte_pos >> 2
    d &= _MASK32
    weighted = (d * (words % _PERIOD + 1)) & _MASK32
    return np.array([d.sum(), weighted.sum()], dtype=np.int64)
