"""Ray rollout workers on a local cluster: one RPC per phase, weights over the transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.transport import TransportConfig

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


@pytest.mark.parametrize(("backend", "num_engines", "tp_size"), [("gloo", 2, 1), ("shm", 1, 2)])
def test_ray_workers_receive_updates_and_answer_collective_rpc(
    ray_cluster, backend: str, num_engines: int, tp_size: int, qwen3_a: Path, qwen3_b: Path
) -> None:
    from trainers.ray_client import RayRolloutClient

    client = RayRolloutClient.launch(
        str(qwen3_a), num_engines=num_engines, tp_size=tp_size, num_cpus=0.5,
        transport=TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=60),
    )
    try:
        client.init_weight_transfer(rollback=True)
        report = client.sync(CheckpointSource(qwen3_b), version=1)
        assert report.version == 1 and len(report.receivers) == num_engines * tp_size
        fresh = ReferenceEngine.from_checkpoint(qwen3_b).fingerprint() if tp_size == 1 else None
        fps = client.collective_rpc("fingerprint")
        assert report.fingerprints == fps
        if fresh is not None:
            assert fps == [fresh] * num_engines
        assert client.collective_rpc("get_weight_version") == [1] * len(fps)
        # Two calls in one update (vLLM's chunked update_weights), then back to checkpoint a.
        src = CheckpointSource(qwen3_a)
        manifest = src.manifest(2)
        names = list(manifest.names)
        tensors = list(src)
        client.start_weight_update(manifest, 2)
        client.update_weights(tensors[:10], names=names[:10])
        client.update_weights(tensors[10:], names=names[10:])
        client.finish_weight_update()
        assert client.collective_rpc("get_weight_version") == [2] * len(fps)
        # vLLM-style reload from a path through collective_rpc.
        client.collective_rpc("reload_weights", kwargs={"weights_path": str(qwen3_b), "version": 3})
        assert client.collective_rpc("fingerprint") == fps
        outs = client.collective_rpc("generate", args=([[5, 6, 7]], 3))
        assert len({tuple(map(tuple, o)) for o in outs[:tp_size]}) == 1
    finally:
        client.shutdown()
