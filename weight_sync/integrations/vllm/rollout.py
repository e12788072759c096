"""VLLMRolloutWorker: a vLLM engine behind the rollout worker's method names (e.g. as a Ray actor).

``trainers.RayRolloutClient`` drives rollout actors phase by phase (``get_address``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
``reload_weights``, ``fingerprint``, ``generate``, ``collective_rpc``); this class answers those calls with
a ``vllm.LLM`` built with :func:`~weight_sync.integrations.vllm.engine_kwargs`, so the same client drives
reference engines and vLLM engines::

    actors = [ray.remote(VLLMRolloutWorker).remote(model_dir, llm_kwargs={...}) for _ in range(n)]
    client = RayRolloutClient(actors, TransportConfig(backend="gloo"))

With ``tensor_parallel_size=n`` the engine has ``n`` worker processes, and every one of them is an end of
the transport: on the broadcast plane (``init_weight_transfer_engine`` ... ``finish_weight_update``) the
workers are receivers ``rank .. rank + n - 1`` of the sender's group (``get_address()["workers"]`` tells the
client how many ranks to give the actor); on the sharded plane (:mod:`~weight_sync.integrations.vllm.sharded`:
``connect_sharded``, then ``receive_update`` per update) they are engine ranks ``engine_rank_offset ..
engine_rank_offset + n - 1`` and each receives only its TP shard. One call of this class reaches every
worker; answers that belong to one worker (update reports, the sharded plane's summaries) come one per
worker in TP-rank order - as a list, except that an engine of one worker answers ``reload_weights`` and
``finish_weight_update`` with its report alone, as before - while ``status`` and ``fingerprint`` answer
for the engine as a whole.

Limitation: pipeline parallelism is refused (``pipeline_parallel_size`` must be 1): a stage does not
hold the keys of the other stages, which the reload plan of a worker would need.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from weight_sync.errors import ConfigError
from weight_sync.transport.group import node_address

__all__ = ["RPC_METHODS", "VLLMRolloutWorker"]

RPC_METHODS = (
    "close_sharded",
    "connect_sharded",
    "finish_weight_update",
    "fingerprint",
    "fingerprints",
    "generate",
    "get_address",
    "get_weight_version",
    "init_weight_transfer_engine",
    "receive_update",
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
        pp = int(llm_kwargs.get("pipeline_parallel_size", 1))
        if pp != 1:
            raise ConfigError(f"VLLMRolloutWorker: pipeline_parallel_size must be 1 (a pipeline stage cannot plan "
                              f"the keys of the other stages), got {pp}")
        self.num_workers = int(llm_kwargs.get("tensor_parallel_size", 1))
        self.llm = LLM(model=str(model), **llm_kwargs, **engine_kwargs(**options))
        self.rank: int | None = None

    def _rpc_all(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` on every worker of the engine; answers in TP-rank order."""
        return list(self.llm.collective_rpc(method, kwargs=kwargs))

    def _per_worker(self, answers: list[Any]) -> Any:
        # One worker's engine answers with its report alone, as before TP > 1 was accepted.
        return answers[0] if self.num_workers == 1 else answers

    def get_address(self) -> dict[str, Any]:
        """Where the engine runs (the client hosts the transport's store where every actor reaches it) and
        how many ends of the transport it has (``workers``: one per TP rank)."""
        return {"host": node_address(), "pid": os.getpid(), "device": str(self.llm.llm_engine.vllm_config.device_config.device),
                "tp_rank": 0, "tp_size": self.num_workers, "workers": self.num_workers}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Connect to the sender: ``init_info`` has ``address`` and this actor's first ``rank`` (>= 1); its
        workers take ranks ``rank .. rank + workers - 1`` of the sender's group."""
        self.rank = int(init_info.get("rank", 1))
        info: dict[str, Any] = {"address": init_info["address"], "rank_offset": self.rank}
        for key in ("connect_timeout_s", "backend"):
            if key in init_info:
                info[key] = init_info[key]
        self.llm.init_weight_transfer_engine({"init_info": info})
        return {"backend": init_info.get("backend", "group"), "rank": self.rank,
                "ranks": list(range(self.rank, self.rank + self.num_workers))}

    def start_weight_update(self, timeout_s: float | None = None, **_: Any) -> dict[str, Any]:
        """Receive and validate the sender's manifest (the engine's own timeout bounds the wait)."""
        self.llm.start_weight_update()
        return self.status()

    def update_weights(self, update_info: dict[str, Any] | None = None) -> dict[str, Any]:
        self.llm.update_weights({"update_info": update_info or {}})
        return self.status()

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """Commit on every worker or none; the committed report (one per worker with TP > 1)."""
        self.llm.finish_weight_update(weight_version=weight_version)
        return self._per_worker(self._rpc_all("ws_last_report"))

    # ------------------------------------------------------------------ the sharded plane
    def connect_sharded(self, address: str, engine_rank_offset: int = 0, connect_timeout_s: float = 300.0,
                        rollback: bool | None = None) -> list[dict[str, Any]]:
        """Join the trainer ranks' sharded transport at ``address``: the workers become engine ranks
        ``engine_rank_offset ..`` (one per TP rank); returns each one's ``engine_rank`` and wire backend.
        ``rollback``: whether a failed update restores the previous weights (default: the engine's option).

        Blocks until every rank of the transport has joined: call it while the trainer ranks connect.
        """
        return self._rpc_all("ws_sharded_connect", {"address": address, "engine_rank_offset": engine_rank_offset,
                                                    "connect_timeout_s": connect_timeout_s, "rollback": rollback})

    def receive_update(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """One sharded update as the trainer ranks send it (call it while they send): every worker
        receives its shard, and the update commits on every engine rank of the transport or on none.

        Returns one summary per worker: ``engine_rank``, ``version``, ``mode``, ``region_bytes`` (by trainer
        rank), ``wire_bytes``, ``seconds``, ``report``.
        """
        return self._rpc_all("ws_sharded_update", {"timeout_s": timeout_s})

    def close_sharded(self) -> None:
        """Leave the sharded transport (every worker; local)."""
        self._rpc_all("ws_sharded_close")

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None,
                       **options: Any) -> dict[str, Any]:
        kwargs = dict(options)
        if weights_path is not None:
            kwargs["weights_path"] = str(weights_path)
        if weights_iterator is not None:
            kwargs["weights_iterator"] = weights_iterator
        return self._per_worker(self._rpc_all("reload_weights", kwargs))

    def fingerprints(self) -> list[str]:
        """Each worker's kernel-tensor fingerprint, in TP-rank order."""
        return self._rpc_all("ws_fingerprint")

    def fingerprint(self) -> str:
        """The engine's fingerprint: its worker's, or with TP > 1 a digest of every worker's in rank order."""
        each = self.fingerprints()
        return each[0] if len(each) == 1 else hashlib.sha256("".join(each).encode()).hexdigest()

    def status(self) -> dict[str, Any]:
        """The engine's status: torn when any worker is (its reason), updating when any is, and the
        version the workers agree on (None when they do not)."""
        each = self._rpc_all("ws_status")
        if len(each) == 1:
            return each[0]
        versions = {s["version"] for s in each}
        return {"torn": next((s["torn"] for s in each if s["torn"]), None),
                "version": versions.pop() if len(versions) == 1 else None,
                "updating": any(s["updating"] for s in each)}

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
