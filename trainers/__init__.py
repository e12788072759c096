"""Trainer side of weight_sync: weight sources, LoRA merge, name mapping and Ray rollout workers.

``ModuleSource`` (any nn.Module / HF model), ``FSDPSource`` (FSDP2 / DTensor, gathered one block at a
time in lockstep, sent from one rank), ``ExpertParallelSource`` (an expert-parallel rank's own experts,
each rank with its own sender, joined into one engine update by ``weight_sync.transport.joined``; it
also splits transformers-5 stacked experts into HF per-expert names) and ``CheckpointSource`` (a safetensors checkpoint) give a
manifest from metadata and ``(name, tensor)`` in block order for a :class:`weight_sync.transport.WeightSender`.
``RolloutWorker`` wraps an engine behind vLLM's method names; ``RayRolloutClient`` fans one RPC per
phase out to Ray actors while the weights travel over the transport; ``EngineProcesses`` does the same
for local worker processes without Ray (JSON over pipes).

``FSDPSource.shards()`` gives each rank's own pieces for the sharded plane (every trainer rank sends what
it holds, every engine rank receives only its shard: ``weight_sync.transport.ShardedSender``, docs/scale_out.md),
and ``trainers.ray_scale.RayScaleOut`` deploys that on Ray placement groups.

Limitations: LoRA merge covers peft-style Linear and Embedding layers (not conv or DoRA), and LoRA factors
are not sharded (``shards()`` refuses them); Ray is imported only by ``trainers.ray_client`` and
``trainers.ray_scale``.
This package imports weight_sync; weight_sync never imports it.
"""

from trainers.expert_parallel import ExpertParallelSource, expert_name_map
from trainers.fsdp import FSDPSource
from trainers.lora import LoraFactor, LoraLayerSpec, find_lora_layers, merge_lora
from trainers.names import NameMap, UnmappedNameError, strip_wrappers
from trainers.remote import EngineProcesses, RemoteWorkerError
from trainers.rollout import RolloutWorker
from trainers.sources import CheckpointSource, ModuleSource, SourceEntry

__all__ = [
    "CheckpointSource",
    "EngineProcesses",
    "ExpertParallelSource",
    "FSDPSource",
    "LoraFactor",
    "LoraLayerSpec",
    "ModuleSource",
    "NameMap",
    "RemoteWorkerError",
    "RolloutWorker",
    "SourceEntry",
    "UnmappedNameError",
    "expert_name_map",
    "find_lora_layers",
    "merge_lora",
    "strip_wrappers",
]
