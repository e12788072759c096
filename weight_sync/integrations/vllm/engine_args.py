"""What makes a vLLM engine use weight_sync: ``LLM(model, **engine_kwargs())`` or the server flags.

Three settings, all through vLLM's supported hooks:
- ``worker_cls``: weight_sync's subclass of the platform's worker (``reload_weights`` and the ``ws_*``
  RPCs; records model format when vLLM builds the model);
- ``additional_config["weight_sync"]``: the :class:`WeightSyncOptions`, as JSON, for every process;
- ``weight_transfer_config={"backend": "weight_sync"}``: vLLM's RL API (``init_weight_transfer_engine``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``) drives weight_sync transports;
  present only when ``weight_sync.transport`` is installed.
The engine-level hooks (prefix-cache reset, refusing torn weights, spooling iterators) come from the
``vllm.general_plugins`` entry point ``weight_sync``; this module also installs them in the calling
process, which covers in-process engines even where entry points are disabled (``VLLM_PLUGINS``).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

from weight_sync.integrations.vllm.options import CONFIG_KEY, WeightSyncOptions

__all__ = ["TRANSFER_BACKEND", "engine_cli_args", "engine_kwargs", "worker_cls_name"]

TRANSFER_BACKEND = "weight_sync"


def worker_cls_name() -> str:
    """Qualified name of weight_sync's worker class for the current vLLM platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "weight_sync.integrations.vllm.worker_cpu.WeightSyncCPUWorker"
    if current_platform.is_cuda_alike():
        return "weight_sync.integrations.vllm.worker_gpu.WeightSyncGPUWorker"
    raise NotImplementedError(
        f"weight_sync has no worker for vLLM platform {current_platform.device_name!r}; "
        "supported: cpu, cuda, rocm"
    )


def _transport_available() -> bool:
    return importlib.util.find_spec("weight_sync.integrations.vllm.transfer") is not None


def engine_kwargs(**options: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` that route weight updates to weight_sync.

    ``options`` are :class:`WeightSyncOptions` fields. Merge your own ``additional_config`` with the one
    returned here rather than replacing it.
    """
    opts = WeightSyncOptions(**options)
    from weight_sync.integrations.vllm.plugin import register

    register()
    kwargs: dict[str, Any] = {
        "worker_cls": worker_cls_name(),
        "additional_config": {CONFIG_KEY: opts.to_dict()},
    }
    if _transport_available():
        kwargs["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}
    return kwargs


def engine_cli_args(**options: Any) -> list[str]:
    """The same settings as command-line flags for ``python -m vllm.entrypoints.openai.api_server``."""
    kw = engine_kwargs(**options)
    args = ["--worker-cls", kw["worker_cls"], "--additional-config", json.dumps(kw["additional_config"])]
    if "weight_transfer_config" in kw:
        args += ["--weight-transfer-config", json.dumps(kw["weight_transfer_config"])]
    return args
