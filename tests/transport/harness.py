"""Multi-process scenarios for transport tests: rank 0 is the trainer, ranks 1..N engine workers.

Functions here run in spawned processes (``run_distributed`` needs module-level functions). The default
gloo group of ``run_distributed`` is only test plumbing: it passes the sender's address and hosts the
engine's TP subgroup; the transport forms its own groups through the sender's store.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.reload import torn_reason
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender


def resident_kb() -> dict[str, int]:
    """This process's resident set by kind, in KiB, from /proc/self/status: RssAnon (heap, stacks,
    allocator arenas), RssShmem (shared-memory segments it maps) and RssFile (library code and mapped
    files)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def settled_resident_kb() -> dict[str, int]:
    """The resident set after garbage collection and glibc's malloc_trim: freed heap that the allocator
    keeps in its arenas is returned first, so what remains is memory something still holds (a leak shows;
    arena churn from one update to the next does not)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_kb()


def _share_address(rank: int, address: str | None) -> str:
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("test/address", address or "")
    return store.get("test/address").decode()


def _engine_group(world: int, tp: bool) -> Any:
    # Every rank of the default group must take part in creating a subgroup, the trainer included.
    return dist.new_group(list(range(1, world))) if tp and world > 2 else None


def connect_pair(rank: int, world: int, backend: str, ckpt: str, *, tp: bool = True, bucket_bytes: int = 64 << 10,
                 timeout_s: float = 30.0, rollback: bool = False, quantization: Any = None,
                 config: dict | None = None):
    """(sender, None, None) on rank 0; (receiver, engine, tp_group) on engine ranks, all connected.

    tp: engine ranks form one tensor-parallel engine; otherwise each is an independent engine.
    """
    group = _engine_group(world, tp)
    if rank == 0:
        sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                                              **(config or {})), num_receivers=world - 1)
        _share_address(0, sender.address)
        sender.connect()
        return sender, None, None
    address = _share_address(rank, None)
    engine = ReferenceEngine.from_checkpoint(ckpt, tp_group=group, quantization=quantization)
    receiver = WeightReceiver(engine, address, rank, rollback=rollback)
    receiver.connect()
    return receiver, engine, group


def sync_end_to_end(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, calls: int) -> dict:
    """Two updates (b, then a, then b again split into ``calls`` calls); engines report fingerprints."""
    end, engine, group = connect_pair(rank, world, backend, ckpt_a)
    if rank == 0:
        reports = []
        for version, ckpt in ((1, ckpt_b), (2, ckpt_a), (3, ckpt_b)):
            src = CheckpointSource(ckpt)
            manifest = src.manifest(version)
            end.start_weight_update(manifest, version)
            names = list(manifest.names)
            n = calls if version == 3 else 1
            cuts = [len(names) * i // n for i in range(n + 1)]
            tensors = iter(src)
            for lo, hi in itertools.pairwise(cuts):
                part = [next(tensors) for _ in range(hi - lo)]
                end.update_weights(part, names=names[lo:hi])
            reports.append(end.finish_weight_update())
        end.close()
        return {"versions": [r.version for r in reports], "fingerprints": [r.fingerprints for r in reports],
                "buckets": [r.num_buckets for r in reports],
                "timings": [(r.transfer_seconds, r.call_seconds, r.seconds) for r in reports]}
    versions, fps = [], []
    for _ in range(3):
        report = end.receive_update()
        versions.append(end.weight_version)
        fps.append(report.fingerprint)
    fresh_b = ReferenceEngine.from_checkpoint(ckpt_b, tp_group=group).fingerprint()
    fresh_a = ReferenceEngine.from_checkpoint(ckpt_a, tp_group=group).fingerprint()
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    fresh = ReferenceEngine.from_checkpoint(ckpt_b, tp_group=group).model.state_dict()
    equal = all(torch.equal(state[k], fresh[k]) for k in fresh)
    tokens = engine.generate([[5, 6, 7]], 4)
    end.close()
    return {"versions": versions, "fingerprints": fps, "fresh": [fresh_b, fresh_a, fresh_b],
            "bitwise_equal": equal, "tokens": tokens}


def _flip_byte_in_bucket(receiver: WeightReceiver, bucket: int) -> None:
    """Corrupt one payload byte of ``bucket`` after it arrived and before it is checked (a bad wire).

    Only rank 1 flips: with shm every receiver maps the same buffer, and two flips would cancel out.
    """
    plane = receiver._plane
    real_wait = plane.wait

    def wait(k: int, i: int, host: bool = True) -> Any:
        out = real_wait(k, i, host)
        if k == bucket and receiver.rank == 1:
            receiver._buffers[i][100] ^= 0x5A
        return out

    plane.wait = wait  # type: ignore[method-assign]


def faults_then_recovery(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, rollback: bool,
                         verify: str = "deferred") -> dict:
    """On one connection: a flipped byte, a manifest the engine rejects, a source that disagrees with its
    manifest, a receiver whose load fails -- each agreed by every rank -- then a clean update."""
    end, engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False, rollback=rollback,
                                  config={"verify": verify})
    src = CheckpointSource(ckpt_b)
    manifest = src.manifest()
    outcomes: list[tuple[str, str]] = []
    messages: dict[str, str] = {}

    def attempt(label: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            outcomes.append((label, "ok"))
        except Exception as e:
            outcomes.append((label, type(e).__name__))
            messages[label] = str(e)

    if rank == 0:
        # 1. a byte flipped on the wire in bucket 8 (receivers corrupt their copy)
        attempt("checksum", lambda: end.send(src, manifest, version=10))
        # 2. a manifest with a shape the engine cannot take
        bad = [m if m.name != "model.norm.weight" else type(m)(m.name, m.dtype, (m.shape[0] + 1,)) for m in manifest]
        attempt("engine_rejects_manifest", lambda: end.send(src, bad, version=11))
        # 3. the source's first tensor disagrees with the manifest (wrong dtype)
        wrong = ((n, t.float() if i == 0 else t) for i, (n, t) in enumerate(src))
        attempt("source_disagrees", lambda: end.send(wrong, manifest, version=12))
        # 4. a receiver fails while loading (its model refuses one tensor): agreed, rolled back or torn
        attempt("receiver_load_fails", lambda: end.send(src, manifest, version=13))
        # 5. the transport is still usable
        attempt("clean", lambda: end.send(src, manifest, version=14))
        end.close()
        return {"outcomes": outcomes, "messages": messages}
    before = engine.fingerprint()
    _flip_byte_in_bucket(end, 8)  # buckets 0-3 hold the split embedding; 8 is past block 0
    attempt("checksum", end.receive_update)
    after_checksum = (engine.fingerprint(), torn_reason(engine.model), end.weight_version)
    end._plane.wait = type(end._plane).wait.__get__(end._plane)  # stop corrupting
    attempt("engine_rejects_manifest", end.receive_update)
    after_manifest = (engine.fingerprint(), torn_reason(engine.model))
    attempt("source_disagrees", end.receive_update)
    after_source = (engine.fingerprint(), torn_reason(engine.model))
    # Make the last layer refuse its tensor on rank 1 only: the other ranks must still agree.
    if rank == 1:
        real_begin = engine.begin_update

        def begin_update(manifest, **opts):
            session = real_begin(manifest, **opts)
            real_load = session.load

            def load(items):
                items = list(items)
                if any(n == "model.norm.weight" for n, _ in items):
                    raise RuntimeError("injected load failure on model.norm.weight")
                return real_load(items)

            session.load = load
            return session

        engine.begin_update = begin_update
    attempt("receiver_load_fails", end.receive_update)
    if rank == 1:
        del engine.begin_update
    after_load = (engine.fingerprint(), torn_reason(engine.model))
    attempt("clean", end.receive_update)
    fresh_b = ReferenceEngine.from_checkpoint(ckpt_b).fingerprint()
    result = {
        "outcomes": outcomes, "before": before, "after_checksum": after_checksum,
        "after_manifest": after_manifest, "after_source": after_source, "after_load": after_load,
        "final": engine.fingerprint(), "final_version": end.weight_version, "fresh_b": fresh_b,
        "torn_final": torn_reason(engine.model), "messages": messages,
    }
    end.close()
    return result


def repeated_updates(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, num_updates: int) -> dict:
    """``num_updates`` consecutive updates alternating two checkpoints; every rank samples its resident
    set (``settled_resident_kb``) after each."""
    end, _engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False)
    sources = [CheckpointSource(ckpt_b), CheckpointSource(ckpt_a)]
    manifests = [s.manifest() for s in sources]
    if rank == 0:
        rss = []
        for v in range(num_updates):
            end.send(sources[v % 2], manifests[v % 2], version=v)
            rss.append(settled_resident_kb())
        end.close()
        return {"rss": rss}
    rss, fps = [], []
    for _ in range(num_updates):
        fps.append(end.receive_update().fingerprint)
        rss.append(settled_resident_kb())
    end.close()
    return {"rss": rss, "fingerprints": fps}


def source_fails_mid_call(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, rollback: bool,
                          verify: str) -> dict:
    """The trainer's source raises after 20 tensors of a call: the sender marks the remaining buckets ABORT
    (never packed), every rank raises the same error, nothing is committed; then a clean update."""
    end, engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False, rollback=rollback,
                                  config={"verify": verify})
    src = CheckpointSource(ckpt_b)
    manifest = src.manifest()
    if rank == 0:
        def failing():
            for i, item in enumerate(src):
                if i == 20:
                    raise RuntimeError("injected trainer failure after 20 tensors")
                yield item

        outcome = []
        for label, tensors in (("failing", failing()), ("clean", iter(src))):
            try:
                end.send(tensors, manifest, version=label)
                outcome.append((label, "ok", ""))
            except Exception as e:
                outcome.append((label, type(e).__name__, str(e)))
        end.close()
        return {"outcomes": outcome}
    before = engine.fingerprint()
    outcome = []
    try:
        end.receive_update()
        outcome.append(("failing", "ok", ""))
    except Exception as e:
        outcome.append(("failing", type(e).__name__, str(e)))
    after = {"rolled_back": engine.fingerprint() == before, "torn": torn_reason(engine.model),
             "version": end.weight_version}
    end.receive_update()
    outcome.append(("clean", "ok", ""))
    result = {"outcomes": outcome, "after_failure": after, "final": engine.fingerprint(),
              "fresh_b": ReferenceEngine.from_checkpoint(ckpt_b).fingerprint(), "version": end.weight_version}
    end.close()
    return result


def host_waits_per_update(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, verify: str,
                          calls: int) -> dict:
    """One update split into ``calls`` update_weights calls; the sender's report carries every rank's
    host waits (by kind) during the update."""
    end, _engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False, config={"verify": verify})
    if rank == 0:
        src = CheckpointSource(ckpt_b)
        manifest = src.manifest()
        end.start_weight_update(manifest, 1)
        names = list(manifest.names)
        cuts = [len(names) * i // calls for i in range(calls + 1)]
        tensors = iter(src)
        for lo, hi in itertools.pairwise(cuts):
            end.update_weights([next(tensors) for _ in range(hi - lo)], names=names[lo:hi])
        report = end.finish_weight_update()
        end.close()
        return {"num_buckets": report.num_buckets, "sender": report.host_waits,
                "receivers": [r["transport"] for r in report.receivers]}
    end.receive_update()
    end.close()
    return {}


# ---------------------------------------------------------------------- sender death / hang
def engine_role(address: str, rank: int, ckpt_a: str, rollback: bool, results: Any, device: str = "cpu") -> None:
    """An engine process waiting for one update from a sender that will die or hang mid-update."""
    try:
        engine = ReferenceEngine.from_checkpoint(ckpt_a, device=device)
        before = engine.fingerprint()
        receiver = WeightReceiver(engine, address, rank, rollback=rollback)
        receiver.connect()
        results.put(("connected", rank, time.time()))
        try:
            receiver.receive_update(timeout_s=60)
            results.put(("result", rank, {"error": None}))
            return
        except Exception as e:
            raised_at = time.time()
            torn = torn_reason(engine.model)
            results.put(("result", rank, {
                "error": type(e).__name__, "message": str(e), "raised_at": raised_at,
                "rolled_back": engine.fingerprint() == before, "torn": torn is not None,
            }))
    except BaseException as e:
        results.put(("result", rank, {"error": f"setup: {type(e).__name__}: {e}"}))


def sender_role(backend: str, num_receivers: int, ckpt_b: str, timeout_s: float, mode: str,
                after_tensors: int, addresses: Any, results: Any) -> None:
    """A trainer that dies (SIGKILL) or hangs after ``after_tensors`` tensors of its first update (mode
    'kill', 'hang'), or dies once the call carrying them is done, before its next call ('kill_between_calls')."""
    import signal
    import threading

    sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=timeout_s),
                          num_receivers=num_receivers)
    for _ in range(num_receivers):
        addresses.put(sender.address)
    sender.connect()
    src = CheckpointSource(ckpt_b)
    if mode == "kill_between_calls":
        # Driven phase by phase: the first call's tensors reach (and are written on) every engine, then
        # the sender dies before the next call's header.
        manifest = src.manifest()
        sender.start_weight_update(manifest, version=1)
        sender.update_weights(itertools.islice(src, after_tensors), names=manifest.names[:after_tensors])
        results.put(("stopped", 0, time.time()))
        results.close()
        results.join_thread()
        os.kill(os.getpid(), signal.SIGKILL)

    def tensors():
        for i, item in enumerate(src):
            if i == after_tensors:
                results.put(("stopped", 0, time.time()))
                if mode == "kill":
                    results.close()
                    results.join_thread()  # the queue's feeder thread must deliver before the kill
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait()  # hang forever: the parent kills this process
            yield item

    sender.send(tensors(), src.manifest(), version=1)


# ---------------------------------------------------------------------- engine death / hang
def _stop_after_loads(engine: ReferenceEngine, num_tensors: int, signum: int, results: Any) -> None:
    """Make this engine's process kill or stop itself once ``num_tensors`` tensors of the update are
    loaded (mid-update, with tensors written), after telling the test when."""
    real_begin = engine.begin_update

    def begin_update(manifest: Any, **opts: Any) -> Any:
        session = real_begin(manifest, **opts)
        real_load = session.load
        loaded = 0

        def load(items: Any) -> Any:
            nonlocal loaded
            items = list(items)
            out = real_load(items)
            loaded += len(items)
            if loaded >= num_tensors:
                results.put(("stopped", 0, time.time()))
                results.close()
                results.join_thread()  # delivered before the signal: a stopped feeder thread sends nothing
                os.kill(os.getpid(), signum)
            return out

        session.load = load
        return session

    engine.begin_update = begin_update  # type: ignore[method-assign]


def surviving_engine_role(address: str, rank: int, ckpt_a: str, ckpt_b: str, rollback: bool, device: str,
                          addresses: Any, results: Any) -> None:
    """An engine that outlives another engine dying mid-update, then takes an update from a new sender."""
    try:
        engine = ReferenceEngine.from_checkpoint(ckpt_a, device=device)
        before = engine.fingerprint()
        receiver = WeightReceiver(engine, address, rank, rollback=rollback)
        receiver.connect()
        outcome: dict[str, Any] = {}
        try:
            receiver.receive_update(timeout_s=60)
            outcome["error"] = None
        except Exception as e:
            outcome.update(error=type(e).__name__, message=str(e))
        outcome.update(rolled_back=engine.fingerprint() == before, torn=torn_reason(engine.model),
                       version=receiver.weight_version)
        receiver.close()
        # A new sender (the trainer's next connection) reaches this engine with a new address.
        receiver = WeightReceiver(engine, addresses.get(timeout=120), 1, rollback=rollback)
        receiver.connect()
        receiver.receive_update(timeout_s=60)
        outcome.update(final=engine.fingerprint(), torn_final=torn_reason(engine.model),
                       final_version=receiver.weight_version,
                       fresh_b=ReferenceEngine.from_checkpoint(ckpt_b, device=device).fingerprint())
        receiver.close()
        results.put(("survivor", rank, outcome))
    except BaseException as e:
        results.put(("survivor", rank, {"setup_error": f"{type(e).__name__}: {e}"}))


def dying_engine_role(address: str, rank: int, ckpt_a: str, signum: int, device: str, results: Any) -> None:
    """An engine whose process is killed (SIGKILL) or stopped (SIGSTOP) after loading 7 tensors."""
    try:
        engine = ReferenceEngine.from_checkpoint(ckpt_a, device=device)
        _stop_after_loads(engine, 7, signum, results)
        receiver = WeightReceiver(engine, address, rank)
        receiver.connect()
        receiver.receive_update(timeout_s=60)
        results.put(("victim", rank, {"error": "the update completed although this engine was to stop"}))
    except BaseException as e:
        results.put(("victim", rank, {"error": f"{type(e).__name__}: {e}"}))


def trainer_of_dying_engines(backend: str, num_receivers: int, ckpt_b: str, timeout_s: float, addresses: Any,
                             survivor_addresses: Any, results: Any) -> None:
    """A trainer whose update fails because an engine dies or stops mid-update; it then connects a new
    sender to the ``num_receivers - 1`` engines that survive and updates them."""
    config = TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=timeout_s)
    src = CheckpointSource(ckpt_b)
    try:
        sender = WeightSender(config, num_receivers=num_receivers)
        for _ in range(num_receivers):
            addresses.put(sender.address)
        sender.connect()
        outcome: dict[str, Any] = {}
        try:
            sender.send(src, src.manifest(), version=1)
            outcome["error"] = None
        except Exception as e:
            outcome.update(error=type(e).__name__, message=str(e), raised_at=time.time())
        sender.close()
        sender = WeightSender(config, num_receivers=num_receivers - 1)
        for _ in range(num_receivers - 1):
            survivor_addresses.put(sender.address)
        sender.connect()
        report = sender.send(src, src.manifest(), version=2)
        outcome["recovered"] = report.version
        sender.close()
        results.put(("trainer", 0, outcome))
    except BaseException as e:
        results.put(("trainer", 0, {"setup_error": f"{type(e).__name__}: {e}"}))


# ---------------------------------------------------------------------- GPU scenarios (device machine)
def gpu_sync(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, quantization: Any, num_updates: int,
             bucket_bytes: int = 1 << 20, verify: str = "deferred", alternate: bool = False,
             zero_copy: bool = False, temporaries: bool = False) -> dict:
    """nccl: sender on cuda:0, engine ranks on cuda:rank. ipc: everyone on cuda:0. Reports memory too.

    alternate: send checkpoint b and a in turn (each update differs from the last, so a bucket loaded
    from a buffer before its receive or packing completed shows up as a wrong fingerprint).
    zero_copy: TransportConfig(zero_copy=True); temporaries: the source yields a fresh copy of every
    tensor (made on the fly on the trainer's stream) instead of the trainer's tensors."""
    device = "cuda:0" if backend == "ipc" else f"cuda:{rank}"
    torch.cuda.set_device(device)
    if rank == 0:
        from weight_sync.transport import bucket_checksum

        bucket_checksum(torch.zeros(4, dtype=torch.uint8, device=device))  # its per-device constants
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=bucket_bytes, timeout_s=60, verify=verify,
                                              zero_copy=zero_copy, checksum=not zero_copy), num_receivers=world - 1)
        _share_address(0, sender.address)
        sender.connect()
        sources = [CheckpointSource(ckpt_b), CheckpointSource(ckpt_a)]
        weights = [[(n, t.to(device)) for n, t in s] for s in sources]  # trainer weights live on the GPU
        manifest = sources[0].manifest()
        torch.cuda.synchronize()
        allocated = []
        reports = []
        for v in range(num_updates):
            w = weights[v % 2] if alternate else weights[0]
            source = ((n, t * 1) for n, t in w) if temporaries else w
            reports.append(sender.send(source, manifest, version=v))
            allocated.append(torch.cuda.memory_allocated())
        stats = sender.zero_copy_stats
        del weights, w, source  # the trainer's own tensors: not transport memory
        sender.close()
        dist.barrier()  # the receivers have closed (released their imports)
        torch.cuda.ipc_collect()
        torch.cuda.synchronize()
        return {"fingerprints": [r.fingerprints for r in reports], "allocated": allocated,
                "leftover": torch.cuda.memory_allocated() - baseline, "num_buckets": reports[-1].num_buckets,
                "receiver_waits": [r.receivers[0].get("transport", {}) for r in reports], "zero_copy": stats}
    address = _share_address(rank, None)
    engine = ReferenceEngine.from_checkpoint(ckpt_a, device=device, quantization=quantization)
    receiver = WeightReceiver(engine, address, rank)
    receiver.connect()
    fps, allocated = [], []
    for _ in range(num_updates):
        fps.append(receiver.receive_update().fingerprint)
        allocated.append(torch.cuda.memory_allocated())
    fresh = ReferenceEngine.from_checkpoint(ckpt_b, device=device, quantization=quantization).fingerprint()
    fresh_a = ReferenceEngine.from_checkpoint(ckpt_a, device=device, quantization=quantization).fingerprint()
    tokens = engine.generate([[5, 6, 7]], 4)
    receiver.close()
    dist.barrier()
    expected = [fresh_a if alternate and v % 2 else fresh for v in range(num_updates)]
    return {"fingerprints": fps, "fresh": fresh, "expected": expected, "allocated": allocated, "tokens": tokens}


def gpu_flipped_byte(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, verify: str) -> dict:
    """On the GPU: rank 1 flips a byte of bucket 5 after it arrived (on its compute stream, so in stream
    order before the checks). Every rank raises the checksum error, the engine is rolled back bitwise;
    then a clean update equals a fresh load."""
    device = "cuda:0" if backend == "ipc" else f"cuda:{rank}"
    torch.cuda.set_device(device)
    if rank == 0:
        sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=60, verify=verify),
                              num_receivers=world - 1)
        _share_address(0, sender.address)
        sender.connect()
        src = CheckpointSource(ckpt_b)
        weights = [(n, t.to(device)) for n, t in src]
        outcomes = []
        for v in ("flipped", "clean"):
            try:
                sender.send(weights, src.manifest(), version=v)
                outcomes.append("ok")
            except Exception as e:
                outcomes.append(type(e).__name__)
        sender.close()
        dist.barrier()
        return {"outcomes": outcomes}
    address = _share_address(rank, None)
    engine = ReferenceEngine.from_checkpoint(ckpt_a, device=device)
    receiver = WeightReceiver(engine, address, rank, rollback=True)
    receiver.connect()
    before = engine.fingerprint()
    _flip_byte_in_bucket(receiver, 5)
    outcomes = []
    try:
        receiver.receive_update()
        outcomes.append("ok")
    except Exception as e:
        outcomes.append(type(e).__name__)
    after = engine.fingerprint()
    torn = torn_reason(engine.model)
    receiver._plane.wait = type(receiver._plane).wait.__get__(receiver._plane)  # stop corrupting
    receiver.receive_update()
    outcomes.append("ok")
    fresh = ReferenceEngine.from_checkpoint(ckpt_b, device=device).fingerprint()
    final = engine.fingerprint()
    receiver.close()
    dist.barrier()
    return {"outcomes": outcomes, "rolled_back": after == before, "torn": torn, "final_is_fresh": final == fresh}


# ---------------------------------------------------------------------- send(): the finish folded into the call
def folded_finish(rank: int, world: int, backend: str, ckpt_a: str, ckpt_b: str, explicit_rank: int | None,
                  failing_rank: int | None, config: dict | None = None) -> dict:
    """Three ``send`` updates (b, a, a). Receivers run ``receive_update``, except ``explicit_rank``, which
    drives ``start`` / ``update_weights`` / ``finish`` itself; in the second update a post-update hook
    raises on ``failing_rank`` (its commit cannot be prepared)."""
    end, engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False, rollback=True, config=config)
    sources = [CheckpointSource(ckpt_b), CheckpointSource(ckpt_a), CheckpointSource(ckpt_a)]
    outcomes: list[tuple[str, str]] = []
    if rank == 0:
        controls = []
        for v, src in enumerate(sources, start=1):
            try:
                report = end.send(src, src.manifest(), version=v)
                controls.append(report.host_waits.get("control"))
                outcomes.append(("ok", ",".join(str(r["version"]) for r in report.receivers)))
            except Exception as e:
                outcomes.append((type(e).__name__, str(e)))
        end.close()
        return {"outcomes": outcomes, "controls": controls}
    failing = [False]
    if rank == failing_rank:
        def hook(_model: Any) -> None:
            if failing[0]:
                raise RuntimeError(f"rank {rank}: the post-update hook refuses this update")

        from weight_sync.reload import register_post_update_hook

        register_post_update_hook(engine.model, hook)
    after = []
    for v in range(1, len(sources) + 1):
        failing[0] = v == 2
        try:
            if rank == explicit_rank:
                end.start_weight_update()
                end.update_weights()
                end.finish_weight_update()
            else:
                end.receive_update()
            outcomes.append(("ok", ""))
        except Exception as e:
            outcomes.append((type(e).__name__, str(e)))
        after.append((engine.fingerprint(), end.weight_version, torn_reason(engine.model)))
    fresh = {"a": ReferenceEngine.from_checkpoint(ckpt_a).fingerprint(),
             "b": ReferenceEngine.from_checkpoint(ckpt_b).fingerprint()}
    end.close()
    return {"outcomes": outcomes, "after": after, "fresh": fresh}
