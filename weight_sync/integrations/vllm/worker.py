"""The worker half of the integration: a mixin for vLLM's worker classes.

vLLM calls worker methods by name through ``collective_rpc``; the mixin overrides ``reload_weights`` and
``load_model`` and adds ``ws_*`` methods (vLLM forbids extension methods whose names exist on the worker,
so the names are new). Concrete classes for each platform live in ``worker_cpu`` / ``worker_gpu`` so that
importing one never imports the other platform's worker.

RPCs (all return JSON-able values):
- ``reload_weights(weights_path=..., weights_iterator=..., version=..., rollback=..., budget_bytes=...,
  fingerprint=...)``: a weight_sync update of vLLM's model; returns the update report as a dict.
- ``ws_fingerprint(draft=False)``: :func:`~weight_sync.integrations.vllm.model_hooks.kernel_fingerprint` of
  the model (of the speculative draft model with ``draft=True``).
- ``ws_last_report(draft=False)``: the report of the model's (drafter's) last successful update, or None.
- ``ws_status()``: ``{"torn": reason | None, "version": ..., "updating": bool}``, plus ``"draft"``
  (the same for the draft model) in engines with one.
- ``ws_stage_init(address=..., ...)`` / ``ws_stage_commit(version=...)`` / ``ws_stage_status()`` /
  ``ws_stage_close()``: updates staged while the engine generates, committed between two steps
  (:mod:`~weight_sync.integrations.vllm.staging`).
- ``ws_sharded_connect(address=..., engine_rank_offset=...)`` / ``ws_sharded_update()`` /
  ``ws_sharded_close()``: this worker as one engine rank of the sharded data plane, receiving only its
  shard (:mod:`~weight_sync.integrations.vllm.sharded`).

``start_draft_weight_update`` is vLLM's: the worker retargets the weight-transfer backend at the draft
model for one session, which weight_sync validates, writes, commits and reports like any other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

import weight_sync
from weight_sync.errors import ConfigError, UpdateStateError
from weight_sync.integrations.vllm.handoff import as_handle, open_handoff
from weight_sync.integrations.vllm.model_hooks import (
    kernel_fingerprint,
    last_report,
    prepare_loaded_model,
    record_report,
    recording_model_format,
)
from weight_sync.integrations.vllm.options import WeightSyncOptions
from weight_sync.manifest import Manifest
from weight_sync.reload import torn_reason
from weight_sync.reload.state import get_state

__all__ = ["WeightSyncWorkerMixin"]

log = logging.getLogger(__name__)


def _answers_every_rank(method: Callable[..., Any]) -> Callable[..., Any]:
    """In an engine of several workers, a failure is returned as ``{RPC_ERROR_KEY: text}`` and raised by
    the engine core once every worker has answered (engine_hooks); vLLM 0.32's multiprocess executor
    would otherwise leave the other workers' answers queued behind the first failure, and every later
    RPC of the engine would read the answer of the one before it."""

    @functools.wraps(method)
    def rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.vllm_config.parallel_config.world_size <= 1:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            from weight_sync.integrations.vllm.engine_hooks import RPC_ERROR_KEY

            log.error("[rank %d] %s failed: %s: %s", self.rank, method.__name__, type(e).__name__, e)
            return {RPC_ERROR_KEY: f"{type(e).__name__}: {e}"}

    return rpc


class WeightSyncWorkerMixin:
    """Mixed in front of a vLLM worker class (``class W(WeightSyncWorkerMixin, CPUWorker)``)."""

    vllm_config: Any
    model_config: Any
    model_runner: Any
    speculative_config: Any
    rank: int
    _ws_staging: Any  # the WorkerStaging of ws_stage_init, or None

    # ------------------------------------------------------------------ setup
    @property
    def ws_options(self) -> WeightSyncOptions:
        opts = WeightSyncOptions.from_vllm_config(self.vllm_config)
        return opts if opts is not None else WeightSyncOptions()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from weight_sync.integrations.vllm.cpu_fp8 import request_amx_tile_state

            # Before any forward: vLLM's AMX fp8 kernels need the process's tile state (see there).
            request_amx_tile_state()
        if self.ws_options.cpu_fp8_fallback:
            from weight_sync.integrations.vllm.cpu_fp8 import install_cpu_fp8_fallback

            install_cpu_fp8_fallback()
        # vLLM creates the weight-transfer backend inside load_model; make sure ours is registered in
        # this process even where the plugin entry point is disabled.
        from weight_sync.integrations.vllm.transfer import register_transfer_backend

        register_transfer_backend()
        with recording_model_format(self.vllm_config) as built:
            super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self.get_model()  # type: ignore[attr-defined]
        if not any(m is model for m in built):
            raise RuntimeError(
                f"[rank {self.rank}] weight_sync did not see vLLM build {type(model).__name__}: the model "
                "loader bypassed record_metadata_for_reloading, so reloads cannot restore model format"
            )
        prepare_loaded_model(model, self.vllm_config)
        draft = self._ws_draft_model()
        if draft is not None:
            # The drafter (speculative decoding's draft model) is built inside the same load_model, so it
            # is recorded at construction like the target; vLLM's start_draft_weight_update then updates
            # it through the same lifecycle.
            if not any(m is draft for m in built):
                raise RuntimeError(
                    f"[rank {self.rank}] weight_sync did not see vLLM build the draft model "
                    f"{type(draft).__name__}: its loader bypassed record_metadata_for_reloading, so draft "
                    "weight updates cannot restore model format"
                )
            prepare_loaded_model(draft, self.vllm_config, dtype=self.speculative_config.draft_model_config.dtype,
                                 model_config=self.speculative_config.draft_model_config)

    def _ws_draft_model(self) -> nn.Module | None:
        """The speculative draft model, or None when the engine has none (vLLM's ``get_draft_model``)."""
        spec = getattr(self, "speculative_config", None)
        if spec is None or getattr(spec, "draft_model_config", None) is None:
            return None
        get_draft_model = getattr(self.model_runner, "get_draft_model", None)
        return get_draft_model() if callable(get_draft_model) else None

    def _ws_model(self, rpc: str, draft: bool) -> nn.Module:
        """The model an inspection RPC names: the target model, or the draft model with ``draft=True``."""
        if not draft:
            return self.get_model()  # type: ignore[attr-defined]
        model = self._ws_draft_model()
        if model is None:
            raise ConfigError(
                f"{rpc}(draft=True): the engine has no draft model (speculative_config with a draft model, "
                "e.g. method 'draft_model' or 'eagle'); got no drafter on this worker"
            )
        return model

    # ------------------------------------------------------------------ vLLM's RL API
    @_answers_every_rank
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        super().init_weight_transfer_engine(init_info)  # type: ignore[misc]

    @_answers_every_rank
    def start_weight_update(self) -> None:
        super().start_weight_update()  # type: ignore[misc]

    @_answers_every_rank
    def start_draft_weight_update(self) -> None:
        super().start_draft_weight_update()  # type: ignore[misc]

    @_answers_every_rank
    def update_weights(self, update_info: dict | list[dict]) -> None:
        super().update_weights(update_info)  # type: ignore[misc]

    @_answers_every_rank
    def finish_weight_update(self) -> None:
        """vLLM's ``finish_weight_update``; a failed one also ends vLLM's session.

        vLLM 0.32 ends its session (``_weight_update_active``) when ``start_weight_update`` or
        ``update_weights`` raises, but not when ``finish_weight_update`` does: its worker would then refuse
        every later start as "already active" although weight_sync's session is over (every rank raised
        the agreed error and aborted it, or the receiver aborts it in ``reset_weight_update_target``).
        """
        try:
            super().finish_weight_update()  # type: ignore[misc]
        except BaseException:
            if getattr(self, "_weight_update_active", False):
                self._weight_update_active = False
                engine = getattr(self, "weight_transfer_engine", None)
                if engine is not None:
                    engine.reset_weight_update_target()
            raise

    # ------------------------------------------------------------------ reload
    @_answers_every_rank
    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | dict[str, str] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
        *,
        version: int | str | None = None,
        rollback: bool | None = None,
        budget_bytes: int | None = None,
        fingerprint: bool | None = None,
    ) -> dict[str, Any] | None:
        """Update the model's weights through weight_sync; returns the update report as a dict.

        Sources: ``weights_path`` (what vLLM's default loader reads locally: a directory or file of
        safetensors, or of ``pytorch_model*.bin`` / ``*.pt`` read with ``torch.load(weights_only=True)``,
        or a hub id found in the local Hugging Face cache; validated before any write), ``weights_iterator`` (a list of (name, tensor), a lazy iterable, or a handle
        from :func:`~weight_sync.integrations.vllm.handoff.share_weights`), or neither (the checkpoint the
        engine was last loaded from). ``is_checkpoint_format=False`` (already-processed kernel tensors) is
        vLLM's own in-place copy and is passed through to it.
        """
        if not is_checkpoint_format:
            super().reload_weights(  # type: ignore[misc]
                weights_iterator=weights_iterator, weights_path=weights_path, is_checkpoint_format=False
            )
            return None
        if weights_iterator is not None and weights_path is not None:
            raise ConfigError("reload_weights takes weights_iterator or weights_path, not both")
        opts = self.ws_options
        update_opts: dict[str, Any] = {
            "version": version,
            "rollback": opts.rollback if rollback is None else rollback,
            "budget_bytes": opts.budget_bytes if budget_bytes is None else budget_bytes,
            # The reload package's own fingerprint would hash KV caches; ours skips them (below).
            "fingerprint": False,
        }
        model: nn.Module = self.get_model()  # type: ignore[attr-defined]
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            if weights_iterator is None:
                path = _local_checkpoint(self.model_config, weights_path)
                report = weight_sync.reload_weights(model, weights_path=path, **update_opts)
            elif as_handle(weights_iterator) is not None:
                reader = open_handoff(weights_iterator)
                report = weight_sync.reload_weights(
                    model, weights_iterator=reader, manifest=reader.manifest, **update_opts
                )
            elif isinstance(weights_iterator, (list, tuple)):
                # Everything is known up front: announce it, so the update is validated before any write.
                manifest = self._ws_list_manifest(weights_iterator, version)
                report = weight_sync.reload_weights(
                    model, weights_iterator=weights_iterator, manifest=manifest, **update_opts
                )
            else:
                stream = cast(Iterable[tuple[str, torch.Tensor]], weights_iterator)
                report = weight_sync.reload_weights(model, weights_iterator=stream, **update_opts)
        if weights_path is not None:
            # vLLM's convention: a later argument-less reload reads the checkpoint loaded last. The
            # revision and any object-storage ``model_weights`` source belong to the model reloaded
            # away from, so vLLM clears them (a stale revision would resolve the new id in the wrong
            # snapshot of the cache).
            self.model_config.model = str(weights_path)
            if hasattr(self.model_config, "model_weights"):
                self.model_config.model_weights = ""
            self.model_config.revision = None
        self._ws_after_update()
        out = report.to_dict()
        want_fp = opts.fingerprint if fingerprint is None else fingerprint
        out["fingerprint"] = kernel_fingerprint(model) if want_fp else None
        record_report(model, out)
        log.info("[rank %d] weight_sync reload: %s", self.rank, report.summary())
        return out

    def _ws_list_manifest(self, items: list | tuple, version: int | str | None) -> Manifest:
        """The manifest of a list of (name, tensor); the previous one when names, dtypes and shapes repeat.

        Reusing the object (not only equal contents) lets the session reuse its validation verdict at
        the cost of one comparison.
        """
        key = tuple((name, t.dtype, t.shape) for name, t in items)
        cached: tuple[tuple, Manifest] | None = getattr(self, "_ws_manifest", None)
        if cached is not None and cached[0] == key:
            manifest = cached[1]
            return manifest if manifest.version == version else manifest.with_version(version)
        manifest = Manifest.from_named_tensors(items, version=version)
        self._ws_manifest = (key, manifest)
        return manifest

    def _ws_after_update(self) -> None:
        """Drop worker-side state derived from the old weights (vLLM's own reload does the same)."""
        runner = self.model_runner
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, name, None)
            if callable(fn):
                fn()

    # ------------------------------------------------------------------ staging (integrations/vllm/staging.py)
    @_answers_every_rank
    def ws_stage_init(self, address: str, rank_offset: int = 1, connect_timeout_s: float = 300.0,
                      **staging: Any) -> dict[str, Any]:
        """Build this worker's staging twin and listen for the sender at ``address`` on a thread of its
        own; ``staging``: the fields of :class:`~weight_sync.reload.staged.StagingConfig`."""
        from weight_sync.integrations.vllm.staging import WorkerStaging, check_staging_bound
        from weight_sync.reload.staged import StagingConfig

        config = StagingConfig(**staging)
        check_staging_bound(self.get_model(), config)  # type: ignore[attr-defined]  # before the old twin goes
        self.ws_stage_close()
        pc = self.vllm_config.parallel_config
        rank = rank_offset + pc.data_parallel_index * pc.world_size + self.rank
        self._ws_staging = WorkerStaging(self, address, rank, config=config, connect_timeout_s=connect_timeout_s)
        return self._ws_staging.status()

    def _ws_stage(self, rpc: str) -> Any:
        staging = getattr(self, "_ws_staging", None)
        if staging is None:
            raise UpdateStateError(f"{rpc}: staging is not set up on this worker; call ws_stage_init first")
        return staging

    @_answers_every_rank
    def ws_stage_commit(self, version: int | str | None = None) -> dict[str, Any] | None:
        """Make the staged version live (the engine core calls it between two steps); None if none."""
        return self._ws_stage("ws_stage_commit").commit(version)

    @_answers_every_rank
    def ws_stage_status(self, version: int | str | None = None) -> dict[str, Any]:
        """The worker's staging state (``WorkerStaging.status``)."""
        return self._ws_stage("ws_stage_status").status(version)

    @_answers_every_rank
    def ws_stage_close(self) -> None:
        """Stop this worker's staging listener and drop its twin (a no-op without one)."""
        staging = getattr(self, "_ws_staging", None)
        self._ws_staging = None
        if staging is not None:
            staging.close()

    # ------------------------------------------------------------------ extension RPCs
    def ws_fingerprint(self, draft: bool = False) -> str:
        """Fingerprint of the model's kernel tensors (KV caches excluded); the drafter's with ``draft``."""
        return kernel_fingerprint(self._ws_model("ws_fingerprint", draft))

    def ws_last_report(self, draft: bool = False) -> dict[str, Any] | None:
        """The report of the model's last committed weight_sync update on this worker, or None; the
        drafter's with ``draft``."""
        return last_report(self._ws_model("ws_last_report", draft))

    def ws_status(self) -> dict[str, Any]:
        """Whether the engine is torn (and why), the model's weight version, whether an update is open.

        With a draft model, ``"draft"`` holds the same three fields for it, and a torn drafter makes the
        engine torn: its proposals would come from a mix of versions.
        """
        model = self.get_model()  # type: ignore[attr-defined]
        status = _model_status(model)
        draft = self._ws_draft_model()
        if draft is not None:
            draft_status = _model_status(draft)
            status["draft"] = draft_status
            if status["torn"] is None and draft_status["torn"] is not None:
                status["torn"] = f"draft model: {draft_status['torn']}"
            status["updating"] = status["updating"] or draft_status["updating"]
        return status

    # ------------------------------------------------------------------ sharded plane (integrations/vllm/sharded.py)
    @_answers_every_rank
    def ws_sharded_connect(self, address: str, engine_rank_offset: int = 0, connect_timeout_s: float = 300.0,
                           rollback: bool | None = None) -> dict[str, Any]:
        """Join the trainer ranks' sharded transport as engine rank ``engine_rank_offset`` + this worker's."""
        from weight_sync.integrations.vllm.sharded import connect_worker

        return connect_worker(self, address, engine_rank_offset, connect_timeout_s, rollback)

    @_answers_every_rank
    def ws_sharded_update(self, timeout_s: float | None = None) -> dict[str, Any]:
        """One whole sharded update (start, this worker's regions, commit on every engine rank or none)."""
        from weight_sync.integrations.vllm.sharded import receive_on_worker

        return receive_on_worker(self, timeout_s)

    @_answers_every_rank
    def ws_sharded_close(self) -> None:
        from weight_sync.integrations.vllm.sharded import close_worker

        close_worker(self)


def _model_status(model: nn.Module) -> dict[str, Any]:
    state = get_state(model)
    return {"torn": torn_reason(model), "version": state.version, "updating": state.active is not None}


def _local_checkpoint(model_config: Any, weights_path: str | None) -> str:
    """The local checkpoint a path reload reads: ``weights_path``, else the model the engine serves.

    As vLLM's default loader, a hub id is looked up in the local Hugging Face cache (at the engine's
    revision when reloading the served model; a new ``weights_path`` has no revision, vLLM clears it),
    and nothing is downloaded inside a worker.
    """
    from weight_sync.checkpoints import resolve_checkpoint
    from weight_sync.errors import WeightSyncError

    name = weights_path if weights_path is not None else model_config.model
    revision = None if weights_path is not None else getattr(model_config, "revision", None)
    try:
        return str(resolve_checkpoint(name, revision=revision))
    except WeightSyncError as e:
        raise ConfigError(f"reload_weights(weights_path={name!r}): {e}") from e
