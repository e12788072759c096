"""Stage an update inside every vLLM worker while the engine generates; stop it only for the commit.

Each worker keeps a *staging twin* of its model (:class:`~weight_sync.reload.staged.StagedWeights`): a
second instance of vLLM's model class, built by vLLM's own loader with ``load_format="dummy"`` under a
copy of the engine's config whose ``static_forward_context`` is fresh (so the twin's attention layers do
not collide with the live ones by name), then seeded with the live weights. A background thread of the
worker process receives updates from the trainer's :class:`~weight_sync.transport.WeightSender` into the
twin - validated, processed (fused, quantized, sharded) exactly as a direct update would be - while the
engine core keeps stepping on the committed weights. ``ws_stage_commit`` is a short worker RPC: the engine
core runs it between two scheduler steps, so every token is computed with exactly one version; it copies
the twin's kernel tensors into the live ones in place and makes the live layers use the twin's kernel
state that lives outside tensors (vLLM-CPU's ``cpu_linear`` callables, which close over the oneDNN
handle or packed weight of the new version). The engine hooks then treat it as any other commit: the
prefix cache is reset and running requests are recomputed unless the user paused the engine, and the
engine's weight version becomes the committed one, so ``weight_versions`` spans name it.

Usage (trainer side; any engine control of :mod:`~weight_sync.integrations.vllm.clients`)::

    from weight_sync.integrations.vllm import LLMControl, engine_kwargs
    from weight_sync.integrations.vllm.staging import StagingClient

    llm = LLM(model, **engine_kwargs())            # or AsyncLLM (AsyncLLMControl), or a server
    with StagingClient(LLMControl(llm)) as client:
        client.connect()                           # every worker builds its twin and starts listening
        handle = client.push(weights, version=2)   # returns at once; the engine keeps generating
        ...                                        # rollouts of the old version continue meanwhile
        handle.wait()                              # staged on every worker (raises what failed)
        client.commit(version=2)                   # between two steps; tokens after it are version 2

Guarantees: until ``commit`` the live weights are never written - a failure while staging (a manifest
the model refuses, a checksum, a trainer that dies) fails the push on every rank and leaves the served
tokens unchanged and nothing new pending; the twin's update runs through the ordinary lifecycle, so its
processing and pointer audit are those of a direct update. ``commit(version=v)`` refuses before any
copy unless every worker holds ``v`` staged.

Limitations: the twin is a second copy of the model's kernel state in the worker's memory
(``ws_stage_status()["num_bytes"]``, bounded by ``StagingConfig.max_bytes``); on CUDA it lives on the
device (vLLM's kernels are built there; ``placement="host"`` is refused). Only the target model is
staged (not a speculative draft model). Building the twin runs in ``ws_stage_init`` on the engine
core's thread (once; requests wait for it). A direct update of the live model while staging (the RL API,
``reload_weights``) makes the next staged update a full one. With several workers (TP / PP) a commit is
one RPC to all of them: :meth:`StagingClient.commit` first checks that every worker holds the version.
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError, TransportError, UpdateStateError
from weight_sync.integrations.vllm.clients import EngineControl, _manifest_and_tensors, run_phase
from weight_sync.integrations.vllm.model_hooks import (
    KV_CACHE_ATTRS,
    kernel_fingerprint,
    prepare_loaded_model,
    record_report,
    recording_model_format,
)
from weight_sync.integrations.vllm.options import WeightSyncOptions
from weight_sync.reload.staged import StagedWeights, StagingConfig, staged_bytes
from weight_sync.reload.state import get_state
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender
from weight_sync.transport.push import PushHandle, push
from weight_sync.transport.receiver import PREFIX as RECEIVER_PREFIX

__all__ = ["StagingClient", "WorkerStaging", "build_twin", "carry_kernel_state", "check_staging_bound"]

log = logging.getLogger(__name__)

# How often the listener looks for the sender's next start (and at its stop flag).
_POLL_S = 0.05


def _start_posted(receiver: WeightReceiver) -> bool:
    """Whether the sender has posted the start of the receiver's next update (never blocks).

    ``WeightReceiver.start_weight_update`` waits for this key itself; waiting there in short slices
    instead would make c10d log a warning at every slice that times out.
    """
    store = receiver._store
    if store is None:
        return True  # not a store-based transport: start_weight_update knows how to wait
    return bool(store.check([f"{RECEIVER_PREFIX}/start/{receiver._seq + 1}"]))


def build_twin(vllm_config: Any) -> nn.Module:
    """A second instance of the engine's model, with the live model's kernel layout and reload records.

    vLLM's loader builds it (``load_format="dummy"``: no checkpoint read) and processes it as it did the
    live model, under a shallow copy of ``vllm_config`` whose compilation config has its own
    ``static_forward_context`` (attention layers register there by name and refuse duplicates) and MoE
    layer list; the twin is never run, so nothing else of the engine's state needs to know it.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    twin_config = copy.copy(vllm_config)
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}
    compilation.static_all_moe_layers = []
    twin_config.compilation_config = compilation
    load_config = copy.copy(vllm_config.load_config)
    load_config.load_format = "dummy"
    twin_config.load_config = load_config
    loader = get_model_loader(load_config)
    with recording_model_format(twin_config) as built, set_current_vllm_config(twin_config):
        twin = loader.load_model(vllm_config=twin_config, model_config=twin_config.model_config)
    if not any(m is twin for m in built):
        raise RuntimeError(
            f"weight_sync did not see vLLM build the staging twin {type(twin).__name__}: its loader bypassed "
            "record_metadata_for_reloading, so staged updates cannot restore model format"
        )
    # The engine's real load config: the twin's first update must cover the checkpoint the live model
    # was loaded from, as the live model's must.
    prepare_loaded_model(twin, vllm_config)
    return twin


def carry_kernel_state(src: nn.Module, dst: nn.Module) -> None:
    """Install in ``dst``'s layers the attributes ``src``'s processors added that are not tensors.

    On vLLM-CPU an unquantized linear (and lm_head) keeps its weight in ``cpu_linear``, a callable that
    closes over a oneDNN handle (or an SGL-packed tensor) made by ``dispatch_cpu_unquantized_gemm``; the
    layer's ``weight`` tensor is emptied. The objects are moved, not written into: processing makes new
    ones on every update, so the model that gave them away never changes them afterwards.
    """
    src_state, dst_modules = get_state(src), dict(dst.named_modules())
    for name, info in src_state.layers.items():
        target = dst_modules.get(name)
        if target is None:
            raise ConfigError(f"staging: layer {name} of the staged model has no counterpart in the live model")
        for key, value in vars(info.module).items():
            if key in info.initial_attrs or isinstance(value, (torch.Tensor, nn.Module)):
                continue
            if _refers_to_a_module(value):
                # Moved into the other model it would keep computing with this model's layer.
                raise ConfigError(
                    f"staging: {name}.{key} ({type(value).__name__}) is bound to or closes over a module; "
                    "its kernel state cannot move between the staging twin and the live model"
                )
            target.__dict__[key] = value


def _refers_to_a_module(value: Any) -> bool:
    """Whether a callable is a bound method of a module or a closure over one (one level deep)."""
    if isinstance(getattr(value, "__self__", None), nn.Module):
        return True
    for cell in getattr(value, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, nn.Module):
                return True
        except ValueError:  # an empty cell (a variable assigned after the closure was made)
            continue
    return False


def check_staging_bound(live: nn.Module, config: StagingConfig) -> int:
    """The twin's estimated bytes; refused (before it is built) when over ``config.max_bytes``.

    The twin holds model-format tensors until processed, then kernel tensors plus the state processors
    keep outside tensors (on CPU, about the model-format bytes of every linear): the larger of the two.
    """
    # Every graph-visible tensor, as the twin counts them: vLLM's layers also keep tensors as plain
    # attributes (which ones depends on the CPU's attention backend), beyond parameters and buffers.
    estimate = max(staged_bytes(live), sum(i.model_format_bytes for i in get_state(live).layers.values()))
    if config.max_bytes is not None and estimate > config.max_bytes:
        raise ConfigError(
            f"ws_stage_init: the staging twin of {type(live).__name__} takes about {estimate} bytes, over "
            f"StagingConfig.max_bytes={config.max_bytes}"
        )
    return estimate


class WorkerStaging:
    """One worker's staging: the twin, the receiver feeding it, and the listener thread.

    Built by the worker RPC ``ws_stage_init``; the RPCs ``ws_stage_commit`` / ``ws_stage_status`` /
    ``ws_stage_close`` call :meth:`commit` / :meth:`status` / :meth:`close`.
    """

    def __init__(self, worker: Any, address: str, rank: int, *, config: StagingConfig,
                 connect_timeout_s: float = 300.0) -> None:
        self.worker = worker
        live: nn.Module = worker.get_model()
        self.live = live
        opts = WeightSyncOptions.from_vllm_config(worker.vllm_config) or WeightSyncOptions()
        self.options = opts
        self.estimate_bytes = check_staging_bound(live, config)
        live_device = next((t.device for t in live.parameters() if t.device.type != "meta"), torch.device("cpu"))

        def build(device: torch.device) -> nn.Module:
            if device != live_device:
                raise ConfigError(
                    f"ws_stage_init: a vLLM staging twin is built by vLLM's loader on the engine's device "
                    f"({live_device}); StagingConfig placement {config.placement!r} chose {device}"
                )
            return build_twin(worker.vllm_config)

        self.staged = StagedWeights(live, build, config=config, carry_state=carry_kernel_state,
                                    skip_attrs=KV_CACHE_ATTRS)
        self.receiver = WeightReceiver(
            self.staged, address, rank, rollback=opts.rollback, budget_bytes=opts.budget_bytes,
            fingerprint=False, connect_timeout_s=connect_timeout_s,
        )
        self.receiver.connect()
        self.num_staged = 0
        self.num_failed = 0
        self.last_error: str | None = None
        self.broken: str | None = None
        self._stop = threading.Event()
        # Set while the listener is inside an update (from the sender's start to the twin's commit):
        # the sender's finish returns once every rank voted, a moment before each rank's twin commits.
        self._receiving = False
        self._idle = threading.Condition()
        self._wait_s = 2 * float(self.receiver.params.timeout_s) if self.receiver.params is not None else 300.0
        self._thread = threading.Thread(target=self._listen, name=f"weight_sync-staging-{rank}", daemon=True)
        self._thread.start()
        # A listener still inside a gloo wait when the interpreter exits aborts the process.
        atexit.register(self.close)

    # ------------------------------------------------------------------ the listener thread
    def _listen(self) -> None:
        """Receive every update the sender starts into the twin, until closed or the transport breaks."""
        from vllm.config import set_current_vllm_config

        while not self._stop.is_set():
            try:
                posted = _start_posted(self.receiver)
            except Exception as e:  # the sender's store is gone: the trainer died between updates
                self._failed(e, broken=f"the sender's store is unreachable: {e}")
                return
            if not posted:
                self._stop.wait(_POLL_S)
                continue
            self._set_receiving(True)
            try:
                # Processors may read the current vLLM config (as in the worker's own reload; the
                # setting is process-wide, and the engine core's thread does not consult it to step).
                with set_current_vllm_config(self.worker.vllm_config):
                    report = self.receiver.receive_update()
            except Exception as e:  # agreed by every rank; the twin's session was aborted
                self._failed(e)
                if self.broken is not None:
                    return
                continue
            finally:
                self._set_receiving(False)
            self.num_staged += 1
            self.last_error = None
            log.info("[rank %d] staged update %r: %s", self.receiver.rank, report.version, report.summary())

    def _set_receiving(self, value: bool) -> None:
        with self._idle:
            self._receiving = value
            self._idle.notify_all()

    def wait_staged(self, version: Any) -> None:
        """Until ``version`` is staged or the listener is between updates (bounded by twice the wire
        timeout): what the sender's finish has decided, this rank's twin may still be committing."""
        with self._idle:
            self._idle.wait_for(lambda: not self._receiving or self._is_pending(version), self._wait_s)

    def _is_pending(self, version: Any) -> bool:
        pending = self.staged.pending_version
        return pending is not None and str(pending) == str(version)

    def _broken(self) -> str | None:
        channel = self.receiver._channel
        return None if channel is None else channel.broken

    def _failed(self, error: BaseException, broken: str | None = None) -> None:
        self.num_failed += 1
        self.broken = broken or self._broken()
        self.last_error = f"{type(error).__name__}: {error}"
        log.error("[rank %d] staged update failed (served weights untouched): %s", self.receiver.rank,
                  self.last_error)

    # ------------------------------------------------------------------ RPCs
    def commit(self, version: Any = None) -> dict[str, Any] | None:
        """Make the staged version live (between two steps); None when nothing is staged.

        ``version``: refuse, before any copy, unless that version is the one staged.
        """
        if version is not None:
            self.wait_staged(version)
        pending = self.staged.pending_version
        if version is not None and not self._is_pending(version):
            raise UpdateStateError(
                f"[rank {self.receiver.rank}] ws_stage_commit(version={version!r}): the staged version is "
                f"{pending!r}" + (f" (last staged update failed: {self.last_error})" if self.last_error else "")
            )
        report = self.staged.commit()
        if report is None:
            return None
        self.worker._ws_after_update()
        out: dict[str, Any] = {
            "version": report.version, "superseded": list(report.superseded), "num_tensors": report.num_tensors,
            "num_bytes": report.num_bytes, "seconds": report.seconds, "placement": report.placement,
        }
        out["fingerprint"] = kernel_fingerprint(self.live) if self.options.fingerprint else None
        staged_report = self.staged.last_report
        record_report(self.live, {**(staged_report.to_dict() if staged_report is not None else {}),
                                  "staged": True, "commit": out, "fingerprint": out["fingerprint"]})
        log.info("[rank %d] staged version %r committed: %d tensors, %.1f MB in %.2f ms",
                 self.receiver.rank, report.version, report.num_tensors, report.num_bytes / 1e6,
                 report.seconds * 1e3)
        return out

    def status(self, version: Any = None) -> dict[str, Any]:
        """What is staged, committed and in flight, the twin's memory, and the last failure; with
        ``version``, once that version is staged or the listener is between updates."""
        if version is not None:
            self.wait_staged(version)
        # Read first: once the listener has ended, every field it wrote before ending is final, so a
        # status saying "not listening" always carries the failure that ended it.
        listening = self._thread.is_alive()
        twin_state = get_state(self.staged.model)
        return {
            "pending": self.staged.pending_version,
            "committed": self.staged.committed_version,
            "staging": twin_state.active is not None,
            "num_staged": self.num_staged,
            "num_commits": self.staged.num_commits,
            "num_failed": self.num_failed,
            "last_error": self.last_error,
            "listening": listening,
            "num_bytes": self.staged.num_bytes,
            "estimate_bytes": self.estimate_bytes,
            "placement": self.staged.placement,
        }

    def close(self) -> None:
        """Stop listening (after an update in flight ends), disconnect, and let the twin go."""
        atexit.unregister(self.close)
        self._stop.set()
        self._thread.join()
        self.receiver.close()
        self.staged.close()


class StagingClient:
    """The trainer side of staged updates into one vLLM engine (see the module docstring).

    control: the engine (``LLMControl`` / ``AsyncLLMControl`` / ``HTTPControl`` / ``RayControl``).
    transport: the data plane (default gloo). num_workers: the engine's workers (TP * PP * DP).
    staging: where each worker's twin lives and its bound. rpc_timeout_s: bound on ``connect``'s RPC.
    """

    def __init__(self, control: EngineControl, transport: TransportConfig | None = None, *,
                 num_workers: int = 1, staging: StagingConfig | None = None,
                 rpc_timeout_s: float | None = None) -> None:
        self.control = control
        self.transport = transport if transport is not None else TransportConfig(backend="gloo")
        if self.transport.backend == "disk":
            raise ConfigError("StagingClient: transport 'disk' has no listener; use gloo, shm, nccl or ipc")
        self.num_workers = num_workers
        self.staging = staging if staging is not None else StagingConfig()
        self.rpc_timeout_s = rpc_timeout_s if rpc_timeout_s is not None else 2 * self.transport.timeout_s
        self.sender: WeightSender | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-staging-rpc")

    def connect(self) -> list[dict[str, Any]]:
        """Create the sender; every worker builds its twin and listens (``ws_stage_init``). Returns the
        workers' staging status (``num_bytes``: the twin's memory)."""
        if self.sender is not None:
            self.close_staging()
        self.sender = WeightSender(self.transport, num_receivers=self.num_workers)
        s = self.staging
        kwargs = {"address": self.sender.address, "rank_offset": 1, "placement": s.placement,
                  "device_budget_bytes": s.device_budget_bytes, "max_bytes": s.max_bytes, "pin_host": s.pin_host}
        answers: list[dict[str, Any]] = []
        run_phase(self._pool, self.rpc_timeout_s, "ws_stage_init",
                  lambda: answers.extend(self.control.collective_rpc("ws_stage_init", kwargs)), self.sender.connect)
        return answers

    def _sender(self) -> WeightSender:
        if self.sender is None:
            raise TransportError("StagingClient: call connect() before pushing weights")
        return self.sender

    def push(self, weights: Any, *, version: int | str, snapshot: bool = False) -> PushHandle[Any]:
        """Start staging ``weights`` (pairs, a mapping, or a source with ``manifest(version)``) on every
        worker; returns at once. ``handle.wait()``: the TransferReport once every worker staged it."""
        if version is None:
            raise ConfigError("StagingClient.push needs a version: commit(version=...) names what goes live")
        manifest, tensors = _manifest_and_tensors(weights, version)
        return push(self._sender(), tensors, manifest, version, snapshot=snapshot)

    def status(self, version: int | str | None = None) -> list[dict[str, Any]]:
        """Every worker's ``ws_stage_status()`` (with ``version``: once that version is staged there or
        its listener is between updates)."""
        return self.control.collective_rpc("ws_stage_status", None if version is None else {"version": version})

    def commit(self, version: int | str | None = None) -> list[dict[str, Any] | None]:
        """Make the staged version live on every worker between two engine steps.

        ``version``: the version pushed (default: whatever every worker has staged). Refused before any
        copy unless every worker holds the same staged version; returns each worker's commit report
        (``seconds``: how long that worker's copy paused the engine), or Nones when nothing was staged.
        """
        pending = {str(s["pending"]) if s["pending"] is not None else None for s in self.status(version)}
        if len(pending) != 1 or (version is not None and pending != {str(version)}):
            raise UpdateStateError(
                f"StagingClient.commit(version={version!r}): the workers hold staged versions {sorted(map(str, pending))}"
                " (None: nothing staged); wait() for the push first"
            )
        want = next(iter(pending)) if version is None else str(version)
        if want is None:
            return [None] * self.num_workers
        return self.control.collective_rpc("ws_stage_commit", {"version": want})

    def close_staging(self) -> None:
        """Stop the workers' listeners and drop their twins; close the sender."""
        if self.sender is None:
            return
        try:
            self.control.collective_rpc("ws_stage_close")
        finally:
            self.sender.close()
            self.sender = None

    def close(self) -> None:
        self.close_staging()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StagingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
