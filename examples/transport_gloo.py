"""Trainer process -> engine process over the gloo transport (CPU), three updates, verified.

    python examples/transport_gloo.py [--backend shm] [--workers 2]

The trainer (this process) owns a WeightSender; each engine process owns a ReferenceEngine and a
WeightReceiver. After every update the engines' fingerprints (returned in the sender's report) are
compared with a fresh load of the same weights.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
from pathlib import Path

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.testing import make_checkpoint
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender


def engine_process(address: str, rank: int, checkpoint: str, updates: int) -> None:
    engine = ReferenceEngine.from_checkpoint(checkpoint)
    receiver = WeightReceiver(engine, address, rank, rollback=True)
    receiver.connect()
    for _ in range(updates):
        report = receiver.receive_update(timeout_s=120)
        print(f"[engine {rank}] {report.summary()}")
    receiver.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "shm"], default="gloo")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ws-transport-"))
    ckpts = [make_checkpoint(root / f"ckpt{i}", seed=i) for i in range(2)]
    sender = WeightSender(TransportConfig(backend=args.backend, bucket_bytes=256 << 10, timeout_s=60),
                          num_receivers=args.workers)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=engine_process, args=(sender.address, r + 1, str(ckpts[0]), 3))
             for r in range(args.workers)]
    for proc in procs:
        proc.start()
    sender.connect()
    ok = True
    for version, ckpt in enumerate([ckpts[1], ckpts[0], ckpts[1]], start=1):
        source = CheckpointSource(ckpt)
        report = sender.send(source, source.manifest(), version=version)
        expected = ReferenceEngine.from_checkpoint(ckpt).fingerprint()
        match = all(fp == expected for fp in report.fingerprints)
        ok &= match
        print(f"[trainer] update {version}: {report.num_bytes / 1e6:.2f} MB in {report.num_buckets} buckets, "
              f"{report.seconds * 1e3:.0f} ms, engines match a fresh load: {match}")
    for proc in procs:
        proc.join(timeout=60)
    sender.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
