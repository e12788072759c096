"""A trainer process for transfer tests: a WeightSender that runs a script of updates (spawned).

Kept free of vllm imports: it is what a trainer host runs. The pipe to the test carries only the sender's
address and a line per step (test plumbing, not part of any wire format).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from weight_sync.layers.blocks import order_by_block
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.transport import TransportConfig, WeightSender

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def _update(path: str) -> tuple[Manifest, dict[str, torch.Tensor]]:
    tensors = dict(iter_checkpoint(path))
    names = order_by_block(list(tensors))
    return Manifest(tuple(TensorMeta.of(n, tensors[n]) for n in names)), tensors


def chunks(path: str) -> list[list[str]]:
    """The update of ``path`` cut in three calls of whole blocks, in manifest order (vLLM-style chunks)."""
    names = list(_update(str(path))[0].names)
    third = len(names) // 3
    cut = [names[:third], names[third: 2 * third], names[2 * third:]]
    return [c for c in cut if c]


def _dying(manifest: Manifest, tensors: dict[str, torch.Tensor]):
    """Yield the update's tensors until half are sent, then die the way an OOM-killed trainer does."""
    for n, name in enumerate(manifest.names):
        if n == len(manifest) // 2:
            os.kill(os.getpid(), signal.SIGKILL)
        yield name, tensors[name]


def _expect_failure(conn: Any, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> None:
    """Send the rest of the update in one call the engine is expected to fail; report the error and how
    long the call took."""
    t0 = time.monotonic()
    try:
        sender.update_weights(tensors)
    except Exception as e:
        conn.send(f"failed {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")
    else:
        conn.send("sent")


def run_trainer(conn: Any, steps: list[tuple[str, str]], timeout_s: float, zero_copy: bool = False,
                num_receivers: int = 1) -> None:
    """Steps: ("good", ckpt) a full update; ("bad_shape", ckpt) a manifest announcing a wrong shape;
    ("die", ckpt) start an update and get SIGKILLed in the middle of sending it; ("rejected", ckpt) an
    update whose one call the engine fails; ("rejected_second", ckpt) an update in two calls whose second
    one the engine fails; ("incomplete", ckpt) an update finished after half of its tensors;
    ("chunked", ckpt) an update in the three calls of ``chunks(ckpt)``. zero_copy: shm zero-copy (the engine copies from this process's tensors)
    instead of gloo buckets. num_receivers: the engine's workers (TP x PP)."""
    config = (TransportConfig(backend="shm", zero_copy=True, checksum=False, timeout_s=timeout_s) if zero_copy
              else TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=timeout_s))
    sender = WeightSender(config, num_receivers=num_receivers)
    conn.send(sender.address)
    sender.connect()
    for i, (kind, path) in enumerate(steps, start=1):
        manifest, tensors = _update(path)
        if kind == "good":
            report = sender.send(tensors, manifest, version=i)
            conn.send(f"committed {report.version}")
        elif kind == "bad_shape":
            bad = Manifest(tuple(TensorMeta(m.name, m.dtype, (7, *m.shape[1:])) if m.name == K_PROJ else m
                                 for m in manifest))
            try:
                sender.start_weight_update(bad, version=i)
            except Exception as e:
                conn.send(f"refused {type(e).__name__}: {e}")
        elif kind == "rejected":
            sender.start_weight_update(manifest, version=i)
            _expect_failure(conn, sender, tensors)
        elif kind == "rejected_second":
            sender.start_weight_update(manifest, version=i)
            half = list(manifest.names[: len(manifest) // 2])
            sender.update_weights([(n, tensors[n]) for n in half], names=half)
            conn.send("first call sent")
            _expect_failure(conn, sender, tensors)
        elif kind == "incomplete":
            sender.start_weight_update(manifest, version=i)
            half = list(manifest.names[: len(manifest) // 2])
            sender.update_weights([(n, tensors[n]) for n in half], names=half)
            try:
                sender.finish_weight_update()
                conn.send("committed")
            except Exception as e:
                conn.send(f"failed {type(e).__name__}: {e}")
        elif kind == "chunked":
            sender.start_weight_update(manifest, version=i)
            for names in chunks(path):
                sender.update_weights([(n, tensors[n]) for n in names], names=names)
            report = sender.finish_weight_update()
            conn.send(f"committed {report.version}")
        elif kind == "die":
            sender.start_weight_update(manifest, version=i)

            sender.update_weights(_dying(manifest, tensors))
    conn.send("done")
    sender.close()
