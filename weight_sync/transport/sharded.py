"""The sharded data plane: every trainer rank sends what it holds, every engine rank receives its shard.

``ShardedSender`` runs on every trainer rank (rank 0 hosts the rendezvous store), ``ShardedReceiver``
on every engine rank. One update is one transaction over all of them:

1. **start**: trainer rank 0 broadcasts the manifest (block order) and the digest of the trainer
   side's holdings (their JSON is in the store, once per layout). Each engine rank opens its update
   session (the manifest is validated against its reload plan before any write), announces its
   needs (from that plan; JSON in the store once per layout, a digest per update) and plans its own
   routes; the trainer ranks plan every link (:class:`~weight_sync.transport.routes.RoutePlanCache`:
   planned once per layout). A status exchange makes every rank raise the same error if any of this
   failed - the model is untouched.
2. **mode**: rank 0 broadcasts the plane it chose (``sharded``, or ``broadcast`` when that moves fewer
   bytes on the busiest link, see :func:`~weight_sync.transport.sharded_plan.choose_mode`).
3. **data**: per (trainer, engine) link, the link's items cut into buckets in block order
   (:func:`~weight_sync.transport.sharded_plan.cut_buckets`), sent point to point (gloo on CPU, NCCL
   on GPU) with ``depth`` buckets in flight per link; each bucket's trailer carries its index, length,
   checksum and the cut's digest. An engine rank posts receives from every sender at once and takes
   whichever bucket lands first (any order across senders, block order within one), with
   ``senders x depth`` buckets of receive memory, which must fit the reload budget; each region is
   written straight into the view its reload plan recorded (:class:`~weight_sync.transport.sharded_sink.RegionSink`).
   A rank that failed locally (a checksum, a write) keeps receiving without writing, so no peer waits.
4. **status**, then **finish**: every rank reports (engines: bytes per sender; trainers: bytes per
   engine rank); engines prepare their commit (completeness, processing, pointer audit) and every rank
   agrees on it in one exchange before any commits: committed on all engine ranks or on none (rolled
   back with ``rollback=True``, otherwise torn).

Every wait has a deadline. A dead or silent peer raises within the timeout on every rank and breaks the
transport (a point-to-point message may be half matched): close it and connect a new one.

Limitations: trainer ranks must hold plain tensors of their pieces (``DTensor.to_local()``); a key an
engine loads through a computing loader is staged whole on that rank; NCCL sends are issued one link
at a time (``pg.send`` / ``pg.recv``), not coalesced with ``batch_isend_irecv``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from weight_sync.checksum import bucket_checksum, checksum_value
from weight_sync.errors import (
    ChecksumError,
    ConfigError,
    ManifestError,
    TransportError,
    TransportTimeout,
)
from weight_sync.manifest import Manifest
from weight_sync.transport.group import (
    Channel,
    host_store,
    join_store,
    make_group,
    node_address,
)
from weight_sync.transport.routes import Holding, Need, RoutePlan, RoutePlanCache
from weight_sync.transport.routes_layouts import merge_needs
from weight_sync.transport.sharded_plan import (
    Bucket,
    Item,
    broadcast_items,
    choose_mode,
    cut_buckets,
    cut_digest,
    holdings_to_json,
    needs_from_json,
    sharded_items,
)
from weight_sync.transport.status import raise_agreed, status_of

__all__ = ["ShardedConfig", "ShardedReport", "ShardedSender"]

log = logging.getLogger(__name__)

PREFIX = "weight_sync/sharded"
TRAILER_WORDS = 4  # int64: bucket index, payload bytes, checksum, cut digest
TRAILER_BYTES = 8 * TRAILER_WORDS


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedConfig:
    """Wire parameters of a sharded transport, decided by trainer rank 0 and read by every engine rank.

    backend: 'gloo' (CPU tensors) or 'nccl' (CUDA tensors). mode: 'sharded', 'broadcast' or 'auto'
    (the plane whose busiest link carries fewer bytes). bucket_bytes: payload of one message. depth:
    buckets in flight per link. timeout_s: the longest any wait may make no progress.
    """

    num_trainers: int
    num_engine_ranks: int
    backend: str = "gloo"
    mode: str = "auto"
    bucket_bytes: int = 4 << 20
    depth: int = 2
    timeout_s: float = 60.0
    host: str | None = None
    port: int = 0

    def __post_init__(self) -> None:
        if self.num_trainers < 1 or self.num_engine_ranks < 1:
            raise ConfigError(f"num_trainers and num_engine_ranks must be >= 1, got {self.num_trainers} and "
                              f"{self.num_engine_ranks}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.mode not in ("auto", "sharded", "broadcast"):
            raise ConfigError(f"mode must be 'auto', 'sharded' or 'broadcast', got {self.mode!r}")
        if self.bucket_bytes < 1024 or self.bucket_bytes % 16:
            raise ConfigError(f"bucket_bytes must be a multiple of 16 and >= 1024, got {self.bucket_bytes}")
        if self.depth < 1:
            raise ConfigError(f"depth must be >= 1, got {self.depth}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_engine_ranks

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__})  # type: ignore[attr-defined]

    @classmethod
    def from_json(cls, raw: str | bytes) -> ShardedConfig:
        try:
            return cls(**json.loads(raw))
        except (TypeError, ValueError) as e:
            raise TransportError(f"sharded transport: malformed wire parameters: {e}") from e


@dataclass(slots=True)
class ShardedReport:
    """What one rank moved in one update: region bytes per peer (the plan's, counted on the wire)."""

    version: Any
    mode: str
    region_bytes: dict[int, int]  # by peer: engine rank (trainer side) or trainer rank (engine side)
    wire_bytes: int  # payload, padding and trailers actually sent or received
    seconds: float
    engines: list[dict[str, Any]] = field(default_factory=list)  # the engine ranks' summaries (trainer side)
    update: Any = None  # the engine's UpdateReport (engine side)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class _Peer:
    """The connection every rank of a sharded transport shares: store, control channel, data group."""

    def __init__(self, config: ShardedConfig, group_rank: int, store: Any, address: str, peers: str,
                 connect_timeout_s: float) -> None:
        self.config = config
        self.group_rank = group_rank
        self.store = store
        self.address = address
        # Joining waits for every rank (a restarted one may take its start-up time); every later wait has
        # its own deadline of timeout_s, so the groups' own timeout is only a backstop.
        join_s = max(config.timeout_s, connect_timeout_s)
        ctl = make_group("gloo", store, f"{PREFIX}/ctl", group_rank, config.world_size, join_s)
        self.channel = Channel(ctl, group_rank, config.world_size, config.timeout_s, peers)
        self.data = make_group(config.backend, store, f"{PREFIX}/data", group_rank, config.world_size, join_s)
        self.join_s = join_s
        self.channel.add_group(self.data)
        self.seq = 0
        self.cuts: dict[tuple, tuple[list[Item], list[Bucket], int]] = {}
        self._bcast: dict[int, Any] | None = None
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def broadcast_groups(self) -> dict[int, Any]:
        """Per trainer rank ``s``, the group {s, every engine rank} it broadcasts its pieces over (root 0).

        Made the first time an update runs in broadcast mode, at the same point on every rank (after the
        mode header); a trainer rank joins only its own group.
        """
        if self._bcast is None:
            cfg, r = self.config, self.group_rank
            out = {}
            for s in range(cfg.num_trainers):
                if r == s or r >= cfg.num_trainers:
                    rank = 0 if r == s else 1 + r - cfg.num_trainers
                    out[s] = make_group(cfg.backend, self.store, f"{PREFIX}/bcast/{s}", rank,
                                        cfg.num_engine_ranks + 1, self.join_s)
                    self.channel.add_group(out[s])
            self._bcast = out
        return self._bcast

    def header(self, payload: dict[str, Any] | None, phase: str, timeout_s: float | None = None) -> dict[str, Any]:
        raw = self.channel.broadcast_bytes(None if payload is None else json.dumps(payload).encode(), phase,
                                           timeout_s)
        try:
            return json.loads(raw)
        except ValueError as e:
            msg = f"[rank {self.group_rank}] {phase}: malformed header: {e}"
            self.channel.fail(msg)
            raise TransportError(msg) from e

    def cut(self, key: tuple, items: list[Item]) -> tuple[list[Item], list[Bucket], int]:
        hit = self.cuts.get(key)
        if hit is None:
            buckets = cut_buckets(items, self.config.bucket_bytes)
            hit = self.cuts[key] = (items, buckets, cut_digest(items, buckets))
            while len(self.cuts) > 64:
                self.cuts.pop(next(iter(self.cuts)))
        return hit

    def exchange(self, phase: str, error: BaseException | None, report: dict[str, Any] | None = None) -> list:
        statuses = self.channel.exchange_status(status_of(self.group_rank, phase, error, report))
        raise_agreed(statuses, phase, self.config.world_size, local=error)
        return statuses

    def buffers(self, key: tuple, n: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """``n`` bucket buffers of one link, allocated once and reused by every update of that layout."""
        bufs = self._buffers.get(key)
        if bufs is None or len(bufs) != n or bufs[0].numel() < nbytes or bufs[0].device != device:
            bufs = self._buffers[key] = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        return bufs

    def close(self) -> None:
        self.channel.close()
        self.store = None
        self._buffers = {}


def _trailer(buf: torch.Tensor, b: Bucket, digest: int) -> None:
    words = buf[b.nbytes : b.nbytes + TRAILER_BYTES].view(torch.int64)
    value = checksum_value(bucket_checksum(buf[: b.nbytes]), b.nbytes) if b.nbytes else 0
    signed = value - (1 << 64) if value >= 1 << 63 else value
    words.copy_(torch.tensor([b.index, b.nbytes, signed, digest], dtype=torch.int64))


def check_trailer(buf: torch.Tensor, b: Bucket, digest: int, what: str) -> None:
    """Refuse a bucket whose trailer disagrees with what this end planned (ChecksumError / ManifestError)."""
    index, nbytes, checksum, got_digest = buf[b.nbytes : b.nbytes + TRAILER_BYTES].view(torch.int64).tolist()
    if got_digest != digest or index != b.index or nbytes != b.nbytes:
        raise ManifestError(f"{what}: bucket {b.index} ({b.nbytes} bytes) arrived as bucket {index} ({nbytes} "
                            "bytes) of a different cut; the two ends planned the link differently")
    value = checksum_value(bucket_checksum(buf[: b.nbytes]), b.nbytes) if b.nbytes else 0
    if (value - (1 << 64) if value >= 1 << 63 else value) != checksum:
        raise ChecksumError(f"{what}: bucket {b.index} ({b.nbytes} bytes): checksum mismatch")


class ShardedSender:
    """One trainer rank's end of a sharded transport (see the module docstring).

    ``ShardedSender(config, rank)``; rank 0 hosts the store (``address`` is then its 'host:port'), every
    other rank and every engine rank connects to that address. ``connect()`` on every rank, then per
    update ``send(holdings, local, manifest, version)`` on every trainer rank at once.
    """

    def __init__(self, config: ShardedConfig, rank: int, address: str | None = None, *,
                 connect_timeout_s: float = 300.0) -> None:
        if not 0 <= rank < config.num_trainers:
            raise ConfigError(f"rank must be in [0, {config.num_trainers}), got {rank}")
        if (rank == 0) != (address is None):
            raise ConfigError("trainer rank 0 hosts the store (no address); every other rank needs its address")
        self.config = config
        self.rank = rank
        self.connect_timeout_s = connect_timeout_s
        self._store: Any = None
        if rank == 0:
            self._store = host_store(config.host or node_address(), config.port, config.timeout_s)
            self.address = f"{config.host or node_address()}:{self._store.port}"
        else:
            self.address = address  # type: ignore[assignment]
        self._peer: _Peer | None = None
        self._plans = RoutePlanCache()
        self._needs: dict[tuple[int, str], list[Need]] = {}
        self._last: tuple[str, str] | None = None  # (manifest, holdings) digests rank 0 announced last

    def connect(self) -> None:
        """Join the transport (rank 0: publish the wire parameters first)."""
        if self._peer is not None:
            raise TransportError(f"[trainer rank {self.rank}] connect() was already called")
        store = self._store if self._store is not None else join_store(self.address, self.connect_timeout_s)
        if self.rank == 0:
            store.set(f"{PREFIX}/config", self.config.to_json())
        self._peer = _Peer(self.config, self.rank, store, self.address, "the other ranks", self.connect_timeout_s)

    def send(self, holdings: Sequence[Holding], local: Mapping[str, torch.Tensor], manifest: Manifest,
             version: Any = None) -> ShardedReport:
        """Run one update: ``local`` holds this rank's piece of every tensor ``holdings`` give it.

        The arguments are what :meth:`trainers.fsdp.FSDPSource.shards` returns: ``send(*source.shards())``.
        """
        peer = self._require()
        t0 = time.perf_counter()
        peer.seq += 1
        cfg = self.config
        manifest_json = Manifest(manifest.tensors, version=None).to_json()
        hold_json = holdings_to_json(holdings)
        digests = (_digest(manifest_json), _digest(hold_json))
        error: BaseException | None = None
        header = None
        if self.rank == 0:
            if self._last is None or self._last[1] != digests[1]:
                peer.store.set(f"{PREFIX}/holdings/{digests[1]}", hold_json)
            same = self._last is not None and self._last[0] == digests[0]
            header = {"kind": "start", "seq": peer.seq, "version": version, "manifest_digest": digests[0],
                      "manifest": None if same else manifest_json, "holdings": digests[1]}
            self._last = digests
        header = peer.header(header, "start_weight_update")
        if header.get("seq") != peer.seq:
            error = TransportError(f"[trainer rank {self.rank}] at update {peer.seq}, rank 0 at {header.get('seq')}")
        elif (header["manifest_digest"], header["holdings"]) != digests:
            error = ManifestError(f"[trainer rank {self.rank}] its manifest or holdings differ from trainer rank "
                                  "0's (every trainer rank must announce the same layout)")
        plan = None
        if error is None:
            try:
                _check_local(local, holdings, self.rank)
                plan = self._plan(peer, holdings, manifest)
            except Exception as e:
                error = e
        peer.exchange("start_weight_update", error)
        assert plan is not None
        mode = choose_mode(plan, cfg.mode, cfg.backend)
        got = peer.header({"mode": mode} if self.rank == 0 else None, "start_weight_update (mode)")
        mode = got["mode"]
        links = self._links(peer, plan, holdings, manifest, mode)
        group = peer.broadcast_groups()[self.rank] if mode == "broadcast" else None
        # Local pieces were checked at start: what fails here is communication, which breaks the channel
        # (no exchange can follow) and raises on this rank; the peers see it fail or time out.
        region, wire = _send_links(peer, links, local, holdings, self.rank, group)
        sent = sum(region.values())
        peer.exchange("update_weights", None, {"sent": sent})
        statuses = peer.exchange("finish_weight_update", None)
        engines = [s.report for s in statuses[cfg.num_trainers:]]
        return ShardedReport(version=header["version"], mode=mode, region_bytes=region, wire_bytes=wire,
                             seconds=time.perf_counter() - t0, engines=engines)

    def _plan(self, peer: _Peer, holdings: Sequence[Holding], manifest: Manifest) -> RoutePlan:
        """Read every engine rank's needs for this update and plan (or reuse) every link."""
        cfg = self.config
        keys = [f"{PREFIX}/needs/{peer.seq}/{d}" for d in range(cfg.num_engine_ranks)]
        try:
            peer.store.wait(keys, timedelta(seconds=cfg.timeout_s))
        except Exception as e:
            raise TransportTimeout(f"[trainer rank {self.rank}] start_weight_update: not every engine rank "
                                   f"announced its needs within {cfg.timeout_s:.1f} s: {e}") from e
        announced = []
        for d, key in enumerate(keys):
            digest = peer.store.get(key).decode()
            if digest.startswith("!"):
                # That engine rank failed before planning; its error comes in the status exchange.
                raise ManifestError(f"engine rank {d} could not announce its needs: {digest[1:]}")
            needs = self._needs.get((d, digest))
            if needs is None:
                needs = needs_from_json(peer.store.get(f"{PREFIX}/needs_json/{d}/{digest}"))
                self._needs = {k: v for k, v in self._needs.items() if k[0] != d}
                self._needs[(d, digest)] = needs
            announced.append(needs)
        merged = merge_needs(announced, order=manifest.names)
        return self._plans.get(holdings, merged)

    def _links(self, peer: _Peer, plan: RoutePlan, holdings: Sequence[Holding], manifest: Manifest,
               mode: str) -> list[tuple[int, list[Item], list[Bucket], int]]:
        out = []
        for d in range(self.config.num_engine_ranks):
            if mode == "sharded":
                items = sharded_items(plan, self.rank, d)
                key: tuple = (plan.digest, "sharded", self.rank, d)
            else:
                items = broadcast_items(holdings, manifest.tensors, self.rank)
                key = (plan.digest, "broadcast", self.rank)
            items, buckets, digest = peer.cut(key, items)
            if buckets:
                out.append((d, items, buckets, digest))
        return out

    def _require(self) -> _Peer:
        if self._peer is None:
            raise TransportError(f"[trainer rank {self.rank}] connect() first")
        self._peer.channel.check()
        return self._peer

    def close(self) -> None:
        """Release the groups (local; the other ranks close on their own)."""
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        self._store = None


def _check_local(local: Mapping[str, torch.Tensor], holdings: Sequence[Holding], rank: int) -> None:
    """Every piece the holdings give ``rank`` is in ``local`` with the box's shape and the dtype."""
    problems = []
    for h in holdings:
        for p in h.pieces:
            if p.rank != rank:
                continue
            t = local.get(h.name)
            shape = tuple(b - a for a, b in p.box)
            if t is None:
                problems.append(f"{h.name}: no local piece (the holdings give this rank {shape})")
            elif tuple(t.shape) != shape or t.dtype != h.dtype:
                problems.append(f"{h.name}: the holdings give this rank {shape} {h.dtype}, its local piece is "
                                f"{tuple(t.shape)} {t.dtype}")
            break
    if problems:
        raise ManifestError(f"[trainer rank {rank}] local pieces disagree with the holdings: "
                            + "; ".join(problems[:8]) + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))


def _piece_boxes(holdings: Sequence[Holding], rank: int) -> dict[str, tuple]:
    out = {}
    for h in holdings:
        for p in h.pieces:
            if p.rank == rank:
                out[h.name] = p.box
                break
    return out


def _send_links(peer: _Peer, links: list[tuple[int, list[Item], list[Bucket], int]],
                local: Mapping[str, torch.Tensor], holdings: Sequence[Holding], rank: int,
                group: Any = None) -> tuple[dict[int, int], int]:
    """Send every link's buckets, ``depth`` in flight per link; links with one cut share its packing.

    ``group``: broadcast mode, every link has the same cut and each bucket is one broadcast over it.
    """
    cfg = peer.config
    boxes = _piece_boxes(holdings, rank)
    shared: dict[int, list[int]] = {}  # cut digest -> engine ranks (broadcast: all of them)
    cut_of: dict[int, tuple[list[Item], list[Bucket]]] = {}
    for d, items, buckets, digest in links:
        shared.setdefault(digest, []).append(d)
        cut_of[digest] = (items, buckets)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    region: dict[int, int] = {d: 0 for d, *_ in links}
    wire = 0
    bufs = {g: peer.buffers(("send", i), cfg.depth, max(b.nbytes for b in cut_of[g][1]) + TRAILER_BYTES, device)
            for i, g in enumerate(shared)}
    inflight: dict[tuple[int, int], list[Any]] = {}
    longest = max((len(c[1]) for c in cut_of.values()), default=0)
    for k in range(longest):
        for g, dsts in shared.items():
            items, buckets = cut_of[g]
            if k >= len(buckets):
                continue
            slot = k % cfg.depth
            for w in inflight.pop((g, slot), []):
                wait_p2p(peer, w, f"update_weights: send of bucket {k - cfg.depth} to engine ranks {dsts}")
            buf, b = bufs[g][slot], buckets[k]
            for s in b.slots:
                it = items[s.item]
                piece = local.get(it.name)
                if piece is None or it.name not in boxes:
                    raise ManifestError(f"[trainer rank {rank}] {it.name}: the plan sends a region of it from "
                                        "this rank, which holds no local piece of it")
                src = piece[tuple(slice(a - pa, b_ - pa) for (a, b_), (pa, _) in zip(s.box, boxes[it.name]))]
                buf[s.offset : s.offset + s.nbytes].view(it.dtype).view(src.shape).copy_(src)
            _trailer(buf, b, g)
            msg = buf[: b.nbytes + TRAILER_BYTES]
            if group is not None:
                works = [_ibroadcast(peer, group, msg)]
            else:
                works = [_isend(peer, msg, cfg.num_trainers + d, k) for d in dsts]
            for d in dsts:
                region[d] += sum(s.nbytes for s in b.slots)
                wire += msg.numel()
            inflight[(g, slot)] = works
    for works in inflight.values():
        for w in works:
            wait_p2p(peer, w, "update_weights: the last sends")
    return region, wire


def _isend(peer: _Peer, msg: torch.Tensor, dst: int, tag: int) -> Any:
    return peer.channel.guard("update_weights: send", lambda: peer.data.send([msg], dst, tag))


def _irecv(peer: _Peer, msg: torch.Tensor, src: int, tag: int) -> Any:
    return peer.channel.guard("update_weights: receive", lambda: peer.data.recv([msg], src, tag))


def _ibroadcast(peer: _Peer, group: Any, msg: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return peer.channel.guard("update_weights: broadcast", lambda: group.broadcast([msg], opts))


def wait_p2p(peer: _Peer, work: Any, phase: str) -> None:
    """Wait for a point-to-point work (or a broadcast) with the full timeout; a failure breaks the channel.

    Never in slices: a gloo send or receive whose wait times out poisons every pair of its context, so
    the one wait this rank makes is the deadline. NCCL works are polled (their ``wait`` is a stream wait).
    """
    cfg = peer.config
    if cfg.backend == "nccl":
        peer.channel.wait(work, phase)
        return
    try:
        work.wait(timedelta(seconds=cfg.timeout_s))
    except Exception as e:
        is_timeout = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
        msg = f"[rank {peer.group_rank}] {phase}: {'timed out' if is_timeout else 'failed'}: {e}"
        peer.channel.fail(msg)
        raise (TransportTimeout if is_timeout else TransportError)(msg) from e


def receive_links(peer: _Peer, links: list[tuple[int, list[Item], list[Bucket], int]], consume: Any,
                  device: torch.device, what: str,
                  groups: dict[int, Any] | None = None) -> tuple[dict[int, int], int, BaseException | None]:
    """Receive every link's buckets from all senders at once, taking them in whatever order they land.

    One receiving thread per link (a gloo receive cannot be polled: its completion is only seen by a
    blocking wait) keeps up to ``depth`` buckets of its link posted; this thread takes landed buckets
    from all links in arrival order (block order within a link). ``consume(src, items, bucket,
    buffer)`` takes a verified bucket; a failure in it (or in a check) is returned as the rank's error
    and the remaining buckets are received without being consumed, so no sender is left waiting. No
    bucket from any link within the timeout, or a failed receive, breaks the channel and raises.
    ``groups``: broadcast mode, trainer rank ``s``'s buckets arrive by broadcasts over ``groups[s]``.
    """
    cfg = peer.config
    region: dict[int, int] = {s: 0 for s, *_ in links}
    wire = 0
    error: BaseException | None = None
    landed: queue.Queue = queue.Queue()
    free = {s: threading.Semaphore(cfg.depth) for s, *_ in links}
    stop = threading.Event()
    bufs = {s: peer.buffers(("recv", s), cfg.depth, max(b.nbytes for b in buckets) + TRAILER_BYTES, device)
            for s, _, buckets, _ in links}

    def receive(s: int, buckets: list[Bucket]) -> None:
        try:
            for k, b in enumerate(buckets):
                while not free[s].acquire(timeout=0.1):
                    if stop.is_set():
                        return
                msg = bufs[s][k % cfg.depth][: b.nbytes + TRAILER_BYTES]
                work = _ibroadcast(peer, groups[s], msg) if groups is not None else _irecv(peer, msg, s, k)
                wait_p2p(peer, work, f"update_weights: bucket {k} from trainer rank {s}")
                landed.put((s, k, None))
        except BaseException as e:
            landed.put((s, -1, e))

    threads = [threading.Thread(target=receive, args=(s, buckets), daemon=True,
                                name=f"ws-sharded-recv-{peer.group_rank}-from-{s}")
               for s, _, buckets, _ in links]
    for t in threads:
        t.start()
    left = sum(len(buckets) for _, _, buckets, _ in links)
    state = {s: (items, buckets, digest) for s, items, buckets, digest in links}
    try:
        while left:
            try:
                s, k, failure = landed.get(timeout=cfg.timeout_s)
            except queue.Empty:
                msg = (f"[rank {peer.group_rank}] update_weights: no bucket from trainer ranks "
                       f"{sorted(state)} within {cfg.timeout_s:.1f} s")
                peer.channel.fail(msg)
                raise TransportTimeout(msg) from None
            if failure is not None:
                peer.channel.fail(f"[rank {peer.group_rank}] receive from trainer rank {s}: {failure}")
                if isinstance(failure, TransportError):
                    raise failure
                raise TransportError(f"[rank {peer.group_rank}] update_weights: receive from trainer rank {s} "
                                     f"failed: {failure}") from failure
            items, buckets, digest = state[s]
            b = buckets[k]
            buf = bufs[s][k % cfg.depth]
            wire += b.nbytes + TRAILER_BYTES
            if error is None:
                try:
                    check_trailer(buf, b, digest, f"{what}, from trainer rank {s}")
                    consume(s, items, b, buf)
                    region[s] += sum(x.nbytes for x in b.slots)
                except Exception as e:
                    error = e
            free[s].release()
            left -= 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=0 if peer.channel.broken else cfg.timeout_s)
    return region, wire, error
