"""Bucket layout: how a run of manifest tensors is cut into buckets, computed identically on both ends.

A layout is a pure function of (tensor metas in order, bucket payload bytes, alignment), so the sender
never ships offsets: each receiver computes the same layout and cross-checks the bucket count.

Rules: tensors keep manifest order and start on aligned offsets; a block (``model.layers.N``) that fits
in the space left in the current bucket goes there, otherwise it starts a new bucket, so buckets hold
complete blocks; a block larger than one bucket fills consecutive buckets, and a tensor that does not fit
in what is left is split at an aligned byte offset and continues in the next bucket (the receiver
reassembles it in one block-sized staging tensor).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from weight_sync.errors import ManifestError
from weight_sync.layers.blocks import group_by_block, order_by_block
from weight_sync.manifest import Manifest, TensorMeta

__all__ = [
    "MIN_FILL_BYTES",
    "PIPELINE_BUCKETS",
    "Bucket",
    "BucketLayout",
    "LayoutCache",
    "Segment",
    "align_up",
    "check_block_order",
    "fill_bytes",
    "plan_buckets",
]


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Segment(NamedTuple):
    """Bytes [tensor_offset, tensor_offset + nbytes) of tensor ``index`` at ``bucket_offset``.

    (A named tuple: every call of a delta update plans its layout again, one segment per tensor, and a
    frozen dataclass costs about a microsecond more per instance.)"""

    index: int
    tensor_offset: int
    nbytes: int
    bucket_offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: its segments in order and the payload bytes on the wire (aligned)."""

    index: int
    segments: tuple[Segment, ...]
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """The buckets of one run of tensors, plus the largest split tensor (the reassembly size)."""

    metas: tuple[TensorMeta, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    align_bytes: int
    max_split_bytes: int

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def num_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def digest(self) -> str:
        """A short hash of names, dtypes, shapes and cut points (both ends compare it in tests/logs)."""
        h = hashlib.sha256()
        for m in self.metas:
            h.update(f"{m.name}|{m.dtype}|{m.shape};".encode())
        for b in self.buckets:
            h.update(repr([(s.index, s.tensor_offset, s.nbytes, s.bucket_offset) for s in b.segments]).encode())
        return h.hexdigest()[:16]


def check_block_order(names: Sequence[str]) -> None:
    """Raise ManifestError unless every block's names are contiguous and blocks come in forward order."""
    names = list(names)
    ordered = order_by_block(names, reference_order=names)
    if ordered != names:
        first = next(i for i, (a, b) in enumerate(zip(names, ordered)) if a != b)
        raise ManifestError(
            f"manifest is not in block order: position {first} holds {names[first]!r}, block order "
            f"expects {ordered[first]!r} there; order the manifest (and the tensors) with "
            "weight_sync.layers.order_by_block"
        )


def block_ordered(manifest: Manifest) -> Manifest:
    """The manifest with its entries stably reordered into block order (same version)."""
    order = order_by_block(manifest.names, reference_order=list(manifest.names))
    if list(order) == list(manifest.names):
        return manifest
    return Manifest(tuple(manifest[n] for n in order), version=manifest.version)


#: A call whose payload would fill fewer buckets than this is cut into about this many (each of at least
#: :data:`MIN_FILL_BYTES`): with one bucket, packing, the wire and the engine's load run one after
#: another; with several they overlap. A delta's payload is a few percent of its model, often one bucket
#: (the Qwen3-0.6B shape's 2% delta, 48 MB in 64 MiB buckets, took 0.43 s in one bucket and 0.35 s in
#: three on the 2-core CI host).
PIPELINE_BUCKETS = 4
MIN_FILL_BYTES = 1 << 20


def fill_bytes(metas: Sequence[TensorMeta], bucket_bytes: int, align_bytes: int) -> int:
    """How full a bucket of ``metas``' call gets before the next block starts a new one: ``bucket_bytes``,
    or less for a call of fewer than :data:`PIPELINE_BUCKETS` buckets' payload (see there)."""
    total = sum(align_up(m.nbytes, align_bytes) for m in metas)
    if total >= PIPELINE_BUCKETS * bucket_bytes:
        return bucket_bytes
    return min(bucket_bytes, max(MIN_FILL_BYTES, align_up(-(-total // PIPELINE_BUCKETS), align_bytes)))


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int, align_bytes: int,
                 fill: int | None = None) -> BucketLayout:
    """Cut ``metas`` (already in block order) into buckets of at most ``bucket_bytes`` payload; ``fill``: a
    bucket holding this many bytes is closed before the next block (blocks are split only where one
    exceeds a bucket, as without it)."""
    fill = bucket_bytes if fill is None else fill
    if bucket_bytes % align_bytes or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive multiple of {align_bytes}, got {bucket_bytes}")
    metas = tuple(metas)
    groups = _blocks_of(tuple(m.name for m in metas))
    sizes = [m.nbytes for m in metas]  # (a property computing a product: read once per tensor)
    buckets: list[Bucket] = []
    current: list[Segment] = []
    used = 0
    max_split = 0

    def close() -> None:
        nonlocal current, used
        if current:
            buckets.append(Bucket(len(buckets), tuple(current), used))
        current, used = [], 0

    for block in groups:
        block_bytes = sum([align_up(sizes[i], align_bytes) for i in block])
        if used and (used >= fill or used + block_bytes > bucket_bytes):
            close()
        for i in block:
            nbytes = sizes[i]
            if nbytes == 0:
                current.append(Segment(i, 0, 0, used))
                continue
            offset = 0
            while offset < nbytes:
                if used >= bucket_bytes:
                    close()
                take = min(nbytes - offset, bucket_bytes - used)
                current.append(Segment(i, offset, take, used))
                if take < nbytes:
                    max_split = max(max_split, nbytes)
                used += align_up(take, align_bytes)
                offset += take
    close()
    return BucketLayout(metas, tuple(buckets), bucket_bytes, align_bytes, max_split)


@functools.lru_cache(maxsize=16)
def _blocks_of(names: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The positions in ``names`` of each block's names, blocks in block order: the same names come
    with every call of a delta update (whose sizes change, so its layout is planned again), and
    grouping them is most of the planning's host time."""
    index = {n: i for i, n in enumerate(names)}
    return tuple(tuple(index[n] for n in g) for g in group_by_block(names, reference_order=names).values())


class LayoutCache:
    """Bucket layouts of recent calls by (first, count), recomputed only when the tensors differ.

    Planning a 400-tensor call costs about a millisecond of Python. On a receiver it sits between the
    call's header and its first posted receive, while the wire idles; an unchanged manifest keeps the
    same metas, so the comparison below is by identity, element by element, and cheap.
    """

    MAX_ENTRIES = 64  # distinct call splits remembered (a sender normally has one or a few)

    def __init__(self, bucket_bytes: int, align_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.align_bytes = align_bytes
        self._layouts: dict[tuple[int, int], BucketLayout] = {}

    def get(self, tensors: Sequence[TensorMeta], first: int, count: int) -> BucketLayout:
        """The layout of ``tensors[first : first + count]``."""
        key = (first, count)
        metas = tuple(tensors[first : first + count])
        layout = self._layouts.get(key)
        if layout is None or layout.metas != metas:
            layout = plan_buckets(metas, self.bucket_bytes, self.align_bytes,
                                  fill_bytes(metas, self.bucket_bytes, self.align_bytes))
            if len(self._layouts) >= self.MAX_ENTRIES:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout
