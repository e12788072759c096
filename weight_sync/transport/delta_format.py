"""Delta encoding's wire constants and table decisions, shared by its torch, numpy and native paths.

The format itself is described in ``weight_sync/transport/delta.py``; this module holds what every
encoder and decoder must agree on: the magic, the chunk forms, the offset width and the choice of each
chunk's form from its changed count.
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync import native

__all__ = ["DEFAULT_CHUNK_ELEMS", "FORM_BITMASK", "FORM_INDEX", "FORM_PLAIN", "FORM_SAME", "MAGIC", "forms_of_sizes"]

MAGIC = 0x32445357  # "WSD2" little-endian (WSD1 had int32 offsets for every chunk size)
FORM_SAME, FORM_BITMASK, FORM_INDEX, FORM_PLAIN = 0, 1, 2, 3
# 64 Ki elements: a bitmask chunk costs 8 KiB of bits, so a chunk with more than 4Ki changes (6.25%) of
# bf16 prefers the bitmask; small enough that a dense corner of a tensor goes plain on its own.
DEFAULT_CHUNK_ELEMS = 1 << 16
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


#: What a 2-byte index offset is stored less: 0..65535 shifted into int16's range (no uint16
#: arithmetic needed on either side).
OFFSET16_BIAS = 1 << 15


def _offset_bytes(chunk_elems: int) -> int:
    """Width of an index chunk's offsets: 2 bytes while every offset fits 16 bits (chunks of up to
    64 Ki elements, the default), else 4. Halves the index bytes, the usual form at low density."""
    return 2 if chunk_elems <= 1 << 16 else 4


def _forms(counts: np.ndarray, chunk_elems: int, numel: int, item: int) -> np.ndarray:
    """Per chunk the cheapest form, from the changed counts per chunk of one tensor of ``numel``
    elements (the table is decided on the host: it is tiny; by the native kernel where it is built,
    one call for numpy's dozen small operations, once per tensor of every update)."""
    if native.enabled():
        return native.forms(counts, chunk_elems, numel, item, _offset_bytes(chunk_elems))
    sizes = np.full(counts.size, chunk_elems, dtype=np.int64)
    if counts.size:
        sizes[-1] = numel - (counts.size - 1) * chunk_elems
    return forms_of_sizes(counts, sizes, chunk_elems, item)


def forms_of_sizes(counts: np.ndarray, sizes: np.ndarray, chunk_elems: int, item: int) -> np.ndarray:
    """Per chunk the cheapest form (ties go to the simpler one: same < plain < index < bitmask), from
    its changed count and its element count (chunks of several tensors at once)."""
    bitmask = chunk_elems // 8 + counts * item
    index = counts * (_offset_bytes(chunk_elems) + item)
    plain = sizes * item
    form = np.where(index < plain, FORM_INDEX, FORM_PLAIN)
    form = np.where(bitmask < np.minimum(index, plain), FORM_BITMASK, form)
    return np.where(counts == 0, FORM_SAME, form).astype(np.int64)
