"""VLLMRolloutWorker: a vLLM engine behind the rollout worker's method names (e.g. as a Ray actor).

``trainers.RayRolloutClient`` drives rollout actors phase by phase (``get_address``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
``reload_weights``, ``fingerprint``, ``generate``, ``collective_rpc``); this class answers those calls with
a ``vllm.LLM`` built with :func:`~weight_sync.integrations.vllm.engine_kwargs`, so the same client drives
reference engines and vLLM engines::

    actors = [ray.remote(VLLMRolloutWorker).remote(model_dir, llm_kwargs={...}) for _ in range(n)]
    client = RayRolloutClient(actors, TransportConfig(backend="gloo"))

Limitation: one receiver per actor, so each actor's engine must have a single worker (TP = PP = 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from weight_sync.errors import ConfigError
from weight_sync.transport.group import node_address

__all__ = ["RPC_METHODS", "VLLMRolloutWorker"]

RPC_METHODS = (
    "finish_weight_update",
    "fingerprint",
    "generate",
    "get_address",
    "get_weight_version",
    "init_weight_transfer_engine",
    "reload_weights",
    "shutdown",
    "start_weight_update",
    "status",
    "update_weights",
)


class VLLMRolloutWorker:
    """A ``vllm.LLM`` on ``model`` with weight_sync; ``options`` are WeightSyncOptions fields."""

    def __init__(self, model: str | os.PathLike, *, llm_kwargs: dict[str, Any] | None = None,
                 **options: Any) -> None:
        from vllm import LLM

        from weight_sync.integrations.vllm.engine_args import engine_kwargs

        llm_kwargs = dict(llm_kwargs or {})
        tp = int(llm_kwargs.get("tensor_parallel_size", 1)) * int(llm_kwargs.get("pipeline_parallel_size", 1))
        if tp != 1:
            raise ConfigError(f"VLLMRolloutWorker hosts one receiver per actor; got {tp} workers per engine")
        self.llm = LLM(model=str(model), **llm_kwargs, **engine_kwargs(**options))
        self.rank: int | None = None

    def _rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return self.llm.collective_rpc(method, kwargs=kwargs)[0]

    def get_address(self) -> dict[str, Any]:
        """Where the engine runs (the client hosts the transport's store where every actor reaches it)."""
        return {"host": node_address(), "pid": os.getpid(), "device": str(self.llm.llm_engine.vllm_config.device_config.device),
                "tp_rank": 0, "tp_size": 1}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Connect to the sender: ``init_info`` has ``address`` and this actor's ``rank`` (>= 1)."""
        self.rank = int(init_info.get("rank", 1))
        info: dict[str, Any] = {"address": init_info["address"], "rank_offset": self.rank}
        for key in ("connect_timeout_s", "backend"):
            if key in init_info:
                info[key] = init_info[key]
        self.llm.init_weight_transfer_engine({"init_info": info})
        return {"backend": init_info.get("backend", "group"), "rank": self.rank}

    def start_weight_update(self, timeout_s: float | None = None, **_: Any) -> dict[str, Any]:
        """Receive and validate the sender's manifest (the engine's own timeout bounds the wait)."""
        self.llm.start_weight_update()
        return self._rpc("ws_status")

    def update_weights(self, update_info: dict[str, Any] | None = None) -> dict[str, Any]:
        self.llm.update_weights({"update_info": update_info or {}})
        return self._rpc("ws_status")

    def finish_weight_update(self, weight_version: str | None = None) -> dict[str, Any] | None:
        self.llm.finish_weight_update(weight_version=weight_version)
        return self._rpc("ws_last_report")

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None,
                       **options: Any) -> dict[str, Any]:
        kwargs = dict(options)
        if weights_path is not None:
            kwargs["weights_path"] = str(weights_path)
        if weights_iterator is not None:
            kwargs["weights_iterator"] = weights_iterator
        return self._rpc("reload_weights", kwargs)

    def fingerprint(self) -> str:
        return self._rpc("ws_fingerprint")

    def status(self) -> dict[str, Any]:
        return self._rpc("ws_status")

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of token-id prompts."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        """Call one of RPC_METHODS by name (or a callable taking this worker first)."""
        kwargs = kwargs or {}
        if callable(method):
            return method(self, *args, **kwargs)
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: unknown method {method!r}; supported: {list(RPC_METHODS)}")
        return getattr(self, method)(*args, **kwargs)
