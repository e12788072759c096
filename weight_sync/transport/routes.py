"""Route plans: which trainer rank sends which region of which tensor to which engine rank.

Both sides announce a layout before any byte moves. Trainer ranks announce :class:`Holding` s (per
checkpoint tensor, which rank holds which box of it: an FSDP2 ``Shard(0)`` chunk, a TP column block, a
whole replicated or expert-parallel tensor); engine ranks announce :class:`Need` s (per checkpoint tensor,
which box each engine rank needs and where in its own parameter that box lands: a qkv shard needs rows of
q, k and v at three offsets of one fused tensor). :func:`plan_routes` intersects them into a
:class:`RoutePlan`: per (trainer rank, engine rank) pair, the regions to send, each with its source box
(global and in the sender's local piece) and its destination view.

Validation happens while planning, so a bad layout is refused before any transfer: a needed tensor
nobody holds, a layout the two sides disagree on, two trainer ranks claiming overlapping regions that are
not the same region (replicas hold *equal* boxes), a needed region the holdings leave uncovered - each is
a :class:`~weight_sync.errors.ManifestError` naming the tensor, the ranks and the boxes.

A plan depends only on the layouts, so it is keyed by :func:`layout_digest` and reused while layouts are
unchanged (:class:`RoutePlanCache`). Planning scales to trillion-parameter shapes because layouts repeat:
every ``q_proj`` of every block has the same boxes, so the intersection is computed once per distinct
(holding boxes, needed boxes) pattern and shared (announcers build their piece tuples through caches so
that equal patterns are the same objects).

Boxes are per-dimension half-open ``(start, stop)`` pairs in the checkpoint tensor's coordinates.
Destinations are strided views ``(offset, size, stride)`` into the engine's parameter, in elements
relative to the parameter's own storage offset, as the reload plan records them; a destination of
``param=None`` means the engine's own loader consumes the whole tensor (a loader that computes).
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weight_sync.errors import ConfigError, ManifestError

__all__ = [
    "Box",
    "Holding",
    "Need",
    "NeedPiece",
    "Piece",
    "Route",
    "RoutePlan",
    "RoutePlanCache",
    "copy_routes",
    "fmt_box",
    "layout_digest",
    "plan_routes",
]

Box = tuple[tuple[int, int], ...]

_MAX_NAMED = 8  # problems named in one error message


def fmt_box(box: Box) -> str:
    """``[0:8, 0:128]``: how messages name a box."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def _overlap(x: Box, y: Box) -> Box | None:
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _in_bounds(box: Box, shape: tuple[int, ...]) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Piece:
    """Trainer rank ``rank`` holds ``box`` of a tensor, as a contiguous local tensor of the box's shape."""

    rank: int
    box: Box


@dataclass(frozen=True, slots=True)
class Holding:
    """What the trainer ranks hold of one checkpoint tensor; equal boxes on several ranks are replicas."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class NeedPiece:
    """Engine rank ``rank`` needs ``box`` of a tensor, landing in the view ``(dst_offset, box size,
    dst_stride)`` of the need's parameter (``dst_stride`` is empty when the parameter is None)."""

    rank: int
    box: Box
    dst_offset: int = 0
    dst_stride: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Need:
    """What the engine ranks need of one checkpoint tensor and which of their parameters it fills.

    ``param`` None: the engine's own loader consumes the tensor (its pieces are whole tensors).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: str | None
    pieces: tuple[NeedPiece, ...]


@dataclass(frozen=True, slots=True)
class Route:
    """One region to send: ``src_box`` of tensor ``name`` from trainer ``src_rank`` to engine ``dst_rank``.

    ``src_local`` is the same region in the sender's local piece; the receiver writes it into
    ``param.as_strided(dst_size, dst_stride, param.storage_offset() + dst_offset)``.
    """

    name: str
    src_rank: int
    dst_rank: int
    src_box: Box
    src_local: Box
    param: str | None
    dst_offset: int
    dst_size: tuple[int, ...]
    dst_stride: tuple[int, ...]
    nbytes: int


# A template is the intersection of one holding pattern with one need pattern, shared by every tensor
# with both patterns: per need piece, (src rank, region of the tensor, region in the sender's piece).
_Template = tuple[tuple[tuple[int, Box, Box], ...], ...]


@dataclass(slots=True)
class _Entry:
    need: Need
    holding: Holding
    template: _Template
    links: dict[tuple[int, int], int]  # elements per (src rank, dst rank), shared with the template


@dataclass(slots=True)
class RoutePlan:
    """The validated intersection of holdings and needs; accounting without materializing every route."""

    digest: str
    entries: list[_Entry]
    unneeded: tuple[str, ...]  # tensors held but needed by no engine rank
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    _link_bytes: dict[tuple[int, int], int] | None = field(default=None, repr=False)

    def routes(self, *, src_rank: int | None = None, dst_rank: int | None = None) -> Iterator[Route]:
        """Every route (of one sender and/or one receiver), in the order the needs were announced."""
        for e in self.entries:
            if src_rank is not None and src_rank not in {s for s, _ in e.links}:
                continue
            item = e.need.dtype.itemsize
            for np_, parts in zip(e.need.pieces, e.template):
                if dst_rank is not None and np_.rank != dst_rank:
                    continue
                for src, box, local in parts:
                    if src_rank is not None and src != src_rank:
                        continue
                    size = tuple(b - a for a, b in box)
                    off = np_.dst_offset + sum(
                        (a - na) * s for (a, _), (na, _), s in zip(box, np_.box, np_.dst_stride)
                    )
                    yield Route(
                        name=e.need.name, src_rank=src, dst_rank=np_.rank, src_box=box,
                        src_local=local, param=e.need.param, dst_offset=off, dst_size=size,
                        dst_stride=np_.dst_stride, nbytes=_volume(box) * item,
                    )

    def pairs(self) -> dict[tuple[int, int], list[Route]]:
        """Routes by (trainer rank, engine rank), each list in announcement order."""
        out: dict[tuple[int, int], list[Route]] = {}
        for r in self.routes():
            out.setdefault((r.src_rank, r.dst_rank), []).append(r)
        return out

    def bytes_per_link(self) -> dict[tuple[int, int], int]:
        """Bytes the sharded plan moves from each trainer rank to each engine rank."""
        if self._link_bytes is None:
            # Tensors share templates; sum each template's per-link elements once per dtype size.
            uses: dict[tuple[int, int], list] = {}
            for e in self.entries:
                key = (id(e.links), e.need.dtype.itemsize)
                slot = uses.setdefault(key, [e.links, 0])
                slot[1] += 1
            total: dict[tuple[int, int], int] = {}
            for (_, item), (links, count) in uses.items():
                for link, n in links.items():
                    total[link] = total.get(link, 0) + n * item * count
            self._link_bytes = total
        return dict(self._link_bytes)

    def bytes_received(self) -> dict[int, int]:
        """Bytes each engine rank receives under the plan (every engine rank listed, 0 if none)."""
        out = dict.fromkeys(self.dst_ranks, 0)
        for (_, d), n in self.bytes_per_link().items():
            out[d] += n
        return out

    def bytes_sent(self) -> dict[int, int]:
        """Bytes each trainer rank sends under the plan (every trainer rank listed, 0 if none)."""
        out = dict.fromkeys(self.src_ranks, 0)
        for (s, _), n in self.bytes_per_link().items():
            out[s] += n
        return out

    def needed_bytes(self) -> dict[int, int]:
        """Bytes of the regions each engine rank announced it needs (equal to what it receives)."""
        out = dict.fromkeys(self.dst_ranks, 0)
        for e in self.entries:
            item = e.need.dtype.itemsize
            for np_ in e.need.pieces:
                out[np_.rank] += _volume(np_.box) * item
        return out

    @property
    def model_bytes(self) -> int:
        """Bytes of every needed tensor, whole: what broadcast delivers to each engine rank."""
        return sum(_volume(tuple((0, n) for n in e.need.shape)) * e.need.dtype.itemsize
                   for e in self.entries)

    def broadcast_bytes_per_link(self, root: int = 0) -> dict[tuple[int, int], int]:
        """Bytes per (root, engine rank) when trainer ``root`` broadcasts every needed tensor whole."""
        if root not in self.src_ranks:
            raise ConfigError(f"root must be one of the trainer ranks {list(self.src_ranks)}, got {root}")
        total = self.model_bytes
        return {(root, d): total for d in self.dst_ranks}


def _check_holding(h: Holding, problems: list[str]) -> dict[Box, list[int]] | None:
    """Distinct boxes of ``h`` -> their ranks, or None (problems appended) when they are inconsistent."""
    boxes: dict[Box, list[int]] = {}
    bad = False
    for p in h.pieces:
        if not _in_bounds(p.box, h.shape):
            problems.append(f"{h.name}: trainer rank {p.rank} claims {fmt_box(p.box)}, outside the "
                            f"tensor's shape {h.shape}")
            bad = True
        boxes.setdefault(p.box, []).append(p.rank)
    if bad:
        return None
    # Distinct boxes must be disjoint: sweep along dim 0 (boxes sorted by start), compare only those
    # whose dim-0 ranges meet.
    order = sorted((b for b in boxes if _volume(b)), key=lambda b: b[0] if b else (0, 0))
    for i, x in enumerate(order):
        for y in order[i + 1:]:
            if x and y[0][0] >= x[0][1]:
                break
            if _overlap(x, y) is not None:
                problems.append(
                    f"{h.name}: trainer ranks {boxes[x][0]} and {boxes[y][0]} claim overlapping "
                    f"regions {fmt_box(x)} and {fmt_box(y)} that are not the same region (replicas "
                    "must hold equal boxes)"
                )
                return None
    return boxes


class _Index:
    """The distinct boxes of one holding pattern, searchable by bisection along the dimension that
    splits them (a 1-D mesh's Shard(d): boxes equal except for disjoint ranges of dimension d)."""

    __slots__ = ("boxes", "distinct", "split", "starts")

    def __init__(self, boxes: dict[Box, list[int]]) -> None:
        self.boxes = boxes
        distinct = [b for b in boxes if _volume(b)]
        self.split: int | None = None
        if distinct:
            ndim = len(distinct[0])
            varying = [d for d in range(ndim) if len({b[d] for b in distinct}) > 1]
            if len(varying) <= 1:
                self.split = varying[0] if varying else 0
                distinct.sort(key=lambda b: b[self.split][0])  # type: ignore[index]
        self.distinct = distinct
        self.starts = [b[self.split][0] for b in distinct] if self.split is not None else []

    def candidates(self, box: Box) -> list[Box]:
        """Distinct boxes that may overlap ``box`` (all of them when no dimension splits them)."""
        if self.split is None:
            return self.distinct
        a, b = box[self.split]
        # Disjoint ranges sorted by start: only the one starting before ``a`` and those up to ``b``.
        lo = max(0, bisect.bisect_right(self.starts, a) - 1)
        hi = bisect.bisect_left(self.starts, b)
        return self.distinct[lo:hi]


def _intersect(index: _Index, need: Need, problems: list[str]) -> _Template | None:
    """Per need piece, where its box comes from; None (problems appended) when it is not covered."""
    out = []
    for np_ in need.pieces:
        if not _in_bounds(np_.box, need.shape):
            problems.append(f"{need.name}: engine rank {np_.rank} needs {fmt_box(np_.box)}, outside the "
                            f"tensor's shape {need.shape}")
            return None
        if need.param is not None and len(np_.dst_stride) != len(np_.box):
            problems.append(f"{need.name}: engine rank {np_.rank}'s destination stride {np_.dst_stride} "
                            f"has not one entry per dimension of {fmt_box(np_.box)}")
            return None
        parts = []
        covered = 0
        for b in index.candidates(np_.box):
            o = _overlap(np_.box, b)
            if o is None:
                continue
            ranks = index.boxes[b]
            # Replicas: spread engine ranks over them so that no replica sends everything.
            src = ranks[np_.rank % len(ranks)]
            local = tuple((lo - a, hi - a) for (lo, hi), (a, _) in zip(o, b))
            parts.append((src, o, local))
            covered += _volume(o)
        if covered != _volume(np_.box):
            problems.append(
                f"{need.name}: engine rank {np_.rank} needs {fmt_box(np_.box)} "
                f"({_volume(np_.box)} elements), the trainer ranks hold {covered} of them"
            )
            return None
        out.append(tuple(parts))
    return tuple(out)


def _links(template: _Template, need: Need) -> dict[tuple[int, int], int]:
    links: dict[tuple[int, int], int] = {}
    for np_, parts in zip(need.pieces, template):
        for src, box, _ in parts:
            links[(src, np_.rank)] = links.get((src, np_.rank), 0) + _volume(box)
    return links


def _raise(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - _MAX_NAMED} more)" if len(problems) > _MAX_NAMED else ""
        raise ManifestError(f"route plan: {what}: " + "; ".join(problems[:_MAX_NAMED]) + more)


def plan_routes(holdings: Iterable[Holding], needs: Iterable[Need]) -> RoutePlan:
    """Intersect what trainer ranks hold with what engine ranks need; validate before any byte moves.

    Raises ManifestError naming every problem found (the first few): duplicate announcements, needed
    tensors nobody holds, disagreeing shapes or dtypes, inconsistent or out-of-bounds claims, needed
    regions left uncovered. Needs keep their order (routes come out in it: block order when the
    engine announced in block order).
    """
    holdings = list(holdings)
    needs = list(needs)
    problems: list[str] = []
    by_name: dict[str, Holding] = {}
    for h in holdings:
        if h.name in by_name:
            problems.append(f"{h.name}: announced twice by the trainer side")
        by_name[h.name] = h
    seen: set[str] = set()
    for n in needs:
        if n.name in seen:
            problems.append(f"{n.name}: announced twice by the engine side")
        seen.add(n.name)
    _raise(problems, "duplicate announcements")

    missing = [n for n in needs if n.name not in by_name]
    for n in missing:
        ranks = sorted({p.rank for p in n.pieces})
        problems.append(f"{n.name}: needed by engine ranks {ranks}, held by no trainer rank")
    _raise(problems, "needed tensors nobody holds")
    for n in needs:
        h = by_name[n.name]
        if tuple(h.shape) != tuple(n.shape) or h.dtype != n.dtype:
            problems.append(f"{n.name}: engine ranks expect {tuple(n.shape)} {_dtype_name(n.dtype)}, "
                            f"trainer ranks hold {tuple(h.shape)} {_dtype_name(h.dtype)}")
    _raise(problems, "layouts that disagree")

    # Memos keyed by the identity of piece tuples (kept alive in the memo, so ids are not reused):
    # announcers share one tuple between all tensors of a pattern, and hashing 256 pieces per
    # tensor would dominate planning at scale. Templates are keyed by the needed regions alone
    # (rank, box), so that patterns differing only in destination offsets (expert e of every
    # local slot) share one intersection.
    checked: dict[int, tuple[tuple[Piece, ...], _Index | None]] = {}
    regions: dict[int, tuple[tuple[NeedPiece, ...], tuple]] = {}
    templates: dict[tuple[int, tuple], tuple[_Template | None, dict]] = {}
    entries: list[_Entry] = []
    for n in needs:
        h = by_name[n.name]
        hk = id(h.pieces)
        if hk not in checked:
            boxes = _check_holding(h, problems)
            checked[hk] = (h.pieces, None if boxes is None else _Index(boxes))
        index = checked[hk][1]
        if index is None:
            # Report the inconsistency once per pattern, under the first tensor that has it.
            continue
        nk = id(n.pieces)
        if nk not in regions:
            regions[nk] = (n.pieces, tuple((p.rank, p.box) for p in n.pieces))
        key = (hk, regions[nk][1])
        hit = templates.get(key)
        if hit is None:
            t = _intersect(index, n, problems)
            hit = templates[key] = (t, {} if t is None else _links(t, n))
        if hit[0] is not None:
            entries.append(_Entry(need=n, holding=h, template=hit[0], links=hit[1]))
    _raise(problems, "inconsistent layouts")

    needed = {n.name for n in needs}
    return RoutePlan(
        digest=layout_digest(holdings, needs),
        entries=entries,
        unneeded=tuple(sorted(set(by_name) - needed)),
        src_ranks=_ranks(h.pieces for h in holdings),
        dst_ranks=_ranks(n.pieces for n in needs),
    )


def _ranks(piece_tuples: Iterable[tuple[Piece, ...] | tuple[NeedPiece, ...]]) -> tuple[int, ...]:
    """Sorted ranks named by the piece tuples (each distinct tuple object read once)."""
    seen: dict[int, object] = {}
    ranks: set[int] = set()
    for pieces in piece_tuples:
        if id(pieces) not in seen:
            seen[id(pieces)] = pieces
            ranks.update(p.rank for p in pieces)
    return tuple(sorted(ranks))


def layout_digest(holdings: Iterable[Holding], needs: Iterable[Need]) -> str:
    """SHA-256 of both layouts (names, shapes, dtypes, every piece): the key of a reusable plan.

    Piece tuples shared between tensors are serialized once (their digest is memoized by identity).
    """
    memo: dict[int, tuple[object, bytes]] = {}

    def pieces_digest(pieces: tuple) -> bytes:
        hit = memo.get(id(pieces))
        if hit is None:
            hit = memo[id(pieces)] = (pieces, hashlib.sha256(repr(pieces).encode()).digest())
        return hit[1]

    h = hashlib.sha256(b"weight_sync.route_plan.v1\n")
    for x in sorted(holdings, key=lambda x: x.name):
        h.update(f"H {x.name} {tuple(x.shape)} {_dtype_name(x.dtype)}\n".encode())
        h.update(pieces_digest(x.pieces))
    for n in needs:  # order matters: it is the order routes come out in
        h.update(f"N {n.name} {tuple(n.shape)} {_dtype_name(n.dtype)} {n.param}\n".encode())
        h.update(pieces_digest(n.pieces))
    return h.hexdigest()


class RoutePlanCache:
    """Plans by layout digest: a layout seen before gets its plan back without re-planning."""

    def __init__(self, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ConfigError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._plans: OrderedDict[str, RoutePlan] = OrderedDict()
        self.num_planned = 0

    def get(self, holdings: Sequence[Holding], needs: Sequence[Need]) -> RoutePlan:
        """The plan for these layouts: cached when their digest was planned before, else planned now."""
        digest = layout_digest(holdings, needs)
        plan = self._plans.get(digest)
        if plan is None:
            plan = plan_routes(holdings, needs)
            self.num_planned += 1
            self._plans[digest] = plan
            while len(self._plans) > self.max_entries:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(digest)
        return plan


def copy_routes(
    routes: Iterable[Route],
    source: Callable[[str, int], torch.Tensor],
    params: Mapping[str, torch.Tensor],
) -> int:
    """Apply routes with plain copies: ``source(name, src_rank)`` is that rank's local piece; returns bytes.

    The reference implementation of a route's meaning (the data plane must write the same bytes).
    """
    moved = 0
    for r in routes:
        if r.param is None:
            raise ManifestError(f"{r.name}: engine rank {r.dst_rank} loads it through its own loader; "
                                "copy_routes only writes planned destination views")
        piece = source(r.name, r.src_rank)
        src = piece[tuple(slice(a, b) for a, b in r.src_local)]
        dst_param = params[r.param]
        dst = dst_param.as_strided(r.dst_size, r.dst_stride, dst_param.storage_offset() + r.dst_offset)
        dst.copy_(src)
        moved += r.nbytes
    return moved
