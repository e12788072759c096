"""The sharded data plane's wire plan: layouts as JSON, per-link transfer items, bucket cuts.

A sharded update moves, per (trainer rank, engine rank) pair, a list of *items*: regions
``(tensor, box)`` of checkpoint tensors. With ``mode='sharded'`` the items are that pair's routes of
the :class:`~weight_sync.transport.routes.RoutePlan` (each engine rank receives exactly its shard);
with ``mode='broadcast'`` they are every piece the trainer rank holds, whole (each engine rank
receives the whole model and keeps what its plan needs), which moves fewer bytes only when many
engine ranks need everything (replicas of a small model) and the trainer side has one holder.

Both ends derive the item list of a pair from the same inputs (the holdings, the engine rank's needs,
the manifest order) and cut it into the same buckets (:func:`cut_buckets`): items in order, packed at
``ALIGN`` byte offsets, an item larger than a bucket split into sub-boxes along its outer dimensions.
The cut's digest travels in every bucket's trailer, so a receiver that planned differently refuses
the first bucket instead of writing the wrong bytes.

Layouts travel as JSON (never pickle): piece tuples shared between tensors are written once as
patterns, and decoded back into one shared tuple each, so the decoded layout plans as fast as the
announced one (see :mod:`weight_sync.transport.routes`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from weight_sync.errors import ConfigError, ManifestError
from weight_sync.manifest import TensorMeta, dtype_from_str, dtype_to_str
from weight_sync.transport.routes import Box, Holding, Need, NeedPiece, Piece, RoutePlan, fmt_box

__all__ = [
    "ALIGN",
    "Bucket",
    "Item",
    "Slot",
    "broadcast_items",
    "choose_mode",
    "cut_buckets",
    "cut_digest",
    "holdings_from_json",
    "holdings_to_json",
    "needs_from_json",
    "needs_to_json",
    "sharded_items",
]

ALIGN = 16  # byte offset of every item in a bucket: a multiple of every element size
MODES = ("auto", "sharded", "broadcast")


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


# ------------------------------------------------------------------------------------------ JSON


def holdings_to_json(holdings: Iterable[Holding]) -> str:
    """Holdings as JSON, each distinct piece tuple written once."""
    patterns: dict[int, int] = {}
    table: list[list] = []
    tensors = []
    for h in holdings:
        k = patterns.get(id(h.pieces))
        if k is None:
            k = patterns[id(h.pieces)] = len(table)
            table.append([[p.rank, [list(x) for x in p.box]] for p in h.pieces])
        tensors.append([h.name, list(h.shape), dtype_to_str(h.dtype), k])
    return json.dumps({"patterns": table, "tensors": tensors}, separators=(",", ":"))


def holdings_from_json(raw: str | bytes) -> list[Holding]:
    """Inverse of :func:`holdings_to_json` (tensors of one pattern share one piece tuple)."""
    d = _load(raw, "holdings")
    try:
        pats = [tuple(Piece(rank=int(r), box=tuple((int(a), int(b)) for a, b in box)) for r, box in p)
                for p in d["patterns"]]
        return [Holding(name=str(n), shape=tuple(int(x) for x in s), dtype=dtype_from_str(dt), pieces=pats[k])
                for n, s, dt, k in d["tensors"]]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ManifestError(f"holdings JSON: malformed record: {e}") from e


def needs_to_json(needs: Iterable[Need]) -> str:
    """Needs as JSON, each distinct piece tuple written once."""
    patterns: dict[int, int] = {}
    table: list[list] = []
    tensors = []
    for n in needs:
        k = patterns.get(id(n.pieces))
        if k is None:
            k = patterns[id(n.pieces)] = len(table)
            table.append([[p.rank, [list(x) for x in p.box], p.dst_offset, list(p.dst_stride)] for p in n.pieces])
        tensors.append([n.name, list(n.shape), dtype_to_str(n.dtype), n.param, k])
    return json.dumps({"patterns": table, "tensors": tensors}, separators=(",", ":"))


def needs_from_json(raw: str | bytes) -> list[Need]:
    """Inverse of :func:`needs_to_json`."""
    d = _load(raw, "needs")
    try:
        pats = [tuple(NeedPiece(rank=int(r), box=tuple((int(a), int(b)) for a, b in box), dst_offset=int(off),
                                dst_stride=tuple(int(s) for s in stride)) for r, box, off, stride in p)
                for p in d["patterns"]]
        return [Need(name=str(n), shape=tuple(int(x) for x in s), dtype=dtype_from_str(dt),
                     param=None if param is None else str(param), pieces=pats[k])
                for n, s, dt, param, k in d["tensors"]]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ManifestError(f"needs JSON: malformed record: {e}") from e


def _load(raw: str | bytes, what: str) -> dict:
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise ManifestError(f"{what} JSON: not JSON: {e}") from e
    if not isinstance(d, dict):
        raise ManifestError(f"{what} JSON: expected an object, got {type(d).__name__}")
    return d


# ------------------------------------------------------------------------------------------ items


@dataclass(frozen=True, slots=True)
class Item:
    """One region to move on a link: ``box`` of tensor ``name`` (``dtype``), in checkpoint coordinates."""

    name: str
    dtype: torch.dtype
    box: Box

    @property
    def nbytes(self) -> int:
        return _volume(self.box) * self.dtype.itemsize


def sharded_items(plan: RoutePlan, src_rank: int, dst_rank: int) -> list[Item]:
    """The regions trainer ``src_rank`` sends engine ``dst_rank`` under ``plan``, in plan (block) order."""
    out = []
    for e in plan.entries:
        for np_, parts in zip(e.need.pieces, e.template):
            if np_.rank != dst_rank:
                continue
            for src, box, _ in parts:
                if src == src_rank and _volume(box):
                    out.append(Item(e.need.name, e.need.dtype, box))
    return out


def broadcast_items(holdings: Sequence[Holding], metas: Sequence[TensorMeta], src_rank: int) -> list[Item]:
    """Every distinct piece trainer ``src_rank`` is the first holder of, whole, in manifest order."""
    by_name = {h.name: h for h in holdings}
    out: list[Item] = []
    for m in metas:
        h = by_name.get(m.name)
        if h is None:
            continue
        first: dict[Box, int] = {}
        for p in h.pieces:
            first.setdefault(p.box, p.rank)
        out.extend(Item(h.name, h.dtype, box) for box, r in first.items() if r == src_rank and _volume(box))
    return out


def choose_mode(plan: RoutePlan, mode: str, backend: str = "gloo") -> str:
    """``'sharded'`` or ``'broadcast'``: with 'auto', broadcast when its busiest link carries fewer bytes.

    The sharded plan's busiest link is its largest per-rank total, sent or received. A broadcast
    delivers every needed tensor whole to every engine rank: over NCCL (a pipelined ring or tree) each
    link carries each byte about once, so its busiest link carries the model; gloo's broadcast sends
    from the root to every member, so a holder's link carries what it holds times the engine ranks.
    So broadcast wins where many engine ranks need everything from few holders (replicas of a small
    model over NCCL); a sharded layout (TP engines) keeps the sharded plan.
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    sharded = max([*plan.bytes_sent().values(), *plan.bytes_received().values(), 0])
    model = plan.model_bytes
    if backend == "nccl":
        broadcast = model
    else:
        first: dict[int, int] = {}
        for e in plan.entries:
            seen: set = set()
            for p in e.holding.pieces:
                if p.box not in seen:
                    seen.add(p.box)
                    first[p.rank] = first.get(p.rank, 0) + _volume(p.box) * e.holding.dtype.itemsize
        broadcast = max([model, *(n * len(plan.dst_ranks) for n in first.values())])
    return "broadcast" if broadcast < sharded else "sharded"


# ------------------------------------------------------------------------------------------ buckets


@dataclass(frozen=True, slots=True)
class Slot:
    """Item ``item`` (its sub-box ``box``) at byte ``offset`` of a bucket's payload."""

    item: int
    box: Box
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One message of a link: its slots and its payload length (a multiple of 4, for the checksum)."""

    index: int
    slots: tuple[Slot, ...]
    nbytes: int


def _split(box: Box, cap_elems: int) -> list[Box]:
    """``box`` cut along its outer dimensions into boxes of at most ``cap_elems`` elements, in order."""
    if _volume(box) <= cap_elems:
        return [box]
    for d, (a, b) in enumerate(box):
        inner = _volume(box[d + 1:])
        if inner <= cap_elems:
            step = max(1, cap_elems // inner)
            return [(*box[:d], (s, min(s + step, b)), *box[d + 1:]) for s in range(a, b, step)]
        if b - a > 1:
            return [p for s in range(a, b) for p in _split((*box[:d], (s, s + 1), *box[d + 1:]), cap_elems)]
    raise AssertionError(f"cannot split {fmt_box(box)}")  # unreachable: a single element fits (cap >= 1)


def cut_buckets(items: Sequence[Item], bucket_bytes: int) -> list[Bucket]:
    """Cut a link's items into buckets of at most ``bucket_bytes`` payload bytes, in item order."""
    if bucket_bytes < ALIGN:
        raise ConfigError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0

    def close() -> None:
        nonlocal slots, used
        if slots:
            buckets.append(Bucket(len(buckets), tuple(slots), -(-used // 4) * 4))
        slots, used = [], 0

    for i, it in enumerate(items):
        item_size = it.dtype.itemsize
        for box in _split(it.box, max(1, bucket_bytes // item_size)):
            n = _volume(box) * item_size
            at = -(-used // ALIGN) * ALIGN
            if slots and at + n > bucket_bytes:
                close()
                at = 0
            slots.append(Slot(i, box, at, n))
            used = at + n
    close()
    return buckets


def cut_digest(items: Sequence[Item], buckets: Sequence[Bucket]) -> int:
    """A signed 64-bit digest of a link's cut (items and slots): both ends must compute the same."""
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.name} {dtype_to_str(it.dtype)} {it.box}\n".encode())
    for b in buckets:
        h.update(f"{b.nbytes} {[(s.item, s.box, s.offset) for s in b.slots]}\n".encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True)
