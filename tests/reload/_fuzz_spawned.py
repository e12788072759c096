"""The lifecycle fuzzer across processes: TP=2 replays over gloo, and a sender killed at a random tensor.

TP=2: both ranks draw the same random sequence of rules (one ``random.Random`` seeded alike; the drivers'
states stay identical, so the draws do too) and run it on their shard of one engine; each rank checks its
shard against a fresh TP=2 load of the expected version. A rank that finds a violation returns it with
the steps; ranks never build fresh engines on one side only (collectives would wait for the other).

Transport: a trainer process sends a full update over gloo or shm and is SIGKILLed after ``k`` tensors;
the engine process must raise, be rolled back (rollback=True) or torn-or-unchanged (otherwise), then take
the next good full update, and leave no thread, descriptor, child or shm file behind.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from typing import Any

from tests.reload._fuzz_drivers import STATS, EngineDriver, RandomDraw
from tests.reload._fuzz_world import Violation, kernel_differences, snapshot_kernel

OPEN_RULES = ("load_next", "finish", "abort_open", "caller_raises", "serve")
CLOSED_RULES = ("full_update", "partial_update", "faulty_update", "seed_alias_update", "begin", "serve")


def pick_rule(driver: EngineDriver, rng: random.Random) -> str:
    if driver.session is None:
        return rng.choice(CLOSED_RULES)
    rules = [r for r in OPEN_RULES if r != "load_next" or driver.open["pending"]]
    return rng.choice(rules)


def replay_tp(rank: int, world: int, flavor: str, seeds: list[int], num_steps: int) -> dict:
    """Run one random sequence per seed on this rank's shard; a violation ends its sequence (and is
    returned with the steps that led to it), the next sequence starts on a fresh engine."""
    import torch.distributed as dist

    group = dist.group.WORLD
    out: dict[str, Any] = {"sequences": 0, "steps": 0, "violations": []}
    for seed in seeds:
        rng = random.Random(seed)
        d = EngineDriver(flavor, tp_group=group)
        d.diagnose = False
        out["sequences"] += 1
        try:
            for _ in range(num_steps):
                getattr(d, pick_rule(d, rng))(RandomDraw(rng))
                d.check()
                out["steps"] += 1
            d.final_check()
        except Violation as e:
            out["violations"].append({"kind": type(e).__name__, "message": str(e), "seed": seed,
                                      "steps": [[r, {k: repr(v) for k, v in p.items()}] for r, p in d.log]})
    out["stats"] = dict(STATS)
    return out


# ---------------------------------------------------------------------------------------- transport
def killed_sender(backend: str, shm_dir: str, ckpt: str, after_tensors: int, timeout_s: float,
                  addresses: Any, results: Any) -> None:
    """A trainer that SIGKILLs itself after producing ``after_tensors`` tensors of its first update."""
    from trainers import CheckpointSource
    from weight_sync.transport import TransportConfig, WeightSender

    sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=timeout_s,
                                          shm_dir=shm_dir), num_receivers=1)
    addresses.put(sender.address)
    sender.connect()
    src = CheckpointSource(ckpt)

    def tensors():
        for i, item in enumerate(src):
            if i == after_tensors:
                results.put(("killed", 0, time.time()))
                results.close()
                results.join_thread()  # the queue's feeder thread must deliver before the kill
                os.kill(os.getpid(), signal.SIGKILL)
            yield item

    sender.send(tensors(), src.manifest(), version="killed")


def engine_after_kill(address: str, flavor: str, ckpt_a: str, ckpt_b: str, rollback: bool,
                      results: Any) -> None:
    """Receive from a sender that dies; then the promise, the next good update, and hygiene."""
    try:
        results.put(("result", 1, _engine_after_kill(address, flavor, ckpt_a, ckpt_b, rollback)))
    except BaseException as e:  # the parent reports it
        import traceback

        results.put(("result", 1, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))


def _engine_after_kill(address: str, flavor: str, ckpt_a: str, ckpt_b: str, rollback: bool) -> dict:
    from tests.reload._fuzz_drivers import ENGINE_FLAVORS, ENGINE_SIZE
    from weight_sync import TornModelError, TransportError
    from weight_sync.engine import ReferenceEngine
    from weight_sync.layers.tensors import signatures
    from weight_sync.reload import torn_reason
    from weight_sync.transport import WeightReceiver

    opts = {**ENGINE_FLAVORS[flavor], **ENGINE_SIZE}
    fresh_a = snapshot_kernel(ReferenceEngine.from_checkpoint(ckpt_a, **opts).model)
    fresh_b = snapshot_kernel(ReferenceEngine.from_checkpoint(ckpt_b, **opts).model)
    engine = ReferenceEngine.from_checkpoint(ckpt_a, **opts)
    pointers = signatures(engine.model)
    gc.collect()
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    problems: list[str] = []
    receiver = WeightReceiver(engine, address, 1, rollback=rollback)
    receiver.connect()
    error = None
    try:
        receiver.receive_update(timeout_s=60)
        problems.append("receive_update committed an update whose sender died")
    except TransportError as e:
        error = f"{type(e).__name__}: {e}"
    torn = torn_reason(engine.model)
    if torn is None:
        diff = kernel_differences(engine.model, fresh_a)
        if diff:
            problems.append(f"not torn after the sender died, yet {len(diff)} kernel tensor(s) differ from "
                            f"the committed version: {diff[:4]}")
    else:
        if rollback:
            problems.append(f"rollback=True, yet torn: {torn}")
        try:
            engine.generate([[5, 6]], 2)
            problems.append("a torn engine served generate")
        except TornModelError:
            pass
    if signatures(engine.model) != pointers:
        problems.append("graph-visible tensors moved")
    receiver.close()
    del receiver
    engine.reload_weights(ckpt_b)
    if torn_reason(engine.model) is not None or kernel_differences(engine.model, fresh_b):
        problems.append("the next good full update did not restore a fresh load of it")
    gc.collect()
    now_threads, now_fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    if now_threads > threads or now_fds > fds:
        problems.append(f"receiver leaked: threads {threads} -> {now_threads}, fds {fds} -> {now_fds} "
                        f"({sorted(t.name for t in threading.enumerate())})")
    return {"error": None, "raised": error, "torn": torn, "problems": problems}


def run_killed_sender(backend: str, flavor: str, rollback: bool, after_tensors: int, ckpt_a: str,
                      ckpt_b: str, timeout_s: float = 4.0) -> dict:
    """Spawn the dying trainer and one engine; return the engine's verdict plus parent-side hygiene."""
    import multiprocessing as mp
    import queue
    import shutil
    import tempfile

    ctx = mp.get_context("spawn")
    shm_dir = tempfile.mkdtemp(prefix="ws_fuzz_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    results, addresses = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=killed_sender, daemon=True,
                         args=(backend, shm_dir, ckpt_b, after_tensors, timeout_s, addresses, results))
    sender.start()
    procs = [sender]
    try:
        address = addresses.get(timeout=120)
        engine = ctx.Process(target=engine_after_kill, daemon=True,
                             args=(address, flavor, ckpt_a, ckpt_b, rollback, results))
        engine.start()
        procs.append(engine)
        verdict = None
        deadline = time.monotonic() + 180
        while verdict is None and time.monotonic() < deadline:
            try:
                kind, _, payload = results.get(timeout=5)
            except queue.Empty:
                if not engine.is_alive():
                    break
                continue
            if kind == "result":
                verdict = payload
        for p in procs:
            p.join(timeout=30)
        if verdict is None:
            verdict = {"error": f"the engine process reported nothing (exit code {engine.exitcode})"}
        left = sorted(os.listdir(shm_dir))
        verdict["shm_left"] = left
        verdict["children_left"] = [p.pid for p in procs if p.is_alive()]
        return verdict
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(shm_dir, ignore_errors=True)
