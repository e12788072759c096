"""Engine-level guarantees that workers cannot give: cache invalidation, no serving of torn weights.

Workers own the weights; the engine core owns the scheduler and its prefix cache, and the client owns the
call arguments. Three small wrappers, installed once per process by the plugin (and by
:func:`~weight_sync.integrations.vllm.engine_args.engine_kwargs`), act only on engines whose
``additional_config`` carries weight_sync options; every other engine passes straight through.

``EngineCore.collective_rpc``
    When the user has not paused the engine (``pause_generation``), weight_sync keeps every token computed
    with one version on its own: between ``start_weight_update`` and ``finish_weight_update`` the
    scheduler is held (nothing steps on half-written weights; queued requests wait); after a successful
    ``reload_weights`` / ``finish_weight_update`` the prefix cache is reset (running requests are
    preempted, so their KV is recomputed with the new weights), the encoder cache too, and the engine's
    weight version becomes the committed update's version (when it has one) before the next step, so
    ``weight_versions`` spans name the weights that sampled each token. A staged update's commit
    (``ws_stage_commit``, integrations/vllm/staging.py) is such a commit and needs no hold: the RPC
    itself runs between two steps (one that found nothing staged changes nothing), and it relabels the
    engine's version even under a user's pause (no vLLM call carries its label). When the user paused, vLLM's
    pause owns all of that: no hold, no cache reset, no relabel - the mode and ``clear_cache`` of
    ``pause_generation`` decide, exactly as on plain vLLM. After a failed update either way: ask the
    workers whether the model is torn; if so, abort in-flight (also kept) requests and refuse new ones
    until a complete update succeeds.
``EngineCore.pause_scheduler`` / ``resume_scheduler`` (and the overrides of its subclasses)
    A pause or resume that arrives during weight_sync's hold is what the scheduler returns to when the
    hold ends; until the commit nothing steps (a ``wait`` pause's in-flight requests therefore finish
    after the commit, on the new weights: the old ones are being overwritten), and the commit then
    follows the user's pause (no cache reset, no relabel).
``EngineCore.preprocess_add_request``
    Refuses requests (naming the failed update) while the engine is torn: in a multiprocess engine each
    refused request finishes with an error.
``LLMEngine.add_request``
    The same refusal for an in-process engine core, raised before the request is registered with the
    output processor (a refusal after it would leave the request pending forever in ``LLM.generate``).
``SyncMPClient.collective_rpc`` / ``AsyncMPClient.collective_rpc_async``
    A ``reload_weights`` call whose ``weights_iterator`` is tensors is spooled through
    :mod:`~weight_sync.integrations.vllm.handoff`, so it reaches worker processes without pickle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from weight_sync.errors import TornModelError
from weight_sync.integrations.vllm.handoff import as_handle, share_weights
from weight_sync.integrations.vllm.options import WeightSyncOptions

__all__ = ["install_engine_hooks"]

log = logging.getLogger(__name__)

# ws_sharded_update is a whole update in one RPC (integrations/vllm/sharded.py): a commit, no hold needed.
_COMMITS = frozenset({"reload_weights", "finish_weight_update", "ws_stage_commit", "ws_sharded_update"})
_SESSION_STEPS = frozenset({"start_weight_update", "start_draft_weight_update", "update_weights"})
_INSTALLED = False
# A worker of a multi-worker engine returns {RPC_ERROR_KEY: text} instead of raising (see worker.py):
# vLLM 0.32's MultiprocExecutor.collective_rpc raises at the first failed worker's response and leaves
# the other workers' responses in their queues, so every later RPC would read a stale answer.
RPC_ERROR_KEY = "__weight_sync_rpc_error__"


def _rpc_error(result: Any) -> str | None:
    if isinstance(result, list):
        for r in result:
            if isinstance(r, dict) and RPC_ERROR_KEY in r:
                return str(r[RPC_ERROR_KEY])
    return None


def _options(vllm_config: Any) -> WeightSyncOptions | None:
    try:
        return WeightSyncOptions.from_vllm_config(vllm_config)
    except Exception:  # a malformed config is reported by the worker, which parses it strictly
        return None


def install_engine_hooks() -> None:
    """Wrap the engine core and the multiprocess clients of this process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine

    EngineCore.collective_rpc = _wrap_core_rpc(EngineCore.collective_rpc)  # type: ignore[method-assign]
    from vllm.v1.engine import core as core_module

    for cls in vars(core_module).values():
        if isinstance(cls, type) and issubclass(cls, EngineCore):
            # Each class that defines its own pause / resume (EngineCoreProc, DPEngineCoreProc) is wrapped.
            if "pause_scheduler" in vars(cls):
                cls.pause_scheduler = _wrap_pause_call(cls.pause_scheduler)  # type: ignore[attr-defined]
            if "resume_scheduler" in vars(cls):
                cls.resume_scheduler = _wrap_pause_call(cls.resume_scheduler)  # type: ignore[attr-defined]
    EngineCore.preprocess_add_request = _wrap_add_request(  # type: ignore[method-assign]
        EngineCore.preprocess_add_request
    )
    LLMEngine.add_request = _wrap_llm_engine_add(LLMEngine.add_request)  # type: ignore[method-assign]
    SyncMPClient.collective_rpc = _wrap_sync_client(SyncMPClient.collective_rpc)  # type: ignore[method-assign]
    AsyncMPClient.collective_rpc_async = _wrap_async_client(  # type: ignore[method-assign]
        AsyncMPClient.collective_rpc_async
    )
    _INSTALLED = True


# ---------------------------------------------------------------------- engine core
def _wrap_core_rpc(original: Any) -> Any:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        if not isinstance(method, str) or _options(self.vllm_config) is None:
            return original(self, method, timeout, args, kwargs)
        if method in ("start_weight_update", "start_draft_weight_update"):
            _hold(self)
            self._ws_draft_session = method == "start_draft_weight_update"
        try:
            result = original(self, method, timeout, args, kwargs)
            error = _rpc_error(result)
            if error is not None:
                # Every worker answered, so the executor's queues are in step; raise as vLLM does.
                raise RuntimeError(f"Worker failed with error '{error}', please check the stack trace above "
                                   "for the root cause")
        except BaseException:
            if method in _COMMITS or method in _SESSION_STEPS:
                _after_failure(self, original, method)
            raise
        if method in _COMMITS:
            _after_commit(self, original, method, result)
        return result

    return collective_rpc


def _hold(core: Any) -> None:
    """Stop stepping until the session ends, whatever the user's pause state (restored at release).

    Under a user's pause this changes nothing the user can see (nothing runs: abort and wait drained the
    engine, keep froze it) except that a ``resume_generation`` during the session waits for its end.
    """
    from vllm.v1.core.sched.interface import PauseState

    if getattr(core, "_ws_held", False):
        return
    core._ws_after_hold = core.scheduler.pause_state
    core._ws_held = True
    core.scheduler.set_pause_state(PauseState.PAUSED_ALL)


def _release(core: Any) -> None:
    from vllm.v1.core.sched.interface import PauseState

    if getattr(core, "_ws_held", False):
        core._ws_held = False
        core.scheduler.set_pause_state(getattr(core, "_ws_after_hold", PauseState.UNPAUSED))


def _paused_by_user(core: Any) -> bool:
    """Whether ``pause_generation`` (any mode) paused the scheduler, before or during weight_sync's hold."""
    from vllm.v1.core.sched.interface import PauseState

    if getattr(core, "_ws_held", False):
        return bool(getattr(core, "_ws_after_hold", PauseState.UNPAUSED) != PauseState.UNPAUSED)
    return bool(core.scheduler.pause_state != PauseState.UNPAUSED)


def _keep_holding(core: Any) -> None:
    """After the user's pause or resume ran during the hold: remember its state, restore the hold."""
    from vllm.v1.core.sched.interface import PauseState

    core._ws_after_hold = core.scheduler.pause_state
    core.scheduler.set_pause_state(PauseState.PAUSED_ALL)


def _wrap_pause_call(original: Any) -> Any:
    """``pause_scheduler`` / ``resume_scheduler``: during the hold, the state the call set is kept for later."""

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Overrides call their base's method (DPEngineCoreProc.resume_scheduler), which is wrapped too:
        # only the outermost call may read the state the user asked for.
        outer = not getattr(self, "_ws_in_pause_call", False)
        self._ws_in_pause_call = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            if outer:
                self._ws_in_pause_call = False
        if outer and getattr(self, "_ws_held", False):
            _keep_holding(self)
        return result

    return call


def _after_commit(core: Any, rpc: Any, method: str, result: Any) -> None:
    if method == "ws_stage_commit" and not any(isinstance(r, dict) for r in (result or [])):
        return  # nothing was staged: the weights did not change
    core._ws_torn = None
    draft = method == "finish_weight_update" and getattr(core, "_ws_draft_session", False)
    core._ws_draft_session = False
    if _paused_by_user(core):
        # vLLM's documented pause semantics: abort / wait left nothing running, keep froze the running
        # requests with their KV, and clear_cache=True already cleared the caches when the pause
        # completed. Resetting here would preempt kept requests that the user asked to continue.
        if method == "ws_stage_commit":
            # No vLLM call carries a staged commit's label (as finish_weight_update(weight_version=...)
            # does for the RL API): the version the user committed is it.
            _relabel(core, rpc, method, result)
        _release(core)  # a pause that came during the hold: its state, not UNPAUSED
        return
    # Blocks cached under the old weights must never be hit again; requests already running are
    # preempted and recomputed so their KV does not mix versions either.
    if not core.scheduler.reset_prefix_cache(reset_running_requests=True):
        log.warning("weight_sync: the prefix cache could not be reset after a weight update")
    core.scheduler.reset_encoder_cache()
    if not draft:
        # AsyncLLM.finish_weight_update(weight_version=...) sets the label in a later engine-core call;
        # the scheduler may step in between, and those tokens would carry the old label.
        _relabel(core, rpc, method, result)
    _release(core)


def _relabel(core: Any, rpc: Any, method: str, result: Any) -> None:
    version = _committed_version(core, rpc, method, result)
    if version is not None:
        core._weight_version = version


def _committed_version(core: Any, rpc: Any, method: str, result: Any) -> str | None:
    """The version the workers committed, as vLLM labels versions (a string); None if none was given."""
    if method in ("reload_weights", "ws_stage_commit"):
        answers = result if isinstance(result, list) else [result]
    else:
        try:
            answers = rpc(core, "ws_status", None, (), None)
        except Exception as e:  # the commit succeeded; only the label is unknown
            log.warning("weight_sync: the committed version could not be read (%s)", e)
            return None
    versions = {a.get("version") for a in answers if isinstance(a, dict)} - {None}
    return str(versions.pop()) if len(versions) == 1 else None


def _after_failure(core: Any, rpc: Any, method: str) -> None:
    try:
        states = rpc(core, "ws_status", None, (), None)
        if _rpc_error(states) is not None:
            raise RuntimeError(_rpc_error(states))
    except Exception as e:  # the workers cannot say: assume the worst
        states = [{"torn": f"{method} failed and the workers' state is unknown ({e})"}]
    torn = next((s["torn"] for s in states if isinstance(s, dict) and s.get("torn")), None)
    if torn is None:
        # Nothing was written (rejected before the first write) or it was rolled back: the previous
        # weights are intact and the failed session is over, so serving resumes on them.
        _release(core)
        return
    core._ws_torn = torn
    from vllm.v1.request import RequestStatus

    aborted = core.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    send = getattr(core, "_send_abort_outputs", None)
    if aborted and callable(send):
        send(aborted)
    core.scheduler.reset_prefix_cache(reset_running_requests=True)
    _release(core)
    log.error("weight_sync: the model is torn (%s); refusing requests until a complete update", torn)


def _refuse_if_torn(core: Any, request_id: Any) -> None:
    torn = getattr(core, "_ws_torn", None)
    if torn:
        raise TornModelError(
            f"request {request_id} refused: {torn}; the engine serves again after a complete weight "
            "update succeeds"
        )


def _wrap_add_request(original: Any) -> Any:
    @functools.wraps(original)
    def preprocess_add_request(self: Any, request: Any) -> Any:
        _refuse_if_torn(self, request.request_id)
        return original(self, request)

    return preprocess_add_request


def _wrap_llm_engine_add(original: Any) -> Any:
    @functools.wraps(original)
    def add_request(self: Any, request_id: Any, *args: Any, **kwargs: Any) -> Any:
        # Only an in-process client holds the engine core itself; multiprocess engines refuse in
        # preprocess_add_request, which reports the refusal through the request's output.
        core = getattr(getattr(self, "engine_core", None), "engine_core", None)
        if core is not None:
            _refuse_if_torn(core, request_id)
        return original(self, request_id, *args, **kwargs)

    return add_request


# ---------------------------------------------------------------------- clients
def _needs_spool(client: Any, method: Any, kwargs: dict[str, Any] | None) -> WeightSyncOptions | None:
    if method != "reload_weights" or not kwargs or kwargs.get("weights_iterator") is None:
        return None
    if as_handle(kwargs["weights_iterator"]) is not None:
        return None
    return _options(client.vllm_config)


def _wrap_sync_client(original: Any) -> Any:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        opts = _needs_spool(self, method, kwargs)
        if opts is None:
            return original(self, method, timeout, args, kwargs)
        assert kwargs is not None
        with share_weights(kwargs["weights_iterator"], directory=opts.handoff_dir) as spool:
            return original(self, method, timeout, args, {**kwargs, "weights_iterator": spool.handle})

    return collective_rpc


def _wrap_async_client(original: Any) -> Any:
    @functools.wraps(original)
    async def collective_rpc_async(self: Any, method: Any, timeout: float | None = None,
                                   args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        opts = _needs_spool(self, method, kwargs)
        if opts is None:
            return await original(self, method, timeout, args, kwargs)
        assert kwargs is not None
        # Spooling is file I/O; keep the event loop (and the requests it serves) responsive meanwhile.
        spool = await asyncio.to_thread(
            share_weights, kwargs["weights_iterator"], directory=opts.handoff_dir
        )
        with spool:
            return await original(self, method, timeout, args, {**kwargs, "weights_iterator": spool.handle})

    return collective_rpc_async
