"""ShardedReceiver: one engine rank's end of the sharded data plane (see :mod:`.sharded`).

``ShardedReceiver(engine_or_model, address, rank)`` -> ``connect()`` -> ``receive_update()`` per update
-> ``close()``. ``rank`` is the engine rank in ``[0, num_engine_ranks)`` the route plan knows it by
(engine ``j``'s TP rank ``t`` is ``j * tp + t`` for the reference engine's layout). Per update it opens
a session, announces its needs from its reload plan, plans its own routes, receives its regions from
every trainer rank at once and writes them into the planned views (:class:`.sharded_sink.RegionSink`);
the update commits on every engine rank or on none.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError, IncompleteUpdateError, ManifestError, TransportError
from weight_sync.manifest import Manifest
from weight_sync.transport.group import join_store
from weight_sync.transport.routes import Box, Holding, Need, RoutePlan, RoutePlanCache
from weight_sync.transport.routes_layouts import needs_from_model
from weight_sync.transport.sharded import (
    PREFIX,
    TRAILER_BYTES,
    ShardedConfig,
    ShardedReport,
    _digest,
    _Peer,
    receive_links,
)
from weight_sync.transport.sharded_plan import (
    Bucket,
    Item,
    broadcast_items,
    holdings_from_json,
    needs_to_json,
    sharded_items,
)
from weight_sync.transport.sharded_sink import RegionSink

__all__ = ["ShardedReceiver"]

log = logging.getLogger(__name__)

# (box in checkpoint coordinates, destination parameter, destination offset, destination stride)
_Target = tuple[Box, str | None, int, tuple[int, ...]]


def _overlap(x: Box, y: Box) -> Box | None:
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


class ShardedReceiver:
    """Engine side of a sharded transport; see the module docstring.

    target: an engine with ``begin_update(manifest, **options)`` and ``.model``, or an nn.Module.
    rollback / budget_bytes / fingerprint / allow_partial: options of the update session.
    """

    def __init__(self, target: Any, address: str, rank: int, *, rollback: bool = False,
                 budget_bytes: int | None = None, fingerprint: bool = True, allow_partial: bool = False,
                 connect_timeout_s: float = 300.0) -> None:
        # An nn.Module is the model itself (a CausalLM has a .model of its own); else an engine's .model.
        model = target if isinstance(target, nn.Module) else getattr(target, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"ShardedReceiver needs an engine with .model or an nn.Module, got {type(target).__name__}")
        self.target = target
        self.model = model
        self.address = address
        self.rank = rank
        self.session_options = dict(rollback=rollback, budget_bytes=budget_bytes, fingerprint=fingerprint,
                                    allow_partial=allow_partial)
        self.connect_timeout_s = connect_timeout_s
        self.config: ShardedConfig | None = None
        self.last_report: ShardedReport | None = None
        self._peer: _Peer | None = None
        self._manifest: tuple[str, Manifest] | None = None  # (digest, manifest) of the last full manifest
        self._holdings: tuple[str, list[Holding]] | None = None
        self._needs: dict[str, tuple[list[Need], str]] = {}  # by manifest digest: (needs, their digest)
        self._published: set[str] = set()  # needs digests whose JSON is in the store
        self._plans = RoutePlanCache()

    def connect(self) -> ShardedConfig:
        """Join the trainer ranks' transport; returns the wire parameters trainer rank 0 decided."""
        if self._peer is not None:
            raise TransportError(f"[engine rank {self.rank}] connect() was already called")
        store = join_store(self.address, self.connect_timeout_s)
        try:
            store.wait([f"{PREFIX}/config"], _td(self.connect_timeout_s))
            config = ShardedConfig.from_json(store.get(f"{PREFIX}/config"))
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"[engine rank {self.rank}] connect: no wire parameters at {self.address}: {e}") from e
        if not 0 <= self.rank < config.num_engine_ranks:
            raise ConfigError(f"engine rank must be in [0, {config.num_engine_ranks}), got {self.rank}")
        self.config = config
        self._peer = _Peer(config, config.num_trainers + self.rank, store, self.address, "the trainer ranks",
                           self.connect_timeout_s)
        return config

    # ------------------------------------------------------------------ one update
    def receive_update(self, timeout_s: float | None = None) -> Any:
        """Run one whole update as the trainer ranks drive it; returns the engine's UpdateReport."""
        peer = self._require()
        cfg = peer.config
        t0 = time.perf_counter()
        peer.seq += 1
        header = peer.header(None, "start_weight_update", timeout_s)
        session = None
        try:
            error: BaseException | None = None
            plan: RoutePlan | None = None
            needs: list[Need] = []
            holdings: list[Holding] = []
            manifest: Manifest | None = None
            try:
                if header.get("seq") != peer.seq:
                    raise TransportError(f"[engine rank {self.rank}] at update {peer.seq}, the trainers at "
                                         f"{header.get('seq')}")
                manifest = self._manifest_of(header)
                session = self._begin(manifest, header.get("version"))
                needs = self._announce(peer, manifest, header["manifest_digest"])
                holdings = self._holdings_of(peer, header["holdings"])
                plan = self._plans.get(holdings, needs)
            except Exception as e:
                error = e
                if peer.store is not None and not peer.store.check([f"{PREFIX}/needs/{peer.seq}/{self.rank}"]):
                    peer.store.set(f"{PREFIX}/needs/{peer.seq}/{self.rank}", f"!{type(e).__name__}: {e}")
            peer.exchange("start_weight_update", error)
            assert plan is not None and manifest is not None
            mode = peer.header(None, "start_weight_update (mode)")["mode"]
            links, targets = self._links(peer, plan, holdings, manifest, mode)
            error = None
            assert session is not None  # the start exchange raised otherwise
            sink = RegionSink(session, needs, self.rank)
            # Receive memory: depth buckets per sender, all at once; it must fit a reload budget the caller
            # set (the default budget sizes processed layers' staging, which a direct model has none of).
            recv_bytes = sum(cfg.depth * (max(b.nbytes for b in bk) + TRAILER_BYTES) for _, _, bk, _ in links)
            if self.session_options["budget_bytes"] is not None and recv_bytes > session.budget_bytes:
                error = ConfigError(f"[engine rank {self.rank}] receiving from {len(links)} trainer ranks takes "
                                    f"{recv_bytes} bytes of buckets in flight (depth {cfg.depth}), over the reload "
                                    f"budget of {session.budget_bytes} bytes; lower bucket_bytes or depth")

            def consume(src: int, items: list[Item], bucket: Bucket, buf: torch.Tensor) -> None:
                if error is not None:
                    return
                for s in bucket.slots:
                    it = items[s.item]
                    shape = tuple(b - a for a, b in s.box)
                    data = buf[s.offset : s.offset + s.nbytes].view(it.dtype).view(shape)
                    for box, param, off, stride in targets(src, s.item, it.name):
                        o = _overlap(s.box, box)
                        if o is None:
                            continue
                        src_view = data[tuple(slice(a - sa, b - sa) for (a, b), (sa, _) in zip(o, s.box))]
                        dst_off = off + sum((a - ba) * st for (a, _), (ba, _), st in zip(o, box, stride))
                        sink.write(it.name, param, dst_off, stride, o, src_view)

            groups = peer.broadcast_groups() if mode == "broadcast" else None
            region, wire, failed = receive_links(peer, links, consume, self._buffer_device(cfg),
                                                 f"[engine rank {self.rank}]", groups)
            error = error or failed
            if error is None and not self.session_options["allow_partial"] and sink.incomplete():
                left = sink.incomplete()
                error = IncompleteUpdateError(f"[engine rank {self.rank}] {len(left)} key(s) not fully received: "
                                              f"{left[:5]}", tuple(left))
            peer.exchange("update_weights", error, {"received": sum(region.values())})
            summary: dict[str, Any] = {}
            error = None
            try:
                if not self.session_options["allow_partial"]:
                    missing = session.missing()
                    if missing:
                        raise IncompleteUpdateError(f"[engine rank {self.rank}] {len(missing)} announced "
                                                    f"tensor(s) never arrived: {missing[:5]}", tuple(missing))
                session.prepare()
                summary = {"engine_rank": self.rank, "mode": mode, "region_bytes": sink.region_bytes,
                           "by_trainer": {str(k): v for k, v in region.items()}}
            except Exception as e:
                error = e
            peer.exchange("finish_weight_update", error, summary)
            report = session.commit()
            session = None
        finally:
            if session is not None:
                self._abort(session)
        self._committed(report)
        self.last_report = ShardedReport(version=report.version, mode=mode, region_bytes=region, wire_bytes=wire,
                                         seconds=time.perf_counter() - t0, update=report)
        return report

    def _buffer_device(self, cfg: ShardedConfig) -> torch.device:
        """Where buckets land: the model's CUDA device over NCCL, host memory over gloo."""
        if cfg.backend != "nccl":
            return torch.device("cpu")
        device = next((t.device for t in self.model.parameters() if t.device.type == "cuda"), None)
        if device is None:
            raise ConfigError(f"[engine rank {self.rank}] backend 'nccl' needs the engine's model on a CUDA device")
        return device

    def _abort(self, session: Any) -> None:
        try:
            session.abort("the sharded update failed")
        except Exception as e:  # the failure that got us here is what the caller must see
            log.error("[engine rank %d] aborting the session failed too: %s", self.rank, e)

    def _committed(self, report: Any) -> None:
        if hasattr(self.target, "last_report") and self.target is not self.model:
            self.target.last_report = report

    def _manifest_of(self, header: dict[str, Any]) -> Manifest:
        digest = header["manifest_digest"]
        if header.get("manifest") is not None:
            if _digest(header["manifest"]) != digest:
                raise ManifestError(f"[engine rank {self.rank}] the manifest does not match its digest")
            self._manifest = (digest, Manifest.from_json(header["manifest"]))
        if self._manifest is None or self._manifest[0] != digest:
            raise TransportError(f"[engine rank {self.rank}] the trainers reuse manifest {digest[:12]}, which this "
                                 "rank does not hold")
        return self._manifest[1].with_version(header.get("version"))

    def _begin(self, manifest: Manifest, version: Any) -> Any:
        opts = dict(self.session_options, version=version)
        begin = getattr(self.target, "begin_update", None)
        if begin is not None and callable(begin):
            return begin(manifest, **opts)
        from weight_sync.reload.api import begin_update

        return begin_update(self.model, manifest, **opts)

    def _announce(self, peer: _Peer, manifest: Manifest, manifest_digest: str) -> list[Need]:
        """This rank's needs for ``manifest`` (planned once per manifest), published for the trainers."""
        hit = self._needs.get(manifest_digest)
        if hit is None:
            needs = needs_from_model(self.model, manifest.tensors, self.rank)
            text = needs_to_json(needs)
            hit = self._needs[manifest_digest] = (needs, _digest(text))
            if hit[1] not in self._published:
                peer.store.set(f"{PREFIX}/needs_json/{self.rank}/{hit[1]}", text)
                self._published.add(hit[1])
        peer.store.set(f"{PREFIX}/needs/{peer.seq}/{self.rank}", hit[1])
        if peer.seq > 1:
            # Every trainer rank read the last update's key before that update's start exchange.
            peer.store.delete_key(f"{PREFIX}/needs/{peer.seq - 1}/{self.rank}")
        return hit[0]

    def _holdings_of(self, peer: _Peer, digest: str) -> list[Holding]:
        if self._holdings is None or self._holdings[0] != digest:
            raw = peer.store.get(f"{PREFIX}/holdings/{digest}")
            if _digest(raw.decode()) != digest:
                raise ManifestError(f"[engine rank {self.rank}] the trainers' holdings do not match their digest")
            self._holdings = (digest, holdings_from_json(raw))
        return self._holdings[1]

    def _links(self, peer: _Peer, plan: RoutePlan, holdings: list[Holding], manifest: Manifest,
               mode: str) -> tuple[list[tuple[int, list[Item], list[Bucket], int]], Any]:
        """Per trainer rank, this rank's cut of the link, and where each item's regions go."""
        d = self.rank
        out = []
        routes: dict[int, list[_Target]] = {}
        pieces: dict[str, list[_Target]] = {}
        for e in plan.entries:
            pieces[e.need.name] = [(p.box, e.need.param, p.dst_offset, p.dst_stride)
                                   for p in e.need.pieces if p.rank == d]
        for s in range(peer.config.num_trainers):
            if mode == "sharded":
                items = sharded_items(plan, s, d)
                key: tuple = (plan.digest, "sharded", s, d)
                routes[s] = [(r.src_box, r.param, r.dst_offset, r.dst_stride)
                             for r in plan.routes(src_rank=s, dst_rank=d) if r.nbytes]
                assert len(routes[s]) == len(items)
            else:
                items = broadcast_items(holdings, manifest.tensors, s)
                key = (plan.digest, "broadcast", s)
            items, buckets, digest = peer.cut(key, items)
            if buckets:
                out.append((s, items, buckets, digest))

        def targets(src: int, item: int, name: str) -> list[_Target]:
            if mode == "sharded":
                return [routes[src][item]]
            return pieces.get(name, [])

        return out, targets

    def _require(self) -> _Peer:
        if self._peer is None:
            raise TransportError(f"[engine rank {self.rank}] connect() first")
        self._peer.channel.check()
        return self._peer

    def close(self) -> None:
        """Release the groups (local)."""
        if self._peer is not None:
            self._peer.close()
            self._peer = None


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)
